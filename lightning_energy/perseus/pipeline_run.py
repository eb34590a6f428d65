"""Pipeline-parallel training at per-instruction clocks, one pipeline rank per process.

:class:`PipelineRun` builds a ``torch.distributed.pipelining`` schedule (GPipe, 1F1B or
interleaved 1F1B) over the stages a module declares (:class:`PipelineModule`), wraps this
rank's stages so every forward and backward runs at its planned clock, and plans: from a
plan file, or online (:class:`~lightning_energy.perseus.online.OnlinePerseus`). A framework
adapter builds it once the process group exists, calls :meth:`PipelineRun.step` for each
batch and :meth:`PipelineRun.close` at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_energy.device.simulated import as_simulated
from lightning_energy.errors import ConfigError
from lightning_energy.perseus.online import OnlinePerseus
from lightning_energy.perseus.plan import Plan
from lightning_energy.perseus.runtime import (
    ClockController,
    PerseusPipelineStage,
    PipelineRuntime,
    PipelineSimulation,
    StageWork,
)
from lightning_energy.perseus.schedule import PipelineSchedule, build_schedule

if TYPE_CHECKING:
    from lightning_energy.config import PerseusConfig
    from lightning_energy.perseus.rank_gpu import RankGPU

__all__ = ["PipelineModule", "PipelineRun", "checked_stages", "pipeline_schedule"]

_SCHEDULE_CLASSES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


@runtime_checkable
class PipelineModule(Protocol):
    """What a module declares to be trained pipeline-parallel with Perseus.

    Batches are ``(inputs, target)``; both are split into microbatches along dimension 0.
    The module's ``training_step`` is not called: the pipeline step runs instead.
    """

    def pipeline_stages(self) -> Sequence[torch.nn.Module]:
        """The stages, in pipeline order (one per GPU, times the virtual stages)."""
        ...

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Loss of one microbatch from the last stage's output."""
        ...


def pipeline_schedule(section: PerseusConfig, ranks: int) -> PipelineSchedule:
    """The schedule of ``ranks`` pipeline ranks with the section's settings."""
    return build_schedule(
        section.schedule,
        ranks * section.virtual_stages,
        section.microbatches,
        virtual_stages=section.virtual_stages,
    )


def checked_stages(module: Any, schedule: PipelineSchedule, owner: str) -> list[torch.nn.Module]:
    """The module's stages, checked against the schedule.

    Raises:
        ConfigError: the module declares no stage split, or the wrong number of stages.
    """
    if not isinstance(module, PipelineModule):
        raise ConfigError(
            f"{type(module).__name__} must define pipeline_stages() and pipeline_loss() "
            f"to be trained with {owner}"
        )
    stages = list(module.pipeline_stages())
    if len(stages) != schedule.num_stages:
        raise ConfigError(
            f"pipeline_stages() returned {len(stages)} stages; {schedule.num_devices} ranks x "
            f"{schedule.virtual_stages} virtual stages need {schedule.num_stages}"
        )
    return stages


class PipelineRun:
    """This rank's part of a Perseus pipeline.

    Args:
        rank: this rank's GPU and guard.
        section: the ``perseus:`` settings (schedule, microbatches, plan, online planning).
        module: the module declaring its stages (:class:`PipelineModule`).
        global_rank: this process's pipeline rank.
        world_size: the number of pipeline ranks.
        root_device: where this rank's stages run.
        stage_times_s: simulated GPUs: ``[forward, backward]`` time at the maximum clock
            of one microbatch on each stage (None: 20 ms and 40 ms everywhere).
        owner: the adapter's name, for error messages.

    Raises:
        ConfigError: the module declares no stage split or the wrong number of stages.
    """

    def __init__(
        self,
        rank: RankGPU,
        section: PerseusConfig,
        module: Any,
        *,
        global_rank: int,
        world_size: int,
        root_device: torch.device,
        stage_times_s: Sequence[Sequence[float]] | None = None,
        owner: str = "the Perseus pipeline",
    ) -> None:
        schedule = pipeline_schedule(section, world_size)
        stages = checked_stages(module, schedule, owner)
        self.rank = rank
        gpu = rank.gpu
        simulation = None
        if (simulated := as_simulated(gpu)) is not None:
            times = stage_times_s or [[0.02, 0.04]] * schedule.num_stages
            works = {
                (s, kind): StageWork(times[s][k], section.compute_bound_share)
                for s in range(schedule.num_stages)
                if schedule.device_of(s) == global_rank
                for k, kind in enumerate(("forward", "backward"))
            }
            simulation = PipelineSimulation(simulated, works, group=rank.group)
        self.runtime = PipelineRuntime(
            schedule,
            global_rank,
            ClockController(rank.guard, gpu=gpu),
            simulation=simulation,
            record=False,
        )
        local = [s for s in range(schedule.num_stages) if schedule.device_of(s) == global_rank]
        pipeline_stages = [
            PerseusPipelineStage(
                stages[s], s, schedule.num_stages, root_device, runtime=self.runtime
            )
            for s in local
        ]
        self._has_first = 0 in local
        self._has_last = schedule.num_stages - 1 in local
        self._pipe = _SCHEDULE_CLASSES[section.schedule](
            pipeline_stages if len(pipeline_stages) > 1 else pipeline_stages[0],
            n_microbatches=section.microbatches,
            loss_fn=module.pipeline_loss,
        )
        self.online: OnlinePerseus | None = None
        if section.plan is not None:
            self.runtime.set_plan(Plan.load(section.plan))
            return
        self.online = OnlinePerseus(
            self.runtime,
            gpu,
            supported_clocks_mhz=gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=section.profile_clocks_mhz,
            warmup_iterations=section.warmup_iterations,
            iterations_per_clock=section.iterations_per_clock,
            target_time_s=section.target_time_s,
            replan_every_iterations=section.replan_every_iterations,
            group=rank.group,
            clock=rank.clock,
        )

    def set_target_time(self, target_s: float | None) -> None:
        """Re-plan for ``target_s`` at the next iteration (rank 0's value counts)."""
        if self.online is not None:
            self.online.set_target_time(target_s)

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One pipeline step (every microbatch's forward and backward) at the planned
        clocks; returns the mean microbatch loss (the same on every rank)."""
        if self.online is not None:
            self.online.on_iteration_start()
        losses: list[torch.Tensor] = []
        step_args = (inputs,) if self._has_first else ()
        step_kwargs: dict[str, Any] = {}
        if self._has_last:
            step_kwargs = {"target": target, "losses": losses}
        self._pipe.step(*step_args, **step_kwargs)
        if self.online is not None:
            self.online.on_iteration_end()
        else:
            self.runtime.end_iteration()
        loss = torch.stack(losses).mean().detach().cpu() if losses else torch.zeros(())
        if dist.is_initialized():
            last = self.runtime.schedule.device_of(self.runtime.schedule.num_stages - 1)
            dist.broadcast(loss, src=last, group=self.rank.group)
        return loss

    def close(self) -> None:
        """Reset the clocks, then release the GPU when this run opened it."""
        try:
            self.runtime.close()
        finally:
            self.rank.close()
