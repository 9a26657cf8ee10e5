"""mosaicml-streaming as a source: MDS shards written from arrays, read back keyed by sample id.

For data that does not fit one machine: a ``StreamingDataset`` streams MDS shards into a local
cache and hands each rank a disjoint share of every epoch. :class:`IndexedStreamingDataset` adds
each sample's own streaming sample id (its global index over all streams, the same on every rank
and in every epoch) to the sample, as the field ``"sample_id"``, and :class:`StreamingSource`
uses it as the dataset index, so Stale-SB's per-example store is keyed by it. A
``StreamingDataLoader`` is resumed through its own ``state_dict()`` (exact mid-epoch resume, the
sample count saved as of the last batch the loader consumed).

Importing this module imports ``streaming`` (``import sbloader`` does not; pass a
``StreamingDataLoader`` to ``SelectiveLoader`` and it is imported then). Note that ``import
streaming`` imports torchvision (for streaming's own vision datasets).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

try:
    from streaming import MDSWriter, StreamingDataLoader, StreamingDataset
except ModuleNotFoundError as e:  # streaming imports torchvision at its top level
    if (e.name or "").partition(".")[0] != "torchvision":
        raise
    raise ModuleNotFoundError(
        "sbloader.streaming imports mosaicml-streaming, whose `import streaming` imports "
        "torchvision, which is not installed; install the torchvision build that matches your "
        "torch, or, where none exists for it (this project's CPU-only setup), put sbloader's "
        "placeholder first on the path: PYTHONPATH=tests/placeholders (from the repository)",
        name="torchvision",
    ) from e

from streaming.base import distributed as streaming_ranks

from ._checks import check_bool, check_int
from .stateful import StatefulSource

__all__ = ["SAMPLE_ID", "IndexedStreamingDataset", "StreamingSource", "open_mds", "write_mds"]

#: The field :class:`IndexedStreamingDataset` adds to every sample: its streaming sample id.
SAMPLE_ID = "sample_id"
#: How often :meth:`StreamingSource._loader_state` reads a resume state another rank is writing
#: (10 ms apart).
_READS = 100


def _check_ranks(rank: int, world_size: int) -> None:
    """Refuse a streaming rank layout that is not the ``torch.distributed`` job's.

    NOTE: streaming reads the ranks from ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (torchrun sets them), never from ``torch.distributed``. A job whose
    process group was initialised with ``rank=`` and ``world_size=`` (``mp.spawn``) and without
    them is one rank of one to streaming on every process: on one machine the ranks then all
    register the same shared memory and all but one fail with a bare ``FileExistsError`` naming
    it; on machines of their own, every rank silently read the whole dataset every epoch.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    job = (dist.get_rank(), dist.get_world_size())
    if job == (rank, world_size):
        return
    raise ValueError(
        f"torch.distributed runs rank {job[0]} of {job[1]}, but streaming reads rank {rank} of "
        f"{world_size} from the environment (RANK={os.environ.get('RANK')!r}, "
        f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}), so the ranks would not read disjoint "
        "shares of the data; set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE in each "
        "process before building the dataset (torchrun sets them)"
    )


#: MDS's encodings of float scalars, by numpy dtype name.
_FLOAT_ENCODINGS = frozenset({"float16", "float32", "float64"})


def _kind(value: Any) -> str:
    """The numpy dtype kind of a field's value ("i", "u", "f", ...)."""
    if isinstance(value, torch.Tensor):
        return "f" if value.dtype.is_floating_point else "c" if value.dtype.is_complex else "i"
    return np.asarray(value).dtype.kind


