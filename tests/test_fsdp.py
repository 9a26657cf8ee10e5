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
    rank and another rank's (filtered) source has ended, the rank without a candidate to pad
    with takes one from the probing rank instead of refusing the round (RuntimeError 'a rank
    had no candidate yet')."""
    for r in ranks:
        assert len(r[kind]["resumes"]) > 4
        assert all(r[kind]["resumes"]), r[kind]["resumes"]


@pytest.fixture(scope="module")
def raised(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_raised")
    return torchrun_ranks("fsdp_scenarios.py", out, DEADLINE_S, args=("raised",))


@pytest.mark.parametrize("case", ["first", "second", "stale", "decision"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_exception_on_one_rank_outside_its_forwards_raises_on_every_rank(raised, kind, case):
    """Under FSDP, rank 1's source raises as it loads its first or second source batch of a
    fresh epoch (before the round's selection forwards, which are collectives: reported in the
    ranks' agreement on them, and none runs them), or a stale epoch's first (a round without
    forwards), or Kath18 refuses its losses (after the forwards): rank 1 raises its own error,
    rank 0 one naming rank 1, the stage and the message, within seconds. Before, rank 0 waited
    in its next collective (a forward among them) until rank 1's process ended ("Connection
    reset by peer") or the process group timed out."""
    own, other = raised[1][kind][case], raised[0][kind][case]
    if case == "decision":
        named = "ValueError in its selection pass"
        message = "ValueError: Kath18 samples in proportion to the loss, so losses should be >= 0"
    else:
        named = "OSError while loading a source batch"
        # (the stale epoch's first example loaded: one its prefilter kept)
        example = {"first": "48", "second": "64", "stale": ""}[case]
        message = f"OSError: cannot read example {example}"
    kind_name, text = message.split(": ", 1)
    assert own["raised"].startswith(
        f"{kind_name}: on rank 1 of 2 (every rank stops with this error, reported to the "
        f"others): {text}"
    ), own
    epoch = 1 if case == "stale" else 0
    assert other["raised"].startswith(
        f"RuntimeError: in epoch {epoch}, rank 1 of 2 raised {named}"
    ), other
    assert f"Rank 1's error: {message}" in other["raised"], other
    assert own["seconds"] < 60 and other["seconds"] < 60, (own, other)  # (PG timeout: 120 s)


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


@pytest.fixture(scope="module")
def layered(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_layered")
    return torchrun_ranks("fsdp_scenarios.py", out, DEADLINE_S, args=("layered",))


@pytest.mark.parametrize("kind", KINDS)
def test_a_probe_of_other_sizes_on_each_rank_keeps_the_ranks_in_step(layered, kind):
    """Per-layer sharding (each Linear and the root: the usual use, where every forward
    gathers). The first round's probe ran one forward over rank 0's first batch of two rows
    and two over rank 1's, or one more for a sharded selector's largest-label row on one rank
    only, while the round agreed on one: every rank hung in a collective. Now each rank agrees
    on the forwards it runs and pads up to the most; both ranks train every batch."""
    for r in layered:
        assert r[kind]["small_first_batch"] == [5, 7]
        assert r[kind]["selector_label_row"] == [5, 5]


@pytest.mark.parametrize("kind", KINDS)
def test_padding_forwards_run_in_eval_mode_and_leave_batchnorm_alone(layered, kind):
    """With eval_selection=False a padding forward of the one kept row ran in train mode: a
    BatchNorm1d refused it (a 'chunk of one' the data did not hold) and killed the run, and
    elsewhere each padding forward updated the running statistics. Now a rank's BatchNorm
    counts its training and its counted selection forwards only."""
    r0, r1 = (r[kind]["train_mode_pads"] for r in layered)
    assert isinstance(r0, dict) and isinstance(r1, dict), (r0, r1)
    assert r0["selection_calls"] > r1["selection_calls"]  # rank 1 padded
    for r in (r0, r1):
        assert r["tracked"] == sum(r["steps"]) + r["selection_calls"], r


@pytest.mark.parametrize("kind", KINDS)
def test_a_resume_where_one_ranks_share_ends_first_goes_on(layered, kind):
    """A fresh process has no padding candidate: resumed where rank 1's share (5 source
    batches) ended while rank 0's (7) went on, every rank refused ('a rank had no candidate
    yet'). The rank still scoring shares its candidate, and every resume is exact."""
    for r in layered:
        assert len(r[kind]["resumes"]) >= 8
        assert all(r[kind]["resumes"]), r[kind]["resumes"]


def test_fsdp_over_a_compiled_module_and_sync_batchnorm_in_train_mode(layered):
    """FSDP1 over torch.compile(net) was unwrapped to the raw net (FSDP1 forwards attribute
    lookups such as _orig_mod), whose freed shards the pass called; and eval_selection=False
    with a SyncBatchNorm (whose train-mode forwards are collectives the padding forwards do
    not make) is refused up front."""
    for r in layered:
        assert r["compiled_inside"]["unwrapped"] == "FullyShardedDataParallel"
        assert r["compiled_inside"]["steps"] == [6, 5]
        for kind in KINDS:
            assert "pass eval_selection=True" in r[kind]["refused"]["sync_bn"]
