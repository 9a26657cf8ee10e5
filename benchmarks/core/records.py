"""What one training run records (:class:`Run`), and saving and loading it as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arrays import arrays_path, save_arrays


@dataclass
class Run:
    """One strategy trained once: its error curve, its loader's stats and its time breakdown.

    ``points`` is the error curve: one dict per evaluation with ``position`` [epochs of data],
    ``time_s`` (training wall-clock so far, evaluation excluded) [s], ``error`` (test error)
    [1], ``backprops`` and ``selections`` (examples so far) [examples]. The first point is the
    untrained model at position 0 (error 1 by convention), at the time charged before training
    (EL2N's scoring).
    """

    strategy: str
    seed: int
    noise: float
    planned_epochs: int
    points: list[dict[str, float]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    """The loader's stats per epoch (``EpochStats.as_dict()``)."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds, summed over epochs: selection, forward, backward, data, el2n, other."""
    pre_cost: dict[str, Any] = field(default_factory=dict)
    """EL2N scoring's cost, charged before training."""
    eval_s: float = 0.0
    """Seconds spent evaluating (excluded from the wall-clock) [s]."""
    final_error: float = float("nan")
    train_s: float = 0.0
    """Training wall-clock, everything the user pays for [s]."""
    diverged: bool = False
    """Collapsed: chance-level test error at some point from epoch 1 on (see :func:`collapsed`)."""
    classes: int = 10
    interleaved: bool = False
    """Trained an epoch at a time in turn with the other runs of its seed."""
    selection_dtype: str = ""
    """The precision the loader's selection passes ran in (``loader.autocast``: ``"float32"``
    or a dtype's name; empty in runs saved before it was recorded)."""
    arrays: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    """The per-example arrays kept for the analysis (``keep_outputs``), saved next to the JSON
    as ``.npz`` (see ``arrays.py``); not in the JSON, and None when loaded."""

    def key(self) -> str:
        return run_key(self.strategy, self.seed, self.noise)


def run_key(strategy: str, seed: int, noise: float) -> str:
    """The file name (without ``.json``) of a run."""
    return f"{strategy}__s{seed}__n{noise:g}"


def collapsed(run: Run) -> bool:
    """Whether training collapsed: the test error was at chance level (within half a class of
    it) at an evaluation from the end of the first epoch on, or is not a number at the end.

    NOTE: a collapsed run can recover part of the way when the learning rate decays (measured:
    SB from the first step, 90% error for five epochs, 74% at the end), so the final error
    alone does not tell.
    """
    chance = 1 - 1.5 / run.classes
    late = [p["error"] for p in run.points if p["position"] >= 1.0 - 1e-9]
    return not math.isfinite(run.final_error) or any(e >= chance for e in late)


def save_run(run: Run, folder: Path) -> Path:
    """Write the run as ``<key>.json`` in ``folder`` (and its arrays, if kept, as ``.npz``)."""
    path = folder / f"{run.key()}.json"
    record = {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name != "arrays"}
    path.write_text(json.dumps(record))
    if run.arrays is not None:
        save_arrays(arrays_path(path), run.arrays)
    return path


def load_runs(folder: Path) -> list[Run]:
    """Every run saved in ``folder``, sorted by file name."""
    names = {f.name for f in dataclasses.fields(Run)}
    runs = []
    for f in sorted(folder.glob("*.json")):
        d = json.loads(f.read_text())
        run = Run(**{k: v for k, v in d.items() if k in names and k != "arrays"})
        run.diverged = collapsed(run)  # also for runs saved before the definition changed
        runs.append(run)
    return runs
