#!/usr/bin/env bash
# A/B on the GPU: the library at 5167c93 (.oldlib) against the working tree, same seed, same families.
set -u
out=$1
export SBLOADER_FASHION_MNIST=$PWD/.data/fashion-mnist PYTHONUNBUFFERED=1
F="random_0.33:10 recipe_anneal_fb:10 traditional:2,10"
w=$(mktemp -d)
root=$PWD
(cd .oldlib && PYTHONPATH=$PWD timeout 150 python3 benchmarks/run.py --preset gpu_frontier --families $F --seeds 0 --out $w/old > $out/old.log 2>&1; echo "rc $?" >> $out/old.log)
PYTHONPATH=$root timeout 150 python3 benchmarks/run.py --preset gpu_frontier --families $F --seeds 0 --out $w/new > $out/new.log 2>&1; echo "rc $?" >> $out/new.log
tar czf $out/ab.tgz -C $w old new
for f in $out/old.log $out/new.log; do echo "== $f"; tr '\r' '\n' < $f | grep "final error"; done
