"""The strategy registry: every benchmarked strategy as a named entry built by a function.

A strategy is a policy, how its candidates are batched, and its planned epochs. The builders
below (:func:`traditional`, :func:`random_backprop`, :func:`selective_backprop`,
:func:`stale_sb`, :func:`kath18`, :func:`el2n`, :func:`diet_sb`) make one each and name it;
:data:`REGISTRY` holds them over the grids the benchmarks use. A *budget* (planned epochs other
than the configuration's) is written ``_eN`` after a registered name: ``traditional_e4`` is
Traditional decayed over 4 epochs, ``stale_sb_3_rwarmup_e15`` the Stale-SB recipe over 15. The
strategies that differ only in their budget form a *family*, named by the strategy without it.

Variants (a suffix of the name): ``_warmup`` (one Traditional epoch first), ``_rwarmup`` (one
Random-Backprop epoch at the same selectivity first), ``_anneal`` (the last eighth of the
planned epochs on all the data), ``_reweight`` (SB's weights 1/P, normalised per batch),
``_int8`` (selection passes through ``quantize_selection=True``, see :func:`int8`), ``_float`` and
``_int8auto`` (a user's loader with ``quantize_selection=False`` or ``"auto"``, see
:func:`user_quantized`), ``_overlap`` (selection passes
overlapped with training, ``overlap_selection=True``, see :func:`overlapped`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sbloader

PolicyFn = Callable[[int], sbloader.Policy]
"""Builds a policy for a strategy planned over the given number of epochs."""

SELECTIVITIES = (0.1, 0.2, 0.25, 0.33, 0.5)
"""Selectivities registered for ``random_<s>`` and ``sb_<s>`` (the name holds the value as
written: ``sb_0.33`` keeps 0.33, not 1/3)."""
STALENESS = (2, 3, 4, 5, 10)
"""Staleness values registered for ``stale_sb_<n>`` [epochs]."""
BUDGET = "_e"
"""What separates a registered name from its budget: ``traditional_e4``."""


@dataclass(frozen=True)
class Strategy:
    """How to build one strategy's loader."""

    name: str
    selective: bool
    """sbloader's selection (True) or a control: Traditional, Random-Backprop (False)."""
    make_policy: PolicyFn = dataclasses.field(repr=False)
    epochs: int | None = None
    """Planned epochs (None: the configuration's)."""
    pooled: bool = True
    """Candidates come in source batches of ``pool_batch_size`` (else ``batch_size``)."""
    pool: int | None = None
    """Source batches of this many candidates instead of the configuration's
    ``pool_batch_size`` [examples] (where ``pooled``; see :func:`with_pool`)."""
    prune: bool = False
    """EL2N pre-pruning first, its cost charged to the run."""
    selectivity: float | None = None
    feedback: bool = False
    """The training step reports its per-example losses (``loader.feedback``)."""
    as_user: bool = False
    """The loader as a user gets it with no options: source batches of the training batch and
    the loader's own selection precision, ``autocast="auto"`` (else the configuration's pools and
    selection precision)."""
    quantized: bool = False
    """Selection passes through the loader's int8 copy of the model (``quantize_selection=True``,
    CPU only) instead of the configuration's selection precision."""
    user_quantize: bool | str | None = None
    """The ``quantize_selection`` a user's loader (``as_user``) is told (None: the loader's own
    default, which was ``"auto"`` at commit 8cdbc3f and is False since)."""
    overlap: bool = False
    """Selection passes on a background thread, on a copy of the model refreshed before each
    pass (``overlap_selection=True``, CPU only): one source batch staler."""
    lr_by_backprops: bool = False
    """The learning rate's cosine follows the examples backpropagated, as a share of the run's
    planned backprops (:func:`planned_backprops`), instead of the position in the data (every
    registered strategy's: see the Trainer's NOTE)."""
    family: str = ""
    """The strategy without its budget: the name of its family (set by :func:`_named`)."""

    def policy(self, planned_epochs: int) -> sbloader.Policy:
        """A fresh policy for a run planned over ``planned_epochs``."""
        return self.make_policy(planned_epochs)

    def planned(self, default_epochs: int) -> int:
        """The run's planned epochs: the strategy's budget, else ``default_epochs``."""
        return self.epochs or default_epochs

    def source_batch(self, pool_batch_size: int, batch_size: int) -> int:
        """The examples per source batch of this strategy's runs [examples], given the
        configuration's ``pool_batch_size`` and ``batch_size``."""
        if not self.pooled:
            return batch_size
        return pool_batch_size if self.pool is None else self.pool

    def with_budget(self, epochs: int) -> Strategy:
        """The same strategy planned over ``epochs`` (named ``<family>_e<epochs>``)."""
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"a budget should be a whole number of epochs >= 1, got {epochs!r}")
        return dataclasses.replace(self, name=f"{self.family}{BUDGET}{epochs}", epochs=epochs)


