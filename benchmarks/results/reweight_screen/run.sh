#!/bin/bash
# The reweight screen: run.sh OUT SEED:REFERENCE ..., from the repository root; the seeds one
# after another on core 0, each seed's runs interleaved. REFERENCE: Traditional-10's final error
# of that seed on this machine (measured in an earlier sitting: the runs are deterministic).
out=$1; shift
for arg in "$@"; do
  seed=${arg%%:*}
  taskset -c 0 nice -n -10 python3 benchmarks/results/reweight_screen/rw_run.py --preset frontier \
    --strategies traditional_e2 --families traditional:2 random_0.33:3,5,10 recipe_fb_int8:2,3,5 \
    recipe_rw_fb_int8:2,3,5 --seeds "$seed" --threads 1 --reference-error "$arg" \
    --out "$out/s$seed" > "$out/s$seed.log" 2>&1
done
