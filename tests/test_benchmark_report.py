"""The per-example analysis of a benchmark: kept arrays, the numbers and report.html."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import sbloader
import sbloader.analysis as A
from benchmarks.analysis import write_analysis
from benchmarks.core import strategies
from benchmarks.core.arrays import KEYS, arrays_path, load_arrays, save_arrays
from benchmarks.core.config import Config
from benchmarks.core.findings import GALLERY, analyse, load_run_arrays
from benchmarks.core.records import Run, save_run
from benchmarks.core.scores import el2n_path, save_el2n
from benchmarks.core.train import Trainer

N, T, C = 200, 60, 10


def synthetic_arrays(rng, epochs=3, flipped=(), selected=None, times=(10.0, 20.0, 30.0)):
    """A run's arrays with known contents: evaluation i of len(times) at position i + 1."""
    e = len(times)
    targets = rng.integers(0, C, T)
    logits = rng.normal(size=(T, C)).astype(np.float32)
    probs = torch.softmax(torch.from_numpy(logits).double(), 1).numpy()
    labels = rng.integers(0, C, N)
    return dict(
        eval_position=np.arange(1.0, e + 1),
        eval_time_s=np.array(times),
        eval_confidence=np.stack([rng.random(T) for _ in range(e)]).astype(np.float16),
        eval_predicted=np.stack([rng.integers(0, C, T) for _ in range(e)]).astype(np.int16),
        test_logits=logits,
        test_targets=targets,
        selected=(
            rng.integers(0, 2, (epochs, N)).astype(np.uint8) if selected is None else selected
        ),
        seen=np.full(N, epochs, dtype=np.int32),
        last_loss=rng.random(N).astype(np.float32),
        train_loss=rng.random(N).astype(np.float32),
        labels=labels,
        flipped=np.asarray(flipped, dtype=np.int64),
        _probs=probs,
    )


