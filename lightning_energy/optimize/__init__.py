"""Pure decision logic: measurements in, settings out.

* :class:`PowerLimitOptimizer` profiles power limits in :class:`Window` s and picks one with
  a :class:`Selector` (:func:`make_selector` builds one from its configuration name);
* the batch-size decisions of recurring jobs (:func:`pruning_state`,
  :func:`thompson_choice`, :func:`best_choice`) over the job's stored trials, applied to a
  job's history in the tuning store by :mod:`.recurring`
  (:class:`~lightning_energy.optimize.recurring.BatchSizeOptimizer`, and
  :class:`~lightning_energy.optimize.recurring.RecurringRun` for one run of the job: the
  only module here that does I/O, through the store);
* :func:`zeus_cost`, the energy-time cost both of them minimise.

The batch-size names are imported on first use: their module reads the tuning history's
records, which need SQLAlchemy.

Example:
    >>> profile = [
    ...     Measurement(300.0, time_per_step_s=0.10, energy_per_step_j=25.0, steps=40),
    ...     Measurement(250.0, time_per_step_s=0.11, energy_per_step_j=22.0, steps=40),
    ... ]
    >>> selector = make_selector("energy")
    >>> selector.select(profile, max_power_limit_w=300.0, num_gpus=1).power_limit_w
    250.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_energy._lazy import lazy_exports
from lightning_energy.optimize.cost import zeus_cost
from lightning_energy.optimize.power_limit import PowerLimitOptimizer, Window
from lightning_energy.optimize.selectors import (
    CostSelector,
    EnergySelector,
    MaxSlowdownSelector,
    Measurement,
    Selector,
    TargetTimeSelector,
    TimeSelector,
    make_selector,
    select_across,
)

if TYPE_CHECKING:
    from lightning_energy.optimize.batch_size import (
        BestChoice,
        JobSpec,
        Observation,
        PruningState,
        Trial,
        best_choice,
        pruning_state,
        thompson_choice,
    )

__all__ = [
    "BestChoice",
    "CostSelector",
    "EnergySelector",
    "JobSpec",
    "MaxSlowdownSelector",
    "Measurement",
    "Observation",
    "PowerLimitOptimizer",
    "PruningState",
    "Selector",
    "TargetTimeSelector",
    "TimeSelector",
    "Trial",
    "Window",
    "best_choice",
    "make_selector",
    "pruning_state",
    "select_across",
    "thompson_choice",
    "zeus_cost",
]

_BATCH_SIZE_NAMES = (
    "BestChoice",
    "JobSpec",
    "Observation",
    "PruningState",
    "Trial",
    "best_choice",
    "pruning_state",
    "thompson_choice",
)
__getattr__ = lazy_exports(__name__, dict.fromkeys(_BATCH_SIZE_NAMES, "batch_size"))
