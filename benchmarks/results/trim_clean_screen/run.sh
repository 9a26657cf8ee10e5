#!/bin/bash
# The clean-label trim screen: run.sh OUT CORE SEED:REFERENCE, from the repository root; one seed
# on one core, its runs interleaved. REFERENCE: Traditional-10's final error of that seed on this
# machine kind (measured in an earlier sitting: the runs are deterministic).
out=$1; core=$2; arg=$3
seed=${arg%%:*}
taskset -c "$core" python3 benchmarks/results/trim_clean_screen/tr_run.py --preset frontier \
  --strategies traditional_e2 --families traditional:2,3 random_0.33:3,5,10 recipe_fb_int8:2,3,5 \
  recipe_trim10_fb_int8:2,3,5 --seeds "$seed" --threads 1 --reference-error "$arg" \
  --out "$out/s$seed" > "$out/s$seed.log" 2>&1
