"""The loader's shape: one epoch iterator at a time, a state that knows whose it is, typed rows and
the plain decision functions, tested directly."""

from __future__ import annotations

import copy
import gc
import multiprocessing
import threading
import warnings
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ENCODED_KEYS, EncodedDataset, IndexLoss, encoded_batches
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sbloader import (
    EpochIterator,
    Kath18,
    Phased,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
    Traditional,
)
from sbloader._checks import FieldError
from sbloader.decisions import choose_finite, in_subset, keep_function, subset_mask
from sbloader.policies import Choice
from sbloader.rows import PendingRows, Rows, metadata_rows
from sbloader.store import ExampleStore

CPU = torch.device("cpu")


def make(n=120, policy=None, seed=0, model=None, source_batch=30, batch_size=10, **kw):
    data, num_samples = EncodedDataset(n), kw.pop("num_samples", None)
    dl = DataLoader(
        data,
        batch_size=source_batch,
        generator=torch.Generator().manual_seed(1),
        # (a sampler drawing num_samples examples a pass: an epoch shorter than the dataset)
        sampler=None
        if num_samples is None
        else torch.utils.data.RandomSampler(
            data, num_samples=num_samples, generator=torch.Generator().manual_seed(1)
        ),
        shuffle=kw.pop("shuffle", False),
        drop_last=kw.pop("drop_last", False),
    )
    return SelectiveLoader(
        dl,
        model or IndexLoss(),
        policy=policy or SelectiveBackprop(0.5),
        batch_size=batch_size,
        seed=seed,
        **kw,
    )


def epoch_indices(it):
    return [b.indices.tolist() for b in it]


# ---------------------------------------------------------------------- one live iterator
def test_iter_returns_an_epoch_iterator_that_starts_lazily():
    loader = make()
    it = iter(loader)
    assert isinstance(it, EpochIterator) and iter(it) is it
    assert not it.started and it.stats is None and loader.epoch == 0
    next(it)
    assert it.started and it.epoch == 0 and it.stats is loader.stats.current


def test_a_second_iterator_ends_the_first_cleanly():
    """The two-iterator corruption: consuming both used to leave epoch == 3 after two epochs of
    data. Now the newer iterator closes the older one, whose started epoch counts as abandoned,
    and the older one refuses to go on instead of interleaving with the newer."""
    loader = make()
    it1 = iter(loader)
    next(it1)
    it2 = iter(loader)
    with pytest.raises(RuntimeError, match="closed"):
        next(it1)
    rest = epoch_indices(it2)
    assert it2.epoch == 1 and loader.epoch == 2 and rest
    assert [e.epoch for e in loader.stats.epochs] == [0, 1]
    with pytest.raises(StopIteration):
        next(it2)  # a finished iterator stays finished


def test_an_iterator_that_never_started_takes_no_epoch():
    reference = epoch_indices(make())
    loader = make()
    it1 = iter(loader)
    it2 = iter(loader)
    assert epoch_indices(it2) == reference and loader.epoch == 1
    with pytest.raises(RuntimeError, match="closed"):
        next(it1)


def test_break_then_iter_starts_the_next_epoch_like_before():
    loader = make()
    for _ in loader:
        break
    assert epoch_indices(loader) and loader.epoch == 2  # epoch 0 abandoned, epoch 1 whole


def test_a_dropped_iterator_stops_its_prefetch_thread_at_once():
    loader = make(prefetch=1)

    def prefetchers():
        return [t for t in threading.enumerate() if t.name == "sbloader-prefetch"]

    it = iter(loader)
    next(it)
    assert prefetchers()
    del it  # `break` out of a for loop drops the iterator the same way
    gc.collect()
    assert not prefetchers()
    assert loader.state_dict()["active"]  # the abandoned epoch's position is still known


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_dropped_after_a_prefiltered_epoch_is_freed_at_once(tmp_path, workers):
    """A stale epoch is filtered before loading: the DataLoader's batch sampler keeps the
    epoch's keep function, which referred to the source (its ``replaying``), so a loader
    dropped after such an epoch lived on in a reference cycle, with its persistent worker
    processes and its policy's memory-mapped store, whose folder another store was refused,
    until the garbage collector happened to run. Dropped, it is now freed at once."""
    gc.disable()  # (only reference counting frees the loader: no collection in between)
    try:
        dl = DataLoader(
            EncodedDataset(60), batch_size=10, num_workers=workers, persistent_workers=workers > 0
        )
        policy = SelectiveBackprop(0.5, staleness=3, store_path=str(tmp_path))
        loader = SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=10)
        for _ in range(3):
            epoch_indices(loader)
        assert loader.stats.current.prefiltered  # the last epoch was filtered before loading
        source = weakref.ref(loader.source)
        del loader, dl, policy
        assert source() is None
        assert not [w for w in multiprocessing.active_children() if w.is_alive()]
        assert len(ExampleStore(80, path=tmp_path)) == 80  # its folder is free for another
    finally:
        gc.enable()


def test_close_is_idempotent_and_an_error_closes_the_iterator():
    loader = make()
    it = iter(loader)
    next(it)
    it.close()
    it.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)

    class Fails(IndexLoss):
        def forward(self, x):
            raise OSError("disk gone")

    it = iter(make(n=60, model=Fails()))
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    with pytest.raises(RuntimeError, match="closed"):
        next(it)


# ---------------------------------------------------------------------- state identity
@pytest.mark.parametrize(
    ("saved_kw", "loading_kw", "field"),
    [
        ({"seed": 0}, {"seed": 123}, "seed"),
        ({"rank": 0}, {"rank": 1}, "rank"),
        ({"policy": SelectiveBackprop(0.5)}, {"policy": RandomBackprop(0.5)}, "policy"),
        (
            {"policy": SelectiveBackprop(0.5, staleness=2)},
            {"policy": SelectiveBackprop(0.5, staleness=3)},
            "policy",
        ),
        ({"n": 120}, {"n": 150}, "dataset_size"),
        # (the same dataset and sampler class, another number of examples a pass)
        ({"num_samples": 90}, {"num_samples": 60}, "epoch_size"),
        # A mid-epoch position counts source batches: resumed with another source batch size,
        # epoch length or subset, the epoch would skip or repeat examples.
        ({"source_batch": 30}, {"source_batch": 40}, "source_batch_size"),
        ({"batch_size": 10}, {"batch_size": 5}, "batch_size"),
        ({"subset": list(range(0, 120, 2))}, {}, "subset"),
        ({"subset": list(range(0, 120, 2))}, {"subset": list(range(1, 120, 2))}, "subset"),
        ({"policy": RandomBackprop(0.5)}, {"policy": RandomBackprop(0.25)}, "policy_settings"),
        ({"policy": Kath18(0.5)}, {"policy": Kath18(0.25)}, "policy_settings"),
        (
            {"policy": Phased(RandomBackprop(0.5), warmup_epochs=1)},
            {"policy": Phased(RandomBackprop(0.5), warmup_epochs=2)},
            "policy_settings",
        ),
        # The carried rows hold the selection's logits and the prefix's features, or not: loaded
        # into a loader that keeps the other, they broke a later batch's join or came back None.
        ({"keep_logits": True}, {}, "keep_logits"),
        ({}, {"keep_logits": True}, "keep_logits"),
        (
            {"model": nn.Linear(6, 4), "frozen_prefix": nn.Linear(6, 6).requires_grad_(False)},
            {},
            "frozen_prefix",
        ),
        (
            {},
            {"model": nn.Linear(6, 4), "frozen_prefix": nn.Linear(6, 6).requires_grad_(False)},
            "frozen_prefix",
        ),
        # What the batches are made of, and the source's order: loaded silently, a mid-epoch
        # state skipped the first batches of another order, or yielded another run's batches.
        ({"remainder": "carry"}, {"remainder": "drop"}, "remainder"),
        ({"min_batch_size": 1}, {"min_batch_size": 3}, "min_batch_size"),
        ({"nonfinite": "skip"}, {"nonfinite": "select"}, "nonfinite"),
        ({"shuffle": True}, {}, "sampler"),
        ({"drop_last": True}, {}, "source_drop_last"),
    ],
)
def test_a_state_of_another_run_is_refused_naming_the_field_and_both_values(
    saved_kw, loading_kw, field
):
    saved = make(**saved_kw)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    other = make(**loading_kw)
    before = other.state_dict()
    with pytest.raises(
        ValueError, match=f"has {field}=.*but this SelectiveLoader has {field}="
    ) as e:
        other.load_state_dict(state)
    mine, theirs = other.state_dict()["identity"], state["identity"]
    assert f"state has {field}={theirs[field]!r}, but this" in str(e.value), str(e.value)
    assert f"this SelectiveLoader has {field}={mine[field]!r};" in str(e.value), str(e.value)
    assert other.state_dict()["epoch"] == before["epoch"] and other.epoch == 0  # nothing loaded


