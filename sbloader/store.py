"""The per-example store: each example's last selection loss, when it was measured, how often it
was selected. Keyed by dataset index, backed by numba kernels, optionally memory-mapped."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import _kernels
from ._checks import check_indices, check_int
from ._state import check_identity, check_version

__all__ = ["ExampleStore"]

#: Bytes per example: float32 loss, int32 epoch, int32 selection count.
BYTES_PER_EXAMPLE = 12


class ExampleStore:
    """Per-example loss memory for Stale-SB, EL2N scores and statistics, 12 bytes per example.

    The dataset index *is* the position in each column, so indices are exact at any size (no float
    round trip, unlike an all_gather of indices cast to float). Columns:

    - ``loss`` (float32): the last finite selection loss (clipped to float32's range).
    - ``seen`` (int32): the epoch that loss was measured in, plus one; 0 if never scored.
    - ``selected`` (int32): how many times the example was chosen for backprop.

    All-zero bytes mean "never scored": a new store needs no initialisation pass, and a new
    memory-mapped file stays sparse until examples are scored. :meth:`lookup` returns NaN and
    epoch -1 for examples never scored.

    Args:
        size: the number of examples (dataset indices ``0 .. size - 1``).
        path: a folder to hold the columns as memory-mapped files (for 10^8 to 10^9 examples; the
            operating system pages them in and out, and files are created sparse). Default: in
            memory.

    Example:
        >>> import numpy as np
        >>> s = ExampleStore(10)
        >>> s.record(np.array([2, 7]), np.array([0.5, np.nan]), epoch=3)
        >>> losses, epochs = s.lookup(np.array([2, 7]))
        >>> losses.tolist(), epochs.tolist()
        ([0.5, nan], [3, -1])
    """

    VERSION = 1

    def __init__(self, size: int, path: str | os.PathLike | None = None) -> None:
        self.size = check_int("size", size, minimum=0)
        self.path = None if path is None else Path(path)
        #: Whether a column file already existed, of the right size, and was opened with its
        #: contents (an earlier store's): see :meth:`clear`.
        self.reopened = False
        if self.path is None:
            # np.zeros maps zeroed pages lazily: untouched examples cost no resident memory.
            self.loss = np.zeros(self.size, dtype=np.float32)
            self.seen = np.zeros(self.size, dtype=np.int32)
            self.selected = np.zeros(self.size, dtype=np.int32)
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self._open_columns(fresh=False)

    def _open_columns(self, fresh: bool) -> None:
        self.loss = self._memmap("loss", np.float32, fresh)
        self.seen = self._memmap("seen", np.int32, fresh)
        self.selected = self._memmap("selected", np.int32, fresh)

    def _memmap(self, name: str, dtype: type, fresh: bool) -> np.ndarray:
        """A column file of zeros (created sparse), or the existing one of the right size (unless
        ``fresh``: then it is truncated and made again, sparse)."""
        assert self.path is not None
        if self.size == 0:
            return np.zeros(0, dtype=dtype)
        file = self.path / f"{name}.{np.dtype(dtype).name}"
        if not fresh:
            fresh = not file.exists() or file.stat().st_size != self.size * np.dtype(dtype).itemsize
            self.reopened |= not fresh
        return np.memmap(file, dtype=dtype, mode="w+" if fresh else "r+", shape=(self.size,))

    def clear(self) -> None:
        """Forget every example: all losses never scored, all counts 0.

        NOTE: a memory-mapped store's files are truncated and made again (sparse, so clearing
        costs no writes however large the store); in memory the columns are zeroed.

        Example:
            >>> import numpy as np
            >>> s = ExampleStore(3)
            >>> s.record(np.array([1]), np.array([0.5]), epoch=0)
            >>> s.clear()
            >>> s.lookup(np.array([1]))[1].tolist()
            [-1]
        """
        if self.path is None:
            for col in (self.loss, self.seen, self.selected):
                col[:] = 0
            return
        self.flush()
        del self.loss, self.seen, self.selected  # unmapped before their files are truncated
        self._open_columns(fresh=True)
        self.reopened = False

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Bytes held by the three columns (12 per example)."""
        return self.loss.nbytes + self.seen.nbytes + self.selected.nbytes

    @staticmethod
    def _indices(indices: np.ndarray) -> np.ndarray:
        return check_indices("indices", indices)

    @property
    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ``(loss, seen, selected)`` columns, for the kernels that update them."""
        return self.loss, self.seen, self.selected

    def check_outside(self, outside: int, indices: np.ndarray) -> None:
        """Raise ``IndexError`` naming some of ``indices`` if ``outside`` of them are outside."""
        if outside:
            bad = indices[(indices < 0) | (indices >= self.size)][:5].tolist()
            raise IndexError(
                f"{outside} dataset indices are outside the store of size {self.size} (e.g. "
                f"{bad}); build the store with size=len(dataset)"
            )

    def record(self, indices: np.ndarray, losses: np.ndarray, epoch: int) -> None:
        """Store each finite loss for its index, measured in ``epoch`` (non-finite: kept as was).

        ``epoch`` must be >= 0: the ``seen`` column holds it plus one, and 0 there means "never
        scored".
        """
        epoch = check_int("epoch", epoch, minimum=0)
        idx = self._indices(indices)
        values = np.ascontiguousarray(losses, dtype=np.float64).reshape(-1)
        if values.shape != idx.shape:
            raise ValueError(f"got {idx.shape[0]} indices but {values.shape[0]} losses")
        out = _kernels.store_record(self.loss, self.seen, idx, values, epoch)
        self.check_outside(out, idx)

    def lookup(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored loss (float64, NaN if never scored) and epoch (-1 if never) of each index."""
        idx = self._indices(indices)
        losses = np.empty(idx.shape[0], dtype=np.float64)
        epochs = np.empty(idx.shape[0], dtype=np.int64)
        out = _kernels.store_lookup(self.loss, self.seen, idx, losses, epochs)
        self.check_outside(out, idx)
        return losses, epochs

    def spread_sample(self, count: int) -> np.ndarray:
        """The stored losses of ``count`` examples spread evenly over the indices (index
        ``floor((j + 1/2) * size / count)`` for j < count; every example if ``size <= count``),
        in index order, leaving out those never scored. Deterministic: every rank holding the
        same store gets the same sample.

        Example:
            >>> import numpy as np
            >>> s = ExampleStore(10)
            >>> s.record(np.arange(10), np.arange(10.0), epoch=0)
            >>> s.spread_sample(4).tolist()
            [1.0, 3.0, 6.0, 8.0]
        """
        losses, epochs = self.spread_lookup(count)
        return losses[epochs >= 0]

    def spread_lookup(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The stored losses and epochs (as :meth:`lookup`) of ``count`` examples spread evenly
        over the indices as in :meth:`spread_sample`, those never scored included (epoch -1)."""
        count = check_int("count", count, minimum=1)
        if self.size <= count:
            idx = np.arange(self.size, dtype=np.int64)
        else:
            idx = ((np.arange(count, dtype=np.int64) * 2 + 1) * self.size) // (2 * count)
        return self.lookup(idx)

    def count_selected(self, indices: np.ndarray) -> None:
        """Count one selection for each index (an index repeated is counted again)."""
        idx = self._indices(indices)
        self.check_outside(_kernels.store_count(self.selected, idx), idx)

    def flush(self) -> None:
        """Write memory-mapped columns to disk (no-op in memory)."""
        for col in (self.loss, self.seen, self.selected):
            if isinstance(col, np.memmap):
                col.flush()

    def state_dict(self) -> dict[str, Any]:
        """The columns (copies for in-memory stores; flushed file paths for memory-mapped ones).

        Columns are CPU tensors, so that a checkpoint holding them loads with ``torch.load``'s
        default ``weights_only=True`` (numpy arrays would be refused).
        """
        if self.path is not None:
            self.flush()
            return {"version": self.VERSION, "size": self.size, "path": str(self.path)}
        return {
            "version": self.VERSION,
            "size": self.size,
            "loss": torch.from_numpy(self.loss.copy()),
            "seen": torch.from_numpy(self.seen.copy()),
            "selected": torch.from_numpy(self.selected.copy()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = check_version(state, "ExampleStore", self.VERSION)
        check_identity(
            "ExampleStore",
            {"size": int(state["size"])},
            {"size": self.size},
            "build it for the same dataset",
        )
        if "path" in state:
            if self.path is None or Path(state["path"]).resolve() != self.path.resolve():
                raise ValueError(
                    f"the saved store is memory-mapped at {state['path']}; build the store with "
                    "path= that folder"
                )
            return  # the files are the state
        self.loss[:] = state["loss"]
        self.seen[:] = state["seen"]
        self.selected[:] = state["selected"]
