"""What a selection did, per example: pure functions over arrays (numpy in, numpy out).

The papers' per-example analyses, without plotting, I/O or model calls:

- the target confidence of a model on a labelled set, its inverse CDF (Selective-Backprop's
  Figure 8) and the accuracy per percentile bin of it (Figure 9):
  :func:`target_confidence`, :func:`confidence_percentiles`, :func:`accuracy_by_percentile`;
- how often each example was selected when it was seen, over a run or a window of epochs, and how
  stable the selected set is from one epoch to the next: :func:`selection_frequency`,
  :func:`store_selection_frequency`, :func:`selection_stability`;
- how much two per-example rankings agree at a grid of fractions (the Diet-SB poster: EL2N of two
  architectures, SB's least used against EL2N's lowest), and what two random rankings would give:
  :func:`overlap_curve`, :func:`random_overlap`, :func:`random_overlap_band`;
- the indices to show in galleries (easiest, hardest, least and most used, lowest combined rank):
  :func:`gallery_indices`, :func:`combined_rank`;
- with labels flipped on purpose, the share of flipped examples among the most selected:
  :func:`flipped_share`.

Inputs may be numpy arrays, sequences or torch tensors (converted with ``.detach().cpu()``);
outputs are float64 or int64 numpy arrays (or, for :func:`flipped_share` and
:func:`accuracy_by_percentile`, named tuples of them). Ties are always broken deterministically,
as each function documents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ._checks import check_bool, check_choice, check_float, check_indices, check_int
from .store import ExampleStore, saved_column

__all__ = [
    "BinnedAccuracy",
    "NoiseShare",
    "accuracy_by_percentile",
    "binned_accuracy",
    "combined_rank",
    "confidence_percentiles",
    "flipped_share",
    "gallery_indices",
    "overlap_curve",
    "random_overlap",
    "random_overlap_band",
    "selection_frequency",
    "selection_stability",
    "store_selection_frequency",
    "target_confidence",
]

_DIRECTIONS = ("lowest", "highest")
_TIES = ("index", "expected")
#: How far a row of probabilities may sum from 1 (float16 softmax outputs stay well within it).
_SUM_TOLERANCE = 1e-2


class BinnedAccuracy(NamedTuple):
    """Accuracy per target-confidence percentile bin (see :func:`accuracy_by_percentile`).

    Attributes:
        accuracy: float64, one per bin, lowest confidence first; NaN for an empty bin.
        examples: int64, the examples in each bin.

    Example:
        With fewer examples than bins, the last bins are empty and their accuracy is NaN:

        >>> accuracy, examples = binned_accuracy([0.2, 0.9, 0.6], [False, True, True], bins=4)
        >>> accuracy.tolist(), examples.tolist()
        ([0.0, 1.0, 1.0, nan], [1, 1, 1, 0])
    """

    accuracy: np.ndarray
    examples: np.ndarray


class NoiseShare(NamedTuple):
    """The share of flipped labels among the most selected examples (see :func:`flipped_share`).

    Attributes:
        share: the share of the ``k`` most selected examples whose label was flipped.
        expected: the share a random choice of ``k`` examples would give (the noise rate among the
            examples with a selection count).

    Example:
        The never-seen example (NaN) is left out of the noise rate; the most selected is flipped:

        >>> result = flipped_share([0, 3], [4, float("nan"), 3, 1], k=1)
        >>> result
        NoiseShare(share=1.0, expected=0.6666666666666666)
        >>> result.share > result.expected
        True
    """

    share: float
    expected: float


# --- input conversion -----------------------------------------------------------------------------


def _numpy(value: Any) -> np.ndarray:
    """``value`` as a numpy array (torch tensors detached and moved to the CPU first)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return tensor.numpy()
    return np.asarray(value)


def _vector(name: str, value: Any, *, nan: bool) -> np.ndarray:
    """A 1-d float64 copy of numeric ``value``; NaN refused unless ``nan``."""
    array = _numpy(value)
    if array.ndim != 1:
        raise ValueError(
            f"{name} should be 1-d (one value per example), but has shape {array.shape}"
        )
    if array.size and array.dtype.kind not in "iuf":
        raise TypeError(f"{name} should hold numbers, but has dtype {array.dtype}")
    vector = np.array(array, dtype=np.float64)
    if not nan and np.isnan(vector).any():
        where = np.flatnonzero(np.isnan(vector))
        keep = "scored in both inputs" if name.startswith("scores_") else f"with a {name}"
        raise ValueError(
            f"{name} has {where.size} NaN values (e.g. at indices {where[:5].tolist()}); keep only "
            f"the examples {keep}, or fill the NaN values, first"
        )
    return vector


def _confidences(value: Any) -> np.ndarray:
    """``confidence`` as a vector (see :func:`_vector`), each a probability in [0, 1].

    NOTE: logits or losses passed as confidences (above 1, negative, infinite) were binned and
    ranked as given, unsaid: a figure of the wrong quantity."""
    values = _vector("confidence", value, nan=False)
    outside = (values < 0) | (values > 1)
    if outside.any():
        where = np.flatnonzero(outside)
        raise ValueError(
            f"confidence should hold probabilities in [0, 1], but has {where.size} outside it "
            f"(e.g. {values[where[0]]:g} at index {where[0]}); pass the softmax probability of "
            "each target, e.g. target_confidence(outputs, targets, logits=True) from logits"
        )
    return values


