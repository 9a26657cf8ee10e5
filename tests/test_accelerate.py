"""SelectiveLoader under Hugging Face Accelerate (the real library, on the CPU).

The 2-process tests launch tests/accelerate_scenarios.py with torchrun once (gloo) under a
deadline, so a hang fails instead of blocking the suite; the tests below compare its ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import sbloader

accelerate = pytest.importorskip("accelerate")
import accelerate_scenarios as S  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.data_loader import DataLoaderShard, prepare_data_loader  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradientAccumulationPlugin  # noqa: E402
from conftest import checkout_env, no_native_bf16  # noqa: E402
from launch import ROOT, torchrun_ranks  # noqa: E402

from sbloader.integrations.accelerate import AcceleratedLoader, AcceleratedShardSource  # noqa: E402

#: Seconds the 2-process run may take before it fails as a hang (about 20 s alone on one core;
#: a loaded machine is several times slower, and a hang never ends).
DEADLINE_S = 300

pytestmark = pytest.mark.timeout(DEADLINE_S + 60)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return torchrun_ranks("accelerate_scenarios.py", tmp_path_factory.mktemp("acc"), DEADLINE_S)


# ------------------------------------------------------------------ 2 processes
def test_the_shards_are_the_prepared_loaders_own_and_do_not_overlap(ranks):
    """A Traditional SelectiveLoader over a prepared loader yields exactly the batches the
    prepared loader's own __iter__ yields (its generator synchronisation reproduced, with
    generators seeded differently on each rank), so the ranks' shards partition the data."""
    for r in ranks:
        assert r["selective"] == r["native"]
    for epoch in range(2):
        shards = [sorted(i for b in r["selective"][epoch] for i in b) for r in ranks]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(S.N))
    assert ranks[0]["selective"][0] != ranks[0]["selective"][1]  # reshuffled per epoch


