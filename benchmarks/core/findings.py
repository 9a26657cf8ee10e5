"""The per-example analysis of a benchmark's runs, as numbers and curves (no plotting): SB's
Figures 8 and 9 (target confidence on the test set), the Diet-SB poster's overlaps (EL2N of two
architectures; SB's least used against EL2N's lowest), selection frequency and stability, the
examples to show in galleries, the selection rate by class and the share of flipped labels among
the most selected. Everything is computed from a benchmark folder's saved arrays
(``runs/*.npz``, ``scores/*.npz``) through :mod:`sbloader.analysis`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import sbloader
import sbloader.analysis as A

from .arrays import arrays_path, load_arrays
from .records import Run, load_runs
from .scores import el2n_path, load_el2n
from .strategies import get

FRACTIONS = np.round(np.arange(0.05, 1.0, 0.05), 2)
"""The grid of the overlap curves [fraction of the training set]."""
REPORTED = (0.1, 0.3, 0.5)
"""Fractions whose overlaps are reported as numbers."""
PERCENTILE = 20
"""The target-confidence percentile whose accuracy is reported (the paper's 20th)."""
BINS = 20
"""Percentile bins of Figure 9 (5% each: the reported bin is the one ending at PERCENTILE)."""
GALLERY = 16
"""Images per gallery."""


@dataclass
class Loaded:
    """A run and its saved arrays."""

    run: Run
    arrays: dict[str, np.ndarray]

    @property
    def label(self) -> str:
        noise = f", {100 * self.run.noise:g}% flipped" if self.run.noise else ""
        return f"{self.run.strategy} (seed {self.run.seed}{noise})"


@dataclass
class Evaluation:
    """One model's test-set target confidence and correctness at one evaluation."""

    label: str
    position: float
    time_s: float
    confidence: np.ndarray
    correct: np.ndarray


@dataclass
class Gallery:
    """Training examples to show: dataset indices, the score shown under each, and what it is."""

    title: str
    indices: np.ndarray
    scores: np.ndarray
    score_name: str
    caption: str


@dataclass
class Analysis:
    """Everything the report shows, for one SB run (and its Traditional and noisy partners)."""

    sb: Loaded
    trad: Loaded | None
    noisy: Loaded | None
    el2n: dict[str, np.ndarray]
    warmup: int
    """SB's warm-up epochs, left out of its selection counts."""
    evaluations: list[Evaluation] = field(default_factory=list)
    percentiles: np.ndarray = field(default_factory=lambda: np.arange(101.0))
    inverse_cdf: dict[str, np.ndarray] = field(default_factory=dict)
    binned: dict[str, A.BinnedAccuracy] = field(default_factory=dict)
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    frequency: np.ndarray = field(default_factory=lambda: np.zeros(0))
    stability: np.ndarray = field(default_factory=lambda: np.zeros(0))
    stability_random: np.ndarray = field(default_factory=lambda: np.zeros(0))
    overlaps: dict[str, np.ndarray] = field(default_factory=dict)
    random_overlap: np.ndarray = field(default_factory=lambda: np.zeros(0))
    random_band: np.ndarray = field(default_factory=lambda: np.zeros((2, 0)))
    galleries: list[Gallery] = field(default_factory=list)
    noisy_counts: np.ndarray | None = None
    noisy_gallery: Gallery | None = None
    noise: A.NoiseShare | None = None
    class_rates: np.ndarray | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    """The headline numbers, named (see :func:`headline`)."""


def load_run_arrays(folder: Path) -> list[Loaded]:
    """The runs of a benchmark folder that kept their arrays (``keep_outputs``)."""
    out = []
    for run in load_runs(folder / "runs"):
        path = arrays_path(folder / "runs" / f"{run.key()}.json")
        if path.exists():
            out.append(Loaded(run, load_arrays(path)))
    return out


def _warmup(strategy: str, planned: int) -> int:
    """The warm-up epochs of a registered strategy's policy over ``planned`` epochs (a
    ``Phased`` policy's ``warmup_epochs``: the ``_warmup`` and ``_rwarmup`` variants', and the
    recipe's Random-Backprop epoch, also under a suffix such as ``_fb`` or ``_int8``).

    NOTE: read from the policy, not the name: ``stale_sb_3_rwarmup_fb`` and every recipe start
    with a warm-up epoch that a name ending in ``_warmup`` or ``_rwarmup`` misses, and their
    warm-up's random selections were counted as SB's."""
    policy = get(strategy).policy(planned)
    return min(policy.warmup_epochs, planned) if isinstance(policy, sbloader.Phased) else 0


def pick(
    loaded: list[Loaded], sb: str | None = None, traditional: str = "traditional", seed: Any = None
) -> tuple[Loaded, Loaded | None, Loaded | None]:
    """The SB run (``sb``, default the first selective run kept, ``sb_`` ones first), the
    Traditional run of the same seed, and the SB strategy's run with flipped labels (10% when
    there is one), each None where the folder lacks it."""
    clean = [x for x in loaded if x.run.noise == 0]
    if seed is not None:
        clean = [x for x in clean if x.run.seed == seed]
    if sb is None:
        selective = [x for x in clean if get(x.run.strategy).selective]
        selective.sort(key=lambda x: (not x.run.strategy.startswith("sb_"), x.run.seed))
        if not selective:
            raise ValueError(
                "the folder has no selective run with saved arrays; run the benchmark with "
                "keep_outputs (python3 benchmarks/run.py --preset analysis)"
            )
        chosen = selective[0]
    else:
        named = [x for x in clean if x.run.strategy == sb]
        if not named:
            kept = sorted({x.run.strategy for x in clean})
            raise ValueError(f"sb={sb!r} has no run with saved arrays here; runs kept: {kept}")
        chosen = named[0]
    s = chosen.run.seed
    trad = next((x for x in clean if x.run.strategy == traditional and x.run.seed == s), None)
    noisy = [x for x in loaded if x.run.strategy == chosen.run.strategy and x.run.seed == s]
    noisy = [x for x in noisy if x.run.noise > 0]
    noisy.sort(key=lambda x: abs(x.run.noise - 0.1))
    return chosen, trad, noisy[0] if noisy else None


def evaluation(x: Loaded, i: int, label: str) -> Evaluation:
    """The ``i``-th kept evaluation of a run."""
    a = x.arrays
    conf = a["eval_confidence"][i].astype(np.float64)
    correct = a["eval_predicted"][i].astype(np.int64) == a["test_targets"]
    return Evaluation(
        label, float(a["eval_position"][i]), float(a["eval_time_s"][i]), conf, correct
    )


def _nearest(values: np.ndarray, target: float) -> int:
    """The position of the value nearest ``target`` (the earlier one on a tie)."""
    return int(np.argmin(np.abs(values - target)))


def selection_counts(x: Loaded, skip: int) -> np.ndarray:
    """Times each example was yielded in the run's epochs from ``skip`` on (float64), NaN for
    the examples the run never saw (those EL2N pruned before a Diet-SB run).

    NOTE: a pruned example was never a candidate, so its count of 0 says nothing of how SB
    ranks it. Counted as 0, the pruned examples (by construction EL2N's lowest) were taken
    for SB's least used: over random data a Diet-SB run's "SB least used vs EL2N lowest"
    overlap at 30% read 0.61, against 0.33 over the examples it could choose from."""
    counts = x.arrays["selected"][skip:].sum(axis=0, dtype=np.int64).astype(np.float64)
    counts[x.arrays["seen"] == 0] = np.nan
    return counts


def analyse(
    loaded: list[Loaded],
    el2n: dict[str, np.ndarray],
    sb: str | None = None,
    traditional: str = "traditional",
    seed: Any = None,
) -> Analysis:
    """The whole analysis of the chosen runs (see :func:`pick`) and EL2N scores (by model
    name, the first one the ranking compared with SB's)."""
    sb_run, trad, noisy = pick(loaded, sb, traditional, seed)
    warm = _warmup(sb_run.run.strategy, sb_run.run.planned_epochs)
    an = Analysis(sb_run, trad, noisy, el2n, warm)

    # Figures 8 and 9: SB's final model against Traditional's after the same epochs and after
    # the same wall-clock (its evaluation nearest in position, in time).
    final = evaluation(sb_run, -1, f"SB: {sb_run.run.strategy}")
    an.evaluations.append(final)
    if trad is not None:
        pos, times = trad.arrays["eval_position"], trad.arrays["eval_time_s"]
        i = _nearest(pos, final.position)
        j = _nearest(times, final.time_s)
        an.evaluations.append(
            evaluation(trad, i, f"Traditional, same epochs ({pos[i]:g} ep, {times[i]:.0f} s)")
        )
        an.evaluations.append(
            evaluation(trad, j, f"Traditional, same wall-clock ({pos[j]:g} ep, {times[j]:.0f} s)")
        )
    for ev in an.evaluations:
        an.inverse_cdf[ev.label] = A.confidence_percentiles(ev.confidence, an.percentiles)
        an.binned[ev.label] = A.binned_accuracy(ev.confidence, ev.correct, BINS)

    # Selection: counts over SB's selective epochs, their frequency and their stability.
    an.counts = selection_counts(sb_run, warm)
    candidates = ~np.isnan(an.counts)
    epochs = sb_run.arrays["selected"].shape[0]
    seen = sb_run.arrays["seen"].astype(np.int64) * (epochs - warm) // max(epochs, 1)
    an.frequency = A.selection_frequency(np.nan_to_num(an.counts).astype(np.int64), seen)
    chosen = sb_run.arrays["selected"] > 0
    an.stability = A.selection_stability(chosen)
    # (random selections are drawn from the candidates, at the share of them selected)
    rates = chosen[:, candidates].mean(axis=1)
    p, q = rates[:-1], rates[1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        an.stability_random = p * q / (p + q - p * q)

    # Overlaps: EL2N of two models; SB's least used against EL2N's lowest.
    n = int(candidates.sum())
    an.random_overlap = A.random_overlap(n, FRACTIONS)
    an.random_band = A.random_overlap_band(n, FRACTIONS, np.random.default_rng(0))
    names = list(el2n)
    if len(names) >= 2:
        a, b = el2n[names[0]], el2n[names[1]]
        an.overlaps[f"EL2N {names[0]} vs EL2N {names[1]} (lowest)"] = A.overlap_curve(
            a, b, FRACTIONS
        )
    if names:
        scores = el2n[names[0]]
        both = candidates & ~np.isnan(scores)
        an.overlaps[f"SB least used vs EL2N {names[0]} lowest"] = A.overlap_curve(
            an.counts[both], scores[both], FRACTIONS, ties="expected"
        )

    an.galleries = _galleries(an)
    if noisy is not None and len(noisy.arrays["flipped"]):
        an.noisy_counts = selection_counts(
            noisy, _warmup(noisy.run.strategy, noisy.run.planned_epochs)
        )
        k = max(1, round(0.1 * int((~np.isnan(an.noisy_counts)).sum())))
        an.noise = A.flipped_share(noisy.arrays["flipped"], an.noisy_counts, k, ties="expected")
        key = an.noisy_counts + 0.5 * _rank01(noisy.arrays["train_loss"].astype(np.float64))
        an.noisy_gallery = Gallery(
            f"Most used with {100 * noisy.run.noise:g}% of labels flipped",
            A.gallery_indices(key, GALLERY, direction="highest"),
            an.noisy_counts,
            "selected",
            "the examples SB selected most often when labels were flipped (ties: the highest "
            "final loss first); flipped ones in red, the true label in brackets",
        )
    an.class_rates = _class_rates(sb_run.run)
    an.numbers = headline(an)
    return an


def _galleries(an: Analysis) -> list[Gallery]:
    loss = an.sb.arrays["train_loss"].astype(np.float64)
    out = [
        Gallery(
            "Easiest",
            A.gallery_indices(loss, GALLERY),
            loss,
            "loss",
            "the lowest loss of SB's final model (on the labels it trained on)",
        ),
        Gallery(
            "Hardest",
            A.gallery_indices(loss, GALLERY, direction="highest"),
            loss,
            "loss",
            "the highest loss of SB's final model",
        ),
    ]
    counts = an.counts
    # Counts tie in large groups: within a count, by the final loss (a rank below 0.5), so the
    # least used are shown easiest first and the most used hardest first.
    key = counts + 0.5 * _rank01(loss)
    out.append(
        Gallery(
            "Least used",
            A.gallery_indices(key, GALLERY),
            counts,
            "selected",
            f"selected least often by SB after its {an.warmup} warm-up epochs (ties: the lowest "
            "final loss first)",
        )
    )
    out.append(
        Gallery(
            "Most used",
            A.gallery_indices(key, GALLERY, direction="highest"),
            counts,
            "selected",
            "selected most often by SB (ties: the highest final loss first)",
        )
    )
    if an.el2n:
        name, scores = next(iter(an.el2n.items()))
        out.append(
            Gallery(
                f"Lowest EL2N ({name})",
                A.gallery_indices(scores, GALLERY),
                scores,
                "EL2N",
                f"the lowest EL2N score of {name}: what EL2N pruning drops first",
            )
        )
        combined = A.combined_rank(scores, counts)
        out.append(
            Gallery(
                "Lowest combined rank",
                A.gallery_indices(combined, GALLERY),
                combined,
                "rank sum",
                f"the lowest sum of ranks by EL2N ({name}) and by SB's selection count: easy for "
                "both",
            )
        )
    return out


def _rank01(values: np.ndarray) -> np.ndarray:
    """Each value's rank scaled into [0, 1) (ties by index)."""
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[np.lexsort((np.arange(values.size), values))] = np.arange(values.size)
    return ranks / max(values.size, 1)


def _class_rates(run: Run) -> np.ndarray | None:
    """Per epoch and class, the selection rate (NaN where not counted)."""
    rows = [e.get("class_selection_rates") for e in run.epochs]
    width = max((len(r) for r in rows if r), default=0)
    if not width:
        return None
    out = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = [np.nan if v is None else v for v in r]
    return out


def _at(fracs: np.ndarray, curve: np.ndarray, f: float) -> float:
    return float(curve[int(np.argmin(np.abs(fracs - f)))])


def headline(an: Analysis) -> dict[str, Any]:
    """The numbers the report (and the README) quote, named."""
    out: dict[str, Any] = {}
    b = PERCENTILE * BINS // 100 - 1  # the bin ending at the PERCENTILE-th percentile
    low = PERCENTILE - 100 // BINS
    for ev in an.evaluations:
        out[f"accuracy in the {low}-{PERCENTILE}th confidence percentiles: {ev.label}"] = float(
            an.binned[ev.label].accuracy[b]
        )
        least = np.lexsort((np.arange(ev.confidence.size), ev.confidence))
        least = least[: round(PERCENTILE / 100 * ev.confidence.size)]
        out[f"accuracy of the {PERCENTILE}% least confident: {ev.label}"] = float(
            ev.correct[least].mean() if least.size else np.nan
        )
        out[f"confidence at the {PERCENTILE}th percentile: {ev.label}"] = float(
            an.inverse_cdf[ev.label][PERCENTILE]
        )
        out[f"test error: {ev.label}"] = float(1 - ev.correct.mean())
    for name, curve in an.overlaps.items():
        for f in REPORTED:
            out[f"overlap at {100 * f:g}%: {name}"] = _at(FRACTIONS, curve, f)
    for f in REPORTED:
        out[f"overlap at {100 * f:g}%: two random rankings"] = _at(FRACTIONS, an.random_overlap, f)
    finite = an.stability[~np.isnan(an.stability)]
    if finite.size:
        out["selected-set Jaccard, consecutive epochs (mean)"] = float(finite.mean())
    if an.noise is not None and an.noisy is not None:
        pct = f"{100 * an.noisy.run.noise:g}%"
        out[f"flipped share among the 10% most selected ({pct} flipped)"] = an.noise.share
        out[f"flipped share expected at random ({pct} flipped)"] = an.noise.expected
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def el2n_scores_of(folder: Path, models: tuple[str, ...], seed: int) -> dict[str, np.ndarray]:
    """The saved EL2N scores of ``models`` for ``seed`` (those saved; in ``models``' order)."""
    out = {}
    for m in models:
        path = el2n_path(folder, m, seed)
        if path.exists():
            out[m] = load_el2n(path)
    return out