def _pair(scores_a: Any, scores_b: Any, *, nan: bool) -> tuple[np.ndarray, np.ndarray]:
    """Two score vectors over the same examples, checked (see :func:`_vector`)."""
    a = _vector("scores_a", scores_a, nan=nan)
    b = _vector("scores_b", scores_b, nan=nan)
    if a.shape != b.shape:
        raise ValueError(
            f"scores_a and scores_b should score the same examples, but have {a.size} and "
            f"{b.size} values"
        )
    return a, b


def _counts(name: str, value: Any) -> np.ndarray:
    """Non-negative integer counts as int64: a 1-d array, or a 0-d one to broadcast."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        array = np.asarray(check_int(name, value, minimum=0), dtype=np.int64)
    else:
        array = _numpy(value)
        if array.ndim > 1:
            raise ValueError(
                f"{name} should be 1-d (one count per example), but has shape {array.shape}"
            )
        if array.size and array.dtype.kind not in "iu":
            raise TypeError(
                f"{name} should hold integer counts, but has dtype {array.dtype}; pass the counts, "
                "not frequencies"
            )
        array = np.array(array, dtype=np.int64)
    if (array < 0).any():
        where = np.flatnonzero(array.reshape(-1) < 0)
        raise ValueError(
            f"{name} should be counts >= 0, but has {where.size} negative values (e.g. at indices "
            f"{where[:5].tolist()})"
        )
    return array


def _outputs(outputs: Any, logits: bool) -> np.ndarray:
    """Model outputs as a finite float64 (N, C) array; probabilities checked unless ``logits``."""
    array = _numpy(outputs)
    if array.ndim != 2 or array.shape[1] < 1:
        raise ValueError(
            f"outputs should have shape (examples, classes), but has shape {array.shape}"
        )
    if array.dtype.kind not in "iuf":
        raise TypeError(f"outputs should hold numbers, but has dtype {array.dtype}")
    values = np.array(array, dtype=np.float64)
    if not np.isfinite(values).all():
        rows = np.flatnonzero(~np.isfinite(values).all(axis=1))
        raise ValueError(
            f"outputs has non-finite values in {rows.size} rows (e.g. rows {rows[:5].tolist()}); "
            "evaluate the model without them, or check it for divergence"
        )
    if logits or values.shape[0] == 0:
        return values
    low, high = float(values.min()), float(values.max())
    if low < 0.0 or high > 1.0:
        raise ValueError(
            f"outputs should be probabilities in [0, 1] (softmax outputs), but range over "
            f"[{low:g}, {high:g}]; pass logits=True if they are logits"
        )
    sums = values.sum(axis=1)
    off = np.flatnonzero(np.abs(sums - 1.0) > _SUM_TOLERANCE)
    if off.size:
        raise ValueError(
            f"each row of outputs should sum to 1 (softmax outputs), but {off.size} rows do not "
            f"(e.g. row {off[0]} sums to {sums[off[0]]:g}); pass logits=True if they are logits"
        )
    return values


def _targets(targets: Any, n: int, classes: int) -> np.ndarray:
    """Integer class targets as int64, one per row of the outputs, each in [0, classes)."""
    array = _numpy(targets)
    if array.ndim != 1 or array.shape[0] != n:
        raise ValueError(
            f"targets should have shape ({n},), one class index per row of outputs, but has shape "
            f"{array.shape}"
        )
    if n and array.dtype.kind not in "iu":
        raise TypeError(
            f"targets should hold integer class indices, but has dtype {array.dtype}; pass class "
            "indices, not one-hot rows or probabilities"
        )
    values = array.astype(np.int64)
    bad = np.flatnonzero((values < 0) | (values >= classes))
    if bad.size:
        raise ValueError(
            f"targets should be class indices in [0, {classes}) for outputs with {classes} "
            f"classes, but targets[{bad[0]}]={values[bad[0]]}"
        )
    return values


def _fractions(fractions: Any) -> np.ndarray:
    """Fractions as float64, each in (0, 1]."""
    values = np.asarray(_numpy(fractions), dtype=np.float64)
    bad = ~((values > 0.0) & (values <= 1.0))  # NaN is bad too
    if bad.any():
        shown = fractions if values.ndim == 0 else values.tolist()
        raise ValueError(
            f"fractions should be in (0, 1], but got {values[bad].reshape(-1)[0]:g} in "
            f"fractions={shown}; pass shares of the examples, e.g. [0.1, 0.3, 0.5]"
        )
    return values


def _top_sizes(fractions: np.ndarray, n: int) -> np.ndarray:
    """k = fraction * n rounded to the nearest integer, halves up (int64, same shape)."""
    # Rounding to 9 decimals first keeps 0.145 * 100 = 14.499999999999998 a half, rounded up.
    return np.floor(np.round(fractions * n, 9) + 0.5).astype(np.int64)


def _direction(direction: str) -> str:
    return check_choice("direction", direction, _DIRECTIONS)


def _order(key: np.ndarray) -> np.ndarray:
    """Positions sorted by ascending ``key``, ties by ascending position."""
    return np.lexsort((np.arange(key.shape[0]), key))


def _membership(key: np.ndarray, order: np.ndarray, k: int, ties: str) -> np.ndarray:
    """Each example's weight in the ``k`` lowest of ``key`` (sorted as ``order``); sums to k.

    ``ties="index"``: 1 for the first k of ``order``, 0 for the rest. ``ties="expected"``: the
    probability of being among the k if ties at the k-th place were broken at random (1 below the
    k-th value, (k - below) / tied for the examples equal to it, 0 above).
    """
    weights = np.zeros(key.shape[0], dtype=np.float64)
    if k == 0:
        return weights
    if ties == "index":
        weights[order[:k]] = 1.0
        return weights
    threshold = key[order[k - 1]]
    below = key < threshold
    tied = key == threshold
    weights[below] = 1.0
    weights[tied] = (k - int(below.sum())) / int(tied.sum())
    return weights


# --- target confidence (SB's Figures 8 and 9) -----------------------------------------------------


def target_confidence(outputs: Any, targets: Any, *, logits: bool = False) -> np.ndarray:
    """The probability each example's true class gets: softmax output at the target.

    Args:
        outputs: (N, C) softmax probabilities (each row in [0, 1] and summing to 1 within 0.01),
            or logits with ``logits=True``.
        targets: (N,) integer class indices in ``[0, C)``.
        logits: whether ``outputs`` are logits (the softmax is then taken in float64).

    Returns:
        float64 (N,): ``softmax(outputs)[i, targets[i]]``.

    Example:
        >>> import numpy as np
        >>> probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
        >>> target_confidence(probs, np.array([0, 1])).tolist()
        [0.7, 0.1]
        >>> target_confidence(np.log(probs), np.array([0, 1]), logits=True).round(6).tolist()
        [0.7, 0.1]
    """
    logits = check_bool("logits", logits)
    values = _outputs(outputs, logits)
    n, classes = values.shape
    rows = np.arange(n)
    tgt = _targets(targets, n, classes)
    if not logits or n == 0:
        return values[rows, tgt]
    top = values.max(axis=1)
    log_norm = np.log(np.exp(values - top[:, None]).sum(axis=1))
    return np.exp(values[rows, tgt] - top - log_norm)


def confidence_percentiles(
    confidence: Any, percentiles: Any = None, *, method: str = "inverted_cdf"
) -> np.ndarray:
    """The inverse CDF of target confidence at a grid of percentiles (SB's Figure 8).

    Args:
        confidence: (N,) target confidences in [0, 1], e.g. from :func:`target_confidence`;
            no NaN.
        percentiles: percentiles in [0, 100] (default: 0, 1, ..., 100).
        method: passed to :func:`numpy.percentile`. The default ``"inverted_cdf"`` is the inverse
            CDF itself: the smallest confidence c with at least p% of the examples at or below c
            (percentile 0 is the minimum), so every value returned is one of the inputs.

    Returns:
        float64 of the shape of ``percentiles``; all NaN when ``confidence`` is empty.

    Example:
        >>> confidence_percentiles([0.4, 0.1, 0.3, 0.2], [0, 25, 26, 50, 100]).tolist()
        [0.1, 0.1, 0.2, 0.2, 0.4]
        >>> confidence_percentiles([], [50]).tolist()
        [nan]
    """
    values = _confidences(confidence)
    grid = np.arange(101, dtype=np.float64) if percentiles is None else _numpy(percentiles)
    grid = np.asarray(grid, dtype=np.float64)
    bad = ~((grid >= 0.0) & (grid <= 100.0))
    if bad.any():
        raise ValueError(
            f"percentiles should be in [0, 100], but got {grid[bad].reshape(-1)[0]:g}; pass "
            "percentiles, not fractions (e.g. 20, not 0.2)"
        )
    method = check_choice(
        "method", method, ("inverted_cdf", "linear", "lower", "higher", "nearest", "midpoint")
    )
    if values.size == 0:
        return np.full(grid.shape, np.nan, dtype=np.float64)
    if method == "inverted_cdf":
        # NOTE: numpy computes p / 100 * n in floating point (7 / 100 * 100 is
        # 7.000000000000001) and takes its ceiling, one example too far; rounded to 9 decimals
        # first, as _top_sizes does, p of n is the smallest value with at least p% at or below.
        ordered = np.sort(values.reshape(-1))
        n = ordered.size
        k = np.clip(np.ceil(np.round(grid * n / 100.0, 9)), 1, n).astype(np.int64)
        return np.asarray(ordered[k - 1], dtype=np.float64)
    return np.asarray(np.percentile(values, grid, method=method), dtype=np.float64)  # type: ignore[call-overload]


def accuracy_by_percentile(
    outputs: Any, targets: Any, bins: int = 10, *, logits: bool = False
) -> BinnedAccuracy:
    """Accuracy per target-confidence percentile bin (SB's Figure 9).

    Examples are sorted by target confidence (ascending; ties by ascending index, so tied examples
    can fall into different bins) and split into ``bins`` bins of equal count, as
    :func:`numpy.array_split` splits: when ``bins`` does not divide N, the first ``N % bins``
    bins (the least confident) hold one example more; when N < ``bins`` the last bins are empty.
    An example is correct when the argmax of its outputs is its target (on tied outputs the lowest
    class wins, as in :func:`numpy.argmax`).

    Args:
        outputs: (N, C) softmax probabilities, or logits with ``logits=True``.
        targets: (N,) integer class indices.
        bins: the number of bins (10: deciles).
        logits: whether ``outputs`` are logits.

    Returns:
        :class:`BinnedAccuracy`: ``accuracy`` (float64, NaN for an empty bin) and ``examples``
        (int64), one per bin, least confident first.

    Example:
        >>> import numpy as np
        >>> probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8], [0.5, 0.5]])
        >>> targets = np.array([1, 1, 1, 1, 0])
        >>> result = accuracy_by_percentile(probs, targets, bins=2)
        >>> result.accuracy.tolist(), result.examples.tolist()
        ([0.3333333333333333, 1.0], [3, 2])
    """
    bins = check_int("bins", bins, minimum=1)
    logits = check_bool("logits", logits)
    values = _outputs(outputs, logits)
    tgt = _targets(targets, *values.shape)
    confidence = target_confidence(values, tgt, logits=logits)
    correct = values.argmax(axis=1) == tgt if values.shape[0] else np.zeros(0, dtype=bool)
    return binned_accuracy(confidence, correct, bins)


def binned_accuracy(confidence: Any, correct: Any, bins: int = 10) -> BinnedAccuracy:
    """:func:`accuracy_by_percentile` from target confidences and correctness already computed
    (e.g. kept from an evaluation instead of the whole outputs); the same bins and ties.

    Args:
        confidence: (N,) target confidences in [0, 1]; no NaN.
        correct: (N,) booleans: whether each example was classified correctly.
        bins: the number of bins.

    Returns:
        :class:`BinnedAccuracy`, least confident first.

    Example:
        >>> result = binned_accuracy([0.1, 0.4, 0.7, 0.8, 0.5], [False, False, True, True, True], 2)
        >>> result.accuracy.tolist(), result.examples.tolist()
        ([0.3333333333333333, 1.0], [3, 2])
    """
    bins = check_int("bins", bins, minimum=1)
    conf = _confidences(confidence)
    right = _numpy(correct)
    if right.shape != conf.shape or (right.size and right.dtype != np.bool_):
        raise ValueError(
            f"correct should be booleans, one per confidence ({conf.size}), but has shape "
            f"{right.shape} and dtype {right.dtype}"
        )
    parts = np.array_split(_order(conf), bins)
    examples = np.array([part.size for part in parts], dtype=np.int64)
    accuracy = np.array(
        [right[part].mean() if part.size else np.nan for part in parts], dtype=np.float64
    )
    return BinnedAccuracy(accuracy, examples)


# --- selection frequency and stability ------------------------------------------------------------


def selection_frequency(
    selected: Any,
    seen: Any,
    *,
    selected_before: Any = None,
    seen_before: Any = None,
) -> np.ndarray:
    """Times selected / times seen, per example, over a run or a window of epochs.

    Over a run, pass the counts; over a window, also pass the counts at the window's start
    (``*_before``, snapshots taken then): the window's counts are the differences.

    Args:
        selected: (N,) integer times each example was selected (e.g. ``ExampleStore.selected``).
        seen: integer times each example was drawn as a candidate: (N,), or one int for all (e.g.
            the number of epochs, when each epoch draws every example once).
        selected_before: ``selected`` at the window's start (default: 0, the run's start).
        seen_before: ``seen`` at the window's start (default: 0).

    Returns:
        float64 (N,): NaN for examples not seen (in the window), not 0, since nothing is known of
        them. Policies that sample with replacement can select an example more often than it was
        seen, so values above 1 are possible.

    Raises:
        ValueError: for negative counts, a snapshot later than the counts it is subtracted from,
            or an example selected but never seen.

    Example:
        >>> selection_frequency([0, 2, 3, 0], [4, 4, 4, 0]).tolist()
        [0.0, 0.5, 0.75, nan]
        >>> selection_frequency([1, 5], 6, selected_before=[1, 2], seen_before=3).tolist()
        [0.0, 1.0]
    """
    sel = _counts("selected", selected)
    if sel.ndim != 1:
        raise ValueError("selected should be 1-d (one count per example), but got a single number")
    n = sel.shape[0]
    seen_counts = _broadcast("seen", _counts("seen", seen), n)
    if selected_before is not None:
        before = _broadcast("selected_before", _counts("selected_before", selected_before), n)
        sel = _window("selected", sel, before)
    if seen_before is not None:
        before = _broadcast("seen_before", _counts("seen_before", seen_before), n)
        seen_counts = _window("seen", seen_counts, before)
    unseen = np.flatnonzero((seen_counts == 0) & (sel > 0))
    if unseen.size:
        i = unseen[0]
        raise ValueError(
            f"{unseen.size} examples were selected but never seen (e.g. index {i}: selected "
            f"{sel[i]} times, seen 0); seen should count the times each example was drawn as a "
            "candidate (check the argument order and the snapshots)"
        )
    frequency = np.full(n, np.nan, dtype=np.float64)
    np.divide(sel, seen_counts, out=frequency, where=seen_counts > 0)
    return frequency


def _broadcast(name: str, counts: np.ndarray, n: int) -> np.ndarray:
    if counts.ndim == 0:
        return np.full(n, int(counts), dtype=np.int64)
    if counts.shape[0] != n:
        raise ValueError(
            f"{name} should have one count per example ({n}), but has {counts.shape[0]}"
        )
    return counts


def _window(name: str, now: np.ndarray, before: np.ndarray) -> np.ndarray:
    later = np.flatnonzero(before > now)
    if later.size:
        i = later[0]
        raise ValueError(
            f"{name}_before should be an earlier snapshot of {name}, but is larger at "
            f"{later.size} examples (e.g. index {i}: {before[i]} > {now[i]}); pass the counts at "
            f"the window's start as {name}_before and the later ones as {name}"
        )
    return now - before


def _selected_column(name: str, store: Any) -> np.ndarray:
    """The selection counts of an ExampleStore, its ``state_dict()``, or an array of counts."""
    if isinstance(store, ExampleStore):
        return np.array(store.selected, dtype=np.int64)
    if isinstance(store, Mapping):
        if "selected" in store:
            return _counts(name, store["selected"])
        if "path" in store:
            # A memory-mapped store's state: its counts are in the snapshot it names.
            column = saved_column(dict(store), "selected")
            if column is None:
                raise ValueError(
                    f"{name} is the state of a memory-mapped store that names its files as "
                    f"they are (only {store['path']!r}), not a snapshot of them; pass "
                    "a copy of its selected column then (store.selected.copy())"
                )
            return _counts(name, column)
        raise ValueError(
            f"{name} should be an ExampleStore state_dict() with a 'selected' column, but has "
            f"keys {sorted(store)}"
        )
    return _counts(name, store)


def _scored_column(store: Any) -> np.ndarray | None:
    """Which examples an ExampleStore (or its state) ever scored, or None where it is not known
    (a ``selected`` column given alone, a state naming a memory-mapped store's live files)."""
    if isinstance(store, ExampleStore):
        return np.asarray(store.seen) > 0
    if isinstance(store, Mapping) and ("seen" in store or "path" in store):
        column = saved_column(dict(store), "seen")
        return None if column is None else column > 0
    return None


def store_selection_frequency(
    store: Any, seen: Any, *, before: Any = None, seen_before: Any = None
) -> np.ndarray:
    """:func:`selection_frequency` from a loader's per-example store.

    The store counts selections but not how often each example was seen (it keeps the epoch of
    the last loss, not a count), so ``seen`` comes from the caller: with every example drawn
    once in each epoch the store's policy decided, it is the number of those epochs. NOTE:
    only those: a :class:`~sbloader.Phased` policy's warm-up and annealed epochs (the default
    policy's Random-Backprop epoch, its annealed end) are decided by another policy, whose
    selections the store does not count, so leave them out of ``seen``. Under DDP each rank's
    store holds every rank's losses but counts only its own rank's selections: sum the
    ``selected`` columns over the ranks (``torch.distributed.all_reduce``) and pass the sum.

    An example that a store (or its state) given whole never scored and never selected was
    never drawn in an epoch its policy decided (a selection pass scores every candidate, a
    stale epoch selects every candidate it has no loss for): one outside the loader's
    ``subset``, say. Its frequency is NaN, whatever ``seen`` says, not 0.

    Args:
        store: an :class:`~sbloader.ExampleStore`, its ``state_dict()`` (in memory), or its
            ``selected`` column (then nothing is known of which examples it scored).
        seen: times each example was seen: (N,) integers, or one int for all.
        before: the counts at the window's start: a copy of the ``selected`` column
            (``store.selected.copy()``), a copy of the store (``copy.deepcopy(store)``), or a
            state it saved (e.g. a checkpoint's; a memory-mapped store's is read from the
            snapshot it names). NOTE: calling a memory-mapped store's ``state_dict()`` just
            for this writes a snapshot, which counts against its ``keep_snapshots``.
            Default: the run's start.
        seen_before: ``seen`` at the window's start (default: 0; or pass the window's own
            ``seen`` and leave this out).

    Returns:
        float64 (N,), NaN for examples not seen.

    Example:
        >>> import numpy as np
        >>> from sbloader import ExampleStore
        >>> store = ExampleStore(3)
        >>> store.record(np.arange(3), np.array([0.2, 0.1, 0.9]), epoch=0)  # all scored
        >>> store.count_selected(np.array([0, 2]))
        >>> snapshot = store.selected.copy()
        >>> store.count_selected(np.array([0]))
        >>> store_selection_frequency(store, 2).tolist()
        [1.0, 0.0, 0.5]
        >>> store_selection_frequency(store, 2, before=snapshot, seen_before=1).tolist()
        [1.0, 0.0, 0.0]

        An example the store never scored nor selected (outside a ``subset``) is NaN:

        >>> store = ExampleStore(3)
        >>> store.record(np.array([0, 1]), np.array([0.5, 2.0]), epoch=0)
        >>> store.count_selected(np.array([1]))
        >>> store_selection_frequency(store, 1).tolist()
        [0.0, 1.0, nan]
    """
    if before is not None and before is store:
        raise ValueError(
            "before is the store itself, whose counts keep changing; pass a snapshot taken at the "
            "window's start (store.selected.copy() or store.state_dict())"
        )
    selected = _selected_column("store", store)
    selected_before = None if before is None else _selected_column("before", before)
    frequency = selection_frequency(
        selected, seen, selected_before=selected_before, seen_before=seen_before
    )
    # NOTE: a subset's other examples read 0 (never selected) with seen= the epochs: the least
    # used of the run, first in a gallery and in the overlap with EL2N's lowest (the pruned).
    scored = _scored_column(store)
    if scored is not None and scored.shape == selected.shape:
        frequency[~scored & (selected == 0)] = np.nan
    return frequency


def _selected_set(epoch: int, value: Any) -> np.ndarray:
    """One epoch's selection, a boolean mask or integer indices, as sorted unique indices."""
    array = _numpy(value)
    if array.ndim != 1:
        raise ValueError(
            f"selections[{epoch}] should be 1-d (a boolean mask or dataset indices), but has "
            f"shape {array.shape}"
        )
    if array.dtype == np.bool_:
        return np.flatnonzero(array)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"selections[{epoch}] should be a boolean mask or integer dataset indices, but has "
            f"dtype {array.dtype}"
        )
    indices = np.unique(array.astype(np.int64))
    if indices.size and indices[0] < 0:
        raise ValueError(
            f"selections[{epoch}] should hold dataset indices >= 0, but holds {indices[0]}"
        )
    # NOTE: as for a matrix (see selection_stability): a 0/1 integer row read as indices is the
    # set {0, 1}, whatever it marks (two disjoint masks gave 1.0), and a row of per-epoch counts
    # the set of counts it holds (two disjoint rows of counts up to 2 gave 1.0). Such rows repeat
    # 0 (or 0 and 1), which indices hardly do (index 0 drawn twice: np.unique(row) passes it).
    zeros = int(np.count_nonzero(array == 0))
    if zeros > 1 or (indices.size < array.size and indices[-1] <= 1):
        held = f"0 {zeros} times" if zeros > 1 else "only 0 and 1, repeated"
        raise ValueError(
            f"selections[{epoch}] should be a boolean mask or dataset indices, but holds {held} "
            f"({array.size} values): a 0/1 mask or per-epoch counts? Pass it as "
            "booleans (row > 0), or its indices (np.flatnonzero(row)); indices that repeat 0 "
            "as np.unique(row)"
        )
    return indices


