"""Never lose a run: exact resumption, clear errors for bad input, faults and scale.

Resumption is checked bitwise against an uninterrupted run while the model trains between
batches, so that a selection pass run at the wrong moment (before instead of after a training
step) changes the losses and shows up.
"""

from __future__ import annotations

import copy
import errno
import gc
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import N_CLASSES, EncodedDataset, IndexLoss, run_python
from speed_harness import through_torch_save
from torch import nn
from torch.utils.data import DataLoader, Dataset

from sbloader import (
    ExampleStore,
    Kath18,
    Phased,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
    Traditional,
    default_policy,
)
from sbloader._state import unsaved_states
from sbloader.datasets import ArrayDataset

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest)


class Net(nn.Module):
    """A small trainable model; inputs are scaled so that EncodedDataset's large values train."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, N_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.float() / 100.0)


# ---------------------------------------------------------------------- resumable state
POLICIES = {
    "sb": lambda: SelectiveBackprop(1 / 3, history=64),
    "stale-sb": lambda: SelectiveBackprop(1 / 3, history=64, staleness=2),
    "kath18": lambda: Kath18(1 / 3, tau_threshold=1.05),
    "random": lambda: RandomBackprop(0.4),
    "phased": lambda: Phased(SelectiveBackprop(1 / 3, history=64), warmup_epochs=1),
    "traditional": lambda: Traditional(),
}


class Run:
    """A model, its optimizer and a loader, built identically every time."""

    def __init__(self, policy: str, *, n=240, bs=8, source_bs=48, workers=0, **kw) -> None:
        torch.manual_seed(0)
        self.model = Net()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        dl = DataLoader(
            EncodedDataset(n),
            batch_size=source_bs,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(1),
        )
        self.loader = SelectiveLoader(
            dl, self.model, policy=POLICIES[policy](), batch_size=bs, seed=3, **kw
        )

    def step(self, batch) -> tuple:
        """Train on the batch; return everything it carried, as bytes (NaN compares equal)."""
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y, reduction="none") * batch.weights
        self.opt.zero_grad()
        loss.mean().backward()
        self.opt.step()
        return (
            tuple(batch.indices.tolist()),
            batch.losses.numpy().tobytes(),
            batch.probabilities.numpy().tobytes(),
            batch.weights.numpy().tobytes(),
            x.numpy().tobytes(),
            y.numpy().tobytes(),
        )

    def checkpoint(self) -> dict:
        state = {
            "loader": self.loader.state_dict(),
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
        }
        return copy.deepcopy(state)

    def restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.loader.load_state_dict(state["loader"])


def run(policy: str, epochs: int, cuts=(), **kw):
    """Train ``epochs`` epochs; at each cut ``(epoch, k)`` (after k batches of that epoch; k may
    be "end", after the epoch's StopIteration) checkpoint, throw everything away and resume in a
    freshly built run. Returns the batches, the final Run, the batches per epoch and the
    pending (selected, not yet yielded) counts at the cuts."""
    r = Run(policy, **kw)
    out, counts, pending = [], [], []
    cuts = set(cuts)

    def cut(r: Run) -> Run:
        pending.append(r.loader.pending_examples)
        state = r.checkpoint()
        r = Run(policy, **kw)
        r.restore(state)
        return r

    for ep in range(epochs):
        it, k = iter(r.loader), 0
        while True:
            if (ep, k) in cuts:
                del it
                r = cut(r)
                it = iter(r.loader)
            batch = next(it, None)
            if batch is None:
                break
            out.append(r.step(batch))
            k += 1
        counts.append(k)
        if (ep, "end") in cuts:
            r = cut(r)
    return out, r, counts, pending


COUNTS = (
    "examples_seen",
    "selection_forwards",
    "selection_calls",
    "examples_selected",
    "examples_yielded",
    "batches_yielded",
    "nonfinite",
    "dropped",
    "prefiltered",
)


def assert_same_state(a: Run, b: Run) -> None:
    """Same per-epoch counts, same loss window, same per-example store."""
    for ea, eb in zip(a.loader.stats.epochs, b.loader.stats.epochs, strict=True):
        assert [getattr(ea, c) for c in COUNTS] == [getattr(eb, c) for c in COUNTS], ea.epoch
    sa, sb = a.loader.policy, b.loader.policy
    sa, sb = getattr(sa, "policy", sa), getattr(sb, "policy", sb)
    store_a, store_b = getattr(sa, "store", None), getattr(sb, "store", None)
    assert (store_a is None) == (store_b is None)
    if store_a is not None:
        for col in ("loss", "seen", "selected"):
            np.testing.assert_array_equal(getattr(store_a, col), getattr(store_b, col))
    window_a, window_b = getattr(sa, "window", None), getattr(sb, "window", None)
    if window_a is not None:
        np.testing.assert_array_equal(window_a.values(), window_b.values())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_two_epochs_save_resume_two_epochs_equals_four(policy):
    full, ref, _, _ = run(policy, 4)
    got, resumed, _, _ = run(policy, 4, cuts=[(1, "end")])
    assert got == full and len(full) > 0
    assert_same_state(ref, resumed)
    assert [e.epoch for e in resumed.loader.stats.epochs] == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_resume_at_every_kind_of_point_is_bitwise_exact(policy):
    """At 0, after 1, mid-epoch, after the last batch, at the end of an epoch, twice within one
    epoch, and in a stale epoch (Stale-SB's epoch 1), all in one run."""
    full, ref, counts, _ = run(policy, 4)
    last = counts[1]
    cuts = [(0, 0), (0, 1), (1, 0), (1, 2), (1, last - 1), (1, last), (2, "end"), (3, 3)]
    got, resumed, _, _ = run(policy, 4, cuts=cuts)
    assert got == full
    assert_same_state(ref, resumed)


@pytest.mark.parametrize("policy", ["sb", "stale-sb", "kath18", "phased"])
def test_resume_with_a_pending_batch_is_bitwise_exact(policy):
    """Source batches of 48 for training batches of 8: a source batch fills several training
    batches, so the saved pending batch often holds more than a full batch still to be yielded
    before the next selection pass."""
    full, ref, counts, _ = run(policy, 3)
    cuts = [(ep, k) for ep in range(3) for k in range(1, counts[ep], 2)]
    got, resumed, _, pending = run(policy, 3, cuts=cuts)
    assert got == full
    assert_same_state(ref, resumed)
    assert max(pending) >= 8  # some cut had a full batch or more waiting
    assert sum(p > 0 for p in pending) >= len(pending) // 2


@pytest.mark.parametrize("cut", ["mid-epoch", "epoch-end"])
def test_a_resumed_phased_run_reports_the_rate_of_the_epoch_it_was_saved_in(cut):
    """Between the load and the next batch, the resumed Phased policy is in the saved run's
    phase: its target_rate (and loader.expected_batches()) are the uninterrupted run's, not
    its warm-up's."""
    r = Run("phased")
    list(r.loader)  # epoch 0: the Traditional warm-up (rate 1)
    it = iter(r.loader)
    for _ in range(2):
        r.step(next(it))  # epoch 1: SB at 1/3
    if cut == "epoch-end":
        for batch in it:
            r.step(batch)
    resumed = Run("phased")
    resumed.restore(r.checkpoint())
    assert r.loader.policy.target_rate == pytest.approx(1 / 3)
    assert resumed.loader.policy.target_rate == r.loader.policy.target_rate
    assert resumed.loader.expected_batches() == r.loader.expected_batches()


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_with_workers_mid_epoch(workers):
    full, _, counts, _ = run("sb", 2, workers=workers)
    got, _, _, pending = run("sb", 2, cuts=[(0, 3), (1, counts[1] // 2)], workers=workers)
    assert got == full and pending[0] > 0


@pytest.mark.parametrize("remainder", ["short", "carry", "drop"])
def test_resume_after_the_last_full_batch_with_dict_batches(remainder):
    """Saved after the epoch's last full batch, nothing left to load: the restored pending batch
    must still be yielded (short), carried or dropped, in the source's dict structure."""

    def as_dict(samples):
        x, y = torch.utils.data.default_collate(samples)
        return {"image": x, "label": y, "name": [f"ex{int(v)}" for v in x[:, 0]]}

    def build():
        dl = DataLoader(
            EncodedDataset(100),
            batch_size=20,
            shuffle=True,
            collate_fn=as_dict,
            generator=torch.Generator().manual_seed(0),
        )
        return SelectiveLoader(
            dl,
            IndexLoss(),
            policy=RandomBackprop(1.0),
            batch_size=8,
            remainder=remainder,
            input_key="image",
            target_key="label",
        )

    def names(b):
        return b["name"], b.indices.tolist()

    full = build()
    want = [names(b) for _ in range(2) for b in full]
    loader = build()
    it = iter(loader)
    got = [names(next(it)) for _ in range(12)]  # 100 examples: 12 full batches, 4 left over
    state = loader.state_dict()
    assert state["pending"]["count"] == 4 and state["position"] == 5
    assert state["codec"]["format"] == {
        "kind": "dict",
        "keys": ["image", "label", "name"],
        "input_key": "image",
        "target_key": "label",
    }
    again = build()
    again.load_state_dict(state)
    got += [names(b) for _ in range(2) for b in again]
    assert got == want
    assert all(isinstance(n, list) and n[0].startswith("ex") for n, _ in got)


def scalars(obj):
    """Everything in a state but tensors and arrays."""
    if isinstance(obj, dict):
        return {k: scalars(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scalars(v) for v in obj]
    return None if isinstance(obj, (torch.Tensor, np.ndarray)) else obj


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_mid_epoch_state_is_json_scalars_plus_tensors_and_loads_weights_only(policy, tmp_path):
    r = Run(policy)
    list(r.loader)
    it = iter(r.loader)
    for _ in range(3):
        next(it)
    state = r.loader.state_dict()
    assert state["version"] == SelectiveLoader.STATE_VERSION and state["active"]
    json.dumps(scalars(state))  # the scalar part is JSON

    def arrays(obj):
        if isinstance(obj, dict):
            return any(arrays(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(arrays(v) for v in obj)
        return isinstance(obj, np.ndarray)

    assert not arrays(state)  # numpy arrays would make torch.load(weights_only=True) refuse it
    torch.save({"loader": state}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    again = Run(policy)
    again.loader.load_state_dict(loaded)
    rest = [b.indices.tolist() for b in again.loader]
    assert rest == [b.indices.tolist() for b in it]


def test_memory_mapped_store_state_names_a_snapshot_of_its_files(tmp_path):
    def build():
        policy = SelectiveBackprop(1 / 3, staleness=2, store_path=str(tmp_path / "store"))
        dl = DataLoader(EncodedDataset(120), batch_size=30)
        return SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=10)

    loader = build()
    list(loader)
    state = loader.state_dict()
    store_state = dict(state["policy"]["store"])
    name = store_state.pop("snapshot")
    assert store_state == {
        "version": ExampleStore.VERSION,
        "size": 120,
        "path": str(tmp_path / "store"),
    }
    snapshot = tmp_path / "store" / "snapshots" / name
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "loss.float32",
        "seen.int32",
        "selected.int32",
    ]
    for column in ("loss.float32", "seen.int32", "selected.int32"):  # the files as they were
        assert (snapshot / column).read_bytes() == (tmp_path / "store" / column).read_bytes()
    json.dumps(scalars(state))
    losses = loader.policy.store.loss.copy()  # (the older store is refused once again is built)
    again = build()
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.policy.store.loss, losses)
    assert (again.policy.store.seen == 1).all()


class Trained:
    """A Stale-SB run (passes in epochs 0, 2, 4) whose store is memory-mapped in ``folder``,
    training a linear model so that its losses change from pass to pass; ``record`` collects
    each yielded batch's indices and weights."""

    def __init__(self, folder, keep=2) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(6, N_CLASSES)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        policy = SelectiveBackprop(
            0.5,
            history=64,
            staleness=2,
            store_path=None if folder is None else str(folder),
            store_snapshots=keep,
        )
        dl = DataLoader(
            EncodedDataset(96), batch_size=24, shuffle=True, generator=torch.Generator()
        )
        self.loader = SelectiveLoader(dl, self.model, policy=policy, batch_size=8, seed=5)
        self.record: list[tuple[list[int], list[float]]] = []

    def step(self, batch) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y, reduction="none")
        self.opt.zero_grad()
        (loss * batch.weights).mean().backward()
        self.opt.step()
        self.record.append((batch.indices.tolist(), batch.weights.tolist()))

    def train(self, epochs: int = 1) -> None:
        """Train on every batch of the next ``epochs`` epochs."""
        for _ in range(epochs):
            for batch in self.loader:
                self.step(batch)

    def until(self, epoch: int) -> None:
        """Train to the end of the epoch before ``epoch`` (a resumed epoch's rest first)."""
        while self.loader.epoch < epoch:
            self.train()

    def checkpoint(self) -> dict:
        return through_torch_save(
            {
                "loader": self.loader.state_dict(),
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
            }
        )

    def restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.loader.load_state_dict(state["loader"])


def test_a_memory_mapped_store_resumes_exactly_after_the_run_went_on_past_the_checkpoint(tmp_path):
    """Crash recovery: a checkpoint in the first stale epoch, the run goes on through another
    pass (which rewrites every stored loss and count), then dies; rebuilt and resumed from that
    checkpoint it yields exactly what the uninterrupted run did from there (the stale epoch
    decides from the losses of epoch 0's pass, not epoch 2's that the files held by then), and
    ends with the same parameters and store."""
    reference = Trained(tmp_path / "reference")
    reference.train(4)

    run = Trained(tmp_path / "run")
    run.train()
    it = iter(run.loader)
    for _ in range(2):
        run.step(next(it))
    saved, done = run.checkpoint(), len(run.record)
    for batch in it:
        run.step(batch)
    run.train(2)  # the pass of epoch 2 and the stale epoch 3 rewrite the files
    assert run.record == reference.record
    files = run.loader.policy.store
    losses_then = files.loss.copy()
    del run, it, files

    resumed = Trained(tmp_path / "run")
    resumed.restore(saved)
    resumed.record = reference.record[:done]
    resumed.until(4)
    assert resumed.record == reference.record
    for a, b in zip(resumed.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)
    store, ref = resumed.loader.policy.store, reference.loader.policy.store
    for a, b in zip(store.columns, ref.columns):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(store.loss, losses_then)


def test_a_state_whose_store_snapshot_was_removed_is_refused_naming_store_snapshots(tmp_path):
    """The snapshots of the newest ``store_snapshots`` states are kept (also across a resumed
    process, whose new snapshots prune its predecessor's); an older state is refused when
    loaded, with the fix, and the loader that refused it goes on as it was."""
    run = Trained(tmp_path / "store", keep=2)
    states = []
    for _ in range(3):
        run.train()
        states.append(run.checkpoint())
    folder = tmp_path / "store" / "snapshots"
    names = [s["loader"]["policy"]["store"]["snapshot"] for s in states]
    assert sorted(p.name for p in folder.iterdir()) == sorted(names[1:])

    fresh = Trained(tmp_path / "store", keep=2)
    before = fresh.loader.state_dict()["epoch"]
    with pytest.raises(ValueError, match=r"store snapshot .*missing.*store_snapshots="):
        fresh.loader.load_state_dict(states[0]["loader"])
    assert fresh.loader.epoch == before
    fresh.restore(states[1])  # the two newest load
    assert fresh.loader.epoch == 2
    fresh.train()
    fresh.checkpoint()
    fresh.checkpoint()  # the resumed process's own two newest: its predecessor's are removed
    assert len(list(folder.iterdir())) == 2 and not set(names) & {p.name for p in folder.iterdir()}


def test_store_snapshots_none_keeps_every_snapshot(tmp_path):
    """store_snapshots=None (every checkpoint kept, e.g. Lightning's save_top_k=-1): no snapshot
    is removed, and the oldest state still resumes; a snapshot removed from the folder by hand
    is refused saying so."""
    run = Trained(tmp_path / "store", keep=None)
    states = []
    for _ in range(4):
        run.train()
        states.append(run.checkpoint())
    assert len(list((tmp_path / "store" / "snapshots").iterdir())) == 4
    assert run.loader.policy.store.seen.max() == 3  # the pass of epoch 2
    fresh = Trained(tmp_path / "store", keep=None)
    fresh.restore(states[0])
    assert fresh.loader.epoch == 1 and fresh.loader.policy.store.seen.max() == 1
    name = states[1]["loader"]["policy"]["store"]["snapshot"]
    shutil.rmtree(tmp_path / "store" / "snapshots" / name)
    with pytest.raises(ValueError, match="keeps every snapshot, so it was removed"):
        fresh.restore(states[1])


@pytest.mark.parametrize("memory_mapped", [True, False], ids=["store_path", "in_memory"])
def test_states_taken_back_to_back_share_an_unchanged_stores_columns(tmp_path, memory_mapped):
    """Within unsaved_states() (Lightning's two states of an epoch stopped part-way), a
    store not used since its last state shares that state's snapshot, or its columns' copies:
    with keep_snapshots=1 both states load (a second snapshot removed the first's). A store
    used in between (record, a read of its columns that may write them), or outside the
    context, takes its own, whose values are the store's now."""
    path = tmp_path / "store" if memory_mapped else None
    store = ExampleStore(6, path=path, keep_snapshots=1)
    store.record(np.array([1, 4]), np.array([0.5, 2.0]), epoch=0)
    first = store.state_dict()
    with unsaved_states():
        second = store.state_dict()
    if memory_mapped:
        assert second == first
        assert len(list((tmp_path / "store" / "snapshots").iterdir())) == 1
    else:
        assert all(second[k] is first[k] for k in ("loss", "seen", "selected"))
    store.record(np.array([2]), np.array([9.0]), epoch=1)
    for state in (first, second):  # both load, as they were
        store.load_state_dict(state)
        np.testing.assert_array_equal(store.lookup(np.array([1, 2, 4]))[0], [0.5, np.nan, 2.0])
    store.record(np.array([3]), np.array([7.0]), epoch=1)
    with unsaved_states():
        changed = store.state_dict()
    loss = store.loss  # (a use of a column: it may be written through)
    loss[5] = 3.0
    with unsaved_states():
        written = store.state_dict()
    if memory_mapped:
        assert changed != first
    else:
        store.load_state_dict(changed)
        np.testing.assert_array_equal(store.loss[[2, 3, 5]], [0.0, 7.0, 0.0])
    assert not memory_mapped or written != changed  # (its own snapshot: changed's removed)
    store.load_state_dict(written)
    np.testing.assert_array_equal(store.loss[[3, 5]], [7.0, 3.0])
    alone = store.state_dict()  # outside the context: a state of its own
    assert alone is not written and (not memory_mapped or alone != written)


def test_a_spared_snapshot_removes_no_older_one_and_goes_once_loaded_or_replaced(tmp_path):
    """Within unsaved_states() (a Lightning stop's state, which no checkpoint may save), a
    memory-mapped store's new snapshot removes none of those kept, and the snapshots after it
    prune as ever (keep_snapshots newest) but keep it until its state was loaded (fit again
    after the stop), as a state_dict() called by hand between the stop and fit again removed
    it (found by review: that fit was refused); the next stop's replaces it."""
    store = ExampleStore(4, path=tmp_path, keep_snapshots=1)
    folder = tmp_path / "snapshots"

    def on_disk():
        return sorted(p.name for p in folder.iterdir())

    store.record(np.array([0]), np.array([1.0]), epoch=0)
    kept = store.state_dict()
    store.record(np.array([1]), np.array([2.0]), epoch=0)
    with unsaved_states():
        spared = store.state_dict()
    assert on_disk() == [kept["snapshot"], spared["snapshot"]]
    store.load_state_dict(kept)  # still there
    np.testing.assert_array_equal(store.loss, [1.0, 0.0, 0.0, 0.0])
    by_hand = store.state_dict()
    assert on_disk() == [spared["snapshot"], by_hand["snapshot"]]
    store.load_state_dict(spared)
    np.testing.assert_array_equal(store.loss, [1.0, 2.0, 0.0, 0.0])
    latest = store.state_dict()
    assert on_disk() == [latest["snapshot"]]

    with unsaved_states():
        first_stop = store.state_dict()  # shares latest's: unchanged
    store.record(np.array([2]), np.array([3.0]), epoch=1)
    with unsaved_states():
        stop = store.state_dict()
    store.record(np.array([3]), np.array([4.0]), epoch=1)
    with unsaved_states():
        next_stop = store.state_dict()  # never loaded, the stop's goes
    assert first_stop["snapshot"] == latest["snapshot"]
    assert on_disk() == [latest["snapshot"], next_stop["snapshot"]]
    assert stop["snapshot"] not in on_disk()


def test_a_memory_mapped_store_resumes_from_a_copy_of_its_folder_elsewhere(tmp_path):
    """A run moved to another machine or mount: the checkpoint and a copy of the store's folder
    at another path resume exactly; a folder without the snapshot is refused, naming where the
    state was saved."""
    reference = Trained(tmp_path / "reference")
    reference.train(3)

    run = Trained(tmp_path / "here")
    run.train()
    saved, done = run.checkpoint(), len(run.record)
    del run
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    shutil.rmtree(tmp_path / "here")
    moved = Trained(tmp_path / "there")
    moved.restore(saved)
    moved.record = reference.record[:done]
    moved.until(3)
    assert moved.record == reference.record

    empty = Trained(tmp_path / "empty")
    with pytest.raises(
        ValueError, match=r"missing or incomplete \(the state was saved by a store at .*here"
    ):
        empty.restore(saved)


def test_a_refused_load_leaves_a_memory_mapped_store_as_it_was(tmp_path):
    """All or nothing: a state the loader refuses after the policy's part was restored (here
    its statistics) leaves the store's files as they were, also when a load before it had
    succeeded and its snapshot was not applied yet; a snapshot is applied once a load
    succeeds."""
    run = Trained(tmp_path / "store")
    run.train()
    saved = run.checkpoint()
    at_checkpoint = [c.copy() for c in run.loader.policy.store.columns]
    run.train(2)
    after = [c.copy() for c in run.loader.policy.store.columns]
    assert not np.array_equal(after[1], at_checkpoint[1])
    bad = copy.deepcopy(saved["loader"])
    bad["stats"]["epochs"][0]["no_such_count"] = 1

    def refused():
        with pytest.raises(TypeError, match="no_such_count"):
            run.loader.load_state_dict(bad)

    refused()
    for a, b in zip(run.loader.policy.store.columns, after):
        np.testing.assert_array_equal(a, b)
    run.loader.load_state_dict(saved["loader"])
    refused()
    for a, b in zip(run.loader.policy.store.columns, at_checkpoint):
        np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(60)  # (a copy_file_range copying nothing would loop for ever)
@pytest.mark.parametrize("kernel", ["copies", "refuses", "copies-nothing"])
@pytest.mark.parametrize("seed", range(6))
def test_copy_sparse_copies_every_byte_whatever_the_holes(seed, kernel, tmp_path, monkeypatch):
    """Files of random sizes with random data runs among holes (at the start, the end, none)
    copy byte for byte, in the kernel or, where it refuses or copies nothing (a file system
    that does not serve it), through memory; the copy's holes stay holes (it takes no more
    blocks on disk than the file copied)."""
    from sbloader._files import copy_sparse

    if kernel != "copies":

        def refused(*args):
            if kernel == "copies-nothing":
                return 0
            raise OSError(38, "copy_file_range refused")

        monkeypatch.setattr(os, "copy_file_range", refused)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        size = int(rng.integers(1, 1 << 22))
        with open(tmp_path / "a", "wb") as f:
            f.truncate(size)
            for _ in range(int(rng.integers(0, 5))):
                start = int(rng.integers(0, size))
                f.seek(start)
                f.write(rng.bytes(min(int(rng.integers(1, 1 << 18)), size - start)))
        copy_sparse(tmp_path / "a", tmp_path / "b")
        assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes()
        blocks = [(tmp_path / name).stat().st_blocks for name in "ab"]
        assert blocks[1] <= blocks[0] + 64, blocks  # (32 KiB for the file system's rounding)


def test_a_version_1_store_state_still_loads(tmp_path):
    """States saved before snapshots (version 1): an in-memory store's columns load as they
    were; a memory-mapped one's named its files, which it continues with, as it did then."""
    store = ExampleStore(4)
    store.load_state_dict(
        {
            "version": 1,
            "size": 4,
            "loss": torch.tensor([0.0, 2.5, 0.0, 0.0]),
            "seen": torch.tensor([0, 3, 0, 0], dtype=torch.int32),
            "selected": torch.tensor([0, 1, 0, 0], dtype=torch.int32),
        }
    )
    assert store.lookup(np.arange(4))[0][1] == 2.5 and store.selected.tolist() == [0, 1, 0, 0]
    mapped = ExampleStore(4, path=tmp_path)
    mapped.record(np.array([2]), np.array([1.5]), epoch=0)
    mapped.load_state_dict({"version": 1, "size": 4, "path": str(tmp_path)})
    assert mapped.lookup(np.array([2]))[0].tolist() == [1.5]
    with pytest.raises(ValueError, match="memory-mapped at"):
        ExampleStore(4, path=tmp_path / "other").load_state_dict(
            {"version": 1, "size": 4, "path": str(tmp_path)}
        )


def test_a_rewind_to_a_state_saved_before_the_stores_first_use_starts_empty(tmp_path):
    """A run in a folder an earlier run used, checkpointed at step 0 (the snapshot holds the
    earlier run's files), trained an epoch (its store cleared and refilled at first use), then
    rewound to that checkpoint: it starts empty again at first use, as the saved run did, and
    counts what a run in a fresh folder counts (the snapshot's earlier-run counts never come
    back)."""
    earlier = stale_sb_in(tmp_path / "used")
    for _ in range(3):
        list(earlier)
    del earlier
    run = stale_sb_in(tmp_path / "used")
    at_step_0 = run.state_dict()
    list(run)
    run.load_state_dict(at_step_0)
    reference = stale_sb_in(tmp_path / "fresh")
    for _ in range(2):
        list(run)
        list(reference)
    for a, b in zip(run.policy.store.columns, reference.policy.store.columns):
        np.testing.assert_array_equal(a, b)


def test_a_refused_load_of_an_in_memory_state_leaves_a_memory_mapped_store_as_it_was(tmp_path):
    """An in-memory store's state loaded into a memory-mapped store is written into its files
    only once the load succeeded (at the columns' next use): a refused one leaves them as they
    were."""
    in_memory = Trained(None)
    in_memory.train()
    saved = in_memory.checkpoint()
    run = Trained(tmp_path / "store")
    run.train(2)
    before = [c.copy() for c in run.loader.policy.store.columns]
    bad = copy.deepcopy(saved["loader"])
    bad["stats"]["epochs"][0]["no_such_count"] = 1
    with pytest.raises(TypeError, match="no_such_count"):
        run.loader.load_state_dict(bad)
    for a, b in zip(run.loader.policy.store.columns, before):
        np.testing.assert_array_equal(a, b)
    run.restore(saved)
    for a, b in zip(run.loader.policy.store.columns, in_memory.loader.policy.store.columns):
        np.testing.assert_array_equal(a, b)


def test_snapshot_names_order_as_written_whatever_the_clock(tmp_path, monkeypatch):
    """Snapshots are named by a sequence one past the folder's highest (not by the time): a
    clock that steps back, or a new store in the folder (a resumed process), never makes a new
    snapshot sort before older ones, and the newest kept are the newest written."""
    import time as time_module

    monkeypatch.setattr(time_module, "time_ns", lambda: 0)
    store = ExampleStore(8, path=tmp_path, keep_snapshots=2)
    names = [store.state_dict()["snapshot"] for _ in range(3)]
    again = ExampleStore(8, path=tmp_path, keep_snapshots=2)
    names += [again.state_dict()["snapshot"] for _ in range(2)]
    assert names == sorted(names) and len(set(names)) == 5
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == names[-2:]


def test_copy_sparse_copies_whole_where_seek_data_is_not_supported(tmp_path, monkeypatch):
    from sbloader._files import copy_sparse

    with open(tmp_path / "a", "wb") as f:
        f.truncate(1 << 20)
        f.seek(1000)
        f.write(b"data")
    lseek = os.lseek

    def no_seek_data(fd, offset, how):
        if how == os.SEEK_DATA:
            raise OSError(errno.EOPNOTSUPP, "not supported")
        return lseek(fd, offset, how)

    monkeypatch.setattr(os, "lseek", no_seek_data)
    copy_sparse(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes()


def test_a_store_folder_is_held_by_one_process(tmp_path):
    """Two processes writing one store folder (every rank of a job given the same store_path)
    would corrupt it silently: another process's store there is refused at once, naming this
    process (not the one an earlier run left in the lock file) and the fix; stores of one
    process share the folder; once this process's last store there is gone (or the process
    ended) another process may take it."""
    code = (
        "import sys\n"
        "from sbloader import ExampleStore\n"
        "try:\n"
        "    ExampleStore(10, path=sys.argv[1])\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    print('taken')\n"
    )

    def other_process() -> str:
        out = run_python(code, str(tmp_path), timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    (tmp_path / ".lock").write_text("9" * 12)  # (an earlier process's: a longer pid)
    first = ExampleStore(10, path=tmp_path)
    second = ExampleStore(10, path=tmp_path)  # the same process: shared
    message = other_process()
    assert message.startswith("refused:") and f"(pid {os.getpid()})" in message
    assert "store_path=f'stores/rank{rank}'" in message
    del first
    gc.collect()
    assert other_process().startswith("refused:")  # the second store still holds it
    (tmp_path / ".lock").read_text()  # another descriptor of the lock file, closed again
    shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-copy")  # (a copy, as to move)
    assert other_process().startswith("refused:")  # neither dropped the hold
    with pytest.raises(ValueError, match="a store of 10 examples in this process; a store of 11"):
        ExampleStore(11, path=tmp_path)  # would truncate the files the others map
    del second
    gc.collect()
    assert other_process() == "taken"


def test_two_live_runs_given_one_store_path_do_not_share_its_files(tmp_path):
    """Two loaders of one process given the same store_path (two models side by side, a sweep
    in one process, a notebook cell run again): the newer one's store takes the folder and the
    older run refuses to go on, naming the fix, instead of deciding from the other's losses."""

    def make():
        policy = SelectiveBackprop(0.5, staleness=2, store_path=tmp_path)
        return shuffled_loader(40, 8, 0, IndexLoss(), policy, batch_size=4)

    older = make()
    list(older)
    newer = make()
    list(newer)
    with pytest.raises(ValueError, match="was taken by a newer store in this process") as info:
        list(older)
    assert "give each run its own store_path" in str(info.value)
    list(newer)  # the newest goes on


def test_an_older_run_neither_writes_its_reports_into_nor_saves_a_newer_runs_store(tmp_path):
    """The older run of a shared store_path is refused before it touches the newer one's files:
    its pending reports were written into them as its next epoch began (only the kernels'
    columns were checked), and its state_dict saved a snapshot of the newer run's losses as its
    own and pruned the newer run's snapshots, so the newer run's checkpoint no longer loaded."""

    def make():
        policy = SelectiveBackprop(0.5, staleness=2, store_path=tmp_path)
        return shuffled_loader(40, 8, 0, IndexLoss(), policy, batch_size=4)

    older = make()
    for batch in older:
        older.feedback(batch.indices, torch.full((len(batch.indices),), 123.0))
    newer = make()
    list(newer)
    states = [newer.state_dict(), newer.state_dict()]  # (the 2 snapshots kept)
    losses = newer.policy.store.loss.copy()
    with pytest.raises(ValueError, match="was taken by a newer store in this process"):
        list(older)  # its reports are not applied to the newer store's files
    with pytest.raises(ValueError, match="was taken by a newer store in this process"):
        older.state_dict()
    np.testing.assert_array_equal(newer.policy.store.loss, losses)
    for state in states:
        make().load_state_dict(state)  # the newer run's snapshots are all there


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_inherit_its_parents_hold_on_a_store_folder(tmp_path):
    """A forked child (a DataLoader worker, or the user's own) is another process: a store it
    builds in the parent's folder is refused, as another process's is."""
    import multiprocessing

    held = ExampleStore(10, path=tmp_path)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child() -> None:
        try:
            ExampleStore(10, path=tmp_path)
        except ValueError as e:
            queue.put(str(e))
        else:
            queue.put("taken")

    process = ctx.Process(target=child)
    process.start()
    message = queue.get(timeout=60)
    process.join(timeout=60)
    assert "in use by another process" in message and f"(pid {os.getpid()})" in message
    assert held.size == 10


def test_a_store_snapshot_stays_sparse(tmp_path):
    """A store of ten million examples with a few scored: its snapshot takes about what the
    scored examples' pages take on disk, not the 120 MB of its columns."""
    store = ExampleStore(10_000_000, path=tmp_path)
    store.record(np.array([5, 9_999_999]), np.array([1.0, 2.0]), epoch=0)
    store.count_selected(np.array([5]))
    state = store.state_dict()
    snapshot = tmp_path / "snapshots" / state["snapshot"]
    used = sum(f.stat().st_blocks * 512 for f in snapshot.iterdir())
    if sum((tmp_path / f.name).stat().st_blocks * 512 for f in snapshot.iterdir()) > 1 << 20:
        pytest.skip("this file system does not keep files sparse")
    assert used < 1 << 20
    store.record(np.array([5]), np.array([7.0]), epoch=1)  # the run goes on
    again = ExampleStore(10_000_000, path=tmp_path)
    again.load_state_dict(state)
    losses, epochs = again.lookup(np.array([5, 6, 9_999_999]))
    assert losses[[0, 2]].tolist() == [1.0, 2.0] and epochs.tolist() == [0, -1, 0]
    assert again.selected[5] == 1


def stale_sb_in(path) -> SelectiveLoader:
    """A Stale-SB loader whose store is memory-mapped in the folder ``path``."""
    policy = SelectiveBackprop(1 / 3, staleness=2, store_path=str(path))
    dl = DataLoader(EncodedDataset(120), batch_size=30, generator=torch.Generator())
    return SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=10, seed=3)


def test_a_new_run_in_a_used_store_path_starts_empty_and_a_resumed_one_keeps_it(tmp_path):
    """store_path files an earlier run left are that run's losses and selection counts: a new
    run starts empty (its counts are those of a run in a fresh folder, not the sum of both
    runs'), a run resumed from a state continues with them, and losses reported during a
    warm-up (the store's first use) are not cleared when the wrapped policy's first epoch
    begins."""

    used, fresh = tmp_path / "used", tmp_path / "fresh"
    first = stale_sb_in(used)
    for _ in range(3):
        list(first)
    state = first.state_dict()
    counts = first.policy.store.selected.copy()
    assert counts.sum() > 0
    del first

    reference = stale_sb_in(fresh)
    again = stale_sb_in(used)
    assert again.policy.store.reopened
    for _ in range(3):
        list(reference)
        list(again)
    np.testing.assert_array_equal(again.policy.store.selected, reference.policy.store.selected)
    np.testing.assert_array_equal(again.policy.store.selected, counts)  # not 2 * counts
    del again

    resumed = stale_sb_in(used)
    resumed.load_state_dict(state)
    next(iter(resumed))  # epoch 3 begins with the store as the files hold it
    assert resumed.policy.store.selected.sum() >= counts.sum()

    warm = SelectiveBackprop(1 / 3, staleness=2, store_path=str(used))
    warm.attach(120, 0)
    assert warm.store.reopened
    warm.feedback(np.arange(10), np.ones(10), 0)  # the first use: the earlier run's is cleared
    warm.begin_epoch(0)  # and the reports stay
    losses, epochs = warm.store.lookup(np.arange(12))
    assert losses[:10].tolist() == [1.0] * 10 and epochs.tolist() == [0] * 10 + [-1, -1]
    assert warm.store.selected.sum() == 0


def test_a_state_saved_before_a_used_store_paths_first_use_resumes_as_the_run_goes_on(tmp_path):
    """A checkpoint saved before the first epoch of a new run in a used store_path (the store
    not used yet): the run itself clears the earlier run's files when its first epoch begins,
    so the run resumed from that checkpoint must not continue with them."""

    used, fresh = tmp_path / "used", tmp_path / "fresh"
    earlier = stale_sb_in(used)
    for _ in range(3):
        list(earlier)
    assert earlier.policy.store.selected.sum() > 0
    del earlier

    reference = stale_sb_in(fresh)
    state = stale_sb_in(used).state_dict()  # e.g. a checkpoint at step 0
    resumed = stale_sb_in(used)
    resumed.load_state_dict(state)
    for _ in range(3):
        list(reference)
        list(resumed)
    np.testing.assert_array_equal(resumed.policy.store.selected, reference.policy.store.selected)


# ---------------------------------------------------------------------- bad input
class PoisonedLoss:
    """Per-example cross-entropy, with NaN, +inf and -inf for the examples listed (the model's
    inputs carry each example's index); ``enabled`` switches the poison off."""

    reduction = "none"
    BAD = {7: float("nan"), 18: float("inf"), 29: float("-inf"), 77: float("nan")}

    def __init__(self) -> None:
        self.enabled = True
        self.index: torch.Tensor | None = None

    def __call__(self, out, y):
        loss = nn.functional.cross_entropy(out, y, reduction="none")
        if self.enabled:
            for i, v in self.BAD.items():
                loss = torch.where(self.index == i, torch.tensor(v), loss)
        return loss


class Recorder(IndexLoss):
    """IndexLoss that shares the batch's indices with a PoisonedLoss."""

    def __init__(self, loss: PoisonedLoss) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, x):
        self.loss.index = x[:, 0].long()
        return super().forward(x)


@pytest.mark.parametrize("mode", ["skip", "select", "raise"])
def test_nan_and_infinite_losses_never_reach_window_or_store(mode):
    bad = set(PoisonedLoss.BAD)
    loss = PoisonedLoss()
    model = Recorder(loss).train()
    dl = DataLoader(EncodedDataset(120), batch_size=30)
    loader = SelectiveLoader(
        dl,
        model,
        loss_fn=loss,
        policy=SelectiveBackprop(1.0, history=1024, staleness=2),
        batch_size=10,
        nonfinite=mode,
        remainder="short",
    )
    store = loader.policy.store
    if mode == "raise":
        with pytest.raises(
            FloatingPointError, match=r"3 selection .*indices \[7, 18, 29\].*nonfinite='skip'"
        ):
            list(loader)
        assert model.training and len(loader.policy.window) == 0  # nothing of that batch
        assert (store.seen == 0).all() and loader.stats.current.nonfinite == 3
        loss.enabled = False
        assert sum(len(b[0]) for b in loader) == 120  # the same loader carries on
        return
    batches = list(loader)
    got = [i for b in batches for i in b.indices.tolist()]
    assert loader.stats.current.nonfinite == len(bad)
    window = loader.policy.window.values()
    assert np.isfinite(window).all() and len(window) == 120 - len(bad)
    losses, epochs = store.lookup(np.arange(120))
    # marked scored non-finite: skipped as NaN (so stale epochs skip them too), selected as
    # +inf (so stale epochs keep them too)
    marked = np.isnan(losses[sorted(bad)]) if mode == "skip" else losses[sorted(bad)] == np.inf
    assert marked.all() and (epochs[sorted(bad)] == 0).all()
    good = np.setdiff1d(np.arange(120), sorted(bad))
    assert np.isfinite(losses[good]).all() and (epochs[good] == 0).all()
    if mode == "skip":
        assert sorted(got) == good.tolist()
    else:
        assert sorted(got) == list(range(120))
        for b in batches:
            for i, v, p in zip(b.indices.tolist(), b.losses.tolist(), b.probabilities.tolist()):
                assert (i in bad) == (not np.isfinite(v))
                if i in bad:
                    assert p == 1.0 and (np.isnan(v) or v == PoisonedLoss.BAD[i])


@pytest.mark.parametrize(
    "loss_fn, shape, fix",
    [
        (lambda out, y: nn.functional.cross_entropy(out, y), r"\(\)", "reduction='none'"),
        (lambda out, y: float(nn.functional.cross_entropy(out, y)), "float", "reduction='none'"),
        # Unreduced already, but per output (or per token): the fix is to reduce the rest.
        (
            lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")[:, None],
            r"\(\d+, 1\)",
            "reduce it over every dimension but the first",
        ),
        (
            lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")[:, None].expand(
                -1, 7
            ),
            r"\(\d+, 7\)",
            "reduce it over every dimension but the first.*ignore_index",
        ),
    ],
)
def test_loss_fn_without_one_loss_per_example_names_the_fix(loss_fn, shape, fix):
    model = nn.Sequential(nn.Linear(6, N_CLASSES), nn.Dropout(0.1)).train()
    dl = DataLoader(EncodedDataset(40), batch_size=10)
    loader = SelectiveLoader(dl, model, loss_fn=loss_fn, batch_size=5)
    with pytest.raises(ValueError, match=f"one loss per example.*{shape}.*{fix}"):
        next(iter(loader))
    assert model.training and model[1].training


def test_per_token_outputs_with_a_per_example_loss_are_refused_naming_the_token_loss():
    """Language-model outputs (batch, seq, vocab) with the default nn.CrossEntropyLoss raised
    torch's "Expected target size [8, 10], got [8, 5]" from the first selection pass; refused
    naming the shapes and a per-example loss_fn over tokens, which then runs."""

    class TokenModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 10)

        def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.embed(ids)}

    torch.manual_seed(0)
    batches = [
        {"input_ids": torch.randint(0, 10, (8, 5)), "labels": torch.randint(0, 10, (8, 5))}
        for _ in range(3)
    ]
    options = dict(input_key="input_ids", target_key="labels", batch_size=4, seed=0)
    loader = SelectiveLoader(batches, TokenModel(), policy=SelectiveBackprop(0.5), **options)
    shapes = r"of shape \(8, 5, 10\), and targets of shape \(8, 5\): outputs per token"
    fix = r"transpose\(1, 2\).*, with output='logits' \(the model returns a dict"
    with pytest.raises(ValueError, match=rf"Expected target size.*{shapes}.*{fix}"):
        next(iter(loader))

    def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # the fix it names
        losses = nn.functional.cross_entropy(out.transpose(1, 2), y, reduction="none")
        return losses.sum(1) / (y != -100).sum(1).clamp(min=1)

    loader = SelectiveLoader(
        batches,
        TokenModel(),
        loss_fn=token_loss,
        output="logits",
        policy=SelectiveBackprop(0.5),
        **options,
    )
    assert next(iter(loader))["labels"].shape == (4, 5)


class Relabel(EncodedDataset):
    """EncodedDataset whose label for example 13 is out of range while ``broken``."""

    broken = True

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, torch.tensor(99) if (self.broken and i == 13) else y


def test_label_out_of_range_surfaces_and_the_same_loader_carries_on():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, N_CLASSES)).train()
    model[1].eval()  # a frozen BatchNorm stays frozen
    ds = Relabel(60)
    # Plain SB: the selection pass of every epoch meets every example (the default's
    # Random-Backprop warm-up makes none, so the training step would meet the label instead).
    loader = SelectiveLoader(
        DataLoader(ds, batch_size=20), model, policy=SelectiveBackprop(1 / 3), batch_size=10
    )
    with pytest.raises(IndexError, match="out of bounds"):
        list(loader)  # the loss's own error
    assert model.training and not model[1].training
    assert len(loader.policy.window) == 0  # the failed batch's losses went nowhere
    ds.broken = False
    got = sorted(i for b in loader for i in b.indices.tolist())
    assert len(got) == loader.stats.current.examples_selected - loader.pending_examples
    assert loader.stats.current.examples_seen == 60 and loader.epoch == 2


