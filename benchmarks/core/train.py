"""The one training step, and one run of one strategy trained an epoch at a time.

A :class:`Trainer` owns everything its run draws randomness from: the model is initialised from
the run's seed before any training (leaving the global RNGs alone), the source has its own
generator, the loader its own seed and augmentation its own generator. Nothing draws from a
global RNG during training, so runs trained in turn, an epoch each (:func:`train_interleaved`),
make the same selections as each run trained alone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import sbloader
from sbloader.datasets import ArrayDataset
from sbloader.recipes import cosine_lr, error_rate

from .arrays import Keeper, predict
from .config import Config
from .data import augment, flip_labels, shuffled
from .models import make_loader, make_model, make_optimizer, seeded_model
from .records import Run, collapsed
from .strategies import Strategy, planned_backprops
from .timing import StepTimer, sync, train_autocast

Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""Train images, train labels, test images, test labels (see ``data.load_data``)."""


def train_step(
    cfg: Config,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor | None = None,
    timer: StepTimer | None = None,
) -> torch.Tensor:
    """One training step: forward (under bf16 autocast when ``cfg.train_bf16``), cross-entropy
    in fp32 per example (times ``weights``), its mean, backward and the optimizer step. ``timer``
    is marked before the forward, after the loss and after the step. Returns the per-example
    losses (detached), which a strategy with feedback reports to its loader."""
    if timer is not None:
        timer.mark()
    with train_autocast(cfg):
        out = model(x)
    per_example = F.cross_entropy(out.float(), y, reduction="none")
    loss = (per_example if weights is None else per_example * weights).mean()
    if timer is not None:
        timer.mark()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if timer is not None:
        timer.mark()
    return per_example.detach()


