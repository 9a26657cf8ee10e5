"""How much sooner does each strategy reach Traditional's accuracy, and what does it cost?

Trains the reference CNN on Fashion-MNIST (Debian's dataset-fashion-mnist: 60,000 real images)
with each strategy and reports, from one run on one machine:

- the frontier (the headline): for targets Traditional's final error x1.0, x1.05, x1.1, x1.2 and
  x1.4, the best control's wall-clock to the target (Traditional and Random-Backprop, at every
  budget run) over the best sbloader family's (``benchmarks/core/frontier.py``);
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

    python3 benchmarks/run.py --preset quick           # the main job: ~15-20 minutes on 2 cores
    python3 benchmarks/run.py --preset full            # everything (hours)
    python3 benchmarks/run.py --preset full --resume --out results/full   # continue a run
    python3 benchmarks/run.py --preset frontier        # families at several budgets (hours)
    python3 benchmarks/run.py --preset analysis        # per-example analysis, report.html

Strategy names come from the registry in ``benchmarks/core/strategies.py``; ``_eN`` after a name
plans N epochs. ``--interleave`` (on in the ``frontier`` preset) holds all of a seed's runs in
memory and trains them an epoch each in turn, so that a busy spell of a shared machine falls on
all of them alike; each run owns its randomness, so its selections are those it makes alone.

Each run is saved as soon as it ends (``runs/*.json`` in the output folder), so an interrupted
benchmark keeps what it measured and ``--resume`` skips it next time (interleaved runs not yet
ended start again).
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
from benchmarks.core.scores import compute_el2n, el2n_path, save_el2n
from benchmarks.core.train import Data, Trainer, train_interleaved, warm_up


def _family(text: str) -> tuple[str, tuple[int, ...]]:
    """``--families`` item ``NAME:B1,B2,...`` as (strategy, budgets)."""
    name, sep, budgets = text.partition(":")
    try:
        parsed = tuple(int(b) for b in budgets.split(","))
    except ValueError:
        parsed = ()
    if not sep or not parsed or min(parsed) < 1:
        raise argparse.ArgumentTypeError(
            f"a family should be NAME:EPOCHS,EPOCHS,... such as traditional:2,4,10, got {text!r}"
        )
    return name, parsed


def _reference_error(text: str) -> tuple[int | None, float]:
    """``--reference-error``'s entries: ``ERROR`` (every seed) or ``SEED:ERROR``."""
    seed, sep, error = text.rpartition(":")
    try:
        value = float(error)
        key = int(seed) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--reference-error takes ERROR or SEED:ERROR (a fraction, e.g. 0.076 or 0:0.076), "
            f"but got {text!r}"
        ) from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(
            f"--reference-error's error should be a fraction in (0, 1), but got {text!r}"
        )
    return key, value


def _reference_errors(
    entries: list[tuple[int | None, float]],
) -> tuple[float | None, tuple[tuple[int, float], ...]]:
    """(reference_error, seed_reference_errors) from ``--reference-error``'s entries."""
    common = [e for seed, e in entries if seed is None]
    if len(common) > 1:
        raise SystemExit(
            "--reference-error takes at most one ERROR for every seed (then SEED:ERROR entries), "
            f"but got {len(common)}"
        )
    per_seed = tuple(sorted((seed, e) for seed, e in entries if seed is not None))
    if len({seed for seed, _ in per_seed}) < len(per_seed):
        raise SystemExit("--reference-error names a seed twice; give each seed once")
    return (common[0] if common else None), per_seed


def configure(args: argparse.Namespace) -> Config:
    """The preset's configuration with the command line's overrides."""
    cfg = Config(preset=args.preset, **PRESETS[args.preset])
    if args.strategies:
        cfg.strategies = tuple(args.strategies)
        cfg.families = ()  # the runs named, and no others
    if args.families:
        cfg.families = tuple(args.families)
    if args.seeds:
        cfg.seeds = tuple(args.seeds)
    if args.epochs:
        cfg.epochs = args.epochs
    if args.reference_error:
        cfg.reference_error, cfg.seed_reference_errors = args.reference_error
    if args.threads:
        cfg.threads = args.threads
    if args.device:
        cfg.device = args.device
    if args.data:
        cfg.data_root = str(Path(args.data).resolve())
    if args.interleave is not None:
        cfg.interleave = args.interleave
    if args.train_examples:
        cfg.train_examples = args.train_examples
    if args.test_examples:
        cfg.test_examples = args.test_examples
    if args.keep_outputs:
        cfg.keep_outputs = True
    if args.train_bf16 is not None:
        cfg.train_bf16 = args.train_bf16
    cfg.device = str(cfg.resolved_device())
    for name in (*cfg.run_names(), *cfg.noise_strategies):
        strategies.get(name)  # fail fast on a typo
    _check_runs_named_once(cfg)
    return cfg


