"""Training-step losses reported back to the loader (:meth:`SelectiveLoader.feedback`).

The training step already computes each backpropagated example's loss. Reported back, those
losses keep a per-example store fresh at no cost: a Stale-SB epoch then decides each example
from its loss the last time it was trained, not from the last selection pass (InfoBatch's source
of scores). This module checks a report as it comes and holds what was reported until the
loader hands it to the policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._checks import check_indices
from ._state import check_version

if TYPE_CHECKING:
    from .stats import LoaderStats

__all__ = ["FeedbackBuffer", "check_range", "check_reported", "checked", "unindexed"]


def check_range(indices: np.ndarray, size: int | None) -> np.ndarray:
    """``indices``, or an ``IndexError`` naming the fix if one is outside ``0 .. size - 1``.

    Example:
        >>> check_range(np.array([0, 9]), 10).tolist(), check_range(np.array([12]), None).tolist()
        ([0, 9], [12])
        >>> check_range(np.array([3, 10, -1]), 10)
        Traceback (most recent call last):
            ...
        IndexError: loader.feedback got dataset indices outside 0..9 (e.g. [10, -1]); pass the ...
    """
    if size is None or not len(indices):
        return indices
    outside = (indices < 0) | (indices >= size)
    if outside.any():
        raise IndexError(
            f"loader.feedback got dataset indices outside 0..{size - 1} (e.g. "
            f"{indices[outside][:5].tolist()}); pass the yielded batch's own indices "
            "(batch.indices)"
        )
    return indices


def _as_tensor(name: str, values: Any) -> torch.Tensor:
    """``values`` as a detached 1-d tensor, left on its device (no host synchronisation)."""
    if isinstance(values, torch.Tensor):
        return values.detach().reshape(-1)
    if (
        isinstance(values, (list, tuple))
        and values
        and all(isinstance(v, torch.Tensor) for v in values)
    ):
        # NOTE: a list of per-example tensors (one loss computed per example, e.g. for inputs
        # of different sizes) went through NumPy: one requiring grad raised torch's own "Can't
        # call numpy() on Tensor that requires grad", and a GPU one a TypeError saying the list
        # was not an array. Joined here as a tensor is: detached, on their device.
        try:
            return torch.cat([v.detach().reshape(-1) for v in values])
        except RuntimeError as e:  # (tensors on different devices)
            raise TypeError(
                f"{name} should be a tensor or array with one entry per example, but got a "
                f"{type(values).__name__} of tensors that cannot be joined ({e})"
            ) from e
    try:
        return torch.as_tensor(np.asarray(values)).reshape(-1)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} should be a tensor or array with one entry per example, but got "
            f"{type(values).__name__}"
        ) from e


def checked(indices: Any, losses: Any, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's report as two 1-d tensors on their device, or an error naming the fix.

    Host-side indices are checked against ``size`` at once; device-side ones are left for
    :func:`check_range` when they reach the host (checking them here would synchronise).

    Example:
        >>> idx, losses = checked([4, 7], np.array([0.5, 2.0]), 10)
        >>> idx.tolist(), losses.tolist()
        ([4, 7], [0.5, 2.0])
        >>> checked([4, 7], [0.5], 10)
        Traceback (most recent call last):
            ...
        ValueError: feedback needs one loss per example, but got 2 indices and 1 losses; ...
        >>> checked([4, 7], torch.zeros(2, 5), 10)
        Traceback (most recent call last):
            ...
        ValueError: feedback needs one loss per example, but got 2 indices and losses of shape ...
        >>> checked([4, 7], torch.tensor([3, 0]), 10)
        Traceback (most recent call last):
            ...
        TypeError: losses should hold real per-example losses (a float tensor such as ...
        >>> checked(torch.tensor([1.0]), [0.5], 10)
        Traceback (most recent call last):
            ...
        TypeError: indices should hold whole dataset indices (an integer tensor such as ...
    """
    idx, val = _as_tensor("indices", indices), _as_tensor("losses", losses)
    if idx.shape[0] != val.shape[0]:
        shape = tuple(getattr(losses, "shape", ()))
        if len(shape) > 1 and shape[0] == idx.shape[0]:
            # Unreduced already, but per token (or per output): reduction='none' is given.
            raise ValueError(
                f"feedback needs one loss per example, but got {idx.shape[0]} indices and "
                f"losses of shape {shape}, several per example (e.g. per-token losses); reduce "
                "them over every dimension but the first, as the training loss is, e.g. "
                "token_losses.sum(1) / (labels != -100).sum(1).clamp(min=1)"
            )
        raise ValueError(
            f"feedback needs one loss per example, but got {idx.shape[0]} indices and "
            f"{val.shape[0]} losses; pass the per-example losses (reduction='none') of the "
            "batch whose indices you pass"
        )
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(
            f"indices should hold whole dataset indices (an integer tensor such as "
            f"batch.indices), but got dtype {idx.dtype}"
        )
    if not val.is_floating_point():
        # NOTE: integers too. Losses are floats; an integer tensor of the right length is
        # almost always the batch's targets passed instead, and its class numbers stored as
        # losses decided the stale epochs from the labels, with nothing said.
        hint = (
            " (the targets instead of the losses?); pass the per-example losses, or "
            "losses.float() where integer values are meant"
            if not val.is_complex() and val.dtype != torch.bool
            else ""
        )
        raise TypeError(
            "losses should hold real per-example losses (a float tensor such as "
            f"F.cross_entropy(..., reduction='none')), but got dtype {val.dtype}{hint}"
        )
    if idx.device.type == "cpu":
        check_range(check_indices("indices", idx.numpy()), size)
    return idx, val


