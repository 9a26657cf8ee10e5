"""EL2N scores of several architectures for the per-example analysis (the Diet-SB poster's
question: do two architectures prune the same examples?), computed once per seed and saved as
``scores/el2n_<model>__s<seed>.npz`` in a benchmark's folder."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

import sbloader
from sbloader.datasets import ArrayDataset

from .config import Config
from .data import shuffled
from .models import make_model, make_optimizer
from .train import Data


def el2n_path(folder: Path, model: str, seed: int) -> Path:
    """Where the EL2N scores of ``model`` for ``seed`` live in a benchmark's folder."""
    return folder / "scores" / f"el2n_{model}__s{seed}.npz"


def compute_el2n(cfg: Config, data: Data, seed: int, model: str) -> sbloader.EL2NResult:
    """EL2N scores of ``model`` on the (clean) training set: ``cfg.el2n_models`` copies trained
    ``cfg.el2n_epochs`` epochs each with the benchmark's optimizer and batch size."""
    x_train, y_train, _, _ = data
    arch = dataclasses.replace(cfg, model=model)
    device = cfg.resolved_device()
    classes, channels = int(y_train.max()) + 1, x_train.shape[1]
    dataset = ArrayDataset(x_train.to(device), y_train.to(device))
    return sbloader.el2n_scores(
        functools.partial(make_model, arch, classes, channels),
        shuffled(dataset, cfg.batch_size, seed, cfg.array_collate),
        make_optimizer=functools.partial(make_optimizer, arch),
        models=cfg.el2n_models,
        epochs=cfg.el2n_epochs,
        seed=1000 + seed,
        device=device,
    )


def save_el2n(path: Path, result: sbloader.EL2NResult) -> Path:
    """Write the scores and their cost as a compressed ``.npz``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez_compressed(
            f,
            scores=result.scores.astype(np.float32),
            seconds=np.array(result.seconds),
            models=np.array(result.models),
            epochs=np.array(result.epochs),
        )
    return path


def load_el2n(path: Path) -> np.ndarray:
    """The EL2N scores saved at ``path`` (float64, one per training example)."""
    with np.load(path, allow_pickle=False) as f:
        return f["scores"].astype(np.float64)
