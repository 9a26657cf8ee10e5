"""SelectiveLoader: a drop-in replacement for a training DataLoader that yields only the examples
worth backpropagating, in full training batches that carry the selection pass's results.

The loader holds configuration and cross-epoch state; an :class:`~sbloader.epoch.EpochIterator`
(what ``iter(loader)`` returns) runs each epoch.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
from torch import nn

from ._checks import check_choice, check_device, check_int, indices_needed
from ._migrations import loader_state_v1_to_v2
from ._state import check_identity, check_version
from .adapt import make_source
from .codec import BatchCodec
from .decisions import NONFINITE, subset_mask
from .device_decisions import DecisionGenerator
from .distributed import RankSync, make_sync
from .epoch import EpochIterator
from .features import make_feature_cache
from .policies import Policy, SelectiveBackprop
from .rows import PendingRows
from .scoring import Scorer
from .selection import Forward, Output, SelectionForward, check_loss_fn, input_fields, model_device
from .sources import Source
from .stats import EpochStats, LoaderStats

__all__ = ["SelectiveLoader"]

logger = logging.getLogger("sbloader")

_REMAINDERS = ("carry", "short", "drop")
_CDFS = ("local", "global")
_DECISIONS = ("host", "device")
_BATCHNORM = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)

# The keys of the loader's state (version 2).
K_VERSION, K_IDENTITY, K_EPOCH, K_POSITION, K_ACTIVE = (
    "version",
    "identity",
    "epoch",
    "position",
    "active",
)
K_RNG, K_SOURCE, K_POLICY, K_PENDING, K_CODEC, K_SCORER, K_STATS = (
    "rng",
    "source",
    "policy",
    "pending",
    "codec",
    "scorer",
    "stats",
)
K_DEVICE_RNG = "device_rng"  # only with decisions="device"


class SelectiveLoader:
    """Wraps a training data source and yields full batches of the examples a policy selects.

    For each source batch, the loader runs a *selection pass* (the model in eval mode under
    ``torch.inference_mode()``) to get one loss per example, asks the policy which examples to
    keep, and collects the kept ones into training batches of exactly ``batch_size`` examples on
    the model's device. Batches keep the source's structure, so ``for inputs, targets in loader``
    works unchanged, and carry the selection results as attributes (see
    :class:`~sbloader.batch.SelectedBatch`): ``indices``, ``losses``, ``probabilities`` and
    ``weights``.

    Args:
        source: a torch ``DataLoader`` (over a map-style dataset the dataset indices are
            recovered automatically, with any sampler and number of workers), an FFCV ``Loader``
            (indices from its index field, see :mod:`sbloader.ffcv`), or any re-iterable of
            batches (indices then come from the field ``index_key``, or are unknown).
        model: the model being trained. Selection passes call its unwrapped module (DDP,
            DataParallel and ``torch.compile`` wrappers are looked through). With
            ``frozen_prefix``, the trainable part that runs on the prefix's outputs (the head).
        loss_fn: per-example loss, ``loss_fn(model(inputs), targets)`` of shape ``(B,)``.
            Default ``nn.CrossEntropyLoss(reduction="none")``.
        policy: the selection policy. Default ``SelectiveBackprop(selectivity=1/3)``.
        seed: seeds the loader's own generator (the only randomness it uses).
        batch_size: examples per yielded training batch. Default: the source's batch size.
        selection_batch_size: examples per selection forward (chunks of a source batch). Default:
            the whole source batch in one forward. A source batch larger than the training batch
            makes selection cheaper per example.
        remainder: what happens to selected examples that do not fill a batch when an epoch ends:
            ``"carry"`` (default, the paper's Algorithm 1) keeps them for the next epoch's first
            batch; ``"short"`` yields them as a short batch; ``"drop"`` drops them (counted in
            ``stats``).
        min_batch_size: smaller batches are never yielded (dropped and counted). Default 2 when
            the model has BatchNorm layers (a batch of one makes BatchNorm raise in training),
            else 1.
        nonfinite: what happens to an example whose selection loss is NaN or infinite: ``"skip"``
            (default: never backpropagated, since its gradient would corrupt the weights),
            ``"select"`` (always backpropagated) or ``"raise"`` (``FloatingPointError``). Either
            way it never enters the policy's loss window and is counted in ``stats``.
        device: where yielded batches go. Default: the model's device.
        autocast: a dtype such as ``torch.bfloat16`` to run selection passes under autocast.
        memory_format: e.g. ``torch.channels_last``, applied to 4-d inputs before selection and
            training.
        input_key, target_key: the model input and loss target fields: positions in tuple/list
            batches (default 0 and 1), keys in dict batches (default ``"input"``, ``"target"``).
            A tuple ``input_key`` names several fields, the model's positional inputs:
            ``input_key=("input_ids", "attention_mask")`` scores ``model(ids, mask)``. A dict
            batch with tensor fields that the model is not given (neither input nor target nor
            index field) is warned about on the first selection pass: pass ``forward=``.
        index_key: the field holding dataset indices, for sources that carry them themselves.
        selector: a separate (cheaper) model for selection passes. Default: ``model``.
        compile_selection: run selection forwards through ``torch.compile`` of the unwrapped
            selection model, compiled once on first use (``True``, or a dict of
            ``torch.compile`` arguments). Training forwards are not affected.
        selection_scale: resize 4-d inputs by this factor in (0, 1] (bilinear) before the
            selection forward only, e.g. 0.5 (Composer's ``scale_factor``); the model must
            accept the smaller inputs. Training batches keep full resolution.
        frozen_prefix: activation caching for a frozen backbone: a module without trainable
            parameters whose outputs ``model`` (the head) takes. The selection pass computes
            ``features = frozen_prefix(inputs)`` once (in eval mode, without autograd, under
            ``autocast`` when given: the features are then reduced-precision values, returned
            as float32) and the losses from ``model(features)``; yielded batches carry the
            selected examples' ``batch.features``, so the training step runs only the head:
            ``loss_fn(model(batch.features), targets)``. Refused (``ValueError``) when a prefix
            parameter has ``requires_grad=True``, checked again when each epoch starts.
        cache_features: with ``frozen_prefix``, keep each example's prefix output across
            epochs, keyed by dataset index (a :class:`~sbloader.features.FeatureCache`): the
            prefix then runs once per example in the whole run, not once per epoch. ``True``
            keeps the cache on the loader's device, a device (e.g. ``"cpu"``) keeps it there.
            Valid only when an example's input is the same every epoch (no random
            augmentation before the prefix): a few cached examples are recomputed each epoch
            and a changed input raises ``ValueError``. Needs dataset indices. Its memory is
            dataset size x prefix output size (in the ``autocast`` dtype when given).
        keep_logits: yielded batches also carry ``batch.logits``, the selection pass's model
            outputs for their examples (float32, one row each, as ``output=`` picks them from
            the model's outputs; the selector's outputs when
            ``selector`` is given, on downsampled inputs with ``selection_scale``), e.g. for
            distillation or monitoring, without a second forward. Rows of examples chosen without
            a selection pass (stale epochs, warm-up, passthrough) are NaN; ``batch.logits`` is
            ``None`` until a selection pass has shown the outputs' shape. Default False.
        forward: ``forward(model, batch)``, how the selection pass calls the model, for models
            that are not ``model(inputs)`` (several inputs, keyword inputs, nested batches):
            ``batch`` is the source batch's structure (a dict, tuple or list, nested dicts
            included, on the loader's device) restricted to the candidates of one selection
            forward (a chunk of ``selection_batch_size``), and ``model`` is the (unwrapped,
            compiled with ``compile_selection``) selection model: call it, not a model from an
            enclosing scope. It runs like the default forward: in eval mode (restored even when
            it raises), under ``torch.inference_mode()`` and ``autocast``. E.g.
            ``forward=lambda model, batch: model(batch["input_ids"],
            attention_mask=batch["attention_mask"])``; ``input_key`` then only names the field
            whose length counts the examples. Not with ``frozen_prefix`` or ``selection_scale``
            (refused). Training forwards are yours and are not affected.
        output: what ``loss_fn`` and ``keep_logits`` take from the model's outputs: a key or
            attribute name (``output="scores"``), a position in a tuple output (``output=0``),
            or a callable (``output=lambda out: out.logits[:, -1]``). A name the outputs lack is
            refused on the first selection pass, with the names they have. Default: the logits,
            i.e. a Tensor as is, a dict's or Hugging Face ``ModelOutput``'s ``"logits"``, an
            object's (a dataclass's) Tensor attribute ``logits``, anything else whole; taken by
            ``keep_logits`` and by a torch loss module (such as the default
            ``nn.CrossEntropyLoss``), whereas a ``loss_fn`` of your own takes non-tensor outputs
            whole (pass ``output=`` to hand it a part).
        subset: dataset indices to train on (e.g. from :func:`sbloader.prune`); the others are
            never yielded. A DataLoader source does not even load them. Needs dataset indices.
        eval_selection: run selection passes in eval mode (default True).
        rank: the process's rank, to derive its generator from ``seed``. Default: the
            ``torch.distributed`` rank when initialised, else 0.
        distributed: keep the ranks of a DDP job in step (see :mod:`sbloader.distributed`):
            every rank yields the same number of batches per epoch whatever its selections,
            and the end-of-epoch remainder is handled alike on every rank (``"short"``: one
            batch of at most ``batch_size`` on every rank or on none). Default None: on when
            ``torch.distributed`` is initialised with more than one rank (build the loader
            after ``init_process_group``).
        process_group: the process group for the loader's collectives. Default: the world.
        cdf: ``"local"`` (default): each rank's policy ranks losses against its own history;
            ``"global"``: against every rank's, all-gathered per source batch (the ranks'
            loss windows then hold identical contents).
        prefetch: source batches fetched ahead on a background thread while the caller trains
            (0: fetched on demand). Default: 1 for a DataLoader with ``num_workers > 0``, else
            0. NOTE: with ``num_workers=0`` the dataset's ``__getitem__`` then runs on that
            thread, so a dataset that draws from torch's global RNG (random transforms) would
            interleave its draws with the training step's and runs would not be reproducible:
            pass ``prefetch=1`` there only for datasets without global randomness (such as
            :class:`~sbloader.datasets.ArrayDataset`). FFCV loaders fetch ahead themselves.
        metadata_key: also carry the selection results inside each yielded batch, so that they
            survive frameworks that rebuild batches when moving them to a device (Lightning,
            Accelerate's ``send_to_device``): dict batches get this key, tuple and list batches
            one more last element, holding ``{"indices", "losses", "probabilities",
            "weights"}`` (and ``"features"``, ``"logits"`` when kept). Default None: the
            results are only attributes of the batch.
        decisions: where the per-batch decisions of a selection pass run. ``"host"``
            (default): the losses come to the host and the policy decides with the loader's
            numpy generator (selections identical for a seed on every machine). ``"device"``:
            on the losses' device (a GPU's, or the CPU's), with a ``torch.Generator`` derived
            from ``seed``: a loss window tensor, draws and gathers by index tensors; the host
            learns how many losses were finite and how many candidates were kept (and the kept
            positions where the source has dataset indices, which stay on the CPU). Different
            draws than ``"host"`` for the same seed, with the same probabilities; resume stays
            exact. For policies whose :meth:`~sbloader.Policy.decides_on_device` is True
            (SelectiveBackprop with ``staleness=1``), without ``keep_logits``, a frozen prefix or
            losses shared across ranks (``cdf="global"``).

    Attributes:
        stats: a :class:`~sbloader.stats.LoaderStats` with per-epoch and total counts and times.
        epoch: the number of the current (or next) epoch, from 0.
        pending_examples: selected examples waiting for a batch (carried into the next epoch
            with ``remainder="carry"``).

    ``iter(loader)`` returns an :class:`~sbloader.epoch.EpochIterator` for the next epoch (or the
    rest of a restored one); a newer iterator closes an older one (see its documentation).

    ``len(loader)`` is exact for passthrough policies (Traditional) and raises ``TypeError`` for
    selective ones, whose batch count per epoch is random: use :meth:`expected_batches` or
    schedule by :attr:`progress` instead.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import sbloader
        >>> data = TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,)))
        >>> model = nn.Linear(8, 3)
        >>> loader = sbloader.SelectiveLoader(
        ...     DataLoader(data, batch_size=32, shuffle=True), model,
        ...     loss_fn=nn.CrossEntropyLoss(reduction="none"),
        ...     policy=sbloader.SelectiveBackprop(selectivity=0.5), seed=0)
        >>> for inputs, targets in loader:
        ...     assert inputs.shape == (32, 8) and targets.shape == (32,)
        >>> batch = next(iter(loader))
        >>> batch.indices.shape, batch.weights.shape
        (torch.Size([32]), torch.Size([32]))

    A model with several inputs and dict outputs, on dict batches:

        >>> class Masked(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = nn.Linear(8, 3)
        ...     def forward(self, x, attention_mask):
        ...         return {"logits": self.fc(x * attention_mask)}
        >>> rows = [{"input_ids": torch.randn(8), "attention_mask": torch.ones(8), "labels": i % 3}
        ...         for i in range(64)]
        >>> loader = sbloader.SelectiveLoader(
        ...     DataLoader(rows, batch_size=32), Masked(), input_key="input_ids",
        ...     target_key="labels", keep_logits=True, batch_size=8,
        ...     forward=lambda model, b: model(b["input_ids"], attention_mask=b["attention_mask"]))
        >>> batch = next(iter(loader))
        >>> sorted(batch), batch.logits.shape
        (['attention_mask', 'input_ids', 'labels'], torch.Size([8, 3]))
    """

    STATE_VERSION = 2

    def __init__(
        self,
        source: Any,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        policy: Policy | None = None,
        *,
        seed: int = 0,
        batch_size: int | None = None,
        selection_batch_size: int | None = None,
        remainder: str = "carry",
        min_batch_size: int | None = None,
        nonfinite: str = "skip",
        device: torch.device | str | None = None,
        autocast: torch.dtype | None = None,
        memory_format: torch.memory_format | None = None,
        input_key: Hashable | None = None,
        target_key: Hashable | None = None,
        index_key: Hashable | None = None,
        selector: nn.Module | None = None,
        compile_selection: bool | dict[str, Any] = False,
        selection_scale: float | None = None,
        frozen_prefix: nn.Module | None = None,
        cache_features: bool | str | torch.device = False,
        keep_logits: bool = False,
        forward: Forward | None = None,
        output: Output = None,
        subset: Any = None,
        eval_selection: bool = True,
        rank: int | None = None,
        distributed: bool | None = None,
        process_group: Any = None,
        cdf: str = "local",
        prefetch: int | None = None,
        metadata_key: str | None = None,
        decisions: str = "host",
    ) -> None:
        for name, module, optional in (("model", model, False), ("selector", selector, True)):
            if not isinstance(module, nn.Module) and not (optional and module is None):
                raise TypeError(
                    f"{name} should be a torch.nn.Module{' or None' if optional else ''}, but "
                    f"got {type(module).__name__}"
                )
        self.policy: Policy = SelectiveBackprop() if policy is None else policy
        if not isinstance(self.policy, Policy):
            raise TypeError(
                "policy should be an sbloader policy such as sbloader.SelectiveBackprop(...), but "
                f"got {type(self.policy).__name__}"
            )
        loss_fn = nn.CrossEntropyLoss(reduction="none") if loss_fn is None else loss_fn
        check_loss_fn(loss_fn)
        if not isinstance(keep_logits, bool):
            raise TypeError(
                f"keep_logits should be True or False, but got keep_logits={keep_logits!r}"
            )
        if autocast is not None and not isinstance(autocast, torch.dtype):
            raise TypeError(
                f"autocast should be a torch.dtype such as torch.bfloat16, but got {autocast!r}"
            )
        self.keep_logits, self.autocast, self.memory_format = keep_logits, autocast, memory_format
        self.eval_selection = bool(eval_selection)
        self.selection_batch_size = (
            None
            if selection_batch_size is None
            else check_int("selection_batch_size", selection_batch_size, minimum=1)
        )
        self._source: Source = make_source(source, index_key)
        if self.policy.needs_indices() and not self._source.has_indices():
            raise indices_needed(repr(self.policy))
        self.seed = check_int("seed", seed, minimum=0)
        self.rank = self._default_rank() if rank is None else check_int("rank", rank, minimum=0)
        # NOTE: every random draw of the loader comes from generators derived from (seed, rank):
        # one for the policies' Bernoulli draws, one key for counter-based ones (Stale-SB).
        self._rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=(self.rank,)))
        )
        key = np.random.SeedSequence(self.seed, spawn_key=(self.rank, 1)).generate_state(1)[0]
        self.policy.attach(self._source.dataset_size, int(key))
        if subset is not None and not self._source.has_indices():
            raise indices_needed("subset=")
        self._subset = None if subset is None else subset_mask(subset, self._source.dataset_size)
        codec_input_key, call = input_fields(input_key, forward)
        selection_forward = SelectionForward(
            compile=compile_selection,
            scale=selection_scale,
            frozen_prefix=frozen_prefix,
            forward=call,
            output=output,
        )
        self._scorer = Scorer(
            model,
            loss_fn,
            selector,
            selection_forward,
            make_feature_cache(cache_features, frozen_prefix, autocast, self._source),
            autocast,
            self.selection_batch_size,
            self.eval_selection,
            keep_logits,
            index_key=index_key,
        )
        self._scorer.check()
        if batch_size is None:
            batch_size = self._source.batch_size
            if batch_size is None:
                raise ValueError(
                    "batch_size could not be taken from the source; pass batch_size= (the number "
                    "of examples per training batch)"
                )
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.remainder = check_choice("remainder", remainder, _REMAINDERS)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE)
        self.cdf = check_choice("cdf", cdf, _CDFS)
        self.prefetch = (
            self._source.default_prefetch()
            if prefetch is None
            else check_int("prefetch", prefetch, minimum=0)
        )
        self._sync: RankSync | None = make_sync(distributed, process_group)
        if min_batch_size is None:
            min_batch_size = 2 if any(isinstance(m, _BATCHNORM) for m in model.modules()) else 1
        self.min_batch_size = check_int("min_batch_size", min_batch_size, minimum=1)
        if self.min_batch_size > self.batch_size:
            raise ValueError(
                f"min_batch_size should be <= batch_size={self.batch_size}, but got "
                f"min_batch_size={self.min_batch_size}"
            )
        self._device = torch.device(device) if device is not None else None
        self.input_key, self.target_key = input_key, target_key
        if metadata_key is not None and not isinstance(metadata_key, str):
            raise TypeError(
                "metadata_key should be a str (the dict key to carry the selection results under) "
                f"or None, but got metadata_key={metadata_key!r}"
            )
        self.metadata_key = metadata_key
        self._codec = BatchCodec(codec_input_key, target_key, memory_format, metadata_key)
        self.decisions = check_choice("decisions", decisions, _DECISIONS)
        self._decider = self._device_decider(frozen_prefix is not None)
        self._scorer.host_values = self._decider is None
        # Cross-epoch state.
        self.stats = LoaderStats()
        self.epoch = 0
        self._pending = PendingRows()
        self._live: weakref.ref[EpochIterator] | None = None
        # An epoch that no live iterator owns but that did not end: (position, resume). A
        # restored mid-epoch state resumes it; an abandoned one is skipped by the next iterator.
        self._unfinished: tuple[int, bool] | None = None
        # Whether the model and loss_fn were checked on a source batch (see EpochIterator).
        self._probed = False

    def _device_decider(self, prefix: bool) -> DecisionGenerator | None:
        """The generator of ``decisions="device"`` (None on the host), after checking that this
        configuration can decide on the device."""
        if self.decisions == "host":
            return None
        if not self.policy.decides_on_device():
            raise ValueError(
                f"decisions='device' needs a policy that decides on the device, but "
                f"{self.policy!r} does not; use SelectiveBackprop with staleness=1, or "
                "decisions='host'"
            )
        for on, what in (
            (self.keep_logits, "keep_logits=True"),
            (prefix, "a frozen_prefix"),
            (self._sharing(), "losses shared across ranks (cdf='global')"),
        ):
            if on:
                raise ValueError(
                    f"decisions='device' does not support {what} yet; pass decisions='host'"
                )
        return DecisionGenerator(self.seed, self.rank)

    @staticmethod
    def _default_rank() -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    # ------------------------------------------------------------------ public helpers
    @property
    def device(self) -> torch.device:
        """Where yielded batches live: ``device`` if given, else the model's device."""
        return self._device if self._device is not None else model_device(self.model)

    @property
    def source(self) -> Source:
        return self._source

    @property
    def model(self) -> nn.Module:
        """The model being trained (selection passes score with it unless ``selector`` is set)."""
        return self._scorer.model

    @property
    def selector(self) -> nn.Module | None:
        """The separate selection model, or None."""
        return self._scorer.selector

    @property
    def loss_fn(self) -> Callable[..., torch.Tensor]:
        """The per-example loss of selection passes."""
        return self._scorer.loss_fn

    @property
    def scorer(self) -> Scorer:
        """The selection pass: the model or selector, the loss, the speed options, the frozen
        prefix's cache (:class:`~sbloader.scoring.Scorer`)."""
        return self._scorer

    @property
    def dataset(self) -> Any:
        """The source's dataset (e.g. the DataLoader's), for ``len(loader.dataset)``."""
        return self._source.dataset

    @property
    def sampler(self) -> Any:
        """The source's sampler (e.g. a DistributedSampler), or None."""
        return self._source.sampler

    @property
    def pending_examples(self) -> int:
        """Selected examples waiting for a batch (carried into the next epoch by ``"carry"``)."""
        return len(self._pending)

    @property
    def world_size(self) -> int:
        """The number of ranks the loader keeps in step (1 on a single process)."""
        return 1 if self._sync is None else self._sync.world_size

    @property
    def progress(self) -> float:
        """Epochs of source data consumed so far, as a float (for learning-rate schedules).

        Counts the candidates drawn from the source (also those a policy rejected before
        loading them and those outside ``subset``) against the examples of an epoch, so it
        advances at the same rate for every policy and reaches each whole number exactly when
        an epoch ends: schedules keyed on it are identical across strategies (by position in
        the data). Sources of unknown size count batches instead.

        NOTE: counting batches would be wrong where a source loads only some of an epoch's
        examples (Stale-SB's stale epochs, a subset): fewer batches come, and a schedule keyed
        on them would lag within the epoch and jump at its end.
        """
        it = self._live_iterator()
        if it is None or not it.running or it.stats is None:
            return float(self.epoch)
        size = self._source.epoch_size
        if size:
            drawn = it.stats.examples_seen + it.stats.excluded
            return float(self.epoch + min(drawn / size, 1.0))
        try:
            n = len(self._source)
        except TypeError:
            return float(self.epoch)
        return float(self.epoch + (min(it.position / n, 1.0) if n else 0.0))

    def expected_batches(self) -> float:
        """The expected number of training batches per epoch (an estimate when selective)."""
        examples = self._source.epoch_size
        if examples is None:
            bs = self._source.batch_size
            if bs is None:
                raise TypeError("the source's size is unknown, so no batch count can be estimated")
            examples = len(self._source) * bs
        return examples * self.policy.target_rate / self.batch_size

    def __len__(self) -> int:
        if not self.policy.passthrough():
            raise TypeError(
                f"len() is undefined for a SelectiveLoader with {self.policy!r}: the number of "
                "batches per epoch is random. Use loader.expected_batches() for an estimate, or "
                "key schedules on loader.progress"
            )
        n = len(self._source)
        size, bs = self._source.epoch_size, self._source.batch_size
        if size is not None and bs and not self._source.drop_last():
            if 0 < size % bs < self.min_batch_size:
                n -= 1  # the source's last batch is too small and will be dropped
        return n

    def __iter__(self) -> EpochIterator:
        live = self._live_iterator()
        if live is not None:
            live.close()  # a started epoch it had not finished counts as abandoned
        it = EpochIterator(self)
        self._live = weakref.ref(it)
        return it

    def _live_iterator(self) -> EpochIterator | None:
        return None if self._live is None else self._live()

    # ------------------------------------------------------------------ the epoch handover
    def _begin(self, it: EpochIterator) -> tuple[int, int, bool, EpochStats]:
        """Hand the next epoch (or the rest of a restored one) to ``it``: its number, the source
        batches to skip, whether it resumes a restored epoch, and its stats."""
        self._scorer.check()  # a frozen prefix may have been unfrozen
        check_device(self.device, self._device is not None)
        skip, resumed = 0, False
        if self._unfinished is not None:
            position, resume = self._unfinished
            self._unfinished = None
            if resume:
                skip, resumed = position, True
            else:
                self.epoch += 1  # the previous epoch was abandoned part-way (e.g. ``break``)
        self._source.set_epoch(self.epoch)
        self.policy.begin_epoch(self.epoch)
        current = self.stats.current
        if not (resumed and current is not None and current.epoch == self.epoch):
            current = self.stats.begin_epoch(self.epoch, self.policy.target_rate)
        return self.epoch, skip, resumed, current

    def _abandon(self, it: EpochIterator) -> None:
        """``it`` ended part-way: the next iterator starts the next epoch."""
        live = self._live_iterator()
        if live is None or live is it:  # (a dropped iterator's weak reference may be dead)
            self._unfinished = (it.position, False)

    def _end(self, it: EpochIterator) -> None:
        """``it`` finished its epoch."""
        stats = it.stats
        assert stats is not None
        self.epoch += 1
        if stats.examples_seen == 0:
            raise ValueError(
                f"the source yielded no examples in epoch {stats.epoch}; check that its dataset "
                "and sampler are not empty"
            )
        if stats.nonfinite:
            logger.warning(
                "epoch %d: %d candidates had a non-finite selection loss (nonfinite=%r)",
                stats.epoch,
                stats.nonfinite,
                self.nonfinite,
            )
        self.stats.log_epoch(stats)

    def _sharing(self) -> bool:
        """Whether the ranks exchange selection losses every round (``cdf="global"``, or a
        policy with per-example records such as Stale-SB's store)."""
        return self._sync is not None and (self.cdf == "global" or self.policy.records_examples())

    # ------------------------------------------------------------------ state
    def _identity(self) -> dict[str, Any]:
        """What a saved state must agree with to belong to this loader."""
        return {
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "policy": self.policy.kind(),
            "dataset_size": self._source.dataset_size,
            "decisions": self.decisions,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: epoch, position, generator, policy, pending rows, stats.

        Tensors are CPU tensors and everything else plain Python, so the state loads with
        ``torch.load(..., weights_only=True)``. Restore with :meth:`load_state_dict` on a loader
        built with the same arguments (checked: seed, rank, world size, policy kind, dataset
        size).
        """
        it = self._live_iterator()
        if it is not None and it.running:
            active, position = True, it.position
        elif self._unfinished is not None:
            active, position = True, self._unfinished[0]
        else:
            active, position = False, 0
        return {
            K_VERSION: self.STATE_VERSION,
            K_IDENTITY: self._identity(),
            K_EPOCH: self.epoch,
            K_POSITION: position,
            K_ACTIVE: active,
            K_RNG: self._rng.bit_generator.state,
            K_SOURCE: self._source.state_dict(),
            K_POLICY: self.policy.state_dict(),
            K_PENDING: self._pending.state_dict(),
            K_CODEC: self._codec.state_dict(),
            K_SCORER: self._scorer.state_dict(),
            K_STATS: self.stats.state_dict(),
            **({K_DEVICE_RNG: self._decider.state_dict()} if self._decider is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` (at an epoch boundary or mid-epoch).

        Refuses (``ValueError`` naming the field and both values) a state saved by a loader
        with another seed, rank, world size, policy kind or dataset size; migrates a version-1
        state. The next ``iter(loader)`` continues a restored unfinished epoch.
        """
        state = check_version(state, "SelectiveLoader", self.STATE_VERSION, {1: self._from_v1})
        check_identity(
            "SelectiveLoader",
            state[K_IDENTITY],
            self._identity(),
            "build the loader with the saved run's arguments (seed=, policy=, the same data "
            "and world size) to resume it",
        )
        active, position = bool(state[K_ACTIVE]), int(state[K_POSITION])
        self._source.load_state_dict(state[K_SOURCE], mid_epoch=active and position > 0)
        live = self._live_iterator()
        if live is not None:
            live.close()
        self._live = None
        self.epoch = int(state[K_EPOCH])
        self._unfinished = (position, True) if active else None
        self._rng.bit_generator.state = state[K_RNG]
        self.policy.load_state_dict(state[K_POLICY])
        self._codec.load_state_dict(state[K_CODEC])
        self._scorer.load_state_dict(state[K_SCORER])
        self._pending.load_state_dict(state[K_PENDING], self.device)
        self.stats.load_state_dict(state[K_STATS])
        if self._decider is not None:
            self._decider.load_state_dict(state[K_DEVICE_RNG])

    def _from_v1(self, state: dict[str, Any]) -> dict[str, Any]:
        return loader_state_v1_to_v2(state, self._scorer.has_prefix, self.keep_logits)

    def __repr__(self) -> str:
        return (
            f"SelectiveLoader(policy={self.policy!r}, batch_size={self.batch_size}, "
            f"remainder={self.remainder!r}, seed={self.seed})"
        )