@pytest.mark.parametrize("source", ["empty list", "empty sampler", "drop_last"])
def test_a_source_that_yields_nothing_is_an_error(source):
    if source == "empty list":
        src = []
    elif source == "drop_last":  # (its one short batch dropped: the message names drop_last)
        src = DataLoader(EncodedDataset(40), batch_size=64, drop_last=True)
    else:
        src = DataLoader(EncodedDataset(40), batch_size=10, sampler=[])
    loader = SelectiveLoader(src, IndexLoss(), batch_size=4)
    with pytest.raises(ValueError, match=r"yielded no examples in epoch 0.*drop_last=True"):
        list(loader)
    with pytest.raises(ValueError, match="yielded no examples in epoch 1"):
        list(loader)  # every time, not only once


@pytest.mark.parametrize(
    "policy, remainder, model, sizes, dropped",
    [
        ("traditional", "carry", "plain", [[5], [5]], 0),
        ("random1", "short", "plain", [[5], [5]], 0),
        ("random1", "drop", "plain", [[], []], 5),
        ("random1", "carry", "plain", [[], [8]], 0),
        ("sb1", "short", "bn", [[5], [5]], 0),
        ("traditional", "carry", "bn1", [[], []], 1),  # a batch of one never reaches BatchNorm
    ],
)
def test_dataset_smaller_than_one_batch(policy, remainder, model, sizes, dropped):
    n = 1 if model == "bn1" else 5
    pol = {
        "traditional": Traditional(),
        "random1": RandomBackprop(1.0),
        "sb1": SelectiveBackprop(1.0),
    }[policy]
    net = (
        IndexLoss()
        if model == "plain"
        else nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, N_CLASSES))
    )
    dl = DataLoader(EncodedDataset(n), batch_size=16)
    loader = SelectiveLoader(dl, net, policy=pol, batch_size=8, remainder=remainder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [[len(b[0]) for b in loader] for _ in range(2)]
    assert got == sizes
    assert loader.stats.epochs[-1].dropped == dropped
    # an epoch that kept examples and yielded none of them is said once, naming the fix
    said = [str(w.message) for w in caught if "yielded no batch" in str(w.message)]
    if dropped:
        assert len(said) == 1 and f"the {dropped} examples it kept" in said[0]
        assert f"remainder={remainder!r}" in said[0]
        if remainder == "drop":
            assert "remainder='carry'" in said[0] and "min_batch_size where" not in said[0]
        else:  # (dropped under min_batch_size: 'carry' was no fix)
            assert "smaller min_batch_size" in said[0] and "remainder='short'" not in said[0]
    else:
        assert not said  # (carried to the next epoch: not dropped)


def test_index_field_of_another_length_is_refused():
    batches = [(torch.zeros(4, 6), torch.zeros(4, dtype=torch.long), torch.arange(3))]
    loader = SelectiveLoader(batches, IndexLoss(), batch_size=2, index_key=2)
    with pytest.raises(ValueError, match=r"field 2 .* 3 entries but the input field 0 has 4"):
        next(iter(loader))


def test_dict_fields_of_different_lengths_are_refused():
    batches = [{"input": torch.zeros(4, 6), "target": torch.zeros(4, dtype=torch.long), "w": [1]}]
    with pytest.raises(ValueError, match=r"field 'w' .* 1 entries .* one entry per example"):
        next(iter(SelectiveLoader(batches, IndexLoss(), batch_size=2)))


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (
            {},
            KeyError,
            r"without the keys 'input' and 'target'; pass input_key= and target_key= naming "
            r"two of \['x', 'y'\]",
        ),
        ({"target_key": "y"}, KeyError, r"without the key 'input'; pass input_key= naming one"),
        ({"input_key": "x"}, KeyError, "without the key 'target'; pass target_key="),
        ({"input_key": "x", "target_key": "z"}, KeyError, "without the key 'z'"),
        ({"input_key": "x", "target_key": "y", "index_key": "idx"}, KeyError, "index_key='idx'"),
    ],
)
def test_dict_batches_without_the_named_key(kwargs, exc, message):
    batches = [{"x": torch.zeros(4, 6), "y": torch.zeros(4, dtype=torch.long)}]
    with pytest.raises(exc, match=message):
        next(iter(SelectiveLoader(batches, IndexLoss(), batch_size=2, **kwargs)))


