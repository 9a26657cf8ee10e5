"""Batches that keep the source's structure and carry what the selection pass learned."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._checks import FieldError

__all__ = ["SelectedBatch", "SelectedDict", "SelectedList", "SelectedTuple"]


class SelectedBatch:
    """Mixin for yielded batches: the selection results travel as attributes.

    Attributes:
        indices: int64 CPU tensor of dataset indices, or ``None`` when the source has none.
        losses: float32 tensor of selection-pass losses on the model's device; NaN for
            examples chosen without a selection pass (Traditional, Random-Backprop, Stale-SB's
            stale epochs).
        probabilities: float32 tensor, the probability each example was kept with.
        weights: float32 tensor, the per-example loss weight (1.0 unless the policy says otherwise).
        features: the frozen prefix's outputs for these examples when the loader was given
            ``frozen_prefix=`` (train the head on them), else ``None``.
        logits: with ``keep_logits=True``, the selection pass's model outputs for these
            examples (float32; NaN rows for examples chosen without a selection pass), else
            ``None`` (also before the loader's first selection pass: a Random-Backprop warm-up or
            Traditional has no outputs whose width it knows).

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import sbloader
        >>> data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        >>> loader = sbloader.SelectiveLoader(
        ...     DataLoader(data, batch_size=32), torch.nn.Linear(4, 2),
        ...     policy=sbloader.RandomBackprop(0.5), batch_size=8)
        >>> batch = next(iter(loader))
        >>> inputs, targets = batch
        >>> type(batch).__name__, isinstance(batch, sbloader.SelectedBatch), len(batch.indices)
        ('SelectedList', True, 8)
        >>> bool(batch.losses.isnan().all()), batch.probabilities[0].item(), batch.weights[0].item()
        (True, 0.5, 1.0)
    """

    indices: torch.Tensor | None
    losses: torch.Tensor | None
    probabilities: torch.Tensor
    weights: torch.Tensor
    # NOTE: no class-level defaults: a batch a framework rebuilt (a new instance of the same
    # class, without the results) must not read None, which means "no selection pass yet".
    features: torch.Tensor | None
    logits: torch.Tensor | None

    if TYPE_CHECKING:
        # NOTE (typing): every yielded batch is a tuple, a list or a dict of the source's
        # structure (the subclasses below), so a type-checked loop may unpack and index the
        # batch it gets (``inputs, targets = batch``, ``batch["image"]``).

        def __iter__(self) -> Iterator[Any]: ...

        def __getitem__(self, key: Any) -> Any: ...

        def __len__(self) -> int: ...

    def _set_meta(
        self,
        indices: torch.Tensor | None,
        losses: torch.Tensor | None,
        probabilities: torch.Tensor,
        weights: torch.Tensor,
    ) -> None:
        self.indices = indices
        self.losses = losses
        self.probabilities = probabilities
        self.weights = weights

    def _set_lazy_meta(self, make: Callable[[], tuple[Any, ...]]) -> None:
        """Attach ``indices``, ``losses``, ``probabilities`` and ``weights`` as ``make()``
        returns them, called on the first access of any of them.

        NOTE: a whole source batch handed out by a passthrough policy (Traditional's fast path)
        carries metadata known without looking at it; made for every batch, its tensors were a
        third of the loader's own time per batch, and most training loops never read them.
        Reading an attribute gives the same tensors it would have had; pickling or copying the
        batch makes them first.
        """
        self.__dict__[_LAZY] = make

    def __getattr__(self, name: str) -> Any:
        # Called only where normal lookup fails: for a batch whose metadata is still to be made.
        if name in _META:
            attributes = self.__dict__
            make = attributes.get(_LAZY)
            if make is not None:
                # NOTE: made outside any inference mode the first read happens in (a logging
                # line, ``loader.feedback``): the weights are multiplied into a loss that is
                # backpropagated, which inference tensors cannot be. Only those not set by the
                # caller since (``batch.weights = ...`` before any of them was read must stay),
                # and set before the callable is dropped, so that another thread reading the
                # batch at the same time finds one or the other (never neither).
                with torch.inference_mode(False):
                    made = make()
                for key, value in zip(_META_ORDER, made):
                    attributes.setdefault(key, value)
                attributes.pop(_LAZY, None)
            if name in attributes:
                return attributes[name]
        if name in _CARRIED:
            kind = type(self).__name__
            raise AttributeError(
                f"{kind!r} object has no attribute {name!r}: this batch carries no selection "
                f"results, as when a framework rebuilds a yielded batch (a move to the device "
                f"that makes a new {kind} of the same items, as Lightning's does); pass "
                "metadata_key= to SelectiveLoader to carry them inside the batch "
                "(sbloader.integrations.lightning.selective_loader does), or read them before "
                "the transfer"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        # The metadata still to be made is listed too (tab completion, introspection).
        return sorted(set(super().__dir__()) | _META)

    def __getstate__(self) -> dict[str, Any]:
        if _LAZY in self.__dict__:
            self.__getattr__("indices")
        return self.__dict__


class SelectedTuple(tuple, SelectedBatch):
    """A tuple batch (``for inputs, targets in loader`` keeps working) with selection attributes.

    Example:
        A source of tuple batches without dataset indices:

        >>> import sbloader
        >>> batches = [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])) for _ in range(2)]
        >>> loader = sbloader.SelectiveLoader(
        ...     batches, torch.nn.Linear(3, 2), policy=sbloader.SelectiveBackprop(beta=0),
        ...     batch_size=4)
        >>> batch = next(iter(loader))
        >>> inputs, targets = batch
        >>> type(batch).__name__, inputs.shape, targets.tolist(), batch.indices
        ('SelectedTuple', torch.Size([4, 3]), [0, 1, 0, 1], None)
    """


class SelectedList(list, SelectedBatch):
    """A list batch with selection attributes.

    Example:
        A DataLoader over a TensorDataset collates its batches as lists:

        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import sbloader
        >>> data = TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
        >>> loader = sbloader.SelectiveLoader(
        ...     DataLoader(data, batch_size=4), torch.nn.Linear(3, 2),
        ...     policy=sbloader.Traditional())
        >>> [(type(b).__name__, len(b), b.indices.tolist()) for b in loader]
        [('SelectedList', 2, [0, 1, 2, 3]), ('SelectedList', 2, [4, 5, 6, 7])]
    """


class SelectedDict(dict, SelectedBatch):
    """A dict batch with selection attributes.

    Example:
        Fields besides ``"input"`` and ``"target"`` are selected with them:

        >>> from torch.utils.data import DataLoader
        >>> import sbloader
        >>> rows = [{"input": torch.randn(3), "target": i % 2, "id": f"row{i}"} for i in range(8)]
        >>> loader = sbloader.SelectiveLoader(
        ...     DataLoader(rows, batch_size=4), torch.nn.Linear(3, 2),
        ...     policy=sbloader.SelectiveBackprop(beta=0), batch_size=4)
        >>> batch = next(iter(loader))
        >>> type(batch).__name__, sorted(batch), batch["id"], batch.indices.tolist()
        ('SelectedDict', ['id', 'input', 'target'], ['row0', 'row1', 'row2', 'row3'], [0, 1, 2, 3])
    """


#: The metadata attributes of a yielded batch, and where a batch keeps the callable that makes
#: them when they are made on first access (see SelectedBatch._set_lazy_meta).
_META_ORDER = ("indices", "losses", "probabilities", "weights")  # as _set_meta takes them
_META = frozenset(_META_ORDER)
#: Every selection result a yielded batch carries as an attribute.
_CARRIED = _META | {"features", "logits"}
_LAZY = "_sbloader_lazy_meta"

Column = Any  # a tensor with the batch in dimension 0, or a list with one entry per example


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make")


#: The yielded class made for each source batch class (None: it cannot be made; see
#: selected_class), and the lock that makes each once.
_SELECTED: dict[type, type | None] = {}
_SELECTED_LOCK = threading.Lock()


def selected_class(cls: type) -> type | None:
    """A subclass of the source's own batch class ``cls`` (a namedtuple, or a mapping other
    than ``dict``, such as transformers' ``BatchEncoding``) and of :class:`SelectedBatch`,
    ``Selected<name>``, made once per class; None where Python refuses such a subclass.

    NOTE (the source's own batch class): a yielded batch keeps it, so that code written for the
    source's batches works on the loader's (``batch.label`` of a namedtuple, ``batch.to(device)``
    and ``batch.input_ids`` of a ``BatchEncoding``). Attribute lookups that find nothing look
    up the selection results first, then the class's own ``__getattr__``; the class pickles by
    its base class (module-level, as the source's batches need to be for worker processes).

    Example:
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "image label")
        >>> Selected = selected_class(Pair)
        >>> batch = Selected(torch.zeros(2, 3), torch.tensor([0, 1]))
        >>> Selected.__name__, isinstance(batch, Pair), isinstance(batch, SelectedBatch)
        ('SelectedPair', True, True)
    """
    with _SELECTED_LOCK:
        if cls in _SELECTED:
            return _SELECTED[cls]
        clash = sorted(name for name in _CARRIED if hasattr(cls, name))
        if clash:
            # NOTE: a field named like a selection result (a namedtuple's ``features``) is a
            # read-only property of the class: the results could not be set (a bare "can't set
            # attribute"), or ``batch.weights`` read the field. The batch falls back to a plain
            # tuple or dict, whose attributes are the selection's, and says so once.
            warnings.warn(
                f"the source's batch class {cls.__name__} has {', '.join(map(repr, clash))}, "
                "named like the selection results yielded batches carry as attributes, so "
                f"yielded batches are plain {'tuples' if _is_namedtuple(cls) else 'dicts'} "
                f"instead of {cls.__name__} (its fields by position or key); rename the field "
                "to keep the class",
                UserWarning,
                stacklevel=2,
            )
            _SELECTED[cls] = None
            return None
        base_getattr = getattr(cls, "__getattr__", None)

        def __getattr__(self: Any, name: str) -> Any:
            if name in _META or base_getattr is None:
                return SelectedBatch.__getattr__(self, name)
            return base_getattr(self, name)

        def __reduce__(self: Any) -> Any:
            contents = tuple(self) if _is_namedtuple(cls) else dict(self.items())
            return (_rebuild_selected, (cls, contents, self.__getstate__()))

        namespace: dict[str, Any] = {
            "__getattr__": __getattr__,
            "__reduce__": __reduce__,
            "__module__": __name__,
            "__qualname__": f"Selected{cls.__name__}",
        }
        base_setattr: Any = cls.__setattr__  # (unbound: the class's own, taking self)
        if base_setattr is not object.__setattr__:
            # NOTE: a mapping whose attribute writes are item writes (easydict's EasyDict,
            # addict's Dict, Box) would take the selection results as keys of the batch
            # (``model(**batch)`` given ``indices=``, ``losses=``...): they are set as the
            # instance's own attributes, past the class's __setattr__; other names use it.
            def __setattr__(self: Any, name: str, value: Any) -> None:
                if name in _CARRIED:
                    object.__setattr__(self, name, value)
                else:
                    base_setattr(self, name, value)

            namespace["__setattr__"] = __setattr__
        try:
            made: type | None = type(f"Selected{cls.__name__}", (cls, SelectedBatch), namespace)
        except TypeError:  # e.g. a class that cannot be subclassed, or a layout conflict
            made = None
        _SELECTED[cls] = made
        return made


def _rebuild_selected(cls: type, contents: Any, state: dict[str, Any]) -> Any:
    """Unpickle a batch of :func:`selected_class`'s class for ``cls``."""
    made = selected_class(cls)
    assert made is not None
    batch = made(*contents) if _is_namedtuple(cls) else made(contents)
    batch.__dict__.update(state)
    return batch


def like(structure: Any, values: Any) -> Any:
    """``values`` in ``structure``'s class: a dict of them for a mapping, a sequence in order
    otherwise (a namedtuple's fields by position); the plain dict where a mapping's class does
    not take one.

    Example:
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "a b")
        >>> like(Pair(1, 2), [3, 4]), like((1, 2), [3, 4]), like({"a": 1}, {"a": 2})
        (Pair(a=3, b=4), (3, 4), {'a': 2})
    """
    cls = type(structure)
    if isinstance(structure, Mapping):
        if cls is dict:
            return dict(values)
        try:
            return cls(dict(values))
        except Exception:
            return dict(values)
    if _is_namedtuple(cls):
        return cls(*values)
    return cls(values)


# NOTE: the batch classes named in states taken in this process, by name. A class defined in a
# function cannot be imported again, so a loader rebuilt in the same process (a resume within
# one job, a notebook) found no class for the state it loaded, and the batches it handed out
# before its first source batch (a batch taken back with ``unconsumed=1``, carried rows that
# fill one) were plain tuples or dicts: ``batch.image`` or ``batch.to(device)`` then failed.
# Such a class's name carries a serial of its own (``module:qualname#3``): two classes defined
# by one function (each call defines another, e.g. a namedtuple with other fields) share a
# qualname, and by qualname alone a state of the first resumed with the second's fields,
# whichever had been named last. (A namedtuple made in a function has no ``<locals>`` in its
# qualname: what tells such a class is that importing its name does not find it.)
_NAMED: weakref.WeakValueDictionary[str, type] = weakref.WeakValueDictionary()
_SERIALS: weakref.WeakKeyDictionary[type, int] = weakref.WeakKeyDictionary()
_NEXT_SERIAL = itertools.count()
_SERIALS_LOCK = threading.Lock()


def class_name(cls: type | None) -> str | None:
    """``module:qualname`` of a batch class, for a saved state (None for none); with ``#`` and
    a serial for a class that importing that name does not find (one defined in a function),
    found again in this process only."""
    if cls is None:
        return None
    name = f"{cls.__module__}:{cls.__qualname__}"
    if _imported(name) is cls:
        return name
    with _SERIALS_LOCK:
        serial = _SERIALS.get(cls)
        if serial is None:
            serial = _SERIALS[cls] = next(_NEXT_SERIAL)
    name = f"{name}#{serial}"
    _NAMED[name] = cls
    return name


def class_named(name: str | None) -> type | None:
    """The class :func:`class_name` named: one named in this process, or one that can be
    imported, else None."""
    if not name:
        return None
    known = _NAMED.get(name)
    if known is not None:
        return known
    if "#" in name:  # (a class that cannot be imported, named in another process)
        return None
    return _imported(name)


def _imported(name: str) -> type | None:
    """The class ``module:qualname`` names, imported; None where there is none."""
    if "<" in name:  # (defined in a function)
        return None
    module, _, qualname = name.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


@dataclass(frozen=True)
class BatchFormat:
    """How a source batch maps to columns, and back.

    Tuple and list batches are addressed by position, dict batches by key. ``input_key`` and
    ``target_key`` name the model input and the loss target; every other field is carried along
    and selected with them. ``cls`` is the source's own batch class where it is a namedtuple
    or a mapping other than ``dict`` (yielded batches keep it: see :func:`selected_class`),
    else None.
    """

    kind: type
    keys: tuple[Hashable, ...]
    input_key: Hashable
    target_key: Hashable
    cls: type | None = None

    @staticmethod
    def own_class(batch: Any) -> type | None:
        """``type(batch)`` where batches of it keep their class (a namedtuple, or a mapping
        other than ``dict``), else None."""
        cls = type(batch)
        if cls in (dict, list, tuple):
            return None
        if isinstance(batch, Mapping) or _is_namedtuple(cls):
            return cls
        return None

    @classmethod
    def infer(
        cls, batch: Any, input_key: Hashable | None, target_key: Hashable | None
    ) -> BatchFormat:
        """Work out the format of the first source batch, or raise naming the fix."""
        if isinstance(batch, Mapping):
            keys = tuple(batch.keys())
            input_key = "input" if input_key is None else input_key
            target_key = "target" if target_key is None else target_key
            # (both named at once where both are missing: the defaults over a batch of other
            # keys, which were refused one run at a time)
            missing = [
                (name, key)
                for name, key in (("input_key", input_key), ("target_key", target_key))
                if key not in batch
            ]
            if missing:
                without = " and ".join(repr(key) for _, key in missing)
                names = " and ".join(f"{name}=" for name, _ in missing)
                raise FieldError(
                    f"the source yields dict batches without the key{'s' * (len(missing) > 1)} "
                    f"{without}; pass {names} naming {'two' if len(missing) > 1 else 'one'} "
                    f"of {list(keys)!r}"
                )
            return cls(dict, keys, input_key, target_key, cls.own_class(batch))
        if isinstance(batch, (tuple, list)):
            n = len(batch)
            input_key = 0 if input_key is None else input_key
            target_key = 1 if target_key is None else target_key
            for name, key in (("input_key", input_key), ("target_key", target_key)):
                if not isinstance(key, int) or not -n <= key < n:
                    raise FieldError(
                        f"{name} should be a position in the source's {n}-field "
                        f"{type(batch).__name__} batches, but got {name}={key!r}"
                        + _field_position(batch, name, key)
                    )
            kind = list if isinstance(batch, list) else tuple
            return cls(
                kind,
                tuple(range(n)),
                cls.stored_key(kind, n, input_key),
                cls.stored_key(kind, n, target_key),
                cls.own_class(batch),
            )
        raise TypeError(
            "SelectiveLoader needs batches that are tuples, lists or dicts of per-example fields "
            f"(e.g. (inputs, targets)), but the source yielded a {type(batch).__name__}; "
            + _batch_fix(batch)
        )

    def columns(self, batch: Any) -> list[Column]:
        """The batch's fields as a list of columns, in key order."""
        if self.kind is dict:
            if not isinstance(batch, Mapping):
                raise ValueError(
                    f"the source changed its batch format: expected a dict with keys "
                    f"{list(self.keys)!r}, got a {type(batch).__name__}"
                )
            # NOTE: the same keys in another order are the same fields (the default collate
            # function orders a batch's keys as its first example's, which a dataset of JSON
            # records may order differently): read by key, in the first batch's order.
            if tuple(batch.keys()) != self.keys and (
                len(batch) != len(self.keys) or any(k not in batch for k in self.keys)
            ):
                missing = [k for k in self.keys if k not in batch]
                extra = [k for k in batch.keys() if k not in self.keys]
                raise ValueError(
                    f"the source changed its batch format: expected a dict with keys "
                    f"{list(self.keys)!r} (as its first batch had, or a saved run's), got one "
                    f"with keys {list(batch.keys())!r} (missing {missing!r}, new {extra!r}); "
                    "give every batch the same fields (e.g. fill a missing one with a default "
                    "in the collate_fn), or leave the field out of every batch"
                )
            return [batch[k] for k in self.keys]
        if not isinstance(batch, (tuple, list)) or len(batch) != len(self.keys):
            raise ValueError(
                f"the source changed its batch format: expected a {len(self.keys)}-field "
                f"{self.kind.__name__}, got {type(batch).__name__}"
            )
        return list(batch)

    @staticmethod
    def stored_key(kind: type, fields: int, key: Hashable) -> Hashable:
        """``key`` as a format of ``kind`` with ``fields`` fields holds it: a position in a
        tuple or list batch counted from 0 (``-1``: the last field's), any other key as it is.

        Example:
            >>> BatchFormat.stored_key(tuple, 3, -1), BatchFormat.stored_key(dict, 3, "x")
            (2, 'x')
        """
        if kind in (tuple, list) and isinstance(key, int) and not isinstance(key, bool):
            return key % fields
        return key

    def position(self, key: Hashable) -> int:
        return self.keys.index(key)

    def view(self, columns: Sequence[Column]) -> Any:
        """The source batch's structure over ``columns`` (of its own class where it keeps it,
        else a plain dict, tuple or list)."""
        if self.cls is not None:
            made = self._made(self.cls, columns)
            if made is not None:
                return made
        if self.kind is dict:
            return dict(zip(self.keys, columns))
        return self.kind(columns)

    def build(self, columns: Sequence[Column]) -> SelectedBatch:
        """A yielded batch of the source's structure from columns: of the source's own batch
        class where it keeps it (:func:`selected_class`), else a :class:`SelectedDict`,
        :class:`SelectedList` or :class:`SelectedTuple`."""
        if self.cls is not None:
            selected = selected_class(self.cls)
            if selected is not None:
                made = self._made(selected, columns)
                if made is not None:
                    return made
        if self.kind is dict:
            return SelectedDict(zip(self.keys, columns))
        if self.kind is list:
            return SelectedList(columns)
        return SelectedTuple(columns)

    def _made(self, cls: type, columns: Sequence[Column]) -> Any:
        """A batch of ``cls`` over ``columns``, or None where its constructor does not take
        the fields (a mapping built from a dict of them, a namedtuple from them in order)."""
        if cls in _UNBUILDABLE:
            return None
        try:
            if self.kind is dict:
                made = cls(dict(zip(self.keys, columns)))
                if tuple(made.keys()) == self.keys:
                    return made
            elif len(columns) == len(self.keys):
                return cls(*columns)
        except Exception:  # (a constructor of another signature: the plain structure instead)
            pass
        _UNBUILDABLE.add(cls)
        return None


def _field_position(batch: Any, name: str, key: Any) -> str:
    """The fix where ``name=`` names a field of namedtuple batches by its name (``input_key=
    'image'``), for the message: the field's position, by which tuple batches are addressed;
    else ``''``.

    Example:
        >>> from collections import namedtuple
        >>> pair = namedtuple("Pair", "image label")(1, 2)
        >>> fix = _field_position(pair, "target_key", "label")
        >>> fix.endswith("the field 'label' is 1 of ['image', 'label']")
        True
        >>> _field_position((1, 2), "target_key", "label")
        ''
    """
    fields = getattr(type(batch), "_fields", ()) if _is_namedtuple(type(batch)) else ()
    if not isinstance(key, str) or key not in fields:
        return ""
    return (
        f"; namedtuple batches are addressed by position, as tuples are: name the fields "
        f"by position in {name}=, where the field {key!r} is {fields.index(key)} of "
        f"{list(fields)!r}"
    )


def _batch_fix(batch: Any) -> str:
    """The fix for a source batch of no structure :meth:`BatchFormat.infer` reads, for its
    message: the conversion that gives one, for a dataclass, a tensor or any other batch."""
    # NOTE: a dataclass's fields are read by name into a dict: dataclasses.asdict would copy
    # every tensor (it deep-copies), and vars() fails for a class with __slots__.
    if dataclasses.is_dataclass(batch):
        return (
            "make the source yield dicts of the batch's fields (e.g. a DataLoader's collate_fn "
            "returning {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)} of "
            "the batch it makes now), and pass input_key= and target_key= naming the fields "
            "(yielded batches are then dicts of them)"
        )
    if isinstance(batch, torch.Tensor):
        return (
            "a single tensor has no target: make the source yield (inputs, targets) (e.g. from "
            "the dataset or a DataLoader's collate_fn), or a dict such as {'input_ids': ids} "
            "with input_key='input_ids', target_key='input_ids' where the input is its own "
            "target"
        )
    return (
        "make the source yield a tuple, list or dict of the batch's fields, each with one "
        "entry per example (e.g. from a DataLoader's collate_fn)"
    )


#: Batch classes whose constructor did not take their fields (see BatchFormat._made).
_UNBUILDABLE: set[type] = set()


def column_length(column: Column, field: Hashable) -> int:
    """The number of examples in a column, or raise naming the field.

    A nested field (a dict inside the batch) has as many examples as each of its entries, which
    must agree.

    Example:
        >>> column_length({"ids": torch.zeros(3, 5), "meta": {"len": [1, 2, 3]}}, "inputs")
        3
    """
    if isinstance(column, torch.Tensor):  # NOTE: first: the common case, and no ABC check
        if column.dim() == 0:
            raise ValueError(
                f"field {field!r} of the batch is a 0-d tensor; SelectiveLoader selects examples "
                "along dimension 0, so every field needs one entry per example: repeat a "
                "batch-level value per example in the DataLoader's collate_fn (e.g. "
                "value.expand(len(batch))), or leave it out of the batch"
            )
        return column.shape[0]
    if isinstance(column, Mapping):
        if not column:
            raise ValueError(
                f"field {field!r} of the batch is an empty dict; SelectiveLoader selects "
                "examples along dimension 0, so every field needs one entry per example"
            )
        lengths = {k: column_length(v, f"{field}.{k}") for k, v in column.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"the entries of the nested field {field!r} have different numbers of examples "
                f"({lengths}); every entry needs one per example"
            )
        return next(iter(lengths.values()))
    if isinstance(column, (list, tuple)):
        return len(column)
    raise TypeError(
        f"field {field!r} of the batch is a {type(column).__name__}; SelectiveLoader can select "
        "tensors, numpy arrays, lists and dicts of them with one entry per example: give a "
        "batch-level value one entry per example in the DataLoader's collate_fn (e.g. "
        "[value] * len(batch)), or leave it out of the batch"
    )


def to_column(
    value: Any, device: torch.device, memory_format: torch.memory_format | None
) -> Column:
    """Move a field to ``device`` (numpy arrays become tensors); lists stay on the host.

    A nested field (a dict) is moved entry by entry (``memory_format`` applies at the top level
    only). A numpy array of a dtype torch cannot hold (strings such as file names, objects)
    becomes a list, selected entry by entry as lists are.

    Example:
        >>> cpu = torch.device("cpu")
        >>> to_column(np.array(["a.png", "b.png"]), cpu, None)
        ['a.png', 'b.png']
        >>> to_column(np.arange(3.0)[::-1], cpu, None)
        tensor([2., 1., 0.], dtype=torch.float64)
    """
    if not isinstance(value, torch.Tensor):  # NOTE: tensors first: no ABC check for them
        if isinstance(value, Mapping):
            return {k: to_column(v, device, None) for k, v in value.items()}
        if isinstance(value, tuple):
            return list(value)
        if not isinstance(value, np.ndarray):
            return value
        if any(stride < 0 for stride in value.strides):
            value = value.copy()  # torch.from_numpy refuses negative strides (arr[::-1])
        try:
            value = torch.from_numpy(value)
        except TypeError:  # a dtype torch has no tensors of: strings, bytes, objects
            return value.tolist()
    if value.device != device:
        value = value.to(device, non_blocking=value.is_pinned())
    return in_memory_format(value, memory_format)


def memory_format_rank(memory_format: torch.memory_format) -> int:
    """The rank of the tensors a memory format lays out: 5 for ``torch.channels_last_3d``
    (video batches: N, C, D, H, W), else 4 (image batches: N, C, H, W).

    Example:
        >>> memory_format_rank(torch.channels_last), memory_format_rank(torch.channels_last_3d)
        (4, 5)
    """
    return 5 if memory_format == torch.channels_last_3d else 4


def in_memory_format(value: Any, memory_format: torch.memory_format | None) -> Any:
    """``value`` in ``memory_format`` where it is a tensor of the rank that format lays out
    (:func:`memory_format_rank`); anything else as it is.

    NOTE: by rank, so that ``torch.channels_last_3d`` applies to 5-d inputs (before, only 4-d
    inputs were converted: it was silently ignored on the video batches it is for, and raised
    torch's own error on images).

    Example:
        >>> x = in_memory_format(torch.zeros(2, 3, 4, 5, 6), torch.channels_last_3d)
        >>> x.is_contiguous(memory_format=torch.channels_last_3d)
        True
        >>> in_memory_format(torch.zeros(2, 3, 4, 5), torch.channels_last_3d).is_contiguous()
        True
    """
    if (
        memory_format is not None
        and isinstance(value, torch.Tensor)
        and value.dim() == memory_format_rank(memory_format)
    ):
        value = value.contiguous(memory_format=memory_format)
    return value


#: Dtypes whose 1-d tensors torch's ``index_select`` does not implement (it raises
#: NotImplementedError); indexing with a tensor of positions gathers them. (torch < 2.3 has
#: none of them.)
_NO_INDEX_SELECT = tuple(
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)
)


