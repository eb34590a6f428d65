"""Apply a frequency plan in ``torch.distributed.pipelining``: per-instruction clocks.

Pieces, one per concern:

* :class:`ClockController`: a dedicated thread (``lightning-energy-perseus-clock``) that
  locks the GPU clock through the :class:`~lightning_energy.device.guard.GPUGuard`. The
  training thread only records a marker with each request (a blocking CUDA event on the
  stage device's current stream, where the instruction's kernels are queued); the thread,
  working on the stage's device, sleeps until the GPU reaches it, then applies the newest
  request the GPU has passed (older ones coalesce), so changes land at instruction
  boundaries, never stall the CPU issuing kernels and never queue without bound. Resetting
  the clocks never waits for the GPU (a stream may never advance again: a dead peer).
* :class:`PipelineRuntime`: one per pipeline rank. Before each forward/backward of each
  microbatch it asks the controller for the planned clock; it records what ran, measures
  instructions while profiling (:class:`InstructionMeter`: CUDA events on the stage's
  stream time them), and resets the clocks at the end and on failure (also the guard's
  job on exit and SIGTERM).
* :class:`PerseusPipelineStage`: a ``PipelineStage`` that calls the runtime around every
  ``forward_one_chunk`` / ``backward_one_chunk``. It works with every schedule of
  ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B...).
* :class:`PipelineSimulation`: with simulated GPUs (no GPU, CPU + gloo), each instruction's
  GPU time and energy come from the simulated GPU at the locked clock, and the ranks'
  virtual clocks follow the pipeline dependencies (a stage waits for the virtual time its
  input was produced), so a simulated iteration takes the planned iteration time and its
  bubbles draw the blocked power.

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
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.device.base import GPU
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.simulated import PhysicsModel, SimulatedGPU
from lightning_energy.errors import ConfigError, EnergyError
from lightning_energy.perseus.attribution import EnergyTimeline
from lightning_energy.perseus.plan import Plan
from lightning_energy.perseus.profile import BACKWARD, FORWARD, PipelineProfile
from lightning_energy.perseus.schedule import Instruction, PipelineSchedule

__all__ = [
    "BLOCKED_LABEL",
    "ClockController",
    "ExecutedInstruction",
    "InstructionHooks",
    "InstructionMeter",
    "Marker",
    "PerseusPipelineStage",
    "PipelineRuntime",
    "PipelineSimulation",
    "StageWork",
    "agree_on_clock_control",
    "simulated_profile",
]

log = logging.getLogger(__name__)

_THREAD_NAME = "lightning-energy-perseus-clock"

#: Timeline label of the time a pipeline rank waits between its instructions.
BLOCKED_LABEL = "blocked"


class Marker(Protocol):
    """A point of the GPU stream: reached once the GPU has run everything before it."""

    def query(self) -> bool:
        """True once the GPU has reached the point (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until the GPU reaches the point (sleeping, not spinning)."""
        ...


class _Reached:
    """Devices without a stream (CPU, simulated GPUs): every point is reached at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _stream_device(device: torch.device | None) -> torch.device | None:
    """The CUDA device whose stream a stage's instructions run on (None: no stream).

    None stands for the current CUDA device of the calling thread, when there is CUDA.
    """
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return None
    if device is None or device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _stream_marker(device: torch.device) -> Callable[[], Marker]:
    """Markers at the current point of ``device``'s current stream, the stream the
    stage's kernels are queued on (whatever the calling thread's current device is)."""

    def marker() -> Marker:
        event = torch.cuda.Event(blocking=True)  # waiting on it yields the core
        event.record(torch.cuda.current_stream(device))
        return event

    return marker


class ClockController:
    """Locks one GPU's SM clock from a dedicated thread, following the stage's stream.

    The training thread only records a marker on the stage device's current stream with
    each request. The thread (its CUDA calls on the stage's device) waits, blocking, not
    spinning, for the oldest pending marker, then applies the newest request whose marker
    the GPU has reached and drops the older ones: when setting a clock takes longer than an
    instruction runs, requests coalesce instead of queueing without bound, and the clock
    set is the one of the instruction the GPU runs now.

    Nothing that puts clocks back waits for the GPU: a stream may never reach a marker
    again (a peer died in the middle of a receive), so :meth:`reset` drops the pending
    requests and resets the clocks at once, and a request made before it is never applied.
    :meth:`flush`, the one wait while training runs, gives up after ``flush_timeout_s``.

    Args:
        guard: the guard every change goes through (restores the GPU at the end).
        gpu_position: position of the GPU in the guard's list.
        gpu: the GPU, to read back the clock actually locked (None: the guard's answer).
        device: the stage's device; on a CUDA device, changes follow its current stream.
            None: the current CUDA device of the thread building the controller (when
            there is CUDA).
        wait_for_device: on CUDA, apply a change only when the GPU reaches the point of
            the stream where it was requested; otherwise at once (no stream is followed).
        marker: makes a marker at the current point of the stream (default: a blocking
            CUDA event on the stage device's current stream, else an already reached one).
        flush_timeout_s: the longest :meth:`flush` waits for the GPU.

    Raises:
        ConfigError: ``flush_timeout_s`` is not a positive number of seconds.
    """

    def __init__(
        self,
        guard: GPUGuard,
        gpu_position: int = 0,
        *,
        gpu: GPU | None = None,
        device: torch.device | None = None,
        wait_for_device: bool = True,
        marker: Callable[[], Marker] | None = None,
        flush_timeout_s: float = 60.0,
    ):
        if not 0 < flush_timeout_s < float("inf"):
            raise ConfigError(
                f"flush_timeout_s: {flush_timeout_s!r} is not allowed; use a finite number "
                "of seconds > 0",
                source="ClockController",
            )
        self.guard = guard
        self.gpu_position = gpu_position
        self.gpu = gpu
        #: The CUDA device whose stream the changes follow (None: none, changes at once).
        self.device = _stream_device(device) if wait_for_device else None
        if marker is None:
            marker = _Reached if self.device is None else _stream_marker(self.device)
        self._marker = marker
        self.flush_timeout_s = flush_timeout_s
        self._cond = threading.Condition()
        self._apply_lock = threading.Lock()  # one change or reset of the GPU at a time
        self._pending: list[tuple[int, Marker]] = []
        self._busy = False  # the thread works on a request (not voided since)
        self._waiting = False  # the thread waits for the GPU to reach a marker
        self._epoch = 0  # moves on at every reset and stop: earlier requests are void
        self._thread: threading.Thread | None = None
        self._current: int | None = None
        self._requested: int | None = None
        self._error: BaseException | None = None
        self._warned_flush = False
        self.changes = 0

    @property
    def current_mhz(self) -> int | None:
        """The clock the GPU was last locked to, as read back (None: none yet, or reset)."""
        return self._current

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True)
            self._thread.start()

    def request(self, freq_mhz: int) -> None:
        """Ask for ``freq_mhz`` from the current point of the GPU stream on; never blocks.

        Raises:
            EnergyError: an earlier change failed in strict mode (re-raised here).
        """
        self._raise_pending()
        if freq_mhz == self._requested:
            return
        self.start()
        marker = self._marker()
        with self._cond:
            self._requested = freq_mhz
            self._pending.append((freq_mhz, marker))
            self._cond.notify_all()

    def flush(self) -> bool:
        """Wait until every requested change is applied (or superseded): before a
        measured instruction, on simulated GPUs. Waits at most ``flush_timeout_s`` (one
        warning when the GPU did not get there: its stream may be stalled).

        Returns:
            True when every request was applied, False when the wait gave up.

        Raises:
            EnergyError: a change failed in strict mode.
        """
        with self._cond:
            done = self._cond.wait_for(
                lambda: not self._pending and not self._busy, timeout=self.flush_timeout_s
            )
        if not done and not self._warned_flush:
            self._warned_flush = True
            log.warning(
                "Perseus: the GPU did not reach a requested clock change within %.0f s (is "
                "its stream stalled, waiting for a peer?); going on without waiting for it.",
                self.flush_timeout_s,
            )
        self._raise_pending()
        return done

    def reset(self) -> None:
        """Put the GPU's clocks back to their pre-job state now. Requests not applied yet
        are dropped (never applied later) and the GPU is not waited for.

        Raises:
            EnergyError: a change failed in strict mode (after the reset).
        """
        with self._cond:
            self._drop_pending()
            self._requested = None
        with self._apply_lock:  # a change being applied now ends first
            self._current = None
            self.guard.reset_clocks([self.gpu_position])
        self._raise_pending()

    def stop(self) -> None:
        """Stop the thread, dropping what is pending (idempotent). A thread waiting for the
        GPU is not waited for: it applies nothing more and ends when the stream moves."""
        with self._cond:
            thread, self._thread = self._thread, None
            waiting = self._waiting
            self._drop_pending()
        if thread is not None and not waiting:
            thread.join(self.flush_timeout_s)

    def _drop_pending(self) -> None:
        """Void every request not applied yet, the one being waited for too (under the
        condition's lock)."""
        self._pending.clear()
        self._busy = False
        self._epoch += 1
        self._cond.notify_all()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _next(self) -> tuple[Marker, int] | None:
        """The oldest pending request's marker and the epoch it belongs to (None: this
        thread was stopped)."""
        me = threading.current_thread()
        with self._cond:
            self._cond.wait_for(lambda: bool(self._pending) or self._thread is not me)
            if self._thread is not me:
                return None
            self._busy = self._waiting = True
            return self._pending[0][1], self._epoch

    def _take_newest_reached(self) -> int:
        """Drop the pending requests the GPU has passed; the newest of them."""
        last = 0
        for k in range(1, len(self._pending)):
            if not self._pending[k][1].query():
                break  # markers are in stream order: later ones are not reached
            last = k
        freq = self._pending[last][0]
        del self._pending[: last + 1]
        return freq

    def _apply_reached(self, epoch: int) -> None:
        """Apply the newest request the GPU has passed, unless a reset or stop came since
        the thread started waiting (``epoch``)."""
        with self._apply_lock:
            with self._cond:
                if epoch != self._epoch:
                    return
                freq = self._take_newest_reached()
            if freq == self._current:
                return
            applied = self.guard.lock_clocks_mhz(freq, freq, gpus=[self.gpu_position])
            if self.gpu is not None:
                applied = self.gpu.locked_clocks_mhz()
            self._current = None if applied is None else applied[1]
            self.changes += 1

    def _run(self) -> None:
        try:
            if self.device is not None:
                # Every CUDA call of this thread on the stage's GPU: a new thread starts on
                # device 0, and would make a CUDA context there.
                torch.cuda.set_device(self.device)
        except BaseException as exc:  # handed to the training thread
            self._error = exc
        while (item := self._next()) is not None:
            marker, epoch = item
            try:
                try:
                    marker.synchronize()
                finally:
                    with self._cond:
                        self._waiting = False
                self._apply_reached(epoch)
            except BaseException as exc:  # handed to the training thread
                self._error = exc
                with self._cond:
                    if epoch == self._epoch:
                        self._drop_pending()
            finally:
                with self._cond:
                    if epoch == self._epoch:  # else a reset or stop voided it already
                        self._busy = False
                        self._cond.notify_all()