def _named(name: str, selective: bool, make_policy: PolicyFn, **kw: Any) -> Strategy:
    return Strategy(name, selective, make_policy, family=name, **kw)


def _label(x: float) -> str:
    return f"{x:g}"


def _phased(make: PolicyFn, variant: str, selectivity: float) -> PolicyFn:
    """``make`` with a variant's schedule: ``warmup`` (one Traditional epoch first),
    ``rwarmup`` (one Random-Backprop epoch at ``selectivity``), ``anneal`` (all the data in
    the last eighth of the planned epochs, at least one); ``""`` or ``reweight``: ``make``."""
    if variant in ("", "reweight"):
        return make
    if variant not in ("warmup", "rwarmup", "anneal"):
        raise ValueError(f"unknown variant {variant!r}")

    def policy(planned: int) -> sbloader.Policy:
        return sbloader.Phased(
            make(planned),
            warmup_epochs=0 if variant == "anneal" else 1,
            warmup_policy=sbloader.RandomBackprop(selectivity) if variant == "rwarmup" else None,
            anneal_from_epoch=planned - max(1, round(planned / 8)) if variant == "anneal" else None,
        )

    return policy


def _suffix(variant: str) -> str:
    return f"_{variant}" if variant else ""


def traditional() -> Strategy:
    """Every example backpropagated; source batches of the training batch size."""
    return _named("traditional", False, lambda planned: sbloader.Traditional(), pooled=False)


def random_backprop(selectivity: float, variant: str = "") -> Strategy:
    """Random-Backprop: a uniform share ``selectivity`` of each pool, no selection pass."""
    s = selectivity
    return _named(
        f"random_{_label(s)}{_suffix(variant)}",
        False,
        _phased(lambda planned: sbloader.RandomBackprop(s), variant, s),
        selectivity=s,
    )


def selective_backprop(selectivity: float, variant: str = "") -> Strategy:
    """Selective-Backprop keeping ``selectivity`` in expectation (``reweight``: weights 1/P,
    normalised to mean 1 per batch)."""
    s = selectivity
    reweight = variant == "reweight"
    return _named(
        f"sb_{_label(s)}{_suffix(variant)}",
        True,
        _phased(lambda planned: sbloader.SelectiveBackprop(s, reweight=reweight), variant, s),
        selectivity=s,
    )


def stale_sb(
    staleness: int, variant: str = "", selectivity: float = 1 / 3, feedback: bool = False
) -> Strategy:
    """Stale-SB: a fresh selection pass every ``staleness``-th epoch (named ``_s<selectivity>``
    after the staleness unless 1/3; ``_fb`` at the end when the training step reports its
    losses, so that stale epochs decide from each example's last training loss)."""
    n, s = staleness, selectivity
    label = "" if s == 1 / 3 else f"_s{_label(s)}"
    return _named(
        f"stale_sb_{n}{label}{_suffix(variant)}{'_fb' if feedback else ''}",
        True,
        _phased(lambda planned: sbloader.SelectiveBackprop(s, staleness=n), variant, s),
        selectivity=s,
        feedback=feedback,
    )