def test_epoch_size_and_length_are_each_processes_share(ranks):
    for r in ranks:
        assert r["epoch_size"] == r["epoch_size_sb"] == S.N // 2
        assert r["len"] == S.N // 2 // S.SOURCE_BATCH


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("even_batches", [True, False])
def test_epoch_size_is_what_each_processes_shard_yields(fresh_accelerate, drop_last, even_batches):
    """Where the processes' shares differ (99 examples in batches of 8: a short last batch,
    even_batches' padding, a dropped last batch), each process's epoch_size is the examples
    its shard yields."""
    for rank in range(2):
        shard = prepare_data_loader(
            DataLoader(data(99), batch_size=8, drop_last=drop_last),
            num_processes=2,
            process_index=rank,
            even_batches=even_batches,
        )
        yielded = sum(len(x) for x, _ in shard)
        assert AcceleratedShardSource(shard).epoch_size == yielded, rank


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("processes", [1, 2])
def test_len_counts_the_batches_a_prepared_loader_yields(fresh_accelerate, drop_last, processes):
    """A SelectiveLoader over a prepared loader (99 examples in batches of 8) counts the batches
    it yields, the last partial one dropped where the DataLoader drops it (also on one process,
    where Accelerate keeps the DataLoader's own batch sampler)."""
    for rank in range(processes):
        shard = prepare_data_loader(
            DataLoader(data(99), batch_size=8, drop_last=drop_last),
            num_processes=processes,
            process_index=rank,
        )
        expected = [len(x) for x, _ in shard]
        sb = sbloader.SelectiveLoader(
            shard, nn.Linear(6, 3), policy=sbloader.Traditional(), batch_size=8, seed=0
        )
        assert [len(x) for x, _ in sb] == expected and len(sb) == len(expected), rank
    if drop_last:  # (each process's share of the 12 full batches)
        assert expected == [8] * (12 // processes)


def test_ranks_take_equal_steps_on_disjoint_examples(ranks):
    ref = [r["reference"] for r in ranks]
    assert [len(e) for e in ref[0]] == [len(e) for e in ref[1]]
    for e0, e1 in zip(*ref):
        seen = [{i for s in e for i in s["indices"]} for e in (e0, e1)]
        assert not seen[0] & seen[1]  # remainder="drop": nothing carried across epochs


def test_gradient_accumulation_syncs_on_each_epochs_last_batch(ranks):
    for r in ranks:
        epochs = r["reference"]
        # The test means something only if an epoch's length is no multiple of the steps.
        assert any(len(e) % S.ACCUMULATE for e in epochs)
        for steps in epochs + r["resumed"]:
            assert steps[-1]["sync"]
            assert steps[0]["clean"]  # no gradient carried over from the previous epoch
        for steps in epochs:  # every ACCUMULATE-th step, and the last
            syncs = [i + 1 for i, s in enumerate(steps) if s["sync"]]
            expected = sorted({*range(S.ACCUMULATE, len(steps) + 1, S.ACCUMULATE), len(steps)})
            assert syncs == expected


def test_register_for_checkpointing_resumes_exactly(ranks):
    for r in ranks:
        ref = [s for e in r["reference"] for s in e]
        cut = next(i for i, s in enumerate(ref) if s.get("saved")) + 1
        resumed = [s for e in r["resumed"] for s in e]
        assert [s["indices"] for s in resumed] == [s["indices"] for s in ref[cut:]]
        assert [s["sync"] for s in resumed] == [s["sync"] for s in ref[cut:]]
        assert r["resumed_at"][0] == S.SAVE_EPOCH and r["resumed_at"][1] > 0  # mid-epoch
        assert r["saved_processes"] == (2, 2)  # every process's state, and their number


def test_the_selective_loader_registered_itself_is_refused_on_another_rank(ranks):
    """Accelerate saves a registered object from the main process only: rank 1 would resume
    rank 0's run. It is refused, naming the supported way."""
    assert ranks[0]["bare"] == ""
    assert "AcceleratedLoader" in ranks[1]["bare"] and "rank 1" in ranks[1]["bare"]


# ------------------------------------------------------------------ one process
@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps process-wide singletons; each test starts and ends without them."""
    reset_accelerate()
    yield
    reset_accelerate()


def data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def one_process_setup(
    accumulate: int, sync_with_dataloader: bool = True
) -> tuple[Any, nn.Module, Any, sbloader.SelectiveLoader]:
    """One process's Accelerator, prepared model and optimizer, and a SelectiveLoader (SB at
    1/2, batches of 4) over a prepared shuffling DataLoader of :func:`data`."""
    plugin = GradientAccumulationPlugin(
        num_steps=accumulate, sync_with_dataloader=sync_with_dataloader
    )
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    source = DataLoader(data(), batch_size=16, shuffle=True, generator=g)
    model, opt, source = accelerator.prepare(model, opt, source)
    sb = sbloader.SelectiveLoader(
        source, model, policy=sbloader.SelectiveBackprop(selectivity=0.5), batch_size=4, seed=2
    )
    return accelerator, model, opt, sb


def train_step(accelerator: Any, model: nn.Module, opt: Any, batch: Any) -> None:
    """One weighted training step on ``batch`` under ``accelerator.accumulate``."""
    x, y = batch
    with accelerator.accumulate(model):
        loss = (F.cross_entropy(model(x), y, reduction="none") * batch.weights).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()


def one_process_run(
    accumulate: int,
    ckpt: Path | None = None,
    load: bool = False,
    wrap: bool = True,
    sync_with_dataloader: bool = True,
) -> tuple[list[list[tuple[list[int], bool]]], sbloader.SelectiveLoader]:
    """Two epochs on one process: per epoch, per step, the indices and sync_gradients.

    ``ckpt``: save there after the 4th step (or, with ``load``, resume from it); ``wrap=False``
    iterates the SelectiveLoader itself instead of an AcceleratedLoader."""
    accelerator, model, opt, sb = one_process_setup(accumulate, sync_with_dataloader)
    loader = AcceleratedLoader(sb) if wrap else sb
    if wrap:
        accelerator.register_for_checkpointing(loader)
    if load:
        accelerator.load_state(str(ckpt))
    log = []
    for _ in range(sb.epoch, 2):
        steps = []
        for batch in loader:
            train_step(accelerator, model, opt, batch)
            steps.append((batch.indices.tolist(), accelerator.sync_gradients))
            if ckpt is not None and not load and sb.epoch == 0 and len(steps) == 4:
                accelerator.save_state(str(ckpt))  # gradient_accumulation_steps=2: a sync step
        log.append(steps)
    return log, sb


def reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_a_selective_loader_passed_to_prepare_is_reported_on_every_rank(ranks):
    """accelerator.prepare(SelectiveLoader(raw DataLoader)) returns it unchanged, unsharded:
    both processes read every example. Each rank's loader says so once, naming the fix."""
    for r in ranks:
        got = r["prepared_selective"]
        assert got["unchanged"] and got["batches"] == ranks[0]["prepared_selective"]["batches"]
        assert len(got["warned"]) == 1 and "accelerator.prepare(dataloader)" in got["warned"][0]