class Trainer:
    """One strategy trained once (one seed, one label-noise level), an epoch per call.

    Wall-clock accounting: everything the user pays for (selection passes, EL2N's scoring, data
    loading) counts; evaluation does not. Each epoch is timed on its own, so that runs can be
    trained in turn; the time of a point on the error curve is the run's training time so far.
    The learning rate follows a cosine schedule by position in the data (``loader.progress``)
    over the run's planned epochs; a strategy with ``lr_by_backprops`` follows its examples
    backpropagated as a share of its planned backprops instead (a run that backpropagates fewer
    than planned ends at a small learning rate, not at zero).

    NOTE: position, for every registered strategy: it is known in advance, where a run's total
    backprops are random under selection, and it gives every strategy the same learning rate
    at the same point of the data. ``lr_by_backprops`` is for measuring the other choice.
    """

    def __init__(
        self,
        cfg: Config,
        strat: Strategy,
        seed: int,
        noise: float,
        data: Data,
        progress: Any = None,
        interleaved: bool = False,
    ) -> None:
        x_train, y_train, x_test, y_test = data
        self.cfg, self.strat, self.progress = cfg, strat, progress
        y_noisy = flip_labels(y_train, noise, seed)
        classes = int(y_train.max()) + 1
        channels = x_train.shape[1]
        self.planned = strat.planned(cfg.epochs)
        self.run = Run(strat.name, seed, noise, self.planned, interleaved=interleaved)
        self.run.classes = classes
        self.device = device = cfg.resolved_device()
        self.model = seeded_model(cfg, seed, classes, channels)
        self.opt = make_optimizer(cfg, self.model)
        # NOTE: on a GPU the training set lives on the device, as a GPU user would keep a
        # dataset of this size; the DataLoader then only indexes it (num_workers=0).
        dataset = ArrayDataset(x_train.to(device), y_noisy.to(device))
        self.x_test, self.y_test = x_test.to(device), y_test.to(device)
        self.clock = 0.0  # training seconds so far, at the start of the current epoch
        subset = None
        if strat.prune:
            r = sbloader.el2n_scores(
                functools.partial(make_model, cfg, classes, channels),
                shuffled(dataset, cfg.batch_size, seed, cfg.array_collate),
                make_optimizer=functools.partial(make_optimizer, cfg),
                models=cfg.el2n_models,
                epochs=cfg.el2n_epochs,
                seed=1000 + seed,
                device=device,
            )
            subset = sbloader.prune(r.scores, cfg.el2n_keep, keep="hardest")
            self.run.pre_cost = r.cost()
            self.clock += r.seconds  # the user pays for scoring
        # the loader's own default precision for a user's loader
        # NOTE: the other strategies select in the configuration's precision, never through
        # the library's automatic int8 copy, so that a family means the same on every CPU.
        user: dict[str, Any] = dict(autocast="auto") if strat.as_user else {}
        if not strat.as_user:
            user.update(quantize_selection=False)
        elif strat.user_quantize is not None:
            user.update(quantize_selection=strat.user_quantize)
        if strat.quantized:
            user.update(autocast=None, quantize_selection=True)
        if strat.overlap:
            user.update(overlap_selection=True)
        self.loader = make_loader(
            cfg,
            shuffled(
                dataset,
                strat.source_batch(cfg.pool_batch_size, cfg.batch_size),
                seed,
                cfg.array_collate,
            ),
            self.model,
            strat.policy(self.planned),  # its own schedule
            seed,
            subset=subset,
            **user,
        )
        self._record_precision()
        self.keep = (
            Keeper(
                y_noisy,
                (y_noisy != y_train).nonzero().flatten().numpy(),
                self.planned,
                subset,
            )
            if cfg.keep_outputs
            else None
        )
        self.x_train = dataset.tensors[0] if cfg.keep_outputs else None
        self.aug_gen = torch.Generator(device=device).manual_seed(20_000 + seed)
        self.timer = StepTimer(device)
        self.epoch = 0
        self.backprops = 0
        # (lr_by_backprops: the run's planned backprops [examples]; None: by position)
        self._planned_backprops = (
            planned_backprops(self.loader.policy, self.planned) * len(dataset)
            if strat.lr_by_backprops
            else None
        )
        self.next_eval = cfg.eval_every
        self._epoch_start = 0.0
        self._epoch_eval = 0.0
        self.run.points.append(
            dict(position=0.0, time_s=self.clock, error=1.0, backprops=0, selections=0)
        )

    @property
    def done(self) -> bool:
        return self.epoch >= self.planned

    def evaluate(self) -> float:
        return error_rate(self.model, self.x_test, self.y_test, autocast=self._eval_autocast)

    @property
    def _eval_autocast(self) -> torch.dtype | None:
        return torch.bfloat16 if self.cfg.train_bf16 else None

    def _record(self, position: float) -> float:
        """Evaluate (excluded from the wall-clock) and add a point to the curve (keeping the
        test outputs with ``keep_outputs``)."""
        sync(self.device)
        e0 = time.perf_counter()
        elapsed = self.clock + e0 - self._epoch_start - self._epoch_eval
        if self.keep is None:
            err = self.evaluate()
        else:
            logits = predict(self.model, self.x_test, autocast=self._eval_autocast)
            err = self.keep.evaluation(position, elapsed, logits, self.y_test)
        spent = time.perf_counter() - e0
        self._epoch_eval += spent
        self.run.eval_s += spent
        self.run.points.append(
            dict(
                position=position,
                time_s=elapsed,
                error=err,
                backprops=self.backprops,
                selections=self.loader.stats.total.selection_forwards,
            )
        )
        return err

    def train_epoch(self) -> None:
        """Train one epoch, evaluating every ``eval_every`` epochs of data and at the end."""
        if self.done:
            raise RuntimeError(f"{self.run.key()} has trained its {self.planned} epochs")
        cfg, loader, progress = self.cfg, self.loader, self.progress
        sync(self.device)  # work still queued (another run's, on a GPU) is not this run's
        self._epoch_eval = 0.0
        self._epoch_start = time.perf_counter()
        for batch in loader:
            x, y = batch
            if cfg.augment:
                x = augment(x, self.aug_gen, flip=cfg.dataset != "svhn")
            lr = cosine_lr(cfg.lr, self._schedule_position(), self.planned)
            for group in self.opt.param_groups:
                group["lr"] = lr
            losses = train_step(cfg, self.model, self.opt, x, y, batch.weights, self.timer)
            if self.strat.feedback:
                loader.feedback(batch.indices, losses)
            self.backprops += len(y)
            if self.keep is not None:
                self.keep.batch(self.epoch, batch.indices, batch.losses)
            # NOTE: the planned end is evaluated after the loop: a pooled loader's progress
            # reaches it when the last source batch is drawn, before the batches kept from it
            # are trained (up to a few hundred examples), so the final error would not be
            # the trained model's.
            # NOTE: the end is told by the loader's position, not by the next evaluation's: a
            # source batch larger than ``eval_every`` epochs of data (a small training set)
            # moves the position past several evaluation points at once, and the points it
            # skipped are skipped (one evaluation per position, never the same one twice).
            final = loader.progress >= self.planned - 1e-9
            if loader.progress + 1e-9 >= self.next_eval and not final:
                err = self._record(loader.progress)
                while self.next_eval <= loader.progress + 1e-9:
                    self.next_eval += cfg.eval_every
                if progress is not None:
                    st = loader.stats.current
                    assert st is not None  # an epoch is under way
                    progress.set_postfix(
                        epoch=f"{loader.progress:.1f}",
                        rate=f"{st.selection_rate:.2f}",
                        err=f"{100 * err:.2f}%",
                    )
            if progress is not None:  # hundredths of an epoch
                progress.update(int(100 * loader.progress) - progress.n)
        self.epoch += 1
        # The final state is always evaluated (also when eval_every does not divide the epochs).
        if self.done and self.run.points[-1]["position"] < self.planned - 1e-9:
            self._record(float(self.planned))
        sync(self.device)
        self.clock += time.perf_counter() - self._epoch_start - self._epoch_eval

    def _schedule_position(self) -> float:
        """Where the learning rate's schedule is [epochs]: the position in the data, or with
        ``lr_by_backprops`` the backprops so far as a share of the planned ones (at most 1),
        times the planned epochs."""
        if self._planned_backprops is None:
            return self.loader.progress
        return self.planned * min(1.0, self.backprops / self._planned_backprops)

    def _record_precision(self) -> None:
        """The run's selection precision as the loader has it now (an automatic int8 copy can
        fall back to a float precision on the first source batch)."""
        chosen = self.loader.autocast
        if self.loader.scorer.quantized is not None:
            self.run.selection_dtype = "int8"  # the loader's int8 copy; autocast stays None
        else:
            self.run.selection_dtype = "float32" if chosen is None else str(chosen).split(".")[-1]

    def finish(self) -> Run:
        """The run's record, once its planned epochs are trained."""
        if not self.done:
            raise RuntimeError(f"{self.run.key()} has {self.planned - self.epoch} epochs to go")
        run = self.run
        self._record_precision()
        run.final_error = run.points[-1]["error"]
        run.train_s = self.clock
        t = self.loader.stats.total
        fwd_s, bwd_s = self.timer.totals()
        # NOTE: on a GPU the loader's selection time also holds the wait for training work still
        # queued when a selection pass starts (it needs the losses on the host), so there the
        # breakdown's parts can exceed the wall-clock; "other" is what remains, at least 0.
        run.breakdown = dict(
            selection=t.selection_s,
            forward=fwd_s,
            backward=bwd_s,
            data=t.source_s,
            el2n=run.pre_cost.get("seconds", 0.0),
        )
        run.breakdown["other"] = max(0.0, run.train_s - sum(run.breakdown.values()))
        run.epochs = [e.as_dict() for e in self.loader.stats.epochs]
        run.diverged = collapsed(run)
        if self.keep is not None and self.x_train is not None:
            run.arrays = self.keep.finish(
                self.model, self.x_train, self.loader.policy, autocast=self._eval_autocast
            )
        return run

    def train(self) -> Run:
        """Every planned epoch, then the record."""
        while not self.done:
            self.train_epoch()
        return self.finish()


