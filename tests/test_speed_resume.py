"""The speed options and resuming: a run with any combination of them is deterministic per seed
and resumes exactly (within what the README documents), and a state saved with other speed
options is refused or loads with a warning naming them, as documented.

The harness (``speed_harness``) trains a small CNN with a real optimizer step on every batch, so
that every selection depends on the steps before it."""

from __future__ import annotations

import random
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from speed_harness import (
    CUTS,
    Config,
    build,
    first_difference,
    run,
    same,
    sample,
    step,
    through_torch_save,
)

import sbloader

pytestmark = [
    # Plain SB with overlap is warned about (test_overlap); the combinations here use it anyway.
    pytest.mark.filterwarnings("ignore:overlap_selection=True with"),
    pytest.mark.usefixtures("one_torch_thread"),  # (conftest)
]


def saved_after(cfg: Config, batches: int) -> dict[str, Any]:
    """The loader's state after ``batches`` trained batches (mid-epoch)."""
    _, model, opt, loader = build(cfg)
    done = 0
    while True:
        for batch in loader:
            step(cfg, model, opt, loader, batch)
            done += 1
            if done == batches:
                return through_torch_save(loader.state_dict())


def load_warnings(cfg: Config, state: dict[str, Any]) -> list[str]:
    """Load ``state`` into a loader built from ``cfg``; the speed warnings it gave."""
    _, _, _, loader = build(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state)
    assert loader.epoch == state["epoch"]  # loaded
    return [str(w.message) for w in caught if "loaded SelectiveLoader state" in str(w.message)]


QUANTIZED = sbloader.QuantizedSelection(refresh_every=2)


@pytest.mark.parametrize(
    ("saved", "loading", "was", "now"),
    [
        ({}, {"overlap": True}, "overlap_selection=False", "overlap_selection=True"),
        ({"overlap": True}, {}, "overlap_selection=True", "overlap_selection=False"),
        ({}, {"scale": 0.5}, "selection_scale=None", "selection_scale=0.5"),
        ({"autocast": None}, {"autocast": torch.bfloat16}, "autocast=None", "autocast=torch.bf"),
        ({"autocast": torch.bfloat16}, {"autocast": None}, "autocast=torch.bf", "autocast=None"),
        ({}, {"channels_last": True}, "memory_format=None", "memory_format=torch.channels_last"),
        ({}, {"compile": True}, "compile_selection=False", "compile_selection={'backend'"),
        ({}, {"selection_batch_size": 5}, "selection_batch_size=None", "selection_batch_size=5"),
        ({}, {"selector": True}, "selector=None", "selector=Sequential"),
        (
            {"quantize": True},
            {"quantize": True, "extra": {"quantize": QUANTIZED}},
            "quantize_selection=QuantizedSelection(refresh_examples=16384",
            "quantize_selection=QuantizedSelection(refresh_examples=None, refresh_every=2",
        ),
    ],
    ids=[
        "overlap",
        "no-overlap",
        "scale",
        "bf16",
        "float32",
        "channels_last",
        "compile",
        "chunks",
        "selector",
        "int8-settings",
    ],
)
def test_a_state_saved_with_other_speed_options_loads_with_a_warning_naming_them(
    saved, loading, was, now
):
    """Documented as allowed (a run resumed on another machine may change them), but not
    silently: loaded without a word, the resumed run selected otherwise than the saved run
    would have."""
    base = Config(policy="sb", autocast=None)
    state = saved_after(replace(base, **saved), 5)
    (message,) = load_warnings(replace(base, **loading), state)
    assert f"saved with {was}" in message and f"this loader has {now}" in message
    assert "to resume it exactly" in message


@pytest.mark.parametrize(
    ("saved", "loading"),
    [
        ({}, {}),
        ({"overlap": True, "scale": 0.5, "channels_last": True}, {}),  # all of them, ...
        ({}, {"prefetch": 1}),  # changes no selection
        ({"autocast": torch.bfloat16}, {"autocast": "auto"}),  # "auto" adopts the saved one
        ({"autocast": None}, {"autocast": "auto"}),
    ],
    ids=["same", "same-many", "prefetch", "auto-adopts-bf16", "auto-adopts-float32"],
)
def test_no_speed_warning_where_the_resumed_run_selects_as_the_saved_one(saved, loading):
    base = Config(policy="sb", autocast=None)
    state = saved_after(replace(base, **saved), 5)
    assert not load_warnings(replace(base, **{**saved, **loading}), state)


