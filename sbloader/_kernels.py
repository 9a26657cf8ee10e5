"""Every numba kernel of sbloader, in one module.

Rules for this module:
- ``cache=True`` and no ``fastmath``: fastmath lets the compiler assume no NaN, which makes
  ``np.isnan`` lie, and NaN handling is a feature here.
- Callers pass contiguous arrays of explicit dtypes (float64 values, int64 counters); the thin
  Python wrappers in ``window.py`` and ``store.py`` enforce that.
- Callers pass every argument, defaults included: a call that leaves a default out is typed
  with numba's ``omitted`` arguments and took about 80 microseconds more per call here (the
  fused SB kernel: 170 instead of 90 for a pool of 512).
- No randomness in here: numba's RNG is separate from numpy's, so uniforms are drawn by the
  caller from the loader's own ``numpy.random.Generator``.
- Every kernel also runs as plain Python under ``NUMBA_DISABLE_JIT=1`` (the test suite checks).
"""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)


@_jit
def count_le(sorted_values: np.ndarray, n: int, x: float) -> int:
    """Number of entries of ``sorted_values[:n]`` that are <= ``x`` (binary search)."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) >> 1
        if sorted_values[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@_jit
def count_lt(sorted_values: np.ndarray, n: int, x: float) -> int:
    """Number of entries of ``sorted_values[:n]`` that are < ``x`` (binary search)."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) >> 1
        if sorted_values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@_jit
def window_push(ring: np.ndarray, sorted_values: np.ndarray, meta: np.ndarray, x: float) -> None:
    """Append the finite value ``x`` to the window, evicting the oldest value when full.

    ``ring`` holds values in arrival order (``meta[1]`` is the next slot to write);
    ``sorted_values`` holds the same ``meta[0]`` values in ascending order. Finding positions
    costs O(log R); the shift moves only the entries between the evicted and the new value.

    NOTE: the shifts are slice assignments (numba copies overlapping slices correctly, as
    numpy does), which compile to block copies: about 10x faster than an element loop.
    """
    cap = ring.shape[0]
    n = meta[0]
    head = meta[1]
    if n < cap:
        pos = count_le(sorted_values, n, x)
        sorted_values[pos + 1 : n + 1] = sorted_values[pos:n]
        sorted_values[pos] = x
        meta[0] = n + 1
    else:
        old = ring[head]
        # Any entry equal to ``old`` may be removed: equal values are interchangeable.
        p_old = count_lt(sorted_values, n, old)
        p_new = count_le(sorted_values, n, x)
        if p_new > p_old:
            sorted_values[p_old : p_new - 1] = sorted_values[p_old + 1 : p_new]
            sorted_values[p_new - 1] = x
        else:
            sorted_values[p_new + 1 : p_old + 1] = sorted_values[p_new:p_old]
            sorted_values[p_new] = x
    ring[head] = x
    meta[1] = (head + 1) % cap


@_jit
def first_outside(values: np.ndarray, low: float, high: float) -> int:
    """The first position of ``values`` outside ``[low, high]`` (NaN is outside any range), or
    -1 where every value is inside: one pass, which stops at the first one outside."""
    for i in range(values.shape[0]):
        x = values[i]
        if not (low <= x <= high):
            return i
    return -1


#: ``cut_power``'s relative tolerance at the cut (see its NOTE).
CUT_TOLERANCE = 1.0 + 1e-12


@_jit
def cut_power(cdf: float, beta: float, cut: float) -> float:
    """``(cdf / cut) ** beta`` up to ``cut``, 0 above it: Selective-Backprop's P with the losses
    above the window's ``cut`` quantile never kept (``cut = 1``: exactly ``cdf ** beta``).

    NOTE (the cut itself): ``cut = 1 - trim_top`` is rounded in float (1 - 0.07 is
    0.92999...), so the loss at exactly the ``cut`` quantile (CDF 93/100) would compare above
    it and be trimmed with the ones above; a relative tolerance of 1e-12 (far below any CDF
    step 1/R) keeps it, with P = 1 at most."""
    return tied_cut_power(cdf, cdf, beta, cut)


