"""The state protocol every stateful component implements, and its checks.

Each component (loader, source, policy, window, store, stats) has ``state_dict()`` returning a
dict with a ``"version"`` key and named keys, and ``load_state_dict(state)``. A composite's state
nests its children's under named keys. Loading checks the version first (migrating older
versions where a migration exists) and then that the state belongs to this configuration
(:func:`check_identity`), so that a checkpoint of another run is refused with the field and both
values named, never loaded silently.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "VERSION",
    "Stateful",
    "check_identity",
    "check_version",
    "rollback_state",
    "taking_rollback",
    "taking_unsaved",
    "unsaved_states",
]

#: The key of every component's state version.
VERSION = "version"


@runtime_checkable
class Stateful(Protocol):
    """Anything with the state protocol."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_version(
    state: Mapping[str, Any],
    component: str,
    version: int,
    migrations: Mapping[int, Callable[[dict[str, Any]], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The state at ``version``: as it is, or migrated from an older version; else raise.

    Args:
        state: a state saved by ``component``'s ``state_dict()``.
        component: the component's name, for the message.
        version: the version this code writes and reads.
        migrations: for an older version v, a function from a version-v state to a version-v+1
            state.

    Example:
        >>> check_version({"version": 1, "x": 2}, "Thing", 2, {1: lambda s: {**s, "version": 2}})
        {'version': 2, 'x': 2}
        >>> check_version({"version": 3}, "Thing", 2)
        Traceback (most recent call last):
        ...
        ValueError: Thing state has version=3, but this sbloader reads version 2 ...
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{component} state should be a dict from {component}.state_dict(), but got "
            f"{type(state).__name__}"
        )
    if VERSION not in state:
        # NOTE: every state this protocol writes has a version (one saved before it had one
        # is given its version 0 by its reader), so a dict without one is another object's:
        # a whole checkpoint, or the model's state. Reported as version None, the message
        # advised saving it with another sbloader.
        keys = [repr(k) for k in list(state)[:8]] + (["..."] if len(state) > 8 else [])
        raise ValueError(
            f"{component} state has no {VERSION!r} key, so it is not a state saved by "
            f"{component}.state_dict() (its keys: {', '.join(keys) or 'none'}); pass what "
            f"{component}.state_dict() returned (for a checkpoint that holds several states, "
            "its entry)"
        )
    saved = state.get(VERSION)
    migrations = migrations or {}
    out = dict(state)
    while isinstance(saved, int) and saved < version and saved in migrations:
        out = migrations[saved](out)
        saved = out.get(VERSION)
    if saved != version:
        known = sorted({version, *migrations})
        raise ValueError(
            f"{component} state has version={state.get(VERSION)!r}, but this sbloader reads "
            f"version {version} (and migrates versions {known}); save the state with a "
            "matching sbloader, or restart from an epoch boundary without it"
        )
    return out


def check_identity(
    component: str,
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    fix: str,
) -> None:
    """Refuse a state saved by a differently configured ``component``.

    Every key of ``saved`` that ``current`` also has must hold the same value (keys missing from
    an older state are not checked).

    Example:
        >>> check_identity("Loader", {"seed": 0}, {"seed": 123}, "build it as saved")
        Traceback (most recent call last):
        ...
        ValueError: the saved Loader state has seed=0, but this Loader has seed=123; build it ...
    """
    for key, value in saved.items():
        if key in current and current[key] != value:
            raise ValueError(
                f"the saved {component} state has {key}={value!r}, but this {component} has "
                f"{key}={current[key]!r}; {fix}"
            )


# Whether the states being taken are a rollback backup (see rollback_state).
_ROLLBACK = contextvars.ContextVar("sbloader_rollback_state", default=False)


@contextlib.contextmanager
def rollback_state() -> Iterator[None]:
    """Within this context ``state_dict()`` calls take a backup to roll a refused
    ``load_state_dict`` back to, in this process only: components whose state is large or lives
    outside the process (a memory-mapped store's files, a feature cache's rows) then refer to
    what they hold instead of copying it (see :func:`taking_rollback`).

    NOTE (why): a state refused part-way must leave the loader as it was (all or nothing), so
    the loader takes its own state first; copying a store's files or a cache's gigabytes for a
    backup that is dropped unless the load fails would make every load cost a checkpoint.

    Example:
        >>> with rollback_state():
        ...     taking_rollback()
        True
        >>> taking_rollback()
        False
    """
    with _set(_ROLLBACK):
        yield


def taking_rollback() -> bool:
    """Whether a rollback backup is being taken (within :func:`rollback_state`)."""
    return _ROLLBACK.get()


# Whether the states being taken are ones a checkpoint may never save (see unsaved_states).
_UNSAVED = contextvars.ContextVar("sbloader_unsaved_states", default=False)


@contextlib.contextmanager
def unsaved_states() -> Iterator[None]:
    """Within this context ``state_dict()`` calls take states that a checkpoint may never save
    (see :func:`taking_unsaved`): a component whose state is costly (a store's columns, a
    memory-mapped store's snapshot) and unchanged since its last state returns what that one
    holds again instead of a new copy, and files it writes for one (a snapshot) take no place
    among the newest it keeps (``store_snapshots``) until a checkpoint saves the state
    (``SelectiveLoader.keep_saved_files``); it removes them otherwise once their state was
    loaded (fit again) and another snapshot follows, or the next unsaved one replaces them.

    NOTE (why): a run Lightning stops part-way takes two states at the stop (the epoch as of
    its last batch, and the epoch ended there: see ``LightningLoader.end_epoch``), for a
    checkpoint that may follow (``save_last``, ``trainer.save_checkpoint``) or may not. Each
    wrote a snapshot, removing the oldest kept: with ``store_snapshots=1`` the second removed
    the first's, so resuming the stopped epoch was refused, and with
    ``ModelCheckpoint(every_n_train_steps=10)`` a run stopped at step 35 left its only
    checkpoint (step 30) refused. A store changed in between still takes its own.

    Example:
        >>> with unsaved_states():
        ...     taking_unsaved()
        True
        >>> taking_unsaved()
        False
    """
    with _set(_UNSAVED):
        yield


def taking_unsaved() -> bool:
    """Whether the states taken now are ones a checkpoint may never save (within
    :func:`unsaved_states`)."""
    return _UNSAVED.get()


@contextlib.contextmanager
def _set(flag: contextvars.ContextVar[bool]) -> Iterator[None]:
    """``flag`` is True within this context."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)
