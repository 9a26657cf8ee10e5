"""SelectiveLoader under torch.distributed: gloo on the CPU, each rank a spawned process.

Every spawned group runs under a deadline (and a process-group timeout), so a hang fails the test
instead of blocking the suite. A worker returns a picklable result; the assertions that compare
ranks run in the parent.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import os
import pickle
import shutil
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import (
    ENCODED_KEYS,
    N_CLASSES,
    EncodedDataset,
    IndexLoss,
    ListedBatches,
    bn_model,
    encoded_batches,
    expected_losses,
)
from launch import NegativeLoss, end_process_group, free_port, gloo_threads, leave, spawn_ranks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

import sbloader
from sbloader import (
    LoaderStats,
    Phased,
    Policy,
    RandomBackprop,
    SelectiveBackprop,
    SelectiveLoader,
)
from sbloader.distributed import TEXT_LIMIT, RankSync, reduce_stats

#: Seconds a spawned group may run before the test fails as a hang. NOTE: a group takes about
#: 10 s alone and up to about 60 s on a loaded 2-core machine (each rank imports torch, DDP
#: and numba's kernels); a hang never ends, so a wide margin costs nothing but the wait.
DEADLINE_S = 240
#: The process groups' own timeout: a collective that waits longer raises in the worker (the
#: rendezvous included, where one rank may still be importing while another waits).
PG_TIMEOUT_S = 120

#: A test may set up two spawned groups (module-scoped fixtures) before its own body runs.
pytestmark = pytest.mark.timeout(2 * DEADLINE_S + 120)


# ------------------------------------------------------------------ spawning ranks
def _worker(rank: int, world_size: int, port: int, scenario: str, out: str, kwargs: dict) -> None:
    # NOTE: this is a spawned child process of the test, so setting its thread count and debug
    # level here changes nothing in the test process. DETAIL makes gloo check every collective's
    # signature across ranks, so a mismatch raises instead of hanging.
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        result = SCENARIOS[scenario](rank, world_size, **kwargs)
        dist.barrier()
    finally:
        threads = end_process_group()
    with open(Path(out) / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    leave(threads)  # (a DDP scenario's group outlives it: see tests/launch.py)


def run_ranks(scenario: str, world_size: int, tmp_path: Path, **kwargs) -> list:
    """Run ``SCENARIOS[scenario]`` on ``world_size`` gloo ranks; their results, by rank."""
    return spawn_ranks(
        _worker,
        (world_size, free_port(), scenario, str(tmp_path), kwargs),
        world_size,
        tmp_path,
        DEADLINE_S,
        f"{scenario!r} on {world_size} ranks",
    )


# ------------------------------------------------------------------ data and policies
class FlippedLabels(Dataset):
    """Every label moved to the next class: makes one rank's losses much higher."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        x, y = self.ds[i]
        return x, (y + 1) % N_CLASSES


class Block(Sampler):
    """Rank ``rank`` of ``world_size`` gets the contiguous block of indices, shuffled.

    Its ``generator`` attribute lets the loader replay an epoch's order (mid-epoch resume).
    """

    def __init__(self, n: int, rank: int, world_size: int, seed: int = 0) -> None:
        per = n // world_size
        self.indices = list(range(rank * per, (rank + 1) * per))
        self.generator = torch.Generator().manual_seed(seed + rank)

    def __iter__(self):
        perm = torch.randperm(len(self.indices), generator=self.generator).tolist()
        return iter([self.indices[i] for i in perm])

    def __len__(self) -> int:
        return len(self.indices)


class RejectInEpoch(RandomBackprop):
    """RandomBackprop whose prefilter rejects every example in epoch ``epoch`` if ``reject``;
    it asks for every rank's losses under a global CDF (as a policy of the user's own does by
    default), so that its drain rounds make the loss exchange."""

    def ranks_shared_losses(self) -> bool:
        return True

    def __init__(self, selectivity: float, *, epoch: int, reject: bool) -> None:
        super().__init__(selectivity)
        self.reject_epoch, self.reject, self._epoch = epoch, reject, 0

    def begin_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def can_prefilter(self) -> bool:
        return True

    def prefilter(self, indices):
        return np.full(len(indices), not (self.reject and self._epoch == self.reject_epoch))


class Recording(SelectiveBackprop):
    """SelectiveBackprop that remembers what it was given to observe and to choose from."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.observed: list[list[int]] = []
        self.chosen_from: list[list[int]] = []

    def observe(self, losses, indices, *, cdf=True):
        self.observed.append(indices.tolist())
        super().observe(losses, indices, cdf=cdf)

    def choose(self, losses, indices, rng, n):
        self.chosen_from.append(indices.tolist())
        return super().choose(losses, indices, rng, n)


def sampler_indices(ds: Dataset, rank: int, world_size: int, epoch: int) -> list[int]:
    s = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    s.set_epoch(epoch)
    return list(s)


# ------------------------------------------------------------------ scenarios (run per rank)
def scenario_ddp(
    rank: int, world_size: int, policy: str, epochs: int = 2, decisions: str = "host"
) -> dict:
    """DDP training of a BatchNorm model from a DistributedSampler, with uneven selections:
    labels flipped on rank 1 only, different source batch sizes and selection chunking (so a
    different number of selection forwards) on every rank, and for RandomBackprop very different
    rates. A selection forward through the DDP wrapper would make a collective (DDP broadcasts
    BatchNorm buffers) on one rank but not another."""
    torch.manual_seed(0)
    model = bn_model()
    ddp = DistributedDataParallel(model)
    base = EncodedDataset(203)  # not divisible by 2 or 3: the sampler pads
    ds = FlippedLabels(base) if rank == 1 else base
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    if policy == "sb":
        chosen: Policy = SelectiveBackprop(1 / 3, history=64)
    else:
        chosen = RandomBackprop([0.9, 0.25, 0.5][rank])
    loader = SelectiveLoader(
        # Different source batch sizes: the ranks run out of source batches at different
        # rounds, so some rounds have a selection forward on one rank and none on another.
        DataLoader(ds, batch_size=[24, 10, 16][rank], sampler=sampler),
        ddp,
        policy=chosen,
        batch_size=8,
        selection_batch_size=[None, 5, 7][rank],
        seed=0,
        decisions=decisions,
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    yielded: list[list[int]] = []
    for _ in range(epochs):
        epoch: list[int] = []
        for batch in loader:
            x, y = batch
            loss = F.cross_entropy(ddp(x), y, reduction="none")
            opt.zero_grad()
            (loss * batch.weights).mean().backward()
            opt.step()
            epoch.extend(batch.indices.tolist())
        yielded.append(epoch)
    return {
        "batches": [e.batches_yielded for e in loader.stats.epochs],
        "selected": [e.examples_selected for e in loader.stats.epochs],
        "calls": loader.stats.total.selection_calls,
        "yielded": yielded,
        "sampler": [sampler_indices(ds, rank, world_size, e) for e in range(epochs)],
        "params": [p.detach().clone() for p in model.parameters()],
        "pending": loader.pending_examples,
        "total": loader.stats.total.as_dict(),
        "epochs": [e.as_dict() for e in loader.stats.epochs],
        "reduced": reduce_stats(loader.stats).total.as_dict(),
        "rank": loader.rank,
    }


def _iterable(rank: int, n_batches: int, bs: int = 10, offset: int = 0) -> list:
    """``n_batches`` batches of EncodedDataset rows with an index field (position 2)."""
    ds = EncodedDataset(400)
    out = []
    for b in range(n_batches):
        rows = range(b * bs, (b + 1) * bs)
        x = torch.stack([ds[i][0] for i in rows])
        y = torch.stack([ds[i][1] for i in rows])
        out.append((x, y, torch.tensor([offset + i for i in rows], dtype=torch.int64)))
    return out


def scenario_rounds(rank: int, world_size: int) -> dict:
    """Uneven source lengths, remainders, passthrough, global CDF, big indices, Stale-SB with
    nothing loaded on one rank, generators and reduced stats: several loaders in sequence."""
    res: dict = {"rank": rank}

    # Uneven source lengths (6, 3 and 2 batches) with very different selection rates.
    lengths = [6, 3, 2][rank]
    for remainder in ("carry", "short", "drop"):
        loader = SelectiveLoader(
            _iterable(rank, lengths),
            IndexLoss(),
            policy=RandomBackprop([1.0, 0.5, 0.25][rank]),
            batch_size=4,
            remainder=remainder,
            seed=1,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # (six epochs with "carry": rank 0's backlog passes the chance bound in the fourth)
            epochs = 6 if remainder == "carry" else 3
            res[remainder] = [[len(b[0]) for b in loader] for _ in range(epochs)]
        res[remainder + "_stats"] = [e.as_dict() for e in loader.stats.epochs]
        res[remainder + "_pending"] = loader.pending_examples
        res[remainder + "_backlog"] = [
            str(w.message) for w in caught if "selected examples into epoch" in str(w.message)
        ]

    # Passthrough (Traditional) with uneven source lengths: equal counts, extras dropped.
    loader = SelectiveLoader(
        _iterable(rank, lengths), IndexLoss(), policy=sbloader.Traditional(), batch_size=10
    )
    res["traditional"] = [len(b[0]) for b in loader]
    res["traditional_dropped"] = loader.stats.current.dropped

    # Global CDF with labels flipped on rank 1 only: identical windows, different rates.
    for cdf in ("global", "local"):
        base = EncodedDataset(300)
        ds = FlippedLabels(base) if rank == 1 else base
        sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, seed=0)
        loader = SelectiveLoader(
            DataLoader(ds, batch_size=20, sampler=sampler),
            IndexLoss(),
            policy=SelectiveBackprop(1 / 3, history=128),
            batch_size=5,
            cdf=cdf,
            seed=0,
        )
        list(loader)
        res[cdf + "_window"] = loader.policy.window.values()
        res[cdf + "_rate"] = loader.stats.current.selection_rate

    # Indices above 2**31 (and 2**53 + 1, which no float64 holds) survive the exchange exactly.
    big = [2**31 + 7, 2**53 + 1, 2**62 + 12345][rank]
    policy = Recording(0.5, history=64)
    loader = SelectiveLoader(
        _iterable(rank, 3, offset=big),
        IndexLoss(),
        policy=policy,
        batch_size=5,
        index_key=2,
        cdf="global",
        seed=0,
    )
    res["big_yielded"] = [i for b in loader for i in b.indices.tolist()]
    res["big_observed"] = policy.observed
    res["big_chosen_from"] = policy.chosen_from

    # Stale-SB over rank-blocked data (rank 0 holds the lowest losses): in the stale epoch
    # rank 0 loads nothing at all, the others load some; every store knows every example.
    for cdf in ("global", "local"):
        ds = EncodedDataset(120)
        loader = SelectiveLoader(
            DataLoader(ds, batch_size=10, sampler=Block(120, rank, world_size)),
            IndexLoss(),
            policy=SelectiveBackprop(beta=30.0, history=512, staleness=2),
            batch_size=4,
            cdf=cdf,
            seed=0,
        )
        counts = []
        for epoch in range(2):
            counts.append(sum(1 for _ in loader))
            if epoch == 0:
                res[cdf + "_stale_store"] = loader.policy.store.lookup(np.arange(120))
        res[cdf + "_stale_batches"] = counts
        res[cdf + "_stale_stats"] = [e.as_dict() for e in loader.stats.epochs]
        res[cdf + "_stale_window"] = loader.policy.window.values()

    # The same with each rank's store memory-mapped in a folder of its own: the same batches
    # and store; a state saved after the pass epoch and loaded after the stale epoch (crash
    # recovery) gives the stale epoch's batches again.
    def mapped(folder: str) -> SelectiveLoader:
        return SelectiveLoader(
            DataLoader(EncodedDataset(120), batch_size=10, sampler=Block(120, rank, world_size)),
            IndexLoss(),
            policy=SelectiveBackprop(beta=30.0, history=512, staleness=2, store_path=folder),
            batch_size=4,
            cdf="global",
            seed=0,
        )

    folder = tempfile.mkdtemp(prefix=f"sbloader-rank{rank}-")
    loader = mapped(folder)
    first = [b.indices.tolist() for b in loader]
    state = copy.deepcopy(loader.state_dict())
    stale = [b.indices.tolist() for b in loader]
    res["mapped_store"] = loader.policy.store.lookup(np.arange(120))
    del loader
    loader = mapped(folder)
    loader.load_state_dict(state)
    res["mapped_batches"] = [len(first), len(stale)]
    res["mapped_stale_again"] = [b.indices.tolist() for b in loader] == stale
    del loader
    shutil.rmtree(folder, ignore_errors=True)

    # Generators derive from (seed, rank): the same data on every rank, different choices;
    # the same seed again, the same choices. Then stats reduced over ranks.
    def choices() -> tuple[list[int], SelectiveLoader]:
        loader = SelectiveLoader(
            _iterable(rank, 4),
            IndexLoss(),
            policy=RandomBackprop(0.5),
            batch_size=4,
            index_key=2,
            seed=3,
        )
        return [i for b in loader for i in b.indices.tolist()], loader

    res["choices"], loader = choices()
    res["choices_again"], _ = choices()
    res["loader_rank"] = loader.rank
    res["local_stats"] = loader.stats.current.as_dict()
    res["reduced_stats"] = reduce_stats(loader.stats.current).as_dict()

    # Mid-epoch resume while rank 0 has loaded nothing in the epoch (its position is 0) and
    # yields only what it carried: the same batches as an uninterrupted run, and no hang.
    def uneven(policy) -> SelectiveLoader:
        sizes = [300, 120, 120]  # rank 0 carries a large surplus out of epoch 0
        ds = EncodedDataset(sum(sizes))
        sampler = Block(sum(sizes), 0, 1, seed=rank)
        sampler.indices = list(range(sum(sizes[:rank]), sum(sizes[: rank + 1])))
        return SelectiveLoader(
            DataLoader(ds, batch_size=10, sampler=sampler),
            IndexLoss(),
            policy=policy,
            batch_size=4,
            cdf="global",  # a drain round starts with an exchange: misaligned rounds hang
            seed=0,
        )

    def resumable() -> SelectiveLoader:
        return uneven(RejectInEpoch(1.0, epoch=1, reject=rank == 0))

    whole = resumable()
    res["resume_whole"] = [[b.indices.tolist() for b in whole] for _ in range(2)]
    loader = resumable()
    first = [b.indices.tolist() for b in loader]
    it = iter(loader)
    second = [next(it).indices.tolist() for _ in range(4)]  # mid-round: one batch owed
    state = copy.deepcopy(loader.state_dict())
    del it
    loader = resumable()
    loader.load_state_dict(state)
    second += [b.indices.tolist() for b in loader]
    res["resume_split"] = [first, second]
    res["resume_position"] = state["position"]

    # Crash recovery: the same state, kept while the run goes on to the end of the epoch and
    # through another (every rank alike), then resumed by a new loader on every rank.
    loader = resumable()
    list(loader)
    it = iter(loader)
    crashed = [next(it).indices.tolist() for _ in range(4)]
    state = copy.deepcopy(loader.state_dict())
    for _ in it:
        pass
    list(loader)
    del it
    loader = resumable()
    loader.load_state_dict(state)
    crashed += [b.indices.tolist() for b in loader]
    res["crash_split"] = crashed

    # A loop capping its steps per epoch (break after 3), ending each epoch with end_epoch()
    # and saving a state as it ends, over uneven sources and a global CDF: a run resumed from
    # the second epoch's state goes on with the uninterrupted run's third and fourth epochs.
    def capped() -> SelectiveLoader:
        return uneven(SelectiveBackprop(0.5, history=64))

    def capped_epochs(loader: SelectiveLoader, epochs: int) -> tuple[list, list]:
        yielded, states = [], []
        for _ in range(epochs):
            epoch = []
            for step, batch in enumerate(loader):
                epoch.append(batch.indices.tolist())
                if step == 2:
                    break
            loader.end_epoch()
            yielded.append(epoch)
            states.append(copy.deepcopy(loader.state_dict()))
        return yielded, states

    res["capped_whole"], states = capped_epochs(capped(), 4)
    loader = capped()
    loader.load_state_dict(states[1])
    res["capped_resumed"], _ = capped_epochs(loader, 2)
    return res


class NonFiniteFor(IndexLoss):
    """:class:`IndexLoss` with a NaN selection loss for the indices in ``NAN`` and an infinite
    one for those in ``INF`` (two of each on each of two rank-blocked halves of 120 examples)."""

    NAN, INF = (7, 77), (18, 95)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        idx = x[:, 0].long()
        logits = torch.where(torch.isin(idx, torch.tensor(self.NAN))[:, None], np.nan, logits)
        inf = torch.isin(idx, torch.tensor(self.INF))
        logits[inf, idx[inf] % N_CLASSES] = -np.inf  # the target's logit: an infinite loss
        return logits


class FiniteOnly(SelectiveBackprop):
    """SelectiveBackprop that records every loss it is given to observe or to choose from."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.given: list[np.ndarray] = []

    def observe(self, losses, indices, *, cdf=True):
        self.given.append(np.array(losses))
        super().observe(losses, indices, cdf=cdf)

    def choose(self, losses, indices, rng, n):
        self.given.append(np.array(losses))
        return super().choose(losses, indices, rng, n)


