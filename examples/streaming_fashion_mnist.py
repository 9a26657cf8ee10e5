"""Stale-SB over streaming data: Fashion-MNIST as MDS shards, read by mosaicml-streaming.

Writes a Fashion-MNIST subset as MDS shards (``sbloader.streaming.write_mds``), reads it back
with a ``StreamingDataLoader`` whose samples carry their streaming sample id
(``sbloader.streaming.open_mds``), and trains the small CNN with Stale-SB (after one
Random-Backprop warm-up epoch), whose per-example store is keyed by those sample ids. Then it
shows the exact resume: a second run is stopped in the middle of an epoch, checkpointed (model,
optimizer and loader state) and continued by a fresh process state, and it trains on exactly the
examples the uninterrupted run did.

    python examples/streaming_fashion_mnist.py --examples 4096 --epochs 4

Data: Debian's dataset-fashion-mnist; the MDS shards go to ``--dir`` (default: a temporary
directory). Needs mosaicml-streaming (``scripts/setup.sh`` installs it); ``import streaming``
imports torchvision, which ``scripts/setup.sh`` does not install (no PyPI build matches its
CPU-only torch): there, run it with the repository's placeholder on the path,
``PYTHONPATH=tests/placeholders python3 examples/streaming_fashion_mnist.py ...``.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import sbloader
from sbloader.datasets import fashion_mnist_tensors
from sbloader.recipes import error_rate, small_cnn
from sbloader.streaming import open_mds, write_mds


def build(args: argparse.Namespace, local: Path):
    """A fresh model, optimizer and SelectiveLoader (what a restarted process builds)."""
    torch.manual_seed(args.seed)  # model initialisation only; the loader has its own generator
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    policy = sbloader.Phased(
        sbloader.SelectiveBackprop(1 / 3, staleness=2),
        warmup_epochs=1,
        warmup_policy=sbloader.RandomBackprop(1 / 3),
    )
    loader = sbloader.SelectiveLoader(
        open_mds(local, args.selection_batch_size, shuffle=True, seed=args.seed),
        model,
        input_key="image",
        target_key="label",
        policy=policy,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    return model, opt, loader


def train(model, opt, loader, epochs: int, stop_at: int | None = None) -> list[list[int]]:
    """Train until ``loader.epoch == epochs`` (or ``stop_at`` steps); each step's sample ids."""
    trained: list[list[int]] = []
    while loader.epoch < epochs:
        for batch in loader:
            loss = F.cross_entropy(model(batch["image"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            trained.append(batch.indices.tolist())
            if stop_at is not None and len(trained) == stop_at:
                return trained
    return trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=4096, help="training examples used")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--selection-batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the MDS shards go, in DIR/fashion-mnist (new or empty: write_mds does not "
        "overwrite), and the checkpoint",
    )
    args = parser.parse_args()

    x, y = fashion_mnist_tensors("train")
    x_test, y_test = fashion_mnist_tensors("test")
    work = Path(args.dir or tempfile.mkdtemp(prefix="sbloader-streaming-"))
    local = write_mds(work / "fashion-mnist", (x[: args.examples], y[: args.examples]))
    print(f"wrote {args.examples} examples as MDS shards to {local}")

    model, opt, loader = build(args, local)
    reference = train(model, opt, loader, args.epochs)
    reference_epochs = loader.stats.epochs
    for e in loader.stats.epochs:
        print(
            f"epoch {e.epoch}: {e.examples_yielded} of {e.examples_seen} examples trained, "
            f"{e.selection_forwards} selection forwards"
        )
    print(f"test error: {error_rate(model, x_test[:2000], y_test[:2000]):.4f}")
    stored = int((loader.policy.policy.store.seen > 0).sum())
    print(f"Stale-SB's store holds losses for {stored} of {args.examples} sample ids")
    # NOTE: streaming allows one live dataset per local directory: drop a run's before the next.
    del model, opt, loader
    gc.collect()

    # The same run, stopped in the middle of an epoch and checkpointed ...
    model, opt, loader = build(args, local)
    steps = [e.batches_yielded for e in reference_epochs]
    stop_at = sum(steps[:-1]) + steps[-1] // 2  # the middle of the last epoch
    before = train(model, opt, loader, args.epochs, stop_at=stop_at)
    checkpoint = work / "checkpoint.pt"
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict()},
        checkpoint,
    )
    print(f"stopped at loader epoch {loader.epoch}, after {len(before)} steps; saved {checkpoint}")
    del model, opt, loader
    gc.collect()

    # ... and continued from the checkpoint by freshly built objects.
    model, opt, loader = build(args, local)
    state = torch.load(checkpoint)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    loader.load_state_dict(state["loader"])
    after = train(model, opt, loader, args.epochs)
    print(f"resumed run matches the uninterrupted one: {before + after == reference}")


if __name__ == "__main__":
    main()
