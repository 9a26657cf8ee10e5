"""The state protocol of :class:`~sbloader.SelectiveLoader`, its parts that are plain functions
of values: the keys of the loader's state (version 2), what a saved state must match to belong to
a loader (:func:`identity`), the speed options compared, not enforced, when one is loaded
(:func:`speed_options`, :func:`warn_other_speed`), the checks a state passes before it is
restored (:func:`checked_state`), and the warnings said as a state is taken.

:meth:`SelectiveLoader.state_dict <sbloader.SelectiveLoader.state_dict>` and
:meth:`SelectiveLoader.load_state_dict <sbloader.SelectiveLoader.load_state_dict>` build and
restore the state with these (their documentation is the protocol's).
"""

from __future__ import annotations

import functools
import numbers
import types
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ._state import check_identity, check_version
from .distributed import batch_digest

if TYPE_CHECKING:
    from .policies import Policy
    from .selection import SelectionForward
    from .sources import Source

__all__ = [
    "K_ACTIVE",
    "K_AHEAD",
    "K_AUTOCAST",
    "K_CODEC",
    "K_DEVICE_RNG",
    "K_EPOCH",
    "K_FEEDBACK",
    "K_IDENTITY",
    "K_PENDING",
    "K_POLICY",
    "K_POSITION",
    "K_PREFILTER",
    "K_RETURNED",
    "K_RNG",
    "K_SCORER",
    "K_SHARE",
    "K_SOURCE",
    "K_SPEED",
    "K_STATS",
    "K_TRAINING",
    "K_VERSION",
    "checked_state",
    "describe_callable",
    "identity",
    "mid_epoch_warning",
    "speed_options",
    "unreported_warning",
    "warn_other_speed",
]

# The keys of the loader's state (version 2).
K_VERSION, K_IDENTITY, K_EPOCH, K_POSITION, K_ACTIVE = (
    "version",
    "identity",
    "epoch",
    "position",
    "active",
)
K_RNG, K_SOURCE, K_POLICY, K_PENDING, K_CODEC, K_SCORER, K_STATS, K_RETURNED = (
    "rng",
    "source",
    "policy",
    "pending",
    "codec",
    "scorer",
    "stats",
    "returned",
)
K_FEEDBACK = "feedback"  # optional: states saved before feedback existed have none
# NOTE: an optional key of version 2 (absent from states saved before batches_per_epoch): the
# training-epoch clock, or None without batches_per_epoch.
K_TRAINING = "training"
K_DEVICE_RNG = "device_rng"  # only with decisions="device"
K_AUTOCAST = "autocast"  # the selection precision (optional: older states have none)
K_AHEAD = "ahead"  # optional: a source batch scored ahead (overlap_selection) and not consumed
# NOTE: optional (absent from states saved before it): the speed options the state was saved
# with (see speed_options), compared, not enforced, when it is loaded.
K_SPEED = "speed"
# NOTE: optional (absent from states saved before it): whether the epoch a state was saved in
# loaded only what the policy kept of the source (a Stale-SB stale epoch's prefilter), which
# decides what its position counts (filtered source batches, or all of them).
K_PREFILTER = "prefilter"
# NOTE: optional (absent from states saved before it, and None on one process): the share of
# the running epoch's pass that every rank reports as drawn (EpochIterator.shared_fraction), so
# that a resumed run's ``progress`` goes on as the uninterrupted run's, the same on every rank.
K_SHARE = "share"


def _stable_repr(value: Any) -> str:
    """``repr(value)`` with functions and classes (nested in dicts, lists and tuples) named by
    their module and qualified name, for :func:`speed_options`.

    NOTE: a plain repr names a function by its address (``<function f at 0x7f...>``), which
    differs from process to process: ``compile_selection={"backend": my_backend}`` then warned
    on every resume with the very same options.
    """
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_stable_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        # (a set of strings iterates in an order of the process's hash seed)
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_stable_repr(v) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', None)}.{value.__qualname__}"
    text = repr(value)
    if " at 0x" in text:  # an object's default repr
        kind = type(value)
        return f"<{kind.__module__}.{kind.__qualname__} object>"
    return text


