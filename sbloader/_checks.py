"""Argument checks that raise PyTorch-style errors naming the parameter and the fix."""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any, NoReturn

import numpy as np
import torch


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` as an int, or raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} should be an int, but got {name}={value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} should be >= {minimum}, but got {name}={value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool (or a numpy bool), or raise naming ``name``: a flag
    given as a string such as ``"False"`` or a number would otherwise be read by its truth
    value.

    Example:
        >>> check_bool("reweight", False)
        False
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} should be True or False, but got {name}={value!r}")
    return bool(value)


def check_float(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a finite float within the given bounds, or raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} should be a number, but got {name}={value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range (10**400)
        raise ValueError(
            f"{name} should be a finite number, but got an integer of {len(str(abs(value)))} "
            "digits, beyond a float's range (about 1.8e308)"
        ) from None
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} should be finite, but got {name}={value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        if low is not None and high is not None:
            interval = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            interval = f"{'>' if low_open else '>='} {low:g}"
        else:
            interval = f"{'<' if high_open else '<='} {high:g}"
        raise ValueError(f"{name} should be {interval}, but got {name}={value!r}")
    return value


def check_device_name(name: str, value: Any) -> torch.device:
    """``value`` (a ``torch.device``, a device string such as ``"cuda:0"`` or a device index) as a
    ``torch.device``, or raise naming ``name``: torch's own error ("Expected one of cpu, cuda,
    ...") names no parameter.

    Example:
        >>> check_device_name("device", "cpu")
        device(type='cpu')
        >>> check_device_name("device", "gpu")
        Traceback (most recent call last):
            ...
        ValueError: device should be a device such as 'cpu' or 'cuda:0', but got device='gpu' ...
    """
    if isinstance(value, torch.device):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (str, numbers.Integral)):
        raise TypeError(
            f"{name} should be a torch.device or a device such as 'cpu' or 'cuda:0', but got "
            f"{name}={value!r}"
        )
    try:
        return torch.device(value if isinstance(value, str) else int(value))
    except (RuntimeError, ValueError) as e:
        raise ValueError(
            f"{name} should be a device such as 'cpu' or 'cuda:0', but got {name}={value!r} "
            f"(torch: {e}); pass a device name torch reads, such as 'cpu', 'cuda', 'cuda:1' "
            "or 'mps'"
        ) from e


def check_choice(name: str, value: Any, choices: Collection[str]) -> str:
    """Return ``value`` if it is one of ``choices``, or raise naming ``name``."""
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} should be one of {options}, but got {name}={value!r}")
    return value


def check_indices(name: str, value: Any) -> Any:
    """``value`` as a contiguous 1-d int64 numpy array of dataset indices, or raise naming
    ``name``: indices must be integers, since a float round trip corrupts those above 2^24.

    Example:
        >>> check_indices("indices", [3, 1]).tolist()
        [3, 1]
    """
    if isinstance(value, torch.Tensor):
        # NOTE: one call where the tensor is already a plain CPU one (every source batch).
        value = (
            value.numpy()
            if value.is_cpu and not value.requires_grad
            else value.detach().cpu().numpy()
        )
    idx = np.asarray(value)
    if idx.dtype.kind not in "iu":
        raise TypeError(
            f"{name} should hold integers (dataset indices), but has dtype {idx.dtype}; a float "
            "round trip would corrupt indices above 2^24"
        )
    return np.ascontiguousarray(idx, dtype=np.int64).reshape(-1)


#: The fix :func:`indices_needed` names unless told another.
INDEX_FIX = (
    "pass a DataLoader over a map-style dataset, or index_key= naming the batch field that holds "
    "the indices"
)


def indices_needed(what: str, fix: str = "") -> ValueError:
    """The error for a feature that needs each example's dataset index from a source without.

    Example:
        >>> str(indices_needed("subset=")).split(";")[0]
        "subset= needs each example's dataset index, but the source provides none"
    """
    fix = fix or INDEX_FIX
    return ValueError(
        f"{what} needs each example's dataset index, but the source provides none; {fix}"
    )


class NonFiniteLoss(FloatingPointError):
    """Selection losses that are not finite under ``nonfinite="raise"``: a ``FloatingPointError``
    of its own type, so that the loader can tell it from others (on several ranks it is reported
    to every rank before it is raised, see :mod:`sbloader.distributed`).

    Example:
        >>> import numpy as np
        >>> from sbloader import Traditional
        >>> from sbloader.decisions import choose_finite
        >>> issubclass(NonFiniteLoss, FloatingPointError)
        True
        >>> try:
        ...     choose_finite(Traditional(), np.array([1.0, np.inf, np.nan]), np.array([4, 5, 6]),
        ...                   np.random.default_rng(0), 3, "raise")
        ... except NonFiniteLoss as e:
        ...     print(str(e).split(";")[0])
        2 selection losses are not finite (dataset indices [5, 6]...)
    """


def nonfinite_losses(
    count: int, indices: list[int] | None = None, positions: bool = False
) -> NonFiniteLoss:
    """The error for ``count`` non-finite selection losses under ``nonfinite="raise"``, naming
    the first dataset ``indices`` where known (``positions``: the first positions in the source
    batch instead, for a source without indices).

    Example:
        >>> str(nonfinite_losses(2, [7, 9])).split(";")[0]
        '2 selection losses are not finite (dataset indices [7, 9]...)'
        >>> str(nonfinite_losses(2, [0, 3], positions=True)).split(";")[0]
        '2 selection losses are not finite (positions [0, 3] in the source batch...)'
    """
    what = "positions {} in the source batch" if positions else "dataset indices {}"
    where = "" if indices is None else f" ({what.format(indices)}...)"
    return NonFiniteLoss(
        f"{count} selection losses are not finite{where}; pass nonfinite='skip' or "
        "nonfinite='select' to continue past them"
    )


def not_a_dataloader(owner: object, name: str) -> AttributeError:
    """The error for a torch ``DataLoader`` attribute (``batch_sampler``, ``drop_last``) asked of
    a loader that is none, as what rebuilds a DataLoader from its attributes does: Accelerate's
    ``skip_first_batches``, the usual way to resume mid-epoch under Accelerate, would otherwise
    fail on a bare ``AttributeError``, or (given those attributes) rebuild the source's plain
    DataLoader, training on every example without a selection pass.

    Example:
        >>> str(not_a_dataloader(object(), "batch_sampler")).split(":")[0]
        "'object' object has no attribute 'batch_sampler'"
    """
    kind = type(owner).__name__
    return AttributeError(
        f"'{kind}' object has no attribute {name!r}: it is no torch DataLoader and cannot be "
        f"rebuilt as one. accelerator.skip_first_batches(dataloader, n) should be given a "
        f"DataLoader, but got dataloader={kind}: to resume mid-epoch, restore the loader's own "
        "state instead (accelerator.load_state restores an AcceleratedLoader registered with "
        "accelerator.register_for_checkpointing; or loader.load_state_dict) and iterate it "
        "without skipping: it goes on where it was saved"
    )


class NotADataLoader:
    """A loader that is no torch ``DataLoader``: its ``batch_sampler`` and ``drop_last`` raise
    :func:`not_a_dataloader`'s ``AttributeError`` (``hasattr`` answers False, as without them)."""

    @property
    def batch_sampler(self) -> NoReturn:
        """None: raises ``AttributeError`` naming the fix for what asked (see
        :func:`not_a_dataloader`)."""
        raise not_a_dataloader(self, "batch_sampler")

    @property
    def drop_last(self) -> NoReturn:
        """None: see :attr:`batch_sampler`."""
        raise not_a_dataloader(self, "drop_last")


class FieldError(KeyError, ValueError):
    """A batch field that does not exist (a key of dict batches, a position of tuple batches).

    Both a ``KeyError`` and a ``ValueError``, so that either ``except`` catches it.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def check_cuda_present(name: str, device: torch.device, fix: str) -> None:
    """Refuse ``name=device`` where it is a CUDA device this machine does not have, naming
    ``fix`` as the alternative (else the first use would fail in torch, naming nothing).

    Example:
        >>> check_cuda_present("device", torch.device("cpu"), "leave it out")
    """
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count or (device.index is not None and device.index >= count):
        raise ValueError(
            f"{name} should be a device this machine has (CUDA devices: {count}), but got "
            f"{name}={str(device)!r}; pass one it has (e.g. 'cpu'), or {fix}"
        )


def check_device(device: Any, given: bool) -> None:
    """Refuse to move batches to the meta device, where tensors hold no data, or to a CUDA
    device this machine does not have (else the first batch would fail in torch)."""
    if given:
        check_cuda_present("device", device, "leave device out to use the model's")
    if device.type != "meta":
        return
    if given:
        raise ValueError(
            "device='meta' would turn every batch into tensors without data; pass device= the "
            "device to train on (e.g. 'cpu' or 'cuda'), or leave it out to use the model's"
        )
    raise ValueError(
        "the model's parameters are on the meta device (not materialised), and SelectiveLoader "
        "moves batches to the model's device; materialise the model first (e.g. "
        "model.to_empty(device='cpu') and initialise its parameters), or pass device="
    )
