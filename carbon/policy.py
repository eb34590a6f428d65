"""Carbon-aware pacing: how fast to train now, given grid carbon intensity and a deadline.

A policy turns the current intensity, its forecast, the job's remaining steps and deadline
and the job's energy-time frontier (:class:`~carbon.planning.OperatingPoint`, e.g. one per
GPU power limit) into a :class:`PacingDecision`: a target time per step as a ``scale >= 1``
of the fastest step time, or "pause now" when the user allows pausing. The training side
then picks the least-energy setting that meets the target. Three policies, by name:

- ``static``: carbon-unaware; the point the energy optimizer selected, or by default the
  least-energy constant pace that meets the deadline.
- ``threshold``: in the spirit of Chase (Yang et al., 2023): compare the current intensity
  with the forecast for the next interval; speed up while the extra energy of going faster
  now, at today's intensity, costs less than doing that work later at the least-energy
  point; pause (when allowed) while now is clearly dirtier than what comes next.
- ``forecast``: plan every interval up to the deadline to emit the least carbon
  (:func:`~carbon.planning.plan_steps`), re-planned at every call; a missing or short
  forecast is continued by a daily-profile forecaster learnt from the intensities seen.

Every policy keeps the deadline: it never lets the job fall so far behind that full speed
could not finish in time (with a small reserve), and runs at full speed when behind.

Example:
    >>> from datetime import datetime, timedelta, timezone
    >>> now = datetime(2023, 1, 1, tzinfo=timezone.utc)
    >>> policy = make_policy("forecast", allow_pause=True)
    >>> progress = JobProgress(remaining_steps=3600, now=now, deadline=now + timedelta(hours=3))
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
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from carbon.errors import CarbonConfigError
from carbon.forecast import DailyProfileForecaster
from carbon.planning import (
    OperatingPoint,
    deadline_from_max_slowdown,
    frontier_from_profile,
    plan_steps,
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


@dataclass(frozen=True)
class JobProgress:
    """Where the job stands.

    Attributes:
        remaining_steps: training steps still to do (>= 0).
        now: the current time (naive means UTC).
        deadline: when the job must be done (naive means UTC).

    Raises:
        CarbonConfigError: if ``remaining_steps`` is negative.
    """

    remaining_steps: int
    now: datetime
    deadline: datetime

    def __post_init__(self) -> None:
        if self.remaining_steps < 0:
            raise CarbonConfigError(f"remaining_steps: must be >= 0; got {self.remaining_steps!r}")
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


class _Outlook:
    """The intensity the policies expect: the current value, then the forecast, then a
    daily profile learnt from what was seen (history and forecast)."""

    def __init__(self, forecaster: DailyProfileForecaster, history_s: float) -> None:
        self._forecaster = forecaster
        self._history_s = history_s
        self._history: dict[float, float] = {}
        self._oldest_s = math.inf

    def record(self, time_s: float, value: float) -> None:
        self._history[time_s] = value
        self._oldest_s = min(self._oldest_s, time_s)
        horizon = time_s - self._history_s
        if self._oldest_s < horizon - 0.1 * self._history_s:
            self._history = {t: v for t, v in self._history.items() if t >= horizon}
            self._oldest_s = min(self._history)

    def means(
        self,
        now_s: float,
        intensity_now: float,
        forecast: Sequence[IntensityPoint],
        edges_s: FloatArray,
        step_s: float,
    ) -> FloatArray:
        """Mean expected intensity over each ``[edges_s[i], edges_s[i + 1])``."""
        ahead = sorted(
            (p.time.timestamp(), p.intensity_g_per_kwh)
            for p in forecast
            if p.time.timestamp() > now_s
        )
        knot_t = np.array([now_s] + [t for t, _ in ahead], dtype=np.float64)
        knot_v = np.array([intensity_now] + [v for _, v in ahead], dtype=np.float64)
        spacing = float(np.median(np.diff(knot_t[1:]))) if len(ahead) > 1 else step_s
        known_until = knot_t[-1] + spacing
        if known_until < edges_s[-1]:
            ext_t = np.arange(known_until, edges_s[-1], step_s, dtype=np.float64)
            self._fit(knot_t, knot_v)
            knot_t = np.concatenate([knot_t, ext_t])
            knot_v = np.concatenate([knot_v, self._forecaster.predict_arrays(ext_t)])
        cum = np.concatenate([[0.0], np.cumsum(knot_v[:-1] * np.diff(knot_t))])
        k = np.searchsorted(knot_t, edges_s, side="right") - 1
        integral = cum[k] + knot_v[k] * (edges_s - knot_t[k])
        return np.diff(integral) / np.diff(edges_s)

    def _fit(self, knot_t: FloatArray, knot_v: FloatArray) -> None:
        past = [(t, v) for t, v in self._history.items() if t < knot_t[0]]
        times = np.concatenate([np.array([t for t, _ in past], dtype=np.float64), knot_t])
        values = np.concatenate([np.array([v for _, v in past], dtype=np.float64), knot_v])
        self._forecaster.fit_arrays(times, values)


class _BasePolicy(ABC):
    """Shared machinery: the frontier, the history, and the deadline guard."""

    name: ClassVar[str] = ""

    def __init__(
        self,
        *,
        allow_pause: bool,
        interval_s: float,
        reserve_fraction: float,
        forecaster: DailyProfileForecaster | None,
        history_s: float,
    ) -> None:
        self.allow_pause = allow_pause
        self.interval_s = interval_s
        self.reserve_fraction = reserve_fraction
        self._outlook = _Outlook(forecaster or DailyProfileForecaster(), history_s)
        self._hull_key: tuple[OperatingPoint, ...] = ()
        self._hull: tuple[OperatingPoint, ...] = ()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(allow_pause={self.allow_pause}, "
            f"interval_s={self.interval_s:g}, reserve_fraction={self.reserve_fraction:g})"
        )

    def observe(self, points: Sequence[IntensityPoint]) -> None:
        """Learn from past intensities (the forecast extension fits on them).

        Args:
            points: measured or estimated intensities, any order.
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
        fastest, slowest = hull[0], hull[-1]
        if steps == 0:
            return _decision(hull, 1.0 / slowest.time_per_step_s, False, "done: no steps left")
        time_left_s = progress.time_left_s - self.reserve_fraction * steps * fastest.time_per_step_s
        if time_left_s <= steps * fastest.time_per_step_s:
            return _decision(
                hull, 1.0 / fastest.time_per_step_s, False, "behind schedule: full speed"
            )
        rate, pause, reason = self._choose(
            steps, now_s, time_left_s, intensity_now_g_per_kwh, forecast, hull, idle_power_w
        )
        decision = self._guard(steps, time_left_s, rate, pause and self.allow_pause, reason, hull)
        logger.debug("%s policy: %s", self.name, decision)
        return decision

    @abstractmethod
    def _choose(
        self,
        steps: int,
        now_s: float,
        time_left_s: float,
        intensity_now: float,
        forecast: Sequence[IntensityPoint],
        hull: tuple[OperatingPoint, ...],
        idle_power_w: float,
    ) -> tuple[float, bool, str]:
        """The policy's wish: a rate in steps/s, whether to pause, and why."""

    def _guard(
        self,
        steps: int,
        time_left_s: float,
        rate: float,
        pause: bool,
        reason: str,
        hull: tuple[OperatingPoint, ...],
    ) -> PacingDecision:
        """Go at least as fast as needed for full speed to still finish after this
        interval, within the frontier's range of rates."""
        r_max = 1.0 / hull[0].time_per_step_s
        r_eff = 1.0 / hull[-1].time_per_step_s
        span_s = min(self.interval_s, time_left_s)
        needed = (steps - r_max * (time_left_s - span_s)) / span_s
        if needed > (0.0 if pause else rate):
            rate = min(max(needed, r_eff), r_max)
            return _decision(hull, rate, False, f"{reason}; sped up to keep the deadline")
        return _decision(hull, min(max(rate, r_eff), r_max), pause, reason)

    def _frontier(self, frontier: Sequence[OperatingPoint]) -> tuple[OperatingPoint, ...]:
        key = tuple(frontier)
        if key != self._hull_key:
            self._hull = frontier_from_profile(key)
            self._hull_key = key
        return self._hull

    def _pace(self, steps: int, time_left_s: float, hull: tuple[OperatingPoint, ...]) -> float:
        """The least-energy constant rate that finishes in ``time_left_s``."""
        return max(steps / time_left_s, 1.0 / hull[-1].time_per_step_s)


