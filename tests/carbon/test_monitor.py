"""CarbonMonitor: background polling, outages, fallbacks, lifecycle."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest

from carbon.errors import CarbonConfigError, ProviderUnavailableError, QuotaError
from carbon.monitor import CarbonMonitor
from carbon.providers.trace import TraceProvider, load_trace
from carbon.types import IntensityPoint, PointKind, ReadingStatus

UTC = timezone.utc
T0 = datetime(2023, 6, 1, tzinfo=UTC)


class Clock:
    """A virtual clock in epoch seconds."""

    def __init__(self, start: datetime = T0) -> None:
        self.t = start.timestamp()

    def __call__(self) -> float:
        return self.t

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.t, tz=UTC)


class ScriptedProvider:
    """Hourly values ``100 + hour of day`` at the clock's time; fails while ``down``."""

    name = "scripted"
    region = "test"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.down = False
        self.latest_calls = 0
        self.polled = threading.Event()
        self.gate: threading.Event | None = None

    def _point(self, t: datetime, kind: PointKind) -> IntensityPoint:
        hour = t.replace(minute=0, second=0, microsecond=0)
        return IntensityPoint(hour, 100.0 + hour.hour, kind, "scripted:test")

    def latest(self) -> IntensityPoint:
        if self.gate is not None:
            self.gate.wait(timeout=10)
        self.latest_calls += 1
        self.polled.set()
        if self.down:
            raise ProviderUnavailableError("down", provider=self.name, operation="latest")
        return self._point(self.clock.now(), PointKind.MEASURED)

    def history(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        if self.down:
            raise ProviderUnavailableError("down", provider=self.name, operation="history")
        hours = int((end - start).total_seconds() // 3600)
        return [self._point(start + timedelta(hours=h), PointKind.MEASURED) for h in range(hours)]

    def forecast(self, horizon_s: float | None = None) -> list[IntensityPoint]:
        if self.down:
            raise ProviderUnavailableError("down", provider=self.name, operation="forecast")
        now = self.clock.now()
        return [self._point(now + timedelta(hours=h), PointKind.FORECAST) for h in range(4)]


def monitor_records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "carbon.monitor" and r.levelno == level]


def test_outage_keeps_last_value_then_falls_back_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    clock = Clock()
    provider = ScriptedProvider(clock)
    monitor = CarbonMonitor(
        provider,
        poll_interval_s=300,
        max_staleness_s=3600,
        fallback_g_per_kwh=444.0,
        seed_history_s=0,
        clock=clock,
    )
    reading = monitor.poll_now()
    assert (reading.intensity_g_per_kwh, reading.status) == (100.0, ReadingStatus.FRESH)
    good_time = reading.time
    provider.down = True
    statuses = []
    for _ in range(30):  # 30 failed polls, 2.5 h
        clock.t += 300
        reading = monitor.poll_now()
        statuses.append(reading.status)
        if reading.status is ReadingStatus.STALE:
            assert reading.intensity_g_per_kwh == 100.0 and reading.time == good_time
        else:
            assert reading.intensity_g_per_kwh == 444.0
            assert reading.source == "fallback:constant" and reading.time is None
    assert statuses[:12] == [ReadingStatus.STALE] * 12  # up to 3600 s old
    assert statuses[12:] == [ReadingStatus.FALLBACK] * 18
    assert monitor.in_outage
    warnings = monitor_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
    assert "constant fallback" in warnings[0].getMessage()
    provider.down = False
    for _ in range(3):
        clock.t += 300
        reading = monitor.poll_now()
    assert reading.status is ReadingStatus.FRESH and reading.intensity_g_per_kwh == 102.0
    infos = monitor_records(caplog, logging.INFO)
    assert len(infos) == 1 and "available again" in infos[0].getMessage()
    assert "30 failed polls" in infos[0].getMessage()
    assert len(monitor_records(caplog, logging.WARNING)) == 1


def test_daily_fallback_uses_the_history_seen() -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)
    monitor = CarbonMonitor(
        provider,
        poll_interval_s=3600,
        max_staleness_s=3600,
        fallback="daily",
        seed_history_s=2 * 86400,
        clock=clock,
    )
    monitor.poll_now()
    assert len(monitor.history()) == 49  # 48 seeded hours + the latest value
    provider.down = True
    clock.t += 5 * 3600 + 600  # 05:10, last good value 5 h old
    reading = monitor.poll_now()
    assert reading.status is ReadingStatus.FALLBACK and reading.source == "fallback:daily"
    assert reading.intensity_g_per_kwh == pytest.approx(105.0, abs=0.5)


