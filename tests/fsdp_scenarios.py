"""What tests/test_fsdp.py runs under torch's FSDP on 2 CPU processes (gloo).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_scenarios.py OUT
    (... tests/fsdp_scenarios.py OUT raised, or OUT layered)

Each rank trains a small FSDP-sharded model through a SelectiveLoader over a source of its own
length (rank 0 has more batches than rank 1), with selection chunks that differ per batch, a
warm-up epoch (the first batch's probe) and Stale-SB (stale epochs without selection forwards).
Each process writes its counts to ``OUT/<rank>.pkl``. With ``raised``, rank 1 meets an
exception outside its selection forwards instead (see :func:`raised`), and each process writes
what it raised; with ``layered``, per-layer sharded models meet the cases of :func:`layered`.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import NegativeLoss, end_process_group, leave
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    SubsetRandomSampler,
    TensorDataset,
)

import sbloader

EPOCHS = 4


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    if kind == "FullyShardedDataParallel":
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    fully_shard(model)
    return model


def run(kind: str, rank: int) -> dict[str, Any]:
    model = make_model(kind)
    calls = {"selection": 0, "training": 0}

    def count(module: nn.Module, args: Any) -> None:
        calls["training" if module.training else "selection"] += 1

    model.register_forward_pre_hook(count)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(161, 6, generator=g), torch.randint(0, 3, (161,), generator=g))
    # Uneven shares: rank 0 has more source batches than rank 1, and a different last batch.
    share = range(100) if rank == 0 else range(100, 161)
    sampler = SubsetRandomSampler(share, generator=torch.Generator().manual_seed(rank))
    source = DataLoader(data, batch_size=16, sampler=sampler)
    policy = sbloader.Phased(
        sbloader.SelectiveBackprop(selectivity=0.5, staleness=2),
        warmup_epochs=1,
        warmup_policy=sbloader.RandomBackprop(0.5),
    )
    loader = sbloader.SelectiveLoader(
        source, model, policy=policy, batch_size=4, selection_batch_size=5, seed=1
    )
    steps = []
    for _ in range(EPOCHS):
        k = 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            k += 1
        steps.append(k)
    refused = ""
    try:
        sbloader.SelectiveLoader(source, model, distributed=False)
    except ValueError as e:
        refused = str(e)
    return {
        "calls": calls,
        "steps": steps,
        "selection_calls": [e.selection_calls for e in loader.stats.epochs],
        "refused": refused,
        "params_finite": all(bool(p.isfinite().all()) for p in model.parameters()),
    }


def resumes(kind: str) -> list[bool]:
    """Stale-SB over a DistributedSampler, saved (loader and full model state) after each batch
    of the first two epochs and resumed in a fresh model and loader: whether each resumed run
    yields the uninterrupted run's batches (their indices and kept logits) to the end of epoch
    2. A stale epoch's sources are filtered, so one rank's may end a round before the other's,
    while a fresh loader probes the model (see EpochIterator._selection_round)."""
    full = StateDictOptions(full_state_dict=True)

    def build() -> tuple[nn.Module, sbloader.SelectiveLoader]:
        model = make_model(kind)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
        )
        source = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0))
        policy = sbloader.SelectiveBackprop(1 / 3, staleness=2)
        loader = sbloader.SelectiveLoader(
            source, model, policy=policy, batch_size=4, keep_logits=True
        )
        return model, loader

    def train(model: nn.Module, loader: sbloader.SelectiveLoader, saves: list | None) -> list:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        while loader.epoch < 3:
            for batch in loader:
                out.append((batch.indices.tolist(), batch.logits))
                losses = F.cross_entropy(model(batch[0]), batch[1], reduction="none")
                opt.zero_grad()
                losses.mean().backward()
                opt.step()
                loader.feedback(batch.indices, losses)
                if saves is not None and loader.epoch < 2:
                    state = get_model_state_dict(model, options=full)
                    model_state = {k: v.clone() for k, v in state.items()}
                    saves.append((len(out), loader.state_dict(), model_state))
        return out

    saves: list = []
    model, loader = build()
    whole = train(model, loader, saves)
    same = []
    for done, state, model_state in saves:
        model, loader = build()
        set_model_state_dict(model, model_state, options=full)
        loader.load_state_dict(state)
        rest = train(model, loader, None)
        same.append(
            [i for i, _ in rest] == [i for i, _ in whole[done:]]
            and all(
                torch.allclose(a, b, atol=1e-5, equal_nan=True)
                for (_, a), (_, b) in zip(rest, whole[done:])
            )
        )
    return same


class Corrupt(Dataset):
    """96 examples; on rank 1 only, example ``bad`` cannot be read (a corrupt file), and once
    ``armed``, none of its examples can."""

    def __init__(self, rank: int, bad: int = -1) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
        self.rank, self.bad, self.armed = rank, bad, False

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rank == 1 and (i == self.bad or self.armed):
            raise OSError(f"cannot read example {i}: the file is corrupt")
        return self.x[i], self.y[i]


def raised(kind: str, rank: int) -> dict[str, dict[str, Any]]:
    """Rank 1 raises outside its selection forwards, under FSDP: its source as its first or
    second source batch of a fresh epoch is loaded (before the round's forwards), or as a stale
    epoch's first one is (a round without forwards), or the policy's decision on its losses
    (after them). What each case raised (``"Type: message"``) and the seconds it took."""
    out: dict[str, dict[str, Any]] = {}

    def attempt(name: str, data: Corrupt, policy: sbloader.Policy, **kw: Any) -> None:
        model = make_model(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        source = DataLoader(data, batch_size=16, sampler=range(48 * rank, 48 * rank + 48))
        loader = sbloader.SelectiveLoader(source, model, policy=policy, batch_size=4, **kw)
        t0, got = time.perf_counter(), ""
        try:
            for epoch in range(2):
                data.armed = epoch == 1 and name == "stale"
                for x, y in loader:
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
        except Exception as e:
            got = f"{type(e).__name__}: {e}"
        out[name] = {"raised": got, "seconds": time.perf_counter() - t0}

    sb = sbloader.SelectiveBackprop
    attempt("first", Corrupt(rank, bad=48), sb(0.5))
    attempt("second", Corrupt(rank, bad=64), sb(0.5, staleness=2))
    attempt("stale", Corrupt(rank), sb(0.5, staleness=2))
    attempt("decision", Corrupt(rank), sbloader.Kath18(0.5), loss_fn=NegativeLoss(rank))
    return out


def layered_model(kind: str, norm: bool = False) -> nn.Module:
    """The scenarios' model sharded as FSDP is usually applied, per layer and at the root (the
    root's parameters stay gathered between forwards, so a root-only model hid a rank running
    fewer forwards than another), with a BatchNorm1d where ``norm``."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(6, 16), *([nn.BatchNorm1d(16)] if norm else []), nn.ReLU(), nn.Linear(16, 3)
    )
    if kind == "FullyShardedDataParallel":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({nn.Linear})
        return FullyShardedDataParallel(net, device_id=torch.device("cpu"), auto_wrap_policy=policy)
    for m in net:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(net)
    return net