@dataclass(frozen=True)
class ExecutedInstruction:
    """One instruction as it ran on this rank.

    Attributes:
        instruction: what ran.
        freq_mhz: the clock locked while it ran (None: unchanged).
        time_s: its GPU time, when measured (simulated, or while profiling).
        energy_j: how far the energy counter moved over it, when measured (on a counter
            that moves every ~100 ms, mostly 0 J; see
            :class:`~lightning_energy.perseus.attribution.EnergyTimeline`).
    """

    instruction: Instruction
    freq_mhz: int | None
    time_s: float | None = None
    energy_j: float | None = None


@dataclass(frozen=True)
class StageWork:
    """Simulated GPU work of one instruction kind on one stage.

    Attributes:
        t0_s: its time at the maximum clock.
        compute_bound_share: the share of that time that scales with the clock.
    """

    t0_s: float
    compute_bound_share: float = 1.0


def agree_on_clock_control(
    guard: GPUGuard, freq_mhz: int | None, gpu_position: int = 0, group: Any = None
) -> bool:
    """Lock ``freq_mhz`` to find out whether clocks may be changed, and agree on it.

    Without permission (or with a GPU that cannot lock its clocks, or observe-only for
    any other reason) the guard logs its one warning; every rank of ``group`` then learns
    that clocks cannot be controlled everywhere, and those that locked one reset it, so
    no rank profiles or plans clocks that would never be applied.

    Every rank of ``group`` must call it at the same point, whatever happened before on
    that rank: a rank that cannot control clocks (its supported clocks could not be read:
    ``freq_mhz=None``) votes against, and a lock that raises (strict mode) raises only
    after the vote, so the other ranks never wait for a rank that left.

    Args:
        guard: the guard of this rank's GPU.
        freq_mhz: the clock to lock (the first one Perseus wants); None: this rank cannot
            control clocks and only votes against.
        gpu_position: position of the GPU in the guard.
        group: a process group taking CPU objects (None: the default group); a single
            process decides alone.

    Returns:
        True when every rank locked ``freq_mhz``.

    Raises:
        Exception: what locking raised on this rank (strict mode), after the vote.
    """
    locked = False
    failure: Exception | None = None
    if freq_mhz is not None and not guard.observe_only:
        try:
            locked = guard.lock_clocks_mhz(freq_mhz, freq_mhz, gpus=[gpu_position]) is not None
        except Exception as exc:  # re-raised once every rank has its vote
            failure = exc
    agreed = locked
    if dist.is_initialized():
        votes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(votes, locked, group=group)
        agreed = all(votes)
        if locked and not agreed:
            guard.reset_clocks([gpu_position])
            refused = [r for r, vote in enumerate(votes) if not vote]
            log.info("Perseus disabled: rank(s) %s cannot change GPU clocks.", refused)
    if failure is not None:
        raise failure
    return agreed


