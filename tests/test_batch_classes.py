"""Yielded batches keep the source's own batch class (a namedtuple, a mapping such as
transformers' ``BatchEncoding``), so that code written for the source's batches works."""

from __future__ import annotations

import collections
import copy
import dataclasses
import io
import pickle
from collections import UserDict, namedtuple
from typing import Any

import pytest
import torch
from conftest import ENCODED_KEYS, N_CLASSES, EncodedDataset, IndexLoss, encoded_batches
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import sbloader
from sbloader import SelectedBatch, SelectiveBackprop, SelectiveLoader, Traditional

Sample = namedtuple("Sample", "image label")
N = 48


class Encoding(UserDict):
    """As transformers' BatchEncoding: a UserDict with attribute access to its keys and an
    in-place ``to(device)`` that returns itself."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device: Any) -> Encoding:
        self.data = {k: v.to(device) if torch.is_tensor(v) else v for k, v in self.data.items()}
        return self


class Samples(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Sample:
        x, y = EncodedDataset(N)[i]
        return Sample(x, y)


def encodings(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> Encoding:
    return Encoding(
        {
            "image": torch.stack([s[0] for s in samples]),
            "label": torch.stack([s[1] for s in samples]),
        }
    )


def namedtuple_loader(policy: Any, **kw: Any) -> SelectiveLoader:
    return SelectiveLoader(
        DataLoader(Samples(), batch_size=12), IndexLoss(), policy=policy, batch_size=6, seed=0, **kw
    )


def encoding_loader(
    policy: Any, collate: Any = encodings, batch_size: int = 6, **kw: Any
) -> SelectiveLoader:
    source = DataLoader(EncodedDataset(N), batch_size=12, collate_fn=collate)
    return SelectiveLoader(
        source,
        IndexLoss(),
        policy=policy,
        batch_size=batch_size,
        seed=0,
        input_key="image",
        target_key="label",
        **kw,
    )


def paired(batch: Any) -> None:
    assert torch.equal(batch.image[:, 0].long(), batch.indices)
    assert torch.equal(batch.label, batch.indices % N_CLASSES)


@pytest.mark.parametrize(
    "policy", [Traditional, lambda: SelectiveBackprop(0.5)], ids=["trad", "sb"]
)
def test_namedtuple_batches_stay_namedtuples(policy):
    batches = list(namedtuple_loader(policy()))
    assert batches
    for b in batches:
        assert isinstance(b, Sample) and isinstance(b, SelectedBatch)
        assert type(b).__name__ == "SelectedSample" and b._fields == ("image", "label")
        paired(b)  # attribute access, and the selection results
        image, label = b  # still a tuple
        assert image is b.image and label is b.label
    assert sorted(i for b in batches for i in b.indices.tolist()) == sorted(
        set(i for b in batches for i in b.indices.tolist())
    )


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"input_key": "image"}, r"input_key=, where the field 'image' is 0 of"),
        ({"target_key": "label"}, r"target_key=, where the field 'label' is 1 of"),
    ],
    ids=["input_key", "target_key"],
)
def test_a_namedtuple_field_given_by_name_is_refused_naming_its_position(keys, named):
    """input_key='image' over namedtuple batches (whose fields are read by name in the loop) was
    refused as no position, without the position it means: now the message names it."""
    loader = namedtuple_loader(Traditional(), **keys)
    with pytest.raises(ValueError, match=named + r" \['image', 'label'\]"):
        next(iter(loader))


@pytest.mark.parametrize(
    ("policy", "batch_size"),
    # (12: Traditional hands out whole source batches, whose results are made when first read:
    # looked up before the class's own __getattr__, which knows only the batch's keys)
    [(Traditional, 6), (Traditional, 12), (lambda: SelectiveBackprop(0.5), 6)],
    ids=["trad", "trad-whole", "sb"],
)
def test_a_mapping_batch_class_keeps_its_methods_and_attribute_access(policy, batch_size):
    batches = list(encoding_loader(policy(), batch_size=batch_size))
    assert batches
    for b in batches:
        assert isinstance(b, Encoding) and type(b).__name__ == "SelectedEncoding"
        assert b.to("cpu") is b  # the class's own method
        paired(b)  # its attribute access (image, label) and the selection results
        assert list(b.keys()) == ["image", "label"]
        with pytest.raises(AttributeError):
            b.nothing  # noqa: B018


class AttributeItems(Encoding):
    """As easydict's EasyDict or addict's Dict: an attribute written is an item of the batch."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "data":  # (UserDict's own storage)
            super().__setattr__(name, value)
        else:
            self.data[name] = value


