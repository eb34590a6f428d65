"""Straggler-aware clocks for one data-parallel rank, driven by step events.

:class:`StragglerRun` wires a
:class:`~lightning_energy.perseus.data_parallel.straggler.StragglerEqualizer` to what
measures the rank's compute: a simulated step on simulated GPUs (the device layer runs
it); on CUDA GPUs, CUDA events at the step start and at the end of the backward pass (found
through gradient hooks, not a DDP communication hook: the model's own hook and process
group stay untouched). Framework adapters call :meth:`StragglerRun.step_start` before the
forward pass and :meth:`StragglerRun.step_end` after the optimizer step, and
:meth:`StragglerRun.close` at the end; they hold no logic of their own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.autograd import Variable

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.device import StageWork, cuda_stream, work_runner
from lightning_energy.device.cuda_events import CudaStream, TimedPoint
from lightning_energy.errors import DeviceError
from lightning_energy.perseus.data_parallel.straggler import (
    Reading,
    StepReadings,
    StragglerEqualizer,
)

if TYPE_CHECKING:
    from lightning_energy.config import PerseusConfig
    from lightning_energy.device.base import GPU
    from lightning_energy.perseus.runtime.rank_gpu import RankGPU

__all__ = ["StepWork", "StragglerClocks", "StragglerRun"]

log = logging.getLogger(__name__)


class StepWork(Protocol):
    """A data-parallel step the device layer runs itself (see
    :func:`~lightning_energy.device.work_runner`)."""

    def compute(self) -> float:
        """Run the step's compute at the locked clock; its time in seconds."""
        ...

    def all_reduce(self) -> StepReadings:
        """Wait for the slowest rank; the step's counter readings."""
        ...


class StragglerClocks:
    """The straggler equaliser's clocks as a knob of the job (registered with the job's
    energy controller when there is one): it holds the clocks, so the job profiles no power
    limits (they would confound the equaliser's measurements), and it cannot be paced (it
    follows the straggler)."""

    name = "straggler_clocks"
    holds_clocks = True

    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """None to pace: the straggler sets the step time."""
        return []

    def apply_pace(self, scale: float) -> None:
        """Nothing: the straggler sets the step time."""
        return None


class StragglerRun:
    """One rank's straggler equalisation over a run.

    Args:
        rank: this rank's GPU and guard.
        section: the ``perseus:`` settings (``window_steps``, ``steps_per_clock``,
            ``margin``, ``profile_clocks_mhz``, and the simulated step's
            ``simulated_step_s`` and ``compute_bound_share``).
        ddp_model: the DDP-wrapped model (CUDA GPUs: the end of its backward pass marks
            the end of the rank's compute); None where there is none.
        strict: raise when the GPU cannot lock clocks instead of running without Perseus
            (at the step where the ranks vote on clock control, after voting against, so
            that no other rank waits for it).

    Raises:
        ConfigError: bad settings.
    """

    def __init__(
        self,
        rank: RankGPU,
        section: PerseusConfig,
        *,
        ddp_model: Any = None,
        strict: bool = False,
    ) -> None:
        self.rank = rank
        self.equalizer: StragglerEqualizer | None = None
        self._work: StepWork | None = None
        self._probe: _CudaComputeProbe | None = None
        gpu = rank.gpu
        group = cpu_collective_group(rank.group)
        self._strict_error: DeviceError | None = None
        runner = work_runner(gpu)
        stream = cuda_stream(None) if runner is None and ddp_model is not None else None
        try:
            clocks = gpu.supported_sm_clocks_mhz()
        except DeviceError as exc:
            # The other ranks vote on clock control after the first steps: this rank takes
            # part then, against, and raises after the vote in strict mode.
            log.warning("Perseus: %s; ranks not equalised.", exc)
            clocks = []
            self._strict_error = exc if strict else None
        measurable = runner is not None or stream is not None
        if clocks and not measurable:
            log.warning("Perseus: no CUDA and no simulated GPU; ranks not equalised.")
            clocks = []  # nothing measures this rank's compute: it votes against
        self.equalizer = StragglerEqualizer(
            rank.guard,
            clocks,
            profile_clocks_mhz=section.profile_clocks_mhz if clocks else None,
            steps_per_clock=section.steps_per_clock,
            window_steps=section.window_steps,
            margin=section.margin,
            counter_period_s=gpu.energy_counter_period_s(),
            group=group,
        )
        if runner is not None:
            # Every rank runs its simulated step (the simulated all-reduce is a
            # collective), also one that cannot equalise.
            work = StageWork(section.simulated_step_s, section.compute_bound_share)
            self._work = runner.data_parallel(work, group=group)
        elif clocks and stream is not None:
            self._probe = _CudaComputeProbe(ddp_model, gpu, self.equalizer, stream)

    def step_start(self) -> None:
        """A training step starts (before the forward pass)."""
        if self._probe is not None:
            self._probe.step_start()

    def step_end(self) -> None:
        """A training step ended (after the optimizer step): record it, maybe re-clock.

        Every rank counts every step, whatever it could measure: the equalizer's
        collectives happen at step counts, so a rank that skipped one would enter them at
        another step than the others (and an NCCL collective after them would hang).

        Raises:
            DeviceError: strict mode, this GPU cannot lock clocks (at the step of the
                ranks' vote on clock control, after voting against).
        """
        if self.equalizer is None:
            return
        if self._work is not None:
            compute_s = self._work.compute()
            self.equalizer.look_for_foreign_clocks()  # the GPU has just computed
            self.equalizer.record_step(compute_s, self._work.all_reduce())
        elif self._probe is not None:
            self.equalizer.look_for_foreign_clocks()  # the step's kernels are still queued
            measured = self._probe.step_end()
            if measured is None:
                self.equalizer.skip_step()
            else:
                self.equalizer.record_step(*measured)
        self.equalizer.on_step_end()
        if self._strict_error is not None and self.equalizer.voted:
            error, self._strict_error = self._strict_error, None
            raise error

    def close(self) -> None:
        """Put the clock back, leave the model as it was, and release the GPU when this
        run opened it."""
        try:
            if self._probe is not None:
                self._probe.close()
            if self.equalizer is not None and self.equalizer.enabled:
                self.rank.guard.reset_clocks([self.equalizer.gpu_position])
        finally:
            self.rank.close()


