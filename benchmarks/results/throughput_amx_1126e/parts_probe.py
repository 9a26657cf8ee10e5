"""Where a batch's time goes in SelectiveLoader's epoch iterator (this folder's NOTE.md).

Times the epoch iterator's steps with perf_counter_ns wrappers (their own cost included) over
an epoch of the trivial model, after a warm-up, beside the raw source's own epoch:

    taskset -c 0 python3 benchmarks/results/throughput_amx_1126e/parts_probe.py ffcv traditional
    (sources: dataloader, ffcv; strategies: traditional, sb, stale_sb)
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from torch import nn

import sbloader
import sbloader.epoch as E
from benchmarks.core.config import measurement
from benchmarks.core.data import train_set
from benchmarks.core.sources import Sources
from benchmarks.core.throughput import raw_epoch

total: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def wrap(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` with a timed wrapper (this probe's process only)."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            total[label] += time.perf_counter_ns() - t
            calls[label] += 1

    setattr(owner, name, timed)


def main() -> None:
    kind, strategy = sys.argv[1], sys.argv[2]
    for name in ("__next__", "_load", "_take", "_build", "_next_ready", "_source_step"):
        wrap(E.EpochIterator, name, name)
    cfg, m = measurement(False)
    x, y = train_set(cfg)
    sources = Sources(x, y, cfg.device, kind == "ffcv", 1)
    bs = cfg.batch_size if strategy == "traditional" else cfg.pool_batch_size
    source = sources.make(kind, bs, 0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(cfg.image_size**2, 10))
    policy = m.policy(strategy)
    loader = sbloader.SelectiveLoader(source, model, policy=policy, batch_size=cfg.batch_size)
    for name in ("columns", "build"):
        wrap(loader._codec, name, "codec." + name)
    for i, _ in enumerate(loader):
        if i >= 8:
            break
    for _ in range(3):
        total.clear()
        calls.clear()
        raw = raw_epoch(source)
        t0 = time.perf_counter()
        n = sum(1 for _ in loader)
        elapsed = time.perf_counter() - t0
        print(f"raw per batch {bs / raw * 1e6:.0f}us, loader per batch {elapsed / n * 1e6:.0f}us")
    print({k: round(v / max(calls[k], 1) / 1000, 1) for k, v in total.items()}, dict(calls))
    sources.close()


if __name__ == "__main__":
    main()
