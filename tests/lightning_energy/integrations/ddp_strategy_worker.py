"""A 2-process Lightning DDP fit with ``EnergyDDPStrategy`` (run by test_lightning.py).

``python -m tests.lightning_energy.integrations.ddp_strategy_worker`` with ``ENERGY_CFG``
(the energy configuration as JSON) and ``OUT_DIR`` in the environment. Configuring the
strategy alone attaches the callback; every rank writes the power limit chosen and the
job-wide profile to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as ns
import torch.distributed as dist

from lightning_energy.integrations.lightning import EnergyDDPStrategy
from tests.lightning_energy.integrations._models import make_loader, module_class


def main() -> None:
    out_dir = Path(os.environ["OUT_DIR"])
    strategy = EnergyDDPStrategy(energy=json.loads(os.environ["ENERGY_CFG"]))
    trainer = ns.Trainer(
        max_steps=160,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=out_dir,
    )
    trainer.fit(module_class(ns)(), make_loader())
    callback = strategy.energy_callback
    assert callback in trainer.callbacks  # type: ignore[attr-defined]
    assert callback.controller is not None and callback.summary is not None
    (out_dir / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "power_limit_w": callback.summary.power_limit_w,
                "profile": callback.controller.profile(),
            }
        )
    )


if __name__ == "__main__":
    main()
    # Lightning leaves the process group to the program, which ends it before it exits.
    if dist.is_initialized():
        dist.destroy_process_group()
