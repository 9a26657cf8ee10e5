"""mosaicml-streaming as a source: MDS written with sbloader, read back keyed by sample id, resumed
through StreamingDataLoader's own state, on one process and on two gloo ranks."""

from __future__ import annotations

import datetime
import gc
import io
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import (
    N_CLASSES,
    EncodedDataset,
    IndexLoss,
    expected_losses,
    import_streaming,
    streaming_env,
)
from launch import end_process_group, free_port, leave, spawn_ranks
from torch import nn

from sbloader import SelectiveBackprop, SelectiveLoader, Traditional
from sbloader.datasets import load_fashion_mnist

import_streaming()  # skips the module where mosaicml-streaming is not installed
sbs = pytest.importorskip("sbloader.streaming")

ROOT = Path(__file__).resolve().parents[1]
N = 120
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def mds(tmp_path) -> Path:
    """EncodedDataset(N) written as MDS: image i is [i, ..., i], label i % N_CLASSES."""
    return sbs.write_mds(tmp_path / "mds", EncodedDataset(N))


def released(*objects) -> None:
    """Collect the garbage after a test's last use of a loader (and its StreamingDataset):
    streaming lets one dataset per local directory live at a time, and frees its shared memory
    when the dataset is collected. Only objects no caller still refers to are freed: a test that
    opens the same directory again drops its own references first (``del``)."""
    del objects
    gc.collect()


def make_loader(local, policy=None, prefetch=0, mds=None, **kw) -> SelectiveLoader:
    """SB over ``open_mds(local, 24, shuffle=True, seed=7)`` (``mds``: other open_mds settings)."""
    source = sbs.open_mds(local, 24, **{"shuffle": True, "seed": 7, **(mds or {})})
    return SelectiveLoader(
        source,
        IndexLoss(),
        policy=policy or SelectiveBackprop(0.5),
        batch_size=10,
        seed=0,
        input_key="image",
        target_key="label",
        prefetch=prefetch,
        **kw,
    )


def check_pairing(batch) -> None:
    """Each yielded example's image, label and index (its sample id) belong together."""
    idx = batch.indices
    assert torch.equal(batch["sample_id"], idx)
    assert torch.equal(batch["image"][:, 0].long(), idx)
    assert torch.equal(batch["label"], idx % N_CLASSES)


def run(loader, epochs: int) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        for b in loader:
            check_pairing(b)
            out.append(b.indices.tolist())
    return out


