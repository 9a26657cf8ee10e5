"""Models that are not ``model(x)``: ``forward=``, a tuple ``input_key``, nested batches and the
``output=`` extractor, with a small transformer over token ids and an attention mask."""

from __future__ import annotations

import io
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from sbloader import Phased, RandomBackprop, SelectiveBackprop, SelectiveLoader
from sbloader.selection import eval_mode

V, L, D, C, N = 30, 10, 16, 3, 120  # vocabulary, sequence length, width, classes, examples


class Tokens(Dataset):
    """Token ids padded with 0 to length L, a boolean attention mask (True: a real token) and a
    label; ``nested=True`` puts the model's inputs in a dict of their own."""

    def __init__(self, nested: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, L + 1, (N,), generator=g)
        self.mask = torch.arange(L)[None, :] < lengths[:, None]
        self.ids = torch.randint(1, V, (N, L), generator=g).masked_fill(~self.mask, 0)
        self.labels = torch.randint(0, C, (N,), generator=g)
        self.nested = nested

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        inputs = {"input_ids": self.ids[i], "attention_mask": self.mask[i]}
        if self.nested:
            return {"inputs": inputs, "labels": self.labels[i]}
        return {**inputs, "labels": self.labels[i]}


class TinyEncoder(nn.Module):
    """A one-layer ``nn.TransformerEncoder`` over token ids, mean-pooled over the real tokens;
    returns ``{"logits": ...}``. Without a mask it attends to (and pools) the padding too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(
            D, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(D, C)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        if attention_mask is None:
            return {"logits": self.head(self.encoder(h).mean(1))}
        real = attention_mask.bool()
        h = self.encoder(h, src_key_padding_mask=~real).masked_fill(~real[..., None], 0.0)
        pooled = h.sum(1) / real.sum(1, keepdim=True)
        return {"logits": self.head(pooled)}


def with_mask(model: nn.Module, batch: dict[str, Any]) -> Any:
    return model(batch["input_ids"], attention_mask=batch["attention_mask"])


def source(nested: bool = False, batch_size: int = 40) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(Tokens(nested), batch_size=batch_size, shuffle=True, generator=g)


def make_loader(model: nn.Module, nested: bool = False, **kw: Any) -> SelectiveLoader:
    kw.setdefault("input_key", "inputs" if nested else "input_ids")
    kw.setdefault("policy", SelectiveBackprop(0.5))
    kw.setdefault("autocast", None)  # losses and logits are compared with float32's
    return SelectiveLoader(
        source(nested),
        model,
        batch_size=16,
        seed=3,
        target_key="labels",
        keep_logits=True,
        **kw,
    )


def reference(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The model's logits as a selection pass computes them: eval mode, no autograd."""
    with eval_mode(model), torch.no_grad():
        return model(ids, attention_mask=mask)["logits"]


def test_selection_losses_are_the_masked_models_and_logits_its_outputs():
    """forward= gets the whole input: each yielded example's selection loss is the loss of the
    model with the attention mask (not of the model without it), batch.logits rows are the
    model's outputs for those examples, and the hook sees chunks of selection_batch_size in
    eval mode under inference mode, with the training flags restored afterwards."""
    model = TinyEncoder().train()
    seen: list[tuple[list[str], int, bool, bool]] = []

    def forward(m: nn.Module, batch: dict[str, Any]) -> Any:
        rows = batch["input_ids"].shape[0]
        seen.append((sorted(batch), rows, m.training, torch.is_inference_mode_enabled()))
        return with_mask(m, batch)

    data = Tokens()
    batches = list(make_loader(model, forward=forward, selection_batch_size=7))
    assert batches and all(m.training for m in model.modules())
    assert {s[0] == ["attention_mask", "input_ids", "labels"] for s in seen} == {True}
    assert [s[1] for s in seen[:6]] == [7, 7, 7, 7, 7, 5]  # one source batch of 40, in chunks
    assert {(s[2], s[3]) for s in seen} == {(False, True)}
    for b in batches:
        ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
        assert torch.equal(ids, data.ids[b.indices]) and torch.equal(mask, data.mask[b.indices])
        full = reference(model, ids, mask)
        torch.testing.assert_close(b.logits, full)
        torch.testing.assert_close(b.losses, F.cross_entropy(full, labels, reduction="none"))
        unmasked = F.cross_entropy(reference(model, ids, None), labels, reduction="none")
        assert (unmasked - b.losses).abs().max() > 1e-2


