"""Selection-speed options: each one either makes the same choices as without it (when it is
numerically neutral) or does exactly what it says to the selection forward only."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sbloader import (
    FeatureCache,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
    Traditional,
    default_policy,
)

N, CLASSES = 240, 4


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, 8, 8, generator=g)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return TensorDataset(x, y)


def seeded(build):
    """Build a module with torch's global RNG seeded inside, leaving the global state as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build()


def cnn(pooled: bool = True) -> nn.Module:
    """Resolution-agnostic (global pooling), so it also scores downsampled inputs; or, not
    ``pooled``, with a classifier sized for 8 x 8 images, which 4 x 4 ones do not fit."""
    pool = [nn.AdaptiveAvgPool2d(2)] if pooled else []
    return seeded(
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            *pool,
            nn.Flatten(),
            nn.Linear(32 if pooled else 8 * 8 * 8, CLASSES),
        )
    )


class ShapeRecorder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return self.inner(x)


def run(model=None, epochs=2, source_bs=60, bs=20, policy=None, **kw):
    loader = SelectiveLoader(
        DataLoader(images(), batch_size=source_bs, shuffle=True, generator=torch.Generator()),
        model if model is not None else cnn(),
        policy=policy or SelectiveBackprop(1 / 3, history=64),
        batch_size=bs,
        seed=0,
        **{"quantize_selection": False, **kw},  # the float forward's options, compared
    )
    batches = [b for _ in range(epochs) for b in loader]
    return loader, batches


def chosen(batches):
    return [b.indices.tolist() for b in batches]


# ------------------------------------------------------------------ downsampled scoring
def test_selection_scale_one_is_neutral():
    _, plain = run()
    _, scaled = run(selection_scale=1.0)
    assert chosen(plain) == chosen(scaled)


def test_selection_scale_downsamples_the_selection_forward_only():
    model = ShapeRecorder(cnn())
    loader, batches = run(model=model, selection_scale=0.5, epochs=1)
    assert set(model.shapes) == {(60, 3, 4, 4)}  # every selection forward, none full-size
    assert all(b[0].shape == (20, 3, 8, 8) for b in batches)  # training batches: full size
    assert loader.stats.current.selection_forwards == N


@pytest.mark.parametrize(
    "value, exc, match",
    [
        (0.0, ValueError, r"selection_scale should be in \(0, 1\]"),
        (1.5, ValueError, r"selection_scale should be in \(0, 1\]"),
        ("half", TypeError, "selection_scale should be a number"),
    ],
)
def test_bad_selection_scale_is_named(value, exc, match):
    with pytest.raises(exc, match=match):
        run(selection_scale=value)


@pytest.mark.parametrize("shape", [(6,), (3, 6), (1, 3, 4, 4)], ids=["2d", "3d", "5d"])
def test_selection_scale_on_non_image_inputs_names_the_fix(shape):
    """Only 4-d image batches are resized: sequences (3-d) and videos (5-d) too are refused
    naming selection_scale, not left to torch's interpolate error."""
    data = TensorDataset(torch.randn(20, *shape), torch.zeros(20, dtype=torch.long))
    model = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(shape)), 2))
    loader = SelectiveLoader(DataLoader(data, batch_size=10), model, selection_scale=0.5)
    with pytest.raises(ValueError, match=r"resizes 4-d image batches .*selection_scale=None"):
        next(iter(loader))


def first_batch(model, policy, data=None, **kw):
    """The loader, and what its first next() raised (selection_scale=0.5)."""
    loader = SelectiveLoader(
        DataLoader(data or images(), batch_size=60),
        model.train(),
        policy=policy,
        batch_size=20,
        seed=0,
        selection_scale=0.5,
        **kw,
    )
    with pytest.raises(Exception) as raised:
        next(iter(loader))
    return loader, raised.value


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("warmup", [False, True], ids=["selection pass", "warm-up probe"])
def test_a_selection_scale_the_model_cannot_take_is_named_on_the_first_batch(int8, warmup):
    """A model whose classifier is sized for full-size images cannot take them downsampled: the
    first selection pass (or a warm-up's probe; or the int8 copy's calibration, explicitly
    asked for) failed inside torch ("mat1 and mat2 shapes cannot be multiplied"), naming
    neither selection_scale nor the fix. It is refused naming both, chained to torch's error,
    with the model, its BatchNorm statistics, the stats and the policy's window as they were."""
    model = cnn(pooled=False)
    bn = model[1]
    policy = default_policy() if warmup else SelectiveBackprop(1 / 3, history=64)
    loader, error = first_batch(model, policy, quantize_selection=int8)
    assert isinstance(error, ValueError), error
    message = str(error)
    assert "selection_scale should resize the inputs to a size the model takes" in message
    assert "selection_scale=0.5, which resizes inputs of shape (3, 8, 8) to (3, 4, 4)" in message
    assert "mat1 and mat2 shapes cannot be multiplied" in message
    assert message.endswith("or selection_scale=None")
    assert "mat1 and mat2" in str(error.__cause__)
    assert all(m.training for m in model.modules())
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean, torch.zeros(8))
    assert loader.stats.current.selection_forwards == 0
    if not warmup:
        assert len(loader.policy.window) == 0


