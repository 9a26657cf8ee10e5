"""Selection policies: decisions from losses (and the policy's own state) to choices.

A policy never calls a model, never does I/O and never touches a global RNG: the loader hands it
the losses of a selection pass (or ``None`` when the policy needs none) and its own
``numpy.random.Generator``, and gets back a :class:`Choice`. Policies are stateful (a loss window,
a per-example store, a moving average): :meth:`Policy.choose` updates that state, which the
state protocol saves and restores.
"""

from __future__ import annotations

import abc
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._checks import check_bool, check_choice, check_float, check_indices, check_int
from ._random import hashed_uniforms
from .device_decisions import DeviceChoice, DeviceWindow
from .store import ExampleStore
from .window import LossWindow, rank_against

__all__ = [
    "Choice",
    "Kath18",
    "Phased",
    "Policy",
    "RandomBackprop",
    "SelectiveBackprop",
    "Traditional",
    "default_policy",
]

#: The share of the planned epochs that :func:`default_policy` anneals on all the data by default
#: (InfoBatch's).
ANNEAL_SHARE = 1 / 8
#: The default ``drift_bound`` of :class:`SelectiveBackprop` and :func:`default_policy`.
DRIFT_BOUND = 0.5

#: What a stale epoch of :class:`SelectiveBackprop` ranks stored losses against (``stale_cdf``).
STALE_CDFS = ("window", "store")