def test_a_tuple_input_key_passes_the_fields_as_positional_inputs():
    forward = list(make_loader(TinyEncoder(), forward=with_mask))
    fields = list(make_loader(TinyEncoder(), input_key=("input_ids", "attention_mask")))
    assert len(forward) == len(fields) > 0
    for a, b in zip(forward, fields):
        assert torch.equal(a.indices, b.indices)
        assert torch.equal(a.losses, b.losses) and torch.equal(a.logits, b.logits)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def test_nested_batches_are_selected_and_resume_mid_epoch_exactly():
    """Dict batches with the model's inputs in a nested dict: rows are gathered in every
    nested field, and a loader restored mid-epoch (through torch.save / weights_only load, with
    nested rows pending) yields exactly what the uninterrupted one does."""
    model = TinyEncoder()

    def forward(m: nn.Module, batch: dict[str, Any]) -> Any:
        return m(**batch["inputs"])

    data = Tokens(nested=True)
    whole = make_loader(model, nested=True, forward=forward)
    expected = list(whole) + list(whole)
    for b in expected:
        assert torch.equal(b["inputs"]["input_ids"], data.ids[b.indices])
        assert torch.equal(b["inputs"]["attention_mask"], data.mask[b.indices])
        inputs = b["inputs"]
        torch.testing.assert_close(
            b.logits, reference(model, inputs["input_ids"], inputs["attention_mask"])
        )

    first = make_loader(model, nested=True, forward=forward)
    it = iter(first)
    got = [next(it) for _ in range(2)]
    assert first.pending_examples > 0  # nested rows wait in the saved state
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make_loader(model, nested=True, forward=forward)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    got += list(resumed) + list(resumed)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert _equal(dict(a), dict(b))
        assert torch.equal(a.indices, b.indices) and torch.equal(a.losses, b.losses)
        assert torch.equal(a.logits, b.logits)


@dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class ModelOutput(OrderedDict):
    """Like Hugging Face's ModelOutput: a dict whose entries are attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


WRAPS = {
    "dict": (lambda z: {"hidden": z * 2, "logits": z}, None),
    "modeloutput": (lambda z: ModelOutput(loss=z.sum(), logits=z), None),
    "dataclass": (lambda z: Out(logits=z, hidden=z * 2), None),
    "key": (lambda z: {"scores": z, "logits": z * 2}, "scores"),
    "attribute": (lambda z: Out(logits=z * 2, hidden=z), "hidden"),
    "position": (lambda z: (z * 2, z), 1),
    "callable": (lambda z: [{"out": z}], lambda out: out[0]["out"]),
}


@pytest.mark.parametrize("kind", sorted(WRAPS))
def test_the_output_extractor_feeds_loss_fn_and_keep_logits(kind):
    wrap, output = WRAPS[kind]
    model = TinyEncoder()

    def forward(m: nn.Module, batch: dict[str, Any]) -> Any:
        return wrap(with_mask(m, batch)["logits"])

    batches = list(make_loader(model, forward=forward, output=output))
    assert batches
    for b in batches:
        full = reference(model, b["input_ids"], b["attention_mask"])
        torch.testing.assert_close(b.logits, full)
        torch.testing.assert_close(b.losses, F.cross_entropy(full, b["labels"], reduction="none"))


def test_a_loss_fn_of_ones_own_takes_dict_outputs_whole_and_keep_logits_their_logits():
    """As before output= existed, a loss_fn that is not a torch loss module gets the model's dict
    whole; keep_logits keeps its "logits"; output= hands the loss_fn a part instead."""
    model = TinyEncoder()
    taken: list[type] = []

    def whole(out: Any, y: torch.Tensor) -> torch.Tensor:
        taken.append(type(out))
        return F.cross_entropy(out["logits"], y, reduction="none")

    def part(out: Any, y: torch.Tensor) -> torch.Tensor:
        taken.append(type(out))
        return F.cross_entropy(out, y, reduction="none")

    for loss_fn, output, kind in ((whole, None, dict), (part, "logits", torch.Tensor)):
        taken.clear()
        batches = list(make_loader(model, forward=with_mask, loss_fn=loss_fn, output=output))
        assert batches and set(taken) == {kind}
        for b in batches:
            full = reference(model, b["input_ids"], b["attention_mask"])
            torch.testing.assert_close(b.logits, full)
            torch.testing.assert_close(
                b.losses, F.cross_entropy(full, b["labels"], reduction="none")
            )


def _first_batch_fails(model: nn.Module, error: type, match: str, **kw: Any) -> None:
    """The first next() raises, after one selection forward at most, with the flags restored."""
    calls: list[int] = []
    hook = kw.get("forward")
    if hook is not None:

        def counted(m: nn.Module, batch: Any) -> Any:
            calls.append(1)
            return hook(m, batch)

        kw["forward"] = counted
    loader = make_loader(model.train(), **kw)
    with pytest.raises(error, match=match):
        next(iter(loader))
    assert all(m.training for m in model.modules())  # restored although the pass raised
    assert len(calls) <= 1 and loader.stats.current.selection_forwards == 0


def test_user_errors_are_refused_on_the_first_batch_naming_the_fix():
    model = TinyEncoder()

    def loss(m: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(with_mask(m, batch)["logits"], batch["labels"])

    _first_batch_fails(
        model,
        ValueError,
        r"forward= returned a 0-d tensor .* make forward= return the model's outputs",
        forward=loss,
    )
    _first_batch_fails(
        model,
        ValueError,
        r"output='logit' names no key or attribute of the model's outputs, which are a dict "
        r"with keys \['logits'\]; pass output= one of them",
        forward=with_mask,
        output="logit",
    )
    _first_batch_fails(
        model,
        ValueError,
        r"output='loss' returned a 0-d tensor .* pass output= naming the per-example outputs",
        forward=lambda m, b: {"loss": loss(m, b), "logits": with_mask(m, b)["logits"]},
        output="loss",
    )
    _first_batch_fails(
        model,
        TypeError,
        r"on the outputs of forward=, a dict with keys \['scores'\]; pass output= naming",
        forward=lambda m, b: {"scores": with_mask(m, b)["logits"]},
    )
    _first_batch_fails(
        model,
        KeyError,
        r"input_key=\('input_ids', 'mask'\) names 'mask', which is no field",
        input_key=("input_ids", "mask"),
    )


class _PairDataset(Dataset):
    """Examples ``((ids, mask), label)`` or ``(ids, label, (ids, mask))``: a tuple of fields
    inside the example, which the default collate function turns into a list of two tensors."""

    def __init__(self, inputs_first: bool) -> None:
        self.data, self.inputs_first = Tokens(), inputs_first

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        pair = (self.data.ids[i], self.data.mask[i])
        if self.inputs_first:
            return pair, self.data.labels[i]
        return self.data.ids[i], self.data.labels[i], pair


@pytest.mark.parametrize("inputs_first", [True, False], ids=["input", "extra_field"])
def test_a_nested_tuple_of_fields_is_refused_naming_it_and_the_fix(inputs_first):
    """A multi-input model's examples as ``((ids, mask), label)``: the input field is a list of
    two tensors of 16 rows, once collated. The first batch said "field 1 has 16 entries but the
    input field 0 has 2", as if the data were short, not that nested tuples are not selected."""
    forward = (lambda m, b: m(*b[0])) if inputs_first else (lambda m, b: m(b[0]))
    dl = DataLoader(_PairDataset(inputs_first), batch_size=16)
    loader = SelectiveLoader(
        dl, TinyEncoder(), policy=SelectiveBackprop(0.5), batch_size=8, forward=forward,
        output="logits",
    )  # fmt: skip
    field = 0 if inputs_first else 2
    with pytest.raises(
        ValueError,
        match=rf"field {field} of a source batch is a list of 2 tensors of 16 rows each: a "
        r"tuple or list of fields .* make the example a dict",
    ):
        next(iter(loader))


