"""Source batches fetched ahead on a background thread: same batches, same stats, clean stops."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EncodedDataset, IndexLoss
from torch.utils.data import DataLoader

from sbloader import (
    Phased,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
    Traditional,
)
from sbloader.prefetch import Prefetcher


class CountingDataset(EncodedDataset):
    def __init__(self, n=300, fail_at=None):
        super().__init__(n)
        self.loaded = 0
        self.fail_at = fail_at

    def __getitem__(self, i):
        if self.fail_at is not None and int(i) == self.fail_at:
            raise RuntimeError(f"cannot read example {i}")
        self.loaded += 1
        return super().__getitem__(i)


def build(policy_fn, prefetch, ds=None, workers=0, **kw):
    ds = ds if ds is not None else EncodedDataset(600)
    dl = DataLoader(
        ds,
        batch_size=30,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    return SelectiveLoader(
        dl, IndexLoss(), policy=policy_fn(), batch_size=10, seed=0, prefetch=prefetch, **kw
    )


def prefetch_threads(before=()):
    """The loader's prefetch threads alive now, except those in ``before`` (left by an earlier
    test of the session, whose abandoned iterator the garbage collector has not reached yet)."""
    return [t for t in threading.enumerate() if t.name == "sbloader-prefetch" and t not in before]


POLICIES = {
    "sb": lambda: SelectiveBackprop(1 / 3, history=64),
    "stale": lambda: SelectiveBackprop(1 / 3, history=64, staleness=3),
    "phased": lambda: Phased(
        SelectiveBackprop(0.5, history=32, staleness=2),
        warmup_epochs=1,
        warmup_policy=RandomBackprop(0.5),
    ),
    "traditional": Traditional,
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_prefetching_yields_the_same_batches_and_stats(name):
    runs = {}
    for prefetch in (0, 2):
        loader = build(POLICIES[name], prefetch, subset=np.arange(0, 600, 2))
        batches = [(b.indices.tolist(), b[1].tolist()) for _ in range(4) for b in loader]
        stats = [e.as_dict() for e in loader.stats.epochs]
        for s in stats:
            for k in [k for k in s if k.endswith("_s")]:
                del s[k]  # times differ; counts must not
        runs[prefetch] = (batches, stats)
    assert runs[0] == runs[2]
    if name == "stale":
        assert runs[2][1][1]["prefiltered"] > 0  # rejections before loading are counted


@pytest.mark.parametrize("stop_after", [1, 4, 9])
def test_mid_epoch_resume_with_prefetching_matches_an_uninterrupted_run(stop_after):
    policy = POLICIES["stale"]
    full = build(policy, 1)
    expected = [b.indices.tolist() for _ in range(3) for b in full]
    a = build(policy, 1)
    got = [b.indices.tolist() for b in a]  # epoch 0 (fresh)
    it = iter(a)  # epoch 1: stale, prefiltered
    got += [next(it).indices.tolist() for _ in range(stop_after)]
    state = a.state_dict()
    b = build(policy, 1)
    b.load_state_dict(state)
    got += [x.indices.tolist() for x in b]
    got += [x.indices.tolist() for x in b]
    assert got == expected
    assert [e.examples_seen for e in b.stats.epochs] == [e.examples_seen for e in full.stats.epochs]
    assert [e.prefiltered for e in b.stats.epochs] == [e.prefiltered for e in full.stats.epochs]


def test_the_next_source_batch_is_fetched_while_the_caller_holds_a_batch():
    ds = CountingDataset(600)
    before = prefetch_threads()
    loader = build(Traditional, 1, ds=ds)
    it = iter(loader)
    next(it)
    # The thread loads the next batch while the caller "trains". NOTE: waited for by condition,
    # not for a fixed time: on a loaded machine the thread may not run for seconds.
    start = time.monotonic()
    while ds.loaded < 60 and time.monotonic() - start < 60:
        threading.Event().wait(0.01)
    took = time.monotonic() - start
    assert ds.loaded >= 60
    # Bounded: the caller's batch, one queued (depth 1) and at most one in the thread's hands.
    # An unbounded thread would go on loading at the pace it just showed: give it twice as long.
    threading.Event().wait(max(0.2, 2 * took))
    assert 60 <= ds.loaded <= 90
    it.close()
    assert not prefetch_threads(before)


def test_abandoning_an_epoch_stops_the_thread_and_the_next_epoch_starts_clean():
    before = prefetch_threads()
    loader = build(POLICIES["sb"], 1)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert not prefetch_threads(before)
    assert sum(len(b[1]) for b in loader) > 0  # epoch 1 runs, from the start of its order
    assert loader.epoch == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_dataset_surfaces_in_the_callers_thread(workers):
    before = prefetch_threads()
    loader = build(POLICIES["sb"], 1, ds=CountingDataset(600, fail_at=17), workers=workers)
    with pytest.raises(RuntimeError, match="cannot read example 17"):
        list(loader)
    assert not prefetch_threads(before)


def test_prefetch_defaults_and_bad_values():
    assert build(Traditional, None).prefetch == 0
    assert build(Traditional, None, workers=1).prefetch == 1
    with pytest.raises(ValueError, match="prefetch should be >= 0"):
        build(Traditional, -1)
    with pytest.raises(TypeError, match="prefetch should be an int"):
        build(Traditional, 1.5)


def test_prefetcher_hands_over_errors_in_order_and_closes_its_iterator():
    closed = []

    def gen():
        try:
            yield 1
            yield 2
            raise KeyError("boom")
        finally:
            closed.append(threading.current_thread().name)

    p = Prefetcher(gen, depth=1, tally=lambda: 0)
    assert p.next()[0] == 1 and p.next()[0] == 2
    with pytest.raises(KeyError, match="boom"):
        p.next()
    with pytest.raises(StopIteration):
        p.next()
    p.close()
    assert closed == ["sbloader-prefetch"]  # closed by the thread that ran it


def test_a_tally_that_raises_is_handed_over_not_a_hang():
    """The source's state (the tally) failing after an item: its error reaches the caller."""
    calls = []

    def tally():
        calls.append(1)
        if len(calls) >= 2:
            raise RuntimeError("state_dict failed")
        return 0

    p = Prefetcher(lambda: iter(range(5)), depth=1, tally=tally)
    assert p.next()[0] == 0
    with pytest.raises(RuntimeError, match="state_dict failed"):
        p.next()
    p.close()


