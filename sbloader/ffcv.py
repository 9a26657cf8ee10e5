"""FFCV support: write ``.beton`` files that carry dataset indices, and read them as a source.

`FFCV <https://ffcv.io>`_ decodes batches in compiled code on background threads, which makes it
a fast source for the selection pass. This module provides three pieces:

- :func:`write_beton` writes a map-style dataset (or arrays) to a ``.beton`` file **with an index
  field**: each example's dataset index is stored next to its data, so it travels inside every
  batch and can never come apart from it.
- :func:`open_beton` builds an FFCV ``Loader`` with torch-like defaults (every example each
  epoch, an explicit seed) without FFCV's side effects on thread counts.
- :class:`FFCVSource` adapts an FFCV ``Loader`` to :class:`~sbloader.SelectiveLoader`; passing
  the ``Loader`` itself to ``SelectiveLoader`` does the same.

Indices come from the index field (``index_field="index"``, what :func:`write_beton` writes). For
``.beton`` files written without one, ``index_field=None`` recovers them from the loader's
traversal order instead, which is exact for the ``SEQUENTIAL`` and ``RANDOM`` orders (a pure
function of seed and epoch) and refused for ``QUASI_RANDOM``.

What sbloader guards against (see the module's NOTEs):

- ``import sbloader`` (and importing this module) never imports ffcv; ffcv is imported on first
  use, through :func:`import_ffcv`.
- ``import ffcv`` sets torch's and numba's thread counts to 1, and every ``Loader(...)`` and
  ``iter(loader)`` sets them to ``num_workers``; sbloader restores both around everything it asks
  ffcv to do (:func:`preserved_threads`), so using ffcv through sbloader never leaves them changed.
- FFCV's batches are views into a ring of ``batches_ahead + 2`` reused buffers, valid only until
  the next batch is requested. SelectiveLoader gathers the examples it keeps (pending or carried
  into the next epoch) with ``index_select``, which copies; only the passthrough policy
  (``Traditional``) yields FFCV's own tensors, valid until the next batch as with FFCV itself
  (copies where the caller runs ahead: :meth:`sbloader.epoch.EpochIterator.finishing`).

Example (needs ffcv; ``images`` float32 of shape (N, 1, 28, 28), ``labels`` int64 of shape (N,)):
    >>> import sbloader, sbloader.ffcv as sbffcv
    >>> path = sbffcv.write_beton("train.beton", (images, labels))  # doctest: +SKIP
    >>> ffcv_loader = sbffcv.open_beton(path, 512, order="random", seed=0)  # doctest: +SKIP
    >>> loader = sbloader.SelectiveLoader(ffcv_loader, model, batch_size=128)  # doctest: +SKIP
    >>> for batch in loader:  # doctest: +SKIP
    ...     images, labels, index = batch  # the selected examples; batch.indices equals index
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import importlib.util
import multiprocessing
import os
import queue
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ._checks import check_bool, check_choice, check_indices, check_int
from ._migrations import ffcv_state_v0_to_v1
from ._state import VERSION, check_identity, check_version
from ._types import is_a
from .sources import Source

__all__ = [
    "FFCVSource",
    "ffcv_available",
    "import_ffcv",
    "is_ffcv_loader",
    "open_beton",
    "preserved_threads",
    "write_beton",
]

_ORDERS = ("sequential", "random", "quasi_random")
#: FFCV traversal orders that are a pure function of (seed, epoch): replayable and recoverable.
_PURE_ORDERS = ("Sequential", "Random")


# ---------------------------------------------------------------------------------- threads
_SETTLE_LOCK = threading.Lock()
_settled = False  # numba's TBB layer has no queued task left (see _launch_numba_threads)


def _tbb_synchronize() -> Callable[[], None] | None:
    """numba's TBB ``synchronize`` (``tg->wait()``), or None for another layer or numba."""
    try:
        parallel = importlib.import_module("numba.np.ufunc.parallel")
        if getattr(parallel, "_threading_layer", None) != "tbb":
            return None
        tbbpool = importlib.import_module("numba.np.ufunc.tbbpool")
        return ctypes.CFUNCTYPE(None)(tbbpool.synchronize)
    except (ImportError, AttributeError):
        return None


def _launch_numba_threads() -> None:
    """Launch numba's threading layer on this thread if nothing has yet, and let it settle.

    Called where sbloader (or ffcv, through sbloader) would first touch numba's thread count,
    which is what launches the layer: the layer, its thread count and numba's configuration are
    the ones numba would have chosen anyway.

    NOTE (numba's TBB layer hangs exit after a fork on one core): launching the TBB layer queues
    an empty task (``tg->run([]{})`` in numba's ``tbbpool.cpp``) that TBB's worker threads
    normally run at once. With one usable core (``taskset -c 0``, a one-CPU container) TBB starts
    no workers, so the task waits in the launching thread's own (implicit) arena. A ``fork()``
    from that thread (FFCV's writer processes in :func:`write_beton`, DataLoader workers,
    ``multiprocessing``) runs numba's ``prepare_fork`` (``tbb::finalize``), which drops the task,
    and at exit numba's ``unload_tbb`` waits on the task group (``tg->wait()``) forever.
    Waiting on the group right after the launch, on the launching thread, runs the empty task
    and leaves nothing to lose. Only that thread can: any other thread's ``tg->wait()`` blocks
    forever too (as does exit when the launcher was not the main thread). So this settles a
    launch it makes itself, holding numba's launch locks (in numba's order) so that no other
    thread launches in between. Reproduce without sbloader: under ``taskset -c 0``,
    ``import numba, os; numba.get_num_threads(); os.fork() or os._exit(0); os.wait()`` never
    exits. Nothing of numba's configuration changes (no thread count, no layer choice).

    Example:
        >>> _launch_numba_threads()  # idempotent
        >>> _launch_numba_threads()
    """
    global _settled
    if _settled or "numba" not in sys.modules:
        return
    with _SETTLE_LOCK:
        try:
            parallel = importlib.import_module("numba.np.ufunc.parallel")
            if parallel._is_initialized:
                return  # launched by someone else: see _settle_before_fork
            if not parallel._backend_init_process_lock:
                parallel._set_init_process_lock()
            locks = (parallel._backend_init_process_lock, parallel._backend_init_thread_lock)
        except (ImportError, AttributeError):  # another numba: it launches as it would
            return
        with locks[0], locks[1]:  # numba's _launch_threads takes them in this order
            if parallel._is_initialized:
                return
            parallel._launch_threads()
            synchronize = _tbb_synchronize()
            if synchronize is not None:
                synchronize()  # on the launching thread: runs the queued empty task
            _settled = True