def checkpoint(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def test_write_mds_is_read_back_with_each_samples_own_id(mds):
    loader = sbs.open_mds(mds, 16, shuffle=True, seed=1)
    epochs = []
    for _ in range(2):
        ids = []
        for b in loader:
            assert torch.equal(b["image"][:, 0].long(), b["sample_id"])
            assert torch.equal(b["label"], b["sample_id"] % N_CLASSES)
            ids += b["sample_id"].tolist()
        assert sorted(ids) == list(range(N))
        epochs.append(ids)
    assert epochs[0] != epochs[1]  # shuffled anew every epoch
    released(loader)


def test_a_streaming_loader_is_a_source_keyed_by_sample_id(mds):
    loader = make_loader(mds)
    source = loader.source
    assert isinstance(source, sbs.StreamingSource)
    assert source.has_indices() and source.dataset_size == N and source.epoch_size == N
    assert len(run(loader, 1)) >= 5
    released(loader, source)


def test_a_resume_state_read_while_another_rank_writes_it_is_read_again(mds, monkeypatch):
    """streaming's state_dict() reads the resume state another rank's load_state_dict() writes
    into shared memory; read between the block's creation and the write, it is empty and json
    fails (two ranks resuming together met it: the loader reads its source's state as it loads
    one). The source reads it again, and fails only where it never becomes whole."""
    import json

    loader = make_loader(mds)
    source = loader.source
    real, calls = source.loader.state_dict, []

    def torn(limit: int):
        def state_dict():
            calls.append(1)
            return json.loads("") if len(calls) <= limit else real()

        return state_dict

    monkeypatch.setattr(source.loader, "state_dict", torn(2))
    assert source.state_dict()["loader"] == real() and len(calls) == 3
    calls.clear()
    monkeypatch.setattr(source.loader, "state_dict", torn(10**6))
    with pytest.raises(json.JSONDecodeError):
        source.state_dict()
    assert len(calls) == sbs._READS
    released(loader, source)


def test_a_dataset_without_sample_ids_needs_an_index_key(mds):
    streaming = import_streaming()
    dataset = streaming.StreamingDataset(local=str(mds), batch_size=8)
    loader = streaming.StreamingDataLoader(dataset, batch_size=8)
    with pytest.raises(TypeError, match="IndexedStreamingDataset"):
        SelectiveLoader(loader, IndexLoss(), input_key="image", target_key="label")
    released(loader, dataset)


@pytest.mark.parametrize(("stop", "prefetch"), [((1, 3), 0), ((1, 3), 1), ((1, 0), 1)])
def test_mid_epoch_resume_yields_what_an_uninterrupted_run_does(mds, stop, prefetch):
    epochs = 3
    loader = make_loader(mds, prefetch=prefetch)
    reference = run(loader, epochs)
    released(loader)

    full, steps = stop
    loader = make_loader(mds, prefetch=prefetch)
    before = run(loader, full)
    it = iter(loader)
    for _ in range(steps):
        b = next(it)
        check_pairing(b)
        before.append(b.indices.tolist())
    state = checkpoint(loader.state_dict())
    it.close()
    released(loader, it)

    resumed = make_loader(mds, prefetch=prefetch)  # a new dataset, loader and model
    resumed.load_state_dict(state)
    assert before + run(resumed, epochs - full) == reference
    released(resumed)


def test_steps_capped_per_epoch_and_a_state_at_each_epochs_end_resume_exactly(mds):
    """A loop that leaves each epoch after 3 batches (`break`), ends it (loader.end_epoch())
    and saves as each epoch ends: the state starts the next epoch, as the loop's next iter()
    does, so the resumed run (a new dataset and loader) yields the rest of the uninterrupted
    run (found by review: without end_epoch() it went on with the rest of the left epoch, a
    pass behind for good; that is warned of where the loop goes on)."""
    cap, epochs = 3, 4

    def capped(loader, n):
        out = []
        for _ in range(n):
            for k, b in enumerate(loader):
                check_pairing(b)
                out.append(b.indices.tolist())
                if k + 1 == cap:
                    break
            loader.end_epoch()
        return out

    loader = make_loader(mds)
    reference = capped(loader, epochs)
    released(loader)
    loader = make_loader(mds)
    before = capped(loader, 2)
    state = checkpoint(loader.state_dict())
    assert state["epoch"] == 2 and not state["active"]
    released(loader)
    resumed = make_loader(mds)
    resumed.load_state_dict(state)
    assert before + capped(resumed, epochs - 2) == reference
    released(resumed)


def test_a_checkpoint_the_run_went_past_resumes_exactly(mds):
    """Crash recovery: a mid-epoch state kept while the run goes on into the next epoch (the
    dataset's own epoch and resume state move on), then the process dies; resumed from that
    state a new dataset and loader yield exactly the rest of the uninterrupted run."""
    epochs = 3
    loader = make_loader(mds)
    reference = run(loader, epochs)
    released(loader)

    loader = make_loader(mds)
    before = run(loader, 1)
    it = iter(loader)
    before += [next(it).indices.tolist() for _ in range(3)]
    state = checkpoint(loader.state_dict())
    for _ in it:  # the run goes on past the checkpoint
        pass
    run(loader, 1)
    it.close()
    released(loader, it)

    resumed = make_loader(mds)
    resumed.load_state_dict(state)
    assert before + run(resumed, epochs - 1) == reference
    released(resumed)


def test_stale_sb_stores_each_loss_under_its_sample_id(mds):
    policy = SelectiveBackprop(1 / 3, staleness=2)
    loader = make_loader(mds, policy=policy)
    run(loader, 2)
    losses, epochs = policy.store.lookup(np.arange(N))
    np.testing.assert_array_equal(losses, expected_losses(N))
    assert (epochs == 0).all()
    assert [e.selection_forwards for e in loader.stats.epochs] == [N, 0]
    released(loader)


def write_gids(tmp_path: Path) -> Path:
    """EncodedDataset(N) as MDS with a field of its own ids, gid = 3 i (a larger dataset's)."""
    x = torch.stack([EncodedDataset(N)[i][0] for i in range(N)])
    return sbs.write_mds(
        tmp_path / "ids",
        (x, torch.arange(N) % N_CLASSES, torch.arange(N) * 3),
        names=("image", "label", "gid"),
    )


def test_a_written_index_field_beyond_the_sample_count_takes_dataset_size(tmp_path):
    """A field written with the data (``index_key=``) may hold the ids of a larger dataset:
    ``dataset_size=`` sizes the store for them. It was refused (the size was fixed to the
    sample count), and Stale-SB then failed on the first batch."""
    policy = SelectiveBackprop(1 / 3, staleness=2)
    loader = make_loader(write_gids(tmp_path), policy, index_key="gid", dataset_size=3 * N)
    assert loader.source.dataset_size == 3 * N
    for b in loader:
        assert torch.equal(b["gid"], b.indices)
        assert torch.equal(b["image"][:, 0].long() * 3, b.indices)
    losses, epochs = policy.store.lookup(np.arange(N) * 3)
    np.testing.assert_array_equal(losses, expected_losses(N))
    assert (epochs == 0).all()
    released(loader)


def test_indices_beyond_the_stores_size_are_refused_naming_dataset_size(tmp_path):
    policy = SelectiveBackprop(1 / 3, staleness=2)
    loader = make_loader(write_gids(tmp_path), policy, index_key="gid")
    with pytest.raises(ValueError, match=r"dataset_size=120\); pass dataset_size="):
        list(loader)
    released(loader)


@pytest.mark.parametrize("size", [N - 1, N + 1, 3 * N])
def test_a_dataset_size_other_than_the_sample_count_is_refused_with_sample_ids(mds, size):
    """Without ``index_key=``, the indices are streaming's sample ids, which index the dataset's
    N samples: another ``dataset_size`` would size the store wrong (too small for the ids, or
    with rows no example ever fills). It is refused at construction, naming the fix; the right
    size is accepted."""
    with pytest.raises(ValueError, match=rf"dataset_size={size} was given.*{N} samples: leave"):
        make_loader(mds, dataset_size=size)
    loader = make_loader(mds, dataset_size=N)
    assert loader.source.dataset_size == N
    released(loader)


def test_the_sample_id_beside_an_index_field_is_no_unused_model_input(tmp_path):
    """open_mds adds each sample's sample_id also where index_key= names a field of ids
    written with the data: the loader warned that the model was not given that tensor field,
    advising forward=lambda model, batch: model(batch['image'], sample_id=...). It is an id of
    sbloader's own, left out of that warning as the index field is; another field is not."""
    local = write_gids(tmp_path)
    loader = make_loader(local, index_key="gid", dataset_size=3 * N)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = next(iter(loader))
    assert "sample_id" in batch
    # (dropped here, not by released(): streaming lets one dataset per directory live at a time)
    del loader, batch
    gc.collect()
    loader = make_loader(local)
    with pytest.warns(UserWarning, match=r"tensor fields \['gid'\] besides"):
        next(iter(loader))
    released(loader)


@pytest.mark.parametrize(
    "options, match",
    [({"shuffle": "False"}, "shuffle should be True or False"), ({"num_workers": -1}, ">= 0")],
)
def test_open_mds_refuses_a_flag_given_as_a_string_and_negative_workers(mds, options, match):
    """open_mds(shuffle="False") (a config's string) shuffled, read by its truth value."""
    with pytest.raises((TypeError, ValueError), match=match):
        sbs.open_mds(mds, 8, **options)


def test_ranks_the_environment_does_not_name_are_refused(mds, monkeypatch):
    """streaming reads the ranks from RANK, WORLD_SIZE, ... (torchrun sets them), never from
    torch.distributed. A job started with mp.spawn and init_process_group(rank=, world_size=)
    built its datasets as one rank of one on every process: on one machine all but one rank
    failed with a bare FileExistsError naming streaming's shared memory, on machines of their
    own every rank read the whole dataset. open_mds and StreamingSource say what to set."""
    built = sbs.open_mds(mds, 8)
    job = SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        get_rank=lambda: 1,
        get_world_size=lambda: 2,
    )
    monkeypatch.setattr(sbs, "dist", job, raising=False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    match = r"runs rank 1 of 2, but streaming reads rank 0 of 1 .* set RANK, WORLD_SIZE"
    with pytest.raises(ValueError, match=match):
        sbs.StreamingSource(built)
    with pytest.raises(ValueError, match=match):
        SelectiveLoader(built, IndexLoss(), input_key="image", target_key="label")
    del built
    gc.collect()
    with pytest.raises(ValueError, match=match):
        sbs.open_mds(mds, 8)


# ------------------------------------------------------------------ two gloo ranks
DEADLINE_S = 240


def _two_ranks(rank: int, world_size: int, port: int, local: str, out: str) -> None:
    # NOTE: a spawned child of the test. streaming reads the ranks and the node layout from these
    # variables (torchrun sets them), not from torch.distributed.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result: dict = {}
        loader = make_loader(local, policy=Traditional())
        result["seen"] = [[i for b in loader for i in b.indices.tolist()] for _ in range(2)]
        released(loader)
        dist.barrier()

        def stale() -> SelectiveLoader:
            return make_loader(local, policy=SelectiveBackprop(0.5, staleness=2), prefetch=1)

        loader = stale()
        result["reference"] = run(loader, 3)
        result["stored"] = loader.policy.store.lookup(np.arange(N))[0]
        released(loader)
        dist.barrier()
        loader = stale()
        before = run(loader, 1)
        it = iter(loader)
        before += [next(it).indices.tolist() for _ in range(2)]
        state = checkpoint(loader.state_dict())
        it.close()
        released(loader, it)
        dist.barrier()
        loader = stale()
        loader.load_state_dict(state)
        result["resumed"] = before + run(loader, 2)
        released(loader)
        dist.barrier()
    finally:
        threads = end_process_group()
    with open(Path(out) / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    leave(threads)


@pytest.mark.slow  # two spawned ranks, each importing streaming (and transformers): ~25 s
def test_two_ranks_read_disjoint_shares_and_resume_exactly(mds, tmp_path):
    results = spawn_ranks(
        _two_ranks,
        (2, free_port(), str(mds), str(tmp_path)),
        2,
        tmp_path,
        DEADLINE_S,
        "two streaming ranks",
    )
    for epoch in range(2):
        a, b = (set(r["seen"][epoch]) for r in results)
        assert len(results[0]["seen"][epoch]) == len(a) == N // 2 == len(b)
        assert not a & b and a | b == set(range(N))  # disjoint shares of the whole dataset
    for r in results:
        # Each rank's store holds every example's loss under its sample id (the ranks exchange
        # their losses), and the resumed run yields what the uninterrupted one did.
        np.testing.assert_array_equal(r["stored"], expected_losses(N))
        assert r["resumed"] == r["reference"]


# ------------------------------------------------------------------ the example
def _have_fashion_mnist() -> bool:
    try:
        load_fashion_mnist("test")
    except FileNotFoundError:
        return False
    return True


@pytest.mark.realdata
@pytest.mark.skipif(not _have_fashion_mnist(), reason="needs Debian's dataset-fashion-mnist")
def test_the_streaming_example_runs(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples/streaming_fashion_mnist.py")]
    cmd += ["--examples", "512", "--epochs", "2", "--selection-batch-size", "128"]
    cmd += ["--batch-size", "32", "--dir", str(tmp_path)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=280, cwd=ROOT, env=streaming_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed run matches the uninterrupted one: True" in proc.stdout


def test_without_torchvision_the_import_names_the_fix():
    """``import streaming`` imports torchvision, which this project's CPU setup lacks: importing
    sbloader.streaming without it says what to do instead of a bare ModuleNotFoundError."""
    code = (
        "import sys\n"
        "sys.modules['torchvision'] = None  # not installed\n"
        "try:\n"
        "    import sbloader.streaming\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120
    ).stdout
    assert out.startswith("torchvision |") and "PYTHONPATH=tests/placeholders" in out


def test_write_mds_keeps_float_scalars_dtype_and_gives_integer_scalars_as_int64(tmp_path):
    """A float32 scalar field comes back float32, as array fields keep theirs (read back as
    float64 it made a float32 model's Huber loss fail in backward); integer scalars come back
    int64 whatever they were written as (cross_entropy refuses int32 class labels), Python
    floats as float64."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 4)).astype(np.float32)
    columns = (
        x,
        x.sum(1).astype(np.float32),
        np.arange(40, dtype=np.int32),
        np.arange(40, dtype=np.uint8),
        [float(i) for i in range(40)],
        list(range(40)),
    )
    names = ("x", "f32", "i32", "u8", "py_float", "py_int")
    out = sbs.write_mds(tmp_path / "mds", columns, names=names)
    loader = sbs.open_mds(out, 10, shuffle=False)
    batch = next(iter(loader))
    dtypes = {k: batch[k].dtype for k in names}
    assert dtypes == {
        "x": torch.float32,
        "f32": torch.float32,
        "i32": torch.int64,
        "u8": torch.int64,
        "py_float": torch.float64,
        "py_int": torch.int64,
    }
    assert torch.equal(batch["f32"], torch.from_numpy(columns[1][:10]))
    model = nn.Linear(4, 1)
    nn.functional.huber_loss(model(batch["x"]).squeeze(1), batch["f32"]).backward()
    nn.functional.cross_entropy(nn.Linear(4, 3)(batch["x"]), batch["i32"] % 3).backward()
    del batch
    released(loader)


def test_a_float_after_an_integer_in_a_field_is_refused_not_truncated(tmp_path):
    """write_mds takes each field's encoding from sample 0: a map-style dataset whose first
    label was the integer 0 and whose later ones were 0.5, 1.5 wrote them as 0, 1 without a
    word (arrays likewise: an integer array first, float arrays after). Such a value is refused,
    naming the field and the sample; a float field taking integers later is written as floats."""

    class Mixed(torch.utils.data.Dataset):
        def __init__(self, targets) -> None:
            self.targets = targets

        def __len__(self) -> int:
            return len(self.targets)

        def __getitem__(self, i):
            return np.zeros(2, np.float32), self.targets[i]

    with pytest.raises(TypeError, match=r"field 'label' as integers .* sample 1 holds floating"):
        sbs.write_mds(tmp_path / "scalars", Mixed([0, 0.5, 1.5]))
    arrays = Mixed([np.arange(2), np.arange(2) / 4])
    with pytest.raises(TypeError, match=r"field 'label' as integers .* sample 1 holds floating"):
        sbs.write_mds(tmp_path / "arrays", arrays)
    out = sbs.write_mds(tmp_path / "floats", Mixed([0.5, 1, torch.tensor(2)]))
    loader = sbs.open_mds(out, 3, shuffle=False)
    assert next(iter(loader))["label"].tolist() == [0.5, 1.0, 2.0]
    released(loader)


def test_a_state_saved_with_another_shuffle_is_refused_and_other_workers_load(mds):
    """Streaming's own state holds the samples seen and the shuffle seed, not whether (or how)
    the dataset shuffles: a state saved shuffling and loaded into one that does not went on
    silently in another order (mid-epoch, skipping the first samples of that other order). It
    is refused, naming shuffle. A state saved with another seed was taken silently too (the
    resume takes the saved seed, so the rest of the run was the saved seed's, the seed given
    ignored): refused, naming open_mds's seed=. Another num_workers is no such change:
    streaming resumes from the samples seen whatever the workers, so the state loads."""
    loader = make_loader(mds)
    it = iter(loader)
    next(it)
    state = checkpoint(loader.state_dict())
    it.close()
    released(loader, it)

    unshuffled = make_loader(mds, mds={"shuffle": False})
    with pytest.raises(ValueError, match="shuffle=True, but this one has shuffle=False"):
        unshuffled.load_state_dict(state)
    released(unshuffled)
    reseeded = make_loader(mds, mds={"seed": 8})
    refused = r"shuffle_seed=7, but this one has shuffle_seed=8.*, seed=7"
    with pytest.raises(ValueError, match=refused):
        reseeded.load_state_dict(state)
    released(reseeded)
    workers = make_loader(mds, mds={"num_workers": 2})
    workers.load_state_dict(state)  # (no iteration: nothing starts a worker)
    released(workers)


@pytest.mark.parametrize("dispatch_batches", [None, False])
def test_a_streaming_loader_prepared_by_accelerate_is_refused_naming_the_unprepared_one(
    mds, dispatch_batches
):
    """accelerator.prepare(StreamingDataLoader) makes a DataLoaderDispatcher (or, without
    dispatching, a DataLoaderShard over an IterableDatasetShard). The refusal said its batches
    carry no dataset indices and named a DistributedSampler; they carry sample ids, and the fix
    is to pass the StreamingDataLoader itself, which shards by rank on its own."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        config = accelerate.DataLoaderConfiguration(dispatch_batches=dispatch_batches)
        accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
        loader = sbs.open_mds(mds, 24, shuffle=False)
        prepared = accelerator.prepare(loader)
        with pytest.raises(ValueError, match="pass the StreamingDataLoader itself, not accel"):
            SelectiveLoader(prepared, IndexLoss(), input_key="image", target_key="label")
        released(loader, prepared)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
