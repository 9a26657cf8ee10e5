"""The benchmark's accounting on synthetic curves: time to target, paired speedups, Pareto."""

from __future__ import annotations

import dataclasses
import json

import pytest

import sbloader
from benchmarks import run as bench
from benchmarks.core import strategies
from benchmarks.core.analysis import pareto, speedup_table, time_to
from benchmarks.core.config import Config
from benchmarks.core.records import Run, collapsed


def make_run(name, seed, curve, noise=0.0):
    r = Run(name, seed, noise, planned_epochs=len(curve))
    r.points = [dict(position=0.0, time_s=0.0, error=1.0, backprops=0, selections=0)]
    r.points += [
        dict(position=i + 1.0, time_s=t, error=e, backprops=0, selections=0)
        for i, (t, e) in enumerate(curve)
    ]
    r.final_error = curve[-1][1]
    return r


def test_time_to_is_the_first_evaluation_at_or_below_target():
    r = make_run("x", 0, [(10, 0.2), (20, 0.1), (30, 0.12), (40, 0.08)])
    assert time_to(r.points, 0.1) == 20
    assert time_to(r.points, 0.08) == 40
    assert time_to(r.points, 0.05) is None


def test_speedups_are_paired_by_seed_and_count_never():
    runs = [
        make_run("traditional", 0, [(10, 0.2), (20, 0.1)]),
        make_run("traditional", 1, [(10, 0.2), (40, 0.1)]),
        make_run("fast", 0, [(5, 0.1)]),
        make_run("fast", 1, [(10, 0.1)]),
        make_run("slow", 0, [(50, 0.11)]),
        make_run("slow", 1, [(80, 0.105)]),
    ]
    table = speedup_table(runs)
    assert table["traditional"][1.0]["mean"] == 1.0
    fast = table["fast"][1.0]
    assert fast["mean"] == pytest.approx((20 / 5 + 40 / 10) / 2) and fast["never"] == 0
    assert table["slow"][1.0]["mean"] is None and table["slow"][1.0]["never"] == 2
    # x1.1 of 0.1 = 0.11: seed 0 reaches it at 50 s (Traditional at 20 s), seed 1 at 80 s.
    slow = table["slow"][1.1]
    assert slow["min"] == pytest.approx(20 / 50) and slow["max"] == pytest.approx(40 / 80)


def test_each_seed_is_measured_against_its_own_traditional_final_error():
    runs = [
        make_run("traditional", 0, [(10, 0.2), (20, 0.08)]),
        make_run("traditional", 1, [(10, 0.2), (20, 0.12)]),  # the mean, 0.10, is never reached
        make_run("x", 0, [(5, 0.09), (10, 0.08)]),
        make_run("x", 1, [(5, 0.12)]),
    ]
    table = speedup_table(runs)
    trad = table["traditional"][1.0]
    assert trad["mean"] == 1.0 and trad["never"] == 0
    assert table["x"][1.0]["min"] == pytest.approx(2.0) and table["x"][1.0]["max"] == 4.0
    assert table["x"][1.0]["target"] == pytest.approx(0.10)  # reported: the mean target


def test_warmup_suffixes_build_matched_policies():
    cfg = Config()
    rw = strategies.get("stale_sb_3_rwarmup").policy(cfg.epochs)
    assert isinstance(rw.warmup_policy, sbloader.RandomBackprop)
    assert rw.warmup_policy.selectivity == pytest.approx(1 / 3) and rw.policy.staleness == 3
    control = strategies.get("random_0.33_warmup").policy(cfg.epochs)
    assert isinstance(control.policy, sbloader.RandomBackprop)
    assert isinstance(control.warmup_policy, sbloader.Traditional)
    assert strategies.get("diet_sb_rwarmup").prune
    # Annealing follows the strategy's own schedule (built with its planned epochs).
    anneal = strategies.get("sb_0.33_anneal_e16")
    assert anneal.planned(cfg.epochs) == 16
    assert anneal.policy(anneal.planned(cfg.epochs)).anneal_from_epoch == 14


def test_pareto_frontier_keeps_only_non_dominated_points():
    runs = [
        make_run("a", 0, [(10, 0.3), (20, 0.2), (30, 0.15)]),
        make_run("b", 0, [(15, 0.25), (25, 0.22), (35, 0.1)]),
    ]
    front = pareto(runs)
    assert [(n, t) for n, t, _ in front] == [("a", 10), ("b", 15), ("a", 20), ("a", 30), ("b", 35)]


def test_strategy_names_parse_and_typos_fail():
    s = strategies.get("stale_sb_3_e20")
    assert s.epochs == 20 and s.selective and s.selectivity == pytest.approx(1 / 3)
    assert s.name == "stale_sb_3_e20" and s.family == "stale_sb_3"
    assert strategies.get("traditional_e4").epochs == 4
    assert not strategies.get("traditional_e4").selective
    with pytest.raises(ValueError, match="unknown strategy"):
        strategies.get("sbb_0.3")


def test_a_screens_variant_unknown_to_the_report_names_the_script_that_knows_it():
    """A screen's runs (``run_variant``) reported by run.py itself: the report stopped at the
    first run with "unknown strategy 'default_rw1_fb': a registered name ... optionally
    followed by a budget", as for a typo, where only the screen's script registers it."""
    with pytest.raises(ValueError, match=r"registered only by its script \(run_variant\)"):
        strategies.get("default_rw1_fb")


def test_a_run_that_sat_at_chance_level_is_collapsed_even_if_it_recovered():
    healthy = make_run("x", 0, [(10, 0.40), (20, 0.12), (30, 0.09)])
    healthy.points[1]["position"] = 0.5  # a high error before the first epoch ends is fine
    assert not collapsed(healthy)
    stuck = make_run("x", 0, [(10, 0.90), (20, 0.90), (30, 0.74)])  # recovered part way
    assert collapsed(stuck)
    many = make_run("x", 0, [(10, 0.95), (20, 0.90)])
    many.classes = 100  # chance level on 100 classes is 99%
    assert not collapsed(many)
    nan = make_run("x", 0, [(10, 0.2), (20, float("nan"))])
    assert collapsed(nan)


def test_a_report_keeps_and_describes_the_recorded_machine_and_config(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    for name, curve in [("traditional", [(10, 0.2), (20, 0.1)]), ("sb_0.33", [(5, 0.1)])]:
        r = make_run(name, 0, curve)
        (runs / f"{r.key()}.json").write_text(json.dumps(dataclasses.asdict(r)))
    machine = {"cpu": "Recorded CPU", "cores": 16, "torch": "9.9", "torch_threads": 16}
    machine.update(gpu="Recorded GPU", numba="0", sbloader="0", date="then")
    (tmp_path / "machine.json").write_text(json.dumps(machine))
    cfg = dataclasses.asdict(Config(preset="gpu", device="cuda", model="resnet18"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert bench.main(["--preset", "quick", "--out", str(tmp_path), "--report-only"]) == 0
    assert json.loads((tmp_path / "machine.json").read_text()) == machine  # not overwritten
    summary = (tmp_path / "summary.md").read_text()
    assert "Recorded CPU" in summary and "Recorded GPU" in summary
    assert "resnet18 on cuda" in summary and "preset `gpu`" in summary