def recipe(
    feedback: bool = False,
    as_user: bool = False,
    anneal: bool = False,
    ramp: bool = False,
    trim: float = 0.0,
    scdf: bool = False,
    selectivity: float = 1 / 3,
    anneal_share: float = 1 / 8,
    drift_bound: float | None = 0.5,
) -> Strategy:
    """sbloader's default policy (:func:`sbloader.default_policy`): ``recipe`` with the
    benchmark's selection settings, ``default`` as ``SelectiveLoader(source, model)`` builds it;
    ``_ramp`` with the selection ramped in over its first epoch (``ramp_epochs=1``);
    ``_trimN`` with the N% highest losses never kept (``trim_top=N/100``, for noisy labels);
    ``_scdf`` with stale epochs ranked against the stored losses (``stale_cdf="store"``);
    ``_s<selectivity>`` keeping another share than 1/3 (``selectivity=``);
    ``_anneal`` with all the data in the last eighth of the planned epochs (InfoBatch's
    annealing), ``_annealN`` in the last N% of them (``anneal_share=N/100``); ``_driftN`` with
    ``drift_bound=N/100`` instead of 0.5; ``_fb`` when the training step reports its losses."""
    name = "default" if as_user else "recipe"
    r = 1.0 if ramp else 0.0
    t = f"_trim{round(100 * trim)}" if trim else ""
    kw: dict[str, Any] = dict(
        ramp_epochs=r,
        trim_top=trim,
        stale_cdf="store" if scdf else "window",
        selectivity=selectivity,
        anneal_share=anneal_share,
        drift_bound=drift_bound,
    )
    sel = "" if selectivity == 1 / 3 else f"_s{_label(selectivity)}"
    share = "" if anneal_share == 1 / 8 else f"{round(100 * anneal_share)}"
    return _named(
        f"{name}{sel}{'_ramp' if ramp else ''}{t}{'_scdf' if scdf else ''}"
        f"{f'_anneal{share}' if anneal else ''}"
        f"{_drift_label(drift_bound)}"
        f"{'_fb' if feedback else ''}",
        True,
        (lambda planned: sbloader.default_policy(epochs=planned, **kw))
        if anneal
        else (lambda planned: sbloader.default_policy(**kw)),
        selectivity=selectivity,
        feedback=feedback,
        as_user=as_user,
        pooled=not as_user,
    )


def _drift_label(drift_bound: float | None) -> str:
    """The name's part for a drift bound: none for the default 0.5."""
    if drift_bound is None:
        return "_nodrift"
    return "" if drift_bound == 0.5 else f"_drift{round(100 * drift_bound)}"


def int8(strategy: Strategy) -> Strategy:
    """``strategy`` with its selection passes through the loader's int8 copy of the model
    (``quantize_selection=True``), named ``<name>_int8``."""
    name = f"{strategy.name}_int8"
    return dataclasses.replace(strategy, name=name, family=name, quantized=True)


def with_pool(strategy: Strategy, size: int) -> Strategy:
    """``strategy`` with source batches of ``size`` candidates whatever the configuration's
    ``pool_batch_size``, named ``<name>_pool<size>`` (on a GPU, pools of 4096 cut the loader's
    own share of an SB epoch from 4.9% to 2.5%: ``benchmarks/results/gpu_h200_1126b/``)."""
    name = f"{strategy.name}_pool{size}"
    return dataclasses.replace(strategy, name=name, family=name, pool=size)


def user_quantized(strategy: Strategy, value: bool | str) -> Strategy:
    """``strategy`` (a user's loader) told ``quantize_selection=value``: named ``<name>_float``
    for False, ``<name>_int8auto`` for ``"auto"``."""
    if not strategy.as_user:
        raise ValueError(f"{strategy.name} selects in the configuration's precision")
    name = f"{strategy.name}_{'float' if value is False else 'int8auto'}"
    return dataclasses.replace(strategy, name=name, family=name, user_quantize=value)


