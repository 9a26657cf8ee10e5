"""SelectiveLoader end to end on synthetic data whose inputs encode their dataset index."""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings

import numpy as np
import pytest
import torch
from conftest import N_CLASSES, EncodedDataset, IndexLoss, bn_model, run_python
from torch import nn
from torch.utils.data import DataLoader

import sbloader
from sbloader import Phased, RandomBackprop, SelectiveBackprop, SelectiveLoader, Traditional
from sbloader.datasets import ArrayDataset
from sbloader.selection import eval_mode


def make_loader(
    ds=None,
    *,
    bs=20,
    source_bs=None,
    shuffle=True,
    workers=0,
    seed=0,
    gen_seed=0,
    policy=None,
    model=None,
    **kw,
):
    ds = ds or EncodedDataset()
    dl = DataLoader(
        ds,
        batch_size=source_bs or bs,
        shuffle=shuffle,
        num_workers=workers,
        generator=torch.Generator().manual_seed(gen_seed),
    )
    return SelectiveLoader(
        dl,
        model or IndexLoss(),
        policy=policy or SelectiveBackprop(0.5),
        batch_size=bs,
        seed=seed,
        **kw,
    )


def check_pairing(batch):
    """Inputs, targets and indices of every yielded example belong together."""
    x, y = batch
    idx = batch.indices
    assert torch.equal(x[:, 0].long(), idx)
    assert (x == x[:, :1]).all()
    assert torch.equal(y, idx % N_CLASSES)


# ------------------------------------------------------------------ structure and pairing
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("policy", [Traditional(), SelectiveBackprop(1 / 3), RandomBackprop(0.5)])
def test_every_pair_comes_from_the_dataset_with_shuffling_and_workers(workers, policy):
    loader = make_loader(workers=workers, policy=policy, source_bs=40, bs=20)
    seen = 0
    for _ in range(2):
        for batch in loader:
            # default_collate turns tuple samples into list batches: the structure is kept.
            assert isinstance(batch, list) and isinstance(batch, sbloader.SelectedBatch)
            assert len(batch) == 2
            check_pairing(batch)
            seen += len(batch[0])
    assert seen > 0


def test_traditional_yields_exactly_the_sources_examples_in_order(dataset):
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    plain = DataLoader(dataset, batch_size=32, shuffle=True, generator=g1)
    wrapped = SelectiveLoader(
        DataLoader(dataset, batch_size=32, shuffle=True, generator=g2),
        IndexLoss(),
        policy=Traditional(),
    )
    assert len(wrapped) == len(plain)
    for _ in range(2):
        ours = list(wrapped)
        theirs = list(plain)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert (a.weights == 1).all() and (a.probabilities == 1).all()
            assert torch.isnan(a.losses).all()  # no selection pass was made
    assert wrapped.stats.total.selection_forwards == 0


def test_batches_are_full_and_carry_the_selection_results():
    model = IndexLoss()
    loader = make_loader(model=model, bs=16, source_bs=48, policy=SelectiveBackprop(1 / 3))
    for batch in loader:
        assert batch[0].shape[0] == 16
        assert batch.indices.dtype == torch.int64 and batch.indices.shape == (16,)
        # The carried losses are exactly the selection pass's losses for these examples.
        expected = nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")
        torch.testing.assert_close(batch.losses, expected)
        assert ((batch.probabilities > 0) & (batch.probabilities <= 1)).all()
        assert (batch.weights == 1).all()


def test_selection_results_are_never_recomputed():
    model = IndexLoss()
    loader = make_loader(model=model, bs=10, source_bs=50)
    list(loader)
    # One model call per source batch (selection pass), none per yielded batch.
    assert model.calls == loader.stats.total.selection_calls == 4


def test_list_and_dict_batches_keep_their_structure():
    ds = EncodedDataset(60)

    def as_dict(samples):
        x, y = torch.utils.data.default_collate(samples)
        return {"image": x, "label": y, "name": [f"ex{int(v)}" for v in x[:, 0]]}

    dl = DataLoader(
        ds,
        batch_size=30,
        shuffle=True,
        collate_fn=as_dict,
        generator=torch.Generator().manual_seed(0),
    )
    loader = SelectiveLoader(
        dl,
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=10,
        input_key="image",
        target_key="label",
    )
    for batch in loader:
        assert isinstance(batch, dict) and set(batch) == {"image", "label", "name"}
        assert batch["name"] == [f"ex{int(i)}" for i in batch.indices]
        assert torch.equal(batch["image"][:, 0].long(), batch.indices)

    dl_list = DataLoader(
        ds, batch_size=30, collate_fn=lambda s: list(torch.utils.data.default_collate(s))
    )
    batch = next(iter(SelectiveLoader(dl_list, IndexLoss(), policy=Traditional())))
    assert isinstance(batch, list) and isinstance(batch, sbloader.SelectedBatch)


@pytest.mark.parametrize("policy", [SelectiveBackprop(0.5), Traditional()], ids=["sb", "trad"])
def test_numpy_fields_torch_cannot_hold_or_reversed_are_selected_with_their_examples(policy):
    """A collate function may give numpy arrays of file names (strings), of objects, or a
    reversed view: torch.from_numpy refuses all three, and the first source batch raised torch's
    error naming no field. The first two are selected as lists, the third as a tensor, each
    entry with its example, and a mid-epoch state of them resumes."""
    ds = EncodedDataset(60)

    def collate(samples):
        x, y = torch.utils.data.default_collate(samples)
        idx = x[:, 0].long().numpy()
        objects = np.empty(len(idx), dtype=object)
        objects[:] = [{"i": int(i)} for i in idx]
        # idx in order, as a view with a negative stride (of a reversed copy)
        reversed_view = np.ascontiguousarray(idx[::-1].astype(np.float64))[::-1]
        assert reversed_view.strides[0] < 0
        return {
            "image": x,
            "label": y,
            "name": np.array([f"ex{i}.png" for i in idx]),
            "meta": objects,
            "double": reversed_view,
        }

    def make():
        dl = DataLoader(
            ds, batch_size=30, shuffle=True, collate_fn=collate,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        return SelectiveLoader(
            dl,
            IndexLoss(),
            policy=policy,
            batch_size=10,
            input_key="image",
            target_key="label",
            forward=lambda model, batch: model(batch["image"]),  # "double" is no model input
        )

    loader = make()
    batches = [b for _ in range(2) for b in loader]
    assert batches
    for batch in batches:
        idx = batch.indices.tolist()
        assert batch["name"] == [f"ex{i}.png" for i in idx]
        assert batch["meta"] == [{"i": i} for i in idx]
        assert torch.equal(batch["double"], batch.indices.double())
        assert torch.equal(batch["image"][:, 0].long(), batch.indices)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = [b["name"] for b in it]
    resumed = make()
    resumed.load_state_dict(state)
    assert [b["name"] for b in resumed] == rest


@pytest.mark.parametrize("name", ["uint16", "uint32", "uint64"])
def test_unsigned_fields_wider_than_a_byte_are_selected(name):
    """torch has no 1-d index_select for uint16/32/64 (token counts or ids kept as numpy
    uint16): selecting the kept rows raised NotImplementedError on the first batch."""
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    ds = EncodedDataset(60)

    def collate(samples):
        x, y = torch.utils.data.default_collate(samples)
        return x, y, x[:, 0].long().to(dtype), x[:, :2].long().to(dtype)

    dl = DataLoader(ds, batch_size=20, collate_fn=collate)
    loader = SelectiveLoader(dl, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=8)
    batches = [b for _ in range(2) for b in loader]
    assert batches
    for batch in batches:
        assert batch[2].dtype == dtype and torch.equal(batch[2].long(), batch.indices)
        assert torch.equal(batch[3].long(), batch.indices[:, None].expand(-1, 2))


def test_dict_batch_without_the_key_names_the_fix():
    dl = [{"x": torch.zeros(4, 6), "y": torch.zeros(4, dtype=torch.long)}]
    loader = SelectiveLoader(dl, IndexLoss(), batch_size=2)
    with pytest.raises(KeyError, match="pass input_key="):
        next(iter(loader))


def test_iterable_sources_with_and_without_an_index_field():
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
        batches, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=5, index_key=2
    )
    for b in loader:
        assert torch.equal(b.indices, b[2]) and torch.equal(b[0][:, 0].long(), b.indices)
    no_idx = SelectiveLoader(batches, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=5)
    assert all(b.indices is None for b in no_idx)
    # What needs each example's dataset index is refused as the loader is built, naming it:
    # a per-example store (Stale-SB), or a subset of the dataset.
    for needs, what in (
        ({"policy": SelectiveBackprop(0.5, staleness=2)}, "SelectiveBackprop"),
        ({"subset": [0, 1]}, "subset="),
    ):
        with pytest.raises(ValueError, match=f"^{what}.*needs each example's dataset index, but"):
            SelectiveLoader(batches, IndexLoss(), batch_size=5, **needs)
    with pytest.raises(TypeError, match="re-iterable"):
        SelectiveLoader(iter(batches), IndexLoss(), batch_size=5)


def test_default_policy_given_over_a_source_without_a_store_names_has_store():
    """README: planned_epochs=E is the same as policy=default_policy(epochs=E). Over a source
    without dataset indices (or their count) planned_epochs picks the recipe without a store;
    default_policy(epochs=E) given as policy= builds its Stale-SB's store and is refused, and the
    refusal named only the source's fixes (indices, dataset_size=) and staleness=1, which
    default_policy takes no argument for, never its has_store=False."""
    x, y = torch.randn(64, 5), torch.arange(64) % N_CLASSES
    plain = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    indexed = [(x[i : i + 16], y[i : i + 16], torch.arange(i, i + 16)) for i in range(0, 64, 16)]
    model = nn.Linear(5, N_CLASSES)
    for batches, kwargs in ((plain, {}), (indexed, {"index_key": 2})):
        auto = SelectiveLoader(batches, model, planned_epochs=10, batch_size=8, **kwargs)
        assert auto.policy.policy.staleness == 1
        with pytest.raises(ValueError, match=r"default_policy\(\.\.\., has_store=False\)"):
            SelectiveLoader(
                batches, model, policy=sbloader.default_policy(epochs=10), batch_size=8, **kwargs
            )
        given = sbloader.default_policy(epochs=10, has_store=False)
        assert repr(SelectiveLoader(batches, model, policy=given, batch_size=8, **kwargs).policy)
        assert repr(auto.policy) == repr(sbloader.default_policy(epochs=10, has_store=False))


