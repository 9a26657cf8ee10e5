"""Screen (not a library feature): the short recipe (``recipe_fb_int8``) with SB's ``reweight``
on: each kept example weighted by 1/P, normalised to mean 1 per yielded batch, so that the
classes' (and the easy examples') total weight stays near their share of the data while the
batches still hold the high-loss examples. Registered as ``recipe_rw_fb_int8``."""

import dataclasses
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

from benchmarks.core import strategies as S

base = S.REGISTRY["recipe_fb_int8"]


def make(planned):
    policy = base.make_policy(planned)
    policy.policy.reweight = True  # (the default policy's Stale-SB; the warm-up is unweighted)
    return policy


S.REGISTRY["recipe_rw_fb_int8"] = dataclasses.replace(
    base, name="recipe_rw_fb_int8", family="recipe_rw_fb_int8", make_policy=make
)
sys.argv = ["benchmarks/run.py", *sys.argv[1:]]
runpy.run_module("benchmarks.run", run_name="__main__", alter_sys=True)
