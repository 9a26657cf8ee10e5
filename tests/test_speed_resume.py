"""The speed options and resuming: a run with any combination of them is deterministic per seed
and resumes exactly (within what the README documents), and a state saved with other speed
options is refused or loads with a warning naming them, as documented.

The harness (``speed_harness``) trains a small CNN with a real optimizer step on every batch, so
that every selection depends on the steps before it."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
from speed_harness import (
    Config,
    build,
    first_difference,
    run,
    same,
    step,
    through_torch_save,
)

import sbloader

pytestmark = [
    # Plain SB with overlap is warned about (test_overlap); the combinations here use it anyway.
    pytest.mark.filterwarnings("ignore:overlap_selection=True with"),
    pytest.mark.usefixtures("one_torch_thread"),  # (conftest)
]


def saved_after(cfg: Config, batches: int) -> dict[str, Any]:
    """The loader's state after ``batches`` trained batches (mid-epoch)."""
    _, model, opt, loader = build(cfg)
    done = 0
    while True:
        for batch in loader:
            step(cfg, model, opt, loader, batch)
            done += 1
            if done == batches:
                return through_torch_save(loader.state_dict())


def load_warnings(cfg: Config, state: dict[str, Any]) -> list[str]:
    """Load ``state`` into a loader built from ``cfg``; the speed warnings it gave."""
    _, _, _, loader = build(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state)
    assert loader.epoch == state["epoch"]  # loaded
    return [str(w.message) for w in caught if "loaded SelectiveLoader state" in str(w.message)]


QUANTIZED = sbloader.QuantizedSelection(refresh_every=2)


@pytest.mark.parametrize(
    ("saved", "loading", "was", "now"),
    [
        ({}, {"overlap": True}, "overlap_selection=False", "overlap_selection=True"),
        ({"overlap": True}, {}, "overlap_selection=True", "overlap_selection=False"),
        ({}, {"scale": 0.5}, "selection_scale=None", "selection_scale=0.5"),
        ({"autocast": None}, {"autocast": torch.bfloat16}, "autocast=None", "autocast=torch.bf"),
        ({"autocast": torch.bfloat16}, {"autocast": None}, "autocast=torch.bf", "autocast=None"),
        ({}, {"channels_last": True}, "memory_format=None", "memory_format=torch.channels_last"),
        ({}, {"compile": True}, "compile_selection=False", "compile_selection={'backend'"),
        ({}, {"selection_batch_size": 5}, "selection_batch_size=None", "selection_batch_size=5"),
        (
            {"quantize": True},
            {"quantize": True, "extra": {"quantize": QUANTIZED}},
            "quantize_selection=QuantizedSelection(refresh_examples=16384",
            "quantize_selection=QuantizedSelection(refresh_examples=None, refresh_every=2",
        ),
    ],
    ids=[
        "overlap",
        "no-overlap",
        "scale",
        "bf16",
        "float32",
        "channels_last",
        "compile",
        "chunks",
        "int8-settings",
    ],
)
def test_a_state_saved_with_other_speed_options_loads_with_a_warning_naming_them(
    saved, loading, was, now
):
    """Documented as allowed (a run resumed on another machine may change them), but not
    silently: loaded without a word, the resumed run selected otherwise than the saved run
    would have."""
    base = Config(policy="sb", autocast=None)
    state = saved_after(replace(base, **saved), 5)
    (message,) = load_warnings(replace(base, **loading), state)
    assert f"saved with {was}" in message and f"this loader has {now}" in message
    assert "to resume it exactly" in message


@pytest.mark.parametrize(
    ("saved", "loading"),
    [
        ({}, {}),
        ({"overlap": True, "scale": 0.5, "channels_last": True}, {}),  # all of them, ...
        ({}, {"prefetch": 1}),  # changes no selection
        ({"autocast": torch.bfloat16}, {"autocast": "auto"}),  # "auto" adopts the saved one
        ({"autocast": None}, {"autocast": "auto"}),
    ],
    ids=["same", "same-many", "prefetch", "auto-adopts-bf16", "auto-adopts-float32"],
)
def test_no_speed_warning_where_the_resumed_run_selects_as_the_saved_one(saved, loading):
    base = Config(policy="sb", autocast=None)
    state = saved_after(replace(base, **saved), 5)
    assert not load_warnings(replace(base, **{**saved, **loading}), state)


def test_a_state_saved_before_speed_options_were_recorded_loads_without_a_warning():
    state = saved_after(Config(policy="sb"), 5)
    del state["speed"]
    assert not load_warnings(Config(policy="sb", overlap=True), state)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("policy", ["ramp", "stale"])
def test_what_a_dataloaders_workers_draw_ahead_is_counted_when_handed_out(policy, prefetch):
    """A DataLoader with worker processes draws batches from its sampler ahead of handing them
    out, and the examples it filters out there (outside ``subset``, rejected in Stale-SB's stale
    epochs) were counted as they were drawn: a run resumed mid-epoch (which replays the batches
    consumed, uncounted) counted the batches drawn ahead twice, its ``excluded`` and
    ``prefiltered`` too high and its ``loader.progress`` ahead, and with ``ramp_epochs``, whose
    P follows the progress, it then selected otherwise. Counted as each batch is handed out,
    a run with workers counts, progresses and selects as one without, and resumes exactly."""
    plain = run(Config(policy=policy, subset=True, prefetch=prefetch))
    workers = Config(policy=policy, subset=True, prefetch=prefetch, workers=1)
    for cuts in ((), ((3, "in-loop"), (9, "after-break"), (14, "unconsumed"))):
        got = run(workers, cuts)
        alike = same(got, plain)
        assert alike, f"{cuts}: {first_difference(got, plain)}"
