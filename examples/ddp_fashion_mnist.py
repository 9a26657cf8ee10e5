"""Selective-Backprop under DistributedDataParallel on Fashion-MNIST, launched with torchrun.

The single-process recipe of ``examples/train_fashion_mnist.py`` (same CNN, SGD + Nesterov,
cosine learning rate by position in the data), with each rank reading its DistributedSampler
share. ``--batch-size`` and ``--selection-batch-size`` are *global*: each of N ranks takes 1/N
of them, so N processes train with the same global batch and learning rate as one.

    torchrun --nproc_per_node=2 examples/ddp_fashion_mnist.py               # SB, 2 processes
    torchrun --nproc_per_node=1 examples/ddp_fashion_mnist.py               # the 1-process run
    torchrun --nproc_per_node=2 examples/ddp_fashion_mnist.py --strategy traditional
    python examples/ddp_fashion_mnist.py --epochs 1                         # 1 process, no torchrun

gloo on CPUs; nccl with one GPU per process (``LOCAL_RANK``) when CUDA is available. Rank 0
prints, per epoch: the test error, the slowest rank's training wall-clock (evaluation
excluded), and each rank's selection counts. The training loop is the single-process one: every
rank yields the same number of batches (SelectiveLoader agrees on it), so DDP never hangs.

Data: Debian's dataset-fashion-mnist (``apt-get install dataset-fashion-mnist``); nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import sbloader
from sbloader.datasets import ArrayDataset, fashion_mnist_tensors
from sbloader.distributed import reduce_stats
from sbloader.precision import PRECISIONS
from sbloader.recipes import cosine_lr, error_rate, small_cnn


def setup() -> tuple[int, int, torch.device]:
    """Join the torchrun job (or make a 1-process group without torchrun); rank, size, device."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def per_rank(total: int, world: int, name: str) -> int:
    if total % world:
        raise SystemExit(f"--{name}={total} should be divisible by the {world} processes")
    return total // world


