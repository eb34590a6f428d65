"""A 2-process Lightning DDP fit with ``BatchSizeCallback`` (run by
test_batch_size_callback.py).

``python -m tests.lightning_energy.integrations.ddp_batch_size_worker`` with
``ENERGY_CFG`` (the energy configuration as JSON), ``STORE_URL``, ``DEFAULT_BS`` and
``OUT_DIR`` in the environment. Every rank writes how often it opened the tuning store,
the batch size chosen, the loader's batch size and the epochs run to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as ns
import torch.distributed as dist

from lightning_energy.integrations.lightning import BatchSizeCallback, EnergyCallback
from lightning_energy.store import Store
from tests.lightning_energy.integrations.test_batch_size_callback import _classes


def main() -> None:
    out_dir = Path(os.environ["OUT_DIR"])
    opened: list[tuple[Any, ...]] = []
    real_open = Store.open

    def spy(*args: Any, **kwargs: Any) -> Any:
        opened.append(args)
        return real_open(*args, **kwargs)

    Store.open = spy  # type: ignore[method-assign]
    energy_cb = EnergyCallback(json.loads(os.environ["ENERGY_CFG"]))
    batch_cb = BatchSizeCallback(
        "toy-ddp",
        monitor="val_score",
        target=1.0,
        batch_sizes=[8, 16, 32],
        default_batch_size=int(os.environ["DEFAULT_BS"]),
        store=os.environ["STORE_URL"],
    )
    callbacks: list[Any] = [energy_cb, batch_cb]
    data_cls, model_cls = _classes(ns)
    model = model_cls()
    trainer = ns.Trainer(
        max_epochs=6,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=out_dir,
    )
    trainer.fit(model, datamodule=data_cls())
    (out_dir / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "opened": len(opened),
                "batch_size": batch_cb.batch_size,
                "loader": model.loader_batch_size,
                "epochs": trainer.current_epoch,
            }
        )
    )


if __name__ == "__main__":
    main()
    # Lightning leaves the process group to the program, which ends it before it exits.
    if dist.is_initialized():
        dist.destroy_process_group()