def test_a_store_over_a_map_style_dataloader_read_with_index_key_names_its_size():
    """A DataLoader over a map-style dataset read with index_key=: the store needs the bound of
    the indices, which the batches hold, and the refusal told the user, who had passed one, to
    "use a DataLoader over a map-style dataset". It names dataset_size=len(dataset) now, and
    with it the run goes; a policy without a store takes the indices as they are."""
    x, y = torch.randn(64, 5), torch.arange(64) % N_CLASSES
    rows = [(x[i], y[i], i) for i in range(64)]
    model = nn.Linear(5, N_CLASSES)
    stale = SelectiveBackprop(0.5, staleness=2)
    with pytest.raises(ValueError, match=r"pass dataset_size=len\(dataset\) \(64\)"):
        SelectiveLoader(DataLoader(rows, batch_size=16), model, policy=stale, index_key=2)
    loader = SelectiveLoader(
        DataLoader(rows, batch_size=16), model, policy=stale, index_key=2, dataset_size=64
    )
    seen = [i for _ in range(2) for batch in loader for i in batch.indices.tolist()]
    assert seen and set(seen) <= set(range(64))
    assert len(loader.policy.store) == 64
    plain = SelectiveLoader(
        DataLoader(rows, batch_size=16), model, policy=SelectiveBackprop(0.5), index_key=2
    )
    assert [i for batch in plain for i in batch.indices.tolist()]


@pytest.mark.parametrize("batches_per_epoch", [None, 3])
def test_takes_back_says_whether_state_dict_takes_unconsumed(batches_per_epoch):
    """loader.takes_back() is what state_dict(unconsumed=1) accepts (the Lightning wrapper reads
    it to save a batch fetched ahead), through an epoch: before it, running, left part-way by
    break, ended."""
    loader = SelectiveLoader(
        DataLoader(EncodedDataset(48), batch_size=16),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=4,
        batches_per_epoch=batches_per_epoch,
    )

    def accepted() -> bool:
        try:
            loader.state_dict(unconsumed=1)
        except ValueError:
            return False
        return True

    seen = [(loader.takes_back(), accepted())]
    it = iter(loader)
    next(it)
    seen.append((loader.takes_back(), accepted()))
    for _ in it:
        break
    del it
    seen.append((loader.takes_back(), accepted()))
    for _ in loader:
        pass
    seen.append((loader.takes_back(), accepted()))
    assert all(said == taken for said, taken in seen), seen
    assert [said for said, _ in seen] == [False, True, batches_per_epoch is None, False]


@pytest.mark.parametrize("input_key, target_key", [(2, 0), (-1, -3)])
def test_positional_input_and_target_keys(input_key, target_key):
    ds = EncodedDataset(40)
    batches = [
        (
            torch.stack([ds[i][1] for i in range(s, s + 10)]),  # targets first
            torch.arange(s, s + 10),  # then the dataset indices
            torch.stack([ds[i][0] for i in range(s, s + 10)]),  # inputs last
        )
        for s in range(0, 40, 10)
    ]
    model = IndexLoss()
    loader = SelectiveLoader(
        batches,
        model,
        policy=SelectiveBackprop(0.5),
        batch_size=5,
        input_key=input_key,
        target_key=target_key,
        index_key=1,
    )
    got = list(loader)
    assert got and model.calls == 4
    for b in got:
        assert isinstance(b, tuple) and len(b) == 3
        y, idx, x = b
        assert torch.equal(idx, b.indices) and torch.equal(x[:, 0].long(), b.indices)
        assert torch.equal(y, b.indices % N_CLASSES)
        expected = nn.functional.cross_entropy(model(x), y, reduction="none")
        torch.testing.assert_close(b.losses, expected)


# ------------------------------------------------------------------ determinism
def yielded(loader, epochs=2):
    return [b.indices.tolist() for _ in range(epochs) for b in loader]


def test_same_seed_same_batches_different_seed_different():
    assert yielded(make_loader(seed=1)) == yielded(make_loader(seed=1))
    assert yielded(make_loader(seed=1)) != yielded(make_loader(seed=2))


def test_global_rng_state_does_not_matter():
    torch.manual_seed(0)
    np.random.seed(0)  # noqa: NPY002 - deliberately, to show it does not matter
    a = yielded(make_loader(seed=3))
    torch.manual_seed(99)
    np.random.seed(99)  # noqa: NPY002 - deliberately, to show it does not matter
    assert yielded(make_loader(seed=3)) == a


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        (None, {}),  # the default recipe, with its store, feedback and warm-up
        (SelectiveBackprop(1 / 3), {}),
        (SelectiveBackprop(1 / 3, staleness=2), {"prefetch": 1}),
        (SelectiveBackprop(1 / 3), {"decisions": "device"}),
        (None, {"overlap_selection": True}),
        (RandomBackprop(0.5), {}),
        (sbloader.Kath18(0.5), {}),
        (Traditional(), {}),
    ],
    ids=["default", "sb", "stale_prefetch", "device", "overlap", "random", "kath18", "traditional"],
)
def test_iterating_never_touches_global_rngs_threads_or_torch(policy, options):
    """Explicit randomness and no global side effects: building the loader and a training loop
    over it (with feedback, two epochs, selection passes) leave Python's, numpy's and torch's
    global random states, torch's thread counts and the DataLoader's own methods exactly as
    they were."""
    import random

    from torch.utils.data import dataloader as tdl

    data = torch.utils.data.TensorDataset(torch.randn(96, 6), torch.randint(0, N_CLASSES, (96,)))
    source = DataLoader(data, batch_size=24, shuffle=True, generator=torch.Generator())
    model = nn.Linear(6, N_CLASSES)
    kw = {} if policy is None else {"policy": policy}
    # Taken before the loader is built: InfoBatch patches DataLoader and reseeds numpy when it
    # is set up, not when it iterates. Seeded apart from any seed a library would use.
    random.seed(8191)
    np.random.seed(8191)  # noqa: NPY002 - deliberately, a state the loader must leave alone
    torch.manual_seed(8191)
    methods = (DataLoader.__iter__, tdl._BaseDataLoaderIter.__next__, torch.Tensor.backward)
    threads = (torch.get_num_threads(), torch.get_num_interop_threads())
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())  # noqa: NPY002
    loader = SelectiveLoader(source, model, batch_size=8, seed=5, **kw, **options)
    trained = 0
    for _ in range(2):
        for batch in loader:
            x, y = batch
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            losses.mean().backward()
            loader.feedback(batch.indices, losses)
            trained += len(y)
    assert trained > 0 and loader.stats.total.examples_yielded == trained
    after = (random.getstate(), np.random.get_state(), torch.get_rng_state())  # noqa: NPY002
    assert after[0] == states[0]
    assert all(np.array_equal(a, b) for a, b in zip(after[1], states[1]))
    assert torch.equal(after[2], states[2])
    assert (torch.get_num_threads(), torch.get_num_interop_threads()) == threads
    assert (DataLoader.__iter__, tdl._BaseDataLoaderIter.__next__, torch.Tensor.backward) == methods


# ------------------------------------------------------------------ the selection pass
def test_selection_pass_leaves_batchnorm_and_modes_untouched():
    torch.manual_seed(0)
    model = bn_model()
    model.train()
    model[1].eval()  # a deliberately frozen BatchNorm must stay frozen
    before = copy.deepcopy(model.state_dict())
    flags = [m.training for m in model.modules()]
    loader = make_loader(model=model, policy=SelectiveBackprop(0.5))
    batches = list(loader)
    assert batches and loader.stats.total.selection_forwards == 200
    after = model.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k  # running stats, num_batches_tracked
    assert [m.training for m in model.modules()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert not batches[0].losses.requires_grad and batches[0].losses.grad_fn is None


def test_selection_pass_leaves_a_training_batchnorms_statistics_alone():
    """The prior implementations' BatchNorm pollution: a forward in train mode under no_grad
    still updates running_mean and num_batches_tracked. The test above freezes its only
    BatchNorm, so there the pass's eval mode goes unchecked; here the BatchNorm trains, and
    two epochs of selection passes (no training step) leave its statistics as they were."""
    torch.manual_seed(0)
    model = bn_model().train()
    before = copy.deepcopy(model.state_dict())
    loader = make_loader(model=model, policy=SelectiveBackprop(0.5))
    for _ in range(2):
        list(loader)
    assert loader.stats.total.selection_forwards == 400
    assert model[1].training and int(model[1].num_batches_tracked) == 0
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k


class FrozenNormTrain(nn.Module):
    """A model whose own ``train`` keeps its BatchNorm frozen, and which counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(6, N_CLASSES))
        self.train_calls: list[bool] = []

    def train(self, mode: bool = True) -> FrozenNormTrain:
        self.train_calls.append(mode)
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x):
        assert not any(m.training for m in self.modules()), "selection ran in train mode"
        return self.head(self.bn(self.lin(x)))


class LoggedFlags(nn.Linear):
    """A module whose ``__setattr__`` records every ``training`` write."""

    def __init__(self) -> None:
        super().__init__(6, N_CLASSES)
        object.__setattr__(self, "writes", [])

    def __setattr__(self, name, value):
        if name == "training":
            self.writes.append(value)
        super().__setattr__(name, value)


def test_selection_pass_calls_an_overridden_train_and_restores_each_flag():
    """eval_mode's fast path (flags set directly) is taken only for torch's own train and
    __setattr__: a model overriding train() gets model.eval() called (its frozen BatchNorm
    stays frozen after the pass), and a module overriding __setattr__ sees its writes."""
    model = FrozenNormTrain().train()
    model.train_calls.clear()
    flags = [m.training for m in model.modules()]
    assert flags == [True, True, False, True, True, True]
    loader = make_loader(model=model, policy=SelectiveBackprop(0.5))
    assert list(loader)
    # eval() went through train, and each pass's restore through train(True) (see below)
    assert model.train_calls and model.train_calls == [False, True] * (len(model.train_calls) // 2)
    assert [m.training for m in model.modules()] == flags

    logged = LoggedFlags()
    net = nn.Sequential(nn.Identity(), logged).train()
    logged.writes.clear()
    with eval_mode(net):
        assert not any(m.training for m in net.modules())
    assert logged.writes == [False, True]
    assert all(m.training for m in net.modules())


class MergingLinear(nn.Linear):
    """loralib's ``lora.Linear`` (``merge_weights=True``): ``eval()`` merges its low-rank update
    into the frozen weight, ``train()`` takes it out again; unmerged, the update trains."""

    def __init__(self) -> None:
        super().__init__(6, N_CLASSES)
        self.lora_a = nn.Parameter(torch.full((2, 6), 0.1))
        self.lora_b = nn.Parameter(torch.full((N_CLASSES, 2), 0.1))
        self.weight.requires_grad_(False)
        self.merged = False

    def train(self, mode: bool = True) -> MergingLinear:
        super().train(mode)
        if mode == self.merged:
            with torch.no_grad():
                self.weight.add_((self.lora_b @ self.lora_a) * (-1.0 if mode else 1.0))
            self.merged = not mode
        return self

    def forward(self, x):
        out = super().forward(x)
        return out if self.merged else out + x @ self.lora_a.T @ self.lora_b.T


def test_selection_pass_undoes_what_an_overridden_train_did():
    """The restore set the flags back but never called the module's own ``train(True)``: the
    layer stayed merged in a training model, so its update's parameters got no gradient for the
    rest of the run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), MergingLinear()).train()
    loader = make_loader(model=model, policy=SelectiveBackprop(0.5))
    batch = next(iter(loader))
    assert model[1].training and not model[1].merged
    inputs, targets = batch
    nn.functional.cross_entropy(model(inputs), targets).backward()
    assert model[1].lora_a.grad is not None