def take(column: Column, positions: torch.Tensor, positions_list: list[int] | None) -> Column:
    """Rows ``positions`` of a column, gathered where the column lives (no host round trip);
    a nested field's entries are gathered recursively."""
    if isinstance(column, torch.Tensor):
        if positions.device != column.device:
            positions = positions.to(column.device, non_blocking=True)
        if column.dtype in _NO_INDEX_SELECT and column.dim() == 1:
            return column[positions]  # the same rows, by the indexing kernel that has them
        return column.index_select(0, positions)
    if isinstance(column, Mapping):
        return {k: take(v, positions, positions_list) for k, v in column.items()}
    assert positions_list is not None
    return [column[i] for i in positions_list]


def concat(parts: Sequence[Column], pad: Any = None) -> Column:
    """Concatenate column chunks along the example dimension (nested fields entry by entry).

    Tensor chunks whose trailing (non-batch) sizes differ are padded at the end of every trailing
    dimension to the largest size among them, with the value ``pad`` (see
    ``SelectiveLoader(pad_values=)``); without ``pad`` they must agree (``torch.cat`` raises).

    Example:
        >>> concat([torch.tensor([[1, 2]]), torch.tensor([[3]])], pad=-100).tolist()
        [[1, 2], [3, -100]]
    """
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], torch.Tensor):
        if pad is not None:
            shape = parts[0].shape[1:]
            if any(p.shape[1:] != shape for p in parts):
                return _padded_cat(parts, pad)
        return torch.cat(list(parts), dim=0)
    if isinstance(parts[0], Mapping):
        return {k: concat([p[k] for p in parts]) for k in parts[0]}
    out: list[Any] = []
    for p in parts:
        out.extend(p)
    return out


