"""``SelectiveBackprop(stale_cdf="store")``: a stale epoch ranks each stored loss against the
stored losses as they are when it begins (a sample spread evenly over the dataset), not against
the window the last selection pass left, so fed (falling) losses keep the kept fraction at the
selectivity; the refill happens once per epoch, is the same on every rank, and resumes exactly."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from conftest import EncodedDataset, IndexLoss
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sbloader import ExampleStore, SelectiveBackprop, SelectiveLoader, default_policy

N = 3000


def fed_policy(stale_cdf: str, history: int = 256) -> tuple[SelectiveBackprop, np.ndarray]:
    """Stale-SB (n = 3) after a fresh epoch 0 that saw losses in [1, 2), then fed training
    losses ten times lower for every example, as a training step reports them."""
    p = SelectiveBackprop(1 / 3, history=history, staleness=3, stale_cdf=stale_cdf)
    p.attach(N, key=7)
    idx = np.random.default_rng(0).permutation(N)
    rng = np.random.default_rng(1)
    p.begin_epoch(0)
    p.choose(1.0 + rng.random(N), idx, np.random.default_rng(2), N)
    p.feedback(idx, 0.1 * (1.0 + rng.random(N)), 0)
    p.begin_epoch(1)
    return p, idx


def test_the_spread_sample_is_evenly_spaced_skips_never_scored_and_is_deterministic():
    s = ExampleStore(100)
    s.record(np.arange(100), np.arange(100.0) / 10, epoch=0)
    sample = s.spread_sample(10)
    np.testing.assert_array_equal(sample, ((np.arange(10) * 10 + 5) / 10).astype(np.float32))
    np.testing.assert_array_equal(s.spread_sample(10), sample)
    fresh = ExampleStore(100)
    fresh.record(np.arange(50), np.arange(50.0), epoch=0)  # indices 50 to 99 never scored
    # (spread over the 50 scored examples: 2, 7, ..., 47, not 5, 15, ..., 45 over all 100)
    np.testing.assert_array_equal(fresh.spread_sample(10), np.arange(10) * 5 + 2)
    everything = (np.arange(100.0) / 10).astype(np.float32)  # the store holds float32
    np.testing.assert_array_equal(s.spread_sample(500), everything)
    assert len(ExampleStore(10).spread_sample(4)) == 0
    with pytest.raises(ValueError, match="count"):
        s.spread_sample(0)


def test_fed_falling_losses_keep_the_selectivity_only_against_the_store():
    """Against the window of epoch 0 every fed loss is below every window loss: P is the lowest
    rank's, about 0, and a stale epoch keeps almost nothing. Against the store it keeps a third,
    the highest losses most."""
    kept = {}
    for cdf in ("window", "store"):
        p, idx = fed_policy(cdf)
        c = p.choose(None, idx, np.random.default_rng(3), N)
        kept[cdf] = c
    assert len(kept["window"].positions) < 0.01 * N
    c = kept["store"]
    assert abs(len(c.positions) / N - 1 / 3) < 0.03
    assert abs(c.probabilities.mean() - 1 / 3) < 0.02
    stored, _ = fed_policy("store")[0].store.lookup(idx)  # type: ignore[union-attr]
    order = np.argsort(stored)
    assert c.probabilities[order[-300:]].mean() > 0.8 > 0.02 > c.probabilities[order[:300]].mean()


def test_the_window_holds_the_stored_sample_while_the_stale_epoch_lasts():
    p, idx = fed_policy("store", history=200)
    assert p.store is not None
    np.testing.assert_array_equal(p.window.values(), p.store.spread_sample(200))
    before = p.window.values()
    p.feedback(idx[:100], np.full(100, 50.0), 1)  # this epoch's reports: not until the next
    p.begin_epoch(1)  # the epoch already begun: no second refill
    p.choose(None, idx, np.random.default_rng(3), N)
    np.testing.assert_array_equal(p.window.values(), before)
    p.begin_epoch(2)  # the next stale epoch ranks against the store as it is now
    np.testing.assert_array_equal(p.window.values(), p.store.spread_sample(200))
    assert p.window.values().max() == 50.0


def test_fresh_epochs_are_unchanged_by_the_option():
    """Epochs with a selection pass push and rank as always: the same choices either way."""
    a = SelectiveBackprop(1 / 3, history=128, staleness=3, stale_cdf="store")
    b = SelectiveBackprop(1 / 3, history=128, staleness=3)
    losses = np.random.default_rng(4).exponential(size=N)
    idx = np.arange(N)
    for p in (a, b):
        p.attach(N, key=1)
        p.begin_epoch(0)
    ca = a.choose(losses, idx, np.random.default_rng(9), N)
    cb = b.choose(losses, idx, np.random.default_rng(9), N)
    np.testing.assert_array_equal(ca.positions, cb.positions)
    np.testing.assert_array_equal(ca.probabilities, cb.probabilities)


def test_bad_stale_cdf_is_refused_naming_the_parameter():
    with pytest.raises(ValueError, match=r"stale_cdf should be one of \['window', 'store'\]"):
        SelectiveBackprop(1 / 3, staleness=3, stale_cdf="global")
    with pytest.raises(ValueError, match="staleness=1 has no stale epochs; give staleness > 1"):
        SelectiveBackprop(1 / 3, stale_cdf="store")  # would silently do nothing
    assert "stale_cdf='store'" in repr(default_policy(stale_cdf="store"))
    assert default_policy(has_store=False, stale_cdf="store").policy.staleness == 1


class LossIsInput(nn.Module):
    """A model whose output is its input: each example's selection loss is its input value."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))  # (a parameter, so the model has a device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_stale_epoch_over_a_subset_ranks_against_a_full_sample_of_the_subset():
    """A ``subset`` leaves the other examples never scored. The sample was spread over all
    indices, so it held only the subset's share of ``history`` losses, and none where its
    stride met only examples outside the subset (here: the odd indices of 4096, the sample
    at indices 2, 6, 10, ...): the window was empty, P was 1, and a stale epoch kept
    everything. Spread over the scored examples it holds ``history`` losses, and a stale
    epoch keeps the selectivity."""
    n, history, s = 4096, 1024, 1 / 3
    losses = np.random.default_rng(0).exponential(size=n).astype(np.float32)
    data = TensorDataset(torch.from_numpy(losses).reshape(-1, 1), torch.zeros(n, dtype=torch.long))
    dl = DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    subset = np.arange(1, n, 2)
    policy = SelectiveBackprop(s, history=history, staleness=3, stale_cdf="store")
    loader = SelectiveLoader(
        dl,
        LossIsInput(),
        loss_fn=lambda out, y: out.reshape(-1),
        policy=policy,
        subset=subset,
        remainder="short",
        autocast=None,
    )
    kept = [sum(len(b.indices) for b in loader) / len(subset) for _ in range(3)]
    # The draws' binomial spread plus the window's: its empirical CDF is off by at most about
    # 1 / (2 sqrt(R)) at any loss, which moves the kept share by at most as much.
    tolerance = 4 * np.sqrt(s * (1 - s) / len(subset) + 1 / (4 * history))
    for rate in kept:  # epoch 0 fresh, 1 and 2 stale
        assert abs(rate - s) < tolerance, kept
    assert len(policy.window) == history


