"""Shared fixtures: synthetic data whose inputs encode their own dataset index."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis  # noqa: F401  (see the NOTE below)
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

# NOTE (hypothesis imported here): hypothesis's pytest plugin imports the package at the end of a
# run; under CPython 3.11.7 a run of test files that never imported it (e.g. tests/test_ffcv.py
# alone) then failed now and then after every test passed, with "SystemError: AST constructor
# recursion depth mismatch" as pytest's assertion rewriter parsed hypothesis's modules.
# Importing it while the tests are collected, as a whole-suite run always does (three test files
# use it), takes that parse out of the end of the run.

N_CLASSES = 4


class EncodedDataset(Dataset):
    """Example i has input [i, i, ..., i] (float) and target i % N_CLASSES: any mix-up shows."""

    def __init__(self, n: int = 200, dim: int = 6) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((self.dim,), float(i)), torch.tensor(i % N_CLASSES)


#: The SelectiveLoader keys of :func:`encoded_batches`' fields.
ENCODED_KEYS: dict[str, str] = {"input_key": "x", "target_key": "y", "index_key": "i"}


def encoded_batches(sizes: list[int], start: int = 0, dim: int = 6) -> list[dict[str, Any]]:
    """Dict batches of :class:`EncodedDataset`'s examples ``start, start + 1, ...`` in batches of
    the given ``sizes`` (0: an empty batch): inputs ``"x"``, targets ``"y"``, indices ``"i"``
    (a SelectiveLoader over them takes ``**ENCODED_KEYS``)."""
    out = []
    for n in sizes:
        i = torch.arange(start, start + n)
        out.append({"x": i[:, None].float().expand(n, dim).clone(), "y": i % N_CLASSES, "i": i})
        start += n
    return out


class ListedBatches:
    """A ``batch_sampler=`` of no sampler of its own: draws ``batches`` (lists of dataset
    indices) and says it has ``length`` batches of ``batch_size``, as a bucketing sampler says
    (a loader counts such a sampler's batches as full ones)."""

    def __init__(self, batches: list[list[int]], length: int, batch_size: int) -> None:
        self.batches, self.length, self.batch_size = batches, length, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return self.length


class IndexLoss(nn.Module):
    """A model whose per-example loss is a known function of the example's index.

    ``forward`` returns logits whose cross-entropy grows with ``loss_of(index)``; combined with
    :class:`EncodedDataset` this makes selection losses known in advance.
    """

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, N_CLASSES)  # a parameter so the model has a device
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        idx = x[:, 0]
        # Logit margin shrinks with index: higher index, higher cross-entropy loss.
        logits = torch.zeros(x.shape[0], N_CLASSES, device=x.device)
        target = idx.long() % N_CLASSES
        logits[torch.arange(x.shape[0], device=x.device), target] = 10.0 - idx / 100.0
        return logits + 0.0 * self.lin(x)


def expected_losses(n: int) -> np.ndarray:
    """IndexLoss's float32 cross-entropy for examples 0 .. n-1 of EncodedDataset, computed
    directly."""
    ds = EncodedDataset(n)
    x = torch.stack([ds[i][0] for i in range(n)])
    with torch.no_grad():
        return nn.functional.cross_entropy(
            IndexLoss()(x), torch.arange(n) % N_CLASSES, reduction="none"
        ).numpy()


def bn_model(dim: int = 6) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, N_CLASSES)
    )


@pytest.fixture
def dataset() -> EncodedDataset:
    return EncodedDataset()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``n`` intra-op threads inside the block (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_torch_thread() -> Any:
    """Tiny tensors: one intra-op thread is faster and immune to a busy machine (restored)."""
    with torch_threads(1):
        yield


# ------------------------------------------------------------------ mosaicml-streaming's import
PLACEHOLDERS = Path(__file__).resolve().parent / "placeholders"


def _placeholder_needed() -> bool:
    """Whether no working torchvision is installed (checked in a subprocess: a broken one fails
    its import half-way)."""
    if importlib.util.find_spec("torchvision") is None:
        return True
    code = "import torchvision"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0


def import_streaming() -> Any:
    """Import mosaicml-streaming, or skip the test where it is not installed.

    NOTE: tests only. `import streaming` imports torchvision (for streaming's vision datasets,
    which sbloader does not use), and PyPI's torchvision does not import against the CPU-only
    torch this project is tested with. Where no working torchvision is installed, streaming is
    imported with a placeholder torchvision (tests/placeholders) first on the path, and the
    placeholder is then taken off the path and out of sys.modules again, so that libraries
    imported later (torchmetrics, transformers) still find no torchvision. sbloader itself never
    touches sys.modules or sys.path.
    """
    if "streaming" in sys.modules:
        return sys.modules["streaming"]
    if importlib.util.find_spec("streaming") is None:
        pytest.skip("needs mosaicml-streaming (scripts/setup.sh installs it)")
    if not _placeholder_needed():
        return importlib.import_module("streaming")
    sys.path.insert(0, str(PLACEHOLDERS))
    try:
        return importlib.import_module("streaming")
    finally:
        sys.path.remove(str(PLACEHOLDERS))
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]


def checkout_env(*first: str) -> dict[str, str]:
    """The environment for a subprocess that must import this checkout's sbloader (and
    benchmarks), ``first`` paths before it.

    NOTE: Why every script a test starts gets this
        A script's own folder, not the working directory, heads its ``sys.path``, so without it
        ``import sbloader`` finds whatever sbloader is installed: none in a bare clone (the
        test fails for the wrong reason), or an editable install of another checkout (the test
        passes on code it was not meant to test).
    """
    env = dict(os.environ)
    paths = [*first, str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).strip(os.pathsep)
    return env


def run_python(
    code: str, *argv: str, timeout: float, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code *argv`` in a fresh interpreter that imports this checkout's sbloader
    (``env`` defaults to :func:`checkout_env`'s); its output comes back as text."""
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=checkout_env() if env is None else env,
        check=check,
    )


def streaming_env() -> dict[str, str]:
    """The environment for a subprocess that imports streaming and this checkout's sbloader
    (with the placeholder torchvision where no working one is installed)."""
    return checkout_env(*([str(PLACEHOLDERS)] if _placeholder_needed() else []))


def no_native_bf16(monkeypatch: pytest.MonkeyPatch, native: bool = False) -> None:
    """Make this process's CPU answer ``native`` to both of torch's bf16 capability queries (the
    ones sbloader.precision reads): with False, autocast="auto" alone picks float32."""
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: native, raising=False)