def test_a_longer_planned_run_still_resumes():
    """The anneal's start is not part of the identity: a run may be resumed planned longer."""
    saved = make(policy=Phased(RandomBackprop(0.5), warmup_epochs=1, anneal_from_epoch=3))
    list(saved)
    state = saved.state_dict()
    longer = make(policy=Phased(RandomBackprop(0.5), warmup_epochs=1, anneal_from_epoch=9))
    longer.load_state_dict(state)
    assert longer.epoch == 1


def test_a_mid_epoch_state_resumed_with_a_plan_that_loads_its_epoch_otherwise_is_refused():
    """Mid-way through an epoch the saved run loaded whole (annealed) and the new plan
    prefilters (a stale epoch), or the other way round, the position counts other source
    batches: refused as the epoch resumes, naming the fix, where it skipped or repeated up to
    half an epoch; an epoch loaded alike by both plans resumes exactly."""

    def phased(anneal):
        stale = SelectiveBackprop(0.5, staleness=2, history=64)
        return Phased(stale, warmup_epochs=1, anneal_from_epoch=anneal)

    def state_in_epoch_2(anneal):
        saved = make(policy=phased(anneal))
        list(saved)
        list(saved)
        it = iter(saved)
        next(it)
        return copy.deepcopy(saved.state_dict()), it

    for saved_plan, new_plan in ((2, 6), (6, 2)):
        state, _ = state_in_epoch_2(saved_plan)
        other = make(policy=phased(new_plan))
        other.load_state_dict(state)
        with pytest.raises(ValueError, match="Resume with the saved run's policy and planned"):
            list(other)
    state, rest = state_in_epoch_2(6)
    # (loaded and saved again before resuming: the state still says how its epoch loaded)
    relay = make(policy=phased(6))
    relay.load_state_dict(state)
    state = copy.deepcopy(relay.state_dict())
    alike = make(policy=phased(8))  # epoch 2 stale in both
    alike.load_state_dict(state)
    assert epoch_indices(alike) == epoch_indices(rest)


def test_a_state_refused_part_way_through_restoring_changes_nothing():
    """The policy's own check (its beta) runs after the loader's epoch, generators and position
    are restored: the loader must come back as it was, so that starting afresh after the
    refusal starts afresh, and a running epoch goes on where it was."""
    saved = make(policy=SelectiveBackprop(beta=3.0))
    list(saved)
    list(saved)
    it = iter(saved)
    next(it)
    next(it)
    state = saved.state_dict()  # epoch 2, mid-epoch

    fresh = make(policy=SelectiveBackprop(beta=2.0))
    before = fresh.state_dict()
    with pytest.raises(ValueError, match=r"beta=3\.0, but this policy has beta=2\.0"):
        fresh.load_state_dict(state)
    assert fresh.epoch == 0 and fresh.state_dict()["position"] == before["position"] == 0
    assert epoch_indices(fresh) == epoch_indices(make(policy=SelectiveBackprop(beta=2.0)))

    # Refused while an epoch is running: it resumes where it stopped, as if nothing happened.
    whole = make(policy=SelectiveBackprop(beta=2.0))
    expected = epoch_indices(whole)
    running = make(policy=SelectiveBackprop(beta=2.0))
    it = iter(running)
    head = [next(it).indices.tolist() for _ in range(3)]
    with pytest.raises(ValueError, match="beta="):
        running.load_state_dict(state)
    assert head + epoch_indices(running) == expected


@pytest.mark.parametrize("per_epoch", [None, 3], ids=["passes", "batches_per_epoch"])
@pytest.mark.parametrize(
    ("other", "match"),
    [
        ({"seed": 1}, "has seed=1"),  # the identity, checked before restoring
        ({"batch_size": 5}, "has batch_size=5"),
        ({"keep_logits": True}, "has keep_logits=True"),
        ({"beta": 3.0}, r"beta=3\.0"),  # the policy's own, part-way through restoring
    ],
    ids=["seed", "batch_size", "keep_logits", "beta"],
)
def test_every_refused_state_leaves_a_running_epoch_to_resume_where_it_stopped(
    other, match, per_epoch
):
    """Whichever check refuses a state loaded while an epoch runs, the next ``iter(loader)``
    goes on where the epoch stopped, as documented: a state refused by the identity check (a
    seed, a batch size) left the epoch running, and the next ``iter(loader)`` then closed it as
    abandoned and skipped its rest, where one refused by the policy's check resumed it."""

    def build(beta: float = 2.0, **changed):
        return make(policy=SelectiveBackprop(beta=beta), batches_per_epoch=per_epoch, **changed)

    whole = build()
    expected = [epoch_indices(whole) for _ in range(3)]
    saved = build(**other)
    list(saved)
    state = saved.state_dict()
    running = build()
    it = iter(running)
    head = [next(it).indices.tolist() for _ in range(2)]
    with pytest.raises(ValueError, match=match):
        running.load_state_dict(state)
    got = [head + epoch_indices(running), epoch_indices(running), epoch_indices(running)]
    assert got == expected


def test_a_state_saved_with_another_reweight_is_refused_and_an_older_one_loads():
    """SelectiveBackprop's reweight changes every yielded weight (1 / P against 1): a state
    saved with reweight=True is refused by a policy with reweight=False, naming the fix; a state
    saved before reweight was part of the policy's state (no key) still loads."""
    saved = make(policy=SelectiveBackprop(beta=2.0, reweight=True))
    list(saved)
    state = saved.state_dict()
    assert state["policy"]["reweight"] is True
    other = make(policy=SelectiveBackprop(beta=2.0))
    with pytest.raises(ValueError, match=r"has reweight=True, but this policy has reweight=False"):
        other.load_state_dict(state)
    assert other.epoch == 0
    same = make(policy=SelectiveBackprop(beta=2.0, reweight=True))
    same.load_state_dict(state)
    assert same.epoch == 1
    older = copy.deepcopy(state)
    del older["policy"]["reweight"]
    other.load_state_dict(older)
    assert other.epoch == 1


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda v: SelectiveBackprop(1 / 3, reweight=v), "reweight"),
        (lambda v: Kath18(1 / 3, unbiased=v), "unbiased"),
        (lambda v: make(eval_selection=v), "eval_selection"),
    ],
)
@pytest.mark.parametrize("value", ["False", 0, None])
def test_flags_that_are_not_bools_are_refused_naming_them(build, name, value):
    """A flag given as the string "False" (truthy) or a number is refused, not read by its
    truth value; numpy bools are bools."""
    with pytest.raises(TypeError, match=rf"{name} should be True or False, but got {name}="):
        build(value)
    build(np.bool_(False))
    build(True)


