"""Hugging Face Accelerate: a SelectiveLoader over a prepared DataLoader, seen by Accelerate as
one of its own loaders.

Two pieces, each doing what Accelerate's own ``DataLoaderShard`` does:

- the source: a DataLoader prepared by ``accelerator.prepare`` (a ``DataLoaderShard`` whose
  ``BatchSamplerShard`` gives each process its share of every epoch) is rebuilt, like any
  DataLoader, to recover the dataset indices, and each epoch starts as the shard's own
  ``__iter__`` starts one: the shard's generators are synchronised across the processes (rank
  0's state broadcast, so that every rank shuffles alike and the shards do not overlap) and the
  epoch is passed on to the samplers. :func:`sbloader.adapt.make_source` builds it
  (:func:`shard_source`, from :mod:`sbloader.integrations.accelerate_source` and exported here
  too), so ``SelectiveLoader(accelerator.prepare(dataloader), model)`` works.
- :class:`AcceleratedLoader` wraps the SelectiveLoader for the training loop: it registers with
  Accelerate's ``GradientState`` while an epoch runs and marks the epoch's last batch, so that
  ``accelerator.accumulate()`` synchronises gradients and steps on it; and its state is every
  process's loader state, so ``accelerator.register_for_checkpointing`` restores each rank
  exactly (Accelerate saves a registered object's state from the main process only).

Example:
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> import sbloader
    >>> from sbloader.integrations.accelerate import AcceleratedLoader
    >>> accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    >>> data = TensorDataset(torch.randn(96, 8), torch.randint(0, 3, (96,)))
    >>> model, source = accelerator.prepare(nn.Linear(8, 3), DataLoader(data, batch_size=32))
    >>> loader = AcceleratedLoader(sbloader.SelectiveLoader(
    ...     source, model, policy=sbloader.SelectiveBackprop(selectivity=0.5), batch_size=8))
    >>> accelerator.register_for_checkpointing(loader)
    >>> syncs = []
    >>> for inputs, targets in loader:
    ...     with accelerator.accumulate(model):
    ...         syncs.append(accelerator.sync_gradients)
    >>> syncs[-1]  # the epoch's last batch
    True
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState

from .._checks import NotADataLoader, check_bool
from .._loader_state import K_IDENTITY
from .._state import check_version
from ..loader import SelectiveLoader
from .accelerate_source import AcceleratedShardSource, shard_source

__all__ = ["AcceleratedLoader", "AcceleratedShardSource", "shard_source"]


class AcceleratedLoader(DataLoaderStateMixin, NotADataLoader):
    """A :class:`~sbloader.SelectiveLoader` as Accelerate sees its own loaders.

    Iterate it instead of the SelectiveLoader; it yields the same batches (with their
    ``indices``, ``losses``, ``probabilities`` and ``weights``) and:

    - registers with Accelerate's ``GradientState`` while an epoch runs, as
      ``DataLoaderShard`` does, and under gradient accumulation sets ``end_of_dataloader`` on
      the epoch's last batch, so that ``accelerator.accumulate(model)`` synchronises the
      gradients and lets the optimizer step there: no half-accumulated gradient crosses into
      the next epoch (without accumulation every step synchronises, nothing runs ahead to
      learn which batch is the last, and ``end_of_dataloader`` stays False: see the NOTE);
    - saves and restores every process's loader state: register it with
      ``accelerator.register_for_checkpointing(loader)`` (not the SelectiveLoader itself:
      Accelerate writes a registered object's state from the main process only, which on
      several processes would give every rank rank 0's state) and ``save_state`` /
      ``load_state`` resume each rank exactly, also mid-epoch;
    - saved where a training step raised (``accelerator.save_state`` in the loop's ``except``
      or ``finally``), resumes at the interrupted batch once :meth:`interrupted` says so: the
      state then takes that batch back, and the resumed run trains it first. Saved while an
      exception is handled without it, it warns (it cannot know whether the step finished).

    NOTE (one batch ahead): the end of a selective epoch is known only once the next batch is
    selected, so with gradient accumulation (``gradient_accumulation_steps > 1`` and
    ``sync_with_dataloader``, Accelerate's default) the loader selects the next batch before
    handing out the current one, as Accelerate's own loaders fetch one batch ahead: that
    batch's selection pass then runs before the optimizer step on the current one. Without
    accumulation every step synchronises anyway, nothing runs ahead, and the batches are
    exactly the SelectiveLoader's alone. ``remainder`` stays -1 (Accelerate's "unknown"): a
    selected batch holds no padding to cut in ``gather_for_metrics``.

    Args:
        loader: the SelectiveLoader, over the prepared DataLoader (or any source).

    Attributes:
        loader: the wrapped SelectiveLoader (``stats``, ``epoch``, ``progress``, ...).

    Example:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from sbloader import Traditional
        >>> data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
        >>> prepared = Accelerator(cpu=True).prepare(DataLoader(data, batch_size=4))
        >>> loader = AcceleratedLoader(
        ...     SelectiveLoader(prepared, torch.nn.Linear(4, 3), policy=Traditional()))
        >>> len(loader), [batch.indices.tolist() for batch in loader]
        (3, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
        >>> state = loader.state_dict()  # what accelerator.save_state saves: every rank's state
        >>> state["version"], state["world_size"], len(state["ranks"])
        (1, 1, 1)
        >>> AcceleratedLoader(prepared)
        Traceback (most recent call last):
            ...
        TypeError: AcceleratedLoader wraps a sbloader.SelectiveLoader, but got DataLoaderShard; ...
    """

    VERSION = 1

    def __init__(self, loader: SelectiveLoader) -> None:
        if not isinstance(loader, SelectiveLoader):
            raise TypeError(
                "AcceleratedLoader wraps a sbloader.SelectiveLoader, but got "
                f"{type(loader).__name__}; pass SelectiveLoader(accelerator.prepare(dataloader), "
                "model, ...)"
            )
        self.loader = loader
        self.gradient_state = GradientState()
        self._drop_last = True  # NOTE: keeps DataLoaderStateMixin.begin() from a remainder
        self._interrupted: bool | None = None  # what interrupted() said, until the next save

    def __iter__(self) -> Iterator[Any]:
        self._interrupted = None
        state = self.gradient_state
        ahead = state.num_steps > 1 and state.sync_with_dataloader
        it = iter(self.loader)
        if ahead:
            it.runs_ahead()
        self.begin()
        try:
            for batch in it:
                if ahead:
                    self.end_of_dataloader = it.finishing()
                yield batch
        finally:
            self.end()

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        """The source's dataset (``loader.dataset``)."""
        return self.loader.dataset

    @property
    def sampler(self) -> Any:
        """The source's sampler (``loader.sampler``)."""
        return self.loader.sampler

    def feedback(self, indices: Any, losses: Any) -> None:
        """Report the training step's per-example losses to the wrapped loader (see
        :meth:`SelectiveLoader.feedback <sbloader.SelectiveLoader.feedback>`), so that the
        README's loop, ``loader.feedback(batch.indices, losses)``, runs unchanged here."""
        self.loader.feedback(indices, losses)

    def end_epoch(self) -> None:
        """End the epoch for good before ``accelerator.save_state``, in a loop that caps its
        steps per epoch (``break``) and saves as each epoch ends: the state then starts the next
        epoch, as Accelerate's scripts resume such a checkpoint (see
        :meth:`SelectiveLoader.end_epoch <sbloader.SelectiveLoader.end_epoch>`)."""
        self.loader.end_epoch()

    def interrupted(self, step_finished: bool = False) -> None:
        """Say, before ``accelerator.save_state`` where the loop was interrupted, whether the
        training step on the batch handed out last finished.

        Accelerate's loop gives the loader no sign of it: a step that raised (a
        ``KeyboardInterrupt``, an out-of-memory error) leaves the batch in hand untrained, yet
        the loader handed it out, and a state saved then resumes after it, so the resumed run
        never trains it. Called with ``step_finished=False`` (the default), the next state saved
        takes that batch back (:meth:`SelectiveLoader.state_dict
        <sbloader.SelectiveLoader.state_dict>` with ``unconsumed=1``): the resumed run hands it
        out again first, with the same examples, and goes on as the uninterrupted run would.
        ``step_finished=True`` says the step finished (the exception came after it): the state
        is the usual one, and saving it does not warn. Either holds for the next save only.

        Args:
            step_finished: whether the training step on the batch handed out last finished.

        Raises:
            ValueError: with ``step_finished=False``, where no batch handed out can be taken
                back now (no epoch is running, nor one left part-way): raised here rather than
                at the save.

        Example:
            >>> import torch
            >>> from accelerate import Accelerator
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> from sbloader import Traditional
            >>> data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
            >>> prepared = Accelerator(cpu=True).prepare(DataLoader(data, batch_size=4))
            >>> loader = AcceleratedLoader(
            ...     SelectiveLoader(prepared, torch.nn.Linear(4, 3), policy=Traditional()))
            >>> try:
            ...     for batch in loader:
            ...         if batch.indices[0] == 4:
            ...             raise KeyboardInterrupt  # (the step on batch [4, 5, 6, 7])
            ... except KeyboardInterrupt:
            ...     loader.interrupted()
            ...     state = loader.state_dict()  # (what accelerator.save_state saves)
            >>> again = AcceleratedLoader(
            ...     SelectiveLoader(prepared, torch.nn.Linear(4, 3), policy=Traditional()))
            >>> again.load_state_dict(state)
            >>> [batch.indices.tolist() for batch in again]
            [[4, 5, 6, 7], [8, 9, 10, 11]]
        """
        step_finished = check_bool("step_finished", step_finished)
        if not step_finished and not self.loader.takes_back(1):
            raise ValueError(
                "interrupted(): no batch handed out can be taken back now (no epoch is running, "
                "nor one left part-way, or it ended with its last step); call it between the "
                "interrupted step and accelerator.save_state, before the next iter(loader), or "
                "pass step_finished=True"
            )
        self._interrupted = not step_finished

    def state_dict(self) -> dict[str, Any]:
        """Every process's loader state, in rank order (a collective on several processes:
        every rank calls it, as ``accelerator.save_state`` does).

        After :meth:`interrupted`, the state takes back the batch whose training step was
        interrupted. Warns where it is saved while an exception is handled (the loop's
        ``except`` or ``finally``) after a batch was handed out and :meth:`interrupted` was not
        called: the state counts that batch as trained, which is wrong where the exception
        interrupted its step.

        Warns too where it is saved between optimizer steps (gradient accumulation, and
        ``accelerator.sync_gradients`` False after the last step): the gradients accumulated
        since the last optimizer step are in no checkpoint, so a run resumed from it trains on
        the same batches with other weights and soon selects other examples."""
        interrupted, self._interrupted = self._interrupted, None
        handling = sys.exc_info()[1]
        if interrupted is None and handling is not None and self.loader.takes_back(1):
            warnings.warn(
                f"the AcceleratedLoader's state is saved while {type(handling).__name__} is "
                "handled, and counts the batch handed out last as trained: where the exception "
                "interrupted the training step on it, the resumed run never trains it; call "
                "loader.interrupted() before accelerator.save_state (or "
                "loader.interrupted(step_finished=True) where the step had finished)",
                UserWarning,
                stacklevel=2,
            )
        state = self.gradient_state
        if state.num_steps > 1 and not state.sync_gradients:
            warnings.warn(
                "the AcceleratedLoader's state is saved between optimizer steps (accelerator."
                f"sync_gradients is False under gradient_accumulation_steps={state.num_steps}): "
                "the gradients accumulated since the last optimizer step are in no checkpoint, "
                "so a run resumed from it will not train as the uninterrupted one does; save at "
                "a step where accelerator.sync_gradients is True",
                UserWarning,
                stacklevel=2,
            )
        own = self.loader.state_dict(unconsumed=1 if interrupted else 0)
        world = self.loader.world_size
        if world == 1:
            states: list[Any] = [own]
        else:
            states = [None] * world
            dist.all_gather_object(states, own, group=self.loader.process_group)
        return {"version": self.VERSION, "world_size": len(states), "ranks": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this process's entry of a :meth:`state_dict`.

        Raises:
            ValueError: ``state`` is another object's, e.g. a SelectiveLoader's own (the saving
                run registered the SelectiveLoader for checkpointing, not this wrapper), or of
                another number of processes.
        """
        if isinstance(state, Mapping) and K_IDENTITY in state and "ranks" not in state:
            # (a SelectiveLoader's version, 2, was read as a newer AcceleratedLoader state's)
            raise ValueError(
                "this is a SelectiveLoader's own state (SelectiveLoader.state_dict()), not an "
                "AcceleratedLoader's: the saving run registered the SelectiveLoader for "
                "checkpointing; register the same object in both runs (the AcceleratedLoader, "
                "which saves every process's state), or load it with "
                "loader.loader.load_state_dict(state) on one process"
            )
        state = check_version(state, "AcceleratedLoader", self.VERSION)
        ranks = state["ranks"]
        world = self.loader.world_size
        if len(ranks) != world:
            raise ValueError(
                f"the saved AcceleratedLoader state holds {len(ranks)} processes' loader states, "
                f"but this run has {world}; resume with the saved run's number of processes"
            )
        self.loader.load_state_dict(ranks[0 if world == 1 else self.loader.rank])
        self._interrupted = None

    def __repr__(self) -> str:
        return f"AcceleratedLoader({self.loader!r})"