def test_one_process_source_and_accumulation(fresh_accelerate):
    log, sb = one_process_run(accumulate=3)
    assert isinstance(sb.source, AcceleratedShardSource)
    assert sb.source.epoch_size == 96 and len(sb.source) == 6
    for steps in log:
        assert steps[-1][1] is True
    assert any(len(steps) % 3 for steps in log)


def test_the_loader_is_accelerates_active_dataloader_only_while_its_epoch_runs(fresh_accelerate):
    """As Accelerate's own loaders: registered with GradientState during an epoch (so that
    accumulate() syncs at its end), unregistered once it ends."""
    accelerator, _, _, sb = one_process_setup(accumulate=2)
    loader = AcceleratedLoader(sb)
    for _ in range(2):
        inside = [accelerator.gradient_state.active_dataloader is loader for _ in loader]
        assert inside and all(inside)
        assert not accelerator.gradient_state.in_dataloader


def test_one_process_checkpoint_resumes_exactly(fresh_accelerate, tmp_path):
    ref, _ = one_process_run(accumulate=2, ckpt=tmp_path / "ckpt")
    reset_accelerate()
    resumed, _ = one_process_run(accumulate=2, ckpt=tmp_path / "ckpt", load=True)
    assert [s for e in resumed for s in e] == [s for e in ref for s in e][4:]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_checkpoint_at_an_epochs_last_step_resumes_with_that_epochs_end(
    fresh_accelerate, tmp_path, accumulate
):
    """A checkpoint saved at an epoch's last step resumes, with or without gradient
    accumulation, where the run stood: the loop's first epoch is the rest of the saved one
    (nothing), then the next ones as the uninterrupted run had them, whether the loop counts
    its own epochs or reads loader.epoch. Under accumulation the loader runs ahead to learn
    that the batch is the last (end_of_dataloader); it once ended the epoch then, so the
    checkpoint said epoch 1, and a loop resumed at the caller's own epoch 0 trained one epoch
    more."""

    def run(save_at: int | None = None, load: bool = False) -> tuple[list[Any], int]:
        accelerator, model, opt, sb = one_process_setup(accumulate)
        loader = AcceleratedLoader(sb)
        accelerator.register_for_checkpointing(loader)
        if load:
            accelerator.load_state(str(tmp_path))
            assert sb.epoch == 0
        epochs = []
        for user_epoch in range(3):  # the caller's own counter (the checkpoint's: 0)
            steps = []
            for batch in loader:
                x, y = batch
                with accelerator.accumulate(model):
                    accelerator.backward(F.cross_entropy(model(x), y))
                    opt.step()
                    opt.zero_grad()
                steps.append(batch.indices.tolist())
                if user_epoch == 0 and len(steps) == save_at:
                    # the last step: Accelerate syncs there under accumulation
                    assert accelerator.gradient_state.end_of_dataloader == (accumulate > 1)
                    assert sb.epoch == 0
                    accelerator.save_state(str(tmp_path))
            epochs.append(steps)
        return epochs, sb.epoch

    full, _ = run()
    reset_accelerate()
    saving, _ = run(save_at=len(full[0]))
    assert saving == full
    reset_accelerate()
    resumed, end_epoch = run(load=True)
    assert resumed[0] == []  # the rest of epoch 0
    assert resumed[1:] == full[1:]
    assert end_epoch == 3