def _decision(
    hull: tuple[OperatingPoint, ...], rate: float, pause: bool, reason: str
) -> PacingDecision:
    fastest_s = hull[0].time_per_step_s
    scale = max(1.0, 1.0 / (rate * fastest_s))
    return PacingDecision(scale, pause, reason, scale * fastest_s)


class StaticPolicy(_BasePolicy):
    """Carbon-unaware: a fixed operating point, sped up only to keep the deadline.

    Args:
        static_point: the point the energy optimizer selected; ``None`` means the
            least-energy constant pace that meets the deadline.
        **kwargs: as for :func:`make_policy`.
    """

    name: ClassVar[str] = "static"

    def __init__(
        self,
        *,
        static_point: OperatingPoint | None = None,
        allow_pause: bool = False,
        interval_s: float = 3600.0,
        reserve_fraction: float = 0.02,
    ) -> None:
        super().__init__(
            allow_pause=allow_pause,
            interval_s=interval_s,
            reserve_fraction=reserve_fraction,
            forecaster=None,
            history_s=0.0,
        )
        self.static_point = static_point

    def _choose(
        self,
        steps: int,
        now_s: float,
        time_left_s: float,
        intensity_now: float,
        forecast: Sequence[IntensityPoint],
        hull: tuple[OperatingPoint, ...],
        idle_power_w: float,
    ) -> tuple[float, bool, str]:
        if self.static_point is not None:
            label = self.static_point.label or f"{self.static_point.time_per_step_s:g} s/step"
            return 1.0 / self.static_point.time_per_step_s, False, f"static: selected {label}"
        return self._pace(steps, time_left_s, hull), False, "static: least-energy pace"


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

    Args:
        lookahead_s: how far ahead ``J`` looks, after the current interval.
        pause_margin: how much dirtier than ``J`` now must be to pause.
        **kwargs: as for :func:`make_policy`.
    """

    name: ClassVar[str] = "threshold"

    def __init__(
        self,
        *,
        allow_pause: bool = False,
        interval_s: float = 3600.0,
        reserve_fraction: float = 0.02,
        lookahead_s: float = _DAY_S,
        pause_margin: float = 0.1,
        forecaster: DailyProfileForecaster | None = None,
        history_s: float = 7 * _DAY_S,
    ) -> None:
        super().__init__(
            allow_pause=allow_pause,
            interval_s=interval_s,
            reserve_fraction=reserve_fraction,
            forecaster=forecaster,
            history_s=history_s,
        )
        self.lookahead_s = lookahead_s
        self.pause_margin = pause_margin

    def _choose(
        self,
        steps: int,
        now_s: float,
        time_left_s: float,
        intensity_now: float,
        forecast: Sequence[IntensityPoint],
        hull: tuple[OperatingPoint, ...],
        idle_power_w: float,
    ) -> tuple[float, bool, str]:
        start_s = now_s + self.interval_s
        end_s = min(start_s + self.lookahead_s, now_s + time_left_s)
        ahead = intensity_now
        if end_s > start_s:
            edges = np.array([start_s, end_s], dtype=np.float64)
            means = self._outlook.means(now_s, intensity_now, forecast, edges, self.interval_s)
            ahead = float(means[0])
        slowest = hull[-1]
        if (
            self.allow_pause
            and intensity_now > (1.0 + self.pause_margin) * ahead
            and steps * slowest.time_per_step_s <= time_left_s - self.interval_s
        ):
            return 0.0, True, f"threshold: pause, now {intensity_now:.0f} > ahead {ahead:.0f} g/kWh"
        rates = np.array([1.0 / p.time_per_step_s for p in reversed(hull)])
        powers = np.array([p.power_w for p in reversed(hull)])
        marginal = np.diff(powers) / np.diff(rates)
        worth = int(np.sum(intensity_now * marginal <= ahead * slowest.energy_per_step_j))
        rate = max(float(rates[worth]), self._pace(steps, time_left_s, hull))
        return rate, False, f"threshold: now {intensity_now:.0f}, ahead {ahead:.0f} g/kWh"


class ForecastPolicy(_BasePolicy):
    """Plan every interval up to the deadline for the least carbon; re-plan at each call.

    The intervals are ``interval_s`` long from now to the deadline (less the reserve); their
    intensities are the current value, the forecast, and past its end a daily profile
    fitted on the intensities seen (:meth:`observe` and every call) and the forecast. The
    plan (:func:`~carbon.planning.plan_steps`) fills the cleanest intervals with the most
    efficient work first. The first interval of the plan is what to do now: its pace, or,
    when the plan does less than half an interval of least-energy work there and more
    later, a pause.

    Args:
        forecaster: continues short forecasts; a fresh
            :class:`~carbon.forecast.DailyProfileForecaster` by default.
        history_s: how much history to keep for it.
        **kwargs: as for :func:`make_policy`.
    """

    name: ClassVar[str] = "forecast"

    def __init__(
        self,
        *,
        allow_pause: bool = False,
        interval_s: float = 3600.0,
        reserve_fraction: float = 0.02,
        forecaster: DailyProfileForecaster | None = None,
        history_s: float = 7 * _DAY_S,
    ) -> None:
        super().__init__(
            allow_pause=allow_pause,
            interval_s=interval_s,
            reserve_fraction=reserve_fraction,
            forecaster=forecaster,
            history_s=history_s,
        )

    def _choose(
        self,
        steps: int,
        now_s: float,
        time_left_s: float,
        intensity_now: float,
        forecast: Sequence[IntensityPoint],
        hull: tuple[OperatingPoint, ...],
        idle_power_w: float,
    ) -> tuple[float, bool, str]:
        edges = np.append(np.arange(0.0, time_left_s, self.interval_s), time_left_s) + now_s
        intensity = self._outlook.means(now_s, intensity_now, forecast, edges, self.interval_s)
        durations = np.diff(edges)
        plan = plan_steps(
            intensity,
            durations,
            steps,
            hull,
            allow_pause=self.allow_pause,
            idle_power_w=idle_power_w,
        )
        span_s = float(durations[0])
        planned = float(plan.steps[0])
        slowest = hull[-1]
        r_eff = 1.0 / slowest.time_per_step_s
        reason = f"forecast: {planned:.0f} steps planned now, {plan.emissions_g:.0f} g to go"
        if planned >= r_eff * span_s * (1.0 - 1e-9) or steps <= r_eff * span_s:
            return max(planned / span_s, r_eff), False, reason
        if not self.allow_pause:
            return r_eff, False, reason
        # Part of this interval is planned as a pause: compare pausing all of it with working
        # all of it at the least-energy point, each followed by the best plan for the rest.
        rest = (intensity[1:], durations[1:])
        after_pause = plan_steps(*rest, steps, hull, allow_pause=True, idle_power_w=idle_power_w)
        after_run = plan_steps(
            *rest, steps - r_eff * span_s, hull, allow_pause=True, idle_power_w=idle_power_w
        )
        pause_g = intensity[0] * idle_power_w * span_s / _J_PER_KWH + after_pause.emissions_g
        run_g = intensity[0] * slowest.power_w * span_s / _J_PER_KWH + after_run.emissions_g
        return r_eff, after_pause.feasible and pause_g < run_g, reason


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
        problems.append(f"interval_s: must be a number > 0; got {interval_s!r}")
    if not (0.0 <= reserve_fraction < 1.0):
        problems.append(f"reserve_fraction: must be in [0, 1); got {reserve_fraction!r}")
    if not (math.isfinite(lookahead_s) and lookahead_s > 0):
        problems.append(f"lookahead_s: must be a number > 0; got {lookahead_s!r}")
    if not (math.isfinite(pause_margin) and pause_margin >= 0):
        problems.append(f"pause_margin: must be a number >= 0; got {pause_margin!r}")
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
    )
