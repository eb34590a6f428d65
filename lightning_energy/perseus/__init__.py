"""Perseus: per-instruction GPU frequency planning for pipeline-parallel training.

Plan offline from a profile::

    from lightning_energy.perseus import PerseusPlanner, PipelineProfile, one_f_one_b

    profile = PipelineProfile.from_csv("profile.csv", blocked_power_w=70.0)
    planner = PerseusPlanner(profile, one_f_one_b(num_stages=4, num_microbatches=8))
    point = planner.plan_no_slowdown()
    point.plan.save("plan.json")

or let the runtime profile online and plan by itself (see ``docs/perseus.md``).

Three parts: :mod:`.planning` (schedules, profiles, the planner, plans; what this package
exports), :mod:`.runtime` (clocks applied around every pipeline instruction, online
profiling) and :mod:`.data_parallel` (the straggler equaliser).
"""

from __future__ import annotations

from lightning_energy.perseus.planning import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    Frontier,
    FrontierPoint,
    Instruction,
    InstructionProfile,
    PerseusPlanner,
    PipelineProfile,
    PipelineSchedule,
    Plan,
    PlanEvaluation,
    build_schedule,
    evaluate,
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
