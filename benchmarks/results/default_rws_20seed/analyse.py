"""The designed experiment's tables from each seed's ``curves.csv`` (``analyse.py DIR``: the
folder holding ``s0``, ``s1``, ...). Frontier time of a run at a target: the first evaluation
(every half epoch) at or below it, in training seconds; speedup over Random-Backprop: its time
÷ the variant's, per seed, as the benchmark's frontier does (one budget each, 10 epochs)."""

import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

from benchmarks.core.frontier import first_time

REFERENCE = 0.074  # the default_safety preset's (Traditional-10's final error, frontier seeds 0-2)
TARGETS = (1.0, 1.05, 1.1, 1.2, 1.4)
CONTROL, VARIANTS = "random_0.33", ("default_fb", "default_rws_fb")


def curves(path: Path) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            out.setdefault(row["strategy"], []).append((float(row["time_s"]), float(row["error"])))
    return out


def reach(points: list[tuple[float, float]], target: float) -> float:
    """The frontier's first evaluation at or below ``target`` (its tie slack), inf: never."""
    t = first_time(points, target)
    return float("inf") if t is None else t


def main(root: Path) -> None:
    seeds = sorted((int(p.name[1:]), p) for p in root.glob("s*") if (p / "curves.csv").exists())
    speed: dict[tuple[str, float], list[float]] = {}
    final: dict[str, list[float]] = {s: [] for s in (CONTROL, *VARIANTS)}
    print("| seed | " + " | ".join(f"x{k} fb / rws" for k in TARGETS) + " | final RB / fb / rws |")
    print("|---|" + "---|" * (len(TARGETS) + 1))
    for seed, p in seeds:
        c = curves(p / "curves.csv")
        cells = []
        for k in TARGETS:
            base = reach(c[CONTROL], REFERENCE * k)
            pair = []
            for v in VARIANTS:
                t = reach(c[v], REFERENCE * k)
                if t == base == float("inf"):
                    pair.append("neither")  # (left out of the counts)
                    speed.setdefault((v, k), []).append(float("nan"))
                    continue
                r = base / t if t < float("inf") else 0.0
                speed.setdefault((v, k), []).append(r)
                pair.append("inf" if r == float("inf") else ("never" if r == 0 else f"{r:.2f}"))
            cells.append(" / ".join(pair))
        for s in final:
            final[s].append(c[s][-1][1])
        ends = " / ".join(f"{100 * c[s][-1][1]:.2f}" for s in final)
        print(f"| {seed} | " + " | ".join(cells) + f" | {ends} |")
    print(f"\n{len(seeds)} seeds: {[s for s, _ in seeds]}\n")
    print("| target | variant | mean speedup (finite) | min | behind RB (< 1) | against fb |")
    print("|---|---|---|---|---|---|")
    for k in TARGETS:
        for v in VARIANTS:
            rs = [r for r in speed[(v, k)] if r == r]  # (NaN: neither reached it)
            if not rs:
                print(f"| x{k} | {v} | neither reached it | | | |")
                continue
            finite = [r for r in rs if 0 < r < float("inf")]
            mean = f"{statistics.mean(finite):.2f}" if finite else "-"
            low = f"{min(rs):.2f}"
            behind = sum(r < 1 for r in rs)
            vs = ""
            if v != VARIANTS[0]:
                a, b = speed[(VARIANTS[0], k)], speed[(v, k)]
                up, down = sum(y > x for x, y in zip(a, b)), sum(y < x for x, y in zip(a, b))
                vs = f"{up} faster, {down} slower"
            print(f"| x{k} | {v} | {mean} | {low} | {behind}/{len(rs)} | {vs} |")
    d = [b - a for a, b in zip(final[VARIANTS[0]], final[VARIANTS[1]])]
    print(
        "\nfinal error, mean: "
        + ", ".join(f"{s} {100 * statistics.mean(v):.2f}%" for s, v in final.items())
        + f"; rws - fb per seed: mean {100 * statistics.mean(d):+.2f} points "
        f"(range {100 * min(d):+.2f} to {100 * max(d):+.2f})"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
