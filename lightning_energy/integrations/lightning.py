"""Energy optimisation for ``lightning.pytorch`` (for ``pytorch_lightning``, see
:mod:`lightning_energy.integrations.pytorch_lightning`).

Add the callback::

    from lightning.pytorch import Trainer
    from lightning_energy.integrations.lightning import EnergyCallback

    trainer = Trainer(callbacks=[EnergyCallback(power_limit={"selector": "cost", "eta": 0.5})])

or pick the strategy by name once this module is imported (``strategy="energy_ddp"``), or
set ``LIGHTNING_ENERGY_CONFIG=energy.yaml`` and change nothing: the
``lightning.pytorch.callbacks_factory`` entry point adds the callback.
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

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


class EnergyCallback(EnergyCallbackCore, Callback):
    """Chooses the GPU power limit that minimises energy for the speed asked for.

    Profiles candidate power limits during the first training steps (pausing during
    validation), applies the one the selector picks, logs ``energy/*`` metrics and a
    summary, saves its profile in checkpoints, and restores every GPU at the end, on
    exceptions and on SIGTERM.

    Args:
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``; None
            reads ``LIGHTNING_ENERGY_CONFIG``, else uses defaults.
        device: the ``device:`` section.
        power_limit: the ``power_limit:`` section (``selector``, ``eta``, ...).
        carbon: the ``carbon:`` section (carbon-aware pacing).
        strict: raise instead of observing when GPU settings cannot be changed.
        report: write the run report (JSON) to this path at the end of ``fit``.

    Raises:
        ConfigError: invalid configuration (before training starts).

    Example:
        >>> cb = EnergyCallback(power_limit={"selector": "max_slowdown", "max_slowdown": 1.05})
        >>> cb.config.power_limit.selector
        'max_slowdown'
    """


class BatchSizeCallback(BatchSizeCallbackCore, Callback):
    """Batch-size optimisation across recurring runs; see
    :class:`~lightning_energy.integrations.batch_size.BatchSizeCallbackCore` for the
    arguments."""


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
    return entry_point_callbacks("lightning.pytorch", EnergyCallback, Trainer)


register_energy_strategies(StrategyRegistry, EnergyDDPStrategy, EnergySingleDeviceStrategy)