def describe_callable(fn: Any) -> str:
    """A description of a loss function that is the same in every process for the same loss:
    a function by its module and qualified name, a ``functools.partial`` by its function and
    arguments, a loss module (or any callable object) by its class and its public settings
    (tensors by shape and a digest of their values), for :func:`speed_options`.

    NOTE: not ``repr``: ``nn.CrossEntropyLoss(label_smoothing=0.5)``'s repr omits the
    smoothing, so a resume with another smoothing went unnoticed.

    Example:
        >>> from torch import nn
        >>> describe_callable(nn.CrossEntropyLoss(reduction="none", label_smoothing=0.1))[22:]
        "CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1, reduction='none')"
    """
    if isinstance(fn, functools.partial):
        args = [describe_callable(a) if callable(a) else _setting(a) for a in fn.args]
        args += [f"{k}={_setting(v)}" for k, v in sorted(fn.keywords.items())]
        return f"partial({describe_callable(fn.func)}, {', '.join(args)})"
    if isinstance(fn, types.MethodType):  # a bound method: its function (and its object's class)
        return f"{describe_callable(fn.__func__)} of {type(fn.__self__).__qualname__}"
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, type)):
        return _stable_repr(fn)
    kind = type(fn)
    settings = ", ".join(
        f"{k}={_setting(v)}"
        for k, v in sorted(vars(fn).items() if hasattr(fn, "__dict__") else ())
        if not k.startswith("_") and k != "training"
    )
    buffers = ""
    if isinstance(fn, nn.Module):
        named = [*fn.named_buffers(), *fn.named_parameters()]
        buffers = "".join(f", {k}={_setting(v)}" for k, v in sorted(named, key=lambda kv: kv[0]))
    return f"{kind.__module__}.{kind.__qualname__}({settings}{buffers})"


#: Tensors of a loss module up to this many elements are described by a digest of their
#: values (class weights, say); larger ones (a frozen teacher's weights) by shape and dtype alone,
#: so that ``state_dict()`` does not copy and hash them at every checkpoint.
_DIGESTED_ELEMENTS = 65_536


def _setting(value: Any) -> str:
    """A setting of :func:`describe_callable`: a tensor by its shape and a digest of its values
    (up to :data:`_DIGESTED_ELEMENTS`), anything else as :func:`_stable_repr` gives it."""
    if isinstance(value, torch.Tensor):
        if value.numel() > _DIGESTED_ELEMENTS:
            return f"tensor{tuple(value.shape)}:{value.dtype}"
        return f"tensor{tuple(value.shape)}#{batch_digest(value):x}"
    return _stable_repr(value)


