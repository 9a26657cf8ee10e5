"""What a run keeps for the per-example analysis: collected while it trains, saved next to its
JSON as a compressed ``runs/<run>.npz``, loaded back so that ``benchmarks/analysis.py`` runs
after the fact without retraining.

The arrays (``T`` test examples, ``C`` classes, ``E`` evaluations, ``N`` training examples):

- ``eval_position`` (E,) float64 and ``eval_time_s`` (E,) float64: where and when each kept
  evaluation was made (epochs of data; training wall-clock so far, as in the run's curve);
- ``eval_confidence`` (E, T) float16: each test example's target confidence (softmax at its true
  class) at each evaluation, and ``eval_predicted`` (E, T) int16 the predicted class;
- ``test_logits`` (T, C) float32 and ``test_targets`` (T,) int64: the final model's outputs;
- ``selected`` (epochs, N) uint8: how often each example was yielded for backprop in each epoch
  (examples carried over an epoch's end count in the epoch that yields them);
- ``seen`` (N,) int32: the epochs in which each example was a candidate (all of them, or those
  of the run's EL2N subset);
- ``last_loss`` (N,) float32: the selection loss of each example when it was last yielded (NaN:
  never yielded after a selection pass);
- ``train_loss`` (N,) float32: the final model's loss on each training example, on the labels it
  trained on (eval mode; like evaluation, not charged to the wall-clock);
- ``labels`` (N,) int64: those labels; ``flipped`` (F,) int64: the indices whose label was
  flipped on purpose;
- ``store_loss``, ``store_epoch``, ``store_selected`` (N,): the policy's per-example store
  (:class:`sbloader.ExampleStore`: last selection loss, the epoch it was measured in, -1 if never,
  and times selected), for policies that keep one (Stale-SB).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import sbloader
from sbloader.recipes import eval_batch_size
from sbloader.selection import eval_mode

FORMAT = 1
"""The arrays' format version, saved with them (``format``)."""
KEYS = (
    "eval_position",
    "eval_time_s",
    "eval_confidence",
    "eval_predicted",
    "test_logits",
    "test_targets",
    "selected",
    "seen",
    "last_loss",
    "train_loss",
    "labels",
    "flipped",
)
"""Every run's arrays (the store's columns only where the policy keeps a store)."""


