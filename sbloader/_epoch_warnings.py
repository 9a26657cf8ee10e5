"""The warnings :class:`~sbloader.SelectiveLoader` says about how a run went through its epochs,
as plain functions of values: each builds its message (and, for the ranks' backlog, decides
whether there is one to say); the loader says each once, with the stack level that names the
caller's line.

- :func:`peek_warning`: the run's first epoch was left after at most one batch.
- :func:`left_saved_warning`: a state saved after an epoch was left part-way resumes that
  epoch, but the run goes on with the next.
- :func:`nothing_yielded_warning`: an epoch kept examples and yielded no batch.
- :func:`drifted_backlog`, :func:`backlog_warning`: a rank carries more selected examples into
  the next epoch than ranks that differ by chance would.
"""

from __future__ import annotations

import math

__all__ = [
    "backlog_warning",
    "drifted_backlog",
    "left_saved_warning",
    "nothing_yielded_warning",
    "peek_warning",
]


def peek_warning(peeked: int, policy: object) -> str:
    """The warning, as epoch 1 begins, where epoch 0 was left after ``peeked`` (0 or 1)
    batches: a look at a batch before training (``next(iter(loader))``, as over a DataLoader,
    where it changes nothing) ended epoch 0, so that training begins at epoch 1.

    NOTE: not told apart from a loop that breaks after one step (an epoch left part-way
    counts as ended, which ``limit_train_batches`` and step-counted loops need), so a
    warning, not another rule: the default policy's Random-Backprop epoch, which keeps
    loss-based selection from collapsing from a random initialisation, was skipped unsaid,
    and a schedule keyed on ``loader.progress`` began at 1.0. Said as epoch 1 begins, not as
    epoch 0 is left: a peeked iterator is left when it is collected, which for one in a
    reference cycle is whenever the garbage collector runs, anywhere in the program. (Under
    ``batches_per_epoch`` a training epoch left part-way leaves its pass running, so it is
    never noted.)

    Example:
        >>> peek_warning(1, "Traditional()")[:36]
        'epoch 0 was left after 1 batch (a lo'
    """
    return (
        f"epoch 0 was left after {peeked} batch (a look at a batch with "
        "next(iter(loader))?), so it counted as ended, as after break: this epoch is epoch "
        f"1, past the policy's first epoch ({policy!r}), with loader.progress at 1.0; to "
        "look at a batch before training, take one from the source "
        "(next(iter(train_loader))), or build the SelectiveLoader again after looking"
    )


def left_saved_warning(left: int, goes_on: int | None) -> str:
    """The warning where a state was saved after epoch ``left`` was left part-way: that state
    resumes the rest of epoch ``left``, and this run goes on with epoch ``goes_on`` instead
    (None: :meth:`~sbloader.SelectiveLoader.end_epoch` ends epoch ``left`` after the save).

    NOTE: a state saved after ``break`` resumes the rest of the epoch left (a run that leaves
    its loop to save and stop, preempted, goes on from there, as torchdata's
    StatefulDataLoader does), but a loop that caps its steps per epoch and saves as each epoch
    ends (torchtune's ``max_steps_per_epoch``; Accelerate's scripts, which resume such a
    checkpoint at the next epoch) means the next epoch: resumed, it went on a pass behind its
    run for good, every batch after it different and the annealed pass never reached, unsaid
    (found by review). Which of the two a run means is known when it goes on, or when
    ``end_epoch()`` is called after the save; the loader says it then.

    Example:
        >>> "goes on with epoch 4" in left_saved_warning(3, 4)
        True
    """
    said = (
        "end_epoch() was called after it was saved"
        if goes_on is None
        else f"this run goes on with epoch {goes_on}"
    )
    return (
        f"a state was saved after epoch {left} was left part-way (break), and it resumes "
        f"the rest of epoch {left}, but {said}: a run resumed from that state would go "
        "on a pass behind this one. A loop that leaves each epoch part-way (a cap on steps "
        "per epoch) and saves as each epoch ends should call loader.end_epoch() after "
        "leaving the loop, before saving (the state then starts the next epoch, as this run "
        "does); to resume an epoch part-way, save inside the loop"
    )