def overlapped(strategy: Strategy) -> Strategy:
    """``strategy`` with its selection passes overlapped with training
    (``overlap_selection=True``), named ``<name>_overlap``."""
    name = f"{strategy.name}_overlap"
    return dataclasses.replace(strategy, name=name, family=name, overlap=True)


def kath18() -> Strategy:
    """Katharopoulos & Fleuret (2018) importance sampling at 1/3."""
    return _named("kath18", True, lambda planned: sbloader.Kath18(1 / 3), selectivity=1 / 3)


def el2n() -> Strategy:
    """EL2N pruning to ``el2n_keep`` of the data (scoring charged), then Traditional."""
    return _named("el2n", True, lambda planned: sbloader.Traditional(), prune=True, pooled=False)


def diet_sb(variant: str = "") -> Strategy:
    """EL2N pruning, then SB at 1/3."""
    return _named(
        f"diet_sb{_suffix(variant)}",
        True,
        _phased(lambda planned: sbloader.SelectiveBackprop(1 / 3), variant, 1 / 3),
        prune=True,
        selectivity=1 / 3,
    )


def _build_registry() -> dict[str, Strategy]:
    entries = [traditional(), kath18(), el2n()]
    entries += [recipe(fb, user) for fb in (False, True) for user in (False, True)]
    entries += [
        user_quantized(recipe(fb, True), v) for fb in (False, True) for v in (False, "auto")
    ]
    entries += [recipe(feedback=True, anneal=True), recipe(feedback=True, anneal=True, ramp=True)]
    entries += [recipe(feedback=True, anneal=True, trim=0.1), recipe(feedback=True, trim=0.1)]
    entries += [recipe(feedback=True, anneal=True, scdf=True)]
    entries += [recipe(feedback=True, anneal=True, ramp=True, scdf=True)]
    entries += [recipe(feedback=True, anneal=True, selectivity=s) for s in (0.4, 0.5)]
    for s in SELECTIVITIES:
        entries += [random_backprop(s, v) for v in ("", "warmup", "anneal")]
        entries += [
            selective_backprop(s, v) for v in ("", "warmup", "rwarmup", "anneal", "reweight")
        ]
    for n in STALENESS:
        entries += [stale_sb(n, v) for v in ("", "warmup", "rwarmup", "anneal")]
        entries += [stale_sb(n, v, feedback=True) for v in ("", "rwarmup")]
        entries += [stale_sb(n, "rwarmup", s, feedback=True) for s in (0.2, 0.25)]
    entries += [diet_sb(v) for v in ("", "warmup", "rwarmup")]
    entries += [int8(selective_backprop(s)) for s in (0.33, 0.5)]
    entries += [int8(stale_sb(3, "rwarmup", feedback=True))]
    entries += [int8(recipe(True)), int8(recipe(True, anneal=True))]
    entries += [int8(recipe(True, anneal=True, selectivity=s)) for s in (0.4, 0.5)]
    entries += [int8(recipe(True, selectivity=s)) for s in (0.4, 0.5)]
    entries += [
        int8(recipe(True, anneal=True, selectivity=s, anneal_share=0.25)) for s in (1 / 3, 0.5)
    ]
    entries += [int8(recipe(True, trim=0.1, selectivity=0.5))]
    entries += [int8(recipe(True, anneal=True, scdf=True, selectivity=0.5))]
    entries += [overlapped(selective_backprop(0.33)), overlapped(recipe(True, anneal=True))]
    entries += [int8(recipe(True, anneal=True, drift_bound=0.75))]
    entries += [with_pool(recipe(True, anneal=True, selectivity=s), 4096) for s in (1 / 3, 0.5)]
    registry = {}
    for e in entries:
        assert e.name not in registry, e.name
        registry[e.name] = e
    return registry


