"""``SelectiveBackprop(trim_top=q)``: the losses above the window's 1 - q quantile are never
kept, the others with ``P = (CDF / (1 - q)) ** beta_q`` at the same expected kept fraction; on
every path that decides from losses (fresh, stored, the device window, blended with the ramp),
bit for bit the paper's P at q = 0, and refused where it cannot keep its selectivity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import EncodedDataset, IndexLoss
from torch.utils.data import DataLoader

from sbloader import LossWindow, Phased, RandomBackprop, SelectiveBackprop, SelectiveLoader
from sbloader import _kernels as K
from sbloader.device_decisions import DeviceWindow

N = 600


def test_cut_power_is_zero_above_the_cut_and_a_rescaled_power_below():
    assert K.cut_power(0.5, 2.0, 1.0) == 0.25
    assert K.cut_power(0.45, 2.0, 0.9) == pytest.approx(0.25, abs=1e-15)
    assert K.cut_power(0.9, 1.7, 0.9) == 1.0  # the cut itself is kept for sure
    assert K.cut_power(0.9001, 1.7, 0.9) == 0.0
    assert K.cut_power(1.0, 0.0, 1.0) == 1.0


@pytest.mark.parametrize("s", [0.25, 1 / 3, 0.5])
@pytest.mark.parametrize("q", [0.0, 0.05, 0.1, 0.3])
def test_the_top_q_is_never_kept_and_the_kept_fraction_is_unchanged(s, q):
    """Over a grid of selectivities and trims: with the window full, P is 0 exactly where the
    CDF is above 1 - q, is (CDF / (1 - q)) ** beta_q below, and the mean P is s."""
    losses = np.random.default_rng(4).lognormal(size=40000)
    p = SelectiveBackprop(s, history=1024, trim_top=q)
    c = p.choose(losses, None, np.random.default_rng(0), len(losses))
    # The CDF each loss had, from the same window without trimming (beta = 1: P is the CDF).
    cdf = LossWindow(1024).push_and_rank(losses, 1.0)
    beta_q = (1 - q) * (1 / s) - 1
    expected = np.where(cdf > 1 - q, 0.0, (cdf / (1 - q)) ** beta_q)
    np.testing.assert_allclose(c.probabilities, expected, rtol=1e-12, atol=0)
    assert abs(c.probabilities[2000:].mean() - s) < 0.01
    assert abs(len(c.positions) / len(losses) - s) < 0.015
    kept_cdf = cdf[c.positions]
    assert kept_cdf.max() <= 1 - q
    if q:
        assert (cdf > 1 - q).sum() > 0.9 * q * len(losses)  # there was a top to leave out


def test_no_trim_is_bit_for_bit_the_papers_p_on_every_host_path():
    rng = np.random.default_rng(9)
    losses = rng.exponential(size=3000)
    u = rng.random(3000)
    a, b = LossWindow(256), LossWindow(256)
    np.testing.assert_array_equal(
        a.push_and_rank(losses[:1000], 2.0), b.push_and_rank(losses[:1000], 2.0, cut=1.0)
    )
    pa = a.push_rank_and_draw(losses[1000:], u[1000:], 2.0, False)
    pb = b.push_rank_and_draw(losses[1000:], u[1000:], 2.0, False, cut=1.0)
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.rank(losses[:50], 2.0), b.rank(losses[:50], 2.0, cut=1.0))
    plain = SelectiveBackprop(1 / 3, history=256)
    zero = SelectiveBackprop(1 / 3, history=256, trim_top=0.0)
    c0 = plain.choose(losses, None, np.random.default_rng(1), 3000)
    c1 = zero.choose(losses, None, np.random.default_rng(1), 3000)
    np.testing.assert_array_equal(c0.probabilities, c1.probabilities)
    np.testing.assert_array_equal(c0.positions, c1.positions)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_the_ramp_blends_with_the_trimmed_p_at_the_same_rate(share):
    losses = np.random.default_rng(3).exponential(size=30000)
    ramped = SelectiveBackprop(1 / 3, history=512, ramp_epochs=1, trim_top=0.1)
    ramped.advance(1.0 - share)
    trimmed = SelectiveBackprop(1 / 3, history=512, trim_top=0.1)
    c = ramped.choose(losses, None, np.random.default_rng(5), len(losses))
    ref = trimmed.choose(losses, None, np.random.default_rng(5), len(losses))
    expected = share / 3 + (1 - share) * ref.probabilities
    np.testing.assert_allclose(c.probabilities, expected, rtol=0, atol=1e-15)
    assert abs(c.probabilities[1000:].mean() - 1 / 3) < 0.01


def test_device_window_trims_as_the_host_window():
    rng = np.random.default_rng(7)
    host, dev = LossWindow(128), DeviceWindow(128)
    cut_off = 0
    for n, share in ((400, 0.0), (300, 0.4), (7, 0.0)):
        losses, u = rng.exponential(size=n), rng.random(n)
        p, pos, w, _ = host.push_rank_and_draw(losses, u, 1.7, True, uniform_share=share, cut=0.9)
        c = dev.push_rank_and_draw(
            torch.from_numpy(losses),
            torch.from_numpy(u),
            1.7,
            reweight=True,
            uniform_share=share,
            cut=0.9,
        )
        np.testing.assert_allclose(c.probabilities.numpy(), p, rtol=1e-15)
        np.testing.assert_array_equal(c.positions.numpy(), pos)
        np.testing.assert_allclose(c.weights.numpy(), w, rtol=1e-15)
        cut_off += int((p == 0).sum())
    assert cut_off > 20  # losses above the cut were met, and left out on both


def test_the_policys_device_decisions_are_its_host_decisions():
    losses = torch.from_numpy(np.random.default_rng(2).exponential(size=2000))
    host = SelectiveBackprop(1 / 3, history=256, trim_top=0.2)
    dev = SelectiveBackprop(1 / 3, history=256, trim_top=0.2)
    g = torch.Generator().manual_seed(0)
    d = dev.choose_device(losses, g, "skip")
    u = torch.rand(2000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = host.window.push_rank_and_draw(losses.numpy(), u.numpy(), host._cut_beta, False, cut=0.8)
    np.testing.assert_allclose(d.probabilities.numpy(), h[0], rtol=1e-15)
    np.testing.assert_array_equal(d.positions.numpy(), h[1])


def test_bad_trims_are_refused_naming_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match="trim_top"):
        SelectiveBackprop(1 / 3, trim_top=-0.1)
    with pytest.raises(ValueError, match=r"trim_top should be at most 1 - selectivity = 0\.5"):
        SelectiveBackprop(0.5, trim_top=0.6)
    with pytest.raises(ValueError, match="trim_top should be at most"):
        SelectiveBackprop(1.0, trim_top=0.1)  # keeping everything leaves nothing to trim
    with pytest.raises(TypeError, match="trim_top"):
        SelectiveBackprop(1 / 3, trim_top="top")  # type: ignore[arg-type]
    assert SelectiveBackprop(0.25, trim_top=0.75)._cut_beta == 0.0  # keep all below the cut
    # trim_top = 1 - selectivity as typed (1e-16 off in float): accepted, exponent exactly 0
    for s in (0.1, 0.2, 0.3, 0.7, 0.8, 0.9):
        assert SelectiveBackprop(s, trim_top=float(f"{1 - s:.10g}"))._cut_beta == 0.0, s


# ---------------------------------------------------------------------- through the loader
def loader_for(policy, shuffle=True, **kw):
    dl = DataLoader(
        EncodedDataset(N),
        batch_size=60,
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(0),
    )
    kw.setdefault("autocast", None)  # float32 losses: no ties from bf16 rounding
    return SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=20, seed=1, **kw)


def kept_indices(loader):
    return torch.cat([torch.zeros(0, dtype=torch.long)] + [b.indices for b in loader]).numpy()


def test_the_loader_never_keeps_the_highest_losses_once_the_window_holds_them():
    """IndexLoss: loss grows with the index, the same every epoch. In the same order every epoch
    with a window of N, the second epoch ranks each example against all N losses, so index i
    has CDF (i + 1) / N: trimming 10% leaves out exactly the indices 540 and above (the
    'mislabelled'), which plain SB keeps the most. (In the first epoch each loss is a new
    maximum: trimmed SB keeps none, plain SB all.)"""
    trimmed = loader_for(SelectiveBackprop(1 / 3, history=N, trim_top=0.1), shuffle=False)
    plain = loader_for(SelectiveBackprop(1 / 3, history=N), shuffle=False)
    assert len(kept_indices(trimmed)) == 0 and len(kept_indices(plain)) == N
    t, p = kept_indices(trimmed), kept_indices(plain)
    assert not (t >= 540).any()
    assert (t >= 530).any()  # just below the cut, P is near 1
    assert (p >= 540).mean() > 0.12  # plain SB: the top tenth is over-represented
    assert abs(len(t) / N - 1 / 3) < 0.08 and abs(len(p) / N - 1 / 3) < 0.08
    # Below the cut the trimmed policy still prefers the higher losses.
    assert np.median(t) > N / 2


def test_stale_epochs_trim_by_stored_loss_and_keep_the_never_scored():
    """Stale-SB: epoch 0 scores every example; epoch 1 decides from stored losses ranked
    against the window of epoch 0's N losses, (i + 2) / (N + 1) for index i, each cut by its
    rank within that window, (i + 1) / N: index 539, the 0.9 quantile, is kept (P = 1), as a
    fresh pass keeps it; indices 540 and above are above the cut and never kept."""
    policy = SelectiveBackprop(1 / 3, history=N, staleness=3, trim_top=0.1)
    loader = loader_for(policy)
    kept_indices(loader)
    assert not policy.needs_losses(1)
    stale = kept_indices(loader)
    assert not (stale >= 540).any() and len(stale) > N / 5
    cdf = (np.arange(N) + 2) / (N + 1)
    beta_q = 0.9 * 3 - 1
    expected = np.where((np.arange(N) + 1) / N > 0.9, 0.0, np.minimum(1, (cdf / 0.9) ** beta_q))
    np.testing.assert_allclose(policy.stale_probabilities(np.arange(N)), expected, rtol=1e-12)
    assert expected[538] > 0.99 and expected[539] == 1.0 and expected[540] == 0.0
    # The same decisions where the loader cannot prefilter (the kernel of a stale choose).
    c = policy.choose(None, np.arange(N), np.random.default_rng(0), N)
    np.testing.assert_allclose(c.probabilities, expected, rtol=1e-12)
    assert not (c.positions >= 540).any() and abs(len(c.positions) / N - 1 / 3) < 0.08
    # An example never scored is kept for sure, trimmed or not.
    fresh = SelectiveBackprop(1 / 3, history=N, staleness=3, trim_top=0.1)
    fresh.attach(N, 0)
    fresh.begin_epoch(0)
    fresh.choose(np.linspace(0, 1, 10), np.arange(10), np.random.default_rng(0), 10)
    fresh.begin_epoch(1)
    assert fresh.stale_probabilities(np.array([3, 500]))[1] == 1.0


@pytest.mark.parametrize(
    "history, q", [(8, 0.25), (1024, 0.25), (1024, 0.5), (1024, 0.125), (1000, 0.1), (999, 0.1)]
)
def test_a_stale_epoch_trims_the_losses_a_fresh_pass_trims_and_no_more(history, q):
    """The stored losses of the window's own examples, ranked in a stale epoch, are trimmed
    exactly where the pass that stored them trimmed them: the top q of the window, the loss at
    the 1 - q quantile kept. Ranked as if added to a window holding them already, that
    quantile's loss was trimmed too wherever q * history is whole (257 of 1024 at q = 0.25),
    although the pass had kept it for sure."""
    sb = SelectiveBackprop(1 / 3, history=history, staleness=2, trim_top=q, drift_bound=None)
    sb.attach(history, 0)
    sb.begin_epoch(0)
    losses = np.random.default_rng(history).permutation(np.arange(1.0, history + 1))
    sb.choose(losses, np.arange(history), np.random.default_rng(0), history)
    sb.begin_epoch(1)
    stale = sb.stale_probabilities(np.arange(history))
    ranks = losses.astype(int)
    top = ranks / history > 1 - q + 1e-12
    assert (stale == 0).sum() == top.sum() == history - round(history * (1 - q) + 1e-9)
    np.testing.assert_array_equal(stale == 0, top)
    cut_member = ranks == round(history * (1 - q))
    if cut_member.any():
        assert stale[cut_member][0] == 1.0
    assert (stale[~top] > 0).all()


def test_the_default_policy_takes_the_trim_and_a_state_from_another_trim_is_refused():
    from sbloader import default_policy

    p = default_policy(trim_top=0.1)
    assert isinstance(p, Phased) and p.policy.trim_top == 0.1
    assert "trim_top=0.1" in repr(p) and "trim_top=0.1" in p.kind()
    assert default_policy(has_store=False, trim_top=0.1).policy.trim_top == 0.1
    a = loader_for(
        Phased(
            SelectiveBackprop(1 / 3, trim_top=0.1),
            warmup_epochs=1,
            warmup_policy=RandomBackprop(1 / 3),
        )
    )
    kept_indices(a)
    b = loader_for(
        Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, warmup_policy=RandomBackprop(1 / 3))
    )
    with pytest.raises(ValueError, match="trim_top"):
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("q", [0.07, 0.1, 0.32, 0.33])
def test_the_loss_at_exactly_the_cut_quantile_is_kept_and_only_the_top_q_trimmed(q):
    """1 - q is rounded in float (1 - 0.07 = 0.92999...): the loss whose CDF is exactly the
    cut (93/100 in a window of 100) is still kept for sure, and exactly q of the window's CDF
    values are trimmed, on the host kernels and on the device window alike."""
    import copy

    base = SelectiveBackprop(1 / 3, history=100, trim_top=q)
    base.probabilities(np.arange(1.0, 101.0))  # the window: losses 1..100
    # each probe evicts loss 1 and enters at CDF j / 100
    ps = np.array(
        [copy.deepcopy(base).probabilities(np.array([j + 0.5]))[0] for j in range(1, 101)]
    )
    k = round(100 * (1 - q))
    assert ps[k - 1] == 1.0 and (ps[:k] > 0).all()
    assert (ps == 0).sum() == 100 - k
    assert K.cut_power(k / 100, 1.7, 1 - q) == 1.0
    # the device window: the same window, the same probe CDFs
    dev = DeviceWindow(100)
    dev.push_rank_and_draw(
        torch.arange(1.0, 101.0, dtype=torch.float64), torch.ones(100, dtype=torch.float64), 1.0
    )
    for j in (k - 1, k, k + 1):
        probe = copy.deepcopy(dev)
        c = probe.push_rank_and_draw(
            torch.tensor([j + 0.5], dtype=torch.float64),
            torch.zeros(1, dtype=torch.float64),
            base._cut_beta,
            cut=base._cut,
        )
        assert float(c.probabilities[0]) == ps[j - 1]


@pytest.mark.parametrize("history, q", [(1, 0.1), (2, 0.1), (9, 0.1), (19, 0.05), (3, 0.3)])
def test_a_trim_finer_than_the_windows_steps_is_refused_naming_history(history, q):
    """The window's highest loss alone is 1 / history of its CDF: a trim_top below that would
    trim more than q (history=1: everything, a loader that silently yields nothing)."""
    with pytest.raises(ValueError, match=rf"trim_top={q} needs history >= .*history={history}"):
        SelectiveBackprop(1 / 3, history=history, trim_top=q)
    # the smallest window that can hold the trim is accepted, and keeps about the selectivity
    SelectiveBackprop(1 / 3, history=10, trim_top=0.1)
    SelectiveBackprop(1 / 3, history=4, trim_top=0.25)


def test_a_subnormal_trim_is_refused_naming_history_not_overflowing():
    """1 / trim_top overflows to inf for a subnormal trim_top: the refusal said OverflowError
    ("cannot convert float infinity to integer"), naming nothing."""
    with pytest.raises(ValueError, match=r"trim_top=1e-320 needs history >= 1 / trim_top = inf"):
        SelectiveBackprop(1 / 3, trim_top=1e-320)


@pytest.mark.parametrize("n", [8, 200])  # (fewer than 32 losses and more: both kernel paths)
def test_tied_losses_at_the_cut_are_kept_not_all_trimmed(n):
    """A group of equal losses that reaches down to the 1 - q quantile is at the quantile, not
    above it: kept (P = 1), as plain SB keeps all-equal losses. Trimmed by their CDF (that of
    the group's highest rank), all-equal losses (fp16 losses underflowing to 0, a clipped loss)
    got P = 0: a loader that kept nothing, on every path."""
    zeros = np.zeros(n)
    sb = SelectiveBackprop(1 / 3, history=64, trim_top=0.1)
    p = sb.probabilities(zeros)
    assert (p[1:] == 1.0).all()  # (the first loss ever is the whole window: its top step)
    c = SelectiveBackprop(1 / 3, history=64, trim_top=0.1).choose(
        zeros, None, np.random.default_rng(0), n
    )
    assert len(c.positions) >= n - 1
    # stored losses ranked against the window (stale epochs), and the device window
    assert (sb.window.rank(zeros, sb._cut_beta, sb._cut) == 1.0).all()
    dev = DeviceWindow(64)
    c = dev.push_rank_and_draw(
        torch.zeros(n, dtype=torch.float64),
        torch.full((n,), 0.5, dtype=torch.float64),
        sb._cut_beta,
        cut=sb._cut,
    )
    np.testing.assert_array_equal(c.probabilities.numpy(), p)
    # a group of 60% at the top reaches below the cut: kept for sure, the rest ranked below it
    losses = np.where(np.random.default_rng(1).random(n) < 0.6, 1.0, 0.5)
    p = SelectiveBackprop(1 / 3, history=64, trim_top=0.1).probabilities(losses)
    assert (p[losses == 1.0][1:] == 1.0).all()
    # a group wholly above the cut is still trimmed: 5 equal top losses of 100, q = 0.1
    sb = SelectiveBackprop(1 / 3, history=100, trim_top=0.1)
    sb.probabilities(np.arange(95.0))
    assert (sb.probabilities(np.full(5, 99.0)) == 0.0).all()
