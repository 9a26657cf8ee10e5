"""The benchmark's frontier measure (pure), its registry of families, and interleaved training."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch

import sbloader
from benchmarks import run as bench
from benchmarks.core import strategies
from benchmarks.core.config import PRESETS, Config, preset
from benchmarks.core.frontier import Reached, Record, family_time, first_time, frontier_table
from benchmarks.core.machine import machine_info, tree_changes
from benchmarks.core.records import Run
from benchmarks.core.report import (
    _isa,
    frontier_section,
    interval_lines,
    pairwise_lines,
    sitting_lines,
    speedup_cell,
    summary_markdown,
)
from benchmarks.core.train import Trainer, train_interleaved
from sbloader.datasets import load_fashion_mnist


def rec(family, budget, evaluations, seed=0):
    return Record(family, budget, seed, tuple(evaluations))


# A control family (Traditional at 10 and 4 epochs) and an sbloader family (at 5 and 10).
# Traditional-10 ends at 0.10, so the targets are 0.10, 0.12 and 0.20 (x1.0, x1.2, x2.0).
TRAD_10 = rec("traditional", 10, [(10, 0.30), (20, 0.20), (30, 0.125), (40, 0.10)])
TRAD_4 = rec("traditional", 4, [(8, 0.25), (16, 0.115)])
SB_5 = rec("sb", 5, [(5, 0.18), (10, 0.13)])
SB_10 = rec("sb", 10, [(6, 0.22), (12, 0.15), (18, 0.095)])
RECORDS = [TRAD_10, TRAD_4, SB_5, SB_10]


def test_first_time_counts_an_evaluation_at_the_target_and_none_when_never():
    ev = [(1.0, 0.3), (2.0, 0.2), (3.0, 0.25)]
    assert first_time(ev, 0.2) == 2.0  # at the target counts
    assert first_time(ev, 0.25) == 2.0  # the first, not the last, below it
    assert first_time(ev, 0.1) is None


def test_a_family_frontier_takes_the_budget_that_gets_there_first():
    # Shorter budget first at a loose target, longer budget at a tight one.
    assert family_time(RECORDS, "sb", 0, 0.20) == Reached("sb", 5, 5)
    assert family_time(RECORDS, "sb", 0, 0.12) == Reached("sb", 10, 18)  # sb-5 ends at 0.13
    assert family_time(RECORDS, "traditional", 0, 0.12) == Reached("traditional", 4, 16)
    assert family_time(RECORDS, "traditional", 0, 0.10) == Reached("traditional", 10, 40)
    assert family_time(RECORDS, "sb", 0, 0.05) is None
    assert family_time(RECORDS, "sb", 1, 0.20) is None  # no run in that seed


def test_ratio_table_by_hand():
    table = frontier_table(RECORDS, {"traditional"}, ("traditional", 10), (1.0, 1.2, 2.0))
    assert table.controls == ("traditional",) and table.selective == ("sb",)
    assert table.seeds == (0,)
    c = {m: table.cells[0, m] for m in (1.0, 1.2, 2.0)}
    assert [x.target for x in c.values()] == pytest.approx([0.10, 0.12, 0.20])
    assert c[1.0].control == Reached("traditional", 10, 40)
    assert c[1.0].sbloader == Reached("sb", 10, 18)
    assert c[1.0].ratio == pytest.approx(40 / 18)
    assert c[1.2].ratio == pytest.approx(16 / 18)  # Traditional-4 beats sb-10 here
    assert c[2.0].control == Reached("traditional", 4, 16)  # before Traditional-10's 20 s
    assert c[2.0].ratio == pytest.approx(16 / 5)  # sb-5 first
    assert table.families["sb", 0, 2.0] == Reached("sb", 5, 5)
    s = table.summary(1.2)
    assert (s.mean, s.low, s.high, s.never, s.seeds) == pytest.approx((16 / 18,) * 3 + (0, 1))


def test_ties_never_and_only_sbloader():
    records = [
        rec("traditional", 10, [(10, 0.2), (20, 0.1)]),
        rec("random", 5, [(20, 0.11)]),  # ties Traditional at x1.1
        rec("random", 10, [(20, 0.105)]),  # ties its own family's shorter budget
        rec("sb", 10, [(20, 0.109), (30, 0.104)]),  # ties the controls at x1.1
        rec("sb", 3, [(5, 0.5)]),
    ]
    table = frontier_table(records, {"traditional", "random"}, ("traditional", 10), (1.0, 1.1))
    tie = table.cells[0, 1.1]
    assert tie.control.time_s == 20 and tie.ratio == 1.0
    assert table.families["random", 0, 1.1] == Reached("random", 5, 20)  # the smaller budget
    assert tie.control == Reached("random", 5, 20)  # ties between families: smaller budget
    never = table.cells[0, 1.0]  # 0.1: only Traditional gets there
    assert never.sbloader is None and never.ratio is None
    assert table.summary(1.0).never == 1 and table.summary(1.0).mean is None
    only_sb = frontier_table(
        [rec("traditional", 10, [(10, 0.2)]), rec("sb", 10, [(5, 0.25), (8, 0.19)])],
        {"traditional"},
        ("traditional", 10),
        (0.96,),
    )
    assert math.isinf(only_sb.cells[0, 0.96].ratio)


def test_seeds_pair_their_own_targets_and_summarise_mean_and_range():
    records = [
        rec("traditional", 10, [(10, 0.2), (20, 0.1)], seed=0),
        rec("traditional", 10, [(10, 0.3), (40, 0.2)], seed=1),
        rec("sb", 10, [(10, 0.1)], seed=0),  # 2x in seed 0
        rec("sb", 10, [(10, 0.25), (20, 0.2)], seed=1),  # 2x in seed 1 (target 0.2)
        rec("sb", 10, [(5, 0.2)], seed=2),  # no reference in seed 2: left out
    ]
    table = frontier_table(records, {"traditional"}, ("traditional", 10), (1.0, 1.5))
    assert table.seeds == (0, 1)
    s = table.summary(1.0)
    assert (s.mean, s.low, s.high, s.never) == (2.0, 2.0, 2.0, 0)
    assert s.mean_target == pytest.approx(0.15)
    # x1.5: seed 0 target 0.15, Traditional at 20 s, sb at 10 s; seed 1 target 0.3, both at 10 s
    s = table.summary(1.5)
    assert (s.low, s.high) == (1.0, 2.0) and s.mean == pytest.approx(1.5)


def test_each_sbloader_family_against_each_control_by_hand():
    rand = rec("random", 10, [(4, 0.19), (9, 0.121)])
    table = frontier_table([*RECORDS, rand], {"traditional", "random"}, ("traditional", 10))
    lines = pairwise_lines(table)
    rows = {tuple(x.strip() for x in line.split("|")[1:3]): line for line in lines[4:-1]}
    assert set(rows) == {("sb", "traditional"), ("sb", "random")}
    cells = [c.strip() for c in rows["sb", "random"].split("|")[3:-1]]
    # x1.0 (target 0.10): sb-10 at 18 s, random never (it ends at 0.121).
    assert cells[0] == "∞ (∞)"
    assert cells[4] == "0.90x (0.90x)"  # x1.4 (0.14): random at 9 s, sb-5 at 10 s
    cells = [c.strip() for c in rows["sb", "traditional"].split("|")[3:-1]]
    assert cells[0] == "2.22x (2.22x)"  # Traditional-10 at 40 s against sb-10 at 18 s
    assert cells[3] == "0.89x (0.89x)"  # x1.2: Traditional-4 at 16 s against sb-10 at 18 s
    worse = rec("sb", 3, [(1, 0.5)], seed=0)
    table = frontier_table([TRAD_10, worse], {"traditional"}, ("traditional", 10), (1.0,))
    assert "never in 1/1" in pairwise_lines(table)[-2]


def test_a_given_reference_error_sets_the_targets_of_seeds_without_a_reference_run():
    records = [TRAD_4, SB_5, rec("sb", 5, [(3, 0.2)], seed=1)]
    assert frontier_table(records, {"traditional"}, ("traditional", 10)).seeds == ()
    table = frontier_table(records, {"traditional"}, ("traditional", 10), (1.0,), 0.13)
    assert table.seeds == (0, 1)
    assert table.cells[0, 1.0].target == 0.13
    assert table.cells[0, 1.0].ratio == pytest.approx(16 / 10)  # Traditional-4 at 16 s, sb at 10
    assert table.cells[1, 1.0].sbloader is None
    with_ref = frontier_table([TRAD_10, *records], {"traditional"}, ("traditional", 10), (1.0,), 1)
    assert with_ref.cells[0, 1.0].target == 0.10 and with_ref.cells[1, 1.0].target == 1.0


def test_families_and_the_frontier_preset_name_registered_runs():
    for name, settings in PRESETS.items():
        cfg = preset(name)
        for run in (*cfg.run_names(), *settings.get("noise_strategies", ())):
            strategies.get(run)
    cfg = preset("frontier")
    names = cfg.run_names()
    assert cfg.interleave and names[0] == "traditional" and "traditional_e10" not in names
    assert "traditional_e4" in names and "random_0.33_e20" in names
    assert {"recipe_fb_int8_e2", "recipe_fb_int8_e3", "recipe_s0.5_anneal_fb_int8_e15"} <= set(
        names
    )
    assert "recipe_s0.5_anneal_fb_int8" in preset("frontier_mlp").run_names()
    assert len(names) == len(set(names))
    noisy = preset("frontier_noise").run_names()
    assert {"recipe_trim10_fb_e5", "recipe_s0.5_trim10_fb_int8_e15"} <= set(noisy)
    assert not any("anneal" in name for name in noisy)  # annealing trains on the flipped labels
    quick = preset("quick")
    assert quick.interleave and quick.run_names()[0] == "traditional"
    assert {
        "traditional_e3",
        "random_0.33_e3",
        "recipe_fb_int8_e5",
        "recipe_anneal_fb_int8",
    } <= set(quick.run_names())
    # The controls at the frontier preset's budgets (a weaker grid overstated the speedups),
    # and the short recipe at the same budgets as there.
    assert dict(quick.families)["recipe_fb_int8"] == dict(cfg.families)["recipe_fb_int8"]
    assert dict(quick.families)["traditional"] == dict(cfg.families)["traditional"]
    assert dict(quick.families)["random_0.33"] == dict(cfg.families)["random_0.33"]
    recipe, default = strategies.get("recipe_fb"), strategies.get("default")
    assert recipe.feedback and recipe.pooled and not recipe.as_user
    assert default.as_user and not default.pooled and not default.feedback
    assert repr(recipe.policy(10)) == repr(sbloader.default_policy())
    members = strategies.family_members("random_0.33", (5, 10), 10)
    assert members == ["random_0.33_e5", "random_0.33"]
    assert strategies.get("stale_sb_3_rwarmup_e15").family == "stale_sb_3_rwarmup"
    with pytest.raises(ValueError, match="without a budget"):
        strategies.family_members("traditional_e4", (2,), 10)
    saved = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert Config.from_dict(saved) == cfg


def test_a_screens_variant_takes_its_bases_options_with_its_own_policy_and_family():
    made = []

    def make(planned):
        made.append(planned)
        return sbloader.RandomBackprop(0.5)

    base = strategies.get("recipe_fb_int8")
    try:
        variant = strategies.register_variant("test_rb_half", make, base="recipe_fb_int8")
        budgeted = strategies.get("test_rb_half_e4")
        assert (variant.family, budgeted.family, budgeted.epochs) == ("test_rb_half",) * 2 + (4,)
        # everything but the policy and the names is the base's (its int8 selection, batching,
        # feedback)
        assert {
            f.name: getattr(variant, f.name)
            for f in dataclasses.fields(variant)
            if f.name not in ("name", "family", "make_policy")
        } == {
            f.name: getattr(base, f.name)
            for f in dataclasses.fields(base)
            if f.name not in ("name", "family", "make_policy")
        }
        assert isinstance(budgeted.make_policy(4), sbloader.RandomBackprop) and made == [4]
        with pytest.raises(ValueError, match="'test_rb_half' is registered already"):
            strategies.register_variant("test_rb_half", make)
        with pytest.raises(ValueError, match="registered already"):
            strategies.register_variant("traditional", make)
    finally:
        strategies.REGISTRY.pop("test_rb_half", None)


def _tiny_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (160,), generator=g)
    return x, y, x[:64].clone(), y[:64].clone()


def _selections(run, model):
    epochs = [{k: v for k, v in e.items() if not k.endswith("_s")} for e in run.epochs]
    points = [(p["position"], p["error"], p["backprops"], p["selections"]) for p in run.points]
    return epochs, points, {k: v.clone() for k, v in model.state_dict().items()}


def test_interleaved_runs_make_the_same_selections_as_runs_trained_alone():
    cfg = Config(batch_size=16, pool_batch_size=32, epochs=2, eval_every=1.0)
    data = _tiny_data()
    jobs = [
        ("traditional", 0, 0.0),
        ("sb_0.33_rwarmup", 0, 0.0),  # a Random-Backprop epoch, then SB
        ("stale_sb_2", 1, 0.0),  # a fresh selection epoch, then a stale one
        ("random_0.33_e3", 0, 0.1),  # its own budget and label noise
        ("kath18", 2, 0.0),
    ]
    alone = []
    for name, seed, nz in jobs:
        t = Trainer(cfg, strategies.get(name), seed, nz, data)
        alone.append(_selections(t.train(), t.model))
    torch.manual_seed(123)  # a different global RNG state must not matter either
    trainers = [
        Trainer(cfg, strategies.get(name), seed, nz, data, interleaved=True)
        for name, seed, nz in jobs
    ]
    order = []
    runs = train_interleaved(trainers, on_epoch=lambda t: order.append(t.run.strategy))
    names = [name for name, _, _ in jobs]
    # one epoch each in turn, each round starting one run further on
    assert order == names + names[1:] + names[:1] + ["random_0.33_e3"]
    assert all(r.interleaved for r in runs)
    for (name, _, _), before, run, t in zip(jobs, alone, runs, trainers):
        after = _selections(run, t.model)
        assert after[0] == before[0], name  # per-epoch counts: seen, selected, backpropagated
        assert after[1] == before[1], name  # test errors and counts at each evaluation
        for k in before[2]:  # the trained weights: every step's loss was the same
            assert torch.equal(after[2][k], before[2][k]), (name, k)
    assert [e["examples_yielded"] for e in runs[0].epochs] == [160, 160]
    assert runs[1].epochs[0]["selection_forwards"] == 0 < runs[1].epochs[1]["selection_forwards"]


def test_each_round_starts_one_run_further_on_among_the_runs_still_training():
    """README: interleaved runs take turns, each round starting one run further on. Rotating
    over every run's index, a start that fell on an ended run moved to the next one still
    training, so once the short budgets had ended one run took the first slot round after
    round (the frontier preset: rounds 11-14 all in one order)."""

    class Counted:
        def __init__(self, name, planned):
            self.name, self.planned, self.epoch = name, planned, 0

        @property
        def done(self):
            return self.epoch >= self.planned

        def train_epoch(self):
            self.epoch += 1

        def finish(self):
            return self.name

    budgets = [2, 2, 2, 6, 2, 6, 6, 2]  # three long runs among short ones
    trainers = [Counted(i, b) for i, b in enumerate(budgets)]
    log = []
    train_interleaved(trainers, on_epoch=lambda t: log.append((t.epoch, t.name)))
    rounds = [[name for epoch, name in log if epoch == k] for k in range(1, 7)]
    assert [r[0] for r in rounds[:2]] == [0, 1]
    # after the short runs ended: 3, 5 and 6 each begin a round in turn, in every slot
    assert rounds[2:] == [[3, 5, 6], [5, 6, 3], [6, 3, 5], [3, 5, 6]]


def test_a_schedule_by_backprops_follows_the_examples_trained_not_the_position(monkeypatch):
    """``lr_by_backprops``: the cosine's position is the planned epochs times the share of the
    planned backprops trained so far (an annealed epoch, on all the data, moves it three times
    as fast as a selective one); every registered strategy keeps the position in the data."""
    from benchmarks.core import train as train_module

    policy = sbloader.default_policy(epochs=3)  # Random-Backprop, SB, then annealed
    assert strategies.planned_backprops(policy, 3) == pytest.approx(1 / 3 + 1 / 3 + 1)
    assert strategies.planned_backprops(sbloader.RandomBackprop(0.25), 8) == pytest.approx(2.0)
    assert strategies.planned_backprops(sbloader.Traditional(), 4) == 4
    seen = []

    def recording(lr, position, total):
        seen.append((position, t.backprops, t.loader.progress))
        return cosine(lr, position, total)

    cosine = train_module.cosine_lr
    monkeypatch.setattr(train_module, "cosine_lr", recording)
    cfg = Config(batch_size=8, pool_batch_size=16, epochs=3, eval_every=1.0)
    base = strategies.get("recipe_anneal_fb")
    for by_backprops in (False, True):
        seen.clear()
        strat = dataclasses.replace(base, lr_by_backprops=by_backprops)
        t = Trainer(cfg, strat, 0, 0.0, _tiny_data())
        t.train()
        planned = strategies.planned_backprops(t.loader.policy, 3) * 160
        for position, backprops, progress in seen:
            expected = 3 * min(1.0, backprops / planned) if by_backprops else progress
            assert position == pytest.approx(expected)
        if by_backprops:  # behind the position until the annealed epoch catches up
            assert all(p <= q + 1e-9 for p, _, q in seen)
            assert any(p < q - 0.3 for p, _, q in seen)
    assert not any(s.lr_by_backprops for s in strategies.REGISTRY.values())


def test_a_pooled_variant_reads_source_batches_of_its_own_size():
    """``<recipe>_pool4096`` (the GPU's larger pools) draws candidates in source batches of its
    own size, whatever the configuration's; Traditional keeps the training batch."""
    big = strategies.get("recipe_anneal_fb_pool4096_e10")
    assert big.family == "recipe_anneal_fb_pool4096" and big.pool == 4096 and big.epochs == 10
    assert big.source_batch(1024, 256) == 4096
    assert strategies.get("recipe_anneal_fb").source_batch(1024, 256) == 1024
    assert strategies.get("traditional").source_batch(1024, 256) == 256
    assert repr(big.policy(10)) == repr(strategies.get("recipe_anneal_fb").policy(10))
    cfg = Config(batch_size=8, pool_batch_size=16, epochs=1, eval_every=1.0)
    wide = dataclasses.replace(strategies.get("random_0.33"), pool=48)
    t = Trainer(cfg, wide, 0, 0.0, _tiny_data())
    assert t.loader.source.batch_size == 48


@pytest.mark.parametrize("name", ["sb_0.33", "random_0.33", "traditional"])
def test_the_final_evaluation_sees_every_training_step(name):
    """A pooled loader reaches the planned position when its last source batch is drawn,
    before the batches kept from it are trained: the final error is taken after them."""
    cfg = Config(batch_size=8, pool_batch_size=80, epochs=2, eval_every=1.0)
    t = Trainer(cfg, strategies.get(name), 0, 0.0, _tiny_data())
    run = t.train()
    last = run.points[-1]
    assert last["position"] == 2.0 and last["backprops"] == t.backprops
    assert run.final_error == last["error"] == t.evaluate()
    assert [p["position"] for p in run.points] == [0.0, 1.0, 2.0] or name != "traditional"


@pytest.mark.parametrize("name", ["sb_0.33", "random_0.33"])
def test_a_source_batch_wider_than_eval_every_still_ends_on_the_trained_model(name):
    """A source batch of a whole epoch (a small training set, ``--train-examples 512`` with
    pools of 512) moves the position past several evaluation points at once. The next one lagged
    behind it, so the run was evaluated twice at 1.0 and at 2.0 before the last pool's kept
    batches were trained, and that early error was the run's final error."""
    cfg = Config(batch_size=8, pool_batch_size=160, epochs=2, eval_every=0.5)
    t = Trainer(cfg, strategies.get(name), 0, 0.0, _tiny_data())
    run = t.train()
    positions = [p["position"] for p in run.points]
    assert positions == [0.0, 1.0, 2.0]  # once each; 0.5 and 1.5 fall inside a source batch
    assert run.points[-1]["backprops"] == t.backprops


def test_an_evaluation_at_exactly_a_float_products_target_reaches_it():
    from benchmarks.core.analysis import time_to
    from benchmarks.core.frontier import first_time

    target = 0.071 * 1.2  # 0.08519999999999998
    assert first_time([(5.0, 0.09), (9.0, 0.0852)], target) == 9.0
    assert time_to([{"time_s": 9.0, "error": 0.0852}], target) == 9.0


def test_the_sitting_check_flags_traditional_runs_slowed_unevenly():
    def trad(budget: int, seed: int, seconds: float) -> Run:
        run = Run("traditional" if budget == 10 else f"traditional_e{budget}", seed, 0.0, budget)
        run.points = [{"position": float(budget), "backprops": 1000 * budget, "error": 0.1}]
        run.train_s = seconds
        return run

    even = [trad(2, 0, 2.0), trad(10, 0, 10.5)]  # 1.00 and 1.05 ms per example
    uneven = [trad(2, 1, 2.0), trad(4, 1, 6.0)]  # 1.00 and 1.50
    lines = sitting_lines([*even, *uneven, Run("random_0.33", 0, 0.0, 3)])
    assert "- seed 0: 2 ep 1.000, 10 ep 1.050 (spread 1.050x)" in lines
    assert "- seed 1: 2 ep 1.000, 4 ep 1.500 (spread 1.500x) **uneven**" in lines
    assert sitting_lines([Run("random_0.33", 0, 0.0, 3)]) == []


def test_the_interval_check_flags_a_burst_of_load_on_one_control_run_that_runs_average_out():
    """A burst of load on one half-epoch of one run slows that run only slightly on the whole
    (below the per-run check's 1.2x), but its interval is flagged, with the run and where."""

    def control(name: str, seed: int, slow_at: int | None = None) -> Run:
        run = Run(name, seed, 0.0, 10)
        t, run.points = 0.0, [{"position": 0.0, "time_s": 0.0, "backprops": 0, "error": 1.0}]
        for k in range(20):  # 20 half-epochs of 1000 backprops, 1 ms each (3 when slowed)
            t += 3.0 if k == slow_at else 1.0 + 0.01 * (k % 3)
            run.points.append(
                {"position": (k + 1) / 2, "time_s": t, "backprops": 1000 * (k + 1), "error": 0.1}
            )
        run.train_s = t
        return run

    even = [control("traditional", 0), control("random_0.33", 0)]
    burst = [control("traditional", 1, slow_at=2), control("random_0.33_e20", 1)]
    runs = [*even, *burst]
    per_run = sitting_lines(runs)
    assert not any("**uneven**" in line for line in per_run)  # (1.10x: not flagged per run)
    lines = interval_lines(runs)
    (seed0,) = [line for line in lines if line.startswith("- seed 0")]
    (seed1,) = [line for line in lines if line.startswith("- seed 1")]
    assert "**slowed**" not in seed0 and "worst 1.01x" in seed0
    assert "worst 2.97x (traditional from epoch 1.0); **slowed**: 1 above 1.5x" in seed1
    # sbloader runs (selection passes in some intervals) are not compared
    assert interval_lines([control("recipe_fb_int8", 0, slow_at=0)]) == []


def test_the_machine_record_says_whether_the_tree_was_dirty(tmp_path):
    info = machine_info()
    assert isinstance(info["git_dirty"], bool) and info["git_commit"]
    assert info["git_dirty"] == bool(tree_changes())
    assert info["sbloader_path"].endswith("sbloader")
    # the vector ISA and native bf16 tell apart machines that share a CPU name
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["native_bf16"] == sbloader.precision.native_bf16(torch.device("cpu"))
    assert info["amx"] == torch.cpu._is_amx_tile_supported()


def test_a_results_folder_nested_in_a_new_folder_is_not_a_change_of_the_tree():
    """Re-running a benchmark into ``new/sub`` (its earlier results there) records the tree as
    clean: git named the untracked folder ``new/`` alone, which was not under the excluded
    results folder, so the run's own earlier output made ``git_dirty`` True."""
    import uuid

    from benchmarks.core.machine import ROOT

    new = ROOT / "benchmarks" / "results" / f"tmp_{uuid.uuid4().hex[:8]}"
    try:
        (new / "sub").mkdir(parents=True)
        (new / "sub" / "old.json").write_text("{}")
        assert not [c for c in tree_changes(exclude=new / "sub") if new.name in c]
        (new / "other.txt").write_text("")  # a file beside the results still counts
        assert [c for c in tree_changes(exclude=new / "sub") if new.name in c] == [
            f"?? benchmarks/results/{new.name}/other.txt"
        ]
    finally:
        shutil.rmtree(new, ignore_errors=True)


@pytest.mark.parametrize(
    "record, shown",
    [
        (
            {"cpu_capability": "AVX512", "native_bf16": True, "amx": True},
            " (AVX512, native bf16, AMX)",
        ),
        ({"cpu_capability": "AVX512", "native_bf16": True, "amx": False}, " (AVX512, native bf16)"),
        ({"cpu_capability": "AVX2", "native_bf16": False}, " (AVX2, no native bf16)"),  # older
        ({"cpu": "AMD EPYC"}, ""),  # older still
    ],
)
def test_the_summary_names_the_cpus_matrix_units(record, shown):
    """Three CPUs have served under one machine kind; the summary's first line tells them apart
    (AMX: the Intel one, where int8 and bf16 selection passes are cheapest)."""
    assert _isa(record) == shown


try:
    load_fashion_mnist("test")
    HAVE_DATA = True
except FileNotFoundError:
    HAVE_DATA = False


@pytest.mark.realdata
@pytest.mark.skipif(not HAVE_DATA, reason="needs Debian's dataset-fashion-mnist")
def test_the_frontier_preset_runs_interleaved_and_reports_the_frontier_first(tmp_path):
    argv = ["--preset", "frontier", "--out", str(tmp_path), "--seeds", "0", "--epochs", "2"]
    argv += ["--families", "traditional:1,2", "random_0.33:1,2", "stale_sb_3_rwarmup:2"]
    argv += ["--train-examples", "512", "--test-examples", "128"]
    assert bench.main(argv) == 0
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    names = ["random_0.33", "random_0.33_e1", "stale_sb_3_rwarmup", "traditional"]
    assert runs == [f"{n}__s0__n0.json" for n in [*names, "traditional_e1"]]
    assert all(json.loads((tmp_path / "runs" / r).read_text())["interleaved"] for r in runs)
    summary = (tmp_path / "summary.md").read_text()
    head = summary.index("## Frontier")
    assert head < summary.index("## Table 1") < summary.index("## Pareto frontier")
    assert "| x1.0 |" in summary and "| x1.05 |" in summary and "| x1.4 |" in summary
    assert "traditional (1, 2 ep)" in summary and "stale_sb_3_rwarmup (2 ep)" in summary
    assert json.loads((tmp_path / "config.json").read_text())["interleave"] is True


def test_a_report_of_only_noisy_runs_breaks_down_their_time_and_lists_no_clean_row():
    """The label-noise frontier trains every run with flipped labels: its time breakdown reads
    those runs (it was an empty table), and its noise table has no empty 0% row."""
    from benchmarks.core.records import Run
    from benchmarks.core.report import summary_markdown

    runs = []
    for name, secs in [("traditional", 30.0), ("recipe_anneal_fb", 12.0)]:
        run = Run(name, 0, 0.1, planned_epochs=2, interleaved=True)
        run.points = [dict(position=0.0, time_s=0.0, error=1.0, backprops=0, selections=0)]
        run.points += [dict(position=2.0, time_s=secs, error=0.2, backprops=0, selections=0)]
        run.final_error, run.train_s = 0.2, secs
        run.breakdown = dict(forward=secs / 3, backward=secs / 2)
        if name != "traditional":
            run.breakdown["selection"] = 1.5
        runs.append(run)
    cfg = Config(preset="frontier_noise", epochs=2, seeds=(0,))
    text = summary_markdown(cfg, runs, machine_info())
    breakdown = text[text.index("## Time breakdown") :].split("\n\n")[1]
    assert "10% of labels flipped" in text[text.index("## Time breakdown") :].split("\n")[0]
    assert "| traditional | 0.0 | 10.0 | 15.0 |" in breakdown
    assert "| recipe_anneal_fb | 1.5 | 4.0 | 6.0 |" in breakdown
    noise = text[text.index("## Label noise") :]
    assert "| 0% |" not in noise and "| 10% | 20.00% | 20.00% |" in noise


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("fp32", None),
        ("bf16", torch.bfloat16),
        # "auto": the loader's own choice on this machine (float32 where bf16 is emulated)
        ("auto", sbloader.precision.selection_dtype("auto", torch.device("cpu"))[0]),
    ],
)
def test_selection_precision_is_the_configurations_and_is_recorded(precision, expected):
    """The benchmark never forces bf16: by default its selective runs select in whatever the
    loader's autocast="auto" chooses, and each run and the summary record what that was."""
    assert Config().selection_precision == "auto"
    cfg = Config(batch_size=16, pool_batch_size=32, epochs=1, selection_precision=precision)
    t = Trainer(cfg, strategies.get("sb_0.33"), 0, 0.0, _tiny_data())
    assert t.loader.autocast == expected
    run = t.train()
    named = "float32" if expected is None else "bfloat16"
    assert run.selection_dtype == named
    summary = summary_markdown(cfg, [run], machine_info())
    assert f"selection passes {precision} ({named})" in summary
    assert f"({torch.backends.cpu.get_cpu_capability()}, " in summary.splitlines()[2]
    assert (", AMX)" in summary.splitlines()[2]) == torch.cpu._is_amx_tile_supported()


