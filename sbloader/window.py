"""The loss window: the R most recent finite losses, for Selective-Backprop's CDF."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import _kernels
from ._checks import check_int
from ._state import check_identity, check_version

__all__ = ["LossWindow", "rank_against"]

_FROZEN = (
    "the loss window is frozen: a stale epoch's prefilter may be reading it on the prefetch "
    "thread; add losses only in epochs with a selection pass"
)
#: Stand-ins for "no per-example store" in the kernels' arguments.
_EMPTY = (np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(0, np.int32))
_NO_INDICES = np.zeros(0, np.int64)


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

    def push_and_rank(self, losses: np.ndarray, beta: float, cut: float = 1.0) -> np.ndarray:
        """Add each finite loss in turn and return its ``CDF(loss) ** beta`` (NaN if not finite;
        with ``cut`` < 1, ``(CDF / cut) ** beta`` up to the cut and 0 above it)."""
        if self.frozen:
            raise RuntimeError(_FROZEN)
        return self._push_and_rank(losses, beta, cut)

    def _push_and_rank(self, losses: np.ndarray, beta: float, cut: float = 1.0) -> np.ndarray:
        losses = np.ascontiguousarray(losses, dtype=np.float64).reshape(-1)
        out = np.empty(losses.shape[0], dtype=np.float64)
        _kernels.push_and_cdf_power(
            self._ring, self._sorted, self._meta, losses, float(beta), out, float(cut)
        )
        return out

    def push_rank_and_draw(
        self,
        losses: np.ndarray,
        uniforms: np.ndarray,
        beta: float,
        reweight: bool,
        columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
        indices: np.ndarray | None = None,
        epoch: int = 0,
        uniform_share: float = 0.0,
        cut: float = 1.0,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Selective-Backprop's whole decision for one batch, in one kernel call.

        Each finite loss enters the window and gets ``P = CDF(loss) ** beta`` (as
        :meth:`push_and_rank`); candidate ``i`` is kept when ``uniforms[i] < P``.

        Args:
            losses: float64 losses, one per candidate (non-finite: P = NaN, never kept).
            uniforms: float64 uniforms in [0, 1), one per candidate.
            beta: the exponent.
            reweight: weights ``1 / P`` instead of 1.
            columns: a per-example store's ``(loss, seen, selected)`` columns, or None: each
                finite loss is then recorded for its index in ``epoch`` and each kept index
                counts one selection.
            indices: int64 dataset indices (with ``columns``).
            epoch: the epoch the losses were measured in (with ``columns``).
            uniform_share: u in [0, 1]: P becomes ``u / (beta + 1) + (1 - u) * P``, a blend
                with uniform keeping at the same expected rate (0: SB's P unchanged).
            cut: the CDF above which P is 0, below it ``(CDF / cut) ** beta`` (1: SB's P);
                the uniform share's rate is then ``cut / (beta + 1)``, that P's kept fraction.

        Returns:
            ``(probabilities, positions, weights, outside)``; ``outside`` > 0 is the number of
            indices outside the store, and then nothing was changed.

        Example:
            >>> w = LossWindow(4)
            >>> p, pos, wt, _ = w.push_rank_and_draw(np.array([1.0, 3.0]), np.array([0.9, 0.9]),
            ...                                      beta=1.0, reweight=False)
            >>> p.tolist(), pos.tolist(), wt.tolist()
            ([1.0, 1.0], [0, 1], [1.0, 1.0])
        """
        if self.frozen:
            raise RuntimeError(_FROZEN)
        n = losses.shape[0]
        _same_length("uniforms", uniforms, n)
        idx = _NO_INDICES
        if columns is not None:
            _same_length("indices", indices, n)
            assert indices is not None
            idx = indices
        out_p = np.empty(n, dtype=np.float64)
        out_pos = np.empty(n, dtype=np.int64)
        out_w = np.empty(n, dtype=np.float64)
        loss_col, seen_col, selected_col = _EMPTY if columns is None else columns
        k = _kernels.sb_choose_fresh(
            self._ring,
            self._sorted,
            self._meta,
            np.ascontiguousarray(losses, dtype=np.float64),
            np.ascontiguousarray(uniforms, dtype=np.float64),
            float(beta),
            bool(reweight),
            loss_col,
            seen_col,
            selected_col,
            idx,
            int(epoch),
            out_p,
            out_pos,
            out_w,
            float(uniform_share),
            float(cut),
        )
        if k < 0:
            return out_p, out_pos[:0], out_w[:0], -k
        return out_p, out_pos[:k], out_w[:k], 0

    def rank_and_draw_stored(
        self,
        columns: tuple[np.ndarray, np.ndarray, np.ndarray],
        indices: np.ndarray,
        uniforms: np.ndarray,
        beta: float,
        reweight: bool,
        cut: float = 1.0,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Stale-SB's decision for one batch from stored losses, in one kernel call.

        Each candidate's P is its stored loss ranked as :meth:`rank` (1 if never scored); it is
        kept when ``uniforms[i] < P`` and counts one selection in ``columns``. The window is
        not changed. Arguments and results as :meth:`push_rank_and_draw`.
        """
        n = indices.shape[0]
        _same_length("uniforms", uniforms, n)
        out_p = np.empty(n, dtype=np.float64)
        out_pos = np.empty(n, dtype=np.int64)
        out_w = np.empty(n, dtype=np.float64)
        k = _kernels.sb_choose_stale(
            self._sorted,
            len(self),
            float(beta),
            bool(reweight),
            *columns,
            indices,
            np.ascontiguousarray(uniforms, dtype=np.float64),
            out_p,
            out_pos,
            out_w,
            float(cut),
        )
        if k < 0:
            return out_p, out_pos[:0], out_w[:0], -k
        return out_p, out_pos[:k], out_w[:k], 0

    def rank(self, losses: np.ndarray, beta: float, cut: float = 1.0) -> np.ndarray:
        """``CDF(loss) ** beta`` without changing the window (each loss ranked as if added; with
        ``cut`` < 1 as :meth:`push_and_rank`)."""
        return rank_against(self._sorted[: len(self)], losses, beta, cut)

    def push(self, losses: np.ndarray) -> None:
        """Add the finite losses, in order, without ranking them."""
        self.push_and_rank(losses, 1.0)

    def refill(self, losses: np.ndarray) -> None:
        """Empty the window, then add the finite ``losses`` in order (the last ``size`` of them
        stay). Unlike :meth:`push`, allowed while frozen: call it only where no other thread
        reads the window (a policy's ``begin_epoch``)."""
        self._ring[:] = 0.0
        self._sorted[:] = 0.0
        self._meta[:] = 0
        self._push_and_rank(np.asarray(losses, dtype=np.float64), 1.0)

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
        self.refill(state["values"])


def _same_length(name: str, values: np.ndarray | None, n: int) -> None:
    """Refuse ``values`` that do not hold one entry per candidate."""
    length = None if values is None else values.shape[0]
    if length != n:
        raise ValueError(f"{name} should hold one entry per candidate ({n}), but holds {length}")


def rank_against(
    sorted_values: np.ndarray, losses: np.ndarray, beta: float, cut: float = 1.0
) -> np.ndarray:
    """``CDF(loss) ** beta`` of each loss against ascending ``sorted_values`` (as
    :meth:`LossWindow.rank` against a window holding them; NaN for a non-finite loss).

    Example:
        >>> import numpy as np
        >>> rank_against(np.array([1.0, 2.0, 3.0]), np.array([0.5, 2.5]), 1.0).tolist()
        [0.25, 0.75]
    """
    ref = np.ascontiguousarray(sorted_values, dtype=np.float64).reshape(-1)
    x = np.ascontiguousarray(losses, dtype=np.float64).reshape(-1)
    out = np.empty(x.shape[0], dtype=np.float64)
    _kernels.cdf_power(ref, len(ref), x, float(beta), out, float(cut))
    return out
