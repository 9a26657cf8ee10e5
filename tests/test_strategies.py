"""The papers' strategies through SelectiveLoader: Stale-SB, Random-Backprop, Kath18, EL2N
pruning, Diet-SB and the beyond-paper options (warm-up, annealing, reweighting)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EncodedDataset, IndexLoss, expected_losses
from torch import nn
from torch.utils.data import DataLoader, Dataset

import sbloader
from sbloader import (
    ExampleStore,
    Kath18,
    Phased,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
    el2n_scores,
    prune,
)
from sbloader._random import hashed_uniforms


class CountingDataset(EncodedDataset):
    """Counts which indices were loaded."""

    def __init__(self, n=300):
        super().__init__(n)
        self.loaded: list[int] = []

    def __getitem__(self, i):
        self.loaded.append(int(i))
        return super().__getitem__(i)


def loader_for(policy, ds=None, *, bs=10, source_bs=30, workers=0, model=None, **kw):
    ds = ds if ds is not None else EncodedDataset(300)
    dl = DataLoader(
        ds,
        batch_size=source_bs,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    return SelectiveLoader(dl, model or IndexLoss(), policy=policy, batch_size=bs, seed=0, **kw)


# ------------------------------------------------------------------ Stale-SB
@pytest.mark.parametrize("workers", [0, 2])
def test_stale_sb_makes_no_selection_forward_in_stale_epochs(workers):
    model = IndexLoss()
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=3), model=model, workers=workers)
    calls = []
    for _ in range(6):
        before = model.calls
        list(loader)
        calls.append(model.calls - before)
    forwards = [e.selection_forwards for e in loader.stats.epochs]
    assert forwards == [300, 0, 0, 300, 0, 0]
    assert calls[1] == calls[2] == calls[4] == calls[5] == 0 and calls[0] == 10


@pytest.mark.parametrize("workers", [0, 2])
def test_stored_losses_stay_aligned_with_their_indices(workers):
    """The authors' Stale-SB paired losses with the wrong examples; ours are keyed by index."""
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=2), workers=workers)
    list(loader)
    store = loader.policy.store
    losses, epochs = store.lookup(np.arange(300))
    np.testing.assert_array_equal(losses, expected_losses(300))
    assert (epochs == 0).all()


def test_stale_epochs_decide_each_example_from_its_own_stored_loss():
    policy = SelectiveBackprop(1 / 3, staleness=3, history=1024)
    loader = loader_for(policy)
    list(loader)  # fresh epoch 0: every example scored and stored
    stored, _ = policy.store.lookup(np.arange(300))
    window = policy.window.sorted_values()
    before = policy.store.selected.copy()
    list(loader)  # stale epoch 1
    chosen = np.flatnonzero(policy.store.selected - before)
    # Recompute each example's decision from its own stored loss alone.
    p = ((np.searchsorted(window, stored, side="right") + 1) / (len(window) + 1)) ** policy.beta
    expected = np.flatnonzero(hashed_uniforms(policy._key, 1, np.arange(300)) < p)
    np.testing.assert_array_equal(chosen, expected)
    assert loader.stats.epochs[1].examples_selected == len(expected)
    # Swapping two examples' stored losses swaps exactly their probabilities.
    hi, lo = int(np.argmax(stored)), int(np.argmin(stored))
    policy.store.loss[[hi, lo]] = policy.store.loss[[lo, hi]]
    swapped = policy.stale_probabilities(np.array([hi, lo, 7]))
    assert swapped.tolist() == [p[lo], p[hi], p[7]] and p[hi] > 0.9 > 0.01 > p[lo]


def test_stale_epoch_does_not_load_rejected_examples():
    ds = CountingDataset(300)
    policy = SelectiveBackprop(1 / 3, staleness=2)
    loader = loader_for(policy, ds)
    list(loader)
    assert sorted(ds.loaded) == list(range(300))  # the fresh epoch loads everything
    ds.loaded.clear()
    yielded = [i for b in loader for i in b.indices.tolist()]
    e = loader.stats.epochs[1]
    assert len(ds.loaded) == e.examples_selected < 150  # only the kept ones were loaded
    assert e.examples_seen == 300 and e.prefiltered == 300 - len(ds.loaded)
    assert set(yielded) - set(ds.loaded) <= set(range(300))  # carried ones came from epoch 0


def test_never_scored_examples_are_selected_not_skipped():
    class NanFirst(IndexLoss):
        def forward(self, x):
            out = super().forward(x)
            out[x[:, 0] < 30] = float("nan")  # examples 0..29 never get a finite loss
            return out

    # Under nonfinite="select" the selection pass stores no loss for them (they are never
    # scored); under the default "skip" they are marked scored non-finite and stay skipped
    # (test_loader.py::test_stale_epochs_treat_a_nonfinite_loss_as_its_selection_pass_did).
    policy = SelectiveBackprop(0.2, staleness=2)
    loader = loader_for(policy, model=NanFirst(), remainder="short", nonfinite="select")
    list(loader)
    assert not policy.needs_losses(1)  # the next epoch is stale
    got = {i for b in loader for i in b.indices.tolist()}
    assert set(range(30)) <= got


@pytest.mark.parametrize("workers", [0, 2])
def test_stale_epochs_keep_an_example_kept_for_a_later_non_finite_loss(workers):
    """Under nonfinite="select" an example whose loss turns non-finite in a later selection pass
    is kept there, and in the stale epochs after it too (prefiltered at the source or chosen per
    batch): they decided from the finite loss stored by the pass before (a low one: never kept),
    where README says they keep it, as its pass did."""

    class NanLater(IndexLoss):
        nan = False

        def forward(self, x):
            out = super().forward(x)
            if self.nan:
                out[x[:, 0] < 30] = float("nan")  # examples 0..29, whose losses are the lowest
            return out

    model = NanLater()
    policy = SelectiveBackprop(1 / 3, staleness=2, drift_bound=None)
    loader = loader_for(policy, model=model, remainder="short", nonfinite="select", workers=workers)
    list(loader)  # epoch 0: a selection pass, every loss finite and stored
    list(loader)  # epoch 1: stale
    model.nan = True
    fresh = {i for b in loader for i in b.indices.tolist()}  # epoch 2: a pass, 0..29 non-finite
    assert set(range(30)) <= fresh
    assert not policy.needs_losses(3)
    stale = {i for b in loader for i in b.indices.tolist()}  # epoch 3: stale
    assert set(range(30)) <= stale
    assert (policy.stale_probabilities(np.arange(30)) == 1.0).all()
    assert (policy.store.lookup(np.arange(30))[1] == 2).all()  # scored in the pass of epoch 2


