"""quantize_selection=: the selection forward through an int8 copy of the model on the CPU."""

from __future__ import annotations

import io
import logging
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_python
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sbloader
from sbloader import QuantizedSelection, SelectiveBackprop, SelectiveLoader

CLASSES = 4


def cnn(seed: int = 0) -> nn.Module:
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * 6 * 6, 16),
            nn.ReLU(),
            nn.Linear(16, CLASSES),
        )


def dataset(n: int = 384, seed: int = 0, noise: float = 0.5) -> TensorDataset:
    """Images whose class is the quadrant holding a bright blob, plus noise (learnable)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = torch.randn(n, 1, 12, 12, generator=g) * noise
    for i, c in enumerate(y.tolist()):
        r, s = divmod(c, 2)
        x[i, 0, 6 * r : 6 * r + 6, 6 * s : 6 * s + 6] += 1.0
    return TensorDataset(x, y)


def trained(seed: int = 0, steps: int = 30) -> nn.Module:
    model = cnn(seed)
    data = dataset(512, seed=99)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(steps):
        j = (i * 32) % 512
        loss = nn.functional.cross_entropy(
            model(data.tensors[0][j : j + 32]), data.tensors[1][j : j + 32]
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def make(model: nn.Module, quantize: Any, policy: Any = None, **kw: Any) -> SelectiveLoader:
    kw.setdefault("batch_size", 8)
    return SelectiveLoader(
        DataLoader(kw.pop("data", dataset()), batch_size=kw.pop("source_batch", 32)),
        model,
        policy=SelectiveBackprop(1 / 3) if policy is None else policy,
        seed=kw.pop("seed", 0),
        quantize_selection=quantize,
        **kw,
    )


def epoch_batches(
    loader: SelectiveLoader, opt: torch.optim.Optimizer | None = None, stop: int | None = None
) -> list[tuple[list[int], list[float]]]:
    """The yielded batches' indices and selection losses; one SGD step on each when ``opt``."""
    out = []
    for batch in loader:
        out.append((batch.indices.tolist(), batch.losses.tolist()))
        if opt is not None:
            x, y = batch
            loss = nn.functional.cross_entropy(loader.model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if len(out) == stop:  # (the batches fetched were all trained on)
            break
    return out


def test_int8_selections_agree_with_fp32_on_a_trained_cnn() -> None:
    # The model does not change during the epoch, so both loaders score the same weights with
    # the same draws; only the losses' precision differs.
    model = trained()
    runs = {}
    for q in (False, True):
        loader = make(model, q, data=dataset(768, seed=1), source_batch=128, batch_size=16)
        runs[q] = epoch_batches(loader)
    kept = {q: {i for idx, _ in runs[q] for i in idx} for q in runs}
    overlap = len(kept[True] & kept[False]) / len(kept[False])
    # Measured: 0.978 of fp32's kept set (int8 moves a few ranks near the draws' thresholds).
    assert overlap >= 0.9, overlap
    losses = {q: {i: v for idx, ls in runs[q] for i, v in zip(idx, ls)} for q in runs}
    common = sorted(kept[True] & kept[False])
    a = np.array([losses[True][i] for i in common])
    b = np.array([losses[False][i] for i in common])
    assert not np.array_equal(a, b)  # int8 really scored (its losses are not fp32's)
    assert np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1] > 0.98


class Recording(nn.Module):
    """A per-example cross-entropy that records, per selection forward, which int8 copy scored
    (the refresh count at the time) and whether its logits were all zero."""

    reduction = "none"

    def __init__(self) -> None:
        super().__init__()
        self.loader: SelectiveLoader | None = None
        self.calls: list[tuple[int, bool]] = []

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self.loader is not None
        quantized = self.loader.scorer.quantized
        assert quantized is not None
        self.calls.append((quantized.refreshes, bool((logits == 0).all())))
        return nn.functional.cross_entropy(logits, y, reduction="none")


