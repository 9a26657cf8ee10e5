"""FFCV as a source: indices, pairing, buffer reuse, thread counts, equivalence with DataLoader.

Every example's image is filled with its dataset index and its label is ``index % N_CLASSES``,
so any mix-up of images, labels and indices shows. Skipped when ffcv is not installed.
"""

from __future__ import annotations

import copy
import operator
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import N_CLASSES, IndexLoss, checkout_env, run_python
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sbloader
from sbloader import RandomBackprop, SelectiveBackprop, SelectiveLoader, Traditional
from sbloader import ffcv as sbffcv

with sbffcv.preserved_threads():  # NOTE: a bare `import ffcv` would set torch's threads to 1
    pytest.importorskip("ffcv")

N = 300
ROOT = Path(__file__).resolve().parents[1]


def encoded_arrays(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    images = np.repeat(np.arange(n, dtype=np.float32), 16).reshape(n, 1, 4, 4)
    return images, np.arange(n, dtype=np.int64) % N_CLASSES


@pytest.fixture(scope="module")
def beton(tmp_path_factory) -> Path:
    return sbffcv.write_beton(tmp_path_factory.mktemp("ffcv") / "encoded.beton", encoded_arrays())


@pytest.fixture(autouse=True)
def threads_unchanged():
    """No test here may leave torch's or numba's thread count, or torch's default for new
    threads, changed."""
    import numba

    before = (torch.get_num_threads(), numba.get_num_threads(), new_thread_torch_threads())
    yield
    after = (torch.get_num_threads(), numba.get_num_threads(), new_thread_torch_threads())
    assert after == before


def new_thread_torch_threads() -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]


def model() -> nn.Module:
    """Cross-entropy grows with the index (IndexLoss on the image's first pixel)."""
    return nn.Sequential(nn.Flatten(), IndexLoss(dim=16))


def check_pairing(images, labels, indices) -> None:
    idx = torch.as_tensor(indices)
    assert images.shape[1:] == (1, 4, 4)
    assert torch.equal(images.reshape(len(idx), -1), idx[:, None].float().expand(-1, 16))
    assert torch.equal(labels, idx % N_CLASSES)


def numba_limit() -> int:
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


# ------------------------------------------------------------------ the source itself
@pytest.mark.parametrize("order", ["sequential", "random"])
@pytest.mark.parametrize("workers", [1, 2])
def test_every_index_exactly_once_with_exact_pairing(beton, order, workers):
    if workers > numba_limit():
        pytest.skip("needs NUMBA_NUM_THREADS >= 2 (test_more_workers_than_cores covers more)")
    loader = sbffcv.open_beton(beton, 32, order=order, seed=3, num_workers=workers)
    source = sbffcv.FFCVSource(loader)
    assert len(source) == 10 and source.batch_size == 32 and source.dataset_size == N
    orders = []
    for epoch in range(2):
        source.set_epoch(epoch)
        seen = []
        for (images, labels, index), indices in source.epoch():
            assert labels.shape == index.shape == (len(indices),)  # (B, 1) flattened
            check_pairing(images, labels, indices)
            assert torch.equal(index, torch.from_numpy(indices))
            seen.append(indices)
        seen = np.concatenate(seen)
        assert np.array_equal(np.sort(seen), np.arange(N))
        if order == "random":  # FFCV's documented order: a permutation by (seed + epoch)
            assert np.array_equal(seen, np.random.default_rng(3 + epoch).permutation(N))
        orders.append(seen)
    assert (order == "sequential") == np.array_equal(orders[0], orders[1])


def test_more_workers_than_cores_in_a_subprocess(beton):
    """FFCV on the CPU with 4 workers (more than this machine's cores): every index exactly once
    per epoch. FFCV needs NUMBA_NUM_THREADS >= num_workers, set before numba is imported."""
    code = textwrap.dedent(
        f"""
        import numpy as np, torch, sbloader, sbloader.ffcv as F
        torch.set_num_threads(2)
        loader = F.open_beton({str(beton)!r}, 25, order="random", num_workers=4)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
        sl = sbloader.SelectiveLoader(loader, model, policy=sbloader.RandomBackprop(1.0),
                                      remainder="short")
        for _ in range(2):
            seen = []
            for images, labels, index in sl:
                assert torch.equal(images[:, 0, 0, 0].long(), index)
                assert torch.equal(labels, index % 4)
                seen += index.tolist()
            assert sorted(seen) == list(range({N})), len(seen)
        assert torch.get_num_threads() == 2
        print("ok")
        """
    )
    out = run_python(code, timeout=240, env={**checkout_env(), "NUMBA_NUM_THREADS": "4"})
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_too_many_workers_names_the_fix(beton):
    with pytest.raises(ValueError, match=r"num_workers=.*NUMBA_NUM_THREADS"):
        sbffcv.open_beton(beton, 32, num_workers=numba_limit() + 1)


def test_indices_recovered_from_the_traversal_order_match_the_index_field(beton):
    loader = sbffcv.open_beton(beton, 32, order="random", seed=5)
    by_field, by_order = sbffcv.FFCVSource(loader), sbffcv.FFCVSource(loader, index_field=None)
    for epoch in (0, 3):
        by_field.set_epoch(epoch)
        by_order.set_epoch(epoch)
        a = [i for _, i in by_field.epoch()]
        b = [i for _, i in by_order.epoch()]
        assert len(a) == len(b) == 10 and all(np.array_equal(x, y) for x, y in zip(a, b))
    quasi = sbffcv.open_beton(beton, 32, order="quasi_random")
    with pytest.raises(ValueError, match="index_field='index'"):
        sbffcv.FFCVSource(quasi, index_field=None)
    with pytest.raises(ValueError, match="index_field=None"):
        sbffcv.FFCVSource(loader, index_field="idx")


def test_a_loader_with_batches_ahead_0_is_refused_naming_it(beton):
    """FFCV's batches_ahead=0 makes its output queue unbounded (queue.Queue(0)), so its batch
    thread writes every batch of the epoch into its 2 buffers without waiting: the batch being
    selected from is overwritten under the loader. open_beton refuses it; a Loader built directly
    was accepted."""
    ffcv_loader = sys.modules["ffcv.loader"]
    with sbffcv.preserved_threads():
        loader = ffcv_loader.Loader(str(beton), 30, num_workers=1, seed=0, batches_ahead=0)
    with pytest.raises(ValueError, match=r"batches_ahead=0.*batches_ahead=1"):
        sbffcv.FFCVSource(loader)
    with pytest.raises(ValueError, match=r"batches_ahead=0"):
        SelectiveLoader(loader, model(), batch_size=16)


def test_a_drop_last_given_as_a_string_is_refused_not_read_by_its_truth_value(beton):
    """open_beton(drop_last="False") (a config's string) dropped the last partial batch."""
    with pytest.raises(TypeError, match=r"drop_last should be True or False.*'False'"):
        sbffcv.open_beton(beton, 32, drop_last="False")


