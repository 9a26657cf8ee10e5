"""What a module computes with besides its tensors: its public attributes and its forward hooks,
as objects compared by identity (:func:`module_attributes`, :func:`same_attributes`).

The selection copy of ``overlap_selection`` (:class:`~sbloader.overlap.SelectionCopy`) is made
again where any of them changed; the frozen prefix's cross-epoch feature cache
(:class:`~sbloader.features.FeatureCache`) is emptied where its hooks changed
(:func:`hook_keys`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["Attributes", "hook_keys", "module_attributes", "same_attributes"]

#: Per module, its attributes as ``(name, value, keys)`` (see :func:`module_attributes`).
Attributes = list[list[tuple[str, Any, tuple[Any, ...] | None]]]


#: The registries of forward hooks, the private attributes compared (see :func:`module_attributes`).
_HOOKS = frozenset(
    {
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
    }
)


def module_attributes(model: nn.Module) -> Attributes:
    """Per module of ``model``, its public attributes and its forward hooks' registries as
    ``(name, value, keys)``: the value itself (compared by identity), and for a dict (the
    registries, changed in place) its keys.

    NOTE: not ``training`` (set by every pass), nor other private attributes: frameworks keep
    per-step state there (Lightning's ``_current_fx_name``), and a copy made again at every
    pass would cost a deep copy of the model per source batch.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> before = module_attributes(net)
        >>> same_attributes(before, module_attributes(net))
        True
        >>> _ = net[0].register_forward_hook(lambda m, i, o: o)
        >>> same_attributes(before, module_attributes(net))
        False
    """
    return [
        [
            (k, v, tuple(v) if isinstance(v, dict) else None)
            for k, v in vars(m).items()
            if (k in _HOOKS or not k.startswith("_")) and k != "training"
        ]
        for m in model.modules()
    ]


def same_attributes(
    made: Attributes,
    now: Attributes,
) -> bool:
    """Whether every module's attributes are the objects (and dicts' keys) they were."""
    return len(made) == len(now) and all(
        len(a) == len(b)
        and all(ka == kb and va is vb and da == db for (ka, va, da), (kb, vb, db) in zip(a, b))
        for a, b in zip(made, now)
    )


def hook_keys(model: nn.Module) -> tuple[tuple[Any, ...], ...]:
    """Per module of ``model``, the keys of its forward hooks' registries (each registration
    gets a new key): what :func:`module_attributes` compares of them, alone.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> before = hook_keys(net)
        >>> _ = net[0].register_forward_pre_hook(lambda m, args: args)
        >>> before == hook_keys(net)
        False
    """
    return tuple(
        tuple(tuple(v) for k, v in sorted(vars(m).items()) if k in _HOOKS and isinstance(v, dict))
        for m in model.modules()
    )
