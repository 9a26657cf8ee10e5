"""SelectiveLoader: a drop-in replacement for a training DataLoader that yields only the examples
worth backpropagating, in full training batches that carry the selection pass's results.

The loader holds configuration and cross-epoch state; an :class:`~sbloader.epoch.EpochIterator`
(what ``iter(loader)`` returns) runs each epoch.
"""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from ._checks import (
    INDEX_FIX,
    NotADataLoader,
    check_bool,
    check_choice,
    check_device,
    check_device_name,
    check_float,
    check_int,
    indices_needed,
)
from ._epoch_warnings import (
    backlog_warning,
    drifted_backlog,
    left_saved_warning,
    nothing_yielded_warning,
    peek_warning,
)
from ._loader_checks import (
    check_memory_format,
    check_metadata_key,
    check_modules,
    check_pad_values,
    check_planned_epochs,
    check_remainder,
    checked_min_batch_size,
    dropped_index_key,
    training_batch_size,
)
from ._loader_state import (
    K_ACTIVE,
    K_AHEAD,
    K_AUTOCAST,
    K_CODEC,
    K_DEVICE_RNG,
    K_EPOCH,
    K_FEEDBACK,
    K_IDENTITY,
    K_PENDING,
    K_POLICY,
    K_POSITION,
    K_PREFILTER,
    K_RETURNED,
    K_RNG,
    K_SCORER,
    K_SHARE,
    K_SOURCE,
    K_SPEED,
    K_STATS,
    K_TRAINING,
    K_VERSION,
    checked_state,
    identity,
    mid_epoch_warning,
    speed_options,
    unreported_warning,
    warn_other_speed,
)
from ._migrations import loader_state_v1_to_v2
from ._owners import check_owner, claim
from ._state import rollback_state, taking_rollback
from .adapt import make_source
from .codec import BatchCodec
from .decisions import NONFINITE, load_kernels, prefilters, subset_mask
from .device_decisions import DecisionGenerator
from .distributed import (
    RankSync,
    agree_configuration,
    agree_pass_length,
    agree_position,
    batch_digest,
    check_unsynced,
    is_distributed,
    make_sync,
)
from .epoch import MAX_UNCONSUMED, EpochIterator, _describe, _raise_own, pass_fraction
from .features import make_feature_cache
from .feedback import FeedbackBuffer, check_reported, checked, unindexed
from .length import (
    FixedEpochIterator,
    FixedEpochs,
    batches_at,
    check_batches_per_epoch,
    check_fills_a_batch,
    expected_count,
    pass_examples,
    pass_length,
    planned_passes,
)
from .overlap import AheadScores, SelectionCopy
from .policies import NO_STORE_FIX, Policy, check_policy, default_policy
from .precision import (
    AUTO,
    check_autocast,
    selection_dtype,
)
from .quantize import QuantizedSelection, QuantizedSelector
from .quantize import resolve as resolve_quantized
from .rows import PendingRows, Rows, WholeBatch
from .scoring import Scorer
from .selection import (
    FieldsForward,
    Forward,
    Output,
    SelectionForward,
    check_loss_fn,
    concrete_device,
    input_fields,
    is_fsdp,
    model_device,
    unwrap,
)
from .sources import Source
from .stats import EpochStats, LoaderStats

__all__ = ["SelectiveLoader"]

logger = logging.getLogger("sbloader")


_REMAINDERS = ("carry", "short", "drop")
_CDFS = ("local", "global")
_DECISIONS = ("host", "device")