def write_run(folder, strategy, noise, arrays, final_time):
    run = Run(strategy, 0, noise, planned_epochs=3)
    run.points = [dict(position=0.0, time_s=0.0, error=1.0, backprops=0, selections=0)]
    run.points += [
        dict(position=float(p), time_s=float(t), error=0.5, backprops=0, selections=0)
        for p, t in zip(arrays["eval_position"], arrays["eval_time_s"])
    ]
    run.final_error, run.train_s = 0.5, final_time
    run.epochs = [
        dict(epoch=e, examples_yielded=100, class_selection_rates=[0.5] * (C - 1) + [None])
        for e in range(3)
    ]
    run.arrays = {k: v for k, v in arrays.items() if not k.startswith("_")}
    save_run(run, folder / "runs")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A benchmark folder as the analysis preset leaves it, with synthetic contents: SB (its
    final evaluation at 19 s), Traditional (evaluated at 10, 20 and 30 s), SB with 10% flipped
    labels that selects exactly the flipped examples, EL2N of two models, the run's figures."""
    tmp_path = tmp_path_factory.mktemp("bench")
    rng = np.random.default_rng(0)
    (tmp_path / "runs").mkdir()
    cfg = Config(preset="analysis", epochs=3, el2n_archs=("small_cnn", "mlp"), keep_outputs=True)
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    write_run(tmp_path, "traditional", 0.0, synthetic_arrays(rng), 30.0)
    write_run(tmp_path, "sb_0.33_rwarmup", 0.0, synthetic_arrays(rng, times=(7, 13, 19)), 19.0)
    flipped = np.arange(0, N, 10)
    selected = np.zeros((3, N), dtype=np.uint8)
    selected[1:, flipped] = 1
    noisy = synthetic_arrays(rng, flipped=flipped, selected=selected, times=(7, 13, 19))
    write_run(tmp_path, "sb_0.33_rwarmup", 0.1, noisy, 19.0)
    for model in cfg.el2n_archs:
        scores = rng.random(N)
        result = sbloader.EL2NResult(scores, 1.0, N, N, 1, 1)
        save_el2n(el2n_path(tmp_path, model, 0), result)
    (tmp_path / "summary.md").write_text(
        "# sbloader benchmark\n\nSome `code` and **bold**.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    fig.savefig(tmp_path / "fig7_error_vs_time.png")
    plt.close(fig)
    write_analysis(tmp_path, images=images())  # once for the tests below (about 10 s)
    return tmp_path


def images():
    x = np.random.default_rng(1).random((N, 1, 28, 28)).astype(np.float32)
    return x, np.random.default_rng(2).integers(0, C, N)


def test_report_links_only_local_files_that_exist_and_shows_every_figure(folder):
    text = (folder / "report.html").read_text()
    links = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', text, flags=re.I)
    images_linked = [u for u in links if u.endswith(".png")]
    assert len(images_linked) == len(set(images_linked)) >= 13
    for url in links:
        assert not re.match(r"^[a-z]+:|^//", url, flags=re.I), url  # no http(s), data-free
        if not url.startswith("#"):
            assert (folder / url).is_file(), url
    assert "fig7_error_vs_time.png" in images_linked  # the run's own figure
    assert "fig14_pareto.png" not in text  # absent, so not linked
    for name in (
        "fig8_confidence_cdf",
        "fig9_accuracy_by_confidence",
        "overlap",
        "selection_frequency",
        "selection_stability",
        "class_rates",
        "gallery_easiest",
        "gallery_hardest",
        "gallery_least_used",
        "gallery_most_used",
        "gallery_lowest_combined_rank",
    ):
        assert f"analysis/{name}.png" in images_linked, name
    # Every figure's title is in the page; no external resource of any kind.
    for title in re.findall(r'alt="([^"]+)"', text):
        assert f"<strong>{title}.</strong>" in text
    assert not re.search(r"https?://|<script|<link|@import|url\(", text, flags=re.I)
    # summary.md's table and inline markup became HTML.
    assert "<th>a</th><th>b</th>" in text and "<td>1</td><td>2</td>" in text
    assert "<code>code</code>" in text and "<strong>bold</strong>" in text


def test_numbers_are_those_of_the_chosen_runs(folder):
    numbers = json.loads((folder / "analysis.json").read_text())
    # The noisy SB run selected exactly the 20 flipped examples, 10% of 200: all of its 10%
    # most selected are flipped, against 10% expected at random.
    assert numbers["flipped share among the 10% most selected (10% flipped)"] == 1.0
    assert numbers["flipped share expected at random (10% flipped)"] == pytest.approx(0.1)
    assert numbers["overlap at 10%: two random rankings"] == pytest.approx(0.1)
    loaded = load_run_arrays(folder)
    an = analyse(loaded, {}, seed=0)
    sb, same_epochs, same_time = an.evaluations
    assert sb.time_s == 19.0 and sb.position == 3.0
    assert same_epochs.position == 3.0 and same_epochs.time_s == 30.0  # its final evaluation
    assert same_time.time_s == 20.0 and same_time.position == 2.0  # the nearest to 19 s
    trad = next(x for x in loaded if x.run.strategy == "traditional")
    conf = trad.arrays["eval_confidence"][1].astype(np.float64)
    correct = trad.arrays["eval_predicted"][1] == trad.arrays["test_targets"]
    acc = A.binned_accuracy(conf, correct, 20).accuracy[3]  # the bin ending at p20
    name = "accuracy in the 15-20th confidence percentiles: Traditional, same wall-clock"
    key = [k for k in numbers if k.startswith(name)]
    assert numbers[key[0]] == pytest.approx(acc)
    least = np.argsort(conf, kind="stable")[: round(0.2 * T)]
    name = "accuracy of the 20% least confident: Traditional, same wall-clock"
    key = [k for k in numbers if k.startswith(name)]
    assert numbers[key[0]] == pytest.approx(correct[least].mean())
    # SB's counts leave out its warm-up epoch.
    sb_run = next(x for x in loaded if x.run.strategy.startswith("sb") and x.run.noise == 0)
    assert an.warmup == 1
    assert an.counts.tolist() == sb_run.arrays["selected"][1:].sum(0).tolist()
    assert [len(g.indices) for g in an.galleries] == [GALLERY] * 4  # no EL2N given here
    assert an.class_rates.shape == (3, C) and np.isnan(an.class_rates[:, -1]).all()


@pytest.mark.parametrize(
    ("name", "warmup"),
    [
        ("sb_0.33_rwarmup", 1),
        ("stale_sb_3_rwarmup_fb", 1),  # a suffix after the variant's
        ("stale_sb_3_rwarmup_fb_int8", 1),
        ("recipe_anneal_fb", 1),  # the recipe's Random-Backprop epoch
        ("sb_0.33", 0),
        ("sb_0.33_anneal", 0),
    ],
)
def test_the_warm_up_left_out_of_sbs_counts_is_its_policys(name, warmup):
    """The analysis leaves a run's warm-up epochs out of SB's selection counts; it read them
    from the name's ending, so a Stale-SB run with feedback (``..._rwarmup_fb``) or a recipe
    had its Random-Backprop epoch counted as SB's selections."""
    from benchmarks.core.findings import _warmup

    assert _warmup(name, 3) == warmup


def test_arrays_round_trip_and_are_checked(tmp_path):
    arrays = synthetic_arrays(np.random.default_rng(0), flipped=[3, 5])
    arrays.pop("_probs")
    path = save_arrays(tmp_path / "r.npz", arrays)
    back = load_arrays(path)
    assert sorted(back) == sorted(arrays)
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k
    with pytest.raises(ValueError, match="missing"):
        save_arrays(tmp_path / "s.npz", {k: v for k, v in arrays.items() if k != "selected"})
    np.savez(tmp_path / "old.npz", format=np.array(0), **arrays)
    with pytest.raises(ValueError, match="format 0"):
        load_arrays(tmp_path / "old.npz")


def test_binned_accuracy_matches_accuracy_by_percentile():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(103, 5))
    targets = rng.integers(0, 5, 103)
    conf = A.target_confidence(logits, targets, logits=True)
    correct = logits.argmax(1) == targets
    want = A.accuracy_by_percentile(logits, targets, 7, logits=True)
    got = A.binned_accuracy(conf, correct, 7)
    assert got.examples.tolist() == want.examples.tolist()
    assert np.array_equal(got.accuracy, want.accuracy)
    with pytest.raises(ValueError, match="correct should be booleans"):
        A.binned_accuracy(conf, correct.astype(int), 7)


