"""The best time to start a job that runs without a break: least carbon within a window.

A job of ``duration_s`` at a constant power must be done within ``within_s`` of now. The
expected intensity of every planning step from now to that end is the one pacing plans
with (:class:`~carbon.planning.IntensityOutlook`: the current value, the forecast, then a
daily profile of the history), and the start is chosen by the pacing planner itself
(:func:`~carbon.planning.plan_intervals` with one operating point, no pause, and a
delayed start allowed), so a start that pacing would find dirtier is never proposed.

The planning steps are at most ``step_s`` long (pacing's decision interval, the carbon
monitor's ``poll_interval_s``) and divide the job into whole steps, so a start is always
a whole number of steps from now and the job's grams are exact, not rounded to a step.

Example:
    >>> from datetime import datetime, timedelta, timezone
    >>> from carbon.types import IntensityPoint, PointKind
    >>> now = datetime(2023, 1, 1, tzinfo=timezone.utc)
    >>> forecast = [IntensityPoint(now + timedelta(hours=h), v, PointKind.FORECAST, "x")
    ...             for h, v in enumerate([400.0, 400.0, 100.0, 100.0, 400.0])]
    >>> best = best_start(now, 400.0, forecast, [], duration_s=7200.0, within_s=5 * 3600.0,
    ...                   step_s=3600.0, power_w=1000.0)
    >>> best.start.hour, best.emissions_g, best.now_emissions_g
    (2, 200.0, 800.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np

from carbon.errors import CarbonConfigError
from carbon.forecast import forecast_reach_s
from carbon.planning import IntensityOutlook, OperatingPoint, interval_offsets, plan_intervals
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = ["MAX_WITHIN_S", "MIN_DURATION_S", "StartWindow", "best_start"]

#: The furthest end of a window: a week (past the forecast, a daily profile is a guess).
MAX_WITHIN_S = 7 * 86400.0
_J_PER_KWH = 3.6e6
#: The shortest job planned.
MIN_DURATION_S = 60.0


@dataclass(frozen=True)
class StartWindow:
    """The best start of a job, against starting now.

    Attributes:
        now: when the window was planned (UTC).
        start: when to start (UTC); ``now`` when nothing later is cleaner.
        end: when the job then ends.
        mean_g_per_kwh: the intensity expected over the job started at ``start``.
        now_mean_g_per_kwh: the same, started now.
        emissions_g: grams expected at ``start`` (at the power given).
        now_emissions_g: grams expected when started now.
        forecast_reach_s: how far the forecast reaches from now (0 without one); past it
            the intensities are the daily profile's.
        beyond_forecast_s: how much of the job, started at ``start``, lies past the
            forecast.
        step_s: the planning step (starts are whole steps from now).
    """

    now: datetime
    start: datetime
    end: datetime
    mean_g_per_kwh: float
    now_mean_g_per_kwh: float
    emissions_g: float
    now_emissions_g: float
    forecast_reach_s: float
    beyond_forecast_s: float
    step_s: float

    @property
    def start_in_s(self) -> float:
        """Seconds from ``now`` to ``start`` (0: start now)."""
        return (self.start - self.now).total_seconds()

    @property
    def saved_g(self) -> float:
        """Grams saved by starting at ``start`` instead of now (>= 0)."""
        return self.now_emissions_g - self.emissions_g


def best_start(
    now: datetime,
    intensity_now_g_per_kwh: float,
    forecast: Sequence[IntensityPoint],
    history: Sequence[IntensityPoint],
    *,
    duration_s: float,
    within_s: float,
    step_s: float,
    power_w: float,
) -> StartWindow:
    """The least-carbon start of a job that must end within ``within_s`` of now.

    Args:
        now: the current time (naive means UTC).
        intensity_now_g_per_kwh: the current intensity.
        forecast: forecast points (those after now are used; any order).
        history: past intensities, for the daily profile that continues the forecast.
        duration_s: how long the job runs (at least :data:`MIN_DURATION_S`).
        within_s: the job must be done this long after now (>= ``duration_s``, at most
            :data:`MAX_WITHIN_S`).
        step_s: the longest planning step (> 0): pacing's decision interval.
        power_w: the job's mean power (> 0).

    Returns:
        The best start and its grams, with those of starting now.

    Raises:
        CarbonConfigError: naming each bad argument and what is allowed.
    """
    problems = []
    if not (math.isfinite(duration_s) and duration_s >= MIN_DURATION_S):
        problems.append(
            f"duration: {duration_s!r} s is not allowed; use a duration of at least "
            f"{MIN_DURATION_S:g} s"
        )
    if not (math.isfinite(within_s) and duration_s <= within_s <= MAX_WITHIN_S):
        problems.append(
            f"within: {within_s!r} s is not allowed; use a duration from the job's duration "
            f"({duration_s:g} s) to {MAX_WITHIN_S / 3600:g} h"
        )
    if not (math.isfinite(step_s) and step_s > 0):
        problems.append(f"step_s: {step_s!r} is not allowed; use a number > 0")
    if not (math.isfinite(power_w) and power_w > 0):
        problems.append(f"power_w: {power_w!r} is not allowed; use a number > 0")
    if problems:
        raise CarbonConfigError(problems)
    now = as_utc(now)
    now_s = now.timestamp()
    steps = math.ceil(duration_s / step_s - 1e-9)
    step_s = duration_s / steps
    outlook = IntensityOutlook()
    for p in sorted(history, key=lambda p: p.time):
        if p.kind is not PointKind.FORECAST and p.time.timestamp() <= now_s:
            outlook.record(p.time.timestamp(), p.intensity_g_per_kwh)
    offsets = interval_offsets(within_s, step_s)
    edges = offsets + now_s
    intensity = outlook.means(now_s, intensity_now_g_per_kwh, forecast, edges, step_s)
    durations = np.diff(offsets)  # exact: the edges lose digits at epoch magnitudes
    job = [OperatingPoint(step_s, power_w * step_s)]

    def plan(allow_delay: bool) -> tuple[int, float]:
        result = plan_intervals(
            intensity, durations, steps, job, allow_pause=False, allow_delay=allow_delay
        )
        first = int(np.flatnonzero(result.choices >= 0)[0])
        return first, result.emissions_g

    first, grams = plan(allow_delay=True)
    _, now_grams = plan(allow_delay=False)
    start_s = float(offsets[first])
    start = now + timedelta(seconds=start_s)
    energy_kwh = power_w * duration_s / _J_PER_KWH
    reach_s = forecast_reach_s(forecast, now_s)
    return StartWindow(
        now=now,
        start=start,
        end=start + timedelta(seconds=duration_s),
        mean_g_per_kwh=grams / energy_kwh,
        now_mean_g_per_kwh=now_grams / energy_kwh,
        emissions_g=grams,
        now_emissions_g=now_grams,
        forecast_reach_s=reach_s,
        beyond_forecast_s=min(max(start_s + duration_s - reach_s, 0.0), duration_s),
        step_s=step_s,
    )
