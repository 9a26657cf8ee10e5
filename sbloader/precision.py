"""The precision of selection passes: what ``SelectiveLoader(autocast="auto")`` chooses.

A selection pass only ranks losses, and bf16 ranks them as fp32 does (Spearman 1.0000 on the
benchmark CNN, ``benchmarks/results/quantized``) at a fraction of the cost where the hardware
computes bf16 natively: c = 0.26 against fp32's 0.67 of a training step on this project's CPU
(AVX512-BF16). Where bf16 is only emulated it can be slower than fp32, so the choice follows the
device's native support, not a timing (a timing would make selections depend on the machine's
load). Training itself is never changed: where a selection pass computes what training consumes
(a frozen prefix's features), ``"auto"`` keeps float32.

Example:
    >>> import torch
    >>> from sbloader.precision import selection_dtype
    >>> selection_dtype(None, torch.device("cpu"))
    (None, 'autocast=None: float32')
    >>> selection_dtype(torch.bfloat16, torch.device("cpu"))[0]
    torch.bfloat16
    >>> selection_dtype("auto", torch.device("meta"))
    (None, "autocast='auto': float32 (no native bf16 on meta)")
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "AUTO",
    "PRECISIONS",
    "check_autocast",
    "forward_autocast",
    "forward_autocast_refused",
    "native_bf16",
    "native_int8",
    "selection_dtype",
]

AUTO = "auto"
"""The ``autocast`` value that lets the loader choose the selection precision."""

PRECISIONS: dict[str, torch.dtype | str | None] = {
    "auto": AUTO,
    "bf16": torch.bfloat16,
    "fp32": None,
}
"""The loader's ``autocast`` argument for each precision name a command line may offer
(``"auto"``, ``"bf16"``, ``"fp32"``)."""


#: The dtypes ``torch.autocast`` runs; with another it warns, disables itself and runs float32.
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def check_autocast(autocast: Any) -> torch.dtype | str | None:
    """Return ``autocast`` if it is a dtype autocast runs, ``"auto"`` or None; else raise
    naming it.

    Example:
        >>> check_autocast(torch.bfloat16), check_autocast(None)
        (torch.bfloat16, None)
        >>> check_autocast(torch.float32)
        Traceback (most recent call last):
        ...
        ValueError: autocast should be torch.bfloat16 or torch.float16 (what torch.autocast ...
    """
    if isinstance(autocast, torch.dtype):
        if autocast in _AUTOCAST_DTYPES:
            return autocast
        raise ValueError(
            "autocast should be torch.bfloat16 or torch.float16 (what torch.autocast runs: with "
            f"another dtype it runs float32), 'auto' or None, but got autocast={autocast}; pass "
            "autocast=None for float32 selection passes"
        )
    if autocast is None or autocast == AUTO:
        return autocast
    raise TypeError(
        "autocast should be a torch.dtype such as torch.bfloat16, 'auto' (bf16 where the device "
        f"computes it natively) or None (float32), but got autocast={autocast!r}"
    )


def forward_autocast(model: torch.nn.Module, device: torch.device) -> torch.dtype | None:
    """The dtype of the ``torch.autocast`` that ``model``'s own forward enters on ``device``'s
    type, or None: where the forward was replaced on the instance by one decorated with
    ``torch.autocast``, as ``accelerator.prepare(model)`` does under Accelerate's
    ``mixed_precision="bf16"`` (or ``"fp16"``). A selection pass calls the model, so it then runs
    in that dtype whatever the loader's ``autocast`` asks (an inner autocast overrides an outer
    one).

    NOTE: found by following the instance forward's ``__wrapped__`` chain (``functools.wraps``,
    which torch's autocast decorator and Accelerate's output conversion both set) to the
    ``torch.autocast`` held in a closure; a disabled autocast, one for another device type and a
    float64 model (which autocast leaves as it is) count as none.

    Example:
        >>> from types import MethodType
        >>> model = torch.nn.Linear(2, 2)
        >>> forward_autocast(model, torch.device("cpu")) is None
        True
        >>> model.forward = MethodType(
        ...     torch.autocast("cpu", dtype=torch.bfloat16)(torch.nn.Linear.forward), model)
        >>> forward_autocast(model, torch.device("cpu"))
        torch.bfloat16
    """
    forward = vars(model).get("forward")
    if forward is None or any(p.dtype == torch.float64 for p in model.parameters()):
        return None
    fn = getattr(forward, "__func__", forward)
    for _ in range(64):  # (a chain of decorators: never a cycle in practice, bounded anyway)
        if fn is None:
            break
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if (
                isinstance(value, torch.autocast)
                and value.device == device.type
                and getattr(value, "_enabled", True)
            ):
                return value.fast_dtype
        fn = getattr(fn, "__wrapped__", None)
    return None


def forward_autocast_refused(requested: Any, dtype: torch.dtype, device: torch.device) -> str:
    """The refusal of an explicit ``autocast`` that a model's own forward autocast (see
    :func:`forward_autocast`) overrides.

    Example:
        A model prepared with bf16 mixed precision, and ``autocast=torch.float32`` asked:

        >>> message = forward_autocast_refused(torch.float32, torch.bfloat16, torch.device("cuda"))
        >>> print(message.split(" (")[0])
        autocast should be 'auto' or torch.bfloat16 for this model, whose forward runs under its
        own torch.autocast('cuda', dtype=torch.bfloat16)
        >>> print(message.split("; ")[1])
        pass autocast='auto' (selection passes in bfloat16, as the training forward), or prepare
        the model without mixed precision
    """
    name = str(dtype).removeprefix("torch.")
    return (
        f"autocast should be 'auto' or {dtype} for this model, whose forward runs under its own "
        f"torch.autocast({device.type!r}, dtype={dtype}) (as accelerator.prepare(model) makes it "
        f"with mixed_precision), so that selection passes run in {name} whatever the loader "
        f"asks, but got autocast={requested!r}; pass autocast='auto' (selection passes in "
        f"{name}, as the training forward), or prepare the model without mixed precision"
    )


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively: a CUDA device of compute capability 8.0 or more
    (Ampere and later; ROCm's, which all support it), or a CPU with AVX512-BF16 or AMX (x86).
    Other devices and CPUs (ARM included), and older GPUs (V100, T4), which only emulate bf16,
    answer False.

    Example:
        The answer depends on the machine; ``autocast="auto"`` picks bf16 where it is True:

        >>> cpu = torch.device("cpu")
        >>> isinstance(native_bf16(cpu), bool), native_bf16(torch.device("meta"))
        (True, False)
        >>> selection_dtype("auto", cpu)[0] == (torch.bfloat16 if native_bf16(cpu) else None)
        True
    """
    if device.type == "cuda":
        return _cuda_bf16(device)
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return _cpu_has("_is_avx512_bf16_supported", "_is_amx_tile_supported")


