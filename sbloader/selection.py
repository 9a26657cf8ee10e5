"""The selection pass: one forward of the candidates to get one loss per example."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import sys
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import batch as B
from ._checks import FieldError, check_float

__all__ = [
    "FieldsForward",
    "Forward",
    "Output",
    "SelectionForward",
    "check_class_outputs",
    "check_class_targets",
    "check_forward",
    "check_loss_fn",
    "check_output",
    "downsample",
    "eval_mode",
    "features_as_float",
    "input_fields",
    "is_fsdp",
    "model_output",
    "prefix_features",
    "restrict",
    "selection_autocast",
    "selection_outputs",
    "tensor_field",
    "unbound_inputs",
    "unused_fields",
    "unwrap",
]

#: ``forward(model, batch) -> outputs``: how the selection pass calls the model on a chunk of
#: candidates (``batch``: the source batch's structure restricted to the chunk's rows).
Forward = Callable[[nn.Module, Any], Any]
#: Which part of the model's outputs ``loss_fn`` and ``keep_logits`` take: None (the default
#: rule, see :func:`model_output`), a key or attribute name, a position, or a callable.
Output = str | int | Callable[[Any], Any] | None


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / DataParallel / torch.compile wrappers.

    NOTE: selection passes must call the unwrapped module: a forward through the DDP wrapper on
    one rank but not another makes DDP's collectives mismatch across ranks.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> unwrap(nn.DataParallel(model)) is model, unwrap(model) is model
        (True, True)
    """
    while True:
        inner = getattr(model, "module", None)
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) and inner:
            model = inner
            continue
        # NOTE: torch.compile's OptimizedModule holds the module as its child _orig_mod. Read
        # as an attribute, FSDP1 forwards the name to the module it wraps: FSDP1 over a compiled
        # module was unwrapped to the raw module, whose freed shards the pass then called.
        orig = model._modules.get("_orig_mod")
        if isinstance(orig, nn.Module):
            model = orig
            continue
        return model


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` (or a submodule) is sharded by FSDP (``FullyShardedDataParallel`` or
    ``fully_shard``): its forward then gathers parameters from every rank, a collective.

    Example:
        >>> is_fsdp(nn.Linear(2, 2))
        False
    """
    # NOTE: a model sharded by FSDP was made with torch.distributed.fsdp already imported;
    # importing it here for every other model would cost about a second.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return False
    kinds = tuple(
        getattr(fsdp, k) for k in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, k)
    )
    return any(isinstance(m, kinds) for m in model.modules())


@contextlib.contextmanager
def eval_mode(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Put ``model`` in eval mode and restore every submodule's own ``training`` flag afterwards.

    Restores each submodule individually (not ``model.train(was_training)``), so a deliberately
    frozen BatchNorm inside a training model stays frozen; restores even when the body raises,
    including KeyboardInterrupt.

    NOTE (cost): ``model.eval()`` and ``module.training = flag`` go through ``Module.train`` and
    ``Module.__setattr__`` for every submodule, about 3 microseconds each: 190 microseconds per
    selection pass for a ResNet-18 (65 modules), a few percent of its forward on a GPU. For
    modules whose class keeps torch's ``train`` and ``__setattr__`` (see :func:`_plain_training`)
    the flag is set directly, which is what those methods do; a module with its own ``train``
    (e.g. one keeping a BatchNorm frozen) or ``__setattr__`` anywhere in the tree makes the pass
    call ``model.eval()`` as before, and each such module whose flag that changed is put back
    with its own ``train(flag)`` (in ``model.modules()``'s order, parents first; the flags of
    the others are then set directly).

    NOTE: its ``train`` may do more than set flags, which only it can undo: loralib's
    ``lora.Linear`` merges its low-rank update into the frozen weight on ``eval()`` and takes it
    out on ``train()``. Restored by ``module.training = flag`` alone, such a layer stayed merged
    in a training model: its forward then used the merged weight only, and the update's
    parameters got no gradient for the rest of the run.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
        >>> with eval_mode(net):
        ...     [m.training for m in net.modules()]
        [False, False, False]
        >>> [m.training for m in net.modules()]
        [True, True, True]
    """
    if not enabled:
        yield
        return
    flags = [(m, m.training, _plain_training(cast(type, type(m)))) for m in model.modules()]
    direct = type(model).eval is nn.Module.eval and all(plain for _, _, plain in flags)
    try:
        if direct:
            for m, _, _ in flags:
                object.__setattr__(m, "training", False)
        else:
            model.eval()
        yield
    finally:
        for m, flag, plain in flags:
            if plain:
                object.__setattr__(m, "training", flag)
            elif m.training != flag:
                m.train(flag)  # (its own train, which may undo more than the flag: see the NOTE)
            else:
                m.training = flag


# NOTE: bounded: torch.fx makes a new GraphModule class for every traced module (each refresh
# of an int8 selection copy traces one), so an unbounded cache would grow with the run.
@functools.lru_cache(maxsize=1024)
def _plain_training(cls: type) -> bool:
    """Whether ``cls.train(mode)`` only sets ``training`` on itself and its children, and
    setting ``training`` on it is a plain attribute write: it keeps ``nn.Module``'s ``train``
    and ``__setattr__``, and ``training`` is no property of its own.

    Example:
        >>> _plain_training(nn.Linear), _plain_training(nn.Module)
        (True, True)
    """
    return (
        getattr(cls, "train", None) is nn.Module.train
        and cls.__setattr__ is nn.Module.__setattr__
        and not any("training" in vars(base) for base in cls.__mro__ if base is not nn.Module)
    )


def check_loss_fn(loss_fn: Callable[..., torch.Tensor]) -> None:
    """Reject, before any data flows, a ``loss_fn`` that cannot be called and loss modules
    that reduce over the batch.

    Raises:
        TypeError: ``loss_fn`` is not callable (e.g. the name of a loss), or is a class (e.g.
            ``nn.CrossEntropyLoss`` without parentheses).
        ValueError: ``loss_fn`` is a loss module whose ``reduction`` is not ``"none"``.

    Example:
        >>> check_loss_fn(nn.CrossEntropyLoss(reduction="none"))  # one loss per example: fine
        >>> check_loss_fn(nn.CrossEntropyLoss())
        Traceback (most recent call last):
            ...
        ValueError: loss_fn should return one loss per example, but got a loss with
        reduction='mean'; pass reduction='none', e.g. nn.CrossEntropyLoss(reduction='none')
        >>> check_loss_fn("cross_entropy")
        Traceback (most recent call last):
            ...
        TypeError: loss_fn should be a callable loss_fn(outputs, targets) returning one loss per
        example, e.g. nn.CrossEntropyLoss(reduction='none'), but got loss_fn='cross_entropy'
    """
    if not callable(loss_fn):
        raise TypeError(
            "loss_fn should be a callable loss_fn(outputs, targets) returning one loss per "
            f"example, e.g. nn.CrossEntropyLoss(reduction='none'), but got loss_fn={loss_fn!r}"
        )
    if isinstance(loss_fn, type):
        raise TypeError(
            f"loss_fn should be a loss function or module instance, but got the class "
            f"{loss_fn.__name__}; create it, e.g. loss_fn={loss_fn.__name__}(reduction='none')"
        )
    reduction = getattr(loss_fn, "reduction", "none")
    if reduction != "none":
        raise ValueError(
            "loss_fn should return one loss per example, but got a loss with "
            f"reduction={reduction!r}; pass reduction='none', e.g. "
            "nn.CrossEntropyLoss(reduction='none')"
        )


_BINARY_LOSS = (
    "lambda out, y: F.binary_cross_entropy_with_logits(out, y.float().view_as(out), "
    "reduction='none').flatten(1).mean(1)"
)


def check_class_outputs(loss_fn: Callable[..., Any], outputs: Any, source: str) -> None:
    """Refuse cross-entropy over ``outputs`` of one class (shape ``(m, 1, ...)``: a binary
    classifier of one logit): its loss is 0 for every example, whatever the model predicts.

    NOTE: nothing else refused it: the losses have the right shape, so a selection pass ranked
    ties, SB "keeping a third" kept every candidate (a Traditional run paying for selection
    passes, unsaid), and a user training with BCE was never told that the default ``loss_fn``
    is cross-entropy (found by review). A shape check: no values are read.

    Raises:
        ValueError: ``loss_fn`` is an ``nn.CrossEntropyLoss`` and ``outputs`` have one class.

    Example:
        >>> ce = nn.CrossEntropyLoss(reduction="none")
        >>> check_class_outputs(ce, torch.zeros(4, 2), "the model")  # two classes: fine
        >>> check_class_outputs(ce, torch.zeros(4, 1), "the model")
        Traceback (most recent call last):
            ...
        ValueError: loss_fn is nn.CrossEntropyLoss (the default one unless you passed it), ...
    """
    if not isinstance(loss_fn, nn.CrossEntropyLoss) or not isinstance(outputs, torch.Tensor):
        return
    if outputs.dim() < 2 or outputs.shape[1] != 1:
        return
    raise ValueError(
        "loss_fn is nn.CrossEntropyLoss (the default one unless you passed it), but "
        f"{source} returned outputs of shape {tuple(outputs.shape)}: one class, whose "
        "cross-entropy is 0 for every example whatever the model predicts, so the selection "
        "would rank only ties; for a binary classifier of one logit pass the loss you train "
        f"with, per example, e.g. loss_fn={_BINARY_LOSS} (or give the model two outputs)"
    )


def check_class_targets(loss_fn: Callable[..., Any], targets: Any) -> None:
    """Refuse floating ``targets`` of two or more dimensions for an ``nn.CrossEntropyLoss``
    (which takes them as class probabilities) whose rows do not sum to 1: multi-hot labels of a
    multi-label task, or scores that are not probabilities.

    NOTE: cross-entropy against a multi-hot row is not the multi-label loss trained (BCE): a
    row with no positive label scores 0 whatever the model predicts, so such examples were
    never selected, and the rest ranked by a loss unrelated to training, unsaid (found by
    review). Soft labels (label smoothing, mixup) sum to 1 and pass. Read once, on the first
    source batch (one copy of a row sum from the device).

    Raises:
        ValueError: where such a row is found.

    Example:
        >>> ce = nn.CrossEntropyLoss(reduction="none")
        >>> check_class_targets(ce, torch.tensor([[0.9, 0.1], [0.5, 0.5]]))  # probabilities
        >>> check_class_targets(ce, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
        Traceback (most recent call last):
            ...
        ValueError: loss_fn is nn.CrossEntropyLoss (the default one unless you passed it), ...
    """
    if not isinstance(loss_fn, nn.CrossEntropyLoss) or not isinstance(targets, torch.Tensor):
        return
    if not targets.is_floating_point() or targets.dim() < 2 or targets.shape[0] == 0:
        return
    if targets.shape[1] == 1:  # (one class: refused by check_class_outputs, as binary)
        return
    sums = targets.detach().float().sum(dim=1).flatten().cpu()  # (the one copy to the host)
    worst = int((sums - 1).abs().argmax())
    if abs(float(sums[worst]) - 1) <= 1e-2:
        return
    raise ValueError(
        "loss_fn is nn.CrossEntropyLoss (the default one unless you passed it), which takes "
        f"floating targets as class probabilities, but the targets (shape "
        f"{tuple(targets.shape)}) have rows that do not sum to 1 (one sums to "
        f"{float(sums[worst]):.4g}): multi-hot labels, whose cross-entropy is not a "
        "multi-label loss (a row without a positive label scores 0 whatever the model "
        "predicts); pass the loss you train with, per example, e.g. "
        "loss_fn=lambda out, y: F.binary_cross_entropy_with_logits(out, y, "
        "reduction='none').mean(1), or, where that field is not the loss target (a mask), "
        "target_key= the target's field"
    )


class FieldsForward:
    """``model(*fields)``: several batch fields as the model's positional inputs (what a tuple
    ``input_key`` means).

    Example:
        >>> fwd = FieldsForward(("x", "scale"))
        >>> fwd(lambda x, s: x * s, {"x": torch.ones(2), "scale": torch.full((2,), 3.0), "y": 0})
        tensor([3., 3.])
    """

    def __init__(self, keys: Sequence[Hashable]) -> None:
        self.keys = tuple(keys)

    def __call__(self, model: Callable[..., Any], batch: Any) -> Any:
        return model(*(batch[k] for k in self.keys))

    def check(self, batch: Any) -> None:
        """Refuse keys that name no field of the source's batches (on the first batch)."""
        fields = list(batch.keys()) if isinstance(batch, Mapping) else list(range(len(batch)))
        for k in self.keys:
            if isinstance(batch, Mapping):
                ok = k in batch
            else:
                ok = (
                    isinstance(k, int) and not isinstance(k, bool) and -len(batch) <= k < len(batch)
                )
            if not ok:
                raise FieldError(
                    f"input_key={self.keys!r} names {k!r}, which is no field of the source's "
                    f"batches ({fields!r}); pass input_key= a tuple of its fields, or forward= "
                    "to call the model on the batch yourself"
                )

    def __repr__(self) -> str:
        return f"input_key={self.keys!r}"


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _forward_params(module: nn.Module) -> list[inspect.Parameter] | None:
    """The parameters of ``module.forward``, or None where its signature is unknown."""
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def unbound_inputs(module: nn.Module, given: int) -> str | None:
    """Why ``module`` called with ``given`` positional inputs cannot bind them to its
    ``forward``'s signature (e.g. ``"Two.forward(x, mask) takes 2 positional inputs"``), or
    None where they bind, where its signature is unknown, or where forward pre-hooks (its own or
    global ones) or a ``__call__`` of the module's own may supply inputs.

    Example:
        >>> class Two(nn.Module):
        ...     def forward(self, x, mask, scale=1.0):
        ...         return x * mask * scale
        >>> unbound_inputs(Two(), 1)
        'Two.forward(x, mask, scale=1.0) takes 2 to 3 positional inputs'
        >>> unbound_inputs(Two(), 2) is None, unbound_inputs(nn.Linear(2, 2), 1) is None
        (True, True)
    """
    # (inputs a hook supplies, or a __call__ of the module's own, bind where forward's do not)
    global_hooks = getattr(torch.nn.modules.module, "_global_forward_pre_hooks", None)
    if module._forward_pre_hooks or global_hooks or type(module).__call__ is not nn.Module.__call__:
        return None
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*([None] * given))
        return None
    except TypeError:
        pass
    params = signature.parameters.values()
    positional = [p for p in params if p.kind in _POSITIONAL]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    most = "" if variadic else str(len(positional))
    takes = (
        f"{required} positional input{'s' if required != 1 else ''}"
        if most == str(required)
        else f"{required} to {most} positional inputs"
        if most
        else f"at least {required} positional inputs"
    )
    if required <= given and (variadic or given <= len(positional)):
        takes = "required keyword-only inputs"  # (the positional ones bind: a keyword is missing)
    bare = signature.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in params],
        return_annotation=inspect.Signature.empty,
    )
    return f"{type(module).__name__}.forward{bare} takes {takes}"


def _inputs_example(batch: Any, module: nn.Module) -> str:
    """An ``input_key=`` / ``target_key=`` that would call ``module`` on the first fields of a
    tuple ``batch`` (its last field the target), or naming the dict ``batch``'s keys that are
    its forward's parameter names; ``""`` where neither fits."""
    params = _forward_params(module)
    if params is None:
        return ""
    names = [
        p.name for p in params if p.kind in _POSITIONAL and p.default is inspect.Parameter.empty
    ]
    if isinstance(batch, Mapping):
        if names and all(name in batch for name in names):
            return f" (e.g. input_key={tuple(names)!r})"
        return f" (the source's batches have the fields {list(batch.keys())!r})"
    if isinstance(batch, (tuple, list)) and 1 < len(names) < len(batch):
        return (
            f" (e.g. input_key={tuple(range(len(names)))!r}, target_key={len(batch) - 1} for "
            f"batches of {len(batch)} fields whose last is the target)"
        )
    return ""


def input_fields(
    input_key: Hashable | Sequence[Hashable] | None, forward: Forward | None
) -> tuple[Hashable | None, Forward | None]:
    """The single input field the batch format tracks (its length counts the examples) and the
    selection hook, from ``input_key`` and ``forward``: a tuple (or list) ``input_key`` becomes
    a :class:`FieldsForward` over its fields, the first of them tracked.

    Example:
        >>> input_fields(("input_ids", "attention_mask"), None)
        ('input_ids', input_key=('input_ids', 'attention_mask'))
    """
    check_forward(forward)
    if not isinstance(input_key, (tuple, list)):
        return input_key, forward
    if not input_key:
        raise ValueError(
            "input_key should name at least one field, but got an empty "
            f"{type(input_key).__name__}; pass input_key= a field, or a tuple of the fields that "
            "are the model's positional inputs"
        )
    if forward is not None:
        raise ValueError(
            f"input_key={tuple(input_key)!r} and forward= cannot be combined: a tuple input_key "
            "calls model(*fields) itself; pass forward= with a single input_key (the field whose "
            "length counts the examples), or drop forward="
        )
    return input_key[0], FieldsForward(input_key)


def check_forward(forward: Any) -> None:
    """Refuse a ``forward=`` that is neither None nor a callable ``forward(model, batch)``.

    Example:
        >>> check_forward(None)
        >>> check_forward(lambda model, batch: model(batch["x"]))
        >>> check_forward("input_ids")
        Traceback (most recent call last):
            ...
        TypeError: forward should be a callable forward(model, batch) returning the model's
        outputs, e.g. forward=lambda model, batch: model(batch['input_ids'],
        attention_mask=batch['attention_mask']), but got str
    """
    if forward is not None and not callable(forward):
        raise TypeError(
            "forward should be a callable forward(model, batch) returning the model's outputs, "
            f"e.g. forward=lambda model, batch: model(batch['input_ids'], "
            f"attention_mask=batch['attention_mask']), but got {type(forward).__name__}"
        )


def check_output(output: Any) -> Output:
    """``output=`` as given (a numpy integer position as an int), or refused where it is none of
    :data:`Output`'s kinds: None, a key or attribute name, a position (an int, not a bool) or a
    callable.

    Example:
        >>> [check_output(output) for output in (None, "logits", np.int64(0))]
        [None, 'logits', 0]
        >>> check_output(True)
        Traceback (most recent call last):
            ...
        TypeError: output should be None (a Tensor as is, else its 'logits'), a key or attribute
        name such as output='logits', a position such as output=0, or a callable, but got
        output=True
    """
    if output is None or callable(output) or isinstance(output, str):
        return output
    if isinstance(output, numbers.Integral) and not isinstance(output, bool):
        return int(output)
    raise TypeError(
        "output should be None (a Tensor as is, else its 'logits'), a key or attribute name such "
        "as output='logits', a position such as output=0, or a callable, but got "
        f"output={output!r}"
    )


def describe(out: Any) -> str:
    """A model output in a few words, for error messages."""
    if isinstance(out, torch.Tensor):
        return f"a Tensor of shape {tuple(out.shape)}"
    if isinstance(out, Mapping):
        return f"a {type(out).__name__} with keys {list(out.keys())!r}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}"
    fields = getattr(out, "__dataclass_fields__", None)
    if fields:
        return f"a {type(out).__name__} with fields {list(fields)!r}"
    return f"a {type(out).__name__}"


def model_output(out: Any, output: Output = None) -> Any:
    """The part of a model's outputs that ``loss_fn`` (and ``keep_logits``) take.

    ``output=None`` (the default): a Tensor as is; a dict (or Hugging Face ``ModelOutput``)
    holding ``"logits"``: that entry; an object (e.g. a dataclass) with a Tensor attribute
    ``logits``: that attribute; anything else as is (``loss_fn`` then takes it whole). A string
    names a key (dicts) or an attribute, an int a position (tuples and lists), a callable is
    applied. A name or position that the outputs lack is refused (``ValueError``) with the keys
    they have.

    Example:
        >>> model_output({"logits": torch.zeros(2, 3), "hidden": None}).shape
        torch.Size([2, 3])
        >>> model_output((torch.zeros(2, 3), torch.ones(2)), 1)
        tensor([1., 1.])
    """
    if output is None:
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, Mapping):
            return out["logits"] if "logits" in out else out
        logits = getattr(out, "logits", None)
        return logits if isinstance(logits, torch.Tensor) else out
    if isinstance(output, str):
        if isinstance(out, Mapping):
            if output in out:
                return out[output]
        elif getattr(out, output, None) is not None:
            return getattr(out, output)
        raise ValueError(
            f"output={output!r} names no key or attribute of the model's outputs, which are "
            f"{describe(out)}; pass output= one of them (or a callable that picks the per-example "
            "outputs)"
        )
    if isinstance(output, int):
        if isinstance(out, (tuple, list)) and -len(out) <= output < len(out):
            return out[output]
        raise ValueError(
            f"output={output!r} names no position of the model's outputs, which are "
            f"{describe(out)}; pass output= a position of a tuple output, a key or attribute name, "
            "or a callable"
        )
    return output(out)


def unused_fields(
    batch: Any, used: Sequence[Any], ignore: Sequence[Hashable] = ()
) -> list[Hashable]:
    """The fields of a dict batch that are tensors (or nested dicts) other than the columns
    ``used`` (compared by identity) and the keys ``ignore``: inputs the model may need but that
    ``model(batch[input_key])`` does not pass it.

    Example:
        >>> ids, mask, y = torch.zeros(2, 4), torch.ones(2, 4), torch.zeros(2)
        >>> batch = {"ids": ids, "mask": mask, "y": y, "name": ["a", "b"], "meta": {"id": ["a"]}}
        >>> unused_fields(batch, [ids, y])
        ['mask']
    """
    if not isinstance(batch, Mapping):
        return []
    return [
        k
        for k, v in batch.items()
        if tensor_field(v) and not any(v is u for u in used) and k not in ignore
    ]


def tensor_field(value: Any) -> bool:
    """Whether a batch field is a tensor or a dict holding one (nested dicts included): a field
    a model may take, unlike a dict of names or a list of strings.

    Example:
        >>> tensor_field(torch.ones(2)), tensor_field({"mask": {"m": torch.ones(2)}})
        (True, True)
        >>> tensor_field({"names": ["a", "b"]}), tensor_field(["a", "b"])
        (False, False)
    """
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, Mapping) and _first_tensor(value) is not None


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(items, (list, tuple)) or isinstance(value, Mapping):
        for v in items:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


def restrict(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every field of a batch structure (a dict, tuple or list of
    columns; nested dicts entry by entry).

    Example:
        >>> restrict({"x": torch.arange(5), "meta": {"n": list("abcde")}}, 1, 3)
        {'x': tensor([1, 2]), 'meta': {'n': ['b', 'c']}}
    """
    if isinstance(batch, Mapping):
        return B.like(batch, {k: B.rows(v, start, stop) for k, v in batch.items()})
    return B.like(batch, [B.rows(v, start, stop) for v in batch])


def selection_outputs(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    batch_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    eval: bool = True,
    keep_outputs: bool = False,
    forward: Forward | None = None,
    batch: Any = None,
    output: Output = None,
    inference: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-example losses of ``model`` on the candidates, without autograd, and the model's
    outputs (logits) when ``keep_outputs`` (else ``None``).

    Runs under ``torch.inference_mode()`` (``torch.no_grad()`` when not ``inference``) in chunks of
    ``batch_size`` examples (all at once when None), in eval mode unless ``eval=False``, optionally
    under autocast. Each chunk's losses are ``loss_fn(model_output(model(x), output), y)``, or with
    ``forward`` ``loss_fn(model_output(forward(model, chunk), output), y)``, where ``chunk`` is
    ``batch`` (the source batch's structure: a dict, tuple or list of fields, nested dicts included)
    restricted to the chunk's rows (see :func:`model_output` for ``output``). With ``output=None`` a
    ``loss_fn`` that is not a torch loss module takes the model's outputs whole (a dict, a tuple,
    ...), as it did before ``output=`` existed; the kept outputs are ``model_output(...)`` either
    way.

    NOTE (FSDP): an FSDP model's forward under ``inference_mode`` leaves inference tensors in
    its gathered parameters, and its next training forward then fails; ``inference=False``
    (``no_grad``) is for it.

    NOTE (eval-mode selection): a train-mode forward updates BatchNorm running statistics even
    without gradients and applies dropout noise to the losses; eval mode does neither, and a
    selection chunk of one example cannot crash BatchNorm. With ``eval=False``, a chunk of one
    example that a BatchNorm refuses in train mode (one value per channel) is scored in eval
    mode instead, with a ``UserWarning`` naming the fixes (see :func:`_one_in_eval_mode`).

    Returns:
        float32 losses on the model's output device, as an ordinary tensor (not an inference
        tensor), so that they can be used in autograd expressions such as ``loss * weights``;
        and the outputs as float32 (one row per candidate), or ``None``.

    Example:
        >>> losses, logits = selection_outputs(
        ...     nn.Linear(3, 2), torch.zeros(4, 3), torch.zeros(4, dtype=torch.long),
        ...     nn.CrossEntropyLoss(reduction="none"), keep_outputs=True)
        >>> losses.shape, logits.shape
        (torch.Size([4]), torch.Size([4, 2]))
        >>> batch = {"x": torch.zeros(4, 3), "scale": torch.ones(4, 1), "y": torch.zeros(4).long()}
        >>> losses, _ = selection_outputs(
        ...     nn.Linear(3, 2), batch["x"], batch["y"], nn.CrossEntropyLoss(reduction="none"),
        ...     forward=lambda model, b: {"logits": model(b["x"]) * b["scale"]}, batch=batch,
        ...     batch_size=3)
        >>> losses.shape
        torch.Size([4])
    """
    if forward is not None and batch is None:
        raise ValueError("selection_outputs with forward= needs batch= (the source batch)")
    n = B.column_length(inputs, "input")
    if n == 0:
        raise ValueError(
            "selection_outputs needs at least one example to score, but the inputs have 0 rows; "
            "skip empty batches before the selection pass"
        )
    step = n if not batch_size else batch_size
    chunks = []
    outputs = []
    first = _first_tensor(inputs)
    if first is None and batch is not None:
        first = _first_tensor(batch)
    device_type = first.device.type if first is not None else "cpu"
    autocast = selection_autocast(device_type, autocast_dtype)
    custom = forward is not None and not isinstance(forward, FieldsForward)
    source = f"output={output!r}" if output is not None else "forward=" if custom else "the model"
    grad_free = torch.inference_mode() if inference else torch.no_grad()
    with eval_mode(model, eval), grad_free, autocast:
        for start in range(0, n, step):
            stop = min(start + step, n)
            m = stop - start
            y = B.rows(targets, start, stop)
            counts = _batchnorm_counts(model) if m == 1 and not eval else None

            def chunk_forward(start: int = start, stop: int = stop) -> Any:
                if forward is None:
                    return model(B.rows(inputs, start, stop))
                return forward(model, restrict(batch, start, stop))

            try:
                raw = chunk_forward()
            except ValueError as e:
                if counts is None or _ONE_VALUE_PER_CHANNEL not in str(e):
                    raise
                raw = _one_in_eval_mode(model, counts, e, chunk_forward)
            logits = model_output(raw, output)
            # NOTE: by default a loss_fn of the user's own takes non-tensor outputs whole, as it
            # did before output= existed; a torch loss module takes tensors only.
            whole = output is None and not isinstance(loss_fn, nn.modules.loss._Loss)
            loss_input = raw if whole else logits
            if isinstance(loss_input, torch.Tensor) and loss_input.dim() == 0:
                raise ValueError(
                    f"{source} returned a 0-d tensor (one value for a chunk of {m} examples, e.g. "
                    "a loss already reduced over the batch), but the selection pass needs the "
                    "model's outputs, one row per example, for loss_fn(outputs, targets); "
                    + _scalar_fix(output, custom)
                )
            check_class_outputs(loss_fn, loss_input, source)
            try:
                out = loss_fn(loss_input, y)
            except (RuntimeError, ValueError) as e:
                if not _per_token(loss_input, y):
                    raise
                # NOTE: torch's own error ("Expected target size [8, 10], got [8, 5]") says
                # nothing of the selection pass nor of the outputs being per token.
                raise ValueError(
                    f"loss_fn(outputs, targets) raised {type(e).__name__} ({_first_line(e)}) on "
                    f"the outputs of {source}, of shape {tuple(loss_input.shape)}, and targets of "
                    f"shape {tuple(y.shape)}: outputs per token (or per position), which a loss "
                    "of one value per example (such as the default "
                    "nn.CrossEntropyLoss(reduction='none')) does not take as they are; pass a "
                    "loss_fn that returns one loss per example, e.g. for token losses with "
                    f"ignore_index=-100: {_TOKEN_LOSS}"
                    + (
                        # (a loss_fn of the user's own takes non-tensor outputs whole)
                        f", with output='logits' (the model returns {describe(raw)})"
                        if output is None and raw is not loss_input
                        else ""
                    )
                ) from e
            except (TypeError, AttributeError) as e:
                if isinstance(loss_input, torch.Tensor):
                    raise
                raise TypeError(
                    f"loss_fn(outputs, targets) raised {type(e).__name__} ({e}) on the outputs "
                    f"of {source}, {describe(loss_input)}; pass output= naming the per-example "
                    "outputs in them (a key or attribute such as output='logits', a position such "
                    "as output=0, or a callable)"
                ) from e
            if not isinstance(out, torch.Tensor) or out.shape != (m,):
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                if isinstance(out, torch.Tensor) and out.dim() > 1 and out.shape[0] == m:
                    # Already unreduced, but per token or per output: reducing over the
                    # batch is not the fix, reducing over the other dimensions is.
                    raise ValueError(
                        f"loss_fn should return one loss per example (shape ({m},)), but "
                        f"returned {shape}, with dimensions besides the examples'; reduce it "
                        "over every dimension but the first, e.g. for token losses with "
                        f"ignore_index=-100: {_TOKEN_LOSS}; for (batch, 1) regression outputs: "
                        "lambda out, y: F.mse_loss(out, y, reduction='none').flatten(1).mean(1)"
                    )
                if isinstance(out, torch.Tensor) and out.numel() == m and out.dim() > 1:
                    # One loss per example, laid out otherwise (e.g. (1, m)): reduction is not
                    # the fix, the layout is.
                    raise ValueError(
                        f"loss_fn should return one loss per example (shape ({m},)), but "
                        f"returned {shape}: as many losses, laid out otherwise; return them "
                        "as a 1-d tensor, e.g. loss_fn=lambda out, y: my_loss(out, y).reshape(-1)"
                    )
                if (
                    isinstance(out, torch.Tensor)
                    and out.dim() == 1
                    and out.numel() > m
                    and out.numel() % m == 0
                ):
                    # Unreduced already, but several values per example flattened together
                    # (per-token losses of (B * T, C) logits): reduction='none' is given.
                    raise ValueError(
                        f"loss_fn should return one loss per example (shape ({m},)), but "
                        f"returned {shape}: {out.numel() // m} values per example, flattened "
                        "(e.g. per-token losses); reduce them per example, e.g. loss_fn=lambda "
                        "out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), "
                        f"reduction='none').view({m}, -1).mean(1)"
                    )
                raise ValueError(
                    f"loss_fn should return one loss per example (shape ({m},)), but "
                    f"returned {shape}; pass reduction='none', e.g. "
                    "nn.CrossEntropyLoss(reduction='none')"
                )
            chunks.append(out.float())
            if keep_outputs:
                if not isinstance(logits, torch.Tensor) or logits.shape[:1] != (m,):
                    raise ValueError(
                        "keep_outputs (SelectiveLoader's keep_logits=True) keeps one output row "
                        f"per example ({m} here), but {source} returned {describe(logits)}; pass "
                        "output= naming the per-example logits in the model's outputs (a key or "
                        "attribute such as output='logits', a position such as output=0, or a "
                        "callable), or pass keep_logits=False"
                    )
                outputs.append(logits.float())
        losses = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        kept = None
        if keep_outputs:
            kept = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    # Cloning outside inference mode turns the inference tensor into an ordinary one.
    return losses.clone(), None if kept is None else kept.clone()


#: A loss_fn of one loss per example for outputs per token, for error messages.
_TOKEN_LOSS = (
    "loss_fn=lambda out, y: F.cross_entropy(out.transpose(1, 2), y, reduction='none').sum(1) / "
    "(y != -100).sum(1).clamp(min=1)"
)


def _per_token(outputs: Any, targets: Any) -> bool:
    """Whether ``outputs`` and ``targets`` look like outputs per token and their targets: tensors
    that agree in their first two sizes (examples, tokens), the outputs with one more dimension.

    Example:
        >>> _per_token(torch.zeros(8, 5, 10), torch.zeros(8, 5)), _per_token(torch.zeros(8, 3), 0)
        (True, False)
    """
    return (
        isinstance(outputs, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and outputs.dim() >= 3
        and targets.dim() >= 2
        and outputs.shape[:2] == targets.shape[:2]
    )


def _scalar_fix(output: Output, custom: bool) -> str:
    if output is not None:
        return "pass output= naming the per-example outputs (e.g. output='logits'), not a loss"
    if custom:
        return (
            "make forward= return the model's outputs (e.g. return model(...), not a loss "
            "computed from them), or pass output= to pick them from what it returns"
        )
    return "have the model return its per-example outputs, or pass output= to pick them"


def has_lazy(module: nn.Module) -> bool:
    """Whether ``module`` holds lazy parameters or buffers still to be made (``nn.LazyLinear``
    before its first forward).

    NOTE (why it matters): made by a forward under ``torch.inference_mode()`` they would be
    inference tensors, which report ``requires_grad=True`` but never get a gradient: a
    selection pass over such a module runs under ``torch.no_grad()`` instead (see
    :class:`~sbloader.scoring.Scorer`).

    Example:
        >>> has_lazy(nn.Linear(2, 2)), has_lazy(nn.Sequential(nn.LazyLinear(2)))
        (False, True)
    """
    return any(nn.parameter.is_lazy(t) for t in (*module.parameters(), *module.buffers()))


def downsample(inputs: torch.Tensor, scale: float) -> torch.Tensor:
    """Bilinearly resize a 4-d image batch by ``scale`` (Composer's ``scale_factor``).

    Example:
        >>> downsample(torch.zeros(2, 3, 32, 32), 0.5).shape
        torch.Size([2, 3, 16, 16])
    """
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
        shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise ValueError(
            f"selection_scale={scale:g} resizes 4-d image batches (N, C, H, W), but the input "
            f"field has shape {shape}; pass selection_scale=None"
        )
    if not inputs.is_floating_point():
        raise TypeError(
            f"selection_scale={scale:g} resizes floating-point images, but the inputs have dtype "
            f"{inputs.dtype}; convert them to float in the source, or pass selection_scale=None"
        )
    if scale == 1.0:
        return inputs
    h, w = (math.floor(d * scale) for d in inputs.shape[2:])
    if h < 1 or w < 1:
        # (the smallest scale that leaves a pixel, rounded up to 3 decimals: one accepted)
        least = math.ceil(1000 / min(inputs.shape[2:])) / 1000
        raise ValueError(
            f"selection_scale={scale:g} resizes the inputs' height and width "
            f"{tuple(inputs.shape[2:])} to ({h}, {w}), with no pixels left; pass a "
            f"selection_scale of at least {least:g}, or selection_scale=None"
        )
    return F.interpolate(inputs, scale_factor=scale, mode="bilinear", align_corners=False)


def prefix_features(
    prefix: nn.Module,
    inputs: torch.Tensor,
    *,
    batch_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
    as_float: bool = True,
) -> torch.Tensor:
    """The outputs of a frozen ``prefix`` on ``inputs``, in eval mode, without autograd.

    Runs under ``torch.no_grad()`` (not inference mode) so that the outputs are ordinary tensors
    that a trainable head can take as inputs in autograd. Under ``autocast_dtype``, outputs of
    that dtype are returned as float32, ready for a float32 head (unless not ``as_float``: as
    the prefix returned them, e.g. for a cache that keeps them in their own dtype).

    Example:
        >>> prefix_features(nn.Linear(4, 2), torch.zeros(5, 4), batch_size=2).shape
        torch.Size([5, 2])
    """
    n = inputs.shape[0]
    step = n if not batch_size else batch_size
    with eval_mode(prefix), torch.no_grad(), selection_autocast(inputs.device.type, autocast_dtype):
        chunks = [prefix(inputs[start : start + step]) for start in range(0, n, step)]
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return features_as_float(out, autocast_dtype) if as_float else out


def features_as_float(features: torch.Tensor, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """A frozen prefix's outputs as the head takes them: float32 where they came in the
    selection passes' ``autocast_dtype``, else as they are.

    Example:
        >>> features_as_float(torch.ones(2, dtype=torch.bfloat16), torch.bfloat16).dtype
        torch.float32
        >>> features_as_float(torch.ones(2, dtype=torch.float64), None).dtype
        torch.float64
    """
    if autocast_dtype is not None and features.dtype == autocast_dtype:
        return features.float()
    return features


class SelectionForward:
    """How the selection pass calls the model: compiled or not, at what input scale, and through
    a frozen prefix whose outputs are cached for training.

    Args:
        compile: ``True`` to run the selection forward through ``torch.compile`` of the
            (unwrapped) selection model, compiled once, on first use; or a dict of
            ``torch.compile`` keyword arguments (e.g. ``{"mode": "max-autotune"}``).
        scale: resize 4-d inputs by this factor in (0, 1] before the selection forward only.
        frozen_prefix: a module with no trainable parameters whose outputs are the model's
            inputs: the selection pass computes them once and keeps them for training.
        forward: ``forward(model, batch)`` calls the model on a chunk of candidates (``batch``:
            the source batch's structure restricted to the chunk's rows), instead of
            ``model(inputs)``; a :class:`FieldsForward` for a tuple ``input_key``. Not with
            ``scale`` or ``frozen_prefix``.
        output: which part of the model's outputs ``loss_fn`` and ``keep_outputs`` take (see
            :func:`model_output`).
        convert: ``convert(value)``, applied to what the model and ``loss_fn`` take (the
            inputs, after any prefix or scale, the targets and ``batch``) before each forward,
            e.g. a Lightning precision plugin's ``convert_input``; the caller's values are not
            changed.

    Example:
        >>> fwd = SelectionForward(scale=0.5)
        >>> losses, features, logits = fwd(
        ...     nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)),
        ...     torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long),
        ...     nn.CrossEntropyLoss(reduction="none"))
        >>> losses.shape, features, logits
        (torch.Size([4]), None, None)
    """

    def __init__(
        self,
        *,
        compile: bool | Mapping[str, Any] = False,
        scale: float | None = None,
        frozen_prefix: nn.Module | None = None,
        forward: Forward | None = None,
        output: Output = None,
        convert: Callable[[Any], Any] | None = None,
    ) -> None:
        check_forward(forward)
        output = check_output(output)
        if convert is not None and not callable(convert):
            raise TypeError(
                "convert_inputs should be a callable convert_inputs(value) or None, but got "
                f"convert_inputs={convert!r}"
            )
        self.call, self.output, self.convert = forward, output, convert
        if forward is not None:
            name = repr(forward) if isinstance(forward, FieldsForward) else "forward="
            if frozen_prefix is not None:
                raise ValueError(
                    f"{name} and frozen_prefix cannot be combined: with a frozen prefix the "
                    "model (the head) takes the prefix's outputs, computed from the input field "
                    "alone; pass frozen_prefix=None and call the whole model in forward=, or "
                    "drop forward="
                )
            if scale is not None:
                raise ValueError(
                    f"{name} and selection_scale cannot be combined: selection_scale resizes the "
                    "input field before model(inputs); pass selection_scale=None and resize in "
                    "forward= (e.g. F.interpolate(batch['image'], scale_factor=0.5))"
                )
        if isinstance(compile, Mapping):
            self.compile_kwargs: dict[str, Any] | None = check_compile_kwargs(dict(compile))
        elif isinstance(compile, (bool, np.bool_)):
            self.compile_kwargs = {} if compile else None
        else:
            raise TypeError(
                "compile_selection should be a bool or a dict of torch.compile arguments, but got "
                f"compile_selection={compile!r}"
            )
        self.scale = (
            None
            if scale is None
            else check_float("selection_scale", scale, low=0.0, high=1.0, low_open=True)
        )
        if frozen_prefix is not None and not isinstance(frozen_prefix, nn.Module):
            raise TypeError(
                "frozen_prefix should be a torch.nn.Module or None, but got "
                f"{type(frozen_prefix).__name__}"
            )
        if frozen_prefix is not None and self.scale is not None:
            raise ValueError(
                "selection_scale and frozen_prefix cannot be combined: the cached prefix outputs "
                "are training inputs and must come from full-resolution inputs; pass "
                "selection_scale=None"
            )
        self.frozen_prefix = None if frozen_prefix is None else unwrap(frozen_prefix)
        # NOTE: keyed by id() with the module kept alongside, so a recycled id cannot match.
        self._compiled: dict[int, tuple[nn.Module, nn.Module]] = {}
        # Whether a selection forward at ``scale`` has succeeded (see blame_scale).
        self._scale_taken = False

    @property
    def compiled_modules(self) -> list[nn.Module]:
        """The compiled selection modules made so far (one per module selected with)."""
        return [entry[1] for entry in self._compiled.values()]

    def module(self, module: nn.Module) -> nn.Module:
        """``module``, or its compiled version (compiled once, on first use) when compiling."""
        if self.compile_kwargs is None:
            return module
        entry = self._compiled.get(id(module))
        if entry is None or entry[0] is not module:
            # NOTE: torch.compile of a module returns an OptimizedModule, an nn.Module.
            compiled = cast(nn.Module, torch.compile(module, **self.compile_kwargs))
            self._compiled[id(module)] = entry = (module, compiled)
        return entry[1]

    def check(self, model: nn.Module, selector: nn.Module | None = None) -> None:
        """Refuse a frozen prefix that trains, or that the model or a selector contains.

        Called when the loader is built and again when each epoch starts.
        """
        prefix = self.frozen_prefix
        if prefix is None:
            return
        if selector is not None:
            raise ValueError(
                "selector and frozen_prefix cannot be combined: with a frozen prefix the "
                "selection pass scores the model on the cached prefix outputs; pass selector=None"
            )
        trainable = [name for name, p in prefix.named_parameters() if p.requires_grad]
        if trainable:
            shown = ", ".join(trainable[:3]) + (", ..." if len(trainable) > 3 else "")
            raise ValueError(
                f"frozen_prefix has {len(trainable)} parameters with requires_grad=True ({shown}); "
                "its outputs are computed once in the selection pass and reused for training, so "
                "it must not train: call frozen_prefix.requires_grad_(False) and keep its "
                "parameters out of the optimizer, or pass frozen_prefix=None"
            )
        prefix_params = {id(p) for p in prefix.parameters()}
        if prefix_params and any(id(p) in prefix_params for p in unwrap(model).parameters()):
            raise ValueError(
                "model should be the part that runs on frozen_prefix's outputs (the head), but it "
                "contains frozen_prefix's parameters; pass model=head and frozen_prefix=backbone, "
                "and train with head(batch.features)"
            )

    def features(
        self,
        inputs: torch.Tensor,
        batch_size: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        as_float: bool = True,
    ) -> torch.Tensor:
        """The frozen prefix's outputs on ``inputs`` (compiled when compiling; see
        :func:`prefix_features` for ``as_float``)."""
        assert self.frozen_prefix is not None
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(
                "frozen_prefix takes the input field as one tensor, but it is a "
                f"{type(inputs).__name__}; pass input_key= a tensor field, or frozen_prefix=None"
            )
        prefix = self.module(self.frozen_prefix)
        return prefix_features(
            prefix, inputs, batch_size=batch_size, autocast_dtype=autocast_dtype, as_float=as_float
        )

    def __call__(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[..., torch.Tensor],
        *,
        batch_size: int | None = None,
        autocast_dtype: torch.dtype | None = None,
        eval: bool = True,
        features: torch.Tensor | None = None,
        keep_outputs: bool = False,
        batch: Any = None,
        inference: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Per-example losses of ``model`` on the candidates, the frozen prefix's outputs
        (``None`` without a frozen prefix; ``features``, when given, are those outputs already
        computed, e.g. from a cache, and the prefix does not run), and the model's outputs when
        ``keep_outputs`` (else ``None``). ``batch`` is the source batch's structure (a dict,
        tuple or list of fields), which ``forward`` takes in chunks.

        NOTE: the prefix runs under ``autocast_dtype`` too, since it is most of a frozen-backbone
        model's selection cost; its outputs, which become the selected examples' training
        inputs, are then reduced-precision values returned as float32. Without autocast they
        are exactly what a float32 training forward of the prefix computes.
        """
        full = inputs
        if self.frozen_prefix is not None:
            if features is None:
                features = self.features(inputs, batch_size, autocast_dtype)
            inputs = features
        elif self.scale is not None:
            with torch.inference_mode() if inference else torch.no_grad():
                inputs = downsample(inputs, self.scale)
        if isinstance(self.call, FieldsForward):
            self.call.check(batch)
        options: dict[str, Any] = {"autocast_dtype": autocast_dtype, "keep_outputs": keep_outputs}
        try:
            losses, outputs = selection_outputs(
                self.module(model),
                self.converted(inputs),
                self.converted(targets),
                loss_fn,
                batch_size=batch_size,
                eval=eval,
                forward=self.call,
                # (only a forward= hook takes the batch: the model alone, its input field)
                batch=batch if self.call is None else self.converted(batch),
                output=self.output,
                inference=inference,
                **options,
            )
        except Exception as e:
            self.blame_inputs(model, batch, e)
            # (not for a collective forward, FSDP's: trials on one rank would wait for the rest)
            if inference:
                self.blame_scale(model, full, targets, loss_fn, e, inference=inference, **options)
            raise
        self._scale_taken = self.scale is not None
        return losses, features, outputs

    def converted(self, value: Any) -> Any:
        """``value`` as the model and ``loss_fn`` take it: through ``convert`` where given
        (None stays None)."""
        if self.convert is None or value is None:
            return value
        return self.convert(value)

    def blame_inputs(self, model: nn.Module, batch: Any, error: Exception) -> None:
        """Raise ``TypeError`` naming ``input_key`` and ``forward``, from ``error``, where the
        selection forward failed because the model takes other inputs than the pass gives it
        (``model(inputs)``, or ``model(*fields)`` of a tuple ``input_key``); return otherwise
        (the caller re-raises ``error``).

        NOTE: the model's own ``TypeError`` ("forward() missing 1 required positional argument:
        'mask'") says nothing of the selection pass nor of the loader's parameter that decides
        what it calls the model with. Only a ``TypeError`` whose inputs do not bind to the
        model's ``forward`` signature is explained: one raised inside a forward that took its
        inputs is left as it is.
        """
        call = self.call
        if not isinstance(error, TypeError) or self.frozen_prefix is not None:
            return
        if call is not None and not isinstance(call, FieldsForward):
            return
        given = 1 if call is None else len(call.keys)
        module = unwrap(model)
        why = unbound_inputs(module, given)
        if why is None:
            return
        called = (
            "model(inputs), the input_key field alone"
            if call is None
            else f"model(*fields) with the {given} fields of {call!r}"
        )
        raise TypeError(
            f"the selection pass calls {called}, but {why} and raised TypeError "
            f"({_first_line(error)}); pass input_key= a tuple of the batch fields that are the "
            "model's positional inputs, in order, and target_key= the loss target"
            + _inputs_example(batch, module)
            + ", or forward=lambda model, batch: model(...) to call the model on the batch "
            "yourself"
        ) from error

    def blame_scale(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[..., torch.Tensor],
        error: Exception,
        **options: Any,
    ) -> None:
        """Raise ``ValueError`` naming ``selection_scale``, from ``error``, where the first
        selection forward at it failed because of it: the model (with ``loss_fn``) takes the
        first candidates of ``inputs`` at full size but not downsampled. Return otherwise (the
        caller re-raises ``error``): without a scale, after a forward at it has succeeded, or
        for an error the scale does not cause (the same failure at full size, or one due to
        other candidates, e.g. a label out of range).

        NOTE: torch's own error (e.g. ``mat1 and mat2 shapes cannot be multiplied``, from a
        classifier sized for the full-size images) does not say that the inputs were resized.
        The two trials run in eval mode without gradients on two candidates at most, only after
        a failure, and change nothing (no BatchNorm statistics); ``options`` are
        :func:`selection_outputs`' (autocast, outputs kept, inference mode), as in the pass.
        """
        scale = self.scale
        if scale is None or self._scale_taken or not isinstance(inputs, torch.Tensor):
            return  # (inputs that are no tensor: downsample's own error names the scale)
        k = min(B.column_length(inputs, "input"), 2)
        first, labels = B.rows(inputs, 0, k), B.rows(targets, 0, k)
        if self._trial(model, first, labels, loss_fn, None, options) is not None:
            return
        failed = self._trial(model, first, labels, loss_fn, scale, options)
        if failed is None:
            return
        shape = tuple(first.shape[1:])
        small = tuple(downsample(first[:1], scale).shape[1:])
        raise ValueError(
            f"selection_scale should resize the inputs to a size the model takes, but got "
            f"selection_scale={scale:g}, which resizes inputs of shape {shape} to {small}: the "
            f"model takes them at full size, and downsampled raised {type(failed).__name__} "
            f"({_first_line(failed)}); pass a larger selection_scale, a model that takes any "
            "input size (e.g. global pooling before its classifier), or selection_scale=None"
        ) from error

    def _trial(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[..., torch.Tensor],
        scale: float | None,
        options: Mapping[str, Any],
    ) -> Exception | None:
        """What a selection forward of ``inputs`` resized by ``scale`` (None: as they are)
        raises, or None (a trial for :meth:`blame_scale`).

        NOTE: with the pass's ``output=`` (a model whose logits it takes from a dict would fail
        at full size too without it); a ``forward=`` hook takes the whole source batch, which
        the trial does not have: the model is called on the inputs alone (a failure at full size
        then leaves the error as it was)."""
        try:
            with torch.no_grad():
                x = inputs if scale is None else downsample(inputs, scale)
            selection_outputs(
                self.module(model),
                self.converted(x),
                self.converted(targets),
                loss_fn,
                eval=True,
                output=self.output,
                **options,
            )
        except Exception as e:
            return e
        return None


def _first_line(error: BaseException) -> str:
    """The first line of an error's message, at most 200 characters."""
    text = str(error)
    return text.splitlines()[0][:200] if text else ""


#: torch.compile's modes (``mode=``), as its documentation lists them.
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``compile_selection``'s ``torch.compile`` arguments, checked when the loader is built:
    names ``torch.compile`` takes, a known ``mode`` and a registered ``backend`` name (the
    compilation itself runs at the first selection pass, where torch's own error would not name
    ``compile_selection``).

    Example:
        >>> check_compile_kwargs({"mode": "reduce-overhead"})
        {'mode': 'reduce-overhead'}
        >>> check_compile_kwargs({"mdoe": "default"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: compile_selection={'mdoe': 'default'} names an argument ... ('mdoe'); ...
    """
    taken = sorted(set(inspect.signature(torch.compile).parameters) - {"model"})
    unknown = [k for k in kwargs if k not in taken]
    if unknown:
        raise ValueError(
            f"compile_selection={kwargs!r} names an argument torch.compile does not take "
            f"({', '.join(map(repr, unknown))}); it takes {', '.join(taken)}"
        )
    mode = kwargs.get("mode")
    if mode is not None and mode not in _COMPILE_MODES:
        raise ValueError(
            f"compile_selection's mode should be one of {', '.join(map(repr, _COMPILE_MODES))} "
            f"or None, but got mode={mode!r}"
        )
    if mode is not None and kwargs.get("options") is not None:
        raise ValueError(
            "compile_selection's mode and options cannot both be given (torch.compile takes "
            "one of them); pass mode= or options="
        )
    backend = kwargs.get("backend")
    if isinstance(backend, str):
        from torch._dynamo import list_backends

        known = list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"compile_selection's backend should be a registered torch.compile backend "
                f"such as 'inductor' or 'eager', but got backend={backend!r}; registered: "
                f"{', '.join(known)}"
            )
    return kwargs


def selection_autocast(
    device_type: str, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    """The precision region of a selection-side forward (the selection pass, a frozen prefix,
    an int8 copy's calibration): ``dtype``'s autocast, or with None float32, also inside a
    caller's ``torch.autocast`` region.

    NOTE: autocast is thread-local, so an overlapped pass (on the selection thread) never sees
    the caller's region; passes in the caller's thread must not either, or they would run in
    another precision than those, and a frozen prefix's features would reach a float32 head in
    bf16.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     with selection_autocast("cpu", None):
        ...         (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    if dtype is not None:
        return torch.autocast(device_type, dtype=dtype)
    if _autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _autocast_enabled(device_type: str) -> bool:
    """Whether the calling thread is in a ``torch.autocast`` region for ``device_type`` (False
    for a device type autocast does not know, e.g. ``"meta"``)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4: no device type argument
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled()
        return device_type == "cuda" and torch.is_autocast_enabled()
    except RuntimeError:
        return False


#: The start of torch's message for a train-mode BatchNorm given one value per channel.
_ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training"


def _batchnorm_counts(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each training BatchNorm's ``num_batches_tracked`` with a copy of its value, to be put
    back by :func:`_one_in_eval_mode` (torch counts the batch before refusing it)."""
    return [
        (m.num_batches_tracked, m.num_batches_tracked.clone())
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.training
        and isinstance(m.num_batches_tracked, torch.Tensor)
    ]


#: What leaves a selection forward one candidate, and how to avoid it.
_LONE_FIX = (
    "a source batch of one, such as a DataLoader's last, or the last chunk of "
    "selection_batch_size); pass drop_last=True to the DataLoader, a selection_batch_size that "
    "leaves no chunk of one, or eval_selection=True"
)


def _one_in_eval_mode(
    model: nn.Module,
    counts: list[tuple[torch.Tensor, torch.Tensor]],
    error: Exception,
    chunk_forward: Callable[[], Any],
) -> Any:
    """The model's output for the one candidate that a train-mode BatchNorm refused
    (``error``): ``chunk_forward()``, the pass's own forward of it, run again in eval mode (the
    BatchNorms' running statistics), with the BatchNorm counters put back as they were before
    the refused forward (torch counts the batch before refusing it) and a ``UserWarning`` naming
    the fixes.

    NOTE: scored, not refused: a pass of 41 examples in source batches of 20 (a DataLoader's
    last batch of one) was refused only when its first selective epoch ended, after a
    Random-Backprop warm-up, losing that epoch. Eval mode is the one way to score a single
    example through BatchNorm1d; the other candidates keep their train-mode scores (the rank of
    one loss in the window is all that differs). Only a forward torch refuses is re-run:
    BatchNorm2d normalises a single image over its pixels, and BatchNorm1d refuses one example
    only where it has one value per channel. An FSDP model's forward (a collective) is refused
    instead, naming the same fixes: a forward re-run on one rank would leave the others waiting
    in its parameter gathers.

    Raises:
        ValueError: for an FSDP model (torch's own error would not say where the example came
            from).
    """
    with torch.no_grad():
        for tracked, before in counts:
            tracked.copy_(before)
    if is_fsdp(model):
        raise ValueError(
            "eval_selection=False scores in train mode, where BatchNorm cannot normalise a "
            f"single example, but a selection forward got 1 candidate ({_LONE_FIX}"
        ) from error
    warnings.warn(
        "eval_selection=False scores in train mode, where BatchNorm cannot normalise a single "
        "example, but a selection forward got 1 candidate: it was scored in eval mode (with "
        f"the BatchNorms' running statistics) instead ({_LONE_FIX}, to score every candidate "
        "in train mode",
        UserWarning,
        stacklevel=2,
    )
    with eval_mode(model):
        return chunk_forward()


def concrete_device(device: torch.device) -> torch.device:
    """``device`` with its index filled in: ``cuda`` is the current CUDA device (so that
    ``cuda`` and ``cuda:0`` compare equal where 0 is current); other devices as they are.

    Example:
        >>> concrete_device(torch.device("cpu"))
        device(type='cpu')
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for a model without."""
    for t in model.parameters():
        return t.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")
