"""Screen (not a library feature): the default with no selection pass in its first selective
epoch, deciding from the warm-up's fed-back losses, unscored examples kept at the base rate.

Run from anywhere with the repository at /work/main (as measured), e.g.
``python3 ff_run.py --preset default_safety --strategies random_0.33 default_fb default_ff_fb
--seeds 3 --threads 1 --out OUT``.
"""

import sys

sys.path.insert(0, "/work/main")

import numpy as np

from benchmarks.core import strategies as S
from sbloader._random import hashed_uniforms
from sbloader.policies import Choice, Phased, RandomBackprop, SelectiveBackprop


class FeedFirst(SelectiveBackprop):
    def _due(self, epoch):
        if self._last_fresh is None and self._fed:
            return epoch >= self.fed_staleness
        return super()._due(epoch)

    def stale_probabilities(self, indices):
        stored, measured = self._stale_store().lookup(indices)
        p = self.window.rank(stored, self._cut_beta, self._cut)
        p[measured < 0] = self.target_rate
        return p

    def choose(self, losses, indices, rng, n):
        if losses is not None:
            return super().choose(losses, indices, rng, n)
        indices = np.asarray(indices, dtype=np.int64)
        p = self.stale_probabilities(indices)
        u = hashed_uniforms(self._key, self._epoch, indices)
        pos = np.flatnonzero(u < p)
        self.store.count_selected(indices[pos])
        return Choice(pos, p, np.ones(len(pos)))


def make(planned):
    return Phased(
        FeedFirst(1 / 3, staleness=3, fed_staleness=10, stale_cdf="store"),
        warmup_epochs=1,
        warmup_policy=RandomBackprop(1 / 3),
    )


S.run_variant("default_ff_fb", make)
