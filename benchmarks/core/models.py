"""Model, optimizer and SelectiveLoader construction, the same for every benchmark."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

import sbloader
from sbloader.precision import PRECISIONS
from sbloader.recipes import mlp, resnet18, small_cnn

from .config import Config

MODELS = ("small_cnn", "resnet18", "mlp")
"""The models a configuration can name."""


def make_model(cfg: Config, classes: int = 10, channels: int = 1) -> nn.Module:
    """The configuration's model on its device, in its memory format, initialised from the
    global RNG (see :func:`seeded_model` for a run's own initialisation)."""
    if cfg.model == "small_cnn":
        model = small_cnn(classes, channels)
    elif cfg.model == "resnet18":
        model = resnet18(classes, channels)
    elif cfg.model == "mlp":
        model = mlp(classes, channels * cfg.image_size**2)
    else:
        raise ValueError(f"model should be one of {MODELS}, but got model={cfg.model!r}")
    device = cfg.resolved_device()
    if cfg.memory_format is None:
        return model.to(device)
    # Module.to takes memory_format at run time; torch's stub overloads leave it out.
    return model.to(device, memory_format=cfg.memory_format)  # type: ignore[call-overload]


def seeded_model(cfg: Config, seed: int, classes: int = 10, channels: int = 1) -> nn.Module:
    """:func:`make_model` initialised from ``seed``, leaving the global RNGs as they were."""
    device = cfg.resolved_device()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return make_model(cfg, classes, channels)


def make_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum and weight decay at the peak learning rate (the schedule sets
    the rate before each step)."""
    return torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=True,
        weight_decay=cfg.weight_decay,
    )


def make_loader(
    cfg: Config,
    source: Any,
    model: nn.Module,
    policy: sbloader.Policy,
    seed: int,
    **kw: Any,
) -> sbloader.SelectiveLoader:
    """A SelectiveLoader with the configuration's training batch, memory format and selection
    precision (``selection_precision``); ``kw`` overrides or adds options."""
    kw.setdefault("autocast", PRECISIONS[cfg.selection_precision])
    return sbloader.SelectiveLoader(
        source,
        model,
        policy=policy,
        batch_size=cfg.batch_size,
        memory_format=cfg.memory_format,
        seed=seed,
        **kw,
    )


def split_backbone(cfg: Config, model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model's convolutional backbone and its classifier head (shared modules)."""
    cut = 7 if cfg.model == "resnet18" else 8
    seq = cast(nn.Sequential, model)  # every model in MODELS is an nn.Sequential
    return seq[:cut], seq[cut:]
