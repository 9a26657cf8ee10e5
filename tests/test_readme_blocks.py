"""The README's Python code blocks run as written, and do what the README says they do.

Each ```python block of README.md is one case, found by a marker phrase that exactly one block
holds (so reordering the README skips nothing, and a new block without a case fails
:func:`test_every_python_block_is_exactly_one_case`). A block is executed from the README's own
text, in a fresh namespace holding the names it assumes (``model``, ``train_loader``,
``dataset``, the modules an earlier block imported, ...): tiny synthetic data, 1x28x28 images of
10 classes. The block's text is never edited, except by the substitutions a case names, each of
which must match the README exactly once. A traceback shows the block's lines, naming the README
line the block starts at.

The DDP block runs on two spawned gloo ranks; the others in this process (FFCV, streaming,
Accelerate and Lightning skipped where those are not installed).
"""

from __future__ import annotations

import datetime
import gc
import linecache
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import import_streaming, torch_threads
from launch import end_process_group, free_port, leave, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import sbloader

README = Path(__file__).resolve().parents[1] / "README.md"

#: Each case's marker: a phrase exactly one of the README's python blocks holds.
CASES = {
    "drop_in": "loader.feedback(batch.indices, losses)  # ...but this line",
    "plain_sb": "# plain SB, every epoch",
    "forward": "keep_logits=True,",
    "pad_values": "pad_values={",
    "ffcv": "sbffcv.write_beton(",
    "streaming": "sbstream.write_mds(",
    "ddp": "DistributedDataParallel(",
    "accelerate": "AcceleratedLoader(sbloader.SelectiveLoader(",
    "lightning": "SelectiveLoaderCallback(",
}

N = 512  #: examples in the synthetic data sets
DDP_DEADLINE_S = 240

pytestmark = pytest.mark.timeout(DDP_DEADLINE_S + 60)


def python_blocks() -> list[tuple[str, int]]:
    """Every ```python block of the README: its text and the README line before its first."""
    text = README.read_text()
    found = [
        (m.group(1), text.count("\n", 0, m.start(1)))
        for m in re.finditer(r"^```python\n(.*?)\n```$", text, re.S | re.M)
    ]
    assert len(found) == text.count("```python"), "a python block the pattern does not match"
    return found


def block(case: str) -> tuple[str, int]:
    """The one python block holding ``CASES[case]``."""
    found = [b for b in python_blocks() if CASES[case] in b[0]]
    assert len(found) == 1, f"{len(found)} README python blocks hold {CASES[case]!r}"
    return found[0]


def block_source(case: str, *substitutions: tuple[str, str]) -> tuple[str, str]:
    """The block's text after each ``(old, new)`` substitution (``old`` must occur exactly
    once: a README change fails here), and the name tracebacks give it."""
    code, line = block(case)
    for old, new in substitutions:
        assert code.count(old) == 1, f"the README's {case} block no longer holds {old!r}"
        code = code.replace(old, new)
    return code, f"README.md, the python block from line {line + 1}"


