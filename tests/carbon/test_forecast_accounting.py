"""The daily-profile forecaster, the point types and the carbon ledger."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from carbon.accounting import J_PER_KWH, CarbonLedger, emissions_g
from carbon.errors import AccountingError, CarbonConfigError, CarbonError
from carbon.forecast import DailyProfileForecaster, interval_ends_s
from carbon.types import IntensityPoint, PointKind

UTC = timezone.utc
T0 = datetime(2023, 3, 1, tzinfo=UTC)


def daily(hours: int, level: float = 100.0, start: datetime = T0) -> list[IntensityPoint]:
    """Hourly points following ``level + hour of day``."""
    return [
        IntensityPoint(
            start + timedelta(hours=h), level + (start.hour + h) % 24, PointKind.MEASURED, "test"
        )
        for h in range(hours)
    ]


def test_point_normalises_time_and_kind() -> None:
    naive = IntensityPoint(datetime(2023, 1, 1, 5), 10, "forecast", "x")  # type: ignore[arg-type]
    assert naive.time == datetime(2023, 1, 1, 5, tzinfo=UTC)
    assert naive.kind is PointKind.FORECAST and naive.intensity_g_per_kwh == 10.0
    shifted = IntensityPoint(
        datetime(2023, 1, 1, 7, tzinfo=timezone(timedelta(hours=2))), 1.0, PointKind.MEASURED, "x"
    )
    assert shifted.time == datetime(2023, 1, 1, 5, tzinfo=UTC) and shifted.time.tzinfo is UTC
    assert PointKind("estimated") is PointKind.ESTIMATED and PointKind.MEASURED == "measured"


def test_profile_reproduces_a_daily_cycle() -> None:
    model = DailyProfileForecaster(level_decay_s=None).fit(daily(72))
    assert model.profile_g_per_kwh == [100.0 + h for h in range(24)]
    later = [T0 + timedelta(days=9, hours=h, minutes=30) for h in range(24)]
    assert model.predict(later) == [100.0 + h for h in range(24)]


def test_window_keeps_only_recent_days() -> None:
    old = daily(24 * 10, level=500.0)
    recent = daily(48, level=100.0, start=T0 + timedelta(days=10))
    model = DailyProfileForecaster(window_days=2, level_decay_s=None).fit(old + recent)
    assert model.profile_g_per_kwh[3] == 103.0
    everything = DailyProfileForecaster(window_days=None, level_decay_s=None).fit(old + recent)
    assert everything.profile_g_per_kwh[3] == pytest.approx((10 * 503 + 2 * 103) / 12)


def test_level_blending_decays_towards_the_profile() -> None:
    points = daily(48)
    jump = IntensityPoint(T0 + timedelta(hours=48), 300.0, PointKind.MEASURED, "test")
    model = DailyProfileForecaster(window_days=None, level_decay_s=3600.0).fit([*points, jump])
    profile_at_jump = model.profile_g_per_kwh[0]
    gap = 300.0 - profile_at_jump
    soon, later = model.predict([jump.time, jump.time + timedelta(hours=5)])
    assert soon == pytest.approx(300.0)
    assert later == pytest.approx(model.profile_g_per_kwh[5] + gap * np.exp(-5))


def test_missing_slots_are_interpolated_around_midnight() -> None:
    points = [
        IntensityPoint(T0 + timedelta(hours=2), 100.0, PointKind.MEASURED, "t"),
        IntensityPoint(T0 + timedelta(hours=22), 200.0, PointKind.MEASURED, "t"),
    ]
    profile = DailyProfileForecaster(level_decay_s=None).fit(points).profile_g_per_kwh
    assert profile[2] == 100.0 and profile[22] == 200.0
    assert profile[12] == pytest.approx(150.0)
    assert profile[0] == pytest.approx(150.0)  # 22 -> 2 across midnight, halfway
    single = DailyProfileForecaster().fit(points[:1]).profile_g_per_kwh
    assert single == [100.0] * 24


def test_extend_a_short_forecast() -> None:
    model = DailyProfileForecaster(level_decay_s=None).fit(daily(48))
    start = T0 + timedelta(days=2)
    given = [
        IntensityPoint(start + timedelta(hours=h), 50.0, PointKind.FORECAST, "provider")
        for h in range(3)
    ]
    extended = model.extend(given, until=start + timedelta(hours=6), step_s=3600)
    assert extended[:3] == given
    assert [p.time.hour for p in extended] == [0, 1, 2, 3, 4, 5]
    assert [p.intensity_g_per_kwh for p in extended[3:]] == [103.0, 104.0, 105.0]
    assert {p.kind for p in extended[3:]} == {PointKind.FORECAST}
    assert extended[3].source == "forecast:daily-profile"
    from_nothing = model.extend([], until=start + timedelta(hours=2), step_s=1800, start=start)
    assert [p.time for p in from_nothing] == [start + timedelta(minutes=30 * k) for k in range(4)]
    assert model.extend(given, until=start, step_s=3600) == given
    with pytest.raises(ValueError):
        model.extend(given, until=start, step_s=0)


def test_forecaster_errors() -> None:
    with pytest.raises(CarbonError, match="not fitted"):
        DailyProfileForecaster().predict([T0])
    with pytest.raises(CarbonError, match="empty"):
        DailyProfileForecaster().fit([])
    with pytest.raises(CarbonConfigError, match="slot_s"):
        DailyProfileForecaster(slot_s=7 * 3600)


def test_interval_ends_follow_each_row() -> None:
    """30 min rows, then 15 min rows, then a 2 h gap: each value holds until the next
    row; the last one for its own step. No 'typical period'."""
    times = np.array([0.0, 1800.0, 3600.0, 4500.0, 5400.0, 12600.0, 13500.0])
    assert interval_ends_s(times).tolist() == [
        1800.0,
        3600.0,
        4500.0,
        5400.0,
        12600.0,
        13500.0,
        14400.0,
    ]
    assert interval_ends_s(np.array([7.0]), default_s=60.0).tolist() == [67.0]
    assert interval_ends_s(np.array([7.0, 7.0]), default_s=60.0).tolist() == [7.0, 67.0]
    assert interval_ends_s(np.array([])).size == 0


def test_profile_weighs_rows_by_the_time_they_cover() -> None:
    """Day 1 at 30 min rows (value 100), day 2 at 15 min rows (value 200): each day
    counts the same in the hourly profile, however many rows it has."""
    day1 = [(T0 + timedelta(minutes=30 * k), 100.0) for k in range(48)]
    day2 = [(T0 + timedelta(days=1, minutes=15 * k), 200.0) for k in range(96)]
    points = [IntensityPoint(t, v, PointKind.MEASURED, "x") for t, v in day1 + day2]
    model = DailyProfileForecaster(level_decay_s=None).fit(points)
    assert model.profile_g_per_kwh == pytest.approx([150.0] * 24)


# -- accounting -------------------------------------------------------------------------


def test_emissions_formula() -> None:
    assert J_PER_KWH == 3.6e6
    assert emissions_g(3.6e6, 250.0) == 250.0
    assert emissions_g(0.0, 900.0) == 0.0
    assert emissions_g(1.8e6, 100.0) == pytest.approx(50.0)


def test_ledger_matches_a_hand_computation() -> None:
    # 300 W for 2 h at 250 g/kWh: 0.6 kWh -> 150 g
    # 150 W for 30 min at 80 g/kWh: 0.075 kWh -> 6 g
    # 400 W for 15 min at 420 g/kWh: 0.1 kWh -> 42 g
    ledger = CarbonLedger()
    t = T0
    ledger.add(t, t + timedelta(hours=2), 300 * 7200, 250.0, source="trace:CISO")
    t += timedelta(hours=2)
    ledger.add(t, t + timedelta(minutes=30), 150 * 1800, 80.0)
    t += timedelta(minutes=30)
    ledger.add(t, t + timedelta(minutes=15), 400 * 900, 420.0)
    assert [e.emissions_g for e in ledger.entries] == pytest.approx([150.0, 6.0, 42.0])
    assert ledger.total_emissions_g == pytest.approx(198.0)
    assert ledger.total_energy_j == pytest.approx(0.775 * 3.6e6)
    assert ledger.mean_intensity_g_per_kwh == pytest.approx(198.0 / 0.775)
    report = ledger.to_dict()
    assert report["total_emissions_g"] == pytest.approx(198.0)
    first = report["intervals"][0]
    assert first == {
        "start": "2023-03-01T00:00:00+00:00",
        "end": "2023-03-01T02:00:00+00:00",
        "duration_s": 7200.0,
        "energy_j": 2160000.0,
        "intensity_g_per_kwh": 250.0,
        "emissions_g": 150.0,
        "source": "trace:CISO",
    }


def test_spanning_interval_is_split_at_intensity_changes() -> None:
    points = [
        IntensityPoint(T0 + timedelta(hours=h), v, PointKind.MEASURED, "t")
        for h, v in enumerate([100.0, 300.0, 50.0])
    ]
    ledger = CarbonLedger()
    # 1 kWh spread evenly over 00:30 .. 02:30: 0.25 kWh at 100, 0.5 at 300, 0.25 at 50
    entries = ledger.add_spanning(
        T0 + timedelta(minutes=30), T0 + timedelta(hours=2, minutes=30), 3.6e6, points
    )
    assert [e.intensity_g_per_kwh for e in entries] == [100.0, 300.0, 50.0]
    assert [e.duration_s for e in entries] == [1800.0, 3600.0, 1800.0]
    assert ledger.total_emissions_g == pytest.approx(0.25 * 100 + 0.5 * 300 + 0.25 * 50)
    assert ledger.total_energy_j == pytest.approx(3.6e6)


def test_ledger_rejects_bad_intervals() -> None:
    ledger = CarbonLedger()
    with pytest.raises(AccountingError) as info:
        ledger.add(T0, T0 - timedelta(seconds=1), -5.0, float("nan"))
    message = str(info.value)
    assert "before start" in message and "energy_j" in message and "intensity" in message
    with pytest.raises(AccountingError):
        ledger.add_spanning(T0, T0 + timedelta(hours=1), 1.0, [])
    assert ledger.entries == [] and ledger.mean_intensity_g_per_kwh is None
