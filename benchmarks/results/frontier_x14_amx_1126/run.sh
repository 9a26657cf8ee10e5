#!/bin/bash
# The x1.2/x1.4 sitting: short budgets only, Traditional-10's final error per seed as reference
# (deterministic: 7.60/7.29/7.62% in both AMX sittings of 2026-11-26).
core=$1; shift
for pair in "$@"; do
  seed=${pair%%:*}; ref=${pair##*:}
  PYTHONPATH=/work/wt_bench taskset -c $core nice -n -10 python3 /work/wt_bench/benchmarks/run.py --preset frontier \
    --strategies traditional_e2 --families traditional:2,3,4 random_0.33:3,5,10 recipe_fb_int8:2,3,5 \
    --seeds $seed --threads 1 --reference-error $ref --out /work/bench_x14/s$seed > /work/bench_x14/s$seed.log 2>&1
done
