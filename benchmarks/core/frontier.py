"""The frontier measure (issue 12): how much sooner the best sbloader family reaches each target
error than the best control. Pure: records in, tables out; no I/O.

A *family* is one strategy at several planned budgets (``traditional`` at 2, 3, 4, 6 and 10
epochs). Its frontier time at a target error e, T_F(e), is the least training wall-clock at which
any of its runs (in one seed) is evaluated at a test error <= e. The targets are the reference
run's final error (Traditional at the reference budget, in the same seed) times each multiplier.
The headline is T_best control(e) / T_best sbloader family(e): above 1, sbloader gets there
sooner than every control at every budget tried.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

TARGETS = (1.0, 1.05, 1.1, 1.2, 1.4)
"""Multipliers of the reference's final error: the frontier table's rows."""


@dataclass(frozen=True)
class Record:
    """One run, as the frontier sees it."""

    family: str
    budget: int
    """Planned epochs [epochs]."""
    seed: int
    evaluations: tuple[tuple[float, float], ...]
    """(training wall-clock [s], test error [1]) of each evaluation, in training order."""

    @property
    def final_error(self) -> float:
        return self.evaluations[-1][1]


@dataclass(frozen=True)
class Reached:
    """Where a family (or the best of several) first reaches a target: which run, and when."""

    family: str
    budget: int
    time_s: float


#: Slack on ``error <= target``: a target is a product of floats (0.071 * 1.2 is
#: 0.08519999999999998), and an evaluation at exactly that error (a whole number of test
#: examples) reaches it.
TIE = 1e-9


def first_time(evaluations: Iterable[tuple[float, float]], target: float) -> float | None:
    """Wall-clock of the first evaluation at or below ``target`` (None: never).

    Example:
        >>> first_time([(10.0, 0.09), (20.0, 0.0852)], 0.071 * 1.2)
        20.0
    """
    for t, err in evaluations:
        if err <= target + TIE:
            return t
    return None


def _earliest(candidates: Iterable[Reached]) -> Reached | None:
    """The soonest; ties go to the smaller budget, then to the family named first (sorted)."""
    return min(candidates, key=lambda r: (r.time_s, r.budget, r.family), default=None)


def family_time(records: Iterable[Record], family: str, seed: int, target: float) -> Reached | None:
    """T_F(target) in ``seed``: the least wall-clock at which a run of ``family`` is evaluated
    at or below ``target``, and that run's budget (None: no run of it gets there)."""
    found = []
    for r in records:
        if r.family == family and r.seed == seed:
            t = first_time(r.evaluations, target)
            if t is not None:
                found.append(Reached(family, r.budget, t))
    return _earliest(found)


@dataclass(frozen=True)
class Cell:
    """One seed at one target: the best control, the best sbloader family and their ratio."""

    seed: int
    multiplier: float
    target: float
    control: Reached | None
    sbloader: Reached | None

    @property
    def ratio(self) -> float | None:
        """T_best control / T_best sbloader: ``inf`` when only sbloader reaches the target,
        None when no sbloader family does (whatever the controls do)."""
        if self.sbloader is None:
            return None
        if self.control is None:
            return math.inf
        if self.sbloader.time_s == 0:
            return math.inf if self.control.time_s > 0 else 1.0
        return self.control.time_s / self.sbloader.time_s


@dataclass(frozen=True)
class Summary:
    """One target over the seeds: the ratio's range over the seeds where some sbloader family
    reached it, its mean over the seeds, and in how many seeds no sbloader family did.

    The mean is None where in some seed a control reached the target and no sbloader family
    did (``lost``): that seed's ratio is a loss of unknown size, and a mean over the other seeds
    alone would look like the win it is not. A seed where neither got there (possible only with
    a given ``reference_error``) is no loss and is left out of the mean. So is a seed where only
    sbloader got there (``only``, ratio ``inf``): a win of unknown size, which would make the
    mean ``inf`` whatever the other seeds measured; the mean is ``inf`` only where every seed
    that reached the target is such a seed."""

    multiplier: float
    mean_target: float
    mean: float | None
    low: float | None
    high: float | None
    never: int
    """Seeds where no sbloader family reached the target (``lost`` and ``neither``)."""
    seeds: int
    lost: int = 0
    """Seeds where a control reached the target and no sbloader family did."""
    neither: int = 0
    """Seeds where neither a control nor an sbloader family reached it (no loss)."""
    only: int = 0
    """Seeds where an sbloader family reached it and no control did (ratio ``inf``, left out of
    the mean unless every ratio is)."""