class Scores(nn.Module):
    """A model whose output is a dict: ``output="scores"`` takes the logits from it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scores": self.inner(x)}


def test_a_selection_scale_is_named_for_a_model_whose_logits_output_takes():
    """The trials that tell whether selection_scale caused the first pass's error call the model
    as the pass does, with output=: without it the full-size trial failed too (the loss taking
    the model's dict), and a model sized for full-size images kept torch's bare error."""
    model = Scores(cnn(pooled=False))
    policy = SelectiveBackprop(1 / 3, history=64)
    _, error = first_batch(model, policy, quantize_selection=False, output="scores")
    assert isinstance(error, ValueError), error
    assert "selection_scale=0.5, which resizes inputs of shape (3, 8, 8)" in str(error)


def test_errors_selection_scale_does_not_cause_keep_their_own_type_and_message():
    """The first pass's errors that the model also raises at full size (inputs of another channel
    count), or that other candidates cause (a label out of range past the first two), are not
    blamed on selection_scale."""
    policy = SelectiveBackprop(1 / 3, history=64)
    wrong_channels = seeded(lambda: nn.Sequential(nn.Conv2d(4, 8, 3), nn.AdaptiveAvgPool2d(1)))
    _, error = first_batch(wrong_channels, policy, quantize_selection=False)
    assert type(error) is RuntimeError and "selection_scale" not in str(error)
    x, y = images().tensors
    y = y.clone()
    y[30] = CLASSES  # out of range
    _, error = first_batch(cnn(), policy, data=TensorDataset(x, y), quantize_selection=False)
    assert type(error) is IndexError and "out of bounds" in str(error)


class FailsOnCall(ShapeRecorder):
    """Raises on its ``fail``-th call (only)."""

    def __init__(self, inner: nn.Module, fail: int) -> None:
        super().__init__(inner)
        self.fail, self.calls = fail, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().forward(x)


def test_only_the_first_selection_pass_at_a_scale_is_checked():
    """Once a pass at selection_scale succeeded, a later pass's error is raised as it is, with
    no trial forwards (the model is called once per pass)."""
    model = FailsOnCall(cnn(), fail=2)
    loader = SelectiveLoader(
        DataLoader(images(), batch_size=60),
        model,
        policy=SelectiveBackprop(1 / 3, history=64),
        batch_size=20,
        selection_scale=0.5,
        quantize_selection=False,
    )
    with pytest.raises(RuntimeError, match="illegal memory access"):
        list(loader)
    assert model.calls == 2 and model.shapes == [(60, 3, 4, 4)]


# ------------------------------------------------------------------ compilation
def test_compile_selection_compiles_once_lazily_and_keeps_the_choices():
    model = cnn()
    loader, compiled = run(model=model, compile_selection={"backend": "eager"})
    _, plain = run()
    assert chosen(compiled) == chosen(plain)
    assert len(loader.scorer.forward.compiled_modules) == 1  # compiled once, reused
    assert type(loader.model) is nn.Sequential  # the training model is untouched


def test_compile_selection_calls_torch_compile_once_for_the_whole_run(monkeypatch):
    """The compiled module is made at the first selection pass and reused by every later one
    (of every epoch): torch.compile is not called again per pass."""
    calls = []
    real = torch.compile

    @functools.wraps(real)  # (its signature: the loader checks compile_selection against it)
    def counted(model, **kwargs):
        calls.append(model)
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", counted)
    model = cnn()
    loader, batches = run(model=model, compile_selection={"backend": "eager"}, epochs=2)
    assert batches and loader.stats.total.selection_calls == 2 * N // 60
    assert calls == [model]


@pytest.mark.slow
def test_compile_selection_with_inductor_keeps_the_choices():
    _, compiled = run(compile_selection=True)
    _, plain = run()
    assert chosen(compiled) == chosen(plain)
    for a, b in zip(compiled, plain):
        torch.testing.assert_close(a.losses, b.losses, rtol=1e-4, atol=1e-5)


def test_bad_compile_selection_is_named():
    with pytest.raises(TypeError, match="compile_selection should be a bool or a dict"):
        run(compile_selection="yes")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "bogus"}, r"compile_selection's mode should be one of .* got mode='bogus'"),
        ({"bogus_kw": 1}, r"names an argument torch.compile does not take \('bogus_kw'\)"),
        ({"backend": "nope"}, r"compile_selection's backend should be a registered"),
        ({"mode": "default", "options": {}}, "mode and options cannot both be given"),
    ],
)
def test_bad_compile_arguments_are_refused_when_the_loader_is_built(kwargs, match):
    """torch.compile runs at the first selection pass, where its own error would not name
    compile_selection: its arguments are checked when the loader is built, before any data."""
    dl = DataLoader(images(), batch_size=40)
    with pytest.raises(ValueError, match=match):
        SelectiveLoader(dl, cnn(), compile_selection=kwargs, batch_size=10)


# ------------------------------------------------------------------ neutral existing options
def test_channels_last_and_a_copied_selector_keep_the_choices():
    _, plain = run()
    _, channels_last = run(memory_format=torch.channels_last)
    assert chosen(channels_last) == chosen(plain)
    assert channels_last[0][0].is_contiguous(memory_format=torch.channels_last)
    model = cnn()
    _, with_selector = run(model=model, selector=copy.deepcopy(model))
    assert chosen(with_selector) == chosen(plain)


def test_a_selector_on_another_device_than_the_batches_is_refused_naming_the_fix():
    """A selector whose parameters are elsewhere than the batches it scores (the meta device
    stands in for a GPU) is refused when the loader is built, and when an epoch starts after it
    was moved; one without parameters of its own is accepted. Before, the loader was built and
    its first selection pass failed in torch, naming neither the selector nor the fix."""
    message = r"selector should be on the device the loader scores batches on, cpu .* on meta"
    with pytest.raises(ValueError, match=message):
        run(selector=cnn().to("meta"))
    selector = cnn()
    loader, _ = run(selector=selector, epochs=1)
    selector.to("meta")
    with pytest.raises(ValueError, match=message):
        next(iter(loader))
    free = nn.Sequential(nn.Flatten(), nn.AdaptiveAvgPool1d(CLASSES))
    assert chosen(run(selector=free, epochs=1)[1])


class LayoutRecorder(nn.Module):
    """A video model that records, per forward, whether its input is channels_last_3d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 4, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, CLASSES))
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.is_contiguous(memory_format=torch.channels_last_3d))
        return self.head(self.conv(x))