def test_refreshed_from_current_weights_every_refresh_every_source_batches() -> None:
    model = cnn()
    loss = Recording()
    # 384 examples in source batches of 32: 12 selection passes per epoch.
    loader = make(model, QuantizedSelection(refresh_every=5), loss_fn=loss)
    loss.loader = loader
    for i, _ in enumerate(loader):
        if i == 0:  # after the first pass: the next copy scores every example log(4)
            with torch.no_grad():
                model[-1].weight.zero_()
                model[-1].bias.zero_()
    quantized = loader.scorer.quantized
    assert quantized is not None and quantized.refreshes == 3  # passes 0, 5 and 10
    assert [c[0] for c in loss.calls] == [1] * 5 + [2] * 5 + [3] * 2
    # The first copy was built before the weights changed and scored 5 passes with them (stale);
    # every later one was built from the zeroed weights.
    assert [c[1] for c in loss.calls] == [False] * 5 + [True] * 7
    list(loader)  # a new epoch starts with a refresh
    assert quantized.refreshes == 6
    assert [c[0] for c in loss.calls[12:]] == [4] * 5 + [5] * 5 + [6] * 2
    assert quantized.refresh_s > 0


def test_stale_sb_refreshes_once_per_fresh_epoch() -> None:
    loss = Recording()
    policy = SelectiveBackprop(1 / 3, staleness=3)
    loader = make(cnn(), QuantizedSelection(refresh_every=100), policy, loss_fn=loss)
    loss.loader = loader
    fresh = []
    for _ in range(4):
        before = len(loss.calls)
        list(loader)
        fresh.append(len(loss.calls) > before)
    assert fresh == [True, False, False, True]
    quantized = loader.scorer.quantized
    assert quantized is not None and quantized.refreshes == 2
    assert [c[0] for c in loss.calls] == [1] * 12 + [2] * 12


def run(stop: int | None, quantize: Any, seed: int = 0) -> tuple[list[Any], dict[str, Any] | None]:
    """Two epochs of SB with training; with ``stop``, the state after ``stop`` batches of the
    second epoch (loader, model, optimizer) instead of the rest."""
    model = cnn(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = make(model, quantize, seed=seed, data=dataset(768, noise=2.0))
    out = epoch_batches(loader, opt)
    out += epoch_batches(loader, opt, stop)
    if stop is None:
        return out, None
    state = {"loader": loader.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return out, torch.load(buffer, weights_only=True)


def test_same_seed_same_selections_and_global_state_untouched() -> None:
    engine, threads = torch.backends.quantized.engine, torch.get_num_threads()
    rng = torch.get_rng_state()
    first, _ = run(None, QuantizedSelection(refresh_every=3))
    after_int8 = torch.get_rng_state()
    torch.set_rng_state(rng)
    run(None, False)
    assert torch.equal(after_int8, torch.get_rng_state())  # no draws from torch's global RNG
    second, _ = run(None, QuantizedSelection(refresh_every=3))
    assert first == second
    assert len(first) > 40
    assert (torch.backends.quantized.engine, torch.get_num_threads()) == (engine, threads)


@pytest.mark.parametrize(
    "quantize",
    # (refreshes counted in candidates too: the count scored since the last one is resumed)
    [QuantizedSelection(refresh_every=4), QuantizedSelection(refresh_examples=100)],
    ids=["every", "examples"],
)
@pytest.mark.parametrize("stop", [3, 7])
def test_resumed_run_scores_with_the_saved_copy(stop: int, quantize: QuantizedSelection) -> None:
    whole, _ = run(None, quantize)
    head, state = run(stop, quantize)
    assert state is not None
    model = cnn(seed=5)  # other initial weights: everything comes from the state
    model.load_state_dict(state["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt.load_state_dict(state["opt"])
    loader = make(model, quantize, data=dataset(768, noise=2.0))
    loader.load_state_dict(state["loader"])
    rest = epoch_batches(loader, opt)
    assert head + rest == whole


def test_state_must_match_the_option() -> None:
    with_q = make(cnn(), True)
    list(with_q)
    without = make(cnn(), False)
    with pytest.raises(ValueError, match="made with an int8 selection copy") as info:
        without.load_state_dict(with_q.state_dict())
    assert "quantize_selection=True to resume" in str(info.value)
    with pytest.raises(ValueError, match="made without an int8 selection copy") as info:
        make(cnn(), True).load_state_dict(without.state_dict())
    assert "quantize_selection=False to resume" in str(info.value)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(144, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor's value: torch.fx cannot trace it
            x = -x
        return self.fc(x.flatten(1))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"autocast": torch.bfloat16}, "quantize_selection cannot be combined with autocast="),
        ({"compile_selection": True}, "cannot be combined with compile_selection="),
        ({"forward": lambda m, b: m(b[0])}, "cannot be combined with forward="),
        ({"input_key": (0,)}, "cannot be combined with forward= or a tuple input_key"),
        ({"eval_selection": False}, "cannot be combined with eval_selection=False"),
        ({"frozen_prefix": nn.Identity()}, "cannot be combined with frozen_prefix="),
        ({"keep_logits": True}, "cannot be combined with keep_logits=True"),
        ({"device": "meta"}, "int8 kernels on the CPU, but device is on meta"),
    ],
)
def test_refused_combinations_name_the_options(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        make(cnn(), True, **kw)
    assert "quantize_selection=False" in str(info.value)


def test_untraceable_model_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"tracing it with torch\.fx") as info:
        make(Branchy(), True)
    assert "selector= a traceable model" in str(info.value)
    # a traceable selector makes it work: the selector is what is quantized
    loader = make(Branchy(), True, selector=cnn())
    assert len(list(loader)) > 0


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="refresh_every should be >= 1"):
        QuantizedSelection(refresh_every=0)
    with pytest.raises(TypeError, match="calibration_examples should be an int"):
        QuantizedSelection(calibration_examples=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="refresh_examples should be >= 1"):
        QuantizedSelection(refresh_examples=0)
    with pytest.raises(ValueError, match="refresh_examples or refresh_every, not both"):
        QuantizedSelection(refresh_examples=64, refresh_every=2)
    with pytest.raises(TypeError, match="quantize_selection should be 'auto', True, False or"):
        make(cnn(), "int8")


