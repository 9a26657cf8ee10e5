"""Policies on their own: pure functions of losses, their state and the generator passed in."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbloader import (
    Choice,
    Kath18,
    Phased,
    Policy,
    RandomBackprop,
    SelectiveBackprop,
    Traditional,
    default_policy,
)


def test_selectivity_gives_beta():
    assert SelectiveBackprop(selectivity=1 / 3).beta == pytest.approx(2.0)
    assert SelectiveBackprop(selectivity=0.25).beta == pytest.approx(3.0)
    assert SelectiveBackprop(beta=1.0).selectivity == pytest.approx(0.5)
    assert SelectiveBackprop(selectivity=1.0).beta == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"selectivity": 0.0}, r"selectivity should be in \(0, 1\], but got selectivity=0.0"),
        ({"selectivity": 1.5}, r"selectivity should be in \(0, 1\], but got selectivity=1.5"),
        ({"selectivity": float("nan")}, "selectivity should be finite"),
        ({"selectivity": 1e-320}, r"selectivity should be large enough .*selectivity=1e-320"),
        ({"beta": -1}, r"beta should be >= 0, but got beta=-1.0"),
        ({"selectivity": 0.5, "beta": 1.0}, "give either selectivity or beta"),
        ({"history": 0}, "history should be >= 1, but got history=0"),
        # (reports keep stored losses fresher, so passes may be sparser with them, never denser)
        (
            {"staleness": 3, "fed_staleness": 2},
            "fed_staleness should be >= 3, but got fed_staleness=2",
        ),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SelectiveBackprop(**kwargs)


@pytest.mark.parametrize("has_store", [True, False])
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stale_cdf": "stroe"}, "stale_cdf should be one of .*got stale_cdf='stroe'"),
        ({"drift_bound": 7.0}, r"drift_bound should be in \(0, 1\], but got drift_bound=7.0"),
        ({"drift_bound": -1.0}, r"drift_bound should be in \(0, 1\], but got drift_bound=-1.0"),
    ],
)
def test_default_policy_refuses_bad_store_options_with_or_without_a_store(
    has_store, kwargs, message
):
    """Options that apply only with a store are checked without one too: a typo is refused,
    not silently unused."""
    with pytest.raises(ValueError, match=message):
        default_policy(has_store=has_store, **kwargs)


@pytest.mark.parametrize(("epochs", "share"), [(2, 0.125), (3, 0.5), (4, 0.8), (10, 0.95)])
def test_a_schedule_without_a_selective_epoch_is_warned_of_naming_its_arguments(epochs, share):
    """default_policy(epochs=, anneal_share=) whose annealed end starts right after the warm-up
    never selects: warned of, naming both (and Phased itself, when given such epochs), while a
    schedule with a selective epoch is built silently."""
    with pytest.warns(UserWarning, match=rf"default_policy\(epochs={epochs}, anneal_share="):
        p = default_policy(epochs=epochs, anneal_share=share)
    assert not [e for e in range(epochs) if p.active(e)]
    with pytest.warns(UserWarning, match="anneal_from_epoch=1 right after its warmup_epochs=1"):
        Phased(SelectiveBackprop(0.5), warmup_epochs=1, anneal_from_epoch=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_policy(epochs=epochs + 10, anneal_share=0.1).active(1)
        Phased(SelectiveBackprop(0.5), warmup_epochs=1, anneal_from_epoch=2)


@pytest.mark.parametrize("bad", ["False", "True", 0, 1, None])
def test_default_policy_refuses_a_has_store_that_is_no_bool(bad):
    """has_store picks Stale-SB (a per-example store) or a selection pass every epoch: read by its
    truth value, has_store="False" silently built the Stale-SB."""
    with pytest.raises(
        TypeError, match=f"has_store should be True or False, but got has_store={bad!r}"
    ):
        default_policy(has_store=bad)
    assert default_policy(has_store=np.bool_(False)).policy.staleness == 1
    assert default_policy(has_store=True).policy.staleness == 3


@pytest.mark.parametrize(
    ("bad", "error", "says"),
    [
        (0, ValueError, "should be >= 1"),
        ("2", TypeError, "should be an int"),
        (True, TypeError, "should be an int"),
    ],
)
def test_a_bad_store_snapshots_is_refused_at_construction_naming_it(bad, error, says):
    with pytest.raises(error, match=f"store_snapshots {says}, but got store_snapshots={bad!r}"):
        SelectiveBackprop(0.5, staleness=2, store_snapshots=bad)
    assert SelectiveBackprop(0.5, staleness=2, store_snapshots=None).store_snapshots is None


@pytest.mark.parametrize("bad", [True, 1, 3.5, ["/tmp/store"]])
def test_a_store_path_that_is_no_path_is_refused_naming_it(bad, tmp_path):
    """store_path=True or a number was taken, then failed in os.fspath when a loader opened the
    store ("expected str, bytes or os.PathLike object, not bool"), naming no parameter."""
    with pytest.raises(TypeError, match=r"store_path should be a folder .*" + re.escape(repr(bad))):
        SelectiveBackprop(0.5, staleness=2, store_path=bad)
    for ok in (str(tmp_path), tmp_path, None):
        assert SelectiveBackprop(0.5, staleness=2, store_path=ok).store_path == ok


def test_probabilities_follow_the_formula_exactly():
    """P = CDF_R(loss)^beta over the R most recent losses, each loss entering before ranking."""
    rng = np.random.default_rng(0)
    losses = rng.gamma(2.0, size=3000)
    sb = SelectiveBackprop(beta=2.0, history=100)
    p = sb.probabilities(losses)
    for i in (0, 1, 50, 99, 100, 1234, 2999):
        window = losses[max(0, i - 99) : i + 1]
        assert p[i] == pytest.approx((np.sum(window <= losses[i]) / len(window)) ** 2.0)


@pytest.mark.parametrize("trim_top", [0.0, 0.2, 0.3])
@pytest.mark.parametrize("position", [0.0, 0.25, 1.0])
def test_probabilities_during_a_ramp_are_those_choose_keeps_with(position, trim_top):
    """With ``ramp_epochs``, P blends uniform keeping at the same rate into CDF^beta; the public
    ``probabilities`` gives the P that ``choose`` keeps with, not the ramp-less one, to the bit
    (at trim_top=0.3 the uniform rate computed as 1 / (beta + 1) is 1 ulp off the kernel's
    cut / (cut_beta + 1))."""
    rng = np.random.default_rng(3)
    losses = rng.gamma(2.0, size=300)
    a = SelectiveBackprop(1 / 3, history=64, ramp_epochs=0.5, trim_top=trim_top)
    b = SelectiveBackprop(1 / 3, history=64, ramp_epochs=0.5, trim_top=trim_top)
    a.advance(position)
    b.advance(position)
    p = a.probabilities(losses)
    chosen = b.choose(losses, None, np.random.default_rng(0), len(losses))
    np.testing.assert_array_equal(p, chosen.probabilities)
    if position == 0.0:  # all uniform: every candidate at the policy's rate
        np.testing.assert_allclose(p, 1 / 3)


def test_examples_are_chosen_in_the_predicted_proportions():
    """With losses known in advance, each loss decile is kept at the rate the formula predicts."""
    rng = np.random.default_rng(1)
    n, beta = 60_000, 2.0
    losses = rng.exponential(size=n)
    sb = SelectiveBackprop(beta=beta, history=1024)
    chosen = np.zeros(n, dtype=bool)
    predicted = np.empty(n)
    draw = np.random.default_rng(2)
    for start in range(0, n, 500):
        c = sb.choose(losses[start : start + 500], None, draw, 500)
        chosen[start + c.positions] = True
        predicted[start : start + 500] = c.probabilities
    # The realized rate matches the selectivity 1 / (beta + 1).
    assert chosen.mean() == pytest.approx(1 / 3, abs=0.01)
    # Per bin of predicted P, the kept fraction matches the mean predicted P (binomial bound).
    bins = np.digitize(predicted, np.linspace(0, 1, 11)[1:-1])
    for b in range(10):
        sel = bins == b
        m, k = sel.sum(), chosen[sel].sum()
        p = predicted[sel].mean()
        assert abs(k / m - p) < 4 * np.sqrt(p * (1 - p) / m) + 1e-9, (b, k / m, p)
    # Higher losses are kept more often: the top decile of losses far more than the bottom.
    order = np.argsort(losses)
    assert chosen[order[-n // 10 :]].mean() > 0.7 > 0.05 > chosen[order[: n // 10]].mean()


def test_choose_uses_only_the_generator_given():
    losses = np.random.default_rng(3).random(1000)
    a = SelectiveBackprop().choose(losses, None, np.random.default_rng(7), 1000)
    np.random.seed(123)  # noqa: NPY002 - the global RNG must make no difference
    b = SelectiveBackprop().choose(losses, None, np.random.default_rng(7), 1000)
    c = SelectiveBackprop().choose(losses, None, np.random.default_rng(8), 1000)
    np.testing.assert_array_equal(a.positions, b.positions)
    assert not np.array_equal(a.positions, c.positions)


def test_traditional_keeps_everything_and_needs_no_losses():
    t = Traditional()
    assert t.passthrough() and not t.needs_losses(0)
    c = t.choose(None, None, np.random.default_rng(0), 5)
    assert c.positions.tolist() == [0, 1, 2, 3, 4] and (c.weights == 1).all()


def test_random_backprop_keeps_a_fraction_without_losses():
    r = RandomBackprop(0.3)
    assert not r.needs_losses(0)
    c = r.choose(None, None, np.random.default_rng(0), 50_000)
    assert len(c.positions) / 50_000 == pytest.approx(0.3, abs=0.01)
    assert (c.probabilities == 0.3).all()


class _Own(Policy):
    def choose(self, losses, indices, rng, n):
        return Choice.everything(n)


def test_only_policies_that_rank_other_ranks_losses_ask_for_them():
    """cdf="global" gathers every rank's losses only for a policy that ranks them: SB's window
    and, by default, a policy of the user's own (its observe may use them); Phased answers as
    the policy it wraps, the same in every epoch (every rank makes the same collectives)."""
    assert _Own().ranks_shared_losses()
    for policy in (SelectiveBackprop(0.5), SelectiveBackprop(0.5, staleness=2)):
        assert policy.ranks_shared_losses()
    for policy in (Traditional(), RandomBackprop(0.5), Kath18(0.5)):
        assert not policy.ranks_shared_losses()
    sb = Phased(SelectiveBackprop(0.5), warmup_epochs=1, warmup_policy=RandomBackprop(0.5))
    kath = Phased(Kath18(0.5), warmup_epochs=1, anneal_from_epoch=3)
    for epoch in range(4):
        sb.begin_epoch(epoch)
        kath.begin_epoch(epoch)
        assert sb.ranks_shared_losses() and not kath.ranks_shared_losses()


def test_sb_state_round_trip_continues_identically():
    rng = np.random.default_rng(4)
    a = SelectiveBackprop(beta=1.5, history=64)
    a.probabilities(rng.random(500))
    b = SelectiveBackprop(beta=1.5, history=64)
    b.load_state_dict(a.state_dict())
    probe = rng.random(200)
    np.testing.assert_array_equal(a.probabilities(probe), b.probabilities(probe))


@pytest.mark.parametrize(
    "saved, loading, says",
    [
        ({"beta": 2.0}, {"beta": 1.0}, "saved selectivity"),
        ({"reweight": False}, {"reweight": True}, "state has reweight=False, but this policy has"),
    ],
)
def test_sb_state_with_another_beta_or_reweight_is_refused(saved, loading, says):
    """Neither is in the loader state's identity (kind() leaves them out): the policy's own
    state refuses them."""
    with pytest.raises(ValueError, match=says):
        SelectiveBackprop(**loading).load_state_dict(SelectiveBackprop(**saved).state_dict())


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0, 1e6), min_size=1, max_size=200),
    st.floats(0.01, 1.0),
    st.integers(0, 2**32 - 1),
)
def test_property_choice_is_valid_and_identical_after_state_round_trip(losses, s, seed):
    losses = np.array(losses)
    a = SelectiveBackprop(selectivity=s, history=50)
    half = len(losses) // 2
    a.choose(losses[:half], None, np.random.default_rng(seed), half)
    b = SelectiveBackprop(selectivity=s, history=50)
    b.load_state_dict(a.state_dict())
    ca = a.choose(losses[half:], None, np.random.default_rng(seed), len(losses) - half)
    cb = b.choose(losses[half:], None, np.random.default_rng(seed), len(losses) - half)
    assert isinstance(ca, Choice)
    np.testing.assert_array_equal(ca.positions, cb.positions)
    np.testing.assert_array_equal(ca.probabilities, cb.probabilities)
    assert ((ca.probabilities > 0) & (ca.probabilities <= 1)).all()
    assert (np.diff(ca.positions) > 0).all()  # source order, no repeats


def test_reweight_is_self_normalised_and_s_over_p_weights_are_unbiased():
    """What the reweight docs claim: the weights are 1/P normalised to mean 1 per batch, whose
    weighted batch mean is a biased (self-normalised) estimate of the data's mean loss, while
    weights s / P (``selectivity / batch.probabilities``) give an unbiased one."""
    rng = np.random.default_rng(0)
    population = rng.exponential(size=4096)
    s, b = 1 / 3, 64
    sb = SelectiveBackprop(s, history=1024, reweight=True)
    sb.choose(population[:1024], None, rng, 1024)  # a full window
    kept, p = [], []
    for _ in range(100):
        losses = rng.permutation(population)
        c = sb.choose(losses, None, rng, losses.size)
        np.testing.assert_allclose(c.weights, 1 / c.probabilities[c.positions])
        kept.append(losses[c.positions])
        p.append(c.probabilities[c.positions])
    usable = sum(len(k) for k in kept) // b * b
    losses_kept = np.concatenate(kept)[:usable].reshape(-1, b)
    inverse = 1 / np.concatenate(p)[:usable].reshape(-1, b)
    normalised = inverse / inverse.mean(axis=1, keepdims=True)  # what the loader yields
    self_normalised = (normalised * losses_kept).mean(axis=1).mean()
    unbiased = (s * inverse * losses_kept).mean(axis=1).mean()
    assert unbiased == pytest.approx(population.mean(), rel=0.02)
    assert self_normalised > 1.05 * population.mean()


@pytest.mark.parametrize("history", [1, 4, 16, 1024])
@pytest.mark.parametrize("s", [0.1, 1 / 3, 0.5])
def test_a_full_window_keeps_the_discrete_cdfs_share_about_s_plus_one_over_2r(history, s):
    """The history docs: once the window is full, continuous losses are kept at
    mean((k / R) ** beta), k = 1..R, about s + 1 / (2R) (everything at R = 1)."""
    sb = SelectiveBackprop(s, history=history)
    losses = np.random.default_rng(3).lognormal(0.0, 1.5, 200_000)
    p = sb.choose(losses, None, np.random.default_rng(0), losses.size).probabilities
    share = np.mean((np.arange(1, history + 1) / history) ** sb.beta)
    assert p[history:].mean() == pytest.approx(share, abs=0.004)
    if history >= 16:
        assert share == pytest.approx(s + 1 / (2 * history), abs=0.1 / history)


def test_during_a_ramp_the_uniform_share_keeps_trimmed_losses_at_u_times_s():
    """The trim_top docs' NOTE: the ramp's uniform share reaches the trimmed losses too."""
    sb = SelectiveBackprop(1 / 3, history=100, trim_top=0.1, ramp_epochs=1.0)
    sb.advance(0.25)  # u = 0.75
    rng = np.random.default_rng(0)
    p = sb.choose(np.arange(100.0), None, rng, 100).probabilities  # each loss a new maximum
    assert p[-1] == pytest.approx(0.75 / 3)
    sb.advance(1.0)  # ramp over: trimmed losses are never kept
    assert sb.choose(np.array([1e9]), None, rng, 1).probabilities[0] == 0.0


def test_a_refused_sb_state_changes_nothing():
    """A state refused for its store (none here, or one of another size) leaves the window,
    the schedule and the store as they were: nothing half-loaded."""
    rng = np.random.default_rng(5)
    plain = SelectiveBackprop(beta=1.0, history=32)
    plain.probabilities(rng.random(40))
    before = plain.window.values().copy()
    stale = SelectiveBackprop(beta=1.0, history=32, staleness=2)
    stale.attach(10, 0)
    stale.probabilities(rng.random(40))
    with pytest.raises(ValueError, match="has a per-example store"):
        plain.load_state_dict(stale.state_dict())
    np.testing.assert_array_equal(plain.window.values(), before)

    other = SelectiveBackprop(beta=1.0, history=32, staleness=2)
    other.attach(20, 0)
    other.probabilities(rng.random(40))
    other.begin_epoch(0)
    other_window = other.window.values().copy()
    schedule = other.state_dict()["schedule"]
    with pytest.raises(ValueError, match="size"):
        other.load_state_dict(stale.state_dict())
    np.testing.assert_array_equal(other.window.values(), other_window)
    assert other.state_dict()["schedule"] == schedule


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(fed_staleness=5), "fed_staleness"),
        (dict(store_path="/tmp/sb_store"), "store_path"),
        (dict(drift_bound=0.25), "drift_bound"),
    ],
)
def test_stale_sb_options_with_staleness_1_are_refused_not_ignored(kwargs, name):
    """fed_staleness, store_path and a drift_bound other than the default belong to Stale-SB:
    with staleness=1 (a pass every epoch, no store) they would do nothing, so they are refused
    naming the option and the fix."""
    with pytest.raises(ValueError, match=rf"{name}.*give staleness > 1 .* or leave {name} out"):
        SelectiveBackprop(1 / 3, staleness=1, **kwargs)
    assert SelectiveBackprop(1 / 3, staleness=2, **kwargs).staleness == 2
    assert SelectiveBackprop(1 / 3, staleness=1, fed_staleness=1).fed_staleness == 1
    # the default bound, and no bound, are what a plain SB has: accepted
    assert SelectiveBackprop(1 / 3, staleness=1, drift_bound=0.5).drift_bound == 0.5
    assert SelectiveBackprop(1 / 3, staleness=1, drift_bound=None).drift_bound is None


def test_a_drift_bound_with_stale_epochs_ranked_against_the_store_is_refused():
    """drift_bound judges stale epochs ranked against the window; with stale_cdf="store" it is
    never consulted (_drifted returns False), so another bound than the default is refused,
    naming both options, rather than ignored."""
    with pytest.raises(ValueError, match=r"drift_bound=0.75 with stale_cdf='store'"):
        SelectiveBackprop(1 / 3, staleness=3, stale_cdf="store", drift_bound=0.75)
    with pytest.raises(ValueError, match=r"drift_bound=0.75 with stale_cdf='store'"):
        default_policy(stale_cdf="store", drift_bound=0.75)
    assert SelectiveBackprop(1 / 3, staleness=3, stale_cdf="store").drift_bound == 0.5
    assert SelectiveBackprop(1 / 3, staleness=3, drift_bound=0.75).drift_bound == 0.75


def test_a_warmup_policy_that_needs_losses_in_a_later_epoch_is_refused_at_construction():
    """Phased makes no selection pass in its warm-up: a warm-up policy that needs losses in any
    epoch (not only its first) is refused when Phased is built, not after an epoch."""
    inner = Phased(SelectiveBackprop(0.5), warmup_epochs=1, warmup_policy=RandomBackprop(0.5))
    assert not inner.needs_losses(0) and inner.uses_losses()
    with pytest.raises(ValueError, match=r"warmup_policy should need no selection pass in any"):
        Phased(SelectiveBackprop(0.5), warmup_epochs=3, warmup_policy=inner)
    # a warm-up of Random-Backprop after Traditional is fine
    ok = Phased(RandomBackprop(0.5), warmup_epochs=1)
    Phased(SelectiveBackprop(0.5), warmup_epochs=2, warmup_policy=ok)


def test_a_warmup_policy_with_no_warmup_epochs_is_refused():
    """warmup_policy= with the default warmup_epochs=0 never runs: refused with the fix, while a
    Phased without a warm-up policy (e.g. annealing only) still takes warmup_epochs=0."""
    with pytest.raises(ValueError, match=r"warmup_epochs=0.*pass warmup_epochs >= 1"):
        Phased(SelectiveBackprop(1 / 3), warmup_policy=RandomBackprop(1 / 3))
    assert Phased(SelectiveBackprop(1 / 3), anneal_from_epoch=3).warmup_epochs == 0


class _EveryThird(Policy):
    """A warm-up policy of one's own with state: keeps every third candidate, counted across
    batches, without losses."""

    def __init__(self) -> None:
        self.count = 0

    def uses_losses(self) -> bool:
        return False

    def needs_losses(self, epoch: int) -> bool:
        return False

    def choose(self, losses, indices, rng, n):
        positions = np.array([i for i in range(n) if (self.count + i) % 3 == 0], dtype=np.int64)
        self.count += n
        return Choice(positions, np.full(n, 1 / 3), np.ones(len(positions)))

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = int(state["count"])


def test_a_phased_state_restores_its_warmup_policys_state():
    """A warm-up policy with state (one of the user's own) resumes mid-warm-up where it was:
    the restored Phased keeps the candidates the uninterrupted one keeps."""

    def make():
        return Phased(SelectiveBackprop(1 / 3), warmup_epochs=1, warmup_policy=_EveryThird())

    rng = np.random.default_rng(0)
    saved = make()
    saved.begin_epoch(0)
    saved.choose(None, None, rng, 4)
    restored = make()
    restored.load_state_dict(saved.state_dict())
    restored.begin_epoch(0)
    kept = [p.choose(None, None, rng, 6).positions.tolist() for p in (saved, restored)]
    assert kept == [[2, 5], [2, 5]]


@pytest.mark.parametrize("name", ["beta", "selectivity"])
def test_an_integer_beyond_floats_range_is_refused_naming_the_parameter(name):
    with pytest.raises(
        ValueError, match=rf"^{name} should be a finite number, but got an integer of 401"
    ):
        SelectiveBackprop(**{name: 10**400})


def _returning(make):
    """A policy of the user's own whose choose returns ``make(n)``."""
    from sbloader import Policy

    class Mine(Policy):
        def choose(self, losses, indices, rng, n):
            return make(n)

    return Mine()


@pytest.mark.parametrize(
    "make, error, says",
    [
        (
            lambda n: Choice(np.array([-1, 0]), np.full(n, 0.5), np.ones(2)),
            ValueError,
            "in \\[0, 8\\)",
        ),
        (
            lambda n: Choice(np.array([n, 0]), np.full(n, 0.5), np.ones(2)),
            ValueError,
            "in \\[0, 8\\)",
        ),
        (lambda n: Choice(np.array([1.0]), np.full(n, 0.5), np.ones(1)), TypeError, "integers"),
        (lambda n: Choice([1, 0], np.full(n, 0.5), np.ones(2)), TypeError, "positions field"),
        (lambda n: Choice(np.array([1, 0]), np.full(n, 0.5), np.ones(3)), ValueError, "weights"),
        (lambda n: Choice(np.array([1, 0]), np.full(2, 0.5), np.ones(2)), ValueError, "probabil"),
        (lambda n: np.array([1, 0]), TypeError, ", but got ndarray"),
        (
            lambda n: Choice(np.array([1, 0]), np.full(n, 0.5), np.array([1.0, np.nan])),
            ValueError,
            "weights are finite and >= 0.*got weights\\[1\\] = nan",
        ),
        (
            lambda n: Choice(np.array([1, 0]), np.full(n, 0.5), np.array([np.inf, 1.0])),
            ValueError,
            "weights are finite and >= 0.*got weights\\[0\\] = inf",
        ),
        (
            lambda n: Choice(np.array([1, 0]), np.full(n, 0.5), np.array([1.0, -0.5])),
            ValueError,
            "weights are finite and >= 0.*got weights\\[1\\] = -0.5",
        ),
        (
            lambda n: Choice(np.array([1, 0]), np.r_[np.nan, np.full(n - 1, 0.5)], np.ones(2)),
            ValueError,
            "probabilities are in \\[0, 1\\].*got probabilities\\[0\\] = nan",
        ),
        (
            lambda n: Choice(np.array([1, 0]), np.full(n, -0.5), np.ones(2)),
            ValueError,
            "probabilities are in \\[0, 1\\]",
        ),
        (
            lambda n: Choice(np.array([1, 0]), np.full(n, 1.5), np.ones(2)),
            ValueError,
            "probabilities are in \\[0, 1\\].*got probabilities\\[0\\] = 1.5",
        ),
        (
            lambda n: Choice(np.array([1, 0]), np.full(n, 0.5), np.array(["1", "1"])),
            TypeError,
            "weights are floats",
        ),
    ],
)
def test_a_choice_that_does_not_fit_its_candidates_is_refused_naming_the_policy(make, error, says):
    """A policy of one's own whose Choice did not fit the candidates failed in torch or numpy
    ("index out of range in self", "could not broadcast"), naming neither the policy nor the
    field; probabilities of another length went into batch.probabilities unsaid, and NaN,
    infinite or negative weights into the trained loss."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from sbloader import SelectiveLoader

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    loader = SelectiveLoader(
        DataLoader(data, batch_size=8), torch.nn.Linear(4, 2), policy=_returning(make), batch_size=4
    )
    with pytest.raises(
        error, match="Mine\\(\\)\\.choose\\(\\.\\.\\.\\) should return a Choice.*" + says
    ):
        list(loader)
    # a Choice that fits, int32 positions included, is taken as it is
    fits = _returning(lambda n: Choice(np.array([1, 0], np.int32), np.full(n, 0.5), np.ones(2)))
    loader = SelectiveLoader(
        DataLoader(data, batch_size=8), torch.nn.Linear(4, 2), policy=fits, batch_size=4
    )
    assert [b.indices.tolist() for b in loader] == [[1, 0, 9, 8]]


def test_zero_weights_are_refused_only_where_the_loader_scales_them_to_mean_1():
    """A policy whose normalize_weights() is True and whose weights were 0 had each batch's
    weights scaled by 1 / 0: NaN weights went into the trained loss."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from sbloader import Policy, SelectiveLoader

    class Zero(Policy):
        def __init__(self, scaled):
            self.scaled = scaled

        def normalize_weights(self):
            return self.scaled

        def choose(self, losses, indices, rng, n):
            return Choice(np.arange(n, dtype=np.int64), np.ones(n), np.zeros(n))

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))

    def loader(scaled):
        source = DataLoader(data, batch_size=8)
        return SelectiveLoader(source, torch.nn.Linear(4, 2), policy=Zero(scaled), batch_size=4)

    with pytest.raises(ValueError, match=r"weights are finite and > 0 .*normalize_weights"):
        list(loader(True))
    assert all((b.weights == 0).all() for b in loader(False))