def _settle_before_fork() -> None:
    """Before sbloader forks (ffcv's writer processes): settle a TBB layer launched elsewhere.

    NOTE: when the layer was launched before sbloader touched numba (``import ffcv``, a user's
    ``numba.get_num_threads()``), only its launching thread can run the queued task (see
    :func:`_launch_numba_threads`), and which thread that was is not known. So this waits only
    on the main thread, the usual launcher. When another thread launched it, waiting here blocks
    only where the process could not exit anyway: with workers (more than one core) the task
    has run and the wait returns; with none, exit waits on the main thread for a task only its
    launcher can run. Called only right before sbloader's own fork, where it matters.
    """
    global _settled
    if _settled or threading.current_thread() is not threading.main_thread():
        return
    _launch_numba_threads()
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if _settled or parallel is None or not getattr(parallel, "_is_initialized", False):
        return
    synchronize = _tbb_synchronize()
    if synchronize is not None:
        synchronize()
    _settled = True


def _numba_threads() -> int | None:
    numba = sys.modules.get("numba")
    return None if numba is None else int(numba.get_num_threads())


@contextlib.contextmanager
def preserved_threads() -> Iterator[None]:
    """Restore torch's and numba's thread counts (of the calling thread) on exit.

    On entry, numba's threading layer is launched and settled on the calling thread if nothing
    has launched it yet (:func:`_launch_numba_threads`).

    NOTE: torch's count is restored unconditionally, even when it reads unchanged: a
    ``torch.set_num_threads`` call on another thread (FFCV's batch thread calls one when it
    starts) changes the process-wide default that new threads start with, which the calling
    thread's own ``torch.get_num_threads()`` does not show.

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with preserved_threads():
        ...     torch.set_num_threads(1)
        >>> torch.get_num_threads() == before
        True
    """
    _launch_numba_threads()
    torch_threads = torch.get_num_threads()
    numba_threads = _numba_threads()
    try:
        yield
    finally:
        torch.set_num_threads(torch_threads)
        numba = sys.modules.get("numba")
        if numba is not None:
            if numba_threads is None:  # numba was first imported inside the block
                numba_threads = int(numba.config.NUMBA_NUM_THREADS)
            numba.set_num_threads(numba_threads)


def ffcv_available() -> bool:
    """Whether ffcv is installed (checked without importing it).

    Example:
        >>> isinstance(ffcv_available(), bool)
        True
    """
    return "ffcv" in sys.modules or importlib.util.find_spec("ffcv") is not None


def import_ffcv() -> ModuleType:
    """Import ffcv and the submodules sbloader uses, leaving thread counts as they were.

    Raises:
        ImportError: naming the fix when ffcv is not installed.

    Example:
        ``import ffcv`` alone would set torch's thread count to 1:

        >>> before = torch.get_num_threads()
        >>> ffcv = import_ffcv() if ffcv_available() else None  # ffcv is optional
        >>> torch.get_num_threads() == before
        True
    """
    with preserved_threads():
        try:
            module = importlib.import_module("ffcv")
            for sub in ("ffcv.loader", "ffcv.writer", "ffcv.fields", "ffcv.fields.decoders"):
                importlib.import_module(sub)
            importlib.import_module("ffcv.transforms")
        except ImportError as e:
            raise ImportError(
                f"sbloader's FFCV support needs ffcv ({e}); install it with "
                "`pip install ffcv==1.0.2` (scripts/setup.sh does) or `pip install sbloader[ffcv]`"
            ) from e
    return module


def is_ffcv_loader(obj: Any) -> bool:
    """Whether ``obj`` is an FFCV ``Loader``, decided without importing ffcv.

    Example:
        >>> is_ffcv_loader([1, 2])
        False
    """
    if "ffcv" not in sys.modules:  # no ffcv Loader can exist without ffcv being imported
        return False
    return is_a(obj, "ffcv", "Loader")


# ---------------------------------------------------------------------------------- writing
def _as_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def _infer_field(name: str, value: Any) -> Any:
    """An ffcv Field for a sample's value: NDArrayField, IntField or FloatField."""
    fields = sys.modules["ffcv.fields"]
    value = _as_numpy(value)
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        return fields.NDArrayField(dtype=value.dtype, shape=tuple(value.shape))
    scalar = np.asarray(value)
    if scalar.ndim == 0 and scalar.dtype.kind in "iub":
        return fields.IntField()
    if scalar.ndim == 0 and scalar.dtype.kind == "f":
        if scalar.dtype != np.float64:
            warnings.warn(
                f"field {name!r} holds {scalar.dtype} scalars, which ffcv's FloatField stores as "
                "float64: they are read back as float64 (convert them, e.g. y.float(), before a "
                "loss that wants float32, such as binary_cross_entropy), or pass fields="
                f"{{{name!r}: ffcv.fields.NDArrayField(np.dtype('{scalar.dtype}'), (1,))}} to "
                "keep the dtype (read back with shape (B, 1))",
                UserWarning,
                stacklevel=3,
            )
        return fields.FloatField()
    raise TypeError(
        f"cannot infer an ffcv field for {name!r} from a {type(value).__name__}; pass fields= "
        "mapping each name to an ffcv Field (e.g. ffcv.fields.NDArrayField, IntField)"
    )


