"""How much sooner does each strategy reach Traditional's accuracy, and what does it cost?

Trains the reference CNN on Fashion-MNIST (Debian's dataset-fashion-mnist: 60,000 real images)
with each strategy and reports, from one run on one machine:

- Table 1 (the paper's): wall-clock to reach Traditional's final test error x1.0, x1.1, x1.2 and
  x1.4, as a speedup over Traditional (mean over seeds, with the spread);
- Figure 7: test error against wall-clock; Figure 1/10: the time breakdown per strategy;
  Figure 13: a selectivity sweep; Figure 14: the Pareto frontier of (time, error) over all
  configurations; Figure 12: 1%, 10% and 20% of labels flipped.

Honest accounting: wall-clock includes everything the user pays for (selection passes, EL2N
scoring and its short training runs, data loading); evaluation is excluded and reported on its
own. Every strategy uses the same model, optimizer, batch size, channels_last layout and a cosine
learning-rate schedule keyed on position in the data (epochs of candidates consumed, from
``loader.progress``), decayed to zero over the strategy's planned epochs.

    python3 benchmarks/run.py --preset quick           # the main job: ~11 minutes on 2 cores
    python3 benchmarks/run.py --preset full            # everything (hours)
    python3 benchmarks/run.py --preset full --resume --out results/full   # continue a run

Each run is saved as soon as it ends (``runs/*.json`` in the output folder), so an interrupted
benchmark keeps what it measured and ``--resume`` skips it next time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _machine import machine_info
from torch.utils.data import DataLoader

import sbloader
from sbloader.datasets import ArrayDataset, fashion_mnist_tensors
from sbloader.recipes import cosine_lr, error_rate, resnet18, small_cnn

MULTIPLIERS = (1.0, 1.1, 1.2, 1.4)


# ---------------------------------------------------------------------------- configuration
@dataclass
class Config:
    """One benchmark's settings. Units are in the comments."""

    preset: str = "quick"
    epochs: int = 10  # planned epochs of the default schedule [epochs of data]
    seeds: tuple[int, ...] = (0,)
    strategies: tuple[str, ...] = ("traditional", "sb_0.33", "stale_sb_3")
    batch_size: int = 128  # training batch [examples]
    pool_batch_size: int = 512  # source batch of selective strategies [examples per selection]
    lr: float = 0.05  # peak learning rate [1]
    momentum: float = 0.9
    weight_decay: float = 5e-4
    eval_every: float = 0.5  # evaluation interval [epochs of data]
    selection_bf16: bool = True  # selection passes under bf16 autocast (training stays fp32)
    label_noise: tuple[float, ...] = (0.0,)  # fractions of training labels flipped [1]
    noise_strategies: tuple[str, ...] = ()  # strategies also run at the non-zero noise levels
    noise_seeds: tuple[int, ...] = (0,)
    el2n_models: int = 2  # EL2N: copies trained [models]
    el2n_epochs: int = 1  # EL2N: epochs per copy [epochs]
    el2n_keep: float = 0.7  # EL2N: fraction of the training set kept [1]
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    model: str = "small_cnn"  # "small_cnn" (28 x 28) or "resnet18" (CIFAR-style, 32 x 32)
    dataset: str = "fashion_mnist"  # or "cifar10", "cifar100", "svhn" (local files, see --data)
    data_root: str | None = None  # folder of a local dataset in torchvision's format
    image_size: int = 28  # Fashion-MNIST is padded to this size [pixels]
    device: str = "cpu"  # "cpu", "cuda" or "auto" (cuda when available) [device]
    train_bf16: bool = False  # training forwards under bf16 autocast (GPU presets)
    augment: bool = False  # random crops (padding 4) and, unless svhn, flips of training batches


_RESNET: dict[str, Any] = dict(
    model="resnet18",
    image_size=32,
    device="auto",
    train_bf16=True,
    batch_size=256,
    pool_batch_size=1024,
    lr=0.1,
)
_GPU_STRATEGIES = (
    "traditional",
    "traditional_e4",
    "random_0.33",
    "sb_0.33",
    "sb_0.33_rwarmup",
    "stale_sb_3",
    "stale_sb_3_rwarmup",
)

PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(
        strategies=(
            "traditional",
            "traditional_e4",
            "random_0.33",
            "sb_0.33_rwarmup",
            "stale_sb_3_rwarmup",
        ),
    ),
    "full": dict(
        seeds=(0, 1, 2),
        # The headline comparisons first, so that a run cut short still holds them.
        strategies=(
            "traditional",
            "traditional_e4",
            "traditional_e6",
            "random_0.33",
            "random_0.33_warmup",
            "sb_0.33_rwarmup",
            "stale_sb_3_rwarmup",
            "sb_0.33",
            "stale_sb_3",
            "stale_sb_2",
            "random_0.5",
            "random_0.25",
            "sb_0.5",
            "sb_0.25",
            "kath18",
            "el2n",
            "diet_sb",
            "diet_sb_rwarmup",
            "sb_0.33_warmup",
            "stale_sb_3_warmup",
            "sb_0.33_anneal",
            "sb_0.33_reweight",
        ),
        label_noise=(0.0, 0.01, 0.1, 0.2),
        noise_strategies=("traditional", "random_0.33", "sb_0.33_rwarmup"),
    ),
    # For a lent GPU: ResNet-18 on Fashion-MNIST padded to 32 x 32, larger batches, bf16.
    "gpu": dict(
        seeds=(0, 1, 2),
        strategies=_GPU_STRATEGIES,
        **_RESNET,
    ),
    # For data a user has locally in torchvision's format (never downloaded): --data FOLDER.
    "cifar10": dict(
        dataset="cifar10", augment=True, epochs=30, strategies=_GPU_STRATEGIES, **_RESNET
    ),
    "cifar100": dict(
        dataset="cifar100", augment=True, epochs=30, strategies=_GPU_STRATEGIES, **_RESNET
    ),
    "svhn": dict(dataset="svhn", augment=True, epochs=20, strategies=_GPU_STRATEGIES, **_RESNET),
}


# ---------------------------------------------------------------------------- strategies
@dataclass
class Strategy:
    """How to build one strategy's loader."""

    name: str
    family: str  # "control" or "selective": for the Pareto share
    policy: Callable[[Config], sbloader.Policy]
    epochs: int | None = None  # planned epochs (None: the config's)
    pooled: bool = True  # candidates come in pool_batch_size source batches
    prune: bool = False  # EL2N pre-pruning first (its cost is charged)
    selectivity: float | None = None


def _strategy(name: str) -> Strategy:
    """Parse a strategy name such as ``sb_0.33``, ``stale_sb_3_warmup`` or ``traditional_e4``.

    A part ``eN`` anywhere sets the planned epochs (the schedule's length) to N.
    """
    parts = name.split("_")
    planned = [int(p[1:]) for p in parts if len(p) > 1 and p[0] == "e" and p[1:].isdigit()]
    parts = [p for p in parts if not (len(p) > 1 and p[0] == "e" and p[1:].isdigit())]
    strat = _parse(name, parts)
    if planned:
        strat.epochs = planned[0]
    return strat


