"""The CUDA path: run where a GPU is present (skipped elsewhere; CI has none)."""

from __future__ import annotations

import pytest
import torch
from conftest import N_CLASSES, EncodedDataset, IndexLoss
from torch import nn
from torch.utils.data import DataLoader

import sbloader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_loader(policy, *, pin=False, seed=0, model=None, n=600, batch_size=20, **kw):
    dl = DataLoader(
        EncodedDataset(n),
        batch_size=60,
        shuffle=True,
        pin_memory=pin,
        generator=torch.Generator().manual_seed(0),
    )
    model = model if model is not None else IndexLoss().cuda()
    return sbloader.SelectiveLoader(
        dl, model, policy=policy, batch_size=batch_size, seed=seed, **kw
    )


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize(
    "policy", [sbloader.Traditional(), sbloader.SelectiveBackprop(1 / 3, history=64)]
)
def test_batches_live_on_the_gpu_with_exact_pairing(policy, pin):
    loader = cuda_loader(policy, pin=pin)
    seen = 0
    for x, y in loader:
        assert x.is_cuda and y.is_cuda
        assert torch.equal(x[:, 0].long() % N_CLASSES, y)  # inputs encode their index
        seen += len(y)
    assert seen == (600 if policy.passthrough() else seen) and seen > 0


def test_metadata_is_on_the_gpu_and_indices_match_inputs():
    loader = cuda_loader(sbloader.SelectiveBackprop(0.5, history=64))
    for batch in loader:
        x, _ = batch
        for t in (batch.losses, batch.probabilities, batch.weights):
            assert t.is_cuda
        assert torch.equal(batch.indices.to(x.device), x[:, 0].long())


def test_whole_traditional_batches_make_their_metadata_on_the_gpu_like_re_batched_ones():
    """A source batch handed out whole makes its metadata on first read (``WholeBatch``): on the
    same devices, with the same values, as a re-batched one's (source batch 60 into batches of
    20), and its indices pair with its inputs."""
    whole = cuda_loader(sbloader.Traditional(), batch_size=60)
    ref = next(iter(cuda_loader(sbloader.Traditional())))
    assert len(ref[1]) == 20
    for b in whole:
        x, y = b
        assert len(y) == 60
        assert torch.equal(b.indices.to(x.device), x[:, 0].long())
        for name in ("indices", "losses", "probabilities", "weights"):
            got, want = getattr(b, name), getattr(ref, name)
            assert got.device == want.device and got.dtype == want.dtype, name
        assert b.weights.is_cuda and bool((b.weights == 1).all())
        assert bool(b.losses.isnan().all()) and bool((b.probabilities == 1).all())


def test_same_seed_same_batches_on_the_gpu():
    def run(seed):
        return [
            b.indices.tolist()
            for b in cuda_loader(sbloader.SelectiveBackprop(1 / 3, history=64), seed=seed)
        ]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_bf16_selection_leaves_batchnorm_and_modes_untouched_on_the_gpu():
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).cuda()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = cuda_loader(
        sbloader.SelectiveBackprop(1 / 3, history=64), model=model, autocast=torch.bfloat16
    )
    it = iter(loader)
    batch = next(it)
    assert model.training and all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert batch.losses.dtype == torch.float32 and not batch.losses.requires_grad


def test_frozen_prefix_features_on_the_gpu():
    backbone = nn.Sequential(nn.Linear(6, 8), nn.ReLU()).cuda().requires_grad_(False)
    head = nn.Linear(8, 4).cuda()
    loader = cuda_loader(
        sbloader.SelectiveBackprop(1 / 3, history=64), model=head, frozen_prefix=backbone
    )
    for batch in loader:
        x, _ = batch
        assert batch.features.is_cuda
        torch.testing.assert_close(batch.features, backbone(x))


def test_features_cached_on_the_cpu_for_a_model_on_the_gpu(monkeypatch):
    stored_on = set()
    put = sbloader.FeatureCache.put

    def spy(self, indices, features):
        put(self, indices, features)
        stored_on.add(self.values.device.type)

    monkeypatch.setattr(sbloader.FeatureCache, "put", spy)
    backbone = nn.Sequential(nn.Linear(6, 8), nn.ReLU()).cuda().requires_grad_(False)
    head = nn.Linear(8, 4).cuda()
    loader = cuda_loader(
        sbloader.SelectiveBackprop(1 / 3, history=64),
        model=head,
        frozen_prefix=backbone,
        cache_features="cpu",
    )
    for _ in range(2):
        for batch in loader:
            x, _ = batch
            assert batch.features.is_cuda
            torch.testing.assert_close(batch.features, backbone(x))
    assert stored_on == {"cpu"}
    assert loader.stats.epochs[1].prefix_forwards <= sbloader.FeatureCache.CHECKED


