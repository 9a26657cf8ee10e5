"""What an epoch iterator uses of its loader: the contract between a
:class:`~sbloader.SelectiveLoader` and its :class:`~sbloader.epoch.EpochIterator`, declared.

NOTE (one declared contract): configuration apart from iteration, as torch's DataLoader has it:
the loader holds the options, the collaborators it builds from them (the source, the codec, the
scorer, the ranks' synchronisation) and the state that crosses epochs (the rows selected and not
handed out yet, the source's position, what the last epoch left); the iterator owns one epoch
and reads and updates that state through the members below, and nothing else of the loader.
``EpochIterator`` refers to its loader as an :class:`EpochHost`, so the type checker refuses any
other access, and ``SelectiveLoader`` is checked to provide every member (the assignment at the
end of :mod:`sbloader.loader`). The members keep their leading underscore: they are the
package's own, not the user's API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import torch

    from .codec import BatchCodec
    from .device_decisions import DecisionGenerator
    from .distributed import RankSync
    from .epoch import EpochIterator
    from .length import FixedEpochs
    from .overlap import AheadScores, SelectionCopy
    from .policies import Policy
    from .rows import PendingRows, Rows, WholeBatch
    from .scoring import Scorer
    from .sources import Source
    from .stats import EpochStats

__all__ = ["EpochHost"]


class EpochHost(Protocol):
    """The members of a :class:`~sbloader.SelectiveLoader` its epoch iterator uses.

    Options (read only): ``policy``, ``batch_size``, ``min_batch_size``, ``remainder``,
    ``nonfinite``, ``cdf``, ``prefetch``, ``device``, ``source``, ``epoch``.

    Collaborators, built from the options (read only): ``_source``, ``_codec``, ``_scorer``,
    ``_sync`` (None on one process), ``_decider`` (device-side decisions, or None), ``_overlap``
    (the selection copy of ``overlap_selection``, or None), ``_subset`` (a mask, or None),
    ``_fixed`` (``batches_per_epoch``'s count, or None), ``_rng``.

    State crossing epochs (read and updated by the iterator): ``_pending`` (rows selected and not
    handed out), ``_source_state`` (the source's state as the current source batch was taken),
    ``_probed`` (the model and loss were checked on a source batch), ``_epoch_prefilter``,
    ``_share`` / ``_ahead`` (what an epoch left part-way agreed and scored ahead),
    ``_returned`` (rows a saved state took back), ``_counted_full`` /
    ``_counted_full_warned``.

    Steps of the loader's own (the epoch's beginning, end and abandonment, and what they decide
    from the loader's whole state): ``_begin``, ``_end``, ``_abandon``, ``_keep_ended``,
    ``_sharing``; and ``_new_pass`` (a pass's iterator, for the training-epoch iterator of
    ``batches_per_epoch``, :class:`~sbloader.length.FixedEpochIterator`, which reads its loader
    through this contract too).
    """

    # ------------------------------------------------------------------ options
    policy: Policy
    batch_size: int
    min_batch_size: int
    remainder: str

    @property
    def last_batch_min(self) -> int: ...

    nonfinite: str
    cdf: str
    epoch: int

    @property
    def prefetch(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def source(self) -> Source: ...

    # ------------------------------------------------------------------ collaborators
    _source: Source
    _codec: BatchCodec
    _scorer: Scorer
    _sync: RankSync | None
    _decider: DecisionGenerator | None
    _overlap: SelectionCopy | None
    _subset: np.ndarray | None
    _fixed: FixedEpochs | None
    _rng: np.random.Generator

    # ------------------------------------------------------------------ state crossing epochs
    _pending: PendingRows
    _source_state: dict[str, Any] | None
    _probed: bool
    _epoch_prefilter: bool
    _share: float | None
    _ahead: AheadScores | None
    _returned: list[Rows]
    _orphans: list[EpochIterator]
    _counted_full: bool
    _counted_full_warned: bool

    # ------------------------------------------------------------------ the loader's steps
    def _begin(self, it: EpochIterator) -> tuple[int, int, bool, EpochStats, list[Rows]]: ...

    def _end(self, it: EpochIterator) -> None: ...

    def _abandon(
        self,
        it: EpochIterator,
        resumable: bool,
        handed: Sequence[Rows | WholeBatch] = (),
        why: str = "",
    ) -> None: ...

    def _keep_ended(self) -> None: ...

    def _sharing(self) -> bool: ...

    def _new_pass(self) -> EpochIterator: ...
