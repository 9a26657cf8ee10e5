"""The selection pass: one forward of the candidates to get one loss per example."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_float

__all__ = [
    "SelectionForward",
    "check_loss_fn",
    "downsample",
    "eval_mode",
    "prefix_features",
    "selection_outputs",
    "unwrap",
]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / DataParallel / torch.compile wrappers.

    NOTE: selection passes must call the unwrapped module: a forward through the DDP wrapper on
    one rank but not another makes DDP's collectives mismatch across ranks.
    """
    while True:
        inner = getattr(model, "module", None)
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) and inner:
            model = inner
            continue
        orig = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(orig, nn.Module):
            model = orig
            continue
        return model


@contextlib.contextmanager
def eval_mode(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Put ``model`` in eval mode and restore every submodule's own ``training`` flag afterwards.

    Restores each submodule individually (not ``model.train(was_training)``), so a deliberately
    frozen BatchNorm inside a training model stays frozen; restores even when the body raises,
    including KeyboardInterrupt.
    """
    if not enabled:
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def check_loss_fn(loss_fn: Callable[..., torch.Tensor]) -> None:
    """Reject loss modules that reduce over the batch before any data flows."""
    reduction = getattr(loss_fn, "reduction", "none")
    if reduction != "none":
        raise ValueError(
            "loss_fn should return one loss per example, but got a loss with "
            f"reduction={reduction!r}; pass reduction='none', e.g. "
            "nn.CrossEntropyLoss(reduction='none')"
        )


def selection_outputs(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    batch_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    eval: bool = True,
    keep_outputs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-example losses of ``model`` on the candidates, without autograd, and the model's
    outputs (logits) when ``keep_outputs`` (else ``None``).

    Runs under ``torch.inference_mode()`` in chunks of ``batch_size`` examples (all at once when
    None), in eval mode unless ``eval=False``, optionally under autocast.

    NOTE (eval-mode selection): a train-mode forward updates BatchNorm running statistics even
    without gradients and applies dropout noise to the losses; eval mode does neither, and a
    selection chunk of one example cannot crash BatchNorm.

    Returns:
        float32 losses on the model's output device, as an ordinary tensor (not an inference
        tensor), so that they can be used in autograd expressions such as ``loss * weights``;
        and the outputs as float32 (one row per candidate), or ``None``.

    Example:
        >>> losses, logits = selection_outputs(
        ...     nn.Linear(3, 2), torch.zeros(4, 3), torch.zeros(4, dtype=torch.long),
        ...     nn.CrossEntropyLoss(reduction="none"), keep_outputs=True)
        >>> losses.shape, logits.shape
        (torch.Size([4]), torch.Size([4, 2]))
    """
    n = inputs.shape[0]
    step = n if not batch_size else batch_size
    chunks = []
    outputs = []
    device_type = inputs.device.type if isinstance(inputs, torch.Tensor) else "cpu"
    autocast = (
        torch.autocast(device_type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with eval_mode(model, eval), torch.inference_mode(), autocast:
        for start in range(0, n, step):
            x = inputs[start : start + step]
            y = targets[start : start + step]
            logits = model(x)
            out = loss_fn(logits, y)
            if not isinstance(out, torch.Tensor) or out.shape != (x.shape[0],):
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"loss_fn should return one loss per example (shape ({x.shape[0]},)), but "
                    f"returned {shape}; pass reduction='none', e.g. "
                    "nn.CrossEntropyLoss(reduction='none')"
                )
            chunks.append(out.float())
            if keep_outputs:
                if not isinstance(logits, torch.Tensor) or logits.shape[:1] != (x.shape[0],):
                    found: tuple[int, ...] | str = (
                        tuple(logits.shape)
                        if isinstance(logits, torch.Tensor)
                        else type(logits).__name__
                    )
                    raise ValueError(
                        "keep_outputs (SelectiveLoader's keep_logits=True) keeps one model output "
                        f"row per example ({x.shape[0]} here), but the model returned {found}; "
                        "pass keep_logits=False"
                    )
                outputs.append(logits.float())
        losses = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        kept = None
        if keep_outputs:
            kept = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    # Cloning outside inference mode turns the inference tensor into an ordinary one.
    return losses.clone(), None if kept is None else kept.clone()


def downsample(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    """Bilinearly resize a 4-d image batch by ``scale`` (Composer's ``scale_factor``).

    Example:
        >>> downsample(torch.zeros(2, 3, 32, 32), 0.5).shape
        torch.Size([2, 3, 16, 16])
    """
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
        shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise ValueError(
            f"selection_scale={scale:g} resizes 4-d image batches (N, C, H, W), but the input "
            f"field has shape {shape}; pass selection_scale=None"
        )
    if not inputs.is_floating_point():
        raise TypeError(
            f"selection_scale={scale:g} resizes floating-point images, but the inputs have dtype "
            f"{inputs.dtype}; convert them to float in the source, or pass selection_scale=None"
        )
    if scale == 1.0:
        return inputs
    return F.interpolate(inputs, scale_factor=scale, mode="bilinear", align_corners=False)


def prefix_features(
    prefix: nn.Module,
    inputs: torch.Tensor,
    *,
    batch_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The outputs of a frozen ``prefix`` on ``inputs``, in eval mode, without autograd.

    Runs under ``torch.no_grad()`` (not inference mode) so that the outputs are ordinary tensors
    that a trainable head can take as inputs in autograd. Under ``autocast_dtype``, outputs of
    that dtype are returned as float32, ready for a float32 head.

    Example:
        >>> prefix_features(nn.Linear(4, 2), torch.zeros(5, 4), batch_size=2).shape
        torch.Size([5, 2])
    """
    n = inputs.shape[0]
    step = n if not batch_size else batch_size
    device_type = inputs.device.type
    autocast = (
        torch.autocast(device_type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with eval_mode(prefix), torch.no_grad(), autocast:
        chunks = [prefix(inputs[start : start + step]) for start in range(0, n, step)]
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    if autocast_dtype is not None and out.dtype == autocast_dtype:
        out = out.float()
    return out


class SelectionForward:
    """How the selection pass calls the model: compiled or not, at what input scale, and through
    a frozen prefix whose outputs are cached for training.

    Args:
        compile: ``True`` to run the selection forward through ``torch.compile`` of the
            (unwrapped) selection model, compiled once, on first use; or a dict of
            ``torch.compile`` keyword arguments (e.g. ``{"mode": "max-autotune"}``).
        scale: resize 4-d inputs by this factor in (0, 1] before the selection forward only.
        frozen_prefix: a module with no trainable parameters whose outputs are the model's
            inputs: the selection pass computes them once and keeps them for training.

    Example:
        >>> fwd = SelectionForward(scale=0.5)
        >>> losses, features, logits = fwd(
        ...     nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)),
        ...     torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long),
        ...     nn.CrossEntropyLoss(reduction="none"))
        >>> losses.shape, features, logits
        (torch.Size([4]), None, None)
    """

    def __init__(
        self,
        *,
        compile: bool | Mapping[str, Any] = False,
        scale: float | None = None,
        frozen_prefix: nn.Module | None = None,
    ) -> None:
        if isinstance(compile, Mapping):
            self.compile_kwargs: dict[str, Any] | None = dict(compile)
        elif isinstance(compile, bool):
            self.compile_kwargs = {} if compile else None
        else:
            raise TypeError(
                "compile_selection should be a bool or a dict of torch.compile arguments, but got "
                f"compile_selection={compile!r}"
            )
        self.scale = (
            None
            if scale is None
            else check_float("selection_scale", scale, low=0.0, high=1.0, low_open=True)
        )
        if frozen_prefix is not None and not isinstance(frozen_prefix, nn.Module):
            raise TypeError(
                "frozen_prefix should be a torch.nn.Module or None, but got "
                f"{type(frozen_prefix).__name__}"
            )
        if frozen_prefix is not None and self.scale is not None:
            raise ValueError(
                "selection_scale and frozen_prefix cannot be combined: the cached prefix outputs "
                "are training inputs and must come from full-resolution inputs; pass "
                "selection_scale=None"
            )
        self.frozen_prefix = None if frozen_prefix is None else unwrap(frozen_prefix)
        # NOTE: keyed by id() with the module kept alongside, so a recycled id cannot match.
        self._compiled: dict[int, tuple[nn.Module, nn.Module]] = {}

    @property
    def compiled_modules(self) -> list[nn.Module]:
        """The compiled selection modules made so far (one per module selected with)."""
        return [entry[1] for entry in self._compiled.values()]

    def module(self, module: nn.Module) -> nn.Module:
        """``module``, or its compiled version (compiled once, on first use) when compiling."""
        if self.compile_kwargs is None:
            return module
        entry = self._compiled.get(id(module))
        if entry is None or entry[0] is not module:
            # NOTE: torch.compile of a module returns an OptimizedModule, an nn.Module.
            compiled = cast(nn.Module, torch.compile(module, **self.compile_kwargs))
            self._compiled[id(module)] = entry = (module, compiled)
        return entry[1]

    def check(self, model: nn.Module, selector: nn.Module | None = None) -> None:
        """Refuse a frozen prefix that trains, or that the model or a selector contains.

        Called when the loader is built and again when each epoch starts.
        """
        prefix = self.frozen_prefix
        if prefix is None:
            return
        if selector is not None:
            raise ValueError(
                "selector and frozen_prefix cannot be combined: with a frozen prefix the "
                "selection pass scores the model on the cached prefix outputs; pass selector=None"
            )
        trainable = [name for name, p in prefix.named_parameters() if p.requires_grad]
        if trainable:
            shown = ", ".join(trainable[:3]) + (", ..." if len(trainable) > 3 else "")
            raise ValueError(
                f"frozen_prefix has {len(trainable)} parameters with requires_grad=True ({shown}); "
                "its outputs are computed once in the selection pass and reused for training, so "
                "it must not train: call frozen_prefix.requires_grad_(False) and keep its "
                "parameters out of the optimizer, or pass frozen_prefix=None"
            )
        prefix_params = {id(p) for p in prefix.parameters()}
        if prefix_params and any(id(p) in prefix_params for p in unwrap(model).parameters()):
            raise ValueError(
                "model should be the part that runs on frozen_prefix's outputs (the head), but it "
                "contains frozen_prefix's parameters; pass model=head and frozen_prefix=backbone, "
                "and train with head(batch.features)"
            )

    def features(
        self,
        inputs: torch.Tensor,
        batch_size: int | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The frozen prefix's outputs on ``inputs`` (compiled when compiling)."""
        assert self.frozen_prefix is not None
        prefix = self.module(self.frozen_prefix)
        return prefix_features(prefix, inputs, batch_size=batch_size, autocast_dtype=autocast_dtype)

    def __call__(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[..., torch.Tensor],
        *,
        batch_size: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        eval: bool = True,
        features: torch.Tensor | None = None,
        keep_outputs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Per-example losses of ``model`` on the candidates, the frozen prefix's outputs
        (``None`` without a frozen prefix; ``features``, when given, are those outputs already
        computed, e.g. from a cache, and the prefix does not run), and the model's outputs when
        ``keep_outputs`` (else ``None``).

        NOTE: the prefix runs under ``autocast_dtype`` too, since it is most of a frozen-backbone
        model's selection cost; its outputs, which become the selected examples' training
        inputs, are then reduced-precision values returned as float32. Without autocast they
        are exactly what a float32 training forward of the prefix computes.
        """
        if self.frozen_prefix is not None:
            if features is None:
                features = self.features(inputs, batch_size, autocast_dtype)
            inputs = features
        elif self.scale is not None:
            with torch.inference_mode():
                inputs = downsample(inputs, self.scale)
        losses, outputs = selection_outputs(
            self.module(model),
            inputs,
            targets,
            loss_fn,
            batch_size=batch_size,
            autocast_dtype=autocast_dtype,
            eval=eval,
            keep_outputs=keep_outputs,
        )
        return losses, features, outputs


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for a model without."""
    for t in model.parameters():
        return t.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")
