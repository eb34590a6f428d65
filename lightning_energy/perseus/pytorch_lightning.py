"""Perseus for the ``pytorch_lightning`` namespace: two strategies.

The same classes as :mod:`lightning_energy.perseus.lightning` (see it for the arguments),
built on ``pytorch_lightning``'s own ``DDPStrategy`` (the two namespaces reject each
other's objects) and registered as ``perseus_pipeline`` and ``perseus_ddp`` in its
``StrategyRegistry``. Importing this module does not import ``lightning.pytorch``.
"""

from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from lightning_energy.perseus._strategy_core import (
    PerseusDDPCore,
    PerseusPipelineCore,
    PipelineModule,
    register_perseus_strategies,
)

__all__ = ["PerseusDDPStrategy", "PerseusPipelineStrategy", "PipelineModule"]


class PerseusPipelineStrategy(PerseusPipelineCore, DDPStrategy):
    """The ``pytorch_lightning`` twin of ``perseus.lightning.PerseusPipelineStrategy``."""


class PerseusDDPStrategy(PerseusDDPCore, DDPStrategy):
    """The ``pytorch_lightning`` twin of ``perseus.lightning.PerseusDDPStrategy``."""


register_perseus_strategies(StrategyRegistry, PerseusPipelineStrategy, PerseusDDPStrategy)
