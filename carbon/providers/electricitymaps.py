"""Electricity Maps API v4 (https://api.electricitymaps.com/v4), and v3 while it answers.

Endpoints used: ``carbon-intensity/latest``, ``/history`` (the last 24 hours),
``/past-range`` (older ranges, fetched in windows of at most 10 days) and ``/forecast``
(v4: ``horizonHours`` of 6, 24, 48 or 72; the longest one that the horizon asked for
needs). A zone key (``"DE"``, ``"US-CAL-CISO"``) or ``"lat,lon"`` selects the grid; on v4
and v3 alike ``disableCallerLookup=true`` is always sent, so the API never answers for the
location of the caller's IP address instead. The token goes in the ``auth-token`` header only.

Every request names the emission factor (``emissionFactorType``: ``lifecycle`` or
``direct``, which differ a lot: 75 against 20 gCO2eq/kWh for one Danish hour), and an
answer computed with another factor than the one asked for is refused.

Plans: the free tier has ``latest``, ``history`` and ``forecast`` for about 350 zones, and
neither ``past`` nor ``past-range``. A 401 is then not always a bad token: once the token
has been accepted by an earlier request, a 401 or 403 means that the plan lacks the
endpoint or the zone (:class:`~carbon.errors.RegionNotInPlanError`); before that it may be
either, and the error says so.

Data: Electricity Maps, licensed ODbL; attribute "Electricity Maps" when reporting it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import requests

from carbon.errors import AuthError, CarbonConfigError, ProviderError, RegionNotInPlanError
from carbon.providers.base import (
    HttpProvider,
    Secret,
    fetch_in_windows,
    parse_intensity,
    parse_time,
    points_between,
)
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = [
    "API_VERSIONS",
    "FORECAST_HORIZONS_H",
    "ElectricityMapsProvider",
    "parse_lat_lon",
    "resolve_api_version",
    "validate_zone",
]

#: The API versions spoken, the default first.
API_VERSIONS: tuple[str, ...] = ("v4", "v3")
#: The forecast horizons v4 offers (``horizonHours``), in hours.
FORECAST_HORIZONS_H: tuple[int, ...] = (6, 24, 48, 72)

_PUBLIC_ROOT = "https://api.electricitymaps.com"
_ZONE = re.compile(r"^[A-Z]{2,3}(-[A-Z0-9]+)*$")
_LAT_LON = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*$")
_VERSION_SUFFIX = re.compile(r"/(v\d+)/*$")
_HISTORY_SPAN = timedelta(hours=24)
#: A range that starts this much before the last 24 hours is still asked of ``/history``:
#: callers compute "the last day" from their own, earlier reading of the clock.
_HISTORY_LEEWAY = timedelta(hours=1)
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


def resolve_api_version(api_version: object, base_url: str | None) -> tuple[str, str | None]:
    """The API version to speak, and a problem when the settings are wrong.

    Args:
        api_version: ``"v4"``, ``"v3"``, or ``None``: the version ``base_url`` ends with
            (``.../v3``), else ``"v4"``.
        base_url: the API root asked for, if any.

    Returns:
        ``(version, problem)``: the problem (naming the key, the value and what is allowed)
        is ``None`` when the settings agree.

    Example:
        >>> resolve_api_version(None, "http://proxy:8080/v3")
        ('v3', None)
        >>> resolve_api_version("v5", None)[1]
        "api_version: 'v5' is not allowed; allowed: v4, v3"
    """
    suffix = _VERSION_SUFFIX.search(base_url or "")
    in_url = suffix.group(1) if suffix else None
    if api_version is None:
        api_version = in_url if in_url is not None else API_VERSIONS[0]
    if api_version not in API_VERSIONS:
        allowed = ", ".join(API_VERSIONS)
        return API_VERSIONS[0], f"api_version: {api_version!r} is not allowed; allowed: {allowed}"
    version = str(api_version)
    if in_url is not None and in_url != version:
        return version, (
            f"api_version: {version!r} does not match base_url, which ends in '/{in_url}'; "
            f"allowed: a base_url ending in '/{version}' (or none), or api_version: {in_url}"
        )
    return version, None


class ElectricityMapsProvider(HttpProvider):
    """Carbon intensity from Electricity Maps.

    Args:
        region: a zone key (``"DE"``) or ``"lat,lon"``.
        token: the API token (sent only in the ``auth-token`` header).
        api_version: ``"v4"`` or ``"v3"``; by default the version ``base_url`` ends with,
            else ``"v4"``.
        emission_factor: ``"direct"`` (operational) or ``"lifecycle"`` (LCA), sent with
            every request; an answer computed with the other one is refused.
        disable_estimations: ask for measured values only (``disableEstimations``).
        now: the current time (for history/forecast ranges); the wall clock by default.
        **http: options of :class:`~carbon.providers.base.HttpProvider` (``base_url``, the
            root of one API version such as ``"http://proxy:8080/v4"``; ``timeout_s``,
            ``max_retries``, ``sleep``...).

    Raises:
        CarbonConfigError: on a malformed region, emission factor or API version, or an
            ``api_version`` that ``base_url`` contradicts.

    Example:
        >>> p = ElectricityMapsProvider("DE", token="not-shown")
        >>> "token=***" in repr(p) and "not-shown" not in repr(p), p.base_url
        (True, 'https://api.electricitymaps.com/v4')
    """

    name = "electricitymaps"
    default_base_url = f"{_PUBLIC_ROOT}/{API_VERSIONS[0]}"

    def __init__(
        self,
        region: str,
        token: str | Secret,
        *,
        api_version: Literal["v4", "v3"] | None = None,
        emission_factor: Literal["direct", "lifecycle"] = "direct",
        disable_estimations: bool = False,
        now: Callable[[], datetime] | None = None,
        **http: Any,
    ) -> None:
        problems = []
        problem = validate_zone(region)
        if problem:
            problems.append(f"region {region!r} is not {problem}")
        if emission_factor not in ("direct", "lifecycle"):
            problems.append(
                f"emission_factor: {emission_factor!r} is not allowed; "
                "allowed: 'direct', 'lifecycle'"
            )
        base_url = http.pop("base_url", None)
        version, problem = resolve_api_version(api_version, base_url)
        if problem:
            problems.append(problem)
        if problems:
            raise CarbonConfigError(problems)
        super().__init__(base_url=base_url or f"{_PUBLIC_ROOT}/{version}", **http)
        self._region = region
        self._token = token if isinstance(token, Secret) else Secret(token)
        self.api_version = version
        self.emission_factor = emission_factor
        self.disable_estimations = disable_estimations
        self._now = now
        # Whether a request with this token has succeeded: a 401 after that is the plan's.
        self._token_accepted = False

    @property
    def region(self) -> str:
        """The zone key or ``"lat,lon"``."""
        return self._region

    def __repr__(self) -> str:
        return (
            f"ElectricityMapsProvider(region={self._region!r}, base_url={self.base_url!r}, "
            f"api_version={self.api_version!r}, emission_factor={self.emission_factor!r}, "
            "token=***)"
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
        24 hours (or starts up to an hour before them, whose first hour ``/history`` may then
        lack), otherwise ``/past-range`` in windows of at most 10 days (not in the free
        tier: replay older periods from a trace).

        Raises:
            ProviderError: a subclass on any failure.
        """
        start, end = as_utc(start), as_utc(end)
        if end <= start:
            return []
        if start >= self._clock() - _HISTORY_SPAN - _HISTORY_LEEWAY:
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
        """Forecast values (``carbon-intensity/forecast``) from the current hour.

        On v4 the request asks for the shortest ``horizonHours`` that covers ``horizon_s``
        (72 h, the longest, when ``horizon_s`` is ``None`` or longer).

        Args:
            horizon_s: keep points starting before now + ``horizon_s``; all when ``None``.

        Raises:
            ProviderError: a subclass on any failure (``RegionNotInPlanError`` when the
                plan lacks forecasts for the zone).
        """
        extra = {}
        if self.api_version != "v3":
            extra["horizonHours"] = str(_horizon_hours(horizon_s))
        body = self._get("/carbon-intensity/forecast", "forecast", **extra)
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
        params["disableCallerLookup"] = "true"
        if self.disable_estimations and operation != "forecast":
            params["disableEstimations"] = "true"
        params.update(extra)
        body = self._request_json(
            path,
            operation=operation,
            params=params,
            headers={"auth-token": self._token.reveal()},
        )
        self._token_accepted = True
        return body

    def _points(self, body: Any, key: str, operation: str, kind: PointKind) -> list[IntensityPoint]:
        if not isinstance(body, dict) or not isinstance(body.get(key), list):
            raise self._bad(f"{operation}: expected a JSON object with a {key!r} list", operation)
        self._check_factor(body, operation)
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
        self._check_factor(item, operation)
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

    def _check_factor(self, record: Mapping[str, Any], operation: str) -> None:
        """Refuse values computed with another emission factor than the one asked for:
        direct and life-cycle values of one hour differ several times over."""
        answered = record.get("emissionFactorType")
        if answered is not None and answered != self.emission_factor:
            raise self._bad(
                f"{operation}: asked for {self.emission_factor!r} emission factors, the "
                f"answer holds {str(answered)[:40]!r} ones",
                operation,
            )

    def _error_for(self, response: requests.Response, operation: str) -> ProviderError:
        status = response.status_code
        if status not in (401, 403):
            return super()._error_for(response, operation)
        plan = (
            f"the token's plan does not include /carbon-intensity/{operation} for "
            f"{self._region!r} (the free tier has latest, history and forecast, for about "
            "350 zones, and no past-range)"
        )
        if operation == "past-range":
            plan += (
                "; to replay a period older than 24 h without that endpoint, export it as a "
                "CSV and use provider: trace"
            )
        kwargs: dict[str, Any] = {"provider": self.name, "operation": operation, "status": status}
        detail = self._body_message(response)
        if self._token_accepted:
            return RegionNotInPlanError(
                f"{plan}; the token itself was accepted earlier: {detail}", **kwargs
            )
        if status == 403:
            return RegionNotInPlanError(
                f"{plan}, or the token is not valid for it: {detail}", **kwargs
            )
        return AuthError(
            f"the token was rejected (check it; its value is never shown), or {plan}: {detail}",
            **kwargs,
        )


def _horizon_hours(horizon_s: float | None) -> int:
    """The shortest v4 ``horizonHours`` reaching ``horizon_s`` (the longest when none does)."""
    longest = FORECAST_HORIZONS_H[-1]
    if horizon_s is None:
        return longest
    return next((h for h in FORECAST_HORIZONS_H if h * 3600.0 >= horizon_s), longest)


def _iso(t: datetime) -> str:
    return as_utc(t).strftime("%Y-%m-%dT%H:%M:%SZ")
