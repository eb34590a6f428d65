"""Replaying the shipped traces and user CSV files."""

from __future__ import annotations

import csv
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from carbon.errors import CarbonConfigError, NoDataError, TraceError
from carbon.providers.base import CarbonProvider
from carbon.providers.trace import (
    SHIPPED_TRACES,
    TraceProvider,
    TraceSeries,
    load_trace,
    shipped_trace_path,
)
from carbon.types import PointKind

UTC = timezone.utc
DIRECT = "Carbon Intensity gCO₂eq/kWh (direct)"
LCA = "Carbon Intensity gCO₂eq/kWh (LCA)"


def csv_rows(name: str) -> list[dict[str, str]]:
    with shipped_trace_path(name).open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def row_time(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(
    ("name", "rows", "period_s", "time_col", "value_col"),
    [
        ("CISO", 8760, 3600.0, "Datetime (UTC)", DIRECT),
        ("DE", 8760, 3600.0, "Datetime (UTC)", DIRECT),
        ("FR", 18574, 1800.0, "Time", "Carbon Intensity"),
    ],
)
def test_shipped_trace_values_equal_the_csv_rows(
    name: str, rows: int, period_s: float, time_col: str, value_col: str
) -> None:
    series = load_trace(name)
    expected = csv_rows(name)
    assert len(series) == rows == len(expected)
    assert series.period_s == period_s
    assert series.start == row_time(expected[0][time_col])
    assert series.end == row_time(expected[-1][time_col]) + timedelta(seconds=period_s)
    rng = np.random.default_rng(7)
    for i in [0, 1, rows // 2, rows - 1, *rng.integers(0, rows, 40).tolist()]:
        t = row_time(expected[i][time_col])
        value = float(expected[i][value_col])
        assert series.at(t) == value
        assert series.at(t + timedelta(seconds=period_s / 2)) == value  # held over the interval
        (point,) = series.between(t, t + timedelta(seconds=1))
        assert point.time == t and point.intensity_g_per_kwh == value
        assert point.source == f"trace:{name}"


@pytest.mark.parametrize("name", ["CISO", "DE"])
def test_estimated_rows_and_lifecycle_column(name: str) -> None:
    expected = csv_rows(name)
    lca = load_trace(name, emission_factor="lifecycle")
    assert lca.values_g_per_kwh[0] == float(expected[0][LCA])
    series = load_trace(name)
    estimated = [i for i, r in enumerate(expected) if r["Data Estimated"] == "true"]
    assert estimated, "the shipped trace has estimated rows"
    i = estimated[0]
    t = row_time(expected[i]["Datetime (UTC)"])
    assert series.between(t, t + timedelta(hours=1))[0].kind is PointKind.ESTIMATED
    j = next(k for k in range(len(expected)) if expected[k]["Data Estimated"] == "false")
    t = row_time(expected[j]["Datetime (UTC)"])
    assert series.between(t, t + timedelta(hours=1))[0].kind is PointKind.MEASURED


def test_replay_a_year_with_a_virtual_clock() -> None:
    """Drive the provider with a simulated clock through every hour of 2023 (CISO)."""
    expected = csv_rows("CISO")
    clock = {"now": datetime(2023, 1, 1, tzinfo=UTC)}
    provider = TraceProvider(load_trace("CISO"), now=lambda: clock["now"])
    assert isinstance(provider, CarbonProvider)
    for row in expected:
        clock["now"] = row_time(row["Datetime (UTC)"]) + timedelta(minutes=59)
        point = provider.latest()
        assert point.intensity_g_per_kwh == float(row[DIRECT])
        assert point.time == row_time(row["Datetime (UTC)"])


def test_wraps_around_keeping_the_hour_of_day() -> None:
    series = load_trace("CISO")
    provider = TraceProvider(series)
    provider.set_now(datetime(2024, 1, 1, 5, 20, tzinfo=UTC))  # one year after the start
    point = provider.latest()
    assert point.time == datetime(2024, 1, 1, 5, tzinfo=UTC)  # in the caller's frame
    assert point.intensity_g_per_kwh == series.at(datetime(2023, 1, 1, 5, tzinfo=UTC))
    provider.set_now(datetime(2022, 12, 31, 23, 30, tzinfo=UTC))  # before the start
    assert provider.latest().intensity_g_per_kwh == series.at(
        datetime(2023, 12, 31, 23, tzinfo=UTC)
    )
    # history across the wrap is continuous in the caller's frame
    provider.set_now(datetime(2024, 1, 1, 2, tzinfo=UTC))
    history = provider.history(
        datetime(2023, 12, 31, 22, tzinfo=UTC), datetime(2025, 1, 1, tzinfo=UTC)
    )
    assert [p.time.hour for p in history] == [22, 23, 0, 1, 2]
    assert history[2].intensity_g_per_kwh == series.at(datetime(2023, 1, 1, tzinfo=UTC))


def test_fr_partial_last_day_is_served_then_wraps() -> None:
    series = load_trace("FR")
    provider = TraceProvider(series)
    last = datetime(2021, 1, 9, 22, 30, tzinfo=UTC)
    provider.set_now(last + timedelta(minutes=10))
    assert provider.latest().intensity_g_per_kwh == series.at(last)
    provider.set_now(series.end + timedelta(minutes=1))
    wrapped = provider.latest()
    assert wrapped.time == series.end
    assert wrapped.time.hour == 23  # the wrap period is whole days
    assert wrapped.intensity_g_per_kwh == series.at(datetime(2019, 12, 20, 23, tzinfo=UTC))


def test_perfect_forecast_is_the_future_of_the_trace() -> None:
    series = load_trace("DE")
    now = datetime(2023, 6, 1, 12, 40, tzinfo=UTC)
    provider = TraceProvider(series, now=lambda: now, forecast_horizon_s=6 * 3600)
    forecast = provider.forecast()
    assert [p.time for p in forecast] == [
        datetime(2023, 6, 1, 12, tzinfo=UTC) + timedelta(hours=k) for k in range(7)
    ]
    assert [p.intensity_g_per_kwh for p in forecast] == [series.at(p.time) for p in forecast]
    assert {p.kind for p in forecast} == {PointKind.FORECAST}
    assert len(provider.forecast(3600)) == 2  # 12:00 (containing now) and 13:00


def test_daily_forecaster_is_fitted_on_the_past_only() -> None:
    series = load_trace("CISO")
    now = datetime(2023, 7, 10, 12, tzinfo=UTC)
    perfect = TraceProvider(series, now=lambda: now).forecast(24 * 3600)
    daily = TraceProvider(series, now=lambda: now, forecaster="daily").forecast(24 * 3600)
    assert [p.time for p in daily] == [p.time for p in perfect]
    assert daily[0].intensity_g_per_kwh == pytest.approx(series.at(now))  # anchored on now
    assert [p.intensity_g_per_kwh for p in daily] != [p.intensity_g_per_kwh for p in perfect]
    actual = np.array([p.intensity_g_per_kwh for p in perfect])
    predicted = np.array([p.intensity_g_per_kwh for p in daily])
    flat = np.full_like(actual, series.at(now))
    # the solar-driven daily cycle makes the profile beat persistence over a day
    assert np.abs(predicted - actual).mean() < np.abs(flat - actual).mean()


def test_custom_csv_with_configured_columns(tmp_path: Path) -> None:
    path = tmp_path / "grid.csv"
    path.write_text(
        "when,g,other\n2024-01-01T01:00:00Z,30,x\n2024-01-01T00:00:00+00:00,10,y\n"
        "2024-01-01T02:00:00,20.5,z\n",
        encoding="utf-8",
    )
    series = load_trace(path, time_col="when", value_col="g")
    assert series.name == "grid"
    assert series.values_g_per_kwh.tolist() == [10.0, 30.0, 20.5]  # sorted by time
    assert series.at(datetime(2024, 1, 1, 2, 59, tzinfo=UTC)) == 20.5
    with pytest.raises(NoDataError):
        series.at(datetime(2024, 1, 1, 3, tzinfo=UTC))


def test_missing_columns_are_named(tmp_path: Path) -> None:
    path = tmp_path / "grid.csv"
    path.write_text("stamp,value\n2024-01-01T00:00Z,1\n2024-01-01T01:00Z,2\n", encoding="utf-8")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert len(info.value.problems) == 2
    assert "'stamp', 'value'" in str(info.value)
    with pytest.raises(TraceError, match="value_col: 'g' not found"):
        load_trace(path, time_col="stamp", value_col="g")
    assert isinstance(info.value, CarbonConfigError)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("Time,Carbon Intensity\n2024-01-01 00:00,1\n2024-01-01 00:00,2\n", "strictly increasing"),
        ("Time,Carbon Intensity\n2024-01-01 00:00,1\nyesterday,2\n", "line 3"),
        ("Time,Carbon Intensity\n2024-01-01 00:00,1\n2024-01-01 01:00,-3\n", ">= 0"),
        ("Time,Carbon Intensity\n2024-01-01 00:00,1\n", "at least 2 rows"),
        ("", "empty"),
    ],
)
def test_malformed_csv(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_unknown_names_and_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="CISO, DE, FR"):
        shipped_trace_path("XX")
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.csv")
    assert set(SHIPPED_TRACES) == {"CISO", "DE", "FR"}
    assert load_trace("ciso").name == "CISO"


