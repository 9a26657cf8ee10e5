"""Recognising a third-party package's classes without importing the package."""

from __future__ import annotations

from typing import Any

__all__ = ["is_a"]


def is_a(obj: Any, package: str, name: str) -> bool:
    """Whether ``obj`` is an instance of ``package``'s class ``name`` (or of a subclass of it),
    without importing ``package``: by the names and modules of its type's classes.

    NOTE: by the type's own classes, not ``isinstance``: Accelerate's prepared loaders report
    their wrapped loader's class (``__class__``); and the package's module, not the class name
    alone: a user's own class named ``QuasiRandom`` or ``NDArrayField`` is not ffcv's.

    Example:
        >>> class QuasiRandom:  # (a class of this module, not ffcv's)
        ...     pass
        >>> is_a(QuasiRandom(), "ffcv", "QuasiRandom")
        False
        >>> from collections import OrderedDict
        >>> is_a(OrderedDict(), "collections", "OrderedDict")
        True
        >>> is_a({}, "collections", "OrderedDict")
        False
    """
    return any(
        c.__name__ == name and c.__module__.split(".")[0] == package for c in type(obj).__mro__
    )
