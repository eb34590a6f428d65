"""Perseus at run time: per-instruction clocks on a running pipeline.

* :mod:`.clock` (:class:`ClockController`): the thread that locks the clocks at instruction
  boundaries, and the ranks' vote on clock control (:func:`agree_on_clock_control`).
* :mod:`.hooks`: what runs around every instruction (:class:`PipelineRuntime`,
  :class:`InstructionMeter`, :class:`PerseusPipelineStage`).
* :mod:`.attribution` (:class:`EnergyTimeline`): a slow energy counter's updates split
  between instructions.
* :mod:`.online` (:class:`OnlinePerseus`): profile online, plan, re-plan.
* :mod:`.pipeline_run` (:class:`RankPipeline`, :class:`PipelineRun`): this rank's Perseus
  over any pipeline engine; :mod:`.rank_gpu` (:class:`RankGPU`): the GPU it drives.
"""

from __future__ import annotations

from lightning_energy.perseus.runtime.attribution import EnergyTimeline, min_profile_s
from lightning_energy.perseus.runtime.clock import (
    ClockController,
    agree_on_clock_control,
)
from lightning_energy.perseus.runtime.hooks import (
    BLOCKED_LABEL,
    ExecutedInstruction,
    InstructionHooks,
    InstructionMeter,
    PerseusPipelineStage,
    PipelineRuntime,
    PipelineWork,
)
from lightning_energy.perseus.runtime.online import OnlinePerseus
from lightning_energy.perseus.runtime.pipeline_run import (
    PipelineModule,
    PipelineRun,
    RankPipeline,
    schedule_from_orders,
)
from lightning_energy.perseus.runtime.rank_gpu import RankGPU, open_rank_gpu

__all__ = [
    "BLOCKED_LABEL",
    "ClockController",
    "EnergyTimeline",
    "ExecutedInstruction",
    "InstructionHooks",
    "InstructionMeter",
    "OnlinePerseus",
    "PerseusPipelineStage",
    "PipelineModule",
    "PipelineRun",
    "PipelineRuntime",
    "PipelineWork",
    "RankGPU",
    "RankPipeline",
    "agree_on_clock_control",
    "min_profile_s",
    "open_rank_gpu",
    "schedule_from_orders",
]
