"""Quantized selection on the CPU: is an int8 selection forward cheaper than bf16 + compile, and
how much of the ranking does it keep?

Trains the breakdown's CNN (``benchmarks.core.models``, channels_last) partly on Fashion-MNIST,
then for each way of running the selection forward measures:

- **c**: selection seconds per example over training-step seconds per example, with
  ``breakdown.py``'s method (selection passes alternating with training steps round by round,
  the median of the per-round ratios);
- **Spearman's rho** of its per-example losses against fp32's on held-out real batches (the
  ranking is what Selective-Backprop uses), and the share of fp32's top third it keeps;
- **refresh**: seconds to build the quantized copy from the current weights (the copy must be
  rebuilt as the model trains; a refresh every n source batches makes the selection pass up to
  n steps stale).

Ways: fp32; bf16 autocast; bf16 + ``torch.compile``; int8 dynamic quantization of the Linear
layers (``torch.ao.quantization.quantize_dynamic``); int8 static quantization of convolutions
and Linear layers (FX graph mode, x86 backend, Conv-BN-ReLU fused, calibrated on 512 examples).

``--section loader`` measures the loader's own option, ``SelectiveLoader(quantize_selection=)``,
against bf16 autocast in whole training epochs (the breakdown's CNN, step and DataLoader source),
side by side and interleaved round by round with Traditional: each epoch's c from the loader's
stats (selection seconds per selection forward, refreshes included, over training seconds per
backpropagated example), k (backpropagated over seen examples), and the epoch time against the
bound 1.1 x (c x forwards per seen example + k) x Traditional's epoch time of the same round.
Stale-SB's figures are the mean over one staleness cycle (one fresh epoch, then stale ones).

    taskset -c 0 python3 benchmarks/quantized_selection.py results/quantized --threads 1
    taskset -c 0 python3 benchmarks/quantized_selection.py results/quantized --threads 1 \
        --section loader
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import runpy
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("benchmarks.quantized_selection", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import copy
import dataclasses
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import sbloader
from benchmarks.breakdown import TrainingStep, train_epoch, warm_up
from benchmarks.core.config import Config, Measurement, measurement
from benchmarks.core.data import train_set
from benchmarks.core.machine import describe_commit, machine_info
from benchmarks.core.models import make_loader, seeded_model
from benchmarks.core.sources import Sources
from benchmarks.core.timing import cell, median, rounds_summary
from sbloader.selection import SelectionForward


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        # average the ranks of ties
        _, inv, counts = np.unique(v, return_inverse=True, return_counts=True)
        sums = np.bincount(inv, weights=r)
        return sums[inv] / counts[inv]

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def top_overlap(a: np.ndarray, b: np.ndarray, frac: float = 1 / 3) -> float:
    """The share of ``a``'s top ``frac`` that is also in ``b``'s."""
    k = max(1, int(len(a) * frac))
    return len(set(np.argsort(-a)[:k]) & set(np.argsort(-b)[:k])) / k


def static_int8(model: nn.Module, calib: torch.Tensor) -> nn.Module:
    """An FX graph-mode int8 copy (x86 backend): Conv-BN-ReLU fused, per-channel weights,
    activations observed on ``calib``."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    # Module.to takes memory_format at run time; torch's stub overloads leave it out.
    m = copy.deepcopy(model).eval().to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(m, get_default_qconfig_mapping("x86"), (calib[:2],))
        with torch.inference_mode():
            for i in range(0, len(calib), 128):
                prepared(calib[i : i + 128])
        return convert_fx(prepared)


def library_int8(examples: int) -> Callable[[nn.Module, torch.Tensor], nn.Module]:
    """The copy ``SelectiveLoader(quantize_selection=QuantizedSelection(calibration_examples=
    examples))`` builds (min-max activation observers), on the first ``examples`` of ``calib``."""
    from sbloader.quantize import QuantizedSelection, QuantizedSelector

    def build(model: nn.Module, calib: torch.Tensor) -> nn.Module:
        config = QuantizedSelection(calibration_examples=examples)
        return QuantizedSelector(config, torch.backends.quantized.engine).model_for(model, calib, 0)

    return build