@_jit
def tied_cut_power(cdf: float, first: float, beta: float, cut: float) -> float:
    """:func:`cut_power` of a loss that equal losses may share: ``cdf`` is the CDF of the
    highest rank of its group of equal values, ``first`` that of the lowest (``(#{w < loss} +
    1) / n``; ``first == cdf`` for a loss no other equals). The loss is left out only where the
    whole group is above the cut (``first`` > ``cut``).

    NOTE (ties): judged by ``cdf`` alone, a group of equal losses that reaches down to the cut
    (all-equal losses: fp16 losses underflowing to 0, a clipped loss at its clip) was above it
    whole: every loss got P = 0, and a loader kept nothing, where plain SB keeps such losses
    with P = 1. A group at the cut is at the ``1 - trim_top`` quantile, which is kept: P =
    ``min(1, (cdf / cut) ** beta)``, 1 where it reaches above the cut."""
    if first > cut * CUT_TOLERANCE:
        return 0.0
    return min(1.0, (cdf / cut) ** beta)


@_jit
def push_and_cdf_power(
    ring: np.ndarray,
    sorted_values: np.ndarray,
    meta: np.ndarray,
    losses: np.ndarray,
    beta: float,
    out: np.ndarray,
    cut: float = 1.0,
) -> None:
    """Selective-Backprop's probability, one loss at a time, as the paper's Algorithm 1.

    Each finite loss first enters the window, then gets ``P = CDF(loss) ** beta`` with the
    empirical CDF ``#{w in window : w <= loss} / len(window)``. Non-finite losses never enter the
    window and get ``P = NaN`` (the caller decides what happens to them).

    NOTE (ties): counting ``<=`` (the right-continuous empirical CDF) gives every loss a CDF of
    at least 1/len(window) because the loss itself is in the window, gives the largest loss P = 1,
    and gives all-equal losses P = 1: when losses carry no ranking information (e.g. fp16
    underflow to 0) Selective-Backprop degrades to Traditional rather than to selecting nothing.
    A tied group thus keeps more than its share: were 40% of losses exactly 0, beta = 2 would
    keep about 0.376 instead of 1/3. Measured on real losses, ties are too rare to matter: the
    benchmark CNN's float32 and bf16 losses over Fashion-MNIST's 60,000 training images in its
    first three epochs (up to 2.7% of them exactly 0) kept 0.3338 in windows of 1,024, equal to
    four decimals to the tie-averaged rank's kept fraction.
    With ``cut`` < 1, P is :func:`tied_cut_power` of the CDF (the losses above the cut never
    kept; equal losses reaching down to it are).
    """
    for i in range(losses.shape[0]):
        x = losses[i]
        if not np.isfinite(x):
            out[i] = np.nan
            continue
        window_push(ring, sorted_values, meta, x)
        n = meta[0]
        cdf = count_le(sorted_values, n, x) / n
        # (the lowest rank of the loss's equals only where a cut can leave it out)
        first = (count_lt(sorted_values, n, x) + 1) / n if cut < 1.0 else cdf
        out[i] = tied_cut_power(cdf, first, beta, cut)


@_jit
def cdf_power(
    sorted_values: np.ndarray,
    n: int,
    losses: np.ndarray,
    beta: float,
    out: np.ndarray,
    cut: float = 1.0,
) -> None:
    """``CDF(loss) ** beta`` against the window without changing it; NaN for non-finite losses.

    Each loss is ranked as if it had been added to the window, ``(#{w <= loss} + 1) / (n + 1)``,
    so that, as in ``push_and_cdf_power``, no loss gets P = 0 and an empty window gives P = 1
    (with ``cut`` < 1: :func:`cut_power` of that CDF).
    """
    for i in range(losses.shape[0]):
        x = losses[i]
        if not np.isfinite(x):
            out[i] = np.nan
        else:
            out[i] = _ranked_cut_power(sorted_values, n, x, beta, cut)


