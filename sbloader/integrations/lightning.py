"""Lightning: a SelectiveLoader as a LightningModule's training loader, checkpointed exactly.

Two pieces, both needed:

- :func:`selective_loader`, called in ``train_dataloader``: builds the
  :class:`~sbloader.SelectiveLoader` over your source DataLoader, scoring with the module (or a
  submodule you pass), with the selection results inside each batch (``metadata_key="sb"``), so
  that they survive Lightning's device transfer.
- :class:`SelectiveLoaderCallback`, in ``Trainer(callbacks=[...])`` (or returned by the module's
  ``configure_callbacks``): saves the loader's state with every checkpoint and restores it when
  the loader is built again from ``fit(ckpt_path=...)``.

Why a callback: Lightning saves a loader's ``state_dict()`` but restores it only when it resumes
in the middle of an epoch (so a run resumed from an end-of-epoch checkpoint would restart the
loader at epoch 0: its warm-up again, its carried examples lost), and it fetches one batch ahead
of the training step (so the loader's own state at a mid-epoch checkpoint is one batch past what
was trained). The callback counts the batches Lightning hands to ``training_step`` and saves the
state the last of them was trained from (``SelectiveLoader.state_dict(unconsumed=1)``): the
batch fetched ahead is handed out again, as it was, by the resumed run. A resumed run then trains
on exactly the examples the uninterrupted run did, at any checkpoint.

Under DDP every rank saves its own loader state (gathered into the checkpoint that rank 0
writes); each rank's source needs a ``DistributedSampler`` (checked).

Example:
    >>> import lightning.pytorch as pl
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> import sbloader
    >>> from sbloader.integrations.lightning import SelectiveLoaderCallback, selective_loader
    >>> class Classifier(pl.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = nn.Linear(4, 3)
    ...         self.seen = []
    ...     def forward(self, x):
    ...         return self.net(x)
    ...     def train_dataloader(self):
    ...         data = TensorDataset(torch.randn(96, 4), torch.randint(0, 3, (96,)))
    ...         source = DataLoader(data, batch_size=32, shuffle=True,
    ...                             generator=torch.Generator().manual_seed(0))
    ...         return selective_loader(self, source, policy=sbloader.SelectiveBackprop(0.5),
    ...                                 batch_size=8, seed=0)
    ...     def training_step(self, batch, batch_idx):
    ...         x, y, sb = batch  # sb: indices, losses, probabilities, weights
    ...         self.seen.append(sb["indices"])
    ...         return (F.cross_entropy(self(x), y, reduction="none") * sb["weights"]).mean()
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> module = Classifier()
    >>> trainer = pl.Trainer(max_epochs=2, callbacks=[SelectiveLoaderCallback()],
    ...                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
    ...                      enable_model_summary=False, accelerator="cpu")
    >>> trainer.fit(module)
    >>> all(len(i) == 8 for i in module.seen), trainer.train_dataloader.loader.epoch
    (True, 2)
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from .._state import check_version, unsaved_states
from ..epoch import MAX_UNCONSUMED, EpochIterator
from ..length import FixedEpochIterator
from ..loader import SelectiveLoader
from ..policies import Phased, passes_within, plan_batches

__all__ = ["LightningLoader", "SelectiveLoaderCallback", "selective_loader"]

_S = TypeVar("_S", dict[str, Any], dict[str, Any] | None)

#: The version of the callback's checkpoint state (2: ``"next"``, the states that start the next
#: epoch of a run stopped part-way through one; version 1 states are read as having none).
STATE_VERSION = 2


class LightningLoader:
    """What :func:`selective_loader` returns to Lightning: the loader, as Lightning iterates it.

    Counts the batches Lightning fetches in the current epoch (``fetched``) against those the
    callback saw handed to ``training_step`` (``trained``), so that a checkpoint saves the state
    the last trained batch came from. ``len()`` is the loader's.

    Attributes:
        loader: the :class:`~sbloader.SelectiveLoader` (its ``stats``, ``epoch``, ``progress``).
        fetched: batches Lightning fetched from the current epoch's iterator.
        trained: batches of those handed to ``training_step``.

    Example:
        Lightning fetches a batch ahead of ``training_step``; the state saved is the one the
        last trained batch came from, so a resumed loader hands the batch fetched ahead out
        again:

        >>> from torch.utils.data import TensorDataset
        >>> import sbloader
        >>> data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
        >>> source = DataLoader(data, batch_size=4)
        >>> wrapped = LightningLoader(
        ...     SelectiveLoader(source, nn.Linear(4, 3), policy=sbloader.Traditional()))
        >>> batches = iter(wrapped)
        >>> first, ahead = next(batches), next(batches)
        >>> wrapped.trained = 1  # as SelectiveLoaderCallback counts training_step's batches
        >>> again = SelectiveLoader(source, nn.Linear(4, 3), policy=sbloader.Traditional())
        >>> again.load_state_dict(wrapped.saved_state())
        >>> next(iter(again)).indices.tolist(), ahead.indices.tolist()
        ([4, 5, 6, 7], [4, 5, 6, 7])
    """

    def __init__(self, loader: SelectiveLoader) -> None:
        if not isinstance(loader, SelectiveLoader):
            raise TypeError(
                "LightningLoader wraps a sbloader.SelectiveLoader, but got "
                f"{type(loader).__name__}; return selective_loader(self, source, ...) from "
                "train_dataloader"
            )
        self.loader = loader
        self.fetched = self.trained = 0
        self._epoch: EpochIterator | FixedEpochIterator | None = None
        self._state: dict[str, Any] | None = None  # restored, loaded when iterated first
        # With _state of an epoch Lightning stopped part-way: the state that starts the next
        # epoch instead, which a run restored from it loads where Lightning does not go on with
        # the stopped epoch (_new_epoch; see SelectiveLoaderCallback._attach).
        self._next_state: dict[str, Any] | None = None
        self._new_epoch = False
        self._restored = False
        self._untrained: list[Any] = []  # batches fetched before the epoch's first trained one
        self._again: list[Any] = []  # of those, the ones to hand out again

    def __iter__(self) -> LightningLoader:
        epoch = self._epoch
        if epoch is not None and epoch.running and self.fetched and not self.trained:
            # NOTE: Lightning iterates a loader again before training on the batch it fetched
            # ahead (a loader rebuilt by reload_dataloaders_every_n_epochs is iterated in
            # setup_data and again when its epoch starts): the epoch goes on, and the batches
            # fetched ahead are handed out again, where a new epoch would abandon this one.
            self._again, self._untrained = self._untrained, []
            self.fetched = 0
            return self
        self._untrained, self._again = [], []
        if self._state is not None:
            # NOTE: loaded here, not when built: Lightning may build the loader before it moves
            # the model to its device (estimated_stepping_batches in configure_optimizers), and
            # the restored rows go to the model's device.
            state = self._state
            if self._new_epoch and self._next_state is not None:
                state = self._next_state
            self._state = self._next_state = None
            self._new_epoch = False
            self.loader.load_state_dict(state)
        # (without a len(), Lightning fetches past an epoch's last batch before training on it)
        self.loader.keep_ended_state(_length(self.loader) is None)
        self._epoch = iter(self.loader)
        self.fetched = self.trained = 0
        return self

    def __next__(self) -> Any:
        if self._epoch is None:
            raise StopIteration
        batch = self._again.pop(0) if self._again else next(self._epoch)
        self.fetched += 1
        if not self.trained:
            self._untrained.append(batch)
        elif self._untrained:
            self._untrained = []
        return batch

    def __len__(self) -> int:
        return len(self.loader)

    def feedback(self, indices: Any, losses: Any) -> None:
        """Report ``training_step``'s per-example losses to the loader (see
        :meth:`SelectiveLoader.feedback <sbloader.SelectiveLoader.feedback>`):
        ``self.trainer.train_dataloader.feedback(sb["indices"], losses)``."""
        self.loader.feedback(indices, losses)

    def saved_state(self, interrupted: bool = False) -> dict[str, Any]:
        """The loader's state as of the last batch handed to ``training_step``; with
        ``interrupted``, as of the one before it (an exception interrupted the step on it, and
        Lightning resumes there), where :meth:`resumes_interrupted` says it can."""
        if self._state is not None:
            return self._state  # restored and not iterated yet: nothing has changed
        ended = self._ended_last() if interrupted else None
        if ended is not None:
            return ended
        return self.loader.state_dict(unconsumed=self._unconsumed(interrupted))

    def _ended_last(self) -> dict[str, Any] | None:
        """Where the batch in ``training_step`` is the last of a loader epoch that has ended
        (Lightning fetched past it), the state that takes it back (see
        :meth:`SelectiveLoader.keep_ended_state <sbloader.SelectiveLoader.keep_ended_state>`)."""
        epoch = self._epoch
        ended = epoch is not None and not epoch.running and not self.loader.takes_back()
        if ended and self.trained and self.fetched == self.trained:
            return self.loader.ended_state
        return None

    def resumes_interrupted(self) -> bool:
        """Whether a state saved now can take back the batch an exception interrupted
        ``training_step`` on, with the one fetched ahead (see
        :meth:`SelectiveLoader.takes_back <sbloader.SelectiveLoader.takes_back>`)."""
        untrained = self._unconsumed()
        return (
            self._state is not None
            or (untrained + 1 <= MAX_UNCONSUMED and self.loader.takes_back(untrained + 1))
            or self._ended_last() is not None
        )

    def _unconsumed(self, interrupted: bool = False) -> int:
        """The batches a state saved now takes back: those fetched ahead of ``training_step``,
        and with ``interrupted`` the one it was interrupted on (where possible)."""
        # NOTE: an exception in a selection pass (fetching ahead: the batch before it fetched,
        # not trained) closes the epoch, left part-way; without batches_per_epoch such an epoch
        # still takes back its last batch, which Lightning resumes at. Saved with unconsumed=0
        # (OnExceptionCheckpoint), the resumed run skipped that batch, unsaid.
        running = self._epoch is not None and (self._epoch.running or self.loader.takes_back())
        untrained = self.fetched - self.trained if running else 0
        if interrupted and self.resumes_interrupted():
            return untrained + 1
        return untrained

    def end_epoch(self, stopped: bool = False) -> None:
        """Lightning ended its epoch: end the loader's too, as a plain loop would.

        Lightning stops asking for batches after ``len()`` of them when the loader has a length,
        and early with ``limit_train_batches``, ``max_steps`` or a hook returning -1; the
        loader's epoch then has not seen its end. After exactly ``len()`` batches the end of
        epoch runs now (what the next ``next()`` of a plain loop does: the remainder, the
        stats); otherwise the epoch is abandoned, so that a checkpoint saved now resumes at the
        next epoch, as the uninterrupted run goes on; unless Lightning stopped the run there.

        Args:
            stopped: Lightning stopped the run part-way through the epoch (``max_steps``
                reached, or ``trainer.should_stop``: ``max_time``, ``EarlyStopping``). A run
                resumed from a checkpoint saved then goes on with the rest of this epoch where
                Lightning does (it counts steps: ``max_steps`` given to the resumed Trainer),
                and starts the next epoch where Lightning does (a Trainer of ``max_epochs``
                alone), so both are kept: the epoch as of the last batch trained (also for
                ``fit`` again in this process), and the state with the epoch ended there, as
                an epoch cut short ends (see :meth:`next_state`).
        """
        epoch = self._epoch
        if epoch is None or not epoch.running:
            return
        if stopped and self.trained:
            # NOTE: Lightning resumes such an epoch where it stopped when its resumed Trainer
            # counts steps (max_steps), so abandoning it made that run start a new pass there:
            # the rest of this pass never trained, and the epochs counted one pass apart. A
            # Trainer of max_epochs alone starts the next epoch instead, which the kept epoch
            # gave only its rest: one pass behind Lightning's epochs to the end of the run (the
            # default policy's annealed pass never came), unsaid. Which one the resumed run
            # takes is known only when it restores the checkpoint: both are saved, and share
            # the store's columns (one snapshot of a store_path store: with store_snapshots=1
            # the second snapshot removed the first, and a resume of the epoch was refused).
            # Their snapshot is a checkpoint's just saved at this step where there is one, and
            # else removes no older one (see _state.unsaved_states): no checkpoint may follow.
            with unsaved_states():
                self._state = self.saved_state()
                epoch.close(resumable=False)  # (as an epoch Lightning cuts short ends)
                self._next_state = self.loader.state_dict()
            return
        if not self.trained:
            # NOTE: nothing of this epoch was trained on: Lightning ends, on resuming, an epoch
            # whose loader epoch ended before the checkpoint (one saved when validation ended at
            # its last batch), after fetching the next epoch's first batch. That epoch goes on,
            # its batch handed out again when Lightning iterates the loader for the next epoch.
            return
        length = _length(self.loader)
        # NOTE: counted over the whole training epoch (restored with a mid-epoch state), not
        # since this iterator started: a resumed epoch must end as the uninterrupted one did.
        # (Whether it ends or is abandoned changes what the source draws next: a torch
        # RandomSampler draws again from its generator when it is exhausted.) With
        # batches_per_epoch, the training epoch's batches, not its current pass's.
        if length is None or self.loader.batches_yielded < length:
            epoch.close(resumable=False)
            return
        extra = next(epoch, None)
        if extra is not None:
            raise RuntimeError(
                f"the loader handed out more than len(loader)={length} batches in an epoch, so "
                "Lightning (which stops after len() batches) would skip one; this is a bug in "
                "the loader's len()"
            )

    def next_state(self) -> dict[str, Any] | None:
        """Where Lightning stopped the run part-way through an epoch (see :meth:`end_epoch`):
        the state with that epoch ended as of the last batch trained, which a run restored from
        a checkpoint saved then loads where Lightning starts the next epoch; else None."""
        return self._next_state

    # NOTE: the two methods below make Lightning treat the loader as resumable (without them,
    # resuming a loader with a len() mid-epoch, it warns that the loader is not). The state
    # itself is the callback's; Lightning's copy is only a marker, checked when Lightning
    # restores a mid-epoch loader.
    def state_dict(self) -> dict[str, Any]:
        return {"saved_by": "SelectiveLoaderCallback"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self._restored:
            raise RuntimeError(
                "Lightning is resuming this loader in the middle of an epoch, but the checkpoint "
                "holds no SelectiveLoaderCallback state for it; resume from a checkpoint saved "
                "with the callback in Trainer(callbacks=[...])"
            )


class SelectiveLoaderCallback(pl.Callback):
    """Saves the SelectiveLoader's state with every checkpoint and restores it on resume.

    Add one to ``Trainer(callbacks=[...])`` (or return it from the module's
    ``configure_callbacks``) and build the loader with :func:`selective_loader`. Its checkpoint
    state (under ``checkpoint["callbacks"]["SelectiveLoaderCallback"]``) holds each rank's loader
    state as of the last batch handed to ``training_step`` (``"ranks"``) and, where Lightning
    stopped the run part-way through an epoch, each rank's state with that epoch ended there
    (``"next"``, else None), which a resumed run loads where Lightning starts the next epoch
    (see :meth:`LightningLoader.end_epoch`). One callback per training run: a
    loader built again by the same callback (``reload_dataloaders_every_n_epochs``) carries on
    from the previous one's state.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> class Module(pl.LightningModule):
        ...     def training_step(self, batch, batch_idx):
        ...         pass
        >>> callback = SelectiveLoaderCallback()
        >>> callback.loader, callback.state_dict()  # no loader built yet: nothing to save
        (None, {})
        >>> module = Module()
        >>> module.trainer = pl.Trainer(callbacks=[callback], logger=False, accelerator="cpu")
        >>> data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
        >>> loader = selective_loader(module, DataLoader(data, batch_size=4), nn.Linear(4, 3),
        ...                           batch_size=2)
        >>> callback.loader is loader
        True
        >>> state = callback.state_dict()  # what a checkpoint holds: one state per rank
        >>> state["version"], len(state["ranks"]), state["ranks"][0]["epoch"], state["next"]
        (2, 1, 0, None)
    """

    def __init__(self) -> None:
        self._loader: LightningLoader | None = None
        self._restored: list[dict[str, Any]] | None = None
        self._restored_next: list[dict[str, Any] | None] | None = None
        # Whether Lightning goes on with the restored checkpoint's epoch (see on_load_checkpoint)
        self._resumes: bool | None = None
        self._in_step = False  # between on_train_batch_start and on_train_batch_end
        self._interrupted = False  # an exception interrupted a batch's training step
        # Lightning's setup of fit (configure_optimizers), before on_fit_start: a loader built
        # then is built for Trainer.estimated_stepping_batches (see _warn_no_estimate)
        self._setting_up = False

    @property
    def loader(self) -> LightningLoader | None:
        """The loader built by :func:`selective_loader` for this run, or None before."""
        return self._loader

    def _attach(
        self, wrapper: LightningLoader, rank: int, world_size: int, new_epoch: bool = False
    ) -> None:
        """Hand ``wrapper`` the state it goes on from: the restored one (``new_epoch``: where
        Lightning starts the next epoch of the checkpoint's, that of a run stopped part-way
        through it, where saved), or the previous loader's of this run."""
        previous, self._loader = self._loader, wrapper
        if self._restored is not None:
            states, self._restored = self._restored, None
            nexts, self._restored_next = self._restored_next, None
            if len(states) != world_size:
                raise ValueError(
                    f"the checkpoint holds the loader states of {len(states)} processes, but "
                    f"this run has {world_size}; resume with as many processes as were saved"
                )
            wrapper._state, wrapper._restored = states[rank], True
            wrapper._next_state = None if nexts is None else nexts[rank]
            wrapper._new_epoch = new_epoch if self._resumes is None else not self._resumes
            self._resumes = None
        elif previous is not None:
            wrapper._state = previous.saved_state()
            wrapper._next_state = previous.next_state()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._setting_up = stage == "fit"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._setting_up = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._setting_up = False  # (an exception in the setup)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # NOTE: read from the checkpoint, as Lightning will decide it, not from its fit loop:
        # a loader built before Lightning restores its loops (estimated_stepping_batches in
        # configure_optimizers builds it) found the fit loop not restarting, and a run stopped
        # by max_steps, resumed with max_steps, started the next epoch where Lightning went on.
        self._resumes = _resumes_saved_epoch(trainer, checkpoint)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._interrupted = False
        if self._loader is not None:
            self._loader.trained += 1
            self._in_step = True

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # NOTE: an epoch that Lightning stops by count (the loader's len(), limit_train_batches)
        # ends here, before ModelCheckpoint(every_n_train_steps=...) saves after this batch
        # (Lightning runs checkpoint callbacks last): Lightning resumes such a checkpoint at the
        # next epoch, so the state saved must be the ended epoch's, not one still to be ended.
        self._in_step = False
        if self._loader is not None and batch_idx + 1 >= trainer.num_training_batches:
            self._loader.end_epoch()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._in_step = False  # (a batch at which on_train_batch_start returned -1)
        if self._loader is None:
            return
        # (Lightning's own rule: an epoch whose batches ran out, by count or by the loader's
        # end, resumes at the next epoch; one stopped before that resumes where it stopped)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        ran_out = progress.is_last_batch or progress.current.ready >= trainer.num_training_batches
        max_steps = trainer.max_steps
        stopped = trainer.should_stop or (max_steps != -1 and trainer.global_step >= max_steps)
        self._loader.end_epoch(stopped=stopped and not ran_out)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # NOTE: an exception in training_step, its backward or its optimizer step (a
        # KeyboardInterrupt, an out-of-memory error) leaves its batch untrained, and Lightning
        # resumes a checkpoint saved then (OnExceptionCheckpoint, or trainer.save_checkpoint
        # after fit raised) at that batch; but the loader had handed out the next one too.
        # A state taking back only that one made the resumed run skip the interrupted batch,
        # unsaid; it takes back both (see state_dict). Lightning runs this hook before
        # OnExceptionCheckpoint's: it puts checkpoint callbacks last.
        self._interrupted, self._in_step = self._in_step, False

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Warn where the checkpoint is saved between optimizer steps of gradient accumulation
        (``accumulate_grad_batches``), as :class:`~sbloader.integrations.accelerate.
        AcceleratedLoader` does: the gradients accumulated since the last step are in no
        checkpoint, so a run resumed from it trains the same batches with other weights and
        soon selects other examples; and where it is saved as the last batch of an epoch of a
        loader without ``len()`` ends, which Lightning resumes with the optimizer steps falling
        on other batches (see :func:`_restarts_counting_on`)."""
        n = trainer.accumulate_grad_batches
        # (while fitting: a checkpoint saved as validation ends comes in the validation stage)
        if self._loader is None or n <= 1 or trainer.state.fn != "fit":
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress
        # (Lightning's own rule: the optimizer steps after every n-th batch and the last one)
        if progress.current.ready % n and not progress.is_last_batch:
            warnings.warn(
                "the SelectiveLoaderCallback's state is saved between optimizer steps "
                f"(accumulate_grad_batches={n}, {progress.current.ready % n} batches accumulated "
                "since the last step): those gradients are in no checkpoint, so a run resumed "
                "from it will not train as the uninterrupted one does; save where the optimizer "
                "steps (ModelCheckpoint(every_n_train_steps=...) does; a val_check_interval "
                "that is a multiple of accumulate_grad_batches too)",
                UserWarning,
                stacklevel=2,
            )
        elif progress.current.ready % n and _restarts_counting_on(trainer):
            warnings.warn(
                "the SelectiveLoaderCallback's state is saved as the last batch of an epoch "
                f"ends, for a loader without len() (accumulate_grad_batches={n}): Lightning "
                "resumes such a checkpoint with the next epoch's batches counted on from this "
                f"epoch's (batch_idx {progress.current.ready}, not 0), so its optimizer steps "
                "fall on other batches and a run resumed from it will not train as the "
                'uninterrupted one does; pass batches_per_epoch="expected" to '
                "selective_loader (a len(), by which Lightning counts the next epoch from 0), or "
                "resume from a checkpoint saved at an epoch's end (ModelCheckpoint("
                "every_n_epochs=1)) or at another step",
                UserWarning,
                stacklevel=2,
            )

    def state_dict(self) -> dict[str, Any]:
        nexts: list[dict[str, Any] | None] | None
        if self._loader is None:
            if self._restored is None:
                return {}
            states = self._restored  # restored, and the loader not built yet
            nexts = self._restored_next
        else:
            if self._interrupted and not self._loader.resumes_interrupted():
                warnings.warn(
                    "the SelectiveLoaderCallback's state is saved after an exception "
                    "interrupted a training step: Lightning resumes at the interrupted batch, "
                    "but the loader cannot take it back (a pass of batches_per_epoch began "
                    "after it, it was the source's own reused buffers, or it was an epoch's "
                    "last and the policy's store_path keeps no state as an epoch ends), so a "
                    "run resumed from this checkpoint never trains the interrupted batch's "
                    "examples and does not train as the uninterrupted one does; for an exact "
                    "resume, resume from the last checkpoint saved before the exception "
                    "(ModelCheckpoint)",
                    UserWarning,
                    stacklevel=2,
                )
            own = self._loader.saved_state(interrupted=self._interrupted)
            own_next = self._loader.next_state()
            for saved in (own, own_next):  # (a stop's: their snapshot is a checkpoint's now)
                if saved is not None:
                    self._loader.loader.keep_saved_files(saved)
            states = _gather(own)
            gathered = _gather(own_next)
            nexts = None if all(n is None for n in gathered) else gathered
        return {"version": STATE_VERSION, "ranks": states, "next": nexts}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = check_version(
            state_dict, "SelectiveLoaderCallback", STATE_VERSION, {1: _next_states_added}
        )
        self._restored = list(state["ranks"])
        nexts = state["next"]
        if nexts is not None and len(nexts) != len(self._restored):
            raise ValueError(
                f"the SelectiveLoaderCallback state holds {len(self._restored)} processes' "
                f"loader states but {len(nexts)} of the next epoch's; resume from a checkpoint "
                "the callback saved whole"
            )
        self._restored_next = None if nexts is None else list(nexts)


def _next_states_added(state: dict[str, Any]) -> dict[str, Any]:
    """A version-1 callback state as version 2: no state of a next epoch (version 1 saved the
    stopped epoch alone)."""
    return {**state, "version": 2, "next": None}


def _restarts_counting_on(trainer: pl.Trainer) -> bool:
    """Whether a checkpoint saved now is one that Lightning resumes with the next epoch's batch
    count going on from this epoch's: saved after the last batch's training step, before
    Lightning counts it completed (``ModelCheckpoint(every_n_train_steps=...)``), of a loader
    without ``len()``.

    NOTE: Lightning's training epoch loop, restarting from such a checkpoint, starts its epoch
    counts anew only where they reach ``num_training_batches``, which is infinite without a
    ``len()``: it starts the next epoch at ``batch_idx`` one past this epoch's last, and with
    ``accumulate_grad_batches`` (of which this epoch's count is not a multiple) steps the
    optimizer on other batches than the uninterrupted run (a probe: 7 batches an epoch,
    accumulating 2, resumed at the next epoch's batch_idx 7, stepped after its first batch
    alone), so the resumed run diverged from the uninterrupted one, unsaid.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    current = progress.current  # (a _ProcessedTracker, typed as the tracker it extends)
    processed: int = current.processed  # type: ignore[attr-defined]
    return (
        trainer.num_training_batches == float("inf")
        and progress.is_last_batch
        and current.completed == processed - 1
    )


def _resumes_saved_epoch(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool | None:
    """Whether Lightning, restoring ``checkpoint``, goes on with the epoch it was saved in, by
    its own rule (see :func:`_resumes_epoch`) applied to the checkpoint's epoch progress; None
    where the checkpoint holds none."""
    try:
        current = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]
        ready, started, processed = current["ready"], current["started"], current["processed"]
    except (KeyError, TypeError):
        return None
    return ready != processed or started != processed or trainer.max_steps != -1


def _resumes_epoch(trainer: pl.Trainer) -> bool:
    """Whether Lightning, having restored a checkpoint, goes on with the epoch it was saved in.

    NOTE: Lightning's own rule (its fit loop's ``restarting``, set when the loops' progress is
    restored): the saved epoch's progress counts say it did not finish, or the resumed
    Trainer counts steps (``max_steps``); an epoch stopped part-way by ``should_stop`` or
    ``max_steps`` counts as finished, so a Trainer of ``max_epochs`` alone starts the next one.
    """
    return bool(trainer.fit_loop.restarting)


def _length(loader: SelectiveLoader) -> int | None:
    """``len(loader)``, or None where the loader has none (Lightning stops after that many
    batches; without one it fetches past an epoch's last batch)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _gather(state: _S) -> list[_S]:
    """Every rank's state, in rank order (a collective under DDP: Lightning saves checkpoints on
    every rank, and only rank 0 writes the file)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def _trained_batches(trainer: pl.Trainer, epochs: int, length: int) -> int:
    """The batches a Trainer's run trains on: ``epochs`` epochs of ``length`` batches, each cut
    to ``limit_train_batches`` and the run to ``max_steps`` optimizer steps (of
    ``accumulate_grad_batches`` batches, and one more at each epoch's end), as Lightning counts
    them (its ``estimated_stepping_batches``, in batches)."""
    limit = trainer.limit_train_batches
    per = min(length, limit) if isinstance(limit, int) else int(length * limit)
    total = epochs * per
    max_steps, accumulate = trainer.max_steps, trainer.accumulate_grad_batches
    if max_steps != -1 and per > 0:
        full, rest = divmod(max_steps, math.ceil(per / accumulate))
        total = min(total, full * per + min(per, rest * accumulate))
    return total


