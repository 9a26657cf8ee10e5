"""Screen (not a library feature): the default as a user gets it, with SB's ``reweight`` (1/P
weights, normalised to mean 1 per batch) in its first selective epoch only (epoch 1, after the
Random-Backprop warm-up), unweighted from epoch 2 on. Registered as ``default_rw1_fb``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

from benchmarks.core import strategies as S
from sbloader.policies import Phased, RandomBackprop, SelectiveBackprop


class FirstEpochReweighted(SelectiveBackprop):
    """The default's Stale-SB, weighting its kept examples by 1/P in epoch 1 only."""

    def begin_epoch(self, epoch: int) -> None:
        super().begin_epoch(epoch)
        self.reweight = epoch == 1


def make(planned):
    return Phased(
        FirstEpochReweighted(1 / 3, staleness=3, fed_staleness=10, drift_bound=0.5),
        warmup_epochs=1,
        warmup_policy=RandomBackprop(1 / 3),
    )


S.run_variant("default_rw1_fb", make)