def test_a_stale_epoch_gives_an_example_skipped_as_non_finite_p_0_as_choose_does():
    """An example whose selection loss was not finite (marked by count_skipped, as
    nonfinite="skip" does) gets P = 0 in its stale epochs from stale_probabilities (the P that
    prefilter loads by) as from choose, not NaN: a P outside [0, 1]. A scored example gets its
    stored loss's rank, and one never scored P = 1."""
    policy = SelectiveBackprop(beta=1.0, history=16, staleness=2)
    policy.attach(6, key=0)
    policy.begin_epoch(0)
    rng = np.random.default_rng(0)
    policy.choose(np.array([1.0, 2.0, 3.0, 4.0]), np.arange(4), rng, 4)
    policy.count_skipped(np.array([4]))
    policy.begin_epoch(1)
    assert not policy.needs_losses(1)
    candidates = np.array([0, 3, 4, 5])
    p = policy.stale_probabilities(candidates)
    np.testing.assert_allclose(p, [2 / 5, 1.0, 0.0, 1.0])  # (rank of 1 among 1..4, as if added)
    np.testing.assert_array_equal(policy.choose(None, candidates, rng, 4).probabilities, p)


def test_nonfinite_select_counts_forced_examples_in_the_store():
    """With nonfinite="select" an example with a non-finite loss is backpropagated, so the
    store's selection count (ExampleStore.selected: times chosen for backprop) counts it; it
    used to count only the examples the policy chose among the finite ones."""

    class NanSome(IndexLoss):
        def forward(self, x):
            out = super().forward(x)
            out[x[:, 0] % 7 == 0] = float("nan")
            return out

    policy = SelectiveBackprop(0.2, staleness=2)
    loader = loader_for(policy, model=NanSome(), remainder="short", nonfinite="select")
    yielded = np.concatenate([b.indices.numpy() for b in loader])  # epoch 0: a selection pass
    assert policy.store is not None and loader.stats.current.nonfinite == 300 // 7 + 1
    assert set(range(0, 300, 7)) <= set(yielded.tolist())
    np.testing.assert_array_equal(policy.store.selected, np.bincount(yielded, minlength=300))


@pytest.mark.parametrize("stop", [0, 1, 3])
def test_stale_sb_resumes_exactly_mid_stale_epoch(stop):
    def build():
        return loader_for(SelectiveBackprop(1 / 3, staleness=3, history=64))

    full_loader = build()
    full = [b.indices.tolist() for _ in range(4) for b in full_loader]

    loader = build()
    got = [b.indices.tolist() for _ in range(1) for b in loader]  # fresh epoch 0
    it = iter(loader)  # stale epoch 1
    got += [next(it).indices.tolist() for _ in range(stop)]
    state = loader.state_dict()
    again = build()
    again.load_state_dict(state)
    got += [b.indices.tolist() for _ in range(3) for b in again]  # rest of 1, then 2 and 3
    assert got == full
    np.testing.assert_array_equal(again.policy.store.selected, full_loader.policy.store.selected)
    np.testing.assert_array_equal(again.policy.store.loss, full_loader.policy.store.loss)


def test_stale_sb_at_three_costs_a_third_of_sbs_selection_forwards():
    sb, stale = (
        loader_for(SelectiveBackprop(1 / 3)),
        loader_for(SelectiveBackprop(1 / 3, staleness=3)),
    )
    for _ in range(6):
        list(sb)
        list(stale)
    ratio = stale.stats.total.selection_forwards / sb.stats.total.selection_forwards
    assert ratio == pytest.approx(1 / 3)


def test_staleness_needs_the_dataset_size():
    batches = [(torch.zeros(4, 6), torch.zeros(4, dtype=torch.long), torch.arange(4))]
    with pytest.raises(ValueError, match="staleness"):
        SelectiveLoader(
            batches, IndexLoss(), policy=SelectiveBackprop(staleness=2), batch_size=2, index_key=2
        )
    with pytest.raises(ValueError, match="staleness should be >= 1"):
        SelectiveBackprop(staleness=0)


# ------------------------------------------------------------------ Random-Backprop
def test_random_backprop_never_calls_the_model_and_keeps_a_fraction():
    model = IndexLoss()
    loader = loader_for(RandomBackprop(0.25), EncodedDataset(4000), model=model, source_bs=100)
    for _ in range(2):
        list(loader)
    assert model.calls == 0 and loader.stats.total.selection_forwards == 0
    assert loader.stats.total.selection_rate == pytest.approx(0.25, abs=0.02)


# ------------------------------------------------------------------ Kath18
def test_kath18_stays_uniform_until_tau_crosses_the_threshold():
    rng = np.random.default_rng(0)
    k = Kath18(selectivity=1 / 3)
    flat = np.ones(90)  # equal losses: tau = 1 < tau_th = (90 + 90) / 90 = 2
    for _ in range(50):
        c = k.choose(flat, None, rng, 90)
        assert not k.importance_sampling
        assert len(c.positions) == 30 and len(set(c.positions.tolist())) == 30  # no replacement
        assert (c.weights == 1).all()
    skewed = np.r_[np.full(80, 0.01), np.full(10, 10.0)]
    for _ in range(60):
        c = k.choose(skewed, None, rng, 90)
    assert k.tau > k.threshold(90, 30) and k.importance_sampling
    # Now sampling is in proportion to loss: the 10 high-loss examples take ~99% of draws.
    counts = np.zeros(90)
    for _ in range(300):
        np.add.at(counts, k.choose(skewed, None, rng, 90).positions, 1)
    share = counts[80:].sum() / counts.sum()
    assert share == pytest.approx(100 / 100.8, abs=0.01)


def test_kath18_refuses_losses_of_another_length_or_not_finite_leaving_tau_as_it_was():
    """Called directly, Kath18.choose drew positions from losses of another length than the
    pool's (3 losses for n=5 chose positions 3 and 4) and drew a pool holding a NaN loss
    uniformly (its shares NaN), both unsaid; SelectiveBackprop refuses such calls."""
    k = Kath18(selectivity=0.5)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"one loss per candidate \(5\), but got shape \(3,\)"):
        k.choose(np.ones(3), None, rng, 5)
    with pytest.raises(ValueError, match=r"losses should be finite, but got 1 non-finite"):
        k.choose(np.array([1.0, np.nan, 2.0, 0.5]), None, rng, 4)
    assert k.tau == 0.0
    assert len(k.choose(np.array([1.0, 3.0, 2.0, 0.5]), None, rng, 4).positions) == 2


def test_kath18_decides_each_pool_from_the_earlier_pools_tau():
    """tau starts at 0, and a pool is importance-sampled only where the tau of the pools before
    it exceeds the threshold (as in the original): the first pool is drawn uniformly even at
    tau_threshold=0, and even where its own estimate crosses the threshold (one loss above 0
    among 400: sqrt(400) = 20, tau 0.1 * 20 = 2 after it); the next pool is importance-sampled,
    every draw the one example with a loss."""
    losses = np.zeros(400)
    losses[7] = 1.0
    rng = np.random.default_rng(0)
    for threshold in (0.0, 1.0):
        k = Kath18(selectivity=0.5, tau_threshold=threshold)
        first = k.choose(losses, None, rng, 400)
        assert not k.importance_sampling and k.tau == pytest.approx(2.0)
        assert len(np.unique(first.positions)) == 200 and (first.weights == 1).all()
        np.testing.assert_array_equal(first.probabilities, np.full(400, 0.5))
        second = k.choose(losses, None, rng, 400)
        assert k.importance_sampling and second.positions.tolist() == [7] * 200


