"""The numba loss window against a plain-Python reference, on streams with ties, NaN and inf."""

from __future__ import annotations

import bisect
import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbloader import LossWindow, _kernels


class ReferenceWindow:
    """The obvious implementation: a deque and a sorted list."""

    def __init__(self, size: int) -> None:
        self.ring: collections.deque[float] = collections.deque(maxlen=size)

    def push_and_rank(self, losses, beta):
        out = []
        for x in losses:
            if not np.isfinite(x):
                out.append(np.nan)
                continue
            self.ring.append(float(x))
            s = sorted(self.ring)
            out.append((bisect.bisect_right(s, x) / len(s)) ** beta)
        return np.array(out)

    def rank(self, losses, beta):
        s = sorted(self.ring)
        return np.array(
            [
                ((bisect.bisect_right(s, x) + 1) / (len(s) + 1)) ** beta
                if np.isfinite(x)
                else np.nan
                for x in losses
            ]
        )


def stream(rng: np.random.Generator, n: int) -> np.ndarray:
    """Losses with many ties (rounded), some NaN and infinities."""
    x = np.round(rng.exponential(size=n), 1)
    special = rng.random(n)
    x[special < 0.03] = np.nan
    x[(special >= 0.03) & (special < 0.05)] = np.inf
    x[(special >= 0.05) & (special < 0.06)] = -np.inf
    return x


@pytest.mark.parametrize("size", [1, 2, 7, 64, 1024])
@pytest.mark.parametrize("beta", [0.0, 1.0, 2.0, 3.5])
def test_matches_reference_on_streams_with_ties_nan_inf(size, beta):
    rng = np.random.default_rng(size * 10 + int(beta * 2))
    w, ref = LossWindow(size), ReferenceWindow(size)
    for _ in range(6):
        losses = stream(rng, 300)
        np.testing.assert_allclose(w.push_and_rank(losses, beta), ref.push_and_rank(losses, beta))
        assert w.values().tolist() == list(ref.ring)
        assert w.sorted_values().tolist() == sorted(ref.ring)
        probe = stream(rng, 50)
        np.testing.assert_allclose(w.rank(probe, beta), ref.rank(probe, beta))


@pytest.mark.parametrize("size", [1, 5, 40, 1024])
def test_batched_ranking_matches_one_loss_at_a_time(size):
    """push_rank_and_draw ranks a batch of 32 or more finite losses with a Fenwick tree: the
    same probabilities, ring and sorted window as the one-at-a-time reference, across batch
    sizes either side of that threshold, signed zeros, ties and evictions."""
    rng = np.random.default_rng(size)
    w, ref = LossWindow(size), ReferenceWindow(size)
    for n in (31, 32, 33, 300, 1, 64, 2500):
        losses = stream(rng, n)
        losses[rng.random(n) < 0.1] = -0.0
        losses[rng.random(n) < 0.1] = 0.0
        p, positions, _, _ = w.push_rank_and_draw(losses, np.full(n, 0.5), 2.0, False)
        np.testing.assert_array_equal(p, ref.push_and_rank(losses, 2.0))
        np.testing.assert_array_equal(positions, np.flatnonzero(p > 0.5))
        np.testing.assert_array_equal(w.values(), np.array(ref.ring))
        np.testing.assert_array_equal(w.sorted_values(), np.sort(np.array(ref.ring)))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 31, 256, 257, 700])
def test_radix_argsort_is_the_stable_order_of_finite_floats(n):
    """push_all's sort (a byte-wise radix sort of the floats' bits) is the stable ascending
    order of finite floats of every sign and scale: duplicates, signed zeros (-0.0 first),
    subnormals, the extremes, values sharing all but their lowest byte."""
    rng = np.random.default_rng(n)
    pools = [
        rng.normal(size=n) * 10.0 ** rng.integers(-300, 300, size=n),
        np.round(rng.normal(size=n), 1),  # many ties
        rng.choice([-0.0, 0.0, 5e-324, -5e-324, np.finfo(np.float64).max, -1.0], size=n),
        1.0 + np.arange(n) * np.finfo(np.float64).eps,  # differ in the lowest bytes only
        np.full(n, 2.5),  # every pass skipped
    ]
    for values in pools:
        order = _kernels.argsort_finite(np.ascontiguousarray(values))
        assert order.dtype == np.int64
        # ascending, -0.0 before 0.0, equal values in their order
        expected = np.lexsort((np.arange(n), ~np.signbit(values), values))
        np.testing.assert_array_equal(order, expected)
    signed = np.array([0.0, -0.0, 0.0, -0.0])
    np.testing.assert_array_equal(_kernels.argsort_finite(signed), [1, 3, 0, 2])


def test_nonfinite_never_enter_the_window():
    w = LossWindow(8)
    p = w.push_and_rank(np.array([np.nan, np.inf, -np.inf, 1.0]), 1.0)
    assert np.isnan(p[:3]).all() and p[3] == 1.0
    assert w.values().tolist() == [1.0]


def test_ties_never_all_zero_and_max_gets_one():
    w = LossWindow(16)
    p = w.push_and_rank(np.zeros(40), 2.0)  # e.g. fp16 underflow: every loss is 0
    assert (p == 1.0).all()
    p = w.push_and_rank(np.array([5.0, 0.0]), 3.0)
    assert p[0] == 1.0  # the largest loss in the window
    assert p[1] > 0.0  # the smallest is never given P = 0


