"""The selection pass of a loader: which model scores candidates, how, and what it keeps.

A :class:`Scorer` owns what a selection pass needs across epochs: the model (or a separate
selector), the per-example loss, the speed options (:class:`~sbloader.selection.SelectionForward`:
compilation, downsampling, a frozen prefix), the frozen prefix's cross-epoch cache, and the
shape of the model's outputs for ``keep_logits``.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NoReturn

import numpy as np
import torch
from torch import nn

from . import batch as B
from ._state import check_version
from .features import FeatureCache, prefix_digest
from .precision import AUTO, forward_autocast, forward_autocast_refused
from .quantize import Int8Unavailable, QuantizedSelector
from .selection import (
    FieldsForward,
    SelectionForward,
    check_class_targets,
    concrete_device,
    downsample,
    features_as_float,
    has_lazy,
    is_fsdp,
    model_device,
    restrict,
    tensor_field,
    unused_fields,
    unwrap,
)
from .stats import EpochStats

logger = logging.getLogger("sbloader")

__all__ = ["Scored", "Scorer"]


@dataclass(frozen=True)
class Scored:
    """What one selection pass over a source batch computed.

    Attributes:
        losses: per-example losses where the model computed them.
        values: the same losses as float64 on the host, for the policy (None where the
            decisions run on the device: ``Scorer.host_values`` False).
        features: the frozen prefix's outputs for every candidate, or None without one.
        logits: the model's outputs for every candidate (``keep_logits``), else None.

    Example:
        >>> from sbloader.selection import SelectionForward
        >>> scorer = Scorer(nn.Linear(3, 2), nn.CrossEntropyLoss(reduction="none"), None,
        ...                 SelectionForward(), None, None, None, True, False)
        >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
        >>> scored = scorer.run(scorer.selection_model, x, y)
        >>> scored.losses.shape, scored.values.dtype, scored.features, scored.logits
        (torch.Size([4]), dtype('float64'), None, None)
        >>> scorer.host_values = False  # decisions="device": no host copy
        >>> scorer.run(scorer.selection_model, x, y).values is None
        True
    """

    losses: torch.Tensor
    values: np.ndarray | None
    features: torch.Tensor | None
    logits: torch.Tensor | None


class Scorer:
    """Runs a loader's selection passes.

    Args:
        model: the model being trained (the head, with a frozen prefix).
        loss_fn: per-example loss.
        selector: a separate model for selection passes, or None for ``model``.
        forward: how the selection model is called.
        feature_cache: the frozen prefix's cross-epoch cache, or None.
        autocast: the dtype to run selection passes in, or None.
        batch_size: examples per selection forward, or None for whole source batches.
        eval_selection: run selection passes in eval mode.
        keep_logits: keep the model's outputs for yielded batches.
        id_fields: the batch fields holding ids (dataset indices), no model inputs.
        quantized: the int8 copy that scores in the selection model's place
            (``quantize_selection``), or None.
        fallback_autocast: the precision to score in if a copy chosen by
            ``quantize_selection="auto"`` cannot be built (see :meth:`fall_back`).
        precision: what selection passes run in, and why (``loader.selection_precision``).

    Example:
        Five candidates scored in forwards of 2, the outputs kept (``keep_logits``):

        >>> from sbloader.selection import SelectionForward
        >>> scorer = Scorer(nn.Linear(3, 2), nn.CrossEntropyLoss(reduction="none"), None,
        ...                 SelectionForward(), None, None, 2, True, True)
        >>> stats = EpochStats()
        >>> x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1])
        >>> scored = scorer.score(x, y, np.arange(5), 0, stats)
        >>> scored.losses.shape, scored.logits.shape, scorer.logits_shape
        (torch.Size([5]), torch.Size([5, 2]), (2,))
        >>> stats.selection_forwards, stats.selection_calls, scorer.chunks(5)
        (5, 3, 3)
    """

    VERSION = 1

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        selector: nn.Module | None,
        forward: SelectionForward,
        feature_cache: FeatureCache | None,
        autocast: torch.dtype | None,
        batch_size: int | None,
        eval_selection: bool,
        keep_logits: bool,
        *,
        id_fields: tuple[Hashable, ...] = (),
        default_target: bool = False,
        quantized: QuantizedSelector | None = None,
        fallback_autocast: torch.dtype | None = None,
        precision: str = "",
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.selector = selector
        self.forward = forward
        self.feature_cache = feature_cache
        self.autocast = autocast
        self.batch_size = batch_size
        self.eval_selection = eval_selection
        self.keep_logits = keep_logits
        self.id_fields = id_fields
        #: Whether the loss target is the default field (no ``target_key`` given).
        self.default_target = default_target
        self.quantized = quantized
        self.fallback_autocast = fallback_autocast
        self.precision = precision
        self._fields_checked = False
        self._targets_checked = False  # (see _check_targets)
        #: Whether a selection pass copies its losses to the host (False: decisions="device").
        self.host_values = True
        # A pass's CUDA events and host seconds, while its GPU time is not yet known (only with
        # decisions="device"; see :meth:`settle_forward_time`).
        self._gpu_timing: tuple[torch.cuda.Event, torch.cuda.Event, float] | None = None
        #: The shape of one example's selection output (keep_logits), once a pass has shown it.
        self.logits_shape: tuple[int, ...] | None = None
        #: Whether a selection forward is a collective (an FSDP-sharded selection model): every
        #: rank must then run as many as the others, in the same rounds (see :meth:`pad`).
        self.collective = is_fsdp(selector if selector is not None else model)
        # Whether a selection model may still hold lazy parameters (see _inference).
        self._maybe_lazy = True
        if self.collective and forward.frozen_prefix is not None:
            raise ValueError(
                "frozen_prefix cannot be combined with an FSDP-sharded model (the prefix runs on "
                "the chosen rows only, a different number of forwards on each rank); pass "
                "frozen_prefix=None"
            )
        sync_bn = self.collective and any(
            isinstance(m, nn.SyncBatchNorm)
            for m in (selector if selector is not None else model).modules()
        )
        if sync_bn and not self.eval_selection:
            # NOTE: a train-mode SyncBatchNorm forward is a collective of its own; the padding
            # forwards (see pad) run in eval mode, where it makes none, so ranks would wait in
            # collectives the others never make.
            raise ValueError(
                "eval_selection=False cannot be combined with an FSDP-sharded model holding "
                "SyncBatchNorm (its train-mode forwards are collectives, which the ranks would "
                "make unevenly); pass eval_selection=True"
            )
        # One candidate (inputs, targets, batch) kept for padding forwards (collective only).
        self._template: tuple[Any, Any, Any] | None = None

    @property
    def has_prefix(self) -> bool:
        return self.forward.frozen_prefix is not None

    def check(self) -> None:
        """Refuse a frozen prefix that trains (checked when the loader is built and per epoch)."""
        self.forward.check(self.model, self.selector)

    def check_selector_device(self, device: torch.device) -> None:
        """Refuse a ``selector`` whose parameters (or buffers) are on another device than
        ``device``, where the loader puts the batches it scores (``ValueError`` naming both and
        the fix). Checked when the loader is built and when each epoch starts (the model may
        have been moved since, and the selector with it or not).

        NOTE: the selection pass calls the selector on the batches' device; before, a selector
        left on the CPU beside a model on a GPU was accepted, and the first selection pass failed
        in torch ("Expected all tensors to be on the same device"), naming neither the selector
        nor the fix.
        """
        selector = self.selector
        if selector is None:
            return
        inner = unwrap(selector)
        if next(iter((*inner.parameters(), *inner.buffers())), None) is None:
            return  # (no tensors of its own: it runs wherever its inputs are)
        where = model_device(inner)
        if concrete_device(where) != concrete_device(device):
            raise ValueError(
                f"selector should be on the device the loader scores batches on, {device} (the "
                f"model's, or device= when given), but its parameters are on {where}; move it "
                f"there (selector.to({str(device)!r})) before building the loader or starting "
                "the epoch"
            )

    def score(
        self,
        inputs: Any,
        targets: Any,
        indices: np.ndarray | None,
        epoch: int,
        stats: EpochStats,
        batch: Any = None,
    ) -> Scored:
        """One selection pass over a source batch, counted and timed in ``stats``.

        ``batch`` is the source batch's structure over its columns (a dict, tuple or list), which
        a ``forward=`` hook takes; without a hook, the model takes ``inputs`` alone, and a dict
        batch with other tensor fields is warned about once (see :meth:`check_fields`).
        """
        t0 = perf_counter()
        if not self._fields_checked:
            self._fields_checked = True
            self.check_fields(batch, inputs, targets, indices)
        cached = None
        if self.feature_cache is not None:
            cached = self._prefix_outputs(inputs, indices, None, epoch, stats)
        elif self.has_prefix:
            stats.prefix_forwards += inputs.shape[0]
        model = self.selection_model
        if self.quantized is not None:
            try:
                model = self.quantized.model_for(model, inputs, epoch, self._prepare)
            except (Int8Unavailable, TypeError) as e:
                self._int8_failed(e, model, inputs, targets)
        events = self._events(inputs)
        scored = self.run(model, inputs, targets, batch, cached)
        host_s = perf_counter() - t0
        stats.selection_forward_s += host_s
        if events is not None:
            events[1].record(torch.cuda.current_stream(inputs.device))
            self._gpu_timing = (events[0], events[1], host_s)
        self.count(scored, stats)
        return scored

    def _events(self, inputs: Any) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """A started pair of CUDA timing events where the losses stay on a GPU (inputs on a GPU
        and decisions="device"), else None."""
        if self.host_values or not isinstance(inputs, torch.Tensor) or not inputs.is_cuda:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(inputs.device))
        return start, end

    def settle_forward_time(self, stats: EpochStats) -> None:
        """Count the GPU time of the last pass's forward in ``selection_forward_s``, once the
        decision that followed it has synchronised (``decisions="device"`` on a GPU).

        NOTE: without a host copy of the losses, :meth:`score`'s clock stops when the forward is
        queued, and the GPU runs it while the decision waits for its two integers: that wait
        would count as the loader's own time. The forward's GPU time (between two events around
        it) replaces the queueing time where it is longer; no synchronisation is added.
        """
        timing, self._gpu_timing = self._gpu_timing, None
        if timing is None:
            return
        start, end, host_s = timing
        end.synchronize()  # done already: the decision copied two integers after the forward
        stats.selection_forward_s += max(0.0, start.elapsed_time(end) / 1e3 - host_s)

    @property
    def selection_model(self) -> nn.Module:
        """The (unwrapped) model selection passes score with: ``selector`` or ``model``."""
        return unwrap(self.selector if self.selector is not None else self.model)

    def count(self, scored: Scored, stats: EpochStats) -> None:
        """Count a selection pass's forwards and model calls in ``stats``."""
        n = scored.losses.shape[0]
        stats.selection_forwards += n
        stats.selection_calls += self.chunks(n)

    def run(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        batch: Any = None,
        features: torch.Tensor | None = None,
    ) -> Scored:
        """One selection pass of ``model`` over a source batch, with this scorer's options, and
        nothing counted (what :meth:`score` and an overlapped pass on the selection thread run;
        see :mod:`sbloader.overlap`)."""
        try:
            losses, features, logits = self.forward(
                model,
                inputs,
                targets,
                self.loss_fn,
                batch_size=self.batch_size,
                autocast_dtype=self.autocast,
                eval=self.eval_selection,
                features=features,
                keep_outputs=self.keep_logits,
                batch=batch,
                inference=self._inference(model),
            )
        except IndexError as e:
            self._blame_selector(e)
        self._check_targets(targets)
        self.keep_template(inputs, targets, batch)
        if logits is not None:
            self.logits_shape = tuple(logits.shape[1:])
        # NOTE: the policy needs the losses on the host anyway; copying them inside the timed
        # region makes the time exact on a GPU too (it waits for the forward to finish, and for
        # any training work still queued before it). With decisions="device" nothing is copied:
        # the forward's GPU time is counted once its decision has synchronised
        # (settle_forward_time).
        return Scored(losses, self._host_values(losses), features, logits)

    def restore(
        self, losses: torch.Tensor, logits: torch.Tensor | None, device: torch.device
    ) -> Scored:
        """A pass's result from its saved losses (and outputs), as :meth:`run` returned it:
        what a resumed run decides the source batch scored ahead from (``overlap_selection``)."""
        if logits is not None:
            self.logits_shape = tuple(logits.shape[1:])
            logits = logits.to(device)
        return Scored(losses.to(device), self._host_values(losses), None, logits)

    def _host_values(self, losses: torch.Tensor) -> np.ndarray | None:
        """The losses as float64 on the host for the policy (None: decisions="device")."""
        return _to_host(losses) if self.host_values else None

    def probe(
        self, inputs: Any, targets: Any, batch: Any = None, indices: np.ndarray | None = None
    ) -> np.ndarray:
        """Run the selection forward on the first two and the first three candidates, so that a
        ``loss_fn`` without one loss per example or an unselectable model fails at once; returns
        the finite losses (float64) of the larger probe, for the policy's
        :meth:`~sbloader.Policy.check_losses`.

        NOTE: used where an epoch has no selection pass (a warm-up) but later ones will: without
        it, such a mistake would surface only after the whole warm-up. It changes nothing: eval
        mode (also with ``eval_selection=False``: a train-mode forward would update BatchNorm's
        running statistics, and a run resumed in the warm-up, which probes again, would then
        differ from the uninterrupted one) and inference mode, no stats, no cache, and the
        outputs' shape is not recorded. ``batch`` is the source batch's structure, as in
        :meth:`score` (a ``forward=`` hook takes its first rows).

        NOTE (two sizes): a loss reduced over the wrong axis, e.g. ``(B, C) -> (C,)``, has one
        value per example on a probe of C rows; no C equals both 2 and 3.
        """
        if not self._fields_checked:
            self._fields_checked = True
            self.check_fields(batch, inputs, targets, indices)
        n = B.column_length(inputs, "input")
        model = unwrap(self.selector if self.selector is not None else self.model)
        if self.quantized is not None:  # the fp32 model is probed; the int8 copy is tried
            try:
                self.quantized.trial(model, B.rows(inputs, 0, min(n, 2)), self._prepare)
            except (Int8Unavailable, TypeError) as e:
                self._int8_failed(e, model, inputs, targets)
        for start, stop in self._probe_plan(n, targets):
            rows = self._probe_rows(model, inputs, targets, batch, start, stop)
            if start == 0:  # (the first rows' larger probe; not the largest label's row)
                losses = rows
        self._check_targets(targets)
        self.keep_template(inputs, targets, batch)
        values = _to_host(losses)
        # Only finite ones, as a selection pass hands the policy (nonfinite= decides the rest).
        return values[np.isfinite(values)]

    def probe_forwards(self, inputs: Any, targets: Any) -> int:
        """The selection forwards :meth:`probe` runs over a source batch of ``inputs`` (what a
        probe round agrees on under FSDP, see :meth:`pad`)."""
        return len(self._probe_plan(B.column_length(inputs, "input"), targets))

    def _probe_plan(self, n: int, targets: Any) -> list[tuple[int, int]]:
        """The rows ``(start, stop)`` of each of :meth:`probe`'s forwards over ``n`` candidates:
        the first two and the first three (one forward where ``n`` < 3), and with a selector
        the row of the largest class label where it is not among those.

        NOTE: a selector with fewer outputs than the labels fails only on a row whose label it
        lacks; the first rows may all have small labels, and the warm-up would then end before
        the first selection pass failed. The row of the largest class label of the batch is
        probed too (once per run, a selector only).

        NOTE (FSDP): the count differs between ranks (a rank's first batch of two rows, or its
        largest label past row 2); the round agreed on one forward, so a rank running two or
        three while another ran one waited in a collective the others never made (a hang).
        """
        plan = [(0, k) for k in sorted({min(n, 2), min(n, 3)})]
        top = _largest_label_row(targets) if self.selector is not None else None
        if top is not None and top >= min(n, 3):
            plan.append((top, top + 1))
        return plan

    def _check_targets(self, targets: Any) -> None:
        """Refuse, once a first selection forward has run (so that a model refusing its inputs
        is named first), targets the cross-entropy ``loss_fn`` cannot rank by (see
        :func:`~sbloader.selection.check_class_targets`); checked until they pass."""
        if not self._targets_checked:
            check_class_targets(self.loss_fn, targets)
            self._targets_checked = True

    def _probe_rows(
        self, model: nn.Module, inputs: Any, targets: Any, batch: Any, start: int, stop: int
    ) -> torch.Tensor:
        """The losses of a probe's selection forward over rows ``start:stop`` (see
        :meth:`probe`)."""
        try:
            losses, _, _ = self.forward(
                model,
                B.rows(inputs, start, stop),
                B.rows(targets, start, stop),
                self.loss_fn,
                batch_size=None,
                autocast_dtype=self.autocast,
                eval=True,
                keep_outputs=self.keep_logits,
                batch=None if batch is None else restrict(batch, start, stop),
                inference=self._inference(model),
            )
        except IndexError as e:
            self._blame_selector(e)
        return losses

    def _blame_selector(self, error: IndexError) -> NoReturn:
        """Re-raise ``error``, an ``IndexError`` of a selection pass, naming ``selector=``
        where there is one; else unchanged.

        NOTE: a selector whose outputs have fewer classes than the targets' labels (one built
        for another head) fails only in the selection passes, with torch's "Target 9 is out of
        bounds", which names neither the selector nor the fix; the training model, whose
        outputs fit, trains without error.
        """
        if self.selector is None:
            raise error
        raise IndexError(
            f"the selection pass over selector= raised IndexError: {error}. The selector's "
            "outputs are scored with the loader's loss_fn against the batch's targets, so they "
            "need the training model's classes: a selector with fewer outputs than the labels "
            "fails here; give it the model's number of outputs (or check its forward)"
        ) from error

    def _inference(self, model: nn.Module) -> bool:
        """Whether a pass over ``model`` runs under ``torch.inference_mode()``: not for an FSDP
        model (see :func:`~sbloader.selection.selection_outputs`), nor while the model holds
        lazy parameters still to be made (:func:`~sbloader.selection.has_lazy`): that pass runs
        under ``torch.no_grad()``, so that what it makes trains. Checked until a pass finds
        none."""
        if self.collective:
            return False
        if self._maybe_lazy:
            if has_lazy(model):
                return False
            self._maybe_lazy = False
        return True

    def _int8_failed(self, error: Exception, model: nn.Module, inputs: Any, targets: Any) -> None:
        """The int8 copy could not be built on ``inputs`` (``error``): refused naming
        ``selection_scale`` where the float ``model`` cannot take the downsampled inputs either
        (:meth:`SelectionForward.blame_scale <sbloader.selection.SelectionForward.blame_scale>`;
        the copy is calibrated on them), else :meth:`fall_back`."""
        self.forward.blame_scale(
            model,
            inputs,
            targets,
            self.loss_fn,
            error,
            autocast_dtype=self.autocast,
            keep_outputs=self.keep_logits,
            inference=self._inference(model),
        )
        self.fall_back(error)

    def fall_back(self, error: Exception) -> None:
        """Score in ``fallback_autocast`` from now on, where the int8 copy was chosen by
        ``quantize_selection="auto"`` and cannot be built for this model or input (warned and
        recorded in :attr:`precision`); re-raise ``error`` where it was asked for explicitly.

        NOTE: only before any copy was built to score with (the first source batch's trial or
        pass) or restored: a copy that was built once builds again, and a run never mixes
        precisions.
        """
        quantized = self.quantized
        if quantized is None or not quantized.auto or quantized.used:
            raise error
        self.quantized = None
        self.autocast = self.fallback_autocast
        cause = error.__cause__ if error.__cause__ is not None else error
        first = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        self.precision = (
            f"quantize_selection='auto': off (the int8 copy could not be built: {first[:200]}); "
            f"{_float_name(self.autocast)}"
        )
        logger.info("selection precision: %s", self.precision)
        warnings.warn(
            f"sbloader: {self.precision}. Selection passes run in {_float_name(self.autocast)} "
            "instead; pass quantize_selection=False to choose that without trying int8.",
            UserWarning,
            stacklevel=4,
        )

    def precision_choice(self) -> tuple[Any, ...]:
        """What decides the selection precision (the int8 copy, the autocast dtypes and their
        reason), for :meth:`restore_precision` after a refused resume."""
        return self.quantized, self.autocast, self.fallback_autocast, self.precision

    def restore_precision(self, choice: tuple[Any, ...]) -> None:
        """Put back a :meth:`precision_choice`: a resume refused after :meth:`adopt_quantized`
        or the loader's autocast adoption followed the saved run must leave the loader's own
        choice as it was."""
        self.quantized, self.autocast, self.fallback_autocast, self.precision = choice

    def adopt_quantized(self, state: dict[str, Any]) -> None:
        """Before a resume: check that a saved scorer state matches this scorer's int8 copy, and
        follow the saved run where this one's copy was chosen by ``"auto"`` and the saved run
        fell back from it (or ran without it)."""
        state = check_version(state, "Scorer", self.VERSION)
        quantized = state.get("quantized")
        if quantized is None and self.quantized is not None and self.quantized.auto:
            self.quantized = None
            self.autocast = self.fallback_autocast
            # (logged by the loader once the resume is accepted: a refused one changes nothing)
            self.precision = (
                "quantize_selection='auto': off (the resumed run's own, from its state)"
            )
        if (quantized is None) != (self.quantized is None):
            saved = "without" if quantized is None else "with"
            raise ValueError(
                f"the saved SelectiveLoader state was made {saved} an int8 selection copy "
                f"(quantize_selection), but this loader {'has' if self.quantized else 'has none'} "
                f"({self.precision}); build the loader with quantize_selection="
                f"{quantized is not None} to resume it"
            )

    def follow_forward_autocast(self, requested: Any) -> None:
        """Where the selecting model's own forward runs under ``torch.autocast`` (Accelerate's
        ``mixed_precision``: see :func:`~sbloader.precision.forward_autocast`), selection passes
        run in its dtype whatever ``autocast`` asks (``requested``: the loader's ``autocast``
        argument, checked): with ``"auto"`` that dtype is the selection precision (reported and
        saved as such), an explicit other one is refused naming the fix. Checked when the loader
        is built and at every epoch start (the model may be prepared after the loader is
        built).

        NOTE: not with a frozen prefix, whose float32 features feed training (the head's own
        autocast then covers only the head), nor for an int8 copy, which is traced from the
        module's class forward (only the float precision it falls back to follows).
        """
        if self.has_prefix:
            return
        selecting = self.selector if self.selector is not None else self.model
        device = model_device(selecting)
        dtype = forward_autocast(unwrap(selecting), device)
        if dtype is None:
            return
        if self.quantized is not None:
            if requested == AUTO:
                self.fallback_autocast = dtype
            return
        if dtype == self.autocast:
            return
        if requested != AUTO:
            raise ValueError(forward_autocast_refused(requested, dtype, device))
        self.autocast = self.fallback_autocast = dtype
        self.precision = (
            f"autocast='auto': {str(dtype).removeprefix('torch.')} (the model's forward runs "
            "under its own torch.autocast, as accelerator.prepare(model) makes it with "
            "mixed_precision)"
        )
        logger.info("selection precision: %s", self.precision)

    def adopt_autocast(self, saved: Any, requested: Any) -> None:
        """Continue a resumed run in the selection precision it was saved with (``saved``), when
        this loader's was chosen by ``autocast="auto"`` (``requested``; explicit choices are kept
        as given)."""
        if isinstance(saved, str):
            saved = getattr(torch, saved)
        if saved == self.autocast or requested != AUTO:
            return
        if self.feature_cache is not None:
            raise ValueError(
                f"the saved run selected in {saved} and this loader's autocast='auto' chose "
                f"{self.autocast}, but its frozen prefix's cached features are kept in the "
                f"chosen precision; build the loader with autocast={saved!r} to resume"
            )
        self.autocast = saved  # (logged once the resume is accepted: load_state_dict)
        self.precision = f"autocast={saved} (the resumed run's own, from its state)"

    def _prepare(self, inputs: torch.Tensor) -> torch.Tensor:
        """What the selection forward does to the inputs before the model sees them (for the
        int8 copy's calibration)."""
        scale = self.forward.scale
        return inputs if scale is None else downsample(inputs, scale)

    def chunks(self, n: int) -> int:
        """The selection forwards a pass over ``n`` candidates runs (chunks of ``batch_size``)."""
        return math.ceil(n / (self.batch_size or n)) if n else 0

    @property
    def can_pad(self) -> bool:
        """Whether :meth:`pad` has a candidate to run (one was scored or probed before)."""
        return self._template is not None

    def pad(self, count: int) -> None:
        """Run ``count`` selection forwards on one kept candidate and discard them.

        NOTE (FSDP): each forward of a sharded model all-gathers its parameters from every rank,
        so a rank with fewer chunks to score in a round (a shorter source batch, or none left)
        runs these, through the same model, hook and options, until every rank has run as many
        as the one with the most. Counted nowhere, changes nothing.

        NOTE (eval mode): also with ``eval_selection=False``. In train mode a padding forward
        of the one kept row failed in a BatchNorm1d (one value per channel), reported as a
        selection chunk of one that the data did not hold, and elsewhere updated BatchNorm's
        running statistics once per padding forward (rank 1's counter at 8 where its counted
        forwards were 4). FSDP's collectives are the same in either mode; a SyncBatchNorm's are
        not, which is why that combination is refused when the scorer is built.
        """
        if count <= 0:
            return
        assert self._template is not None, "pad() before any selection pass"
        inputs, targets, batch = self._template
        model = unwrap(self.selector if self.selector is not None else self.model)
        for _ in range(count):
            self.forward(
                model,
                inputs,
                targets,
                self.loss_fn,
                batch_size=None,
                autocast_dtype=self.autocast,
                eval=True,
                batch=batch,
                inference=False,
            )

    def host_template(self) -> tuple[Any, Any, Any] | None:
        """The one candidate :meth:`pad` runs, on the host (to send to another rank), or None
        before any was kept."""
        if self._template is None:
            return None
        cpu = torch.device("cpu")
        inputs, targets, batch = self._template
        return (_moved(inputs, cpu), _moved(targets, cpu), _moved(batch, cpu))

    def adopt_template(self, template: tuple[Any, Any, Any], device: torch.device) -> None:
        """Pad with ``template``, another rank's candidate (on the host), moved to ``device``:
        for a rank that has scored nothing in this process (a resumed one) and whose source
        has ended while another rank's still scores (see ``EpochIterator._selection_round``)."""
        inputs, targets, batch = template
        self._template = (_moved(inputs, device), _moved(targets, device), _moved(batch, device))

    def keep_template(self, inputs: Any, targets: Any, batch: Any) -> None:
        """Keep a candidate of this source batch for :meth:`pad` (FSDP only; the first one
        kept stays). The epoch keeps one before a round's forwards too, so that a rank that
        scores in the round has one to share with a rank that has none."""
        if self.collective and self._template is None:
            self._template = (
                _owned(B.rows(inputs, 0, 1)),
                _owned(B.rows(targets, 0, 1)),
                None if batch is None else _owned(restrict(batch, 0, 1)),
            )

    def check_fields(
        self, batch: Any, inputs: Any, targets: Any, indices: np.ndarray | None = None
    ) -> None:
        """Warn (``UserWarning``) when the model is called on the input field alone but a dict
        batch has other tensor fields it may need (an attention mask): the selection losses
        would then silently differ from the training forward's. Not with ``forward=`` (or a
        tuple ``input_key``), which decides what the model takes, nor with a frozen prefix,
        which takes the input field alone by design. Tuple and list batches: see
        :meth:`_check_positions`."""
        if isinstance(batch, (tuple, list)):
            self._check_positions(batch, inputs, targets, indices)
            return
        if self.forward.call is not None or self.has_prefix or not isinstance(batch, Mapping):
            return
        extra = unused_fields(batch, [inputs, targets], self.id_fields)
        if not extra:
            return
        key = next((k for k, v in batch.items() if v is inputs), None)
        warnings.warn(
            f"the source's dict batches have tensor fields {extra!r} besides the input field "
            f"{key!r} and the target, but the selection pass scores model(batch[{key!r}]) alone, "
            "without them. If the model needs them (e.g. an attention mask), pass forward=, e.g. "
            f"forward=lambda model, batch: model(batch[{key!r}], {extra[0]}=batch[{extra[0]!r}]), "
            f"or input_key= a tuple of the model's positional inputs; to score with {key!r} "
            f"alone and silence this warning, pass forward=lambda model, batch: "
            f"model(batch[{key!r}])",
            UserWarning,
            stacklevel=2,
        )

    def _check_positions(
        self, batch: Sequence[Any], inputs: Any, targets: Any, indices: np.ndarray | None
    ) -> None:
        """Warn (``UserWarning``) where tuple or list batches of more than two fields leave the
        target at its default, the second field, and have tensor fields that are neither the
        input, the target nor dataset ids (an index field, or one that holds this batch's
        dataset ``indices``: ``(x, y, i)`` batches): the selection losses are taken against the
        second field whatever it holds. With the model called on the input alone (no
        ``forward=``), only where the second field looks like a companion of the input (see
        :func:`_input_like`: a mask), or where another field could be the target in its place
        (see :func:`_rival`: lengths or group ids beside the labels).

        NOTE: over ``(tokens, lengths, labels)`` batches with ``forward=lambda model, batch:
        model(batch[0], batch[1])``, or ``(x, mask, y)`` and a model whose mask is optional,
        the losses were taken against the lengths or the mask, silently where the loss accepts
        them (lengths below the class count). An explicit ``target_key`` says which field is
        the target, and silences this; a tuple ``input_key`` is checked against the default
        target when the batch format is learnt (see ``BatchCodec``).

        NOTE (the input alone): a model called on field 0 alone does not take field 1, so the
        usual ``(x, y, weight)`` rows were warned of for a target that is right; there only a
        field 1 shaped like the input, or another field of field 1's shape and kind, is. Field
        values are not read: ``(x, y, id)`` rows of a ``Subset`` (the ids of the dataset under
        it, not the loader's indices) are still warned of, as ``(x, lengths, y)`` must be.
        ``forward=`` may pass any field to the model, so every other tensor field is warned of
        then.
        """
        if not self.default_target or isinstance(self.forward.call, FieldsForward):
            return
        extra = [
            j
            for j, v in enumerate(batch)
            if tensor_field(v)
            and v is not inputs
            and v is not targets
            and j not in self.id_fields
            and j - len(batch) not in self.id_fields
            and not _holds(v, indices)
        ]
        if self.forward.call is None and not _input_like(targets, inputs):  # (model alone)
            extra = [j for j in extra if _rival(batch[j], targets)]
        if not extra:
            return
        called = (
            "forward= calls the model on the batch"
            if self.forward.call is not None
            else f"the selection pass scores model(batch[{_position(batch, inputs)}]) alone"
        )
        warnings.warn(
            f"the source's {type(batch).__name__} batches of {len(batch)} fields leave "
            f"target_key at its default, 1 (the second field), and have tensor fields {extra!r} "
            f"that are neither the input nor the target, and {called}: where field 1 is not the "
            "loss target (batches of (x, mask, y)), the selection losses are taken against it; "
            f"pass target_key= the loss target's position (e.g. target_key={len(batch) - 1}), "
            "target_key=1 to confirm it and silence this warning, and, where the model takes "
            "those fields too, input_key= a tuple of its positional inputs or forward=",
            UserWarning,
            stacklevel=3,
        )

    def features(
        self,
        inputs: torch.Tensor,
        scored: Scored | None,
        positions: np.ndarray | None,
        indices: np.ndarray | None,
        epoch: int,
        stats: EpochStats,
    ) -> torch.Tensor | None:
        """The frozen prefix's outputs for rows ``positions`` (all rows if None) of a source
        batch, or None without a frozen prefix.

        Outputs from the selection pass are gathered (a copy); without one (passthrough and
        loss-free policies), the prefix runs on the chosen rows only (timed as selection).
        """
        if not self.has_prefix:
            return None
        if scored is not None and scored.features is not None:
            if positions is None:
                return scored.features
            pos = torch.from_numpy(positions).to(scored.features.device, non_blocking=True)
            return scored.features.index_select(0, pos)
        t0 = perf_counter()
        out = self._prefix_outputs(inputs, indices, positions, epoch, stats)
        elapsed = perf_counter() - t0
        stats.selection_s += elapsed
        stats.selection_forward_s += elapsed
        return out

    def logits(
        self, scored: Scored | None, positions: np.ndarray | None, k: int, device: torch.device
    ) -> torch.Tensor | None:
        """With ``keep_logits``, the chosen rows of the selection pass's outputs, or NaN rows
        when the examples had no selection pass; None without ``keep_logits``.

        NOTE: before any selection pass the rows' shape is unknown; they are then (k, 0), and
        widened to NaN rows of the right shape when they meet real outputs in a batch
        (:meth:`sbloader.rows.Rows.concat`).
        """
        if not self.keep_logits:
            return None
        if scored is not None and scored.logits is not None:
            assert positions is not None  # only selection passes have outputs
            logits = scored.logits
            return logits.index_select(0, torch.from_numpy(positions).to(logits.device))
        shape = self.logits_shape if self.logits_shape is not None else (0,)
        return torch.full((k, *shape), float("nan"), device=device)

    def _prefix_outputs(
        self,
        inputs: torch.Tensor,
        indices: np.ndarray | None,
        positions: np.ndarray | None,
        epoch: int,
        stats: EpochStats,
    ) -> torch.Tensor:
        """The frozen prefix's outputs for rows ``positions`` (all if None) of ``inputs``,
        from the cross-epoch cache where it holds them; computed (and cached) otherwise."""
        cache = self.feature_cache
        rows = np.arange(inputs.shape[0]) if positions is None else positions

        def compute(x: torch.Tensor, as_float: bool = True) -> torch.Tensor:
            return self.forward.features(x, self.batch_size, self.autocast, as_float)

        if positions is not None:
            pos = torch.from_numpy(positions).to(inputs.device, non_blocking=True)
            inputs = inputs.index_select(0, pos)
        if cache is None:
            stats.prefix_forwards += inputs.shape[0]
            return compute(inputs)
        assert indices is not None and self.forward.frozen_prefix is not None
        idx = indices[rows]
        cache.follow(self.forward.frozen_prefix, epoch)
        stats.prefix_forwards += cache.check(epoch, idx, inputs, compute)
        missing = cache.missing(idx)
        if len(missing):
            x = inputs.index_select(0, torch.from_numpy(missing).to(inputs.device))
            # NOTE: kept as the prefix returns them: in the autocast dtype where its last op ran
            # in it, in float32 where it ran in float32 (a pooling or normalisation autocast
            # keeps in float32): before, those were rounded to the autocast dtype when cached,
            # so that with cache_features the head trained on other features than without.
            cache.put(idx[missing], compute(x, as_float=False))
            stats.prefix_forwards += len(missing)
        return features_as_float(cache.get(idx, inputs.device), self.autocast)

    def state_dict(self) -> dict[str, Any]:
        shape = self.logits_shape
        cache = self.feature_cache
        return {
            "version": self.VERSION,
            "logits_shape": None if shape is None else list(shape),
            # NOTE: an optional key of version 1 (absent from states saved before
            # quantize_selection): the int8 copy's refresh clock and values, or None.
            "quantized": None if self.quantized is None else self.quantized.state_dict(),
            # (optional too: the feature cache, whose rows only save_feature_cache=True keeps)
            "feature_cache": None if cache is None else self._cache_state(cache),
        }

    def _cache_state(self, cache: FeatureCache) -> dict[str, Any]:
        """The feature cache's state, with its rows the prefix's digest (see load_state_dict)."""
        state = cache.state_dict()
        prefix = self.forward.frozen_prefix
        if "filled" in state and prefix is not None:
            state["prefix_digest"] = prefix_digest(prefix)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adopt_quantized(state)
        state = check_version(state, "Scorer", self.VERSION)
        quantized = state.get("quantized")
        shape = state["logits_shape"]
        self.logits_shape = None if shape is None else tuple(int(v) for v in shape)
        if self.quantized is not None and quantized is not None:
            self.quantized.load_state_dict(quantized)
        cache = state.get("feature_cache")
        prefix = self.forward.frozen_prefix
        if self.feature_cache is not None and cache is not None and prefix is not None:
            # NOTE: rows of another prefix (other weights, another model) would be handed out as
            # this one's features, unnoticed until the next epoch's check: refused now.
            saved = cache.get("prefix_digest")
            if saved is not None and saved != prefix_digest(prefix):
                raise ValueError(
                    "the saved feature cache was computed by another frozen_prefix (its "
                    "parameters or buffers differ from this one's): load the prefix's weights "
                    "before the loader's state, or build the loader with "
                    "save_feature_cache=False to compute the cache again"
                )
            self.feature_cache.load_state_dict(cache, model_device(prefix))