@pytest.mark.parametrize(
    ("policy", "batch_size"),
    [(Traditional, 6), (Traditional, 12), (lambda: SelectiveBackprop(0.5), 6)],
    ids=["trad", "trad-whole", "sb"],
)
def test_a_mapping_whose_attributes_are_items_keeps_its_keys(policy, batch_size):
    def collate(samples):
        return AttributeItems(encodings(samples).data)

    loader = encoding_loader(policy(), collate=collate, batch_size=batch_size)
    batches = list(loader)
    assert batches
    for b in batches:
        assert isinstance(b, AttributeItems)
        assert list(b.keys()) == ["image", "label"]  # no selection result among the fields
        paired(b)
        assert b.features is None and b.logits is None
        b.note = 1  # the class's own attribute writes are kept
        assert b["note"] == 1


def test_forward_hooks_get_the_source_class_too():
    seen: list[type] = []

    def forward(model, batch):
        seen.append(type(batch))
        return model(batch.image)

    list(namedtuple_loader(SelectiveBackprop(0.5), forward=forward))
    assert seen and all(t is Sample for t in seen)


def test_metadata_key_goes_into_a_mapping_and_after_a_namedtuples_fields():
    b = next(iter(encoding_loader(SelectiveBackprop(0.5), metadata_key="sb")))
    assert isinstance(b, Encoding) and torch.equal(b["sb"]["indices"], b.indices)
    t = next(iter(namedtuple_loader(SelectiveBackprop(0.5), metadata_key="sb")))
    image, label, meta = t  # a namedtuple cannot take a field: a plain tuple with the results
    assert type(t) is sbloader.SelectedTuple and torch.equal(meta["indices"], t.indices)
    assert torch.equal(image[:, 0].long(), t.indices) and torch.equal(label, t.indices % N_CLASSES)


@pytest.mark.parametrize(
    "make", [namedtuple_loader, encoding_loader], ids=["namedtuple", "mapping"]
)
def test_pickle_and_deepcopy_keep_the_class_and_the_results(make):
    for policy in (Traditional(), SelectiveBackprop(0.5)):
        b = next(iter(make(policy)))
        for copied in (pickle.loads(pickle.dumps(b)), copy.deepcopy(b)):
            assert type(copied) is type(b)
            assert torch.equal(copied.indices, b.indices)
            assert torch.equal(copied.weights, b.weights)
            paired(copied)


@pytest.mark.parametrize(
    "make", [namedtuple_loader, encoding_loader], ids=["namedtuple", "mapping"]
)
def test_a_resumed_run_yields_the_class_and_the_same_batches(make):
    reference = [b.indices.tolist() for b in make(SelectiveBackprop(0.5))]
    loader = make(SelectiveBackprop(0.5))
    it = iter(loader)
    head = [next(it).indices.tolist() for _ in range(2)]
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    buffer.seek(0)
    resumed = make(SelectiveBackprop(0.5))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    rest = list(resumed)
    assert all(
        type(b).__name__.startswith("Selected") and type(b).__bases__[0] in (Sample, Encoding)
        for b in rest
    )
    assert head + [b.indices.tolist() for b in rest] == reference


def _local_class_loader(fields: str = "image label") -> Any:
    """A loader over batches of a namedtuple class defined in a function, and the class."""
    Pair = namedtuple("Pair", fields)  # (defined here: it cannot be imported again)

    class Pairs(Dataset):
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> Any:
            return Pair(*EncodedDataset(N)[i])

    def make() -> SelectiveLoader:
        return SelectiveLoader(
            DataLoader(Pairs(), batch_size=12),
            IndexLoss(),
            policy=SelectiveBackprop(0.9),
            batch_size=4,
            seed=0,
        )

    return make, Pair


