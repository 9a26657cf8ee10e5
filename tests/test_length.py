"""An honest ``len(loader)``: training epochs of a fixed number of batches
(``batches_per_epoch=``), and iterable sources (``drop_index=``, ``dataset_size=``).

The fixed-length epochs are checked against the loader without the option: the same stream of
batches, only cut into epochs differently, so nothing is lost, repeated or reordered.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import itertools
import logging
import multiprocessing
import warnings
import weakref

import pytest
import torch
from conftest import EncodedDataset, IndexLoss, ListedBatches
from torch.utils.data import DataLoader

import sbloader
from sbloader import (
    Kath18,
    Phased,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
    Traditional,
)
from sbloader.length import BARREN_PASSES, FixedEpochs

POLICIES = {
    "sb-third": lambda: SelectiveBackprop(1 / 3, history=64),
    "sb-half": lambda: SelectiveBackprop(0.5, history=64),
    "random": lambda: RandomBackprop(0.25),
    "kath18": lambda: Kath18(0.5),
    "phased": lambda: Phased(SelectiveBackprop(1 / 3, history=64), warmup_epochs=1),
    "stale": lambda: SelectiveBackprop(1 / 3, history=64, staleness=2),
    "traditional": Traditional,
}


def source(n: int = 120, bs: int = 20, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(EncodedDataset(n), batch_size=bs, shuffle=True, generator=g)


def make(policy="sb-third", seed=0, n=120, per_epoch="expected", **kwargs) -> SelectiveLoader:
    kwargs.setdefault("batch_size", 8)
    return SelectiveLoader(
        source(n, seed=seed),
        IndexLoss(),
        policy=POLICIES[policy](),
        seed=seed,
        batches_per_epoch=per_epoch,
        **kwargs,
    )


def indices(batches) -> list[list[int]]:
    return [b.indices.tolist() for b in batches]


def stream(loader: SelectiveLoader, n_batches: int) -> list[list[int]]:
    """The first ``n_batches`` batches a loader without batches_per_epoch yields, epoch after
    epoch."""
    out: list[list[int]] = []
    while len(out) < n_batches:
        out += indices(loader)
    return out[:n_batches]


# ---------------------------------------------------------------------- len() is what is yielded
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("per_epoch", ["expected", 4])
def test_len_is_the_number_of_batches_of_every_epoch(policy, seed, per_epoch):
    loader = make(policy, seed, per_epoch=per_epoch)
    k = len(loader)
    if per_epoch == "expected":  # Traditional: 120 examples in batches of 8; else rounded
        per_pass = 15 if policy == "traditional" else 120 * loader.policy.steady_rate / 8
        assert k == round(per_pass)
    else:
        assert k == per_epoch
    for epoch in range(5):
        assert loader.training_epoch == epoch
        sizes = [len(b[0]) for b in loader]
        assert len(sizes) == len(loader) == k
        assert sizes == [8] * k  # full batches, Traditional's too


def test_expected_uses_the_rate_after_the_warmup():
    """A Traditional warm-up keeps everything in pass 0; "expected" is sized by the selecting
    policy's rate, so the warm-up pass spans about three training epochs."""
    loader = make("phased", per_epoch="expected")
    assert loader.expected_batches() == pytest.approx(120 / 8)  # the warm-up pass's rate
    assert len(loader) == round(120 / 3 / 8) == 5
    passes = []
    for _ in range(4):
        list(loader)
        passes.append(loader.epoch)
    # 15 warm-up batches make three training epochs; the pass ends on the fourth's first batch.
    assert passes == [0, 0, 0, 1]
    assert loader.stats.epochs[0].batches_yielded == 15


@pytest.mark.parametrize("policy", ["sb-third", "random", "phased", "stale", "kath18"])
@pytest.mark.parametrize("remainder", ["carry", "drop"])
@pytest.mark.parametrize("per_epoch", [3, 11])
def test_the_batches_are_those_of_the_loader_without_the_option(policy, remainder, per_epoch):
    """Short passes continue into the next pass, long ones carry their surplus: the batches, in
    order, are exactly the unfixed loader's; no example is lost or yielded twice."""
    fixed = make(policy, remainder=remainder, per_epoch=per_epoch)
    got = [indices(fixed) for _ in range(6)]
    flat = [b for epoch in got for b in epoch]
    assert flat == stream(make(policy, remainder=remainder, per_epoch=None), len(flat))
    assert all(len(epoch) == len(fixed) for epoch in got)
    # The counts agree: every selected example was yielded, is pending, or was dropped.
    total = fixed.stats.total
    rest = fixed.pending_examples + total.dropped
    assert total.examples_selected == total.examples_yielded + rest
    assert total.examples_yielded == 6 * len(fixed) * 8


def test_an_abandoned_epoch_loses_nothing_and_the_next_has_its_full_count():
    loader = make(per_epoch=5)
    got = indices(loader)
    it = iter(loader)
    got += [next(it).indices.tolist() for _ in range(2)]  # `break` after two batches
    del it
    assert loader.training_epoch == 2  # epoch 1 was abandoned
    again = indices(loader)
    assert len(again) == 5 and loader.training_epoch == 3  # epoch 1 was abandoned
    assert got + again == stream(make(per_epoch=None), 12)


def test_a_state_saved_after_an_abandoned_epoch_resumes_with_the_next():
    def run(resume: bool) -> list[list[int]]:
        loader = make(per_epoch=5)
        got = indices(loader)
        it = iter(loader)
        got += [next(it).indices.tolist() for _ in range(2)]
        del it  # `break`: training epoch 1 is abandoned
        if resume:
            state = copy.deepcopy(loader.state_dict())
            loader = make(per_epoch=5)
            loader.load_state_dict(state)
        assert loader.training_epoch == 2  # the abandoned epoch counts as ended
        return got + indices(loader) + [[loader.training_epoch]]

    assert run(resume=True) == run(resume=False)


def test_a_copy_has_its_own_training_epochs_and_is_refused_while_its_pass_runs():
    """copy.deepcopy of a loader with batches_per_epoch copied its clock's weak reference to
    the training-epoch iterator as it was: iter(copy) closed the original's (unstarted) epoch.
    The copy now has its own; once a pass is under way (it goes on across training epochs),
    the copy is refused with the fix, and the fix (a new loader loading the state) goes on as
    the original does."""
    loader = make(per_epoch=5)
    it = iter(loader)  # a training epoch's iterator, not started
    twin = copy.deepcopy(loader)
    assert indices(twin) == indices(it)  # iter(twin) left the original's iterator alone
    assert loader.training_epoch == twin.training_epoch == 1
    with pytest.raises(
        TypeError, match="pass over the data is under way, which with batches_per_epoch"
    ) as refused:
        copy.deepcopy(loader)  # between training epochs: the pass is under way
    assert "load_state_dict(loader.state_dict())" in str(refused.value)
    resumed = make(per_epoch=5)
    resumed.load_state_dict(copy.deepcopy(loader.state_dict()))
    assert indices(resumed) + indices(resumed) == indices(loader) + indices(loader)


