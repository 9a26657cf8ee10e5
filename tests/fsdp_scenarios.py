"""What tests/test_fsdp.py runs under torch's FSDP on 2 CPU processes (gloo).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_scenarios.py OUT

Each rank trains a small FSDP-sharded model through a SelectiveLoader over a source of its own
length (rank 0 has more batches than rank 1), with selection chunks that differ per batch, a
warm-up epoch (the first batch's probe) and Stale-SB (stale epochs without selection forwards).
Each process writes its counts to ``OUT/<rank>.pkl``.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import end_process_group, leave
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

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


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {kind: run(kind, rank) for kind in ("FullyShardedDataParallel", "fully_shard")}
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