def test_an_int8_strategy_selects_through_the_quantized_copy_and_records_int8():
    """``_int8`` runs score with the loader's int8 copy (not the configuration's precision) and
    say so in the run and the summary, beside the float32 runs."""
    cfg = Config(batch_size=16, pool_batch_size=32, epochs=1, selection_precision="fp32")
    t = Trainer(cfg, strategies.get("sb_0.33_int8"), 0, 0.0, _tiny_data())
    assert t.loader.scorer.quantized is not None and t.loader.autocast is None
    run = t.train()
    assert run.selection_dtype == "int8"
    plain = Trainer(cfg, strategies.get("sb_0.33"), 0, 0.0, _tiny_data()).train()
    summary = summary_markdown(cfg, [run, plain], machine_info())
    assert "selection passes fp32 (float32/int8)" in summary


def test_a_configuration_saved_with_selection_bf16_reports_the_precision_it_ran():
    old = {k: v for k, v in dataclasses.asdict(Config()).items() if k != "selection_precision"}
    assert Config.from_dict({**old, "selection_bf16": True}).selection_precision == "bf16"
    assert Config.from_dict({**old, "selection_bf16": False}).selection_precision == "fp32"
    assert Config.from_dict(old).selection_precision == "auto"


def test_a_seed_where_only_a_control_reaches_the_target_leaves_the_mean_undefined():
    """A seed where a control reaches the target and no sbloader family does is a loss of
    unknown size: the mean over seeds is then not a number (it was the mean of the other seeds,
    a win where sbloader lost in one seed of two), and the report says where it was reached."""
    records = [
        rec("traditional", 10, [(10, 0.2), (20, 0.1)], seed=0),
        rec("sb", 10, [(10, 0.1)], seed=0),  # 2x in seed 0
        rec("traditional", 10, [(10, 0.2), (20, 0.1)], seed=1),
        rec("sb", 10, [(10, 0.15)], seed=1),  # never in seed 1, where Traditional gets there
    ]
    table = frontier_table(records, {"traditional"}, ("traditional", 10), (1.0, 1.5))
    s = table.summary(1.0)
    assert s.mean is None and (s.low, s.high, s.never, s.seeds) == (2.0, 2.0, 1, 2)
    assert speedup_cell(s) == "2.00x in 1 of 2 seeds, never in 1/2"
    s = table.summary(1.5)  # reached in both: 2x and 20/10
    assert s.mean == 2.0 and speedup_cell(s) == "2.00x (2.00x to 2.00x)"
    # A seed where neither gets there (a given reference error) is no loss: the mean stands.
    neither = frontier_table(
        [*records[:2], rec("sb", 10, [(10, 0.3)], seed=1)],
        {"traditional"},
        ("traditional", 10),
        (1.0,),
        reference_error=0.1,
    )
    s = neither.summary(1.0)
    assert s.mean == 2.0 and speedup_cell(s) == "2.00x, neither in 1/2"


