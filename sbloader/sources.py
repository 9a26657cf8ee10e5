"""Sources of candidate batches, each yielding ``(batch, dataset_indices_or_None)`` per epoch.

A torch ``DataLoader`` over a map-style dataset is rebuilt around two thin wrappers: the dataset
returns each sample with its index and the collate function splits the indices off again. The
indices therefore travel inside the same batch as the data, through any sampler, shuffling and
any number of workers, so they can never come apart from their examples; the user's dataset,
sampler and collate function are used unchanged.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler
from torch.utils.data.dataloader import default_collate

from ._checks import FieldError, check_indices, check_int
from ._types import is_a

__all__ = ["DataLoaderSource", "IterableSource", "Source"]


class _IndexedSamples:
    """A fetched list of samples together with their dataset indices (crosses worker pipes)."""

    __slots__ = ("indices", "samples")

    def __init__(self, indices: Sequence[int], samples: Any) -> None:
        self.indices = indices
        self.samples = samples


class IndexedDataset(Dataset):
    """Wraps a map-style dataset so that each fetched batch of samples knows its indices.

    Attributes it does not have are the dataset's, read and written (a worker's
    ``get_worker_info().dataset`` is the dataset itself: see :class:`WorkerInit`).

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.arange(4))
        >>> wrapped = IndexedDataset(data)
        >>> wrapped.tensors is data.tensors, len(wrapped)
        (True, 4)
    """

    dataset: Dataset

    def __init__(self, dataset: Dataset) -> None:
        self.__dict__["dataset"] = dataset

    def __getattr__(self, name: str) -> Any:
        # (only for names not found on the wrapper; "dataset" itself is absent while a worker
        # unpickles the wrapper, and dunders are looked up on the class)
        dataset = self.__dict__.get("dataset")
        if dataset is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "dataset":
            self.__dict__["dataset"] = value
        else:
            setattr(self.__dict__["dataset"], name, value)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int]) -> _IndexedSamples:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return _IndexedSamples(list(indices), samples)


class WorkerInit:
    """The user's ``worker_init_fn`` for a DataLoader over :class:`IndexedDataset`, run after the
    worker's ``get_worker_info().dataset`` is set to the user's dataset.

    NOTE (why): the usual per-worker setup reads that field (opening a file handle, seeding
    per-worker augmentation, sharding): given the wrapper, it failed or, writing an attribute,
    changed nothing the dataset reads. Only this worker's info object is changed (torch's
    ``WorkerInfo`` refuses assignments once built, so the field is set past that guard); the
    worker's fetcher keeps the wrapper it was given, which wraps the same dataset object.
    """

    def __init__(self, worker_init_fn: Any) -> None:
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        if info is not None and isinstance(info.dataset, IndexedDataset):
            object.__setattr__(info, "dataset", info.dataset.__dict__["dataset"])
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)


class IndexedCollate:
    """Collates the samples with the user's collate function and returns (indices, batch)."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, fetched: _IndexedSamples) -> tuple[torch.Tensor, Any]:
        # NOTE: through numpy: several times faster than torch.as_tensor on a list of ints.
        keys = np.asarray(fetched.indices)
        if keys.ndim != 1 or keys.dtype.kind not in "iu":
            raise TypeError(
                "the DataLoader's sampler yields keys that are not integer dataset indices (the "
                f"first: {fetched.indices[0]!r}), and sbloader keeps each example's index from "
                "them (its per-example losses, feedback and resume); give the dataset's "
                "examples a field holding their index and pass index_key= naming it (the "
                "DataLoader is then iterated as it is), or sample integer indices"
            )
        indices = torch.from_numpy(keys.astype(np.int64, copy=False))
        return indices, self.collate_fn(fetched.samples)