def selection_stability(selections: Any) -> np.ndarray:
    """The Jaccard index of consecutive epochs' selected sets A and B: |A & B| / |A | B|.

    1 when an epoch selects exactly the examples the previous one did, 0 when none of them.
    Repeated indices count once (a set), but an integer row that holds 0 more than once (or
    only 0s and 1s, repeated) is refused as a 0/1 mask or per-epoch counts (pass masks as
    booleans, and indices that repeat 0 as ``np.unique(row)``), and so are boolean masks of
    different lengths. Two empty sets have no overlap to measure: their Jaccard index is NaN (a
    gap in a plot, not a perfect score); one empty set against a
    non-empty one gives 0.

    Args:
        selections: per epoch, the selected examples: a boolean matrix (epochs, N), or a sequence
            with, per epoch, a boolean mask or an array of dataset indices.

    Returns:
        float64 (epochs - 1,): entry e compares epoch e with epoch e + 1 (empty for < 2 epochs).

    Example:
        >>> selection_stability([[0, 1, 2], [1, 2, 3], [], []]).tolist()
        [0.5, 0.0, nan]
        >>> import numpy as np
        >>> selection_stability(np.array([[True, True, False], [True, False, False]])).tolist()
        [0.5]
    """
    if isinstance(selections, (np.ndarray, torch.Tensor)):
        array = _numpy(selections)
        if array.ndim != 2:
            raise ValueError(
                f"selections should be a matrix (epochs, examples) or a list of per-epoch "
                f"selections, but has shape {array.shape}"
            )
        if array.dtype != np.bool_:
            # NOTE: a row of another dtype would be read as dataset indices: a 0/1 mask or a
            # count matrix (a run's "selected" array) would compare its values, not its members.
            raise TypeError(
                f"a selections matrix should be boolean (epochs, examples), but has dtype "
                f"{array.dtype}; pass selections > 0 (a 0/1 mask or per-epoch counts), or a list "
                "of per-epoch index arrays"
            )
        rows: Sequence[Any] = list(array)
    elif isinstance(selections, Sequence) and not isinstance(selections, str):
        rows = selections
    else:
        raise TypeError(
            f"selections should be a matrix (epochs, examples) or a list of per-epoch selections, "
            f"but got {type(selections).__name__}"
        )
    # NOTE: masks of different lengths are not over the same examples (one run's, another's).
    sizes = {len(row) for row in rows if _numpy(row).dtype == np.bool_ and _numpy(row).ndim == 1}
    if len(sizes) > 1:
        raise ValueError(
            f"selections' boolean masks should all be over the same examples, but have lengths "
            f"{sorted(sizes)}; pass one mask of length N (the dataset's size) per epoch"
        )
    sets = [_selected_set(e, row) for e, row in enumerate(rows)]
    jaccard = np.full(max(len(sets) - 1, 0), np.nan, dtype=np.float64)
    for e in range(len(sets) - 1):
        a, b = sets[e], sets[e + 1]
        both = np.intersect1d(a, b, assume_unique=True).size
        union = a.size + b.size - both
        if union:
            jaccard[e] = both / union
    return jaccard