def _planned_epochs_fix(fits: int | None, least: int, what: str) -> str:
    """The fix a short-run warning names: ``planned_epochs=fits`` (``what`` they are) where at
    least ``least`` fit, else a policy without annealing."""
    if fits is not None and fits >= least:
        return f"pass planned_epochs={fits} to selective_loader ({what})"
    return "pass a policy without annealing (e.g. policy=sbloader.default_policy())"


def _convert_as_trained(trainer: pl.Trainer, options: dict[str, Any]) -> None:
    """Have the selection passes convert their inputs as the Trainer's precision plugin
    converts ``training_step``'s (``convert_inputs=`` its ``convert_input``), where it converts
    any (a true precision: ``"bf16-true"``, ``"16-true"``, ``"64-true"``, ...); unless
    ``convert_inputs`` is given.

    NOTE: under a true precision Lightning converts the module's parameters and, for
    ``training_step`` alone, the batch's floating-point tensors; the loader's own selection
    pass over the source's float32 batches failed on its first forward with torch's "mat1 and
    mat2 must have the same dtype", before any training. Yielded batches are left as the source
    made them: Lightning converts them for ``training_step``. The plugin's ``forward_context``
    (``torch.set_default_dtype``, process-wide) is not entered: a selection pass may run on a
    thread beside the training step (``overlap_selection``); a forward that makes
    floating-point tensors of the default dtype should make them in its inputs' dtype. Mixed
    precision converts nothing (autocast; the selection pass's precision is ``autocast=``).
    """
    plugin = trainer.precision_plugin
    if type(plugin).convert_input is pl.plugins.Precision.convert_input:
        return
    options.setdefault("convert_inputs", plugin.convert_input)