@pytest.mark.parametrize("accumulate, sync_with_dataloader", [(1, True), (2, False)])
def test_without_accumulation_nothing_runs_ahead(
    fresh_accelerate, accumulate, sync_with_dataloader
):
    """gradient_accumulation_steps=1, or accumulation that does not sync with the loader's
    end: the batches are the plain SelectiveLoader's (no look-ahead), though the model trains
    between them."""
    ahead, _ = one_process_run(accumulate, sync_with_dataloader=sync_with_dataloader)
    reset_accelerate()
    plain, _ = one_process_run(accumulate, wrap=False, sync_with_dataloader=sync_with_dataloader)
    assert ahead == plain


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(8):
            yield torch.zeros(2), i


@pytest.mark.parametrize(
    "make, kwargs, message",
    [
        (lambda a: a.prepare(DataLoader(Stream(), batch_size=4)), {}, "DataLoaderDispatcher: pass"),
        (
            lambda a: a.skip_first_batches(a.prepare(DataLoader(data(), batch_size=4)), 1),
            {},
            "restoring the SelectiveLoader's state",
        ),
        (
            lambda a: a.prepare(DataLoader(data(), batch_size=4)),
            {"index_key": 0},
            "drop index_key",
        ),
        (  # not dispatched: each process reads its shard of the stream, without indices
            lambda a: prepare_data_loader(
                DataLoader(Stream(), batch_size=4),
                num_processes=2,
                process_index=0,
                dispatch_batches=False,
            ),
            {},
            "over an iterable dataset",
        ),
        (  # a DataLoaderShard built to skip its first batches
            lambda a: DataLoaderShard(data(), batch_size=4, skip_batches=1),
            {},
            "skips its first batches.*restoring the SelectiveLoader's state",
        ),
        (  # as accelerator.prepare builds it on 2 processes with split_batches=True
            lambda a: prepare_data_loader(
                DataLoader(data(), batch_size=8),
                num_processes=2,
                process_index=0,
                split_batches=True,
            ),
            {},
            r"split_batches=True .*prepare it with split_batches=False",
        ),
    ],
)
def test_what_cannot_work_is_refused_with_the_supported_way(
    fresh_accelerate, make, kwargs, message
):
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=message):
        sbloader.SelectiveLoader(make(accelerator), nn.Linear(6, 3), batch_size=4, **kwargs)