def test_a_state_refused_after_a_break_leaves_the_next_epoch_as_it_was():
    """After ``break`` the next iter() starts the next epoch (a saved state would resume the
    left one): a refused load must not turn that into resuming it."""
    saved = make(policy=SelectiveBackprop(beta=3.0))
    list(saved)
    state = saved.state_dict()

    def broken():
        loader = make(policy=SelectiveBackprop(beta=2.0))
        for i, _ in enumerate(loader):
            if i == 2:
                break
        return loader

    reference = epoch_indices(broken())
    loader = broken()
    with pytest.raises(ValueError, match="beta="):
        loader.load_state_dict(state)
    assert epoch_indices(loader) == reference and loader.epoch == 2


def test_a_refused_state_on_a_source_that_cannot_resume_mid_epoch_changes_nothing():
    """A DataLoader shuffling with the global RNG refuses mid-epoch resumes: putting the loader's
    own mid-epoch state back after a refusal must not be refused too (leaving the loader half
    restored, and hiding the reason for the refusal)."""

    def build(beta):
        dl = DataLoader(EncodedDataset(120), batch_size=30, shuffle=True)  # no generator=
        return SelectiveLoader(dl, IndexLoss(), policy=SelectiveBackprop(beta=beta), batch_size=10)

    saved = build(3.0)
    list(saved)
    state = saved.state_dict()
    loader = build(2.0)
    it = iter(loader)
    next(it)
    before = {k: loader.state_dict()[k] for k in ("epoch", "position", "active")}
    with pytest.raises(ValueError, match=r"beta=3\.0, but this policy"):
        loader.load_state_dict(state)
    assert {k: loader.state_dict()[k] for k in ("epoch", "position", "active")} == before


def test_a_refused_state_leaves_an_epoch_that_cannot_be_replayed_part_way_not_replayed():
    """A running epoch is closed by ``load_state_dict``; the state refused, the next iter()
    resumes it by replaying its source's order. A DataLoader shuffling with the global RNG draws
    a new order then: the replay skipped the consumed batches of that other order, so the epoch
    repeated some examples and never yielded others, silently. Such an epoch is left part-way
    instead, as after ``break``: the next iter() starts the next epoch."""

    def build(seed: int) -> SelectiveLoader:
        dl = DataLoader(EncodedDataset(48), batch_size=8, shuffle=True)  # no generator=
        return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), batch_size=8, seed=seed)

    state = build(seed=1).state_dict()
    torch.manual_seed(0)
    loader = build(seed=0)
    it = iter(loader)
    epochs: dict[int, list[int]] = {}
    for _ in range(3):
        epochs.setdefault(loader.epoch, []).extend(next(it).indices.tolist())
    with pytest.raises(ValueError, match="has seed=1"):
        loader.load_state_dict(state)
    for batch in loader:
        epochs.setdefault(loader.epoch, []).extend(batch.indices.tolist())
    assert all(len(set(seen)) == len(seen) for seen in epochs.values()), epochs  # none twice
    assert sorted(epochs) == [0, 1] and sorted(epochs[1]) == list(range(48))
    assert loader.epoch == 2


def test_a_state_saved_mid_pass_out_of_order_is_refused_wherever_it_is_loaded():
    """With ``in_order=False`` the workers hand out batches as they finish them, so the batches
    consumed are not the sampler's first ones, which a resumed epoch skips: it would repeat some
    examples and never yield others. A state saved so mid-pass is refused, also by a loader
    rebuilt with ``in_order=True`` as the message advises; one saved in order resumes in either,
    and one saved at the end of a pass resumes as any."""

    def build(in_order: bool) -> SelectiveLoader:
        dl = DataLoader(
            EncodedDataset(120),
            batch_size=30,
            shuffle=True,
            num_workers=2,
            in_order=in_order,
            generator=torch.Generator().manual_seed(0),
        )
        return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), batch_size=30)

    def saved_after_one_batch(in_order: bool) -> tuple[dict, list[int]]:
        loader = build(in_order)
        it = iter(loader)
        head = next(it).indices.tolist()
        state = loader.state_dict()
        it.close()
        return state, head

    state, _ = saved_after_one_batch(in_order=False)
    for loading in (False, True):
        with pytest.raises(ValueError, match=r"saved from a DataLoader with in_order=False"):
            build(loading).load_state_dict(state)
    state, head = saved_after_one_batch(in_order=True)
    for loading in (True, False):
        resumed = build(loading)
        resumed.load_state_dict(state)
        rest = [i for b in resumed for i in b.indices.tolist()]
        assert sorted(head + rest) == list(range(120))
    done = build(False)
    list(done)
    resumed = build(False)
    resumed.load_state_dict(done.state_dict())
    assert sorted(i for b in resumed for i in b.indices.tolist()) == list(range(120))


@pytest.mark.parametrize("batch_size", [10, 30])
def test_a_state_saved_after_finishing_keeps_the_batch_it_ran_ahead_to(batch_size):
    """finishing() (AcceleratedLoader calls it after every batch) runs ahead until the next
    batch is ready; with Traditional's source batches of batch_size that batch waits whole, and
    a state saved then must still hand it out."""

    def build():
        return make(policy=Traditional(), batch_size=batch_size)

    expected = epoch_indices(build())
    first = build()
    it = iter(first)
    head = [next(it).indices.tolist() for _ in range(2)]
    assert not it.finishing()
    resumed = build()
    resumed.load_state_dict(first.state_dict())
    assert head + epoch_indices(resumed) == expected
    # And the iterator itself, closed there, leaves that batch with the rest of its pass: the
    # next epoch is one whole pass, len(loader) batches (handed out first, it made one more).
    it.close()
    assert epoch_indices(first) == expected and len(expected) == len(first)
    assert first.stats.epochs[0].dropped == batch_size


def test_a_state_taking_back_a_batch_of_a_resumed_run_keeps_the_order_of_those_it_took_back():
    """A state that took back two batches (the one fetched and not trained, ``unconsumed=1``,
    and the one finishing() ran ahead to), resumed, and saved again with ``unconsumed=1`` after
    the first of them: the batch fetched comes before the one still taken back, so that a run
    resumed twice yields the uninterrupted run's batches, in its order."""

    def build():
        return make(policy=Traditional(), batch_size=30)

    expected = epoch_indices(build())
    first = build()
    it = iter(first)
    assert next(it).indices.tolist() == expected[0]
    assert not it.finishing()  # batch 1 made ready, whole
    state = first.state_dict(unconsumed=1)  # takes back batch 0 (not trained) and batch 1
    second = build()
    second.load_state_dict(state)
    it = iter(second)
    assert next(it).indices.tolist() == expected[0]
    third = build()
    third.load_state_dict(second.state_dict(unconsumed=1))  # batch 0 again, not trained
    assert epoch_indices(third) == expected


def test_a_batch_taken_back_that_fails_to_be_handed_out_keeps_its_place(monkeypatch):
    """Joining a batch taken back by a state can fail (an out-of-memory error, an interrupt):
    that batch stays first, before the others the state took back, so that a state saved then
    resumes in the uninterrupted run's order."""

    def build():
        return make(policy=Traditional(), batch_size=30)

    expected = epoch_indices(build())
    first = build()
    it = iter(first)
    next(it)
    assert not it.finishing()  # batch 1 made ready, whole
    second = build()
    second.load_state_dict(first.state_dict(unconsumed=1))  # takes back batches 0 and 1
    build_batch = second._codec.build

    def fails_once(*args):
        monkeypatch.setattr(second._codec, "build", build_batch)
        raise MemoryError("joining the batch")

    monkeypatch.setattr(second._codec, "build", fails_once)
    with pytest.raises(MemoryError):
        next(iter(second))
    third = build()
    third.load_state_dict(second.state_dict())
    assert epoch_indices(third) == expected