def _train(loader: sbloader.SelectiveLoader, model: nn.Module, epochs: int) -> list[int]:
    """Train ``epochs`` epochs (SGD); the batches of each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for _ in range(epochs):
        k = 0
        for batch in loader:
            F.cross_entropy(model(batch[0]), batch[1]).backward()
            opt.step()
            opt.zero_grad()
            k += 1
        steps.append(k)
    return steps


def layered(kind: str, rank: int) -> dict[str, Any]:
    """Per-layer sharded models (:func:`layered_model`) where the ranks' forwards came apart:
    the first round's probe of a warm-up over a first batch of two rows on rank 0 (one probe
    forward, against two on rank 1) or with a sharded selector whose largest label is past the
    probe's rows on rank 1 only; padding forwards in train mode (``eval_selection=False``)
    over a BatchNorm1d; a run resumed after any batch where the ranks' shares differ (a fresh
    process has no padding candidate); and what is refused up front."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    data = TensorDataset(x, y)
    share = list(range(48 * rank, 48 * rank + 48))
    warm = sbloader.Phased(
        sbloader.SelectiveBackprop(0.5), warmup_epochs=1, warmup_policy=sbloader.RandomBackprop(0.5)
    )
    out: dict[str, Any] = {}

    model = layered_model(kind)
    source = DataLoader(data, batch_size=2 if rank == 0 else 8, sampler=share)
    loader = sbloader.SelectiveLoader(source, model, policy=warm, batch_size=4, seed=1)
    out["small_first_batch"] = _train(loader, model, 2)

    labels = torch.zeros(96, dtype=torch.long)
    labels[0:3] = 2
    labels[48 + 5] = 2  # rank 1's largest label in row 5 of its first batch, rank 0's in row 0
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    source = DataLoader(TensorDataset(x, labels), batch_size=8, sampler=share)
    loader = sbloader.SelectiveLoader(
        source, plain, selector=layered_model(kind), policy=warm, batch_size=4, seed=1
    )
    out["selector_label_row"] = _train(loader, plain, 2)

    # Uneven shares (48 and 16): rank 1 pads; no chunk of one anywhere in the data.
    model = layered_model(kind, norm=True)
    uneven = list(range(48)) if rank == 0 else list(range(48, 64))
    source = DataLoader(data, batch_size=8, sampler=uneven)
    loader = sbloader.SelectiveLoader(
        source,
        model,
        policy=sbloader.SelectiveBackprop(0.5),
        batch_size=4,
        selection_batch_size=4,
        eval_selection=False,
        seed=1,
    )
    norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
    try:
        steps = _train(loader, model, 1)
        out["train_mode_pads"] = {
            "steps": steps,
            "selection_calls": loader.stats.epochs[-1].selection_calls,
            "tracked": int(norm.num_batches_tracked),
        }
    except Exception as e:  # (before: rank 1's padding forward refused, rank 0 left hanging)
        out["train_mode_pads"] = f"{type(e).__name__}: {e}"

    out["resumes"] = layered_resumes(kind, rank, data)

    refused = {}
    torch.manual_seed(0)
    synced = nn.Sequential(nn.Linear(6, 16), nn.SyncBatchNorm(16), nn.Linear(16, 3))
    synced = FullyShardedDataParallel(synced, device_id=torch.device("cpu"))
    try:
        sbloader.SelectiveLoader(source, synced, eval_selection=False)
    except ValueError as e:
        refused["sync_bn"] = str(e)
    out["refused"] = refused
    return out