def identity(
    source: Source,
    policy: Policy,
    *,
    seed: int,
    rank: int,
    world_size: int,
    subset: str | None,
    batch_size: int,
    batches_per_epoch: int | None,
    decisions: str,
    keep_logits: bool,
    frozen_prefix: bool,
    remainder: str,
    min_batch_size: int,
    nonfinite: str,
    eval_selection: bool,
    cdf: str,
) -> dict[str, Any]:
    """What a saved state must agree with to belong to a loader of these arguments (each
    named as the loader's attribute of that name; ``frozen_prefix``: whether there is one,
    ``subset``: its digest).

    NOTE: a mid-epoch state records its position as source batches consumed, so the
    source's batch size and epoch length and the ``subset`` are part of it: resumed with
    another, the epoch would silently skip or repeat examples. The carried rows hold the
    selection's logits (``keep_logits``) and a frozen prefix's features, or not, so those two
    are part of it too: loaded into a loader that keeps the other, a later batch's join
    raised or its ``logits``/``features`` came back None. So are what makes the batches
    handed out (``remainder``, ``min_batch_size``, ``nonfinite``) and the source's order
    (its sampler's class, e.g. ``RandomSampler`` or ``SequentialSampler``; a
    ``DistributedSampler``'s seed and ``shuffle``, which its class does not tell, are checked
    by the source's own state, :func:`~sbloader.sources.sampler_settings`) and ``drop_last``,
    and what the selection
    passes score and rank against (``eval_selection``, ``cdf``). The fields of the source's
    batches that the passes score (``input_key``, ``target_key``) are checked by the batch
    codec's state. So is the kind of source (:meth:`Source.state_kind
    <sbloader.sources.Source.state_kind>`), whose state the source reads. (Keys added later
    are absent from older states, which are then not checked for them.)
    """
    return {
        "seed": seed,
        "rank": rank,
        "world_size": world_size,
        # NOTE: the kind of source (a DataLoader's, an index_key= iterable's, a stateful
        # loader's): their states hold other things, and one loaded into another failed
        # with a bare KeyError or a version error advising another sbloader.
        "source": source.state_kind(),
        "policy": policy.kind(),
        "policy_settings": policy.settings(),
        "dataset_size": source.dataset_size,
        "source_batch_size": source.batch_size,
        "epoch_size": source.epoch_size,
        "subset": subset,
        "batch_size": batch_size,
        "batches_per_epoch": batches_per_epoch,
        "decisions": decisions,
        "keep_logits": keep_logits,
        "frozen_prefix": frozen_prefix,
        # What the batches handed out are made of: a state loaded with other ones would
        # yield another run's batches (and, with another order or drop_last, resume a
        # mid-epoch position over other examples).
        "remainder": remainder,
        "min_batch_size": min_batch_size,
        "nonfinite": nonfinite,
        "source_drop_last": source.drop_last(),
        "sampler": None if source.sampler is None else type(source.sampler).__name__,
        # What the selection passes score and rank against: in train mode (dropout on) or
        # not, and each rank's own losses or every rank's (cdf): resumed with the other,
        # the run would select otherwise than the one it continues.
        "eval_selection": eval_selection,
        "cdf": cdf,
    }


def speed_options(
    forward: SelectionForward,
    quantized: Any,
    *,
    autocast: Any,
    overlapping: bool,
    memory_format: torch.memory_format | None,
    selection_batch_size: int | None,
    selector: nn.Module | None,
    loss_fn: Callable[..., Any],
) -> dict[str, str]:
    """The options that change how selection passes score, as shown in messages (``forward``:
    the scorer's :class:`~sbloader.selection.SelectionForward`, ``quantized``: its int8 copy or
    None; the others as the loader's attributes of those names): the effective ``autocast``
    (an ``"auto"`` loader's after adopting a saved run's), ``overlap_selection``,
    ``selection_scale``, ``compile_selection``, ``memory_format``, ``selection_batch_size``,
    ``quantize_selection``'s settings, whether there is a ``selector`` (by its class's name)
    and the ``loss_fn`` (:func:`describe_callable`: a loss module's class and settings, e.g.
    its ``label_smoothing``, which its repr omits).

    NOTE: not part of the identity: a run may resume with other speed options (another
    machine: its cores, its native precisions), and then selects as they do from the resume
    on (:func:`warn_other_speed`). Left out: ``prefetch``, which changes nothing a run
    yields, and ``cache_features``, whose cache a resume refills (or restores, with
    ``save_feature_cache``: see its documentation). ``quantize_selection`` on or off,
    ``decisions``, ``keep_logits`` and ``frozen_prefix`` are refused where they differ (the
    state holds their values).
    """
    compiled = forward.compile_kwargs
    return {
        "autocast": repr(autocast),
        "overlap_selection": repr(overlapping),
        "selection_scale": repr(forward.scale),
        "compile_selection": _stable_repr(compiled if compiled else compiled is not None),
        "memory_format": repr(memory_format),
        "selection_batch_size": repr(selection_batch_size),
        "quantize_selection": repr(None if quantized is None else quantized.config),
        "selector": "None" if selector is None else type(selector).__name__,
        "loss_fn": describe_callable(loss_fn),
    }


