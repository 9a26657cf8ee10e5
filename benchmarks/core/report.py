"""run.py's report: the summary (markdown: the frontier table first, then Table 1, the time
breakdown, the Pareto share and label noise), the error curves (CSV) and the plots."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .analysis import MULTIPLIERS, pareto, speedup_table
from .config import Config
from .frontier import TARGETS, Cell, FrontierTable, Reached, Record, Summary, frontier_table
from .machine import describe_commit
from .records import Run
from .strategies import get


def _save(fig: Any, path: Path) -> Path:
    """Write a figure as a PNG and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _fmt(cell: dict) -> str:
    if cell["mean"] is None:
        return "never"
    s = f"{cell['mean']:.2f}x"
    if cell["seeds"] > 1:
        s += f" ({cell['min']:.2f} to {cell['max']:.2f})"
    if cell["never"]:
        s += f", never in {cell['never']}/{cell['seeds']}"
    return s


def frontier_records(runs: Sequence[Run], noise: float = 0.0) -> list[Record]:
    """The runs at label noise ``noise`` as the frontier sees them: family, budget, seed and
    (wall-clock, error) of each evaluation."""
    return [
        Record(
            family=get(r.strategy).family,
            budget=r.planned_epochs,
            seed=r.seed,
            evaluations=tuple((p["time_s"], p["error"]) for p in r.points),
        )
        for r in runs
        if r.noise == noise
    ]


def _times(m: float) -> str:
    """A multiplier as x1.0, x1.05, x1.1."""
    return f"x{m:.1f}" if round(m, 1) == m else f"x{m:.2f}"


def _ratio(x: float | None) -> str:
    if x is None:
        return "never"
    return "∞" if math.isinf(x) else f"{x:.2f}x"


def _seed_ratio(cell: Cell) -> str:
    """One seed's speedup: ``neither`` where no control reached the target either (no loss:
    e.g. a sitting of short budgets only), else as :func:`_ratio`."""
    if cell.sbloader is None and cell.control is None:
        return "neither"
    return _ratio(cell.ratio)


def speedup_cell(sm: Summary) -> str:
    """The headline's speedup at one target: the mean over seeds and the range; where sbloader
    lost some seed by never getting there (no mean), the range over the seeds it reached.
    Seeds where neither a control nor sbloader got there are no loss, and are counted apart
    ("neither in k/n"; "neither" alone where that is every seed); seeds where only sbloader got
    there (∞) are left out of a mean over finite ratios and counted apart ("∞ in k/n")."""
    if sm.low is None:  # no sbloader family reached it in any seed
        if sm.lost:
            speed = "never"
            if sm.neither:
                speed += f" (neither in {sm.neither}/{sm.seeds})"
            return speed
        return "neither"
    if sm.mean is None:
        reached = sm.seeds - sm.never
        span = _ratio(sm.low) if sm.low == sm.high else f"{_ratio(sm.low)} to {_ratio(sm.high)}"
        speed = f"{span} in {reached} of {sm.seeds} seeds"
    else:
        speed = _ratio(sm.mean)
    if sm.seeds - sm.never > 1 and sm.mean is not None:
        speed += f" ({_ratio(sm.low)} to {_ratio(sm.high)})"
    if sm.only and sm.mean is not None and math.isfinite(sm.mean):
        speed += f", ∞ in {sm.only}/{sm.seeds}"
    if sm.lost:
        speed += f", never in {sm.lost}/{sm.seeds}"
    if sm.neither:
        speed += f", neither in {sm.neither}/{sm.seeds}"
    return speed


def _where(r: Reached | None) -> str:
    return "never" if r is None else f"{r.family}, {r.budget} ep ({r.time_s:.0f} s)"


def _reference_seeds(records: Sequence[Record], cfg: Config) -> set[int]:
    """Seeds with a Traditional run at the configuration's planned epochs (their targets)."""
    return {r.seed for r in records if (r.family, r.budget) == ("traditional", cfg.epochs)}


