"""Dynamically padded sources (``SelectiveLoader(pad_values=)``): batches padded to each source
batch's longest sequence, as transformers' ``DataCollatorWithPadding`` makes them, joined into
training batches padded with each field's own value; and, without ``pad_values``, the early error
on the first source batch whose sizes differ."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import sbloader
from sbloader import SelectiveBackprop, SelectiveLoader, Traditional
from sbloader.sources import Source

V, C, N, LONGEST = 20, 3, 48, 12  # vocabulary, classes per token, examples, longest sequence
PADS = {"input_ids": 0, "attention_mask": 0, "labels": -100}


class Sequences(Dataset):
    """Example i: ``L_i`` token ids in [1, V) (0 is the pad token) and a class per token; by
    default each run of 8 examples has its own longest length, from 3 to ``LONGEST``."""

    def __init__(self, n: int = N, lengths: list[int] | None = None) -> None:
        g = torch.Generator().manual_seed(1)
        if lengths is None:
            caps = [3 + (i // 8 * 3) % 10 for i in range(n)]
            lengths = [int(torch.randint(2, cap + 1, (), generator=g)) for cap in caps]
        self.ids = [torch.randint(1, V, (k,), generator=g) for k in lengths]
        self.labels = [torch.randint(0, C, (k,), generator=g) for k in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Collator:
    """Pads each batch to its own longest sequence (ids with 0, mask with 0, labels with -100),
    as ``DataCollatorWithPadding`` does; counts its calls and the widths it made."""

    def __init__(self) -> None:
        self.widths: list[int] = []

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in items)
        self.widths.append(width)
        ids = torch.zeros(len(items), width, dtype=torch.long)
        mask = torch.zeros(len(items), width, dtype=torch.long)
        labels = torch.full((len(items), width), -100, dtype=torch.long)
        for j, r in enumerate(items):
            k = len(r["input_ids"])
            ids[j, :k], mask[j, :k], labels[j, :k] = r["input_ids"], 1, r["labels"]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Tagger(nn.Module):
    """Per-token logits from an embedding, masked: ``forward(input_ids, attention_mask)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, 8)
        self.head = nn.Linear(8, C)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids) * attention_mask[..., None])


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per token (padding ignored), averaged over each example's tokens."""
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)


def over(source: Any, **kw: Any) -> SelectiveLoader:
    """A loader of the :class:`Tagger` over ``source``'s padded batches."""
    return SelectiveLoader(
        source,
        Tagger(),
        token_loss,
        input_key="input_ids",
        target_key="labels",
        forward=lambda model, b: model(b["input_ids"], b["attention_mask"]),
        **{"batch_size": 4, "seed": 0, "prefetch": 0, **kw},
    )


def make(dataset: Sequences, batch: int = 8, collate: Collator | None = None, **kw: Any):
    collate = Collator() if collate is None else collate
    return over(DataLoader(dataset, batch_size=batch, collate_fn=collate), **kw), collate


