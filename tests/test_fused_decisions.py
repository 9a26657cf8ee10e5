"""SelectiveBackprop's one-kernel-call decision against a reference copy of the arithmetic it
replaced (window push and rank, then ``rng.random(n) < P``, flatnonzero, weights, store record
and count, each a separate numpy step): identical choices, probabilities, weights, window, store
and generator state on a grid of seeds, selectivities, histories, ties, non-finite losses and
Stale-SB epochs."""

from __future__ import annotations

import numpy as np
import pytest

from sbloader import ExampleStore, SelectiveBackprop
from sbloader._random import hashed_uniforms
from sbloader.decisions import choose_finite
from sbloader.policies import Choice


# ---------------------------------------------------------------------- the reference
# A plain-Python copy of the per-batch arithmetic before the fused kernel (commit bf59271):
# LossWindow's push_and_cdf_power / cdf_power kernels, ExampleStore's record / lookup / count
# and SelectiveBackprop.choose, step by step.
def count_le(s, n, x):
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if s[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def count_lt(s, n, x):
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if s[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


class RefWindow:
    def __init__(self, size):
        self.ring = np.zeros(size)
        self.sorted = np.zeros(size)
        self.n = self.head = 0

    def _push(self, x):
        cap, n = self.ring.shape[0], self.n
        s = self.sorted
        if n < cap:
            pos = count_le(s, n, x)
            s[pos + 1 : n + 1] = s[pos:n].copy()
            s[pos] = x
            self.n = n + 1
        else:
            old = self.ring[self.head]
            p_old, p_new = count_lt(s, n, old), count_le(s, n, x)
            if p_new > p_old:
                s[p_old : p_new - 1] = s[p_old + 1 : p_new].copy()
                s[p_new - 1] = x
            else:
                s[p_new + 1 : p_old + 1] = s[p_new:p_old].copy()
                s[p_new] = x
        self.ring[self.head] = x
        self.head = (self.head + 1) % cap

    def push_and_rank(self, losses, beta):
        out = np.empty(len(losses))
        for i, x in enumerate(losses):
            if not np.isfinite(x):
                out[i] = np.nan
                continue
            self._push(x)
            out[i] = (count_le(self.sorted, self.n, x) / self.n) ** beta
        return out

    def rank(self, losses, beta):
        return np.array(
            [
                ((count_le(self.sorted, self.n, x) + 1) / (self.n + 1)) ** beta
                if np.isfinite(x)
                else np.nan
                for x in losses
            ]
        )

    def values(self):
        if self.n < self.ring.shape[0]:
            return self.ring[: self.n].copy()
        return np.concatenate([self.ring[self.head :], self.ring[: self.head]])


class RefSB:
    """SelectiveBackprop.choose as it was, with its store as three numpy columns."""

    def __init__(self, beta, history, size, reweight, key):
        self.beta, self.reweight, self.key = beta, reweight, key
        self.window = RefWindow(history)
        self.loss = np.zeros(size, np.float32)
        self.seen = np.zeros(size, np.int32)
        self.selected = np.zeros(size, np.int32)
        self.store = size > 0
        self.epoch = 0

    def stale_probabilities(self, indices):
        stored = np.where(self.seen[indices] > 0, self.loss[indices].astype(np.float64), np.nan)
        p = self.window.rank(stored, self.beta)
        p[(self.seen[indices] == 0) | (stored == np.inf)] = 1.0  # (+inf: kept non-finite)
        return p

    def choose(self, losses, indices, rng, n):
        if losses is not None:
            p = self.window.push_and_rank(losses, self.beta)
            if self.store:
                ok = np.isfinite(losses)
                self.loss[indices[ok]] = losses[ok]
                self.seen[indices[ok]] = self.epoch + 1
            keep = rng.random(n) < p
        else:
            p = self.stale_probabilities(indices)
            keep = hashed_uniforms(self.key, self.epoch, indices) < p
        positions = np.flatnonzero(keep).astype(np.int64)
        if self.store:
            np.add.at(self.selected, indices[positions], 1)
        weights = 1.0 / p[positions] if self.reweight else np.ones(len(positions))
        return Choice(positions, p, weights)


# ---------------------------------------------------------------------- the comparison
def losses_with_ties(rng, n, nonfinite):
    """Exponential losses rounded to one decimal (many ties), some zeros, some non-finite."""
    x = np.round(rng.exponential(size=n), 1)
    x[rng.random(n) < 0.05] = 0.0
    if nonfinite:
        special = rng.random(n)
        x[special < 0.04] = np.nan
        x[(special >= 0.04) & (special < 0.06)] = np.inf
    return x


def assert_same_choice(new, old):
    np.testing.assert_array_equal(new.positions, old.positions)
    assert new.positions.dtype == np.int64
    np.testing.assert_array_equal(new.probabilities, old.probabilities)  # NaN equal to NaN
    np.testing.assert_array_equal(new.weights, old.weights)


class Adapter:
    """The reference under choose_finite (which hands a policy only finite losses)."""

    def __init__(self, ref):
        self.ref = ref

    def choose(self, losses, indices, rng, n):
        return self.ref.choose(losses, indices, rng, n)

    def count_forced(self, indices):
        """Examples kept for their non-finite losses count as selected (nonfinite="select"),
        stored as kept non-finite (+inf, scored in this epoch)."""
        if self.ref.store:
            np.add.at(self.ref.selected, indices, 1)
            self.ref.loss[indices] = np.inf
            self.ref.seen[indices] = self.ref.epoch + 1

    def normalize_weights(self):
        """The weights are compared as chosen (checked_choice asks, to check them)."""
        return False


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("selectivity", [1.0, 0.5, 1 / 3, 0.1])
@pytest.mark.parametrize("history", [1, 7, 1024])
@pytest.mark.parametrize("nonfinite", ["skip", "select", None])
def test_fresh_choices_identical_to_the_reference(seed, selectivity, history, nonfinite):
    reweight = seed == 1
    new = SelectiveBackprop(selectivity, history=history, reweight=reweight)
    ref = RefSB(new.beta, history, 0, reweight, 0)
    data = np.random.default_rng(100 + seed)
    rng_new, rng_old = np.random.default_rng(seed), np.random.default_rng(seed)
    for n in (0, 1, 300, 2000, 64):
        losses = losses_with_ties(data, n, nonfinite is not None)
        if nonfinite is None:
            a = new.choose(losses, None, rng_new, n)
            b = ref.choose(losses, None, rng_old, n)
        else:
            a, bad_a = choose_finite(new, losses, None, rng_new, n, nonfinite)
            b, bad_b = choose_finite(Adapter(ref), losses, None, rng_old, n, nonfinite)  # type: ignore[arg-type]
            assert bad_a == bad_b
        assert_same_choice(a, b)
        np.testing.assert_array_equal(new.window.values(), ref.window.values())
        np.testing.assert_array_equal(new.window.sorted_values(), ref.window.sorted[: ref.window.n])
    assert rng_new.bit_generator.state == rng_old.bit_generator.state


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("selectivity", [0.5, 0.2])
@pytest.mark.parametrize("reweight", [False, True])
def test_stale_sb_choices_and_store_identical_to_the_reference(seed, selectivity, reweight):
    """Fresh epochs record losses (repeated indices, never-scored examples, non-finite losses);
    stale epochs decide from the store with counter-based uniforms, and prefilter agrees."""
    size = 500
    new = SelectiveBackprop(selectivity, history=64, staleness=3, reweight=reweight)
    new.attach(size, key=7 + seed)
    assert new.store is not None
    ref = RefSB(new.beta, 64, size, reweight, 7 + seed)
    data = np.random.default_rng(seed)
    rng_new, rng_old = np.random.default_rng(seed), np.random.default_rng(seed)
    for epoch in range(6):
        new.begin_epoch(epoch)
        ref.epoch = epoch
        for _ in range(4):
            n = 120
            indices = data.integers(0, size // (2 if epoch == 0 else 1), n)  # repeats; some unseen
            if new.needs_losses(epoch):
                losses = losses_with_ties(data, n, True)
                a, _ = choose_finite(new, losses, indices, rng_new, n, "select")
                b, _ = choose_finite(Adapter(ref), losses, indices, rng_old, n, "select")  # type: ignore[arg-type]
            else:
                a = new.choose(None, indices, rng_new, n)
                b = ref.choose(None, indices, rng_old, n)
                keep = new.prefilter(indices)
                np.testing.assert_array_equal(np.flatnonzero(keep), a.positions)
            assert_same_choice(a, b)
        np.testing.assert_array_equal(new.store.loss, ref.loss)
        np.testing.assert_array_equal(new.store.seen, ref.seen)
        np.testing.assert_array_equal(new.store.selected, ref.selected)
    assert rng_new.bit_generator.state == rng_old.bit_generator.state


@pytest.mark.parametrize("stale", [False, True])
def test_indices_outside_the_store_change_nothing(stale):
    """A batch holding an index outside the store is refused, in a fresh epoch and in a stale
    one (decided from stored losses) alike, before anything changes: the stale one would
    otherwise choose none of it silently."""
    sb = SelectiveBackprop(0.5, history=8, staleness=2)
    sb.attach(10, key=0)
    assert sb.store is not None
    sb.begin_epoch(0)
    sb.choose(np.array([1.0, 2.0]), np.array([0, 1]), np.random.default_rng(0), 2)
    if stale:
        sb.begin_epoch(1)
        assert not sb.needs_losses(1)
    window, selected = sb.window.values(), sb.store.selected.copy()
    losses = None if stale else np.array([3.0, 4.0])
    with pytest.raises(IndexError, match="outside the store of size 10"):
        sb.choose(losses, np.array([2, 10]), np.random.default_rng(0), 2)
    np.testing.assert_array_equal(sb.window.values(), window)
    np.testing.assert_array_equal(sb.store.selected, selected)
    assert sb.store.seen[2] == 0


@pytest.mark.parametrize("mapped", [False, True])
def test_a_store_call_refused_for_an_index_outside_changes_nothing(mapped, tmp_path):
    """ExampleStore.record and count_selected refuse a call holding an index outside the
    store before writing anything, as lookup, mark_nonfinite and the fused kernels do: they
    wrote the indices inside, then raised, so a refused call had changed the store."""
    store = ExampleStore(4, path=tmp_path if mapped else None)
    store.record(np.array([1]), np.array([0.5]), epoch=0)
    with pytest.raises(IndexError, match="outside the store of size 4"):
        store.record(np.array([2, 1, 9]), np.array([7.0, 8.0, 9.0]), epoch=1)
    with pytest.raises(IndexError, match="outside the store of size 4"):
        store.count_selected(np.array([2, -1]))
    losses, epochs = store.lookup(np.arange(4))
    np.testing.assert_array_equal(losses, [np.nan, 0.5, np.nan, np.nan])
    assert epochs.tolist() == [-1, 0, -1, -1] and store.selected.tolist() == [0, 0, 0, 0]


def test_lengths_must_match():
    sb = SelectiveBackprop(0.5, history=8)
    with pytest.raises(ValueError, match="uniforms should hold one entry per candidate"):
        sb.window.push_rank_and_draw(np.ones(3), np.ones(2), 1.0, False)


def test_a_stale_choice_ranks_against_the_held_losses_of_a_window_not_full():
    """A stale epoch's decision ranks each stored loss against the losses the window holds,
    not against its unused slots: with a window of 64 holding 10 losses, the kernel's P is the
    prefilter's (``stale_probabilities``), which the source loaded by."""
    sb = SelectiveBackprop(beta=1.0, history=64, staleness=2)
    sb.attach(10, 0)
    sb.begin_epoch(0)
    rng = np.random.default_rng(0)
    indices = np.arange(10)
    sb.choose(np.linspace(1.0, 10.0, 10), indices, rng, 10)
    sb.begin_epoch(1)
    assert len(sb.window) == 10 and not sb.needs_losses(1)
    expected = sb.stale_probabilities(indices)
    np.testing.assert_allclose(expected, (np.arange(1, 11) + 1) / 11)
    np.testing.assert_array_equal(sb.choose(None, indices, rng, 10).probabilities, expected)