def _targets_text(cfg: Config, seeds: Sequence[int]) -> str:
    """How the frontier's targets were set (see ``Config.reference_error``)."""
    given = cfg.given_reference_errors(seeds)
    if not given:
        return f"Target = Traditional-{cfg.epochs}'s final error in each seed x k"
    if len(set(given.values())) == 1 and not cfg.seed_reference_errors:
        return (
            f"Target = {100 * next(iter(given.values())):.2f}% (the reference_error given) x k "
            "in seeds without a Traditional run"
        )
    each = ", ".join(f"seed {s} {100 * e:.2f}%" for s, e in sorted(given.items()))
    return (
        f"Target = the reference error given for each seed without a Traditional run ({each}) x k"
    )


def _absent_runs(cfg: Config, runs: Sequence[Run], seeds: Sequence[int]) -> str:
    """The configuration's runs (``cfg.run_names()``) absent from ``seeds`` at its label noise,
    as a sentence (empty when every seed has them all).

    NOTE (why): a sitting cut short (or a folder merged from several) holds a seed's targets
    and some of its runs, and a family's frontier there is over the runs present: interleaved,
    Random-Backprop over 20 epochs ends last, and a seed without it read a weaker control, a
    speedup larger than measured, under a header naming its budget among every seed's."""
    gaps = []
    for seed in seeds:
        present = {r.strategy for r in runs if r.seed == seed and r.noise == cfg.noise}
        absent = [name for name in cfg.run_names() if name not in present]
        if absent:
            gaps.append(f"seed {seed}: {', '.join(absent)}")
    if not gaps:
        return ""
    return (
        " Runs of the configuration absent, so that their families' frontiers in those seeds "
        f"are over the runs present only (`--resume` trains them): {'; '.join(gaps)}."
    )