def _column(value: Any) -> tuple[str, Any]:
    """An MDS encoding for one field, from its first value, and a converter for every value."""
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("write_mds cannot store booleans; convert them to integers first")
    if isinstance(value, (int, float, np.integer, np.floating)) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        # NOTE: a float scalar keeps its dtype, as arrays do (a float32 target read back as
        # float64 made a float32 model's loss fail in backward(); a Python float is float64);
        # an integer one comes back int64 whatever it was written as, as losses want class
        # labels (cross_entropy refuses int32 targets), as write_beton's do.
        dtype = np.asarray(value).dtype
        if dtype.kind in "iu":
            return "int64", lambda v: np.int64(v)
        if dtype.name in _FLOAT_ENCODINGS:
            return dtype.name, lambda v: dtype.type(v)
        return "float64", lambda v: np.float64(v)
    if isinstance(value, np.ndarray):
        shape = ",".join(str(d) for d in value.shape)
        dtype = value.dtype

        def convert(v: Any) -> np.ndarray:
            v = v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
            return np.ascontiguousarray(v, dtype=dtype)

        return f"ndarray:{dtype.name}:{shape}", convert
    raise TypeError(
        f"write_mds stores arrays, tensors and numbers, but got a {type(value).__name__} field"
    )


def write_mds(
    path: str | os.PathLike,
    data: Any,
    *,
    names: Sequence[str] | None = None,
    size_limit: int = 1 << 26,
) -> Path:
    """Write a map-style dataset, or equal-length arrays, as MDS shards into ``path``.

    Sample ``i`` written is sample id ``i`` of a ``StreamingDataset`` over this one directory:
    :class:`IndexedStreamingDataset` hands it out with ``sample_id = i``.

    Args:
        path: the output directory (must be empty or not exist).
        data: a map-style dataset whose items are tuples (or single values), or a tuple/list of
            arrays or tensors of equal length (e.g. ``(images, labels)``). Each field is
            written in sample 0's encoding (integer scalars as int64); a later floating-point
            value in a field that sample 0 holds as integers is refused (``TypeError``), not
            truncated.
        names: field names, one per sample entry. Default ``("image", "label")`` for two entries,
            ``("image",)`` for one, else required.
        size_limit: bytes per shard (streaming's default, 64 MiB).

    Returns:
        The directory written.

    Example:
        >>> import tempfile, numpy as np
        >>> data = (np.zeros((5, 2), np.float32), np.arange(5))
        >>> out = write_mds(tempfile.mkdtemp() + "/mds", data)
        >>> sorted(p.name for p in out.iterdir())
        ['index.json', 'shard.00000.mds']
    """
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"write_mds writes into an empty directory, but path={str(path)!r} is not")
    if isinstance(data, (tuple, list)):
        columns = [c.numpy() if isinstance(c, torch.Tensor) else np.asarray(c) for c in data]
        lengths = {len(c) for c in columns}
        if len(lengths) != 1:
            raise ValueError(f"write_mds needs arrays of equal length, but got {sorted(lengths)}")
        n = lengths.pop()

        def sample(i: int) -> tuple[Any, ...]:
            return tuple(c[i] for c in columns)

    else:
        n = len(data)

        def sample(i: int) -> tuple[Any, ...]:
            item = data[i]
            return tuple(item) if isinstance(item, (tuple, list)) else (item,)

    if n == 0:
        raise ValueError("write_mds needs at least one sample, but data is empty")
    first = sample(0)
    if names is None:
        defaults = {1: ("image",), 2: ("image", "label")}
        if len(first) not in defaults:
            raise ValueError(
                f"samples have {len(first)} entries; pass names= (one field name per entry)"
            )
        names = defaults[len(first)]
    if len(names) != len(first) or SAMPLE_ID in names:
        raise ValueError(
            f"names should give one name per sample entry ({len(first)}) and not {SAMPLE_ID!r}, "
            f"but got names={tuple(names)!r}"
        )
    encodings = [_column(v) for v in first]
    columns_spec = {name: enc for name, (enc, _) in zip(names, encodings)}
    integral = [_kind(v) in "iu" for v in first]
    with MDSWriter(out=str(path), columns=columns_spec, size_limit=size_limit) as writer:
        for i in range(n):
            values = sample(i)
            for name, whole, v in zip(names, integral, values):
                # NOTE: a field's encoding comes from sample 0; a later float value in an integer
                # field (a map-style dataset's label 0, then 0.5) was truncated without a word.
                if whole and _kind(v) in "fc":
                    raise TypeError(
                        f"write_mds writes field {name!r} as integers (as sample 0 holds it), "
                        f"but sample {i} holds floating-point values there ({type(v).__name__}), "
                        f"which would be truncated; make sample 0's {name!r} a float too (or "
                        "every sample's an integer)"
                    )
            writer.write({name: conv(v) for name, (_, conv), v in zip(names, encodings, values)})
    return path