def test_daily_fallback_without_history_is_the_constant() -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)
    provider.down = True
    monitor = CarbonMonitor(provider, fallback="daily", fallback_g_per_kwh=321.0, clock=clock)
    reading = monitor.poll_now()
    assert (reading.status, reading.intensity_g_per_kwh) == (ReadingStatus.FALLBACK, 321.0)
    assert reading.age_s is None


def test_forecast_and_history_in_memory() -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)
    monitor = CarbonMonitor(provider, poll_interval_s=60, seed_history_s=0, clock=clock)
    assert monitor.forecast() == [] and monitor.history() == []
    monitor.poll_now()
    assert [p.time.hour for p in monitor.forecast()] == [0, 1, 2, 3]
    clock.t += 2 * 3600 + 60  # 02:01: the 00:00 and 01:00 intervals are over
    assert [p.time.hour for p in monitor.forecast()] == [2, 3]
    for _ in range(3):
        monitor.poll_now()  # same interval: kept once
    assert [p.time.hour for p in monitor.history()] == [0, 2]


def test_waiting_for_the_first_poll() -> None:
    clock = Clock()
    monitor = CarbonMonitor(ScriptedProvider(clock), seed_history_s=0, clock=clock)
    assert monitor.wait_for_first_poll(0) is False  # none has run
    for bad in (float("nan"), float("inf"), -1.0, "1"):
        with pytest.raises(CarbonConfigError, match="timeout_s"):
            monitor.wait_for_first_poll(bad)  # type: ignore[arg-type]
    monitor.poll_now()
    assert monitor.wait_for_first_poll(0) is True


def test_history_window_is_trimmed() -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)
    monitor = CarbonMonitor(
        provider, poll_interval_s=3600, history_window_s=3 * 3600, seed_history_s=0, clock=clock
    )
    for _ in range(10):
        monitor.poll_now()
        clock.t += 3600
    assert [p.time.hour for p in monitor.history()] == [6, 7, 8, 9]


def test_background_polling_never_blocks_the_caller() -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)
    provider.gate = threading.Event()  # the "network" hangs until released
    monitor = CarbonMonitor(provider, poll_interval_s=60, fallback_g_per_kwh=250.0, clock=clock)
    with monitor:
        reading = monitor.latest()  # answered while the first poll is stuck
        assert (reading.status, reading.intensity_g_per_kwh) == (ReadingStatus.FALLBACK, 250.0)
        provider.gate.set()
        assert provider.polled.wait(timeout=10)
        for _ in range(1000):  # bounded wait for the background poll to land
            if monitor.latest().status is ReadingStatus.FRESH:
                break
            time.sleep(0.01)
        assert monitor.latest().intensity_g_per_kwh == 100.0


def test_fast_polling_and_no_thread_left_after_stop() -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)
    enough = threading.Event()

    def counting_latest() -> IntensityPoint:
        clock.t += 600  # the simulated job's clock runs fast
        point = ScriptedProvider.latest(provider)
        if provider.latest_calls >= 5:
            enough.set()
        return point

    provider.latest = counting_latest  # type: ignore[method-assign]
    monitor = CarbonMonitor(provider, poll_interval_s=0.05, max_staleness_s=0.05, clock=clock)
    monitor.start()
    assert monitor.start() is monitor and monitor.running  # idempotent
    assert enough.wait(timeout=20)
    names = [t.name for t in threading.enumerate()]
    assert any(n.startswith("APScheduler") for n in names)
    monitor.stop()
    monitor.stop()  # idempotent
    assert not monitor.running
    left = [t.name for t in threading.enumerate() if t.name.startswith(("APScheduler", "carbon"))]
    assert left == []
    assert len(monitor.history()) >= 5


