"""Selection overlapped with training on a CPU: what ``overlap_selection=True`` buys, measured in
whole training epochs against Traditional and SB at each torch thread count.

On a machine with several cores, the selection pass can run on a thread of its own while the
training step runs (``SelectiveLoader(overlap_selection=True)``, :mod:`sbloader.overlap`), or
both can share the cores through torch's intra-op threads. This measures, side by side and
interleaved round by round (one epoch of each way in turn, then the next round), the breakdown's
CNN (channels_last; `--model mlp`: the MLP) on a prefix of Fashion-MNIST from a DataLoader, fp32
selection passes:

- each way's epoch seconds, and its ratio to the fastest Traditional epoch of the same round
  (Traditional at its best thread count: the fair control on this hardware);
- c (the caller's visible selection seconds per selection forward over training seconds per
  backpropagated example), the hidden share of the passes (``selection_hidden_s`` over all
  their seconds) and k (backpropagated over seen examples);
- the bound of issue 14, 1.1 x (c x forwards per seen example + k) x Traditional's epoch at the
  same thread count, and the ideal of a perfect overlap, k x that epoch.

Ways: Traditional, SB and SB with ``overlap_selection`` at each of ``--threads`` intra-op thread
counts (the overlapped pass and the step each use that many). Give the script the cores it may
use (``taskset -c 0,1``) and nothing else to run: unlike the other benchmarks, which share one
core, this one is about using a second.

    taskset -c 0,1 python3 benchmarks/overlap.py results/overlap --threads 1 2 --rounds 3
    taskset -c 0,1 python3 benchmarks/overlap.py results/overlap_mlp --model mlp
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import runpy
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("benchmarks.overlap", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks.breakdown import train_epoch, warm_up
from benchmarks.core.config import Config, Measurement, measurement
from benchmarks.core.data import train_set
from benchmarks.core.machine import describe_commit, machine_info
from benchmarks.core.models import make_loader, seeded_model
from benchmarks.core.sources import Sources
from benchmarks.core.timing import cell, rounds_summary

#: name -> (strategy, SelectiveLoader options)
WAYS: dict[str, tuple[str, dict[str, Any]]] = {
    "traditional": ("traditional", {}),
    "sb": ("sb", {"autocast": None}),
    "sb overlap": ("sb", {"autocast": None, "overlap_selection": True}),
}


def epochs(
    cfg: Config, m: Measurement, x: torch.Tensor, y: torch.Tensor, rounds: int, threads: list[int]
) -> list[dict[str, Any]]:
    """One epoch of every way at every thread count per round, interleaved within the round; one
    row per way, thread count and round."""
    sources = Sources(x, y, cfg.device, False)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            trad: dict[int, float] = {}
            for t in threads:
                torch.set_num_threads(t)  # NOTE: the benchmark's setting, never the library's
                for name, (strategy, kw) in WAYS.items():
                    model = seeded_model(cfg, m.seed)
                    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
                    source_bs = cfg.batch_size if strategy == "traditional" else cfg.pool_batch_size
                    source = sources.make("dataloader", source_bs, m.seed + r)
                    warm_up(source, model, cfg, m, kw)
                    loader = make_loader(cfg, source, model, m.policy(strategy), m.seed, **kw)
                    e = train_epoch(loader, model, opt, cfg)
                    st = loader.stats.current
                    assert st is not None
                    row: dict[str, Any] = {
                        "way": name,
                        "threads": t,
                        "round": r,
                        "wall_s": e["wall"],
                        "k": e["backprop"] / e["examples_seen"],
                        "forwards_per_seen": e["selection_forwards"] / e["examples_seen"],
                        "train_s_per_example": (e["train_fwd"] + e["backward"]) / e["backprop"],
                        "selection_visible_s": st.selection_forward_s,
                        "selection_hidden_s": st.selection_hidden_s,
                    }
                    if e["selection_forwards"]:
                        per_forward = st.selection_forward_s / e["selection_forwards"]
                        row["c"] = per_forward / row["train_s_per_example"]
                        total = st.selection_forward_s + st.selection_hidden_s
                        row["hidden_share"] = st.selection_hidden_s / total if total else 0.0
                        row["c_total"] = (
                            total / e["selection_forwards"] / row["train_s_per_example"]
                        )
                    if strategy == "traditional":
                        trad[t] = e["wall"]
                    else:
                        row["ratio_same_threads"] = e["wall"] / trad[t]
                        row["bound"] = 1.1 * (row["c"] * row["forwards_per_seen"] + row["k"])
                        row["ideal"] = row["k"]
                    rows.append(row)
                    extra = (
                        ""
                        if "c" not in row
                        else f"  c {row['c']:.3f} (hidden {row['hidden_share']:.0%})  "
                        f"k {row['k']:.3f}  epoch/trad {row['ratio_same_threads']:.3f}  "
                        f"bound {row['bound']:.3f}"
                    )
                    print(
                        f"[{r + 1}/{rounds}] {name:12s} {t} thread(s) epoch {e['wall']:6.2f}s"
                        f"{extra}",
                        flush=True,
                    )
            best = min(trad.values())
            for row in rows:
                if row["round"] == r:
                    row["ratio_best_traditional"] = row["wall_s"] / best
    finally:
        sources.close()
    return rows


def markdown(report: dict[str, Any]) -> str:
    machine, rows = report["machine"], report["rounds"]
    setting, m = report["config"]["setting"], report["config"]["measurement"]
    table = rounds_summary(rows, ("way", "threads"), "ratio_same_threads")
    lines = [
        "# overlap_selection on the CPU (benchmarks/overlap.py)",
        "",
        f"Machine: {machine['cpu']} ({machine.get('cpu_capability', '?')}), "
        f"{report['cores']} core(s) allowed, torch {machine['torch']}, sbloader "
        f"{describe_commit(machine)}, {machine['date']}. Model {setting['model']} (channels_last), "
        f"{m['examples']} Fashion-MNIST examples per epoch from a DataLoader, training batch "
        f"{setting['batch_size']}, source batch {setting['pool_batch_size']} for SB (keep "
        f"{m['selectivity']:.3g}), fp32 selection passes; medians of {table[0]['rounds']} rounds, "
        "every way at every thread count interleaved within each round. c: the caller's visible "
        "selection seconds per selection forward over training seconds per backpropagated "
        "example (with overlap: the waits); c total: all the passes' seconds likewise; hidden: "
        "the passes' share that ran while the caller trained; epoch / best Traditional: against "
        "the fastest Traditional epoch of the same round at any thread count; bound: 1.1 x (c x "
        "forwards per seen example + k), as a fraction of Traditional's epoch at the same thread "
        "count.",
        "",
        "| way | threads | epoch [s] | epoch / best Traditional | epoch / Traditional, same "
        "threads | c | c total | hidden | k | bound | within |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    f = cell

    for r in table:
        within = "" if "within_rounds" not in r else f"{r['within_rounds']} of {r['rounds']}"
        lines.append(
            f"| {r['way']} | {r['threads']} | {r['wall_s']:.2f} | "
            f"{f(r, 'ratio_best_traditional')} | {f(r, 'ratio_same_threads')} | {f(r, 'c')} | "
            f"{f(r, 'c_total')} | {f(r, 'hidden_share', '.0%')} | {f(r, 'k')} | "
            f"{f(r, 'bound')} | {within} |"
        )
    lines += ["", "Per round:", "", "| round | way | threads | epoch [s] | c | hidden |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['round'] + 1} | {r['way']} | {r['threads']} | {r['wall_s']:.2f} | "
            f"{f(r, 'c')} | {f(r, 'hidden_share', '.0%')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra-op threads")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--examples", type=int, default=15_360, help="examples per epoch")
    p.add_argument("--model", default="small_cnn", help="small_cnn (the breakdown's) or mlp")
    p.add_argument("--report-only", action="store_true", help="rebuild overlap.md from the json")
    args = p.parse_args(argv)
    path = args.out / "overlap.json"
    if args.report_only:
        report = json.loads(path.read_text())
    else:
        cfg, m = measurement(True, examples=args.examples)
        cfg = dataclasses.replace(cfg, channels_last=True, model=args.model)
        x, y = train_set(cfg)
        x, y = x[: m.examples].contiguous(), y[: m.examples].contiguous()
        rows = epochs(cfg, m, x, y, args.rounds, args.threads)
        report = {
            "cores": len(os.sched_getaffinity(0)),
            "machine": machine_info(exclude=args.out),
            "config": {"setting": dataclasses.asdict(cfg), "measurement": dataclasses.asdict(m)},
            "rounds": rows,
        }
    report["summary"] = rounds_summary(report["rounds"], ("way", "threads"), "ratio_same_threads")
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (args.out / "overlap.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
