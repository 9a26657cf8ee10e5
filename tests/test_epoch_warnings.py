"""The loader's epoch warnings as plain functions: the backlog decision over simulated ranks, and
each message naming its values and its fix. (The loader's saying them, once and at the caller's
line, is tested where each arises: tests/test_epoch.py, tests/test_distributed.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from sbloader._epoch_warnings import (
    backlog_warning,
    drifted_backlog,
    left_saved_warning,
    nothing_yielded_warning,
    peek_warning,
)

BATCH = 32
SHARE = 6000  # candidates per rank per epoch


def first_flagged(rates: list[float], epochs: int, seed: int) -> int | None:
    """The first epoch at which any of the ranks (one per keep rate in ``rates``, each scoring
    ``SHARE`` candidates an epoch) is flagged as drifting, or None: every rank yields as many
    whole batches as the one with the fewest selected has ready, and carries the rest."""
    rng = np.random.default_rng(seed)
    carried = np.zeros(len(rates), dtype=np.int64)
    selected = np.zeros(len(rates), dtype=np.int64)
    for epoch in range(epochs):
        kept = rng.binomial(SHARE, rates)
        selected += kept
        ready = carried + kept
        yielded = (int(ready.min()) // BATCH) * BATCH
        carried = ready - yielded
        for rank in range(len(rates)):
            if drifted_backlog(int(carried[rank]), BATCH, yielded, int(selected[rank])):
                return epoch
    return None


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ranks", [2, 8])
def test_ranks_that_differ_by_chance_are_never_flagged(ranks, seed):
    assert first_flagged([1 / 3] * ranks, epochs=100, seed=seed) is None


@pytest.mark.parametrize("seed", range(5))
def test_a_rank_that_selects_a_tenth_more_is_flagged_within_a_few_epochs(seed):
    epoch = first_flagged([1 / 3] * 7 + [1.1 / 3], epochs=100, seed=seed)
    assert epoch is not None and 3 <= epoch <= 12


def test_the_backlog_must_pass_four_batches_and_a_quarter_of_the_yield():
    selected = 1  # (the chance bound 12 * sqrt(selected) is then no obstacle)
    assert not drifted_backlog(4 * BATCH, BATCH, 0, selected)
    assert drifted_backlog(4 * BATCH + 1, BATCH, 0, selected)
    assert not drifted_backlog(1000, BATCH, 4000, selected)
    assert drifted_backlog(1001, BATCH, 4000, selected)
    assert not drifted_backlog(1200, BATCH, 0, 10_000)  # exactly at 12 * sqrt(10000)
    assert drifted_backlog(1201, BATCH, 0, 10_000)


def test_each_message_names_its_values_and_its_fix():
    assert "after 1 batch" in peek_warning(1, "Policy()") and "Policy()" in peek_warning(
        1, "Policy()"
    )
    assert "rest of epoch 2" in left_saved_warning(2, 3)
    assert "goes on with epoch 3" in left_saved_warning(2, 3)
    assert "end_epoch() was called after it was saved" in left_saved_warning(2, None)
    drop = nothing_yielded_warning(4, 20, 32, "drop", 1)
    assert "epoch 4 yielded no batch" in drop and "the 20 examples" in drop
    assert "remainder='carry'" in drop
    short = nothing_yielded_warning(4, 3, 32, "short", 8)
    assert "smaller min_batch_size" in short and "remainder='carry'" not in short
    backlog = backlog_warning(1, 4, 1500, 960, 6)
    assert backlog.startswith("rank 1 of 4 carries 1500 selected examples into epoch 7")
    assert "DistributedSampler" in backlog
