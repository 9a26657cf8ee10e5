"""Selective-Backprop in a Hugging Face Accelerate loop on Fashion-MNIST, with gradient
accumulation and a checkpoint that resumes exactly.

The Accelerate loop is unchanged but for the loader: the prepared DataLoader is wrapped in a
``SelectiveLoader`` and then in ``AcceleratedLoader``, which tells Accelerate where each epoch
ends (so ``accelerator.accumulate`` steps on the last batch) and saves every process's loader
state with ``accelerator.save_state``.

    python examples/accelerate_fashion_mnist.py --epochs 2 --examples 4096      # one process
    torchrun --nproc_per_node=2 examples/accelerate_fashion_mnist.py --epochs 2 --examples 4096
    python examples/accelerate_fashion_mnist.py --resume ckpt                   # continue a run

Prints, on the main process, per epoch: the test error, the number of training steps and
optimizer steps, the examples each process backpropagated, and whether the epoch's last batch
synchronised the gradients. ``--checkpoint DIR`` saves the state at every epoch's end.

Data: Debian's dataset-fashion-mnist (``apt-get install dataset-fashion-mnist``); nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

import sbloader
from sbloader.datasets import ArrayDataset, fashion_mnist_tensors
from sbloader.integrations.accelerate import AcceleratedLoader
from sbloader.recipes import error_rate, small_cnn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--examples", type=int, help="train on the first N examples only")
    p.add_argument("--batch-size", type=int, default=64, help="per process, per step")
    p.add_argument("--selection-batch-size", type=int, default=256, help="per process")
    p.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--selectivity", type=float, default=1 / 3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", help="save the state here at the end of every epoch")
    p.add_argument("--resume", help="load the state saved here before training")
    p.add_argument("--json", help="the main process writes the per-epoch rows to this file")
    args = p.parse_args()

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.accumulate
    )
    x, y = fashion_mnist_tensors("train")
    if args.examples:
        x, y = x[: args.examples], y[: args.examples]
    x_test, y_test = fashion_mnist_tensors("test")

    torch.manual_seed(args.seed)  # model initialisation only; the loader has its own generator
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    source = DataLoader(ArrayDataset(x, y), batch_size=args.selection_batch_size, shuffle=True)
    model, opt, source = accelerator.prepare(model, opt, source)
    policy = sbloader.Phased(  # a Random-Backprop warm-up epoch, then Selective-Backprop
        sbloader.SelectiveBackprop(selectivity=args.selectivity),
        warmup_epochs=1,
        warmup_policy=sbloader.RandomBackprop(args.selectivity),
    )
    loader = AcceleratedLoader(
        sbloader.SelectiveLoader(
            source, model, policy=policy, batch_size=args.batch_size, seed=args.seed
        )
    )
    accelerator.register_for_checkpointing(loader)
    if args.resume:
        accelerator.load_state(args.resume)

    rows = []
    for epoch in range(loader.loader.epoch, args.epochs):
        model.train()
        steps = updates = 0
        last_sync = False
        for batch in loader:
            inputs, targets = batch
            with accelerator.accumulate(model):
                losses = F.cross_entropy(model(inputs), targets, reduction="none")
                accelerator.backward((losses * batch.weights).mean())
                opt.step()
                opt.zero_grad()
                last_sync = accelerator.sync_gradients
            steps += 1
            updates += int(last_sync)
        stats = loader.loader.stats.epochs[-1]
        backprop = accelerator.gather(
            torch.tensor([stats.examples_yielded], device=accelerator.device)
        ).tolist()
        row = {
            "epoch": epoch,
            "test_error": round(error_rate(accelerator.unwrap_model(model), x_test, y_test), 4),
            "steps": steps,
            "optimizer_steps": updates,
            "backprop_per_process": backprop,
            "last_batch_synced": last_sync,
        }
        rows.append(row)
        accelerator.print(json.dumps(row))
        if args.checkpoint:
            accelerator.save_state(args.checkpoint)
    if args.json and accelerator.is_main_process:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
