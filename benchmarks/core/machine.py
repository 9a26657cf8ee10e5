"""What every benchmark records with its results: the machine, the library versions, the commit
and whether the working tree had changes (``git_dirty``)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository


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


def _git(*args: str) -> str | None:
    """A git command's output in the repository, or None where git or the repository is absent."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def tree_changes(exclude: Path | str | None = None) -> list[str] | None:
    """``git status --porcelain`` lines of the repository (None without git): changed, staged
    and untracked files, leaving out those under ``exclude`` (a results folder being written)."""
    # NOTE: every untracked file, not its folder: git names a new folder alone, which a results
    # folder nested in it (holding an earlier run's files) would otherwise make count as a change.
    out = _git("status", "--porcelain", "--untracked-files=all")
    if out is None:
        return None
    skip = None if exclude is None else Path(exclude).resolve()
    lines = []
    for line in out.splitlines():
        path = (ROOT / line[3:].split(" -> ")[-1].strip('"')).resolve()
        if skip is not None and (path == skip or skip in path.parents):
            continue
        lines.append(line)
    return lines


def amx_tiles() -> bool | None:
    """Whether the CPU has AMX tile units (int8 and bf16 matrix products), or None where this
    torch cannot tell (its check is private: ``torch.cpu._is_amx_tile_supported``)."""
    import torch

    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return None if check is None else bool(check())


def machine_info(exclude: Path | str | None = None) -> dict[str, Any]:
    """Date (UTC), CPU, cores, threads, GPU, Python, platform, library versions, git commit,
    whether the tree had changes (``git_dirty``; None without git; files under ``exclude``, the
    results being written, do not count) and the first of those changes."""
    import torch

    import sbloader
    from sbloader.precision import native_bf16

    commit = (_git("rev-parse", "--short", "HEAD") or "").strip()
    changes = tree_changes(exclude)
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        # NOTE: "AMD EPYC" has named both an AVX512-BF16 and an AVX2-only machine of this
        # project's kind, 3.4x apart per training step: the vector ISA torch uses tells them apart.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16(torch.device("cpu")),
        # NOTE: a third CPU of this name (an Intel Xeon with AMX) computes int8 and bf16 matrix
        # products in tile units, and trains the benchmark CNN more slowly than the AVX512-BF16
        # AMD one: the selection's share of a training step differs, so their speedups do not
        # compare.
        "amx": amx_tiles(),
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
        "sbloader": sbloader.__version__,
        # NOTE: the library that ran, which need not be this checkout's (an editable install
        # elsewhere wins when the repository is not on sys.path).
        "sbloader_path": str(Path(sbloader.__file__).resolve().parent),
        "git_commit": commit,
        "git_dirty": None if changes is None else bool(changes),
        "git_changes": None if changes is None else changes[:50],
    }


def describe_commit(machine: dict[str, Any]) -> str:
    """``commit abc1234`` with ``, with uncommitted changes`` when the tree was dirty."""
    commit = machine.get("git_commit") or "?"
    dirty = machine.get("git_dirty")
    return f"commit {commit}" + (", with uncommitted changes" if dirty else "")
