"""File-system helpers of the memory-mapped store: a copy that keeps a file's holes, syncing a
folder's entries, and holding a folder for one process."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # (no flock here: folders are not held)
    fcntl = None  # type: ignore[assignment]

__all__ = ["claim_newest", "copy_sparse", "hold_folder", "sync_folder"]


def copy_sparse(src: Path, dst: Path, sync: bool = False) -> None:
    """Copy the file ``src`` to ``dst`` (replaced), leaving holes where ``src`` has them: a
    store's files are sparse until examples are scored, and a copy that wrote their zeros would
    take the whole size on disk. Where the file system cannot tell data from holes, every byte
    is copied. ``sync``: flushed to disk before returning.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> with open(d / "a", "wb") as f:
        ...     _ = f.truncate(1 << 20)
        ...     _ = f.seek(500_000)
        ...     _ = f.write(b"x")
        >>> copy_sparse(d / "a", d / "b")
        >>> (d / "b").read_bytes() == (d / "a").read_bytes()
        True
    """
    size = src.stat().st_size
    fdi = os.open(src, os.O_RDONLY)
    try:
        fdo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fdo, size)
            for start, end in _data_ranges(fdi, size):
                _copy_range(fdi, fdo, start, end)
            if sync:
                os.fsync(fdo)
        finally:
            os.close(fdo)
    finally:
        os.close(fdi)


def _copy_range(fdi: int, fdo: int, start: int, end: int) -> None:
    """Copy bytes ``start .. end`` of the open file ``fdi`` to the same place in ``fdo``: in the
    kernel (``os.copy_file_range``, which some file systems serve by sharing blocks), else
    through memory where it is unavailable or refused."""
    while start < end:
        try:
            done = os.copy_file_range(fdi, fdo, end - start, start, start)
        except (AttributeError, OSError):
            break
        if not done:
            break
        start += done
    while start < end:
        chunk = os.pread(fdi, min(end - start, 1 << 24), start)
        if not chunk:
            break
        start += os.pwrite(fdo, chunk, start)


#: The errors of ``lseek(SEEK_DATA)`` where a file system cannot tell data from holes.
_NO_SEEK_DATA = {
    errno.EINVAL,
    errno.ENOSYS,
    errno.ESPIPE,
    getattr(errno, "EOPNOTSUPP", errno.EINVAL),
    getattr(errno, "ENOTSUP", errno.EINVAL),
}


def _data_ranges(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` byte ranges of the open file ``fd`` that hold data (all of it where
    the file system has no ``SEEK_DATA``)."""
    seek_data = getattr(os, "SEEK_DATA", None)
    seek_hole = getattr(os, "SEEK_HOLE", None)
    offset = 0
    while offset < size:
        if seek_data is None or seek_hole is None:
            yield offset, size
            return
        try:
            start = os.lseek(fd, offset, seek_data)
        except OSError as e:
            if e.errno == errno.ENXIO:  # holes from offset to the end
                return
            if e.errno not in _NO_SEEK_DATA:
                raise
            seek_data = None  # not supported here: copy the rest whole
            continue
        end = min(os.lseek(fd, start, seek_hole), size)  # (a hole at least at the end)
        yield start, end
        offset = end


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries to disk (where the system allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# NOTE (one process per folder): a memory-mapped store's folder is held by one process at a
# time. Two processes writing the same files (e.g. every rank of a torchrun job given the same
# store_path) corrupt them silently: selection counts are read-modified-written by each, a new
# run's clearing truncates files another maps, and one's snapshots prune the other's. The hold
# is a ``flock`` on ``.lock`` in the folder (a lock of the open file description, so that no
# other descriptor of the file, e.g. a copy of the folder made in this process, drops it; the
# system releases it when the process ends, also by a crash), taken by the first store of a
# process and shared by its other stores of that folder, keyed by the folder's device and inode
# (one entry however the folder is reached); closed when the last of them is gone.
# NOTE (releases): a store's finalizer may run inside a garbage collection that starts while
# this module's lock is held, in the same thread: it never waits for the lock, it queues the
# release, which whoever holds the lock carries out before letting it go.
_HELD: dict[tuple[int, int], list[int]] = {}  # folder -> [descriptor, stores, size]
_HELD_LOCK = threading.Lock()
_RELEASES: list[tuple[int, int]] = []
#: ``flock`` errors of a file system without locks: nothing is held there.
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EINVAL, getattr(errno, "EOPNOTSUPP", errno.EINVAL)}


