#!/bin/bash
# The x1.2/x1.4 sitting for three more seeds: short budgets, with Traditional-10 as the reference.
core=$1; shift
for seed in "$@"; do
  PYTHONPATH=/work/wt_ds taskset -c $core nice -n -10 python3 /work/wt_ds/benchmarks/run.py --preset frontier \
    --strategies traditional --families traditional:2,3,4 random_0.33:3,5,10 recipe_fb_int8:2,3,5 \
    --seeds $seed --threads 1 --out /work/bench_x14b/s$seed > /work/bench_x14b/s$seed.log 2>&1
done
