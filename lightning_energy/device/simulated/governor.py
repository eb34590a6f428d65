"""The power and thermal governor of a simulated GPU: the SM clock, control period by period.

A board under a power limit does not pick one clock for a piece of work. Its firmware
reads the board's power averaged over the last control period and, every control period,
moves a clock target: up while that reading is under the setpoint (the limit, less the
preset's ``cap_margin``), down while it is over, by ``gain x (setpoint - reading)``
(integral action: over a run the periods' readings, and so the average power, meet the
setpoint whenever the clock is not at a bound). The target is bounded by the lowest
supported clock and by a ceiling: the maximum clock, a lock's upper bound, and a thermal
ceiling when the model has a :class:`~.physics.ThermalModel`. The SM clock is the highest
supported clock at or under the target. So under a cap the clock follows the work's
phases as far as the loop is fast enough: it rises in memory-bound phases and in waits in
collectives, which draw less, and falls in compute-bound ones; a locked clock holds unless
the power limit or the temperature forces it down (a power limit and the temperature win
over a lock, as on NVIDIA GPUs).

Integration is exact and piecewise: between two control instants the clock is constant,
so each stretch of one phase at one clock has a constant power and progress rate (work
with compute-bound share ``beta`` progresses at ``1 / (beta f_max / f + 1 - beta)`` seconds
of ``f_max`` work per second); the period's energy adds up exactly and the temperature, a
first-order filter of the power, advances in closed form. A piece of work costs one step
per control period or phase boundary it spans, and one step per phase when nothing can
move the clock (it sits at its ceiling, no phase draws more than the setpoint there, no
thermal slowdown is due): then the result is the static answer of
:class:`~.physics.PhysicsModel` exactly.

Time without work (the GPU idle) is caught up at the next piece of work: the readings
and the temperature follow the idle power, and the control instants in between raise
the target (an idle GPU draws less than any setpoint).

Example:
    >>> from lightning_energy.device.simulated.physics import Phase, physics_preset
    >>> model = physics_preset("a100")
    >>> governor = Governor(model, start_s=0.0)
    >>> run = governor.run(0.0, 1.0, [Phase(1.0, 1.0)], power_limit_w=250.0)
    >>> run.power_capped, run.mean_clock_mhz < model.max_clock_mhz
    (True, True)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_energy.device.simulated.physics import Phase, PhysicsModel, phase_problems
from lightning_energy.errors import ConfigError

__all__ = ["GovernedRun", "Governor", "steady_run"]


@dataclass(frozen=True)
class GovernedRun:
    """What a piece of work did under the governor.

    Attributes:
        duration_s: how long it took.
        energy_j: the energy it drew.
        clock_mhz: the SM clock when it ended.
        mean_clock_mhz: the SM clock averaged over its duration.
        power_w: its average power (for work of no duration, the power at its start).
        power_capped: the power limit held the clock under its ceiling at some point.
        lock_held: a clock lock held the clock under what the governor would have run.
        thermal_slowdown: the temperature held the clock under the lock's or maximum clock.
    """

    duration_s: float
    energy_j: float
    clock_mhz: int
    mean_clock_mhz: float
    power_w: float
    power_capped: bool
    lock_held: bool
    thermal_slowdown: bool


class Governor:
    """The clock state of one simulated GPU (not thread-safe: its GPU's lock guards it).

    Args:
        model: the GPU's physics model (clocks, power, governor constants, thermal model).
        start_s: the virtual time the GPU starts at, idle at its maximum clock target.
    """

    def __init__(self, model: PhysicsModel, start_s: float) -> None:
        self.model = model
        constants = model.governor
        self._period_s = constants.control_period_s
        self._margin = constants.cap_margin
        self._gain = constants.control_period_s / constants.response_s
        self._ascending = model.sm_clocks_mhz[::-1]
        # The power rise per MHz of compute-bound work around each supported clock: the
        # loop's scale from a power error to a clock step where the clock is.
        clocks, last = self._ascending, len(self._ascending) - 1
        power_w = [model.work_power_w(1.0, f) for f in clocks]
        self._slopes = [
            max(
                (power_w[min(k + 1, last)] - power_w[max(k - 1, 0)])
                / max(clocks[min(k + 1, last)] - clocks[max(k - 1, 0)], 1),
                1e-9,
            )
            for k in range(len(clocks))
        ]
        self._f_max = float(model.max_clock_mhz)
        self._f_min = float(self._ascending[0])
        self._target_mhz = self._f_max
        self._pinned = True  # the target sits at its ceiling: only the ceiling holds it
        self._reading_w = model.idle_power_w  # the mean power of the last control period
        self._period_j = 0.0  # the energy drawn since the last control instant
        self._now_s = start_s
        self._next_tick_s = start_s + self._period_s
        thermal = model.thermal
        self._temperature_c = math.nan if thermal is None else thermal.steady_c(model.idle_power_w)
        self._thermal_ceiling_mhz = self._f_max

    def temperature_at(self, at_s: float) -> float:
        """The modelled temperature at ``at_s`` (at or after the last piece of work), the
        GPU idle since; NaN without a thermal model."""
        thermal = self.model.thermal
        if thermal is None:
            return math.nan
        steady_c = thermal.steady_c(self.model.idle_power_w)
        cooled = math.exp(-max(0.0, at_s - self._now_s) / thermal.time_constant_s)
        return steady_c + (self._temperature_c - steady_c) * cooled

    def clock_mhz(self) -> int:
        """The SM clock the governor runs work at now."""
        return self._quantize(self._target_mhz)

    def _quantize(self, mhz: float) -> int:
        """The highest supported clock at or under ``mhz`` (the lowest when none is)."""
        k = bisect.bisect_right(self._ascending, mhz + 1e-9)
        return self._ascending[max(k - 1, 0)]

    def _step_clock(self, mhz: float, steps: int) -> float:
        """The supported clock ``steps`` places above (or below) ``mhz``'s, bounded."""
        k = bisect.bisect_right(self._ascending, mhz + 1e-9) - 1 + steps
        return float(self._ascending[min(max(k, 0), len(self._ascending) - 1)])

    def _relax(self, power_w: float, seconds: float) -> None:
        """Advance the period's energy and the temperature by ``seconds`` at ``power_w``."""
        self._period_j += power_w * seconds
        thermal = self.model.thermal
        if thermal is not None:
            steady_c = thermal.steady_c(power_w)
            self._temperature_c = steady_c + (self._temperature_c - steady_c) * math.exp(
                -seconds / thermal.time_constant_s
            )

    def _control(self, setpoint_w: float, lock_ceiling_mhz: float) -> None:
        """One control instant: read the period's mean power, move the thermal ceiling,
        then the clock target."""
        self._reading_w, self._period_j = self._period_j / self._period_s, 0.0
        thermal = self.model.thermal
        if thermal is not None:
            if self._temperature_c >= thermal.slowdown_c:
                self._thermal_ceiling_mhz = self._step_clock(self._thermal_ceiling_mhz, -1)
            elif self._temperature_c <= thermal.slowdown_c - thermal.hysteresis_c:
                self._thermal_ceiling_mhz = min(
                    self._f_max, self._step_clock(self._thermal_ceiling_mhz, 1)
                )
        ceiling = min(lock_ceiling_mhz, self._thermal_ceiling_mhz)
        k = max(bisect.bisect_right(self._ascending, self._target_mhz + 1e-9) - 1, 0)
        target = self._target_mhz + self._gain * (setpoint_w - self._reading_w) / self._slopes[k]
        self._pinned = target >= ceiling
        self._target_mhz = ceiling if self._pinned else max(self._f_min, target)

    def _catch_up(self, until_s: float, setpoint_w: float, lock_ceiling_mhz: float) -> None:
        """Let the GPU idle from the end of its last piece of work to ``until_s``."""
        idle_w = self.model.idle_power_w
        while self._next_tick_s <= until_s:
            self._relax(idle_w, self._next_tick_s - self._now_s)
            self._now_s = self._next_tick_s
            before = (self._target_mhz, self._pinned, self._thermal_ceiling_mhz)
            self._control(setpoint_w, lock_ceiling_mhz)
            self._next_tick_s += self._period_s
            settled = self.model.thermal is None or self._thermal_ceiling_mhz == self._f_max
            if settled and before == (self._target_mhz, self._pinned, self._thermal_ceiling_mhz):
                # Nothing moves any more while the GPU idles: skip to the last instant,
                # whose reading is the idle power.
                skipped = math.floor((until_s - self._next_tick_s) / self._period_s) + 1
                if skipped > 0:
                    last_tick_s = self._next_tick_s + (skipped - 1) * self._period_s
                    self._relax(idle_w, last_tick_s - self._now_s)
                    self._reading_w, self._period_j = idle_w, 0.0
                    self._now_s, self._next_tick_s = last_tick_s, last_tick_s + self._period_s
                break
        if until_s > self._now_s:
            self._relax(idle_w, until_s - self._now_s)
            self._now_s = until_s

    def run(
        self,
        start_s: float,
        t0_s: float,
        phases: Sequence[Phase],
        power_limit_w: float,
        max_clock_mhz: int | None = None,
        slowdown: float = 1.0,
    ) -> GovernedRun:
        """Run a piece of work from ``start_s``, advancing the governor's state to its end.

        Args:
            start_s: when the work starts (>= the end of the previous one).
            t0_s: its duration at ``f_max`` (a blocked phase's share of it lasts as long
                at any clock).
            phases: its phases (valid: see :func:`~.physics.phase_problems`).
            power_limit_w: the power limit in force.
            max_clock_mhz: the upper bound of a clock lock, if any.
            slowdown: a straggler's factor: its work progresses this much slower at the
                same power (waits are not slowed).

        Returns:
            The work's duration, energy, clocks and the reasons that held its clock back.
        """
        model = self.model
        setpoint_w = power_limit_w * (1.0 - self._margin)
        lock_mhz = self._f_max if max_clock_mhz is None else min(self._f_max, max_clock_mhz)
        self._catch_up(start_s, setpoint_w, lock_mhz)
        ceiling = min(lock_mhz, self._thermal_ceiling_mhz)
        if self._pinned or self._target_mhz > ceiling:
            self._target_mhz, self._pinned = ceiling, True
        start_clock = self.clock_mhz()
        start_power_w = model.phase_power_w(phases[0], start_clock) if phases else 0.0
        if self._steady(phases, setpoint_w, start_clock):
            energy_j, duration_s = self._run_steady(t0_s, phases, start_clock, slowdown)
            held = self._quantize(lock_mhz) < self._f_max
            return GovernedRun(
                duration_s=duration_s,
                energy_j=energy_j,
                clock_mhz=start_clock,
                mean_clock_mhz=float(start_clock),
                power_w=energy_j / duration_s if duration_s > 0 else start_power_w,
                power_capped=False,
                lock_held=held,
                thermal_slowdown=False,
            )
        energy_j = clock_time = 0.0
        capped = held = hot = False
        lock_clock = self._quantize(lock_mhz)
        f_max = self._f_max
        start = self._now_s
        for phase in phases:
            left = phase.share * t0_s
            beta = phase.compute_bound_share
            while left > 0.0:
                while self._next_tick_s <= self._now_s:
                    self._control(setpoint_w, lock_mhz)
                    self._next_tick_s += self._period_s
                clock = self._quantize(self._target_mhz)
                if phase.blocked:
                    rate = 1.0
                else:
                    rate = 1.0 / (slowdown * (beta * f_max / clock + 1.0 - beta))
                power_w = model.phase_power_w(phase, clock)
                to_tick_s = self._next_tick_s - self._now_s
                if left <= rate * to_tick_s:
                    dt_s, left = left / rate, 0.0
                else:
                    dt_s = to_tick_s
                    left -= rate * dt_s
                energy_j += power_w * dt_s
                clock_time += clock * dt_s
                self._relax(power_w, dt_s)
                self._now_s += dt_s
                thermal_ceiling = self._quantize(self._thermal_ceiling_mhz)
                hot = hot or thermal_ceiling < lock_clock
                if self._pinned:
                    held = held or (lock_clock < f_max and thermal_ceiling >= lock_clock)
                else:
                    capped = True
        duration_s = self._now_s - start
        return GovernedRun(
            duration_s=duration_s,
            energy_j=energy_j,
            clock_mhz=self.clock_mhz(),
            mean_clock_mhz=clock_time / duration_s if duration_s > 0 else float(start_clock),
            power_w=energy_j / duration_s if duration_s > 0 else start_power_w,
            power_capped=capped,
            lock_held=held,
            thermal_slowdown=hot,
        )

    def _steady(self, phases: Sequence[Phase], setpoint_w: float, clock_mhz: int) -> bool:
        """Whether nothing can move the clock during this work: it sits at its ceiling,
        neither the power reading nor any phase exceeds the setpoint there, and no
        thermal slowdown can start."""
        if not self._pinned or self._reading_w > setpoint_w:
            return False
        peak_w = max((self.model.phase_power_w(p, clock_mhz) for p in phases), default=0.0)
        if peak_w > setpoint_w:
            return False
        thermal = self.model.thermal
        return thermal is None or (
            self._thermal_ceiling_mhz == self._f_max
            and max(self._temperature_c, thermal.steady_c(peak_w)) < thermal.slowdown_c
        )

    def _run_steady(
        self, t0_s: float, phases: Sequence[Phase], clock_mhz: int, slowdown: float
    ) -> tuple[float, float]:
        """``(energy_j, duration_s)`` of work at one clock, advancing the state."""
        energy_j = duration_s = 0.0
        for phase in phases:
            if phase.blocked:
                dt_s = phase.share * t0_s
            else:
                dt_s = slowdown * self.model.work_time_s(
                    phase.share * t0_s, phase.compute_bound_share, clock_mhz
                )
            power_w = self.model.phase_power_w(phase, clock_mhz)
            energy_j += power_w * dt_s
            duration_s += dt_s
            self._relax(power_w, dt_s)
        self._now_s += duration_s
        if self._next_tick_s <= self._now_s:
            # The control instants passed kept the clock at its ceiling; the last one read
            # this work's mean power (at most the setpoint, as every phase's power is).
            passed = math.floor((self._now_s - self._next_tick_s) / self._period_s) + 1
            self._next_tick_s += passed * self._period_s
            self._reading_w = energy_j / duration_s
            self._period_j = self._reading_w * (self._now_s - self._next_tick_s + self._period_s)
        return energy_j, duration_s


def steady_run(
    model: PhysicsModel,
    t0_s: float,
    phases: Sequence[Phase],
    power_limit_w: float,
    max_clock_mhz: int | None = None,
    *,
    settle_s: float = 2.0,
    measure_s: float = 2.0,
) -> GovernedRun:
    """A piece of work repeated back to back under fixed settings, once the governor has
    settled: what a profiling window measures per repetition.

    Args:
        model: the physics model.
        t0_s: the work's duration at ``f_max`` (> 0).
        phases: its phases.
        power_limit_w: the power limit in force.
        max_clock_mhz: the upper bound of a clock lock, if any.
        settle_s: repetitions run first for at least this long, and are not measured.
        measure_s: repetitions measured for at least this long (at least one).

    Returns:
        The mean repetition: its duration, energy and power; the clock when the last one
        ended, the clock averaged over the measured ones; a reason is set when it held
        the clock back in any of them.

    Raises:
        ConfigError: ``t0_s`` is not > 0, or a phase is out of range.
    """
    problems = [] if t0_s > 0 else [f"t0_s: {t0_s!r} is not allowed; use > 0"]
    problems.extend(phase_problems(phases))
    if problems:
        raise ConfigError(problems, source="steady_run")
    governor = Governor(model, 0.0)
    now_s = 0.0
    while now_s < settle_s:
        now_s += governor.run(now_s, t0_s, phases, power_limit_w, max_clock_mhz).duration_s
    runs: list[GovernedRun] = []
    start_s = now_s
    while not runs or now_s - start_s < measure_s:
        runs.append(governor.run(now_s, t0_s, phases, power_limit_w, max_clock_mhz))
        now_s += runs[-1].duration_s
    duration_s = (now_s - start_s) / len(runs)
    energy_j = math.fsum(run.energy_j for run in runs) / len(runs)
    return GovernedRun(
        duration_s=duration_s,
        energy_j=energy_j,
        clock_mhz=runs[-1].clock_mhz,
        mean_clock_mhz=math.fsum(r.mean_clock_mhz * r.duration_s for r in runs)
        / max(now_s - start_s, 1e-300),
        power_w=energy_j / duration_s if duration_s > 0 else runs[-1].power_w,
        power_capped=any(run.power_capped for run in runs),
        lock_held=any(run.lock_held for run in runs),
        thermal_slowdown=any(run.thermal_slowdown for run in runs),
    )
