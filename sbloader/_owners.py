"""Which :class:`~sbloader.SelectiveLoader` each policy object is attached to: attaching starts a
policy's run afresh, so a loader whose policy was given to another loader since refuses to go on
with it (:func:`check_owner`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .policies import Policy

__all__ = ["check_owner", "claim"]


#: The loader each policy object was last attached to (see check_owner), by
#: the policy's id, with a weak reference to the policy (an entry goes when the policy does).
#: NOTE: not a WeakKeyDictionary, which needs hashable keys: a policy written as a dataclass
#: with eq=True has no hash.
_OWNERS: dict[int, tuple[weakref.ref[Policy], weakref.ref[object]]] = {}


def claim(policy: Policy, loader: object) -> None:
    """Record ``loader`` as the one ``policy`` is attached to (not for a policy that cannot be
    weakly referenced, e.g. with ``__slots__`` and no ``__weakref__``: it is not checked)."""
    key = id(policy)

    def forget(_: weakref.ref[Policy]) -> None:
        _OWNERS.pop(key, None)

    try:
        ref = weakref.ref(policy, forget)
    except TypeError:
        return
    _OWNERS[key] = (ref, weakref.ref(loader))


def _owner(policy: Policy) -> weakref.ref[object] | None:
    """The loader ``policy`` was last attached to (a weak reference), or None."""
    entry = _OWNERS.get(id(policy))
    if entry is None or entry[0]() is not policy:
        return None
    return entry[1]


def check_owner(policies: Iterable[Policy], loader: object) -> None:
    """Refuse (``RuntimeError``) to let ``loader`` go on where one of its ``policies`` (its
    policy and the policies it runs) was attached to another SelectiveLoader since: attaching
    starts the policy's run afresh (its window, store and pass schedule), so ``loader``'s run
    state is gone.

    NOTE: checked when the loader is used, not when the second loader is built: building a
    loader again with the same policy object (a notebook cell run twice) is fine as long
    as the first one is not used again.
    """
    for part in policies:
        owner = _owner(part)
        if owner is not None and owner() is not loader:
            raise RuntimeError(
                f"this SelectiveLoader's policy {part!r} was given to another "
                "SelectiveLoader since, which started the policy's run afresh (its loss "
                "window, per-example store and pass schedule), so this loader cannot go on "
                "with it; give each loader its own policy object (e.g. "
                "policy=copy.deepcopy(policy)), or build this loader again"
            )
