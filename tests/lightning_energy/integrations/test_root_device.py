"""The Lightning adapter hands the controller the strategy's root device (the GPU the
framework trains on), not only the local rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_energy.controller import EnergyController
from lightning_energy.integrations import _lightning_core
from lightning_energy.integrations.lightning import EnergyCallback
from tests.lightning_energy.integrations._models import make_loader, module_class


def test_lightning_passes_the_strategy_root_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    class Recording(EnergyController):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(kwargs.get("device"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_lightning_core, "EnergyController", Recording)
    config = {"device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")}}
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        callbacks=[EnergyCallback(config)],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(module_class(pl)(), make_loader())
    assert seen == [trainer.strategy.root_device] == [torch.device("cpu")]