class _Dying(Prefetcher):
    """A producer that dies without handing over its error."""

    def _put(self, message):
        if message[0] != 0:  # (not an item: the end or an error)
            raise SystemExit
        return super()._put(message)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_producer_that_dies_without_a_message_raises_instead_of_waiting_for_ever():
    p = _Dying(lambda: iter(range(2)), depth=4, tally=lambda: 0)
    assert [p.next()[0], p.next()[0]] == [0, 1]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="prefetch thread stopped"):
        p.next()
    assert time.monotonic() - started < 30
    p.close()


def test_closing_the_prefetcher_fetches_nothing_more():
    """close() makes room in the queue for the item the producer is waiting to put; it must
    not then fetch another (past the end of the data a DataLoader would draw its next order from
    generators the caller may be restoring)."""
    produced = []

    def items():
        for i in range(100):
            produced.append(i)
            yield i

    p = Prefetcher(items, depth=1, tally=lambda: 0)
    assert p.next()[0] == 0
    deadline = time.monotonic() + 10
    while len(produced) < 3 and time.monotonic() < deadline:  # 1 queued, 2 waiting to be put
        time.sleep(0.01)
    time.sleep(0.1)  # the producer is blocked putting item 2
    assert produced == [0, 1, 2]
    p.close()
    assert produced == [0, 1, 2]


