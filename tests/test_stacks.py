"""What a user meets in the first hour of dropping sbloader into a training stack: the usual log
lines, mistakes that must fail before any training, and selection results that survive the
frameworks' device transfer (with the real Lightning and Accelerate functions)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import EncodedDataset, IndexLoss, bn_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sbloader import Phased, RandomBackprop, SelectiveBackprop, SelectiveLoader


def warmup_policy():
    return Phased(SelectiveBackprop(0.5), warmup_epochs=1, warmup_policy=RandomBackprop(0.5))


# ---------------------------------------------------------------------- the usual log lines
def test_dataset_and_sampler_pass_through_to_the_source():
    dl = DataLoader(EncodedDataset(90), batch_size=30, shuffle=True)
    loader = SelectiveLoader(dl, IndexLoss(), batch_size=10)
    assert loader.dataset is dl.dataset and len(loader.dataset) == 90
    assert loader.sampler is dl.sampler
    batches = [(torch.zeros(2, 6), torch.zeros(2, dtype=torch.long))]
    plain = SelectiveLoader(batches, IndexLoss(), batch_size=2)
    assert plain.dataset is None and plain.sampler is None


# ---------------------------------------------------------------------- fail at once
def test_a_loss_without_one_value_per_example_fails_before_the_warmup_trains():
    """F.cross_entropy (reduction='mean' by default) has no ``reduction`` attribute to check at
    construction; under a warm-up without selection passes it used to fail only after the whole
    warm-up epoch. Now the first source batch is checked."""
    loader = SelectiveLoader(
        DataLoader(EncodedDataset(90), batch_size=30),
        IndexLoss(),
        loss_fn=F.cross_entropy,
        policy=warmup_policy(),
        batch_size=10,
    )
    with pytest.raises(ValueError, match="reduction='none'"):
        next(iter(loader))
    assert loader.stats.current.examples_yielded == 0


def test_a_loss_class_and_flattened_per_token_losses_are_named_with_their_fix():
    """``loss_fn=nn.CrossEntropyLoss`` (the class, parentheses forgotten) is refused when the
    loader is built; losses already unreduced but flattened, several per example (per-token
    losses of ``(B * T, C)`` logits), are not told to pass ``reduction='none'``."""
    dl = DataLoader(EncodedDataset(90), batch_size=30)
    with pytest.raises(TypeError, match=r"got the class CrossEntropyLoss; create it, e\.g\. "):
        SelectiveLoader(dl, IndexLoss(), loss_fn=nn.CrossEntropyLoss, batch_size=10)

    def per_token(out, y):  # 4 "tokens" per example, flattened
        return F.cross_entropy(out, y, reduction="none").repeat_interleave(4)

    loader = SelectiveLoader(
        dl, IndexLoss(), loss_fn=per_token, policy=warmup_policy(), batch_size=10
    )
    with pytest.raises(ValueError, match=r"4 values per example, flattened") as info:
        next(iter(loader))
    assert "pass reduction='none'" not in str(info.value)


def test_an_unselectable_model_fails_before_the_warmup_trains():
    class TupleOut(IndexLoss):
        def forward(self, x):
            return super().forward(x), x.sum(1)

    def loss_fn(out, y):
        return F.cross_entropy(out[0], y, reduction="none")

    loader = SelectiveLoader(
        DataLoader(EncodedDataset(90), batch_size=30),
        TupleOut(),
        loss_fn=loss_fn,
        policy=warmup_policy(),
        batch_size=10,
        keep_logits=True,
    )
    with pytest.raises(ValueError, match="keep_logits=False"):
        next(iter(loader))


def test_the_first_batch_check_leaves_no_trace():
    """The warm-up epoch yields exactly what Random-Backprop alone yields (no generator draw,
    no stats), and BatchNorm's buffers and the model's mode are untouched."""

    def run(policy, model):
        loader = SelectiveLoader(
            DataLoader(EncodedDataset(90), batch_size=30), model, policy=policy, batch_size=10
        )
        return [b.indices.tolist() for b in loader], loader.stats.current

    torch.manual_seed(0)
    model = bn_model().train()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    with_check, stats = run(warmup_policy(), model)
    alone, _ = run(RandomBackprop(0.5), bn_model())
    assert with_check == alone and stats.selection_forwards == 0
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, buffers[k]), k


def test_no_check_for_policies_that_never_select():
    calls = []

    class Counting(IndexLoss):
        def forward(self, x):
            calls.append(len(x))
            return super().forward(x)

    loader = SelectiveLoader(
        DataLoader(EncodedDataset(60), batch_size=30),
        Counting(),
        policy=RandomBackprop(0.5),
        batch_size=10,
    )
    list(loader)
    assert calls == []


# ---------------------------------------------------------------------- metadata in the batch
def dict_source(n=60):
    class Dicts(EncodedDataset):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return {"input": x, "target": y}

    return DataLoader(Dicts(n), batch_size=30)


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_metadata_key_carries_the_selection_results_inside_the_batch(kind):
    source = dict_source() if kind == "dict" else DataLoader(EncodedDataset(60), batch_size=30)
    loader = SelectiveLoader(
        source, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=10, metadata_key="sb"
    )
    for batch in loader:
        meta = batch["sb"] if kind == "dict" else batch[-1]
        if kind == "tuple":
            _inputs, _targets, meta = batch  # one more element: the results
        assert torch.equal(meta["indices"], batch.indices)
        for name in ("losses", "probabilities", "weights"):
            assert torch.equal(meta[name], getattr(batch, name))
        assert (meta["indices"] % 6).tolist() == meta["indices"].remainder(6).tolist()


@pytest.mark.parametrize(
    "policy", [SelectiveBackprop(0.5), Phased(SelectiveBackprop(0.5), warmup_epochs=1)]
)
def test_metadata_of_a_source_without_indices_carries_none_for_them(policy):
    """A source without dataset indices (a list of batches, no index_key): the results inside
    the batch say indices None, as batch.indices does, not the rows' positions."""
    ds = EncodedDataset(60)
    batches = [
        tuple(torch.stack([ds[i][k] for i in range(s, s + 20)]) for k in (0, 1))
        for s in range(0, 60, 20)
    ]
    loader = SelectiveLoader(batches, IndexLoss(), policy=policy, batch_size=10, metadata_key="sb")
    for _ in range(2):  # (Phased: a passthrough epoch, then a selective one)
        for batch in loader:
            assert batch.indices is None and batch[-1]["indices"] is None
            assert torch.allclose(batch[-1]["losses"], batch.losses, equal_nan=True)


