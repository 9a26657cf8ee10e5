"""Training epochs of a fixed number of batches: ``SelectiveLoader(batches_per_epoch=)``.

A selective policy keeps a random number of examples per pass over the source, so a pass yields
a random number of batches and ``len(loader)`` is undefined. With ``batches_per_epoch``, a
*training epoch* (what ``iter(loader)`` then returns, a :class:`FixedEpochIterator`) yields
exactly that many full batches, cut from the loader's stream of batches pass after pass:

- **a short pass**: a training epoch that needs more batches than the current pass over the data
  has left goes on into the next pass (which begins as any epoch does: the sampler's
  ``set_epoch``, the policy's next epoch; ``remainder=`` applies to the pass that ended);
- **a long pass**: a pass that still has batches when the training epoch is full is suspended,
  and the next training epoch goes on with it: its surplus is carried, never dropped or yielded
  twice.

NOTE: the batches are exactly those the loader yields without the option (the same passes, the
same selections, the same carried examples, in the same order): only where training epochs begin
and end differs. So the two are counted apart: ``loader.epoch``, ``loader.progress``,
``loader.stats`` (one entry per pass), the sampler's ``set_epoch`` and every policy keyed on
epochs (Phased's warm-up and anneal, Stale-SB's fresh and stale epochs) count passes over the
data; ``loader.training_epoch`` counts training epochs. Topping a short epoch up from the next
pass keeps every selection decision where it was, whereas ending passes early (or padding them)
would change what the policies see.

Under DDP the ranks' passes yield the same number of batches round by round (see
:mod:`sbloader.distributed`), so the cut after ``count`` batches falls at the same point of every
rank's pass; the ranks check once that they agree on ``count``. ``loader.state_dict()`` holds the
training epoch's clock (:class:`FixedEpochs`) besides the pass's position: a resumed run yields
exactly the uninterrupted one's batches, epoch by epoch.
"""

from __future__ import annotations

import numbers
import weakref
from enum import Enum
from typing import TYPE_CHECKING, Any

from ._state import check_version

if TYPE_CHECKING:
    from . import batch as B
    from .epoch import EpochIterator
    from .loader import SelectiveLoader

__all__ = [
    "BARREN_PASSES",
    "FixedEpochIterator",
    "FixedEpochs",
    "check_batches_per_epoch",
    "fills_a_batch",
    "unfillable",
]

#: Passes over the data in a row that may yield no batch before a training epoch gives up (a
#: policy that keeps (almost) nothing, or ``remainder="drop"`` with fewer selected examples per
#: pass than a batch): the loader raises instead of looping over the data forever.
BARREN_PASSES = 100


def check_batches_per_epoch(value: Any) -> int | str | None:
    """``batches_per_epoch`` checked: a positive int, ``"expected"`` or None; else raise naming it.

    Example:
        >>> check_batches_per_epoch(12), check_batches_per_epoch("expected")
        (12, 'expected')
        >>> check_batches_per_epoch(0)
        Traceback (most recent call last):
        ...
        ValueError: batches_per_epoch should be a positive int, "expected" or None, but got ...
    """
    if value is None or (isinstance(value, str) and value == "expected"):
        return value
    message = (
        'batches_per_epoch should be a positive int, "expected" or None, but got '
        f"batches_per_epoch={value!r}"
    )
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise TypeError(message)
    if isinstance(value, str) or value < 1:
        raise ValueError(message)
    return int(value)


class _Phase(Enum):
    NEW = 0
    RUNNING = 1
    DONE = 2
    CLOSED = 3