def test_restart_after_stop() -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)
    monitor = CarbonMonitor(provider, poll_interval_s=60, clock=clock)
    for _ in range(2):
        provider.polled.clear()
        with monitor:
            assert provider.polled.wait(timeout=10)  # first poll at once, in the background
        assert not monitor.running


def test_replay_a_trace_with_a_virtual_clock() -> None:
    clock = Clock(datetime(2023, 1, 1, tzinfo=UTC))
    series = load_trace("DE")
    monitor = CarbonMonitor(
        TraceProvider(series, now=clock.now), poll_interval_s=1, seed_history_s=0, clock=clock
    )
    for _ in range(48):
        reading = monitor.poll_now()
        assert reading.intensity_g_per_kwh == series.at(clock.now())
        clock.t += 3600
    assert len(monitor.history()) == 48
    forecast = monitor.forecast()  # fetched at 47:00 for 72 h; 47:00 is over now
    assert forecast[0].time == clock.now() and len(forecast) == 71
    assert monitor.forecast_reach_s == 72 * 3600.0  # what the trace gave at that poll
    assert [p.intensity_g_per_kwh for p in forecast] == [series.at(p.time) for p in forecast]


def test_unexpected_provider_bug_counts_as_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)

    def broken() -> IntensityPoint:
        raise KeyError("bug")

    provider.latest = broken  # type: ignore[method-assign]
    monitor = CarbonMonitor(provider, fallback_g_per_kwh=10.0, clock=clock)
    assert monitor.poll_now().intensity_g_per_kwh == 10.0
    assert len(monitor_records(caplog, logging.WARNING)) == 1


def test_forecast_failure_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    provider = ScriptedProvider(clock)

    def no_forecast(horizon_s: float | None = None) -> list[IntensityPoint]:
        raise ProviderUnavailableError("plan", provider="scripted", operation="forecast")

    provider.forecast = no_forecast  # type: ignore[method-assign]
    monitor = CarbonMonitor(provider, seed_history_s=0, clock=clock)
    for _ in range(5):
        assert monitor.poll_now().status is ReadingStatus.FRESH
    assert len(monitor_records(caplog, logging.WARNING)) == 1
    assert monitor.forecast() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"poll_interval_s": 0}, "poll_interval_s"),
        ({"poll_interval_s": 60, "max_staleness_s": 30}, "max_staleness_s"),
        ({"fallback": "zero"}, "fallback"),
        ({"fallback_g_per_kwh": -1}, "fallback_g_per_kwh"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CarbonConfigError, match=message):
        CarbonMonitor(ScriptedProvider(Clock()), **kwargs)  # type: ignore[arg-type]