def test_distributed_before_init_process_group_names_the_fix(beton):
    """open_beton(..., distributed=True) on a process without torch.distributed initialised
    failed inside FFCV on torch's "default process group" error; it names the call to make."""
    assert not torch.distributed.is_initialized()
    with pytest.raises(
        ValueError, match=r"distributed=True.*init_process_group.*distributed=False"
    ):
        sbffcv.open_beton(beton, 32, distributed=True)


def test_mid_epoch_resume_is_refused_for_quasi_random(beton):
    source = sbffcv.FFCVSource(sbffcv.open_beton(beton, 32, order="quasi_random"))
    state = source.state_dict()
    source.load_state_dict(state, mid_epoch=False)
    with pytest.raises(ValueError, match="epoch boundary"):
        source.load_state_dict(state, mid_epoch=True)
    other_seed = sbffcv.FFCVSource(sbffcv.open_beton(beton, 32, order="random", seed=1))
    state = sbffcv.FFCVSource(sbffcv.open_beton(beton, 32, order="random", seed=2)).state_dict()
    with pytest.raises(ValueError, match="seed"):
        other_seed.load_state_dict(state, mid_epoch=True)
    other_size = sbffcv.FFCVSource(sbffcv.open_beton(beton, 30, order="random", seed=2))
    with pytest.raises(ValueError, match=r"batch_size=32, but this one has .*batch_size=30"):
        other_size.load_state_dict(state, mid_epoch=True)
    other_size.load_state_dict(state, mid_epoch=False)  # a new epoch may batch otherwise
    dropping = sbffcv.FFCVSource(
        sbffcv.open_beton(beton, 32, order="random", seed=2, drop_last=True)
    )
    with pytest.raises(ValueError, match=r"drop_last=False, but this \w+ has \w*drop_last=True"):
        dropping.load_state_dict(state, mid_epoch=True)
    with pytest.raises(ValueError, match=rf"read {N + 1} examples but .* has {N}; open the same"):
        other_size.load_state_dict({**state, "num_samples": N + 1})  # another file's


def test_a_quasi_random_state_saved_mid_epoch_is_warned_of_when_saved(beton):
    """A QUASI_RANDOM order cannot be replayed, so load_state_dict refuses a mid-epoch state;
    a run checkpointing every few steps learned so only when it resumed. Now saving one warns,
    naming the order and the fix, once; a state saved at an epoch boundary does not warn and
    loads."""

    def build(order: str = "quasi_random") -> SelectiveLoader:
        loader = sbffcv.open_beton(beton, 32, order=order, seed=1)
        return SelectiveLoader(loader, model(), policy=SelectiveBackprop(1 / 3), batch_size=16)

    sl = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(sl)
        boundary = sl.state_dict()
    it = iter(sl)
    next(it)
    with pytest.warns(UserWarning, match="QuasiRandom order is not a pure function.*RANDOM"):
        state = sl.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sl.state_dict()  # (said once per loader)
    del it
    with pytest.raises(ValueError, match="epoch boundary"):
        build().load_state_dict(state)
    build().load_state_dict(boundary)
    replayable = build("random")
    it = iter(replayable)
    next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replayable.state_dict()
    del it


def test_a_quasi_random_run_restarted_at_an_epoch_boundary_reads_the_same_orders(beton):
    """ffcv's QUASI_RANDOM order shuffles its table of pages in place each time an order is
    drawn, so epoch e's order depended on the orders drawn before: a run restarted from a state
    saved at an epoch boundary read other orders than the uninterrupted run. Now every epoch
    reads the same order as the uninterrupted run's, each a permutation, epochs differing."""

    def build() -> SelectiveLoader:
        loader = sbffcv.open_beton(beton, 32, order="quasi_random", seed=1)
        return SelectiveLoader(loader, model(), policy=Traditional(), batch_size=32)

    def epoch_order(sl: SelectiveLoader) -> list[int]:
        return [i for batch in sl for i in batch.indices.tolist()]

    sl = build()
    full = [epoch_order(sl) for _ in range(3)]
    assert all(sorted(order) == list(range(N)) for order in full)
    assert full[0] != full[1] != full[2]
    first = build()
    epoch_order(first)
    state = first.state_dict()
    resumed = build()
    resumed.load_state_dict(state)
    assert [epoch_order(resumed), epoch_order(resumed)] == full[1:]


def test_mid_epoch_resume_is_refused_for_other_indices_drop_last_or_distributed(beton):
    """The FFCV Loader's indices=, drop_last and distributed decide which examples an epoch's
    batches hold, but a mid-epoch state did not record them: resumed with other indices of the
    same size (dataset and epoch sizes as saved), it skipped the consumed batches of another
    sequence of examples, silently. They are recorded now and a mismatch is refused at
    load_state_dict, naming the setting; at an epoch boundary they may change."""

    def build(indices, drop_last=False):
        loader = sbffcv.open_beton(
            beton, 30, order="random", seed=4, indices=indices, drop_last=drop_last
        )
        return SelectiveLoader(loader, model(), policy=SelectiveBackprop(0.5), seed=2)

    evens, odds = np.arange(0, N, 2), np.arange(1, N, 2)
    saved = build(evens)
    it = iter(saved)
    next(it)
    state = copy.deepcopy(saved.state_dict())
    del it
    assert state["source"]["version"] == 1 and state["source"]["drop_last"] is False
    with pytest.raises(ValueError, match=r"FFCVSource state has indices='150 examples.*indices="):
        build(odds).load_state_dict(state)
    with pytest.raises(ValueError, match=r"drop_last=False, but this \w+ has \w*drop_last=Tr"):
        build(evens, drop_last=True).load_state_dict(state)  # (30 divides 150: same epoch size)
    for key, value in (("distributed", True), ("indices", "150 examples, digest 0")):
        other = copy.deepcopy(state)
        other["source"][key] = value
        with pytest.raises(ValueError, match=rf"{key}=.*build the FFCV Loader with the saved"):
            build(evens).load_state_dict(other)
    resumed = build(evens)
    resumed.load_state_dict(state)
    assert {i for b in resumed for i in b.indices.tolist()} <= set(evens.tolist())
    # At an epoch boundary other settings are a new choice, not a resume of the saved epoch.
    boundary = build(evens)
    list(boundary)
    build(odds).load_state_dict(boundary.state_dict())


def test_an_ffcv_source_state_saved_before_it_had_a_version_still_resumes(beton):
    """States saved before the source recorded its version, indices=, drop_last and
    distributed load (as version 1, not checked for the keys they lack) and resume exactly."""

    def build():
        loader = sbffcv.open_beton(beton, 30, order="random", seed=4)
        return SelectiveLoader(loader, model(), policy=SelectiveBackprop(1 / 3), seed=2)

    full = [b.indices.tolist() for b in build()]
    first = build()
    it = iter(first)
    got = [next(it).indices.tolist() for _ in range(2)]
    state = copy.deepcopy(first.state_dict())
    del it
    for key in ("version", "indices", "drop_last", "distributed"):
        del state["source"][key]
    resumed = build()
    resumed.load_state_dict(state)
    assert got + [b.indices.tolist() for b in resumed] == full
    with pytest.raises(ValueError, match=r"FFCVSource state has version=2"):
        build().load_state_dict({**state, "source": {**state["source"], "version": 2}})


