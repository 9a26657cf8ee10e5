"""The one configuration object of every benchmark (:class:`Config`), the presets of ``run.py``, and
what the timing benchmarks measure (:class:`Measurement`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

import sbloader

from . import strategies


@dataclass
class Config:
    """A benchmark's training setting and plan. Units in brackets in each field's docstring.

    ``run.py`` uses every field; ``breakdown.py`` and ``throughput.py`` use the training setting
    (model, data, batches, precision, layout, device, threads) and add their own measurement
    settings. Saved as ``config.json`` next to a run's results, flat, field by field.
    """

    preset: str = "quick"
    """The preset this configuration came from [name]."""
    epochs: int = 10
    """Planned epochs of the default schedule; a strategy named ``..._eN`` plans N [epochs]."""
    seeds: tuple[int, ...] = (0,)
    """Seeds: model initialisation, data order, selection randomness, label noise [1]."""
    strategies: tuple[str, ...] = ("traditional", "sb_0.33", "stale_sb_3")
    """Strategy names from ``benchmarks.core.strategies`` [names]."""
    batch_size: int = 128
    """Training batch [examples]."""
    pool_batch_size: int = 512
    """Source batch of selective strategies: the candidates of one selection pass [examples]."""
    lr: float = 0.05
    """Peak learning rate of the cosine schedule [1]."""
    momentum: float = 0.9
    """SGD (Nesterov) momentum [1]."""
    weight_decay: float = 5e-4
    """SGD weight decay [1]."""
    eval_every: float = 0.5
    """Evaluation interval [epochs of data]."""
    selection_precision: str = "auto"
    """Selection passes' precision: ``"auto"`` the loader's own choice (``autocast="auto"``:
    bf16 where the device computes it natively, else fp32), ``"bf16"`` or ``"fp32"``; training
    stays fp32 unless ``train_bf16`` [name].

    NOTE: never bf16 by fiat: on a CPU without AVX512-BF16 or AMX (AVX2 only), a bf16 selection
    forward of the benchmark CNN measured 8x slower than fp32 (1.71 s against 0.21 s per 512),
    which would charge sbloader for a setting no user of that machine would choose."""
    reference_error: float | None = None
    """The frontier's targets in seeds without a Traditional run at ``epochs`` are this error
    times each multiplier (None: such seeds are left out) [1]."""
    seed_reference_errors: tuple[tuple[int, float], ...] = ()
    """Per-seed reference errors, (seed, error) pairs, for seeds without a Traditional run at
    ``epochs`` (e.g. each seed's Traditional final error from another sitting, which
    deterministic runs repeat); ``reference_error`` covers the seeds not named [seed, 1]."""
    noise: float = 0.0
    """Fraction of training labels flipped in every run of ``strategies`` and ``families``
    (the frontier under label noise) [1]."""
    label_noise: tuple[float, ...] = (0.0,)
    """Fractions of training labels flipped [1]."""
    noise_strategies: tuple[str, ...] = ()
    """Strategies also run at the non-zero label-noise levels [names]."""
    noise_seeds: tuple[int, ...] = (0,)
    """Seeds of the label-noise runs [1]."""
    el2n_models: int = 2
    """EL2N: copies trained for scoring [models]."""
    el2n_epochs: int = 1
    """EL2N: epochs per scoring copy [epochs]."""
    el2n_keep: float = 0.7
    """EL2N: fraction of the training set kept [1]."""
    threads: int | None = None
    """torch intra-op threads (None: torch's default) [threads]."""
    model: str = "small_cnn"
    """``"small_cnn"`` (28 x 28), ``"resnet18"`` (CIFAR-style, 32 x 32) or ``"mlp"``
    (784-1024-1024-10) [name]."""
    dataset: str = "fashion_mnist"
    """``"fashion_mnist"``, or ``"cifar10"``, ``"cifar100"``, ``"svhn"`` from local files [name]."""
    data_root: str | None = None
    """Folder of a local dataset in torchvision's format (``--data``) [path]."""
    image_size: int = 28
    """Fashion-MNIST is padded to this size [pixels]."""
    device: str = "cpu"
    """``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda when available) [device]."""
    train_bf16: bool = False
    """Training forwards under bf16 autocast (GPU presets) [bool]."""
    augment: bool = False
    """Random crops (padding 4) and, unless svhn, flips of training batches [bool]."""
    channels_last: bool = True
    """Model and inputs in the channels_last memory format [bool]."""
    array_collate: bool = False
    """The DataLoader sources collate with ``ArrayDataset.collate`` (the gathered tensors are
    the batch) instead of torch's default collate function, which splits them into rows and
    stacks them again: the same batches, less host time (on by default for ResNet-18 on a GPU,
    from 2026-11-25 on; earlier results ran without it) [bool]."""
    families: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Families run at several budgets, added to ``strategies``: (strategy, planned epochs of
    each run) pairs; a budget equal to ``epochs`` runs under the strategy's own name [names,
    epochs]."""
    interleave: bool = False
    """Hold all of a seed's runs in memory and train them one epoch each in turn, so that a busy
    spell of a shared machine falls on all of them alike [bool]."""
    train_examples: int | None = None
    """Train on this prefix of the training set only (None: all of it) [examples]."""
    test_examples: int | None = None
    """Evaluate on this prefix of the test set only (None: all of it) [examples]."""
    keep_outputs: bool = False
    """Save what the per-example analysis needs next to each run's JSON (``runs/<run>.npz``:
    test-set outputs at every evaluation, selections per epoch, final training losses) and
    write the analysis report after training (``benchmarks/analysis.py``) [bool]."""
    el2n_archs: tuple[str, ...] = ()
    """Models whose EL2N scores the analysis compares (``model`` names), computed per seed with
    ``el2n_models`` copies of ``el2n_epochs`` epochs each and saved as
    ``scores/el2n_<model>__s<seed>.npz``; the first is the EL2N ranking compared with SB's
    selections [names]."""

    def resolved_device(self) -> torch.device:
        """The device, with ``"auto"`` resolved to cuda when available."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def memory_format(self) -> torch.memory_format | None:
        return torch.channels_last if self.channels_last else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """A configuration saved as ``config.json`` (lists back to tuples; fields added since
        it was saved keep their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names
        }
        if "selection_bf16" in d and "selection_precision" not in d:  # saved before 2026-11-25
            kw["selection_precision"] = "bf16" if d["selection_bf16"] else "fp32"
        kw["families"] = tuple((f, tuple(b)) for f, b in kw.get("families", ()))
        kw["seed_reference_errors"] = tuple(
            (int(seed), float(error)) for seed, error in kw.get("seed_reference_errors", ())
        )
        return cls(**kw)

    def given_reference_errors(self, seeds: Iterable[int]) -> dict[int, float]:
        """The reference error given for each of ``seeds`` (``seed_reference_errors``, else
        ``reference_error``); seeds with none are left out."""
        per_seed = dict(self.seed_reference_errors)
        out = {}
        for seed in seeds:
            error = per_seed.get(seed, self.reference_error)
            if error is not None:
                out[seed] = error
        return out

    def run_names(self) -> tuple[str, ...]:
        """``strategies`` followed by every member of ``families`` (each name once)."""
        names = list(self.strategies)
        for family, budgets in self.families:
            names += strategies.family_members(family, tuple(budgets), self.epochs)
        return tuple(dict.fromkeys(names))


# Shared by every ResNet-18 configuration (a GPU's): run.py's presets and breakdown's --gpu.
RESNET: dict[str, Any] = dict(
    model="resnet18",
    image_size=32,
    train_bf16=True,
    batch_size=256,
    pool_batch_size=1024,
    array_collate=True,
)
_RESNET_RUN: dict[str, Any] = dict(RESNET, device="auto", lr=0.1)
_GPU_STRATEGIES = (
    "traditional",
    "traditional_e4",
    "random_0.33",
    "sb_0.33",
    "sb_0.33_rwarmup",
    "stale_sb_3",
    "stale_sb_3_rwarmup",
)

PRESETS: dict[str, dict[str, Any]] = {
    # The main job: the frontier measure for one seed, every run trained interleaved.
    # NOTE: the controls at the frontier preset's budgets: without Traditional at 2 epochs
    # (the best control at x1.4 in every seed of frontier_amx_1126) and at 6, and
    # Random-Backprop at 20 (the best at x1.0-x1.1 in most seeds), the preset's speedups at
    # the loosest and tightest targets were over weaker controls than the frontier's.
    "quick": dict(
        strategies=("traditional",),  # the reference: Traditional at ``epochs``
        families=(
            ("traditional", (2, 3, 4, 6, 10)),
            ("random_0.33", (3, 5, 10, 20)),
            ("recipe_fb_int8", (2, 3, 5)),
            ("recipe_anneal_fb_int8", (10,)),
        ),
        interleave=True,
    ),
    "full": dict(
        seeds=(0, 1, 2),
        # The headline comparisons first, so that a run cut short still holds them.
        strategies=(
            "traditional",
            "traditional_e4",
            "traditional_e6",
            "random_0.33",
            "random_0.33_warmup",
            "sb_0.33_rwarmup",
            "stale_sb_3_rwarmup",
            "sb_0.33",
            "stale_sb_3",
            "stale_sb_2",
            "random_0.5",
            "random_0.25",
            "sb_0.5",
            "sb_0.25",
            "kath18",
            "el2n",
            "diet_sb",
            "diet_sb_rwarmup",
            "sb_0.33_warmup",
            "stale_sb_3_warmup",
            "sb_0.33_anneal",
            "sb_0.33_reweight",
        ),
        label_noise=(0.0, 0.01, 0.1, 0.2),
        noise_strategies=("traditional", "random_0.33", "sb_0.33_rwarmup"),
    ),
    # For a lent GPU: ResNet-18 on Fashion-MNIST padded to 32 x 32, larger batches, bf16.
    "gpu": dict(seeds=(0, 1, 2), strategies=_GPU_STRATEGIES, **_RESNET_RUN),
    # The frontier measure (issue 12) on a lent GPU: ResNet-18 as in ``gpu``, each family at
    # several budgets, trained interleaved (all runs' models held on the GPU).
    "gpu_frontier": dict(
        seeds=(0, 1, 2),
        strategies=("traditional",),
        families=tuple(strategies.GPU_FAMILIES.items()),
        interleave=True,
        **_RESNET_RUN,
    ),
    # For data a user has locally in torchvision's format (never downloaded): --data FOLDER.
    "cifar10": dict(
        dataset="cifar10", augment=True, epochs=30, strategies=_GPU_STRATEGIES, **_RESNET_RUN
    ),
    "cifar100": dict(
        dataset="cifar100", augment=True, epochs=30, strategies=_GPU_STRATEGIES, **_RESNET_RUN
    ),
    "svhn": dict(
        dataset="svhn", augment=True, epochs=20, strategies=_GPU_STRATEGIES, **_RESNET_RUN
    ),
    # The per-example analysis (benchmarks/analysis.py), about 23 minutes on one shared core:
    # SB and Traditional of one seed on all of Fashion-MNIST over 5 epochs (not 10), SB again
    # with 10% of labels flipped, and EL2N scores of the CNN and an MLP (2 copies x 1 epoch).
    "analysis": dict(
        epochs=5,
        strategies=("traditional", "sb_0.33_rwarmup"),
        label_noise=(0.0, 0.1),
        noise_strategies=("sb_0.33_rwarmup",),
        keep_outputs=True,
        el2n_archs=("small_cnn", "mlp"),
        threads=1,
    ),
    # The frontier measure (issue 12): each family at several budgets, trained interleaved.
    "frontier": dict(
        seeds=(0, 1, 2),
        strategies=("traditional",),  # the reference: Traditional at ``epochs``
        families=tuple(strategies.FAMILIES.items()),
        interleave=True,
    ),
    # The same with the MLP (784-1024-1024-10), and with 10% of the labels flipped.
    "frontier_mlp": dict(
        seeds=(0, 1, 2),
        model="mlp",
        strategies=("traditional",),
        families=tuple(strategies.MLP_FAMILIES.items()),
        interleave=True,
    ),
    "frontier_noise": dict(
        seeds=(0, 1, 2),
        noise=0.1,
        strategies=("traditional",),
        families=tuple(strategies.NOISE_FAMILIES.items()),
        interleave=True,
    ),
    # The default's safety: SelectiveLoader(source, model) as a user builds it, against
    # Random-Backprop at the same budget, over ten seeds. Evaluated every half epoch, as the
    # frontier is: x1.4 is reached within 3-4 epochs of 6-9 s, where evaluating once an epoch
    # would place each run's arrival up to a whole epoch late.
    "default_safety": dict(
        seeds=tuple(range(10)),
        strategies=("random_0.33", "default", "default_fb"),
        interleave=True,
        reference_error=0.074,  # Traditional-10's final error here (frontier, seeds 0-2)
    ),
}


def preset(name: str, **overrides: Any) -> Config:
    """The configuration of a preset, with ``overrides`` (None values ignored)."""
    if name not in PRESETS:
        raise ValueError(f"preset should be one of {sorted(PRESETS)}, but got preset={name!r}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return Config(preset=name, **kw)


@dataclass
class Measurement:
    """How ``breakdown.py`` and ``throughput.py`` measure: what is timed, how often, on how much
    data (the training setting itself is a :class:`Config`). Units in brackets."""

    quick: bool = False
    """A small subset, for an indicative figure in minutes [bool]."""
    examples: int = 60_000
    """Training examples per epoch (a prefix of the training set) [examples]."""
    selectivity: float = 1 / 3
    """SB's and Stale-SB's expected kept fraction [1]."""
    staleness: int = 3
    """Stale-SB: a fresh selection pass every n-th epoch [epochs]."""
    warmup_batches: int = 8
    """Untimed batches before each measurement [batches]."""
    repeats: int = 1
    """Measurements per configuration; figures are medians [runs]."""
    ffcv_workers: int = 1
    """FFCV decoding threads [threads]."""
    option_batches: int = 12
    """Selection cost: examples per round, in source batches [batches]."""
    throughput_epochs: int = 2
    """Trivial-model throughput: epochs of the raw source and of the loader per measurement,
    alternated (one pair per epoch) [epochs]."""
    frozen_examples: int = 60_000
    """Frozen-backbone comparison: examples per epoch [examples]."""
    seed: int = 0
    """Model initialisation and data order [1]."""

    def policy(self, kind: str) -> sbloader.Policy:
        """The policy measured as ``kind``: ``traditional``, ``sb`` (SB at ``selectivity``) or
        ``stale_sb`` (Stale-SB at ``selectivity`` with ``staleness``)."""
        if kind == "traditional":
            return strategies.traditional().policy(1)
        if kind == "sb":
            return strategies.selective_backprop(self.selectivity).policy(1)
        if kind == "stale_sb":
            return strategies.stale_sb(self.staleness, selectivity=self.selectivity).policy(1)
        raise ValueError(f"kind should be traditional, sb or stale_sb, but got kind={kind!r}")


def measurement(quick: bool, gpu: bool = False, **overrides: Any) -> tuple[Config, Measurement]:
    """The training setting and the measurement of ``breakdown.py`` (``throughput.py``: not
    quick). ``quick``: a small subset; ``gpu``: ResNet-18 at 32 x 32 on CUDA with bf16 training.
    ``overrides`` (None values ignored) go to whichever of the two has the field."""
    setting: dict[str, Any] = dict(preset="breakdown")
    measure: dict[str, Any] = (
        dict(
            quick=True,
            examples=6_144,
            warmup_batches=4,
            option_batches=4,
            throughput_epochs=1,
            frozen_examples=4_096,
        )
        if quick
        else dict(repeats=3)
    )
    if gpu:
        setting.update(RESNET, device="cuda")
    names = {f.name for f in dataclasses.fields(Measurement)}
    for k, v in overrides.items():
        if v is not None:
            (measure if k in names else setting)[k] = v
    return Config(**setting), Measurement(**measure)