def test_engine_changed_fails_on_the_first_batch_even_in_a_warm_up() -> None:
    model = cnn()
    model.train()
    flags = [m.training for m in model.modules()]
    loader = make(model, True, sbloader.default_policy())  # epoch 0: no selection pass
    engine = torch.backends.quantized.engine
    other = next(e for e in torch.backends.quantized.supported_engines if e not in (engine, "none"))
    try:
        torch.backends.quantized.engine = other
        with pytest.raises(RuntimeError, match=r"torch\.backends\.quantized\.engine was"):
            next(iter(loader))
    finally:
        torch.backends.quantized.engine = engine
    assert [m.training for m in model.modules()] == flags
    # the training flags stay as they were after a normal epoch too
    list(make(model, True))
    assert [m.training for m in model.modules()] == flags


def circular() -> nn.Module:
    """Traceable, but quantized convolutions have no circular padding."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, padding_mode="circular"),
        nn.Flatten(),
        nn.Linear(4 * 12 * 12, CLASSES),
    )


@pytest.mark.parametrize("policy", [SelectiveBackprop(1 / 3), sbloader.default_policy()])
def test_model_without_int8_kernels_fails_on_the_first_batch(policy: Any) -> None:
    model = circular()
    loader = make(model, True, policy)  # (default_policy: a warm-up epoch without a pass)
    with pytest.raises(RuntimeError, match="could not make an int8 copy") as info:
        next(iter(loader))
    assert "circular is not supported" in str(info.value)
    assert "quantize_selection=False" in str(info.value)
    assert model.training  # the model itself was never put in eval mode


def scaled_cnn() -> nn.Module:
    """Takes 6 x 6 inputs only: the 12 x 12 images at selection_scale=0.5 (so the copy must be
    calibrated on downsampled inputs too)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 6 * 6, CLASSES),
        )


def test_with_selection_scale_the_copy_scores_the_downsampled_inputs() -> None:
    model = scaled_cnn()
    runs = {}
    for q in (False, True):
        loader = make(model, q, data=dataset(768, seed=2), source_batch=128, selection_scale=0.5)
        runs[q] = set()
        for batch in loader:  # yielded batches keep full resolution
            assert batch[0].shape[-2:] == (12, 12)
            runs[q] |= set(batch.indices.tolist())
    assert len(runs[True] & runs[False]) / len(runs[False]) >= 0.9


