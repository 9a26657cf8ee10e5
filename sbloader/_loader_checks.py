"""The checks of :class:`~sbloader.SelectiveLoader`'s constructor arguments that depend only on
the arguments (and the source): each refuses a bad value, naming the parameter and the fix, or
returns the checked value. The constructor calls each where its own order of checks has it, so
that of two bad arguments the same one is refused first.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._checks import check_bool, check_int

if TYPE_CHECKING:
    from .sources import Source

__all__ = [
    "check_memory_format",
    "check_metadata_key",
    "check_modules",
    "check_pad_values",
    "check_planned_epochs",
    "check_remainder",
    "checked_min_batch_size",
    "dropped_index_key",
    "training_batch_size",
]

_BATCHNORM = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def check_modules(model: Any, selector: Any) -> None:
    """Refuse a ``model`` that is not a ``torch.nn.Module``, and a ``selector`` that is neither
    one nor None (``TypeError``)."""
    for name, module, optional in (("model", model, False), ("selector", selector, True)):
        if not isinstance(module, nn.Module) and not (optional and module is None):
            raise TypeError(
                f"{name} should be a torch.nn.Module{' or None' if optional else ''}, but "
                f"got {type(module).__name__}"
            )


def check_planned_epochs(planned_epochs: Any, policy: Any) -> int | None:
    """``planned_epochs`` checked (an int >= 2, or None), refused beside a ``policy`` (it sets
    only the default policy's length)."""
    if planned_epochs is None:
        return None
    planned_epochs = check_int("planned_epochs", planned_epochs, minimum=2)
    if policy is not None:
        raise ValueError(
            f"planned_epochs={planned_epochs} only sets the length of the default "
            f"policy's run, but policy={policy!r} was given: pass the run's length to "
            "that policy instead (e.g. policy=sbloader.default_policy(epochs="
            f"{planned_epochs})), or leave policy out"
        )
    return planned_epochs


def check_memory_format(memory_format: Any) -> None:
    """Refuse a ``memory_format`` that is neither a ``torch.memory_format`` nor None
    (``TypeError``), or is ``torch.preserve_format``, no layout to convert to (``ValueError``)."""
    if memory_format is not None and not isinstance(memory_format, torch.memory_format):
        raise TypeError(
            "memory_format should be a torch.memory_format such as torch.channels_last, or "
            f"None, but got memory_format={memory_format!r}"
        )
    if memory_format == torch.preserve_format:
        raise ValueError(
            "memory_format should be a layout to convert inputs to, such as "
            "torch.channels_last (4-d images) or torch.channels_last_3d (5-d videos), but got "
            "memory_format=torch.preserve_format; pass memory_format=None to keep the "
            "source's layout"
        )


def training_batch_size(batch_size: Any, source: Source) -> int:
    """``batch_size`` checked (an int >= 1), or where it is None the ``source``'s own (refused
    where the source has none)."""
    if batch_size is None:
        batch_size = source.batch_size
        if batch_size is None:
            raise ValueError(
                "batch_size could not be taken from the source; pass batch_size= (the number "
                "of examples per training batch)"
            )
    return check_int("batch_size", batch_size, minimum=1)


def check_remainder(remainder: str, per_epoch: int | str | None) -> None:
    """Refuse ``remainder="short"`` with ``batches_per_epoch`` (``per_epoch``, checked)."""
    if per_epoch is not None and remainder == "short":
        raise ValueError(
            "remainder='short' yields a short batch at the end of each pass over the data, "
            "which with batches_per_epoch falls inside a training epoch of full batches; use "
            "remainder='carry' or 'drop' with batches_per_epoch"
        )


def checked_min_batch_size(min_batch_size: Any, model: nn.Module, batch_size: int) -> int:
    """``min_batch_size`` checked (an int from 1 to ``batch_size``); by default 2 for a
    ``model`` with BatchNorm (at most ``batch_size``), else 1."""
    if min_batch_size is None:
        # NOTE: at most batch_size: a model with BatchNorm trained in batches of one (e.g.
        # images, which BatchNorm2d normalises over their pixels) was refused with "got
        # min_batch_size=2", an argument its user never passed.
        min_batch_size = 2 if any(isinstance(m, _BATCHNORM) for m in model.modules()) else 1
        min_batch_size = min(min_batch_size, batch_size)
    checked = check_int("min_batch_size", min_batch_size, minimum=1)
    if checked > batch_size:
        raise ValueError(
            f"min_batch_size should be <= batch_size={batch_size}, but got min_batch_size={checked}"
        )
    return checked


def check_metadata_key(metadata_key: Any) -> None:
    """Refuse a ``metadata_key`` that is neither a str nor None (``TypeError``)."""
    if metadata_key is not None and not isinstance(metadata_key, str):
        raise TypeError(
            "metadata_key should be a str (the dict key to carry the selection results under) "
            f"or None, but got metadata_key={metadata_key!r}"
        )


def dropped_index_key(drop_index: Any, source: Source) -> Hashable | None:
    """The key of the ``source``'s index field that ``drop_index=True`` leaves out of yielded
    batches, or None (``drop_index`` checked; refused where the source has no index field)."""
    drop_index = check_bool("drop_index", drop_index)
    drop_key = source.index_field_key() if drop_index else None
    if drop_index and drop_key is None:
        raise ValueError(
            "drop_index=True leaves the index field out of yielded batches, but this "
            "source's batches have none; pass index_key= naming the field that holds the "
            "dataset indices (a DataLoader over a map-style dataset has no index field: "
            "leave drop_index out)"
        )
    return drop_key


def check_pad_values(pad_values: Any, frozen_prefix: nn.Module | None) -> None:
    """Refuse ``pad_values`` beside a ``frozen_prefix`` (the values themselves are checked by
    the batch codec)."""
    if pad_values and frozen_prefix is not None:
        raise ValueError(
            "pad_values cannot be combined with frozen_prefix: the prefix's cached features "
            "of source batches padded to different lengths are not padded when their rows "
            "are joined; pad the source's batches to one length (e.g. a collator with "
            "padding='max_length'), or leave frozen_prefix out"
        )