def test_finishing_counts_batches_a_state_took_back_and_leaves_the_end_to_the_caller():
    """finishing() after a resume whose state took back the epoch's last batch
    (``unconsumed=1``): that batch is still to come (it answered True, having run the epoch to
    its end past it). After the last batch it answers True, and the epoch ends (loader.epoch
    counts it) only at the caller's next step, as without running ahead."""

    def build():
        return make(n=30, policy=Traditional(), source_batch=10, batch_size=10)

    expected = epoch_indices(build())
    first = build()
    it = iter(first)
    head = [next(it).indices.tolist() for _ in range(3)]
    state = first.state_dict(unconsumed=1)
    resumed = build()
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert not it.finishing()
    assert next(it).indices.tolist() == head[2] == expected[2]
    assert it.finishing() and resumed.epoch == 0
    assert next(it, None) is None and resumed.epoch == 1


@pytest.mark.parametrize("prefetch", [0, 1])
def test_rolling_back_a_running_loader_replays_the_saved_epoch(prefetch):
    """Loading an epoch-boundary state into a loader whose next epoch is running (a rollback
    after a NaN loss): the replayed epoch is the one that followed the save. The running epoch's
    prefetch thread must stop before the source's generators are restored, or its fetch past
    the end of the data draws a new order from them."""

    def build():
        dl = DataLoader(
            EncodedDataset(120),
            batch_size=30,
            shuffle=True,
            generator=torch.Generator().manual_seed(1),
        )
        return SelectiveLoader(
            dl, IndexLoss(), policy=SelectiveBackprop(1 / 3), batch_size=4, prefetch=prefetch
        )

    for k in range(1, 9):
        loader = build()
        list(loader)
        state = loader.state_dict()
        want = epoch_indices(loader)
        it = iter(loader)
        for _ in range(min(k, 7)):
            if next(it, None) is None:
                break
        loader.load_state_dict(state)
        assert epoch_indices(loader) == want, f"rolled back after {k} batches"


def test_the_identity_includes_the_world_size():
    state = make().state_dict()
    assert state["identity"]["world_size"] == 1
    state["identity"]["world_size"] = 2
    with pytest.raises(ValueError, match="world_size=2, but this SelectiveLoader has world_size=1"):
        make().load_state_dict(state)


def test_an_unknown_version_is_refused_clearly():
    state = make().state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match=r"reads version 2 \(and migrates versions \[1, 2\]\)"):
        make().load_state_dict(state)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.pop("policy"), r"has no 'policy' \(a truncated or edited state\)"),
        (lambda s: s.pop("identity"), r"has no 'identity'"),
        (lambda s: s.update(identity=None), r"has identity=None, but it should be a dict"),
        (lambda s: s.update(position=-1), r"has position=-1, but it should be an int >= 0"),
        (lambda s: s.update(epoch=-1), r"has epoch=-1, but it should be an int >= 0"),
        (lambda s: s.update(epoch=1.7), r"has epoch=1\.7, but it should be an int >= 0"),
        (lambda s: s.update(active=None), r"has active=None, but it should be True or False"),
        (lambda s: s.update(rng=None), r"has rng=None, but it should be a dict"),
        (lambda s: s.update(policy=[1]), r"has policy=\[1\], but it should be a dict"),
        (lambda s: s.update(source=None), r"has source=None, but it should be a dict"),
        (lambda s: s.update(stats="x" * 99), r"has stats='x{56}\.\.\., but it should be a dict"),
    ],
    ids=[
        *("no-policy", "no-identity", "identity-none", "position", "epoch", "epoch-float"),
        *("active", "rng-none", "policy-list", "source-none", "stats-str"),
    ],
)
def test_a_truncated_or_edited_state_is_refused_naming_the_field_and_changes_nothing(edit, match):
    """A state without a key failed with a bare KeyError; one with position=-1 resumed its
    epoch from before its start (more examples seen than the epoch holds), epoch=1.7 was
    truncated to 1 and active=None taken for an ended epoch, all unsaid."""
    saved = make()
    it = iter(saved)
    next(it)
    next(it)
    state = saved.state_dict()  # mid-epoch
    edit(state)
    loader = make()
    before = epoch_indices(make())
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    assert loader.epoch == 0 and epoch_indices(loader) == before


def test_a_dict_that_is_no_loader_state_is_refused_as_such_not_as_another_version():
    """A whole checkpoint (or the model's state) passed for the loader's has no version at all:
    the message names what was passed, not a version to save it with."""
    loader = make()
    checkpoint = {"loader": loader.state_dict(), "model": loader.model.state_dict()}
    with pytest.raises(ValueError, match=r"not a state saved by SelectiveLoader\.state_dict") as e:
        make().load_state_dict(checkpoint)
    assert "'loader', 'model'" in str(e.value) and "matching sbloader" not in str(e.value)


def test_check_version_migrates_an_old_state_one_step_at_a_time():
    """A state two versions old is migrated through each step in turn."""
    from sbloader._state import check_version

    steps = {
        1: lambda s: {**s, "version": 2, "b": s["a"] + 1},
        2: lambda s: {**s, "version": 3, "c": s["b"] * 10},
    }
    assert check_version({"version": 1, "a": 1}, "Thing", 3, steps) == {
        "version": 3,
        "a": 1,
        "b": 2,
        "c": 20,
    }
    with pytest.raises(ValueError, match=r"version=0, but this sbloader reads version 3 \(and"):
        check_version({"version": 0}, "Thing", 3, steps)


def test_a_version_1_state_migrates_and_resumes_exactly():
    """tests/data/loader_state_v1.pt was saved mid-epoch, with carried rows and keep_logits, by
    the sbloader of commit 7e08153 (tests/data/make_loader_state_v1.py), with the batches that
    sbloader yielded after it."""
    saved = torch.load(Path(__file__).parent / "data" / "loader_state_v1.pt", weights_only=True)
    assert saved["state"]["version"] == 1 and saved["state"]["pending"]["count"] > 0

    def build(seed=5):
        x = torch.arange(90 * 4, dtype=torch.float32).reshape(90, 4) / 100
        y = torch.arange(90) % 3
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        dl = DataLoader(
            TensorDataset(x, y),
            batch_size=30,
            shuffle=True,
            generator=torch.Generator().manual_seed(1),
        )
        return SelectiveLoader(
            dl,
            model,
            policy=SelectiveBackprop(0.5),
            batch_size=8,
            seed=seed,
            keep_logits=True,
            autocast=None,  # the saved run selected in float32
        )

    loader = build()
    loader.load_state_dict(saved["state"])
    it = iter(loader)
    rest = epoch_indices(it) + epoch_indices(loader)
    assert rest == saved["rest"]
    # Version 1 counted no classes: unknown (None), not the counts of the epoch's rest alone.
    assert loader.stats.epochs[0].class_seen is None and loader.stats.total.class_seen is None
    assert loader.stats.epochs[-1].class_seen is not None  # the epoch begun after the resume
    with pytest.raises(ValueError, match="seed=5, but this SelectiveLoader has seed=6"):
        build(seed=6).load_state_dict(saved["state"])
    # its identity was seed and rank: a state of another rank is refused
    with pytest.raises(ValueError, match="rank=1, but this SelectiveLoader has rank=0"):
        build().load_state_dict({**saved["state"], "rank": 1})


