"""Selected examples on their way to a training batch: typed rows and the buffer that holds them.

A :class:`Rows` is a block of examples: the source batch's data fields (in the batch format's
key order) and what the selection learned about each example (dataset index, selection loss,
probability, weight), plus the frozen prefix's outputs and the selection pass's model outputs
when the loader keeps them. :class:`PendingRows` collects kept rows until a full training batch
can be cut from them; it is the only place rows are merged and split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch

from . import batch as B
from ._state import taking_rollback

__all__ = ["PendingRows", "Rows", "WholeBatch", "metadata_rows"]


@dataclass(frozen=True)
class Rows:
    """A block of selected examples, one row each in every field.

    Attributes:
        data: the source batch's fields, in the batch format's key order (tensors with the
            examples in dimension 0, or lists).
        indices: int64 CPU tensor of dataset indices (-1 where the source has none).
        losses: float32 selection losses (NaN for examples chosen without a selection pass).
        probabilities: float32, the probability each example was kept with.
        weights: float32 per-example loss weights.
        features: the frozen prefix's outputs for these examples, or None without one.
        logits: the selection pass's model outputs (``keep_logits``), or None when not kept.
            Rows chosen before any selection pass showed the outputs' shape have shape
            ``(k, 0)``; :meth:`concat` widens them to NaN rows of the known shape.

    Example:
        >>> import torch
        >>> r = metadata_rows([torch.arange(4)], None, None, None, 4, torch.device("cpu"))
        >>> head, rest = Rows.concat([r, r]).split(5)
        >>> len(head), len(rest), head.data[0].tolist()
        (5, 3, [0, 1, 2, 3, 0])
    """

    data: list[Any]
    indices: torch.Tensor
    losses: torch.Tensor
    probabilities: torch.Tensor
    weights: torch.Tensor
    features: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def split(self, k: int) -> tuple[Rows, Rows]:
        """The first ``k`` rows and the rest."""
        # NOTE: field by field, without building dicts: this runs for most yielded batches.
        f, g = self.features, self.logits
        head = Rows(
            [B.rows(c, 0, k) for c in self.data],
            self.indices[:k],
            self.losses[:k],
            self.probabilities[:k],
            self.weights[:k],
            None if f is None else f[:k],
            None if g is None else g[:k],
        )
        rest = Rows(
            [B.rows(c, k, None) for c in self.data],
            self.indices[k:],
            self.losses[k:],
            self.probabilities[k:],
            self.weights[k:],
            None if f is None else f[k:],
            None if g is None else g[k:],
        )
        return head, rest

    @staticmethod
    def concat(parts: Sequence[Rows], pads: Mapping[int, Any] | None = None) -> Rows:
        """The rows of ``parts`` in order, as one block.

        Args:
            parts: the blocks.
            pads: the pad value of data fields (by position) whose tensors may differ in their
                trailing sizes from part to part (:func:`sbloader.batch.concat`), or None.
        """
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        features = [p.features for p in parts]
        logits = [p.logits for p in parts]
        pads = pads or {}
        return Rows(
            [B.concat([p.data[j] for p in parts], pads.get(j)) for j in range(len(first.data))],
            torch.cat([p.indices for p in parts]),
            torch.cat([p.losses for p in parts]),
            torch.cat([p.probabilities for p in parts]),
            torch.cat([p.weights for p in parts]),
            _cat_optional(features),
            _cat_optional(logits, widen=True),
        )

    def to(self, device: torch.device) -> Rows:
        """The rows with every tensor except ``indices`` on ``device`` (lists stay lists; nested
        fields' tensors move too)."""

        def move(c: Any) -> Any:
            return B.move(c, device)

        return replace(
            self,
            data=[move(c) for c in self.data],
            losses=move(self.losses),
            probabilities=move(self.probabilities),
            weights=move(self.weights),
            features=move(self.features),
            logits=move(self.logits),
        )

    def copy(self) -> Rows:
        """The rows with every tensor copied (data fields, nested ones too, and the selection
        results), sharing no memory with the source's batches (FFCV reuses its buffers) nor
        with a batch made from these rows, which a training step may change in place (the
        tensors of a list field too: see :func:`_copied`); lists of strings stay as they are.

        Example:
            >>> import torch
            >>> x = torch.zeros(2)
            >>> rows = metadata_rows([x], None, None, None, 2, torch.device("cpu"))
            >>> r = rows.copy()
            >>> x += 1
            >>> rows.weights.mul_(0)
            tensor([0., 0.])
            >>> r.data[0].tolist(), r.weights.tolist()
            ([0.0, 0.0], [1.0, 1.0])
        """

        return Rows(
            [_copied(c) for c in self.data],
            self.indices.clone(),
            self.losses.clone(),
            self.probabilities.clone(),
            self.weights.clone(),
            _copied(self.features),
            _copied(self.logits),
        )

    def state_dict(self) -> dict[str, Any]:
        """The rows as CPU tensors, lists and dicts of them (nested fields), loadable with
        ``torch.load(weights_only=True)``."""
        cpu = self.to(torch.device("cpu"))
        if not taking_rollback():
            # NOTE: copies of tensors already on the CPU: the state must not share memory with
            # batches still to be handed out, which a training step may change in place
            # (``x.mul_(...)``) while the state is held (an in-memory rollback, an asynchronous
            # checkpoint writer). A rollback backup taken by load_state_dict may share them.
            cpu = cpu.owned(self)
        return {
            "data": [B.plain(c) for c in cpu.data],
            "indices": cpu.indices,
            "losses": cpu.losses,
            "probabilities": cpu.probabilities,
            "weights": cpu.weights,
            "features": cpu.features,
            "logits": cpu.logits,
        }

    def owned(self, original: Rows) -> Rows:
        """These rows with copies of every tensor that is still ``original``'s (the same
        object: :meth:`to` moves nothing already on its device)."""

        def own(c: Any, o: Any) -> Any:
            if isinstance(c, torch.Tensor):
                return c.clone() if c is o else c
            if isinstance(c, Mapping) and isinstance(o, Mapping):
                return {k: own(v, o.get(k)) for k, v in c.items()}
            if isinstance(c, list) and isinstance(o, list):  # (one tensor per example)
                return [own(v, w) for v, w in zip(c, o)]
            return c

        return replace(
            self,
            data=[own(c, o) for c, o in zip(self.data, original.data)],
            indices=own(self.indices, original.indices),
            losses=own(self.losses, original.losses),
            probabilities=own(self.probabilities, original.probabilities),
            weights=own(self.weights, original.weights),
            features=own(self.features, original.features),
            logits=own(self.logits, original.logits),
        )

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> Rows:
        """Rows saved by :meth:`state_dict`, moved to ``device`` (copies where they are there
        already, so that the caller's state shares no memory with the batches handed out)."""
        rows = cls(
            data=list(state["data"]),
            indices=state["indices"],
            losses=state["losses"],
            probabilities=state["probabilities"],
            weights=state["weights"],
            features=state.get("features"),
            logits=state.get("logits"),
        )
        moved = rows.to(device)
        return moved if taking_rollback() else moved.owned(rows)


def _cat_optional(chunks: list[torch.Tensor | None], widen: bool = False) -> torch.Tensor | None:
    """The chunks joined, or None when the first is None. ``widen`` (logits): rows of shape
    ``(k, 0)`` widened first (:func:`_widen`), and chunks that differ in their trailing sizes
    (outputs per token of sequences padded to different lengths, see ``pad_values``) padded
    with NaN, the value of logits a selection pass did not give."""
    if chunks[0] is None:
        return None
    tensors = cast(list[torch.Tensor], chunks)
    return B.concat(_widen(tensors), float("nan")) if widen else torch.cat(tensors)


def _widen(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """NaN rows of shape (k, 0) (``keep_logits`` rows made before the outputs' shape was known)
    widened to the shape of the real rows they are batched with."""
    empty = [c.dim() == 2 and c.shape[1] == 0 for c in chunks]
    full = [c for c, e in zip(chunks, empty) if not e]
    if not any(empty) or not full:
        return chunks
    shape = full[0].shape[1:]
    return [
        torch.full((c.shape[0], *shape), float("nan"), dtype=full[0].dtype, device=c.device)
        if e
        else c
        for c, e in zip(chunks, empty)
    ]


def metadata_rows(
    data: list[Any],
    positions: np.ndarray | None,
    choice: Any,
    indices: np.ndarray | None,
    n: int,
    device: torch.device,
    losses: torch.Tensor | None = None,
    features: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    positions_t: torch.Tensor | None = None,
) -> Rows:
    """Rows for the chosen examples of a source batch, whose ``data`` is already gathered.

    Args:
        data: the chosen examples' data columns.
        positions: int64 positions of the chosen examples in the source batch, or None when
            every example of the batch was chosen without a selection pass (probability and
            weight 1; the fast path of passthrough policies).
        choice: the policy's :class:`~sbloader.Choice` (``probabilities`` per candidate,
            ``weights`` per chosen example), or None with ``positions=None``.
        indices: the source batch's dataset indices, or None when the source has none.
        n: the number of chosen examples.
        device: where the metadata tensors go (``indices`` stay on the CPU).
        losses: the source batch's selection losses (where the model computed them), or None.
        features, logits: the chosen rows' :attr:`Rows.features` and :attr:`Rows.logits`.
        positions_t: ``positions`` as a tensor the caller already made (on ``device``), used for
            the losses' gather where they live there instead of copying the positions again.

    NOTE: with ``positions=None`` the columns are made directly instead of through
    :class:`~sbloader.Choice` arrays: the same values, with no per-example numpy work, since
    Traditional pays this on every batch.

    NOTE (one transfer): the probabilities and weights of the chosen rows go to ``device`` as one
    float32 array of two rows, each column a row of it: on a GPU every small host-to-device copy
    costs the host a few microseconds and a synchronisation with pageable memory.

    Example:
        Rows 1 and 3 of a source batch of four, chosen by a policy, their data gathered:

        >>> import numpy as np, torch
        >>> from sbloader import Choice
        >>> choice = Choice(np.array([1, 3]), np.array([0.2, 0.5, 0.2, 0.5]), np.array([2.0, 2.0]))
        >>> r = metadata_rows([torch.tensor([11, 13])], choice.positions, choice,
        ...                   np.array([40, 41, 42, 43]), 2, torch.device("cpu"),
        ...                   losses=torch.tensor([0.1, 0.9, 0.2, 0.8]))
        >>> r.indices.tolist(), r.losses.tolist(), r.probabilities.tolist(), r.weights.tolist()
        ([41, 43], [0.8999999761581421, 0.800000011920929], [0.5, 0.5], [2.0, 2.0])
    """
    if positions is None:
        idx = (
            torch.from_numpy(indices.astype(np.int64))  # a copy: sources may reuse their buffers
            if indices is not None
            else torch.full((n,), -1, dtype=torch.int64)
        )
        ones = torch.ones(n, dtype=torch.float32, device=device)
        nan = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
        return Rows(data, idx, nan, ones, ones.clone(), features, logits)
    idx = torch.from_numpy(
        indices[positions].astype(np.int64) if indices is not None else np.full(n, -1, np.int64)
    )
    if losses is None:
        kept_losses = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    else:
        pos_t = (
            positions_t
            if positions_t is not None and positions_t.device == losses.device
            else torch.from_numpy(positions).to(losses.device, non_blocking=True)
        )
        kept_losses = losses.index_select(0, pos_t)
    both = np.empty((2, n), dtype=np.float32)
    both[0] = choice.probabilities[positions]
    both[1] = choice.weights
    meta = torch.from_numpy(both).to(device)
    return Rows(data, idx, kept_losses, meta[0], meta[1], features, logits)


class WholeBatch:
    """A source batch handed out whole, every example chosen without a selection pass (the
    fast path of passthrough policies): :class:`Rows` whose metadata columns are made only
    when asked for.

    NOTE (made when asked for): the metadata of such a batch is known without looking at it
    (probability and weight 1, no loss), and a Traditional loop rarely reads it; making its
    four tensors for every batch was a third of the loader's own time per batch. The yielded
    batch makes them on first access (see :meth:`sbloader.SelectedBatch.__getattr__`), and
    :meth:`rows` makes them where the loader needs :class:`Rows` (a saved state). The dataset
    indices are copied here, as :func:`metadata_rows` copies them: a source may reuse its
    buffers.

    Example:
        >>> import numpy as np, torch
        >>> whole = WholeBatch([torch.zeros(3, 2)], np.array([7, 8, 9]), 3, torch.device("cpu"))
        >>> r = whole.rows()
        >>> len(whole), r.indices.tolist(), r.weights.tolist(), bool(r.losses.isnan().all())
        (3, [7, 8, 9], [1.0, 1.0, 1.0], True)
    """

    __slots__ = ("_rows", "data", "device", "features", "indices", "logits", "n")

    def __init__(
        self,
        data: list[Any],
        indices: np.ndarray | None,
        n: int,
        device: torch.device,
        features: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        self.data = data
        self.indices = None if indices is None else np.array(indices, dtype=np.int64)
        self.n = n
        self.device = device
        self.features = features
        self.logits = logits
        self._rows: Rows | None = None

    def __len__(self) -> int:
        return self.n

    def rows(self) -> Rows:
        """The batch as :class:`Rows` (the same values :func:`metadata_rows` gives; made once)."""
        if self._rows is None:
            self._rows = metadata_rows(
                self.data,
                None,
                None,
                self.indices,
                self.n,
                self.device,
                features=self.features,
                logits=self.logits,
            )
        return self._rows

    def copy(self) -> Rows:
        """:meth:`rows` with their data copied (see :meth:`Rows.copy`)."""
        return self.rows().copy()

    def copy_whole(self) -> WholeBatch:
        """The batch with its tensors copied, still whole: its metadata, made when asked for, is
        the copy's own (see :meth:`Rows.copy`).

        Example:
            >>> import torch
            >>> x = torch.zeros(2)
            >>> whole = WholeBatch([x], None, 2, torch.device("cpu"))
            >>> held = whole.copy_whole()
            >>> x += 1
            >>> held.data[0].tolist(), held.rows().indices.tolist()
            ([0.0, 0.0], [-1, -1])
        """

        return WholeBatch(
            [_copied(c) for c in self.data],
            self.indices,
            self.n,
            self.device,
            _copied(self.features),
            _copied(self.logits),
        )

    def metadata(self, has_indices: bool) -> tuple[Any, ...]:
        """The yielded batch's ``indices`` (None when ``has_indices`` is False), ``losses``,
        ``probabilities`` and ``weights``, made now."""
        rows = self.rows()
        indices = rows.indices if has_indices else None
        return indices, rows.losses, rows.probabilities, rows.weights


class PendingRows:
    """Selected rows waiting to fill a training batch, in the order they were selected.

    Example:
        >>> import torch
        >>> p = PendingRows()
        >>> p.add(metadata_rows([torch.arange(3)], None, None, None, 3, torch.device("cpu")))
        >>> p.full_batches(2), p.pop(2).data[0].tolist(), len(p)
        (1, [0, 1], 1)
    """

    def __init__(self) -> None:
        self._parts: list[Rows] = []
        self._count = 0
        # (whether the rows were chosen in an epoch whose batches are normalised to mean
        # weight 1: see begin_epoch)
        self._normalized = False

    def __len__(self) -> int:
        return self._count

    def begin_epoch(self, normalizes: bool) -> None:
        """A new epoch begins, whose yielded batches are normalised to mean weight 1 where
        ``normalizes`` (the policy's ``normalize_weights()`` in that epoch).

        NOTE: the loader normalises a batch by what the policy of the epoch it is yielded in
        says. Rows carried from an epoch that normalises (Stale-SB's 1/P with ``reweight=True``)
        into one that does not (``Phased``'s annealed Traditional end) went into its first batch
        with their raw 1/P weights: a batch of mean weight 1.7 and one row of 11 in a measured
        case, where the policy promises mean 1. They are normalised here instead, as one
        block to mean 1, keeping their ratios; the new epoch's rows join them at weight 1.
        Carried into an epoch that normalises, they are normalised with its batches as before.

        Example:
            >>> import torch
            >>> p = PendingRows()
            >>> p.begin_epoch(True)
            >>> r = metadata_rows([torch.arange(2)], None, None, None, 2, torch.device("cpu"))
            >>> p.add(replace(r, weights=torch.tensor([1.0, 3.0])))
            >>> p.begin_epoch(False)
            >>> p.pop(2).weights.tolist()
            [0.5, 1.5]
        """
        if self._normalized and not normalizes and self._count:
            total = sum(float(part.weights.sum()) for part in self._parts)
            scale = self._count / total
            self._parts = [replace(part, weights=part.weights * scale) for part in self._parts]
        self._normalized = bool(normalizes)

    def add(self, rows: Rows) -> None:
        if len(rows):
            self._parts.append(rows)
            self._count += len(rows)

    def full_batches(self, batch_size: int) -> int:
        """How many full batches of ``batch_size`` the pending rows make."""
        return self._count // batch_size

    def pop(self, k: int, pads: Mapping[int, Any] | None = None) -> Rows:
        """Remove and return the first ``k`` rows (``k <= len(self)``), joined with ``pads``
        (see :meth:`Rows.concat`)."""
        if not 0 < k <= self._count:
            raise ValueError(f"k should be in [1, {self._count}], but got k={k}")
        # NOTE: only the parts that hold the first k rows are joined; the rest stay as they are
        # (views), so that a row is copied once on its way to a batch, not at every pop.
        parts, held, used = self._parts, 0, 0
        while held < k:
            held += len(parts[used])
            used += 1
        rest = parts[used:]
        if held > k:
            last, tail = parts[used - 1].split(len(parts[used - 1]) - (held - k))
            parts, rest = [*parts[: used - 1], last], [tail, *rest]
        else:
            parts = parts[:used]
        # (joined before the rows are removed: where joining fails, e.g. out of memory, they
        # stay pending)
        out = Rows.concat(parts, pads)
        self._parts, self._count = rest, self._count - k
        return out

    def clear(self) -> int:
        """Drop every pending row; returns how many there were."""
        n, self._parts, self._count = self._count, [], 0
        return n

    def state_dict(self) -> dict[str, Any]:
        return {
            "count": self._count,
            "parts": [p.state_dict() for p in self._parts],
            "normalized": self._normalized,
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.clear()
        for part in state["parts"]:
            self.add(Rows.from_state(part, device))
        # (absent from states saved before it existed: their rows were never normalised here)
        self._normalized = bool(state.get("normalized", False))
        if self._count != int(state["count"]):
            raise ValueError(
                f"the saved pending rows count {state['count']} examples but hold {self._count}; "
                "the state is corrupt"
            )


def _copied(c: Any) -> Any:
    """``c`` with its tensors cloned: a tensor, a dict of them (nested fields), a list holding
    them (one tensor, or dict of tensors, per example: boxes, detection targets), or anything
    else as it is (a list of strings).

    NOTE (lists): before, a list was kept as it is, so that a field of per-example tensors was
    shared with the batch it was handed out in, and a step that changed those tensors in place
    changed the copy held to take the batch back (``state_dict(unconsumed=1)``) too.
    """
    if isinstance(c, torch.Tensor):
        return c.clone()
    if isinstance(c, Mapping):
        return {k: _copied(v) for k, v in c.items()}
    if isinstance(c, list) and any(isinstance(v, _HOLDERS) for v in c):
        return [_copied(v) for v in c]
    return c


#: What a list entry is copied for (see _copied): what may hold a tensor.
_HOLDERS = (torch.Tensor, Mapping, list)
