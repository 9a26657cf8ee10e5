"""Training-step losses reported through ``loader.feedback``: where they go, when they take
effect, how they are checked and saved."""

from __future__ import annotations

import warnings

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
from sbloader._random import hashed_uniforms
from sbloader.feedback import FeedbackBuffer

N = 300


def loader_for(policy, *, bs=10, source_bs=30, seed=0, **kw):
    dl = DataLoader(
        EncodedDataset(N),
        batch_size=source_bs,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    return SelectiveLoader(dl, IndexLoss(), policy=policy, batch_size=bs, seed=seed, **kw)


def reported(indices: torch.Tensor) -> torch.Tensor:
    """A training loss that reverses the selection pass's order: example i reports N - i."""
    return (N - indices).double()


def measured(batch) -> torch.Tensor:
    """The training loss a model unchanged since the selection pass reports: the pass's own."""
    x, y = batch
    return torch.nn.functional.cross_entropy(IndexLoss()(x), y, reduction="none")


def test_reports_replace_stored_losses_when_the_next_epoch_starts():
    policy = SelectiveBackprop(1 / 3, staleness=3)
    loader = loader_for(policy)
    trained = []
    for batch in loader:  # fresh epoch 0
        loader.feedback(batch.indices, reported(batch.indices))
        trained += batch.indices.tolist()
        # Nothing reported reaches the store mid-epoch (the epoch's decisions stay its own).
        stored, _ = policy.store.lookup(batch.indices.numpy())
        assert not np.array_equal(stored, reported(batch.indices).numpy())
    assert loader.stats.epochs[0].feedback == len(trained)
    before, _ = policy.store.lookup(np.arange(N))
    it = iter(loader)
    next(it)  # stale epoch 1 starts: the reports are in the store now
    after, epochs = policy.store.lookup(np.arange(N))
    t = np.array(sorted(set(trained)))
    untrained = np.setdiff1d(np.arange(N), t)
    np.testing.assert_array_equal(after[t], (N - t).astype(np.float32))
    np.testing.assert_array_equal(after[untrained], before[untrained])
    assert (epochs[t] == 0).all()


def test_stale_epoch_decides_from_the_reported_losses():
    """Examples reported with a loss above everything in the window are kept with P = 1; those
    reported with loss 0 get P = 0, whatever the selection pass had measured for them."""
    policy = SelectiveBackprop(1 / 3, staleness=2)
    loader = loader_for(policy, remainder="short")
    trained = []
    for batch in loader:  # fresh epoch 0 scores everything (IndexLoss: loss grows with the index)
        # The easier half by the selection pass reports a loss above everything, the harder 0.
        loader.feedback(batch.indices, torch.where(batch.indices < N // 2, 100.0, 0.0))
        trained += batch.indices.tolist()
    high = np.array([i for i in trained if i < N // 2])
    low = np.array([i for i in trained if i >= N // 2])
    assert len(high) > 5 and len(low) > 5
    before = policy.store.selected.copy()
    list(loader)  # stale epoch 1
    chosen = set(np.flatnonzero(policy.store.selected - before).tolist())
    assert set(high.tolist()) <= chosen
    assert not chosen & set(low.tolist())
    # Everything else is decided from its stale selection loss, as without feedback.
    p = policy.stale_probabilities(np.arange(N))
    expected = hashed_uniforms(policy._key, 1, np.arange(N)) < p
    assert chosen == set(np.flatnonzero(expected).tolist())


def test_a_reported_loss_of_an_example_no_pass_scored_decides_its_stale_epochs():
    """An example the selection pass never scored (a sampler that drew only half the data in
    the fresh epoch; the stale epoch then keeps the others with P = 1, and they are trained)
    counts as scored once its training loss is reported: its stale epochs rank that loss, not
    P = 1 as for an example never scored."""
    policy = SelectiveBackprop(beta=1.0, history=16, staleness=3, drift_bound=None)
    policy.attach(10, 0)
    policy.begin_epoch(0)
    rng = np.random.default_rng(0)
    policy.choose(np.arange(1.0, 6.0), np.arange(5), rng, 5)  # the pass scores 0..4 only
    unscored = np.arange(5, 10)
    np.testing.assert_array_equal(policy.stale_probabilities(unscored), np.ones(5))
    fed = np.array([0.5, 1.5, 2.5, 3.5, 4.5])
    policy.feedback(unscored, fed, 0)
    policy.begin_epoch(1)
    assert not policy.needs_losses(1)
    losses, epochs = policy.store.lookup(unscored)
    np.testing.assert_array_equal(losses, fed)
    np.testing.assert_array_equal(epochs, np.zeros(5))
    p = policy.stale_probabilities(unscored)
    np.testing.assert_allclose(p, policy.window.rank(fed, 1.0))
    assert p[0] < 1.0
    np.testing.assert_array_equal(policy.choose(None, unscored, rng, 5).probabilities, p)


def test_feedback_leaves_the_current_epoch_and_the_window_alone():
    def run(feed: bool):
        policy = SelectiveBackprop(1 / 3, staleness=3, history=64)
        loader = loader_for(policy)
        out = []
        for batch in loader:
            out.append(batch.indices.tolist())
            if feed:
                loader.feedback(batch.indices, reported(batch.indices))
        return out, policy.window.sorted_values()

    (plain, w_plain), (fed, w_fed) = run(False), run(True)
    assert plain == fed
    np.testing.assert_array_equal(w_plain, w_fed)


def test_reports_change_stale_epochs_and_nothing_else():
    def run(feed: bool):
        loader = loader_for(SelectiveBackprop(1 / 3, staleness=2))
        epochs = []
        for _ in range(3):
            got = []
            for batch in loader:
                got += batch.indices.tolist()
                if feed:
                    loader.feedback(batch.indices, reported(batch.indices))
            epochs.append(got)
        return epochs

    plain, fed = run(False), run(True)
    assert plain[0] == fed[0]  # fresh epoch: the selection pass decides
    assert plain[1] != fed[1]  # stale epoch: the reported losses decide


@pytest.mark.parametrize("stop", [0, 2, 5])
def test_resume_with_reports_pending_is_exact(stop):
    def build():
        return loader_for(
            Phased(
                SelectiveBackprop(1 / 3, staleness=2, history=64),
                warmup_epochs=1,
                warmup_policy=RandomBackprop(1 / 3),
            )
        )

    def train(loader, batches):
        got = []
        for batch in batches:
            got.append(batch.indices.tolist())
            loader.feedback(batch.indices, reported(batch.indices))
        return got

    full_loader = build()
    full = [b for _ in range(4) for b in train(full_loader, full_loader)]

    loader = build()
    got = train(loader, loader)  # warm-up
    epoch1 = train(loader, loader)  # fresh epoch
    it = iter(loader)  # stale epoch 2: the reports of epoch 1 are applied when it starts
    part = train(loader, [next(it) for _ in range(stop)])
    got += epoch1 + part
    state = loader.state_dict()  # holds the reports not applied yet
    held = sum(map(len, part)) if stop else sum(map(len, epoch1))
    assert state["feedback"]["indices"].numel() == held
    again = build()
    again.load_state_dict(state)
    got += [b for _ in range(2) for b in train(again, again)]
    assert got == full
    np.testing.assert_array_equal(
        again.policy.policy.store.loss, full_loader.policy.policy.store.loss
    )


@pytest.mark.parametrize("policy", [Traditional(), RandomBackprop(0.5), SelectiveBackprop(0.5)])
def test_policies_without_a_store_count_and_ignore_reports(policy):
    loader = loader_for(policy)
    first = []
    for batch in loader:
        first.append(batch.indices.tolist())
        loader.feedback(batch.indices, reported(batch.indices))
    assert loader.stats.epochs[0].feedback == sum(map(len, first))
    assert len(loader._feedback) == 0  # nothing held for a policy that cannot use it
    assert loader.state_dict()["feedback"]["indices"].numel() == 0
    with pytest.raises(ValueError, match="one loss per example"):  # but still checked
        loader.feedback(torch.tensor([1, 2]), torch.zeros(3))


def test_the_drop_in_loop_runs_over_a_source_without_indices():
    """The README's drop-in loop reports ``loader.feedback(batch.indices, losses)``; over a
    source with no dataset indices (a list of batches) ``batch.indices`` is None, and feedback
    raised TypeError on the first step although it "changes nothing" there."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(12, 4, generator=g), torch.randint(0, 2, (12,), generator=g))] * 3
    model = torch.nn.Linear(4, 2)
    loader = SelectiveLoader(batches, model, batch_size=4, seed=0)  # the default recipe
    for _ in range(2):  # the warm-up, then a selective epoch
        for batch in loader:
            x, y = batch
            assert batch.indices is None
            losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            loader.feedback(batch.indices, losses)
    assert [e.feedback for e in loader.stats.epochs] == [
        e.examples_yielded for e in loader.stats.epochs
    ]
    with pytest.raises(ValueError, match="losses of shape"):  # still checked
        loader.feedback(None, torch.zeros(4, 7))
    # A loss reduced over the batch: one value, no count to compare it with, so it was counted
    # as one example reported, the missing reduction='none' unsaid.
    for reduced in (torch.tensor(0.5), 0.5, np.float32(0.5)):
        with pytest.raises(ValueError, match=r"single value.*reduction='none'"):
            loader.feedback(None, reduced)
    fresh = SelectiveLoader(batches, model, batch_size=4, seed=0)
    next(iter(fresh))
    fresh.feedback(None, torch.tensor([0.5]))  # a batch of one example (of one trained)
    stale = loader_for(SelectiveBackprop(1 / 3, staleness=2))  # a source with indices
    next(iter(stale))
    with pytest.raises(TypeError, match="indices should be a tensor"):
        stale.feedback(None, torch.zeros(3))


def test_bad_reports_are_refused_at_once_naming_the_fix():
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    batch = next(iter(loader))
    with pytest.raises(ValueError, match="one loss per example"):
        loader.feedback(batch.indices, torch.zeros(len(batch.indices) + 1))
    with pytest.raises(TypeError, match="whole dataset indices"):
        loader.feedback(batch.indices.float(), torch.zeros(len(batch.indices)))
    with pytest.raises(IndexError, match=r"outside 0\.\.299"):
        loader.feedback(torch.tensor([5, 300]), torch.zeros(2))
    with pytest.raises(IndexError, match=r"batch\.indices"):
        loader.feedback(torch.tensor([-1]), torch.zeros(1))
    n = len(batch.indices)
    for dtype in (torch.bool, torch.complex64):
        with pytest.raises(TypeError, match=f"real per-example losses.*{dtype}"):
            loader.feedback(batch.indices, torch.zeros(n, dtype=dtype))
    assert len(loader._feedback) == 0  # nothing half-added


def test_a_batch_reported_twice_is_refused_at_once_and_changes_nothing():
    """A second report of the same batch (two hooks, the report repeated after the loop) was
    accepted: its examples were counted twice in ``loader.stats`` and held twice, the mistake
    unsaid. Refused now, naming the fix, with nothing held or counted; a batch reported after the
    next epoch began is not a second report."""
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=3))
    with pytest.raises(ValueError, match=r"more examples than the loader has yielded"):
        loader.feedback(torch.tensor([1, 2]), torch.zeros(2))  # before any batch was yielded
    it = iter(loader)
    batch = next(it)
    loader.feedback(batch.indices, reported(batch.indices))
    with pytest.raises(ValueError, match=r"reported twice.*once, after its training step"):
        loader.feedback(batch.indices, reported(batch.indices))
    n = len(batch.indices)
    assert len(loader._feedback) == n and loader.stats.current.feedback == n
    batches = list(it)
    for batch in batches:
        loader.feedback(batch.indices, reported(batch.indices))
    with pytest.raises(ValueError, match="reported twice"):  # again after the loop
        loader.feedback(batches[-1].indices, reported(batches[-1].indices))
    e = loader.stats.current
    assert e.feedback == e.examples_yielded == len(loader._feedback)
    # An epoch's last batch reported only after the next epoch began: counted there.
    batches = list(loader)
    for batch in batches[:-1]:
        loader.feedback(batch.indices, reported(batch.indices))
    first = next(iter(loader))
    for batch in (batches[-1], first):
        loader.feedback(batch.indices, reported(batch.indices))
    assert loader.stats.current.feedback > loader.stats.current.examples_yielded
    assert loader.stats.total.feedback == loader.stats.total.examples_yielded


def test_a_reported_batch_taken_back_is_counted_once_when_reported_again():
    """A step that reported its batch and then raised (the backward out of memory) saves
    ``state_dict(unconsumed=1)``: the resumed run hands the batch out again and reports it
    again. Its stats counted that report twice (more reported than yielded), and the second
    report was then refused as a batch reported twice."""

    def build():
        return loader_for(SelectiveBackprop(1 / 3, staleness=3))

    loader = build()
    with pytest.raises(MemoryError):
        for step, batch in enumerate(loader):
            loader.feedback(batch.indices, reported(batch.indices))
            if step == 2:
                raise MemoryError("out of memory in backward")
    state = loader.state_dict(unconsumed=1)
    again = build()
    again.load_state_dict(state)
    for batch in again:
        again.feedback(batch.indices, reported(batch.indices))
    e = again.stats.current
    assert e.feedback == e.examples_yielded > 0


def test_a_list_of_per_example_loss_tensors_is_taken_detached():
    """Losses computed one example at a time (a list of 0-d tensors that require grad) raised
    torch's "Can't call numpy() on Tensor that requires grad", though feedback detaches."""
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    batch = next(iter(loader))
    w = torch.ones((), requires_grad=True)
    n = len(batch.indices)
    losses = [w * float(i) for i in range(n)]
    loader.feedback(batch.indices[:2], losses[:2])
    loader.feedback(batch.indices[2:], tuple(v.reshape(1) for v in losses[2:]))
    idx, val = loader._feedback.take()
    assert idx.tolist() == batch.indices.tolist() and val.tolist() == list(range(n))


def test_a_list_of_loss_tensors_of_several_examples_each_is_joined_in_order():
    """Losses computed in chunks (a step's micro-batches), passed as a list of tensors of
    several examples each: every example's loss, in order."""
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    batch = next(iter(loader))
    losses = reported(batch.indices)
    loader.feedback(batch.indices, [losses[:3], losses[3:7], losses[7:]])
    idx, val = loader._feedback.take()
    assert idx.tolist() == batch.indices.tolist() and val.tolist() == losses.tolist()


def test_per_token_reports_are_refused_naming_the_reduction_over_tokens():
    """Losses of shape (batch, seq) were refused telling a user who had reduction='none' to
    pass reduction='none'; the message names the shape and the per-example reduction."""
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    batch = next(iter(loader))
    n = len(batch.indices)
    with pytest.raises(ValueError, match=rf"losses of shape \({n}, 7\).*over every dimension"):
        loader.feedback(batch.indices, torch.zeros(n, 7))
    loader.feedback(batch.indices, torch.zeros(n, 1))  # one per example, laid out as a column
    assert len(loader._feedback) == n
    # (another batch's per-token losses: the counts differ, and the message says so)
    with pytest.raises(ValueError, match=rf"got {n} indices and {7 * (n + 1)} losses;"):
        loader.feedback(batch.indices, torch.zeros(n + 1, 7))


def test_reports_are_the_values_reported_whatever_the_caller_does_with_them_after():
    """A report is held until the next epoch starts: a buffer reused for each step's losses, or
    losses changed in place after the report (weighted, zeroed), must not change what the store
    gets (held as views, every example got the last step's values, or the changed ones)."""
    policy = SelectiveBackprop(1 / 3, staleness=3)
    loader = loader_for(policy)
    buffer = np.zeros(10)
    indices = torch.zeros(10, dtype=torch.int64)
    trained = []
    for step, batch in enumerate(loader):
        n = len(batch.indices)
        if step % 2:
            buffer[:n] = reported(batch.indices).numpy()
            indices[:n] = batch.indices
            loader.feedback(indices[:n], buffer[:n])  # the same buffers every other step
        else:
            losses = reported(batch.indices)
            loader.feedback(batch.indices, losses)
            losses.mul_(0.0)  # e.g. weighted in place after the report
        trained += batch.indices.tolist()
    next(iter(loader))  # the reports reach the store
    t = np.array(sorted(set(trained)))
    stored, _ = policy.store.lookup(t)
    np.testing.assert_array_equal(stored, (N - t).astype(np.float32))


def test_a_state_taken_before_the_batchs_report_is_said():
    """A checkpoint saved in the training step before ``loader.feedback`` holds no report of the
    batch it counts as trained: the resumed run's store differed from the uninterrupted run's
    (its stale epochs decided from older losses), with nothing said. Said when it is taken."""
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, batch in enumerate(loader):
            if step == 0:
                loader.state_dict()  # a run that has not reported yet: nothing to say
            loader.feedback(batch.indices, reported(batch.indices))
            loader.state_dict()  # each batch reported before the state is taken
        it = iter(loader)
        batch = next(it)
        loader.state_dict(unconsumed=1)  # fetched, not trained yet: taken back, not missing
    with pytest.warns(UserWarning, match=r"10 of the 10 examples yielded in epoch 1.*before"):
        state = loader.state_dict()
    loader.feedback(batch.indices, 2 * reported(batch.indices))
    assert state["feedback"]["indices"].numel() == 0  # (the report the resumed run lacks)
    next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # said once
    plain = loader_for(Traditional())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in plain:  # a policy that ignores reports: nothing lost
            plain.state_dict()
            plain.feedback(batch.indices, reported(batch.indices))


def test_feedback_buffer_round_trips_and_takes_everything_once():
    buf = FeedbackBuffer()
    buf.add(torch.tensor([3, 1]), torch.tensor([0.5, 1.5]))
    buf.add(np.array([2]), np.array([2.5]))
    state = buf.state_dict()
    assert len(buf) == 3  # saving does not consume
    other = FeedbackBuffer()
    other.load_state_dict(state)
    idx, val = other.take()
    assert idx.tolist() == [3, 1, 2] and val.tolist() == [0.5, 1.5, 2.5]
    assert other.take()[0].size == 0
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({**state, "version": 99})


def test_an_old_state_without_reports_loads():
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    list(loader)
    state = loader.state_dict()
    del state["feedback"]
    again = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    again.load_state_dict(state)
    assert len(again._feedback) == 0


def test_the_default_recipe_anneals_the_last_eighth_of_the_planned_epochs():
    """default_policy(epochs=E): Random-Backprop, Stale-SB fed by the training losses (one
    selection pass), then all the data in the last eighth of E (at least one epoch)."""
    from sbloader import default_policy

    loader = loader_for(default_policy(epochs=8))
    for _ in range(8):
        for batch in loader:
            loader.feedback(batch.indices, measured(batch))
    e = loader.stats.epochs
    assert [x.selection_forwards for x in e] == [0, N, 0, 0, 0, 0, 0, 0]
    assert e[-1].examples_selected == e[-1].examples_seen == N  # the annealed epoch
    assert all(x.examples_selected < N for x in e[:-1])
    with pytest.raises(ValueError, match="epochs should be >= 2"):
        default_policy(epochs=1)
    assert default_policy().anneal_from_epoch is None  # SelectiveLoader's own default


def test_planned_epochs_make_the_loaders_default_anneal():
    """SelectiveLoader(source, model, planned_epochs=E) is default_policy(epochs=E): the same
    selections, epoch by epoch, as passing that policy; refused with an explicit policy."""
    from sbloader import default_policy

    a = loader_for(None, planned_epochs=8)
    b = loader_for(default_policy(epochs=8))
    assert a.planned_epochs == 8 and a.policy.anneal_from_epoch == 7
    for _ in range(8):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.indices, y.indices)
            a.feedback(x.indices, reported(x.indices))
            b.feedback(y.indices, reported(y.indices))
    e = a.stats.epochs
    assert e[-1].examples_selected == e[-1].examples_seen == N
    assert all(x.examples_selected < N for x in e[:-1])
    assert loader_for(None).policy.anneal_from_epoch is None
    with pytest.raises(ValueError, match="planned_epochs should be >= 2"):
        loader_for(None, planned_epochs=1)
    with pytest.raises(ValueError, match=r"policy=sbloader.default_policy\(epochs=8\)"):
        loader_for(SelectiveBackprop(0.5), planned_epochs=8)


@pytest.mark.parametrize("selectivity", [0.2, 0.5])
def test_the_default_recipe_keeps_the_selectivity_it_is_given(selectivity):
    """default_policy(selectivity=s): the Random-Backprop warm-up and the Stale-SB epochs both
    keep about s of the candidates (the first selective epoch decides from a selection pass);
    a selectivity outside (0, 1] is refused by name."""
    from sbloader import default_policy

    loader = loader_for(default_policy(epochs=8, selectivity=selectivity))
    for _ in range(4):
        for batch in loader:
            loader.feedback(batch.indices, reported(batch.indices))
    kept = [x.examples_selected / x.examples_seen for x in loader.stats.epochs]
    assert all(abs(k - selectivity) < 0.1 for k in kept[:2]), kept
    assert loader.stats.epochs[1].selection_forwards == N
    no_store = default_policy(has_store=False, selectivity=selectivity)
    assert no_store.policy.selectivity == no_store.warmup_policy.selectivity == selectivity
    with pytest.raises(ValueError, match="selectivity should be"):
        default_policy(selectivity=0.0)
    with pytest.raises(ValueError, match="selectivity should be"):
        default_policy(selectivity=1.5)


@pytest.mark.parametrize(
    ("epochs", "share", "first"), [(8, 1 / 8, 7), (8, 0.25, 6), (16, 0.25, 12)]
)
def test_the_default_recipe_anneals_the_share_of_its_epochs_it_is_given(epochs, share, first):
    """default_policy(epochs=E, anneal_share=a): the last round(a E) epochs (at least one) keep
    every candidate, the epochs before them select; a share outside (0, 1) is refused."""
    from sbloader import default_policy

    policy = default_policy(epochs=epochs, anneal_share=share)
    assert policy.anneal_from_epoch == first
    loader = loader_for(policy)
    for _ in range(epochs):
        for batch in loader:
            loader.feedback(batch.indices, reported(batch.indices))
    kept = [x.examples_selected / x.examples_seen for x in loader.stats.epochs]
    assert all(k == 1.0 for k in kept[first:]), kept
    assert max(kept[:first]) < 0.9, kept  # selective before (this loss reverses the ranks)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="anneal_share should be"):
            default_policy(epochs=8, anneal_share=bad)


def fed_run(bound, scale, epochs):
    """Stale-SB fed with each trained example's selection loss times ``scale`` (the model
    improved on what it trained on): returns the policy and the epochs' stats."""
    policy = SelectiveBackprop(1 / 3, staleness=3, fed_staleness=10, drift_bound=bound)
    loader = loader_for(policy)
    for _ in range(epochs):
        for batch in loader:
            loader.feedback(batch.indices, measured(batch) * scale)
    return policy, loader.stats.epochs


def test_stale_epochs_that_would_starve_run_a_selection_pass_instead():
    """Reports of loss 0 for every trained example: ranked against the pass's window, an example
    once trained on is never kept again, and without the bound the kept share falls epoch after
    epoch (the GPU run where it fell to 2%). With the default bound (0.5), a stale epoch expected
    to keep less than half the selectivity runs a selection pass instead."""
    policy, e = fed_run(None, 0.0, 6)
    assert [x.selection_forwards for x in e] == [N, 0, 0, 0, 0, 0]
    assert e[4].examples_selected <= 0.1 * N and policy.drift_passes == 0
    policy, e = fed_run(0.5, 0.0, 6)
    assert [x.selection_forwards for x in e] == [N] * 6
    assert policy.drift_passes == 5
    assert all(x.examples_selected >= N / 6 for x in e)


@pytest.mark.parametrize(("scale", "pass_instead"), [(0.0, True), (1.0, False), (1e3, True)])
def test_a_stale_epoch_runs_a_pass_where_its_expected_share_leaves_the_bound_either_way(
    scale, pass_instead
):
    """Every example reported at ``scale`` times its pass's loss, ranked against the pass's
    losses: at 0 a stale epoch would keep almost none (below d * s), at 1e3 every one (above
    s / d: the loss rose, or changed scale); either way the epoch runs a selection pass instead.
    Reports equal to the pass's keep s, and the epoch stays stale."""
    policy = SelectiveBackprop(1 / 3, history=256, staleness=3, fed_staleness=10)
    policy.attach(N, key=0)
    policy.begin_epoch(0)
    losses, everyone = np.random.default_rng(0).exponential(size=N), np.arange(N)
    policy.choose(losses, everyone, np.random.default_rng(1), N)
    policy.feedback(everyone, losses * scale, 0)
    policy.begin_epoch(1)
    assert policy.needs_losses(1) == pass_instead
    assert policy.drift_passes == int(pass_instead)


def test_the_expected_stale_share_predicts_what_a_stale_epoch_keeps():
    """expected_stale_share, read as a stale epoch ends (its own reports not applied yet), is
    the share that epoch kept, within sampling noise; and it is None until a pass was made."""
    policy = SelectiveBackprop(1 / 3, staleness=3, fed_staleness=10, drift_bound=None)
    assert policy.expected_stale_share() is None
    loader = loader_for(policy)
    for epoch in range(5):
        for batch in loader:
            loader.feedback(batch.indices, torch.zeros(len(batch.indices)))
        if epoch:
            kept = loader.stats.epochs[-1].examples_selected / N
            assert abs(policy.expected_stale_share() - kept) <= 0.04, epoch


def test_reports_that_match_the_pass_leave_the_schedule_alone():
    policy, e = fed_run(0.5, 1.0, 5)
    assert [x.selection_forwards for x in e] == [N, 0, 0, 0, 0]
    assert policy.drift_passes == 0
    assert abs(policy.expected_stale_share() - 1 / 3) < 0.02


def test_a_mild_drift_passes_when_it_crosses_the_bound_and_the_schedule_restarts():
    """Reports at 0.3 of the pass's losses: epoch 1 is still stale (expected share 0.20 >
    1/6); by epoch 2 it would keep less, so epoch 2 makes a pass, and epoch 3, judged against
    that pass, is stale again."""
    policy, e = fed_run(0.5, 0.3, 4)
    assert [x.selection_forwards > 0 for x in e] == [True, False, True, False]
    assert policy.drift_passes == 1


@pytest.mark.parametrize("stop", [0, 3])
def test_resume_across_a_drift_pass_is_exact(stop):
    """A state saved in a stale epoch holds the pass's reference: the resumed run makes the
    same drift pass in the same epoch and yields the same batches."""

    def build():
        return loader_for(SelectiveBackprop(1 / 3, staleness=3, fed_staleness=10))

    def train(loader, batches):
        got = []
        for batch in batches:
            got.append(batch.indices.tolist())
            loader.feedback(batch.indices, measured(batch) * 0.3)
        return got

    full_loader = build()
    full = [b for _ in range(4) for b in train(full_loader, full_loader)]
    loader = build()
    got = train(loader, loader)  # fresh epoch 0
    it = iter(loader)  # stale epoch 1 (the reference is taken as its reports arrive)
    got += train(loader, [next(it) for _ in range(stop)])
    state = loader.state_dict()
    again = build()
    again.load_state_dict(state)
    got += [b for _ in range(3) for b in train(again, again)]
    assert got == full
    assert again.policy.drift_passes == full_loader.policy.drift_passes == 1
    assert [x.selection_forwards > 0 for x in again.stats.epochs] == [True, False, True, False]


def test_the_drift_bound_is_checked_and_reaches_the_default_recipe():
    from sbloader import default_policy

    assert default_policy().policy.drift_bound == 0.5
    assert default_policy(drift_bound=None).policy.drift_bound is None
    assert default_policy(drift_bound=0.75).policy.drift_bound == 0.75
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="drift_bound"):
            SelectiveBackprop(1 / 3, staleness=3, drift_bound=bad)
    assert "drift_bound=0.75" in repr(SelectiveBackprop(1 / 3, staleness=3, drift_bound=0.75))


def test_a_report_outside_the_data_refuses_the_checkpoint_and_the_epoch_keeping_everything():
    """A device-side report is held unchecked (checking it would synchronise): its indices are
    checked when the next epoch starts. Before, an index outside the data was taken out of the
    buffer and then refused (the epoch half begun, the other reports lost), and a checkpoint
    saved meanwhile held it, so every run resumed from that checkpoint failed at the same
    point."""
    policy = SelectiveBackprop(1 / 3, staleness=2)
    loader = loader_for(policy)
    batches = list(loader)
    good = loader.state_dict()
    for batch in batches[:2]:
        loader.feedback(batch.indices, reported(batch.indices))
    held = len(loader._feedback)
    loader._feedback.add(torch.tensor([7, 300]), torch.zeros(2))  # as a CUDA report is held
    with pytest.raises(IndexError, match=r"outside 0\.\.299 \(e\.g\. \[300\]\).*batch\.indices"):
        loader.state_dict()
    with pytest.raises(IndexError, match=r"outside 0\.\.299"):
        next(iter(loader))
    assert len(loader._feedback) == held + 2  # nothing taken
    assert loader.epoch == 1 and loader.stats.current.epoch == 0  # the epoch not begun
    assert policy.store.lookup(batches[0].indices.numpy())[1].max() == 0  # nothing stored
    loader.load_state_dict(good)  # a checkpoint from before loads, the bad report gone
    assert len(loader._feedback) == 0
    assert len(list(loader)) > 0


def test_a_saved_report_outside_the_data_is_refused_at_load_changing_nothing():
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    list(loader)
    state = loader.state_dict()
    bad = {"indices": torch.tensor([3, 301]), "losses": torch.tensor([1.0, 2.0])}
    state["feedback"] = {**state["feedback"], **bad}
    fresh = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    before = fresh.state_dict()
    with pytest.raises(IndexError, match=r"outside 0\.\.299 \(e\.g\. \[301\]\)"):
        fresh.load_state_dict(state)
    after = fresh.state_dict()
    assert after["epoch"] == before["epoch"] == 0 and len(fresh._feedback) == 0


def test_non_finite_reports_are_said_and_do_not_count_as_fed(caplog):
    """A run whose training losses turned NaN reported them; the store keeps each example's
    earlier loss (record skips non-finite ones). Before, nothing was said, and the policy took
    the reports as fed, spacing its selection passes by fed_staleness as if the scores were
    fresh."""

    def run(losses_of):
        policy = SelectiveBackprop(1 / 3, staleness=2, fed_staleness=5)
        loader = loader_for(policy)
        fresh = []
        for _ in range(3):
            for batch in loader:
                loader.feedback(batch.indices, losses_of(batch.indices))
            fresh.append(loader.stats.current.selection_forwards > 0)
        return fresh, policy, loader

    with caplog.at_level("WARNING", logger="sbloader"):
        finite, _, _ = run(reported)
    assert not [r for r in caplog.records if "NaN or infinite" in r.getMessage()]
    assert finite == [True, False, False]  # fed: the next pass is 5 epochs on
    caplog.clear()
    with caplog.at_level("WARNING", logger="sbloader"):
        nan, policy, loader = run(lambda idx: torch.full((len(idx),), float("nan")))
    assert nan == [True, False, True]  # unfed: a pass every 2 epochs, as without reports
    said = [r.getMessage() for r in caplog.records if "NaN or infinite" in r.getMessage()]
    n = loader.stats.epochs[0].examples_yielded  # every report of epoch 0, all NaN
    assert said[0].startswith(f"epoch 0: {n} of {n} training losses") and "diverged" in said[0]
    stored, _ = policy.store.lookup(np.arange(N))
    assert np.isfinite(stored).all()  # the selection passes' losses, kept


def test_a_report_beyond_float32s_range_is_stored_clipped_not_taken_as_non_finite(caplog):
    """The store's loss column is float32: a finite report above its range is stored as its
    largest value, as a selection pass's loss is, not turned into inf on its way to the store
    (which would keep the example's earlier loss, and the loader warn of a diverged run)."""
    policy = SelectiveBackprop(1 / 3, staleness=3)
    loader = loader_for(policy)
    trained = []
    for batch in loader:
        loader.feedback(batch.indices, np.full(len(batch.indices), 1e39))
        trained += batch.indices.tolist()
    with caplog.at_level("WARNING", logger="sbloader"):
        next(iter(loader))  # the reports reach the store
    assert not [r for r in caplog.records if "NaN or infinite" in r.getMessage()]
    stored, epochs = policy.store.lookup(np.array(trained))
    assert (stored == np.finfo(np.float32).max).all() and (epochs == 0).all()


def test_targets_reported_instead_of_losses_are_refused_at_once():
    """An integer report of the right length is almost always the batch's targets: accepted,
    their class numbers became the stored losses the stale epochs decided from, unsaid."""
    loader = loader_for(SelectiveBackprop(1 / 3, staleness=2))
    batch = next(iter(loader))
    _, targets = batch
    for wrong in (targets, targets.numpy(), targets.tolist()):
        with pytest.raises(TypeError, match=r"real per-example losses.*int64.*the targets"):
            loader.feedback(batch.indices, wrong)
    assert len(loader._feedback) == 0
    half = len(targets) // 2
    loader.feedback(batch.indices[:half], targets[:half].float())  # integer values meant: said so
    loader.feedback(batch.indices[half:], torch.ones(len(targets) - half, dtype=torch.float16))
    assert len(loader._feedback) == len(targets)
