"""Small data helpers for examples, benchmarks and tests: no downloads, ever."""

from __future__ import annotations

import gzip
import os
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

__all__ = [
    "FASHION_MNIST_DIR",
    "LOCAL_DATASETS",
    "ArrayDataset",
    "ArrayRows",
    "fashion_mnist_tensors",
    "load_fashion_mnist",
    "load_local_dataset",
    "local_dataset_tensors",
]

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
    # (over a bytearray: writable, as the labels are; over the bytes object a tensor made from
    # it warned of undefined behaviour and wrote into immutable memory)
    return np.frombuffer(bytearray(data), dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


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


class ArrayRows(Sequence):
    """A batch of an :class:`ArrayDataset`'s rows, gathered once per tensor: what its
    ``__getitems__`` returns.

    As a sequence it holds one tuple per row (what torch's default collate function takes, made
    on first access); :meth:`ArrayDataset.collate` uses ``columns``, the gathered tensors, as
    they are.

    Example:
        >>> ds = ArrayDataset(torch.arange(6).view(3, 2), torch.tensor([7, 8, 9]))
        >>> rows = ds.__getitems__([2, 0])
        >>> len(rows), [c.tolist() for c in rows.columns]
        (2, [[[4, 5], [0, 1]], [9, 7]])
        >>> rows[0]
        (tensor([4, 5]), tensor(9))
        >>> [c.tolist() for c in ArrayDataset.collate(rows)]
        [[[4, 5], [0, 1]], [9, 7]]
    """

    __slots__ = ("_rows", "columns")

    def __init__(self, columns: list[torch.Tensor]) -> None:
        self.columns = columns
        self._rows: list[tuple[torch.Tensor, ...]] | None = None

    def _materialised(self) -> list[tuple[torch.Tensor, ...]]:
        if self._rows is None:
            self._rows = list(zip(*(c.unbind(0) for c in self.columns)))
        return self._rows

    def __len__(self) -> int:
        return int(self.columns[0].shape[0])

    def __getitem__(self, i: Any) -> Any:
        return self._materialised()[i]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return iter(self._materialised())


class ArrayDataset(Dataset):
    """A map-style dataset over tensors of equal length, with batched fetching.

    Implements ``__getitems__`` so that a DataLoader fetches a whole batch with one indexing
    operation per tensor instead of one ``__getitem__`` call per example. Pass
    ``collate_fn=ArrayDataset.collate`` too and the gathered tensors are the batch, instead of
    being split into rows that torch's default collate function stacks again.

    NOTE (why ``collate``): with the default collate function a batch of B rows costs B views
    per tensor and a stack of them; on a GPU, where each costs host time, that was 0.4-0.5 s an
    epoch of 60,000 examples on an H100 (the "data loading" of ``benchmarks/results/
    gpu_breakdown_1125/``), 14-21% of an epoch there. The batch is the same either way.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> ds = ArrayDataset(torch.arange(10.0).view(5, 2), torch.arange(5))
        >>> ds[3]
        (tensor([6., 7.]), tensor(3))
        >>> len(ds.__getitems__([0, 4]))
        2
        >>> x, y = next(iter(DataLoader(ds, batch_size=2, collate_fn=ArrayDataset.collate)))
        >>> x.tolist(), y.tolist()
        ([[0.0, 1.0], [2.0, 3.0]], [0, 1])
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

    def __getitems__(self, indices: Sequence[int]) -> ArrayRows:
        # NOTE: a sampler's list of ints through numpy: about 3.5x faster than torch.as_tensor
        # on it (6.5 against 23 us for 512 indices).
        idx = (
            indices.to(torch.int64)
            if isinstance(indices, torch.Tensor)
            else torch.from_numpy(np.asarray(indices, dtype=np.int64))
        )
        # NOTE: tensors may live on a GPU (a dataset kept on the device, num_workers=0).
        return ArrayRows([t.index_select(0, idx.to(t.device)) for t in self.tensors])

    @staticmethod
    def collate(batch: Any) -> Any:
        """A DataLoader's ``collate_fn`` for an ArrayDataset: the gathered tensors of an
        :class:`ArrayRows` as a list (what the default collate function makes of the same rows,
        without splitting and stacking them); anything else through the default one."""
        if isinstance(batch, ArrayRows):
            return list(batch.columns)
        return default_collate(batch)


def fashion_mnist_tensors(
    split: str = "train", root: str | os.PathLike | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised float32 images (N x 1 x 28 x 28) and int64 labels, ready for training.

    Reads the files of :func:`load_fashion_mnist` (same ``split`` and ``root``), scales the pixels
    to [0, 1] and normalises them with the training split's mean (0.2860) and std (0.3530).

    Example:
        Two white test images written as IDX files (the format of the dataset's files):

        >>> import tempfile
        >>> def write_idx(path, a):
        ...     dims = b"".join(d.to_bytes(4, "big") for d in a.shape)
        ...     Path(path).write_bytes(bytes([0, 0, 8, a.ndim]) + dims + a.tobytes())
        >>> with tempfile.TemporaryDirectory() as root:
        ...     write_idx(f"{root}/t10k-images-idx3-ubyte", np.full((2, 28, 28), 255, np.uint8))
        ...     write_idx(f"{root}/t10k-labels-idx1-ubyte", np.array([3, 7], np.uint8))
        ...     x, y = fashion_mnist_tensors("test", root)
        >>> x.shape, x.dtype, round(x.max().item(), 4), y.dtype, y.tolist()
        (torch.Size([2, 1, 28, 28]), torch.float32, 2.0227, torch.int64, [3, 7])
    """
    images, labels = load_fashion_mnist(split, root)
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    return x.contiguous(), torch.from_numpy(labels)


#: Datasets that :func:`load_local_dataset` reads, with their number of classes.
LOCAL_DATASETS: dict[str, int] = {"cifar10": 10, "cifar100": 100, "svhn": 10}

_TITLES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "svhn": "SVHN"}
_TORCHVISION_CLASSES = {"cifar10": "CIFAR10", "cifar100": "CIFAR100", "svhn": "SVHN"}

