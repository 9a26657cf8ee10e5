"""``decisions="device"`` (run here with CPU tensors): the tensor window ranks exactly as the numba
window, the same uniforms give the same selections, and through the loader the kept rate
matches the host path's, a seed is deterministic and a resume is exact."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sbloader
from sbloader import LossWindow, SelectiveBackprop
from sbloader.device_decisions import DecisionGenerator, DeviceWindow


def stream(rng: np.random.Generator, n: int) -> np.ndarray:
    """Losses with many ties (rounded), some NaN and infinities."""
    x = np.round(rng.exponential(size=n), 1)
    special = rng.random(n)
    x[special < 0.03] = np.nan
    x[(special >= 0.03) & (special < 0.05)] = np.inf
    return x


@pytest.mark.parametrize("size", [1, 7, 64, 1024])
@pytest.mark.parametrize("beta", [0.0, 1.0, 2.0, 3.5])
def test_same_probabilities_and_selections_as_the_host_window(size, beta):
    """Same losses, same uniforms: the device window gives the host kernel's probabilities and
    kept positions, and holds the same values afterwards (batches larger than the window too).

    The CDF counts are exact (beta 0 and 1: identical probabilities); ``CDF ** beta`` may differ
    in the last bit, since torch's vectorised pow rounds differently from libm's."""
    rng = np.random.default_rng(size + int(beta * 10))
    host, dev = LossWindow(size), DeviceWindow(size)
    for n in (5, 300, 2 * size + 3, 1, 2500):
        losses, u = stream(rng, n), rng.random(n)
        p, positions, _, _ = host.push_rank_and_draw(losses, u, beta, reweight=False)
        c = dev.push_rank_and_draw(torch.from_numpy(losses), torch.from_numpy(u), beta)
        finite = np.isfinite(losses)
        if beta in (0.0, 1.0):
            np.testing.assert_array_equal(c.probabilities.numpy()[finite], p[finite])
        np.testing.assert_allclose(c.probabilities.numpy()[finite], p[finite], rtol=1e-15)
        assert (c.probabilities.numpy()[~finite] == 0.0).all()  # nonfinite="skip"
        np.testing.assert_array_equal(c.positions.numpy(), positions)
        assert c.nonfinite == int((~finite).sum())
        np.testing.assert_array_equal(dev.values().numpy(), host.values())
        np.testing.assert_array_equal(dev.sorted_values().numpy(), host.sorted_values())


def test_nonfinite_select_reweight_and_raise():
    w = DeviceWindow(8)
    losses = torch.tensor([1.0, float("nan"), 3.0, float("inf"), 2.0])
    c = w.push_rank_and_draw(losses, torch.full((5,), 0.6), 1.0, reweight=True, nonfinite="select")
    assert c.probabilities.tolist() == [1.0, 1.0, 1.0, 1.0, 2 / 3]
    assert c.positions.tolist() == [0, 1, 2, 3, 4]
    assert c.weights.tolist() == [1.0, 1.0, 1.0, 1.0, 1.5]
    assert w.values().tolist() == [1.0, 3.0, 2.0]  # non-finite losses never enter
    with pytest.raises(FloatingPointError, match="1 selection losses are not finite"):
        w.push_rank_and_draw(
            torch.tensor([4.0, float("nan")]), torch.zeros(2), 1.0, nonfinite="raise"
        )
    assert w.values().tolist() == [1.0, 3.0, 2.0]  # unchanged


def test_generator_state_round_trips_before_and_after_first_use():
    cpu = torch.device("cpu")
    g = DecisionGenerator(seed=5, rank=0)
    fresh = g.state_dict()
    first = torch.rand(4, generator=g.get(cpu))
    g2 = DecisionGenerator(seed=5, rank=0)
    g2.load_state_dict(fresh)
    assert torch.equal(torch.rand(4, generator=g2.get(cpu)), first)
    saved = g.state_dict()
    nxt = torch.rand(4, generator=g.get(cpu))
    g2.load_state_dict(saved)
    assert torch.equal(torch.rand(4, generator=g2.get(cpu)), nxt)
    other = DecisionGenerator(seed=6, rank=0)
    assert not torch.equal(torch.rand(4, generator=other.get(cpu)), first)
    with pytest.raises(ValueError, match="another seed or rank"):
        other.load_state_dict(saved)


def test_reweighted_kept_candidates_weigh_one_over_their_own_probability():
    """Kept positions that are not the first ones: each weight is 1 / P of its own candidate."""
    window = DeviceWindow(8)
    window.push_rank_and_draw(torch.tensor([10.0, 10.0]), torch.ones(2, dtype=torch.float64), 1.0)
    losses = torch.tensor([1.0, 20.0, 5.0, 30.0])  # CDFs 1/3, 1, 2/5, 1 as pushed in turn
    uniforms = torch.tensor([0.5, 0.0, 0.1, 0.9], dtype=torch.float64)
    c = window.push_rank_and_draw(losses, uniforms, beta=1.0, reweight=True)
    assert c.positions.tolist() == [1, 2, 3]
    torch.testing.assert_close(c.probabilities, torch.tensor([1 / 3, 1.0, 0.4, 1.0]).double())
    torch.testing.assert_close(c.weights, torch.tensor([1.0, 2.5, 1.0]).double())


def test_a_window_state_with_more_values_than_its_size_keeps_the_most_recent():
    window = DeviceWindow(4)
    window.load_state_dict({"version": 1, "size": 4, "values": torch.arange(6.0)})
    assert len(window) == 4 and window.values().tolist() == [2.0, 3.0, 4.0, 5.0]
    assert window.sorted_values().tolist() == [2.0, 3.0, 4.0, 5.0]


def test_a_generator_state_of_another_device_type_is_refused_with_the_fix():
    """CPU and CUDA generators keep different states (a Mersenne Twister's 5056 bytes, a
    Philox seed and offset's 16): a state saved by a run that decided on a GPU cannot continue
    its draws on the CPU (nor the other way), and says so instead of failing in set_state."""
    cpu = torch.device("cpu")
    g = DecisionGenerator(seed=5, rank=0)
    cuda_state = torch.zeros(16, dtype=torch.uint8)  # the size of a CUDA generator's state
    g.load_state_dict({"seed": g.seed, "state": cuda_state})
    with pytest.raises(ValueError, match=r"decisions='device'.*another kind of device.*on cpu"):
        g.get(cpu)
    used = DecisionGenerator(seed=5, rank=0)  # its CPU generator made already
    torch.rand(2, generator=used.get(cpu))
    twin = DecisionGenerator(seed=5, rank=0)
    twin.load_state_dict(used.state_dict())
    with pytest.raises(ValueError, match="resume on the kind of device the run was saved on"):
        used.load_state_dict({"seed": used.seed, "state": cuda_state})
    # the refused state changed nothing
    assert torch.equal(
        torch.rand(4, generator=used.get(cpu)), torch.rand(4, generator=twin.get(cpu))
    )


# ---------------------------------------------------------------------- through the loader
X = torch.randn(3000, 12, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()


def make_loader(decisions="device", seed=0, data=None, **kw):
    source = DataLoader(
        TensorDataset(X, Y) if data is None else data,
        batch_size=200,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    model = nn.Linear(12, 3)
    with torch.no_grad():  # fixed weights (no global RNG), losses that vary with the input
        model.weight.zero_()
        model.bias.zero_()
        model.weight[0, 0] = 1.0
    return sbloader.SelectiveLoader(
        source,
        model,
        policy=SelectiveBackprop(kw.pop("selectivity", 1 / 3), history=256),
        batch_size=64,
        seed=seed,
        decisions=decisions,
        **kw,
    )


def epoch_batches(loader):
    return [(b[0].clone(), b.indices.clone(), b.probabilities.clone()) for b in loader]


def test_kept_rate_matches_the_host_path():
    """Different draws, same distribution: over three epochs both keep about 1/3, within the
    binomial spread of each other."""
    rates = {}
    for decisions in ("host", "device"):
        loader = make_loader(decisions)
        for _ in range(3):
            epoch_batches(loader)
        total = loader.stats.total
        rates[decisions] = total.examples_selected / total.examples_seen
    assert abs(rates["device"] - rates["host"]) < 0.03, rates
    assert abs(rates["device"] - 1 / 3) < 0.03, rates


def test_deterministic_per_seed_and_rows_consistent():
    a, b, c = make_loader(seed=4), make_loader(seed=4), make_loader(seed=5)
    ea, eb, ec = epoch_batches(a), epoch_batches(b), epoch_batches(c)
    assert len(ea) == len(eb)
    for (xa, ia, pa), (xb, ib, pb) in zip(ea, eb):
        assert torch.equal(xa, xb) and torch.equal(ia, ib) and torch.equal(pa, pb)
    assert [i.tolist() for _, i, _ in ea] != [i.tolist() for _, i, _ in ec]
    for x, idx, p in ea:  # each row is its dataset example, kept with P in (0, 1]
        assert torch.equal(x, X[idx]) and bool(((p > 0) & (p <= 1)).all())


def test_nonfinite_losses_are_counted_and_never_yielded_as_on_the_host():
    """nonfinite="skip" (the default): a candidate whose selection loss is not finite is never
    yielded, and the epoch's stats count it, on the device as on the host."""
    bad = torch.zeros(len(X), dtype=torch.bool)
    bad[::50] = True
    inputs = X.clone()
    inputs[bad] = float("nan")
    for decisions in ("host", "device"):
        loader = make_loader(decisions, data=TensorDataset(inputs, Y))
        yielded = torch.cat([b.indices for b in loader])
        assert not bad[yielded].any() and len(yielded) > 0
        e = loader.stats.current
        assert (e.nonfinite, e.examples_seen) == (int(bad.sum()), len(X)), decisions


def test_resume_mid_epoch_is_exact():
    whole = make_loader(seed=2)
    epoch_batches(whole)
    expected = epoch_batches(whole)  # the second epoch, uninterrupted

    first = make_loader(seed=2)
    epoch_batches(first)
    it = iter(first)
    got = [next(it) for _ in range(3)]
    got = [(b[0].clone(), b.indices.clone(), b.probabilities.clone()) for b in got]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make_loader(seed=2)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    got += epoch_batches(resumed)
    assert len(got) == len(expected)
    for (xa, ia, pa), (xb, ib, pb) in zip(got, expected):
        assert torch.equal(ia, ib) and torch.equal(xa, xb) and torch.equal(pa, pb)


def test_a_generator_state_of_another_device_type_is_refused_at_load_state_dict():
    """A loader state whose device generator was saved on another kind of device (here a CUDA
    generator's 16 bytes, loaded for the CPU) loaded without complaint and was refused only at
    the epoch's first decision, after the loader had taken the saved run's position. It is
    refused by load_state_dict now, naming decisions='device' and the fix, and the loader is
    left as it was."""
    saved = make_loader(seed=2)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    del it
    state["device_rng"]["state"] = torch.zeros(16, dtype=torch.uint8)
    fresh = make_loader(seed=2)
    before = fresh.state_dict()
    with pytest.raises(ValueError, match=r"decisions='device'.*another kind of device.*on cpu"):
        fresh.load_state_dict(state)
    after = fresh.state_dict()
    assert after["device_rng"]["state"] is None and after["position"] == before["position"] == 0
    assert [i.tolist() for _, i, _ in epoch_batches(fresh)] == [
        i.tolist() for _, i, _ in epoch_batches(make_loader(seed=2))
    ]


def test_configurations_it_cannot_run_are_refused():
    with pytest.raises(ValueError, match="decisions should be one of"):
        make_loader("gpu")
    with pytest.raises(ValueError, match="use SelectiveBackprop with staleness=1"):
        sbloader.SelectiveLoader(
            DataLoader(TensorDataset(X, Y), batch_size=100),
            nn.Linear(12, 3),
            policy=SelectiveBackprop(staleness=2),
            decisions="device",
        )
    with pytest.raises(ValueError, match="keep_logits=True"):
        make_loader(keep_logits=True)
    with pytest.raises(ValueError, match="decisions"):  # a host state is not a device run's
        make_loader("device").load_state_dict(make_loader("host").state_dict())