def test_the_hook_runs_like_the_default_forward():
    """Eval mode restored when the hook raises; autocast applied; compile_selection hands the
    hook the compiled module."""
    model = TinyEncoder().train()

    def boom(m: nn.Module, batch: Any) -> Any:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        next(iter(make_loader(model, forward=boom)))
    assert all(m.training for m in model.modules())

    flags: list[bool] = []

    def autocast(m: nn.Module, batch: Any) -> Any:
        flags.append(torch.is_autocast_enabled("cpu"))
        return with_mask(m, batch)

    next(iter(make_loader(model, forward=autocast, autocast=torch.bfloat16)))
    assert flags and all(flags)

    kinds: list[str] = []

    def compiled(m: nn.Module, batch: Any) -> Any:
        kinds.append(type(m).__name__)
        return with_mask(m, batch)

    loader = make_loader(model, forward=compiled, compile_selection={"backend": "eager"})
    got = next(iter(loader))
    assert set(kinds) == {"OptimizedModule"}
    plain = next(iter(make_loader(model, forward=with_mask)))
    assert torch.equal(got.indices, plain.indices)


def test_bad_combinations_are_refused_when_the_loader_is_built():
    model, dl = TinyEncoder(), source()
    cases: list[tuple[dict[str, Any], type, str]] = [
        ({"forward": "model"}, TypeError, r"forward should be a callable forward\(model, batch\)"),
        ({"output": 1.5}, TypeError, "output should be None"),
        ({"forward": with_mask, "frozen_prefix": nn.Identity()}, ValueError, "frozen_prefix=None"),
        ({"forward": with_mask, "selection_scale": 0.5}, ValueError, "selection_scale=None"),
        ({"input_key": ()}, ValueError, "input_key should name at least one field"),
        (
            {"input_key": ("input_ids", "attention_mask"), "forward": with_mask},
            ValueError,
            "cannot be combined: a tuple input_key calls model",
        ),
    ]
    for kw, error, match in cases:
        kw.setdefault("input_key", "input_ids")
        with pytest.raises(error, match=match):
            SelectiveLoader(dl, model, target_key="labels", **kw)


def test_fields_the_model_is_not_given_are_warned_about():
    """input_key="input_ids" alone scores without the attention mask: warned, naming forward=;
    not with forward=, nor for the index field, list fields or a dict field of names."""
    model = TinyEncoder()
    with pytest.warns(UserWarning, match=r"\['attention_mask'\] besides the input field") as rec:
        first = next(iter(make_loader(model)))
    assert "pass forward=" in str(rec[0].message) and first.logits is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(make_loader(model, forward=with_mask)))
        g = torch.Generator().manual_seed(0)
        rows = [
            {
                "x": torch.randn(4, generator=g),
                "y": i % 2,
                "idx": i,
                "name": f"ex{i}",
                "meta": {"source": f"s{i % 3}"},  # (a dict of names: no tensor field)
            }
            for i in range(32)
        ]
        loader = SelectiveLoader(
            [b for b in DataLoader(rows, batch_size=16)],
            nn.Linear(4, 2),
            input_key="x",
            target_key="y",
            index_key="idx",
            batch_size=4,
        )
        next(iter(loader))