@torch.inference_mode()
def predict(
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    batch_size: int | None = None,
    memory_format: torch.memory_format | None = torch.channels_last,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """The model's float32 outputs for ``inputs`` in eval mode, on the CPU (every module's
    training flag restored), evaluated as :func:`sbloader.recipes.error_rate` evaluates."""
    device = next(model.parameters()).device
    batch_size = eval_batch_size(device) if batch_size is None else batch_size
    amp = (
        torch.autocast(device.type, dtype=autocast)
        if autocast is not None
        else contextlib.nullcontext()
    )
    out = []
    with eval_mode(model), amp:
        for i in range(0, len(inputs), batch_size):
            x = inputs[i : i + batch_size].to(device, non_blocking=True)
            if memory_format is not None and x.dim() == 4:
                x = x.contiguous(memory_format=memory_format)
            out.append(model(x).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0)


def policy_store(policy: sbloader.Policy) -> sbloader.ExampleStore | None:
    """The per-example store of a policy (inside a ``Phased`` one too), or None."""
    if isinstance(policy, sbloader.Phased):
        return policy_store(policy.policy)
    if isinstance(policy, sbloader.SelectiveBackprop):
        return policy.store
    return None


class Keeper:
    """Collects one run's arrays (see the module docstring) as it trains.

    Args:
        labels: the training labels the run trains on (after any flipping).
        flipped: the indices whose label was flipped.
        epochs: the run's planned epochs.
        subset: the dataset indices the loader draws from (None: all).
    """

    def __init__(
        self,
        labels: torch.Tensor,
        flipped: np.ndarray,
        epochs: int,
        subset: np.ndarray | None = None,
    ) -> None:
        n = len(labels)
        self.labels = labels.detach().cpu().numpy().astype(np.int64)
        self.flipped = np.asarray(flipped, dtype=np.int64)
        self.selected = np.zeros((epochs, n), dtype=np.uint8)
        self.last_loss = np.full(n, np.nan, dtype=np.float32)
        per_epoch = np.ones(n, dtype=np.int32)
        if subset is not None:
            per_epoch[:] = 0
            per_epoch[np.asarray(subset, dtype=np.int64)] = 1
        self.seen = per_epoch * epochs
        self.positions: list[float] = []
        self.times: list[float] = []
        self.confidence: list[np.ndarray] = []
        self.predicted: list[np.ndarray] = []
        self.logits: torch.Tensor | None = None
        self.targets: np.ndarray | None = None

    def batch(self, epoch: int, indices: Any, losses: Any) -> None:
        """Count one yielded batch (its dataset indices and selection losses) in ``epoch``."""
        idx = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices)
        np.add.at(self.selected[epoch], idx, 1)  # Kath18 may yield an example twice
        loss = losses.detach().float().cpu().numpy()
        measured = ~np.isnan(loss)
        self.last_loss[idx[measured]] = loss[measured]

    def evaluation(
        self, position: float, time_s: float, logits: torch.Tensor, targets: torch.Tensor
    ) -> float:
        """Keep one evaluation's test outputs; returns the test error."""
        y = targets.detach().cpu()
        probs = torch.softmax(logits.double(), dim=1)
        predicted = logits.argmax(1)
        self.positions.append(position)
        self.times.append(time_s)
        self.confidence.append(probs[torch.arange(len(y)), y].numpy().astype(np.float16))
        self.predicted.append(predicted.numpy().astype(np.int16))
        self.logits, self.targets = logits, y.numpy().astype(np.int64)
        return float((predicted != y).double().mean()) if len(y) else float("nan")

    def finish(
        self, model: nn.Module, train_inputs: torch.Tensor, policy: sbloader.Policy, **kw: Any
    ) -> dict[str, np.ndarray]:
        """The run's arrays, with the final model's loss on every training example (``kw`` go
        to :func:`predict`)."""
        if self.logits is None or self.targets is None:
            raise RuntimeError("the run kept no evaluation; evaluate it at least once")
        out = predict(model, train_inputs, **kw)
        train_loss = F.cross_entropy(out, torch.from_numpy(self.labels), reduction="none")
        arrays = dict(
            eval_position=np.array(self.positions, dtype=np.float64),
            eval_time_s=np.array(self.times, dtype=np.float64),
            eval_confidence=np.stack(self.confidence),
            eval_predicted=np.stack(self.predicted),
            test_logits=self.logits.numpy().astype(np.float32),
            test_targets=self.targets,
            selected=self.selected,
            seen=self.seen,
            last_loss=self.last_loss,
            train_loss=train_loss.numpy().astype(np.float32),
            labels=self.labels,
            flipped=self.flipped,
        )
        store = policy_store(policy)
        if store is not None:
            losses, epochs = store.lookup(np.arange(len(store), dtype=np.int64))
            arrays.update(
                store_loss=losses.astype(np.float32),
                store_epoch=epochs.astype(np.int32),
                store_selected=np.array(store.selected, dtype=np.int32),
            )
        return arrays


def arrays_path(json_path: Path) -> Path:
    """Where the arrays of the run saved as ``json_path`` live: next to it, as ``.npz``."""
    return json_path.with_suffix(".npz")


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """Write ``arrays`` (and the format version) as one compressed ``.npz``."""
    missing = [k for k in KEYS if k not in arrays]
    if missing:
        raise ValueError(f"a run's arrays need {list(KEYS)}, but {missing} are missing")
    with open(path, "wb") as f:
        # numpy's stub lets ``**arrays`` fill ``allow_pickle: bool``; its keys are array names.
        np.savez_compressed(f, format=np.array(FORMAT), **arrays)  # type: ignore[arg-type]
    return path


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays saved at ``path`` by :func:`save_arrays`, checked for format and keys."""
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    version = int(arrays.pop("format", -1))
    if version != FORMAT:
        raise ValueError(
            f"{path} holds arrays of format {version}, but this analysis reads format {FORMAT}; "
            "re-run the benchmark with keep_outputs (the analysis preset)"
        )
    missing = [k for k in KEYS if k not in arrays]
    if missing:
        raise ValueError(f"{path} lacks the arrays {missing}; it was not written by save_arrays")
    return arrays