def _check_training_stage(trainer: pl.Trainer) -> None:
    """Refuse a ``selective_loader`` built for the Trainer's validation, test or prediction
    loaders (``val_dataloader``, ``test_dataloader``, ``predict_dataloader``, the sanity check).

    NOTE: one returned from ``val_dataloader`` was taken: validation saw only the examples the
    policy selected (half of them under ``SelectiveBackprop(0.5)``), and the callback, which
    keeps one loader per run, attached the new one in the training loader's place: it went on
    from the training loader's state, and checkpoints saved its state instead, unsaid.
    """
    if not (trainer.evaluating or trainer.predicting):
        return
    stage = trainer.state.stage.value if trainer.state.stage is not None else None
    raise ValueError(
        f"selective_loader builds the training loader, but the Trainer is in its {stage!r} "
        "stage (it was called from val_dataloader, test_dataloader or predict_dataloader, or "
        "for the sanity check): return it from "
        "train_dataloader only, and a plain DataLoader from the others, which must see every "
        "example"
    )


def _check_fractions(trainer: pl.Trainer, loader: SelectiveLoader) -> None:
    """Refuse a Trainer whose fractions of an epoch (``limit_train_batches``,
    ``val_check_interval``) need the loader's ``len()``, which a selective loader without
    ``batches_per_epoch`` does not have.

    NOTE: Lightning refuses them too, but only in ``fit``, saying "When using an
    IterableDataset", of a source that is a map-style dataset: the fix (``batches_per_epoch``)
    was nowhere to be read.
    """
    try:
        len(loader)
        return
    except TypeError:
        pass
    for name in ("limit_train_batches", "val_check_interval"):
        value = getattr(trainer, name)
        if isinstance(value, float) and value != 1.0:
            raise ValueError(
                f"{name} should be an int or 1.0 for a selective loader without len() (its "
                f"batches per epoch are random), but got Trainer({name}={value!r}); pass "
                'batches_per_epoch="expected" to selective_loader for epochs of a fixed number '
                f"of batches, or an int {name}"
            )