def test_a_warm_up_tries_the_hook_on_its_first_batch():
    """An epoch without selection passes (a Random-Backprop warm-up) still tries forward= on the
    first source batch: a good hook trains through it, a bad one fails at once, and fields the
    model is not given are warned about there."""

    def warmup() -> Phased:
        return Phased(SelectiveBackprop(0.5), warmup_epochs=1, warmup_policy=RandomBackprop(0.5))

    model = TinyEncoder()
    loader = make_loader(model, forward=with_mask, policy=warmup())
    assert list(loader) and loader.stats.current.selection_forwards == 0
    assert list(loader) and loader.stats.current.selection_forwards == N

    def loss(m: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(with_mask(m, batch)["logits"], batch["labels"])

    with pytest.raises(ValueError, match="forward= returned a 0-d tensor"):
        next(iter(make_loader(model, forward=loss, policy=warmup())))
    with pytest.warns(UserWarning, match=r"\['attention_mask'\] besides the input field"):
        next(iter(make_loader(model, policy=warmup())))


def test_a_selection_pass_over_no_examples_is_refused_naming_the_fix():
    from sbloader.selection import selection_outputs

    with pytest.raises(
        ValueError, match="needs at least one example to score, but the inputs have 0 rows"
    ):
        selection_outputs(
            nn.Linear(3, 2),
            torch.zeros(0, 3),
            torch.zeros(0, dtype=torch.long),
            nn.CrossEntropyLoss(reduction="none"),
        )


class Masked(nn.Module):
    """``model(x, mask)``: a linear layer over the masked features."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, C)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x * mask)


def masked_rows(n: int = 64) -> torch.utils.data.TensorDataset:
    """``(x, mask, y)`` examples."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    mask = (torch.rand(n, 8, generator=g) > 0.3).float()
    return torch.utils.data.TensorDataset(x, mask, torch.randint(0, C, (n,), generator=g))


@pytest.mark.parametrize("policy", ["sb", "default", "phased"])
def test_a_model_of_two_inputs_given_one_is_refused_on_the_first_batch_naming_input_key(policy):
    """Over (x, mask, y) batches a model(x, mask) called with x alone fails on the first source
    batch, in a warm-up epoch too (the default's), with a TypeError naming input_key= (with the
    keys that fit), target_key= and forward=, chained from the model's own; with those keys the
    selection losses are the model's on both inputs against the third field."""
    policies = {
        "sb": lambda: SelectiveBackprop(0.5),
        "default": lambda: None,
        "phased": lambda: Phased(
            SelectiveBackprop(0.5), warmup_epochs=1, warmup_policy=RandomBackprop(0.5)
        ),
    }
    data = masked_rows()
    drawn = []

    class Counted(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(data)

        def __getitem__(self, i: int) -> Any:
            drawn.append(i)
            return data[i]

    model = Masked()
    loader = SelectiveLoader(
        DataLoader(Counted(), batch_size=16), model, policy=policies[policy](), autocast=None
    )
    with pytest.raises(TypeError) as caught:
        next(iter(loader))
    message = str(caught.value)
    assert "calls model(inputs), the input_key field alone" in message
    assert "Masked.forward(x, mask) takes 2 positional inputs" in message
    assert "input_key=(0, 1), target_key=2" in message and "forward=" in message
    assert isinstance(caught.value.__cause__, TypeError)
    assert "missing 1 required positional argument: 'mask'" in str(caught.value.__cause__)
    assert len(drawn) == 16  # the first source batch

    fixed = SelectiveLoader(
        DataLoader(data, batch_size=16),
        model,
        policy=SelectiveBackprop(0.5),
        input_key=(0, 1),
        target_key=2,
        autocast=None,
    )
    batches = list(fixed)
    assert batches
    x, mask, y = data.tensors
    for b in batches:
        assert torch.equal(b[2], y[b.indices])
        with torch.no_grad():
            expected = F.cross_entropy(
                model(x[b.indices], mask[b.indices]), y[b.indices], reduction="none"
            )
        torch.testing.assert_close(b.losses, expected)


def test_a_tuple_input_key_of_more_fields_than_the_model_takes_is_refused_naming_it():
    loader = SelectiveLoader(
        DataLoader(masked_rows(), batch_size=16),
        nn.Linear(8, C),
        policy=SelectiveBackprop(0.5),
        input_key=(0, 1),
        target_key=2,
    )
    with pytest.raises(
        TypeError,
        match=r"with the 2 fields of input_key=\(0, 1\), but Linear.forward\(input\) takes 1 ",
    ):
        next(iter(loader))


def test_a_type_error_inside_a_forward_that_took_its_inputs_is_left_as_it_is():
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise TypeError("an error of the model's own")

    loader = SelectiveLoader(
        DataLoader(masked_rows(), batch_size=16), Broken(), policy=SelectiveBackprop(0.5)
    )
    with pytest.raises(TypeError, match=r"^an error of the model's own$"):
        next(iter(loader))


def test_inputs_that_a_forward_pre_hook_completes_are_not_blamed():
    from sbloader.selection import unbound_inputs

    model = Masked()
    assert "takes 2 positional inputs" in str(unbound_inputs(model, 1))
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: None)
    assert unbound_inputs(Masked(), 1) is None  # (a global hook may supply inputs too)
    handle.remove()

    class OwnCall(Masked):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return super().__call__(x, torch.ones_like(x))

    assert unbound_inputs(OwnCall(), 1) is None
    model.register_forward_pre_hook(lambda m, args: (args[0], torch.ones_like(args[0])))
    assert unbound_inputs(model, 1) is None
    loader = SelectiveLoader(
        DataLoader(masked_rows(), batch_size=16),
        model,
        policy=SelectiveBackprop(0.5),
        target_key=2,
    )
    assert list(loader)


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_a_default_target_that_a_tuple_input_key_names_is_refused_on_every_first_batch(kind):
    """input_key=(0, 1) over (x, mask, y) leaves target_key at its default, 1: the mask. Refused
    on the first batch, and again on the next epoch's (the refusal leaves no format behind);
    given explicitly (a model conditioned on its label) the same field is accepted."""
    data = masked_rows()
    x, mask, y = data.tensors
    if kind == "tuple":
        rows: Any = data
        keys: tuple[Any, ...] = (0, 1)
        refused = "target_key defaults to 1, the second field of list batches"
    else:
        rows = [{"input": x[i], "target": mask[i], "y": y[i]} for i in range(len(y))]
        keys = ("input", "target")
        refused = "target_key defaults to 'target' of dict batches"
    loader = SelectiveLoader(
        DataLoader(rows, batch_size=16),
        Masked(),
        policy=SelectiveBackprop(0.5),
        input_key=keys,
        loss_fn=lambda out, target: (out.sum(1, keepdim=True) - target).pow(2).mean(1),
    )
    for _ in range(2):
        with pytest.raises(ValueError, match=refused):
            next(iter(loader))
    explicit = SelectiveLoader(
        DataLoader(rows, batch_size=16),
        Masked(),
        policy=SelectiveBackprop(0.5),
        input_key=keys,
        target_key=keys[1],
        loss_fn=lambda out, target: (out.sum(1, keepdim=True) - target).pow(2).mean(1),
    )
    assert list(explicit)


class Lengths(torch.utils.data.Dataset):
    """``(tokens, lengths, labels)`` of 100 classes (every length is a valid class too); with
    ``ids``, ``(x, y, i)`` rows whose third field is the dataset index (plus ``offset``)."""

    def __init__(self, ids: bool = False, offset: int = 0) -> None:
        g = torch.Generator().manual_seed(2)
        self.tokens = torch.randint(0, V, (96, L), generator=g)
        self.lengths = torch.randint(2, L + 1, (96,), generator=g)
        self.labels = torch.randint(0, 100, (96,), generator=g)
        self.ids, self.offset = ids, offset

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> Any:
        if self.ids:
            return self.tokens[i].float(), self.labels[i], i + self.offset
        return self.tokens[i], self.lengths[i], self.labels[i]


class Pooled(nn.Module):
    """Token embeddings averaged over the first ``lengths`` positions, 100 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, 100)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        keep = torch.arange(L)[None, :] < lengths[:, None]
        return (self.embed(tokens) * keep[..., None]).sum(1) / lengths[:, None]


def _target_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "leave target_key at its default" in str(w.message)]


@pytest.mark.parametrize("policy", ["sb", "default"])
def test_a_default_target_beside_other_tensor_fields_of_tuple_batches_is_warned_of(policy):
    """(tokens, lengths, labels) with forward= calling model(tokens, lengths): target_key's
    default is the lengths, which cross-entropy over 100 classes takes silently. Warned of on
    the first source batch (a warm-up's too), naming target_key=2; target_key=2 scores the
    labels, unwarned, and target_key=1 confirms the default, unwarned."""

    def make(**kw: Any) -> SelectiveLoader:
        return SelectiveLoader(
            DataLoader(Lengths(), batch_size=16),
            Pooled(),
            policy=SelectiveBackprop(0.5) if policy == "sb" else None,
            forward=lambda model, batch: model(batch[0], batch[1]),
            autocast=None,
            **kw,
        )

    def warned(**kw: Any) -> tuple[list[str], list[Any]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(make(**kw))
        return _target_warnings(caught), batches

    (message,), _ = warned()
    assert "list batches of 3 fields" in message and "tensor fields [2]" in message
    assert "e.g. target_key=2" in message and "forward= calls the model" in message
    data, model = Lengths(), Pooled()
    for key, target in ((2, data.labels), (1, data.lengths)):
        messages, batches = warned(target_key=key)
        assert not messages and batches
        for b in batches if policy == "sb" else []:
            i = b.indices
            with torch.no_grad():
                logits = model(data.tokens[i], data.lengths[i])
            expected = F.cross_entropy(logits, target[i], reduction="none")
            torch.testing.assert_close(b.losses, expected)


def weighted() -> torch.utils.data.TensorDataset:
    """``(x, y, weight)`` rows: a per-example weight (float) after the target."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(96, L, generator=g), torch.randint(0, 100, (96,), generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.rand(96, generator=g))


class Bag(nn.Module):
    """Token embeddings averaged over every position (no lengths taken), 100 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.EmbeddingBag(V, 100)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


@pytest.mark.parametrize("forward", [False, True], ids=["model_alone", "forward"])
@pytest.mark.parametrize("rows", ["ids", "subset_ids", "weights", "lengths"])
def test_which_third_fields_beside_the_default_target_are_warned_of(rows, forward):
    """(x, y, i) rows whose i is the dataset index, the usual way to carry it: unwarned. With
    the model called on x alone, (x, y, weight) rows are not warned of either (found by
    review: they were), the weights no loss target in the labels' place; (tokens, lengths,
    labels) rows are (the model takes tokens alone, and the losses are taken against the
    lengths), and so are (x, y, id) rows of a Subset (ids of the dataset under it, not the
    loader's indices, and integers as the labels are: the check reads no values).
    forward= may pass any field to the model, so there every third field other than the
    loader's indices is warned of. Each is scored against field 1."""
    data: torch.utils.data.Dataset = {
        "ids": Lengths(ids=True),
        "subset_ids": torch.utils.data.Subset(Lengths(ids=True), range(10, 90)),
        "weights": weighted(),
        "lengths": Lengths(),
    }[rows]
    torch.manual_seed(0)
    model = Bag() if rows == "lengths" else nn.Linear(L, 100)
    loader = SelectiveLoader(
        DataLoader(data, batch_size=16, shuffle=True),
        model,
        policy=SelectiveBackprop(0.5),
        forward=(lambda model, batch: model(batch[0])) if forward else None,
        autocast=None,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = next(iter(loader))
    warns = {"ids": False, "subset_ids": True, "weights": forward, "lengths": True}[rows]
    assert bool(_target_warnings(caught)) == warns
    x, y = (torch.stack([data[int(i)][f] for i in first.indices]) for f in (0, 1))
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y, reduction="none")
    torch.testing.assert_close(first.losses, expected)


def test_an_optional_mask_left_out_of_a_models_call_is_warned_of():
    """model(x, mask=None) over (x, mask, y) is called with x alone, and the default target is
    the mask: warned of, naming the field the selection pass left out."""

    class Optional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return self.fc(x if mask is None else x * mask)

    loader = SelectiveLoader(
        DataLoader(masked_rows(), batch_size=16),
        Optional(),
        policy=SelectiveBackprop(0.5),
        loss_fn=lambda out, target: (out - target).pow(2).mean(1),  # takes the mask silently
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(loader))
    (message,) = _target_warnings(caught)
    assert "scores model(batch[0]) alone" in message and "tensor fields [2]" in message


def _to_double(value: Any) -> Any:
    return value.double() if torch.is_tensor(value) and value.is_floating_point() else value


def test_convert_inputs_scores_a_model_of_another_dtype_and_yields_the_source_batches():
    """A float64 model over a float32 source failed in the first selection pass (torch's
    "mat1 and mat2 must have the same dtype"); with ``convert_inputs`` the pass's losses are
    the model's own on the converted rows, and the batches yielded are as the source made
    them. Not with quantize_selection, and only a callable."""
    x = torch.randn(48, 5, generator=torch.Generator().manual_seed(0))
    y = torch.arange(48) % 3
    model = nn.Linear(5, 3).double()
    source = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    plain = SelectiveLoader(source, model, policy=SelectiveBackprop(0.5), batch_size=8)
    with pytest.raises(RuntimeError, match="dtype"):
        next(iter(plain))
    loader = SelectiveLoader(
        source, model, policy=SelectiveBackprop(0.5), batch_size=8, convert_inputs=_to_double
    )
    batches = list(loader)
    chosen = [i for b in batches for i in b.indices.tolist()]
    assert chosen and len(set(chosen)) == len(chosen)
    for b in batches:
        assert b[0].dtype == torch.float32 and torch.equal(b[0], x[b.indices])
        with torch.no_grad():
            own = F.cross_entropy(model(x[b.indices].double()), y[b.indices], reduction="none")
        torch.testing.assert_close(b.losses.double(), own, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="convert_inputs="):
        SelectiveLoader(source, model, convert_inputs=_to_double, quantize_selection=True)
    with pytest.raises(TypeError, match="convert_inputs should be a callable"):
        SelectiveLoader(source, model, convert_inputs=3)
