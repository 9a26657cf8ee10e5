"""``SelectiveBackprop(ramp_epochs=r)``: over the first r epochs of data, SB's P is blended with
uniform keeping at the same rate, the uniform share falling linearly with the loader's position;
the blend is exact, keeps the expected rate, ends where it should, resumes exactly, and the
device path blends as the host path does."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from conftest import EncodedDataset, IndexLoss
from torch.utils.data import DataLoader

from sbloader import (
    LossWindow,
    Phased,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
    default_policy,
)
from sbloader.device_decisions import DeviceWindow

N = 600


def test_the_uniform_share_falls_linearly_with_the_position_and_stays_at_zero():
    p = SelectiveBackprop(1 / 3, ramp_epochs=2)
    assert p.uniform_share == 1.0  # before any position: all uniform
    shares = []
    for position in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 7.25):
        p.advance(position)
        shares.append(p.uniform_share)
    assert shares == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    plain = SelectiveBackprop(1 / 3)
    plain.advance(0.0)
    assert plain.uniform_share == 0.0  # no ramp: SB from the first batch


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("beta", [1.0, 2.0, 4.0])
def test_p_is_the_blend_of_uniform_and_sbs_p_and_draws_use_it(share, beta):
    """Same losses into a ramped and a plain policy: the ramped P is exactly
    u / (beta + 1) + (1 - u) * the plain P, and a candidate is kept exactly when its uniform
    (the same stream in both) is below the blended P."""
    losses = np.random.default_rng(3).exponential(size=2000)
    ramped = SelectiveBackprop(beta=beta, history=256, ramp_epochs=1)
    ramped.advance(1.0 - share)
    assert ramped.uniform_share == pytest.approx(share)
    plain = SelectiveBackprop(beta=beta, history=256)
    c = ramped.choose(losses, None, np.random.default_rng(5), len(losses))
    ref = plain.choose(losses, None, np.random.default_rng(5), len(losses))
    u = ramped.uniform_share
    expected = u / (beta + 1) + (1 - u) * ref.probabilities
    np.testing.assert_allclose(c.probabilities, expected, rtol=0, atol=1e-15)
    uniforms = np.random.default_rng(5).random(len(losses))
    np.testing.assert_array_equal(c.positions, np.flatnonzero(uniforms < c.probabilities))
    if share == 0.0:  # the ramp over: bit for bit SB's own choice
        np.testing.assert_array_equal(c.probabilities, ref.probabilities)
        np.testing.assert_array_equal(c.positions, ref.positions)
    if share == 1.0:  # all uniform: every candidate at the policy's rate, whatever its loss
        assert np.all(c.probabilities == 1 / (beta + 1))


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_the_expected_kept_fraction_is_the_same_at_every_share(share):
    losses = np.random.default_rng(11).lognormal(size=30000)
    p = SelectiveBackprop(1 / 3, history=1024, ramp_epochs=1)
    p.advance(1.0 - share)
    c = p.choose(losses, None, np.random.default_rng(0), len(losses))
    assert abs(c.probabilities[2000:].mean() - 1 / 3) < 0.01
    assert abs(len(c.positions) / len(losses) - 1 / 3) < 0.015


def test_while_ramping_high_losses_are_still_kept_more_often():
    """The blend ranks as SB does: halfway through the ramp the highest tenth of the losses is
    kept with P near 1/6 + 1/2, the lowest tenth near 1/6."""
    losses = np.random.default_rng(2).permutation(np.linspace(0.0, 5.0, 5000))
    p = SelectiveBackprop(1 / 3, history=500, ramp_epochs=1)
    p.advance(0.5)
    c = p.choose(losses, None, np.random.default_rng(0), len(losses))
    order = np.argsort(losses[1000:]) + 1000  # once the window is full
    low, high = c.probabilities[order[:400]], c.probabilities[order[-400:]]
    assert low.mean() < 0.5 / 3 + 0.01 and high.mean() > 0.5 / 3 + 0.4
    assert high.min() > low.max()


def test_bad_ramps_are_refused_naming_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match="ramp_epochs"):
        SelectiveBackprop(1 / 3, ramp_epochs=-1)
    with pytest.raises(ValueError, match="ramp_epochs should be at most 1 with staleness=3"):
        SelectiveBackprop(1 / 3, staleness=3, ramp_epochs=2)
    with pytest.raises(TypeError, match="ramp_epochs"):
        SelectiveBackprop(1 / 3, ramp_epochs="one")  # type: ignore[arg-type]
    SelectiveBackprop(1 / 3, staleness=3, ramp_epochs=1)  # within Stale-SB's fresh epoch
    # default_policy names its own arguments (it said "use staleness=1", which it does not take)
    with pytest.raises(ValueError, match=r"default_policy's ramp_epochs .* has_store=False"):
        default_policy(ramp_epochs=1.5)
    assert default_policy(ramp_epochs=1).policy.ramp_epochs == 1  # the first epoch, as above
    assert default_policy(has_store=False, ramp_epochs=2).policy.ramp_epochs == 2


def test_device_window_blends_as_the_host_window():
    rng = np.random.default_rng(7)
    host, dev = LossWindow(128), DeviceWindow(128)
    for n in (50, 300, 7):
        losses, u = rng.exponential(size=n), rng.random(n)
        p, pos, _, _ = host.push_rank_and_draw(losses, u, 2.0, False, uniform_share=0.4)
        c = dev.push_rank_and_draw(
            torch.from_numpy(losses), torch.from_numpy(u), 2.0, uniform_share=0.4
        )
        np.testing.assert_allclose(c.probabilities.numpy(), p, rtol=1e-15)
        np.testing.assert_array_equal(c.positions.numpy(), pos)


# ---------------------------------------------------------------------- through the loader
class Recording(SelectiveBackprop):
    """SB that records the share of each decision it makes from selection losses."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.shares: list[float] = []

    def choose(self, losses, indices, rng, n):
        if losses is not None:
            self.shares.append(self.uniform_share)
        return super().choose(losses, indices, rng, n)