def _float_name(dtype: torch.dtype | None) -> str:
    """``"float32"`` for None, else the dtype's name (``"bfloat16"``)."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def _mapped(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (a tensor, or a structure of dicts, tuples and lists of them) with ``fn``
    applied to each tensor; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _mapped(v, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return B.like(value, [_mapped(v, fn) for v in value])
    return value


def _owned(value: Any) -> Any:
    """``value`` with its tensors copied (a view would keep its whole source batch alive)."""
    return _mapped(value, torch.Tensor.clone)


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors on ``device``."""
    return _mapped(value, lambda t: t.to(device))


def _largest_label_row(targets: Any) -> int | None:
    """The row of the largest class label where ``targets`` are class labels (a 1-d integer
    tensor), else None."""
    if (
        not isinstance(targets, torch.Tensor)
        or targets.dim() != 1
        or targets.numel() == 0
        or targets.dtype.is_floating_point
        or targets.dtype.is_complex
        or targets.dtype == torch.bool
    ):
        return None
    return int(targets.argmax())


def _to_host(losses: torch.Tensor) -> np.ndarray:
    """Selection losses (float32 on any device) as float64 on the host, as policies take them."""
    return losses.detach().cpu().numpy().astype(np.float64)


def _position(batch: Sequence[Any], field: Any) -> int:
    """The position of ``field`` (by identity) in a tuple or list ``batch``, else 0."""
    return next((j for j, v in enumerate(batch) if v is field), 0)


