"""x1.2 and x1.4 of the CNN frontier from recorded curves, as evaluated (the benchmark's measure:
a run reaches a target at its first evaluation at or below it) and with each run's crossing
interpolated linearly in time between its two evaluations around the target: an estimate of what
a finer evaluation grid would read. Nothing is trained again.

Usage: python3 interpolate.py FOLDER REFS [FOLDER REFS ...], REFS a JSON object of per-seed
reference errors ('{}': each seed's Traditional-10 run in FOLDER's curves.csv).
"""

from __future__ import annotations

import collections
import csv
import json
import sys
from pathlib import Path

CONTROLS = ("traditional", "random_0.33")


def curves(folder: Path) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """(seed, run) -> [(training seconds, test error)] in the order evaluated."""
    out: dict[tuple[int, str], list[tuple[float, float]]] = collections.defaultdict(list)
    with open(folder / "curves.csv") as f:
        for r in csv.DictReader(f):
            out[int(r["seed"]), r["strategy"]].append((float(r["time_s"]), float(r["error"])))
    return out


def family(run: str) -> str:
    """The run's family: its name without a budget suffix ``_eN``."""
    head, _, tail = run.rpartition("_e")
    return head if head and tail.isdigit() else run


def reached(curve: list[tuple[float, float]], target: float, interpolate: bool) -> float | None:
    """The time the curve first reaches ``target`` (None: never)."""
    prev = None
    for t, e in curve:
        if e <= target + 1e-12:
            if interpolate and prev is not None and prev[1] > target:
                t0, e0 = prev
                return t0 + (t - t0) * (e0 - target) / (e0 - e)
            return t
        prev = (t, e)
    return None


def best(runs, seed: int, target: float, interpolate: bool, control: bool):
    """The earliest (time, run) of the controls' (or sbloader's) runs of ``seed``."""
    hits = [
        (t, run)
        for (s, run), curve in runs.items()
        if s == seed and (family(run) in CONTROLS) == control
        if (t := reached(curve, target, interpolate)) is not None
    ]
    return min(hits) if hits else None


def main(argv: list[str]) -> None:
    for folder, refs in zip(argv[0::2], argv[1::2]):
        runs, given = curves(Path(folder)), json.loads(refs)
        for seed in sorted({s for s, _ in runs}):
            ref = given.get(str(seed), runs.get((seed, "traditional"), [(0.0, None)])[-1][1])
            print(f"{folder} seed {seed} (reference {100 * ref:.2f}%)")
            for m in (1.2, 1.4):
                cells = []
                for interpolate in (False, True):
                    c = best(runs, seed, ref * m, interpolate, control=True)
                    s = best(runs, seed, ref * m, interpolate, control=False)
                    cells.append(
                        f"{c[0] / s[0]:.2f}x ({c[1]} {c[0]:.1f} s / {s[1]} {s[0]:.1f} s)"
                        if c and s
                        else "n/a"
                    )
                print(f"  x{m}: evaluated {cells[0]}; interpolated {cells[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