class Monotonic:
    """A monotonic clock in seconds that moves only when told to."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _wait_for_records(
    caplog: pytest.LogCaptureFixture, text: str, count: int, timeout_s: float = 20.0
) -> int:
    """Wait (bounded) until ``count`` records containing ``text`` were logged."""
    found = 0
    for _ in range(int(timeout_s / 0.01)):
        found = sum(text in r.getMessage() for r in list(caplog.records))
        if found >= count:
            break
        time.sleep(0.01)
    return found


def test_retry_after_is_honoured_across_polls(caplog: pytest.LogCaptureFixture) -> None:
    clock, mono = Clock(), Monotonic()
    provider = ScriptedProvider(clock)
    real_latest = provider.latest
    limited = {"on": True}

    def latest() -> IntensityPoint:
        point = real_latest()
        if limited["on"]:
            raise QuotaError("rate limited", retry_after_s=600.0, provider="scripted", status=429)
        return point

    provider.latest = latest  # type: ignore[method-assign]
    monitor = CarbonMonitor(
        provider,
        poll_interval_s=60,
        fallback_g_per_kwh=321.0,
        seed_history_s=0,
        clock=clock,
        monotonic=mono,
    )
    assert monitor.poll_now().intensity_g_per_kwh == 321.0
    assert provider.latest_calls == 1
    limited["on"] = False
    for _ in range(9):  # 9 polls, one a minute: the server asked for 10 minutes
        mono.t += 60
        clock.t += 60
        assert monitor.poll_now().status is ReadingStatus.FALLBACK
    assert provider.latest_calls == 1
    mono.t += 61
    reading = monitor.poll_now()
    assert provider.latest_calls == 2 and reading.status is ReadingStatus.FRESH
    assert len(monitor_records(caplog, logging.WARNING)) == 1
    assert "600 s" in monitor_records(caplog, logging.WARNING)[0].getMessage()


def test_retry_after_holds_back_the_background_polls(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="carbon.monitor")
    clock, mono = Clock(), Monotonic()  # the monotonic clock stands still: still too early
    provider = ScriptedProvider(clock)
    real_latest = provider.latest

    def latest() -> IntensityPoint:
        real_latest()
        raise QuotaError("rate limited", retry_after_s=3600.0, provider="scripted", status=429)

    provider.latest = latest  # type: ignore[method-assign]
    monitor = CarbonMonitor(
        provider, poll_interval_s=0.05, max_staleness_s=60, clock=clock, monotonic=mono
    )
    with monitor:
        held_back = _wait_for_records(caplog, "asked to wait", 5)
    assert held_back >= 5  # five scheduled polls came and went without a request
    assert provider.latest_calls == 1


def test_a_poll_outlasting_the_interval_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """A hung provider: the scheduler's per-run 'skipped' warnings do not appear; the
    monitor says it once, and once that it is back."""
    caplog.set_level(logging.DEBUG)
    clock = Clock()
    provider = ScriptedProvider(clock)
    provider.gate = threading.Event()
    monitor = CarbonMonitor(provider, poll_interval_s=0.05, max_staleness_s=60, clock=clock)
    with monitor:
        skipped = _wait_for_records(caplog, "still waiting", 10)
        provider.gate.set()
        for _ in range(2000):  # bounded wait for the hung poll to land
            if monitor.latest().status is ReadingStatus.FRESH:
                break
            time.sleep(0.01)
    assert skipped >= 10
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["carbon.monitor"], [r.getMessage() for r in warnings]
    assert "no answer" in warnings[0].getMessage()
    assert "poll_interval_s" in warnings[0].getMessage()
    assert monitor.latest().intensity_g_per_kwh == 100.0
    assert any("available again" in r.getMessage() for r in monitor_records(caplog, logging.INFO))


def test_forecast_cut_where_each_interval_ends() -> None:
    """A forecast at 30 min, then 15 min: an interval is over when the next one starts,
    not after a 'typical' step."""
    clock = Clock()
    provider = ScriptedProvider(clock)
    minutes = [0, 30, 60, 90, 120, 135, 150]

    def forecast(horizon_s: float | None = None) -> list[IntensityPoint]:
        return [
            IntensityPoint(T0 + timedelta(minutes=m), 100.0 + m, PointKind.FORECAST, "f")
            for m in minutes
        ]

    provider.forecast = forecast  # type: ignore[method-assign]
    monitor = CarbonMonitor(provider, seed_history_s=0, clock=clock)
    monitor.poll_now()
    clock.t += 140 * 60  # 02:20: the 02:00 interval ended at 02:15
    assert [p.time for p in monitor.forecast()] == [
        T0 + timedelta(minutes=135),
        T0 + timedelta(minutes=150),
    ]
    clock.t += 25 * 60  # 02:45: the last one lasts its own 15 min
    assert monitor.forecast() == []


def test_an_absurd_retry_after_holds_back_one_day_at_most() -> None:
    clock, mono = Clock(), Monotonic()
    provider = ScriptedProvider(clock)
    real_latest = provider.latest
    limited = {"on": True}

    def latest() -> IntensityPoint:
        point = real_latest()
        if limited["on"]:
            raise QuotaError("rate limited", retry_after_s=3e11, provider="scripted", status=429)
        return point

    provider.latest = latest  # type: ignore[method-assign]
    monitor = CarbonMonitor(provider, seed_history_s=0, clock=clock, monotonic=mono)
    monitor.poll_now()
    limited["on"] = False
    mono.t += 86400 - 1
    monitor.poll_now()
    assert provider.latest_calls == 1
    mono.t += 2
    assert monitor.poll_now().status is ReadingStatus.FRESH and provider.latest_calls == 2


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` came true within ``timeout_s`` (real seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def _first_value_served(monitor: CarbonMonitor, provider: ScriptedProvider) -> None:
    """Wait (bounded) for the monitor's first poll to land: the value of 00:00 served."""
    assert provider.polled.wait(timeout=10)
    assert _wait_for(lambda: monitor.latest().time == T0)


