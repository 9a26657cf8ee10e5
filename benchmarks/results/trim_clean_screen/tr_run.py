"""Screen (not a library feature): the short recipe (``recipe_fb_int8``) never keeping the 10%
highest losses (``default_policy(trim_top=0.1)``) on clean labels, for the loosest target. The
first loss-ranked epoch raises the test error (its kept examples crowd into the hard classes);
the hardest tenth is where that crowding is largest. Registered as
``recipe_trim10_fb_int8``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

import sbloader
from benchmarks.core import strategies as S

S.run_variant(
    "recipe_trim10_fb_int8",
    lambda planned: sbloader.default_policy(trim_top=0.1),
    base="recipe_fb_int8",
)