# ---------------------------------------------------------------------- the threading contract
def test_stale_epochs_freeze_the_window_that_prefilter_reads():
    sb = SelectiveBackprop(0.5, staleness=2)
    sb.attach(10, key=1)
    sb.begin_epoch(0)
    assert not sb.can_prefilter() and not sb.window.frozen
    sb.choose(np.linspace(0.1, 1.0, 10), np.arange(10), np.random.default_rng(0), 10)
    with pytest.raises(RuntimeError, match="not a stale epoch"):
        sb.prefilter(np.arange(10))
    sb.begin_epoch(1)
    assert sb.can_prefilter() and sb.window.frozen
    mask = sb.prefilter(np.arange(10))
    assert mask.dtype == bool and mask.shape == (10,)
    with pytest.raises(RuntimeError, match="frozen"):
        sb.window.push_and_rank(np.array([1.0]), beta=1.0)
    sb.begin_epoch(2)
    assert not sb.window.frozen


def test_phased_declares_its_capabilities_from_the_phase():
    p = Phased(SelectiveBackprop(0.5, staleness=2), warmup_epochs=1, warmup_policy=RandomBackprop())
    p.attach(10, key=0)
    assert p.needs_indices() and p.records_examples() and not p.passthrough()
    assert p.kind() == "Phased(SelectiveBackprop(staleness=2), warmup_policy=RandomBackprop)"
    p.begin_epoch(0)
    assert not p.can_prefilter()
    p.begin_epoch(1)
    assert not p.can_prefilter()  # the wrapped policy's first (fresh) epoch
    p.begin_epoch(2)
    assert p.can_prefilter()


# ---------------------------------------------------------------------- plain functions
def test_choose_finite_skips_selects_or_raises_on_nonfinite_losses():
    values = np.array([1.0, np.nan, 2.0, np.inf, 0.5])
    idx = np.array([10, 11, 12, 13, 14])
    rng = np.random.default_rng(0)
    c, bad = choose_finite(Traditional(), values, idx, rng, 5, "skip")
    assert bad == 2 and c.positions.tolist() == [0, 2, 4]
    assert c.probabilities.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    c, bad = choose_finite(RandomBackprop(1e-9), values, idx, rng, 5, "select")
    assert bad == 2 and c.positions.tolist() == [1, 3] and c.weights.tolist() == [1.0, 1.0]
    with pytest.raises(FloatingPointError, match=r"2 selection losses .*\[11, 13\]"):
        choose_finite(Traditional(), values, idx, rng, 5, "raise")
    c, bad = choose_finite(Traditional(), None, None, rng, 3, "raise")
    assert bad == 0 and c.positions.tolist() == [0, 1, 2]


def test_the_policy_never_sees_a_nonfinite_loss():
    seen = []

    class Spy(Traditional):
        def choose(self, losses, indices, rng, n):
            seen.append((losses.copy(), indices.copy()))
            return super().choose(losses, indices, rng, n)

    choose_finite(
        Spy(), np.array([np.nan, 3.0]), np.array([7, 8]), np.random.default_rng(), 2, "skip"
    )
    assert seen[0][0].tolist() == [3.0] and seen[0][1].tolist() == [8]


def test_subset_mask_and_membership():
    mask = subset_mask(torch.tensor([4, 0]), 6)
    assert mask.tolist() == [True, False, False, False, True, False]
    # (6: the first index past the mask, as for a dataset of unknown size)
    got = in_subset(mask, np.array([4, 5, -1, 99, 6])).tolist()
    assert got == [True, False, False, False, False]
    assert subset_mask([2], None).tolist() == [False, False, True]
    with pytest.raises(ValueError, match=r"in \[0, 6\)"):
        subset_mask([6], 6)
    with pytest.raises(TypeError, match="subset should hold integers"):
        subset_mask([0.5], 6)


@pytest.mark.parametrize("empty", [[], np.array([], dtype=np.int64), torch.tensor([])])
def test_an_empty_subset_or_a_boolean_mask_is_refused_naming_it(empty):
    """An empty subset failed on the first batch blaming the source ("check that its dataset and
    sampler are not empty"), or, as an empty list, said that a float round trip would corrupt
    indices; a boolean mask (scores > t) was told the same about floats."""
    with pytest.raises(ValueError, match="subset should hold at least one dataset index"):
        make(subset=empty)
    with pytest.raises(TypeError, match=r"got a boolean mask; pass np\.flatnonzero\(mask\)"):
        make(subset=np.arange(120) % 3 == 0)
    with pytest.raises(TypeError, match="got a boolean mask"):
        make(subset=torch.arange(120) % 3 == 0)


def test_keep_function_counts_what_it_leaves_out_except_while_replaying():
    class Odd(Traditional):
        def can_prefilter(self):
            return True

        def prefilter(self, indices):
            return indices % 2 == 1

    replaying = [False]
    keep = keep_function(Odd(), subset_mask([0, 1, 2, 3], 8), lambda: replaying[0])
    assert keep is not None
    tally = keep.tally
    assert keep(np.arange(8)).tolist() == [False, True, False, True] + [False] * 4
    assert tally == [2, 4]  # two rejected by the policy, four outside the subset
    replaying[0] = True
    keep(np.arange(8))
    assert tally == [2, 4]
    assert keep_function(Traditional(), None, lambda: False) is None


# ---------------------------------------------------------------------- rows
def test_rows_concat_split_and_widen_logits_placeholders():
    a = metadata_rows([torch.arange(2), ["a", "b"]], None, None, np.array([5, 6]), 2, CPU)
    a = Rows(a.data, a.indices, a.losses, a.probabilities, a.weights, None, torch.empty(2, 0))
    choice = Choice(np.array([1]), np.array([0.2, 0.7]), np.array([3.0]))
    b = metadata_rows(
        [torch.tensor([9]), ["c"]],
        np.array([1]),
        choice,
        np.array([7, 8]),
        1,
        CPU,
        torch.tensor([0.1, 0.9]),
    )
    b = Rows(b.data, b.indices, b.losses, b.probabilities, b.weights, None, torch.ones(1, 3))
    both = Rows.concat([a, b])
    assert len(both) == 3 and both.data[1] == ["a", "b", "c"] and both.indices.tolist() == [5, 6, 8]
    assert both.logits.shape == (3, 3) and torch.isnan(both.logits[:2]).all()
    torch.testing.assert_close(both.probabilities, torch.tensor([1.0, 1.0, 0.7]))
    torch.testing.assert_close(both.weights, torch.tensor([1.0, 1.0, 3.0]))
    assert both.losses[2].item() == pytest.approx(0.9) and torch.isnan(both.losses[:2]).all()
    head, rest = both.split(1)
    assert head.indices.tolist() == [5] and rest.indices.tolist() == [6, 8]
    assert rest.data[1] == ["b", "c"] and head.features is None


def test_rows_copy_shares_no_tensor_with_the_source_nested_fields_included():
    """copy() is what a source that reuses its buffers cannot overwrite: every data tensor,
    a nested field's too, is its own."""
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    rows = metadata_rows([x, {"inputs": {"mask": mask}}, ["a", "b"]], None, None, None, 2, CPU)
    copied = rows.copy()
    x += 1
    mask -= 1
    assert copied.data[0].tolist() == [[0.0] * 3] * 2
    assert copied.data[1]["inputs"]["mask"].tolist() == [[1.0] * 3] * 2
    assert copied.data[2] == ["a", "b"] and copied.indices.tolist() == [-1, -1]


def test_pending_rows_pop_in_order_and_refuse_too_many():
    p = PendingRows()
    for start in (0, 3):
        p.add(metadata_rows([torch.arange(start, start + 3)], None, None, None, 3, CPU))
    assert len(p) == 6 and p.full_batches(4) == 1
    assert p.pop(4).data[0].tolist() == [0, 1, 2, 3] and len(p) == 2
    with pytest.raises(ValueError, match="k should be in"):
        p.pop(3)
    assert p.clear() == 2 and len(p) == 0