def test_kath18_reports_each_candidates_chance_of_being_drawn_at_least_once():
    """An importance-sampled pool draws b examples with replacement in proportion to the loss;
    the probability reported for each candidate is that of being drawn at least once,
    1 - (1 - p)^b (not b * p, which exceeds it, capped at 1), and the draws' frequencies match
    it."""
    losses = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 10.0])
    k = Kath18(selectivity=0.5, tau_threshold=0.0)  # b = 3 of 6
    k.tau = 1.0  # already past the threshold
    rng = np.random.default_rng(5)
    drawn = np.zeros(6)
    for _ in range(4000):
        c = k.choose(losses, None, rng, 6)
        drawn[np.unique(c.positions)] += 1
    share = losses / losses.sum()
    np.testing.assert_allclose(c.probabilities, 1 - (1 - share) ** 3, rtol=1e-12)
    np.testing.assert_allclose(drawn / 4000, c.probabilities, atol=0.03)
    assert drawn[0] == 0


def test_kath18_weights_are_unbiased():
    """E[(1/b) sum w_j x_j] over importance-sampled draws equals the pool's mean of x."""
    rng = np.random.default_rng(1)
    losses = rng.gamma(0.5, size=60) + 1e-3
    x = rng.normal(size=60)  # any per-example quantity, e.g. a gradient coordinate
    k = Kath18(selectivity=0.25, tau_threshold=0.0)
    k.tau = 1.0  # already past the threshold
    estimates = []
    for _ in range(20000):
        c = k.choose(losses, None, rng, 60)
        estimates.append(np.mean(c.weights * x[c.positions]))
    assert k.importance_sampling
    assert np.mean(estimates) == pytest.approx(x.mean(), abs=4 * np.std(estimates) / 141)


def test_kath18_weighted_losses_estimate_the_pool_mean_loss_exactly():
    """E[(1/b) sum_j w_j loss_j] is the pool's mean loss. With draws in proportion to the loss
    and w = 1 / (B p), each draw's estimate is that mean (no variance), so a tight tolerance
    catches self-normalised weights (w / mean(w): the harmonic mean of the drawn losses) and
    weights from the inclusion probability (b / (B P)), which are biased by far more."""
    rng = np.random.default_rng(2)
    losses = rng.gamma(0.5, size=40) + 1e-3
    k = Kath18(selectivity=0.5, tau_threshold=0.0)
    k.tau = 1.0  # already past the threshold
    estimates = []
    for _ in range(4000):
        c = k.choose(losses, None, rng, 40)
        assert k.importance_sampling and len(c.positions) == 20
        estimates.append(np.sum(c.weights * losses[c.positions]) / len(c.positions))
    tolerance = 4 * np.std(estimates) / np.sqrt(len(estimates)) + 1e-9 * losses.mean()
    assert np.mean(estimates) == pytest.approx(losses.mean(), abs=tolerance)


def test_kath18_biased_weights_are_all_one():
    rng = np.random.default_rng(3)
    losses = rng.gamma(0.5, size=40) + 1e-3
    k = Kath18(selectivity=0.5, tau_threshold=0.0, unbiased=False)
    k.tau = 1.0
    for _ in range(50):
        c = k.choose(losses, None, rng, 40)
        assert k.importance_sampling and len(c.positions) == 20
        assert c.weights.tolist() == [1.0] * 20
    assert len(np.unique(c.positions)) < 20  # drawn with replacement: importance-sampled


def test_kath18_through_the_loader_carries_weights():
    loader = loader_for(Kath18(1 / 3, tau_threshold=0.0), EncodedDataset(600), bs=10, source_bs=30)
    batches = [b for _ in range(3) for b in loader]
    assert all(len(b[0]) == 10 for b in batches)
    assert any((b.weights != 1).any() for b in batches)  # importance-sampled, reweighted


@pytest.mark.parametrize("scale", [2.0**1002, 2.0**-1060])
def test_kath18_chooses_alike_for_losses_scaled_near_floats_limits(scale):
    """Losses near float64's largest (their total overflowed to inf: numpy's "probabilities
    contain NaN", and tau fell to 0), or subnormal ones, choose as the same losses unscaled do."""
    losses = np.array([1.0, 2.0, 3.0, 1.75, 0.0, 0.5]) * 2.0**20
    made = []
    for pool in (losses, losses * scale):
        k = Kath18(selectivity=0.5, tau_threshold=0.0)
        k.tau = 1.0  # already past the threshold
        made.append((k.choose(pool, None, np.random.default_rng(0), 6), k.tau))
    (plain, plain_tau), (scaled, scaled_tau) = made
    assert scaled.positions.tolist() == plain.positions.tolist()
    np.testing.assert_allclose(scaled.probabilities, plain.probabilities, rtol=1e-12)
    np.testing.assert_allclose(scaled.weights, plain.weights, rtol=1e-12)
    assert scaled_tau == pytest.approx(plain_tau, rel=1e-12) and scaled_tau > 0.9


def test_kath18_rejects_negative_losses():
    with pytest.raises(ValueError, match="losses should be >= 0"):
        Kath18().choose(np.array([-1.0, 1.0]), None, np.random.default_rng(0), 2)


# ------------------------------------------------------------------ EL2N, prune, Diet-SB
class Blobs(Dataset):
    """Two Gaussian classes, far apart, with some labels flipped."""

    def __init__(self, n=400, flip=0.1, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.x = torch.randn(n, 2, generator=g) + 3.0 * (2 * self.y[:, None].float() - 1)
        self.flipped = torch.randperm(n, generator=g)[: int(flip * n)]
        self.y[self.flipped] = 1 - self.y[self.flipped]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_el2n_ranks_flipped_labels_among_the_hardest():
    ds = Blobs()
    dl = DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    state = torch.get_rng_state()
    r = el2n_scores(
        lambda: nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)),
        dl,
        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        models=3,
        epochs=3,
        seed=0,
    )
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is untouched
    hardest = set(prune(r.scores, 0.1, keep="hardest").tolist())
    flipped = set(ds.flipped.tolist())
    assert len(hardest & flipped) >= 0.8 * len(flipped)
    assert r.train_examples == 3 * 3 * 400 and r.score_forwards == 3 * 400 and r.seconds > 0


@pytest.mark.parametrize("shuffle", [True, False])
def test_el2n_leaves_the_global_rng_alone_with_a_source_that_draws_from_it(shuffle):
    """A DataLoader without generator= draws its base seed (and a shuffling one its order)
    from torch's global RNG at every iter(): the scoring passes too run in the fork."""
    dl = DataLoader(Blobs(100), batch_size=32, shuffle=shuffle)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    el2n_scores(
        lambda: nn.Linear(2, 2),
        dl,
        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        models=2,
        epochs=1,
    )
    assert torch.equal(torch.rand(3), expected)