def test_series_is_read_only() -> None:
    series = TraceSeries(np.array([0.0, 60.0]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError):
        series.values_g_per_kwh[0] = 5.0
    with pytest.raises(CarbonConfigError, match="forecaster"):
        TraceProvider(series, forecaster="oracle")  # type: ignore[arg-type]


# -- irregular traces: a change of resolution and a gap ----------------------------------

T_IRR = datetime(2024, 1, 1, tzinfo=UTC)
#: 30 min rows for 5 h, 15 min rows for 2 h, no rows for 3 h 15 (a gap), 15 min rows again.
IRREGULAR_MIN = [30 * k for k in range(10)] + [300 + 15 * k for k in range(8)] + [600, 615, 630]


def irregular_series(tmp_path: Path) -> TraceSeries:
    lines = ["Time,Carbon Intensity"]
    for k, m in enumerate(IRREGULAR_MIN):
        lines.append(f"{(T_IRR + timedelta(minutes=m)).isoformat()},{100 + 10 * k}")
    path = tmp_path / "irregular.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return load_trace(path)


def test_irregular_trace_rows_hold_until_the_next_row(tmp_path: Path) -> None:
    series = irregular_series(tmp_path)
    t0 = T_IRR.timestamp()
    assert series.period_s == 1800.0  # the median: 30 min, yet the last rows are 15 min
    ends_min = [(e - t0) / 60 for e in series.ends_s]
    assert ends_min == [*IRREGULAR_MIN[1:], 645.0]  # the last row lasts its own 15 min
    assert series.end == T_IRR + timedelta(minutes=645) and series.end_s == t0 + 645 * 60
    for k, m in enumerate(IRREGULAR_MIN):
        end_m = ends_min[k]
        for inside_m in (m, (m + end_m) / 2, end_m - 1 / 60):
            assert series.at(T_IRR + timedelta(minutes=inside_m)) == 100 + 10 * k
    assert series.at(T_IRR + timedelta(minutes=500)) == 100 + 10 * 17  # held across the gap
    with pytest.raises(NoDataError, match="outside"):
        series.at(series.end)
    assert series.gaps() == [(t0 + 405 * 60, t0 + 600 * 60)]
    assert load_trace("FR").gaps() == [] and load_trace("CISO").gaps() == []


def test_irregular_trace_integral_and_segments(tmp_path: Path) -> None:
    series = irregular_series(tmp_path)
    t0 = T_IRR.timestamp()
    # whole trace: each value times its own interval
    expected = sum(
        (100 + 10 * k) * (e - (t0 + m * 60))
        for k, (m, e) in enumerate(zip(IRREGULAR_MIN, series.ends_s, strict=True))
    )
    assert series.integral_g_s_per_kwh(series.start_s, series.end_s) == pytest.approx(expected)
    # from 04:50 (inside a 30 min row) to 05:20 (inside a 15 min row)
    start_s, end_s = t0 + 290 * 60, t0 + 320 * 60
    values, durations = series.segments(start_s, end_s)
    assert values.tolist() == [190.0, 200.0, 210.0]
    assert durations.tolist() == [600.0, 900.0, 300.0]
    assert series.integral_g_s_per_kwh(start_s, end_s) == pytest.approx(values @ durations)
    # across the gap, up to the very end
    values, durations = series.segments(t0 + 400 * 60, series.end_s)
    assert values.tolist() == [260.0, 270.0, 280.0, 290.0, 300.0]
    assert durations.tolist() == [300.0, 195 * 60.0, 900.0, 900.0, 900.0]
    assert series.integral_g_s_per_kwh(start_s, start_s) == 0.0
    with pytest.raises(NoDataError):
        series.integral_g_s_per_kwh(start_s, series.end_s + 1)
    with pytest.raises(NoDataError):
        series.segments(series.start_s - 1, end_s)


def test_irregular_trace_replayed_row_by_row(tmp_path: Path) -> None:
    """latest, history and forecast follow every row, and wrapping past the end goes on
    without a hole, a repeat or a stall."""
    series = irregular_series(tmp_path)
    clock = {"now": T_IRR}
    provider = TraceProvider(series, now=lambda: clock["now"])
    row_times = [T_IRR + timedelta(minutes=m) for m in IRREGULAR_MIN]
    for minute in range(0, 645, 5):
        clock["now"] = T_IRR + timedelta(minutes=minute)
        point = provider.latest()
        assert point.time == max(t for t in row_times if t <= clock["now"])
        assert point.intensity_g_per_kwh == series.at(clock["now"])
    clock["now"] = series.end - timedelta(seconds=1)
    history = provider.history(T_IRR, series.end)
    assert [p.time for p in history] == row_times
    assert [p.intensity_g_per_kwh for p in history] == series.values_g_per_kwh.tolist()
    clock["now"] = T_IRR
    forecast = provider.forecast(645 * 60)
    assert [p.time for p in forecast] == row_times and len(forecast) == len(series)
    # past the end: the trace again, shifted by its length (shorter than a day)
    assert provider.wrap_period_s == 645 * 60
    clock["now"] = T_IRR + timedelta(minutes=560)
    later = provider.forecast(24 * 3600)
    times = [p.time for p in later]
    assert times == sorted(set(times))  # strictly increasing, and it ended
    assert times[-1] >= clock["now"] + timedelta(hours=23, minutes=45)
    shift = timedelta(minutes=645)
    assert times[times.index(series.end) : times.index(series.end) + len(series)] == [
        t + shift for t in row_times
    ]