class Source(abc.ABC):
    """The protocol of an epoch-wise source of ``(batch, indices)`` pairs.

    A source declares what it can do through plain methods (:meth:`has_indices`,
    :meth:`can_filter`, :meth:`refills_batches`, :meth:`drop_last`, :meth:`replaying`,
    :meth:`default_prefetch`, :meth:`check_prefetch`, :meth:`reuses_buffers`,
    :meth:`mid_epoch_refusal`), never through attributes the loader has to probe, and
    implements :meth:`epoch` and the state protocol. :func:`sbloader.adapt.make_source` turns
    what a user passes into a source.

    Threading contract: :meth:`epoch`'s iterator may be advanced on the loader's prefetch
    thread (see ``prefetch=``), and ``keep`` is then called on that thread too; every other
    method is called on the caller's thread, never while an epoch iterator of the same source is
    being advanced elsewhere, except :meth:`replaying`, which ``keep`` may call.

    Example:
        A source of two batches of four examples, with their dataset indices:

        >>> import torch
        >>> import sbloader
        >>> class Ranges(Source):
        ...     def has_indices(self):
        ...         return True
        ...     def epoch(self, skip=0, keep=None):
        ...         for b in range(skip, 2):
        ...             idx = np.arange(4 * b, 4 * b + 4)
        ...             yield (torch.randn(4, 4), torch.from_numpy(idx % 2)), idx
        >>> loader = sbloader.SelectiveLoader(Ranges(), torch.nn.Linear(4, 2),
        ...                                   policy=sbloader.Traditional(), batch_size=4)
        >>> [batch.indices.tolist() for batch in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """

    def has_indices(self) -> bool:
        """Whether :meth:`epoch` yields dataset indices (False: ``None`` instead)."""
        return False

    def index_field_key(self) -> Hashable | None:
        """The key or position of the field of the source's batches that holds the dataset
        indices, or None when the batches hold none (e.g. indices recovered by a DataLoader
        source). ``SelectiveLoader(drop_index=True)`` leaves this field out of yielded batches."""
        return None

    def can_filter(self) -> bool:
        """Whether :meth:`epoch` honours ``keep`` (rejected examples are then never loaded)."""
        return False

    def refills_batches(self) -> bool:
        """Whether an epoch filtered by ``keep`` still yields batches of :attr:`batch_size`, the
        kept examples re-batched (only the last may be shorter), as an unfiltered one does.
        Where it does, a policy that keeps every example it is given hands those batches out
        whole, joining none, also with ``subset=``."""
        return False

    def drop_last(self) -> bool:
        """Whether the source drops its last partial batch."""
        return False

    def replaying(self) -> bool:
        """True while a resumed epoch filters the batches it skips again (``keep`` is then called
        for examples already counted before the checkpoint)."""
        return False

    def mid_epoch_refusal(self) -> str | None:
        """Why a state saved in the middle of an epoch of this source would be refused when
        loaded (its order cannot be replayed), with the fix, or None. The loader warns when it
        takes such a state, not only when it is loaded."""
        return None

    def default_prefetch(self) -> int:
        """Source batches worth fetching ahead on a thread by default (see ``prefetch=``)."""
        return 0

    def reuses_buffers(self) -> bool:
        """Whether a batch's tensors may be overwritten once the next batch is fetched (FFCV's
        ring of buffers); the loader then copies what it keeps, or hands out, past that."""
        return False

    def check_prefetch(self, prefetch: int) -> None:  # noqa: B027 - optional hook
        """Raise ValueError, naming ``prefetch=`` and the fix, where this source's batches
        cannot be fetched ``prefetch`` batches ahead on a thread (the default accepts any)."""

    def disjoint_across_ranks(self) -> bool:
        """Whether, under DDP, the ranks' indices in a pass name disjoint shares of one dataset
        (up to a batch per rank read twice: a sharding sampler's padding), so that more
        overlap means a misconfigured source (see :meth:`sbloader.distributed.RankSync.
        check_overlap`). False (not checked) where a source's own partitioning may repeat more
        (streaming pads its shares with up to a batch per rank) or is unknown."""
        return False

    def index_field_name(self) -> Hashable | None:
        """The batch field this source reads dataset indices from (no model input), or None."""
        return None

    def id_fields(self) -> tuple[Hashable, ...]:
        """Batch fields the source adds that hold ids, not model inputs, besides the index
        field: none by default (the loader's warning about tensor fields the model is not given
        leaves them out)."""
        return ()

    def snapshot(self) -> dict[str, Any] | None:
        """This source's :meth:`state_dict` as of the batch its epoch iterator produced last.

        Called on the thread that advances :meth:`epoch` (the prefetch thread, if any), right
        after each batch, and on the caller's thread before an epoch starts; the loader saves the
        snapshot of the last batch the caller consumed. None (the default): :meth:`state_dict`,
        called at any time on the caller's thread, is already right (sources whose state does
        not move while batches are fetched ahead).
        """
        return None

    @abc.abstractmethod
    def epoch(
        self, skip: int = 0, keep: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> Iterator[tuple[Any, np.ndarray | None]]:
        """One epoch of batches, leaving out the first ``skip`` (to resume mid-epoch).

        Sources that :meth:`can_filter` load only the examples whose dataset index ``keep``
        accepts (a function from an int64 array of indices to a boolean mask); others ignore
        ``keep``. Where ``keep`` has them (the loader's :class:`~sbloader.decisions.Keep`), a
        filtering source calls ``keep.batch_made()`` as it makes each batch it does not skip,
        ``keep.batch_taken()`` as it hands out each of those batches (in the same order), and
        ``keep.ended()`` when the epoch ends, so that ``keep``'s tally of what was left out is
        counted as of the batches handed out, also where batches are made ahead (a
        DataLoader's workers).
        """

    def state_dict(self) -> dict[str, Any]:
        """The source's own state (e.g. its shuffling generator), for exact resumption."""
        return {}

    def state_kind(self) -> str:
        """The kind of source whose state this one saves and loads: the name of the class that
        defines its :meth:`state_dict` (a subclass that keeps its parent's state is of its
        parent's kind, e.g. Accelerate's shard source a DataLoader source). Part of the
        loader's identity: a state of another kind of source is refused naming both."""
        for cls in type(self).__mro__:
            if "state_dict" in vars(cls):
                return cls.__name__
        return type(self).__name__  # (unreachable: Source defines it)

    def load_state_dict(self, state: dict[str, Any], mid_epoch: bool = False) -> None:
        """Restore :meth:`state_dict`; ``mid_epoch`` says the next :meth:`epoch` resumes one."""
        if mid_epoch:
            raise ValueError(
                f"{type(self).__name__} cannot resume in the middle of an epoch; save the "
                "loader's state at an epoch boundary"
            )

    def restart_epoch(self) -> None:  # noqa: B027 - optional hook
        """After :meth:`load_state_dict` of a state saved in an epoch none of whose batches was
        consumed (its first source batch raised): the next :meth:`epoch` draws the order that
        epoch drew, not the next one. Nothing to do for a source whose state is its position."""

    def __len__(self) -> int:
        raise TypeError(f"{type(self).__name__} has no length")

    @property
    def batch_size(self) -> int | None:
        return None

    @property
    def dataset_size(self) -> int | None:
        return None

    def unsaid_size(self) -> int | None:
        """The size of a dataset whose indices the source reads from its batches, where it
        knows that size but was not told that the indices lie below it (then
        :attr:`dataset_size` is None), else None: named in errors as the ``dataset_size=`` to
        pass."""
        return None

    @property
    def dataset(self) -> Any:
        """The wrapped loader's dataset, or None (``loader.dataset`` passes it through)."""
        return None

    @property
    def sampler(self) -> Any:
        """The wrapped loader's sampler, or None (``loader.sampler`` passes it through)."""
        return None

    @property
    def epoch_size(self) -> int | None:
        """Examples per epoch on this process (a DistributedSampler's share), or None."""
        return self.dataset_size

    def last_batch_size(self) -> int | None:
        """The number of examples of a pass's last batch where the source cannot tell its
        examples per pass (:attr:`epoch_size` is None) but can tell this, else None."""
        return None

    def draws_each_once(self) -> bool:
        """Whether a pass draws every example of the dataset exactly once on this process: as
        many as the dataset holds, none dropped, and no sampler drawing with replacement (a
        ``RandomSampler(replacement=True)`` of ``len(dataset)`` draws some twice, others
        never)."""
        size = self.epoch_size
        return (
            size is not None
            and size == self.dataset_size
            and not self.drop_last()
            and not self.draws_with_replacement()
        )

    def draws_with_replacement(self) -> bool:
        """Whether the sampler draws with replacement (``WeightedRandomSampler``,
        ``RandomSampler(replacement=True)``): a pass then holds some examples twice, others
        never."""
        return bool(getattr(self.sampler, "replacement", False))

    def full_batches(self) -> int | None:
        """The batches of a pass of a source that drops its last partial batch (all full), or
        None where unknown: its length."""
        try:
            return len(self)
        except TypeError:
            return None

    def set_epoch(self, epoch: int) -> None:  # noqa: B027 - optional hook
        """Forward the epoch to samplers that want it (DistributedSampler)."""


class _SkippingBatchSampler:
    """The user's batch sampler, filtered and re-batched, without the first ``skip`` batches.

    ``keep`` (set per epoch) maps an int64 array of dataset indices to a boolean mask: rejected
    indices are never loaded, and the kept ones are re-batched to the sampler's batch size. The
    first ``skip`` (filtered) batches are left out without loading them (to resume mid-epoch).
    """

    def __init__(self, inner: Iterable[list[int]]) -> None:
        self.inner = inner
        self.skip = 0
        self.keep: Callable[[np.ndarray], np.ndarray] | None = None
        self.replaying = False  # True while the skipped batches are filtered again

    def _filtered(self) -> Iterator[list[int]]:
        keep = self.keep
        if keep is None:
            yield from self.inner
            return
        made = getattr(keep, "batch_made", None)  # (see Source.epoch)
        size = getattr(self.inner, "batch_size", None)
        buffer: list[int] = []
        for batch in self.inner:
            idx = np.asarray(batch, dtype=np.int64)
            buffer.extend(idx[keep(idx)].tolist())
            size = size or len(batch)
            while len(buffer) >= size:
                if made is not None and not self.replaying:
                    made()
                yield buffer[:size]
                buffer = buffer[size:]
        if buffer:
            if made is not None and not self.replaying:
                made()
            yield buffer

    def __iter__(self) -> Iterator[list[int]]:
        it = self._filtered()
        skip, self.skip = self.skip, 0
        self.replaying = True
        try:
            for _ in range(skip):
                if next(it, None) is None:
                    return
        finally:
            self.replaying = False
        yield from it

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


def _generators(loader: DataLoader) -> list[torch.Generator]:
    """The torch generators that decide a DataLoader's order and worker seeds."""
    gens: list[torch.Generator] = []
    sampler = getattr(loader.batch_sampler, "sampler", None)
    for g in (loader.generator, getattr(sampler, "generator", None)):
        if isinstance(g, torch.Generator) and all(g is not h for h in gens):
            gens.append(g)
    return gens


def _generator_roles(loader: DataLoader) -> list[str]:
    """What each of :func:`_generators`'s generators draws for ``loader``: its worker seeds
    (``"DataLoader"``), its sampler's order (``"sampler"``), or both (``shuffle=True`` with
    ``generator=``, whose sampler draws from the DataLoader's generator)."""
    sampler = getattr(loader.batch_sampler, "sampler", None)
    owners = (("DataLoader", loader.generator), ("sampler", getattr(sampler, "generator", None)))
    return [" and ".join(name for name, h in owners if h is g) for g in _generators(loader)]


def sampler_shares_generator(loader: Any) -> bool:
    """Whether ``loader``'s sampler draws from the loader's own ``generator`` (the role
    ``"DataLoader and sampler"`` of :func:`_generator_roles`: ``shuffle=True`` with
    ``generator=``).

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, RandomSampler
        >>> data, g = list(range(4)), torch.Generator()
        >>> sampler_shares_generator(DataLoader(data, shuffle=True, generator=g))
        True
        >>> sampler_shares_generator(DataLoader(data, sampler=RandomSampler(data, generator=g)))
        False
    """
    generator = getattr(loader, "generator", None)
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return generator is not None and getattr(sampler, "generator", None) is generator


def loader_batch_size(loader: Any) -> int | None:
    """A DataLoader's (or a loader like it) batch size: its own, or its ``batch_sampler=``'s."""
    bs = getattr(loader, "batch_size", None)
    if bs is None:
        bs = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return bs


def loader_epoch_size(loader: Any, dataset_size: int | None) -> int | None:
    """A DataLoader's (or a loader like it) examples per pass on this process: its sampler's
    length (a ``DistributedSampler`` gives this rank ``len(sampler)`` examples, not
    ``len(dataset)``), else ``dataset_size``; None for a ``batch_sampler=`` with no
    ``sampler`` of its own, which draws its batches itself and may shard by rank (only its
    number of batches is known then).

    Example:
        >>> from torch.utils.data import DistributedSampler
        >>> data = list(range(10))
        >>> sharded = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0))
        >>> own = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])  # draws its own batches
        >>> loader_epoch_size(sharded, 10), loader_epoch_size(own, 10)
        (5, None)
    """
    batches = getattr(loader, "batch_sampler", None)
    if batches is not None and not hasattr(batches, "sampler"):
        return None
    try:
        return len(getattr(batches, "sampler", None))  # type: ignore[arg-type]
    except TypeError:
        return dataset_size


def drops_last(loader: Any) -> bool:
    """Whether a DataLoader (or a loader like it) drops its last partial batch: its batch
    sampler's ``drop_last``, which a ``batch_sampler=`` given to the DataLoader decides (the
    DataLoader's own ``drop_last`` is then False, whatever the batch sampler does).

    Example:
        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> data = list(range(10))
        >>> loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 4, True))
        >>> drops_last(loader), loader.drop_last, len(loader)
        (True, False, 2)
    """
    default = bool(getattr(loader, "drop_last", False))
    return bool(getattr(getattr(loader, "batch_sampler", None), "drop_last", default))


def unreplayable_sampler(sampler: Any) -> str | None:
    """Why a DataLoader's order, drawn by ``sampler``, cannot be replayed from its generators'
    saved states, or None: the sampler draws from torch's global RNG (which sbloader never
    touches).

    NOTE: torch's random samplers (``RandomSampler``, ``SubsetRandomSampler``,
    ``WeightedRandomSampler``) and any sampler with a ``generator`` attribute draw from the
    global RNG when it is None; the DataLoader's own ``generator=`` reaches only the
    ``RandomSampler`` it makes for ``shuffle=True``.

    Example:
        >>> import torch
        >>> from torch.utils.data import RandomSampler, SubsetRandomSampler
        >>> unreplayable_sampler(SubsetRandomSampler(range(4)))[:40]
        'its sampler (SubsetRandomSampler) draws '
        >>> unreplayable_sampler(RandomSampler(range(4), generator=torch.Generator()))
    """
    if sampler is None or not hasattr(sampler, "generator") or sampler.generator is not None:
        return None
    if self_seed(sampler) is not None:
        return None  # its order comes from its seed and epoch (checked at load: LoaderOrder)
    name = type(sampler).__name__
    fix = f"build the {name} with generator=torch.Generator().manual_seed(seed)"
    if isinstance(sampler, RandomSampler):
        fix = (
            "pass generator=torch.Generator().manual_seed(seed) to the DataLoader (shuffle=True), "
            f"or to the {name} you built"
        )
    return (
        f"its sampler ({name}) draws from torch's global RNG, so its order cannot be "
        f"replayed; {fix}"
    )


def self_seed(sampler: Any) -> int | None:
    """The seed of a sampler that seeds its own generator with ``seed + epoch`` at every
    ``iter()`` (Accelerate's ``SeedableRandomSampler``, ``use_seedable_sampler=True``), or None
    for any other: its order is replayed from its seed and epoch, not from a saved generator
    state (it makes its generator at its first ``iter()``)."""
    if not is_a(sampler, "accelerate", "SeedableRandomSampler"):
        return None
    seed = getattr(sampler, "initial_seed", None)
    return None if seed is None else int(seed)


#: The settings of a DistributedSampler that decide its order, besides the epoch.
_DISTRIBUTED_ORDER = ("seed", "shuffle", "drop_last")


def sampler_settings(sampler: Any) -> dict[str, Any] | None:
    """The settings that decide a ``DistributedSampler``'s order (``seed``, ``shuffle``,
    ``drop_last``; with the epoch, from ``set_epoch``), or None for any other sampler.

    NOTE: a DistributedSampler draws each epoch's order from ``seed + epoch`` with a generator
    of its own, made at every ``iter()``: no generator state of it is saved, so a mid-epoch
    state loaded into one with another seed or ``shuffle`` skipped the consumed batches of
    another order (54 of a rank's 120 examples never trained that epoch, 13 twice), unsaid.

    Example:
        >>> from torch.utils.data import DistributedSampler
        >>> sampler_settings(DistributedSampler(range(8), num_replicas=2, rank=0, seed=3))
        {'seed': 3, 'shuffle': True, 'drop_last': False}
        >>> sampler_settings(range(8)) is None
        True
    """
    if not isinstance(sampler, DistributedSampler):
        return None
    return {key: getattr(sampler, key) for key in _DISTRIBUTED_ORDER}


def persistent(loader: Any) -> bool:
    """Whether a DataLoader keeps its workers between epochs (and so draws their base seed from
    its generator once in the run, not every epoch)."""
    return bool(getattr(loader, "persistent_workers", False) and loader.num_workers > 0)


def refuse_other_persistence(saved: bool | None, loader: DataLoader, sampler: Any) -> None:
    """Refuse (``ValueError`` naming ``persistent_workers``) a state saved from a DataLoader
    that kept its workers between epochs where ``loader`` does not, or the other way round,
    where ``loader``'s generator also draws the order (``shuffle=True`` with ``generator=``);
    ``saved``: the saved state's :func:`persistent` (None: saved before it was recorded).

    NOTE: a DataLoader with persistent workers draws their base seed from its generator once in
    the run, one without them every epoch; where that generator also draws the order, every
    later epoch's order differs: resumed with the other, the run silently went on in another
    order from the next epoch on. (``num_workers`` alone changes no order, nor persistence
    where the sampler has a generator of its own.)
    """
    generator = loader.generator
    shuffles = generator is not None and getattr(sampler, "generator", None) is generator
    if saved is None or bool(saved) == persistent(loader) or not shuffles:
        return
    raise ValueError(
        "the saved state's DataLoader "
        f"{'kept' if saved else 'did not keep'} its workers between epochs "
        f"(persistent_workers=True with num_workers > 0), but this one "
        f"{'does' if persistent(loader) else 'does not'} (persistent_workers="
        f"{loader.persistent_workers}, num_workers={loader.num_workers}): "
        "their base seed is drawn from the generator that shuffles, once in a run with "
        "persistent workers and every epoch without, so every later epoch's order would "
        "differ from the saved run's; build the DataLoader with the saved run's "
        "persistent_workers and num_workers to resume it"
    )


class LoaderOrder:
    """A DataLoader's order, as the states of the generators that draw it: now, and as the
    current epoch started (:class:`DataLoaderSource`, and :class:`IterableSource` over a
    DataLoader).

    NOTE: an epoch-boundary resume restores the states as they are now (the next epoch's order
    goes on as in the uninterrupted run); a mid-epoch one restores those of the epoch's start,
    replays the interrupted epoch's order and skips what was consumed.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> order = LoaderOrder([g])
        >>> order.begin(skip=0), torch.randint(9, (3,), generator=g).tolist()
        (False, [8, 0, 2])
        >>> order.begin(skip=1), torch.randint(9, (3,), generator=g).tolist()  # replayed
        (True, [8, 0, 2])
    """

    def __init__(self, generators: list[torch.Generator], roles: list[str] | None = None) -> None:
        self.generators = generators
        self.roles = roles
        self.epoch_start: list[torch.Tensor] | None = None
        self._restart = False

    def begin(self, skip: int) -> bool:
        """As an epoch begins: a resumed one (``skip`` > 0, or :meth:`restart` called; its start
        known) gets the states of its start back (True); any other has its start recorded
        (False)."""
        restart, self._restart = self._restart, False
        if (skip or restart) and self.epoch_start is not None:
            for g, state in zip(self.generators, self.epoch_start):
                g.set_state(state)
            return True
        self.epoch_start = [g.get_state() for g in self.generators]
        return False

    def restart(self) -> None:
        """The next :meth:`begin` replays the start of the epoch last begun, even at ``skip=0``:
        for a state saved after that epoch's order was drawn but before any of its batches was
        consumed (its first source batch raised)."""
        self._restart = True

    def state_dict(self, sampler: Any = None) -> dict[str, Any]:
        """The generators' states now and at the epoch's start, the seed of a ``sampler``
        that seeds itself (:func:`self_seed`), where it is one, and why ``sampler``'s order
        cannot be replayed (:func:`unreplayable_sampler`; None where it can)."""
        state: dict[str, Any] = {
            "generators": [g.get_state() for g in self.generators],
            "epoch_start": self.epoch_start,
            "unreplayable": unreplayable_sampler(sampler),
        }
        if self.roles is not None:
            state["roles"] = list(self.roles)
        seed = self_seed(sampler)
        if seed is not None:
            state["sampler_seed"] = seed
        settings = sampler_settings(sampler)
        if settings is not None:
            state["sampler_settings"] = settings
        return state

    def check(self, state: dict[str, Any] | None, sampler: Any, mid_epoch: bool) -> None:
        """Refuse (``ValueError`` naming the fix) a state of another number of generators (None:
        a state without them), or a mid-epoch one where ``sampler`` draws from torch's global
        RNG (or the saved run's did), where the generators draw for other parts of the
        DataLoader than the saved run's did, or where ``sampler`` seeds itself with another seed
        than the saved run's sampler, or where a ``DistributedSampler`` has another seed,
        ``shuffle`` or ``drop_last`` than the saved run's (:func:`sampler_settings`)."""
        why = unreplayable_sampler(sampler) if mid_epoch else None
        if why is not None:
            raise ValueError(f"cannot resume this DataLoader in the middle of an epoch: {why}")
        # NOTE: what counts is how the state was saved too: the order of a pass drawn from
        # torch's global RNG was not saved, so a loader rebuilt with a generator (as the
        # warning at state_dict() advises) would skip the consumed batches of another order,
        # repeating some examples and never yielding others. (Absent from older states.) Checked
        # before the generators' count: such a state also has fewer generators than the rebuilt
        # DataLoader (shuffle=True without one, then with one), and "build the DataLoader as the
        # saved one was" would send the user back to the configuration that cannot resume.
        saved_why = (state or {}).get("unreplayable")
        if mid_epoch and saved_why is not None:
            raise ValueError(
                "cannot resume this state in the middle of a pass over the data: it was saved "
                f"from a DataLoader whose order cannot be replayed ({saved_why}); a DataLoader "
                "rebuilt with a generator cannot replay the saved run's order either, so resume "
                "from a state saved at the end of a pass"
            )
        saved = self.generators if state is None else state["generators"]
        if len(saved) != len(self.generators):
            raise ValueError(
                f"the saved source state has {len(saved)} generators but this DataLoader has "
                f"{len(self.generators)}; build the DataLoader as the saved one was"
            )
        # NOTE: the same number of generators may draw otherwise: shuffle=True with the
        # DataLoader's generator= draws its worker seeds and its order from one generator, a
        # RandomSampler built with its own generator= only the order. Restored into the other,
        # the saved generator states replay another order (a mid-epoch resume then skips the
        # consumed batches of that other order, repeating some examples and never yielding
        # others); at an epoch's end the next order is drawn afresh, as after a sampler's
        # generator is added (the fix for a sampler on the global RNG). (Absent from older
        # states, which are not checked for them.)
        saved_roles = (state or {}).get("roles")
        roles = self.roles
        if mid_epoch and saved_roles is not None and roles is not None and saved_roles != roles:
            raise ValueError(
                "cannot resume this state in the middle of a pass over the data: the saved "
                "source state's generators drew for: "
                f"{'; '.join(saved_roles)}, but this DataLoader's draw for: "
                f"{'; '.join(roles)}; build the DataLoader as the saved one was "
                "(shuffle=True with its generator=, or a sampler with a generator= of its own), "
                "or resume from a state saved at the end of a pass"
            )
        seed, saved_seed = self_seed(sampler), (state or {}).get("sampler_seed")
        if mid_epoch and seed is not None and saved_seed is not None and seed != saved_seed:
            raise ValueError(
                "cannot resume this DataLoader in the middle of an epoch: its sampler "
                f"({type(sampler).__name__}) draws each epoch's order from its seed, which is "
                f"{seed} here but was {saved_seed} in the saved run (by default torch's initial "
                "seed, which differs between processes unless set); call "
                "accelerate.utils.set_seed(seed) before accelerator.prepare, or pass "
                "DataLoaderConfiguration(data_seed=seed)"
            )

        # (absent from older states, which are not checked for them)
        saved_settings, settings = (state or {}).get("sampler_settings"), sampler_settings(sampler)
        if mid_epoch and saved_settings is not None and settings is not None:
            for key, value in saved_settings.items():
                if settings.get(key) != value:
                    raise ValueError(
                        "cannot resume this DataLoader in the middle of an epoch: its sampler "
                        f"({type(sampler).__name__}) draws each epoch's order from its seed, "
                        f"shuffle and drop_last, and has {key}={settings.get(key)!r} here but "
                        f"{key}={value!r} in the saved run; build it with {key}={value!r}, as "
                        "the saved run's was, or resume from a state saved at the end of a pass"
                    )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`check`)."""
        for g, saved in zip(self.generators, state["generators"]):
            g.set_state(saved)
        self.epoch_start = state["epoch_start"]


def indexed_loader_kwargs(loader: DataLoader, batch_sampler: Any) -> dict[str, Any]:
    """The arguments of ``loader``'s twin over :class:`IndexedDataset`: the same batches from
    ``batch_sampler``, workers and memory options, collated into ``(indices, batch)``."""
    kwargs: dict[str, Any] = dict(
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=IndexedCollate(loader.collate_fn or default_collate),
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=WorkerInit(loader.worker_init_fn) if loader.num_workers > 0 else None,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return kwargs


class DataLoaderSource(Source):
    """A torch DataLoader over a map-style dataset, with every example's index recovered.

    For exact resumption it snapshots the states of the DataLoader's and its sampler's torch
    generators when each epoch starts; a mid-epoch resume restores them and skips the batches
    already consumed without loading them.

    NOTE: a shuffling DataLoader without a ``generator`` draws its order from torch's global RNG,
    which sbloader never touches, so its order cannot be replayed: such a source resumes only at
    epoch boundaries (a mid-epoch state is refused with the fix).

    NOTE (persistent workers): a DataLoader draws its workers' base seed from its ``generator``
    when it makes an iterator, which with ``persistent_workers=True`` happens once, at the
    first epoch; later epochs reuse the workers and draw only their order, from the same
    generator when it also shuffles. A resumed run (or one whose workers died) makes a new
    iterator where the uninterrupted run reused one: its base seed is then drawn from a
    generator of its own (seeded by the base seed the run drew), so that the order goes on as
    in the uninterrupted run. The state records whether the run had drawn it, at the epoch's
    start (for a mid-epoch resume) and now.

    Example:
        A filtering epoch loads only the examples ``keep`` accepts, in full batches:

        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> src = DataLoaderSource(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4))
        >>> [idx.tolist() for _, idx in src.epoch()]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> [(x.tolist(), idx.tolist()) for (x,), idx in src.epoch(keep=lambda i: i % 2 == 0)]
        [([0.0, 2.0, 4.0, 6.0], [0, 2, 4, 6])]
        >>> [idx.tolist() for _, idx in src.epoch(skip=1)], len(src), src.dataset_size
        ([[4, 5, 6, 7]], 2, 8)
    """

    def __init__(self, loader: DataLoader) -> None:
        if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
            what = (
                type(loader).__name__
                if not isinstance(loader, DataLoader)
                else "a DataLoader over an iterable dataset"
            )
            raise TypeError(
                "DataLoaderSource's loader should be a torch DataLoader over a map-style dataset "
                f"(whose indices it recovers), but got {what}; pass any other source to "
                "SelectiveLoader (sbloader.adapt.make_source) as it is"
            )
        if loader.batch_size is None and loader.batch_sampler is None:
            raise ValueError(
                "SelectiveLoader needs a batching DataLoader, but got one with batch_size=None "
                "(automatic batching disabled); give the DataLoader a batch_size, or, where its "
                "dataset yields whole batches, give them a field holding each example's dataset "
                "index and pass index_key= naming it (the DataLoader is then iterated as it is)"
            )
        self.loader = loader
        assert loader.batch_sampler is not None  # a batching DataLoader (checked above)
        self._batch_sampler = _SkippingBatchSampler(loader.batch_sampler)
        self._order = LoaderOrder(_generators(loader), _generator_roles(loader))
        # Persistent workers: the base seed the run drew for them from the generator (None: not
        # drawn yet), now and when the current epoch started (see the class's NOTE).
        self._base_seed: int | None = None
        self._epoch_start_seed: int | None = None
        # The workers this source made from a generator of their own (see _iterate): the base
        # seed they follow and their own base seed (drawn from that generator), or None.
        self._own_workers: tuple[int, int] | None = None
        self._indexed = DataLoader(
            IndexedDataset(loader.dataset), **indexed_loader_kwargs(loader, self._batch_sampler)
        )

    def has_indices(self) -> bool:
        return True

    def can_filter(self) -> bool:
        return True

    def refills_batches(self) -> bool:
        """True: the kept indices are re-batched to the batch sampler's size before loading."""
        return True

    def drop_last(self) -> bool:
        return drops_last(self.loader)

    def replaying(self) -> bool:
        return self._batch_sampler.replaying

    def default_prefetch(self) -> int:
        """1 with worker processes (the next batch is then fetched while the caller trains)."""
        return 1 if self.loader.num_workers > 0 else 0

    def disjoint_across_ranks(self) -> bool:
        """True: a map-style dataset's indices, shared out by a sampler."""
        return True

    @property
    def out_of_order(self) -> bool:
        """Whether the DataLoader hands out batches as its workers finish them
        (``in_order=False`` with worker processes), not in the sampler's order."""
        return not getattr(self.loader, "in_order", True) and self.loader.num_workers > 0

    @property
    def replayable(self) -> bool:
        """Whether the epoch order can be replayed from saved generator states."""
        return unreplayable_sampler(self.sampler) is None

    def mid_epoch_refusal(self) -> str | None:
        if self.out_of_order:
            return (
                "the DataLoader hands out batches as its workers finish them (in_order=False), "
                "so the batches consumed are not the first ones of its order; give it "
                "in_order=True"
            )
        return unreplayable_sampler(self.sampler)

    def epoch(
        self, skip: int = 0, keep: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> Iterator[tuple[Any, np.ndarray]]:
        if self._order.begin(skip):
            self._base_seed = self._epoch_start_seed
        else:
            self._epoch_start_seed = self._base_seed
        self._batch_sampler.skip = skip
        self._batch_sampler.keep = keep
        self._drop_workers(only_dead=True)
        # NOTE: the DataLoader draws batches from the sampler ahead of handing them out (with
        # workers, prefetch_factor per worker): the keep function is told which batch goes out,
        # so that its tally counts what the batches handed out left out (see Source.epoch).
        taken = getattr(keep, "batch_taken", None)
        try:
            for indices, batch in self._iterate():
                if taken is not None:
                    taken()
                yield batch, indices.numpy()
        except Exception:
            self._drop_workers(only_dead=False)
            raise
        ended = getattr(keep, "ended", None)
        if ended is not None:
            ended()

    def _iterate(self) -> Iterator[Any]:
        """A new epoch's iterator of the rebuilt DataLoader; with persistent workers, its base
        seed drawn from the generator once in the run (see the class's NOTE)."""
        loader = self._indexed
        if not (loader.persistent_workers and loader.num_workers > 0):
            return iter(loader)
        workers = loader._iterator
        if workers is not None:
            seed = int(workers._base_seed)
            if self._base_seed is not None and (
                seed == self._base_seed or self._own_workers == (self._base_seed, seed)
            ):
                # NOTE: the workers of an earlier epoch, those made from a generator of their
                # own too (see below), whose base seed is another: they were made again every
                # epoch of a resumed run, restarting their random streams each epoch. Only the
                # order is drawn.
                return iter(loader)
            # NOTE: workers whose base seed is not the one this epoch's order follows: a state
            # restored into this loader (a rollback, or a retry after an error) whose epoch
            # began before the run drew its base seed (its first), or drew another. Reused,
            # they drew only the order, from where the uninterrupted run had drawn the seed
            # first: another order, whose first batches the resumed epoch skipped (examples
            # repeated and others never yielded). Made again, as the uninterrupted run did.
            self._drop_workers(only_dead=False)
        if self._base_seed is None:  # the run's first: drawn from the generator, as torch does
            it = iter(loader)
            self._base_seed = int(it._base_seed)
            return it
        own = torch.Generator().manual_seed(self._base_seed)
        shared, loader.generator = loader.generator, own
        try:
            it = iter(loader)
        finally:
            loader.generator = shared
        self._own_workers = (self._base_seed, int(it._base_seed))
        return it

    def _drop_workers(self, only_dead: bool) -> None:
        """Shut down persistent workers (if ``only_dead``: only when one has died), so that the
        next epoch starts afresh.

        NOTE: a DataLoader with ``persistent_workers=True`` keeps its worker iterator after an
        epoch failed because a worker was killed (e.g. by the OOM killer); its next epoch then
        fails again, or hangs forever fetching a tensor the dead worker shared. The death may
        surface while the worker still looks alive, or (through torch's SIGCHLD handler) outside
        this loop: hence both checks.
        """
        it = getattr(self._indexed, "_iterator", None)
        workers = getattr(it, "_workers", None) or []
        if it is None or (only_dead and all(w.is_alive() for w in workers)):
            return
        self._indexed._iterator = None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._order.state_dict(self.sampler),
            "base_seed": self._base_seed,
            "epoch_start_seed": self._epoch_start_seed,
            "out_of_order": self.out_of_order,
            "persistent_workers": persistent(self._indexed),
        }

    def load_state_dict(self, state: dict[str, Any], mid_epoch: bool = False) -> None:
        self._order.check(state, self.sampler, mid_epoch)
        refuse_other_persistence(state.get("persistent_workers"), self._indexed, self.sampler)
        if mid_epoch and state.get("out_of_order", self.out_of_order):
            # NOTE: a resumed epoch skips the batches consumed, taken as the sampler's first
            # ones; out of order they were whichever the workers finished first, so the resumed
            # epoch would repeat some examples and never yield others. What counts is how the
            # state was saved (a loader rebuilt with in_order=True cannot mend that), recorded
            # since; older states are judged by the loading DataLoader.
            raise ValueError(
                "cannot resume this state in the middle of a pass over the data: it was saved "
                "from a DataLoader with in_order=False, whose workers hand out batches in the "
                "order they finish them, so the batches consumed are not the sampler's first "
                "ones; give the DataLoader in_order=True (the default) to save states that "
                "resume mid-pass, or resume from a state saved at the end of a pass"
            )
        self._order.load_state_dict(state)
        # (absent from states saved before persistent workers were followed)
        self._base_seed = state.get("base_seed")
        self._epoch_start_seed = state.get("epoch_start_seed")

    def restart_epoch(self) -> None:
        self._order.restart()

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int | None:
        return loader_batch_size(self.loader)

    @property
    def dataset_size(self) -> int | None:
        return len(self.loader.dataset)  # type: ignore[arg-type]

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def epoch_size(self) -> int | None:
        return loader_epoch_size(self.loader, self.dataset_size)

    @property
    def sampler(self) -> Any:
        return getattr(self.loader.batch_sampler, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        set_loader_epoch(self.loader, epoch)


def _fields(batch: Any) -> str:
    """The fields of a source batch in a few words, for an error naming a field it lacks.

    Example:
        >>> _fields({"x": 0, "i": 1}), _fields((0, 1, 2)), _fields(7)
        ("its keys: ['x', 'i']", 'positions 0 to 2 of its 3-field tuple', 'batches of type int')
    """
    if isinstance(batch, Mapping):
        return f"its keys: {list(batch.keys())!r}"
    if isinstance(batch, (tuple, list)):
        kind = type(batch).__name__
        return f"positions 0 to {len(batch) - 1} of its {len(batch)}-field {kind}"
    return f"batches of type {type(batch).__name__}"


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """Tell a DataLoader's batch sampler, its sampler and the loader's sampler the epoch, each
    that takes one (``set_epoch``) once, as Lightning does: a ``DistributedSampler`` and a
    batch sampler that shards and shuffles by epoch itself (bucketing samplers) both reshuffle
    by it."""
    batches = getattr(loader, "batch_sampler", None)
    told: set[int] = set()
    for obj in (batches, getattr(batches, "sampler", None), getattr(loader, "sampler", None)):
        set_epoch = getattr(obj, "set_epoch", None)
        if obj is None or id(obj) in told or not callable(set_epoch):
            continue
        told.add(id(obj))
        set_epoch(epoch)


class IterableSource(Source):
    """Any re-iterable of batches; indices come from the field ``index_key`` if given.

    Args:
        iterable: the batches, one pass per epoch.
        index_key: the field holding dataset indices, or None.
        dataset_size: the number of examples, which an iterable cannot tell: each epoch is taken
            to yield this many, and the dataset indices must lie in ``[0, dataset_size)``
            (checked per batch). It sizes Stale-SB's per-example store and a ``subset`` mask,
            and gives ``loader.expected_batches()`` and ``loader.progress`` their example count.

    Example:
        >>> import torch
        >>> batches = [(torch.zeros(4, 2), torch.zeros(4), torch.arange(4 * b, 4 * b + 4))
        ...            for b in range(3)]
        >>> src = IterableSource(batches, index_key=2, dataset_size=12)
        >>> [idx.tolist() for _, idx in src.epoch(skip=1)], src.epoch_size, src.index_field_key()
        ([[4, 5, 6, 7], [8, 9, 10, 11]], 12, 2)
    """

    def __init__(
        self,
        iterable: Iterable,
        index_key: Hashable | None = None,
        dataset_size: int | None = None,
    ) -> None:
        if not isinstance(iterable, Iterable):
            raise TypeError(
                "IterableSource's iterable should be a re-iterable of batches (a DataLoader, a "
                f"list of batches), but got {type(iterable).__name__}"
            )
        # NOTE: told by its type, not by calling iter(): on a DataLoader that built an iterator,
        # drawing its base seed from the DataLoader's generator (so that every epoch's order
        # was another than the DataLoader's own, for the same generator state) and starting its
        # worker processes, before the first epoch.
        if isinstance(iterable, Iterator):
            raise TypeError(
                "SelectiveLoader's source should be re-iterable (one pass per epoch), but got an "
                f"iterator ({type(iterable).__name__}); pass the DataLoader or a list of batches"
            )
        self.iterable = iterable
        self.index_key = index_key
        self._size = (
            None if dataset_size is None else check_int("dataset_size", dataset_size, minimum=1)
        )
        # NOTE (a DataLoader iterated as it is, e.g. with index_key=): its order comes from its
        # generators, whose states are saved (now, and as the epoch started), so that an
        # epoch-boundary resume goes on with the next epoch's order, and a mid-epoch one
        # replays the interrupted epoch's order and skips what was consumed.
        self._order = (
            LoaderOrder(_generators(iterable), _generator_roles(iterable))
            if isinstance(iterable, DataLoader)
            else None
        )

    def has_indices(self) -> bool:
        return self.index_key is not None

    def index_field_key(self) -> Hashable | None:
        return self.index_key

    def epoch(
        self, skip: int = 0, keep: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> Iterator[tuple[Any, np.ndarray | None]]:
        # NOTE: a generic iterable cannot skip without producing batches; resuming mid-epoch
        # replays and discards them, which is exact only if the iterable's order is fixed (or,
        # for a DataLoader, drawn from the generators restored here).
        if self._order is not None:
            self._order.begin(skip)
        for i, batch in enumerate(self.iterable):
            if i < skip:
                continue
            if self.index_key is None:
                yield batch, None
                continue
            try:
                raw = batch[self.index_key]
            except (KeyError, IndexError, TypeError):
                raise FieldError(
                    f"index_key={self.index_key!r} names no field of the source's batches "
                    f"({_fields(batch)}); pass index_key= the key or position of the field that "
                    "holds dataset indices"
                ) from None
            indices = check_indices(f"the index field {self.index_key!r}", raw)
            if self._size is not None and indices.size:
                low, high = int(indices.min()), int(indices.max())
                if low < 0 or high >= self._size:
                    raise ValueError(
                        f"the index field {self.index_key!r} holds indices from {low} to {high}, "
                        f"outside [0, dataset_size={self._size}); pass dataset_size= the number "
                        "of examples (one more than the largest dataset index)"
                    )
            yield batch, indices

    def state_dict(self) -> dict[str, Any]:
        loader = self.iterable
        if not isinstance(loader, DataLoader):
            return {}
        state = {} if self._order is None else self._order.state_dict(self.sampler)
        state["persistent_workers"] = persistent(loader)
        if isinstance(loader.dataset, IterableDataset):
            state["num_workers"] = loader.num_workers
        return state

    def mid_epoch_refusal(self) -> str | None:
        """A DataLoader iterated as it is: refused mid-epoch where its sampler draws from torch's
        global RNG (as at :meth:`load_state_dict`)."""
        return None if self._order is None else unreplayable_sampler(self.sampler)

    def load_state_dict(self, state: dict[str, Any], mid_epoch: bool = False) -> None:
        """A DataLoader's order (see the NOTE in ``__init__``); nothing else: a mid-epoch
        resume replays the iterable and skips batches. Refuses (``ValueError``) a state saved
        from a DataLoader that read its ``IterableDataset`` with another ``num_workers``, or
        (where its generator shuffles) kept its workers between epochs where this one does not,
        or the other way round (:func:`refuse_other_persistence`)."""
        loader = self.iterable
        if not isinstance(loader, DataLoader):
            return
        workers = state.get("num_workers")  # (absent from older states)
        if workers is not None and workers != loader.num_workers:
            # NOTE: an IterableDataset read by workers yields one stream per worker (each its
            # share, as the dataset splits it by get_worker_info()), and the DataLoader hands
            # out their batches in turn: with another number of workers every batch holds other
            # examples, so a mid-epoch resume skipped other batches than the saved run consumed
            # (repeating some examples and never yielding others), and every later epoch was
            # another run's.
            raise ValueError(
                f"the saved source state's DataLoader read its IterableDataset with num_workers="
                f"{workers}, but this one has num_workers={loader.num_workers}: each worker "
                "yields its own share of the stream, so the batches would hold other examples "
                f"than the saved run's; build the DataLoader with num_workers={workers} to "
                "resume it"
            )
        refuse_other_persistence(state.get("persistent_workers"), loader, self.sampler)
        assert self._order is not None  # (made for every DataLoader)
        saved = state if "generators" in state else None  # (None: saved before they were)
        self._order.check(saved, self.sampler, mid_epoch)
        if saved is not None:
            self._order.load_state_dict(saved)

    def restart_epoch(self) -> None:
        if self._order is not None:
            self._order.restart()

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    @property
    def batch_size(self) -> int | None:
        """The iterable's ``batch_size``; for a DataLoader built with ``batch_sampler=``, its
        batch sampler's (:func:`loader_batch_size`), as for a DataLoader read without
        ``index_key=``."""
        return loader_batch_size(self.iterable)

    @property
    def dataset_size(self) -> int | None:
        """``dataset_size=`` as given (an iterable cannot tell its size), or None."""
        return self._size

    def unsaid_size(self) -> int | None:
        """``len(dataset)`` of a DataLoader over a map-style dataset read with ``index_key=``
        and no ``dataset_size=``, else None.

        NOTE: not taken as ``dataset_size``: the index field may hold ids beyond
        ``len(dataset)`` (a ``Subset`` whose examples carry the full dataset's indices), which
        a policy without a store takes as they are. A store needs the bound said.
        """
        loader = self.iterable
        if self._size is not None or not isinstance(loader, DataLoader):
            return None
        if isinstance(loader.dataset, IterableDataset):
            return None
        try:
            return len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            return None

    @property
    def epoch_size(self) -> int | None:
        """``dataset_size``; for a DataLoader over a map-style dataset (read with
        ``index_key=``), what its sampler draws in a pass, as for any DataLoader
        (:func:`loader_epoch_size`: a DistributedSampler's share, a sampler's ``num_samples``).
        """
        loader = self.iterable
        if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
            return loader_epoch_size(loader, self._size)
        return self._size

    def drop_last(self) -> bool:
        """A DataLoader's (:func:`drops_last`); False for any other iterable."""
        return drops_last(self.iterable) if isinstance(self.iterable, DataLoader) else False

    def full_batches(self) -> int | None:
        """Its length; for a DataLoader over an ``IterableDataset`` without one, read by at
        most one worker, ``dataset_size // batch_size`` (with several, each worker's stream
        drops its own short batch: unknown)."""
        full = super().full_batches()
        loader = self.iterable
        if full is not None or not isinstance(loader, DataLoader) or loader.num_workers > 1:
            return full
        bs = loader.batch_size
        return None if self._size is None or not bs else self._size // bs

    def last_batch_size(self) -> int | None:
        """A DataLoader's last batch over a sized ``IterableDataset`` read by at most one
        worker: ``len(dataset)`` less its other batches. None for any other iterable.

        NOTE: not ``dataset_size``, which would also size the store and bound the indices by
        the dataset's own ``__len__``. With several workers each worker's stream ends in its
        own short batch, so the last batch does not tell them all.
        """
        loader = self.iterable
        if not isinstance(loader, DataLoader) or loader.num_workers > 1:
            return None
        bs, dataset = loader.batch_size, loader.dataset
        if bs is None or loader.drop_last or not isinstance(dataset, IterableDataset):
            return None
        try:
            examples, batches = len(dataset), len(loader)  # type: ignore[arg-type]
        except TypeError:
            return None
        last = examples - (batches - 1) * bs
        return last if 0 < last <= bs else None

    @property
    def dataset(self) -> Any:
        return getattr(self.iterable, "dataset", None)

    def set_epoch(self, epoch: int) -> None:
        """A DataLoader's samplers are told the epoch (see :func:`set_loader_epoch`)."""
        if isinstance(self.iterable, DataLoader):
            set_loader_epoch(self.iterable, epoch)

    @property
    def sampler(self) -> Any:
        """The sampler that draws the order (a DataLoader's batch sampler's), or None."""
        batches = getattr(self.iterable, "batch_sampler", None)
        return getattr(batches, "sampler", getattr(self.iterable, "sampler", None))