def test_el2n_refuses_a_make_model_that_returns_the_same_model_again():
    """make_model=lambda: model trained the caller's model in place and continued each copy
    from the last one's weights (one long training scored, silently); refused at the second
    copy, naming make_model. A backbone shared by fresh heads is refused too; fresh models
    whose predecessors were freed are not (parameter ids may be reused)."""
    dl = DataLoader(Blobs(64), batch_size=32)
    opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="make_model should return a new model on each call"):
        el2n_scores(lambda: model, dl, make_optimizer=opt, models=2, epochs=1)
    backbone = nn.Linear(2, 4)  # trainable, so trained by every copy in turn
    with pytest.raises(ValueError, match="copy 1 shares parameters"):
        el2n_scores(
            lambda: nn.Sequential(backbone, nn.Linear(4, 2)), dl, make_optimizer=opt, models=2
        )
    with pytest.raises(TypeError, match="make_model should return a freshly initialised"):
        el2n_scores(lambda: None, dl, make_optimizer=opt, models=1)
    r = el2n_scores(lambda: nn.Linear(2, 2), dl, make_optimizer=opt, models=3, epochs=1)
    assert r.models == 3 and not np.isnan(r.scores).any()


def test_el2n_with_a_frozen_shared_backbone_uint8_labels_and_its_own_generator():
    """A frozen backbone shared by fresh heads is not trained, so it is allowed; uint8 labels
    (which cross-entropy takes) are scored; the source's generator= is put back, so the order
    of the training that follows is unchanged and the same call scores the same; drop_last is
    refused (examples would go unscored)."""
    ds = Blobs(64)
    labels8 = [(x, y.to(torch.uint8)) for x, y in (ds[i] for i in range(len(ds)))]
    opt = lambda m: torch.optim.SGD((p for p in m.parameters() if p.requires_grad), lr=0.1)  # noqa: E731
    frozen = nn.Linear(2, 4).requires_grad_(False)

    def step(model, optimizer, x, y):
        loss = nn.functional.cross_entropy(model(x), y.long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    gen = torch.Generator().manual_seed(5)
    dl = DataLoader(labels8, batch_size=16, shuffle=True, generator=gen)
    before = gen.get_state()
    make = lambda: nn.Sequential(frozen, nn.Linear(4, 2))  # noqa: E731
    first = el2n_scores(make, dl, make_optimizer=opt, train_step=step, models=2, epochs=1)
    assert torch.equal(gen.get_state(), before)
    again = el2n_scores(make, dl, make_optimizer=opt, train_step=step, models=2, epochs=1)
    np.testing.assert_array_equal(first.scores, again.scores)
    assert not np.isnan(first.scores).any()
    dropping = DataLoader(ds, batch_size=24, drop_last=True)
    with pytest.raises(ValueError, match="drop_last=False"):
        el2n_scores(lambda: nn.Linear(2, 2), dropping, make_optimizer=opt, models=1)


def test_el2n_scores_soft_labels_and_refuses_other_target_shapes_before_training():
    """EL2N by hand, ||softmax(W x) - y||_2 averaged over copies: class indices and the same
    labels one-hot as floats (soft labels, which cross-entropy trains on) score alike; (batch, 1)
    targets are refused at the first training batch (scoring failed in torch or numba only after
    a whole copy had trained)."""
    torch.manual_seed(0)
    x, y = torch.randn(10, 3), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    weights = [torch.randn(3, 3) for _ in range(2)]
    made = []

    def make():
        model = nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            model.weight.copy_(weights[len(made) % 2])
        made.append(model)
        return model

    hand = np.mean(
        [
            (torch.softmax(x @ w.T, 1) - nn.functional.one_hot(y, 3)).norm(dim=1).numpy()
            for w in weights
        ],
        axis=0,
    )
    opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.0)  # noqa: E731
    for labels in (y, nn.functional.one_hot(y, 3).float()):
        loader = DataLoader(list(zip(x, labels)), batch_size=4, shuffle=True)
        result = el2n_scores(make, loader, make_optimizer=opt, models=2, epochs=1)
        np.testing.assert_allclose(result.scores, hand, rtol=0, atol=1e-6)
    steps = []
    step = lambda model, optimizer, x, y: steps.append(1)  # noqa: E731
    column = DataLoader(list(zip(x, y.view(-1, 1))), batch_size=4)
    with pytest.raises(ValueError, match=r"class indices.*shape \(4, 1\) and dtype torch.int64"):
        el2n_scores(make, column, make_optimizer=opt, train_step=step, models=2, epochs=1)
    assert steps == []
    wrong = DataLoader(list(zip(x, torch.rand(10, 4))), batch_size=4)
    with pytest.raises(ValueError, match=r"shape \(4, 4\) and the model's outputs \(4, 3\)"):
        el2n_scores(make, wrong, make_optimizer=opt, models=1, epochs=0)