def _warn_short_run(trainer: pl.Trainer, epochs: int, length: int) -> None:
    """Warn where ``planned_epochs=max_epochs`` (training epochs of ``length`` batches, with
    ``batches_per_epoch``) plans the default policy's anneal for more batches than the Trainer
    trains on (``limit_train_batches``, ``max_steps``), naming the ``planned_epochs`` to pass.

    NOTE: without ``batches_per_epoch`` each Lightning epoch is one pass over the data, cut
    short or not, so the plan's passes are the run's; with it the stream of batches goes on
    from one Lightning epoch to the next, and a run of fewer batches than planned ended before
    its annealed pass began: the default recipe without its anneal, unsaid.
    """
    trained = _trained_batches(trainer, epochs, length)
    if not trained or trained >= epochs * length:
        return
    fix = _planned_epochs_fix(
        trained // length, 2, "the epochs of len(loader) batches the run trains on"
    )
    warnings.warn(
        f"the Trainer trains on {trained} batches (limit_train_batches="
        f"{trainer.limit_train_batches!r}, max_steps={trainer.max_steps}), fewer than the "
        f"max_epochs={epochs} epochs of len(loader)={length} batches ({epochs * length}) that "
        "the default policy's anneal is planned for (planned_epochs=max_epochs), so the run "
        f"ends before its annealed pass on all the data; {fix}",
        UserWarning,
        stacklevel=3,
    )