def test_channels_last_3d_converts_video_inputs_and_preserve_format_is_refused():
    """Before, memory_format applied to 4-d inputs only: channels_last_3d, the layout for 5-d
    video batches, was silently ignored on them (and raised torch's error on images)."""
    g = torch.Generator().manual_seed(0)
    videos = TensorDataset(torch.randn(24, 3, 2, 4, 4, generator=g), torch.arange(24) % CLASSES)
    model = seeded(LayoutRecorder)
    loader = SelectiveLoader(
        DataLoader(videos, batch_size=12),
        model,
        policy=SelectiveBackprop(0.5, history=16),
        batch_size=4,
        memory_format=torch.channels_last_3d,
    )
    batches = list(loader)
    assert model.seen == [True, True]  # both selection passes
    assert all(b[0].is_contiguous(memory_format=torch.channels_last_3d) for b in batches)
    _, images_ = run(epochs=1, memory_format=torch.channels_last_3d)  # 4-d: left as they are
    assert images_[0][0].is_contiguous()
    flat = SelectiveLoader(  # channels_last lays out 4-d images: videos are left as they are
        DataLoader(videos, batch_size=12),
        seeded(LayoutRecorder),
        policy=SelectiveBackprop(0.5, history=16),
        batch_size=4,
        memory_format=torch.channels_last,
    )
    assert all(b[0].is_contiguous() for b in flat)
    with pytest.raises(ValueError, match=r"memory_format=torch\.preserve_format; pass"):
        run(memory_format=torch.preserve_format)


