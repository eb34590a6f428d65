"""What a configuration file switches on by itself in a Lightning ``Trainer``.

The ``callbacks_factory`` entry points of both Lightning namespaces read the file named by
``LIGHTNING_ENERGY_CONFIG`` and add the energy callback, then what the file's sections
enable: ``perseus: {enabled: true}`` adds the Perseus callback (the straggler equaliser
for DDP; for a pipeline it checks that the strategy is ``perseus_pipeline``), and
``batch_size: {enabled: true}`` adds the batch-size callback. The training script is
unchanged.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_energy.config import EnergyConfig

__all__ = ["configured_callbacks"]

_PERSEUS_MODULES = {
    "lightning.pytorch": "lightning_energy.integrations.perseus_lightning",
    "pytorch_lightning": "lightning_energy.integrations.perseus_pytorch_lightning",
}


def configured_callbacks(config: EnergyConfig, namespace: str) -> list[Any]:
    """The callbacks ``config`` enables next to the energy callback.

    Args:
        config: the energy configuration.
        namespace: ``"lightning.pytorch"`` or ``"pytorch_lightning"``.

    Returns:
        The Perseus and batch-size callbacks of ``namespace`` the sections enable.
    """
    callbacks: list[Any] = []
    if config.perseus.enabled:
        module = importlib.import_module(_PERSEUS_MODULES[namespace])
        callbacks.append(module.PerseusCallback(config))
    if config.batch_size.enabled:
        from lightning_energy.integrations.batch_size import batch_size_callback_class

        callbacks.append(batch_size_callback_class(namespace)(config=config))
    return callbacks