def _parse(name: str, parts: list[str]) -> Strategy:
    suffix = parts[-1] if parts[-1] in ("warmup", "rwarmup", "anneal", "reweight") else ""
    if suffix:
        parts = parts[:-1]
    reweight = suffix == "reweight"

    def phased(
        make: Callable[[Config], sbloader.Policy], s: float
    ) -> Callable[[Config], sbloader.Policy]:
        """Wrap a policy with the name's warm-up (``_warmup``: one Traditional epoch;
        ``_rwarmup``: one Random-Backprop epoch at the same selectivity) or annealing."""
        if suffix not in ("warmup", "rwarmup", "anneal"):
            return make
        return lambda c: sbloader.Phased(
            make(c),
            warmup_epochs=0 if suffix == "anneal" else 1,
            warmup_policy=sbloader.RandomBackprop(s) if suffix == "rwarmup" else None,
            anneal_from_epoch=c.epochs - max(1, round(c.epochs / 8))
            if suffix == "anneal"
            else None,
        )

    if parts == ["traditional"]:
        return Strategy(name, "control", lambda c: sbloader.Traditional(), pooled=False)
    if parts[0] == "random":
        s = float(parts[1])
        return Strategy(
            name, "control", phased(lambda c: sbloader.RandomBackprop(s), s), selectivity=s
        )
    if parts[0] == "sb":
        s = float(parts[1])
        return Strategy(
            name,
            "selective",
            phased(lambda c: sbloader.SelectiveBackprop(s, reweight=reweight), s),
            selectivity=s,
        )
    if parts[:2] == ["stale", "sb"]:
        n = int(parts[2])
        return Strategy(
            name,
            "selective",
            phased(lambda c: sbloader.SelectiveBackprop(1 / 3, staleness=n), 1 / 3),
            selectivity=1 / 3,
        )
    if parts[0] == "kath18":
        return Strategy(name, "selective", lambda c: sbloader.Kath18(1 / 3), selectivity=1 / 3)
    if parts[0] == "el2n":
        return Strategy(
            name, "selective", lambda c: sbloader.Traditional(), prune=True, pooled=False
        )
    if parts[:2] == ["diet", "sb"]:
        return Strategy(
            name,
            "selective",
            phased(lambda c: sbloader.SelectiveBackprop(1 / 3), 1 / 3),
            prune=True,
            selectivity=1 / 3,
        )
    raise ValueError(f"unknown strategy {name!r}")


# ---------------------------------------------------------------------------- one run
@dataclass
class Run:
    strategy: str
    seed: int
    noise: float
    planned_epochs: int
    points: list[dict[str, float]] = field(default_factory=list)  # the error curve
    epochs: list[dict[str, Any]] = field(default_factory=list)  # loader stats per epoch
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds, summed over epochs
    pre_cost: dict[str, Any] = field(default_factory=dict)  # EL2N scoring
    eval_s: float = 0.0
    final_error: float = float("nan")
    train_s: float = 0.0
    diverged: bool = False  # collapsed: chance-level test error at some point from epoch 1 on
    classes: int = 10

    def key(self) -> str:
        return f"{self.strategy}__s{self.seed}__n{self.noise:g}"


def _flip_labels(y: torch.Tensor, fraction: float, seed: int, classes: int = 10) -> torch.Tensor:
    if fraction <= 0:
        return y
    g = torch.Generator().manual_seed(10_000 + seed)
    idx = torch.randperm(len(y), generator=g)[: round(fraction * len(y))]
    shift = torch.randint(1, classes, (len(idx),), generator=g)
    y = y.clone()
    y[idx] = (y[idx] + shift) % classes  # always a wrong label
    return y


def load_data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised float32 train and test images (N, C, H, W) and int64 labels, on the CPU."""
    if cfg.dataset == "fashion_mnist":
        x, y = fashion_mnist_tensors("train")
        xt, yt = fashion_mnist_tensors("test")
        pad = cfg.image_size - x.shape[-1]
        if pad < 0 or pad % 2:
            raise ValueError(
                f"image_size should be 28 or more by an even number for Fashion-MNIST, but got "
                f"image_size={cfg.image_size}"
            )
        if pad:  # pad with the background value (what 0 becomes after normalisation)
            fill = float(x.min())
            x, xt = (F.pad(t, (pad // 2,) * 4, value=fill).contiguous() for t in (x, xt))
        return x, y, xt, yt
    from sbloader.datasets import local_dataset_tensors

    if cfg.data_root is None:
        raise ValueError(
            f"the {cfg.dataset!r} preset reads a local copy in torchvision's format; pass "
            "--data FOLDER (sbloader never downloads data)"
        )
    return (
        *local_dataset_tensors(cfg.dataset, "train", cfg.data_root),
        *local_dataset_tensors(cfg.dataset, "test", cfg.data_root),
    )


def make_model(cfg: Config, classes: int, channels: int) -> torch.nn.Module:
    if cfg.model == "small_cnn":
        return small_cnn(classes, channels)
    if cfg.model == "resnet18":
        return resnet18(classes, channels)
    raise ValueError(f"model should be 'small_cnn' or 'resnet18', but got model={cfg.model!r}")


def augment(x: torch.Tensor, gen: torch.Generator, flip: bool, pad: int = 4) -> torch.Tensor:
    """Random crops of the zero-padded images (a shift of up to ``pad`` pixels each way, per
    example) and, when ``flip``, random horizontal flips: airbench's batch augmentation."""
    n, c, h, w = x.shape
    dev = x.device
    if flip:
        mask = torch.rand(n, device=dev, generator=gen) < 0.5
        x = torch.where(mask[:, None, None, None], x.flip(3), x)
    padded = F.pad(x, (pad,) * 4)
    dy, dx = torch.randint(0, 2 * pad + 1, (2, n), device=dev, generator=gen)
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]
    batch = torch.arange(n, device=dev)[:, None, None, None]
    chans = torch.arange(c, device=dev)[None, :, None, None]
    return padded[batch, chans, rows, cols].contiguous(memory_format=torch.channels_last)