def test_a_batch_handed_out_again_after_a_resume_keeps_a_class_defined_in_a_function():
    # (the batch taken back with unconsumed=1 is handed out before any source batch is read:
    # its class came from the state, which could not import a class defined in a function)
    make, pair = _local_class_loader()
    loader = make()
    it = iter(loader)
    next(it)
    taken_back = next(it)
    state = loader.state_dict(unconsumed=1)
    resumed = make()
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    assert isinstance(first, pair) and type(first) is type(taken_back)
    assert torch.equal(first.indices, taken_back.indices)
    paired(first)


def test_two_classes_defined_by_one_function_are_told_apart_on_resume():
    """Each call of a function defines its class anew, under one qualname (here with other
    fields): a state resumes with its own run's class, not with whichever class of that name a
    state was taken of last (by qualname alone, the second: ``first.image`` then failed)."""
    make, pair = _local_class_loader("image label")
    other_make, other = _local_class_loader("pixels target")
    assert pair.__qualname__ == other.__qualname__ and pair is not other
    loader, other_loader = make(), other_make()
    it, other_it = iter(loader), iter(other_loader)
    next(it), next(other_it)
    taken_back = next(it)
    state = loader.state_dict(unconsumed=1)
    next(other_it)
    other_loader.state_dict(unconsumed=1)  # (its class named after the first's)
    resumed = make()
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    assert isinstance(first, pair) and type(first) is type(taken_back)
    assert first.image is not None and torch.equal(first.indices, taken_back.indices)


def test_a_batch_class_that_cannot_be_found_on_resume_is_warned_of_naming_the_fix():
    make, _ = _local_class_loader()
    loader = make()
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict(unconsumed=1)
    # (as in another process, where a class defined in a function cannot be found)
    state["codec"]["format"]["class"] = "elsewhere:run.<locals>.Pair"
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="elsewhere:run.<locals>.Pair.*define the batch cl") as w:
        kinds = [type(b).__name__ for b in resumed]
    assert len([x for x in w if "cannot be imported" in str(x.message)]) == 1
    # (plain until the first source batch, which tells the class)
    first_pair = kinds.index("SelectedPair")
    assert 0 < first_pair and set(kinds[:first_pair]) == {"SelectedTuple"}
    assert set(kinds[first_pair:]) == {"SelectedPair"}


def test_a_mapping_whose_constructor_takes_no_dict_falls_back_to_a_plain_dict():
    def collate(samples):
        out = collections.defaultdict(list)  # defaultdict(dict) would take a factory
        out["image"] = torch.stack([s[0] for s in samples])
        out["label"] = torch.stack([s[1] for s in samples])
        return out

    source = DataLoader(EncodedDataset(N), batch_size=12, collate_fn=collate)
    loader = SelectiveLoader(
        source, IndexLoss(), policy=Traditional(), input_key="image", target_key="label"
    )
    batches = list(loader)
    assert batches and all(type(b) is sbloader.SelectedDict for b in batches)
    assert sorted(i for b in batches for i in b.indices.tolist()) == list(range(N))


def test_an_ordered_dict_source_yields_ordered_dicts():
    def collate(samples):
        return collections.OrderedDict(encodings(samples).data)

    source = DataLoader(EncodedDataset(N), batch_size=12, collate_fn=collate)
    loader = SelectiveLoader(
        source,
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=6,
        seed=0,
        input_key="image",
        target_key="label",
    )
    for b in loader:
        assert isinstance(b, collections.OrderedDict) and isinstance(b, SelectedBatch)
        assert torch.equal(b["image"][:, 0].long(), b.indices)


