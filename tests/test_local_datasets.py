"""CIFAR-10, CIFAR-100 and SVHN readers, on tiny synthetic files in torchvision's formats."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from sbloader import datasets
from sbloader.datasets import LOCAL_DATASETS, load_local_dataset, local_dataset_tensors

CIFAR10_TRAIN_SIZES = (7, 5, 6, 4, 3)  # examples in data_batch_1 .. data_batch_5


def _pickle(path: Path, entry: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(entry, f, protocol=2)


def _images(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)


def write_cifar10(root: Path, seed: int = 0) -> dict[str, list[dict]]:
    """Writes cifar-10-batches-py/ under root; returns the entries written, per split."""
    rng = np.random.default_rng(seed)
    written: dict[str, list[dict]] = {"train": [], "test": []}
    for i, n in enumerate(CIFAR10_TRAIN_SIZES, start=1):
        entry = {
            "batch_label": f"training batch {i} of 5",
            "data": _images(rng, n),
            "labels": rng.integers(0, 10, size=n).tolist(),
            "filenames": [f"img_{i}_{k}.png" for k in range(n)],
        }
        _pickle(root / "cifar-10-batches-py" / f"data_batch_{i}", entry)
        written["train"].append(entry)
    # Test pixels are darker than train ones, so their normalised mean is clearly not 0.
    entry = {"data": _images(rng, 5) // 2, "labels": [0, 9, 3, 3, 1]}
    _pickle(root / "cifar-10-batches-py" / "test_batch", entry)
    written["test"].append(entry)
    return written


def write_cifar100(root: Path, seed: int = 1) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    written = {}
    for split, n in (("train", 7), ("test", 5)):
        entry = {
            "data": _images(rng, n),
            "fine_labels": rng.integers(0, 100, size=n).tolist(),
            "coarse_labels": rng.integers(0, 20, size=n).tolist(),
        }
        _pickle(root / "cifar-100-python" / split, entry)
        written[split] = entry
    return written


def write_svhn(root: Path, seed: int = 2) -> dict[str, dict]:
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    written = {}
    for split, n in (("train", 7), ("test", 5)):
        x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
        y = rng.integers(1, 11, size=(n, 1)).astype(np.uint8)
        y[0, 0], y[1, 0] = 10, 3  # one digit 0 (stored as 10) and a plain label in every split
        savemat(root / f"{split}_32x32.mat", {"X": x, "y": y})
        written[split] = {"X": x, "y": y}
    return written


def test_local_datasets_lists_class_counts():
    assert LOCAL_DATASETS == {"cifar10": 10, "cifar100": 100, "svhn": 10}


def test_cifar10_train_concatenates_batches_in_order(tmp_path):
    written = write_cifar10(tmp_path)
    images, labels = load_local_dataset("cifar10", "train", tmp_path)
    n = sum(CIFAR10_TRAIN_SIZES)
    assert images.shape == (n, 3, 32, 32) and images.dtype == np.uint8
    assert labels.shape == (n,) and labels.dtype == np.int64
    expected_labels = [y for entry in written["train"] for y in entry["labels"]]
    assert labels.tolist() == expected_labels
    expected = np.concatenate([entry["data"] for entry in written["train"]])
    np.testing.assert_array_equal(images.reshape(n, -1), expected)


def test_a_root_under_the_home_folder_is_expanded(tmp_path, monkeypatch):
    write_cifar10(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    images, _ = load_local_dataset("cifar10", "test", f"~/{tmp_path.name}")
    assert images.shape[1:] == (3, 32, 32)


def test_cifar10_pixels_land_at_the_right_index_and_channel(tmp_path):
    root = tmp_path
    rng = np.random.default_rng(3)
    for i, n in enumerate(CIFAR10_TRAIN_SIZES, start=1):
        data = np.zeros((n, 3072), dtype=np.uint8)
        if i == 2:
            # Image k=3 of data_batch_2: channel-major rows of 32 pixels per colour plane.
            data[3, 0 * 1024 + 5 * 32 + 7] = 11  # R at (row 5, col 7)
            data[3, 1 * 1024 + 31 * 32 + 0] = 22  # G at (row 31, col 0)
            data[3, 2 * 1024 + 0 * 32 + 31] = 33  # B at (row 0, col 31)
        entry = {"data": data, "labels": rng.integers(0, 10, size=n).tolist()}
        _pickle(root / "cifar-10-batches-py" / f"data_batch_{i}", entry)
    images, _ = load_local_dataset("cifar10", "train", root)
    index = CIFAR10_TRAIN_SIZES[0] + 3
    assert images[index, 0, 5, 7] == 11
    assert images[index, 1, 31, 0] == 22
    assert images[index, 2, 0, 31] == 33
    assert int(images.sum()) == 11 + 22 + 33  # nothing else is set anywhere


def test_cifar10_test_split(tmp_path):
    written = write_cifar10(tmp_path)
    images, labels = load_local_dataset("cifar10", "test", tmp_path)
    assert images.shape == (5, 3, 32, 32) and images.dtype == np.uint8
    assert labels.dtype == np.int64 and labels.tolist() == [0, 9, 3, 3, 1]
    data = written["test"][0]["data"]
    np.testing.assert_array_equal(images[4], data[4].reshape(3, 32, 32))
    assert images[2, 1, 10, 20] == data[2, 1024 + 10 * 32 + 20]


def test_cifar100_uses_fine_labels(tmp_path):
    written = write_cifar100(tmp_path)
    for split, n in (("train", 7), ("test", 5)):
        images, labels = load_local_dataset("cifar100", split, str(tmp_path))
        assert images.shape == (n, 3, 32, 32) and images.dtype == np.uint8
        assert labels.dtype == np.int64
        assert labels.tolist() == written[split]["fine_labels"]
        np.testing.assert_array_equal(images.reshape(n, -1), written[split]["data"])


def test_svhn_layout_and_label_ten_is_zero(tmp_path):
    pytest.importorskip("scipy")
    written = write_svhn(tmp_path)
    for split, n in (("train", 7), ("test", 5)):
        images, labels = load_local_dataset("svhn", split, tmp_path)
        assert images.shape == (n, 3, 32, 32) and images.dtype == np.uint8
        assert images.flags.c_contiguous
        x, y = written[split]["X"], written[split]["y"]
        # X is H x W x C x N: image k, channel c, row h, column w is X[h, w, c, k].
        assert images[2, 0, 5, 7] == x[5, 7, 0, 2]
        assert images[2, 1, 31, 0] == x[31, 0, 1, 2]
        assert images[n - 1, 2, 0, 31] == x[0, 31, 2, n - 1]
        np.testing.assert_array_equal(images, x.transpose(3, 2, 0, 1))
        assert labels.dtype == np.int64 and labels.shape == (n,)
        assert labels[0] == 0 and labels[1] == 3
        assert labels.tolist() == [0 if v == 10 else int(v) for v in y[:, 0]]
        assert labels.min() >= 0 and labels.max() <= 9


def test_svhn_without_scipy_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    (tmp_path / "train_32x32.mat").write_bytes(b"")
    real_import = builtins.__import__

    def no_scipy(name, *args, **kwargs):
        if name == "scipy" or name.startswith("scipy."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_scipy)
    with pytest.raises(ImportError, match="pip install scipy"):
        load_local_dataset("svhn", "train", tmp_path)


def _check_normalised_with_train_stats(name: str, root: Path) -> None:
    train_u8, _ = load_local_dataset(name, "train", root)
    test_u8, test_labels = load_local_dataset(name, "test", root)
    # The test split first: its statistics must still come from the train split.
    x_test, y_test = local_dataset_tensors(name, "test", root)
    x_train, y_train = local_dataset_tensors(name, "train", root)
    assert x_train.dtype == torch.float32 and x_train.shape == train_u8.shape
    assert x_test.dtype == torch.float32 and x_test.shape == test_u8.shape
    assert y_train.dtype == torch.int64 and y_test.dtype == torch.int64
    assert y_test.tolist() == test_labels.tolist()
    per_channel = x_train.double().transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(
        per_channel.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        per_channel.std(1, unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-5, rtol=0
    )
    # The test split goes through the train split's transform, not its own statistics.
    pixels = train_u8.astype(np.float64).transpose(1, 0, 2, 3).reshape(3, -1) / 255.0
    mean, std = pixels.mean(1), pixels.std(1)
    expected = (test_u8.astype(np.float64) / 255.0 - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(x_test.numpy(), expected, atol=1e-5, rtol=0)


def test_cifar10_tensors_use_train_statistics(tmp_path):
    write_cifar10(tmp_path)
    _check_normalised_with_train_stats("cifar10", tmp_path)
    x_test, _ = local_dataset_tensors("cifar10", "test", tmp_path)
    # The test images are darker, so with the train transform their mean is well below 0.
    assert x_test.mean().item() < -0.5


def test_cifar100_tensors_use_train_statistics(tmp_path):
    write_cifar100(tmp_path)
    _check_normalised_with_train_stats("cifar100", tmp_path)


def test_svhn_tensors_use_train_statistics(tmp_path):
    pytest.importorskip("scipy")
    write_svhn(tmp_path)
    _check_normalised_with_train_stats("svhn", tmp_path)


def test_a_constant_channel_is_normalised_to_zero_not_nan(tmp_path):
    for split, n in (("train", 3), ("test", 2)):
        data = np.zeros((n, 3, 1024), np.uint8)
        data[:, 1] = 77  # green is one value everywhere: its std is 0
        data[:, 2] = np.arange(n * 1024).reshape(n, 1024) % 256
        entry = {"data": data.reshape(n, 3072), "fine_labels": [0] * n}
        _pickle(tmp_path / "cifar-100-python" / split, entry)
    x, _ = local_dataset_tensors("cifar100", "test", tmp_path)
    assert torch.isfinite(x).all() and not x[:, :2].any() and x[:, 2].std() > 0.5


def test_train_split_is_read_once_per_root(tmp_path):
    write_cifar10(tmp_path)
    first, _ = local_dataset_tensors("cifar10", "test", tmp_path)
    assert ("cifar10", str(tmp_path.resolve())) in datasets._TRAIN_STATS
    for i in range(1, 6):  # the statistics are cached: the train files are no longer needed
        (tmp_path / "cifar-10-batches-py" / f"data_batch_{i}").unlink()
    again, _ = local_dataset_tensors("cifar10", "test", str(tmp_path))
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    # Another root has its own statistics.
    other = tmp_path / "other"
    write_cifar10(other, seed=5)
    x_train, _ = local_dataset_tensors("cifar10", "train", other)
    assert abs(x_train.mean().item()) < 1e-5


def test_unknown_name_is_rejected(tmp_path):
    msg = "name should be one of 'cifar10', 'cifar100', 'svhn', but got name='mnist'"
    with pytest.raises(ValueError, match=msg):
        load_local_dataset("mnist", "train", tmp_path)
    with pytest.raises(ValueError, match="but got name='CIFAR10'"):
        local_dataset_tensors("CIFAR10", "train", tmp_path)


def test_unknown_split_is_rejected(tmp_path):
    msg = "split should be one of 'train', 'test', but got split='val'"
    with pytest.raises(ValueError, match=msg):
        load_local_dataset("cifar10", "val", tmp_path)
    with pytest.raises(ValueError, match="split="):
        local_dataset_tensors("svhn", "valid", tmp_path)


@pytest.mark.parametrize(
    ("name", "split", "expected", "torchvision"),
    [
        ("cifar10", "train", "cifar-10-batches-py/data_batch_1", "CIFAR10"),
        ("cifar10", "test", "cifar-10-batches-py/test_batch", "CIFAR10"),
        ("cifar100", "train", "cifar-100-python/train", "CIFAR100"),
        ("cifar100", "test", "cifar-100-python/test", "CIFAR100"),
        ("svhn", "train", "train_32x32.mat", "SVHN"),
        ("svhn", "test", "test_32x32.mat", "SVHN"),
    ],
)
def test_missing_files_name_the_path_and_the_fix(tmp_path, name, split, expected, torchvision):
    with pytest.raises(FileNotFoundError) as info:
        load_local_dataset(name, split, tmp_path)
    message = str(info.value)
    assert str(tmp_path / expected) in message
    assert f"torchvision.datasets.{torchvision}(" in message
    assert "sbloader never downloads data" in message
    with pytest.raises(FileNotFoundError, match="never downloads"):
        local_dataset_tensors(name, split, tmp_path)


def test_missing_cifar10_batch_is_named(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_local_dataset("cifar10", "train", tmp_path)
    message = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py" / "data_batch_4") in message
    assert "data_batch_3" not in message
    load_local_dataset("cifar10", "test", tmp_path)  # the test split is still complete


def test_cifar_file_with_wrong_contents_is_named(tmp_path):
    path = tmp_path / "cifar-100-python" / "test"
    _pickle(path, {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 1]})
    with pytest.raises(ValueError, match="fine_labels") as info:
        load_local_dataset("cifar100", "test", tmp_path)
    assert str(path) in str(info.value)

    _pickle(path, {"data": np.zeros((2, 32, 32, 3), np.uint8), "fine_labels": [0, 1]})
    with pytest.raises(ValueError, match=r"\(N, 3072\)") as info:
        load_local_dataset("cifar100", "test", tmp_path)
    assert str(path) in str(info.value)
    # rows of another width: 3 x 1024 bytes would have read as one image
    _pickle(path, {"data": np.zeros((3, 1024), np.uint8), "fine_labels": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"\(N, 3072\), but got uint8 \(3, 1024\)"):
        load_local_dataset("cifar100", "test", tmp_path)

    _pickle(path, {"data": np.zeros((2, 3072), np.uint8), "fine_labels": [0, 1, 2]})
    with pytest.raises(ValueError, match="one label per row") as info:
        load_local_dataset("cifar100", "test", tmp_path)
    assert str(path) in str(info.value)

    _pickle(path, {"data": np.zeros((2, 3072), np.uint8), "fine_labels": [0, 100]})
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        load_local_dataset("cifar100", "test", tmp_path)

    path.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a readable CIFAR pickle") as info:
        load_local_dataset("cifar100", "test", tmp_path)
    assert str(path) in str(info.value)


def test_svhn_file_with_wrong_contents_is_named(tmp_path):
    pytest.importorskip("scipy")
    from scipy.io import savemat

    path = tmp_path / "test_32x32.mat"
    savemat(path, {"images": np.zeros((32, 32, 3, 2), np.uint8), "y": np.ones((2, 1))})
    with pytest.raises(ValueError, match="'X' and 'y'") as info:
        load_local_dataset("svhn", "test", tmp_path)
    assert str(path) in str(info.value)

    savemat(path, {"X": np.zeros((2, 3, 32, 32), np.uint8), "y": np.ones((2, 1))})
    with pytest.raises(ValueError, match=r"\(32, 32, 3, N\)") as info:
        load_local_dataset("svhn", "test", tmp_path)
    assert str(path) in str(info.value)

    savemat(path, {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.ones((3, 1))})
    with pytest.raises(ValueError, match=r"\(2, 1\)"):
        load_local_dataset("svhn", "test", tmp_path)
    for shape in ((1, 2), (2, 1, 1)):  # one label per image, but not as a column
        savemat(path, {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.ones(shape)})
        with pytest.raises(ValueError, match=r"\(2, 1\), one label per image, but got"):
            load_local_dataset("svhn", "test", tmp_path)

    savemat(path, {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.zeros((2, 1))})
    with pytest.raises(ValueError, match=r"1\.\.10"):
        load_local_dataset("svhn", "test", tmp_path)


def test_idx_files_are_read_into_writable_arrays(tmp_path):
    """The images array was a view of an immutable bytes object: a tensor made from it warned
    of undefined behaviour, and writes went into Python's bytes."""
    import gzip
    import warnings

    header = (0x0803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (2, 3, 3))
    path = tmp_path / "images.gz"
    with gzip.open(path, "wb") as f:
        f.write(header + bytes(range(18)))
    array = datasets._read_idx(path)
    assert array.shape == (2, 3, 3) and array.flags.writeable and array[1, 2, 2] == 17
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.from_numpy(array)


def _write_idx(path: Path, array: np.ndarray, kind: int = 0x08) -> None:
    dims = b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(bytes([0, 0, kind, array.ndim]) + dims + array.tobytes())


def test_fashion_mnist_files_are_checked_and_read_with_int64_labels(tmp_path):
    """The test split's t10k files, labels as int64; a file of other than unsigned bytes, or
    images and labels of different counts, are refused naming the files."""
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 7], np.uint8))
    x, y = datasets.load_fashion_mnist("test", tmp_path)
    assert np.array_equal(x, images) and y.dtype == np.int64 and y.tolist() == [3, 7]
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 7, 1], np.uint8))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte has 2 images but .* 3 labels"):
        datasets.load_fashion_mnist("test", tmp_path)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 7], ">i4"), kind=0x0C)
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte is not an unsigned-byte IDX"):
        datasets.load_fashion_mnist("test", tmp_path)
