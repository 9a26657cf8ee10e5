"""A cache of a frozen prefix's outputs across epochs, keyed by dataset index."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ._checks import check_bool, check_cuda_present, check_device_name, check_int, indices_needed
from ._forward_state import hook_keys
from ._state import check_identity, check_version, taking_rollback

__all__ = ["FeatureCache", "make_feature_cache", "prefix_digest"]


class FeatureCache:
    """The frozen prefix's output for each dataset index, computed once and reused every epoch.

    Valid only when an example's input is the same every epoch (no random augmentation) and the
    prefix never changes; :meth:`check` verifies the first on a few cached examples per epoch.
    Storage is allocated on first use, ``size`` rows of the output's shape, in ``store_dtype``
    (e.g. bfloat16 to halve the memory; it rounds outputs of a wider dtype), or by default in
    the outputs' own dtype; :meth:`get` returns rows in the dtype they were given in.

    NOTE: the cache is part of a loader's checkpoint only when asked (``in_state``; it can take
    gigabytes); otherwise after a resume it fills again as examples are seen, with outputs that
    may differ from the first ones in the last bits where the prefix's kernels depend on the
    batch they run in, so the resumed run is not bit-exact.

    Args:
        size: the number of dataset indices.
        device: where the rows live (e.g. ``"cpu"`` to keep a large cache off the GPU); None:
            where the first outputs are.
        store_dtype: the storage dtype; None stores the outputs' own dtype.
        in_state: :meth:`state_dict` holds the rows (a copy on the CPU), so that a resumed run
            uses the outputs the saved run cached (bit-exact); else it holds none.

    Example:
        >>> cache = FeatureCache(10, "cpu")
        >>> idx = np.array([3, 7])
        >>> cache.missing(idx).tolist()
        [0, 1]
        >>> cache.put(idx, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        >>> cache.missing(np.array([7, 8])).tolist(), cache.get(np.array([7, 3])).tolist()
        ([1], [[3.0, 4.0], [1.0, 2.0]])
    """

    #: Examples recomputed per epoch by :meth:`check` (a random flip changes about half of
    #: them: 16 miss it with probability 2**-16); float32 ones twice (see its calibration).
    CHECKED = 16
    #: Largest relative L2 difference between a recomputed and a cached output that :meth:`check`
    #: accepts where outputs are kept in a reduced precision (bf16 rounds to about 4e-3) or may
    #: come from TF32 kernels (a CUDA cache while torch allows TF32): a random crop differs by
    #: more, a horizontal flip through a pooled backbone (1-2%) may not. NOTE: other float32
    #: outputs get :attr:`TOLERANCE_FP32`, far below a flip and far above another batch's
    #: kernels (2.4e-7 measured on a CPU).
    TOLERANCE = 0.05
    #: The same for float32 outputs.
    TOLERANCE_FP32 = 1e-3

    VERSION = 1

    def __init__(
        self,
        size: int,
        device: torch.device | str | None = None,
        store_dtype: torch.dtype | None = None,
        in_state: bool = False,
    ) -> None:
        self.size = check_int("size", size, minimum=0)
        if store_dtype is not None and not isinstance(store_dtype, torch.dtype):
            raise TypeError(
                "store_dtype should be a torch.dtype such as torch.bfloat16, or None to store the "
                f"outputs' own dtype, but got store_dtype={store_dtype!r}"
            )
        self.device = None if device is None else check_device_name("device", device)
        self.store_dtype = store_dtype
        self.values: torch.Tensor | None = None
        self.out_dtype: torch.dtype | None = None
        self.filled = np.zeros(self.size, dtype=bool)
        self._checked_epoch: int | None = None
        self.in_state = check_bool("in_state", in_state)
        # The prefix's modules and weights as the rows were computed (see :meth:`follow`), and the
        # epoch of the last look at them.
        self._signature: tuple[tuple[Any, ...], ...] | None = None
        self._followed_epoch: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored rows (0 before the first :meth:`put`)."""
        return 0 if self.values is None else self.values.numel() * self.values.element_size()

    def missing(self, indices: np.ndarray) -> np.ndarray:
        """Positions (into ``indices``) of the examples not cached yet."""
        return np.flatnonzero(~self.filled[indices])

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        if self.device is None:
            self.device = like.device
        dtype = self.store_dtype or like.dtype
        shape = (self.size, *like.shape[1:])
        try:
            return torch.empty(shape, dtype=dtype, device=self.device)
        except (RuntimeError, MemoryError) as e:
            gib = self.size * like[0].numel() * torch.empty((), dtype=dtype).element_size() / 2**30
            raise MemoryError(
                f"cache_features needs {gib:.1f} GiB on {self.device} for {self.size} examples "
                f"of shape {tuple(like.shape[1:])} ({dtype}); pass cache_features='cpu' to keep "
                "it in host memory, end frozen_prefix with a pooling layer so that it outputs "
                "less per example, or pass cache_features=False"
            ) from e

    def put(self, indices: np.ndarray, features: torch.Tensor) -> None:
        """Store the outputs of ``indices`` (one row each)."""
        if self.values is None:
            self.values = self._allocate(features)
            self.out_dtype = features.dtype
        elif tuple(features.shape[1:]) != tuple(self.values.shape[1:]):
            raise ValueError(
                f"frozen_prefix returned outputs of shape {tuple(features.shape[1:])} per "
                f"example, but earlier ones had shape {tuple(self.values.shape[1:])}; "
                "cache_features needs outputs of one shape (inputs of one size)"
            )
        assert self.device is not None
        rows = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)).to(self.device)
        self.values.index_copy_(0, rows, features.detach().to(self.device, self.values.dtype))
        self.filled[indices] = True

    def get(self, indices: np.ndarray, device: torch.device | None = None) -> torch.Tensor:
        """The cached outputs of ``indices`` (all cached), on ``device`` (default: the cache's)."""
        assert self.values is not None and self.out_dtype is not None
        rows = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)).to(self.device)
        out = self.values.index_select(0, rows).to(self.out_dtype)
        return out if device is None else out.to(device, non_blocking=True)

    def follow(self, prefix: nn.Module, epoch: int) -> None:
        """Once per epoch: empty the cache where the prefix changed since the rows were
        computed: its parameters or buffers changed in place (``load_state_dict``, an in-place
        update) or were given new data (``p.data = ...``), were cast to another dtype or moved
        to another device (``prefix.to(...)``, ``prefix.half()``), one of its layers was
        replaced (also by one without parameters), or a forward hook (or pre-hook) was
        registered or removed on one of its modules, so that they are computed again by the
        prefix as it is now (and stored in its outputs' dtype).

        NOTE: before, rows computed by the old weights were handed out as the new prefix's
        features: silently where the weights changed little, else :meth:`check` refused them
        blaming a changed input (random augmentation). Torch's version counters of the tensors
        (and their identities) tell a change without reading the weights; ``Module.to`` keeps
        both (it sets each tensor's ``.data``), so their dtypes and devices are compared too:
        a prefix cast to float64 was handed its float32 rows, and its float64 head failed in
        the selection pass (``mat1 and mat2 must have the same dtype``). A replaced layer
        without parameters (an activation) changes no tensor: the modules are compared too.
        Weights assigned through ``.data`` (``nn.utils.vector_to_parameters``) keep both the
        identity and the version: the storage's address is compared too (found by review).
        A hook changes the outputs and no tensor: the keys of the hooks' registries are
        compared too (:func:`~sbloader._forward_state.hook_keys`; before, a hook scaling the
        features by 1.0005 left the old rows handed out, and one scaling them by 2 was refused
        as a changed input).

        NOTE (not the public attributes, which the selection copy of ``overlap_selection``
        follows): a prefix that counts its examples in an attribute, or keeps its last outputs
        in one, sets a new object at every forward, and the cache, emptied at every epoch,
        computed every row again, unsaid. A changed attribute that changes the outputs (a
        BatchNorm's ``eps``) is still caught by :meth:`check`'s recomputed rows where it moves
        them past its tolerance (refused, as a changed input).
        """
        if self._followed_epoch == epoch:
            return
        self._followed_epoch = epoch
        tensors = (*prefix.parameters(), *prefix.buffers())
        signature = (
            tuple((id(m), type(m)) for m in prefix.modules()),
            tuple((id(t), t._version, t.data_ptr(), t.dtype, t.device) for t in tensors),
            hook_keys(prefix),
        )
        if self._signature is not None and signature != self._signature:
            self.filled[:] = False
            self._checked_epoch = None
            # (allocated again at the next put, in the dtype the prefix returns now)
            self.values, self.out_dtype = None, None
        self._signature = signature

    def tolerance(self, device: torch.device) -> float:
        """:attr:`TOLERANCE_FP32` for outputs kept in float32 (or float64) and computed on
        ``device`` without TF32 kernels, else :attr:`TOLERANCE` (a CUDA device while torch
        allows TF32 convolutions or matmuls: recomputed in another batch, outputs may differ by
        about 1e-3, wherever the cache is kept)."""
        kept = self.values.dtype if self.values is not None else self.store_dtype
        tf32 = device.type == "cuda" and (
            torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
        )
        full = kept in (None, torch.float32, torch.float64) and not tf32
        return self.TOLERANCE_FP32 if full else self.TOLERANCE

    def check(
        self,
        epoch: int,
        indices: np.ndarray,
        inputs: torch.Tensor,
        compute: Callable[[torch.Tensor], torch.Tensor],
    ) -> int:
        """Once per epoch: recompute the outputs of a few cached candidates and compare; returns
        how many examples the prefix ran on.

        Args:
            epoch: the loader's epoch (one check each).
            indices: the candidates' dataset indices, one per row of ``inputs``.
            inputs: the candidates' inputs as loaded now.
            compute: runs the frozen prefix on some inputs.

        Raises:
            ValueError: when an output differs from the cached one by more than
                :meth:`tolerance` (relative L2): the example's input changed since it was cached.
        """
        if self._checked_epoch == epoch:
            return 0
        hits = np.flatnonzero(self.filled[indices])[: self.CHECKED]
        if not len(hits):
            return 0  # nothing cached among these candidates yet: check a later batch
        self._checked_epoch = epoch
        pos = torch.from_numpy(hits).to(inputs.device)
        fresh = compute(inputs.index_select(0, pos)).float().flatten(1)
        forwards = len(hits)
        tolerance = self.tolerance(fresh.device)
        if tolerance < self.TOLERANCE and len(hits) >= 2:
            # NOTE (calibration): the same inputs in two halves, against the whole: what another
            # batch alone changes. A prefix whose outputs depend on the rest of the batch
            # (dynamic int8 quantization: about 4%) is then held to ten times that, at most
            # TOLERANCE, instead of being refused as if its inputs had changed.
            half = len(hits) // 2
            split = torch.cat(
                [compute(inputs.index_select(0, p)) for p in (pos[:half], pos[half:])]
            )
            split = split.float().flatten(1)
            forwards += len(hits)
            noise = float(_relative(split, fresh).max())
            tolerance = min(self.TOLERANCE, max(tolerance, 10 * noise))
        cached = self.get(indices[hits], fresh.device).float().flatten(1)
        diff = _relative(fresh, cached)
        worst = int(diff.argmax())
        if float(diff[worst]) > tolerance:
            raise ValueError(
                f"cache_features: example {int(indices[hits[worst]])}'s frozen_prefix output "
                f"differs from the one cached in an earlier epoch (relative difference "
                f"{float(diff[worst]):.3g}, more than the {tolerance:.3g} allowed), so its input "
                "changed between epochs (random augmentation?); cached outputs would be stale: "
                "pass cache_features=False, or augment after the frozen prefix"
            )
        return forwards

    def state_dict(self) -> dict[str, Any]:
        """The cached rows (a CPU copy, with which are filled) where :attr:`in_state`, else
        nothing but the size: a resumed run refills the cache.

        Example:
            >>> cache = FeatureCache(4, "cpu", in_state=True)
            >>> cache.put(np.array([2]), torch.tensor([[1.5, 2.5]]))
            >>> again = FeatureCache(4, "cpu")
            >>> again.load_state_dict(cache.state_dict())
            >>> again.missing(np.arange(4)).tolist(), again.get(np.array([2])).tolist()
            ([0, 1, 3], [[1.5, 2.5]])
        """
        state: dict[str, Any] = {"version": self.VERSION, "size": self.size}
        if taking_rollback():  # what it holds, not a copy (see _state.rollback_state)
            live = (self.values, self.out_dtype, self.device, self.filled, self._checked_epoch)
            return {**state, "live": live}
        if not self.in_state:
            return state
        values = self.values
        return {
            **state,
            "filled": torch.from_numpy(self.filled.copy()),
            "values": None if values is None else values.detach().to("cpu", copy=True),
            "out_dtype": None
            if self.out_dtype is None
            else str(self.out_dtype).removeprefix("torch."),
            "checked_epoch": self._checked_epoch,
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore the rows a state holds (a copy, on this cache's device, else on ``device``:
        the prefix's); a state without rows leaves the cache empty, to refill."""
        state = check_version(state, "FeatureCache", self.VERSION)
        check_identity(
            "FeatureCache", {"size": int(state["size"])}, {"size": self.size}, "the same dataset"
        )
        if "live" in state:  # a rollback: what the cache held
            (self.values, self.out_dtype, self.device, self.filled, self._checked_epoch) = state[
                "live"
            ]
            return
        self.values, self.out_dtype, self._checked_epoch = None, None, None
        self.filled = np.zeros(self.size, dtype=bool)
        self._signature, self._followed_epoch = None, None  # (rows checked against its digest)
        if "filled" not in state:
            return
        self._checked_epoch = state["checked_epoch"]
        values = state["values"]
        if values is None:
            return
        if self.device is None:
            self.device = device if device is not None else torch.device("cpu")
        if tuple(values.shape) != (self.size, *values.shape[1:]):
            raise ValueError(
                f"the saved feature cache has {values.shape[0]} rows, but this cache has "
                f"{self.size}; build the loader over the same dataset"
            )
        stored = self.store_dtype or values.dtype
        # (a copy: the run goes on writing rows, never into the caller's state)
        self.values = values.to(self.device, stored, copy=True)
        self.out_dtype = getattr(torch, state["out_dtype"])
        self.filled = np.asarray(state["filled"], dtype=bool).reshape(-1).copy()


def prefix_digest(prefix: nn.Module) -> str:
    """A digest of a module's parameters and buffers (in order: shapes, dtypes and bytes), which
    a saved feature cache records, so that a cache computed by another prefix is refused.

    NOTE: not their names, which wrapping changes (``torch.compile``'s ``_orig_mod.``, DDP's
    ``module.``) while the outputs stay the same.

    Example:
        >>> a = nn.Linear(2, 2)
        >>> prefix_digest(a) == prefix_digest(a), prefix_digest(a) == prefix_digest(nn.Linear(2, 2))
        (True, False)
    """
    h = hashlib.blake2b(digest_size=16)
    for t in prefix.state_dict().values():
        if not isinstance(t, torch.Tensor):
            continue
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_feature_cache(
    cache: Any, prefix: nn.Module | None, source: Any, in_state: bool = False
) -> FeatureCache | None:
    """The cross-epoch cache of a frozen prefix's outputs that ``cache_features=`` asks for over
    ``source`` (a :class:`~sbloader.sources.Source`), or None; checked.

    A cache of one row per dataset index, on the device ``cache`` names (``True``: where the
    outputs are), stored in the outputs' own dtype: under a bf16 ``autocast`` bf16 where the
    prefix's last op runs in it (half the memory, nothing lost), float32 where it runs in
    float32 (e.g. a 3-d pooling, or a normalisation on a GPU).

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from sbloader.sources import DataLoaderSource, IterableSource
        >>> src = DataLoaderSource(DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4))
        >>> cache = make_feature_cache("cpu", nn.Linear(3, 2), src)
        >>> cache.size, cache.device, cache.store_dtype
        (8, device(type='cpu'), None)
        >>> make_feature_cache(False, nn.Linear(3, 2), src) is None
        True
        >>> make_feature_cache(True, None, src)
        Traceback (most recent call last):
            ...
        ValueError: cache_features caches frozen_prefix's outputs, but got frozen_prefix=None; ...
        >>> make_feature_cache(True, nn.Linear(3, 2), IterableSource([[torch.zeros(2, 3)]]))
        Traceback (most recent call last):
            ...
        ValueError: cache_features needs each example's dataset index, but the source provides ...
    """
    if isinstance(cache, np.bool_):  # a numpy bool, as the bool it holds
        cache = bool(cache)
    if cache is False or cache is None:
        if in_state:
            raise ValueError(
                "save_feature_cache=True saves cache_features' cache in the loader's state, but "
                f"got cache_features={cache!r}; pass cache_features=True (or a device)"
            )
        return None
    if cache is not True and not isinstance(cache, (str, torch.device)):
        # NOTE: an int is refused, not read as a CUDA index: cache_features=1 means True.
        raise TypeError(
            "cache_features should be True (the cache on the loader's device), False, or a "
            f"device such as 'cpu' to keep it on, but got cache_features={cache!r}"
        )
    if prefix is None:
        raise ValueError(
            "cache_features caches frozen_prefix's outputs, but got frozen_prefix=None; pass "
            "frozen_prefix=backbone (and model=head), or cache_features=False"
        )
    size = source.dataset_size
    if not source.has_indices() or size is None:
        raise indices_needed(
            "cache_features",
            "pass a DataLoader over a map-style dataset, or cache_features=False",
        )
    device = None if cache is True else _cache_device(cache)
    # NOTE: no store_dtype: the outputs' own (see the Scorer, which caches them as the prefix
    # returns them); a bf16 store of float32 outputs rounded the head's training inputs.
    return FeatureCache(size, device, None, in_state)


def _cache_device(cache: str | torch.device) -> torch.device:
    """``cache_features``' device, refused where it cannot hold the cache: the meta device, or
    a CUDA device this machine does not have.

    NOTE: before, such a device was accepted, and the first selection pass failed in torch
    (``Torch not compiled with CUDA enabled``, ``Cannot copy out of meta tensor``), naming
    nothing of ``cache_features``.

    Example:
        >>> _cache_device("meta")
        Traceback (most recent call last):
            ...
        ValueError: cache_features='meta' would keep the features without their data; pass ...
    """
    device = check_device_name("cache_features", cache)
    if device.type == "meta":
        raise ValueError(
            "cache_features='meta' would keep the features without their data; pass "
            "cache_features=True (the cache where the features are) or a device such as 'cpu'"
        )
    check_cuda_present("cache_features", device, "True to keep the cache where the features are")
    return device


def _relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's relative L2 difference of ``a`` from ``b``."""
    return (a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-12)