def _check_readable(name: str, field: Any) -> None:
    """Refuse, before anything is written, a field that ffcv writes but cannot read back: an
    ``NDArrayField`` of float16 (its loader's numba code has no float16; the file was written
    whole and the first batch failed inside ffcv's thread)."""
    if is_a(field, "ffcv", "NDArrayField") and np.dtype(field.dtype) == np.float16:
        raise ValueError(
            f"field {name!r} is a float16 NDArrayField, which ffcv writes but cannot read back "
            "(its loader has no float16); write it as float32 (e.g. images.astype(np.float32)), "
            "or as its bits (images.view(np.int16)) and view them as float16 after loading"
        )


def _encode(field: Any, value: Any) -> Any:
    """A sample value in the form ``field.encode`` expects, or raise ValueError."""
    value = _as_numpy(value)
    kind = type(field).__name__
    if kind in ("NDArrayField", "TorchTensorField"):
        arr = np.ascontiguousarray(value, dtype=field.dtype)
        if arr.shape != tuple(field.shape):
            raise ValueError(f"has shape {arr.shape}, but the field's shape is {field.shape}")
        return arr
    if kind == "IntField":
        arr = np.asarray(value)
        if arr.size != 1 or arr.dtype.kind not in "iub":
            raise ValueError(f"should be one integer, but got {value!r:.80}")
        return int(arr.reshape(()))
    if kind == "FloatField":
        return float(np.asarray(value).reshape(()))
    return value


def _indices_digest(indices: Any) -> str:
    """An FFCV Loader's ``indices`` (the examples it reads, in their order) in a few words.

    Example:
        >>> _indices_digest(np.arange(3)) == _indices_digest([0, 1, 2])
        True
        >>> _indices_digest([0, 1, 2]) == _indices_digest([2, 1, 0])
        False
    """
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    digest = hashlib.blake2b(idx.tobytes(), digest_size=8).hexdigest()
    return f"{idx.size} examples, digest {digest}"


class _Indexed:
    """The dataset as ffcv's writer reads it: samples in field order, each with its index.

    NOTE: FFCV's writer waits forever if a worker process dies (its main loop never checks the
    workers). So a sample that cannot be encoded never raises in a worker: it is written as the
    first sample, and its index is reported through shared memory; ``write_beton`` then raises
    and removes the file.
    """

    def __init__(
        self, dataset: Any, fields: Sequence[Any], failed: Any, keys: Sequence[Any] | None = None
    ) -> None:
        self.dataset, self.fields, self.failed = dataset, list(fields), failed
        self.keys = keys  # the entries of dict samples, in field order (None: tuple samples)

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, i: int) -> tuple[Any, ...]:
        values = self.dataset[i]
        if self.keys is not None:
            values = _entries(values, self.keys)
        if not isinstance(values, (tuple, list)):
            values = (values,)
        if len(values) != len(self.fields) - 1:
            raise ValueError(
                f"has {len(values)} fields, but {len(self.fields) - 1} names were given"
            )
        out = [_encode(f, v) for f, v in zip(self.fields, values)]
        return (*out, int(i))

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        try:
            return self.sample(i)
        except Exception:  # reported to the parent process, see the NOTE above
            with self.failed.get_lock():
                if self.failed.value < 0:
                    self.failed.value = int(i)
            return (*self.sample(0)[:-1], int(i))


def _entries(sample: Any, keys: Sequence[Any]) -> tuple[Any, ...]:
    """A dict sample's entries ``keys``, in that order (raise ValueError naming a missing one)."""
    if not isinstance(sample, Mapping):
        raise ValueError(f"is a {type(sample).__name__}, but sample 0 is a dict")
    missing = [k for k in keys if k not in sample]
    if missing:
        raise ValueError(f"has no entry {missing[0]!r} (the entries written: {list(keys)})")
    return tuple(sample[k] for k in keys)


class _Arrays:
    """Equal-length arrays as a map-style dataset of tuples."""

    def __init__(self, arrays: Sequence[Any]) -> None:
        if not len(arrays):
            raise ValueError("data holds no arrays; pass (images, labels) or a dataset")
        self.arrays = [_as_numpy(a) for a in arrays]
        n = len(self.arrays[0])
        for j, a in enumerate(self.arrays):
            if len(a) != n:
                raise ValueError(
                    f"array {j} has {len(a)} rows but array 0 has {n}; all arrays written to a "
                    ".beton need the same length"
                )

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return tuple(a[i] for a in self.arrays)