REGISTRY: dict[str, Strategy] = _build_registry()
"""Every registered strategy by name (without budgets; :func:`get` adds those)."""


def get(name: str) -> Strategy:
    """The strategy called ``name``: a registered name, optionally with a budget ``_eN``."""
    if name in REGISTRY:
        return REGISTRY[name]
    family, sep, epochs = name.rpartition(BUDGET)
    if sep and family in REGISTRY and epochs.isdigit() and epochs == str(int(epochs) or ""):
        return REGISTRY[family].with_budget(int(epochs))
    raise ValueError(
        f"unknown strategy {name!r}: a registered name (such as {', '.join(list(REGISTRY)[:4])}; "
        f"all in benchmarks/core/strategies.py), optionally followed by a budget such as _e4; "
        "a screen's variant is registered only by its script (run_variant): report its runs "
        "with that script, e.g. python3 benchmarks/results/SCREEN/..._run.py --report-only "
        "--out DIR"
    )


def planned_backprops(policy: sbloader.Policy, planned_epochs: int) -> float:
    """The examples a run of ``policy`` over ``planned_epochs`` is expected to backpropagate,
    in epochs of data: each epoch at its policy's ``target_rate`` (a ``Phased`` policy's
    warm-up at its warm-up policy's, its annealed epochs at 1).

    Example:
        >>> planned_backprops(sbloader.default_policy(epochs=10), 10)  # 9 x 1/3 + 1 annealed
        4.0
        >>> round(planned_backprops(sbloader.RandomBackprop(0.25), 8), 6)
        2.0
    """
    if not isinstance(policy, sbloader.Phased):
        return planned_epochs * policy.target_rate
    warmup = min(policy.warmup_epochs, planned_epochs)
    anneal = planned_epochs if policy.anneal_from_epoch is None else policy.anneal_from_epoch
    anneal = max(warmup, min(anneal, planned_epochs))
    return (
        warmup * policy.warmup_policy.target_rate
        + (anneal - warmup) * policy.policy.target_rate
        + (planned_epochs - anneal)
    )


def register_variant(
    name: str, make_policy: PolicyFn | None = None, base: str = "default_fb", **changes: Any
) -> Strategy:
    """Register ``name``: the registered strategy ``base`` (its batching, options and budget)
    with another policy (``make_policy``; None: the base's) and any other ``changes`` of its
    fields, as a family of its own (``name_eN`` gives it a budget), for a screen of what is not
    a library feature (see :func:`run_variant`).

    Example:
        >>> import sbloader
        >>> s = register_variant("doc_rb_half", lambda planned: sbloader.RandomBackprop(0.5),
        ...     base="random_0.33")
        >>> get("doc_rb_half_e4").family, get("doc_rb_half_e4").epochs
        ('doc_rb_half', 4)
        >>> del REGISTRY["doc_rb_half"]
    """
    if name in REGISTRY:
        raise ValueError(f"the strategy {name!r} is registered already: choose another name")
    origin = get(base)
    strategy = dataclasses.replace(
        origin,
        name=name,
        family=name,
        make_policy=origin.make_policy if make_policy is None else make_policy,
        **changes,
    )
    REGISTRY[name] = strategy
    return strategy


def run_variant(
    name: str, make_policy: PolicyFn | None = None, base: str = "default_fb", **changes: Any
) -> None:
    """Register ``name`` (:func:`register_variant`) and run ``benchmarks/run.py`` with this
    process's command-line arguments, which may then name it among ``--strategies``: what a
    screen script (``benchmarks/results/*/..._run.py``) ends with."""
    import runpy
    import sys

    register_variant(name, make_policy, base, **changes)
    sys.argv = ["benchmarks/run.py", *sys.argv[1:]]
    runpy.run_module("benchmarks.run", run_name="__main__", alter_sys=True)


