"""Pipeline-parallel training at per-instruction clocks, one pipeline rank per process.

:class:`RankPipeline` is this rank's Perseus over any pipeline engine: the engine's adapter
calls it around every iteration and every forward and backward, and it applies the planned
clocks and plans: from a plan file, or online
(:class:`~lightning_energy.perseus.runtime.online.OnlinePerseus`). An engine that runs its own
schedule (DeepSpeed, Megatron-Core) describes it with :func:`schedule_from_orders`.

:class:`PipelineRun` builds a ``torch.distributed.pipelining`` schedule (GPipe, 1F1B or
interleaved 1F1B) over the stages a module declares (:class:`PipelineModule`) on a
:class:`RankPipeline`. A framework adapter builds it once the process group exists, calls
:meth:`PipelineRun.step` for each batch and :meth:`PipelineRun.close` at the end.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_energy.controller.knobs import KnobDecision
from lightning_energy.device import StageWork, work_runner
from lightning_energy.errors import ConfigError, DeviceError
from lightning_energy.perseus.planning.plan import Plan
from lightning_energy.perseus.planning.profile import BACKWARD, FORWARD
from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule, build_schedule
from lightning_energy.perseus.runtime.clock import ClockController
from lightning_energy.perseus.runtime.hooks import (
    PerseusPipelineStage,
    PipelineRuntime,
    PipelineWork,
)
from lightning_energy.perseus.runtime.online import OnlinePerseus

if TYPE_CHECKING:
    from lightning_energy.config import PerseusConfig
    from lightning_energy.perseus.runtime.rank_gpu import RankGPU

__all__ = [
    "PipelineModule",
    "PipelinePace",
    "PipelineRun",
    "RankPipeline",
    "checked_stages",
    "pipeline_schedule",
    "schedule_from_orders",
]

log = logging.getLogger(__name__)

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


def schedule_from_orders(
    name: str,
    device_orders: Sequence[Sequence[Instruction]],
    *,
    num_microbatches: int,
) -> PipelineSchedule:
    """A schedule from the per-device instruction orders an engine executes.

    Stage ``s`` runs on device ``s % len(device_orders)`` (the placement of
    ``torch.distributed.pipelining``, Megatron-Core and DeepSpeed, virtual stages too).

    Args:
        name: the schedule's name (plans record it).
        device_orders: for each device (pipeline rank), its forwards and backwards in the
            order the engine runs them.
        num_microbatches: microbatches per iteration.

    Raises:
        ConfigError: every problem found: an instruction missing or repeated, an unknown
            kind, a stage on another device, a backward before its forward, or orders that
            deadlock against the stage dependencies.

    Example:
        >>> from lightning_energy.perseus.planning.schedule import one_f_one_b
        >>> orders = one_f_one_b(2, 3).device_orders
        >>> schedule_from_orders("engine", orders, num_microbatches=3).num_stages
        2
        >>> schedule_from_orders("engine", [orders[0], orders[1][1:]], num_microbatches=3)
        Traceback (most recent call last):
        ...
        lightning_energy.errors.ConfigError: invalid configuration in ...: F1.0 is missing
    """
    devices = len(device_orders)
    if devices < 1 or num_microbatches < 1:
        raise ConfigError(
            f"schedule {name!r}: {devices} devices and {num_microbatches} microbatches; "
            "use >= 1 of each"
        )
    stages = {inst.stage for order in device_orders for inst in order}
    num_stages = max(stages) + 1 if stages else 0
    problems: list[str] = []
    if num_stages % devices:
        problems.append(
            f"{num_stages} stages do not divide evenly over {devices} devices "
            "(stage s runs on device s % devices)"
        )
    counts = Counter(inst for order in device_orders for inst in order)
    for device, order in enumerate(device_orders):
        seen: set[Instruction] = set()
        for inst in order:
            if inst.kind not in (FORWARD, BACKWARD):
                problems.append(f"{inst}: kind {inst.kind!r}; use {FORWARD!r} or {BACKWARD!r}")
            elif not 0 <= inst.microbatch < num_microbatches:
                problems.append(f"{inst}: microbatch out of range 0..{num_microbatches - 1}")
            elif inst.stage % devices != device:
                problems.append(f"{inst} runs on device {device}, not {inst.stage % devices}")
            elif (
                inst.kind == BACKWARD
                and counts[replace(inst, kind=FORWARD)]
                and (replace(inst, kind=FORWARD) not in seen)
            ):
                problems.append(f"{inst} runs before its forward")
            seen.add(inst)
    for stage in range(num_stages):
        for m in range(num_microbatches):
            for kind in (FORWARD, BACKWARD):
                inst = Instruction(stage, m, kind)
                if counts[inst] == 0:
                    problems.append(f"{inst} is missing")
                elif counts[inst] > 1:
                    problems.append(f"{inst} runs {counts[inst]} times")
    if problems:
        raise ConfigError(problems[:8], source=f"schedule {name!r}")
    schedule = PipelineSchedule(
        name,
        num_stages,
        num_microbatches,
        devices,
        tuple(tuple(order) for order in device_orders),
    )
    schedule.topological_order  # noqa: B018  (raises ConfigError on a deadlock)
    return schedule


class RankPipeline:
    """This rank's Perseus over any pipeline engine.

    The engine's adapter calls :meth:`iteration_start`, :meth:`before` and :meth:`after`
    around every forward and backward this rank runs, and :meth:`iteration_end`; clocks
    follow the plan file of the ``perseus:`` section, or the plan of online profiling.
    The first iteration runs at the clocks found: its executed order is checked against
    the schedule (a mismatch, the engine running another schedule than it was described
    by, resets the clocks and switches Perseus off with one warning, strict: a
    ``ConfigError``, since a plan for another order could slow the pipeline down), and
    while its work keeps the GPU busy the guard looks for an administrator's clock lock,
    which NVML shows only under load. Clocks follow the plan from the second iteration.

    Args:
        rank: this rank's GPU and guard.
        section: the ``perseus:`` settings.
        schedule: the pipeline's schedule (the engine's own order).
        global_rank: this rank's device in the schedule.
        device: the device the engine runs this rank's stages on (on a CUDA device,
            clock changes follow its current stream; None: the current CUDA device).
        stage_times_s: simulated GPUs: ``[forward, backward]`` time at the maximum clock
            of one microbatch on each stage (None: 20 ms and 40 ms everywhere).
        strict: raise instead of warning when the executed order is not the schedule's.
        plan_clocks: False: only run (and, on simulated GPUs, simulate) the pipeline and
            leave the clocks alone.
        plan: the clocks to apply (None: the section's plan file, or online planning).

    Raises:
        ConfigError: ``global_rank`` outside the schedule, or a plan file for another
            schedule.
        ProfileError: an unreadable plan file.
    """

    def __init__(
        self,
        rank: RankGPU,
        section: PerseusConfig,
        schedule: PipelineSchedule,
        *,
        global_rank: int,
        device: torch.device | None = None,
        stage_times_s: Sequence[Sequence[float]] | None = None,
        strict: bool = False,
        plan_clocks: bool = True,
        plan: Plan | None = None,
    ) -> None:
        self.rank = rank
        self.schedule = schedule
        self.strict = strict
        gpu = rank.gpu
        work: PipelineWork | None = None
        if (runner := work_runner(gpu)) is not None:
            times = stage_times_s or [[0.02, 0.04]] * schedule.num_stages
            if len(times) != schedule.num_stages:
                raise ConfigError(
                    f"stage_times_s: {len(times)} stages given, the schedule has "
                    f"{schedule.num_stages}"
                )
            works = {
                (s, kind): StageWork(times[s][k], section.compute_bound_share)
                for s in range(schedule.num_stages)
                if schedule.device_of(s) == global_rank
                for k, kind in enumerate((FORWARD, BACKWARD))
            }
            work = runner.pipeline(works, group=rank.group)
        # Work the device layer runs runs in this thread: no stream to follow.
        controller = ClockController(
            rank.guard, gpu=gpu, device=device, wait_for_device=work is None
        )
        self.runtime = PipelineRuntime(schedule, global_rank, controller, work=work, record=False)
        self._expected = schedule.device_orders[global_rank]
        self._executed: list[Instruction] = []
        self._checked = False
        self._planning = plan_clocks
        self._plan_file: Plan | None = None
        self.online: OnlinePerseus | None = None
        if not plan_clocks:
            return
        if plan is None and section.plan is not None:
            plan = Plan.load(section.plan, schedule=schedule)
        if plan is not None:
            self._plan_file = plan
            return
        try:
            supported = gpu.supported_sm_clocks_mhz()
        except DeviceError as exc:  # still votes on clock control (against) with the others
            log.warning("Perseus: %s; clocks not planned.", exc)
            supported = []
        self.online = OnlinePerseus(
            self.runtime,
            gpu,
            supported_clocks_mhz=supported,
            profile_clocks_mhz=section.profile_clocks_mhz,
            warmup_iterations=section.warmup_iterations,
            iterations_per_clock=section.iterations_per_clock,
            target_time_s=section.target_time_s,
            replan_every_iterations=section.replan_every_iterations,
            group=rank.group,
            clock=rank.clock,
        )

    @property
    def active(self) -> bool:
        """Whether clocks follow a plan or profiling (False once switched off)."""
        return self._planning and (self.online is None or self.online.enabled)

    def set_target_time(self, target_s: float | None) -> None:
        """Re-plan for ``target_s`` at the next check (rank 0's value counts)."""
        if self.online is not None:
            self.online.set_target_time(target_s)

    def iteration_start(self) -> None:
        """An iteration starts (before its first instruction)."""
        self._executed.clear()
        if self.online is not None:
            self.online.on_iteration_start()

    def before(self, inst: Instruction) -> None:
        """``inst`` is about to run on this rank: set its clock.

        Raises:
            ConfigError: ``inst`` does not run on this rank in the schedule.
        """
        if not self._checked:
            self._executed.append(inst)
        self.runtime.before(inst)

    def after(self, inst: Instruction) -> None:
        """``inst`` ran on this rank."""
        self.runtime.after(inst)
        if self._planning and not self._checked:
            # The first iteration runs at the clocks found, and its work keeps the GPU
            # busy: the guard looks for an administrator's clock lock (NVML shows one only
            # under load), so that the first lock never replaces one, nor restore resets it.
            self.rank.guard.check_foreign_clocks()

    def iteration_end(self) -> None:
        """An iteration ended (after its last instruction); after the first, the ranks
        agree on the order and on clock control and the clocks follow the plan (or online
        profiling); plans after profiling.

        Raises:
            ConfigError: strict mode, and the executed order is not the schedule's.
        """
        first = self._planning and not self._checked
        if first:
            self._check_order()
        if self.online is not None:
            self.online.on_iteration_end()
        else:
            self.runtime.end_iteration()
        if first and self._planning:
            if self.online is not None:
                self.online.start()
            elif self._plan_file is not None:
                self.runtime.set_plan(self._plan_file)

    def _check_order(self) -> None:
        """Agree (every rank, once) whether each rank ran its schedule's order."""
        self._checked = True
        executed = tuple(self._executed)
        problem = None if executed == self._expected else self._order_problem(executed)
        problems = [problem]
        if dist.is_initialized():
            problems = [None] * dist.get_world_size(self.rank.group)
            dist.all_gather_object(problems, problem, group=self.rank.group)
        found = [p for p in problems if p is not None]
        if not found:
            return
        message = "; ".join(found) + ": the engine's schedule is not the one Perseus planned for"
        if self.strict:
            raise ConfigError(message)
        log.warning("Perseus switched off: %s; GPU clocks reset.", message)
        self._planning = False
        self.runtime.clear_plan()
        self.runtime.measure_with(None)
        if self.online is not None:
            self.online.enabled = False
        self.runtime.controller.reset()

    def _order_problem(self, executed: tuple[Instruction, ...]) -> str:
        first = next(
            (i for i, (a, b) in enumerate(zip(executed, self._expected, strict=False)) if a != b),
            min(len(executed), len(self._expected)),
        )
        ran = str(executed[first]) if first < len(executed) else "nothing"
        planned = str(self._expected[first]) if first < len(self._expected) else "nothing"
        return (
            f"pipeline rank {self.runtime.rank} ran {ran} where the {self.schedule.name!r} "
            f"schedule runs {planned} (position {first})"
        )

    def close(self) -> None:
        """Reset the clocks, then release the GPU when this rank opened it."""
        try:
            self.runtime.close()
        finally:
            self.rank.close()


class PipelineRun:
    """This rank's part of a ``torch.distributed.pipelining`` pipeline under Perseus.

    Args:
        rank: this rank's GPU and guard.
        section: the ``perseus:`` settings (schedule, microbatches, plan, online planning).
        module: the module declaring its stages (:class:`PipelineModule`).
        global_rank: this process's pipeline rank.
        world_size: the number of pipeline ranks.
        root_device: where this rank's stages run (on a GPU, clock changes and
            measurements follow its current stream, and the loss stays there).
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
        self.pipeline = RankPipeline(
            rank,
            section,
            schedule,
            global_rank=global_rank,
            device=root_device,
            stage_times_s=stage_times_s,
        )
        self.rank = rank
        self._device = root_device
        self._last = schedule.device_of(schedule.num_stages - 1)
        local = [s for s in range(schedule.num_stages) if schedule.device_of(s) == global_rank]
        pipeline_stages = [
            PerseusPipelineStage(
                stages[s], s, schedule.num_stages, root_device, runtime=self.pipeline
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

    @property
    def runtime(self) -> PipelineRuntime:
        """This rank's runtime (the pipeline's)."""
        return self.pipeline.runtime

    @property
    def online(self) -> OnlinePerseus | None:
        """Online profiling and planning (None with a plan file)."""
        return self.pipeline.online

    def set_target_time(self, target_s: float | None) -> None:
        """Re-plan for ``target_s`` at the next iteration (rank 0's value counts)."""
        self.pipeline.set_target_time(target_s)

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One pipeline step (every microbatch's forward and backward) at the planned
        clocks; returns the mean microbatch loss (the same on every rank, float32, on this
        rank's device).

        A loss on a GPU stays there: it reaches the other ranks through the trainer's own
        process group (NCCL), so no rank copies it to the CPU or waits for its GPU; a CPU
        loss goes over the gloo group.
        """
        self.pipeline.iteration_start()
        losses: list[torch.Tensor] = []
        step_args = (inputs,) if self._has_first else ()
        step_kwargs: dict[str, Any] = {}
        if self._has_last:
            step_kwargs = {"target": target, "losses": losses}
        self._pipe.step(*step_args, **step_kwargs)
        self.pipeline.iteration_end()
        if losses:
            # float32 everywhere: the other ranks receive into a float32 scalar.
            loss = torch.stack([x.detach() for x in losses]).mean().float()
        else:
            loss = torch.zeros((), device=self._device)
        if dist.is_initialized():
            group = self.rank.group if loss.device.type == "cpu" else None
            dist.broadcast(loss, src=self._last, group=group)
        return loss

    def close(self) -> None:
        """Reset the clocks, then release the GPU when this run opened it."""
        self.pipeline.close()


#: Weight of the newest step in the running mean of the time a step spends outside the
#: pipeline schedule (optimizer, data loading).
_OVERHEAD_WEIGHT = 0.2

#: Iteration times the pace's frontier is sampled at, from no slowdown to the energy optimum.
_PACE_POINTS = 12


class PipelinePace:
    """Perseus' per-instruction clocks as a knob of the job: the planner's time-energy
    frontier, and its target iteration time for the carbon pace.

    A step is one iteration of the pipeline plus the time it spends outside the schedule
    (optimizer step, data loading), measured while the plan runs; the frontier's times
    include it, so the pace's deadline arithmetic counts whole steps.

    Args:
        pipeline: this rank's pipeline (its online planner lives on rank 0).
    """

    name = "perseus_clocks"
    holds_clocks = True

    def __init__(self, pipeline: RankPipeline) -> None:
        self.pipeline = pipeline
        self.overhead_s = 0.0
        self._frontier: list[tuple[float, float, str]] = []
        self._planner: Any = None

    def observe_step(self, duration_s: float) -> None:
        """A step of ``duration_s`` seconds (device clock) ran under the plan in force."""
        plan = self.pipeline.runtime.plan
        if plan is None or not plan.metadata or "iteration_time_s" not in plan.metadata:
            return
        extra = max(duration_s - plan.metadata["iteration_time_s"], 0.0)
        self.overhead_s += _OVERHEAD_WEIGHT * (extra - self.overhead_s)

    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """Rank 0, once planned: ``(step s, step J, label)`` from no slowdown to the
        energy optimum (computed once per planner)."""
        online = self.pipeline.online
        planner = None if online is None or not self.pipeline.active else online.planner
        if planner is None:
            return []
        if planner is not self._planner:
            self._planner = planner
            t_min, t_opt = planner.min_iteration_time_s, planner.energy_optimal_time_s()
            step = max((t_opt - t_min) / _PACE_POINTS, t_min * 1e-3)
            frontier = planner.frontier(time_step_s=step)
            self._frontier = [
                (p.iteration_time_s, p.energy_j, f"plan {p.iteration_time_s * 1e3:.1f} ms")
                for p in frontier
            ]
        return [(t + self.overhead_s, e, label) for t, e, label in self._frontier]

    def apply_pace(self, scale: float) -> KnobDecision:
        """Plan for ``scale`` times the fastest step (rank 0's target counts); the target
        step time (known on rank 0 only: None elsewhere)."""
        online = self.pipeline.online
        if online is None or online.planner is None:
            if online is not None:
                online.set_target_time(None)  # only rank 0's value is broadcast
            return KnobDecision("target_time_s", None, "pace")
        target_step_s = scale * (online.planner.min_iteration_time_s + self.overhead_s)
        online.set_target_time(max(target_step_s - self.overhead_s, 0.0))
        return KnobDecision("target_time_s", target_step_s, "pace")
