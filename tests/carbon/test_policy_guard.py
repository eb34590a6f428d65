"""The forecast policy does not emit more than the carbon-unaware run.

Every shipped trace, 30 start days each, jobs with pausing allowed (with and without idle
power) and without: the ``forecast`` policy against ``static`` (the least-energy constant
pace that meets the deadline), both simulated hour by hour on the trace itself as the
training side runs them (one power limit held for each hour, the least energy that meets
the target; or a pause at idle power), the policy seeing a week of history and the true
next 24 hours (a perfect day-ahead forecast) or the next 48 (the whole run).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carbon.planning import efficient_points, executed_point
from carbon.policy import JobProgress, OperatingPoint, Policy, make_policy
from carbon.providers.trace import SHIPPED_TRACES, load_trace
from carbon.types import IntensityPoint, PointKind

HOUR_S = 3600.0
STARTS = 30
# ResNet-50 on ImageNet, batch size 256, on an A40 (Zeus power trace): seconds and watts of
# one step at 300, 250, 200 and 150 W (every limit, as the controller measures them).
FRONTIER = tuple(
    OperatingPoint(t, t * p, label)
    for t, p, label in (
        (3.8475, 235.0, "300 W"),
        (3.865, 215.0, "250 W"),
        (3.9095, 196.0, "200 W"),
        (4.1235, 178.0, "150 W"),
    )
)
FloatArray = npt.NDArray[np.float64]


def _hourly(name: str) -> tuple[float, FloatArray]:
    """The trace as hourly values (each hour's value held from its start)."""
    series = load_trace(name)
    times = np.asarray(series.times_s, dtype=np.float64)
    values = np.asarray(series.values_g_per_kwh, dtype=np.float64)
    first = math.ceil(times[0] / HOUR_S) * HOUR_S
    hours = np.arange(first, times[-1], HOUR_S)
    return first, values[np.searchsorted(times, hours, side="right") - 1]


def _points(first_s: float, hourly: FloatArray, lo: int, hi: int, kind: PointKind) -> list:
    return [
        IntensityPoint(
            datetime.fromtimestamp(first_s + h * HOUR_S, tz=timezone.utc),
            float(hourly[h]),
            kind,
            "t",
        )
        for h in range(lo, min(hi, hourly.size))
    ]


def _run(
    policy: Policy,
    first_s: float,
    hourly: FloatArray,
    start_h: int,
    steps: int,
    deadline_h: float,
    idle_power_w: float,
    forecast_hours: int = 24,
    frontier: tuple[OperatingPoint, ...] = FRONTIER,
) -> tuple[float, float]:
    """Grams and finish time (hours after the start) of one job run hour by hour, the
    policy seeing the true next ``forecast_hours``; each hour runs at one limit."""
    points = efficient_points(frontier)
    policy.observe(_points(first_s, hourly, start_h - 7 * 24, start_h, PointKind.MEASURED))
    start = datetime.fromtimestamp(first_s + start_h * HOUR_S, tz=timezone.utc)
    deadline = start + timedelta(hours=deadline_h)
    left, t_h, grams = float(steps), 0.0, 0.0
    while left > 1e-9:
        h = start_h + int(t_h + 1e-9)
        progress = JobProgress(math.ceil(left - 1e-9), start + timedelta(hours=t_h), deadline)
        forecast = _points(first_s, hourly, h + 1, h + 1 + forecast_hours, PointKind.FORECAST)
        decision = policy.decide(
            progress, float(hourly[h]), forecast, frontier, idle_power_w=idle_power_w
        )
        span_s = (h + 1 - start_h - t_h) * HOUR_S
        if decision.pause:
            grams += hourly[h] * idle_power_w * span_s / 3.6e6
            t_h += span_s / HOUR_S
            continue
        point = executed_point(points, decision.target_time_per_step_s * (1 + 1e-9))
        rate, power_w = 1.0 / point.time_per_step_s, point.power_w
        span_s = min(span_s, left / rate)
        grams += hourly[h] * power_w * span_s / 3.6e6
        left -= rate * span_s
        t_h += span_s / HOUR_S
    return grams, t_h


@pytest.mark.parametrize("trace", sorted(SHIPPED_TRACES))
@pytest.mark.parametrize(
    ("work_h", "slack", "allow_pause", "idle_power_w"),
    [
        (24.0, 0.5, True, 0.0),
        (24.0, 0.25, True, 30.0),
        (12.0, 0.5, True, 30.0),
        (24.0, 0.1, False, 0.0),
    ],
)
@pytest.mark.parametrize("forecast_hours", [24, 48])
def test_forecast_never_emits_more_than_carbon_unaware(
    trace: str,
    work_h: float,
    slack: float,
    allow_pause: bool,
    idle_power_w: float,
    forecast_hours: int,
) -> None:
    first_s, hourly = _hourly(trace)
    steps = round(work_h * HOUR_S / FRONTIER[0].time_per_step_s)
    deadline_h = work_h * (1.0 + slack)
    last_start = hourly.size - math.ceil(deadline_h) - 26
    worse = []
    for start_h in np.linspace(7 * 24, last_start, STARTS).astype(int):
        forecast = make_policy("forecast", allow_pause=allow_pause)
        grams, finish_h = _run(
            forecast, first_s, hourly, start_h, steps, deadline_h, idle_power_w, forecast_hours
        )
        unaware, _ = _run(make_policy("static"), first_s, hourly, start_h, steps, deadline_h, 0.0)
        assert finish_h <= deadline_h + 1e-9
        if grams > unaware * (1 + 1e-9):
            worse.append((int(start_h), grams / unaware))
    # With the whole run forecast, never; with a day-ahead forecast (the daily profile
    # continues it), at most one start in 30, by less than 0.1 %.
    if forecast_hours >= deadline_h:
        assert worse == []
    else:
        assert len(worse) <= 1
        assert all(ratio < 1.001 for _, ratio in worse)


@pytest.mark.parametrize("trace", sorted(SHIPPED_TRACES))
def test_a_long_pausing_job_with_a_day_ahead_forecast_never_emits_more_than_carbon_unaware(
    trace: str,
) -> None:
    # 72 h of work, 36 h of slack, 30 W idle: a pause now is paid back at the end of the
    # job, days past the forecast, where only the daily profile speaks; the grid there may
    # peak an hour or two off the past week's times of day.
    first_s, hourly = _hourly(trace)
    steps = round(72.0 * HOUR_S / FRONTIER[0].time_per_step_s)
    deadline_h = 72.0 * 1.5
    last_start = hourly.size - math.ceil(deadline_h) - 26
    worse = []
    for start_h in np.linspace(7 * 24, last_start, 10).astype(int):
        policy = make_policy("forecast", allow_pause=True)
        grams, finish_h = _run(policy, first_s, hourly, start_h, steps, deadline_h, 30.0)
        unaware, _ = _run(make_policy("static"), first_s, hourly, start_h, steps, deadline_h, 0.0)
        assert finish_h <= deadline_h + 1e-9
        if grams > unaware * (1 + 1e-9):
            worse.append((int(start_h), grams / unaware))
    assert worse == []


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    trace=st.sampled_from(sorted(SHIPPED_TRACES)),
    start_share=st.floats(0.0, 1.0),
    work_h=st.floats(4.0, 30.0),
    slack=st.floats(0.05, 0.8),
    allow_pause=st.booleans(),
    idle_share=st.floats(0.0, 0.4),
    spread=st.floats(0.0, 0.25),
)
def test_with_the_whole_run_forecast_the_plan_never_loses_to_carbon_unaware(
    trace: str,
    start_share: float,
    work_h: float,
    slack: float,
    allow_pause: bool,
    idle_share: float,
    spread: float,
) -> None:
    # Any trace, start, job size, slack, idle power and frontier shape (``spread``: how much
    # the slowest limit saves per step), the policy seeing the true intensity to the deadline.
    frontier = tuple(
        OperatingPoint(t * (1 + spread * k / 3) ** 0.5, t * p * (1 - spread * k / 4), f"{k}")
        for k, (t, p) in enumerate(((3.85, 235.0), (3.87, 215.0), (3.91, 196.0), (4.12, 178.0)))
    )
    idle_power_w = idle_share * min(p.power_w for p in frontier)
    first_s, hourly = _hourly(trace)
    steps = round(work_h * HOUR_S / frontier[0].time_per_step_s)
    deadline_h = work_h * (1.0 + slack)
    last_start = hourly.size - math.ceil(deadline_h) - 2
    start_h = 7 * 24 + round(start_share * (last_start - 7 * 24))
    whole_run = math.ceil(deadline_h) + 1
    policy = make_policy("forecast", allow_pause=allow_pause)
    grams, finish_h = _run(
        policy, first_s, hourly, start_h, steps, deadline_h, idle_power_w, whole_run, frontier
    )
    unaware, _ = _run(
        make_policy("static"), first_s, hourly, start_h, steps, deadline_h, 0.0, 0, frontier
    )
    assert finish_h <= deadline_h + 1e-9
    assert grams <= unaware * (1 + 1e-9)
