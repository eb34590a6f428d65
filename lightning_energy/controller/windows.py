"""The run's measurement windows, and what a failed GPU reading does to them.

Three windows are open at times: the profiling window (one power limit being measured,
paused while something other than training runs),
the logging interval (metrics, timeline, carbon) and the steps after the profile (the
savings estimate). Once a reading fails, every window is cancelled, no new one opens and
the controller is told once (it restores the GPUs and keeps training, observe-only).
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_energy.errors import DeviceError
from lightning_energy.measure import EnergyMeter, Measurement

__all__ = ["AFTER_PROFILE", "INTERVAL", "WINDOW", "Readings"]

WINDOW = "profile-window"
INTERVAL = "log-interval"
AFTER_PROFILE = "after-profile"


class Readings:
    """Named measurement windows over the run's GPUs that survive a failed reading.

    Args:
        on_lost: called once, with the error, when a reading first fails.
    """

    def __init__(self, on_lost: Callable[[DeviceError], None]) -> None:
        self._on_lost = on_lost
        self.meter: EnergyMeter | None = None
        self.error: str | None = None

    def begin(self, name: str) -> None:
        """Open a measurement window, unless readings were lost."""
        if self.meter is None or self.error is not None:
            return
        try:
            self.meter.begin(name)
        except DeviceError as exc:
            self._lose(exc)
            return
        self._check()

    def end(self, name: str) -> Measurement | None:
        """Close a measurement window; None when it is not open or the reading failed."""
        if self.meter is None or not self.meter.is_open(name):
            return None
        try:
            m = self.meter.end(name)
        except DeviceError as exc:
            self._lose(exc)
            return None
        return None if self._check() else m

    def peek(self, name: str) -> Measurement | None:
        """What a window measured so far; None when it is not open or the reading failed."""
        if self.meter is None or not self.meter.is_open(name):
            return None
        try:
            m = self.meter.peek(name)
        except DeviceError as exc:
            self._lose(exc)
            return None
        return None if self._check() else m

    def pause(self, name: str) -> None:
        """Leave out what runs from now until :meth:`resume` (nothing happens when the
        window is not open or readings were lost)."""
        if self.meter is None or not self.meter.is_open(name):
            return
        try:
            self.meter.pause(name)
        except DeviceError as exc:
            self._lose(exc)
            return
        self._check()

    def resume(self, name: str) -> None:
        """Measure a paused window again from now on."""
        if self.meter is None or not self.meter.is_open(name):
            return
        try:
            self.meter.resume(name)
        except DeviceError as exc:
            self._lose(exc)
            return
        self._check()

    def cancel(self, name: str) -> None:
        """Forget a window (nothing happens when it is not open)."""
        if self.meter is not None:
            self.meter.cancel(name)

    def is_open(self, name: str) -> bool:
        """Whether a window is open."""
        return self.meter is not None and self.meter.is_open(name)

    @property
    def last_error(self) -> DeviceError | None:
        """The meter's last failed reading (a GPU it could not read or synchronise)."""
        return self.meter.last_error if self.meter is not None else None

    def _check(self) -> bool:
        """Whether readings are lost: a GPU the meter could not read (its energy is NaN)
        or synchronise counts as a failed reading, as a raised error does."""
        error = self.last_error
        if error is not None and self.error is None:
            self._lose(error)
        return self.error is not None

    def _lose(self, exc: DeviceError) -> None:
        self.error = str(exc)
        for name in (WINDOW, INTERVAL, AFTER_PROFILE):
            self.cancel(name)
        self._on_lost(exc)