def test_a_state_saved_before_speed_options_were_recorded_loads_without_a_warning():
    state = saved_after(Config(policy="sb"), 5)
    del state["speed"]
    assert not load_warnings(Config(policy="sb", overlap=True), state)


# ---------------------------------------------------------------------- the combinations
# Hand-picked so that every option runs at least once in the fast test, each with others.
COVERING = [
    Config(policy="sb", overlap=True, decisions="device", prefetch=1, selection_batch_size=5),
    Config(policy="stale", quantize=True, scale=0.5, feedback=True, store=True),
    Config(policy="phased", prefix=True, keep_logits=True, autocast=torch.bfloat16, subset=True),
    Config(policy="sb", channels_last=True, compile=True, keep_logits=True, autocast=None),
    Config(policy="default-planned", overlap=True, feedback=True, store=True, channels_last=True),
    Config(policy="default", overlap=True, batches_per_epoch="expected", scale=0.5, prefetch=1),
    Config(policy="phased", quantize=True, batches_per_epoch=3, feedback=True, prefetch=1),
    Config(policy="stale", prefix=True, cache=True, feedback=True, selection_batch_size=5),
    Config(policy="default", prefix=True, cache=True, save_cache=True, store=True, feedback=True),
    Config(policy="sb", selector=True, overlap=True, workers=1, keep_logits=True),
    Config(policy="default", selector=True, quantize=True, feedback=True),
]


def check(cfg: Config, rng: random.Random, folder: Path) -> None:
    """(a) Two runs of one seed yield the same batches and parameters (the second in the first's
    ``store_path`` folder: a run that loads no state starts with an empty store); (b) a run
    interrupted at random points (1-3 checkpoints of random kinds), rebuilt and resumed each
    time, yields exactly the rest of the uninterrupted run and ends with the same parameters.

    With ``batches_per_epoch`` a training epoch left with ``break`` ends there (the next one has
    its full count): the reference then leaves its loop at the same points without resuming.
    With ``cache_features`` a resume is documented as not bit-exact (the cache refills): the
    resumed run is compared as far as its features are the same, and there they must be
    within float32 rounding of the uninterrupted run's; with ``save_feature_cache`` too it is
    exact."""
    first = run(cfg, folder=folder / "store")
    again = run(cfg, folder=folder / "store")
    deterministic = same(first, again)
    assert deterministic, f"not deterministic: {first_difference(first, again)}"
    n = len(first.batches)
    assert n > 0
    # NOTE: each cut at its own batch count, and those taken after a batch is trained
    # ("in-loop", "after-break") after the first: the first cut always happens (checked below).
    ks = rng.sample(range(n), min(n, rng.choice([1, 1, 2, 3])))
    hows = [rng.choice(CUTS) for _ in ks]
    cuts = tuple(
        (max(k, 1) if how in ("in-loop", "after-break", "crash") else k, how)
        for k, how in zip(ks, hows)
    )
    reference = first
    if cfg.batches_per_epoch is not None:
        reference = run(cfg, cuts, folder=folder / "reference", resuming=False)
    resumed = run(cfg, cuts, folder=folder / "resumed")
    assert resumed.resumes >= 1, f"{cuts}: no cut resumed the run"
    if not cfg.cache or cfg.save_cache:
        exact = same(reference, resumed)
        assert exact, f"{cuts}: {first_difference(reference, resumed)}"
        return
    features = 5  # the position of the features in a batch's record
    for ours, theirs in zip(resumed.batches, reference.batches):
        if ours[features] != theirs[features]:
            a, b = (
                torch.frombuffer(bytearray(x[features]), dtype=torch.float32)
                for x in (ours, theirs)
            )
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), cuts
            assert ours[0] == theirs[0]  # the same examples, their features in the last bits
            break
        assert ours == theirs, cuts
    else:  # no feature differed: the whole run is the uninterrupted one's
        assert len(resumed.batches) == len(reference.batches), cuts
        assert all(torch.equal(x, y) for x, y in zip(resumed.params, reference.params)), cuts


@pytest.mark.parametrize("cfg", COVERING, ids=[f"covering-{i}" for i in range(len(COVERING))])
def test_every_speed_option_is_deterministic_and_resumes_exactly(cfg, tmp_path):
    check(cfg, random.Random(str(cfg)), tmp_path)