def test_the_pairwise_table_says_in_how_many_seeds_only_the_family_got_there():
    """A seed where only the sbloader family reached the target (∞) is left out of the pairwise
    mean of the finite ratios; the cell says so instead of reading as the loss of the others
    (it read '0.50x (0.50x)' for a family that only the control missed in seed 0)."""
    records = [
        rec("traditional", 10, [(10, 0.2), (20, 0.1)], seed=0),
        rec("traditional", 10, [(10, 0.2), (20, 0.1)], seed=1),
        rec("random", 10, [(10, 0.2), (20, 0.13)], seed=0),  # never at x1.2 (0.12) in seed 0
        rec("random", 10, [(10, 0.2), (20, 0.11)], seed=1),  # at 20 s in seed 1
        rec("sb", 10, [(30, 0.115)], seed=0),
        rec("sb", 10, [(40, 0.115)], seed=1),
    ]
    table = frontier_table(records, {"traditional", "random"}, ("traditional", 10), (1.2,))
    rows = {line.split("|")[2].strip(): line for line in pairwise_lines(table)[4:-1]}
    assert rows["random"].split("|")[3].strip() == "0.50x (0.50x), ∞ in 1/2"
    assert rows["traditional"].split("|")[3].strip() == "0.58x (0.50x)"  # 20/30 and 20/40