def test_pending_rows_pop_joins_only_the_parts_it_needs_and_keeps_every_row_once():
    p = PendingRows()
    for start, size in ((0, 3), (3, 2), (5, 4), (9, 1)):
        idx = np.arange(start, start + size)
        p.add(metadata_rows([torch.arange(start, start + size) * 10], None, None, idx, size, CPU))
    got = [p.pop(k) for k in (2, 1, 4, 3)]  # inside a part, a part's end, three parts, the rest
    assert [r.data[0].tolist() for r in got] == [[0, 10], [20], [30, 40, 50, 60], [70, 80, 90]]
    assert [r.indices.tolist() for r in got] == [[0, 1], [2], [3, 4, 5, 6], [7, 8, 9]]
    assert len(p) == 0 and p.full_batches(1) == 0
    # A batch inside one part is that part's rows, not a copy of every pending row.
    column = torch.arange(6)
    for part in (column, torch.arange(6, 9)):
        p.add(metadata_rows([part], None, None, None, len(part), CPU))
    head = p.pop(2)
    assert head.data[0].data_ptr() == column.data_ptr() and head.data[0].tolist() == [0, 1]
    assert p.pop(7).data[0].tolist() == [2, 3, 4, 5, 6, 7, 8]


def test_a_bad_field_is_one_kind_of_error_for_dicts_and_positions():
    dict_batches = [{"x": torch.zeros(2, 3), "y": torch.zeros(2, dtype=torch.long)}]
    tuple_batches = [(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))]
    for batches, kw in (
        (dict_batches, {"input_key": "image"}),
        (tuple_batches, {"input_key": 5}),
        (tuple_batches, {"input_key": 2}),  # (the first position past the last field)
    ):
        loader = SelectiveLoader(batches, nn.Linear(3, 2), policy=Traditional(), batch_size=2, **kw)
        with pytest.raises(FieldError, match="input_key") as err:
            next(iter(loader))
        assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)


def test_an_index_key_that_names_no_field_is_refused_naming_the_fields_there_are():
    """The message named the key alone; a user who misspelt it had to print a batch."""
    dict_batches = encoded_batches([4])
    tuple_batches = [tuple(b.values()) for b in dict_batches]
    for batches, key, fields in (
        (dict_batches, "idx", r"its keys: \['x', 'y', 'i'\]"),
        (tuple_batches, 3, "positions 0 to 2 of its 3-field tuple"),
        (tuple_batches, "i", "positions 0 to 2 of its 3-field tuple"),
    ):
        loader = SelectiveLoader(
            batches, IndexLoss(), policy=Traditional(), batch_size=4, index_key=key
        )
        with pytest.raises(FieldError, match=rf"index_key={key!r} names no field .*{fields}"):
            next(iter(loader))


@pytest.mark.parametrize("key", [1, -2])
def test_an_index_key_naming_the_target_field_is_refused_where_its_values_repeat(key):
    """``index_key=1`` over (inputs, targets, indices) batches, meant for 2, made the class
    labels the dataset indices, unsaid: Stale-SB's store kept one loss per class. Targets that
    are the dataset indices (each example its own class) still work."""
    x, y = torch.randn(32, 4), torch.arange(32) % 3
    batches = [(x[i : i + 8], y[i : i + 8], torch.arange(i, i + 8)) for i in range(0, 32, 8)]
    loader = SelectiveLoader(
        batches,
        nn.Linear(4, 3),
        policy=SelectiveBackprop(0.5, staleness=2),
        batch_size=4,
        index_key=key,
        dataset_size=32,
    )
    with pytest.raises(ValueError, match=rf"index_key={key} names the target field .*repeat"):
        next(iter(loader))
    own = [(x[i : i + 8], torch.arange(i, i + 8)) for i in range(0, 32, 8)]
    loader = SelectiveLoader(
        own,
        nn.Linear(4, 32),
        policy=SelectiveBackprop(0.5, staleness=2),
        batch_size=4,
        index_key=1,
        dataset_size=32,
    )
    yielded = [i for batch in loader for i in batch.indices.tolist()]
    assert yielded and len(set(yielded)) == len(yielded) and max(yielded) < 32


@pytest.mark.parametrize(
    "policy",
    [
        Traditional(),
        RandomBackprop(0.5),
        SelectiveBackprop(0.5),
        SelectiveBackprop(0.5, staleness=2),
        Kath18(0.5),
    ],
    ids=lambda p: repr(p)[:24],
)
def test_an_empty_source_batch_is_skipped_as_if_the_source_never_yielded_it(policy):
    """An iterable source's empty batch has nothing to score: the epoch yields what it would
    without it (the same examples in the same batches, seed for seed), and a resume saved just
    after it replays the rest exactly."""

    def build(batches):
        return SelectiveLoader(
            batches,
            IndexLoss(),
            policy=copy.deepcopy(policy),
            batch_size=4,
            seed=3,
            dataset_size=24,
            **ENCODED_KEYS,
        )

    sizes = [8, 8, 8]
    with_empty = [0, 8, 0, 8, 8, 0]
    plain = build(encoded_batches(sizes))
    gappy = build(encoded_batches(with_empty))
    for _ in range(3):
        want = epoch_indices(plain)
        assert want and epoch_indices(gappy) == want
    assert gappy.stats.epochs[-1].examples_seen == 24

    # A state saved after the first batch, past the empty source batches, resumes exactly.
    first = build(encoded_batches(with_empty))
    it = iter(first)
    head = next(it).indices.tolist()
    state = first.state_dict()
    rest = epoch_indices(it)
    resumed = build(encoded_batches(with_empty))
    resumed.load_state_dict(state)
    assert epoch_indices(resumed) == rest
    yielded = [i for batch in [head, *rest] for i in batch]
    whole = [i for batch in epoch_indices(build(encoded_batches(sizes))) for i in batch]
    assert sorted(yielded) == sorted(whole)


def test_metadata_rows_are_the_same_with_the_positions_already_made():
    """The epoch hands ``metadata_rows`` the positions tensor it gathered the data with (one copy
    to the device instead of two); the rows are those made from the numpy positions, and the
    probabilities and weights (one transfer, two rows of one array) are float32 columns of
    their own values."""
    positions = np.array([3, 0, 2], dtype=np.int64)
    choice = Choice(positions, np.array([0.5, 0.1, 0.25, 1.0]), np.array([2.0, 4.0, 1.0]))
    losses = torch.tensor([0.1, 0.2, 0.3, 0.4])
    indices = np.array([10, 11, 12, 13])
    data = [torch.tensor([3, 0, 2])]
    plain = metadata_rows(data, positions, choice, indices, 3, CPU, losses)
    shared = metadata_rows(
        data, positions, choice, indices, 3, CPU, losses, positions_t=torch.from_numpy(positions)
    )
    for rows in (plain, shared):
        assert rows.indices.tolist() == [13, 10, 12]
        assert rows.losses.tolist() == pytest.approx([0.4, 0.1, 0.3])
        assert rows.probabilities.tolist() == [1.0, 0.5, 0.25]
        assert rows.weights.tolist() == [2.0, 4.0, 1.0]
        assert rows.probabilities.dtype == rows.weights.dtype == torch.float32
        rows.weights.mul_(2)  # a caller's in-place change touches its own column only
        assert rows.probabilities.tolist() == [1.0, 0.5, 0.25]