@_jit
def _ranked_cut_power(
    sorted_values: np.ndarray, n: int, x: float, beta: float, cut: float
) -> float:
    """:func:`tied_cut_power` of the finite ``x`` ranked as if added to ``sorted_values[:n]``
    (as :func:`cdf_power`).

    NOTE: a stored loss is mostly ranked against the window that its own selection pass
    filled, which holds it already. So the cut is judged by the lowest rank of its equals
    within the window, ``first = (#{w < x} + 1) / n``, where the window holds a value equal to
    it (its own, mostly), and by its rank as if added, ``(#{w < x} + 1) / (n + 1)``, where it
    holds none. Judged as if added, the window's own ``1 - trim_top`` quantile member ranked
    one step above it, ``(k + 1) / (n + 1)`` for ``k / n`` at the cut, and was trimmed in
    every stale epoch (one loss more than ``trim_top`` of the window, 257 of 1024 for
    ``trim_top=0.25``), though a fresh pass keeps it (its CDF is the cut)."""
    le = count_le(sorted_values, n, x)
    cdf = (le + 1) / (n + 1)
    if cut >= 1.0:
        return tied_cut_power(cdf, cdf, beta, cut)
    lt = count_lt(sorted_values, n, x)
    first = (lt + 1) / n if le > lt else (lt + 1) / (n + 1)
    return tied_cut_power(cdf, first, beta, cut)


@_jit
def argsort_finite(values: np.ndarray) -> np.ndarray:
    """The stable ascending order of the finite float64 ``values`` (int64 positions), by an LSD
    radix sort of their bits, a byte at a time.

    NOTE: numba's ``np.argsort`` is a quicksort compiled from Python, about 22 microseconds for
    512 values on the benchmark CPU (numpy's own takes 5); this takes 6 and made
    :func:`push_all`, which sorts each batch and the values it evicts, about a third faster. A
    float's bits, with the sign bit flipped for positive values and every bit flipped for
    negative ones, order as unsigned integers as the floats do (-0.0 just below 0.0, which
    compare equal; callers treat equal values alike). Passes in which every value has the same
    byte are skipped. NaN has no place in this order: callers pass finite values only.
    """
    n = values.shape[0]
    bits = np.ascontiguousarray(values).view(np.uint64)
    keys = np.empty(n, dtype=np.uint64)
    top = np.uint64(1) << np.uint64(63)
    for i in range(n):
        b = bits[i]
        keys[i] = ~b if b & top else b | top
    order = np.arange(n, dtype=np.int64)
    spare = np.empty(n, dtype=np.int64)
    count = np.empty(257, dtype=np.int64)
    for p in range(8):
        shift = np.uint64(8 * p)
        count[:] = 0
        for i in range(n):
            count[np.int64((keys[i] >> shift) & np.uint64(255)) + 1] += 1
        if n == 0 or np.max(count) == n:
            continue
        for d in range(256):
            count[d + 1] += count[d]
        for i in range(n):
            j = order[i]
            d = np.int64((keys[j] >> shift) & np.uint64(255))
            spare[count[d]] = j
            count[d] += 1
        order, spare = spare, order
    return order


#: From this many finite losses on, :func:`push_all` ranks a batch with a Fenwick tree.
_BATCH_PUSH = 32


