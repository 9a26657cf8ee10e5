"""Run test processes on several CPU ranks under a deadline: a scenario script with torchrun, or
a function spawned by torch.multiprocessing; either way each rank's result comes back pickled."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[1]


def torchrun_ranks(script: str, out: Path, deadline_s: int, processes: int = 2) -> list[dict]:
    """Run ``tests/<script> OUT`` on ``processes`` processes; what each wrote to
    ``OUT/<rank>.pkl``, by rank. A run past ``deadline_s`` fails the test as a hang."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={processes}", str(ROOT / "tests" / script), str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=deadline_s, cwd=ROOT, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} on {processes} processes ran past {deadline_s} s: a hang")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [pickle.loads((out / f"{r}.pkl").read_bytes()) for r in range(processes)]


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
