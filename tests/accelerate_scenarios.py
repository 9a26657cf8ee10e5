"""What tests/test_accelerate.py runs under Accelerate on 2 CPU processes (or on one).

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/accelerate_scenarios.py OUT_DIR

Each process writes its results to ``OUT_DIR/<rank>.pkl``; the test compares the ranks. The
data is tiny and synthetic; every collective runs on gloo.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from launch import end_process_group, leave
from torch import nn
from torch.utils.data import DataLoader, Dataset

import sbloader
from sbloader.integrations.accelerate import AcceleratedLoader

N = 192  # 2 processes x 6 batches x 16: no padding, so the shards must not overlap at all
SOURCE_BATCH, TRAIN_BATCH, ACCUMULATE, EPOCHS = 16, 4, 3, 3
SAVE_EPOCH = 1  # a mid-epoch checkpoint: at this epoch's first optimizer step after its first


class Points(Dataset):
    """Fixed random points with labels from a fixed linear map (the same on every rank)."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x @ torch.randn(6, 3, generator=g)).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Index(Dataset):
    """Example i is (i, i)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, i


def shuffled(dataset: Dataset, rank: int) -> DataLoader:
    # NOTE: a different generator seed on each rank: only Accelerate's synchronisation (rank 0's
    # state broadcast each epoch) makes the ranks shuffle alike.
    g = torch.Generator().manual_seed(100 + rank)
    return DataLoader(dataset, batch_size=SOURCE_BATCH, shuffle=True, generator=g)


def native_and_selective(accelerator: Accelerator) -> dict[str, Any]:
    """The shard's own batches against a Traditional SelectiveLoader's over an identical shard."""
    rank = accelerator.process_index
    native = accelerator.prepare(shuffled(Index(), rank))
    other = accelerator.prepare(shuffled(Index(), rank))
    loader = sbloader.SelectiveLoader(other, nn.Linear(1, 1), policy=sbloader.Traditional())
    out: dict[str, Any] = {"native": [], "selective": []}
    for _ in range(2):
        out["native"].append([b[0].tolist() for b in native])
        out["selective"].append([b.indices.tolist() for b in loader])
    out["epoch_size"] = loader.source.epoch_size
    out["len"] = len(loader)
    return out


def build(accelerator: Accelerator) -> tuple[nn.Module, Any, AcceleratedLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    source = shuffled(Points(), accelerator.process_index)
    model, opt, source = accelerator.prepare(model, opt, source)
    sb = sbloader.SelectiveLoader(
        source,
        model,
        policy=sbloader.SelectiveBackprop(selectivity=0.5, history=64),
        batch_size=TRAIN_BATCH,
        remainder="drop",
        seed=3,
    )
    loader = AcceleratedLoader(sb)
    accelerator.register_for_checkpointing(loader)
    return model, opt, loader


def train(
    accelerator: Accelerator,
    model: nn.Module,
    opt: Any,
    loader: AcceleratedLoader,
    checkpoint: Path | None = None,
) -> list[list[dict[str, Any]]]:
    """Train to EPOCHS; per epoch, per step: indices, sync_gradients, grads at the step's start."""
    epochs: list[list[dict[str, Any]]] = []
    for epoch in range(loader.loader.epoch, EPOCHS):
        steps: list[dict[str, Any]] = []
        for batch in loader:
            x, y = batch
            clean = all(p.grad is None or not p.grad.any() for p in model.parameters())
            with accelerator.accumulate(model):
                loss = (F.cross_entropy(model(x), y, reduction="none") * batch.weights).mean()
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
                sync = accelerator.sync_gradients
            steps.append({"indices": batch.indices.tolist(), "sync": sync, "clean": clean})
            if checkpoint is not None and epoch == SAVE_EPOCH and sync and len(steps) > 1:
                accelerator.save_state(str(checkpoint))  # (after an optimizer step)
                steps[-1]["saved"] = True
                checkpoint = None
        epochs.append(steps)
    return epochs


def bare_loader_registered(path: Path) -> str:
    """The SelectiveLoader itself registered for checkpointing: Accelerate saves rank 0's state
    only; loading it on rank 1 must be refused, naming AcceleratedLoader (returns the error)."""
    accelerator = Accelerator(cpu=True)
    source = accelerator.prepare(shuffled(Points(), accelerator.process_index))
    bare = sbloader.SelectiveLoader(source, nn.Linear(6, 3), batch_size=TRAIN_BATCH)
    accelerator.register_for_checkpointing(bare)
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()  # (the main process writes the files)
    try:
        accelerator.load_state(str(path))
    except ValueError as e:
        return str(e)
    return ""


def prepared_selective_loader(accelerator: Accelerator) -> dict[str, Any]:
    """The misuse: ``accelerator.prepare(SelectiveLoader(raw_dataloader, ...))``. Accelerate
    returns an object it does not know unchanged, so every rank reads every example; the
    loader reports it on every rank at its first round (the messages of what it warned)."""
    import warnings

    g = torch.Generator().manual_seed(7)  # the same order on every rank, as a user's seed
    loader = sbloader.SelectiveLoader(
        DataLoader(Points(), batch_size=SOURCE_BATCH, shuffle=True, generator=g),
        nn.Linear(6, 3),
        batch_size=TRAIN_BATCH,
    )
    same = accelerator.prepare(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = sum(1 for _ in same)
    return {
        "unchanged": same is loader,
        "batches": batches,
        "warned": [str(w.message) for w in caught if "first source batch" in str(w.message)],
    }


def run(out: Path) -> dict[str, Any]:
    """Everything above on this rank; ends with Accelerate's own teardown (``end_training``)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    result = native_and_selective(accelerator)
    model, opt, loader = build(accelerator)
    result["epoch_size_sb"] = loader.loader.source.epoch_size
    result["reference"] = train(accelerator, model, opt, loader, checkpoint=out / "ckpt")
    accelerator.wait_for_everyone()
    # The resumed run: fresh objects under a fresh Accelerator, restored from the checkpoint.
    resumed = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, opt, loader = build(resumed)
    resumed.load_state(str(out / "ckpt"))
    result["resumed_at"] = (loader.loader.epoch, loader.loader.state_dict()["position"])
    saved = loader.state_dict()  # (a collective: every rank's state)
    result["saved_processes"] = (saved["world_size"], len(saved["ranks"]))
    result["resumed"] = train(resumed, model, opt, loader)
    accelerator.wait_for_everyone()
    result["bare"] = bare_loader_registered(out / "bare")
    accelerator.wait_for_everyone()
    result["prepared_selective"] = prepared_selective_loader(accelerator)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group, as Accelerate asks scripts to
    return result


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    result = run(out)
    # NOTE: torch keeps the group of a model once wrapped in DDP (Accelerate's prepare) alive
    # past destroy_process_group, so gloo's workers are still running here and this rank leaves
    # without finalizing (see tests/launch.py end_process_group).
    threads = end_process_group()
    with open(out / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    leave(threads)


if __name__ == "__main__":
    main()
