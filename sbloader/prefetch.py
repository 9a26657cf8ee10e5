"""Fetching source batches on a background thread while the caller trains on the last ones."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Prefetcher", "Synchronous"]

T = TypeVar("T")

_ITEM, _END, _ERROR = 0, 1, 2


class Prefetcher(Generic[T]):
    """Iterates ``make_iter()`` on a daemon thread: up to ``depth`` items wait ready for the
    caller, and the thread holds one more, fetched while they wait (``depth + 1`` ahead of
    the item the caller holds).

    Each item comes with ``tally()`` read right after the item was produced, on the producing
    thread, so that counts kept while producing an item (e.g. examples rejected before loading)
    reach the caller with that item and not earlier. An exception raised while producing is
    re-raised by :meth:`next` in the caller's thread, in order.

    NOTE: the iterator is created, advanced and closed on the background thread only; a
    generator can be closed only by the thread that runs it, and a persistent-worker
    DataLoader iterator must never be advanced by two threads. :meth:`close` stops the thread
    and waits for it, so that the next epoch's iterator cannot overlap this one.

    Example:
        >>> p = Prefetcher(lambda: iter(range(3)), depth=1, tally=lambda: 0)
        >>> [p.next()[0] for _ in range(3)]
        [0, 1, 2]
        >>> p.next()
        Traceback (most recent call last):
        ...
        StopIteration
        >>> p.close()
    """

    def __init__(
        self, make_iter: Callable[[], Iterator[T]], depth: int, tally: Callable[[], Any]
    ) -> None:
        self._queue: queue.Queue[tuple[int, Any, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._tally = tally
        self._done = False
        self._thread = threading.Thread(
            target=self._run, args=(make_iter,), name="sbloader-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, message: tuple[int, Any, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, make_iter: Callable[[], Iterator[T]]) -> None:
        it: Iterator[T] | None = None
        try:
            it = make_iter()
            for item in it:
                # NOTE: a put that close() made room for (by draining the queue) must not lead to
                # another fetch: past the end of the data a DataLoader would draw the next
                # epoch's order from generators the caller may be restoring.
                if not self._put((_ITEM, item, self._tally())) or self._stop.is_set():
                    return
            self._put((_END, None, self._tally()))
        except BaseException as e:  # handed to the caller, re-raised there
            try:
                tally = self._tally()
            except BaseException:  # (the tally itself failed: the error is still handed over)
                tally = None
            self._put((_ERROR, e, tally))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def next(self) -> tuple[T, Any]:
        """The next item and its tally; raises StopIteration at the end (and the producer's
        exception where it failed)."""
        if self._done:
            raise StopIteration
        while True:
            try:
                kind, payload, count = self._queue.get(timeout=0.5)
                break
            except queue.Empty:
                # NOTE: the producer always hands over an end or an error before it stops; one
                # that died without (an error while handing one over) must not leave the caller
                # waiting for ever.
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError(
                        "the prefetch thread stopped without handing over the end of the source "
                        "or its error (see the thread's traceback above); build the loader with "
                        "prefetch=0 to get the error in this thread"
                    ) from None
        if kind == _ITEM:
            return payload, count
        self._done = True
        self.last_tally = count
        if kind == _ERROR:
            raise payload
        raise StopIteration

    #: The tally read when the source ended (or failed): counts after the last item.
    last_tally: Any = 0

    def request_stop(self) -> None:
        """Ask the producer to stop after the item it is fetching, without waiting (also on the
        producer's own thread, where :meth:`close` would wait for ever)."""
        self._stop.set()

    def close(self) -> None:
        """Stop the producer (it finishes the item it is fetching, and fetches no other) and
        wait for it."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()


class Synchronous(Generic[T]):
    """:class:`Prefetcher`'s interface without a thread: each item is produced on demand.

    Example:
        >>> s = Synchronous(lambda: iter("ab"), tally=lambda: 7)
        >>> s.next(), s.next()
        (('a', 7), ('b', 7))
    """

    def __init__(self, make_iter: Callable[[], Iterator[T]], tally: Callable[[], Any]) -> None:
        self._it = make_iter()
        self._tally = tally
        self.last_tally: Any = 0

    def next(self) -> tuple[T, Any]:
        try:
            item = next(self._it)
        except StopIteration:
            self.last_tally = self._tally()
            raise
        return item, self._tally()

    def request_stop(self) -> None:
        """Nothing to stop: no thread fetches ahead (see :meth:`Prefetcher.request_stop`)."""

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