def test_a_state_saved_before_the_schedule_was_state_keeps_passes_in_epochs_0_n_2n():
    """A Stale-SB state without ``schedule`` (saved when passes ran in epochs 0, n, 2n, ...)
    goes on in that schedule until its next pass: with staleness 3, epochs 4 and 5 stale, 6
    and 9 fresh (not every epoch stale because no pass is recorded)."""
    saved = SelectiveBackprop(beta=1.0, history=8, staleness=3)
    saved.attach(10, 0)
    saved.begin_epoch(0)
    saved.choose(np.linspace(0.1, 1.0, 10), np.arange(10), np.random.default_rng(0), 10)
    state = saved.state_dict()
    del state["schedule"]
    resumed = SelectiveBackprop(beta=1.0, history=8, staleness=3)
    resumed.attach(10, 0)
    resumed.load_state_dict(state)
    fresh = []
    for epoch in range(4, 10):
        resumed.begin_epoch(epoch)
        fresh.append(resumed.needs_losses(epoch))
    assert fresh == [False, False, True, False, False, True]


def test_sb_state_round_trip_restores_the_pass_schedule_and_drift_reference():
    """A Stale-SB state keeps the pass schedule (the last pass, whether reports came since,
    the epoch begun and its decision), the drift reference and the drift passes counted: the
    restored policy's schedule is the saved one's, and it decides the next epochs alike."""
    saved = SelectiveBackprop(beta=1.0, history=8, staleness=2, fed_staleness=4)
    saved.attach(10, 0)
    saved.begin_epoch(0)
    saved.choose(np.linspace(0.1, 1.0, 10), np.arange(10), np.random.default_rng(0), 10)
    saved.begin_epoch(1)
    saved.feedback(np.arange(5), np.full(5, 0.5), 0)  # (reports reach it as epoch 1 begins)
    saved.drift_passes = 2
    restored = SelectiveBackprop(beta=1.0, history=8, staleness=2, fed_staleness=4)
    restored.attach(10, 0)
    restored.load_state_dict(saved.state_dict())
    a, b = saved.state_dict()["schedule"], restored.state_dict()["schedule"]
    assert a["reference"] is not None
    np.testing.assert_array_equal(b.pop("reference"), a.pop("reference"))
    assert b == a == {"last_fresh": 0, "fed": True, "begun": 1, "fresh": False, "drift_passes": 2}
    for epoch in range(2, 6):
        saved.begin_epoch(epoch)
        restored.begin_epoch(epoch)
        assert restored.needs_losses(epoch) == saved.needs_losses(epoch), epoch


