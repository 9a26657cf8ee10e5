"""How fast and how big is the per-example store at 10^6, 10^7 and 10^8 examples?

For each size N and backing (in memory, memory-mapped files), measures on this machine:

- **update rate** of ``ExampleStore.record``, ``lookup`` and ``count_selected`` in losses (or
  indices) per second, for batches of uniformly random dataset indices (the worst case for the
  caches: every index touches another page);
- **memory**: the store's ``nbytes`` (12 bytes per example) and the growth of the process's
  resident memory (RSS) after creating the store and after the timed updates (zeroed pages are
  mapped lazily, so a new store costs nothing until examples are scored; memory-mapped pages
  count in RSS while the kernel keeps them in the page cache).

Warm-up (numba compilation or cache load, first touches of the index arrays) is excluded: each
operation first runs ``warmup_calls`` untimed calls. Each rate is the median over ``repeats``
passes of ``calls`` calls. Writes ``store_scale.json`` and ``store_scale.md`` into the results
folder, with the machine and library versions.

    python3 benchmarks/store_scale.py results/store_scale            # ~15 s on 2 cores, 1.2 GB
    python3 benchmarks/store_scale.py results/store_scale --quick    # 10^6 and 10^7 only

The machine may be shared: timings from a busy machine are indicative only.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    # Run as a file: run this checkout's ``benchmarks.store_scale`` as ``python3 -m`` would from
    # the repository, so that this checkout's benchmarks and sbloader are the ones that run.
    import runpy
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("benchmarks.store_scale", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.core.machine import describe_commit, machine_info
from sbloader import ExampleStore

OPERATIONS = ("record", "lookup", "count_selected")


@dataclass
class Config:
    """The benchmark's settings. Units are in the comments."""

    sizes: tuple[int, ...] = (10**6, 10**7, 10**8)  # N [examples]
    backings: tuple[str, ...] = ("memory", "memmap")
    batch: int = 4096  # indices per call [examples]
    calls: int = 1000  # timed calls per pass [calls]
    warmup_calls: int = 20  # untimed calls before timing [calls]
    repeats: int = 3  # timed passes; the median is reported
    seed: int = 0
    memmap_dir: str | None = None  # where memory-mapped columns go (default: a temporary folder)


def rss_bytes() -> int | None:
    """The process's resident memory, or None where /proc is not available."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def run_operation(store: ExampleStore, op: str, indices: np.ndarray, losses: np.ndarray) -> None:
    """One call of ``op`` per row of ``indices``."""
    if op == "record":
        for idx, values in zip(indices, losses):
            store.record(idx, values, epoch=1)
    elif op == "lookup":
        for idx in indices:
            store.lookup(idx)
    else:
        for idx in indices:
            store.count_selected(idx)


def measure(cfg: Config, size: int, backing: str, folder: Path | None) -> dict[str, Any]:
    rng = np.random.default_rng(cfg.seed)
    indices = rng.integers(0, size, size=(cfg.calls, cfg.batch), dtype=np.int64)
    losses = rng.exponential(size=(cfg.calls, cfg.batch))
    warm_idx = rng.integers(0, size, size=(cfg.warmup_calls, cfg.batch), dtype=np.int64)
    warm_losses = rng.exponential(size=(cfg.warmup_calls, cfg.batch))
    gc.collect()
    rss0 = rss_bytes()
    store = ExampleStore(size, path=folder)
    rss_created = rss_bytes()
    rates: dict[str, float] = {}
    seconds: dict[str, list[float]] = {}
    for op in OPERATIONS:
        run_operation(store, op, warm_idx, warm_losses)  # warm-up: not timed
        times = []
        for _ in range(cfg.repeats):
            start = time.perf_counter()
            run_operation(store, op, indices, losses)
            times.append(time.perf_counter() - start)
        seconds[op] = times
        rates[op] = cfg.calls * cfg.batch / float(np.median(times))
    rss_after = rss_bytes()
    # The store still agrees with the last losses written (a sanity check, not timed).
    got, _ = store.lookup(indices[-1])
    last = {int(i): v for i, v in zip(indices[-1], losses[-1])}
    assert np.allclose(got, np.array([last[int(i)] for i in indices[-1]], dtype=np.float32))
    result = {
        "size": size,
        "backing": backing,
        "nbytes": store.nbytes,
        "bytes_per_example": store.nbytes / size,
        "rss_growth_created": None if rss0 is None or rss_created is None else rss_created - rss0,
        "rss_growth_after_updates": None if rss0 is None or rss_after is None else rss_after - rss0,
        "rate_per_s": rates,
        "seconds": seconds,
        "examples_per_pass": cfg.calls * cfg.batch,
    }
    del store
    gc.collect()
    return result


def mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.0f}"


def markdown(cfg: Config, machine: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [
        "# ExampleStore: update rate and memory",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, "
        f"numpy {machine['numpy']}, numba {machine['numba']} (JIT "
        f"{'on' if machine['numba_jit'] else 'off'}), sbloader {machine['sbloader']} "
        f"({describe_commit(machine)}), "
        f"{machine['date']}.",
        f"Batches of {cfg.batch} uniformly random indices; rates are the median of "
        f"{cfg.repeats} passes of {cfg.calls} calls, after {cfg.warmup_calls} untimed calls.",
        "",
        "| N | backing | nbytes (MiB) | bytes/example | RSS growth, created (MiB) | RSS growth, "
        "after updates (MiB) | record (M losses/s) | lookup (M/s) | count_selected (M/s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rate = r["rate_per_s"]
        lines.append(
            f"| 10^{round(np.log10(r['size']))} | {r['backing']} | {mib(r['nbytes'])} | "
            f"{r['bytes_per_example']:g} | {mib(r['rss_growth_created'])} | "
            f"{mib(r['rss_growth_after_updates'])} | {rate['record'] / 1e6:.1f} | "
            f"{rate['lookup'] / 1e6:.1f} | {rate['count_selected'] / 1e6:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="results folder (created)")
    parser.add_argument("--quick", action="store_true", help="only N = 10^6 and 10^7")
    parser.add_argument("--memmap-dir", default=None, help="folder for memory-mapped columns")
    args = parser.parse_args(argv)
    cfg = Config(memmap_dir=args.memmap_dir)
    if args.quick:
        cfg = dataclasses.replace(cfg, sizes=(10**6, 10**7))
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(exclude=args.out)
    # Load (or compile) the kernels before any memory is measured.
    warm = ExampleStore(8)
    run_operation(warm, "record", np.arange(8)[None], np.ones((1, 8)))
    for op in OPERATIONS[1:]:
        run_operation(warm, op, np.arange(8)[None], np.ones((1, 8)))
    results = []
    for size in cfg.sizes:
        for backing in cfg.backings:
            folder = None
            if backing == "memmap":
                folder = Path(tempfile.mkdtemp(prefix="sbloader-store-", dir=cfg.memmap_dir))
            try:
                r = measure(cfg, size, backing, folder)
            finally:
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
            results.append(r)
            print(
                f"N={size:.0e} {backing}: "
                + ", ".join(f"{op} {v / 1e6:.1f} M/s" for op, v in r["rate_per_s"].items()),
                file=sys.stderr,
            )
    report = {"config": dataclasses.asdict(cfg), "machine": machine, "results": results}
    (args.out / "store_scale.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(cfg, machine, results)
    (args.out / "store_scale.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