def test_a_closed_epoch_iterator_refuses_to_go_on():
    loader = make(per_epoch=5)
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(RuntimeError, match="closed"):
        next(first)
    assert sum(1 for _ in second) == 5


def test_pass_epochs_and_training_epochs_are_counted_apart():
    """loader.epoch and progress count passes over the data (policies are keyed on them);
    training_epoch counts epochs of batches_per_epoch; stats has one entry per pass."""
    loader = make("random", per_epoch=2)  # 120 * 0.25 / 8 = 3.75 batches per pass
    for _ in range(4):
        list(loader)
    assert loader.training_epoch == 4
    assert loader.epoch == 2 and 2.0 < loader.progress < 3.0
    assert [e.epoch for e in loader.stats.epochs] == [0, 1, 2]
    assert sum(e.batches_yielded for e in loader.stats.epochs) == 8


def test_time_between_training_epochs_is_not_the_passes(monkeypatch):
    """An evaluation between training epochs (here 1000 s of a fake clock) is counted neither as
    the training step's time (consumer_s) nor as the pass's wall time, though the pass spans it."""
    now = [0.0]
    monkeypatch.setattr(sbloader.epoch, "perf_counter", lambda: now[0])
    loader = make("random", per_epoch=2)  # 3.75 batches a pass: passes span training epochs
    for _ in range(4):
        for _batch in loader:
            now[0] += 1.0  # the training step
        now[0] += 1000.0  # the evaluation
    total = loader.stats.total
    assert 0 < total.consumer_s <= 8 and 0 < total.wall_s <= 8


# ---------------------------------------------------------------------- frameworks that need len
def test_one_cycle_lr_steps_through_every_epoch():
    loader = make("sb-third", per_epoch="expected")
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    epochs = 6
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, steps_per_epoch=len(loader), epochs=epochs
    )
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
    with pytest.raises(ValueError, match="Tried to step"):
        sched.step()  # every scheduled step was taken: one more is refused


def test_tqdm_shows_the_total():
    tqdm = pytest.importorskip("tqdm").tqdm
    loader = make(per_epoch="expected")
    out = io.StringIO()
    bar = tqdm(loader, file=out)
    assert bar.total == len(loader) == 5
    assert sum(1 for _ in bar) == 5
    bar.close()
    assert "5/5" in out.getvalue()


# ---------------------------------------------------------------------- resume
@pytest.mark.parametrize("policy", ["sb-third", "phased", "stale"])
@pytest.mark.parametrize("stop", [(1, 3), (2, 0), (1, 7), (3, 5)])
def test_a_resume_mid_epoch_yields_what_an_uninterrupted_run_does(policy, stop):
    """Stopped after ``stop[1]`` batches of training epoch ``stop[0]`` (7 of 7: after the last
    batch, before the epoch's end is asked for, as Lightning's checkpoints are), saved,
    restored into a new loader: every epoch is the uninterrupted run's."""
    epochs, (stop_epoch, stop_batch) = 5, stop
    whole = make(policy, per_epoch=7)
    expected = [indices(whole) for _ in range(epochs)]

    loader = make(policy, per_epoch=7)
    got = [indices(loader) for _ in range(stop_epoch)]
    it = iter(loader)
    got.append([next(it).indices.tolist() for _ in range(stop_batch)])
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    del it
    resumed = make(policy, per_epoch=7)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.training_epoch == stop_epoch
    got[-1] += indices(resumed)
    got += [indices(resumed) for _ in range(epochs - stop_epoch - 1)]
    assert got == expected
    assert resumed.stats.total.as_dict().keys() == whole.stats.total.as_dict().keys()
    assert resumed.epoch == whole.epoch and resumed.pending_examples == whole.pending_examples


def test_a_resume_with_a_prefetch_thread_is_exact():
    """The suspended pass's prefetch thread has fetched ahead when the state is saved between
    training epochs: the batches it fetched are not counted, and are loaded again on resume."""
    whole = make(per_epoch=4, prefetch=1)
    expected = [indices(whole) for _ in range(4)]
    loader = make(per_epoch=4, prefetch=1)
    got = [indices(loader) for _ in range(2)]
    state = copy.deepcopy(loader.state_dict())
    assert state["active"] and state["position"] > 0  # saved inside a pass
    resumed = make(per_epoch=4, prefetch=1)
    resumed.load_state_dict(state)
    assert got + [indices(resumed) for _ in range(2)] == expected


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dropped_loader_stops_its_suspended_pass_at_once(workers):
    """Between training epochs the loader keeps the pass over the data it suspended (its
    prefetch thread, a DataLoader's worker processes): that pass referred to the loader, so a
    loader dropped there lived on in a reference cycle, threads and worker processes running,
    until the garbage collector happened to run (a process that built loaders one after another
    gathered a hundred idle workers). Dropped, it now stops them at once."""
    gc.disable()  # (only reference counting frees the loader: no collection in between)
    try:
        loader = SelectiveLoader(
            DataLoader(EncodedDataset(120), batch_size=20, num_workers=workers),
            IndexLoss(),
            policy=POLICIES["sb-third"](),
            batch_size=8,
            batches_per_epoch=2,
            prefetch=1,
        )
        indices(loader)
        suspended = loader._fixed._pass
        assert suspended is not None and suspended.running  # a pass left for the next epoch
        fetch = weakref.ref(suspended._fetch)
        del loader, suspended
        assert fetch() is None  # the pass, its prefetch thread and its source are gone
        assert not [w for w in multiprocessing.active_children() if w.is_alive()]
    finally:
        gc.enable()


