"""Small data helpers for examples, benchmarks and tests: no downloads, ever."""

from __future__ import annotations

import gzip
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["FASHION_MNIST_DIR", "ArrayDataset", "load_fashion_mnist"]

#: Where Debian's ``dataset-fashion-mnist`` package installs the IDX files.
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

#: Mean and standard deviation of Fashion-MNIST's training pixels (scaled to [0, 1]).
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    if magic >> 8 != 0x08:  # 0x08: unsigned byte
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic {magic:#x})")
    ndim = magic & 0xFF
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_fashion_mnist(
    split: str = "train", root: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST images (uint8, N x 28 x 28) and labels (int64, N) from local IDX files.

    Args:
        split: ``"train"`` (60,000 examples) or ``"test"`` (10,000).
        root: the folder with the ``*-idx*-ubyte.gz`` files. Default: ``$SBLOADER_FASHION_MNIST``
            or Debian's ``/usr/share/datasets/fashion-mnist``.

    Example:
        >>> images, labels = load_fashion_mnist("test")  # doctest: +SKIP
        >>> images.shape, labels[:3].tolist()  # doctest: +SKIP
        ((10000, 28, 28), [9, 2, 1])
    """
    if split not in ("train", "test"):
        raise ValueError(f"split should be 'train' or 'test', but got split={split!r}")
    folder = Path(root or os.environ.get("SBLOADER_FASHION_MNIST") or FASHION_MNIST_DIR)
    prefix = "train" if split == "train" else "t10k"
    paths = []
    for kind in ("images-idx3", "labels-idx1"):
        candidates = [folder / f"{prefix}-{kind}-ubyte{ext}" for ext in (".gz", "")]
        found = next((p for p in candidates if p.exists()), None)
        if found is None:
            raise FileNotFoundError(
                f"Fashion-MNIST file {candidates[0].name} not found in {folder}; install it with "
                "`apt-get install dataset-fashion-mnist` or pass root= (or set "
                "SBLOADER_FASHION_MNIST) to a folder holding the IDX files"
            )
        paths.append(found)
    images, labels = _read_idx(paths[0]), _read_idx(paths[1])
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{paths[0]} has {images.shape[0]} images but {paths[1]} has {labels.shape[0]} labels"
        )
    return images, labels.astype(np.int64)


class ArrayDataset(Dataset):
    """A map-style dataset over tensors of equal length, with batched fetching.

    Implements ``__getitems__`` so that a DataLoader fetches a whole batch with one indexing
    operation per tensor instead of one ``__getitem__`` call per example.

    Example:
        >>> ds = ArrayDataset(torch.arange(10.0).view(5, 2), torch.arange(5))
        >>> ds[3]
        (tensor([6., 7.]), tensor(3))
        >>> len(ds.__getitems__([0, 4]))
        2
    """

    def __init__(self, *tensors: torch.Tensor | np.ndarray) -> None:
        if not tensors:
            raise ValueError("ArrayDataset needs at least one tensor")
        self.tensors = tuple(torch.as_tensor(t) for t in tensors)
        n = self.tensors[0].shape[0]
        for i, t in enumerate(self.tensors):
            if t.shape[0] != n:
                raise ValueError(
                    f"tensor {i} has {t.shape[0]} rows but tensor 0 has {n}; all tensors of an "
                    "ArrayDataset need the same length"
                )

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, ...]]:
        idx = torch.as_tensor(indices, dtype=torch.int64)
        columns = [t.index_select(0, idx).unbind(0) for t in self.tensors]
        return list(zip(*columns))


def fashion_mnist_tensors(
    split: str = "train", root: str | os.PathLike | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised float32 images (N x 1 x 28 x 28) and int64 labels, ready for training."""
    images, labels = load_fashion_mnist(split, root)
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    return x.contiguous(), torch.from_numpy(labels)