class AutocastRecorder(nn.Module):
    """Records, per forward, whether CPU autocast is on and the dtype its matmul computes in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3 * 8 * 8, CLASSES)
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x.flatten(1))
        self.seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_autocast_applies_to_the_selection_forward(dtype):
    model = seeded(AutocastRecorder)
    _, batches = run(model=model, epochs=1, autocast=dtype)
    # (float16 too: the dtype given, not the device's default autocast dtype, bf16 on a CPU)
    expected = (True, dtype) if dtype is not None else (False, torch.float32)
    assert model.seen == [expected] * (N // 60)  # every selection forward
    assert batches and all(b.losses.dtype == torch.float32 for b in batches)
    assert not torch.is_autocast_enabled("cpu")  # only inside the selection pass


def test_selection_forward_time_is_part_of_selection_time():
    loader, _ = run()
    e = loader.stats.total
    assert 0 < e.selection_forward_s <= e.selection_s


# ------------------------------------------------------------------ activation caching
def backbone_and_head() -> tuple[nn.Module, nn.Module]:
    full = cnn()
    backbone, head = full[:4], full[4:]  # conv-BN-ReLU-pool | flatten-linear
    backbone.requires_grad_(False)
    backbone.eval()
    return backbone, head


def test_frozen_prefix_makes_the_same_choices_and_carries_features():
    backbone, head = backbone_and_head()
    full = nn.Sequential(backbone, head)
    _, plain = run(model=full, autocast=None)  # float32, as "auto" chooses with a prefix
    loader, cached = run(model=head, frozen_prefix=backbone)
    assert loader.autocast is None
    assert loader.stats.total.prefix_forwards == 2 * N  # every candidate of both epochs, once
    assert chosen(cached) == chosen(plain)
    for a, b in zip(cached, plain):
        torch.testing.assert_close(a.losses, b.losses)
        with torch.no_grad():
            expected = backbone(a[0])
        assert a.features.shape == (20, 8, 2, 2)
        torch.testing.assert_close(a.features, expected)
        assert b.features is None and not a.features.requires_grad
    # Training the head on the cached features gives the full model's gradient.
    batch = cached[0]
    nn.functional.cross_entropy(head(batch.features), batch[1]).backward()
    grads = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    nn.functional.cross_entropy(full(batch[0]), batch[1]).backward()
    for g, p in zip(grads, head.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert all(p.grad is None for p in backbone.parameters())


def test_frozen_prefix_under_autocast_scores_like_the_full_model_and_gives_float32():
    backbone, head = backbone_and_head()
    _, plain = run(model=nn.Sequential(backbone, head), autocast=torch.bfloat16)
    _, cached = run(model=head, frozen_prefix=backbone, autocast=torch.bfloat16)
    assert chosen(cached) == chosen(plain)
    for a, b in zip(cached, plain):
        torch.testing.assert_close(a.losses, b.losses)
        assert a.features.dtype == torch.float32
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = backbone(a[0]).float()
        torch.testing.assert_close(a.features, expected)


def test_a_frozen_prefix_left_in_train_mode_runs_in_eval_mode_and_is_left_as_it_was():
    """A frozen prefix the caller left in train mode (its BatchNorm included) computes its
    outputs in eval mode: its running statistics and counters are never updated, its flags are
    restored, and the features are the eval-mode outputs."""
    backbone, head = backbone_and_head()
    backbone.train()
    before = copy.deepcopy(backbone.state_dict())
    _, batches = run(model=head, frozen_prefix=backbone, epochs=1)
    assert batches and all(m.training for m in backbone.modules())
    for k, v in backbone.state_dict().items():
        assert torch.equal(v, before[k]), k  # running_mean, running_var, num_batches_tracked
    backbone.eval()
    for b in batches:
        with torch.no_grad():
            torch.testing.assert_close(b.features, backbone(b[0]))


def test_frozen_prefix_without_a_selection_pass_runs_on_the_chosen_examples_only():
    backbone, head = backbone_and_head()
    recorder = ShapeRecorder(backbone)
    loader, batches = run(model=head, frozen_prefix=recorder, policy=RandomBackprop(0.25), epochs=1)
    # The prefix ran once per source batch, on exactly the examples chosen from it.
    assert len(recorder.shapes) == N // 60
    assert sum(s[0] for s in recorder.shapes) == loader.stats.current.examples_selected < N
    _, traditional = run(model=head, frozen_prefix=backbone, policy=Traditional(), epochs=1)
    for b in batches + traditional:
        with torch.no_grad():
            torch.testing.assert_close(b.features, backbone(b[0]))


def test_trainable_frozen_prefix_is_refused_up_front_and_at_each_epoch():
    backbone, head = backbone_and_head()
    backbone[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"requires_grad=True .*requires_grad_\(False\)"):
        run(model=head, frozen_prefix=backbone)
    backbone.requires_grad_(False)
    loader, _ = run(model=head, frozen_prefix=backbone, epochs=1)
    backbone[1].bias.requires_grad_(True)  # unfrozen between epochs
    with pytest.raises(ValueError, match="frozen_prefix has 1 parameters with requires_grad"):
        next(iter(loader))


def test_a_frozen_prefix_unfrozen_between_training_epochs_is_refused_at_the_next_one():
    """With batches_per_epoch a pass over the data spans several training epochs; before, the
    prefix was checked only when a pass began, so the training epochs after an unfreeze within
    a pass trained on its detached features unnoticed (the prefix never trained)."""
    backbone, head = backbone_and_head()
    loader = SelectiveLoader(
        DataLoader(images(), batch_size=60),
        head,
        policy=SelectiveBackprop(1 / 3, history=64),
        batch_size=20,
        frozen_prefix=backbone,
        batches_per_epoch=1,
    )
    first = [b.indices.tolist() for b in loader]
    assert len(first) == 1 and loader.epoch == 0  # the pass goes on in the next epoch
    backbone[0].weight.requires_grad_(True)  # unfrozen between training epochs
    with pytest.raises(ValueError, match="frozen_prefix has 1 parameters with requires_grad"):
        next(iter(loader))
    backbone.requires_grad_(False)
    second = [b.indices.tolist() for b in loader]  # refrozen: goes on, nothing lost
    assert len(second) == 1 and not set(second[0]) & set(first[0])


def test_frozen_prefix_misuse_is_named():
    backbone, head = backbone_and_head()
    with pytest.raises(ValueError, match="pass model=head"):
        run(model=nn.Sequential(backbone, head), frozen_prefix=backbone)
    with pytest.raises(ValueError, match="selector=None"):
        run(model=head, frozen_prefix=backbone, selector=cnn())
    with pytest.raises(ValueError, match="selection_scale=None"):
        run(model=head, frozen_prefix=backbone, selection_scale=0.5)
    with pytest.raises(TypeError, match=r"frozen_prefix should be a torch\.nn\.Module"):
        run(model=head, frozen_prefix="backbone")


def test_frozen_prefix_features_survive_a_mid_epoch_resume():
    def build():
        backbone, head = backbone_and_head()
        return SelectiveLoader(
            DataLoader(images(), batch_size=60, shuffle=True, generator=torch.Generator()),
            head,
            policy=SelectiveBackprop(1 / 3, history=64),
            batch_size=20,
            seed=0,
            frozen_prefix=backbone,
        )

    uninterrupted = build()
    full = [b for _ in range(2) for b in uninterrupted]
    first = build()
    got = list(first)
    it = iter(first)
    got.append(next(it))
    state = copy.deepcopy(first.state_dict())
    del it
    resumed = build()
    resumed.load_state_dict(state)
    got += list(resumed)
    assert chosen(got) == chosen(full)
    for a, b in zip(got, full):
        torch.testing.assert_close(a.features, b.features)


# ------------------------------------------------------------------ features cached across epochs
class CountingPrefix(nn.Module):
    """Counts the examples it runs on."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.examples = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.examples += x.shape[0]
        return self.inner(x)


