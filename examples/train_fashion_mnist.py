"""Train a small CNN on Fashion-MNIST with Traditional training and with sbloader.

The training loop changes in two lines: the DataLoader is wrapped in ``sbloader.SelectiveLoader``
and the step reports its per-example losses (``loader.feedback``, which keeps Stale-SB's stored
losses fresh; other policies ignore it). Prints test error, training wall-clock (evaluation
excluded) and backprop counts per epoch, then a summary.

    python examples/train_fashion_mnist.py                       # traditional and recipe, 10 epochs
    python examples/train_fashion_mnist.py --strategies sb --epochs 3 --selectivity 0.25
    python examples/train_fashion_mnist.py --strategies sb --warmup-epochs 0  # SB from step one

``recipe`` is sbloader's default policy (``SelectiveLoader(source, model)`` with no ``policy=``):
one Random-Backprop epoch, then Stale-SB at 1/3, and all the data in the last eighth of
``--epochs`` (``planned_epochs``). ``sb`` is the paper's plain SB at
``--selectivity``, after ``--warmup-epochs`` of Random-Backprop at the same selectivity (as cheap
as the SB epochs that follow): from a random initialisation, loss-based selection can collapse at
this learning rate (the model predicts one class, the selection keeps only the others).

Data: Debian's dataset-fashion-mnist (``apt-get install dataset-fashion-mnist``); nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import sbloader
from sbloader.datasets import ArrayDataset, fashion_mnist_tensors
from sbloader.precision import PRECISIONS
from sbloader.recipes import cosine_lr, error_rate, small_cnn


def make_model() -> nn.Module:
    """The reference CNN: conv32-BN-pool, conv64-BN-pool, fc128, fc10."""
    return small_cnn()


def test_error(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return error_rate(model, x, y)


def train(strategy: str, args: argparse.Namespace, data) -> list[dict]:
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(args.seed)  # model initialisation only; the loader has its own generator
    model = make_model().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    dataset = ArrayDataset(x_train, y_train)
    gen = torch.Generator().manual_seed(args.seed)
    # ArrayDataset.collate: the gathered tensors are the batch (not split into rows and stacked
    # again by the default collate function: 4x faster here, the same batches).
    # Selective strategies get candidates in source batches of selection_batch_size: one
    # selection forward each.
    source = DataLoader(
        dataset,
        batch_size=args.batch_size if strategy == "traditional" else args.selection_batch_size,
        shuffle=True,
        generator=gen,
        collate_fn=ArrayDataset.collate,
    )
    if strategy == "traditional":
        policy: sbloader.Policy | None = sbloader.Traditional()
    elif strategy == "recipe":
        policy = None  # sbloader's default
    else:
        policy = sbloader.SelectiveBackprop(selectivity=args.selectivity, history=1024)
        if args.warmup_epochs:
            policy = sbloader.Phased(
                policy,
                warmup_epochs=args.warmup_epochs,
                warmup_policy=sbloader.RandomBackprop(args.selectivity),
            )
    loader = sbloader.SelectiveLoader(
        source,
        model,
        loss_fn=nn.CrossEntropyLoss(reduction="none"),
        policy=policy,
        batch_size=args.batch_size,
        memory_format=torch.channels_last,
        # Selection passes only rank losses: bf16 ranks as float32 does and is cheaper where the
        # hardware computes it natively; "auto" picks it there and float32 elsewhere
        # (loader.selection_precision says which). An int8 copy of the model is opt-in
        # (quantize_selection="auto" or True). Training stays float32.
        autocast=PRECISIONS[args.selection_precision],
        seed=args.seed,
        # The default recipe trains on all the data in the last eighth of a known run length.
        planned_epochs=args.epochs if policy is None and args.epochs >= 2 else None,
    )
    if strategy != "traditional":
        print(f"# {strategy}: selection precision {loader.selection_precision}", flush=True)
    total_positions = args.epochs  # the schedule is keyed on position in the data (epochs)
    rows, train_time = [], 0.0
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        for batch in loader:
            inputs, targets = batch
            for group in opt.param_groups:  # cosine schedule by position in the data
                group["lr"] = cosine_lr(args.lr, loader.progress, total_positions)
            losses = F.cross_entropy(model(inputs), targets, reduction="none")
            loss = (losses * batch.weights).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loader.feedback(batch.indices, losses)  # free: the step computed them anyway
        epoch_time = time.perf_counter() - t0
        train_time += epoch_time
        st = loader.stats.current
        row = {
            "strategy": strategy,
            "epoch": epoch + 1,
            "test_error": test_error(model, x_test, y_test),
            "epoch_s": epoch_time,
            "train_s": train_time,
            "backprop": st.examples_yielded,
            "selection_forwards": st.selection_forwards,
            "selection_rate": st.selection_rate,
            "selection_s": st.selection_s,
            "source_s": st.source_s,
            "caller_s": st.consumer_s,
            "overhead_s": st.overhead_s,
        }
        rows.append(row)
        print(
            f"{strategy:12s} epoch {epoch + 1:2d}  test error {100 * row['test_error']:5.2f}%  "
            f"epoch {epoch_time:6.2f}s  total {train_time:7.2f}s  "
            f"backprop {st.examples_yielded:6d}  "
            f"selection forwards {st.selection_forwards:6d}  rate {st.selection_rate:.3f}  "
            f"[selection {st.selection_s:5.2f}s source {st.source_s:5.2f}s "
            f"train {st.consumer_s:5.2f}s loader {st.overhead_s:4.2f}s]",
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--strategies",
        nargs="+",
        default=["traditional", "recipe"],
        choices=["traditional", "recipe", "sb"],
    )
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument(
        "--selectivity",
        type=float,
        default=1 / 3,
        help="sb's selectivity (and its warm-up's); the recipe keeps its own 1/3",
    )
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--selection-batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
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
    p.add_argument("--json", help="also write the per-epoch rows to this JSON file")
    p.add_argument(
        "--train-examples", type=int, help="train on the first N examples only (a quick try)"
    )
    args = p.parse_args()
    if args.epochs < 1:
        p.error(f"--epochs should be >= 1, but got {args.epochs}")
    if args.train_examples is not None and args.train_examples < 1:
        p.error(f"--train-examples should be >= 1, but got {args.train_examples}")

    print(
        f"# torch {torch.__version__}, sbloader {sbloader.__version__}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    x, y = fashion_mnist_tensors("train")
    if args.train_examples is not None:
        x, y = x[: args.train_examples], y[: args.train_examples]
    data = (x, y, *fashion_mnist_tensors("test"))
    results = {s: train(s, args, data) for s in args.strategies}

    print("\n# summary")
    for s, rows in results.items():
        mean_epoch = sum(r["epoch_s"] for r in rows) / len(rows)
        print(
            f"{s:12s} final test error {100 * rows[-1]['test_error']:5.2f}%  "
            f"mean epoch {mean_epoch:6.2f}s  backprop/epoch "
            f"{sum(r['backprop'] for r in rows) / len(rows):8.0f}"
        )
    for name in ("recipe", "sb"):
        if "traditional" not in results or name not in results:
            continue
        trad = [r["epoch_s"] for r in results["traditional"]]
        sel = [r["epoch_s"] for r in results[name] if r["selection_forwards"]]  # not warm-up
        if sel:
            ratio = (sum(sel) / len(sel)) / (sum(trad) / len(trad))
            print(f"{name} epoch with a selection pass / Traditional epoch wall-clock: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