def frontier_section(cfg: Config, runs: Sequence[Run]) -> list[str]:
    """The headline: per target, the best control's frontier time over the best sbloader
    family's (see ``frontier.py``), then each family's frontier; nothing without a reference
    run (Traditional at the configuration's planned epochs)."""
    records = frontier_records(runs, cfg.noise)
    controls = {get(r.strategy).family for r in runs if not get(r.strategy).selective}
    table = frontier_table(
        records,
        controls,
        ("traditional", cfg.epochs),
        TARGETS,
        cfg.given_reference_errors(sorted({r.seed for r in records})) or None,
    )
    # NOTE: a seed without a reference run (Traditional at ``epochs`` interrupted, or never
    # run) has no targets and is left out; the section says which, since the summary's header
    # names every seed of the runs and a mean over the others would read as theirs all.
    left_out = sorted({r.seed for r in records} - set(table.seeds))
    missing = (
        f"Seeds without a Traditional-{cfg.epochs} run, left out of the frontier: "
        f"{', '.join(map(str, left_out))} (`--reference-error SEED:ERROR` sets their targets)."
    )
    if not table.seeds:
        if table.controls and table.selective:
            return ["## Frontier", "", missing, ""]
        return []
    budgets = {
        f: sorted({r.budget for r in records if r.family == f})
        for f in (*table.controls, *table.selective)
    }

    def family(f: str) -> str:
        return f"{f} ({', '.join(map(str, budgets[f]))} ep)"

    lines = [
        "## Frontier: the best sbloader family against the best control, at each target",
        "",
        _targets_text(cfg, sorted({r.seed for r in records} - _reference_seeds(records, cfg)))
        + ". A family is one "
        "strategy at several planned budgets; its frontier time is the least training "
        "wall-clock at which any of its runs is evaluated at or below the target. Speedup = "
        "the best control's frontier time ÷ the best sbloader family's (above 1: sbloader "
        "gets there sooner than every control at every budget tried); mean over seeds, range "
        "in parentheses; never: no sbloader family reached it though a control did (no mean "
        "then: the range over the seeds sbloader reached instead); neither: no control nor "
        "sbloader family reached it (no loss, left out); ∞: only sbloader did (∞ in k/n: in k "
        "seeds, left out of the mean). "
        f"Controls: {', '.join(map(family, table.controls)) or 'none'}. sbloader: "
        f"{', '.join(map(family, table.selective)) or 'none'}."
        + (f" {missing}" if left_out else "")
        + _absent_runs(cfg, runs, table.seeds),
        "",
        "| target | error | speedup | best control | best sbloader |",
        "|---|---|---|---|---|",
    ]
    for m in table.multipliers:
        sm = table.summary(m)
        speed = speedup_cell(sm)
        seed_cells = [table.cells[s, m] for s in table.seeds]
        tag = (lambda s: f"seed {s}: ") if len(seed_cells) > 1 else (lambda s: "")
        lines.append(
            f"| {_times(m)} | {100 * sm.mean_target:.2f}% | {speed} | "
            + "; ".join(tag(c.seed) + _where(c.control) for c in seed_cells)
            + " | "
            + "; ".join(tag(c.seed) + _where(c.sbloader) for c in seed_cells)
            + " |"
        )
    lines.append("")
    if len(table.seeds) > 1:
        lines += [
            "Speedup per seed:",
            "",
            "| seed | " + " | ".join(_times(m) for m in table.multipliers) + " |",
            "|" + "---|" * (len(table.multipliers) + 1),
        ]
        for s in table.seeds:
            lines.append(
                f"| {s} | "
                + " | ".join(_seed_ratio(table.cells[s, m]) for m in table.multipliers)
                + " |"
            )
        lines.append("")
    names = (*table.controls, *table.selective)
    lines += [
        "Frontier time per family (s, mean over the seeds that reached the target; the budget "
        "that got there first in parentheses when one seed):",
        "",
        "| target | " + " | ".join(family(f) for f in names) + " |",
        "|" + "---|" * (len(names) + 1),
    ]
    for m in table.multipliers:
        cells = []
        for f in names:
            got = [table.families[f, s, m] for s in table.seeds]
            reached = [r for r in got if r is not None]
            times = [r.time_s for r in reached]
            if not times:
                cells.append("never")
                continue
            cell = f"{sum(times) / len(times):.0f}"
            if len(got) == 1:  # and it reached the target
                cell += f" ({reached[0].budget} ep)"
            elif len(times) < len(got):
                cell += f", never in {len(got) - len(times)}/{len(got)}"
            cells.append(cell)
        lines.append(f"| {_times(m)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += pairwise_lines(table)
    lines += sitting_lines(runs, cfg.noise)
    lines += interval_lines(runs, cfg.noise)
    return lines


#: The spread of Traditional's training time per backpropagated example across its runs of a
#: seed above which the sitting is flagged as uneven.
UNEVEN = 1.2


def sitting_lines(runs: Sequence[Run], noise: float = 0.0) -> list[str]:
    """A check of the sitting: every Traditional run of a seed does the same work per example,
    so their training milliseconds per backpropagated example should agree; a spread above
    ``UNEVEN`` means the machine's load fell unevenly on the runs compared, and the targets
    decided by short runs measure the load as much as the strategies."""
    per_seed: dict[int, list[tuple[int, float]]] = {}
    for r in runs:
        if r.noise != noise or get(r.strategy).family != "traditional" or not r.train_s:
            continue
        backprops = r.points[-1].get("backprops") if r.points else None
        if backprops:
            per_seed.setdefault(r.seed, []).append((r.planned_epochs, 1e3 * r.train_s / backprops))
    if not per_seed:
        return []
    lines = [
        "Sitting check (Traditional's training ms per backpropagated example, per run; the "
        f"same work, so a spread above {UNEVEN:g}x flags a sitting whose load fell unevenly):",
        "",
    ]
    for seed, got in sorted(per_seed.items()):
        got.sort()
        values = [ms for _, ms in got]
        spread = max(values) / min(values)
        flag = " **uneven**" if spread > UNEVEN else ""
        runs_text = ", ".join(f"{b} ep {ms:.3f}" for b, ms in got)
        # (three decimals: a spread of 1.2023 read "1.20x **uneven**" against "above 1.2x")
        lines.append(f"- seed {seed}: {runs_text} (spread {spread:.3f}x){flag}")
    lines.append("")
    return lines


#: A control's evaluation interval whose training ms per backpropagated example is above this
#: multiple of the seed's median over every control interval is flagged as slowed by load
#: (the same epoch's time varies by up to about 40% between runs on these shared machines).
SLOWED = 1.5


def interval_lines(runs: Sequence[Run], noise: float = 0.0) -> list[str]:
    """A finer check of the sitting: the training ms per backpropagated example of every
    evaluation interval (half an epoch, by default) of every control run (Traditional and
    Random-Backprop, whose work per example does not change), per seed against the median of
    them all; an interval above ``SLOWED`` times it is flagged, with its run and position.

    NOTE: :func:`sitting_lines` compares whole runs, which averages a burst of load over a
    run's epochs: a test file on the other core during the first round of a sitting slowed
    one reference run's first half-epoch 2.4-fold and that run by 14% in all, below its
    1.2x flag, though it moved a seed's speedup at x1.0 from about 1.55x to 1.68x.
    """
    per_seed: dict[int, list[tuple[float, str, float]]] = {}
    for r in runs:
        family = get(r.strategy).family
        if r.noise != noise or not (family == "traditional" or family.startswith("random")):
            continue
        for a, b in zip(r.points, r.points[1:]):
            done = b.get("backprops", 0) - a.get("backprops", 0)
            if done > 0:
                ms = 1e3 * (b["time_s"] - a["time_s"]) / done
                per_seed.setdefault(r.seed, []).append((ms, r.strategy, a["position"]))
    if not per_seed:
        return []
    lines = [
        "Intervals (each control run's training ms per backpropagated example between two "
        f"evaluations, against the seed's median; above {SLOWED:g}x flags load on that run "
        "alone):",
        "",
    ]
    for seed, got in sorted(per_seed.items()):
        median = float(np.median([ms for ms, _, _ in got]))
        slowed = sorted((ms / median, name, at) for ms, name, at in got if ms > SLOWED * median)
        worst = max(got)
        text = f"- seed {seed}: median {median:.3f} ms over {len(got)} intervals, worst "
        text += f"{worst[0] / median:.2f}x ({worst[1]} from epoch {worst[2]:.1f})"
        if slowed:
            text += f"; **slowed**: {len(slowed)} above {SLOWED:g}x"
        lines.append(text)
    lines.append("")
    return lines


def pairwise_lines(table: FrontierTable) -> list[str]:
    """Each sbloader family against each control family on its own: per target, the control's
    frontier time over the family's, mean over seeds and the worst seed (the default's safety
    check: never behind Random-Backprop)."""
    if not table.selective or not table.controls:
        return []
    lines = [
        "Each sbloader family against each control family (control's time ÷ the family's; mean "
        "over seeds, worst seed in parentheses; never: the family missed the target in some "
        "seed where the control reached it; ∞: only the family reached it, ∞ in k/n: in k "
        "seeds, left out of the mean):",
        "",
        "| sbloader family | control | " + " | ".join(_times(m) for m in table.multipliers) + " |",
        "|" + "---|" * (len(table.multipliers) + 2),
    ]
    for f in table.selective:
        for c in table.controls:
            cells = []
            for m in table.multipliers:
                ratios: list[float] = []
                missed = 0
                for s in table.seeds:
                    mine, theirs = table.families[f, s, m], table.families[c, s, m]
                    if mine is None:
                        missed += theirs is not None
                        continue
                    cell = Cell(s, m, 0.0, control=theirs, sbloader=mine)
                    if cell.ratio is not None:
                        ratios.append(cell.ratio)
                if missed:
                    cells.append(f"never in {missed}/{len(table.seeds)}")
                elif not ratios:
                    cells.append("neither")
                else:
                    finite = [r for r in ratios if math.isfinite(r)]
                    mean = statistics.fmean(finite) if finite else math.inf
                    text = f"{_ratio(mean)} ({_ratio(min(ratios))})"
                    if finite and len(finite) < len(ratios):  # the mean leaves those out
                        text += f", ∞ in {len(ratios) - len(finite)}/{len(table.seeds)}"
                    cells.append(text)
            lines.append(f"| {f} | {c} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _isa(machine: dict[str, Any]) -> str:
    """`` (AVX2, no native bf16)`` or `` (AVX512, native bf16, AMX)``, from a machine record
    that has them (newer ones)."""
    if "cpu_capability" not in machine:
        return ""
    bf16 = "native bf16" if machine.get("native_bf16") else "no native bf16"
    amx = ", AMX" if machine.get("amx") else ""
    return f" ({machine['cpu_capability']}, {bf16}{amx})"


def _precisions(cfg: Config, runs: Sequence[Run]) -> str:
    """The selection precision asked for, and what the loaders of runs with selection passes
    chose."""
    chosen = {r.selection_dtype for r in runs if r.points and r.points[-1].get("selections")}
    got = "/".join(sorted(chosen - {""}))
    return f"{cfg.selection_precision}" + (f" ({got})" if got else "")


def summary_markdown(cfg: Config, runs: Sequence[Run], machine: dict[str, Any]) -> str:
    lines = [f"# sbloader benchmark: preset `{cfg.preset}`", ""]
    lines.append(
        f"Machine: {machine['cpu']}{_isa(machine)}, {machine['cores']} cores, torch "
        f"{machine['torch']} ({machine['torch_threads']} threads), GPU: "
        f"{machine['gpu'] or 'none'}, numba {machine['numba']}, sbloader "
        f"{machine['sbloader']} ({describe_commit(machine)}), {machine['date']}."
    )
    lines.append(
        f"{cfg.dataset} ({cfg.image_size} x {cfg.image_size}"
        f"{', augmented' if cfg.augment else ''}), "
        f"{cfg.model} on {cfg.device}{' (bf16 training)' if cfg.train_bf16 else ''}, "
        f"batch {cfg.batch_size}, source batch {cfg.pool_batch_size}"
        f"{' (ArrayDataset.collate)' if cfg.array_collate else ''}, peak lr {cfg.lr:g}, "
        f"selection passes {_precisions(cfg, runs)}, {cfg.epochs} planned epochs unless "
        f"named (`_eN`), seeds {list(cfg.seeds)}, evaluation every {cfg.eval_every} epochs "
        "(excluded from wall-clock)."
        + (
            " Runs trained interleaved: each seed's runs an epoch each in turn."
            if cfg.interleave
            else ""
        )
        + (
            f" Before them, a warm-up trained every configuration on a few batches "
            f"({machine['warmup_s']:.0f} s, not counted: first-use costs of the process, such "
            "as numba's kernels and int8 quantization, fall on no run)."
            if machine.get("warmup_s") is not None
            else ""
        )
    )
    lines.append("")
    lines += frontier_section(cfg, runs)
    table = speedup_table(runs)
    if table:
        final = table["traditional"][1.0]["target"]
        lines.append(
            f"## Table 1: speedup to Traditional's final error (mean {100 * final:.2f}%) x k"
        )
        lines.append("")
        lines.append(
            "Speedup = Traditional's wall-clock to the target ÷ the strategy's, paired by seed "
            "(the target in each seed is that seed's Traditional final error x k); mean over "
            "seeds, range in parentheses."
        )
        lines.append("")
        head = (
            "| strategy | final error | wall-clock s | backprops/epoch | "
            + " | ".join(f"x{m:g}" for m in MULTIPLIERS)
            + " |"
        )
        lines += [head, "|" + "---|" * (4 + len(MULTIPLIERS))]
        broken = []
        for name, row in table.items():
            rs = [r for r in runs if r.strategy == name and r.noise == 0]
            err = np.mean([r.final_error for r in rs])
            bad = sum(r.diverged for r in rs)
            if bad:
                broken.append(f"{name} in {bad} of {len(rs)} seeds")
                name = f"{name} (collapsed)"
            wall = np.mean([r.train_s for r in rs])
            per_epoch = [e["examples_yielded"] for r in rs for e in r.epochs]
            bp = sum(per_epoch) / len(per_epoch) if per_epoch else float("nan")
            lines.append(
                f"| {name} | {100 * err:.2f}% | {wall:.1f} | {bp:.0f} | "
                + " | ".join(_fmt(row[m]) for m in MULTIPLIERS)
                + " |"
            )
        lines.append("")
        if broken:
            lines.append(
                "Collapsed: the test error sat at chance level (the model predicts one class) "
                f"after the first epoch for {'; '.join(broken)}. Loss-based selection from "
                "a random initialisation can do this; the `_warmup` and `_rwarmup` variants "
                "start it after one epoch."
            )
            lines.append("")
    # The breakdown reads the clean runs; a preset with only noisy runs (the
    # label-noise frontier) reads its lowest noise level instead of an empty table.
    base_noise = min((r.noise for r in runs), default=0.0)
    flipped = f", {100 * base_noise:g}% of labels flipped" if base_noise > 0 else ""
    lines.append(f"## Time breakdown (seconds per run, mean over seeds{flipped})")
    lines.append("")
    parts = ("selection", "forward", "backward", "data", "el2n", "other")
    lines += [
        "| strategy | " + " | ".join(parts) + " | eval (excluded) |",
        "|" + "---|" * (len(parts) + 2),
    ]
    for name in dict.fromkeys(r.strategy for r in runs if r.noise == base_noise):
        rs = [r for r in runs if r.strategy == name and r.noise == base_noise]
        vals = [np.mean([r.breakdown.get(p, 0.0) for r in rs]) for p in parts]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{v:.1f}" for v in vals)
            + f" | {np.mean([r.eval_s for r in rs]):.1f} |"
        )
    lines.append("")
    front = pareto(runs)
    if front:
        sel = sum(1 for n, _, _ in front if get(n).selective)
        lines.append(
            f"## Pareto frontier: {len(front)} points, {sel} "
            f"({100 * sel / len(front):.0f}%) from selective strategies"
        )
        lines.append("")
        lines.append(", ".join(f"{n} ({t:.0f}s, {100 * e:.2f}%)" for n, t, e in front))
        lines.append("")
    noisy = sorted({r.noise for r in runs if r.noise > 0})
    if noisy:
        lines.append("## Label noise: final test error")
        lines.append("")
        names = list(dict.fromkeys(r.strategy for r in runs if r.noise > 0))
        lines += ["| flipped | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        levels = ([0.0] if any(r.noise == 0 for r in runs) else []) + noisy
        for nz in levels:
            cells = []
            for n in names:
                rs = [r for r in runs if r.strategy == n and r.noise == nz]
                cells.append(f"{100 * np.mean([r.final_error for r in rs]):.2f}%" if rs else "")
            lines.append(f"| {100 * nz:g}% | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plots(cfg: Config, runs: Sequence[Run], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    clean = [r for r in runs if r.noise == 0]
    names = list(dict.fromkeys(r.strategy for r in clean))
    cmap = plt.cm.tab10 if len(names) <= 10 else plt.cm.tab20  # distinct colours first
    colors = {n: cmap(i % cmap.N) for i, n in enumerate(names)}

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in clean:
        pts = r.points[1:]
        ax.plot(
            [p["time_s"] for p in pts],
            [100 * p["error"] for p in pts],
            color=colors[r.strategy],
            alpha=0.9 if r.seed == cfg.seeds[0] else 0.35,
            label=r.strategy if r.seed == cfg.seeds[0] else None,
        )
    ax.set(
        xlabel="training wall-clock (s, evaluation excluded)",
        ylabel="test error (%)",
        title="Figure 7: test error against wall-clock",
        ylim=(5, 20),
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "fig7_error_vs_time.png"))

    parts = ("selection", "forward", "backward", "data", "el2n", "other")
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.5))
    left = np.zeros(len(names))
    for p in parts:
        vals = np.array(
            [
                np.mean(
                    [r.breakdown.get(p, 0.0) / r.planned_epochs for r in clean if r.strategy == n]
                )
                for n in names
            ]
        )
        ax.barh(names, vals, left=left, label=p)
        left += vals
    ax.set(xlabel="seconds per epoch", title="Figure 1/10: where an epoch's time goes")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "fig1_breakdown.png"))

    sweep = [n for n in names if n.startswith(("sb_", "random_")) and n.count("_") == 1]
    if len(sweep) >= 2:
        fig, ax = plt.subplots(figsize=(6, 4))
        for fam in ("sb", "random"):
            xs = sorted(float(n.split("_")[1]) for n in sweep if n.startswith(fam + "_"))
            if not xs:
                continue
            err = [
                np.mean([r.final_error for r in clean if r.strategy == f"{fam}_{x:g}"]) for x in xs
            ]
            ax.plot(xs, [100 * e for e in err], "o-", label=fam)
        ax.set(
            xlabel="selectivity",
            ylabel="final test error (%)",
            title="Figure 13: selectivity sweep",
        )
        ax.legend()
        paths.append(_save(fig, out / "fig13_selectivity.png"))

    front = pareto(runs)
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in clean:
        ax.scatter(
            [p["time_s"] for p in r.points[1:]],
            [100 * p["error"] for p in r.points[1:]],
            s=6,
            color=colors[r.strategy],
            alpha=0.4,
        )
    ax.step([t for _, t, _ in front], [100 * e for _, _, e in front], where="post", color="k")
    for n, t, e in front:
        ax.annotate(n, (t, 100 * e), fontsize=6)
    ax.set(
        xlabel="wall-clock (s)",
        ylabel="test error (%)",
        ylim=(5, 20),
        title="Figure 14: Pareto frontier of time against error",
    )
    paths.append(_save(fig, out / "fig14_pareto.png"))

    noisy = sorted({r.noise for r in runs})
    if len(noisy) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in dict.fromkeys(r.strategy for r in runs if r.noise > 0):
            xs = [nz for nz in noisy if any(r.strategy == n and r.noise == nz for r in runs)]
            ys = [
                100 * np.mean([r.final_error for r in runs if r.strategy == n and r.noise == nz])
                for nz in xs
            ]
            ax.plot([100 * x for x in xs], ys, "o-", label=n)
        ax.set(
            xlabel="labels flipped (%)",
            ylabel="final test error (%)",
            title="Figure 12: label noise",
        )
        ax.legend()
        paths.append(_save(fig, out / "fig12_noise.png"))
    return paths


def write_curves(runs: Sequence[Run], out: Path) -> Path:
    """Every evaluation of every run as ``curves.csv``."""
    with open(out / "curves.csv", "w") as f:
        f.write("strategy,seed,noise,position,time_s,error,backprops,selections\n")
        for r in runs:
            for pt in r.points:
                f.write(
                    f"{r.strategy},{r.seed},{r.noise},{pt['position']:.4f},"
                    f"{pt['time_s']:.3f},{pt['error']:.5f},{pt['backprops']},"
                    f"{pt['selections']}\n"
                )
    return out / "curves.csv"