def test_the_readme_loop_reports_losses_through_the_accelerated_loader(fresh_accelerate):
    """``loader.feedback(batch.indices, losses)``, the README's loop (what the default recipe
    needs), raised AttributeError on the AcceleratedLoader the Accelerate section iterates."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    source = DataLoader(data(), batch_size=16, shuffle=True, generator=g)
    model, opt, source = accelerator.prepare(model, opt, source)
    policy = sbloader.SelectiveBackprop(0.5, staleness=2)
    loader = AcceleratedLoader(sbloader.SelectiveLoader(source, model, policy=policy, batch_size=4))
    reported = {}
    for batch in loader:
        inputs, targets = batch
        with accelerator.accumulate(model):
            losses = F.cross_entropy(model(inputs), targets, reduction="none")
            accelerator.backward(losses.mean())
            opt.step()
            opt.zero_grad()
        loader.feedback(batch.indices, losses)
        reported.update(zip(batch.indices.tolist(), losses.tolist()))
    stats = loader.loader.stats.epochs[0]
    assert stats.feedback == stats.examples_yielded == len(reported)
    next(iter(loader))  # the reports reach the store as the next epoch starts
    idx = sorted(reported)
    stored, _ = policy.store.lookup(np.array(idx))
    np.testing.assert_allclose(stored, [reported[i] for i in idx], rtol=1e-6)


def test_accelerated_loader_wraps_only_a_selective_loader():
    with pytest.raises(TypeError, match="SelectiveLoader"):
        AcceleratedLoader(DataLoader(data(), batch_size=4))  # type: ignore[arg-type]


def test_a_state_from_another_number_of_processes_is_refused(fresh_accelerate):
    accelerator = Accelerator(cpu=True)
    source = accelerator.prepare(DataLoader(data(), batch_size=16))
    loader = AcceleratedLoader(sbloader.SelectiveLoader(source, nn.Linear(6, 3), batch_size=4))
    state = loader.state_dict()
    assert state["world_size"] == 1 and len(state["ranks"]) == 1
    with pytest.raises(ValueError, match="number of processes"):
        loader.load_state_dict({**state, "ranks": state["ranks"] * 2, "world_size": 2})


def test_a_state_of_the_other_registered_object_is_refused_naming_the_mix_up(
    fresh_accelerate, tmp_path
):
    """accelerator.save_state with the AcceleratedLoader registered and load_state with the
    SelectiveLoader registered, or the other way round: refused naming which object saved it
    and the fix (found by review: a bare KeyError 'pending' from sbloader 0.1's migration, and a
    version error advising another sbloader)."""

    def registered(wrap: bool) -> tuple[Any, Any]:
        reset_accelerate()
        accelerator, _, _, sb = one_process_setup(accumulate=1)
        obj = AcceleratedLoader(sb) if wrap else sb
        accelerator.register_for_checkpointing(obj)
        return accelerator, obj

    for saved_wrapped in (True, False):
        accelerator, obj = registered(saved_wrapped)
        for _ in obj:
            pass
        accelerator.save_state(str(tmp_path / str(saved_wrapped)))
        accelerator, _ = registered(not saved_wrapped)
        match = "saved by a wrapper" if saved_wrapped else "a SelectiveLoader's own state"
        with pytest.raises(ValueError, match=match):
            accelerator.load_state(str(tmp_path / str(saved_wrapped)))
        accelerator, _ = registered(saved_wrapped)
        accelerator.load_state(str(tmp_path / str(saved_wrapped)))  # the same object: loads


def test_steps_capped_per_epoch_and_a_checkpoint_at_each_epochs_end_resume_exactly(
    fresh_accelerate, tmp_path
):
    """Accelerate's scripts' loop: `break` after so many steps per epoch, loader.end_epoch() and
    accelerator.save_state as each epoch ends, a resume at the next epoch (found by review:
    without a way to say the epoch ended, the resumed loader went on with the rest of the left
    epoch, a pass behind the run for good: every later batch different). Without end_epoch()
    the loop going on is warned of as the next epoch begins."""
    cap, epochs = 3, 4

    def run(
        save_after: int | None = None, load: bool = False, end: bool = True, go_on: bool = False
    ) -> tuple[list[Any], int]:
        reset_accelerate()
        accelerator, model, opt, sb = one_process_setup(accumulate=1)
        loader = AcceleratedLoader(sb)
        accelerator.register_for_checkpointing(loader)
        start = 0
        if load:
            accelerator.load_state(str(tmp_path / "ckpt"))
            start = save_after + 1
        log = []
        for epoch in range(start, epochs):
            steps = []
            for batch in loader:
                train_step(accelerator, model, opt, batch)
                steps.append(batch.indices.tolist())
                if len(steps) == cap:
                    break
            if end:
                loader.end_epoch()
            log.append(steps)
            if epoch == save_after and not load:
                accelerator.save_state(str(tmp_path / "ckpt"))
                if not go_on:
                    break
        return log, sb.epoch

    with pytest.warns(UserWarning, match=r"epoch 0 was left part-way.*loader\.end_epoch\(\)"):
        unended, _ = run(save_after=0, end=False, go_on=True)
    full, full_epoch = run()
    assert unended == full  # (the same batches in this process, either way)
    head, _ = run(save_after=1)
    rest, epoch = run(save_after=1, load=True)
    assert head + rest == full and epoch == full_epoch == epochs


def bf16_model() -> tuple[nn.Module, list[torch.dtype]]:
    """A model whose layer records the dtype it computes in during selection passes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(
        lambda m, i, out: None if m.training else dtypes.append(out.dtype)
    )
    return model, dtypes


def test_a_model_prepared_for_mixed_precision_selects_in_it_and_says_so(
    fresh_accelerate, monkeypatch
):
    """accelerator.prepare(model) under mixed_precision="bf16" puts its own autocast into the
    model's forward, which selection passes run under whatever the loader asks. The loader
    reported float32 (autocast="auto" where the CPU has no native bf16, or autocast=None) while
    selecting in bf16; "auto" now reports and saves bf16, and an explicit float32 is refused
    naming the fix."""
    no_native_bf16(monkeypatch)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model, dtypes = bf16_model()
    model, source = accelerator.prepare(model, DataLoader(data(), batch_size=16))
    loader = sbloader.SelectiveLoader(
        source, model, policy=sbloader.SelectiveBackprop(0.5), batch_size=4
    )
    next(iter(loader))
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert loader.autocast is torch.bfloat16
    assert "bfloat16" in loader.selection_precision
    assert "mixed_precision" in loader.selection_precision
    assert loader.state_dict()["autocast"] == "bfloat16"
    with pytest.raises(
        ValueError, match=r"autocast should be 'auto' or torch.bfloat16 .* got autocast=None"
    ):
        sbloader.SelectiveLoader(source, model, batch_size=4, autocast=None)


