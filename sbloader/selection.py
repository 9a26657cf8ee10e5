"""The selection pass: one forward of the candidates to get one loss per example."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["check_loss_fn", "eval_mode", "selection_losses", "unwrap"]


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


def selection_losses(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    batch_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    eval: bool = True,
) -> torch.Tensor:
    """Per-example losses of ``model`` on the candidates, without autograd.

    Runs under ``torch.inference_mode()`` in chunks of ``batch_size`` examples (all at once when
    None), in eval mode unless ``eval=False``, optionally under autocast.

    NOTE (eval-mode selection): a train-mode forward updates BatchNorm running statistics even
    without gradients and applies dropout noise to the losses; eval mode does neither, and a
    selection chunk of one example cannot crash BatchNorm.

    Returns:
        float32 losses on the model's output device, as an ordinary tensor (not an inference
        tensor), so that they can be used in autograd expressions such as ``loss * weights``.
    """
    n = inputs.shape[0]
    step = n if not batch_size else batch_size
    chunks = []
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
            out = loss_fn(model(x), y)
            if not isinstance(out, torch.Tensor) or out.shape != (x.shape[0],):
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"loss_fn should return one loss per example (shape ({x.shape[0]},)), but "
                    f"returned {shape}; pass reduction='none', e.g. "
                    "nn.CrossEntropyLoss(reduction='none')"
                )
            chunks.append(out.float())
        losses = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    # Cloning outside inference mode turns the inference tensor into an ordinary one.
    return losses.clone()