def test_a_resumed_sitting_keeps_the_machine_record_of_the_runs_there(tmp_path, monkeypatch):
    """``--resume`` trains only the runs not yet in the folder; the runs already there were
    measured on the machine and commit of ``machine.json``, which the resumed sitting
    overwrote with its own (so a folder's record named only its last sitting). It is kept, and
    the resumed sitting's record is saved beside it."""
    monkeypatch.setattr(bench, "execute", lambda *a, **k: None)
    monkeypatch.setattr(bench, "report", lambda *a, **k: "")
    (tmp_path / "runs").mkdir()
    earlier = {"git_commit": "0000000", "date": "2026-11-25T17:53:37+00:00", "cpu": "earlier"}
    (tmp_path / "machine.json").write_text(json.dumps(earlier))
    argv = ["--preset", "quick", "--out", str(tmp_path), "--resume"]
    assert bench.main(argv) == 0
    assert json.loads((tmp_path / "machine.json").read_text()) == earlier
    resumed = sorted(tmp_path.glob("machine_resumed_*.json"))
    assert len(resumed) == 1
    assert json.loads(resumed[0].read_text())["git_commit"] == machine_info()["git_commit"]
    assert bench.main(["--preset", "quick", "--out", str(tmp_path / "fresh")]) == 0
    assert (tmp_path / "fresh" / "machine.json").exists()  # a new folder records its machine


