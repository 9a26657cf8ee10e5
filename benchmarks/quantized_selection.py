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

    taskset -c 0 python3 benchmarks/quantized_selection.py results/quantized --threads 1
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

from benchmarks.breakdown import TrainingStep
from benchmarks.core.config import measurement
from benchmarks.core.data import train_set
from benchmarks.core.machine import describe_commit, machine_info
from benchmarks.core.models import seeded_model
from benchmarks.core.timing import median
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

    m = copy.deepcopy(model).eval().to(memory_format=torch.contiguous_format)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(m, get_default_qconfig_mapping("x86"), (calib[:2],))
        with torch.inference_mode():
            for i in range(0, len(calib), 128):
                prepared(calib[i : i + 128])
        return convert_fx(prepared)


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--train-examples", type=int, default=6_400, help="partial training")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, m = measurement(True)
    cfg = dataclasses.replace(cfg, channels_last=True)
    x, y = train_set(cfg)
    fmt = torch.channels_last
    # Partly trained: SGD over the first train_examples, the breakdown's model and step.
    model = seeded_model(cfg, m.seed).to(memory_format=fmt)
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
    chunks = [(xh[i : i + 512], yh[i : i + 512]) for i in range(0, n, 512)]
    calib = x[start + n : start + n + 512].contiguous()
    ways = [
        Way("fp32", model, chunks),
        Way("bf16", model, chunks, bf16=True),
        Way("bf16 + compile", model, chunks, bf16=True, compile=True),
        Way("int8 dynamic (Linear)", model, chunks, build=dynamic_int8, calib=calib),
        Way("int8 static FX (conv + Linear)", model, chunks, build=static_int8, calib=calib),
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
    (args.out / "quantized.json").write_text(
        json.dumps({"threads": torch.get_num_threads(), "machine": machine, "rows": rows}, indent=1)
    )
    lines = [
        "# Quantized selection on the CPU (benchmarks/quantized_selection.py)",
        "",
        f"Machine: {machine['cpu']}, torch {machine['torch']}, {torch.get_num_threads()} "
        f"intra-op thread(s), sbloader {describe_commit(machine)}, {machine['date']}. "
        f"Breakdown CNN (channels_last) trained on {args.train_examples} Fashion-MNIST "
        f"examples; {n} held-out examples in selection batches of 512; c against a training "
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
