"""The loss window: the R most recent finite losses, for Selective-Backprop's CDF."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import _kernels
from ._checks import check_int
from ._state import check_identity, check_version

__all__ = ["LossWindow"]


class LossWindow:
    """The ``size`` most recent finite losses, kept both in arrival order and sorted.

    Backed by numba kernels: adding a loss and ranking it cost O(log R) comparisons plus a shift of
    the entries between the evicted and the new value. Non-finite losses are never stored.

    Args:
        size: R, the number of most recent losses the CDF is taken over (paper: 1024).

    Example:
        >>> import numpy as np
        >>> w = LossWindow(4)
        >>> w.push_and_rank(np.array([1.0, 3.0, 2.0, float("nan")]), beta=1.0).tolist()
        [1.0, 1.0, 0.6666666666666666, nan]
        >>> w.values().tolist()
        [1.0, 3.0, 2.0]
    """

    VERSION = 1

    def __init__(self, size: int = 1024) -> None:
        self.size = check_int("size", size, minimum=1)
        #: While True, adding losses raises (see :class:`~sbloader.Policy`'s threading contract).
        self.frozen = False
        self._ring = np.zeros(self.size, dtype=np.float64)
        self._sorted = np.zeros(self.size, dtype=np.float64)
        # meta[0]: number of values held; meta[1]: next ring slot to write.
        self._meta = np.zeros(2, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._meta[0])

    def push_and_rank(self, losses: np.ndarray, beta: float) -> np.ndarray:
        """Add each finite loss in turn and return its ``CDF(loss) ** beta`` (NaN if not finite)."""
        if self.frozen:
            raise RuntimeError(
                "the loss window is frozen: a stale epoch's prefilter may be reading it on the "
                "prefetch thread; add losses only in epochs with a selection pass"
            )
        return self._push_and_rank(losses, beta)

    def _push_and_rank(self, losses: np.ndarray, beta: float) -> np.ndarray:
        losses = np.ascontiguousarray(losses, dtype=np.float64).reshape(-1)
        out = np.empty(losses.shape[0], dtype=np.float64)
        _kernels.push_and_cdf_power(self._ring, self._sorted, self._meta, losses, float(beta), out)
        return out

    def rank(self, losses: np.ndarray, beta: float) -> np.ndarray:
        """``CDF(loss) ** beta`` without changing the window (each loss ranked as if added)."""
        losses = np.ascontiguousarray(losses, dtype=np.float64).reshape(-1)
        out = np.empty(losses.shape[0], dtype=np.float64)
        _kernels.cdf_power(self._sorted, len(self), losses, float(beta), out)
        return out

    def push(self, losses: np.ndarray) -> None:
        """Add the finite losses, in order, without ranking them."""
        self.push_and_rank(losses, 1.0)

    def values(self) -> np.ndarray:
        """The held losses, oldest first."""
        n, head = len(self), int(self._meta[1])
        if n < self.size:
            return self._ring[:n].copy()
        return np.concatenate([self._ring[head:], self._ring[:head]])

    def sorted_values(self) -> np.ndarray:
        """The held losses in ascending order."""
        return self._sorted[: len(self)].copy()

    def state_dict(self) -> dict[str, Any]:
        """The window's state: its size and its values, oldest first (a float64 tensor, so that
        a checkpoint holding it loads with ``torch.load``'s default ``weights_only=True``)."""
        return {
            "version": self.VERSION,
            "size": self.size,
            "values": torch.from_numpy(self.values()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (the sizes must agree)."""
        state = check_version(state, "LossWindow", self.VERSION)
        check_identity(
            "LossWindow",
            {"size": int(state["size"])},
            {"size": self.size},
            "construct the policy with the same history",
        )
        self._ring[:] = 0.0
        self._sorted[:] = 0.0
        self._meta[:] = 0
        self._push_and_rank(np.asarray(state["values"], dtype=np.float64), 1.0)
