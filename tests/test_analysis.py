"""sbloader.analysis against answers computed by hand: ties, uneven bins, empty sets, bad input."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

import sbloader
from sbloader import ExampleStore
from sbloader.analysis import (
    accuracy_by_percentile,
    binned_accuracy,
    combined_rank,
    confidence_percentiles,
    flipped_share,
    gallery_indices,
    overlap_curve,
    random_overlap,
    random_overlap_band,
    selection_frequency,
    selection_stability,
    store_selection_frequency,
    target_confidence,
)

nan = float("nan")


def same(actual, expected) -> None:
    """Equal values (NaN equal to NaN) and float64 dtype."""
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-12)


def test_module_is_exported_as_a_module_only():
    assert sbloader.analysis.overlap_curve is overlap_curve
    assert "overlap_curve" not in dir(sbloader)


# --- target confidence ----------------------------------------------------------------------------


def test_target_confidence_from_probabilities_and_from_logits():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    same(target_confidence(probs, [0, 1]), [0.7, 0.1])
    # softmax([0, ln 3]) = [1/4, 3/4]; huge equal logits stay finite.
    logits = np.array([[0.0, np.log(3.0)], [1000.0, 1000.0]])
    same(target_confidence(logits, [1, 0], logits=True), [0.75, 0.5])


def test_target_confidence_accepts_torch_tensors():
    logits = torch.tensor([[0.0, np.log(3.0)]], dtype=torch.float32, requires_grad=True)
    out = target_confidence(logits, torch.tensor([0]), logits=True)
    assert out.dtype == np.float64
    assert out[0] == pytest.approx(0.25, abs=1e-6)
    bf16 = torch.tensor([[0.5, 0.5]], dtype=torch.bfloat16)
    assert target_confidence(bf16, torch.tensor([1])).tolist() == [0.5]


@pytest.mark.parametrize(
    "outputs, targets, logits, error, match",
    [
        ([[2.0, -1.0]], [0], False, ValueError, r"probabilities in \[0, 1\].*logits=True"),
        ([[0.0, 1.5]], [0], False, ValueError, r"probabilities in \[0, 1\].*\[0, 1.5\]"),
        ([[0.5, 0.45]], [0], False, ValueError, "sum to 1.*row 0 sums to 0.95"),
        ([[0.5, 0.2]], [0], False, ValueError, "sum to 1.*row 0 sums to 0.7.*logits=True"),
        ([[0.5, 0.5]], [2], False, ValueError, r"class indices in \[0, 2\).*targets\[0\]=2"),
        ([[0.5, 0.5]], [-1], False, ValueError, r"targets\[0\]=-1"),
        ([[0.5, 0.5]], [1.0], False, TypeError, "integer class indices"),
        ([[0.5, 0.5]], [0, 1], False, ValueError, r"targets should have shape \(1,\)"),
        ([0.5, 0.5], [0], False, ValueError, r"shape \(examples, classes\)"),
        ([[nan, 0.0]], [0], True, ValueError, "non-finite values in 1 rows"),
    ],
)
def test_target_confidence_refuses_bad_input(outputs, targets, logits, error, match):
    with pytest.raises(error, match=match):
        target_confidence(np.array(outputs), np.array(targets), logits=logits)


@pytest.mark.parametrize("logits", ["False", "no", 1, None])
def test_logits_flag_that_is_not_a_bool_is_refused(logits):
    # "False" is truthy: probabilities were read as logits and softmaxed again (0.9 -> 0.69).
    probs = np.array([[0.9, 0.1], [0.2, 0.8]])
    with pytest.raises(TypeError, match="logits should be True or False"):
        target_confidence(probs, [0, 1], logits=logits)
    with pytest.raises(TypeError, match="logits should be True or False"):
        accuracy_by_percentile(probs, [0, 1], logits=logits)


def test_confidence_percentiles_are_the_inverse_cdf_with_ties():
    # Sorted: 0.1 0.1 0.3 0.5 0.9 (N = 5): percentile p gives the ceil(p/100 * 5)-th value.
    confidence = [0.5, 0.1, 0.1, 0.9, 0.3]
    grid = [0, 20, 21, 40, 41, 60, 61, 80, 81, 100]
    expected = [0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.5, 0.5, 0.9, 0.9]
    same(confidence_percentiles(confidence, grid), expected)
    default = confidence_percentiles(confidence)
    assert default.shape == (101,)
    assert default[0] == 0.1 and default[100] == 0.9
    assert (np.diff(default) >= 0).all()
    same(confidence_percentiles(confidence, [50], method="linear"), [0.3])


def test_confidence_percentiles_of_no_examples_are_nan():
    same(confidence_percentiles([], [0, 50, 100]), [nan, nan, nan])
    same(confidence_percentiles(np.zeros(0)), np.full(101, nan))


def test_confidence_percentiles_refuse_bad_input():
    with pytest.raises(ValueError, match=r"percentiles should be in \[0, 100\], but got 150"):
        confidence_percentiles([0.5], [150])
    with pytest.raises(ValueError, match=r"confidence has 1 NaN .*with a confidence"):
        confidence_percentiles([0.5, nan])
    with pytest.raises(ValueError, match="method should be one of"):
        confidence_percentiles([0.5], method="median")


@pytest.mark.parametrize("bad", [1.7, -0.2, np.inf])
def test_confidences_that_are_no_probabilities_are_refused_naming_target_confidence(bad):
    """Logits or losses passed as confidences were binned and ranked as given, unsaid."""
    match = r"confidence should hold probabilities in \[0, 1\], but has 1 outside it .*logits"
    with pytest.raises(ValueError, match=match):
        confidence_percentiles([0.5, bad, 1.0, 0.0])
    with pytest.raises(ValueError, match=match):
        binned_accuracy([0.5, bad], [True, False], 2)
    assert confidence_percentiles([0.0, 1.0], [0, 100]).tolist() == [0.0, 1.0]  # (the bounds)


def _three_class_rows():
    """Seven examples of target 0; confidence (and whether argmax is right), by index:
    0: 0.4 right, 1: 0.1 wrong, 2: 0.4 wrong, 3: 0.9 right, 4: 0.2 wrong, 5: 0.4 wrong, 6: 0.6
    right. Sorted, ties by index: 1 4 0 | 2 5 | 6 3 (7 into 3 bins: 3, 2, 2)."""
    probs = np.array(
        [
            [0.4, 0.3, 0.3],
            [0.1, 0.45, 0.45],
            [0.4, 0.5, 0.1],
            [0.9, 0.05, 0.05],
            [0.2, 0.7, 0.1],
            [0.4, 0.1, 0.5],
            [0.6, 0.2, 0.2],
        ]
    )
    return probs, np.zeros(7, dtype=np.int64)


def test_accuracy_by_percentile_splits_ties_by_index_and_puts_extras_first():
    probs, targets = _three_class_rows()
    result = accuracy_by_percentile(probs, targets, bins=3)
    assert result.examples.dtype == np.int64
    assert result.examples.tolist() == [3, 2, 2]
    same(result.accuracy, [1 / 3, 0.0, 1.0])
    # The same from logits (argmax and ranking are unchanged by the softmax).
    from_logits = accuracy_by_percentile(
        torch.tensor(np.log(probs)), torch.tensor(targets), 3, logits=True
    )
    same(from_logits.accuracy, [1 / 3, 0.0, 1.0])


def test_accuracy_by_percentile_with_more_bins_than_examples_and_none():
    probs = np.array([[0.9, 0.1], [0.3, 0.7]])
    result = accuracy_by_percentile(probs, [1, 1], bins=4)
    assert result.examples.tolist() == [1, 1, 0, 0]
    same(result.accuracy, [0.0, 1.0, nan, nan])
    empty = accuracy_by_percentile(np.zeros((0, 3)), np.zeros(0, dtype=np.int64), bins=2)
    assert empty.examples.tolist() == [0, 0]
    same(empty.accuracy, [nan, nan])
    with pytest.raises(ValueError, match="bins should be >= 1, but got bins=0"):
        accuracy_by_percentile(probs, [1, 1], bins=0)


# --- selection frequency --------------------------------------------------------------------------


def test_selection_frequency_over_a_run_and_a_window():
    same(selection_frequency([0, 2, 3, 0, 1], [4, 4, 4, 0, 2]), [0.0, 0.5, 0.75, nan, 0.5])
    # Window: selected 1 -> 1, 2 -> 5, 0 -> 0; seen 3 -> 6 for all: 0/3, 3/3, 0/3.
    same(selection_frequency([1, 5, 0], 6, selected_before=[1, 2, 0], seen_before=3), [0, 1, 0])
    # Seen only before the window: NaN in it, not 0.
    same(
        selection_frequency([2, 2], [3, 4], selected_before=[2, 1], seen_before=[3, 2]), [nan, 0.5]
    )


def test_selection_frequency_from_a_store_with_known_counts():
    store = ExampleStore(5)
    # Epoch 1 selects 0, 1, 1 (a repeat counts again); epoch 2 selects 1, 3; example 4 never seen.
    store.record(np.arange(4), np.ones(4), epoch=0)  # (a selection pass scores what it draws)
    store.count_selected(np.array([0, 1, 1]))
    snapshot = store.state_dict()
    column = store.selected.copy()
    store.count_selected(np.array([1, 3]))
    seen = np.array([2, 2, 2, 2, 0])
    same(store_selection_frequency(store, seen), [0.5, 1.5, 0.0, 0.5, nan])
    same(store_selection_frequency(store.state_dict(), seen), [0.5, 1.5, 0.0, 0.5, nan])
    same(store_selection_frequency(store.selected, seen), [0.5, 1.5, 0.0, 0.5, nan])
    # Epoch 2 alone: from a state_dict snapshot or a copy of the column.
    window = [0.0, 1.0, 0.0, 1.0, nan]
    same(store_selection_frequency(store, seen, before=snapshot, seen_before=seen // 2), window)
    same(store_selection_frequency(store, seen // 2, before=column), window)


def test_selection_frequency_from_a_memory_mapped_store(tmp_path):
    store = ExampleStore(3, path=tmp_path)
    store.record(np.arange(3), np.ones(3), epoch=0)
    store.count_selected(np.array([2, 2, 0]))
    same(store_selection_frequency(store, 4), [0.25, 0.0, 0.5])
    same(store_selection_frequency(store.state_dict(), 4), [0.25, 0.0, 0.5])  # its snapshot
    live = {"version": 1, "size": 3, "path": str(tmp_path)}  # an old state: the files as they are
    with pytest.raises(ValueError, match=r"memory-mapped store.*store\.selected\.copy\(\)"):
        store_selection_frequency(live, 4)


def test_a_memory_mapped_stores_checkpoint_as_before_writes_and_removes_nothing(tmp_path):
    """The counts since a checkpoint: its state's snapshot is read, and the call neither writes
    a snapshot nor removes one (which could make the checkpoint unloadable)."""
    store = ExampleStore(4, path=tmp_path, keep_snapshots=2)
    store.record(np.arange(4), np.ones(4), epoch=0)
    store.count_selected(np.array([1]))
    first = store.state_dict()
    store.count_selected(np.array([2, 2]))
    second = store.state_dict()
    store.count_selected(np.array([3]))
    snapshots = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    same(store_selection_frequency(store, 2, before=first), [0.0, 0.0, 1.0, 0.5])
    same(store_selection_frequency(store, 1, before=second), [0.0, 0.0, 0.0, 1.0])
    same(store_selection_frequency(first, 1), [0.0, 1.0, 0.0, 0.0])
    same(store_selection_frequency(store, 2, before=copy.deepcopy(store)), [0.0] * 4)
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == snapshots
    store.load_state_dict(first)
    assert store.selected.tolist() == [0, 1, 0, 0]


def test_selection_frequency_of_a_subset_run_is_nan_outside_the_subset():
    """Diet-SB (a pruned subset under Stale-SB): the examples the loader never drew are NaN,
    not 0, so they are not the run's least used (nor the overlap with EL2N's lowest)."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(60, 4), torch.randint(0, 2, (60,)))
    keep = sbloader.prune(np.arange(60.0), 0.5)  # the 30 hardest: 30 .. 59
    policy = sbloader.SelectiveBackprop(1 / 3, staleness=2)
    loader = sbloader.SelectiveLoader(
        DataLoader(data, batch_size=10),
        torch.nn.Linear(4, 2),
        policy=policy,
        batch_size=5,
        subset=keep,
    )
    for _ in range(2):
        for _batch in loader:
            pass
    assert policy.store is not None
    for store in (policy.store, policy.store.state_dict()):
        frequency = store_selection_frequency(store, 2)
        assert np.isnan(frequency[:30]).all()
        assert not np.isnan(frequency[30:]).any()
    assert gallery_indices(store_selection_frequency(policy.store, 2), 5).min() >= 30
    # Given alone, the selected column says nothing of what was scored: 0 where not selected.
    assert not np.isnan(store_selection_frequency(policy.store.selected.copy(), 2)).any()


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (([1, 0], [0, 1]), {}, ValueError, "selected but never seen.*index 0: selected 1"),
        (([1, 0], [2, 1]), {"selected_before": [2, 0]}, ValueError, "earlier snapshot.*2 > 1"),
        (([1, 0], [2, 1]), {"seen_before": 3}, ValueError, "seen_before should be an earlier"),
        (([0.5, 0.0], [2, 1]), {}, TypeError, "selected should hold integer counts"),
        (([-1, 0], [2, 1]), {}, ValueError, "selected should be counts >= 0"),
        (([1, 0], [2, 1, 1]), {}, ValueError, r"seen should have one count per example \(2\)"),
        (([1, 0], -1), {}, ValueError, "seen should be >= 0, but got seen=-1"),
    ],
)
def test_selection_frequency_refuses_bad_counts(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        selection_frequency(*args, **kwargs)


def test_store_selection_frequency_refuses_the_live_store_as_its_own_snapshot():
    store = ExampleStore(2)
    with pytest.raises(ValueError, match="before is the store itself"):
        store_selection_frequency(store, 1, before=store)
    with pytest.raises(TypeError, match="store should hold integer counts"):
        store_selection_frequency({"selected": np.array([0.5, 1.0])}, 2)  # not counts


# --- stability of the selected set ----------------------------------------------------------------


def test_selection_stability_is_the_jaccard_index_of_consecutive_epochs():
    epochs = [[0, 1, 2], [1, 2, 3], [3], [3, 3], [], []]
    # {0,1,2}~{1,2,3}: 2/4; {1,2,3}~{3}: 1/3; {3}~{3}: 1; {3}~{}: 0; {}~{}: NaN.
    expected = [0.5, 1 / 3, 1.0, 0.0, nan]
    same(selection_stability(epochs), expected)
    masks = np.zeros((6, 5), dtype=bool)
    for e, chosen in enumerate(epochs):
        masks[e, chosen] = True
    same(selection_stability(masks), expected)
    same(selection_stability(torch.from_numpy(masks)), expected)
    same(selection_stability([torch.tensor(s, dtype=torch.long) for s in epochs]), expected)
    same(selection_stability(list(masks)), expected)


def test_selection_stability_of_fewer_than_two_epochs_is_empty():
    assert selection_stability([[1, 2]]).shape == (0,)
    assert selection_stability([]).shape == (0,)


def test_selection_stability_refuses_bad_input():
    with pytest.raises(ValueError, match=r"selections\[1\] should hold dataset indices >= 0"):
        selection_stability([[0], [-1]])
    with pytest.raises(TypeError, match=r"selections\[0\] should be a boolean mask or integer"):
        selection_stability([[0.5], [1]])
    with pytest.raises(ValueError, match=r"matrix \(epochs, examples\)"):
        selection_stability(np.zeros(3, dtype=bool))


# --- overlap curves -------------------------------------------------------------------------------

# Lowest first, ties by index: A = 5 1 3 2 0 4, B = 1 3 0 2 5 4.
A = [3, 1, 2, 1, 5, 0]
B = [2, 0, 2, 1, 5, 2]
SIXTHS = [1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0]


def test_overlap_curve_lowest_with_ties_broken_by_index():
    same(overlap_curve(A, B, SIXTHS), [0.0, 1 / 2, 2 / 3, 3 / 4, 1.0, 1.0])


def test_overlap_curve_highest_with_ties_broken_by_index():
    # Highest first, ties by index: A = 4 0 2 1 3 5, B = 4 0 2 5 3 1.
    same(overlap_curve(A, B, SIXTHS, direction="highest"), [1.0, 1.0, 1.0, 3 / 4, 4 / 5, 1.0])


def test_overlap_curve_expected_ties_match_enumerated_tie_breaks():
    same(overlap_curve([0, 0, 0, 1], [0, 1, 0, 1], 0.5), 0.5)
    same(overlap_curve([0, 0, 0, 1], [0, 1, 0, 1], 0.5, ties="expected"), 2 / 3)

    def mean_membership(scores, k):
        """Each example's share of the tie-break orders that put it in the lowest k."""
        scores = np.asarray(scores, dtype=float)
        inside = np.zeros(scores.size)
        orders = list(itertools.permutations(range(scores.size)))
        for tiebreak in orders:
            top = np.lexsort((np.array(tiebreak), scores))[:k]
            inside[top] += 1
        return inside / len(orders)

    a, b = [1, 0, 1, 1, 0, 2], [0, 1, 1, 1, 1, 0]
    fractions = [1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6]
    expected = [mean_membership(a, k) @ mean_membership(b, k) / k for k in range(1, 6)]
    same(overlap_curve(a, b, fractions, ties="expected"), expected)
    assert not np.allclose(overlap_curve(a, b, fractions), expected)  # index ties differ here


def test_overlap_curve_k_rounds_halves_up_and_empty_tops_are_nan():
    # 0.145 * 100 is 14.499999999999998 in floating point, still a half: k = 15, not 14.
    same(random_overlap(100, [0.145, 0.25, 0.005]), [0.15, 0.25, 0.01])
    same(random_overlap(10, 0.25), 0.3)
    ranks = np.arange(100)
    shifted = np.r_[1000, ranks[1:]]  # top 15 of A: 0-14, of B: 1-15 (k = 14 would give 13/14)
    same(overlap_curve(ranks, shifted, 0.145), 14 / 15)
    # N = 3: f = 0.1 gives k = 0 (NaN); f = 0.5 gives k = 2 (1.5 up): {0, 1} and {2, 1}.
    same(overlap_curve([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [0.1, 0.5]), [nan, 0.5])
    same(overlap_curve([], [], [0.5, 1.0]), [nan, nan])
    same(random_overlap(3, 0.1), nan)
    same(random_overlap(0, [0.5]), [nan])


def test_overlap_curve_keeps_the_shape_of_fractions():
    assert overlap_curve(A, B, 0.5).shape == ()
    assert overlap_curve(A, B, [[0.5, 1.0]]).shape == (1, 2)
    assert random_overlap_band(6, [[0.5, 1.0]], np.random.default_rng(0), draws=5).shape == (
        2,
        1,
        2,
    )


def test_random_rankings_overlap_as_expected():
    rng = np.random.default_rng(1234)
    n, fractions, draws = 1000, np.array([0.1, 0.3, 0.5, 0.9]), 300
    curves = np.array(
        [overlap_curve(rng.permutation(n), rng.permutation(n), fractions) for _ in range(draws)]
    )
    same(random_overlap(n, fractions), fractions)
    # Standard error of the mean: at most sqrt(0.1 * 0.9 * 0.9 / 100 / 300) < 0.002.
    np.testing.assert_allclose(curves.mean(axis=0), fractions, atol=0.01)
    band = random_overlap_band(n, fractions, np.random.default_rng(5), draws=4000)
    np.testing.assert_allclose(band, np.quantile(curves, [0.025, 0.975], axis=0), atol=0.02)
    inside = ((band[0] <= curves) & (curves <= band[1])).mean()
    assert 0.9 < inside < 0.99


def test_random_overlap_band_uses_only_the_generator_given():
    np.random.seed(0)  # noqa: NPY002 (the global generator must stay where it was)
    first = random_overlap_band(500, [0.2], np.random.default_rng(7), draws=50)
    again = random_overlap_band(500, [0.2], np.random.default_rng(7), draws=50)
    next_draw = np.random.random()  # noqa: NPY002
    np.testing.assert_array_equal(first, again)
    np.random.seed(0)  # noqa: NPY002
    assert next_draw == np.random.random()  # noqa: NPY002
    with pytest.raises(TypeError, match=r"rng should be a numpy\.random\.Generator.*default_rng"):
        random_overlap_band(500, [0.2], np.random.RandomState(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"quantiles should be in \[0, 1\]"):
        random_overlap_band(500, [0.2], np.random.default_rng(0), quantiles=[2.5])


@pytest.mark.parametrize(
    "fractions, match",
    [
        (0, r"fractions should be in \(0, 1\], but got 0 in fractions=0"),
        ([0.5, 1.5], r"but got 1.5 in fractions=\[0.5, 1.5\]"),
        ([nan], "but got nan"),
    ],
)
def test_overlap_curve_refuses_bad_fractions(fractions, match):
    with pytest.raises(ValueError, match=match):
        overlap_curve(A, B, fractions)
    with pytest.raises(ValueError, match=match):
        random_overlap(6, fractions)


def test_overlap_curve_refuses_bad_scores():
    with pytest.raises(ValueError, match=r"scores_b has 1 NaN .*indices \[2\]\).*both inputs"):
        overlap_curve([1, 2, 3], [1, 2, nan], 0.5)
    with pytest.raises(ValueError, match="same examples, but have 3 and 2 values"):
        overlap_curve([1, 2, 3], [1, 2], 0.5)
    with pytest.raises(ValueError, match=r"scores_a should be 1-d .*shape \(\)"):
        overlap_curve(0.5, 0.5, 1.0)
    with pytest.raises(ValueError, match="direction should be one of 'lowest', 'highest'"):
        overlap_curve(A, B, 0.5, direction="low")
    with pytest.raises(ValueError, match="ties should be one of 'index', 'expected'"):
        overlap_curve(A, B, 0.5, ties="random")


# --- galleries ------------------------------------------------------------------------------------

SCORES = [0.5, 0.1, nan, 0.1, 0.9, 0.5, 0.0]


def test_gallery_indices_ties_by_index_and_nan_skipped():
    lowest = gallery_indices(SCORES, 3)
    assert lowest.dtype == np.int64
    assert lowest.tolist() == [6, 1, 3]
    assert gallery_indices(SCORES, 3, direction="highest").tolist() == [4, 0, 5]
    assert gallery_indices(SCORES, 10).tolist() == [6, 1, 3, 0, 5, 4]
    assert gallery_indices(SCORES, 0).tolist() == []
    assert gallery_indices(torch.tensor(SCORES), 2).tolist() == [6, 1]


def test_gallery_of_least_and_most_used():
    frequency = selection_frequency([0, 0, 2, 0, 4], [0, 4, 4, 4, 4])  # nan 0 .5 0 1
    assert gallery_indices(frequency, 2).tolist() == [1, 3]
    assert gallery_indices(frequency, 1, direction="highest").tolist() == [4]


def test_combined_rank_with_ties_and_unscored_examples():
    el2n = [0.3, 0.1, 0.2, 0.1, nan]
    loss = [1.0, 3.0, 2.0, 0.5, 0.1]
    # Ranks among examples 0-3: EL2N 4 1.5 3 1.5, loss 2 4 3 1.
    combined = combined_rank(el2n, loss)
    same(combined, [6.0, 5.5, 6.0, 2.5, nan])
    assert gallery_indices(combined, 2).tolist() == [3, 1]
    assert gallery_indices(combined, 2, direction="highest").tolist() == [0, 2]
    # The order of the examples does not change anyone's combined rank.
    perm = np.array([3, 0, 4, 2, 1])
    same(combined_rank(np.array(el2n)[perm], np.array(loss)[perm]), combined[perm])
    # An example unscored in B alone is left out of A's ranking too.
    same(combined_rank([0.1, 0.2, 0.3], [0.3, nan, 0.1]), [3.0, nan, 3.0])
    with pytest.raises(ValueError, match="same examples"):
        combined_rank([1.0], [1.0, 2.0])


def test_gallery_refuses_bad_input():
    with pytest.raises(ValueError, match="k should be >= 0, but got k=-1"):
        gallery_indices(SCORES, -1)
    with pytest.raises(TypeError, match="k should be an int"):
        gallery_indices(SCORES, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"scores should be 1-d"):
        gallery_indices([[0.1, 0.2]], 1)


# --- label noise ----------------------------------------------------------------------------------


def test_flipped_share_among_the_most_selected():
    counts = [5, 9, 1, 2, 4, 0]  # most selected: 1, 0, 4, 3, 2, 5
    assert flipped_share([1, 4], counts, k=2) == (0.5, 1 / 3)
    assert flipped_share([1, 4, 4], counts, k=3) == pytest.approx((2 / 3, 1 / 3))
    assert flipped_share(torch.tensor([2, 5]), counts, k=6) == (1 / 3, 1 / 3)


def test_flipped_share_ties_by_index_or_expected():
    counts = [2, 1, 1, 1]  # k = 2: example 0, then one of the tied 1, 2, 3
    assert flipped_share([3], counts, k=2).share == 0.0
    assert flipped_share([1], counts, k=2).share == 0.5
    assert flipped_share([3], counts, k=2, ties="expected").share == pytest.approx(1 / 6)
    assert flipped_share([1, 2, 3], counts, k=2, ties="expected").share == pytest.approx(1 / 2)


def test_flipped_share_leaves_unseen_examples_out():
    frequency = [nan, 1.0, 0.5, 0.0]
    share, expected = flipped_share([0, 2], frequency, k=1)
    assert (share, expected) == (0.0, 1 / 3)
    assert flipped_share([0, 2], frequency, k=2).share == 0.5


def test_flipped_share_refuses_bad_input():
    with pytest.raises(ValueError, match="k should be at most the 3 examples with a selection"):
        flipped_share([0], [nan, 1.0, 2.0, 3.0], k=4)
    with pytest.raises(ValueError, match=r"flipped should hold dataset indices in \[0, 4\).*4"):
        flipped_share([4], [1, 2, 3, 4], k=1)
    with pytest.raises(TypeError, match="flipped should hold integers"):
        flipped_share([1.0], [1, 2, 3, 4], k=1)
    with pytest.raises(ValueError, match="k should be >= 1"):
        flipped_share([1], [1, 2, 3, 4], k=0)


def test_selection_stability_refuses_a_matrix_that_is_not_boolean():
    """A 0/1 or count matrix read row by row as dataset indices compared values, not members
    (two disjoint selections gave 1.0)."""
    disjoint = np.array([[1, 0, 1, 0], [0, 1, 0, 1]])
    assert selection_stability(disjoint > 0).tolist() == [0.0]
    for matrix in (disjoint, torch.tensor(disjoint, dtype=torch.uint8), disjoint * 3):
        with pytest.raises(TypeError, match=r"boolean.*selections > 0"):
            selection_stability(matrix)


def test_inverted_cdf_percentiles_are_the_smallest_value_with_p_percent_at_or_below():
    values = np.arange(1.0, 101.0) / 100  # 0.01..1: the p-th percentile is p / 100
    same(confidence_percentiles(values, [7, 14, 28, 56]), [0.07, 0.14, 0.28, 0.56])
    big = np.arange(1.0, 10001.0) / 10000
    same(confidence_percentiles(big, [7, 17, 81]), [0.07, 0.17, 0.81])
    # 64.4 * 250 / 100 is 161.00000000000003 in floating point: the 161st value, not the 162nd
    same(confidence_percentiles(np.arange(250.0) / 250, [64.4]), [160 / 250])


def test_flipped_share_takes_an_empty_list_of_flipped_labels():
    assert flipped_share([], [0.5, 0.2, 0.9, 0.1], k=2).share == 0.0


def test_flipped_share_takes_a_boolean_mask_and_refuses_a_0_1_integer_mask():
    selection = [5, 9, 1, 2, 4, 0]  # the 2 most selected: 1 and 0
    mask = np.array([False, True, False, False, True, False])  # flipped: 1 and 4
    assert flipped_share(mask, selection, k=2) == flipped_share([1, 4], selection, k=2)
    assert flipped_share(torch.from_numpy(mask), selection, k=2).share == 0.5
    # As indices, a 0/1 integer mask named examples 0 and 1: share 1.0 instead of 0.5.
    with pytest.raises(ValueError, match=r"0/1 mask\? Pass it as booleans"):
        flipped_share(mask.astype(np.int64), selection, k=2)
    with pytest.raises(ValueError, match=r"one flag per example \(6,\), but has shape \(5,\)"):
        flipped_share(mask[:5], selection, k=2)
    with pytest.raises(ValueError, match=r"one flag per example \(6,\), but has shape \(7,\)"):
        flipped_share(np.append(mask, False), selection, k=2)
    # Indices 0 and 1, each once, are indices.
    assert flipped_share([0, 1], selection, k=2).share == 1.0


def test_selection_stability_refuses_0_1_integer_rows_in_a_list():
    # Read as indices, both rows were the set {0, 1}: Jaccard 1.0 for disjoint masks (0.0).
    rows = [np.array([1, 0, 0]), np.array([0, 1, 0])]
    with pytest.raises(ValueError, match=r"selections\[0\] .*0/1 mask or per-epoch counts\? Pass"):
        selection_stability(rows)
    with pytest.raises(ValueError, match="0/1 mask"):
        selection_stability(list(np.array([[1, 0, 1], [0, 1, 1]])))
    assert selection_stability([row > 0 for row in rows]).tolist() == [0.0]
    # Indices 0 and 1 each once, or repeated indices above 1, are indices.
    assert selection_stability([[0, 1], [1, 2, 2]]).tolist() == [1 / 3]
    # Per-epoch counts with a 2 were read as the set of counts, {0, 1, 2}: 1.0 for disjoint
    # selections; masks of different lengths were compared as if over the same examples.
    counts = list(np.array([[0, 2, 1, 0], [1, 0, 0, 2]], dtype=np.uint8))
    with pytest.raises(ValueError, match=r"selections\[0\] .*holds 0 2 times .*per-epoch counts"):
        selection_stability(counts)
    assert selection_stability([row > 0 for row in counts]).tolist() == [0.0]
    with pytest.raises(ValueError, match=r"same examples, but have lengths \[2, 3\]"):
        selection_stability([np.array([True, False, True]), np.array([True, False])])
    assert selection_stability([np.unique([0, 0, 3]), [0, 3]]).tolist() == [1.0]