# --- overlap of two rankings ----------------------------------------------------------------------


def overlap_curve(
    scores_a: Any,
    scores_b: Any,
    fractions: Any,
    *,
    direction: str = "lowest",
    ties: str = "index",
) -> np.ndarray:
    """At each fraction f, the share of A's top f that is also in B's top f.

    The top f of a score is its k = round(f * N) examples (halves rounded up) with the lowest
    scores (``direction="lowest"``, e.g. the examples pruned first by EL2N, or used least by SB)
    or the highest. The overlap is |top(A) ∩ top(B)| / k; two random rankings give f on average
    (:func:`random_overlap`). Ranks work as scores (rank 0 first with ``"lowest"``); negate one
    score to compare its lowest with the other's highest.

    Args:
        scores_a, scores_b: (N,) scores of the same examples; no NaN (keep only the examples both
            scored, e.g. ``ok = ~np.isnan(a) & ~np.isnan(b)`` and pass ``a[ok], b[ok]``).
        fractions: fractions in (0, 1], a number or an array.
        direction: ``"lowest"`` or ``"highest"``: which end of each score is its top.
        ties: ``"index"``: ties at the k-th place are broken by index, the lower index first (in
            either direction), so each top holds exactly k examples. ``"expected"``: the overlap
            expected if those ties were broken at random (deterministic; better for integer
            scores such as selection counts, whose ties are large).

    Returns:
        float64 of the shape of ``fractions``; NaN where k = 0 (N = 0 or f < 1 / (2N)).

    Example:
        >>> a = [0.1, 0.2, 0.3, 0.4]
        >>> b = [0.4, 0.1, 0.2, 0.3]
        >>> overlap_curve(a, b, [0.25, 0.5, 0.75, 1.0]).tolist()
        [0.0, 0.5, 0.6666666666666666, 1.0]
        >>> overlap_curve([0, 0, 0, 1], [0, 1, 0, 1], 0.5).tolist()
        0.5
        >>> overlap_curve([0, 0, 0, 1], [0, 1, 0, 1], 0.5, ties="expected").tolist()
        0.6666666666666666
    """
    a, b = _pair(scores_a, scores_b, nan=False)
    fracs = _fractions(fractions)
    direction = _direction(direction)
    ties = check_choice("ties", ties, _TIES)
    n = a.size
    sizes = _top_sizes(fracs, n).reshape(-1)
    key_a, key_b = (a, b) if direction == "lowest" else (-a, -b)
    order_a, order_b = _order(key_a), _order(key_b)
    overlap = np.full(sizes.shape, np.nan, dtype=np.float64)
    if ties == "index":
        # An example is in both tops of size k iff its later position of the two is below k.
        position_a = np.empty(n, dtype=np.int64)
        position_a[order_a] = np.arange(n)
        position_b = np.empty(n, dtype=np.int64)
        position_b[order_b] = np.arange(n)
        later = np.sort(np.maximum(position_a, position_b))
        both = np.searchsorted(later, sizes, side="left")
        np.divide(both, sizes, out=overlap, where=sizes > 0)
    else:
        for i, k in enumerate(sizes.tolist()):
            if k:
                in_a = _membership(key_a, order_a, k, ties)
                in_b = _membership(key_b, order_b, k, ties)
                overlap[i] = float(in_a @ in_b) / k
    return overlap.reshape(fracs.shape)