class SelectiveLoader(NotADataLoader):
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
            (indices from its index field, see :mod:`sbloader.ffcv`), torchdata's
            ``StatefulDataLoader`` or streaming's ``StreamingDataLoader`` (resumed through their
            own state; other such loaders through :class:`~sbloader.StatefulSource`), or any
            re-iterable of batches (indices then come from the field ``index_key``, or are
            unknown).
        model: the model being trained. Selection passes call its unwrapped module (DDP,
            DataParallel and ``torch.compile`` wrappers are looked through); an FSDP-sharded
            model is called as it is, under ``no_grad``, as many times on every rank (see
            :mod:`sbloader.distributed`). With
            ``frozen_prefix``, the trainable part that runs on the prefix's outputs (the head).
        loss_fn: per-example loss, ``loss_fn(model(inputs), targets)`` of shape ``(B,)``.
            Default ``nn.CrossEntropyLoss(reduction="none")``, for class labels (or class
            probabilities); a cross-entropy over outputs of one class (a binary classifier of
            one logit) or over multi-hot targets (rows not summing to 1) is refused on the
            first batch, naming a per-example BCE to pass instead.
        policy: the selection policy. Default :func:`~sbloader.policies.default_policy`: one
            Random-Backprop epoch at 1/3, then Stale-SB at 1/3 with a selection pass every
            third epoch (every tenth while the training loop reports its losses with
            :meth:`feedback`; every epoch where the source gives no dataset indices, or an
            iterable source no ``dataset_size=``: no per-example store then), and with
            ``planned_epochs`` all the data in the last eighth of the run's passes; logged. The
            paper's plain SB is
            ``SelectiveBackprop(1 / 3)``.
        seed: seeds the loader's own generator (the only randomness it uses).
        batch_size: examples per yielded training batch. Default: the source's batch size.
            Under every policy, Traditional's included: a passthrough policy hands out the
            source's batches as they are when they have this size, and re-batches them (every
            example once per pass, in order, the rest as one short last batch) when not.
        selection_batch_size: examples per selection forward (chunks of a source batch). Default:
            the whole source batch in one forward. A source batch larger than the training batch
            makes selection cheaper per example.
        remainder: what happens to selected examples that do not fill a batch when an epoch ends:
            ``"carry"`` (default, the paper's Algorithm 1) keeps them for the next epoch's first
            batch; ``"short"`` yields them as a short batch; ``"drop"`` drops them (counted in
            ``stats``). With ``batches_per_epoch`` this applies at the end of each pass over the
            data; ``"short"`` is then refused (a short batch would fall inside a training epoch).
            A passthrough policy (Traditional) yields a pass's rest as a short batch, as the
            source's own last batch would be, whether ``"carry"`` or ``"short"``; ``"drop"``
            drops it (counted), as a DataLoader's ``drop_last`` does.
        batches_per_epoch: fix the number of training batches per epoch, so that ``len(loader)``
            is exact (``OneCycleLR(steps_per_epoch=len(loader))``, ``tqdm(loader)``,
            Lightning's ``estimated_stepping_batches``): an int, or ``"expected"``, the expected
            number of batches per pass over the data, rounded (examples per epoch x the policy's
            :attr:`~sbloader.Policy.steady_rate`, its rate after any warm-up / ``batch_size``;
            rounded down with ``remainder="drop"``, which drops each pass's rest; for
            ``Traditional`` the exact count; refused when it rounds to 0, and when the source's
            size is unknown: pass ``dataset_size=``). Every epoch then yields exactly that many
            full batches, cut from the same stream of batches as without the option: an epoch
            that needs more goes on into the next pass over the data, and a pass's surplus is
            carried into the next epoch (nothing lost, nothing twice). ``epoch``, ``progress``,
            ``stats`` and policies keyed on epochs (Phased, Stale-SB) count passes over the data,
            ``training_epoch`` counts these epochs (see :mod:`sbloader.length`). With
            ``remainder="drop"``, a policy expected to keep less than ``batch_size`` examples
            per pass is refused (most passes would yield nothing): as the loader is built, or
            after the first pass that yields nothing where the source's size is unknown. Default
            None: an epoch is one pass, of a random number of batches.
        min_batch_size: smaller batches are never yielded (dropped and counted). Default 2 when
            the model has BatchNorm layers (a batch of one makes BatchNorm raise in training)
            and ``batch_size`` is at least 2, else 1 (the default is logged).
        nonfinite: what happens to an example whose selection loss is NaN or infinite: ``"skip"``
            (default: never backpropagated, since its gradient would corrupt the weights),
            ``"select"`` (always backpropagated) or ``"raise"`` (``FloatingPointError``; on
            several ranks raised on every rank, naming the rank that met it, at the end of that
            round). Either way it never enters the policy's loss window and is counted in
            ``stats``.
        device: where yielded batches go. Default: the model's device.
        autocast: the precision of selection passes (training is never changed):
            ``torch.bfloat16`` or ``torch.float16`` to run them under autocast (the dtypes it
            runs; another is refused), None for float32, or ``"auto"``
            (default): bf16 where the selecting model's device computes it natively (a CUDA
            device of compute capability 8.0 or more, an x86 CPU with AVX512-BF16 or AMX; not a
            GPU that only emulates bf16, e.g. a V100 or T4), float32 elsewhere and
            with a ``frozen_prefix`` (its features feed training); see :mod:`sbloader.precision`.
            bf16 ranks losses as float32 does at a fraction of the cost there. The choice is
            logged and is ``loader.autocast``; a saved state records it, and a loader built with
            ``"auto"`` adopts it, so a run resumed on another machine selects as it began (an
            explicit dtype or None is kept as given, with a warning where it differs from the
            saved run's: see :meth:`load_state_dict`). Pass None for float32 selections
            identical on every machine. A model whose own forward runs under ``torch.autocast``
            (``accelerator.prepare(model)`` with ``mixed_precision``) selects in that dtype
            whatever is asked: ``"auto"`` then takes it as the selection precision, and another
            explicit value is refused (``ValueError``, when the loader is built or at the first
            epoch start after the model is prepared).
        memory_format: e.g. ``torch.channels_last``, applied to 4-d inputs before selection and
            training (``torch.channels_last_3d``: to 5-d ones, e.g. videos).
        input_key, target_key: the model input and loss target fields: positions in tuple/list
            batches (default 0 and 1), keys in dict batches (default ``"input"``, ``"target"``).
            A tuple ``input_key`` names several fields, the model's positional inputs:
            ``input_key=("input_ids", "attention_mask")`` scores ``model(ids, mask)``; give
            ``target_key`` with it where the default target is one of those fields (refused on
            the first batch otherwise), and a model that takes other inputs than the pass gives
            it is refused there too (``TypeError``, naming these and ``forward=``). Tuple
            batches of more than two fields with a default ``target_key`` and other tensor
            fields (not dataset ids) are warned of on the first batch. A dict
            batch with tensor fields that the model is not given (neither input nor target nor
            index field) is warned about on the first selection pass: pass ``forward=``.
        index_key: the field holding dataset indices, for sources that carry them themselves.
        drop_index: leave the index field out of yielded batches (``index_key``'s field, or an
            FFCV loader's index output), so that ``for inputs, targets in loader`` works over a
            source of ``(inputs, targets, indices)``; the indices stay in ``batch.indices``.
            ``input_key`` and ``target_key`` still name fields of the source's batches. Default
            False.
        dataset_size: the number of examples, for an iterable source (which cannot tell it): it
            sizes Stale-SB's per-example store and ``subset``, and gives
            :meth:`expected_batches`, ``batches_per_epoch="expected"`` and :attr:`progress` the
            examples per epoch (each pass is taken to yield each example once; dataset indices
            must lie in ``[0, dataset_size)``). Refused when the source knows another size.
            Under DDP, an iterable that streams each rank a shard yields fewer examples per pass
            on each rank than ``dataset_size``: pass ``batches_per_epoch`` an int there.
        selector: a separate (cheaper) model for selection passes. Default: ``model``.
        compile_selection: run selection forwards through ``torch.compile`` of the unwrapped
            selection model, compiled once on first use (``True``, or a dict of
            ``torch.compile`` arguments). Training forwards are not affected.
        selection_scale: resize 4-d inputs by this factor in (0, 1] (bilinear) before the
            selection forward only, e.g. 0.5 (Composer's ``scale_factor``); the model must
            accept the smaller inputs (a model that takes the first candidates at full size
            but not resized is refused on the first selection pass, naming
            ``selection_scale``). Training batches keep full resolution.
        frozen_prefix: activation caching for a frozen backbone: a module without trainable
            parameters whose outputs ``model`` (the head) takes. The selection pass computes
            ``features = frozen_prefix(inputs)`` once (in eval mode, without autograd, under
            ``autocast`` when given: the features are then reduced-precision values, returned
            as float32) and the losses from ``model(features)``; yielded batches carry the
            selected examples' ``batch.features``, so the training step runs only the head:
            ``loss_fn(model(batch.features), targets)``. Refused (``ValueError``) when a prefix
            parameter has ``requires_grad=True``, checked again when each epoch starts (and
            each training epoch, with ``batches_per_epoch``).
        cache_features: with ``frozen_prefix``, keep each example's prefix output across
            epochs, keyed by dataset index (a :class:`~sbloader.features.FeatureCache`): the
            prefix then runs once per example in the whole run, not once per epoch. ``True``
            keeps the cache on the loader's device, a device (e.g. ``"cpu"``) keeps it there.
            Valid only when an example's input is the same every epoch (no random
            augmentation before the prefix): a few cached examples are recomputed each epoch
            and a changed input raises ``ValueError``; a prefix whose weights change in place
            (``load_state_dict``), that is cast or moved (``prefix.to(...)``) or has a layer
            replaced is computed again from the next epoch on. Needs dataset indices. Its
            memory is
            dataset size x prefix output size (in the dtype the prefix returns: the ``autocast``
            dtype when given, unless the prefix's last op runs in float32). Part of
            :meth:`state_dict` only with ``save_feature_cache=True``; otherwise it refills after
            a resume, with features computed among other candidates, which may differ in the
            last bits from those the uninterrupted run cached, so such a resume is not
            bit-exact.
        save_feature_cache: :meth:`state_dict` holds ``cache_features``' rows (a CPU copy:
            dataset size x prefix output size in every checkpoint), so that a resumed run uses
            the saved run's cached outputs: bit-exact, and the prefix does not run again.
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
        convert_inputs: ``convert_inputs(value)``, applied to what each selection forward
            gives the model and ``loss_fn`` (the inputs, after ``frozen_prefix`` or
            ``selection_scale``, the targets, and the batch ``forward=`` takes), for a model
            trained on converted inputs, e.g. one whose parameters are bfloat16 or float64 (the
            source's float32 inputs raised torch's "mat1 and mat2 must have the same dtype"):
            ``convert_inputs=lambda v: v.to(torch.bfloat16) if torch.is_tensor(v) and
            v.is_floating_point() else v`` for a bfloat16 model with a single input field.
            Yielded batches are not converted. Lightning's :func:`selective_loader
            <sbloader.integrations.lightning.selective_loader>` passes the Trainer's precision
            plugin's ``convert_input`` under a true precision (``precision="bf16-true"``,
            ``"16-true"``, ``"64-true"``). Not with ``quantize_selection`` (refused). Default
            None: as they come.
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
        eval_selection: run selection passes in eval mode (default True). With False, a
            selection forward of a single example (a source batch of one) that a BatchNorm
            refuses in train mode (one value per channel, e.g. ``BatchNorm1d`` after a linear
            layer) is run in eval mode instead, with a ``UserWarning`` naming the fixes
            (refused with ``ValueError`` under FSDP, whose forwards run in step on every rank).
        rank: the process's rank, to derive its generator from ``seed``. Default: the
            ``torch.distributed`` rank when initialised (in ``process_group`` where one is
            given), else 0. Accepted without a process
            group: processes that are not one ``torch.distributed`` job draw differently by it.
        distributed: keep the ranks of a DDP job in step (see :mod:`sbloader.distributed`):
            every rank yields the same number of batches per epoch whatever its selections,
            and the end-of-epoch remainder is handled alike on every rank (``"short"``: one
            batch on every rank or on none, of the same size on every rank, the fewest any rank
            holds, up to ``batch_size``). Default None: on when
            ``torch.distributed`` is initialised with more than one rank (build the loader
            after ``init_process_group``: where ``WORLD_SIZE`` says the launcher started
            several processes but no process group is initialised, None is refused, and False
            runs each process on its own).
        process_group: the process group for the loader's collectives. Default: the world.
            Refused without an initialised process group.
        cdf: ``"local"`` (default): each rank's policy ranks losses against its own history;
            ``"global"``: against every rank's, all-gathered per source batch (the ranks'
            loss windows then hold identical contents), for a policy that ranks losses against
            other ranks' (:meth:`Policy.ranks_shared_losses
            <sbloader.Policy.ranks_shared_losses>`); with one that does not (Kath18,
            Random-Backprop, Traditional) it gathers nothing and changes nothing. ``"global"``
            is refused with ``distributed=False`` on several ranks, and on one process without
            a process group it ranks against the process's own losses, as ``"local"``, with a
            warning (a group of one rank: silent, its global CDF being exact).
        prefetch: source batches that wait ready, fetched on a background thread while the
            caller trains (0: fetched on demand); the thread fetches one more while they wait,
            so ``prefetch + 1`` are in memory besides the one being taken. Default: 1 for a
            DataLoader with ``num_workers > 0``, else 0. NOTE: with ``num_workers=0`` the
            dataset's ``__getitem__`` then runs on that thread, so a dataset that draws from
            torch's global RNG (random transforms) would interleave its draws with the training
            step's and runs would not be reproducible: pass ``prefetch=1`` there only for
            datasets without global randomness (such as
            :class:`~sbloader.datasets.ArrayDataset`). FFCV loaders fetch ahead themselves
            (their ``batches_ahead``); ``prefetch`` > 0 is refused for them (see
            :mod:`sbloader.ffcv`).
        metadata_key: also carry the selection results inside each yielded batch, so that they
            survive frameworks that rebuild batches when moving them to a device (Lightning,
            Accelerate's ``send_to_device``): dict batches get this key, tuple and list batches
            one more last element, holding ``{"indices", "losses", "probabilities",
            "weights"}`` (and ``"features"``, ``"logits"`` when kept). Default None: the
            results are only attributes of the batch.
        decisions: where the per-batch decisions of a selection pass run. ``"host"``
            (default): the losses come to the host and the policy decides with the loader's
            numpy generator (for a seed, the same selections wherever the losses are the same: with
            ``autocast=None``, on every machine). ``"device"``:
            on the losses' device (a GPU's, or the CPU's), with a ``torch.Generator`` derived
            from ``seed``: a loss window tensor, draws and gathers by index tensors; the host
            learns how many losses were finite and how many candidates were kept (and the kept
            positions where the source has dataset indices, which stay on the CPU). Different
            draws than ``"host"`` for the same seed, with the same probabilities; resume stays
            exact. For policies whose :meth:`~sbloader.Policy.decides_on_device` is True
            (SelectiveBackprop with ``staleness=1``), without ``keep_logits``, a frozen prefix or
            losses shared across ranks (``cdf="global"``). Measured slower than ``"host"`` on an
            H100 (ResNet-18, pools of 1024: 2.01 s against 1.91 s an SB epoch) and on the CPU.
        planned_epochs: the run's planned epochs, for the default policy: with it, the last
            eighth of the run's passes over the data (at least one) train on all the data, which
            brought it to within half a point of Traditional's final error here, or to it
            (:func:`~sbloader.policies.default_policy`). Without ``batches_per_epoch`` these
            epochs are passes over the data (``loader.epoch``). With it they are training epochs
            of ``batches_per_epoch`` batches (what ``iter(loader)`` yields, and what Lightning
            counts): the policy plans for the most passes ``P >= 2`` expected to fit in
            ``planned_epochs * batches_per_epoch`` batches, an annealed pass yielding all the
            data (:func:`~sbloader.policies.passes_within`), so that its anneal ends within the
            run. For example, 8 training epochs of ``"expected"`` batches (a pass at 1/3) make
            5 or 6 passes as whole batches round (5 for Fashion-MNIST's 60,000 examples in
            source batches of 512 and batches of 128), the last one annealed (about 3 training
            epochs); the batches left after the planned passes, part of one more, train on all
            the data too (there, 630 of the 1,248 batches, about 4 training epochs, do). A run
            too short
            for a selective pass and an annealed one plans 2 passes and warns; where the
            source's size is unknown (no estimate), ``planned_epochs`` is taken as passes, with
            a warning. The passes planned are :attr:`planned_passes`; logged. Refused together
            with ``policy=``, which it would not change, and under DDP where the ranks' differ.
            Lightning's :func:`selective_loader
            <sbloader.integrations.lightning.selective_loader>` passes the Trainer's
            ``max_epochs``. Default None: the default policy does not anneal.
        quantize_selection: run the selection forward through an int8 copy of the (unwrapped)
            selection model on the CPU (``True``, or a :class:`~sbloader.QuantizedSelection` with
            its settings): PyTorch's FX graph-mode post-training quantization for the current
            ``torch.backends.quantized.engine`` (Conv-BN-ReLU fused, int8 weights, activation
            ranges calibrated on the first ``calibration_examples`` candidates of the source
            batch being scored whose inputs are finite; a candidate with a NaN or infinite
            input gets a non-finite loss, as in float). The copy is rebuilt from the model's
            current weights at the first selection pass of every epoch that has selection
            passes (a Stale-SB fresh epoch, every epoch of plain SB) and then every
            ``refresh_examples`` candidates scored (16384 unless set), so selection losses come
            from weights up to that many candidates old. Training forwards are not affected.
            Its refresh clock and the copy's int8 values are part of :meth:`state_dict` (a
            resume scores with the same copy).
            Refused (``ValueError``) with a model torch.fx cannot trace or one with forward
            hooks (which the copy would run without), on a GPU, and with an ``autocast`` dtype,
            ``compile_selection``, ``forward=`` (or a tuple ``input_key``), ``frozen_prefix``,
            ``eval_selection=False``, ``overlap_selection``, ``keep_logits=True`` or an
            FSDP-sharded model; a model with layers that have no int8
            kernels fails on the first source batch (``RuntimeError``). Refreshes are counted in
            ``loader.scorer.quantized.refreshes``; their time is part of the epochs'
            ``selection_forward_s``. Under DDP each rank builds its own copy on its own
            candidates, with no collective. ``"auto"``: the copy where the CPU computes int8
            natively (VNNI or AMX) and none of the above stands in the way (``autocast`` left at
            ``"auto"``, which then gives way to it), else off; a model that cannot be quantized
            then falls back, on the first source batch and with a warning, to the float
            precision ``autocast="auto"`` picks (:func:`sbloader.quantize.resolve`). The choice
            and its reason: :attr:`selection_precision`. Default False.

            NOTE (why not ``"auto"`` by default): measured as the default over 10 seeds on the
            AVX512-VNNI CPU (``benchmarks/results/default_safety_int8/``), ``"auto"`` sped the
            default's one selection pass up but, with a training loop that reports its losses
            (``feedback``), its stale epochs kept fewer examples (156k backprops in 10 epochs
            against 171k) and ended 0.14 points worse on average (worse in 8 of 10 seeds):
            the int8 pass's losses, from a copy up to ``refresh_examples`` candidates old, sit
            above the live model's, and the training losses fed back rank lower against them.
            It did not close the default's gap to Random-Backprop at the loosest target either.
        overlap_selection: run the selection pass of the next source batch on a background
            thread while the caller trains on the batches of the current one (the paper's
            pipelining, :mod:`sbloader.overlap`), with a copy of the selection model refreshed
            from its weights before each pass: a pass scores with the weights as they were
            before the caller's steps on the previous source batch's batches (one source batch
            staler; other selections than without it, and as deterministic). The first source
            batch of each epoch with selection passes is scored at once. What the caller waits
            for is counted in ``selection_forward_s``, the rest of the passes' time in
            ``selection_hidden_s``. Pays only with a core to spare for the thread (the pass and
            the step each use ``torch.get_num_threads()`` intra-op threads). Costs a second
            copy of the selection model's memory. On a GPU the pass runs on a CUDA stream of
            the selection thread's own, beside the training step's kernels (ordered by events,
            no host synchronisation). Refused (``ValueError``) with batches sent to another
            device than the model's (``device=``), with ``compile_selection``,
            ``quantize_selection``, ``frozen_prefix``, ``eval_selection=False`` (a pass in train
            mode would update the copy's BatchNorm statistics, not the model's) and an
            FSDP-sharded model. A model changed after the loader was built (its lazy
            parameters made, a layer replaced, moved to another device or cast to another
            dtype) is copied again at the next pass. Default False.
        pad_values: for sources whose batches are padded to each batch's own longest sequence
            (Hugging Face's ``DataCollatorWithPadding``, ``pad_sequence`` in a ``collate_fn``):
            a dict from a field (a dict batch's key, or a position in tuple/list batches) to the
            value to pad it with, e.g. ``{"input_ids": tokenizer.pad_token_id,
            "attention_mask": 0, "labels": -100}`` (labels take the loss's ignore index, not 0,
            which is a real class). When kept rows of source batches of different lengths are
            joined into a training batch, each field named here is padded at the end of every
            dimension past the first to the longest among them (the widest source batch the
            training batch's rows come from). A key that is no field of the source's batches, or
            a value the field's dtype cannot hold (-100 in a bool mask), is refused on the first
            source batch (``ValueError``). A tensor field without a pad value must keep its
            sizes past dimension 0 across source batches: in an epoch that re-batches kept rows
            (any but a passthrough policy's, such as ``Traditional``, given source batches of
            ``batch_size`` and no ``subset``), the first source batch
            whose sizes differ from an earlier one's raises ``ValueError`` naming the field, when
            it is loaded. Fields inside a nested dict field cannot be padded, and a
            ``frozen_prefix``'s cached features are not (refused together). Default None.

    Attributes:
        stats: a :class:`~sbloader.stats.LoaderStats` with per-epoch and total counts and times.
        epoch: the number of the current (or next) epoch, from 0.
        pending_examples: selected examples waiting for a batch (carried into the next epoch
            with ``remainder="carry"``).
        planned_passes: the passes over the data the default policy plans for with
            ``planned_epochs`` (see there), else None.

    ``iter(loader)`` returns an :class:`~sbloader.epoch.EpochIterator` for the next epoch (or the
    rest of a restored one); a newer iterator closes an older one (see its documentation). With
    ``batches_per_epoch`` it returns a :class:`~sbloader.length.FixedEpochIterator` over the next
    training epoch of ``len(loader)`` batches.

    ``len(loader)`` is ``batches_per_epoch`` when given. Without it, it is exact for passthrough
    policies (Traditional: the pass's examples, within ``subset``, in batches of ``batch_size``
    and a short last one; a ``subset`` of a rank's share of the data raises ``TypeError``; on
    several ranks the fewest batches any rank's pass makes, which every rank yields, agreed as
    the loader is built) and raises ``TypeError`` for selective ones, whose batch count per
    epoch is random: pass ``batches_per_epoch=``, use :meth:`expected_batches`, or schedule by
    :attr:`progress` instead.

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
        ...     policy=sbloader.SelectiveBackprop(1 / 3),
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
        batches_per_epoch: int | Literal["expected"] | None = None,
        min_batch_size: int | None = None,
        nonfinite: str = "skip",
        device: torch.device | str | None = None,
        autocast: torch.dtype | str | None = AUTO,
        memory_format: torch.memory_format | None = None,
        input_key: Hashable | None = None,
        target_key: Hashable | None = None,
        index_key: Hashable | None = None,
        drop_index: bool = False,
        dataset_size: int | None = None,
        selector: nn.Module | None = None,
        compile_selection: bool | dict[str, Any] = False,
        selection_scale: float | None = None,
        frozen_prefix: nn.Module | None = None,
        cache_features: bool | str | torch.device = False,
        save_feature_cache: bool = False,
        keep_logits: bool = False,
        forward: Forward | None = None,
        convert_inputs: Callable[[Any], Any] | None = None,
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
        planned_epochs: int | None = None,
        quantize_selection: bool | str | QuantizedSelection = False,
        overlap_selection: bool = False,
        pad_values: dict[Hashable, bool | int | float] | None = None,
    ) -> None:
        check_modules(model, selector)
        if device is not None:
            device = check_device_name("device", device)
        if dataset_size is not None:
            dataset_size = check_int("dataset_size", dataset_size, minimum=1)
        self._source: Source = make_source(source, index_key, dataset_size)
        # NOTE: the default depends on the source: Stale-SB's store needs dataset indices and
        # the dataset's size.
        store = bool(self._source.has_indices()) and self._source.dataset_size is not None
        planned_epochs = check_planned_epochs(planned_epochs, policy)
        self.planned_epochs = planned_epochs
        # NOTE: with batches_per_epoch, planned_epochs counts training epochs of that many
        # batches, whose passes over the data are known only once it is resolved (below): the
        # default policy is built without them until then (its rates, by which "expected" is
        # resolved, do not depend on them) and rebuilt for them by _plan_passes.
        #: The passes over the data the default policy plans for (anneals the last eighth of):
        #: ``planned_epochs``, or with ``batches_per_epoch`` the passes that many training epochs
        #: are expected to make; None without ``planned_epochs``.
        self.planned_passes: int | None = planned_epochs if batches_per_epoch is None else None
        if policy is None:
            with warnings.catch_warnings():  # (planned_epochs=2 is warned of below, by name)
                warnings.simplefilter("ignore", UserWarning)
                policy_made: Policy = default_policy(store, epochs=self.planned_passes)
        self.policy: Policy = policy_made if policy is None else policy
        check_policy("policy", self.policy, "sbloader.SelectiveBackprop(...)")
        if not self.policy.passthrough():
            load_kernels()  # (once per process: not the first epoch's selection time)
        if policy is None and batches_per_epoch is None and planned_epochs == 2:
            warnings.warn(
                "planned_epochs=2 leaves the default policy no selective epoch: epoch 0 is its "
                "Random-Backprop warm-up and epoch 1, the last eighth of the run (at least one "
                "epoch), trains on all the data; plan at least planned_epochs=3, or pass a "
                "policy (e.g. policy=sbloader.default_policy() anneals nothing)",
                UserWarning,
                stacklevel=2,
            )
        if policy is None and self.planned_passes == planned_epochs:  # else in _plan_passes
            logger.info(
                "policy: %r (the default recipe, chosen for this source%s)",
                self.policy,
                "" if planned_epochs is None else f" and {planned_epochs} planned epochs",
            )
        loss_fn = nn.CrossEntropyLoss(reduction="none") if loss_fn is None else loss_fn
        check_loss_fn(loss_fn)
        keep_logits = check_bool("keep_logits", keep_logits)
        check_memory_format(memory_format)
        # NOTE: "auto" resolves here, once, on the selecting model's device, so that a loader's
        # selections never change precision mid-run; a resumed state brings its own choice.
        self._autocast_requested = check_autocast(autocast)
        # The float precision: what selection passes run in without the int8 copy (and what an
        # "auto" copy falls back to).
        selecting = model if selector is None else selector
        autocast, why = selection_dtype(
            autocast,
            model_device(selecting),
            # (kept logits feed training too, e.g. distillation targets: float32 for "auto")
            feeds_training="the frozen prefix's features"
            if frozen_prefix is not None
            else "the kept logits"
            if keep_logits
            else None,
            model_dtype=next(
                (p.dtype for p in selecting.parameters() if p.is_floating_point()), None
            ),
        )
        self.keep_logits, self.memory_format = keep_logits, memory_format
        self.eval_selection = check_bool("eval_selection", eval_selection)
        self.selection_batch_size = (
            None
            if selection_batch_size is None
            else check_int("selection_batch_size", selection_batch_size, minimum=1)
        )
        if self.policy.needs_indices() and not self._source.has_indices():
            # NOTE: a per-example store (Stale-SB, the default recipe's) has a fix besides
            # indices: no store. default_policy(epochs=E) given as policy= (README: the same as
            # planned_epochs=E) builds its store whatever the source; the fix named was only
            # the source's, never has_store=False, which policy=None chooses for this source.
            raise indices_needed(
                repr(self.policy),
                INDEX_FIX
                + (
                    f"; or a policy without a per-example store: {NO_STORE_FIX}"
                    if self.policy.records_examples()
                    else ""
                ),
            )
        unsaid = self._source.unsaid_size()
        if self.policy.records_examples() and unsaid is not None:
            # NOTE: the store's size is the bound of the indices, which index_key= reads from
            # the batches: the message said to use a DataLoader over a map-style dataset, to a
            # user who had passed one.
            raise ValueError(
                f"{self.policy!r} stores each example's loss by dataset index, which index_key= "
                "reads from the batches, so the store needs the number of indices they can "
                f"hold; pass dataset_size=len(dataset) ({unsaid}) where every index lies in "
                f"[0, {unsaid}) (else the bound they lie below), or a policy without a "
                f"per-example store: {NO_STORE_FIX}"
            )
        self.seed = check_int("seed", seed, minimum=0)
        self.rank = (
            self._default_rank(process_group, distributed)
            if rank is None
            else check_int("rank", rank, minimum=0)
        )
        # NOTE: every random draw of the loader comes from generators derived from (seed, rank):
        # one for the policies' Bernoulli draws, one key for counter-based ones (Stale-SB).
        self._rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=(self.rank,)))
        )
        key = np.random.SeedSequence(self.seed, spawn_key=(self.rank, 1)).generate_state(1)[0]
        if subset is not None and not self._source.has_indices():
            raise indices_needed("subset=")
        self._subset = None if subset is None else subset_mask(subset, self._source.dataset_size)
        self._subset_digest = None if self._subset is None else _digest(self._subset)
        codec_input_key, call = input_fields(input_key, forward)
        selection_forward = SelectionForward(
            compile=compile_selection,
            scale=selection_scale,
            frozen_prefix=frozen_prefix,
            forward=call,
            output=output,
            convert=convert_inputs,
        )
        self._overlap_requested = check_bool("overlap_selection", overlap_selection)
        quantized, int8_why = self._quantizer(
            quantize_selection,
            selector if selector is not None else model,
            device,
            selection_forward,
            autocast,
        )
        self._scorer = Scorer(
            model,
            loss_fn,
            selector,
            selection_forward,
            make_feature_cache(
                cache_features,
                frozen_prefix,
                self._source,
                check_bool("save_feature_cache", save_feature_cache),
            ),
            None if quantized is not None else autocast,  # the int8 copy replaces it
            self.selection_batch_size,
            self.eval_selection,
            keep_logits,
            id_fields=tuple(
                k
                for k in (
                    self._source.index_field_name() if index_key is None else index_key,
                    *self._source.id_fields(),
                )
                if k is not None
            ),
            default_target=target_key is None,
            quantized=quantized,
            fallback_autocast=autocast,
            precision=f"{int8_why}; {why}" if quantized is None else int8_why,
        )
        self._scorer.follow_forward_autocast(self._autocast_requested)
        logger.info("selection precision: %s", self._scorer.precision)
        self._scorer.check()
        self._overlap = self._selection_copy(overlap_selection, device, frozen_prefix)
        self.batch_size = training_batch_size(batch_size, self._source)
        self.remainder = check_choice("remainder", remainder, _REMAINDERS)
        per_epoch = check_batches_per_epoch(batches_per_epoch)
        check_remainder(self.remainder, per_epoch)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE)
        self.cdf = check_choice("cdf", cdf, _CDFS)
        self.prefetch = self._source.default_prefetch() if prefetch is None else prefetch
        self._sync: RankSync | None = make_sync(distributed, process_group)
        # (checked in _agree_configuration, alike on every rank)
        self._rank_given = rank is not None
        if self._sync is None:
            check_unsynced(distributed, process_group, self.cdf)
        if self._scorer.collective and self._sync is None and is_distributed(process_group):
            raise ValueError(
                "distributed=False cannot be used with an FSDP-sharded model on several ranks: "
                "each selection forward gathers parameters from every rank, so the ranks must "
                "run them in step; pass distributed=True (the default under an initialised "
                "process group)"
            )
        self.min_batch_size = checked_min_batch_size(min_batch_size, model, self.batch_size)
        if min_batch_size is None:
            # NOTE: a default that depends on the model, said as the policy and the selection
            # precision are: a batch below it is dropped (counted in loader.stats, dropped).
            logger.info(
                "min_batch_size: %d (the default %s)",
                self.min_batch_size,
                "for batch_size=1"
                if self.batch_size == 1
                else "for a model with BatchNorm layers, which cannot train on a batch of one"
                if self.min_batch_size > 1
                else "for a model without BatchNorm layers",
            )
        self._device = device  # (a torch.device or None: checked above)
        self._scorer.check_selector_device(self.device)
        self.input_key, self.target_key = input_key, target_key
        check_metadata_key(metadata_key)
        self.metadata_key = metadata_key
        drop_key = dropped_index_key(drop_index, self._source)
        check_pad_values(pad_values, frozen_prefix)
        self._codec = BatchCodec(
            codec_input_key,
            target_key,
            memory_format,
            metadata_key,
            drop_key,
            pad_values,
            self._source.index_field_key(),
            call.keys if isinstance(call, FieldsForward) else None,
        )
        # NOTE: resolved last: "expected" needs the source, batch size, subset and policy.
        # (whether "expected" was resolved: ranks that resolve it differently are told why)
        self._expected_given = per_epoch == "expected"
        if self._expected_given:
            per_epoch = expected_count(
                self._source, self._subset, self.batch_size, self.policy, self.remainder
            )
        if policy is None and planned_epochs is not None and per_epoch is not None:
            self._plan_passes(store, planned_epochs, int(per_epoch))
        self._fixed = None if per_epoch is None else FixedEpochs(int(per_epoch))
        if self._fixed is not None and self.remainder == "drop":
            check_fills_a_batch(
                self._source, self._subset, self.batch_size, self.policy, self._fixed.count
            )
        self._backlog_warned = False  # see _warn_backlog
        self._nothing_warned = False  # see _warn_nothing_yielded
        # The batches an epoch handed out when the caller left it, where they were at most one
        # (a look at a batch, warned of where it was the first epoch: see _warn_peek), until the
        # next epoch begins.
        self._peeked: int | None = None
        self._peek_warned = False
        size = self._source.dataset_size
        checkable = self._source.disjoint_across_ranks()
        if self._sync is not None and self.policy.records_examples() and checkable:
            # Every rank's losses reach the per-example store by dataset index: the indices
            # must name one dataset's examples on every rank (sizes checked at the first
            # collective, overlap after the first pass).
            if size is not None:
                self._sync.arm_overlap_check(size)
        self._agree_configuration(decisions)
        # Whether a pass's length was counted as the source's batches, all full batches of
        # batch_size (a batch_sampler= with no sampler of its own: by len(), or by the ranks'
        # agreement just below), and whether a batch of another size was warned of since.
        # NOTE: set before that agreement counts: reset after it, a loader on several ranks
        # whose user never called len() yielded the agreed count of such batches unwarned.
        self._counted_full = False
        self._counted_full_warned = False
        # The fewest and the most batches of a pass on any rank, for a passthrough policy on
        # several ranks (every rank yields the fewest: len(loader) says so); None otherwise.
        self._pass_span = self._agree_pass_length()
        #: Training batches per epoch (``len(loader)``), or None (one pass per epoch).
        self.batches_per_epoch: int | None = None if self._fixed is None else self._fixed.count
        self.decisions = check_choice("decisions", decisions, _DECISIONS)
        self._decider = self._device_decider(frozen_prefix is not None)
        self._scorer.host_values = self._decider is None
        # Cross-epoch state.
        self.stats = LoaderStats()
        self.epoch = 0
        self._pending = PendingRows()
        self._feedback = FeedbackBuffer()
        self._live: weakref.ref[EpochIterator] | None = None
        # Iterators freed on one of the loader's own threads, closed at the loader's next use
        # (see EpochIterator.__del__).
        self._orphans: list[EpochIterator] = []
        # An epoch that no live iterator owns but that did not end: (position, resume). A
        # restored mid-epoch state resumes it; an abandoned one is skipped by the next iterator.
        self._unfinished: tuple[int, bool] | None = None
        # On several ranks, the share of that epoch's pass every rank reports as drawn (see
        # EpochIterator.shared_fraction), for ``progress``; None on one process or before any.
        self._share: float | None = None
        # Whether the current epoch's source loads only what a Keep keeps (the policy's
        # prefilter or ``subset``; see K_PREFILTER), and what a loaded mid-epoch state says its
        # epoch did (checked as it resumes).
        self._epoch_prefilter = False
        self._resume_prefilter: bool | None = None
        # Batches handed out but not trained when a state was saved (``state_dict(unconsumed=)``):
        # the next epoch iterator hands them out first, as they were.
        self._returned: list[Rows] = []
        # The batches handed out last by an epoch left part-way and resumable (the loop left by
        # an exception in the training step, or ``break``), while that epoch is unfinished:
        # what ``state_dict(unconsumed=)`` takes back then (see _abandon), the latest last.
        self._left: list[Rows | WholeBatch] = []
        self._left_why = ""  # why the batch before those cannot be taken back
        # With keep_ended_state (a framework that fetches past an epoch's last batch before
        # training on it: LightningLoader without len()), the state that takes back the last
        # batch of the epoch that ended last, taken as it ended; until the next epoch begins.
        self._keeps_ended = False
        self._ended_state: dict[str, Any] | None = None
        # Whether the model and loss_fn were checked on a source batch (see EpochIterator).
        self._probed = False
        # Whether this epoch's beginning made the exchange of loader.feedback's reports (see
        # _begin).
        self._fed = False
        # Whether a state saved mid-epoch that could not resume there was warned of.
        self._mid_epoch_warned = False
        self._unreported_warned = False  # (see _warn_unreported)
        # Whether a state (resuming its rest) was saved after the epoch was left part-way in
        # this run, until the next epoch begins; and whether that was warned of (see
        # _warn_left_saved).
        self._saved_left = False
        self._left_saved_warned = False
        # The source's state as of the last source batch consumed (see Source.snapshot); None:
        # ask the source.
        self._source_state: dict[str, Any] | None = None
        # A source batch scored ahead and not consumed (overlap_selection), held for a state and
        # for the iterator that resumes its epoch.
        self._ahead: AheadScores | None = None
        # NOTE: last, after every check: attaching starts the policy's run afresh and claims it
        # for this loader, so a constructor that refuses an argument must not have done it (a
        # policy already running in another loader would lose its window and its owner).
        self._attach_policy(int(key))
        for part in self.policy.parts():
            claim(part, self)

    def _attach_policy(self, key: int) -> None:
        """Attach the policy to this loader (the constructor's last step); on several ranks,
        raise on every rank where it failed on any (one ``all_reduce`` and, only then, the
        failed rank's message in :meth:`RankSync.broadcast_text
        <sbloader.distributed.RankSync.broadcast_text>`): that rank raises its own error,
        naming its rank, and the others a ``RuntimeError`` naming it and its error.

        NOTE: attaching may fail on one rank alone (the store folder of ``store_path`` held by
        another process, e.g. every rank given the same folder, or a stale run's); that rank
        then raised alone and the others, built, waited in their first epoch's first collective
        until the process group timed out, or until that rank's process ended and gloo closed
        its connections ("Connection closed by peer"), neither naming the error. The ranks that
        attached keep their policy attached (its run begun afresh), as a loader whose
        constructor raised after attaching would.
        """
        sync = self._sync
        error: Exception | None = None
        try:
            self.policy.attach(self._source.dataset_size, key)
        except Exception as e:
            if sync is None or sync.world_size < 2:
                raise
            error = e
        self._raise_on_every_rank(
            error, "in attaching the policy as the SelectiveLoader was built (e.g. its store_path)"
        )

    def _raise_on_every_rank(self, error: Exception | None, what: str) -> None:
        """On several ranks, where every rank calls it alike: raise on every rank where any
        rank passed an ``error`` (the lowest such rank's), or return where none did; nothing on
        one process. ``what``: where the rank raised it, as the other ranks say it.

        One ``all_reduce`` (:meth:`RankSync.span <sbloader.distributed.RankSync.span>`) and,
        only then, the failed rank's message in :meth:`RankSync.broadcast_text
        <sbloader.distributed.RankSync.broadcast_text>`: a rank that met an error raises its
        own, of its type, naming its rank, the others a ``RuntimeError`` naming that rank,
        ``what`` and its message.
        """
        sync = self._sync
        if sync is None or sync.world_size < 2:
            return
        failed = sync.span(sync.rank if error is not None else sync.world_size, self.device)[0]
        if failed >= sync.world_size:
            return
        where = f"rank {sync.rank} of {sync.world_size}"
        detail = sync.broadcast_text(
            _describe(error) if error is not None else "", failed, self.device
        )
        if error is not None:
            message = f"on {where} (every rank stops with this error, reported to the others): "
            _raise_own(error, message + str(error))
        raise RuntimeError(
            f"rank {failed} of {sync.world_size} raised an exception {what}; every rank stops "
            f"with it (this is {where}), so that none waits for it in a collective. Rank "
            f"{failed}'s error: {detail} (its own log has the traceback)"
        )

    def _selection_copy(
        self, option: Any, device: Any, frozen_prefix: nn.Module | None
    ) -> SelectionCopy | None:
        """The selection model's copy of ``overlap_selection`` (None when off), after checking
        that this configuration can overlap its selection passes. Called after the scorer is
        made."""
        if not check_bool("overlap_selection", option):
            return None
        scorer = self._scorer
        model = scorer.selection_model
        where = torch.device(device) if device is not None else model_device(model)
        conflicts = {
            "batches on another device than the model's (the selection copy lives where the "
            "model does)": concrete_device(where) != concrete_device(model_device(model)),
            "compile_selection= (a compiled model cannot be copied for the selection thread)": (
                scorer.forward.compile_kwargs is not None
            ),
            "quantize_selection= (its int8 copy is rebuilt from the live model)": (
                scorer.quantized is not None
            ),
            "frozen_prefix= (its features feed the training step)": frozen_prefix is not None,
            "eval_selection=False (a pass in train mode would update the copy's BatchNorm "
            "statistics, not the model's)": not self.eval_selection,
            "an FSDP-sharded model (its forwards are collectives)": scorer.collective,
        }
        for what, on in conflicts.items():
            if on:
                raise ValueError(
                    f"overlap_selection=True cannot be combined with {what}; pass "
                    "overlap_selection=False or drop the other option"
                )
        if self.policy.needs_losses(0):
            # NOTE: measured (README, A cheaper selection pass): the one-source-batch-staler
            # selections of an untrained model feed back into its first steps at full learning
            # rate; plain SB collapsed to chance in 2 of 2 seeds with overlap, not with a warm-up.
            warnings.warn(
                f"overlap_selection=True with {self.policy!r}, which selects by loss from the "
                "first epoch: measured on the benchmark CNN, plain SB with overlapped (one source "
                "batch staler) selection collapsed to chance accuracy in 2 of 2 seeds, while the "
                "default recipe, which starts with a Random-Backprop warm-up epoch, trained as "
                "without overlap. Use sbloader.default_policy(), or "
                "sbloader.Phased(policy, warmup_epochs=1, warmup_policy="
                "sbloader.RandomBackprop(...)) for a warm-up first",
                UserWarning,
                stacklevel=3,
            )
        return SelectionCopy(model)

    @property
    def overlapping(self) -> bool:
        """Whether selection passes run on a background thread (``overlap_selection``)."""
        return self._overlap is not None

    def _quantizer(
        self,
        option: Any,
        selection_model: nn.Module,
        device: Any,
        forward: SelectionForward,
        autocast: torch.dtype | None,
    ) -> tuple[QuantizedSelector | None, str]:
        """The int8 selection copy of ``quantize_selection`` (None when off) and why, after
        checking that this configuration can use one (:func:`sbloader.quantize.resolve`).
        Called before the scorer is made: reads the options set so far; ``autocast`` is the
        float precision chosen."""
        model = unwrap(selection_model)
        where = torch.device(device) if device is not None else model_device(model)
        explicit = self._autocast_requested != AUTO and autocast is not None
        # NOTE: each option below changes the selection forward in a way an int8 copy of
        # model(inputs) cannot follow, or duplicates what it does; refused rather than ignored
        # (and, for quantize_selection="auto", the reason the copy stays off).
        conflicts = {
            "autocast= (the int8 copy replaces reduced precision)": explicit,
            "compile_selection= (no gain measured on the int8 copy)": forward.compile_kwargs
            is not None,
            "forward= or a tuple input_key (the int8 copy is traced as model(inputs))": (
                forward.call is not None
            ),
            "frozen_prefix= (its outputs are training inputs, which int8 would change)": (
                forward.frozen_prefix is not None
            ),
            "convert_inputs= (the int8 copy is calibrated on the inputs as they come)": (
                forward.convert is not None
            ),
            "eval_selection=False (the int8 copy folds BatchNorm: it runs in eval mode)": (
                not self.eval_selection
            ),
            "an FSDP-sharded model (each rank holds a shard; pass selector= a whole model)": (
                is_fsdp(selection_model)
            ),
            "overlap_selection=True (its selection thread scores with a float copy)": (
                self._overlap_requested
            ),
            "keep_logits=True (kept logits feed training, which int8 would change)": bool(
                self.keep_logits
            ),
        }
        return resolve_quantized(option, model, conflicts, where, self._autocast_requested)

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
    def _default_rank(group: Any, distributed: bool | None) -> int:
        """The process's rank in ``group`` (the loader's process group) when it runs over one,
        else its rank in the world (0 without a process group).

        NOTE: an explicit ``rank=`` is checked against the rank in the group (see
        :func:`~sbloader.distributed.agree_configuration`); the world's rank as the default
        differed from it under a subgroup, so that passing the loader's own default was refused,
        and a state saved with it was refused by a loader given the group's rank."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        if group is not None and distributed is not False:
            own = dist.get_rank(group)
            if own >= 0:  # (-1: not a member, refused as the loader's collectives are set up)
                return own
        return dist.get_rank()

    # ------------------------------------------------------------------ public helpers
    @property
    def device(self) -> torch.device:
        """Where yielded batches live: ``device`` if given, else the model's device."""
        return self._device if self._device is not None else model_device(self.model)

    @property
    def source(self) -> Source:
        return self._source

    @property
    def prefetch(self) -> int:
        """Source batches fetched ahead on a thread (``prefetch=``); set it between epochs to
        change it, checked as when the loader is built (e.g. refused > 0 for FFCV)."""
        return self._prefetch

    @prefetch.setter
    def prefetch(self, value: int) -> None:
        value = check_int("prefetch", value, minimum=0)
        self._source.check_prefetch(value)
        self._prefetch = value

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype of selection passes (None: float32, or the int8 copy's)."""
        return self._scorer.autocast

    @property
    def selection_precision(self) -> str:
        """What selection passes run in and why, as chosen (``autocast``,
        ``quantize_selection``) or resumed: e.g. ``"quantize_selection='auto': int8 (native
        int8 on this CPU)"``. Also logged when the loader is built and when it changes (an
        ``"auto"`` int8 copy that could not be built, a resumed run's own precision)."""
        return self._scorer.precision

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
    def training_epoch(self) -> int:
        """The number of the current (or next) training epoch, from 0: with
        ``batches_per_epoch``, counted in epochs of that many batches; else :attr:`epoch` (one
        epoch is one pass over the data)."""
        return self.epoch if self._fixed is None else self._fixed.current()[0]

    @property
    def batches_yielded(self) -> int:
        """Batches handed out in the current training epoch so far (0 before it began): with
        ``batches_per_epoch``, counted in that epoch (whose passes over the data are not its
        epochs); else in the pass over the data. Restored with a mid-epoch state, so that a
        resumed epoch ends where the uninterrupted one did (``batches_yielded == len(loader)``
        after its last batch, where the loader has a ``len()``).

        Example:
            >>> import torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> import sbloader
            >>> data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
            >>> loader = sbloader.SelectiveLoader(
            ...     DataLoader(data, batch_size=10), torch.nn.Linear(4, 2),
            ...     policy=sbloader.Traditional())
            >>> it = iter(loader)
            >>> _ = next(it); _ = next(it)
            >>> loader.batches_yielded, len(loader)
            (2, 4)
        """
        if self._fixed is not None:
            return self._fixed.current()[1]
        stats = self.stats.current
        return 0 if stats is None else stats.batches_yielded

    @property
    def world_size(self) -> int:
        """The number of ranks the loader keeps in step (1 on a single process)."""
        return 1 if self._sync is None else self._sync.world_size

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` process group the loader keeps its ranks in step over
        (``process_group=``; None for the world's, and where it keeps no ranks in step:
        :attr:`world_size` 1). A collective of the caller's own over the loader's ranks (say,
        gathering every rank's :meth:`state_dict` into one checkpoint) uses this group, and
        indexes by :attr:`rank`, this process's rank in it."""
        return None if self._sync is None else self._sync.group

    @property
    def progress(self) -> float:
        """Epochs of source data consumed so far, as a float (for learning-rate schedules).

        Counts the candidates drawn from the source (also those a policy rejected before
        loading them and those outside ``subset``) against the examples of an epoch, so it
        advances at the same rate for every policy and reaches each whole number exactly when
        an epoch ends: schedules keyed on it are identical across strategies (by position in
        the data). Sources of unknown size count batches instead. On several ranks it is the
        same on every rank while an epoch runs: the smallest share of its pass any rank had
        drawn at the ranks' last agreement (see :meth:`EpochIterator.shared_fraction
        <sbloader.epoch.EpochIterator.shared_fraction>`).

        NOTE: counting batches would be wrong where a source loads only some of an epoch's
        examples (Stale-SB's stale epochs, a subset): fewer batches come, and a schedule keyed
        on them would lag within the epoch and jump at its end.
        """
        it = self._live_iterator()
        if it is not None and it.running:
            return float(self.epoch + it.shared_fraction())
        current = self.stats.current
        if self._unfinished is not None and current is not None and current.epoch == self.epoch:
            # NOTE: an epoch left part-way (``break``) or restored mid-way: the data its pass
            # drew, so that a schedule set now (e.g. on resume, before the first batch) reads
            # where the run is, and progress never goes back.
            if self._share is not None:  # (on several ranks: the share every rank reports)
                return float(self.epoch + self._share)
            position, filtered = self._unfinished[0], self._epoch_prefilter
            return float(self.epoch + pass_fraction(self._source, current, position, filtered))
        return float(self.epoch)

    def expected_batches(self, rate: float | None = None) -> float:
        """The expected number of training batches per pass over the data (an estimate when
        selective): examples per epoch (this rank's share, within ``subset``) x the policy's
        rate in the pass under way, or between passes in the next one (``epoch_rate``) /
        ``batch_size``.

        Args:
            rate: the share of the candidates kept, in [0, 1], instead of the policy's current
                ``target_rate`` (e.g. ``policy.steady_rate`` for a selective pass, 1.0 for a
                full one), or None.

        Raises:
            TypeError: the source's number of examples is unknown (an iterable without a length
                or without a batch size); the message names the fix, ``dataset_size=``.

        Example:
            >>> import torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from sbloader import SelectiveLoader, RandomBackprop
            >>> data = TensorDataset(torch.randn(1000, 3), torch.arange(1000) % 2)
            >>> loader = SelectiveLoader(DataLoader(data, batch_size=100), torch.nn.Linear(3, 2),
            ...                          policy=RandomBackprop(0.5), batch_size=50)
            >>> loader.expected_batches(), loader.expected_batches(1.0)
            (10.0, 20.0)
        """
        if rate is None:
            rate = self.policy.epoch_rate(self._next_epoch())
        else:
            rate = check_float("rate", rate, low=0.0, high=1.0)
        return batches_at(self._source, self._subset, self.batch_size, rate)

    def _next_epoch(self) -> int:
        """The epoch under way, or the one the next ``iter()`` begins (or resumes).

        NOTE: the policy's ``target_rate`` is that of the epoch last begun; read between two
        epochs it was the one before's, and ``expected_batches()`` estimated a ``Phased`` run's
        first annealed pass at the selective rate (10 batches, and it yielded 30).
        """
        left = self._unfinished is not None and not self._unfinished[1]
        return self.epoch + 1 if left else self.epoch

    def _plan_passes(self, store: bool, planned_epochs: int, per_epoch: int) -> None:
        """``planned_epochs`` with ``batches_per_epoch`` and the default policy: rebuild that
        policy for the passes over the data that ``planned_epochs`` training epochs of
        ``per_epoch`` batches are expected to make (:func:`~sbloader.length.planned_passes`,
        from the ranks' fewest expected batches), attached at the constructor's end as any
        policy is."""
        unknown: TypeError | None = None
        try:
            steady = self.expected_batches(self.policy.steady_rate)
            full = self.expected_batches(1.0)
        except TypeError as e:
            unknown, steady, full = e, -1.0, -1.0
        sync = self._sync
        if sync is not None and sync.world_size > 1:
            # NOTE: every rank yields as many batches a round as the fewest any rank has, so the
            # plan is the fewest's, and the same on every rank (each rank planned from its own
            # share, and with uneven shares the ranks annealed from different passes).
            low_steady = sync.span(round(steady * 1000), self.device)[0]
            low_full = sync.span(round(full * 1000), self.device)[0]
            if min(low_steady, low_full) < 0:
                unknown = unknown or TypeError("another rank's source cannot tell its length")
            else:
                steady, full = low_steady / 1000, low_full / 1000
        passes = planned_passes(planned_epochs, per_epoch, steady, full, unknown)
        self.planned_passes = passes
        with warnings.catch_warnings():  # (the plan's own warnings are planned_passes's)
            warnings.simplefilter("ignore", UserWarning)
            self.policy = default_policy(store, epochs=passes)
        logger.info(
            "policy: %r (the default recipe, chosen for this source and %d planned epochs of "
            "%d batches: %d passes over the data)",
            self.policy,
            planned_epochs,
            per_epoch,
            passes,
        )

    def __len__(self) -> int:
        if self._fixed is not None:
            return self._fixed.count
        if not self.policy.passthrough():
            raise TypeError(
                f"len() is undefined for a SelectiveLoader with {self.policy!r}: the number of "
                'batches per epoch is random. Pass batches_per_epoch="expected" (or an int) '
                "for epochs of a fixed number of batches, use loader.expected_batches() for an "
                "estimate, or key schedules on loader.progress"
            )
        own = self._pass_length()
        span = self._pass_span
        if span is None:
            return own
        if span[0] < 0:
            raise TypeError(
                "the number of batches of a pass is unknown on another rank (its source has no "
                "known number of examples), and every rank yields as many as the fewest any "
                "rank's pass makes; pass dataset_size= on every rank, or batches_per_epoch= an "
                "int"
            )
        return span[0]

    def _agree_configuration(self, decisions: Any) -> None:
        """On several ranks: refuse, on every rank alike, options that must be the same on
        every rank and are not (:meth:`_shared_options`), and an explicit ``rank=`` other than
        the process's rank in the group (:func:`~sbloader.distributed.agree_configuration`,
        whose NOTE says why)."""
        sync = self._sync
        if sync is None:
            return
        agree_configuration(
            sync,
            self._shared_options(decisions) if sync.world_size > 1 else {},
            self.device,
            rank=self.rank if self._rank_given else None,
            empty=self._source.epoch_size == 0,
            expected_rate=self.policy.steady_rate if self._expected_given else None,
        )

    def _shared_options(self, decisions: Any) -> dict[str, str]:
        """The options of :meth:`_agree_configuration`, as they are compared."""
        return {
            # (its kind: what decides the collectives; settings such as a selectivity may
            # differ between ranks, which stay in step whatever each keeps)
            "policy": self.policy.kind(),
            # NOTE: the default policy's plan: ranks planned for other lengths anneal from other
            # passes, one rank training on all the data while the others select (in step, each
            # yielding the fewest batches any rank has: the annealing rank's pass was cut short,
            # unsaid).
            "planned_epochs": repr(self.planned_epochs),
            "cdf": repr(self.cdf),
            # (a policy of the user's own may answer by its settings, which kind() leaves out)
            "policy.ranks_shared_losses()": repr(self._global_ranking()),
            "remainder": repr(self.remainder),
            "batch_size": repr(self.batch_size),
            "batches_per_epoch": repr(None if self._fixed is None else self._fixed.count),
            "min_batch_size": repr(self.min_batch_size),
            "nonfinite": repr(self.nonfinite),
            "decisions": repr(decisions),
        }

    def _agree_pass_length(self) -> tuple[int, int] | None:
        """On several ranks, for a passthrough policy with epochs of one pass: the fewest and
        the most batches of a pass on any rank (-1 where a rank's is unknown), agreed as the
        loader is built (:func:`~sbloader.distributed.agree_pass_length`, whose NOTE says why);
        None otherwise (no collective)."""
        sync = self._sync
        if sync is None or sync.world_size < 2 or self._fixed is not None:
            return None
        if not self.policy.passthrough():
            return None
        try:
            own = self._pass_length()
        except TypeError:
            own = -1
        return agree_pass_length(sync, own, self.batch_size, self.device)

    @property
    def last_batch_min(self) -> int:
        """The fewest examples a pass's last (short) batch is yielded with: ``min_batch_size``,
        or ``batch_size`` for a passthrough policy with ``remainder="drop"``, whose pass's rest
        is dropped (it hands its short rest out whatever the ``remainder`` otherwise).

        NOTE: ``remainder="drop"`` asked of ``Traditional`` was ignored, unsaid: the pass's
        short rest was yielded as the source's own last batch is.

        Example:
            >>> import torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from sbloader import SelectiveLoader, Traditional
            >>> data = TensorDataset(torch.randn(10, 3), torch.arange(10) % 2)
            >>> loader = SelectiveLoader(DataLoader(data, batch_size=4), torch.nn.Linear(3, 2),
            ...                          policy=Traditional(), remainder="drop")
            >>> loader.last_batch_min, len(loader), [len(b[0]) for b in loader]
            (4, 2, [4, 4])
        """
        if self.remainder == "drop" and self.policy.passthrough():
            return self.batch_size
        return self.min_batch_size

    def _pass_length(self) -> int:
        """The exact number of batches of a pass of a passthrough policy
        (:func:`~sbloader.length.pass_length` of :func:`~sbloader.length.pass_examples`).

        Raises:
            TypeError: the pass's number of examples is not known exactly (the message names the
                fix).
        """
        examples, counted_full = pass_examples(self._source, self._subset, self.batch_size)
        if counted_full:  # (warned of where a source batch of another size comes: epoch.py)
            self._counted_full = True
        return pass_length(examples, self.batch_size, self.last_batch_min)

    def __iter__(self) -> EpochIterator | FixedEpochIterator:
        self._check_owner()
        if self._fixed is not None:
            return self._fixed.iterate(self)
        return self._new_pass()

    def _check_owner(self) -> None:
        """Refuse to go on where this loader's policy (or a policy it runs) was attached to
        another SelectiveLoader since (:func:`~sbloader._owners.check_owner`, whose NOTE says
        when it is checked)."""
        check_owner(self.policy.parts(), self)

    def _new_pass(self) -> EpochIterator:
        """The iterator of the next pass over the data (one epoch without
        ``batches_per_epoch``)."""
        live = self._live_iterator()
        if live is not None:
            live.close()  # a started epoch it had not finished counts as abandoned
        it = EpochIterator(self)
        self._live = weakref.ref(it)
        return it

    def _live_iterator(self) -> EpochIterator | None:
        if self._orphans:  # (closed here, on the caller's thread, as their finalizers could not)
            orphans, self._orphans = self._orphans, []
            for it in orphans:
                it.close()
        return None if self._live is None else self._live()

    def __deepcopy__(self, memo: dict[int, Any]) -> SelectiveLoader:
        """A copy between epochs (its own model, policy and source, no live iterator); refused
        while an epoch is running, whose iterator the copy would share.

        NOTE: the epoch's iterator is referenced weakly, and ``copy.deepcopy`` keeps a weak
        reference as it is: a copy made mid-epoch still pointed at the original's iterator, so
        that ``iter(copy)`` closed the original's epoch and ``copy.state_dict()`` read its
        position beside the copy's own policy and generators.
        """
        it = self._live_iterator()
        if it is not None and it.running:
            what, when = (
                ("an epoch is running", "copy it between epochs, or ")
                if self._fixed is None
                else (
                    "its pass over the data is under way, which with batches_per_epoch goes on "
                    "across training epochs, between them too",
                    "",
                )
            )
            raise TypeError(
                f"a SelectiveLoader cannot be copied while {what} (the copy would share its "
                f"iterator); {when}build a new loader and load_state_dict(loader.state_dict()) "
                "into it"
            )
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            object.__setattr__(new, name, copy.deepcopy(value, memo))
        object.__setattr__(new, "_live", None)
        return new

    # ------------------------------------------------------------------ the epoch handover
    def _begin(self, it: EpochIterator) -> tuple[int, int, bool, EpochStats, list[Rows]]:
        """Hand the next epoch (or the rest of a restored one) to ``it``: its number, the source
        batches to skip, whether it resumes a restored epoch, its stats, and the batches to hand
        out first (taken back by a saved state).

        NOTE (an exception on one rank): on several ranks, an exception this rank meets as the
        epoch begins (checking the model and its device, the source's ``set_epoch``, the reports
        of :meth:`feedback`, the policy's ``begin_epoch``: a sampler or a policy of the user's
        own, a report's index outside the data) is held while the rank makes the collectives of
        the epoch's beginning that the others make, and is then raised on every rank (see
        :meth:`_raise_on_every_rank`). Raised on this rank alone, it left the others waiting in
        their first round's collectives until this rank's process ended ("Connection closed by
        peer") or the process group timed out, neither naming the error nor the rank. It costs
        one ``all_reduce`` of two integers per epoch (not per round), made after the epoch has
        begun on every rank: no collective of the epoch's beginning is made where every
        rank's error could be reported in it, the comparison of the ranks' positions
        (:func:`~sbloader.distributed.agree_position`) being made before anything changes.
        """
        sync = self._sync
        several = sync is not None and sync.world_size > 1
        error: Exception | None = None
        try:
            self._scorer.check()  # a frozen prefix may have been unfrozen
            # (the model may have been prepared by Accelerate since)
            self._scorer.follow_forward_autocast(self._autocast_requested)
            check_device(self.device, self._device is not None)
            self._scorer.check_selector_device(self.device)
        except Exception as e:
            if not several:
                raise
            error = e
        epoch, skip, resumed = self.epoch, 0, False
        if self._unfinished is not None:
            position, resume = self._unfinished
            if resume:
                skip, resumed = position, True
            else:
                epoch += 1  # the previous epoch was abandoned part-way (e.g. ``break``)
        current = self.stats.current
        if not (resumed and current is not None and current.epoch == epoch):
            current = None  # (a new epoch's stats, begun below)
        yielded = 0 if current is None else current.batches_yielded
        # (before anything changes: a refusal loses nothing)
        agree_position(self._sync, epoch, yielded, self.device)
        self._fed = False
        if error is None:
            try:
                current = self._begin_epoch(epoch, skip, resumed, current)
            except Exception as e:
                if not several:
                    raise
                error = e
        if several:
            assert sync is not None
            if error is not None and not self._fed and self._feeds(resumed):
                # (the reports' exchange the other ranks make, with none of this rank's)
                sync.bind(self.device)
                sync.exchange(None, None)
            self._raise_on_every_rank(
                error,
                f"as epoch {epoch} began (checking the model and its device, the source's "
                "set_epoch, applying the reports of loader.feedback, or the policy's begin_epoch)",
            )
        assert current is not None
        returned, self._returned = self._returned, []
        return self.epoch, skip, resumed, current, returned

    def _begin_epoch(
        self, epoch: int, skip: int, resumed: bool, current: EpochStats | None
    ) -> EpochStats:
        """Begin epoch ``epoch`` (resumed ``skip`` source batches in where ``resumed``; with its
        stats ``current`` where they go on) once the ranks agreed on it (see :meth:`_begin`);
        its stats."""
        # (taken before anything changes too: an index outside the data refuses the epoch, and
        # the reports stay held)
        reports = None if resumed else self._feedback.take(self._source.dataset_size)
        saved_left, self._saved_left = self._saved_left, False
        self._unfinished, self.epoch, self._left = None, epoch, []
        self._ended_state = None
        self._source.set_epoch(self.epoch)
        if reports is not None:
            self._apply_feedback(*reports)
        self.policy.begin_epoch(self.epoch)
        if not resumed:  # (a resumed epoch's rows were settled as it began, in its saved run)
            self._warn_peek()
            self._warn_left_saved(saved_left)
            self._drop_abandoned_rest()
            self._pending.begin_epoch(self.policy.normalize_weights())
        # (the one decision: the epoch iterator builds its Keep from this flag)
        self._epoch_prefilter = self._source.can_filter() and prefilters(self.policy, self._subset)
        saved, self._resume_prefilter = self._resume_prefilter, None
        if resumed and saved is not None and saved != self._epoch_prefilter:
            self._unfinished = (skip, True)  # (still resumable once the cause is mended)
            raise ValueError(
                f"the state was saved {skip} source batches into epoch {self.epoch}, which its "
                f"run {'prefiltered' if saved else 'loaded whole'} (a Stale-SB stale epoch loads "
                "only the examples it keeps), but here the policy "
                f"{'prefilters' if self._epoch_prefilter else 'loads'} that epoch "
                f"{'' if self._epoch_prefilter else 'whole '}(e.g. planned for another number "
                "of epochs, so that it anneals from another one): the position would count other "
                "batches, skipping or repeating examples. Resume with the saved run's policy "
                "and planned epochs until the epoch ends, or from a state saved at an epoch "
                "boundary"
            )
        if current is None:
            current = self.stats.begin_epoch(self.epoch, self.policy.target_rate)
        return current

    def _drop_abandoned_rest(self) -> None:
        """Begin a passthrough policy's epoch (without ``batches_per_epoch``) with no rows of an
        earlier one: the rest of a source batch that an epoch left part-way (``break``, an
        error in the training step, ``iter(loader)`` again) had not handed out is dropped with
        the rest of that pass, counted in its stats' ``dropped``.

        NOTE: carried, those rows made the next epoch longer than ``len(loader)`` (a whole pass
        and the abandoned rest: 22 batches where ``len`` said 21), so that a schedule sized by
        it (``OneCycleLR(total_steps=len(loader) * epochs)``) stepped past its end; a
        passthrough epoch is one pass, every example once, as a DataLoader's epoch after
        ``break`` is. A state saved before the next epoch begins still holds them, and resumes
        the epoch left part-way with them.
        """
        if self._fixed is not None or not self.policy.passthrough():
            return
        rest = self._pending.clear() + sum(len(rows) for rows in self._returned)
        self._returned = []
        previous = self.stats.current
        if rest and previous is not None:
            previous.dropped += rest
            # (its line was logged as it was left, with the rows not dropped yet: said now)
            logger.info(
                "epoch %d (left part-way): dropped %d more, the rest of its last source batch, "
                "as the next epoch begins a whole pass (dropped %d in all)",
                previous.epoch,
                rest,
                previous.dropped,
            )

    def feedback(self, indices: Any, losses: Any) -> None:
        """Report the training step's per-example losses, to keep the policy's scores fresh.

        Stale-SB (``SelectiveBackprop(staleness=n)``, and the default recipe) decides the epochs
        between selection passes from each example's stored loss. Reported here, the loss the
        training step computed anyway replaces the stored one, so those decisions use each
        example's loss from the last time it was trained instead of from the last selection pass,
        at no cost. Other policies ignore it, so the same training loop works with every policy.
        Reports take effect when the next epoch starts (and are part of :meth:`state_dict`).

        Args:
            indices: the batch's dataset indices (``batch.indices``, or ``batch[key]["indices"]``
                with ``metadata_key=``); None where the source gives none (then nothing
                takes the report, which is only checked and counted).
            losses: one loss per example of the batch, as computed by the training step
                (``reduction="none"``; detached and copied here, on its device, where the copy
                stays until the epoch ends: the tensor may be changed or reused after the call);
                a tensor, an array, or a list of per-example loss tensors.

        Raises:
            ValueError, TypeError: counts that differ, indices that are not integers, losses
                that are not floating-point numbers (integers: the targets passed instead of
                the losses, most often) (at once).
            ValueError: a report that would make more examples reported than the loader has
                yielded (a batch reported twice, or before it was yielded): at once, with
                nothing held or counted. Report each yielded batch once.
            IndexError: an index outside the dataset: at once for host-side indices; for
                device-side ones (checked without a synchronisation per step) when the next
                epoch starts or a state is saved, whichever is first; every report stays held.

        A report of a NaN or infinite loss leaves the example's stored loss as it was and is
        said (a warning in the ``sbloader`` log when the next epoch starts).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> import sbloader
            >>> data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
            >>> model = nn.Linear(4, 2)
            >>> policy = sbloader.SelectiveBackprop(1 / 3, staleness=3)
            >>> loader = sbloader.SelectiveLoader(DataLoader(data, batch_size=16), model,
            ...                                   policy=policy, batch_size=8)
            >>> for batch in loader:
            ...     x, y = batch
            ...     losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            ...     losses.mean().backward()
            ...     loader.feedback(batch.indices, losses)
            >>> loader.stats.total.feedback == loader.stats.total.examples_yielded
            True
        """
        self._check_owner()
        size = self._source.dataset_size
        if indices is None and not self._source.has_indices() and not self.policy.takes_feedback():
            # NOTE: a source with no dataset indices yields batches whose ``batch.indices`` is
            # None, and no policy takes feedback there (there is no per-example store): the
            # losses are checked and counted, so the drop-in loop runs over such a source too.
            indices = unindexed(losses)
        idx, val = checked(indices, losses, size)
        n = int(idx.shape[0])
        check_reported(self.stats, n)
        if self.policy.takes_feedback():
            self._feedback.add(idx, val)
        # (else checked and counted, but neither held nor copied to the host: nothing uses it)
        current = self.stats.current
        if current is not None:
            current.feedback += n

    def _feeds(self, resumed: bool) -> bool:
        """Whether the ranks exchange the reports of :meth:`feedback` as an epoch begins
        (:meth:`_apply_feedback`; never as a resumed one does): where the ranks share a policy's
        per-example records. The same on every rank (the policy's kind is)."""
        policy = self.policy
        return (
            not resumed
            and self._sync is not None
            and policy.takes_feedback()
            and policy.records_examples()
        )

    def _apply_feedback(self, indices: np.ndarray, losses: np.ndarray) -> None:
        """Hand the reports since the last epoch start (``indices``, ``losses``: taken from the
        buffer, checked) to the policy (every rank's, when the ranks share per-example
        records); warn where some were not finite."""
        if not self.policy.takes_feedback():
            return
        epoch = max(self.epoch - 1, 0)
        bad = int(np.count_nonzero(~np.isfinite(losses)))
        if bad:
            # NOTE: not silent. A non-finite report leaves the example's stored loss as it was
            # (store.record), so a run whose training losses turned NaN would otherwise go on
            # deciding from ever older scores, with nothing said.
            logger.warning(
                "epoch %d: %d of %d training losses reported through loader.feedback were NaN "
                "or infinite; those examples keep their earlier scores (a non-finite training "
                "loss usually means the run diverged: check the learning rate and the loss)",
                epoch,
                bad,
                losses.shape[0],
            )
        if self._feeds(False):
            assert self._sync is not None
            self._sync.bind(self.device)
            self._fed = True  # (made on this rank: see _begin)
            for values, idx in self._sync.exchange(losses, indices):
                if idx is not None:
                    self.policy.feedback(idx, values, epoch)
        else:
            self.policy.feedback(indices, losses, epoch)

    def _abandon(
        self,
        it: EpochIterator,
        resumable: bool,
        handed: Sequence[Rows | WholeBatch] = (),
        why: str = "",
    ) -> None:
        """``it`` ended part-way: the next iterator starts the next epoch (and a state saved
        before then resumes ``it``'s epoch where it stopped if ``resumable``); ``handed``: the
        batches it handed out last that a state may take back (see
        :meth:`EpochIterator.takeable <sbloader.epoch.EpochIterator.takeable>`), and ``why``
        the one before them cannot be.

        NOTE (``handed``): a training step that raises (an out-of-memory error) leaves the loop,
        which drops and closes the iterator before the caller's ``except`` can save a state; the
        batch it was training on is kept, so that ``state_dict(unconsumed=1)`` still takes it
        back, as it does inside the loop. Before, the state had to count it as trained (its
        examples lost in the resumed run), and ``unconsumed=1`` was refused, saying the epoch
        had ended.
        """
        live = self._live_iterator()
        if live is None or live is it:  # (a dropped iterator's weak reference may be dead)
            # NOTE: logged now, marked as left part-way: an epoch left with ``break`` (a loop of
            # so many steps per epoch) or closed by a framework (Lightning's
            # ``limit_train_batches``) never reaches _end, and was never logged at all, nor its
            # non-finite losses warned of. (A state saved now still resumes it; that run logs
            # the whole epoch when it ends.)
            if it.stats is not None:
                self._log_epoch(it.stats, left=True)
                if not it.raised:  # (left by the error raised to the caller, not by a peek)
                    self._note_peek(it.stats)
            self._left = list(handed) if resumable else []
            self._left_why = why
            self._share = it.agreed_share() if resumable else None
            if resumable:
                self._unfinished = (it.position, False)
            else:
                self._end_for_good()

    def _end_for_good(self) -> None:
        """The epoch left part-way ends here for good (``close(resumable=False)``,
        :meth:`end_epoch`): states saved from now start the next epoch, taking nothing back."""
        self._unfinished, self._left, self._share, self._ahead = None, [], None, None
        self.epoch += 1
        # NOTE: the source's state as it is now (its epoch closed), not the snapshot of the last
        # batch consumed: a source with its own state (StatefulSource) then says its pass was
        # left for good, and a state saved before the next epoch begins a new pass when loaded,
        # as this run's next iter() does.
        self._source_state = None

    def _end(self, it: EpochIterator) -> None:
        """``it`` finished its epoch."""
        stats = it.stats
        assert stats is not None
        self.epoch += 1
        if it.empty_rank is not None:  # on several ranks: the same on every rank
            assert self._sync is not None
            raise ValueError(
                f"the source of rank {it.empty_rank} of {self._sync.world_size} yielded no "
                f"examples in epoch {stats.epoch}, so no rank can yield a batch (each yields as "
                "many as the fewest any rank has); give every rank a share of the data (e.g. "
                "sampler=DistributedSampler(dataset)), and check that no rank's dataset or "
                "sampler is empty"
            )
        if stats.examples_seen == 0:
            raise ValueError(
                f"the source yielded no examples in epoch {stats.epoch}; check that its dataset "
                "and sampler are not empty, and that its batch size is not larger than its "
                "data where it drops its last short batch (drop_last=True, as a DataLoader or "
                "an FFCV Loader takes it)"
            )
        self._warn_backlog(stats)
        self._warn_nothing_yielded(stats)
        self._log_epoch(stats)

    def _log_epoch(self, stats: EpochStats, left: bool = False) -> None:
        """Log an epoch that ended (``left``: part-way), and warn of its non-finite losses."""
        if stats.nonfinite:
            logger.warning(
                "epoch %d: %d candidates had a non-finite selection loss (nonfinite=%r)",
                stats.epoch,
                stats.nonfinite,
                self.nonfinite,
            )
        self.stats.log_epoch(stats, left)

    def _note_peek(self, stats: EpochStats) -> None:
        """Note an epoch left by the caller after at most one batch; :meth:`_warn_peek` warns
        where it was the run's first (the next epoch is epoch 1)."""
        if not self._peek_warned and stats.batches_yielded <= 1:
            self._peeked = stats.batches_yielded

    def _warn_peek(self) -> None:
        """As the next epoch begins, warn (once) where the run's first epoch was left after at
        most one batch (see :func:`~sbloader._epoch_warnings.peek_warning`)."""
        peeked, self._peeked = self._peeked, None
        if peeked is None or self.epoch != 1:
            return
        self._peek_warned = True
        warnings.warn(
            peek_warning(peeked, self.policy),
            UserWarning,
            stacklevel=7,  # (the caller's loop: its next() of the epoch's iterator)
        )

    def _warn_left_saved(self, saved: bool, before_end: bool = False) -> None:
        """As the next epoch begins, warn (once) where a state was ``saved`` after the epoch
        before it was left part-way: that state resumes the rest of the epoch left, and this
        run goes on with the next one instead; ``before_end``: as :meth:`end_epoch` ends the
        epoch left (the current one) after such a state (see
        :func:`~sbloader._epoch_warnings.left_saved_warning`)."""
        if not saved or self._left_saved_warned:
            return
        self._left_saved_warned = True
        message = (
            left_saved_warning(self.epoch, None)
            if before_end
            else left_saved_warning(self.epoch - 1, self.epoch)
        )
        warnings.warn(
            message,
            UserWarning,
            stacklevel=3 if before_end else 7,  # (the caller's call, or its loop's next())
        )

    def _warn_nothing_yielded(self, stats: EpochStats) -> None:
        """Warn (once) where an epoch that kept examples yielded no batch (see
        :func:`~sbloader._epoch_warnings.nothing_yielded_warning`). (With
        ``batches_per_epoch`` a training epoch spans passes, and passes that never fill a
        batch are refused instead: see ``length.FixedEpochIterator``.)"""
        if self._nothing_warned or self._fixed is not None:
            return
        if stats.batches_yielded or not stats.dropped:
            return
        self._nothing_warned = True
        warnings.warn(
            nothing_yielded_warning(
                stats.epoch, stats.dropped, self.batch_size, self.remainder, self.min_batch_size
            ),
            UserWarning,
            stacklevel=6,  # the caller's loop (through the iterator's steps)
        )

    def _warn_backlog(self, stats: EpochStats) -> None:
        """Warn (once) where this rank carries many more selected examples into the next epoch
        than ranks that differ by chance would (see
        :func:`~sbloader._epoch_warnings.drifted_backlog`)."""
        sync = self._sync
        if sync is None or self.remainder != "carry" or self._backlog_warned:
            return
        carried = len(self._pending)
        selected = sum(e.examples_selected for e in self.stats.epochs)
        if not drifted_backlog(carried, self.batch_size, stats.examples_yielded, selected):
            return
        self._backlog_warned = True
        warnings.warn(
            backlog_warning(
                sync.rank, sync.world_size, carried, stats.examples_yielded, stats.epoch
            ),
            UserWarning,
            stacklevel=6,  # the caller's loop (through the iterator's steps)
        )

    def _sharing(self) -> bool:
        """Whether the ranks exchange selection losses every round (``cdf="global"`` with a
        policy that ranks them, or a policy with per-example records such as Stale-SB's store).

        NOTE: the one predicate of every place that decides whether a round makes the exchange
        (a decision, a batchless or drain round, a failing rank's :meth:`EpochIterator._stop_pass
        <sbloader.epoch.EpochIterator._stop_pass>`, ``decisions="device"``'s check): its inputs
        are static and agreed across ranks as the loader is built (:meth:`_shared_options`), so
        every rank makes the exchange in the same rounds."""
        return self._sync is not None and (self._global_ranking() or self.policy.records_examples())

    def _global_ranking(self) -> bool:
        """Whether ``cdf="global"`` has the ranks share losses: not for a policy that ranks none
        against a window (Kath18, Random-Backprop, Traditional), which would gather every rank's
        losses every round for nothing."""
        return self.cdf == "global" and self.policy.ranks_shared_losses()

    # ------------------------------------------------------------------ state
    def _identity(self) -> dict[str, Any]:
        """What a saved state must agree with to belong to this loader
        (:func:`~sbloader._loader_state.identity`, whose NOTE says why each field is there)."""
        return identity(
            self._source,
            self.policy,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            subset=self._subset_digest,
            batch_size=self.batch_size,
            batches_per_epoch=self.batches_per_epoch,
            decisions=self.decisions,
            keep_logits=self.keep_logits,
            frozen_prefix=self._scorer.has_prefix,
            remainder=self.remainder,
            min_batch_size=self.min_batch_size,
            nonfinite=self.nonfinite,
            eval_selection=self.eval_selection,
            cdf=self.cdf,
        )

    def end_epoch(self) -> None:
        """End the current epoch for good, as this loader's next ``iter()`` ends one whose loop
        was left part-way: states saved from now start the next epoch. For a loop that caps its
        steps per epoch (``break``) and saves a checkpoint as each epoch ends (a state saved
        after ``break`` otherwise resumes the rest of the epoch left, for a run that leaves its
        loop to save and stop; see :meth:`state_dict`). A running epoch is closed (call it just
        before ``break``, or after the loop); nothing is taken back after it
        (``unconsumed=``). Does nothing where no epoch was begun or left part-way, and with
        ``batches_per_epoch``, whose training epochs left part-way already count as ended.
        Warns (``UserWarning``) where a state was saved after the epoch was left and before
        this call: that state resumes the epoch's rest.

        Raises:
            RuntimeError: a state saved inside the loop (mid-epoch) was loaded and not iterated
                yet: the loader cannot end an epoch it has not gone on with (resume from a state
                saved after ``end_epoch()``).

        Example:
            >>> import torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from sbloader import SelectiveLoader, Traditional
            >>> data = TensorDataset(torch.randn(12, 3), torch.arange(12) % 2)
            >>> loader = SelectiveLoader(DataLoader(data, batch_size=4), torch.nn.Linear(3, 2),
            ...                          policy=Traditional())
            >>> for step, batch in enumerate(loader):
            ...     if step == 1:
            ...         break  # (two steps per epoch)
            >>> loader.end_epoch()
            >>> state = loader.state_dict()  # as each epoch ends
            >>> state["epoch"], state["active"]  # the next epoch, as the loop goes on with
            (1, False)
        """
        self._check_owner()
        if self._fixed is not None:
            # (its pass's iterator runs on between training epochs: closing it ended the run)
            return
        if self._unfinished is not None and self._unfinished[1]:
            raise RuntimeError(
                f"end_epoch(): the state loaded resumes epoch {self.epoch} part-way (it was "
                "saved inside the loop), and this loader has not gone on with it yet, so it "
                "cannot tell that epoch's rest apart from the next; iterate the loader to go on "
                "with the epoch, or resume from a state saved after end_epoch()"
            )
        # (a state saved already resumes the rest of the epoch: see _warn_left_saved)
        self._warn_left_saved(self._saved_left, before_end=True)
        live = self._live_iterator()
        if live is not None and live.running:
            live.close(resumable=False)
        elif self._unfinished is not None:
            self._end_for_good()
        self._saved_left = False
        self._peeked = None  # (left after one batch on purpose: a loop of one step per epoch)

    def takes_back(self, unconsumed: int = 1) -> bool:
        """Whether :meth:`state_dict` takes ``unconsumed`` now: an epoch is running (with
        ``batches_per_epoch``, a training epoch) and has handed out at least ``unconsumed``
        batches, or its loop was left part-way without ``batches_per_epoch`` and the batches it
        handed out last are kept to be handed out again.

        Args:
            unconsumed: batches fetched and not trained on, 1 or 2 (see :meth:`state_dict`).

        Example:
            >>> import torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from sbloader import SelectiveLoader, Traditional
            >>> data = TensorDataset(torch.randn(8, 3), torch.arange(8) % 2)
            >>> loader = SelectiveLoader(DataLoader(data, batch_size=4), torch.nn.Linear(3, 2),
            ...                          policy=Traditional())
            >>> loader.takes_back()  # nothing handed out yet
            False
            >>> for batch in loader:
            ...     break  # (a training step that raised, say)
            >>> loader.takes_back()  # the batch left with is handed out again on resume
            True
            >>> loader.takes_back(2)  # (only one batch was handed out)
            False
        """
        unconsumed = _checked_unconsumed(unconsumed)
        return unconsumed <= self._takeable()

    def _takeable(self) -> int:
        """How many of the batches handed out last :meth:`state_dict` can take back now."""
        counted: int | None = None  # (with batches_per_epoch: those of this training epoch)
        if self._fixed is not None:
            _, yielded, active = self._fixed.current()
            if not active:
                return 0
            counted = yielded
        it = self._live_iterator()
        if it is not None and it.running:
            n = it.takeable()
        elif self._unfinished is not None:
            n = len(self._left)
        else:
            n = 0
        return n if counted is None else min(n, counted)

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        """Everything needed to resume: epoch, position, generator, policy, pending rows, stats.

        Tensors are CPU tensors and everything else plain Python, so the state loads with
        ``torch.load(..., weights_only=True)``. Restore with :meth:`load_state_dict` on a loader
        built with the same arguments (checked: see :meth:`load_state_dict`).

        Args:
            unconsumed: 1 when the caller has fetched the last batch handed out but not trained
                on it yet (a framework that fetches ahead, as Lightning does): the state is then
                the one that batch was handed out from, and a resumed run hands that same batch
                out first (no selection pass is made again for it), then goes on as the
                uninterrupted run did. 2 where the caller had fetched one ahead of a training
                step that raised (Lightning resumes at the interrupted batch): the two batches
                handed out last are handed out again, in order. Only while an epoch is running
                (with ``batches_per_epoch``, a training epoch, and batches of it), or after its
                loop was left part-way without ``batches_per_epoch`` (a training step that
                raised, in the caller's ``except``), until the next ``iter(loader)``; and not
                past a batch handed out as the source's own reused buffers (FFCV's, with a
                passthrough policy at the source's batch size) once a later one is handed out.
                :meth:`takes_back` says whether it is taken. Default 0.

        An epoch left part-way (``break``) is saved where it stopped, so that saving after
        leaving the loop resumes it; one closed with ``close(resumable=False)`` or ended with
        :meth:`end_epoch` (a loop that caps its steps per epoch and saves as each ends) is saved
        as the start of the next epoch.
        """
        self._check_owner()
        return self._state_dict(_checked_unconsumed(unconsumed))

    def keep_saved_files(self, state: dict[str, Any]) -> None:
        """``state``, a state of this loader taken within ``_state.unsaved_states()`` (a
        Lightning stop's, which a checkpoint may never save), was saved by a checkpoint: the
        files it names (a memory-mapped store's snapshot) are kept from now among the
        ``store_snapshots`` newest, as any saved state's (see ``ExampleStore.keep_spared``)."""
        self.policy.keep_saved_files(state[K_POLICY])

    def keep_ended_state(self, keep: bool = True) -> None:
        """Keep, as each epoch ends, the state that takes back its last batch
        (:attr:`ended_state`), for a caller that fetches past an epoch's last batch before
        training on it (Lightning with a loader that has no ``len()``: the loader's epoch has
        ended when the step on its last batch runs). Costs a state per epoch.

        NOTE: such a caller's step on the epoch's last batch may raise (a KeyboardInterrupt);
        the framework resumes at that batch, but the epoch it belongs to has ended, and a state
        saved then counts it as trained. The state kept here, taken at the end of the epoch
        before anything of the end ran, hands that batch out again and then ends the epoch as
        the uninterrupted run did. Not kept where taking a state writes files (a policy with a
        memory-mapped store, ``store_path``: each state writes a snapshot, and a state taken
        per epoch would push the checkpoints' own out of ``store_snapshots``).

        Args:
            keep: whether to keep it (False drops the one kept).

        Example:
            >>> import torch
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from sbloader import SelectiveLoader, Traditional
            >>> data = TensorDataset(torch.randn(8, 3), torch.arange(8) % 2)
            >>> source = DataLoader(data, batch_size=4)
            >>> loader = SelectiveLoader(source, torch.nn.Linear(3, 2), policy=Traditional())
            >>> loader.keep_ended_state()
            >>> [batch.indices.tolist() for batch in loader]  # (the epoch ends)
            [[0, 1, 2, 3], [4, 5, 6, 7]]
            >>> again = SelectiveLoader(source, torch.nn.Linear(3, 2), policy=Traditional())
            >>> again.load_state_dict(loader.ended_state)  # (the last step was interrupted)
            >>> [batch.indices.tolist() for batch in again], again.epoch
            ([[4, 5, 6, 7]], 1)
        """
        self._keeps_ended = check_bool("keep", keep)
        if not keep:
            self._ended_state = None

    @property
    def ended_state(self) -> dict[str, Any] | None:
        """With :meth:`keep_ended_state`, the state that takes back the last batch of the epoch
        that ended last (:meth:`state_dict` with ``unconsumed=1`` as of just before it ended),
        until the next epoch begins or a state is loaded; else None."""
        return self._ended_state

    def _keep_ended(self) -> None:
        """Called as a pass over the data ends, before its end runs (see keep_ended_state)."""
        if not self._keeps_ended or self._fixed is not None or self._takeable() < 1:
            return
        if any(part.writes_state_files() for part in self.policy.parts()):
            return
        try:
            self._ended_state = self._state_dict(1, warn=False)
        except ValueError:
            # (a state refused now, e.g. a device-side report of an index outside the data, is
            # refused where it is saved or the next epoch begins, naming why; not here)
            self._ended_state = None

    def _state_dict(self, unconsumed: int, warn: bool = True) -> dict[str, Any]:
        """:meth:`state_dict`; ``warn=False``: taken for later, without its warnings."""
        takeable = self._takeable() if unconsumed else 0
        if 0 < takeable < unconsumed:
            it = self._live_iterator()
            if self._fixed is not None and self._fixed.current()[1] < unconsumed:
                cause = "belongs to an earlier training epoch"
            elif it is not None and it.running:
                cause = it.untakeable()
            else:
                cause = self._left_why
            raise ValueError(
                f"unconsumed={unconsumed}, but only the last {takeable} batch handed out can be "
                f"taken back now: the one before it {cause}; pass unconsumed={takeable}"
            )
        if unconsumed > takeable:
            it = self._live_iterator()
            if self._fixed is not None and not self._fixed.current()[2]:
                # NOTE: between training epochs the pass over the data is still running
                # (suspended), but the batch handed out last belongs to a training epoch that
                # has ended (or was abandoned): taken back, the next training epoch would hand
                # it out again.
                raise ValueError(
                    f"unconsumed={unconsumed}, but no training epoch is running: the batches "
                    "handed out were all part of a training epoch that has ended (or was "
                    "abandoned); pass unconsumed=0"
                )
            if it is not None and it.running:
                raise ValueError(
                    f"unconsumed={unconsumed}, but this epoch has handed out no batch yet; pass "
                    "the number of batches the caller has fetched from the loader and not "
                    "trained on"
                )
            raise ValueError(
                f"unconsumed={unconsumed}, but no epoch is running: the batches handed out were "
                "all part of an epoch that has ended (or was closed with resumable=False, or "
                "none was handed out yet); pass unconsumed=0"
            )
        it = self._live_iterator()
        returned = self._returned
        ahead = self._ahead if self._unfinished is not None else None
        share = self._share if self._unfinished is not None else None
        if it is not None and it.running:
            active, position = True, it.position
            returned = it._not_trained(unconsumed)
            ahead = it.ahead_scores()
            share = it.agreed_share()
        elif self._unfinished is not None:
            active, position = True, self._unfinished[0]
            if unconsumed:  # the loop was left part-way (see _abandon)
                taken = self._left[len(self._left) - unconsumed :]
                returned = [*(rows.copy() for rows in taken), *returned]
        else:
            active, position = False, 0
        warn = warn and not taking_rollback()
        if active and position > 0 and not self._mid_epoch_warned and warn:
            # NOTE: said when the state is taken, not only when a resume refuses it: every step
            # checkpoint of a long run would otherwise turn out unusable only at the resume.
            why = self._source.mid_epoch_refusal()
            if why is not None:
                self._mid_epoch_warned = True
                warning = mid_epoch_warning(why, self._fixed is not None)
                warnings.warn(warning, UserWarning, stacklevel=2)
        stats = self.stats.state_dict()
        if unconsumed:
            current = stats["epochs"][-1]  # the taken-back batches count when handed out again
            current["examples_yielded"] -= sum(len(rows) for rows in returned[:unconsumed])
            current["batches_yielded"] -= unconsumed
            # NOTE: a step that raised after reporting its batch (loader.feedback before the
            # backward that ran out of memory) had its report counted, and the resumed run,
            # handing the batch out again, counted it again when reported again (more reported
            # than yielded: refused as a batch reported twice). Its report stays held (the
            # new one, made later, is what the store keeps); only the count is taken back.
            current["feedback"] = min(current["feedback"], current["examples_yielded"])
        state = {
            K_VERSION: self.STATE_VERSION,
            K_IDENTITY: self._identity(),
            K_EPOCH: self.epoch,
            K_POSITION: position,
            K_ACTIVE: active,
            K_PREFILTER: self._epoch_prefilter if active else None,
            K_SHARE: share if active else None,
            K_RNG: self._rng.bit_generator.state,
            K_SOURCE: (
                self._source.state_dict() if self._source_state is None else self._source_state
            ),
            K_POLICY: self.policy.state_dict(),
            K_PENDING: self._pending.state_dict(),
            K_RETURNED: [rows.state_dict() for rows in returned],
            K_CODEC: self._codec.state_dict(),
            K_SCORER: self._scorer.state_dict(),
            K_STATS: stats,
            # (device-side reports' indices are checked here, unless for a rollback backup:
            # a checkpoint never holds a report that every resumed run would fail on)
            K_FEEDBACK: self._feedback.state_dict(
                None if taking_rollback() else self._source.dataset_size
            ),
            K_TRAINING: None if self._fixed is None else self._fixed.state_dict(unconsumed),
            K_AUTOCAST: None
            if self.autocast is None
            else str(self.autocast).removeprefix("torch."),
            **({K_DEVICE_RNG: self._decider.state_dict()} if self._decider is not None else {}),
            **({K_AHEAD: ahead.state_dict()} if ahead is not None else {}),
            K_SPEED: self._speed(),
        }
        if warn:  # (once the state is taken: a refused one loses nothing)
            self._warn_unreported(stats["epochs"])
            if not unconsumed and self._unfinished is not None and not self._unfinished[1]:
                self._saved_left = True  # (see _warn_left_saved)
        return state

    def _warn_unreported(self, epochs: list[dict[str, Any]]) -> None:
        """Warn (once) where a state is taken after batches were yielded in its epoch that were
        not reported yet (``epochs``: the state's stats), in a run that reports its losses
        (:func:`~sbloader._loader_state.unreported_warning`, whose NOTE says why)."""
        if self._unreported_warned or not epochs or not self.policy.takes_feedback():
            return
        warning = unreported_warning(epochs)
        if warning is None:
            return
        self._unreported_warned = True
        warnings.warn(warning, UserWarning, stacklevel=3)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` (at an epoch boundary or mid-epoch).

        Refuses (``ValueError`` naming the field and both values) a state saved by a loader
        with another seed, rank, world size, kind of source, policy (kind or settings, such as a
        selectivity), dataset size, source batch size or epoch length, source order (its
        sampler's class) or ``drop_last``, ``subset``, ``batch_size``, ``batches_per_epoch``,
        ``remainder``, ``min_batch_size``, ``nonfinite``, ``decisions``, ``keep_logits`` or
        ``frozen_prefix`` (whether there is one), ``eval_selection`` or ``cdf``, with or
        without ``quantize_selection``'s int8 copy (a copy that
        ``"auto"`` chose is dropped instead for a state saved without one, and kept where the
        state is refused), and with
        ``decisions="device"`` a generator state of another kind of device than the loader's
        (CPU or CUDA); migrates a version-1 state. A refused state changes nothing: the loader
        is as it was (a running epoch is closed, and the next ``iter(loader)`` resumes it where
        it stopped, whichever check refused the state; where its source cannot replay its order
        mid-epoch, e.g. a sampler on torch's global RNG, it is left part-way instead, as after
        ``break``). The next ``iter(loader)`` continues a
        restored unfinished epoch.

        The other speed options may differ (a run resumed on another machine): a state saved
        with another ``overlap_selection``, ``selection_scale``, ``compile_selection``,
        ``memory_format``, ``selection_batch_size``, explicit ``autocast``,
        :class:`~sbloader.QuantizedSelection` settings, with or without a ``selector`` (of
        another class) or another ``loss_fn`` (a loss module's class and settings) loads with a
        ``UserWarning`` naming each
        option and its saved value; the run then selects as this loader's options do, so it is
        not the uninterrupted run from here on. ``prefetch`` changes no selection and is not
        compared.
        """
        # NOTE: all or nothing. The policy's, codec's and scorer's own checks (a window size,
        # a beta) run part-way through restoring; a state refused there must not leave the
        # loader half restored (its epoch, generators and position taken from the refused
        # state), or a caller that starts afresh after a refusal would silently continue the
        # refused run. So the loader's own state is taken first and put back on any failure,
        # with what a saved state does not tell: whether an epoch left part-way is resumed by
        # the next iter() (a saved state always resumes it; after a break the loader does not).
        # The version and identity checks run inside too: refused before restoring, they left a
        # running epoch running, and the next iter() then skipped its rest as abandoned, where
        # a state refused later resumed it; every refusal now ends alike (closed, resumed).
        live = self._live_iterator()
        running = live is not None and live.running
        # NOTE: a running epoch is closed below and, if the state is refused, resumed by the
        # next iter() by replaying its source's order: where that order cannot be replayed (a
        # sampler on torch's global RNG), the replay skipped the consumed batches of a new
        # order, repeating some examples and never yielding others; it is then left part-way
        # instead, as after ``break``.
        resumable = running and self._source.mid_epoch_refusal() is None
        unfinished, source_state = self._unfinished, self._source_state
        # NOTE: an "auto" loader adopts the saved run's precision (its int8 copy or not, its
        # autocast dtype) before the later checks: a state refused by one of them must leave
        # the loader's own choice, which the backup's restore would otherwise take for another
        # run's (it refused its own state, naming the wrong cause, and kept the adopted one).
        precision = self._scorer.precision_choice()
        # (a backup for this process only: a memory-mapped store names its files, a feature
        # cache its rows, nothing is copied; see _state.rollback_state)
        with rollback_state():
            backup = self.state_dict()
        try:
            checked = self._checked(state)
            self._restore(checked)
            self._left, self._ended_state, self._saved_left = [], None, False
        except BaseException:
            self._scorer.restore_precision(precision)
            self._restore(backup, rollback=True, resume=resumable)
            if not running:  # a running epoch was closed: the next iter() resumes it
                self._unfinished = unfinished
            elif not resumable and self._unfinished is not None:
                self._unfinished = (self._unfinished[0], False)  # (left part-way)
            self._source_state = source_state
            raise
        # NOTE: said only now: logged as it was adopted, a resume refused after it said that
        # the loader selects in a precision it does not (the refusal puts its own back).
        if self._scorer.precision != precision[3]:
            logger.info("selection precision: %s", self._scorer.precision)
        saved = checked.get(K_SPEED)
        if saved:  # (states saved before the speed options were recorded are not compared)
            warn_other_speed(saved, self._speed())

    def _speed(self) -> dict[str, str]:
        """The options that change how selection passes score, compared (not enforced) when a
        state is loaded (:func:`~sbloader._loader_state.speed_options`)."""
        return speed_options(
            self._scorer.forward,
            self._scorer.quantized,
            autocast=self.autocast,
            overlapping=self.overlapping,
            memory_format=self.memory_format,
            selection_batch_size=self.selection_batch_size,
            selector=self.selector,
            loss_fn=self._scorer.loss_fn,
        )

    def _checked(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` migrated to this version, once its version, rank and identity are checked
        against this loader's (:func:`~sbloader._loader_state.checked_state`)."""
        return checked_state(
            state,
            version=self.STATE_VERSION,
            from_v1=self._from_v1,
            rank=self.rank,
            world_size=self.world_size,
            identity=self._identity(),
            batches_per_epoch=None if self._fixed is None else self._fixed.count,
        )

    def _restore(self, state: dict[str, Any], rollback: bool = False, resume: bool = False) -> None:
        """Set the loader to ``state`` (checked by :meth:`load_state_dict`'s caller part);
        ``rollback``: ``state`` is this loader's own, taken before a refused load (its source's
        generators are put back as they were, even where a mid-epoch resume would be refused);
        ``resume``: with ``rollback``, the running epoch that ``state`` holds is resumed by the
        next ``iter()``, and its source is told so, as for a mid-epoch state."""
        active, position = bool(state[K_ACTIVE]), int(state[K_POSITION])
        training = state.get(K_TRAINING)
        # NOTE: the running epoch is stopped before the source's generators are restored: its
        # prefetch thread may still fetch (and, past the end of the data, draw a new order from
        # the generators) until it is stopped.
        live = self._live_iterator()
        if live is not None:
            live.close()
        self._live = None
        self._scorer.adopt_quantized(state[K_SCORER])
        self._scorer.adopt_autocast(state.get(K_AUTOCAST, self.autocast), self._autocast_requested)
        # NOTE (resume): a source with its own state (StatefulSource) resumes where a mid-epoch
        # state says; told it was not, its next epoch refused to start at the running epoch's
        # position after a refused load ("can resume at source batch 0").
        mid_epoch = active and position > 0 and (resume or not rollback)
        try:
            self._source.load_state_dict(state[K_SOURCE], mid_epoch=mid_epoch)
        except ValueError:
            if not (rollback and mid_epoch):
                raise
            # (a source of the user's own that refuses every mid-epoch state: put back as it was)
            self._source.load_state_dict(state[K_SOURCE], mid_epoch=False)
        if active and position == 0 and not rollback:
            # NOTE: an epoch begun (its order drawn) whose first source batch raised (e.g. a
            # transient out-of-memory error in the selection pass): nothing was consumed, but
            # the source's generators are past the epoch's draw; it starts again with its order.
            self._source.restart_epoch()
        self._source_state = state[K_SOURCE]
        self.epoch = int(state[K_EPOCH])
        self._unfinished = (position, True) if active else None
        self._share = state.get(K_SHARE) if active else None
        prefilter = state.get(K_PREFILTER)
        self._resume_prefilter = None if prefilter is None or not active else bool(prefilter)
        if self._resume_prefilter is not None:  # (what a state saved before resuming says)
            self._epoch_prefilter = self._resume_prefilter
        self._rng.bit_generator.state = state[K_RNG]
        self.policy.load_state_dict(state[K_POLICY])
        self._codec.load_state_dict(state[K_CODEC])
        self._scorer.load_state_dict(state[K_SCORER])
        self._pending.load_state_dict(state[K_PENDING], self.device)
        # (absent from states saved before ``unconsumed`` existed)
        self._returned = [Rows.from_state(r, self.device) for r in state.get(K_RETURNED, [])]
        self.stats.load_state_dict(state[K_STATS])
        if K_FEEDBACK in state:
            self._feedback.load_state_dict(
                state[K_FEEDBACK], None if rollback else self._source.dataset_size
            )
        else:
            self._feedback = FeedbackBuffer()
        if self._fixed is not None and training is not None:
            self._fixed.load_state_dict(training)
        if self._decider is not None:
            # NOTE: checked against the kind of device the draws will be made on (batches go
            # to the loader's device), so that a state of another kind is refused now; a
            # rollback restores this loader's own, whatever device the model is on now.
            self._decider.load_state_dict(state[K_DEVICE_RNG], None if rollback else self.device)
        ahead = state.get(K_AHEAD)
        self._ahead = None if ahead is None or not active else AheadScores.from_state(ahead)

    def _from_v1(self, state: dict[str, Any]) -> dict[str, Any]:
        return loader_state_v1_to_v2(state, self._scorer.has_prefix, self.keep_logits)

    def __repr__(self) -> str:
        return (
            f"SelectiveLoader(policy={self.policy!r}, batch_size={self.batch_size}, "
            f"remainder={self.remainder!r}, seed={self.seed})"
        )


def _checked_unconsumed(unconsumed: Any) -> int:
    """``unconsumed`` of :meth:`SelectiveLoader.state_dict`, checked: an int from 0 to
    :data:`~sbloader.epoch.MAX_UNCONSUMED`."""
    if unconsumed not in range(MAX_UNCONSUMED + 1):
        raise ValueError(
            "unconsumed should be 0, 1 or 2 (the batches fetched from the loader and not trained "
            "on yet: 2 where a framework fetched one ahead of a training step that raised), but "
            f"got unconsumed={unconsumed!r}"
        )
    return int(unconsumed)


def _digest(mask: np.ndarray) -> str:
    """A short fingerprint of a ``subset`` mask: how many it keeps, and a digest of which."""
    return f"{int(np.count_nonzero(mask))}:{batch_digest(np.asarray(mask, dtype=bool))}"


if TYPE_CHECKING:
    from .epoch import EpochHost

    def _hosts_epochs(loader: SelectiveLoader) -> EpochHost:
        """(For the type checker: a SelectiveLoader provides every member its epoch iterator
        uses, :class:`~sbloader.epoch.EpochHost`.)"""
        return loader
