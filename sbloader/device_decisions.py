"""Decisions on the model's device (``SelectiveLoader(decisions="device")``).

A :class:`DeviceWindow` holds the R most recent finite selection losses as a tensor where the
losses are (oldest first, plus a sorted copy). One batch's decision (rank every loss as if pushed
one at a time, ``P = CDF(loss) ** beta``, one Bernoulli draw each from a ``torch.Generator``, the
kept positions and weights) runs as a few tensor operations; the host learns two small integers
per batch (how many losses were finite, how many candidates were kept), in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import _kernels
from . import batch as B
from ._checks import check_int, nonfinite_losses
from ._state import check_identity, check_version
from .rows import Rows

__all__ = ["DecisionGenerator", "DeviceChoice", "DeviceWindow", "device_rows"]

#: Rows per block of the pairwise comparisons in :meth:`DeviceWindow.ranks`.
_BLOCK = 1024


@dataclass(frozen=True)
class DeviceChoice:
    """A policy's decision for one batch, as tensors on the losses' device.

    Attributes:
        positions: int64 positions of the kept candidates, in order.
        probabilities: float64, one per candidate: the probability it was kept with.
        weights: float64, one per kept candidate: its loss weight.
        nonfinite: how many losses were not finite.

    Example:
        The infinite loss is never kept (P = 0); with ``reweight=True`` a kept loss weighs 1 / P:

        >>> losses = torch.tensor([2.0, float("inf"), 1.0, 4.0])
        >>> uniforms = torch.tensor([0.9, 0.0, 0.4, 0.9], dtype=torch.float64)
        >>> c = DeviceWindow(8).push_rank_and_draw(losses, uniforms, beta=1.0, reweight=True)
        >>> len(c), c.positions.tolist(), c.probabilities.tolist(), c.weights.tolist(), c.nonfinite
        (3, [0, 2, 3], [1.0, 0.0, 0.5, 1.0], [1.0, 2.0, 1.0], 1)
    """

    positions: torch.Tensor
    probabilities: torch.Tensor
    weights: torch.Tensor
    nonfinite: int

    def __len__(self) -> int:
        return int(self.positions.shape[0])


class DeviceWindow:
    """The ``size`` most recent finite losses, as float64 tensors on one device.

    Ranks are those of :class:`~sbloader.window.LossWindow` exactly: each loss of a batch is
    counted against the window as it would be after pushing the batch's losses one at a time
    (the old window by ``torch.searchsorted``, the old values evicted before it and the batch's
    own values still held by two masked comparisons). The window is then rebuilt with one
    concatenation and one sort of at most ``size`` values: no host round trip.

    Args:
        size: R, the number of most recent losses the CDF is taken over.

    Example:
        >>> w = DeviceWindow(4)
        >>> c = w.push_rank_and_draw(torch.tensor([1.0, 3.0, 2.0, float("nan")]),
        ...                          torch.full((4,), 0.5), beta=1.0)
        >>> c.probabilities.tolist(), c.positions.tolist(), w.values().tolist()
        ([1.0, 1.0, 0.6666666666666666, 0.0], [0, 1, 2], [1.0, 3.0, 2.0])
    """

    VERSION = 1

    def __init__(self, size: int = 1024) -> None:
        self.size = check_int("size", size, minimum=1)
        self._values = torch.zeros(0, dtype=torch.float64)  # oldest first
        self._sorted = torch.zeros(0, dtype=torch.float64)

    def __len__(self) -> int:
        return int(self._values.shape[0])

    @property
    def device(self) -> torch.device:
        return self._values.device

    def to(self, device: torch.device) -> DeviceWindow:
        """Move the window to ``device`` (in place; returns self)."""
        if self._values.device != device:
            self._values = self._values.to(device)
            self._sorted = self._sorted.to(device)
        return self

    def values(self) -> torch.Tensor:
        """The held losses, oldest first."""
        return self._values.clone()

    def sorted_values(self) -> torch.Tensor:
        """The held losses in ascending order."""
        return self._sorted.clone()

    def ranks(self, losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For each loss, the count and window size of the empirical CDF it gets when the
        batch's finite losses are pushed one at a time, and which losses are finite.

        Returns ``(count, size, finite)``: ``CDF = count / size`` where ``finite``.
        """
        count, _, size, finite = self._counts(losses, lows=False)
        return count, size, finite

    def _counts(
        self, losses: torch.Tensor, lows: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """:meth:`ranks`' ``(count, low, size, finite)``, with ``low`` (where ``lows``) the
        count of the values below each loss (``<``, not ``<=``: a tie group's lowest rank),
        from the same pass of pairwise comparisons, else None."""
        x = losses.to(torch.float64).reshape(-1)
        n, n0, cap = x.shape[0], len(self), self.size
        finite = torch.isfinite(x)
        order = torch.cumsum(finite, 0) - 1  # each finite loss's place among the batch's
        pushed = n0 + order + 1  # values pushed so far, the loss included
        size = pushed.clamp(max=cap)
        evicted = pushed - size  # of the whole stream (old values first, then the batch's)
        count = torch.searchsorted(self._sorted, x, right=True)
        low = torch.searchsorted(self._sorted, x, right=False) if lows else None
        span = min(n, n0)  # old values the batch can evict (one per push)
        arange = torch.arange(max(span, n), device=x.device)
        first_held = (evicted - n0).clamp(min=0)  # place of the batch's oldest value still held
        # NOTE: the pairwise comparisons go in blocks of rows, so that memory stays at
        # _BLOCK x n booleans for any batch (a source batch of 8192 would need 64 MB at once).
        parts: list[torch.Tensor] = []
        low_parts: list[torch.Tensor] = []
        for a in range(0, n, _BLOCK):
            b = min(a + _BLOCK, n)
            xi = x[a:b].unsqueeze(1)
            # The batch's own finite values up to each loss (j <= i), less those evicted.
            ours = x[:b].unsqueeze(0)
            mask = (
                finite[:b].unsqueeze(0)
                & (arange[:b].unsqueeze(0) <= arange[a:b].unsqueeze(1))
                & (order[:b].unsqueeze(0) >= first_held[a:b].unsqueeze(1))
            )
            held = ((ours <= xi) & mask).sum(1)
            held_low = ((ours < xi) & mask).sum(1) if lows else None
            if n0 + n > cap and span:
                # Old values evicted before each loss.
                old = self._values[:span].unsqueeze(0)
                gone = arange[:span].unsqueeze(0) < evicted[a:b].unsqueeze(1)
                held -= ((old <= xi) & gone).sum(1)
                if held_low is not None:
                    held_low -= ((old < xi) & gone).sum(1)
            parts.append(held)
            if held_low is not None:
                low_parts.append(held_low)
        if parts:
            count = count + torch.cat(parts)
            if low is not None:
                low = low + torch.cat(low_parts)
        return count, low, size, finite

    def push(self, losses: torch.Tensor, finite: torch.Tensor, m: int) -> None:
        """Append the ``m`` finite ``losses`` (mask ``finite``) in order, evicting the oldest."""
        if m == 0:
            return
        x = losses.to(torch.float64).reshape(-1)
        if m < x.shape[0]:
            # The finite losses first, in order, without learning where they are on the host.
            x = x[torch.argsort((~finite).to(torch.uint8), stable=True)[:m]]
        self._values = torch.cat([self._values.to(x.device), x])[-self.size :]
        self._sorted = torch.sort(self._values).values

    def push_rank_and_draw(
        self,
        losses: torch.Tensor,
        uniforms: torch.Tensor,
        beta: float,
        *,
        reweight: bool = False,
        nonfinite: str = "skip",
        uniform_share: float = 0.0,
        cut: float = 1.0,
    ) -> DeviceChoice:
        """Selective-Backprop's decision for one batch on the losses' device.

        Each finite loss gets ``P = CDF(loss) ** beta`` as if pushed in turn (as
        :meth:`LossWindow.push_and_rank`), and candidate ``i`` is kept when ``uniforms[i] < P``.
        A non-finite loss never enters the window: with ``nonfinite="skip"`` it gets P = 0
        (never kept), with ``"select"`` P = 1 (kept, weight 1), and ``"raise"`` raises
        ``FloatingPointError`` before the window changes.

        Args:
            losses: one loss per candidate (any float dtype; ranked as float64).
            uniforms: float64 uniforms in [0, 1), one per candidate, on the same device.
            beta: the exponent.
            reweight: weights ``1 / P`` instead of 1 (non-finite ``"select"``: 1).
            nonfinite: ``"skip"``, ``"select"`` or ``"raise"``.
            uniform_share: u in [0, 1]: a finite loss's P becomes
                ``u / (beta + 1) + (1 - u) * P`` (as :meth:`LossWindow.push_rank_and_draw`).
            cut: the CDF above which a finite loss's P is 0, below it ``(CDF / cut) ** beta``
                (1: SB's P), the uniform share's rate then ``cut / (beta + 1)`` (as
                :meth:`LossWindow.push_rank_and_draw`).
        """
        self.to(losses.device)
        n = losses.shape[0]
        if uniforms.shape != (n,):
            raise ValueError(
                f"uniforms should hold one entry per candidate ({n}), but has shape "
                f"{tuple(uniforms.shape)}"
            )
        count, lows, size, finite = self._counts(losses, lows=cut < 1.0)
        cdf = count.to(torch.float64) / size.clamp(min=1).to(torch.float64)
        if lows is not None:
            # (the cut's relative tolerance as _kernels.cut_power's: see its NOTE; a loss is
            # left out only where its equals' lowest rank is above the cut, as in
            # _kernels.tied_cut_power)
            first = (lows + 1).to(torch.float64) / size.clamp(min=1).to(torch.float64)
            p = torch.where(
                first > cut * _kernels.CUT_TOLERANCE, 0.0, ((cdf / cut) ** beta).clamp(max=1.0)
            )
        else:
            p = cdf**beta
        if uniform_share > 0.0:
            p = uniform_share * cut / (beta + 1.0) + (1.0 - uniform_share) * p
        p = torch.where(finite, p, 1.0 if nonfinite == "select" else 0.0)
        keep = uniforms < p
        # NOTE: the only transfer to the host: two integers, in one copy.
        m, k = torch.stack([finite.sum(), keep.sum()]).tolist()
        if nonfinite == "raise" and m < n:
            raise nonfinite_losses(n - m)
        self.push(losses, finite, m)
        positions = torch.argsort((~keep).to(torch.uint8), stable=True)[:k]
        if reweight:
            weights = 1.0 / p.index_select(0, positions)
        else:
            weights = torch.ones(k, dtype=torch.float64, device=p.device)
        return DeviceChoice(positions, p, weights, n - m)

    def state_dict(self) -> dict[str, Any]:
        """Its size and its values, oldest first, as a float64 CPU tensor."""
        return {"version": self.VERSION, "size": self.size, "values": self._values.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (the sizes must agree); stays on its device."""
        state = check_version(state, "DeviceWindow", self.VERSION)
        check_identity(
            "DeviceWindow",
            {"size": int(state["size"])},
            {"size": self.size},
            "construct the policy with the same history",
        )
        values = torch.as_tensor(state["values"], dtype=torch.float64).reshape(-1)
        self._values = values.to(self.device)[-self.size :]
        self._sorted = torch.sort(self._values).values


class DecisionGenerator:
    """The loader's ``torch.Generator`` for device-side Bernoulli draws, derived from its seed.

    Made on the device of the first losses it draws for (a CUDA generator for CUDA losses), so
    the draws never leave the device. Its state is saved and restored exactly, also before it
    was first used, on the kind of device it was made on: CPU and CUDA generators keep
    different states, so a state of one is refused (``ValueError``) by the other, when it is
    loaded for a given device (as the loader does), else at the first draw.

    Args:
        seed: the loader's seed.
        rank: the loader's rank.

    Example:
        >>> g = DecisionGenerator(seed=0, rank=0)
        >>> a = torch.rand(3, generator=g.get(torch.device("cpu")))
        >>> state = g.state_dict()
        >>> b = torch.rand(3, generator=g.get(torch.device("cpu")))
        >>> g2 = DecisionGenerator(seed=0, rank=0); g2.load_state_dict(state)
        >>> bool((torch.rand(3, generator=g2.get(torch.device("cpu"))) == b).all())
        True
    """

    def __init__(self, seed: int, rank: int) -> None:
        # NOTE: spawn key (rank, 2): distinct from the loader's numpy generator (rank,) and the
        # counter-based key (rank, 1), so the three streams are independent.
        self.seed = int(
            np.random.SeedSequence(seed, spawn_key=(rank, 2)).generate_state(1, np.uint64)[0]
            >> np.uint64(1)
        )
        self._generator: torch.Generator | None = None
        self._state: torch.Tensor | None = None  # restored before the generator was made

    def get(self, device: torch.device) -> torch.Generator:
        """The generator, made on ``device`` at first use (moved there with its state if it was
        made on another device of the same kind, e.g. another GPU).

        Raises:
            ValueError: its state (restored, or its generator's) is that of another kind of
                device (a CPU generator's for CUDA losses, or the other way).
        """
        g = self._generator
        if g is None or g.device != device:
            g = self._made(device, self._state if g is None else g.get_state())
            self._generator, self._state = g, None
        return g

    def _made(self, device: torch.device, state: torch.Tensor | None) -> torch.Generator:
        """A generator on ``device`` seeded, then set to ``state`` when given (refused, naming
        the fix, when it is another kind of device's)."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        if state is not None:
            _set_state(g, state)
        return g

    def state_dict(self) -> dict[str, Any]:
        """``{"seed": ..., "state": a uint8 CPU tensor or None before the first draw}``."""
        g = self._generator
        state = g.get_state() if g is not None else self._state
        return {"seed": self.seed, "state": state}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore a state from :meth:`state_dict`; a refused one changes nothing.

        Args:
            state: the saved state.
            device: where the draws will be made (the loader's device), or None: given, the
                generator is made there now, so that a state of another kind of device is
                refused here rather than at the first draw.

        Raises:
            ValueError: a state of another seed or rank, or of another kind of device than
                ``device`` (or than the generator's, once made).
        """
        if int(state["seed"]) != self.seed:
            raise ValueError(
                "the saved device generator belongs to another seed or rank; build the loader "
                "with the saved run's seed= and rank="
            )
        saved = state["state"]
        if saved is not None and device is not None:
            self._generator, self._state = self._made(device, saved), None
        elif self._generator is not None and saved is not None:
            _set_state(self._generator, saved)
        else:
            self._generator, self._state = None, saved


def _set_state(generator: torch.Generator, state: torch.Tensor) -> None:
    """``generator.set_state(state)``, refusing a state of another kind of device with the fix.

    NOTE: a CPU generator's state is a Mersenne Twister's (5056 bytes), a CUDA generator's a
    Philox seed and offset (16 bytes); ``set_state`` refuses the other kind's with a message
    that names neither ``decisions`` nor what to do.
    """
    try:
        generator.set_state(state)
    except RuntimeError as e:
        raise ValueError(
            f"decisions='device': the saved draws of its generator were made on another kind of "
            f"device than the losses, which are on {generator.device} (CPU and CUDA generators "
            "keep different states, so the draws cannot continue here); resume on the kind of "
            "device the run was saved on (keep the model there), or start the run afresh"
        ) from e


def device_rows(
    data: list[Any],
    choice: DeviceChoice,
    indices: np.ndarray | None,
    device: torch.device,
    losses: torch.Tensor,
) -> Rows:
    """Rows for the kept candidates of a source batch, gathered where each column lives.

    The kept positions stay on the device for tensor columns, losses, probabilities and
    weights; they come to the host only for list columns and for the source's dataset indices
    (which :class:`~sbloader.rows.Rows` keeps on the CPU).

    Example:
        A tensor column and a list column, positions 0, 2 and 3 kept:

        >>> losses = torch.tensor([2.0, float("inf"), 1.0, 4.0])
        >>> uniforms = torch.tensor([0.9, 0.0, 0.4, 0.9], dtype=torch.float64)
        >>> c = DeviceWindow(8).push_rank_and_draw(losses, uniforms, beta=1.0, reweight=True)
        >>> data = [torch.tensor([10, 11, 12, 13]), ["a", "b", "c", "d"]]
        >>> rows = device_rows(data, c, np.array([50, 51, 52, 53]), torch.device("cpu"), losses)
        >>> rows.data[0].tolist(), rows.data[1], rows.indices.tolist()
        ([10, 12, 13], ['a', 'c', 'd'], [50, 52, 53])
        >>> rows.losses.tolist(), rows.probabilities.tolist(), rows.weights.tolist()
        ([2.0, 1.0, 4.0], [1.0, 0.5, 1.0], [1.0, 2.0, 1.0])
        >>> device_rows(data[:1], c, None, torch.device("cpu"), losses).indices.tolist()
        [-1, -1, -1]
    """
    pos = choice.positions
    k = len(choice)
    need_host = indices is not None or any(not isinstance(c, torch.Tensor) for c in data)
    host = pos.cpu() if need_host else None
    pos_list = host.tolist() if host is not None else None
    kept = [B.take(c, pos, pos_list) for c in data]
    idx = (
        torch.from_numpy(indices.astype(np.int64))[host]
        if indices is not None and host is not None
        else torch.full((k,), -1, dtype=torch.int64)
    )
    return Rows(
        kept,
        idx,
        losses.index_select(0, pos.to(losses.device)),
        choice.probabilities.index_select(0, pos).to(device=device, dtype=torch.float32),
        choice.weights.to(device=device, dtype=torch.float32),
    )