def random_overlap(n: int, fractions: Any) -> np.ndarray:
    """The overlap :func:`overlap_curve` expects from two independent random rankings of n.

    With k = round(f * n) (as :func:`overlap_curve` rounds), the intersection of two random
    k-subsets is hypergeometric with mean k^2 / n, so the expected overlap is k / n (about f).

    Args:
        n: the number of examples ranked.
        fractions: fractions in (0, 1].

    Returns:
        float64 of the shape of ``fractions``; NaN where k = 0.

    Example:
        >>> random_overlap(10, [0.1, 0.25, 1.0]).tolist()
        [0.1, 0.3, 1.0]
    """
    n = check_int("n", n, minimum=0)
    fracs = _fractions(fractions)
    sizes = _top_sizes(fracs, n)
    expected = np.full(sizes.shape, np.nan, dtype=np.float64)
    np.divide(sizes, n, out=expected, where=sizes > 0)
    return expected


def random_overlap_band(
    n: int,
    fractions: Any,
    rng: np.random.Generator,
    *,
    draws: int = 1000,
    quantiles: Any = (0.025, 0.975),
) -> np.ndarray:
    """Quantiles of the overlap of two random rankings, simulated: a band around
    :func:`random_overlap` to draw with an overlap curve.

    Each draw is the overlap of two independent random k-subsets of n examples, sampled
    exactly from its hypergeometric distribution with ``rng`` (never numpy's global generator).

    Args:
        n: the number of examples ranked.
        fractions: fractions in (0, 1].
        rng: a :class:`numpy.random.Generator` (e.g. ``numpy.random.default_rng(0)``).
        draws: random ranking pairs per fraction.
        quantiles: quantiles in [0, 1] of the simulated overlaps (default: a central 95% band).

    Returns:
        float64 (len(quantiles), *fractions.shape); NaN where k = 0.

    Example:
        >>> import numpy as np
        >>> band = random_overlap_band(1000, [0.1, 0.5], np.random.default_rng(0))
        >>> bool(((band[0] < [0.1, 0.5]) & ([0.1, 0.5] < band[1])).all())
        True
    """
    n = check_int("n", n, minimum=0)
    draws = check_int("draws", draws, minimum=1)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"rng should be a numpy.random.Generator, but got {type(rng).__name__}; pass "
            "numpy.random.default_rng(seed)"
        )
    fracs = _fractions(fractions)
    qs = np.atleast_1d(np.asarray(_numpy(quantiles), dtype=np.float64))
    if qs.ndim != 1:
        raise ValueError(f"quantiles should be 1-d, but has shape {qs.shape}")
    for q in qs.tolist():
        check_float("quantiles", q, low=0.0, high=1.0)
    sizes = _top_sizes(fracs, n).reshape(-1)
    band = np.full((qs.size, sizes.size), np.nan, dtype=np.float64)
    for i, k in enumerate(sizes.tolist()):
        if k:
            both = rng.hypergeometric(k, n - k, k, size=draws)
            band[:, i] = np.quantile(both / k, qs)
    return band.reshape((qs.size, *fracs.shape))