#: Per-channel (mean, std) of each train split, in [0, 1] pixel units, keyed by (name, root).
_TRAIN_STATS: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}


def _check_name_split(name: str, split: str) -> None:
    if name not in LOCAL_DATASETS:
        names = ", ".join(repr(n) for n in LOCAL_DATASETS)
        raise ValueError(f"name should be one of {names}, but got name={name!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split should be one of 'train', 'test', but got split={split!r}")


def _local_files(name: str, split: str, folder: Path) -> list[Path]:
    if name == "cifar10":
        base = folder / "cifar-10-batches-py"
        names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        return [base / n for n in names]
    if name == "cifar100":
        return [folder / "cifar-100-python" / split]
    return [folder / f"{split}_32x32.mat"]


def _read_cifar_pickle(path: Path, label_key: str, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        try:
            entry = pickle.load(f, encoding="latin1")
        except Exception as e:  # a truncated or foreign file: say which one
            raise ValueError(f"{path} is not a readable CIFAR pickle: {e}") from e
    if not isinstance(entry, dict) or "data" not in entry or label_key not in entry:
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(
            f"{path} should be a pickled dict with keys 'data' and {label_key!r}, but got {keys}"
        )
    data = np.asarray(entry["data"])
    labels = np.asarray(entry[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(
            f"{path}: 'data' should be a uint8 array of shape (N, 3072), but got "
            f"{data.dtype} {data.shape}"
        )
    if labels.ndim != 1 or labels.shape[0] != data.shape[0]:
        raise ValueError(
            f"{path}: {label_key!r} should hold one label per row of 'data' ({data.shape[0]}), "
            f"but got shape {labels.shape}"
        )
    if labels.size and (
        not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() >= n_classes
    ):
        raise ValueError(
            f"{path}: {label_key!r} should be integers in [0, {n_classes}), but got "
            f"{labels.dtype} values in [{labels.min()}, {labels.max()}]"
        )
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _read_svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        from scipy.io import loadmat  # type: ignore[import-untyped]
    except ImportError as e:
        raise ImportError(
            "reading SVHN's .mat files needs scipy; install it with `pip install scipy`"
        ) from e
    try:
        mat = loadmat(path)
    except Exception as e:
        raise ValueError(f"{path} is not a readable MATLAB file: {e}") from e
    if "X" not in mat or "y" not in mat:
        keys = sorted(k for k in mat if not k.startswith("__"))
        raise ValueError(f"{path} should hold variables 'X' and 'y', but has {keys}")
    x, y = mat["X"], mat["y"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise ValueError(
            f"{path}: 'X' should be a uint8 array of shape (32, 32, 3, N), but got "
            f"{x.dtype} {x.shape}"
        )
    n = x.shape[3]
    if y.size != n or (y.ndim == 2 and y.shape[1] != 1) or y.ndim > 2:
        raise ValueError(
            f"{path}: 'y' should have shape ({n}, 1), one label per image, but got {y.shape}"
        )
    labels = y.reshape(-1).astype(np.int64)
    if labels.size and (labels.min() < 1 or labels.max() > 10):
        raise ValueError(
            f"{path}: 'y' should hold labels 1..10 (10 for the digit 0), but got values in "
            f"[{labels.min()}, {labels.max()}]"
        )
    labels[labels == 10] = 0
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), labels


def load_local_dataset(
    name: str, split: str, root: str | os.PathLike
) -> tuple[np.ndarray, np.ndarray]:
    """Images (uint8, N x 3 x 32 x 32) and labels (int64, N) of a dataset in torchvision's format.

    Reads the files that torchvision's dataset classes leave under their ``root`` folder; nothing
    is ever downloaded:

    * ``"cifar10"``: ``root/cifar-10-batches-py/data_batch_1`` .. ``data_batch_5`` (train, in
      that order) and ``test_batch``.
    * ``"cifar100"``: ``root/cifar-100-python/train`` and ``test`` (the 100 fine labels).
    * ``"svhn"``: ``root/train_32x32.mat`` and ``root/test_32x32.mat``; labels are 0..9 (SVHN's
      label 10 is the digit 0). Needs scipy (``pip install scipy``), which sbloader does not
      require otherwise.

    The CIFAR files are pickles, which can run code when read: as with torchvision, read only
    files you trust.

    Args:
        name: one of :data:`LOCAL_DATASETS`: ``"cifar10"``, ``"cifar100"`` or ``"svhn"``.
        split: ``"train"`` or ``"test"``.
        root: the folder given to torchvision as ``root``.

    Raises:
        ValueError: for an unknown ``name`` or ``split``, or a file with unexpected contents.
        FileNotFoundError: when a file of the split is missing under ``root``.

    Example:
        >>> LOCAL_DATASETS["cifar100"]
        100
        >>> load_local_dataset("mnist", "train", "data")
        Traceback (most recent call last):
            ...
        ValueError: name should be one of 'cifar10', 'cifar100', 'svhn', but got name='mnist'
        >>> images, labels = load_local_dataset("cifar10", "test", "data")  # doctest: +SKIP
        >>> images.shape, images.dtype, labels[:3].tolist()  # doctest: +SKIP
        ((10000, 3, 32, 32), dtype('uint8'), [3, 8, 8])
    """
    _check_name_split(name, split)
    folder = Path(root).expanduser()  # ("~/data", as torchvision takes it)
    paths = _local_files(name, split, folder)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        title = _TITLES[name]
        raise FileNotFoundError(
            f"{title} {split} file(s) not found: {', '.join(str(p) for p in missing)}; put "
            f"{title} there in torchvision's format (torchvision.datasets."
            f"{_TORCHVISION_CLASSES[name]}(root, "
            + ("split=..., " if name == "svhn" else "")
            + "download=True) writes it); sbloader never downloads data"
        )
    if name == "svhn":
        return _read_svhn_mat(paths[0])
    label_key = "labels" if name == "cifar10" else "fine_labels"
    parts = [_read_cifar_pickle(p, label_key, LOCAL_DATASETS[name]) for p in paths]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def _channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean and (population) std of uint8 N x C x H x W images, in [0, 1]."""
    values = np.arange(256, dtype=np.float64)
    means, stds = [], []
    for c in range(images.shape[1]):
        counts = np.bincount(images[:, c].reshape(-1), minlength=256).astype(np.float64)
        n = counts.sum()
        if n == 0:
            raise ValueError("cannot normalise with the statistics of an empty train split")
        mean = (counts * values).sum() / n
        means.append(mean)
        stds.append(np.sqrt((counts * (values - mean) ** 2).sum() / n))
    mean, std = np.array(means) / 255.0, np.array(stds) / 255.0
    return mean, np.where(std > 0, std, 1.0)  # a constant channel maps to 0, not to nan


def local_dataset_tensors(
    name: str, split: str, root: str | os.PathLike
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised float32 images (N x 3 x 32 x 32) and int64 labels, ready for training.

    Pixels are scaled to [0, 1], then each channel is normalised with the mean and std of the
    *train* split (so train and test go through the same transform). These statistics are
    computed once per ``(name, root)`` and kept for the life of the process, so reading the test
    split after the train split does not read the train files again.

    Args:
        name: ``"cifar10"``, ``"cifar100"`` or ``"svhn"`` (see :func:`load_local_dataset`).
        split: ``"train"`` or ``"test"``.
        root: the folder given to torchvision as ``root``.

    Example:
        >>> x, y = local_dataset_tensors("cifar10", "train", "data")  # doctest: +SKIP
        >>> x.shape, x.dtype, y.dtype  # doctest: +SKIP
        (torch.Size([50000, 3, 32, 32]), torch.float32, torch.int64)
    """
    _check_name_split(name, split)
    key = (name, str(Path(root).expanduser().resolve()))
    images, labels = load_local_dataset(name, split, root)
    if key not in _TRAIN_STATS:
        train = images if split == "train" else load_local_dataset(name, "train", root)[0]
        _TRAIN_STATS[key] = _channel_stats(train)
    mean, std = _TRAIN_STATS[key]
    shape = (1, -1, 1, 1)
    x = torch.from_numpy(images).to(torch.float32).div_(255.0)
    x.sub_(torch.from_numpy(mean).to(torch.float32).view(shape))
    x.div_(torch.from_numpy(std).to(torch.float32).view(shape))
    return x, torch.from_numpy(labels)