@pytest.mark.parametrize("make", [RandomBackprop, Kath18, SelectiveBackprop])
@pytest.mark.parametrize("bad", [0.0, -0.5, 1.0001, 2, float("inf")])
def test_selectivity_outside_the_unit_interval_is_refused(make, bad):
    with pytest.raises(ValueError, match=f"selectivity should be (in|finite).*selectivity={bad}"):
        make(selectivity=bad)
    with pytest.raises(TypeError, match="selectivity should be a number"):
        make(selectivity="1/3")


class Flaky(nn.Module):
    """Raises in its ``fail``-th forward (counting from 1), then works; records modes."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.lin = nn.Linear(6, N_CLASSES)
        self.bn = nn.BatchNorm1d(N_CLASSES)
        self.calls, self.fail = 0, fail

    def forward(self, x):
        self.calls += 1
        assert not self.training and not self.bn.training
        if self.calls == self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.bn(self.lin(x / 100))


def test_a_model_that_raises_mid_selection_leaves_nothing_half_done():
    """The failure is in the second chunk of a source batch: the first chunk's losses must not
    enter the window, and the same loader carries on afterwards."""
    model = Flaky(fail=4).train()  # source batch 2, chunk 2
    dl = DataLoader(EncodedDataset(90), batch_size=30)
    loader = SelectiveLoader(  # the float model's own forward (no int8 copy) fails
        dl,
        model,
        policy=SelectiveBackprop(0.5),
        batch_size=10,
        selection_batch_size=16,
        quantize_selection=False,
    )
    it = iter(loader)
    next(it)
    window = loader.policy.window.values()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        list(it)
    assert model.training and model.bn.training
    np.testing.assert_array_equal(loader.policy.window.values(), window)  # 30, not 46
    assert len(window) == 30
    assert sum(len(b[0]) for b in loader) > 0 and loader.stats.current.examples_seen == 90


def test_a_cuda_device_this_machine_lacks_is_refused_naming_it():
    """device= a CUDA device the machine does not have fails before the first batch is loaded,
    naming the parameter, not inside torch when a batch is moved."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    dl = DataLoader(EncodedDataset(40), batch_size=10)
    missing = [f"cuda:{count}"] + ([] if count else ["cuda", torch.device("cuda")])
    for device in missing:
        loader = SelectiveLoader(dl, IndexLoss(), policy=Traditional(), device=device)
        with pytest.raises(
            ValueError, match=r"device should be a device this machine has .*device='cuda"
        ):
            next(iter(loader))
        assert loader.stats.total.examples_seen == 0