def test_a_model_prepared_after_the_loader_was_built_is_followed_at_the_epoch_start(
    fresh_accelerate, monkeypatch
):
    no_native_bf16(monkeypatch)
    model, dtypes = bf16_model()
    source = DataLoader(data(), batch_size=16)
    policy = sbloader.SelectiveBackprop(0.5)
    auto = sbloader.SelectiveLoader(source, model, policy=policy, batch_size=4)
    explicit = sbloader.SelectiveLoader(source, model, batch_size=4, autocast=None)
    assert auto.autocast is None
    Accelerator(cpu=True, mixed_precision="bf16").prepare(model)  # patches model in place
    next(iter(auto))
    assert auto.autocast is torch.bfloat16 and set(dtypes) == {torch.bfloat16}
    with pytest.raises(ValueError, match="got autocast=None; pass autocast='auto'"):
        next(iter(explicit))


@pytest.mark.parametrize("wrap", [False, True])
@pytest.mark.parametrize("iterable", [False, True])
def test_skip_first_batches_on_the_loader_names_the_resume_that_works(
    fresh_accelerate, wrap, iterable
):
    """Accelerate's mid-epoch resume recipe, accelerator.skip_first_batches(loader, n) after
    load_state, given the SelectiveLoader or the AcceleratedLoader, failed on a bare
    AttributeError ('AcceleratedLoader' object has no attribute 'dataset'); it now names the
    loader's own state as the way to resume."""
    accelerator = Accelerator(cpu=True)
    if iterable:
        source = DataLoader(Stream(), batch_size=4)
        loader = sbloader.SelectiveLoader(
            source, nn.Linear(2, 3), batch_size=2, index_key=1, dataset_size=8
        )
    else:
        source = accelerator.prepare(DataLoader(data(), batch_size=16))
        loader = sbloader.SelectiveLoader(source, nn.Linear(6, 3), batch_size=4)
    target = AcceleratedLoader(loader) if wrap else loader
    with pytest.raises(AttributeError, match=r"skip_first_batches.*load_state"):
        accelerator.skip_first_batches(target, 2)
    assert not hasattr(target, "batch_sampler") and not hasattr(target, "drop_last")
    assert target.dataset is loader.dataset and target.sampler is loader.sampler