def unindexed(losses: Any) -> torch.Tensor:
    """Stand-in indices (``0 .. n - 1``) for a report of ``losses`` from a source with no
    dataset indices, which no policy takes (only checked and counted): one per loss, refusing
    a single value (``ValueError``).

    Example:
        >>> unindexed(torch.zeros(3)).tolist()
        [0, 1, 2]
    """
    shape = getattr(losses, "shape", None)
    rows = np.shape(losses) if shape is None else tuple(shape)
    if not rows:
        # NOTE: with indices, a loss reduced over the batch is refused by the count;
        # here nothing gives the count, and a scalar passed as one loss counted a step
        # of a full batch as one example reported (the mistake unsaid until the loop
        # met a source with indices).
        raise ValueError(
            "feedback needs one loss per example, but got a single value (a loss "
            "reduced over the batch?); pass the per-example losses "
            "(reduction='none'), of shape (1,) for a batch of one example"
        )
    return torch.arange(rows[0])


def check_reported(stats: LoaderStats, n: int) -> None:
    """Refuse a report of ``n`` examples that would make more examples reported than the
    loader has yielded (its ``stats``: a batch reported twice), before anything is held or
    counted.

    NOTE (a batch reported twice): refused, not made idempotent. Telling a batch reported
    again from another one of the same examples (a sampler with replacement, a pass of
    ``batches_per_epoch``) would take every yielded index kept on the host (a
    synchronisation per step for device-side indices, memory for a large dataset). Reported
    twice, a batch's examples were counted twice in ``loader.stats`` (``feedback`` above
    ``examples_yielded``) and held twice, the store silently keeping the second report
    (e.g. losses of the model after its optimizer step), and the mistake behind it (a hook
    called twice, a report repeated after the loop) went unsaid. The counts compared are
    the run's totals, not the current epoch's: a batch reported after the next epoch began
    (a framework that starts it first) is counted there, and is not refused. A loop that
    reports every batch twice is refused at its first step; one that reports some batches
    twice and others not at all is not (each example's last report is stored).
    """
    current = stats.current
    if current is not None and current.feedback + n <= current.examples_yielded:
        return  # (the usual case, without summing every epoch's counts)
    yielded = sum(e.examples_yielded for e in stats.epochs)
    reported = sum(e.feedback for e in stats.epochs)
    if reported + n > yielded:
        raise ValueError(
            f"loader.feedback got losses for more examples than the loader has yielded "
            f"({reported} reported before, {n} now, {yielded} yielded): was a batch reported "
            "twice (e.g. by two hooks, or again after the loop), or reported before the "
            "loader yielded it? Report each yielded batch once, after its training step: "
            "loader.feedback(batch.indices, losses)"
        )