def warn_other_speed(saved: Mapping[str, str] | None, current: Mapping[str, str]) -> None:
    """Warn (``UserWarning``) where a state loaded was saved with other speed options than
    the loader's (``current``; both as :func:`speed_options` gives them): the resumed run then
    selects otherwise than the uninterrupted one from here on. Allowed, not refused; states
    saved before the speed options were recorded are not compared."""
    if not saved:
        return
    changed = [k for k, v in saved.items() if k in current and current[k] != v]
    if not changed:
        return
    was = ", ".join(f"{k}={saved[k]}" for k in changed)
    now = ", ".join(f"{k}={current[k]}" for k in changed)
    warnings.warn(
        f"the loaded SelectiveLoader state was saved with {was}, but this loader has {now}: "
        "these options change the selection passes, so from here on this run selects "
        "otherwise than the saved run would have (allowed, e.g. to resume on another "
        f"machine); build the loader with {was} to resume it exactly",
        UserWarning,
        stacklevel=3,
    )


def checked_state(
    state: dict[str, Any],
    *,
    version: int,
    from_v1: Callable[[dict[str, Any]], dict[str, Any]],
    rank: int,
    world_size: int,
    identity: Mapping[str, Any],
    batches_per_epoch: int | None,
) -> dict[str, Any]:
    """``state`` migrated to ``version`` (a version-1 state by ``from_v1``), once its version,
    rank and identity are checked against the loader's (``rank``, ``world_size``, its
    :func:`identity` and its ``batches_per_epoch``; refused with ``ValueError``, naming the field
    and the fix)."""
    if isinstance(state, Mapping) and "ranks" in state and K_IDENTITY not in state:
        # NOTE: a wrapper's state (AcceleratedLoader's, the Lightning callback's) holds every
        # process's loader state; its own version (1) was taken for sbloader 0.1's loader
        # state, which failed inside the migration with a bare KeyError (found by review).
        raise ValueError(
            f"this state holds the loader states of {len(state['ranks'])} process(es) "
            "(its 'ranks'): it was saved by a wrapper (AcceleratedLoader.state_dict(), or the "
            "Lightning SelectiveLoaderCallback), not by SelectiveLoader.state_dict(); load it "
            "with the same wrapper (register the AcceleratedLoader for checkpointing in both "
            "runs), or pass this process's entry, state['ranks'][rank]"
        )
    state = check_version(state, "SelectiveLoader", version, {1: from_v1})
    _check_fields(state)
    saved_rank = state[K_IDENTITY].get("rank", rank)
    if saved_rank != rank and world_size > 1:
        raise ValueError(
            f"rank {rank} was given the loader state of rank {saved_rank}: every rank "
            "must load its own state. Save and load it on each rank, or under Accelerate "
            "register sbloader.integrations.accelerate.AcceleratedLoader(loader) for "
            "checkpointing (Accelerate saves a registered object from the main process only)"
        )
    check_identity(
        "SelectiveLoader",
        state[K_IDENTITY],
        identity,
        "build the loader with the saved run's arguments (seed=, policy=, batch_size=, "
        "subset=, keep_logits=, frozen_prefix=, the same data, source batch size and world "
        "size) to resume it",
    )
    training = state.get(K_TRAINING)
    if batches_per_epoch is not None and training is None:
        raise ValueError(
            f"the saved SelectiveLoader state has no training epochs of batches_per_epoch="
            f"{batches_per_epoch} (it was saved without batches_per_epoch); build the loader "
            "with the saved run's arguments to resume it"
        )
    return state


#: The keys every version-2 loader state has (the others are optional: absent from states saved
#: before they existed).
_REQUIRED = (
    K_IDENTITY,
    K_EPOCH,
    K_POSITION,
    K_ACTIVE,
    K_RNG,
    K_SOURCE,
    K_POLICY,
    K_PENDING,
    K_CODEC,
    K_SCORER,
    K_STATS,
)


