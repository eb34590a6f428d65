"""The energy controller: the one object every framework adapter talks to.

Adapters translate their framework's hooks into typed events and read the answer::

    controller = EnergyController(config)
    controller.setup()                                  # opens GPUs, takes the guard's lease
    for step in training:
        controller.handle(StepStart())
        ...                                             # the user's training step
        result = controller.handle(StepEnd())
        if result.metrics is not None:                  # a logging interval closed
            log_to_the_framework(result.metrics)
    controller.handle(Interruption("validation"))       # validation is left out of windows
    summary = controller.handle(End()).summary          # restores every GPU first
    controller.setup()                                  # another run (a second fit)

Inside, three parts with one concern each:

* :mod:`.session` (:class:`ProfilingSession`): the profiling-window state machine. The
  power-limit optimizer hands out windows (a power limit, steps to settle, steps and
  seconds to measure); the session counts their steps and reports the job-wide numbers.
* :mod:`.ledger` (:class:`RunLedger`, :class:`RunSummary`): logging intervals, energy and
  carbon accounting, decisions, baselines, the summary and the job's totals.
* :mod:`.coordinator` (:class:`EnergyController`): the lifecycle. It opens the GPUs, takes
  the lease, agrees with the other ranks, applies settings through the guard, runs the
  carbon pause loop, saves and resumes checkpoints and restores first at teardown.

With a ``carbon:`` section, rank 0 polls the grid in the background and the pacing policy
turns intensity into a target time per step; the decision is broadcast at fixed step
boundaries and the optimizer re-selects the least-energy limit meeting it, without
profiling again. docs/adapters.md describes the contract adapters follow.
"""

from lightning_energy.controller.coordinator import EnergyController
from lightning_energy.controller.events import (
    CheckpointLoad,
    CheckpointSave,
    Decision,
    End,
    Event,
    Interruption,
    PaceTarget,
    Pause,
    StepEnd,
    StepResult,
    StepStart,
)
from lightning_energy.controller.ledger import RunLedger, RunSummary
from lightning_energy.controller.session import ProfilingSession

__all__ = [
    "CheckpointLoad",
    "CheckpointSave",
    "Decision",
    "End",
    "EnergyController",
    "Event",
    "Interruption",
    "PaceTarget",
    "Pause",
    "ProfilingSession",
    "RunLedger",
    "RunSummary",
    "StepEnd",
    "StepResult",
    "StepStart",
]