@dataclass(frozen=True)
class Choice:
    """What a policy decided for one batch of candidates.

    Attributes:
        positions: int64 positions (into the candidate batch) to backpropagate, in the order they
            should be yielded. A position may repeat for policies that sample with replacement.
        probabilities: float64, one per candidate: the probability the policy gave it, in
            [0, 1].
        weights: float64, one per entry of ``positions``: the loss weight for that example,
            finite and >= 0 (> 0 where the policy's ``normalize_weights()`` is True). The loader
            refuses a Choice outside these bounds, naming the policy and the field.

    Example:
        >>> import numpy as np
        >>> c = Choice(np.array([2, 0]), np.array([1.0, 0.25, 0.5]), np.array([1.0, 4.0]))
        >>> c.positions.tolist(), c.probabilities.tolist(), c.weights.tolist()
        ([2, 0], [1.0, 0.25, 0.5], [1.0, 4.0])
        >>> Choice.bernoulli(np.array([1.0, 0.0, 1.0]), np.random.default_rng(0)).positions.tolist()
        [0, 2]
        >>> Choice.everything(3).weights.tolist()
        [1.0, 1.0, 1.0]
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
    must run a selection pass in a given epoch), :meth:`begin_epoch`, the capability methods and
    the state methods. Capabilities are plain methods that the loader calls; it never probes.

    Threading contract: the loader calls every method on the caller's thread, except
    :meth:`prefilter`, which a source may call on the loader's prefetch thread (``prefetch=``)
    while :meth:`choose` runs on the caller's thread. So in an epoch where :meth:`can_prefilter`
    is True, :meth:`prefilter` may only read state that :meth:`choose` does not change in that
    epoch (it is fixed by :meth:`begin_epoch`). :class:`SelectiveBackprop` enforces this: its
    loss window is frozen in such epochs, and a push into it raises.

    Example:
        A policy that backpropagates the higher-loss half of every candidate batch, hardest
        first:

        >>> import numpy as np
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import sbloader
        >>> class HardestHalf(Policy):
        ...     @property
        ...     def target_rate(self):
        ...         return 0.5
        ...     def choose(self, losses, indices, rng, n):
        ...         positions = np.argsort(-losses, kind="stable")[: n // 2].astype(np.int64)
        ...         return Choice(positions, np.full(n, 0.5), np.ones(n // 2))
        >>> data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
        >>> loader = sbloader.SelectiveLoader(
        ...     DataLoader(data, batch_size=8), torch.nn.Linear(4, 2), policy=HardestHalf(),
        ...     batch_size=4)
        >>> batches = list(loader)
        >>> [len(y) for _, y in batches], loader.stats.total.selection_rate
        ([4, 4, 4, 4], 0.5)
        >>> bool((batches[0].losses[:-1] >= batches[0].losses[1:]).all())
        True
    """

    def passthrough(self) -> bool:
        """Whether the policy keeps every example without a selection pass: the loader hands
        the source's batches out as they are where they have ``batch_size`` examples, and
        re-batches them in order where not."""
        return False

    def needs_indices(self) -> bool:
        """Whether :meth:`choose` needs each candidate's dataset index."""
        return False

    def normalize_weights(self) -> bool:
        """Whether the loader should scale each yielded batch's weights to mean 1 (the
        weights of :meth:`choose` must then be > 0, and are refused otherwise)."""
        return False

    def records_examples(self) -> bool:
        """Whether the policy keeps per-example records keyed by dataset index (Stale-SB's store)
        that every rank's losses must reach in a distributed run: the loader then shares losses
        across ranks through :meth:`observe` even with ``cdf="local"``."""
        return False

    def ranks_shared_losses(self) -> bool:
        """Whether other ranks' selection losses change this policy's decisions.

        Under ``SelectiveLoader(cdf="global")`` on several ranks, the ranks exchange their
        selection losses every round (an ``all_gather``) and feed them to :meth:`observe` only
        where this is True: a policy that ranks losses against no shared distribution (one that
        decides without losses, or from each batch's own) would get them for nothing. The answer
        must not change during a run, and must be the same on every rank (the loader compares it
        across ranks as it is built), since every rank must make the same collectives in every
        round. :meth:`records_examples` makes the ranks exchange losses either way.

        Returns:
            True by default, so that a policy's own :meth:`observe` gets every rank's losses;
            False for :class:`Traditional`, :class:`RandomBackprop` and :class:`Kath18`.
        """
        return True

    def can_prefilter(self) -> bool:
        """Whether :meth:`prefilter` decides in the current epoch (set by :meth:`begin_epoch`)."""
        return False

    def decides_on_device(self) -> bool:
        """Whether :meth:`choose_device` can decide batches with a selection pass on the
        losses' device (``SelectiveLoader(decisions="device")``)."""
        return False

    def choose_device(
        self, losses: torch.Tensor, generator: torch.Generator, nonfinite: str
    ) -> DeviceChoice:
        """Choose among the candidates of ``losses`` (a tensor, possibly with non-finite
        entries, handled as ``nonfinite`` says) with draws from ``generator``, on the losses'
        device. Called only where :meth:`decides_on_device` is True."""
        raise NotImplementedError(f"{type(self).__name__} does not decide on the device")

    def kind(self) -> str:
        """What kind of policy this is, for checking that a saved state belongs to it."""
        return type(self).__name__

    def settings(self) -> str:
        """The settings a saved state must agree with besides :meth:`kind` (a state saved with
        another selectivity is refused on loading), or "" where :meth:`kind` or the policy's own
        state already checks them (the default)."""
        return ""

    def attach(self, num_examples: int | None, key: int) -> None:  # noqa: B027 - optional hook
        """Called once by the loader: the dataset size (None if unknown) and a per-loader integer
        key for counter-based randomness (see :meth:`prefilter`)."""

    def prefilter(self, indices: np.ndarray) -> np.ndarray:
        """Decide before loading, from dataset indices alone, which candidates to load.

        Called only in epochs where :meth:`can_prefilter` is True, possibly on the prefetch
        thread (see the class's threading contract). Returns a boolean mask. The policy must
        make the same decision again in :meth:`choose`, whatever the order the examples come in.
        """
        raise NotImplementedError(f"{type(self).__name__} does not prefilter")

    @property
    def target_rate(self) -> float:
        """The expected fraction of candidates backpropagated (for ``loader.stats``)."""
        return 1.0

    @property
    def steady_rate(self) -> float:
        """The expected fraction backpropagated once any warm-up is over: what
        ``SelectiveLoader(batches_per_epoch="expected")`` sizes its epochs by (``target_rate``
        unless the policy changes its rate by epoch, as :class:`Phased` does)."""
        return self.target_rate

    def epoch_rate(self, epoch: int) -> float:
        """The expected fraction backpropagated in ``epoch``, begun or not: what
        ``loader.expected_batches()`` estimates a pass by (``target_rate`` unless the policy
        changes its rate by epoch, as :class:`Phased` does)."""
        return self.target_rate

    def needs_losses(self, epoch: int) -> bool:
        """Whether :meth:`choose` needs fresh selection-pass losses in ``epoch``."""
        return True

    def uses_losses(self) -> bool:
        """Whether the policy needs selection-pass losses in any epoch (the loader then checks
        the model and ``loss_fn`` on the first source batch, even in an epoch without a pass)."""
        return True

    def check_losses(self, losses: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` for finite selection losses this policy cannot decide from
        (default: none). The loader calls it on the losses of the check it runs once, on its
        first source batch, where that batch's epoch has no selection pass (a warm-up), so that
        such a loss (among the first three candidates) fails before the warm-up, not after it; a
        policy checks the losses of its selection passes in its own :meth:`choose` (as
        :class:`Kath18` does, calling this)."""

    def begin_epoch(self, epoch: int) -> None:  # noqa: B027 - optional hook
        """Called by the loader when ``epoch`` (0-based) starts."""

    def advance(self, position: float) -> None:  # noqa: B027 - optional hook
        """Called by the loader before each decision made from selection-pass losses, with the
        position in the data: epochs of source data consumed so far, the current source batch
        included (:attr:`SelectiveLoader.progress <sbloader.SelectiveLoader.progress>`).
        Derived from the loader's state, so a resumed run passes the same positions."""

    def takes_feedback(self) -> bool:
        """Whether :meth:`feedback` uses training-step losses (a per-example store does)."""
        return False

    def writes_state_files(self) -> bool:
        """Whether :meth:`state_dict` writes files (a memory-mapped store's snapshot, counted
        against its ``store_snapshots``), so that a state must not be taken only in case it is
        needed (see :meth:`SelectiveLoader.keep_ended_state
        <sbloader.SelectiveLoader.keep_ended_state>`). Of this policy alone, not its
        :meth:`parts`."""
        return False

    def keep_saved_files(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """A state of this policy taken within ``_state.unsaved_states()`` (whose files took no
        place among those kept: see :meth:`writes_state_files`) was saved by a checkpoint: its
        files are kept from now as any saved state's (a memory-mapped store's snapshot)."""

    def count_forced(self, indices: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Examples backpropagated without :meth:`choose` choosing them: those with a non-finite
        selection loss under ``nonfinite="select"`` (int64 dataset indices). A policy with
        per-example records counts them as selected, as it counts those it chooses."""

    def mark_forced(self, indices: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Examples backpropagated for a non-finite selection loss under ``nonfinite="select"``
        (int64 dataset indices), by this rank (from :meth:`count_forced`) or by another (a
        distributed run's shared losses). A policy with per-example records marks them, so
        that the epochs deciding from stored losses keep them too, instead of deciding from a
        loss measured before; unlike :meth:`count_forced`, nothing is counted as selected."""

    def parts(self) -> list[Policy]:
        """This policy and the policies it runs (a :class:`Phased`'s), each holding run state
        that belongs to one loader."""
        return [self]

    def count_skipped(self, indices: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Examples left out because their selection loss was not finite, under
        ``nonfinite="skip"`` (int64 dataset indices). A policy with per-example records marks
        them, so that the epochs deciding from stored losses skip them too, instead of taking
        them for never scored (kept with P = 1)."""

    def feedback(  # noqa: B027 - optional hook
        self, indices: np.ndarray, losses: np.ndarray, epoch: int
    ) -> None:
        """Training-step losses of examples backpropagated in ``epoch``, reported through
        :meth:`SelectiveLoader.feedback <sbloader.SelectiveLoader.feedback>`. The loader calls
        this only when an epoch starts, before :meth:`begin_epoch` (never mid-epoch: see the
        threading contract), with every rank's reports in a distributed run."""

    def observe(  # noqa: B027 - optional hook
        self, losses: np.ndarray, indices: np.ndarray | None, *, cdf: bool = True
    ) -> None:
        """Learn from candidates that another rank chooses for (distributed runs only).

        With ``cdf="global"`` where :meth:`ranks_shared_losses` is True (or when
        :meth:`records_examples`), the loader calls this with each other rank's selection
        losses of the round: those of lower ranks before this rank's own :meth:`choose`, those
        of higher ranks after it, so that every rank's policy sees the same losses in the same
        order.

        Args:
            losses: float64 selection losses of another rank's candidates, all finite.
            indices: their int64 dataset indices, or ``None`` if the source has none.
            cdf: whether the losses should enter the distribution this policy ranks losses
                against (``cdf="global"``); per-example records take them either way.
        """

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


#: The fix for a per-example store (Stale-SB's) over a source without dataset indices or size.
NO_STORE_FIX = (
    "SelectiveBackprop(staleness=1), or default_policy(..., has_store=False) (a selection pass "
    "every epoch, the policy that policy=None chooses for such a source)"
)


def check_policy(name: str, value: Any, example: str) -> None:
    """Refuse a ``value`` that is not a policy object (``TypeError`` naming ``name``).

    NOTE: a policy class given for an object (``policy=sbloader.SelectiveBackprop``, the
    parentheses left out) was refused as "but got ABCMeta", the class's metaclass.

    Example:
        >>> check_policy("policy", Traditional, "sbloader.Traditional()")
        Traceback (most recent call last):
            ...
        TypeError: policy should be an sbloader policy object, but got the class Traditional; ...
    """
    if isinstance(value, Policy):
        return
    if isinstance(value, type) and issubclass(value, Policy):
        raise TypeError(
            f"{name} should be an sbloader policy object, but got the class {value.__name__}; "
            f"pass an instance, e.g. {name}={value.__name__}(...)"
        )
    raise TypeError(
        f"{name} should be an sbloader policy such as {example}, but got {type(value).__name__}"
    )


class Traditional(Policy):
    """Backpropagate every example, in the source's own batches; no selection pass.

    Example:
        >>> import numpy as np
        >>> Traditional().choose(None, None, np.random.default_rng(0), 3).positions.tolist()
        [0, 1, 2]
    """

    def passthrough(self) -> bool:
        return True

    def needs_losses(self, epoch: int) -> bool:
        return False

    def uses_losses(self) -> bool:
        return False

    def ranks_shared_losses(self) -> bool:
        return False

    def choose(
        self,
        losses: np.ndarray | None,
        indices: np.ndarray | None,
        rng: np.random.Generator,
        n: int,
    ) -> Choice:
        return Choice.everything(n)


class SelectiveBackprop(Policy):
    """Selective-Backprop (Jiang et al., 2019): keep an example with P = CDF_R(loss) ** beta.

    The CDF is taken over the ``history`` most recent finite selection losses (a
    :class:`~sbloader.window.LossWindow`), each loss entering the window before it is ranked, and
    each example gets one Bernoulli draw from the loader's generator. Give either ``selectivity``
    s (the expected kept fraction, beta = 1/s - 1) or ``beta`` directly.

    With ``staleness=n`` this is Stale-SB: a selection pass runs only in every n-th epoch (epochs
    0, n, 2n, ...) and stores each example's loss by dataset index in an
    :class:`~sbloader.store.ExampleStore`; the n - 1 epochs between decide each example from its
    own stored loss, ranked against the window without changing it, and make no selection
    forward at all. Their decisions use counter-based uniforms of (seed, epoch, dataset index),
    so a DataLoader source does not even load the examples they reject.

    Args:
        selectivity: expected fraction of examples kept, in (0, 1]. Default 1/3 when ``beta`` is
            not given.
        beta: the exponent, >= 0 (beta = 0 keeps everything).
        history: R, the number of recent losses the CDF is taken over (paper: 1024). NOTE:
            the empirical CDF takes the values k / R, so once the window is full a pass keeps
            ``mean((k / R) ** beta for k in 1..R)`` of continuous losses in expectation, about
            ``s + 1 / (2R)``: 0.3338 at s = 1/3 and R = 1024, but 0.365 at R = 16, and R = 1
            keeps everything (its one loss is its own maximum). Before R losses were seen the
            CDF is over those seen (the first loss gets P = 1).
        staleness: n, a fresh selection pass every n-th epoch (1: every epoch, plain SB); epochs
            are passes over the data (``loader.epoch``), also with ``batches_per_epoch``.
        fed_staleness: m >= n, the passes' spacing while the training step reports its losses
            (:meth:`SelectiveLoader.feedback <sbloader.SelectiveLoader.feedback>`): those
            reports keep the stored losses fresh, so a pass is needed less often. An epoch runs
            a pass when at least m epochs have passed since the last one and the previous epoch's
            losses were reported, or n epochs and they were not. Default: n. Refused above 1
            with ``staleness=1`` (a pass every epoch: it would change nothing).
        reweight: weight each kept example by 1/P, normalised to mean 1 per yielded batch (off
            by default, as in the paper). NOTE: the normalisation makes the weighted batch mean
            a self-normalised (ratio) estimate, not an unbiased one: most batches hold none of
            the rare kept examples of low P (low loss), so its expectation stays above the data's
            mean loss (measured: exponential losses at s = 1/3, R = 1024, batches of 64: 1.13
            against 1.02). For an unbiased
            estimate of the data's mean loss, weight with ``selectivity / batch.probabilities``
            instead (the batch mean of those weighted losses).
        store_path: a folder to memory-map the per-example store in (Stale-SB on huge datasets;
            refused with ``staleness=1``, which keeps no store).
            A run that begins without loading a state starts with an empty store (the files an
            earlier run left there are cleared). Each saved state copies the files into a
            snapshot in the folder's ``snapshots/`` (sparse: about the scored examples' 12
            bytes each), and loading a state restores its snapshot, so that a resumed run
            continues from the store as it was at the checkpoint, exactly as an in-memory
            store's does. The folder is held by one process (another process's store there,
            e.g. another rank's, is refused): under several ranks give each rank its own.
        store_snapshots: how many of the newest saved states keep their snapshot in
            ``store_path`` (older ones are removed; a state whose snapshot is gone is refused
            when loaded, naming this): at least as many as the checkpoints you keep, counting
            every ``state_dict()`` call (two per step with two checkpoint callbacks; a Lightning
            stop's state counts once a checkpoint saves it); None keeps every one (e.g. with
            Lightning's ``save_top_k=-1``). Default 2.
        ramp_epochs: r >= 0: over the first r epochs of data this policy decides (counted from
            its start, after a :class:`Phased` warm-up), each P of a selection pass is blended
            with uniform keeping at the same expected rate, ``P = u / (beta + 1) + (1 - u) *
            CDF ** beta``, the uniform share u falling linearly from 1 to 0 with the position
            in the data (0: the paper's SB from the first batch). At most 1 with
            ``staleness > 1``: only Stale-SB's first epoch makes a selection pass, and its
            stale epochs decide from stored losses without a blend.
        trim_top: q in [0, 1 - selectivity]: never keep the losses above the window's 1 - q
            quantile (the q highest), and keep the others with ``P = (CDF / (1 - q)) **
            beta_q``, ``beta_q = (1 - q)(beta + 1) - 1``, so that the expected kept fraction
            stays ``selectivity`` (0: the paper's P). For labels known to be noisy: the
            highest losses are then mostly the mislabelled examples, which loss-ranked
            selection otherwise trains on the most. Applies to every decision with losses,
            stored or fresh; an example never scored keeps P = 1. NOTE: during a ramp
            (``ramp_epochs``) the uniform share u keeps every loss at ``u * selectivity``, the
            trimmed ones included: only ``(1 - u)`` of P is trimmed. Needs
            ``history >= 1 / trim_top`` (the window's highest loss alone is ``1 / history`` of
            it; refused otherwise), and the loss exactly at the ``1 - q`` quantile is kept,
            as are equal losses that reach down to it (all-equal losses, as plain SB keeps
            them: every one).
        stale_cdf: what a stale epoch ranks each stored loss against. ``"window"`` (default):
            the window as the last selection pass left it. ``"store"``: at the start of each
            stale epoch the window is refilled with the stored losses of ``history`` examples
            spread evenly over the scored examples (every one's, if fewer; those of a
            ``subset`` only, the others are never scored), so that P is the CDF over
            the stored losses as they are now and a stale epoch keeps ``selectivity`` of the data
            in expectation. With :meth:`SelectiveLoader.feedback
            <sbloader.SelectiveLoader.feedback>` the stored losses fall as training goes on,
            and ranked against the early window ever fewer are kept (measured: 1/3 down to about
            0.21 by the tenth epoch); without it a fresh epoch's losses fall through the epoch,
            so its last ``history`` losses sit low and the stale epochs keep more than the
            selectivity. ``"store"`` keeps the rate either way. With feedback, measured on the
            CNN (``benchmarks/results/MEASURED.md``, "The frontier"): keeping 1/3 over 10 epochs
            it ended no lower than ``"window"``; keeping 0.5 over 20 epochs, 0.14 points lower on
            the mean (four seeds) at 8% more backprops and 7-15% more time. A small gain at a
            cost in time, so it is not the default.
        drift_bound: d in (0, 1], or None: with ``stale_cdf="window"``, a stale epoch whose
            expected kept share (:meth:`expected_stale_share`: the stored losses ranked against
            those the last selection pass stored) is below ``d * s`` or
            above ``s / d`` (s: the selectivity) runs a selection pass instead, and the schedule
            restarts from it (``drift_passes`` counts them; the epoch's ``loader.stats`` show
            its selection forwards). Default 0.5.
            Without it, a long stale phase with reported losses can starve: on a GPU the kept
            share fell to 2% and the run ended at 19% error (see :meth:`_drifted`). None: the
            schedule alone decides. A bound other than 0.5 is refused where no stale epoch is
            judged by it (``staleness=1``, or ``stale_cdf="store"``).

    NOTE (the ramp): switching from uniform to loss-ranked batches at a high learning rate can
    raise the test error for a while (measured here, the CNN: 14.7% after a Random-Backprop
    epoch, 16.3% half an epoch into SB, while Random-Backprop went on to 13.5%). Ramping the
    selection in over an epoch removed that rise in one measurement (13.4%) at the same cost,
    but not reliably: in a later two-seed check it moved the rise to the ramp's end in one seed
    and caused one in the other (README, Strategies), so it is off by default.

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
        staleness: int = 1,
        fed_staleness: int | None = None,
        reweight: bool = False,
        store_path: str | None = None,
        store_snapshots: int | None = 2,
        ramp_epochs: float = 0.0,
        trim_top: float = 0.0,
        stale_cdf: str = "window",
        drift_bound: float | None = DRIFT_BOUND,
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
            if not math.isfinite(beta):  # (1 / s overflows for a subnormal s)
                raise ValueError(
                    "selectivity should be large enough that 1 / selectivity - 1 (the exponent "
                    f"beta) is finite, but got selectivity={selectivity!r}, whose beta overflows "
                    "to inf; pass a selectivity of at least 1e-300"
                )
        self.beta = check_float("beta", beta, low=0.0)
        self.window = LossWindow(check_int("history", history, minimum=1))
        self.staleness = check_int("staleness", staleness, minimum=1)
        self.fed_staleness = (
            self.staleness
            if fed_staleness is None
            else check_int("fed_staleness", fed_staleness, minimum=self.staleness)
        )
        self.reweight = check_bool("reweight", reweight)
        self.ramp_epochs = check_float("ramp_epochs", ramp_epochs, low=0.0)
        if self.staleness > 1 and self.ramp_epochs > 1:
            raise ValueError(
                f"ramp_epochs should be at most 1 with staleness={self.staleness} (only the first "
                f"epoch of Stale-SB makes a selection pass), but got ramp_epochs={ramp_epochs}; "
                "use staleness=1 for a longer ramp"
            )
        self.trim_top = check_float("trim_top", trim_top, low=0.0, high=1.0)
        # (1 - selectivity as typed, e.g. trim_top=0.2 for 0.8, is 1e-16 off in float)
        if self.trim_top > 1.0 - self.selectivity + 1e-12 or self.trim_top == 1.0:
            raise ValueError(
                f"trim_top should be at most 1 - selectivity = {1.0 - self.selectivity:g} (the "
                "share of losses this policy can leave out and still keep its selectivity), but "
                f"got trim_top={trim_top}; lower trim_top or the selectivity"
            )
        if self.trim_top > 0 and self.trim_top * self.window.size < 1 - 1e-9:
            # NOTE: the window's CDF takes the values k / R, and the top step alone (the window's
            # highest loss, CDF 1) is 1 / R of the losses: with trim_top * R < 1 the trim would
            # leave out more than trim_top (everything at R = 1) and the kept share would fall.
            needed = 1 / self.trim_top  # (inf for a subnormal trim_top: no int to round up)
            raise ValueError(
                f"trim_top={trim_top} needs history >= 1 / trim_top = "
                f"{math.ceil(needed - 1e-9) if math.isfinite(needed) else needed} (the window's "
                "highest loss alone is "
                f"1 / history of it), but got history={history}; raise history or lower trim_top"
            )
        if stale_cdf not in STALE_CDFS:
            raise ValueError(
                f"stale_cdf should be one of {list(STALE_CDFS)}, but got stale_cdf={stale_cdf!r}"
            )
        if stale_cdf == "store" and self.staleness == 1:
            raise ValueError(
                "stale_cdf='store' ranks the stale epochs' stored losses, and staleness=1 has no "
                "stale epochs; give staleness > 1 (Stale-SB) or leave stale_cdf='window'"
            )
        # Stale-SB's own options do nothing with staleness=1: refused rather than ignored.
        if self.staleness == 1 and self.fed_staleness > 1:
            raise ValueError(
                "fed_staleness spaces Stale-SB's selection passes while the training step reports "
                "its losses, and staleness=1 runs a pass every epoch (it keeps no stored losses); "
                f"give staleness > 1 (Stale-SB) or leave fed_staleness out, but got "
                f"fed_staleness={fed_staleness!r} with staleness=1"
            )
        if self.staleness == 1 and store_path is not None:
            raise ValueError(
                "store_path is where Stale-SB memory-maps its per-example store, and "
                "staleness=1 keeps no store; give staleness > 1 (Stale-SB) or leave store_path "
                f"out, but got store_path={store_path!r} with staleness=1"
            )
        self.stale_cdf = stale_cdf
        self.drift_bound = (
            None
            if drift_bound is None
            else check_float("drift_bound", drift_bound, low=0.0, high=1.0, low_open=True)
        )
        # NOTE: a bound other than the default where no stale epoch is judged by it (plain SB,
        # or stale epochs ranked against the store, whose rate holds by construction) would be
        # ignored; None is accepted anywhere (no bound is what those runs have).
        if self.drift_bound is not None and self.drift_bound != DRIFT_BOUND:
            if self.staleness == 1:
                raise ValueError(
                    "drift_bound bounds the kept share of Stale-SB's stale epochs, and "
                    "staleness=1 has no stale epochs (a selection pass runs every epoch); give "
                    f"staleness > 1 (Stale-SB) or leave drift_bound out, but got "
                    f"drift_bound={drift_bound!r} with staleness=1"
                )
            if stale_cdf != "window":
                raise ValueError(
                    "drift_bound bounds the kept share of stale epochs ranked against the "
                    "window (stale_cdf='window'), and stale_cdf='store' keeps the selectivity "
                    "by construction, so the bound is never used; leave drift_bound out or use "
                    f"stale_cdf='window', but got drift_bound={drift_bound!r} with "
                    f"stale_cdf={stale_cdf!r}"
                )
        # The CDF above which P is 0 and the exponent below it (see trim_top).
        self._cut = 1.0 - self.trim_top
        cut_beta = self._cut * (self.beta + 1.0) - 1.0
        # (at trim_top = 1 - selectivity the exponent is 0, give or take float's 1e-16)
        self._cut_beta = self.beta if self.trim_top == 0 else 0.0 if cut_beta < 1e-12 else cut_beta
        if store_path is not None and not isinstance(store_path, (str, os.PathLike)):
            raise TypeError(
                "store_path should be a folder to memory-map the per-example store in (a str or "
                f"os.PathLike), or None to keep it in memory, but got store_path={store_path!r}"
            )
        self.store_path = store_path
        self.store_snapshots = (
            None
            if store_snapshots is None
            else check_int("store_snapshots", store_snapshots, minimum=1)
        )
        self.store: ExampleStore | None = None
        # Whether the store belongs to this run: begun in, or loaded from a state (a store
        # reopened from an earlier run's files is cleared when the first epoch begins, as is
        # one loaded from a state saved before its first use).
        self._store_adopted = False
        self._clear_at_adoption = False
        self._key = 0
        self._start_run()

    def _start_run(self) -> None:
        """The run's state as it begins: an empty window, the pass schedule from epoch 0, the
        ramp from its start (the store is the caller's: see :meth:`attach`)."""
        self.window = LossWindow(self.window.size)
        #: The window of ``decisions="device"`` (the host window is not used then).
        self.device_window = DeviceWindow(self.window.size)
        self._uniform_share = 1.0 if self.ramp_epochs > 0 else 0.0
        #: Selection passes run early because the stored losses drifted (see ``drift_bound``).
        self.drift_passes = 0
        # The stored losses (a sorted spread sample) as the last selection pass left them, which
        # the stale epochs after it are judged against (see _drifted).
        self._reference: np.ndarray | None = None
        # The pass schedule (state): the last epoch with a pass, whether the losses of the
        # epoch before the current one were reported, the epoch begun and its decision.
        self._last_fresh: int | None = None
        self._fed = False
        self._begun: int | None = None
        self._fresh = True
        self._epoch = 0

    @property
    def selectivity(self) -> float:
        """The expected kept fraction, 1 / (beta + 1), of a continuous CDF (with the window's
        discrete one, slightly more: see ``history``)."""
        return 1.0 / (self.beta + 1.0)

    @property
    def target_rate(self) -> float:
        return self.selectivity

    @property
    def history(self) -> int:
        """R, the window size."""
        return self.window.size

    @property
    def uniform_share(self) -> float:
        """u, the share of uniform keeping in the P of the next decision with losses (the
        ramp; 0 once it is over, or without ``ramp_epochs``)."""
        return self._uniform_share

    def advance(self, position: float) -> None:
        if self.ramp_epochs > 0:
            self._uniform_share = min(1.0, max(0.0, 1.0 - float(position) / self.ramp_epochs))

    def needs_indices(self) -> bool:
        return self.staleness > 1

    def normalize_weights(self) -> bool:
        return self.reweight

    def attach(self, num_examples: int | None, key: int) -> None:
        """A new loader's run: the window, the pass schedule and the store start afresh (a
        state loaded next restores them), also for a policy reused from an earlier run.

        NOTE: a policy reused without this began the new run in its old schedule (a stale first
        epoch, kept against the old run's losses, or against an empty store of another size:
        every example kept, no selection pass)."""
        self._key = int(key)
        self._start_run()
        if self.store is not None and self._store_adopted:
            # (the store an earlier run used: cleared at its first use, unless a state loads)
            self._store_adopted, self._clear_at_adoption = False, True
        if self.staleness == 1:
            return
        if num_examples is None:
            raise ValueError(
                f"SelectiveBackprop(staleness={self.staleness}) stores each example's loss by "
                "dataset index, so it needs the dataset's size, which this source does not "
                "give; pass dataset_size= to the SelectiveLoader (an iterable source), use a "
                f"DataLoader over a map-style dataset, or a policy without a store: {NO_STORE_FIX}"
            )
        if self.store is None or len(self.store) != num_examples:
            if self.store is not None:
                # (the folder let go first: the new store is of another size)
                self.store.close()
                self.store = None
            self.store = ExampleStore(num_examples, self.store_path, self.store_snapshots)
            self._store_adopted = False

    def _adopt_store(self) -> None:
        """Make the store this run's, at its first use (an epoch begun, or losses reported
        during a :class:`Phased` warm-up) unless a state was loaded into it (one saved after
        that first use: see :meth:`state_dict`).

        NOTE (store_path): a run that begins without loading a state starts with an empty
        store. Files an earlier run left in the folder would otherwise be its losses and
        selection counts; a resumed run (load_state_dict) continues from its state's snapshot
        of them instead (see :class:`~sbloader.store.ExampleStore`).
        """
        if self.store is not None and not self._store_adopted:
            if self.store.reopened or self._clear_at_adoption:
                self.store.clear()
            self._store_adopted = True
            self._clear_at_adoption = False

    def _due(self, epoch: int) -> bool:
        """Whether ``epoch`` would run a selection pass if it began now."""
        if self._last_fresh is None:  # epochs 0, n, 2n, ... until the first pass
            return epoch % self.staleness == 0
        return epoch - self._last_fresh >= (self.fed_staleness if self._fed else self.staleness)

    def expected_stale_share(self) -> float | None:
        """The share of the scored examples a stale epoch would keep if the stored losses were
        ranked against those the last selection pass stored, before any report changed them
        (None before a pass, or without a store).

        NOTE (why not the window): under DDP with ``cdf="local"`` each rank's window holds its
        own losses, while every rank holds the same store; a judgement from the store alone is
        the same on every rank, so they agree on which epochs run a selection pass.
        """
        if self._reference is None or self.store is None or not len(self._reference):
            return None
        # NOTE: examples never scored are not sampled: those outside a loader's ``subset`` never
        # are, and any others are kept with P = 1 whatever the drift.
        stored, _ = self.store.spread_lookup(self.window.size)
        if not len(stored):
            return None
        p = rank_against(self._reference, stored, self._cut_beta, self._cut)
        p[stored == np.inf] = 1.0  # (kept for a non-finite loss, as the stale epochs keep it)
        return float(np.nan_to_num(p, nan=0.0).mean())

    def _drifted(self) -> bool:
        """Whether the epoch beginning, stale by the schedule, must run a selection pass instead:
        its expected kept share left ``[drift_bound * s, s / drift_bound]``.

        NOTE: with reported losses (``fed_staleness``) a stale phase can last many epochs, and
        its window stays as the last pass left it. Where the model improved much since (on a
        GPU, ResNet-18 at 1/3: seed 2 of ``benchmarks/results/gpu_frontier``), every reported
        loss ranks low against it: the examples trained on are never kept again, and the kept
        share fell from 1/3 to 2% (1,280 of 60,000 an epoch) and the run ended at 19% error.
        """
        if (
            self.drift_bound is None
            or self.staleness == 1
            or self.store is None
            or self.stale_cdf != "window"
            or self._last_fresh is None
        ):
            return False
        if self._reference is None:  # no report since the pass: the store is the pass's
            self._take_reference()
        share = self.expected_stale_share()
        s = self.selectivity
        if share is None or self.drift_bound * s <= share <= s / self.drift_bound:
            return False
        # NOTE: counted, not logged (no I/O in a policy): the epoch's stats show its pass.
        self.drift_passes += 1
        return True

    def _take_reference(self) -> None:
        """Keep the stored losses (a sorted spread sample) as the last selection pass left them,
        before any report changes them: what the stale epochs' window was made from."""
        assert self.store is not None
        sample = self.store.spread_sample(self.window.size)
        self._reference = np.sort(sample[np.isfinite(sample)])

    def needs_losses(self, epoch: int) -> bool:
        if self.staleness == 1:
            return True
        return self._fresh if epoch == self._begun else self._due(epoch)

    def begin_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._adopt_store()
        # NOTE: idempotent for the epoch already begun: a resumed epoch keeps its decision.
        if epoch != self._begun:
            self._fresh = self._due(epoch) or self._drifted()
            if self._fresh:
                self._last_fresh = epoch
                self._reference = None
            self._fed = False  # the reports of this epoch arrive when the next one starts
            self._begun = epoch
            if not self._fresh and self.stale_cdf == "store" and self.store is not None:
                # NOTE: once, as the epoch begins (before the prefetch thread reads the window);
                # a resumed epoch keeps the window its state saved. The next selection pass then
                # begins with this window, not the one the last pass left: its first ``history``
                # losses are ranked against the stored losses (fed-back training losses among
                # them), which are newer than that pass's, until its own losses replace them.
                self.window.refill(self.store.spread_sample(self.window.size))
        # NOTE: the threading contract (see Policy): in a stale epoch prefilter reads the window
        # on the prefetch thread, so nothing may change it until the next fresh epoch.
        self.window.frozen = self.can_prefilter()

    def records_examples(self) -> bool:
        return self.staleness > 1

    def can_prefilter(self) -> bool:
        return not self.needs_losses(self._epoch) and self.store is not None

    def kind(self) -> str:
        fed = ""
        if self.fed_staleness != self.staleness:
            fed = f", fed_staleness={self.fed_staleness}"
        if self.ramp_epochs:
            fed += f", ramp_epochs={self.ramp_epochs:g}"
        if self.trim_top:
            fed += f", trim_top={self.trim_top:g}"
        if self.stale_cdf != "window":
            fed += f", stale_cdf={self.stale_cdf!r}"
        if self.drift_bound != DRIFT_BOUND and self.staleness > 1:
            fed += f", drift_bound={self.drift_bound}"
        return f"SelectiveBackprop(staleness={self.staleness}{fed})"

    def takes_feedback(self) -> bool:
        return self.store is not None

    def writes_state_files(self) -> bool:
        return self.store_path is not None

    def keep_saved_files(self, state: dict[str, Any]) -> None:
        if self.store is not None and "store" in state:
            self.store.keep_spared(state["store"])

    def count_forced(self, indices: np.ndarray) -> None:
        if self.store is not None and len(indices):
            self.store.count_selected(indices)
        self.mark_forced(indices)

    def mark_forced(self, indices: np.ndarray) -> None:
        self._adopt_store()
        if self.store is not None and len(indices):
            self.store.mark_nonfinite(indices, self._epoch, kept=True)

    def count_skipped(self, indices: np.ndarray) -> None:
        self._adopt_store()
        if self.store is not None and len(indices):
            self.store.mark_nonfinite(indices, self._epoch)

    def feedback(self, indices: np.ndarray, losses: np.ndarray, epoch: int) -> None:
        """Training losses enter the store (by index; the window is left alone: it ranks
        selection-pass losses, which training losses of the hardest examples would skew)."""
        self._adopt_store()
        if self.store is not None and len(indices):
            if self._reference is None and self._last_fresh is not None:
                self._take_reference()  # before the first reports since the pass
            self.store.record(indices, losses, epoch)
            # (only a finite loss is stored: reports that were all NaN fed nothing, and the
            # epochs between passes stay those of an unfed policy)
            self._fed = self._fed or bool(np.isfinite(losses).any())

    def observe(self, losses: np.ndarray, indices: np.ndarray | None, *, cdf: bool = True) -> None:
        """Another rank's losses enter the window (if ``cdf``) and the store (by index)."""
        if cdf:
            self.window.push(losses)
        if self.store is not None and indices is not None:
            self.store.record(indices, losses, self._epoch)

    def probabilities(self, losses: np.ndarray) -> np.ndarray:
        """Add the losses to the window in order and return each one's P (NaN if not finite),
        as :meth:`choose` would keep them with: during a ramp (``ramp_epochs``), blended with
        uniform keeping at the same rate (see :attr:`uniform_share`)."""
        p = self.window.push_and_rank(losses, self._cut_beta, self._cut)
        u = self._uniform_share
        if u > 0.0:  # (the kernel's arithmetic, in its order: the same P as choose's)
            p = u * self._cut / (self._cut_beta + 1.0) + (1.0 - u) * p
        return p

    def stale_probabilities(self, indices: np.ndarray) -> np.ndarray:
        """P of each example from its stored loss, without changing the window.

        NOTE: an example never scored yet (no finite stored loss) gets P = 1: it is selected,
        never silently skipped.
        """
        stored, measured = self._stale_store().lookup(indices)
        p = self.window.rank(stored, self._cut_beta, self._cut)
        p[measured < 0] = 1.0
        p[stored == np.inf] = 1.0  # a non-finite loss, kept where it was measured (mark_forced)
        p[np.isnan(p)] = 0.0  # a non-finite loss, skipped where it was measured (count_skipped)
        return p

    def _stale_store(self) -> ExampleStore:
        """The per-example store, which stale-epoch selection needs."""
        if self.store is None:
            raise ValueError(
                "stale-epoch selection needs the per-example store; give the policy "
                "staleness > 1 and use it through a SelectiveLoader"
            )
        return self.store

    def prefilter(self, indices: np.ndarray) -> np.ndarray:
        if not self.can_prefilter():
            raise RuntimeError(
                f"prefilter was called in epoch {self._epoch}, which is not a stale epoch of "
                f"{self!r}; call it only where can_prefilter() is True"
            )
        u = hashed_uniforms(self._key, self._epoch, indices)
        return u < self.stale_probabilities(indices)

    def choose(
        self,
        losses: np.ndarray | None,
        indices: np.ndarray | None,
        rng: np.random.Generator,
        n: int,
    ) -> Choice:
        # NOTE: one kernel call per batch (window, P, draw, positions, weights, store): the
        # uniforms are drawn here, as rng.random(n) always was, so choices are unchanged.
        store = self.store
        if store is not None:
            indices = check_indices("indices", indices)
        if losses is not None:
            p, positions, weights, outside = self.window.push_rank_and_draw(
                losses,
                rng.random(n),
                self._cut_beta,
                self.reweight,
                None if store is None else store.columns,
                indices,
                self._epoch,
                self._uniform_share,
                self._cut,
            )
        elif self.staleness > 1:
            store = self._stale_store()
            assert indices is not None  # (checked above: the policy has its store)
            p, positions, weights, outside = self.window.rank_and_draw_stored(
                store.columns,
                indices,
                hashed_uniforms(self._key, self._epoch, indices),
                self._cut_beta,
                self.reweight,
                self._cut,
            )
        else:
            raise ValueError("SelectiveBackprop needs selection losses, but got losses=None")
        if outside:
            assert store is not None and indices is not None
            store.check_outside(outside, indices)
        return Choice(positions, p, weights)

    def decides_on_device(self) -> bool:
        # NOTE: Stale-SB's per-example store lives on the host; its decisions stay there.
        return self.staleness == 1

    def choose_device(
        self, losses: torch.Tensor, generator: torch.Generator, nonfinite: str
    ) -> DeviceChoice:
        uniforms = torch.rand(
            losses.shape[0], generator=generator, dtype=torch.float64, device=losses.device
        )
        return self.device_window.push_rank_and_draw(
            losses,
            uniforms,
            self._cut_beta,
            reweight=self.reweight,
            nonfinite=nonfinite,
            uniform_share=self._uniform_share,
            cut=self._cut,
        )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "beta": self.beta,
            "reweight": self.reweight,
            "window": self.window.state_dict(),
        }
        if len(self.device_window):
            state["device_window"] = self.device_window.state_dict()
        if self.store is not None:
            state["store"] = self.store.state_dict()
            # NOTE: False for a state saved before the store's first use (a checkpoint at step
            # 0): a memory-mapped store's state is a snapshot of its files, which are then an
            # earlier run's, and the run resumed from it clears them at that first use, as this
            # run does.
            state["store_adopted"] = self._store_adopted
        state["schedule"] = {
            "last_fresh": self._last_fresh,
            "fed": self._fed,
            "begun": self._begun,
            "fresh": self._fresh,
            "reference": None if self._reference is None else torch.from_numpy(self._reference),
            "drift_passes": self.drift_passes,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if float(state["beta"]) != self.beta:
            raise ValueError(
                f"the saved SelectiveBackprop state has beta={state['beta']}, but this policy has "
                f"beta={self.beta}; construct the policy with the saved selectivity"
            )
        # NOTE: saved before reweight was state: not checked.
        if "reweight" in state and bool(state["reweight"]) != self.reweight:
            raise ValueError(
                f"the saved SelectiveBackprop state has reweight={bool(state['reweight'])}, but "
                f"this policy has reweight={self.reweight}; construct the policy with "
                f"reweight={bool(state['reweight'])}"
            )
        if "store" in state and self.store is None:
            raise ValueError(
                "the saved SelectiveBackprop state has a per-example store, but this policy "
                "has none; construct it with the saved staleness and attach it to a loader"
            )
        # NOTE (a refused state changes nothing): every part is read into new objects and
        # locals first; the store, whose own load is all-or-nothing, loads last, and only then
        # does the policy take the rest.
        window = LossWindow(self.window.size)
        window.load_state_dict(state["window"])
        window.frozen = self.window.frozen
        device_window = DeviceWindow(self.history)
        if "device_window" in state:
            device_window.load_state_dict(state["device_window"])
        device_window.to(self.device_window.device)
        schedule = state.get("schedule")
        if schedule is None:
            # NOTE: saved before the schedule was state, when passes ran in epochs 0, n, 2n...:
            # until the next pass, the schedule continues that way (see _due).
            schedule = {"last_fresh": None, "fed": False, "begun": None, "fresh": True}
        # NOTE: saved before drift_bound existed: no reference until the next stale phase.
        reference = schedule.get("reference")
        reference_array = (
            None
            if reference is None
            else np.asarray(torch.as_tensor(reference, dtype=torch.float64).numpy()).copy()
        )
        drift_passes = int(schedule.get("drift_passes", 0))
        last_fresh, begun = schedule["last_fresh"], schedule["begun"]
        fed, fresh = bool(schedule["fed"]), bool(schedule["fresh"])
        if "store" in state:
            assert self.store is not None
            self.store.load_state_dict(state["store"])
            # NOTE: saved before store_adopted was state: adopted. A state saved before the
            # store's first use holds an earlier run's files (or nothing): the run resumed from
            # it starts empty at that first use, as the saved run did, whatever the files are
            # by now (see _adopt_store).
            self._store_adopted = bool(state.get("store_adopted", True))
            self._clear_at_adoption = not self._store_adopted
        self.window, self.device_window = window, device_window
        self._last_fresh, self._fed, self._begun, self._fresh = last_fresh, fed, begun, fresh
        self._reference = reference_array
        self.drift_passes = drift_passes

    def __repr__(self) -> str:
        extra = f", staleness={self.staleness}" if self.staleness > 1 else ""
        if self.fed_staleness != self.staleness:
            extra += f", fed_staleness={self.fed_staleness}"
        extra += ", reweight=True" if self.reweight else ""
        extra += f", ramp_epochs={self.ramp_epochs:g}" if self.ramp_epochs else ""
        extra += f", trim_top={self.trim_top:g}" if self.trim_top else ""
        extra += f", stale_cdf={self.stale_cdf!r}" if self.stale_cdf != "window" else ""
        if self.drift_bound != DRIFT_BOUND and self.staleness > 1:
            extra += f", drift_bound={self.drift_bound}"
        return f"SelectiveBackprop(beta={self.beta:g}, history={self.history}{extra})"


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

    def uses_losses(self) -> bool:
        return False

    def ranks_shared_losses(self) -> bool:
        return False

    def choose(
        self,
        losses: np.ndarray | None,
        indices: np.ndarray | None,
        rng: np.random.Generator,
        n: int,
    ) -> Choice:
        return Choice.bernoulli(np.full(check_int("n", n, minimum=0), self.selectivity), rng)

    def settings(self) -> str:
        return f"selectivity={self.selectivity!r}"

    def __repr__(self) -> str:
        return f"RandomBackprop(selectivity={self.selectivity:g})"


class Kath18(Policy):
    """Katharopoulos & Fleuret (2018) importance sampling, as the Selective-Backprop paper ran it.

    Each source batch is a presampled pool of B candidates (make it b / selectivity examples);
    the selection pass scores the pool, and b = round(B * selectivity) examples are drawn from it
    with replacement, with probability proportional to their loss. Variable start: until the
    variance-reduction estimate tau (an exponential moving average of
    1 / sqrt(1 - ||g - u||^2 / ||g||^2), g the normalised losses and u = 1/B) exceeds
    tau_th = (B + 3b) / (3b), b examples are drawn uniformly without replacement instead.

    NOTE: the original code took the uniform phase's scores from the training forward; here the
    pool is scored by the selection pass in both phases, and that cost is counted.

    Args:
        selectivity: b / B, the fraction of each pool backpropagated, in (0, 1].
        tau_threshold: override tau_th (default: (B + 3b) / (3b) per pool).
        momentum: of tau's moving average (0.9 in the original).
        unbiased: weight each importance-sampled example by 1 / (B * p) so that the weighted mean
            loss is an unbiased estimate of the pool's mean loss (default True).

    Example:
        >>> import numpy as np
        >>> k = Kath18(selectivity=0.5, tau_threshold=1.0)
        >>> losses, rng = np.array([0.0, 0.0, 1.0, 3.0]), np.random.default_rng(0)
        >>> first = k.choose(losses, None, rng, 4)  # tau starts at 0: uniform
        >>> k.importance_sampling, round(k.tau, 3)
        (False, 0.158)
        >>> for _ in range(10):
        ...     c = k.choose(losses, None, rng, 4)
        >>> k.importance_sampling, set(c.positions.tolist()) <= {2, 3}  # zero loss: never drawn
        (True, True)
    """

    def __init__(
        self,
        selectivity: float = 1 / 3,
        *,
        tau_threshold: float | None = None,
        momentum: float = 0.9,
        unbiased: bool = True,
    ) -> None:
        self.selectivity = check_float("selectivity", selectivity, low=0.0, high=1.0, low_open=True)
        self.tau_threshold = (
            None if tau_threshold is None else check_float("tau_threshold", tau_threshold, low=0)
        )
        self.momentum = check_float("momentum", momentum, low=0.0, high=1.0, high_open=True)
        self.unbiased = check_bool("unbiased", unbiased)
        self.tau = 0.0
        self.importance_sampling = False

    @property
    def target_rate(self) -> float:
        return self.selectivity

    def settings(self) -> str:
        return (
            f"selectivity={self.selectivity!r}, tau_threshold={self.tau_threshold!r}, "
            f"momentum={self.momentum!r}, unbiased={self.unbiased}"
        )

    def ranks_shared_losses(self) -> bool:
        # (each pool is sampled from its own losses; tau's average is this rank's own)
        return False

    def check_losses(self, losses: np.ndarray) -> None:
        if (losses < 0).any():
            raise ValueError(
                "Kath18 samples in proportion to the loss, so losses should be >= 0, but got "
                f"min loss {losses.min():g}; pass loss_fn= a non-negative per-example loss"
            )

    def threshold(self, pool: int, b: int) -> float:
        """tau_th for a pool of ``pool`` candidates from which ``b`` are drawn."""
        if self.tau_threshold is not None:
            return self.tau_threshold
        return (pool + 3 * b) / (3 * b)

    def attach(self, num_examples: int | None, key: int) -> None:
        """A new loader's run: tau starts afresh (a state loaded next restores it), also for
        a policy reused from an earlier run."""
        self.tau = 0.0
        self.importance_sampling = False

    def update_tau(self, losses: np.ndarray) -> float:
        """Fold one pool's losses into tau's moving average and return the pool's estimate."""
        n = losses.shape[0]
        g = _shares(losses)
        if g is None:
            g = np.full(n, 1.0 / n)
        # ||g - u||^2 / ||g||^2 = 1 - 1 / (n ||g||^2), so the estimate is sqrt(n ||g||^2).
        estimate = float(np.sqrt(n * np.dot(g, g)))
        self.tau = self.momentum * self.tau + (1 - self.momentum) * estimate
        return estimate

    def choose(
        self,
        losses: np.ndarray | None,
        indices: np.ndarray | None,
        rng: np.random.Generator,
        n: int,
    ) -> Choice:
        if losses is None:
            raise ValueError("Kath18 needs selection losses, but got losses=None")
        if losses.shape != (n,):
            raise ValueError(
                f"losses should hold one loss per candidate ({n}), but got shape "
                f"{tuple(losses.shape)}"
            )
        if n == 0:
            return Choice.everything(0)
        if not np.isfinite(losses).all():
            # (a NaN made the pool's shares NaN, and the pool was drawn uniformly, unsaid;
            # SelectiveLoader passes finite losses only: its nonfinite= decides the others)
            raise ValueError(
                "Kath18 samples in proportion to the loss, so losses should be finite, but got "
                f"{int((~np.isfinite(losses)).sum())} non-finite; pass the finite ones"
            )
        self.check_losses(losses)
        b = max(1, round(n * self.selectivity))
        # As in the original: the decision uses tau from earlier pools, then this pool updates it.
        self.importance_sampling = self.tau > self.threshold(n, b)
        self.update_tau(losses)
        p = _shares(losses)
        if not self.importance_sampling or p is None:
            positions = np.sort(rng.choice(n, size=min(b, n), replace=False)).astype(np.int64)
            return Choice(positions, np.full(n, min(b, n) / n), np.ones(len(positions)))
        positions = np.sort(rng.choice(n, size=b, replace=True, p=p)).astype(np.int64)
        weights = 1.0 / (n * p[positions]) if self.unbiased else np.ones(b)
        inclusion = 1.0 - (1.0 - p) ** b  # probability of being drawn at least once
        return Choice(positions, inclusion, weights)

    def state_dict(self) -> dict[str, Any]:
        return {"tau": self.tau, "importance_sampling": self.importance_sampling}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tau = float(state["tau"])
        self.importance_sampling = bool(state["importance_sampling"])

    def __repr__(self) -> str:
        return f"Kath18(selectivity={self.selectivity:g})"


def _shares(losses: np.ndarray) -> np.ndarray | None:
    """Each non-negative loss's share of the pool's total, or None where every loss is 0.

    NOTE: scaled by the largest loss first: the total of losses near float64's largest (1e308)
    overflowed to inf and every share was 0 or NaN (numpy's "probabilities contain NaN", and
    tau's estimate 0); scaled, the total is at most the pool's size, and the shares are
    those of the losses divided by any constant.
    """
    top = losses.max() if losses.shape[0] else 0.0
    if not top > 0:
        return None
    scaled = losses / top
    return scaled / scaled.sum()


class Phased(Policy):
    """Run ``policy`` only between a warm-up and an annealing phase.

    During the first ``warmup_epochs`` epochs ``warmup_policy`` decides (default
    :class:`Traditional`: every example, as the authors' code did in its first epoch), and from
    ``anneal_from_epoch`` on every example is backpropagated (InfoBatch trains on everything in
    its final epochs to keep final accuracy). The wrapped policy sees epochs counted from the end
    of the warm-up, so Stale-SB's first active epoch is a fresh one.

    NOTE: loss-based selection from a random initialisation can collapse at learning rates that
    train well without it: the model predicts one class, the selection keeps only the examples
    of other classes, and the next steps chase another class (measured: SB at selectivity 1/4
    and lr 0.05 on Fashion-MNIST ends at chance). A warm-up lets the model learn coarse features
    first; ``warmup_policy=RandomBackprop(s)`` makes that warm-up as cheap as the selection that
    follows it.

    Args:
        policy: the policy to run in between.
        warmup_epochs: epochs decided by ``warmup_policy`` first. Epochs here are passes over
            the data (``loader.epoch``), also where ``batches_per_epoch`` cuts training epochs
            of another length.
        anneal_from_epoch: the first epoch (0-based, counted like ``loader.epoch``) of Traditional
            training at the end; None for no annealing.
        warmup_policy: the policy of the warm-up epochs; it must need no selection losses and no
            per-example records (e.g. :class:`Traditional` or :class:`RandomBackprop`). Default
            :class:`Traditional`.

    Example:
        >>> p = Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, anneal_from_epoch=9)
        >>> [p.needs_losses(e) for e in (0, 1, 8, 9)]
        [False, True, True, False]
        >>> cheap = Phased(SelectiveBackprop(1 / 3), warmup_epochs=1,
        ...                warmup_policy=RandomBackprop(1 / 3))
        >>> cheap.begin_epoch(0); round(cheap.target_rate, 3)
        0.333
    """

    def __init__(
        self,
        policy: Policy,
        *,
        warmup_epochs: int = 0,
        anneal_from_epoch: int | None = None,
        warmup_policy: Policy | None = None,
    ) -> None:
        check_policy("policy", policy, "sbloader.SelectiveBackprop(1/3)")
        given_warmup = warmup_policy is not None
        warmup_policy = Traditional() if warmup_policy is None else warmup_policy
        check_policy("warmup_policy", warmup_policy, "sbloader.RandomBackprop(1/3)")
        # NOTE: uses_losses (any epoch), not needs_losses(0): Phased makes no selection pass in
        # its warm-up, so a warm-up policy that needs losses only later (itself a Phased, say)
        # would fail after the first epoch instead of here.
        if warmup_policy.uses_losses() or warmup_policy.records_examples():
            raise ValueError(
                "warmup_policy should need no selection pass in any epoch (e.g. Traditional() or "
                f"RandomBackprop(s)), but got warmup_policy={warmup_policy!r}; put a loss-based "
                "policy in policy= instead (a policy of your own that needs no losses says so "
                "by returning False from uses_losses())"
            )
        self.policy = policy
        self.warmup_policy = warmup_policy
        self.warmup_epochs = check_int("warmup_epochs", warmup_epochs, minimum=0)
        if given_warmup and self.warmup_epochs == 0:
            raise ValueError(
                f"warmup_policy={warmup_policy!r} decides only the first warmup_epochs epochs, "
                "but got warmup_epochs=0, so it would never run (and the wrapped policy would "
                "select by loss from a random initialisation); pass warmup_epochs >= 1 or leave "
                "warmup_policy out"
            )
        self.anneal_from_epoch = (
            None
            if anneal_from_epoch is None
            else check_int("anneal_from_epoch", anneal_from_epoch, minimum=self.warmup_epochs)
        )
        if self.anneal_from_epoch == self.warmup_epochs:
            warnings.warn(
                f"Phased with anneal_from_epoch={self.anneal_from_epoch} right after its "
                f"warmup_epochs={self.warmup_epochs} never runs {policy!r}: the warm-up's "
                "epochs are followed by Traditional training; pass anneal_from_epoch > "
                "warmup_epochs (or None)",
                UserWarning,
                stacklevel=2,
            )
        self._epoch = 0

    def active(self, epoch: int) -> bool:
        """Whether the wrapped policy runs in ``epoch``."""
        after_warmup = epoch >= self.warmup_epochs
        before_anneal = self.anneal_from_epoch is None or epoch < self.anneal_from_epoch
        return after_warmup and before_anneal

    def _current(self, epoch: int) -> Policy | None:
        """The policy deciding in ``epoch``: the wrapped one, the warm-up's, or None (anneal)."""
        if self.active(epoch):
            return self.policy
        return self.warmup_policy if epoch < self.warmup_epochs else None

    def needs_indices(self) -> bool:
        return self.policy.needs_indices() or self.warmup_policy.needs_indices()

    def normalize_weights(self) -> bool:
        current = self._current(self._epoch)
        return current is not None and current.normalize_weights()

    def kind(self) -> str:
        return f"Phased({self.policy.kind()}, warmup_policy={self.warmup_policy.kind()})"

    def settings(self) -> str:
        # NOTE: anneal_from_epoch is left out: a resumed run may be planned longer or shorter
        # than it was (default_policy(epochs=) of another length), which moves the anneal.
        return (
            f"warmup_epochs={self.warmup_epochs}; policy: {self.policy.settings()}; "
            f"warmup_policy: {self.warmup_policy.settings()}"
        )

    @property
    def target_rate(self) -> float:
        current = self._current(self._epoch)
        return 1.0 if current is None else current.target_rate

    @property
    def steady_rate(self) -> float:
        """The wrapped policy's rate: what it keeps between the warm-up and the anneal."""
        return self.policy.steady_rate

    def epoch_rate(self, epoch: int) -> float:
        # NOTE: by ``epoch``, not by the epoch last begun (target_rate's): between two epochs
        # the loader asks for the next one's, and read from the last one's, the first pass of
        # the anneal was estimated at the selective rate (a third of its batches).
        if self.active(epoch):
            return self.policy.epoch_rate(epoch - self.warmup_epochs)
        return self.warmup_policy.epoch_rate(epoch) if epoch < self.warmup_epochs else 1.0

    def attach(self, num_examples: int | None, key: int) -> None:
        # (a new run starts in epoch 0: reused from an earlier run, the policy reported that
        # run's phase, its target_rate and so loader.expected_batches(), until epoch 0 began)
        self._epoch = 0
        self.policy.attach(num_examples, key)
        self.warmup_policy.attach(num_examples, key)

    def needs_losses(self, epoch: int) -> bool:
        return self.active(epoch) and self.policy.needs_losses(epoch - self.warmup_epochs)

    def uses_losses(self) -> bool:
        return self.policy.uses_losses()

    def check_losses(self, losses: np.ndarray) -> None:
        self.policy.check_losses(losses)

    def begin_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        if self.active(epoch):
            self.policy.begin_epoch(epoch - self.warmup_epochs)
        elif epoch < self.warmup_epochs:
            self.warmup_policy.begin_epoch(epoch)

    def advance(self, position: float) -> None:
        # The wrapped policy counts positions from the end of the warm-up, as its epochs.
        if self.active(self._epoch):
            self.policy.advance(position - self.warmup_epochs)

    def can_prefilter(self) -> bool:
        return self.active(self._epoch) and self.policy.can_prefilter()

    def prefilter(self, indices: np.ndarray) -> np.ndarray:
        return self.policy.prefilter(indices)

    def records_examples(self) -> bool:
        return self.policy.records_examples()

    def ranks_shared_losses(self) -> bool:
        # NOTE: the wrapped policy's, in every epoch: whether a round makes the loss exchange
        # must be the same on every rank and in every round, and a static answer is. The
        # warm-up policy needs no losses (checked in __init__); in its epochs and the anneal's
        # a round's exchange carries none, one all_gather of two integers (observe passes
        # nothing on outside the active epochs).
        return self.policy.ranks_shared_losses()

    def takes_feedback(self) -> bool:
        return self.policy.takes_feedback()

    def parts(self) -> list[Policy]:
        return [self, *self.policy.parts(), *self.warmup_policy.parts()]

    def keep_saved_files(self, state: dict[str, Any]) -> None:
        self.policy.keep_saved_files(state["policy"])
        self.warmup_policy.keep_saved_files(state.get("warmup", {}))

    def count_forced(self, indices: np.ndarray) -> None:
        # NOTE: like choose: only the policy deciding from losses (the wrapped one) gets them.
        if self.active(self._epoch):
            self.policy.count_forced(indices)

    def count_skipped(self, indices: np.ndarray) -> None:
        if self.active(self._epoch):
            self.policy.count_skipped(indices)

    def mark_forced(self, indices: np.ndarray) -> None:
        if self.active(self._epoch):
            self.policy.mark_forced(indices)

    def feedback(self, indices: np.ndarray, losses: np.ndarray, epoch: int) -> None:
        # NOTE: also from warm-up epochs (recorded as the wrapped policy's epoch 0): the store
        # is the wrapped policy's, whichever policy chose the examples.
        self.policy.feedback(indices, losses, max(epoch - self.warmup_epochs, 0))

    def observe(self, losses: np.ndarray, indices: np.ndarray | None, *, cdf: bool = True) -> None:
        # NOTE: like choose, only while active, so that windows stay identical across ranks.
        if self.active(self._epoch):
            self.policy.observe(losses, indices, cdf=cdf)

    def choose(
        self,
        losses: np.ndarray | None,
        indices: np.ndarray | None,
        rng: np.random.Generator,
        n: int,
    ) -> Choice:
        current = self._current(self._epoch)
        if current is None:
            return Choice.everything(n)
        return current.choose(losses, indices, rng, n)

    def decides_on_device(self) -> bool:
        return self.policy.decides_on_device()

    def choose_device(
        self, losses: torch.Tensor, generator: torch.Generator, nonfinite: str
    ) -> DeviceChoice:
        # Only the wrapped policy needs selection losses (the warm-up policy needs none).
        return self.policy.choose_device(losses, generator, nonfinite)

    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.state_dict(),
            "warmup": self.warmup_policy.state_dict(),
            "epoch": self._epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.warmup_policy.load_state_dict(state.get("warmup", {}))
        # NOTE: the epoch last begun decides target_rate and normalize_weights (and so
        # loader.expected_batches()) until the next begin_epoch; not restored, a resumed run
        # read its warm-up's rate there, where the uninterrupted run read its phase's. (Absent
        # from states saved before it was kept: left as it is.)
        if "epoch" in state:
            self._epoch = int(state["epoch"])

    def __repr__(self) -> str:
        warm = (
            ""
            if isinstance(self.warmup_policy, Traditional)
            else f", warmup_policy={self.warmup_policy!r}"
        )
        return (
            f"Phased({self.policy!r}, warmup_epochs={self.warmup_epochs}, "
            f"anneal_from_epoch={self.anneal_from_epoch}{warm})"
        )


def default_policy(
    has_store: bool = True,
    epochs: int | None = None,
    ramp_epochs: float = 0.0,
    trim_top: float = 0.0,
    stale_cdf: str = "window",
    selectivity: float = 1 / 3,
    anneal_share: float = ANNEAL_SHARE,
    drift_bound: float | None = DRIFT_BOUND,
) -> Policy:
    """The policy of ``SelectiveLoader(source, model)`` with no ``policy=``: the recipe that
    measured fastest to every target here (README, Measured), not the paper's plain SB.

    ``Phased(SelectiveBackprop(1/3, staleness=3, fed_staleness=10), warmup_epochs=1,
    warmup_policy=RandomBackprop(1/3))``: one Random-Backprop epoch (no selection pass; from a
    random initialisation loss-based selection can collapse), then Stale-SB keeping a third. The
    epochs between selection passes decide each example from its stored loss. A training loop
    that reports its losses (:meth:`SelectiveLoader.feedback
    <sbloader.SelectiveLoader.feedback>`) keeps those fresh, and then a pass runs only every tenth
    epoch; one that does not gets a pass every third epoch. Either way a stale epoch that would
    keep less than half the selectivity (or more than twice), judged from the stored losses
    against those of the last pass, runs a pass instead (``drift_bound=0.5`` of
    :class:`SelectiveBackprop`; measured on a GPU, a ten-epoch stale phase without it let the kept
    share fall to 2%). Without a per-example store
    (``has_store=False``: the source gives no dataset indices, or not the dataset's size), every
    active epoch runs a selection pass.

    With ``epochs`` (the planned epochs of the run), the last eighth of them (at least one) train
    on all the data (InfoBatch's annealing): measured here (the CNN, three seeds), that one full
    epoch at the end of 10 brought the recipe to Traditional-10's final error in one seed (2.1x
    sooner) and to within 0.2-0.5 points of it in the other two
    (``benchmarks/results/MEASURED.md``, "The frontier").
    ``SelectiveLoader(source, model)`` cannot know the run's length, so its default anneals only
    when given ``planned_epochs=E`` (the same as ``policy=sbloader.default_policy(epochs=E)``).
    ``epochs`` here are passes over the data (``loader.epoch``); with ``batches_per_epoch=``
    the loader's ``planned_epochs`` counts training epochs of that many batches instead, and
    the loader passes this function the passes they are expected to make
    (:func:`passes_within`, ``loader.planned_passes``), an annealed pass yielding about
    ``1 / selectivity`` times a selective one's batches.

    ``ramp_epochs`` is the Stale-SB's :class:`SelectiveBackprop` ``ramp_epochs``: its selection
    ramped in from uniform over that many epochs after the warm-up (at most 1 with the store).
    ``trim_top`` is its ``trim_top``: the highest losses never kept (for noisy labels). With
    noisy labels leave ``epochs`` out: the annealed epochs train on every example, the flipped
    ones included, at the lowest learning rate (measured here with 10% of the labels flipped,
    three seeds: 8.79-9.58% final error annealed, 8.07-8.47% not; README, Measured).
    ``stale_cdf`` is its ``stale_cdf``: what stale epochs rank stored losses against (unused
    without a store, where every active epoch makes a selection pass).
    ``selectivity`` is the share kept, by the Stale-SB and by the Random-Backprop warm-up alike
    (1/3 by default; a larger share trades speed for final accuracy). ``anneal_share`` is the
    share of the planned ``epochs`` annealed on all the data (1/8 by default, InfoBatch's;
    unused without ``epochs``): ``round(epochs * anneal_share)`` epochs, at least one, rounded
    as Python's ``round`` does (a half to the even number: 2 of 20 epochs, 6 of 44).
    ``drift_bound`` is the Stale-SB's ``drift_bound`` (unused without a store).

    The paper's plain SB is ``SelectiveBackprop(1 / 3)``.

    Example:
        >>> p = default_policy()
        >>> p.policy.staleness, p.policy.fed_staleness, p.warmup_epochs
        (3, 10, 1)
        >>> default_policy(has_store=False).policy.staleness
        1
        >>> default_policy(epochs=10).anneal_from_epoch, default_policy(epochs=16).anneal_from_epoch
        (9, 14)
    """
    warmup = 1
    anneal = None
    has_store = check_bool("has_store", has_store)
    selectivity = check_float("selectivity", selectivity, low=0.0, high=1.0, low_open=True)
    anneal_share = check_float(
        "anneal_share", anneal_share, low=0.0, high=1.0, low_open=True, high_open=True
    )
    if epochs is not None:
        epochs = check_int("epochs", epochs, minimum=warmup + 1)
        anneal = _anneal_from(epochs, anneal_share, warmup)
        if anneal == warmup:
            warnings.warn(
                f"default_policy(epochs={epochs}, anneal_share={anneal_share:g}) leaves no "
                f"selective epoch: epoch 0 is the Random-Backprop warm-up and epochs {warmup} to "
                f"{epochs - 1}, the annealed end (at least one epoch), train on all the data; "
                "plan more epochs or a smaller anneal_share",
                UserWarning,
                stacklevel=2,
            )
    ramp_epochs = check_float("ramp_epochs", ramp_epochs, low=0.0)
    if has_store and ramp_epochs > 1:
        # NOTE: refused here, naming what default_policy takes: the Stale-SB's own refusal
        # named staleness=, which default_policy has no argument for.
        raise ValueError(
            f"default_policy's ramp_epochs should be at most 1 with a per-example store (its "
            "Stale-SB makes a selection pass only in its first epoch, which the ramp must end "
            f"in), but got ramp_epochs={ramp_epochs:g}; pass ramp_epochs <= 1, or for a longer "
            "ramp has_store=False (a selection pass in every epoch after the warm-up)"
        )
    # (checked also where they go unused, without a store: a typo is never accepted silently)
    check_choice("stale_cdf", stale_cdf, STALE_CDFS)
    if drift_bound is not None:
        check_float("drift_bound", drift_bound, low=0.0, high=1.0, low_open=True)
    with warnings.catch_warnings():  # (warned above, naming default_policy's arguments)
        warnings.simplefilter("ignore", UserWarning)
        return Phased(
            SelectiveBackprop(
                selectivity,
                staleness=3,
                fed_staleness=10,
                ramp_epochs=ramp_epochs,
                trim_top=trim_top,
                stale_cdf=stale_cdf,
                drift_bound=drift_bound,
            )
            if has_store
            else SelectiveBackprop(selectivity, ramp_epochs=ramp_epochs, trim_top=trim_top),
            warmup_epochs=warmup,
            warmup_policy=RandomBackprop(selectivity),
            anneal_from_epoch=anneal,
        )


def _anneal_from(epochs: int, anneal_share: float, warmup: int = 1) -> int:
    """:func:`default_policy`'s first annealed epoch of ``epochs``: the last ``anneal_share`` of
    them (Python's ``round``, a half to even; at least one) anneal, none of the ``warmup``
    epochs.

    NOTE: kept as Python rounds (halves to even, unlike ``prune``'s halves up): runs measured
    with 20 planned epochs annealed 2, and a state saved before must resume with the same plan.
    """
    return max(warmup, epochs - max(1, round(epochs * anneal_share)))


def passes_within(
    training_batches: float,
    steady_batches: float,
    full_batches: float,
    anneal_share: float = ANNEAL_SHARE,
) -> int | None:
    """The most passes over the data ``P >= 2`` whose expected batches under
    ``default_policy(epochs=P, anneal_share=anneal_share)`` fit within ``training_batches``;
    None where not even two passes fit.

    A plan of ``P`` passes anneals ``A`` of them (:func:`default_policy`'s last ``anneal_share``,
    at least one), each expected to yield ``full_batches`` (all the data), and keeps the steady
    rate in the other ``P - A`` (the warm-up's rate is the same), each expected to yield
    ``steady_batches``: ``(P - A) * steady_batches + A * full_batches`` batches in all. This is
    how ``SelectiveLoader(planned_epochs=E, batches_per_epoch=n)`` turns ``E`` training epochs of
    ``n`` batches (``training_batches = E * n``) into the passes its default policy plans for.

    Example:
        >>> # 8 training epochs of "expected" batches (2048 examples at 1/3, batches of 64): 5
        >>> # passes at 1/3 and one annealed pass, about 3 training epochs on its own.
        >>> passes_within(8 * 11, 2048 / 3 / 64, 2048 / 64)
        6
        >>> passes_within(80 * 11, 2048 / 3 / 64, 2048 / 64)  # 8 of them annealed
        66
        >>> passes_within(3 * 11, 2048 / 3 / 64, 2048 / 64) is None  # one pass + an anneal: 43
        True
    """
    steady = check_float("steady_batches", steady_batches, low=0.0, low_open=True)
    full = check_float("full_batches", full_batches, low=0.0, low_open=True)
    budget = float(training_batches)

    def fits(passes: int) -> bool:
        expected = plan_batches(passes, _anneal_from(passes, anneal_share), steady, full)
        return expected <= budget * (1 + 1e-9)

    if not fits(2):
        return None
    passes = 2  # expected() grows by steady or full batches with each pass
    while fits(passes + 1):
        passes += 1
    return passes


def plan_batches(
    passes: int, anneal_from: int, steady_batches: float, full_batches: float
) -> float:
    """The expected batches of a plan of ``passes`` passes over the data whose passes from
    ``anneal_from`` on are annealed (all the data, ``full_batches`` each) and the others keep the
    steady rate (``steady_batches`` each; a warm-up's rate is the same): the count
    :func:`passes_within` fits to a budget.

    Example:
        >>> round(plan_batches(6, 5, 2048 / 3 / 64, 2048 / 64), 2)  # 5 passes at 1/3, 1 annealed
        85.33
    """
    return anneal_from * steady_batches + (passes - anneal_from) * full_batches
