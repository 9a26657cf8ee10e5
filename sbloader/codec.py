"""Between the source's batches and the loader's rows: read a source batch into data columns, and
build a yielded batch of the source's structure from :class:`~sbloader.rows.Rows`."""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Hashable, Mapping, MutableMapping
from functools import partial
from typing import Any

import numpy as np
import torch

from . import batch as B
from ._state import check_version
from .rows import Rows, WholeBatch

__all__ = ["BatchCodec"]

_KINDS: dict[str, type] = {"dict": dict, "list": list, "tuple": tuple}
_PLAIN = (dict, list, tuple)


class BatchCodec:
    """The source's batch format (learnt from its first batch) and the conversions it implies.

    Args:
        input_key, target_key: the model input and loss target fields (positions in tuple/list
            batches, default 0 and 1; keys in dict batches, default ``"input"``, ``"target"``).
        memory_format: e.g. ``torch.channels_last``, applied to 4-d inputs
            (``torch.channels_last_3d``: to 5-d ones).
        metadata_key: carry the selection results inside yielded batches under this key (see
            ``SelectiveLoader(metadata_key=)``), or None.
        drop_key: a field of the source's batches (the index field) that yielded batches leave
            out (see ``SelectiveLoader(drop_index=)``), or None. Input and target keys still
            name fields of the source's batches.
        index_key: the field of the source's batches that holds the dataset indices (see
            ``SelectiveLoader(index_key=)``), or None. Where it is the input or target field
            (e.g. ``index_key=1`` meant for a third field), a source batch whose indices repeat
            is refused: those are class labels or inputs, not dataset indices.
        pad_values: the value to pad each field with whose tensors differ in their trailing
            sizes from source batch to source batch (see ``SelectiveLoader(pad_values=)``), by
            key or position, or None. Checked here (:func:`check_pad_values`); the keys are
            checked against the source's fields on its first batch.
        input_fields: the fields of a tuple ``input_key`` (the model's positional inputs), or
            None. A default ``target_key`` that is one of them is refused on the first batch.

    Example:
        >>> import torch
        >>> codec = BatchCodec(None, None, None)
        >>> data, n = codec.columns((torch.zeros(3, 2), torch.arange(3)), None, torch.device("cpu"))
        >>> n, codec.input_position, codec.target_position
        (3, 0, 1)
    """

    VERSION = 1

    def __init__(
        self,
        input_key: Hashable | None,
        target_key: Hashable | None,
        memory_format: torch.memory_format | None,
        metadata_key: str | None = None,
        drop_key: Hashable | None = None,
        pad_values: Any = None,
        index_key: Hashable | None = None,
        input_fields: tuple[Hashable, ...] | None = None,
    ) -> None:
        self.input_key, self.target_key = input_key, target_key
        self.input_fields = input_fields
        self.index_key = index_key
        # "input" or "target" where index_key names that field (see _check_index_key).
        self._index_is: str | None = None
        self.memory_format = memory_format
        self.metadata_key = metadata_key
        self.drop_key = drop_key
        self.pad_values = check_pad_values(pad_values)
        #: ``pad_values`` by position in the source's batches (known from its first batch).
        self.pads: dict[int, Any] = {}
        # The shapes of the first source batch's tensor fields that have no pad value, by
        # position, that every source batch of a re-batching epoch must share past dimension 0
        # (see check_shapes); None until that batch.
        self._shapes: dict[int, tuple[int, ...]] | None = None
        # The same for tensors inside nested dict fields, by (field, path of keys).
        self._nested: dict[tuple[int, tuple[Hashable, ...]], tuple[int, ...]] = {}
        self.format: B.BatchFormat | None = None
        # The source format it was made for, the yielded batches' format, the dropped position.
        self._yielded: tuple[B.BatchFormat, B.BatchFormat, int] | None = None
        # The batch class a loaded state names that could not be found (see build), until a
        # source batch tells it.
        self._unfound: str | None = None

    @property
    def input_position(self) -> int:
        assert self.format is not None
        return self.format.position(self.format.input_key)

    @property
    def target_position(self) -> int:
        assert self.format is not None
        return self.format.position(self.format.target_key)

    def columns(
        self, raw: Any, indices: np.ndarray | None, device: torch.device
    ) -> tuple[list[Any], int]:
        """The source batch's fields as columns on ``device``, checked for consistent lengths."""
        if self.format is None:
            self.format = B.BatchFormat.infer(raw, self.input_key, self.target_key)
            try:
                self._check_format()
            except Exception:
                self.format = None  # (refused: so is the next epoch's first batch)
                raise
        fmt = self.format
        if fmt.cls is None and type(raw) not in _PLAIN:
            # (a format restored from a state whose batch class could not be imported: the
            # source's own batches tell it)
            own = B.BatchFormat.own_class(raw)
            if own is not None:
                fmt = self.format = dataclasses.replace(fmt, cls=own)
                self._unfound = None
        in_pos = self.input_position
        columns = [
            B.to_column(v, device, self.memory_format if j == in_pos else None)
            for j, v in enumerate(fmt.columns(raw))
        ]
        n = B.column_length(columns[in_pos], fmt.input_key)
        for key, col in zip(fmt.keys, columns):
            if B.column_length(col, key) != n:
                _check_not_collated_fields(fmt.keys, columns)
                m = B.column_length(col, key)
                raise ValueError(
                    f"field {key!r} of a source batch has {m} entries but the input field "
                    f"{fmt.input_key!r} has {n}; every field needs one entry per example"
                    + _time_major(columns[in_pos], fmt.input_key, n, col, key, m)
                )
        if self._index_is is not None and indices is not None:
            self._check_repeats(indices)
        if indices is not None and indices.shape[0] != n:
            # NOTE: a DataLoader's indices are its sampler's, paired with the collated
            # examples by position: a collate_fn that leaves samples out (e.g. those a dataset
            # returned as None) or adds some (several crops of each) cannot be paired, nor one
            # that reorders them (e.g. sorts them by length), which goes unseen.
            raise ValueError(
                f"the source batch has {n} examples but {indices.shape[0]} dataset indices: a "
                "DataLoader's collate_fn must return one example for each sample it is given, "
                "in their order (each is paired with its dataset index by position), but this "
                f"one returned {n} for {indices.shape[0]}; give each example a field holding its "
                "dataset index and pass index_key= naming it (the batches then carry their own "
                "indices), or return one example per sample"
            )
        return columns, n

    def _check_format(self) -> None:
        """The checks of a format, whether inferred from the first source batch or restored from
        a state: ``metadata_key`` not one of its keys, ``drop_key`` one, the pads resolved."""
        assert self.format is not None
        meta_key = self.metadata_key
        if meta_key is not None and self.format.kind is dict and meta_key in self.format.keys:
            raise ValueError(
                f"metadata_key={meta_key!r} is already a key of the source's dict batches; "
                "pass another metadata_key"
            )
        self._check_drop_key()
        self._check_index_key()
        self._check_default_target()
        self._resolve_pads()

    def _check_default_target(self) -> None:
        """Refuse a default ``target_key`` that a tuple ``input_key`` names as a model input.

        NOTE: over ``(x, mask, y)`` batches, ``input_key=(0, 1)`` alone leaves ``target_key``
        at its default, 1: the loss would be taken against the mask, which a loss that
        broadcasts accepts silently. Given explicitly, a target that is also an input (a model
        conditioned on its label) is accepted.
        """
        fmt, fields = self.format, self.input_fields
        if fmt is None or fields is None or self.target_key is not None:
            return
        n = len(fmt.keys)
        positions = {
            key % n if fmt.kind is not dict and isinstance(key, int) and -n <= key < n else key
            for key in fields
        }
        if fmt.target_key in positions:
            default = "'target'" if fmt.kind is dict else "1, the second field"
            raise ValueError(
                f"target_key defaults to {default} of {fmt.kind.__name__} batches, which "
                f"input_key={fields!r} names as one of the model's inputs, so the loss would be "
                "taken against an input; pass target_key= the field of the loss target (e.g. "
                f"target_key={n - 1 if fmt.kind is not dict else fmt.keys[-1]!r}), or "
                f"target_key={fmt.target_key!r} where that field is both"
            )

    def _check_index_key(self) -> None:
        """Note whether ``index_key`` names the input or the target field (see
        :meth:`_check_repeats`)."""
        fmt, key = self.format, self.index_key
        self._index_is = None
        if key is None or fmt is None:
            return
        if fmt.kind is not dict and isinstance(key, int) and not isinstance(key, bool):
            key = key % len(fmt.keys) if -len(fmt.keys) <= key < len(fmt.keys) else key
        if key == fmt.target_key:
            self._index_is = "target"
        elif key == fmt.input_key:
            self._index_is = "input"

    def _check_repeats(self, indices: np.ndarray) -> None:
        """Refuse a source batch whose dataset indices, read from the input or target field,
        repeat: that field holds class labels (or inputs), not dataset indices.

        NOTE: otherwise accepted silently: ``index_key=1`` over ``(inputs, targets, indices)``
        batches (meant for 2) made the labels the dataset indices, and Stale-SB's store kept one
        loss per class. Only repeats are refused, so that targets that are the dataset indices
        (instance discrimination) still work.
        """
        if np.unique(indices).shape[0] == indices.shape[0]:
            return
        name = "target_key" if self._index_is == "target" else "input_key"
        assert self.format is not None
        field = self.format.target_key if self._index_is == "target" else self.format.input_key
        raise ValueError(
            f"index_key={self.index_key!r} names the {self._index_is} field of the source's "
            f"batches ({name}={field!r}), whose values repeat within a source batch "
            f"({np.unique(indices).shape[0]} distinct in {indices.shape[0]}): they are no "
            "dataset indices; pass index_key= the field that holds each example's dataset index"
        )

    def _check_drop_key(self) -> None:
        fmt, key = self.format, self.drop_key
        if key is None or fmt is None:
            return
        if fmt.kind is not dict and isinstance(key, int) and -len(fmt.keys) <= key < 0:
            key = key % len(fmt.keys)  # a position from the end, as the index field allows
        if key not in fmt.keys or key in (fmt.input_key, fmt.target_key):
            raise ValueError(
                f"drop_index=True leaves the index field {self.drop_key!r} out of yielded "
                "batches, but it is no field of the source's batches, or it is the input or target "
                "field; pass index_key= the field that holds the dataset indices"
            )
        self.drop_key = key

    def _resolve_pads(self) -> None:
        """``pads`` from ``pad_values`` and the source's format, or raise naming a key that is
        no field of its batches."""
        fmt = self.format
        assert fmt is not None
        n, pads = len(fmt.keys), {}
        for key, value in self.pad_values.items():
            field = key
            if fmt.kind is not dict and isinstance(key, int) and -n <= key < 0:
                field = key % n  # a position from the end
            if isinstance(key, bool) or field not in fmt.keys:
                raise ValueError(
                    f"pad_values names the field {key!r}, but the source's batches have no such "
                    f"field (their fields: {list(fmt.keys)!r}); pass pad_values= keyed by "
                    "the batches' dict keys, or positions in tuple/list batches"
                )
            pads[fmt.position(field)] = value
        self.pads = pads

    def check_shapes(self, data: list[Any], where: str) -> None:
        """Raise (``ValueError`` naming the field, both shapes and the fix) when a tensor field
        without a pad value has other trailing (non-batch) sizes in ``data`` than in the first
        source batch checked: its rows could not be concatenated with that batch's rows.

        Called on every source batch loaded in an epoch whose rows are re-batched (a selective
        one, or a passthrough one whose source batches are not training batches), at load time:
        the error comes with the first source batch that differs, not at a later concatenation,
        which depends on which rows were kept. ``where`` names the batch for the message. One
        shape comparison per such field.
        """
        shapes = self._shapes
        if shapes is None:
            self._first_shapes(data)
            return
        for j, shape in shapes.items():
            got = data[j].shape
            if got[1:] != shape[1:]:
                raise self._ragged(j, shape, tuple(got), where)
        for (j, path), shape in self._nested.items():
            leaf = _entry(data[j], path)
            if not isinstance(leaf, torch.Tensor) or leaf.shape[1:] != shape[1:]:
                got = None if not isinstance(leaf, torch.Tensor) else tuple(leaf.shape)
                raise self._ragged_nested(j, path, shape, got, where)
        # An entry the first batch did not have: its rows would be dropped when joined with
        # rows of a batch without it (the joined dict takes the first part's entries).
        for j in {j for j, _ in self._nested}:
            column = data[j]
            if isinstance(column, Mapping):
                for path, leaf in _leaves(column, ()):
                    if (j, path) not in self._nested:
                        assert self.format is not None
                        entry = "".join(f"[{k!r}]" for k in path)
                        raise ValueError(
                            f"the nested field {self.format.keys[j]!r} of {where} has an entry "
                            f"{entry} (shape {tuple(leaf.shape)}) that an earlier source "
                            "batch's has not: their kept rows cannot be joined into one "
                            "training batch without dropping it; give every source batch the "
                            "same entries (e.g. fill the missing one with a default)"
                        )

    def _first_shapes(self, data: list[Any]) -> None:
        """Record the shapes of the first source batch checked; check the pad values against
        the dtypes of the fields they pad."""
        assert self.format is not None
        for j, value in self.pads.items():
            column = data[j]
            if isinstance(column, Mapping):
                key = self.format.keys[j]
                raise ValueError(
                    f"pad_values names the field {key!r}, a nested dict: its entries cannot be "
                    "padded; pad every source batch to one length (e.g. padding='max_length') "
                    "or make its entries top-level fields of the batches"
                )
            if not isinstance(column, torch.Tensor):
                continue
            if column.is_floating_point() or column.is_complex():
                continue
            if column.dtype == torch.bool:
                if value in (0, 1):
                    continue
                wrong = "a bool field pads with True, False, 0 or 1"
            elif not float(value).is_integer():
                wrong = f"a {column.dtype} field pads with whole numbers"
            else:
                info = torch.iinfo(column.dtype)
                if info.min <= value <= info.max:
                    continue
                wrong = f"a {column.dtype} field holds {info.min} to {info.max}"
            key = self.format.keys[j]
            raise ValueError(
                f"pad_values={{{key!r}: {value!r}}} cannot pad the field {key!r}: {wrong}; "
                "pass a pad value of the field's dtype"
            )
        self._shapes = {
            j: tuple(c.shape)
            for j, c in enumerate(data)
            if isinstance(c, torch.Tensor) and j not in self.pads
        }
        self._nested = {
            (j, path): tuple(t.shape)
            for j, c in enumerate(data)
            if isinstance(c, Mapping)
            for path, t in _leaves(c, ())
        }
        self._warn_left_padded(data)

    def _warn_left_padded(self, data: list[Any]) -> None:
        """Warn where a field that ``pad_values`` pads looks padded at the start of its rows in
        the first source batch checked (``data``): some rows, not all, begin with its pad value
        and none ends with it, as a tokenizer with ``padding_side='left'`` pads.

        NOTE: rows are padded at the end when joined (:func:`sbloader.batch.concat`), so a row
        of a narrower source batch padded at the start got padding at both ends
        (``[pad, pad, tok, tok, pad]``), silently: a model that reads the last position (a
        decoder's classification token) read padding. One look at the first batch (a sync on a
        GPU, once); right-padded fields, labels whose first token is ignored in every row and
        rows of one length are not warned of.
        """
        assert self.format is not None
        for j, value in self.pads.items():
            column = data[j]
            if not isinstance(column, torch.Tensor) or column.dim() != 2 or column.shape[1] < 2:
                continue
            first, last = column[:, 0] == value, column[:, -1] == value
            some, every, ends = torch.stack([first.any(), first.all(), last.any()]).tolist()
            if not some or every or ends:  # (read in one host sync)
                continue
            key = self.format.keys[j]
            warnings.warn(
                f"pad_values pads the field {key!r} at the end of its rows where rows of "
                "source batches of different widths are joined, but the first source batch "
                f"pads it at the start (some rows begin with {value!r}, none ends with it, as "
                "a tokenizer with padding_side='left' pads), so the rows of a narrower source "
                "batch get padding at both ends, and a model that reads the last position "
                "(e.g. a decoder's classification token) reads padding; pad on the right "
                "(tokenizer.padding_side = 'right'), or every source batch to one length "
                "(padding='max_length')",
                UserWarning,
                stacklevel=2,
            )

    def _ragged(
        self, j: int, first: tuple[int, ...], got: tuple[int, ...], where: str
    ) -> ValueError:
        assert self.format is not None
        key = self.format.keys[j]
        return ValueError(
            f"field {key!r} of {where} has shape {got}, but an earlier source batch's has "
            f"shape {first}: their kept rows differ in a size past dimension 0 and cannot be "
            "joined into one training batch. For batches padded to each batch's longest "
            "sequence (e.g. transformers' DataCollatorWithPadding), pass "
            f"pad_values={{{key!r}: <pad value>}} (with every such field) to pad the rows of a "
            "training batch to its longest: the tokenizer's pad_token_id for input ids, 0 for "
            "an attention mask, and for labels the loss's ignore index (-100 for "
            "nn.CrossEntropyLoss), not 0, which is a real class; or pad every source batch to "
            "one length (e.g. padding='max_length')"
        )

    def _ragged_nested(
        self,
        j: int,
        path: tuple[Hashable, ...],
        first: tuple[int, ...],
        got: tuple[int, ...] | None,
        where: str,
    ) -> ValueError:
        assert self.format is not None
        key = self.format.keys[j]
        entry = "".join(f"[{k!r}]" for k in path)
        has = "no such tensor" if got is None else f"shape {got}"
        return ValueError(
            f"the entry {entry} of the nested field {key!r} of {where} has {has}, but an "
            f"earlier source batch's has shape {first}: their kept rows cannot be joined into "
            "one training batch, and entries inside a nested dict cannot be padded "
            "(pad_values pads top-level fields). Pad every source batch to one length (e.g. "
            "padding='max_length'), or make the entry a top-level field of the batches and "
            "pass pad_values= for it"
        )

    def _yielded_format(self) -> tuple[B.BatchFormat, int] | None:
        """The yielded batches' format without ``drop_key``'s field, and that field's position,
        or None when nothing is dropped."""
        fmt = self.format
        if self.drop_key is None or fmt is None:
            return None
        if self._yielded is None or self._yielded[0] is not fmt:
            pos = fmt.position(self.drop_key)
            keys = fmt.keys[:pos] + fmt.keys[pos + 1 :]
            # (a mapping keeps its class without the field; a namedtuple cannot lose one)
            cls = fmt.cls if fmt.kind is dict else None
            out = B.BatchFormat(fmt.kind, keys, fmt.input_key, fmt.target_key, cls)
            self._yielded = (fmt, out, pos)
        return self._yielded[1], self._yielded[2]

    def view(self, data: list[Any]) -> Any:
        """The source batch's structure (a plain dict, tuple or list) over the columns ``data``,
        e.g. for a ``forward=`` hook (no copy)."""
        assert self.format is not None
        return self.format.view(data)

    def build(
        self, rows: Rows | WholeBatch, normalize_weights: bool, has_indices: bool
    ) -> B.SelectedBatch:
        """A yielded batch of the source's structure from ``rows``, with the selection results
        as attributes (``indices`` None when the source has none; weights scaled to mean 1 when
        ``normalize_weights``). A :class:`~sbloader.rows.WholeBatch`'s are made when first
        read (its weights are all 1, scaled or not)."""
        assert self.format is not None
        if self._unfound is not None:
            self._warn_unfound()
        if isinstance(rows, WholeBatch) and self.metadata_key is not None:
            rows = rows.rows()  # the metadata travels in the batch itself
        data = list(rows.data)
        in_pos = self.input_position
        x = data[in_pos]
        # NOTE: index_select and cat return the default layout; restore the requested one
        # (a no-op when the batch already has it, e.g. passthrough batches).
        data[in_pos] = B.in_memory_format(x, self.memory_format)
        if isinstance(rows, WholeBatch):
            batch = self._structure(data)
            batch._set_lazy_meta(partial(rows.metadata, has_indices))
            batch.features = rows.features
            batch.logits = _known_logits(rows.logits)
            return batch
        weights = rows.weights / rows.weights.mean() if normalize_weights else rows.weights
        indices = rows.indices if has_indices else None
        logits = _known_logits(rows.logits)
        assert self.format is not None
        if self.metadata_key is None:
            batch = self._structure(data)
        else:
            meta: dict[str, Any] = {
                "indices": indices,
                "losses": rows.losses,
                "probabilities": rows.probabilities,
                "weights": weights,
            }
            if rows.features is not None:
                meta["features"] = rows.features
            if rows.logits is not None:
                meta["logits"] = logits
            if self.format.kind is dict:
                batch = self._structure(data)
                if isinstance(batch, MutableMapping):
                    batch[self.metadata_key] = meta
                else:  # (a read-only mapping class: a plain dict of its items and the results)
                    batch = B.SelectedDict({**batch, self.metadata_key: meta})
            else:
                # (a tuple or list batch gets the results as one more entry: a plain one,
                # whatever the source's class, which is not built only to be dropped)
                fmt = self._drop_field(data)
                batch = (
                    B.SelectedList([*data, meta])
                    if fmt.kind is list
                    else B.SelectedTuple((*data, meta))
                )
        batch._set_meta(indices, rows.losses, rows.probabilities, weights)
        batch.features = rows.features
        batch.logits = logits
        return batch

    def _structure(self, data: list[Any]) -> B.SelectedBatch:
        """The yielded batch's structure over the columns ``data`` (``drop_key``'s field
        removed from ``data``)."""
        return self._drop_field(data).build(data)

    def _drop_field(self, data: list[Any]) -> B.BatchFormat:
        """Remove ``drop_key``'s field from the columns ``data``; the yielded batches' format."""
        assert self.format is not None
        fmt = self.format
        dropped = self._yielded_format()
        if dropped is not None:
            fmt, pos = dropped
            del data[pos]
        return fmt

    def _warn_unfound(self) -> None:
        """Warn (once) that a batch is built before the resumed run's first source batch
        without the source's batch class, which the loaded state names but which cannot be
        found in this process (a class defined in a function, saved by another process)."""
        assert self.format is not None
        name, self._unfound = self._unfound, None
        warnings.warn(
            f"the source's batch class {name!r}, which the loaded state names, cannot be "
            "imported in this process (a class defined in a function), so the batches handed "
            "out before the resumed run's first source batch are plain "
            f"{self.format.kind.__name__}s, not of that class (later ones have it again); "
            "define the batch class at module level to resume with it",
            UserWarning,
            stacklevel=4,
        )

    def state_dict(self) -> dict[str, Any]:
        f = self.format
        fmt = None
        if f is not None:
            fmt = {
                "kind": f.kind.__name__,
                "keys": list(f.keys),
                "input_key": f.input_key,
                "target_key": f.target_key,
            }
            if f.cls is not None:
                fmt["class"] = B.class_name(f.cls)
        shapes = None
        if self._shapes is not None:
            shapes = {j: list(shape) for j, shape in self._shapes.items()}
        # NOTE: "shapes" is optional within version 1 (older states have none): a resumed run
        # checks later source batches against the same first shapes as the run it continues.
        nested = [[j, list(path), list(shape)] for (j, path), shape in self._nested.items()]
        return {"version": self.VERSION, "format": fmt, "shapes": shapes, "nested": nested}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the format, so that restored rows can be yielded before (or without) another
        source batch, e.g. as a short last batch."""
        state = check_version(state, "BatchCodec", self.VERSION)
        fmt = state["format"]
        self._unfound = None
        if fmt is not None:
            keys = tuple(fmt["keys"])
            kind = _KINDS[fmt["kind"]]
            # NOTE: the saved run's fields are what its passes scored: a loader given other
            # fields explicitly would score the saved ones while saying it scores its own.
            for name, mine, saved in (
                ("input_key", self.input_key, fmt["input_key"]),
                ("target_key", self.target_key, fmt["target_key"]),
            ):
                if mine is not None and _as_key(mine, kind, len(keys)) != _as_key(saved):
                    raise ValueError(
                        f"the saved run's selection passes scored {name}={_as_key(saved)!r}, but "
                        f"this loader has {name}={mine!r}; build the loader with the saved run's "
                        f"{name} (another field is another run: start it afresh)"
                    )
            # NOTE: "class" is optional within version 1 (older states have none).
            cls = B.class_named(fmt.get("class"))
            self._unfound = fmt.get("class") if cls is None else None
            self.format = B.BatchFormat(kind, keys, fmt["input_key"], fmt["target_key"], cls)
            self._check_format()
        shapes = state.get("shapes")
        self._shapes = None
        if shapes is not None:
            self._shapes = {
                int(j): tuple(int(s) for s in shape)
                for j, shape in shapes.items()
                if int(j) not in self.pads
            }
        # NOTE: optional within version 1 ("nested" came later): older states check no entry.
        self._nested = {
            (int(j), tuple(path)): tuple(int(x) for x in shape)
            for j, path, shape in state.get("nested", [])
        }


def _as_key(key: Any, kind: type = dict, fields: int = 0) -> Any:
    """A field key as saved and as given alike: a tuple of keys (which comes back from a state
    as a list) as a tuple, each as a format of ``kind`` with ``fields`` fields holds it
    (:meth:`BatchFormat.stored_key <sbloader.batch.BatchFormat.stored_key>`)."""
    if isinstance(key, (list, tuple)):
        return tuple(_as_key(k, kind, fields) for k in key)
    return B.BatchFormat.stored_key(kind, fields, key)


def _leaves(
    column: Mapping[Any, Any], path: tuple[Hashable, ...]
) -> list[tuple[tuple[Hashable, ...], torch.Tensor]]:
    """The tensors inside a nested dict field, each with its path of keys."""
    out: list[tuple[tuple[Hashable, ...], torch.Tensor]] = []
    for k, v in column.items():
        if isinstance(v, torch.Tensor):
            out.append(((*path, k), v))
        elif isinstance(v, Mapping):
            out.extend(_leaves(v, (*path, k)))
    return out


def _entry(column: Any, path: tuple[Hashable, ...]) -> Any:
    """The entry at ``path`` of a nested dict field, or None where there is none."""
    for k in path:
        if not isinstance(column, Mapping) or k not in column:
            return None
        column = column[k]
    return column


def _time_major(
    inputs: Any, input_key: Hashable, n: int, column: Any, key: Hashable, m: int
) -> str:
    """The fix, for the message, where the input field (of ``n`` entries) or the field ``key``
    (of ``m``) has its examples in dimension 1: sequences of shape (time, batch), as
    ``pad_sequence`` pads them without ``batch_first=True``; else ``''``.

    Example:
        >>> x, y = torch.zeros(7, 4, 3), torch.zeros(4)
        >>> _time_major(x, 0, 7, y, 1, 4).startswith(" (field 0 has 4 in dimension 1")
        True
        >>> _time_major(torch.zeros(7, 3), 0, 7, y, 1, 4)
        ''
    """
    for field, tensor, count in ((input_key, inputs, m), (key, column, n)):
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 1 and tensor.shape[1] == count:
            return (
                f" (field {field!r} has {count} in dimension 1, so its examples look to be in "
                "dimension 1, as torch.nn.utils.rnn.pad_sequence pads sequences without "
                "batch_first=True); SelectiveLoader selects examples along dimension 0: make "
                "it (batch, time, ...), e.g. pad_sequence(..., batch_first=True) in the "
                "collate_fn, and transpose it back in forward= where the model takes "
                "(time, batch)"
            )
    return ""


def _check_not_collated_fields(keys: tuple[Hashable, ...], columns: list[Any]) -> None:
    """Raise naming the fix when a field is a list of tensors (or of tensors and lists) that all
    have the row count of another field: the default collate function's batch of a tuple or list
    of fields inside each example (``((ids, mask), label)``, ``(image, label, (index, path))``),
    which is no column of one entry per example; or a list
    of sequences that all have that count: its batch of a list inside each example (several
    captions of an image).

    Called only when the fields' lengths disagree: a list of per-example tensors whose row
    counts happen to agree (e.g. 5 boxes per image) is a column like any other (so is a list of
    per-example lists, and a transposed one where the batch has as many examples as each
    example's list has entries goes unseen).
    """
    lengths = [B.column_length(c, k) for k, c in zip(keys, columns)]
    for key, column, length in zip(keys, columns, lengths):
        if not (isinstance(column, list) and column):
            continue
        if all(isinstance(v, (list, tuple)) for v in column):
            # (the default collate function's batch of a list inside each example, e.g. five
            # captions an image: one tuple per position in the lists, of one entry per example)
            sizes = {len(v) for v in column}
            if len(sizes) != 1 or (m := sizes.pop()) == length or m not in lengths:
                continue
            raise ValueError(
                f"field {key!r} of a source batch is a list of {length} sequences of {m} "
                "entries each: a list inside each example (e.g. several captions of an "
                "image), which the default collate function batches as one tuple per position "
                "in the lists, each of one entry per example, so SelectiveLoader, which selects "
                "one entry per example, cannot select it; collate the field as a list of each "
                "example's own list (e.g. [sample[k] for sample in samples] in the DataLoader's "
                "collate_fn, the other fields by torch.utils.data.default_collate), or as a "
                "tensor of the examples' rows"
            )
        # (a tuple of fields of several kinds, (image, label, (index, path)), is batched as a
        # tensor and a list of strings: entries of either kind, counted alike)
        if not all(
            isinstance(v, (list, tuple)) or (isinstance(v, torch.Tensor) and v.dim() > 0)
            for v in column
        ):
            continue
        rows = {v.shape[0] if isinstance(v, torch.Tensor) else len(v) for v in column}
        if len(rows) != 1 or (m := rows.pop()) == length or m not in lengths:
            continue
        tensors = all(isinstance(v, torch.Tensor) for v in column)
        entries = f"tensors of {m} rows" if tensors else f"fields of {m} entries (tensors, lists)"
        raise ValueError(
            f"field {key!r} of a source batch is a list of {length} {entries} each: a "
            "tuple or list of fields inside each example (the default collate function batches "
            "((ids, mask), label) or (image, label, (index, path)) so), which SelectiveLoader "
            "cannot select, since it selects "
            "one entry per example; make the example a dict of fields, e.g. "
            "({'ids': ids, 'mask': mask}, label) with forward=lambda model, batch: "
            "model(**batch[0]) (nested dicts are selected entry by entry), or flatten it: "
            "(ids, mask, label) with input_key=(0, 1), target_key=2"
        )


def check_pad_values(value: Any) -> dict[Hashable, bool | int | float]:
    """``SelectiveLoader(pad_values=)`` as a dict of plain numbers ({} for None), or raise
    naming the parameter and the fix.

    Example:
        >>> check_pad_values({"input_ids": 0, "labels": -100})
        {'input_ids': 0, 'labels': -100}
    """
    example = (
        "e.g. pad_values={'input_ids': tokenizer.pad_token_id, 'attention_mask': 0, 'labels': -100}"
    )
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            "pad_values should be a dict from a field (a dict batch's key, or a position in "
            f"tuple/list batches) to the value to pad it with ({example}), but got "
            f"pad_values={value!r}"
        )
    out: dict[Hashable, bool | int | float] = {}
    for key, v in value.items():
        if isinstance(v, (bool, np.bool_)):
            out[key] = bool(v)
        elif isinstance(v, numbers.Integral):
            out[key] = int(v)
        elif isinstance(v, numbers.Real):
            out[key] = float(v)
        else:
            hint = (
                " (a tokenizer without a pad token has pad_token_id None: set one, e.g. "
                "tokenizer.pad_token = tokenizer.eos_token)"
                if v is None
                else ""
            )
            raise TypeError(
                "pad_values should map each field to a number or bool to pad it with "
                f"({example}), but got pad_values={dict(value)!r}{hint}"
            )
    return out


def _known_logits(logits: torch.Tensor | None) -> torch.Tensor | None:
    """A batch's ``logits``: None for rows of shape ``(k, 0)`` (no selection pass has shown the
    outputs' shape yet)."""
    if logits is not None and logits.dim() == 2 and logits.shape[1] == 0:
        return None
    return logits