@pytest.mark.parametrize(
    "policy",
    [
        lambda: SelectiveBackprop(1 / 3, history=64),
        lambda: SelectiveBackprop(1 / 3, history=64, staleness=2),
        Traditional,
        lambda: RandomBackprop(0.5),
    ],
)
def test_cached_features_run_the_prefix_once_per_example_and_change_nothing(policy):
    backbone, head = backbone_and_head()
    counting = CountingPrefix(backbone)
    _, plain = run(model=head, frozen_prefix=backbone, policy=policy(), epochs=3)
    loader, cached = run(
        model=head, frozen_prefix=counting, policy=policy(), epochs=3, cache_features=True
    )
    assert chosen(cached) == chosen(plain)
    for a, b in zip(cached, plain):
        torch.testing.assert_close(a.features, b.features)
        torch.testing.assert_close(a.losses, b.losses, equal_nan=True)
    # Each example once (at most N), plus a few recomputed per later epoch to check the cache.
    # (float32 features: each checked example twice, the second time to calibrate)
    assert counting.examples <= N + 2 * 2 * FeatureCache.CHECKED
    assert sum(e.prefix_forwards for e in loader.stats.epochs) == counting.examples
    if loader.policy.needs_losses(2):  # every candidate scored: all cached after epoch 0
        assert loader.stats.epochs[-1].prefix_forwards <= 2 * FeatureCache.CHECKED


@pytest.mark.parametrize("where", ["cpu", torch.device("cpu")])
def test_cached_features_on_a_given_device_run_the_prefix_once_and_change_nothing(
    where, monkeypatch
):
    stored_on = set()
    put = FeatureCache.put

    def spy(self, indices, features):
        put(self, indices, features)
        stored_on.add(self.values.device)

    monkeypatch.setattr(FeatureCache, "put", spy)
    backbone, head = backbone_and_head()
    counting = CountingPrefix(backbone)
    _, plain = run(model=head, frozen_prefix=backbone, epochs=3)
    loader, cached = run(model=head, frozen_prefix=counting, epochs=3, cache_features=where)
    assert chosen(cached) == chosen(plain)
    for a, b in zip(cached, plain):
        torch.testing.assert_close(a.features, b.features)
        torch.testing.assert_close(a.losses, b.losses)
    forwards = [e.prefix_forwards for e in loader.stats.epochs]
    assert forwards[0] == N and all(f <= 2 * FeatureCache.CHECKED for f in forwards[1:])
    assert counting.examples == sum(forwards) and stored_on == {torch.device("cpu")}


def test_cached_features_refuse_inputs_that_change_between_epochs():
    class Augmented(TensorDataset):
        epoch = 0

        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return x + Augmented.epoch, y  # a different input every epoch

    base = images()
    data = Augmented(*base.tensors)
    backbone, head = backbone_and_head()
    loader = SelectiveLoader(
        DataLoader(data, batch_size=60, shuffle=True, generator=torch.Generator()),
        head,
        policy=SelectiveBackprop(1 / 3, history=64),
        batch_size=20,
        frozen_prefix=backbone,
        cache_features=True,
    )
    list(loader)
    Augmented.epoch = 1
    with pytest.raises(ValueError, match="input changed between epochs"):
        list(loader)


@pytest.mark.parametrize("factor", [2.0, 1.0001])
def test_cached_features_follow_prefix_weights_loaded_between_epochs(factor):
    """Rows cached by the prefix's old weights were handed out as the new weights' features:
    silently for a small change, else refused as a changed input (random augmentation)."""
    backbone, head = backbone_and_head()
    data = images()
    loader = cached_prefix_loader(data, backbone, head)
    list(loader)
    other = cnn()[:4]
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(factor)
    backbone.load_state_dict(other.state_dict())
    assert_features_of_prefix_as_it_is(loader, data, backbone)


def cached_prefix_loader(data, backbone, head, **options):
    """A loader caching the frozen ``backbone``'s features of ``data`` for ``head``."""
    return SelectiveLoader(
        DataLoader(data, batch_size=60, shuffle=True, generator=torch.Generator()),
        head,
        policy=Traditional(),
        batch_size=20,
        frozen_prefix=backbone,
        cache_features=True,
        seed=0,
        **options,
    )


def assert_features_of_prefix_as_it_is(loader, data, backbone):
    """An epoch of ``loader`` yields every example, with the features ``backbone`` gives now."""
    batches = list(loader)
    assert sum(len(b.indices) for b in batches) == N
    with torch.no_grad():
        for b in batches:
            torch.testing.assert_close(b.features, backbone(data.tensors[0][b.indices]))


