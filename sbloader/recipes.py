"""The reference training recipe of sbloader's examples and benchmarks (Fashion-MNIST scale).

A small CNN, its evaluation and its learning-rate schedule, kept in one place so that examples
and benchmarks train exactly the same way. Nothing here is needed to use :class:`SelectiveLoader`.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ._checks import check_float, check_int

__all__ = ["cosine_lr", "error_rate", "eval_batch_size", "mlp", "resnet18", "small_cnn"]


def _sizes(**sizes: int) -> tuple[int, ...]:
    """Each of a model's ``sizes`` checked (an int >= 1), in order.

    NOTE: torch builds a layer of 0 outputs (``num_classes=0``: a classifier of no classes,
    trained on nothing) and takes ``True`` for 1, unsaid.
    """
    return tuple(check_int(name, value, minimum=1) for name, value in sizes.items())


def mlp(num_classes: int = 10, in_features: int = 28 * 28, hidden: int = 1024) -> nn.Module:
    """784-1024-1024-10 with ReLUs, on flattened inputs (the papers' second architecture here).

    Example:
        >>> mlp()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    num_classes, in_features, hidden = _sizes(
        num_classes=num_classes, in_features=in_features, hidden=hidden
    )
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, num_classes),
    )


def small_cnn(num_classes: int = 10, in_channels: int = 1) -> nn.Module:
    """conv32-BN-pool, conv64-BN-pool, fc128, fc10 for 28 x 28 inputs.

    Example:
        >>> small_cnn()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    num_classes, in_channels = _sizes(num_classes=num_classes, in_channels=in_channels)
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


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (He et al., 2016)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Sequential:
    """ResNet-18 for 32 x 32 inputs (CIFAR-style: a 3x3 stem, no max-pool; 11.2M parameters).

    A ``Sequential`` whose first seven modules (stem and the four stages) form the backbone and
    whose last three (pool, flatten, linear) the classifier, so ``model[:7]`` can serve as a
    frozen prefix. Its global average pool accepts any input resolution (e.g. downsampled
    selection inputs).

    Example:
        >>> resnet18(num_classes=10, in_channels=1)(torch.zeros(2, 1, 32, 32)).shape
        torch.Size([2, 10])
    """

    num_classes, in_channels = _sizes(num_classes=num_classes, in_channels=in_channels)

    def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1))

    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        stage(64, 64, 1),
        stage(64, 128, 2),
        stage(128, 256, 2),
        stage(256, 512, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(512, num_classes),
    )


def eval_batch_size(device: torch.device | str) -> int:
    """Examples per evaluation forward on ``device``: 128 on a CPU, 1000 elsewhere.

    NOTE: on a CPU a large evaluation batch is slower per example, not faster: its activations
    leave the core's caches. The small CNN on 10,000 Fashion-MNIST test images, one thread, the
    Intel Xeon with AMX: 1.26 s in batches of 128, 1.6 s of 256, 3.2 s of 1000 (two threads: 0.67,
    0.82, 1.12 s), with identical outputs. An accelerator wants large batches instead.

    Example:
        >>> eval_batch_size("cpu"), eval_batch_size(torch.device("cuda", 0))
        (128, 1000)
    """
    return 128 if torch.device(device).type == "cpu" else 1000


@torch.inference_mode()
def error_rate(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    batch_size: int | None = None,
    memory_format: torch.memory_format = torch.channels_last,
    autocast: torch.dtype | None = None,
) -> float:
    """Top-1 error of ``model`` in eval mode, on the model's device (optionally under autocast);
    restores every module's training flag. ``inputs`` and ``targets`` hold the same examples (at
    least one), evaluated ``batch_size`` (>= 1) at a time; None: :func:`eval_batch_size` of the
    model's device.

    Example:
        >>> m = small_cnn()
        >>> 0.0 <= error_rate(m, torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long)) <= 1.0
        True
    """
    from .selection import eval_mode

    device = next(model.parameters()).device
    batch_size = (
        eval_batch_size(device)
        if batch_size is None
        else check_int("batch_size", batch_size, minimum=1)
    )
    if len(inputs) != len(targets):
        raise ValueError(
            f"error_rate needs one target per input, but got {len(inputs)} inputs and "
            f"{len(targets)} targets; pass the targets of the same examples"
        )
    if not len(inputs):
        raise ValueError("error_rate needs at least one example, but got 0 inputs")
    if targets.dim() != 1:
        raise ValueError(
            "error_rate needs one class index per input (targets of shape (N,)), but got "
            f"targets of shape {tuple(targets.shape)}; pass class indices (e.g. "
            "targets.argmax(1) for one-hot rows)"
        )
    # NOTE: a label outside the model's classes (a model built with another num_classes) was
    # counted as a mistake, unsaid: the error rate of a mismatched model, not an error.
    low, high = (v.item() for v in torch.aminmax(targets))  # (one pass over them)
    amp = (
        torch.autocast(device.type, dtype=autocast)
        if autocast is not None
        else contextlib.nullcontext()
    )
    wrong = torch.zeros((), dtype=torch.int64, device=device)
    with eval_mode(model), amp:
        for i in range(0, len(inputs), batch_size):
            x = inputs[i : i + batch_size].to(device, non_blocking=True)
            y = targets[i : i + batch_size].to(device, non_blocking=True)
            if x.dim() == 4:  # (a memory format is a layout of images: batch, C, H, W)
                x = x.contiguous(memory_format=memory_format)
            out = model(x)
            if i == 0 and (low < 0 or high >= out.shape[1]):
                raise ValueError(
                    f"targets should be class indices in [0, {out.shape[1]}) for a model with "
                    f"{out.shape[1]} outputs, but range from {low:g} to {high:g}; pass the "
                    "targets of the model's classes, or a model with one output per class"
                )
            wrong += (out.argmax(1) != y).sum()
    return int(wrong) / len(inputs)


def cosine_lr(base_lr: float, position: float, total: float) -> float:
    """Cosine decay from ``base_lr`` to 0 by position in the data (epochs consumed / planned).

    Keyed on position in the data (``loader.progress``), the schedule is the same for every
    strategy, however many examples each backpropagates. ``total`` must be > 0.

    Example:
        >>> cosine_lr(0.1, 0.0, 10), cosine_lr(0.1, 5.0, 10), cosine_lr(0.1, 10.0, 10)
        (0.1, 0.05, 0.0)
    """
    # NOTE: a NaN position (or base_lr) made the rate NaN, which optimizers take, unsaid.
    base_lr = check_float("base_lr", base_lr, low=0.0)
    position = check_float("position", position)
    total = check_float("total", total, low=0.0, low_open=True)
    t = min(max(position / total, 0.0), 1.0)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * t))