@pytest.mark.parametrize("name", ["sb_0.33_rwarmup", "stale_sb_3"])
def test_a_trainer_keeps_what_the_analysis_needs(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1, 28, 28, generator=g)
    y = torch.randint(0, C, (256,), generator=g)
    xt, yt = torch.randn(50, 1, 28, 28, generator=g), torch.randint(0, C, (50,), generator=g)
    cfg = Config(
        epochs=2, eval_every=1.0, keep_outputs=True, batch_size=32, pool_batch_size=64, threads=1
    )
    trainer = Trainer(cfg, strategies.get(name), 0, 0.1, (x, y, xt, yt))
    run = trainer.train()
    a = run.arrays
    assert a is not None and set(KEYS) <= set(a)
    # Every yielded example counted in its epoch, exactly once per yield.
    assert a["selected"].shape == (2, 256)
    assert a["selected"].sum(1).tolist() == [e["examples_yielded"] for e in run.epochs]
    assert (a["seen"] == 2).all()
    # The flipped labels: 10%, and the labels trained on differ there only.
    assert len(a["flipped"]) == round(0.1 * 256)
    assert np.flatnonzero(a["labels"] != y.numpy()).tolist() == a["flipped"].tolist()
    # Test outputs at every evaluation; the last are the final model's, and its error.
    assert a["eval_position"].tolist() == [1.0, 2.0]
    assert a["eval_time_s"].tolist() == [p["time_s"] for p in run.points[1:]]
    probs = torch.softmax(torch.from_numpy(a["test_logits"]).double(), 1).numpy()
    conf = probs[np.arange(50), yt.numpy()]
    assert np.allclose(a["eval_confidence"][-1], conf, atol=1e-3)
    assert (a["eval_predicted"][-1] != yt.numpy()).mean() == run.final_error
    assert np.isfinite(a["train_loss"]).all() and a["test_targets"].tolist() == yt.tolist()
    if name == "stale_sb_3":  # the policy's store: selections counted as the loader chose
        assert a["store_selected"].sum() == sum(e["examples_selected"] for e in run.epochs)
        assert (a["store_epoch"] == 0).all()  # every example scored in the fresh epoch 0
    else:
        assert "store_selected" not in a
        assert np.isnan(a["last_loss"][a["selected"][1:].sum(0) == 0]).all()  # never measured


