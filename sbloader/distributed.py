"""Distributed training: what the ranks of a DDP job agree on, once per source batch.

Under ``DistributedDataParallel`` every rank must run the same number of training steps, or the
gradient all-reduce of a rank with more steps blocks until the process group times out. Each
rank selects different examples, so each would fill a different number of batches. A
:class:`RankSync` makes every rank yield the same number, without ``Join``:

- after each source batch, every rank makes ONE ``all_reduce(MIN)`` of the int64 tuple
  ``[ready, -active, empty, failed, share]``: ``ready`` is the number of full batches it could
  yield now, ``active`` is 1 while it still has source batches, ``empty`` names the rank once its
  pass is over without an example (refused on every rank when the pass ends), ``failed`` the
  rank and the kind of an error it met in the round (below), ``share`` the share of its pass it
  has drawn (whose minimum every rank's ``loader.progress`` reports, so that a learning rate
  keyed on it is the same on every rank). Every rank then yields the
  minimum; the surplus stays pending and is yielded later, as carried examples are on one
  process;
- a rank whose source is exhausted keeps taking part (``active = 0``, no new data) until no rank
  is active, so source lengths may differ (Stale-SB's stale epochs load a different number of
  examples on each rank; an iterable source may simply be shorter on one rank);
- when the selection model is sharded by FSDP (each selection forward is then a collective),
  the ranks first agree on the most selection forwards any of them runs in the round
  (:meth:`RankSync.most`), and each runs that many (padding with forwards on one kept example);
  an error a rank met before them (loading its source batch) is reported there, so that every
  rank raises before any forward;
- with ``cdf="global"`` and a policy that ranks losses against other ranks'
  (:meth:`~sbloader.Policy.ranks_shared_losses`: not Kath18, Random-Backprop or Traditional),
  or a policy that keeps per-example records (Stale-SB's store), the ranks also all-gather their
  selection losses and dataset indices (:meth:`RankSync.exchange`), and each rank feeds the
  others' into its policy through :meth:`~sbloader.Policy.observe`;
- a rank that meets an error its round can finish without (a non-finite selection loss under
  ``nonfinite="raise"``, a source batch whose fields cannot be joined with earlier ones, an
  exception raised in its round, under FSDP outside its selection forwards: by its source as a
  batch is loaded, by the user's code or the policy's decision in its selection pass, or in
  keeping the rows it chose)
  goes on to the end of the round, making its collectives, and reports it in the same
  ``all_reduce(MIN)`` (a fourth integer: its kind, for an exception its type and the stage of
  the round), so that every rank raises at the end of that round, naming the rank, instead of
  the others waiting in their next collective (:attr:`RankSync.failed`); an exception in
  attaching the policy as the loader is built (a ``store_path`` folder another process holds)
  is reported the same way, in one ``all_reduce`` made there, and so is one met as an epoch
  begins (a sampler's ``set_epoch``, the policy's ``begin_epoch``), in one ``all_reduce`` per
  epoch;
- the first of those ``all_reduce(MIN)`` calls also carries a digest of the rank's first source
  batch (and its negation), so that a source that is not sharded (every rank reading the same
  examples, e.g. a DataLoader without a ``DistributedSampler``) is reported on every rank, at no
  extra collective (:meth:`RankSync.note_batch`);
- with a passthrough policy (Traditional) and epochs of one pass, the ranks agree on the batches
  of a pass as the loader is built (:meth:`RankSync.span`, one ``all_reduce`` every rank makes
  there): every rank yields the fewest any rank's pass makes, and ``len(loader)`` says so on
  every rank;
- where a policy keeps per-example records (Stale-SB's store, which every rank's losses reach by
  dataset index), the ranks check that their datasets have the same size (the first
  collective; an error), and, once, after the first whole pass, warn where more indices were read
  by two ranks than a sharding sampler pads with (a batch per rank): ranks reading their own data
  under indices from 0 mix their losses in the store (:meth:`RankSync.check_overlap`).

:func:`reduce_stats` sums a loader's counters across ranks. :func:`check_unsynced` checks the
options that only mean something across ranks where a loader makes no collectives (a loader built
before ``init_process_group`` under a launcher of several processes, ``cdf="global"`` alone).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from typing import Any, overload

import numpy as np
import torch
import torch.distributed as dist

from .stats import CLASS_FIELDS, COUNT_FIELDS, TIME_FIELDS, EpochStats, LoaderStats

#: The most bytes of a failed rank's error message that :meth:`RankSync.broadcast_text` sends.
TEXT_LIMIT = 4000

__all__ = [
    "FAILURE_KINDS",
    "TEXT_LIMIT",
    "RankSync",
    "agree_configuration",
    "agree_pass_length",
    "agree_position",
    "batch_digest",
    "check_unsynced",
    "collective_device",
    "is_distributed",
    "make_sync",
    "reduce_stats",
]


#: The kinds of error a rank can report in :meth:`RankSync.agree` are 1 to ``FAILURE_KINDS - 1``
#: (0: none); the reduced integer is ``rank * FAILURE_KINDS + kind``, so its minimum names the
#: lowest rank that failed, and its kind.
FAILURE_KINDS = 256

#: A share of a pass in [0, 1] travels in :meth:`RankSync.agree` as an integer of this many units.
SHARE_UNITS = 1 << 40
#: What a rank passes in :meth:`RankSync.agree` for a share it does not report (above any share).
_NO_SHARE = 1 << 62


def batch_digest(inputs: Any) -> int | None:
    """A 63-bit digest of a batch's inputs (their bytes, dtype and shape), or None for inputs
    that are neither a tensor nor a numeric numpy array.

    Example:
        >>> a = batch_digest(torch.arange(6).reshape(2, 3))
        >>> a == batch_digest(torch.arange(6).reshape(2, 3)), a == batch_digest(torch.arange(6))
        (True, False)
    """
    if isinstance(inputs, torch.Tensor):
        t = inputs.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        meta = f"{t.dtype}{tuple(t.shape)}"
    elif isinstance(inputs, np.ndarray) and inputs.dtype.kind in "biufc":
        raw = np.ascontiguousarray(inputs).tobytes()
        meta = f"{inputs.dtype}{inputs.shape}"
    else:
        return None
    h = hashlib.blake2b(raw, digest_size=8)
    h.update(meta.encode())
    return int.from_bytes(h.digest(), "little") >> 1


def is_distributed(group: Any = None) -> bool:
    """Whether ``torch.distributed`` is initialised with more than one rank in ``group``.

    Example:
        >>> is_distributed()  # a plain Python process
        False
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where the loader's collective tensors live for ``backend``, given the model's ``device``.

    NOTE: gloo reduces CPU tensors and nccl only CUDA ones. A process group may have one backend
    per device type (``"cpu:gloo,cuda:nccl"``); the CPU is then preferred, since these tensors
    are a few bytes and a CPU collective needs no device synchronisation.

    Example:
        >>> collective_device("gloo", torch.device("cpu"))
        device(type='cpu')
    """
    names = str(backend).lower()
    if "gloo" in names or "mpi" in names:
        return torch.device("cpu")
    if device.type != "cpu":
        return device
    if "nccl" in names:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankSync:
    """The collectives a :class:`~sbloader.SelectiveLoader` makes on each of several ranks.

    Every rank calls the same methods in the same order: per source batch (or, once its source
    is exhausted, per round of the others) an optional :meth:`exchange`, then one :meth:`agree`;
    after an agreement that reports a failed rank, :meth:`broadcast_text` of its message.

    Args:
        group: the process group; None for the default (world) group.

    Attributes:
        rank: this process's rank within ``group``.
        world_size: the number of ranks in ``group``.
        device: where collective tensors live (set by :meth:`bind`).

    Example:
        It is built on every rank after ``torch.distributed.init_process_group(...)``; without
        an initialised process group (a plain Python process) it is refused:

        >>> RankSync()
        Traceback (most recent call last):
            ...
        RuntimeError: distributed=True needs an initialised process group; call
        torch.distributed.init_process_group(...) before building the SelectiveLoader, or pass
        distributed=False
    """

    def __init__(self, group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "distributed=True needs an initialised process group; call "
                "torch.distributed.init_process_group(...) before building the SelectiveLoader, "
                "or pass distributed=False"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = torch.device("cpu")
        self._digest: int | None = None  # of this rank's first source batch (note_batch)
        self._checked = False  # whether the first agree compared the ranks' digests
        self._identical = False  # whether it found every rank's first batch the same
        # The dataset indices this rank read in the current pass, while the overlap of the
        # ranks' indices is still to be checked (arm_overlap_check); None otherwise.
        self._read: np.ndarray | None = None
        self._size: int | None = None  # this rank's dataset size, compared at the first bind
        self._widest = 0  # the most indices in one source batch this rank read (the check's slack)
        #: The lowest rank that reported an empty pass in the last :meth:`agree`, or None.
        self.empty_rank: int | None = None
        #: ``(rank, kind)`` of the lowest rank that reported an error in the last
        #: :meth:`agree`, or None.
        self.failed: tuple[int, int] | None = None
        #: The smallest share of its pass any rank reported in the last :meth:`agree`, or None.
        self.least_share: float | None = None

    def note_batch(self, inputs: Any) -> None:
        """Remember a digest of this rank's first source batch's inputs (later calls, and
        calls after the first :meth:`agree`, do nothing): the first :meth:`agree` compares it
        across ranks."""
        if self._digest is None and not self._checked:
            self._digest = batch_digest(inputs)

    def arm_overlap_check(self, dataset_size: int) -> None:
        """Check that the ranks' dataset indices name one dataset's examples: at the first
        :meth:`bind`, that every rank's dataset has this size (an error), and at the end of the
        first whole pass over the data, how many indices two ranks read (:meth:`check_overlap`,
        a warning). The loader arms it where a policy keeps per-example records, which every
        rank's losses reach by index. Every rank arms it alike, an empty dataset's included."""
        if self.world_size > 1 and dataset_size >= 0:
            self._read = np.zeros(dataset_size, dtype=np.uint8)
            self._size = dataset_size

    def note_indices(self, indices: np.ndarray | None) -> None:
        """Mark the dataset indices of a source batch this rank read in the current pass
        (forgotten when the next pass begins, :meth:`bind`); nothing once checked."""
        read = self._read
        if read is None:
            return
        if indices is not None and len(indices) and len(read):
            read[np.clip(indices, 0, len(read) - 1)] = 1
            self._widest = max(self._widest, len(indices))

    def check_overlap(self) -> None:
        """At the end of a whole pass (once per run): an ``all_reduce(MAX)`` of the ranks'
        widest source batches and one ``all_reduce(SUM)`` of the indices each rank read (the
        ranks' datasets have the same size: :meth:`bind` checked); warns on every rank where
        more indices were read by two ranks than a sharding sampler pads with.

        NOTE: a sharding sampler may pad the ranks' shares to equal lengths with examples read
        twice: fewer than ``world_size`` (``DistributedSampler``), or up to a batch per rank
        (Accelerate's ``even_batches``, measured: never more than ``world_size`` batches). More
        means either that each rank reads its own data under indices from 0 (a pre-sharded
        dataset), whose losses a per-example store keyed by index mixes across ranks (a stale
        epoch deciding one rank's examples from another's losses), or that every rank reads the
        whole dataset in its own order, or a sampler that repeats examples on purpose
        (repeated augmentation, sampling with replacement), whose global indices keep the store
        consistent. The counts cannot tell these apart, so this warns, naming all three, where
        an error would stop the last kind of run. Replicas (every rank's first batch the same,
        which :meth:`agree` warned about) are consistent too, and not warned about again.
        """
        read, self._read = self._read, None
        if read is None:
            return
        head = torch.tensor([self._widest], dtype=torch.int64, device=self.device)
        dist.all_reduce(head, op=dist.ReduceOp.MAX, group=self.group)
        widest = int(head.item())
        dtype = torch.uint8 if self.world_size < 256 else torch.int32
        t = torch.from_numpy(read).to(dtype).to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        shared = int((t > 1).sum().item())
        if shared > self.world_size * max(widest, 1) and not self._identical:
            warnings.warn(
                f"{shared} dataset indices were read by more than one of the {self.world_size} "
                "ranks in one pass over the data. If each rank reads its own data under indices "
                "from 0 (a pre-sharded dataset), this policy's per-example store (Stale-SB's; "
                "the default policy's) mixes the ranks' losses by index: give each example its "
                "global index (a field of the batch, named by index_key=). If every rank reads "
                "the whole dataset, give the DataLoader sampler=DistributedSampler(dataset). If "
                "the sampler repeats examples on purpose (repeated augmentation, sampling with "
                "replacement), the indices are global and nothing is wrong: filter this warning",
                UserWarning,
                stacklevel=2,
            )

    def bind(self, device: torch.device) -> None:
        """Place collective tensors for a model on ``device`` (the loader calls this as each
        pass over the data begins: the indices noted so far are forgotten, an earlier pass
        having ended part-way); the first time, once :meth:`arm_overlap_check` is armed, check
        that every rank's dataset has the same size (one ``all_reduce(MIN)``, the run's first
        collective: before any rank's losses reach another's store)."""
        self.device = collective_device(self.backend, device)
        if self._read is not None:
            self._read[:] = 0
        if self._size is None:
            return
        size, self._size = self._size, None
        low, high = self.span(size)
        if low != high:
            self._read = None
            raise ValueError(
                f"the ranks' datasets differ in size ({low} to {high} examples): each rank "
                "reads its own data under indices from 0 (a pre-sharded dataset), whose losses "
                "this policy's per-example store (Stale-SB's; the default policy's) would mix "
                "across ranks by index. Give each example its global index (a field of the "
                "batch, named by index_key=, with dataset_size= the whole dataset's), or give "
                "one dataset to every rank with sampler=DistributedSampler(dataset)"
            )

    def span(self, value: int, device: torch.device | None = None) -> tuple[int, int]:
        """The smallest and the largest ``value`` of any rank: one ``all_reduce(MIN)`` of
        ``[value, -value]``, on :attr:`device`, or where a model on ``device`` puts them (before
        :meth:`bind`)."""
        where = self.device if device is None else collective_device(self.backend, device)
        t = torch.tensor([value, -value], dtype=torch.int64, device=where)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        low, high = t.tolist()
        return int(low), -int(high)

    def differing(self, options: dict[str, str], device: torch.device | None = None) -> str | None:
        """The first of ``options`` (a name and its value as text) whose value is not the same
        on every rank, or None: one :meth:`span` of a digest of them all, and where the ranks
        differ one more per option, every rank taking the same path.

        Example:
            Two ranks built with another ``cdf`` each: ``sync.differing({"cdf": "'global'"})``
            returns ``"cdf"`` on both (one process: always None).
        """

        def digest(text: str) -> int:
            raw = np.frombuffer(text.encode(), dtype=np.uint8)
            return batch_digest(raw) or 0  # (a uint8 array always has one)

        low, high = self.span(digest("\n".join(f"{k}={v}" for k, v in options.items())), device)
        if low == high:
            return None
        for name, value in options.items():
            low, high = self.span(digest(value), device)
            if low != high:
                return name
        return None  # (only where the joined texts' digests collided)

    def agree(
        self,
        ready: int,
        active: bool,
        digest: bool = True,
        empty: bool = False,
        failed: int = 0,
        share: float | None = None,
    ) -> tuple[int, bool]:
        """The fewest batches any rank has ready, and whether any rank still has source batches.

        One ``all_reduce(MIN)`` of ``[ready, -active, e, f, s]``, ``e`` this rank's number where
        ``empty`` (its pass is over and read no example) and ``world_size`` otherwise: afterwards
        :attr:`empty_rank` is the lowest rank that reported an empty pass, or None. (In the
        pass's last round, where no rank is active, every rank knows whether its pass was empty,
        so every rank learns alike whether any was.) ``f`` is ``rank * FAILURE_KINDS + failed``
        where ``failed`` (the kind of an error this rank met in the round, 1 to
        ``FAILURE_KINDS - 1``) and ``world_size * FAILURE_KINDS`` otherwise: afterwards
        :attr:`failed` is ``(rank, kind)`` of the lowest rank that reported one, or None, the
        same on every rank (the caller raises then, on every rank). ``s`` is ``share`` (the
        share of its pass this rank has drawn, in [0, 1]) in :data:`SHARE_UNITS`: afterwards
        :attr:`least_share` is the smallest share any rank reported, the same on every rank, or
        None where no rank passed one (every rank passes one at a call site, or none does).
        The first call of a run also
        carries
        ``[d, -d]``, ``d`` the digest of this rank's first source batch (:meth:`note_batch`; a
        distinct negative number per rank where there is none), and warns on every rank when
        every rank's first batch had the same digest. ``digest=False``: a call made before
        any source batch is loaded (every rank alike), which leaves that comparison to the
        first call after one.

        NOTE: every rank makes its first call in the same round (the calls are matched one to
        one across ranks, or the job would hang already), so the seven-element tensor of the
        first call meets seven-element tensors only. The minimum of ``d`` equals the maximum
        (minus the minimum of ``-d``) exactly when all ranks' digests agree.

        NOTE (the cost of ``f``): one more int64 in a tensor of three, in a collective made
        anyway. Measured on 2 gloo ranks (this project's 2-core CPU, loaded): medians of 20
        alternating blocks of 500 calls, 701, 737 and 757 us a call with three int64 against
        732, 739 and 734 us with four, in three runs: no difference beyond the noise.

        NOTE (a warning, not an error): the same data on every rank is almost always a
        forgotten ``DistributedSampler`` (each rank then trains on every example, world-size
        times the work for the same updates), but it runs correctly in lockstep, and tests or
        deliberate replicas may want it.
        """
        first = digest and not self._checked and self.world_size > 1
        if not 0 <= failed < FAILURE_KINDS:
            raise ValueError(f"failed should be in [0, {FAILURE_KINDS}), but got failed={failed!r}")
        none = self.world_size * FAILURE_KINDS
        values = [ready, -int(active), self.rank if empty else self.world_size]
        values.append(self.rank * FAILURE_KINDS + failed if failed else none)
        values.append(_NO_SHARE if share is None else round(share * SHARE_UNITS))
        if first:
            self._checked = True
            d = self._digest if self._digest is not None else -(self.rank + 1)
            values += [d, -d]
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        got = t.tolist()
        self.empty_rank = got[2] if got[2] < self.world_size else None
        self.failed = divmod(got[3], FAILURE_KINDS) if got[3] < none else None
        self.least_share = got[4] / SHARE_UNITS if got[4] < _NO_SHARE else None
        if first and got[5] >= 0 and got[5] == -got[6]:
            self._identical = True
            warnings.warn(
                f"every one of the {self.world_size} ranks read the same first source batch: the "
                "source looks unsharded, so each rank trains on every example (a DataLoader "
                "without a DistributedSampler, or a SelectiveLoader passed to "
                "accelerator.prepare(), which returns it unchanged); give the DataLoader "
                "sampler=DistributedSampler(dataset), or build the SelectiveLoader from "
                "accelerator.prepare(dataloader)",
                UserWarning,
                stacklevel=2,
            )
        return int(got[0]), got[1] < 0

    def most(self, count: int, flag: bool, failed: int = 0) -> tuple[int, bool]:
        """The largest ``count`` of any rank, and whether any rank raised ``flag``.

        One ``all_reduce(MAX)`` of ``[count, flag, f]`` (the selection forwards of a round under
        FSDP, see :meth:`sbloader.scoring.Scorer.pad`): ``f`` reports an error this rank met
        before the round's forwards (``failed``: its kind, as for :meth:`agree`), so that
        afterwards :attr:`failed` is ``(rank, kind)`` of the lowest rank that reported one, or
        None, the same on every rank (the caller raises then, on every rank, before any
        forward). NOTE: ``(world_size - rank) * FAILURE_KINDS + failed`` where ``failed``, 0
        otherwise: the maximum names the lowest rank; one more int64 in a collective made
        anyway.
        """
        if not 0 <= failed < FAILURE_KINDS:
            raise ValueError(f"failed should be in [0, {FAILURE_KINDS}), but got failed={failed!r}")
        f = (self.world_size - self.rank) * FAILURE_KINDS + failed if failed else 0
        t = torch.tensor([count, int(flag), f], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        most, any_flag, got = t.tolist()
        self.failed = None
        if got:
            ahead, kind = divmod(int(got), FAILURE_KINDS)
            self.failed = (self.world_size - ahead, kind)
        return int(most), any_flag > 0

    def share(self, value: Any, has: bool) -> tuple[bool, Any]:
        """``value`` of the lowest rank whose ``has`` is True, on every rank, and whether there
        was one (``(False, None)`` on every rank where none). Every rank calls it alike; the
        others' ``value`` is not read.

        One ``all_reduce(MIN)`` naming that rank, then ``broadcast_object_list`` of its
        (picklable, host) value. Used only where a round would otherwise stop (a rank without
        a padding candidate under FSDP, see ``EpochIterator._selection_round``), never in an
        ordinary round.
        """
        t = torch.tensor([self.rank if has else self.world_size], dtype=torch.int64)
        t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        src = int(t.item())
        if src >= self.world_size:
            return False, None
        box = [value if self.rank == src else None]
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        dist.broadcast_object_list(box, src=root, group=self.group, device=self.device)
        return True, box[0]

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.group)
        return parts

    def broadcast_text(self, text: str, src: int, device: torch.device | None = None) -> str:
        """``text`` as rank ``src`` (of this group) passed it, on every rank; every rank calls it
        alike, and only ``src``'s ``text`` is read (the others pass anything, e.g. ``""``).
        ``device``: as for :meth:`span` (before :meth:`bind`).

        Two broadcasts: the length, then the UTF-8 bytes (at most :data:`TEXT_LIMIT`; none where
        the text is empty). Used on the error path only (see
        :meth:`sbloader.EpochIterator._raise_reported`), never in an ordinary round. Tested on
        two gloo ranks (``tests/test_distributed.py``: rank 0's error ends with rank 1's
        message).
        """
        where = self.device if device is None else collective_device(self.backend, device)
        data = text.encode("utf-8", "replace")[:TEXT_LIMIT] if self.rank == src else b""
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        size = torch.tensor([len(data)], dtype=torch.int64, device=where)
        dist.broadcast(size, src=root, group=self.group)
        n = int(size.item())
        if not n:
            return ""
        buf = torch.zeros(n, dtype=torch.uint8, device=where)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=root, group=self.group)
        return bytes(buf.cpu().tolist()).decode("utf-8", "replace")

    def exchange(
        self, losses: np.ndarray | None, indices: np.ndarray | None
    ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Every rank's selection losses and dataset indices of this round, in rank order.

        Sizes are gathered first, then the losses (float64, padded with NaN to the longest) and
        the indices in a separate int64 tensor (padded with -1), then the padding is cut off.

        NOTE: the indices never pass through a float: InfoBatch gathers them concatenated with
        float losses, and indices above 2**24 come back wrong.

        Args:
            losses: this rank's float64 losses, or None when it has none this round.
            indices: their int64 dataset indices, or None.

        Returns:
            One ``(losses, indices_or_None)`` pair per rank, this rank's own included.
        """
        n = 0 if losses is None else int(losses.shape[0])
        if indices is not None and int(indices.shape[0]) != n:
            raise ValueError(f"got {n} losses but {indices.shape[0]} indices")
        header = torch.tensor([n, int(indices is not None)], dtype=torch.int64, device=self.device)
        headers = torch.stack(self._all_gather(header)).cpu().tolist()
        sizes = [int(h[0]) for h in headers]
        has_indices = [bool(h[1]) for h in headers]
        width = max(sizes)
        empty = np.zeros(0, dtype=np.float64)
        if width == 0:
            return [(empty, np.zeros(0, dtype=np.int64) if h else None) for h in has_indices]
        buf = torch.full((width,), float("nan"), dtype=torch.float64, device=self.device)
        if n:
            buf[:n] = torch.from_numpy(np.asarray(losses, dtype=np.float64)).to(self.device)
        all_losses = torch.stack(self._all_gather(buf)).cpu().numpy()
        all_indices = None
        if any(has_indices):
            ibuf = torch.full((width,), -1, dtype=torch.int64, device=self.device)
            if n and indices is not None:
                ibuf[:n] = torch.from_numpy(np.asarray(indices, dtype=np.int64)).to(self.device)
            all_indices = torch.stack(self._all_gather(ibuf)).cpu().numpy()
        out: list[tuple[np.ndarray, np.ndarray | None]] = []
        for r in range(self.world_size):
            idx = None
            if has_indices[r] and all_indices is not None:
                idx = all_indices[r, : sizes[r]].copy()
            out.append((all_losses[r, : sizes[r]].copy(), idx))
        return out

    def __repr__(self) -> str:
        return f"RankSync(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"


def make_sync(distributed: bool | None, group: Any = None) -> RankSync | None:
    """The :class:`RankSync` a loader should use, or None to run as a single process.

    Args:
        distributed: None (automatic: when ``torch.distributed`` is initialised with more than
            one rank), True (required; an uninitialised process group raises) or False.
        group: the process group; None for the default group.

    Example:
        In a plain Python process (no process group initialised):

        >>> make_sync(None) is None, make_sync(False) is None
        (True, True)
        >>> make_sync(True)
        Traceback (most recent call last):
            ...
        RuntimeError: distributed=True needs an initialised process group; ...
        >>> make_sync("yes")
        Traceback (most recent call last):
            ...
        TypeError: distributed should be True, False or None (automatic), but got distributed='yes'
    """
    if distributed is None:
        return RankSync(group) if is_distributed(group) else None
    if not isinstance(distributed, (bool, np.bool_)):
        raise TypeError(
            f"distributed should be True, False or None (automatic), but got "
            f"distributed={distributed!r}"
        )
    return RankSync(group) if distributed else None


def launched_processes() -> int:
    """How many processes the job's launcher says it has: ``WORLD_SIZE`` in the environment
    (torchrun and most launchers set it), else 1.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"WORLD_SIZE": "4"}):
        ...     launched_processes()
        4
        >>> with mock.patch.dict(os.environ, {"WORLD_SIZE": "x"}):
        ...     launched_processes()  # unreadable: one
        1
    """
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def check_unsynced(distributed: bool | None, group: Any, cdf: str) -> None:
    """Check the options of a loader that makes no collectives (:func:`make_sync` gave None): an
    option that only means something across ranks is refused where there are several, and warned
    about on one process.

    - ``process_group=`` without an initialised process group: refused (no group can be live);
    - ``distributed=None`` (automatic) without an initialised process group, while
      ``WORLD_SIZE`` says the launcher started several processes: refused. The loader was built
      before ``init_process_group``, so each rank would yield its own number of batches and DDP
      would hang; ``distributed=False`` runs each process on its own on purpose;
    - ``cdf="global"`` with ``distributed=False`` on several ranks: refused (the ranks then share
      no losses);
    - ``cdf="global"`` on one process without an initialised process group: a warning, since it
      ranks against the process's own losses, as ``"local"`` does (a script run both on one
      process and under torchrun may pass it; a group of one rank is silent: its global CDF is
      exact).

    NOTE: ``rank=`` is not checked: on processes that are not one ``torch.distributed`` job it is
    how each draws differently from the same ``seed``.

    Example:
        Without a process group, under a launcher that started 4 processes:

        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"WORLD_SIZE": "4"}):
        ...     check_unsynced(False, None, "local")  # each process on its own: fine
        ...     check_unsynced(None, None, "local")
        Traceback (most recent call last):
            ...
        ValueError: WORLD_SIZE=4 says this is one of 4 processes, but no torch.distributed ...

        On one process, ``cdf="global"`` warns that it ranks as ``"local"`` does:

        >>> with mock.patch.dict(os.environ, {"WORLD_SIZE": "1"}), warnings.catch_warnings():
        ...     warnings.simplefilter("error")  # the warning raised, to show it
        ...     check_unsynced(None, None, "global")
        Traceback (most recent call last):
            ...
        UserWarning: cdf='global' ranks losses against every rank's, which needs an initialised ...
    """
    initialised = dist.is_available() and dist.is_initialized()
    if group is not None and not initialised:
        raise ValueError(
            f"process_group should be a group of an initialised torch.distributed, but got "
            f"process_group={group!r} and no process group is initialised; call "
            "torch.distributed.init_process_group(...) before building the SelectiveLoader, or "
            "leave process_group out"
        )
    ranks = dist.get_world_size(group) if initialised else launched_processes()
    if ranks > 1 and distributed is None:
        raise ValueError(
            f"WORLD_SIZE={ranks} says this is one of {ranks} processes, but no torch.distributed "
            "process group is initialised, so the SelectiveLoader would run alone on each (each "
            "rank yielding its own number of batches: DDP would hang); build the SelectiveLoader "
            "after torch.distributed.init_process_group(...) (in Lightning: in "
            "train_dataloader(); with Accelerate: after Accelerator()), or pass "
            "distributed=False to run each process on its own"
        )
    if cdf != "global":
        return
    if ranks > 1:
        raise ValueError(
            f"cdf should be 'local' with distributed=False on {ranks} ranks (each then runs on "
            "its own and shares no losses), but got cdf='global'; leave distributed out to rank "
            "losses against every rank's, or pass cdf='local'"
        )
    if not initialised:
        warnings.warn(
            "cdf='global' ranks losses against every rank's, which needs an initialised "
            "torch.distributed process group, but none is initialised: this process ranks "
            "against its own losses, as cdf='local' does; call "
            "torch.distributed.init_process_group(...) before building the SelectiveLoader, or "
            "pass cdf='local'",
            UserWarning,
            stacklevel=3,
        )


def agree_configuration(
    sync: RankSync,
    shared: dict[str, str],
    device: torch.device,
    *,
    rank: int | None,
    empty: bool,
    expected_rate: float | None,
) -> None:
    """As a :class:`~sbloader.SelectiveLoader` is built, on several ranks: refuse, on every rank
    alike, options that must be the same on every rank and are not (``shared``: each option's
    name and value as text, compared with :meth:`RankSync.differing`: one ``all_reduce``), and an
    explicit ``rank=`` other than the process's rank in the group (``rank``: the one given, or
    None). ``empty``: whether this rank's source draws no example; ``expected_rate``: where
    ``batches_per_epoch="expected"`` was resolved, the policy's steady rate it was resolved at
    (named where the ranks' counts differ), else None. On one process, only ``rank`` is checked.

    NOTE (why): each rank's collectives follow from these options (a policy with or
    without selection passes, a shared CDF or not, short batches or not, how many batches
    an epoch has): ranks built with different ones fell out of step, hanging in a
    collective or aborting the process group, or trained batches of different sizes. A
    ``rank=LOCAL_RANK`` on two nodes (0 on both) drew alike and accepted the other's
    state."""
    own_wrong = rank is not None and rank != sync.rank
    # NOTE ("empty"): a rank whose source draws no example (an empty sampler or share) was
    # found out only when the first pass ended on every rank, after the other ranks' whole
    # pass of selection forwards; compared here with the options, it costs no collective
    # more unless a rank's differs (all empty: raised when the first pass ends, at once).
    options: dict[str, str] = {}
    differing = None
    if sync.world_size > 1:  # ("rank": whether this rank's is wrong, compared like the rest)
        options = {
            **shared,
            "rank": repr(own_wrong),
            "empty": repr(empty),
        }
        differing = sync.differing(options, device)
    if own_wrong or differing == "rank":
        whose = f"rank={rank} is not this process's ({sync.rank})"
        raise ValueError(
            "rank= should be each process's rank in the process group, but "
            + (whose if own_wrong else "another process's is not")
            + ": the loader derives its draws from (seed, rank) and checks a loaded "
            "state's rank against it; leave rank= out under torch.distributed (the group's "
            "rank is used), or pass distributed=False"
        )
    if differing == "empty":
        lowest = sync.span(sync.rank if empty else sync.world_size, device)[0]
        raise ValueError(
            f"the source of rank {lowest} of {sync.world_size} draws no examples (its sampler "
            f"or dataset is empty; this is rank {sync.rank}), so no rank could yield a batch "
            "(each yields as many as the fewest any rank has); give every rank a share of "
            "the data (e.g. sampler=DistributedSampler(dataset)), and check that no rank's "
            "dataset or sampler is empty"
        )
    if differing == "batches_per_epoch" and expected_rate is not None:
        # NOTE: every rank passed "expected", so "the same batches_per_epoch on every rank"
        # would name no fix: each rank resolved it from its own share and policy.
        raise ValueError(
            'batches_per_epoch="expected" resolves to the batches expected from each rank\'s '
            f"own share of the data at its policy's rate, and the ranks' differ: this rank "
            f"({sync.rank}) expects {options[differing]} at a rate of "
            f"{expected_rate:g}; give every rank an equal share "
            "(sampler=DistributedSampler(dataset)) and the same policy settings, or pass "
            "batches_per_epoch= an int, the same on every rank"
        )
    if differing is not None:
        raise ValueError(
            f"{differing} should be the same on every rank, but the ranks differ; this rank "
            f"({sync.rank}) has {differing}={options[differing]}; build the SelectiveLoader "
            f"with the same {differing} on every rank"
        )


def agree_pass_length(
    sync: RankSync, own: int, batch_size: int, device: torch.device
) -> tuple[int, int]:
    """On several ranks, for a passthrough policy with epochs of one pass: the fewest and
    the most batches of a pass on any rank (``own``: this rank's; -1 where a rank's is
    unknown), agreed as the loader is built; warns where they differ (every rank yields the
    fewest, in batches of ``batch_size``).

    NOTE: every rank yields the same number of batches per pass, as many as the fewest any
    rank's pass makes (a rank's further batches are dropped and counted), so ``len()`` of
    a rank's own pass would be more on the ranks with more data: a loop, scheduler or
    framework keyed on ``len(loader)`` (gradient accumulation's last step, Lightning's
    validation interval) would then differ between ranks. The loader is built on every
    rank at the same point, before any other collective of its own, so this one
    ``all_reduce`` is matched on every rank, whereas ``len()`` itself may be called on one
    rank only (a progress bar).
    """
    fewest, most = sync.span(own, device)
    if 0 <= fewest < most:
        warnings.warn(
            f"the ranks' passes over their data make from {fewest} to {most} batches of "
            f"{batch_size}: every rank yields {fewest} per epoch (len(loader)), and a "
            "rank's further batches are dropped (counted in loader.stats, dropped); give the "
            "DataLoader sampler=DistributedSampler(dataset) for equal shares",
            UserWarning,
            stacklevel=4,
        )
    return fewest, most


def agree_position(sync: RankSync | None, epoch: int, yielded: int, device: torch.device) -> None:
    """On several ranks, refuse (on every rank) to begin where the ranks' positions differ:
    the ``epoch``, and the batches already ``yielded`` in it where a saved state resumes it;
    nothing without ``sync`` or on one rank.

    NOTE: each rank restores its own state, and nothing compared them: a state loaded on one
    rank only (under ``if rank == 0:``), or states of different checkpoints, put the ranks in
    different epochs or at different batches of one, and the next collectives then hung,
    aborted the process group with a collective mismatch, or paired batches of different
    positions (overlapping shards). One ``all_reduce`` as each epoch begins, every rank
    alike, before the loader changes anything: the refusal leaves each rank's state as it
    was, to be mended by loading the right one.
    """
    if sync is None or sync.world_size < 2:
        return
    position = {"epoch": str(epoch), "batches yielded": str(yielded)}
    differing = sync.differing(position, device)
    if differing is not None:
        where = f"epoch {epoch}" + (f" after {yielded} batches" if yielded else "")
        raise ValueError(
            f"the ranks would begin at different positions ({differing} differs): this rank "
            f"({sync.rank}) begins {where}. Every rank must resume from its own state of the "
            "same checkpoint: call load_state_dict on every rank (not under `if rank == 0:`), "
            "each with the state its rank saved at the same step"
        )


@overload
def reduce_stats(
    stats: EpochStats, group: Any = None, device: torch.device | None = None
) -> EpochStats: ...


@overload
def reduce_stats(
    stats: LoaderStats, group: Any = None, device: torch.device | None = None
) -> LoaderStats: ...


def reduce_stats(
    stats: EpochStats | LoaderStats, group: Any = None, device: torch.device | None = None
) -> EpochStats | LoaderStats:
    """A loader's stats over all ranks: counts summed, times the maximum over ranks.

    A collective: every rank of ``group`` must call it, with stats of the same number of
    epochs. On a single process it returns a copy. ``target_rate`` becomes the mean over ranks
    weighted by examples seen; epoch numbers are kept.

    Args:
        stats: ``loader.stats`` (a :class:`~sbloader.LoaderStats`) or one
            :class:`~sbloader.EpochStats` such as ``loader.stats.current``.
        group: the process group; None for the default group.
        device: where the reduced tensors live. Default: the CPU, or the current CUDA device
            for an nccl-only group.

    Raises:
        TypeError: ``stats`` is neither a LoaderStats nor an EpochStats, on any rank: raised
            on every rank (the others name no type), so that none waits for it.
        ValueError: the ranks hold stats of different numbers of epochs (on every rank).

    Example:
        >>> s = LoaderStats()
        >>> s.begin_epoch(0, target_rate=0.5).examples_seen = 10
        >>> reduce_stats(s).total.examples_seen  # one process: unchanged
        10
    """
    collective = dist.is_available() and dist.is_initialized()
    wrong = None
    if not isinstance(stats, (EpochStats, LoaderStats)):
        wrong = TypeError(
            "stats should be a LoaderStats (loader.stats) or an EpochStats, but got "
            f"{type(stats).__name__}"
        )
        if not collective:
            raise wrong
    epochs = [] if wrong is not None else [stats] if isinstance(stats, EpochStats) else stats.epochs
    # NOTE: dataclasses.replace, not copy.copy: its __post_init__ copies the per-class count
    # arrays, which the running epoch adds to in place (a shallow copy taken mid-epoch went on
    # counting classes while its other counts stood still).
    reduced = [dataclasses.replace(e) for e in epochs]
    if collective:
        if device is None:
            device = collective_device(str(dist.get_backend(group)), torch.device("cpu"))
        # NOTE: a wrong argument on one rank is refused after this first collective, on every
        # rank: raised before it, that rank left the others waiting in it until the process
        # group's timeout (30 minutes by default).
        n = torch.tensor(
            [len(epochs), -len(epochs), -int(wrong is not None)], dtype=torch.int64, device=device
        )
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group)
        if wrong is not None:
            raise TypeError(f"{wrong} (every rank of the group stops with an error)")
        if int(n[2]):
            raise TypeError(
                "reduce_stats was called on another rank with stats that are neither a "
                "LoaderStats nor an EpochStats (that rank's error names what it got); pass "
                "loader.stats or loader.stats.current on every rank"
            )
        if int(n[0]) != -int(n[1]):
            raise ValueError(
                f"reduce_stats needs stats of the same number of epochs on every rank, but "
                f"ranks hold between {int(n[0])} and {-int(n[1])}; call it at the same point "
                "of training on every rank"
            )
        counts = torch.tensor(
            [[getattr(e, c) for c in COUNT_FIELDS] for e in epochs],
            dtype=torch.int64,
            device=device,
        ).reshape(len(epochs), len(COUNT_FIELDS))
        times = torch.tensor(
            [[getattr(e, t) for t in TIME_FIELDS] for e in epochs],
            dtype=torch.float64,
            device=device,
        ).reshape(len(epochs), len(TIME_FIELDS))
        rates = torch.tensor(
            [e.target_rate * e.examples_seen for e in epochs], dtype=torch.float64, device=device
        )
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(rates, op=dist.ReduceOp.SUM, group=group)
        counts_l, times_l, rates_l = counts.tolist(), times.tolist(), rates.tolist()
        for i, e in enumerate(reduced):
            for c, v in zip(COUNT_FIELDS, counts_l[i]):
                setattr(e, c, int(v))
            for t, v in zip(TIME_FIELDS, times_l[i]):
                setattr(e, t, float(v))
            if e.examples_seen:
                e.target_rate = rates_l[i] / e.examples_seen
        _reduce_classes(reduced, group, device)
    if isinstance(stats, EpochStats):
        return reduced[0]
    out = LoaderStats()
    out.epochs = reduced
    return out


