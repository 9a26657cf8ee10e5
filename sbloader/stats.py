"""Counters and timers of a SelectiveLoader, per epoch and in total."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["CLASS_FIELDS", "COUNT_FIELDS", "TIME_FIELDS", "EpochStats", "LoaderStats"]

logger = logging.getLogger("sbloader")

#: The count fields of :class:`EpochStats` (summed across epochs and ranks).
COUNT_FIELDS = (
    "examples_seen",
    "selection_forwards",
    "selection_calls",
    "examples_selected",
    "examples_yielded",
    "batches_yielded",
    "nonfinite",
    "dropped",
    "prefiltered",
    "excluded",
    "prefix_forwards",
    "feedback",
)
#: The time fields of :class:`EpochStats`, in seconds (summed across epochs, max across ranks).
TIME_FIELDS = (
    "selection_s",
    "selection_forward_s",
    "selection_hidden_s",
    "source_s",
    "consumer_s",
    "wall_s",
)
#: The per-class count fields of :class:`EpochStats` (int64 arrays indexed by class, or None).
CLASS_FIELDS = ("class_seen", "class_selected")
#: Up to this many classes, the epoch log line shows every class's selection rate.
_LOGGED_CLASSES = 20
#: Targets of this value or more are not counted as classes (see EpochStats.count_classes).
_MAX_CLASSES = 1 << 20


def _no_classes() -> np.ndarray | None:
    return np.zeros(0, dtype=np.int64)


def _class_counts(targets: Any) -> np.ndarray | None:
    """Targets as int64 class indices on the host, or None where they are not class indices on
    the CPU (see :meth:`EpochStats.count_classes`)."""
    if isinstance(targets, torch.Tensor):
        if targets.dim() != 1 or not targets.is_cpu or targets.dtype == torch.bool:
            return None
        if targets.is_floating_point() or targets.is_complex():
            return None
        return targets.numpy()
    if isinstance(targets, np.ndarray):
        if targets.ndim != 1 or targets.dtype.kind not in "iu":
            return None
        return targets
    return None


def _add(total: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``total + counts`` for per-class counts of possibly different lengths (the longer one)."""
    if counts.size > total.size:
        total, counts = counts, total
    out = total.copy()
    out[: counts.size] += counts
    return out


