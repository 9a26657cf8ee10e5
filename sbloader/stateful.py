"""Sources that keep their own state: resumed through their own ``state_dict()``, not replayed.

torchdata's ``StatefulDataLoader`` and mosaicml-streaming's ``StreamingDataLoader`` know where
they are in an epoch (their sampler's or dataset's position, a stateful dataset's own state).
Replaying such a loader from the start of its epoch and discarding batches diverges wherever that
state matters (an iterable dataset that shuffles with its own generator, a streaming dataset that
resumes from a sample count); :class:`StatefulSource` saves and restores the loader's own state
instead.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from ._checks import check_int
from ._state import VERSION, Stateful, check_version
from .sources import (
    IndexedDataset,
    IterableSource,
    Source,
    drops_last,
    indexed_loader_kwargs,
    loader_batch_size,
    loader_epoch_size,
    set_loader_epoch,
)

__all__ = ["StatefulSource"]


def _has_state(loader: Any) -> bool:
    return isinstance(loader, Stateful)


def _map_style(loader: Any) -> bool:
    return isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)


#: Said where a StatefulDataLoader's sampler shares the loader's generator.
SHARED_GENERATOR = (
    "the StatefulDataLoader's sampler draws from the loader's own generator "
    "(shuffle=True, generator=g): torchdata's state restores the sampler's draws from it but "
    "not the loader's own draw (each epoch's base seed, drawn after the shuffle), so a resumed "
    "run's following epochs come in another order than an uninterrupted run's (torchdata 0.11); "
    "give the sampler a generator of its own, "
    "sampler=torchdata.stateful_dataloader.sampler.RandomSampler(dataset, generator=g), and "
    "no generator= to the loader, to resume exactly"
)


def _indexed_twin(loader: DataLoader) -> DataLoader:
    """A loader of ``loader``'s own class over its dataset with indices, yielding
    ``(indices, batch)``: the same sampler objects, so its state is the user's loader's."""
    if loader.batch_sampler is None:
        raise ValueError(
            "SelectiveLoader needs a batching DataLoader, but got one with batch_size=None "
            "(automatic batching disabled); give the DataLoader a batch_size, or, where its "
            "dataset yields whole batches, give them a field holding each example's dataset "
            "index and pass index_key= naming it (the DataLoader is then iterated as it is)"
        )
    kwargs = indexed_loader_kwargs(loader, loader.batch_sampler)
    # NOTE: StatefulDataLoader's one argument beyond DataLoader's; copied where the loader has
    # it, so that the twin snapshots its workers' state as often as the user's loader would.
    every = getattr(loader, "snapshot_every_n_steps", None)
    if every is not None:
        kwargs["snapshot_every_n_steps"] = every
    return type(loader)(IndexedDataset(loader.dataset), **kwargs)


class _Passes:
    """Each ``iter()`` is one pass over ``loader``, started on the first ``next()``.

    NOTE: :class:`~sbloader.sources.IterableSource` checks that its iterable is re-iterable by
    calling ``iter()`` once; on a DataLoader that would build an iterator (drawing from the
    loader's generator, starting workers) and change the very state this source saves.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        yield from self.loader


class StatefulSource(Source):
    """A loader with its own ``state_dict()`` / ``load_state_dict()``, resumed through them.

    Each epoch is one pass over the loader; a mid-epoch checkpoint holds the loader's own state
    as of the last source batch the :class:`~sbloader.SelectiveLoader` consumed (a copy taken on
    the fetching thread right after that batch, so batches fetched ahead by ``prefetch=`` are not
    counted), and resuming loads it into the loader, which continues from there. Rejected
    examples are loaded and dropped (the loader decides what it loads).

    Args:
        loader: a re-iterable of batches with ``state_dict()`` and ``load_state_dict()``, such as
            torchdata's ``StatefulDataLoader``. Over a map-style dataset (without ``index_key``)
            the dataset indices are recovered as for a DataLoader: the loader is rebuilt as a
            twin of its own class around the same dataset, sampler and options, and the twin's
            state is saved.
        index_key: the batch field holding dataset indices (an iterable dataset's own ids).
        dataset_size: the number of distinct dataset indices, for Stale-SB's per-example store;
            the ``index_key`` field's values are checked to lie below it. Default:
            ``len(dataset)`` for a map-style dataset, else unknown.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from torchdata.stateful_dataloader import StatefulDataLoader
        >>> src = StatefulSource(StatefulDataLoader(TensorDataset(torch.arange(6.0)), batch_size=4))
        >>> [(batch[0].tolist(), idx.tolist()) for batch, idx in src.epoch()]
        [([0.0, 1.0, 2.0, 3.0], [0, 1, 2, 3]), ([4.0, 5.0], [4, 5])]
        >>> src.state_dict()["position"], src.state_dict()["finished"]
        (2, True)
    """

    STATE_VERSION = 1
    #: Whether the loader's own state holds its workers' (a state saved with another
    #: ``num_workers`` is refused at :meth:`load_state_dict`).
    WORKERS_IN_STATE = True

    def __init__(
        self, loader: Any, index_key: Hashable | None = None, dataset_size: int | None = None
    ) -> None:
        if not _has_state(loader):
            raise TypeError(
                "StatefulSource needs a loader with state_dict() and load_state_dict(), but got "
                f"{type(loader).__name__}; pass other loaders to SelectiveLoader directly"
            )
        self.loader = loader
        self.index_key = index_key
        if dataset_size is not None:
            dataset_size = check_int("dataset_size", dataset_size, minimum=1)
        elif _map_style(loader):
            dataset_size = len(loader.dataset)
        self._size = dataset_size
        self._twin = _indexed_twin(loader) if index_key is None and _map_style(loader) else None
        # NOTE: given the size, the rows check that the index field's values lie below it.
        self._rows = (
            None
            if self._twin is not None
            else IterableSource(_Passes(loader), index_key, dataset_size)
        )
        self._stateful: Any = self._twin if self._twin is not None else loader
        self._position = 0  # source batches produced in the current epoch
        self._finished = False  # whether the loader's last epoch ran to its end
        self._abandoned = False  # whether it was left part-way (closed or failed)
        self._resume_at: int | None = None  # the position a loaded mid-epoch state resumes at
        self._resume_ended = False  # whether the pass that state resumes had ended
        self._loaded: dict[str, Any] | None = None  # a loaded state, until the next epoch starts

    def has_indices(self) -> bool:
        return self._twin is not None or self.index_key is not None

    def index_field_name(self) -> Hashable | None:
        return self.index_key

    def index_field_key(self) -> Hashable | None:
        """``index_key``: the batch field ``SelectiveLoader(drop_index=True)`` leaves out (None
        where the indices are recovered, over a map-style dataset)."""
        return self.index_key

    def drop_last(self) -> bool:
        return drops_last(self.loader)

    def default_prefetch(self) -> int:
        """1 with worker processes (the next batch is then fetched while the caller trains)."""
        return 1 if getattr(self.loader, "num_workers", 0) > 0 else 0

    def epoch(
        self, skip: int = 0, keep: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> Iterator[tuple[Any, np.ndarray | None]]:
        # NOTE: nothing is skipped here: a loaded state has already put the loader at ``skip``.
        expected, self._resume_at = self._resume_at or 0, None
        ended, self._resume_ended = self._resume_ended, False
        if skip != expected:
            raise ValueError(
                f"{type(self).__name__} can resume at source batch {expected} (where its loaded "
                f"state was saved), but the loader asked for batch {skip}; load the "
                "SelectiveLoader's state and the source's together, from one state_dict()"
            )
        self._loaded = None
        self._position, self._finished, self._abandoned = skip, False, False
        if ended:
            # NOTE: the loaded state was saved after the pass's last batch (the epoch's short
            # last batch, remainder="short", is handed out after it): nothing of the pass is
            # left, and the loader's own state, loaded as at an epoch's end, begins the next pass.
            self._finished = True
            return
        try:
            if self._twin is not None:
                for indices, batch in self._twin:
                    self._position += 1
                    yield batch, indices.numpy()
            else:
                assert self._rows is not None
                for batch, indices in self._rows.epoch():
                    self._position += 1
                    yield batch, indices
            self._finished = True
        finally:
            self._abandoned = not self._finished

    def state_dict(self) -> dict[str, Any]:
        """The loader's own state (a copy) and this epoch's position in source batches."""
        if self._loaded is not None:
            return self._loaded
        return {
            VERSION: self.STATE_VERSION,
            "position": self._position,
            "finished": self._finished,
            "abandoned": self._abandoned,
            "loader": copy.deepcopy(self._loader_state()),
            "num_workers": getattr(self.loader, "num_workers", None),
        }

    def _loader_state(self) -> Any:
        """The wrapped loader's own ``state_dict()`` (overridden where reading it needs care)."""
        return self._stateful.state_dict()

    def snapshot(self) -> dict[str, Any] | None:
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any], mid_epoch: bool = False) -> None:
        state = check_version(state, type(self).__name__, self.STATE_VERSION)
        workers, own = state.get("num_workers"), getattr(self.loader, "num_workers", None)
        if self.WORKERS_IN_STATE and workers is not None and workers != own:
            # NOTE: torchdata's StatefulDataLoader saves the state of each worker's share (and in
            # another form without workers): loaded into one with another num_workers, the
            # load went through and the next epoch failed deep inside torchdata (an
            # AssertionError naming a missing '_snapshot'), or resumed other shares.
            raise ValueError(
                f"the saved {type(self).__name__} state was saved from a loader with "
                f"num_workers={workers}, but this loader has num_workers={own}: its own state "
                "holds each worker's share of the data (or none), which a loader with other "
                f"workers cannot resume; build the loader with num_workers={workers} to resume it"
            )
        self._stateful.load_state_dict(self._resumable(copy.deepcopy(state["loader"]), state))
        if not mid_epoch and state.get("abandoned"):
            # NOTE: the loader's own state still describes the pass that was left part-way
            # (Lightning's limit_train_batches or max_steps end epochs early), which its next
            # iter() would resume, where the run it was saved from began a new pass. That pass
            # is resumed here and dropped (one batch read), so that the next iter() begins a
            # new one from the state the saved run's did.
            self._drop_resumed_pass()
        # NOTE: a mid-epoch state whose pass had ended (saved after the epoch's short last batch,
        # handed out after the pass's last source batch) resumes an epoch with nothing left to
        # read; refused before ("ended its epoch"), such a step checkpoint could not be loaded.
        self._resume_at = int(state["position"]) if mid_epoch else None
        self._resume_ended = bool(mid_epoch and state["finished"])
        self._loaded = state

    def _drop_resumed_pass(self) -> None:
        """Begin the pass a loaded state resumes, and leave it."""
        passes = iter(self._stateful)
        try:
            next(passes)
        except StopIteration:
            pass
        finally:
            del passes

    def _resumable(self, loader_state: Any, state: dict[str, Any]) -> Any:
        """What to load into the loader for ``state`` (overridden where the loader's own state at
        an epoch's end would not start the next epoch)."""
        return loader_state

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int | None:
        return loader_batch_size(self.loader)

    @property
    def dataset_size(self) -> int | None:
        return self._size

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    @property
    def sampler(self) -> Any:
        return getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)

    @property
    def epoch_size(self) -> int | None:
        return loader_epoch_size(self.loader, self.dataset_size)

    def set_epoch(self, epoch: int) -> None:
        set_loader_epoch(self.loader, epoch)
