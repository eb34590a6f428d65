"""Carbon-aware pacing: how fast to train now, given grid carbon intensity and a deadline.

A policy turns the current intensity, its forecast, the job's remaining steps and deadline
and the job's energy-time frontier (:class:`~carbon.planning.OperatingPoint`, e.g. one per
GPU power limit) into a :class:`PacingDecision`: a target time per step as a ``scale >= 1``
of the fastest step time, or "pause now" when the user allows pausing. The training side
then picks the least-energy setting that meets the target. Three policies, by name:

- ``static``: carbon-unaware; the point the energy optimizer selected, or by default the
  least-energy constant pace that meets the deadline.
- ``threshold``: in the spirit of Chase (Yang et al., 2023): compare the current intensity
  with the mean forecast of what comes next (a day by default); speed up while the extra
  energy of going faster now, at the current intensity, costs less than doing that work
  later at the least-energy point; pause (when allowed) while now is clearly dirtier.
- ``forecast``: plan every interval up to the deadline to emit the least carbon
  (:func:`~carbon.planning.plan_intervals`: one setting or a pause per interval, as the
  controller runs it), re-planned at every call; a missing or short
  forecast is continued by a daily-profile forecaster learnt from the intensities seen.

Every policy keeps the deadline: it never lets the job fall so far behind that full speed
could not finish in time (with a small reserve), and runs at full speed when behind.

Example:
    >>> from datetime import datetime, timedelta, timezone
    >>> now = datetime(2023, 1, 1, tzinfo=timezone.utc)
    >>> policy = make_policy("forecast", allow_pause=True)
    >>> progress = JobProgress(remaining_steps=2400, now=now, deadline=now + timedelta(hours=3))
    >>> frontier = [OperatingPoint(1.0, 300.0, "300 W"), OperatingPoint(1.2, 240.0, "200 W")]
    >>> dirty_then_clean = [IntensityPoint(now + timedelta(hours=h), v, PointKind.FORECAST, "x")
    ...                     for h, v in ((1, 500.0), (2, 50.0))]
    >>> policy.decide(progress, 500.0, dirty_then_clean, frontier).pause
    True
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from carbon.errors import CarbonConfigError
from carbon.forecast import DailyProfileForecaster
from carbon.planning import (
    IntensityOutlook,
    OperatingPoint,
    deadline_from_max_slowdown,
    efficient_points,
    executed_point,
    frontier_from_profile,
    interval_offsets,
    plan_intervals,
)
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = [
    "POLICY_NAMES",
    "ForecastPolicy",
    "JobProgress",
    "OperatingPoint",
    "PacingDecision",
    "Policy",
    "StaticPolicy",
    "ThresholdPolicy",
    "deadline_from_max_slowdown",
    "frontier_from_profile",
    "make_policy",
]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

#: The names :func:`make_policy` accepts.
POLICY_NAMES: tuple[str, ...] = ("static", "threshold", "forecast")

_DAY_S = 86400.0
_J_PER_KWH = 3.6e6
#: The pessimistic outlook looks this far around the time of day for the dirtiest value of
#: the past week, per second ahead of now (the daily pattern drifts more the further
#: ahead), up to :data:`_WORST_WINDOW_MAX_S`.
_WORST_WINDOW_PER_S = 1.0 / 8.0
_WORST_WINDOW_MAX_S = 3 * 3600.0


@dataclass(frozen=True)
class JobProgress:
    """Where the job stands.

    Attributes:
        remaining_steps: training steps still to do (>= 0).
        now: the current time (naive means UTC).
        deadline: when the job must be done (naive means UTC).
        emitted_g: grams the job has emitted since the policy's first decision, as measured
            (energy at the intensity in force); None lets the policy estimate them from its
            own decisions.

    Raises:
        CarbonConfigError: if ``remaining_steps`` or ``emitted_g`` is negative.
    """

    remaining_steps: int
    now: datetime
    deadline: datetime
    emitted_g: float | None = None

    def __post_init__(self) -> None:
        if self.remaining_steps < 0:
            raise CarbonConfigError(
                f"remaining_steps: {self.remaining_steps!r} is not allowed; use >= 0"
            )
        if self.emitted_g is not None and not (
            math.isfinite(self.emitted_g) and self.emitted_g >= 0
        ):
            raise CarbonConfigError(
                f"emitted_g: {self.emitted_g!r} is not allowed; use a finite number >= 0 or None"
            )
        object.__setattr__(self, "now", as_utc(self.now))
        object.__setattr__(self, "deadline", as_utc(self.deadline))

    @property
    def time_left_s(self) -> float:
        """Seconds until the deadline (negative once it has passed)."""
        return (self.deadline - self.now).total_seconds()


@dataclass(frozen=True)
class PacingDecision:
    """What to do until the next decision.

    Attributes:
        scale: target time per step over the fastest frontier step time (>= 1). While
            paused, the pace to resume at.
        pause: stop training until the next decision (only when pausing is allowed).
        reason: why, in words, for logs and reports.
        target_time_per_step_s: ``scale`` times the fastest step time.
    """

    scale: float
    pause: bool
    reason: str
    target_time_per_step_s: float


@runtime_checkable
class Policy(Protocol):
    """What the controller calls at every carbon poll."""

    @property
    def name(self) -> str:
        """The policy's name (one of :data:`POLICY_NAMES`)."""
        ...

    def observe(self, points: Sequence[IntensityPoint]) -> None:
        """Learn from past intensities (e.g. the monitor's history at start-up)."""
        ...

    def decide(
        self,
        progress: JobProgress,
        intensity_now_g_per_kwh: float,
        forecast: Sequence[IntensityPoint],
        frontier: Sequence[OperatingPoint],
        *,
        idle_power_w: float = 0.0,
    ) -> PacingDecision:
        """Choose the pace until the next call."""
        ...