@dataclass
class FrontierTable:
    reference: tuple[str, int]
    """(family, budget) whose final error sets the targets."""
    multipliers: tuple[float, ...]
    controls: tuple[str, ...]
    selective: tuple[str, ...]
    seeds: tuple[int, ...]
    """Seeds with a reference run (the others are left out)."""
    cells: dict[tuple[int, float], Cell] = field(default_factory=dict)
    """By (seed, multiplier)."""
    families: dict[tuple[str, int, float], Reached | None] = field(default_factory=dict)
    """Each family's frontier by (family, seed, multiplier)."""

    def summary(self, multiplier: float) -> Summary:
        cells = [self.cells[s, multiplier] for s in self.seeds]
        ratios = [c.ratio for c in cells if c.ratio is not None]
        lost = sum(c.sbloader is None and c.control is not None for c in cells)
        neither = sum(c.sbloader is None and c.control is None for c in cells)
        finite = [r for r in ratios if math.isfinite(r)]
        mean = statistics.fmean(finite) if finite else math.inf
        return Summary(
            multiplier=multiplier,
            mean_target=statistics.fmean(c.target for c in cells) if cells else math.nan,
            mean=mean if ratios and not lost else None,
            low=min(ratios) if ratios else None,
            high=max(ratios) if ratios else None,
            never=len(cells) - len(ratios),
            seeds=len(cells),
            lost=lost,
            neither=neither,
            only=len(ratios) - len(finite),
        )


def frontier_table(
    records: Sequence[Record],
    controls: Collection[str],
    reference: tuple[str, int],
    multipliers: Sequence[float] = TARGETS,
    reference_error: float | Mapping[int, float] | None = None,
) -> FrontierTable:
    """Family frontiers and the ratio of the best control's to the best sbloader family's time,
    per seed and target.

    ``controls`` names the control families (Traditional, Random-Backprop); every other family
    in ``records`` is an sbloader family. ``reference`` is the (family, budget) whose final error
    in each seed, times each multiplier, is that seed's target. Seeds without a reference run
    are left out, unless ``reference_error`` is given: their targets are then that error times
    each multiplier (e.g. the mean reference error of another sitting's seeds), or, where it
    maps seeds to errors, their own seed's (e.g. that seed's Traditional final error from
    another sitting, which deterministic runs repeat); seeds it does not map are left out.
    """
    families = list(dict.fromkeys(r.family for r in records))
    table = FrontierTable(
        reference=reference,
        multipliers=tuple(multipliers),
        controls=tuple(f for f in families if f in controls),
        selective=tuple(f for f in families if f not in controls),
        seeds=(),
    )
    refs: dict[int, Record] = {}
    for r in records:
        if (r.family, r.budget) == reference:
            if r.seed in refs:
                raise ValueError(f"two reference runs {reference} in seed {r.seed}")
            refs[r.seed] = r
    given: dict[int, float] = {}
    if isinstance(reference_error, Mapping):
        given = {int(k): float(v) for k, v in reference_error.items()}
    elif reference_error is not None:
        given = {r.seed: float(reference_error) for r in records}
    table.seeds = tuple(sorted(set(refs) | (given.keys() & {r.seed for r in records})))
    for seed in table.seeds:
        base = refs[seed].final_error if seed in refs else given[seed]
        for m in table.multipliers:
            target = base * m
            for f in families:
                table.families[f, seed, m] = family_time(records, f, seed, target)
            table.cells[seed, m] = Cell(
                seed,
                m,
                target,
                control=_earliest(
                    hit for f in table.controls if (hit := table.families[f, seed, m]) is not None
                ),
                sbloader=_earliest(
                    hit for f in table.selective if (hit := table.families[f, seed, m]) is not None
                ),
            )
    return table