@pytest.mark.parametrize("device", ["gpu", "CPU", 2.5, True, [0]])
def test_a_device_torch_cannot_parse_is_refused_naming_the_parameter(device):
    """device= that torch.device cannot read fails as the loader (or el2n_scores, or a
    FeatureCache) is built, naming the parameter, not in torch's words ("Expected one of cpu,
    cuda, ...") that name none."""
    from sbloader import FeatureCache, el2n_scores

    dl = DataLoader(EncodedDataset(40), batch_size=10)
    exc = TypeError if not isinstance(device, str) else ValueError
    with pytest.raises(
        exc, match=r"device should be a .*'cuda:0', but got device=" + re.escape(repr(device))
    ):
        SelectiveLoader(dl, IndexLoss(), policy=Traditional(), device=device)
    with pytest.raises(exc, match=r"device should be a .*device="):
        el2n_scores(
            lambda: Net(),
            dl,
            make_optimizer=lambda m: torch.optim.SGD(m.parameters(), 0.1),
            device=device,
        )
    with pytest.raises(exc, match=r"device should be a .*device="):
        FeatureCache(4, device=device)
    # Devices as torch reads them are unchanged: a name, a torch.device, an index type.
    for ok in ("cpu", torch.device("cpu"), "cuda:0"):
        assert SelectiveLoader(dl, IndexLoss(), device=ok)._device == torch.device(ok)


