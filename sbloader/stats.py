"""Counters and timers of a SelectiveLoader, per epoch and in total."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COUNT_FIELDS", "TIME_FIELDS", "EpochStats", "LoaderStats"]

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
TIME_FIELDS = ("selection_s", "selection_forward_s", "source_s", "consumer_s", "wall_s")


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
            (and a frozen prefix's); the rest is the policy's decision.
        source_s: seconds spent waiting for the source's next batch.
        consumer_s: seconds the caller spent between batches (the training step).
        wall_s: seconds from the epoch's start to its end.
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
    source_s: float = 0.0
    consumer_s: float = 0.0
    wall_s: float = 0.0

    @property
    def selection_rate(self) -> float:
        """The realized fraction of seen candidates selected (compare with ``target_rate``)."""
        return self.examples_selected / self.examples_seen if self.examples_seen else float("nan")

    @property
    def overhead_s(self) -> float:
        """Wall-clock spent in the loader itself: neither selection, source nor the caller."""
        return max(0.0, self.wall_s - self.selection_s - self.source_s - self.consumer_s)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["selection_rate"] = self.selection_rate
        d["overhead_s"] = self.overhead_s
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
        if t.examples_seen:
            t.target_rate = (
                sum(e.target_rate * e.examples_seen for e in self.epochs) / t.examples_seen
            )
        return t

    def log_epoch(self, e: EpochStats) -> None:
        logger.info(
            "epoch %d: seen %d, selection forwards %d, selected %d (rate %.3f, target %.3f), "
            "yielded %d in %d batches, non-finite %d, dropped %d; selection %.2fs, source %.2fs, "
            "caller %.2fs, wall %.2fs",
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
        )

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": [dataclasses.asdict(e) for e in self.epochs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs = [EpochStats(**e) for e in state["epochs"]]
