"""Perseus for the ``pytorch_lightning`` namespace: two strategies and a callback.

The same classes as :mod:`lightning_energy.integrations.perseus_lightning` (see it for the
arguments), built on ``pytorch_lightning``'s own ``DDPStrategy`` and ``Callback`` (the two
namespaces reject each other's objects) and registered as ``perseus_pipeline`` and
``perseus_ddp`` in its ``StrategyRegistry``. Importing this module does not import
``lightning.pytorch``.
"""

from __future__ import annotations

from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from lightning_energy.integrations._perseus_core import (
    PerseusCallbackCore,
    PerseusDDPCore,
    PerseusPipelineCore,
    PipelineModule,
    register_perseus_strategies,
)

__all__ = ["PerseusCallback", "PerseusDDPStrategy", "PerseusPipelineStrategy", "PipelineModule"]


# The cores are type-checked as ``lightning.pytorch``'s ``DDPStrategy`` and ``Callback``;
# this namespace's classes name its own types, which the checker cannot match.
class PerseusPipelineStrategy(PerseusPipelineCore, DDPStrategy):  # type: ignore[misc]
    """The ``pytorch_lightning`` twin of ``perseus_lightning.PerseusPipelineStrategy``."""


class PerseusDDPStrategy(PerseusDDPCore, DDPStrategy):  # type: ignore[misc]
    """The ``pytorch_lightning`` twin of ``perseus_lightning.PerseusDDPStrategy``."""


class PerseusCallback(PerseusCallbackCore, Callback):  # type: ignore[misc]
    """The ``pytorch_lightning`` twin of ``perseus_lightning.PerseusCallback``."""


register_perseus_strategies(StrategyRegistry, PerseusPipelineStrategy, PerseusDDPStrategy)