@pytest.mark.parametrize("change", ["layer", "dtype", "data", "hook", "pre-hook"])
def test_cached_features_follow_a_prefix_cast_or_with_a_layer_replaced_between_epochs(change):
    """None changes a tensor's version counter: rows cached by the old prefix were handed
    out, refused as a changed input (an activation replaced, a pre-hook doubling the prefix's
    inputs) or, for a prefix and head cast to float64, fed in float32 to the float64 head
    (``mat1 and mat2 must have the same dtype``); weights a little changed through ``.data``
    (``vector_to_parameters``) or a hook scaling a layer's outputs a little, silently."""
    backbone, head = backbone_and_head()
    data = images()
    loader = cached_prefix_loader(data, backbone, head, autocast=None)
    list(loader)
    if change == "layer":
        backbone[2] = nn.Tanh()
    elif change == "data":  # (0.05%: within the cache's own check of rows, 1e-3)
        weights = nn.utils.parameters_to_vector(backbone.parameters())
        nn.utils.vector_to_parameters(weights * 1.0005, backbone.parameters())
    elif change == "hook":  # (0.05% again)
        backbone[2].register_forward_hook(lambda module, args, out: out * 1.0005)
    elif change == "pre-hook":
        backbone.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    else:
        backbone.double()
        head.double()
        data.tensors = (data.tensors[0].double(), data.tensors[1])
    assert_features_of_prefix_as_it_is(loader, data, backbone)


def test_cached_features_under_autocast_are_stored_in_half_the_memory():
    backbone, head = backbone_and_head()
    loader, batches = run(
        model=head,
        frozen_prefix=backbone,
        autocast=torch.bfloat16,
        cache_features=True,
        epochs=2,
    )
    cache = loader.scorer.feature_cache
    assert cache.values.dtype == torch.bfloat16 and cache.nbytes == N * 8 * 2 * 2 * 2
    assert all(b.features.dtype == torch.float32 for b in batches)


def test_cached_features_of_a_prefix_ending_in_float32_under_autocast_are_not_rounded():
    """Under a bf16 autocast, a prefix whose last op autocast runs in float32 (a 3-d pooling on
    a CPU; a normalisation on a GPU) returns float32 features; before, the cache stored them in
    bf16, so with cache_features the head trained on rounded features, other than without it
    (from the first epoch on: the cached rows are what the batches carry)."""
    g = torch.Generator().manual_seed(0)
    videos = TensorDataset(torch.randn(24, 3, 2, 4, 4, generator=g), torch.arange(24) % CLASSES)
    backbone = seeded(
        lambda: nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.AdaptiveAvgPool3d(1), nn.Flatten())
    ).requires_grad_(False)

    def features(cache):
        loader = SelectiveLoader(
            DataLoader(videos, batch_size=12),
            seeded(lambda: nn.Linear(8, CLASSES)),
            policy=Traditional(),
            frozen_prefix=backbone,
            autocast=torch.bfloat16,
            cache_features=cache,
        )
        return loader, [torch.cat([b.features for b in loader]) for _ in range(2)]

    _, plain = features(False)
    loader, cached = features(True)
    assert loader.scorer.feature_cache.values.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(cached, plain))


def test_cache_features_misuse_is_named():
    backbone, head = backbone_and_head()
    with pytest.raises(ValueError, match="cache_features caches frozen_prefix's outputs"):
        run(model=head, cache_features=True)
    with pytest.raises(ValueError, match="cache_features needs each example's dataset index"):
        SelectiveLoader(
            [(torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))],
            head,
            policy=Traditional(),
            frozen_prefix=backbone,
            cache_features=True,
        )
    with pytest.raises(ValueError, match=r"save_feature_cache=True .* cache_features=False"):
        run(model=head, frozen_prefix=backbone, save_feature_cache=True)
    with pytest.raises(TypeError, match="save_feature_cache should be True or False"):
        run(model=head, frozen_prefix=backbone, cache_features=True, save_feature_cache="yes")
    # (before: accepted, and the first selection pass failed in torch, naming nothing)
    with pytest.raises(ValueError, match="cache_features='meta' would keep the features"):
        run(model=head, frozen_prefix=backbone, cache_features="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cache_features should be a device this machine"):
            run(model=head, frozen_prefix=backbone, cache_features="cuda")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"CUDA devices: {gpus}.*cache_features='cuda:{gpus}'"):
        run(model=head, frozen_prefix=backbone, cache_features=f"cuda:{gpus}")


def test_a_saved_feature_cache_resumes_without_running_the_prefix_again():
    """save_feature_cache=True: the state holds the cached rows (bf16 as stored, on the CPU),
    and a loader that loads it hands out the saved run's features without a prefix forward for
    examples cached before; without it the state holds none and the cache refills."""
    backbone, head = backbone_and_head()
    kwargs = dict(model=head, frozen_prefix=backbone, autocast=torch.bfloat16, cache_features=True)
    loader, _ = run(save_feature_cache=True, epochs=1, **kwargs)
    state = loader.state_dict()
    saved = state["scorer"]["feature_cache"]
    assert saved["values"].dtype == torch.bfloat16 and saved["values"].device.type == "cpu"
    assert saved["filled"].all()
    again, _ = run(save_feature_cache=True, epochs=0, **kwargs)
    again.load_state_dict(state)
    assert [b.features.shape[0] for b in again]  # an epoch from the restored cache
    assert again.stats.current.prefix_forwards <= 2 * FeatureCache.CHECKED  # only the check's
    cache = again.scorer.feature_cache
    assert torch.equal(cache.values, loader.scorer.feature_cache.values)
    plain, _ = run(epochs=1, **kwargs)
    assert "filled" not in plain.state_dict()["scorer"]["feature_cache"]