def _check_runs_named_once(cfg: Config) -> None:
    """Refuse two names of one run (a strategy at one budget), such as ``traditional`` and
    ``traditional_e10`` at 10 planned epochs.

    NOTE (why): both were trained, the same run twice, and the report then stopped at the
    frontier (``two reference runs ('traditional', 10)``), as every ``--report-only`` after it
    did, the sitting's runs saved but never reported."""
    seen: dict[tuple[str, int], str] = {}
    for name in cfg.run_names():
        strat = strategies.get(name)
        run = (strat.family, strat.planned(cfg.epochs))
        if run in seen:
            raise SystemExit(
                "--strategies and --families should name each run once, but "
                f"{seen[run]} and {name} are both {run[0]} over {run[1]} planned epochs "
                f"(--epochs {cfg.epochs}); name one of them"
            )
        seen[run] = name


def jobs(cfg: Config) -> list[tuple[str, int, float]]:
    """(strategy, seed, label noise) of every run, seed-major, each seed's label-noise runs
    right after its clean ones: a run cut short still holds complete comparisons for its first
    seeds."""
    out = []
    for seed in cfg.seeds:
        out += [(s, seed, cfg.noise) for s in cfg.run_names()]
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


def train_sequential(
    cfg: Config, todo: list[tuple[str, int, float]], data: Data, folder: Path
) -> None:
    """Train each run start to end, one after another, saving each as it ends."""
    from tqdm import tqdm

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


def train_each_seed_interleaved(
    cfg: Config, todo: list[tuple[str, int, float]], data: Data, folder: Path
) -> None:
    """Per seed, hold all of its runs in memory and train them an epoch each in turn, saving
    each run as it ends."""
    from tqdm import tqdm

    for seed in dict.fromkeys(seed for _, seed, _ in todo):
        trainers = [
            Trainer(cfg, strategies.get(name), s, nz, data, interleaved=True)
            for name, s, nz in todo
            if s == seed
        ]
        with tqdm(
            total=sum(t.planned for t in trainers),
            desc=f"seed {seed}: {len(trainers)} runs interleaved, epochs",
            leave=False,
            file=sys.stderr,
        ) as bar:

            def epoch_done(t: Trainer) -> None:
                bar.update(1)
                last = t.run.points[-1]["error"]
                bar.set_postfix(run=t.run.strategy, err=f"{100 * last:.2f}%")

            def run_done(run: Run) -> None:
                save_run(run, folder)
                _log(run)

            train_interleaved(trainers, epoch_done, run_done)


def execute(
    cfg: Config, out: Path, machine: dict, resume: bool = False, data: Data | None = None
) -> None:
    """Train the configuration's runs (those not in ``out`` already, with ``resume``) into
    ``out/runs``, interleaved per seed when ``cfg.interleave``."""
    todo = [
        job
        for job in jobs(cfg)
        if not (resume and (out / "runs" / f"{run_key(*job)}.json").exists())
    ]
    print(
        f"# {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"{len(todo)} runs{', interleaved per seed' if cfg.interleave else ''} -> {out}",
        flush=True,
    )
    data = load_data(cfg) if data is None else data
    if todo:
        names = dict.fromkeys(name for name, _, _ in todo)
        seconds = warm_up(cfg, [strategies.get(name) for name in names], data)
        (out / "warmup.json").write_text(json.dumps({"seconds": seconds, "runs": list(names)}))
        print(f"# warm-up: every configuration on a few batches, {seconds:.1f}s (not counted)")
    train = train_each_seed_interleaved if cfg.interleave else train_sequential
    train(cfg, todo, data, out / "runs")
    for seed in cfg.seeds:
        for model in cfg.el2n_archs:
            path = el2n_path(out, model, seed)
            if not (resume and path.exists()):
                result = compute_el2n(cfg, data, seed, model)
                save_el2n(path, result)
                print(f"EL2N scores of {model}, seed {seed}: {result.seconds:.1f}s", flush=True)


