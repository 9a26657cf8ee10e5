"""Hugging Face Accelerate's prepared DataLoader as a SelectiveLoader source.

:func:`shard_source` adapts a ``DataLoaderShard`` (what ``accelerator.prepare`` makes of a
DataLoader over a map-style dataset) or refuses it naming the supported way;
:func:`sbloader.adapt.make_source` calls it, so ``SelectiveLoader(accelerator.prepare(dataloader),
model)`` works. :class:`~sbloader.integrations.accelerate.AcceleratedLoader` (the training
loop's side) is in :mod:`sbloader.integrations.accelerate`.

NOTE: apart from the loader's wrapper, so that the core (``adapt``) depends on this adapter
only, never on the module that imports the loader (which imports ``adapt``).
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import cached_property
from typing import Any

import torch
from accelerate.data_loader import (
    BatchSamplerShard,
    IterableDatasetShard,
    SkipBatchSampler,
    get_sampler,
)
from accelerate.utils import synchronize_rng_states
from torch.utils.data import BatchSampler, IterableDataset

from .._types import is_a
from ..sources import DataLoaderSource, LoaderOrder, Source

__all__ = ["AcceleratedShardSource", "shard_source"]

_SUPPORTED = (
    "pass the DataLoader prepared by accelerator.prepare() over a map-style dataset (a "
    "DataLoaderShard, the default), or the unprepared DataLoader with each process's share "
    "(a DistributedSampler): SelectiveLoader keeps the processes in step either way"
)


def _reads_streaming(loader: Any) -> bool:
    """Whether a prepared loader reads a mosaicml-streaming ``StreamingDataset`` (directly, as
    a ``DataLoaderDispatcher`` does, or through Accelerate's ``IterableDatasetShard``), told
    without importing streaming."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        dataset = getattr(dataset, "dataset", None)
    return is_a(dataset, "streaming", "StreamingDataset")


def shard_source(loader: Any, index_key: Hashable | None = None) -> Source:
    """The source for a loader prepared by Accelerate, or a refusal naming the supported way.

    Supported: a ``DataLoaderShard`` over a map-style dataset (what ``accelerator.prepare``
    makes of a DataLoader by default). Refused (``ValueError``): batches dispatched from the
    main process (``dispatch_batches=True``, Accelerate's default for iterable datasets),
    iterable datasets (a prepared ``StreamingDataLoader``: pass it unprepared, since streaming
    gives each process its share itself), ``split_batches=True``, ``skip_first_batches``
    (resume through the loader's state instead), and ``index_key`` (the indices are recovered
    without it).

    Example:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
        >>> prepared = Accelerator(cpu=True).prepare(DataLoader(data, batch_size=4))
        >>> source = shard_source(prepared)
        >>> type(source).__name__, source.epoch_size
        ('AcceleratedShardSource', 12)
        >>> shard_source(DataLoader(data, batch_size=4))  # not prepared
        Traceback (most recent call last):
            ...
        ValueError: SelectiveLoader cannot read Accelerate's DataLoader: pass the DataLoader ...
    """
    kind = type(loader).__name__
    if _reads_streaming(loader):
        # NOTE: the generic refusals below said that the batches carry no dataset indices and
        # named a DistributedSampler; a StreamingDataLoader's carry their sample ids, and
        # streaming gives each rank its share itself: it is passed as it is, unprepared.
        raise ValueError(
            f"SelectiveLoader cannot read a StreamingDataLoader prepared by Accelerate (a "
            f"{kind}): pass the StreamingDataLoader itself, not accelerator.prepare()'d: "
            "streaming gives each process its share of every epoch (from RANK and WORLD_SIZE), "
            "and its batches carry each sample's id (sbloader.streaming.open_mds)"
        )
    if kind != "DataLoaderShard":
        fix = (
            "; to resume mid-epoch, restore the SelectiveLoader's state instead of skipping "
            "batches (AcceleratedLoader with accelerator.register_for_checkpointing)"
            if kind == "SkipDataLoader"
            else ""
        )
        raise ValueError(f"SelectiveLoader cannot read Accelerate's {kind}: {_SUPPORTED}{fix}")
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            "SelectiveLoader cannot read a loader prepared by Accelerate over an iterable "
            f"dataset (its batches carry no dataset indices); {_SUPPORTED}, with index_key= "
            "naming the field that holds the indices"
        )
    if index_key is not None:
        raise ValueError(
            f"index_key={index_key!r} is not needed for a loader prepared by Accelerate over a "
            "map-style dataset: the dataset indices are recovered; drop index_key"
        )
    if getattr(loader, "skip_batches", 0) or isinstance(loader.batch_sampler, SkipBatchSampler):
        raise ValueError(
            "the prepared loader skips its first batches (accelerator.skip_first_batches); pass "
            "the loader without skipping and resume by restoring the "
            "SelectiveLoader's state (AcceleratedLoader with "
            "accelerator.register_for_checkpointing)"
        )
    if getattr(loader.batch_sampler, "split_batches", False):
        raise ValueError(
            "SelectiveLoader cannot read a loader prepared with split_batches=True (its batch "
            "sampler reports the whole batch size, not each process's part); prepare it with "
            "split_batches=False (the default) and batch_size= each process's share"
        )
    return AcceleratedShardSource(loader)