def layered_resumes(kind: str, rank: int, data: Dataset) -> list[bool]:
    """SB over shares of 56 and 40 examples (7 and 5 source batches of 8), saved after each
    batch of two epochs and resumed in a fresh process's model and loader: whether each yields
    the uninterrupted run's batches to the end."""
    full = StateDictOptions(full_state_dict=True)
    share = list(range(56)) if rank == 0 else list(range(56, 96))

    def build() -> tuple[nn.Module, sbloader.SelectiveLoader]:
        model = layered_model(kind)
        source = DataLoader(data, batch_size=8, sampler=share)
        policy = sbloader.SelectiveBackprop(0.5)
        return model, sbloader.SelectiveLoader(source, model, policy=policy, batch_size=4, seed=1)

    def train(model: nn.Module, loader: sbloader.SelectiveLoader, saves: list | None) -> list:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        while loader.epoch < 2:
            for batch in loader:
                out.append(batch.indices.tolist())
                F.cross_entropy(model(batch[0]), batch[1]).backward()
                opt.step()
                opt.zero_grad()
                if saves is not None:
                    state = get_model_state_dict(model, options=full)
                    model_state = {k: v.clone() for k, v in state.items()}
                    saves.append((len(out), loader.state_dict(), model_state))
        return out

    saves: list = []
    whole = train(*build(), saves)
    same = []
    for done, state, model_state in saves:
        model, loader = build()
        set_model_state_dict(model, model_state, options=full)
        loader.load_state_dict(state)
        try:
            same.append(train(model, loader, None) == whole[done:])
        except RuntimeError:  # (before: "a rank had no candidate yet", on every rank)
            same.append(False)
    return same


def compiled_inside(rank: int) -> dict[str, Any]:
    """FSDP1 wrapping a ``torch.compile``d module: the selection passes go through FSDP (they
    called the raw module, its parameters freed shards: "setStorage ... out of bounds")."""
    from sbloader.selection import unwrap

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    model = FullyShardedDataParallel(
        torch.compile(net, backend="eager"), device_id=torch.device("cpu")
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
    source = DataLoader(data, batch_size=8, sampler=range(48 * rank, 48 * rank + 48))
    loader = sbloader.SelectiveLoader(
        source, model, policy=sbloader.SelectiveBackprop(0.5), batch_size=4, seed=1
    )
    return {"unwrapped": type(unwrap(model)).__name__, "steps": _train(loader, model, 2)}


def main() -> None:
    kinds = ("FullyShardedDataParallel", "fully_shard")
    if sys.argv[2:] == ["layered"]:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        rank = dist.get_rank()
        result: dict[str, Any] = {kind: layered(kind, rank) for kind in kinds}
        result["compiled_inside"] = compiled_inside(rank)
    elif sys.argv[2:] == ["raised"]:
        # (a hang fails fast: the test's deadline is longer)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        rank = dist.get_rank()
        result = {kind: raised(kind, rank) for kind in kinds}
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        result = {kind: run(kind, rank) for kind in kinds}
        for kind in kinds:
            result[kind]["resumes"] = resumes(kind)
    dist.barrier()
    # NOTE: fully_shard's DTensor caches keep the group alive past destroy_process_group, so
    # gloo's workers are still running here and this rank leaves without finalizing (see
    # tests/launch.py end_process_group).
    threads = end_process_group()
    with open(Path(sys.argv[1]) / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    leave(threads)


if __name__ == "__main__":
    main()