# ---------------------------------------------------------------- refreshes, memory, checkpoints
def test_refreshes_counted_in_candidates_whatever_the_source_batch() -> None:
    """The default clock counts candidates scored: the same work between two refreshes with
    source batches of 32 or of 16 (every 2 or every 4 passes for refresh_examples=64)."""
    for source_batch, per_copy in ((32, 2), (16, 4)):
        loss = Recording()
        loader = make(
            cnn(), QuantizedSelection(refresh_examples=64), loss_fn=loss, source_batch=source_batch
        )
        loss.loader = loader
        list(loader)
        passes = 384 // source_batch
        assert [c[0] for c in loss.calls] == [1 + i // per_copy for i in range(passes)]
    assert QuantizedSelection().refresh_examples == 16384  # 32 source batches of 512


def test_refreshes_leave_no_copy_alive() -> None:
    """Each refresh replaces the copy; torch's FX conversion memoises every module it converts
    (an unbounded cache), which would keep each old copy's weights alive without the loader's
    clearing it.

    NOTE: counted in live modules, not tensors: in the whole suite a thread some earlier test
    left running may hold a few thousand more tensors at one moment than at another (seen once
    in CI), while the leak adds whole modules (the float and intermediate copies) per refresh.
    By ``type(o)``, not ``isinstance``: the latter reads ``__class__``, which raises on a dead
    weak proxy among the collected objects.
    """
    import gc
    import weakref

    def live() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if issubclass(type(o), nn.Module))

    loader = make(cnn(), QuantizedSelection(refresh_every=1))
    list(loader)
    quantized = loader.scorer.quantized
    assert quantized is not None
    copies = []
    before = live()
    for _ in range(3):
        for _ in loader:  # 12 refreshes an epoch
            copies.append(weakref.ref(quantized.model))
    assert quantized.refreshes == 48
    gc.collect()
    old = {id(m): m for m in (c() for c in copies) if m is not None and m is not quantized.model}
    holders = sorted(
        {type(r).__name__ for m in old.values() for r in gc.get_referrers(m) if r is not old}
    )
    assert not old, f"{len(old)} old int8 copies still alive, referred to by {holders}"
    del old
    assert live() - before <= 2


class BareLinear(nn.Module):
    """A model whose int8 copy packs a functional linear layer's weights (a ScriptObject)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(CLASSES, 144, generator=torch.Generator()) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.flatten(1), self.weight)


def test_a_copy_with_packed_weights_checkpoints_with_weights_only_and_resumes_exactly() -> None:
    def loader() -> SelectiveLoader:
        return make(BareLinear(), QuantizedSelection(refresh_every=5))

    whole = loader()
    expected = epoch_batches(whole)
    first = loader()
    it = iter(first)
    head = [(b.indices.tolist(), b.losses.tolist()) for b in (next(it), next(it), next(it))]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # torch.load's default
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + epoch_batches(resumed) == expected


def attribute_cnn() -> nn.Module:
    """A CNN whose int8 copy holds values outside its state dict: a quantized ELU's output scale
    and zero point, a quantized PReLU's int8 weight, scale and zero point (plain attributes)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ELU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.PReLU(8),
            nn.Flatten(),
            nn.Linear(8 * 12 * 12, CLASSES),
        )


def test_a_copy_holding_values_outside_its_state_dict_resumes_exactly() -> None:
    """The resumed copy is traced from the resumed model (trained past the saved copy's last
    refresh) and calibrated on the resumed run's first source batch, then takes the saved
    values: those its modules hold as plain attributes must be the saved copy's too."""
    quantize = QuantizedSelection(refresh_every=5)

    def start(state: dict[str, Any] | None = None) -> tuple[SelectiveLoader, Any]:
        model = attribute_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = make(model, quantize, data=dataset(384, noise=2.0))
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            loader.load_state_dict(state["loader"])
        return loader, opt

    whole, opt = start()
    expected = epoch_batches(whole, opt)
    first, opt = start()
    head = epoch_batches(first, opt, stop=3)
    model = first.model
    buffer = io.BytesIO()
    torch.save(
        {"loader": first.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()},
        buffer,
    )
    buffer.seek(0)
    resumed, opt = start(torch.load(buffer, weights_only=True))
    assert head + epoch_batches(resumed, opt) == expected


