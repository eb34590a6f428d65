"""The best start of a job that runs without a break (carbon.window)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from carbon.errors import CarbonConfigError
from carbon.planning import DELAY_MIN_SAVING, IntensityOutlook, interval_offsets
from carbon.types import IntensityPoint, PointKind
from carbon.window import MAX_WITHIN_S, best_start

NOW = datetime(2023, 3, 1, 6, 20, tzinfo=timezone.utc)
HOUR_S = 3600.0


def _forecast(values: list[float], first: datetime = NOW, step_s: float = HOUR_S) -> list:
    return [
        IntensityPoint(first + timedelta(seconds=k * step_s), v, PointKind.FORECAST, "f")
        for k, v in enumerate(values)
    ]


def _brute_force(
    now_g: float, forecast: list, duration_s: float, within_s: float, step_s: float
) -> list[float]:
    """g/kWh x seconds of every possible start, from the same expected intensities."""
    steps = int(np.ceil(duration_s / step_s - 1e-9))
    step = duration_s / steps
    edges = interval_offsets(within_s, step) + NOW.timestamp()
    means = IntensityOutlook().means(NOW.timestamp(), now_g, forecast, edges, step)
    fits = [k for k in range(means.size) if edges[k] + duration_s <= edges[-1] + 1e-6]
    grams = [float(means[k : k + steps] @ np.full(steps, step)) for k in fits]
    return grams


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(st.floats(0.0, 900.0), min_size=12, max_size=30),
    duration_s=st.floats(60.0, 8 * HOUR_S),
    slack_s=st.floats(0.0, 10 * HOUR_S),
    step_s=st.sampled_from([900.0, 1800.0, 3600.0]),
)
@example(  # equal grams from 09:00 on: intervals rounded at epoch magnitudes still tie
    values=[1.0, 1.0, 71.0, 0.4536] + [0.0] * 8, duration_s=60.0, slack_s=10860.0, step_s=900.0
)
def test_the_start_is_the_least_carbon_one_of_every_possible_start(
    values: list[float], duration_s: float, slack_s: float, step_s: float
) -> None:
    forecast = _forecast(values, NOW.replace(minute=0))
    within_s = duration_s + slack_s
    best = best_start(
        NOW,
        values[0],
        forecast,
        [],
        duration_s=duration_s,
        within_s=within_s,
        step_s=step_s,
        power_w=3600.0,  # 1 kWh per hour: grams are g/kWh x hours
    )
    grams = _brute_force(values[0], forecast, duration_s, within_s, step_s)
    kwh_per_s = 1.0 / 1000.0
    assert best.emissions_g == pytest.approx(min(grams) * kwh_per_s, rel=2e-6, abs=1e-9)
    assert best.now_emissions_g == pytest.approx(grams[0] * kwh_per_s, rel=1e-9, abs=1e-9)
    # the earliest start that no later one beats by more than a millionth (a tie starts now)
    first = next(
        k
        for k, g in enumerate(grams)
        if k == len(grams) - 1 or g * (1 - DELAY_MIN_SAVING) <= min(grams[k + 1 :]) + 1e-12
    )
    assert best.start_in_s / best.step_s == pytest.approx(first)
    assert best.step_s <= step_s and duration_s / best.step_s == pytest.approx(
        round(duration_s / best.step_s)
    )
    assert best.end - best.start == timedelta(seconds=duration_s)
    assert best.saved_g >= -1e-9


def test_a_clean_night_is_found_and_the_grams_are_those_of_the_power() -> None:
    values = [500.0] * 6 + [100.0] * 4 + [500.0] * 14
    best = best_start(
        NOW,
        500.0,
        _forecast(values, NOW.replace(minute=0)),
        [],
        duration_s=4 * HOUR_S,
        within_s=24 * HOUR_S,
        step_s=HOUR_S,
        power_w=2000.0,
    )
    # now is 06:20, the clean hours are 12:00-16:00; starts are whole hours from now
    assert best.start == NOW + timedelta(hours=6)
    # 12:20-16:20: 3 h 40 min at 100 g, the last 20 minutes at 500 g
    assert best.emissions_g == pytest.approx(2.0 * (100.0 * 11 / 3 + 500.0 / 3))
    assert best.now_emissions_g == pytest.approx(2.0 * 500.0 * 4)
    assert best.mean_g_per_kwh == pytest.approx(best.emissions_g / 8.0)
    assert best.beyond_forecast_s == 0.0 and best.forecast_reach_s > 17 * HOUR_S


def test_a_flat_outlook_starts_now() -> None:
    best = best_start(
        NOW,
        300.0,
        _forecast([300.0] * 30, NOW.replace(minute=0)),
        [],
        duration_s=5 * HOUR_S,
        within_s=24 * HOUR_S,
        step_s=900.0,
        power_w=1000.0,
    )
    assert best.start == NOW and best.saved_g == 0.0


def test_past_the_forecast_the_daily_profile_of_the_history_decides_and_it_is_said() -> None:
    # a week of history: clean from 01:00 to 05:00 every night, dirty otherwise
    history = [
        IntensityPoint(
            NOW - timedelta(hours=h),
            100.0 if (NOW - timedelta(hours=h)).hour in (1, 2, 3, 4) else 600.0,
            PointKind.MEASURED,
            "h",
        )
        for h in range(1, 7 * 24)
    ]
    best = best_start(
        NOW,
        600.0,
        _forecast([600.0] * 6, NOW.replace(minute=0)),
        history,
        duration_s=3 * HOUR_S,
        within_s=36 * HOUR_S,
        step_s=HOUR_S,
        power_w=1000.0,
    )
    assert best.forecast_reach_s == pytest.approx(5 * HOUR_S + 40 * 60)
    assert best.start > NOW + timedelta(hours=18)  # the next night, past the forecast
    assert best.start.hour in (0, 1, 2)
    assert best.beyond_forecast_s == 3 * HOUR_S
    assert best.emissions_g < best.now_emissions_g


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duration_s": 0.0}, "duration: 0.0 s is not allowed; use a duration of at least 60 s"),
        ({"within_s": HOUR_S}, "within: 3600.0 s is not allowed; use a duration from"),
        ({"within_s": MAX_WITHIN_S + 1}, "to 168 h"),
        ({"power_w": float("nan")}, "power_w: nan is not allowed"),
        ({"step_s": -1.0}, "step_s: -1.0 is not allowed"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, float], message: str) -> None:
    args = {"duration_s": 2 * HOUR_S, "within_s": 24 * HOUR_S, "step_s": 900.0, "power_w": 1.0}
    with pytest.raises(CarbonConfigError, match=message):
        best_start(NOW, 100.0, [], [], **{**args, **kwargs})
