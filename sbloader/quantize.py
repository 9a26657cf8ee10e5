"""``quantize_selection=``: the selection forward through an int8 copy of the model, on the CPU.

The copy is made with PyTorch's FX graph-mode post-training quantization (Conv-BN-ReLU fused,
per-channel int8 weights, activations observed on real candidates) for the quantized engine that
is current when the loader is built (``torch.backends.quantized.engine``, ``"x86"`` on x86 Linux).
It is rebuilt from the model's current weights as training goes on (a *refresh*): at the first
selection pass of every epoch that has selection passes, then every ``refresh_every`` selection
passes (source batches) within the epoch. Between refreshes the selection losses come from
weights up to ``refresh_every`` source batches old.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any, cast

import torch
from torch import nn

from ._checks import check_int
from ._state import check_version
from .selection import model_device

__all__ = ["QuantizedSelection", "QuantizedSelector", "qconfig_mapping", "quantized_selection"]

_ENGINES = ("x86", "fbgemm", "onednn", "qnnpack")
_FIX = "or pass quantize_selection=False"


@dataclass(frozen=True)
class QuantizedSelection:
    """The settings of ``SelectiveLoader(quantize_selection=...)``; ``True`` means the defaults.

    Args:
        refresh_every: selection passes (source batches) between two rebuilds of the int8 copy
            within an epoch; the copy is also rebuilt at the first selection pass of every epoch
            that has any. Selection losses then come from weights up to this many source batches
            old. Default 32: on the benchmark CNN (one thread) a refresh costs about 0.24 s,
            about one source batch of 512 of SB's training, so refreshing every 32 adds about
            0.01 to c; 32 source batches of 512 are about 43 training steps of 128 at k = 1/3
            (see ``benchmarks/results/quantized/``).
        calibration_examples: the first this many candidates of the source batch being scored
            when the copy is rebuilt calibrate its activation ranges (all of them if the batch
            is smaller). Default 128: the same ranking as 256 or 512 (Spearman 0.9996 against
            fp32 on the benchmark CNN) at a cheaper refresh.

    Example:
        >>> QuantizedSelection(refresh_every=8)
        QuantizedSelection(refresh_every=8, calibration_examples=128)
    """

    refresh_every: int = 32
    calibration_examples: int = 128

    def __post_init__(self) -> None:
        check_int("refresh_every", self.refresh_every, minimum=1)
        check_int("calibration_examples", self.calibration_examples, minimum=1)


def quantized_selection(value: Any) -> QuantizedSelection | None:
    """The settings of a ``quantize_selection=`` argument: None when off.

    Example:
        >>> quantized_selection(True)
        QuantizedSelection(refresh_every=32, calibration_examples=128)
        >>> quantized_selection(False) is None
        True
    """
    if value is None or value is False:
        return None
    if value is True:
        return QuantizedSelection()
    if isinstance(value, QuantizedSelection):
        return value
    raise TypeError(
        "quantize_selection should be True, False or a sbloader.QuantizedSelection(...), but got "
        f"quantize_selection={value!r}"
    )


def check_quantizable(model: nn.Module, conflicts: Mapping[str, bool], device: torch.device) -> str:
    """Refuse what an int8 selection copy cannot work with, when the loader is built; return the
    quantized engine to build with.

    Args:
        model: the (unwrapped) selection model.
        conflicts: option descriptions (``"autocast="``) and whether each is set.
        device: where the loader's batches live.
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
    see benchmarks/results/quantized/). Weights keep the default's per-channel observer.
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
    work = copy.deepcopy(model, memo).eval()
    work.requires_grad_(False)
    prepared = prepare_fx(work, qconfig_mapping(engine), (calib[:1],))
    with torch.inference_mode():
        prepared(calib)
    # NOTE: converted outside inference mode: its parameters must take a saved copy's values
    # (load_state_dict) on a resume. convert_fx makes float reference modules whose constructors
    # initialise weights from torch's global RNG (then overwritten): forked, so that the caller's
    # stream of random numbers is the same with or without quantize_selection.
    with torch.random.fork_rng(devices=[]):
        quantized = convert_fx(prepared)
    with torch.inference_mode():
        quantized(calib[:2])  # an op without int8 kernels fails here, not mid-epoch
    return quantized


class QuantizedSelector:
    """The int8 copy of the selection model, rebuilt when due; counted and timed.

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

    def __init__(self, config: QuantizedSelection, engine: str) -> None:
        self.config = config
        self.engine = engine
        self.refreshes = 0
        self.refresh_s = 0.0
        self.model: nn.Module | None = None
        self._epoch: int | None = None  # the epoch of the copy's last refresh
        self._since = 0  # selection passes with the current copy
        self._restored: dict[str, Any] | None = None  # a saved copy's state, not yet loaded

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
        if due or epoch != self._epoch or self._since >= self.config.refresh_every:
            t0 = perf_counter()
            current = self._build(model, inputs, prepare)
            self.refresh_s += perf_counter() - t0
            self.refreshes += 1
            self._epoch, self._since, self._restored = epoch, 0, None
        elif self._restored is not None:
            # NOTE: a resumed run: the saved copy's structure comes from tracing the current
            # model; every value in it (weights, scales, zero points) is then the saved one's.
            current = self._build(model, inputs, prepare)
            current.load_state_dict(_with_versions(self._restored, current))
            self._restored = None
        assert current is not None
        self.model = current
        self._since += 1
        return current

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
        calib = inputs[: self.config.calibration_examples]
        if prepare is not None:
            with torch.inference_mode():
                calib = prepare(calib)
        # NOTE: torch.ao.quantization warns on every use (a DeprecationWarning naming torchao's
        # pt2e flow, and a UserWarning per observer made); silenced here, for these calls only.
        # Its FX flow is what this module uses while torch ships it; without it, the build fails
        # with the RuntimeError below.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.ao\.")
            try:
                return _int8_copy(model, calib, self.engine)
            except Exception as e:
                first = str(e).splitlines()[0][:300] if str(e) else ""
                raise RuntimeError(
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
        """The refresh clock and the current copy's values (int8 weights, scales, zero points),
        so that a resumed run scores with the same copy as an uninterrupted one."""
        model = self.model
        values = None if model is None else dict(model.state_dict())
        if values is None and self._restored is not None:
            values = self._restored
        return {
            "version": self.VERSION,
            "epoch": self._epoch,
            "since": self._since,
            "refreshes": self.refreshes,
            "model": values,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = check_version(state, "QuantizedSelector", self.VERSION)
        self._epoch = None if state["epoch"] is None else int(state["epoch"])
        self._since = int(state["since"])
        self.refreshes = int(state["refreshes"])
        self.model = None
        self._restored = None if state["model"] is None else dict(state["model"])