# ------------------------------------------------------------------ through SelectiveLoader
def test_selective_loader_takes_an_ffcv_loader_directly(beton):
    loader = sbffcv.open_beton(beton, 30, order="random", seed=0)
    sl = SelectiveLoader(loader, model(), policy=SelectiveBackprop(0.5), batch_size=10, seed=0)
    assert isinstance(sl.source, sbffcv.FFCVSource)
    assert sl.expected_batches() == pytest.approx(N * 0.5 / 10)
    for batch in sl:
        images, labels, index = batch
        assert isinstance(batch, tuple) and isinstance(batch, sbloader.SelectedBatch)
        check_pairing(images, labels, batch.indices)
        assert torch.equal(index, batch.indices)
    by_position = SelectiveLoader(loader, model(), policy=Traditional(), index_key=2)
    assert len(by_position) == 10 and all(b.indices is not None for b in by_position)
    # a position counts from either end, as in Python; one past either end is refused
    assert sbffcv.FFCVSource(loader, index_field=-1).index_field == "index"
    assert sbffcv.FFCVSource(loader, index_field=-3).index_field == "image"
    for outside in (3, -4):
        with pytest.raises(ValueError, match=rf"index_field={outside} is no position"):
            sbffcv.FFCVSource(loader, index_field=outside)
    with pytest.raises(TypeError, match=r"an FFCV loader's index output .*index_key=\('index',\)"):
        SelectiveLoader(loader, model(), policy=Traditional(), index_key=("index",))


def test_drop_index_leaves_the_index_output_out(beton):
    loader = sbffcv.open_beton(beton, 30, order="random", seed=0)
    sl = SelectiveLoader(
        loader,
        model(),
        policy=SelectiveBackprop(0.5),
        batch_size=10,
        seed=0,
        drop_index=True,
        batches_per_epoch="expected",
    )
    assert len(sl) == 15
    for _ in range(2):
        n = 0
        for batch in sl:
            images, labels = batch  # (image, label): the index output is left out
            check_pairing(images, labels, batch.indices)
            n += 1
        assert n == 15


def test_subsets_by_loader_indices_and_by_the_loaders_subset(beton):
    ffcv_subset = sbffcv.open_beton(beton, 16, order="random", indices=np.arange(0, N, 3))
    sl = SelectiveLoader(ffcv_subset, model(), policy=RandomBackprop(1.0), remainder="short")
    assert sl.source.epoch_size == N // 3 and sl.source.dataset_size == N
    assert sorted(i for b in sl for i in b.indices.tolist()) == list(range(0, N, 3))
    full = sbffcv.open_beton(beton, 32, order="random")
    subset = np.arange(1, N, 2)
    sl = SelectiveLoader(full, model(), policy=SelectiveBackprop(1.0), subset=subset, seed=0)
    got = [b for _ in range(2) for b in sl]
    assert {i for b in got for i in b.indices.tolist()} <= set(subset.tolist())
    for b in got:
        check_pairing(b[0], b[1], b.indices)


@pytest.mark.parametrize(
    "indices, error, match",
    [
        ([0, 5, N], ValueError, rf"in \[0, {N}\).*but holds {N}"),
        ([0, -1], ValueError, "but holds -1"),
        ([0.0, 1.0], TypeError, "integer dataset indices.*float64"),
    ],
    ids=["past the end", "negative", "floats"],
)
def test_loader_indices_outside_the_file_are_refused_before_reading(beton, indices, error, match):
    """FFCV reads an example at whatever position indices= gives, unchecked: one past the file's
    end yielded garbage images with a garbage index field (Traditional handed them out without
    a word), a negative one wrapped around, and floats failed in FFCV's batch thread at the first
    batch, blamed on a pipeline step. Now open_beton refuses them before building the Loader, and
    SelectiveLoader refuses a Loader built with them directly, naming indices=."""
    with pytest.raises(error, match="^indices= should be .*" + match):
        sbffcv.open_beton(beton, 2, indices=indices)
    from ffcv.loader import Loader

    with sbffcv.preserved_threads():
        raw = Loader(str(beton), 2, num_workers=1, indices=np.array(indices))
    with pytest.raises(error, match="^the FFCV Loader's indices= should be .*" + match):
        SelectiveLoader(raw, model(), policy=Traditional())
    assert sbffcv.open_beton(beton, 2, indices=[N - 1, 0]).indices.tolist() == [N - 1, 0]


def test_an_empty_indices_list_gives_the_loader_int64_indices_as_any_other_does(beton):
    """numpy reads ``indices=[]`` as float64; the Loader gets int64 indices, as for any other
    subset, so that they join other dataset indices without turning them into floats."""
    loader = sbffcv.open_beton(beton, 2, indices=[])
    assert loader.indices.dtype == np.int64 and loader.indices.size == 0
    assert sbffcv.open_beton(beton, 2, indices=[3, 1]).indices.dtype == np.int64
    assert np.concatenate([loader.indices, np.array([3, 1])]).dtype == np.int64


def test_kept_batches_survive_ffcvs_buffer_reuse(beton):
    """Yielded batches (built from pending and carried examples) are copies: kept for many more
    than batches_ahead + 2 iterations, their contents stay exact."""
    loader = sbffcv.open_beton(beton, 30, order="random", seed=1, batches_ahead=1)
    # The control: FFCV's own batches, kept without copying, are overwritten (3 slots).
    with sbffcv.preserved_threads():
        raw = [(idx, idx.clone()) for _, _, idx in loader]
    assert sum(not torch.equal(kept, snapshot) for kept, snapshot in raw) > 0
    sl = SelectiveLoader(
        loader, model(), policy=SelectiveBackprop(1 / 3), batch_size=16, seed=0, remainder="carry"
    )
    kept, carried = [], 0
    for _ in range(3):
        kept += list(sl)
        carried = max(carried, sl.pending_examples)
    assert len(kept) > 3 * (1 + 2) and carried > 0
    for batch in kept:
        images, labels, index = batch
        check_pairing(images, labels, batch.indices)
        assert torch.equal(index, batch.indices)
        expected = nn.functional.cross_entropy(model()(images), labels, reduction="none")
        torch.testing.assert_close(batch.losses, expected)


def test_metadata_read_after_ffcv_reused_the_buffers_is_each_batchs_own(beton):
    """Traditional hands out FFCV's own batches and makes their metadata only when it is read:
    read after the epoch (FFCV has overwritten the batches' data by then), pickled or copied,
    each batch's metadata is still its own."""
    import copy
    import pickle

    loader = sbffcv.open_beton(beton, 30, order="random", seed=1, batches_ahead=1)
    sl = SelectiveLoader(loader, model(), policy=Traditional(), batch_size=30)
    for epoch in range(2):
        batches = list(sl)
        assert len(batches) == N // 30
        # The control: the batches' own index field was overwritten by FFCV (3 buffers).
        fields = torch.cat([b[2] for b in batches]).numpy()
        assert not np.array_equal(fields, np.random.default_rng(1 + epoch).permutation(N))
        pickled = [pickle.loads(pickle.dumps(b)) for b in batches[:3]]
        copied = [copy.deepcopy(b) for b in batches[3:6]]
        order = torch.cat([b.indices for b in batches]).numpy()
        assert np.array_equal(order, np.random.default_rng(1 + epoch).permutation(N))
        for b in batches:
            assert b.indices.dtype == torch.int64 and b.weights.dtype == torch.float32
            assert torch.equal(b.weights, torch.ones(30)) and b.losses.isnan().all()
            assert torch.equal(b.probabilities, torch.ones(30))
        for b, twin in zip(batches, pickled + copied):
            assert torch.equal(b.indices, twin.indices) and torch.equal(b.weights, twin.weights)


