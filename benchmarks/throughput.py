"""Section 3 of ``benchmarks/breakdown.py`` alone: SelectiveLoader's throughput with a trivial
model against the raw source's, with the same configuration and code, in under a minute.

For re-measuring the loader's per-batch overhead after a change without re-running the whole
breakdown (whose other sections take 14 minutes on the 2-core CPU). Writes ``throughput.json``
(with the machine and versions) and ``throughput.md`` into the folder given; ``--runs N``
repeats the whole measurement N times and reports each run and the median ratio.

    python3 benchmarks/throughput.py results/throughput --runs 3
    taskset -c 0 python3 benchmarks/throughput.py results/throughput --threads 1
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    # Run as a file: run this checkout's ``benchmarks.throughput`` as ``python3 -m`` would from
    # the repository, so that this checkout's benchmarks and sbloader are the ones that run.
    import runpy
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("benchmarks.throughput", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

import sbloader.ffcv as sbffcv
from benchmarks.core.config import measurement
from benchmarks.core.data import train_set
from benchmarks.core.machine import describe_commit, machine_info
from benchmarks.core.sources import Sources
from benchmarks.core.throughput import throughput


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="results folder (created)")
    p.add_argument("--runs", type=int, default=3, help="whole measurements (default 3)")
    p.add_argument("--no-ffcv", action="store_true", help="DataLoader source only")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"--runs should be >= 1, but got --runs={args.runs}")
    # NOTE: the same thread setting as breakdown.py's (Config.threads), whose section 3 this
    # re-runs: without it, its figures and breakdown.py --threads 1's did not compare.
    cfg, m = measurement(False, threads=args.threads)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    x, y = train_set(cfg)
    x, y = x[: m.examples].contiguous(), y[: m.examples].contiguous()
    use_ffcv = not args.no_ffcv and sbffcv.ffcv_available()
    sources = Sources(x, y, cfg.device, use_ffcv, m.ffcv_workers)
    started = time.perf_counter()
    runs = []
    try:
        for i in range(args.runs):
            print(f"# run {i + 1}/{args.runs}", flush=True)
            runs.append(throughput(cfg, m, sources, print))
    finally:
        sources.close()
    machine = machine_info(exclude=args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {"setting": dataclasses.asdict(cfg), "measurement": dataclasses.asdict(m)},
        "machine": machine,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    (args.out / "throughput.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# SelectiveLoader throughput with a trivial model (section 3 of breakdown.py)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), "
        f"sbloader {machine['sbloader']} ({describe_commit(machine)}), {machine['date']}. "
        f"{m.examples} examples; the raw source and the loader alternated epoch by epoch, "
        f"{m.throughput_epochs} pairs per measurement, {m.repeats} measurements per run, the "
        f"median of the paired ratios; {args.runs} runs.",
        "",
        "| source | strategy | prefetch | ratio per run | median ratio | median ratio without "
        "the selection forwards | selection forwards' share of the loader's time |",
        "|---|---|---|---|---|---|---|",
    ]
    for j, row in enumerate(runs[0]):
        ratios = [run[j]["ratio"] for run in runs]
        net = statistics.median(run[j]["ratio_without_forward"] for run in runs)
        share = statistics.median(run[j]["forward_share"] for run in runs)
        lines.append(
            f"| {row['source']} | {row['strategy']} | {row['prefetch']} | "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f" | {statistics.median(ratios):.3f} | {net:.3f} | {share:.3f} |"
        )
    lines += [
        "",
        "Target: ratio >= 0.9 (the loader's examples per second / the raw source's). SB runs a "
        "selection forward of the trivial model (one linear layer) on every candidate, which the "
        "raw source does not; the ratio without the selection forwards' time is the loader's own "
        "overhead.",
    ]
    (args.out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
