"""Energy optimisation for the ``pytorch_lightning`` namespace.

The same classes as :mod:`lightning_energy.integrations.lightning`, built on
``pytorch_lightning``'s own ``Callback`` and strategies (the two namespaces reject each
other's objects). Importing this module does not import ``lightning.pytorch``.
"""

from __future__ import annotations

from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

from lightning_energy.integrations._entry_point import entry_point_callbacks
from lightning_energy.integrations._lightning_core import (
    EnergyCallbackCore,
    EnergySingleDeviceCore,
    EnergyStrategyCore,
    KareusDDPCore,
    register_energy_strategies,
)
from lightning_energy.integrations.batch_size import BatchSizeCallbackCore

__all__ = [
    "BatchSizeCallback",
    "EnergyCallback",
    "EnergyDDPStrategy",
    "EnergySingleDeviceStrategy",
    "callbacks_factory",
]


# The core's hooks are type-checked against ``lightning.pytorch``'s ``Callback``; this
# namespace's ``Callback`` names its own ``Trainer`` type, which the checker cannot match.
class EnergyCallback(EnergyCallbackCore, Callback):  # type: ignore[misc]
    """The ``pytorch_lightning`` twin of ``integrations.lightning.EnergyCallback``."""


class BatchSizeCallback(BatchSizeCallbackCore, Callback):  # type: ignore[misc]
    """The ``pytorch_lightning`` twin of ``integrations.lightning.BatchSizeCallback``."""


class EnergyDDPStrategy(KareusDDPCore, EnergyStrategyCore, DDPStrategy):
    """``DDPStrategy`` with the energy callback attached (``strategy="energy_ddp"``) and,
    given ``data_parallel=``, a Kareus data-parallel setting applied to DDP."""

    callback_class = EnergyCallback


class EnergySingleDeviceStrategy(EnergySingleDeviceCore, SingleDeviceStrategy):
    """``SingleDeviceStrategy`` with the energy callback (``strategy="energy_single_device"``),
    on the device the ``Trainer`` chose (see :class:`._lightning_core.EnergySingleDeviceCore`)."""

    callback_class = EnergyCallback


def callbacks_factory() -> list[Callback]:
    """Entry point: when ``LIGHTNING_ENERGY_CONFIG`` is set, the energy callback and what
    the file enables (Perseus, batch size), each unless the Trainer has one already; put
    into the Trainer's own list, never the user's (see :mod:`._entry_point`)."""
    return entry_point_callbacks("pytorch_lightning", EnergyCallback, Trainer)


register_energy_strategies(StrategyRegistry, EnergyDDPStrategy, EnergySingleDeviceStrategy)
