"""National Grid ESO Carbon Intensity API for Great Britain (https://api.carbonintensity.org.uk).

No key. National values have a forecast and, after the fact, an ``actual`` (measured);
regional values (17 regions, or the region of a postcode's outward code) are modelled
(``forecast`` only) and reported as estimated. Endpoints used:

- now: ``/intensity``, ``/regional/regionid/{id}``, ``/regional/postcode/{pc}``
- 48 h forecast: ``/intensity/{from}/fw48h``,
  ``/regional/intensity/{from}/fw48h/regionid/{id}``,
  ``/regional/intensity/{from}/fw48h/postcode/{pc}``
- history: ``/intensity/{from}/{to}`` and the regional equivalents (14-day windows).

Data: Carbon Intensity API (National Grid ESO), CC BY 4.0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from carbon.errors import CarbonConfigError
from carbon.providers.base import HttpProvider, fetch_in_windows, parse_intensity, parse_time
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = ["UK_REGIONS", "UKCarbonIntensityProvider", "validate_region"]

#: Region ids of the API and their short names.
UK_REGIONS: dict[int, str] = {
    1: "North Scotland",
    2: "South Scotland",
    3: "North West England",
    4: "North East England",
    5: "Yorkshire",
    6: "North Wales & Merseyside",
    7: "South Wales",
    8: "West Midlands",
    9: "East Midlands",
    10: "East England",
    11: "South West England",
    12: "South England",
    13: "London",
    14: "South East England",
    15: "England",
    16: "Scotland",
    17: "Wales",
}

_OUTWARD_CODE = re.compile(r"^[A-Z]{1,2}[0-9][A-Z0-9]?$")
_HISTORY_MAX = timedelta(days=14)
_FORECAST_SPAN_S = 48 * 3600.0


def validate_region(region: str) -> str | None:
    """Check a UK region; returns a problem description or ``None``.

    Args:
        region: ``"national"``, a region id ``"1"``..``"17"``, or a postcode's outward
            code (``"EN2"``, ``"SW1A"``, ``"RG10"``).
    """
    if region == "national" or _OUTWARD_CODE.match(region.upper()):
        return None
    if region.isdigit() and int(region) in UK_REGIONS:
        return None
    return (
        "'national', a region id 1-17, or the outward code of a postcode "
        "(the part before the space, e.g. 'EN2', 'SW1A')"
    )


class UKCarbonIntensityProvider(HttpProvider):
    """Carbon intensity of Great Britain, nationally or for one region.

    Args:
        region: ``"national"``, a region id ``"1"``..``"17"`` (see :data:`UK_REGIONS`)
            or a postcode outward code.
        now: the current time (the start of forecasts); the wall clock by default.
        **http: options of :class:`~carbon.providers.base.HttpProvider`.

    Raises:
        CarbonConfigError: on a malformed region.
    """

    name = "uk"
    default_base_url = "https://api.carbonintensity.org.uk"

    def __init__(
        self, region: str = "national", *, now: Callable[[], datetime] | None = None, **http: Any
    ) -> None:
        problem = validate_region(region)
        if problem:
            raise CarbonConfigError(f"region {region!r} is not {problem}")
        super().__init__(**http)
        self._region = region if region == "national" or region.isdigit() else region.upper()
        self._now = now

    @property
    def region(self) -> str:
        """``"national"``, a region id or a postcode outward code."""
        return self._region

    def __repr__(self) -> str:
        return f"UKCarbonIntensityProvider(region={self._region!r}, base_url={self.base_url!r})"

    def latest(self) -> IntensityPoint:
        """The current half hour.

        Raises:
            ProviderError: a subclass on any failure.
        """
        if self._region == "national":
            body = self._request_json("/intensity", operation="latest")
        elif self._region.isdigit():
            body = self._request_json(f"/regional/regionid/{self._region}", operation="latest")
        else:
            body = self._request_json(f"/regional/postcode/{self._region}", operation="latest")
        points = self._parse(body, "latest", PointKind.MEASURED)
        return points[-1]

    def forecast(self, horizon_s: float | None = None) -> list[IntensityPoint]:
        """The 48 h forecast from the current half hour.

        Args:
            horizon_s: keep points starting before now + ``horizon_s`` (48 h at most).

        Raises:
            ProviderError: a subclass on any failure.
        """
        now = self._clock()
        start = _iso(now)
        if self._region == "national":
            path = f"/intensity/{start}/fw48h"
        else:
            path = f"/regional/intensity/{start}/fw48h/{self._regional_suffix()}"
        points = self._parse(
            self._request_json(path, operation="forecast"), "forecast", PointKind.FORECAST
        )
        span_s = _FORECAST_SPAN_S if horizon_s is None else min(horizon_s, _FORECAST_SPAN_S)
        until = now + timedelta(seconds=span_s)
        return [p for p in points if p.time < until]

    def history(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        """Past half hours in ``[start, end)``, in windows of at most 14 days.

        Raises:
            ProviderError: a subclass on any failure.
        """

        def fetch(window_start: datetime, window_end: datetime) -> list[IntensityPoint]:
            span = f"{_iso(window_start)}/{_iso(window_end)}"
            if self._region == "national":
                path = f"/intensity/{span}"
            else:
                path = f"/regional/intensity/{span}/{self._regional_suffix()}"
            body = self._request_json(path, operation="history")
            return self._parse(body, "history", PointKind.MEASURED)

        return fetch_in_windows(as_utc(start), as_utc(end), _HISTORY_MAX, fetch)

    def _regional_suffix(self) -> str:
        kind = "regionid" if self._region.isdigit() else "postcode"
        return f"{kind}/{self._region}"

    def _clock(self) -> datetime:
        return as_utc(self._now()) if self._now is not None else datetime.now(timezone.utc)

    def _parse(self, body: Any, operation: str, kind: PointKind) -> list[IntensityPoint]:
        """Points from a national list, a regional list or a regional object answer."""
        if not isinstance(body, dict) or "data" not in body:
            raise self._bad(f"{operation}: expected a JSON object with 'data'", operation)
        data = body["data"]
        regional = False
        if isinstance(data, dict):  # regional range: {"data": {"regionid": .., "data": [..]}}
            data, regional = data.get("data"), True
        elif isinstance(data, list) and data and isinstance(data[0], dict) and "data" in data[0]:
            data, regional = data[0]["data"], True  # regional now: [{"regionid": .., "data"}]
        if not isinstance(data, list):
            raise self._bad(f"{operation}: 'data' is not a list of half hours", operation)
        source = f"{self.name}:{self._region}"
        points = []
        try:
            for record in data:
                intensity = record["intensity"]
                actual = None if regional else intensity.get("actual")
                predicted = intensity.get("forecast")
                if kind is PointKind.FORECAST:
                    value, point_kind = predicted, PointKind.FORECAST
                elif actual is not None:
                    value, point_kind = actual, PointKind.MEASURED
                else:
                    value, point_kind = predicted, PointKind.ESTIMATED
                if value is None:
                    continue
                points.append(
                    IntensityPoint(
                        parse_time(str(record["from"])), parse_intensity(value), point_kind, source
                    )
                )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise self._bad(f"{operation}: malformed half hour ({exc})", operation) from exc
        if not points:
            raise self._no_data(f"no {operation} data for {self._region!r}", operation)
        return sorted(points, key=lambda p: p.time)


def _iso(t: datetime) -> str:
    return as_utc(t).strftime("%Y-%m-%dT%H:%MZ")
