"""Section 3 of ``benchmarks/breakdown.py`` alone: SelectiveLoader's throughput with a trivial
model against the raw source's, with the same configuration and code, in under a minute.

For re-measuring the loader's per-batch overhead after a change without re-running the whole
breakdown (whose other sections take 14 minutes on the 2-core CPU). Writes ``throughput.json``
(with the machine and versions) and ``throughput.md`` into the folder given; ``--runs N``
repeats the whole measurement N times and reports each run and the median ratio.

    python3 benchmarks/throughput.py results/throughput --runs 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import breakdown as bd
from _machine import machine_info

import sbloader.ffcv as sbffcv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="results folder (created)")
    p.add_argument("--runs", type=int, default=3, help="whole measurements (default 3)")
    p.add_argument("--no-ffcv", action="store_true", help="DataLoader source only")
    args = p.parse_args()
    if args.runs < 1:
        raise SystemExit(f"--runs should be >= 1, but got --runs={args.runs}")
    cfg = bd.Config.make(False)
    x, y = bd.padded_train_set(cfg)
    x, y = x[: cfg.examples].contiguous(), y[: cfg.examples].contiguous()
    use_ffcv = not args.no_ffcv and sbffcv.ffcv_available()
    sources = bd.Sources(cfg, x, y, use_ffcv)
    started = time.perf_counter()
    runs = []
    try:
        for i in range(args.runs):
            print(f"# run {i + 1}/{args.runs}", flush=True)
            runs.append(bd.throughput(cfg, sources, print))
    finally:
        sources.close()
    machine = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "config": dataclasses.asdict(cfg),
        "machine": machine,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    (args.out / "throughput.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# SelectiveLoader throughput with a trivial model (section 3 of breakdown.py)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"sbloader {machine['sbloader']} (commit {machine['git_commit']}), {machine['date']}. "
        f"{cfg.examples} examples, {cfg.throughput_epochs} epochs per measurement, median of "
        f"{cfg.repeats} per run; {args.runs} runs.",
        "",
        "| source | strategy | prefetch | ratio per run | median ratio |",
        "|---|---|---|---|---|",
    ]
    for j, row in enumerate(runs[0]):
        ratios = [run[j]["ratio"] for run in runs]
        lines.append(
            f"| {row['source']} | {row['strategy']} | {row['prefetch']} | "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f" | {statistics.median(ratios):.3f} |"
        )
    lines += ["", "Target: ratio >= 0.9 (the loader's examples per second / the raw source's)."]
    (args.out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
