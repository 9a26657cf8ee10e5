"""One epoch of a :class:`~sbloader.SelectiveLoader`: the object ``iter(loader)`` returns.

An :class:`EpochIterator` owns everything that lives for one epoch: the position in the source,
the fetcher (and its prefetch thread), the epoch's stats and the lockstep rounds with other
ranks. The loader keeps what lives across epochs (options, generator, policy, epoch number, the
rows carried between epochs) and hands them over when the epoch starts and takes them back when
it ends.

The iterator is a small state machine rather than a generator: each :meth:`~EpochIterator.__next__`
first hands out a batch that is already owed, and otherwise advances by one step (start the
epoch, process one source batch, one distributed drain round, the end-of-epoch remainder).

NOTE (one declared contract): configuration apart from iteration, as torch's DataLoader has it:
the loader holds the options, the collaborators it builds from them (the source, the codec, the
scorer, the ranks' synchronisation) and the state that crosses epochs (the rows selected and not
handed out yet, the source's position, what the last epoch left); the iterator owns one epoch
and reads and updates that state through the members :class:`EpochHost` declares, and nothing
else of the loader. The contract stands here, with the iterator that needs it, so the loader
depends on the iterator and never the other way round.
``EpochIterator`` refers to its loader as an :class:`EpochHost`, so the type checker refuses any
other access, and ``SelectiveLoader`` is checked to provide every member (the assignment at the
end of :mod:`sbloader.loader`). The members keep their leading underscore: they are the
package's own, not the user's API.
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from time import perf_counter
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np
import torch

from . import batch as B
from ._checks import NonFiniteLoss
from .decisions import Keep, choose_finite, in_subset
from .device_decisions import device_rows
from .overlap import AheadScores, SelectionThread
from .prefetch import Prefetcher, Synchronous
from .rows import Rows, WholeBatch, metadata_rows
from .scoring import Scored, Scorer
from .stats import EpochStats

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .codec import BatchCodec
    from .device_decisions import DecisionGenerator
    from .distributed import RankSync
    from .overlap import SelectionCopy
    from .policies import Policy
    from .rows import PendingRows
    from .sources import Source

__all__ = ["EpochHost", "EpochIterator"]

#: The names of the loader's own threads begin so (the selection and prefetch threads).
_THREAD_PREFIX = "sbloader-"

#: The most batches a saved state takes back (``SelectiveLoader.state_dict(unconsumed=)``): the
#: batch a framework fetched ahead (Lightning), and the one before it, on which a training step
#: raised (Lightning resumes a checkpoint saved then at the interrupted batch).
MAX_UNCONSUMED = 2

# The errors a rank meets in a round and reports to the others before raising (see
# EpochIterator._fail): their kinds in RankSync.agree, and what the other ranks raise, naming them.
_NONFINITE, _SHAPES = 1, 2
_REPORTED: dict[int, tuple[type[Exception], str, str]] = {
    _NONFINITE: (
        NonFiniteLoss,
        "met a non-finite selection loss (NaN or infinite) under nonfinite='raise'",
        "pass nonfinite='skip' or nonfinite='select' to continue past such losses",
    ),
    _SHAPES: (
        ValueError,
        "loaded a source batch whose rows cannot be joined with earlier ones into training "
        "batches (a field padded to another length, or a pad value that does not fit its field)",
        "pass pad_values= for every field padded per batch (e.g. pad_values={'input_ids': "
        "<pad_token_id>}), or pad every source batch to one length (padding='max_length')",
    ),
}


#: The exception types a rank names to the others when its selection pass raised (kinds from
#: ``_RAISED``, see :func:`_raised_kind`): built-in ones, then torch's out-of-memory error.
#: NOTE: an explicit list in a fixed order, not the ``builtins`` of the running Python (whose
#: order would move with a version's new types): the same kinds on every rank, and a type not
#: named here is sent as "derived from" its nearest named base.
_NAMED: tuple[type[Exception], ...] = (
    Exception,
    ArithmeticError,
    AssertionError,
    AttributeError,
    BufferError,
    ConnectionError,
    EOFError,
    FileNotFoundError,
    FloatingPointError,
    ImportError,
    IndexError,
    KeyError,
    LookupError,
    MemoryError,
    ModuleNotFoundError,
    NameError,
    NotImplementedError,
    OSError,
    OverflowError,
    PermissionError,
    RecursionError,
    ReferenceError,
    RuntimeError,
    StopIteration,
    SystemError,
    TimeoutError,
    TypeError,
    UnboundLocalError,
    UnicodeDecodeError,
    UnicodeEncodeError,
    UnicodeError,
    ValueError,
    ZeroDivisionError,
    *[c for c in (getattr(torch, "OutOfMemoryError", None),) if c is not None],
)
#: Where in its round a rank raised an exception (see :func:`_raised_kind`), as the other ranks
#: say it: the stages of a round, in order.
_SELECTING, _LOADING, _KEEPING = 0, 1, 2
_STAGES = (
    "in its selection pass (the model's forward, loss_fn, a forward= or output= hook, or the "
    "policy's decision)",
    "while loading a source batch (the source: its dataset, sampler, collate_fn or workers)",
    "while keeping the rows it selected (gathering them, or computing their cached features)",
)
#: The kinds of an exception raised in a rank's round: ``_RAISED + stage * _STAGE + 2 * i`` for
#: type ``_NAMED[i]`` itself, ``+ 1`` for a type derived from it (and from none after it in its
#: MRO). NOTE: a fixed stride, not ``2 * len(_NAMED)``: ranks whose torch names one type more
#: still read each other's stage.
_RAISED, _STAGE = 3, 80


def _raised_kind(error: Exception, stage: int = _SELECTING) -> int:
    """The kind that names ``error``'s type (or its nearest named base) and the stage of the
    round where it was raised (``_SELECTING``, ``_LOADING`` or ``_KEEPING``) to the other ranks."""
    base = _RAISED + stage * _STAGE
    for depth, cls in enumerate(type(error).__mro__):
        if cls in _NAMED:
            return base + 2 * _NAMED.index(cls) + int(depth > 0)
    return base + 2 * _NAMED.index(Exception) + 1  # (unreachable: Exception is named)


def _raised_stage(kind: int) -> str:
    """Where in its round the exception of kind ``kind`` was raised, as the other ranks say it."""
    return _STAGES[min((kind - _RAISED) // _STAGE, len(_STAGES) - 1)]


def _raised_name(kind: int) -> str:
    """What the other ranks call the exception of kind ``kind`` (see :func:`_raised_kind`)."""
    index = (kind - _RAISED) % _STAGE // 2
    if index >= len(_NAMED):  # (a rank with another torch, naming one more)
        return "an exception"
    cls = _NAMED[index]
    name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"
    return f"an exception derived from {name}" if (kind - _RAISED) % _STAGE % 2 else name


class EpochHost(Protocol):
    """The members of a :class:`~sbloader.SelectiveLoader` its epoch iterator uses.

    Options (read only): ``policy``, ``batch_size``, ``min_batch_size``, ``remainder``,
    ``batches_per_epoch``, ``nonfinite``, ``cdf``, ``prefetch``, ``device``, ``source``,
    ``epoch``.

    Collaborators, built from the options (read only): ``_source``, ``_codec``, ``_scorer``,
    ``_sync`` (None on one process), ``_decider`` (device-side decisions, or None), ``_overlap``
    (the selection copy of ``overlap_selection``, or None), ``_subset`` (a mask, or None),
    ``_rng``.

    State crossing epochs (read and updated by the iterator): ``_pending`` (rows selected and not
    handed out), ``_source_state`` (the source's state as the current source batch was taken),
    ``_probed`` (the model and loss were checked on a source batch), ``_epoch_prefilter``,
    ``_share`` / ``_ahead`` (what an epoch left part-way agreed and scored ahead),
    ``_returned`` (rows a saved state took back), ``_counted_full`` /
    ``_counted_full_warned``.

    Steps of the loader's own (the epoch's beginning, end and abandonment, and what they decide
    from the loader's whole state): ``_begin``, ``_end``, ``_abandon``, ``_keep_ended``,
    ``_sharing``; and ``_new_pass`` (a pass's iterator, for the training-epoch iterator of
    ``batches_per_epoch``, :class:`~sbloader.length.FixedEpochIterator`, which reads its loader
    through this contract too).
    """

    # ------------------------------------------------------------------ options
    policy: Policy
    batch_size: int
    min_batch_size: int
    remainder: str
    batches_per_epoch: int | None

    @property
    def last_batch_min(self) -> int: ...

    nonfinite: str
    cdf: str
    epoch: int

    @property
    def prefetch(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def source(self) -> Source: ...

    # ------------------------------------------------------------------ collaborators
    _source: Source
    _codec: BatchCodec
    _scorer: Scorer
    _sync: RankSync | None
    _decider: DecisionGenerator | None
    _overlap: SelectionCopy | None
    _subset: np.ndarray | None
    _rng: np.random.Generator

    # ------------------------------------------------------------------ state crossing epochs
    _pending: PendingRows
    _source_state: dict[str, Any] | None
    _probed: bool
    _epoch_prefilter: bool
    _share: float | None
    _ahead: AheadScores | None
    _returned: list[Rows]
    _orphans: list[EpochIterator]
    _counted_full: bool
    _counted_full_warned: bool

    # ------------------------------------------------------------------ the loader's steps
    def _begin(self, it: EpochIterator) -> tuple[int, int, bool, EpochStats, list[Rows]]: ...

    def _end(self, it: EpochIterator) -> None: ...

    def _abandon(
        self,
        it: EpochIterator,
        resumable: bool,
        handed: Sequence[Rows | WholeBatch] = (),
        why: str = "",
    ) -> None: ...

    def _keep_ended(self) -> None: ...

    def _sharing(self) -> bool: ...

    def _new_pass(self) -> EpochIterator: ...


class _Phase(Enum):
    NEW = 0  # not started: the epoch begins on the first __next__
    SOURCE = 1  # reading source batches
    DRAIN = 2  # this rank's source is exhausted; taking part in the other ranks' rounds
    REMAINDER = 3  # the end-of-epoch remainder
    FINISH = 4  # drop what remainder= drops, then end the epoch
    DONE = 5  # the epoch ended
    CLOSED = 6  # ended before the epoch did (a newer iterator, close(), or an error)


@dataclass
class _Loaded:
    """A source batch fetched and moved to the loader's device, not consumed yet.

    Attributes:
        data: its columns.
        indices: its dataset indices, or None.
        n: its candidates (within ``subset``).
        tally: the fetcher's tally read right after it (rejected, excluded, source state).
        excluded: candidates left out after loading because they are outside ``subset``.
        waited: seconds spent waiting for the source.
        device: the loader's device it was moved to.
        future: its selection pass running on the selection thread (``overlap_selection``),
            or None.
        failed: the error refreshing the selection copy for that pass raised, raised when the
            batch is taken (``overlap_selection``), or None.
    """

    data: list[Any]
    indices: np.ndarray | None
    n: int
    tally: tuple[int, int, Any]
    excluded: int
    waited: float
    device: torch.device
    future: Future[tuple[Scored, float]] | None = None
    failed: Exception | None = None


class EpochIterator:
    """Iterates one epoch of a loader; made by ``iter(loader)``.

    The epoch starts on the first ``next()``, not when the iterator is made. Only one iterator
    of a loader is live at a time: ``iter(loader)`` closes the previous one, and the epoch that
    iterator had started counts as abandoned (the next epoch begins, as after ``break``); the
    closed iterator then raises ``RuntimeError`` if advanced. An iterator that is dropped part-way
    (``break`` and no reference left), or whose step raised, is closed too: its fetcher stops
    and its prefetch thread ends.

    Attributes:
        stats: the epoch's :class:`~sbloader.EpochStats` (None before it starts).
        position: source batches consumed in the epoch so far.
        epoch: the epoch's number (None before it starts).

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import sbloader
        >>> data = TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,)))
        >>> loader = sbloader.SelectiveLoader(DataLoader(data, batch_size=4), torch.nn.Linear(4, 2),
        ...                                   policy=sbloader.Traditional())
        >>> it = iter(loader)
        >>> it.epoch, it.stats
        (None, None)
        >>> batch = next(it)
        >>> it.epoch, it.position, batch.indices.tolist(), it.finishing()
        (0, 1, [0, 1, 2, 3], False)
        >>> batch = next(it)
        >>> batch = next(it)
        >>> it.finishing(), it.position, next(it, None)
        (True, 3, None)
    """

    def __init__(self, loader: EpochHost) -> None:
        # The loader, held strongly while the caller owns this iterator; weakly once the loader
        # keeps it (see held_by_loader).
        self._owner: EpochHost | None = loader
        self._owner_ref = weakref.ref(loader)
        self._phase = _Phase.NEW
        self.stats: EpochStats | None = None
        self.epoch: int | None = None
        self.position = 0
        self._fetch: Prefetcher[Any] | Synchronous[Any] | None = None
        self._owed = 0  # full batches agreed on and not handed out yet
        self._short = 0  # the size of a short last batch to hand out (remainder="short")
        self._direct: WholeBatch | None = None  # a passthrough batch to hand out as it is
        # Batches a saved state took back from the caller (see SelectiveLoader.state_dict's
        # ``unconsumed``), handed out first and as they were; and the batches handed out last
        # that a state saved now may take back (at most MAX_UNCONSUMED, the latest last).
        self._replay: list[Rows] = []
        self._handed: list[Rows | WholeBatch] = []
        self._lent_before = False  # whether the batch before the last was the source's own
        self._counted = (0, 0)
        self._handed_out: float | None = None
        self._start = 0.0
        self._fresh = self._passthrough = self._filtering = self._joins = False
        self._committed = False  # whether the source batch being taken took effect
        self._remainder = "carry"  # this epoch's remainder (set as it begins)
        self._paused = False  # paused between training epochs (see pause())
        # Whether the caller runs ahead (see runs_ahead()) of a source that reuses its buffers:
        # its batches are then handed out as copies, never as the source's own.
        self._copy_direct = False
        # Whether the batch handed out last is such a source's own buffers (a source batch
        # handed out as it is before the caller ran ahead): finishing() must not take the next
        # source batch while the caller holds it (see _more_after_lent()).
        self._lent = False
        #: Whether the epoch was left by an exception raised in getting a batch (from the
        #: source, the selection pass or the policy), not by the caller (``break``, a peek).
        self.raised = False
        # overlap_selection: the next source batch, fetched and being scored on the selection
        # thread; the fetcher's last tally once fetching ahead found the source exhausted; the
        # thread; and the scores a restored state made ahead for this epoch's next source batch.
        self._next: _Loaded | None = None
        self._device = torch.device("cpu")  # set when the epoch begins
        self._exhausted: tuple[int, int, Any] | None = None
        self._thread: SelectionThread | None = None
        self._resume_scores: AheadScores | None = None
        # overlap_selection: an exception loading the next source batch ahead, raised when that
        # batch is taken.
        self._ahead_failed: Exception | None = None
        #: The lowest rank whose pass read no example, as the ranks' last round found (None: no
        #: rank's, or a single process; see :meth:`_drain_step`).
        self.empty_rank: int | None = None
        # On several ranks, an error this rank met in the current round, held until the round's
        # agreement reports it to every rank (see _fail): its kind and the error.
        self._failure: tuple[int, Exception] | None = None
        # The current round's progress, for an exception raised in it (see _source_step): where
        # it is (a stage of _STAGES), and whether its loss exchange and its agreement were made;
        # under FSDP, whether its agreement on the selection forwards was made, and whether the
        # rank is running those forwards (see _reports_raised).
        self._stage = _SELECTING
        self._exchanged = self._agreed = False
        self._rounded = self._forwarding = False
        # On several ranks: the smallest share of its pass any rank had drawn at the last
        # agreement, which :meth:`shared_fraction` reports on every rank alike; None before one.
        self._shared: float | None = None

    # ------------------------------------------------------------------ protocol
    @property
    def _loader(self) -> EpochHost:
        """The loader, as the members this iterator may use of it (see :class:`EpochHost`)."""
        loader = self._owner if self._owner is not None else self._owner_ref()
        if loader is None:
            raise ReferenceError("the SelectiveLoader of this epoch iterator was dropped")
        return loader

    def held_by_loader(self) -> None:
        """The loader keeps this iterator (a pass over the data suspended between training
        epochs of ``batches_per_epoch``), and whoever advances it holds the loader: it refers
        to the loader weakly from now on.

        NOTE: held strongly both ways, a loader dropped with a suspended pass lived on in a
        reference cycle, and with it the pass's prefetch thread and a DataLoader's worker
        processes, until the garbage collector happened to run; now it is freed at once, and
        the pass is closed as it is freed (see :meth:`close`).
        """
        self._owner = None

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> B.SelectedBatch:
        stats = self.stats
        if self._paused:
            self._paused, self._start = False, perf_counter()
        if self._handed_out is not None and stats is not None:
            stats.consumer_s += perf_counter() - self._handed_out
            self._handed_out = None
        try:
            while True:
                batch = self._next_ready()
                if batch is not None:
                    self._handed_out = perf_counter()
                    return batch
                if self._phase is _Phase.DONE:
                    raise StopIteration
                if self._phase is _Phase.CLOSED:
                    raise RuntimeError(
                        "this epoch iterator was closed (by a newer iter(loader), close(), or an "
                        "error in an earlier step); call iter(loader) for the next epoch"
                    )
                self._advance()
        except StopIteration:
            raise
        except BaseException:
            self.raised = True
            self.close()
            raise

    @property
    def started(self) -> bool:
        """Whether the epoch has begun."""
        return self._phase is not _Phase.NEW

    @property
    def running(self) -> bool:
        """Whether the epoch has begun and neither ended nor been closed."""
        return self._phase not in (_Phase.NEW, _Phase.DONE, _Phase.CLOSED)

    def pause(self) -> None:
        """The caller stops asking for batches for a while, within the epoch (a training epoch
        of ``batches_per_epoch`` ended here): the time since the last batch was handed out is
        counted as the caller's now, and neither ``consumer_s`` nor ``wall_s`` counts whatever
        the caller does until it asks for the next batch (e.g. an evaluation)."""
        now = perf_counter()
        if self._handed_out is not None and self.stats is not None:
            self.stats.consumer_s += now - self._handed_out
            self._handed_out = None
        if self._start and self.stats is not None:  # the pause is not the epoch's wall time
            self.stats.wall_s += now - self._start
            self._start = 0.0
            self._paused = True

    def runs_ahead(self) -> None:
        """Declare, before the first batch, that :meth:`finishing` will be called after each
        batch is handed out (as :class:`sbloader.integrations.accelerate.AcceleratedLoader`
        does under gradient accumulation). Optional: the first :meth:`finishing` call declares
        it too.

        NOTE: running ahead fetches the next source batch while the caller still trains on the
        one handed out; a source that reuses its buffers (FFCV: a ring of ``batches_ahead + 2``)
        may then overwrite the batch being trained on when a source batch is handed out as it is
        (Traditional at the source's batch size). Such batches are handed out as copies instead
        (only once declared: a caller that never runs ahead gets the source's own, uncopied).
        """
        self._copy_direct = self._loader._source.reuses_buffers()

    def finishing(self) -> bool:
        """Whether the epoch has no batch left after those handed out so far.

        To know, the iterator runs ahead until its next batch is ready or the source's batches
        are all taken: it may process source batches (their selection passes then run before
        the caller's step on the last batch handed out, one step staler), but leaves the
        epoch's end to the caller's next step (``loader.epoch`` counts it when the caller's
        loop ends). The batch it runs ahead to stays owed, so a state saved now still yields
        it.
        Used by :class:`sbloader.integrations.accelerate.AcceleratedLoader` to mark an epoch's
        last batch as Accelerate's own loaders do.

        Safe on its own with a source that reuses its buffers (FFCV), where running ahead would
        let the source overwrite the batch the caller holds: calling it declares
        :meth:`runs_ahead` (later batches are handed out as copies), and while the batch handed
        out last is still the source's own (handed out before the first call), it answers from
        the source's size without taking the next source batch.
        """
        t0 = perf_counter()
        try:
            self.runs_ahead()
            if self._lent:
                return not self._more_after_lent()
            # NOTE (the epoch ends when its caller sees it end): the run-ahead stops short of
            # the epoch's end (FINISH: the rows it drops, the source's stop, loader.epoch's
            # count), which the caller's next step makes, as it does without running ahead. A
            # state saved at the epoch's last step is then the same either way (the epoch
            # running, at its end), and a loop resumed from it, keyed on its own epoch counter
            # or on loader.epoch, first ends that epoch; once ended ahead, the state said the
            # next one, and a resumed run trained one epoch more (Accelerate under gradient
            # accumulation, checkpointing at an epoch's last step).
            # (batches taken back by a state, handed out first, are batches left too)
            while self._direct is None and not self._owed and not self._short and not self._replay:
                if self._phase in (_Phase.FINISH, _Phase.DONE, _Phase.CLOSED):
                    return True
                self._advance()
            return False
        except BaseException:
            self.raised = True
            self.close()
            raise
        finally:
            if self._handed_out is not None:  # the run-ahead is the loader's time, not the caller's
                self._handed_out += perf_counter() - t0

    def close(self, resumable: bool = True) -> None:
        """End the iterator: stop its fetcher (and prefetch thread) and hand the epoch back.

        A started epoch that did not end counts as abandoned: the next iterator starts the next
        epoch. Closing twice is harmless.

        Args:
            resumable: whether a state saved before the next epoch starts resumes this one
                where it stopped (the default, as after ``break``: a run saved after leaving
                its loop goes on from there). False ends the epoch here for good (a framework
                that ends its epochs early, e.g. Lightning's ``limit_train_batches``): the state
                then starts the next epoch, as the run does.
        """
        if self._phase in (_Phase.DONE, _Phase.CLOSED):
            return
        if self._owner is None and self._owner_ref() is None:  # the loader was dropped
            self._phase = _Phase.CLOSED
            self._stop_fetch()
            return
        running = self.running
        if running and resumable:
            self._loader._ahead = self.ahead_scores()
        self._phase = _Phase.CLOSED
        # Batches agreed on but not handed out stay in the loader's pending rows: the next epoch
        # yields them (nothing selected is lost).
        self._owed = self._short = 0
        # A direct batch made ready but not handed out (finishing() ran ahead to it) is handed
        # out next too, after those taken back: its source batch was consumed. (A passthrough
        # policy's next epoch, a whole pass, drops them instead: see SelectiveLoader.
        # _drop_abandoned_rest; a state saved before it begins keeps them.)
        ready = [] if self._direct is None else [self._direct.rows()]
        handed, self._direct, self._handed = self._handed, None, []
        why, self._lent = self.untakeable(), False
        self._loader._returned[:0], self._replay = [*self._replay, *ready], []
        self._stop_fetch()
        if running:
            self._loader._abandon(self, resumable, handed, why)

    def __del__(self) -> None:
        # NOTE: a `for` loop left with `break` drops its iterator; closing it here stops the
        # prefetch thread and the source's epoch (FFCV's batch threads) at once, instead of at
        # the next iter(loader) or never. The iterator is in no reference cycle (the fetcher's
        # callables hold the source and the loader's policy, never the iterator).
        try:
            if threading.current_thread().name.startswith(_THREAD_PREFIX):
                self._close_later()
            else:
                self.close()
        except Exception:  # nothing can be reported from a finalizer
            pass

    def _close_later(self) -> None:
        """Close this iterator at its loader's next use (what :meth:`__del__` does on one of
        the loader's own threads), asking its prefetch thread to stop now.

        NOTE: an iterator held in a reference cycle (a trainer object that refers to itself) is
        freed by the cyclic garbage collector on whichever thread allocates, the selection or
        prefetch thread among them. Closed there, it waited for the pass running on that same
        thread (or for that thread to end): the thread never ended, and with
        ``overlap_selection`` the interpreter's exit waited for it for ever. Neither waits now;
        the loader closes the iterator (saving what it held ahead) on the caller's thread, as
        the finalizer would have.
        """
        fetch = self._fetch
        if fetch is not None:
            fetch.request_stop()
        loader = self._owner if self._owner is not None else self._owner_ref()
        if loader is not None:
            loader._orphans.append(self)
            return
        # (the loader is gone: nothing to hand back; its threads are stopped without waiting)
        self._phase = _Phase.CLOSED
        thread, self._thread, self._fetch = self._thread, None, None
        if thread is not None:
            thread.close(wait=False)

    # ------------------------------------------------------------------ steps
    def _advance(self) -> None:
        phase = self._phase
        if phase is _Phase.NEW:
            self._begin()
        elif phase is _Phase.SOURCE:
            self._source_step()
        elif phase is _Phase.DRAIN:
            self._drain_step()
        elif phase is _Phase.REMAINDER:
            self._remainder_step()
        elif phase is _Phase.FINISH:
            self._finish()

    def _begin(self) -> None:
        loader = self._loader
        epoch, skip, resumed, stats, replay = loader._begin(self)
        self.epoch, self.position, self.stats, self._replay = epoch, skip, stats, replay
        # (a resumed epoch goes on from the share its saved run agreed on, the same on every rank)
        self._shared, loader._share = (loader._share if resumed else None), None
        ahead, loader._ahead = loader._ahead, None
        if resumed and ahead is not None and ahead.epoch == epoch:
            self._resume_scores = ahead
        # NOTE: where this epoch's batches go, resolved once as it begins (the model is not
        # walked for every source batch): a model moved between epochs is followed from the
        # next one; one moved mid-epoch fails loudly in the caller's forward (device mismatch).
        self._device = loader.device
        policy = loader.policy
        self._fresh = policy.needs_losses(epoch)
        self._passthrough = policy.passthrough()
        # A passthrough policy hands out a pass's rest as one short batch, as the source's own
        # last batch would be, whatever ``remainder`` says for selected rows; except with
        # ``batches_per_epoch``, whose training epochs are of full batches: there ``remainder``
        # ("carry" or "drop") applies at the end of the pass, as for every policy.
        fixed = loader.batches_per_epoch is not None
        self._remainder = "short" if self._passthrough and not fixed else loader.remainder
        # Whether rows of different source batches are joined into training batches this epoch:
        # always when selecting; for a passthrough policy, where the source's batches are not
        # already training batches (another batch size, or rows left out by ``subset`` after
        # loading), or where a pass's rest is carried into the next (``batches_per_epoch``).
        # NOTE: a source that leaves the rows outside ``subset`` out before loading and
        # re-batches the rest (a DataLoader's) yields training batches already; counted as
        # joining, a dynamically padded one was refused on its second batch ("cannot be
        # joined") although none of its rows were ever joined.
        source = loader.source
        subset_joins = loader._subset is not None and not (
            loader._epoch_prefilter and source.refills_batches()
        )
        self._joins = (
            not self._passthrough or fixed or source.batch_size != loader.batch_size or subset_joins
        )
        self._filtering = source.can_filter()
        # (whether it loads part of the epoch is the loader's decision, made as it began)
        keep = (
            Keep(policy, loader._subset, _weakly(source.replaying))
            if loader._epoch_prefilter
            else None
        )
        snapshot = source.snapshot

        def make_iter() -> Any:
            return source.epoch(skip, keep)

        # NOTE: the source's snapshot and the tally of what it left out travel with each batch,
        # taken right after it on the fetching thread: the state saved mid-epoch is that of the
        # last batch consumed, never of the ones fetched ahead (by the prefetch thread, or by
        # the source itself: see Keep).
        def read_tally() -> tuple[int, int, Any]:
            rejected, excluded = (0, 0) if keep is None else keep.counted()
            return (rejected, excluded, snapshot())

        loader._source_state = snapshot()

        self._fetch = (
            Prefetcher(make_iter, loader.prefetch, read_tally)
            if loader.prefetch
            else Synchronous(make_iter, read_tally)
        )
        if loader._sync is not None:
            loader._sync.bind(self._device)
        self._start = perf_counter()
        self._phase = _Phase.SOURCE
        # NOTE: on several ranks the condition must not depend on the rank's own position: a
        # rank that had loaded no source batch yet (skip == 0) still takes part.
        if skip or (resumed and loader._sync is not None):
            # Resuming mid-epoch: first the batches the saved round still owed, so that the next
            # selection pass runs after the caller's steps on them, as it would have.
            # (made before any source batch is loaded: the first batches' comparison, which
            # warns of an unsharded source, waits for the next agreement)
            self._owed = self._agree(loader._pending.full_batches(loader.batch_size), digest=False)

    def _source_step(self) -> None:
        loader, stats = self._loader, self.stats
        assert self._fetch is not None and stats is not None and self.epoch is not None
        self._exchanged = self._agreed = self._rounded = self._forwarding = False
        loaded, self._next = self._next, None
        failed, self._ahead_failed = self._ahead_failed, None
        if failed is not None:  # (loading this source batch ahead raised: see _score_ahead)
            self._stage = _LOADING
            self._report_raised(failed)
            raise failed
        if loaded is None and self._exhausted is None:
            try:
                loaded = self._load()
            except Exception as e:
                self._report_raised(e)
                raise
        if loaded is None:
            tally = self._exhausted if self._exhausted is not None else self._fetch.last_tally
            self._count_unloaded(tally)
            loader._source_state = tally[2]
            self._phase = _Phase.DRAIN if loader._sync is not None else _Phase.REMAINDER
            return
        # NOTE (a batch not taken is not consumed): where taking the batch raises before its
        # chosen rows are kept (a model that raises, a transient out-of-memory error in its
        # selection pass or in gathering the rows it keeps, nonfinite="raise"), the position,
        # the source's snapshot and the counts go back to before it, so that a state saved
        # afterwards reads it again instead of skipping its examples (the next iter(loader)
        # starts the next epoch, as after ``break``; ``loader.load_state_dict(
        # loader.state_dict())`` goes on with this one). Where the policy had already decided
        # (the error came while gathering), the resumed run decides that batch again, having
        # seen its losses once more: not the uninterrupted run's choice, but nothing skipped.
        # On one process only: under DDP the ranks stop together and another rank may have
        # taken its batch of the round.
        undo = self._counts()
        self._committed = False
        try:
            self._take(loaded)
        except BaseException as e:
            if isinstance(e, Exception):
                self._report_raised(e)
            if not self._committed and loader._sync is None:
                self._restore_counts(undo)
            raise

    def _report_raised(self, error: Exception) -> None:
        """An exception raised in this rank's source step (loading its source batch, its
        selection pass, the policy's decision, keeping the rows it chose): on several ranks,
        where the round's agreement is still to be made, the rank makes the round's remaining
        collectives and reports it there, and every rank raises (:meth:`_stop_pass`); otherwise
        (one process, an exception in a selection forward under FSDP, an error the agreement
        reported or met after it) the caller raises it as it is.

        NOTE: raised on this rank alone (a corrupt file in its share of the data, a model that
        cannot take one of its batches), it left the others waiting in their next collective
        until the process group timed out, or until this rank's process ended and gloo closed
        its connections ("Connection closed by peer"), neither naming the error nor the rank.
        """
        if self._reports_raised() and not self._agreed:
            self._stop_pass(error)

    def _kept(self, targets: Any, positions: np.ndarray | None, k: int) -> None:
        """The source batch's ``k`` chosen rows (at ``positions``; all if None) are kept: its
        taking took effect (see :meth:`_source_step`), and they are counted."""
        stats = self.stats
        assert stats is not None
        self._committed = True
        stats.count_classes(targets, positions)
        stats.examples_selected += k

    #: The epoch's stats that taking a source batch adds to (see _source_step).
    _TAKEN_STATS = ("source_s", "examples_seen", "prefiltered", "excluded")

    def _counts(self) -> tuple[Any, ...]:
        """The position, the source's snapshot and the counts that taking a batch changes."""
        stats = self.stats
        assert stats is not None
        taken = tuple(getattr(stats, name) for name in self._TAKEN_STATS)
        return (self.position, self._loader._source_state, self._counted, taken)

    def _restore_counts(self, counts: tuple[Any, ...]) -> None:
        """Put back what :meth:`_counts` took."""
        self.position, self._loader._source_state, self._counted, taken = counts
        for name, value in zip(self._TAKEN_STATS, taken):
            setattr(self.stats, name, value)

    def _take(self, loaded: _Loaded) -> None:
        """Score, decide and keep the rows of the source batch ``loaded`` (see _source_step)."""
        self._stage = _SELECTING
        loader, stats = self._loader, self.stats
        assert stats is not None and self.epoch is not None
        stats.source_s += loaded.waited
        self._count_unloaded(loaded.tally)  # examples left out before loading, up to this batch
        loader._source_state = loaded.tally[2]
        self.position += 1
        device = loaded.device
        data, indices, n = loaded.data, loaded.indices, loaded.n
        stats.excluded += loaded.excluded
        stats.examples_seen += n
        if not n and (loader._sync is None or not self._passthrough):
            # NOTE: a source batch without examples (an iterable source's empty batch, or one
            # whose rows ``subset`` all leaves out) has nothing to score, select or hand out; it
            # still counts as a source batch, so that a resume skips it like the others. On
            # several ranks this rank still makes the round's collectives, as a rank whose
            # source has ended does, its source still going; a passthrough round goes on below,
            # where no rows make an empty part.
            if loader._sync is not None:
                self._batchless_collectives()
                self._owed = self._agree(loader._pending.full_batches(loader.batch_size))
            return
        scorer, codec = loader._scorer, loader._codec
        inputs, targets = data[codec.input_position], data[codec.target_position]
        probing = not loader._probed and bool(n) and loader.policy.uses_losses()
        if scorer.collective and loader._sync is not None:
            # (before the round's forwards: a candidate to share with a rank that has none)
            scorer.keep_template(inputs, targets, codec.view(data))
        probes = scorer.probe_forwards(inputs, targets) if probing and not self._fresh else 0
        pad = self._selection_round(scorer.chunks(n) if self._fresh else probes)
        probed = None
        if not loader._probed:
            loader._probed = True
            if n and not self._fresh and loader.policy.uses_losses():
                probed = scorer.probe(inputs, targets, codec.view(data), indices)
        if not self._fresh:
            self._pad(pad)
        if probed is not None:
            # (e.g. Kath18's losses >= 0: checked before its warm-up ends, once the round's
            # forwards are all run; an exception here is reported to the other ranks as any of
            # the round's: _report_raised)
            loader.policy.check_losses(probed)
        targets = data[loader._codec.target_position]
        if loader._counted_full and n != loader.batch_size:
            self._check_counted_full(n)
        if self._passthrough:
            self._stage = _KEEPING
            inputs = data[loader._codec.input_position]
            features = scorer.features(inputs, None, None, indices, self.epoch, stats)
            logits = scorer.logits(None, None, n, device)
            # The source's batch is a training batch: handed out as it is (the fast path).
            # NOTE: a source batch of another size (a source batched otherwise, rows left out by
            # ``subset``, or its short last batch) is re-batched, and what is left when the pass
            # ends is handed out as one short batch (see _remainder_step), as the source's own
            # last batch would be: every example once per pass, in order, in batches of
            # batch_size. Rows kept for a later batch are copies (FFCV reuses its buffers).
            # One agreement either way: the ranks make the same collectives.
            direct = n == loader.batch_size and not len(loader._pending) and not self._copy_direct
            if direct and self._agree(1):
                self._direct = WholeBatch(data, indices, n, device, features, logits)
                self._kept(targets, None, n)
                return
            copied = _gather(data, np.arange(n, dtype=np.int64), device)
            loader._pending.add(
                metadata_rows(
                    copied, None, None, indices, n, device, features=features, logits=logits
                )
            )
            self._kept(targets, None, n)
            if not direct:  # (a direct batch another rank had no batch for waits for the next)
                self._owed = self._agree(loader._pending.full_batches(loader.batch_size))
            return
        t0 = perf_counter()
        scored = None
        if self._fresh:
            inputs = data[loader._codec.input_position]
            batch = loader._codec.view(data)
            scored = self._scored(loaded, inputs, targets, indices, batch)
            self._pad(pad)
            loader.policy.advance(self.epoch + self.fraction())
            if loader._decider is not None:
                self._decide_on_device(scored, data, indices, n, t0)
                self._score_ahead()
                return
        try:
            choice = self._decide(scored, indices, n)
        except NonFiniteLoss as e:
            self._stop_round(_NONFINITE, e)
        stats.selection_s += perf_counter() - t0
        positions = choice.positions
        k = len(positions)
        self._stage = _KEEPING
        if k:
            inputs = data[loader._codec.input_position]
            # NOTE (one copy of the positions): the data's gather and the losses' share it.
            pos_t = torch.from_numpy(positions).to(device, non_blocking=True)
            rows = metadata_rows(
                _gather(data, positions, device, pos_t),
                positions,
                choice,
                indices,
                k,
                device,
                None if scored is None else scored.losses,
                features=scorer.features(inputs, scored, positions, indices, self.epoch, stats),
                logits=scorer.logits(scored, positions, k, device),
                positions_t=pos_t,
            )
            loader._pending.add(rows)
        self._kept(targets, positions, k)
        self._score_ahead()
        self._owed = self._agree(loader._pending.full_batches(loader.batch_size))

    def _check_counted_full(self, n: int) -> None:
        """Warn (once per loader) where ``len()`` counted the source's batches as full batches
        of ``batch_size`` and a source batch before the last has ``n`` examples: the count is
        off (a bucketing ``batch_sampler=``), and a scheduler sized from it is too."""
        loader = self._loader
        if loader._counted_full_warned:
            return
        try:
            last = self.position >= len(loader._source)
        except TypeError:
            last = False
        if last:
            return
        loader._counted_full_warned = True
        warnings.warn(
            f"len(loader) counted the source's batches as full batches of batch_size="
            f"{loader.batch_size} (a batch_sampler= with no sampler of its own), but source "
            f"batch {self.position} of epoch {self.epoch} has {n} examples: batches of other "
            "sizes are re-batched, so the epoch yields another number of batches than len() "
            'said; pass batches_per_epoch="expected" (or an int) for a fixed count, or key '
            "schedules on loader.progress",
            UserWarning,
            stacklevel=4,
        )

    def _load(self) -> _Loaded | None:
        """The next source batch, on the loader's device and within ``subset``, or None at the
        end of the source; nothing is counted until it is consumed."""
        loader = self._loader
        assert self._fetch is not None
        t0 = perf_counter()
        stage, self._stage = self._stage, _LOADING
        try:
            (raw, indices), tally = self._fetch.next()
        except StopIteration:
            self._stage = stage
            return None
        waited = perf_counter() - t0
        device = self._device
        data, n = loader._codec.columns(raw, indices, device)
        if self._joins:
            # NOTE (ragged fields fail at load time): rows of different source batches are
            # joined into one training batch only later, when enough are kept, so a field whose
            # trailing sizes change from batch to batch (dynamic padding) would fail in torch.cat
            # at a point that depends on which rows the policy kept, possibly hours into a run.
            # Checked here on every source batch of a re-batching epoch (one shape comparison
            # per tensor field), it fails on the first batch that differs. A passthrough epoch
            # whose source batches are training batches hands each out whole and joins none.
            # On several ranks the round goes on (its rows are only joined later) and its
            # agreement raises on every rank (see _fail).
            try:
                loader._codec.check_shapes(
                    data, f"source batch {self.position + 1} (counted from 1) of epoch {self.epoch}"
                )
            except ValueError as e:
                self._fail(_SHAPES, e)
        if loader._sync is not None:
            loader._sync.note_batch(data[loader._codec.input_position])
            loader._sync.note_indices(indices)
        excluded = 0
        if loader._subset is not None and not self._filtering:
            assert indices is not None
            positions = np.flatnonzero(in_subset(loader._subset, indices))
            if len(positions) < n:
                excluded = n - len(positions)
                data, indices, n = (
                    _gather(data, positions, device),
                    indices[positions],
                    len(positions),
                )
        self._stage = stage  # (loaded: an exception from here on is of the stage it loads in)
        return _Loaded(data, indices, n, tally, excluded, waited, device)

    def _score_ahead(self) -> None:
        """With ``overlap_selection``, in an epoch with selection passes: fetch the next source
        batch and start its selection pass on the selection thread, with the selection copy
        refreshed from the model as it is now (before the caller's steps on the batches this
        source batch made ready).

        NOTE: called after the current source batch's rows were gathered: an FFCV loader may
        reuse a batch's buffers once the next one is fetched.
        """
        loader = self._loader
        copy = loader._overlap
        if copy is None or not self._fresh or self._next is not None:
            return
        if self._exhausted is not None or self._ahead_failed is not None:
            return
        # NOTE: an error loading the next source batch, or refreshing the selection copy for
        # it (a model that can no longer be copied), is raised when that batch is taken, as a
        # load or selection error without overlap is: raised here, the rows of the batch just
        # taken, kept but not handed out, came only in the next epoch (yielded twice where the
        # epoch was run again).
        stage = self._stage
        try:
            loaded = self._load()
        except Exception as e:
            self._stage, self._ahead_failed = stage, e
            return
        if loaded is None:
            assert self._fetch is not None
            self._exhausted = self._fetch.last_tally
            return
        self._next = loaded
        if not loaded.n:
            return
        scorer, codec, data = loader._scorer, loader._codec, loaded.data
        try:
            copy.sync(scorer.selection_model)
        except Exception as e:  # (raised when the batch is taken, as a load error is)
            loaded.failed = e
            return
        model = copy.model
        inputs, targets = data[codec.input_position], data[codec.target_position]
        batch = codec.view(data)
        if self._thread is None:
            self._thread = SelectionThread()
        loaded.future = self._thread.submit(
            lambda: scorer.run(model, inputs, targets, batch), loaded.device, data
        )

    def _scored(
        self, loaded: _Loaded, inputs: Any, targets: Any, indices: np.ndarray | None, batch: Any
    ) -> Scored:
        """The selection pass over a consumed source batch: scored now, collected from the
        selection thread, or restored from a saved state (``overlap_selection``)."""
        loader, stats = self._loader, self.stats
        assert stats is not None and self.epoch is not None
        scorer = loader._scorer
        saved, self._resume_scores = self._resume_scores, None
        if saved is not None:
            saved.check(self.epoch, self.position, indices, loaded.n)
            scored = scorer.restore(saved.losses, saved.logits, loaded.device)
            stats.selection_hidden_s += saved.seconds
            scorer.count(scored, stats)
            return scored
        if loaded.failed is not None:
            raise loaded.failed
        if loaded.future is None:
            return scorer.score(inputs, targets, indices, self.epoch, stats, batch)
        t0 = perf_counter()
        out, ran = loaded.future.result()
        scored = SelectionThread.collect(out, loaded.device)
        waited = perf_counter() - t0
        stats.selection_forward_s += waited
        stats.selection_hidden_s += max(ran - waited, 0.0)
        scorer.count(scored, stats)
        return scored

    def ahead_scores(self) -> AheadScores | None:
        """The scores of the next source batch, computed ahead by ``overlap_selection`` and not
        consumed yet (what :meth:`SelectiveLoader.state_dict
        <sbloader.SelectiveLoader.state_dict>` keeps), or None: waits for its pass to end; a
        pass that raised counts as none (its error is raised when the batch is consumed)."""
        if self._resume_scores is not None:
            return self._resume_scores
        loaded = self._next
        if loaded is None or loaded.future is None or self.epoch is None:
            return None
        try:
            out, ran = loaded.future.result()
        except Exception:  # re-raised when the batch is consumed, if ever
            return None
        scored = SelectionThread.collect(out, loaded.device)
        return AheadScores(
            self.epoch,
            self.position + 1,
            None if loaded.indices is None else np.array(loaded.indices, dtype=np.int64),
            scored.losses,
            scored.logits,
            self._loader._scorer.chunks(loaded.n),
            ran,
        )

    def _decide_on_device(
        self, scored: Scored, data: list[Any], indices: np.ndarray | None, n: int, t0: float
    ) -> None:
        """The rest of a source step with ``decisions="device"``: decide and gather on the
        losses' device (see :mod:`sbloader.device_decisions`)."""
        loader, stats = self._loader, self.stats
        assert stats is not None and loader._decider is not None
        losses = scored.losses.detach()
        try:
            choice = loader.policy.choose_device(
                losses, loader._decider.get(losses.device), loader.nonfinite
            )
        except NonFiniteLoss as e:
            self._stop_round(_NONFINITE, e)
        loader._scorer.settle_forward_time(stats)
        stats.selection_s += perf_counter() - t0
        k = len(choice)
        self._stage = _KEEPING
        if k:
            loader._pending.add(device_rows(data, choice, indices, self._device, scored.losses))
        self._committed = True
        stats.nonfinite += choice.nonfinite
        # NOTE: the kept positions stay on the device: class counts would need them on the host
        # every source batch, so they are unknown (None), never partial.
        stats.class_seen = stats.class_selected = None
        stats.examples_selected += k
        self._owed = self._agree(loader._pending.full_batches(loader.batch_size))

    def _batchless_collectives(self) -> None:
        """The collectives a rank makes in a round before its agreement when it has no source
        batch to score (its source ended, or its batch has no examples): the FSDP padding
        forwards and the loss exchange, with nothing of its own."""
        loader = self._loader
        sync = loader._sync
        assert sync is not None
        if loader._scorer.collective:
            self._pad(self._selection_round(0))
            loader._probed = True  # as on the ranks that probed this round
        if loader._sharing() and not self._passthrough:
            self._observe(self._exchange(None, None))

    def _drain_step(self) -> None:
        """One round of the other ranks' with no new data (see :mod:`sbloader.distributed`).

        NOTE: without this, a rank with fewer source batches (an uneven source, Stale-SB's
        prefiltering) would stop making collectives while the others wait in theirs.
        """
        loader = self._loader
        sync = loader._sync
        assert sync is not None
        self._batchless_collectives()
        # NOTE: whether this rank's pass was empty travels in the round's one all_reduce; in the
        # last round (no rank active) every rank learns whether any rank's was, so that
        # loader._end refuses it on every rank: a rank raising alone would leave the others
        # waiting in the next pass's first collective.
        assert self.stats is not None
        count, active = sync.agree(
            loader._pending.full_batches(loader.batch_size),
            active=False,
            empty=self.stats.examples_seen == 0,
            failed=self._failed_kind(),
            share=self.fraction(),
        )
        self._shared = sync.least_share
        self._raise_reported(sync)  # another rank's error, met in this round
        self._owed = count
        if not active:
            self.empty_rank = sync.empty_rank
            self._phase = _Phase.REMAINDER

    def _remainder_step(self) -> None:
        # NOTE: on several ranks a rank may hold more than a batch here (the others select
        # less); "short" then yields one batch on every rank or on none, and drops the rest, so
        # that batch counts stay equal. The batch has the same size on every rank (the fewest
        # any rank holds, up to batch_size): DDP averages each rank's mean loss, which is the
        # mean over the step's examples only when every rank's batch is as large.
        loader = self._loader
        pending = len(loader._pending)
        if self._remainder == "short":
            mine = min(pending, loader.batch_size) if pending >= loader.last_batch_min else 0
            self._short = self._agree(mine, active=False)
        self._phase = _Phase.FINISH

    def _finish(self) -> None:
        loader, stats = self._loader, self.stats
        assert stats is not None
        loader._keep_ended()  # (before anything of the end runs: see keep_ended_state)
        if loader._sync is not None:
            loader._sync.check_overlap()  # the ranks' indices, after a whole pass (once)
        if self._remainder != "carry":
            stats.dropped += loader._pending.clear()
        self._phase = _Phase.DONE
        self._stop_fetch()
        loader._end(self)

    # ------------------------------------------------------------------ batches
    def _next_ready(self) -> B.SelectedBatch | None:
        """A batch owed to the caller, or None."""
        loader = self._loader
        if self._replay:
            return self._build(self._replay.pop(0))
        if self._direct is not None:
            rows, self._direct = self._direct, None
            return self._build(rows, lent=loader._source.reuses_buffers())
        if self._owed:
            self._owed -= 1
            return self._build(loader._pending.pop(loader.batch_size, loader._codec.pads))
        if self._short:
            n, self._short = self._short, 0
            return self._build(loader._pending.pop(n, loader._codec.pads))
        return None

    def _build(self, rows: Rows | WholeBatch, lent: bool = False) -> B.SelectedBatch:
        """The yielded batch: the source's structure, with the selection results attached;
        ``lent``: ``rows`` are the source's own reused buffers."""
        loader, stats = self._loader, self.stats
        assert stats is not None
        try:
            batch = loader._codec.build(
                rows, loader.policy.normalize_weights(), loader.source.has_indices()
            )
        except BaseException:
            # NOTE: rows not handed out (an out-of-memory error in joining them, an interrupt)
            # are handed out first when the epoch goes on, and a state saved now keeps them
            # (close() takes them back with the others); before, they were lost.
            if isinstance(rows, WholeBatch):
                self._direct = rows
            else:
                self._replay.insert(0, rows)
            raise
        stats.examples_yielded += len(rows)
        stats.batches_yielded += 1
        # NOTE: a batch handed out as the source's own reused buffers (FFCV's ring) can be
        # taken back only while it is the last one: once the next is made, the source has read
        # on, and the ring may hold other examples where it was; a copy then would be wrong,
        # unsaid. Its place is given up (state_dict says why a take-back that needs it fails).
        kept = [] if self._lent else self._handed[len(self._handed) + 1 - MAX_UNCONSUMED :]
        # NOTE: What a state takes back is a copy made as the batch is handed out
        #     The batch shares its tensors with ``rows``, and a training step may change them
        #     in place (``x.sub_(mean)``, ``batch.weights.mul_(...)``) before it raises and the
        #     state taking the batch back is saved: a copy made then would resume a changed
        #     batch, silently. One copy of each batch handed out (as large as the batch, on its
        #     device) is the price; :data:`MAX_UNCONSUMED` of them are held.
        held = rows.copy_whole() if isinstance(rows, WholeBatch) else rows.copy()
        self._handed, self._lent_before, self._lent = [*kept, held], self._lent, lent
        return batch

    def _more_after_lent(self) -> bool:
        """Whether the epoch hands out another batch after the source's own batch handed out
        last, known from the source's size: taking its next batch would let the source
        overwrite the one the caller holds (see :meth:`finishing`).

        NOTE: that batch was a whole source batch handed out as it is, which happens only in a
        passthrough epoch whose source batches are training batches, with nothing pending. So
        the source batches read so far were full, and the examples left, ``epoch_size`` less
        ``position`` full batches, make full batches and a short last one of at least
        ``min_batch_size`` (as :meth:`_remainder_step` hands it out). Exact where every rank has
        as many examples left (FFCV's distributed order gives every rank a share of one size).
        """
        loader = self._loader
        size = loader._source.epoch_size
        if size is None:
            raise RuntimeError(
                f"finishing() cannot tell whether {type(loader._source).__name__} has another "
                "batch without taking it, which would overwrite the batch handed out last (the "
                "source reuses its buffers and its epoch size is unknown); call "
                "runs_ahead() before the first batch when calling finishing() after each batch"
            )
        left = size - self.position * loader.batch_size
        return left >= min(loader.batch_size, loader.last_batch_min)

    def fraction(self) -> float:
        """The share of this epoch's source data drawn so far, in [0, 1]: candidates drawn (also
        those rejected before loading and those outside ``subset``) against the examples of an
        epoch, or source batches against the source's length where its size is unknown; 0 for a
        source of neither (see :attr:`SelectiveLoader.progress
        <sbloader.SelectiveLoader.progress>`)."""
        if self.stats is None:
            return 0.0
        loader = self._loader
        return pass_fraction(loader._source, self.stats, self.position, loader._epoch_prefilter)

    def shared_fraction(self) -> float:
        """The share of this epoch's source data drawn so far as every rank reports it (see
        :attr:`SelectiveLoader.progress <sbloader.SelectiveLoader.progress>`): on several ranks
        the smallest share any rank had drawn at the last agreement, else :meth:`fraction`.

        NOTE: the ranks load their source batches in lockstep, one per round, but a round's
        batch may span other numbers of candidates on each rank (a Stale-SB stale epoch loads
        only the candidates it keeps, each rank its own), so that each rank's own share, and a
        learning rate keyed on it, differed between ranks: DDP averaged the gradients, each rank
        stepped with its own learning rate, and the replicas' weights drifted apart, unsaid.
        """
        return self.fraction() if self._shared is None else self._shared

    def agreed_share(self) -> float | None:
        """The share of :meth:`shared_fraction` as the ranks last agreed on it, or None (one
        process, or no agreement yet): what a state saved now holds."""
        return self._shared

    def takeable(self) -> int:
        """How many of the batches handed out last a state saved now can take back (see
        :meth:`SelectiveLoader.state_dict <sbloader.SelectiveLoader.state_dict>`'s
        ``unconsumed``): those handed out in this epoch, at most :data:`MAX_UNCONSUMED`, and
        none before a batch handed out as the source's own reused buffers (see :meth:`_build`)."""
        return len(self._handed)

    def untakeable(self) -> str:
        """Why the batch before those :meth:`takeable` counts cannot be taken back (for the
        error that refuses it)."""
        if self._lent_before:
            return (
                "was the source's own reused buffers, which it has overwritten since (an FFCV "
                "source with a passthrough policy; call runs_ahead() on the epoch's iterator "
                "before its first batch to have such batches handed out as copies)"
            )
        return "was handed out by an earlier pass over the data, which has ended"

    def _not_trained(self, unconsumed: int) -> list[Rows]:
        """The batches a state saved now must hand out first when resumed: the ``unconsumed``
        handed out last, in order (fetched ahead by a framework, and the one a step that raised
        was training on: not trained yet), then those taken back by the state this epoch
        resumed and not handed out yet, then a source batch made ready whole and not handed out
        yet (:meth:`finishing` runs ahead to it; its source batch counts as consumed).

        NOTE: the last batch handed out and a batch made ready may be a source's own batch
        (a passthrough policy's fast path), which an FFCV source overwrites as the epoch goes on
        (its ring of reused buffers): the state gets copies of their data, not views.
        """
        ready = [] if self._direct is None else [self._direct.copy()]
        if not unconsumed:
            return [*self._replay, *ready]
        if unconsumed > len(self._handed):
            raise ValueError(
                f"unconsumed={unconsumed}, but this epoch can take back only the last "
                f"{len(self._handed)} batches it handed out; pass the number of batches the "
                "caller has fetched from the loader and not trained on"
            )
        taken = [rows.copy() for rows in self._handed[len(self._handed) - unconsumed :]]
        return [*taken, *self._replay, *ready]

    # ------------------------------------------------------------------ decisions
    def _selection_round(self, real: int) -> int:
        """How many padding selection forwards this rank runs this round after its ``real`` ones:
        under FSDP on several ranks, as many as make every rank run the same number (the most
        any rank runs); otherwise 0, without a collective. A rank without a candidate to pad
        with gets one from a rank that has one (:meth:`_adopt_template`).

        NOTE: whether the ranks agree is decided alike on every rank (a fresh epoch, or the
        first round's probe), so that they all make this collective or none does.
        """
        loader = self._loader
        sync, scorer = loader._sync, loader._scorer
        if not self._rounds_forwards():
            return 0
        assert sync is not None
        most, stuck = sync.most(real, not real and not scorer.can_pad, self._failed_kind())
        self._rounded = True
        if sync.failed is not None:
            # An error a rank met before the round's forwards (loading its source batch): every
            # rank raises here, none running a forward the others would wait in, and none
            # reports it again (the agreement that reports it is made).
            self._agreed = True
            self._raise_reported(sync)
        if stuck and most and self._adopt_template(sync, scorer):
            stuck = False
        if stuck and most:
            self._agreed = True  # (raised alike on every rank, after this agreement: no report)
            raise RuntimeError(
                "under FSDP every rank runs as many selection forwards as the others, but a rank "
                "had no candidate yet to run them on (its source was empty when the others' "
                "was not); give every rank data in each epoch (e.g. a DistributedSampler)"
            )
        self._forwarding = most > 0
        return most - real

    def _adopt_template(self, sync: RankSync, scorer: Scorer) -> bool:
        """Give every rank without a padding candidate that of the lowest rank with one
        (:meth:`RankSync.share <sbloader.distributed.RankSync.share>`); whether one had it.

        NOTE: a resumed process has scored nothing yet, so a rank whose source ends in its first
        fresh round after the resume (the other's still going) had no candidate to pad with,
        and the run was refused ("a rank had no candidate yet"), though the uninterrupted run
        went on. The candidate is not in the state (it is data); a rank scoring this round keeps
        one before its forwards, so some rank has one whenever any runs a forward.
        """
        host = scorer.host_template()
        found, shared = sync.share(host, host is not None)
        if found and host is None:
            scorer.adopt_template(shared, self._device)
        return found

    def _rounds_forwards(self) -> bool:
        """Whether the ranks agree on this round's selection forwards (:meth:`_selection_round`:
        under FSDP on several ranks, in a fresh epoch or the first round's probe), decided alike
        on every rank."""
        loader = self._loader
        probing = not loader._probed and not self._fresh and loader.policy.uses_losses()
        return loader._sync is not None and loader._scorer.collective and (self._fresh or probing)

    def _pad(self, count: int) -> None:
        """This rank's ``count`` padding selection forwards of the round (:meth:`Scorer.pad
        <sbloader.scoring.Scorer.pad>`): the last of its forwards."""
        self._loader._scorer.pad(count)
        self._forwarding = False

    def _agree(self, ready: int, active: bool = True, digest: bool = True) -> int:
        """How many of ``ready`` batches to yield now: all of them on one process; on several
        ranks the fewest any rank has ready, so that every rank makes the same number of steps.
        On several ranks it raises, on every rank, where any rank met an error in the round
        (see :meth:`_fail`). ``digest=False`` for an agreement made before any source batch is
        loaded (see :meth:`RankSync.agree <sbloader.distributed.RankSync.agree>`)."""
        sync = self._loader._sync
        if sync is None:
            return ready
        self._agreed = True
        count = sync.agree(
            ready, active, digest, failed=self._failed_kind(), share=self.fraction()
        )[0]
        self._shared = sync.least_share
        self._raise_reported(sync)
        return count

    def _failed_kind(self) -> int:
        """The kind of the error this rank met in the round (0: none), for its agreement."""
        return 0 if self._failure is None else self._failure[0]

    def _fail(self, kind: int, error: Exception) -> None:
        """This rank met ``error`` (of kind ``kind``, see ``_REPORTED``): raised at once on one
        process; on several ranks held until the round's agreement (:meth:`_agree`), its last
        collective, which reports it to every rank, and every rank raises then.

        NOTE: raised here on one rank alone, it would leave the others waiting in the round's
        collectives until the process group times out (or torchrun ends the job), and only this
        rank's log would say why. The round goes on with its data instead: every rank makes the
        same collectives as in any round, and the error travels in the agreement's
        ``all_reduce`` (one more integer, no collective more in the round); its message follows
        in the broadcasts of :meth:`_raise_reported`, made only once a rank has failed.
        """
        if self._loader._sync is None:
            raise error
        if self._failure is None:
            self._failure = (kind, error)

    def _stop_round(self, kind: int, error: Exception) -> NoReturn:
        """This rank cannot go on with the round (``error``, of kind ``kind``): raised at once on
        one process; on several ranks its agreement, made now, raises on every rank."""
        self._fail(kind, error)
        self._agree(self._loader._pending.full_batches(self._loader.batch_size))
        raise AssertionError("unreachable: the agreement reports the error and raises")

    def _reports_raised(self) -> bool:
        """Whether an exception raised in this rank's round is reported to the other ranks
        (:meth:`_stop_pass`): on several ranks, except while the rank runs its selection
        forwards under FSDP.

        NOTE (FSDP): there a selection forward is itself a collective, so a rank whose forward
        raised may have left the others waiting inside theirs (an all-gather of the next
        layer's parameters), where no agreement can reach them; such an exception is raised on
        that rank alone, as before (the process group's timeout ends the others). One raised
        before the round's forwards (loading its source batch) is reported in the ranks'
        agreement on those forwards (:meth:`RankSync.most
        <sbloader.distributed.RankSync.most>`, one more integer), so that no rank runs them;
        one raised after them (the policy's decision, keeping the rows it chose) in the
        round's agreement, as without FSDP.
        """
        return self._loader._sync is not None and not self._forwarding

    def _stop_pass(self, error: Exception) -> NoReturn:
        """This rank's round raised ``error`` (loading its source batch; its selection pass: the
        model's forward, ``loss_fn``, a ``forward=`` or ``output=`` hook, the policy's decision;
        keeping the rows it chose): the rank skips the rest of its round's own work but makes
        the round's remaining collectives, the same as the other ranks make (the loss exchange
        where the round has one and it was not made yet, with no losses; then the agreement),
        whose ``all_reduce`` reports the error's type and the stage of the round where it was
        raised (see :func:`_raised_kind`); every rank raises then.

        NOTE: raised on this rank alone, it left the others waiting in their next collective
        until the process group timed out (minutes), with a bare gloo error. The type travels in
        the agreement's one integer, so that no ordinary round makes a collective more; the
        message follows in two broadcasts made only once a rank has failed
        (:meth:`_raise_reported`).
        """
        loader = self._loader
        kind = _raised_kind(error, self._stage)
        if not self._rounded and self._rounds_forwards():
            # (under FSDP, before the round's forwards: reported in their agreement)
            self._fail(kind, error)
            self._selection_round(0)
            raise AssertionError("unreachable: the forwards' agreement reports the error")
        if loader._sharing() and not self._passthrough and not self._exchanged:
            self._exchange(None, None)
        self._stop_round(kind, error)

    def _exchange(
        self, losses: np.ndarray | None, indices: np.ndarray | None
    ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """The round's loss exchange (:meth:`RankSync.exchange
        <sbloader.distributed.RankSync.exchange>`), noted as made (see :meth:`_stop_pass`)."""
        sync = self._loader._sync
        assert sync is not None
        self._exchanged = True
        return sync.exchange(losses, indices)

    def _raise_reported(self, sync: RankSync) -> None:
        """After an agreement: raise where a rank reported an error in it (the same on every
        rank). The rank that met it raises its own error, naming its rank; the others raise one
        of the same kind naming that rank and the fix, with that rank's message.

        NOTE (the message): the agreement carries the lowest failed rank and its error's kind;
        its message then comes from that rank in :meth:`RankSync.broadcast_text`, which every
        rank calls here alike (they all learned of the failure in the same agreement), before
        any rank raises. Collectives made only on the way to an error cost no ordinary round.
        """
        if sync.failed is None:
            return
        where = f"rank {sync.rank} of {sync.world_size}"
        own = self._failure
        rank, kind = sync.failed
        detail = sync.broadcast_text(
            _describe(own[1]) if own is not None and sync.rank == rank else "", rank
        )
        if own is not None:
            error = own[1]
            message = f"on {where} (every rank stops with this error, reported to the others): "
            _raise_own(error, message + str(error))
        if kind >= _RAISED:
            raise RuntimeError(
                f"in epoch {self.epoch}, rank {rank} of {sync.world_size} raised "
                f"{_raised_name(kind)} {_raised_stage(kind)}; every rank stops with it "
                f"(this is {where}), so that none waits for it in a collective. Rank {rank}'s "
                f"error: {detail} (its own log has the traceback)"
            )
        cls, what, fix = _REPORTED[kind]
        raise cls(
            f"in epoch {self.epoch}, rank {rank} of {sync.world_size} {what}; every rank stops "
            f"with it (this is {where}), so that none waits for it in a collective: {fix}. "
            f"Rank {rank}'s error: {detail}"
        )

    def _decide(self, scored: Scored | None, indices: np.ndarray | None, n: int) -> Any:
        """The policy's choice; when the ranks share losses, made between observing the lower
        ranks' and the higher ranks' losses, so that every rank's policy sees the same losses in
        the same order (identical loss windows under ``cdf="global"``)."""
        loader, stats = self._loader, self.stats
        assert stats is not None
        values = None if scored is None else scored.values
        if not loader._sharing():
            return self._choose(values, indices, n)
        sync = loader._sync
        assert sync is not None
        shared = self._exchange(values, None if values is None else indices)
        self._observe(shared[: sync.rank])
        choice = self._choose(values, indices, n)
        self._observe(shared[sync.rank + 1 :])
        return choice

    def _choose(self, values: np.ndarray | None, indices: np.ndarray | None, n: int) -> Any:
        loader, stats = self._loader, self.stats
        assert stats is not None
        finite = None
        if values is not None:
            finite = np.isfinite(values)
            stats.nonfinite += int(finite.size - np.count_nonzero(finite))  # before "raise" raises
        # NOTE: the policy refusing this rank's losses (Kath18's negative loss, a policy of the
        # user's own raising, a Choice that does not fit) is reported to the other ranks as any
        # exception of the round is (see _report_raised); the round's exchange is made already.
        choice, _ = choose_finite(
            loader.policy, values, indices, loader._rng, n, loader.nonfinite, finite
        )
        return choice

    def _observe(self, shared: list[tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Feed other ranks' finite losses (and their indices) to the policy, in rank order."""
        loader = self._loader
        for values, indices in shared:
            finite = np.isfinite(values)
            if finite.any():
                idx = None if indices is None else indices[finite]
                loader.policy.observe(values[finite], idx, cdf=loader.cdf == "global")
            if indices is not None and not finite.all():  # (every rank's store alike)
                if loader.nonfinite == "skip":
                    loader.policy.count_skipped(indices[~finite])
                elif loader.nonfinite == "select":
                    loader.policy.mark_forced(indices[~finite])

    def _count_unloaded(self, now: tuple[int, int, Any]) -> None:
        """Add the candidates left out before loading since the last count to the stats."""
        stats = self.stats
        assert stats is not None
        rejected, excluded = now[0] - self._counted[0], now[1] - self._counted[1]
        stats.examples_seen += rejected
        stats.prefiltered += rejected
        stats.excluded += excluded
        self._counted = (now[0], now[1])

    def _stop_fetch(self) -> None:
        thread, self._thread = self._thread, None
        self._next = None
        if thread is not None:
            thread.close()
        fetch, self._fetch = self._fetch, None
        if fetch is not None:
            try:
                fetch.close()
            finally:
                if self.stats is not None and self._start:
                    now = perf_counter()
                    if self._handed_out is not None:
                        # NOTE: an epoch left part-way (``break``) after a batch was handed
                        # out: the caller's step on it is the caller's time, as the next
                        # ``next()`` would have counted it; left uncounted, the wall time
                        # held it and ``overhead_s`` reported a training step as the
                        # loader's own.
                        self.stats.consumer_s += now - self._handed_out
                        self._handed_out = None
                    self.stats.wall_s += now - self._start
                    self._start = 0.0


def _weakly(method: Callable[[], bool]) -> Callable[[], bool]:
    """``method`` (a bound method), called through a weak reference to its object: False once
    the object is gone; any other callable as it is.

    NOTE: a source keeps the epoch's :class:`~sbloader.decisions.Keep` (a DataLoader's batch
    sampler holds it, and so do persistent workers' sampler iterators); a Keep holding the
    source's ``replaying`` strongly made a reference cycle, so that a loader dropped after a
    prefiltered epoch (Stale-SB's stale epochs, ``subset``) lived on with its DataLoader, its
    persistent worker processes and the policy's memory-mapped store (whose folder a new
    store was refused) until the garbage collector happened to run.
    """
    if not inspect.ismethod(method):
        return method
    ref = weakref.WeakMethod(method)

    def call() -> bool:
        bound = ref()
        return bound is not None and bound()

    return call


def _describe(error: BaseException) -> str:
    """``"Type: message"`` of ``error``, or its type's name alone where its message cannot be
    made (its ``__str__`` raised): the failed rank must reach the broadcast that the others
    wait in, whatever its error."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:
        return f"{type(error).__name__} (its message could not be made)"


def _raise_own(error: Exception, message: str) -> NoReturn:
    """Raise an exception of ``error``'s type with ``message``, chained to ``error`` (its
    traceback); ``error`` itself, unchanged, where its type cannot be made from a message
    alone (a constructor that takes other arguments)."""
    try:
        again: Exception | None = type(error)(message)
    except Exception:
        again = None
    if again is None or type(again) is not type(error):
        raise error
    raise again from error


def _gather(
    data: list[Any],
    positions: np.ndarray,
    device: torch.device,
    pos_t: torch.Tensor | None = None,
) -> list[Any]:
    """Rows ``positions`` of every data column, gathered where each column lives (``pos_t``:
    the positions already on ``device``, if the caller made them)."""
    if pos_t is None:
        pos_t = torch.from_numpy(positions).to(device, non_blocking=True)
    pos_list = positions.tolist() if any(not isinstance(c, torch.Tensor) for c in data) else None
    return [B.take(c, pos_t, pos_list) for c in data]


def pass_fraction(source: Any, stats: EpochStats, position: int, filtered: bool = False) -> float:
    """The share of a pass over ``source`` drawn after ``position`` source batches with the
    epoch's ``stats``, in [0, 1] (see :meth:`EpochIterator.fraction`).

    NOTE (``filtered``): a source of unknown size whose pass is filtered before loading (a
    stale epoch's prefilter, ``subset``) makes fewer source batches than its length says; its
    candidates drawn are counted against its length in full batches instead, so that the
    fraction does not lag and then jump at the pass's end.
    """
    size = source.epoch_size
    if size:
        return min((stats.examples_seen + stats.excluded) / size, 1.0)
    try:
        n = len(source)
    except TypeError:
        return 0.0
    bs = source.batch_size
    if filtered and n and bs:
        return min((stats.examples_seen + stats.excluded) / (n * bs), 1.0)
    return min(position / n, 1.0) if n else 0.0
