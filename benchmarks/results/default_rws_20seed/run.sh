#!/bin/bash
# run.sh CORE OUT SEED ...: from the repository root, seeds one after another on core CORE.
core=$1; out=$2; shift 2
for seed in "$@"; do
  taskset -c "$core" nice -n -10 python3 benchmarks/results/default_rws_20seed/ds_run.py \
    --preset default_safety --strategies random_0.33 default_fb default_rws_fb \
    --seeds "$seed" --threads 1 --out "$out/s$seed" > "$out/s$seed.log" 2>&1
done
