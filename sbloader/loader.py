"""SelectiveLoader: a drop-in replacement for a training DataLoader that yields only the examples
worth backpropagating, in full training batches that carry the selection pass's results."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Iterator
from time import perf_counter
from typing import Any

import numpy as np
import torch
from torch import nn

from . import batch as B
from ._checks import check_choice, check_int
from .distributed import RankSync, make_sync
from .features import FeatureCache
from .policies import Choice, Policy, SelectiveBackprop
from .prefetch import Prefetcher, Synchronous
from .selection import SelectionForward, check_loss_fn, unwrap
from .sources import DataLoaderSource, Source, make_source
from .stats import EpochStats, LoaderStats

__all__ = ["SelectiveLoader"]

logger = logging.getLogger("sbloader")

_REMAINDERS = ("carry", "short", "drop")
_NONFINITE = ("skip", "select", "raise")
_CDFS = ("local", "global")
_BATCHNORM = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


class _Pending:
    """Selected examples waiting to fill a training batch: a list of column chunks.

    With ``logits_last`` the last column holds ``keep_logits`` rows, whose (k, 0) placeholders
    are widened when they meet real rows (see :func:`_widen`).
    """

    def __init__(self, logits_last: bool = False) -> None:
        self.parts: list[list[B.Column]] = []
        self.count = 0
        self.logits_last = logits_last

    def add(self, columns: list[B.Column], k: int) -> None:
        if k:
            self.parts.append(columns)
            self.count += k

    def pop(self, k: int) -> list[B.Column]:
        """Remove and return the first ``k`` examples (k <= count)."""
        columns = [[p[j] for p in self.parts] for j in range(len(self.parts[0]))]
        if self.logits_last:
            columns[-1] = _widen(columns[-1])
        merged = [B.concat(c) for c in columns]
        heads, rests = zip(*(B.split(c, k) for c in merged))
        self.count -= k
        self.parts = [list(rests)] if self.count else []
        return list(heads)

    def pop_all(self) -> list[B.Column]:
        return self.pop(self.count)

    def clear(self) -> int:
        n, self.parts, self.count = self.count, [], 0
        return n


def _widen(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """NaN rows of shape (k, 0) (``keep_logits`` rows made before the outputs' shape was known)
    widened to the shape of the real rows they are batched with."""
    if len(chunks) < 2:
        return chunks
    empty = [c.dim() == 2 and c.shape[1] == 0 for c in chunks]
    full = [c for c, e in zip(chunks, empty) if not e]
    if not any(empty) or not full:
        return chunks
    shape = full[0].shape[1:]
    return [
        torch.full((c.shape[0], *shape), float("nan"), dtype=full[0].dtype, device=c.device)
        if e
        else c
        for c, e in zip(chunks, empty)
    ]


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _check_device(device: torch.device, given: bool) -> None:
    """Refuse to move batches to the meta device, where tensors hold no data."""
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
            outputs for their examples (float32, one row each; the selector's outputs when
            ``selector`` is given, on downsampled inputs with ``selection_scale``), e.g. for
            distillation or monitoring, without a second forward. Rows of examples chosen without
            a selection pass (stale epochs, warm-up, passthrough) are NaN; ``batch.logits`` is
            ``None`` until a selection pass has shown the outputs' shape. Default False.
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

    Attributes:
        stats: a :class:`~sbloader.stats.LoaderStats` with per-epoch and total counts and times.
        epoch: the number of the current (or next) epoch, from 0.

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
    """

    STATE_VERSION = 1

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
        subset: Any = None,
        eval_selection: bool = True,
        rank: int | None = None,
        distributed: bool | None = None,
        process_group: Any = None,
        cdf: str = "local",
        prefetch: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model should be a torch.nn.Module, but got {type(model).__name__}")
        if selector is not None and not isinstance(selector, nn.Module):
            raise TypeError(
                f"selector should be a torch.nn.Module or None, but got {type(selector).__name__}"
            )
        self.policy: Policy = SelectiveBackprop() if policy is None else policy
        if not isinstance(self.policy, Policy):
            raise TypeError(
                "policy should be an sbloader policy such as sbloader.SelectiveBackprop(...), but "
                f"got {type(self.policy).__name__}"
            )
        self.loss_fn = nn.CrossEntropyLoss(reduction="none") if loss_fn is None else loss_fn
        check_loss_fn(self.loss_fn)
        self.model = model
        self.selector = selector
        # Selection-speed options: compilation, downsampling, a frozen prefix (activation cache).
        self._forward = SelectionForward(
            compile=compile_selection, scale=selection_scale, frozen_prefix=frozen_prefix
        )
        self._forward.check(model, selector)
        if not isinstance(keep_logits, bool):
            raise TypeError(
                f"keep_logits should be True or False, but got keep_logits={keep_logits!r}"
            )
        self.keep_logits = keep_logits
        # The shape of one example's selection output (keep_logits), once a pass has shown it.
        self._logits_shape: tuple[int, ...] | None = None
        self._source: Source = make_source(source, index_key)
        if self.policy.needs_indices and not self._source.has_indices:
            raise ValueError(
                f"{self.policy!r} needs each example's dataset index, but the source provides "
                "none; pass a DataLoader over a map-style dataset, or index_key= naming the "
                "batch field that holds the indices"
            )
        self.seed = check_int("seed", seed, minimum=0)
        self.rank = self._default_rank() if rank is None else check_int("rank", rank, minimum=0)
        self._rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=(self.rank,)))
        )
        # A second stream for counter-based decisions (Stale-SB), also from (seed, rank).
        key = np.random.SeedSequence(self.seed, spawn_key=(self.rank, 1)).generate_state(1)[0]
        self.policy.attach(self._source.dataset_size, int(key))
        self._subset = self._subset_mask(subset)
        self._feature_cache = self._make_feature_cache(cache_features, frozen_prefix, autocast)
        source_bs = self._source.batch_size
        if batch_size is None:
            if source_bs is None:
                raise ValueError(
                    "batch_size could not be taken from the source; pass batch_size= (the number "
                    "of examples per training batch)"
                )
            batch_size = source_bs
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.selection_batch_size = (
            None
            if selection_batch_size is None
            else check_int("selection_batch_size", selection_batch_size, minimum=1)
        )
        self.remainder = check_choice("remainder", remainder, _REMAINDERS)
        self.nonfinite = check_choice("nonfinite", nonfinite, _NONFINITE)
        self.cdf = check_choice("cdf", cdf, _CDFS)
        self.prefetch = (
            self._default_prefetch()
            if prefetch is None
            else check_int("prefetch", prefetch, minimum=0)
        )
        self._sync: RankSync | None = make_sync(distributed, process_group)
        if min_batch_size is None:
            has_bn = any(isinstance(m, _BATCHNORM) for m in model.modules())
            min_batch_size = 2 if has_bn else 1
        self.min_batch_size = check_int("min_batch_size", min_batch_size, minimum=1)
        if self.min_batch_size > self.batch_size:
            raise ValueError(
                f"min_batch_size should be <= batch_size={self.batch_size}, but got "
                f"min_batch_size={self.min_batch_size}"
            )
        self._device = torch.device(device) if device is not None else None
        if autocast is not None and not isinstance(autocast, torch.dtype):
            raise TypeError(
                f"autocast should be a torch.dtype such as torch.bfloat16, but got {autocast!r}"
            )
        self.autocast = autocast
        self.memory_format = memory_format
        self.input_key, self.target_key = input_key, target_key
        self.eval_selection = bool(eval_selection)
        self.stats = LoaderStats()
        self.epoch = 0
        self._format: B.BatchFormat | None = None
        self._pending = _Pending(self.keep_logits)
        self._position = 0  # source batches consumed in the current epoch
        self._active = False  # an epoch has started and not finished
        self._resume = False  # the next epoch iterator continues a restored, unfinished epoch

    def _make_feature_cache(
        self, cache: Any, prefix: nn.Module | None, autocast: Any
    ) -> FeatureCache | None:
        """The cross-epoch cache of prefix outputs, or None; checked."""
        if cache is False or cache is None:
            return None
        if prefix is None:
            raise ValueError(
                "cache_features caches frozen_prefix's outputs, but got frozen_prefix=None; pass "
                "frozen_prefix=backbone (and model=head), or cache_features=False"
            )
        size = self._source.dataset_size
        if not self._source.has_indices or size is None:
            raise ValueError(
                "cache_features keys the cache by dataset index, but the source provides none; "
                "pass a DataLoader over a map-style dataset, or cache_features=False"
            )
        device = None if cache is True else torch.device(cache)
        dtype = autocast if isinstance(autocast, torch.dtype) else None
        return FeatureCache(size, device, dtype)

    def _default_prefetch(self) -> int:
        """1 for a DataLoader with worker processes, else 0 (see ``prefetch``)."""
        loader = getattr(self._source, "loader", None)
        workers = (
            getattr(loader, "num_workers", 0) if isinstance(self._source, DataLoaderSource) else 0
        )
        return 1 if workers > 0 else 0

    # ------------------------------------------------------------------ public helpers
    @property
    def device(self) -> torch.device:
        """Where yielded batches live: ``device`` if given, else the model's device."""
        return self._device if self._device is not None else _model_device(self.model)

    @property
    def source(self) -> Source:
        return self._source

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
        current = self.stats.current
        if not self._active or current is None:
            return float(self.epoch)
        size = self._source.epoch_size
        if size:
            drawn = current.examples_seen + current.excluded
            return float(self.epoch + min(drawn / size, 1.0))
        try:
            n = len(self._source)
        except TypeError:
            return float(self.epoch)
        return float(self.epoch + (min(self._position / n, 1.0) if n else 0.0))

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
        if not self.policy.passthrough:
            raise TypeError(
                f"len() is undefined for a SelectiveLoader with {self.policy!r}: the number of "
                "batches per epoch is random. Use loader.expected_batches() for an estimate, or "
                "key schedules on loader.progress"
            )
        n = len(self._source)
        size, bs = self._source.epoch_size, self._source.batch_size
        drop_last = getattr(getattr(self._source, "loader", None), "drop_last", False)
        if size is not None and bs and not drop_last and 0 < size % bs < self.min_batch_size:
            n -= 1  # the source's last batch is too small and will be dropped
        return n

    def __iter__(self) -> Iterator[B.SelectedBatch]:
        return self._epoch_iter()

    # ------------------------------------------------------------------ the epoch
    @staticmethod
    def _default_rank() -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _begin_epoch(self) -> tuple[EpochStats, int]:
        """Start (or, after ``load_state_dict``, continue) an epoch; returns the batches to skip."""
        if self._resume:
            self._resume = False
            self._source.set_epoch(self.epoch)
            self.policy.begin_epoch(self.epoch)
            current = self.stats.current
            if current is None or current.epoch != self.epoch:
                current = self.stats.begin_epoch(self.epoch, self.policy.target_rate)
            return current, self._position
        if self._active:  # the previous epoch was abandoned part-way (e.g. ``break``)
            self.epoch += 1
        self._position = 0
        self._active = True
        self._source.set_epoch(self.epoch)
        self.policy.begin_epoch(self.epoch)
        return self.stats.begin_epoch(self.epoch, self.policy.target_rate), 0

    def _end_epoch(self, stats: EpochStats) -> None:
        self._active = False
        self._position = 0
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

    def _epoch_iter(self) -> Iterator[B.SelectedBatch]:
        self._forward.check(self.model, self.selector)  # a frozen prefix may have been unfrozen
        _check_device(self.device, self._device is not None)
        resumed = self._resume
        stats, skip = self._begin_epoch()
        fresh = self.policy.needs_losses(stats.epoch)
        passthrough = self.policy.passthrough
        filtering = self._source.can_filter
        keep, tally = self._keep_fn() if filtering else (None, [0, 0])
        fetch = self._fetcher(lambda: self._source.epoch(skip, keep), lambda: tuple(tally))
        counted = (0, 0)
        if self._sync is not None:
            self._sync.bind(self.device)
        start = perf_counter()
        try:
            # NOTE: on several ranks the condition must not depend on the rank's own position:
            # a rank that had loaded no source batch yet (skip == 0) still takes part.
            if skip or (resumed and self._sync is not None):
                # Resuming mid-epoch: first yield the batches the saved round still owed, so that
                # the next selection pass runs after the caller's steps on them, as it would have.
                for _ in range(self._agree(self._pending.count // self.batch_size)):
                    yield from self._yield(
                        self._pending.pop(self.batch_size), self.batch_size, stats
                    )
            while True:
                t0 = perf_counter()
                try:
                    (raw, indices), now = fetch.next()
                except StopIteration:
                    self._count_unloaded(stats, counted, fetch.last_tally)
                    break
                stats.source_s += perf_counter() - t0
                # Examples left out before loading, up to this batch.
                counted = self._count_unloaded(stats, counted, now)
                self._position += 1
                device = self.device  # NOTE: looked up once per source batch (it walks the model)
                columns, n = self._columns(raw, indices, device)
                if self._subset is not None and not filtering:
                    loaded = n
                    columns, indices, n = self._restrict(columns, indices)
                    stats.excluded += loaded - n
                stats.examples_seen += n
                if passthrough:
                    out = columns + self._passthrough_meta(n, indices, device)
                    out += self._cached_features(columns, None, None, indices, stats)
                    out += self._logits(None, None, n, device)
                    stats.examples_selected += n
                    if self._agree(int(n >= self.min_batch_size)):
                        yield from self._yield(out, n, stats)
                    else:
                        stats.dropped += n
                    continue
                t0 = perf_counter()
                losses, values, features, logits = (
                    self._selection_pass(columns, indices, stats)
                    if fresh
                    else (None, None, None, None)
                )
                choice = self._decide(values, indices, n, stats)
                stats.selection_s += perf_counter() - t0
                k = len(choice.positions)
                stats.examples_selected += k
                if k:
                    taken = self._take(columns, choice, indices, losses, device)
                    taken += self._cached_features(
                        columns, choice.positions, features, indices, stats
                    )
                    taken += self._logits(logits, choice.positions, k, device)
                    self._pending.add(taken, k)
                for _ in range(self._agree(self._pending.count // self.batch_size)):
                    yield from self._yield(
                        self._pending.pop(self.batch_size), self.batch_size, stats
                    )
            if self._sync is not None:
                yield from self._drain(stats, passthrough)
            # NOTE: on several ranks a rank may hold more than a batch here (the others select
            # less); "short" then yields one batch of at most batch_size on every rank or on
            # none, and drops the rest, so that batch counts stay equal.
            short = int(self._pending.count >= self.min_batch_size)
            if self.remainder == "short" and self._agree(short, active=False):
                n = min(self._pending.count, self.batch_size)
                yield from self._yield(self._pending.pop(n), n, stats)
            if self.remainder != "carry":
                stats.dropped += self._pending.clear()
        finally:
            fetch.close()
            stats.wall_s += perf_counter() - start
        self._end_epoch(stats)

    # ------------------------------------------------------------------ several ranks
    def _agree(self, ready: int, active: bool = True) -> int:
        """How many of ``ready`` batches to yield now: all of them on one process; on several
        ranks the fewest any rank has ready, so that every rank makes the same number of steps."""
        if self._sync is None:
            return ready
        return self._sync.agree(ready, active)[0]

    def _sharing(self) -> bool:
        """Whether the ranks exchange selection losses every round (``cdf="global"``, or a
        policy with per-example records such as Stale-SB's store)."""
        return self._sync is not None and (self.cdf == "global" or self.policy.records_examples)

    def _decide(
        self,
        values: np.ndarray | None,
        indices: np.ndarray | None,
        n: int,
        stats: EpochStats,
    ) -> Choice:
        """:meth:`_choose`; when the ranks share losses, between observing the lower ranks' and
        the higher ranks' losses, so that every rank's policy sees the same losses in the same
        order (identical loss windows under ``cdf="global"``)."""
        if not self._sharing():
            return self._choose(values, indices, n, stats)
        assert self._sync is not None
        shared = self._sync.exchange(values, None if values is None else indices)
        rank = self._sync.rank
        self._observe(shared[:rank])
        choice = self._choose(values, indices, n, stats)
        self._observe(shared[rank + 1 :])
        return choice

    def _observe(self, shared: list[tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Feed other ranks' finite losses (and their indices) to the policy, in rank order."""
        for values, indices in shared:
            finite = np.isfinite(values)
            if finite.any():
                idx = None if indices is None else indices[finite]
                self.policy.observe(values[finite], idx, cdf=self.cdf == "global")

    def _drain(self, stats: EpochStats, passthrough: bool) -> Iterator[B.SelectedBatch]:
        """Take part in the other ranks' rounds once this rank's source is exhausted.

        Each round mirrors one of a rank that still has source batches (an exchange when the
        ranks share losses, then one agreement) with no new data; it ends when no rank has any.

        NOTE: without this, a rank with fewer source batches (an uneven source, Stale-SB's
        prefiltering) would stop making collectives while the others wait in theirs.
        """
        assert self._sync is not None
        sharing = self._sharing() and not passthrough
        while True:
            if sharing:
                self._observe(self._sync.exchange(None, None))
            ready = self._pending.count // self.batch_size
            count, active = self._sync.agree(ready, active=False)
            for _ in range(count):
                yield from self._yield(self._pending.pop(self.batch_size), self.batch_size, stats)
            if not active:
                return

    def _yield(
        self, columns: list[B.Column], n: int, stats: EpochStats
    ) -> Iterator[B.SelectedBatch]:
        """Yield a batch built from data columns followed by the four metadata columns (and the
        frozen prefix's outputs), timing the caller's work until it asks for the next one."""
        assert self._format is not None
        nfields = len(self._format.keys)
        data = columns[:nfields]
        in_pos = self._format.position(self._format.input_key)
        x = data[in_pos]
        if self.memory_format is not None and isinstance(x, torch.Tensor) and x.dim() == 4:
            # NOTE: index_select and cat return the default layout; restore the requested one
            # (a no-op when the batch already has it, e.g. passthrough batches).
            data[in_pos] = x.contiguous(memory_format=self.memory_format)
        batch = self._format.build(data)
        indices, losses, probs, weights = columns[nfields : nfields + 4]
        if self.policy.normalize_weights:
            weights = weights / weights.mean()
        batch._set_meta(indices if self._source.has_indices else None, losses, probs, weights)
        extra = columns[nfields + 4 :]
        if self._forward.frozen_prefix is not None:
            batch.features = extra.pop(0)
        if self.keep_logits:
            logits = extra.pop(0)
            unknown = logits.dim() == 2 and logits.shape[1] == 0  # no selection pass yet
            batch.logits = None if unknown else logits
        stats.examples_yielded += n
        stats.batches_yielded += 1
        handed_out = perf_counter()
        yield batch
        stats.consumer_s += perf_counter() - handed_out

    def _subset_mask(self, subset: Any) -> np.ndarray | None:
        """A boolean mask over dataset indices from ``subset``, or None; checked."""
        if subset is None:
            return None
        if not self._source.has_indices:
            raise ValueError(
                "subset= selects examples by dataset index, but the source provides none; pass "
                "a DataLoader over a map-style dataset, or index_key= naming the index field"
            )
        if isinstance(subset, torch.Tensor):
            subset = subset.cpu().numpy()
        idx = np.asarray(subset)
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise TypeError(
                f"subset should be a 1-d sequence of integer dataset indices, but got dtype "
                f"{idx.dtype} with shape {idx.shape}"
            )
        size = self._source.dataset_size
        if size is None:
            size = int(idx.max()) + 1 if idx.size else 0
        if idx.size and (idx.min() < 0 or idx.max() >= size):
            raise ValueError(
                f"subset should hold dataset indices in [0, {size}), but got values from "
                f"{idx.min()} to {idx.max()}"
            )
        mask = np.zeros(size, dtype=bool)
        mask[idx] = True
        return mask

    def _in_subset(self, indices: np.ndarray) -> np.ndarray:
        assert self._subset is not None
        inside = (indices >= 0) & (indices < self._subset.shape[0])
        return inside & self._subset[np.where(inside, indices, 0)]

    def _keep_fn(self) -> tuple[Any, list[int]]:
        """What a filtering source should load this epoch: the subset, minus what the policy
        rejects before loading (Stale-SB's stale epochs); None when everything is loaded. And a
        two-element tally, [rejected by the policy, outside the subset], advanced by whichever
        thread loads.

        NOTE: a resumed epoch filters its skipped batches again; the checkpoint's stats already
        count those, so they are not counted twice. A DataLoader with worker processes draws
        index batches ahead of those it hands out (``prefetch_factor``), so there the counts (and
        ``progress``) run ahead by the batches in flight: stats only, never the selections.
        """
        tally = [0, 0]
        policy_filters = self.policy.prefilter(np.zeros(0, dtype=np.int64)) is not None
        if self._subset is None and not policy_filters:
            return None, tally

        def keep(indices: np.ndarray) -> np.ndarray:
            mask = (
                self._in_subset(indices)
                if self._subset is not None
                else np.ones(len(indices), dtype=bool)
            )
            counting = not getattr(self._source, "replaying", False)
            if counting:
                tally[1] += int(len(indices) - mask.sum())
            if policy_filters:
                chosen = self.policy.prefilter(indices[mask])
                assert chosen is not None
                if counting:
                    tally[0] += int(mask.sum() - chosen.sum())
                mask[np.flatnonzero(mask)[~chosen]] = False
            return mask

        return keep, tally

    @staticmethod
    def _count_unloaded(
        stats: EpochStats, counted: tuple[int, int], now: tuple[int, int]
    ) -> tuple[int, int]:
        """Add the candidates left out before loading since ``counted`` to ``stats``."""
        rejected, excluded = now[0] - counted[0], now[1] - counted[1]
        stats.examples_seen += rejected
        stats.prefiltered += rejected
        stats.excluded += excluded
        return now

    def _fetcher(
        self, make_iter: Callable[[], Iterator[Any]], tally: Callable[[], tuple[int, int]]
    ) -> Prefetcher[Any] | Synchronous[Any]:
        """The epoch's source batches, fetched ``prefetch`` ahead on a thread, or on demand."""
        if self.prefetch:
            return Prefetcher(make_iter, self.prefetch, tally)
        return Synchronous(make_iter, tally)

    def _restrict(
        self, columns: list[B.Column], indices: np.ndarray | None
    ) -> tuple[list[B.Column], np.ndarray | None, int]:
        """Drop the rows outside ``subset`` from a loaded batch (sources that cannot filter)."""
        assert indices is not None
        positions = np.flatnonzero(self._in_subset(indices))
        if len(positions) == len(indices):
            return columns, indices, len(indices)
        pos_t = torch.from_numpy(positions)
        pos_list = positions.tolist()
        taken = [B.take(c, pos_t, pos_list) for c in columns]
        return taken, indices[positions], len(positions)

    def _columns(
        self, raw: Any, indices: np.ndarray | None, device: torch.device
    ) -> tuple[list[B.Column], int]:
        """The source batch as columns on ``device``, checked for consistent lengths."""
        if self._format is None:
            self._format = B.BatchFormat.infer(raw, self.input_key, self.target_key)
        fmt = self._format
        in_pos = fmt.position(fmt.input_key)
        columns = [
            B.to_column(v, device, self.memory_format if j == in_pos else None)
            for j, v in enumerate(fmt.columns(raw))
        ]
        n = B.column_length(columns[in_pos], fmt.input_key)
        for key, col in zip(fmt.keys, columns):
            if B.column_length(col, key) != n:
                raise ValueError(
                    f"field {key!r} of a source batch has {B.column_length(col, key)} entries but "
                    f"the input field {fmt.input_key!r} has {n}; every field needs one entry per "
                    "example"
                )
        if indices is not None and indices.shape[0] != n:
            raise ValueError(
                f"the source batch has {n} examples but {indices.shape[0]} dataset indices"
            )
        return columns, n

    def _selection_pass(
        self, columns: list[B.Column], indices: np.ndarray | None, stats: EpochStats
    ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor | None, torch.Tensor | None]:
        """Selection losses of a source batch (where the model computed them, and as float64 on
        the host for the policy), the frozen prefix's outputs (or None), and the model's outputs
        (with ``keep_logits``, else None)."""
        fmt = self._format
        assert fmt is not None
        inputs = columns[fmt.position(fmt.input_key)]
        targets = columns[fmt.position(fmt.target_key)]
        n = inputs.shape[0]
        t0 = perf_counter()
        cached = None
        if self._feature_cache is not None:
            cached = self._prefix_outputs(inputs, indices, None, stats)
        elif self._forward.frozen_prefix is not None:
            stats.prefix_forwards += n
        losses, features, logits = self._forward(
            unwrap(self.selector if self.selector is not None else self.model),
            inputs,
            targets,
            self.loss_fn,
            batch_size=self.selection_batch_size,
            autocast_dtype=self.autocast,
            eval=self.eval_selection,
            features=cached,
            keep_outputs=self.keep_logits,
        )
        if logits is not None:
            self._logits_shape = tuple(logits.shape[1:])
        # NOTE: the policy needs the losses on the host anyway; copying them inside the timed
        # region makes the time exact on a GPU too (it waits for the forward to finish, and for
        # any training work still queued before it).
        values = losses.detach().cpu().numpy().astype(np.float64)
        stats.selection_forward_s += perf_counter() - t0
        stats.selection_forwards += n
        step = self.selection_batch_size or n
        stats.selection_calls += math.ceil(n / step)
        return losses, values, features, logits

    def _logits(
        self,
        logits: torch.Tensor | None,
        positions: np.ndarray | None,
        k: int,
        device: torch.device,
    ) -> list[B.Column]:
        """With ``keep_logits``, one extra column: the chosen rows of the selection pass's
        outputs, or NaN rows when the examples had no selection pass.

        NOTE: before any selection pass the rows' shape is unknown; they are then (k, 0), and
        widened to NaN rows of the right shape when they meet real outputs in a batch.
        """
        if not self.keep_logits:
            return []
        if logits is not None:
            assert positions is not None  # only selection passes have outputs
            return [logits.index_select(0, torch.from_numpy(positions).to(logits.device))]
        shape = self._logits_shape if self._logits_shape is not None else (0,)
        return [torch.full((k, *shape), float("nan"), device=device)]

    def _prefix_outputs(
        self,
        inputs: torch.Tensor,
        indices: np.ndarray | None,
        positions: np.ndarray | None,
        stats: EpochStats,
    ) -> torch.Tensor:
        """The frozen prefix's outputs for rows ``positions`` (all if None) of ``inputs``,
        from the cross-epoch cache where it holds them; computed (and cached) otherwise."""
        cache = self._feature_cache
        rows = np.arange(inputs.shape[0]) if positions is None else positions

        def compute(x: torch.Tensor) -> torch.Tensor:
            return self._forward.features(x, self.selection_batch_size, self.autocast)

        if positions is not None:
            pos = torch.from_numpy(positions).to(inputs.device, non_blocking=True)
            inputs = inputs.index_select(0, pos)
        if cache is None:
            stats.prefix_forwards += inputs.shape[0]
            return compute(inputs)
        assert indices is not None
        idx = indices[rows]
        stats.prefix_forwards += cache.check(self.epoch, idx, inputs, compute)
        missing = cache.missing(idx)
        if len(missing):
            x = inputs.index_select(0, torch.from_numpy(missing).to(inputs.device))
            cache.put(idx[missing], compute(x))
            stats.prefix_forwards += len(missing)
        return cache.get(idx, inputs.device)

    def _cached_features(
        self,
        columns: list[B.Column],
        positions: np.ndarray | None,
        features: torch.Tensor | None,
        indices: np.ndarray | None,
        stats: EpochStats,
    ) -> list[B.Column]:
        """The frozen prefix's outputs for rows ``positions`` (all rows if None), as a list of
        one extra column; empty without a frozen prefix.

        Outputs from the selection pass are gathered (a copy); without one (passthrough and
        loss-free policies), the prefix runs on the chosen rows only.
        """
        if self._forward.frozen_prefix is None:
            return []
        if features is not None:
            if positions is None:
                return [features]
            pos = torch.from_numpy(positions).to(features.device, non_blocking=True)
            return [features.index_select(0, pos)]
        fmt = self._format
        assert fmt is not None
        inputs = columns[fmt.position(fmt.input_key)]
        t0 = perf_counter()
        features = self._prefix_outputs(inputs, indices, positions, stats)
        elapsed = perf_counter() - t0
        stats.selection_s += elapsed
        stats.selection_forward_s += elapsed
        return [features]

    def _choose(
        self,
        values: np.ndarray | None,
        indices: np.ndarray | None,
        n: int,
        stats: EpochStats,
    ) -> Choice:
        """Ask the policy, handling non-finite losses so that the policy never sees them."""
        if values is None:
            return self.policy.choose(None, indices, self._rng, n)
        finite = np.isfinite(values)
        if finite.all():
            return self.policy.choose(values, indices, self._rng, n)
        bad = np.flatnonzero(~finite)
        stats.nonfinite += len(bad)
        if self.nonfinite == "raise":
            where = indices[bad[:5]].tolist() if indices is not None else bad[:5].tolist()
            raise FloatingPointError(
                f"{len(bad)} selection losses are not finite (dataset indices {where}...); pass "
                "nonfinite='skip' or nonfinite='select' to continue past them"
            )
        good = np.flatnonzero(finite)
        sub = self.policy.choose(
            values[good], None if indices is None else indices[good], self._rng, len(good)
        )
        probabilities = np.zeros(n, dtype=np.float64)
        probabilities[good] = sub.probabilities
        positions, weights = good[sub.positions], sub.weights
        if self.nonfinite == "select":
            probabilities[bad] = 1.0
            positions = np.concatenate([positions, bad])
            weights = np.concatenate([weights, np.ones(len(bad))])
            order = np.argsort(positions, kind="stable")
            positions, weights = positions[order], weights[order]
        return Choice(positions, probabilities, weights)

    def _meta(
        self,
        choice: Choice,
        indices: np.ndarray | None,
        losses: torch.Tensor | None,
        device: torch.device,
    ) -> list[B.Column]:
        """The four metadata columns for the chosen examples: indices, losses, P, weights."""
        pos = choice.positions
        idx = torch.from_numpy(indices[pos] if indices is not None else np.full(len(pos), -1))
        pos_t = torch.from_numpy(pos)
        if losses is None:
            kept_losses = torch.full((len(pos),), float("nan"), device=device)
        else:
            kept_losses = losses.index_select(0, pos_t.to(losses.device, non_blocking=True))
        probs = torch.from_numpy(choice.probabilities[pos].astype(np.float32)).to(device)
        weights = torch.from_numpy(choice.weights.astype(np.float32)).to(device)
        return [idx.to(torch.int64), kept_losses, probs, weights]

    def _passthrough_meta(
        self, n: int, indices: np.ndarray | None, device: torch.device
    ) -> list[B.Column]:
        """:meth:`_meta` for a whole source batch chosen without a selection pass (the same
        columns as ``_meta(Choice.everything(n), indices, None, device)``, made directly)."""
        idx = (
            torch.from_numpy(indices.astype(np.int64))  # a copy: sources may reuse their buffers
            if indices is not None
            else torch.full((n,), -1, dtype=torch.int64)
        )
        return [
            idx,
            torch.full((n,), float("nan"), device=device),
            torch.ones(n, device=device),
            torch.ones(n, device=device),
        ]

    def _take(
        self,
        columns: list[B.Column],
        choice: Choice,
        indices: np.ndarray | None,
        losses: torch.Tensor | None,
        device: torch.device,
    ) -> list[B.Column]:
        """Gather the chosen rows of every column where it lives, plus the metadata columns."""
        pos_t = torch.from_numpy(choice.positions)
        pos_list = (
            choice.positions.tolist()
            if any(not isinstance(c, torch.Tensor) for c in columns)
            else None
        )
        device_pos = pos_t.to(device, non_blocking=True)
        data = [B.take(c, device_pos, pos_list) for c in columns]
        return data + self._meta(choice, indices, losses, device)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: epoch, position, generator, policy, pending batch, stats.

        Tensors of the pending (carried) batch are moved to the CPU; the rest is plain Python
        and JSON-serialisable. Restore with :meth:`load_state_dict` on a loader built with the
        same arguments.
        """
        pending = [
            [c.cpu() if isinstance(c, torch.Tensor) else list(c) for c in part]
            for part in self._pending.parts
        ]
        f = self._format
        fmt = None
        if f is not None:
            fmt = {
                "kind": f.kind.__name__,
                "keys": list(f.keys),
                "input_key": f.input_key,
                "target_key": f.target_key,
            }
        return {
            "version": self.STATE_VERSION,
            "seed": self.seed,
            "rank": self.rank,
            "epoch": self.epoch,
            "position": self._position,
            "active": self._active,
            "rng": self._rng.bit_generator.state,
            "source": self._source.state_dict(),
            "policy": self.policy.state_dict(),
            "pending": {"count": self._pending.count, "parts": pending},
            "logits_shape": None if self._logits_shape is None else list(self._logits_shape),
            "format": fmt,
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` (at an epoch boundary or mid-epoch)."""
        version = state.get("version")
        if version != self.STATE_VERSION:
            raise ValueError(
                f"SelectiveLoader state has version={version!r}, but this sbloader reads "
                f"version {self.STATE_VERSION}"
            )
        self._source.load_state_dict(
            state["source"], mid_epoch=bool(state["active"]) and int(state["position"]) > 0
        )
        self.epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._active = bool(state["active"])
        self._resume = self._active
        self._rng.bit_generator.state = state["rng"]
        self.policy.load_state_dict(state["policy"])
        shape = state.get("logits_shape")
        self._logits_shape = None if shape is None else tuple(int(v) for v in shape)
        device = self.device
        self._pending = _Pending(self.keep_logits)
        for part in state["pending"]["parts"]:
            cols = [c.to(device) if isinstance(c, torch.Tensor) else list(c) for c in part]
            self._pending.add(cols, B.column_length(cols[0], "pending"))
        # The batch format, so that a restored pending batch can be yielded before (or without)
        # another source batch, e.g. a short last batch.
        fmt = state.get("format")
        if fmt is not None:
            kind = {"dict": dict, "list": list, "tuple": tuple}[fmt["kind"]]
            keys = tuple(fmt["keys"])
            self._format = B.BatchFormat(kind, keys, fmt["input_key"], fmt["target_key"])
        self.stats.load_state_dict(state["stats"])

    def __repr__(self) -> str:
        return (
            f"SelectiveLoader(policy={self.policy!r}, batch_size={self.batch_size}, "
            f"remainder={self.remainder!r}, seed={self.seed})"
        )