def nothing_yielded_warning(
    epoch: int, dropped: int, batch_size: int, remainder: str, min_batch_size: int
) -> str:
    """The warning where epoch ``epoch`` kept examples and yielded no batch: the ``dropped``
    examples it kept were dropped at its end (fewer than ``batch_size`` under
    ``remainder="drop"``, or fewer than ``min_batch_size``), so a training loop over it took no
    step. The fix it names follows from ``remainder``.

    Example:
        >>> "remainder='carry'" in nothing_yielded_warning(0, 20, 32, "drop", 1)
        True
    """
    fix = (
        "pass a smaller batch_size, remainder='carry' (kept examples wait for the next "
        "epoch) or remainder='short' (a last, shorter batch), or keep more (a larger "
        "selectivity)"
        if remainder == "drop"
        else f"a batch smaller than min_batch_size={min_batch_size} is never yielded: "
        "give the epoch more examples to keep (more data, a larger selectivity), or pass a "
        "smaller min_batch_size where the model allows it"
    )
    return (
        f"epoch {epoch} yielded no batch: the {dropped} examples it kept were "
        f"dropped at its end, fewer than a batch (batch_size={batch_size}, "
        f"remainder={remainder!r}, min_batch_size={min_batch_size}), so a loop "
        f"over it trained on nothing (and will in every epoch that keeps as few); {fix}"
    )


def drifted_backlog(carried: int, batch_size: int, yielded: int, selected: int) -> bool:
    """Whether a rank that carries ``carried`` selected examples into the next epoch, after
    an epoch that yielded ``yielded`` examples and a run that selected ``selected`` in all,
    carries more than ranks that differ by chance would.

    NOTE: every rank yields as many batches as the fewest has ready, so a rank that selects
    more keeps its surplus pending under ``remainder="carry"`` (trained first in the next
    epoch). Ranks with equal shares and rates still drift apart by chance, as random walks
    do: the difference grows as the square root of the examples selected (an SB keep is a
    coin flip per candidate), about 3 of those units for 8 ranks. A rank with a larger share
    of the data or a higher selection rate drifts linearly instead, and its backlog (memory,
    and ever staler selections) grows without bound. The answer is yes beyond 12 such units
    (and four batches, and a quarter of the epoch's yield): not for a chance difference, but
    within a few epochs for a rank that selects a tenth more.

    Example:
        >>> drifted_backlog(600, 32, 1000, 10_000)  # within 12 * sqrt(10000) = 1200 of chance
        False
        >>> drifted_backlog(1500, 32, 1000, 10_000)
        True
    """
    if carried <= max(4 * batch_size, yielded // 4):
        return False
    return carried > 12 * math.sqrt(selected)


def backlog_warning(rank: int, world_size: int, carried: int, yielded: int, epoch: int) -> str:
    """The warning where rank ``rank`` of ``world_size`` carries ``carried`` selected examples
    into the epoch after ``epoch``, in which it yielded ``yielded`` (see
    :func:`drifted_backlog`).

    Example:
        >>> backlog_warning(1, 2, 1500, 1000, 3)[:40]
        'rank 1 of 2 carries 1500 selected exampl'
    """
    return (
        f"rank {rank} of {world_size} carries {carried} selected examples into "
        f"epoch {epoch + 1} (it yielded {yielded} in epoch "
        f"{epoch}), more than the ranks' selections differ by chance: every rank "
        "yields as many batches as the fewest has ready, so a rank that selects more than "
        "the others keeps its surplus pending, and where its share of the data or its "
        "selection rate stays larger that backlog grows every epoch; give every rank an "
        "equal share (sampler=DistributedSampler(dataset)), or pass remainder='drop' "
        "(counted in loader.stats, dropped) or remainder='short'"
    )