def dynamic_int8(model: nn.Module, calib: torch.Tensor) -> nn.Module:
    """int8 dynamic quantization of the Linear layers (convolutions stay fp32)."""
    m = copy.deepcopy(model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)


class Way:
    """One way of running the selection forward over fixed chunks, called as the loader calls
    it (``sbloader.selection.SelectionForward``: eval mode, inference mode, autocast, compile),
    as ``breakdown.py``'s selection passes are."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        chunks: list[tuple[torch.Tensor, torch.Tensor]],
        bf16: bool = False,
        compile: bool = False,
        build: Callable[[nn.Module, torch.Tensor], nn.Module] | None = None,
        calib: torch.Tensor | None = None,
    ) -> None:
        self.name, self.chunks = name, chunks
        self.dtype = torch.bfloat16 if bf16 else None
        self.refresh_s: float | None = None
        if build is not None:
            assert calib is not None
            t0 = time.perf_counter()
            model = build(model, calib)
            self.refresh_s = time.perf_counter() - t0
        self.model = model
        self.forward = SelectionForward(compile=compile)
        self.loss = nn.CrossEntropyLoss(reduction="none")
        t0 = time.perf_counter()
        self.run()
        self.warmup_s = time.perf_counter() - t0

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.forward(
            self.model, x, y, self.loss, batch_size=len(y), autocast_dtype=self.dtype
        )[0]
        return out.float()

    def run(self) -> float:
        """Seconds per example."""
        t0 = time.perf_counter()
        for x, y in self.chunks:
            self.losses(x, y)
        return (time.perf_counter() - t0) / sum(len(y) for _, y in self.chunks)


#: The loader section's ways: (strategy, SelectiveLoader options).
LOADER_WAYS: dict[str, tuple[str, dict[str, Any]]] = {
    "traditional": ("traditional", {}),
    "sb bf16": ("sb", {"autocast": torch.bfloat16}),
    "sb int8": ("sb", {"autocast": None, "quantize_selection": True}),
    "stale_sb bf16": ("stale_sb", {"autocast": torch.bfloat16}),
    "stale_sb int8": ("stale_sb", {"autocast": None, "quantize_selection": True}),
}


def loader_epochs(
    cfg: Config, m: Measurement, x: torch.Tensor, y: torch.Tensor, rounds: int
) -> list[dict[str, Any]]:
    """Every way of :data:`LOADER_WAYS` for one epoch (a staleness cycle for Stale-SB) per round,
    the ways interleaved within each round; one row per way and round."""
    sources = Sources(x, y, cfg.device, False)
    rows: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            trad_wall = None
            for name, (strategy, kw) in LOADER_WAYS.items():
                epochs = m.staleness if strategy == "stale_sb" else 1
                source_bs = cfg.batch_size if strategy == "traditional" else cfg.pool_batch_size
                model = seeded_model(cfg, m.seed)
                opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
                source = sources.make("dataloader", source_bs, m.seed + r)
                warm_up(source, model, cfg, m, kw)
                loader = make_loader(cfg, source, model, m.policy(strategy), m.seed, **kw)
                per_epoch = [train_epoch(loader, model, opt, cfg) for _ in range(epochs)]
                total = {k: sum(e[k] for e in per_epoch) for k in per_epoch[0]}
                wall = total["wall"] / epochs
                quantized = loader.scorer.quantized
                row: dict[str, Any] = {
                    "way": name,
                    "round": r,
                    "epochs": epochs,
                    "wall_s": wall,
                    "k": total["backprop"] / total["examples_seen"],
                    "forwards_per_seen": total["selection_forwards"] / total["examples_seen"],
                    "train_s_per_example": (total["train_fwd"] + total["backward"])
                    / total["backprop"],
                    "selection_s": total["selection_fwd"] / epochs,
                    "refreshes": None if quantized is None else quantized.refreshes / epochs,
                    "refresh_s": None if quantized is None else quantized.refresh_s / epochs,
                }
                if total["selection_forwards"]:
                    per_forward = total["selection_fwd"] / total["selection_forwards"]
                    row["c"] = per_forward / row["train_s_per_example"]
                    if quantized is not None:
                        build = quantized.refresh_s / total["selection_forwards"]
                        row["c_without_refresh"] = (per_forward - build) / row[
                            "train_s_per_example"
                        ]
                if strategy == "traditional":
                    trad_wall = wall
                else:
                    assert trad_wall is not None
                    row["ratio"] = wall / trad_wall
                    row["bound"] = 1.1 * (row["c"] * row["forwards_per_seen"] + row["k"])
                rows.append(row)
                extra = (
                    ""
                    if "ratio" not in row
                    else f"  c {row['c']:.3f}  k {row['k']:.3f}  epoch/trad {row['ratio']:.3f}"
                    f"  bound {row['bound']:.3f}"
                    + ("" if quantized is None else f"  refreshes {row['refreshes']:.1f}")
                )
                print(f"[{r + 1}/{rounds}] {name:14s} epoch {wall:6.2f}s{extra}", flush=True)
    finally:
        sources.close()
    return rows


def refresh_setting(report: dict[str, Any]) -> str:
    """How often the loader section's int8 copies were rebuilt, as ``loader.json`` records it.

    NOTE: ``QuantizedSelection()`` refreshes every ``refresh_examples`` candidates by default,
    with ``refresh_every`` None. Reports saved before ``quantized_selection`` was recorded hold
    ``refresh_every`` alone, which printed as ``refresh_every=None`` for that default: 16,384
    candidates from commit 8cdbc3f (where ``refresh_examples`` came in) on."""
    settings = report.get("quantized_selection")
    if settings is None:
        every = report.get("refresh_every")
        if every is None:
            return "refreshed every 16384 candidates, the default then"
        return f"refreshed every {every} source batches"
    if settings.get("refresh_every") is not None:
        refresh = f"refreshed every {settings['refresh_every']} source batches"
    else:
        refresh = f"refreshed every {settings['refresh_examples']} candidates"
    return f"{refresh}, calibrated on {settings['calibration_examples']} candidates"


def loader_markdown(report: dict[str, Any]) -> str:
    """``loader.md`` from ``loader.json``'s contents."""
    machine, rows = report["machine"], report["rounds"]
    setting, m = report["config"]["setting"], report["config"]["measurement"]
    summary = rounds_summary(rows)
    rounds = summary[0]["rounds"]
    lines = [
        "# quantize_selection in the loader (benchmarks/quantized_selection.py --section loader)",
        "",
        f"Machine: {machine['cpu']}, torch {machine['torch']}, {report['threads']} intra-op "
        f"thread(s), sbloader {describe_commit(machine)}, {machine['date']}. Breakdown CNN "
        f"(channels_last), {m['examples']} Fashion-MNIST examples per epoch from a DataLoader, "
        f"training batch {setting['batch_size']}, source batch {setting['pool_batch_size']} for "
        f"SB and Stale-SB (keep {m['selectivity']:.3g}, staleness {m['staleness']}); "
        f"quantize_selection=True ({refresh_setting(report)}); medians of "
        f"{rounds} rounds, the ways interleaved within each round. c: selection seconds per "
        "selection forward (refreshes included) over training seconds per backpropagated "
        "example, from the loader's stats in the measured epochs; bound: 1.1 x (c x selection "
        "forwards per seen example + k), as a fraction of Traditional's epoch in the same round; "
        "within: rounds whose epoch was within its own bound.",
        "",
        "| way | epoch [s] | c | c without refreshes | k | refreshes / epoch | "
        "epoch / Traditional | bound | epoch / bound | within |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    f = cell

    for r in summary:
        within = "" if "within_rounds" not in r else f"{r['within_rounds']} of {r['rounds']}"
        lines.append(
            f"| {r['way']} | {r['wall_s']:.2f} | {f(r, 'c')} | {f(r, 'c_without_refresh')} | "
            f"{f(r, 'k')} | {f(r, 'refreshes', '.1f')} | {f(r, 'ratio')} | {f(r, 'bound')} | "
            f"{f(r, 'epoch_over_bound')} | {within} |"
        )
    lines += [
        "",
        "Per round:",
        "",
        "| round | way | epoch [s] | c | k | epoch / Traditional | bound |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['round'] + 1} | {r['way']} | {r['wall_s']:.2f} | {f(r, 'c')} | {f(r, 'k')} | "
            f"{f(r, 'ratio')} | {f(r, 'bound')} |"
        )
    return "\n".join(lines) + "\n"


def loader_section(args: argparse.Namespace) -> None:
    path = args.out / "loader.json"
    if args.report_only:
        report = json.loads(path.read_text())
    else:
        cfg, m = measurement(True, examples=args.examples)
        x, y = train_set(cfg)
        x, y = x[: m.examples].contiguous(), y[: m.examples].contiguous()
        rows = loader_epochs(cfg, m, x, y, args.rounds)
        report = {
            "threads": torch.get_num_threads(),
            "machine": machine_info(exclude=args.out),
            "config": {"setting": dataclasses.asdict(cfg), "measurement": dataclasses.asdict(m)},
            # The settings quantize_selection=True runs with (LOADER_WAYS).
            "quantized_selection": dataclasses.asdict(sbloader.QuantizedSelection()),
            "rounds": rows,
        }
    report["summary"] = rounds_summary(report["rounds"])
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    text = loader_markdown(report)
    (args.out / "loader.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--train-examples", type=int, default=6_400, help="partial training")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--section",
        choices=("forwards", "loader"),
        default="forwards",
        help="forwards: the ways of running the selection forward (quantized.md); loader: "
        "quantize_selection= in training epochs (loader.md)",
    )
    p.add_argument("--examples", type=int, default=None, help="loader: examples per epoch")
    p.add_argument(
        "--report-only", action="store_true", help="loader: rebuild loader.md from loader.json"
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.section == "loader":
        loader_section(args)
        return 0
    cfg, m = measurement(True)
    cfg = dataclasses.replace(cfg, channels_last=True)
    x, y = train_set(cfg)
    fmt = torch.channels_last
    # Partly trained: SGD over the first train_examples, the breakdown's model and step.
    # Module.to takes memory_format at run time; torch's stub overloads leave it out.
    model = seeded_model(cfg, m.seed).to(memory_format=fmt)  # type: ignore[call-overload]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    t0 = time.perf_counter()
    for i in range(0, args.train_examples, cfg.batch_size):
        xb = x[i : i + cfg.batch_size].contiguous(memory_format=fmt)
        loss = nn.functional.cross_entropy(model(xb), y[i : i + cfg.batch_size])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"trained on {args.train_examples} examples in {time.perf_counter() - t0:.1f}s")
    model.eval()
    # Held-out real batches (after the training prefix) for ranking; the breakdown's pool size.
    n = m.option_batches * cfg.pool_batch_size
    start = args.train_examples
    xh, yh = x[start : start + n].contiguous(memory_format=fmt), y[start : start + n]
    chunks = [(xh[i : i + 512], yh[i : i + 512]) for i in range(0, len(yh), 512)]
    if not chunks:
        raise ValueError(
            f"no held-out examples after --train-examples {args.train_examples} (the data has "
            f"{len(y)}); pass a smaller --train-examples"
        )
    calib = x[start + n : start + n + 512].contiguous()
    ways = [
        Way("fp32", model, chunks),
        Way("bf16", model, chunks, bf16=True),
        Way("bf16 + compile", model, chunks, bf16=True, compile=True),
        Way("int8 dynamic (Linear)", model, chunks, build=dynamic_int8, calib=calib),
        Way("int8 static FX (conv + Linear)", model, chunks, build=static_int8, calib=calib),
        *(
            Way(
                f"quantize_selection, calibration_examples={n}",
                model,
                chunks,
                build=library_int8(n),
                calib=calib,
            )
            for n in (64, 128, 256)
        ),
    ]
    try:
        ways.append(
            Way(
                "int8 static FX + compile",
                model,
                chunks,
                compile=True,
                build=static_int8,
                calib=calib,
            )
        )
    except Exception as e:  # report, do not fail: compile support for quantized ops varies
        print(f"int8 static FX + compile: not measured ({type(e).__name__}: {e})"[:300])
    reference = torch.cat([ways[0].losses(a, b) for a, b in chunks]).numpy()
    train = TrainingStep(x, y, cfg, m.seed, True, n // cfg.batch_size)
    rows: list[dict[str, Any]] = []
    for way in ways:
        pairs = [(train.run(), way.run()) for _ in range(args.rounds)]
        losses = torch.cat([way.losses(a, b) for a, b in chunks]).numpy()
        row = {
            "way": way.name,
            "c": median(s / t for t, s in pairs),
            "selection_us_per_example": 1e6 * median(s for _, s in pairs),
            "train_us_per_example": 1e6 * median(t for t, _ in pairs),
            "spearman_vs_fp32": spearman(losses, reference),
            "top_third_overlap_vs_fp32": top_overlap(losses, reference),
            "refresh_s": way.refresh_s,
            "warmup_s": way.warmup_s,
        }
        rows.append(row)
        refresh = "" if way.refresh_s is None else f"  refresh {way.refresh_s * 1e3:.0f} ms"
        print(
            f"{way.name:34s} c = {row['c']:.3f}  ({row['selection_us_per_example']:.1f} "
            f"us/example)  rho = {row['spearman_vs_fp32']:.4f}  top-third overlap "
            f"{row['top_third_overlap_vs_fp32']:.3f}{refresh}",
            flush=True,
        )
    machine = machine_info(exclude=args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    # NOTE: what was measured, with the results: the partial training, the held-out batches
    # ranked and the rounds timed (the markdown says them; the JSON held none of them).
    config = {
        "setting": dataclasses.asdict(cfg),
        "measurement": dataclasses.asdict(m),
        "train_examples": args.train_examples,
        "held_out_examples": len(yh),
        "selection_batch": 512,
        "calibration_examples": len(calib),
        "rounds": args.rounds,
    }
    record = {"threads": torch.get_num_threads(), "machine": machine, "config": config}
    (args.out / "quantized.json").write_text(json.dumps(record | {"rows": rows}, indent=1))
    lines = [
        "# Quantized selection on the CPU (benchmarks/quantized_selection.py)",
        "",
        f"Machine: {machine['cpu']}, torch {machine['torch']}, {torch.get_num_threads()} "
        f"intra-op thread(s), sbloader {describe_commit(machine)}, {machine['date']}. "
        f"Breakdown CNN (channels_last) trained on {args.train_examples} Fashion-MNIST "
        f"examples; {len(yh)} held-out examples in selection batches of 512; c against a training "
        f"step of batch {cfg.batch_size}, median of {args.rounds} alternating rounds.",
        "",
        "| selection forward | c | us/example | Spearman vs fp32 | top-third overlap | "
        "refresh [ms] |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        refresh = "" if r["refresh_s"] is None else f"{1e3 * r['refresh_s']:.0f}"
        lines.append(
            f"| {r['way']} | {r['c']:.3f} | {r['selection_us_per_example']:.1f} | "
            f"{r['spearman_vs_fp32']:.4f} | {r['top_third_overlap_vs_fp32']:.3f} | {refresh} |"
        )
    (args.out / "quantized.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
