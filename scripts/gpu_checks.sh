#!/usr/bin/env bash
# One call on a lent GPU (the device tool's `run`), everything a session measures there, in the
# order of what matters most if time runs out: the CUDA tests, the GPU breakdown with the
# selection costs (issue 14), then one seed of the GPU frontier (issue 12).
#
#   bash scripts/gpu_checks.sh OUT [SECONDS] [SEED]
#
# Run from the repository root with Fashion-MNIST's four files in .data/fashion-mnist (carried:
# the GPU machine has no registry and no Debian dataset). Each step gets what is left of
# SECONDS (default 585), so the call ends inside the device tool's 600 s limit; results are
# packed into at most six files under OUT (the tool returns eight at most). On an H200 the three
# steps took 6 minutes, on an H100 6 min 50 s (2026-11-26); the other seeds of the frontier then
# fit a second call on the still-warm machine: `python3 benchmarks/run.py --preset gpu_frontier --seeds 1 2` (5 min),
# merged afterwards with `--report-only --seeds 0 1 2` over the runs of both.
set -u
out=${1:?usage: gpu_checks.sh OUT [SECONDS] [SEED]}
budget=${2:-585}
seed=${3:-0}
end=$(($(date +%s) + budget))
left() { echo $((end - $(date +%s))); }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SBLOADER_FASHION_MNIST="${SBLOADER_FASHION_MNIST:-.data/fashion-mnist}"
work=$(mktemp -d)
mkdir -p "$out"
{
    date -u
    git log --oneline -1 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch, numba, numpy; print(sys.version.split()[0], torch.__version__, torch.version.cuda, numba.__version__, numpy.__version__)"
} >"$out/machine.log" 2>&1

# 1. The CUDA tests (skipped on machines without a GPU, so CI never runs them).
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py \
    "tests/test_robustness.py::test_a_cuda_device_this_machine_lacks_is_refused_naming_it" \
    >"$out/cuda_tests.log" 2>&1
echo "rc $? at $(date -u +%T)" >>"$out/cuda_tests.log"

# 2. Where a GPU epoch goes (7 rows, medians of 3), c for each selection option, and a profile
#    of an SB and a Stale-SB epoch (where the loader's own share goes).
timeout $(($(left) > 220 ? 220 : $(left))) python3 benchmarks/breakdown.py "$work/breakdown" \
    --gpu --no-ffcv --sections breakdown selection profile --repeats 3 >"$out/breakdown.log" 2>&1
echo "rc $? at $(date -u +%T)" >>"$out/breakdown.log"
tar czf "$out/breakdown.tgz" -C "$work" breakdown 2>/dev/null

# 3. One seed of the frontier: every family's runs trained interleaved (about 4 min on an H100).
timeout $(($(left) - 10)) python3 benchmarks/run.py --preset gpu_frontier --seeds "$seed" \
    --out "$work/frontier" >"$out/frontier.log" 2>&1
echo "rc $? at $(date -u +%T)" >>"$out/frontier.log"
tar czf "$out/frontier.tgz" -C "$work" frontier 2>/dev/null
echo "done at $(date -u +%T), $(left) s of $budget left" >>"$out/machine.log"