@dataclass(frozen=True)
class _Mark:
    """A point of the training stream: its CUDA event, and the energy counter there
    (read after synchronising, while the equalizer profiles; None otherwise)."""

    event: TimedPoint
    reading: Reading | None


class _CudaComputeProbe:
    """Times a rank's compute on a CUDA GPU: from the step start to the end of its
    backward pass, before the rank waits for the others' gradients.

    The end of the backward pass is found without a DDP communication hook, so the
    model's own hook (and process group) stays in force and the gradients are exactly
    what they are without Perseus: the first gradient accumulated in a backward pass (a
    post-accumulate-grad hook on the model's parameters) queues a callback that the
    autograd engine runs when the pass ends, on the stream the pass was started from,
    before DDP's own end-of-backward callback makes that stream wait for the
    all-reduce. With gradient accumulation, a step runs from its first micro-batch's
    start to its last backward pass.

    While the equalizer profiles, it synchronises the stream at both points to read the
    energy counter; afterwards it only records CUDA events and reads them one step later,
    without waiting: a step whose events have not completed yet gives no sample (the
    step is still counted).
    """

    def __init__(
        self, model: Any, gpu: GPU, equalizer: StragglerEqualizer, stream: CudaStream
    ) -> None:
        self.gpu = gpu
        self.equalizer = equalizer
        self.stream = stream
        self._start: _Mark | None = None
        self._end: _Mark | None = None
        # The previous step's events.
        self._pending: tuple[TimedPoint, TimedPoint] | None = None
        self._queued = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._gradient_ready)
            for p in model.parameters()
            if p.requires_grad
        ]

    def _mark(self, profiling: bool) -> _Mark:
        event = self.stream.timed_point()
        if not profiling:
            return _Mark(event, None)
        self.stream.synchronize()
        return _Mark(event, (self.gpu.now_s(), self.gpu.energy_j()))

    def step_start(self) -> None:
        """A step (or, with gradient accumulation, its first micro-batch) starts."""
        self._queued = False  # no backward pass runs now (one that raised left it set)
        if self._start is None:
            self._start = self._mark(self.equalizer.profiling)

    def _gradient_ready(self, param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._queued = False
        if self._start is not None:
            self._end = self._mark(self._start.reading is not None)

    def step_end(self) -> tuple[float, StepReadings | None] | None:
        """``(compute_s, counter readings while profiling)`` of a finished step, or None
        when there is none yet (no backward pass, or events not completed)."""
        start, end = self._start, self._end
        self._start = self._end = None
        previous, self._pending = self._pending, None
        if start is None or end is None:
            return None
        if start.reading is not None and end.reading is not None:
            self.stream.synchronize()
            now = (self.gpu.now_s(), self.gpu.energy_j())
            return end.reading[0] - start.reading[0], (start.reading, end.reading, now)
        self._pending = (start.event, end.event)
        if previous is None or not previous[1].query():
            return None
        return CudaStream.seconds_between(*previous), None

    def close(self) -> None:
        """Remove the hooks from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