def contents(batch) -> list[torch.Tensor]:
    return [t.clone() for t in (batch[0], batch[1], batch.indices)]


def held_epoch(loader: SelectiveLoader, declare: bool, first_call: int | None) -> tuple:
    """One epoch with finishing() called after each batch from batch ``first_call`` on (never
    when None), after runs_ahead() when ``declare``: the batches (held to the end) with their
    contents when handed out, whether each still held them when the caller asked for the next
    batch (after finishing() and a training step's wait, while FFCV's thread fills its
    buffers), and finishing()'s answers."""
    it = iter(loader)
    if declare:
        it.runs_ahead()
    kept, intact, flags = [], [], []
    for b, batch in enumerate(it):
        snapshot = contents(batch)
        if first_call is not None and b >= first_call:
            flags.append(it.finishing())
        time.sleep(0.01)
        intact.append(all(map(torch.equal, contents(batch), snapshot)))
        kept.append((batch, snapshot))
    return kept, intact, flags


def changed(kept: list) -> int:
    """How many held batches no longer hold what they held when handed out."""
    return sum(not all(map(torch.equal, contents(batch), snap)) for batch, snap in kept)


def test_running_ahead_hands_out_copies_of_ffcvs_batches(beton):
    """AcceleratedLoader (gradient accumulation) calls finishing() after each batch, which
    fetches the next FFCV batch while the caller trains on the one handed out: Traditional at
    the source's batch size handed out FFCV's own buffers, overwritten by that fetch. After
    runs_ahead() (which AcceleratedLoader calls), batches are copies: held for the whole epoch,
    each stays as it was when handed out, and pairs its images with its indices."""

    def build() -> SelectiveLoader:
        loader = sbffcv.open_beton(beton, 16, order="random", seed=1, batches_ahead=1)
        return SelectiveLoader(loader, model(), policy=Traditional(), batch_size=16, seed=0)

    plain, _, _ = held_epoch(build(), declare=False, first_call=None)
    assert changed(plain) > 0  # the control: FFCV's own batches, held, are overwritten
    kept, intact, _ = held_epoch(build(), declare=True, first_call=0)
    assert len(kept) == len(plain) and all(intact) and changed(kept) == 0
    for b, _ in kept:
        check_pairing(b[0], b[1], b.indices)

    from sbloader.integrations.accelerate import AcceleratedLoader

    accelerate = pytest.importorskip("accelerate")
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    try:
        accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        loader = sbffcv.open_beton(beton, 16, order="random", seed=1, batches_ahead=1)
        wrapped = AcceleratedLoader(
            SelectiveLoader(loader, model(), policy=Traditional(), batch_size=16, seed=0)
        )
        kept = [(b, b[0].clone(), b.indices.clone()) for b in wrapped]
        assert len(kept) == len(plain)
        for b, images, indices in kept:
            assert torch.equal(b[0], images) and torch.equal(b.indices, indices)
            check_pairing(b[0], b[1], b.indices)
    finally:
        accelerate.state.AcceleratorState._reset_state(True)
        accelerate.state.GradientState._reset_state()


@pytest.mark.parametrize(
    "batch_size, drop_last, min_batch_size, batches",
    [(16, False, None, 19), (32, False, 16, 9), (30, True, None, 10), (32, True, None, 9)],
    ids=["short last batch", "short last batch dropped", "no short batch", "drop_last"],
)
def test_finishing_alone_never_lets_ffcv_overwrite_a_held_batch(
    beton, batch_size, drop_last, min_batch_size, batches
):
    """finishing() called after each batch without runs_ahead(): it used to run ahead as it
    was, taking FFCV's next batch while the caller held FFCV's own (Traditional at the source's
    batch size), which FFCV then overwrote while the caller trained on it. Now every batch stays
    as handed out until the next is asked for, whenever the first call comes (the batch held
    then is FFCV's own: that call answers from the source's size without taking the next
    batch), later ones are copies, the answers are True for the last batch only, and the epoch
    is the one handed out without finishing()."""

    def build() -> SelectiveLoader:
        loader = sbffcv.open_beton(
            beton, batch_size, order="random", seed=1, batches_ahead=1, drop_last=drop_last
        )
        kw = {} if min_batch_size is None else {"min_batch_size": min_batch_size}
        return SelectiveLoader(loader, model(), policy=Traditional(), batch_size=batch_size, **kw)

    plain, intact, _ = held_epoch(build(), declare=False, first_call=None)
    # FFCV's own batches, valid until the next one is asked for (the plain path copies nothing)
    assert len(plain) == batches and all(intact) and changed(plain) > 0
    for first_call in (0, batches - 2, batches - 1):
        kept, intact, flags = held_epoch(build(), declare=False, first_call=first_call)
        assert flags == [False] * (batches - first_call - 1) + [True]
        assert all(intact) and changed(kept[first_call + 1 :]) == 0  # copies from then on
        assert [b.indices.tolist() for b, _ in kept] == [s[2].tolist() for _, s in plain]
        for b, _ in kept[first_call + 1 :]:
            check_pairing(b[0], b[1], b.indices)


def test_prefetch_is_refused_naming_ffcvs_batches_ahead(beton):
    """prefetch= fetched FFCV batches ahead on sbloader's thread, which let FFCV's batch thread
    write over the batch being selected from (and those queued behind it) in its ring of
    batches_ahead + 2 buffers: images, labels and indices of the yielded batches no longer
    belonged together. FFCV fetches ahead itself, so prefetch > 0 is refused when the loader is
    built, naming prefetch= and batches_ahead."""
    loader = sbffcv.open_beton(beton, 30, order="random", seed=1, batches_ahead=1)
    for policy in (SelectiveBackprop(1 / 3), Traditional()):
        with pytest.raises(ValueError, match=r"prefetch=1.*prefetch=0.*batches_ahead"):
            SelectiveLoader(loader, model(), policy=policy, batch_size=16, prefetch=1)
    for prefetch in (None, 0):
        sl = SelectiveLoader(loader, model(), batch_size=16, seed=0, prefetch=prefetch)
        assert sl.prefetch == 0
        for batch in sl:
            check_pairing(batch[0], batch[1], batch.indices)
    with pytest.raises(ValueError, match=r"prefetch=1.*prefetch=0.*batches_ahead"):
        sl.prefetch = 1  # set after construction: refused as well
    assert sl.prefetch == 0