def loader_for(policy, seed=0, **kw):
    dl = DataLoader(
        EncodedDataset(N),
        batch_size=60,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    return SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=20, seed=seed, **kw)


def test_the_loader_ramps_by_position_from_the_end_of_the_warm_up():
    """One Random-Backprop epoch, then SB ramped over one epoch: its decisions see shares
    1 - (position in the active epoch, this source batch included), falling to 0 at its end
    and 0 from then on."""
    sb = Recording(1 / 3, ramp_epochs=1)
    loader = loader_for(Phased(sb, warmup_epochs=1, warmup_policy=RandomBackprop(1 / 3)))
    for _ in range(3):
        for _batch in loader:
            pass
    batches = N // 60
    assert len(sb.shares) == 2 * batches  # no selection pass in the warm-up
    first = np.array(sb.shares[:batches])
    np.testing.assert_allclose(first, 1.0 - np.arange(1, batches + 1) / batches, atol=1e-12)
    assert sb.shares[batches:] == [0.0] * batches


def test_the_ramp_changes_which_examples_are_kept_in_its_epoch_only():
    """With IndexLoss, SB keeps high indices; early in the ramp low indices are kept about as
    often as high ones, and after it SB's preference is back in full."""

    def kept_low_share(policy, epochs):
        loader = loader_for(policy)
        per_epoch = []
        for _ in range(epochs):
            idx = torch.cat([b.indices for b in loader])
            per_epoch.append(float((idx < N // 2).float().mean()))
        return per_epoch

    ramped = kept_low_share(SelectiveBackprop(1 / 3, history=120, ramp_epochs=1), 2)
    plain = kept_low_share(SelectiveBackprop(1 / 3, history=120), 2)
    assert ramped[0] > plain[0] + 0.1  # the ramp keeps more low-loss examples in its epoch
    assert ramped[1] == pytest.approx(plain[1], abs=0.08)  # and SB's preference after it


def test_resume_in_the_middle_of_the_ramp_is_exact():
    def make():
        return loader_for(
            Phased(
                SelectiveBackprop(1 / 3, history=120, ramp_epochs=1),
                warmup_epochs=1,
                warmup_policy=RandomBackprop(1 / 3),
            ),
            seed=3,
        )

    def epoch(loader):
        return [b.indices.tolist() + b.probabilities.tolist() for b in loader]

    whole = make()
    epoch(whole)
    expected = epoch(whole) + epoch(whole)

    first = make()
    epoch(first)
    it = iter(first)
    got = [next(it) for _ in range(4)]
    got = [b.indices.tolist() + b.probabilities.tolist() for b in got]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    got += epoch(resumed) + epoch(resumed)
    assert got == expected


def test_a_state_saved_with_another_ramp_is_refused():
    a = loader_for(SelectiveBackprop(1 / 3, ramp_epochs=1))
    for _batch in a:
        pass
    b = loader_for(SelectiveBackprop(1 / 3))
    with pytest.raises(ValueError, match="ramp_epochs"):
        b.load_state_dict(a.state_dict())
