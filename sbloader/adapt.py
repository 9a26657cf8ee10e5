"""What a user passes as a source, adapted to a :class:`~sbloader.sources.Source`.

The one place that knows the concrete source types: the loader, EL2N scoring and the
integrations call :func:`make_source` and then use only the :class:`~sbloader.sources.Source`
protocol.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from .ffcv import FFCVSource, is_ffcv_loader
from .sources import DataLoaderSource, IterableSource, Source

__all__ = ["make_source"]


def _is_accelerate_loader(source: Any) -> bool:
    """Whether ``source`` is one of Accelerate's loader types, checked without importing it.

    NOTE: they claim to be a ``DataLoader`` (their ``__class__`` is overridden); ``type()`` is
    not fooled.
    """
    return type(source).__module__.split(".")[0] == "accelerate"


def make_source(source: Any, index_key: Hashable | None = None) -> Source:
    """Adapt what the user passed to a :class:`~sbloader.sources.Source`.

    Args:
        source: a :class:`~sbloader.sources.Source` (returned as is), a loader prepared by
            Hugging Face Accelerate (see :mod:`sbloader.integrations.accelerate`), a torch
            ``DataLoader`` (over a map-style dataset its indices are recovered; with
            ``index_key``, or over an iterable dataset, it is iterated as it is), an FFCV
            ``Loader`` (detected without importing ffcv), or any re-iterable of batches.
        index_key: the batch field holding dataset indices, for sources that carry them.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> src = make_source(DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2))
        >>> type(src).__name__, src.has_indices(), src.can_filter()
        ('DataLoaderSource', True, True)
    """
    if isinstance(source, Source):
        return source
    if _is_accelerate_loader(source):  # NOTE: before the DataLoader check, which it passes
        from .integrations.accelerate import shard_source

        return shard_source(source, index_key)
    if isinstance(source, DataLoader) and not isinstance(source.dataset, IterableDataset):
        if index_key is not None:
            return IterableSource(source, index_key)
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
    return IterableSource(source, index_key)