@_jit
def push_all(
    ring: np.ndarray,
    sorted_values: np.ndarray,
    meta: np.ndarray,
    losses: np.ndarray,
    counts: np.ndarray,
    sizes: np.ndarray,
    lows: np.ndarray,
) -> None:
    """Push each finite loss in turn into the window (as :func:`window_push`) and record, right
    after it entered, ``counts[i] = #{w in window : w <= losses[i]}``, ``lows[i] = #{w in
    window : w < losses[i]}`` and ``sizes[i]`` = the window's length (all left unset for
    non-finite losses, which never enter).

    NOTE: the counts are those of :func:`push_and_cdf_power`, exactly. Pushing one value shifts
    up to the whole sorted window (a third of it on average); for a batch of many losses the
    values that can be in the window during the batch (the window's and the batch's) are known
    in advance, so a Fenwick tree over their distinct sorted values counts in O(log) per loss,
    and the sorted window is written once at the end from the per-value counts. Each batch
    value's place among the distinct values comes from the merge that builds them (one sort of
    the batch), and each evicted value's from that place or, for the window's own values, from
    one sort of those it evicts: no search per loss.
    """
    m = losses.shape[0]
    finite = 0
    for i in range(m):
        if np.isfinite(losses[i]):
            finite += 1
    if finite < _BATCH_PUSH:
        for i in range(m):
            x = losses[i]
            if np.isfinite(x):
                window_push(ring, sorted_values, meta, x)
                sizes[i] = meta[0]
                counts[i] = count_le(sorted_values, sizes[i], x)
                lows[i] = count_lt(sorted_values, sizes[i], x)
        return
    cap = ring.shape[0]
    n = meta[0]
    head = meta[1]
    n_old = n
    where = np.empty(finite, dtype=np.int64)  # each finite loss's position in ``losses``
    batch = np.empty(finite, dtype=np.float64)  # the finite losses, in order
    j = 0
    for i in range(m):
        if np.isfinite(losses[i]):
            where[j] = i
            batch[j] = losses[i]
            j += 1
    by_value = argsort_finite(batch)
    # The distinct values of the window (sorted already) and the batch, merged in order; each
    # batch value's place among them (``place``) and the window's count of each (``held``) are
    # known from the merge, so that pushing a batch value needs no search.
    distinct = np.empty(n + finite, dtype=np.float64)
    held = np.zeros(n + finite, dtype=np.int64)
    place = np.empty(finite, dtype=np.int64)
    u = 0
    a = 0
    b = 0
    while a < n or b < finite:
        if b >= finite or (a < n and sorted_values[a] <= batch[by_value[b]]):
            v = sorted_values[a]
            a += 1
            if u == 0 or distinct[u - 1] < v:
                distinct[u] = v
                u += 1
            held[u - 1] += 1
        else:
            v = batch[by_value[b]]
            if u == 0 or distinct[u - 1] < v:
                distinct[u] = v
                u += 1
            place[by_value[b]] = u - 1
            b += 1
    tree = np.zeros(u + 1, dtype=np.int64)
    for t in range(1, u + 1):
        tree[t] += held[t - 1]
        up = t + (t & -t)
        if up <= u:
            tree[up] += tree[t]
    # The window's own values that this batch evicts, oldest first, and their places (sorted
    # once and walked along the distinct values, instead of one search each).
    evict = max(0, min(n_old, n_old + finite - cap))
    oldest = head - n_old if head >= n_old else head - n_old + cap
    gone = np.empty(evict, dtype=np.float64)
    for t in range(evict):
        slot = oldest + t
        gone[t] = ring[slot if slot < cap else slot - cap]
    gone_place = np.empty(evict, dtype=np.int64)
    r = 0
    for t in argsort_finite(gone):
        while distinct[r] < gone[t]:
            r += 1
        gone_place[t] = r
    for j in range(finite):
        x = batch[j]
        if n < cap:
            n += 1
        else:
            # The value evicted now entered the window ``cap`` pushes ago: one the window held
            # before this batch or one of this batch's, whose places are both known.
            q = n_old + j - cap
            old = place[q - n_old] if q >= n_old else gone_place[q]
            held[old] -= 1
            _tree_add(tree, u, old, -1)
        rank = place[j]
        held[rank] += 1
        _tree_add(tree, u, rank, 1)
        ring[head] = x
        head += 1
        if head == cap:
            head = 0
        i = where[j]
        sizes[i] = n
        counts[i] = _tree_prefix(tree, rank)
        lows[i] = counts[i] - held[rank]  # (held[rank]: the window's values equal to x)
    pos = 0
    for r in range(u):
        for _ in range(held[r]):
            sorted_values[pos] = distinct[r]
            pos += 1
    meta[0] = n
    meta[1] = head


@_jit
def _tree_add(tree: np.ndarray, u: int, rank: int, delta: int) -> None:
    """Add ``delta`` at ``rank`` (0-based) of a Fenwick tree over ``u`` values."""
    t = rank + 1
    while t <= u:
        tree[t] += delta
        t += t & -t


@_jit
def _tree_prefix(tree: np.ndarray, rank: int) -> int:
    """The sum over ranks ``0 .. rank`` of a Fenwick tree."""
    total = 0
    t = rank + 1
    while t > 0:
        total += tree[t]
        t -= t & -t
    return total


#: The largest float32, the store's loss dtype (see :func:`as_stored`).
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@_jit
def as_stored(x: float) -> float:
    """A finite loss as the store's float32 column holds it: clipped to float32's range, so that
    a finite loss stays finite (stored as inf, a stale epoch's prefilter ranked it NaN and its
    choose ranked it highest)."""
    if x > _FLOAT32_MAX:
        return _FLOAT32_MAX
    if x < -_FLOAT32_MAX:
        return -_FLOAT32_MAX
    return x


