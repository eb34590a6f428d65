"""Perseus' offline half: schedules, profiles, the solver and planner, and plans.

* :mod:`.schedule`: pipeline schedules as DAGs of instructions (:class:`PipelineSchedule`).
* :mod:`.profile`: time and energy of every instruction at every clock
  (:class:`PipelineProfile`).
* :mod:`.solver` and :mod:`.planner` (:class:`PerseusPlanner`): the time-energy frontier.
* :mod:`.plan` (:class:`Plan`): a clock for every instruction, and what it costs.
"""

from __future__ import annotations

from lightning_energy.perseus.planning.plan import PLAN_FORMAT, Plan, PlanEvaluation, evaluate
from lightning_energy.perseus.planning.planner import Frontier, FrontierPoint, PerseusPlanner
from lightning_energy.perseus.planning.profile import (
    BACKWARD,
    FORWARD,
    BlockedPower,
    InstructionProfile,
    PipelineProfile,
)
from lightning_energy.perseus.planning.schedule import (
    SCHEDULES,
    Instruction,
    PipelineSchedule,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule_to_json,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "PLAN_FORMAT",
    "SCHEDULES",
    "BlockedPower",
    "Frontier",
    "FrontierPoint",
    "Instruction",
    "InstructionProfile",
    "PerseusPlanner",
    "PipelineProfile",
    "PipelineSchedule",
    "Plan",
    "PlanEvaluation",
    "build_schedule",
    "evaluate",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule_to_json",
]
