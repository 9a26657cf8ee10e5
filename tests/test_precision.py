"""autocast="auto", the loader's default: bf16 selection passes where the device computes bf16
natively, float32 elsewhere and where the pass feeds training; the choice is logged, saved and
adopted by a resumed run."""

from __future__ import annotations

import logging
from types import MethodType

import pytest
import torch
from conftest import no_native_bf16
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sbloader import SelectiveBackprop, SelectiveLoader
from sbloader.datasets import ArrayDataset
from sbloader.precision import forward_autocast, native_bf16, native_int8, selection_dtype

CPU = torch.device("cpu")
N = 240


def build(seed: int = 0, **kw) -> SelectiveLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 16, generator=g)
    y = (x[:, :3] + 0.7 * torch.randn(N, 3, generator=g)).argmax(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))
    dl = DataLoader(
        ArrayDataset(x, y), batch_size=40, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    kw.setdefault("quantize_selection", False)  # the float precisions (int8: its own tests)
    kw.setdefault("policy", SelectiveBackprop(0.5))
    return SelectiveLoader(dl, kw.pop("model", model), batch_size=10, seed=seed, **kw)


def test_auto_follows_the_devices_native_bf16(monkeypatch):
    no_native_bf16(monkeypatch, native=True)
    assert native_bf16(CPU)
    assert selection_dtype("auto", CPU) == (
        torch.bfloat16,
        "autocast='auto': bfloat16 (native on cpu)",
    )
    assert selection_dtype("auto", CPU, feeds_training=True)[0] is None
    assert selection_dtype(None, CPU)[0] is None
    assert selection_dtype(torch.float16, CPU)[0] is torch.float16
    no_native_bf16(monkeypatch, native=False)
    assert not native_bf16(CPU)
    assert selection_dtype("auto", CPU) == (
        None,
        "autocast='auto': float32 (no native bf16 on cpu)",
    )
    assert not native_bf16(torch.device("meta"))
    with pytest.raises(TypeError, match=r"autocast should be a torch.dtype .* got autocast='bf16'"):
        build(autocast="bf16")


def test_a_reduced_precision_model_without_autocast_is_said_to_select_in_its_own_dtype(
    monkeypatch,
):
    """A bfloat16 model (its inputs converted by convert_inputs=) selects in bfloat16 where no
    autocast is used; loader.selection_precision said float32 ("what selection passes run
    in")."""
    no_native_bf16(monkeypatch, native=False)
    for autocast in ("auto", None):
        dtype, why = selection_dtype(autocast, CPU, model_dtype=torch.bfloat16)
        assert dtype is None and "bfloat16 (the model's own dtype" in why, why
    dtype, why = selection_dtype(
        "auto", CPU, feeds_training="the kept logits", model_dtype=torch.float16
    )
    assert dtype is None and "float16 (the model's own dtype" in why, why
    assert selection_dtype("auto", CPU, model_dtype=torch.float32)[1].endswith(
        "float32 (no native bf16 on cpu)"
    )
    model = nn.Linear(4, 3).to(torch.bfloat16)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    loader = SelectiveLoader(
        DataLoader(data, batch_size=8),
        model,
        policy=SelectiveBackprop(0.5),
        batch_size=4,
        convert_inputs=lambda v: v.to(torch.bfloat16) if v.is_floating_point() else v,
    )
    assert "float32" not in loader.selection_precision, loader.selection_precision
    assert "bfloat16 (the model's own dtype" in loader.selection_precision


@pytest.mark.parametrize(
    ("capability", "native"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)]
)
def test_a_gpu_that_only_emulates_bf16_is_not_native(monkeypatch, capability, native):
    """A V100 (7.0) or a T4 (7.5) emulates bf16: ``torch.cuda.is_bf16_supported()``'s default
    (``including_emulation=True``) answers True there, and "auto" chose bf16 selection passes,
    said to be native; Ampere (8.0) and later compute it. The model's device is the one asked
    about, not the current device."""
    asked = []

    def get_capability(index=None):
        asked.append(index)
        return capability

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", None)
    assert native_bf16(torch.device("cuda", 1)) is native
    assert asked == [1]
    dtype, why = selection_dtype("auto", torch.device("cuda", 1))
    assert dtype is (torch.bfloat16 if native else None)
    assert why.endswith("(native on cuda)" if native else "(no native bf16 on cuda)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_a_dtype_autocast_cannot_run_is_refused_naming_the_fix(dtype):
    """torch.autocast runs bf16 or float16 only: with another dtype it warned on every selection
    pass, ran float32, and loader.selection_precision claimed the dtype asked for."""
    message = r"autocast should be torch\.bfloat16 or torch\.float16"
    with pytest.raises(ValueError, match=rf"{message}.* got autocast={dtype}; pass autocast=None"):
        build(autocast=dtype)
    with pytest.raises(ValueError, match=message):
        selection_dtype(dtype, CPU)


@pytest.mark.parametrize("native", [True, False])
def test_the_default_selects_as_the_chosen_dtype_given_explicitly(monkeypatch, caplog, native):
    no_native_bf16(monkeypatch, native)
    with caplog.at_level(logging.INFO, logger="sbloader"):
        auto = build()
    chosen = torch.bfloat16 if native else None
    assert auto.autocast is chosen
    assert f"autocast='auto': {'bfloat16' if native else 'float32'}" in caplog.text
    assert auto.selection_precision == (
        f"quantize_selection=False; autocast='auto': {'bfloat16' if native else 'float32'} "
        f"({'native' if native else 'no native bf16'} on cpu)"
    )
    given = build(autocast=chosen)
    for a, b in zip(auto, given, strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.losses, b.losses)
    # The passes really ran in the chosen dtype: bf16's losses are not float32's.
    fp32 = torch.cat([b.losses for b in build(autocast=None)])
    assert torch.equal(torch.cat([b.losses for b in build()]), fp32) is not native


def test_a_float64_model_gets_no_autocast_and_says_so(monkeypatch):
    """autocast never casts float64 tensors: "auto" must not report bf16 selection passes that
    run in float64."""
    no_native_bf16(monkeypatch, native=True)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,))
    model = nn.Sequential(nn.Linear(16, 3)).double()
    dl = DataLoader(ArrayDataset(x, y), batch_size=40)
    loader = SelectiveLoader(
        dl, model, policy=SelectiveBackprop(0.5), batch_size=10, quantize_selection=False
    )
    assert loader.autocast is None
    assert "the model is float64" in loader.selection_precision
    exact = SelectiveLoader(
        DataLoader(ArrayDataset(x, y), batch_size=40),
        model,
        policy=SelectiveBackprop(0.5),
        batch_size=10,
        autocast=None,
        quantize_selection=False,
    )
    for a, b in zip(loader, exact, strict=True):
        assert torch.equal(a.losses, b.losses)