def _cuda_bf16(device: torch.device) -> bool:
    """Whether the CUDA device ``device`` (the current one without an index) computes bf16
    natively.

    NOTE: not ``torch.cuda.is_bf16_supported()`` as called by default: with its default
    ``including_emulation=True`` it answers True on GPUs before Ampere too (a V100, a T4), where
    bf16 is only emulated, so ``"auto"`` chose bf16 there and logged it as native. And it asks
    about the current device, not the model's.
    """
    if not torch.cuda.is_available():
        return False
    if torch.version.hip:  # (every ROCm GPU torch runs on computes bf16, as torch says)
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 8


def native_int8() -> bool:
    """Whether this CPU computes int8 dot products natively (x86 VNNI or AMX), where the int8
    selection copy (``quantize_selection``) measured cheaper than bf16 and fp32 (README, A
    cheaper selection pass). Without them (an AVX2-only CPU, ARM) it saved far less, so
    ``quantize_selection="auto"`` leaves it off.

    Example:
        The answer depends on the machine's CPU:

        >>> isinstance(native_int8(), bool)
        True
    """
    return _cpu_has("_is_vnni_supported", "_is_amx_tile_supported")


def _cpu_has(*queries: str) -> bool:
    """Whether any of these capability queries of ``torch.cpu`` answers True.

    NOTE: torch exposes its CPU capability queries only as private functions of torch.cpu; a
    torch without them answers False (the plainer precision), never an error.
    """
    for name in queries:
        query = getattr(torch.cpu, name, None)
        if query is not None and query():
            return True
    return False