# --- galleries ------------------------------------------------------------------------------------


def gallery_indices(scores: Any, k: int, *, direction: str = "lowest") -> np.ndarray:
    """The indices of the k examples with the lowest (or highest) scores, most extreme first.

    Easiest: the lowest loss; hardest: the highest; least used: the lowest selection frequency;
    most used: the highest; lowest combined rank: the lowest :func:`combined_rank`.

    Ties are broken by index, the lower index first (in either direction). Examples with a NaN
    score (never scored, never seen) are never picked, so fewer than k come back when fewer than
    k have a score.

    Args:
        scores: (N,) per-example scores.
        k: how many indices (>= 0).
        direction: ``"lowest"`` or ``"highest"``.

    Returns:
        int64 (min(k, examples with a score),).

    Example:
        >>> gallery_indices([0.3, 0.1, float("nan"), 0.1, 0.9], 3).tolist()
        [1, 3, 0]
        >>> gallery_indices([0.3, 0.1, float("nan"), 0.1, 0.9], 2, direction="highest").tolist()
        [4, 0]
    """
    values = _vector("scores", scores, nan=True)
    k = check_int("k", k, minimum=0)
    direction = _direction(direction)
    scored = np.flatnonzero(~np.isnan(values))
    key = values[scored] if direction == "lowest" else -values[scored]
    return scored[_order(key)[:k]].astype(np.int64)


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``values`` ascending, tied values sharing their mean rank."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.ones(values.size, dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    last = np.append(first[1:], values.size) - 1
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = ((first + last) / 2.0 + 1.0)[group]
    return ranks


