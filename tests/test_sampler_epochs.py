"""Samplers that reshuffle by epoch are told each pass's epoch, whichever way the loader reads
the DataLoader: indices recovered, an ``index_key=`` field, a ``batch_sampler=`` that shards
and shuffles itself, or a StatefulDataLoader."""

from __future__ import annotations

import pytest
import torch
from conftest import N_CLASSES, EncodedDataset, IndexLoss
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from sbloader import SelectiveBackprop, SelectiveLoader, Traditional

N = 40


class WithIndex(Dataset):
    """EncodedDataset's examples with their index as a third field."""

    def __init__(self) -> None:
        self.base = EncodedDataset(N)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x, y, i


class ShardingBatchSampler(Sampler[list[int]]):
    """Batches of this rank's share of a permutation drawn from ``seed + epoch`` (as distributed
    bucketing samplers do): the order changes only through ``set_epoch``."""

    def __init__(self, n: int, batch_size: int, rank: int = 0, replicas: int = 2) -> None:
        self.n, self.batch_size, self.rank, self.replicas = n, batch_size, rank, replicas
        self.epoch = 0
        self.told: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.told.append(epoch)

    def order(self, epoch: int) -> list[int]:
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        return perm[self.rank :: self.replicas]

    def __iter__(self):
        mine = self.order(self.epoch)
        for start in range(0, len(mine), self.batch_size):
            yield mine[start : start + self.batch_size]

    def __len__(self) -> int:
        return -(-len(range(self.rank, self.n, self.replicas)) // self.batch_size)


def epochs_of(loader: SelectiveLoader, epochs: int) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        got = []
        for b in loader:
            assert torch.equal(b[1], b.indices % N_CLASSES)  # inputs, targets, indices paired
            assert torch.equal(b[0][:, 0].long(), b.indices)
            got += b.indices.tolist()
        out.append(got)
    return out


def distributed(epoch: int) -> list[int]:
    s = DistributedSampler(range(N), num_replicas=2, rank=0, shuffle=True, seed=0)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("index_key", [None, 2], ids=["recovered", "index_key"])
def test_a_distributed_sampler_reshuffles_every_epoch(index_key):
    sampler = DistributedSampler(WithIndex(), num_replicas=2, rank=0, shuffle=True, seed=0)
    source = DataLoader(WithIndex(), batch_size=5, sampler=sampler)
    loader = SelectiveLoader(
        source, IndexLoss(), policy=Traditional(), batch_size=5, index_key=index_key, seed=0
    )
    assert epochs_of(loader, 3) == [distributed(e) for e in range(3)]


SAVED = {"seed": 0, "shuffle": True, "drop_last": False}


@pytest.mark.parametrize("index_key", [None, 2], ids=["recovered", "index_key"])
@pytest.mark.parametrize(
    "other", [dict(seed=1), dict(shuffle=False), dict(drop_last=True)], ids=lambda o: str(o)
)
def test_a_mid_epoch_state_of_another_distributed_order_is_refused_naming_it(index_key, other):
    """A DistributedSampler draws each epoch's order from seed + epoch, with no generator state
    to save: a mid-epoch state loaded into one with another seed, shuffle or drop_last skipped
    the consumed batches of another order (some examples trained twice in the epoch, others
    never), unsaid. Refused, naming the setting; the same sampler resumes exactly, and at an
    epoch's end another seed is the user's to choose (the next epoch drawn afresh)."""

    def build(**kw):
        options = {**SAVED, "num_replicas": 2, "rank": 0, **kw}
        sampler = DistributedSampler(WithIndex(), **options)
        source = DataLoader(WithIndex(), batch_size=5, sampler=sampler)
        return SelectiveLoader(
            source, IndexLoss(), policy=Traditional(), batch_size=5, index_key=index_key, seed=0
        )

    reference = epochs_of(build(), 2)
    loader = build()
    it = iter(loader)
    head = [next(it).indices.tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    key, value = next(iter(other.items()))
    match = rf"has {key}={value!r} here but {key}={SAVED[key]!r} in the saved run"
    with pytest.raises(ValueError, match=match):
        build(**other).load_state_dict(state)
    resumed = build()
    resumed.load_state_dict(state)
    rest = epochs_of(resumed, 2)
    assert [i for b in head for i in b] + rest[0] == reference[0] and rest[1] == reference[1]
    ended = build()
    epochs_of(ended, 1)
    build(**other).load_state_dict(ended.state_dict())  # (an epoch's end: loads)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("index_key", [None, 2], ids=["recovered", "index_key"])
def test_a_shuffling_dataloader_draws_its_own_order_every_epoch(index_key, workers):
    """Each epoch is the one the DataLoader draws on its own from the same generator state, also
    read with ``index_key=``; and building the loader draws nothing from that generator nor
    starts workers. Read with ``index_key=``, the constructor called ``iter()`` on the
    DataLoader to check that it was re-iterable: that drew a base seed from its generator (every
    epoch's order was then another than the DataLoader's) and started its worker processes."""

    def source() -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(WithIndex(), batch_size=8, shuffle=True, generator=g, num_workers=workers)

    own = source()
    expected = [[i for b in own for i in b[2].tolist()] for _ in range(2)]
    dl = source()
    before = dl.generator.get_state()
    loader = SelectiveLoader(
        dl, IndexLoss(), policy=Traditional(), batch_size=8, index_key=index_key, seed=0
    )
    assert torch.equal(dl.generator.get_state(), before)
    assert epochs_of(loader, 2) == expected


def stateful(ds, **kw):
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    return tdl.StatefulDataLoader(ds, **kw)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("kind", [DataLoader, stateful], ids=["DataLoader", "Stateful"])
@pytest.mark.parametrize("index_key", [None, 2], ids=["recovered", "index_key"])
def test_a_batch_sampler_that_shuffles_by_epoch_is_told_the_epoch(kind, index_key):
    batches = ShardingBatchSampler(N, 4)
    source = kind(WithIndex(), batch_sampler=batches)
    loader = SelectiveLoader(
        source, IndexLoss(), policy=Traditional(), batch_size=4, index_key=index_key, seed=0
    )
    got = epochs_of(loader, 3)
    assert got == [batches.order(e) for e in range(3)]
    assert len(set(map(tuple, got))) == 3
    assert sorted(set(batches.told)) == [0, 1, 2]


def test_counts_of_a_batch_sampler_that_shards_are_this_ranks_share():
    """A batch_sampler= that shards by rank (no sampler of its own): len(), progress and the
    expected batches count this rank's batches, not the whole dataset's."""
    source = DataLoader(WithIndex(), batch_sampler=ShardingBatchSampler(N, 4))
    loader = SelectiveLoader(source, IndexLoss(), policy=Traditional(), batch_size=4, seed=0)
    assert len(source) == 5
    assert len(loader) == 5 == len(list(loader))
    assert loader.progress == 1.0
    it = iter(loader)
    for _ in range(2):
        next(it)
    assert loader.progress == pytest.approx(1.4)
    sb = SelectiveLoader(
        DataLoader(WithIndex(), batch_sampler=ShardingBatchSampler(N, 4)),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=2,
        seed=0,
    )
    assert sb.expected_batches() == pytest.approx(20 * 0.5 / 2)


def test_a_sharding_batch_sampler_without_a_batch_size_names_the_fix():
    class Bare:  # batches of 4 without a batch_size attribute
        def __init__(self) -> None:
            self.inner = ShardingBatchSampler(N, 4)

        def __iter__(self):
            return iter(self.inner)

        def __len__(self) -> int:
            return len(self.inner)

    source = DataLoader(WithIndex(), batch_sampler=Bare())
    loader = SelectiveLoader(source, IndexLoss(), policy=Traditional(), batch_size=4, seed=0)
    with pytest.raises(TypeError, match="batch_sampler= draws the batches itself"):
        len(loader)
    with pytest.raises(TypeError, match="batches_per_epoch= an int"):
        loader.expected_batches()