@pytest.mark.filterwarnings("ignore:overlap_selection=True with")
def test_overlapped_passes_read_ffcv_batches_before_their_buffers_are_reused(beton):
    """overlap_selection holds the next FFCV batch while the caller trains (3 buffer slots with
    batches_ahead=1, a slow caller so that FFCV fills them): every loss still belongs to its
    own example, and the selections are those of an unshuffled DataLoader with overlap."""
    runs = []
    for source in (
        sbffcv.open_beton(beton, 30, order="sequential", num_workers=1, batches_ahead=1),
        dataloader_twin(30),
    ):
        sl = SelectiveLoader(
            source,
            model(),
            policy=SelectiveBackprop(1 / 3, history=64),
            batch_size=16,
            seed=7,
            overlap_selection=True,
        )
        run = []
        for _ in range(2):
            for batch in sl:
                time.sleep(0.005)
                images, labels = batch[0], batch[1]
                check_pairing(images, labels, batch.indices)
                expected = nn.functional.cross_entropy(model()(images), labels, reduction="none")
                torch.testing.assert_close(batch.losses, expected)
                run.append(batch.indices.tolist())
        runs.append(run)
    assert runs[0] == runs[1] and len(runs[0]) > 6


def dataloader_twin(batch_size: int) -> DataLoader:
    images, labels = encoded_arrays()
    data = TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def linear_model() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(16, N_CLASSES))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return m


@pytest.mark.parametrize(
    "policy",
    [
        lambda: SelectiveBackprop(1 / 3, history=64),
        lambda: SelectiveBackprop(1 / 3, history=64, staleness=2),
        lambda: RandomBackprop(0.5),
        lambda: Traditional(),
    ],
    ids=["sb", "stale-sb", "random", "traditional"],
)
@pytest.mark.parametrize("make_model", [model, linear_model], ids=["index-loss", "linear"])
def test_ffcv_and_dataloader_give_the_same_selections(beton, policy, make_model):
    """Same seed, data and example order (FFCV SEQUENTIAL vs an unshuffled DataLoader, same batch
    size): the same examples are selected, with the same losses, in the same batches."""
    runs = []
    for source in (
        sbffcv.open_beton(beton, 30, order="sequential", num_workers=1),
        dataloader_twin(30),
    ):
        sl = SelectiveLoader(source, make_model(), policy=policy(), batch_size=20, seed=7)
        run = []
        for _ in range(3):
            for batch in sl:
                check_pairing(batch[0], batch[1], batch.indices)
                run.append((batch.indices.tolist(), batch.losses.clone(), batch[0].clone()))
        runs.append(run)
    ffcv_run, dl_run = runs
    assert [r[0] for r in ffcv_run] == [r[0] for r in dl_run]
    for (_, la, xa), (_, lb, xb) in zip(ffcv_run, dl_run):
        assert torch.equal(xa, xb)
        torch.testing.assert_close(la, lb, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["SEQUENTIAL", "RANDOM", "QUASI_RANDOM"])
def test_open_beton_takes_ffcvs_own_order_option_as_its_name(beton, name):
    """ffcv's ``OrderOption`` was refused, asking for the string ffcv's own Loader does not
    take; it reads as its name (the same traversal), and the name stays checked."""
    from ffcv.loader import OrderOption  # (imported by this module's preserved import)

    def order(option):
        loader = sbffcv.open_beton(beton, 30, order=option, seed=4)
        with sbffcv.preserved_threads():  # (a bare ffcv Loader's iteration sets torch's threads)
            return [np.asarray(b[-1]).ravel().tolist() for b in loader]

    assert order(getattr(OrderOption, name)) == order(name.lower())
    with pytest.raises(ValueError, match="order should be one of"):
        sbffcv.open_beton(beton, 30, order=3)


def test_mid_epoch_resume_with_a_random_order(beton):
    def build():
        loader = sbffcv.open_beton(beton, 30, order="random", seed=4)
        return SelectiveLoader(
            loader, model(), policy=SelectiveBackprop(1 / 3, history=64), batch_size=16, seed=2
        )

    full = [b.indices.tolist() for b in build_and_run(build(), 3)]
    first = build()
    got = [b.indices.tolist() for b in first]
    it = iter(first)
    got += [next(it).indices.tolist() for _ in range(2)]
    state = copy.deepcopy(first.state_dict())
    del it
    resumed = build()
    resumed.load_state_dict(state)
    got += [b.indices.tolist() for b in resumed]  # the rest of epoch 2
    got += [b.indices.tolist() for b in resumed]  # epoch 3
    assert got == full


def test_a_sequential_order_resumes_mid_epoch_in_a_loader_of_another_seed(beton):
    """A SEQUENTIAL order does not depend on the seed: a mid-epoch state resumes, in a loader
    built with another seed, with the rest of the uninterrupted run's epoch."""

    def build(seed: int) -> SelectiveLoader:
        loader = sbffcv.open_beton(beton, 30, order="sequential", seed=seed)
        return SelectiveLoader(
            loader, model(), policy=SelectiveBackprop(1 / 3), batch_size=16, seed=2
        )

    full = [b.indices.tolist() for b in build(0)]
    first = build(0)
    it = iter(first)
    got = [next(it).indices.tolist() for _ in range(2)]
    state = copy.deepcopy(first.state_dict())
    del it
    resumed = build(5)
    resumed.load_state_dict(state)
    assert got + [b.indices.tolist() for b in resumed] == full


def test_a_checkpoint_the_run_went_past_resumes_exactly(beton):
    """Crash recovery with FFCV: a mid-epoch state (Stale-SB, whose stale epoch decides from the
    stored losses) kept while the run goes on through the next epochs (FFCV's epoch counter,
    its buffers and the store move on), then resumed by a new loader: the rest of the
    uninterrupted run exactly."""

    def build():
        loader = sbffcv.open_beton(beton, 30, order="random", seed=4)
        policy = SelectiveBackprop(1 / 3, history=64, staleness=2)
        return SelectiveLoader(loader, model(), policy=policy, batch_size=16, seed=2)

    full = [b.indices.tolist() for b in build_and_run(build(), 4)]
    first = build()
    got = [b.indices.tolist() for b in first]
    it = iter(first)
    got += [next(it).indices.tolist() for _ in range(2)]
    state = copy.deepcopy(first.state_dict())
    for _ in it:
        pass
    for _ in range(2):
        list(first)
    del it, first
    resumed = build()
    resumed.load_state_dict(state)
    for _ in range(3):
        got += [b.indices.tolist() for b in resumed]
    assert got == full


def test_a_state_saved_mid_epoch_keeps_its_batches_while_the_run_goes_on(beton):
    """Traditional hands out FFCV's own batches (source batch size = batch size). A state saved
    with unconsumed=1 (the last batch handed out, not trained yet), or after finishing() made the
    next batch ready, kept those batches as views of FFCV's reused buffers: once the run went on
    they held other examples, and the resumed run handed out images that were not its indices."""

    def build():
        loader = sbffcv.open_beton(beton, 30, order="random", seed=1, batches_ahead=1)
        return SelectiveLoader(loader, model(), policy=Traditional(), seed=0)

    sl = build()
    it = iter(sl)
    for _ in range(3):
        last = next(it)
    taken_back = sl.state_dict(unconsumed=1)
    expected = [last.indices.clone()]
    assert not it.finishing()  # runs ahead to the next batch, which the state keeps
    made_ready = sl.state_dict()
    for _ in range(6):  # FFCV writes over its 3 buffers twice
        expected.append(next(it).indices.clone())
    del it
    for state, first in ((taken_back, expected[:2]), (made_ready, expected[1:2])):
        resumed = build()
        resumed.load_state_dict(state)
        got = []
        for batch in resumed:  # FFCV's own batches are valid until the next one
            check_pairing(batch[0], batch[1], batch.indices)
            got.append(batch.indices.tolist())
        assert got[: len(first)] == [i.tolist() for i in first]