@pytest.mark.parametrize("native", [True, False])
def test_a_frozen_prefix_keeps_float32_since_its_features_feed_training(monkeypatch, native):
    """Float32 for a frozen prefix's features, which feed training; where bf16 is native the
    reason also says how to select in it (a float32 pass then costs more than the bf16 one the
    loader runs without the prefix)."""
    no_native_bf16(monkeypatch, native=native)
    backbone = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).requires_grad_(False)
    loader = build(frozen_prefix=backbone)
    assert loader.autocast is None
    assert "the frozen prefix's features feed training" in loader.selection_precision
    assert ("autocast=torch.bfloat16 selects in it" in loader.selection_precision) is native
    assert build().autocast is (torch.bfloat16 if native else None)


def test_kept_logits_keep_float32_since_they_feed_training(monkeypatch):
    """Kept logits are training inputs (distillation targets): "auto" keeps float32 for them,
    and says why, so that they are the model's float32 outputs on every machine."""
    no_native_bf16(monkeypatch, native=True)
    loader = build(keep_logits=True)
    assert loader.autocast is None
    assert "the kept logits feed training" in loader.selection_precision
    batch = next(b for b in loader if b.logits is not None)
    with torch.no_grad():
        exact = loader.model(loader.dataset.tensors[0][torch.as_tensor(batch.indices)])
    # (float32 up to the batch's summation order; bf16 is about 1e-2 off)
    torch.testing.assert_close(batch.logits, exact, rtol=1e-5, atol=1e-6)


