"""A training harness over the loader's speed options and their combinations (tests only).

A small CNN on small images trains with a real optimizer step on every yielded batch, so the
model changes and every selection depends on the steps before it. :func:`run` records each
batch (indices, data, weights, selection losses, logits) and the final parameters; with a cut
it saves the loader, model and optimizer states at that point (through ``torch.save`` and
``torch.load(weights_only=True)``), builds everything afresh, loads them and goes on, so that
an interrupted run can be compared with an uninterrupted one.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sbloader
from sbloader import Phased, RandomBackprop, SelectiveBackprop, SelectiveLoader
from sbloader.stats import CLASS_FIELDS, COUNT_FIELDS

N, CLASSES, SIDE = 72, 4, 6
EPOCHS = 4
POLICIES = ("sb", "ramp", "stale", "phased", "default", "default-planned")
CUTS = ("in-loop", "unconsumed", "after-break", "epoch-end", "crash")
#: After a ``"crash"`` cut's checkpoint the run goes on for this many batches (or to its end),
#: then dies and is resumed from that checkpoint.
CRASH_AFTER = 7


@dataclass(frozen=True)
class Config:
    """One combination of speed options (and the policy they run under)."""

    policy: str = "sb"
    overlap: bool = False
    quantize: bool = False
    autocast: Any = "auto"
    scale: float | None = None
    decisions: str = "host"
    prefix: bool = False
    cache: bool = False
    save_cache: bool = False
    channels_last: bool = False
    prefetch: int = 0
    feedback: bool = False
    store: bool = False
    keep_logits: bool = False
    compile: bool = False
    selection_batch_size: int | None = None
    batches_per_epoch: int | str | None = None
    subset: bool = False
    selector: bool = False
    workers: int = 0
    source_batch: int = 16
    batch_size: int = 6
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def conflicts(self) -> str | None:
        """Why the loader refuses this combination (documented refusals), or None."""
        stale = self.policy in ("stale", "phased", "default", "default-planned")
        rules = {
            "overlap with quantize": self.overlap and self.quantize,
            "overlap with prefix": self.overlap and self.prefix,
            "overlap with compile": self.overlap and self.compile,
            "quantize with an autocast dtype": self.quantize
            and self.autocast not in ("auto", None),
            "quantize with prefix": self.quantize and self.prefix,
            "quantize with compile": self.quantize and self.compile,
            "quantize with keep_logits": self.quantize and self.keep_logits,
            "scale with prefix": self.scale is not None and self.prefix,
            "selector with prefix": self.selector and self.prefix,
            "device decisions need staleness 1": self.decisions == "device" and stale,
            "device decisions with keep_logits": self.decisions == "device" and self.keep_logits,
            "device decisions with prefix": self.decisions == "device" and self.prefix,
            "cache without prefix": self.cache and not self.prefix,
            "cache saved without a cache": self.save_cache and not self.cache,
            "store without a store": self.store and not stale,
        }
        return next((why for why, on in rules.items() if on), None)


def sample(rng: random.Random) -> Config:
    """A random combination the loader accepts."""
    while True:
        cfg = Config(
            policy=rng.choice(POLICIES),
            overlap=rng.random() < 0.4,
            quantize=rng.random() < 0.3,
            autocast=rng.choice(["auto", torch.bfloat16, None]),
            scale=rng.choice([None, None, 0.5]),
            decisions=rng.choice(["host", "host", "device"]),
            prefix=rng.random() < 0.25,
            cache=rng.random() < 0.5,
            channels_last=rng.random() < 0.3,
            prefetch=rng.choice([0, 1]),
            feedback=rng.random() < 0.5,
            store=rng.random() < 0.3,
            keep_logits=rng.random() < 0.3,
            compile=rng.random() < 0.15,
            selection_batch_size=rng.choice([None, None, 5]),
            batches_per_epoch=rng.choice([None, None, None, "expected", 3]),
            subset=rng.random() < 0.2,
            selector=rng.random() < 0.15,
            workers=rng.choice([0] * 9 + [1]),
            source_batch=rng.choice([12, 16, 20]),
            batch_size=rng.choice([4, 6, 8]),
            seed=rng.randrange(2**16),
        )
        cfg = replace(cfg, save_cache=cfg.cache and rng.random() < 0.5)
        if cfg.conflicts() is None:
            return cfg


def images() -> TensorDataset:
    """Images whose class is the quadrant of a bright blob, plus noise (learnable)."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    x = torch.randn(N, 2, SIDE, SIDE, generator=g) * 0.7
    half = SIDE // 2
    for i, c in enumerate(y.tolist()):
        r, s = divmod(c, 2)
        x[i, :, half * r : half * r + half, half * s : half * s + half] += 1.0
    return TensorDataset(x, y)


