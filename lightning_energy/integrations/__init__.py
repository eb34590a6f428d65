"""Framework adapters: thin translations of a framework's hooks into controller calls.

Each adapter is a module of its own that imports its framework (docs/adapters.md). Its
public classes are exported here too, imported on first use, so ``import
lightning_energy.integrations`` imports no framework, and a framework that is not installed
fails only the name that needs it. The Lightning classes are those of ``lightning.pytorch``;
for the ``pytorch_lightning`` namespace import
:mod:`lightning_energy.integrations.pytorch_lightning` and
:mod:`lightning_energy.integrations.perseus_pytorch_lightning`.

Example::

    from lightning_energy.integrations import EnergyCallback

    trainer = Trainer(callbacks=[EnergyCallback()])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_energy._lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_energy.integrations.accelerate import AcceleratorEnergy, EnergyTracker
    from lightning_energy.integrations.batch_size import BatchSizeCallback
    from lightning_energy.integrations.deepspeed import DeepSpeedEnergy
    from lightning_energy.integrations.fabric import EnergyFabricCallback
    from lightning_energy.integrations.lightning import (
        EnergyCallback,
        EnergyDDPStrategy,
        EnergySingleDeviceStrategy,
    )
    from lightning_energy.integrations.megatron import MegatronEnergy
    from lightning_energy.integrations.perseus_lightning import (
        PerseusCallback,
        PerseusDDPStrategy,
        PerseusPipelineStrategy,
    )
    from lightning_energy.integrations.transformers import EnergyTrainerCallback

__all__ = [
    "AcceleratorEnergy",
    "BatchSizeCallback",
    "DeepSpeedEnergy",
    "EnergyCallback",
    "EnergyDDPStrategy",
    "EnergyFabricCallback",
    "EnergySingleDeviceStrategy",
    "EnergyTracker",
    "EnergyTrainerCallback",
    "MegatronEnergy",
    "PerseusCallback",
    "PerseusDDPStrategy",
    "PerseusPipelineStrategy",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "AcceleratorEnergy": "accelerate",
        "BatchSizeCallback": "batch_size",
        "DeepSpeedEnergy": "deepspeed",
        "EnergyCallback": "lightning",
        "EnergyDDPStrategy": "lightning",
        "EnergyFabricCallback": "fabric",
        "EnergySingleDeviceStrategy": "lightning",
        "EnergyTracker": "accelerate",
        "EnergyTrainerCallback": "transformers",
        "MegatronEnergy": "megatron",
        "PerseusCallback": "perseus_lightning",
        "PerseusDDPStrategy": "perseus_lightning",
        "PerseusPipelineStrategy": "perseus_lightning",
    },
)