class IndexedStreamingDataset(StreamingDataset):
    """A ``StreamingDataset`` whose samples carry their own sample id, as ``"sample_id"``.

    Takes ``StreamingDataset``'s arguments. Every sample dict gets the field
    :data:`SAMPLE_ID`: its global sample id over all streams, which is what the shuffling and
    partitioning permute, so it names the same example on every rank and in every epoch.

    Example:
        >>> import tempfile, numpy as np
        >>> data = (np.zeros((4, 2), np.float32), np.arange(4))
        >>> out = write_mds(tempfile.mkdtemp() + "/mds", data)
        >>> dataset = IndexedStreamingDataset(local=str(out), batch_size=2, shuffle=False)
        >>> sample = dataset[2]
        >>> sorted(sample), int(sample["sample_id"]), sample["image"].flags.writeable
        (['image', 'label', 'sample_id'], 2, True)
        >>> del dataset, sample  # releases streaming's shared memory for this directory
    """

    def get_item(self, sample_id: int, retry: int = 7) -> Any:
        sample = super().get_item(sample_id, retry)
        # NOTE: MDS decodes arrays as read-only views of the shard; torch's collate would wrap
        # them as tensors that must not be written to (and warns). Samples are copied out.
        for key, value in sample.items():
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                sample[key] = value.copy()
        sample[SAMPLE_ID] = np.int64(sample_id)
        return sample


