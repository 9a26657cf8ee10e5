#!/bin/bash
# run.sh OUT SEED ...: from the repository root, seeds one after another on core 0.
out=$1; shift
for seed in "$@"; do
  taskset -c 0 nice -n -10 python3 benchmarks/results/default_rw1_screen/ds_run.py \
    --preset default_safety --strategies random_0.33 default_fb default_rw1_fb \
    --seeds "$seed" --threads 1 --out "$out/s$seed" > "$out/s$seed.log" 2>&1
done