def test_eval_modes_class_cache_stays_bounded():
    """torch.fx makes a new class per traced module (each int8 copy refresh traces one): the
    per-class cache of eval_mode's fast path must not grow with the run."""
    from sbloader.selection import _plain_training

    for i in range(1100):
        with eval_mode(type(f"Traced{i}", (nn.Module,), {})()):
            pass
    assert _plain_training.cache_info().currsize <= 1024


def test_selection_pass_fast_path_restores_mixed_flags_and_survives_errors():
    """Plain modules (the fast path): the flags are all False inside, each one's own value
    after, also when the body raises."""
    net = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(), nn.Linear(6, 3))
    net.train()
    net[1].eval()
    net[2].eval()
    flags = [m.training for m in net.modules()]
    with pytest.raises(RuntimeError, match="inside"):
        with eval_mode(net):
            assert not any(m.training for m in net.modules())
            raise RuntimeError("inside")
    assert [m.training for m in net.modules()] == flags
    with eval_mode(net, enabled=False):
        assert [m.training for m in net.modules()] == flags


class Exploding(nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        self.exc = exc

    def forward(self, x):
        assert not self.training
        raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_model_mode_is_restored_when_the_selection_pass_raises(exc):
    model = Exploding(exc).train()
    loader = make_loader(model=model)
    with pytest.raises(type(exc)):
        next(iter(loader))
    assert model.training and model.bn.training


class RaisesAfterBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        self.lin = nn.Linear(6, N_CLASSES)
        self.explode = True
        self.bn_calls = 0

    def forward(self, x):
        h = self.bn(x)
        self.bn_calls += 1
        if self.explode:
            raise RuntimeError("after BatchNorm")
        return self.lin(h)


def test_batchnorm_buffers_are_untouched_when_the_selection_pass_raises_after_batchnorm():
    model = RaisesAfterBatchNorm().train()
    before = copy.deepcopy(model.state_dict())
    loader = make_loader(model=model, bs=10, source_bs=50)
    with pytest.raises(RuntimeError, match="after BatchNorm"):
        next(iter(loader))
    assert model.bn_calls == 1 and model.training and model.bn.training
    for k, v in model.state_dict().items():  # running_mean, running_var, num_batches_tracked
        assert torch.equal(v, before[k]), k
    model.explode = False  # the same loader carries on, still without touching them
    assert len(list(loader)) > 0 and model.training and model.bn.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class ModeDependent(IndexLoss):
    """:class:`IndexLoss`, with every loss raised by a wrong-class logit in train mode (as
    dropout or BatchNorm's batch statistics would change it); records the mode of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        logits = super().forward(x)
        if self.training:
            logits[:, 0] += 1.0 + 0.1 * (x[:, 0] % 7)
        return logits


@pytest.mark.parametrize("eval_selection", [True, False])
def test_eval_selection_false_scores_in_train_mode_and_keeps_the_mode(eval_selection):
    model = ModeDependent().train()
    loader = make_loader(model=model, bs=10, source_bs=50, eval_selection=eval_selection)
    batches = list(loader)
    assert model.modes == [not eval_selection] * 4 and model.training
    scorer = copy.deepcopy(model).train(not eval_selection)
    for b in batches:
        expected = nn.functional.cross_entropy(scorer(b[0]), b[1], reduction="none")
        torch.testing.assert_close(b.losses, expected)
    frozen = ModeDependent().eval()  # eval_selection=False does not put a model in train mode
    list(make_loader(model=frozen, bs=10, source_bs=50, eval_selection=False))
    assert not any(frozen.modes) and not frozen.training


def test_weights_and_losses_work_in_autograd():
    torch.manual_seed(0)
    model = bn_model()
    loader = make_loader(model=model)
    batch = next(iter(loader))
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y, reduction="none")
    (loss * batch.weights + 0 * batch.losses).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_selection_batch_size_chunks_the_forward():
    model = IndexLoss()
    loader = make_loader(model=model, bs=10, source_bs=50, selection_batch_size=16)
    a = yielded(loader, 1)
    assert model.calls == 4 * 4  # ceil(50 / 16) chunks per source batch
    assert loader.stats.total.selection_calls == model.calls  # the stats count each chunk
    assert a == yielded(make_loader(bs=10, source_bs=50), 1)  # same losses, same choices


class ReversedIndexLoss(IndexLoss):
    """:class:`IndexLoss` ranked the other way round: the lower the index, the higher the loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        idx = x[:, 0]
        logits = torch.zeros(x.shape[0], N_CLASSES)
        logits[torch.arange(x.shape[0]), idx.long() % N_CLASSES] = 8.0 + idx / 100.0
        return logits + 0.0 * self.lin(x)


def test_a_selector_scores_the_candidates_instead_of_the_model():
    def chosen(**kw):
        loader = make_loader(bs=10, source_bs=50, policy=SelectiveBackprop(beta=3.0), **kw)
        return [b for _ in range(3) for b in loader]

    model, selector = IndexLoss(), ReversedIndexLoss()
    batches = chosen(model=model, selector=selector)
    assert model.calls == 0 and selector.calls == 3 * 4  # one selection forward per source batch
    for b in batches:
        check_pairing(b)
        expected = nn.functional.cross_entropy(selector(b[0]), b[1], reduction="none")
        torch.testing.assert_close(b.losses, expected)  # the selector's losses, not the model's
    # The selector's hardest examples are the lowest indices, the model's the highest.
    by_selector = torch.cat([b.indices for b in batches]).float()
    by_model = torch.cat([b.indices for b in chosen(model=IndexLoss())]).float()
    assert by_selector.median() < 70 and by_model.median() > 130


@pytest.mark.parametrize("warmup", [False, True], ids=["selection-pass", "probe"])
def test_a_selector_with_fewer_classes_than_the_labels_is_named_on_the_first_batch(warmup):
    """A selector built for another head (fewer outputs than the labels) failed in the first
    selection pass, or in the warm-up's probe, with torch's bare "Target .. is out of bounds":
    the error now names selector= and the fix, chained to torch's; the model alone is fine."""
    small = nn.Linear(6, 2)  # the labels go up to N_CLASSES - 1 = 3
    policy = SelectiveBackprop(0.5)
    if warmup:
        policy = Phased(policy, warmup_epochs=1, warmup_policy=RandomBackprop(0.5))
    loader = make_loader(bs=10, source_bs=50, policy=policy, selector=small)
    with pytest.raises(IndexError, match=r"selector=.*fewer outputs than the labels") as info:
        next(iter(loader))
    assert isinstance(info.value.__cause__, IndexError)
    assert "out of bounds" in str(info.value.__cause__)
    assert len(next(iter(make_loader(bs=10, source_bs=50, policy=policy)))[0]) == 10


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reducing_loss_module_is_rejected_up_front(reduction):
    with pytest.raises(ValueError, match="reduction='none'"):
        make_loader(loss_fn=nn.CrossEntropyLoss(reduction=reduction))


def test_scalar_loss_function_is_rejected_with_the_fix():
    loader = make_loader(loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))
    with pytest.raises(ValueError, match=r"one loss per example .*reduction='none'"):
        next(iter(loader))