# ---------------------------------------------------------------------- Selective-Backprop
# One call per source batch: the policy's whole decision (window, probability, draw, positions,
# weights, store updates) in one kernel, so that the per-batch path makes no chain of small numpy
# calls. The uniforms come from the caller (the loader's generator, or counter-based hashes).


@_jit
def _outside(indices: np.ndarray, size: int) -> int:
    """How many of ``indices`` are outside ``0 .. size - 1``."""
    outside = 0
    for i in range(indices.shape[0]):
        if indices[i] < 0 or indices[i] >= size:
            outside += 1
    return outside


@_jit
def sb_choose_fresh(
    ring: np.ndarray,
    sorted_values: np.ndarray,
    meta: np.ndarray,
    losses: np.ndarray,
    uniforms: np.ndarray,
    beta: float,
    reweight: bool,
    store_loss: np.ndarray,
    store_seen: np.ndarray,
    store_selected: np.ndarray,
    indices: np.ndarray,
    epoch: int,
    out_p: np.ndarray,
    out_positions: np.ndarray,
    out_weights: np.ndarray,
    uniform_share: float = 0.0,
    cut: float = 1.0,
) -> int:
    """Selective-Backprop's decision for one batch with a selection pass, in one call.

    Each loss enters the window and gets ``P = CDF(loss) ** beta`` as in
    :func:`push_and_cdf_power` (NaN when not finite), blended with the uniform keeping
    probability ``1 / (beta + 1)`` when ``uniform_share`` u > 0:
    ``P = u / (beta + 1) + (1 - u) * CDF(loss) ** beta`` (the same expected kept fraction;
    u = 0 leaves P exactly as it was), and with ``cut`` < 1 the CDF's power is
    :func:`cut_power`'s (and the uniform share's rate ``cut / (beta + 1)``, the same kept
    fraction as cut_power's P); candidate ``i`` is kept when ``uniforms[i] < P``. Kept
    positions go to ``out_positions`` in order, their weights (``1 / P`` with ``reweight``,
    else 1) to ``out_weights``. With a store (``indices`` not
    empty), each finite loss is recorded for its dataset index in ``epoch`` (as :func:`as_stored`)
    and each kept index counts one selection.

    Returns the number kept, or minus the number of indices outside the store, in which case
    nothing was changed.
    """
    has_store = indices.shape[0] > 0
    if has_store:
        outside = _outside(indices, store_loss.shape[0])
        if outside:
            return -outside
    m = losses.shape[0]
    counts = np.empty(m, dtype=np.int64)
    sizes = np.empty(m, dtype=np.int64)
    lows = np.empty(m, dtype=np.int64)
    push_all(ring, sorted_values, meta, losses, counts, sizes, lows)
    k = 0
    for i in range(m):
        x = losses[i]
        if not np.isfinite(x):
            out_p[i] = np.nan
            continue
        p = tied_cut_power(counts[i] / sizes[i], (lows[i] + 1) / sizes[i], beta, cut)
        if uniform_share > 0.0:
            # cut / (beta + 1): the kept fraction of cut_power's P (1 / (beta + 1) at cut = 1)
            p = uniform_share * cut / (beta + 1.0) + (1.0 - uniform_share) * p
        out_p[i] = p
        if has_store:
            j = indices[i]
            store_loss[j] = as_stored(x)
            store_seen[j] = epoch + 1
        if uniforms[i] < p:
            out_positions[k] = i
            out_weights[k] = 1.0 / p if reweight else 1.0
            k += 1
            if has_store:
                store_selected[indices[i]] += 1
    return k


