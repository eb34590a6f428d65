"""CarbonMonitor.stop never waits for a poll in flight, and closes the provider."""

from __future__ import annotations

import threading
from datetime import datetime, timezone

from carbon.monitor import CarbonMonitor
from carbon.types import IntensityPoint, PointKind


class HangingProvider:
    """A carbon API that answers only when released; counts its closes."""

    name = "hanging"
    region = "test"

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        self.answered = threading.Event()
        self.closed = 0

    def latest(self) -> IntensityPoint:
        self.asked.set()
        self.release.wait(timeout=60)
        self.answered.set()
        return IntensityPoint(
            datetime(2023, 6, 1, tzinfo=timezone.utc), 100.0, PointKind.MEASURED, "hanging:test"
        )

    def forecast(self, horizon_s: float | None = None) -> list[IntensityPoint]:
        return []

    def history(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        return []

    def close(self) -> None:
        self.closed += 1


def test_stop_returns_while_a_poll_hangs_and_closes_the_provider() -> None:
    provider = HangingProvider()
    monitor = CarbonMonitor(provider, poll_interval_s=60, seed_history_s=0)
    monitor.start()
    try:
        assert provider.asked.wait(timeout=20)
        monitor.stop()
        assert not monitor.running
        assert not provider.answered.is_set()  # stop returned with the poll still in flight
        assert provider.closed == 1
    finally:
        provider.release.set()
    assert provider.answered.wait(timeout=20)