def _pass_batches(trainer: pl.Trainer, loader: SelectiveLoader) -> tuple[float, float] | None:
    """The batches a pass over the data is expected to train on, at the policy's steady rate
    and on all the data, each cut to the Trainer's ``limit_train_batches``; None for a source
    whose pass cannot be counted."""
    try:
        steady = loader.expected_batches(loader.policy.steady_rate)
        full = loader.expected_batches(1.0)
    except TypeError:
        return None
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        return min(steady, limit), min(full, limit)
    if isinstance(limit, float):
        return steady * limit, full * limit
    return steady, full


def _warn_steps_before_anneal(trainer: pl.Trainer, loader: SelectiveLoader) -> None:
    """Warn where ``planned_epochs=max_epochs`` without ``batches_per_epoch`` (each Lightning
    epoch one pass over the data) plans the default policy's anneal for more batches than a
    ``max_steps`` that comes first lets the Trainer train on, naming the ``planned_epochs=``
    to pass.

    NOTE: without ``batches_per_epoch`` a Lightning epoch is one pass, cut to
    ``limit_train_batches`` or not, so ``limit_train_batches`` alone still reaches the planned
    passes; ``max_steps`` ends the run after that many optimizer steps, whatever the epoch, and
    a run that stopped before its annealed passes was the default recipe without its anneal,
    unsaid. The passes' batches are expected counts (a selective pass keeps a random number):
    the run is compared with the plan's expected batches, as ``passes_within`` plans them.
    """
    max_steps, policy = trainer.max_steps, loader.policy
    if max_steps == -1 or not isinstance(policy, Phased) or policy.anneal_from_epoch is None:
        return
    counted = _pass_batches(trainer, loader)
    if counted is None:  # (a source whose pass cannot be counted: nothing to compare with)
        return
    steady, full = counted
    epochs, anneal = loader.planned_epochs or 0, policy.anneal_from_epoch
    planned = plan_batches(epochs, anneal, steady, full)
    trained = max_steps * trainer.accumulate_grad_batches
    if not steady or trained >= planned * (1 - 1e-9):
        return
    fix = _planned_epochs_fix(
        passes_within(trained, steady, full),
        3,
        f"the passes over the data that {trained} batches are expected to make",
    )
    warnings.warn(
        f"the Trainer stops after max_steps={max_steps} optimizer steps (about {trained} "
        f"batches), before the max_epochs={epochs} passes over the data (about "
        f"{planned:.0f} batches) that the default policy's anneal is planned for "
        "(planned_epochs=max_epochs): its annealed passes on all the data begin after about "
        f"{anneal * steady:.0f} batches, so the run ends before they do; {fix}",
        UserWarning,
        stacklevel=3,
    )


