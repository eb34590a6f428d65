"""The model and data the Lightning examples train: an MLP on synthetic classification data.

Shared by ``train.py`` (LightningCLI) and ``callback.py`` (plain Python). Nothing here knows
about energy: the examples add lightning-energy from the outside.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, TensorDataset


class Classifier(LightningModule):
    """A two-layer MLP classifier.

    Args:
        features: input features.
        classes: output classes.
        hidden: hidden units.
        lr: SGD learning rate.
    """

    def __init__(self, features: int = 32, classes: int = 4, hidden: int = 64, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


class BlobData(LightningDataModule):
    """Gaussian blobs, one per class.

    Args:
        samples: training samples (validation gets a quarter as many).
        features: input features.
        classes: classes.
        batch_size: batch size.
        seed: seeds the data.
    """

    def __init__(
        self,
        samples: int = 8192,
        features: int = 32,
        classes: int = 4,
        batch_size: int = 64,
        seed: int = 0,
    ):
        super().__init__()
        self.samples, self.features, self.classes = samples, features, classes
        self.batch_size, self.seed = batch_size, seed

    def _loader(self, n: int, offset: int, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        centers = torch.randn(self.classes, self.features, generator=generator) * 0.3
        generator.manual_seed(self.seed + offset)
        labels = torch.randint(0, self.classes, (n,), generator=generator)
        x = centers[labels] + torch.randn(n, self.features, generator=generator)
        return DataLoader(TensorDataset(x, labels), batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.samples, 1, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.samples // 4, 2, shuffle=False)
