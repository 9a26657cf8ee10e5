"""Older states of the loader (and of its components), read by migrating them to the current
version one step at a time (see :func:`sbloader._state.check_version`)."""

from __future__ import annotations

from typing import Any

from .rows import Rows

__all__ = ["ffcv_state_v0_to_v1", "loader_state_v1_to_v2"]


def loader_state_v1_to_v2(
    state: dict[str, Any], has_prefix: bool, keep_logits: bool
) -> dict[str, Any]:
    """A version-1 state (positional pending columns, no identity) as version 2.

    NOTE: version 1 stored each pending chunk as one list of columns: the data fields, then
    indices, losses, probabilities and weights, then the frozen prefix's outputs (with
    ``frozen_prefix``), then the logits (with ``keep_logits``); its identity was only seed
    and rank.
    """
    fmt = state.get("format")
    nfields = len(fmt["keys"]) if fmt is not None else 0
    parts = []
    for cols in state["pending"]["parts"]:
        extra = list(cols[nfields + 4 :])
        features = extra.pop(0) if has_prefix else None
        logits = extra.pop(0) if keep_logits else None
        indices, losses, probabilities, weights = cols[nfields : nfields + 4]
        rows = Rows(list(cols[:nfields]), indices, losses, probabilities, weights, features, logits)
        parts.append(rows.state_dict())
    return {
        "version": 2,
        "identity": {"seed": state["seed"], "rank": state["rank"]},
        "epoch": state["epoch"],
        "position": state["position"],
        "active": state["active"],
        "rng": state["rng"],
        "source": state["source"],
        "policy": state["policy"],
        "pending": {"count": state["pending"]["count"], "parts": parts},
        "codec": {"version": 1, "format": fmt},
        "scorer": {"version": 1, "logits_shape": state.get("logits_shape")},
        # NOTE: version 1 counted no classes: None ("unknown"), not the zeros an absent field
        # would be read as (counts of the rest of a resumed epoch passed off as the epoch's).
        "stats": _without_class_counts(state["stats"]),
    }


def _without_class_counts(stats: Any) -> Any:
    """Version-1 loader stats with each epoch's class counts marked unknown (None)."""
    if not isinstance(stats, dict) or not isinstance(stats.get("epochs"), list):
        return stats
    epochs = [
        {**e, "class_seen": None, "class_selected": None} if isinstance(e, dict) else e
        for e in stats["epochs"]
    ]
    return {**stats, "epochs": epochs}


def ffcv_state_v0_to_v1(state: dict[str, Any]) -> dict[str, Any]:
    """An FFCV source state saved before it had a version (seed, order, num_samples,
    batch_size) as version 1.

    NOTE: version 1 added the Loader's ``indices`` (as a digest), ``drop_last`` and
    ``distributed``, which a mid-epoch resume checks; they stay absent here, so an older state
    is not checked for them (as :func:`sbloader._state.check_identity` skips absent keys).
    """
    return {**state, "version": 1}
