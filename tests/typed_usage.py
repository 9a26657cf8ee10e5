"""The public API as a type-checked training loop uses it (CI's mypy checks this file).

A user who runs mypy over their own loop must not need casts or ignores for what the README
shows: unpacking and indexing a yielded batch, reading its selection results, the stats and
their reduction over ranks, the state protocol.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import sbloader
from sbloader.distributed import reduce_stats


def main() -> int:
    data = TensorDataset(torch.randn(48, 4), torch.randint(0, 3, (48,)))
    model = torch.nn.Linear(4, 3)
    loader = sbloader.SelectiveLoader(
        DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)),
        model,
        policy=sbloader.SelectiveBackprop(0.5),
        batch_size=8,
        seed=0,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backpropagated = 0
    for batch in loader:
        inputs, targets = batch
        first: torch.Tensor = batch[0]
        assert first is inputs
        losses = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="none")
        weights: torch.Tensor = batch.weights
        probabilities: torch.Tensor = batch.probabilities
        assert batch.indices is not None and len(batch) == 2 and probabilities.numel() == 8
        loader.feedback(batch.indices, losses.detach())
        optimizer.zero_grad()
        (losses * weights).mean().backward()
        optimizer.step()
        backpropagated += len(batch.indices)
    epoch = loader.stats.current
    assert epoch is not None
    seen: int = reduce_stats(epoch).examples_seen
    epochs: list[sbloader.EpochStats] = reduce_stats(loader.stats).epochs
    state: dict[str, object] = loader.state_dict()
    loader.load_state_dict(state)
    assert seen == 48 and len(epochs) == 1
    return backpropagated