def scenario_nonfinite(rank: int, world_size: int) -> dict:
    """Non-finite selection losses on every rank, through the loss exchange (a global CDF, and
    Stale-SB's store, which shares losses even with a local one); then distributed=False."""
    res: dict = {}
    for cdf, mode in (("global", "skip"), ("local", "select")):
        policy = FiniteOnly(1.0, history=1024, staleness=2)  # keeps every finite example
        loader = SelectiveLoader(
            DataLoader(EncodedDataset(120), batch_size=15, sampler=Block(120, rank, world_size)),
            NonFiniteFor(),
            policy=policy,
            batch_size=10,
            cdf=cdf,
            nonfinite=mode,
            remainder="short",
            seed=0,
        )
        yielded = sorted(i for b in loader for i in b.indices.tolist())
        res[cdf] = {
            "yielded": yielded,
            "given": policy.given,
            "window": policy.window.values(),
            "store": policy.store.lookup(np.arange(120)),
            "nonfinite": loader.stats.current.nonfinite,
            "reduced": reduce_stats(loader.stats.current).nonfinite,
        }
    # Uneven sources (4 batches and 1): on their own, each rank yields its own batches.
    for name, distributed in (("alone", False), ("lockstep", None)):
        loader = SelectiveLoader(
            _iterable(rank, [4, 1][rank]),
            IndexLoss(),
            policy=RandomBackprop(1.0),
            batch_size=10,
            distributed=distributed,
        )
        res[name] = [len(b[0]) for b in loader]
    # A source with no examples on rank 1 only: every rank raises at the end of the pass (a rank
    # raising alone would leave the others waiting in the next pass's first collective).
    loader = SelectiveLoader(
        _iterable(rank, [3, 0][rank]),
        IndexLoss(),
        policy=RandomBackprop(0.5),
        batch_size=4,
        index_key=2,
    )
    try:
        res["empty_rank"] = f"yielded {len(list(loader))} batches"
    except ValueError as e:
        res["empty_rank"] = str(e)
    # A DataLoader whose sampler draws nothing on rank 1 only: refused as the loader is built
    # (it was refused at the end of the first pass, after rank 0's selection forwards over it).
    data, model = EncodedDataset(40), IndexLoss()
    sampler = torch.utils.data.SubsetRandomSampler([list(range(40)), []][rank])
    for name, policy in (("sb", SelectiveBackprop(0.5)), ("trad", sbloader.Traditional())):
        try:
            built = SelectiveLoader(
                DataLoader(data, batch_size=5, sampler=sampler), model, policy=policy, batch_size=4
            )
            res[f"empty_sampler_{name}"] = f"built: {len(list(built))} batches"
        except ValueError as e:
            res[f"empty_sampler_{name}"] = str(e)
    res["empty_sampler_calls"] = model.calls
    return res


class NonFiniteOnRank1(NonFiniteFor):
    """:class:`NonFiniteFor` with its non-finite losses in the second half of 120 examples only."""

    NAN, INF = (77,), (95,)


class NonFiniteFirst(NonFiniteFor):
    """:class:`NonFiniteFor` with non-finite losses in the first 15 examples of either half."""

    NAN, INF = (7, 67), (8, 68)


def raised(loader: SelectiveLoader) -> str:
    """What an epoch of ``loader`` raised, as ``"Type: message"`` ("" when it ended)."""
    try:
        for _ in loader:
            pass
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def ragged(rank: int, width: int) -> list:
    """Four batches of :func:`_iterable` with a fourth field two wide, ``width`` wide in rank 1's
    third batch."""
    return [
        (x, y, i, torch.zeros(len(x), width if (rank, b) == (1, 2) else 2))
        for b, (x, y, i) in enumerate(_iterable(rank, 4))
    ]


