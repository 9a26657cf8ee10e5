"""ArrayDataset's batched fetching and its collate function: the same batches as torch's
default collate function makes, without splitting the gathered tensors into rows."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import sbloader
from sbloader.datasets import ArrayDataset, ArrayRows


def dataset(n: int = 103) -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    return ArrayDataset(
        torch.randn(n, 3, 4, generator=g),
        torch.randint(0, 10, (n,), generator=g),
        torch.arange(n, dtype=torch.float64),
    )


def batches(ds, collate_fn, batch_size, drop_last=False):
    kw = {} if collate_fn is None else {"collate_fn": collate_fn}
    dl = DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(1),
        **kw,
    )
    return list(dl)


@pytest.mark.parametrize("batch_size", [1, 7, 32, 103, 200])
@pytest.mark.parametrize("drop_last", [False, True])
def test_collate_gives_the_default_collates_batches(batch_size, drop_last):
    ds = dataset()
    fast = batches(ds, ArrayDataset.collate, batch_size, drop_last)
    slow = batches(ds, None, batch_size, drop_last)
    assert len(fast) == len(slow) > 0 or drop_last
    for a, b in zip(fast, slow):
        assert type(a) is type(b) is list and len(a) == len(b) == 3
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous()
            assert torch.equal(x, y)


def test_rows_are_a_sequence_of_tuples_for_any_collate_function():
    ds = dataset(10)
    rows = ds.__getitems__([4, 1, 7])
    assert isinstance(rows, ArrayRows) and len(rows) == 3
    assert [int(r[2]) for r in rows] == [4, 1, 7]
    assert all(torch.equal(a, b) for a, b in zip(rows[1], ds[1]))
    # Anything else goes through the default collate function.
    plain = [ds[4], ds[1]]
    assert all(
        torch.equal(a, b) for a, b in zip(ArrayDataset.collate(plain), default_collate(plain))
    )


@pytest.mark.parametrize(
    "policy", [sbloader.Traditional, lambda: sbloader.SelectiveBackprop(0.5)], ids=["trad", "sb"]
)
def test_a_selective_loader_over_it_yields_the_same_batches_and_indices(policy):
    """The loader wraps the DataLoader's fetch and collate (to learn the dataset indices): with
    ArrayDataset.collate it yields exactly what it yields with the default collate function."""

    def run(collate_fn):
        kw = {} if collate_fn is None else {"collate_fn": collate_fn}
        dl = DataLoader(
            dataset(), batch_size=20, shuffle=True, generator=torch.Generator().manual_seed(2), **kw
        )
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10))
        loader = sbloader.SelectiveLoader(
            dl, model, policy=policy(), batch_size=10, seed=0, input_key=0, target_key=1
        )
        out = []
        for batch in loader:
            x, y, i = batch
            assert torch.equal(i.long(), batch.indices)  # the third tensor holds each row's index
            out.append((x.clone(), y.clone(), batch.indices.clone()))
        return out

    fast, slow = run(ArrayDataset.collate), run(None)
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_tensors_of_different_lengths_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"tensor 1 has 4 rows but tensor 0 has 3"):
        ArrayDataset(torch.zeros(3, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="at least one tensor"):
        ArrayDataset()
