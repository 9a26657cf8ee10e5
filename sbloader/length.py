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

import contextlib
import copy
import math
import numbers
import warnings
import weakref
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from ._state import check_version
from .policies import passes_within

if TYPE_CHECKING:
    from . import batch as B
    from .epoch import EpochHost, EpochIterator
    from .policies import Policy
    from .sources import Source

__all__ = [
    "BARREN_PASSES",
    "FixedEpochIterator",
    "FixedEpochs",
    "batches_at",
    "check_batches_per_epoch",
    "check_fills_a_batch",
    "expected_count",
    "fills_a_batch",
    "pass_examples",
    "pass_length",
    "planned_passes",
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

    def __deepcopy__(self, memo: dict[int, Any]) -> FixedEpochs:
        """A copy with no iterator: the loader's copy (made when no pass is under way) must
        not reach the original's training-epoch iterator, which ``iter(copy)`` would close.

        NOTE: ``copy.deepcopy`` keeps a weak reference as it is, so the copied clock pointed at
        the original's iterator (the loader's own ``__deepcopy__`` clears its reference alike).
        """
        new = copy.copy(self)
        memo[id(self)] = new
        new._live = new._pass = None
        return new

    def iterate(self, loader: EpochHost) -> FixedEpochIterator:
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

    def __init__(self, loader: EpochHost, clock: FixedEpochs) -> None:
        # NOTE: the loader through its declared contract with epoch iterators
        # (sbloader.epoch.EpochHost), as EpochIterator holds it: the type checker refuses any
        # other access.
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


def batches_at(source: Source, subset: np.ndarray | None, batch_size: int, rate: float) -> float:
    """The expected number of training batches of ``batch_size`` per pass over ``source`` (this
    rank's share, within the ``subset`` mask where there is one; only its full batches where it
    drops its last partial one) for a policy that keeps ``rate`` of the candidates (an estimate
    when selective).

    Raises:
        TypeError: the source's number of examples is unknown (an iterable without a length or
            without a batch size); the message names the fix, ``dataset_size=``.
    """
    examples: float | None = source.epoch_size
    if examples is None:
        bs = source.batch_size
        try:
            n: int | None = len(source)
        except TypeError:
            n = None
        if bs is None or n is None:
            if source.dataset_size is not None:  # (a batch_sampler=: no fix by size)
                raise TypeError(_unknown_pass(source))
            raise TypeError(
                "the number of examples per epoch of this source is unknown (it has no "
                f"{'length' if n is None else 'batch_size'}), so no batch count can be "
                "estimated; pass dataset_size= (the number of examples) to the "
                "SelectiveLoader, or use a sized source such as a DataLoader over a "
                "map-style dataset"
            )
        examples = _short_last_counted(source, n, bs) or n * bs
    elif (drawn := _full_batches_drawn(source)) is not None:
        # NOTE: epoch_size, the sampler's length, counts the dropped examples too; a subset's
        # share is taken of the drawn ones, as a filtering source drops them before filtering.
        examples = drawn
    if subset is not None and len(subset):
        examples *= np.count_nonzero(subset) / len(subset)
    return examples * rate / batch_size


def _short_last_counted(source: Source, batches: int, bs: int) -> int | None:
    """The examples of a pass of ``batches`` source batches of ``bs``, all full but the last,
    whose size the source tells (a sized IterableDataset's: its examples are ``len(dataset)``);
    None where it cannot tell it."""
    last = source.last_batch_size()
    return None if last is None or batches < 1 else (batches - 1) * bs + last


def _full_batches_drawn(source: Source) -> int | None:
    """The examples a pass over a source that drops its last partial batch draws: its full
    batches' (None where it drops none, or where the number of its batches is unknown)."""
    bs = source.batch_size
    if not (bs and source.drop_last()):
        return None
    full = source.full_batches()
    return None if full is None else full * bs


def pass_examples(source: Source, subset: np.ndarray | None, batch_size: int) -> tuple[int, bool]:
    """The examples of one pass over ``source`` on this process (within the ``subset`` mask
    where there is one), exactly, and whether they were counted as the source's batches, all
    taken as full batches of ``batch_size`` (a ``batch_sampler=`` with no sampler of its own:
    the loader then warns of a source batch of another size, see
    ``EpochIterator._check_counted_full``).

    Raises:
        TypeError: the pass's number of examples is not known exactly (the message names the
            fix).
    """
    size, bs = source.epoch_size, source.batch_size
    if subset is not None:
        # NOTE: exact only where this process's pass draws each example once: under a
        # DistributedSampler the subset's share of a rank changes from epoch to epoch, and
        # a sampler drawing with replacement draws the subset's examples a varying number
        # of times.
        if not source.draws_each_once():
            raise TypeError(
                "the number of batches of a pass is not fixed with subset= and a source that "
                "does not draw each example of the dataset once on this process (a "
                "DistributedSampler, a sampler drawing with replacement, or drop_last); pass "
                'batches_per_epoch="expected" (or an int) for epochs of a fixed number of '
                "batches, or schedule by loader.progress"
            )
        return int(np.count_nonzero(subset)), False
    if bs and source.drop_last():
        drawn = _full_batches_drawn(source)
        if drawn is None:
            raise TypeError(_unknown_pass(source))
        return drawn, False
    if size is None:
        counted = _short_last_counted(source, len(source), bs) if bs else None
        if counted is not None:  # full batches but the last
            return counted, False
        if bs == batch_size:
            # Handed out as they are: as many batches as the source's (its last one's size
            # unknown, so not checked against min_batch_size), where they are full; a
            # source batch of another size before the last is warned of (see
            # EpochIterator._check_counted_full).
            return len(source) * bs, True
        raise TypeError(_unknown_pass(source))
    return size, False


def pass_length(examples: int, batch_size: int, min_batch_size: int) -> int:
    """The exact number of batches of a pass of a passthrough policy: the pass's ``examples``
    (:func:`pass_examples`) in batches of ``batch_size``, and a last short batch of the rest when
    it has at least ``min_batch_size`` examples (as the iterator hands them out).

    Example:
        >>> pass_length(10, 4, 2), pass_length(9, 4, 2)
        (3, 2)
    """
    full, rest = divmod(examples, batch_size)
    return full + int(rest >= min_batch_size)


def expected_count(
    source: Source, subset: np.ndarray | None, batch_size: int, policy: Policy, remainder: str
) -> int:
    """``batches_per_epoch="expected"`` resolved: the expected batches of ``batch_size`` per pass
    over ``source`` (within ``subset``) of ``policy``, rounded (rounded down under
    ``remainder="drop"``).

    Raises:
        ValueError: the count cannot be computed, or it rounds to 0 (the message names the fix).
    """
    # NOTE: a passthrough policy's pass has a known number of examples; its rest is carried
    # or dropped as for any policy (never a short batch), so it counts as a fraction of a
    # batch: rounded, or left out where it is dropped. Under "drop" a selective pass yields
    # its whole batches only too (10 of 10.7 expected, pass after pass): rounded up, the
    # training epochs outran the passes, and a pass expected to fill 0.5 to 1 batch (most
    # passes none) made training epochs of tens of passes each instead of a refusal.
    passthrough = policy.passthrough()
    expected: float | None = None
    if passthrough:
        with contextlib.suppress(TypeError):  # an exact count unknown: estimated below
            expected = pass_examples(source, subset, batch_size)[0] / batch_size
    if expected is None:
        try:
            expected = batches_at(source, subset, batch_size, policy.steady_rate)
        except TypeError as e:
            raise ValueError(f'batches_per_epoch="expected" cannot be computed: {e}') from None
    dropped = remainder == "drop"
    count = math.floor(expected) if dropped else math.floor(expected + 0.5)
    if count < 1:
        raise ValueError(
            f'batches_per_epoch="expected": {expected:.3g} batches are expected per pass '
            "over the data, which rounds to 0"
            + (" (remainder='drop' drops each pass's rest)" if dropped else "")
            + "; pass batches_per_epoch= an int, or a smaller batch_size"
            + (", or remainder='carry'" if dropped else "")
        )
    return count


def check_fills_a_batch(
    source: Source, subset: np.ndarray | None, batch_size: int, policy: Policy, count: int
) -> None:
    """Refuse, as the loader is built, fixed-length epochs (``batches_per_epoch=count``, of
    ``batch_size``, passes over ``source`` within ``subset``, ``policy``) that
    ``remainder="drop"`` can never fill, or fills one pass in several: a passthrough policy's
    pass of fewer examples than ``batch_size`` yields no batch, and a selective policy's pass
    expected to keep less than a batch yields none in most passes (otherwise found only after
    ``BARREN_PASSES`` passes of selection forwards over the whole data, or never: a training
    epoch of tens of passes). Where the pass's size is unknown, the first pass that yields
    nothing checks it (:func:`sbloader.length.fills_a_batch`)."""
    if not policy.passthrough():
        try:
            expected = batches_at(source, subset, batch_size, policy.steady_rate)
        except TypeError:
            return  # unknown: left to the passes themselves
        if expected < 1.0:
            raise unfillable(
                count,
                f"the policy keeps about {expected * batch_size:.3g} examples per pass "
                "over the source",
                batch_size,
            )
        return
    try:
        examples = pass_examples(source, subset, batch_size)[0]
    except TypeError:
        return  # unknown: left to the passes themselves
    if examples < batch_size:
        raise ValueError(
            f"batches_per_epoch={count} cannot be "
            f"filled: a pass over the source has {examples} examples, fewer than "
            f"batch_size={batch_size}, and remainder='drop' drops each pass's rest; "
            "use remainder='carry' (the rest goes on into the next pass) or a smaller "
            "batch_size"
        )


def planned_passes(
    planned_epochs: int,
    per_epoch: int,
    steady: float,
    full: float,
    unknown: TypeError | None,
) -> int:
    """The passes over the data that ``planned_epochs`` training epochs of ``per_epoch``
    batches are expected to make (:func:`~sbloader.policies.passes_within`), for the default
    policy's plan: ``steady``, ``full``: the batches a pass is expected to yield at the policy's
    steady rate and on all the data; ``unknown``: why they cannot be estimated, or None. Warns
    (``UserWarning``, as the loader is built) where they cannot be estimated (the plan is then
    ``planned_epochs`` passes), or where the run makes only 2 passes (no selective one) or
    cannot complete the anneal.
    """
    if unknown is not None:
        warnings.warn(
            f"planned_epochs={planned_epochs} with batches_per_epoch={per_epoch} counts "
            "training epochs, but the passes over the data they make cannot be estimated, "
            f"so it is taken as {planned_epochs} passes (the last eighth of them annealed on "
            f"all the data, which may fall after the run ends): {unknown}",
            UserWarning,
            stacklevel=4,
        )
        passes = planned_epochs
    else:
        fitted = passes_within(planned_epochs * per_epoch, steady, full)
        passes = 2 if fitted is None else fitted
        # NOTE: 2 passes are the Random-Backprop warm-up and the annealed pass, with no
        # selective pass between them (as planned_epochs=2 without batches_per_epoch, which
        # is warned of too): the training epochs that 3 passes need (the warm-up, one
        # selective pass, the annealed one) are named as the fix.
        needed = math.ceil(((2 * steady + full) / per_epoch) * (1 - 1e-9))
        if fitted is None:
            warnings.warn(
                f"planned_epochs={planned_epochs} training epochs of batches_per_epoch="
                f"{per_epoch} batches ({planned_epochs * per_epoch} in all) cannot complete "
                "the default policy's anneal (a pass over all the data, "
                f"{full:.3g} batches, after its warm-up pass of {steady:.3g}): it plans 2 "
                "passes, and the run ends before the annealed one does. Train for at least "
                f"planned_epochs={needed} epochs of that length, or pass a policy without "
                "annealing (e.g. policy=sbloader.default_policy())",
                UserWarning,
                stacklevel=4,
            )
        elif passes == 2:
            warnings.warn(
                f"planned_epochs={planned_epochs} training epochs of batches_per_epoch="
                f"{per_epoch} batches ({planned_epochs * per_epoch} in all) make 2 passes "
                "over the data, which leave the default policy no selective pass: pass 0 is "
                f"its Random-Backprop warm-up ({steady:.3g} batches) and pass 1, the annealed "
                f"end, trains on all the data ({full:.3g} batches). Train for at least "
                f"planned_epochs={needed} epochs of that length (3 passes), or pass a policy "
                "(e.g. policy=sbloader.default_policy() anneals nothing)",
                UserWarning,
                stacklevel=4,
            )
    return passes


def _unknown_pass(source: Source) -> str:
    """Why the examples of a pass of ``source`` cannot be counted, and the fix."""
    if source.dataset_size is not None:  # a DataLoader whose batch_sampler= draws its batches
        return (
            "the number of examples per pass of this source is unknown: its batch_sampler= "
            "draws the batches itself (it may shard the data by rank), and only their number is "
            "known; give the batch sampler a batch_size attribute and use that batch_size (its "
            "batches are then handed out as they are, and counted), or pass batches_per_epoch= "
            "an int"
        )
    return (
        "the number of examples per pass of this source is unknown (its last batch may be "
        "short), so the number of batches of another size cannot be counted; pass "
        "dataset_size= (the number of examples), or batches_per_epoch= an int"
    )