def test_a_value_past_its_interval_is_polled_again_at_once_in_the_background() -> None:
    # Hourly values and an hourly poll: the value of 00:00 must not be served until the
    # next scheduled poll, nearly an hour into the 01:00 interval. The first answer after
    # the turn comes from memory at once (the caller never waits); a background poll
    # follows at once, and then the new hour's value is served.
    clock = Clock(T0 + timedelta(minutes=10))
    provider = ScriptedProvider(clock)
    monitor = CarbonMonitor(provider, poll_interval_s=3600, seed_history_s=0, clock=clock)
    with monitor:
        _first_value_served(monitor, provider)
        provider.polled.clear()
        clock.t += 3600.0  # 01:10
        assert monitor.latest().time == T0  # from memory, no wait
        assert provider.polled.wait(timeout=10)
        assert _wait_for(lambda: monitor.latest().time == T0 + timedelta(hours=1))
        assert monitor.latest().intensity_g_per_kwh == 101.0
        assert provider.latest_calls == 2


def test_a_value_not_yet_published_is_not_chased() -> None:
    # At the turn the provider still serves the last hour (its new value is not out yet):
    # one extra poll, not one per answer; the scheduled polls pick the new value up.
    clock = Clock(T0 + timedelta(minutes=10))
    provider = ScriptedProvider(clock)
    late = provider._point(T0, PointKind.MEASURED)

    def unpublished() -> IntensityPoint:
        provider.polled.set()
        return late

    provider.latest = unpublished  # type: ignore[method-assign]
    monitor = CarbonMonitor(provider, poll_interval_s=3600, seed_history_s=0, clock=clock)
    with monitor:
        _first_value_served(monitor, provider)
        scheduler = monitor._scheduler
        assert scheduler is not None
        requested = []
        add_job = scheduler.add_job

        def spy(*args: object, **kwargs: object) -> object:
            requested.append(kwargs.get("id"))
            return add_job(*args, **kwargs)

        scheduler.add_job = spy
        provider.polled.clear()
        clock.t += 3600.0
        monitor.latest()
        assert provider.polled.wait(timeout=10)
        assert _wait_for(lambda: monitor._poll_lock.acquire(blocking=False))
        monitor._poll_lock.release()
        for _ in range(50):
            assert monitor.latest().time == T0
        assert len(requested) == 1


def test_a_scheduled_poll_meeting_a_young_poll_at_the_turn_is_no_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The value's hour turns half a second after the first poll; the poll asked for at
    # the turn is still waiting for its answer when the scheduled one comes due. That poll
    # has run for less than poll_interval_s: nothing is late, so no outage is reported.
    # The real seconds a poll has run for are read from a clock that stands still, so a
    # busy machine delaying this thread cannot age the poll past poll_interval_s.
    caplog.set_level(logging.DEBUG)
    clock = Clock(T0 + timedelta(seconds=3599.5))
    provider = ScriptedProvider(clock)
    monitor = CarbonMonitor(
        provider, poll_interval_s=2.0, seed_history_s=0, clock=clock, monotonic=lambda: 0.0
    )
    with monitor:
        _first_value_served(monitor, provider)
        provider.gate = threading.Event()
        provider.polled.clear()
        clock.t += 1.0  # past the turn
        monitor.latest()  # asks for the poll at the turn, which now hangs in the provider
        waiting = _wait_for_records(caplog, "already on its way", 1)
        provider.gate.set()
        assert _wait_for(lambda: monitor.latest().time == T0 + timedelta(hours=1))
    assert waiting >= 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not monitor_records(caplog, logging.INFO)