def test_a_checkpoint_between_optimizer_steps_warns_that_resuming_differs(
    fresh_accelerate, tmp_path
):
    """Under gradient accumulation a checkpoint saved between optimizer steps holds none of the
    gradients accumulated since the last one: the resumed run's weights, and soon its
    selections, differ from the uninterrupted run's (measured here: within a few batches).
    That was silent; it warns, and a checkpoint at an optimizer step does not."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model, source = accelerator.prepare(nn.Linear(6, 3), DataLoader(data(), batch_size=16))
    loader = AcceleratedLoader(
        sbloader.SelectiveLoader(
            source, model, policy=sbloader.SelectiveBackprop(0.5), batch_size=4
        )
    )
    accelerator.register_for_checkpointing(loader)
    it = iter(loader)
    for step in range(3):
        x, y = next(it)
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
        if step == 1:
            assert accelerator.sync_gradients
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                accelerator.save_state(str(tmp_path / "at_a_step"))
    assert not accelerator.sync_gradients
    with pytest.warns(UserWarning, match="sync_gradients is False .* will not train as"):
        accelerator.save_state(str(tmp_path / "between_steps"))


def interruptible_run(
    accumulate: int,
    ckpt: Path,
    fail_at: int | None = None,
    say: bool | None = False,
    load: bool = False,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Two epochs on one process: the indices each training step trained on, and the final
    weights. ``fail_at``: a KeyboardInterrupt at that step (counted over both epochs), before
    it trains (``say=False``: ``loader.interrupted()``) or after (``say=True``:
    ``interrupted(step_finished=True)``; ``say=None``: neither), then ``save_state`` in the
    ``except`` and the run stops; ``load``: resume from ``ckpt`` first."""
    accelerator, model, opt, sb = one_process_setup(accumulate)
    loader = AcceleratedLoader(sb)
    accelerator.register_for_checkpointing(loader)
    if load:
        accelerator.load_state(str(ckpt))
    trained: list[list[int]] = []
    step = 0
    try:
        for _ in range(sb.epoch, 2):
            for batch in loader:
                if step == fail_at and say is not True:
                    raise KeyboardInterrupt
                train_step(accelerator, model, opt, batch)
                trained.append(batch.indices.tolist())
                if step == fail_at:
                    raise KeyboardInterrupt
                step += 1
    except KeyboardInterrupt:
        if say is not None:
            loader.interrupted(step_finished=say)
        accelerator.save_state(str(ckpt))
    return trained, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_interrupted_training_step_resumes_at_its_batch_once_the_loader_is_told(
    fresh_accelerate, tmp_path, accumulate
):
    """A KeyboardInterrupt in the training step, then ``accelerator.save_state`` in the
    ``except``: Accelerate gives the loader no sign that the batch in hand went untrained, and
    the resumed run went on after it, never training it. With ``loader.interrupted()`` before
    the save the resumed run trains that batch first and then exactly what the uninterrupted
    run trained, to the same final weights: at an epoch's first, middle and last step and in
    the second epoch (under accumulation, where the step before synchronised, so that no
    accumulated gradient is lost; the loader then runs ahead a batch)."""
    full, weights = interruptible_run(accumulate, tmp_path / "unused")
    per_epoch = len(full) // 2
    assert per_epoch >= 6
    points = [0, 2, per_epoch - 1, per_epoch, per_epoch + 4]
    if accumulate == 2:
        points = [0, 2, 4, per_epoch + 2] if per_epoch % 2 == 0 else [0, 2, 4, per_epoch + 3]
    for fail_at in points:
        reset_accelerate()
        ckpt = tmp_path / f"at{fail_at}"
        before, _ = interruptible_run(accumulate, ckpt, fail_at=fail_at)
        assert before == full[:fail_at]
        reset_accelerate()
        after, resumed = interruptible_run(accumulate, ckpt, load=True)
        assert before + after == full, fail_at
        assert all(torch.equal(a, b) for a, b in zip(resumed, weights)), fail_at


def test_an_interrupted_step_saved_without_saying_so_warns_and_skips_its_batch(
    fresh_accelerate, tmp_path
):
    """Saved while the KeyboardInterrupt is handled and ``interrupted()`` was not called, the
    state counts the batch in hand as trained (what it did silently before): it warns, naming
    the fix, and the resumed run indeed never trains that batch."""
    full, _ = interruptible_run(1, tmp_path / "unused")
    reset_accelerate()
    with pytest.warns(UserWarning, match=r"KeyboardInterrupt is handled.*loader\.interrupted\(\)"):
        before, _ = interruptible_run(1, tmp_path / "ckpt", fail_at=3, say=None)
    reset_accelerate()
    after, _ = interruptible_run(1, tmp_path / "ckpt", load=True)
    assert before == full[:3]
    assert after[0] != full[3]
    assert full[3] not in after[:1]


def test_a_step_that_finished_before_the_interruption_resumes_after_its_batch(
    fresh_accelerate, tmp_path
):
    """``interrupted(step_finished=True)``: the exception came after the step; the state is the
    usual one (no warning) and the resumed run goes on with the next batch, exactly."""
    full, weights = interruptible_run(1, tmp_path / "unused")
    reset_accelerate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before, _ = interruptible_run(1, tmp_path / "ckpt", fail_at=3, say=True)
    assert before == full[:4]
    reset_accelerate()
    after, resumed = interruptible_run(1, tmp_path / "ckpt", load=True)
    assert before + after == full
    assert all(torch.equal(a, b) for a, b in zip(resumed, weights))