def test_el2n_refuses_nan_outputs_naming_the_copy_and_scores_infinite_logits_at_their_limit():
    """A copy whose outputs were NaN (diverged) was left out of the average silently (NaN
    scores where it was the only copy, which prune took for examples never scored); a logit of
    +inf (a float16 model's overflow) made its row's softmax NaN."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    dl = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    def made(bias):
        def make():
            m = nn.Linear(3, 2)
            with torch.no_grad():
                m.weight.zero_()
                m.bias.copy_(torch.tensor([bias, 0.0]))
            return m

        return make

    def scores(bias, models):
        sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.0)  # noqa: E731
        return el2n_scores(made(bias), dl, make_optimizer=sgd, models=models, epochs=0).scores

    with pytest.raises(ValueError, match=r"NaN scores from copy 0 for 8 examples.*indices \[0,"):
        scores(float("nan"), 2)
    # +inf for class 0: its probability is 1, the error 0 for class 0 and sqrt(2) for class 1
    expected = np.where(y.numpy() == 0, 0.0, np.sqrt(2.0))
    np.testing.assert_allclose(scores(float("inf"), 1), expected, rtol=1e-6)


def test_el2n_copy_k_is_seeded_with_seed_plus_k_and_examples_average_their_scores():
    """Copy k initialises under seed + k, so two copies from seed 3 score as the copies of seeds
    3 and 4 each alone, averaged (one seed for every copy averaged one model with itself); an
    example the sampler draws twice averages its scores, one never drawn is NaN (not 0)."""
    dl = DataLoader(Blobs(64), batch_size=16)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731

    def scores(models, seed, source=dl, epochs=1):
        return el2n_scores(
            lambda: nn.Linear(2, 2),
            source,
            make_optimizer=sgd,
            models=models,
            epochs=epochs,
            seed=seed,
        ).scores

    np.testing.assert_allclose(scores(2, 3), (scores(1, 3) + scores(1, 4)) / 2, rtol=1e-12)
    repeats = DataLoader(Blobs(8), batch_size=2, sampler=[0, 0, 1, 2])
    alone = DataLoader(Blobs(8), batch_size=2, sampler=[0, 1, 2])
    got = scores(1, 0, repeats, epochs=0)  # (untrained: the one model scores both alike)
    assert np.isnan(got[3:]).all()
    np.testing.assert_allclose(got[:3], scores(1, 0, alone, epochs=0)[:3], rtol=1e-12)


def test_el2n_averages_each_copy_once_and_refuses_a_sampler_drawing_with_replacement():
    """An example a pass yields twice counts once per copy: the mean over copies, not over
    scoring events (a copy scoring an example three times outweighed one scoring it once). A
    sampler drawing with replacement, which scores some examples never and others twice, is
    refused before any copy trains, naming the sampler (prune's NaN message named neither)."""
    from torch.utils.data import WeightedRandomSampler

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731

    def scores(source, models):
        return el2n_scores(
            lambda: nn.Linear(2, 2), source, make_optimizer=sgd, models=models, epochs=0
        ).scores

    per_copy = []
    for k in range(2):  # untrained copy k is nn.Linear made under seed k
        torch.manual_seed(k)
        m = nn.Linear(2, 2)
        x, y = Blobs(8).x, Blobs(8).y
        with torch.no_grad():
            p = torch.softmax(m(x), 1).double().numpy()
        per_copy.append(np.linalg.norm(p - np.eye(2)[y.numpy()], axis=1))

    class Uneven(torch.utils.data.Sampler):
        """The first pass yields example 0 three times, later ones once."""

        passes = 0

        def __iter__(self):
            Uneven.passes += 1
            return iter([0, 0] * (Uneven.passes == 1) + list(range(8)))

        def __len__(self):
            return 10 if Uneven.passes == 0 else 8

    # copy 0 scores example 0 three times, copy 1 once: still the mean of the two copies
    uneven = DataLoader(Blobs(8), batch_size=2, sampler=Uneven())
    np.testing.assert_allclose(scores(uneven, 2), np.mean(per_copy, axis=0), rtol=1e-6)
    drawn = WeightedRandomSampler(torch.ones(8), num_samples=8, replacement=True)
    for sampler in (drawn, torch.utils.data.RandomSampler(Blobs(8), replacement=True)):
        source = DataLoader(Blobs(8), batch_size=2, sampler=sampler)
        with pytest.raises(ValueError, match=rf"sampler \({type(sampler).__name__}\) draws with"):
            scores(source, 1)


def test_el2n_names_the_batch_format_and_the_class_range_it_takes():
    """Dict batches failed with a bare KeyError(0) and class indices of another range in
    one_hot's words; both now name what el2n_scores takes and the fix."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    x, y = torch.randn(12, 2), torch.randint(0, 2, (12,))
    rows = [{"x": x[i], "y": y[i]} for i in range(12)]
    with pytest.raises(TypeError, match=r"\(inputs, targets\) batches.*keys \['x', 'y'\]"):
        el2n_scores(lambda: nn.Linear(2, 2), DataLoader(rows, 4), make_optimizer=sgd, models=1)
    for bad, classes in ((y + 5, 6), (y - 1, -1)):
        data = torch.utils.data.TensorDataset(x, bad)
        with pytest.raises(ValueError, match=rf"class indices in \[0, 2\).*holds class {classes}"):
            el2n_scores(
                lambda: nn.Linear(2, 2), DataLoader(data, 4), make_optimizer=sgd, models=1, epochs=0
            )


def test_el2n_trains_each_copy_in_train_mode_and_scores_it_in_eval_mode():
    """Documented: the copies train with the user's recipe (in train mode, also where
    make_model returns a model in eval mode) and are scored in eval mode (dropout off,
    batch-norm statistics used), whatever mode the training left them in."""
    modes: list[bool] = []

    class Records(nn.Linear):
        def forward(self, x):
            modes.append(self.training)
            return super().forward(x)

    el2n_scores(
        lambda: Records(2, 2).eval(),
        DataLoader(Blobs(16), batch_size=8),
        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        models=1,
        epochs=1,
    )
    assert modes == [True, True, False, False]  # two training batches, then two scored


def test_prune_rounds_halves_up_as_the_overlap_does_and_takes_tensors_that_need_grad():
    assert len(prune(np.arange(5.0), 0.5)) == 3  # 2.5 -> 3 (Python's round gives 2)
    assert len(prune(np.arange(100.0), 0.145)) == 15  # 14.499999999999998 -> 15
    scores = torch.tensor([0.1, 0.9, 0.5], requires_grad=True)
    assert prune(scores, 2 / 3).tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64])
def test_prune_takes_tensors_of_any_number_dtype(dtype):
    """Scores made under autocast are bfloat16, which numpy has no dtype for: such a tensor was
    refused as not holding "one number per dataset index"."""
    scores = torch.tensor([1, 9, 5, 7]).to(dtype)
    assert prune(scores, 0.5).tolist() == [1, 3]
    assert prune(scores, 0.5, keep="easiest").tolist() == [0, 2]


def test_el2n_never_reseeds_cuda_generators_it_does_not_restore(monkeypatch):
    """torch.manual_seed also reseeds every CUDA device's generator; on a CPU run fork_rng
    restores none of them, so EL2N seeds the CPU generator alone (a caller's CUDA random state
    would otherwise change): no CUDA seeding happens, and the scores repeat with the seed."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: calls.append("all"))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: calls.append("one"))

    def scores(seed):
        return el2n_scores(
            lambda: nn.Linear(2, 2),
            DataLoader(Blobs(100), batch_size=32),
            make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            models=2,
            epochs=1,
            seed=seed,
            device="cpu",
        ).scores

    first = scores(3)
    assert calls == []
    np.testing.assert_array_equal(first, scores(3))
    assert not np.array_equal(first, scores(4))


def test_el2n_scores_refuses_what_is_no_builder_naming_the_parameter():
    """A model instance for make_model (a module is callable: "forward() missing 1 required
    positional argument"), an optimizer class for make_optimizer ("'Linear' object is not
    iterable") or None failed inside the first copy's training, naming no parameter."""
    from torch.utils.data import DataLoader, TensorDataset

    dl = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=8)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), 0.1)

    for kwargs, message in [
        ({"make_model": nn.Linear(4, 2)}, "make_model should be a function .*make_model=Linear"),
        ({"make_model": None}, "make_model should be a function"),
        ({"make_optimizer": torch.optim.SGD}, "make_optimizer should be a function .*=SGD"),
        ({"make_optimizer": None}, "make_optimizer should be a function"),
        ({"train_step": "sgd"}, "train_step should be a function"),
    ]:
        args = {"make_model": lambda: nn.Linear(4, 2), "make_optimizer": sgd, **kwargs}
        with pytest.raises(TypeError, match=message):
            el2n_scores(args.pop("make_model"), dl, models=1, epochs=1, **args)
    assert el2n_scores(lambda: nn.Linear(4, 2), dl, make_optimizer=sgd, models=1).scores.shape == (
        16,
    )


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.5, 0.77, 1.0])
def test_prune_keeps_exactly_the_requested_fraction(fraction):
    scores = np.round(np.random.default_rng(0).random(1000), 2)  # many ties
    kept = prune(scores, fraction)
    assert len(kept) == round(fraction * 1000) and len(set(kept.tolist())) == len(kept)
    rest = np.setdiff1d(np.arange(1000), kept)
    if len(rest):
        assert scores[kept].min() >= scores[rest].max()
    easy = prune(scores, fraction, keep="easiest")
    assert len(easy) == len(kept)


@pytest.mark.parametrize("fraction", [0.1, 0.33, 0.5, 0.9])
def test_prune_keeps_the_easiest_or_hardest_with_ties_to_the_lower_index(fraction):
    scores = np.round(np.random.default_rng(1).random(500), 1)  # ties at every cut
    k = round(fraction * 500)
    easiest = sorted(range(500), key=lambda i: (scores[i], i))[:k]
    hardest = sorted(range(500), key=lambda i: (-scores[i], i))[:k]
    got = prune(scores, fraction, keep="easiest")
    assert got.dtype == np.int64 and got.tolist() == sorted(easiest)
    assert prune(scores, fraction, keep="hardest").tolist() == sorted(hardest)
    ties = np.full(8, 0.5)
    assert prune(ties, 0.5).tolist() == [0, 1, 2, 3] == prune(ties, 0.5, keep="easiest").tolist()