def _accumulate(total: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``total + counts`` in ``total`` itself where it is long enough (an epoch's own running
    counts, added to once per source batch), else as :func:`_add`."""
    if counts.size > total.size:
        return _add(total, counts)
    total[: counts.size] += counts
    return total


@dataclass
class EpochStats:
    """What one epoch (or, summed, several) cost and chose.

    Attributes:
        epoch: the epoch number (-1 for totals).
        examples_seen: candidates drawn from the source.
        selection_forwards: examples forwarded in selection passes.
        selection_calls: selection-pass model calls (one per selection chunk).
        examples_selected: candidates the policy chose (with multiplicity).
        examples_yielded: examples yielded for backprop (carried-over ones count when yielded).
        batches_yielded: training batches yielded.
        nonfinite: candidates whose selection loss was NaN or infinite.
        dropped: selected examples dropped at the end of an epoch (``remainder="drop"``, or a
            short batch below ``min_batch_size``).
        prefiltered: candidates the policy rejected before loading (Stale-SB's stale epochs);
            they are counted in ``examples_seen`` too.
        excluded: candidates outside the loader's ``subset`` (not loaded where the source can
            filter, dropped after loading where it cannot); not in ``examples_seen``.
        prefix_forwards: examples run through a ``frozen_prefix`` (with ``cache_features``, only
            those not cached yet, and the few recomputed to check the cache).
        feedback: training-step losses reported through ``loader.feedback`` in the epoch.
        target_rate: the policy's expected selection rate.
        selection_s: seconds spent in selection passes (model forward and policy).
        selection_forward_s: the part of ``selection_s`` spent in the selection model's forward
            (and a frozen prefix's); the rest is the policy's decision. With
            ``overlap_selection``, only the time spent waiting for a pass on the selection thread.
            With ``decisions="device"`` on a GPU, the forward's GPU time where it is longer than
            the time to queue it (measured with CUDA events, no added synchronisation).
        selection_hidden_s: with ``overlap_selection``, the seconds of selection passes that ran
            on the selection thread while the caller trained (not in ``selection_s``): the part
            of the selection cost the overlap hid. 0 without it.
        source_s: seconds spent waiting for the source's next batch.
        consumer_s: seconds the caller spent between batches (the training step).
        wall_s: seconds from the epoch's start to its end.
        class_seen: candidates loaded per class (int64, indexed by class; the length is the
            highest class seen plus one), or None where the targets are not class indices on the
            CPU (see :meth:`count_classes`).
        class_selected: candidates selected per class (with multiplicity), or None likewise.

    Example:
        The stats of an epoch that kept every example after a selection pass:

        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import sbloader
        >>> data = TensorDataset(torch.randn(12, 4), torch.tensor([0, 1, 1] * 4))
        >>> loader = sbloader.SelectiveLoader(
        ...     DataLoader(data, batch_size=4), torch.nn.Linear(4, 2),
        ...     policy=sbloader.SelectiveBackprop(beta=0), batch_size=4)
        >>> _ = list(loader)
        >>> e = loader.stats.current
        >>> e.epoch, e.examples_seen, e.selection_forwards, e.examples_selected, e.batches_yielded
        (0, 12, 12, 12, 3)
        >>> e.selection_rate, e.class_seen.tolist(), e.class_selected.tolist()
        (1.0, [4, 8], [4, 8])
    """

    epoch: int = -1
    examples_seen: int = 0
    selection_forwards: int = 0
    selection_calls: int = 0
    examples_selected: int = 0
    examples_yielded: int = 0
    batches_yielded: int = 0
    nonfinite: int = 0
    dropped: int = 0
    prefiltered: int = 0
    excluded: int = 0
    prefix_forwards: int = 0
    feedback: int = 0
    target_rate: float = 1.0
    selection_s: float = 0.0
    selection_forward_s: float = 0.0
    selection_hidden_s: float = 0.0
    source_s: float = 0.0
    consumer_s: float = 0.0
    wall_s: float = 0.0
    # NOTE: arrays take no part in ==, which would be ambiguous for them; compare as_dict()s.
    class_seen: np.ndarray | None = field(default_factory=_no_classes, compare=False)
    class_selected: np.ndarray | None = field(default_factory=_no_classes, compare=False)

    def __post_init__(self) -> None:
        # Restored states and as_dict() hold lists; the counts are int64 arrays.
        for name in CLASS_FIELDS:
            value = getattr(self, name)
            if value is not None:
                # A copy: count_classes adds to these arrays in place.
                setattr(self, name, np.array(value, dtype=np.int64).reshape(-1))

    def count_classes(self, targets: Any, positions: np.ndarray | None) -> None:
        """Count one source batch's candidates by class, and those selected (``positions``;
        None: all of them).

        NOTE: class counting is one ``numpy.bincount`` per source batch, so it is done only where
        it is that cheap: 1-d integer class indices >= 0 on the CPU (tensors or numpy arrays),
        below ``2 ** 20``. Other targets (sequences, regression values, an ignore index, integer
        values such as counts, prices in cents or timestamps, whose counts by value would be an
        array as long as the largest of them, tensors on an accelerator, where reading them
        would synchronise with the device every source batch) leave the epoch's class counts at
        None: unknown rather than partial.

        Example:
            >>> e = EpochStats()
            >>> e.count_classes(np.array([0, 1, 1, 2]), np.array([1, 3]))
            >>> e.class_seen.tolist(), e.class_selected.tolist()
            ([1, 2, 1], [0, 1, 1])
            >>> e.class_selection_rates.tolist()
            [0.0, 0.5, 1.0]
        """
        if self.class_seen is None or self.class_selected is None:
            return
        values = _class_counts(targets)
        if values is None or (values.size and values.max() >= _MAX_CLASSES):
            self.class_seen = self.class_selected = None
            return
        try:
            seen = np.bincount(values)
        except ValueError:  # a negative target (e.g. an ignore index): no class indices
            self.class_seen = self.class_selected = None
            return
        self.class_seen = _accumulate(self.class_seen, seen)
        chosen = seen if positions is None else np.bincount(values[positions], minlength=seen.size)
        self.class_selected = _accumulate(self.class_selected, chosen)

    @property
    def class_selection_rates(self) -> np.ndarray | None:
        """Per class, the fraction of its candidates selected (float64, NaN for a class not
        seen): does the selection starve a class?

        None where the classes were not counted (see :meth:`count_classes`), and in epochs whose
        policy rejected candidates before loading them (Stale-SB's stale epochs with a
        DataLoader source: the class of a candidate never loaded is unknown, so
        ``class_seen`` holds only the loaded ones).
        """
        if self.class_seen is None or self.class_selected is None or self.prefiltered:
            return None
        seen = np.zeros(max(self.class_seen.size, self.class_selected.size), dtype=np.int64)
        seen[: self.class_seen.size] = self.class_seen
        rates = np.full(seen.size, np.nan, dtype=np.float64)
        selected = _add(self.class_selected, np.zeros(seen.size, dtype=np.int64))
        np.divide(selected, seen, out=rates, where=seen > 0)
        return rates

    @property
    def selection_rate(self) -> float:
        """The realized fraction of seen candidates selected (compare with ``target_rate``)."""
        return self.examples_selected / self.examples_seen if self.examples_seen else float("nan")

    @property
    def overhead_s(self) -> float:
        """Wall-clock spent in the loader itself: neither selection, source nor the caller."""
        return max(0.0, self.wall_s - self.selection_s - self.source_s - self.consumer_s)

    def as_dict(self) -> dict[str, Any]:
        """Every field and derived rate as plain Python values (JSON-ready: class counts and
        rates as lists or None, the rate of a class not seen None rather than NaN)."""
        d = self._plain()
        rates = self.class_selection_rates
        d["class_selection_rates"] = (
            None if rates is None else [None if r != r else r for r in rates.tolist()]
        )
        d["selection_rate"] = self.selection_rate
        d["overhead_s"] = self.overhead_s
        return d

    def _plain(self) -> dict[str, Any]:
        """The fields, class counts as lists (what a checkpoint holds)."""
        d = dataclasses.asdict(self)
        for name in CLASS_FIELDS:
            value = getattr(self, name)
            d[name] = None if value is None else value.tolist()
        return d


@dataclass
class LoaderStats:
    """Per-epoch :class:`EpochStats` of a loader, with totals.

    Example:
        >>> s = LoaderStats()
        >>> e = s.begin_epoch(0, target_rate=0.5)
        >>> e.examples_seen, e.examples_selected = 10, 4
        >>> s.total.selection_rate
        0.4
    """

    epochs: list[EpochStats] = field(default_factory=list)

    def begin_epoch(self, epoch: int, target_rate: float) -> EpochStats:
        e = EpochStats(epoch=epoch, target_rate=target_rate)
        self.epochs.append(e)
        return e

    @property
    def current(self) -> EpochStats | None:
        """The stats of the latest epoch, or None before the first."""
        return self.epochs[-1] if self.epochs else None

    @property
    def total(self) -> EpochStats:
        """All epochs summed (``target_rate`` weighted by examples seen)."""
        t = EpochStats()
        for e in self.epochs:
            for name in COUNT_FIELDS + TIME_FIELDS:
                setattr(t, name, getattr(t, name) + getattr(e, name))
            for name in CLASS_FIELDS:
                total, counts = getattr(t, name), getattr(e, name)
                setattr(t, name, None if total is None or counts is None else _add(total, counts))
        if t.examples_seen:
            t.target_rate = (
                sum(e.target_rate * e.examples_seen for e in self.epochs) / t.examples_seen
            )
        return t

    def log_epoch(self, e: EpochStats, left: bool = False) -> None:
        """Log one epoch's counts and times (and its selection rate by class, where counted)
        through the ``sbloader`` logger; ``left``: the epoch was left part-way (``break``,
        an error), so the counts are of the part it ran."""
        text = ("epoch %d (left part-way): " if left else "epoch %d: ") + (
            "seen %d, selection forwards %d, selected %d (rate %.3f, target %.3f), "
            "yielded %d in %d batches, non-finite %d, dropped %d; selection %.2fs, source %.2fs, "
            "caller %.2fs, wall %.2fs"
        )
        args: list[Any] = [
            e.epoch,
            e.examples_seen,
            e.selection_forwards,
            e.examples_selected,
            e.selection_rate,
            e.target_rate,
            e.examples_yielded,
            e.batches_yielded,
            e.nonfinite,
            e.dropped,
            e.selection_s,
            e.source_s,
            e.consumer_s,
            e.wall_s,
        ]
        rates = e.class_selection_rates
        if rates is not None and rates.size:
            text += "; selection rate by class: %s"
            args.append(_by_class(rates))
        logger.info(text, *args)

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": [e._plain() for e in self.epochs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs = [EpochStats(**e) for e in state["epochs"]]


def _by_class(rates: np.ndarray) -> str:
    """Class selection rates for the log: all of them for few classes, else the extremes."""
    if rates.size <= _LOGGED_CLASSES:
        return " ".join(f"{c}:{r:.3f}" for c, r in enumerate(rates.tolist()))
    seen = np.flatnonzero(~np.isnan(rates))
    if not seen.size:
        return "no class seen"
    low, high = seen[np.argmin(rates[seen])], seen[np.argmax(rates[seen])]
    return (
        f"lowest {rates[low]:.3f} (class {low}), highest {rates[high]:.3f} (class {high}), "
        f"{seen.size} classes seen"
    )