def combined_rank(scores_a: Any, scores_b: Any) -> np.ndarray:
    """The sum of each example's ranks in two scores (e.g. EL2N and SB's loss), ranked ascending.

    Each score is ranked 1 (lowest) to n among the examples that have both scores; tied values
    share their mean rank, so the result does not depend on the examples' order. Pass it to
    :func:`gallery_indices` for the examples lowest by both (``direction="lowest"``) or highest
    by both (``"highest"``).

    Args:
        scores_a, scores_b: (N,) scores of the same examples (NaN: not scored).

    Returns:
        float64 (N,): rank in A + rank in B, in [2, 2n]; NaN where either score is NaN.

    Example:
        >>> combined_rank([0.1, 0.2, 0.3, float("nan")], [0.5, 0.5, 0.1, 0.0]).tolist()
        [3.5, 4.5, 4.0, nan]
    """
    a, b = _pair(scores_a, scores_b, nan=True)
    both = np.flatnonzero(~np.isnan(a) & ~np.isnan(b))
    combined = np.full(a.size, np.nan, dtype=np.float64)
    combined[both] = _average_ranks(a[both]) + _average_ranks(b[both])
    return combined


# --- label noise ----------------------------------------------------------------------------------


def _flipped_indices(flipped: Any, n: int) -> np.ndarray:
    """The flipped examples, given as dataset indices or as a boolean mask of ``n``, as sorted
    unique int64 indices (not yet checked against ``n``)."""
    raw = _numpy(flipped)
    if raw.dtype == np.bool_:
        if raw.shape != (n,):
            raise ValueError(
                f"flipped as a boolean mask should have one flag per example ({n},), but has "
                f"shape {raw.shape}; or pass the dataset indices of the flipped examples"
            )
        return np.flatnonzero(raw).astype(np.int64)
    if raw.size == 0:
        raw = raw.astype(np.int64)  # (an empty list is float64: no flipped labels)
    given = check_indices("flipped", raw)
    indices = np.unique(given)
    # NOTE: a 0/1 integer mask ((noisy != clean).astype(int)) read as indices names examples 0
    # and 1 only, a silently wrong share; real indices of flipped labels do not repeat 0 and 1.
    if indices.size < given.size and indices[0] >= 0 and indices[-1] <= 1:
        raise ValueError(
            f"flipped should hold the dataset indices of the flipped examples, but holds only 0 "
            f"and 1, repeated ({given.size} values): a 0/1 mask? Pass it as booleans "
            "(flipped.astype(bool)), or its indices (np.flatnonzero(flipped))"
        )
    return indices