def build_and_run(loader: SelectiveLoader, epochs: int) -> list:
    return [b for _ in range(epochs) for b in loader]


# ------------------------------------------------------------------ writing
def test_write_a_map_style_dataset_and_read_it_back(tmp_path):
    class Samples:
        def __len__(self):
            return 50

        def __getitem__(self, i):
            return torch.full((2, 3), float(i)), i % 5, float(i) / 2

    path = sbffcv.write_beton(tmp_path / "ds.beton", Samples(), names=("x", "y", "half"))
    loader = sbffcv.open_beton(path, 16)
    source = sbffcv.FFCVSource(loader)
    assert source.outputs == ["x", "y", "half", "index"]
    seen = []
    for (x, y, half, _), indices in source.epoch():
        idx = torch.from_numpy(indices)
        assert torch.equal(x, idx[:, None, None].float().expand(-1, 2, 3))
        assert torch.equal(y, idx % 5) and torch.allclose(half, idx.double() / 2)
        seen += indices.tolist()
    assert seen == list(range(50))


def test_a_bad_sample_raises_naming_it_and_removes_the_file(tmp_path):
    class Bad:
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return np.zeros((3,) if i != 17 else (4,), np.float32), 0

    path = tmp_path / "bad.beton"
    with pytest.raises(ValueError, match="sample 17 has shape"):
        sbffcv.write_beton(path, Bad())
    assert not path.exists()
    with pytest.raises(ValueError, match="same length"):
        sbffcv.write_beton(path, (np.zeros((3, 2)), np.zeros(4)))
    with pytest.raises(ValueError, match="index_field="):
        sbffcv.write_beton(path, (np.zeros((3, 2)), np.zeros(3, np.int64)), names=("a", "index"))


# ------------------------------------------------------------------ side effects
def test_using_ffcv_through_sbloader_never_changes_thread_counts(tmp_path):
    """From a fresh process: importing ffcv, writing, building a Loader and iterating (including
    abandoning an epoch) leave torch's and numba's thread counts as they were."""
    code = textwrap.dedent(
        f"""
        import sys, threading, numba, numpy as np, torch
        import sbloader, sbloader.ffcv as F
        torch.set_num_threads(2)
        assert "ffcv" not in sys.modules, "import sbloader.ffcv imported ffcv"

        def counts():
            out = []
            t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
            t.start(); t.join()
            return torch.get_num_threads(), numba.get_num_threads(), out[0]

        before = counts()
        images = np.repeat(np.arange(200, dtype=np.float32), 16).reshape(200, 1, 4, 4)
        path = F.write_beton({str(tmp_path / "t.beton")!r}, (images, np.arange(200) % 4))
        assert counts() == before, ("write", counts(), before)
        loader = F.open_beton(path, 20, order="random", num_workers=1)
        assert counts() == before, ("open", counts(), before)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
        for policy in (sbloader.Traditional(), sbloader.SelectiveBackprop(0.5)):
            sl = sbloader.SelectiveLoader(loader, model, policy=policy, batch_size=10)
            for _ in range(2):
                for batch in sl:
                    assert counts() == before, ("batch", counts(), before)
            for batch in sl:
                break
            assert counts() == before, ("break", counts(), before)
        print("ok")
        """
    )
    out = run_python(code, timeout=240)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def ffcv_batch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if type(t).__name__ == "EpochIterator"]


def test_closing_an_abandoned_epoch_stops_ffcvs_batch_thread(beton):
    """An epoch abandoned once FFCV's thread has produced its last batch: that thread waits for
    room in its full queue without a timeout, and closing the epoch must still end it."""
    loader = sbffcv.open_beton(beton, 30, order="random", seed=0)  # 10 batches, 3 ahead
    source = sbffcv.FFCVSource(loader)
    before = set(ffcv_batch_threads())
    epoch = source.epoch()
    for _ in range(7):  # holding batch 6; batches 7, 8, 9 fill the queue
        held, _ = next(epoch)
    (thread,) = set(ffcv_batch_threads()) - before
    deadline = time.monotonic() + 60
    while not (operator.length_hint(thread.iter_ixes) == 0 and thread.output_queue.full()):
        assert time.monotonic() < deadline, "FFCV's thread never produced the epoch's batches"
        time.sleep(0.01)
    snapshot = [x.clone() for x in held]
    epoch.close()
    assert not thread.is_alive()
    # Stopping computed no further batch: the batch the caller still holds is intact.
    assert all(torch.equal(x, y) for x, y in zip(held, snapshot))
    next_epoch = source.epoch()
    next(next_epoch)
    del next_epoch  # garbage-collected: the same
    assert set(ffcv_batch_threads()) <= before


@pytest.mark.parametrize("launched_by", ["sbloader", "user"])
def test_breaking_out_of_epochs_on_one_core_exits(tmp_path, launched_by):
    """Issue 11: a process with one usable core that writes a .beton (forking writer processes)
    and breaks out of FFCV epochs through SelectiveLoader must exit. It hung at exit in numba's
    TBB teardown (see sbloader.ffcv._launch_numba_threads), whether sbloader or the user first
    launched numba's threading layer, and left FFCV's batch thread of an epoch abandoned near
    its end blocked forever."""
    user_launch = "numba.get_num_threads()" if launched_by == "user" else ""
    code = textwrap.dedent(
        f"""
        import os
        os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})  # before numba and TBB load
        import threading, numba, numpy as np, torch, sbloader, sbloader.ffcv as F
        {user_launch}
        images = np.repeat(np.arange(200, dtype=np.float32), 16).reshape(200, 1, 4, 4)
        path = F.write_beton({str(tmp_path / "one.beton")!r}, (images, np.arange(200) % 4))
        loader = F.open_beton(path, 20, order="random", num_workers=1)  # 10 batches
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
        for policy in (sbloader.Traditional(), sbloader.SelectiveBackprop(0.5)):
            sl = sbloader.SelectiveLoader(loader, model, policy=policy, batch_size=10)
            for stop in (0, 6):
                for i, batch in enumerate(sl):
                    if i == stop:
                        break
                for batch in sl:
                    pass
        left = [t for t in threading.enumerate() if type(t).__name__ == "EpochIterator"]
        assert not left, left
        print("ok", flush=True)
        """
    )
    env = checkout_env()
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        where = "at exit, after printing ok" if out.strip().endswith("ok") else "before ok"
        pytest.fail(f"the one-core process hung {where}: {err[-2000:]}")
    assert out.strip().endswith("ok") and child.returncode == 0, err[-3000:]