def test_an_epoch_without_reports_returns_to_the_unfed_staleness():
    """fed_staleness holds only while losses are reported: reports in epoch 1 (one after the
    pass in epoch 0) stretch the stale phase, none in epoch 2 give epoch 3 its pass at the
    plain staleness of 2 (not the fed 4 of the epoch before)."""
    sb = SelectiveBackprop(beta=1.0, history=8, staleness=2, fed_staleness=4)
    sb.attach(10, 0)
    sb.begin_epoch(0)
    sb.choose(np.linspace(0.1, 1.0, 10), np.arange(10), np.random.default_rng(0), 10)
    sb.begin_epoch(1)
    sb.feedback(np.arange(5), np.full(5, 0.5), 0)
    sb.begin_epoch(2)
    assert not sb.needs_losses(2)  # fed: 2 - 0 < 4
    sb.begin_epoch(3)
    assert sb.needs_losses(3)  # no reports in epoch 2: 3 - 0 >= 2


def test_a_policy_class_given_for_a_policy_object_is_refused_naming_the_fix():
    """policy=SelectiveBackprop (the parentheses left out) was refused as "but got ABCMeta", the
    class's metaclass, by the loader and by Phased."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from sbloader import SelectiveLoader

    data = TensorDataset(torch.randn(8, 3), torch.arange(8) % 2)
    for make, name, cls in (
        (
            lambda: SelectiveLoader(
                DataLoader(data), torch.nn.Linear(3, 2), policy=SelectiveBackprop
            ),
            "policy",
            "SelectiveBackprop",
        ),
        (lambda: Phased(SelectiveBackprop, warmup_epochs=1), "policy", "SelectiveBackprop"),
        (
            lambda: Phased(SelectiveBackprop(), warmup_epochs=1, warmup_policy=RandomBackprop),
            "warmup_policy",
            "RandomBackprop",
        ),
    ):
        with pytest.raises(
            TypeError,
            match=rf"^{name} should be an sbloader policy object, but got the class "
            rf"{cls}; pass an instance, e.g. {name}={cls}\(\.\.\.\)$",
        ):
            make()
    with pytest.raises(TypeError, match=r"policy should be an sbloader policy such as .* got str"):
        Phased("sb")