# ------------------------------------------------------------------------ quantize_selection="auto"
def native(monkeypatch: pytest.MonkeyPatch, answer: bool) -> None:
    """Make this process's CPU answer ``answer`` to torch's int8 capability queries."""
    for name in ("_is_vnni_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: answer, raising=False)


def test_auto_is_int8_where_the_cpu_has_native_int8_and_the_default_is_off(monkeypatch) -> None:
    native(monkeypatch, True)
    model = trained()
    chosen = make(model, "auto")
    assert chosen.scorer.quantized is not None and chosen.autocast is None
    assert chosen.selection_precision == "quantize_selection='auto': int8 (native int8 on this CPU)"
    default = SelectiveLoader(  # measured: not the default (see the loader's NOTE)
        DataLoader(dataset(), batch_size=32), model, policy=SelectiveBackprop(1 / 3), batch_size=8
    )
    assert default.scorer.quantized is None
    assert default.selection_precision.startswith("quantize_selection=False; autocast='auto': ")
    auto = epoch_batches(chosen)
    explicit = epoch_batches(make(model, True))  # the same copy, the same selections
    assert auto == explicit
    floats = epoch_batches(make(model, False, autocast=None))
    assert auto != floats  # int8 really scored
    native(monkeypatch, False)
    off = make(model, "auto")
    assert off.scorer.quantized is None
    assert off.selection_precision.startswith(
        "quantize_selection='auto': off (no native int8 on this CPU); autocast='auto': "
    )


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"autocast": torch.bfloat16}, "autocast=torch.bfloat16 was given"),
        ({"autocast": None}, "autocast=None was given"),
        ({"compile_selection": {"backend": "eager"}}, "compile_selection="),
        ({"forward": lambda m, b: m(b[0])}, "forward="),
        ({"eval_selection": False}, "eval_selection=False"),
        ({"frozen_prefix": nn.Identity()}, "frozen_prefix="),
        ({"keep_logits": True}, "keep_logits=True"),
        ({"overlap_selection": True}, "overlap_selection=True"),
        ({"device": "meta"}, "device is on meta"),
    ],
)
def test_auto_stays_off_and_says_why_where_something_stands_in_the_way(
    monkeypatch, kw: dict[str, Any], reason: str
) -> None:
    native(monkeypatch, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overlap_selection's warning about plain SB
        loader = make(cnn(), "auto", **kw)
    assert loader.scorer.quantized is None
    assert loader.selection_precision.startswith("quantize_selection='auto': off (")
    assert reason in loader.selection_precision


@pytest.mark.parametrize("warmup", [False, True])
def test_auto_falls_back_on_the_first_batch_where_int8_cannot_be_built(
    monkeypatch, warmup: bool
) -> None:
    """An untraceable model: the first source batch (a pass, or the warm-up's trial) finds it,
    warns once, and every pass runs in the float precision ``"auto"`` picks; the selections are
    those of a loader told ``quantize_selection=False``. Explicitly asked for, it is refused."""
    native(monkeypatch, True)
    policy = (lambda: sbloader.default_policy()) if warmup else (lambda: SelectiveBackprop(0.5))
    torch.manual_seed(3)
    model = Branchy()
    auto = make(model, "auto", policy())
    assert auto.scorer.quantized is not None  # not traced when built: its forward is not run
    with pytest.warns(UserWarning, match=r"the int8 copy could not be built: TraceError"):
        got = [b for _ in range(2) for b in epoch_batches(auto)]
    assert auto.scorer.quantized is None
    assert "quantize_selection='auto': off (the int8 copy could not be built" in (
        auto.selection_precision
    )
    plain = make(model, False, policy())
    # (compared as text: a warm-up's batches carry NaN losses, which == never matches)
    assert str(got) == str([b for _ in range(2) for b in epoch_batches(plain)])
    assert auto.autocast is plain.autocast
    with pytest.raises(ValueError, match=r"tracing it with torch\.fx"):
        make(model, True)


@pytest.mark.parametrize("warmup", [False, True], ids=["selection pass", "warm-up trial"])
@pytest.mark.parametrize("quantize", [True, "auto"])
def test_a_lazy_model_gets_its_int8_copy_and_its_parameters_train(
    monkeypatch, quantize: Any, warmup: bool
) -> None:
    """A model with lazy parameters (``nn.LazyLinear``), which float selection passes take: the
    copy's build makes them first, as a float pass would (under ``no_grad``: they train). Before,
    the build met them uninitialised: ``True`` was refused on the first batch naming layers
    without int8 kernels, and ``"auto"`` fell back to float for the whole run."""
    native(monkeypatch, True)
    policy = sbloader.default_policy() if warmup else SelectiveBackprop(0.5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(CLASSES))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no fall-back warning)
        loader = make(model, quantize, policy)
        x, y = next(b for _ in range(2) for b in loader)
    assert loader.scorer.quantized is not None
    assert "int8" in loader.selection_precision and "off" not in loader.selection_precision
    lazy = model[3]
    assert isinstance(lazy, nn.Linear) and not lazy.weight.is_inference()
    nn.functional.cross_entropy(model(x), y).backward()
    assert lazy.weight.grad is not None


