#!/usr/bin/env bash
# Sets up everything sbloader needs on a fresh Debian machine (the project's CPU machine kind):
# Debian's Fashion-MNIST, the libraries ffcv builds against, a CPU build of torch, and sbloader
# itself with its development extras. Safe to run again: finished steps are skipped quickly.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

APT_PACKAGES="dataset-fashion-mnist pkg-config libturbojpeg0-dev libopencv-dev"
missing=""
for p in $APT_PACKAGES; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q $missing
fi

PIP="python3 -m pip install -q --disable-pip-version-check"
# NOTE: torch 2.13.0 resolves to the local CPU wheel here (seconds, ~200 MB). A bare "torch"
# would pull the CUDA build (~5.4 GB, ~90 s) that only runs on this CPU anyway; torchvision is
# not needed (sbloader reads Fashion-MNIST itself and defines its own models).
if ! python3 -c "import torch, sys; sys.exit(not torch.__version__.startswith('2.13.0'))" 2>/dev/null; then
  $PIP "torch==2.13.0"
fi
# NOTE: every later install is constrained to the torch, numpy, numba and llvmlite installed now,
# so that resolving sbloader's extras or ffcv's dependencies can never replace them.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
python3 -c "import importlib.metadata as m
for name in ('torch', 'numpy', 'numba', 'llvmlite'):
    try:
        print(f'{name}=={m.version(name)}')
    except m.PackageNotFoundError:
        pass" >"$constraints"
$PIP -c "$constraints" -e ".[dev,bench,frameworks]"

# FFCV (an optional, fast source; sbloader.ffcv). ffcv 1.0.2 builds from source (~15 s) against
# the apt libraries above.
if ! python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('ffcv') != '1.0.2')" 2>/dev/null; then
  python3 -c "import importlib.metadata as m
for name in ('numba', 'llvmlite'):
    print(f'{name}=={m.version(name)}')" >>"$constraints"
  $PIP -c "$constraints" "ffcv==1.0.2"
fi
