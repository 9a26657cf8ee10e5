"""Selection passes overlapped with training: the paper's pipelining (Jiang et al. 2019, §3.3).

With ``SelectiveLoader(..., overlap_selection=True)`` the selection pass of the next source
batch runs on a background thread while the caller trains on the batches of the current one.
It scores with a *copy* of the selection model (:class:`SelectionCopy`), refreshed from the
live model's parameters and buffers right before each pass is handed to the thread: the live
model keeps changing under the caller's optimizer steps, and a forward that read it meanwhile
would see half-updated weights. Each pass therefore uses the weights as they were when the
previous source batch had been decided, before the caller's steps on its batches: one source
batch staler than without overlap, which the paper expects.

NOTE (determinism): the copy is refreshed at a fixed point of the iteration (in the caller's
thread, when no pass is running), so what each pass computes does not depend on how the two
threads are scheduled: a seed gives the same selections with or without a busy machine. It
gives *different* selections than ``overlap_selection=False`` (staler weights).

NOTE (resume): a pass scored ahead is not consumed yet, so a state saved while one is held
keeps its losses (:class:`AheadScores`), and the resumed run decides that source batch from
them instead of scoring it again with weights the uninterrupted run never used.

NOTE (threads): the background pass and the caller's step each use torch's intra-op thread
count (``torch.get_num_threads()``), which the loader never changes; on a machine with ``c``
cores, ``torch.set_num_threads(c // 2)`` keeps the two from competing for the same cores.

NOTE (GPU): with the model on a GPU the copy lives there too, and each pass runs on a CUDA
stream of the selection thread's own (:class:`SelectionThread`), ordered after the caller's work
by events, without host synchronisation; the host still launches its kernels, from the thread.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np
import torch
from torch import nn

from ._forward_state import module_attributes, same_attributes
from .selection import concrete_device, has_lazy, unwrap

__all__ = ["AheadScores", "SelectionCopy", "SelectionThread"]


class SelectionCopy:
    """A copy of the selection model that selection passes on the background thread use.

    Args:
        model: the selection model (wrappers such as DDP or ``torch.compile`` are looked
            through: the copy is of the module inside).

    Raises:
        ValueError: the model cannot be copied with ``copy.deepcopy``.

    Example:
        >>> import torch
        >>> live = torch.nn.Linear(2, 1)
        >>> c = SelectionCopy(live)
        >>> with torch.no_grad():
        ...     _ = live.weight.add_(1.0)
        >>> bool(torch.equal(c.model.weight, live.weight))
        False
        >>> c.sync(live)
        >>> bool(torch.equal(c.model.weight, live.weight)), c.syncs
        (True, 1)
    """

    def __init__(self, model: nn.Module) -> None:
        live = unwrap(model)
        self.model: nn.Module = _frozen_copy(live)
        # The live model's modules the copy was made from (weak: a replaced one may go).
        self._made_from = _module_refs(live)
        self._made_as = module_attributes(live)
        #: How many times the copy was refreshed from the live model.
        self.syncs = 0

    def sync(self, live: nn.Module) -> None:
        """Refresh the copy from ``live``'s parameters and buffers.

        Call it only while no selection pass runs on the copy. Where they still match the
        copy's (in number, shape, dtype and device) and ``live`` is made of the modules the copy
        was made from, they are copied in place; else the copy is made again from ``live`` as it
        is now: lazy parameters made by the model's first forward, a layer replaced (also by one
        with parameters of the same shapes, or by a layer without parameters, e.g. an
        activation), the model moved to another device or cast to another dtype after the
        loader was built are followed, as a pass over the live model would be.

        NOTE: a layer replaced by one with parameters of the same shapes (or none) left the
        parameters matching, and the copy went on scoring with the old layer for the rest of
        the run, where a run without overlap scores with the new one. So did a forward hook
        registered since, or an attribute set since (a temperature, a BatchNorm's ``eps``, a
        reassigned ``forward``): the copy is made again where any module's attributes are not
        the objects they were (see :func:`~sbloader._forward_state.module_attributes`).

        NOTE: these were refused (or, for a dtype, cast back) at the first refresh, which comes
        at the second source batch of the first epoch with selection passes: after a whole
        warm-up epoch with the default recipe, for a change that a run without overlap follows.

        Raises:
            ValueError: the copy had to be made again, and ``copy.deepcopy(live)`` raised.
        """
        live = unwrap(live)
        src = [*live.parameters(), *live.buffers()]
        dst = [*self.model.parameters(), *self.model.buffers()]
        same = (
            not has_lazy(live)
            and not has_lazy(self.model)
            and _same_modules(self._made_from, live)
            and same_attributes(self._made_as, module_attributes(live))
            and len(src) == len(dst)
            and all(
                s.shape == d.shape and s.dtype == d.dtype and s.device == d.device
                for s, d in zip(src, dst)
            )
        )
        if same:
            with torch.no_grad():
                for s, d in zip(src, dst):
                    d.copy_(s)
        else:
            self.model = _frozen_copy(live)
            self._made_from = _module_refs(live)
            self._made_as = module_attributes(live)
        self.syncs += 1


def _module_refs(model: nn.Module) -> list[weakref.ref[nn.Module]]:
    """Weak references to ``model``'s modules, in ``model.modules()``'s order."""
    return [weakref.ref(m) for m in model.modules()]


def _same_modules(refs: Sequence[weakref.ref[nn.Module]], model: nn.Module) -> bool:
    """Whether ``model``'s modules are those ``refs`` refer to, in order (not where one was
    replaced, added or removed since).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> refs = _module_refs(net)
        >>> _same_modules(refs, net)
        True
        >>> net[1] = nn.Tanh()
        >>> _same_modules(refs, net)
        False
    """
    modules = list(model.modules())
    return len(modules) == len(refs) and all(r() is m for r, m in zip(refs, modules))


@dataclass
class AheadScores:
    """The losses of a source batch scored ahead and not consumed yet (kept in a saved state).

    Attributes:
        epoch: the epoch of the source batch.
        position: its number in the epoch, from 1 (the iterator's ``position`` once it is
            consumed).
        indices: its dataset indices, or None where the source has none.
        losses: its per-example losses (float32 or the selection dtype's, on the CPU).
        logits: the selection outputs with ``keep_logits``, else None.
        calls: selection-model calls the pass made.
        seconds: how long the pass ran.

    Example:
        Saved and restored, the scores are used only for the source batch they were made for:

        >>> ahead = AheadScores(0, 3, np.array([8, 9]), torch.tensor([0.5, 1.5]), None, 1, 0.01)
        >>> restored = AheadScores.from_state(ahead.state_dict())
        >>> restored.indices.tolist(), restored.losses.tolist(), restored.position
        ([8, 9], [0.5, 1.5], 3)
        >>> restored.check(0, 3, np.array([8, 9]), 2)  # the same batch: no error
        >>> restored.check(0, 3, np.array([8, 10]), 2)
        Traceback (most recent call last):
            ...
        RuntimeError: the resumed run's source yielded another source batch than the saved run ...
    """

    epoch: int
    position: int
    indices: np.ndarray | None
    losses: torch.Tensor
    logits: torch.Tensor | None
    calls: int
    seconds: float

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "indices": None if self.indices is None else torch.from_numpy(self.indices.copy()),
            "losses": self.losses.detach().cpu(),
            "logits": None if self.logits is None else self.logits.detach().cpu(),
            "calls": self.calls,
            "seconds": self.seconds,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AheadScores:
        indices = state["indices"]
        return cls(
            epoch=int(state["epoch"]),
            position=int(state["position"]),
            indices=None if indices is None else np.asarray(indices, dtype=np.int64),
            losses=state["losses"],
            logits=state["logits"],
            calls=int(state["calls"]),
            seconds=float(state["seconds"]),
        )

    def check(self, epoch: int, position: int, indices: np.ndarray | None, n: int) -> None:
        """Refuse to use these scores for another source batch than the one they were made for.

        Raises:
            RuntimeError: the resumed source yielded another batch at this position (a source
                that does not replay its epoch exactly, e.g. a different sampler seed).
        """
        same = self.epoch == epoch and self.position == position and len(self.losses) == n
        if same and self.indices is not None:
            same = indices is not None and np.array_equal(self.indices, indices)
        if not same:
            raise RuntimeError(
                "the resumed run's source yielded another source batch than the saved run had "
                f"scored ahead (epoch {self.epoch}, source batch {self.position}, "
                f"{len(self.losses)} examples; now epoch {epoch}, source batch {position}, {n} "
                "examples, or other dataset indices): resume with the saved run's source "
                "(the same data, sampler and seed)"
            )


class SelectionThread:
    """One background thread that runs an epoch's overlapped selection passes, one at a time.

    On a GPU each pass runs on a CUDA stream of the thread's own, so that its kernels can run
    beside the caller's training step instead of queueing behind it.

    NOTE (streams): a pass must see the caller's work up to its submission (the copy's refreshed
    weights, the source batch moved to the device), and the caller must see the pass's outputs
    before using them. :meth:`submit` records an event on the caller's stream that the pass's
    stream waits for; :meth:`collect` makes the caller's stream wait for an event recorded after
    the pass. Neither blocks the host. The caching allocator is told which stream uses a tensor
    made on the other (``Tensor.record_stream``), so that no memory is reused while a stream
    may still read it.

    Example:
        >>> t = SelectionThread()
        >>> f = t.submit(lambda: 6 * 7)
        >>> f.result()[0]
        42
        >>> t.close()
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sbloader-select")
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def submit(
        self,
        fn: Callable[[], Any],
        device: torch.device | None = None,
        inputs: Sequence[Any] = (),
    ) -> Future[tuple[Any, float]]:
        """Run ``fn()`` on the thread; the future gives its result and how long it ran.

        With a CUDA ``device``, ``fn`` runs on the thread's stream for that device, after the
        caller's stream has reached this point; ``inputs`` (tensors made on the caller's stream
        that ``fn`` reads) are recorded as used by that stream. The result is then
        ``((out, done), seconds)``, ``done`` an event recorded after ``fn``'s work: pass it to
        :meth:`collect`.
        """
        if device is None or device.type != "cuda":

            def timed() -> tuple[Any, float]:
                t0 = perf_counter()
                out = fn()
                return out, perf_counter() - t0

            return self._executor.submit(timed)
        device = concrete_device(device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        for t in _tensors(inputs):
            if t.is_cuda:
                t.record_stream(stream)

        def on_stream() -> tuple[Any, float]:
            t0 = perf_counter()
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                out = fn()
                done = torch.cuda.Event()
                done.record(stream)
            return (out, done), perf_counter() - t0

        return self._executor.submit(on_stream)

    @staticmethod
    def collect(out: Any, device: torch.device | None) -> Any:
        """The result of a pass from :meth:`submit`: on a CUDA ``device``, ``(out, done)``
        unpacked, with the caller's stream made to wait for ``done`` and the tensors of the
        result (its attributes', for an object) recorded as used by it; else ``out`` as it is."""
        if device is None or device.type != "cuda":
            return out
        result, done = out
        caller = torch.cuda.current_stream(device)
        caller.wait_event(done)
        held = list(vars(result).values()) if hasattr(result, "__dict__") else [result]
        for t in _tensors(held):
            if t.is_cuda:
                t.record_stream(caller)
        return result

    def close(self, wait: bool = True) -> None:
        """Wait for a running pass to end and stop the thread (``wait=False``: stop it once
        the pass ends, without waiting; on the thread itself)."""
        self._executor.shutdown(wait=wait, cancel_futures=True)


def _frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters take no gradient (lazy ones, still to be made,
    are left as they are: ``requires_grad_`` refuses them).

    Raises:
        ValueError: the model cannot be copied with ``copy.deepcopy``.
    """
    try:
        out = copy.deepcopy(model)
    except Exception as e:
        raise ValueError(
            "overlap_selection=True scores on a copy of the selection model, but "
            f"copy.deepcopy(model) raised {type(e).__name__} ({e}); make the model "
            "deep-copyable or pass overlap_selection=False"
        ) from e
    for p in out.parameters():
        if not nn.parameter.is_lazy(p):
            p.requires_grad_(False)
    return out


def _tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors among ``values`` and inside the lists, tuples and dicts among them."""
    out: list[torch.Tensor] = []
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return out