FAMILIES: dict[str, tuple[int, ...]] = {
    "traditional": (2, 3, 4, 6, 10),
    "random_0.33": (3, 5, 10, 20),
    "recipe_fb_int8": (2, 3, 5),
    "recipe_anneal_fb_int8": (10, 15),
    "recipe_s0.4_anneal_fb_int8": (10, 15),
    "recipe_s0.5_anneal_fb_int8": (15,),
}
"""The frontier preset's families and their budgets [planned epochs]: the controls over budgets
wide enough that their frontiers are reached (issue 12: 2-10 epochs for Traditional, 3-20 for
Random-Backprop), and sbloader's recipes with int8 selection passes: with feedback at short
budgets for the loose targets (2, 3 and 5 epochs, as Traditional's grid starts at 2: the 2-epoch
run was the best at x1.4 in one seed of three, ``benchmarks/results/frontier_x14_amx_1126/``),
annealed over 10 and 15 epochs keeping 1/3 or 0.4 and over 15 keeping 0.5 for the tight ones
(``benchmarks/results/MEASURED.md``, "The frontier": three seeds, 2026-11-25)."""

GPU_FAMILIES: dict[str, tuple[int, ...]] = {
    "traditional": (2, 3, 4, 6, 10),
    "random_0.33": (5, 10, 20),
    "recipe_anneal_fb": (10, 15, 20),
    "recipe_s0.5_anneal_fb": (10, 15),
}
"""The GPU frontier's families (``gpu_frontier`` preset, ResNet-18): the controls as on the CPU,
and the recipe in the configuration's precision (bf16 on a GPU; int8 copies are CPU-only),
annealed over 10, 15 and 20 epochs keeping 1/3 and over 10 and 15 keeping 0.5. The recipe with
feedback at 3 and 5 epochs reached no target in a first H100 run (18.2% and 11.0% final error,
against Traditional-6's 8.3% in 13.8 s), and was dropped for a 20-epoch budget of the annealed
one, whose 15-epoch run ended lowest (7.0%) but above Traditional-10 (6.6%)."""

MLP_FAMILIES: dict[str, tuple[int, ...]] = {
    "traditional": (2, 3, 4, 6, 10),
    "random_0.33": (3, 5, 10, 20),
    "recipe_anneal_fb": (10,),
    "recipe_fb_int8": (2, 3, 5),
    "recipe_anneal_fb_int8": (10,),
    "recipe_s0.4_anneal_fb_int8": (10,),
    "recipe_s0.5_anneal_fb_int8": (10,),
}
"""The MLP frontier's families: as measured (README, Measured), the recipe also in the
configuration's precision and every annealed recipe over 10 epochs; the short recipe at 2, 3
and 5 epochs as in :data:`FAMILIES` (the 2-epoch run changed no x1.4 figure here:
``benchmarks/results/frontier_x14_mlp_amx_1126/``)."""

NOISE_FAMILIES: dict[str, tuple[int, ...]] = {
    "traditional": (2, 3, 6, 10),
    "random_0.33": (3, 5, 10),
    "recipe_trim10_fb": (5, 10),
    "recipe_s0.5_trim10_fb_int8": (10, 15),
}
"""The label-noise frontier's families: the recipe never keeping the 10% highest losses
(``trim_top=0.1``), not annealed (annealing trains on the flipped labels at the end: measured
worse), keeping 1/3 at 5 and 10 epochs and 0.5 with int8 selection at 10 and 15 (the families of
``benchmarks/results/frontier_noise_s05/``)."""


def family_members(family: str, budgets: tuple[int, ...], default_epochs: int) -> list[str]:
    """The run names of ``family`` at ``budgets``: ``<family>_e<N>``, or the family's own name
    for the budget equal to ``default_epochs`` (``traditional``, not ``traditional_e10``)."""
    base = get(family)
    if base.epochs is not None:
        raise ValueError(f"a family is a strategy without a budget, but got {family!r}")
    return [family if b == default_epochs else base.with_budget(b).name for b in budgets]
