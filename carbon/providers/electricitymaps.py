"""Electricity Maps API v3 (https://api.electricitymaps.com/v3).

Endpoints used: ``carbon-intensity/latest``, ``/history`` (the last 24 hours),
``/past-range`` (older ranges, fetched in windows of at most 10 days) and ``/forecast``
(paid plans). A zone key (``"DE"``, ``"US-CAL-CISO"``) or ``"lat,lon"`` selects the grid.
The token goes in the ``auth-token`` header only.

Data: Electricity Maps, licensed ODbL; attribute "Electricity Maps" when reporting it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import requests

from carbon.errors import CarbonConfigError, ProviderError, RegionNotInPlanError
from carbon.providers.base import (
    HttpProvider,
    Secret,
    fetch_in_windows,
    parse_intensity,
    parse_time,
    points_between,
)
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = ["ElectricityMapsProvider", "parse_lat_lon", "validate_zone"]

_ZONE = re.compile(r"^[A-Z]{2,3}(-[A-Z0-9]+)*$")
_LAT_LON = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*$")
_HISTORY_SPAN = timedelta(hours=24)
_PAST_RANGE_MAX = timedelta(days=10)


def parse_lat_lon(region: str) -> tuple[float, float] | None:
    """``(lat, lon)`` from ``"lat,lon"`` when in range, else ``None``."""
    match = _LAT_LON.match(region)
    if not match:
        return None
    lat, lon = float(match.group(1)), float(match.group(2))
    if not (-90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0):
        return None
    return lat, lon


def validate_zone(region: str) -> str | None:
    """Check an Electricity Maps region; returns a problem description or ``None``.

    Args:
        region: a zone key such as ``"DE"`` or ``"US-CAL-CISO"``, or ``"lat,lon"``.
    """
    if _ZONE.match(region) or parse_lat_lon(region) is not None:
        return None
    return (
        "an Electricity Maps zone key in capitals (e.g. 'DE', 'FR', 'US-CAL-CISO') "
        "or 'lat,lon' (e.g. '52.52,13.40')"
    )


class ElectricityMapsProvider(HttpProvider):
    """Carbon intensity from Electricity Maps.

    Args:
        region: a zone key (``"DE"``) or ``"lat,lon"``.
        token: the API token (sent only in the ``auth-token`` header).
        emission_factor: ``"direct"`` (operational) or ``"lifecycle"`` (LCA).
        disable_estimations: ask for measured values only (``disableEstimations``).
        now: the current time (for history/forecast ranges); the wall clock by default.
        **http: options of :class:`~carbon.providers.base.HttpProvider` (``base_url``,
            ``timeout_s``, ``max_retries``, ``sleep``...).

    Raises:
        CarbonConfigError: on a malformed region or emission factor.

    Example:
        >>> p = ElectricityMapsProvider("DE", token="not-shown")
        >>> "token=***" in repr(p) and "not-shown" not in repr(p)
        True
    """

    name = "electricitymaps"
    default_base_url = "https://api.electricitymaps.com/v3"

    def __init__(
        self,
        region: str,
        token: str | Secret,
        *,
        emission_factor: Literal["direct", "lifecycle"] = "direct",
        disable_estimations: bool = False,
        now: Callable[[], datetime] | None = None,
        **http: Any,
    ) -> None:
        problem = validate_zone(region)
        if problem:
            raise CarbonConfigError(f"region {region!r} is not {problem}")
        if emission_factor not in ("direct", "lifecycle"):
            raise CarbonConfigError(
                f"emission_factor: {emission_factor!r} is not allowed; "
                "allowed: 'direct', 'lifecycle'"
            )
        super().__init__(**http)
        self._region = region
        self._token = token if isinstance(token, Secret) else Secret(token)
        self.emission_factor = emission_factor
        self.disable_estimations = disable_estimations
        self._now = now

    @property
    def region(self) -> str:
        """The zone key or ``"lat,lon"``."""
        return self._region

    def __repr__(self) -> str:
        return (
            f"ElectricityMapsProvider(region={self._region!r}, base_url={self.base_url!r}, "
            f"emission_factor={self.emission_factor!r}, token=***)"
        )

    def _secrets(self) -> list[Secret]:
        return [*super()._secrets(), self._token]

    def latest(self) -> IntensityPoint:
        """The latest value (``carbon-intensity/latest``).

        Raises:
            ProviderError: a subclass on any failure (``NoDataError`` when the zone has no
                recent data).
        """
        body = self._get("/carbon-intensity/latest", "latest")
        if not isinstance(body, dict):
            raise self._bad("latest: expected a JSON object", "latest")
        point = self._point(body, "latest", PointKind.MEASURED)
        if point is None:
            raise self._no_data(f"no recent carbon intensity for {self._region!r}", "latest")
        return point

    def history(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        """Past values in ``[start, end)``: ``/history`` when the range lies within the last
        24 hours, otherwise ``/past-range`` in windows of at most 10 days.

        Raises:
            ProviderError: a subclass on any failure.
        """
        start, end = as_utc(start), as_utc(end)
        if end <= start:
            return []
        if start >= self._clock() - _HISTORY_SPAN:
            body = self._get("/carbon-intensity/history", "history")
            return points_between(
                self._points(body, "history", "history", PointKind.MEASURED), start, end
            )

        def fetch(window_start: datetime, window_end: datetime) -> list[IntensityPoint]:
            body = self._get(
                "/carbon-intensity/past-range",
                "past-range",
                start=_iso(window_start),
                end=_iso(window_end),
            )
            return self._points(body, "data", "past-range", PointKind.MEASURED)

        return fetch_in_windows(start, end, _PAST_RANGE_MAX, fetch)

    def forecast(self, horizon_s: float | None = None) -> list[IntensityPoint]:
        """Forecast values (``carbon-intensity/forecast``; paid plans) from the current hour.

        Args:
            horizon_s: keep points starting before now + ``horizon_s``; all when ``None``.

        Raises:
            ProviderError: a subclass on any failure (``RegionNotInPlanError`` when the
                plan lacks forecasts).
        """
        body = self._get("/carbon-intensity/forecast", "forecast")
        points = self._points(body, "forecast", "forecast", PointKind.FORECAST)
        if horizon_s is not None:
            until = self._clock() + timedelta(seconds=horizon_s)
            points = [p for p in points if p.time < until]
        return points

    def _clock(self) -> datetime:
        return as_utc(self._now()) if self._now is not None else datetime.now(timezone.utc)

    def _get(self, path: str, operation: str, **extra: str) -> Any:
        params: dict[str, str] = {}
        lat_lon = parse_lat_lon(self._region)
        if lat_lon is not None:
            params["lat"], params["lon"] = (f"{v:g}" for v in lat_lon)
        else:
            params["zone"] = self._region
        params["emissionFactorType"] = self.emission_factor
        if self.disable_estimations and operation != "forecast":
            params["disableEstimations"] = "true"
        params.update(extra)
        return self._request_json(
            path,
            operation=operation,
            params=params,
            headers={"auth-token": self._token.reveal()},
        )

    def _points(self, body: Any, key: str, operation: str, kind: PointKind) -> list[IntensityPoint]:
        if not isinstance(body, dict) or not isinstance(body.get(key), list):
            raise self._bad(f"{operation}: expected a JSON object with a {key!r} list", operation)
        points = [self._point(item, operation, kind) for item in body[key]]
        found = [p for p in points if p is not None]
        if not found:
            raise self._no_data(f"no {operation} data for {self._region!r}", operation)
        return sorted(found, key=lambda p: p.time)

    def _point(self, item: Any, operation: str, kind: PointKind) -> IntensityPoint | None:
        """One record; ``None`` when the value is missing (null or a no-data answer)."""
        if not isinstance(item, Mapping):
            raise self._bad(f"{operation}: a record is not a JSON object", operation)
        if "carbonIntensity" not in item:
            if item.get("status") == "no-data" or item.get("data") == {}:
                return None
            raise self._bad(f"{operation}: a record has no 'carbonIntensity'", operation)
        value = item["carbonIntensity"]
        if value is None:
            return None
        try:
            time = parse_time(str(item["datetime"]))
            intensity = parse_intensity(value)
        except (KeyError, ValueError) as exc:
            raise self._bad(f"{operation}: malformed record ({exc})", operation) from exc
        if kind is PointKind.MEASURED and item.get("isEstimated"):
            kind = PointKind.ESTIMATED
        zone = item.get("zone") or self._region
        return IntensityPoint(time, intensity, kind, f"{self.name}:{zone}")

    def _error_for(self, response: requests.Response, operation: str) -> ProviderError:
        if response.status_code == 403:
            return RegionNotInPlanError(
                f"access denied for {self._region!r} on /{operation}: the token's plan does "
                "not include this zone or endpoint (the free tier covers one zone and no "
                f"forecast), or the token is not valid for it: {self._body_message(response)}",
                provider=self.name,
                operation=operation,
                status=403,
            )
        return super()._error_for(response, operation)


def _iso(t: datetime) -> str:
    return as_utc(t).strftime("%Y-%m-%dT%H:%M:%SZ")
