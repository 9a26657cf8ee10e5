"""Device synchronisation, autocast, the training step's timer, and medians over timed rounds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any, cast

import numpy as np
import torch

from .config import Config


def median(values: Iterable[float]) -> float:
    """The median, as a float: what repeated timings report."""
    return float(np.median(list(values)))


def sync(device: torch.device | str) -> None:
    """Wait for the GPU's queued work, so that a timer read next includes it (CPU: nothing)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_autocast(cfg: Config) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast for training forwards when ``cfg.train_bf16``, else nothing."""
    if cfg.train_bf16:
        return torch.autocast(cfg.resolved_device().type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class StepTimer:
    """Seconds in training forwards and in backwards (with the optimizer step), from three marks
    per step: before the forward, after the loss, after the optimizer step.

    On the CPU, wall-clock between marks. On a GPU, CUDA events read when the totals are asked
    for, so that timing never forces a synchronisation that would change the wall-clock measured;
    with ``synchronise=True`` instead, each mark first waits for the GPU (so that each phase
    holds its own GPU work, at the price of some CPU/GPU overlap: breakdown.py's choice).
    """

    def __init__(self, device: torch.device | str, synchronise: bool = False) -> None:
        self.device = torch.device(device)
        self.synchronise = synchronise
        self.events = self.device.type == "cuda" and not synchronise
        self.forward = self.backward = 0.0
        self._marks: list[Any] = []
        self._pending: list[list[Any]] = []

    def mark(self) -> None:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            if self.synchronise:
                sync(self.device)
            self._marks.append(time.perf_counter())
        if len(self._marks) == 3:
            self._pending.append(self._marks)
            self._marks = []
            if not self.events:
                self._settle()

    def _settle(self) -> None:
        for a, b, c in self._pending:
            if self.events:
                self.forward += a.elapsed_time(b) / 1000
                self.backward += b.elapsed_time(c) / 1000
            else:
                self.forward += b - a
                self.backward += c - b
        self._pending = []

    def totals(self) -> tuple[float, float]:
        """(forward seconds, backward seconds) so far."""
        if self.events and self._pending:
            torch.cuda.synchronize()
            self._settle()
        return self.forward, self.backward


def rounds_summary(
    rows: list[dict[str, Any]], by: tuple[str, ...] = ("way",), ratio: str = "ratio"
) -> list[dict[str, Any]]:
    """Per group of rows with the same values of ``by``, the medians over rounds of each number;
    where the rows have ``ratio`` and ``bound``: ``epoch_over_bound`` (the median of ratio /
    bound), ``within_rounds`` (in how many rounds the epoch was within its bound) and
    ``within_bound`` (that median is at most 1)."""
    out = []
    for group in dict.fromkeys(tuple(r[k] for k in by) for r in rows):
        rs = [r for r in rows if tuple(r[k] for k in by) == group]
        row: dict[str, Any] = {**dict(zip(by, group, strict=True)), "rounds": len(rs)}
        for key in rs[0]:
            values = [r.get(key) for r in rs]
            if key not in (*by, "round") and all(isinstance(v, (int, float)) for v in values):
                row[key] = median(cast(list[float], values))  # all numbers: checked above
        if ratio in row and "bound" in row:
            over = [r[ratio] / r["bound"] for r in rs]
            row["epoch_over_bound"] = median(over)
            row["within_rounds"] = sum(v <= 1 for v in over)
            row["within_bound"] = row["epoch_over_bound"] <= 1
        out.append(row)
    return out


def cell(row: dict[str, Any], key: str, fmt: str = ".3f") -> str:
    """A table cell: ``row[key]`` formatted, or empty where the row lacks it."""
    v = row.get(key)
    return "" if v is None else format(v, fmt)