def scenario_failures(rank: int, world_size: int) -> dict:
    """Errors met on one rank (a non-finite selection loss under nonfinite="raise", a ragged
    field): every rank raises, in the same round; none waits in a collective."""
    res: dict = {}

    def nonfinite(model: torch.nn.Module, sampler=None, staleness: int = 1, **kw) -> str:
        return raised(
            SelectiveLoader(
                DataLoader(
                    EncodedDataset(120),
                    batch_size=15,
                    sampler=Block(120, rank, world_size) if sampler is None else sampler,
                ),
                model,
                policy=SelectiveBackprop(0.5, history=64, staleness=staleness),
                batch_size=10,
                nonfinite="raise",
                seed=0,
                **kw,
            )
        )

    # Rank 1 only: decided on the host with a local CDF (no exchange) or a global one (the
    # exchange comes first), with Stale-SB's store (its exchange), or on the device.
    res["local"] = nonfinite(NonFiniteOnRank1())
    res["global"] = nonfinite(NonFiniteOnRank1(), cdf="global")
    res["stale"] = nonfinite(NonFiniteOnRank1(), staleness=2)
    res["device"] = nonfinite(NonFiniteOnRank1(), decisions="device")
    # Rank 1 meets it in its second source batch, while rank 0 (one source batch) drains.
    res["draining"] = nonfinite(NonFiniteOnRank1(), sampler=[range(15), range(60, 120)][rank])
    # Both ranks in the same round: each raises its own error.
    res["both"] = nonfinite(NonFiniteFirst(), sampler=range(60 * rank, 60 * (rank + 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same first batch on both ranks; overlap's advice
        for name, kw in (("ragged", {}), ("ragged_ahead", {"overlap_selection": True})):
            res[name] = raised(
                SelectiveLoader(
                    ragged(rank, 3),
                    IndexLoss(),
                    policy=SelectiveBackprop(0.5),
                    batch_size=4,
                    index_key=2,
                    **kw,
                )
            )
    return res


class RaisingLoss:
    """Per-example cross-entropy that raises ``IndexError`` (a target out of range, say) in its
    ``at``-th call on rank 1 only."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at, self.calls = rank, at, 0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.rank == 1 and self.calls == self.at:
            raise IndexError(f"target 99 is out of bounds in call {self.calls}")
        return F.cross_entropy(outputs, targets, reduction="none")


class BadInput(ValueError):
    """An exception type of the user's own (derived from a built-in one)."""


class RaisingModel(IndexLoss):
    """:class:`IndexLoss` whose forward raises :class:`BadInput` on rank 1 only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:
            raise BadInput("the model cannot take this input")
        return super().forward(x)


def iterated(make) -> dict:
    """Iterate the loader ``make()`` returns to its end (building it inside the clock): what it
    raised (``"Type: message"``, "" where nothing) and its cause, and the seconds it took."""
    t0, got = time.perf_counter(), {"raised": "", "cause": ""}
    try:
        for _ in make():
            pass
    except Exception as e:
        got["raised"] = f"{type(e).__name__}: {e}"
        if e.__cause__ is not None:
            got["cause"] = f"{type(e.__cause__).__name__}: {e.__cause__}"
    got["seconds"] = time.perf_counter() - t0
    return got


def scenario_raised(rank: int, world_size: int) -> dict:
    """An exception raised by the user's code in rank 1's selection pass only: every rank raises
    in the same round (none waits in a collective), whatever the round's collectives are."""
    res: dict = {}

    def run(
        at: int = 1, sampler=None, model=None, staleness: int = 1, policy=None, loss_fn=None, **kw
    ) -> dict:
        policy = (
            SelectiveBackprop(0.5, history=64, staleness=staleness) if policy is None else policy
        )
        loader = SelectiveLoader(
            DataLoader(
                EncodedDataset(120),
                batch_size=15,
                sampler=Block(120, rank, world_size) if sampler is None else sampler,
            ),
            IndexLoss() if model is None else model,
            loss_fn=RaisingLoss(rank, at) if loss_fn is None else loss_fn,
            policy=policy,
            batch_size=10,
            seed=0,
            **kw,
        )
        return iterated(lambda: loader)

    res["first"] = run(at=1)  # (a) rank 1's first selection pass
    res["later"] = run(at=3)  # (b) its third
    res["global"] = run(at=2, cdf="global")  # (c) the losses exchanged first
    res["stale"] = run(at=2, staleness=2)  # Stale-SB's store: exchanged too
    res["device"] = run(at=2, decisions="device")
    # (d) rank 1's second source batch, while rank 0 (one source batch) drains.
    res["draining"] = run(at=2, sampler=[range(15), range(60, 120)][rank])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overlap's advice on the CPU
        res["ahead"] = run(at=2, overlap_selection=True)  # raised on the selection thread
    res["forward"] = run(model=RaisingModel(rank))
    # The policy refuses rank 1's losses in its decision: with a global CDF, Kath18 makes no
    # exchange (it ranks no other rank's losses); one that asks for them decides after it.
    res["policy"] = run(policy=sbloader.Kath18(0.5), loss_fn=NegativeLoss(rank))
    res["policy_global"] = run(
        policy=sbloader.Kath18(0.5), loss_fn=NegativeLoss(rank), cdf="global"
    )
    res["policy_shared"] = run(policy=SharedKath18(0.5), loss_fn=NegativeLoss(rank), cdf="global")
    # A warm-up epoch without selection passes: the first round's probe forward raises (a
    # passthrough round, and one of RandomBackprop's with the losses shared by the store).
    res["probe"] = run(policy=Phased(SelectiveBackprop(0.5, history=64), warmup_epochs=1))
    stale = SelectiveBackprop(0.5, history=64, staleness=2)
    res["probe_random"] = run(
        policy=Phased(stale, warmup_epochs=1, warmup_policy=RandomBackprop(0.5))
    )
    # A source batch without examples on rank 1 only (a list source's empty batch, or one that
    # subset= leaves empty): every rank goes on in step (rank 1 makes the round's collectives
    # with nothing of its own), under SB, Stale-SB's shared store and a global CDF, and
    # Traditional; rank 1 never yields an example outside its subset.
    sb = SelectiveBackprop(0.5, history=64)
    cases = {
        "empty": (sb, {}, [15, 0, 15, 15]),
        "empty_stale": (SelectiveBackprop(0.5, history=64, staleness=2), {}, [15, 0, 15, 15]),
        "empty_global": (sb, {"cdf": "global"}, [15, 0, 15, 15]),
        "empty_trad": (sbloader.Traditional(), {}, [15, 0, 15, 15]),
        # rank 1's second batch, dataset indices 75-89, is outside its subset
        "empty_subset": (sb, {"subset": np.r_[0:75, 90:120]}, [15, 15, 15]),
    }
    for name, (policy, kw, sizes) in cases.items():
        loader = SelectiveLoader(
            encoded_batches(sizes if rank == 1 else [15, 15, 15], start=60 * rank),
            IndexLoss(),
            policy=copy.deepcopy(policy),
            batch_size=5,
            seed=0,
            dataset_size=120,
            **ENCODED_KEYS,
            **kw,
        )
        got: dict = {"raised": "", "batches": [], "indices": []}
        try:
            for _ in range(2):
                batches = [b.indices.tolist() for b in loader]
                got["batches"].append(len(batches))
                got["indices"] += [i for b in batches for i in b]
        except Exception as e:
            got["raised"] = f"{type(e).__name__}: {e}"
        res[name] = got
    return res


class CorruptOnRank1(Dataset):
    """:class:`EncodedDataset` whose example 75 cannot be read (a corrupt file) on rank 1 only."""

    def __init__(self, rank: int) -> None:
        self.ds, self.rank = EncodedDataset(120), rank

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        if self.rank == 1 and i == 75:
            raise OSError(f"cannot read example {i}: the file is corrupt")
        return self.ds[i]


def scenario_round_raised(rank: int, world_size: int, folder: str) -> dict:
    """Exceptions raised on rank 1 only outside its selection pass: its source raising as it
    loads a batch (under the rounds' every kind of collectives), and its policy's store refusing
    a folder another process holds as the loader is built."""
    res: dict = {}

    def source(policy=None, sampler=None, **kw):
        # Rank 1 reads 60-119 in batches of 15: example 75 is in its second batch.
        sampler = Block(120, rank, world_size) if sampler is None else sampler
        return lambda: SelectiveLoader(
            DataLoader(CorruptOnRank1(rank), batch_size=15, sampler=sorted(sampler)),
            IndexLoss(),
            policy=SelectiveBackprop(0.5, history=64) if policy is None else policy,
            batch_size=10,
            seed=0,
            **kw,
        )

    res["local"] = iterated(source())
    res["global"] = iterated(source(cdf="global"))  # (the losses exchanged in every round)
    res["stale"] = iterated(source(SelectiveBackprop(0.5, history=64, staleness=2)))
    res["traditional"] = iterated(source(sbloader.Traditional()))
    # Rank 0 (one source batch) drains while rank 1 loads its second.
    res["draining"] = iterated(source(sampler=[range(15), range(60, 120)][rank]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overlap's advice on the CPU
        # Loaded ahead, in the round of rank 1's first batch (after its decision).
        res["ahead"] = iterated(source(overlap_selection=True))
    # Every rank gives its policy its own store folder, but another process holds rank 1's.
    held = None
    if rank == 0:
        held = sbloader.store.ExampleStore(120, os.path.join(folder, "rank1"))
    dist.barrier()
    stale = SelectiveBackprop(0.5, staleness=2, store_path=os.path.join(folder, f"rank{rank}"))
    res["store"] = iterated(
        lambda: SelectiveLoader(
            DataLoader(EncodedDataset(120), batch_size=15, sampler=Block(120, rank, world_size)),
            IndexLoss(),
            policy=stale,
            batch_size=10,
        )
    )
    del held
    return res


class SetEpochRaising(Block):
    """:class:`Block` whose ``set_epoch`` raises on rank 1 only (a sampler of the user's own)."""

    def __init__(self, n: int, rank: int, world_size: int) -> None:
        super().__init__(n, rank, world_size)
        self.rank = rank

    def set_epoch(self, epoch: int) -> None:
        if self.rank == 1:
            raise ValueError(f"cannot shuffle for epoch {epoch}")


class BeginRaising(SelectiveBackprop):
    """SelectiveBackprop whose ``begin_epoch`` raises on rank 1 only, in epoch 1."""

    def __init__(self, rank: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank

    def begin_epoch(self, epoch: int) -> None:
        super().begin_epoch(epoch)
        if self.rank == 1 and epoch == 1:
            raise ValueError(f"cannot begin epoch {epoch}")


def scenario_begin_raised(rank: int, world_size: int) -> dict:
    """Exceptions raised on rank 1 only as an epoch begins: its sampler's ``set_epoch`` in epoch
    0, its policy's ``begin_epoch`` in epoch 1 (two epochs iterated); with Stale-SB's store the
    ranks exchange the reports of ``loader.feedback`` there too."""
    res: dict = {}

    def run(policy, sampler) -> dict:
        loader = SelectiveLoader(
            DataLoader(EncodedDataset(120), batch_size=15, sampler=sampler),
            IndexLoss(),
            policy=policy,
            batch_size=10,
            seed=0,
        )
        return iterated(lambda: itertools.chain(loader, loader))

    block = Block(120, rank, world_size)
    raising = SetEpochRaising(120, rank, world_size)
    res["set_epoch"] = run(SelectiveBackprop(0.5, history=64), raising)
    res["set_epoch_stale"] = run(SelectiveBackprop(0.5, history=64, staleness=2), raising)
    res["begin_epoch"] = run(BeginRaising(rank, 0.5, history=64), block)
    res["begin_epoch_stale"] = run(BeginRaising(rank, 0.5, history=64, staleness=2), block)
    return res


def refused(**kwargs) -> str:
    """The error building a SelectiveLoader with ``kwargs`` raised ("" when it was built)."""
    try:
        SelectiveLoader(DataLoader(EncodedDataset(20), batch_size=5), IndexLoss(), **kwargs)
    except ValueError as e:
        return str(e)
    return ""


def scenario_lengths(rank: int, world_size: int) -> dict:
    """len() of Traditional over sources of different lengths on each rank (no
    DistributedSampler), and over equal shares; then two epochs of it."""
    res: dict = {}
    shares = [range(45), range(45, 70)][rank]  # 45 and 25 examples
    cases = {
        "sized": (DataLoader(EncodedDataset(70), batch_size=10, sampler=shares), 10),
        "rebatched": (DataLoader(EncodedDataset(70), batch_size=10, sampler=shares), 4),
        "even": (
            DataLoader(
                EncodedDataset(70),
                batch_size=10,
                sampler=DistributedSampler(EncodedDataset(70), world_size, rank, shuffle=False),
            ),
            10,
        ),
    }
    for name, (source, batch_size) in cases.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = SelectiveLoader(
                source, IndexLoss(), policy=sbloader.Traditional(), batch_size=batch_size
            )
        res[name] = {
            "len": len(loader),
            "yielded": [sum(1 for _ in loader) for _ in range(2)],
            "warnings": [str(w.message) for w in caught],
        }
    # A bucketing batch_sampler= (no sampler of its own, batches of 8 and of 1) on every rank,
    # len() never called: the ranks' agreement as the loader is built counted its batches as
    # full ones, and the yield of each epoch follows that count, so the first batch of another
    # size is warned of on every rank, as where the user called len().
    starts = enumerate(range(32 * rank, 32 * rank + 32, 8))  # each rank its own examples
    buckets = [list(range(s, s + 8)) if j % 2 == 0 else [s] for j, s in starts]
    source = DataLoader(EncodedDataset(64), batch_sampler=ListedBatches(buckets, 4, 8))
    loader = SelectiveLoader(source, IndexLoss(), policy=sbloader.Traditional(), batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in loader:
            pass
    res["bucketed"] = [str(w.message) for w in caught]
    # A rank whose pass length is unknown (batches of an iterable, of unknown sizes, re-batched):
    # len() is unknown on both.
    source = cases["sized"][0] if rank == 0 else _iterable(rank, 2)
    loader = SelectiveLoader(source, IndexLoss(), policy=sbloader.Traditional(), batch_size=4)
    try:
        res["unknown"] = f"len() was {len(loader)}"
    except TypeError as e:
        res["unknown"] = str(e)
    return res


def scenario_limits(rank: int, world_size: int) -> dict:
    return {
        **scenario_failures(rank, world_size),
        "lengths": scenario_lengths(rank, world_size),
        # Each rank on its own, with a CDF over every rank's losses: refused on every rank.
        "global_alone": refused(cdf="global", distributed=False),
        "local_alone": refused(cdf="local", distributed=False),
        "texts": scenario_texts(rank, world_size),
        "agreements": scenario_agreements(rank, world_size),
    }


def scenario_texts(rank: int, world_size: int) -> list[str]:
    """RankSync.broadcast_text: what every rank receives from rank 1 (each rank passes its own
    text, only the source's is read), an empty text, and one past the limit in multi-byte
    characters."""
    sync = RankSync()
    mine = f"from rank {rank}: héllo ✓"
    long_text = "é" * TEXT_LIMIT  # 2 bytes each: cut at TEXT_LIMIT bytes
    return [
        sync.broadcast_text(mine, 1),
        sync.broadcast_text(mine, 0),
        sync.broadcast_text("", 1),
        sync.broadcast_text(long_text if rank == 1 else "", 1),
    ]


def scenario_agreements(rank: int, world_size: int) -> dict:
    """RankSync's agreements and reduce_stats called directly on two ranks, with values that
    differ by rank: the errors reported by rank 0 (the lowest rank, named on every rank), a flag
    raised on rank 1 only, a text broadcast in a group other than the world, the overlap check
    over shares padded within its slack and past it, and the stats of two epochs (one whose
    classes rank 0 could not count)."""
    res: dict = {}
    sync = RankSync()
    # most(): rank 0 reports an error of kind 5 before the forwards; then rank 1 alone a flag.
    res["most_failed"] = (sync.most(3 - rank, False, failed=5 if rank == 0 else 0), sync.failed)
    res["most_flag"] = (sync.most(rank, rank == 1), sync.failed)
    # agree(): both ranks report an error, of kinds 7 and 8: the lowest rank's is named.
    res["agree_failed"] = (sync.agree(2 + rank, rank == 0, False, failed=7 + rank), sync.failed)
    # broadcast_text in a group of one rank each (every rank makes both): its src 0 is global
    # rank 1 on rank 1.
    groups = [dist.new_group([r]) for r in range(world_size)]
    res["group_text"] = RankSync(groups[rank]).broadcast_text(f"from rank {rank}", 0)

    def overlap(passes: list[list[range]]) -> list[str]:
        """The overlap warnings of a check armed for 80 examples, over passes (a bind each) of
        this rank's source batches (each a range of indices)."""
        check = RankSync()
        check.arm_overlap_check(80)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batches in passes:
                check.bind(torch.device("cpu"))
                for indices in batches:
                    check.note_indices(np.asarray(indices, dtype=np.int64))
            check.check_overlap()
        return [str(w.message) for w in caught if "read by more than one" in str(w.message)]

    own = [range(rank + 20 * b, rank + 20 * (b + 1), 2) for b in range(4)]  # batches of 10
    # Disjoint shares padded with 15 and 25 examples read on both ranks: within the slack of a
    # batch per rank (2 * 10), and past it.
    res["overlap_padded"] = overlap([[*own, range(10), range(10, 15)]])
    res["overlap_past"] = overlap([[*own, range(10), range(10, 20), range(20, 25)]])
    # A pass broken off after two batches of the other rank's share (a sampler reshuffled per
    # epoch), then a whole pass of its own: only the whole pass counts.
    other = [range(1 - rank + 20 * b, 1 - rank + 20 * (b + 1), 2) for b in range(2)]
    res["overlap_after_partial"] = overlap([other, own])

    stats = LoaderStats()
    first = stats.begin_epoch(0, target_rate=[1.0, 0.25][rank])
    first.examples_seen = [10, 30][rank]
    first.count_classes(np.array([[0, 1], [0, 1, 3, 3]][rank]), None)
    second = stats.begin_epoch(1, target_rate=0.5)
    second.count_classes([torch.zeros(2, 2), torch.tensor([0, 2])][rank], None)
    reduced = reduce_stats(stats).epochs
    res["reduced"] = [(e.target_rate, e.as_dict()["class_seen"]) for e in reduced]
    try:
        reduce_stats(stats if rank else LoaderStats())
        res["reduced_apart"] = ""
    except ValueError as e:
        res["reduced_apart"] = str(e)
    # A wrong argument on rank 1 only: refused on both ranks (rank 0 waited in the collective
    # until the process group's timeout), each naming what it can.
    try:
        reduce_stats({"examples_seen": 1} if rank else stats)  # type: ignore[call-overload]
        res["reduced_wrong"] = ""
    except TypeError as e:
        res["reduced_wrong"] = str(e)
    res["reduced_after"] = reduce_stats(stats).total.examples_seen  # the group still works
    return res


def scenario_feedback(rank: int, world_size: int) -> dict:
    """Stale-SB with training losses reported on every rank: each rank reports 1000 + index for
    what it trained in epoch 0 (only rank 0 in epoch 1); the reports reach every rank's store."""
    ds = EncodedDataset(120)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = SelectiveLoader(
        DataLoader(ds, batch_size=[24, 10, 16][rank], sampler=sampler),
        IndexLoss(),
        policy=SelectiveBackprop(1 / 3, staleness=2, fed_staleness=3),
        batch_size=8,
        seed=0,
    )
    reported: list[list[int]] = []
    stores = []
    for epoch in range(3):
        mine: list[int] = []
        for batch in loader:
            if epoch == 0 or rank == 0:
                loader.feedback(batch.indices, 1000.0 + batch.indices.double())
                mine += batch.indices.tolist()
        reported.append(mine)
        stores.append(loader.policy.store.loss.copy())
    return {
        "reported": reported,
        "stores": stores,
        "forwards": [e.selection_forwards for e in loader.stats.epochs],
        "batches": [e.batches_yielded for e in loader.stats.epochs],
    }


def scenario_unsharded(rank: int, world_size: int) -> dict:
    """A DataLoader that is not sharded (every rank reads every example) is refused on every
    rank at the first round; ranks that read their own data with the same indices are not."""
    res: dict = {}
    shared = SelectiveLoader(
        DataLoader(
            EncodedDataset(80),
            batch_size=20,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
        ),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=10,
    )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res["unsharded_batches"] = [b.indices.tolist() for b in shared]
    res["unsharded"] = [str(w.message) for w in caught if "first source batch" in str(w.message)]
    # The same with training epochs of a fixed length, whose count the ranks agree on before
    # any source batch is loaded: the check still compares the first source batches.
    fixed = SelectiveLoader(
        DataLoader(EncodedDataset(80), batch_size=20),
        IndexLoss(),
        policy=SelectiveBackprop(0.5),
        batch_size=10,
        batches_per_epoch=2,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(fixed)
    res["unsharded_fixed"] = [
        str(w.message) for w in caught if "first source batch" in str(w.message)
    ]

    # A run resumed mid-epoch (its first agreement is made before it loads a source batch).
    def unsharded() -> SelectiveLoader:
        source = DataLoader(EncodedDataset(80), batch_size=20)
        return SelectiveLoader(source, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=10)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = unsharded()
        it = iter(first)
        next(it)
        state = first.state_dict()
        it.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = unsharded()
        resumed.load_state_dict(state)
        list(resumed)
    res["unsharded_resumed"] = [
        str(w.message) for w in caught if "first source batch" in str(w.message)
    ]
    # Each rank its own examples (a pre-sharded dataset), the same indices and the same order.
    own = torch.utils.data.TensorDataset(
        torch.randn(80, 6, generator=torch.Generator().manual_seed(rank)),
        torch.randint(0, N_CLASSES, (80,), generator=torch.Generator().manual_seed(rank)),
    )
    per_rank = SelectiveLoader(
        DataLoader(own, batch_size=20, shuffle=True, generator=torch.Generator().manual_seed(3)),
        torch.nn.Linear(6, N_CLASSES),
        policy=SelectiveBackprop(0.5),
        batch_size=10,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res["per_rank"] = [b.indices.tolist() for _ in range(2) for b in per_rank]
    res["per_rank_warnings"] = [str(w.message) for w in caught]
    sampler = torch.utils.data.RandomSampler(own, generator=torch.Generator().manual_seed(3))
    res["per_rank_first"] = list(sampler)[:20]  # the first source batch's indices

    # With Stale-SB's per-example store, which every rank's losses reach by index: the ranks'
    # own data under the same indices would mix in it; refused on every rank after the first
    # pass, as is every rank reading the whole dataset in its own order. The same data under
    # the same indices on every rank (reported above) keeps the store consistent: not refused.
    def stale_run(dataset, order_seed: int, model, sampler=None) -> str | None:
        """The error (an error's epoch and message) or the overlap warnings of two epochs."""
        try:
            loader = SelectiveLoader(
                DataLoader(
                    dataset,
                    batch_size=20,
                    shuffle=sampler is None,
                    sampler=sampler,
                    generator=torch.Generator().manual_seed(order_seed),
                ),
                model,
                policy=SelectiveBackprop(0.5, staleness=2),
                batch_size=10,
            )
        except ValueError as e:
            return f"error as built: {e}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(2):
                    list(loader)
            except ValueError as e:
                return f"error in epoch {loader.epoch}: {e}"
        overlap = [str(w.message) for w in caught if "read by more than one" in str(w.message)]
        return f"warned after {loader.epoch} epochs: {overlap[0]}" if overlap else None

    res["stale_pre_sharded"] = stale_run(own, 3, torch.nn.Linear(6, N_CLASSES))
    uneven = torch.utils.data.Subset(own, range(80 - 20 * rank))  # shards of 80 and 60
    res["stale_uneven_shards"] = stale_run(uneven, 3, torch.nn.Linear(6, N_CLASSES))
    empty = torch.utils.data.Subset(own, range(0 if rank else 40))  # more ranks than shards
    res["stale_empty_shard"] = stale_run(
        empty, 3, torch.nn.Linear(6, N_CLASSES), sampler=list(range(len(empty)))
    )
    # Every example on every rank on purpose, each rank its own order (repeated augmentation):
    # global indices, a consistent store; warned about (the counts cannot tell), not refused.
    repeated = list(torch.randperm(80, generator=torch.Generator().manual_seed(rank)))
    res["stale_repeated"] = stale_run(EncodedDataset(80), 3, IndexLoss(), sampler=repeated)
    res["stale_own_orders"] = stale_run(EncodedDataset(80), 3 + rank, IndexLoss())
    res["stale_replicas"] = stale_run(EncodedDataset(80), 3, IndexLoss())
    # Disjoint shares padded with a few repeated examples, as Accelerate's even_batches pads
    # (up to a batch per rank): not refused.
    padded = SelectiveLoader(
        DataLoader(EncodedDataset(70), batch_size=20, sampler=[*range(rank, 70, 2), *range(5)]),
        IndexLoss(),
        policy=SelectiveBackprop(0.5, staleness=2),
        batch_size=10,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res["stale_padded_batches"] = [len(list(padded)) for _ in range(2)]
    res["stale_padded_warned"] = [
        str(w.message) for w in caught if "more than one" in str(w.message)
    ]
    return res


class SharedKath18(sbloader.Kath18):
    """Kath18 that asks for every rank's losses under a global CDF (as a policy of the user's
    own does by default): the round's exchange comes before its decision."""

    def ranks_shared_losses(self) -> bool:
        return True


class SharesOn(RandomBackprop):
    """RandomBackprop whose :meth:`ranks_shared_losses` is True only where ``shares``."""

    def __init__(self, shares: bool) -> None:
        super().__init__(0.5)
        self.shares = shares

    def ranks_shared_losses(self) -> bool:
        return self.shares


def counting_exchanges(run):
    """``run()``'s result and the :meth:`RankSync.exchange` calls it made on this rank."""
    calls = 0
    original = RankSync.exchange

    def counted(self, losses, indices):
        nonlocal calls
        calls += 1
        return original(self, losses, indices)

    RankSync.exchange = counted  # type: ignore[method-assign]
    try:
        return run(), calls
    finally:
        RankSync.exchange = original  # type: ignore[method-assign]


def scenario_exchanges(rank: int, world_size: int) -> dict:
    """cdf="global" with policies that rank no losses against other ranks' (Kath18,
    Random-Backprop, Traditional): no loss exchange, the batches of cdf="local"; SB: an exchange
    every round, identical windows; Phased(SB) after a Random-Backprop warm-up: the same, and a
    resume mid-warm-up and mid-selection gives the uninterrupted run's batches. Ranks hold
    uneven shares (4, 6 and 5 source batches, interleaved: alike losses), so rounds drain on the
    shorter ones."""
    data = EncodedDataset(90 * world_size)

    def build(policy: Policy, cdf: str) -> SelectiveLoader:
        sampler = Block(len(data), 0, 1, seed=rank)
        sampler.indices = list(range(rank, len(data), world_size))[: [60, 90, 75][rank]]
        return SelectiveLoader(
            DataLoader(data, batch_size=15, sampler=sampler),
            IndexLoss(),
            policy=policy,
            batch_size=5,
            cdf=cdf,
            seed=0,
        )

    res: dict = {}
    makers = {
        "kath18": lambda: sbloader.Kath18(0.5),
        "random": lambda: RandomBackprop([0.5, 0.25, 0.75][rank]),
        "traditional": sbloader.Traditional,
        "phased_kath18": lambda: Phased(sbloader.Kath18(0.5), warmup_epochs=1),
        "sb": lambda: SelectiveBackprop(1 / 3, history=64),
    }
    for name, make in makers.items():
        for cdf in ("global", "local"):
            loader = build(make(), cdf)
            batches, calls = counting_exchanges(
                lambda loader=loader: [[b.indices.tolist() for b in loader] for _ in range(2)]
            )
            res[f"{name}_{cdf}"] = {"batches": batches, "exchanges": calls}
            if name == "sb":
                res[f"{name}_{cdf}"]["window"] = loader.policy.window.values()

    def phased(stops: dict[int, int]) -> tuple[list[list[int]], np.ndarray]:
        def make() -> SelectiveLoader:
            sb = SelectiveBackprop(1 / 3, history=64)
            return build(Phased(sb, warmup_epochs=1, warmup_policy=RandomBackprop(0.5)), "global")

        loader, out = make(), []
        for epoch in range(3):
            it = iter(loader)
            if epoch in stops:
                out += [next(it).indices.tolist() for _ in range(stops[epoch])]
                state = copy.deepcopy(loader.state_dict())
                del it
                loader = make()
                loader.load_state_dict(state)
                it = iter(loader)
            out += [b.indices.tolist() for b in it]
        return out, loader.policy.policy.window.values()

    (res["phased_whole"], res["phased_window"]), res["phased_exchanges"] = counting_exchanges(
        lambda: phased({})
    )
    res["phased_split"], _ = phased({0: 3, 1: 2})  # mid-warm-up and mid-selection
    return res


def scenario_two(rank: int, world_size: int) -> dict:
    return {
        **scenario_unsharded(rank, world_size),
        **scenario_exchanges(rank, world_size),
        "sb": scenario_ddp(rank, world_size, "sb"),
        "random": scenario_ddp(rank, world_size, "random"),
        "feedback": scenario_feedback(rank, world_size),
        # decisions="device": each rank's window and torch.Generator, the same lockstep.
        "sb_device": scenario_ddp(rank, world_size, "sb", decisions="device"),
    }


def scenario_fixed(rank: int, world_size: int) -> dict:
    """batches_per_epoch over uneven source lengths and selection rates: the same count on every
    rank in every epoch, a mid-epoch resume, and ranks given different counts."""
    res: dict = {}

    def fixed(per_epoch=3) -> SelectiveLoader:
        return SelectiveLoader(
            _iterable(rank, [6, 3, 2][rank]),
            IndexLoss(),
            policy=RandomBackprop([1.0, 0.5, 0.25][rank]),
            batch_size=4,
            index_key=2,
            batches_per_epoch=per_epoch,
            seed=1,
        )

    whole = fixed()
    res["fixed_whole"] = [[b.indices.tolist() for b in whole] for _ in range(4)]
    res["fixed_passes"] = whole.epoch
    loader = fixed()
    split = [[b.indices.tolist() for b in loader]]
    it = iter(loader)
    split.append([next(it).indices.tolist() for _ in range(2)])
    state = copy.deepcopy(loader.state_dict())
    del it
    loader = fixed()
    loader.load_state_dict(state)
    split[-1] += [b.indices.tolist() for b in loader]
    split += [[b.indices.tolist() for b in loader] for _ in range(2)]
    res["fixed_split"] = split
    try:  # refused on every rank as the loaders are built
        fixed([3, 4, 3][rank])
        res["fixed_mismatch"] = None
    except ValueError as e:
        res["fixed_mismatch"] = str(e)
    return res


def scenario_three(rank: int, world_size: int) -> dict:
    return {
        **scenario_two(rank, world_size),
        **scenario_rounds(rank, world_size),
        **scenario_fixed(rank, world_size),
    }


# NOTE: one spawned group per world size, running every scenario in sequence: each process
# pays the imports (torch, DDP's torch._dynamo, numba's cached kernels) once.
def scenario_mismatches(rank: int, world_size: int) -> dict:
    """Options that must be the same on every rank, built differently on each (each refused at
    construction on every rank, naming the option); rank= other than the group's; and the
    default policy planned from uneven shares (the same plan on every rank)."""
    res: dict = {}
    data = EncodedDataset(64)
    cases = {
        "cdf": dict(policy=SelectiveBackprop(0.5), cdf=["global", "local"][rank]),
        "policy": dict(policy=[sbloader.Traditional(), RandomBackprop(0.5)][rank]),
        "remainder": dict(policy=RandomBackprop(0.5), remainder=["carry", "short"][rank]),
        "batch_size": dict(policy=RandomBackprop(0.5), batch_size=[4, 8][rank]),
        "rank": dict(policy=RandomBackprop(0.5), rank=0),  # rank=LOCAL_RANK on two nodes
        "planned_epochs": dict(planned_epochs=[8, None][rank]),  # the default's anneal
        # "expected" on every rank, resolved from each rank's own rate: 4 and 2 batches
        "expected": dict(policy=RandomBackprop([0.5, 0.25][rank]), batches_per_epoch="expected"),
        # a policy of the user's own (one kind) asking for the losses on one rank only
        "policy.ranks_shared_losses()": dict(policy=SharesOn(rank == 0), cdf="global"),
    }
    for name, options in cases.items():
        source = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, world_size, rank))
        options = {"batch_size": 4, **options}
        try:
            SelectiveLoader(source, IndexLoss(), **options)
            res[name] = "built"
        except ValueError as e:
            res[name] = str(e)
    shares = [range(0, 48), range(48, 64)][rank]  # uneven: 48 and 16 examples
    sampler = torch.utils.data.SubsetRandomSampler(
        list(shares), generator=torch.Generator().manual_seed(rank)
    )
    loader = SelectiveLoader(
        DataLoader(data, batch_size=8, sampler=sampler),
        IndexLoss(),
        batches_per_epoch=2,
        planned_epochs=8,
        batch_size=4,
    )
    res["planned"] = (loader.planned_passes, loader.policy.anneal_from_epoch)
    res.update(resumed_apart(rank, world_size, data))
    return res


def resumed_apart(rank: int, world_size: int, data: Dataset) -> dict:
    """States loaded on one rank only, or of different positions: refused on every rank as the
    epoch begins, naming what differs, with nothing lost (loading the right states then resumes
    exactly)."""

    def build() -> SelectiveLoader:
        sampler = DistributedSampler(data, world_size, rank, seed=1)
        source = DataLoader(data, batch_size=16, sampler=sampler)
        return SelectiveLoader(
            source, IndexLoss(), policy=SelectiveBackprop(0.5), batch_size=4, seed=3
        )

    def attempt(loader: SelectiveLoader) -> str:
        try:
            next(iter(loader))
        except ValueError as e:
            return str(e)
        return "began"

    res: dict = {}
    run = build()
    for _ in run:  # epoch 0
        pass
    boundary = run.state_dict()
    it = iter(run)
    after_boundary = [next(it).indices.tolist()]
    mid = run.state_dict()
    after_boundary += [b.indices.tolist() for b in it]
    lone = build()
    if rank == 0:  # the forgotten load on the other ranks
        lone.load_state_dict(boundary)
    res["lone"] = attempt(lone)
    lone.load_state_dict(boundary)  # mended on every rank
    res["mended"] = [b.indices.tolist() for b in lone] == after_boundary
    mixed = build()
    mixed.load_state_dict(mid if rank == 0 else boundary)
    res["mixed"] = attempt(mixed)
    # Another rank's state (as its identity says: states swapped between the ranks' files).
    swapped = copy.deepcopy(boundary)
    swapped["identity"]["rank"] = 1 - rank
    try:
        build().load_state_dict(swapped)
        res["swapped"] = "loaded"
    except ValueError as e:
        res["swapped"] = str(e)
    return res


def scenario_subgroup(rank: int, world_size: int) -> dict:
    """A loader over ``process_group=`` a subgroup of ranks 1 and 2 (rank 0 of the world takes no
    part), where each process's rank in the group differs from its rank in the world: the
    loader's default ``rank``, a loader given that rank explicitly (accepted), and a state taken
    by the one with the default loaded into the explicit one."""
    group = dist.new_group([1, 2])  # (every process of the world calls it)
    if rank == 0:
        return {}
    own = dist.get_rank(group)
    data = EncodedDataset(60)

    def build(**kwargs) -> SelectiveLoader:
        sampler = DistributedSampler(data, 2, own, seed=0)
        return SelectiveLoader(
            DataLoader(data, batch_size=12, sampler=sampler),
            IndexLoss(),
            policy=SelectiveBackprop(1 / 3),
            batch_size=4,
            seed=0,
            process_group=group,
            **kwargs,
        )

    res: dict = {"group_rank": own}
    default = build()
    res["default_rank"] = default.rank
    res["its_group"] = default.process_group is group and default.world_size == 2
    first = [b.indices.tolist() for b in default]
    state = default.state_dict()
    try:
        explicit = build(rank=default.rank)
        explicit.load_state_dict(state)
        res["explicit"] = [first, [b.indices.tolist() for b in explicit]]
    except ValueError as e:
        res["explicit"] = str(e)
    return res


def scenario_progress(rank: int, world_size: int) -> dict:
    """A DDP loop with its learning rate keyed on ``loader.progress`` (the README's cosine
    schedule) over Stale-SB, whose stale epochs load only what each rank keeps: each step's
    progress, the replica's weights at the end, and the progress of a run resumed mid-way
    through a stale epoch from every rank's state."""
    from sbloader.recipes import cosine_lr

    g = torch.Generator().manual_seed(0)
    x = torch.randn(301, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(1)
    data = TensorDataset(x, y)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, SelectiveLoader]:
        torch.manual_seed(0)
        model = DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        source = DataLoader(data, batch_size=24, sampler=DistributedSampler(data, seed=0))
        policy = SelectiveBackprop(1 / 3, staleness=3)
        loader = SelectiveLoader(source, model, policy=policy, batch_size=8, seed=0)
        return model, opt, loader

    def train(model, opt, loader, epochs: int, stop: int | None = None) -> list[float]:
        seen = []
        for _ in range(loader.epoch, epochs):
            for batch in loader:
                for group in opt.param_groups:
                    group["lr"] = cosine_lr(0.1, loader.progress, epochs)
                seen.append(loader.progress)
                inputs, targets = batch
                losses = F.cross_entropy(model(inputs), targets, reduction="none")
                (losses * batch.weights).mean().backward()
                opt.step()
                opt.zero_grad()
                loader.feedback(batch.indices, losses)
                if len(seen) == stop:
                    return seen
        return seen

    model, opt, loader = build()
    whole = train(model, opt, loader, 3)
    params = [p.detach().clone() for p in model.module.parameters()]
    model, opt, loader = build()
    first = train(model, opt, loader, 3, stop=len(whole) - 4)  # (in the stale epoch 2)
    saved = copy.deepcopy((model.module.state_dict(), opt.state_dict(), loader.state_dict()))
    model, opt, loader = build()
    model.module.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    loader.load_state_dict(saved[2])
    rest = train(model, opt, loader, 3)
    return {"whole": whole, "params": params, "resumed": first + rest}


SCENARIOS = {
    "progress": scenario_progress,
    "subgroup": scenario_subgroup,
    "mismatches": scenario_mismatches,
    "two": scenario_two,
    "three": scenario_three,
    "nonfinite": scenario_nonfinite,
    "limits": scenario_limits,
    "raised": scenario_raised,
    "round_raised": scenario_round_raised,
    "begin_raised": scenario_begin_raised,
}


# ------------------------------------------------------------------ tests on spawned ranks
def check_no_index_on_two_ranks(results: list[dict], epoch: int) -> None:
    """What the ranks yield in an epoch overlaps no more than their samplers' padding does."""
    sampled = Counter(i for r in results for i in r["sampler"][epoch])
    got = Counter(i for r in results for i in r["yielded"][epoch])
    for r in results:  # and each rank yields only its own sampler's examples
        assert set(r["yielded"][epoch]) <= set(r["sampler"][epoch])
    assert all(got[i] <= sampled[i] for i in got), "an index was yielded on two ranks"
    padding = sum(sampled.values()) - len(sampled)
    assert sum(got.values()) - len(got) <= padding


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_ranks("two", 2, tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> list[dict]:
    return run_ranks("three", 3, tmp_path_factory.mktemp("three"))


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory) -> list[dict]:
    return run_ranks("nonfinite", 2, tmp_path_factory.mktemp("nonfinite"))


@pytest.fixture(scope="module")
def limits(tmp_path_factory) -> list[dict]:
    return run_ranks("limits", 2, tmp_path_factory.mktemp("limits"))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("policy", ["sb", "random", "sb_device"])
def test_ddp_ranks_take_equal_steps_and_stay_identical(two, rounds, world_size, policy):
    results = [r[policy] for r in (two if world_size == 2 else rounds)]
    batches = [r["batches"] for r in results]
    assert all(b == batches[0] for b in batches) and batches[0][0] > 0
    # The selections really were uneven, and so were the selection forwards (each a DDP
    # collective if it went through the wrapper).
    if policy.startswith("sb"):
        assert len({r["calls"] for r in results}) == world_size
    else:
        selected = [r["selected"][0] for r in results]
        assert max(selected) > 2 * min(selected)
    # DDP kept the parameters bitwise identical.
    for r in results[1:]:
        for a, b in zip(results[0]["params"], r["params"]):
            assert torch.equal(a, b)
    check_no_index_on_two_ranks(results, 0)
    assert [r["rank"] for r in results] == list(range(world_size))
    # Reduced stats: counts summed over ranks, times the slowest rank's.
    for r in results:
        red = r["reduced"]
        assert red["examples_selected"] == sum(x["total"]["examples_selected"] for x in results)
        assert red["batches_yielded"] == world_size * results[0]["total"]["batches_yielded"]
        slowest = [max(x["epochs"][e]["wall_s"] for x in results) for e in range(2)]
        assert red["wall_s"] == pytest.approx(sum(slowest))
        # Class counts summed over ranks too: every rank's classes (of different lengths
        # where a rank saw fewer classes), each selection of a class counted once.
        if policy == "sb_device":  # decided on the device: class counts unknown, not partial
            assert red["class_seen"] is None and red["class_selected"] is None
            continue
        for field in ("class_seen", "class_selected"):
            width = max(len(x["total"][field]) for x in results)
            summed = [
                sum(x["total"][field][c] for x in results if c < len(x["total"][field]))
                for c in range(width)
            ]
            assert red[field] == summed
        assert sum(red["class_selected"]) == red["examples_selected"]


def test_progress_is_the_same_on_every_rank_in_stale_epochs_and_resumes(tmp_path):
    """A stale epoch loads only the candidates each rank keeps, so a round's source batch spans
    other numbers of candidates on each rank: each rank's own progress differed, and with it a
    learning rate keyed on it, so that DDP's replicas drifted apart. Every rank reports the
    share the ranks agreed on, also after a mid-epoch resume."""
    ranks = run_ranks("progress", 2, tmp_path)
    assert ranks[0]["whole"] == ranks[1]["whole"]
    assert any(p % 1 for p in ranks[0]["whole"][-4:])  # (the stale epoch's, mid-way)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)  # the replicas stayed identical
    for r in ranks:
        assert r["resumed"] == r["whole"]


def test_a_source_that_is_not_sharded_is_reported_on_every_rank(two):
    """Every rank reading the same examples (no DistributedSampler) is reported once, at the
    first round, on both ranks, naming the fix (and still runs in lockstep); ranks with their
    own data under the same indices and order are not."""
    for r in two:
        assert len(r["unsharded"]) == 1, "an unsharded source was not reported exactly once"
        assert "DistributedSampler" in r["unsharded"][0]
        assert len(r["unsharded_fixed"]) == 1, "not reported with batches_per_epoch"
        assert len(r["unsharded_resumed"]) == 1, "not reported after a mid-epoch resume"
        assert len(r["unsharded_batches"]) == len(two[0]["unsharded_batches"]) > 0  # lockstep
        assert r["per_rank"] and all(len(b) == 10 for b in r["per_rank"])
        assert not [m for m in r["per_rank_warnings"] if "first source batch" in m]
    # The same indices in the first source batch on both ranks, but different examples.
    assert two[0]["per_rank_first"] == two[1]["per_rank_first"]


def test_ranks_reading_the_same_indices_are_reported_with_a_store(two):
    """A policy with a per-example store (Stale-SB) on ranks whose indices overlap: their own
    data under indices from 0 (losses mixed in the store), the whole dataset each in its own
    order, or examples repeated on purpose, is warned about on every rank after the first pass;
    datasets of different sizes are refused at the first collective; the same data under the
    same indices on every rank (replicas, warned about once already) and disjoint shares padded
    with a batch's worth are not reported."""
    for r in two:
        for case in ("stale_pre_sharded", "stale_own_orders", "stale_repeated"):
            # After the first pass, a warning naming the three cases; the run goes on.
            assert r[case] is not None and r[case].startswith("warned after 2 epochs: "), r[case]
            assert "read by more than one of the 2 ranks" in r[case]
            assert "index_key=" in r[case] and "DistributedSampler" in r[case]
            assert "repeats examples on purpose" in r[case]
        # Shards of different sizes: an error before any loss is shared (the first collective);
        # an empty one is refused as the loader is built (no rank could yield a batch).
        case = "stale_uneven_shards"
        assert r[case] is not None and r[case].startswith("error in epoch 0: "), r[case]
        assert "the ranks' datasets differ in size (60 to 80 examples)" in r[case]
        empty = "error as built: the source of rank 1 of 2 draws no examples"
        assert r["stale_empty_shard"].startswith(empty), r["stale_empty_shard"]
        assert r["stale_replicas"] is None
        assert all(r["stale_padded_batches"])  # ran two epochs, not refused
        assert r["stale_padded_warned"] == []  # (within the slack of a batch per rank)


def test_reported_losses_reach_every_ranks_store_and_schedule(two):
    results = [r["feedback"] for r in two]
    # Epoch 0's reports (both ranks') are in every rank's store once epoch 1 has started...
    reported = sorted({i for r in results for i in r["reported"][0]})
    assert len(reported) > 20
    for r in results:
        np.testing.assert_array_equal(r["stores"][1][reported], 1000.0 + np.array(reported))
    np.testing.assert_array_equal(results[0]["stores"][1], results[1]["stores"][1])
    # ...and both ranks agree that the reports make epoch 1 and 2 stale (fed_staleness=3),
    # although in epoch 1 only rank 0 reported: the ranks see the same reports.
    assert [r["forwards"][1:] for r in results] == [[0, 0], [0, 0]]
    assert results[0]["forwards"][0] > 0 and results[1]["forwards"][0] > 0
    assert results[0]["batches"] == results[1]["batches"]
    only0 = sorted(set(results[0]["reported"][1]))
    for r in results:
        np.testing.assert_array_equal(r["stores"][2][only0], 1000.0 + np.array(only0))


@pytest.mark.parametrize("remainder", ["carry", "short", "drop"])
def test_uneven_source_lengths_do_not_hang_and_batch_counts_agree(rounds, remainder):
    sizes = [r[remainder] for r in rounds]
    for epoch in range(3):
        assert len({len(s[epoch]) for s in sizes}) == 1, sizes
    for r in rounds:
        for epoch, stats in zip(r[remainder], r[remainder + "_stats"]):
            st = stats
            if remainder == "carry":
                assert all(n == 4 for n in epoch)
            if remainder == "drop":
                assert all(n == 4 for n in epoch)
                assert st["examples_yielded"] + st["dropped"] == st["examples_selected"]
            if remainder == "short":
                assert all(n == 4 for n in epoch[:-1]) and all(1 <= n <= 4 for n in epoch)
                assert st["examples_yielded"] + st["dropped"] == st["examples_selected"]
    if remainder == "short":
        # The last batch is as large on every rank (DDP's mean of the ranks' means is then the
        # mean over the step's examples), and some epoch has a short one.
        for epoch in range(3):
            assert len({s[epoch][-1] for s in sizes}) == 1, sizes
        assert any(s[epoch][-1] < 4 for s in sizes for epoch in range(3)), sizes
    # Carried surplus stays pending on the ranks that selected more, nothing is lost.
    for r in rounds:
        st = r["carry_stats"]
        selected = sum(s["examples_selected"] for s in st)
        assert selected == sum(s["examples_yielded"] for s in st) + r["carry_pending"]
    assert rounds[0]["carry_pending"] > rounds[2]["carry_pending"]


def test_a_rank_whose_carried_surplus_grows_is_warned(rounds):
    """Rank 0 selects everything of 6 source batches, rank 2 a quarter of 2: every rank yields
    what rank 2 has ready, so rank 0's surplus grows every epoch under remainder="carry" (by
    about 56 examples, beyond the chance bound of 12 * sqrt(selected) by the fourth epoch). It
    is warned once, naming the fixes; rank 2, carrying nothing, and the other remainders are
    not."""
    (message,) = rounds[0]["carry_backlog"]
    assert message.startswith("rank 0 of 3 carries ") and "more than the ranks' select" in message
    assert "DistributedSampler" in message and "remainder='drop'" in message
    assert rounds[2]["carry_backlog"] == []
    for r in rounds:
        assert r["short_backlog"] == r["drop_backlog"] == []


def test_batches_per_epoch_holds_on_every_rank_and_resumes_exactly(rounds):
    """Uneven sources (6, 3 and 2 batches a pass) and rates: every rank yields 3 batches in every
    training epoch; the ranks' passes end in step (rank 2 needs several passes per epoch); a
    mid-epoch resume on every rank gives the uninterrupted run's batches."""
    for r in rounds:
        assert [len(e) for e in r["fixed_whole"]] == [3] * 4
        assert all(len(b) == 4 for e in r["fixed_whole"] for b in e)
        assert r["fixed_split"] == r["fixed_whole"]
    assert len({r["fixed_passes"] for r in rounds}) == 1 and rounds[0]["fixed_passes"] > 1
    for rank, r in enumerate(rounds):  # different counts: refused on every rank as it is built
        message = r["fixed_mismatch"]
        assert message is not None and message.startswith(
            "batches_per_epoch should be the same on every rank"
        )
        assert f"has batches_per_epoch={[3, 4, 3][rank]}" in message


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("policy", ["kath18", "random", "traditional", "phased_kath18"])
def test_a_global_cdf_makes_no_exchange_for_a_policy_that_ranks_no_shared_losses(
    two, rounds, world_size, policy
):
    """Kath18, Random-Backprop and Traditional rank no other rank's losses: under cdf="global"
    the ranks made an all_gather every round (in decisions and drain rounds) for nothing. Now
    none, with the batches of cdf="local" (those the global CDF gave: observe ignored them)."""
    for r in two if world_size == 2 else rounds:
        glob, local = r[policy + "_global"], r[policy + "_local"]
        assert glob["exchanges"] == local["exchanges"] == 0
        assert glob["batches"] == local["batches"]
        assert len(glob["batches"][1]) >= 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_global_cdf_still_exchanges_for_sb_and_for_phased_sb(two, rounds, world_size):
    """SB ranks every rank's losses: exchanged in every round (none with cdf="local"), identical
    windows; so does Phased(SB) after a Random-Backprop warm-up, in every epoch, and resumed
    mid-warm-up and mid-selection it yields the uninterrupted run's batches."""
    results = two if world_size == 2 else rounds
    for r in results:
        assert r["sb_global"]["exchanges"] >= 2 * 6  # two epochs of the longest share's rounds
        assert r["sb_local"]["exchanges"] == 0
        assert r["phased_exchanges"] >= 3 * 6
        assert r["phased_split"] == r["phased_whole"]
        assert len(r["sb_global"]["window"]) == len(r["phased_window"]) == 64
    # (every rank made the exchange in the same rounds)
    assert len({r["sb_global"]["exchanges"] for r in results}) == 1
    assert len({r["phased_exchanges"] for r in results}) == 1
    for r in results[1:]:
        np.testing.assert_array_equal(r["sb_global"]["window"], results[0]["sb_global"]["window"])
        np.testing.assert_array_equal(r["phased_window"], results[0]["phased_window"])
    assert not np.array_equal(results[0]["sb_local"]["window"], results[1]["sb_local"]["window"])


def test_traditional_with_uneven_sources_drops_the_extra_batches(rounds):
    assert [r["traditional"] for r in rounds] == [[10, 10]] * 3
    assert [r["traditional_dropped"] for r in rounds] == [40, 10, 0]


def test_global_cdf_gives_identical_windows_across_ranks(rounds):
    windows = [r["global_window"] for r in rounds]
    assert len(windows[0]) == 128
    for w in windows[1:]:
        assert np.array_equal(w, windows[0])
    # Rank 1's flipped labels give it the highest losses of the global distribution ...
    assert rounds[1]["global_rate"] > 0.6
    assert rounds[0]["global_rate"] < 0.3 and rounds[2]["global_rate"] < 0.3
    # ... while local CDFs keep each rank's own rate near the target, in different windows.
    assert not np.array_equal(rounds[0]["local_window"], rounds[1]["local_window"])
    for r in rounds:
        assert 0.15 < r["local_rate"] < 0.55


def test_indices_above_2_to_the_31_survive_the_exchange_exactly(rounds):
    starts = [2**31 + 7, 2**53 + 1, 2**62 + 12345]
    for rank, r in enumerate(rounds):
        assert set(r["big_yielded"]) <= set(range(starts[rank], starts[rank] + 30))
        # Per round, the lower ranks' candidates are observed before choosing, the higher
        # ranks' after: exactly the other ranks' indices, in rank order.
        others = [o for o in range(3) if o != rank]
        expected = [rounds[o]["big_chosen_from"][k] for k in range(3) for o in others]
        assert r["big_observed"] == expected


def test_memory_mapped_stores_on_three_ranks_match_and_recover(rounds):
    """Each rank's store memory-mapped in a folder of its own: the batches and store of the
    in-memory run, and a stale epoch resumed from a state saved before it (after it ran)
    hands out its batches again on every rank."""
    for r in rounds:
        assert r["mapped_batches"] == r["global_stale_batches"]
        for a, b in zip(r["mapped_store"], r["global_stale_store"]):
            np.testing.assert_array_equal(a, b)
        assert r["mapped_stale_again"]


def test_stale_sb_with_nothing_loaded_on_one_rank(rounds):
    for cdf in ("global", "local"):
        counts = [r[cdf + "_stale_batches"] for r in rounds]
        assert all(c == counts[0] for c in counts), counts
        # Every rank's store knows every example's own loss after the fresh epoch, each under
        # its index (a pairing error of the exchange, the same on every rank, fails here).
        for r in rounds:
            losses, epochs = r[cdf + "_stale_store"]
            np.testing.assert_array_equal(losses, expected_losses(120))
            assert (epochs == 0).all()
    # With a global CDF, rank 0's examples are the easiest: in the stale epoch it loads none.
    stale0 = rounds[0]["global_stale_stats"][1]
    assert stale0["prefiltered"] == stale0["examples_seen"] == 40
    assert stale0["selection_forwards"] == 0
    assert rounds[2]["global_stale_stats"][1]["prefiltered"] < 40
    windows = [r["global_stale_window"] for r in rounds]
    assert all(np.array_equal(w, windows[0]) for w in windows)


def test_generators_differ_by_rank_and_reproduce(rounds):
    assert [r["loader_rank"] for r in rounds] == [0, 1, 2]
    for r in rounds:
        assert r["choices"] == r["choices_again"]
    assert len({tuple(r["choices"]) for r in rounds}) == 3


def test_mid_epoch_resume_with_a_rank_that_loaded_nothing(rounds):
    """Resumed at once, and from the same checkpoint after the run went on past it (crash
    recovery): on three ranks, the uninterrupted run's batches."""
    assert rounds[0]["resume_position"] == 0 < rounds[1]["resume_position"]
    for r in rounds:
        assert len(r["resume_whole"][1]) > 5
        assert r["resume_split"] == r["resume_whole"]
        assert r["crash_split"] == r["resume_whole"][1]  # from a checkpoint the run went past


def test_capped_epochs_ended_and_saved_resume_exactly_on_every_rank(rounds):
    """A loop of 3 steps per epoch (``break``), ``end_epoch()`` and a state saved as each
    epoch ends, on three ranks with uneven sources under a global CDF: every epoch yields 3
    batches of 4 on every rank, epochs differ, and a run resumed from the second epoch's state
    yields the uninterrupted run's third and fourth epochs on every rank."""
    for r in rounds:
        whole = r["capped_whole"]
        assert [len(e) for e in whole] == [3] * 4
        assert all(len(b) == 4 for e in whole for b in e)
        assert len({str(e) for e in whole}) == 4
        assert r["capped_resumed"] == whole[2:]
    assert len({str(r["capped_whole"]) for r in rounds}) == 3  # each rank its own examples


def test_reduce_stats_sums_counts_and_takes_the_slowest_time(rounds):
    for r in rounds:
        red = r["reduced_stats"]
        for key in ("examples_seen", "examples_selected", "batches_yielded", "examples_yielded"):
            assert red[key] == sum(x["local_stats"][key] for x in rounds)
        assert red["wall_s"] == max(x["local_stats"]["wall_s"] for x in rounds)
        assert red["target_rate"] == pytest.approx(0.5)


# ------------------------------------------------------------------ one process
@pytest.mark.parametrize("cdf", ["global", "local"])
def test_nonfinite_losses_never_cross_the_exchange_and_are_counted(nonfinite, cdf):
    bad = sorted(NonFiniteFor.NAN + NonFiniteFor.INF)
    good = np.setdiff1d(np.arange(120), bad)
    for rank, r in enumerate(nonfinite):
        res = r[cdf]
        own = np.arange(60 * rank, 60 * (rank + 1))
        own_bad = [i for i in bad if i in own]
        assert len(own_bad) == 2 and res["nonfinite"] == 2 and res["reduced"] == 4
        given = np.concatenate(res["given"])  # all the policy was asked to observe or rank
        assert np.isfinite(given).all() and len(given) == len(good)
        window = res["window"]
        assert np.isfinite(window).all()
        assert len(window) == (len(good) if cdf == "global" else len(own) - len(own_bad))
        # Every rank's store: both ranks' finite losses, and under "skip" (the global CDF's
        # run) both ranks' non-finite ones marked as scored (NaN, epoch 0), so that stale
        # epochs skip them too; under "select" marked as scored and kept (+inf, epoch 0), so
        # that stale epochs keep them too.
        losses, epochs = res["store"]
        marked = np.isnan(losses[bad]) if cdf == "global" else losses[bad] == np.inf
        assert marked.all() and (epochs[bad] == 0).all()
        assert np.isfinite(losses[good]).all() and (epochs[good] == 0).all()
        expected = own if cdf == "local" else np.setdiff1d(own, bad)  # select / skip
        assert res["yielded"] == expected.tolist()
    if cdf == "global":
        np.testing.assert_array_equal(nonfinite[0][cdf]["window"], nonfinite[1][cdf]["window"])


def test_distributed_false_on_two_ranks_keeps_each_rank_on_its_own(nonfinite):
    assert [r["alone"] for r in nonfinite] == [[10] * 4, [10]]
    lockstep = [r["lockstep"] for r in nonfinite]  # the default: equal steps on every rank
    assert lockstep[0] == lockstep[1]


def test_a_rank_without_examples_is_refused_on_every_rank(nonfinite):
    """A source that yields no example on one rank (the others' yield theirs, and no rank a
    batch: the fewest ready is 0) is refused on every rank at the end of the pass, naming it."""
    for r in nonfinite:
        message = r["empty_rank"]
        expected = "the source of rank 1 of 2 yielded no examples in epoch 0"
        assert message.startswith(expected), message
        assert "DistributedSampler" in message


def test_a_rank_whose_sampler_draws_nothing_is_refused_as_the_loader_is_built(nonfinite):
    """A DataLoader whose sampler is empty on rank 1 only was refused at the end of the first
    pass, after rank 0 had run its whole pass of selection forwards (Traditional warned that
    every rank yields 0 batches per epoch, then raised). Now refused on every rank as the loader
    is built, naming the rank and the fix."""
    for rank, r in enumerate(nonfinite):
        for name in ("sb", "trad"):
            message = r[f"empty_sampler_{name}"]
            expected = "the source of rank 1 of 2 draws no examples (its sampler or dataset is"
            assert message.startswith(expected), message
            assert f"this is rank {rank})" in message and "DistributedSampler" in message
        assert r["empty_sampler_calls"] == 0  # no selection forward before the refusal


@pytest.mark.parametrize("case", ["local", "global", "stale", "device", "draining"])
def test_a_nonfinite_loss_on_one_rank_raises_on_every_rank(limits, case):
    """nonfinite="raise" with a non-finite selection loss on rank 1 only: rank 1 raises its own
    error and rank 0 one naming rank 1 and the fix, in the same round (none waits in a
    collective), whether the losses are exchanged first or decided on the device, and while
    rank 0's source has ended."""
    own, other = limits[1][case], limits[0][case]
    assert own.startswith("NonFiniteLoss: on rank 1 of 2 (every rank stops"), own
    assert "selection losses are not finite" in own  # (on the host, naming the indices)
    assert "nonfinite='skip' or nonfinite='select'" in own
    expected = "NonFiniteLoss: in epoch 0, rank 1 of 2 met a non-finite selection loss"
    assert other.startswith(expected), other
    assert "under nonfinite='raise'" in other and "this is rank 0 of 2" in other
    assert "pass nonfinite='skip' or nonfinite='select'" in other
    # with rank 1's own message
    _, _, detail = other.partition(". Rank 1's error: NonFiniteLoss: ")
    assert detail and "selection losses are not finite" in detail, other


def test_nonfinite_losses_on_every_rank_raise_each_ranks_own_error(limits):
    """Non-finite losses on both ranks in the same round: each rank raises its own error."""
    for rank, r in enumerate(limits):
        assert r["both"].startswith(f"NonFiniteLoss: on rank {rank} of 2"), r["both"]
        assert "dataset indices [" in r["both"]


def test_traditional_len_is_what_every_rank_yields_over_uneven_sources(limits):
    """Traditional over sources of 45 and 25 examples (no DistributedSampler): every rank yields
    as many batches as the fewest any rank's pass makes, and len() says so on every rank (it was
    each rank's own pass); a warning names the drop and the fix. Equal shares: no warning."""
    for r in limits:
        lengths = r["lengths"]
        # (passes of 5 and 3 batches of 10, with a short last one; of 12 and 7 batches of 4)
        for case, fewest, most in (("sized", 3, 5), ("rebatched", 7, 12)):
            got = lengths[case]
            assert got["len"] == fewest and got["yielded"] == [fewest, fewest], (case, got)
            (message,) = got["warnings"]
            assert message.startswith(f"the ranks' passes over their data make from {fewest} to ")
            assert f"to {most} batches" in message and "DistributedSampler" in message
        assert lengths["even"] == {"len": 4, "yielded": [4, 4], "warnings": []}
    for r in limits:  # (len() never called: the agreement's count is warned of all the same)
        (message,) = r["lengths"]["bucketed"]
        assert message.startswith("len(loader) counted the source's batches as full batches")
    unknown = [r["lengths"]["unknown"] for r in limits]
    assert unknown[0].startswith("the number of batches of a pass is unknown on another rank")
    assert "batches_per_epoch= an int" in unknown[0]
    assert unknown[1].startswith("the number of examples per pass of this source is unknown")


def test_a_text_broadcast_reaches_every_rank_as_its_source_passed_it(limits):
    """The failed rank's message reaches the others whole (UTF-8), empty stays empty, and a
    long one is cut at TEXT_LIMIT bytes, the same on every rank."""
    for r in limits:
        first, second, empty, long_text = r["texts"]
        assert first == "from rank 1: héllo ✓" and second == "from rank 0: héllo ✓"
        assert empty == ""
        assert long_text == "é" * (TEXT_LIMIT // 2)
    assert limits[0]["texts"] == limits[1]["texts"]


def test_agreements_name_the_lowest_failed_rank_and_reduce_what_every_rank_holds(limits):
    """Called directly on two ranks: an error reported on rank 0 only, or on both, names rank 0
    (and its kind) on every rank, and a flag raised on rank 1 only reaches rank 0; a text sent
    from rank 0 of a group comes from that group's rank 0 (global rank 1 in rank 1's group of
    one); the overlap check allows a batch per rank of padding, warns past it, and counts a
    whole pass only; the reduced stats weigh each rank's target rate by its examples and sum
    class counts of different lengths, unknown (None) on every rank where one rank could not
    count them, and stats of different numbers of epochs are refused on every rank."""
    for rank, r in enumerate(limits):
        got = r["agreements"]
        assert got["most_failed"] == ((3, False), (0, 5))
        assert got["most_flag"] == ((1, True), None)
        assert got["agree_failed"] == ((2, True), (0, 7))
        assert got["group_text"] == f"from rank {rank}"
        assert got["overlap_padded"] == [] and got["overlap_after_partial"] == []
        (message,) = got["overlap_past"]
        assert message.startswith("25 dataset indices were read by more than one of the 2 ranks")
        # (1.0 * 10 + 0.25 * 30) / 40 examples; classes [1, 1] and [1, 1, 0, 2]
        assert got["reduced"] == [(0.4375, [2, 2, 0, 2]), (0.5, None)]
        assert got["reduced_apart"].startswith(
            "reduce_stats needs stats of the same number of epochs on every rank, but ranks "
            "hold between 0 and 2"
        ), got["reduced_apart"]
        if rank:
            assert got["reduced_wrong"].startswith(
                "stats should be a LoaderStats (loader.stats) or an EpochStats, but got dict "
                "(every rank of the group stops"
            ), got["reduced_wrong"]
        else:
            assert got["reduced_wrong"].startswith(
                "reduce_stats was called on another rank with stats that are neither"
            ), got["reduced_wrong"]
        assert got["reduced_after"] == 40


def test_cdf_global_with_each_rank_on_its_own_is_refused_on_every_rank(limits):
    for r in limits:
        assert r["global_alone"].startswith("cdf should be 'local' with distributed=False on 2")
        assert r["local_alone"] == ""


@pytest.fixture(scope="module")
def raised_on_rank1(tmp_path_factory) -> list[dict]:
    return run_ranks("raised", 2, tmp_path_factory.mktemp("raised"))


@pytest.mark.parametrize(
    "case", ["empty", "empty_stale", "empty_global", "empty_trad", "empty_subset"]
)
def test_a_source_batch_without_examples_on_one_rank_keeps_every_rank_in_step(
    raised_on_rank1, case
):
    """Rank 1's source yields a batch without examples (empty, or all outside ``subset``): rank
    1 makes that round's collectives with nothing of its own (as a rank whose source ended), so
    both ranks go on in step over two epochs, with the losses exchanged too (Stale-SB's store,
    a global CDF); rank 1 never yields an example outside its subset. (It raised, or hung.)"""
    ranks = [raised_on_rank1[r][case] for r in (0, 1)]
    for got in ranks:
        assert got["raised"] == "", got
    assert ranks[0]["batches"] == ranks[1]["batches"] and min(ranks[0]["batches"]) > 0, ranks
    assert all(60 <= i < 120 for i in ranks[1]["indices"]), ranks[1]
    if case == "empty_subset":
        assert not any(75 <= i < 90 for i in ranks[1]["indices"]), ranks[1]
    if case == "empty_trad":  # 45 examples each, in batches of 5
        assert ranks[0]["batches"] == [9, 9] and sorted(ranks[1]["indices"]) == sorted(
            list(range(60, 75)) * 2 + list(range(75, 105)) * 2
        )


@pytest.mark.parametrize(
    "case",
    [
        "first",
        "later",
        "global",
        "stale",
        "device",
        "draining",
        "ahead",
        "forward",
        "probe",
        "probe_random",
    ],
)
def test_an_exception_in_one_ranks_selection_pass_raises_on_every_rank(raised_on_rank1, case):
    """The user's loss_fn (or model) raises on rank 1 only: rank 1 raises its own exception (the
    same type, its message prefixed with the rank, the original chained) and rank 0 a
    RuntimeError naming rank 1 and the type, in the same round, within seconds (it waited in
    its next collective until the process group timed out): in the first round or a later one,
    with the losses exchanged first (a global CDF, Stale-SB's store), decided on the device,
    while rank 0 drains, raised on the selection thread (overlap_selection), in the forward,
    in the probe forward of a warm-up's first round."""
    own, other = raised_on_rank1[1][case], raised_on_rank1[0][case]
    if case == "forward":
        kind, message = "BadInput", "the model cannot take this input"
        named = "an exception derived from ValueError"
    else:
        call = (
            3
            if case == "later"
            else 2
            if case in ("global", "stale", "device", "draining", "ahead")
            else 1
        )
        kind, message = "IndexError", f"target 99 is out of bounds in call {call}"
        named = "IndexError"
    prefix = f"{kind}: on rank 1 of 2 (every rank stops with this error, reported to the others)"
    assert own["raised"] == f"{prefix}: {message}", own
    assert own["cause"] == f"{kind}: {message}", own
    expected = f"RuntimeError: in epoch 0, rank 1 of 2 raised {named} in its selection pass"
    assert other["raised"].startswith(expected), other
    assert "this is rank 0 of 2" in other["raised"], other
    # Rank 1's message comes along (two broadcasts made only once a rank failed).
    assert other["raised"].endswith(
        f"Rank 1's error: {kind}: {message} (its own log has the traceback)"
    ), other
    assert other["cause"] == "", other
    assert own["seconds"] < 30 and other["seconds"] < 30, (own, other)  # (PG timeout: 120 s)


@pytest.mark.parametrize("case", ["policy", "policy_global", "policy_shared"])
def test_a_policy_refusing_one_ranks_losses_raises_on_every_rank(raised_on_rank1, case):
    """Kath18 refuses rank 1's negative losses in its decision (a policy's error, not the
    selection forward's): rank 0 waited in the round's agreement until the process group timed
    out, with a bare gloo error. Now every rank raises in that round, rank 0 naming rank 1, the
    policy's decision and its message with the fix."""
    own, other = raised_on_rank1[1][case], raised_on_rank1[0][case]
    message = "Kath18 samples in proportion to the loss, so losses should be >= 0"
    prefix = "ValueError: on rank 1 of 2 (every rank stops with this error, reported to the others)"
    assert own["raised"].startswith(f"{prefix}: {message}"), own
    expected = "RuntimeError: in epoch 0, rank 1 of 2 raised ValueError in its selection pass"
    assert other["raised"].startswith(expected), other
    assert "or the policy's decision" in other["raised"], other
    assert f"Rank 1's error: ValueError: {message}" in other["raised"], other
    assert "pass loss_fn= a non-negative per-example loss" in other["raised"], other
    assert own["seconds"] < 30 and other["seconds"] < 30, (own, other)  # (PG timeout: 120 s)


@pytest.fixture(scope="module")
def round_raised(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("stores")
    return run_ranks("round_raised", 2, tmp_path_factory.mktemp("round_raised"), folder=str(folder))


@pytest.mark.parametrize("case", ["local", "global", "stale", "traditional", "draining", "ahead"])
def test_a_source_raising_on_one_rank_raises_on_every_rank(round_raised, case):
    """Rank 1's dataset raises as its second source batch is loaded (a corrupt file): rank 1
    raises its own OSError (its rank prefixed, the original chained) and rank 0 a RuntimeError
    naming rank 1, the loading and the message, in the same round, within seconds. Before, rank 0
    waited in its next collective until rank 1's process ended ("Connection closed by peer") or
    the process group timed out; with its losses exchanged (a global CDF, Stale-SB's store),
    a passthrough policy, while rank 0 drains, and with the batch loaded ahead
    (overlap_selection)."""
    own, other = round_raised[1][case], round_raised[0][case]
    message = "cannot read example 75: the file is corrupt"
    prefix = "OSError: on rank 1 of 2 (every rank stops with this error, reported to the others)"
    assert own["raised"] == f"{prefix}: {message}", own
    assert own["cause"] == f"OSError: {message}", own
    expected = (
        "RuntimeError: in epoch 0, rank 1 of 2 raised OSError while loading a source batch (the "
        "source: its dataset, sampler, collate_fn or workers); every rank stops with it (this is "
        "rank 0 of 2)"
    )
    assert other["raised"].startswith(expected), other
    assert other["raised"].endswith(
        f"Rank 1's error: OSError: {message} (its own log has the traceback)"
    ), other
    assert own["seconds"] < 30 and other["seconds"] < 30, (own, other)  # (PG timeout: 120 s)


def test_a_store_folder_refused_on_one_rank_raises_on_every_rank_as_the_loader_is_built(
    round_raised,
):
    """Another process holds rank 1's store_path folder: rank 1's loader refuses it as it is
    built, and rank 0's now does too, naming rank 1 and its error (it was built, and its first
    epoch waited for rank 1 in a collective until rank 1's process ended or the group timed
    out)."""
    own, other = round_raised[1]["store"], round_raised[0]["store"]
    prefix = "ValueError: on rank 1 of 2 (every rank stops with this error, reported to the others)"
    assert own["raised"].startswith(f"{prefix}: the store folder "), own
    assert "is in use by another process" in own["raised"], own
    expected = (
        "RuntimeError: rank 1 of 2 raised an exception in attaching the policy as the "
        "SelectiveLoader was built (e.g. its store_path); every rank stops with it (this is "
        "rank 0 of 2)"
    )
    assert other["raised"].startswith(expected), other
    assert "Rank 1's error: ValueError: the store folder " in other["raised"], other
    assert own["seconds"] < 30 and other["seconds"] < 30, (own, other)


@pytest.fixture(scope="module")
def begin_raised(tmp_path_factory) -> list[dict]:
    return run_ranks("begin_raised", 2, tmp_path_factory.mktemp("begin_raised"))


@pytest.mark.parametrize(
    "case", ["set_epoch", "set_epoch_stale", "begin_epoch", "begin_epoch_stale"]
)
def test_an_exception_on_one_rank_as_an_epoch_begins_raises_on_every_rank(begin_raised, case):
    """Rank 1's sampler raises in ``set_epoch`` (epoch 0), or its policy in ``begin_epoch``
    (epoch 1): rank 1 raises its own error (its rank prefixed, the original chained) and rank 0
    a RuntimeError naming rank 1, the epoch's beginning and the message, within seconds. Before,
    rank 0 went on into the epoch's first round and waited there until rank 1's process ended
    ("Connection closed by peer") or the process group timed out; with Stale-SB's store, whose
    ranks exchange the reports of loader.feedback as the epoch begins (rank 1 makes that
    exchange with none of its own when set_epoch raised before it)."""
    own, other = begin_raised[1][case], begin_raised[0][case]
    epoch = 0 if case.startswith("set_epoch") else 1
    message = f"cannot {'shuffle for' if epoch == 0 else 'begin'} epoch {epoch}"
    prefix = "ValueError: on rank 1 of 2 (every rank stops with this error, reported to the others)"
    assert own["raised"] == f"{prefix}: {message}", own
    assert own["cause"] == f"ValueError: {message}", own
    expected = f"RuntimeError: rank 1 of 2 raised an exception as epoch {epoch} began ("
    assert other["raised"].startswith(expected), other
    assert "every rank stops with it (this is rank 0 of 2)" in other["raised"], other
    assert other["raised"].endswith(
        f"Rank 1's error: ValueError: {message} (its own log has the traceback)"
    ), other
    assert own["seconds"] < 30 and other["seconds"] < 30, (own, other)  # (PG timeout: 120 s)


@pytest.mark.parametrize("case", ["ragged", "ragged_ahead"])
def test_a_ragged_field_on_one_rank_raises_on_every_rank(limits, case):
    """A field of another width in rank 1's third source batch: rank 1 raises the field's error,
    rank 0 one naming rank 1 and pad_values=; also when the batch is loaded ahead
    (overlap_selection)."""
    own, other = limits[1][case], limits[0][case]
    assert own.startswith("ValueError: on rank 1 of 2 (every rank stops"), own
    assert "field 3 of source batch 3 (counted from 1) of epoch 0 has shape (10, 3)" in own
    expected = "ValueError: in epoch 0, rank 1 of 2 loaded a source batch whose rows cannot be"
    assert other.startswith(expected), other
    assert "this is rank 0 of 2" in other and "pass pad_values=" in other
    assert other.endswith(
        "Rank 1's error: ValueError: field 3 of source batch 3 (counted from 1) of epoch 0 has "
        + own.split("of epoch 0 has ", 1)[1]
    ), other


def random_choices(rank: int, seed: int = 0) -> list[int]:
    loader = SelectiveLoader(
        DataLoader(EncodedDataset(100), batch_size=20),
        IndexLoss(),
        policy=RandomBackprop(0.5),
        batch_size=5,
        seed=seed,
        rank=rank,
    )
    return [i for b in loader for i in b.indices.tolist()]


def test_an_exception_in_the_selection_pass_on_one_process_propagates_unchanged():
    """On one process the user's exception is raised as it is (no prefix, no chaining)."""
    loss = RaisingLoss(1, 2)
    loader = SelectiveLoader(
        DataLoader(EncodedDataset(60), batch_size=15),
        IndexLoss(),
        loss_fn=loss,
        policy=SelectiveBackprop(0.5),
        batch_size=10,
    )
    with pytest.raises(IndexError) as info:
        for _ in loader:
            pass
    assert str(info.value) == "target 99 is out of bounds in call 2"
    assert info.value.__cause__ is None and loss.calls == 2


def test_the_kinds_of_raised_exceptions_fit_the_agreement_and_name_their_type():
    """Every named exception type has a kind below FAILURE_KINDS, and the kind names the type
    (or its nearest named base); a type that cannot be made from a message is raised as it is."""
    from sbloader import epoch
    from sbloader.distributed import FAILURE_KINDS

    assert 2 * len(epoch._NAMED) <= epoch._STAGE
    assert epoch._RAISED + epoch._STAGE * len(epoch._STAGES) <= FAILURE_KINDS
    for stage, where in enumerate(epoch._STAGES):  # the stage travels with the type
        kind = epoch._raised_kind(BadInput("x"), stage)
        assert epoch._raised_stage(kind) == where
        assert epoch._raised_name(kind) == "an exception derived from ValueError"
    assert epoch._raised_name(epoch._raised_kind(IndexError("x"))) == "IndexError"
    assert epoch._raised_name(epoch._raised_kind(KeyError("x"))) == "KeyError"
    # A built-in type not in the fixed list travels as derived from its nearest listed base.
    assert epoch._raised_name(epoch._raised_kind(BlockingIOError("x"))) == (
        "an exception derived from OSError"
    )
    derived = "an exception derived from ValueError"
    assert epoch._raised_name(epoch._raised_kind(BadInput("x"))) == derived
    assert epoch._raised_name(epoch._raised_kind(torch.OutOfMemoryError("x"))) == (
        "torch.OutOfMemoryError"
    )
    error = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    with pytest.raises(UnicodeDecodeError) as info:
        epoch._raise_own(error, "on rank 1 of 2: ")
    assert info.value is error


def test_rank_seeds_the_generator():
    assert random_choices(0) == random_choices(0)
    assert random_choices(1) == random_choices(1)
    assert random_choices(0) != random_choices(1)


def test_one_process_is_not_distributed_and_cdf_global_changes_nothing_but_warns():
    """cdf="global" on one process without a process group ranks against the process's own
    losses, as "local" does (a script run on one process and under torchrun alike may pass it):
    it warns, naming the option and the fixes; "local" does not."""

    def run(cdf: str) -> list[list[int]]:
        loader = SelectiveLoader(
            DataLoader(EncodedDataset(120), batch_size=30),
            IndexLoss(),
            policy=SelectiveBackprop(1 / 3),
            batch_size=10,
            cdf=cdf,
        )
        assert loader.world_size == 1 and loader.process_group is None
        return [b.indices.tolist() for b in loader]

    expected = r"cdf='global' .*needs an initialised torch.distributed process group, but none"
    with pytest.warns(UserWarning, match=expected) as caught:
        got = run("global")
    assert "init_process_group" in str(caught[0].message)
    assert "pass cdf='local'" in str(caught[0].message)
    with warnings.catch_warnings(record=True) as local:
        warnings.simplefilter("always")
        assert got == run("local")
    assert not [w for w in local if "cdf=" in str(w.message)]


def test_a_loader_built_before_init_process_group_under_a_launcher_is_refused(monkeypatch):
    """WORLD_SIZE=2 (a launcher such as torchrun) without an initialised process group: the
    loader would run alone on each rank, so distributed=None (the default) is refused naming
    init_process_group and distributed=False, and so is cdf="global" with distributed=False;
    distributed=False alone runs each process on its own (rank= then seeds each)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for cdf in ("local", "global"):
        message = refused(cdf=cdf)
        assert message.startswith("WORLD_SIZE=2 says this is one of 2 processes"), message
        assert "after torch.distributed.init_process_group(...)" in message
        assert "in Lightning: in train_dataloader()" in message
        assert "distributed=False" in message
    message = refused(cdf="global", distributed=False)
    assert message.startswith(
        "cdf should be 'local' with distributed=False on 2 ranks (each then runs on its own and "
        "shares no losses), but got cdf='global'"
    ), message
    assert refused(distributed=False, rank=1) == ""


def test_a_process_group_without_an_initialised_one_is_refused():
    message = refused(process_group=object())
    assert message.startswith("process_group should be a group of an initialised torch.")
    assert "init_process_group" in message and "leave process_group out" in message


COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
)


def spy_on_collectives(monkeypatch) -> Counter:
    """Count every call of torch.distributed's collectives (by name) until the test ends."""
    calls: Counter = Counter()
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    return calls


def test_distributed_false_under_an_initialised_group_makes_no_collectives(tmp_path, monkeypatch):
    def run(**kw) -> list[list[int]]:
        loader = SelectiveLoader(
            DataLoader(
                EncodedDataset(120), batch_size=30, shuffle=True, generator=torch.Generator()
            ),
            IndexLoss(),
            policy=SelectiveBackprop(1 / 3, history=64),
            batch_size=10,
            cdf="global",
            remainder="short",
            seed=0,
            **kw,
        )
        return [b.indices.tolist() for _ in range(2) for b in loader]

    with pytest.warns(UserWarning, match="cdf='global'"):  # no process group: its own losses
        alone = run()
    calls = spy_on_collectives(monkeypatch)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a group of one rank: its global CDF is exact
            assert run(distributed=False) == alone and not calls
            assert run() == alone and not calls  # automatic: one rank is not distributed
        assert run(distributed=True) == alone and calls["all_reduce"] > 0  # the spy sees them
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("policy", "gathers_per_round", "fresh_epochs"),
    [(SelectiveBackprop(1 / 3), 0, 2), (SelectiveBackprop(1 / 3, staleness=2), 3, 1)],
    ids=["sb", "stale_sb"],
)
def test_collectives_are_a_fixed_few_per_source_batch_never_per_yielded_batch(
    tmp_path, monkeypatch, policy, gathers_per_round, fresh_epochs
):
    """distributed=True with the default cdf="local": one all_reduce per source batch loaded
    (plus one per round after the source ends; a stale epoch loads only the examples it keeps),
    and with a per-example store three all_gathers per source batch (sizes, losses, indices);
    none per yielded batch: halving the training batch doubles the batches and leaves the
    collectives as they were."""
    calls = spy_on_collectives(monkeypatch)

    def run(batch_size: int) -> tuple[Counter, int, int]:
        calls.clear()
        loader = SelectiveLoader(
            DataLoader(
                EncodedDataset(240), batch_size=40, shuffle=True, generator=torch.Generator()
            ),
            IndexLoss(),
            policy=copy.deepcopy(policy),
            batch_size=batch_size,
            distributed=True,
            seed=0,
        )
        batches = sum(1 for _ in range(2) for _ in loader)
        return Counter(calls), batches, sum(e.selection_forwards for e in loader.stats.epochs)

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        big, big_batches, _ = run(10)
        small, small_batches, _ = run(5)
    finally:
        dist.destroy_process_group()
    rounds = 2 * 6  # at most two epochs of six source batches
    assert small_batches > big_batches > 0
    assert small == big  # nothing per yielded batch
    assert 6 * fresh_epochs <= big["all_reduce"] <= rounds + 2 * 2  # + the end-of-epoch rounds
    # Stale-SB's store: every source batch's losses (or, in a stale epoch, none) are exchanged.
    assert big["all_gather"] <= gathers_per_round * rounds
    assert (big["all_gather"] > 0) == (gathers_per_round > 0)
    assert set(big) <= {"all_reduce", "all_gather"}


def test_a_destroyed_group_still_held_keeps_gloos_workers_and_is_reported(tmp_path):
    """The ranks above leave with launch.leave(end_process_group()): a destroyed group that
    something still holds (as torch does after DDP or fully_shard) keeps gloo's worker threads
    running, and end_process_group reports them; once nothing holds it, they are joined."""
    before = gloo_threads()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.all_reduce(torch.ones(2))
    held = dist.group.WORLD
    assert len(end_process_group()) > len(before)  # destroyed, but held: still running
    del held
    assert end_process_group() == before  # freed: joined


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"distributed": True}, RuntimeError, r"init_process_group.*distributed=False"),
        ({"distributed": "yes"}, TypeError, "distributed should be True, False or None"),
        ({"cdf": "world"}, ValueError, "cdf should be one of 'local', 'global'"),
    ],
)
def test_bad_distributed_arguments_name_the_fix(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        SelectiveLoader(DataLoader(EncodedDataset(10), batch_size=5), IndexLoss(), **kwargs)


def test_observe_feeds_the_window_and_the_store():
    assert Policy.observe(RandomBackprop(), np.ones(2), None) is None  # the default: nothing
    sb = SelectiveBackprop(0.5, history=8)
    sb.observe(np.array([1.0, 2.0]), None)
    sb.observe(np.array([3.0]), None, cdf=False)  # a local CDF: the window is left alone
    assert sb.window.values().tolist() == [1.0, 2.0]
    assert not sb.records_examples()

    stale = SelectiveBackprop(0.5, staleness=2)
    stale.attach(10, key=0)
    assert stale.records_examples()
    stale.begin_epoch(4)
    stale.observe(np.array([0.5, 0.25]), np.array([3, 7]), cdf=False)
    losses, epochs = stale.store.lookup(np.array([3, 7, 1]))
    assert losses[:2].tolist() == [0.5, 0.25] and np.isnan(losses[2])
    assert epochs.tolist() == [4, 4, -1] and len(stale.window) == 0

    phased = Phased(SelectiveBackprop(0.5, history=8), warmup_epochs=1)
    phased.begin_epoch(0)  # warm-up: the wrapped policy sees nothing, as in choose
    phased.observe(np.array([1.0]), None)
    phased.begin_epoch(1)
    phased.observe(np.array([2.0]), None)
    assert phased.policy.window.values().tolist() == [2.0]


def test_reduce_stats_on_one_process_is_a_copy():
    loader = SelectiveLoader(
        DataLoader(EncodedDataset(40), batch_size=10), IndexLoss(), policy=RandomBackprop(0.5)
    )
    list(loader)
    reduced = reduce_stats(loader.stats)
    assert reduced.total.as_dict() == loader.stats.total.as_dict()
    assert reduced.epochs[0] is not loader.stats.epochs[0]
    with pytest.raises(TypeError, match="stats should be a LoaderStats"):
        reduce_stats({"examples_seen": 1})


def test_reduce_stats_mid_epoch_copies_the_class_counts():
    """The copy taken mid-epoch keeps its class counts as they were, with its other counts: its
    shallow copy shared the arrays that the running epoch adds to in place."""
    loader = SelectiveLoader(
        DataLoader(TensorDataset(torch.randn(40, 2), torch.arange(40) % 3), batch_size=10),
        torch.nn.Linear(2, 3),
        policy=RandomBackprop(0.5),
        batch_size=5,
    )
    epoch = iter(loader)
    next(epoch)
    reduced = reduce_stats(loader.stats.current)
    seen = reduced.examples_seen
    assert reduced.class_seen.sum() == seen
    list(epoch)
    assert loader.stats.current.class_seen.sum() == 40
    assert reduced.examples_seen == seen and reduced.class_seen.sum() == seen


def test_batch_counts_use_the_distributed_samplers_share():
    ds = EncodedDataset(101)
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    source = DataLoader(ds, batch_size=10, sampler=sampler)  # 51 examples on this rank
    trad = SelectiveLoader(source, IndexLoss(), policy=sbloader.Traditional())
    assert len(trad) == 6 == len(list(trad))
    sb = SelectiveLoader(source, IndexLoss(), policy=RandomBackprop(0.5), batch_size=5)
    assert sb.expected_batches() == pytest.approx(51 * 0.5 / 5)


def test_an_error_whose_message_cannot_be_made_is_still_described():
    """The failed rank describes its error for the others before raising; an exception whose
    ``__str__`` raises must not stop it before the broadcast they wait in (it hung them)."""
    from sbloader.epoch import _describe

    class Unprintable(RuntimeError):
        def __str__(self) -> str:
            raise ValueError("no message")

    assert _describe(IndexError("target 99")) == "IndexError: target 99"
    assert _describe(Unprintable()) == "Unprintable (its message could not be made)"


def test_options_that_must_match_across_ranks_are_refused_at_construction_naming_them(tmp_path):
    """A policy (of another kind), cdf, remainder or batch size that differs between ranks made
    the ranks fall out of step (a collective hang, a gloo abort, or batches of different
    sizes); rank= other than the group's made both ranks draw alike and accept each other's
    states; and the default policy planned from uneven shares, or for other planned_epochs,
    annealed from different passes on each rank. Each is refused on every rank as the loader is
    built, or planned alike; a batches_per_epoch="expected" that the ranks resolve differently
    is refused naming the fix (it said to pass the same batches_per_epoch on every rank, as
    they had)."""
    results = run_ranks("mismatches", 2, tmp_path)
    for rank, res in enumerate(results):
        names = ("cdf", "policy", "remainder", "batch_size", "planned_epochs")
        for name in (*names, "policy.ranks_shared_losses()"):
            assert res[name].startswith(f"{name} should be the same on every rank"), res[name]
            assert f"this rank ({rank}) has {name}=" in res[name]
        assert res["rank"].startswith("rank= should be each process's rank in the process group")
        mine = "rank=0 is not this process's (1)" if rank else "another process's is not"
        assert mine in res["rank"]
        # (it said to pass "the same batches_per_epoch on every rank", which every rank had)
        assert res["expected"].startswith('batches_per_epoch="expected" resolves to'), res
        assert f"this rank ({rank}) expects {[4, 2][rank]} at a rate of" in res["expected"]
        assert "sampler=DistributedSampler(dataset)" in res["expected"]
        assert "pass batches_per_epoch= an int" in res["expected"]
    assert results[0]["planned"] == results[1]["planned"]


def test_ranks_resuming_from_different_positions_are_refused_on_every_rank(tmp_path):
    """A state loaded on rank 0 only (under `if rank == 0:`) put the ranks in different epochs,
    and states of different steps at different batches of one: the next collectives hung,
    aborted the group, or paired batches of different positions. Refused as the epoch begins,
    on every rank, naming what differs; loading the right states afterwards resumes exactly. A
    state of another rank is refused as it is loaded, naming both ranks and the fix."""
    results = run_ranks("mismatches", 2, tmp_path)
    for rank, res in enumerate(results):
        lone, mixed = res["lone"], res["mixed"]
        assert lone.startswith("the ranks would begin at different positions (epoch differs)")
        assert f"this rank ({rank}) begins epoch {1 if rank == 0 else 0}." in lone
        assert "call load_state_dict on every rank" in lone
        assert "(batches yielded differs)" in mixed
        where = "epoch 1 after 1 batches" if rank == 0 else "epoch 1."
        assert f"this rank ({rank}) begins {where}" in mixed, mixed
        assert res["mended"] is True
        # another rank's state is refused naming both ranks and the fix
        assert res["swapped"].startswith(
            f"rank {rank} was given the loader state of rank {1 - rank}: every rank must load "
            "its own state"
        ), res["swapped"]


def test_the_default_rank_is_the_ranks_in_the_loaders_process_group(tmp_path):
    """With ``process_group=`` a subgroup, the default ``rank`` was the process's rank in the
    world, which the loader refuses when passed explicitly ("should be each process's rank in the
    process group ... leave rank= out (the group's rank is used)"): the same value accepted
    implicitly and refused explicitly, and a state it saved refused by a loader given the
    group's rank. The default is the rank in the loader's group, which rank= is checked against."""
    results = run_ranks("subgroup", 3, tmp_path)
    assert results[0] == {}
    for res in results[1:]:
        assert res["default_rank"] == res["group_rank"]
        assert res["its_group"]  # (loader.process_group: what a caller's own collective uses)
        assert isinstance(res["explicit"], list), res["explicit"]
        first, resumed = res["explicit"]
        assert first and resumed  # the state, loaded, resumes into the next epoch
