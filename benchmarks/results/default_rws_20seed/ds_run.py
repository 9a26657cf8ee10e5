"""Designed experiment (not a library feature): the default as a user gets it, with SB's
``reweight`` (1/P weights) in its first *stale* epoch on purpose, and the normalisation to mean 1
per batch carried through to the next epoch's first batch (which holds the rows kept last and
carried over). Registered as ``default_rws_fb``; see NOTE.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

from benchmarks.core import strategies as S
from sbloader.policies import Phased, RandomBackprop, SelectiveBackprop


class FirstStaleEpochReweighted(SelectiveBackprop):
    """The default's Stale-SB, weighting its kept examples by 1/P in its first stale epoch.

    ``Phased`` numbers the wrapped policy's epochs from the end of the warm-up: inner epoch 0 is
    the run's epoch 1 (the selection pass), inner epoch 1 its epoch 2 (the first stale one).
    Batches are normalised to mean weight 1 in inner epochs 1 and 2: in epoch 2 the weighted
    batches themselves, in epoch 3 its first batch, which holds the rows carried from epoch 2
    (weights 1/P) beside new ones (weights 1)."""

    def begin_epoch(self, epoch: int) -> None:
        super().begin_epoch(epoch)
        self._inner = epoch
        self.reweight = epoch == 1

    def normalize_weights(self) -> bool:
        return getattr(self, "_inner", 0) in (1, 2)


def make(planned):
    return Phased(
        FirstStaleEpochReweighted(1 / 3, staleness=3, fed_staleness=10, drift_bound=0.5),
        warmup_epochs=1,
        warmup_policy=RandomBackprop(1 / 3),
    )


S.run_variant("default_rws_fb", make)