def _padded_cat(parts: Sequence[torch.Tensor], pad: Any) -> torch.Tensor:
    """The chunks in one tensor of their largest trailing sizes, filled with ``pad`` where a
    chunk is shorter: each chunk is copied once, into its corner of the output."""
    # NOTE (pad when rows are joined, not when a source batch is loaded): padding at load would
    # need one length for the whole run, known ahead (a stream cannot tell it) and paid for on
    # every row in the selection forward too. Padded here, a training batch is as wide as the
    # widest source batch its rows come from (as the collator made that one; trimming to the
    # longest row would mean guessing which trailing columns are padding), and the source
    # batches, the selection pass and the pending rows (also in a saved state) keep their own.
    first = parts[0]
    if any(p.dim() != first.dim() for p in parts):
        raise ValueError(
            "cannot pad tensors with different numbers of dimensions together: "
            f"{[tuple(p.shape) for p in parts]}"
        )
    trailing = [max(p.shape[d] for p in parts) for d in range(1, first.dim())]
    rows = sum(p.shape[0] for p in parts)
    out = torch.full((rows, *trailing), pad, dtype=first.dtype, device=first.device)
    start = 0
    for p in parts:
        stop = start + p.shape[0]
        corner = (slice(start, stop), *[slice(0, s) for s in p.shape[1:]])
        out[corner] = p
        start = stop
    return out


def split(column: Column, k: int) -> tuple[Column, Column]:
    """The first ``k`` rows of a column and the rest."""
    return rows(column, 0, k), rows(column, k, None)


def rows(column: Column, start: int, stop: int | None) -> Column:
    """Rows ``start:stop`` of a column (views of tensors; nested fields entry by entry).

    Example:
        >>> rows({"ids": torch.arange(4), "names": list("abcd")}, 1, 3)
        {'ids': tensor([1, 2]), 'names': ['b', 'c']}
    """
    if not isinstance(column, torch.Tensor) and isinstance(column, Mapping):
        return {k: rows(v, start, stop) for k, v in column.items()}
    return column[start:stop]


def move(column: Column, device: torch.device) -> Column:
    """A column with its tensors (nested ones too) on ``device``; lists stay lists."""
    if isinstance(column, Mapping):
        return {k: move(v, device) for k, v in column.items()}
    return column.to(device) if isinstance(column, torch.Tensor) else column


def plain(column: Column) -> Column:
    """A column as tensors, lists and dicts only (for a saved state)."""
    if isinstance(column, Mapping):
        return {k: plain(v) for k, v in column.items()}
    return column if isinstance(column, torch.Tensor) else list(column)
