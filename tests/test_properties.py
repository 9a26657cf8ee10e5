"""Property tests (hypothesis): Stale-SB, Kath18, the per-example store and the whole loader.

Probabilities stay in [0, 1] and grow with the loss; every state survives a round trip (through
``torch.save``/``torch.load(weights_only=True)`` where tensors are involved) and the run then
continues identically. The loss window's own properties are in test_window.py and plain SB's in
test_policies.py.
"""

from __future__ import annotations

import io
import json
import tempfile

import numpy as np
import torch
from conftest import N_CLASSES, EncodedDataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader

from sbloader import (
    ExampleStore,
    Kath18,
    Phased,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
)

finite_losses = st.floats(0, 1e3, allow_nan=False, allow_infinity=False, width=32)


def through_torch_save(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------- Stale-SB
@settings(max_examples=60, deadline=None)
@given(
    window=st.lists(finite_losses, min_size=1, max_size=60),
    stored=st.lists(finite_losses | st.just(float("nan")), min_size=1, max_size=60),
    selectivity=st.floats(0.05, 1.0),
    key=st.integers(0, 2**63 - 1),
    stale_epoch=st.integers(0, 40).map(lambda e: 2 * e + 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_stale_sb_probabilities_and_decisions(window, stored, selectivity, key, stale_epoch, seed):
    n = len(stored)
    stored_arr = np.array(stored)
    p = SelectiveBackprop(selectivity, history=64, staleness=2)
    p.attach(n, key)
    p.window.push(np.array(window))
    idx = np.arange(n)
    p.store.record(idx, stored_arr, epoch=0)  # NaN: never scored
    p.begin_epoch(stale_epoch)
    assert not p.needs_losses(stale_epoch)

    prob = p.stale_probabilities(idx)
    scored = np.isfinite(stored_arr)
    assert ((prob > 0) & (prob <= 1)).all()
    assert (prob[~scored] == 1).all()  # never scored: selected, never silently skipped
    order = np.argsort(stored_arr[scored], kind="stable")
    assert (np.diff(prob[scored][order]) >= 0).all()  # monotone in the stored loss

    # The decision before loading equals the one after, whatever order the examples come in.
    mask = p.prefilter(idx)
    perm = np.random.default_rng(seed).permutation(n)
    np.testing.assert_array_equal(p.prefilter(idx[perm]), mask[perm])

    # A state round trip (through torch.save) gives the same probabilities and choices.
    q = SelectiveBackprop(selectivity, history=64, staleness=2)
    q.attach(n, key)
    q.load_state_dict(through_torch_save(p.state_dict()))
    q.begin_epoch(stale_epoch)
    np.testing.assert_array_equal(q.stale_probabilities(idx), prob)
    cp = p.choose(None, idx, np.random.default_rng(seed), n)
    cq = q.choose(None, idx, np.random.default_rng(seed + 1), n)  # no draws from the rng
    np.testing.assert_array_equal(cp.positions, np.flatnonzero(mask))
    np.testing.assert_array_equal(cq.positions, cp.positions)
    np.testing.assert_array_equal(p.store.selected, q.store.selected)
    assert p.store.selected.sum() == len(cp.positions)


# ---------------------------------------------------------------------- Kath18
@settings(max_examples=80, deadline=None)
@given(
    losses=st.lists(st.floats(0, 1e6, allow_nan=False, width=32), min_size=1, max_size=120),
    selectivity=st.floats(0.05, 1.0),
    tau=st.floats(0, 10),
    seed=st.integers(0, 2**32 - 1),
)
def test_kath18_choices_are_valid_monotone_and_survive_a_round_trip(losses, selectivity, tau, seed):
    losses = np.array(losses, dtype=np.float64)
    n = len(losses)
    k = Kath18(selectivity)
    k.tau = tau
    restored = Kath18(selectivity)
    restored.load_state_dict(json.loads(json.dumps(k.state_dict())))
    c = k.choose(losses, None, np.random.default_rng(seed), n)
    d = restored.choose(losses, None, np.random.default_rng(seed), n)
    for a, b in ((c.positions, d.positions), (c.probabilities, d.probabilities)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c.weights, d.weights)
    assert k.state_dict() == restored.state_dict()

    b = max(1, round(n * selectivity))
    assert len(c.positions) == min(b, n)
    assert ((c.positions >= 0) & (c.positions < n)).all()
    assert ((c.probabilities >= 0) & (c.probabilities <= 1)).all()
    assert (np.isfinite(c.weights) & (c.weights > 0)).all()
    if k.importance_sampling and losses.sum() > 0:
        order = np.argsort(losses, kind="stable")
        assert (np.diff(c.probabilities[order]) >= -1e-12).all()  # monotone in the loss
        assert (losses[c.positions] > 0).all()  # a zero loss is never drawn


# ---------------------------------------------------------------------- the store
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), size=st.integers(1, 40), memmap=st.booleans())
def test_store_matches_a_reference_and_survives_a_round_trip(data, size, memmap):
    index = st.integers(0, size - 1)
    loss = st.floats(allow_nan=True, allow_infinity=True, width=32)
    ref_loss: dict[int, float] = {}
    ref_epoch: dict[int, int] = {}
    ref_count = np.zeros(size, dtype=np.int64)
    with tempfile.TemporaryDirectory() as folder:
        store = ExampleStore(size, path=folder if memmap else None)
        for _ in range(data.draw(st.integers(0, 8))):
            idx = data.draw(st.lists(index, max_size=20))
            if data.draw(st.booleans()):
                values = data.draw(st.lists(loss, min_size=len(idx), max_size=len(idx)))
                epoch = data.draw(st.integers(0, 2**30))
                store.record(np.array(idx, dtype=np.int64), np.array(values), epoch=epoch)
                for i, v in zip(idx, values):
                    if np.isfinite(v):  # non-finite: the example keeps what it had
                        ref_loss[i], ref_epoch[i] = float(np.float32(v)), epoch
            else:
                store.count_selected(np.array(idx, dtype=np.int64))
                np.add.at(ref_count, idx, 1)
        everything = np.arange(size)
        losses, epochs = store.lookup(everything)
        for i in range(size):
            if i in ref_loss:
                assert losses[i] == ref_loss[i] and epochs[i] == ref_epoch[i]
            else:
                assert np.isnan(losses[i]) and epochs[i] == -1
        np.testing.assert_array_equal(store.selected, ref_count)

        state = through_torch_save(store.state_dict())
        again = ExampleStore(size, path=folder if memmap else None)
        again.load_state_dict(state)
        for a, b in zip(again.lookup(everything), (losses, epochs)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(again.selected, ref_count)


# ---------------------------------------------------------------------- the whole loader
POLICIES = {
    "sb": lambda: SelectiveBackprop(1 / 3, history=32),
    "stale-sb": lambda: SelectiveBackprop(1 / 3, history=32, staleness=2),
    "kath18": lambda: Kath18(0.5, tau_threshold=1.02),
    "random": lambda: RandomBackprop(0.5),
    "phased": lambda: Phased(SelectiveBackprop(0.5, history=32), warmup_epochs=1),
}


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    n=st.integers(5, 90),
    bs=st.integers(2, 12),
    source_bs=st.integers(2, 40),
    remainder=st.sampled_from(["carry", "short", "drop"]),
    cuts=st.lists(st.integers(0, 40), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_resuming_anywhere_replays_the_uninterrupted_run(
    one_torch_thread, policy, n, bs, source_bs, remainder, cuts, seed
):
    """Train 3 epochs; checkpoint after batch k (counted over the whole run) for each k in
    ``cuts``, rebuild everything and restore: the batches are the same, bit for bit."""

    def build():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, N_CLASSES))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        dl = DataLoader(
            EncodedDataset(n),
            batch_size=source_bs,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
        loader = SelectiveLoader(
            dl, model, policy=POLICIES[policy](), batch_size=bs, seed=seed, remainder=remainder
        )
        return model, opt, loader

    def train(model, opt, batch):
        x, y = batch
        out = nn.functional.cross_entropy(model(x / 100), y, reduction="none") * batch.weights
        opt.zero_grad()
        out.mean().backward()
        opt.step()
        return batch.indices.tolist(), batch.losses.numpy().tobytes(), x.numpy().tobytes()

    def run(cut_at):
        model, opt, loader = build()
        got, step = [], 0
        for _ in range(3):
            it = iter(loader)
            while True:
                if step in cut_at:
                    cut_at = cut_at - {step}
                    state = {"l": loader.state_dict(), "m": model.state_dict()}
                    state = through_torch_save({**state, "o": opt.state_dict()})
                    del it
                    model, opt, loader = build()
                    model.load_state_dict(state["m"])
                    opt.load_state_dict(state["o"])
                    loader.load_state_dict(state["l"])
                    it = iter(loader)
                batch = next(it, None)
                if batch is None:
                    break
                got.append(train(model, opt, batch))
                step += 1
        return got

    assert run(set(cuts)) == run(set())
