"""sbloader: Selective-Backprop and its relatives as a drop-in PyTorch data loader.

Replace the training DataLoader with a :class:`SelectiveLoader`; it runs a cheap selection pass
over each candidate batch and yields full training batches of the examples worth learning from.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> import sbloader
    >>> data = TensorDataset(torch.randn(512, 4), torch.randint(0, 2, (512,)))
    >>> model = nn.Linear(4, 2)
    >>> loader = sbloader.SelectiveLoader(
    ...     DataLoader(data, batch_size=96), model,
    ...     policy=sbloader.SelectiveBackprop(selectivity=1 / 3), batch_size=32)
    >>> sum(len(y) for _, y in loader) % 32
    0
"""

from . import analysis as analysis
from ._checks import NonFiniteLoss
from .batch import SelectedBatch, SelectedDict, SelectedList, SelectedTuple
from .el2n import EL2NResult, el2n_scores, prune
from .epoch import EpochIterator
from .features import FeatureCache
from .length import FixedEpochIterator
from .loader import SelectiveLoader
from .policies import (
    Choice,
    Kath18,
    Phased,
    Policy,
    RandomBackprop,
    SelectiveBackprop,
    Traditional,
    default_policy,
)
from .quantize import QuantizedSelection
from .sources import DataLoaderSource, IterableSource, Source
from .stateful import StatefulSource
from .stats import EpochStats, LoaderStats
from .store import ExampleStore
from .window import LossWindow

__version__ = "0.1.0"

__all__ = [
    "Choice",
    "DataLoaderSource",
    "EL2NResult",
    "EpochIterator",
    "EpochStats",
    "ExampleStore",
    "FeatureCache",
    "FixedEpochIterator",
    "IterableSource",
    "Kath18",
    "LoaderStats",
    "LossWindow",
    "NonFiniteLoss",
    "Phased",
    "Policy",
    "QuantizedSelection",
    "RandomBackprop",
    "SelectedBatch",
    "SelectedDict",
    "SelectedList",
    "SelectedTuple",
    "SelectiveBackprop",
    "SelectiveLoader",
    "Source",
    "StatefulSource",
    "Traditional",
    "__version__",
    "default_policy",
    "el2n_scores",
    "prune",
]