def test_a_saved_feature_cache_goes_back_to_the_gpu():
    """save_feature_cache with the cache on the GPU (cache_features=True): the state holds a CPU
    copy, and a loader that loads it keeps the rows on the GPU again, the same values."""

    def build():
        torch.manual_seed(0)
        backbone = nn.Sequential(nn.Linear(6, 8), nn.ReLU()).cuda().requires_grad_(False)
        return cuda_loader(
            sbloader.SelectiveBackprop(1 / 3, history=64),
            model=nn.Linear(8, 4).cuda(),
            frozen_prefix=backbone,
            cache_features=True,
            save_feature_cache=True,
        )

    loader = build()
    list(loader)
    cache = loader.scorer.feature_cache
    assert cache.values.is_cuda
    state = loader.state_dict()
    assert state["scorer"]["feature_cache"]["values"].device.type == "cpu"
    again = build()
    again.load_state_dict(state)
    restored = again.scorer.feature_cache
    assert restored.values.is_cuda and torch.equal(restored.values, cache.values)


def test_device_decisions_on_the_gpu_are_deterministic_and_resume_exactly():
    """decisions="device": the window and the generator live on the GPU; same seed, same
    batches; a mid-epoch resume continues exactly."""

    def run(loader, stop=None):
        out = []
        for i, batch in enumerate(loader):
            x, y = batch
            assert x.is_cuda and y.is_cuda and batch.probabilities.is_cuda
            assert torch.equal(x[:, 0].long() % N_CLASSES, y)
            out.append(batch.indices.clone())
            if stop is not None and i + 1 == stop:
                break
        return out

    policy = sbloader.SelectiveBackprop(1 / 3, history=64)
    whole = run(cuda_loader(policy, seed=3, decisions="device"))
    again = run(
        cuda_loader(sbloader.SelectiveBackprop(1 / 3, history=64), seed=3, decisions="device")
    )
    assert [t.tolist() for t in whole] == [t.tolist() for t in again]
    first = cuda_loader(sbloader.SelectiveBackprop(1 / 3, history=64), seed=3, decisions="device")
    head = run(first, stop=3)
    state = first.state_dict()
    resumed = cuda_loader(sbloader.SelectiveBackprop(1 / 3, history=64), seed=3, decisions="device")
    resumed.load_state_dict(state)
    assert [t.tolist() for t in head + run(resumed)] == [t.tolist() for t in whole]
    assert first.policy.device_window.device.type == "cuda"


def test_a_cpu_generator_state_is_refused_when_a_gpu_loader_loads_it():
    """decisions="device": a state saved by a run that decided on the CPU (a Mersenne Twister's
    generator state) is refused by a loader on the GPU at load_state_dict, not at its first
    decision."""
    cpu_run = cuda_loader(
        sbloader.SelectiveBackprop(1 / 3, history=64), model=IndexLoss(), seed=3, decisions="device"
    )
    it = iter(cpu_run)
    next(it)
    state = cpu_run.state_dict()
    del it
    gpu = cuda_loader(sbloader.SelectiveBackprop(1 / 3, history=64), seed=3, decisions="device")
    with pytest.raises(ValueError, match=r"decisions='device'.*another kind of device.*on cuda"):
        gpu.load_state_dict(state)
    assert gpu.state_dict()["position"] == 0