def run_one(
    cfg: Config, strat: Strategy, seed: int, noise: float, data: Data, progress: Any = None
) -> Run:
    """One run trained alone, start to end."""
    return Trainer(cfg, strat, seed, noise, data, progress).train()


def train_interleaved(
    trainers: Sequence[Trainer],
    on_epoch: Callable[[Trainer], None] | None = None,
    on_done: Callable[[Run], None] | None = None,
) -> list[Run]:
    """Train the runs an epoch each in turn (round-robin, each round starting one run further
    on) until each has its planned epochs, so that a busy spell of a shared machine falls on
    all of them alike. ``on_epoch`` is called
    after each epoch of a run, ``on_done`` with each run's record as it ends. Returns the
    records in the order of ``trainers``."""
    runs: dict[int, Run] = {}
    n, start = len(trainers), 0
    while len(runs) < n:
        # NOTE: each round starts one run further on: in a fixed order the runs named first
        # (Traditional's) took every round's first slot, and where a round's conditions change
        # as it goes (other processes starting, caches warming) that falls on them alike in
        # every round (measured: the first runs of round 1 at 0.7-0.8 ms per backpropagated
        # example, the later ones at 1.2-1.8 ms, in frontier_amx_1126).
        # NOTE: further on among the runs still training: rotating over every run's index, a
        # round whose start fell on an ended run began at the next one still training, so
        # once the short budgets had ended the same run took the first slot round after round
        # (the frontier preset: rounds 11-14 all in one order).
        order = [(start + k) % n for k in range(n) if (start + k) % n not in runs]
        for i in order:
            t = trainers[i]
            t.train_epoch()
            if on_epoch is not None:
                on_epoch(t)
            if t.done:
                runs[i] = t.finish()
                if on_done is not None:
                    on_done(runs[i])
        # the next round starts at the first run after this round's first still training
        start = next(
            ((order[0] + k) % n for k in range(1, n + 1) if (order[0] + k) % n not in runs), 0
        )
    return [runs[i] for i in range(len(trainers))]