def test_prune_rejects_nan_and_bad_fractions():
    with pytest.raises(ValueError, match="NaN"):
        prune([0.1, float("nan")], 0.5)
    with pytest.raises(ValueError, match=r"fraction should be in \(0, 1\]"):
        prune([0.1, 0.2], 0.0)


def test_prune_refuses_scores_that_are_not_one_per_index_and_an_empty_result():
    """Scores of shape (N, K) were flattened into N * K "dataset indices" (up to N * K - 1), a
    scalar or None taken as one score, and a fraction that rounds to no example returned an empty
    array: each a silent wrong result, now refused naming the fix."""
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"one score per dataset index \(a 1-d array\).*\(64, 2\)"):
        prune(rng.random((64, 2)), 0.5)
    for bad in (3.0, None, []):
        with pytest.raises(ValueError, match="scores should hold a score for each dataset index"):
            prune(bad, 1.0)
    with pytest.raises(TypeError, match="scores should hold one number per dataset index"):
        prune(["a", "b"], 0.5)
    for mask in ([True, False], np.array([True, False]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match=r"but got booleans \(a mask\).*flatnonzero"):
            prune(mask, 0.5)  # (it kept index 0, a mask's ones ranked as scores)
    with pytest.raises(ValueError, match=r"fraction=0.001 of 64 scores keeps none; .*1/64"):
        prune(rng.random(64), 0.001)
    column = rng.random((64, 1))  # one score per index, as a column: taken as before
    assert prune(column, 0.5).tolist() == prune(column[:, 0], 0.5).tolist()
    assert prune(column.T, 0.5).tolist() == prune(column[:, 0], 0.5).tolist()  # and as a row
    assert prune(torch.tensor([0.1, 0.9, 0.5]), 1 / 3).tolist() == [1]


@pytest.mark.parametrize("workers", [0, 2])
def test_diet_sb_never_yields_a_pruned_index(workers):
    keep = prune(np.random.default_rng(0).random(300), 0.5)
    ds = CountingDataset(300)
    loader = loader_for(SelectiveBackprop(0.5), ds, subset=keep, workers=workers)
    got = {i for _ in range(3) for b in loader for i in b.indices.tolist()}
    assert got <= set(keep.tolist()) and len(got) > 0
    if workers == 0:
        assert set(ds.loaded) <= set(keep.tolist())  # pruned examples are never even loaded
    assert loader.stats.epochs[0].examples_seen == 150


def test_subset_on_a_source_that_cannot_filter():
    ds = EncodedDataset(40)
    batches = [
        (
            torch.stack([ds[i][0] for i in range(s, s + 10)]),
            torch.stack([ds[i][1] for i in range(s, s + 10)]),
            torch.arange(s, s + 10),
        )
        for s in range(0, 40, 10)
    ]
    loader = SelectiveLoader(
        batches,
        IndexLoss(),
        policy=RandomBackprop(1.0),
        batch_size=5,
        index_key=2,
        subset=[1, 2, 3, 11, 12, 39],
        remainder="short",
    )
    got = [i for b in loader for i in b.indices.tolist()]
    assert got == [1, 2, 3, 11, 12, 39]
    # Left out after loading: counted as excluded, never as candidates seen.
    e = loader.stats.current
    assert (e.examples_seen, e.excluded, e.examples_selected) == (6, 34, 6)


@pytest.mark.parametrize(
    "bad, exc", [([1.5, 2.0], TypeError), ([0, 999], ValueError), ([-1], ValueError)]
)
def test_bad_subsets_are_named(bad, exc):
    with pytest.raises(exc, match="subset"):
        loader_for(SelectiveBackprop(), subset=bad)


# ------------------------------------------------------------------ beyond the papers
def test_warmup_and_annealing_backprop_everything_without_selection_passes():
    model = IndexLoss()
    policy = Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, anneal_from_epoch=3)
    loader = loader_for(policy, model=model, remainder="drop")
    for _ in range(4):
        list(loader)
    e = loader.stats.epochs
    assert [x.selection_forwards for x in e] == [0, 300, 300, 0]
    assert e[0].examples_selected == e[3].examples_selected == 300
    assert e[1].examples_selected < 150 and e[0].target_rate == 1.0
    assert e[1].target_rate == pytest.approx(1 / 3)


def test_expected_batches_between_epochs_estimate_the_next_phase():
    """Read before each epoch (to size its schedule), expected_batches() is the rate of the
    epoch about to run: the warm-up's first, then SB's, then the anneal's all the data (it
    read the epoch before's: 30 batches for the first SB epoch, 10 for the annealed one).
    """
    policy = Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, anneal_from_epoch=3)
    loader = loader_for(policy, remainder="drop")
    before, during, yielded = [], [], []
    for _ in range(5):
        before.append(loader.expected_batches())
        n = 0
        for _ in loader:
            if n == 0:
                during.append(loader.expected_batches())
            n += 1
        yielded.append(n)
    assert before == during == [30.0, 10.0, 10.0, 30.0, 30.0]
    assert yielded[0] == yielded[3] == yielded[4] == 30  # the warm-up and the anneal: all 300
    # An epoch left part-way (break): the next iter() begins the next epoch, the anneal's.
    loader = loader_for(Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, anneal_from_epoch=2))
    list(loader)
    for _ in loader:
        break
    assert loader.expected_batches() == 30.0
    assert sum(1 for _ in loader) == 30 and loader.stats.current.epoch == 2


def test_phased_stale_sb_starts_with_a_fresh_epoch():
    policy = Phased(SelectiveBackprop(1 / 3, staleness=2), warmup_epochs=1)
    loader = loader_for(policy)
    for _ in range(4):
        list(loader)
    assert [x.selection_forwards for x in loader.stats.epochs] == [0, 300, 0, 300]


def test_unbiased_reweighting_normalises_weights_per_batch():
    loader = loader_for(SelectiveBackprop(1 / 3, reweight=True), EncodedDataset(600))
    for b in loader:
        torch.testing.assert_close(b.weights.mean(), torch.tensor(1.0))
        # Weight is proportional to 1 / P within a batch.
        ratio = b.weights * b.probabilities
        torch.testing.assert_close(ratio, ratio[0].expand_as(ratio))


@pytest.mark.parametrize("resumed", [False, True])
def test_rows_carried_from_a_reweighted_epoch_into_an_annealed_one_weigh_mean_one(resumed):
    """SB with reweight=True, then Phased's annealed Traditional epoch (which does not
    normalise): the rows carried from the reweighted epoch open the annealed one in their 1/P
    ratios at mean weight 1 (they went in with their raw 1/P weights, the batch's mean far
    from 1), the annealed epoch's own rows weigh 1; resumed from a state saved between the two
    epochs, alike."""

    def loader():
        policy = Phased(SelectiveBackprop(1 / 3, reweight=True), anneal_from_epoch=1)
        return loader_for(policy, EncodedDataset(600))

    first = loader()
    list(first)
    carried = first.pending_examples
    if resumed:
        state = first.state_dict()
        first = loader()
        first.load_state_dict(state)
    b = next(iter(first))
    assert 1 < carried < len(b.weights)
    w, p = b.weights[:carried], b.probabilities[:carried]
    assert w.max() > 1.5 * w.min()  # (1/P weights, not all alike)
    torch.testing.assert_close(w.mean(), torch.tensor(1.0))
    torch.testing.assert_close(w * p, (w * p)[:1].expand_as(w))
    assert (b.weights[carried:] == 1).all() and (b.probabilities[carried:] == 1).all()
    torch.testing.assert_close(b.weights.mean(), torch.tensor(1.0))