def write_beton(
    path: str | os.PathLike,
    data: Any,
    *,
    names: Sequence[str] | None = None,
    fields: Mapping[str, Any] | None = None,
    index_field: str = "index",
    num_workers: int = 1,
    chunksize: int = 100,
) -> Path:
    """Write a map-style dataset, or equal-length arrays, to a ``.beton`` with an index field.

    Every example ``i`` is stored with its data fields followed by ``index_field`` = ``i`` (an
    ``IntField``), so a loader over the file knows each example's dataset index exactly, in any
    order and with any number of workers.

    Args:
        path: the ``.beton`` file to write (overwritten).
        data: a map-style dataset whose items are tuples, dicts (their keys name the fields) or
            single values (a list of tuples or dicts is one), a tuple/list of arrays, tensors or
            lists of equal length (e.g. ``(images, labels)``), or a dict of them (its keys name
            the fields, e.g. ``{"image": images, "label": labels}``). Of dicts, the entries
            ``fields=`` or ``names=`` name are written, in that order (default: all, in order).
        names: field names, one per sample entry. Default: a dict's keys, else
            ``("image", "label")`` for two entries, ``("image",)`` for one, else required.
        fields: an ordered mapping from name to ffcv ``Field`` (overrides ``names``). Default:
            inferred from the first sample: arrays and tensors of one or more dimensions give an
            ``NDArrayField`` of their dtype and shape, integers an ``IntField`` (read back as
            int64), floats a ``FloatField`` (read back as float64; a warning says so for other
            float dtypes).
        index_field: the name of the index field appended to every sample.
        num_workers: writer processes.
        chunksize: samples per writer work item.

    Returns:
        the path written.

    Raises:
        ValueError: when a sample does not match the fields (naming the sample); the partial
            file is removed.

    Example:
        >>> import numpy as np
        >>> data = (np.zeros((8, 1, 4, 4), np.uint8), np.arange(8))
        >>> write_beton("toy.beton", data)  # doctest: +SKIP
        PosixPath('toy.beton')
        >>> FFCVSource(open_beton("toy.beton", 4)).outputs  # doctest: +SKIP
        ['image', 'label', 'index']
    """
    check_int("num_workers", num_workers, minimum=1)
    check_int("chunksize", chunksize, minimum=1)
    if not isinstance(index_field, str) or not index_field:
        raise TypeError(f"index_field should be a non-empty str, but got {index_field!r}")
    import_ffcv()
    writer_mod = sys.modules["ffcv.writer"]
    fields_mod = sys.modules["ffcv.fields"]
    # (a tuple or list of arrays is columns, (images, labels), also where a column is a list;
    # a list of samples, each a tuple or dict as a Dataset's items are, is a map-style dataset
    # as it is)
    samples = isinstance(data, list) and len(data) > 0 and isinstance(data[0], (tuple, Mapping))
    # (the entries of dicts, as named by fields=, else by names=, else by the dict's keys)
    chosen = list(fields) if fields is not None else None if names is None else list(names)
    keys: list[Any] | None = None
    if isinstance(data, Mapping):  # NOTE: read as a dataset, {"image": x} failed: KeyError: 0
        keys = list(data) if chosen is None else chosen
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(
                f"data has no entry {missing[0]!r} (its keys: {list(data)}); name its entries "
                "in names= or fields="
            )
        dataset: Any = _Arrays([data[k] for k in keys])
    elif isinstance(data, (tuple, list)) and not samples:
        dataset = _Arrays(data)
    else:
        dataset = data
    try:
        n = len(dataset)
    except TypeError:
        raise TypeError(
            "data should be a map-style dataset (with __len__ and __getitem__) or a tuple of "
            f"arrays, but got {type(data).__name__}"
        ) from None
    if n == 0:
        raise ValueError("data is empty; a .beton needs at least one example")
    first = dataset[0]
    dicts = isinstance(first, Mapping)  # a dataset of dict samples
    if dicts:
        keys = list(first) if chosen is None else chosen
        try:
            first = _entries(first, keys)
        except ValueError as e:
            raise ValueError(f"sample 0 {e}; name its entries in names= or fields=") from None
    first = tuple(first) if isinstance(first, (tuple, list)) else (first,)
    if fields is None:
        if names is None and keys is not None:
            names = [str(k) for k in keys]
        if names is None:
            defaults = {1: ("image",), 2: ("image", "label")}
            if len(first) not in defaults:
                raise ValueError(
                    f"the samples have {len(first)} entries; pass names= (one name per entry) "
                    "or fields="
                )
            names = defaults[len(first)]
        names = list(names)
        if len(names) != len(first):
            raise ValueError(
                f"names should have one name per sample entry ({len(first)}), but got "
                f"names={names!r}"
            )
        fields = {name: _infer_field(name, v) for name, v in zip(names, first)}
    fields = dict(fields)
    for name, field in fields.items():
        _check_readable(name, field)
    if index_field in fields:
        raise ValueError(
            f"index_field={index_field!r} is also a data field name; pass another index_field="
        )
    fields[index_field] = fields_mod.IntField()
    failed = multiprocessing.Value("q", -1)
    indexed = _Indexed(dataset, list(fields.values()), failed, keys if dicts else None)
    try:
        indexed.sample(0)  # fail early, in this process, on a bad first sample
    except ValueError as e:
        raise ValueError(f"sample 0 {e}; pass fields= matching the data") from None
    path = Path(path)
    _settle_before_fork()  # the writer forks its worker processes
    with preserved_threads():
        writer = writer_mod.DatasetWriter(str(path), fields, num_workers=num_workers)
        writer.from_indexed_dataset(indexed, chunksize=chunksize)
    if failed.value >= 0:
        bad = int(failed.value)
        path.unlink(missing_ok=True)
        try:
            indexed.sample(bad)
            reason = "could not be encoded"
        except Exception as e:  # reported with the sample's index
            reason = str(e)
        raise ValueError(
            f"sample {bad} {reason}; every sample must match the fields {list(fields)} "
            "(pass fields= to set them explicitly)"
        )
    return path


# ---------------------------------------------------------------------------------- reading
def _default_pipeline(field: Any) -> list[Any] | None:
    decoders = sys.modules["ffcv.fields.decoders"]
    to_tensor = sys.modules["ffcv.transforms"].ToTensor
    kind = type(field).__name__
    if kind in ("NDArrayField", "TorchTensorField"):
        return [decoders.NDArrayDecoder(), to_tensor()]
    if kind == "IntField":
        return [decoders.IntDecoder(), to_tensor()]
    if kind == "FloatField":
        return [decoders.FloatDecoder(), to_tensor()]
    return None  # ffcv's default pipeline for other fields


def _check_workers(num_workers: int) -> int:
    """num_workers, resolved like ffcv does, or raise naming the fix for numba's thread limit."""
    import numba

    resolved = multiprocessing.cpu_count() if num_workers < 1 else num_workers
    limit = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if resolved > limit:
        raise ValueError(
            f"num_workers={num_workers} asks for {resolved} FFCV threads, but numba allows at "
            f"most NUMBA_NUM_THREADS={limit}; pass num_workers<={limit}, or set the environment "
            f"variable NUMBA_NUM_THREADS>={resolved} before numba is first imported"
        )
    return resolved