class StepTimer:
    """Seconds in training forwards and in backwards (with the optimizer step).

    On the CPU, wall-clock per step. On a GPU, CUDA events read when the totals are asked for,
    so that timing never forces a synchronisation that would change the wall-clock measured.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.forward = self.backward = 0.0
        self._marks: list[Any] = []
        self._pending: list[list[Any]] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        if len(self._marks) == 3:
            self._pending.append(self._marks)
            self._marks = []
            if not self.cuda:
                self._settle()

    def _settle(self) -> None:
        for a, b, c in self._pending:
            if self.cuda:
                self.forward += a.elapsed_time(b) / 1000
                self.backward += b.elapsed_time(c) / 1000
            else:
                self.forward += b - a
                self.backward += c - b
        self._pending = []

    def totals(self) -> tuple[float, float]:
        if self.cuda and self._pending:
            torch.cuda.synchronize()
            self._settle()
        return self.forward, self.backward


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_one(cfg: Config, strat: Strategy, seed: int, noise: float, data, progress) -> Run:
    x_train, y_train, x_test, y_test = data
    y_noisy = _flip_labels(y_train, noise, seed)
    classes = int(y_train.max()) + 1
    planned = strat.epochs or cfg.epochs
    run = Run(strat.name, seed, noise, planned)
    device = torch.device(cfg.device)
    cl = torch.channels_last

    def new_model() -> torch.nn.Module:
        return make_model(cfg, classes, x_train.shape[1]).to(device, memory_format=cl)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model = new_model()

    def make_opt(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            m.parameters(),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=True,
            weight_decay=cfg.weight_decay,
        )

    opt = make_opt(model)
    # NOTE: on a GPU the training set lives on the device, as a GPU user would keep a dataset
    # of this size; the DataLoader then only indexes it (num_workers=0).
    dataset = ArrayDataset(x_train.to(device), y_noisy.to(device))
    x_test, y_test = x_test.to(device), y_test.to(device)
    bf16 = torch.bfloat16

    def source(bs: int) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=bs,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )

    def evaluate() -> float:
        return error_rate(model, x_test, y_test, autocast=bf16 if cfg.train_bf16 else None)

    train_s = 0.0
    subset = None
    if strat.prune:
        r = sbloader.el2n_scores(
            new_model,
            source(cfg.batch_size),
            make_optimizer=make_opt,
            models=cfg.el2n_models,
            epochs=cfg.el2n_epochs,
            seed=1000 + seed,
            device=device,
        )
        subset = sbloader.prune(r.scores, cfg.el2n_keep, keep="hardest")
        run.pre_cost = r.cost()
        train_s += r.seconds  # the user pays for scoring
    loader = sbloader.SelectiveLoader(
        source(cfg.pool_batch_size if strat.pooled else cfg.batch_size),
        model,
        policy=strat.policy(dataclasses.replace(cfg, epochs=planned)),  # its own schedule
        batch_size=cfg.batch_size,
        memory_format=cl,
        autocast=bf16 if cfg.selection_bf16 else None,
        seed=seed,
        subset=subset,
    )
    aug_gen = torch.Generator(device=device).manual_seed(20_000 + seed)
    train_autocast = (
        (lambda: torch.autocast(device.type, dtype=bf16))
        if cfg.train_bf16
        else contextlib.nullcontext
    )
    timer = StepTimer(device)
    eval_s = 0.0
    next_eval = cfg.eval_every
    run.points.append(dict(position=0.0, time_s=train_s, error=1.0, backprops=0, selections=0))
    backprops = 0

    def record(position: float) -> float:
        """Evaluate (excluded from the wall-clock) and add a point to the curve."""
        nonlocal eval_s
        _sync(device)
        e0 = time.perf_counter()
        err = evaluate()
        elapsed = train_s + e0 - start - eval_s
        eval_s += time.perf_counter() - e0
        run.points.append(
            dict(
                position=position,
                time_s=elapsed,
                error=err,
                backprops=backprops,
                selections=loader.stats.total.selection_forwards,
            )
        )
        return err

    start = time.perf_counter()
    for _epoch in range(planned):
        for batch in loader:
            x, y = batch
            if cfg.augment:
                x = augment(x, aug_gen, flip=cfg.dataset != "svhn")
            lr = cosine_lr(cfg.lr, loader.progress, planned)
            for group in opt.param_groups:
                group["lr"] = lr
            timer.mark()
            with train_autocast():
                out = model(x)
            loss = (F.cross_entropy(out.float(), y, reduction="none") * batch.weights).mean()
            timer.mark()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            timer.mark()
            backprops += len(y)
            if loader.progress + 1e-9 >= next_eval:
                err = record(loader.progress)
                next_eval += cfg.eval_every
                st = loader.stats.current
                progress.set_postfix(
                    epoch=f"{loader.progress:.1f}",
                    rate=f"{st.selection_rate:.2f}",
                    err=f"{100 * err:.2f}%",
                )
            progress.update(int(100 * loader.progress) - progress.n)  # hundredths of an epoch
    # The final state is always evaluated (also when eval_every does not divide the epochs).
    if run.points[-1]["position"] < planned - 1e-9:
        record(float(planned))
    _sync(device)
    total = time.perf_counter() - start - eval_s
    run.final_error = run.points[-1]["error"]
    run.train_s = train_s + total
    run.eval_s = eval_s
    t = loader.stats.total
    fwd_s, bwd_s = timer.totals()
    # NOTE: on a GPU the loader's selection time also holds the wait for training work still
    # queued when a selection pass starts (it needs the losses on the host), so there the
    # breakdown's parts can exceed the wall-clock; "other" is what remains, at least 0.
    run.breakdown = dict(
        selection=t.selection_s,
        forward=fwd_s,
        backward=bwd_s,
        data=t.source_s,
        el2n=run.pre_cost.get("seconds", 0.0),
    )
    run.breakdown["other"] = max(0.0, run.train_s - sum(run.breakdown.values()))
    run.epochs = [e.as_dict() for e in loader.stats.epochs]
    run.classes = classes
    run.diverged = collapsed(run)
    return run


def collapsed(run: Run) -> bool:
    """Whether training collapsed: the test error was at chance level (within half a class of
    it) at an evaluation from the end of the first epoch on, or is not a number at the end.

    NOTE: a collapsed run can recover part of the way when the learning rate decays (measured:
    SB from the first step, 90% error for five epochs, 74% at the end), so the final error
    alone does not tell.
    """
    chance = 1 - 1.5 / run.classes
    late = [p["error"] for p in run.points if p["position"] >= 1.0 - 1e-9]
    return not math.isfinite(run.final_error) or any(e >= chance for e in late)


# ---------------------------------------------------------------------------- analysis
def time_to(points: list[dict[str, float]], target: float) -> float | None:
    """Wall-clock of the first evaluation at or below ``target`` error (None if never)."""
    for p in points:
        if p["error"] <= target:
            return p["time_s"]
    return None


def speedup_table(runs: list[Run], noise: float = 0.0) -> dict[str, dict[float, dict]]:
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


def pareto(runs: list[Run]) -> list[tuple[str, float, float]]:
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


def _fmt(cell: dict) -> str:
    if cell["mean"] is None:
        return "never"
    s = f"{cell['mean']:.2f}x"
    if cell["seeds"] > 1:
        s += f" ({cell['min']:.2f} to {cell['max']:.2f})"
    if cell["never"]:
        s += f", never in {cell['never']}/{cell['seeds']}"
    return s


def summary_markdown(cfg: Config, runs: list[Run], machine: dict[str, Any]) -> str:
    lines = [f"# sbloader benchmark: preset `{cfg.preset}`", ""]
    lines.append(
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), GPU: {machine['gpu'] or 'none'}, numba "
        f"{machine['numba']}, sbloader {machine['sbloader']}, {machine['date']}."
    )
    lines.append(
        f"{cfg.dataset} ({cfg.image_size} x {cfg.image_size}"
        f"{', augmented' if cfg.augment else ''}), "
        f"{cfg.model} on {cfg.device}{' (bf16 training)' if cfg.train_bf16 else ''}, "
        f"batch {cfg.batch_size}, source batch {cfg.pool_batch_size}, peak lr {cfg.lr:g}, "
        f"{cfg.epochs} planned epochs unless "
        f"named (`_eN`), seeds {list(cfg.seeds)}, evaluation every {cfg.eval_every} epochs "
        "(excluded from wall-clock)."
    )
    lines.append("")
    table = speedup_table(runs)
    if table:
        final = table["traditional"][1.0]["target"]
        lines.append(
            f"## Table 1: speedup to Traditional's final error (mean {100 * final:.2f}%) x k"
        )
        lines.append("")
        lines.append(
            "Speedup = Traditional's wall-clock to the target ÷ the strategy's, paired by seed "
            "(the target in each seed is that seed's Traditional final error x k); mean over "
            "seeds, range in parentheses."
        )
        lines.append("")
        head = (
            "| strategy | final error | wall-clock s | backprops/epoch | "
            + " | ".join(f"x{m:g}" for m in MULTIPLIERS)
            + " |"
        )
        lines += [head, "|" + "---|" * (4 + len(MULTIPLIERS))]
        broken = []
        for name, row in table.items():
            rs = [r for r in runs if r.strategy == name and r.noise == 0]
            err = np.mean([r.final_error for r in rs])
            bad = sum(r.diverged for r in rs)
            if bad:
                broken.append(f"{name} in {bad} of {len(rs)} seeds")
                name = f"{name} (collapsed)"
            wall = np.mean([r.train_s for r in rs])
            per_epoch = [e["examples_yielded"] for r in rs for e in r.epochs]
            bp = sum(per_epoch) / len(per_epoch) if per_epoch else float("nan")
            lines.append(
                f"| {name} | {100 * err:.2f}% | {wall:.1f} | {bp:.0f} | "
                + " | ".join(_fmt(row[m]) for m in MULTIPLIERS)
                + " |"
            )
        lines.append("")
        if broken:
            lines.append(
                "Collapsed: the test error sat at chance level (the model predicts one class) "
                f"after the first epoch for {'; '.join(broken)}. Loss-based selection from "
                "a random initialisation can do this; the `_warmup` and `_rwarmup` variants "
                "start it after one epoch."
            )
            lines.append("")
    lines.append("## Time breakdown (seconds per run, mean over seeds)")
    lines.append("")
    parts = ("selection", "forward", "backward", "data", "el2n", "other")
    lines += [
        "| strategy | " + " | ".join(parts) + " | eval (excluded) |",
        "|" + "---|" * (len(parts) + 2),
    ]
    for name in dict.fromkeys(r.strategy for r in runs if r.noise == 0):
        rs = [r for r in runs if r.strategy == name and r.noise == 0]
        vals = [np.mean([r.breakdown.get(p, 0.0) for r in rs]) for p in parts]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{v:.1f}" for v in vals)
            + f" | {np.mean([r.eval_s for r in rs]):.1f} |"
        )
    lines.append("")
    front = pareto(runs)
    if front:
        sel = sum(1 for n, _, _ in front if _strategy(n).family == "selective")
        lines.append(
            f"## Pareto frontier: {len(front)} points, {sel} "
            f"({100 * sel / len(front):.0f}%) from selective strategies"
        )
        lines.append("")
        lines.append(", ".join(f"{n} ({t:.0f}s, {100 * e:.2f}%)" for n, t, e in front))
        lines.append("")
    noisy = sorted({r.noise for r in runs if r.noise > 0})
    if noisy:
        lines.append("## Label noise: final test error")
        lines.append("")
        names = list(dict.fromkeys(r.strategy for r in runs if r.noise > 0))
        lines += ["| flipped | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        for nz in [0.0, *noisy]:
            cells = []
            for n in names:
                rs = [r for r in runs if r.strategy == n and r.noise == nz]
                cells.append(f"{100 * np.mean([r.final_error for r in rs]):.2f}%" if rs else "")
            lines.append(f"| {100 * nz:g}% | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plots(cfg: Config, runs: list[Run], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    clean = [r for r in runs if r.noise == 0]
    names = list(dict.fromkeys(r.strategy for r in clean))
    cmap = plt.cm.tab10 if len(names) <= 10 else plt.cm.tab20  # distinct colours first
    colors = {n: cmap(i % cmap.N) for i, n in enumerate(names)}

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in clean:
        pts = r.points[1:]
        ax.plot(
            [p["time_s"] for p in pts],
            [100 * p["error"] for p in pts],
            color=colors[r.strategy],
            alpha=0.9 if r.seed == cfg.seeds[0] else 0.35,
            label=r.strategy if r.seed == cfg.seeds[0] else None,
        )
    ax.set(
        xlabel="training wall-clock (s, evaluation excluded)",
        ylabel="test error (%)",
        title="Figure 7: test error against wall-clock",
        ylim=(5, 20),
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    paths.append(out / "fig7_error_vs_time.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    parts = ("selection", "forward", "backward", "data", "el2n", "other")
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.5))
    left = np.zeros(len(names))
    for p in parts:
        vals = np.array(
            [
                np.mean(
                    [r.breakdown.get(p, 0.0) / r.planned_epochs for r in clean if r.strategy == n]
                )
                for n in names
            ]
        )
        ax.barh(names, vals, left=left, label=p)
        left += vals
    ax.set(xlabel="seconds per epoch", title="Figure 1/10: where an epoch's time goes")
    ax.legend(fontsize=8)
    paths.append(out / "fig1_breakdown.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    sweep = [n for n in names if n.startswith(("sb_", "random_")) and n.count("_") == 1]
    if len(sweep) >= 2:
        fig, ax = plt.subplots(figsize=(6, 4))
        for fam in ("sb", "random"):
            xs = sorted(float(n.split("_")[1]) for n in sweep if n.startswith(fam + "_"))
            if not xs:
                continue
            err = [
                np.mean([r.final_error for r in clean if r.strategy == f"{fam}_{x:g}"]) for x in xs
            ]
            ax.plot(xs, [100 * e for e in err], "o-", label=fam)
        ax.set(
            xlabel="selectivity",
            ylabel="final test error (%)",
            title="Figure 13: selectivity sweep",
        )
        ax.legend()
        paths.append(out / "fig13_selectivity.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)

    front = pareto(runs)
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in clean:
        ax.scatter(
            [p["time_s"] for p in r.points[1:]],
            [100 * p["error"] for p in r.points[1:]],
            s=6,
            color=colors[r.strategy],
            alpha=0.4,
        )
    ax.step([t for _, t, _ in front], [100 * e for _, _, e in front], where="post", color="k")
    for n, t, e in front:
        ax.annotate(n, (t, 100 * e), fontsize=6)
    ax.set(
        xlabel="wall-clock (s)",
        ylabel="test error (%)",
        ylim=(5, 20),
        title="Figure 14: Pareto frontier of time against error",
    )
    paths.append(out / "fig14_pareto.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    noisy = sorted({r.noise for r in runs})
    if len(noisy) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in dict.fromkeys(r.strategy for r in runs if r.noise > 0):
            xs = [nz for nz in noisy if any(r.strategy == n and r.noise == nz for r in runs)]
            ys = [
                100 * np.mean([r.final_error for r in runs if r.strategy == n and r.noise == nz])
                for nz in xs
            ]
            ax.plot([100 * x for x in xs], ys, "o-", label=n)
        ax.set(
            xlabel="labels flipped (%)",
            ylabel="final test error (%)",
            title="Figure 12: label noise",
        )
        ax.legend()
        paths.append(out / "fig12_noise.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths


# ---------------------------------------------------------------------------- main
def _load_runs(folder: Path) -> list[Run]:
    runs = []
    for f in sorted(folder.glob("*.json")):
        d = json.loads(f.read_text())
        run = Run(**d)
        run.diverged = collapsed(run)  # also for runs saved before the definition changed
        runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--out", help="results folder (default: results/<preset>-<time>)")
    p.add_argument("--strategies", nargs="+", help="override the preset's strategies")
    p.add_argument("--seeds", nargs="+", type=int, help="override the preset's seeds")
    p.add_argument("--epochs", type=int, help="override the planned epochs")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", help="cpu, cuda or auto (default: the preset's)")
    p.add_argument(
        "--data", help="folder of a local CIFAR-10/100 or SVHN copy (torchvision format)"
    )
    p.add_argument("--resume", action="store_true", help="skip runs already in --out")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the summary and plots from the runs in --out",
    )
    args = p.parse_args(argv)

    cfg = Config(preset=args.preset, **PRESETS[args.preset])
    if args.strategies:
        cfg.strategies = tuple(args.strategies)
    if args.seeds:
        cfg.seeds = tuple(args.seeds)
    if args.epochs:
        cfg.epochs = args.epochs
    if args.threads:
        cfg.threads = args.threads
    if args.device:
        cfg.device = args.device
    if args.data:
        cfg.data_root = str(Path(args.data).resolve())
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in (*cfg.strategies, *cfg.noise_strategies):
        _strategy(name)  # fail fast on a typo
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"results/{cfg.preset}-{stamp}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    # NOTE: a report (--report-only) describes the configuration and the machine that measured
    # the runs, as recorded next to them, not the command line or the machine reporting.
    if args.report_only and (out / "config.json").exists():
        cfg = Config(**json.loads((out / "config.json").read_text()))
    else:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    if args.report_only and (out / "machine.json").exists():
        machine = json.loads((out / "machine.json").read_text())
    else:
        (out / "machine.json").write_text(json.dumps(machine, indent=1))

    # Seed-major, each seed's label-noise runs right after its clean ones: a run cut short
    # still holds complete comparisons for its first seeds.
    jobs = []
    for seed in cfg.seeds:
        jobs += [(s, seed, 0.0) for s in cfg.strategies]
        if seed in cfg.noise_seeds:
            jobs += [
                (s, seed, nz) for nz in cfg.label_noise if nz > 0 for s in cfg.noise_strategies
            ]
    if not args.report_only:
        from tqdm import tqdm

        data = load_data(cfg)
        print(
            f"# {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
            f"{len(jobs)} runs -> {out}",
            flush=True,
        )
        for name, seed, nz in jobs:
            run_file = out / "runs" / f"{name}__s{seed}__n{nz:g}.json"
            if args.resume and run_file.exists():
                continue
            strat = _strategy(name)
            planned = strat.epochs or cfg.epochs
            steps = 100 * planned  # the bar counts hundredths of an epoch of data
            with tqdm(
                total=steps,
                desc=f"{name} seed {seed} noise {nz:g}",
                leave=False,
                mininterval=2.0,
                file=sys.stderr,
            ) as bar:
                run = run_one(cfg, strat, seed, nz, data, bar)
            run_file.write_text(json.dumps(dataclasses.asdict(run)))
            print(
                f"{name:22s} seed {seed} noise {nz:4.2f}: final error "
                f"{100 * run.final_error:5.2f}%  wall-clock {run.train_s:6.1f}s  "
                f"(eval {run.eval_s:.1f}s excluded)",
                flush=True,
            )
    runs = _load_runs(out / "runs")
    text = summary_markdown(cfg, runs, machine)
    (out / "summary.md").write_text(text + "\n")
    with open(out / "curves.csv", "w") as f:
        f.write("strategy,seed,noise,position,time_s,error,backprops,selections\n")
        for r in runs:
            for pt in r.points:
                f.write(
                    f"{r.strategy},{r.seed},{r.noise},{pt['position']:.4f},"
                    f"{pt['time_s']:.3f},{pt['error']:.5f},{pt['backprops']},"
                    f"{pt['selections']}\n"
                )
    figs = plots(cfg, runs, out)
    print()
    print(text)
    print("Plots:", *[str(f) for f in figs], sep="\n  ")
    print(f"Everything: {out}/ (summary.md, curves.csv, runs/*.json, config.json, machine.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
