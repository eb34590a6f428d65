"""A plain DDP training script that names no Perseus class (run by test_config_switch.py).

``python -m tests.lightning_energy.perseus.config_fit``: two CPU processes (gloo) train a
small MLP with ``strategy="ddp"``. Perseus comes only from the file named by
``LIGHTNING_ENERGY_CONFIG``, through the Lightning entry point. Every rank writes what the
Perseus and energy callbacks did to ``$PERSEUS_TEST_OUT/rank<r>.json``; the GPUs' settings
after the job are in the ``device.state_dir`` of the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_energy.integrations.lightning import EnergyCallback
from lightning_energy.integrations.perseus_lightning import PerseusCallback

from . import nccl_like
from .lightning_fit import PipelineMLP, RandomData


class Report(pl.Callback):
    """Records the clock locked after each step, and what the two callbacks share."""

    def __init__(self) -> None:
        self.clocks: list[Any] = []
        self.out: dict[str, Any] = {}

    def _ours(self, trainer: Any) -> tuple[Any, Any]:
        perseus = next(c for c in trainer.callbacks if isinstance(c, PerseusCallback))
        energy = next(c for c in trainer.callbacks if isinstance(c, EnergyCallback))
        return perseus, energy

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        perseus, _ = self._ours(trainer)
        self.clocks.append(perseus.run.rank.gpu.locked_clocks_mhz())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        perseus, energy = self._ours(trainer)
        run, controller = perseus.run, energy.controller
        self.out = {
            "clocks": self.clocks,
            "straggler": run.equalizer.straggler_rank,
            "same_gpu": run.rank.gpu is controller.devices.gpus[0],
            "same_guard": run.rank.guard is controller.guard,
            "owned": run.rank.owned,
            "power_limit_decisions": [
                d["purpose"] for d in controller.decisions if d["kind"] == "power_limit"
            ],
            "profiling_off": controller.power_limit.profiling_off,
            # The Perseus callback takes part in the energy callback's run.
            "joined": perseus.running and perseus.controller is controller,
            "checkpoint_entry": perseus.state_dict(),
        }

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        directory = Path(os.environ["PERSEUS_TEST_OUT"])
        (directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.out))


def main() -> None:
    nccl_like.install()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        # Each of 3 profiled clocks: a landing step, then 200 counter periods (20 s) of
        # ~2 s steps; then equalised windows of 4 steps.
        max_steps=48,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Report()],
    )
    trainer.fit(PipelineMLP(), datamodule=RandomData())
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