class FeedbackBuffer:
    """Reported (dataset index, training loss) pairs, held until the next epoch starts.

    NOTE: reported losses reach the policy only when the next epoch starts, never mid-epoch.
    Within an epoch a Stale-SB policy decides which examples to load before loading them (on the
    prefetch thread) and must decide the same again afterwards; a store changing under it would
    break that, and a resumed run would decide differently from an uninterrupted one. Tensors stay
    where they are (a GPU's losses are not copied to the host on every step) until :meth:`take`.

    Example:
        >>> import torch
        >>> buf = FeedbackBuffer()
        >>> buf.add(torch.tensor([4, 7]), torch.tensor([0.5, 2.0]))
        2
        >>> idx, losses = buf.take()
        >>> idx.tolist(), losses.tolist(), len(buf)
        ([4, 7], [0.5, 2.0], 0)
    """

    VERSION = 1

    def __init__(self) -> None:
        self._indices: list[torch.Tensor] = []
        self._losses: list[torch.Tensor] = []
        self._count = 0

    def __len__(self) -> int:
        """The number of examples reported since the last :meth:`take`."""
        return self._count

    def add(self, indices: Any, losses: Any, size: int | None = None) -> int:
        """Hold one step's losses; returns how many examples were reported.

        Args:
            indices: dataset indices, one per loss.
            losses: the training step's per-example losses (copied, on their device: the
                caller may change or reuse its tensor or array after the report).
            size: the dataset's size, to check host-side indices against at once (device-side
                ones are checked by :func:`check_range` when taken, to avoid a synchronisation).

        Raises:
            ValueError: the counts differ. TypeError: indices that are not integers.
            IndexError: a host-side index outside ``0 .. size - 1``.
        """
        idx, val = checked(indices, losses, size)
        # NOTE (copies): held until the next epoch starts, so held as copies (made on their
        # device, without a synchronisation): a view of the caller's tensor or array took every
        # later change to it (a buffer reused for each step's losses, losses weighted in place
        # after the report), and the store then got those values instead of the ones reported.
        self._indices.append(idx.clone())
        self._losses.append(val.clone())
        self._count += int(idx.shape[0])
        return int(idx.shape[0])

    def _joined(self) -> tuple[np.ndarray, np.ndarray]:
        """Everything held, as int64 indices and float64 losses on the host."""
        if not self._indices:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        idx = torch.cat([t.to("cpu", torch.int64) for t in self._indices]).numpy()
        val = torch.cat([t.to("cpu", torch.float64) for t in self._losses]).numpy()
        return idx, val

    def take(self, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Everything held, as int64 indices and float64 losses on the host; then empty.

        Args:
            size: the dataset's size: an index outside ``0 .. size - 1`` (a device-side report,
                not checked when made) raises an ``IndexError`` and leaves everything held.
        """
        joined = self._joined()
        check_range(joined[0], size)
        self._indices, self._losses, self._count = [], [], 0
        return joined

    def state_dict(self, size: int | None = None) -> dict[str, Any]:
        """What is held, as CPU tensors (loads with ``torch.load(weights_only=True)``).

        Args:
            size: the dataset's size: an index outside ``0 .. size - 1`` raises an
                ``IndexError`` instead of saving a report that every resumed run would fail on.
        """
        idx, val = self._joined()
        check_range(idx, size)
        return {
            "version": self.VERSION,
            "indices": torch.from_numpy(idx.copy()),
            "losses": torch.from_numpy(val.copy()),
        }

    def load_state_dict(self, state: dict[str, Any], size: int | None = None) -> None:
        """Hold what ``state`` holds (checked first: a refused state changes nothing)."""
        state = check_version(state, "FeedbackBuffer", self.VERSION)
        idx, val = checked(state["indices"], state["losses"], size)
        self._indices, self._losses, self._count = [], [], 0
        if len(idx):
            self.add(idx, val)