# ---------------------------------------------------------------------- through the loader
def loader_for(stale_cdf: str, seed: int = 0) -> SelectiveLoader:
    dl = DataLoader(
        EncodedDataset(600), batch_size=60, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    policy = SelectiveBackprop(1 / 3, history=120, staleness=4, stale_cdf=stale_cdf)
    return SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=20, seed=seed)


def report(loader: SelectiveLoader, batch, scale: float) -> None:
    """The training step's report: IndexLoss's own losses times ``scale``."""
    x, y = batch
    losses = torch.nn.functional.cross_entropy(IndexLoss()(x), y, reduction="none")
    loader.feedback(batch.indices, scale * losses)


def run_epoch(loader: SelectiveLoader, scale: float) -> list[list[float]]:
    """An epoch whose training step reports losses that fall with ``scale``."""
    out = []
    for b in loader:
        report(loader, b, scale)
        out.append(b.indices.tolist() + b.probabilities.tolist())
    return out


def test_through_the_loader_the_stale_kept_fraction_holds_and_resume_is_exact():
    scales = [1.0, 0.3, 0.1, 0.03]

    def stale_rates(cdf):
        loader = loader_for(cdf)
        for s in scales:
            run_epoch(loader, s)
        return [e.examples_yielded / 600 for e in loader.stats.epochs[1:]]

    # Reports fall every epoch: ranked against epoch 0's window ever fewer are kept.
    window, store = stale_rates("window"), stale_rates("store")
    assert window[0] > window[-1] and window[-1] < 0.25
    assert all(0.3 < r < 0.37 for r in store)

    whole = loader_for("store", seed=5)
    expected = [run_epoch(whole, s) for s in scales]
    first = loader_for("store", seed=5)
    got = [run_epoch(first, s) for s in scales[:2]]
    it = iter(first)
    part = []
    for _ in range(3):
        b = next(it)
        report(first, b, scales[2])
        part.append(b.indices.tolist() + b.probabilities.tolist())
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = loader_for("store", seed=5)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    got.append(part + run_epoch(resumed, scales[2]))
    got.append(run_epoch(resumed, scales[3]))
    assert got == expected


def test_a_state_saved_with_the_other_stale_cdf_is_refused():
    a = loader_for("store")
    run_epoch(a, 1.0)
    b = loader_for("window")
    with pytest.raises(ValueError, match="stale_cdf"):
        b.load_state_dict(a.state_dict())


def test_without_feedback_a_fresh_epoch_whose_losses_fall_keeps_the_rate_against_the_store():
    """No reports: a fresh epoch's losses fall as the model trains through it, so its last R
    losses (the window) sit below most stored ones and a stale epoch keeps more than the
    selectivity against the window; against the store it keeps the selectivity."""
    rates = {}
    for cdf in ("window", "store"):
        p = SelectiveBackprop(1 / 3, history=256, staleness=3, stale_cdf=cdf)
        p.attach(N, key=3)
        idx = np.random.default_rng(0).permutation(N)
        falling = np.linspace(2.0, 0.5, N) * np.random.default_rng(1).lognormal(0, 0.3, N)
        p.begin_epoch(0)
        for part in np.array_split(np.arange(N), 12):  # source batches in order
            p.choose(falling[part], idx[part], np.random.default_rng(2), len(part))
        p.begin_epoch(1)
        c = p.choose(None, idx, np.random.default_rng(3), N)
        rates[cdf] = len(c.positions) / N
    assert rates["window"] > 0.6
    assert abs(rates["store"] - 1 / 3) < 0.03