def test_unnormalised_weights_carried_into_an_annealed_epoch_are_left_as_chosen():
    """Kath18's unbiased weights (1 / (B p), not normalised per batch) carried into Phased's
    annealed epoch open it as they were chosen: the same weights as the rows carried into a
    next Kath18 epoch of the same run; only weights normalised per batch are rescaled."""

    def first_of_epoch_1(anneal):
        policy = Kath18(selectivity=0.25, tau_threshold=0.0)  # 8 of each of 21 pools of 30
        loader = loader_for(Phased(policy, anneal_from_epoch=anneal), EncodedDataset(630))
        list(loader)
        return loader.pending_examples, next(iter(loader))

    carried, annealed = first_of_epoch_1(1)
    same, kept = first_of_epoch_1(None)
    assert carried == same and 1 < carried < len(annealed.weights)
    w = annealed.weights[:carried]
    assert w.max() > 1.5 * w.min() and abs(float(w.mean()) - 1) > 0.01
    torch.testing.assert_close(w, kept.weights[:carried], rtol=0, atol=0)
    torch.testing.assert_close(annealed.indices[:carried], kept.indices[:carried])
    assert (annealed.weights[carried:] == 1).all()


# ------------------------------------------------------------------ the store
def test_store_round_trips_through_state_dict():
    s = ExampleStore(100)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 100, 50)
    s.record(idx, rng.random(50), epoch=4)
    s.count_selected(idx[:10])
    t = ExampleStore(100)
    t.load_state_dict(s.state_dict())
    for a, b in zip(s.lookup(np.arange(100)), t.lookup(np.arange(100))):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(s.selected, t.selected)
    assert s.nbytes == 12 * 100


def test_store_matches_a_numpy_reference():
    """record, lookup and count_selected against numpy: a non-finite loss keeps what was stored,
    a repeated index keeps its last finite loss and is counted once per occurrence."""
    size, rng = 50, np.random.default_rng(4)
    s = ExampleStore(size)
    loss, epoch = np.full(size, np.nan), np.full(size, -1, dtype=np.int64)
    count = np.zeros(size, dtype=np.int64)
    for step in range(30):
        idx = rng.integers(0, size - 10, 40)  # the last 10 never scored
        values = rng.exponential(size=40)
        bad = rng.random(40) < 0.2
        values[bad] = rng.choice(np.array([np.nan, np.inf, -np.inf]), bad.sum())
        s.record(idx, values, epoch=3 * step)
        finite = np.flatnonzero(np.isfinite(values))[::-1]  # the last occurrence wins
        last = finite[np.unique(idx[finite], return_index=True)[1]]
        loss[idx[last]] = values[last].astype(np.float32)
        epoch[idx[last]] = 3 * step
        chosen = idx[rng.random(40) < 0.3]
        s.count_selected(chosen)
        np.add.at(count, chosen, 1)
        probe = rng.integers(0, size, 60)
        got_loss, got_epoch = s.lookup(probe)
        assert got_loss.dtype == np.float64 and got_epoch.dtype == np.int64
        np.testing.assert_array_equal(got_loss, loss[probe])
        np.testing.assert_array_equal(got_epoch, epoch[probe])
        np.testing.assert_array_equal(s.selected, count)
    assert np.isnan(loss).any() and (count > 1).any()  # never-scored and repeated examples
    for call in (
        lambda: s.record(np.array([3, size]), np.ones(2), epoch=0),
        lambda: s.lookup(np.array([-1, 3])),
        lambda: s.count_selected(np.array([size + 5])),
    ):
        with pytest.raises(IndexError, match="outside the store"):
            call()


def test_store_handles_indices_above_2_31_exactly(tmp_path):
    n = 2**31 + 10
    s = ExampleStore(n, path=tmp_path)  # sparse files: no 25 GB written
    idx = np.array([0, 2**24 + 1, 2**31 - 1, 2**31, 2**31 + 9], dtype=np.int64)
    s.record(idx, np.array([1.0, 2.0, 3.0, 4.0, 5.0]), epoch=7)
    s.count_selected(idx[3:])
    losses, epochs = s.lookup(idx)
    assert losses.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] and (epochs == 7).all()
    assert s.selected[2**31] == 1 and s.selected[2**31 - 1] == 0
    assert np.isnan(s.lookup(np.array([2**31 + 1]))[0][0])
    json.dumps(s.state_dict())
    s.close()  # (a newer store on the same folder takes it: the older one is refused after)
    again = ExampleStore(n, path=tmp_path)  # reopening the files keeps the contents
    assert again.lookup(np.array([2**31 + 9]))[0].tolist() == [5.0]
    with pytest.raises(IndexError, match="outside the store"):
        again.record(np.array([n]), np.array([1.0]), epoch=0)
    with pytest.raises(TypeError, match="integers"):
        again.lookup(np.array([1.0]))


@pytest.mark.parametrize("epoch", [-1, -3])
def test_store_refuses_a_negative_epoch_naming_it(epoch):
    """``seen`` holds the epoch plus one, 0 meaning never scored: epoch -1 stored a loss that
    lookup reported as never scored, and -3 one that a stale epoch's prefilter (P = 1, never
    scored) and its choose (P from the loss) decided differently."""
    s = ExampleStore(4)
    with pytest.raises(ValueError, match=f"epoch should be >= 0, but got epoch={epoch}"):
        s.record(np.array([0, 1]), np.array([0.5, 0.7]), epoch=epoch)
    assert (s.seen == 0).all() and (s.loss == 0).all()  # nothing was written
    sb = SelectiveBackprop(1 / 3, staleness=3)
    sb.attach(4, 0)
    with pytest.raises(ValueError, match="epoch should be >= 0"):
        sb.feedback(np.array([0]), np.array([0.5]), epoch)


def test_store_keeps_a_finite_loss_beyond_float32_finite():
    """The loss column is float32: a finite loss above its range was stored as inf, which a
    stale epoch's prefilter ranked as NaN (rejected, never loaded) while its choose ranked it
    highest (kept), and which lookup reported as not finite."""
    s = ExampleStore(3)
    s.record(np.array([0, 1]), np.array([1e39, -1e39]), epoch=0)
    assert np.isfinite(s.lookup(np.array([0, 1]))[0]).all()
    sb = SelectiveBackprop(1 / 3, staleness=3)
    sb.attach(10, 1)
    idx, rng = np.arange(10), np.random.default_rng(0)
    sb.begin_epoch(0)
    sb.choose(np.r_[np.arange(9.0), 1e39], idx, rng, 10)  # a fresh pass stores the losses
    assert np.isfinite(sb.store.lookup(idx)[0]).all()
    sb.begin_epoch(1)  # stale
    mask = sb.prefilter(idx)
    chosen = sb.choose(None, idx, rng, 10)
    np.testing.assert_array_equal(np.flatnonzero(mask), chosen.positions)
    p = sb.stale_probabilities(idx)
    assert np.isfinite(p).all() and p[9] == p.max()  # ranked as the highest stored loss


