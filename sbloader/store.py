"""The per-example store: each example's last selection loss, when it was measured, how often it
was selected. Keyed by dataset index, backed by numba kernels, optionally memory-mapped (with
a snapshot of its files for each saved state, so that a resume is exact)."""

from __future__ import annotations

import copy
import os
import shutil
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import _kernels
from ._checks import check_indices, check_int
from ._files import claim_newest, copy_sparse, hold_folder, sync_folder
from ._state import check_identity, check_version, taking_rollback, taking_unsaved

__all__ = ["ExampleStore"]

#: Bytes per example: float32 loss, int32 epoch, int32 selection count.
BYTES_PER_EXAMPLE = 12
#: The columns' names and dtypes, in the order of :attr:`ExampleStore.columns`.
COLUMNS = (("loss", np.float32), ("seen", np.int32), ("selected", np.int32))
#: The folder, inside a memory-mapped store's, that holds its snapshots.
SNAPSHOTS = "snapshots"


class _Closed:
    """What a closed store holds instead of a pending restore: every use of its columns raises."""


def _no_release() -> None:
    return None


def _always() -> bool:
    return True


def _column_file(folder: Path, name: str, dtype: type) -> Path:
    """A column's file in a store's folder or in one of its snapshots: ``loss.float32``."""
    return folder / f"{name}.{np.dtype(dtype).name}"


def _sequence(name: str) -> int:
    """The sequence number a snapshot's folder name starts with (also an unfinished one's,
    ``.tmp-`` first), or 0 for any other name."""
    head = name.removeprefix(".tmp-").split("-", 1)[0]
    return int(head) if head.isdigit() else 0


#: Entries of ``seen`` read at a time by :func:`spread_scored`.
_SPREAD_CHUNK = 1 << 22


def spread_scored(seen: np.ndarray, count: int) -> np.ndarray:
    """The int64 indices of ``count`` scored examples (``seen != 0``) spread evenly over them,
    in index order: the ``floor((j + 1/2) * scored / count)``-th scored one for j < count, or
    every scored one where there are at most ``count``.

    NOTE: spread over the scored examples, not over all indices: a ``subset`` (a pruned one,
    every other example) leaves the others never scored, and an even spread over all indices
    held fewer stored losses than ``count``, or none where its stride met only examples outside
    the subset. Read in chunks with NumPy (counted, then only the chunks holding a pick
    searched): O(size) at C speed with or without numba's JIT and no temporary of the store's
    size (a memory-mapped store of 2^31 examples: a per-element loop ran for minutes as plain
    Python).

    Example:
        >>> spread_scored(np.array([0, 1, 0, 1, 1, 0, 1], dtype=np.int32), 2).tolist()
        [3, 6]
    """
    n = int(seen.shape[0])
    starts = range(0, n, _SPREAD_CHUNK)
    counts = [int(np.count_nonzero(seen[a : a + _SPREAD_CHUNK])) for a in starts]
    scored = sum(counts)
    if scored <= count:
        targets = np.arange(scored, dtype=np.int64)
    else:
        targets = ((2 * np.arange(count, dtype=np.int64) + 1) * scored) // (2 * count)
    picked, below, t = [], 0, 0
    for a, c in zip(starts, counts):
        end = int(np.searchsorted(targets, below + c, side="left"))
        if end > t:
            found = np.flatnonzero(seen[a : a + _SPREAD_CHUNK]).astype(np.int64) + a
            picked.append(found[targets[t:end] - below])
            t = end
        below += c
    return np.concatenate(picked) if picked else np.empty(0, dtype=np.int64)