def test_unconsumed_needs_a_running_training_epoch():
    """state_dict(unconsumed=1) takes back the last batch of the training epoch under way: once
    that epoch has ended (or was abandoned), its batches were all handed out in it, and the pass
    still running in between must not hand one of them out again in the next epoch; refused as
    without batches_per_epoch. Inside a training epoch (after its last batch too) it resumes the
    uninterrupted run exactly."""
    loader = make(per_epoch=3)
    with pytest.raises(ValueError, match="no training epoch is running"):
        loader.state_dict(unconsumed=1)  # none has begun
    indices(loader)  # training epoch 0 ended: the pass over the data is suspended, not over
    with pytest.raises(ValueError, match="no training epoch is running"):
        loader.state_dict(unconsumed=1)
    it = iter(loader)
    next(it)
    del it  # training epoch 1 abandoned
    with pytest.raises(ValueError, match="no training epoch is running"):
        loader.state_dict(unconsumed=1)

    whole = make(per_epoch=3)
    expected = [indices(whole) for _ in range(3)]
    loader = make(per_epoch=3)
    got = [indices(loader)]
    it = iter(loader)
    got.append([next(it).indices.tolist() for _ in range(3)])  # the last batch, not trained
    state = copy.deepcopy(loader.state_dict(unconsumed=1))
    del it
    resumed = make(per_epoch=3)
    resumed.load_state_dict(state)
    got[-1] = got[-1][:-1] + indices(resumed)
    got.append(indices(resumed))
    assert got == expected


def test_two_batches_taken_back_must_both_be_of_the_training_epoch_under_way():
    """state_dict(unconsumed=2) (a step that raised with a batch fetched ahead) at the first
    batch of a training epoch would take back the last batch of the one before, which the next
    training epoch would hand out again: refused, naming the fix. From the second batch on, the
    resumed run hands both out again and goes on as the uninterrupted run does."""
    whole = make(per_epoch=3)
    expected = [indices(whole) for _ in range(4)]
    loader = make(per_epoch=3)  # (passes over the data of 4 batches: 0-3, 4-7, ...)
    got = [indices(loader), indices(loader)]
    it = iter(loader)
    got.append([next(it).indices.tolist()])
    assert loader.takes_back(1) and not loader.takes_back(2)
    with pytest.raises(ValueError, match=r"belongs to an earlier training epoch.*unconsumed=1"):
        loader.state_dict(unconsumed=2)
    got[-1].append(next(it).indices.tolist())  # (fetched ahead; the step on the first raised)
    assert loader.takes_back(2)
    state = copy.deepcopy(loader.state_dict(unconsumed=2))
    assert state["training"]["yielded"] == 0 and len(state["returned"]) == 2
    del it
    resumed = make(per_epoch=3)
    resumed.load_state_dict(state)
    got[-1] = indices(resumed)
    got.append(indices(resumed))
    assert got == expected


def test_two_batches_taken_back_must_both_be_of_the_pass_under_way():
    """With batches_per_epoch a pass over the data may end inside a training epoch: the batch
    before the pass's first was handed out by a pass that has ended, and is not taken back with
    it (refused, naming why and the fix)."""
    loader = make(per_epoch=3)  # (passes over the data of 4 batches: 0-3, 4-7, ...)
    indices(loader)
    it = iter(loader)
    next(it), next(it)  # the 4th batch of the stream (pass 0's last), then pass 1's first
    assert loader.takes_back(1) and not loader.takes_back(2)
    with pytest.raises(ValueError, match=r"earlier pass over the data.*pass unconsumed=1"):
        loader.state_dict(unconsumed=2)


def test_a_state_of_another_length_is_refused():
    loader = make(per_epoch=5)
    list(loader)
    state = copy.deepcopy(loader.state_dict())
    with pytest.raises(ValueError, match="batches_per_epoch"):
        make(per_epoch=6).load_state_dict(state)
    with pytest.raises(ValueError, match="batches_per_epoch"):
        make(per_epoch=None).load_state_dict(state)
    old = make(per_epoch=None).state_dict()  # as saved before batches_per_epoch existed
    del old["training"], old["identity"]["batches_per_epoch"]
    with pytest.raises(ValueError, match="saved without batches_per_epoch"):
        make(per_epoch=5).load_state_dict(old)
    # the clock refuses another count itself too (whatever state the loader hands it)
    clock = FixedEpochs(5)
    with pytest.raises(ValueError, match=r"has batches_per_epoch=6, but this loader has .*=5;"):
        clock.load_state_dict(FixedEpochs(6).state_dict())
    clock.load_state_dict({**FixedEpochs(5).state_dict(), "epoch": 3})
    assert clock.current() == (3, 0, False)


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", [0, -1, "foo", 2.0, True, [3]])
def test_bad_batches_per_epoch_is_refused_at_construction(bad):
    with pytest.raises((TypeError, ValueError), match="batches_per_epoch should be a positive"):
        make(per_epoch=bad)


def test_expected_batches_at_a_given_rate_counts_the_subset_and_checks_the_rate():
    """expected_batches(rate) is the pass's batches at that share kept (what Lightning's
    max_steps check compares a planned anneal with: a selective pass's and a full one's),
    within the subset as the policy's own rate is; a rate outside [0, 1] is refused naming
    it."""
    loader = make("sb-half", subset=list(range(0, 120, 2)))
    assert loader.expected_batches(1.0) == pytest.approx(60 / 8)
    assert loader.expected_batches(0.25) == pytest.approx(60 * 0.25 / 8)
    assert loader.expected_batches() == loader.expected_batches(0.5)
    with pytest.raises(ValueError, match=r"rate should be in \[0, 1\], but got rate=1.5"):
        loader.expected_batches(1.5)


def test_remainder_short_is_refused_with_a_fixed_length():
    with pytest.raises(ValueError, match="remainder='carry' or 'drop'"):
        make(per_epoch=5, remainder="short")


def test_expected_counts_only_the_subset():
    half = list(range(0, 120, 2))
    loader = make("sb-half", per_epoch="expected", subset=half)
    assert loader.expected_batches() == pytest.approx(60 * 0.5 / 8)
    assert len(loader) == round(60 * 0.5 / 8) == 4
    for _ in range(3):
        got = indices(loader)
        assert len(got) == 4 and all(i % 2 == 0 for b in got for i in b)