def open_beton(
    path: str | os.PathLike,
    batch_size: int,
    *,
    order: Any = "sequential",
    seed: int = 0,
    num_workers: int = 1,
    drop_last: bool = False,
    batches_ahead: int = 3,
    pipelines: Mapping[str, Any] | None = None,
    indices: Sequence[int] | np.ndarray | None = None,
    **kwargs: Any,
) -> Any:
    """An FFCV ``Loader`` over ``path``, built without changing torch's or numba's thread counts.

    Defaults differ from ffcv's on purpose: every example each epoch (``drop_last=False``; ffcv's
    default drops the last partial batch), an explicit ``seed`` (ffcv's default draws one from
    numpy's global generator), one worker thread, and tensors for every array, int and float
    field (``[Decoder(), ToTensor()]``).

    Args:
        path: the ``.beton`` file.
        batch_size: examples per batch.
        order: ``"sequential"``, ``"random"`` (a permutation that is a pure function of seed and
            epoch) or ``"quasi_random"``; or ffcv's ``OrderOption`` of one of them.
        seed: the order's seed.
        num_workers: FFCV's decoding threads (at most numba's ``NUMBA_NUM_THREADS``).
        drop_last: drop the last partial batch of each epoch.
        batches_ahead: batches FFCV prepares in advance (>= 1; ffcv's 0 is broken).
        pipelines: per-field pipelines, overriding the defaults (``None`` disables a field).
        indices: a subset of the file's examples to load (dataset indices, each in
            ``[0, N)`` for a file of ``N`` examples; checked, as FFCV reads past its tables).
        **kwargs: passed to ``ffcv.loader.Loader``.

    Example:
        Over the toy file of :func:`write_beton`'s example (8 examples), and arguments refused
        before ffcv is imported:

        >>> loader = open_beton("toy.beton", 3, order="random", seed=0)  # doctest: +SKIP
        >>> type(loader).__name__, len(loader), loader.drop_last  # doctest: +SKIP
        ('Loader', 3, False)
        >>> open_beton("toy.beton", 3, order="shuffle")
        Traceback (most recent call last):
            ...
        ValueError: order should be one of 'sequential', 'random', 'quasi_random', but got ...
    """
    check_int("batch_size", batch_size, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("num_workers", num_workers)
    check_int("batches_ahead", batches_ahead, minimum=1)
    if is_a(order, "ffcv", "OrderOption"):  # (ffcv's own enum, as ffcv's Loader takes it)
        order = order.name.lower()
    order = check_choice("order", order, _ORDERS)
    # (a string "False" read by its truth value dropped the last batch, unsaid)
    drop_last = check_bool("drop_last", drop_last)
    if kwargs.get("distributed"):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "open_beton(..., distributed=True) reads this process's share of the file, which "
                "needs torch.distributed initialised first; call "
                "torch.distributed.init_process_group(...) before open_beton (as torchrun's "
                "scripts do), or pass distributed=False on one process"
            )
    import_ffcv()
    _check_workers(num_workers)
    loader_mod = sys.modules["ffcv.loader"]
    reader_mod = importlib.import_module("ffcv.reader")
    reader = reader_mod.Reader(str(path))
    handlers = reader.handlers
    if indices is not None:
        indices = _check_subset(indices, int(reader.num_samples))
    specs: dict[str, Any] = {}
    for name, field in handlers.items():
        pipe = _default_pipeline(field)
        if pipe is not None:
            specs[name] = pipe
    specs.update(pipelines or {})
    with preserved_threads():
        return loader_mod.Loader(
            str(path),
            batch_size=batch_size,
            num_workers=num_workers,
            order=getattr(loader_mod.OrderOption, order.upper()),
            seed=seed,
            drop_last=drop_last,
            batches_ahead=batches_ahead,
            pipelines=specs,
            indices=indices,
            **kwargs,
        )


def _check_subset(indices: Any, num_samples: int, name: str = "indices=") -> np.ndarray:
    """An FFCV Loader's ``indices=``, checked: 1-d integers in ``[0, num_samples)``.

    NOTE: FFCV reads an example's data and fields at whatever position it is given, without a
    bounds check: an index past the end read memory beyond the file's tables (garbage images
    and index field, or a crash), a negative one wrapped around to the end, and a float one
    failed only in FFCV's batch thread, at the first batch.

    Example:
        >>> _check_subset([2, 0], 3).tolist()
        [2, 0]
        >>> _check_subset([0, 3], 3)
        Traceback (most recent call last):
            ...
        ValueError: indices= should be dataset indices in [0, 3) (the .beton has 3 ...), but holds 3
    """
    idx = np.asarray(indices)
    if idx.size == 0 and idx.ndim == 1:
        return idx.astype(np.int64)  # (an empty list reads as float64)
    if idx.ndim != 1 or idx.dtype.kind not in "iu":
        raise TypeError(
            f"{name} should be a 1-d sequence of integer dataset indices, but got a "
            f"{idx.ndim}-d array of {idx.dtype}"
        )
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= num_samples:
        raise ValueError(
            f"{name} should be dataset indices in [0, {num_samples}) (the .beton has "
            f"{num_samples} examples), but holds {low if low < 0 else high}"
        )
    return idx


def _field_kind(loader: Any, name: str) -> str | None:
    """The ffcv field class name an output comes from (None for a computed output)."""
    spec = loader.pipeline_specs.get(name)
    source = getattr(spec, "source", name)
    field = loader.reader.handlers.get(source if isinstance(source, str) else name)
    return None if field is None else type(field).__name__


def _quasi_pages(order: Any) -> np.ndarray | None:
    """A ``QUASI_RANDOM`` order's table of each page's examples as ffcv builds it, unshuffled (a
    copy), or None for another order.

    NOTE: ffcv's ``QuasiRandom.sample_order(epoch)`` shuffles that table in place before drawing
    from it, so epoch ``e``'s order depended on every order drawn before (the Loader draws one
    when it is built): a run restarted from a state saved at an epoch boundary read other
    orders than the uninterrupted run, and a loader scored first (``el2n_scores``) trained on
    other orders. Restoring this table before each epoch makes the order a function of seed and
    epoch, as the other orders are.
    """
    if not is_a(order, "ffcv", "QuasiRandom") or not hasattr(order, "prepare_data_structures"):
        return None
    order.prepare_data_structures()  # (rebuilds the table from the file's pages)
    return np.array(order.page_to_samples_array, copy=True)


