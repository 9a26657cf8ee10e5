"""Selective-Backprop in a Lightning module on Fashion-MNIST.

The module builds its training loader with ``sbloader.integrations.lightning.selective_loader``
and reads each batch's selection results (here its weights) in ``training_step``; the Trainer
has a ``SelectiveLoaderCallback``, which saves the loader with every checkpoint and restores it
on ``fit(ckpt_path=...)``. SB starts after one Random-Backprop warm-up epoch.

    python examples/lightning_fashion_mnist.py --epochs 3
    python examples/lightning_fashion_mnist.py --epochs 2 --examples 4096 --devices 2   # DDP
    python examples/lightning_fashion_mnist.py --epochs 3 --ckpt-dir ckpts              # save
    python examples/lightning_fashion_mnist.py --epochs 3 --resume ckpts/last.ckpt      # resume

``--devices 2`` runs Lightning's DDP on the CPU (gloo): Lightning starts the second process
itself. ``--batch-size`` and ``--selection-batch-size`` are global, split between the processes.
Rank 0 prints the test error and each epoch's selection counts.

Data: Debian's dataset-fashion-mnist (``apt-get install dataset-fashion-mnist``); nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import sbloader
from sbloader.datasets import ArrayDataset, fashion_mnist_tensors
from sbloader.integrations.lightning import SelectiveLoaderCallback, selective_loader
from sbloader.recipes import error_rate, small_cnn


class FashionClassifier(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        torch.manual_seed(args.seed)
        self.net = small_cnn()
        self.trained: list[dict[str, object]] = []  # what each step trained on (--record)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def train_dataloader(self) -> object:
        a, world = self.args, self.trainer.world_size
        x, y = fashion_mnist_tensors("train")
        data = ArrayDataset(x[: a.examples], y[: a.examples])
        # Each process reads its share; the same line serves one process (num_replicas=1).
        sampler = DistributedSampler(data, num_replicas=world, rank=self.global_rank, seed=a.seed)
        source = DataLoader(data, batch_size=a.selection_batch_size // world, sampler=sampler)
        policy = sbloader.Phased(
            sbloader.SelectiveBackprop(a.selectivity),
            warmup_epochs=1,
            warmup_policy=sbloader.RandomBackprop(a.selectivity),
        )
        return selective_loader(
            self,
            source,
            policy=policy,
            batch_size=a.batch_size // world,
            seed=a.seed,
            remainder=a.remainder,
        )

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, sb = batch  # sb: the selection results, {"indices", "losses", "weights", ...}
        if self.args.record:
            self.trained.append({"epoch": self.current_epoch, "indices": sb["indices"].tolist()})
        loss = F.cross_entropy(self(x), y, reduction="none")
        return (loss * sb["weights"]).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.args.lr, momentum=0.9, nesterov=True)

    def on_train_end(self) -> None:
        loader = self.trainer.train_dataloader.loader
        if self.args.record:
            sampler = loader.sampler
            shards = []
            for epoch in range(self.args.epochs):
                sampler.set_epoch(epoch)
                shards.append(list(sampler))
            record = {
                "steps": self.trained,
                "shards": shards,
                "world_size": self.trainer.world_size,
            }
            path = Path(self.args.record) / f"rank{self.global_rank}.json"
            path.write_text(json.dumps(record))
        if self.global_rank == 0:
            for e in loader.stats.epochs:
                print(
                    f"epoch {e.epoch}: seen {e.examples_seen}, selection forwards "
                    f"{e.selection_forwards}, backpropagated {e.examples_yielded} in "
                    f"{e.batches_yielded} batches"
                )
            xt, yt = fashion_mnist_tensors("test")
            err = error_rate(self.net, xt[: self.args.test_examples], yt[: self.args.test_examples])
            print(f"test error {err:.2%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--examples", type=int, default=60000, help="training examples used")
    p.add_argument("--test-examples", type=int, default=10000)
    p.add_argument("--batch-size", type=int, default=128, help="global training batch")
    p.add_argument("--selection-batch-size", type=int, default=512, help="global source batch")
    p.add_argument("--selectivity", type=float, default=1 / 3)
    p.add_argument("--remainder", default="carry", choices=["carry", "short", "drop"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=1, help="processes (DDP on the CPU when > 1)")
    p.add_argument("--ckpt-dir", help="save a checkpoint at each epoch end (and last.ckpt)")
    p.add_argument("--resume", help="a checkpoint to resume from")
    p.add_argument("--record", help="write each rank's trained indices to DIR/rank<r>.json")
    args = p.parse_args()
    for name in ("batch_size", "selection_batch_size"):
        if getattr(args, name) % args.devices:
            p.error(f"--{name.replace('_', '-')} should be divisible by --devices={args.devices}")
    callbacks: list[pl.Callback] = [SelectiveLoaderCallback()]
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(args.ckpt_dir, save_top_k=-1, save_last=True))
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(FashionClassifier(args), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
