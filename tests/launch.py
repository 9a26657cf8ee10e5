"""Run test processes on several CPU ranks under a deadline: a scenario script with torchrun, or
a function spawned by torch.multiprocessing; either way each rank's result comes back pickled.
A rank ends its process group with :func:`end_process_group` and leaves with :func:`leave`."""

from __future__ import annotations

import gc
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def torchrun_ranks(
    script: str, out: Path, deadline_s: int, processes: int = 2, args: tuple[str, ...] = ()
) -> list[dict]:
    """Run ``tests/<script> OUT *args`` on ``processes`` processes; what each wrote to
    ``OUT/<rank>.pkl``, by rank. A run past ``deadline_s`` fails the test as a hang."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={processes}", str(ROOT / "tests" / script), str(out), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=deadline_s, cwd=ROOT, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} on {processes} processes ran past {deadline_s} s: a hang")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [pickle.loads((out / f"{r}.pkl").read_bytes()) for r in range(processes)]


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (its work and I/O loops) that are running."""
    names = []
    for task in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(task.read_text().strip())
        except OSError:  # a thread that ended meanwhile
            continue
    return sorted(n for n in names if "gloo" in n)


def end_process_group() -> list[str]:
    """Destroy the default process group and free what is left of it, so that gloo joins its
    worker threads now, while the interpreter is alive; the gloo threads still running after
    (none when nothing else holds the group).

    NOTE (why a rank must not reach interpreter exit with gloo's workers alive): a gloo worker
    thread drops its reference to a finished collective only after the caller's ``wait()`` has
    returned. When the work owns Python objects (a tensor whose Python object the caller already
    dropped, or the Python context torch stashes in the thread-local state that a collective
    issued during ``backward()`` captures; a barrier also keeps the works still in progress when
    it was issued, so they chain), releasing it takes the GIL. If the interpreter is finalizing
    by then, CPython ends the thread with ``pthread_exit``, whose unwinding through gloo's
    ``noexcept`` destructor calls ``std::terminate``: "terminate called without an active
    exception", SIGABRT, and torchrun's ``ChildFailedError``. The window is short, so it shows
    only when the worker waits for the CPU (one core, a loaded machine). This is torch's own bug
    (pytorch/pytorch#190489, and #179291, an abandoned fix that destroyed the groups at exit).
    Only freeing the group joins the workers: ``destroy_process_group`` (its ``shutdown``) does
    not while anything else still holds the group, and torch itself does, after the objects are
    gone: a model once wrapped in DistributedDataParallel (torch 2.13) or sharded by
    ``fully_shard`` (its DTensor caches) keeps it. So such a rank leaves with :func:`leave`.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # (models and loaders in reference cycles still hold the group)
    return gloo_threads()


def leave(threads: list[str]) -> None:
    """End a rank whose results are written: normally, or, where gloo's workers outlived its
    process group (``threads``, from :func:`end_process_group`), without finalizing the
    interpreter (``os._exit(0)`` after flushing), which would race them (see there).
    """
    if threads:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def free_port() -> int:
    """A free TCP port on the loopback address, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    nprocs: int,
    out: Path,
    deadline_s: int,
    what: str,
) -> list[Any]:
    """Spawn ``fn(rank, *args)`` on ``nprocs`` processes; what each wrote to ``out/<rank>.pkl``,
    by rank. A run past ``deadline_s`` fails the test as a hang (and its processes are killed:
    only those this call started)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} ran past {deadline_s} s: a hang")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return [pickle.loads((out / f"{r}.pkl").read_bytes()) for r in range(nprocs)]


class NegativeLoss:
    """Per-example cross-entropy less a baseline of 100 from its second call on rank 1 only (a
    loss relative to a baseline): Kath18 refuses the negative losses in its decision (after the
    round's selection forwards); shared by the DDP and FSDP scenarios."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        losses = F.cross_entropy(outputs, targets, reduction="none")
        return losses - 100.0 if self.rank == 1 and self.calls >= 2 else losses
