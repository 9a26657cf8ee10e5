"""Plain functions for the loader's per-batch decisions: non-finite losses, the training subset,
and what a filtering source should load.

None of them calls a model or does I/O; each can be tested directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _kernels
from ._checks import check_indices, nonfinite_losses
from .policies import Choice, Policy

__all__ = [
    "Keep",
    "checked_choice",
    "choose_finite",
    "in_subset",
    "keep_function",
    "load_kernels",
    "prefilters",
    "subset_mask",
]


def load_kernels() -> None:
    """Make a first numba kernel call now: numba's runtime loads its registries (and scipy's
    linear algebra) on the first call of a process, about 2 s on this project's CPUs.

    NOTE: made when a loader with decisions to make is built, so that this one-time cost is not
    counted as the first epoch's ``selection_s`` (its first decision made that call): a
    Random-Backprop warm-up epoch, which runs no selection pass, read 1.3-2.8 s of selection
    time, most of its wall time.
    """
    _kernels.first_outside(np.zeros(1, dtype=np.float64), 0.0, 1.0)


#: The largest float64: a weight above it (inf) is refused (see :func:`checked_choice`).
_FLOAT64_MAX = float(np.finfo(np.float64).max)
#: The smallest float64 above 0: a weight below it (0) is refused where weights are scaled.
_SMALLEST = float(np.nextafter(0.0, 1.0))

#: What ``choose_finite`` does with a non-finite loss.
NONFINITE = ("skip", "select", "raise")


def choose_finite(
    policy: Policy,
    values: np.ndarray | None,
    indices: np.ndarray | None,
    rng: np.random.Generator,
    n: int,
    nonfinite: str,
    finite: np.ndarray | None = None,
) -> tuple[Choice, int]:
    """Ask ``policy`` to choose among ``n`` candidates so that it never sees a non-finite loss.

    Args:
        policy: the policy.
        values: float64 selection losses, one per candidate, or None when the policy needs none.
        indices: int64 dataset indices of the candidates, or None.
        rng: the loader's generator.
        n: the number of candidates.
        nonfinite: ``"skip"`` (non-finite candidates get P = 0 and are not chosen),
            ``"select"`` (P = 1, chosen with weight 1, each before the first chosen candidate
            of a higher position, the policy's own order kept, and counted through
            :meth:`~sbloader.Policy.count_forced`) or
            ``"raise"`` (:class:`~sbloader._checks.NonFiniteLoss`, a ``FloatingPointError``
            naming the first dataset indices).
        finite: ``np.isfinite(values)`` when the caller has it already (computed otherwise).

    Returns:
        The choice over all ``n`` candidates, and how many losses were not finite.

    Example:
        >>> from sbloader import Traditional
        >>> c, bad = choose_finite(Traditional(), np.array([1.0, np.nan, 2.0]), None,
        ...                        np.random.default_rng(0), 3, "skip")
        >>> c.positions.tolist(), c.probabilities.tolist(), bad
        ([0, 2], [1.0, 0.0, 1.0], 1)
    """
    if values is None:
        return checked_choice(policy, policy.choose(None, indices, rng, n), n), 0
    finite = np.isfinite(values) if finite is None else finite
    if finite.all():
        return checked_choice(policy, policy.choose(values, indices, rng, n), n), 0
    bad = np.flatnonzero(~finite)
    if nonfinite == "raise":
        where = indices[bad[:5]].tolist() if indices is not None else bad[:5].tolist()
        raise nonfinite_losses(len(bad), where, positions=indices is None)
    if nonfinite == "skip" and indices is not None:
        policy.count_skipped(indices[bad])
    good = np.flatnonzero(finite)
    sub = checked_choice(
        policy,
        policy.choose(values[good], None if indices is None else indices[good], rng, len(good)),
        len(good),
    )
    probabilities = np.zeros(n, dtype=np.float64)
    probabilities[good] = sub.probabilities
    positions, weights = good[sub.positions], sub.weights
    if nonfinite == "select":
        if indices is not None:
            # NOTE: backpropagated, so counted as selected in a per-example store's records.
            policy.count_forced(indices[bad])
        probabilities[bad] = 1.0
        # NOTE: each forced candidate goes before the first chosen one of a higher position,
        # so that choices in position order stay in position order, and the order a policy
        # asked for (Choice.positions: "in the order they should be yielded") is kept.
        at = (
            np.searchsorted(np.maximum.accumulate(positions), bad, side="right")
            if len(positions)
            else np.zeros(len(bad), dtype=np.int64)
        )
        positions = np.insert(positions, at, bad)
        weights = np.insert(weights, at, np.ones(len(bad)))
    return Choice(positions, probabilities, weights), len(bad)


def checked_choice(policy: Policy, choice: Any, n: int) -> Choice:
    """``choice``, what ``policy.choose`` returned for ``n`` candidates, or raise naming what
    is wrong with it and the fix.

    NOTE: a policy of the user's own (see :class:`~sbloader.Policy`) whose Choice did not fit
    its candidates failed in torch or numpy with messages that name neither the policy nor the
    field ("index out of range in self", "could not broadcast input array from shape (3,)"),
    and probabilities of another length than the candidates' went into ``batch.probabilities``
    unsaid. Checks of lengths and dtypes, and one min and max of the positions.

    NOTE: a weight that was NaN, infinite or negative went into the trained loss unsaid (a
    NaN weight made every parameter NaN at the next step), as did a probability outside
    [0, 1] (NaN included) into ``batch.probabilities``: refused too, in one pass over each
    array that stops at the first value outside its range.

    Example:
        >>> from sbloader import Traditional
        >>> checked_choice(Traditional(), Choice.everything(3), 3).positions.tolist()
        [0, 1, 2]
        >>> checked_choice(Traditional(), Choice.everything(3), 4)
        Traceback (most recent call last):
            ...
        ValueError: Traditional().choose(...) should return a Choice whose probabilities hold ...
    """
    what = f"{policy!r}.choose(...) should return a Choice"
    if not isinstance(choice, Choice):
        raise TypeError(f"{what}, but got {type(choice).__name__}")
    fields = {"positions": choice.positions, "probabilities": choice.probabilities}
    fields["weights"] = choice.weights
    for name, array in fields.items():
        if not isinstance(array, np.ndarray) or array.ndim != 1:
            raise TypeError(
                f"{what} whose {name} field is a 1-d numpy array, but got "
                f"{type(array).__name__} of shape {getattr(array, 'shape', None)}"
            )
    positions = choice.positions
    if positions.dtype.kind not in "iu":
        raise TypeError(
            f"{what} whose positions are integers (np.int64), but got dtype {positions.dtype}"
        )
    if choice.probabilities.shape[0] != n:
        raise ValueError(
            f"{what} whose probabilities hold one entry per candidate ({n}), but got "
            f"{choice.probabilities.shape[0]}"
        )
    if choice.weights.shape[0] != positions.shape[0]:
        raise ValueError(
            f"{what} whose weights hold one entry per position ({positions.shape[0]}), but got "
            f"{choice.weights.shape[0]}"
        )
    if positions.shape[0] and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(
            f"{what} whose positions are in [0, {n}) (positions into the candidate batch), "
            f"but got values from {positions.min()} to {positions.max()}"
        )
    # NOTE: weights that a policy has the loader scale to mean 1 per batch (normalize_weights)
    # must be > 0: a batch of zero weights only became NaN weights.
    scaled = policy.normalize_weights()
    ranges = (
        ("probabilities", 0.0, 1.0, "in [0, 1]"),
        (
            "weights",
            _SMALLEST if scaled else 0.0,
            _FLOAT64_MAX,
            "finite and > 0 (loss weights, which the loader scales to mean 1 per batch, as "
            "normalize_weights() asks)"
            if scaled
            else "finite and >= 0 (loss weights)",
        ),
    )
    for name, low, high, inside in ranges:
        array = fields[name]
        if array.dtype.kind not in "biuf":
            raise TypeError(
                f"{what} whose {name} are floats (np.float64), but got dtype {array.dtype}"
            )
        bad = _kernels.first_outside(np.ascontiguousarray(array, dtype=np.float64), low, high)
        if bad >= 0:
            raise ValueError(
                f"{what} whose {name} are {inside}, but got {name}[{bad}] = {array[bad]}"
            )
    return choice


def subset_mask(subset: Any, size: int | None) -> np.ndarray:
    """A boolean mask over dataset indices ``0 .. size - 1`` from a collection of indices.

    Args:
        subset: 1-d integer dataset indices (a sequence, numpy array or tensor).
        size: the dataset's size, or None when unknown (the mask then ends at the largest index).

    Example:
        >>> subset_mask([0, 3], 5).tolist()
        [True, False, False, True, False]
    """
    raw = np.asarray(subset.cpu() if hasattr(subset, "cpu") else subset)
    if raw.ndim != 1:
        raise TypeError(
            f"subset should be a 1-d sequence of integer dataset indices, but got shape {raw.shape}"
        )
    if raw.size == 0:  # NOTE: before the dtype check: an empty list is float64
        raise ValueError(
            "subset should hold at least one dataset index, but got an empty subset; pass the "
            "indices of the examples to train on, or subset=None for all of them"
        )
    if raw.dtype == np.bool_:
        raise TypeError(
            "subset should hold dataset indices, but got a boolean mask; pass "
            "np.flatnonzero(mask) (the indices it keeps)"
        )
    idx = check_indices("subset", raw)
    if size is None:
        size = int(idx.max()) + 1 if idx.size else 0
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise ValueError(
            f"subset should hold dataset indices in [0, {size}), but got values from "
            f"{idx.min()} to {idx.max()}"
        )
    mask = np.zeros(size, dtype=bool)
    mask[idx] = True
    return mask


def in_subset(mask: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Whether each dataset index is in the subset ``mask`` (indices outside it: False).

    Example:
        >>> in_subset(np.array([True, False]), np.array([0, 1, 7])).tolist()
        [True, False, False]
    """
    inside = (indices >= 0) & (indices < mask.shape[0])
    return inside & mask[np.where(inside, indices, 0)]