def open_mds(
    local: str | os.PathLike,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    **dataset_kwargs: Any,
) -> StreamingDataLoader:
    """A ``StreamingDataLoader`` over the MDS directory ``local``, with sample ids.

    Each rank reads a disjoint share of every epoch: streaming reads the ranks from ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (torchrun sets them), not from
    ``torch.distributed``; where a process group is initialised and ``RANK`` or ``WORLD_SIZE``
    disagree with it (unset, as under ``mp.spawn``), ``ValueError``.

    Args:
        local: the MDS directory (read where it lies; no remote).
        batch_size: examples per source batch (per rank).
        shuffle: shuffle every epoch (streaming's deterministic, world-size-independent order).
        seed: the shuffle seed.
        num_workers: DataLoader worker processes.
        **dataset_kwargs: further ``StreamingDataset`` arguments.

    Example:
        >>> import tempfile, numpy as np
        >>> data = (np.zeros((5, 2), np.float32), np.arange(5))
        >>> out = write_mds(tempfile.mkdtemp() + "/mds", data)
        >>> loader = open_mds(out, 2, shuffle=False)
        >>> [b["sample_id"].tolist() for b in loader]
        [[0, 1], [2, 3], [4]]
        >>> del loader  # releases streaming's shared memory for this directory
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    _check_ranks(streaming_ranks.get_rank(), streaming_ranks.get_world_size())
    # NOTE: a flag given as a string ("False", from a config) was read by its truth value: the
    # order shuffled, unsaid.
    shuffle = check_bool("shuffle", shuffle)
    num_workers = check_int("num_workers", num_workers, minimum=0)
    dataset = IndexedStreamingDataset(
        local=str(local),
        batch_size=batch_size,
        shuffle=shuffle,
        shuffle_seed=check_int("seed", seed, minimum=0),
        **dataset_kwargs,
    )
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers)


#: The StreamingDataset settings that decide its order (see StreamingSource.load_state_dict).
_ORDER = (
    "shuffle",
    "shuffle_seed",
    "shuffle_algo",
    "shuffle_block_size",
    "sampling_method",
    "batching_method",
)
#: The name open_mds gives a setting, where it differs from the StreamingDataset's.
_OPEN_MDS_NAMES = {"shuffle_seed": "seed"}


class StreamingSource(StatefulSource):
    """A ``StreamingDataLoader`` as a source, keyed by the batch field ``index_key``.

    Resumed through the loader's own ``state_dict()`` (the samples seen this epoch, as of the last
    source batch consumed). The dataset size (for Stale-SB's store) is the dataset's number of
    underlying samples, so sample ids index it; the epoch size is this rank's share.

    Args:
        loader: a ``StreamingDataLoader`` over a ``StreamingDataset``.
        index_key: the batch field holding dataset indices: :data:`SAMPLE_ID` by default, as
            :class:`IndexedStreamingDataset` yields; or a field written with the data.
        dataset_size: with ``index_key``, the number of distinct values its field may hold (one
            more than the largest), where that is not the dataset's sample count (ids of a
            larger dataset). Default: the sample count.

    Example:
        >>> import tempfile, numpy as np
        >>> from streaming import StreamingDataLoader, StreamingDataset
        >>> data = (np.zeros((5, 2), np.float32), np.arange(5))
        >>> out = write_mds(tempfile.mkdtemp() + "/mds", data)
        >>> source = StreamingSource(open_mds(out, 2, shuffle=False))
        >>> source.dataset_size, source.epoch_size, source.id_fields()
        (5, 5, ('sample_id',))
        >>> [indices.tolist() for _, indices in source.epoch()]
        [[0, 1], [2, 3], [4]]
        >>> plain = StreamingDataset(local=str(out), batch_size=2, shuffle=False)
        >>> StreamingSource(StreamingDataLoader(plain, batch_size=2))
        Traceback (most recent call last):
            ...
        TypeError: a StreamingDataset's samples carry no sample id; build it as ...
        >>> del source, plain  # releases streaming's shared memory for this directory
    """

    #: NOTE: streaming resumes from the samples seen in the epoch, whatever the workers
    #: (checked: a state saved with 0 workers resumes exactly with 2, and the other way round).
    WORKERS_IN_STATE = False

    def __init__(
        self,
        loader: StreamingDataLoader,
        index_key: Hashable | None = None,
        dataset_size: int | None = None,
    ) -> None:
        dataset = getattr(loader, "dataset", None)
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(
                "StreamingSource needs a StreamingDataLoader over a StreamingDataset, but its "
                f"dataset is {type(dataset).__name__}; build it with sbloader.streaming.open_mds"
            )
        world = getattr(dataset, "_unique_rank_world", None)  # (streaming's, from the environment)
        if world is not None:
            _check_ranks(int(world.rank), int(world.num_ranks))
        if index_key is None and not isinstance(dataset, IndexedStreamingDataset):
            raise TypeError(
                f"a {type(dataset).__name__}'s samples carry no sample id; build it as "
                "sbloader.streaming.IndexedStreamingDataset (open_mds does), or pass index_key= "
                "the field that holds each sample's dataset index"
            )
        if dataset_size is not None and index_key is None:
            # NOTE: sample ids index the dataset's samples; no other size is right for them.
            dataset_size = check_int("dataset_size", dataset_size, minimum=1)
            if dataset_size != int(dataset.num_samples):
                raise ValueError(
                    f"dataset_size={dataset_size} was given, but the streaming sample ids index "
                    f"the dataset's {int(dataset.num_samples)} samples: leave dataset_size out, "
                    "or pass it with index_key= a field of ids written with the data"
                )
        super().__init__(
            loader,
            SAMPLE_ID if index_key is None else index_key,
            int(dataset.num_samples) if dataset_size is None else dataset_size,
        )

    def _order(self) -> dict[str, Any]:
        """The ``StreamingDataset`` settings that decide each epoch's order."""
        dataset = self.loader.dataset
        return {key: getattr(dataset, key) for key in _ORDER if hasattr(dataset, key)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "order": self._order()}

    def load_state_dict(self, state: dict[str, Any], mid_epoch: bool = False) -> None:
        """Restore :meth:`state_dict`; refuses (``ValueError`` naming the setting) a state saved
        from a ``StreamingDataset`` with another ``shuffle``, ``shuffle_seed`` (``open_mds``'s
        ``seed``), ``shuffle_algo``, ``shuffle_block_size``, ``sampling_method`` or
        ``batching_method``.

        NOTE: streaming's own state holds the samples seen in the epoch, not whether or how it
        shuffles: resumed with another order, a mid-epoch state skipped the first samples of
        that other order (repeating some examples and never yielding others), and every later
        epoch was another run's, with nothing said. It holds the shuffle seed, and a resume
        takes the saved seed over the dataset's own: a state from ``seed=0`` loaded into a
        loader built with ``seed=1`` ran the seed-0 order for the rest of the run, the seed the
        user gave ignored. So the seed is compared too (states saved before it was are
        compared on the others).
        """
        saved, own = state.get("order") or {}, self._order()  # (absent from older states)
        for key, value in saved.items():
            if key in own and own[key] != value:
                name = _OPEN_MDS_NAMES.get(key, key)
                raise ValueError(
                    f"the saved {type(self).__name__} state was saved from a StreamingDataset "
                    f"with {key}={value!r}, but this one has {key}={own[key]!r}: the order of "
                    "every epoch would differ from the saved run's; build the dataset with "
                    f"{key}={value!r} (open_mds(..., {name}={value!r})) to resume it"
                )
        super().load_state_dict(state, mid_epoch)

    def _resumable(self, loader_state: Any, state: dict[str, Any]) -> Any:
        # NOTE: streaming resumes a state saved at an epoch's end inside that same epoch, which
        # then yields nothing; the next epoch's start is what an uninterrupted run reads next.
        if state["finished"] and loader_state is not None:
            return dict(loader_state, epoch=int(loader_state["epoch"]) + 1, sample_in_epoch=0)
        return loader_state

    def _loader_state(self) -> Any:
        """The StreamingDataLoader's state, read again where another rank was writing it.

        NOTE (ranks loading a state at the same time): streaming's ``state_dict()`` reads the
        resume state that ``load_state_dict()`` writes into shared memory, one block per
        dataset directory that the ranks on a machine share; a rank reading it right after
        another rank created the block and before that rank wrote it reads an empty or partial
        text, on which ``json`` fails. The loader reads its source's state as it loads one (to
        put it back if the load is refused), so ranks resuming together met this (seen in the
        two-rank test). The write is one copy of a few hundred bytes: read again a moment later,
        the state is whole.
        """
        for attempt in range(_READS):
            try:
                return self.loader.state_dict()
            except json.JSONDecodeError:
                if attempt == _READS - 1:
                    raise
                time.sleep(0.01)
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def id_fields(self) -> tuple[Hashable, ...]:
        """:data:`SAMPLE_ID`, which an :class:`IndexedStreamingDataset` adds to every sample
        also where ``index_key=`` names another field of ids."""
        return (SAMPLE_ID,) if isinstance(self.loader.dataset, IndexedStreamingDataset) else ()

    def set_epoch(self, epoch: int) -> None:
        """Nothing to forward: a StreamingDataset counts its epochs itself (and saves them)."""

    @property
    def epoch_size(self) -> int | None:
        return len(self.loader.dataset)