def test_an_error_in_ffcvs_batch_thread_raises_instead_of_hanging(beton):
    """A pipeline step that raises (here a torch module, run on FFCV's batch thread) kills that
    thread without ending its queue, and FFCV's next() then waits forever: the epoch hung
    instead of failing. It raises RuntimeError once the thread has died, through the source and
    through SelectiveLoader, and the next epoch runs."""
    code = textwrap.dedent(
        f"""
        import threading, torch, sbloader, sbloader.ffcv as F
        F.import_ffcv()
        from ffcv.fields.decoders import NDArrayDecoder
        from ffcv.transforms import ToTensor

        class Boom(torch.nn.Module):
            calls = 0

            def forward(self, x):
                Boom.calls += 1
                if Boom.calls == 3:
                    raise ValueError("boom")
                return x

        pipe = {{"image": [NDArrayDecoder(), ToTensor(), Boom()]}}
        loader = F.open_beton({str(beton)!r}, 30, pipelines=pipe)  # 10 batches
        for make in (
            lambda: (b for b, _ in F.FFCVSource(loader).epoch()),
            lambda: iter(sbloader.SelectiveLoader(loader, torch.nn.Flatten(), batch_size=16)),
        ):
            Boom.calls, seen = 0, 0
            try:
                for batch in make():
                    seen += 1
                raise AssertionError("no error")
            except RuntimeError as e:
                assert "batch thread" in str(e) and "pipeline" in str(e), e
            assert 1 <= seen <= 2, seen
        left = [t for t in threading.enumerate() if type(t).__name__ == "EpochIterator"]
        assert not left, left
        assert len([b for b, _ in F.FFCVSource(loader).epoch()]) == 10  # Boom.calls is past 3
        print("ok", flush=True)
        """
    )
    try:
        out = run_python(code, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the epoch hung after FFCV's batch thread died")
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_examples_skipped_without_ffcv_run_with_it(tmp_path, monkeypatch):
    """The docstring examples that write and read a .beton are marked +SKIP, so that the
    module's doctests pass where ffcv is not installed; here, with ffcv, they run unskipped (in
    order: open_beton's reads the file of write_beton's), in a temporary folder."""
    import doctest

    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    skipped = 0
    for name in ("write_beton", "open_beton", "FFCVSource"):
        finder = doctest.DocTestFinder(recurse=False)
        (test,) = finder.find(getattr(sbffcv, name), name, globs=dict(vars(sbffcv)))
        for example in test.examples:
            skipped += example.options.pop(doctest.SKIP, False)
        runner.run(test)
    assert skipped >= 8 and runner.failures == 0 and (tmp_path / "toy.beton").exists()


def test_import_sbloader_ffcv_and_a_dataloader_source_never_import_ffcv():
    code = (
        "import sys, torch, sbloader, sbloader.ffcv; "
        "from torch.utils.data import DataLoader, TensorDataset; "
        "dl = DataLoader(TensorDataset(torch.zeros(8, 2), torch.zeros(8).long()), batch_size=4); "
        "list(sbloader.SelectiveLoader(dl, torch.nn.Linear(2, 2))); "
        "list(sbloader.SelectiveLoader([(torch.zeros(4, 2), torch.zeros(4).long())], "
        "torch.nn.Linear(2, 2), batch_size=2)); "
        "assert 'ffcv' not in sys.modules; print('ok')"
    )
    out = run_python(code, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_scalar_fields_read_back_as_ffcv_stores_them_and_float32_is_warned_of(tmp_path):
    """ffcv stores per-example scalars as int64 or float64: integer labels (uint8 here) come back
    int64, and float32 scalars float64, of which write_beton warns naming the fix."""
    images, _ = encoded_arrays(12)
    small = (np.arange(12) % N_CLASSES).astype(np.uint8)
    target = (np.arange(12) / 12).astype(np.float32)
    with pytest.warns(UserWarning, match=r"'target' holds float32 scalars.*NDArrayField"):
        path = sbffcv.write_beton(
            tmp_path / "dtypes.beton", (images, small, target), names=("image", "label", "target")
        )
    with sbffcv.preserved_threads():  # (a bare ffcv Loader's iteration sets torch's threads)
        _, label, got, index = next(iter(sbffcv.open_beton(path, 4)))
    assert label.dtype == torch.int64 and got.dtype == torch.float64
    assert torch.equal(label, index % N_CLASSES)
    assert torch.allclose(got, torch.as_tensor(target[index.numpy()], dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float64 and integer scalars: nothing to warn of
        sbffcv.write_beton(
            tmp_path / "plain.beton",
            (images, small, target.astype(np.float64)),
            names=("image", "label", "target"),
        )


def test_only_int_and_float_scalar_fields_are_flattened(tmp_path):
    """FFCVSource flattens the (B, 1) outputs of IntField and FloatField to (B,); an NDArrayField
    of shape (1,) (what write_beton's float32 warning suggests) keeps its written shape (B, 1)."""
    fields_mod = pytest.importorskip("ffcv.fields")
    images, labels = encoded_arrays(12)
    target = (np.arange(12) / 12).astype(np.float32).reshape(12, 1)
    fields = {
        "image": fields_mod.NDArrayField(np.dtype("float32"), (1, 4, 4)),
        "label": fields_mod.IntField(),
        "target": fields_mod.NDArrayField(np.dtype("float32"), (1,)),
    }
    path = sbffcv.write_beton(tmp_path / "kept.beton", (images, labels, target), fields=fields)
    seen = []
    for (_, label, got, index), idx in sbffcv.FFCVSource(sbffcv.open_beton(path, 4)).epoch():
        assert label.shape == index.shape == (4,) and got.shape == (4, 1)
        assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(target[idx]))
        seen += idx.tolist()
    assert seen == list(range(12))


def test_an_int_field_of_several_values_is_refused_naming_it(tmp_path):
    """An IntField holds one integer per example: a sample with several is refused, saying so
    (not numpy's "cannot reshape array"), and nothing is written."""
    fields_mod = pytest.importorskip("ffcv.fields")
    images, _ = encoded_arrays(8)
    pairs = np.stack([np.arange(8), np.arange(8)], axis=1)  # two labels per example
    fields = {
        "image": fields_mod.NDArrayField(np.dtype("float32"), (1, 4, 4)),
        "label": fields_mod.IntField(),
    }
    path = tmp_path / "pairs.beton"
    with pytest.raises(ValueError, match=r"^sample 0 should be one integer, but got array"):
        sbffcv.write_beton(path, (images, pairs), fields=fields)
    assert not path.exists()


def test_el2n_scores_refuses_an_ffcv_loader_that_drops_its_last_batch(beton):
    """el2n_scores scores every example in one pass: an FFCV Loader with drop_last=True (300
    examples in batches of 32) would leave 12 unscored, and is refused as a DataLoader is."""
    loader = sbffcv.open_beton(beton, 32, drop_last=True)
    assert sbffcv.FFCVSource(loader).drop_last()
    with pytest.raises(ValueError, match=r"its last partial batch is dropped \(drop_last=True\)"):
        sbloader.el2n_scores(
            model, loader, make_optimizer=lambda m: torch.optim.SGD(m.parameters(), 0.1)
        )


def test_el2n_scores_leaves_an_ffcv_loaders_next_order_as_it_was(beton):
    """el2n_scores puts the source's state back so that the training that follows reads the
    same order; over an FFCV Loader it left FFCV's epoch counter models * (epochs + 1) epochs
    on, so a bare loop over the Loader afterwards read another epoch's order."""

    def first_order(loader) -> list[int]:
        with sbffcv.preserved_threads():
            return [i for _, _, index in loader for i in index.tolist()]

    expected = first_order(sbffcv.open_beton(beton, 32, order="random", seed=0))
    loader = sbffcv.open_beton(beton, 32, order="random", seed=0)
    sbloader.el2n_scores(
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(16, N_CLASSES)),
        loader,
        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), 0.01),
        models=2,
        epochs=1,
    )
    assert loader.next_epoch == 0
    assert first_order(loader) == expected