def report(cfg: Config, machine: dict, out: Path, seeds: tuple[int, ...] | None = None) -> str:
    """Summary, curves and plots of the runs in ``out/runs`` (those of ``seeds`` only, where
    given); returns the summary, whose seeds are those of the runs it reports."""
    runs = load_runs(out / "runs")
    if seeds is not None:
        runs = [r for r in runs if r.seed in seeds]
    present = tuple(sorted({r.seed for r in runs}))
    if present:
        # NOTE: a folder merged from several sittings' processes (or a resumed one) holds
        # the runs of other seeds than its config.json's; the summary names the seeds it shows.
        cfg = dataclasses.replace(cfg, seeds=present)
    if (out / "warmup.json").exists():
        machine = {**machine, "warmup_s": json.loads((out / "warmup.json").read_text())["seconds"]}
    text = summary_markdown(cfg, runs, machine)
    (out / "summary.md").write_text(text + "\n")
    write_curves(runs, out)
    figs = plots(cfg, runs, out)
    print()
    print(text)
    print("Plots:", *[str(f) for f in figs], sep="\n  ")
    print(f"Everything: {out}/ (summary.md, curves.csv, runs/*.json, config.json, machine.json)")
    return text


def parser() -> argparse.ArgumentParser:
    """The command line's options (see :func:`configure` for what each overrides)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--out", help="results folder (default: results/<preset>-<time>)")
    p.add_argument("--strategies", nargs="+", help="override the preset's strategies")
    p.add_argument(
        "--families",
        nargs="+",
        type=_family,
        metavar="NAME:EPOCHS,...",
        help="override the preset's families (strategies at several budgets), e.g. "
        "traditional:2,4,10 random_0.33:5,10",
    )
    p.add_argument("--seeds", nargs="+", type=int, help="override the preset's seeds")
    p.add_argument("--epochs", type=int, help="override the planned epochs")
    p.add_argument(
        "--reference-error",
        nargs="+",
        type=_reference_error,
        metavar="[SEED:]ERROR",
        help="the frontier's reference error (a fraction) for seeds without a Traditional run: "
        "one for all of them, or SEED:ERROR for each (e.g. 0:0.076 1:0.0729)",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", help="cpu, cuda or auto (default: the preset's)")
    p.add_argument(
        "--data", help="folder of a local CIFAR-10/100 or SVHN copy (torchvision format)"
    )
    p.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        help="train each seed's runs an epoch each in turn (default: the preset's; frontier: on)",
    )
    p.add_argument("--train-examples", type=int, help="train on a prefix of the training set")
    p.add_argument("--test-examples", type=int, help="evaluate on a prefix of the test set")
    p.add_argument(
        "--train-bf16",
        action=argparse.BooleanOptionalAction,
        help="train every run's forward under bf16 autocast, controls and sbloader alike "
        "(default: the preset's; the CPU presets train in float32)",
    )
    p.add_argument(
        "--keep-outputs",
        action="store_true",
        help="keep the per-example arrays and write the analysis report (benchmarks/analysis.py)",
    )
    p.add_argument("--resume", action="store_true", help="skip runs already in --out")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the summary and plots from the runs in --out",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.reference_error:
        args.reference_error = _reference_errors(args.reference_error)

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
        # (what the command line asks of the report itself: the targets and the seeds)
        if args.reference_error:
            cfg.reference_error, cfg.seed_reference_errors = args.reference_error
    else:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    if args.report_only and (out / "machine.json").exists():
        machine = json.loads((out / "machine.json").read_text())
    elif args.resume and (out / "machine.json").exists():
        # NOTE: the runs already in the folder were measured on the machine and commit of its
        # machine.json: a resumed sitting records its own beside it, never over it.
        (out / f"machine_resumed_{stamp}.json").write_text(json.dumps(machine, indent=1))
    else:
        (out / "machine.json").write_text(json.dumps(machine, indent=1))
    if not args.report_only:
        execute(cfg, out, machine, resume=args.resume)
    report(cfg, machine, out, tuple(args.seeds) if args.seeds else None)
    if cfg.keep_outputs:
        from benchmarks.analysis import write_analysis

        print(f"Analysis: {write_analysis(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