def _warn_unestimated_steps(trainer: pl.Trainer, loader: SelectiveLoader) -> None:
    """Warn where a Trainer's ``estimated_stepping_batches`` will read ``max_steps`` for a
    loader without ``len()``, though its ``max_epochs`` passes over the data are expected to
    end the run before that many steps.

    NOTE: without a length Lightning cannot count an epoch's batches, so it estimates the run
    as ``max_steps`` whatever ``max_epochs`` says (with a length it takes the smaller). A
    schedule sized by that estimate (``OneCycleLR(total_steps=...)``) was cut short when the
    epochs ended first, unsaid: a probe's run of 3 epochs and ``max_steps=40`` stopped after
    34 steps, its learning rate never annealed. The expectation is the policy's (a selective
    pass keeps a random number of batches), as :func:`~sbloader.policies.plan_batches` plans
    the default policy's anneal; a source whose pass cannot be counted is not warned of.
    """
    max_steps, epochs = trainer.max_steps, trainer.max_epochs
    if max_steps == -1 or _length(loader) is not None:
        return
    steps = _expected_steps(trainer, loader)
    if steps is None or steps >= max_steps:
        return
    warnings.warn(
        f"Trainer.estimated_stepping_batches will read max_steps={max_steps} for this loader, "
        "which has no len() (each pass keeps a random number of batches), but its "
        f"max_epochs={epochs} passes over the data are expected to make about {steps:.0f} "
        "optimizer steps, so the run is expected to end before max_steps and a schedule sized "
        "by estimated_stepping_batches (e.g. OneCycleLR(total_steps=...)) before its end; pass "
        'batches_per_epoch="expected" to selective_loader for a len() that Lightning counts '
        f"the run by, or a max_steps the epochs reach (at most about {steps:.0f})",
        UserWarning,
        stacklevel=3,
    )