@pytest.mark.parametrize("subset", [None, list(range(0, 110, 2))])
def test_expected_counts_only_the_full_batches_of_a_source_that_drops_its_last(subset):
    """A DataLoader with drop_last=True draws 5 batches of 20 of 110 examples, 100 a pass (a
    subset's share is taken of those 100, the dropped 10 drawn before it filters):
    expected_batches() and "expected" counted all 110, and planned too many batches a pass."""
    g = torch.Generator().manual_seed(0)
    drops = DataLoader(
        EncodedDataset(110), batch_size=20, shuffle=True, drop_last=True, generator=g
    )
    share = 1.0 if subset is None else 0.5

    def build(**kwargs):
        policy = SelectiveBackprop(0.5, history=64)
        return SelectiveLoader(
            drops, IndexLoss(), policy=policy, batch_size=8, subset=subset, **kwargs
        )

    loader = build()
    assert loader.expected_batches() == pytest.approx(100 * share * 0.5 / 8)
    assert len(build(batches_per_epoch="expected")) == round(100 * share * 0.5 / 8)
    list(loader)
    if subset is None:
        assert loader.stats.epochs[0].examples_seen == 100


def test_expected_rounding_to_no_batch_is_refused():
    with pytest.raises(ValueError, match="rounds to 0"):
        make("random", n=20, per_epoch="expected", batch_size=16)


def test_expected_under_drop_counts_the_whole_batches_of_a_pass():
    """remainder="drop" drops each pass's rest, so a pass expected to select 40 examples (2.5
    batches of 16) yields 2 batches (3 only where it selects 48 or more): "expected" is 2, a
    training epoch about a pass (it was 3, about 1.5 passes); with "carry" it rounds to 3."""
    unfixed = make(per_epoch=None, batch_size=16, remainder="drop")
    for _ in range(10):
        list(unfixed)
    per_pass = [e.batches_yielded for e in unfixed.stats.epochs]
    assert sum(per_pass) / len(per_pass) < 2.5
    assert len(make(batch_size=16, remainder="drop")) == 2
    assert len(make(batch_size=16, remainder="carry")) == 3


def test_expected_under_drop_of_less_than_a_batch_is_refused():
    """5 examples expected per pass in batches of 8 (0.625 batches): under "drop" most passes
    yield nothing, and one batch a training epoch took tens of passes; refused, naming
    "carry" (which rounds it to 1)."""
    with pytest.raises(ValueError, match=r"rounds to 0 \(remainder='drop'.*remainder='carry'"):
        make("random", n=20, per_epoch="expected", remainder="drop")
    assert len(make("random", n=20, per_epoch="expected", remainder="carry")) == 1


def test_an_int_under_drop_of_less_than_a_batch_per_pass_is_refused_when_built():
    """5 examples kept per pass of 20 in batches of 16, the rest dropped: most passes yield
    nothing. Refused as the loader is built (before, after BARREN_PASSES passes of selection
    forwards over the whole data); "carry" works."""
    with pytest.raises(ValueError, match=r"keeps about 5 examples per pass.*batch_size=16.*carry"):
        make("random", n=20, per_epoch=1, batch_size=16, remainder="drop")
    for policy in ("sb-third", "phased", "stale", "kath18"):  # 6.7 to 10 of 20, batches of 16
        with pytest.raises(ValueError, match="can hardly be filled"):
            make(policy, n=20, per_epoch=1, batch_size=16, remainder="drop")
    carried = make("random", n=20, per_epoch=1, batch_size=16, remainder="carry")
    assert [len(b[0]) for b in carried] == [16]
    assert len(list(make("random", n=80, per_epoch=1, batch_size=16, remainder="drop"))) == 1