def test_device_decisions_count_the_forward_gpu_time_as_selection_forward():
    """decisions="device" copies no losses to the host, so the forward's GPU time would land in
    the decision's wait for its two integers (the loader's own time); the scorer counts it as
    selection forward time, as a host copy would. A forward of many large products takes far
    longer on the GPU than to queue: without the events, the device path's forward time would
    be a small fraction of the host path's."""

    class Heavy(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(24)])
            self.head = nn.Linear(2048, N_CLASSES)
            self.lift = nn.Linear(6, 2048)

        def forward(self, x):
            return self.head(self.inner(self.lift(x.float())))

    def epoch_stats(decisions):
        model = Heavy().cuda()
        dl = DataLoader(EncodedDataset(4096), batch_size=2048)
        loader = sbloader.SelectiveLoader(
            dl,
            model,
            policy=sbloader.SelectiveBackprop(1 / 3),
            batch_size=256,
            decisions=decisions,
            seed=0,
        )
        for _ in loader:
            pass
        for _ in loader:  # the second epoch: warm
            pass
        return loader.stats.epochs[-1]

    host, device = epoch_stats("host"), epoch_stats("device")
    assert device.selection_forward_s >= 0.5 * host.selection_forward_s
    assert device.selection_forward_s <= device.selection_s


@pytest.mark.parametrize("decisions", ["host", "device"])
def test_overlapped_selection_on_the_gpu_runs_on_its_own_stream_exactly_and_deterministically(
    decisions,
):
    """overlap_selection=True with the model on the GPU: passes run on the selection thread's
    CUDA stream; batches pair exactly, a seed repeats its selections, the passes' time is
    partly hidden, and the copy lives on the GPU."""
    from sbloader.overlap import SelectionThread

    streams = []
    submit = SelectionThread.submit

    def spy(self, fn, device=None, inputs=()):
        def wrapped():
            streams.append(torch.cuda.current_stream(device))
            return fn()

        return submit(self, wrapped, device, inputs)

    def run():
        torch.manual_seed(0)  # the same initial weights in both runs
        model = nn.Sequential(nn.Linear(6, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
        policy = sbloader.Phased(
            sbloader.SelectiveBackprop(1 / 3, history=64),
            warmup_epochs=1,
            warmup_policy=sbloader.RandomBackprop(1 / 3),
        )
        loader = cuda_loader(
            policy, model=model.cuda(), overlap_selection=True, decisions=decisions
        )
        out = []
        for _ in range(3):
            for batch in loader:
                x, y = batch
                assert x.is_cuda and torch.equal(x[:, 0].long() % N_CLASSES, y)
                out.append(batch.indices.tolist())
        assert loader._overlap.model[0].weight.is_cuda
        return out, loader

    mp = pytest.MonkeyPatch()
    mp.setattr(SelectionThread, "submit", spy)
    try:
        first, loader = run()
        again, _ = run()
    finally:
        mp.undo()
    assert first == again
    default = torch.cuda.current_stream()
    assert streams and all(s != default for s in streams)
    assert loader.stats.total.selection_hidden_s > 0


def test_a_cuda_report_outside_the_data_refuses_the_checkpoint_and_the_next_epoch():
    """CUDA reports are held unchecked (a check would synchronise every step); a checkpoint
    saved while one is held, and the next epoch, refuse an index outside the data and keep
    every report (the same as the CPU path's test in test_feedback.py, on the device)."""
    loader = cuda_loader(sbloader.SelectiveBackprop(1 / 3, staleness=2, history=64))
    batch = next(iter(loader))
    n = len(batch.indices) - 2  # (a report of more examples than were yielded is refused)
    loader.feedback(batch.indices[:n].cuda(), torch.zeros(n, device="cuda"))
    loader.feedback(torch.tensor([3, 600], device="cuda"), torch.zeros(2, device="cuda"))
    held = len(loader._feedback)
    with pytest.raises(IndexError, match=r"outside 0\.\.599 \(e\.g\. \[600\]\)"):
        loader.state_dict()
    with pytest.raises(IndexError, match=r"outside 0\.\.599"):
        next(iter(loader))
    assert len(loader._feedback) == held


def test_a_device_generator_asked_for_another_kind_of_device_refuses_to_start_afresh():
    """decisions="device": a generator that drew on the CPU and is asked for a GPU takes its
    state along, which a CUDA generator cannot hold: refused naming the fix, instead of
    starting the draws again from the seed (a resumed run would then draw otherwise)."""
    from sbloader.device_decisions import DecisionGenerator

    g = DecisionGenerator(seed=5, rank=0)
    torch.rand(3, generator=g.get(torch.device("cpu")))
    with pytest.raises(ValueError, match="another kind of device"):
        g.get(torch.device("cuda", torch.cuda.current_device()))
