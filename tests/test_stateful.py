"""Sources that keep their own state (torchdata's StatefulDataLoader): resumed, not replayed."""

from __future__ import annotations

import io
import time
import warnings

import numpy as np
import pytest
import torch
from conftest import N_CLASSES, EncodedDataset, IndexLoss, checkout_env, run_python
from torch import nn
from torch.utils.data import IterableDataset

import sbloader
from sbloader import SelectiveBackprop, SelectiveLoader
from sbloader.adapt import make_source
from sbloader.stateful import StatefulSource

tdl = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = tdl.StatefulDataLoader
RandomSampler = pytest.importorskip("torchdata.stateful_dataloader.sampler").RandomSampler

N = 120

# torchdata 0.11 calls a deprecated torch function on every iter().
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class ShufflingStream(IterableDataset):
    """Yields ``(x, y, index)`` (x encodes the index) in an order drawn from its own generator
    each epoch. Its ``state_dict`` is what torchdata asks of a stateful dataset: the generator
    at the epoch's start and the position, so a loaded state continues the same order. Replaying
    it from the start draws a new order instead."""

    def __init__(self, n: int = N, dim: int = 6, seed: int = 0) -> None:
        self.n, self.dim = n, dim
        self.gen = torch.Generator().manual_seed(seed)
        self._start = self.gen.get_state()
        self._pos = 0
        self._resume: tuple[list[int], int] | None = None

    def __iter__(self):
        # NOTE: the order is decided when iter() is called, not on the first next(): torchdata
        # calls iter() right after load_state_dict (the resumed pass) and, if the saved pass had
        # ended, once more for the next one.
        if self._resume is not None:
            (order, pos), self._resume = self._resume, None
        else:
            self._start = self.gen.get_state()
            order, pos = torch.randperm(self.n, generator=self.gen).tolist(), 0
        return self._samples(order, pos)

    def _samples(self, order, pos):
        for k in range(pos, self.n):
            self._pos = k + 1
            i = order[k]
            yield torch.full((self.dim,), float(i)), torch.tensor(i % N_CLASSES), i

    def state_dict(self):
        return {"start": self._start.clone(), "pos": self._pos}

    def load_state_dict(self, state):
        self.gen.set_state(state["start"])
        self._start = state["start"].clone()
        order = torch.randperm(self.n, generator=self.gen).tolist()
        self._pos = state["pos"]
        self._resume = (order, self._pos)


def iterable_loader(**kw):
    """SB over a StatefulDataLoader of the shuffling stream; indices in field 2."""
    dl = StatefulDataLoader(ShufflingStream(), batch_size=24)
    return SelectiveLoader(
        dl, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=10, seed=0, index_key=2, **kw
    )


def map_loader(workers=0, **kw):
    """SB over a StatefulDataLoader of a map-style dataset (indices recovered)."""
    ds = EncodedDataset(N)
    sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(3))
    dl = StatefulDataLoader(ds, batch_size=24, sampler=sampler, num_workers=workers)
    return SelectiveLoader(
        dl, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=10, seed=0, **kw
    )


def check_pairing(batch) -> None:
    x, y = batch[0], batch[1]
    assert torch.equal(x[:, 0].long(), batch.indices)
    assert torch.equal(y, batch.indices % N_CLASSES)


def run(loader, epochs: int) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        for b in loader:
            check_pairing(b)
            out.append(b.indices.tolist())
    return out


