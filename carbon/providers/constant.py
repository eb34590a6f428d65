"""A provider with one fixed intensity: for tests, offline runs and "carbon-blind" baselines."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timezone

from carbon.errors import CarbonConfigError
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = ["ConstantProvider"]


class ConstantProvider:
    """Always the same intensity, on a regular grid of ``step_s`` intervals.

    Args:
        intensity_g_per_kwh: the value (>= 0).
        region: a label for the points' source.
        step_s: the interval length of history and forecast points.
        now: the current time; the wall clock by default.

    Raises:
        CarbonConfigError: on a negative intensity or a non-positive step.

    Example:
        >>> ConstantProvider(400.0).latest().intensity_g_per_kwh
        400.0
    """

    name = "constant"

    def __init__(
        self,
        intensity_g_per_kwh: float,
        region: str = "constant",
        step_s: float = 3600.0,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        if not intensity_g_per_kwh >= 0 or math.isinf(intensity_g_per_kwh):
            raise CarbonConfigError(
                f"intensity_g_per_kwh: {intensity_g_per_kwh!r} is not allowed; "
                "use a finite number >= 0"
            )
        if step_s <= 0:
            raise CarbonConfigError(f"step_s: {step_s!r} is not allowed; use > 0")
        self.intensity_g_per_kwh = float(intensity_g_per_kwh)
        self._region = region
        self.step_s = float(step_s)
        self._now = now

    @property
    def region(self) -> str:
        """The label given at construction."""
        return self._region

    def __repr__(self) -> str:
        return f"ConstantProvider(intensity_g_per_kwh={self.intensity_g_per_kwh!r})"

    def latest(self) -> IntensityPoint:
        """The value, timed at the start of the current step."""
        return self._point(self._floor(self._clock().timestamp()), PointKind.ESTIMATED)

    def history(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        """One point per step starting in ``[start, end)``, up to now."""
        end_s = min(as_utc(end).timestamp(), self._clock().timestamp() + 1e-9)
        first_s = math.ceil(as_utc(start).timestamp() / self.step_s) * self.step_s
        count = max(0, math.ceil((end_s - first_s) / self.step_s))
        return [self._point(first_s + k * self.step_s, PointKind.ESTIMATED) for k in range(count)]

    def forecast(self, horizon_s: float | None = None) -> list[IntensityPoint]:
        """One point per step from the current one to now + ``horizon_s`` (24 h default)."""
        now_s = self._clock().timestamp()
        horizon = 24 * 3600.0 if horizon_s is None else float(horizon_s)
        first_s = self._floor(now_s)
        count = max(1, math.ceil((now_s + horizon - first_s) / self.step_s))
        return [self._point(first_s + k * self.step_s, PointKind.FORECAST) for k in range(count)]

    def _clock(self) -> datetime:
        return as_utc(self._now()) if self._now is not None else datetime.now(timezone.utc)

    def _floor(self, t_s: float) -> float:
        return math.floor(t_s / self.step_s) * self.step_s

    def _point(self, t_s: float, kind: PointKind) -> IntensityPoint:
        return IntensityPoint(
            datetime.fromtimestamp(t_s, tz=timezone.utc),
            self.intensity_g_per_kwh,
            kind,
            f"constant:{self._region}",
        )
