"""Resuming a caller that fetches one batch ahead of training (as Lightning does), and an
abandoned epoch's saved state: ``SelectiveLoader.state_dict(unconsumed=1)``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from sbloader import SelectiveBackprop, SelectiveLoader
from sbloader.datasets import ArrayDataset

EPOCHS = 3


def setup(**options):
    """SB at 1/2 over 150 examples in source batches of 40, batches of 12 (``options``: the
    SelectiveLoader's others), with its model and optimizer."""
    g = torch.Generator().manual_seed(0)
    data = ArrayDataset(torch.randn(150, 6, generator=g), torch.randint(0, 4, (150,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    source = DataLoader(
        data, batch_size=40, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    loader = SelectiveLoader(
        source, model, policy=SelectiveBackprop(0.5), batch_size=12, seed=0, **options
    )
    return loader, model, torch.optim.SGD(model.parameters(), lr=0.5)


def fetch_ahead(loader, model, opt, trained, save_at=None, unconsumed=True):
    """Train to EPOCHS, fetching the next batch before training on the current one (the model
    that scores a source batch is then one step older than in a plain loop). Returns the
    checkpoint saved after step ``save_at``."""
    saved = None
    while loader.epoch < EPOCHS:
        it = iter(loader)
        upcoming = next(it, None)
        while upcoming is not None:
            batch, upcoming = upcoming, next(it, None)
            x, y = batch
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            trained.append(batch.indices.tolist())
            if len(trained) - 1 == save_at:
                ahead = int(upcoming is not None and unconsumed)
                saved = copy.deepcopy(
                    (model.state_dict(), opt.state_dict(), loader.state_dict(unconsumed=ahead))
                )
    return saved


def reference(save_at, unconsumed=True):
    loader, model, opt = setup()
    trained: list[list[int]] = []
    saved = fetch_ahead(loader, model, opt, trained, save_at, unconsumed)
    return trained, saved, loader


def resume(saved, loop=None):
    """Train on from ``saved`` (model, optimizer and loader states) with ``loop`` (default
    :func:`fetch_ahead`): (the batches trained, the loader)."""
    loader, model, opt = setup()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    loader.load_state_dict(saved[2])
    trained: list[list[int]] = []
    (loop or fetch_ahead)(loader, model, opt, trained)
    return trained, loader


@pytest.mark.parametrize("save_at", [2, 6, 9, 15])  # 6: the last of epoch 0
def test_a_fetch_ahead_caller_resumes_exactly(save_at):
    trained, saved, loader = reference(save_at)
    after, resumed = resume(saved)
    assert trained[: save_at + 1] + after == trained
    assert resumed.stats.total.examples_yielded == loader.stats.total.examples_yielded
    assert resumed.stats.total.batches_yielded == loader.stats.total.batches_yielded


def test_the_batch_fetched_ahead_is_handed_out_again_as_it_was():
    """The state taken back one batch: resuming hands out that batch first, without a new
    selection pass, so its examples are those chosen by the model one step older."""
    trained, saved, _ = reference(4)
    assert len(saved[2]["returned"]) == 1
    assert saved[2]["returned"][0]["indices"].tolist() == trained[5]


def test_without_taking_back_the_fetched_batch_the_resumed_run_differs():
    """The comparison above is sensitive: the loader's own state at the save is one batch past
    what was trained, and that batch is then never trained."""
    trained, saved, _ = reference(4, unconsumed=False)
    after, _ = resume(saved)
    assert after[0] != trained[5] and trained[:5] + after != trained


def test_unconsumed_is_checked():
    loader, _, _ = setup()
    for wrong in (3, -1, "1"):
        with pytest.raises(ValueError, match=r"unconsumed should be 0, 1 or 2 .* but got"):
            loader.state_dict(unconsumed=wrong)
        with pytest.raises(ValueError, match="unconsumed should be 0, 1 or 2"):
            loader.takes_back(wrong)
    with pytest.raises(ValueError, match="no epoch is running"):
        loader.state_dict(unconsumed=1)
    it = iter(loader)
    with pytest.raises(ValueError, match="no epoch is running"):
        loader.state_dict(unconsumed=1)  # (not begun: it begins on the first next())
    next(it)
    loader.state_dict(unconsumed=1)
    with pytest.raises(ValueError, match=r"only the last 1 batch .* pass unconsumed=1"):
        loader.state_dict(unconsumed=2)
    next(it)
    assert loader.takes_back(2)
    loader.state_dict(unconsumed=2)
    it.close()  # (resumable: the batch handed out last can still be taken back)
    loader.state_dict(unconsumed=1)
    it = iter(loader)
    next(it)
    it.close(resumable=False)
    with pytest.raises(ValueError, match="no epoch is running"):
        loader.state_dict(unconsumed=1)
    # A loaded state replaces the epoch left part-way: the batch that epoch handed out last is
    # no batch of the loaded run, and is not taken back into its state.
    it = iter(loader)
    next(it)
    mid = loader.state_dict()
    next(it)
    it.close()
    loader.load_state_dict(mid)
    with pytest.raises(ValueError, match="no epoch is running"):
        loader.state_dict(unconsumed=1)


@pytest.mark.filterwarnings("ignore:overlap_selection=True with")
@pytest.mark.parametrize(
    "options", [{}, {"prefetch": 2, "overlap_selection": True}], ids=["plain", "threads"]
)
def test_a_training_step_that_raises_can_give_its_batch_back_after_leaving_the_loop(options):
    """The training step raises on its batch (an out-of-memory error): leaving the ``for``
    loop drops and closes the epoch's iterator, and ``state_dict(unconsumed=1)`` in the
    ``except`` still takes that batch back, so that the resumed run trains on it and on
    everything after it as the uninterrupted run does."""

    def make():
        loader, model, _ = setup()
        return SelectiveLoader(
            loader.source.loader,
            model,
            policy=SelectiveBackprop(0.5),
            batch_size=12,
            seed=0,
            **options,
        )

    def run(loader, fail_at=None):
        trained = []
        while loader.epoch < EPOCHS:
            for batch in loader:
                if len(trained) == fail_at:
                    raise RuntimeError("CUDA out of memory (in the training step)")
                trained.append(batch.indices.tolist())
        return trained

    reference = run(make())
    failing = make()
    with pytest.raises(RuntimeError, match="out of memory"):
        run(failing, fail_at=4)
    state = copy.deepcopy(failing.state_dict(unconsumed=1))
    resumed = make()
    resumed.load_state_dict(state)
    assert reference[:4] + run(resumed) == reference


def test_an_epoch_closed_for_good_is_saved_as_the_start_of_the_next():
    """``close(resumable=False)`` (what the Lightning integration does when Lightning ends an
    epoch early): the next iter(loader) starts the next epoch, and a state saved in between
    resumes there too; after a plain ``break`` a saved state resumes the epoch where it
    stopped."""

    def run(loader, stop_after=None, resumable=True):
        seen, it = [], iter(loader)
        for k, batch in enumerate(it):
            seen.append(batch.indices.tolist())
            if k == stop_after:
                it.close(resumable=resumable)
                break
        return seen

    first, _, _ = setup()
    run(first)
    run(first, stop_after=1, resumable=False)
    state = first.state_dict()
    assert state["epoch"] == 2 and not state["active"]
    expected = run(first)
    second, _, _ = setup()
    second.load_state_dict(state)
    assert run(second) == expected and second.epoch == first.epoch == 3

    third, _, _ = setup()
    run(third)
    head = run(third, stop_after=1)  # left like a `break`
    state = third.state_dict()
    assert state["epoch"] == 1 and state["active"] and state["position"] > 0
    fourth, _, _ = setup()
    fourth.load_state_dict(state)
    rest = run(fourth)
    assert len(head) == 2 and rest and not set(map(tuple, head)) & set(map(tuple, rest))


@pytest.mark.parametrize("where", ["after_the_loop", "before_break"])
def test_a_loop_capping_its_epochs_ends_each_for_good_and_saves_the_next(where):
    """A loop of two steps per epoch that saves as each epoch ends: a state saved after
    ``break`` resumes the rest of the epoch left, and the loop going on with the next epoch is
    warned of as it begins, naming end_epoch() (found by review: resumed, the run went on a
    pass behind for good, unsaid); with loader.end_epoch() the state starts the next epoch, and
    a run resumed from it yields what the loop does."""

    def capped(loader, end: bool):
        seen = []
        for k, batch in enumerate(loader):
            seen.append(batch.indices.tolist())
            if k == 1:
                if end and where == "before_break":
                    loader.end_epoch()
                break
        if end and where == "after_the_loop":
            loader.end_epoch()
        return seen

    plain = setup()[0]
    capped(plain, end=False)
    state = plain.state_dict()
    assert state["epoch"] == 0 and state["active"]  # (the rest of epoch 0: a preempted run's)
    with pytest.warns(UserWarning, match=r"epoch 0 was left part-way.*loader\.end_epoch\(\)"):
        capped(plain, end=False)

    run = setup()[0]
    head = capped(run, end=True) + capped(run, end=True)
    state = copy.deepcopy(run.state_dict())
    assert state["epoch"] == 2 and not state["active"] and state["position"] == 0
    with pytest.raises(ValueError, match="unconsumed=1, but no epoch is running"):
        run.state_dict(unconsumed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rest = [capped(run, end=True) for _ in range(2)]
    resumed = setup()[0]
    resumed.load_state_dict(state)
    assert [capped(resumed, end=True) for _ in range(2)] == rest
    assert head[:2] == capped(setup()[0], end=False)  # (the same first epoch either way)
    assert resumed.epoch == run.epoch == 4


def test_end_epoch_where_it_changes_nothing_warns_or_refuses():
    """end_epoch() under batches_per_epoch does nothing (found by review: it closed the pass's
    iterator, which runs on between training epochs, and the next training epoch raised); after
    a state was saved it warns that the state resumes the epoch's rest; on a loaded mid-epoch
    state not iterated yet it refuses (it did nothing, unsaid); a loop of one step per epoch
    that ends each is not taken for a peek at a batch."""
    fixed, reference = setup(batches_per_epoch=3)[0], setup(batches_per_epoch=3)[0]
    seen, expected = [], [[b.indices.tolist() for b in reference] for _ in range(3)]
    for _ in range(3):
        seen.append([b.indices.tolist() for b in fixed])
        fixed.end_epoch()
    assert seen == expected

    saved_first = setup()[0]
    for _ in saved_first:
        break
    saved_first.state_dict()
    with pytest.warns(UserWarning, match=r"end_epoch\(\) was called after it was saved"):
        saved_first.end_epoch()

    run = setup()[0]
    it = iter(run)
    next(it)
    state = copy.deepcopy(run.state_dict())
    it.close()
    loaded = setup()[0]
    loaded.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"resumes epoch 0 part-way.*iterate the loader"):
        loaded.end_epoch()

    one_step = setup()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            for _ in one_step:
                break
            one_step.end_epoch()
    assert one_step.epoch == 3


class Interrupt(Exception):
    """A training step that raised; ``ahead``: whether the caller had fetched a batch ahead."""

    def __init__(self, ahead: bool) -> None:
        super().__init__("interrupted")
        self.ahead = ahead


def train_until(loader, model, opt, trained, fail_at=None):
    """:func:`fetch_ahead`'s loop, whose step on the batch ``fail_at`` raises :class:`Interrupt`
    before its optimizer step."""
    while loader.epoch < EPOCHS:
        it = iter(loader)
        upcoming = next(it, None)
        while upcoming is not None:
            batch, upcoming = upcoming, next(it, None)
            if len(trained) == fail_at:
                raise Interrupt(upcoming is not None)
            x, y = batch
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            trained.append(batch.indices.tolist())


@pytest.mark.parametrize("fail_at", [0, 3, 7, 11, 13])  # 0, 7, 13: an epoch's first
@pytest.mark.parametrize("where", ["in the except", "after it"])
def test_a_step_that_raises_with_a_batch_fetched_ahead_takes_both_back(fail_at, where):
    """Lightning's case: the caller had fetched the next batch when the step on the current
    one raised (a KeyboardInterrupt, an out-of-memory error), so neither was trained:
    ``state_dict(unconsumed=2)`` takes both back, and the resumed run trains the interrupted
    batch, then the one fetched ahead, then the rest, as the uninterrupted run does. Saved in
    the ``except`` (the epoch's iterator still alive) or after it (the iterator dropped and
    closed). Before, a state took back one batch at most: the interrupted batch was lost."""
    reference: list[list[int]] = []
    whole, *rest = setup()
    train_until(whole, *rest, reference)
    loader, model, opt = setup()
    trained: list[list[int]] = []

    def take(ahead: bool):
        return copy.deepcopy(
            (model.state_dict(), opt.state_dict(), loader.state_dict(unconsumed=1 + ahead))
        )

    try:
        train_until(loader, model, opt, trained, fail_at)
    except Interrupt as raised:
        ahead = raised.ahead
        saved = take(ahead) if where == "in the except" else None
    if saved is None:
        saved = take(ahead)
    assert ahead and len(saved[2]["returned"]) == 2
    after, again = resume(saved, train_until)
    assert trained == reference[:fail_at] and trained + after == reference
    assert again.stats.total.examples_yielded == whole.stats.total.examples_yielded
    assert again.stats.total.batches_yielded == whole.stats.total.batches_yielded


def test_taking_back_one_batch_where_two_were_untrained_loses_one():
    """The comparison above is sensitive: with unconsumed=1 (what a state took before), the
    resumed run never trains the interrupted batch."""
    reference: list[list[int]] = []
    train_until(*setup(), reference)
    loader, model, opt = setup()
    trained: list[list[int]] = []
    with pytest.raises(Interrupt):
        train_until(loader, model, opt, trained, 3)
    state = copy.deepcopy((model.state_dict(), opt.state_dict(), loader.state_dict(unconsumed=1)))
    after, _ = resume(state, train_until)
    assert after[0] == reference[4] and trained + after != reference
