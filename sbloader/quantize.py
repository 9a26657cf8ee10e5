"""``quantize_selection=``: the selection forward through an int8 copy of the model, on the CPU.

The copy is made with PyTorch's FX graph-mode post-training quantization (Conv-BN-ReLU fused,
per-channel int8 weights, activations observed on real candidates) for the quantized engine that
is current when the loader is built (``torch.backends.quantized.engine``, ``"x86"`` on x86 Linux).
It is rebuilt from the model's current weights as training goes on (a *refresh*): at the first
selection pass of every epoch that has selection passes, then every ``refresh_examples``
candidates scored (or every ``refresh_every`` selection passes) within the epoch. Between
refreshes the selection losses come from slightly older weights.

``quantize_selection="auto"`` (opt-in: the loader's default is False, see its NOTE) turns the
copy on where it measured cheaper than every other selection precision and nothing stands in its
way: a CPU with native int8 dot products (VNNI or AMX), the selection precision left to the
loader (``autocast="auto"``), no option the copy cannot follow, and a model that ``torch.fx``
can trace. A model that then fails to quantize on the first source batch falls back to the
precision ``autocast="auto"`` chooses, with a warning; the choice and its reason are in
``loader.selection_precision`` and the log (:func:`resolve`).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from ._checks import check_int
from ._state import check_version
from .precision import native_int8
from .selection import eval_mode, has_lazy, model_device, selection_autocast

__all__ = [
    "AUTO",
    "Int8Unavailable",
    "QuantizedSelection",
    "QuantizedSelector",
    "qconfig_mapping",
    "quantized_selection",
    "resolve",
]

AUTO = "auto"
"""The ``quantize_selection`` value that lets the loader choose (see :func:`resolve`)."""

DEFAULT_REFRESH_EXAMPLES = 16384
"""Candidates scored between two refreshes unless told otherwise: 32 source batches of 512."""

_ENGINES = ("x86", "fbgemm", "onednn", "qnnpack")
_FIX = "or pass quantize_selection=False"


@dataclass(frozen=True)
class QuantizedSelection:
    """The settings of ``SelectiveLoader(quantize_selection=...)``; ``True`` means the defaults.

    Args:
        refresh_examples: candidates scored between two rebuilds of the int8 copy within an
            epoch (the copy is also rebuilt at the first selection pass of every epoch that has
            any). Default 16384 (when ``refresh_every`` is not given): on the benchmark CNN
            (one thread) a refresh costs about 0.24 s, about one source batch of 512 of SB's
            training, so refreshing every 16384 candidates (32 source batches of 512, about 43
            training steps of 128 at k = 1/3) adds about 0.01 to c, whatever the source's batch
            size (see ``benchmarks/results/quantized/``).
        refresh_every: selection passes (source batches) between two rebuilds instead: give
            one of the two.
        calibration_examples: the first this many candidates of the source batch being scored
            (of those whose inputs are all finite) when the copy is rebuilt calibrate its
            activation ranges (all of them if the batch is smaller). Default 128: the same
            ranking as 256 or 512 (Spearman 0.9996 against fp32 on the benchmark CNN) at a
            cheaper refresh.

    NOTE: counted in candidates by default, not in source batches: a refresh costs the same
    whatever the source batch's size, so a count of source batches made sources of 128
    refresh four times as often as sources of 512 for the same selection work (at 128, more
    time refreshing than int8 saved on the pass).

    Example:
        >>> QuantizedSelection()
        QuantizedSelection(refresh_examples=16384, refresh_every=None, calibration_examples=128)
        >>> QuantizedSelection(refresh_every=8).refresh_examples is None
        True
    """

    refresh_examples: int | None = None
    refresh_every: int | None = None
    calibration_examples: int = 128

    def __post_init__(self) -> None:
        if self.refresh_examples is not None and self.refresh_every is not None:
            raise ValueError(
                f"QuantizedSelection takes refresh_examples or refresh_every, not both, but got "
                f"refresh_examples={self.refresh_examples!r} and refresh_every="
                f"{self.refresh_every!r}; pass one of them"
            )
        if self.refresh_every is not None:
            check_int("refresh_every", self.refresh_every, minimum=1)
        else:
            refresh = DEFAULT_REFRESH_EXAMPLES
            if self.refresh_examples is not None:
                refresh = check_int("refresh_examples", self.refresh_examples, minimum=1)
            object.__setattr__(self, "refresh_examples", refresh)
        check_int("calibration_examples", self.calibration_examples, minimum=1)

    def due(self, passes: int, examples: int) -> bool:
        """Whether a copy that has scored ``passes`` source batches of ``examples`` candidates
        in all is due for a rebuild."""
        if self.refresh_every is not None:
            return passes >= self.refresh_every
        assert self.refresh_examples is not None
        return examples >= self.refresh_examples


def quantized_selection(value: Any) -> QuantizedSelection | None:
    """The settings of a ``quantize_selection=`` argument: None when off.

    Example:
        >>> quantized_selection(True)
        QuantizedSelection(refresh_examples=16384, refresh_every=None, calibration_examples=128)
        >>> quantized_selection(False) is None
        True
    """
    if isinstance(value, np.bool_):  # a numpy bool, as the bool it holds
        value = bool(value)
    if value is None or value is False:
        return None
    if value is True or value == AUTO:
        return QuantizedSelection()
    if isinstance(value, QuantizedSelection):
        return value
    raise TypeError(
        "quantize_selection should be 'auto', True, False or a sbloader.QuantizedSelection(...), "
        f"but got quantize_selection={value!r}"
    )


def resolve(
    value: Any,
    model: nn.Module,
    conflicts: Mapping[str, bool],
    device: torch.device,
    autocast_requested: Any,
) -> tuple[QuantizedSelector | None, str]:
    """The int8 selection copy a ``quantize_selection=`` argument asks for (None: off), and why.

    ``True`` or a :class:`QuantizedSelection` is checked (:func:`check_quantizable`) and refused
    with the fix when it cannot work. ``"auto"`` never refuses: it turns the copy on only where
    :func:`native_int8`, the selection precision is left to the loader (``autocast_requested``
    is ``"auto"``), and :func:`check_quantizable` finds nothing in the way (its model is traced
    at the first build, not here); otherwise it is off and the reason says what stood in the
    way.

    Args:
        value: the loader's ``quantize_selection`` argument.
        model: the (unwrapped) selection model.
        conflicts: option descriptions and whether each is set (see :func:`check_quantizable`).
        device: where the loader's batches live.
        autocast_requested: the loader's ``autocast`` argument.

    Example:
        >>> m = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
        >>> resolve(False, m, {}, torch.device("cpu"), "auto")
        (None, 'quantize_selection=False')
        >>> copy, why = resolve("auto", m, {}, torch.device("cpu"), torch.bfloat16)
        >>> copy is None, why
        (True, "quantize_selection='auto': off (autocast=torch.bfloat16 was given)")
    """
    config = quantized_selection(value)
    if config is None:
        return None, f"quantize_selection={value!r}"
    if value != AUTO:
        return QuantizedSelector(config, check_quantizable(model, conflicts, device)), (
            f"quantize_selection={value!r}: int8"
        )
    if autocast_requested != AUTO:
        return None, f"quantize_selection='auto': off (autocast={autocast_requested!r} was given)"
    if not native_int8():
        return None, "quantize_selection='auto': off (no native int8 on this CPU)"
    # NOTE: not traced here: tracing runs the model's forward (on proxies), and a user who
    # never asked for int8 should not see it called; the first build traces a copy instead,
    # and a model it cannot trace falls back (Scorer.fall_back).
    try:
        engine = check_quantizable(model, conflicts, device, trace=False)
    except ValueError as e:
        return None, f"quantize_selection='auto': off ({e})"
    return QuantizedSelector(config, engine, auto=True), (
        "quantize_selection='auto': int8 (native int8 on this CPU)"
    )


def check_quantizable(
    model: nn.Module, conflicts: Mapping[str, bool], device: torch.device, trace: bool = True
) -> str:
    """Refuse what an int8 selection copy cannot work with, when the loader is built; return the
    quantized engine to build with.

    Args:
        model: the (unwrapped) selection model.
        conflicts: option descriptions (``"autocast="``) and whether each is set.
        device: where the loader's batches live.
        trace: also trace ``model`` with ``torch.fx`` (which runs its ``forward`` on proxies).
    """
    for what, on in conflicts.items():
        if on:
            raise ValueError(
                f"quantize_selection cannot be combined with {what}; pass quantize_selection="
                "False, or drop the other option"
            )
    where = model_device(model)
    for name, dev in (("the selection model", where), ("device", device)):
        if dev.type != "cpu":
            raise ValueError(
                f"quantize_selection runs the selection forward with int8 kernels on the CPU, but "
                f"{name} is on {dev}; on a GPU pass autocast=torch.bfloat16 (and "
                "compile_selection=True) instead, " + _FIX
            )
    engine = torch.backends.quantized.engine
    if engine not in _ENGINES:
        raise ValueError(
            f"quantize_selection needs a quantized engine (one of {_ENGINES}), but "
            f"torch.backends.quantized.engine is {engine!r}; set it before building the loader, "
            + _FIX
        )
    hooked = _hooked(model)
    if hooked:
        raise ValueError(_hooks_refused(hooked))
    if not trace:
        return engine
    try:
        torch.fx.symbolic_trace(model)
    except Exception as e:
        raise ValueError(
            f"quantize_selection builds an int8 copy of the selection model by tracing it with "
            f"torch.fx, which failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); make "
            "the model's forward traceable (no control flow on tensor values), pass selector= a "
            "traceable model, " + _FIX
        ) from e
    return engine


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence what torch's int8 flow warns on every use, for the calls inside only.

    NOTE: torch.ao.quantization warns on every build (a DeprecationWarning naming torchao's pt2e
    flow, and a UserWarning per observer made), and every int8 forward warns that quantized
    tensor creation is deprecated. Its FX flow is what this module uses while torch ships it
    (without it, a build fails with :class:`Int8Unavailable`); a user who never asked for int8
    (``"auto"``) should not see torch's notices about it.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.ao\.")
        warnings.filterwarnings(
            "ignore", message=r"torch\.quantize_per_tensor", category=UserWarning
        )
        yield


_LINEAR_PACKED = "LinearPackedParamsBase"


def _plain_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy's state dict as tensors and JSON values, which ``torch.load(weights_only=True)``
    takes: the packed weights of a functional linear layer (a ``torch.ScriptObject``) as their
    int8 weight and float bias, a dtype by its name.

    NOTE: ``torch.load``'s default (``weights_only=True``) refuses ScriptObjects, and a loader's
    state must load with it; an int8 copy holding any other kind fails to build instead
    (:func:`_check_plain`)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, torch.ScriptObject):
            weight, bias = torch.ops.quantized.linear_unpack(value)
            value = {"packed": "linear", "weight": weight, "bias": bias}
        elif isinstance(value, torch.dtype):  # a quantized Linear's weight dtype
            value = {"dtype": str(value).removeprefix("torch.")}
        out[key] = value
    return out


def _packed_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_plain_values`."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value.get("packed") == "linear":
            value = torch.ops.quantized.linear_prepack(value["weight"], value["bias"])
        elif isinstance(value, dict) and set(value) == {"dtype"}:
            value = getattr(torch, value["dtype"])
        out[key] = value
    return out


def _check_plain(copy: nn.Module) -> None:
    """Refuse an int8 copy whose values :func:`_plain_values` cannot make checkpointable."""
    for key, value in copy.state_dict().items():
        if isinstance(value, torch.ScriptObject):
            kind = value._type().qualified_name()
            if not kind.endswith(_LINEAR_PACKED):
                raise TypeError(
                    f"its int8 copy holds {key!r} as a {kind}, which a checkpoint loaded with "
                    "torch.load(weights_only=True) cannot hold"
                )


_QPARAMS = ("scale", "zero_point")


def _attributes(copy: nn.Module) -> dict[str, Any]:
    """The values ``copy``'s modules hold as plain attributes, outside its state dict, by
    ``"module.attribute"`` name: tensors (a quantized PReLU's int8 weight) and output scales and
    zero points (a quantized ELU's, PReLU's).

    NOTE: a resumed copy is traced from the resumed model and calibrated on the resumed run's
    first source batch, then takes the saved copy's state dict; without these, such values would
    stay those of that model (weights newer than the saved copy's) and that calibration, and the
    resumed run would score otherwise than the uninterrupted one.
    """
    state = copy.state_dict()
    out: dict[str, Any] = {}
    for name, module in copy.named_modules():
        for attr, value in vars(module).items():
            key = f"{name}.{attr}" if name else attr
            if key in state:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if isinstance(value, torch.Tensor) or (attr in _QPARAMS and number):
                out[key] = value
    return out


def _set_attributes(copy: nn.Module, values: Mapping[str, Any]) -> None:
    """The inverse of :func:`_attributes`: set each saved value on ``copy``'s module."""
    for key, value in values.items():
        name, _, attr = key.rpartition(".")
        setattr(copy.get_submodule(name), attr, value)


def _with_versions(values: dict[str, Any], like: nn.Module) -> dict[str, Any]:
    """``values`` with the module versions of ``like``'s state dict (``_metadata``, which a plain
    dict lacks): quantized modules read their saved format from it."""
    out: Any = OrderedDict(values)
    out._metadata = getattr(like.state_dict(), "_metadata", None)
    return cast(dict[str, Any], out)


def qconfig_mapping(engine: str) -> Any:
    """PyTorch's default post-training qconfig mapping for ``engine``, with min-max activation
    observers in place of its histogram ones.

    NOTE: a refresh runs every ``refresh_every`` source batches, so its cost counts: the
    histogram observer made calibration on the benchmark CNN about twice as slow as min-max, for
    the same ranking of losses (Spearman 0.9996 against fp32 either way on the benchmark CNN;
    see benchmarks/results/quantized/). Weights keep the default's observer (per-channel for
    ``"x86"`` and ``"fbgemm"``, per-tensor min-max for ``"qnnpack"``).

    Example:
        >>> qconfig = qconfig_mapping("x86").global_qconfig
        >>> qconfig.activation.p.func.__name__, qconfig.activation.p.keywords
        ('MinMaxObserver', {'reduce_range': True})
        >>> qconfig.weight.p.func.__name__
        'PerChannelMinMaxObserver'
        >>> qconfig_mapping("qnnpack").global_qconfig.weight.p.func.__name__
        'MinMaxObserver'
    """
    from torch.ao.quantization import QConfig, get_default_qconfig_mapping
    from torch.ao.quantization.observer import MinMaxObserver

    mapping = get_default_qconfig_mapping(engine)
    default = mapping.global_qconfig
    assert default is not None  # every engine's default mapping has a global qconfig
    reduce_range = engine in ("x86", "fbgemm")  # as the default's activation observer
    fast = QConfig(
        activation=MinMaxObserver.with_args(reduce_range=reduce_range), weight=default.weight
    )
    mapping.set_global(fast)
    for kind, qconfig in list(mapping.object_type_qconfigs.items()):
        if qconfig is default:
            mapping.set_object_type(kind, fast)
    return mapping


def _int8_copy(model: nn.Module, calib: torch.Tensor, engine: str) -> nn.Module:
    """An FX graph-mode int8 copy of ``model`` for ``engine``, calibrated on ``calib``."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    # NOTE: the gradients are left out of the copy (deepcopy's memo maps each to None), and the
    # copy, not the model, is put in eval mode: the model's flags stay untouched.
    memo: dict[int, Any] = {id(p.grad): None for p in model.parameters() if p.grad is not None}
    try:
        work = copy.deepcopy(model, memo).eval()
    except Exception as e:
        raise Int8Unavailable(
            "quantize_selection builds its int8 copy from copy.deepcopy of the selection model, "
            f"which failed{_uncopyable(model)}: {type(e).__name__}: {_first_line(e)}; keep "
            "what cannot be copied (a SelectiveLoader during its epoch, a lock, an open file) "
            "off the model's attributes, pass selector= a model that can be copied, " + _FIX
        ) from e
    work.requires_grad_(False)
    prepared = prepare_fx(work, qconfig_mapping(engine), (calib[:1],))
    # NOTE: calibrated and checked in float32 also inside a caller's torch.autocast region
    # (selection_autocast): ranges observed in bf16 would change the copy's scales, and with
    # them the selections, with where the loader was iterated.
    with torch.inference_mode(), selection_autocast(calib.device.type, None):
        prepared(calib)
    # NOTE: converted outside inference mode: its parameters must take a saved copy's values
    # (load_state_dict) on a resume. convert_fx makes float reference modules whose constructors
    # initialise weights from torch's global RNG (then overwritten): forked, so that the caller's
    # stream of random numbers is the same with or without quantize_selection.
    with torch.random.fork_rng(devices=[]):
        quantized = convert_fx(prepared)
    _forget_modules()
    # NOTE: this check forward (under the caller's quiet()) also spends torch's once-per-process
    # warning about quantized tensors; every int8 forward in a process follows a build, so the
    # selection passes need no warning filters of their own (catch_warnings swaps the
    # interpreter's global filter list and is not thread-safe).
    with torch.inference_mode(), selection_autocast(calib.device.type, None):
        quantized(calib[:2])  # an op without int8 kernels fails here, not mid-epoch
    _check_plain(quantized)
    quantized.register_forward_hook(_nonfinite_rows)
    return quantized


def _calibration_rows(inputs: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows of ``inputs`` whose values are all finite, to calibrate a copy on
    (the first ``n`` rows with non-finite values as 0 where no row is finite).

    NOTE: a min-max observer takes the range of every value it sees: one NaN or infinite
    candidate among the calibration rows made the copy's scales non-finite, and the copy then
    scored every candidate NaN until its next refresh (all of them skipped under the default
    ``nonfinite="skip"``), where float selection passes skip that one candidate only.

    Example:
        >>> x = torch.tensor([[float("nan"), 1.0], [2.0, 3.0], [4.0, float("inf")], [5.0, 6.0]])
        >>> _calibration_rows(x, 2)
        tensor([[2., 3.],
                [5., 6.]])
    """
    head = inputs[:n]
    if not head.is_floating_point() or head.dim() == 0:
        return head
    if bool(torch.isfinite(head).all()):
        return head
    finite = torch.isfinite(inputs.reshape(inputs.shape[0], -1)).all(1)
    if bool(finite.any()):
        return inputs[finite][:n]
    return head.nan_to_num(0.0, 0.0, 0.0)


def _nonfinite_rows(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """The forward hook of an int8 copy: NaN outputs for the rows whose inputs hold a NaN or an
    infinite value, as the float model gives them (in every floating-point tensor of one row per
    candidate, also inside a dict, tuple or list of outputs).

    NOTE: quantizing maps NaN and infinite values to finite int8 ones, so without it such a
    candidate got a finite loss from the copy: ``nonfinite=`` never saw it, and it could be
    selected and trained on (its NaN input then reached the training step), where float
    selection passes find its loss non-finite.

    NOTE: a model returning ``{"logits": ...}`` or a tuple (picked by ``output=``) kept that
    finite loss until the outputs inside them were masked too.

    Example:
        >>> x = torch.tensor([[1.0, 2.0], [float("nan"), 0.0]])
        >>> out = _nonfinite_rows(nn.Identity(), (x,), {"logits": torch.ones(2, 3), "n": 2})
        >>> out["logits"][:, 0].tolist(), out["n"]
        ([1.0, nan], 2)
    """
    inputs = args[0] if args else None
    if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point() or inputs.dim() == 0:
        return output
    bad = ~torch.isfinite(inputs.reshape(inputs.shape[0], -1)).all(1)
    if not bool(bad.any()):
        return output
    return _masked(output, bad)


def _masked(output: Any, bad: torch.Tensor) -> Any:
    """``output`` with NaN in the rows ``bad`` marks of each floating-point tensor of one row
    per candidate, through dicts, tuples (namedtuples too) and lists; anything else as it is."""
    if isinstance(output, torch.Tensor):
        if not output.is_floating_point() or output.dim() == 0 or output.shape[0] != len(bad):
            return output
        return output.masked_fill(bad.view(-1, *([1] * (output.dim() - 1))), float("nan"))
    if isinstance(output, Mapping):
        values = {k: _masked(v, bad) for k, v in output.items()}
        if type(output) is dict:
            return values
        try:  # (a Mapping built from a dict, as OrderedDict and Hugging Face's outputs are)
            return cast(Any, type(output))(values)
        except (TypeError, ValueError):
            return values
    if isinstance(output, (tuple, list)):
        items = [_masked(v, bad) for v in output]
        if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
            return type(output)(*items)
        return type(output)(items)
    return output


def _first_line(error: Exception) -> str:
    """The first line of ``error``'s message, at most 300 characters."""
    return str(error).splitlines()[0][:300] if str(error) else ""


def _hooked(model: nn.Module) -> str:
    """``module NAME's forward pre-hook`` (or ``forward hook``) for the first module of
    ``model`` (itself included) with a forward hook or pre-hook registered, or ``""``.

    NOTE: the int8 copy runs without them: ``torch.fx`` traces the model's ``forward`` (not
    its ``__call__``, which runs its hooks) and the layers it converts are new modules. A model
    normalising its inputs in a pre-hook, or scaling its outputs in a hook, was scored by the
    copy as if they were not there, with nothing said (all its losses 0 where the hook
    normalised inputs ten times too large), where a float selection pass runs them.

    NOTE: not the pre-hook by which a lazy module (``nn.LazyLinear``) makes its parameters on
    its first forward, which the copy's build runs first (see :meth:`QuantizedSelector._build`).
    """
    for name, module in model.named_modules():
        where = f"module {name!r}'s" if name else "the selection model's"
        lazy = getattr(module, "_initialize_hook", None)
        own = lazy.id if isinstance(module, LazyModuleMixin) and lazy is not None else None
        if any(key != own for key in module._forward_pre_hooks):
            return f"{where} forward pre-hook"
        if module._forward_hooks:
            return f"{where} forward hook"
    return ""


def _hooks_refused(hooked: str) -> str:
    """The message refusing a model with forward hooks (``hooked``: :func:`_hooked`)."""
    return (
        f"quantize_selection scores with an int8 copy of the selection model, which runs "
        f"without its forward hooks, but found {hooked} (a float selection pass runs it); "
        "remove the hooks (e.g. move what they do into forward), pass selector= a model "
        "without hooks, " + _FIX
    )


def _uncopyable(model: nn.Module) -> str:
    """`` on its attribute NAME (a TYPE)`` for the first attribute of ``model``'s modules (other
    than modules, parameters and buffers) that ``copy.deepcopy`` refuses, or ``""``: for the
    message of a copy that failed (a model that keeps its loader, for instance)."""
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_") or isinstance(value, (nn.Module, torch.Tensor)):
                continue
            try:
                copy.deepcopy(value)
            except Exception:
                key = f"{name}.{attr}" if name else attr
                return f" on its attribute {key!r} (a {type(value).__name__})"
    return ""


def _forget_modules() -> None:
    """Drop the modules torch's FX conversion memoised.

    NOTE: ``convert_fx`` calls ``torch.ao.quantization.fx.utils.assert_and_get_unique_device``,
    an unbounded ``functools.cache`` keyed on the module itself, so every build would keep its
    float and intermediate modules (a full copy of the weights) alive for the life of the
    process: measured, a leak on every refresh. The cache only saves recomputing a module's
    device, so clearing it changes no result."""
    try:
        from torch.ao.quantization.fx import utils
    except ImportError:  # pragma: no cover - a torch without the FX flow fails to build anyway
        return
    clear = getattr(getattr(utils, "assert_and_get_unique_device", None), "cache_clear", None)
    if clear is not None:
        clear()


class Int8Unavailable(RuntimeError):
    """The int8 copy of the selection model could not be built (its message names the fix).

    Example:
        A forward with data-dependent control flow cannot be traced for an int8 copy:

        >>> class Branchy(nn.Module):
        ...     def forward(self, x):
        ...         return x if x.sum() > 0 else -x
        >>> selector = QuantizedSelector(QuantizedSelection(), torch.backends.quantized.engine)
        >>> try:
        ...     selector.model_for(Branchy(), torch.randn(4, 3), epoch=0)
        ... except Int8Unavailable as e:
        ...     print(isinstance(e, RuntimeError), str(e).split(": ", 1)[1])
        True TraceError: symbolically traced variables cannot be used as inputs to control flow;
        pass selector= a model whose layers have int8 kernels (convolutions, Linear, ReLU,
        pooling), or pass quantize_selection=False
    """


class QuantizedSelector:
    """The int8 copy of the selection model, rebuilt when due; counted and timed.

    Args:
        config: when to rebuild and how to calibrate.
        engine: the quantized engine the copies are built for.
        auto: chosen by ``quantize_selection="auto"``: a model that fails to quantize is then
            left to the loader to fall back from, not a mistake of the caller's.

    Attributes:
        refreshes: how many times the copy was built from the model's weights (not counting
            copies restored from a saved state).
        refresh_s: seconds spent building copies (also part of the epochs'
            ``selection_forward_s``).
        model: the current copy, or None before the first selection pass (and after a resume,
            until the next one).

    Example:
        >>> selector = QuantizedSelector(QuantizedSelection(refresh_every=2), "x86")
        >>> model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
        >>> x = torch.randn(8, 1, 6, 6)
        >>> copies = [selector.model_for(model, x, epoch=0) for _ in range(3)]
        >>> selector.refreshes, copies[0] is copies[1], copies[1] is copies[2]
        (2, True, False)
    """

    VERSION = 1

    def __init__(self, config: QuantizedSelection, engine: str, auto: bool = False) -> None:
        self.config = config
        self.engine = engine
        self.auto = auto
        self.refreshes = 0
        self.refresh_s = 0.0
        self.model: nn.Module | None = None
        self._epoch: int | None = None  # the epoch of the copy's last refresh
        self._since = 0  # selection passes with the current copy
        self._since_examples = 0  # candidates scored with the current copy
        self._restored: dict[str, Any] | None = None  # a saved copy's state, not yet loaded
        self._restored_attributes: dict[str, Any] = {}  # its values outside its state dict

    def model_for(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        epoch: int,
        prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> nn.Module:
        """The int8 copy for a selection pass over ``inputs`` in ``epoch``, rebuilt from
        ``model``'s current weights first when due (calibrated on ``prepare(inputs)``'s first
        ``calibration_examples`` rows: ``prepare`` is what the selection forward does to the
        inputs, e.g. downsampling). Counts the pass."""
        self._check_engine()
        current = self.model
        due = current is None and self._restored is None
        stale = self.config.due(self._since, self._since_examples)
        if due or epoch != self._epoch or stale:
            t0 = perf_counter()
            current = self._build(model, inputs, prepare)
            self.refresh_s += perf_counter() - t0
            self.refreshes += 1
            self._epoch, self._since, self._since_examples, self._restored = epoch, 0, 0, None
        elif self._restored is not None:
            # NOTE: a resumed run: the saved copy's structure comes from tracing the current
            # model; every value in it (weights, scales, zero points) is then the saved one's.
            current = self._build(model, inputs, prepare)
            current.load_state_dict(_with_versions(_packed_values(self._restored), current))
            _set_attributes(current, self._restored_attributes)
            self._restored, self._restored_attributes = None, {}
        assert current is not None
        self.model = current
        self._since += 1
        self._since_examples += int(inputs.shape[0])
        return current

    @property
    def used(self) -> bool:
        """Whether a copy was built to score with, or restored from a saved state."""
        return self.model is not None or self.refreshes > 0 or self._restored is not None

    def trial(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Build a copy on ``inputs`` and discard it, changing nothing: on the first source batch
        of a run that starts without selection passes (a warm-up), so that a model that cannot
        be quantized fails at once."""
        self._check_engine()
        self._build(model, inputs, prepare)

    def _build(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        prepare: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> nn.Module:
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(
                "quantize_selection calls the model on the input field as one tensor, but it is "
                f"a {type(inputs).__name__}; pass input_key= a tensor field, " + _FIX
            )
        hooked = _hooked(model)
        if hooked:  # (registered since the loader was built)
            raise Int8Unavailable(_hooks_refused(hooked))
        calib = _calibration_rows(inputs, self.config.calibration_examples)
        if prepare is not None:
            with torch.inference_mode():
                calib = prepare(calib)
        if has_lazy(model):
            # NOTE: lazy parameters (nn.LazyLinear) are made by the model's first forward, which
            # the int8 copy's build came before: it failed on them ("uninitialized parameter"),
            # refused for a model a float selection pass takes (and "auto" fell back for the
            # whole run). Made here as that pass makes them: by a float forward under no_grad
            # (never inference mode, so that they train), in eval mode.
            with eval_mode(model), torch.no_grad(), selection_autocast(calib.device.type, None):
                model(calib[:1].clone())
        with quiet():
            try:
                return _int8_copy(model, calib, self.engine)
            except Int8Unavailable:
                raise
            except Exception as e:
                first = _first_line(e)
                raise Int8Unavailable(
                    "quantize_selection could not make an int8 copy of the selection model with "
                    f"torch.ao.quantization (FX graph mode, engine {self.engine!r}): "
                    f"{type(e).__name__}: {first}; pass selector= a model whose layers have int8 "
                    "kernels (convolutions, Linear, ReLU, pooling), " + _FIX
                ) from e

    def _check_engine(self) -> None:
        now = torch.backends.quantized.engine
        if now != self.engine:
            raise RuntimeError(
                f"torch.backends.quantized.engine was {self.engine!r} when the loader was built "
                f"(quantize_selection builds its int8 copies for it), but is {now!r} now; set it "
                f"back to {self.engine!r}, or build the loader after changing it"
            )

    def state_dict(self) -> dict[str, Any]:
        """The refresh clock and the current copy's values (int8 weights, scales, zero points,
        those held outside its state dict included: :func:`_attributes`), so that a resumed run
        scores with the same copy as an uninterrupted one."""
        model = self.model
        values = None if model is None else _plain_values(model.state_dict())
        attributes = None if model is None else _attributes(model)
        if values is None and self._restored is not None:
            values, attributes = self._restored, self._restored_attributes
        return {
            "version": self.VERSION,
            "epoch": self._epoch,
            "since": self._since,
            "since_examples": self._since_examples,
            "refreshes": self.refreshes,
            "model": values,
            # NOTE: an optional key of version 1 (absent from states saved before it): the
            # copy's values held outside its state dict (see _attributes).
            "attributes": attributes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = check_version(state, "QuantizedSelector", self.VERSION)
        self._epoch = None if state["epoch"] is None else int(state["epoch"])
        self._since = int(state["since"])
        # NOTE: an optional key of version 1 (absent from states saved before refreshes were
        # counted in candidates): such a copy is treated as fresh.
        self._since_examples = int(state.get("since_examples", 0))
        self.refreshes = int(state["refreshes"])
        self.model = None
        self._restored = None if state["model"] is None else dict(state["model"])
        self._restored_attributes = dict(state.get("attributes") or {})