def test_state_dict_round_trip_is_json_and_exact():
    rng = np.random.default_rng(0)
    w = LossWindow(32)
    w.push(stream(rng, 100))
    state = w.state_dict()
    restored = LossWindow(32)
    restored.load_state_dict(json.loads(json.dumps({**state, "values": state["values"].tolist()})))
    probe = stream(rng, 64)
    np.testing.assert_array_equal(restored.push_and_rank(probe, 2.0), w.push_and_rank(probe, 2.0))


def test_state_dict_size_mismatch_names_the_fix():
    with pytest.raises(ValueError, match="same history"):
        LossWindow(4).load_state_dict(LossWindow(8).state_dict())


@pytest.mark.parametrize("bad", [0, -3])
def test_history_below_one_is_rejected(bad):
    """Each error names the parameter the caller passed: the policy's history, the window's size."""
    from sbloader import SelectiveBackprop

    with pytest.raises(ValueError, match=f"history should be >= 1, but got history={bad}"):
        SelectiveBackprop(history=bad)
    with pytest.raises(ValueError, match=f"size should be >= 1, but got size={bad}"):
        LossWindow(bad)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=80),
    st.floats(0, 5),
)
def test_property_probabilities_in_unit_interval_and_monotone(size, losses, beta):
    w = LossWindow(size)
    p = w.push_and_rank(np.array(losses), beta)
    finite = np.isfinite(losses)
    assert np.isnan(p[~finite]).all()
    assert ((p[finite] > 0) & (p[finite] <= 1)).all()
    probe = np.sort(np.array([x for x in losses if np.isfinite(x)]))
    r = w.rank(probe, beta)
    assert (np.diff(r) >= 0).all()  # monotone in the loss


def test_kernels_run_without_jit():
    """The window's tests also pass with NUMBA_DISABLE_JIT=1 (plain-Python kernels)."""
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "not without_jit and not 1024",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_a_zero_probability_is_never_kept_even_with_a_uniform_of_zero():
    """Candidate i is kept when ``uniforms[i] < P`` (strictly): a uniform of 0.0, which the
    generator can draw, keeps every P > 0 and never a P = 0 (a loss above the trim's cut, a
    stored loss that was not finite), which would train with weight 1 / 0."""
    w = LossWindow(4)
    p, positions, weights, _ = w.push_rank_and_draw(
        np.array([4.0, 3.0, 2.0, 1.0]), np.zeros(4), beta=1.0, reweight=True, cut=0.5
    )
    np.testing.assert_allclose(p, [0.0, 1.0, 2 / 3, 0.5])
    assert positions.tolist() == [1, 2, 3]
    np.testing.assert_allclose(weights, [1.0, 1.5, 2.0])

    w = LossWindow(4)
    w.push(np.array([1.0, 3.0]))
    columns = (
        np.array([np.nan, 2.0], np.float32),  # index 0 was scored non-finite
        np.array([1, 1], np.int32),
        np.zeros(2, np.int32),
    )
    p, positions, _, _ = w.rank_and_draw_stored(
        columns, np.array([0, 1]), np.zeros(2), beta=1.0, reweight=False
    )
    np.testing.assert_allclose(p, [0.0, 2 / 3])
    assert positions.tolist() == [1]
    assert columns[2].tolist() == [0, 1]


def test_refill_replaces_what_the_window_held():
    """refill (a stale epoch's window from the store, a loaded state) empties the window
    first: it then holds exactly the refill's last ``size`` losses, in order, however full it
    was."""
    w = LossWindow(4)
    w.push(np.array([9.0, 1.0, 7.0]))
    w.refill(np.array([5.0, np.nan, 3.0]))
    assert w.values().tolist() == [5.0, 3.0] and w.sorted_values().tolist() == [3.0, 5.0]
    w.refill(np.arange(6.0))
    assert w.values().tolist() == [2.0, 3.0, 4.0, 5.0]
    np.testing.assert_array_equal(w.rank(np.array([3.5]), 1.0), [0.6])


def test_a_frozen_window_refuses_every_push_and_still_ranks_and_refills():
    """A stale epoch freezes the window that prefilter reads on the prefetch thread (Policy's
    threading contract): every way of adding losses, a whole decision's included, raises and
    leaves it as it was, while ranking against it, and refill (begin_epoch's, on the caller's
    thread), still work."""
    w = LossWindow(4)
    w.push(np.array([1.0, 2.0]))
    w.frozen = True
    pushes = [
        lambda: w.push(np.array([3.0])),
        lambda: w.push_and_rank(np.array([3.0]), beta=1.0),
        lambda: w.push_rank_and_draw(np.array([3.0]), np.array([0.5]), beta=1.0, reweight=False),
    ]
    for push in pushes:
        with pytest.raises(RuntimeError, match="the loss window is frozen"):
            push()
    assert w.values().tolist() == [1.0, 2.0]
    np.testing.assert_allclose(w.rank(np.array([1.5]), 1.0), [2 / 3])  # (as if added)
    w.refill(np.array([5.0]))
    assert w.values().tolist() == [5.0] and w.frozen