def modules(cfg: Config) -> tuple[nn.Module | None, nn.Module]:
    """(frozen prefix or None, the trained model), from the config's seed."""
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        backbone = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, CLASSES))
    if cfg.prefix:
        backbone.eval().requires_grad_(False)
        prefix, model = backbone, head
    else:
        prefix, model = None, nn.Sequential(backbone, head)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
        if prefix is not None:
            prefix = prefix.to(memory_format=torch.channels_last)
    return prefix, model


def policy(cfg: Config) -> sbloader.Policy | None:
    if cfg.policy == "sb":
        return SelectiveBackprop(0.5, history=24)
    if cfg.policy == "ramp":  # its P follows loader.progress
        return SelectiveBackprop(0.5, history=24, ramp_epochs=3)
    if cfg.policy == "stale":
        return SelectiveBackprop(0.5, history=24, staleness=2, store_path=cfg.extra.get("path"))
    if cfg.policy == "phased":
        inner = SelectiveBackprop(
            0.5, history=24, staleness=2, fed_staleness=3, store_path=cfg.extra.get("path")
        )
        return Phased(inner, warmup_epochs=1, warmup_policy=RandomBackprop(0.5))
    return None  # the default recipe


def build(cfg: Config) -> tuple[nn.Module | None, nn.Module, torch.optim.Optimizer, Any]:
    prefix, model = modules(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    source = DataLoader(
        images(),
        batch_size=cfg.source_batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(cfg.seed + 1),
        num_workers=cfg.workers,
    )
    kw: dict[str, Any] = {}
    if cfg.policy == "default-planned":
        kw["planned_epochs"] = EPOCHS
    pol = policy(cfg)
    if pol is None and cfg.store:
        # The default recipe with its store memory-mapped (as default_policy builds it).
        pol = sbloader.default_policy(epochs=EPOCHS if cfg.policy == "default-planned" else None)
        pol.policy.store_path = cfg.extra.get("path")  # type: ignore[attr-defined]
        kw.pop("planned_epochs", None)
    loader = SelectiveLoader(
        source,
        model,
        policy=pol,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        overlap_selection=cfg.overlap,
        quantize_selection=cfg.extra.get("quantize", cfg.quantize),
        autocast=cfg.autocast,
        selection_scale=cfg.scale,
        decisions=cfg.decisions,
        frozen_prefix=prefix,
        cache_features=cfg.cache,
        save_feature_cache=cfg.save_cache,
        memory_format=torch.channels_last if cfg.channels_last else None,
        prefetch=cfg.prefetch,
        keep_logits=cfg.keep_logits,
        compile_selection={"backend": "eager"} if cfg.compile else False,
        selection_batch_size=cfg.selection_batch_size,
        batches_per_epoch=cfg.batches_per_epoch,
        subset=[i for i in range(N) if i % 5] if cfg.subset else None,
        selector=modules(replace(cfg, seed=cfg.seed + 2))[1] if cfg.selector else None,
        **kw,
    )
    return prefix, model, opt, loader


def through_torch_save(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _bytes(t: torch.Tensor | None) -> bytes | None:
    return None if t is None else t.detach().contiguous().cpu().numpy().tobytes()


@dataclass
class Run:
    """What a run yielded, batch by batch, and its final parameters."""

    batches: list[tuple[Any, ...]]
    params: list[torch.Tensor]
    #: Each epoch's counts (``loader.stats``, times left out) and target rate.
    counts: list[tuple[Any, ...]] = field(default_factory=list)
    #: How many cuts resumed the run from a saved state.
    resumes: int = 0


def step(cfg: Config, model: nn.Module, opt: torch.optim.Optimizer, loader: Any, batch: Any):
    """One training step on ``batch``; returns its record."""
    x, y = batch
    inputs = batch.features if cfg.prefix else x
    out = model(inputs)
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    opt.zero_grad()
    (losses * batch.weights).mean().backward()
    opt.step()
    if cfg.feedback:
        loader.feedback(batch.indices, losses.detach())
    return (
        tuple(batch.indices.tolist()),
        _bytes(x),
        _bytes(batch.weights),
        _bytes(batch.losses),
        _bytes(getattr(batch, "logits", None)),
        _bytes(batch.features) if cfg.prefix else None,
        bool(x.is_contiguous(memory_format=torch.channels_last)) if x.dim() == 4 else None,
        loader.progress,
    )


def run(
    cfg: Config,
    cuts: tuple[tuple[int, str], ...] = (),
    folder: Path | None = None,
    resuming: bool = True,
) -> Run:
    """Train ``EPOCHS`` (training) epochs; at each ``(k, how)`` of ``cuts`` (in order of ``k``)
    checkpoint after ``k`` batches, rebuild everything and resume. ``how``: ``"in-loop"`` (saved
    inside the loop), ``"unconsumed"`` (with the next batch fetched and not trained,
    ``unconsumed=1``), ``"after-break"`` (after leaving the loop), ``"epoch-end"`` (at the end
    of the epoch the cut falls in) or ``"crash"`` (saved inside the loop; the run goes on for
    ``CRASH_AFTER`` batches, or to its end, then dies and is rebuilt from that checkpoint: crash
    recovery, where the loader's state, the model and a memory-mapped store have moved on
    since). Not ``resuming``: the cuts only leave the loop where ``"after-break"`` leaves it,
    and the run goes on with the same loader (what a resumed run after a break must equal)."""
    if folder is not None and cfg.store:
        cfg = replace(cfg, extra={**cfg.extra, "path": str(folder)})
    _, model, opt, loader = build(cfg)
    done: list[tuple[Any, ...]] = []
    pending = sorted(cuts)
    resumes = 0
    # A "crash" cut's checkpoint, the batches done when it was saved and the cuts still to
    # come then (those of the doomed stretch happen again after the resume, as in the
    # uninterrupted run: a break there changes the epochs with batches_per_epoch).
    crash: tuple[dict[str, Any], int, list[tuple[int, str]]] | None = None

    def due(how: str) -> bool:
        return bool(pending) and pending[0][1] == how and pending[0][0] == len(done)

    def resume() -> bool:
        nonlocal model, opt, loader, resumes
        if not resuming:
            pending.pop(0)
            return False
        state = {"l": loader.state_dict(unconsumed=int(pending[0][1] == "unconsumed"))}
        model, opt, loader = _resume(cfg, {**state, "m": model.state_dict()}, opt)
        pending.pop(0)
        resumes += 1
        return True

    def save_for_crash() -> None:
        nonlocal crash
        pending.pop(0)
        if resuming:
            state = {"l": loader.state_dict(), "m": model.state_dict()}
            crash = (through_torch_save({**state, "o": opt.state_dict()}), len(done), list(pending))

    def die() -> None:
        nonlocal model, opt, loader, crash, resumes
        assert crash is not None
        state, k, pending[:] = crash
        crash = None
        model, opt, loader = _resume(cfg, state, None)
        del done[k:]
        resumes += 1

    while loader.training_epoch < EPOCHS or crash is not None:
        if loader.training_epoch >= EPOCHS:
            die()  # the run ended before it would have crashed: it crashes now
            continue
        it = iter(loader)
        left = crashed = False
        for batch in it:
            if due("unconsumed") and resume():
                left = True
                break
            done.append(step(cfg, model, opt, loader, batch))
            if due("crash"):
                save_for_crash()
            if crash is not None and len(done) >= crash[1] + CRASH_AFTER:
                left = crashed = True
                break
            if due("in-loop") and resume():
                left = True
                break
            if due("after-break"):
                break
        del it
        if crashed:
            die()
            continue
        if due("after-break"):
            resume()
        elif not left and pending and pending[0][1] == "epoch-end" and len(done) >= pending[0][0]:
            resume()
        # (a cut that can no longer happen, e.g. past the run's end, is dropped)
        while pending and pending[0][0] < len(done) and pending[0][1] != "epoch-end":
            pending.pop(0)
    params = [p.detach().clone() for p in model.state_dict().values()]
    return Run(done, params, counts(loader), resumes)


def counts(loader: Any) -> list[tuple[Any, ...]]:
    """Each epoch's counts in ``loader.stats`` (its times left out: they are measured)."""
    out = []
    for e in loader.stats.epochs:
        d = e.as_dict()
        out.append(tuple((k, d[k]) for k in (*COUNT_FIELDS, *CLASS_FIELDS, "target_rate")))
    return out


def _resume(cfg: Config, state: dict[str, Any], opt: torch.optim.Optimizer | None):
    """Rebuild everything from ``state`` (the optimizer's from ``opt``, or the state's own)."""
    if opt is not None:
        state = through_torch_save({**state, "o": opt.state_dict()})
    _, model, opt, loader = build(cfg)
    model.load_state_dict(state["m"])
    opt.load_state_dict(state["o"])
    loader.load_state_dict(state["l"])
    return model, opt, loader


def same(a: Run, b: Run) -> bool:
    """The same batches, parameters and counts."""
    return (
        a.batches == b.batches
        and all(torch.equal(x, y) for x, y in zip(a.params, b.params))
        and a.counts == b.counts
    )


def first_difference(a: Run, b: Run) -> str:
    for i, (x, y) in enumerate(zip(a.batches, b.batches)):
        if x != y:
            parts = (
                "indices",
                "data",
                "weights",
                "losses",
                "logits",
                "features",
                "layout",
                "progress",
            )
            which = [p for p, u, v in zip(parts, x, y) if u != v]
            return f"batch {i}: {which} (indices {x[0]} vs {y[0]})"
    if len(a.batches) != len(b.batches):
        return f"{len(a.batches)} batches vs {len(b.batches)}"
    for x, y in zip(a.counts, b.counts):
        if x != y:
            return f"counts: {[(k, u, v) for (k, u), (_, v) in zip(x, y) if u != v]}"
    if len(a.counts) != len(b.counts):
        return f"{len(a.counts)} epochs counted vs {len(b.counts)}"
    return "parameters differ"
