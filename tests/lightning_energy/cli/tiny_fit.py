"""An unchanged Lightning training script (run by path by test_profile.py).

It sets no ``max_steps``: ``lightning-energy profile --steps N`` limits it through
``PL_TRAINER_MAX_STEPS``. It prints ``TRAINED <global step>`` at the end of the fit.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset


class Tiny(LightningModule):
    """A linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(512, 8)
    loader = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=8)
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), loader)
    print("TRAINED", trainer.global_step)


if __name__ == "__main__":
    main()