def test_a_model_on_the_meta_device_is_refused_with_the_fix():
    """On a CPU-only machine the only other device is 'meta': a model not materialised yet (as
    built under ``torch.device('meta')`` for deferred initialisation). Batches moved there would
    hold no data, silently for Traditional; the loader refuses up front instead."""
    with torch.device("meta"):
        meta_model = nn.Linear(6, N_CLASSES)
    dl = DataLoader(EncodedDataset(40), batch_size=10)
    for policy in (SelectiveBackprop(0.5), Traditional()):
        loader = SelectiveLoader(dl, meta_model, policy=policy)
        with pytest.raises(ValueError, match=r"meta device .*to_empty"):
            next(iter(loader))
    loader = SelectiveLoader(dl, nn.Linear(6, N_CLASSES), device="meta")
    with pytest.raises(ValueError, match="device='meta'"):
        next(iter(loader))
    # Inputs that arrive on another device than the model's are moved to it (here: CPU).
    loader = SelectiveLoader(dl, IndexLoss(), device=torch.device("cpu"))
    assert next(iter(loader))[0].device == torch.device("cpu")


def test_inputs_on_the_meta_device_surface_torchs_error():
    batches = [(torch.zeros(4, 6, device="meta"), torch.zeros(4, dtype=torch.long))]
    model = IndexLoss().train()
    with pytest.raises(NotImplementedError, match="meta tensor"):
        next(iter(SelectiveLoader(batches, model, batch_size=2)))
    assert model.training


# ---------------------------------------------------------------------- faults
class KillsItsWorker(EncodedDataset):
    """Loading example 150 in a worker process kills that worker (SIGKILL, as the OOM killer
    does), once: a flag file records that it happened."""

    def __init__(self, n: int, flag: str) -> None:
        super().__init__(n)
        self.flag = flag

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        if i == 150 and info is not None and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


@pytest.fixture
def quick_worker_shutdown(monkeypatch):
    """Workers left over from a failed epoch take torch's status interval (5 s) to exit when
    their iterator is collected; a shorter interval keeps these tests fast. Detection of the
    death is unaffected (it does not wait on this value)."""
    import torch.utils.data._utils as data_utils

    monkeypatch.setattr(data_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    monkeypatch.setattr(data_utils.worker, "MP_STATUS_CHECK_INTERVAL", 0.2)
    yield
    gc.collect()  # shut down failed iterators (held by tracebacks) while the patch is active


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_killed_worker_surfaces_promptly(tmp_path, persistent, quick_worker_shutdown):
    flag = str(tmp_path / "killed")
    model = IndexLoss().train()
    dl = DataLoader(
        KillsItsWorker(400, flag),
        batch_size=20,
        shuffle=True,
        num_workers=2,
        persistent_workers=persistent,
        generator=torch.Generator().manual_seed(0),
    )
    loader = SelectiveLoader(dl, model, policy=SelectiveBackprop(0.5), batch_size=10)
    start = time.monotonic()
    # NOTE: torch reports the death itself (RuntimeError), or, when the worker died while the
    # main process was fetching a tensor it had shared, the broken connection.
    with pytest.raises((RuntimeError, ConnectionError)) as err:
        list(loader)
    if err.type is RuntimeError:
        assert re.search(r"DataLoader worker \(pid.*(killed|exited unexpectedly)", str(err.value))
    del err
    assert os.path.exists(flag) and time.monotonic() - start < 30
    assert model.training
    # The same loader carries on with fresh workers. With persistent workers, a plain
    # DataLoader's next epoch could hang reading what the dead worker left behind.
    start = time.monotonic()
    assert sorted(i for b in loader for i in b.indices.tolist())
    assert loader.stats.current.examples_seen == 400
    assert time.monotonic() - start < 30


class Stalls(EncodedDataset):
    """Loading example 5 in a worker stalls until a release file appears."""

    def __init__(self, n: int, release: str) -> None:
        super().__init__(n)
        self.release = release

    def __getitem__(self, i):
        if i == 5 and torch.utils.data.get_worker_info() is not None:
            while not os.path.exists(self.release):
                time.sleep(0.02)
        return super().__getitem__(i)


@pytest.mark.timeout(120)
def test_a_stalled_worker_hits_the_dataloaders_timeout(tmp_path, quick_worker_shutdown):
    """A hung worker is not dead, so only DataLoader(timeout=) can end the wait: the loader
    passes the user's timeout through to the DataLoader it rebuilds."""
    release = str(tmp_path / "release")
    dl = DataLoader(Stalls(40, release), batch_size=10, num_workers=1, timeout=1)
    loader = SelectiveLoader(dl, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=5)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
            list(loader)
    finally:
        open(release, "w").close()
    assert time.monotonic() - start < 20


class Interrupted(nn.Module):
    """Delivers a real SIGINT (Ctrl-C) to this process during its ``at``-th forward."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.lin = nn.Linear(6, N_CLASSES)
        self.drop = nn.Dropout(0.5)
        self.calls, self.at = 0, at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the KeyboardInterrupt arrives here
        return self.drop(self.lin(x / 100))


def test_ctrl_c_during_a_selection_pass_restores_training_mode_and_state():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default KeyboardInterrupt handler here")
    model = Interrupted(at=3).train()
    model.drop.eval()  # a deliberately frozen submodule stays frozen
    dl = DataLoader(EncodedDataset(120), batch_size=30, generator=torch.Generator())
    loader = SelectiveLoader(  # the float model's own forward is interrupted
        dl, model, policy=SelectiveBackprop(0.5), batch_size=10, quantize_selection=False
    )
    it = iter(loader)
    before = []
    with pytest.raises(KeyboardInterrupt):
        for b in it:
            before.append(b.indices.tolist())
            state = loader.state_dict()
    assert model.training and not model.drop.training
    assert len(loader.policy.window) == 60  # the interrupted batch's losses went nowhere
    # The last checkpoint taken before the interrupt resumes the epoch.
    again = SelectiveLoader(
        DataLoader(EncodedDataset(120), batch_size=30, generator=torch.Generator()),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=10,
    )
    again.load_state_dict(state)
    assert again.stats.current.examples_seen == 60
    assert sum(len(b[0]) for b in again) > 0 and again.stats.current.examples_seen == 120


# ---------------------------------------------------------------------- scale
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


needs_proc = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm"), reason="resident memory is read from /proc"
)


@needs_proc
def test_store_for_1e8_examples_within_16_bytes_each():
    n = 10**8
    warm = ExampleStore(4)  # compile or load the kernels before measuring
    warm.record(np.arange(4), np.ones(4), epoch=0)
    warm.lookup(np.arange(4))
    warm.count_selected(np.arange(4))
    before = rss_bytes()
    store = ExampleStore(n)
    assert store.nbytes == 12 * n <= 16 * n
    idx = np.array([0, 2**24 - 1, 2**24, 2**24 + 1, 2**26 + 3, n - 1])
    values = np.array([0.5, 1.25, 2.0, 3.5, 1e-3, 7.0])
    store.record(idx, values, epoch=9)
    store.count_selected(np.r_[idx, idx[-1:]])
    losses, epochs = store.lookup(idx)
    np.testing.assert_array_equal(losses, values.astype(np.float32))
    assert (epochs == 9).all()
    assert store.selected[idx].tolist() == [1, 1, 1, 1, 1, 2]
    assert np.isnan(store.lookup(np.array([2**24 + 2]))[0][0])
    # Zeroed pages are mapped lazily: an untouched example costs no resident memory.
    assert rss_bytes() - before < 64 * 2**20
    del store


class Wide(Dataset):
    """4 MiB of float inputs, loaded a batch at a time."""

    def __init__(self, n: int = 1024, dim: int = 1024) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, N_CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, idx):
        return self.x[idx], self.y[idx]


def keep_as_is(batch):
    return batch


def live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


@needs_proc
@pytest.mark.parametrize("staleness", [1, 2])
def test_resident_memory_stays_flat_across_epochs(staleness):
    """30 epochs after a warm-up: no growth in live tensors (exact, immune to the allocator
    reusing freed memory) nor in resident memory beyond allocator noise. Leaking what each epoch
    yields would add about 1.4 MB per epoch, 40 MB in all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, N_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dl = DataLoader(
        Wide(),
        batch_size=96,
        shuffle=True,
        collate_fn=keep_as_is,
        generator=torch.Generator().manual_seed(0),
    )
    policy = SelectiveBackprop(1 / 3, history=256, staleness=staleness)
    loader = SelectiveLoader(dl, model, policy=policy, batch_size=32)

    def epoch():
        last = None
        for batch in loader:
            x, y = batch
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = weakref.ref(x)
        return last

    def pending_parts() -> int:  # the selected rows carried into the next epoch, in parts
        return len(loader._pending._parts)

    for _ in range(5):
        epoch()
    gc.collect()
    tensors, rss, parts = live_tensors(), rss_bytes(), pending_parts()
    for _ in range(30):
        last = epoch()
    gc.collect()
    assert last() is None  # the loader keeps no reference to what it yielded
    # The carried pending rows may differ (each part holds 6 tensors: inputs, targets, indices,
    # losses, probabilities, weights); nothing else may grow.
    assert live_tensors() - tensors <= 8 + 6 * max(pending_parts() - parts, 0)
    assert rss_bytes() - rss < 12 * 2**20
    assert len(loader.stats.epochs) == 35


def test_indices_above_2_24_and_2_31_through_the_loader(tmp_path):
    """A map-style dataset of 2^31 + 64 examples (only a few ever loaded): dataset indices
    travel as int64 from the sampler to the batch and the store, with no float round trip."""

    class Huge(Dataset):
        def __len__(self):
            return 2**31 + 64

        def __getitem__(self, i):
            return torch.full((6,), float(i % 1000)), torch.tensor(i % N_CLASSES), torch.tensor(i)

    picks = [2**24 - 1, 2**24, 2**24 + 1, 2**24 + 3, 2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1]
    picks += [2**31 + 63, 2**31 + 17, 2**25 + 1, 2**30 + 7]
    policy = SelectiveBackprop(0.5, staleness=2, store_path=str(tmp_path / "store"))
    dl = DataLoader(Huge(), batch_size=6, sampler=picks)
    loader = SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=3, remainder="short")
    for _ in range(2):
        for batch in loader:
            assert batch.indices.dtype == torch.int64
            assert torch.equal(batch.indices, batch[2])  # the dataset's own copy of its index
            assert set(batch.indices.tolist()) <= set(picks)
    losses, epochs = policy.store.lookup(np.array(picks))
    assert np.isfinite(losses).all() and (epochs == 0).all()
    assert policy.store.seen[[2**24 + 2, 2**31 - 3, 2**31 + 2]].tolist() == [0, 0, 0]
    selected = policy.store.selected[picks]
    assert selected.sum() == sum(e.examples_selected for e in loader.stats.epochs)


