"""Apply a frequency plan in ``torch.distributed.pipelining``: the hooks around every
instruction.

* :class:`PipelineRuntime`: one per pipeline rank. Before each forward/backward of each
  microbatch it asks the :class:`~lightning_energy.perseus.runtime.clock.ClockController`
  for the planned clock; it records what ran, measures instructions while profiling
  (:class:`InstructionMeter`: CUDA events on the stage's stream time them), and resets the
  clocks at the end and on failure (also the guard's job on exit and SIGTERM). Where the
  device layer runs the GPU work itself (a simulated GPU:
  :func:`~lightning_energy.device.work_runner`), each instruction's GPU time and energy
  come from that work, and the ranks' clocks follow the pipeline dependencies.
* :class:`PerseusPipelineStage`: a ``PipelineStage`` that calls the runtime around every
  ``forward_one_chunk`` / ``backward_one_chunk``. It works with every schedule of
  ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B...).

Example (one rank, inside an initialised process group)::

    guard = GPUGuard([gpu])
    controller = ClockController(guard, gpu=gpu, device=device)  # this rank's, e.g. cuda:1
    with PipelineRuntime(schedule, rank, controller, plan=plan) as runtime:
        stage = PerseusPipelineStage(module, rank, num_stages, device, runtime=runtime)
        pipeline = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
        for batch in data:
            pipeline.step(batch)
            runtime.end_iteration()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import torch
from torch.distributed.pipelining import PipelineStage

from lightning_energy.device.base import GPU
from lightning_energy.device.cuda_events import CudaStream, TimedPoint
from lightning_energy.errors import ConfigError, EnergyError
from lightning_energy.perseus.planning.plan import Plan
from lightning_energy.perseus.planning.profile import BACKWARD, FORWARD
from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule
from lightning_energy.perseus.runtime.attribution import EnergyTimeline
from lightning_energy.perseus.runtime.clock import ClockController

__all__ = [
    "BLOCKED_LABEL",
    "ExecutedInstruction",
    "InstructionHooks",
    "InstructionMeter",
    "PerseusPipelineStage",
    "PipelineRuntime",
    "PipelineWork",
]

log = logging.getLogger(__name__)

#: Timeline label of the time a pipeline rank waits between its instructions.
BLOCKED_LABEL = "blocked"


class PipelineWork(Protocol):
    """The GPU work of this rank's instructions when the device layer runs it in this
    thread (see :func:`~lightning_energy.device.work_runner`), with the pipeline's
    cross-rank timing."""

    def wait_for_input(self, schedule: PipelineSchedule, rank: int, inst: Instruction) -> None:
        """Wait until the input of ``inst`` was produced."""
        ...

    def run(self, inst: Instruction) -> tuple[float, float]:
        """Run the work of ``inst`` at the locked clock: ``(time_s, energy_j)``."""
        ...

    def publish(self, schedule: PipelineSchedule, rank: int, inst: Instruction) -> None:
        """Tell the consumer of ``inst``'s output when it was produced."""
        ...

    def locked_mhz(self) -> int | None:
        """The clock the GPU is locked to (None: not locked)."""
        ...

    def end_iteration(self) -> tuple[float, float]:
        """Align every rank on the slowest: ``(iteration_time_s, energy_j of this GPU)``."""
        ...


@dataclass(frozen=True)
class ExecutedInstruction:
    """One instruction as it ran on this rank.

    Attributes:
        instruction: what ran.
        freq_mhz: the clock locked while it ran (None: unchanged).
        time_s: its GPU time, when measured (simulated, or while profiling).
        energy_j: how far the energy counter moved over it, when measured (on a counter
            that moves every ~100 ms, mostly 0 J; see
            :class:`~lightning_energy.perseus.runtime.attribution.EnergyTimeline`).
    """

    instruction: Instruction
    freq_mhz: int | None
    time_s: float | None = None
    energy_j: float | None = None