def test_metadata_key_must_not_shadow_a_field():
    loader = SelectiveLoader(dict_source(), IndexLoss(), batch_size=10, metadata_key="target")
    with pytest.raises(ValueError, match="metadata_key='target' is already a key"):
        next(iter(loader))


def rebuilt_by_lightning(batch):
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(batch, torch.device("cpu"))


def rebuilt_by_accelerate(batch):
    from accelerate.utils import send_to_device

    return send_to_device(batch, torch.device("cpu"))


@pytest.mark.parametrize("transfer", [rebuilt_by_lightning, rebuilt_by_accelerate])
@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_the_results_survive_the_frameworks_device_transfer(transfer, kind):
    """Lightning and Accelerate rebuild tuples and dicts when they move a batch, so attributes
    are lost (the original failure: 'SelectedList' object has no attribute 'weights'); the
    results carried under metadata_key arrive in the training step."""
    source = dict_source() if kind == "dict" else DataLoader(EncodedDataset(60), batch_size=30)
    loader = SelectiveLoader(
        source, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=10, metadata_key="sb"
    )
    batch = next(iter(loader))
    moved = transfer(batch)
    assert not hasattr(moved, "weights")  # the attributes do not survive, as documented
    meta = moved["sb"] if kind == "dict" else moved[-1]
    assert torch.equal(meta["indices"], batch.indices)
    assert torch.equal(meta["weights"], batch.weights)


def test_metadata_with_a_tensor_dataset_and_logits():
    x, y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    loader = SelectiveLoader(
        DataLoader(TensorDataset(x, y), batch_size=20),
        nn.Linear(3, 2),
        policy=SelectiveBackprop(0.5),
        batch_size=5,
        keep_logits=True,
        metadata_key="sb",
    )
    for inputs, _, meta in loader:
        assert meta["logits"].shape == (5, 2)
        assert torch.equal(inputs, x[meta["indices"]])