@dataclass(frozen=True)
class _Situation:
    """What a policy decides from, with the deadline reserve already taken off."""

    steps: int
    now_s: float
    time_left_s: float
    intensity_now: float
    forecast: Sequence[IntensityPoint]
    hull: tuple[OperatingPoint, ...]
    points: tuple[OperatingPoint, ...]
    idle_power_w: float

    @property
    def r_max(self) -> float:
        """Steps per second at full speed."""
        return 1.0 / self.hull[0].time_per_step_s

    @property
    def r_eff(self) -> float:
        """Steps per second at the least-energy point."""
        return 1.0 / self.hull[-1].time_per_step_s

    @property
    def pace(self) -> float:
        """The least-energy constant rate that finishes in time."""
        return max(self.steps / self.time_left_s, self.r_eff)


@dataclass(kw_only=True, eq=False)
class _BasePolicy(ABC):
    """Shared machinery: the frontier, the history, and the deadline guard.

    Attributes (all keyword arguments of the constructors; see :func:`make_policy`):
        allow_pause: whether the policy may pause the job.
        interval_s: time between two decisions, and the planning step.
        reserve_fraction: share of the full-speed time of the remaining work kept in
            reserve before the deadline.
        forecaster: continues short forecasts; by default a
            :class:`~carbon.forecast.DailyProfileForecaster` whose level persists for a day.
        history_s: how much history to keep for the forecaster.
    """

    name: ClassVar[str] = ""
    allow_pause: bool = False
    interval_s: float = 3600.0
    reserve_fraction: float = 0.02
    forecaster: DailyProfileForecaster | None = field(default=None, repr=False)
    history_s: float = field(default=7 * _DAY_S, repr=False)
    _outlook: IntensityOutlook = field(init=False, repr=False)
    _hull_key: tuple[OperatingPoint, ...] = field(default=(), init=False, repr=False)
    _hull: tuple[OperatingPoint, ...] = field(default=(), init=False, repr=False)
    _points: tuple[OperatingPoint, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._outlook = IntensityOutlook(self.forecaster, self.history_s)

    def observe(self, points: Sequence[IntensityPoint]) -> None:
        """Learn from past intensities (the forecast extension fits on them).

        Args:
            points: measured or estimated intensities, any order (forecasts are ignored).
        """
        for p in sorted(points, key=lambda p: p.time):
            if p.kind is not PointKind.FORECAST:
                self._outlook.record(p.time.timestamp(), p.intensity_g_per_kwh)

    def decide(
        self,
        progress: JobProgress,
        intensity_now_g_per_kwh: float,
        forecast: Sequence[IntensityPoint],
        frontier: Sequence[OperatingPoint],
        *,
        idle_power_w: float = 0.0,
    ) -> PacingDecision:
        """Choose the pace until the next call (every ``interval_s``).

        Args:
            progress: remaining steps, now and the deadline.
            intensity_now_g_per_kwh: the current grid intensity.
            forecast: forecast points (those after now are used); may be empty.
            frontier: the job's operating points (the convex frontier is taken).
            idle_power_w: power drawn while paused.

        Returns:
            The decision; ``pause`` is only ever True when pausing is allowed.

        Raises:
            CarbonConfigError: if ``frontier`` is empty or malformed.
        """
        hull = self._frontier(frontier)
        now_s = progress.now.timestamp()
        self._outlook.record(now_s, intensity_now_g_per_kwh)
        steps = progress.remaining_steps
        fastest_s = hull[0].time_per_step_s
        if steps == 0:
            return _decision(hull, 1.0 / hull[-1].time_per_step_s, False, "done: no steps left")
        time_left_s = progress.time_left_s - self.reserve_fraction * steps * fastest_s
        if time_left_s <= steps * fastest_s:
            return _decision(hull, 1.0 / fastest_s, False, "behind schedule: full speed")
        situation = _Situation(
            steps,
            now_s,
            time_left_s,
            intensity_now_g_per_kwh,
            forecast,
            hull,
            self._points,
            idle_power_w,
        )
        rate, pause, reason = self._choose(situation)
        decision = self._guard(situation, rate, pause and self.allow_pause, reason)
        logger.debug("%s policy: %s", self.name, decision)
        return decision

    @abstractmethod
    def _choose(self, s: _Situation) -> tuple[float, bool, str]:
        """The policy's wish: a rate in steps/s, whether to pause, and why."""

    def _guard(self, s: _Situation, rate: float, pause: bool, reason: str) -> PacingDecision:
        """Go at least as fast as needed for full speed to still finish after this
        interval, within the frontier's range of rates."""
        span_s = min(self.interval_s, s.time_left_s)
        needed = (s.steps - s.r_max * (s.time_left_s - span_s)) / span_s
        if needed > (0.0 if pause else rate):
            rate = min(max(needed, s.r_eff), s.r_max)
            return _decision(s.hull, rate, False, f"{reason}; sped up to keep the deadline")
        return _decision(s.hull, min(max(rate, s.r_eff), s.r_max), pause, reason)

    def _frontier(self, frontier: Sequence[OperatingPoint]) -> tuple[OperatingPoint, ...]:
        key = tuple(frontier)
        if key != self._hull_key:
            self._hull = frontier_from_profile(key)
            self._points = efficient_points(key)
            self._hull_key = key
        return self._hull


def _decision(
    hull: tuple[OperatingPoint, ...], rate: float, pause: bool, reason: str
) -> PacingDecision:
    fastest_s = hull[0].time_per_step_s
    scale = max(1.0, 1.0 / (rate * fastest_s))
    return PacingDecision(scale, pause, reason, scale * fastest_s)


@dataclass(kw_only=True, eq=False)
class StaticPolicy(_BasePolicy):
    """Carbon-unaware: a fixed operating point, sped up only to keep the deadline.

    Attributes:
        static_point: the point the energy optimizer selected; ``None`` means the
            least-energy constant pace that meets the deadline. The policy never pauses.
    """

    name: ClassVar[str] = "static"
    static_point: OperatingPoint | None = None

    def _choose(self, s: _Situation) -> tuple[float, bool, str]:
        point = self.static_point
        if point is not None:
            label = point.label or f"{point.time_per_step_s:g} s/step"
            return 1.0 / point.time_per_step_s, False, f"static: selected {label}"
        return s.pace, False, "static: least-energy pace"


@dataclass(kw_only=True, eq=False)
class ThresholdPolicy(_BasePolicy):
    """Chase-like: weigh the current intensity against the forecast of what comes next.

    Let ``I`` be the current intensity and ``J`` the mean forecast over the ``lookahead_s``
    after the current interval (cut at the deadline; ``J = I`` when nothing is left after
    this interval). Work not done now is done later at the least-energy point, costing
    ``J * e_min`` per step; going one segment faster along the frontier now costs ``I * s``
    per extra step (``s`` the segment's marginal energy per step). The policy runs at the
    fastest point whose segments all satisfy ``I * s <= J * e_min`` (and at least at the
    least-energy pace that meets the deadline). With pausing allowed it pauses while
    ``I > (1 + pause_margin) * J`` and the job would still finish at its least-energy
    point after the pause.

    Attributes:
        lookahead_s: how far ahead ``J`` looks, after the current interval.
        pause_margin: how much dirtier than ``J`` now must be to pause.
    """

    name: ClassVar[str] = "threshold"
    lookahead_s: float = _DAY_S
    pause_margin: float = 0.1

    def _choose(self, s: _Situation) -> tuple[float, bool, str]:
        now = s.intensity_now
        start_s = s.now_s + self.interval_s
        end_s = min(start_s + self.lookahead_s, s.now_s + s.time_left_s)
        ahead = now
        if end_s > start_s:
            edges = np.array([start_s, end_s], dtype=np.float64)
            ahead = float(self._outlook.means(s.now_s, now, s.forecast, edges, self.interval_s)[0])
        slowest = s.hull[-1]
        if (
            self.allow_pause
            and now > (1.0 + self.pause_margin) * ahead
            and s.steps * slowest.time_per_step_s <= s.time_left_s - self.interval_s
        ):
            return 0.0, True, f"threshold: pause, now {now:.0f} > ahead {ahead:.0f} g/kWh"
        rates = np.array([1.0 / p.time_per_step_s for p in reversed(s.hull)])
        powers = np.array([p.power_w for p in reversed(s.hull)])
        marginal = np.diff(powers) / np.diff(rates)
        worth = int(np.sum(now * marginal <= ahead * slowest.energy_per_step_j))
        rate = max(float(rates[worth]), s.pace)
        return rate, False, f"threshold: now {now:.0f}, ahead {ahead:.0f} g/kWh"


@dataclass
class _Unaware:
    """The carbon-unaware run of one job, and what it and the job have emitted so far.

    The unaware run starts when the job's first decision is made, at the setting the
    least-energy constant pace that meets the deadline runs at, and never pauses. Its grams
    are counted at the intensity observed at each decision, held until the next one; the
    job's are the measured ones when the caller passes them, else estimated the same way
    from the decisions.
    """

    deadline_s: float
    power_w: float
    end_s: float
    last_s: float
    last_steps: int
    last_intensity: float
    last_energy_per_step_j: float | None = None
    last_idle_power_w: float = 0.0
    job_g: float = 0.0
    unaware_g: float = 0.0
    left: bool = False

    def account(self, now_s: float, steps: int, emitted_g: float | None) -> None:
        """Add the grams of both runs since the last decision."""
        span_s = max(now_s - self.last_s, 0.0)
        if emitted_g is not None:
            self.job_g = emitted_g
        elif self.last_energy_per_step_j is None:
            self.job_g += self.last_intensity * self.last_idle_power_w * span_s / _J_PER_KWH
        else:
            job_j = max(self.last_steps - steps, 0) * self.last_energy_per_step_j
            self.job_g += self.last_intensity * job_j / _J_PER_KWH
        unaware_s = max(min(now_s, self.end_s) - self.last_s, 0.0)
        self.unaware_g += self.last_intensity * self.power_w * unaware_s / _J_PER_KWH
        self.last_s, self.last_steps = now_s, steps


@dataclass(kw_only=True, eq=False)
class ForecastPolicy(_BasePolicy):
    """Plan every interval up to the deadline for the least carbon; re-plan at each call.

    The intervals are ``interval_s`` long from now to the deadline (less the reserve); their
    intensities are the current value, the forecast, and past its end a daily profile
    fitted on the intensities seen (:meth:`observe` and every call) and the forecast
    (:class:`~carbon.planning.IntensityOutlook`).

    Every interval is planned as it will run: one setting held for all of it (one of the
    efficient operating points, until done) or, when pausing is allowed, a pause at
    ``idle_power_w`` (charged until the job is done); the least-carbon such plan that keeps
    the deadline (:func:`~carbon.planning.plan_intervals`) gives the choice for now.

    The plan must pay. At every call the policy weighs, under the same outlook, the plan's
    grams against keeping the steady least-energy pace from now, and the job's grams so
    far (measured, when :class:`JobProgress` carries them) plus the plan's against the
    grams of the carbon-unaware run of the same job (the setting of the least-energy
    constant pace that met the deadline when the job started, never pausing), counted
    over the same past and the same outlook. A plan is followed only if it saves at least
    ``min_saving`` (a share) on both counts, under the outlook and under a pessimistic one
    past the forecast. When the plan for the outlook does not, the plan for the
    pessimistic outlook is weighed the same way: it moves work only where that pays even
    if the hours past the forecast are as dirty as the past week allows (pausing through
    the dirtiest forecast hours, not through those that are merely dirtier than the
    profile). When neither pays, the job runs at the carbon-unaware pace (or faster, when
    that is needed to keep the deadline). When even the steady pace cannot bring a job
    that is behind back under the carbon-unaware run, only the first count applies: a plan
    is then followed only if it loses less than the steady pace under both outlooks.

    Attributes:
        min_saving: the predicted share of emissions a plan must save to be followed.
    """

    name: ClassVar[str] = "forecast"
    min_saving: float = 0.002
    _unaware: _Unaware | None = field(default=None, init=False, repr=False)

    def decide(
        self,
        progress: JobProgress,
        intensity_now_g_per_kwh: float,
        forecast: Sequence[IntensityPoint],
        frontier: Sequence[OperatingPoint],
        *,
        idle_power_w: float = 0.0,
    ) -> PacingDecision:
        """Choose the pace until the next call (see :meth:`_BasePolicy.decide`), keeping
        the account of the job against its carbon-unaware run."""
        now_s = progress.now.timestamp()
        deadline_s = progress.deadline.timestamp()
        steps = progress.remaining_steps
        unaware = self._unaware
        if unaware is None or unaware.deadline_s != deadline_s or steps > unaware.last_steps:
            unaware = self._unaware = self._start_unaware(progress, frontier)
        else:
            unaware.account(now_s, steps, progress.emitted_g)
        decision = super().decide(
            progress, intensity_now_g_per_kwh, forecast, frontier, idle_power_w=idle_power_w
        )
        unaware.left = unaware.left or decision.pause or "carbon-unaware" not in decision.reason
        unaware.last_intensity = intensity_now_g_per_kwh
        unaware.last_idle_power_w = idle_power_w
        unaware.last_energy_per_step_j = (
            None
            if decision.pause
            else executed_point(self._points, decision.target_time_per_step_s).energy_per_step_j
        )
        return decision

    def _start_unaware(self, progress: JobProgress, frontier: Sequence[OperatingPoint]) -> _Unaware:
        hull = self._frontier(frontier)
        steps = progress.remaining_steps
        time_left_s = progress.time_left_s - self.reserve_fraction * steps * hull[0].time_per_step_s
        rate = 1.0 / hull[0].time_per_step_s
        if time_left_s > 0:
            rate = min(max(steps / time_left_s, 1.0 / hull[-1].time_per_step_s), rate)
        point = executed_point(self._points, 1.0 / rate)
        now_s = progress.now.timestamp()
        return _Unaware(
            deadline_s=progress.deadline.timestamp(),
            power_w=point.power_w,
            end_s=now_s + steps * point.time_per_step_s,
            last_s=now_s,
            last_steps=steps,
            last_intensity=0.0,
        )

    def _choose(self, s: _Situation) -> tuple[float, bool, str]:
        offsets = interval_offsets(s.time_left_s, self.interval_s)
        edges = offsets + s.now_s
        intensity = self._outlook.means(
            s.now_s, s.intensity_now, s.forecast, edges, self.interval_s
        )
        durations = np.diff(edges)
        steady = executed_point(s.points, 1.0 / s.pace)
        steady_s = np.clip(s.steps * steady.time_per_step_s - offsets[:-1], 0.0, durations)
        steady_j = steady_s * steady.power_w
        unaware = self._unaware
        unaware_j, past_job_g, past_unaware_g = steady_j, 0.0, 0.0
        if unaware is not None:
            unaware_j = np.clip(unaware.end_s - edges[:-1], 0.0, durations) * unaware.power_w
            past_job_g, past_unaware_g = unaware.job_g, unaware.unaware_g
        keep = 1.0 - self.min_saving
        pessimistic = self._pessimistic(s, edges, intensity)

        def pays(plan_j: FloatArray) -> bool:
            for outlook in (intensity, pessimistic):
                plan_g = float(outlook @ plan_j) / _J_PER_KWH
                steady_g = float(outlook @ steady_j) / _J_PER_KWH
                unaware_g = past_unaware_g + float(outlook @ unaware_j) / _J_PER_KWH
                recoverable = past_job_g + steady_g <= unaware_g
                if plan_g >= keep * steady_g or (
                    recoverable and past_job_g + plan_g >= keep * unaware_g
                ):
                    return False
            return True

        # The plan for the outlook; if it does not pay under both outlooks, the plan for
        # the pessimistic one, which only moves work where that pays even then.
        outlooks = [intensity]
        if not np.array_equal(pessimistic, intensity):
            outlooks.append(pessimistic)
        for planned_on in outlooks:
            plan = self._plan_interval(s, planned_on, durations)
            if plan is None or not pays(plan[2]):
                continue
            rate, pause, plan_j = plan
            plan_g = float(intensity @ plan_j) / _J_PER_KWH
            robust = " (robust plan)" if planned_on is pessimistic else ""
            if pause:
                return s.r_eff, True, f"forecast: pause, {plan_g:.0f} g to go{robust}"
            label = executed_point(s.points, 1.0 / rate).label or f"{rate:.4g} steps/s"
            return rate, False, f"forecast: {label} now, {plan_g:.0f} g to go{robust}"
        return s.pace, False, "forecast: carbon-unaware pace, a plan would not pay"

    def _plan_interval(
        self, s: _Situation, intensity: FloatArray, durations: FloatArray
    ) -> tuple[float, bool, FloatArray] | None:
        """The least-carbon run holding one efficient point or a pause in every interval
        (:func:`~carbon.planning.plan_intervals`): (rate now, pause now, energy of each
        interval), None if nothing keeps the deadline."""
        plan = plan_intervals(
            intensity,
            durations,
            s.steps,
            s.points,
            allow_pause=self.allow_pause,
            idle_power_w=s.idle_power_w,
        )
        if not plan.feasible:
            return None
        choice = int(plan.choices[0])
        if choice < 0:
            return s.r_eff, True, plan.energy_j
        return 1.0 / s.points[choice].time_per_step_s, False, plan.energy_j

    def _pessimistic(self, s: _Situation, edges: FloatArray, intensity: FloatArray) -> FloatArray:
        """The outlook with every interval past the forecast at the dirtiest value seen
        around that time of day over the past week (or, with no such history, the dirtiest
        value now or forecast): the plan must pay even if the daily profile is optimistic,
        and even if the day's peaks come a little earlier or later than last week's. The
        window around the time of day grows with the time ahead (an eighth of it, at most
        3 h)."""
        ahead = [p.time.timestamp() for p in s.forecast if p.time.timestamp() > s.now_s]
        known = edges[:-1] < max(ahead, default=s.now_s) + self.interval_s
        window_s = np.minimum((edges[:-1] - s.now_s) * _WORST_WINDOW_PER_S, _WORST_WINDOW_MAX_S)
        worst = self._outlook.worst_same_time_of_day(edges[:-1], window_s=window_s)
        worst = np.where(np.isnan(worst), float(intensity[known].max()), worst)
        return np.where(known, intensity, np.maximum(worst, intensity))


def make_policy(
    name: str,
    *,
    allow_pause: bool = False,
    interval_s: float = 3600.0,
    reserve_fraction: float = 0.02,
    static_point: OperatingPoint | None = None,
    forecaster: DailyProfileForecaster | None = None,
    lookahead_s: float = _DAY_S,
    pause_margin: float = 0.1,
    min_saving: float = 0.002,
) -> Policy:
    """Build a policy by name, checking every option at once.

    Args:
        name: ``"static"``, ``"threshold"`` or ``"forecast"`` (case-insensitive).
        allow_pause: whether the job may be paused (``carbon.allow_pause``).
        interval_s: time between two decisions (the monitor's poll) and the planning step.
        reserve_fraction: share of the full-speed time of the remaining work kept in reserve
            before the deadline (absorbs step-time noise).
        static_point: ``static`` only: the point the energy optimizer selected.
        forecaster: ``threshold``/``forecast``: what continues a short forecast.
        lookahead_s: ``threshold`` only: how far ahead to compare (default one day).
        pause_margin: ``threshold`` only: how much dirtier now must be to pause.
        min_saving: ``forecast`` only: the predicted share of emissions a plan must save
            before the policy leaves the steady least-energy pace.

    Returns:
        The policy.

    Raises:
        CarbonConfigError: listing every bad option (an unknown name lists the allowed ones).

    Example:
        >>> make_policy("threshold", allow_pause=True).name
        'threshold'
    """
    key = name.strip().lower() if isinstance(name, str) else name
    problems = []
    if key not in POLICY_NAMES:
        problems.append(f"policy: unknown policy {name!r}; allowed: {', '.join(POLICY_NAMES)}")
    if not (math.isfinite(interval_s) and interval_s > 0):
        problems.append(f"interval_s: {interval_s!r} is not allowed; use a number > 0")
    if not (0.0 <= reserve_fraction < 1.0):
        problems.append(
            f"reserve_fraction: {reserve_fraction!r} is not allowed; use a number in [0, 1)"
        )
    if not (math.isfinite(lookahead_s) and lookahead_s > 0):
        problems.append(f"lookahead_s: {lookahead_s!r} is not allowed; use a number > 0")
    if not (math.isfinite(pause_margin) and pause_margin >= 0):
        problems.append(f"pause_margin: {pause_margin!r} is not allowed; use a number >= 0")
    if not (0.0 <= min_saving < 1.0):
        problems.append(f"min_saving: {min_saving!r} is not allowed; use a number in [0, 1)")
    if problems:
        raise CarbonConfigError(problems)
    if key == "static":
        return StaticPolicy(
            static_point=static_point,
            allow_pause=allow_pause,
            interval_s=interval_s,
            reserve_fraction=reserve_fraction,
        )
    if key == "threshold":
        return ThresholdPolicy(
            allow_pause=allow_pause,
            interval_s=interval_s,
            reserve_fraction=reserve_fraction,
            lookahead_s=lookahead_s,
            pause_margin=pause_margin,
            forecaster=forecaster,
        )
    return ForecastPolicy(
        allow_pause=allow_pause,
        interval_s=interval_s,
        reserve_fraction=reserve_fraction,
        forecaster=forecaster,
        min_saving=min_saving,
    )