# ---------------------------------------------------------------------- without numba's JIT
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_whole_suite_passes_without_numba_jit():
    """README: ``NUMBA_DISABLE_JIT=1 python3 -m pytest -q`` (the kernels as plain Python)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@pytest.mark.parametrize(
    "option",
    [
        {"compile_selection": np.bool_(False)},
        {"distributed": np.bool_(False)},
        {"quantize_selection": np.bool_(False)},
        {"overlap_selection": np.bool_(False)},
        {"keep_logits": np.bool_(False)},
        {"output": np.int64(0)},
    ],
    ids=lambda option: next(iter(option)),
)
def test_numpy_scalars_are_taken_as_the_python_values_they_hold(option):
    """A flag or position read from a numpy array or config (np.bool_, np.int64) means what the
    Python value does: compile_selection, distributed and quantize_selection refused np.bool_ and
    output refused np.int64 (TypeError), while the other flags took them."""

    class TupleOut(nn.Module):
        def forward(self, x):
            return (x.float()[:, :N_CLASSES], None)

    dl = DataLoader(EncodedDataset(40), batch_size=10)
    model = TupleOut() if "output" in option else IndexLoss()
    plain = {k: v.item() for k, v in option.items()}
    runs = []
    for kwargs in (option, plain):
        loader = SelectiveLoader(dl, model, policy=SelectiveBackprop(0.5), seed=3, **kwargs)
        runs.append([b.indices.tolist() for b in loader])
    assert runs[0] == runs[1] and runs[0]


def test_feature_cache_options_that_are_no_size_dtype_or_device_are_refused_naming_them():
    """FeatureCache(size) took int(size) (2.5 made 2 rows, True one, "3" three), store_dtype any
    object, and cache_features= an int (read by torch as a CUDA index), a float or a word
    reached torch.device, whose error names no parameter; np.bool_(True) was refused there."""
    from sbloader import FeatureCache

    for bad in (2.5, True, "3", None):
        with pytest.raises(TypeError, match=f"size should be an int, but got size={bad!r}"):
            FeatureCache(bad)
    with pytest.raises(ValueError, match="size should be >= 0, but got size=-1"):
        FeatureCache(-1)
    with pytest.raises(TypeError, match=r"store_dtype should be a torch\.dtype"):
        FeatureCache(4, store_dtype="bf16")
    assert FeatureCache(np.int64(4), "cpu", torch.bfloat16).size == 4

    dl = DataLoader(EncodedDataset(40), batch_size=10)
    prefix = nn.Linear(6, 6).requires_grad_(False)

    def build(cache):
        return SelectiveLoader(
            dl, nn.Linear(6, N_CLASSES), frozen_prefix=prefix, cache_features=cache
        )

    for bad in (1, 0, 2.5, [0]):
        with pytest.raises(
            TypeError,
            match=f"cache_features should be True .*cache_features={re.escape(repr(bad))}",
        ):
            build(bad)
    with pytest.raises(
        ValueError, match=r"cache_features should be a device .*cache_features='yes'"
    ):
        build("yes")
    assert build(np.bool_(True))._scorer.feature_cache is not None
    assert build(np.bool_(False))._scorer.feature_cache is None
    assert build("cpu")._scorer.feature_cache.device == torch.device("cpu")


def test_kath18_negative_losses_fail_on_the_first_batch_of_a_warm_up():
    """Kath18 samples in proportion to the loss: a negative loss_fn was refused only at its first
    selection pass, after a whole warm-up epoch (Phased); the check on the first source batch
    now asks the policy too."""
    dl = DataLoader(EncodedDataset(40), batch_size=10)

    def negative(out, y):
        return -nn.functional.cross_entropy(out, y, reduction="none")

    policy = Phased(Kath18(0.5), warmup_epochs=1, warmup_policy=RandomBackprop(0.5))
    loader = SelectiveLoader(dl, Net(), loss_fn=negative, policy=policy, batch_size=5)
    with pytest.raises(ValueError, match="Kath18 samples in proportion to the loss, so losses"):
        next(iter(loader))
    assert loader.stats.current.examples_yielded == 0
    # A non-negative loss through the same warm-up is taken: both epochs yield.
    loader = SelectiveLoader(dl, Net(), policy=policy, batch_size=5)
    assert all(sum(len(y) for _, y in loader) > 0 for _ in range(2))

    # A non-finite loss is nonfinite='s to decide, in the check as in a selection pass: -inf on
    # the first candidate under "skip" is no negative loss.
    def minus_inf_first(out, y):
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        return torch.cat([torch.tensor([-float("inf")]), losses[1:]])

    loader = SelectiveLoader(
        dl, Net(), loss_fn=minus_inf_first, policy=policy, batch_size=5, nonfinite="skip"
    )
    assert all(sum(len(y) for _, y in loader) > 0 for _ in range(2))


def test_a_loss_reduced_over_the_wrong_axis_fails_before_the_warm_up_whatever_the_classes():
    """A loss reduced over the batch axis, ``(B, C) -> (C,)``, has one value per example on a
    check of C rows: the check on the first source batch tries two sizes, so it fails there for
    2 and 3 classes too, not after the whole warm-up."""
    for classes in (2, 3, 10):
        x = torch.randn(40, 6)
        y = torch.arange(40) % classes
        dl = DataLoader(ArrayDataset(x, y), batch_size=10)

        def wrong_axis(out, t):
            return (
                nn.functional.cross_entropy(out, t, reduction="none")[:, None]
                .expand(-1, out.shape[1])
                .mean(0)
            )

        loader = SelectiveLoader(
            dl, nn.Linear(6, classes), loss_fn=wrong_axis, policy=default_policy(), batch_size=5
        )
        with pytest.raises(ValueError, match="one loss per example"):
            next(iter(loader))
        assert loader.stats.current.examples_yielded == 0, classes


def binary_and_multilabel(kind: str) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """Inputs, targets and a model: a binary classifier of one logit over ``(B, 1)`` float
    labels, or a multi-label one over multi-hot ``(B, 5)`` rows (a third with no label)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(240, 6, generator=g)
    if kind == "binary":
        return x, (x @ torch.randn(6, generator=g) > 0).float()[:, None], nn.Linear(6, 1)
    y = (torch.rand(240, 5, generator=g) < 0.2).float()
    y[::3] = 0
    return x, y, nn.Linear(6, 5)


