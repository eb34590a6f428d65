"""Straggler-aware clocks for one data-parallel rank, driven by step events.

:class:`StragglerRun` wires a :class:`~lightning_energy.perseus.straggler.StragglerEqualizer`
to what measures the rank's compute: a simulated step on simulated GPUs, CUDA events and a
DDP communication hook on CUDA GPUs. Framework adapters call :meth:`StragglerRun.step_start`
before the forward pass and :meth:`StragglerRun.step_end` after the optimizer step, and
:meth:`StragglerRun.close` at the end; they hold no logic of their own.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from lightning_energy.device.simulated import as_simulated
from lightning_energy.errors import DeviceError
from lightning_energy.perseus.runtime import StageWork
from lightning_energy.perseus.straggler import (
    SimulatedDataParallel,
    StepReadings,
    StragglerEqualizer,
)

if TYPE_CHECKING:
    from lightning_energy.config import PerseusConfig
    from lightning_energy.device.base import GPU
    from lightning_energy.perseus.rank_gpu import RankGPU

__all__ = ["StragglerRun"]

log = logging.getLogger(__name__)


class StragglerRun:
    """One rank's straggler equalisation over a run.

    Args:
        rank: this rank's GPU and guard.
        section: the ``perseus:`` settings (``window_steps``, ``steps_per_clock``,
            ``margin``, ``profile_clocks_mhz``, and the simulated step's
            ``simulated_step_s`` and ``compute_bound_share``).
        ddp_model: the DDP-wrapped model (CUDA GPUs: its last gradient bucket marks the
            end of the rank's compute); None where there is none.
        strict: raise when the GPU cannot lock clocks instead of running without Perseus.

    Raises:
        ConfigError: bad settings.
        DeviceError: strict mode, the GPU cannot lock clocks.
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
        self._simulation: SimulatedDataParallel | None = None
        self._probe: _CudaComputeProbe | None = None
        gpu = rank.gpu
        try:
            clocks = gpu.supported_sm_clocks_mhz()
        except DeviceError as exc:
            if strict:
                raise
            log.warning("Perseus: %s; ranks not equalised.", exc)
            return
        self.equalizer = StragglerEqualizer(
            rank.guard,
            clocks,
            profile_clocks_mhz=section.profile_clocks_mhz,
            steps_per_clock=section.steps_per_clock,
            window_steps=section.window_steps,
            margin=section.margin,
            counter_period_s=gpu.energy_counter_period_s(),
            group=rank.group,
        )
        if (simulated := as_simulated(gpu)) is not None:
            work = StageWork(section.simulated_step_s, section.compute_bound_share)
            self._simulation = SimulatedDataParallel(simulated, work, group=rank.group)
        elif torch.cuda.is_available() and ddp_model is not None:
            self._probe = _CudaComputeProbe(ddp_model, gpu, self.equalizer)
        else:
            log.warning("Perseus: no CUDA and no simulated GPU; ranks not equalised.")

    def step_start(self) -> None:
        """A training step starts (before the forward pass)."""
        if self._probe is not None:
            self._probe.step_start()

    def step_end(self) -> None:
        """A training step ended (after the optimizer step): record it, maybe re-clock."""
        if self.equalizer is None:
            return
        if self._simulation is not None:
            compute_s = self._simulation.compute()
            self.equalizer.record_step(compute_s, self._simulation.all_reduce())
        elif self._probe is not None:
            measured = self._probe.step_end()
            if measured is None:
                return
            self.equalizer.record_step(*measured)
        else:
            return
        self.equalizer.on_step_end()

    def close(self) -> None:
        """Put the clock back and release the GPU when this run opened it."""
        try:
            if self.equalizer is not None and self.equalizer.enabled:
                self.rank.guard.reset_clocks([self.equalizer.gpu_position])
        finally:
            self.rank.close()


class _CudaComputeProbe:
    """Times a rank's compute on a CUDA GPU: from the step start to when DDP's last
    gradient bucket is ready (before the all-reduce waits for other ranks).

    While the equalizer profiles, it synchronises the compute stream at both points to
    read the energy counter; afterwards it only records CUDA events and reads them one step
    later, so the CPU never waits for the GPU.
    """

    def __init__(self, ddp_model: Any, gpu: GPU, equalizer: StragglerEqualizer) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.gpu = gpu
        self.equalizer = equalizer
        self._allreduce = allreduce_hook
        self._start: tuple[float, float] | None = None
        self._end: tuple[float, float] | None = None
        self._events: tuple[Any, Any] | None = None
        self._pending: tuple[Any, Any] | None = None
        ddp_model.register_comm_hook(None, self._hook)

    def step_start(self) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self._events = (start, None)
        if self.equalizer.profiling:
            torch.cuda.current_stream().synchronize()
            self._start = (time.perf_counter(), self.gpu.energy_j())

    def _hook(self, state: Any, bucket: Any) -> Any:
        if bucket.is_last() and self._events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (self._events[0], end)
            if self.equalizer.profiling:
                torch.cuda.current_stream().synchronize()
                self._end = (time.perf_counter(), self.gpu.energy_j())
        return self._allreduce(state, bucket)

    def step_end(self) -> tuple[float, StepReadings | None] | None:
        """``(compute_s, counter readings while profiling)`` of a finished step, or None."""
        if self.equalizer.profiling and self._start is not None and self._end is not None:
            torch.cuda.synchronize()
            now = (time.perf_counter(), self.gpu.energy_j())
            start, end = self._start, self._end
            self._start = self._end = None
            return end[0] - start[0], (start, end, now)
        previous, self._pending = self._pending, self._events
        if previous is None or previous[1] is None or not previous[1].query():
            return None
        return previous[0].elapsed_time(previous[1]) / 1000.0, None
