"""How much sooner does each strategy reach Traditional's accuracy, and what does it cost?

Trains the reference CNN on Fashion-MNIST (Debian's dataset-fashion-mnist: 60,000 real images)
with each strategy and reports, from one run on one machine:

- Table 1 (the paper's): wall-clock to reach Traditional's final test error x1.0, x1.1, x1.2 and
  x1.4, as a speedup over Traditional (mean over seeds, with the spread);
- Figure 7: test error against wall-clock; Figure 1/10: the time breakdown per strategy;
  Figure 13: a selectivity sweep; Figure 14: the Pareto frontier of (time, error) over all
  configurations; Figure 12: 1%, 10% and 20% of labels flipped.

Honest accounting: wall-clock includes everything the user pays for (selection passes, EL2N
scoring and its short training runs, data loading); evaluation is excluded and reported on its
own. Every strategy uses the same model, optimizer, batch size, channels_last layout and a cosine
learning-rate schedule keyed on position in the data (epochs of candidates consumed, from
``loader.progress``), decayed to zero over the strategy's planned epochs.

    python3 benchmarks/run.py --preset quick           # the main job: ~11 minutes on 2 cores
    python3 benchmarks/run.py --preset full            # everything (hours)
    python3 benchmarks/run.py --preset full --resume --out results/full   # continue a run

Each run is saved as soon as it ends (``runs/*.json`` in the output folder), so an interrupted
benchmark keeps what it measured and ``--resume`` skips it next time.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    # Run as a file: run this checkout's ``benchmarks.run`` as ``python3 -m`` would from the
    # repository, so that this checkout's benchmarks and sbloader are the ones that run.
    import runpy
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("benchmarks.run", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import dataclasses
import datetime as dt
import json
import sys
from pathlib import Path

import torch

from benchmarks.core import strategies
from benchmarks.core.config import PRESETS, Config
from benchmarks.core.data import load_data
from benchmarks.core.machine import machine_info
from benchmarks.core.records import Run, load_runs, run_key, save_run
from benchmarks.core.report import plots, summary_markdown, write_curves
from benchmarks.core.train import Trainer


def configure(args: argparse.Namespace) -> Config:
    """The preset's configuration with the command line's overrides."""
    cfg = Config(preset=args.preset, **PRESETS[args.preset])
    if args.strategies:
        cfg.strategies = tuple(args.strategies)
    if args.seeds:
        cfg.seeds = tuple(args.seeds)
    if args.epochs:
        cfg.epochs = args.epochs
    if args.threads:
        cfg.threads = args.threads
    if args.device:
        cfg.device = args.device
    if args.data:
        cfg.data_root = str(Path(args.data).resolve())
    cfg.device = str(cfg.resolved_device())
    for name in (*cfg.strategies, *cfg.noise_strategies):
        strategies.get(name)  # fail fast on a typo
    return cfg


def jobs(cfg: Config) -> list[tuple[str, int, float]]:
    """(strategy, seed, label noise) of every run, seed-major, each seed's label-noise runs
    right after its clean ones: a run cut short still holds complete comparisons for its first
    seeds."""
    out = []
    for seed in cfg.seeds:
        out += [(s, seed, 0.0) for s in cfg.strategies]
        if seed in cfg.noise_seeds:
            out += [(s, seed, nz) for nz in cfg.label_noise if nz > 0 for s in cfg.noise_strategies]
    return out


def _log(run: Run) -> None:
    print(
        f"{run.strategy:22s} seed {run.seed} noise {run.noise:4.2f}: final error "
        f"{100 * run.final_error:5.2f}%  wall-clock {run.train_s:6.1f}s  "
        f"(eval {run.eval_s:.1f}s excluded)",
        flush=True,
    )


def train(cfg: Config, todo: list[tuple[str, int, float]], folder: Path) -> None:
    """Train each run, one after another, saving each as it ends."""
    from tqdm import tqdm

    data = load_data(cfg)
    for name, seed, nz in todo:
        strat = strategies.get(name)
        steps = 100 * strat.planned(cfg.epochs)  # the bar counts hundredths of an epoch of data
        with tqdm(
            total=steps,
            desc=f"{name} seed {seed} noise {nz:g}",
            leave=False,
            mininterval=2.0,
            file=sys.stderr,
        ) as bar:
            run = Trainer(cfg, strat, seed, nz, data, bar).train()
        save_run(run, folder)
        _log(run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--out", help="results folder (default: results/<preset>-<time>)")
    p.add_argument("--strategies", nargs="+", help="override the preset's strategies")
    p.add_argument("--seeds", nargs="+", type=int, help="override the preset's seeds")
    p.add_argument("--epochs", type=int, help="override the planned epochs")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", help="cpu, cuda or auto (default: the preset's)")
    p.add_argument(
        "--data", help="folder of a local CIFAR-10/100 or SVHN copy (torchvision format)"
    )
    p.add_argument("--resume", action="store_true", help="skip runs already in --out")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the summary and plots from the runs in --out",
    )
    args = p.parse_args(argv)

    cfg = configure(args)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"results/{cfg.preset}-{stamp}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    machine = machine_info(exclude=out)
    # NOTE: a report (--report-only) describes the configuration and the machine that measured
    # the runs, as recorded next to them, not the command line or the machine reporting.
    if args.report_only and (out / "config.json").exists():
        cfg = Config.from_dict(json.loads((out / "config.json").read_text()))
    else:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    if args.report_only and (out / "machine.json").exists():
        machine = json.loads((out / "machine.json").read_text())
    else:
        (out / "machine.json").write_text(json.dumps(machine, indent=1))

    if not args.report_only:
        todo = [
            job
            for job in jobs(cfg)
            if not (args.resume and (out / "runs" / f"{run_key(*job)}.json").exists())
        ]
        print(
            f"# {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
            f"{len(todo)} runs -> {out}",
            flush=True,
        )
        train(cfg, todo, out / "runs")
    runs = load_runs(out / "runs")
    text = summary_markdown(cfg, runs, machine)
    (out / "summary.md").write_text(text + "\n")
    write_curves(runs, out)
    figs = plots(cfg, runs, out)
    print()
    print(text)
    print("Plots:", *[str(f) for f in figs], sep="\n  ")
    print(f"Everything: {out}/ (summary.md, curves.csv, runs/*.json, config.json, machine.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