class FixedEpochs:
    """The cross-epoch state of fixed-length training epochs (the loader holds one).

    Args:
        count: batches per training epoch.

    Attributes:
        count: batches per training epoch.
        epoch: the number of the current (or next) training epoch, from 0, once it has begun
            (an abandoned one ends when the next begins; :meth:`current` counts it as ended).
        yielded: batches yielded in the current training epoch so far.

    Example:
        >>> clock = FixedEpochs(5)
        >>> clock.state_dict()
        {'version': 1, 'count': 5, 'epoch': 0, 'yielded': 0, 'active': False}
    """

    VERSION = 1

    def __init__(self, count: int) -> None:
        self.count = count
        self.epoch = 0
        self.yielded = 0
        self._active = False  # a training epoch began and has not ended
        self._resume = False  # the next iterator continues a restored training epoch
        self._pass: EpochIterator | None = None  # the pass over the data in progress
        self._live: weakref.ref[FixedEpochIterator] | None = None
        self._agreed = False  # the ranks checked that they agree on count (once per process)
        self._barren = 0  # passes in a row that yielded no batch

    def iterate(self, loader: SelectiveLoader) -> FixedEpochIterator:
        """A new training epoch's iterator (``iter(loader)``); the previous one is closed."""
        self._close_live()
        it = FixedEpochIterator(loader, self)
        self._live = weakref.ref(it)
        return it

    def _close_live(self) -> None:
        live = None if self._live is None else self._live()
        if live is not None:
            live.close()

    def _finish(self) -> None:
        """The training epoch ended (``next()`` was asked for a batch beyond ``count``)."""
        if self._pass is not None:
            self._pass.pause()
        self._active = False
        self.epoch += 1
        self.yielded = 0

    def current(self) -> tuple[int, int, bool]:
        """The training epoch's number, the batches yielded in it, and whether it is under way
        (the next iterator goes on with it). An abandoned epoch counts as ended, as the next
        ``iter(loader)`` will end it."""
        epoch, yielded, active = self.epoch, self.yielded, self._active
        live = None if self._live is None else self._live()
        running = live is not None and live._phase is _Phase.RUNNING
        if active and not (self._resume or running):
            return epoch + 1, 0, False
        return epoch, yielded, active

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        """The clock; ``unconsumed`` batches handed out last are taken back (see
        :meth:`SelectiveLoader.state_dict <sbloader.SelectiveLoader.state_dict>`): the resumed
        training epoch hands them out again and counts them then."""
        epoch, yielded, active = self.current()
        if active:
            yielded -= min(unconsumed, yielded)
        return {
            "version": self.VERSION,
            "count": self.count,
            "epoch": epoch,
            "yielded": yielded,
            "active": active,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next iterator continues a training epoch that was
        running when the state was saved. (The loader restores the pass over the data.)"""
        state = check_version(state, "batches_per_epoch", self.VERSION)
        if int(state["count"]) != self.count:
            raise ValueError(
                f"the saved state has batches_per_epoch={state['count']}, but this loader has "
                f"batches_per_epoch={self.count}; build the loader with the saved run's arguments"
            )
        self._close_live()
        self._live = None
        self._pass = None  # the loader closed it; its restored position resumes it
        self.epoch, self.yielded = int(state["epoch"]), int(state["yielded"])
        self._active = self._resume = bool(state["active"])


class FixedEpochIterator:
    """One training epoch of exactly ``batches_per_epoch`` batches; ``iter(loader)`` makes one
    when the loader has ``batches_per_epoch`` (see :mod:`sbloader.length`).

    The training epoch starts on the first ``next()`` and ends when ``next()`` is called after
    its last batch (so a state saved after the last batch, before that call, resumes into an
    empty rest of the epoch, as at the end of a pass). ``iter(loader)`` closes the previous
    iterator, which then raises ``RuntimeError`` if advanced; a training epoch it had started and
    not finished counts as abandoned: the next one starts with its full count, and the pass over
    the data goes on where it was (nothing selected is lost).

    Attributes:
        epoch: the training epoch's number (None before it starts).

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import sbloader
        >>> data = TensorDataset(torch.randn(300, 4), torch.randint(0, 2, (300,)))
        >>> loader = sbloader.SelectiveLoader(
        ...     DataLoader(data, batch_size=60), torch.nn.Linear(4, 2), batch_size=10,
        ...     policy=sbloader.SelectiveBackprop(1 / 3), batches_per_epoch="expected")
        >>> len(loader), [sum(1 for _ in loader) for _ in range(3)]
        (10, [10, 10, 10])
    """

    def __init__(self, loader: SelectiveLoader, clock: FixedEpochs) -> None:
        self._loader, self._clock = loader, clock
        self._phase = _Phase.NEW
        self.epoch: int | None = None

    def __iter__(self) -> FixedEpochIterator:
        return self

    def __len__(self) -> int:
        """Batches per training epoch (as ``len(loader)``)."""
        return self._clock.count

    def __next__(self) -> B.SelectedBatch:
        clock = self._clock
        if self._phase is _Phase.CLOSED:
            raise RuntimeError(
                "this training-epoch iterator was closed (by a newer iter(loader), close(), or "
                "an error in an earlier step); call iter(loader) for the next epoch"
            )
        if self._phase is _Phase.DONE:
            raise StopIteration
        try:
            if self._phase is _Phase.NEW:
                self._begin()
            if clock.yielded >= clock.count:
                self._phase = _Phase.DONE
                clock._finish()
                raise StopIteration
            batch = self._next_batch()
        except StopIteration:
            raise
        except BaseException:
            self.close()
            raise
        clock.yielded += 1
        return batch

    def runs_ahead(self) -> None:
        """Accepted for :meth:`EpochIterator.runs_ahead <sbloader.epoch.EpochIterator.
        runs_ahead>`'s callers: :meth:`finishing` here knows from the count, without running
        ahead, so batches need no copying."""

    def finishing(self) -> bool:
        """Whether the training epoch has no batch left after those handed out so far (known
        from the count, without running ahead; see :meth:`EpochIterator.finishing
        <sbloader.epoch.EpochIterator.finishing>`)."""
        return self._phase is not _Phase.NEW and self._clock.yielded >= self._clock.count

    @property
    def running(self) -> bool:
        """Whether the training epoch has begun and neither ended nor been closed."""
        return self._phase is _Phase.RUNNING

    def close(self, resumable: bool = True) -> None:
        """End the iterator (the pass over the data it was reading stays open for the next).

        Args:
            resumable: accepted for :meth:`EpochIterator.close
                <sbloader.epoch.EpochIterator.close>`'s callers; a training epoch left part-way
                always counts as ended (the next one starts with its full count, and nothing
                selected is lost), so either way a state saved now starts the next one.
        """
        del resumable
        if self._phase is not _Phase.DONE:
            self._phase = _Phase.CLOSED

    def _begin(self) -> None:
        loader, clock = self._loader, self._clock
        sync = loader._sync
        if sync is not None and not clock._agreed:
            # NOTE: ranks with different counts would hang in DDP's all-reduce at the end of the
            # shortest epoch; both extremes are reduced so every rank raises alike.
            sync.bind(loader.device)
            # (before any source batch: the unsharded-source check waits for the first one)
            fewest = sync.agree(clock.count, True, digest=False)[0]
            most = -sync.agree(-clock.count, True, digest=False)[0]
            # (checked again by the next training epoch when refused: never trained unchecked)
            clock._agreed = fewest == most
            if fewest != most:
                raise ValueError(
                    f"batches_per_epoch should be the same on every rank, but the ranks have "
                    f'from {fewest} to {most}; pass the same int on every rank ("expected" '
                    "differs where the ranks' sources differ in length)"
                )
        # NOTE: a frozen prefix the user unfroze between training epochs is refused here, not
        # only when the next pass over the data begins: a pass can span several training
        # epochs, whose steps would train on its detached features, the prefix unchanged.
        loader._scorer.check()
        if clock._active and not clock._resume:  # the previous training epoch was abandoned
            clock.epoch += 1
            clock.yielded = 0
        clock._active, clock._resume = True, False
        self.epoch = clock.epoch
        self._phase = _Phase.RUNNING

    def _next_batch(self) -> B.SelectedBatch:
        """The next batch of the stream, from the pass in progress or the next ones."""
        loader, clock = self._loader, self._clock
        while True:
            it = clock._pass
            if it is None:
                it = clock._pass = loader._new_pass()
                it.held_by_loader()  # (this iterator holds the loader while it runs)
            try:
                batch = next(it)
            except StopIteration:
                clock._pass = None
                clock._barren = clock._barren + 1 if _barren(it) else 0
                if clock._barren and loader.remainder == "drop":
                    fills_a_batch(it, loader.batch_size, clock.count)
                if clock._barren >= BARREN_PASSES:
                    raise ValueError(
                        f"{BARREN_PASSES} passes over the source in a row yielded no batch, so "
                        f"batches_per_epoch={clock.count} cannot be filled: the policy keeps "
                        f"fewer than batch_size={loader.batch_size} examples per pass (see "
                        "loader.stats: nonfinite, examples_selected, dropped); use "
                        "remainder='carry' or a smaller batch_size"
                    ) from None
                continue
            except BaseException:
                clock._pass = None  # the pass closed itself: the next one begins a new pass
                raise
            return batch


def fills_a_batch(it: EpochIterator, batch_size: int, count: int) -> None:
    """Refuse, after a pass that yielded no batch under ``remainder="drop"``, a policy expected
    to keep less than ``batch_size`` examples per pass (its rate times the pass's candidates):
    most of its passes would yield nothing. The loader refuses this as it is built where the
    pass's size is known; here for sources of unknown length.

    NOTE: only where the expectation itself falls short. A pass expected to fill a batch that
    yields none by chance goes on (up to ``BARREN_PASSES`` in a row).
    """
    stats = it.stats
    if stats is None or not stats.examples_seen:
        return
    expected = stats.target_rate * stats.examples_seen
    if expected < batch_size:
        raise unfillable(
            count,
            f"a pass over the source had {stats.examples_seen} examples, of which the "
            f"policy keeps about {expected:.3g}",
            batch_size,
        )


def unfillable(count: int | None, kept: str, batch_size: int) -> ValueError:
    """The refusal of ``batches_per_epoch=count`` under ``remainder="drop"`` where a pass keeps
    less than a batch (``kept``: what a pass keeps, in words); the one message of the loader's
    check as it is built and of :func:`fills_a_batch`'s after a pass.

    Example:
        >>> str(unfillable(2, "the policy keeps about 5 examples per pass", 8)).split(":")[0]
        'batches_per_epoch=2 can hardly be filled'
    """
    return ValueError(
        f"batches_per_epoch={count} can hardly be filled: {kept}, less than "
        f"batch_size={batch_size}, and remainder='drop' drops each pass's rest, so most passes "
        "yield no batch; use remainder='carry' (the rest goes on into the next pass) or a "
        "smaller batch_size"
    )


def _barren(it: EpochIterator) -> bool:
    """Whether a finished pass yielded no batch (the same on every rank: counts are agreed)."""
    return it.stats is not None and it.stats.batches_yielded == 0
