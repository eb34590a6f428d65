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

Inside, one concern per module:

* :mod:`.events`: what adapters tell the controller; :mod:`.records`: what they read back
  (:class:`Decision`, :class:`StepResult`, :class:`RunSummary`).
* :mod:`.coordinator` (:class:`EnergyController`): sequences a run. It opens the GPUs,
  takes the lease, hands each event to the knobs, paces, saves and resumes checkpoints and
  restores first at teardown.
* :mod:`.knobs` (:class:`Knob`): what the controller coordinates: every setting it
  changes, behind one protocol. :mod:`.power_limits` (:class:`PowerLimitKnob`) and
  :mod:`.locked_clock` (:class:`LockedClockKnob`) are the built-in ones, the two kinds of
  :mod:`.setting_knob` (:class:`SettingKnob`: one setting for every GPU, profiled,
  chosen and paced; ``power_limit.knob`` says which a job profiles); Perseus' clocks and
  the straggler equaliser's register theirs.
* :mod:`.session` (:class:`ProfilingSession`): a setting knob's profiling windows.
* :mod:`.agreement`: who drives what across ranks, and whether the job optimises;
  :mod:`.job_plan`: what the ranks share for it (:class:`~.job_plan.RankInfo`,
  :func:`~.job_plan.agree`) and the job's totals at the end.
* :mod:`.carbon_pace` (:class:`CarbonPacing`): the grid's pace, applied to the paced
  knob, and pauses.
* :mod:`.ledger` (:class:`RunLedger`) and :mod:`.windows`: every number of a run.
* :mod:`.checkpoint`: the controller's state in a training checkpoint.

docs/adapters.md describes the contract adapters follow; docs/knobs.md how to add a knob.
"""

from lightning_energy.controller.carbon_pace import CarbonPacing
from lightning_energy.controller.coordinator import EnergyController
from lightning_energy.controller.events import (
    CheckpointLoad,
    CheckpointSave,
    End,
    Event,
    Interruption,
    StepEnd,
    StepStart,
)
from lightning_energy.controller.knobs import Knob, KnobDecision
from lightning_energy.controller.ledger import RunLedger
from lightning_energy.controller.locked_clock import LockedClockKnob
from lightning_energy.controller.power_limits import PowerLimitKnob
from lightning_energy.controller.records import Decision, Profile, RunSummary, StepResult
from lightning_energy.controller.session import ProfilingSession
from lightning_energy.controller.setting_knob import SettingKnob

__all__ = [
    "CarbonPacing",
    "CheckpointLoad",
    "CheckpointSave",
    "Decision",
    "End",
    "EnergyController",
    "Event",
    "Interruption",
    "Knob",
    "KnobDecision",
    "LockedClockKnob",
    "PowerLimitKnob",
    "Profile",
    "ProfilingSession",
    "RunLedger",
    "RunSummary",
    "SettingKnob",
    "StepEnd",
    "StepResult",
    "StepStart",
]
