"""A LightningCLI app trained with the Perseus strategies (run by test_lightning.py).

``python -m tests.lightning_energy.perseus.lightning_fit fit --config cfg.yaml``; every
rank writes what its strategy did to ``$PERSEUS_TEST_OUT/rank<r>.json`` at the end of fit.
``$PERSEUS_TEST_NAMESPACE`` picks the Lightning namespace: ``lightning.pytorch`` (default)
or ``pytorch_lightning``, with the Perseus strategies of that namespace.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_energy.device.simulated import SimulatedGPU
from lightning_energy.integrations._lightning_core import EnergyCallbackCore

from . import nccl_like

NAMESPACE = os.environ.get("PERSEUS_TEST_NAMESPACE", "lightning.pytorch")
pl: Any = importlib.import_module(NAMESPACE)
perseus: Any = importlib.import_module(
    "lightning_energy.integrations.perseus_"
    + ("lightning" if NAMESPACE == "lightning.pytorch" else "pytorch_lightning")
)


class PipelineMLP(pl.LightningModule):
    """An MLP split into ``num_stages`` stages."""

    def __init__(self, num_stages: int = 2, width: int = 16) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
            for _ in range(num_stages)
        )

    def pipeline_stages(self) -> list[torch.nn.Module]:
        return list(self.stages)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class RandomData(pl.LightningDataModule):
    def __init__(self, width: int = 16, size: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(size, width, generator=generator)
        self.dataset = TensorDataset(x, torch.tanh(x.flip(1)))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.dataset, batch_size=self.batch_size)


class Report(pl.Callback):
    """Records losses, clocks and the strategy's state; writes them at the end of fit."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.clocks: list[Any] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        gpu = trainer.strategy.gpu
        self.clocks.append(gpu.locked_clocks_mhz())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        out: dict[str, Any] = {
            "losses": self.losses,
            "clocks": self.clocks,
            "trainer": type(trainer).__module__,
        }
        if isinstance(strategy, perseus.PerseusPipelineStrategy):
            assert strategy.online is not None and strategy.runtime is not None
            out["phase"] = strategy.online.phase
            out["plan"] = strategy.runtime.plan.to_dict() if strategy.runtime.plan else None
        if isinstance(strategy, perseus.PerseusDDPStrategy):
            assert strategy.equalizer is not None
            out["straggler"] = strategy.equalizer.straggler_rank
        energy = next((c for c in trainer.callbacks if isinstance(c, EnergyCallbackCore)), None)
        if energy is not None:
            # One opening, one guard: the strategy drives the energy callback's GPU.
            controller = energy.controller
            assert controller is not None
            out["shared"] = (
                strategy.gpu is controller.devices.gpus[0]
                and strategy._run.rank.guard is controller.guard
            )
        self.gpu = strategy.gpu
        self.out = out

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        gpu = getattr(self, "gpu", None)
        if isinstance(gpu, SimulatedGPU):
            self.out["clock_after"] = gpu.locked_clocks_mhz()
        directory = Path(os.environ["PERSEUS_TEST_OUT"])
        (directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.out))


def main() -> None:
    nccl_like.install()
    importlib.import_module(f"{NAMESPACE}.cli").LightningCLI(
        PipelineMLP,
        RandomData,
        trainer_defaults={"callbacks": [Report()]},
        save_config_callback=None,
    )
    # Shut gloo down before the interpreter exits: tearing down its threads at exit while
    # the other rank is closing its connections can abort the process.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
