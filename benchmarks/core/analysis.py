"""Pure accounting over runs: time to a target error, Table 1's paired speedups, the Pareto
frontier. No I/O."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .frontier import TIE
from .records import Run

MULTIPLIERS = (1.0, 1.1, 1.2, 1.4)
"""Table 1's targets: Traditional's final error times these."""


def time_to(points: list[dict[str, float]], target: float) -> float | None:
    """Wall-clock of the first evaluation at or below ``target`` error (None if never)."""
    for p in points:
        if p["error"] <= target + TIE:  # (a float product's target: see frontier.TIE)
            return p["time_s"]
    return None


def speedup_table(runs: Sequence[Run], noise: float = 0.0) -> dict[str, dict[float, dict]]:
    """Per strategy and multiplier: speedups over Traditional, paired by seed.

    NOTE: the target is paired too: in seed s it is Traditional's final error in seed s, times
    k. A target shared by all seeds (e.g. the mean final error) is one that Traditional itself
    never reaches in the seeds that end above it.
    """
    runs = [r for r in runs if r.noise == noise]
    trad = {r.seed: r for r in runs if r.strategy == "traditional"}
    if not trad:
        return {}
    table: dict[str, dict[float, dict]] = {}
    for name in dict.fromkeys(r.strategy for r in runs):
        table[name] = {}
        for m in MULTIPLIERS:
            target = float(np.mean([t.final_error for t in trad.values()])) * m
            ups, never = [], 0
            for r in (r for r in runs if r.strategy == name and r.seed in trad):
                goal = trad[r.seed].final_error * m
                t_trad, t = time_to(trad[r.seed].points, goal), time_to(r.points, goal)
                if t is None or t_trad is None:
                    never += 1
                elif t == 0:  # a target at or above the untrained error (as the frontier's)
                    ups.append(math.inf if t_trad > 0 else 1.0)
                else:
                    ups.append(t_trad / t)
            table[name][m] = dict(
                target=target,
                mean=float(np.mean(ups)) if ups else None,
                min=min(ups) if ups else None,
                max=max(ups) if ups else None,
                never=never,
                seeds=len(ups) + never,
            )
    return table


def pareto(runs: Sequence[Run]) -> list[tuple[str, float, float]]:
    """Non-dominated (time, error) points over every evaluation of every run (noise 0)."""
    pts = sorted(
        ((p["time_s"], p["error"], r.strategy) for r in runs if r.noise == 0 for p in r.points[1:]),
    )
    frontier, best = [], float("inf")
    for t, e, name in pts:
        if e < best:
            frontier.append((name, t, e))
            best = e
    return frontier
