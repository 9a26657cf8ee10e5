"""The benchmarks' data: datasets as tensors, label noise, augmentation, DataLoader sources."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from sbloader.datasets import ArrayDataset, fashion_mnist_tensors

from .config import Config


def pad_to(x: torch.Tensor, size: int, fill: float | None = None) -> torch.Tensor:
    """Fashion-MNIST images padded on every side to ``size`` with ``fill`` (default: the
    background value, what 0 becomes after normalisation: the images' minimum)."""
    pad = size - x.shape[-1]
    if pad < 0 or pad % 2:
        raise ValueError(
            f"image_size should be 28 or more by an even number for Fashion-MNIST, but got "
            f"image_size={size}"
        )
    if not pad:
        return x
    fill = float(x.min()) if fill is None else fill
    return F.pad(x, (pad // 2,) * 4, value=fill).contiguous()


def train_set(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST's training images (normalised float32, N x 1 x H x W, padded to
    ``cfg.image_size``) and int64 labels, on the CPU."""
    x, y = fashion_mnist_tensors("train")
    return pad_to(x, cfg.image_size), y


def load_data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised float32 train and test images (N, C, H, W) and int64 labels, on the CPU
    (prefixes of ``train_examples`` and ``test_examples`` when those are set)."""
    x, y, xt, yt = _full_data(cfg)
    if cfg.train_examples is not None:
        x, y = x[: cfg.train_examples].contiguous(), y[: cfg.train_examples].contiguous()
    if cfg.test_examples is not None:
        xt, yt = xt[: cfg.test_examples].contiguous(), yt[: cfg.test_examples].contiguous()
    return x, y, xt, yt


def _full_data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if cfg.dataset == "fashion_mnist":
        x, y = fashion_mnist_tensors("train")
        xt, yt = fashion_mnist_tensors("test")
        fill = float(x.min())  # the training set's background value, for both
        return pad_to(x, cfg.image_size, fill), y, pad_to(xt, cfg.image_size, fill), yt
    from sbloader.datasets import local_dataset_tensors

    if cfg.data_root is None:
        raise ValueError(
            f"the {cfg.dataset!r} preset reads a local copy in torchvision's format; pass "
            "--data FOLDER (sbloader never downloads data)"
        )
    return (
        *local_dataset_tensors(cfg.dataset, "train", cfg.data_root),
        *local_dataset_tensors(cfg.dataset, "test", cfg.data_root),
    )


def flip_labels(y: torch.Tensor, fraction: float, seed: int, classes: int = 10) -> torch.Tensor:
    """``y`` with a ``fraction`` of its labels replaced by a wrong one, chosen by ``seed`` (with
    its own generator: the global RNGs are untouched)."""
    if fraction <= 0:
        return y
    g = torch.Generator().manual_seed(10_000 + seed)
    idx = torch.randperm(len(y), generator=g)[: round(fraction * len(y))]
    shift = torch.randint(1, classes, (len(idx),), generator=g)
    y = y.clone()
    y[idx] = (y[idx] + shift) % classes  # always a wrong label
    return y


def augment(x: torch.Tensor, gen: torch.Generator, flip: bool, pad: int = 4) -> torch.Tensor:
    """Random crops of the zero-padded images (a shift of up to ``pad`` pixels each way, per
    example) and, when ``flip``, random horizontal flips: airbench's batch augmentation."""
    n, c, h, w = x.shape
    dev = x.device
    if flip:
        mask = torch.rand(n, device=dev, generator=gen) < 0.5
        x = torch.where(mask[:, None, None, None], x.flip(3), x)
    padded = F.pad(x, (pad,) * 4)
    dy, dx = torch.randint(0, 2 * pad + 1, (2, n), device=dev, generator=gen)
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]
    batch = torch.arange(n, device=dev)[:, None, None, None]
    chans = torch.arange(c, device=dev)[None, :, None, None]
    return padded[batch, chans, rows, cols].contiguous(memory_format=torch.channels_last)


def shuffled(
    dataset: Dataset, batch_size: int, seed: int, array_collate: bool = False
) -> DataLoader:
    """A shuffling DataLoader with its own generator seeded with ``seed``: its order never draws
    from (or disturbs) the global RNG, so runs trained in turn keep their own data order.
    ``array_collate``: collate with ``ArrayDataset.collate`` (``dataset`` an ArrayDataset)."""
    kw: dict[str, Any] = {"collate_fn": ArrayDataset.collate} if array_collate else {}
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )
