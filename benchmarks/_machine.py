"""What every benchmark records with its results: the machine and the library versions."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or the platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Date (UTC), CPU, cores, threads, GPU, Python, platform, library versions, git commit."""
    import torch

    import sbloader

    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "numba_jit": os.environ.get("NUMBA_DISABLE_JIT", "0") in ("", "0"),
        "ffcv": _version("ffcv"),
        "sbloader": sbloader.__version__,  # the tree that ran, installed or not
        "git_commit": commit,
    }
