"""SelectiveLoader's throughput with a trivial model against the raw source's (section 3 of
``breakdown.py``, and all of ``throughput.py``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

import sbloader

from .config import Config, Measurement
from .sources import Sources
from .timing import median


def throughput(
    cfg: Config, m: Measurement, sources: Sources, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Examples per second: the raw source against SelectiveLoader with a trivial model and a
    training loop that does nothing (Traditional: yielded examples; SB: candidates consumed),
    an epoch of each in turn, the ratio taken per pair (``m.throughput_epochs`` pairs per
    measurement, ``m.repeats`` measurements; medians).

    A DataLoader source is measured with the next batch fetched on demand and fetched ahead on
    a thread (``prefetch=1``; the in-memory dataset draws no global randomness); FFCV fetches
    ahead itself.

    NOTE: SB runs a selection forward of the model on every candidate, which no raw source does;
    even the trivial model's (one linear layer) costs about as much as reading the batch from
    FFCV on a CPU. So each row also gives the ratio without the selection forwards' time (the
    loader's own overhead) and that time's share of the loader's time."""

    def trivial() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(cfg.image_size**2, 10)).to(cfg.device)

    configs = [
        (kind, strategy, bs, prefetch)
        for kind in sources.kinds()
        for strategy, bs in (("traditional", cfg.batch_size), ("sb", cfg.pool_batch_size))
        for prefetch in ((0, 1) if kind == "dataloader" else (0,))
    ]
    measured: dict[tuple[str, str, int, int], list[tuple[float, float, float, float]]] = {
        c: [] for c in configs
    }
    for rep in range(m.repeats):
        for kind, strategy, bs, prefetch in configs:
            source = sources.make(kind, bs, m.seed + rep)
            loader = sbloader.SelectiveLoader(
                source,
                trivial(),
                policy=m.policy(strategy),
                batch_size=cfg.batch_size,
                prefetch=prefetch,
            )
            raw_epoch(source, m.warmup_batches)  # warm-ups
            for i, _ in enumerate(loader):
                if i >= m.warmup_batches:
                    break
            # NOTE: the raw source and the loader alternate epoch by epoch, each pair's ratio
            # taken: on this shared machine the raw DataLoader's own rate swung between about
            # 250k and 430k examples a second from one epoch to the next, and a ratio of a raw
            # measurement and a loader measurement taken a minute apart was as noisy as that.
            for _ in range(m.throughput_epochs):
                raw = raw_epoch(source)
                t0 = time.perf_counter()
                for _ in loader:
                    pass
                elapsed = time.perf_counter() - t0
                current = loader.stats.current
                assert current is not None  # the epoch just iterated
                seen = current.examples_seen
                forward = current.selection_forward_s
                measured[kind, strategy, bs, prefetch].append(
                    (raw, seen / elapsed, seen / max(elapsed - forward, 1e-9), forward / elapsed)
                )
    rows = []
    for (kind, strategy, bs, prefetch), pairs in measured.items():
        row = {
            "source": kind,
            "strategy": strategy,
            "source_batch": bs,
            "prefetch": prefetch,
            "raw_examples_per_s": median(p[0] for p in pairs),
            "loader_examples_per_s": median(p[1] for p in pairs),
            "ratio": median(p[1] / p[0] for p in pairs),  # paired: measured back to back
            # The loader's own overhead: its rate without the selection forwards' time (the
            # trivial model's, which SB runs by definition), and that time's share.
            "ratio_without_forward": median(p[2] / p[0] for p in pairs),
            "forward_share": median(p[3] for p in pairs),
        }
        rows.append(row)
        log(
            f"{kind:10s} {strategy:12s} prefetch {prefetch} raw "
            f"{row['raw_examples_per_s']:9.0f}/s  loader "
            f"{row['loader_examples_per_s']:9.0f}/s  ratio {row['ratio']:.3f} (without the "
            f"selection forwards {row['ratio_without_forward']:.3f})"
        )
    return rows


def raw_epoch(source: Any, limit: int | None = None) -> float:
    """Examples per second of one epoch of the source itself (its first ``limit + 1`` batches,
    a warm-up, where ``limit`` is given, as the loader's warm-up reads; FFCV: threads restored
    after)."""

    guard: Any = contextlib.nullcontext()
    if not isinstance(source, DataLoader):
        import sbloader.ffcv as sbffcv

        guard = sbffcv.preserved_threads()
    with guard:
        seen, t0 = 0, time.perf_counter()
        for i, batch in enumerate(source):
            seen += len(batch[0])
            if limit is not None and i >= limit:
                break
        return seen / (time.perf_counter() - t0)
