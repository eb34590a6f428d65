"""A tiny real LightningModule and data for integration tests (both namespaces)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def make_loader(n: int = 256, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Synthetic binary classification data."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x.sum(dim=1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def module_class(namespace: Any) -> type:
    """A small MLP classifier as a LightningModule of the given namespace."""

    class TinyClassifier(namespace.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, fail_at_step: int | None = None) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
            )
            self.fail_at_step = fail_at_step

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.fail_at_step is not None and self.global_step >= self.fail_at_step:
                raise RuntimeError("boom in training_step")
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return TinyClassifier