def test_one_loss_per_example_laid_out_otherwise_names_the_layout_not_the_reduction():
    def row(out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")[None, :]

    loader = make_loader(loss_fn=row)
    with pytest.raises(ValueError, match=r"returned \(1, 20\): as many losses, laid out") as err:
        next(iter(loader))
    assert "reduction='none'" not in str(err.value)


def test_labels_out_of_range_surface_and_the_loader_recovers():
    model = bn_model().train()
    ds = EncodedDataset(40)
    bad = [(torch.stack([ds[i][0] for i in range(10)]), torch.full((10,), 99))]
    loader = SelectiveLoader(bad, model, batch_size=5)
    with pytest.raises(IndexError):
        next(iter(loader))
    assert model.training
    good = make_loader(model=model)
    assert len(list(good)) > 0


# ------------------------------------------------------------------ counts and remainders
def test_stats_count_what_happened_and_rate_matches_target(caplog):
    ds = EncodedDataset(3000)
    loader = make_loader(ds, bs=50, source_bs=150, policy=SelectiveBackprop(1 / 3))
    with caplog.at_level(logging.INFO, logger="sbloader"):
        for _ in range(3):
            n_batches = sum(1 for _ in loader)
            e = loader.stats.current
            assert e.examples_seen == e.selection_forwards == 3000
            assert e.batches_yielded == n_batches and e.examples_yielded == 50 * n_batches
            assert e.target_rate == pytest.approx(1 / 3)
    total = loader.stats.total
    assert total.selection_rate == pytest.approx(1 / 3, abs=0.03)
    # Everything selected is yielded or still pending (carried), nothing lost.
    assert total.examples_selected == total.examples_yielded + loader.pending_examples
    assert "epoch 2:" in caplog.text and total.selection_s > 0


@pytest.mark.skipif(
    os.environ.get("NUMBA_DISABLE_JIT") == "1", reason="no numba runtime to load without the JIT"
)
def test_numbas_first_call_is_not_counted_as_the_first_epochs_selection_time():
    """In a fresh process, the first numba kernel call loads numba's runtime (seconds): made
    when the loader is built, it is not the selection time of a Random-Backprop epoch, which
    runs no selection pass (it read 1.3-2.8 s, most of the epoch's wall time)."""
    code = (
        "import torch; from torch.utils.data import DataLoader, TensorDataset; import sbloader; "
        "data = TensorDataset(torch.randn(40, 4), torch.arange(40) % 3); "
        "loader = sbloader.SelectiveLoader(DataLoader(data, batch_size=10), torch.nn.Linear(4, 3), "
        "policy=sbloader.RandomBackprop(0.5), batch_size=5); "
        "made = len(sbloader._kernels.first_outside.signatures); "
        "_ = list(loader); e = loader.stats.current; "
        "print(made, e.selection_forwards, e.selection_s)"
    )
    out = run_python(code, timeout=300)
    made, forwards, seconds = out.stdout.split()
    # (the first call made as the loader is built, whatever the machine's caches make it cost)
    assert made == "1" and forwards == "0" and float(seconds) < 0.5, out.stdout


def test_an_epoch_left_part_way_is_logged_with_its_non_finite_losses(caplog):
    """A loop of so many steps per epoch (``break``), or a framework closing its epochs early,
    never reaches an epoch's end: each such epoch is logged all the same, marked as left
    part-way, and its non-finite selection losses are warned of."""
    ds = EncodedDataset(40)

    class NanFor3(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, N_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            return torch.where(x[:, :1] == 3, torch.nan, out)  # example 3's loss is NaN

    loader = make_loader(ds, bs=5, source_bs=10, shuffle=False, model=NanFor3())
    with caplog.at_level(logging.INFO, logger="sbloader"):
        for _ in range(2):
            for i, _batch in enumerate(loader):
                if i == 1:
                    break
        it = iter(loader)
        next(it)
        it.close(resumable=False)
    lines = [r.getMessage() for r in caplog.records]
    for epoch in range(3):
        said = [m for m in lines if m.startswith(f"epoch {epoch} (left part-way): seen ")]
        assert len(said) == 1, lines
        warned = f"epoch {epoch}: 1 candidates had a non-finite"
        assert sum(m.startswith(warned) for m in lines) == 1
    assert [e.nonfinite for e in loader.stats.epochs] == [1, 1, 1]


def test_the_step_before_a_break_is_the_callers_time_not_the_loaders(monkeypatch):
    """An epoch left with ``break`` after its third step (1 s each on a fake clock): the third
    step is the caller's (``consumer_s``), not the loader's own time (``overhead_s``)."""
    now = [100.0]
    monkeypatch.setattr(sbloader.epoch, "perf_counter", lambda: now[0])
    loader = make_loader(bs=5, source_bs=10, policy=RandomBackprop(0.5))
    for i, _batch in enumerate(loader):
        now[0] += 1.0  # the training step
        if i == 2:
            break
    e = loader.stats.current
    assert (e.batches_yielded, e.consumer_s, e.wall_s, e.overhead_s) == (3, 3.0, 3.0, 0.0)


@pytest.mark.parametrize("remainder", ["carry", "short", "drop"])
def test_end_of_epoch_remainder(remainder):
    loader = make_loader(bs=16, source_bs=50, policy=RandomBackprop(0.5), remainder=remainder)
    sizes = [[len(b[0]) for b in loader] for _ in range(3)]
    st = loader.stats
    for ep, s in enumerate(sizes):
        e = st.epochs[ep]
        if remainder == "short":
            assert all(x == 16 for x in s[:-1]) and 1 <= s[-1] <= 16  # no BatchNorm here
            assert e.examples_yielded == e.examples_selected
        else:
            assert all(x == 16 for x in s)
        if remainder == "drop":
            assert e.examples_yielded + e.dropped == e.examples_selected
    if remainder == "carry":
        t = st.total
        assert t.examples_yielded + loader.pending_examples == t.examples_selected
        assert t.dropped == 0


@pytest.mark.parametrize("source_bs", [20, 30])  # whole batches handed out; re-batched
def test_traditional_with_remainder_drop_drops_each_passs_rest(source_bs):
    """remainder="drop" asked of Traditional was ignored, unsaid (the pass's short rest was
    yielded): it drops the rest, counted, as a DataLoader's drop_last does, and len() says so;
    the batches are the first full ones of the source's order, as with "short"."""
    ds = EncodedDataset(130)  # 6 batches of 20 and 10 over
    short = make_loader(ds, bs=20, source_bs=source_bs, policy=Traditional(), remainder="short")
    drop = make_loader(ds, bs=20, source_bs=source_bs, policy=Traditional(), remainder="drop")
    assert len(short) == 7 and len(drop) == 6 and drop.last_batch_min == 20
    for epoch in range(2):
        kept = [b.indices.tolist() for b in drop]
        assert kept == [b.indices.tolist() for b in short][:6]
        e = drop.stats.epochs[epoch]
        assert e.batches_yielded == 6 and e.dropped == 10 and drop.pending_examples == 0


def test_a_batch_of_one_never_reaches_a_batchnorm_model():
    ds = EncodedDataset(41)  # 41 = 2 * 20 + 1: the source's last batch has one example
    loader = SelectiveLoader(DataLoader(ds, batch_size=20), bn_model(), policy=Traditional())
    sizes = [len(b[0]) for b in loader]
    assert sizes == [20, 20] and len(loader) == 2
    assert loader.stats.current.dropped == 1
    plain = SelectiveLoader(DataLoader(ds, batch_size=20), IndexLoss(), policy=Traditional())
    assert [len(b[0]) for b in plain] == [20, 20, 1] and len(plain) == 3


def test_the_default_min_batch_size_is_logged_with_its_reason(caplog):
    """min_batch_size's default depends on the model (its BatchNorm layers): said in the log,
    as the other automatic choices are; a given one is not."""
    source = DataLoader(EncodedDataset(40), batch_size=20)
    with caplog.at_level(logging.INFO, logger="sbloader"):
        SelectiveLoader(source, bn_model(), policy=Traditional())
        SelectiveLoader(source, IndexLoss(), policy=Traditional())
        SelectiveLoader(source, bn_model(), policy=Traditional(), min_batch_size=3)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("min_batch")]
    assert said == [
        "min_batch_size: 2 (the default for a model with BatchNorm layers, which cannot train "
        "on a batch of one)",
        "min_batch_size: 1 (the default for a model without BatchNorm layers)",
    ]


def test_a_batchnorm_model_trains_in_batches_of_one_when_asked():
    """The default min_batch_size of a BatchNorm model (2) is at most batch_size: batches of one
    (images through BatchNorm2d, which torch trains on) were refused naming min_batch_size=2,
    which the user never passed; an explicit one above batch_size is still refused."""
    images, labels = torch.randn(6, 1, 4, 4), torch.arange(6) % N_CLASSES
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, N_CLASSES)
    )
    source = DataLoader(ArrayDataset(images, labels), batch_size=1)
    loader = SelectiveLoader(source, model, policy=Traditional())
    assert loader.min_batch_size == 1 and [len(b[0]) for b in loader] == [1] * 6
    assert SelectiveLoader(source, model, batch_size=2).min_batch_size == 2
    with pytest.raises(ValueError, match="min_batch_size should be <= batch_size=1"):
        SelectiveLoader(source, model, min_batch_size=2)


