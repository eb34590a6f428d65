"""A 2-process Lightning DDP fit paced by a carbon trace (run by test_carbon_pacing.py).

``python -m tests.lightning_energy.integrations.ddp_carbon_worker`` with ``ENERGY_CFG``
(the energy configuration as JSON), ``STEPS`` and ``OUT_DIR`` in the environment. Every
rank writes its decisions, target-time scales and carbon summary to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as ns
import torch.distributed as dist

from lightning_energy.integrations.lightning import EnergyCallback
from tests.lightning_energy.integrations._models import make_loader, module_class


def main() -> None:
    out_dir = Path(os.environ["OUT_DIR"])
    callback = EnergyCallback(json.loads(os.environ["ENERGY_CFG"]))
    trainer = ns.Trainer(
        max_steps=int(os.environ["STEPS"]),
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=out_dir,
    )
    trainer.fit(module_class(ns)(), make_loader(n=4096))
    assert callback.controller is not None and callback.summary is not None
    assert callback.summary.carbon is not None
    decisions = [(d["step"], d["value"]) for d in callback.controller.decisions]
    scales = [e.get("scale") for e in callback.controller.timeline]
    carbon = {k: v for k, v in callback.summary.carbon.items() if k != "baselines"}
    (out_dir / f"rank{trainer.global_rank}.json").write_text(
        json.dumps({"decisions": decisions, "scales": scales, "carbon": carbon})
    )


if __name__ == "__main__":
    main()
    # Lightning leaves the process group to the program, which ends it before it exits.
    if dist.is_initialized():
        dist.destroy_process_group()
