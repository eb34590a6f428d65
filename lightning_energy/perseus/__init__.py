"""Perseus: per-instruction GPU frequency planning for pipeline-parallel training.

Plan offline from a profile::

    from lightning_energy.perseus import PerseusPlanner, PipelineProfile, one_f_one_b

    profile = PipelineProfile.from_csv("profile.csv", blocked_power_w=70.0)
    planner = PerseusPlanner(profile, one_f_one_b(num_stages=4, num_microbatches=8))
    point = planner.plan_no_slowdown()
    point.plan.save("plan.json")

or let the runtime profile online and plan by itself (see :mod:`.runtime` and
``docs/perseus.md``).
"""

from __future__ import annotations

from lightning_energy.perseus.plan import Plan, PlanEvaluation, evaluate
from lightning_energy.perseus.planner import Frontier, FrontierPoint, PerseusPlanner
from lightning_energy.perseus.profile import (
    BACKWARD,
    FORWARD,
    InstructionProfile,
    PipelineProfile,
)
from lightning_energy.perseus.schedule import (
    SCHEDULES,
    Instruction,
    PipelineSchedule,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "SCHEDULES",
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
]