class AcceleratedShardSource(DataLoaderSource):
    """A DataLoader prepared by ``accelerator.prepare`` (a ``DataLoaderShard``): this process's
    share of each epoch, with every example's dataset index.

    Each epoch starts as the shard's own ``__iter__`` starts one, on the caller's thread: first
    the shard's random number generators are synchronised (``synchronize_rng_states`` with the
    shard's ``rng_types``: rank 0's sampler generator, by default, broadcast to every rank, so
    that all ranks draw the same permutation and each takes its own batches of it), then the
    shard's ``set_epoch`` passes the epoch number on to its samplers. The shard's batch sampler
    (``BatchSamplerShard``) then decides this rank's batches as it does for the shard.

    NOTE: the rebuilt DataLoader is iterated, not the shard's own ``__iter__``, because only the
    rebuilt one carries the dataset indices with the data; what the shard's ``__iter__`` adds
    besides is its ``GradientState`` registration (the :class:`AcceleratedLoader`'s job, for
    the yielded batches rather than the source's) and device placement (the SelectiveLoader's
    ``device``). The synchronisation runs in :meth:`set_epoch`, which the loader calls on the
    caller's thread at every epoch start, since a collective must not run on the prefetch
    thread; a resumed epoch then restores its saved generator states over the synchronised ones.

    Example:
        On one process the shard is the whole epoch; a shuffling DataLoader needs a
        ``generator`` for its order to be replayed (a mid-epoch resume):

        >>> import torch
        >>> from accelerate import Accelerator
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> accelerator = Accelerator(cpu=True)
        >>> data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
        >>> source = AcceleratedShardSource(accelerator.prepare(DataLoader(data, batch_size=4)))
        >>> source.set_epoch(0)
        >>> [idx.tolist() for _, idx in source.epoch(skip=1)]
        [[4, 5, 6, 7], [8, 9, 10, 11]]
        >>> shuffled = accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True))
        >>> AcceleratedShardSource(shuffled).replayable
        False
        >>> shuffled = accelerator.prepare(DataLoader(
        ...     data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)))
        >>> AcceleratedShardSource(shuffled).replayable
        True
    """

    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        self.shard = loader
        sampler = get_sampler(loader)
        gens = [getattr(loader, "synchronized_generator", None), loader.generator]
        gens.append(getattr(sampler, "generator", None))
        unique: list[torch.Generator] = []
        for g in gens:
            if g is not None and all(g is not h for h in unique):
                unique.append(g)
        self._order = LoaderOrder(unique)

    @property
    def sampler(self) -> Any:
        """The sampler inside the shard's batch sampler (e.g. the RandomSampler).

        NOTE: on several processes Accelerate gives a shuffling sampler a generator; on one it
        leaves the DataLoader's own (None: torch's global RNG, which cannot be replayed: see
        ``replayable``)."""
        return get_sampler(self.shard)

    def drop_last(self) -> bool:
        return bool(getattr(self.shard.batch_sampler, "drop_last", False))

    @cached_property
    def epoch_size(self) -> int | None:
        """This process's examples per epoch (its ``BatchSamplerShard`` share, padding included).

        NOTE: counted by running the shard's own batch sampler logic over ``range(n)``, so that
        every case (``drop_last``, ``even_batches`` padding) is exactly Accelerate's.
        """
        shard = self.shard.batch_sampler
        if not isinstance(shard, BatchSamplerShard):  # one process: the batch sampler as is
            return super().epoch_size
        inner = shard.batch_sampler
        sampler = getattr(inner, "sampler", None)
        size = getattr(inner, "batch_size", None)
        try:
            n = len(sampler)  # type: ignore[arg-type]
        except TypeError:
            return None
        if size is None:
            return None
        proxy = BatchSamplerShard(
            BatchSampler(range(n), size, bool(getattr(inner, "drop_last", False))),
            num_processes=shard.num_processes,
            process_index=shard.process_index,
            split_batches=shard.split_batches,
            even_batches=shard.even_batches,
        )
        return sum(len(b) for b in proxy)

    def set_epoch(self, epoch: int) -> None:
        """Synchronise the shard's generators across processes, then ``shard.set_epoch``."""
        rng_types = getattr(self.shard, "rng_types", None)
        if rng_types:
            synchronize_rng_states(rng_types, getattr(self.shard, "synchronized_generator", None))
        self.shard.set_epoch(epoch)