@_jit
def sb_choose_stale(
    sorted_values: np.ndarray,
    n: int,
    beta: float,
    reweight: bool,
    store_loss: np.ndarray,
    store_seen: np.ndarray,
    store_selected: np.ndarray,
    indices: np.ndarray,
    uniforms: np.ndarray,
    out_p: np.ndarray,
    out_positions: np.ndarray,
    out_weights: np.ndarray,
    cut: float = 1.0,
) -> int:
    """Stale-SB's decision for one batch without a selection pass, in one call.

    Each candidate's P comes from its stored loss ranked against the window without changing it,
    as :func:`cdf_power` (with its ``cut``; P = 1 for an example never scored or whose stored
    loss is +inf, kept for its non-finite loss, 0 for one whose stored loss is NaN); it is kept
    when
    ``uniforms[i] < P`` and counts one selection. Outputs and the return value as in
    :func:`sb_choose_fresh`.
    """
    outside = _outside(indices, store_loss.shape[0])
    if outside:
        return -outside
    k = 0
    for i in range(indices.shape[0]):
        j = indices[i]
        x = np.float64(store_loss[j])
        if store_seen[j] == 0 or x == np.inf:  # (+inf: kept then, ExampleStore.mark_nonfinite)
            p = 1.0
        elif not np.isfinite(x):  # scored non-finite and skipped then (ExampleStore.mark_nonfinite)
            p = 0.0
        else:
            p = _ranked_cut_power(sorted_values, n, x, beta, cut)
        out_p[i] = p
        if uniforms[i] < p:
            out_positions[k] = i
            out_weights[k] = 1.0 / p if reweight else 1.0
            k += 1
            store_selected[j] += 1
    return k


# ---------------------------------------------------------------------- per-example store
# Columns, each indexed by dataset index: loss float32, seen int32 (the epoch the loss was measured
# in, plus one; 0: never scored), selected int32 (times chosen). 12 bytes per example; the index is
# the position, so indices are exact at any size (no float round trip). All-zero bytes mean "never
# scored", so a new store needs no initialisation pass and a new memory-mapped file stays sparse.


@_jit
def store_record(
    loss: np.ndarray,
    seen: np.ndarray,
    indices: np.ndarray,
    values: np.ndarray,
    at_epoch: int,
) -> int:
    """Store finite ``values[i]`` as the loss of ``indices[i]`` measured in ``at_epoch``.

    Non-finite values are not stored (the example keeps its previous loss); finite ones beyond
    float32's range are stored clipped to it (:func:`as_stored`). Returns the number of indices
    outside the store, in which case nothing was written.

    NOTE: checked before any write (as :func:`sb_choose_fresh`): the indices inside were
    written, and the caller then raised, so a refused call had changed the store.
    """
    outside = _outside(indices, loss.shape[0])
    if outside:
        return outside
    for i in range(indices.shape[0]):
        j = indices[i]
        v = values[i]
        if np.isfinite(v):
            loss[j] = as_stored(v)
            seen[j] = at_epoch + 1
    return outside


@_jit
def store_lookup(
    loss: np.ndarray,
    seen: np.ndarray,
    indices: np.ndarray,
    out_loss: np.ndarray,
    out_epoch: np.ndarray,
) -> int:
    """Gather the stored loss and epoch of each index; returns how many indices are outside."""
    n = loss.shape[0]
    outside = 0
    for i in range(indices.shape[0]):
        j = indices[i]
        if j < 0 or j >= n:
            outside += 1
            out_loss[i] = np.nan
            out_epoch[i] = -1
        elif seen[j] == 0:
            out_loss[i] = np.nan
            out_epoch[i] = -1
        else:
            out_loss[i] = loss[j]
            out_epoch[i] = seen[j] - 1
    return outside


@_jit
def store_count(selected: np.ndarray, indices: np.ndarray) -> int:
    """Add one to the selection count of each index (repeats count twice); returns how many
    indices are outside, in which case nothing was counted (see :func:`store_record`)."""
    outside = _outside(indices, selected.shape[0])
    if outside:
        return outside
    for i in range(indices.shape[0]):
        selected[indices[i]] += 1
    return 0


@_jit
def accumulate(
    sums: np.ndarray, counts: np.ndarray, indices: np.ndarray, values: np.ndarray
) -> int:
    """``sums[indices[i]] += values[i]`` and ``counts[indices[i]] += 1`` for finite values.

    Returns the number of indices outside the arrays (not written).
    """
    n = sums.shape[0]
    outside = 0
    for i in range(indices.shape[0]):
        j = indices[i]
        if j < 0 or j >= n:
            outside += 1
        elif np.isfinite(values[i]):
            sums[j] += values[i]
            counts[j] += 1
    return outside