def test_a_train_mode_selection_forward_of_one_example_is_scored_in_eval_mode_and_warned():
    """eval_selection=False scores in train mode, where BatchNorm1d raises on a single example
    (the prior implementations' failure): a source batch of one (41 = 2 * 20 + 1) is scored in
    eval mode, with a warning naming the fixes, after the default recipe's warm-up as in its
    first epoch; its loss is the eval-mode loss, the other 40 train-mode ones, the BatchNorm
    counts only the two train-mode forwards, and the model's modes are as they were. It was
    refused when the epoch's last batch came: after a Random-Backprop warm-up, a whole epoch
    late."""
    ds = EncodedDataset(41)
    model = bn_model().train()
    before = copy.deepcopy(model.state_dict())
    loader = SelectiveLoader(
        DataLoader(ds, batch_size=20),
        model,
        policy=SelectiveBackprop(0.5),
        eval_selection=False,
        autocast=None,  # (float32: the lone loss is compared exactly below)
    )
    scored: list[torch.Tensor] = []
    original = loader._scorer.run

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        scored.append(out.losses.detach().clone())
        return out

    loader._scorer.run = recording  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match=r"1 candidate: it was scored in eval mode.*drop_last"):
        list(loader)
    assert loader.stats.current.selection_forwards == 41
    assert all(m.training for m in model.modules())
    assert torch.equal(model[1].num_batches_tracked, before["1.num_batches_tracked"] + 2)
    # The lone example's loss is its eval-mode loss (with the running statistics after the two
    # train-mode forwards); a train-mode pass of it with another example differs.
    assert [len(s) for s in scored] == [20, 20, 1]
    x41, y41 = (t.unsqueeze(0) for t in ds[40][:2])
    lone = model.eval()(x41)
    model.train()
    expected = nn.functional.cross_entropy(lone.float(), y41, reduction="none")
    torch.testing.assert_close(scored[2], expected)
    # After a Random-Backprop warm-up (the default recipe): the first selective epoch ends.
    model.load_state_dict(before)
    warmed = SelectiveLoader(
        DataLoader(ds, batch_size=20), model, planned_epochs=4, eval_selection=False
    )
    with pytest.warns(UserWarning, match="1 candidate: it was scored in eval mode"):
        for _ in range(2):
            list(warmed)
    assert warmed.stats.epochs[1].selection_forwards == 41
    fine = SelectiveLoader(
        DataLoader(ds, batch_size=20, drop_last=True),
        copy.deepcopy(model),
        policy=SelectiveBackprop(0.5),
        eval_selection=False,
        batch_size=4,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sum(len(b[0]) for b in fine) > 0
    # In eval mode (the default) the lone example is scored like any other, unwarned.
    model.load_state_dict(before)
    evaluated = SelectiveLoader(DataLoader(ds, batch_size=20), model, policy=SelectiveBackprop(0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(evaluated)
    assert evaluated.stats.current.selection_forwards == 41


def test_a_collective_train_mode_forward_of_one_example_is_refused_naming_the_fixes(monkeypatch):
    """Under FSDP (forwards run in step on every rank; taken here as the model's kind) the lone
    example is not re-run in eval mode, which one rank alone would do: refused naming the
    fixes, with the BatchNorm counter as it was and the model still in train mode."""
    from sbloader import selection
    from sbloader.selection import selection_outputs

    model = bn_model().train()
    tracked = model[1].num_batches_tracked.clone()
    x, y = torch.randn(3, 6), torch.tensor([0, 1, 2])
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    with monkeypatch.context() as patch:
        patch.setattr(selection, "is_fsdp", lambda m: m is model)
        with pytest.raises(ValueError, match=r"got 1 candidate \(a source batch of one.*drop_"):
            selection_outputs(model, x, y, loss_fn, batch_size=2, eval=False, inference=False)
    assert torch.equal(model[1].num_batches_tracked, tracked + 1)  # the chunk of two only
    assert all(m.training for m in model.modules())
    with pytest.warns(UserWarning, match="scored in eval mode"):
        losses, _ = selection_outputs(model, x, y, loss_fn, batch_size=2, eval=False)
    assert losses.shape == (3,)


def test_a_train_mode_selection_forward_of_one_image_through_batchnorm2d_runs():
    """BatchNorm2d normalises a single image in train mode (its statistics run over the image's
    pixels): eval_selection=False scores a source batch of one through it, as torch allows, and
    only the forward torch refuses (BatchNorm1d, above) is refused with the fix."""
    images = torch.randn(41, 1, 4, 4)
    labels = torch.arange(41) % N_CLASSES
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, N_CLASSES)
    ).train()
    loader = SelectiveLoader(
        DataLoader(ArrayDataset(images, labels), batch_size=20),
        model,
        policy=SelectiveBackprop(0.5),
        eval_selection=False,
    )
    list(loader)
    assert loader.stats.current.selection_forwards == 41
    assert all(m.training for m in model.modules())


@pytest.mark.parametrize("min_batch_size, dropped", [(3, 0), (4, 3)])
def test_a_user_min_batch_size_drops_smaller_batches_and_counts_them(min_batch_size, dropped):
    ds = EncodedDataset(53)  # 53 = 5 * 10 + 3: 3 examples left at the end of an epoch
    sizes = [10] * 5 + ([3] if not dropped else [])
    trad = SelectiveLoader(
        DataLoader(ds, batch_size=10),
        IndexLoss(),
        policy=Traditional(),
        min_batch_size=min_batch_size,
    )
    assert [len(b[0]) for b in trad] == sizes and len(trad) == len(sizes)
    assert trad.stats.current.dropped == dropped
    everything = SelectiveBackprop(beta=0.0)  # selective, but keeps every example
    short = SelectiveLoader(
        DataLoader(ds, batch_size=10),
        IndexLoss(),
        policy=everything,
        remainder="short",
        min_batch_size=min_batch_size,
    )
    assert [len(b[0]) for b in short] == sizes
    e = short.stats.current
    assert e.dropped == dropped and e.examples_yielded + e.dropped == e.examples_selected == 53


def test_len_is_honest_or_absent():
    with pytest.raises(TypeError, match="expected_batches"):
        len(make_loader())
    loader = make_loader(EncodedDataset(300), bs=10, policy=SelectiveBackprop(1 / 3))
    assert loader.expected_batches() == pytest.approx(10.0)


def test_progress_counts_source_batches():
    loader = make_loader(EncodedDataset(100), bs=10, policy=RandomBackprop(1.0))
    seen = [loader.progress for _ in loader]
    assert seen == pytest.approx([0.1 * i for i in range(1, 11)])
    assert loader.progress == 1.0


def test_progress_holds_where_an_epoch_was_left_or_restored_part_way():
    """After ``break`` and after loading a mid-epoch state (before the first batch, where a
    resumed run sets its schedule), progress reads where the pass got to, never going back."""
    make = lambda: make_loader(EncodedDataset(100), bs=10, policy=SelectiveBackprop(0.5))  # noqa: E731
    loader = make()
    readings = []
    for i, _ in enumerate(loader):
        readings.append(loader.progress)
        if i == 2:
            break
    assert loader.progress == readings[-1] == 0.6
    fresh = make()
    fresh.load_state_dict(copy.deepcopy(loader.state_dict()))
    assert fresh.progress == readings[-1]
    readings += [fresh.progress for _ in fresh]
    readings.append(loader.progress)  # (still where its pass stopped)
    readings += [loader.progress for _ in loader] + [loader.progress]  # its next epoch
    assert readings[-1] == 2.0
    resumed = readings[: readings.index(1.0) + 1]
    assert resumed == sorted(resumed) and resumed[-1] == 1.0


# ------------------------------------------------------------------ non-finite losses
class NanFor(nn.Module):
    """Loss NaN for examples whose index is a multiple of 7, +inf for multiples of 11."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        idx = x[:, 0]
        logits = torch.zeros(x.shape[0], N_CLASSES) + self.w
        logits[idx % 7 == 0] = float("nan")
        logits[(idx % 11 == 0) & (idx % 7 != 0), :] = torch.tensor([float("-inf"), 0.0, 0, 0])
        return logits


def bad_index(i):
    return i % 7 == 0 or (i % 11 == 0 and i % N_CLASSES == 0)


def test_nonfinite_skip_select_raise():
    skip = make_loader(model=NanFor(), policy=SelectiveBackprop(1.0), remainder="short")
    got = {i for b in skip for i in b.indices.tolist()}
    expected_bad = {i for i in range(200) if bad_index(i)}
    assert got == set(range(200)) - expected_bad
    assert skip.stats.current.nonfinite == len(expected_bad)
    assert len(skip.policy.window) == 200 - len(expected_bad)
    assert np.isfinite(skip.policy.window.values()).all()

    select = make_loader(
        model=NanFor(), policy=SelectiveBackprop(1.0), remainder="short", nonfinite="select"
    )
    got = {i for b in select for i in b.indices.tolist()}
    assert got == set(range(200)) and len(select.policy.window) == 200 - len(expected_bad)

    raising = make_loader(model=NanFor(), nonfinite="raise")
    with pytest.raises(sbloader.NonFiniteLoss, match="nonfinite='skip'"):
        list(raising)


@pytest.mark.parametrize("nonfinite", ["skip", "select"])
@pytest.mark.parametrize("source", ["dataloader", "iterable"])
def test_stale_epochs_treat_a_nonfinite_loss_as_its_selection_pass_did(nonfinite, source):
    """A non-finite selection loss skipped under "skip" stays skipped in Stale-SB's stale
    epochs (decided from the store: at the source before loading, or per batch), instead of
    being taken for never scored and kept with P = 1; under "select" it is kept there too."""
    bad = {i for i in range(200) if bad_index(i)}
    policy = SelectiveBackprop(beta=0.0, staleness=3)  # P = 1 for every finite loss
    kw: dict = dict(model=NanFor(), policy=policy, nonfinite=nonfinite, remainder="drop")
    if source == "iterable":
        batches = [
            {
                "x": torch.arange(s, s + 20).float()[:, None].expand(20, 6).clone(),
                "y": torch.arange(s, s + 20) % N_CLASSES,
                "i": torch.arange(s, s + 20),
            }
            for s in range(0, 200, 20)
        ]
        loader = SelectiveLoader(
            batches,
            NanFor(),
            policy=policy,
            nonfinite=nonfinite,
            remainder="drop",
            batch_size=10,
            seed=0,
            input_key="x",
            target_key="y",
            index_key="i",
            dataset_size=200,
        )
    else:
        loader = make_loader(**kw)
    for epoch in range(3):
        got = [i for b in loader for i in b.indices.tolist()]
        assert policy.needs_losses(epoch) == (epoch == 0)
        if epoch == 0:  # the store counts a forced example as selected, a skipped one not
            selected = policy.store.selected
            assert (selected[sorted(bad)] == (nonfinite == "select")).all()
            assert (np.delete(selected, sorted(bad)) == 1).all()
        kept_bad = bad & set(got)
        assert kept_bad == (set() if nonfinite == "skip" else bad), epoch
        assert len(got) == len(set(got)) and len(got) >= 190 - len(bad)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"remainder": "keep"}, ValueError, "remainder should be one of"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite should be one of"),
        ({"bs": 0, "source_bs": 20}, ValueError, "batch_size should be >= 1, but got batch_size=0"),
        ({"seed": -1}, ValueError, "seed should be >= 0"),
        ({"selection_batch_size": 0}, ValueError, "selection_batch_size should be >= 1"),
        ({"min_batch_size": 50}, ValueError, "min_batch_size should be <= batch_size"),
        ({"autocast": "bf16"}, TypeError, "autocast should be a torch.dtype"),
        ({"policy": "sb"}, TypeError, "policy should be an sbloader policy"),
        ({"model": object()}, TypeError, "model should be a torch.nn.Module"),
        # failed on the first batch with "'str' object is not callable", naming no parameter
        ({"loss_fn": "cross_entropy"}, TypeError, "loss_fn should be a callable"),
        # bool() took these: None (as if the default) scored in train mode, BatchNorm's running
        # statistics updated by every selection pass; "False" scored in eval mode.
        ({"eval_selection": None}, TypeError, "eval_selection should be True or False, but got "),
        ({"eval_selection": "False"}, TypeError, "eval_selection should be True or False"),
        # Unchecked: ignored for inputs that are not 4-d, torch's error on the first 4-d batch.
        ({"memory_format": "channels_last"}, TypeError, r"memory_format should be a torch\.memo"),
        ({"memory_format": torch.float16}, TypeError, "memory_format should be a torch.memory_f"),
        ({"metadata_key": 1}, TypeError, "metadata_key should be a str .* got metadata_key=1"),
        # (a DataLoader over a map-style dataset: its batches have no index field to leave out)
        (
            {"drop_index": True},
            ValueError,
            "drop_index=True leaves the index field out .* have none",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        make_loader(**kwargs)


def test_empty_source_is_an_error():
    loader = SelectiveLoader(DataLoader(EncodedDataset(0), batch_size=4), IndexLoss())
    with pytest.raises(ValueError, match="no examples"):
        list(loader)


def test_fields_of_different_lengths_are_rejected():
    batches = [(torch.zeros(4, 6), torch.zeros(3, dtype=torch.long))]
    with pytest.raises(ValueError, match="one entry per example"):
        next(iter(SelectiveLoader(batches, IndexLoss(), batch_size=2)))


def test_dataset_smaller_than_one_batch_fills_batches_across_epochs():
    loader = make_loader(EncodedDataset(7), bs=10, source_bs=10, policy=RandomBackprop(1.0))
    sizes = [[len(b[0]) for b in loader] for _ in range(3)]
    assert sizes == [[], [10], [10]]  # 7; 14 -> a batch, 4 carried; 11 -> a batch, 1 carried
    assert loader.pending_examples == 1


# ------------------------------------------------------------------ state
def train_epochs(loader, model, opt, epochs):
    out = []
    for _ in range(epochs):
        for batch in loader:
            x, y = batch
            loss = nn.functional.cross_entropy(model(x), y, reduction="none") * batch.weights
            opt.zero_grad()
            loss.mean().backward()
            opt.step()
            out.append(batch.indices.tolist())
    return out


def fresh(seed=0):
    torch.manual_seed(seed)
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return (
        model,
        opt,
        make_loader(model=model, policy=SelectiveBackprop(1 / 3, history=64), bs=16, source_bs=48),
    )


def test_two_epochs_save_resume_two_epochs_equals_four():
    model, opt, loader = fresh()
    full = train_epochs(loader, model, opt, 4)

    model, opt, loader = fresh()
    first = train_epochs(loader, model, opt, 2)
    # A faithful checkpoint also holds torch's RNG (the model's Dropout draws from it).
    state = {
        "loader": loader.state_dict(),
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
        "torch_rng": torch.get_rng_state(),
    }
    model, opt, loader = fresh()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["torch_rng"])
    second = train_epochs(loader, model, opt, 2)
    assert first + second == full


def test_state_scalars_are_json_serialisable():
    _, _, loader = fresh()
    list(loader)
    state = loader.state_dict()
    assert state["version"] == SelectiveLoader.STATE_VERSION

    def scalars(obj):  # everything but tensors and arrays
        if isinstance(obj, dict):
            return {k: scalars(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [scalars(v) for v in obj]
        return None if isinstance(obj, (torch.Tensor, np.ndarray)) else obj

    json.dumps(scalars(state))
    with pytest.raises(ValueError, match="version"):
        loader.load_state_dict({**state, "version": 999})


@pytest.mark.parametrize("stop_after", [0, 1, 5, 12])
@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_yields_what_an_uninterrupted_run_would(stop_after, workers):
    """Save after k batches of epoch 2 (pending batch non-empty), resume in a new loader."""

    def build():
        torch.manual_seed(0)
        model = bn_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return (
            model,
            opt,
            make_loader(
                EncodedDataset(600),
                model=model,
                workers=workers,
                policy=SelectiveBackprop(1 / 3, history=64),
                bs=16,
                source_bs=48,
            ),
        )

    model, opt, loader = build()
    full = train_epochs(loader, model, opt, 3)

    model, opt, loader = build()
    got = train_epochs(loader, model, opt, 1)
    it = iter(loader)
    for _ in range(stop_after):
        batch = next(it)
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        got.append(batch.indices.tolist())
    state = copy.deepcopy(
        {
            "l": loader.state_dict(),
            "m": model.state_dict(),
            "o": opt.state_dict(),
            "rng": torch.get_rng_state(),
        }
    )
    del it
    model, opt, loader = build()
    model.load_state_dict(state["m"])
    opt.load_state_dict(state["o"])
    loader.load_state_dict(state["l"])
    torch.set_rng_state(state["rng"])
    got += train_epochs(loader, model, opt, 1)  # the rest of epoch 2
    got += train_epochs(loader, model, opt, 1)  # epoch 3
    assert got == full
    assert [e.epoch for e in loader.stats.epochs] == [0, 1, 2]


def persistent_workers_loader(policy, batch_size: int) -> SelectiveLoader:
    """A shuffling DataLoader of 120 examples in batches of 24 with two persistent workers."""
    dl = DataLoader(
        EncodedDataset(120),
        batch_size=24,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(1),
    )
    return SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=batch_size, seed=0)


def stopped_run(build, epochs: int, stop_epoch: int, stop_batch: int) -> tuple:
    """An uninterrupted run's batches (as index lists, over ``epochs`` epochs of a loader from
    ``build()``), and a second loader stopped after ``stop_batch`` batches of epoch
    ``stop_epoch``: (the full run's batches, the stopped loader, its live iterator, the batches
    it yielded, a copy of its state)."""
    whole = build()
    full = [b.indices.tolist() for _ in range(epochs) for b in whole]
    del whole
    loader, got = build(), []
    for _ in range(stop_epoch):
        got += [b.indices.tolist() for b in loader]
    it = iter(loader)
    got += [next(it).indices.tolist() for _ in range(stop_batch)]
    return full, loader, it, got, copy.deepcopy(loader.state_dict())


@pytest.mark.parametrize("stop", [(1, 0), (2, 0), (1, 3), (0, 2)])
def test_persistent_workers_resume_in_the_uninterrupted_runs_order(stop):
    """A DataLoader with persistent_workers=True draws its workers' base seed from its
    generator once, when its first epoch starts, and each later epoch only its order. A
    resumed run's new workers drew that seed again, from the generator that also shuffles: every
    epoch after the resume (at an epoch's end or mid-epoch) came in another order than the
    uninterrupted run's. The resumed run now draws it once, when its uninterrupted twin did."""
    epochs, (stop_epoch, stop_batch) = 4, stop

    def build() -> SelectiveLoader:
        return persistent_workers_loader(SelectiveBackprop(0.5), 6)

    full, loader, it, got, state = stopped_run(build, epochs, stop_epoch, stop_batch)
    del it, loader
    resumed = build()
    resumed.load_state_dict(state)
    for _ in range(resumed.epoch, epochs):
        got += [b.indices.tolist() for b in resumed]
    assert got == full


@pytest.mark.parametrize("stop", [(0, 2), (1, 3)])
@pytest.mark.parametrize("running", [False, True], ids=["after-break", "while-running"])
def test_persistent_workers_rolled_back_in_the_same_loader_replay_the_runs_order(stop, running):
    """A state loaded into the loader that saved it, whose persistent workers are still up
    (a retry after an error, after ``break``, or a rollback while the epoch runs): the resumed
    epoch comes in the uninterrupted run's order. In the first epoch the reused workers drew
    only the order, from where the run had first drawn their base seed: another order, whose
    first batches the resumed epoch skipped (examples repeated, others never yielded)."""
    epochs, (stop_epoch, stop_batch) = 3, stop

    def build() -> SelectiveLoader:
        return persistent_workers_loader(Traditional(), 24)

    full, loader, it, got, state = stopped_run(build, epochs, stop_epoch, stop_batch)
    if running:
        next(it)  # (a batch of the rolled-back stretch: handed out again)
    else:
        del it
    loader.load_state_dict(state)
    for _ in range(loader.epoch, epochs):
        got += [b.indices.tolist() for b in loader]
    assert got == full


class WorkerPids(torch.utils.data.Dataset):
    """Example i is [i] * 4, label i % 3, and the id of the process that loaded it."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        return torch.full((4,), float(i)), i % 3, os.getpid()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # (2 workers on one core)
def test_persistent_workers_of_a_resumed_run_stay_up_from_epoch_to_epoch():
    """A resumed run makes its persistent workers from a generator of their own (see the test
    above), whose base seed is not the run's: they were taken for another run's and made again
    every epoch, restarting their random streams (augmentations) each epoch, and their start
    up. Now they load every later epoch, as in the uninterrupted run."""

    def build() -> SelectiveLoader:
        dl = DataLoader(
            WorkerPids(),
            batch_size=12,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(1),
        )
        return SelectiveLoader(dl, nn.Linear(4, 3), policy=Traditional(), batch_size=12)

    def pids(loader):
        return {p for b in loader for p in b[2].tolist()}

    saved = build()
    first = pids(saved)
    state = copy.deepcopy(saved.state_dict())
    assert len(first) == 2 and [pids(saved) for _ in range(2)] == [first] * 2
    resumed = build()
    resumed.load_state_dict(state)
    again = pids(resumed)
    assert len(again) == 2 and [pids(resumed) for _ in range(2)] == [again] * 2


class Augmented(torch.utils.data.Dataset):
    """Example i is i + a random augmentation in [0, 1) from torch's RNG, label i % 3."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((4,), float(i)) + torch.rand(4), i % 3


@pytest.mark.parametrize("workers", [0, 2])
def test_random_augmentations_after_a_mid_epoch_resume_are_as_the_readme_says(workers):
    """README, Resumable: the same examples in the same batches; augmentations drawn in worker
    processes are drawn anew for the rest of the resumed epoch (then as before: non-persistent
    workers are seeded anew each epoch), and with num_workers=0 they repeat where torch's global
    RNG is restored with the checkpoint. (The README claimed exactness without the caveat.)"""

    def build() -> SelectiveLoader:
        dl = DataLoader(
            Augmented(),
            batch_size=24,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(1),
        )
        return SelectiveLoader(dl, nn.Linear(4, 3), policy=Traditional(), batch_size=12)

    torch.manual_seed(0)
    whole = build()
    full = [b[0] for _ in range(2) for b in whole]
    torch.manual_seed(0)
    loader = build()
    it = iter(loader)
    got = [next(it)[0] for _ in range(3)]
    state = copy.deepcopy({"loader": loader.state_dict(), "rng": torch.get_rng_state()})
    del it, loader
    resumed = build()
    resumed.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"])
    got += [b[0] for _ in range(2) if resumed.epoch < 2 for b in resumed]
    assert len(got) == len(full) == 16
    assert all(torch.equal(a.floor(), b.floor()) for a, b in zip(got, full))  # the examples
    same = [torch.equal(a, b) for a, b in zip(got, full)]
    if workers == 0:
        assert all(same)
    else:  # batch 3 was loaded before the checkpoint (the 2nd half of a source batch of 24);
        # the rest of the resumed epoch is drawn anew, the next epoch as before
        assert same == [True] * 4 + [False] * 4 + [True] * 8


@pytest.mark.parametrize("stop_after", [0, 1, 4, 7])
def test_mid_epoch_resume_of_an_iterable_source_yields_what_an_uninterrupted_run_would(
    stop_after,
):
    ds = EncodedDataset(120)
    order = torch.randperm(120, generator=torch.Generator().manual_seed(0)).tolist()
    batches = [
        (
            torch.stack([ds[i][0] for i in order[s : s + 12]]),
            torch.stack([ds[i][1] for i in order[s : s + 12]]),
            torch.tensor(order[s : s + 12]),
        )
        for s in range(0, 120, 12)
    ]

    def build():
        return SelectiveLoader(
            batches,
            IndexLoss(),
            policy=SelectiveBackprop(1 / 3, history=64),
            batch_size=5,
            index_key=2,
            seed=0,
        )

    def rows(got):
        return [(b.indices.tolist(), b.losses.tolist(), b.probabilities.tolist()) for b in got]

    whole = build()
    full = rows(b for _ in range(3) for b in whole)
    loader = build()
    got = rows(loader)
    it = iter(loader)
    got += rows(next(it) for _ in range(stop_after))
    state = copy.deepcopy(loader.state_dict())
    del it
    resumed = build()
    resumed.load_state_dict(state)
    got += rows(resumed)  # the rest of epoch 1
    got += rows(resumed)  # epoch 2
    assert got == full
    assert [e.epoch for e in resumed.stats.epochs] == [0, 1, 2]
    # every pass reads all ten source batches, the resumed one too (its first ones before the
    # checkpoint), and selects from each of the 120 examples
    for stats in (whole.stats, resumed.stats):
        assert [e.examples_seen for e in stats.epochs] == [120] * 3


def test_mid_epoch_resume_without_a_generator_is_refused_with_the_fix():
    dl = DataLoader(EncodedDataset(), batch_size=20, shuffle=True)
    loader = SelectiveLoader(dl, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=10)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = SelectiveLoader(
        DataLoader(EncodedDataset(), batch_size=20, shuffle=True),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=10,
    )
    with pytest.raises(ValueError, match=r"generator=torch\.Generator"):
        other.load_state_dict(state)


@pytest.mark.parametrize("indices", [np.array([5, 2, 2**40], dtype=np.int64), None])
def test_passthrough_metadata_equals_the_general_path_for_every_example(indices):
    """Traditional's fast path builds exactly the rows the general path would for a choice
    of every example: same values (NaN losses), dtypes and devices."""
    from sbloader.policies import Choice
    from sbloader.rows import metadata_rows

    cpu = torch.device("cpu")
    data = [torch.arange(3)]
    fast = metadata_rows(data, None, None, indices, 3, cpu)
    everything = Choice.everything(3)
    general = metadata_rows(data, everything.positions, everything, indices, 3, cpu)
    for name in ("indices", "losses", "probabilities", "weights"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and a.device == b.device
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    if indices is not None:
        indices[0] = 7  # the yielded indices are a copy, not a view of the source's buffer
        assert fast.indices[0] == 5


def test_batches_follow_the_model_moved_between_epochs_not_within_one() -> None:
    """Without ``device=``, an epoch's batches go where the model was when the epoch began."""
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    model = nn.Linear(4, 2)
    loader = SelectiveLoader(
        DataLoader(ArrayDataset(x, y), batch_size=16),
        model,
        policy=Traditional(),
        batch_size=16,
    )
    it = iter(loader)
    first = next(it)
    model.to("meta")  # mid-epoch: the epoch keeps the device it began with
    rest = list(it)
    assert [b[0].device.type for b in [first, *rest]] == ["cpu"] * 4
    # The next epoch looks again, and finds the model on the meta device (refused, with the fix).
    with pytest.raises(ValueError, match="meta device"):
        next(iter(loader))


def test_traditional_batch_columns_are_independent() -> None:
    """A caller scaling one batch's weights in place changes neither its probabilities nor its
    losses, nor any later batch's (the columns share one allocation per batch)."""
    x, y = torch.randn(48, 4), torch.randint(0, 2, (48,))
    loader = SelectiveLoader(
        DataLoader(ArrayDataset(x, y), batch_size=16),
        nn.Linear(4, 2),
        policy=Traditional(),
        batch_size=16,
    )
    batches = []
    for b in loader:
        b.weights.mul_(3.0)
        batches.append(b)
    for b in batches:
        assert torch.equal(b.weights, torch.full((16,), 3.0))
        assert torch.equal(b.probabilities, torch.ones(16))
        assert b.losses is None or torch.isnan(b.losses).all()


@pytest.mark.parametrize("metadata_key", [None, "sb"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_whole_source_batches_carry_the_metadata_of_rebatched_ones(metadata_key, channels_last):
    """Traditional hands out a source batch of the training batch size whole, its metadata made
    when first read; re-batched from larger source batches, the same examples carry the same
    metadata, read at once or later, pickled or copied."""
    import pickle

    images = torch.arange(48 * 3 * 2 * 2, dtype=torch.float32).reshape(48, 3, 2, 2)
    data = ArrayDataset(images, torch.arange(48) % N_CLASSES)
    fmt = torch.channels_last if channels_last else None

    def batches(source_batch: int) -> list:
        loader = SelectiveLoader(
            DataLoader(data, batch_size=source_batch, shuffle=True, generator=gen()),
            nn.Sequential(nn.Flatten(), nn.Linear(12, N_CLASSES)),
            policy=Traditional(),
            batch_size=8,
            metadata_key=metadata_key,
            memory_format=fmt,
        )
        return list(loader)

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(5)

    whole, rebatched = batches(8), batches(24)
    assert len(whole) == len(rebatched) == 6
    later = [pickle.loads(pickle.dumps(b)) for b in whole[:2]] + [copy.copy(b) for b in whole[2:]]
    for w, r, p in zip(whole, rebatched, later):
        assert torch.equal(w[0], r[0]) and torch.equal(w[1], r[1])
        assert w[0].is_contiguous(memory_format=fmt or torch.contiguous_format)
        for name in ("indices", "losses", "probabilities", "weights"):
            for b in (w, p):
                got, want = getattr(b, name), getattr(r, name)
                assert got.dtype == want.dtype
                assert torch.equal(got.nan_to_num(-1), want.nan_to_num(-1))
                if metadata_key is not None:
                    assert torch.equal(b[2][name].nan_to_num(-1), want.nan_to_num(-1))
        assert w.features is None and w.logits is None
    assert torch.equal(torch.cat([b.indices for b in whole]).sort().values, torch.arange(48))


@pytest.mark.parametrize("policy", [Traditional(), SelectiveBackprop(1 / 2)])
def test_the_memory_format_goes_to_the_input_field_wherever_it_is(policy):
    """``memory_format`` applies to the model's input, named by ``input_key``, not to the first
    field: here the images are the second of three 4-d fields. The selection forward and the
    yielded batch get them channels_last; the other fields keep their layout."""
    n = 32
    masks = torch.arange(n * 3 * 2 * 2, dtype=torch.float32).reshape(n, 3, 2, 2)
    images = masks.flip(0) + 0.5
    rows = list(zip(masks, images, torch.arange(n) % N_CLASSES))
    seen: list[bool] = []

    class Records(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(12, N_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(bool(x.is_contiguous(memory_format=torch.channels_last)))
            return self.fc(x.flatten(1))

    loader = SelectiveLoader(
        DataLoader(rows, batch_size=16),
        Records(),
        policy=policy,
        batch_size=8,
        input_key=1,
        target_key=2,
        memory_format=torch.channels_last,
        seed=0,
    )
    batches = list(loader)
    assert batches and (seen or isinstance(policy, Traditional))
    assert all(seen)
    for b in batches:
        assert b[1].is_contiguous(memory_format=torch.channels_last)
        assert not b[1].is_contiguous()
        assert b[0].is_contiguous() and not b[0].is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(b[1], images[b.indices])
        assert torch.equal(b[0], masks[b.indices])


def test_metadata_set_by_the_caller_before_any_was_read_is_kept():
    """A whole batch's metadata is made when first read; a value the caller set before that
    (``batch.weights = ...``) stays when another attribute is read, pickled or copied."""
    import pickle

    data = ArrayDataset(torch.randn(16, 3), torch.arange(16) % N_CLASSES)
    loader = SelectiveLoader(
        DataLoader(data, batch_size=8), nn.Linear(3, N_CLASSES), policy=Traditional(), batch_size=8
    )
    first, second = list(loader)
    mine = torch.full((8,), 2.0)
    first.weights = mine
    assert first.losses.isnan().all() and first.weights is mine
    second.indices = None
    twin = pickle.loads(pickle.dumps(second))
    assert second.indices is None and twin.indices is None
    assert torch.equal(twin.weights, torch.ones(8)) and torch.equal(second.weights, torch.ones(8))
    fresh = next(iter(loader))  # listed before any was read
    assert {"indices", "losses", "probabilities", "weights"} <= set(dir(fresh))


def test_metadata_first_read_in_inference_mode_still_trains():
    """A whole batch's metadata is made when first read; read first inside
    ``torch.inference_mode()`` (a logging line), its weights must still multiply a loss that is
    backpropagated (inference tensors cannot be saved for backward)."""
    data = ArrayDataset(torch.randn(16, 3), torch.arange(16) % N_CLASSES)
    model = nn.Linear(3, N_CLASSES)
    loader = SelectiveLoader(
        DataLoader(data, batch_size=8), model, policy=Traditional(), batch_size=8
    )
    for batch in loader:
        x, y = batch
        with torch.inference_mode():
            assert len(batch.indices.tolist()) == 8
        assert not batch.weights.is_inference() and not batch.losses.is_inference()
        loss = nn.functional.cross_entropy(model(x), y, reduction="none") * batch.weights
        loss.mean().backward()


def test_the_source_classes_refuse_what_they_cannot_read_naming_it():
    """DataLoaderSource and IterableSource, public for sources of one's own, name the parameter
    and the fix for what they cannot read (a bare AttributeError or "'NoneType' object is not
    iterable" before)."""
    from torch.utils.data import IterableDataset

    from sbloader.sources import DataLoaderSource, IterableSource

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(4)

    for bad, what in (([1, 2], "list"), (DataLoader(Stream()), "a DataLoader over an iterable")):
        with pytest.raises(TypeError, match=rf"DataLoaderSource's loader should be .* got {what}"):
            DataLoaderSource(bad)
    with pytest.raises(TypeError, match=r"IterableSource's iterable should be .* got NoneType"):
        IterableSource(None)
    assert len(list(DataLoaderSource(DataLoader(EncodedDataset(8), batch_size=4)).epoch())) == 2
    assert IterableSource([(torch.zeros(2), torch.zeros(2))]).has_indices() is False


def test_make_source_adapts_each_kind_of_source_and_checks_dataset_size():
    """Which Source wraps what: a Source as it is; a DataLoader over a map-style dataset through
    its indices, with index_key as it iterates; a DataLoader over an iterable dataset, and a list,
    as iterables (index_key and dataset_size kept); torchdata's StatefulDataLoader (a subclass
    too) by its own state, and not a class that only shares its name; a dataset_size that the
    source contradicts, and what is not iterable, refused."""
    from torch.utils.data import IterableDataset

    from sbloader.adapt import make_source
    from sbloader.sources import DataLoaderSource, IterableSource
    from sbloader.stateful import StatefulSource

    class Stream(IterableDataset):
        def __iter__(self):
            yield from (EncodedDataset(8)[i] for i in range(8))

    class NamedLike(DataLoader):  # another library's class named as torchdata's
        pass

    NamedLike.__name__ = NamedLike.__qualname__ = "StatefulDataLoader"
    ds = EncodedDataset(8)
    own = DataLoaderSource(DataLoader(ds, batch_size=4))
    assert make_source(own) is own
    kinds = [
        (DataLoader(ds, batch_size=4), {}, DataLoaderSource),
        (DataLoader(ds, batch_size=4), {"index_key": 2}, IterableSource),
        (DataLoader(Stream(), batch_size=4), {"dataset_size": 8}, IterableSource),
        (NamedLike(ds, batch_size=4), {}, DataLoaderSource),
    ]
    for source, kwargs, kind in kinds:
        assert type(make_source(source, **kwargs)) is kind, (source, kind)
    listed = make_source([(torch.zeros(2, 6), torch.zeros(2), torch.tensor([0, 1]))], 2, 8)
    assert listed.has_indices() and listed.dataset_size == 8
    with pytest.raises(ValueError, match="dataset_size=9 was given, but the DataLoaderSource has"):
        make_source(DataLoader(ds, batch_size=4), dataset_size=9)
    with pytest.raises(TypeError, match="an FFCV Loader or an iterable of batches, but got int"):
        make_source(3)
    stateful = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

    class Resumable(stateful):
        pass

    assert type(make_source(Resumable(ds, batch_size=4))) is StatefulSource


def test_a_source_of_ones_own_answering_has_indices_with_a_falsy_value_is_taken():
    """A Source of one's own whose has_indices() returns a falsy non-bool (None, 0) is a source
    without indices, as before: the default policy's store choice reads it as a bool (it was
    refused naming has_store=, a parameter the user never passed)."""
    from sbloader.sources import IterableSource

    class Mine(IterableSource):
        def has_indices(self):  # type: ignore[override]
            return None

    batches = [(torch.randn(6, 3), torch.arange(6) % N_CLASSES) for _ in range(3)]
    loader = SelectiveLoader(Mine(batches), nn.Linear(3, N_CLASSES), batch_size=2, seed=0)
    assert loader.policy.policy.staleness == 1  # plain SB after the warm-up: no store
    assert sum(len(b[0]) for b in loader) > 0


@pytest.mark.parametrize("kind", ["dataloader", "stateful"])
@pytest.mark.parametrize("drop_last", [True, False])
def test_len_follows_a_batch_samplers_drop_last(kind, drop_last):
    """A batch_sampler= decides whether the last partial batch is dropped (the DataLoader's own
    drop_last is then False): len(loader) counts what the epoch yields, as a length-hungry
    scheduler needs."""
    from torch.utils.data import BatchSampler, SequentialSampler

    data = EncodedDataset(100)
    batches = BatchSampler(SequentialSampler(data), 32, drop_last=drop_last)
    if kind == "stateful":
        stateful = pytest.importorskip("torchdata.stateful_dataloader")
        source = stateful.StatefulDataLoader(data, batch_sampler=batches)
    else:
        source = DataLoader(data, batch_sampler=batches)
    loader = SelectiveLoader(source, IndexLoss(), policy=Traditional(), batch_size=32)
    yielded = [len(b.indices) for b in loader]
    assert len(loader) == len(yielded) == (3 if drop_last else 4)
    assert yielded[:3] == [32, 32, 32]


def test_a_policy_given_to_a_second_loader_stops_the_first_instead_of_corrupting_it():
    """Attaching a policy starts its run afresh (window, store, pass schedule): the first loader
    is refused once the policy went to another one (naming the fix), while building a loader
    again with the same policy and using only the new one works (a notebook cell run twice)."""
    shared = SelectiveBackprop(0.5, staleness=3)
    first = make_loader(policy=shared)
    list(first)
    second = make_loader(policy=shared)
    for call in (lambda: iter(first), first.state_dict, lambda: first.feedback([0], [1.0])):
        with pytest.raises(RuntimeError, match=r"copy\.deepcopy\(policy\)"):
            call()
    assert len(list(second)) > 0  # the newest loader goes on
    inner = SelectiveBackprop(0.5)
    wrapped = make_loader(policy=Phased(inner, warmup_epochs=1))
    make_loader(policy=inner)  # the wrapped policy, given on its own to another loader
    with pytest.raises(RuntimeError, match="was given to another SelectiveLoader"):
        iter(wrapped)
    own = make_loader(policy=copy.deepcopy(shared))
    assert len(list(own)) > 0 and len(list(second)) > 0


def test_unhashable_and_slotted_custom_policies_still_build_loaders():
    """The one-loader-per-policy check keys on the policy's identity: a policy written as a
    dataclass (eq=True: no hash) is checked too, and one that cannot be weakly referenced is
    simply not checked."""
    import dataclasses

    @dataclasses.dataclass(eq=True)
    class Half(RandomBackprop):
        rate: float = 0.5

        def __post_init__(self) -> None:
            RandomBackprop.__init__(self, self.rate)

    policy = Half()
    first = make_loader(policy=policy)
    assert len(list(first)) > 0
    make_loader(policy=policy)
    with pytest.raises(RuntimeError, match="was given to another SelectiveLoader"):
        iter(first)


# ---------------------------------------------------------------------- what the source sees
class _OpenedInWorkers(torch.utils.data.Dataset):
    """h5py/lmdb style: a handle opened by worker_init_fn through get_worker_info().dataset,
    and a per-worker offset set the same way."""

    def __init__(self) -> None:
        self.handle: str | None = None
        self.offset = 0

    def open(self) -> None:
        info = torch.utils.data.get_worker_info()
        self.handle, self.offset = f"worker {info.id}", 1000 * (info.id + 1)

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        if self.handle is None:
            raise RuntimeError("dataset not opened")
        return torch.full((4,), float(i + self.offset)), i % 3


def _open_in_worker(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert isinstance(info.dataset, _OpenedInWorkers), type(info.dataset)
    info.dataset.open()


def test_worker_init_fn_sees_the_users_dataset_in_each_worker():
    """A worker_init_fn that opens a handle or sets an attribute on get_worker_info().dataset
    works as with the plain DataLoader (it got sbloader's index wrapper: AttributeError, or an
    attribute set that the dataset never read)."""
    source = DataLoader(
        _OpenedInWorkers(), batch_size=6, num_workers=2, worker_init_fn=_open_in_worker
    )
    plain = sorted(float(x[0]) for b in source for x in b[0])
    loader = SelectiveLoader(source, nn.Linear(4, 3), policy=Traditional(), batch_size=6)
    got = sorted(float(x[0]) for b in loader for x in b[0])
    assert got == plain and min(got) >= 1000  # every example came through an opened worker
    # attributes of the dataset read through sbloader's wrapper are the dataset's
    from sbloader.sources import IndexedDataset

    data = _OpenedInWorkers()
    wrapped = IndexedDataset(data)
    wrapped.offset = 7
    assert data.offset == 7 and wrapped.offset == 7 and wrapped.dataset is data


class _Normalising(DataLoader):
    def __iter__(self):
        for x, y in super().__iter__():
            yield (x - 100.0) / 10.0, y


class _KeepsIterator(DataLoader):
    """As SpeechBrain's SaveableDataLoader: its __iter__ only keeps the iterator."""

    def __iter__(self):
        self.last = super().__iter__()
        return self.last


def test_a_dataloader_subclass_with_its_own_iter_is_warned_of_with_the_fix():
    """sbloader iterates a plain DataLoader of the same arguments to recover indices: a
    subclass's own __iter__ is not run (its batch processing was skipped silently: the batches
    came back unnormalised), so it is warned of, naming the fixes; one whose __iter__ changes
    nothing trains as the plain DataLoader does."""
    data = torch.utils.data.TensorDataset(torch.full((20, 4), 100.0), torch.zeros(20).long())
    with pytest.warns(UserWarning, match=r"_Normalising's own __iter__ is not run.*collate_fn"):
        SelectiveLoader(_Normalising(data, batch_size=5), nn.Linear(4, 3))
    with pytest.warns(UserWarning, match=r"_KeepsIterator's own __iter__ is not run") as said:
        kept = SelectiveLoader(_KeepsIterator(data, batch_size=5), nn.Linear(4, 3))
    with pytest.warns(UserWarning, match=r"_KeepsIterator's own __iter__ is not run") as el2n:
        sbloader.el2n_scores(
            lambda: nn.Linear(4, 3),
            _KeepsIterator(data, batch_size=5),
            make_optimizer=lambda m: torch.optim.SGD(m.parameters(), 0.1),
            models=1,
            epochs=0,
        )
    # It names the caller's line (sbloader's own call of make_source before), which warning
    # filters by module and Python's once-per-location default go by.
    assert [w.filename for w in (*said, *el2n)] == [__file__, __file__]
    plain = SelectiveLoader(DataLoader(data, batch_size=5), nn.Linear(4, 3))
    assert [b.indices.tolist() for b in kept] == [b.indices.tolist() for b in plain]


class _ScaledKeys(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, key):
        i, scale = key
        return torch.full((4,), float(i)) * scale, i % 3


class _ScaleSampler(torch.utils.data.Sampler):
    def __iter__(self):
        return iter([(i, 1 + i % 2) for i in range(20)])

    def __len__(self) -> int:
        return 20


@pytest.mark.parametrize("kind", ["tuples", "strings"])
def test_a_sampler_of_non_integer_keys_is_refused_on_the_first_batch_naming_index_key(kind):
    """Keys that are not integer dataset indices (multi-scale (index, scale) pairs, string
    keys) gave 2-d batch.indices silently, or errors that named no sampler."""
    if kind == "tuples":
        source = DataLoader(_ScaledKeys(), batch_size=5, sampler=_ScaleSampler())
    else:
        keyed = {f"img{i}": (torch.full((4,), float(i)), i % 3) for i in range(20)}
        source = DataLoader(keyed, batch_size=5, sampler=list(keyed))  # a dict is map-style
    loader = SelectiveLoader(source, nn.Linear(4, 3), policy=SelectiveBackprop(0.5), batch_size=5)
    with pytest.raises(TypeError, match=r"not integer dataset indices .*index_key="):
        next(iter(loader))


def test_a_whole_source_batch_never_overtakes_rows_pending_from_a_shorter_one():
    """A passthrough epoch hands a source batch of batch_size out whole only with nothing
    pending: after a short source batch (a bucketing batch_sampler=) its rows wait, and the
    next full source batch is re-batched behind them, so every example comes once, in order."""
    data = EncodedDataset(12)
    source = DataLoader(data, batch_sampler=[[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10], [11]])
    loader = SelectiveLoader(source, IndexLoss(), policy=Traditional(), batch_size=4)
    yielded = [b.indices.tolist() for b in loader]
    assert yielded == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
