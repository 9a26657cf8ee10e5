"""What a user passes as a source, adapted to a :class:`~sbloader.sources.Source`.

The one place that knows the concrete source types: the loader, EL2N scoring and the
integrations call :func:`make_source` and then use only the :class:`~sbloader.sources.Source`
protocol.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterable
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from ._types import is_a
from .ffcv import FFCVSource, is_ffcv_loader
from .sources import DataLoaderSource, IterableSource, Source, sampler_shares_generator
from .stateful import SHARED_GENERATOR, StatefulSource

__all__ = ["make_source"]


def _is_accelerate_loader(source: Any) -> bool:
    """Whether ``source`` is one of Accelerate's loader types, checked without importing it.

    NOTE: they claim to be a ``DataLoader`` (their ``__class__`` is overridden); ``type()`` is
    not fooled.
    """
    return type(source).__module__.split(".")[0] == "accelerate"


def make_source(
    source: Any, index_key: Hashable | None = None, dataset_size: int | None = None
) -> Source:
    """Adapt what the user passed to a :class:`~sbloader.sources.Source`.

    Args:
        source: a :class:`~sbloader.sources.Source` (returned as is), a loader prepared by
            Hugging Face Accelerate (see :mod:`sbloader.integrations.accelerate`),
            mosaicml-streaming's ``StreamingDataLoader`` (indices from the ``sample_id`` field
            by default) or torchdata's ``StatefulDataLoader`` (both detected without importing
            their library, and resumed through their own state), a torch ``DataLoader`` (over
            a map-style dataset its indices are recovered; with ``index_key``, or over an
            iterable dataset, it is iterated as it is), an FFCV ``Loader`` (detected without
            importing ffcv), or any re-iterable of batches.
        index_key: the batch field holding dataset indices, for sources that carry them.
        dataset_size: the number of examples, for an iterable source (which cannot tell it); a
            source that knows its size must agree with it.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> src = make_source(DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2))
        >>> type(src).__name__, src.has_indices(), src.can_filter()
        ('DataLoaderSource', True, True)
    """
    made = _adapt(source, index_key, dataset_size)
    if dataset_size is not None and made.dataset_size != dataset_size:
        has = "no dataset_size" if made.dataset_size is None else f"{made.dataset_size} examples"
        raise ValueError(
            f"dataset_size={dataset_size!r} was given, but the {type(made).__name__} has {has}; "
            "dataset_size= is for iterable sources, which cannot tell their size: leave it out"
        )
    return made


def _adapt(source: Any, index_key: Hashable | None, dataset_size: int | None) -> Source:
    if isinstance(source, Source):
        return source
    if _is_accelerate_loader(source):  # NOTE: before the DataLoader check, which it passes
        from .integrations.accelerate_source import shard_source

        return shard_source(source, index_key)
    if is_a(source, "streaming", "StreamingDataLoader"):
        from .streaming import StreamingSource  # imports streaming: only for its loaders

        return StreamingSource(source, index_key, dataset_size)
    if is_a(source, "torchdata", "StatefulDataLoader"):
        if not isinstance(source.dataset, IterableDataset) and sampler_shares_generator(source):
            # NOTE: warned, not refused: the run itself is right; only a resume from one of its
            # states strays (from the epoch after the resumed one), which the user can avoid
            # before there is a state to lose. stacklevel 4: as below.
            warnings.warn(SHARED_GENERATOR, UserWarning, stacklevel=4)
        return StatefulSource(source, index_key, dataset_size)
    if isinstance(source, DataLoader) and not isinstance(source.dataset, IterableDataset):
        if index_key is not None:
            return IterableSource(source, index_key, dataset_size)
        if type(source).__iter__ is not DataLoader.__iter__:
            # NOTE: DataLoaderSource iterates a DataLoader of the same arguments over the
            # dataset (to recover the indices): a subclass's own __iter__ is not run. Warned,
            # not refused: many only keep the iterator (SpeechBrain's SaveableDataLoader), but
            # one that changes the batches (normalising, moving them) would be skipped unsaid.
            # stacklevel 4: past _adapt, make_source and its caller (SelectiveLoader or
            # el2n_scores) to the user's line (3 named sbloader's own call of make_source).
            warnings.warn(
                f"SelectiveLoader recovers dataset indices through a plain DataLoader of "
                f"{type(source).__name__}'s arguments, so {type(source).__name__}'s own "
                "__iter__ is not run: what it does to the batches is skipped. If it changes "
                "them, move that work into the DataLoader's collate_fn, or give the examples a "
                "field holding their index and pass index_key= naming it (the loader is then "
                "iterated as it is); pass a plain DataLoader of the same arguments to silence "
                "this warning",
                UserWarning,
                stacklevel=4,
            )
        return DataLoaderSource(source)
    if is_ffcv_loader(source):
        if index_key is not None and not isinstance(index_key, (str, int)):
            raise TypeError(
                "index_key should name an FFCV loader's index output by name or position, but "
                f"got index_key={index_key!r}"
            )
        return FFCVSource(source, index_field="index" if index_key is None else index_key)
    if not isinstance(source, Iterable):
        raise TypeError(
            "SelectiveLoader's source should be a torch DataLoader, an FFCV Loader or an "
            f"iterable of batches, but got {type(source).__name__}"
        )
    return IterableSource(source, index_key, dataset_size)