def test_the_saved_run_keeps_its_arrays_next_to_its_json(tmp_path):
    run = Run("traditional", 0, 0.0, 1)
    run.arrays = synthetic_arrays(np.random.default_rng(0))
    run.arrays.pop("_probs")
    json_path = save_run(run, tmp_path)
    assert "arrays" not in json.loads(json_path.read_text())
    assert arrays_path(json_path).is_file()
    assert load_arrays(arrays_path(json_path))["labels"].tolist() == run.arrays["labels"].tolist()


def test_the_mlp_is_784_1024_1024_10():
    from benchmarks.core.models import make_model

    model = make_model(Config(model="mlp"))
    sizes = [(m.in_features, m.out_features) for m in model if isinstance(m, torch.nn.Linear)]
    assert sizes == [(784, 1024), (1024, 1024), (1024, 10)]
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_report_without_runs_names_the_fix(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(Config())))
    with pytest.raises(ValueError, match="keep_outputs"):
        write_analysis(tmp_path, images=images())


def test_analysis_preset_runs_both_models_and_label_noise():
    from benchmarks.core.config import preset

    cfg = preset("analysis")
    assert cfg.keep_outputs and cfg.el2n_archs == ("small_cnn", "mlp")
    assert 0.1 in cfg.label_noise and "traditional" in cfg.strategies
    assert set(cfg.noise_strategies) <= set(cfg.strategies)
    assert Path(arrays_path(Path("runs/x.json"))).suffix == ".npz"


def test_examples_pruned_before_a_run_are_not_counted_as_its_least_used():
    """A Diet-SB run never sees the examples EL2N pruned (EL2N's lowest, by construction);
    counted as selected 0 times, they were SB's "least used", so the SB-vs-EL2N overlap read
    far above chance on random selections (0.61 at 30% over random data, against 0.33 over the
    examples the run could choose from). They are left out: of the counts (NaN), of the
    overlap and its random baseline, of the galleries, and of the stability's random line."""
    rng = np.random.default_rng(1)
    el2n = rng.random(N)
    pruned = np.argsort(el2n)[: N // 2]  # EL2N's lowest half, never a candidate
    arrays = synthetic_arrays(rng, times=(7, 13, 19))
    arrays["selected"][:, pruned] = 0
    arrays["seen"][pruned] = 0
    from benchmarks.core.findings import FRACTIONS, Loaded

    run = Run("diet_sb", 0, 0.0, planned_epochs=3)
    run.epochs = [dict(epoch=e, examples_yielded=50) for e in range(3)]
    an = analyse([Loaded(run, arrays)], {"small_cnn": el2n}, sb="diet_sb")
    kept = np.setdiff1d(np.arange(N), pruned)
    assert np.isnan(an.counts[pruned]).all()
    assert an.counts[kept].tolist() == arrays["selected"].sum(0)[kept].tolist()
    curve = an.overlaps["SB least used vs EL2N small_cnn lowest"]
    expected = A.overlap_curve(an.counts[kept], el2n[kept], FRACTIONS, ties="expected")
    np.testing.assert_allclose(curve, expected)
    i = int(np.argmin(np.abs(FRACTIONS - 0.3)))
    assert abs(curve[i] - 0.3) < 0.15  # random selections: near chance, not near 1
    np.testing.assert_allclose(an.random_overlap, A.random_overlap(kept.size, FRACTIONS))
    for g in an.galleries:
        if g.title in ("Least used", "Most used", "Lowest combined rank"):
            assert np.isin(g.indices, kept).all(), g.title
    rates = (arrays["selected"][:, kept] > 0).mean(axis=1)  # the share of the candidates
    p, q = rates[:-1], rates[1:]
    np.testing.assert_allclose(an.stability_random, p * q / (p + q - p * q))
