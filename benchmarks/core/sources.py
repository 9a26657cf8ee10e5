"""The same examples as a DataLoader and as an FFCV source (``breakdown.py``, ``throughput.py``)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sbloader.datasets import ArrayDataset

from .data import shuffled


class Sources:
    """The same examples as a DataLoader and as an FFCV loader (a .beton in a temporary folder)."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        device: torch.device | str,
        ffcv: bool,
        ffcv_workers: int = 1,
        array_collate: bool = False,
    ) -> None:
        self.x, self.y, self.ffcv_workers = x, y, ffcv_workers
        self.array_collate = array_collate
        # NOTE: on a GPU the examples live on the device (num_workers=0), as a GPU user would
        # keep a dataset of this size.
        self.dataset = ArrayDataset(x.to(device), y.to(device))
        self._tmp = tempfile.TemporaryDirectory(prefix="sbloader-breakdown-")
        self.beton: Path | None = None
        self.write_s: float | None = None
        if ffcv:
            import sbloader.ffcv as sbffcv

            t0 = time.perf_counter()
            # NOTE: the same normalised float32 tensors as the DataLoader's, so that both
            # sources feed the model identical inputs (60,000 images: 188 MB).
            self.beton = sbffcv.write_beton(
                Path(self._tmp.name) / "fashion_mnist.beton", (x.numpy(), y.numpy())
            )
            self.write_s = time.perf_counter() - t0

    def kinds(self) -> list[str]:
        return ["dataloader"] + (["ffcv"] if self.beton is not None else [])

    def make(self, kind: str, batch_size: int, seed: int) -> Any:
        if kind == "dataloader":
            return shuffled(self.dataset, batch_size, seed, self.array_collate)
        import sbloader.ffcv as sbffcv

        assert self.beton is not None
        return sbffcv.open_beton(
            self.beton,
            batch_size,
            order="random",
            seed=seed,
            num_workers=self.ffcv_workers,
        )

    def close(self) -> None:
        self._tmp.cleanup()
