"""``keep_logits=True``: batches carry the selection pass's model outputs, never recomputed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sbloader
from sbloader import Phased, RandomBackprop, SelectiveBackprop, SelectiveLoader

N, D, C = 200, 6, 4


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, C))


def _loader(model: nn.Module, policy: sbloader.Policy, **kw) -> SelectiveLoader:
    dl = DataLoader(
        _data(), batch_size=40, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    # float32 selections: the kept logits are compared with the model's own float32 outputs
    kw.setdefault("autocast", None)
    return SelectiveLoader(dl, model, policy=policy, batch_size=16, seed=3, keep_logits=True, **kw)


def _rows_match_the_model(batch, model: nn.Module) -> None:
    """Every row is either the model's output on that example (a selection pass scored it) or
    NaN (it was chosen without one), and the losses agree with the logits."""
    with torch.no_grad():
        expected = model(batch[0])
    scored = ~torch.isnan(batch.losses)
    assert torch.equal(torch.isnan(batch.logits).all(1), ~scored)
    assert not torch.isnan(batch.logits[scored]).any()
    torch.testing.assert_close(batch.logits[scored], expected[scored])
    ce = nn.functional.cross_entropy(batch.logits[scored], batch[1][scored], reduction="none")
    torch.testing.assert_close(ce, batch.losses[scored])


def test_batches_carry_the_selection_logits_of_exactly_their_examples():
    model = _model()
    batches = list(_loader(model, SelectiveBackprop(0.5)))
    assert batches
    for b in batches:
        assert b.logits.shape == (16, C) and b.logits.dtype == torch.float32
        assert not torch.isnan(b.losses).any()
        _rows_match_the_model(b, model)


def test_without_keep_logits_there_are_none():
    dl = DataLoader(_data(), batch_size=40)
    for b in SelectiveLoader(dl, _model(), policy=SelectiveBackprop(0.5), batch_size=16):
        assert b.logits is None


def test_warmup_and_stale_epochs_give_nan_rows_of_the_right_shape():
    """Warm-up (no selection pass, shape unknown yet): None; the remainder carried into the
    first SB epoch is widened to NaN rows; stale epochs' rows are NaN, carried fresh rows not."""
    model = _model()
    policy = Phased(
        SelectiveBackprop(0.5, staleness=2), warmup_epochs=1, warmup_policy=RandomBackprop(0.5)
    )
    loader = _loader(model, policy)
    warmup = list(loader)
    assert warmup and all(b.logits is None for b in warmup)
    assert loader.pending_examples > 0  # a remainder is carried into the first SB epoch
    fresh = list(loader)
    assert torch.isnan(fresh[0].losses).any()  # the carried warm-up rows come first
    stale = list(loader)
    assert loader.stats.epochs[2].selection_forwards == 0
    assert any(torch.isnan(b.logits).all() for b in stale)
    for b in fresh + stale:
        assert b.logits.shape == (len(b[0]), C)
        _rows_match_the_model(b, model)


def test_a_resumed_loader_keeps_the_logits_shape():
    """Resumed after a fresh epoch with nothing pending, a loader's stale epoch still yields NaN
    rows of the right shape, exactly as the uninterrupted one does."""
    model = _model()
    first = _loader(model, SelectiveBackprop(0.5, staleness=2), remainder="drop")
    list(first)
    state = first.state_dict()
    assert state["pending"]["count"] == 0 and state["scorer"]["logits_shape"] == [C]
    rest = list(first)  # a stale epoch: no selection pass
    assert first.stats.current.selection_forwards == 0
    resumed = _loader(model, SelectiveBackprop(0.5, staleness=2), remainder="drop")
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(rest) > 0
    for a, b in zip(rest, again):
        assert torch.equal(a.indices, b.indices)
        assert b.logits is not None and b.logits.shape == (16, C)
        assert torch.isnan(b.logits).all()
        torch.testing.assert_close(a.logits, b.logits, equal_nan=True)


def test_keep_logits_must_be_a_bool():
    with pytest.raises(TypeError, match="keep_logits should be True or False, but got"):
        SelectiveLoader(DataLoader(_data()), _model(), keep_logits="yes")


def test_with_a_frozen_prefix_the_logits_are_the_heads_on_the_features():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(D, 8), nn.ReLU()).requires_grad_(False)
    head = nn.Linear(8, C)
    dl = DataLoader(_data(), batch_size=40)
    loader = SelectiveLoader(
        dl,
        head,
        policy=SelectiveBackprop(0.5),
        batch_size=16,
        frozen_prefix=backbone,
        keep_logits=True,
        autocast=None,  # compared with float32 outputs
    )
    batches = list(loader)
    assert batches
    for b in batches:
        with torch.no_grad():
            torch.testing.assert_close(b.features, backbone(b[0]))
            torch.testing.assert_close(b.logits, head(b.features))


class _TupleModel(nn.Module):
    """Returns (logits, auxiliary); its loss function takes the tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, C)

    def forward(self, x):
        return self.fc(x), x.sum(1)


def test_a_model_without_one_output_row_per_example_is_refused_with_the_fix():
    def loss_fn(out, y):
        return nn.functional.cross_entropy(out[0], y, reduction="none")

    model = _TupleModel().train()
    dl = DataLoader(_data(), batch_size=40)
    plain = SelectiveLoader(dl, model, loss_fn=loss_fn, policy=SelectiveBackprop(0.5))
    assert sum(len(b[0]) for b in plain) > 0  # fine without keep_logits
    loader = SelectiveLoader(
        dl, model, loss_fn=loss_fn, policy=SelectiveBackprop(0.5), keep_logits=True
    )
    with pytest.raises(
        ValueError, match=r"the model returned a tuple of 2; pass output= .* pass keep_logits=False"
    ):
        next(iter(loader))
    assert model.training  # the selection pass restored the mode