def test_auto_never_falls_back_once_its_copy_has_scored(monkeypatch) -> None:
    """A copy chosen by "auto" that was built and scored with is kept: a refresh that fails
    later (here, the next epoch's) raises, instead of switching to float passes mid-run (a run
    never mixes precisions)."""
    import sbloader.quantize as quantize

    native(monkeypatch, True)
    loader = make(trained(), "auto")
    precision = loader.selection_precision
    assert precision == "quantize_selection='auto': int8 (native int8 on this CPU)"
    assert epoch_batches(loader)
    assert loader.scorer.quantized is not None and loader.scorer.quantized.refreshes == 1

    def broken(*args: Any, **kwargs: Any) -> nn.Module:
        raise RuntimeError("no kernel for this op")

    monkeypatch.setattr(quantize, "_int8_copy", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(quantize.Int8Unavailable, match="no kernel for this op"):
            epoch_batches(loader)
    assert loader.scorer.quantized is not None and loader.selection_precision == precision


def test_auto_resume_follows_the_saved_run(monkeypatch, caplog) -> None:
    """A run saved without the copy (fallen back, or on a CPU without native int8) resumes
    without it under "auto"; a run saved with it cannot be resumed without it."""
    native(monkeypatch, False)
    first = make(trained(), "auto", data=dataset(768))
    it = iter(first)
    head = [(b.indices.tolist(), b.losses.tolist()) for b in (next(it), next(it))]
    state = first.state_dict()
    rest = [(b.indices.tolist(), b.losses.tolist()) for b in it]
    native(monkeypatch, True)
    resumed = make(trained(), "auto", data=dataset(768))
    assert resumed.scorer.quantized is not None  # this machine's own choice ...
    with caplog.at_level(logging.INFO, logger="sbloader"):
        resumed.load_state_dict(state)
    assert resumed.scorer.quantized is None  # ... gives way to the saved run's
    assert "the resumed run's own" in resumed.selection_precision
    said = [r.getMessage() for r in caplog.records if "the resumed run's own" in r.getMessage()]
    assert said == [f"selection precision: {resumed.selection_precision}"]  # once, when accepted
    assert head + epoch_batches(resumed) == head + rest
    saved_int8 = make(trained(), "auto", data=dataset(768))
    list(saved_int8)
    native(monkeypatch, False)
    with pytest.raises(ValueError, match="quantize_selection=True to resume"):
        make(trained(), "auto", data=dataset(768)).load_state_dict(saved_int8.state_dict())


def test_a_refused_resume_leaves_the_auto_loaders_own_precision(monkeypatch, caplog) -> None:
    """A state saved without the copy, refused after "auto" followed it (here: mid-epoch, with
    a sampler on torch's global RNG): refused for that reason, and the loader keeps its int8
    copy (it raised "made with an int8 selection copy" about a state made without one, and had
    turned its copy off); nor does the log say it selects in the saved run's precision (it
    did, as the copy was turned off, before the refusal)."""
    native(monkeypatch, True)
    data = dataset(96)

    def build(quantize: Any) -> SelectiveLoader:
        source = DataLoader(data, batch_size=32, shuffle=True)  # no generator: no mid-epoch
        return SelectiveLoader(source, trained(), batch_size=8, quantize_selection=quantize)

    saved = build(False)
    it = iter(saved)
    next(it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the state cannot resume mid-epoch)
        state = saved.state_dict()
    loader = build("auto")
    before = (loader.scorer.quantized, loader.autocast, loader.selection_precision)
    with caplog.at_level(logging.INFO, logger="sbloader"):
        with pytest.raises(ValueError, match="draws from torch's global RNG"):
            loader.load_state_dict(state)
    assert "the resumed run's own" not in caplog.text
    assert (loader.scorer.quantized, loader.autocast, loader.selection_precision) == before
    epoch_batches(loader)  # (the default's warm-up, then a selection pass with its copy)
    assert len(epoch_batches(loader)) > 0 and loader.scorer.quantized.refreshes > 0


_NOTICE_SCRIPT = r"""
import warnings
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import sbloader

warnings.simplefilter("always")
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
data = TensorDataset(torch.randn(96, 1, 4, 4), torch.randint(0, 3, (96,)))
loader = sbloader.SelectiveLoader(
    DataLoader(data, batch_size=32), model, policy=sbloader.SelectiveBackprop(1 / 3),
    batch_size=8, seed=0, quantize_selection=sbloader.QuantizedSelection(refresh_every=1),
)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for _ in range(2):
        for batch in loader:
            pass
    filters = list(warnings.filters)
assert loader.stats.total.selection_forwards == 192, loader.stats.total
print("NOTICES", len(seen), [str(w.message)[:80] for w in seen[:3]])
# torch's own notice is spent: a forward outside sbloader no longer warns.
with warnings.catch_warnings(record=True) as later:
    warnings.simplefilter("always")
    torch.quantize_per_tensor(torch.randn(2), 0.1, 0, torch.quint8)
print("LATER", len(later))
"""


def test_a_fresh_process_sees_no_int8_notice_and_torch_spends_its_own() -> None:
    """torch warns about quantized tensors once per process; the first build of the int8 copy
    spends that warning under its own filters, so no pass or refresh shows a notice."""

    proc = run_python(_NOTICE_SCRIPT, timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "NOTICES 0 []" in out, out
    assert "LATER 0" in out, out


def test_the_copy_is_calibrated_in_float32_inside_a_callers_autocast_region() -> None:
    """A caller's ``torch.autocast`` region around the loop does not reach the int8 copy's
    calibration: the same scales, and so the same selections, as outside it."""

    def scales_and_batches(region: bool) -> tuple[dict[str, Any], list[Any]]:
        loader = make(cnn(), True, autocast=None)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region):
            batches = epoch_batches(loader, stop=3)
        copy = loader.scorer.quantized.model.state_dict()
        return {k: v for k, v in copy.items() if k.endswith(("scale", "zero_point"))}, batches

    (inside, b_in), (outside, b_out) = scales_and_batches(True), scales_and_batches(False)
    assert inside.keys() == outside.keys() and inside
    for k in inside:
        assert torch.equal(torch.as_tensor(inside[k]), torch.as_tensor(outside[k])), k
    assert b_in == b_out


@pytest.mark.parametrize("bad_row", [0, 40])
def test_a_candidate_with_nan_inputs_is_non_finite_as_in_float(bad_row: int) -> None:
    """A candidate whose input holds a NaN gets a non-finite loss from the int8 copy, as from the
    float model: it alone is skipped (``nonfinite="skip"``). Before, in the calibration rows it
    made every scale NaN (every candidate of the copy's life skipped), and elsewhere quantizing
    made its input finite, so it could be selected and its NaN input trained on."""
    data = dataset(64)
    data.tensors[0][bad_row, 0, 3, 3] = float("nan")
    runs = {}
    for q in (False, True):
        loader = make(cnn(), q, policy=SelectiveBackprop(1.0), data=data)
        kept = {i for idx, _ in epoch_batches(loader) for i in idx}
        stats = loader.stats.current
        assert stats is not None
        runs[q] = (stats.nonfinite, bad_row in kept, len(kept))
    assert runs[True][:2] == runs[False][:2] == (1, False)
    assert runs[True][2] > 32  # the other candidates were scored finite and selected


class _Structured(nn.Module):
    """The CNN returning its logits inside a dict (Hugging Face style) or a tuple."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.net = kind, cnn()

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.net(x)
        return {"logits": logits} if self.kind == "dict" else (logits, logits.sum(1))


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_a_candidate_with_nan_inputs_is_non_finite_whatever_structure_the_model_returns(
    kind: str,
) -> None:
    """A model whose logits come inside a dict or a tuple (``output=0``): the int8 copy's NaN
    rows reach them too. Before, only a tensor output was masked, so the NaN candidate got a
    finite int8 loss, could be selected, and its NaN input reached the training step."""
    data = dataset(64)
    data.tensors[0][5, 0, 3, 3] = float("nan")
    runs = {}
    for q in (False, True):
        extra: dict[str, Any] = {"output": 0} if kind == "tuple" else {}
        loader = make(_Structured(kind), q, policy=SelectiveBackprop(1.0), data=data, **extra)
        kept = {i for idx, _ in epoch_batches(loader) for i in idx}
        stats = loader.stats.current
        assert stats is not None
        runs[q] = (stats.nonfinite, 5 in kept)
    assert runs[True] == runs[False] == (1, False)


def test_a_copy_is_calibrated_on_the_first_finite_candidates_skipping_a_nan_one() -> None:
    """The calibration rows are the first ``calibration_examples`` candidates with finite
    inputs: a NaN candidate among them is skipped (the next finite one takes its place), not
    calibrated on with its values zeroed. The copy is then the one calibrated on those rows."""
    from sbloader.quantize import QuantizedSelector

    x = dataset(16).tensors[0].clone()
    x[4] *= 20.0  # the fifth candidate widens the activation ranges
    x[0, 0, 3, 3] = float("nan")
    engine = torch.backends.quantized.engine
    config = QuantizedSelection(calibration_examples=4)
    model = cnn()
    with torch.inference_mode():
        skipped = QuantizedSelector(config, engine).model_for(model, x, epoch=0)(x[1:])
        clean = QuantizedSelector(config, engine).model_for(model, x[1:], epoch=0)(x[1:])
    assert torch.equal(skipped, clean)


def test_a_model_that_cannot_be_copied_is_refused_naming_the_attribute() -> None:
    """A model that keeps its loader (as a LightningModule may) cannot be deep-copied during an
    epoch: refused on the first batch naming the copy and the attribute, not the model's
    layers."""
    model = cnn()
    loader = make(model, True)
    model.loader = loader  # type: ignore[assignment]
    with pytest.raises(sbloader.quantize.Int8Unavailable) as info:
        next(iter(loader))
    message = str(info.value)
    assert "copy.deepcopy of the selection model" in message, message
    assert "attribute 'loader' (a SelectiveLoader)" in message, message
    assert "layers have int8 kernels" not in message
    assert "quantize_selection=False" in message


def _scale_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
    return (args[0] / 10.0,)


def _shift_outputs(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    return out + torch.arange(out.shape[1], dtype=out.dtype)


def _hook(module: nn.Module, kind: str) -> None:
    """Give ``module`` a forward pre-hook scaling its inputs (``"pre"``) or a forward hook
    shifting its outputs (``"post"``)."""
    if kind == "pre":
        module.register_forward_pre_hook(_scale_inputs)
    else:
        module.register_forward_hook(_shift_outputs)


@pytest.mark.parametrize(
    ("where", "kind"),
    [("", "pre"), ("", "post"), ("0", "pre"), ("5", "post")],
    ids=["model pre-hook", "model hook", "layer pre-hook", "layer hook"],
)
def test_a_model_with_forward_hooks_is_refused_not_scored_without_them(
    monkeypatch, where: str, kind: str
) -> None:
    """The int8 copy runs without the model's forward hooks (torch.fx traces ``forward``, and
    converted layers are new modules): asked for, refused naming the hook and the fix; under
    ``"auto"`` off, saying why; a hook registered after the loader was built is refused on the
    first source batch (``"auto"``: the float precision instead), before any loss is scored."""
    model = trained()
    _hook(model.get_submodule(where), kind)
    hook = "forward pre-hook" if kind == "pre" else "forward hook"
    named = f"module {where!r}'s {hook}" if where else f"the selection model's {hook}"
    with pytest.raises(ValueError, match="runs without its forward hooks") as info:
        make(model, True)
    assert named in str(info.value) and "quantize_selection=False" in str(info.value)
    native(monkeypatch, True)
    off = make(model, "auto")
    assert off.scorer.quantized is None and named in off.selection_precision
    plain = epoch_batches(make(model, False))
    assert epoch_batches(off) == plain
    # registered after the loader was built
    later = trained()
    asked, auto = make(later, True), make(later, "auto")
    _hook(later.get_submodule(where), kind)
    with pytest.raises(sbloader.quantize.Int8Unavailable, match=named):
        next(iter(asked))
    with pytest.warns(UserWarning, match="runs without its forward hooks"):
        assert epoch_batches(auto) == epoch_batches(make(later, False))
