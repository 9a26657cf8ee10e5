"""The reference training recipe of sbloader's examples and benchmarks (Fashion-MNIST scale).

A small CNN, its evaluation and its learning-rate schedule, kept in one place so that examples
and benchmarks train exactly the same way. Nothing here is needed to use :class:`SelectiveLoader`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["cosine_lr", "error_rate", "small_cnn"]


def small_cnn(num_classes: int = 10, in_channels: int = 1) -> nn.Module:
    """conv32-BN-pool, conv64-BN-pool, fc128, fc10 for 28 x 28 inputs.

    Example:
        >>> small_cnn()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(inplace=True),
        nn.Linear(128, num_classes),
    )


@torch.inference_mode()
def error_rate(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    batch_size: int = 1000,
    memory_format: torch.memory_format = torch.channels_last,
) -> float:
    """Top-1 error of ``model`` in eval mode; restores the model's training flag.

    Example:
        >>> m = small_cnn()
        >>> 0.0 <= error_rate(m, torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long)) <= 1.0
        True
    """
    was_training = model.training
    model.eval()
    try:
        wrong = 0
        for i in range(0, len(inputs), batch_size):
            x = inputs[i : i + batch_size].contiguous(memory_format=memory_format)
            wrong += int((model(x).argmax(1) != targets[i : i + batch_size]).sum())
    finally:
        model.train(was_training)
    return wrong / len(inputs)


def cosine_lr(base_lr: float, position: float, total: float) -> float:
    """Cosine decay from ``base_lr`` to 0 by position in the data (epochs consumed / planned).

    Keyed on position in the data (``loader.progress``), the schedule is the same for every
    strategy, however many examples each backpropagates.

    Example:
        >>> cosine_lr(0.1, 0.0, 10), cosine_lr(0.1, 5.0, 10), cosine_lr(0.1, 10.0, 10)
        (0.1, 0.05, 0.0)
    """
    t = min(max(position / total, 0.0), 1.0)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * t))
