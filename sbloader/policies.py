"""Selection policies: pure maps from losses (and the policy's own state) to choices.

A policy never calls a model, never does I/O and never touches a global RNG: the loader hands it
the losses of a selection pass (or ``None`` when the policy needs none) and its own
``numpy.random.Generator``, and gets back a :class:`Choice`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checks import check_float, check_int
from .window import LossWindow

__all__ = ["Choice", "Policy", "RandomBackprop", "SelectiveBackprop", "Traditional"]


@dataclass(frozen=True)
class Choice:
    """What a policy decided for one batch of candidates.

    Attributes:
        positions: int64 positions (into the candidate batch) to backpropagate, in the order they
            should be yielded. A position may repeat for policies that sample with replacement.
        probabilities: float64, one per candidate: the probability the policy gave it.
        weights: float64, one per entry of ``positions``: the loss weight for that example.
    """

    positions: np.ndarray
    probabilities: np.ndarray
    weights: np.ndarray

    @classmethod
    def bernoulli(cls, probabilities: np.ndarray, rng: np.random.Generator) -> Choice:
        """Keep each candidate independently with its probability; weights 1."""
        probabilities = np.asarray(probabilities, dtype=np.float64)
        keep = rng.random(probabilities.shape[0]) < probabilities
        positions = np.flatnonzero(keep).astype(np.int64)
        return cls(positions, probabilities, np.ones(positions.shape[0], dtype=np.float64))

    @classmethod
    def everything(cls, n: int) -> Choice:
        """Keep all ``n`` candidates with probability 1 and weight 1."""
        return cls(
            np.arange(n, dtype=np.int64), np.ones(n, dtype=np.float64), np.ones(n, dtype=np.float64)
        )


class Policy(abc.ABC):
    """Base class of selection policies.

    Subclasses implement :meth:`choose`; they may override :meth:`needs_losses` (whether the loader
    must run a selection pass in a given epoch), :meth:`begin_epoch`, and the state methods.
    """

    #: True when the policy keeps every example and the loader should keep the source's batches
    #: exactly as they are (no re-batching, no selection pass).
    passthrough: bool = False

    #: True when :meth:`choose` needs each candidate's dataset index.
    needs_indices: bool = False

    @property
    def target_rate(self) -> float:
        """The expected fraction of candidates backpropagated (for ``loader.stats``)."""
        return 1.0

    def needs_losses(self, epoch: int) -> bool:
        """Whether :meth:`choose` needs fresh selection-pass losses in ``epoch``."""
        return True

    def begin_epoch(self, epoch: int) -> None:  # noqa: B027 - optional hook
        """Called by the loader when ``epoch`` (0-based) starts."""

    @abc.abstractmethod
    def choose(
        self,
        losses: np.ndarray | None,
        indices: np.ndarray | None,
        rng: np.random.Generator,
        n: int,
    ) -> Choice:
        """Choose which of ``n`` candidates to backpropagate.

        Args:
            losses: float64 selection losses, one per candidate, all finite (the loader handles
                non-finite losses before calling), or ``None`` when ``needs_losses`` was False.
            indices: int64 dataset indices of the candidates, or ``None`` if the source has none.
            rng: the loader's generator; the only source of randomness a policy may use.
            n: the number of candidates.
        """

    def state_dict(self) -> dict[str, Any]:
        """The policy's mutable state (empty for stateless policies)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless default
        """Restore a state from :meth:`state_dict`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Traditional(Policy):
    """Backpropagate every example, in the source's own batches; no selection pass.

    Example:
        >>> import numpy as np
        >>> Traditional().choose(None, None, np.random.default_rng(0), 3).positions.tolist()
        [0, 1, 2]
    """

    passthrough = True

    def needs_losses(self, epoch: int) -> bool:
        return False

    def choose(self, losses, indices, rng, n):
        return Choice.everything(n)


class SelectiveBackprop(Policy):
    """Selective-Backprop (Jiang et al., 2019): keep an example with P = CDF_R(loss) ** beta.

    The CDF is taken over the ``history`` most recent finite selection losses (a
    :class:`~sbloader.window.LossWindow`), each loss entering the window before it is ranked, and
    each example gets one Bernoulli draw from the loader's generator. Give either ``selectivity``
    s (the expected kept fraction, beta = 1/s - 1) or ``beta`` directly.

    Args:
        selectivity: expected fraction of examples kept, in (0, 1]. Default 1/3 when ``beta`` is
            not given.
        beta: the exponent, >= 0 (beta = 0 keeps everything).
        history: R, the number of recent losses the CDF is taken over (paper: 1024).

    Example:
        >>> import numpy as np
        >>> sb = SelectiveBackprop(selectivity=1 / 3, history=1024)
        >>> sb.beta
        2.0
        >>> losses = np.random.default_rng(1).exponential(size=3000)
        >>> c = sb.choose(losses, None, np.random.default_rng(0), 3000)
        >>> 0.30 < len(c.positions) / 3000 < 0.37
        True
        >>> sb.choose(np.array([9.0]), None, np.random.default_rng(0), 1).probabilities  # new max
        array([1.])
    """

    def __init__(
        self,
        selectivity: float | None = None,
        *,
        beta: float | None = None,
        history: int = 1024,
    ) -> None:
        if selectivity is not None and beta is not None:
            raise ValueError(
                "give either selectivity or beta, not both, but got "
                f"selectivity={selectivity!r} and beta={beta!r}"
            )
        if beta is None:
            s = 1 / 3 if selectivity is None else selectivity
            s = check_float("selectivity", s, low=0.0, high=1.0, low_open=True)
            beta = 1.0 / s - 1.0
        self.beta = check_float("beta", beta, low=0.0)
        self.window = LossWindow(history)

    @property
    def selectivity(self) -> float:
        """The expected kept fraction, 1 / (beta + 1)."""
        return 1.0 / (self.beta + 1.0)

    @property
    def target_rate(self) -> float:
        return self.selectivity

    @property
    def history(self) -> int:
        """R, the window size."""
        return self.window.size

    def probabilities(self, losses: np.ndarray) -> np.ndarray:
        """Add the losses to the window in order and return each one's P (NaN if not finite)."""
        return self.window.push_and_rank(losses, self.beta)

    def choose(self, losses, indices, rng, n):
        if losses is None:
            raise ValueError("SelectiveBackprop needs selection losses, but got losses=None")
        return Choice.bernoulli(self.probabilities(losses), rng)

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "window": self.window.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if float(state["beta"]) != self.beta:
            raise ValueError(
                f"the saved SelectiveBackprop state has beta={state['beta']}, but this policy has "
                f"beta={self.beta}; construct the policy with the saved selectivity"
            )
        self.window.load_state_dict(state["window"])

    def __repr__(self) -> str:
        return f"SelectiveBackprop(beta={self.beta:g}, history={self.history})"


class RandomBackprop(Policy):
    """Random-Backprop: keep each example with probability ``selectivity``; no selection pass.

    The control that loss-based selection must beat at matched selectivity.

    Example:
        >>> import numpy as np
        >>> c = RandomBackprop(0.25).choose(None, None, np.random.default_rng(0), 10_000)
        >>> round(len(c.positions) / 10_000, 2)
        0.25
    """

    def __init__(self, selectivity: float = 1 / 3) -> None:
        self.selectivity = check_float("selectivity", selectivity, low=0.0, high=1.0, low_open=True)

    @property
    def target_rate(self) -> float:
        return self.selectivity

    def needs_losses(self, epoch: int) -> bool:
        return False

    def choose(self, losses, indices, rng, n):
        return Choice.bernoulli(np.full(check_int("n", n, minimum=0), self.selectivity), rng)

    def __repr__(self) -> str:
        return f"RandomBackprop(selectivity={self.selectivity:g})"