def _expected_steps(trainer: pl.Trainer, loader: SelectiveLoader) -> float | None:
    """The optimizer steps the Trainer's ``max_epochs`` passes over the data are expected to
    make (the policy's expectation, as :func:`~sbloader.policies.plan_batches` plans the default
    policy's anneal); None without ``max_epochs`` or for a source whose pass cannot be
    counted."""
    epochs = trainer.max_epochs
    counted = _pass_batches(trainer, loader)
    if epochs is None or epochs < 1 or counted is None:
        return None
    policy = loader.policy
    anneal = policy.anneal_from_epoch if isinstance(policy, Phased) else None
    expected = plan_batches(epochs, epochs if anneal is None else anneal, *counted)
    return expected / trainer.accumulate_grad_batches


def _warn_no_estimate(trainer: pl.Trainer, loader: SelectiveLoader) -> None:
    """Warn where a loader without ``len()`` is built for ``Trainer.estimated_stepping_batches``
    (read in ``configure_optimizers``, or another hook of Lightning's setup of ``fit``) and the
    Trainer has no ``max_steps``: the estimate then reads -1, ``max_steps``' default.

    NOTE: Lightning estimates a run without a loader length as ``max_steps`` whatever
    ``max_epochs`` says, -1 where it is not set, which it returns as the estimate, silently: a
    ``CosineAnnealingLR(T_max=-1)`` trained at 0 and the full rate by turns, a
    ``OneCycleLR(total_steps=-1)`` raised "Expected positive integer total_steps", neither
    naming the loader. The read cannot be seen; a loader built while Lightning sets ``fit`` up
    (between the callback's ``setup`` and ``on_fit_start``) is one Lightning loads for it, so
    a loader built when its epochs start, where nothing read the estimate, is not warned of. A
    read after the loader is built (in ``on_train_start``) is not seen either.
    """
    if trainer.max_steps != -1 or _length(loader) is not None:
        return
    steps = _expected_steps(trainer, loader)
    expected = "" if steps is None else f" (about {steps:.0f} expected)"
    warnings.warn(
        "Trainer.estimated_stepping_batches reads -1 (max_steps' default) for this loader, "
        "which has no len() (each pass keeps a random number of batches), so a schedule sized "
        "by it (CosineAnnealingLR(T_max=...), OneCycleLR(total_steps=...)) is not the run's; "
        'pass batches_per_epoch="expected" to selective_loader for a len() that Lightning '
        f"counts the run's optimizer steps by{expected}, or the Trainer a max_steps",
        UserWarning,
        stacklevel=3,
    )


