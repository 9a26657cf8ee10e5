"""Selection passes under torch's FSDP (FullyShardedDataParallel and fully_shard) on 2 CPU
processes (gloo): every rank runs the same number of selection forwards, each a collective.

tests/fsdp_scenarios.py runs under torchrun once, under a deadline (a collective mismatch
between the ranks would hang); the tests compare its ranks.
"""

from __future__ import annotations

import pytest
from launch import torchrun_ranks
from torch import nn

from sbloader.scoring import Scorer
from sbloader.selection import SelectionForward, is_fsdp

KINDS = ("FullyShardedDataParallel", "fully_shard")
#: Seconds the 2-process run may take before it fails as a hang (about 30 s alone on one core).
DEADLINE_S = 300

pytestmark = pytest.mark.timeout(DEADLINE_S + 60)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return torchrun_ranks("fsdp_scenarios.py", tmp_path_factory.mktemp("fsdp"), DEADLINE_S)


@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_runs_as_many_selection_forwards(ranks, kind):
    r0, r1 = (r[kind] for r in ranks)
    # The ranks' own chunk counts differ (uneven sources, stale epochs without any)...
    assert r0["selection_calls"] != r1["selection_calls"]
    assert r0["selection_calls"][0] == r0["selection_calls"][2] == 0  # warm-up, stale epoch
    # ...but each rank ran the busiest rank's number of sharded forwards: its own chunks, the
    # warm-up's check of the first batch (two sizes: two forwards), and padding.
    assert r0["calls"]["selection"] == r1["calls"]["selection"]
    assert r0["calls"]["selection"] == sum(r0["selection_calls"]) + 2


@pytest.mark.parametrize("kind", KINDS)
def test_training_after_selection_passes_works_and_steps_agree(ranks, kind):
    """Under inference_mode an FSDP selection forward breaks the next training forward; the
    selection passes of a sharded model run under no_grad."""
    r0, r1 = (r[kind] for r in ranks)
    assert r0["steps"] == r1["steps"] and all(r0["steps"])
    assert r0["calls"]["training"] == sum(r0["steps"])
    assert r0["params_finite"] and r1["params_finite"]


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_without_distributed_lockstep_is_refused(ranks, kind):
    for r in ranks:
        assert "distributed=True" in r[kind]["refused"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_resumed_after_any_batch_yields_the_uninterrupted_runs_batches(ranks, kind):
    """A resumed loader has scored nothing yet: where its first round probes the model on one
    rank and another rank's (filtered) source has ended, the ranks skip the probe together
    instead of refusing the round (RuntimeError 'a rank had no candidate yet')."""
    for r in ranks:
        assert len(r[kind]["resumes"]) > 4
        assert all(r[kind]["resumes"]), r[kind]["resumes"]


def test_a_plain_model_is_no_collective_and_chunks_are_counted_as_run():
    assert not is_fsdp(nn.Linear(2, 2))
    scorer = Scorer(
        nn.Linear(2, 2),
        nn.CrossEntropyLoss(reduction="none"),
        None,
        SelectionForward(),
        None,
        None,
        4,
        True,
        False,
    )
    assert not scorer.collective
    assert [scorer.chunks(n) for n in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3]
