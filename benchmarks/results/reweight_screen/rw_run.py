"""Screen (not a library feature): the short recipe (``recipe_fb_int8``) with SB's ``reweight``
on: each kept example weighted by 1/P, normalised to mean 1 per yielded batch, so that the
classes' (and the easy examples') total weight stays near their share of the data while the
batches still hold the high-loss examples. Registered as ``recipe_rw_fb_int8``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

from benchmarks.core import strategies as S

base = S.REGISTRY["recipe_fb_int8"]


def make(planned):
    policy = base.make_policy(planned)
    policy.policy.reweight = True  # (the default policy's Stale-SB; the warm-up is unweighted)
    return policy


S.run_variant("recipe_rw_fb_int8", make, base="recipe_fb_int8")