def test_per_seed_reference_errors_set_each_seeds_targets():
    """A mapping of seeds to reference errors (each seed's Traditional final error from another
    sitting) sets each seed's own targets; seeds it does not name are left out, and a seed with
    a reference run keeps that run's."""
    records = [
        rec("traditional", 4, [(8, 0.25), (16, 0.115)], seed=0),
        rec("sb", 5, [(5, 0.18), (10, 0.13)], seed=0),
        rec("traditional", 4, [(8, 0.25), (16, 0.115)], seed=1),
        rec("sb", 5, [(5, 0.18), (10, 0.13)], seed=1),
        rec("sb", 5, [(5, 0.18)], seed=2),
    ]
    table = frontier_table(
        records, {"traditional"}, ("traditional", 10), (1.0,), {0: 0.13, 1: 0.115}
    )
    assert table.seeds == (0, 1)
    assert table.cells[0, 1.0].target == 0.13 and table.cells[0, 1.0].ratio == 16 / 10
    assert table.cells[1, 1.0].target == 0.115 and table.cells[1, 1.0].sbloader is None
    with_ref = frontier_table([TRAD_10, *records], {"traditional"}, ("traditional", 10), (1.0,), {})
    assert with_ref.seeds == (0,) and with_ref.cells[0, 1.0].target == 0.10