def test_a_feature_cache_saved_mid_epoch_resumes_as_the_uninterrupted_run():
    """save_feature_cache=True, saved mid-epoch: the resumed run hands out the uninterrupted
    run's features and runs the prefix as often (an epoch whose check already ran before the
    save does not check again); the rows it caches after the resume are never written into the
    state it loaded."""
    backbone, head = backbone_and_head()

    def fresh():
        return run(
            epochs=0,
            model=head,
            frozen_prefix=backbone,
            cache_features=True,
            save_feature_cache=True,
        )[0]

    def rows(batches):
        return [(b.indices.tolist(), b.features) for b in batches]

    whole = fresh()
    epochs = [rows(whole), rows(whole)]
    forwards = whole.stats.current.prefix_forwards  # the second epoch's: the check's only
    assert 0 < forwards <= 2 * FeatureCache.CHECKED
    for epoch in (0, 1):
        first = fresh()
        for _ in range(epoch):
            list(first)
        it = iter(first)
        head_rows = rows([next(it), next(it)])
        state = first.state_dict()
        filled = state["scorer"]["feature_cache"]["filled"].clone()
        assert (0 < int(filled.sum()) < N) if epoch == 0 else bool(filled.all())
        resumed = fresh()
        resumed.load_state_dict(state)
        got = head_rows + rows(resumed)
        assert [i for i, _ in got] == [i for i, _ in epochs[epoch]]
        for (_, a), (_, b) in zip(got, epochs[epoch]):
            assert torch.equal(a, b)
        assert torch.equal(state["scorer"]["feature_cache"]["filled"], filled)  # not written
        if epoch == 1:
            assert resumed.stats.current.prefix_forwards == forwards


def test_a_feature_cache_hands_out_rows_in_the_dtype_they_were_given_in():
    cache = FeatureCache(4, "cpu", store_dtype=torch.bfloat16)
    cache.put(np.array([1, 3]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert cache.values is not None and cache.values.dtype == torch.bfloat16
    out = cache.get(np.array([3, 1]))
    assert out.dtype == torch.float32 and out.tolist() == [[3.0, 4.0], [1.0, 2.0]]


@pytest.mark.parametrize("saved", [False, True], ids=["cache-not-saved", "cache-saved"])
def test_a_refused_load_leaves_the_feature_cache_as_it_was(saved):
    """All or nothing: a state refused after the scorer's part was restored (here, its stats)
    leaves the cache's rows as they were (its backup refers to them), saved with the state or
    not."""
    backbone, head = backbone_and_head()
    kwargs = dict(model=head, frozen_prefix=backbone, cache_features=True)
    loader, _ = run(save_feature_cache=saved, epochs=1, **kwargs)
    cache = loader.scorer.feature_cache
    values, filled = cache.values.clone(), cache.filled.copy()
    other, _ = run(save_feature_cache=saved, epochs=0, **kwargs)
    bad = copy.deepcopy(other.state_dict())
    bad["stats"]["epochs"] = [{"no_such_count": 1}]
    with pytest.raises(TypeError, match="no_such_count"):
        loader.load_state_dict(bad)
    cache = loader.scorer.feature_cache
    assert torch.equal(cache.values, values) and (cache.filled == filled).all()


def test_a_saved_feature_cache_of_another_prefix_is_refused_and_never_shared():
    """The saved rows record the prefix's digest: a loader whose frozen prefix has other
    weights refuses them when loading (they would be handed out as its features); the rows
    loaded are a copy, never the caller's state's tensor."""
    backbone, head = backbone_and_head()
    kwargs = dict(model=head, cache_features=True, save_feature_cache=True)
    loader, _ = run(frozen_prefix=backbone, epochs=1, **kwargs)
    state = loader.state_dict()
    other = copy.deepcopy(backbone)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    moved, _ = run(frozen_prefix=other, epochs=0, **kwargs)
    with pytest.raises(ValueError, match="computed by another frozen_prefix"):
        moved.load_state_dict(state)
    same, _ = run(frozen_prefix=backbone, epochs=0, **kwargs)
    same.load_state_dict(state)
    rows, saved = same.scorer.feature_cache.values, state["scorer"]["feature_cache"]["values"]
    assert torch.equal(rows, saved) and rows.data_ptr() != saved.data_ptr()
    # The same weights wrapped (parameter names prefixed, as torch.compile's _orig_mod. and
    # DDP's module. do) compute the same features: accepted.
    wrapped, _ = run(frozen_prefix=nn.Sequential(copy.deepcopy(backbone)), epochs=0, **kwargs)
    wrapped.load_state_dict(state)
    assert torch.equal(wrapped.scorer.feature_cache.values, saved)


@pytest.mark.parametrize("cache", [False, None])
def test_save_feature_cache_without_a_cache_is_refused_naming_the_value(cache):
    backbone, head = backbone_and_head()
    with pytest.raises(ValueError, match=rf"save_feature_cache=True .* got cache_features={cache}"):
        run(model=head, frozen_prefix=backbone, cache_features=cache, save_feature_cache=True)


@pytest.mark.parametrize("where", ["model", "selector", "built after the loader"])
def test_lazy_parameters_made_by_a_selection_pass_train(where):
    """A lazy module's first forward may be the loader's first selection pass: under inference
    mode its parameters would be inference tensors, which report requires_grad=True and never
    get a gradient (the layer never trained, silently). Such a pass runs under no_grad, so they
    train; a lazy model with a selector, or one made by the caller after the loader was built,
    trains as well."""
    from torch.utils.data import TensorDataset

    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,))), batch_size=8)
    lazy = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 3))
    model = nn.Linear(4, 3) if where == "selector" else lazy
    loader = SelectiveLoader(
        data,
        model,
        selector=lazy if where == "selector" else None,
        policy=SelectiveBackprop(0.5),
        batch_size=8,
    )
    if where == "built after the loader":
        lazy(torch.randn(2, 4))
    opt = before = None
    for batch in loader:
        if opt is None:
            opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
            before = lazy[0].weight.detach().clone()
        opt.zero_grad()
        nn.functional.cross_entropy(lazy(batch[0]), batch[1]).backward()
        opt.step()
    weight = lazy[0].weight
    assert not weight.is_inference() and weight.grad is not None
    assert not torch.equal(before, weight)
    # once made, passes run under inference mode again
    assert loader._scorer._inference(lazy) and not loader._scorer._maybe_lazy