@torch.no_grad()
def test_error(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    """Each rank evaluates its slice of the test set with rank 0's BatchNorm statistics."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for b in model.buffers():  # NOTE: each rank's last forward updated its own running stats
        dist.broadcast(b, src=0)
    part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    err = error_rate(model, x[part].to(device), y[part].to(device))
    wrong = torch.tensor([err * (part.stop - part.start)], dtype=torch.float64, device=device)
    dist.all_reduce(wrong)
    return float(wrong) / len(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategy", default="sb", choices=["sb", "traditional"])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--selectivity", type=float, default=1 / 3)
    p.add_argument("--batch-size", type=int, default=128, help="global training batch")
    p.add_argument("--selection-batch-size", type=int, default=512, help="global source batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--cdf", default="local", choices=["local", "global"])
    p.add_argument(
        "--selection-precision",
        default="auto",
        choices=sorted(PRECISIONS),
        help="selection passes' precision: auto (the loader's default: bf16 where the CPU or "
        "GPU computes it natively, else float32), bf16 or fp32",
    )
    p.add_argument(
        "--warmup-epochs",
        type=int,
        default=1,
        help="SB: epochs of Random-Backprop first (default 1; 0: selection from the start)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="rank 0 also writes the per-epoch rows to this JSON file")
    p.add_argument(
        "--train-examples", type=int, help="train on the first N examples only (a quick try)"
    )
    args = p.parse_args()
    if args.epochs < 1:
        p.error(f"--epochs should be >= 1, but got {args.epochs}")
    if args.train_examples is not None and args.train_examples < 1:
        p.error(f"--train-examples should be >= 1, but got {args.train_examples}")

    rank, world, device = setup()
    bs = per_rank(args.batch_size, world, "batch-size")
    sel_bs = per_rank(args.selection_batch_size, world, "selection-batch-size")
    if rank == 0:
        print(
            f"# torch {torch.__version__}, sbloader {sbloader.__version__}, "
            f"{platform.processor() or platform.machine()}, {world} processes x "
            f"{torch.get_num_threads()} threads, {dist.get_backend()} on {device.type}; "
            f"{args.strategy}, per-rank batch {bs}, per-rank source batch "
            f"{sel_bs if args.strategy == 'sb' else bs}",
            flush=True,
        )
    x_train, y_train = fashion_mnist_tensors("train")
    if args.train_examples is not None:
        x_train, y_train = x_train[: args.train_examples], y_train[: args.train_examples]
    x_test, y_test = fashion_mnist_tensors("test")

    torch.manual_seed(args.seed)  # model initialisation only (DDP also broadcasts rank 0's)
    model = small_cnn().to(device, memory_format=torch.channels_last)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    opt = torch.optim.SGD(
        ddp.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    dataset = ArrayDataset(x_train, y_train)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    source = DataLoader(
        dataset,
        batch_size=bs if args.strategy == "traditional" else sel_bs,
        sampler=sampler,
        collate_fn=ArrayDataset.collate,
    )
    if args.strategy == "traditional":
        policy: sbloader.Policy = sbloader.Traditional()
    else:
        policy = sbloader.SelectiveBackprop(selectivity=args.selectivity, history=1024)
        if args.warmup_epochs:  # as in examples/train_fashion_mnist.py: see its docstring
            policy = sbloader.Phased(
                policy,
                warmup_epochs=args.warmup_epochs,
                warmup_policy=sbloader.RandomBackprop(args.selectivity),
            )
    loader = sbloader.SelectiveLoader(
        source,
        ddp,  # selection passes look through the DDP wrapper: no collective fires from them
        loss_fn=nn.CrossEntropyLoss(reduction="none"),
        policy=policy,
        batch_size=bs,
        memory_format=torch.channels_last,
        autocast=PRECISIONS[args.selection_precision],
        seed=args.seed,  # each rank's generator derives from (seed, rank)
        cdf=args.cdf,
    )

    rows, train_s = [], 0.0
    for epoch in range(args.epochs):
        dist.barrier()  # start the clock together
        t0 = time.perf_counter()
        for batch in loader:  # the same number of batches on every rank
            inputs, targets = batch
            for group in opt.param_groups:
                group["lr"] = cosine_lr(args.lr, loader.progress, args.epochs)
            loss = F.cross_entropy(ddp(inputs), targets, reduction="none")
            loss = (loss * batch.weights).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's wall-clock
        epoch_s = float(elapsed)
        train_s += epoch_s
        st = loader.stats.current
        counts = [st.examples_seen, st.examples_selected, st.examples_yielded, st.batches_yielded]
        per_rank_counts: list = [None] * world
        dist.all_gather_object(per_rank_counts, counts)
        total = reduce_stats(st)
        err = test_error(model, x_test, y_test, device)
        row = {
            "strategy": args.strategy,
            "processes": world,
            "epoch": epoch + 1,
            "test_error": err,
            "epoch_s": epoch_s,
            "train_s": train_s,
            "backprop": total.examples_yielded,
            "selection_forwards": total.selection_forwards,
            "selection_rate": total.selection_rate,
            "per_rank": [
                dict(zip(("seen", "selected", "yielded", "batches"), c)) for c in per_rank_counts
            ],
        }
        rows.append(row)
        if rank == 0:
            ranks = "  ".join(
                f"rank {r}: selected {c[1]}/{c[0]}, {c[3]} batches"
                for r, c in enumerate(per_rank_counts)
            )
            print(
                f"epoch {epoch + 1:2d}  test error {100 * err:5.2f}%  epoch {epoch_s:6.2f}s  "
                f"total {train_s:7.2f}s  backprop {total.examples_yielded:6d}  [{ranks}]",
                flush=True,
            )
    if rank == 0:
        mean = sum(r["epoch_s"] for r in rows) / len(rows)
        print(
            f"\n# summary: {args.strategy} on {world} processes: final test error "
            f"{100 * rows[-1]['test_error']:5.2f}%  mean epoch {mean:6.2f}s  total {train_s:7.2f}s"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