def selective_loader(
    module: pl.LightningModule, source: Any, model: nn.Module | None = None, **options: Any
) -> LightningLoader:
    """The training loader for ``module``: return it from ``train_dataloader``.

    Args:
        module: the LightningModule being trained (attached to a Trainer that has a
            :class:`SelectiveLoaderCallback`).
        source: the candidates, e.g. a DataLoader (with a ``DistributedSampler`` under DDP,
            ``DistributedSampler(data, num_replicas=self.trainer.world_size,
            rank=self.global_rank, seed=0)``, which also works on one process; with
            ``generator=`` when it shuffles, so that a run can resume mid-epoch).
        model: what the selection pass scores with. Default: ``module`` (its ``forward``).
        **options: :class:`~sbloader.SelectiveLoader`'s options (``policy``, ``batch_size``,
            ``seed``, ...). Defaults here: ``metadata_key="sb"``, so that ``training_step``
            finds the selection results in the batch (``x, y, sb = batch`` for tuples,
            ``batch["sb"]`` for dicts), and ``planned_epochs=trainer.max_epochs`` without
            ``policy`` (or with ``policy=None``; where ``max_epochs >= 2``), so that the
            default policy trains on all the data in the last eighth of the run's passes over
            the data, and under a true precision (``precision="bf16-true"``, ``"64-true"``,
            ...) ``convert_inputs=`` the Trainer's precision plugin's ``convert_input``, so
            that the selection passes convert their inputs as ``training_step``'s are.
            ``batches_per_epoch`` is not set here: pass ``batches_per_epoch="expected"`` (or an
            int) for ``len()`` and ``trainer.estimated_stepping_batches`` (without it a
            selective loader has no length and each Lightning epoch is one pass over the data).
            With it, a Lightning epoch is ``batches_per_epoch`` batches and ``max_epochs``
            counts those: the default policy plans for the passes over the data they are
            expected to make, its annealed pass (all the data, several such epochs) included
            (``loader.planned_passes``; see ``planned_epochs``). A Trainer that trains on fewer
            batches than ``max_epochs`` such epochs (``limit_train_batches``, ``max_steps``)
            would end before that pass: warned of (``UserWarning``), naming the
            ``planned_epochs=`` to pass. Without it, a ``max_steps`` that ends the run before
            the planned passes' expected batches (before their anneal) is warned of too, and
            so is a ``max_steps`` that ``max_epochs`` is expected to end the run before (the
            Trainer's ``estimated_stepping_batches`` reads ``max_steps`` for a loader without
            ``len()``, so a schedule sized by it would be cut short), and, without
            ``max_steps``, a loader built for ``estimated_stepping_batches`` (read in
            ``configure_optimizers``), which reads -1.

    Raises:
        TypeError: ``module`` is not a LightningModule (e.g. a LightningDataModule: pass
            ``self.trainer.lightning_module`` from its ``train_dataloader``).
        ValueError: called for the Trainer's validation, test or prediction loaders (from
            ``val_dataloader``, ``test_dataloader`` or ``predict_dataloader``: those stay plain
            DataLoaders), no :class:`SelectiveLoaderCallback` (or more than one) in the
            Trainer's callbacks, a ``training_step`` that takes ``dataloader_iter``, a source
            DataLoader without a ``DistributedSampler`` for the Trainer's processes, or a float
            ``limit_train_batches`` or ``val_check_interval`` (a fraction of ``len()``) for a
            loader without one (pass ``batches_per_epoch="expected"``).

    Example:
        The selection results travel in the batch, under ``"sb"``:

        >>> from torch.utils.data import TensorDataset
        >>> class Module(pl.LightningModule):
        ...     def training_step(self, batch, batch_idx):
        ...         pass
        >>> module = Module()
        >>> module.trainer = pl.Trainer(callbacks=[SelectiveLoaderCallback()], logger=False,
        ...                             accelerator="cpu")
        >>> data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
        >>> loader = selective_loader(module, DataLoader(data, batch_size=4), nn.Linear(4, 3),
        ...                           batch_size=2)
        >>> x, y, sb = next(iter(loader))
        >>> x.shape, sorted(sb)
        (torch.Size([2, 4]), ['indices', 'losses', 'probabilities', 'weights'])

        Without the callback, checkpoints could not save the loader:

        >>> module.trainer = pl.Trainer(logger=False, accelerator="cpu")
        >>> selective_loader(module, DataLoader(data, batch_size=4))
        Traceback (most recent call last):
            ...
        ValueError: selective_loader needs one SelectiveLoaderCallback in the Trainer's ...
    """
    if not isinstance(module, pl.LightningModule):
        fix = (
            "from a LightningDataModule's train_dataloader, pass "
            "selective_loader(self.trainer.lightning_module, source, ...)"
            if isinstance(module, pl.LightningDataModule)
            else "pass the LightningModule being trained"
        )
        raise TypeError(
            "module should be the LightningModule being trained, but got "
            f"module={type(module).__name__}; {fix}"
        )
    try:
        trainer = module.trainer
    except RuntimeError as e:  # (Lightning: "... is not attached to a `Trainer`")
        raise RuntimeError(
            f"selective_loader needs the Trainer that trains {type(module).__name__}, but the "
            "module is not attached to one yet; call it inside the module's train_dataloader "
            "(or a LightningDataModule's), which Lightning calls from fit, not before fit to "
            "pass as train_dataloaders="
        ) from e
    _check_training_stage(trainer)
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # (set outside Trainer's body)
    found = [cb for cb in callbacks if isinstance(cb, SelectiveLoaderCallback)]
    if len(found) != 1:
        # NOTE: Lightning's Tuner (lr_find, scale_batch_size, and the LearningRateFinder and
        # BatchSizeFinder callbacks) swaps the Trainer's callbacks for its own while it tunes,
        # so a user who passed the callback meets this too: said, with what to do.
        tuner = (
            " Lightning's Tuner (lr_find, scale_batch_size, LearningRateFinder, "
            "BatchSizeFinder) replaces the Trainer's callbacks while it tunes: tune before fit "
            "with a plain DataLoader (e.g. a flag on your module that train_dataloader reads to "
            "return the source itself), then fit with selective_loader"
            if not found
            else ""
        )
        raise ValueError(
            f"selective_loader needs one SelectiveLoaderCallback in the Trainer's callbacks, but "
            f"found {len(found)}: pass Trainer(callbacks=[SelectiveLoaderCallback()]) (or return "
            "it from the module's configure_callbacks), so that checkpoints save and restore "
            f"the loader.{tuner}"
        )
    if "dataloader_iter" in inspect.signature(module.training_step).parameters:
        raise ValueError(
            "selective_loader does not support training_step(dataloader_iter): the callback "
            "counts the batches Lightning hands to training_step, so take the batch argument, "
            "training_step(self, batch, batch_idx)"
        )
    world = trainer.world_size
    # NOTE: checked where the split is the sampler's to make: not over an iterable dataset
    # (mosaicml-streaming's and torchdata's shard by rank themselves; a DataLoader refuses a
    # sampler there), nor for a batch sampler of the user's own that splits by itself or holds
    # no sampler to inspect.
    if (
        world > 1
        and isinstance(source, DataLoader)
        and not isinstance(source.dataset, IterableDataset)
    ):
        batches = source.batch_sampler
        sampler = getattr(batches, "sampler", None)
        splits = world in (
            getattr(batches, "num_replicas", None),
            getattr(sampler, "num_replicas", None),
        )
        if sampler is not None and not splits:
            raise ValueError(
                f"the Trainer runs {world} processes, but the source DataLoader's sampler "
                f"({type(sampler).__name__}) does not split the data between them; build it with "
                "sampler=DistributedSampler(dataset, num_replicas=self.trainer.world_size, "
                "rank=self.global_rank, seed=0)"
            )
    options.setdefault("metadata_key", "sb")
    _convert_as_trained(trainer, options)
    epochs = trainer.max_epochs
    # NOTE: policy=None and planned_epochs=None are the defaults, as left out: passed
    # explicitly (a config's None), the default policy lost the Trainer's max_epochs and never
    # annealed, unsaid.
    planned = options.get("policy") is None and options.get("planned_epochs") is None
    if planned and epochs is not None and epochs >= 2:
        # NOTE: the default policy anneals (all the data) in the last eighth of the run, which
        # only the Trainer knows; max_epochs=-1 (unbounded) leaves it without annealing.
        options["planned_epochs"] = epochs
    loader = SelectiveLoader(source, module if model is None else model, **options)
    if planned and loader.planned_epochs is not None and loader.batches_per_epoch is not None:
        _warn_short_run(trainer, loader.planned_epochs, loader.batches_per_epoch)
    elif planned and loader.planned_epochs is not None:
        _warn_steps_before_anneal(trainer, loader)
    _check_fractions(trainer, loader)
    _warn_unestimated_steps(trainer, loader)
    if found[0]._setting_up:
        _warn_no_estimate(trainer, loader)
    wrapper = LightningLoader(loader)
    found[0]._attach(wrapper, trainer.global_rank, world, new_epoch=not _resumes_epoch(trainer))
    return wrapper