@pytest.mark.parametrize("cfg", COVERING, ids=[f"covering-{i}" for i in range(len(COVERING))])
def test_every_speed_option_recovers_exactly_from_a_checkpoint_the_run_went_past(cfg, tmp_path):
    """Crash recovery: checkpointed after 5 batches, the run goes on for ``CRASH_AFTER`` more
    (a memory-mapped store, the loss window, the pending rows and the model move on), dies, and
    resumed from that checkpoint it yields exactly the uninterrupted run's batches (with
    ``cache_features``, as far as its features are the same; see :func:`check`)."""
    reference = run(cfg, folder=tmp_path / "reference")
    resumed = run(cfg, ((5, "crash"),), folder=tmp_path / "resumed")
    assert resumed.resumes == 1
    if not cfg.cache or cfg.save_cache:
        exact = same(reference, resumed)
        assert exact, first_difference(reference, resumed)
        return
    assert len(resumed.batches) == len(reference.batches)
    assert resumed.batches[:5] == reference.batches[:5]


@pytest.mark.parametrize("k", range(12))
def test_random_combinations_are_deterministic_and_resume_exactly(k, tmp_path):
    """A sample of the combinations (``speed_harness.sample(random.Random(k))``)."""
    rng = random.Random(k)
    check(sample(rng), rng, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("k", range(12, 400))
def test_many_random_combinations_are_deterministic_and_resume_exactly(k, tmp_path):
    rng = random.Random(k)
    check(sample(rng), rng, tmp_path)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("policy", ["ramp", "stale"])
def test_what_a_dataloaders_workers_draw_ahead_is_counted_when_handed_out(policy, prefetch):
    """A DataLoader with worker processes draws batches from its sampler ahead of handing them
    out, and the examples it filters out there (outside ``subset``, rejected in Stale-SB's stale
    epochs) were counted as they were drawn: a run resumed mid-epoch (which replays the batches
    consumed, uncounted) counted the batches drawn ahead twice, its ``excluded`` and
    ``prefiltered`` too high and its ``loader.progress`` ahead, and with ``ramp_epochs``, whose
    P follows the progress, it then selected otherwise. Counted as each batch is handed out,
    a run with workers counts, progresses and selects as one without, and resumes exactly."""
    plain = run(Config(policy=policy, subset=True, prefetch=prefetch))
    workers = Config(policy=policy, subset=True, prefetch=prefetch, workers=1)
    for cuts in ((), ((3, "in-loop"), (9, "after-break"), (14, "unconsumed"))):
        got = run(workers, cuts)
        alike = same(got, plain)
        assert alike, f"{cuts}: {first_difference(got, plain)}"


def _backend() -> Any:
    """A torch.compile backend, a new function object on each call (as in another process)."""

    def backend(gm: Any, example_inputs: Any) -> Any:
        return gm.forward

    return backend


class _Backend:
    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        return gm.forward


@pytest.mark.parametrize("make", [_backend, _Backend], ids=["function", "callable-object"])
def test_no_speed_warning_for_a_compile_backend_given_as_a_callable(make):
    """compile_selection={"backend": fn} was recorded as repr(fn), which names the function by
    its address: the same options warned on every resume in another process (here: another
    function object of the same name). Compared by name, they load silently; another backend
    still warns."""
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))

    def loader(backend: Any) -> sbloader.SelectiveLoader:
        return sbloader.SelectiveLoader(
            torch.utils.data.DataLoader(data, batch_size=8),
            torch.nn.Linear(4, 2),
            batch_size=8,
            compile_selection={"backend": backend},
        )

    saved = loader(make())  # (kept alive: a freed function's address may be reused)
    state = saved.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader(make()).load_state_dict(state)
    with pytest.warns(UserWarning, match="compile_selection="):
        loader("eager").load_state_dict(state)


class _IndexedRows(torch.utils.data.Dataset):
    """40 dict rows with their own index in field ``"i"`` (read with ``index_key="i"``)."""

    def __init__(self) -> None:
        self.x, self.y = torch.randn(40, 4), torch.randint(0, 2, (40,))

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "i": i}