class PipelineRuntime:
    """Applies a plan on one pipeline rank and records what ran.

    Args:
        schedule: the pipeline schedule the stages run.
        rank: this rank's position in the pipeline (its device in the schedule).
        controller: applies the clocks.
        plan: the plan to apply (None: leave the clock alone until one is set).
        work: the GPU work the device layer runs itself, with its cross-rank timing
            (:func:`~lightning_energy.device.work_runner`: simulated GPUs only; None: the
            framework's kernels are the work).
        record: keep every executed instruction in :attr:`trace`.

    Raises:
        ConfigError: the plan is for another schedule, or ``rank`` is out of range.
    """

    def __init__(
        self,
        schedule: PipelineSchedule,
        rank: int,
        controller: ClockController,
        *,
        plan: Plan | None = None,
        work: PipelineWork | None = None,
        record: bool = True,
    ) -> None:
        if not 0 <= rank < schedule.num_devices:
            raise ConfigError(f"rank={rank}: the schedule has {schedule.num_devices} devices")
        self.schedule = schedule
        self.rank = rank
        self.controller = controller
        self.work = work
        self.record = record
        self.trace: list[ExecutedInstruction] = []
        self._plan: Plan | None = None
        self._fixed_mhz: int | None = None
        self._meter: InstructionMeter | None = None
        self._closed = False
        self._order = set(schedule.device_orders[rank])
        if plan is not None:
            self.set_plan(plan)

    @property
    def stream(self) -> CudaStream | None:
        """The CUDA stream this rank's instructions are queued on (None: no stream: on the
        CPU, or simulated GPUs, whose work runs in this thread)."""
        return None if self.work is not None else self.controller.stream

    # ----------------------------------------------------------------- plans
    @property
    def plan(self) -> Plan | None:
        """The plan in force (None while profiling or before one is set)."""
        return self._plan

    def set_plan(self, plan: Plan) -> None:
        """Apply ``plan`` from the next instruction on.

        Raises:
            ConfigError: the plan is for another schedule.
        """
        if plan.schedule.device_orders != self.schedule.device_orders:
            raise ConfigError(
                f"the plan is for {plan.schedule.name} with {plan.schedule.num_stages} stages "
                f"and {plan.schedule.num_microbatches} microbatches, the pipeline runs "
                f"{self.schedule.name} with {self.schedule.num_stages} and "
                f"{self.schedule.num_microbatches}"
            )
        self._plan = plan
        self._fixed_mhz = None

    def clear_plan(self) -> None:
        """Leave the clocks alone from the next instruction on (no plan, no fixed clock)."""
        self._plan = None
        self._fixed_mhz = None

    def set_fixed_clock(self, freq_mhz: int | None) -> None:
        """Run every instruction at ``freq_mhz`` (profiling); None: back to the plan."""
        self._fixed_mhz = freq_mhz

    def measure_with(self, meter: InstructionMeter | None) -> None:
        """Measure every instruction with ``meter`` (None: stop measuring)."""
        self._meter = meter

    def planned_mhz(self, inst: Instruction) -> int | None:
        """The clock ``inst`` runs at: the fixed profiling clock, else the plan's."""
        if self._fixed_mhz is not None:
            return self._fixed_mhz
        if self._plan is not None:
            return self._plan.frequency_mhz(inst)
        return None

    # ------------------------------------------------------------------ hooks
    def before(self, inst: Instruction) -> None:
        """Called just before ``inst`` runs on this rank.

        Raises:
            ConfigError: ``inst`` does not run on this rank in the schedule.
        """
        if inst not in self._order:
            raise ConfigError(f"{inst} does not run on pipeline rank {self.rank}")
        freq = self.planned_mhz(inst)
        if freq is not None:
            self.controller.request(freq)
        if self.work is not None or self._meter is not None:
            # The simulated GPU runs "on the stream" in this thread: the clock change and
            # the input must be there before its work starts; a measured instruction
            # starts at the clock it is attributed to.
            self.controller.flush()
        if self.work is not None:
            self.work.wait_for_input(self.schedule, self.rank, inst)
        if self._meter is not None:
            self._meter.start(inst)

    def after(self, inst: Instruction) -> None:
        """Called just after ``inst`` ran on this rank."""
        time_s: float | None = None
        energy_j: float | None = None
        if self.work is not None:
            time_s, energy_j = self.work.run(inst)
            self.work.publish(self.schedule, self.rank, inst)
        if self._meter is not None:
            measured = self._meter.stop(inst)
            if self.work is None:
                time_s, energy_j = measured
        if self.record:
            # The clock the GPU running the work was locked to while it ran; else the
            # clock read back, not the plan's.
            freq = self.controller.current_mhz if self.work is None else self.work.locked_mhz()
            self.trace.append(ExecutedInstruction(inst, freq, time_s, energy_j))

    def end_iteration(self) -> tuple[float, float] | None:
        """Close an iteration. Simulated: align the ranks and return this rank's
        ``(iteration_time_s, cumulative energy_j)``; real GPUs: None."""
        if self.work is not None:
            return self.work.end_iteration()
        return None

    # --------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Reset the clocks to their pre-job state and stop the controller (idempotent);
        never waits for the GPU."""
        if self._closed:
            return
        self._closed = True
        try:
            self.controller.reset()
        finally:
            self.controller.stop()

    def __enter__(self) -> PipelineRuntime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except EnergyError:
            if exc is None:
                raise
            log.exception("Resetting the GPU clocks after a failure failed")


class InstructionMeter:
    """Marks the energy counter at the start and end of every measured instruction
    (waiting for the GPU, so only while profiling), for an
    :class:`~lightning_energy.perseus.runtime.attribution.EnergyTimeline` to split the counter's
    updates between instructions and the waits between them.

    The counter is for energy only. On CUDA, times are those at which the GPU reached CUDA
    events on the stage device's current stream (the stream the instructions' kernels are
    queued on): an instruction's time is the GPU's time between the event before its
    kernels and the event after them, and the counter reads (0.1 to several ms each) fall
    between instructions, never inside one. At a start (and at every :meth:`mark`) the
    counter is read before the event is recorded; at an end, as soon as the GPU reaches
    the instruction's end event. Without a stream (the CPU, simulated GPUs) the counter is
    read, then ``clock``.

    Args:
        gpu: the GPU whose energy counter to read.
        timeline: where the marks go.
        label: the timeline label of an instruction (e.g. its stage, kind and clock).
        clock: seconds in the GPU's time base (on CUDA: the time of the first event; the
            later ones follow by the GPU's time between events).
        stream: the stage's CUDA stream (:func:`~lightning_energy.device.cuda_stream`;
            None: no stream).
    """

    def __init__(
        self,
        gpu: GPU,
        timeline: EnergyTimeline,
        label: Callable[[Instruction], Hashable],
        clock: Callable[[], float] = time.perf_counter,
        *,
        stream: CudaStream | None = None,
    ) -> None:
        self.gpu = gpu
        self.timeline = timeline
        self.label = label
        self.clock = clock
        self.stream = stream
        self._start: tuple[float, float] | None = None
        self._last_event: tuple[TimedPoint, float] | None = None  # the newest event, its time

    def mark(self, label: Hashable | None) -> None:
        """Wait for the GPU and mark the counter; ``label`` runs from now on (None: left
        out)."""
        self.timeline.mark(*self._reached(), label)

    def start(self, inst: Instruction) -> None:
        """Mark the start of ``inst``."""
        self._start = self._reached()
        self.timeline.mark(*self._start, self.label(inst))

    def stop(self, inst: Instruction) -> tuple[float, float]:
        """Mark the end of ``inst`` (a wait follows); ``(time_s, counter delta in J)``.

        The delta is what the counter showed, not the instruction's energy: on a counter
        that moves every ~100 ms it is mostly 0 J (the timeline's fit is the estimate).

        Raises:
            ConfigError: no :meth:`start` before.
        """
        if self._start is None:
            raise ConfigError(f"{inst}: stop() without start()")
        now, energy_j = self._reached() if self.stream is None else self._reached_end(self.stream)
        self.timeline.mark(now, energy_j, BLOCKED_LABEL)
        t0, e0 = self._start
        self._start = None
        return now - t0, energy_j - e0

    def _reached(self) -> tuple[float, float]:
        """``(time_s, energy_j)`` once the GPU ran everything queued: the counter first."""
        stream = self.stream
        if stream is None:
            self.gpu.synchronize()
            energy_j = self.gpu.energy_j()
            return self.clock(), energy_j
        stream.synchronize()
        energy_j = self.gpu.energy_j()
        event = stream.timed_point()
        event.synchronize()
        return self._time_of(event), energy_j

    def _reached_end(self, stream: CudaStream) -> tuple[float, float]:
        """CUDA: ``(time_s, energy_j)`` of an event right after the instruction's kernels,
        the counter read as soon as the GPU reaches it."""
        end = stream.timed_point()
        end.synchronize()
        energy_j = self.gpu.energy_j()
        return self._time_of(end), energy_j

    def _time_of(self, event: TimedPoint) -> float:
        """Seconds at which the GPU reached ``event`` (reached): the previous event's time
        plus the GPU's time between them; the first event's is ``clock()``."""
        if self._last_event is None:
            time_s = self.clock()
        else:
            previous, previous_s = self._last_event
            time_s = previous_s + CudaStream.seconds_between(previous, event)
        self._last_event = (event, time_s)
        return time_s


class InstructionHooks(Protocol):
    """What runs around every instruction: a :class:`PipelineRuntime`, or a
    :class:`~lightning_energy.perseus.runtime.pipeline_run.RankPipeline` over one."""

    def before(self, inst: Instruction) -> None:
        """``inst`` is about to run on this rank."""
        ...

    def after(self, inst: Instruction) -> None:
        """``inst`` ran on this rank."""
        ...


class PerseusPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose forwards and backwards run at the planned clocks.

    Takes ``PipelineStage``'s arguments plus ``runtime``; every schedule of
    ``torch.distributed.pipelining`` drives it unchanged.

    Args:
        submodule: the stage's module.
        stage_index: the stage (virtual stage for interleaved schedules).
        num_stages: all stages of the pipeline.
        device: the stage's device.
        runtime: what runs around each instruction (a :class:`PipelineRuntime`).
        **kwargs: passed to ``PipelineStage`` (``input_args``, ``group``, ...).
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        *,
        runtime: InstructionHooks,
        **kwargs: Any,
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        self.perseus_runtime = runtime

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        inst = Instruction(self.stage_index, fwd_chunk_id, FORWARD)
        self.perseus_runtime.before(inst)
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.perseus_runtime.after(inst)
        return output

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: Any = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        inst = Instruction(self.stage_index, bwd_chunk_id, BACKWARD)
        self.perseus_runtime.before(inst)
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self.perseus_runtime.after(inst)