def _reduce_classes(epochs: list[EpochStats], group: Any, device: torch.device) -> None:
    """Sum the per-class counts over ranks (in place); an epoch whose classes any rank could not
    count (None) is None on every rank."""
    fields = len(CLASS_FIELDS)
    # Per epoch and field: the count array's length, or -1 for None (the MIN finds any None).
    sizes = [
        -1 if getattr(e, f) is None else int(getattr(e, f).size)
        for e in epochs
        for f in CLASS_FIELDS
    ]
    longest = torch.tensor(sizes, dtype=torch.int64, device=device)
    fewest = longest.clone()
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=group)
    width = max([0, *longest.tolist()])
    counts = torch.zeros(len(epochs), fields, width, dtype=torch.int64, device=device)
    for i, e in enumerate(epochs):
        for j, f in enumerate(CLASS_FIELDS):
            value = getattr(e, f)
            if value is not None and value.size:
                counts[i, j, : value.size] = torch.from_numpy(value).to(device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    summed, low, high = counts.cpu().numpy(), fewest.tolist(), longest.tolist()
    for i, e in enumerate(epochs):
        for j, f in enumerate(CLASS_FIELDS):
            k = i * fields + j
            setattr(e, f, None if low[k] < 0 else summed[i, j, : high[k]].copy())