def hold_folder(owner: object, folder: Path, size: int) -> Callable[[], Any]:
    """Hold ``folder`` for this process while ``owner`` (a store of ``size`` examples) lives,
    or raise ``ValueError`` naming the process that holds it (or, in this process, a store of
    another size there, whose files this one would truncate under it). Returns the release
    (called by itself when ``owner`` is collected; call it when ``owner`` fails to build)."""
    if fcntl is None:
        return lambda: None
    info = folder.stat()
    key = (info.st_dev, info.st_ino)
    with _HELD_LOCK:
        try:
            held = _HELD.get(key)
            if held is None:
                held = _take(folder, size)
                if held is None:
                    return lambda: None
                _HELD[key] = held
            elif held[2] != size:
                raise ValueError(
                    f"the store folder {folder} is used by a store of {held[2]} examples in "
                    f"this process; a store of {size} would truncate its files under it: give "
                    "it another folder"
                )
            held[1] += 1
        finally:
            _release_queued()
    _drain()  # (releases queued while the lock was held here, after the call above)
    return weakref.finalize(owner, _queue_release, key)


# NOTE (the newest store of a folder, in this process): a second store of the same size in one
# process may take a folder (a notebook cell run again builds a new loader while the old one
# still lives), but the two would write the same files: the older one's losses overwritten by
# the newer run's, each run's stale epochs deciding from the other's losses. So the newest
# store of a folder is the one that may use it; an older one refuses at its next use.
_NEWEST: dict[tuple[int, int], int] = {}
_TOKENS = itertools.count(1)


def claim_newest(folder: Path) -> Callable[[], bool]:
    """Make the caller the newest store of ``folder`` in this process; returns whether it still
    is (False once another store has claimed the folder since)."""
    info = folder.stat()
    key, token = (info.st_dev, info.st_ino), next(_TOKENS)
    with _HELD_LOCK:
        _NEWEST[key] = token
    return lambda: _NEWEST.get(key) == token


def _take(folder: Path, size: int) -> list[int] | None:
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno in _NO_LOCKS:
            return None
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise ValueError(
            f"the store folder {folder} is in use by another process (pid {holder}): a "
            "memory-mapped store has one writer; give each process its own folder (under "
            "several ranks, e.g. store_path=f'stores/rank{rank}'), or end the other run"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return [fd, 0, size]


def _queue_release(key: tuple[int, int]) -> None:
    _RELEASES.append(key)
    _drain()


def _drain() -> None:
    """Carry out the queued releases where the lock is free (else its holder does)."""
    while _RELEASES and _HELD_LOCK.acquire(blocking=False):
        try:
            _release_queued()
        finally:
            _HELD_LOCK.release()


def _release_queued() -> None:
    """Carry out the queued releases (with ``_HELD_LOCK`` held)."""
    while _RELEASES:
        key = _RELEASES.pop()
        held = _HELD.get(key)
        if held is None:
            continue
        held[1] -= 1
        if held[1] <= 0:
            del _HELD[key]
            os.close(held[0])  # (drops the lock)


def _forget_held() -> None:
    """In a forked child: the parent's holds are not the child's (its stores take their own),
    and its copies of their descriptors are closed, so that the lock goes when the parent lets
    go (a ``flock`` lasts while any descriptor of it is open, e.g. a DataLoader worker's)."""
    global _HELD_LOCK
    for fd, _, _ in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _RELEASES.clear()
    _HELD_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_held)