def test_store_kernels_run_without_jit():
    """The store's tests (here and the property test) also pass with NUMBA_DISABLE_JIT=1, the
    kernels running as plain Python (the window's: test_window.py)."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["-k", "test_store_ and not without_jit"]  # not itself: no recursion
    cmd += [str(here / "test_strategies.py"), str(here / "test_properties.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 4, proc.stdout[-3000:]


def test_public_api_has_the_strategies():
    for name in ("Kath18", "Phased", "RandomBackprop", "ExampleStore", "el2n_scores", "prune"):
        assert name in sbloader.__all__


def test_a_random_backprop_warmup_selects_without_selection_passes():
    model = IndexLoss()
    policy = Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, warmup_policy=RandomBackprop(0.25))
    loader = loader_for(policy, EncodedDataset(3000), model=model, remainder="drop")
    list(loader)
    first = loader.stats.epochs[0]
    # No selection pass: the model ran twice, on two and three examples, to check it on the
    # first batch.
    assert first.selection_forwards == 0 and model.calls == 2
    assert first.target_rate == 0.25
    assert abs(first.examples_selected / 3000 - 0.25) < 0.03
    list(loader)
    second = loader.stats.epochs[1]
    assert second.selection_forwards == 3000 and second.target_rate == pytest.approx(1 / 3)
    # SB keeps the high-loss (high-index) examples; the random warm-up did not prefer them.
    assert second.examples_selected < 1200


def test_a_loss_based_warmup_policy_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="warmup_policy should need no selection pass"):
        Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, warmup_policy=SelectiveBackprop(0.5))
    with pytest.raises(TypeError, match="warmup_policy should be an sbloader policy"):
        Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, warmup_policy="random")


def test_phased_warmup_state_round_trips_mid_warmup():
    def make():
        return loader_for(
            Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, warmup_policy=RandomBackprop(0.5)),
            EncodedDataset(600),
        )

    ref = make()
    expected = [b.indices.tolist() for _ in range(2) for b in ref]
    a = make()
    it = iter(a)
    got = [next(it).indices.tolist() for _ in range(5)]
    b = make()
    b.load_state_dict(a.state_dict())
    got += [x.indices.tolist() for x in b]
    got += [x.indices.tolist() for x in b]
    assert got == expected


@pytest.mark.parametrize(
    "policy, kw",
    [
        (lambda: SelectiveBackprop(1 / 3, staleness=2), {}),  # epoch 1 is stale: prefiltered
        (lambda: SelectiveBackprop(1 / 3), {"subset": np.arange(0, 300, 3)}),
        (lambda: RandomBackprop(0.5), {}),
    ],
)
def test_progress_advances_by_candidates_drawn_not_batches_loaded(policy, kw):
    """Schedules keyed on progress must not lag where fewer batches are loaded."""
    loader = loader_for(policy(), **kw)
    for epoch in range(2):
        seen = [loader.progress for _ in loader]
        assert seen == sorted(seen) and all(epoch <= p <= epoch + 1 for p in seen)
        # The last batch comes after (nearly) all of the epoch's candidates were drawn.
        assert seen[-1] > epoch + 0.8, seen
        assert loader.progress == epoch + 1
        e = loader.stats.current
        assert e.examples_seen + e.excluded == 300
    if "subset" in kw:
        assert loader.stats.current.excluded == 200 and loader.stats.current.examples_seen == 100


def test_kath18_state_round_trip_restores_tau_and_the_phase_and_continues_identically():
    """A Kath18 restored from its state is past the threshold as the saved one is (tau and
    the phase of its last pool), and chooses the same from the same generator."""
    rng = np.random.default_rng(4)
    skewed = np.r_[np.full(40, 0.01), np.full(5, 10.0)]
    saved = Kath18(selectivity=1 / 3)
    for _ in range(60):
        saved.choose(skewed, None, rng, 45)
    assert saved.importance_sampling
    restored = Kath18(selectivity=1 / 3)
    restored.load_state_dict(saved.state_dict())
    assert (restored.tau, restored.importance_sampling) == (saved.tau, True)
    state = rng.bit_generator.state
    a = saved.choose(skewed, None, rng, 45)
    rng.bit_generator.state = state
    b = restored.choose(skewed, None, rng, 45)
    np.testing.assert_array_equal(a.positions, b.positions)
    np.testing.assert_array_equal(a.weights, b.weights)


@pytest.mark.parametrize(
    "saved, loading, says",
    [
        (
            lambda: SelectiveBackprop(1 / 3, staleness=3, fed_staleness=10),
            lambda: SelectiveBackprop(1 / 3, staleness=3, fed_staleness=5),
            "fed_staleness=10",
        ),
        (
            lambda: SelectiveBackprop(1 / 3, staleness=3, drift_bound=0.25),
            lambda: SelectiveBackprop(1 / 3, staleness=3),
            "drift_bound=0.25",
        ),
        (lambda: RandomBackprop(0.25), lambda: RandomBackprop(0.5), "selectivity=0.25"),
        (lambda: Kath18(0.5, unbiased=False), lambda: Kath18(0.5), "unbiased=False"),
        (
            lambda: Phased(RandomBackprop(0.5), warmup_epochs=2),
            lambda: Phased(RandomBackprop(0.5), warmup_epochs=1),
            "warmup_epochs=2",
        ),
    ],
    ids=["fed_staleness", "drift_bound", "random-selectivity", "kath18-unbiased", "warmup"],
)
def test_a_loader_state_from_other_policy_settings_is_refused_naming_them(saved, loading, says):
    """A checkpoint resumes only into the policy it was saved with: the settings that change
    which examples are chosen, and which the policy's own state does not hold (Stale-SB's pass
    spacing with reports and its drift bound, Random-Backprop's share, Kath18's weights, the
    warm-up's length), are in the loader state's identity, so another is refused, naming it."""
    a = loader_for(saved())
    list(a)
    with pytest.raises(ValueError, match=re.escape(says)):
        loader_for(loading()).load_state_dict(a.state_dict())


@pytest.mark.parametrize("on_disk", [False, True])
def test_clearing_the_store_forgets_losses_epochs_and_selection_counts(on_disk, tmp_path):
    """clear() (a reused policy's next run, at its store's first use) leaves every example
    never scored and never selected, in memory as in files: a count left over was the earlier
    run's selections in this run's records."""
    s = ExampleStore(3, path=tmp_path if on_disk else None)
    s.record(np.array([0, 1]), np.array([0.5, 2.0]), epoch=1)
    s.count_selected(np.array([1, 1, 2]))
    s.clear()
    losses, epochs = s.lookup(np.arange(3))
    assert np.isnan(losses).all() and epochs.tolist() == [-1, -1, -1]
    assert s.selected.tolist() == [0, 0, 0]