# ---------------------------------------------------------------------- samplers and resumes
class IndexedItems(torch.utils.data.Dataset):
    """Example i is (input [i, i], target i % 4, its own index i): for index_key=2."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return torch.full((2,), float(i)), torch.tensor(i % 4), torch.tensor(i)


def _resumed_indices(make_loader, cut: int):
    """The indices of three epochs uninterrupted, and of the same three epochs with the loader
    saved after ``cut`` batches of the second and rebuilt from that state in a process whose
    global RNG is elsewhere."""
    torch.manual_seed(0)
    loader = make_loader()
    full = [epoch_indices(loader) for _ in range(3)]
    torch.manual_seed(0)
    loader = make_loader()
    first = epoch_indices(loader)
    it = iter(loader)
    head = [next(it).indices.tolist() for _ in range(cut)]
    state = copy.deepcopy(loader.state_dict())
    torch.manual_seed(123)
    again = make_loader()
    again.load_state_dict(state)
    return full, [first, head + epoch_indices(again), epoch_indices(again)]


@pytest.mark.parametrize("sampler", ["subset", "weighted"])
def test_a_sampler_on_the_global_rng_refuses_a_mid_epoch_resume_naming_it(sampler):
    """SubsetRandomSampler / WeightedRandomSampler built without a generator draw from torch's
    global RNG (the DataLoader's generator= does not reach them): a mid-epoch resume would
    replay another order (examples repeated and lost), so it is refused naming the sampler and
    the fix; given a generator, the resume is exact."""

    def make(generator):
        def build():
            g = torch.Generator().manual_seed(1) if generator else None
            s = (
                torch.utils.data.SubsetRandomSampler(range(48), generator=g)
                if sampler == "subset"
                else torch.utils.data.WeightedRandomSampler(
                    torch.ones(64), 48, replacement=False, generator=g
                )
            )
            dl = DataLoader(
                EncodedDataset(64), batch_size=8, sampler=s, generator=torch.Generator()
            )
            return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), batch_size=8, seed=0)

        return build

    name = "SubsetRandomSampler" if sampler == "subset" else "WeightedRandomSampler"
    with pytest.raises(
        ValueError,
        match=rf"middle of an epoch: its sampler \({name}\).*build the {name} with generator=",
    ):
        _resumed_indices(make(False), cut=2)
    full, resumed = _resumed_indices(make(True), cut=2)
    assert resumed == full and len({i for batch in full[0] for i in batch}) == 48


@pytest.mark.parametrize("generator", [True, False], ids=["seeded", "global-rng"])
def test_a_dataloader_read_through_index_key_resumes_exactly(generator):
    """With index_key= a map-style DataLoader is iterated as it is (its own index field): its
    generator's states are saved, so that a resume, mid-epoch or at its end, yields what the
    uninterrupted run does; shuffling on the global RNG, a mid-epoch resume is refused."""

    def build():
        g = torch.Generator().manual_seed(0) if generator else None
        dl = DataLoader(IndexedItems(), batch_size=8, shuffle=True, generator=g)
        return SelectiveLoader(
            dl,
            IndexLoss(),
            policy=Traditional(),
            batch_size=8,
            index_key=2,
            drop_index=True,
            dataset_size=64,
            seed=0,
        )

    if not generator:
        with pytest.raises(ValueError, match=r"its sampler \(RandomSampler\).*to the DataLoader"):
            _resumed_indices(build, cut=3)
        return
    for cut in (3, 8):  # mid-epoch, and after the epoch's last batch
        full, resumed = _resumed_indices(build, cut=cut)
        assert resumed == full and full[1] != full[2]


def test_a_copy_is_made_between_epochs_and_refused_while_one_runs():
    """copy.deepcopy of a loader mid-epoch shared the original's iterator (its weak reference
    is copied as it is): iter(copy) closed the original's epoch, and copy.state_dict() read the
    original's position. Refused while an epoch runs; between epochs the copy is a run of its
    own that goes on as the original does."""
    loader = make(policy=SelectiveBackprop(0.5, staleness=2, history=64))
    list(loader)
    it = iter(loader)
    first = next(it)
    with pytest.raises(TypeError, match="cannot be copied while an epoch is running"):
        copy.deepcopy(loader)
    rest = [first.indices.tolist(), *epoch_indices(it)]  # the original's epoch, unharmed
    assert len(rest) > 1
    twin = copy.deepcopy(loader)
    assert epoch_indices(twin) == epoch_indices(loader)


def test_a_mid_epoch_state_that_cannot_resume_is_warned_of_when_taken_once():
    """A shuffling DataLoader on torch's global RNG cannot resume mid-epoch: the refusal came
    only at load_state_dict, so every step checkpoint of a long run turned out unusable at the
    resume. Taking such a state warns (once per loader, naming the fix); an end-of-epoch state
    and a replayable source's mid-epoch state do not."""
    import warnings

    def build(generator):
        g = torch.Generator().manual_seed(1) if generator else None
        dl = DataLoader(EncodedDataset(64), batch_size=8, shuffle=True, generator=g)
        return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), batch_size=8, seed=0)

    loader = build(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # before any epoch
        epoch_indices(loader)
        loader.state_dict()  # at an epoch's end
    it = iter(loader)
    next(it)
    with pytest.warns(UserWarning, match=r"middle of a pass.*RandomSampler.*generator="):
        state = loader.state_dict()
    next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # said once
    with pytest.raises(ValueError, match="cannot resume this DataLoader in the middle"):
        build(False).load_state_dict(state)
    seeded = build(True)
    it = iter(seeded)
    next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(True).load_state_dict(seeded.state_dict())


def test_a_mid_epoch_state_of_an_unreplayable_order_is_refused_by_a_fixed_loader_too():
    """A mid-epoch state saved from a sampler on torch's global RNG (warned of as it is taken:
    "load_state_dict refuses it") was accepted by a loader rebuilt with a generator as the
    warning advises, and its resumed epoch skipped the consumed batches of another order,
    repeating some examples and never yielding others. What counts is how the state was saved:
    refused; an end-of-epoch state of that run resumes."""
    import warnings

    data = EncodedDataset(96)

    def build(sampler_generator):
        # the DataLoader's generator= seeds its workers, not a sampler built by the user
        dl = DataLoader(
            data,
            batch_size=24,
            sampler=torch.utils.data.RandomSampler(data, generator=sampler_generator),
            generator=None if sampler_generator else torch.Generator().manual_seed(1),
        )
        return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), seed=0)

    saved = build(None)
    it = iter(saved)
    next(it)
    with pytest.warns(UserWarning, match=r"middle of a pass.*RandomSampler"):
        state = saved.state_dict()
    fixed = build(torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"saved from a DataLoader whose order cannot be replayed"):
        fixed.load_state_dict(state)
    it.close()
    epoch_indices(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed.load_state_dict(saved.state_dict())  # at an epoch's end
    assert sorted(i for b in epoch_indices(fixed) for i in b) == list(range(96))


def test_a_global_rng_state_loaded_where_a_generator_was_added_names_the_order():
    """shuffle=True without a generator (its order drawn from torch's global RNG), saved
    mid-epoch, then loaded into shuffle=True with generator= (the fix its warning gives): refused
    naming the unreplayable order and a state from the end of a pass, not "0 generators but this
    DataLoader has 1; build the DataLoader as the saved one was" (the configuration that cannot
    resume)."""
    data = EncodedDataset(96)

    def build(generator):
        dl = DataLoader(data, batch_size=24, shuffle=True, generator=generator)
        return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), seed=0)

    saved = build(None)
    it = iter(saved)
    next(it)
    with pytest.warns(UserWarning, match="middle of a pass"):
        state = saved.state_dict()
    with pytest.raises(ValueError, match=r"order cannot be replayed.*end of a pass") as caught:
        build(torch.Generator().manual_seed(1)).load_state_dict(state)
    assert "generators but this DataLoader" not in str(caught.value)
    it.close()