def execute(source: tuple[str, str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute a block (from :func:`block_source`) in ``namespace``, which holds the names it
    assumes; the namespace after. A traceback shows the block's own lines."""
    code, name = source
    linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
    exec(compile(code, name, "exec"), namespace)
    return namespace


def run_block(case: str, namespace: dict[str, Any], *substitutions: tuple[str, str]) -> dict:
    """Execute the block in ``namespace``; the namespace after."""
    return execute(block_source(case, *substitutions), namespace)


def test_every_python_block_is_exactly_one_case():
    blocks = python_blocks()
    assert len(blocks) == len(CASES) == 9
    for code, line in blocks:
        cases = [case for case, marker in CASES.items() if marker in code]
        assert len(cases) == 1, f"README line {line + 1}: cases {cases} (add one for a new block)"
    for case in CASES:
        block(case)  # (each case's marker is in exactly one block)


# ------------------------------------------------------------------ the names blocks assume
def images_and_labels(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def image_set() -> TensorDataset:
    return TensorDataset(*images_and_labels())


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def modules() -> dict[str, Any]:
    """What the README's first block imports, which later blocks use."""
    return {"nn": nn, "F": F, "sbloader": sbloader}


# ------------------------------------------------------------------ the cases
def test_drop_in(one_torch_thread):
    """Every batch trains (gradients) and is reported; the default recipe's batches have the
    source's batch size."""
    model = classifier()
    train_loader = DataLoader(image_set(), batch_size=64, shuffle=True)
    ns = run_block("drop_in", {"train_loader": train_loader, "model": model})
    total = ns["loader"].stats.total
    assert total.examples_seen == N and total.batches_yielded >= 2
    assert total.examples_yielded == 64 * total.batches_yielded == total.feedback
    assert ns["inputs"].shape == (64, 1, 28, 28)
    assert model[1].weight.grad is not None
    assert repr(ns["loader"].policy) == repr(sbloader.default_policy())


def test_plain_selective_backprop(one_torch_thread):
    """Plain SB scores every candidate in every epoch and yields training batches of 128."""
    train_loader = DataLoader(image_set(), batch_size=64, shuffle=True)
    ns = run_block("plain_sb", {"train_loader": train_loader, "model": classifier(), **modules()})
    loader = ns["loader"]
    assert isinstance(loader.policy, sbloader.SelectiveBackprop)
    for epoch in range(2):
        sizes = [len(inputs) for inputs, _ in loader]
        assert sizes and set(sizes) == {128}
        assert loader.stats.total.selection_forwards == N * (epoch + 1)


class Tagger(nn.Module):
    """Token ids and an attention mask in, ``{"logits": ...}`` out: 3 classes per token, or
    (``pooled``) per sequence, averaged over its unmasked tokens."""

    def __init__(self, pooled: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)
        self.pooled = pooled

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        mask = attention_mask[..., None].float()
        logits = self.head(self.embed(input_ids)) * mask
        return {"logits": logits.sum(1) / mask.sum(1) if self.pooled else logits}


def test_a_forward_hook_for_dict_batches(one_torch_thread):
    """The selection passes call the model through ``forward=`` (it needs the attention mask)
    and keep its logits: a batch's ``logits`` are the model's for its examples."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 20, (N, 6), generator=g)
    mask = (torch.arange(6) < torch.randint(1, 7, (N, 1), generator=g)).long()
    rows = [{"input_ids": i, "attention_mask": m, "labels": i[0] % 3} for i, m in zip(ids, mask)]
    model = Tagger(pooled=True)
    names = {"source": DataLoader(rows, batch_size=64), "model": model, **modules()}
    ns = run_block("forward", names)
    loader, kept = ns["loader"], 0
    for _ in range(2):  # the warm-up epoch (no selection pass), then a selective one
        for batch in loader:
            assert set(batch) == {"input_ids", "attention_mask", "labels"}
            if batch.logits is not None and not batch.logits.isnan().any():
                with torch.no_grad():
                    out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
                torch.testing.assert_close(batch.logits, out["logits"])
                assert torch.equal(batch["input_ids"], ids[batch.indices])
                kept += len(batch.indices)
    assert kept > 0 and loader.stats.total.selection_forwards > 0


def word_tokenizer() -> Any:
    """A Hugging Face tokenizer built offline: a word-level vocabulary, ``[PAD]`` = 1."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(18)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model), pad_token="[PAD]", unk_token="[UNK]"
    )


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    tokens = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return tokens.sum(1) / (labels != -100).sum(1).clamp(min=1)


def test_padded_token_batches(one_torch_thread):
    """Source batches padded each to its own longest sequence join into training batches of 32
    padded to their widest part: past each row's own tokens, the pad id, mask 0 and label -100."""
    tokenizer = word_tokenizer()
    from transformers import DataCollatorForTokenClassification

    g = torch.Generator().manual_seed(0)
    lengths = [2 + i // 64 for i in range(N)]  # each source batch has its own width
    dataset = [
        {"input_ids": torch.randint(2, 20, (n,), generator=g).tolist(), "labels": [i % 3] * n}
        for i, n in enumerate(lengths)
    ]
    names = {"dataset": dataset, "tokenizer": tokenizer, "model": Tagger()}
    names |= {"per_example_loss": per_example_loss, "DataLoader": DataLoader}
    names["DataCollatorForTokenClassification"] = DataCollatorForTokenClassification
    loader = run_block("pad_values", {**names, **modules()})["loader"]
    widths = set()
    for _ in range(2):
        for batch in loader:
            assert len(batch["input_ids"]) == 32
            own = torch.tensor([lengths[i] for i in batch.indices.tolist()])
            assert batch["input_ids"].shape[1] >= own.max()
            past = torch.arange(batch["input_ids"].shape[1]) >= own[:, None]
            assert torch.equal(batch["attention_mask"], (~past).long())
            assert (batch["input_ids"][past] == tokenizer.pad_token_id).all()
            labels = (batch.indices % 3)[:, None].expand_as(past).masked_fill(past, -100)
            assert torch.equal(batch["labels"], labels)
            widths.add(batch["input_ids"].shape[1])
    assert len(widths) > 1 and loader.stats.total.selection_forwards > 0


def test_an_ffcv_source(tmp_path, monkeypatch):
    """The block writes train.beton (in a temporary working directory) and trains on it: each
    batch's images, labels and indices belong together; torch's thread count is unchanged."""
    sbffcv = pytest.importorskip("sbloader.ffcv")
    with sbffcv.preserved_threads():  # NOTE: a bare `import ffcv` would set torch's threads to 1
        pytest.importorskip("ffcv")
    monkeypatch.chdir(tmp_path)
    images, labels = (t.numpy() for t in images_and_labels())
    names = {"images": images, "labels": labels, "model": classifier(), **modules()}
    with torch_threads(2):  # (ffcv would set 1, its num_workers)
        ns = run_block("ffcv", names)
        assert torch.get_num_threads() == 2
    assert (tmp_path / "train.beton").is_file()
    index = ns["index"]
    assert ns["images"].shape == (128, 1, 28, 28) and index.shape == ns["labels"].shape == (128,)
    assert torch.equal(ns["images"], torch.from_numpy(images[index.numpy()]))
    assert torch.equal(ns["labels"], torch.from_numpy(labels[index.numpy()]))
    assert ns["loader"].stats.total.examples_seen == N


def test_a_streaming_source(tmp_path, monkeypatch):
    """The block writes MDS shards (under a temporary working directory) and trains on them:
    dict batches whose ``sample_id`` is ``batch.indices``, each image and label its sample's."""
    import_streaming()
    monkeypatch.chdir(tmp_path)
    n = 4 * N  # SB keeps a third: enough for a batch of 256 (the source's) in the first epoch
    images, labels = images_and_labels(n)
    names = {"images": images, "labels": labels, "model": classifier(), **modules()}
    ns = run_block("streaming", names)
    batch, loader = ns["batch"], ns["loader"]
    assert type(ns["source"]).__name__ == "StreamingDataLoader"
    assert set(batch) == {"image", "label", "sample_id"}
    assert torch.equal(batch["sample_id"], batch.indices)
    assert torch.equal(batch["image"], images[batch.indices])
    assert torch.equal(batch["label"], labels[batch.indices])
    assert ns["loss"].isfinite() and loader.stats.total.examples_seen == n
    assert loader.stats.total.examples_yielded == 256 * loader.stats.total.batches_yielded
    assert loader.policy.staleness == 2
    del ns, batch, loader
    gc.collect()  # (streaming frees a dataset's shared memory when it is collected)


def _ddp_rank(rank: int, world_size: int, port: int, source: tuple[str, str], out: str) -> None:
    """One rank of the DDP block: its batches, and what the block printed."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=DDP_DEADLINE_S),
    )
    printed: list[Any] = []
    names = {"dataset": image_set(), "model": classifier(), "local_rank": rank, **modules()}
    names |= {"DataLoader": DataLoader, "DistributedSampler": DistributedSampler}
    names["DistributedDataParallel"] = nn.parallel.DistributedDataParallel
    try:
        ns = execute(source, {**names, "print": printed.append})
        result = {"printed": printed, "total": ns["loader"].stats.total, "last": ns["inputs"].shape}
    finally:
        threads = end_process_group()
    with open(Path(out) / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    leave(threads)


def test_ddp_on_two_ranks(tmp_path):
    """On two gloo ranks (CPUs: ``device_ids=None``, as the block's comment says), every rank
    yields the same number of full batches of 64, and the printed total sums both ranks."""
    source = block_source("ddp", ("device_ids=[local_rank]", "device_ids=None"))
    args = (2, free_port(), source, str(tmp_path))
    ranks = spawn_ranks(_ddp_rank, args, 2, tmp_path, DDP_DEADLINE_S, "the README's DDP block")
    batches = [r["total"].batches_yielded for r in ranks]
    assert batches[0] == batches[1] > 0
    for r in ranks:
        assert r["last"] == (64, 1, 28, 28)
        assert r["total"].examples_seen == N // 2
        assert r["total"].examples_yielded == 64 * batches[0]
    (printed,) = ranks[0]["printed"]
    assert printed.examples_seen == N and printed.batches_yielded == 2 * batches[0]


def test_accelerate_with_gradient_accumulation(tmp_path, one_torch_thread):
    """Batches of 64 from a prepared loader; accumulating over 4 of them, the optimizer steps at
    the epoch's end too (where fewer than 4 remain); every batch is reported; the registered
    loader is saved with ``save_state``."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    steps = []

    class SGD(torch.optim.SGD):
        def step(self, closure=None):  # (Accelerate calls it where the gradients synchronise)
            steps.append(len(steps))
            return super().step(closure)

    model = classifier()
    names = {"dataset": image_set(), "model": model, "opt": SGD(model.parameters(), lr=0.1)}
    names |= {"loss_fn": nn.CrossEntropyLoss(reduction="none"), "Accelerator": Accelerator}
    names |= {"torch": torch, "DataLoader": DataLoader, **modules()}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        ns = run_block("accelerate", names)
        total = ns["loader"].loader.stats.total
        assert ns["inputs"].shape == (64, 1, 28, 28)
        assert total.examples_yielded == 64 * total.batches_yielded == total.feedback
        assert len(steps) == -(-total.batches_yielded // 4) > 0
        ns["accelerator"].save_state(str(tmp_path / "state"))
        assert any((tmp_path / "state").glob("custom_checkpoint_0.pkl"))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_lightning(tmp_path, monkeypatch):
    """Trains 10 epochs of batches of 128 with the selection results in the batch, and the
    last checkpoint holds the loader's state."""
    L = pytest.importorskip("lightning")
    lightning_sb = pytest.importorskip("sbloader.integrations.lightning")
    monkeypatch.chdir(tmp_path)
    names = {"L": L, "train_set": image_set(), "torch": torch, "DataLoader": DataLoader}
    names |= {"DistributedSampler": DistributedSampler, **modules()}
    ns = run_block("lightning", names)
    trainer = ns["trainer"]
    assert trainer.current_epoch == 10
    loader = trainer.train_dataloader.loader
    assert isinstance(loader.policy, sbloader.SelectiveBackprop)
    assert trainer.global_step == loader.stats.total.batches_yielded > 0
    assert loader.stats.total.examples_yielded == 128 * trainer.global_step
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert any(lightning_sb.SelectiveLoaderCallback.__name__ in k for k in checkpoint["callbacks"])
    # "later, to resume": the block again, fitting from "last", resumes after its 10th epoch (and
    # so trains no more) instead of training anew
    resume = 'trainer.fit(Classifier(), ckpt_path="last")'
    assert block("lightning")[0].endswith(f"# later, to resume: {resume}")
    later = run_block("lightning", names, ("trainer.fit(Classifier())  #", f"{resume}  #"))
    resumed = later["trainer"]
    assert resumed is not trainer and resumed.global_step == trainer.global_step
    for name, weights in trainer.lightning_module.state_dict().items():
        assert torch.equal(resumed.lightning_module.state_dict()[name], weights)