@pytest.mark.parametrize("warmup, overlap", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize(
    "kind, match",
    [
        ("binary", r"outputs of shape \(\d+, 1\): one class, whose cross-entropy is 0"),
        ("multilabel", r"targets \(shape \(40, 5\)\) have rows that do not sum to 1"),
    ],
)
def test_the_default_cross_entropy_over_binary_or_multilabel_targets_is_refused(
    kind, match, warmup, overlap
):
    """The default loss_fn, cross-entropy, over one logit is 0 for every example (SB "keeping
    a third" kept every candidate, unsaid), and over multi-hot rows scores 0 every row without
    a label whatever the model predicts: each is refused on the first source batch, also
    before a Random-Backprop warm-up and with passes on the selection thread, naming loss_fn=;
    the loss it names then selects."""
    x, y, model = binary_and_multilabel(kind)
    dl = DataLoader(ArrayDataset(x, y), batch_size=40)
    policy = (
        Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, warmup_policy=RandomBackprop(1 / 3))
        if warmup
        else SelectiveBackprop(1 / 3)
    )
    options = dict(policy=policy, batch_size=8, seed=0, overlap_selection=overlap)
    loader = SelectiveLoader(dl, model, **options)
    with pytest.raises(ValueError, match=f"loss_fn is nn.CrossEntropyLoss.*{match}.*loss_fn="):
        next(iter(loader))
    assert loader.stats.current.examples_yielded == 0 and model.training

    def bce(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # the fixes named
        losses = nn.functional.binary_cross_entropy_with_logits(
            out, t.float().view_as(out), reduction="none"
        )
        return losses.flatten(1).mean(1)

    loader = SelectiveLoader(dl, model, loss_fn=bce, policy=SelectiveBackprop(1 / 3), seed=0)
    batches = list(loader)
    losses = torch.cat([b.losses for b in batches])
    with torch.no_grad():
        expected = bce(model(x), y)
    indices = torch.cat([torch.as_tensor(b.indices) for b in batches])
    assert torch.allclose(losses, expected[indices])
    assert len(losses.unique()) == len(losses)  # (no ties: a loss that ranks)
    assert 0.15 < loader.stats.current.selection_rate < 0.55


def test_soft_labels_summing_to_one_pass_the_cross_entropy_check():
    """Label smoothing and mixup targets are class probabilities (rows summing to 1, in
    float16 too): taken by the default cross-entropy as they are."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g)
    soft = torch.softmax(torch.randn(40, 3, generator=g), dim=1).half()
    dl = DataLoader(ArrayDataset(x, soft), batch_size=20)
    loader = SelectiveLoader(dl, nn.Linear(6, 3), policy=SelectiveBackprop(0.5), batch_size=5)
    batches = list(loader)
    assert batches and all(torch.isfinite(b.losses).all() for b in batches)


def test_the_first_batch_check_runs_in_eval_mode_with_eval_selection_false():
    """The check of a warm-up's first source batch changes nothing, also with
    ``eval_selection=False``: no BatchNorm statistics updated (a resume in the warm-up checks
    again, and would then differ from the uninterrupted run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    bn = model[1]
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    dl = DataLoader(ArrayDataset(torch.randn(40, 6), torch.arange(40) % 3), batch_size=10)
    policy = Phased(SelectiveBackprop(0.5), warmup_epochs=1, warmup_policy=RandomBackprop(0.5))
    loader = SelectiveLoader(dl, model, eval_selection=False, policy=policy, batch_size=5)
    next(iter(loader))
    assert model.training
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_nonfinite_select_keeps_the_order_a_policy_chose_in():
    """``nonfinite="select"`` adds the non-finite candidates to the policy's choice, each before
    the first chosen candidate of a higher position, and keeps the order the policy asked for
    (``Choice.positions``: the order to yield them in); a policy choosing in position order
    still gets position order."""
    from sbloader.decisions import choose_finite
    from sbloader.policies import Choice, Policy

    class HardestFirst(Policy):
        def choose(self, losses, indices, rng, n):
            positions = np.argsort(-losses, kind="stable")[: n // 2].astype(np.int64)
            return Choice(positions, np.full(n, 0.5), np.arange(1.0, len(positions) + 1))

    losses = np.array([np.nan, 1.0, 2.0, 9.0, 3.0, 10.0, np.inf])
    rng = np.random.default_rng(0)
    c, bad = choose_finite(HardestFirst(), losses, None, rng, 7, "select")
    assert bad == 2
    # the policy chose [5, 3] (losses 10 and 9) from the finite ones, in that order; 0 goes
    # before 5, and 6 after every chosen position below it
    assert c.positions.tolist() == [0, 5, 3, 6]
    assert c.weights.tolist() == [1.0, 1.0, 2.0, 1.0]
    assert c.probabilities[[0, 6]].tolist() == [1.0, 1.0]
    sorted_choice, _ = choose_finite(Traditional(), losses, None, rng, 7, "select")
    assert sorted_choice.positions.tolist() == list(range(7))


def test_a_nonfinite_loss_without_dataset_indices_is_named_by_its_position():
    """Under nonfinite="raise" the error names the first dataset indices, or, for a source
    without them, the positions in the source batch (it called those "dataset indices")."""
    from sbloader.decisions import choose_finite

    losses = np.array([1.0, np.nan, 2.0, np.inf])
    rng = np.random.default_rng(0)
    with pytest.raises(FloatingPointError, match=r"positions \[1, 3\] in the source batch"):
        choose_finite(Traditional(), losses, None, rng, 4, "raise")
    with pytest.raises(FloatingPointError, match=r"dataset indices \[11, 13\]"):
        choose_finite(Traditional(), losses, np.arange(10, 14), rng, 4, "raise")


# ---------------------------------------------------------------------- closing and copying
def test_a_policy_attached_to_a_dataset_of_another_size_lets_go_of_its_folder(tmp_path):
    """A Stale-SB policy with store_path, reused for a loader over another dataset, builds a
    store of the new size there (its first store is closed, so that the folder's hold does not
    refuse its own new store); the closed store refuses every further use."""
    policy = SelectiveBackprop(0.5, history=64, staleness=2, store_path=tmp_path)
    first_loader = SelectiveLoader(
        DataLoader(EncodedDataset(96), batch_size=24), Net(), policy=policy, batch_size=8
    )
    first = policy.store
    assert first is not None and len(first) == 96
    for _ in first_loader:
        pass
    SelectiveLoader(
        DataLoader(EncodedDataset(50), batch_size=24), Net(), policy=policy, batch_size=8
    )
    assert policy.store is not None and len(policy.store) == 50 and policy.store is not first
    assert (tmp_path / "loss.float32").stat().st_size == 50 * 4
    for use in (
        lambda: first.loss,
        first.state_dict,
        first.clear,
        lambda: first.lookup(np.arange(2)),
    ):
        with pytest.raises(RuntimeError, match="was closed"):
            use()
    first.close()  # again: nothing


def test_a_closed_store_frees_its_folder_for_another_process(tmp_path):
    store = ExampleStore(10, path=tmp_path)
    code = "import sys\nfrom sbloader import ExampleStore\nExampleStore(10, path=sys.argv[1])\n"
    run = lambda: run_python(code, str(tmp_path), timeout=120)  # noqa: E731
    assert "in use by another process" in run().stderr
    store.close()
    out = run()
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("path", [False, True], ids=["memory", "memory-mapped"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy"])
def test_a_store_copies_as_an_in_memory_store_that_does_not_follow_the_run(tmp_path, path, how):
    """A copy of a store (e.g. to compare selection counts later) holds its columns as they
    were; a memory-mapped store's copy is an in-memory one (never a second writer of the
    folder). copy.copy too (an in-memory store's shared its columns, found by review)."""
    import pickle

    store = ExampleStore(10, path=tmp_path if path else None)
    store.record(np.array([1, 2]), np.array([0.5, 1.5]), epoch=0)
    store.count_selected(np.array([2, 2]))
    copies = {"deepcopy": copy.deepcopy, "copy": copy.copy}
    copied = copies.get(how, lambda s: pickle.loads(pickle.dumps(s)))(store)
    store.record(np.array([1]), np.array([9.0]), epoch=1)
    store.count_selected(np.array([1]))
    assert copied.path is None and not isinstance(copied.loss, np.memmap)
    assert copied.lookup(np.array([1, 2]))[0].tolist() == [0.5, 1.5]
    assert copied.selected.tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 0]
    copied.count_selected(np.array([3]))  # usable, and apart from the original
    assert store.selected[3] == 0
    if path:
        assert len(ExampleStore(10, path=tmp_path)) == 10  # the original still holds the folder


def test_an_attached_stale_sb_policy_can_be_copied():
    policy = SelectiveBackprop(0.5, history=64, staleness=2)
    loader = SelectiveLoader(
        DataLoader(EncodedDataset(96), batch_size=24), Net(), policy=policy, batch_size=8
    )
    for _ in loader:
        pass
    copied = copy.deepcopy(policy)
    assert copied.store is not None and copied.store is not policy.store
    assert np.array_equal(copied.store.loss, policy.store.loss)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_its_parents_folder_locked(tmp_path):
    """A flock lasts while any descriptor of it is open: a forked child (a DataLoader worker)
    closes the copies it inherits, so the folder is free once the parent lets go, the child
    still running."""
    import multiprocessing

    store = ExampleStore(10, path=tmp_path)
    ctx = multiprocessing.get_context("fork")
    started, done = ctx.Event(), ctx.Event()

    def child() -> None:
        started.set()  # (after the fork's handlers ran in the child)
        done.wait(60)

    process = ctx.Process(target=child)
    process.start()
    try:
        assert started.wait(60)
        store.close()
        # (a new descriptor: refused as "in use by another process" while the child's copy of
        # the parent's holds the lock)
        assert len(ExampleStore(20, path=tmp_path)) == 20
    finally:
        done.set()
        process.join(timeout=60)
    assert process.exitcode == 0


def test_a_memory_mapped_store_restores_the_state_as_loaded_not_as_changed_after(tmp_path):
    """An in-memory state loaded into a memory-mapped store is written at the columns' next
    use: what is restored is the state as it was loaded, whatever the caller does to it
    between."""
    source = ExampleStore(10)
    source.record(np.array([4]), np.array([2.5]), epoch=0)
    state = source.state_dict()
    store = ExampleStore(10, path=tmp_path)
    store.load_state_dict(state)
    state["loss"][4] = 99.0  # the caller reuses its tensors
    assert store.lookup(np.array([4]))[0].tolist() == [2.5]


@pytest.mark.parametrize(
    "make",
    [
        lambda: SelectiveBackprop(1 / 3, history=64),
        lambda: SelectiveBackprop(1 / 3, history=64, staleness=3),
        lambda: SelectiveBackprop(1 / 3, history=64, staleness=3, ramp_epochs=1),
        lambda: Phased(SelectiveBackprop(1 / 3, history=64, staleness=2), warmup_epochs=1),
    ],
    ids=["sb", "stale-sb", "stale-sb-ramp", "phased"],
)
@pytest.mark.parametrize("size", [120, 96], ids=["same-size", "other-size"])
def test_a_policy_reused_for_a_new_run_runs_as_a_new_one(make, size):
    """A policy object given to a second loader (a second run, another seed or dataset) starts
    that run afresh, as a policy just built does: its window, its pass schedule (Stale-SB's
    first epoch is a selection pass) and its store (empty) are not the first run's."""

    def run(policy, n, epochs):
        torch.manual_seed(0)
        loader = SelectiveLoader(
            DataLoader(EncodedDataset(n), batch_size=24), Net(), policy=policy, batch_size=8
        )
        return [[b.indices.tolist() for b in loader] for _ in range(epochs)]

    reused = make()
    run(reused, 120, epochs=4)  # the first run: past its first pass and a stale epoch
    assert run(reused, size, epochs=3) == run(make(), size, epochs=3)


def test_a_phased_policy_reused_for_a_new_run_reports_its_warm_up_before_the_first_epoch():
    """Given to a second loader after a run that ended in its selective phase, a Phased policy
    answers for the new run's epoch 0 (its warm-up's rate, and the expected batches that
    follow from it) before that epoch begins, as a policy just built does."""

    def loader_of(policy):
        return SelectiveLoader(
            DataLoader(EncodedDataset(120), batch_size=24), Net(), policy=policy, batch_size=8
        )

    def make():
        return Phased(SelectiveBackprop(1 / 3, history=64), warmup_epochs=1)

    reused = make()
    first = loader_of(reused)
    for _ in range(2):
        list(first)
    assert reused.target_rate == pytest.approx(1 / 3)  # ended in its selective phase
    second, fresh = loader_of(reused), loader_of(make())
    assert reused.target_rate == 1.0
    assert second.expected_batches() == fresh.expected_batches()


def test_a_kath18_policy_reused_for_a_new_run_starts_from_tau_zero():
    policy = Kath18(1 / 3, tau_threshold=1.05)
    loader = SelectiveLoader(
        DataLoader(EncodedDataset(120), batch_size=24), Net(), policy=policy, batch_size=8
    )
    for _ in loader:
        pass
    assert policy.tau > 0
    SelectiveLoader(DataLoader(EncodedDataset(120), batch_size=24), Net(), policy=policy)
    assert policy.tau == 0.0 and not policy.importance_sampling


def failing_once(function, calls: list, at: int):
    """``function``, raising a simulated out-of-memory error at the ``at``-th call counted in
    ``calls`` (shared by every function wrapped with the same list)."""

    def wrapped(*args, **kwargs):
        calls.append(None)
        if len(calls) == at:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return function(*args, **kwargs)

    return wrapped


def shuffled_loader(n, source_bs, order_seed, model, policy, **kw) -> SelectiveLoader:
    """A SelectiveLoader over a shuffling DataLoader of EncodedDataset(n) with its own order."""
    source = DataLoader(
        EncodedDataset(n),
        batch_size=source_bs,
        shuffle=True,
        generator=torch.Generator().manual_seed(order_seed),
    )
    return SelectiveLoader(source, model, policy=policy, **{"seed": 0, **kw})


class FlakyLoss(IndexLoss):
    """IndexLoss whose forward number ``fail_at`` (counted from 0) raises, or returns NaN."""

    def __init__(self, fail_at: int | None = None, nan: bool = False) -> None:
        super().__init__()
        self.fail_at, self.nan, self.forwards = fail_at, nan, 0

    def forward(self, x):
        call, self.forwards = self.forwards, self.forwards + 1
        if call == self.fail_at and not self.nan:
            raise RuntimeError("transient failure")
        out = super().forward(x)
        return out * float("nan") if call == self.fail_at else out


@pytest.mark.parametrize(
    "options",
    [{}, {"prefetch": 1}, {"overlap_selection": True}, {"nonfinite": "raise", "nan": True}],
    ids=["plain", "prefetch", "overlap", "nonfinite-raise"],
)
def test_a_selection_pass_that_raises_loses_no_example_from_a_state_saved_after(options):
    """The source batch whose scoring raised is not consumed: a state saved after the error
    resumes with it, and the run yields what an uninterrupted one does (nothing skipped), its
    stats counting each example seen once."""
    options = dict(options)
    nan = options.pop("nan", False)

    def make(model):
        return shuffled_loader(40, 8, 0, model, SelectiveBackprop(0.5), batch_size=4, **options)

    reference = [b.indices.tolist() for b in make(FlakyLoss())]
    failing = make(FlakyLoss(fail_at=2, nan=nan))
    head = []
    with pytest.raises((RuntimeError, FloatingPointError)):
        for b in failing:
            head.append(b.indices.tolist())
    state = copy.deepcopy(failing.state_dict())
    resumed = make(FlakyLoss())
    resumed.load_state_dict(state)
    assert head + [b.indices.tolist() for b in resumed] == reference
    assert resumed.stats.current.examples_seen == 40  # (the batch not taken counted once)


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        (SelectiveBackprop(beta=0), {}),
        (SelectiveBackprop(beta=0), {"prefetch": 1}),
        (SelectiveBackprop(beta=0), {"decisions": "device"}),
        (SelectiveBackprop(beta=0), {"decisions": "device", "nonfinite": "raise"}),
        (Traditional(), {}),  # (re-batched: batch_size 4 of source batches of 8)
    ],
    ids=["selection", "prefetch", "device-decisions", "device-nonfinite-raise", "passthrough"],
)
def test_a_source_batch_whose_decision_or_gather_raises_loses_no_example(
    monkeypatch, policy, options
):
    """The rows a source batch keeps are gathered after the policy decided; where that raises
    (a transient out-of-memory error), or where the decision on the device raises
    (``nonfinite="raise"``), the batch is not consumed: a state saved after the error resumes
    with it. Before, its examples were skipped by the resumed run. (Keeping every candidate,
    the resumed run yields what an uninterrupted one does; otherwise the batch is decided again
    with other draws.)"""
    import sbloader.device_decisions as device_decisions
    import sbloader.epoch as epoch_module

    nan = options.get("nonfinite") == "raise"

    def make(model):
        return shuffled_loader(40, 8, 0, model, copy.deepcopy(policy), batch_size=4, **options)

    reference = [b.indices.tolist() for b in make(FlakyLoss())]
    calls = []

    def flaky(gather):
        return failing_once(gather, calls, 3)

    if not nan:
        monkeypatch.setattr(epoch_module, "_gather", flaky(epoch_module._gather))
        monkeypatch.setattr(epoch_module, "device_rows", flaky(device_decisions.device_rows))
    failing = make(FlakyLoss(fail_at=2 if nan else None, nan=nan))
    head = []
    with pytest.raises((torch.OutOfMemoryError, FloatingPointError), match=r"simulated|finite"):
        for b in failing:
            head.append(b.indices.tolist())
    monkeypatch.undo()
    state = copy.deepcopy(failing.state_dict())
    resumed = make(FlakyLoss())
    resumed.load_state_dict(state)
    assert head + [b.indices.tolist() for b in resumed] == reference


@pytest.mark.parametrize(
    ("policy", "batch_size", "options", "fails"),
    [
        (SelectiveBackprop(beta=0), 4, {}, "join"),
        (SelectiveBackprop(beta=0), 4, {}, "build"),
        (SelectiveBackprop(beta=0), 4, {"prefetch": 1}, "join"),
        (Traditional(), 8, {}, "build"),  # (source batches handed out whole: nothing joined)
    ],
    ids=["join", "build", "prefetch-join", "whole-source-batch-build"],
)
def test_a_batch_whose_making_raises_is_handed_out_again_from_a_state_saved_after(
    monkeypatch, policy, batch_size, options, fails
):
    """Making the next training batch raises (an out-of-memory error in joining its rows, an
    interrupt): its rows are not lost; a state saved after the error hands them out first.
    Before, they were taken from the pending rows and gone."""
    import sbloader.codec as codec_module
    import sbloader.rows as rows_module

    def make():
        loader = shuffled_loader(
            40, 8, 0, IndexLoss(), copy.deepcopy(policy), batch_size=batch_size, **options
        )
        return loader

    reference = [b.indices.tolist() for b in make()]
    calls = []

    def flaky(function):
        return failing_once(function, calls, 2)

    if fails == "join":
        monkeypatch.setattr(
            rows_module.Rows, "concat", staticmethod(flaky(rows_module.Rows.concat))
        )
    else:
        monkeypatch.setattr(codec_module.BatchCodec, "build", flaky(codec_module.BatchCodec.build))
    failing = make()
    head = []
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        for b in failing:
            head.append(b.indices.tolist())
    monkeypatch.undo()
    state = copy.deepcopy(failing.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b.indices.tolist() for b in resumed] == reference


class _WithIndex(Dataset):
    """EncodedDataset(n) whose examples also carry their index (a third field)."""

    def __init__(self, n: int) -> None:
        self.inner = EncodedDataset(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return (*self.inner[i], i)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("fail_at", [0, 5], ids=["run-start", "epoch-1-start"])
@pytest.mark.parametrize("index_key", [None, 2], ids=["sampler", "index_key"])
def test_a_pass_raising_on_an_epochs_first_batch_resumes_with_that_epochs_order(
    fail_at, prefetch, index_key
):
    """The first source batch of an epoch raises (its order already drawn, nothing consumed):
    the state saved after it resumes that epoch in its own order, and every later epoch as the
    uninterrupted run has them (the source's generators are past the epoch's draw). Also for a
    DataLoader read as an iterable with its indices in a field (``index_key=``), whose order
    the loader follows through the DataLoader's generator."""

    def make(model):
        if index_key is None:
            return shuffled_loader(
                40, 8, 0, model, SelectiveBackprop(0.5), batch_size=4, prefetch=prefetch
            )
        source = DataLoader(
            _WithIndex(40),
            batch_size=8,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
        )
        return SelectiveLoader(
            source,
            model,
            policy=SelectiveBackprop(0.5),
            batch_size=4,
            prefetch=prefetch,
            index_key=index_key,
            seed=0,
        )

    def epochs(loader, n):
        return [b.indices.tolist() for _ in range(n) for b in loader]

    reference = epochs(make(FlakyLoss()), 3)
    failing = make(FlakyLoss(fail_at=fail_at))
    head = []
    with pytest.raises(RuntimeError, match="transient failure"):
        for _ in range(3):
            head += [b.indices.tolist() for b in failing]
    state = copy.deepcopy(failing.state_dict())
    resumed = make(FlakyLoss())
    resumed.load_state_dict(state)
    assert head + epochs(resumed, 3 - fail_at // 5) == reference


def test_a_state_held_in_memory_is_not_changed_by_training_steps_that_change_batches_in_place():
    """A state saved mid-epoch with pending rows shares no memory with the batches handed out
    later, nor (once loaded) with those handed out from it: a step that normalises its inputs
    in place changes neither, and the state rolls back to the same batches every time."""

    def make() -> SelectiveLoader:
        return shuffled_loader(60, 16, 1, IndexLoss(), RandomBackprop(0.7), batch_size=5, seed=3)

    def record(batches) -> list[tuple[list[int], list[float]]]:
        out = []
        for b in batches:
            out.append((b.indices.tolist(), b[0][:, 0].tolist()))
            b[0].mul_(2)  # the training step changes its inputs in place
            b.weights.mul_(0)
        return out

    loader = make()
    it = iter(loader)
    next(it)
    while loader.pending_examples == 0:
        next(it)
    state = loader.state_dict()
    record(it)  # the run goes on, changing its batches
    expected = [
        (i, [float(v) for v in i]) for i in ([b.indices.tolist() for b in _resumed(make, state)])
    ]
    for _ in range(2):  # the same state object, loaded twice, after batches changed in place
        loader.load_state_dict(state)
        assert record(loader) == expected


@pytest.mark.parametrize("left", [False, True], ids=["iterator_held", "loop_left"])
@pytest.mark.parametrize("unconsumed", [1, 2])
@pytest.mark.parametrize(
    "policy, batch_size",
    [
        (lambda: SelectiveBackprop(0.5), 5),  # kept rows re-batched
        (lambda: Traditional(), 16),  # source batches handed out whole (the fast path)
        (lambda: Traditional(), 5),  # re-batched
    ],
    ids=["sb", "traditional_whole", "traditional_rebatched"],
)
def test_a_batch_taken_back_resumes_as_it_was_handed_out_though_the_step_changed_it(
    policy, batch_size, unconsumed, left
):
    """The batches a state takes back (steps that normalised their inputs and scaled their
    weights in place, the last of them raising) resume as they were handed out, not as the steps
    left them: inputs, indices and weights, then the rest of the epoch as an uninterrupted run's;
    whether the iterator is still held or the loop was left by the error."""

    def make() -> SelectiveLoader:
        return shuffled_loader(64, 16, 1, IndexLoss(), policy(), batch_size=batch_size, seed=3)

    def seen(b) -> tuple[list[int], list[float], list[float]]:
        return b.indices.tolist(), b[0][:, 0].tolist(), b.weights.tolist()

    reference = [seen(b) for b in make()]
    loader, head = make(), []

    def step(b) -> None:
        head.append(seen(b))
        if len(head) > 4 - unconsumed:  # a step not trained: it changes its batch in place
            b[0].sub_(100.0)
            b.weights.mul_(0)
            b.indices.fill_(-7)
        if len(head) == 4:
            raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        if left:
            for b in loader:
                step(b)
        else:
            it = iter(loader)
            while True:
                step(next(it))
    state = loader.state_dict(unconsumed=unconsumed)
    resumed = [seen(b) for b in _resumed(make, state)]
    assert head[: 4 - unconsumed] + resumed == reference


def boxed(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """EncodedDataset's examples as a dict batch with a field of one tensor per example (a
    detection batch's boxes, which have no common shape) and one of a dict per example (its
    targets, as torchvision's detection models take them)."""
    x = torch.stack([s[0] for s in samples])
    return {
        "input": x,
        "target": torch.stack([s[1] for s in samples]),
        "boxes": [s[0][:2].clone().repeat(1 + int(s[0][0]) % 3, 1) for s in samples],
        "targets": [{"labels": s[1].clone().view(1)} for s in samples],
    }


def boxes_seen(b) -> list[tuple[int, list[list[float]], int]]:
    return [
        (int(i), box.tolist(), int(t["labels"]))
        for i, box, t in zip(b.indices, b["boxes"], b["targets"])
    ]


@pytest.mark.parametrize(
    "policy, batch_size",
    [(lambda: RandomBackprop(0.5), 5), (lambda: Traditional(), 16)],
    ids=["rebatched", "traditional_whole"],
)
def test_list_fields_of_tensors_resume_as_handed_out_though_steps_changed_them_in_place(
    policy, batch_size
):
    """A field that is a list of per-example tensors (boxes), or of dicts of them, is copied as
    tensor fields are: a batch taken back with ``unconsumed=1``, and a state held in memory
    with pending rows, resume as they were handed out, though the steps changed the list's
    tensors in place (before, those were shared with the batches, and resumed as changed)."""

    def make() -> SelectiveLoader:
        source = DataLoader(EncodedDataset(64), batch_size=16, collate_fn=boxed)
        return SelectiveLoader(source, IndexLoss(), policy=policy(), batch_size=batch_size, seed=0)

    def step(b) -> None:
        for box, t in zip(b["boxes"], b["targets"]):
            box.mul_(-1)  # e.g. boxes scaled to the image in place
            t["labels"].add_(100)

    reference = [boxes_seen(b) for b in make()]
    loader = make()
    it = iter(loader)
    b = next(it)
    step(b)
    taken_back = loader.state_dict(unconsumed=1)  # held in memory, not saved to a file
    while loader.pending_examples == 0 and batch_size != 16:
        step(next(it))
    pending = loader.state_dict()
    held = loader.batches_yielded
    for b in it:  # the run goes on, changing its batches
        step(b)
    for state, start in ((taken_back, 0), (pending, held)):
        fresh = make()
        fresh.load_state_dict(state)
        assert [boxes_seen(b) for b in fresh] == reference[start:]


def _resumed(make, state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    return list(fresh)


def test_a_refused_constructor_leaves_the_policy_and_its_running_loader_alone():
    """A SelectiveLoader constructor that refuses an argument (a typo fixed in a second call, in
    a notebook) must not have attached the policy: the loader already running on it keeps its
    window and goes on."""
    data = EncodedDataset(60)
    policy = SelectiveBackprop(1 / 3, staleness=3)
    first = SelectiveLoader(
        DataLoader(data, batch_size=20), IndexLoss(), policy=policy, batch_size=10
    )
    list(first)
    held = len(policy.window)
    assert held == 60
    with pytest.raises(ValueError, match="remainder should be one of"):
        SelectiveLoader(
            DataLoader(data, batch_size=20),
            IndexLoss(),
            policy=policy,
            batch_size=10,
            remainder="keep",
        )
    assert len(policy.window) == held
    list(first)  # the first loader goes on (it would raise "given to another SelectiveLoader")
    assert first.epoch == 2


def test_el2n_refuses_a_seed_whose_copies_overflow_torchs_seeds_before_training():
    from torch.utils.data import TensorDataset

    from sbloader import el2n_scores

    built = []

    def make_model():
        built.append(1)
        return torch.nn.Linear(5, 3)

    source = DataLoader(TensorDataset(torch.randn(40, 5), torch.randint(0, 3, (40,))), 8)
    with pytest.raises(ValueError, match=r"seed should be at most 2\*\*64 - models"):
        el2n_scores(
            make_model,
            source,
            make_optimizer=lambda m: torch.optim.SGD(m.parameters(), 0.1),
            models=2,
            epochs=1,
            seed=2**64 - 1,
        )
    sgd = lambda m: torch.optim.SGD(m.parameters(), 0.1)  # noqa: E731
    with pytest.raises(ValueError, match="models should be >= 1, but got models=0"):
        el2n_scores(make_model, source, make_optimizer=sgd, models=0)  # (all NaN scores)
    assert built == []
    # The largest seed allowed: copy 1 is seeded with 2**64 - 1, torch's largest.
    el2n_scores(make_model, source, make_optimizer=sgd, models=2, epochs=0, seed=2**64 - 2)
    assert built == [1, 1]