def _workers_loader(
    workers: int, persistent: bool, shuffle: bool = True, index_key: bool = False
) -> Any:
    """A loader over 40 examples in source batches of 8, workers kept between epochs or not;
    with ``index_key``, dict rows carrying their own index in field ``"i"``, the DataLoader
    read as it is (``index_key="i"``)."""
    if index_key:
        data: Any = _IndexedRows()
        fields: dict[str, Any] = dict(input_key="x", target_key="y", index_key="i")
    else:
        data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
        fields = {}
    source = torch.utils.data.DataLoader(
        data,
        batch_size=8,
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(1),
        num_workers=workers,
        persistent_workers=persistent,
    )
    return sbloader.SelectiveLoader(
        source, torch.nn.Linear(4, 2), policy=sbloader.Traditional(), seed=0, **fields
    )


@pytest.mark.parametrize(
    ("saved", "loading"),
    [((2, True), (0, False)), ((2, True), (2, False)), ((0, False), (2, True))],
    ids=["persistent-to-none", "persistent-to-workers", "none-to-persistent"],
)
def test_a_state_saved_with_other_persistent_workers_is_refused_naming_them(saved, loading):
    """A DataLoader with persistent workers draws their base seed from its generator once in the
    run, one without them every epoch, from the generator that also shuffles. A state saved
    with one loaded into the other (e.g. resumed with num_workers=0 to debug) went on silently
    in another order from the next epoch on; it is refused, naming persistent_workers."""

    def saved_state(shuffle: bool) -> dict[str, Any]:
        loader, done = _workers_loader(*saved, shuffle=shuffle), 0
        while done < 7:  # the first epoch's 5 batches and 2 of the second's
            for _ in loader:
                done += 1
                if done == 7:
                    break
        return loader.state_dict()

    with pytest.raises(ValueError, match="persistent_workers"):
        _workers_loader(*loading).load_state_dict(saved_state(shuffle=True))
    # Not shuffling, the base seed draws no order: the state loads.
    _workers_loader(*loading, shuffle=False).load_state_dict(saved_state(shuffle=False))


@pytest.mark.parametrize(
    ("saved", "loading"),
    [((2, False), (2, True)), ((2, True), (0, False))],
    ids=["workers-to-persistent", "persistent-to-none"],
)
def test_an_index_key_state_saved_with_other_persistent_workers_is_refused_naming_them(
    saved, loading
):
    """A DataLoader read through index_key= (iterated as it is) draws its workers' base seed
    from the generator that shuffles once in a run with persistent workers and every epoch
    without: a state saved with one loaded into the other went on silently in another order
    from the next epoch on (only DataLoader sources were checked); it is refused, naming
    persistent_workers. The same workers resume."""
    loader = _workers_loader(*saved, index_key=True)
    for _ in loader:
        pass
    state = loader.state_dict()
    with pytest.raises(ValueError, match="persistent_workers"):
        _workers_loader(*loading, index_key=True).load_state_dict(state)
    _workers_loader(*saved, index_key=True).load_state_dict(state)


class _Stream(torch.utils.data.IterableDataset):
    """24 dict rows with their own index, each worker yielding its share."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, 24, step):
            yield {"x": torch.full((4,), float(i)), "y": i % 2, "i": i}


@pytest.mark.parametrize("stop", [None, 2], ids=["epoch-end", "mid-epoch"])
def test_an_iterable_dataset_state_saved_with_other_num_workers_is_refused_naming_them(stop):
    """An IterableDataset read by workers yields one stream per worker, whose batches the
    DataLoader hands out in turn: with another num_workers every batch holds other examples.
    Such a state loaded silently (a mid-epoch one skipped other batches than the saved run
    consumed, repeating some examples and never yielding others); it is refused, naming
    num_workers, and one saved with the same workers resumes."""

    def make(workers: int) -> Any:
        source = torch.utils.data.DataLoader(_Stream(), batch_size=6, num_workers=workers)
        return sbloader.SelectiveLoader(
            source,
            torch.nn.Linear(4, 2),
            policy=sbloader.Traditional(),
            input_key="x",
            target_key="y",
            index_key="i",
            dataset_size=24,
        )

    loader = make(0)
    for k, _ in enumerate(loader):
        if k + 1 == stop:
            break
    state = loader.state_dict()
    with pytest.raises(ValueError, match="num_workers=0, but this one has num_workers=2"):
        make(2).load_state_dict(state)
    resumed = make(0)
    resumed.load_state_dict(state)
    assert len([b.indices for b in resumed]) == (4 - stop if stop else 4)