#: The required keys whose values are dicts (the identity and the components' own states).
_DICTS = (K_IDENTITY, K_RNG, K_SOURCE, K_POLICY, K_PENDING, K_CODEC, K_SCORER, K_STATS)


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters, for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_fields(state: Mapping[str, Any]) -> None:
    """Refuse a version-2 ``state`` that lacks a required key, whose identity or components'
    states are no dicts, or whose epoch, position or ``active`` flag is not what
    :meth:`SelectiveLoader.state_dict <sbloader.SelectiveLoader.state_dict>` writes
    (``ValueError`` naming the field).

    NOTE: a truncated state failed with a bare ``KeyError`` naming only the key; an edited or
    corrupted one loaded: ``position=-1`` resumed the epoch from before its start (96 examples
    seen in an epoch of 64), ``epoch=1.7`` was truncated to 1 and ``active=None`` was taken
    for an ended epoch; a component's state set to None failed inside that component, with a
    bare ``TypeError`` naming neither the field nor the fix.
    """
    fix = "pass a state saved by SelectiveLoader.state_dict(), as it returned it"
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(
            f"the saved SelectiveLoader state has no {', '.join(map(repr, missing))} (a "
            f"truncated or edited state); {fix}"
        )
    for key in _DICTS:
        if not isinstance(state[key], Mapping):
            raise ValueError(
                f"the saved SelectiveLoader state has {key}={_short(state[key])}, but it should "
                f"be a dict; {fix}"
            )
    for key in (K_EPOCH, K_POSITION):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(
                f"the saved SelectiveLoader state has {key}={value!r}, but it should be an int "
                f">= 0; {fix}"
            )
    if not isinstance(state[K_ACTIVE], (bool, np.bool_)):
        raise ValueError(
            f"the saved SelectiveLoader state has {K_ACTIVE}={state[K_ACTIVE]!r}, but it should "
            f"be True or False; {fix}"
        )


def mid_epoch_warning(why: str, fixed: bool) -> str:
    """The warning where a state is saved in the middle of a pass over the data that its source
    cannot resume there (``why``: :meth:`Source.mid_epoch_refusal
    <sbloader.sources.Source.mid_epoch_refusal>`; ``fixed``: with ``batches_per_epoch``).
    Said when the state is taken (see the NOTE in ``SelectiveLoader.state_dict``).
    """
    end = (
        "the end of a pass over the data (with batches_per_epoch, not every training epoch's end)"
        if fixed
        else "an epoch's end"
    )
    return (
        "this state is saved in the middle of a pass over the data, where it cannot "
        f"be resumed: {why} (load_state_dict refuses it; a state saved at {end} "
        "resumes)"
    )


def unreported_warning(epochs: list[dict[str, Any]]) -> str | None:
    """The warning where a state is taken after batches were yielded in its epoch that were
    not reported yet (``epochs``: the state's stats, at least one), or None where none is
    missing or the run never reported (the loader asks only where its policy takes reports).

    NOTE: a state taken between a batch's yield and its ``loader.feedback`` (a checkpoint
    saved in the training step before the report, as the README loop's ``...`` invites)
    counts the batch as trained but holds no report of it: the resumed run never gets that
    report, and its stale epochs decided from older losses than the uninterrupted run's,
    with nothing said. The report cannot be added to a state already taken, so this is said
    when it is taken (a warning, not an error: a run may report only some batches on
    purpose). Runs that never reported, and policies that ignore reports, are not told.
    """
    current = epochs[-1]
    missing = current["examples_yielded"] - current["feedback"]
    if missing <= 0 or not any(e["feedback"] for e in epochs):
        return None
    return (
        f"this state is taken after {missing} of the {current['examples_yielded']} examples "
        f"yielded in epoch {current['epoch']} were trained but not reported through "
        "loader.feedback: a run resumed from it never gets their reports (made after this "
        "call), so its stale epochs decide from older losses than the uninterrupted run's. "
        "Call loader.feedback(batch.indices, losses) before loader.state_dict() in the "
        "training step (or pass unconsumed=1 for a batch fetched but not trained yet)"
    )
