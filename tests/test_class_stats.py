"""Per-epoch selection rate by class in ``loader.stats``: known counts from a known policy."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import N_CLASSES, EncodedDataset, IndexLoss
from torch.utils.data import DataLoader

import sbloader
from sbloader.datasets import ArrayDataset
from sbloader.policies import Choice, Policy
from sbloader.stats import EpochStats, LoaderStats


class KeepLowResidues(Policy):
    """Keeps the candidates whose dataset index i has i % 8 < 3: of EncodedDataset's classes
    (i % 4), half of classes 0, 1 and 2, and none of class 3."""

    def needs_indices(self) -> bool:
        return True

    def choose(self, losses, indices, rng, n):
        keep = np.flatnonzero(indices % 8 < 3).astype(np.int64)
        return Choice(keep, np.ones(n), np.ones(len(keep)))


def run_epochs(policy, epochs=2, n=200, batch_size=8, **kw):
    source = DataLoader(
        EncodedDataset(n), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    loader = sbloader.SelectiveLoader(
        source, IndexLoss(), policy=policy, batch_size=batch_size, seed=0, **kw
    )
    for _ in range(epochs):
        for _batch in loader:
            pass
    return loader


def test_class_counts_and_rates_of_a_known_policy():
    loader = run_epochs(KeepLowResidues())
    for e in loader.stats.epochs:
        assert e.class_seen.tolist() == [50, 50, 50, 50]
        assert e.class_selected.tolist() == [25, 25, 25, 0]
        assert e.class_selection_rates.tolist() == [0.5, 0.5, 0.5, 0.0]
        assert int(e.class_selected.sum()) == e.examples_selected
    total = loader.stats.total
    assert total.class_seen.tolist() == [100] * 4
    assert total.class_selected.tolist() == [50, 50, 50, 0]
    d = loader.stats.current.as_dict()
    assert d["class_selection_rates"] == [0.5, 0.5, 0.5, 0.0]
    assert d["class_seen"] == [50] * 4 and d["class_selected"] == [25, 25, 25, 0]


@pytest.mark.parametrize("batch_size", [8, 32])
def test_traditional_selects_every_class_fully(batch_size):
    """Every example counts as selected, also where a source batch of batch_size (32) is
    handed out whole (the fast path) rather than re-batched."""
    loader = run_epochs(sbloader.Traditional(), epochs=1, n=90, batch_size=batch_size)
    e = loader.stats.current
    assert e.class_seen.tolist() == np.bincount(np.arange(90) % N_CLASSES).tolist()
    assert e.class_selected.tolist() == e.class_seen.tolist()
    assert e.class_selection_rates.tolist() == [1.0] * N_CLASSES
    assert e.examples_seen == e.examples_selected == e.examples_yielded == 90
    assert e.selection_rate == 1.0 and e.dropped == 0
    assert e.batches_yielded == -(-90 // batch_size)  # (90 = 32 + 32 + 26 at 32)


def test_sb_rates_follow_the_losses():
    # IndexLoss: loss grows with the index; with labels by index range the high classes are
    # the hard ones, and SB must select them at a higher rate than the easy ones.
    n = 400
    x = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 6)
    y = torch.arange(n) * N_CLASSES // n  # class 0: indices 0-99, ..., class 3: 300-399
    source = DataLoader(
        ArrayDataset(x, y), batch_size=100, shuffle=True, generator=torch.Generator().manual_seed(0)
    )

    class RangeLoss(IndexLoss):
        def forward(self, inputs):
            idx = inputs[:, 0]
            logits = torch.zeros(inputs.shape[0], N_CLASSES)
            logits[torch.arange(inputs.shape[0]), (idx.long() * N_CLASSES // n)] = 10 - idx / 40
            return logits + 0.0 * self.lin(inputs)

    loader = sbloader.SelectiveLoader(
        source, RangeLoss(), policy=sbloader.SelectiveBackprop(0.3), batch_size=10, seed=0
    )
    for _ in range(3):
        for _batch in loader:
            pass
    rates = loader.stats.total.class_selection_rates
    assert loader.stats.total.class_seen.tolist() == [300] * 4
    assert np.all(np.diff(rates) > 0), rates  # the easiest class is starved most


def test_epoch_log_line_shows_the_class_rates(caplog):
    with caplog.at_level(logging.INFO, logger="sbloader"):
        run_epochs(KeepLowResidues(), epochs=1)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 0:")]
    assert line and line[0].endswith("selection rate by class: 0:0.500 1:0.500 2:0.500 3:0.000")


def test_epoch_log_line_lists_up_to_20_classes_and_names_the_extremes_of_more(caplog):
    selected = {20: [1] * 19 + [2], 21: [1] * 5 + [0] + [1] * 14 + [2]}  # of 2 seen per class
    with caplog.at_level(logging.INFO, logger="sbloader"):
        for classes in (20, 21, 0):
            e = EpochStats(
                classes, class_seen=[2] * classes, class_selected=selected.get(classes, [])
            )
            LoaderStats().log_epoch(e)
    twenty, more, none = (r.getMessage() for r in caplog.records)
    assert twenty.endswith("by class: " + "".join(f"{c}:0.500 " for c in range(19)) + "19:1.000")
    assert more.endswith(
        "by class: lowest 0.000 (class 5), highest 1.000 (class 20), 21 classes seen"
    )
    assert "by class" not in none  # no class counted: nothing to list


def test_targets_that_are_not_cpu_class_indices_are_not_counted():
    for targets in (
        torch.rand(6),  # regression targets
        torch.zeros(6, 3, dtype=torch.int64),  # sequence labels
        torch.tensor([0, 1, -100, 2, 1, 0]),  # an ignore index
        [0, 1, 2, 0, 1, 2],  # not an array
        torch.tensor([True, False, True]),  # flags, not class indices
        np.array([0.0, 1.0, 2.0]),  # float values in a numpy array (bincount refused them)
        torch.tensor([0, 1, 2], device="meta"),  # not on the CPU (reading it would sync)
        torch.tensor([0, 1, 1 << 20]),  # integer values past the classes counted
        torch.tensor([0, 1_700_000_000_000]),  # a timestamp in ms (bincount: 12 TiB)
    ):
        e = EpochStats()
        e.count_classes(torch.tensor([0, 1, 1]), None)
        e.count_classes(targets, None)
        e.count_classes(torch.tensor([0, 1, 1]), None)  # stays unknown, never partial
        assert e.class_seen is None and e.class_selected is None
        assert e.class_selection_rates is None and e.as_dict()["class_selection_rates"] is None


def test_integer_regression_targets_train_without_class_counts():
    """Integer targets that are values, not classes (timestamps in ms), are not counted: a
    count by value was an array as long as the largest (here a MemoryError of 12 TiB)."""
    n = 32
    x = torch.randn(n, 4)
    y = torch.arange(n) + 1_700_000_000_000

    def loss_fn(out, t):
        return torch.nn.functional.mse_loss(
            out.squeeze(1), (t - 1_700_000_000_000).float(), reduction="none"
        )

    loader = sbloader.SelectiveLoader(
        DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16),
        torch.nn.Linear(4, 1),
        loss_fn,
        policy=sbloader.SelectiveBackprop(0.5),
        batch_size=4,
    )
    assert sum(len(b.indices) for b in loader) > 0
    assert loader.stats.current.class_seen is None
    assert loader.stats.current.class_selection_rates is None


def test_counts_of_growing_class_ranges_add_up_and_round_trip():
    s = LoaderStats()
    e = s.begin_epoch(0, 0.5)
    e.examples_seen = 5
    e.count_classes(np.array([0, 0, 1]), np.array([1]))
    e.count_classes(torch.tensor([3, 0]), np.array([0, 0]))  # Kath18 repeats: with multiplicity
    assert e.class_seen.tolist() == [3, 1, 0, 1]
    assert e.class_selected.tolist() == [1, 0, 0, 2]
    rates = e.class_selection_rates
    assert rates[:2].tolist() == [1 / 3, 0.0] and np.isnan(rates[2]) and rates[3] == 2.0
    restored = LoaderStats()
    restored.load_state_dict(s.state_dict())
    assert restored.current.as_dict() == e.as_dict()
    assert e.as_dict()["class_selection_rates"] == [1 / 3, 0.0, None, 2.0]  # JSON: no NaN
    assert restored.current.class_seen.tolist() == [3, 1, 0, 1]
    assert restored.current.class_selected.tolist() == [1, 0, 0, 2]
    assert all(isinstance(v, int) for v in s.state_dict()["epochs"][0]["class_seen"])


def test_counts_added_in_place_leave_the_arrays_they_came_from_and_the_totals_alone():
    given = np.array([1, 2], dtype=np.int64)
    e = EpochStats(class_seen=given, class_selected=given)
    e.count_classes(np.array([0, 1, 1]), np.array([0]))
    assert given.tolist() == [1, 2] and e.class_seen.tolist() == [2, 4]
    assert e.class_selected.tolist() == [2, 2]
    s = LoaderStats()
    first = s.begin_epoch(0, 1.0)
    first.count_classes(np.array([0, 1]), None)
    total = s.total.class_seen
    first.count_classes(np.array([1]), None)
    assert total.tolist() == [1, 1] and s.total.class_seen.tolist() == [1, 2]


def test_totals_and_derived_values_of_known_epochs_and_their_restored_state():
    """The totals sum every count and time field, weight the target rate by examples seen and
    keep class counts unknown where one epoch's are; an epoch that saw nothing has no selection
    rate (NaN, not 0); the overhead is what the selection, the source and the caller leave of the
    wall-clock (never negative); a restored state replaces the epochs held."""
    s = LoaderStats()
    assert s.current is None and np.isnan(s.begin_epoch(0, 0.25).selection_rate)
    first = s.current
    first.examples_seen, first.examples_selected, first.feedback = 30, 10, 7
    first.wall_s, first.selection_s, first.source_s, first.consumer_s = 10.0, 2.0, 3.0, 4.0
    first.selection_hidden_s = 0.5
    first.count_classes(np.array([0, 1]), None)
    second = s.begin_epoch(1, 1.0)
    second.examples_seen, second.examples_selected, second.feedback = 10, 10, 1
    second.wall_s, second.selection_s, second.source_s, second.consumer_s = 1.0, 0.5, 0.5, 0.5
    assert s.current is second and second.target_rate == 1.0
    assert first.overhead_s == 1.0 and second.overhead_s == 0.0  # (timers overlap: not -0.5)
    total = s.total
    assert (total.examples_seen, total.examples_selected, total.feedback) == (40, 20, 8)
    assert (total.wall_s, total.consumer_s, total.selection_hidden_s) == (11.0, 4.5, 0.5)
    assert total.target_rate == (0.25 * 30 + 1.0 * 10) / 40 and total.selection_rate == 0.5
    assert total.class_seen.tolist() == [1, 1]
    second.count_classes([1, 0], None)  # not an array: unknown, and so the total is unknown
    assert s.total.class_seen is None and s.total.class_selected is None
    restored = LoaderStats()
    restored.begin_epoch(5, 0.5)
    restored.load_state_dict(s.state_dict())
    assert [e.as_dict() for e in restored.epochs] == [e.as_dict() for e in s.epochs]


def test_stale_epochs_that_prefilter_report_no_rates():
    policy = sbloader.SelectiveBackprop(1 / 3, staleness=2)
    loader = run_epochs(policy, epochs=2)
    fresh, stale = loader.stats.epochs
    assert fresh.class_selection_rates is not None
    assert stale.prefiltered > 0 and stale.class_selection_rates is None
    assert stale.class_seen.sum() == stale.examples_seen - stale.prefiltered  # those loaded