def test_a_resumed_auto_loader_selects_in_the_saved_runs_precision(monkeypatch):
    """Saved on a machine with native bf16, resumed on one without: the resumed run continues
    in bf16, exactly as the uninterrupted run; an explicit choice is kept as given, with a
    warning."""
    no_native_bf16(monkeypatch, native=True)
    first = build()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    rest = [b.indices.tolist() for b in it] + [b.indices.tolist() for b in first]
    no_native_bf16(monkeypatch, native=False)
    resumed = build()
    assert resumed.autocast is None  # this machine's own choice ...
    resumed.load_state_dict(state)
    assert resumed.autocast is torch.bfloat16  # ... gives way to the saved run's
    assert [b.indices.tolist() for b in resumed] + [b.indices.tolist() for b in resumed] == rest
    explicit = build(autocast=None)
    with pytest.warns(UserWarning, match="saved with autocast=torch.bfloat16, but this loader"):
        explicit.load_state_dict(state)  # allowed, and said
    assert explicit.autocast is None
    assert state["autocast"] == "bfloat16" and build(autocast=None).state_dict()["autocast"] is None


def test_a_frozen_prefix_stays_float32_inside_a_callers_autocast_region():
    """A caller's ``torch.autocast`` region around the loop reaches neither the prefix's features
    (which feed a float32 head) nor the selection pass: the same features and selections as
    outside it, in SB epochs and in Traditional ones (whose prefix runs alone)."""
    from sbloader import Traditional

    backbone = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).requires_grad_(False)
    head = nn.Linear(8, 3)

    def batches(policy, region):
        loader = build(policy=policy, model=head, autocast=None, frozen_prefix=backbone)
        out = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=region):
            for b in loader:
                out.append((b.indices.tolist(), b.features.clone()))
        return out

    for make in (lambda: SelectiveBackprop(0.5), Traditional):
        inside, outside = batches(make(), True), batches(make(), False)
        assert [i for i, _ in inside] == [i for i, _ in outside]
        for (_, a), (_, b) in zip(inside, outside, strict=True):
            assert a.dtype == torch.float32
            assert torch.equal(a, b)


def _forward_under(autocast: torch.autocast) -> nn.Module:
    """A model whose instance forward runs under ``autocast`` (as Accelerate's prepare makes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))
    model.forward = MethodType(autocast(nn.Sequential.forward), model)
    return model


def test_only_an_enabled_forward_autocast_for_the_models_device_type_counts():
    """A model's own forward autocast decides the selection precision only where it is enabled
    and for the device type the model runs on: a disabled one (which runs float32) or one for
    another device type leaves it to the loader, so an explicit autocast=None is accepted and
    its passes run in float32; an enabled one is found, and autocast=None refused."""
    fp16 = _forward_under(torch.autocast("cpu", dtype=torch.float16))
    assert forward_autocast(fp16, CPU) == torch.float16
    assert forward_autocast(fp16, torch.device("cuda")) is None  # another device type's
    with pytest.raises(ValueError, match=r"autocast should be 'auto' or torch\.float16"):
        build(model=fp16, autocast=None)
    off = _forward_under(torch.autocast("cpu", dtype=torch.float16, enabled=False))
    assert forward_autocast(off, CPU) is None
    loader = build(model=off, autocast=None)
    assert loader.autocast is None
    assert loader.selection_precision.endswith("autocast=None: float32")
    assert all(b.losses.dtype == torch.float32 for b in loader)


@pytest.mark.parametrize("vnni, amx", [(False, False), (True, False), (False, True)])
def test_native_int8_is_a_cpu_with_vnni_or_amx(monkeypatch, vnni, amx):
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: vnni, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert native_int8() is (vnni or amx)