def _stop_epoch_iterator(it: Any) -> None:
    """Stop an FFCV ``EpochIterator`` (finished or abandoned), wait for its thread, then close it.

    NOTE (an abandoned FFCV epoch): ffcv's ``EpochIterator.close()`` only sets a flag that its
    batch thread checks between 0.5 s waits to hand over a batch, and then immediately ends the
    epoch's page reads (``memory_context.__exit__``), possibly under the thread's feet. Once the
    thread has produced the epoch's last batch it waits for room in its full queue without a
    timeout (``output_queue.put(None)``), so an epoch abandoned within ``batches_ahead`` batches
    of its end leaves that thread blocked for the rest of the process, however often ``close()``
    is called. So, in this order: take the batches the thread has not started
    (exhausting its ``iter_ixes``), so that it computes nothing more; set its terminate flag;
    take what it queued until it has ended (emptying the queue unblocks the final ``put``; as
    nothing more is computed, no buffer the caller may still hold is written); join it; and only
    then close the epoch's reads, once (``closed`` is ffcv's own flag, which it never sets).
    """
    if isinstance(it, threading.Thread) and it is not threading.current_thread():
        pending = getattr(it, "iter_ixes", None)
        if pending is not None:
            for _ in pending:  # the thread's next `next(iter_ixes)` ends its loop
                pass
        stop = getattr(it, "terminate_event", None)
        if stop is not None:
            stop.set()
        output = getattr(it, "output_queue", None)
        while it.is_alive():
            if output is not None:
                try:
                    while True:
                        output.get_nowait()
                except queue.Empty:
                    pass
            it.join(timeout=0.05)
    if getattr(it, "closed", False):
        return
    close = getattr(it, "close", None)
    if close is not None:
        close()
        with contextlib.suppress(AttributeError):
            it.closed = True


def _next_batch(it: Any, epoch: int, taken: int) -> Any:
    """The next batch of an FFCV ``EpochIterator``, or None at the end of its epoch.

    NOTE (an FFCV batch thread that died): an exception in FFCV's batch thread (a pipeline step
    that raises) ends the thread without ending its output queue, and FFCV's ``__next__``
    (``output_queue.get()``) then waits forever. So this waits for a batch on the queue's own
    condition (woken by each put, as ``get`` is) while checking that the thread is alive, and
    raises once it has died with nothing queued. Checked under the queue's lock, which every
    put takes: an empty queue with a dead thread can never fill.

    Args:
        it: FFCV's ``EpochIterator`` (anything else is advanced with ``next`` as it is).
        epoch: the epoch, for the error message.
        taken: batches taken from ``it`` so far, for the error message.

    Raises:
        RuntimeError: when FFCV's batch thread died before the end of the epoch.
    """
    output = getattr(it, "output_queue", None)
    # NOTE: a queued batch needs no check (the common case, read without the lock: only this
    # thread takes from the queue, so a batch seen there is still there for ``next``).
    if isinstance(output, queue.Queue) and not output.queue and isinstance(it, threading.Thread):
        with output.not_empty:
            while not output.queue and it.is_alive():
                output.not_empty.wait(0.1)
            died = not output.queue
        if died:
            raise RuntimeError(
                f"FFCV's batch thread ended in epoch {epoch} after {taken} batches without "
                "finishing the epoch: a step of the FFCV loader's pipeline raised (FFCV printed "
                "its traceback above, on stderr); fix that pipeline step"
            )
    return next(it, None)


