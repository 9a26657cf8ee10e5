"""EL2N pre-pruning (Paul et al., 2021): score examples by the error of briefly trained models.

EL2N(x, y) = ||softmax(f(x)) - onehot(y)||_2, averaged over ``models`` copies of the user's model,
each trained for ``epochs`` epochs with the user's recipe and scored in eval mode (with targets
given as class probabilities, (batch, classes), ``y`` is subtracted as it is). Its cost (time,
forwards and backwards) is reported, because a fair comparison must charge it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from . import _kernels
from ._checks import check_choice, check_device_name, check_float, check_int, indices_needed
from .adapt import make_source
from .selection import eval_mode

__all__ = ["EL2NResult", "el2n_scores", "prune"]


@dataclass
class EL2NResult:
    """EL2N scores by dataset index, and what computing them cost.

    Attributes:
        scores: float64, one per dataset index (NaN for examples never scored).
        seconds: wall-clock of training and scoring all models.
        train_examples: examples forwarded and backpropagated while training the models.
        score_forwards: examples forwarded to score them.
        models, epochs: the recipe's size.

    Example:
        >>> r = EL2NResult(scores=np.array([0.2, 1.1, 0.7, 0.9]), seconds=0.5, train_examples=8,
        ...                score_forwards=4, models=1, epochs=2)
        >>> r.cost()
        {'seconds': 0.5, 'train_examples': 8, 'score_forwards': 4, 'models': 1, 'epochs': 2}
        >>> prune(r.scores, 0.5).tolist()
        [1, 3]
    """

    scores: np.ndarray
    seconds: float
    train_examples: int
    score_forwards: int
    models: int
    epochs: int
    per_model_seconds: list[float] = field(default_factory=list)

    def cost(self) -> dict[str, Any]:
        """The cost as a plain dict (for benchmark records)."""
        return {
            "seconds": self.seconds,
            "train_examples": self.train_examples,
            "score_forwards": self.score_forwards,
            "models": self.models,
            "epochs": self.epochs,
        }


def _default_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Any, targets: Any
) -> None:
    loss = nn.functional.cross_entropy(model(inputs), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _to(x: Any, device: torch.device) -> Any:
    return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x


def el2n_scores(
    make_model: Callable[[], nn.Module],
    source: Any,
    *,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    models: int = 4,
    epochs: int = 2,
    train_step: Callable[[nn.Module, torch.optim.Optimizer, Any, Any], None] | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> EL2NResult:
    """Train ``models`` fresh models for ``epochs`` epochs each and average their EL2N scores.

    Args:
        make_model: returns a freshly initialised model (called once per copy).
        source: a DataLoader over a map-style dataset yielding ``(inputs, targets)`` batches; used
            to train each copy and then, in one more pass, to score every example by index.
            Targets are class indices (batch,), or class probabilities (batch, classes).
        make_optimizer: builds the optimizer for a model (the user's recipe).
        models: K, the number of independently initialised copies (the paper: 10).
        epochs: E, epochs of training per copy (short: the paper scores early in training).
        train_step: ``train_step(model, optimizer, inputs, targets)``; default cross-entropy SGD.
        device: where to train. Default: the device of ``make_model()``'s parameters.
        seed: copy k initialises (and shuffles, if the source uses torch's global RNG) under
            ``seed + k`` inside ``torch.random.fork_rng``, so the caller's RNG state is untouched.

    Returns:
        An :class:`EL2NResult`.

    Raises:
        ValueError: in a copy's scoring pass, where its outputs are NaN (it diverged) and so
            its scores would be; an infinite logit (a float16 model's overflow) scores as its
            limit instead; class indices outside [0, classes). Also, before any copy trains, a
            source without dataset indices, that drops its last partial batch or whose sampler
            draws with replacement, and a ``seed`` above ``2**64 - models``; at a copy's first
            batch, targets of another shape than (batch,) or (batch, classes); at the second
            copy, a ``make_model`` whose copies share trainable parameters.
        TypeError: a ``make_model``, ``make_optimizer`` or ``train_step`` that is not a
            function, a ``make_model()`` that is not an ``nn.Module``, or batches that are not
            ``(inputs, targets)`` tuples (dict batches), at the first batch.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
        >>> r = el2n_scores(lambda: nn.Linear(5, 3), DataLoader(TensorDataset(x, y), 16),
        ...                 make_optimizer=lambda m: torch.optim.SGD(m.parameters(), 0.1),
        ...                 models=2, epochs=1)
        >>> r.scores.shape, bool(((r.scores >= 0) & (r.scores <= 2 ** 0.5)).all())
        ((64,), True)
        >>> r.train_examples, r.score_forwards
        (128, 128)
    """
    if isinstance(make_model, nn.Module) or not callable(make_model):
        raise TypeError(
            "make_model should be a function that returns a freshly initialised model (called "
            f"once per copy), but got make_model={type(make_model).__name__}; pass e.g. "
            "make_model=lambda: MyNet()"
        )
    optimizer_class = isinstance(make_optimizer, type) and issubclass(
        make_optimizer, torch.optim.Optimizer
    )
    if optimizer_class or not callable(make_optimizer):
        raise TypeError(
            "make_optimizer should be a function that builds a model's optimizer, but got "
            f"make_optimizer={getattr(make_optimizer, '__name__', type(make_optimizer).__name__)}"
            "; pass e.g. make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1)"
        )
    if train_step is not None and not callable(train_step):
        raise TypeError(
            "train_step should be a function train_step(model, optimizer, inputs, targets) or "
            f"None, but got train_step={train_step!r}"
        )
    models = check_int("models", models, minimum=1)
    epochs = check_int("epochs", epochs, minimum=0)
    seed = check_int("seed", seed, minimum=0)
    if seed + models - 1 >= 2**64:  # copy k is seeded with seed + k, and torch's seeds are uint64
        raise ValueError(
            f"seed should be at most 2**64 - models = {2**64 - models} (copy k is seeded with "
            f"seed + k, and torch's seeds are 64-bit), but got seed={seed} with models={models}; "
            "pass a smaller seed"
        )
    given = None if device is None else check_device_name("device", device)
    src = make_source(source)
    size = src.dataset_size
    if not src.has_indices() or size is None:
        raise indices_needed("el2n_scores", "pass a DataLoader over a map-style dataset")
    if src.drop_last():
        raise ValueError(
            "el2n_scores scores every example in one pass over source, but its last partial "
            "batch is dropped (drop_last=True), so some examples would go unscored (NaN) or be "
            "averaged over fewer copies; pass a DataLoader with drop_last=False"
        )
    # NOTE: a sampler drawing with replacement (WeightedRandomSampler, RandomSampler(
    # replacement=True)) scores some examples twice in a pass and others never: NaN scores
    # that prune refused only later, without naming the sampler.
    if src.draws_with_replacement():
        sampler = src.sampler
        raise ValueError(
            "el2n_scores scores every example in one pass over source, but its sampler "
            f"({type(sampler).__name__}) draws with replacement, so some examples would go "
            "unscored (NaN) and others be scored twice; pass a DataLoader over the same dataset "
            "that draws each example once (shuffle=True or shuffle=False)"
        )
    # NOTE: the source's own generators (a DataLoader's generator=, which a resumable run
    # shuffles with) are put back as they were: scoring must not change the order of the
    # training that follows, nor make two calls with one seed score differently.
    source_state = src.state_dict()
    step = train_step or _default_step
    sums = np.zeros(size, dtype=np.float64)
    counts = np.zeros(size, dtype=np.int64)
    train_examples = score_forwards = 0
    per_model: list[float] = []
    # The parameters of the copies made so far, while they are alive (see _check_fresh).
    earlier: dict[int, weakref.ref[torch.Tensor]] = {}
    start = time.perf_counter()
    try:
        for k in range(models):
            t0 = time.perf_counter()
            dev = given
            devices = _cuda_devices(dev)
            with torch.random.fork_rng(devices=devices):
                # NOTE: not torch.manual_seed, which also reseeds every CUDA device's generator,
                # including those fork_rng does not restore: only the forked ones are seeded.
                torch.default_generator.manual_seed(seed + k)
                for d in devices:
                    with torch.cuda.device(d):
                        torch.cuda.manual_seed(seed + k)
                model = make_model()
                _check_fresh(model, earlier, k)
                if dev is None:
                    dev = next(model.parameters()).device
                model.to(dev)
                optimizer = make_optimizer(model)
                model.train()
                for _ in range(epochs):
                    for batch, _idx in src.epoch():
                        inputs, targets = (_to(v, dev) for v in _fields_of(batch))
                        _check_targets(targets)
                        step(model, optimizer, inputs, targets)
                        train_examples += len(targets)
                # NOTE: the scoring pass inside the fork too: every iter() of a DataLoader draws
                # its base seed (and a shuffling one its order) from torch's global RNG.
                copy_sums = np.zeros(size, dtype=np.float64)
                copy_counts = np.zeros(size, dtype=np.int64)
                with eval_mode(model), torch.inference_mode():
                    for batch, idx in src.epoch():
                        inputs, targets = (_to(v, dev) for v in _fields_of(batch))
                        _check_targets(targets)
                        probs = torch.softmax(_finite_logits(model(inputs).float()), dim=1)
                        err = torch.linalg.vector_norm(probs - _target_rows(targets, probs), dim=1)
                        values = err.cpu().numpy().astype(np.float64)
                        index = np.ascontiguousarray(idx, np.int64)
                        _check_scores(values, index, k, epochs)
                        _kernels.accumulate(copy_sums, copy_counts, index, values)
                        score_forwards += len(targets)
                # NOTE: each copy's mean first, then the mean over copies: an example a batch
                # sampler yields twice in a pass counts once per copy, as every other does.
                scored = copy_counts > 0
                sums[scored] += copy_sums[scored] / copy_counts[scored]
                counts[scored] += 1
            per_model.append(time.perf_counter() - t0)
    finally:
        src.load_state_dict(source_state)
    with np.errstate(invalid="ignore", divide="ignore"):
        scores = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return EL2NResult(
        scores,
        time.perf_counter() - start,
        train_examples,
        score_forwards,
        models,
        epochs,
        per_model,
    )


def _fields_of(batch: Any) -> tuple[Any, Any]:
    """A source batch's inputs and targets, its first two fields.

    NOTE: a dict batch failed on ``batch[0]`` with a bare ``KeyError: 0``, naming neither the
    batch format nor the fix.

    Example:
        >>> _fields_of((torch.zeros(2, 3), torch.tensor([0, 1])))[1].tolist()
        [0, 1]
    """
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    what = (
        f"dict batches with keys {list(batch)!r}"
        if isinstance(batch, Mapping)
        else f"{type(batch).__name__} batches"
        + (f" of {len(batch)} field" if isinstance(batch, (tuple, list)) else "")
    )
    raise TypeError(
        f"el2n_scores takes (inputs, targets) batches, but source yields {what}; pass a "
        "DataLoader whose batches are (inputs, targets) tuples, e.g. with a collate_fn that "
        "returns (batch[input field], batch[target field])"
    )


def _finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with infinite entries at float32's largest (or lowest), NaN left as it is.

    NOTE: a logit of +inf (a float16 model's above 65504, cast to float32 after the overflow)
    made its row's softmax NaN (inf - inf), where its limit is the class's probability 1.

    Example:
        >>> _finite_logits(torch.tensor([[float("inf"), 0.0]])).softmax(dim=1).tolist()
        [[1.0, 0.0]]
    """
    return torch.nan_to_num(logits, nan=float("nan"))


def _check_scores(values: np.ndarray, indices: np.ndarray, copy: int, epochs: int) -> None:
    """Refuse the EL2N scores of a scoring batch where one is not finite (NaN outputs, or NaN
    soft targets).

    NOTE: they were left out of the average (as ``_kernels.accumulate`` skips non-finite
    values): a copy that diverged gave every example the mean of the other copies, or NaN
    where it was the only one, which :func:`prune` then took for examples never scored.
    """
    finite = np.isfinite(values)
    if finite.all():
        return
    bad = indices[~finite]
    raise ValueError(
        f"el2n_scores got NaN scores from copy {copy} for {len(bad)} examples of a scoring "
        f"batch (dataset indices {bad[:5].tolist()}): the model's outputs are NaN (the copy "
        f"diverged in its {epochs} epochs of training) or the targets are, and averaged over "
        "the other copies the scores would not be those of every copy; lower the learning rate "
        "in make_optimizer (or the epochs), or mend the targets"
    )


def _check_targets(targets: Any) -> None:
    """Refuse targets that EL2N cannot score, at the first batch (of training, not after it).

    NOTE: (batch, 1) targets, or any other shape, failed in one_hot or in the score's
    accumulation only in the scoring pass, after a whole copy had trained (with a train_step
    that takes them), with a message naming neither the targets nor the fix.
    """
    if not isinstance(targets, torch.Tensor):
        return  # (the train_step's business; scoring reports it)
    if targets.ndim == 1 or (targets.ndim == 2 and targets.is_floating_point()):
        return
    raise ValueError(
        "el2n_scores scores targets that are class indices, shape (batch,), or class "
        f"probabilities, shape (batch, classes), but a batch's targets have shape "
        f"{tuple(targets.shape)} and dtype {targets.dtype}; have the dataset return class "
        "indices (e.g. int(target) or target.squeeze(0) per example)"
    )


def _target_rows(targets: Any, probs: torch.Tensor) -> torch.Tensor:
    """The rows to subtract from ``probs``: one-hot rows of class indices, or (batch, classes)
    class probabilities (soft labels, e.g. one-hot float labels) as they are.
    """
    if isinstance(targets, torch.Tensor) and targets.ndim == 2:
        if targets.shape != probs.shape:
            raise ValueError(
                f"el2n_scores takes (batch, classes) targets as class probabilities, but a "
                f"batch's targets have shape {tuple(targets.shape)} and the model's outputs "
                f"{tuple(probs.shape)}; pass one probability per class, or class indices"
            )
        return targets.to(probs.dtype)
    classes = probs.shape[1]
    labels = torch.as_tensor(targets).long()
    # NOTE: checked here, not by one_hot, whose message named neither the targets nor the
    # model's class count.
    low, high = (int(v) for v in torch.aminmax(labels)) if labels.numel() else (0, 0)
    if low < 0 or high >= classes:
        bad = high if high >= classes else low
        raise ValueError(
            f"el2n_scores takes class indices in [0, {classes}) as targets (the model has "
            f"{classes} outputs), but a batch holds class {bad}; have the dataset return class "
            "indices from 0, or make_model a model with an output per class"
        )
    # (any integer dtype: cross-entropy takes uint8 labels, one_hot not)
    return nn.functional.one_hot(labels, classes).to(probs.dtype)


def _check_fresh(model: Any, earlier: dict[int, weakref.ref[torch.Tensor]], k: int) -> None:
    """Refuse a ``make_model()`` result that is not a new module or shares parameters with an
    earlier copy still alive; then remember its parameters in ``earlier`` (by id, weakly: a
    copy already freed cannot be shared).

    NOTE: ``make_model=lambda: model`` (the model being trained) trained that model in place
    and continued each copy from the previous one's weights: the scores silently averaged one
    ever longer training instead of ``models`` short ones, and the caller's model came back
    trained. Caught at the second copy, after the first one trained (a single copy cannot be
    told from a fresh model).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"make_model should return a freshly initialised nn.Module, but got "
            f"make_model()={type(model).__name__}; pass a function that builds the model, e.g. "
            "make_model=lambda: MyNet()"
        )
    # NOTE: trainable parameters only: a frozen backbone shared by every copy (a head trained
    # on fixed features) is not trained by el2n_scores, so sharing it changes nothing.
    params = [p for p in model.parameters() if p.requires_grad]
    if any(p is _alive(earlier.get(id(p))) for p in params):
        raise ValueError(
            f"make_model should return a new model on each call, but copy {k} shares parameters "
            "with an earlier copy (make_model=lambda: model returns the model itself, which "
            "el2n_scores trains in place); pass a function that builds a fresh model, e.g. "
            "make_model=lambda: MyNet(), or copy.deepcopy(model) of an untrained one"
        )
    earlier.update((id(p), weakref.ref(p)) for p in params)


def _alive(ref: weakref.ref[torch.Tensor] | None) -> torch.Tensor | None:
    return None if ref is None else ref()


def _cuda_devices(device: torch.device | None) -> list[int]:
    """The CUDA devices whose random state EL2N's training runs fork and seed: ``device``'s when
    it is a CUDA device; with no device given, every CUDA device where CUDA is initialized (the
    model may be made on any of them); none otherwise.

    Example:
        >>> _cuda_devices(torch.device("cpu"))
        []
    """
    if device is not None:
        if device.type != "cuda":
            return []
        return [device.index if device.index is not None else torch.cuda.current_device()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


def prune(scores: Any, fraction: float, keep: str = "hardest") -> np.ndarray:
    """The dataset indices to keep: exactly ``fraction * len(scores)`` of them, rounded to the
    nearest integer (halves up).

    Args:
        scores: one score per dataset index (e.g. ``el2n_scores(...).scores``); no NaN.
        fraction: the fraction of examples to keep, in (0, 1].
        keep: ``"hardest"`` (highest scores; the EL2N paper's choice) or ``"easiest"``.

    Returns:
        Sorted int64 dataset indices. Ties are broken by index (lower first), deterministically.

    Example:
        >>> prune([0.1, 0.9, 0.5, 0.9], 0.5).tolist()
        [1, 3]
        >>> prune([0.1, 0.9, 0.5, 0.9], 0.5, keep="easiest").tolist()
        [0, 2]
    """
    fraction = check_float("fraction", fraction, low=0.0, high=1.0, low_open=True)
    keep = check_choice("keep", keep, ("hardest", "easiest"))
    if isinstance(scores, torch.Tensor):
        # NOTE: as float64 first: numpy has no bfloat16, and np.asarray of a bf16 tensor (scores
        # made under autocast) was refused as not holding "one number per dataset index".
        scores = scores.detach().cpu()
        if scores.is_floating_point():
            scores = scores.to(torch.float64)
    try:
        s = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"scores should hold one number per dataset index, but got {type(scores).__name__} "
            f"({e}); pass e.g. el2n_scores(...).scores"
        ) from e
    if np.asarray(scores).dtype == np.bool_:  # (it converted: no ragged or object rows)
        # (a mask, e.g. a selection, was ranked as scores of 0 and 1, unsaid)
        raise TypeError(
            "scores should hold one number per dataset index, but got booleans (a mask); pass "
            "e.g. el2n_scores(...).scores, or np.flatnonzero(mask) for a mask's indices"
        )
    if s.ndim == 0 or s.size == 0:
        raise ValueError(
            f"scores should hold a score for each dataset index, but got shape {s.shape}; pass "
            "e.g. el2n_scores(...).scores"
        )
    # NOTE: a column (N, 1) or a row (1, N) is one score per index; (N, K) scores (one per
    # model, say) were flattened into N * K "indices" before.
    if sum(d > 1 for d in s.shape) > 1:
        raise ValueError(
            f"scores should hold one score per dataset index (a 1-d array), but got shape "
            f"{s.shape}; reduce the other dimensions first (e.g. scores.mean(axis=1) for one row "
            "per index)"
        )
    s = s.reshape(-1)
    if np.isnan(s).any():
        raise ValueError(
            f"scores has {int(np.isnan(s).sum())} NaN entries (examples never scored); score "
            "every example, or fill them before pruning"
        )
    # NOTE: halves up, as the analysis functions count the top fraction (analysis._top_sizes),
    # so that pruning to f and the overlap at f keep the same number (Python's round() takes
    # 2.5 to 2, and 0.145 * 100 = 14.499999999999998 to 14).
    k = int(np.floor(np.round(fraction * s.shape[0], 9) + 0.5))
    if k == 0:
        raise ValueError(
            f"prune keeps round(fraction * len(scores)) examples, but fraction={fraction:g} of "
            f"{s.shape[0]} scores keeps none; pass fraction >= 1/{s.shape[0]} (at least one "
            "example)"
        )
    order = np.argsort(-s if keep == "hardest" else s, kind="stable")
    return np.sort(order[:k]).astype(np.int64)