def test_a_target_no_run_reached_reads_neither_not_never():
    """Where neither a control nor sbloader reached a target (a sitting of short budgets with
    a given reference error), the report says "neither", apart from "never" (a control got
    there and sbloader did not), and leaves such seeds out of the mean."""
    records = [
        rec("traditional", 2, [(10, 0.2), (20, 0.12)], seed=0),
        rec("sb", 2, [(5, 0.2), (10, 0.125)], seed=0),
        rec("traditional", 2, [(10, 0.2), (20, 0.14)], seed=1),
        rec("sb", 2, [(5, 0.2), (10, 0.15)], seed=1),
    ]
    table = frontier_table(records, {"traditional"}, ("traditional", 10), (1.0, 1.2, 1.3), 0.1)
    assert speedup_cell(table.summary(1.0)) == "neither"
    # x1.2 (0.12): seed 0 Traditional at 20 s, sb never: a loss; seed 1: neither
    assert speedup_cell(table.summary(1.2)) == "never (neither in 1/2)"
    # x1.3 (0.13): seed 0 sb at 10 s, Traditional at 20 s; seed 1 neither
    s = table.summary(1.3)
    assert (s.mean, s.lost, s.neither) == (2.0, 0, 1)
    assert speedup_cell(s) == "2.00x, neither in 1/2"
    text = "\n".join(pairwise_lines(table))
    assert "neither" in text