def test_a_mapping_batch_without_its_dropped_index_field_keeps_its_class():
    """drop_index=True leaves the index field out of a mapping batch, which stays of the
    source's class (a mapping can lose a key; only a namedtuple cannot lose a field)."""

    def collate(samples):
        batch = collections.OrderedDict(encodings(samples).data)
        batch["index"] = batch["image"][:, 0].long()
        return batch

    for policy in (Traditional(), SelectiveBackprop(0.5)):
        loader = encoding_loader(policy, collate, index_key="index", drop_index=True)
        for b in loader:
            assert type(b) is not collections.OrderedDict and isinstance(b, SelectedBatch)
            assert isinstance(b, collections.OrderedDict) and list(b) == ["image", "label"]
            assert torch.equal(b["image"][:, 0].long(), b.indices)


class Record(dict):
    """A batch class whose constructor keeps only the fields it declares (as a typed record's
    does); a collate_fn adds another field by item assignment."""

    FIELDS = ("image", "label")

    def __init__(self, fields: Any) -> None:
        super().__init__({k: fields[k] for k in self.FIELDS})


def names_of(images: Any) -> list[str]:
    return [f"row{int(x[0])}" for x in images]


WAYS = [(Traditional, 12), (Traditional, 6), (lambda: SelectiveBackprop(0.5), 6)]
WAY_IDS = ["trad-whole", "trad", "sb"]


@pytest.mark.parametrize("policy, batch_size", WAYS, ids=WAY_IDS)
def test_a_mapping_class_whose_constructor_changes_the_keys_yields_plain_dicts_of_every_field(
    policy, batch_size
):
    """Record rebuilt from a batch's fields loses the one the collate_fn added (its keys change):
    the yielded batches are plain SelectedDicts of every field, not Records without it."""

    def collate(samples):
        batch = Record(encodings(samples).data)
        batch["name"] = names_of(batch["image"])
        return batch

    batches = list(encoding_loader(policy(), collate, batch_size=batch_size))
    assert batches
    for b in batches:
        assert type(b) is sbloader.SelectedDict and list(b) == ["image", "label", "name"]
        assert b["name"] == [f"row{i}" for i in b.indices.tolist()]
        assert torch.equal(b["image"][:, 0].long(), b.indices)


@pytest.mark.parametrize("policy, batch_size", WAYS, ids=WAY_IDS)
def test_a_tuple_field_is_a_list_in_every_yielded_batch(policy, batch_size):
    """A collate_fn that transposes its samples with zip(*...) gives a per-example field as a
    tuple: it is a list in every yielded batch, handed out whole, re-batched or selected."""

    def collate(samples):
        images, labels = zip(*samples)
        return {
            "image": torch.stack(images),
            "label": torch.stack(labels),
            "name": tuple(names_of(images)),
        }

    batches = list(encoding_loader(policy(), collate, batch_size=batch_size))
    assert batches
    for b in batches:
        assert type(b["name"]) is list
        assert b["name"] == [f"row{i}" for i in b.indices.tolist()]


@pytest.mark.parametrize(
    "value, error, fix",
    [
        (torch.tensor(2.0), ValueError, r"of the batch is a 0-d tensor.*value\.expand\(len\("),
        ("train", TypeError, r"of the batch is a str.*\[value\] \* len\(batch\)"),
        # (a nested field whose entries disagree on the batch's number of examples)
        (
            {"a": torch.zeros(8), "b": torch.zeros(7)},
            ValueError,
            r"have different numbers of examples \(\{'a': 8, 'b': 7\}\)",
        ),
    ],
    ids=["0-d-tensor", "str", "nested-lengths"],
)
def test_a_batch_level_field_is_refused_naming_the_field_and_the_fix(value, error, fix):
    """A collate_fn adding one value for the whole batch (a scale, a split's name) cannot be
    selected along dimension 0: refused on the first batch, for every policy, naming the field
    and how to give it one entry per example."""
    data = TensorDataset(torch.randn(24, 4), torch.arange(24) % 3)

    def collate(items):
        return {
            "x": torch.stack([a for a, _ in items]),
            "y": torch.stack([b for _, b in items]),
            "extra": value,
        }

    for policy, bs in ((sbloader.SelectiveBackprop(0.5), 4), (sbloader.Traditional(), 8)):
        loader = sbloader.SelectiveLoader(
            DataLoader(data, batch_size=8, collate_fn=collate),
            nn.Linear(4, 3),
            policy=policy,
            batch_size=bs,
            input_key="x",
            target_key="y",
        )
        with pytest.raises(error, match=r"field 'extra' " + fix):
            next(iter(loader))