def test_a_missing_index_field_names_the_source_that_reads_without_one(tmp_path):
    fields_mod = pytest.importorskip("ffcv.fields")
    images, labels = encoded_arrays(20)
    fields = {
        "image": fields_mod.NDArrayField(np.dtype("float32"), (1, 4, 4)),
        "label": fields_mod.IntField(),
    }
    path = sbffcv.write_beton(tmp_path / "noindex.beton", (images, labels), fields=fields)
    loader = sbffcv.open_beton(path, 8, order="random", seed=0)
    loader_without = sbffcv.open_beton(path, 8, order="random", seed=0)
    with pytest.raises(ValueError, match=r"FFCVSource\(loader, index_field=None\)"):
        sbffcv.FFCVSource(loader_without, index_field="idx")
    source = sbffcv.FFCVSource(loader, index_field=None)
    batches = list(SelectiveLoader(source, model(), policy=Traditional(), batch_size=8))
    for b in batches:
        check_pairing(b[0], b[1], b.indices)


def test_write_beton_refuses_float16_arrays_before_writing(tmp_path):
    """ffcv writes float16 NDArrayFields but cannot read them back (the first batch failed in
    its thread, after the whole file was written): refused first, naming the field and the fix,
    also through fields=; nothing is written."""
    images = np.random.default_rng(0).random((16, 1, 4, 4)).astype(np.float16)
    path = tmp_path / "half.beton"
    with pytest.raises(ValueError, match=r"field 'image' is a float16 NDArrayField.*float32"):
        sbffcv.write_beton(path, (images, np.arange(16)))
    fields_mod = __import__("ffcv.fields", fromlist=["NDArrayField"])
    with pytest.raises(ValueError, match=r"field 'x' is a float16 NDArrayField"):
        sbffcv.write_beton(
            path,
            (images,),
            fields={"x": fields_mod.NDArrayField(np.dtype("float16"), (1, 4, 4))},
        )
    assert not path.exists()


def test_a_users_own_class_named_as_ffcvs_is_not_taken_for_it():
    """ffcv's classes are recognised by name and package, not by name alone: a user's order
    class named QuasiRandom kept its page table untouched (ffcv's is rebuilt and restored per
    epoch), and a user's field class named NDArrayField of float16 is not refused as ffcv's."""

    class QuasiRandom:
        rebuilt = 0

        def prepare_data_structures(self):
            self.rebuilt += 1

    own = QuasiRandom()
    assert sbffcv._quasi_pages(own) is None and own.rebuilt == 0

    class NDArrayField:
        dtype = np.dtype("float16")

    sbffcv._check_readable("x", NDArrayField())  # (not ffcv's: nothing to refuse)
    fields_mod = __import__("ffcv.fields", fromlist=["NDArrayField"])
    with pytest.raises(ValueError, match="float16 NDArrayField"):
        sbffcv._check_readable("x", fields_mod.NDArrayField(np.dtype("float16"), (1,)))


def test_write_beton_takes_a_list_of_samples_as_a_dataset(tmp_path):
    """A list of (image, label) samples is a map-style dataset: written as its 40 samples (it
    was read as 40 columns and refused asking for 40 names); a list of columns whose first is a
    Python list, [images, labels], is still columns."""
    samples = [(np.full((1, 4, 4), i, np.float32), i % 10) for i in range(40)]
    path = sbffcv.write_beton(tmp_path / "list.beton", samples)
    loader = SelectiveLoader(
        sbffcv.open_beton(path, 8), nn.Flatten(), policy=Traditional(), batch_size=8
    )
    seen = sorted(int(i) for b in loader for i in b.indices)
    assert seen == list(range(40))
    x, y = next(iter(loader))[:2]
    assert torch.equal(y, x[:, 0, 0, 0].long() % 10)
    images = [np.full((1, 4, 4), i, np.uint8) for i in range(5)]
    columns = sbffcv.write_beton(tmp_path / "columns.beton", [images, np.arange(5)])
    assert sbffcv.FFCVSource(sbffcv.open_beton(columns, 5)).outputs == ["image", "label", "index"]


def written(path: Path) -> dict[str, torch.Tensor]:
    """A .beton's outputs, read in order and concatenated."""
    loader = sbffcv.open_beton(path, 7)
    with sbffcv.preserved_threads():
        batches = [[t.clone() for t in b] for b in loader]
    return {name: torch.cat(col) for name, col in zip(loader.pipeline_specs, zip(*batches))}


def test_write_beton_takes_dicts_of_columns_and_datasets_of_dicts(tmp_path):
    """A dict of columns, {"image": x, "label": y}, was read as a dataset (KeyError: 0), and a
    dataset of dict samples (as Hugging Face's and many others' items are) was refused asking
    for fields= that could not help. Now the dict's keys name the fields (names= or fields=
    pick and order the entries written), and a sample missing an entry is named."""
    images = np.arange(20 * 4, dtype=np.float32).reshape(20, 4)
    labels = np.arange(20) % 3
    out = written(sbffcv.write_beton(tmp_path / "d.beton", {"label": labels, "x": images}))
    assert list(out) == ["label", "x", "index"]
    assert torch.equal(out["x"], torch.from_numpy(images))
    assert torch.equal(out["label"].reshape(-1), torch.from_numpy(labels))
    samples = [{"name": f"{i}.png", "y": int(labels[i]), "x": images[i]} for i in range(20)]
    out = written(sbffcv.write_beton(tmp_path / "s.beton", samples, names=["x", "y"]))
    assert list(out) == ["x", "y", "index"]
    assert torch.equal(out["x"], torch.from_numpy(images))
    assert torch.equal(out["y"].reshape(-1), torch.from_numpy(labels))
    assert torch.equal(out["index"].reshape(-1), torch.arange(20))
    with pytest.raises(ValueError, match=r"data has no entry 'label'.*names= or fields="):
        sbffcv.write_beton(tmp_path / "e.beton", {"image": images}, names=["image", "label"])
    samples[5] = {"x": images[5]}
    with pytest.raises(ValueError, match="sample 5 has no entry 'y'"):
        sbffcv.write_beton(tmp_path / "e.beton", samples, names=["x", "y"])
    assert not (tmp_path / "e.beton").exists()
