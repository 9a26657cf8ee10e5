"""Where does an epoch's wall-clock go? The paper's Figure 1, and what the selection pass costs.

Trains the reference CNN (``sbloader.recipes.small_cnn``, as in examples/train_fashion_mnist.py)
on Fashion-MNIST (Debian's dataset-fashion-mnist) and measures, on this machine:

1. **Breakdown** of one epoch into data loading, selection forwards, training forwards,
   backwards (with the optimizer step) and other (the loader's own work and the training loop's),
   for Traditional, SB and Stale-SB, with a DataLoader and an FFCV source. Stale-SB's figure is
   the mean over one staleness cycle (one fresh epoch, then stale ones).
2. **Selection cost** c per example, as a fraction of a training step per example, for each
   selection-speed option: a larger selection batch, channels_last, bf16 autocast,
   ``torch.compile``, downsampled inputs (``selection_scale``) and a cheaper proxy selector.
3. **Throughput** of SelectiveLoader with a trivial model against the raw source's.
4. **Frozen-backbone fine-tuning**: SB epochs with and without activation caching
   (``frozen_prefix=``).
5. **Profile** (``--sections profile``, not in the default four): one SB and one Stale-SB epoch
   of the breakdown's setting under ``cProfile``, unsynchronised, the functions that took the
   most of their own time (``profile_<strategy>.txt``, and the first ones in ``breakdown.md``):
   where the loader's own share goes, on a GPU included.

Warm-up (first calls, kernel selection, numba and FFCV compilation, ``torch.compile``) is
excluded: every measured configuration first runs a few batches that are not timed. Each figure is
the median over ``repeats`` runs. Writes ``breakdown.md``, ``breakdown.json`` and
``breakdown.png`` into the results folder, with the machine and library versions.

    python3 benchmarks/breakdown.py results/breakdown --quick   # ~2-3 minutes on 2 cores
    python3 benchmarks/breakdown.py results/breakdown           # the full measurement
    python3 benchmarks/breakdown.py results/gpu --gpu           # ResNet-18 at 32 x 32 on a GPU

On a GPU (``--gpu``: ResNet-18 on Fashion-MNIST padded to 32 x 32, bf16 training and selection,
training batch 256, source batch 1024) every timed phase ends with a CUDA synchronisation, so
that each category holds its own GPU work; that removes some CPU/GPU overlap, so the epoch
figures there are upper bounds of what an unsynchronised loop takes.

The machine may be shared: timings from a busy machine are indicative only.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    # Run as a file: run this checkout's ``benchmarks.breakdown`` as ``python3 -m`` would from
    # the repository, so that this checkout's benchmarks and sbloader are the ones that run.
    import runpy
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("benchmarks.breakdown", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import cProfile
import dataclasses
import inspect
import io
import json
import os
import pstats
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch import nn

import sbloader
from benchmarks.core.config import Config, Measurement, measurement
from benchmarks.core.data import shuffled, train_set
from benchmarks.core.machine import describe_commit, machine_info
from benchmarks.core.models import make_loader, seeded_model, split_backbone
from benchmarks.core.sources import Sources
from benchmarks.core.throughput import throughput
from benchmarks.core.timing import StepTimer, median, sync
from benchmarks.core.train import train_step
from sbloader.datasets import ArrayDataset
from sbloader.selection import SelectionForward, unwrap


class Variant(NamedTuple):
    """A breakdown row beside the three: the policy kind, the loader's options, whether each
    phase ends with a CUDA synchronisation, and the source batch (None: the config's)."""

    policy: str
    options: dict[str, Any]
    synchronise: bool
    source_batch: int | None = None

    def batch_of_source(self, cfg: Config) -> int:
        """The source batch it is measured with: Traditional's training batch, else its own
        or the config's pool."""
        if self.policy == "traditional":
            return cfg.batch_size
        return self.source_batch or cfg.pool_batch_size

    def epochs(self, m: Measurement) -> int:
        """The epochs one measurement averages: Stale-SB's staleness cycle, else one."""
        return m.staleness if self.policy == "stale_sb" else 1


#: Breakdown rows measured on a GPU beside the three. The ``_async`` rows do not synchronise
#: (a synchronisation of the device would wait for the selection stream too, undoing the
#: overlap): their epoch is what an ordinary training loop takes, their split into categories
#: GPU times from CUDA events (and ``other`` what is left, at least 0). The ``_pool4096`` rows
#: take source batches of 4,096 instead of the config's 1,024: the loader's own work is mostly
#: per pool (a host round trip, the window's insertion, the model's mode toggles), so four times
#: fewer pools is the lever its share has on a GPU.
GPU_VARIANTS: dict[str, Variant] = {
    "sb_device": Variant("sb", {"decisions": "device"}, True),
    "traditional_async": Variant("traditional", {}, False),
    "sb_async": Variant("sb", {}, False),
    "sb_overlap_async": Variant("sb", {"overlap_selection": True}, False),
    "sb_pool4096": Variant("sb", {}, True, 4096),
    "stale_sb_pool4096": Variant("stale_sb", {}, True, 4096),
}
SECTIONS = ("breakdown", "selection", "throughput", "frozen", "profile")
#: The sections measured without ``--sections``: the profile runs only when asked for.
DEFAULT_SECTIONS = ("breakdown", "selection", "throughput", "frozen")
CATEGORIES = ("data", "selection_fwd", "train_fwd", "backward", "other")
LABELS = {
    "data": "data loading",
    "selection_fwd": "selection forwards",
    "train_fwd": "training forwards",
    "backward": "backwards + optimizer step",
    "other": "other (loader + loop)",
}


# ---------------------------------------------------------------------------- helpers
def stale_sb_available() -> bool:
    """Whether this sbloader's SelectiveBackprop has ``staleness=`` (Stale-SB)."""
    return "staleness" in inspect.signature(sbloader.SelectiveBackprop).parameters


def warm_up(
    source: Any,
    model: nn.Module,
    cfg: Config,
    m: Measurement,
    options: dict[str, Any] | None = None,
) -> None:
    """Untimed training steps through a throwaway loader over the same source and model, with
    the measured loader's ``options``: first calls, kernel choices, numba's and FFCV's
    compilation. The model is restored afterwards.

    NOTE: with the variant's own options (``decisions="device"``, ``overlap_selection``), so
    that their first-use costs (the device decisions' kernels, the selection thread, its CUDA
    stream and model copy) fall here and not in the timed epoch."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        # SB from the first step with overlap_selection=True is warned about; here it warms up
        warnings.filterwarnings("ignore", message="overlap_selection=True with")
        loader = make_loader(
            cfg, source, model, sbloader.SelectiveBackprop(0.5), m.seed, **(options or {})
        )
    for i, batch in enumerate(loader):
        train_step(cfg, model, opt, batch[0], batch[1])
        if i + 1 >= m.warmup_batches:
            break
    sync(cfg.device)
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------- 1. breakdown
def train_epoch(
    loader: sbloader.SelectiveLoader,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    cfg: Config,
    inputs_of: Callable[[Any], torch.Tensor] | None = None,
    synchronise: bool = True,
) -> dict[str, float]:
    """One epoch, timed: the training step's forward and backward, and the loader's stats.

    On a GPU each phase ends with a synchronisation, so that its time holds its own GPU work
    (and the loader's selection timer starts on an idle GPU); ``synchronise=False``: none, the
    phases timed with CUDA events."""
    timer = StepTimer(cfg.device, synchronise=synchronise)
    sync(cfg.device)
    t_start = time.perf_counter()
    for batch in loader:
        x = batch[0] if inputs_of is None else inputs_of(batch)
        train_step(cfg, model, opt, x, batch[1], batch.weights, timer)
    sync(cfg.device)  # the epoch's GPU work is in its wall-clock
    wall = time.perf_counter() - t_start
    fwd, bwd = timer.totals()
    st = loader.stats.current
    assert st is not None
    loader_own = st.selection_s - st.selection_forward_s + st.overhead_s
    return {
        "wall": wall,
        "data": st.source_s,
        "selection_fwd": st.selection_forward_s,
        "train_fwd": fwd,
        "backward": bwd,
        "other": max(0.0, wall - st.source_s - st.selection_forward_s - fwd - bwd),
        "loader_own": loader_own,
        "examples_seen": st.examples_seen,
        "selection_forwards": st.selection_forwards,
        "backprop": st.examples_yielded,
        "selection_hidden": st.selection_hidden_s,
        "selection_calls": st.selection_calls,
    }


def breakdown(
    cfg: Config,
    m: Measurement,
    sources: Sources,
    log: Callable[[str], None],
    variants: dict[str, Variant] | None = None,
) -> list[dict[str, Any]]:
    """Section 1: Traditional, SB and Stale-SB, then ``variants`` (default: ``GPU_VARIANTS`` on
    a GPU, none on a CPU), each a row of medians over ``m.repeats``."""
    if variants is None:
        variants = GPU_VARIANTS if str(cfg.device).startswith("cuda") else {}
    strategies = ["traditional", "sb"] + (["stale_sb"] if stale_sb_available() else [])
    strategies += list(variants)
    if not stale_sb_available():
        log("# Stale-SB skipped: this sbloader's SelectiveBackprop has no staleness=")
    configs = [(kind, strategy) for kind in sources.kinds() for strategy in strategies]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in configs}
    # NOTE: repeats are the outer loop, so that a slow spell of a shared machine spreads over
    # all configurations instead of falling on one.
    for rep in range(m.repeats):
        for kind, strategy in configs:
            variant = variants.get(strategy, Variant(strategy, {}, True))
            model = seeded_model(cfg, m.seed)
            opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
            source = sources.make(kind, variant.batch_of_source(cfg), m.seed + rep)
            warm_up(source, model, cfg, m, variant.options)
            with warnings.catch_warnings():
                # plain SB overlapped from its first epoch is warned about (a collapse measured
                # in training); here it is timed only
                warnings.filterwarnings("ignore", message="overlap_selection=True with")
                loader = make_loader(
                    cfg, source, model, m.policy(variant.policy), m.seed, **variant.options
                )
            per_epoch = [
                train_epoch(loader, model, opt, cfg, synchronise=variant.synchronise)
                for _ in range(variant.epochs(m))
            ]
            run = {k: float(np.mean([e[k] for e in per_epoch])) for k in per_epoch[0]}
            runs[kind, strategy].append(run | {"epochs": per_epoch})
            log(
                f"[{rep + 1}/{m.repeats}] {kind:10s} {strategy:9s} epoch {run['wall']:6.2f}s  "
                + "  ".join(f"{c} {run[c]:5.2f}s" for c in CATEGORIES)
                + f"  loader-own {100 * run['loader_own'] / run['wall']:.1f}%"
            )
    rows = []
    for (kind, strategy), rs in runs.items():
        variant = variants.get(strategy, Variant(strategy, {}, True))
        row: dict[str, Any] = {
            "source": kind,
            "strategy": strategy,
            "measured_epochs": variant.epochs(m),
            "source_batch": variant.batch_of_source(cfg),
        }
        keys = ("wall", *CATEGORIES, "loader_own", "examples_seen", "backprop", "selection_hidden")
        for k in keys:
            row[k] = median(r[k] for r in rs)
        row["selection_forwards"] = median(r["selection_forwards"] for r in rs)
        row["loader_own_fraction"] = median(r["loader_own"] / r["wall"] for r in rs)
        row["runs"] = rs
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- 2. selection cost
def proxy_selector(cfg: Config) -> nn.Module:
    """A cheaper proxy model for selection (conv8-pool-conv16-pool-fc10), as airbench's."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(7),  # the identity at 28 x 28
        nn.Flatten(),
        nn.Linear(16 * 7 * 7, 10),
    ).to(cfg.device)


def resolution_agnostic(cfg: Config, model: nn.Module) -> nn.Module:
    """The same modules (shared weights) with an adaptive 7x7 pool before the small CNN's
    classifier: the identity at 28x28, and what lets it score downsampled inputs. ResNet-18
    pools globally and takes any resolution as it is."""
    if cfg.model == "resnet18":
        return model
    layers = list(cast(nn.Sequential, model))  # the small CNN is an nn.Sequential
    return nn.Sequential(*layers[:8], nn.AdaptiveAvgPool2d(7), *layers[8:])


def selection_option(label: str | None = None, **settings: Any) -> dict[str, Any]:
    """A selection option: its settings (``batch``: examples per selection forward;
    ``channels_last``, ``bf16``, ``compile`` (True or ``torch.compile`` arguments), ``scale``,
    ``proxy``) and a name made from them in that order, or ``label``."""
    parts = [f"batch {settings['batch']}"]
    parts += [k for k in ("channels_last", "bf16") if settings.get(k)]
    compiled = settings.get("compile")
    if compiled is True:
        parts.append("compile")
    elif compiled:
        mode = compiled["mode"]
        parts.append(f"compile {mode}" + (" (CUDA graphs)" if mode == "reduce-overhead" else ""))
    if settings.get("scale"):
        parts.append(f"scale {settings['scale']:g}")
    if settings.get("proxy"):
        parts.append("proxy selector")
    return dict(name=label or ", ".join(parts), **settings)


_CL_BF16: dict[str, Any] = dict(channels_last=True, bf16=True)
OPTIONS: list[dict[str, Any]] = [
    selection_option("baseline: batch 128, fp32", batch=128),
    selection_option(batch=512),
    selection_option(batch=512, channels_last=True),
    selection_option(batch=512, **_CL_BF16),
    selection_option(batch=512, channels_last=True, compile=True),
    selection_option(batch=512, **_CL_BF16, compile=True),
    selection_option(batch=512, **_CL_BF16, scale=0.5),
    selection_option(batch=512, **_CL_BF16, proxy=True),
]

#: Further selection options measured on a GPU only: the source batch of ``--gpu`` in one
#: forward, and CUDA graphs (``torch.compile(mode="reduce-overhead")``) for its fixed shape.
GPU_OPTIONS: list[dict[str, Any]] = [
    selection_option(batch=1024, **_CL_BF16),
    selection_option(batch=1024, **_CL_BF16, compile=True),
    selection_option(batch=1024, **_CL_BF16, compile={"mode": "reduce-overhead"}),
]


class TrainingStep:
    """Timed training steps (forward, backward, SGD step at lr 0) over a fixed set of batches."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        cfg: Config,
        seed: int,
        channels_last: bool,
        batches: int,
    ) -> None:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.cfg = cfg
        self.model = seeded_model(dataclasses.replace(cfg, channels_last=channels_last), seed)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0, momentum=0.9)
        bs = cfg.batch_size
        dev = cfg.device
        self.batches = [
            (x[i : i + bs].to(dev).contiguous(memory_format=fmt), y[i : i + bs].to(dev))
            for i in range(0, bs * batches, bs)
        ]
        self.run()  # warm-up

    def run(self) -> float:
        """Seconds per example."""
        sync(self.cfg.device)
        t0 = time.perf_counter()
        for xb, yb in self.batches:
            train_step(self.cfg, self.model, self.opt, xb, yb)
        sync(self.cfg.device)
        return (time.perf_counter() - t0) / sum(len(yb) for _, yb in self.batches)


class SelectionPass:
    """Timed selection passes with one option's settings, through sbloader's SelectionForward."""

    def __init__(
        self,
        option: dict[str, Any],
        x: torch.Tensor,
        y: torch.Tensor,
        cfg: Config,
        seed: int,
        n: int,
    ) -> None:
        cl = option.get("channels_last", False)
        fmt = torch.channels_last if cl else torch.contiguous_format
        self.cfg = cfg
        model = proxy_selector(cfg) if option.get("proxy") else seeded_model(cfg, seed)
        # Module.to takes memory_format at run time; torch's stub overloads leave it out.
        model = model.to(memory_format=fmt)  # type: ignore[call-overload]
        self.selector = resolution_agnostic(cfg, model) if option.get("scale") else model
        self.forward = SelectionForward(
            compile=option.get("compile", False), scale=option.get("scale")
        )
        self.loss_fn = nn.CrossEntropyLoss(reduction="none")
        self.dtype = torch.bfloat16 if option.get("bf16") else None
        self.bs = option["batch"]
        dev = cfg.device
        self.chunks = [
            (x[i : i + self.bs].to(dev).contiguous(memory_format=fmt), y[i : i + self.bs].to(dev))
            for i in range(0, n, self.bs)
        ]
        t0 = time.perf_counter()
        self.run()  # warm-up, including any compilation
        self.warmup_s = time.perf_counter() - t0

    def run(self) -> float:
        """Seconds per example."""
        sync(self.cfg.device)
        t0 = time.perf_counter()
        for xb, yb in self.chunks:
            self.forward(
                unwrap(self.selector),
                xb,
                yb,
                self.loss_fn,
                batch_size=self.bs,
                autocast_dtype=self.dtype,
            )
        sync(self.cfg.device)
        return (time.perf_counter() - t0) / sum(len(yb) for _, yb in self.chunks)


def selection_costs(
    cfg: Config, m: Measurement, x: torch.Tensor, y: torch.Tensor, log: Callable[[str], None]
) -> dict[str, Any]:
    """c per option: selection seconds per example over training-step seconds per example.

    NOTE: each option's selection passes alternate with training steps, round by round, and c
    is the median of the per-round ratios, so that a busy spell of a shared machine hits both
    sides of a ratio alike. The training reference is channels_last (the faster layout here,
    and what the breakdown trains with): a fair c compares with the best training step.
    """
    # As many whole pools as the examples hold (a small --examples holds fewer than planned).
    n = min(m.option_batches, len(y) // cfg.pool_batch_size) * cfg.pool_batch_size
    if n == 0:
        raise ValueError(
            f"the selection costs need at least one pool of {cfg.pool_batch_size} examples, but "
            f"--examples gave {len(y)}; pass --examples {cfg.pool_batch_size} or more"
        )
    x, y = x[:n], y[:n]
    train_batches = n // cfg.batch_size
    train = {cl: TrainingStep(x, y, cfg, m.seed, cl, train_batches) for cl in (False, True)}
    rounds = max(3, 3 * m.repeats)
    layout: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for cl, step in train.items():
            layout[cl].append(step.run())
    rows = []
    options = OPTIONS + (GPU_OPTIONS if str(cfg.device).startswith("cuda") else [])
    for option in options:
        sel = SelectionPass(option, x, y, cfg, m.seed, n)
        pairs = [(train[True].run(), sel.run()) for _ in range(rounds)]
        row = {
            "option": option["name"],
            "settings": {k: v for k, v in option.items() if k != "name"},
            "selection_s_per_example": median(s for _, s in pairs),
            "train_s_per_example": median(t for t, _ in pairs),
            "c": median(s / t for t, s in pairs),
            "warmup_s": sel.warmup_s,
        }
        rows.append(row)
        log(
            f"c = {row['c']:.3f}  ({1e6 * row['selection_s_per_example']:6.1f} us/example; "
            f"warm-up {row['warmup_s']:.1f}s)  {option['name']}"
        )
    return {
        "train_step_s_per_example": {
            "default": median(layout[False]),
            "channels_last": median(layout[True]),
        },
        "options": rows,
    }


# ---------------------------------------------------------------------------- 4. frozen backbone
FROZEN_VARIANTS = ("traditional", "sb_without_caching", "sb_with_caching", "sb_with_feature_cache")


def frozen_backbone(
    cfg: Config, m: Measurement, x: torch.Tensor, y: torch.Tensor, log: Callable[[str], None]
) -> dict[str, Any]:
    """Fine-tuning the classifier on a frozen convolutional backbone (BatchNorm in eval mode).

    Four variants, with the breakdown's selection settings: Traditional (no selection pass;
    the training forward runs the backbone on every example); SB without caching (the training
    step re-runs the backbone on the selected examples); SB with ``frozen_prefix=`` (the
    training step starts from the selection pass's backbone outputs); and SB with
    ``cache_features=True`` as well (each example's backbone output is kept across epochs).
    Each variant trains two epochs; the second is the figure (with the feature cache, the first
    fills the cache and is reported on its own).
    """
    n = min(len(x), m.frozen_examples)
    dataset = ArrayDataset(x[:n].to(cfg.device), y[:n].to(cfg.device))
    walls: dict[str, list[float]] = {v: [] for v in FROZEN_VARIANTS}
    filling: list[float] = []
    for rep in range(m.repeats):
        for variant in FROZEN_VARIANTS:
            full = seeded_model(cfg, m.seed)
            backbone, head = split_backbone(cfg, full)
            backbone.requires_grad_(False)
            backbone.eval()
            opt = torch.optim.SGD(head.parameters(), lr=cfg.lr, momentum=0.9)
            bs = cfg.batch_size if variant == "traditional" else cfg.pool_batch_size
            source = shuffled(dataset, bs, m.seed + rep, cfg.array_collate)
            policy = m.policy("traditional" if variant == "traditional" else "sb")
            inputs_of: Callable[[Any], torch.Tensor] | None = None
            trained: nn.Module = full
            if variant in ("sb_with_caching", "sb_with_feature_cache"):
                loader = make_loader(
                    cfg,
                    source,
                    head,
                    policy,
                    m.seed,
                    frozen_prefix=backbone,
                    cache_features=variant == "sb_with_feature_cache",
                )
                trained, inputs_of = head, (lambda b: b.features)
            else:
                loader = make_loader(cfg, source, full, policy, m.seed)
            first = train_epoch(loader, trained, opt, cfg, inputs_of)["wall"]  # warm-up
            walls[variant].append(train_epoch(loader, trained, opt, cfg, inputs_of)["wall"])
            if variant == "sb_with_feature_cache":
                filling.append(first)
            log(
                f"[{rep + 1}/{m.repeats}] frozen backbone, {variant:22s} "
                f"{walls[variant][-1]:6.2f}s (first epoch {first:.2f}s)"
            )
    out: dict[str, Any] = {"examples": n}
    for variant in FROZEN_VARIANTS:
        out[variant] = {"epoch_s": median(walls[variant]), "runs": walls[variant]}
    out["feature_cache_first_epoch_s"] = median(filling)
    base = walls["sb_without_caching"]
    out["speedup"] = median(a / b for a, b in zip(base, walls["sb_with_caching"]))
    out["speedup_feature_cache"] = median(
        a / b for a, b in zip(base, walls["sb_with_feature_cache"])
    )
    out["speedup_vs_traditional"] = median(
        a / b for a, b in zip(walls["traditional"], walls["sb_with_feature_cache"])
    )
    log(
        f"frozen backbone: within-batch caching {out['speedup']:.2f}x, cross-epoch feature cache "
        f"{out['speedup_feature_cache']:.2f}x faster per epoch than SB without caching; the "
        f"latter {out['speedup_vs_traditional']:.2f}x than Traditional"
    )
    return out


# ---------------------------------------------------------------------------- 5. profile
#: Functions listed per profiled strategy (in the text file; the markdown shows the first 12).
PROFILE_TOP = 40


def profile(
    cfg: Config, m: Measurement, sources: Sources, out: Path, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """One SB and one Stale-SB epoch (its fresh epoch, then a stale one) under ``cProfile``.

    NOTE: the profiled epochs are unsynchronised (as the ``_async`` rows), so that a function
    that waits for the GPU (a copy of the losses to the host) shows that wait as its own time,
    where the loader's own share counts it. ``cProfile`` adds about a microsecond per Python
    call, so the listing ranks where the host's time goes rather than timing it: the epoch's
    wall-clock without the profiler is the breakdown's.
    """
    kind = sources.kinds()[0]
    rows = []
    for strategy in ("sb", "stale_sb") if stale_sb_available() else ("sb",):
        model = seeded_model(cfg, m.seed)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        source = sources.make(kind, cfg.pool_batch_size, m.seed)
        warm_up(source, model, cfg, m)
        loader = make_loader(cfg, source, model, m.policy(strategy), m.seed)
        epochs = 2 if strategy == "stale_sb" else 1
        profiler = cProfile.Profile()
        walls = []
        for _ in range(epochs):
            profiler.enable()
            try:
                walls.append(train_epoch(loader, model, opt, cfg, synchronise=False)["wall"])
            finally:
                profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(PROFILE_TOP)
        name = f"profile_{strategy}.txt"
        (out / name).write_text(
            f"# {strategy}, {kind} source, {epochs} epoch(s) of {walls} s under cProfile\n"
            + text.getvalue()
        )
        top = []
        raw = stats.stats  # type: ignore[attr-defined]
        ranked = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:PROFILE_TOP]
        for (path, line, func), (_, calls, tottime, cumtime, _) in ranked:
            where = f" ({Path(path).name}:{line})" if line else ""
            top.append(
                {
                    "function": f"{func}{where}",
                    "calls": calls,
                    "own_s": tottime,
                    "cumulative_s": cumtime,
                }
            )
        own, called = _sbloader_seconds(raw)
        loader_top = _loader_top(raw, PROFILE_TOP)
        with (out / name).open("a") as f:
            f.write(
                "\n# The loader's own entries (sbloader's functions, and the built-ins they "
                "called, named by caller), by own time:\n"
            )
            for t in loader_top:
                f.write(f"{t['calls']:>8} {t['own_s']:9.4f}  {t['function']}\n")
        rows.append(
            {
                "strategy": strategy,
                "source": kind,
                "epochs": epochs,
                "profiled_wall_s": walls,
                "sbloader_python_s": own,
                "sbloader_builtins_s": called,
                "file": name,
                "top": top,
                "loader_top": loader_top,
            }
        )
        log(
            f"{strategy:9s} profiled {epochs} epoch(s), {sum(walls):.2f}s, sbloader's Python "
            f"{own:.3f}s + the built-ins it called {called:.3f}s: "
            + "; ".join(f"{t['function']} {t['own_s']:.3f}s" for t in top[:4])
        )
    return rows


def _loader_entries(raw: dict[Any, Any]) -> list[dict[str, Any]]:
    """The loader's own time in ``pstats`` entries: sbloader's functions by their own time, and
    each built-in call (torch's and numpy's C functions, numba's kernels, waits for the GPU) by
    the sbloader function that made it (``torch.cat <- concat (rows.py:83)``, ``builtin``
    True). The models of ``sbloader/recipes.py`` (the benchmark's CNN and ResNet-18) are the
    model's time and its datasets (``sbloader/datasets.py``) the source's: left out."""
    package = os.path.join(os.path.dirname(os.path.abspath(sbloader.__file__)), "")
    others = {os.path.join(package, name) for name in ("recipes.py", "datasets.py")}

    def in_sbloader(path: str) -> bool:
        if path == "~":
            return False
        path = os.path.abspath(path)
        return path.startswith(package) and path not in others

    entries = []
    for (path, line, func), (_, calls, tottime, _, callers) in raw.items():
        if in_sbloader(path):
            name = f"{func} ({Path(path).name}:{line})"
            entries.append({"function": name, "calls": calls, "own_s": tottime, "builtin": False})
        elif path == "~":
            for (where, at, caller), entry in callers.items():
                if in_sbloader(where):
                    name = f"{func} <- {caller} ({Path(where).name}:{at})"
                    entries.append(
                        {"function": name, "calls": entry[1], "own_s": entry[2], "builtin": True}
                    )
    return entries


def _loader_top(raw: dict[Any, Any], k: int) -> list[dict[str, Any]]:
    """The ``k`` entries of :func:`_loader_entries` with the most time."""
    return sorted(_loader_entries(raw), key=lambda e: e["own_s"], reverse=True)[:k]


def _sbloader_seconds(raw: dict[Any, Any]) -> tuple[float, float]:
    """The own time of sbloader's Python functions and that of the built-in calls they made
    (:func:`_loader_entries`, summed)."""
    entries = _loader_entries(raw)
    own = sum(e["own_s"] for e in entries if not e["builtin"])
    return own, sum(e["own_s"] for e in entries if e["builtin"])


# ---------------------------------------------------------------------------- reporting
def markdown(cfg: Config, m: Measurement, machine: dict[str, Any], results: dict[str, Any]) -> str:
    lines = [
        "# Epoch breakdown and selection cost"
        + (" (quick mode: indicative only)" if m.quick else ""),
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['torch_threads']} torch "
        f"threads, GPU: {machine['gpu'] or 'none'}. Python {machine['python']}, torch "
        f"{machine['torch']}, numpy {machine['numpy']}, numba {machine['numba']}, ffcv "
        f"{machine['ffcv'] or 'not installed'}, sbloader {machine['sbloader']} "
        f"({describe_commit(machine)}), {machine['date']}.",
        "",
        f"Fashion-MNIST ({cfg.image_size} x {cfg.image_size}), first {m.examples} training "
        f"examples, {cfg.model} on {cfg.device}"
        f"{' (bf16 training)' if cfg.train_bf16 else ''}, training batch "
        f"{cfg.batch_size}, SB/Stale-SB source batch {cfg.pool_batch_size}, selectivity "
        f"{m.selectivity:.3g}, Stale-SB staleness {m.staleness}; selection "
        f"{cfg.selection_precision}, "
        f"{'channels_last' if cfg.channels_last else 'default layout'}; median of "
        f"{m.repeats} run(s), warm-up excluded.",
        "",
    ]
    if "breakdown" in results:
        lines += _breakdown_lines(results["breakdown"])
    if "selection" in results:
        lines += _selection_lines(cfg, results["selection"])
    if "throughput" in results:
        lines += _throughput_lines(results["throughput"])
    if "frozen_backbone" in results:
        lines += _frozen_lines(results["frozen_backbone"])
    if "profile" in results:
        lines += _profile_lines(results["profile"])
    if results.get("ffcv_write_s") is not None:
        lines.append(
            f"Writing the .beton took {results['ffcv_write_s']:.1f} s (not in any figure)."
        )
    return "\n".join(lines) + "\n"


def _profile_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## 5. Profile: where the host's time goes (cProfile, unsynchronised)",
        "",
        "The functions with the most time of their own (a wait for the GPU counts where it "
        f"happens); the first {PROFILE_TOP} of each in its file. cProfile slows Python calls, "
        "so these rank the host's work rather than time it.",
        "",
    ]
    for row in rows:
        lines += [
            f"**{row['strategy']}** ({row['source']}, {row['epochs']} epoch(s), "
            f"{sum(row['profiled_wall_s']):.2f} s profiled; `{row['file']}`): sbloader's "
            f"Python functions {row['sbloader_python_s']:.3f} s of their own, the built-in calls "
            f"they made {row['sbloader_builtins_s']:.3f} s.",
            "",
            "| function | calls | own (s) | cumulative (s) |",
            "|---|---|---|---|",
        ]
        for t in row["top"][:12]:
            lines.append(
                f"| `{t['function']}` | {t['calls']} | {t['own_s']:.3f} | {t['cumulative_s']:.3f} |"
            )
        lines += ["", "The loader's own entries with the most time:", ""]
        lines += [
            "| loader function (or built-in <- its caller) | calls | own (s) |",
            "|---|---|---|",
        ]
        for t in row.get("loader_top", [])[:12]:
            lines.append(f"| `{t['function']}` | {t['calls']} | {t['own_s']:.4f} |")
        lines.append("")
    return lines


def _breakdown_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## 1. One epoch's wall-clock (seconds)",
        "",
        "| source | strategy | epoch | "
        + " | ".join(LABELS[c] for c in CATEGORIES)
        + " | loader's own share | backprop / seen |",
        "|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|",
    ]
    for r in rows:
        name = r["strategy"] + (
            f" (mean of {r['measured_epochs']} epochs)" if r["measured_epochs"] > 1 else ""
        )
        lines.append(
            f"| {r['source']} | {name} | {r['wall']:.2f} | "
            + " | ".join(f"{r[c]:.2f}" for c in CATEGORIES)
            + f" | {100 * r['loader_own_fraction']:.1f}% "
            + f"| {r['backprop']:.0f} / {r['examples_seen']:.0f} |"
        )
    lines += [
        "",
        '"Loader\'s own share": time in the loader that is neither a model forward nor the '
        "source (policy, gathering, batching), as a share of the epoch (target: at most 3%). "
        '`sb_device`: SB with `decisions="device"` (the window, the draws and the gathers on '
        "the GPU). `_async` rows: no synchronisation between phases (the epoch an ordinary loop "
        "takes; categories from CUDA events); `sb_overlap_async`: SB with "
        "`overlap_selection=True` (passes on the selection thread's CUDA stream); `_pool4096`: "
        "source batches of 4,096 (four times fewer selection passes, host round trips and "
        "window insertions an epoch); selection "
        "seconds hidden by the overlap (`selection_hidden_s`): "
        + (
            ", ".join(
                f"{r['strategy']} {r['selection_hidden']:.2f} s"
                for r in rows
                if r["selection_hidden"] > 0
            )
            or "none"
        )
        + ".",
        "",
    ]
    return lines


def _selection_lines(cfg: Config, selection: dict[str, Any]) -> list[str]:
    lines = [
        "## 2. Selection cost c per example (fraction of a training step per example)",
        "",
        "Training step per example: "
        + ", ".join(
            f"{k} {1e6 * v:.1f} us" for k, v in selection["train_step_s_per_example"].items()
        )
        + " (c is measured against channels_last training steps, alternating round by round; "
        f"target c <= {0.15 if cfg.device.startswith('cuda') else 0.3} on this machine).",
        "",
        "| selection pass | us / example | c | one-time warm-up (s) |",
        "|---|---|---|---|",
    ]
    for r in selection["options"]:
        lines.append(
            f"| {r['option']} | {1e6 * r['selection_s_per_example']:.1f} | {r['c']:.3f} | "
            f"{r['warmup_s']:.1f} |"
        )
    lines.append("")
    return lines


def _throughput_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## 3. Throughput with a trivial model (examples per second)",
        "",
        "| source | strategy | source batch | prefetch | raw source | SelectiveLoader | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['strategy']} | {r['source_batch']} | {r.get('prefetch', 0)} | "
            f"{r['raw_examples_per_s']:.0f} | {r['loader_examples_per_s']:.0f} | {r['ratio']:.3f} |"
        )
    lines += [
        "",
        "Traditional counts yielded examples; SB counts candidates consumed (target ratio >= 0.9).",
        "",
    ]
    return lines


def _frozen_lines(fb: dict[str, Any]) -> list[str]:
    return [
        "## 4. Frozen-backbone fine-tuning (seconds per epoch)",
        "",
        f"{fb['examples']} examples per epoch; the classifier trains on a frozen convolutional "
        "backbone; selection settings as in section 1.",
        "",
        "| Traditional | SB without caching | SB, `frozen_prefix=` | SB, `frozen_prefix=` + "
        "`cache_features=True` (first epoch) | speedup of `frozen_prefix=` | speedup with "
        "`cache_features` (target >= 1.5x) | `cache_features` vs Traditional |",
        "|---|---|---|---|---|---|---|",
        f"| {fb['traditional']['epoch_s']:.2f} | {fb['sb_without_caching']['epoch_s']:.2f} | "
        f"{fb['sb_with_caching']['epoch_s']:.2f} | {fb['sb_with_feature_cache']['epoch_s']:.2f} "
        f"({fb['feature_cache_first_epoch_s']:.2f}) | {fb['speedup']:.2f}x | "
        f"{fb['speedup_feature_cache']:.2f}x | {fb['speedup_vs_traditional']:.2f}x |",
        "",
        "Seconds per epoch from each variant's second epoch. Within a batch, `frozen_prefix=` "
        "saves the backbone's forward of the kept examples only (a fraction k of the data), since "
        "the selection pass still runs it on every candidate. `cache_features=True` keeps each "
        "example's backbone output across epochs, so from the second epoch on the backbone "
        "hardly runs at all (its first epoch, in parentheses, fills the cache).",
        "",
    ]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["breakdown"]
    options = results["selection"]["options"]
    fig, (ax, bx) = plt.subplots(
        2,
        1,
        figsize=(9, 0.45 * (len(rows) + len(options)) + 3),
        gridspec_kw={"height_ratios": [len(rows), len(options)]},
    )
    names = [f"{r['source']}: {r['strategy']}" for r in rows]
    left = np.zeros(len(rows))
    colors = ("#9e9e9e", "#1f77b4", "#2ca02c", "#d62728", "#ff7f0e")
    for c, color in zip(CATEGORIES, colors):
        vals = np.array([r[c] for r in rows])
        ax.barh(names, vals, left=left, label=LABELS[c], color=color)
        left += vals
    ax.invert_yaxis()
    ax.set_xlabel("seconds per epoch")
    ax.set_title(f"Where an epoch's wall-clock goes (Fashion-MNIST, {results['model']})")
    ax.legend(loc="lower right", fontsize=8)
    bx.barh([o["option"] for o in options], [o["c"] for o in options], color="#1f77b4")
    target = 0.15 if results.get("device", "cpu").startswith("cuda") else 0.3
    bx.axvline(target, color="#d62728", linestyle="--", label=f"target c = {target:g}")
    bx.invert_yaxis()
    bx.tick_params(axis="y", labelsize=8)
    bx.set_xlabel("selection cost c per example (fraction of a training step)")
    bx.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", type=Path, help="results folder (created)")
    p.add_argument("--quick", action="store_true", help="a small subset: ~2-3 minutes")
    p.add_argument("--repeats", type=int, help="measurements per configuration (median)")
    p.add_argument("--examples", type=int, help="training examples per epoch")
    p.add_argument("--ffcv-workers", type=int, help="FFCV decoding threads")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--no-ffcv", action="store_true", help="DataLoader source only")
    p.add_argument(
        "--gpu", action="store_true", help="ResNet-18 at 32 x 32 on CUDA, bf16 (a lent GPU)"
    )
    p.add_argument("--device", help="override the device (e.g. cpu, to try --gpu's settings)")
    p.add_argument("--frozen-examples", type=int, help="examples per frozen-backbone epoch")
    p.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(DEFAULT_SECTIONS),
        help="measure these sections only (default: the first four; profile: when asked)",
    )
    args = p.parse_args(argv)
    cfg, m = measurement(
        args.quick,
        args.gpu,
        device=args.device,
        frozen_examples=args.frozen_examples,
        repeats=args.repeats,
        examples=args.examples,
        ffcv_workers=args.ffcv_workers,
        threads=args.threads,
    )
    if torch.device(cfg.device).type == "cuda" and not torch.cuda.is_available():
        # NOTE: refused before any data is loaded or folder made: torch's own error came from
        # deep in the sources' set-up ("Torch not compiled with CUDA enabled").
        which = "--gpu" if args.gpu and args.device is None else f"--device {cfg.device}"
        p.error(
            f"{which} measures on a CUDA GPU, but torch.cuda.is_available() is False here; "
            + (
                "pass --device cpu to try --gpu's settings on the CPU, or drop --gpu"
                if args.gpu
                else "pass --device cpu"
            )
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        log_lines.append(line)

    machine = machine_info(exclude=args.out)
    log(f"# {json.dumps(machine)}")
    config = {"setting": dataclasses.asdict(cfg), "measurement": dataclasses.asdict(m)}
    log(f"# {config}")
    started = time.perf_counter()
    x, y = train_set(cfg)
    x, y = x[: m.examples].contiguous(), y[: m.examples].contiguous()
    use_ffcv = not args.no_ffcv
    if use_ffcv:
        import sbloader.ffcv as sbffcv

        if not sbffcv.ffcv_available():
            log("# FFCV skipped: ffcv is not installed (pip install ffcv==1.0.2)")
            use_ffcv = False
    sources = Sources(x, y, cfg.device, use_ffcv, m.ffcv_workers, cfg.array_collate)
    try:
        results: dict[str, Any] = {
            "ffcv_write_s": sources.write_s,
            "model": cfg.model,
            "device": cfg.device,
        }
        if "breakdown" in args.sections:
            log("## 1. breakdown")
            results["breakdown"] = breakdown(cfg, m, sources, log)
        if "selection" in args.sections:
            log("## 2. selection cost")
            results["selection"] = selection_costs(cfg, m, x, y, log)
        if "throughput" in args.sections:
            log("## 3. throughput")
            results["throughput"] = throughput(cfg, m, sources, log)
        if "profile" in args.sections:
            log("## 5. profile")
            results["profile"] = profile(cfg, m, sources, args.out, log)
    finally:
        sources.close()
    if "frozen" in args.sections:
        log("## 4. frozen backbone")
        fx, fy = x, y
        if m.frozen_examples > len(x):
            fx, fy = train_set(cfg)
        results["frozen_backbone"] = frozen_backbone(cfg, m, fx, fy, log)
    results["total_s"] = time.perf_counter() - started
    report = {"config": config, "machine": machine, "results": results}
    (args.out / "breakdown.json").write_text(json.dumps(report, indent=1))
    (args.out / "breakdown.md").write_text(markdown(cfg, m, machine, results))
    if "breakdown" in results and "selection" in results:
        plot(results, args.out / "breakdown.png")
    (args.out / "breakdown.log").write_text("\n".join(log_lines) + "\n")
    log(f"# wrote {args.out}/breakdown.{{md,json,png,log}} in {results['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
