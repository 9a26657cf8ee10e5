"""Run a scenario script on 2 CPU processes with torchrun, under a deadline."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

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