def wait_for_slowest(gpu: SimulatedGPU, group: Any = None) -> float:
    """A barrier on simulated clocks: every rank waits, blocked in the collective, until
    the slowest rank's time.

    Args:
        gpu: this rank's simulated GPU (its clock advances, drawing its blocked power at
            the locked clock).
        group: a process group taking CPU tensors (see
            :func:`~lightning_energy.collectives.cpu_collective_group`; None: the default
            one); a single process just returns.

    Returns:
        The common virtual time all ranks reached.
    """
    end = torch.tensor([gpu.clock.now()], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(end, op=dist.ReduceOp.MAX, group=group)
    wait_s = float(end.item()) - gpu.clock.now()
    if wait_s > 0:
        gpu.wait_in_collective(wait_s)
    return float(end.item())


@dataclass
class PipelineSimulation:
    """GPU time, energy and cross-rank timing of a pipeline on simulated GPUs.

    Every rank runs one simulated GPU on its own virtual clock. Finishing an instruction
    sends its virtual finish time to the rank of the dependent stage (through a gloo
    group); starting one waits, blocked in the receive at the clock just set for it, until
    its input's time. :meth:`end_iteration` aligns all ranks on the slowest one (blocked at
    the last instruction's clock), as the optimizer step does.

    Args:
        gpu: this rank's simulated GPU.
        works: the work of each ``(stage, kind)`` run by this rank.
        group: the process group over the pipeline ranks; None: the default group (CPU
            tensors go over a gloo group, see
            :func:`~lightning_energy.collectives.cpu_collective_group`).
    """

    gpu: SimulatedGPU
    works: Mapping[tuple[int, str], StageWork]
    group: Any = None
    _inbox: dict[Instruction, float] = field(default_factory=dict)
    _sends: list[Any] = field(default_factory=list)
    _iteration_start_s: float = 0.0

    def __post_init__(self) -> None:
        self.group = cpu_collective_group(self.group)
        self._iteration_start_s = self.gpu.clock.now()

    def _tag(self, schedule: PipelineSchedule, inst: Instruction) -> int:
        kind = 0 if inst.kind == FORWARD else 1
        return 1 + 2 * (inst.stage * schedule.num_microbatches + inst.microbatch) + kind

    def _producer(self, schedule: PipelineSchedule, inst: Instruction) -> Instruction | None:
        """The instruction of another stage whose output ``inst`` consumes."""
        if inst.kind == FORWARD and inst.stage > 0:
            return Instruction(inst.stage - 1, inst.microbatch, FORWARD)
        if inst.kind == BACKWARD and inst.stage < schedule.num_stages - 1:
            return Instruction(inst.stage + 1, inst.microbatch, BACKWARD)
        return None

    def _consumer(self, schedule: PipelineSchedule, inst: Instruction) -> Instruction | None:
        if inst.kind == FORWARD and inst.stage < schedule.num_stages - 1:
            return Instruction(inst.stage + 1, inst.microbatch, FORWARD)
        if inst.kind == BACKWARD and inst.stage > 0:
            return Instruction(inst.stage - 1, inst.microbatch, BACKWARD)
        return None

    def wait_for_input(self, schedule: PipelineSchedule, rank: int, inst: Instruction) -> None:
        """Wait (blocked in the receive) until the virtual time the input of ``inst``
        was produced."""
        producer = self._producer(schedule, inst)
        if producer is None:
            return
        if schedule.device_of(producer.stage) == rank:
            ready_s = self._inbox.pop(producer)
        else:
            buf = torch.zeros(1, dtype=torch.float64)
            src = schedule.device_of(producer.stage)
            dist.recv(
                buf,
                src=_global_rank(self.group, src),
                group=self.group,
                tag=self._tag(schedule, producer),
            )
            ready_s = float(buf.item())
        wait_s = ready_s - self.gpu.clock.now()
        if wait_s > 0:
            self.gpu.wait_in_collective(wait_s)

    def run(self, inst: Instruction) -> tuple[float, float]:
        """Run the instruction's GPU work at the locked clock: ``(time_s, energy_j)``."""
        work = self.works[(inst.stage, inst.kind)]
        energy_before = self.gpu.energy_j()
        time_s = self.gpu.run_work(work.t0_s, work.compute_bound_share)
        return time_s, self.gpu.energy_j() - energy_before

    def publish(self, schedule: PipelineSchedule, rank: int, inst: Instruction) -> None:
        """Tell the consumer of ``inst``'s output when it was produced."""
        consumer = self._consumer(schedule, inst)
        if consumer is None:
            return
        now_s = self.gpu.clock.now()
        dst = schedule.device_of(consumer.stage)
        if dst == rank:
            self._inbox[inst] = now_s
            return
        buf = torch.tensor([now_s], dtype=torch.float64)
        self._sends.append(
            dist.isend(
                buf,
                dst=_global_rank(self.group, dst),
                group=self.group,
                tag=self._tag(schedule, inst),
            )
        )

    def end_iteration(self) -> tuple[float, float]:
        """Align every rank on the slowest; ``(iteration_time_s, energy_j of this GPU)``."""
        for work in self._sends:
            work.wait()
        self._sends.clear()
        end_s = wait_for_slowest(self.gpu, self.group)
        iteration_s = end_s - self._iteration_start_s
        self._iteration_start_s = end_s
        return iteration_s, self.gpu.energy_j()


def simulated_profile(
    model: PhysicsModel,
    works: Mapping[tuple[int, str], StageWork],
    clocks_mhz: Sequence[int] | None = None,
) -> PipelineProfile:
    """The profile simulated GPUs of ``model`` would measure for ``works``.

    Args:
        model: the physics model (e.g. ``physics_preset("a100")``).
        works: the work of every ``(stage, kind)``.
        clocks_mhz: clocks to profile (default: all the model supports).

    Returns:
        Time and energy at each clock, and the model's blocked power at each clock.
    """
    clocks = list(clocks_mhz) if clocks_mhz is not None else list(model.sm_clocks_mhz)
    rows = []
    for (stage, kind), work in sorted(works.items()):
        for freq in clocks:
            time_s = model.work_time_s(work.t0_s, work.compute_bound_share, freq)
            power_w = model.work_power_w(work.compute_bound_share, freq)
            rows.append((stage, kind, freq, time_s, time_s * power_w))
    blocked = {freq: model.blocked_power_w(freq) for freq in clocks}
    return PipelineProfile.from_rows(rows, blocked_power_w=blocked)


def _global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (the default group: itself)."""
    if group is None:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


class PipelineRuntime:
    """Applies a plan on one pipeline rank and records what ran.

    Args:
        schedule: the pipeline schedule the stages run.
        rank: this rank's position in the pipeline (its device in the schedule).
        controller: applies the clocks.
        plan: the plan to apply (None: leave the clock alone until one is set).
        simulation: simulated GPU time and cross-rank timing (simulated GPUs only).
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
        simulation: PipelineSimulation | None = None,
        record: bool = True,
    ) -> None:
        if not 0 <= rank < schedule.num_devices:
            raise ConfigError(f"rank={rank}: the schedule has {schedule.num_devices} devices")
        self.schedule = schedule
        self.rank = rank
        self.controller = controller
        self.simulation = simulation
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
    def device(self) -> torch.device | None:
        """The CUDA device whose current stream this rank's instructions are queued on
        (None: no stream: on the CPU, or simulated GPUs, whose work runs in this thread)."""
        return None if self.simulation is not None else self.controller.device

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
        if self.simulation is not None or self._meter is not None:
            # The simulated GPU runs "on the stream" in this thread: the clock change and
            # the input must be there before its work starts; a measured instruction
            # starts at the clock it is attributed to.
            self.controller.flush()
        if self.simulation is not None:
            self.simulation.wait_for_input(self.schedule, self.rank, inst)
        if self._meter is not None:
            self._meter.start(inst)

    def after(self, inst: Instruction) -> None:
        """Called just after ``inst`` ran on this rank."""
        time_s: float | None = None
        energy_j: float | None = None
        if self.simulation is not None:
            time_s, energy_j = self.simulation.run(inst)
            self.simulation.publish(self.schedule, self.rank, inst)
        if self._meter is not None:
            measured = self._meter.stop(inst)
            if self.simulation is None:
                time_s, energy_j = measured
        if self.record:
            if self.simulation is not None:
                # What the simulated GPU was actually locked to while the work ran.
                locked = self.simulation.gpu.locked_clocks_mhz()
                freq = None if locked is None else locked[1]
            else:
                freq = self.controller.current_mhz  # the clock read back, not the plan's
            self.trace.append(ExecutedInstruction(inst, freq, time_s, energy_j))

    def end_iteration(self) -> tuple[float, float] | None:
        """Close an iteration. Simulated: align the ranks and return this rank's
        ``(iteration_time_s, cumulative energy_j)``; real GPUs: None."""
        if self.simulation is not None:
            return self.simulation.end_iteration()
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
    :class:`~lightning_energy.perseus.attribution.EnergyTimeline` to split the counter's
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
        device: the stage's CUDA device (None or another device: no stream).
    """

    def __init__(
        self,
        gpu: GPU,
        timeline: EnergyTimeline,
        label: Callable[[Instruction], Hashable],
        clock: Callable[[], float] = time.perf_counter,
        *,
        device: torch.device | None = None,
    ) -> None:
        self.gpu = gpu
        self.timeline = timeline
        self.label = label
        self.clock = clock
        self.device = device if device is not None and device.type == "cuda" else None
        self._start: tuple[float, float] | None = None
        self._last_event: tuple[Any, float] | None = None  # the newest event, its time

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
        now, energy_j = self._reached() if self.device is None else self._reached_end()
        self.timeline.mark(now, energy_j, BLOCKED_LABEL)
        t0, e0 = self._start
        self._start = None
        return now - t0, energy_j - e0

    def _reached(self) -> tuple[float, float]:
        """``(time_s, energy_j)`` once the GPU ran everything queued: the counter first."""
        if self.device is None:
            self.gpu.synchronize()
            energy_j = self.gpu.energy_j()
            return self.clock(), energy_j
        torch.cuda.current_stream(self.device).synchronize()
        energy_j = self.gpu.energy_j()
        event = self._record()
        event.synchronize()
        return self._time_of(event), energy_j

    def _reached_end(self) -> tuple[float, float]:
        """CUDA: ``(time_s, energy_j)`` of an event right after the instruction's kernels,
        the counter read as soon as the GPU reaches it."""
        end = self._record()
        end.synchronize()
        energy_j = self.gpu.energy_j()
        return self._time_of(end), energy_j

    def _record(self) -> Any:
        """A timing event at the current point of the stage device's current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _time_of(self, event: Any) -> float:
        """Seconds at which the GPU reached ``event`` (reached): the previous event's time
        plus the GPU's time between them; the first event's is ``clock()``."""
        if self._last_event is None:
            time_s = self.clock()
        else:
            previous, previous_s = self._last_event
            time_s = previous_s + previous.elapsed_time(event) / 1000.0
        self._last_event = (event, time_s)
        return time_s


class InstructionHooks(Protocol):
    """What runs around every instruction: a :class:`PipelineRuntime`, or a
    :class:`~lightning_energy.perseus.pipeline_run.RankPipeline` over one."""

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
