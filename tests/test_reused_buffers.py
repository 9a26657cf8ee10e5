"""A source that reuses its buffers (as FFCV's ring does), without FFCV: every batch the loader
hands out holds its own examples, whatever the source writes after."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import N_CLASSES, IndexLoss

from sbloader import SelectiveLoader, Traditional
from sbloader.sources import Source


class Ring(Source):
    """Example i has input [i] * 6 and target i % N_CLASSES, in batches of ``batch`` written
    into one set of buffers (data and indices): fetching a batch overwrites the one before, the
    most any source reusing its buffers may do (FFCV's ring is overwritten as its consumer
    moves on). ``sized=False``: a source that cannot tell its size."""

    def __init__(self, n: int, batch: int = 10, sized: bool = True) -> None:
        self.n, self.batch, self.sized = n, batch, sized
        self.x = torch.zeros(batch, 6)
        self.y = torch.zeros(batch, dtype=torch.int64)
        self.idx = np.zeros(batch, dtype=np.int64)

    @property
    def batch_size(self) -> int:
        return self.batch

    @property
    def dataset_size(self) -> int | None:
        return self.n if self.sized else None

    def has_indices(self) -> bool:
        return True

    def reuses_buffers(self) -> bool:
        return True

    def epoch(self, skip: int = 0, keep: Any = None) -> Any:
        for start in range(skip * self.batch, self.n, self.batch):
            k = min(self.batch, self.n - start)
            i = torch.arange(start, start + k)
            self.x[:k] = i[:, None].float()
            self.y[:k] = i % N_CLASSES
            self.idx[:k] = i.numpy()
            yield (self.x[:k], self.y[:k]), self.idx[:k]


def own(batch: Any) -> list[int]:
    """The batch's indices, after checking that its inputs and targets are its examples'."""
    x, y = batch
    idx = batch.indices
    assert torch.equal(x[:, 0].long(), idx) and (x == x[:, :1]).all()
    assert torch.equal(y, idx % N_CLASSES)
    return idx.tolist()


def ranges(n: int, size: int) -> list[list[int]]:
    return [list(range(s, min(s + size, n))) for s in range(0, n, size)]


def test_running_ahead_declared_before_the_first_batch_needs_no_size():
    """A caller that declares runs_ahead() before its first batch gets copies of every source
    batch handed out whole, so that finishing() may take the next one, also where the source
    cannot tell how many examples are left; declared only by a first finishing() after a batch
    of the source's own, it is refused there, naming the fix."""
    loader = SelectiveLoader(Ring(40, sized=False), IndexLoss(), policy=Traditional())
    it = iter(loader)
    it.runs_ahead()
    got, ends = [], []
    for batch in it:
        ends.append(it.finishing())
        got.append(own(batch))
    assert got == ranges(40, 10) and ends == [False, False, False, True]
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="call runs_ahead"):
        it.finishing()


@pytest.mark.parametrize(("min_batch_size", "sizes"), [(1, [10, 1]), (2, [10])])
def test_finishing_while_holding_the_sources_own_batch_counts_what_is_left(min_batch_size, sizes):
    """finishing() first called while the caller holds a batch that is the source's own buffers
    answers from the examples left, without taking the next batch: another batch comes where
    they make at least min_batch_size (here 1 example is left after the first batch)."""
    loader = SelectiveLoader(
        Ring(11), IndexLoss(), policy=Traditional(), batch_size=10, min_batch_size=min_batch_size
    )
    it = iter(loader)
    first = next(it)
    assert it.finishing() == (len(sizes) == 1)
    got = [own(first), *(own(b) for b in it)]
    assert [len(b) for b in got] == sizes


def test_metadata_read_after_the_source_moved_on_is_each_batchs_own():
    """A source batch handed out whole is the source's buffers, valid until the next is
    fetched; its metadata, made when first read, is its own whenever it is read."""
    loader = SelectiveLoader(Ring(40), IndexLoss(), policy=Traditional(), batch_size=10)
    batches = list(loader)
    assert [b.indices.tolist() for b in batches] == ranges(40, 10)
    assert all(b.weights.tolist() == [1.0] * 10 for b in batches)


@pytest.mark.parametrize("declared", [False, True], ids=["source's own", "copies"])
def test_a_batch_of_the_sources_own_buffers_is_not_taken_back_once_the_next_is_handed_out(
    declared,
):
    """state_dict(unconsumed=2) (a step that raised with a batch fetched ahead) takes back the
    two batches handed out last, copied as the state is taken. A batch handed out as the
    source's own buffers, once the next is handed out, holds whatever the source wrote since
    (here the next batch's examples): refused, naming why and the fix, not saved wrong. With
    runs_ahead() declared first, batches are handed out as copies and both are taken back."""
    loader = SelectiveLoader(Ring(40), IndexLoss(), policy=Traditional())
    it = iter(loader)
    if declared:
        it.runs_ahead()
    first, second = own(next(it)), own(next(it))
    assert first == list(range(10)) and second == list(range(10, 20))
    assert loader.takes_back(1) and loader.takes_back(2) == declared
    if not declared:
        with pytest.raises(ValueError, match=r"source's own reused buffers.*runs_ahead\(\)"):
            loader.state_dict(unconsumed=2)
        state = loader.state_dict(unconsumed=1)
        assert [r["indices"].tolist() for r in state["returned"]] == [second]
        return
    state = loader.state_dict(unconsumed=2)
    assert [r["indices"].tolist() for r in state["returned"]] == [first, second]
    for rows in state["returned"]:  # (each with its own examples' data)
        x, y = rows["data"]
        assert torch.equal(x[:, 0].long(), rows["indices"]) and torch.equal(
            y, rows["indices"] % N_CLASSES
        )
