"""Counter-based uniforms: a pure function of (key, epoch, dataset index).

Used where a decision must not depend on the order in which examples are processed, e.g. Stale-SB's
stale epochs, whose choices are made in the sampler before any example is loaded (and again, with
the same result, after loading), and must replay exactly after a resume.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (uint64 arithmetic wraps modulo 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hashed_uniforms(key: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1), one per index, determined by ``(key, epoch, index)`` alone.

    Example:
        >>> u = hashed_uniforms(7, 2, np.array([0, 1, 2**40]))
        >>> bool(((u >= 0) & (u < 1)).all())
        True
        >>> bool((u == hashed_uniforms(7, 2, np.array([0, 1, 2**40]))).all())
        True
    """
    with np.errstate(over="ignore"):
        stream = _mix(np.array([key % 2**64], dtype=np.uint64) + _GOLDEN * np.uint64(epoch + 1))
        z = _mix(np.asarray(indices, dtype=np.int64).astype(np.uint64) * _GOLDEN + stream)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)