def warm_up(cfg: Config, strats: Sequence[Strategy], data: Data) -> float:
    """Train each strategy once, every planned epoch, on a few source batches of data, untimed
    and thrown away; returns the seconds it took (reported beside the results, never counted in
    a run's wall-clock).

    NOTE (why): the first use of a code path in a process costs seconds that later uses do not:
    numba loading its compiled kernels, torch importing and preparing int8 quantization, oneDNN
    creating primitives for each shape. Trained interleaved, whichever run reaches such a path
    first paid it alone: in the ``quick`` preset at b46e851, the recipe over 3 epochs spent 5.1 s
    of its first selective epoch outside its selection forwards, the recipe runs after it 0.03 s.
    Warming every configuration up first excludes these one-time costs from every run alike (as
    airbench excludes its compile warm-up). Each warm-up run draws its model from its own seed
    and no run's randomness is shared (see :class:`Trainer`), so the timed runs train exactly as
    without it.
    """
    x_train, y_train, x_test, y_test = data
    t0 = time.perf_counter()
    for strat in strats:
        # NOTE: two of the strategy's own source batches (a ``_pool4096`` variant's are wider
        # than the configuration's), so that its first use of that shape is the warm-up's too.
        pool = strat.source_batch(cfg.pool_batch_size, cfg.batch_size)
        n = min(2 * max(pool, cfg.batch_size), len(x_train))
        small = (x_train[:n], y_train[:n], x_test[: cfg.batch_size], y_test[: cfg.batch_size])
        Trainer(cfg, strat, 0, 0.0, small).train()
    return time.perf_counter() - t0