class ExampleStore:
    """Per-example loss memory for Stale-SB, EL2N scores and statistics, 12 bytes per example.

    The dataset index *is* the position in each column, so indices are exact at any size (no float
    round trip, unlike an all_gather of indices cast to float). Columns:

    - ``loss`` (float32): the last finite selection loss (clipped to float32's range); NaN or
      +inf for one scored non-finite and left out or kept then (:meth:`mark_nonfinite`).
    - ``seen`` (int32): the epoch that loss was measured in, plus one; 0 if never scored.
    - ``selected`` (int32): how many times the example was chosen for backprop.

    All-zero bytes mean "never scored": a new store needs no initialisation pass, and a new
    memory-mapped file stays sparse until examples are scored. :meth:`lookup` returns NaN and
    epoch -1 for examples never scored.

    Args:
        size: the number of examples (dataset indices ``0 .. size - 1``).
        path: a folder to hold the columns as memory-mapped files (for 10^8 to 10^9 examples; the
            operating system pages them in and out, and files are created sparse), held by this
            process while the store lives or until :meth:`close` (another process's store
            there is refused: give each rank its own folder). Default: in memory. A copy of
            such a store (``copy.deepcopy``, pickle) is an in-memory store.
        keep_snapshots: a memory-mapped store's :meth:`state_dict` copies its files into a
            snapshot (``path/snapshots/``, sparse where they are); the snapshots of this
            store's newest ``keep_snapshots`` states are kept, older ones (also those an earlier
            process left there) removed; None keeps every one (as many as the checkpoints you
            keep, each the size of the scored examples' columns). A state whose snapshot is gone
            is refused when loaded.

    NOTE (why snapshots): the files of a memory-mapped store change after a state is saved (the
    run goes on), so a state that only named them would resume from the losses and counts
    recorded up to the interruption, not those at the checkpoint. Copying the files when a state
    is saved costs what an in-memory store's state costs (its columns copied into the state),
    and makes a resume exact either way.

    Example:
        >>> import numpy as np
        >>> s = ExampleStore(10)
        >>> s.record(np.array([2, 7]), np.array([0.5, np.nan]), epoch=3)
        >>> losses, epochs = s.lookup(np.array([2, 7]))
        >>> losses.tolist(), epochs.tolist()
        ([0.5, nan], [3, -1])
    """

    VERSION = 2

    def __init__(
        self, size: int, path: str | os.PathLike | None = None, keep_snapshots: int | None = 2
    ) -> None:
        self.size = check_int("size", size, minimum=0)
        self.path = None if path is None else Path(path)
        self.keep_snapshots = (
            None
            if keep_snapshots is None
            else check_int("keep_snapshots", keep_snapshots, minimum=1)
        )
        # A loaded state not yet applied to the files (a memory-mapped store's): its snapshot,
        # or the columns of an in-memory store's state; applied at the columns' next use (see
        # load_state_dict), under a lock, once, whichever thread gets there.
        self._restore: Path | tuple[np.ndarray, ...] | _Closed | None = None
        self._restore_lock = threading.Lock()
        # Lets go of the folder (see close); called by itself when the store is collected.
        self._release: Callable[[], Any] = _no_release
        # Whether this is still the newest store of its folder in this process (see _files).
        self._newest: Callable[[], bool] = _always
        # This store's snapshots, oldest first, and how many it has written (see state_dict).
        self._written: list[Path] = []
        self._count = 0
        # Snapshots written within unsaved_states() and saved by no checkpoint yet (see
        # keep_spared), each with whether a load of its state was applied since: they take none
        # of keep_snapshots' places, and go at the next snapshot once loaded (NOTE (spared)).
        self._spared: dict[Path, bool] = {}
        # Uses of the columns that may have changed them, and this count when the last state
        # was taken with what it holds (its snapshot, or weak references to its columns' copies):
        # a state taken within unsaved_states() shares those where the count is the same.
        self._uses = 0
        self._last_state: tuple[int, Path | tuple[weakref.ref[torch.Tensor], ...]] | None = None
        #: Whether a column file already existed, of the right size, and was opened with its
        #: contents (an earlier store's): see :meth:`clear`.
        self.reopened = False
        if self.path is None:
            # np.zeros maps zeroed pages lazily: untouched examples cost no resident memory.
            self._loss = np.zeros(self.size, dtype=np.float32)
            self._seen = np.zeros(self.size, dtype=np.int32)
            self._selected = np.zeros(self.size, dtype=np.int32)
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self._release = hold_folder(self, self.path, self.size)
            self._newest = claim_newest(self.path)
            try:
                self._open_columns(fresh=False)
            except BaseException:
                self._release()
                raise

    def close(self) -> None:
        """Let go of a memory-mapped store's folder: its files are flushed and unmapped, and the
        folder is free for another store (of another size, or another process's). A restore
        still pending (a state loaded and not used yet) is dropped. The store cannot be used
        after; closing again, or an in-memory store, does nothing.

        Example:
            >>> import tempfile
            >>> folder = tempfile.mkdtemp()
            >>> s = ExampleStore(10, path=folder)
            >>> s.close()
            >>> len(ExampleStore(20, path=folder))  # another size: free once the first is closed
            20
        """
        if self.path is None or isinstance(self._restore, _Closed):
            return
        with self._restore_lock:
            self._restore = _Closed()
            self.flush()
            self._loss = np.zeros(0, dtype=np.float32)
            self._seen = np.zeros(0, dtype=np.int32)
            self._selected = np.zeros(0, dtype=np.int32)
        self._release()

    # NOTE (copies): a copy (copy.copy, copy.deepcopy, pickle) of a memory-mapped store is an
    # in-memory store holding its columns: two stores writing one folder is what the folder's
    # hold forbids, and a copy taken to compare counts later (the analysis functions'
    # ``before=``) must not change as the run goes on.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_restore_lock"], state["_release"], state["_newest"]
        state["_last_state"] = None  # (weak references, and a snapshot that is not the copy's)
        if self.path is not None:
            loss, seen, selected = (np.array(c) for c in self.columns)
            state.update(path=None, _loss=loss, _seen=seen, _selected=selected, _restore=None)
            state.update(_written=[], _spared={}, reopened=False)
        return state

    def __copy__(self) -> ExampleStore:
        # A shallow copy shared the in-memory columns: it followed the run (a copy taken to
        # compare counts later changed with it), and its writes went uncounted by the original
        # (see state_dict's NOTE (uses)). A copy is a copy of the columns, as deepcopy's is.
        return copy.deepcopy(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._restore_lock = threading.Lock()
        self._release = _no_release
        self._newest = _always

    def _open_columns(self, fresh: bool) -> None:
        self._loss = self._memmap("loss", np.float32, fresh)
        self._seen = self._memmap("seen", np.int32, fresh)
        self._selected = self._memmap("selected", np.int32, fresh)

    def _file(self, name: str, dtype: type) -> Path:
        assert self.path is not None
        return _column_file(self.path, name, dtype)

    # NOTE (columns as properties): a loaded state's snapshot is applied at the columns' first
    # use after the load, not in load_state_dict itself, so that a load the loader refuses
    # after the policy's part (all or nothing: see SelectiveLoader.load_state_dict) leaves the
    # files untouched; its rollback cancels the restore.
    # NOTE (every use checked): each use of a column refuses a store whose folder a newer store
    # of this process has taken (see _check_newest), reads and writes alike: only the kernels'
    # columns were checked, so an older run still wrote its reported losses into the newer
    # one's files (record) and saved states that were snapshots of them (state_dict), pruning
    # the newer run's own snapshots.
    @property
    def loss(self) -> np.ndarray:
        """Each example's last finite selection loss (float32)."""
        self._uses += 1
        return self._current()[0]

    @property
    def seen(self) -> np.ndarray:
        """The epoch each loss was measured in, plus one (int32; 0: never scored)."""
        self._uses += 1
        return self._current()[1]

    @property
    def selected(self) -> np.ndarray:
        """How many times each example was chosen for backprop (int32)."""
        self._uses += 1
        return self._current()[2]

    def _current(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The columns, a loaded state applied first, without counting a use (see _uses)."""
        self._check_open()
        if self._restore is not None:
            self._apply_restore()
        return self._loss, self._seen, self._selected

    def _memmap(self, name: str, dtype: type, fresh: bool) -> np.ndarray:
        """A column file of zeros (created sparse), or the existing one of the right size (unless
        ``fresh``: then it is truncated and made again, sparse)."""
        assert self.path is not None
        if self.size == 0:
            return np.zeros(0, dtype=dtype)
        file = self._file(name, dtype)
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
        self._check_open()
        self._uses += 1
        self._restore = None  # (a restore not applied yet: cleared all the same)
        if self.path is None:
            for col in (self._loss, self._seen, self._selected):
                col[:] = 0
            return
        self.flush()
        del self._loss, self._seen, self._selected  # unmapped before their files are truncated
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

    def _check_newest(self) -> None:
        """Refuse use by a memory-mapped store whose folder a newer store of this process has
        taken since (see ``_files.claim_newest``)."""
        if not self._newest():
            raise ValueError(
                f"the store folder {self.path} was taken by a newer store in this process "
                "(another loader or policy given the same store_path): both would write the "
                "same files, each run's losses overwriting the other's; give each run its own "
                "store_path (or close() the store of the run that is over)"
            )

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
        scored". An index outside the store raises ``IndexError``, and nothing is stored.
        """
        epoch = check_int("epoch", epoch, minimum=0)
        idx = self._indices(indices)
        values = np.ascontiguousarray(losses, dtype=np.float64).reshape(-1)
        if values.shape != idx.shape:
            raise ValueError(f"got {idx.shape[0]} indices but {values.shape[0]} losses")
        out = _kernels.store_record(self.loss, self.seen, idx, values, epoch)
        self.check_outside(out, idx)

    def mark_nonfinite(self, indices: np.ndarray, epoch: int, kept: bool = False) -> None:
        """Record that each index's selection loss, measured in ``epoch``, was not finite: its
        stored loss becomes NaN (left out: a stale epoch keeps it with P = 0) or, with ``kept``,
        +inf (kept anyway, ``nonfinite="select"``: a stale epoch keeps it with P = 1), scored
        in ``epoch`` (not "never scored"; a finite stored loss measured before is dropped). A
        later finite loss replaces it.

        NOTE (kept): +inf is never a finite loss's stored value (those are clipped to float32's
        range), so it tells a kept non-finite loss apart. Under "select" the store kept the
        loss measured in an earlier pass, and the stale epochs decided from that one (a low
        loss: never kept), where README says they keep the example, as its pass did.

        Example:
            >>> s = ExampleStore(4)
            >>> s.mark_nonfinite(np.array([2]), epoch=0)
            >>> s.mark_nonfinite(np.array([3]), epoch=0, kept=True)
            >>> s.lookup(np.array([1, 2, 3]))
            (array([nan, nan, inf]), array([-1,  0,  0]))
        """
        epoch = check_int("epoch", epoch, minimum=0)
        idx = self._indices(indices)
        self.check_outside(int(np.count_nonzero((idx < 0) | (idx >= self.size))), idx)
        loss, seen = self.loss, self.seen
        loss[idx] = np.inf if kept else np.nan
        seen[idx] = epoch + 1

    def lookup(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored loss (float64, NaN if never scored) and epoch (-1 if never) of each index."""
        idx = self._indices(indices)
        losses = np.empty(idx.shape[0], dtype=np.float64)
        epochs = np.empty(idx.shape[0], dtype=np.int64)
        out = _kernels.store_lookup(self.loss, self.seen, idx, losses, epochs)
        self.check_outside(out, idx)
        return losses, epochs

    def spread_sample(self, count: int) -> np.ndarray:
        """The stored losses of ``count`` scored examples spread evenly over them (the
        ``floor((j + 1/2) * scored / count)``-th scored one in index order, for j < count; every
        scored example if there are at most ``count``), in index order. Deterministic: every
        rank holding the same store gets the same sample. Examples never scored (outside a
        loader's ``subset``) are not sampled, so a sample holds ``count`` losses wherever at
        least ``count`` examples were scored (one marked non-finite holds NaN).

        Example:
            >>> import numpy as np
            >>> s = ExampleStore(10)
            >>> s.record(np.arange(10), np.arange(10.0), epoch=0)
            >>> s.spread_sample(4).tolist()
            [1.0, 3.0, 6.0, 8.0]
            >>> half = ExampleStore(10)
            >>> half.record(np.arange(1, 10, 2), np.arange(5.0), epoch=0)  # odd indices only
            >>> half.spread_sample(2).tolist()
            [1.0, 3.0]
        """
        return self.spread_lookup(count)[0]

    def spread_lookup(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The stored losses and epochs (as :meth:`lookup`) of the ``count`` scored examples of
        :meth:`spread_sample` (fewer where fewer were scored)."""
        count = check_int("count", count, minimum=1)
        return self.lookup(spread_scored(self.seen, count))

    def count_selected(self, indices: np.ndarray) -> None:
        """Count one selection for each index (an index repeated is counted again); an index
        outside the store raises ``IndexError``, and nothing is counted."""
        idx = self._indices(indices)
        self.check_outside(_kernels.store_count(self.selected, idx), idx)

    def flush(self) -> None:
        """Write memory-mapped columns to disk (no-op in memory)."""
        for col in (self._loss, self._seen, self._selected):
            if isinstance(col, np.memmap):
                col.flush()

    def state_dict(self) -> dict[str, Any]:
        """The columns: copies for an in-memory store; for a memory-mapped one, the name of a
        snapshot of its files written now (see the class's NOTE), the snapshots of states older
        than its ``keep_snapshots`` newest removed. Within ``_state.unsaved_states()``, a
        store whose columns were not used since its last state shares that state's copies or
        snapshot instead.

        NOTE (uses): a use is a read of :attr:`loss`, :attr:`seen`, :attr:`selected` or
        :attr:`columns` (through which the kernels write), or a load or clear. Writes through
        a column read before the last state (or through a shallow ``copy.copy`` of the store,
        whose count is its own) are not counted; this is why sharing is only ever asked for
        where the caller takes two states of one moment back to back.

        Columns are CPU tensors, so that a checkpoint holding them loads with ``torch.load``'s
        default ``weights_only=True`` (numpy arrays would be refused).

        Example:
            >>> import tempfile
            >>> s = ExampleStore(10, path=tempfile.mkdtemp())
            >>> s.record(np.array([3]), np.array([0.5]), epoch=0)
            >>> state = s.state_dict()
            >>> s.record(np.array([3]), np.array([9.0]), epoch=1)  # the run goes on
            >>> s.load_state_dict(state)  # a resume: the losses as they were at the state
            >>> s.lookup(np.array([3]))[0].tolist()
            [0.5]
        """
        self._check_open()
        state: dict[str, Any] = {"version": self.VERSION, "size": self.size}
        shared = self._shared_state()
        if shared is not None:
            return {**state, **shared}
        columns = self._current()  # (a restore still pending is a loaded state's: applied first)
        if self.path is None:
            copies = tuple(torch.from_numpy(c.copy()) for c in columns)
            self._last_state = (self._uses, tuple(weakref.ref(c) for c in copies))
            return {**state, **dict(zip(("loss", "seen", "selected"), copies))}
        state["path"] = str(self.path)
        self.flush()
        if taking_rollback():
            return {**state, "live": True}
        snapshot = self._snapshot()
        self._last_state = (self._uses, snapshot)
        return {**state, "snapshot": snapshot.name}

    def _shared_state(self) -> dict[str, Any] | None:
        """Within ``unsaved_states()``, what the last state taken holds (its columns' copies,
        its snapshot, still there), if the columns have not been used since; else None."""
        last = self._last_state
        if not taking_unsaved() or taking_rollback() or last is None or last[0] != self._uses:
            return None
        held = last[1]
        if isinstance(held, Path):
            return {"path": str(self.path), "snapshot": held.name} if held.is_dir() else None
        copies = tuple(ref() for ref in held)
        if any(c is None for c in copies):
            return None
        return dict(zip(("loss", "seen", "selected"), copies))

    def _snapshot(self) -> Path:
        """Copy the column files into a new snapshot folder, written under a temporary name,
        synced to disk and then renamed, so that a snapshot that exists is whole (also after a
        power loss); then remove those older than the ``keep_snapshots`` newest this store
        wrote.

        NOTE (names): ``<sequence>-<pid>-<count>``, the sequence one more than the highest in
        the folder: snapshots order as they were written, also across the processes of a
        resumed run (which prunes what its predecessor left), whatever the clocks do.
        """
        assert self.path is not None
        folder = self.path / SNAPSHOTS
        folder.mkdir(exist_ok=True)
        sequence = max((_sequence(e.name) for e in folder.iterdir()), default=0)
        self._count += 1
        name = f"{sequence + 1:012d}-{os.getpid()}-{self._count}"
        tmp = folder / f".tmp-{name}"
        tmp.mkdir()
        try:
            if self.size:
                for column, dtype in COLUMNS:
                    file = self._file(column, dtype)
                    copy_sparse(file, tmp / file.name, sync=True)
            sync_folder(tmp)
            final = folder / name
            os.rename(tmp, final)
            sync_folder(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # NOTE (spared): a snapshot written within unsaved_states() (a Lightning stop's state)
        # takes no place among the keep_snapshots newest, so it removes no checkpoint's. No
        # checkpoint refers to it unless one saved it since (keep_spared made it a kept one):
        # its state is the stop's, which fit again in this process loads. So a snapshot taken
        # after that load was applied removes it, as does the next stop's (whose state replaces
        # it); any other (a state_dict() called by hand between the stop and fit again) keeps it,
        # as it removed the snapshot fit again then needed.
        unsaved = taking_unsaved()
        for spared, loaded in list(self._spared.items()):
            if loaded or unsaved:
                shutil.rmtree(spared, ignore_errors=True)
                del self._spared[spared]
        if unsaved:
            self._spared[final] = False
        else:
            self._written.append(final)
            self._prune(folder)
        return final

    def keep_spared(self, state: dict[str, Any]) -> None:
        """A state of this store taken within ``_state.unsaved_states()`` was saved after all (a
        checkpoint holds it): its snapshot is kept from now as any state's, among the
        ``keep_snapshots`` newest (older ones beyond them removed). Any other state: nothing.

        Example:
            >>> import tempfile
            >>> from sbloader._state import unsaved_states
            >>> s = ExampleStore(4, path=tempfile.mkdtemp(), keep_snapshots=1)
            >>> first = s.state_dict()
            >>> s.record(np.array([0]), np.array([1.0]), epoch=0)
            >>> with unsaved_states():
            ...     stop = s.state_dict()  # removes no older snapshot
            >>> len(list((s.path / "snapshots").iterdir()))
            2
            >>> s.keep_spared(stop)  # a checkpoint saved it: the newest kept one
            >>> [p.name for p in (s.path / "snapshots").iterdir()] == [stop["snapshot"]]
            True
        """
        name = state.get("snapshot")
        spared = next((p for p in self._spared if p.name == name), None)
        if spared is None or self.path is None:
            return
        del self._spared[spared]
        self._written = sorted([*self._written, spared], key=lambda p: _sequence(p.name))
        self._prune(self.path / SNAPSHOTS)

    def _prune(self, folder: Path) -> None:
        """Remove the snapshots (and unfinished ones) written before this store's
        ``keep_snapshots``-th newest; none while it has written fewer, or keeping every one,
        and no spared one (see NOTE (spared))."""
        keep = self.keep_snapshots
        if keep is None or len(self._written) < keep:
            return
        oldest_kept = _sequence(self._written[-keep].name)
        for entry in folder.iterdir():
            if entry in self._spared:
                continue
            if entry.is_dir() and 0 < _sequence(entry.name) < oldest_kept:
                shutil.rmtree(entry, ignore_errors=True)
        self._written = self._written[-keep:]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state. A memory-mapped store's snapshot is checked now (it must
        exist, whole) and copied over the files when the columns are next used.

        Raises:
            ValueError: the state is of another size, of another folder, or its snapshot is
                gone (removed as older than the ``keep_snapshots`` newest).
        """
        self._check_open()
        self._uses += 1
        state = check_version(state, "ExampleStore", self.VERSION, {1: _store_v1_to_v2})
        check_identity(
            "ExampleStore",
            {"size": int(state["size"])},
            {"size": self.size},
            "build it for the same dataset",
        )
        if "path" not in state:
            columns = tuple(
                np.asarray(state[name], dtype=dtype).reshape(-1) for name, dtype in COLUMNS
            )
            if self.path is None:
                self._restore = None
                for column, values in zip((self._loss, self._seen, self._selected), columns):
                    column[:] = values
            else:  # written into the files at their next use (NOTE (columns as properties)):
                # copies, since the caller's state may change until then
                self._restore = tuple(c.copy() for c in columns)
            return
        if self.path is None:
            raise ValueError(
                f"the saved store is memory-mapped at {state['path']}; build the store with "
                "path= that folder (or a copy of it)"
            )
        if state.get("live"):
            # The files as they are (a rollback, or a version-1 state): this folder's.
            if Path(state["path"]).resolve() != self.path.resolve():
                raise ValueError(
                    f"the saved store is memory-mapped at {state['path']}; build the store "
                    "with path= that folder"
                )
            self._restore = None
            return
        # NOTE: a snapshot is found in this store's folder, wherever the state was saved: a run
        # moved to another machine or mount resumes from a copy of the folder.
        snapshot = self.path / SNAPSHOTS / str(state["snapshot"])
        self._check_snapshot(snapshot, str(state["path"]))
        self._restore = snapshot

    def _check_snapshot(self, snapshot: Path, saved_at: str | None = None) -> None:
        moved = (
            ""
            if saved_at is None
            or self.path is None
            or Path(saved_at).resolve() == self.path.resolve()
            else f" (the state was saved by a store at {saved_at}: copy that folder here, or "
            "build the store with path= that folder)"
        )
        for name, dtype in COLUMNS:
            file = _column_file(snapshot, name, dtype)
            want = self.size * np.dtype(dtype).itemsize
            if not snapshot.is_dir() or (
                self.size and (not file.is_file() or file.stat().st_size != want)
            ):
                kept = (
                    "this store keeps every snapshot, so it was removed from the folder"
                    if self.keep_snapshots is None
                    else f"a memory-mapped store keeps the snapshots of its {self.keep_snapshots} "
                    "newest saved states and removes older ones: resume from a newer "
                    "checkpoint, or keep more (SelectiveBackprop(store_snapshots=..., or None "
                    "for every one), ExampleStore(keep_snapshots=...))"
                )
                raise ValueError(
                    f"the saved state's store snapshot {snapshot} is missing or incomplete"
                    f"{moved}; {kept}"
                )

    def _check_open(self) -> None:
        if isinstance(self._restore, _Closed):
            self._apply_restore()  # (raises)
        self._check_newest()

    def _apply_restore(self) -> None:
        """Write the loaded state into the column files: its snapshot copied over them (and
        mapped anew), or an in-memory store's columns written into them; once, whichever
        thread uses the columns first."""
        with self._restore_lock:
            restore = self._restore
            if restore is None:
                return
            if isinstance(restore, _Closed):
                raise RuntimeError(
                    f"this store at {self.path} was closed (ExampleStore.close(), e.g. its "
                    "policy attached to a dataset of another size); build another store"
                )
            assert self.path is not None
            if not isinstance(restore, Path):
                for column, values in zip((self._loss, self._seen, self._selected), restore):
                    column[:] = values
                self._restore = None
                return
            self._check_snapshot(restore)
            if self.size:
                for name, dtype in COLUMNS:
                    file = self._file(name, dtype)
                    tmp = file.with_name(f".restore-{os.getpid()}-{file.name}")
                    try:
                        copy_sparse(restore / file.name, tmp)
                        # NOTE: a new file renamed over the mapped one (never rewritten under a
                        # mapping that may still be referenced), then mapped anew.
                        os.replace(tmp, file)
                    finally:
                        tmp.unlink(missing_ok=True)
            self._open_columns(fresh=False)
            self._restore = None
            if restore in self._spared:  # (its state is in the columns: see NOTE (spared))
                self._spared[restore] = True


def saved_column(state: dict[str, Any], name: str) -> np.ndarray | None:
    """Column ``name`` (``loss``, ``seen`` or ``selected``) of an :class:`ExampleStore` state:
    an in-memory store's, or read from the snapshot a memory-mapped store's names (a copy);
    None for a state that names the files as they are (``"live"``: a version-1 state).

    Raises:
        ValueError: the snapshot is missing, or ``name`` is no column.
    """
    dtypes = dict(COLUMNS)
    if name not in dtypes:
        raise ValueError(f"name should be one of {list(dtypes)}, but got name={name!r}")
    if name in state:
        return np.asarray(state[name], dtype=dtypes[name]).reshape(-1).copy()
    if "snapshot" not in state:
        return None
    snapshot = Path(state["path"]) / SNAPSHOTS / str(state["snapshot"])
    file = _column_file(snapshot, name, dtypes[name])
    size = int(state["size"])
    if not size:
        return np.zeros(0, dtype=dtypes[name])
    if not file.is_file() or file.stat().st_size != size * np.dtype(dtypes[name]).itemsize:
        raise ValueError(
            f"the store state's snapshot file {file} is missing or incomplete (a memory-mapped "
            "store keeps the snapshots of its newest saved states only: see keep_snapshots)"
        )
    return np.fromfile(file, dtype=dtypes[name])


def _store_v1_to_v2(state: dict[str, Any]) -> dict[str, Any]:
    """A version-1 state as version 2: a memory-mapped store's named its files as they are
    (``"live"``: such a resume continues with what was recorded up to the interruption, as it
    did when saved), an in-memory store's is unchanged."""
    if "path" in state:
        return {**state, "version": 2, "live": True}
    return {**state, "version": 2}
