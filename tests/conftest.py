"""Shared fixtures: synthetic data whose inputs encode their own dataset index."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

N_CLASSES = 4


class EncodedDataset(Dataset):
    """Example i has input [i, i, ..., i] (float) and target i % N_CLASSES: any mix-up shows."""

    def __init__(self, n: int = 200, dim: int = 6) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((self.dim,), float(i)), torch.tensor(i % N_CLASSES)


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


def bn_model(dim: int = 6) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, N_CLASSES)
    )


@pytest.fixture
def dataset() -> EncodedDataset:
    return EncodedDataset()


# ------------------------------------------------------------------ mosaicml-streaming's import
PLACEHOLDERS = Path(__file__).resolve().parent / "placeholders"


def _torchvision_imports() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    code = "import torchvision"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# NOTE: tests only. `import streaming` imports torchvision (for streaming's vision datasets, which
# sbloader does not use), and PyPI's torchvision does not import against the CPU-only torch this
# project is tested with. Where streaming is installed and no working torchvision is, the tests put
# a placeholder torchvision (tests/placeholders) first on their path, and on the path of the
# processes they start (spawned ranks inherit sys.path; subprocesses get `streaming_env()`).
# sbloader itself never touches sys.modules or sys.path.
STREAMING_PATH: list[str] = []
if importlib.util.find_spec("streaming") is not None and not _torchvision_imports():
    STREAMING_PATH = [str(PLACEHOLDERS)]
    sys.path.insert(0, str(PLACEHOLDERS))


def streaming_env() -> dict[str, str]:
    """The environment for a subprocess that imports streaming and this checkout's sbloader."""
    env = dict(os.environ)
    paths = [*STREAMING_PATH, str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).strip(os.pathsep)
    return env