def test_a_source_of_unknown_length_is_refused_after_its_first_barren_pass_under_drop():
    """With no length known when built, the first pass that yields nothing tells: 120 examples,
    about 30 kept, batches of 40, the rest dropped (one pass's forwards, not a hundred)."""
    model = IndexLoss()
    loader = SelectiveLoader(
        ExampleStream(n=120, bs=20),
        model,
        policy=RandomBackprop(0.25),
        batch_size=40,
        index_key=2,
        batches_per_epoch=1,
        remainder="drop",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refusal = r"had 120 examples, of which the policy keeps about 30"
        with pytest.raises(ValueError, match=refusal):
            next(iter(loader))
    # (the refusal says it: not also the warning of a plain epoch that yielded no batch)
    assert not [w for w in caught if "yielded no batch" in str(w.message)]
    assert model.calls == 0  # Random-Backprop forwards nothing: refused after the one pass
    assert loader.stats.total.examples_seen == 120


def test_passes_that_never_fill_a_batch_raise_instead_of_looping():
    """Expected to fill a batch, but every loss is NaN (skipped): nothing is ever kept, and the
    loader raises after BARREN_PASSES passes instead of looping over the data forever."""

    class NaNLoss(IndexLoss):
        def forward(self, x):
            return super().forward(x) * float("nan")

    loader = SelectiveLoader(
        source(40),
        NaNLoss(),
        policy=SelectiveBackprop(0.5, history=64),
        batch_size=8,
        batches_per_epoch=1,
        remainder="drop",
    )
    with pytest.raises(ValueError, match=f"{BARREN_PASSES} passes over the source"):
        next(iter(loader))


def test_traditional_that_drops_a_pass_smaller_than_a_batch_is_refused_when_built():
    """Certain from the start (a pass of 20 examples, batches of 32, the rest dropped): refused
    as the loader is built, not after BARREN_PASSES passes; carrying the rest works."""
    with pytest.raises(ValueError, match=r"20 examples, fewer than batch_size=32.*carry"):
        make("traditional", n=20, per_epoch=2, batch_size=32, remainder="drop")
    carried = make("traditional", n=20, per_epoch=2, batch_size=32, remainder="carry")
    assert [len(b[0]) for b in carried] == [32, 32]


# ---------------------------------------------------------------------- iterable sources
class ExampleStream(torch.utils.data.IterableDataset):
    """Batches of (inputs, targets, indices) with no length, as a streaming source yields."""

    def __init__(self, n: int = 120, bs: int = 20, dicts: bool = False) -> None:
        self.n, self.bs, self.dicts = n, bs, dicts
        self.ds = EncodedDataset(n)

    def __iter__(self):
        for start in range(0, self.n, self.bs):
            rows = range(start, min(start + self.bs, self.n))
            x = torch.stack([self.ds[i][0] for i in rows])
            y = torch.stack([self.ds[i][1] for i in rows])
            idx = torch.tensor(list(rows))
            yield {"input": x, "index": idx, "target": y} if self.dicts else (x, y, idx)


def stream_loader(**kwargs) -> SelectiveLoader:
    kwargs.setdefault("policy", SelectiveBackprop(0.5, history=64))
    kwargs.setdefault("batch_size", 8)
    return SelectiveLoader(ExampleStream(dicts=kwargs.pop("dicts", False)), IndexLoss(), **kwargs)


def test_drop_index_makes_the_readme_loop_work():
    loader = stream_loader(index_key=2, drop_index=True)
    n = 0
    for x, y in loader:  # the README loop: no third element
        batch_indices = x[:, 0].long()
        assert torch.equal(batch_indices, y.new_tensor(0) + batch_indices)
        n += len(y)
    batch = next(iter(loader))
    assert torch.equal(batch[0][:, 0].long(), batch.indices)  # indices still attached
    assert torch.equal(batch[1], batch.indices % 4)
    assert n == loader.stats.epochs[0].examples_yielded > 0
    with pytest.raises(ValueError, match="too many values to unpack"):
        for _x, _y in stream_loader(index_key=2):  # without drop_index: the original failure
            pass


def test_drop_index_on_dicts_by_negative_position_and_with_metadata():
    batch = next(iter(stream_loader(dicts=True, index_key="index", drop_index=True)))
    assert list(batch) == ["input", "target"]
    assert torch.equal(batch["input"][:, 0].long(), batch.indices)
    x, y, meta = next(iter(stream_loader(index_key=-1, drop_index=True, metadata_key="sb")))
    assert torch.equal(meta["indices"], x[:, 0].long()) and torch.equal(y, meta["indices"] % 4)


def test_drop_index_needs_an_index_field():
    with pytest.raises(ValueError, match="pass index_key="):
        stream_loader(drop_index=True)
    with pytest.raises(ValueError, match="leave drop_index out"):
        SelectiveLoader(source(), IndexLoss(), drop_index=True)
    loader = stream_loader(index_key=1, drop_index=True)  # the target field itself
    with pytest.raises(ValueError, match="it is the input or target field"):
        next(iter(loader))
    with pytest.raises(TypeError, match="drop_index should be True or False"):
        stream_loader(index_key=2, drop_index="yes")


def test_drop_index_survives_a_resume():
    """The index field is still left out after a restored state (the batch format is saved),
    and the resumed epoch is the uninterrupted one's."""

    def run() -> SelectiveLoader:
        return stream_loader(index_key=2, drop_index=True, batches_per_epoch=3, dataset_size=120)

    whole = run()
    expected = [indices(whole) for _ in range(2)]
    loader = run()
    it = iter(loader)
    first = [next(it).indices.tolist()]
    state = copy.deepcopy(loader.state_dict())
    del it
    resumed = run()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert all(len(b) == 2 for b in rest)  # (inputs, targets): no index field
    assert [first + indices(rest), indices(resumed)] == expected


def test_expected_batches_of_a_stream_without_length_names_the_fix():
    loader = stream_loader(index_key=2)
    with pytest.raises(TypeError, match="pass dataset_size="):
        loader.expected_batches()
    with pytest.raises(ValueError, match=r'"expected" cannot be computed.*dataset_size='):
        stream_loader(index_key=2, batches_per_epoch="expected")
    sized = stream_loader(index_key=2, dataset_size=120)
    assert sized.expected_batches() == pytest.approx(120 * 0.5 / 8)

    class Samples(torch.utils.data.IterableDataset):  # one (x, y, index) at a time, no len
        def __iter__(self):
            ds = EncodedDataset(120)
            return ((*ds[i], i) for i in range(120))

    batched = DataLoader(Samples(), batch_size=20)  # the DataLoader over a stream
    with pytest.raises(TypeError, match=r"has no length.*pass dataset_size="):
        SelectiveLoader(batched, IndexLoss(), index_key=2, batch_size=8).expected_batches()
    loader = SelectiveLoader(
        batched,
        IndexLoss(),
        index_key=2,
        batch_size=8,
        dataset_size=120,
        drop_index=True,
        policy=SelectiveBackprop(0.5),
        batches_per_epoch="expected",
    )
    assert len(loader) == 8 and [len(b) for b in loader] == [2] * 8  # (x, y) batches


@pytest.mark.parametrize("workers", [0, 1])
def test_expected_batches_of_a_sized_stream_count_its_short_last_batch(workers):
    """A DataLoader over a sized IterableDataset of 97 examples in batches of 8, read by at most
    one worker, without dataset_size=: its last batch holds 1 example, and "expected" counted it
    as a full one (13 x 8 = 104 examples; found by review: 7 batches at RandomBackprop(0.5)
    where dataset_size=97 gives 6)."""

    class Sized(torch.utils.data.IterableDataset):
        def __iter__(self):
            ds = EncodedDataset(97)
            return ((*ds[i], i) for i in range(97))

        def __len__(self):
            return 97

    source = DataLoader(Sized(), batch_size=8, num_workers=workers)

    def build(**kwargs):
        return SelectiveLoader(
            source, IndexLoss(), index_key=2, batch_size=8, policy=RandomBackprop(0.5), **kwargs
        )

    assert build().expected_batches() == pytest.approx(97 * 0.5 / 8)
    assert len(build(batches_per_epoch="expected")) == 6
    assert len(build(batches_per_epoch="expected", dataset_size=97)) == 6


def test_dataset_size_gives_a_stream_an_honest_length_and_progress():
    loader = stream_loader(index_key=2, dataset_size=120, batches_per_epoch="expected")
    assert len(loader) == round(120 * 0.5 / 8) == 8
    for _ in range(3):
        assert sum(1 for _ in loader) == 8
    it = iter(loader)
    next(it)
    assert loader.progress > loader.epoch  # counted in examples, not stuck at the pass start


def test_dataset_size_lets_stale_sb_store_a_stream():
    with pytest.raises(ValueError, match="pass dataset_size="):
        stream_loader(index_key=2, policy=SelectiveBackprop(0.5, staleness=2))
    loader = stream_loader(
        index_key=2, dataset_size=120, policy=SelectiveBackprop(0.5, history=64, staleness=2)
    )
    fresh = indices(loader)
    losses, epochs = loader.policy.store.lookup(torch.arange(120).numpy())
    assert (epochs == 0).all() and (losses > 0).all()  # every example stored, by its index
    stale = indices(loader)
    assert loader.stats.epochs[1].selection_forwards == 0 and fresh and stale


def test_dataset_size_is_checked():
    with pytest.raises(ValueError, match=r"outside \[0, dataset_size=100\)"):
        list(stream_loader(index_key=2, dataset_size=100))
    with pytest.raises(ValueError, match="leave it out"):
        SelectiveLoader(source(), IndexLoss(), dataset_size=7)
    with pytest.raises(TypeError, match="dataset_size should be an int"):
        stream_loader(index_key=2, dataset_size=1.5)
    # the bound is exclusive: the stream's last batch holds indices 100 to 119
    with pytest.raises(ValueError, match=r"from 100 to 119, outside \[0, dataset_size=119\)"):
        list(stream_loader(index_key=2, dataset_size=119))
    assert SelectiveLoader(source(), IndexLoss(), dataset_size=120).expected_batches() > 0


def test_the_package_exports_the_epoch_iterator():
    assert type(iter(make(per_epoch=2))) is sbloader.FixedEpochIterator
    assert type(iter(make(per_epoch=None))) is sbloader.EpochIterator


@pytest.mark.parametrize("per_epoch", ["expected", 3])
def test_finishing_is_true_exactly_at_each_training_epochs_last_batch(per_epoch):
    """What Accelerate's gradient accumulation asks (AcceleratedLoader): known from the count."""
    loader = make(per_epoch=per_epoch)
    for _ in range(3):
        it = iter(loader)
        flags = []
        for _batch in it:
            flags.append(it.finishing())
        assert flags == [False] * (len(loader) - 1) + [True]


@pytest.mark.parametrize("per_epoch", [None, 3, "expected"])
def test_batches_yielded_counts_the_training_epoch_and_resumes_with_it(per_epoch):
    """``loader.batches_yielded`` (what Lightning's end-of-epoch check reads): 1, 2, ... within
    each training epoch, from 0 again in the next (with ``batches_per_epoch``, its epochs of that
    many batches, not the passes over the data), and a state saved mid-epoch restores it, so the
    resumed epoch reaches ``len(loader)`` after the same batches."""
    loader = make(per_epoch=per_epoch)
    assert loader.batches_yielded == 0
    counts = []
    for _ in range(3):
        it = iter(loader)
        counts.append([loader.batches_yielded for _ in it])
    if per_epoch is not None:
        assert counts == [list(range(1, len(loader) + 1))] * 3
    else:  # (a pass keeps what its draws keep: its own count)
        assert all(c == list(range(1, len(c) + 1)) and len(c) > 2 for c in counts)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    resumed = make(per_epoch=per_epoch)
    resumed.load_state_dict(state)
    assert resumed.batches_yielded == 2
    rest = [resumed.batches_yielded for _ in resumed]
    assert rest[0] == 3 and rest == list(range(3, len(rest) + 3))
    if per_epoch is not None:
        assert rest[-1] == len(resumed)


# ---------------------------------------------------------------------- Traditional's batches
def traditional(n=1000, bs=64, batch_size=16, **kw) -> SelectiveLoader:
    return SelectiveLoader(
        source(n, bs=bs), IndexLoss(), policy=Traditional(), batch_size=batch_size, **kw
    )


@pytest.mark.parametrize(
    ("bs", "batch_size", "sizes"),
    [
        (64, 16, [16] * 62 + [8]),  # each source batch split in four; the last one's 40 rest
        (30, 64, [64] * 15 + [40]),  # source batches joined
        (20, 20, [20] * 50),  # the source's own batches
        (64, 64, [64] * 15 + [40]),  # ... with its short last batch
    ],
)
def test_traditional_yields_batches_of_batch_size_and_len_counts_them(bs, batch_size, sizes):
    """``batch_size`` is the training batch for every policy, Traditional's included: source
    batches of another size are re-batched (every example once per pass, in the source's order,
    the rest as one short last batch), and ``len`` is exact."""
    loader = traditional(bs=bs, batch_size=batch_size)
    twin = source(1000, bs=bs)  # the same shuffled order
    for _ in range(2):
        order = [int(i) for x, _ in twin for i in x[:, 0].tolist()]
        batches = list(loader)
        assert [len(b.indices) for b in batches] == sizes and len(loader) == len(sizes)
        assert [i for b in batches for i in b.indices.tolist()] == order
        for b in batches:  # data paired with its indices
            assert torch.equal(b[0][:, 0].long(), b.indices)


@pytest.mark.parametrize("leave", ["peek", "break", "raise", "iter again", "save and load"])
def test_traditional_len_holds_after_an_epoch_left_part_way(leave, caplog):
    """An epoch left part-way (a batch looked at with next(iter(loader)), ``break``, an error in
    the training step) left the rest of its source batch pending, and the next epoch yielded it
    before a whole pass: more batches than len(loader), so that OneCycleLR(total_steps=
    len(loader) * epochs) stepped past its end. The next epoch is one whole pass, every example
    once; the dropped rest is counted. A state saved part-way still resumes it."""
    loader = traditional(bs=64, batch_size=16)  # 1000 examples: 63 batches
    assert len(loader) == 63
    if leave == "peek":
        next(iter(loader))
    elif leave == "iter again":
        it = iter(loader)
        next(it)
        iter(loader)
    elif leave == "save and load":
        it = iter(loader)
        head = [next(it).indices.tolist() for _ in range(2)]
        state = copy.deepcopy(loader.state_dict())
        resumed = traditional(bs=64, batch_size=16)
        resumed.load_state_dict(state)
        assert len(head) + len(list(resumed)) == 63  # the rest of that epoch, its rows included
    else:
        with contextlib.suppress(KeyError):
            for k, _ in enumerate(loader):
                if k == 1:
                    if leave == "raise":
                        raise KeyError("a training step's error")
                    break
    with caplog.at_level(logging.INFO, logger="sbloader"):
        for _ in range(2):
            batches = indices(loader)
            assert len(batches) == len(loader)
            assert sorted(i for b in batches for i in b) == list(range(1000))
    dropped = 64 - 16 * (1 if leave in ("peek", "iter again") else 2)
    assert loader.stats.epochs[0].dropped == dropped
    # The epoch's log line was written as it was left; the drop is logged as it is made.
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert any(f"epoch 0 (left part-way): dropped {dropped} more" in m for m in said), said


def test_traditional_with_a_subset_counts_the_subset_exactly():
    keep = list(range(0, 1000, 3))  # 334 examples
    loader = traditional(subset=keep)
    batches = list(loader)
    assert [len(b.indices) for b in batches] == [16] * 20 + [14]
    assert len(loader) == 21 and sorted(i for b in batches for i in b.indices.tolist()) == keep


def test_traditional_len_with_a_subset_of_a_ranks_share_names_the_fix():
    from torch.utils.data import DistributedSampler

    dl = DataLoader(
        EncodedDataset(100),
        batch_size=10,
        sampler=DistributedSampler(EncodedDataset(100), num_replicas=2, rank=0, seed=0),
    )
    loader = SelectiveLoader(dl, IndexLoss(), policy=Traditional(), subset=list(range(50)))
    with pytest.raises(TypeError, match='batches_per_epoch="expected"'):
        len(loader)


@pytest.mark.parametrize("stop", [1, 5, 31, 62])
def test_traditional_rebatched_resumes_exactly(stop):
    first = traditional()
    list(first)
    it = iter(first)
    head = [next(it).indices.tolist() for _ in range(stop)]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = traditional()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    rest = [b.indices.tolist() for b in resumed]
    reference = traditional()
    list(reference)
    assert head + rest == [b.indices.tolist() for b in reference]


@pytest.mark.parametrize("remainder", ["carry", "drop"])
@pytest.mark.parametrize("per_epoch", ["expected", 5])
def test_traditional_with_batches_per_epoch_yields_full_batches(remainder, per_epoch):
    """batches_per_epoch promises training epochs of full batches, and ``remainder`` applies at
    the end of each pass: Traditional's rest of a pass (7 examples in batches of 3) is carried
    into the next pass or dropped, never yielded as a short batch inside a training epoch."""
    loader = SelectiveLoader(
        DataLoader(EncodedDataset(7), batch_size=7),
        IndexLoss(),
        policy=Traditional(),
        batch_size=3,
        batches_per_epoch=per_epoch,
        remainder=remainder,
    )
    assert len(loader) == (2 if per_epoch == "expected" else per_epoch)  # 7 / 3, rounded
    got = [indices(loader) for _ in range(4)]
    assert all(len(epoch) == len(loader) for epoch in got)
    assert all(len(b) == 3 for epoch in got for b in epoch)
    flat = [i for epoch in got for b in epoch for i in b]
    one_pass = list(range(7)) if remainder == "carry" else list(range(6))
    assert flat == (one_pass * len(flat))[: len(flat)]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # (2 workers on one core)
def test_traditional_len_over_a_sized_iterable_source():
    """An iterable source whose size is unknown (its last batch may be short): len() counts its
    own batches when they are handed out as they are, names the fix when they are re-batched,
    and counts exactly with dataset_size=."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __len__(self):
            return 100

        def __iter__(self):
            for i in range(100):
                yield torch.full((6,), float(i)), torch.tensor(i % 3)

    def loader(bs, batch_size, workers=0, **kw):
        dl = DataLoader(Stream(), batch_size=bs, num_workers=workers)
        return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), batch_size=batch_size, **kw)

    same = loader(16, 16)
    assert len(same) == 7 == len(list(same))
    # Read by one process, the last batch holds len(dataset) less the other batches' examples.
    rebatched = loader(16, 10)
    assert len(rebatched) == 10 == len(list(rebatched))
    # Several workers each end in a short batch: the examples per pass are unknown.
    with pytest.raises(TypeError, match="dataset_size="):
        len(loader(16, 10, workers=2))
    assert len(loader(16, 16, workers=2)) == 7  # the source's own batches, handed out as they are
    sized = loader(16, 10, dataset_size=100)
    assert len(sized) == 10 == len(list(sized))


@pytest.mark.parametrize("examples, expected", [(41, 5), (49, 6), (50, 7), (48, 6)])
def test_traditional_len_drops_a_sized_iterables_last_batch_under_min_batch_size(
    examples, expected
):
    """A sized IterableDataset read in batches of batch_size: a last batch under
    min_batch_size is not handed out, and len() does not count it."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __len__(self):
            return examples

        def __iter__(self):
            for i in range(examples):
                yield torch.full((6,), float(i)), torch.tensor(i % 3)

    dl = DataLoader(Stream(), batch_size=8)
    loader = SelectiveLoader(dl, IndexLoss(), policy=Traditional(), batch_size=8, min_batch_size=2)
    batches = list(loader)
    assert len(loader) == expected == len(batches)
    assert sum(len(b[1]) for b in batches) == examples - (examples % 8 == 1)


# ---------------------------------------------------------------------- review of 2026-11-26
class _Identified(torch.utils.data.Dataset):
    """A map-style dataset whose items carry their own index (read with ``index_key=2``)."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int):
        return torch.full((6,), float(i)), torch.tensor(i % 4), i


@pytest.mark.parametrize("batch_size", [7, 10])
def test_a_dataloader_read_with_index_key_is_counted_by_what_its_sampler_draws(batch_size):
    """A DataLoader read with ``index_key=`` is counted as one whose indices are recovered: its
    sampler's share (DistributedSampler), its ``num_samples`` (a WeightedRandomSampler drawing
    twice the dataset, where a OneCycleLR sized by len() was stepped past its total), not
    ``dataset_size``."""
    from torch.utils.data import DistributedSampler, WeightedRandomSampler

    ds = _Identified()
    samplers = {
        "share": lambda: DistributedSampler(ds, num_replicas=2, rank=0, seed=0),
        "upsampled": lambda: WeightedRandomSampler(
            [1.0] * 100, 200, generator=torch.Generator().manual_seed(0)
        ),
    }
    for kind, sampler in samplers.items():
        loader = SelectiveLoader(
            DataLoader(ds, batch_size=10, sampler=sampler()),
            IndexLoss(),
            policy=Traditional(),
            batch_size=batch_size,
            index_key=2,
            dataset_size=100,
        )
        assert [sum(1 for _ in loader) for _ in range(2)] == [len(loader)] * 2, kind


@pytest.mark.parametrize("batch_size", [None, 5])
def test_a_batch_sampler_dataloader_read_with_index_key_is_counted_as_without_it(batch_size):
    """A DataLoader built with ``batch_sampler=`` (``drop_last=True``) read with ``index_key=``
    takes its batch size and its dropped last batch from the batch sampler, as one whose
    indices are recovered does. Its batch size was taken from the DataLoader's own
    (None): the loader asked for ``batch_size=``, and given one ``len(loader)`` counted the
    dropped examples (20 batches where a pass yields 18)."""
    from torch.utils.data import BatchSampler, SequentialSampler

    def loader(**kw) -> SelectiveLoader:
        sampler = BatchSampler(SequentialSampler(range(100)), 30, drop_last=True)
        return SelectiveLoader(
            DataLoader(_Identified(), batch_sampler=sampler),
            IndexLoss(),
            policy=Traditional(),
            batch_size=batch_size,
            **kw,
        )

    keyed, recovered = loader(index_key=2, drop_index=True), loader()
    assert keyed.batch_size == recovered.batch_size == (batch_size or 30)
    assert [sum(1 for _ in keyed) for _ in range(2)] == [len(keyed)] * 2
    assert len(keyed) == len(recovered) == 90 // (batch_size or 30)  # 90 examples drawn


def test_an_unsized_stream_that_drops_its_last_batch_is_counted_without_it():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(100):
                yield torch.full((6,), float(i)), torch.tensor(i % 4), i

    # (one worker reads the whole stream as the main process does: its batches are all full)
    for workers, batch_size in ((0, 16), (0, 8), (1, 8)):
        loader = SelectiveLoader(
            DataLoader(Stream(), batch_size=16, drop_last=True, num_workers=workers),
            IndexLoss(),
            policy=Traditional(),
            batch_size=batch_size,
            index_key=2,
            dataset_size=100,
        )
        assert len(loader) == sum(1 for _ in loader) == 96 // batch_size


@pytest.mark.parametrize("case", ["replacement", "drop_last"])
def test_traditional_len_with_a_subset_it_cannot_count_is_refused_naming_the_fix(case):
    """len() of a subset is refused naming the fix where a pass does not hold each of its
    examples once: a sampler drawing with replacement draws them a varying number of times (it
    counted the subset once, and Lightning failed after epoch 0), and drop_last leaves a pass's
    last examples out, whichever the order puts there."""
    from torch.utils.data import RandomSampler

    if case == "replacement":
        ds = EncodedDataset(100)
        g = torch.Generator().manual_seed(0)
        source = DataLoader(
            ds, batch_size=10, sampler=RandomSampler(ds, replacement=True, generator=g)
        )
        subset, match = list(range(50)), "a sampler drawing with replacement"
    else:
        source = DataLoader(EncodedDataset(50), batch_size=16, drop_last=True)
        subset, match = list(range(40)), "drop_last"
    loader = SelectiveLoader(source, IndexLoss(), policy=Traditional(), subset=subset)
    with pytest.raises(TypeError, match=match) as info:
        len(loader)
    assert 'batches_per_epoch="expected"' in str(info.value)


def listed(batches: list[list[int]], length: int) -> SelectiveLoader:
    """Traditional at batch_size 8 over a ``batch_sampler=`` of no sampler of its own that
    draws ``batches`` and says it has ``length``."""

    data = EncodedDataset(max(max(b) for b in batches) + 1)
    source = DataLoader(data, batch_sampler=ListedBatches(batches, length, 8))
    return SelectiveLoader(source, IndexLoss(), policy=Traditional(), batch_size=8)


def test_a_bucketing_batch_sampler_whose_count_len_cannot_know_is_warned_of():
    """A batch_sampler= with no sampler of its own is counted as full batches; one whose
    batches vary in size makes another number: the first such batch (not the last) is warned
    of, once, naming the fix."""
    buckets = [b for s in range(0, 36, 9) for b in (list(range(s, s + 8)), [s + 8])]
    loader = listed(buckets, 8)
    assert len(loader) == 8
    with pytest.warns(UserWarning, match="counted the source's batches as full batches") as rec:
        got = sum(1 for _ in loader)
    assert got != 8 and len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(loader)  # (once)


def test_a_batch_sampler_of_full_batches_and_a_short_last_one_is_not_warned_of():
    """The count of full batches is right where only a pass's last batch is short (as a
    sampler batched by a DataLoader makes them): that batch is no bucketing, and is not warned
    of."""
    chunks = [list(range(s, min(s + 8, 29))) for s in range(0, 29, 8)]
    loader = listed(chunks, 4)
    assert len(loader) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [b.indices.tolist() for b in loader] == chunks


def test_progress_of_a_source_of_unknown_size_does_not_lag_in_prefiltered_passes():
    """A batch_sampler= with no sampler (epoch size unknown: progress counts its batches) in
    Stale-SB's stale passes, which load only the examples kept: the candidates drawn count
    against its length in full batches, so progress advances evenly instead of lagging at a
    third and jumping to the next whole number."""

    class Batches:
        batch_size = 10

        def __init__(self):
            self.g = torch.Generator().manual_seed(0)

        def __iter__(self):
            p = torch.randperm(300, generator=self.g).tolist()
            for s in range(0, 300, 10):
                yield p[s : s + 10]

        def __len__(self):
            return 30

    loader = SelectiveLoader(
        DataLoader(EncodedDataset(300), batch_sampler=Batches()),
        IndexLoss(),
        policy=SelectiveBackprop(1 / 3, history=64, staleness=3),
        batch_size=10,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in range(3):
            readings = [epoch] + [loader.progress for _ in loader] + [loader.progress]
            steps = [b - a for a, b in itertools.pairwise(readings)]
            assert readings[-1] == epoch + 1 and min(steps) >= 0, readings
            assert max(steps) < 0.25, (epoch, readings)
        list(loader)  # epoch 3: a fresh pass
        # left part-way through stale pass 4 (break): progress holds where the pass got to
        for i, _ in enumerate(loader):
            last = loader.progress
            if i == 3:
                break
        assert loader.progress == last > 4.2


# ---------------------------------------------------------------------- review of the sources
def test_traditional_len_over_a_sized_iterable_whose_last_batch_is_full():
    """A sized IterableDataset whose examples fill its last batch exactly (48 in batches of 16):
    that batch is the source's last (len(dataset) less the other batches' examples, a whole
    batch), and the pass is counted in the loader's batches of 10."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __len__(self):
            return 48

        def __iter__(self):
            for i in range(48):
                yield torch.full((6,), float(i)), torch.tensor(i % 3)

    loader = SelectiveLoader(
        DataLoader(Stream(), batch_size=16), IndexLoss(), policy=Traditional(), batch_size=10
    )
    batches = list(loader)
    assert len(loader) == 5 == len(batches)
    assert [len(b[1]) for b in batches] == [10, 10, 10, 10, 8]


def test_fills_a_batch_refuses_only_a_pass_expected_to_keep_less_than_a_batch():
    """After a barren pass under remainder="drop": a policy expected to keep exactly a batch per
    pass goes on (the pass yielded none by chance); one expected to keep less is refused."""
    from types import SimpleNamespace

    from sbloader.length import fills_a_batch

    def after(seen, rate):
        return SimpleNamespace(stats=SimpleNamespace(examples_seen=seen, target_rate=rate))

    fills_a_batch(after(16, 0.5), 8, 3)  # expected 8: a batch
    with pytest.raises(ValueError, match=r"batches_per_epoch=3 can hardly be filled.*about 7\.5"):
        fills_a_batch(after(15, 0.5), 8, 3)
