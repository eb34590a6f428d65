"""Data-parallel stragglers: fast ranks slow their clocks to arrive just in time.

In synchronous data parallelism every rank waits at the gradient all-reduce for the
slowest one (a straggler: a hotter, throttled or simply slower GPU). The faster ranks burn
energy computing fast and then idling; Perseus' insight applies: they can run their step at
a lower clock and finish exactly when the straggler does, with the same step time and less
energy (SOSP'24, section 3, "extrinsic energy bloat").

:class:`StragglerEqualizer` runs on every rank:

1. *profile*: a few steps at each of a few clocks (the first step at each only lets the
   change land; then ``steps_per_clock`` steps and at least
   :func:`~lightning_energy.perseus.runtime.attribution.min_profile_s`), marking the
   energy counter at each step's start, compute end and end; an
   :class:`~lightning_energy.perseus.runtime.attribution.EnergyTimeline` splits the
   counter's updates into the compute power and the power while blocked, both at each
   clock (a GPU blocked in the all-reduce spins at the locked clock); fit
   :class:`~lightning_energy.perseus.runtime.online.ClockModel` and the blocked
   :class:`~lightning_energy.perseus.runtime.online.PowerCurve`;
2. *equalise*: every ``window_steps`` steps the ranks exchange their compute time at the
   maximum clock (scaled from what they measure now, so drift and new stragglers show
   up); the slowest sets the deadline, and each rank locks the clock minimising its
   predicted energy (compute + blocked until the deadline) among those meeting the
   deadline with a small margin, the wait priced at the blocked power of that clock. The
   straggler itself stays at the maximum clock.

:class:`~lightning_energy.device.simulated.work.DataParallelSimulation` provides the
measurements on simulated GPUs (CPU + gloo).

Example (every rank)::

    equalizer = StragglerEqualizer(guard, gpu.supported_sm_clocks_mhz())
    for batch in data:
        ...  # forward, backward; read (time_s, energy_j) at the start, compute end, end
        equalizer.record_step(compute_s, (start, compute_end, end))  # or skip_step()
        equalizer.on_step_end()  # every step, on every rank
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.device.guard import GPUGuard
from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.perseus.runtime.attribution import EnergyTimeline, min_profile_s
from lightning_energy.perseus.runtime.clock import agree_on_clock_control
from lightning_energy.perseus.runtime.online import (
    ClockModel,
    PowerCurve,
    Sample,
    profile_clocks,
)

__all__ = ["Reading", "StepReadings", "StragglerEqualizer"]

log = logging.getLogger(__name__)

#: One read of the energy counter: ``(time_s, energy_j)``.
Reading = tuple[float, float]
#: The counter at a step's start, at the end of its compute, and at its end.
StepReadings = tuple[Reading, Reading, Reading]

_BLOCKED = "blocked"
#: Between one step's end and the next one's start (data loading, the framework's own
#: work): its power is fitted too, so the counter's updates there keep their stretch.
_BETWEEN = "between steps"


class StragglerEqualizer:
    """Locks each data-parallel rank's clock so all ranks reach the all-reduce together.

    Args:
        guard: the guard every clock change goes through.
        supported_clocks_mhz: clocks the GPU supports (none: it votes against clock control).
        gpu_position: position of this rank's GPU in the guard.
        profile_clocks_mhz: clocks to profile (default: 3 from the maximum to 60 % of it).
        steps_per_clock: measured steps per clock, at least (each clock also gets one
            unmeasured step for the change to land, and is measured for at least
            :func:`~lightning_energy.perseus.runtime.attribution.min_profile_s`).
        counter_period_s: how often the GPU's energy counter moves (0: continuously).
        window_steps: steps between re-evaluations.
        margin: finish this much (relative) before the straggler, to absorb noise.
        group: the data-parallel process group (None: the default group). Its CPU
            tensors go over a gloo group (see
            :func:`~lightning_energy.collectives.cpu_collective_group`).
        vote_after_steps: steps run before the ranks agree on clock control and the first
            clock is locked: an administrator's lock shows only while work runs, and is
            looked for during these (see :meth:`look_for_foreign_clocks`).

    Raises:
        ConfigError: bad counts, margin or clocks, or a ``group`` that rejects CPU tensors.
    """

    def __init__(
        self,
        guard: GPUGuard,
        supported_clocks_mhz: Sequence[int],
        *,
        gpu_position: int = 0,
        profile_clocks_mhz: Sequence[int] | None = None,
        steps_per_clock: int = 2,
        window_steps: int = 10,
        margin: float = 0.01,
        counter_period_s: float = 0.0,
        group: Any = None,
        vote_after_steps: int = 3,
    ) -> None:
        problems = []
        if steps_per_clock < 1:
            problems.append(f"steps_per_clock: {steps_per_clock} is not allowed; use >= 1")
        if window_steps < 1:
            problems.append(f"window_steps: {window_steps} is not allowed; use >= 1")
        if not 0 <= margin < 0.5:
            problems.append(f"margin: {margin} is not allowed; use a value in [0, 0.5)")
        if vote_after_steps < 1:
            problems.append(f"vote_after_steps: {vote_after_steps} is not allowed; use >= 1")
        clocks = profile_clocks(supported_clocks_mhz, profile_clocks_mhz, problems, count=3)
        if problems:
            raise ConfigError(problems, source="StragglerEqualizer")
        self.guard = guard
        self.gpu_position = gpu_position
        self.supported_clocks_mhz = sorted(set(supported_clocks_mhz), reverse=True)
        self.max_clock_mhz = max(self.supported_clocks_mhz, default=0)
        self.profile_clocks_mhz = clocks
        self.steps_per_clock = steps_per_clock
        self.window_steps = window_steps
        self.margin = margin
        self.group = cpu_collective_group(group)
        self.model: ClockModel | None = None
        #: Power while blocked in the all-reduce against the clock (fitted with the model).
        self.blocked_power = PowerCurve.constant(0.0)
        self.straggler_rank: int | None = None
        self.deadline_s: float | None = None
        self.clock_mhz: int | None = None
        self.step = 0
        self._timeline = EnergyTimeline(counter_period_s)
        self._min_profile_s = min_profile_s(counter_period_s)
        self._clock_index = 0
        self._clock_steps = 0  # at the current profiling clock, the landing one included
        self._clock_seconds = 0.0  # measured at the current profiling clock
        self._window: list[float] = []
        self._landing = False  # the clock just changed
        self._drift = 1.0  # measured over modelled compute time
        self._vote_after_steps = vote_after_steps
        #: False until the ranks agreed to control clocks (after the first steps), and for
        #: good when clocks cannot be changed on some rank: the equalizer does nothing.
        self.enabled = False
        self.voted = False

    def look_for_foreign_clocks(self) -> None:
        """Until the vote, while the step's work keeps the GPU busy: let the guard look for
        an administrator's clock lock (NVML shows one only under load, never on the idle GPU
        of setup), so that none is replaced by the first lock and reset at the end."""
        if not self.voted:
            self.guard.check_foreign_clocks()

    def _vote(self) -> None:
        """After the first steps: lock the first profiling clock (collective; every rank)."""
        self.voted = True
        first = self.profile_clocks_mhz[0] if self.profile_clocks_mhz else None
        self.enabled = agree_on_clock_control(self.guard, first, self.gpu_position, self.group)
        if self.enabled:
            self.clock_mhz = first

    @property
    def profiling(self) -> bool:
        """True until the step model is fitted (also before the ranks' vote; never once
        disabled)."""
        return not self.voted or (self.enabled and self.model is None)

    def _apply(self, freq_mhz: int) -> None:
        if freq_mhz != self.clock_mhz:
            self.guard.lock_clocks_mhz(freq_mhz, freq_mhz, gpus=[self.gpu_position])
            self.clock_mhz = freq_mhz
            self._landing = True

    def record_step(self, compute_time_s: float, readings: StepReadings | None = None) -> None:
        """Report this rank's last step at the current clock.

        Args:
            compute_time_s: time computing (forward + backward), not waiting.
            readings: the energy counter at the step's start, at the end of its compute
                and at its end, in one time base (needed while profiling).

        Raises:
            ConfigError: no readings while profiling.
        """
        if not self.enabled:
            return
        if self._landing:
            # A clock change governs work only after a while: this step ran partly at the
            # previous clock, so its time says little about the new one.
            self._landing = False
        else:
            self._window.append(compute_time_s)
        if not self.profiling:
            return
        if readings is None:
            raise ConfigError("record_step: the counter readings are needed while profiling")
        assert self.clock_mhz is not None
        start, compute_end, end = readings
        measured = self._clock_steps > 0  # the first step lets the clock change land
        self._timeline.mark(*start, ("compute", self.clock_mhz) if measured else None)
        self._timeline.mark(*compute_end, (_BLOCKED, self.clock_mhz) if measured else None)
        self._timeline.mark(*end, _BETWEEN if measured else None)
        if measured:
            self._clock_seconds += end[0] - start[0]

    def skip_step(self) -> None:
        """This rank could not measure its last step (its CUDA events had not completed
        yet, or it ran no backward pass): no sample, and the time since the previous
        step's end is left out of the energy timeline. :meth:`on_step_end` still counts
        the step, as every rank must."""
        if not self.enabled:
            return
        self._landing = False  # the clock change landed during the skipped step
        self._timeline.leave_out()

    def on_step_end(self) -> None:
        """Advance; after the first steps agree on clock control, then profile, fit, and
        re-evaluate the clock at window ends (collectives)."""
        self.step += 1
        if not self.voted:
            if self.step >= self._vote_after_steps:
                self._vote()
            return
        if not self.enabled:
            return
        if self.profiling:
            self._clock_steps += 1
            done = (
                self._clock_steps > self.steps_per_clock
                and self._clock_seconds >= self._min_profile_s
            )
            if not self._all(done):
                return
            self._clock_index += 1
            self._clock_steps, self._clock_seconds = 0, 0.0
            if self._clock_index < len(self.profile_clocks_mhz):
                self._apply(self.profile_clocks_mhz[self._clock_index])
                return
            if not self._fit():
                return
            self._window = self._window[-self.steps_per_clock :]
            self._equalise()
            return
        if self.step % self.window_steps == 0:
            self._equalise()

    def _all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (collective)."""
        if not dist.is_initialized():
            return flag
        votes = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.group)
        return bool(votes.item() > 0)

    def _measure(self) -> ClockModel:
        """The step model and the blocked power, from the timeline.

        Raises:
            ProfileError: the counter's updates cannot be split, or the fit fails.
        """
        try:
            fitted = self._timeline.fit()
        finally:
            self._timeline.clear()
        samples: list[Sample] = []
        blocked: dict[int, float] = {}
        for label, measured in fitted.items():
            if label == _BETWEEN:
                continue
            kind, freq = cast(tuple[str, int], label)
            if kind == _BLOCKED:
                blocked[freq] = max(measured.power_w, 0.0)
            else:
                samples.append((freq, measured.segment_s, measured.segment_energy_j))
        # The straggler barely waits: no blocked time measured, and none needed.
        self.blocked_power = PowerCurve.fit(blocked) if blocked else PowerCurve.constant(0.0)
        return ClockModel.fit(samples)

    def _fit(self) -> bool:
        """Fit the step model; when it cannot be fitted on some rank, every rank stops
        equalising and resets its clock (one warning on the ranks that failed)."""
        try:
            model: ClockModel | None = self._measure()
        except ProfileError as exc:
            log.warning(
                "Straggler equalisation off: cannot fit the step model (%s); the GPU clock "
                "is left as it was before the job.",
                exc,
            )
            model = None
        fitted: list[Any] = [model is not None]
        if dist.is_initialized():
            fitted = [None] * _world(self.group)
            dist.all_gather_object(fitted, model is not None, group=self.group)
        if all(fitted):
            self.model = model
            return True
        self.enabled = False
        self.guard.reset_clocks([self.gpu_position])
        self.clock_mhz = None
        return False

    def _equalise(self) -> None:
        assert self.model is not None and self.clock_mhz is not None
        if self._window:
            # What this rank would take at the maximum clock, scaled from what it takes now.
            measured_s = sum(self._window) / len(self._window)
            self._drift = measured_s / self.model.time_s(self.clock_mhz)
        self._window = []
        drift = self._drift
        at_max_s = self.model.time_s(self.max_clock_mhz) * drift
        times = torch.tensor([at_max_s], dtype=torch.float64)
        if dist.is_initialized():
            gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(_world(self.group))]
            dist.all_gather(gathered, times, group=self.group)
            all_s = [float(t.item()) for t in gathered]
        else:
            all_s = [at_max_s]
        deadline = max(all_s)
        straggler = all_s.index(deadline)
        if straggler != self.straggler_rank:
            log.info("Straggler: rank %d (%.4f s of compute per step).", straggler, deadline)
        self.straggler_rank, self.deadline_s = straggler, deadline
        self._apply(self.best_clock(deadline * (1 - self.margin), drift))

    def best_clock(self, deadline_s: float, drift: float = 1.0) -> int:
        """The clock with the least predicted energy that meets the deadline: its compute,
        then the wait until the deadline at the blocked power of that clock.

        Args:
            deadline_s: when the step's compute must end (the straggler's compute time).
            drift: this rank's measured over modelled compute time.

        Returns:
            The clock (the maximum when none meets the deadline).

        Raises:
            ConfigError: called before the step model is fitted.
        """
        if self.model is None:
            raise ConfigError("best_clock: the step model is not fitted yet (still profiling)")
        best, best_j = self.max_clock_mhz, float("inf")
        for f in self.supported_clocks_mhz:
            if f < self.model.min_mhz:
                break  # never extrapolate below the profiled clocks
            t = self.model.time_s(f) * drift
            if t > deadline_s:
                continue
            energy = self.model.energy_j(f) * drift + self.blocked_power.power_w(f) * (
                deadline_s - t
            )
            if energy < best_j:
                best, best_j = f, energy
        return best


def _world(group: Any) -> int:
    return int(dist.get_world_size(group))