def check_batch(batch: Any, data: Sequences) -> int:
    """Every row of a yielded batch holds its own example (by ``batch.indices``), padded with
    the field's pad value to the batch's width; returns how many rows are shorter than it."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    width = ids.shape[1]
    assert mask.shape == labels.shape == ids.shape
    assert ids.dtype == mask.dtype == labels.dtype == torch.long
    lengths = [len(data.ids[int(i)]) for i in batch.indices]
    assert width >= max(lengths)
    for row, (i, k) in enumerate(zip(batch.indices.tolist(), lengths)):
        assert torch.equal(ids[row, :k], data.ids[i])
        assert torch.equal(labels[row, :k], data.labels[i])
        assert bool((mask[row, :k] == 1).all())
        assert bool((ids[row, k:] == 0).all())
        assert bool((mask[row, k:] == 0).all())
        assert bool((labels[row, k:] == -100).all())
    return sum(k < width for k in lengths)


def source_widths(data: Sequences, batch: int) -> dict[int, int]:
    """The padded width of the (unshuffled) source batch each example comes in."""
    out = {}
    for start in range(0, len(data), batch):
        members = range(start, min(start + batch, len(data)))
        width = max(len(data.ids[i]) for i in members)
        out.update({i: width for i in members})
    return out


@pytest.mark.parametrize(
    "policy, remainder, overlap",
    [
        (SelectiveBackprop(1 / 3), "carry", False),
        (SelectiveBackprop(1 / 3), "short", False),
        (SelectiveBackprop(1 / 3), "carry", True),
        (None, "carry", False),  # the default policy
    ],
)
def test_whole_epochs_of_padded_batches(policy: Any, remainder: str, overlap: bool) -> None:
    data = Sequences()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # overlap with SB from the first epoch
        loader, collate = make(
            data,
            policy=policy,
            remainder=remainder,
            overlap_selection=overlap,
            pad_values=PADS,
            keep_logits=True,
        )
    widths = source_widths(data, 8)
    joined = padded = rows = 0
    # NOTE: the default policy's stale epochs draw only the candidates they keep, so that their
    # source batches are other 8s of examples than the fixed ones ``widths`` knows.
    fixed = policy is not None
    for _ in range(3):
        for batch in loader:
            if fixed:
                # Each part is padded to the widest source batch among the batch's rows: the
                # batch is as wide as that, never wider (nor narrower than its longest row).
                assert batch["input_ids"].shape[1] == max(widths[int(i)] for i in batch.indices)
                joined += len({widths[int(i)] for i in batch.indices}) > 1
            else:
                assert batch["input_ids"].shape[1] <= max(collate.widths)
                joined += 1
            padded += check_batch(batch, data)
            rows += len(batch.indices)
            if batch.logits is not None:  # per-token logits (see the test below)
                assert batch.logits.shape[0] == len(batch.indices)
    assert len(set(collate.widths)) > 2  # the source's batches do differ in length
    assert joined and padded  # and training batches joined rows of different lengths
    assert rows == sum(loader.stats.epochs[e].examples_yielded for e in range(3))


def test_logits_of_different_lengths_pad_with_nan() -> None:
    data = Sequences()
    loader, _ = make(data, policy=SelectiveBackprop(1 / 3), pad_values=PADS, keep_logits=True)
    widths = source_widths(data, 8)
    seen = 0
    for batch in loader:
        for row, i in enumerate(batch.indices.tolist()):
            logits = batch.logits[row]
            assert torch.isfinite(logits[: widths[i]]).all()
            assert torch.isnan(logits[widths[i] :]).all()
            seen += widths[i] < logits.shape[0]
    assert seen


def test_resume_mid_epoch_with_pending_rows_of_different_lengths() -> None:
    data = Sequences(n=96)
    widths = source_widths(data, 8)

    def build() -> SelectiveLoader:
        return make(data, policy=SelectiveBackprop(1 / 3), pad_values=PADS, batch_size=5)[0]

    def flat(batch: Any) -> tuple:
        return (batch.indices.tolist(), *(batch[k].tolist() for k in PADS))

    whole = build()
    expected, pending = [], []
    for _ in range(2):
        for batch in whole:
            expected.append(flat(batch))
            pending.append(len(whole._pending))
    # Save where rows wait (of one source batch's length) that the next batch joins with rows
    # of another length.
    mixed = [len({widths[i] for i in b[0]}) > 1 for b in expected]
    k = next(j for j in range(1, len(expected) // 2) if pending[j - 1] and mixed[j])

    first = build()
    got = [flat(b) for _, b in zip(range(k), first)]
    state = first.state_dict()
    assert len(state["pending"]["parts"]) == 1 and state["position"] > 0
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = build()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    got += [flat(b) for b in resumed]  # the rest of the epoch
    got += [flat(b) for b in resumed]  # and the next
    assert got == expected


def ragged_source(lengths: list[int]) -> tuple[Sequences, Collator]:
    """Source batches of 4 whose widths are the longest of each 4 lengths."""
    return Sequences(lengths=lengths), Collator()


def test_ragged_field_without_pad_values_fails_on_the_first_batch_that_differs() -> None:
    # Batches 1 and 2 are 8 wide, batch 3 is 10 wide: the error comes when batch 3 is loaded.
    data, collate = ragged_source([8, 3, 2, 5, 4, 8, 6, 2, 10, 3, 3, 3, 8, 2, 2, 2])
    loader, _ = make(data, batch=4, collate=collate, policy=SelectiveBackprop(1 / 3), batch_size=32)
    with pytest.raises(ValueError) as err:
        list(loader)
    message = str(err.value)
    assert collate.widths == [8, 8, 10]  # nothing past the batch that differs was drawn
    assert "field 'input_ids' of source batch 3 (counted from 1) of epoch 0" in message
    assert "(4, 10)" in message and "(4, 8)" in message
    assert "pad_values={'input_ids': <pad value>}" in message
    assert "-100" in message  # labels take the ignore index


def test_time_major_sequences_are_refused_on_the_first_batch_naming_batch_first() -> None:
    """pad_sequence pads to (time, batch) without batch_first=True: the loader, which selects
    along dimension 0, refused the first batch for its fields' lengths, without saying why."""
    data = Sequences()

    def time_major(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = nn.utils.rnn.pad_sequence([r["input_ids"] for r in items])
        return ids, torch.tensor([int(r["labels"][0]) for r in items])

    loader = SelectiveLoader(
        DataLoader(data, batch_size=8, collate_fn=time_major),
        nn.Embedding(V, C),  # (the batch is refused before any forward)
        policy=SelectiveBackprop(1 / 3),
        batch_size=4,
        pad_values={0: 0},
    )
    width = time_major([data[i] for i in range(8)])[0].shape[0]
    with pytest.raises(ValueError) as err:
        next(iter(loader))
    message = str(err.value)
    assert f"field 1 of a source batch has 8 entries but the input field 0 has {width}" in message
    assert "field 0 has 8 in dimension 1" in message
    assert "pad_sequence(..., batch_first=True)" in message


class LeftCollator(Collator):
    """Pads each batch at the start of its rows, as a tokenizer with padding_side='left'."""

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = super().__call__(items)
        for j, r in enumerate(items):
            k = len(r["input_ids"])
            for key in batch:
                batch[key][j] = batch[key][j].roll(batch[key].shape[1] - k)
        return batch


def test_a_field_padded_at_the_start_is_warned_of_on_the_first_batch() -> None:
    """Joined rows are padded at the end: rows of a left-padded source batch got padding at both
    ends silently; now the first source batch is warned of, naming the field and the fix."""
    data = Sequences()
    loader, _ = make(data, collate=LeftCollator(), policy=SelectiveBackprop(1 / 3), pad_values=PADS)
    with pytest.warns(UserWarning) as record:
        next(iter(loader))
    said = [str(w.message) for w in record if "pads it at the start" in str(w.message)]
    assert [m.split("'")[1] for m in said] == ["input_ids", "attention_mask", "labels"]
    assert "tokenizer.padding_side = 'right'" in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # padded at the end, as the loader pads: not warned of
        list(make(data, policy=SelectiveBackprop(1 / 3), pad_values=PADS)[0])


def test_tuple_batches_pad_by_position() -> None:
    data = Sequences()

    def collate(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        padded = Collator()(items)
        return padded["input_ids"], padded["labels"]

    def build(**kw: Any) -> SelectiveLoader:
        return SelectiveLoader(
            DataLoader(data, batch_size=8, collate_fn=collate),
            Tagger(),
            token_loss,
            policy=SelectiveBackprop(1 / 3),
            forward=lambda model, b: model(b[0], (b[0] != 0).long()),
            batch_size=4,
            **kw,
        )

    with pytest.raises(ValueError, match=r"field 1 of source batch 2 .*pad_values=\{1: "):
        list(build(pad_values={0: 0}))  # the labels (position 1) have no pad value
    for ids, labels in build(pad_values={0: 0, -1: -100}):  # -1: the last position
        assert torch.equal(ids == 0, labels == -100)


def test_traditional_passes_ragged_batches_through_without_pad_values() -> None:
    data = Sequences()
    loader, collate = make(data, policy=Traditional(), batch_size=8)
    batches = list(loader)
    assert [b["input_ids"].shape[1] for b in batches] == collate.widths
    assert len(set(collate.widths)) > 1
    for batch in batches:
        assert check_batch(batch, data) >= 0


def test_traditional_rebatching_ragged_batches_needs_pad_values() -> None:
    """Traditional with another batch size than the source's joins rows of different source
    batches, as selection does: the same early error without pad_values, padded rows with."""
    data = Sequences()
    loader, collate = make(data, policy=Traditional(), batch_size=6)
    with pytest.raises(ValueError, match=r"source batch \d+ .*pad_values"):
        list(loader)
    assert len(set(collate.widths)) > 1
    loader, _ = make(data, policy=Traditional(), batch_size=6, pad_values=PADS)
    batches = list(loader)
    assert [len(b.indices) for b in batches] == [6] * (len(data) // 6) + (
        [len(data) % 6] if len(data) % 6 else []
    )
    assert sorted(i for b in batches for i in b.indices.tolist()) == list(range(len(data)))
    assert sum(check_batch(batch, data) for batch in batches) > 0  # some rows were padded


class Padded(Source):
    """A source of :class:`Sequences` padded per batch of 8, with their indices: of a known batch
    size, and leaving nothing out before loading (``subset`` is applied after, as over FFCV)."""

    def __init__(self, data: Sequences, collate: Collator) -> None:
        self.batches = [collate([data[i] for i in range(s, s + 8)]) for s in range(0, N, 8)]

    @property
    def batch_size(self) -> int:
        return 8

    def has_indices(self) -> bool:
        return True

    def epoch(self, skip: int = 0, keep: Any = None) -> Any:
        for b in range(skip, len(self.batches)):
            yield self.batches[b], np.arange(8 * b, 8 * b + 8)


def test_traditional_with_a_subset_left_out_after_loading_needs_pad_values() -> None:
    """Rows outside ``subset`` of a source that cannot leave them out before loading are left
    out after: its batches, of the training batch size, are re-batched, so a ragged field
    without pad_values fails on the first source batch that differs, as with another batch
    size; padded with them."""
    data, collate = Sequences(), Collator()
    source = Padded(data, collate)
    subset = [i for i in range(N) if i % 5]

    def build(**kw: Any) -> SelectiveLoader:
        return over(source, policy=Traditional(), batch_size=8, subset=subset, **kw)

    assert collate.widths[0] != collate.widths[1]
    with pytest.raises(ValueError, match=r"of source batch 2 \(counted from 1\).*pad_values"):
        list(build())
    got = list(build(pad_values=PADS))
    assert [b.indices.tolist() for b in got] == [subset[s : s + 8] for s in range(0, 39, 8)]
    assert sum(check_batch(batch, data) for batch in got) > 0  # some rows were padded


def test_traditional_with_a_subset_a_dataloader_leaves_out_before_loading_joins_no_rows() -> None:
    """A DataLoader leaves the rows outside ``subset`` out before loading and re-batches the
    rest to its batch size: Traditional at that batch size hands its dynamically padded batches
    out whole, each as the collator padded it, without pad_values (it was refused on the second
    source batch, "cannot be joined", though no rows are ever joined there). Over a source that
    leaves them out after loading, the same loader re-batches them (the test above)."""
    data = Sequences()
    subset = [i for i in range(N) if i % 5]
    loader, collate = make(data, policy=Traditional(), batch_size=8, subset=subset)
    got = list(loader)
    assert [b.indices.tolist() for b in got] == [subset[s : s + 8] for s in range(0, 39, 8)]
    assert [b["input_ids"].shape[1] for b in got] == collate.widths
    assert len(set(collate.widths)) > 1  # (ragged: joining any two of them would fail)
    for batch in got:
        check_batch(batch, data)
    # Selecting joins rows of different source batches: still refused without pad_values.
    loader, _ = make(data, policy=SelectiveBackprop(1 / 2), batch_size=8, subset=subset)
    with pytest.raises(ValueError, match=r"source batch 2 \(counted from 1\).*pad_values"):
        list(loader)


def test_resumed_run_fails_where_the_uninterrupted_one_does() -> None:
    # The first batch's shapes are part of the state: a run saved after it and resumed fails on
    # the next batch, as the uninterrupted run does, although its own first batch is 10 wide.
    data, _ = ragged_source([8] * 12 + [10] * 36)

    def build() -> SelectiveLoader:
        return make(data, batch=12, policy=SelectiveBackprop(1 / 3), batch_size=2)[0]

    first = build()
    it = iter(first)
    next(it)
    assert it.position == 1
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = build()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    with pytest.raises(ValueError, match=r"source batch 2 .* has shape \(12, 10\)"):
        list(resumed)


def test_a_run_that_failed_on_ragged_batches_resumes_with_the_pad_values_its_error_names() -> None:
    """The error's fix: resumed with pad_values, the saved first shapes of the fields it pads no
    longer bind them (a padded field's rows are joined at any width), so the run goes on."""
    data, _ = ragged_source([8] * 12 + [10] * 36)

    def build(**kw: Any) -> SelectiveLoader:
        return make(data, batch=12, policy=SelectiveBackprop(1 / 3), batch_size=2, **kw)[0]

    first = build()
    it = iter(first)
    next(it)
    state = copy.deepcopy(first.state_dict())
    with pytest.raises(ValueError, match=r"has shape \(12, 10\)"):
        list(it)
    resumed = build(pad_values=PADS)
    resumed.load_state_dict(state)
    batches = list(resumed)
    assert batches and all(check_batch(b, data) >= 0 for b in batches)


def test_channels_last_inputs_of_different_sizes() -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [4, 4, 6, 5, 6, 3]
    batches = [
        (torch.rand(6, 2, s, s + 1, generator=g) + 1, torch.randint(0, C, (6,), generator=g))
        for s in sizes
    ]
    model = nn.Sequential(
        nn.Conv2d(2, 4, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, C)
    )
    loader = SelectiveLoader(
        batches,
        model,
        policy=SelectiveBackprop(0.5),
        batch_size=4,
        memory_format=torch.channels_last,
        pad_values={0: -1.0},
    )
    padded = 0
    for x, y in loader:
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert x.shape[:2] == (4, 2) and y.shape == (4,)
        for row in x:  # the content is >= 1; -1 only in a bottom-right padded band
            real = row[0] >= 1
            h, w = int(real.any(1).sum()), int(real.any(0).sum())
            assert bool((row[:, :h, :w] >= 1).all())
            assert bool((row[:, h:] == -1).all()) and bool((row[:, :, w:] == -1).all())
            padded += h < x.shape[2]
    assert padded


@pytest.mark.parametrize(
    "pad_values, error, match",
    [
        ([("labels", -100)], TypeError, r"pad_values should be a dict .* but got pad_values=\["),
        ({"input_ids": None}, TypeError, r"pad_values should map .*pad_token_id None"),
        ({"labels": "-100"}, TypeError, r"but got pad_values=\{'labels': '-100'\}"),
    ],
)
def test_pad_values_checked_at_construction(pad_values: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make(Sequences(), pad_values=pad_values)


@pytest.mark.parametrize(
    "pad_values, match",
    [
        ({"label": -100}, r"pad_values names the field 'label', but .*'labels'"),
        ({"input_ids": 0.5, "attention_mask": 0, "labels": -100}, r"whole numbers"),
    ],
)
def test_pad_values_checked_against_the_first_batch(pad_values: Any, match: str) -> None:
    loader, _ = make(Sequences(), policy=SelectiveBackprop(1 / 3), pad_values=pad_values)
    with pytest.raises(ValueError, match=match):
        list(loader)


def test_a_pad_value_out_of_an_integer_fields_range_is_refused() -> None:
    """-1 in a uint8 mask would wrap to 255 silently; refused on the first source batch."""

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        padded = Collator()(items)
        return {**padded, "attention_mask": padded["attention_mask"].to(torch.uint8)}

    data = Sequences()
    kw: dict[str, Any] = {"policy": SelectiveBackprop(1 / 3)}
    bad, _ = make(data, collate=collate, pad_values={**PADS, "attention_mask": -1}, **kw)
    with pytest.raises(ValueError, match=r"a torch.uint8 field holds 0 to 255"):
        next(iter(bad))
    good, _ = make(data, collate=collate, pad_values={**PADS, "attention_mask": 0}, **kw)
    assert all(int(b["attention_mask"].max()) <= 1 for b in good)


def test_pad_values_with_a_frozen_prefix_is_refused() -> None:
    """The prefix's cached per-token features would be joined unpadded (torch.cat fails
    mid-run): refused when the loader is built."""
    prefix = nn.Embedding(50, 4).requires_grad_(False)
    source = DataLoader(Sequences(), batch_size=8, collate_fn=Collator())
    with pytest.raises(ValueError, match="pad_values cannot be combined with frozen_prefix"):
        SelectiveLoader(
            source,
            nn.Linear(4, 5),
            token_loss,
            input_key="input_ids",
            target_key="labels",
            frozen_prefix=prefix,
            pad_values=PADS,
        )


def test_bool_mask_pads_with_a_bool() -> None:
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        padded = Collator()(items)
        return {**padded, "attention_mask": padded["attention_mask"].bool()}

    data = Sequences()
    kw: dict[str, Any] = {"policy": SelectiveBackprop(1 / 3)}
    bad, _ = make(data, collate=collate, pad_values={**PADS, "attention_mask": -100}, **kw)
    with pytest.raises(ValueError, match="a bool field pads with True, False, 0 or 1"):
        list(bad)
    good, _ = make(data, collate=collate, pad_values={**PADS, "attention_mask": False}, **kw)
    for batch in good:
        assert batch["attention_mask"].dtype == torch.bool
        assert torch.equal(batch["attention_mask"], batch["input_ids"] != 0)


def test_public_name() -> None:
    assert "pad_values" in sbloader.SelectiveLoader.__init__.__code__.co_varnames


class NestedCollator(Collator):
    """The same batches with the model's inputs in a nested dict: ``{"inputs": {...}, ...}``."""

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, Any]:  # type: ignore[override]
        flat = super().__call__(items)
        inputs = {"input_ids": flat["input_ids"], "attention_mask": flat["attention_mask"]}
        return {"inputs": inputs, "labels": flat["labels"]}


def make_nested(data: Sequences, batch: int, **kw: Any) -> SelectiveLoader:
    return SelectiveLoader(
        DataLoader(data, batch_size=batch, collate_fn=NestedCollator()),
        Tagger(),
        token_loss,
        input_key="inputs",
        target_key="labels",
        forward=lambda model, b: model(b["inputs"]["input_ids"], b["inputs"]["attention_mask"]),
        **{"batch_size": 2, "seed": 0, "prefetch": 0, "policy": SelectiveBackprop(1 / 3), **kw},
    )


def test_a_ragged_entry_of_a_nested_field_fails_on_the_first_batch_that_differs() -> None:
    # Batches 1 and 2 are 8 wide, batch 3 is 10 wide: the error names the nested entry when
    # batch 3 is loaded, not torch.cat's bare one at a later join.
    data, _ = ragged_source([8, 3, 2, 5, 4, 8, 6, 2, 10, 3, 3, 3, 8, 2, 2, 2])
    loader = make_nested(data, 4, pad_values={"labels": -100}, batch_size=32)
    with pytest.raises(ValueError) as err:
        list(loader)
    message = str(err.value)
    assert "entry ['input_ids'] of the nested field 'inputs' of source batch 3" in message
    assert "(4, 10)" in message and "(4, 8)" in message
    assert "padding='max_length'" in message


def test_nested_fields_of_one_width_train_and_a_resume_checks_the_first_shapes() -> None:
    data, _ = ragged_source([8] * 12 + [10] * 36)
    same = make_nested(Sequences(lengths=[6] * 24), 4, pad_values={"labels": -100})
    rows = [i for b in same for i in b.indices.tolist()]
    assert sorted(rows) == sorted(set(rows)) and 0 < len(rows) < 24
    first = make_nested(data, 12, pad_values={"labels": -100})
    it = iter(first)
    next(it)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make_nested(data, 12, pad_values={"labels": -100})
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    with pytest.raises(ValueError, match=r"nested field 'inputs' of source batch 2 .* \(12, 10\)"):
        list(resumed)


def test_pad_values_for_a_nested_field_is_refused_on_the_first_batch() -> None:
    loader = make_nested(Sequences(), 8, pad_values={"inputs": 0, "labels": -100})
    with pytest.raises(ValueError, match="'inputs', a nested dict: its entries cannot be padded"):
        next(iter(loader))
