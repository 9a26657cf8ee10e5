"""Screen (not a library feature): the annealed recipe with its learning rate keyed on the
examples backpropagated (``lr_by_backprops``) instead of the position in the data, registered as
``recipe_anneal_fb_int8_lrbp``; see NOTE.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

from benchmarks.core import strategies as S

S.run_variant("recipe_anneal_fb_int8_lrbp", base="recipe_anneal_fb_int8", lr_by_backprops=True)