class Keep:
    """What a filtering source should load this epoch, and a tally of what it left out.

    Called on an int64 array of dataset indices, it returns the mask of those to load: the
    examples in ``mask`` (all if None) that the policy does not reject before loading (when it
    :meth:`~sbloader.Policy.can_prefilter`). ``tally`` is ``[rejected by the policy, outside the
    subset]``, advanced by whichever thread loads, except while ``replaying()`` (a resumed epoch
    filtering its skipped batches again, which the checkpoint's stats already count).

    A source that makes batches ahead of handing them out (a DataLoader with worker processes
    draws ``prefetch_factor`` batches per worker from its sampler in advance) calls
    :meth:`batch_made` as it makes each batch and :meth:`batch_taken` as it hands each out in
    that order: :meth:`counted` is then the tally as of the batch handed out last, not as of
    batches made ahead, until :meth:`ended` (the epoch's whole tally).

    NOTE: the loader counts ``counted()`` right after each source batch, and a checkpoint keeps
    those counts. Counted as of the batches made ahead, a run resumed mid-epoch (which replays
    the consumed batches uncounted, then counts from there) counted the batches made ahead
    twice: ``excluded`` and ``prefiltered`` came out too high, and ``loader.progress`` (and the
    ramp of ``ramp_epochs``, which follows it) ran ahead of the uninterrupted run's.

    Example:
        Two batches made, one handed out: ``counted()`` is as of the one handed out.

        >>> from sbloader import Traditional
        >>> keep = Keep(Traditional(), np.array([True, False, True, False]), lambda: False)
        >>> keep(np.array([0, 1])).tolist()
        [True, False]
        >>> keep.batch_made()
        >>> keep(np.array([2, 3])).tolist()
        [True, False]
        >>> keep.batch_made()
        >>> keep.batch_taken()
        >>> keep.tally, keep.counted()
        ([0, 2], (0, 1))
        >>> keep.ended()
        >>> keep.counted()
        (0, 2)
    """

    def __init__(
        self, policy: Policy, mask: np.ndarray | None, replaying: Callable[[], bool]
    ) -> None:
        self._policy, self._mask, self._replaying = policy, mask, replaying
        self._prefilters = policy.can_prefilter()
        self.tally = [0, 0]
        self._marks: deque[tuple[int, int]] = deque()
        self._taken: tuple[int, int] | None = None  # the tally as of the batch handed out last

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        tally = self.tally
        chosen = (
            in_subset(self._mask, indices)
            if self._mask is not None
            else np.ones(len(indices), bool)
        )
        counting = not self._replaying()
        if counting:
            tally[1] += int(len(indices) - chosen.sum())
        if self._prefilters:
            accepted = self._policy.prefilter(indices[chosen])
            if counting:
                tally[0] += int(chosen.sum() - accepted.sum())
            chosen[np.flatnonzero(chosen)[~accepted]] = False
        return chosen

    def batch_made(self) -> None:
        """The source made a batch (not one it skips), with everything left out so far."""
        self._marks.append((self.tally[0], self.tally[1]))

    def batch_taken(self) -> None:
        """The source hands out the oldest batch made and not handed out yet."""
        if self._marks:
            self._taken = self._marks.popleft()

    def ended(self) -> None:
        """The source's epoch ended: every batch made was handed out."""
        self._marks.clear()
        self._taken = None

    def counted(self) -> tuple[int, int]:
        """``(rejected, outside the subset)`` as of the batch handed out last (where the source
        says which; else as of now)."""
        taken = self._taken
        return (self.tally[0], self.tally[1]) if taken is None else taken


def keep_function(
    policy: Policy,
    mask: np.ndarray | None,
    replaying: Callable[[], bool],
) -> Keep | None:
    """What a filtering source should load this epoch: a :class:`Keep` (whose ``tally`` counts
    what it leaves out, ``[rejected by the policy, outside the subset]``), or None when
    everything is loaded.

    Example:
        >>> from sbloader import Traditional
        >>> keep = keep_function(Traditional(), np.array([True, False, True]), lambda: False)
        >>> keep(np.array([0, 1, 2])).tolist(), keep.tally
        ([True, False, True], [0, 1])
    """
    if not prefilters(policy, mask):
        return None
    return Keep(policy, mask, replaying)


def prefilters(policy: Policy, mask: np.ndarray | None) -> bool:
    """Whether a filtering source loads only part of this epoch (what :func:`keep_function`
    keeps): where the policy prefilters (a Stale-SB stale epoch) or a ``subset`` mask is set.

    Example:
        >>> from sbloader import Traditional
        >>> prefilters(Traditional(), None), prefilters(Traditional(), np.array([True]))
        (False, True)
    """
    return mask is not None or policy.can_prefilter()