def test_a_selection_scale_that_leaves_no_pixels_is_refused_naming_it():
    from torch.utils.data import TensorDataset

    data = DataLoader(
        TensorDataset(torch.randn(32, 2, 16, 1), torch.randint(0, 4, (32,))), batch_size=16
    )
    net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 4))
    loader = SelectiveLoader(
        data,
        net,
        policy=SelectiveBackprop(0.5),
        batch_size=8,
        selection_scale=0.5,
        quantize_selection=False,
    )
    with pytest.raises(ValueError, match=r"selection_scale=0.5 resizes .* \(16, 1\) to \(8, 0\)"):
        next(iter(loader))


def test_cached_float32_features_refuse_a_random_horizontal_flip():
    """A horizontal flip through a globally pooled backbone can change its features by 1-2%,
    under the 5% a bf16 cache must allow: float32 features are held to 1e-3 (another batch's
    kernels differ by about 1e-7), and 16 examples are checked (half of them flipped anew each
    epoch), so a flip is refused as the README says (it trained on epoch 0's flips all run)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(N, 3, 16, 16, generator=g)  # non-negative images, as pixels are
    y = torch.randint(0, CLASSES, (N,), generator=g)
    flips = torch.Generator().manual_seed(1)

    class Flipped(TensorDataset):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return (x.flip(-1) if torch.rand((), generator=flips) < 0.5 else x), y

    backbone = seeded(
        lambda: nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
    )
    backbone.requires_grad_(False).eval()
    with torch.no_grad():
        a, b = backbone(x[:32]), backbone(x[:32].flip(-1))
        change = ((a - b).norm(dim=1) / a.norm(dim=1)).max()
    assert FeatureCache.TOLERANCE_FP32 < change < FeatureCache.TOLERANCE  # the case 5% missed
    loader = SelectiveLoader(
        DataLoader(Flipped(x, y), batch_size=60, shuffle=True, generator=g),
        nn.Linear(32, CLASSES),
        policy=SelectiveBackprop(1 / 3, history=64),
        batch_size=20,
        frozen_prefix=backbone,
        cache_features=True,
    )
    list(loader)
    with pytest.raises(ValueError, match="input changed between epochs"):
        list(loader)


def test_a_prefix_whose_outputs_depend_on_its_batch_is_calibrated_not_refused():
    """A dynamically int8-quantized frozen prefix scales its activations per batch: the same
    inputs in another batch differ by about 4% in float32, which the 1e-3 for float32 features
    refused as changed inputs. The check measures what another batch alone changes (the same
    inputs in two halves) and allows ten times that, at most 5%."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    backbone = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
    prefix = torch.ao.quantization.quantize_dynamic(backbone.eval(), {nn.Linear}, torch.qint8)
    prefix.requires_grad_(False)
    loader = SelectiveLoader(
        DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator()),
        nn.Linear(128, 10),
        policy=SelectiveBackprop(0.5),
        batch_size=32,
        frozen_prefix=prefix,
        cache_features=True,
        seed=0,
    )
    for _ in range(3):
        list(loader)
    assert [e.prefix_forwards for e in loader.stats.epochs][1:] == [32, 32]


def test_features_computed_with_tf32_kernels_get_the_loose_tolerance_wherever_kept():
    """Features computed on a CUDA device while torch allows TF32 may differ by about 1e-3 in
    another batch: they get the 5%, also when the cache is kept on the CPU; float32 features
    computed on a CPU (or with TF32 off) the 1e-3, and bf16-kept ones the 5%."""
    cache = FeatureCache(8, "cpu")
    cache.put(np.arange(2), torch.randn(2, 4))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cache.tolerance(cpu) == FeatureCache.TOLERANCE_FP32
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        assert cache.tolerance(cuda) == FeatureCache.TOLERANCE
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        assert cache.tolerance(cuda) == FeatureCache.TOLERANCE_FP32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    half = FeatureCache(8, "cpu", torch.bfloat16)
    half.put(np.arange(2), torch.randn(2, 4))
    assert half.tolerance(cpu) == FeatureCache.TOLERANCE