def test_interrupted_refuses_what_it_cannot_take_back_when_called(fresh_accelerate):
    """Nothing to take back (before the first batch, after an epoch that ended) or a
    step_finished that is not a bool: refused at the call, naming the fix, not at the save."""
    _, _, _, sb = one_process_setup(1)
    loader = AcceleratedLoader(sb)
    with pytest.raises(ValueError, match="no batch handed out can be taken back now"):
        loader.interrupted()
    for _ in loader:
        pass
    with pytest.raises(ValueError, match="pass step_finished=True"):
        loader.interrupted()
    loader.interrupted(step_finished=True)
    with pytest.raises(
        TypeError, match="step_finished should be True or False, but got step_finished=1"
    ):
        loader.interrupted(step_finished=1)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the example
def have_fashion_mnist() -> bool:
    from sbloader.datasets import load_fashion_mnist

    try:
        load_fashion_mnist("test")
    except FileNotFoundError:
        return False
    return True


@pytest.mark.slow  # three epochs and two processes started: about a minute on a busy core
@pytest.mark.realdata
@pytest.mark.skipif(not have_fashion_mnist(), reason="needs Debian's dataset-fashion-mnist")
def test_the_example_accumulates_to_each_epochs_end_and_resumes(tmp_path):
    script = str(ROOT / "examples" / "accelerate_fashion_mnist.py")
    common = ["--examples", "1536", "--batch-size", "32", "--accumulate", "3"]
    common += ["--checkpoint", str(tmp_path / "ckpt")]
    env = checkout_env()

    def run(*extra: str) -> list[dict]:
        out = tmp_path / "rows.json"
        cmd = [sys.executable, script, *common, "--json", str(out), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(out.read_text())

    rows = run("--epochs", "2")
    assert [r["epoch"] for r in rows] == [0, 1]
    for r in rows:
        assert r["last_batch_synced"]
        assert r["optimizer_steps"] == -(-r["steps"] // 3)  # every 3rd step, and the last
        assert r["backprop_per_process"][0] == 32 * r["steps"]
    resumed = run("--epochs", "3", "--resume", str(tmp_path / "ckpt"))
    assert [r["epoch"] for r in resumed] == [2]


def test_one_process_shuffling_with_the_global_rng_cannot_resume_mid_epoch(fresh_accelerate):
    """On one process Accelerate leaves a shuffling DataLoader on torch's global RNG, whose
    order cannot be replayed: a mid-epoch state is refused with the fix, as for any DataLoader."""
    accelerator = Accelerator(cpu=True)
    source = accelerator.prepare(DataLoader(data(), batch_size=16, shuffle=True))
    loader = sbloader.SelectiveLoader(source, nn.Linear(6, 3), batch_size=4)
    assert not loader.source.replayable
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="generator="):
        sbloader.SelectiveLoader(source, nn.Linear(6, 3), batch_size=4).load_state_dict(state)


def test_a_seedable_sampler_resumes_mid_epoch_and_another_seed_is_refused(fresh_accelerate):
    """use_seedable_sampler=True: the sampler seeds its own generator with its seed + epoch at
    each iter() (it has none before), so a mid-epoch state replays its order exactly; one saved
    with another seed (torch's initial seed of another process) is refused naming data_seed."""
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)

    def make() -> sbloader.SelectiveLoader:
        source = accelerator.prepare(DataLoader(data(), batch_size=16, shuffle=True))
        return sbloader.SelectiveLoader(
            source, nn.Linear(6, 3), policy=sbloader.Traditional(), batch_size=8, seed=0
        )

    loader = make()
    assert type(loader.sampler).__name__ == "SeedableRandomSampler"
    assert loader.source.replayable
    it = iter(loader)
    head = [next(it).indices.tolist() for _ in range(3)]
    state = loader.state_dict()
    rest = [b.indices.tolist() for b in it]
    assert sorted(i for b in head + rest for i in b) == list(range(96))
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.indices.tolist() for b in resumed] == rest
    other = make()
    other.sampler.initial_seed += 1
    with pytest.raises(ValueError, match=r"data_seed=seed"):
        other.load_state_dict(state)


def test_the_modules_docstring_example_runs(fresh_accelerate):
    import doctest

    import sbloader.integrations.accelerate as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and result.failed == 0