def flipped_share(flipped: Any, selection: Any, k: int, *, ties: str = "index") -> NoiseShare:
    """How many of the flipped labels are among the k most selected examples.

    A method that learns the hard cases and not the label noise keeps the share near the
    noise rate; one that chases noisy labels (their loss stays high) raises it.

    Args:
        flipped: dataset indices of the examples whose label was flipped (repeats count once),
            or a boolean mask with one flag per example (``noisy_labels != clean_labels``).
        selection: (N,) selection counts or frequencies (:func:`selection_frequency`); NaN
            (never seen) examples are left out of the ranking and of the noise rate.
        k: how many of the most selected examples to look at (1 to the examples with a count).
        ties: how ties at the k-th place are broken: ``"index"`` (the lower index first) or
            ``"expected"`` (the share expected if they were broken at random; deterministic, and
            unbiased when selection counts tie in large groups).

    Returns:
        :class:`NoiseShare`: ``share`` among the k most selected, and ``expected``, the share
        among k examples chosen at random (the noise rate among the examples with a count).

    Example:
        >>> flipped_share([1, 4], [5, 9, 1, 2, 4, 0], k=2)
        NoiseShare(share=0.5, expected=0.3333333333333333)
        >>> flipped_share([3], [2, 1, 1, 1], k=2, ties="expected").share
        0.16666666666666666
    """
    values = _vector("selection", selection, nan=True)
    n = values.size
    indices = _flipped_indices(flipped, n)
    if indices.size and (indices[0] < 0 or indices[-1] >= n):
        bad = indices[(indices < 0) | (indices >= n)][0]
        raise ValueError(
            f"flipped should hold dataset indices in [0, {n}) for a selection of {n} examples, "
            f"but holds {bad}"
        )
    ties = check_choice("ties", ties, _TIES)
    scored = np.flatnonzero(~np.isnan(values))
    k = check_int("k", k, minimum=1)
    if k > scored.size:
        raise ValueError(
            f"k should be at most the {scored.size} examples with a selection count, but got k={k}"
        )
    is_flipped = np.zeros(n, dtype=bool)
    is_flipped[indices] = True
    key = -values[scored]
    weights = _membership(key, _order(key), k, ties)
    share = float(weights @ is_flipped[scored]) / k
    expected = float(is_flipped[scored].mean())
    return NoiseShare(share, expected)