def test_a_state_is_refused_by_a_dataloader_whose_generator_draws_otherwise():
    """shuffle=True with the DataLoader's generator= draws its workers' seed and its order from
    one generator; a RandomSampler built with a generator= of its own draws only the order. A
    state of one was loaded into the other (one generator each, the same sampler class), and
    its resumed epoch replayed another order: the consumed batches skipped were not the ones
    consumed (96 examples, 75 distinct). Refused mid-epoch, naming both; the same build
    resumes, and so does the other from an epoch's end."""
    data = EncodedDataset(96)

    def build(own_sampler):
        g = torch.Generator().manual_seed(1)
        if own_sampler:
            sampler = torch.utils.data.RandomSampler(data, generator=g)
            dl = DataLoader(data, batch_size=24, sampler=sampler)
        else:
            dl = DataLoader(data, batch_size=24, shuffle=True, generator=g)
        return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), seed=0)

    for own in (False, True):
        saved = build(own)
        it = iter(saved)
        head = next(it).indices.tolist()
        state = saved.state_dict()
        with pytest.raises(ValueError, match=r"drew for: (DataLoader and )?sampler, but this "):
            build(not own).load_state_dict(state)
        resumed = build(own)
        resumed.load_state_dict(state)
        assert sorted(head + [i for b in epoch_indices(resumed) for i in b]) == list(range(96))
        other = build(not own)
        other.load_state_dict(resumed.state_dict())  # at an epoch's end: its next order afresh
        assert sorted(i for b in epoch_indices(other) for i in b) == list(range(96))


def test_a_state_of_a_dataloader_with_another_number_of_generators_is_refused_naming_them():
    """The source state holds the states of the generators that draw a DataLoader's order and
    its workers' seeds: shuffle=True with generator= has one, a RandomSampler with a generator=
    of its own and the DataLoader's generator= two. A state of one is refused by the other, at
    an epoch's end too, and a mid-epoch state saved before the generators' roles were recorded
    (an older state) by their number, naming both: restored into other generators, its order
    was not the saved run's."""
    data = EncodedDataset(96)

    def build(generators):
        g = torch.Generator().manual_seed(1)
        if generators == 1:
            dl = DataLoader(data, batch_size=24, shuffle=True, generator=g)
        else:
            sampler = torch.utils.data.RandomSampler(data, generator=g)
            dl = DataLoader(
                data, batch_size=24, sampler=sampler, generator=torch.Generator().manual_seed(2)
            )
        return SelectiveLoader(dl, IndexLoss(), policy=Traditional(), seed=0)

    saved = build(2)
    epoch_indices(saved)
    message = "the saved source state has 2 generators but this DataLoader has 1; build the"
    with pytest.raises(ValueError, match=message):
        build(1).load_state_dict(saved.state_dict())
    it = iter(saved)
    head = next(it).indices.tolist()
    state = copy.deepcopy(saved.state_dict())
    del state["source"]["roles"]  # (as saved before they were recorded)
    with pytest.raises(ValueError, match=message):
        build(1).load_state_dict(state)
    resumed = build(2)
    resumed.load_state_dict(state)  # the same build: resumes
    assert sorted(head + [i for b in epoch_indices(resumed) for i in b]) == list(range(96))


def test_the_mid_epoch_warning_covers_a_dataloader_read_through_index_key_and_passes():
    """A DataLoader read through index_key= on torch's global RNG is refused mid-epoch too: it
    is warned of when taken; with batches_per_epoch, a training epoch's end is not a pass's,
    and the warning says which end resumes."""

    class Indexed(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return {"x": torch.full((6,), float(i)), "y": i % 3, "i": i}

    def build(**kw):
        dl = DataLoader(Indexed(), batch_size=8, shuffle=True)
        return SelectiveLoader(
            dl, nn.Linear(6, 3), policy=Traditional(), batch_size=8, seed=0, **kw
        )

    loader = build(index_key="i", input_key="x", target_key="y")
    it = iter(loader)
    next(it)
    with pytest.warns(UserWarning, match=r"middle of a pass.*RandomSampler.*at an epoch's end"):
        state = loader.state_dict()
    with pytest.raises(ValueError, match="cannot resume this DataLoader in the middle"):
        build(index_key="i", input_key="x", target_key="y").load_state_dict(state)
    fixed = build(input_key="x", target_key="y", batches_per_epoch=2)
    list(fixed)  # a training epoch's end, in the middle of a pass over the data
    with pytest.warns(UserWarning, match=r"at the end of a pass over the data \(with batches_per"):
        fixed.state_dict()


def _peek_warnings(run) -> list[warnings.WarningMessage]:
    """The peek warnings ``run()`` raises (also any raised as an iterator is collected)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
        gc.collect()
    return [w for w in caught if "epoch 0 was left after" in str(w.message)]


@pytest.mark.parametrize("policy", [None, Traditional()], ids=["default", "traditional"])
def test_a_look_at_the_first_batch_before_training_is_warned_of(policy):
    """``next(iter(loader))`` before training, harmless over a DataLoader, ends epoch 0 here (an
    epoch left part-way counts as ended): training then began at epoch 1, past the default
    policy's Random-Backprop epoch, unsaid. Warned of once as epoch 1 begins, at the caller's
    loop, naming the fix (not as the looked-at iterator is collected: that warning came from
    wherever the garbage collector ran); a loop over whole epochs, one that breaks after more
    than a batch, a look after the first epoch and one under ``batches_per_epoch`` (whose pass
    goes on where it was) are not."""

    def build(**kw):
        dl = DataLoader(EncodedDataset(120), batch_size=30)
        return SelectiveLoader(
            dl, IndexLoss(), policy=copy.deepcopy(policy), batch_size=10, seed=0, **kw
        )

    loader = build()
    assert _peek_warnings(lambda: next(iter(loader))) == []  # (nothing skipped yet)
    said = _peek_warnings(lambda: list(loader))
    assert len(said) == 1 and "next(iter(train_loader))" in str(said[0].message)
    assert said[0].filename == __file__  # (the caller's line: the loop's next())
    assert loader.stats.epochs[1].epoch == 1  # (where training began)

    def train_on():
        for _ in range(2):
            assert list(loader)

    assert _peek_warnings(train_on) == []  # (once)

    def two_steps():
        steps = build()
        for k, _ in enumerate(steps):
            if k == 1:
                break
        assert list(steps)

    def look_later():
        later = build()
        assert list(later)
        next(iter(later))
        assert list(later)

    def fixed_count():
        fixed = build(batches_per_epoch=4)
        next(iter(fixed))
        assert list(fixed)

    assert _peek_warnings(two_steps) == []
    assert _peek_warnings(look_later) == []
    assert _peek_warnings(fixed_count) == []


@pytest.mark.parametrize("policy", [None, Traditional()], ids=["default", "traditional"])
def test_an_error_on_the_first_batch_is_not_warned_of_as_a_look_at_it(policy):
    """An epoch 0 left by an error of the loader's first batch (a dataset's ``__getitem__``
    raising, a ``collate_fn`` that drops samples, a wrong ``index_key``: mistakes fail on the
    first batch) raises that error alone. It also warned that the epoch was left after 0 batch
    and asked whether the caller had looked at a batch with ``next(iter(loader))``."""

    class Missing(EncodedDataset):
        def __getitem__(self, i):
            raise FileNotFoundError(f"example {i}")

    loader = SelectiveLoader(
        DataLoader(Missing(120), batch_size=30), IndexLoss(), policy=policy, batch_size=10
    )

    def fail():
        for _ in range(2):  # (the second begins the next epoch, where a peek is warned of)
            with pytest.raises(FileNotFoundError, match="example 0"):
                for _ in loader:
                    pass

    assert _peek_warnings(fail) == []