def test_report_only_takes_the_targets_and_seeds_asked_for(tmp_path):
    """``--report-only`` reports a folder with the saved configuration, but the reference
    errors and the seeds given on its command line (it ignored both: a merged folder's
    targets were the first process's, and its header named that process's seeds only)."""

    def run(seed, strategy, planned, curve):
        points = [{"position": 0.0, "time_s": 0.0, "error": 1.0, "backprops": 0, "selections": 0}]
        points += [
            {
                "position": i + 1.0,
                "time_s": t,
                "error": e,
                "backprops": 100 * (i + 1),
                "selections": 0,
            }
            for i, (t, e) in enumerate(curve)
        ]
        return Run(
            strategy,
            seed,
            0.0,
            planned,
            points=points,
            final_error=curve[-1][1],
            train_s=curve[-1][0],
            interleaved=True,
        )

    from benchmarks.core.records import save_run

    (tmp_path / "runs").mkdir()
    for seed, ref in ((0, 0.10), (1, 0.20)):
        for r in (
            run(seed, "traditional_e2", 2, [(10, 2 * ref), (20, 1.2 * ref)]),
            run(seed, "recipe_fb_int8_e2", 2, [(5, 1.3 * ref), (10, 1.15 * ref)]),
        ):
            save_run(r, tmp_path / "runs")
    cfg = dataclasses.replace(preset("frontier"), seeds=(0,), families=(), strategies=())
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    (tmp_path / "machine.json").write_text(json.dumps(machine_info()))
    argv = ["--report-only", "--out", str(tmp_path), "--reference-error", "0:0.10", "1:0.20"]
    assert bench.main([*argv, "--seeds", "0", "1"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "seed 0 10.00%, seed 1 20.00%" in summary
    assert "seeds [0, 1]" in summary
    # x1.2: Traditional-2 at 20 s, the recipe at 10 s, in both seeds (each its own target)
    assert "| x1.2 | 18.00% | 2.00x (2.00x to 2.00x) |" in summary
    assert bench.main([*argv, "--seeds", "1"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "seeds [1]" in summary and "| x1.2 | 24.00% | 2.00x |" in summary
    with pytest.raises(SystemExit):
        bench.main([*argv[:4], "0:0.1", "0:0.2"])


def _run(seed, strategy, planned, curve):
    """A run whose evaluations after the untrained point are ``curve``'s (time, error)."""
    points = [{"position": 0.0, "time_s": 0.0, "error": 1.0, "backprops": 0, "selections": 0}]
    points += [
        {"position": i + 1.0, "time_s": t, "error": e, "backprops": 100 * (i + 1), "selections": 0}
        for i, (t, e) in enumerate(curve)
    ]
    return Run(
        strategy, seed, 0.0, planned, points=points, final_error=curve[-1][1], train_s=curve[-1][0]
    )


def test_the_frontier_names_the_seeds_it_leaves_out_for_want_of_a_reference_run():
    """A seed whose Traditional-10 run never ended (interrupted) has no targets and is left out
    of the frontier, while the summary's header names it among the seeds: the headline read
    "2.00x" for seed 0 alone, with nothing saying that seed 1 (where the recipe lost) was not
    in it. The section names the seeds it leaves out, and says so when that is every seed."""
    cfg = dataclasses.replace(preset("frontier"), seeds=(0, 1))
    runs = [
        _run(0, "traditional", 10, [(10, 0.2), (20, 0.1)]),
        _run(0, "recipe_fb_int8_e5", 5, [(5, 0.15), (10, 0.1)]),
        _run(1, "traditional_e2", 2, [(4, 0.2), (8, 0.12)]),  # Traditional-10 interrupted
        _run(1, "recipe_fb_int8_e5", 5, [(5, 0.3), (10, 0.25)]),
    ]
    text = "\n".join(frontier_section(cfg, runs))
    assert "| x1.0 | 10.00% | 2.00x |" in text
    assert "Seeds without a Traditional-10 run, left out of the frontier: 1 (" in text
    text = "\n".join(frontier_section(cfg, runs[2:]))
    assert "left out of the frontier: 1 (" in text
    assert "left out of the frontier" not in "\n".join(frontier_section(cfg, runs[:2]))


def test_the_frontier_names_the_planned_runs_a_seed_lacks():
    """A sitting cut short keeps its targets and some of its runs: interleaved, Random-Backprop
    over 20 epochs ends last, and a seed without it read Traditional-10 as its best control at
    x1.1 (3.33x) under a header naming ``random_0.33 (10, 20 ep)`` as every seed's, nothing
    saying that seed lacked one (``benchmarks/results/frontier``'s seed 0 lacks
    ``stale_sb_3_rwarmup_fb``, and its pairwise rows read "never in 1/3" for it)."""
    cfg = Config(
        epochs=10,
        seeds=(0, 1),
        strategies=("traditional",),
        families=(("random_0.33", (10, 20)), ("recipe_anneal_fb_int8", (10, 15))),
    )
    runs = []
    for seed in (0, 1):
        runs += [
            _run(seed, "traditional", 10, [(100, 0.12), (200, 0.10)]),
            _run(seed, "random_0.33", 10, [(40, 0.13), (80, 0.115)]),
            _run(seed, "recipe_anneal_fb_int8", 10, [(40, 0.12), (80, 0.105)]),
            _run(seed, "recipe_anneal_fb_int8_e15", 15, [(60, 0.11), (120, 0.099)]),
        ]
    whole = runs + [_run(s, "random_0.33_e20", 20, [(80, 0.11), (150, 0.098)]) for s in (0, 1)]
    assert "absent" not in "\n".join(frontier_section(cfg, whole))
    text = "\n".join(frontier_section(cfg, whole[:-1]))  # seed 1's 20-epoch run never ended
    assert "| x1.1 | 11.00% | 2.33x (1.33x to 3.33x) |" in text  # over the runs present
    assert "over the runs present only (`--resume` trains them): seed 1: random_0.33_e20." in text


def test_a_seed_only_sbloader_reached_is_left_out_of_the_headline_mean():
    """A seed where only sbloader reached the target (∞: Random-Backprop never got to a given
    reference error, as in default_safety's x1.1) made the headline's mean ∞ whatever the other
    seeds measured ("∞ (2.00x to ∞)" over a 2x seed). As in the pairwise table, the mean is over
    the finite ratios and the cell counts the ∞ seeds; ∞ only where every seed is one."""
    records = [
        rec("random", 10, [(10, 0.12), (20, 0.105)], seed=0),  # 0.11 at 20 s
        rec("random", 10, [(10, 0.12), (20, 0.115)], seed=1),  # never at 0.11
        rec("default", 10, [(10, 0.108)], seed=0),
        rec("default", 10, [(10, 0.108)], seed=1),
    ]
    table = frontier_table(records, {"random"}, ("traditional", 10), (1.1,), 0.1)
    s = table.summary(1.1)
    assert (s.mean, s.low, s.only, s.never) == (2.0, 2.0, 1, 0) and math.isinf(s.high)
    assert speedup_cell(s) == "2.00x (2.00x to ∞), ∞ in 1/2"
    only = frontier_table(records[1::2], {"random"}, ("traditional", 10), (1.1,), 0.1)
    assert speedup_cell(only.summary(1.1)) == "∞"


def test_the_warm_up_trains_each_strategy_on_two_of_its_own_source_batches(monkeypatch):
    """The warm-up (README: every configuration trained once on two source batches, so that no
    timed run pays a first use) cut its data at two of the configuration's source batches: a
    ``_pool4096``-style strategy, whose source batches are wider, saw one partial batch, never
    its own shape."""
    from benchmarks.core import train

    seen = []

    class Watched(Trainer):
        def __init__(self, cfg, strat, seed, noise, data, *a, **k):
            super().__init__(cfg, strat, seed, noise, data, *a, **k)
            seen.append((strat.name, len(data[0]) // self.loader.source.batch_size))

    monkeypatch.setattr(train, "Trainer", Watched)
    cfg = Config(batch_size=8, pool_batch_size=16, epochs=1, eval_every=1.0)
    wide = dataclasses.replace(strategies.get("random_0.33"), name="wide", pool=48)
    train.warm_up(
        cfg, [strategies.get("traditional"), strategies.get("sb_0.33"), wide], _tiny_data()
    )
    assert seen == [("traditional", 2), ("sb_0.33", 2), ("wide", 2)]


def test_train_bf16_on_the_command_line_sets_every_runs_training_precision():
    """``--train-bf16`` trains controls and sbloader alike under bf16 (a CPU preset trains in
    float32 otherwise), and ``--no-train-bf16`` takes it back from a preset that has it."""

    def configured(*argv: str) -> Config:
        return bench.configure(bench.parser().parse_args(list(argv)))

    assert configured("--preset", "quick").train_bf16 is False
    assert configured("--preset", "quick", "--train-bf16").train_bf16 is True
    assert PRESETS["gpu"]["train_bf16"] is True
    gpu = configured("--preset", "gpu", "--device", "cpu", "--no-train-bf16")
    assert gpu.train_bf16 is False


def test_two_names_of_one_run_are_refused_before_training():
    """``traditional`` and ``traditional_e10`` at 10 planned epochs are one run: both were
    trained, and the report then stopped at the frontier (``two reference runs``), as every
    ``--report-only`` after it did. The command line is refused first, naming both."""

    def configured(*argv: str) -> Config:
        return bench.configure(bench.parser().parse_args(list(argv)))

    with pytest.raises(SystemExit, match="traditional and traditional_e10 are both traditional"):
        configured("--strategies", "traditional", "traditional_e10", "sb_0.33")
    with pytest.raises(SystemExit, match=r"random_0\.33_e4 and random_0\.33 are both random_0\.33"):
        configured("--epochs", "4", "--families", "random_0.33:4", "--strategies", "random_0.33_e4")
    assert configured("--epochs", "4", "--strategies", "traditional", "traditional_e10").run_names()