Row = namedtuple("Row", "features label")


class _Table(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return Row(torch.full((4,), float(i)), i % 3)


@pytest.mark.parametrize("policy, bs", [(Traditional, 16), (lambda: SelectiveBackprop(0.5), 8)])
def test_a_namedtuple_with_a_field_named_like_a_selection_result_falls_back_with_a_warning(
    policy, bs
):
    """Row(features, label): the field is a read-only property, so the selection results could
    not be set ("can't set attribute" on the first batch) or batch.weights read the field. The
    batch falls back to a plain tuple whose attributes are the selection's, said once."""
    import warnings

    from sbloader import batch as B

    B._SELECTED.pop(Row, None)  # (the class's fallback is decided, and said, once a process)
    source = DataLoader(_Table(), batch_size=16)
    with pytest.warns(UserWarning, match=r"Row has 'features', named like the selection results"):
        loader = SelectiveLoader(source, nn.Linear(4, 3), policy=policy(), batch_size=bs, seed=0)
        batches = list(loader)
    b = batches[0]
    assert type(b).__name__ == "SelectedTuple" and not isinstance(b, Row)
    x, _ = b
    assert x.shape == (bs, 4) and torch.equal(x[:, 0].long(), b.indices)
    assert b.features is None and b.weights.shape == (bs,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per class
        list(SelectiveLoader(source, nn.Linear(4, 3), policy=policy(), batch_size=bs, seed=0))


def test_a_read_only_mapping_batch_with_metadata_key_stays_a_dict_with_its_keys():
    """A read-only Mapping batch class cannot take the metadata key: it became a tuple of its
    values (keys lost, batch['sb'] a TypeError); now a plain dict of its items and 'sb'."""
    from collections.abc import Mapping

    class Frozen(Mapping):
        def __init__(self, d):
            self._d = dict(d)

        def __getitem__(self, k):
            return self._d[k]

        def __iter__(self):
            return iter(self._d)

        def __len__(self):
            return len(self._d)

    g = torch.Generator().manual_seed(0)
    batches = [
        Frozen({"input": torch.randn(8, 4, generator=g), "target": torch.arange(8) % 3})
        for _ in range(4)
    ]
    loader = SelectiveLoader(
        batches,
        nn.Linear(4, 3),
        policy=sbloader.RandomBackprop(0.5),
        batch_size=4,
        seed=0,
        metadata_key="sb",
    )
    b = next(iter(loader))
    assert isinstance(b, dict) and list(b) == ["input", "target", "sb"]
    assert b["input"].shape == (4, 4) and b["sb"]["weights"].shape == (4,)


def test_a_nested_entry_that_the_first_source_batch_lacks_is_refused_naming_it():
    """Rows of a batch with an extra nested entry were joined with rows of one without it, and
    the entry was dropped silently; the first batch that has it is refused."""

    def batch(i, extra):
        meta = {"id": torch.arange(8) + 8 * i}
        if extra:
            meta["weight"] = torch.full((8,), 2.0)
        return {"input": torch.randn(8, 4), "target": torch.arange(8) % 3, "meta": meta}

    loader = SelectiveLoader(
        [batch(0, False), batch(1, True), batch(2, True)],
        nn.Linear(4, 3),
        policy=sbloader.RandomBackprop(0.5),
        batch_size=6,
        seed=0,
        forward=lambda m, b: m(b["input"]),
    )
    with pytest.raises(ValueError, match=r"nested field 'meta' of source batch 2 .*\['weight'\]"):
        list(loader)


def test_a_namedtuple_with_a_clashing_field_and_a_metadata_key_is_a_plain_tuple_unwarned():
    """With metadata_key a namedtuple batch is yielded as a plain tuple anyway (the results are
    one more entry): its class is not built, so a field named like a result is not warned of."""
    import warnings

    from sbloader import batch as B

    Keyed = namedtuple("Keyed", "image label indices")

    class Data(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return Keyed(torch.randn(4), i % 3, i)

    B._SELECTED.pop(Keyed, None)
    options = dict(policy=SelectiveBackprop(0.5), batch_size=4, metadata_key="sb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = next(
            iter(SelectiveLoader(DataLoader(Data(), batch_size=8), nn.Linear(4, 3), **options))
        )
    assert type(b).__name__ == "SelectedTuple" and len(b) == 4
    assert torch.equal(b[2], b.indices) and torch.equal(b[3]["indices"], b.indices)


def test_dict_batches_with_their_keys_in_another_order_are_read_by_key():
    """A source batch with the first batch's keys in another order (the default collate
    function orders them as the batch's first example, e.g. JSON records) was refused as a
    changed format mid-epoch; its fields are read by key, and yielded in the first's order."""
    batches = encoded_batches([8, 8, 8])
    batches[1] = {"i": batches[1]["i"], "y": batches[1]["y"], "x": batches[1]["x"]}
    loader = SelectiveLoader(
        batches, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=4, seed=0, **ENCODED_KEYS
    )
    yielded = [b for _ in range(2) for b in loader]
    assert len(yielded) > 1
    for b in yielded:
        assert list(b) == ["x", "y", "i"]
        assert torch.equal(b["x"][:, 0].long(), b.indices) and torch.equal(b["i"], b.indices)
        assert torch.equal(b["y"], b.indices % N_CLASSES)


def test_a_dict_batch_with_other_keys_is_refused_naming_the_missing_and_new_ones():
    batches = encoded_batches([8, 8])
    batches[1]["z"] = batches[1].pop("y")
    loader = SelectiveLoader(
        batches, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=4, seed=0, **ENCODED_KEYS
    )
    missing = r"keys \['x', 'i', 'z'\] \(missing \['y'\], new \['z'\]\)"
    with pytest.raises(ValueError, match=missing):
        list(loader)
    # the same for a tuple batch that gains a field
    rows = [tuple(b.values()) for b in encoded_batches([8, 8])]
    rows[1] += (rows[1][0],)
    loader = SelectiveLoader(rows, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=4)
    with pytest.raises(ValueError, match="changed its batch format: expected a 3-field tuple"):
        list(loader)


@dataclasses.dataclass
class _Pair:
    image: torch.Tensor
    label: torch.Tensor


def _stack(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


@pytest.mark.parametrize(
    "collate, fix",
    [
        (lambda items: _Pair(*_stack(items)), r"_Pair; .*dataclasses\.fields\(batch\)"),
        (lambda items: _stack(items)[0], r"Tensor; a single tensor has no target.*targets\)"),
    ],
    ids=["dataclass", "tensor"],
)
def test_a_dataclass_or_tensor_batch_is_refused_naming_the_fix(collate, fix):
    """A collate_fn returning a dataclass or a bare tensor is refused on the first batch with
    the conversion that makes it a batch the loader reads; the dataclass's is one that works."""
    data = EncodedDataset(N)
    loader = SelectiveLoader(
        DataLoader(data, batch_size=12, collate_fn=collate), IndexLoss(), batch_size=6
    )
    with pytest.raises(TypeError, match=r"the source yielded a " + fix):
        next(iter(loader))

    def as_dict(items):
        batch = _Pair(*_stack(items))
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}

    loader = SelectiveLoader(
        DataLoader(data, batch_size=12, collate_fn=as_dict),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=6,
        input_key="image",
        target_key="label",
    )
    for b in loader:
        assert torch.equal(b["image"][:, 0].long(), b.indices)


def test_a_collate_fn_that_leaves_samples_out_is_refused_naming_index_key():
    """The recovered indices are paired with the collated examples by position: a collate_fn
    that drops samples (the dataset's Nones) is refused on that batch naming index_key=, and
    with an index field (also sorted by the collate_fn, as for pack_padded_sequence) each
    example keeps its own index."""

    class Gappy(Dataset):
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> Any:
            x, y = EncodedDataset(N)[i]
            return None if i % 5 == 3 else {"image": x, "label": y, "i": i}

    def kept(items):
        return torch.utils.data.default_collate([s for s in items if s is not None])

    def kept_sorted(items):
        return kept(sorted((s for s in items if s is not None), key=lambda s: -s["i"]))

    def loader(collate, **kw: Any) -> SelectiveLoader:
        return SelectiveLoader(
            DataLoader(Gappy(), batch_size=12, collate_fn=collate),
            IndexLoss(),
            policy=SelectiveBackprop(0.5),
            batch_size=6,
            input_key="image",
            target_key="label",
            **kw,
        )

    with pytest.raises(ValueError, match=r"has 10 examples but 12 dataset indices.*index_key="):
        next(iter(loader(kept)))
    fixed = loader(kept_sorted, index_key="i", dataset_size=N)
    seen = 0
    for b in fixed:
        assert torch.equal(b["image"][:, 0].long(), b.indices)
        assert torch.equal(b["label"], b.indices % N_CLASSES)
        seen += len(b)
    assert seen > 0


def test_a_dataloader_of_whole_batches_is_refused_naming_index_key_which_reads_it():
    """A DataLoader with batch_size=None over a dataset of whole batches cannot have its
    indices recovered: refused naming index_key=, with which it is read as it is."""

    class Batches(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, k: int) -> Any:
            i = torch.arange(12 * k, 12 * k + 12)
            return torch.stack([EncodedDataset(N)[int(j)][0] for j in i]), i % N_CLASSES, i

    with pytest.raises(ValueError, match=r"batch_size=None.*whole batches.*index_key="):
        SelectiveLoader(DataLoader(Batches(), batch_size=None), IndexLoss())
    loader = SelectiveLoader(
        DataLoader(Batches(), batch_size=None),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=6,
        index_key=2,
        drop_index=True,
        dataset_size=N,
    )
    for image, label in loader:
        assert torch.equal(label, image[:, 0].long() % N_CLASSES)


def test_a_list_inside_each_example_collated_by_position_is_refused_naming_the_fix():
    """The default collate function batches a list inside each example (captions of an image)
    as one tuple per position in the lists: refused on the first batch naming the collate_fn
    that keeps each example's list, with which every example keeps its own captions."""

    class Captioned(Dataset):
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> Any:
            x, y = EncodedDataset(N)[i]
            return x, y, [f"{i}a", f"{i}b", f"{i}c"]

    def loader(collate: Any) -> SelectiveLoader:
        return SelectiveLoader(
            DataLoader(Captioned(), batch_size=12, collate_fn=collate),
            IndexLoss(),
            policy=SelectiveBackprop(0.5),
            batch_size=6,
        )

    with pytest.raises(ValueError, match=r"field 2 .* list of 3 sequences of 12 entries.*\[sample"):
        next(iter(loader(torch.utils.data.default_collate)))

    def own_lists(samples):
        x, y = torch.utils.data.default_collate([s[:2] for s in samples])
        return x, y, [s[2] for s in samples]

    for x, y, captions in loader(own_lists):
        assert torch.equal(y, x[:, 0].long() % N_CLASSES)
        assert captions == [[f"{i}a", f"{i}b", f"{i}c"] for i in x[:, 0].long().tolist()]


def test_a_tuple_of_metadata_inside_each_example_is_refused_naming_the_fix():
    """``(image, label, (index, path))`` collated by the default collate function: its tuple
    is one column per position, a tensor of indices and a list of paths. The first batch said
    "field 2 has 2 entries but the input field 0 has 12", not why nor the fix."""

    class Files(Dataset):
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> Any:
            x, y = EncodedDataset(N)[i]
            return x, y, (i, f"img_{i}.png")

    loader = SelectiveLoader(
        DataLoader(Files(), batch_size=12), IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=6
    )
    with pytest.raises(
        ValueError,
        match=r"field 2 of a source batch is a list of 2 fields of 12 entries \(tensors, lists\) "
        r"each: a tuple or list of fields inside each example .* flatten it",
    ):
        next(iter(loader))