def selection_dtype(
    autocast: Any,
    device: torch.device,
    feeds_training: str | None = None,
    model_dtype: torch.dtype | None = None,
) -> tuple[torch.dtype | None, str]:
    """The autocast dtype of selection passes on ``device`` (None: float32), and why.

    Args:
        autocast: a dtype (used as given), None (float32) or ``"auto"``: bf16 where
            :func:`native_bf16` and the pass's outputs do not feed training, else float32.
        device: where selection passes run (the selecting model's device).
        feeds_training: what of the pass's outputs training consumes, named for the reason
            given (``"the frozen prefix's features"``, ``"the kept logits"``), or None:
            ``"auto"`` then keeps float32, so that training is never changed.
        model_dtype: the selecting model's floating-point dtype, if known: a float64 model
            gets no autocast from ``"auto"`` (autocast never casts float64 tensors, so it would
            change nothing but the reported precision), and a bfloat16 or float16 model that
            gets no autocast is reported as selecting in its own dtype, not float32.

    Example:
        >>> selection_dtype("auto", torch.device("cpu"), model_dtype=torch.float64)
        (None, "autocast='auto': none (the model is float64, which autocast leaves as it is)")
        >>> selection_dtype(None, torch.device("cpu"), model_dtype=torch.bfloat16)
        (None, "autocast=None: bfloat16 (the model's own dtype; no autocast)")
    """
    # NOTE: a bf16 (or fp16) model with no autocast selects in its own dtype (its inputs
    # converted, e.g. by convert_inputs=): "float32" was reported for it.
    own = model_dtype if model_dtype in (torch.bfloat16, torch.float16) else None
    chosen, why = _selection_dtype(autocast, device, feeds_training, model_dtype)
    if chosen is None and own is not None:
        name = str(own).removeprefix("torch.")
        return None, f"{why.split(':')[0]}: {name} (the model's own dtype; no autocast)"
    return chosen, why


def _selection_dtype(
    autocast: Any,
    device: torch.device,
    feeds_training: str | None,
    model_dtype: torch.dtype | None,
) -> tuple[torch.dtype | None, str]:
    """:func:`selection_dtype` as the model's dtype aside: float32 where no autocast is used."""
    autocast = check_autocast(autocast)
    if autocast is None:
        return None, "autocast=None: float32"
    if isinstance(autocast, torch.dtype):
        return autocast, f"autocast={autocast}"
    if model_dtype == torch.float64:
        return None, "autocast='auto': none (the model is float64, which autocast leaves as it is)"
    if feeds_training is not None:
        # NOTE: said where bf16 is native, since float32 then costs more than the bf16 pass the
        # same loader would run without these outputs: a frozen prefix without cache_features
        # made an SB epoch slower than without the prefix on the AVX512-BF16 CPU (12.4 s
        # against 8.7 s; README, "A cheaper selection pass").
        hint = (
            "; bf16 is native here: autocast=torch.bfloat16 selects in it at less cost, "
            "the outputs training consumes then carrying bf16's precision"
            if native_bf16(device)
            else ""
        )
        return None, f"autocast='auto': float32 ({feeds_training} feed training{hint})"
    if native_bf16(device):
        return torch.bfloat16, f"autocast='auto': bfloat16 (native on {device.type})"
    return None, f"autocast='auto': float32 (no native bf16 on {device.type})"
