"""Screen (not a library feature): the default whose selection passes keep each class at the
selectivity (P rescaled per class within each source batch); stale epochs unchanged."""

import sys

sys.path.insert(0, "/work/main")

import numpy as np

from benchmarks.core import strategies as S
from benchmarks.core.config import Config
from benchmarks.core.data import load_data
from sbloader.policies import Choice, Phased, RandomBackprop, SelectiveBackprop

LABELS = load_data(Config())[1].numpy()  # training labels by dataset index (no label noise)


class FreshClassBalanced(SelectiveBackprop):
    def choose(self, losses, indices, rng, n):
        if losses is None:
            return super().choose(losses, indices, rng, n)
        indices = np.asarray(indices, dtype=np.int64)
        losses = np.asarray(losses, dtype=np.float64)
        p = np.nan_to_num(self.window.push_and_rank(losses, self._cut_beta, self._cut), nan=0.0)
        y = LABELS[indices]
        q = p.copy()
        for c in np.unique(y):
            m = y == c
            mean = p[m].mean()
            q[m] = np.minimum(1.0, p[m] * self.target_rate / mean) if mean > 0 else self.target_rate
        pos = np.flatnonzero(rng.random(n) < q)
        finite = np.isfinite(losses)
        self.store.record(indices[finite], losses[finite], self._epoch)
        self.store.count_selected(indices[pos])
        return Choice(pos, q, np.ones(len(pos)))


def make(planned):
    return Phased(
        FreshClassBalanced(1 / 3, staleness=3, fed_staleness=10),
        warmup_epochs=1,
        warmup_policy=RandomBackprop(1 / 3),
    )


S.run_variant("default_cb_fb", make)
