"""The one shape of answer every provider gives: points of carbon intensity in time."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum

__all__ = ["IntensityPoint", "PointKind", "Reading", "ReadingStatus", "as_utc"]


class PointKind(str, Enum):
    """How an intensity value was obtained."""

    MEASURED = "measured"
    """Computed from the reported generation mix of that interval."""
    ESTIMATED = "estimated"
    """Filled in by the provider (missing or delayed grid data) for a past interval."""
    FORECAST = "forecast"
    """Predicted for a future interval."""


def as_utc(t: datetime) -> datetime:
    """Return ``t`` as a timezone-aware UTC datetime.

    Args:
        t: a datetime; a naive one is taken to be in UTC already.

    Returns:
        The same instant with ``tzinfo=timezone.utc``.
    """
    if t.tzinfo is None:
        return t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc)


@dataclass(frozen=True)
class IntensityPoint:
    """Grid carbon intensity of one interval starting at ``time``.

    Attributes:
        time: start of the interval, timezone-aware UTC (a naive value is taken as UTC).
        intensity_g_per_kwh: grams of CO2-equivalent per kWh consumed.
        kind: measured, estimated or forecast.
        source: where it came from (``"electricitymaps:DE"``, ``"trace:CISO"``...).

    Example:
        >>> from datetime import datetime, timezone
        >>> p = IntensityPoint(datetime(2023, 1, 1, tzinfo=timezone.utc), 218.3,
        ...                    PointKind.MEASURED, "trace:CISO")
        >>> p.intensity_g_per_kwh
        218.3
    """

    time: datetime
    intensity_g_per_kwh: float
    kind: PointKind
    source: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "time", as_utc(self.time))
        object.__setattr__(self, "intensity_g_per_kwh", float(self.intensity_g_per_kwh))
        object.__setattr__(self, "kind", PointKind(self.kind))


class ReadingStatus(str, Enum):
    """How trustworthy a :class:`Reading` is."""

    FRESH = "fresh"
    """The last poll succeeded; the value is the provider's latest."""
    STALE = "stale"
    """Polls are failing; the value is the last good one, younger than ``max_staleness_s``."""
    FALLBACK = "fallback"
    """No good value, or the last one is too old: the configured fallback is used."""


@dataclass(frozen=True)
class Reading:
    """The carbon intensity a :class:`~carbon.monitor.CarbonMonitor` answers with.

    Attributes:
        intensity_g_per_kwh: grams of CO2-equivalent per kWh to use now.
        time: start of the interval the value belongs to (UTC); ``None`` for a constant
            fallback.
        status: fresh, stale or fallback.
        source: where the value came from (a provider source, ``"fallback:constant"`` or
            ``"fallback:daily"``).
        age_s: seconds since the last successful poll, ``None`` when none succeeded yet.
    """

    intensity_g_per_kwh: float
    time: datetime | None
    status: ReadingStatus
    source: str
    age_s: float | None = None
