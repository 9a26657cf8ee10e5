"""The screen's table from the sittings' ``curves.csv`` (``analyse.py DIR [DIR ...]``): per
seed, each recipe family's final errors and its frontier time (the first evaluation at or below
the target, :func:`benchmarks.core.frontier.first_time`; the family's two budgets, 10 and 15
epochs, the sooner) at Traditional-10's final error x k, by position and by backprops."""

import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

from benchmarks.core.frontier import first_time

TARGETS = (1.0, 1.05, 1.1, 1.2, 1.4)
FAMILIES = {"position": "recipe_anneal_fb_int8", "backprops": "recipe_anneal_fb_int8_lrbp"}


def curves(paths: list[Path]) -> dict[tuple[int, str], list[tuple[float, float]]]:
    out: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for path in paths:
        with open(path / "curves.csv") as f:
            for row in csv.DictReader(f):
                key = (int(row["seed"]), row["strategy"])
                out.setdefault(key, []).append((float(row["time_s"]), float(row["error"])))
    return out


def family_time(c: dict, seed: int, family: str, target: float) -> float:
    times = [
        first_time(c[(seed, name)], target)
        for name in (family, family + "_e15")
        if (seed, name) in c
    ]
    found = [t for t in times if t is not None]
    return min(found) if found else float("inf")


def main(paths: list[Path]) -> None:
    c = curves(paths)
    seeds = sorted({s for s, _ in c})
    print(
        "| seed | Traditional-10 | final 10 / 15 epochs, by position | by backprops | "
        + " | ".join(f"x{k}: s, position / backprops" for k in TARGETS)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(TARGETS))
    ratios: dict[float, list[float]] = {k: [] for k in TARGETS}
    finals: dict[str, list[float]] = {f"{v}{e}": [] for v in FAMILIES for e in ("", "_e15")}
    for seed in seeds:
        ref = c[(seed, "traditional")][-1][1]
        cells = []
        for k in TARGETS:
            pos, bp = (family_time(c, seed, FAMILIES[v], ref * k) for v in FAMILIES)
            cells.append(f"{pos:.1f} / {bp:.1f}")
            if pos < float("inf") and bp < float("inf"):
                ratios[k].append(pos / bp)
        ends = {}
        for v, fam in FAMILIES.items():
            for e in ("", "_e15"):
                ends[f"{v}{e}"] = c[(seed, fam + e)][-1][1]
                finals[f"{v}{e}"].append(ends[f"{v}{e}"])
        print(
            f"| {seed} | {100 * ref:.2f}% | {100 * ends['position']:.2f} / "
            f"{100 * ends['position_e15']:.2f}% | {100 * ends['backprops']:.2f} / "
            f"{100 * ends['backprops_e15']:.2f}% | " + " | ".join(cells) + " |"
        )
    print()
    for k in TARGETS:
        r = ratios[k]
        if r:
            print(
                f"x{k}: position's time / backprops' time, mean {statistics.mean(r):.2f} "
                f"({min(r):.2f}-{max(r):.2f}), seeds reached by both {len(r)}/{len(seeds)}"
            )
    for name, v in finals.items():
        print(f"final error {name}: mean {100 * statistics.mean(v):.2f}%")


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