def _input_like(field: Any, inputs: Any) -> bool:
    """Whether a batch field may be a companion of the input rather than a target: more than
    one value per example, shaped as the input's examples or their trailing dimensions (a
    mask of tokens or pixels); True where either is not a tensor (nothing to tell by).

    Example:
        >>> x = torch.zeros(4, 3, 8, 8)
        >>> _input_like(torch.ones(4, 8, 8), x), _input_like(torch.arange(4), x)
        (True, False)
        >>> _input_like(torch.ones(4, 5), x)
        False
    """
    if not isinstance(field, torch.Tensor) or not isinstance(inputs, torch.Tensor):
        return True
    row, example = tuple(field.shape[1:]), tuple(inputs.shape[1:])
    return 0 < len(row) <= len(example) and example[len(example) - len(row) :] == row


def _rival(field: Any, target: Any) -> bool:
    """Whether ``field`` could be the loss target in ``target``'s place: a tensor of its shape
    and kind (integer or floating); True where either is not a tensor (nothing to tell by).

    Example:
        >>> labels = torch.tensor([3, 1])
        >>> _rival(torch.tensor([7, 9]), labels), _rival(torch.tensor([0.5, 1.0]), labels)
        (True, False)
    """
    if not isinstance(field, torch.Tensor) or not isinstance(target, torch.Tensor):
        return True
    floating = field.is_floating_point() or field.is_complex()
    kind = target.is_floating_point() or target.is_complex()
    return field.shape == target.shape and floating == kind


def _holds(field: Any, indices: np.ndarray | None) -> bool:
    """Whether ``field`` is a tensor of the dataset ``indices``, entry for entry."""
    if indices is None or not isinstance(field, torch.Tensor) or field.dim() != 1:
        return False
    if field.is_floating_point() or field.shape[0] != indices.shape[0]:
        return False
    return bool(np.array_equal(field.detach().cpu().numpy(), indices))
