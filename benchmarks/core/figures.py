"""The per-example analysis's figures (PNG): SB's Figures 8 and 9, the overlap curves, selection
frequency, stability and rate by class, and galleries of training images with labels and scores.
Each function writes one file and returns a :class:`Figure` saying what it shows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .findings import BINS, FRACTIONS, Analysis, Gallery

FASHION_MNIST_CLASSES = (
    "T-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "boot",
)
"""Fashion-MNIST's class names, by label."""


@dataclass
class Figure:
    """A written figure: its file (relative to the report), title and caption."""

    path: Path
    title: str
    caption: str


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    plt = _plt()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def confidence_cdf(an: Analysis, out: Path) -> Figure:
    """SB's Figure 8: the inverse CDF of target confidence on the test set."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for ev in an.evaluations:
        ax.plot(an.percentiles, an.inverse_cdf[ev.label], label=ev.label)
    ax.set(
        xlabel="percentile of test examples",
        ylabel="target confidence (softmax at the true class)",
        title="Figure 8: target confidence, inverse CDF",
        ylim=(0, 1.02),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return Figure(
        _save(fig, out / "fig8_confidence_cdf.png"),
        "Figure 8: target confidence on the test set",
        "The confidence each test example's true class gets, sorted (inverse CDF): the lower "
        "percentiles are the hardest examples. SB's final model against Traditional's after "
        "the same epochs and after the same training wall-clock (its evaluation nearest in "
        "time).",
    )


def accuracy_bins(an: Analysis, out: Path) -> Figure:
    """SB's Figure 9: accuracy per target-confidence percentile bin."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    k = len(an.evaluations)
    width = 0.8 / max(k, 1)
    centres = (np.arange(BINS) + 0.5) * 100 / BINS
    for i, ev in enumerate(an.evaluations):
        acc = an.binned[ev.label].accuracy
        offset = (i - (k - 1) / 2) * width * 100 / BINS
        ax.bar(centres + offset, 100 * acc, width=width * 100 / BINS, label=ev.label)
    ax.set(
        xlabel="target-confidence percentile bin (each 5% of the test set)",
        ylabel="accuracy in the bin (%)",
        title="Figure 9: accuracy by target-confidence percentile",
        xlim=(0, 100),
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return Figure(
        _save(fig, out / "fig9_accuracy_by_confidence.png"),
        "Figure 9: accuracy per confidence percentile bin",
        "Each model's test examples sorted by its own target confidence and cut into bins of "
        "5%: the accuracy within each bin. Gains in the first bins are gains on the hardest "
        "examples.",
    )


def overlaps(an: Analysis, out: Path) -> Figure:
    """The Diet-SB poster's overlap curves, with two random rankings' overlap and 95% band."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = 100 * FRACTIONS
    ax.fill_between(
        x, 100 * an.random_band[0], 100 * an.random_band[1], color="0.85", label="random (95%)"
    )
    ax.plot(x, 100 * an.random_overlap, "k--", lw=1, label="two random rankings")
    for name, curve in an.overlaps.items():
        ax.plot(x, 100 * curve, "o-", ms=3, label=name)
    ax.set(
        xlabel="fraction of the training set (lowest-ranked, %)",
        ylabel="overlap (% of the fraction in both)",
        title="Do two rankings pick the same examples?",
        xlim=(0, 100),
        ylim=(0, 100),
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return Figure(
        _save(fig, out / "overlap.png"),
        "Overlap of rankings",
        "At each fraction f, the share of one ranking's lowest f that is also in the other's "
        "lowest f: EL2N of the two architectures (what EL2N pruning would drop), and the "
        "examples SB used least against EL2N's lowest. Two random rankings overlap by f.",
    )


def selection_frequency(an: Analysis, out: Path) -> Figure:
    """Histogram of selection frequency (and, with a noisy run, flipped against clean)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.linspace(0, 1, 21)
    freq = an.frequency[~np.isnan(an.frequency)]
    ax.hist(freq, bins=bins, alpha=0.8, label=an.sb.label)
    caption = (
        "How often each training example was selected when seen (times selected / times "
        f"seen), over SB's epochs after its {an.warmup} warm-up epoch(s)."
    )
    if an.noisy is not None and an.noisy_counts is not None:
        noisy = an.noisy
        epochs = noisy.arrays["selected"].shape[0] - an.warmup
        f = an.noisy_counts / max(epochs, 1)
        flipped = np.zeros(f.size, dtype=bool)
        flipped[noisy.arrays["flipped"]] = True
        seen = ~np.isnan(f)  # (not the examples pruned before the run)
        clean, dirty = f[~flipped & seen], f[flipped & seen]
        ax.hist(clean, bins=bins, histtype="step", lw=1.5, label=f"{noisy.label}: clean")
        ax.hist(dirty, bins=bins, histtype="step", lw=1.5, label=f"{noisy.label}: flipped")
        caption += " With labels flipped, the flipped examples apart from the others."
    ax.set(xlabel="selection frequency", ylabel="training examples", title="Selection frequency")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    return Figure(_save(fig, out / "selection_frequency.png"), "Selection frequency", caption)


def stability(an: Analysis, out: Path) -> Figure:
    """Jaccard index of consecutive epochs' selected sets, against random selections."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    pairs = np.arange(1, an.stability.size + 1)
    ax.plot(pairs, an.stability, "o-", label=an.sb.label)
    ax.plot(pairs, an.stability_random, "k--", lw=1, label="random selections at the same rates")
    ax.set(
        xlabel="epoch e (against e - 1)",
        ylabel="Jaccard of selected sets",
        title="Does SB select the same examples every epoch?",
        ylim=(0, 1),
    )
    ax.set_xticks(pairs)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return Figure(
        _save(fig, out / "selection_stability.png"),
        "Selected-set stability",
        "The Jaccard index (shared / either) of the examples yielded in consecutive epochs "
        "(epoch 0 is the warm-up when there is one); the dashed line is what independent random "
        "selections at the same rates would give.",
    )


def class_rates(an: Analysis, out: Path, names: Sequence[str] = FASHION_MNIST_CLASSES) -> Figure:
    """Selection rate by class and epoch (``loader.stats``)."""
    plt = _plt()
    rates = an.class_rates
    assert rates is not None
    fig, ax = plt.subplots(figsize=(7, 0.35 * rates.shape[0] + 1.5))
    im = ax.imshow(rates, aspect="auto", cmap="viridis", vmin=0, vmax=max(np.nanmax(rates), 1e-9))
    for (i, j), v in np.ndenumerate(rates):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w")
    labels = [names[c] if c < len(names) else str(c) for c in range(rates.shape[1])]
    ax.set_xticks(range(rates.shape[1]), labels, rotation=45, fontsize=7)
    ax.set_yticks(range(rates.shape[0]))
    ax.set(xlabel="class", ylabel="epoch", title="Selection rate by class (does SB starve one?)")
    fig.colorbar(im, ax=ax)
    return Figure(
        _save(fig, out / "class_rates.png"),
        "Selection rate by class",
        "The share of each class's candidates selected in each epoch, from "
        "loader.stats.current.class_selection_rates.",
    )


def gallery(
    g: Gallery,
    images: np.ndarray,
    labels: np.ndarray,
    out: Path,
    true_labels: np.ndarray | None = None,
    names: Sequence[str] = FASHION_MNIST_CLASSES,
) -> Figure:
    """A grid of training images with their label and score (a flipped label shows the true
    one in brackets, in red)."""
    plt = _plt()
    cols = 8
    rows = max(1, -(-len(g.indices) // cols))
    h, w = images.shape[-2], images.shape[-1]
    pad, head = 2, 14  # pixels between tiles, and above each for its two lines of text
    # NOTE: one mosaic in one axes, not an axes per image: a figure of 16 axes takes seconds.
    mosaic = np.full((rows * (h + head + pad), cols * (w + pad)), np.nan)
    fig, ax = plt.subplots(figsize=(cols * 1.1, rows * 1.5))
    for k, i in enumerate(g.indices.tolist()):
        r, c = divmod(k, cols)
        top, left = r * (h + head + pad) + head, c * (w + pad)
        tile = images[i].reshape(h, w).astype(np.float64)
        span = float(tile.max() - tile.min()) or 1.0
        mosaic[top : top + h, left : left + w] = (tile - tile.min()) / span
        label = int(labels[i])
        text = names[label] if label < len(names) else str(label)
        flipped = true_labels is not None and int(true_labels[i]) != label
        if flipped and true_labels is not None:
            text += f" ({names[int(true_labels[i])]})"
        ax.text(
            left + w / 2,
            top - 1,
            f"{text}\n{g.score_name} {g.scores[i]:.3g}",
            ha="center",
            va="bottom",
            fontsize=5.5,
            color="red" if flipped else "black",
        )
    ax.imshow(mosaic, cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
    ax.axis("off")
    fig.suptitle(g.title, fontsize=9)
    slug = "".join(c if c.isalnum() else "_" for c in g.title.lower()).strip("_")
    return Figure(_save(fig, out / f"gallery_{slug}.png"), f"Gallery: {g.title}", g.caption)


def all_figures(
    an: Analysis,
    out: Path,
    images: np.ndarray,
    true_labels: np.ndarray | None = None,
) -> list[Figure]:
    """Every figure the analysis has data for, written into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    figs = [confidence_cdf(an, out), accuracy_bins(an, out)]
    if an.overlaps:
        figs.append(overlaps(an, out))
    figs += [selection_frequency(an, out), stability(an, out)]
    if an.class_rates is not None:
        figs.append(class_rates(an, out))
    labels = an.sb.arrays["labels"]
    figs += [gallery(g, images, labels, out) for g in an.galleries]
    if an.noisy is not None and an.noisy_gallery is not None:
        figs.append(gallery(an.noisy_gallery, images, an.noisy.arrays["labels"], out, true_labels))
    return figs