def checkpoint(state):
    """A save and load through torch's default (weights-only) unpickler."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def test_stateful_loaders_are_stateful_sources():
    src = make_source(StatefulDataLoader(ShufflingStream(), batch_size=24), index_key=2)
    assert isinstance(src, StatefulSource) and src.has_indices() and not src.can_filter()
    src = make_source(StatefulDataLoader(EncodedDataset(N), batch_size=24))
    assert isinstance(src, StatefulSource) and src.has_indices() and src.dataset_size == N


@pytest.mark.parametrize("make", [iterable_loader, map_loader], ids=["iterable", "map"])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("stop", [(0, 3), (1, 5), (1, 0)])
def test_mid_epoch_resume_yields_what_an_uninterrupted_run_does(make, prefetch, stop):
    epochs = 3
    reference = run(make(prefetch=prefetch), epochs)
    # The run to interrupt: full epochs, then `steps` batches of the next one.
    full, steps = stop
    loader = make(prefetch=prefetch)
    before = run(loader, full)
    it = iter(loader)
    for _ in range(steps):
        b = next(it)
        check_pairing(b)
        before.append(b.indices.tolist())
    if steps:
        assert it.position > 0
    state = checkpoint(loader.state_dict())
    del it, loader  # the interrupted process ends

    resumed = make(prefetch=prefetch)  # a fresh process: a new dataset, loader and model
    resumed.load_state_dict(state)
    after = run(resumed, epochs - full)
    assert before + after == reference
    assert resumed.epoch == epochs


@pytest.mark.parametrize("make", [iterable_loader, map_loader], ids=["iterable", "map"])
def test_a_resumed_run_saved_and_resumed_again_mid_epoch_yields_the_uninterrupted_run(make):
    """The source's position counts the source batches of the whole epoch, those before the
    checkpoint a run resumed from too: a state saved in the resumed epoch resumes again."""
    reference = run(make(), 2)
    loader, got = make(), []
    for _ in range(2):  # two interruptions in epoch 0
        it = iter(loader)
        got += [next(it).indices.tolist() for _ in range(2)]
        state = checkpoint(loader.state_dict())
        del it
        loader = make()
        loader.load_state_dict(state)
    got += run(loader, 2)
    assert got == reference and loader.epoch == 2


def test_worker_processes_resume_exactly_too():
    """With workers the loader prefetches by default, and torchdata snapshots its workers."""
    reference = run(map_loader(workers=2), 2)
    loader = map_loader(workers=2)
    assert loader.prefetch == 1
    before = run(loader, 1)
    it = iter(loader)
    before += [next(it).indices.tolist() for _ in range(3)]
    state = checkpoint(loader.state_dict())
    it.close()
    del it, loader
    resumed = map_loader(workers=2)
    resumed.load_state_dict(state)
    assert before + run(resumed, 1) == reference


def test_a_source_state_of_a_pass_left_part_way_resumes_that_pass_only_mid_epoch():
    """The source's own state after a pass was left part-way still describes that pass: loaded
    mid-epoch it continues it; loaded at an epoch boundary the next pass is a new one."""
    loader = iterable_loader()
    it = iter(loader)
    first = next(it).indices.tolist()
    it.close()  # the epoch is abandoned part-way (as after `break`)
    state = loader.source.state_dict()
    assert state["abandoned"] and not state["finished"]
    rest = iterable_loader().source
    rest.load_state_dict(state, mid_epoch=True)
    resumed = [int(i) for _, idx in rest.epoch(skip=state["position"]) for i in idx]
    boundary = iterable_loader().source
    boundary.load_state_dict(state, mid_epoch=False)
    new_pass = [int(i) for _, idx in boundary.epoch() for i in idx]
    assert sorted(new_pass) == list(range(N))  # a whole pass, not the abandoned one's rest
    assert len(resumed) == N - 24 and not set(resumed) & set(first)
    stream = ShufflingStream()
    orders = [[int(s[2]) for s in stream] for _ in range(2)]
    assert new_pass == orders[1]  # the stream's second order, as the saved run's next pass


@pytest.mark.parametrize(
    "make",
    [iterable_loader, map_loader, lambda **kw: map_loader(workers=2, **kw)],
    ids=["iterable", "map", "map-workers"],
)
@pytest.mark.parametrize("prefetch", [0, 1])
def test_an_epoch_ended_for_good_resumes_with_a_new_pass(make, prefetch):
    """close(resumable=False) (Lightning's limit_train_batches, max_steps), then a checkpoint
    before the next epoch: the resumed run's next epoch is the uninterrupted run's, a new pass
    over the data, not the rest of the pass left part-way."""

    def cut(loader):
        it = iter(loader)
        got = [next(it).indices.tolist() for _ in range(2)]
        it.close(resumable=False)
        return got

    reference = make(prefetch=prefetch)
    head = cut(reference)
    reference_rest = run(reference, 2)
    loader = make(prefetch=prefetch)
    assert cut(loader) == head
    state = checkpoint(loader.state_dict())
    del loader
    resumed = make(prefetch=prefetch)
    resumed.load_state_dict(state)
    assert run(resumed, 2) == reference_rest


def test_the_saved_state_is_that_of_the_last_consumed_batch_not_the_ones_fetched_ahead():
    loader = iterable_loader(prefetch=3)
    it = iter(loader)
    next(it)
    consumed = it.position
    dataset = loader.source.loader.dataset
    deadline = time.monotonic() + 60  # the thread fetches ahead of the consumer
    while dataset._pos <= consumed * 24 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dataset._pos > consumed * 24
    state = loader.state_dict()
    assert state["source"]["position"] == consumed
    assert state["source"]["loader"]["dataset_state"]["pos"] == consumed * 24


def test_replaying_the_stream_would_diverge():
    """The issue's failing row, kept as a control: the stream's epochs differ, so a resume that
    replays it from the start of the epoch (without its state) yields other examples."""
    stream = ShufflingStream()
    first, second = [[int(s[2]) for s in stream] for _ in range(2)]
    assert first != second


def test_stale_sb_keys_its_store_by_the_streams_indices():
    """Stale-SB's per-example store over a stateful iterable source: each stored loss is the
    loss of the example whose index the stream gave."""
    dl = StatefulDataLoader(ShufflingStream(), batch_size=24)
    source = sbloader.StatefulSource(dl, index_key=2, dataset_size=N)
    policy = SelectiveBackprop(1 / 3, staleness=2)
    loader = SelectiveLoader(source, IndexLoss(), policy=policy, batch_size=10, seed=0)
    run(loader, 1)
    x = torch.stack([EncodedDataset(N)[i][0] for i in range(N)])
    with torch.no_grad():
        expected = nn.functional.cross_entropy(
            IndexLoss()(x), torch.arange(N) % N_CLASSES, reduction="none"
        ).numpy()
    losses, epochs = policy.store.lookup(np.arange(N))
    np.testing.assert_array_equal(losses, expected)
    assert (epochs == 0).all()
    run(loader, 1)  # a stale epoch decides from the stored losses: no selection forward
    assert loader.stats.epochs[1].selection_forwards == 0


def test_drop_index_leaves_the_index_key_field_out_of_a_stateful_loaders_batches():
    """``drop_index=True`` over a StatefulDataLoader read with ``index_key=``, as over any
    iterable: ``for x, y in loader`` works and the indices stay in ``batch.indices``. It was
    refused, saying the source's batches had no index field and to pass the ``index_key=``
    that was passed."""
    loader = iterable_loader(drop_index=True, dataset_size=N)
    seen = []
    for batch in loader:
        x, _y = batch  # (two fields: the index field left out)
        assert torch.equal(x[:, 0].long(), batch.indices)
        seen += batch.indices.tolist()
    assert len(seen) == len(set(seen)) > 0


@pytest.mark.parametrize("staleness", [1, 2], ids=["sb", "stale-sb"])
def test_indices_beyond_dataset_size_are_refused_naming_it(staleness):
    """As over any iterable: a stateful iterable's indices must lie below ``dataset_size``. They
    went unchecked here (plain SB trained on them silently; Stale-SB's store failed naming
    ``len(dataset)``, which an iterable has not)."""
    dl = StatefulDataLoader(ShufflingStream(), batch_size=24)  # indices 0 .. N - 1
    policy = SelectiveBackprop(1 / 3, staleness=staleness)
    loader = SelectiveLoader(dl, IndexLoss(), policy=policy, index_key=2, dataset_size=N // 2)
    with pytest.raises(ValueError, match=r"outside \[0, dataset_size=60\); pass dataset_size="):
        run(loader, 1)


def test_a_state_of_another_position_is_refused():
    loader = iterable_loader()
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    state["source"] = dict(state["source"], position=state["source"]["position"] + 1)
    resumed = iterable_loader()
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="can resume at source batch"):
        list(resumed)


def test_a_mid_epoch_state_holding_a_finished_sources_state_is_refused():
    """A hand-mixed checkpoint: the SelectiveLoader's state of a batch mid-epoch with the source's
    state of that epoch's end (saved after the pass). Resuming it would begin the next pass
    where the loader expects the rest of this one; it is refused as the epoch resumes, naming
    the fix (a source state of an ended pass alone is no mix: see the next test)."""
    loader = iterable_loader()
    it = iter(loader)
    next(it)
    mid = loader.state_dict()
    list(it)
    end = loader.state_dict()
    assert end["source"]["finished"] and not mid["source"]["finished"]
    mixed = dict(mid, source=end["source"])
    mixed_loader = iterable_loader()
    mixed_loader.load_state_dict(mixed)
    with pytest.raises(ValueError, match="load the SelectiveLoader's state and the source's"):
        list(mixed_loader)
    resumed = iterable_loader()
    resumed.load_state_dict(mid)  # (the state as saved still resumes)
    assert run(resumed, 1)


@pytest.mark.parametrize("make", [iterable_loader, map_loader], ids=["iterable", "map-style"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_step_checkpoint_after_an_epochs_short_last_batch_resumes_exactly(make, prefetch):
    """With ``remainder="short"`` the epoch's short last batch is handed out after the pass's
    last source batch: a state taken after it (a step checkpoint, inside the loop) holds the
    source's state of an ended pass in a running epoch. It was refused when loaded ("ended its
    epoch, but the SelectiveLoader state resumes one"), a checkpoint saved by the run itself."""
    whole = make(remainder="short", prefetch=prefetch)
    run(whole, 1)
    state = None
    for batch in whole:
        if len(batch.indices) < 10:  # the short last batch
            state = checkpoint(whole.state_dict())
    assert state is not None and state["active"] and state["source"]["finished"]
    expected = run(whole, 2)
    resumed = make(remainder="short", prefetch=prefetch)
    resumed.load_state_dict(state)
    assert run(resumed, 1) == []  # the rest of the saved epoch: nothing
    assert run(resumed, 2) == expected
    assert resumed.epoch == whole.epoch


def test_a_refused_state_leaves_a_running_epoch_to_go_on_where_it_stopped():
    """A state refused while an epoch runs: the next iter(loader) goes on with that epoch where
    it stopped. The loader put its source's own state back as at an epoch boundary, and the
    resumed epoch raised at once ("can resume at source batch 0 ..., but the loader asked for
    batch 2")."""
    expected = run(map_loader(), 2)
    state = map_loader(keep_logits=True).state_dict()  # another run's
    loader = map_loader()
    it = iter(loader)
    head = [next(it).indices.tolist() for _ in range(2)]
    with pytest.raises(ValueError, match="has keep_logits=True"):
        loader.load_state_dict(state)
    assert head + run(loader, 2) == expected


def test_accelerates_prepared_loader_is_not_taken_for_a_stateful_one():
    """Accelerate's prepared DataLoader has a state_dict() too (and reports its wrapped loader's
    class); it stays a DataLoaderSource."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    # What Accelerator.prepare returns on one process, built without an Accelerator (whose state
    # is process-wide).
    prepared = data_loader.DataLoaderShard(EncodedDataset(N), batch_size=24)
    assert isinstance(prepared, torch.utils.data.DataLoader) and hasattr(prepared, "state_dict")
    assert isinstance(make_source(prepared), sbloader.DataLoaderSource)


def test_a_loader_without_state_is_refused():
    with pytest.raises(TypeError, match="state_dict"):
        StatefulSource([[1, 2]])


@pytest.mark.parametrize("make", [iterable_loader, map_loader], ids=["iterable", "map"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_checkpoint_the_run_went_past_resumes_exactly(make, prefetch):
    """Crash recovery: the state saved mid-epoch is kept while the run goes on into the next
    epoch (the source's own state moves on), then the process dies; resumed from that state a
    fresh loader yields exactly the rest of the uninterrupted run."""
    epochs = 3
    reference = run(make(prefetch=prefetch), epochs)
    loader = make(prefetch=prefetch)
    before = run(loader, 1)
    it = iter(loader)
    before += [next(it).indices.tolist() for _ in range(2)]
    state = checkpoint(loader.state_dict())
    for _ in it:  # the run goes on past the checkpoint, then dies
        pass
    run(loader, 1)
    del it, loader

    resumed = make(prefetch=prefetch)
    resumed.load_state_dict(state)
    assert before + run(resumed, epochs - 1) == reference


# ---------------------------------------------------------------------- what a state belongs to
class _Pairs(torch.utils.data.Dataset):
    """Dict examples with two candidate input fields and two candidate target fields."""

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"a": self.x[i], "b": self.x[i].flip(0), "y": self.y[i], "z": 1 - self.y[i]}


def _pairs_loader(**kw) -> SelectiveLoader:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 2))
    dl = torch.utils.data.DataLoader(
        _Pairs(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    kw.setdefault("input_key", "a")
    kw.setdefault("target_key", "y")
    return SelectiveLoader(
        dl, model, policy=SelectiveBackprop(1 / 3), batch_size=8, autocast=None, **kw
    )


def _mid_epoch_state(loader: SelectiveLoader) -> dict:
    it = iter(loader)
    next(it)
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.filterwarnings("ignore:the source's dict batches have tensor fields")
@pytest.mark.parametrize(
    "other, match",
    [
        (dict(input_key="b"), r"scored input_key='a', but this loader has input_key='b'"),
        (dict(target_key="z"), r"scored target_key='y', but this loader has target_key='z'"),
        (dict(eval_selection=False), r"eval_selection=True, but this SelectiveLoader has "),
    ],
)
def test_a_state_is_refused_by_a_loader_scoring_other_fields_or_in_another_mode(other, match):
    """The fields the selection passes score and the mode they run in decide what is selected:
    a state saved with others is refused naming the option (it loaded silently, and the resumed
    loader scored the saved run's fields while reporting its own)."""
    state = _mid_epoch_state(_pairs_loader())
    loader = _pairs_loader(**other)
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    # the same configuration resumes
    _pairs_loader().load_state_dict(state)


@pytest.mark.filterwarnings("ignore:the source's dict batches have tensor fields")
def test_a_resumed_state_checks_the_metadata_key_against_the_saved_fields():
    """A metadata_key that is a field of the source's batches is refused by a fresh loader on
    its first batch, and by a resumed one when the state is loaded (it overwrote the targets)."""
    with pytest.raises(ValueError, match="metadata_key='y' is already a key"):
        next(iter(_pairs_loader(metadata_key="y")))
    state = _mid_epoch_state(_pairs_loader())
    with pytest.raises(ValueError, match="metadata_key='y' is already a key"):
        _pairs_loader(metadata_key="y").load_state_dict(state)


@pytest.mark.filterwarnings("ignore:the source's dict batches have tensor fields")
def test_a_state_saved_with_another_loss_fn_warns_naming_it():
    """loss_fn changes what is selected; it is a speed-like option (allowed, warned of), and
    described by its settings, which its repr omits (label smoothing)."""
    state = _mid_epoch_state(_pairs_loader(loss_fn=nn.CrossEntropyLoss(reduction="none")))
    smoothed = _pairs_loader(loss_fn=nn.CrossEntropyLoss(reduction="none", label_smoothing=0.5))
    with pytest.warns(UserWarning, match=r"loss_fn=.*label_smoothing=0\.0.*label_smoothing=0\.5"):
        smoothed.load_state_dict(state)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _pairs_loader(loss_fn=nn.CrossEntropyLoss(reduction="none")).load_state_dict(state)


@pytest.mark.filterwarnings("ignore:the source's dict batches have tensor fields")
def test_a_state_ranked_against_every_ranks_losses_is_refused_by_a_local_cdf_loader():
    """cdf ('local' or 'global') decides what each rank ranks its losses against: a state that
    says it was saved with the other is refused naming cdf (it resumed silently under DDP)."""
    from sbloader._loader_state import K_IDENTITY

    state = _mid_epoch_state(_pairs_loader())
    assert state[K_IDENTITY]["cdf"] == "local"
    state[K_IDENTITY]["cdf"] = "global"
    with pytest.raises(ValueError, match=r"cdf='global', but this SelectiveLoader has cdf='local'"):
        _pairs_loader().load_state_dict(state)


def test_a_state_saved_with_a_negative_field_position_resumes_with_the_same_one():
    """target_key=-1 is stored as the last field's position: the run's own checkpoint resumes
    (it was refused, comparing -1 with 1), and another position is still refused."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))

    def build(target_key):
        torch.manual_seed(0)
        return SelectiveLoader(
            DataLoader(data, batch_size=8),
            nn.Linear(4, 3),
            policy=sbloader.RandomBackprop(0.5),
            batch_size=8,
            input_key=0,
            target_key=target_key,
        )

    saved = build(-1)
    list(saved)
    state = saved.state_dict()
    build(-1).load_state_dict(state)
    build(1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"scored input_key=0, but this loader has input_key=1"):
        SelectiveLoader(
            DataLoader(data, batch_size=8),
            nn.Linear(4, 3),
            policy=sbloader.RandomBackprop(0.5),
            batch_size=8,
            input_key=1,
            target_key=0,
        ).load_state_dict(state)


def test_a_loss_fn_is_described_alike_in_every_process_and_large_tensors_are_not_hashed():
    """A set-valued setting is described in sorted order (a set of strings iterates in the
    order of the process's hash seed, so every resume warned of another loss_fn), and a loss
    module's large tensors by shape and dtype alone (hashed at every state_dict())."""

    code = (
        "import torch; from sbloader._loader_state import describe_callable as d\n"
        "class L(torch.nn.Module):\n"
        "    def __init__(s):\n"
        "        super().__init__(); s.names = {'background', 'void', 'other', 'unlabeled'}\n"
        "print(d(L()))"
    )
    outs = {
        run_python(
            code, timeout=120, env={**checkout_env(), "PYTHONHASHSEED": str(seed)}, check=True
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(outs) == 1 and "'background', 'other', 'unlabeled', 'void'" in outs.pop()
    from sbloader._loader_state import describe_callable

    teacher = nn.Linear(1000, 1000)
    described = describe_callable(teacher)
    assert "weight=tensor(1000, 1000):torch.float32" in described and "#" in described  # bias


@pytest.mark.parametrize(("saved", "loading"), [(0, 2), (2, 0)])
def test_a_state_saved_with_other_num_workers_is_refused_naming_them(saved, loading):
    """torchdata saves each worker's share of the data (and another form without workers): a
    state saved with another num_workers loaded, and the next epoch failed deep inside
    torchdata (an AssertionError naming '_snapshot') or resumed other shares. It is refused at
    load_state_dict, naming num_workers (nothing started: the loader is as it was)."""
    loader = map_loader(workers=saved)
    it = iter(loader)
    next(it)
    state = checkpoint(loader.state_dict())
    it.close()
    with pytest.raises(ValueError, match=f"num_workers={saved}, but this loader has num_worke"):
        map_loader(workers=loading).load_state_dict(state)


def test_a_state_of_another_kind_of_source_is_refused_naming_both():
    """A StatefulDataLoader's state loaded into a loader over a plain DataLoader failed with a
    bare KeyError ('generators'), and a plain DataLoader's into a StatefulDataLoader's with a
    version error advising another sbloader; both are refused naming the kinds of source."""
    stateful = checkpoint(map_loader().state_dict())
    ds = EncodedDataset(N)
    sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(3))
    plain = SelectiveLoader(
        torch.utils.data.DataLoader(ds, batch_size=24, sampler=sampler),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=10,
        seed=0,
    )
    with pytest.raises(ValueError, match=r"source='StatefulSource'.*source='DataLoaderSource'"):
        plain.load_state_dict(stateful)
    with pytest.raises(ValueError, match=r"source='DataLoaderSource'.*source='StatefulSource'"):
        map_loader().load_state_dict(checkpoint(plain.state_dict()))


def _shuffled_loader(shared: bool) -> SelectiveLoader:
    """SB over a StatefulDataLoader of a map-style dataset that shuffles with generator g:
    ``shuffle=True, generator=g`` (its sampler shares the loader's g) or the fix the warning
    names, ``sampler=RandomSampler(ds, generator=g)``."""
    ds = EncodedDataset(N)
    g = torch.Generator().manual_seed(3)
    dl = (
        StatefulDataLoader(ds, batch_size=24, shuffle=True, generator=g)
        if shared
        else StatefulDataLoader(ds, batch_size=24, sampler=RandomSampler(ds, generator=g))
    )
    return SelectiveLoader(dl, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=10, seed=0)


def _resumed_after_one_batch(make) -> list[list[int]]:
    loader = make()
    it = iter(loader)
    first = next(it).indices.tolist()
    state = checkpoint(loader.state_dict())
    del it, loader
    resumed = make()
    resumed.load_state_dict(state)
    return [first, *run(resumed, 3)]


def test_a_sampler_sharing_the_stateful_loaders_generator_is_warned_of_and_the_fix_resumes():
    """torchdata 0.11's StatefulDataLoader(shuffle=True, generator=g) draws the shuffle and
    each epoch's base seed from one generator and restores only the shuffle's draws, so a run
    resumed from any of its states came in another order from the epoch after the resumed one,
    with nothing said. It is warned of when the loader is built, naming the sampler with its
    own generator, which resumes exactly (the shared one does not: the warning is no
    false alarm)."""
    with pytest.warns(UserWarning, match=r"sampler draws from the loader's own generator"):
        _shuffled_loader(shared=True)
    with pytest.warns(UserWarning, match=r"sampler=torchdata\.stateful_dataloader\.sampler\.Ran"):
        make_source(
            StatefulDataLoader(EncodedDataset(N), shuffle=True, generator=torch.Generator())
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        shared_reference = run(_shuffled_loader(shared=True), 3)
        shared_resumed = _resumed_after_one_batch(lambda: _shuffled_loader(shared=True))
    assert shared_resumed[: len(shared_reference)] != shared_reference

    with warnings.catch_warnings():
        warnings.filterwarnings("error", "the StatefulDataLoader's sampler")  # (the fix: unsaid)
        reference = run(_shuffled_loader(shared=False), 3)
        resumed = _resumed_after_one_batch(lambda: _shuffled_loader(shared=False))
    assert resumed[: len(reference)] == reference
    # (without a generator the sampler draws one of its own: not warned of either)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "the StatefulDataLoader's sampler")
        make_source(StatefulDataLoader(EncodedDataset(N), batch_size=24, shuffle=True))
