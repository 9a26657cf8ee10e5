"""Made tests/data/loader_state_v1.pt with the sbloader of commit 7e08153 (state version 1): a
mid-epoch state with carried rows and keep_logits, and the batches that code yields after it.

Run (from a checkout of 7e08153 on PYTHONPATH): python3 make_loader_state_v1.py loader_state_v1.pt
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sbloader

assert sbloader.loader.SelectiveLoader.STATE_VERSION == 1


def build():
    x = torch.arange(90 * 4, dtype=torch.float32).reshape(90, 4) / 100
    y = torch.arange(90) % 3
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    dl = DataLoader(
        TensorDataset(x, y), batch_size=30, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    return sbloader.SelectiveLoader(
        dl, model, policy=sbloader.SelectiveBackprop(0.5), batch_size=8, seed=5, keep_logits=True
    )


loader = build()
list(loader)
it = iter(loader)
next(it)
state = loader.state_dict()
assert state["pending"]["count"] > 0 and state["active"]
rest = [b.indices.tolist() for b in it] + [b.indices.tolist() for b in loader]
torch.save({"state": state, "rest": rest}, sys.argv[1])
print("pending", state["pending"]["count"], "position", state["position"], "rest", len(rest))
