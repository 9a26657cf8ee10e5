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
requirements="$(mktemp)"
trap 'rm -f "$constraints" "$requirements"' EXIT
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

# mosaicml-streaming (sbloader.streaming; tests/test_streaming.py), with every dependency it
# declares but one. NOTE: 0.10.0 is the newest release that accepts numpy 2 (0.11 to 0.13 pin
# numpy<2.2). It declares torchvision, whose PyPI wheels do not import against this CPU-only torch
# ("operator torchvision::nms does not exist"), and an installed torchvision that fails to import
# breaks `import lightning` (through torchmetrics). So streaming itself is installed without
# resolving, then the requirements its own metadata declares, torchvision excepted, are installed
# (constrained like the rest). `import streaming` still imports torchvision: the tests put a
# placeholder for it on their path (tests/placeholders); with a working torchvision (a GPU
# machine's CUDA build) `pip install ".[streaming]"` is all a user needs.
if ! python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('mosaicml-streaming') != '0.10.0')" 2>/dev/null; then
  $PIP --no-deps "mosaicml-streaming==0.10.0"
fi
python3 -c "import importlib.metadata as m
from packaging.requirements import Requirement
for r in map(Requirement, m.requires('mosaicml-streaming') or []):
    if r.name != 'torchvision' and (r.marker is None or r.marker.evaluate({'extra': ''})):
        print(r)" >"$requirements"
$PIP -c "$constraints" -r "$requirements"