class FFCVSource(Source):
    """An FFCV ``Loader`` as a SelectiveLoader source, with every example's dataset index.

    Batches keep FFCV's structure (a tuple in the order of the loader's outputs); scalar int and
    float fields, which FFCV returns with shape ``(B, 1)``, are flattened to ``(B,)`` so that
    labels suit ``nn.CrossEntropyLoss``, and the index field is kept in the batch as well.

    Epochs: the source sets the FFCV loader's epoch counter to the SelectiveLoader's epoch before
    each pass, so epoch ``e``'s order is FFCV's order for epoch ``e`` whatever happened before
    (a restarted run gets the same orders; for ``QUASI_RANDOM``, whose ffcv order shuffles a
    table in place, the source restores that table before each pass).

    Mid-epoch resume: FFCV's ``SEQUENTIAL`` and ``RANDOM`` orders are a pure function of seed and
    epoch, so the source replays the epoch and discards the batches already consumed (FFCV
    decodes fast; nothing else is needed). ``QUASI_RANDOM`` is not a pure function of the
    epoch (it shuffles persistent state in place), so such a loader resumes only at epoch
    boundaries, as does a loader whose seed, batch size, ``indices=``, ``drop_last`` or
    ``distributed`` differs from the saved one (the state records them; states saved before
    it recorded the last three are not checked for them).

    Args:
        loader: an ``ffcv.loader.Loader`` (e.g. from :func:`open_beton`).
        index_field: the output holding dataset indices, by name or position (default
            ``"index"``, as written by :func:`write_beton`), or ``None`` to recover the indices
            from the loader's traversal order (``SEQUENTIAL`` and ``RANDOM`` orders only).

    Raises:
        TypeError: when ``loader`` is no FFCV ``Loader``, or its ``indices`` are no integers.
        ValueError: for an ``index_field`` that names no output, ``index_field=None`` with an
            order indices cannot be recovered from, ``batches_ahead`` < 1, or ``indices``
            outside the file's examples.

    Thread counts: FFCV's ``iter(loader)`` and its batch thread set torch's and numba's thread
    counts to ``num_workers``; the source restores them as soon as the first batch of each epoch
    has arrived, before anything else runs.

    Example:
        Six examples in batches of 4, in FFCV's random order (labels flattened to ``(B,)``):

        >>> import numpy as np
        >>> data = (np.arange(6, dtype=np.float32).reshape(6, 1) * 10, np.arange(6) % 2)
        >>> path = write_beton("toy.beton", data)  # doctest: +SKIP
        >>> src = FFCVSource(open_beton(path, 4, order="random", seed=0))  # doctest: +SKIP
        >>> src.outputs, len(src), src.dataset_size  # doctest: +SKIP
        (['image', 'label', 'index'], 2, 6)
        >>> [(y.tolist(), idx.tolist()) for (_, y, _), idx in src.epoch()]  # doctest: +SKIP
        [([1, 0, 1, 0], [3, 2, 5, 4]), ([0, 1], [0, 1])]
        >>> FFCVSource([1, 2])
        Traceback (most recent call last):
            ...
        TypeError: loader should be an ffcv.loader.Loader, but got list
    """

    STATE_VERSION = 1

    def __init__(self, loader: Any, *, index_field: str | int | None = "index") -> None:
        if not is_ffcv_loader(loader):
            raise TypeError(
                f"loader should be an ffcv.loader.Loader, but got {type(loader).__name__}"
            )
        batches_ahead = getattr(loader, "batches_ahead", 1)
        if batches_ahead < 1:
            # NOTE: ffcv's output queue is then unbounded (queue.Queue(0)): its batch thread
            # writes the whole epoch into its 2 buffers without waiting for the caller.
            raise ValueError(
                f"the FFCV loader has batches_ahead={batches_ahead}, with which FFCV overwrites "
                "each batch while it is being used (its queue of batches is then unbounded); "
                "build the Loader with batches_ahead=1 or more (open_beton's default is 3)"
            )
        # (also for a Loader built without open_beton, which checks them first)
        _check_subset(loader.indices, int(loader.reader.num_samples), "the FFCV Loader's indices=")
        self.loader = loader
        self.outputs: list[str] = list(loader.pipeline_specs)
        if isinstance(index_field, int) and not isinstance(index_field, bool):
            if not -len(self.outputs) <= index_field < len(self.outputs):
                raise ValueError(
                    f"index_field={index_field} is no position in this FFCV loader's outputs "
                    f"{self.outputs}; pass the index field's name or position"
                )
            index_field = self.outputs[index_field]
        self.order_name = type(loader.traversal_order).__name__
        if index_field is None:
            if self.order_name not in _PURE_ORDERS:
                raise ValueError(
                    f"index_field=None recovers indices from the traversal order, which is not "
                    f"reproducible for FFCV's {self.order_name} order; write the .beton with "
                    "sbloader.ffcv.write_beton (it adds an index field) and pass "
                    "index_field='index', or use order SEQUENTIAL or RANDOM"
                )
            self.index_pos: int | None = None
        else:
            if index_field not in self.outputs:
                raise ValueError(
                    f"index_field={index_field!r} names no output of this FFCV loader (outputs: "
                    f"{self.outputs}); write the .beton with sbloader.ffcv.write_beton, which "
                    "adds an index field, or pass SelectiveLoader the source "
                    "sbloader.ffcv.FFCVSource(loader, index_field=None), which recovers indices "
                    "from the traversal order (SEQUENTIAL and RANDOM orders)"
                )
            self.index_pos = self.outputs.index(index_field)
        self.index_field = index_field
        self._flatten = [
            _field_kind(loader, name) in ("IntField", "FloatField") for name in self.outputs
        ]
        self._epoch = 0
        self._quasi_pages = _quasi_pages(loader.traversal_order)
        # NOTE: besides the order, seed and batch size, what decides which examples an epoch's
        # batches hold (FFCV fixes them when the Loader is built): a mid-epoch resume with
        # others would skip the consumed batches of another sequence of examples.
        self._identity = {
            "indices": _indices_digest(loader.indices),
            "drop_last": bool(loader.drop_last),
            "distributed": bool(loader.distributed),
        }

    # ------------------------------------------------------------------ Source API
    def has_indices(self) -> bool:
        return True

    def index_field_key(self) -> int | None:
        """The position of the index output in the batches (None when recovered)."""
        return self.index_pos

    def drop_last(self) -> bool:
        return bool(self.loader.drop_last)

    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)

    def reuses_buffers(self) -> bool:
        return True

    def check_prefetch(self, prefetch: int) -> None:
        """Refuse ``prefetch`` > 0: FFCV's buffers would be overwritten under the loader.

        NOTE: FFCV's batch thread writes batch ``b + batches_ahead + 2`` into batch ``b``'s
        buffers as soon as batch ``b + 1`` is taken. A prefetch thread takes batches ahead of
        the batch the loader is selecting from, so that batch (and those queued behind it) were
        overwritten while in use: images, labels and indices no longer belonged together.

        Raises:
            ValueError: naming ``prefetch=`` and FFCV's ``batches_ahead``, when ``prefetch`` > 0.
        """
        if prefetch:
            raise ValueError(
                f"prefetch={prefetch} cannot be used with an FFCV loader: FFCV reuses a ring of "
                "batches_ahead + 2 buffers, and batches fetched ahead on sbloader's thread are "
                "overwritten before they are used; pass prefetch=0 (the default for FFCV) and "
                "let FFCV fetch ahead itself (open_beton(..., batches_ahead=...))"
            )

    def mid_epoch_refusal(self) -> str | None:
        # NOTE: the loader warns with this when it takes a state mid-epoch: a run checkpointing
        # every few steps over a QUASI_RANDOM order learned only at its resume that none of its
        # mid-epoch checkpoints could be loaded (load_state_dict refuses them, see below).
        if self.order_name in _PURE_ORDERS:
            return None
        return (
            f"FFCV's {self.order_name} order is not a pure function of seed and epoch, so the "
            "batches consumed cannot be replayed; use order SEQUENTIAL or RANDOM to resume "
            "mid-epoch"
        )

    def _order_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's dataset indices batch by batch, as FFCV's EpochIterator chunks them."""
        loader = self.loader
        order = np.asarray(loader.traversal_order.sample_order(epoch), dtype=np.int64)
        order = order[: len(loader) * loader.batch_size]
        bs = loader.batch_size
        return [order[i : i + bs] for i in range(0, len(order), bs)]

    def _flat(self, pos: int, value: Any) -> Any:
        if self._flatten[pos] and value.ndim == 2 and value.shape[1] == 1:
            return value.reshape(-1)
        return value

    def epoch(
        self, skip: int = 0, keep: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> Iterator[tuple[Any, np.ndarray]]:
        # NOTE: can_filter is False: FFCV fixes an epoch's batches before any example is known
        # to the caller, so ``keep`` is ignored and the loader drops rejected rows after loading.
        loader = self.loader
        epoch = self._epoch
        self._epoch += 1
        recovered = None if self.index_pos is not None else self._order_batches(epoch)
        # NOTE: FFCV draws the epoch's order from its own counter; setting it makes the order a
        # function of the SelectiveLoader's epoch alone (exact resume, repeated runs agree).
        loader.next_epoch = epoch
        if self._quasi_pages is not None:  # (see _quasi_pages)
            np.copyto(loader.traversal_order.page_to_samples_array, self._quasi_pages)
        it = None
        try:
            with preserved_threads():
                it = iter(loader)
                # NOTE: FFCV's batch thread calls torch.set_num_threads when it starts, which is
                # before it hands out the first batch: restoring after that batch is race-free.
                first = _next_batch(it, epoch, 0)
            b = 0
            batch = first
            while batch is not None:
                if b >= skip:
                    yield self._convert(batch, b, recovered)
                b += 1
                batch = _next_batch(it, epoch, b)
        finally:
            # Also on close() or garbage collection of this generator (GeneratorExit): an
            # abandoned epoch's batch thread is stopped and joined here, see the NOTE there.
            if it is not None:
                _stop_epoch_iterator(it)

    def _convert(
        self, batch: Any, b: int, recovered: list[np.ndarray] | None
    ) -> tuple[Any, np.ndarray]:
        values = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if len(values) != len(self.outputs):
            raise ValueError(
                f"the FFCV loader yielded {len(values)} outputs but declares {self.outputs}; "
                "sbloader cannot tell which output holds the indices"
            )
        values = tuple(self._flat(j, v) for j, v in enumerate(values))
        if recovered is not None:
            indices = recovered[b]
            if len(indices) != len(values[0]):
                raise RuntimeError(
                    f"FFCV batch {b} has {len(values[0])} examples but its traversal order has "
                    f"{len(indices)}; pass index_field= with an index field instead"
                )
        else:
            assert self.index_pos is not None  # an index field was named
            # NOTE: a copy, not a view of FFCV's reused buffer: indices outlive the batch.
            indices = check_indices(
                f"the index field {self.index_field!r}", values[self.index_pos]
            ).copy()
        return values, indices

    def state_dict(self) -> dict[str, Any]:
        return {
            VERSION: self.STATE_VERSION,
            "seed": int(self.loader.seed) if self.loader.seed is not None else None,
            "order": self.order_name,
            "num_samples": int(self.loader.reader.num_samples),
            "batch_size": int(self.loader.batch_size),
            # NOTE: FFCV's own epoch counter, which a bare ``iter(loader)`` draws its order
            # from: put back by load_state_dict, so that a pass over the source that is then
            # undone (el2n_scores's) leaves the order of FFCV's next epoch as it was.
            "next_epoch": int(self.loader.next_epoch),
            **self._identity,
        }

    def load_state_dict(self, state: dict[str, Any], mid_epoch: bool = False) -> None:
        # (a state without a version is one saved before the source had one: version 0)
        state = check_version(
            {VERSION: 0, **state}, "FFCVSource", self.STATE_VERSION, {0: ffcv_state_v0_to_v1}
        )
        if state.get("num_samples") != int(self.loader.reader.num_samples):
            raise ValueError(
                f"the saved FFCV source read {state.get('num_samples')} examples but this "
                f"loader's file has {self.loader.reader.num_samples}; open the same .beton"
            )
        if state.get("next_epoch") is not None:  # (absent from states saved before it was kept)
            self.loader.next_epoch = int(state["next_epoch"])
        if not mid_epoch:
            return
        if self.order_name not in _PURE_ORDERS:
            raise ValueError(
                f"cannot resume an FFCV {self.order_name} order in the middle of an epoch: it is "
                "not a pure function of seed and epoch; save at an epoch boundary, or use "
                "order SEQUENTIAL or RANDOM"
            )
        same = (
            state.get("order") == self.order_name
            and state.get("batch_size") == int(self.loader.batch_size)
            and (self.order_name == "Sequential" or state.get("seed") == self.loader.seed)
        )
        if not same:
            raise ValueError(
                "cannot resume in the middle of an epoch: the saved FFCV loader had "
                f"order={state.get('order')}, seed={state.get('seed')}, "
                f"batch_size={state.get('batch_size')}, but this one has "
                f"order={self.order_name}, seed={self.loader.seed}, "
                f"batch_size={self.loader.batch_size}; build the Loader with the saved ones"
            )
        check_identity(
            "FFCVSource",
            state,
            self._identity,
            "build the FFCV Loader with the saved run's indices=, drop_last= and distributed= "
            "to resume in the middle of an epoch, or resume from a state saved at an epoch "
            "boundary",
        )

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int | None:
        return int(self.loader.batch_size)

    @property
    def dataset_size(self) -> int | None:
        """The number of examples in the ``.beton`` (dataset indices are below it)."""
        return int(self.loader.reader.num_samples)

    @property
    def epoch_size(self) -> int | None:
        """Examples per epoch: the loader's ``indices`` (this rank's share when distributed),
        less a dropped last partial batch."""
        loader = self.loader
        return min(len(loader.first_traversal_order), len(loader) * int(loader.batch_size))