_FREED_ON_A_WORKER = r"""
import gc, sys, threading, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
import sbloader

where = sys.argv[1]  # the thread the garbage collector frees the iterator on
gc.disable()  # (only the collect() below, on that thread, frees the cycle)
dropped, freed = threading.Event(), threading.Event()
x, y = torch.randn(512, 4, generator=torch.Generator().manual_seed(0)), torch.arange(512) % 3


def collect_once():
    if dropped.is_set() and not freed.is_set():
        freed.set()
        gc.collect()


class Data(Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        on_prefetch = threading.current_thread().name == "sbloader-prefetch"
        if where == "prefetch" and on_prefetch and i >= 96:  # (its fourth source batch)
            dropped.wait(10)
            collect_once()
        return x[i], y[i]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, v):
        if where == "select" and threading.current_thread().name.startswith("sbloader-select"):
            dropped.wait(10)
            collect_once()
        return self.fc(v)


model = Model()
options = dict(overlap_selection=True) if where == "select" else dict(prefetch=2)


def make():
    return sbloader.SelectiveLoader(
        DataLoader(Data(), batch_size=32), model, policy=sbloader.SelectiveBackprop(0.5),
        batch_size=8, seed=0, **options,
    )


loader = make()


class Trainer:  # refers to itself: only the cyclic collector frees it
    pass


t = Trainer()
t.me, t.it = t, iter(loader)
taken = [next(t.it).indices.tolist() for _ in range(3)]
del t
dropped.set()
assert freed.wait(10), "the collector did not run on the worker thread"
import time
time.sleep(0.5)  # (the finalizer has run on the worker thread by now)
state = loader.state_dict()  # the loader's next use closes the freed iterator, here
left = [th.name for th in threading.enumerate() if th.name.startswith("sbloader")]
rest = [b.indices.tolist() for b in loader]  # the next epoch, as after a break
# The same epoch left by break on this thread, its iterator freed at once:
reference = make()
it = iter(reference)
assert [next(it).indices.tolist() for _ in range(3)] == taken
del it
same = reference.state_dict()
assert state["position"] == same["position"] > 0, (state["position"], same["position"])
assert rest == [b.indices.tolist() for b in reference]
print("threads left:", left)
"""


@pytest.mark.parametrize("where", ["select", "prefetch"])
def test_an_iterator_freed_on_the_loaders_own_thread_closes_later_and_exit_does_not_hang(
    tmp_path, where
):
    """An iterator held in a reference cycle (a trainer referring to itself) is freed by the
    cyclic garbage collector on whichever thread allocates: the selection thread
    (``overlap_selection``) or the prefetch thread. Its finalizer closed it there, waiting for
    the pass running on that same thread, or for that thread's end: the thread never ended,
    and with overlap the interpreter's exit hung. Now it is closed at the loader's next use,
    on the caller's thread: no thread is left, the state and the next epoch are those after
    ``break``, and the process exits."""
    import subprocess
    import sys

    script = tmp_path / "freed.py"
    script.write_text(_FREED_ON_A_WORKER)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    try:
        proc = subprocess.run(
            [sys.executable, str(script), where],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not end: a thread waited for itself")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "threads left: []" in proc.stdout, proc.stdout


def test_prefetch_depth_keeps_depth_items_ready_and_fetches_one_more():
    """Documented: ``depth`` items wait in the queue and the thread holds one more (the
    docstring said "at most depth ahead", one short of what it fetched)."""
    made = []

    def items():
        for i in range(10):
            made.append(i)
            yield i

    for depth in (1, 3):
        made.clear()
        p = Prefetcher(items, depth=depth, tally=lambda: 0)
        try:
            assert p.next()[0] == 0
            deadline = time.monotonic() + 5
            while len(made) < depth + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # (time to fetch past the documented count, were it not held)
            assert len(made) - 1 == depth + 1, (depth, made)  # ahead of the item taken
        finally:
            p.close()
