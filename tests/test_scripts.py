"""The example and the benchmark run end to end on real data (a small slice of it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import checkout_env
from tqdm import tqdm

from benchmarks.core import strategies
from benchmarks.core.config import Config
from benchmarks.core.data import load_data
from benchmarks.core.train import run_one
from sbloader.datasets import load_fashion_mnist

ROOT = Path(__file__).resolve().parents[1]

try:
    load_fashion_mnist("test")
    HAVE_DATA = True
except FileNotFoundError:
    HAVE_DATA = False

pytestmark = [
    pytest.mark.realdata,
    pytest.mark.skipif(not HAVE_DATA, reason="needs Debian's dataset-fashion-mnist"),
]


def test_the_example_trains_both_strategies_and_reports_counts(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "examples/train_fashion_mnist.py"), "--epochs", "3"]
    cmd += ["--train-examples", "2048", "--json", str(out)]
    cmd += ["--strategies", "traditional", "recipe", "sb"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=checkout_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert "sb epoch with a selection pass / Traditional epoch wall-clock" in proc.stdout
    results = json.loads(out.read_text())["results"]
    trad, recipe, sb = results["traditional"], results["recipe"], results["sb"]
    assert [r["backprop"] for r in trad] == [2048] * 3
    assert sb[0]["selection_forwards"] == 0  # the Random-Backprop warm-up epoch
    assert sb[1]["selection_forwards"] == sb[2]["selection_forwards"] == 2048
    # The default recipe: the warm-up, one selection pass, then (the last eighth of the 3
    # planned epochs, at least one) all the data.
    assert [r["selection_forwards"] for r in recipe] == [0, 2048, 0]
    assert recipe[2]["backprop"] == 2048
    for r in sb + recipe[:2]:  # about a third backpropagated, in full batches of 128
        assert 0.15 < r["backprop"] / 2048 < 0.5 and r["backprop"] % 128 == 0
    assert all(0 <= r["test_error"] <= 1 for r in trad + sb + recipe)


@pytest.mark.parametrize(
    "name", ["traditional", "stale_sb_3_rwarmup", "kath18", "diet_sb", "sb_0.33_int8"]
)
def test_a_benchmark_run_records_its_curve_costs_and_breakdown(name):
    cfg = Config(epochs=2, eval_every=1.0, el2n_epochs=1, el2n_models=1)
    x, y, xt, yt = load_data(cfg)
    data = (x[:2048], y[:2048], xt[:500], yt[:500])
    with tqdm(total=200, disable=True) as bar:
        run = run_one(cfg, strategies.get(name), 0, 0.0, data, bar)
    assert [p["position"] for p in run.points] == [0.0, 1.0, 2.0]
    times = [p["time_s"] for p in run.points]
    assert times == sorted(times) and run.train_s >= times[-1] - 1e-6
    assert run.final_error == run.points[-1]["error"]
    assert run.breakdown["forward"] > 0 and run.breakdown["backward"] > 0
    seen = sum(e["examples_seen"] for e in run.epochs)
    fresh = sum(e["selection_forwards"] for e in run.epochs)
    if name == "traditional":
        assert fresh == 0 and run.epochs[0]["examples_yielded"] == 2048
    elif name == "stale_sb_3_rwarmup":  # warm-up (no selection), then a fresh SB epoch
        assert [e["selection_forwards"] for e in run.epochs] == [0, 2048]
    elif name == "diet_sb":  # EL2N keeps 70%; its scoring is charged to the wall-clock
        assert seen == 2 * round(0.7 * 2048) and run.pre_cost["seconds"] > 0
        assert run.points[0]["time_s"] == pytest.approx(run.pre_cost["seconds"])
    else:
        assert fresh == seen


def test_the_benchmark_clock_counts_selection_passes_and_leaves_evaluation_out(monkeypatch):
    """Compute accounting (prior art: Composer counted unpruned samples, EL2N's code saved
    nothing): a run's training time holds every selection pass it paid for and none of its
    evaluations, which sleep here for a known time each."""
    import benchmarks.core.train as train

    pause = {"selection": 0.1, "evaluation": 0.4}
    slept = {"selection": 0.0, "evaluation": 0.0}
    evaluating = [False]

    class Slow(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled() and not evaluating[0]:  # a selection pass
                time.sleep(pause["selection"])
                slept["selection"] += pause["selection"]
            return self.inner(x)

    def slow_error_rate(*args, **kwargs):
        evaluating[0] = True
        try:
            time.sleep(pause["evaluation"])
            slept["evaluation"] += pause["evaluation"]
            return error_rate(*args, **kwargs)
        finally:
            evaluating[0] = False

    made, error_rate = train.seeded_model, train.error_rate
    monkeypatch.setattr(train, "seeded_model", lambda *a, **k: Slow(made(*a, **k)))
    monkeypatch.setattr(train, "error_rate", slow_error_rate)
    cfg = Config(epochs=2, eval_every=1.0)
    x, y, xt, yt = load_data(cfg)
    data = (x[:1024], y[:1024], xt[:200], yt[:200])
    trainer = train.Trainer(cfg, strategies.get("sb_0.33"), 0, 0.0, data)
    start = time.perf_counter()  # (the training loop's wall-clock, evaluations included)
    run = trainer.train()
    wall = time.perf_counter() - start
    assert slept["evaluation"] == 2 * pause["evaluation"]  # after epochs 1 and 2
    assert slept["selection"] >= 2 * pause["selection"]  # one pass an epoch at least
    assert run.breakdown["selection"] >= slept["selection"]
    parts = run.breakdown["selection"] + run.breakdown["forward"] + run.breakdown["backward"]
    assert run.train_s >= parts
    assert run.train_s <= wall - slept["evaluation"]
    assert run.eval_s >= slept["evaluation"]


@pytest.mark.parametrize("name", ["traditional_e2", "random_0.33_e3"])
def test_a_shorter_control_decays_its_learning_rate_over_its_own_budget(name, monkeypatch):
    """The fair controls: a shorter Traditional or Random-Backprop schedule decays to zero at
    the end of its own planned epochs (not part-way down a 10-epoch cosine), every step keyed
    on its position in the data."""
    import benchmarks.core.train as train

    used: list[tuple[float, float, float]] = []

    def recording(base_lr: float, position: float, total: float) -> float:
        lr = train_cosine(base_lr, position, total)
        used.append((position, total, lr))
        return lr

    train_cosine = train.cosine_lr
    monkeypatch.setattr(train, "cosine_lr", recording)
    cfg = Config(epochs=10, eval_every=1.0)
    x, y, xt, yt = load_data(cfg)
    data = (x[:1024], y[:1024], xt[:200], yt[:200])
    with tqdm(total=200, disable=True) as bar:
        run = run_one(cfg, strategies.get(name), 0, 0.0, data, bar)
    planned = run.planned_epochs
    assert planned == (2 if name == "traditional_e2" else 3)
    assert used and all(total == planned for _, total, _ in used)
    positions = [p for p, _, _ in used]
    assert positions == sorted(positions) and positions[-1] <= planned
    assert used[0][2] > 0.9 * cfg.lr  # starts near the peak (after its first candidates)
    assert used[-1][2] < 0.01 * cfg.lr  # the last step is at (nearly) zero


def test_the_ddp_example_keeps_two_ranks_in_step(tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    cmd += ["--standalone", str(ROOT / "examples/ddp_fashion_mnist.py"), "--epochs", "2"]
    cmd += ["--train-examples", "4096", "--json", str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=checkout_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["processes"] for r in rows] == [2, 2]
    for r in rows:
        ranks = r["per_rank"]
        assert ranks[0]["batches"] == ranks[1]["batches"] > 0  # equal steps on both ranks
        assert all(x["seen"] == 2048 for x in ranks)  # each rank its DistributedSampler half
        assert all(x["yielded"] == x["batches"] * 64 for x in ranks)  # full batches of 128 / 2
    assert rows[0]["selection_forwards"] == 0 and rows[1]["selection_forwards"] == 4096


def test_the_warm_up_trains_every_configuration_and_leaves_the_timed_runs_unchanged(tmp_path):
    """execute() warms every configuration up on a few batches before the timed runs (so that
    first-use costs of the process, numba's kernels and int8 quantization, fall on no run),
    records its seconds, says so in the summary, and the runs train exactly as without it."""
    import benchmarks.core.train as train
    from benchmarks.core.machine import machine_info
    from benchmarks.core.train import warm_up
    from benchmarks.run import execute, report

    cfg = Config(epochs=2, eval_every=1.0, strategies=("sb_0.33_int8",), interleave=True)
    x, y, xt, yt = load_data(cfg)
    data = (x[:1024], y[:1024], xt[:200], yt[:200])
    strat = strategies.get("sb_0.33_int8")
    with tqdm(total=200, disable=True) as bar:
        alone = run_one(cfg, strat, 0, 0.0, data, bar)
    # The warm-up trains each configuration, every planned epoch, on its few batches only.
    trained, real_train = [], train.Trainer.train

    def spy(self):
        out = real_train(self)
        trained.append((self.strat.name, self.loader.stats.total.examples_seen))
        return out

    # (two of each strategy's own source batches: the pool for SB, a training batch for
    # Traditional, which takes its source's batches as they come)
    few = min(2 * max(cfg.pool_batch_size, cfg.batch_size), 1024)
    assert few < 2048
    assert strategies.get("traditional").source_batch(cfg.pool_batch_size, cfg.batch_size) == 128
    big = (x[:2048], y[:2048], xt[:200], yt[:200])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train.Trainer, "train", spy)
        warm_up(cfg, [strat, strategies.get("traditional")], big)
    assert trained == [("sb_0.33_int8", 2 * few), ("traditional", 2 * 2 * cfg.batch_size)]
    machine = machine_info(exclude=tmp_path)
    (tmp_path / "runs").mkdir()
    execute(cfg, tmp_path, machine, data=data)
    recorded = json.loads((tmp_path / "warmup.json").read_text())
    assert recorded["runs"] == ["sb_0.33_int8"] and recorded["seconds"] > 0
    run = json.loads((tmp_path / "runs" / "sb_0.33_int8__s0__n0.json").read_text())
    assert [p["error"] for p in run["points"]] == [p["error"] for p in alone.points]
    assert [e["examples_selected"] for e in run["epochs"]] == [
        e["examples_selected"] for e in alone.epochs
    ]
    assert "a warm-up trained every configuration on a few batches" in report(
        cfg, machine, tmp_path
    )


def test_the_throughput_measure_pairs_raw_and_loader_epochs():
    """benchmarks/core/throughput.py (throughput.py, breakdown.py's section 3): the raw source
    and the loader alternate epoch by epoch, and every configuration gets a paired ratio."""
    import torch

    import benchmarks.core.throughput as tp
    import sbloader
    from benchmarks.core.config import measurement
    from benchmarks.core.sources import Sources

    cfg, m = measurement(True, examples=1024, throughput_epochs=2, warmup_batches=1)
    x = torch.randn(1024, 1, cfg.image_size, cfg.image_size)
    sources = Sources(x, torch.randint(0, 10, (1024,)), "cpu", ffcv=False)
    events: list[str] = []
    real_raw, real_iter = tp.raw_epoch, sbloader.SelectiveLoader.__iter__

    def raw(source, limit=None):
        events.append("raw" if limit is None else "raw warm-up")
        return real_raw(source, limit)

    def loader_epoch(self):
        events.append("loader")
        return real_iter(self)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tp, "raw_epoch", raw)
            mp.setattr(sbloader.SelectiveLoader, "__iter__", loader_epoch)
            rows = tp.throughput(cfg, m, sources, lambda line: None)
    finally:
        sources.close()
    # Per configuration: the warm-ups, then a raw epoch and a loader epoch in turn.
    per_config = ["raw warm-up", "loader"] + ["raw", "loader"] * m.throughput_epochs
    assert events == per_config * 4 * m.repeats
    got = {(r["source"], r["strategy"], r["prefetch"]) for r in rows}
    assert got == {("dataloader", s, p) for s in ("traditional", "sb") for p in (0, 1)}
    for r in rows:
        assert r["raw_examples_per_s"] > 0 and r["loader_examples_per_s"] > 0
        assert 0 < r["ratio"] <= r["ratio_without_forward"]
        assert (r["forward_share"] > 0) == (r["strategy"] == "sb")


def test_the_profile_section_ranks_functions_and_counts_sbloader_s_host_time(tmp_path):
    """breakdown.py's section 5: an SB and a Stale-SB epoch under cProfile, each written to its
    file, the top functions ranked by their own time, and the host time in sbloader's functions
    and the built-ins they called counted apart from the training step's."""
    import cProfile

    import torch

    import benchmarks.breakdown as bd
    from benchmarks.core.config import measurement
    from benchmarks.core.sources import Sources

    cfg, m = measurement(True, examples=1024, warmup_batches=1)
    x = torch.randn(1024, 1, cfg.image_size, cfg.image_size)
    sources = Sources(x, torch.randint(0, 10, (1024,)), "cpu", ffcv=False)
    try:
        rows = bd.profile(cfg, m, sources, tmp_path, lambda line: None)
    finally:
        sources.close()
    assert [r["strategy"] for r in rows] == ["sb", "stale_sb"]
    assert [r["epochs"] for r in rows] == [1, 2]
    for r in rows:
        text = (tmp_path / r["file"]).read_text()
        assert "function calls" in text and "Ordered by: internal time" in text
        own = [t["own_s"] for t in r["top"]]
        assert own == sorted(own, reverse=True) and len(own) == bd.PROFILE_TOP
        assert 0 < r["sbloader_python_s"] and 0 < r["sbloader_builtins_s"]
        assert r["sbloader_python_s"] + r["sbloader_builtins_s"] < sum(r["profiled_wall_s"])
        # The loader's entries: sbloader's functions and the built-ins they called, by caller;
        # together the two sums.
        loader = r["loader_top"]
        names = [t["function"] for t in loader]
        assert any(n.startswith("_source_step (epoch.py:") for n in names), names
        assert any(" <- " in t["function"] for t in loader)
        assert (
            sum(t["own_s"] for t in loader)
            <= r["sbloader_python_s"] + r["sbloader_builtins_s"] + 1e-9
        )
        assert "The loader's own entries" in text
    md = "\n".join(bd._profile_lines(rows))
    assert "**stale_sb**" in md and md.count("| function | calls |") == 2
    assert md.count("| loader function (or built-in <- its caller) |") == 2

    # A profile of code outside sbloader counts nothing as sbloader's.
    profiler = cProfile.Profile()
    profiler.enable()
    torch.randn(64, 64) @ torch.randn(64, 64)
    profiler.disable()
    import pstats

    assert bd._sbloader_seconds(pstats.Stats(profiler).stats) == (0.0, 0.0)


def test_the_profile_counts_the_benchmark_models_as_the_model_s_time():
    """sbloader/recipes.py holds the benchmark's models: their forward (and the convolutions it
    calls) is the model's time, not the loader's; sbloader/datasets.py's ArrayDataset is the
    source's."""
    import cProfile
    import pstats

    import torch

    import benchmarks.breakdown as bd
    from sbloader.datasets import ArrayDataset
    from sbloader.recipes import resnet18

    model = resnet18(in_channels=1)  # its blocks' forward is in recipes.py
    x = torch.randn(8, 1, 32, 32)
    model(x)
    profiler = cProfile.Profile()
    profiler.enable()
    data = ArrayDataset(x, torch.zeros(8, dtype=torch.long))
    for _ in range(3):
        model(x)
        data.__getitems__([0, 3, 5])
    profiler.disable()
    assert bd._sbloader_seconds(pstats.Stats(profiler).stats) == (0.0, 0.0)


def test_a_breakdown_variant_with_its_own_source_batch_makes_that_many_fewer_passes():
    """breakdown.py's ``_pool4096`` rows (the GPU's lever on the loader's own share): a variant
    with its own source batch draws pools of that size, so the same epoch makes proportionally
    fewer selection calls, and a Stale-SB variant is measured over its staleness cycle as the
    Stale-SB row is."""
    import torch

    import benchmarks.breakdown as bd
    from benchmarks.core.config import measurement
    from benchmarks.core.sources import Sources

    cfg, m = measurement(True, examples=512, warmup_batches=1, repeats=1, pool_batch_size=32)
    x = torch.randn(512, 1, cfg.image_size, cfg.image_size)
    sources = Sources(x, torch.randint(0, 10, (512,)), "cpu", ffcv=False)
    variants = {
        "sb_pool128": bd.Variant("sb", {}, True, 128),
        "stale_sb_pool128": bd.Variant("stale_sb", {}, True, 128),
    }
    try:
        measured = bd.breakdown(cfg, m, sources, lambda line: None, variants)
        rows = {r["strategy"]: r for r in measured}
    finally:
        sources.close()
    assert list(rows) == ["traditional", "sb", "stale_sb", "sb_pool128", "stale_sb_pool128"]
    assert rows["sb"]["source_batch"] == 32 and rows["sb_pool128"]["source_batch"] == 128
    assert rows["traditional"]["source_batch"] == cfg.batch_size
    calls = {k: r["runs"][0]["epochs"][0]["selection_calls"] for k, r in rows.items()}
    assert calls["sb"] == 512 // 32 and calls["sb_pool128"] == 512 // 128
    assert rows["stale_sb_pool128"]["measured_epochs"] == m.staleness > 1
    assert rows["sb_pool128"]["examples_seen"] == rows["sb"]["examples_seen"] == 512


def test_the_quantized_loader_report_names_the_refresh_the_loader_used():
    """quantized_selection.py --section loader: the report states how often the int8 copies were
    rebuilt. QuantizedSelection() refreshes every 16,384 candidates with ``refresh_every``
    None, which the report printed as ``refresh_every=None``, as if the copy were never
    refreshed; reports saved with ``refresh_every`` alone still read as they ran."""
    import dataclasses

    import sbloader
    from benchmarks.core.config import measurement
    from benchmarks.quantized_selection import loader_markdown, refresh_setting

    default = sbloader.QuantizedSelection()
    cfg, m = measurement(True)
    row = {"way": "sb int8", "round": 0, "wall_s": 1.0, "c": 0.1, "k": 0.3, "refreshes": 1.0}
    report = {
        "threads": 1,
        "machine": {"cpu": "x", "torch": "t", "git_commit": "abc", "date": "d"},
        "config": {"setting": dataclasses.asdict(cfg), "measurement": dataclasses.asdict(m)},
        "quantized_selection": dataclasses.asdict(default),
        "rounds": [row],
    }
    text = loader_markdown(report)
    assert "refresh_every=None" not in text
    assert (
        f"quantize_selection=True (refreshed every {default.refresh_examples} candidates, "
        f"calibrated on {default.calibration_examples} candidates)"
    ) in text
    batches = dataclasses.asdict(sbloader.QuantizedSelection(refresh_every=8))
    assert refresh_setting({"quantized_selection": batches}).startswith(
        "refreshed every 8 source batches"
    )
    assert refresh_setting({"refresh_every": 32}) == "refreshed every 32 source batches"
    assert "16384 candidates" in refresh_setting({"refresh_every": None})


@pytest.mark.parametrize(
    "flags, fix",
    [
        (["--gpu"], "pass --device cpu to try --gpu's settings"),
        (["--device", "cuda"], "pass --device cpu"),
    ],
)
def test_breakdown_on_cuda_without_a_gpu_is_refused_naming_the_fix(
    tmp_path, monkeypatch, capsys, flags, fix
):
    """breakdown.py --gpu (or --device cuda) where torch has no CUDA device: refused at once,
    naming the option and the fix, before any data is loaded or the results folder is made
    (torch's "Torch not compiled with CUDA enabled" came from deep in the sources' set-up)."""
    import torch

    import benchmarks.breakdown as bd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    argv = [
        str(out),
        *flags,
        "--quick",
        "--no-ffcv",
        "--examples",
        "512",
        "--sections",
        "selection",
    ]
    with pytest.raises(SystemExit) as raised:
        bd.main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert f"{' '.join(flags)} measures on a CUDA GPU" in err and fix in err
    assert not out.exists()


def test_a_breakdown_variant_warms_up_with_its_own_options():
    """breakdown.py: each configuration's untimed warm-up runs with the measured loader's
    options, so that a variant's first-use costs (``decisions="device"``'s kernels,
    ``overlap_selection``'s thread and model copy) are not timed; the warm-up ran every variant
    with the default options."""
    import torch

    import benchmarks.breakdown as bd
    from benchmarks.core.config import measurement
    from benchmarks.core.sources import Sources

    cfg, m = measurement(True, examples=256, warmup_batches=1, repeats=1, pool_batch_size=64)
    x = torch.randn(256, 1, cfg.image_size, cfg.image_size)
    sources = Sources(x, torch.randint(0, 10, (256,)), "cpu", ffcv=False)
    variants = {
        "sb_device": bd.Variant("sb", {"decisions": "device"}, True),
        "sb_overlap": bd.Variant("sb", {"overlap_selection": True}, True),
    }
    made: list[dict] = []
    real = bd.make_loader

    def spy(cfg, source, model, policy, seed, **kw):
        made.append(kw)
        return real(cfg, source, model, policy, seed, **kw)

    try:
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="overlap_selection=True with")
            mp.setattr(bd, "make_loader", spy)
            bd.breakdown(cfg, m, sources, lambda line: None, variants)
    finally:
        sources.close()
    # Per configuration: the warm-up's loader, then the measured one.
    assert len(made) == 2 * (3 + len(variants))
    warmed, measured = made[0::2], made[1::2]
    assert warmed == measured
    assert {"decisions": "device"} in warmed and {"overlap_selection": True} in warmed


def test_throughput_py_takes_the_thread_setting_of_the_other_benchmarks(tmp_path, monkeypatch):
    """throughput.py re-runs breakdown.py's section 3 and takes its ``--threads`` as the other
    benchmark scripts do: set before anything is measured, recorded in the configuration and
    stated in the report (it had no such option, so its figures ran at torch's default)."""
    import torch

    import benchmarks.throughput as tp

    seen = []

    def measure(cfg, m, sources, log):
        seen.append((cfg.threads, torch.get_num_threads()))
        return []

    before = torch.get_num_threads()
    monkeypatch.setattr(tp, "throughput", measure)
    try:
        assert tp.main([str(tmp_path), "--runs", "1", "--no-ffcv", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [(1, 1)]
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert report["config"]["setting"]["threads"] == 1
    assert report["machine"]["torch_threads"] == 1
    assert "(1 threads)" in (tmp_path / "throughput.md").read_text()


def test_quantized_selection_records_what_it_measured_with_its_results(tmp_path, monkeypatch):
    """quantized_selection.py (the forwards section): quantized.json holds the configuration
    with the results (the partial training, the held-out examples ranked, the rounds), as every
    benchmark's does; it held the threads, the machine and the rows only."""
    import torch

    import benchmarks.quantized_selection as qs

    class Way:  # stand-ins for what is timed: this test is about the record
        def __init__(self, name, model, chunks, **kw):
            self.name, self.refresh_s, self.warmup_s = name, None, 0.0

        def run(self):
            return 1e-6

        def losses(self, x, y):
            return torch.arange(len(y), dtype=torch.float32)

    class TrainingStep:
        def __init__(self, *args):
            pass

        def run(self):
            return 1e-5

    monkeypatch.setattr(qs, "Way", Way)
    monkeypatch.setattr(qs, "TrainingStep", TrainingStep)
    before = torch.get_num_threads()
    try:
        argv = [str(tmp_path), "--threads", "1", "--train-examples", "128", "--rounds", "1"]
        assert qs.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    record = json.loads((tmp_path / "quantized.json").read_text())
    config = record["config"]
    assert config["train_examples"] == 128 and config["rounds"] == 1
    assert config["held_out_examples"] == config["measurement"]["option_batches"] * 512
    assert config["setting"]["channels_last"] is True
    assert record["rows"][0]["spearman_vs_fp32"] == 1.0
