"""WattTime API v3 (https://api.watttime.org).

Login: ``GET /login`` with HTTP basic auth returns a bearer token valid for 30 minutes;
it is renewed a few minutes before it expires, and once more when the API rejects it.
Data: ``/v3/forecast`` (``horizon_hours=0`` gives the current value), ``/v3/historical``,
``/v3/signal-index`` (the relative 0-100 index) and ``/v3/region-from-loc`` (region of a
``"lat,lon"``). Values come in lbs CO2/MWh and are converted to gCO2/kWh
(1 lb/MWh = 453.592 g / 1000 kWh = 0.4536 g/kWh).

Plans: free accounts get the full data (values in lbs/MWh, forecast, history) only for
``CAISO_NORTH``; for other regions they get only the signal index, and the value
endpoints answer 403, which is raised as :class:`~carbon.errors.RegionNotInPlanError`.
"""

from __future__ import annotations

import base64
import math
import re
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import requests

from carbon.errors import (
    AuthError,
    CarbonConfigError,
    NoDataError,
    ProviderError,
    RegionNotInPlanError,
)
from carbon.providers.base import (
    HttpProvider,
    Secret,
    fetch_in_windows,
    parse_intensity,
    parse_time,
)
from carbon.providers.electricitymaps import parse_lat_lon
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = ["G_PER_KWH_PER_LB_PER_MWH", "WattTimeProvider", "validate_region"]

#: 1 lb/MWh in g/kWh (453.592 g per lb, 1000 kWh per MWh).
G_PER_KWH_PER_LB_PER_MWH = 0.4536

#: Lifetime of a WattTime bearer token.
TOKEN_LIFETIME_S = 30 * 60.0

_REGION = re.compile(r"^[A-Z0-9][A-Z0-9_\-]*$")
_UNITS_TO_G_PER_KWH = {
    "lbs_co2_per_mwh": G_PER_KWH_PER_LB_PER_MWH,
    "lbs_co2e_per_mwh": G_PER_KWH_PER_LB_PER_MWH,
    "g_co2_per_kwh": 1.0,
    "g_co2e_per_kwh": 1.0,
}
_HISTORY_MAX = timedelta(days=32)


def validate_region(region: str) -> str | None:
    """Check a WattTime region; returns a problem description or ``None``.

    Args:
        region: a region abbreviation (``"CAISO_NORTH"``, ``"PJM_DC"``) or ``"lat,lon"``.
    """
    if _REGION.match(region) or parse_lat_lon(region) is not None:
        return None
    return "a WattTime region in capitals (e.g. 'CAISO_NORTH') or 'lat,lon'"


class WattTimeProvider(HttpProvider):
    """Marginal emissions (MOER) from WattTime, converted to gCO2/kWh.

    Args:
        region: a region abbreviation or ``"lat,lon"`` (looked up once with
            ``/v3/region-from-loc``).
        username: the account name.
        password: the account password (sent only as HTTP basic auth to ``/login``).
        signal_type: the signal (``"co2_moer"`` by default; ``"co2_aoer"`` where offered).
        refresh_margin_s: renew the token this long before its 30 minutes are up.
        clock: monotonic seconds, for the token's age (injected by tests).
        **http: options of :class:`~carbon.providers.base.HttpProvider`.

    Raises:
        CarbonConfigError: on a malformed region.
    """

    name = "watttime"
    default_base_url = "https://api.watttime.org"

    def __init__(
        self,
        region: str,
        username: str,
        password: str | Secret,
        *,
        signal_type: str = "co2_moer",
        refresh_margin_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        **http: Any,
    ) -> None:
        problem = validate_region(region)
        if problem:
            raise CarbonConfigError(f"region {region!r} is not {problem}")
        super().__init__(**http)
        self._region = region
        self._username = username
        self._password = password if isinstance(password, Secret) else Secret(password)
        self.signal_type = signal_type
        self.refresh_margin_s = refresh_margin_s
        self._clock = clock
        self._token: Secret | None = None
        self._token_time = 0.0
        self._resolved_region: str | None = None if parse_lat_lon(region) else region

    @property
    def region(self) -> str:
        """The configured region (an abbreviation or ``"lat,lon"``)."""
        return self._region

    def __repr__(self) -> str:
        return (
            f"WattTimeProvider(region={self._region!r}, base_url={self.base_url!r}, "
            f"signal_type={self.signal_type!r}, username={self._username!r}, "
            "password=***, token=***)"
        )

    def _secrets(self) -> list[Secret]:
        basic = base64.b64encode(f"{self._username}:{self._password.reveal()}".encode()).decode()
        token = [self._token] if self._token is not None else []
        return [*super()._secrets(), self._password, Secret(basic), *token]

    def grid_region(self) -> str:
        """The WattTime region abbreviation (resolving ``"lat,lon"`` on first use).

        Raises:
            ProviderError: a subclass if the lookup fails (``NoDataError`` for coordinates
                WattTime does not cover).
        """
        if self._resolved_region is None:
            lat_lon = parse_lat_lon(self._region)
            assert lat_lon is not None
            body = self._authed(
                "/v3/region-from-loc",
                "region-from-loc",
                latitude=f"{lat_lon[0]:g}",
                longitude=f"{lat_lon[1]:g}",
                signal_type=self.signal_type,
            )
            if not isinstance(body, dict) or not isinstance(body.get("region"), str):
                raise self._bad("region-from-loc: no 'region' in the answer", "region-from-loc")
            self._resolved_region = body["region"]
        return self._resolved_region

    def latest(self) -> IntensityPoint:
        """The current value (``/v3/forecast`` with ``horizon_hours=0``).

        Raises:
            ProviderError: a subclass on any failure; ``RegionNotInPlanError`` when the
                plan only offers the signal index for this region.
        """
        points = self._forecast_points(0)
        return IntensityPoint(
            points[0].time, points[0].intensity_g_per_kwh, PointKind.MEASURED, points[0].source
        )

    def forecast(self, horizon_s: float | None = None) -> list[IntensityPoint]:
        """The forecast (``/v3/forecast``), 5-minute points from now.

        Args:
            horizon_s: how far ahead; the API's default (24 h) when ``None``.

        Raises:
            ProviderError: a subclass on any failure.
        """
        hours = None if horizon_s is None else max(0, math.ceil(horizon_s / 3600.0))
        return self._forecast_points(hours)

    def history(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        """Past values in ``[start, end)`` (``/v3/historical``, 32-day windows).

        Raises:
            ProviderError: a subclass on any failure.
        """

        def fetch(window_start: datetime, window_end: datetime) -> list[IntensityPoint]:
            body = self._authed(
                "/v3/historical",
                "historical",
                region=self.grid_region(),
                signal_type=self.signal_type,
                start=_iso(window_start),
                end=_iso(window_end),
            )
            return self._parse(body, "historical", PointKind.MEASURED)

        return fetch_in_windows(as_utc(start), as_utc(end), _HISTORY_MAX, fetch)

    def signal_index(self) -> tuple[datetime, float]:
        """The relative signal index (0 = cleanest, 100 = dirtiest of recent history),
        available to free accounts for every region (``/v3/signal-index``).

        Returns:
            The time of the value and the percentile.

        Raises:
            ProviderError: a subclass on any failure.
        """
        body = self._authed(
            "/v3/signal-index",
            "signal-index",
            region=self.grid_region(),
            signal_type=self.signal_type,
        )
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise self._bad("signal-index: expected a 'data' list", "signal-index")
        if not data:
            raise NoDataError("no signal index", provider=self.name, operation="signal-index")
        try:
            when, value = parse_time(str(data[0]["point_time"])), float(data[0]["value"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise self._bad(f"signal-index: malformed record ({exc})", "signal-index") from exc
        if not 0.0 <= value <= 100.0:
            raise self._bad(f"signal-index: {value!r} is not a percentile 0-100", "signal-index")
        return when, value

    def _forecast_points(self, horizon_hours: int | None) -> list[IntensityPoint]:
        params = {"region": self.grid_region(), "signal_type": self.signal_type}
        if horizon_hours is not None:
            params["horizon_hours"] = str(horizon_hours)
        operation = "latest" if horizon_hours == 0 else "forecast"
        body = self._authed("/v3/forecast", operation, **params)
        return self._parse(body, operation, PointKind.FORECAST)

    def _parse(self, body: Any, operation: str, kind: PointKind) -> list[IntensityPoint]:
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise self._bad(f"{operation}: expected a JSON object with a 'data' list", operation)
        raw_meta = body.get("meta")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        units = str(meta.get("units", "lbs_co2_per_mwh"))
        factor = _UNITS_TO_G_PER_KWH.get(units)
        if factor is None:
            raise self._bad(
                f"{operation}: values are in {units!r}, not an emission rate; "
                f"allowed: {', '.join(_UNITS_TO_G_PER_KWH)}",
                operation,
            )
        region = str(meta.get("region") or self._resolved_region or self._region)
        points = []
        try:
            records = body["data"]
            if records and isinstance(records[0], dict) and "forecast" in records[0]:
                # Forecast-history shape: one entry per generation time; use the newest.
                newest = max(records, key=lambda r: str(r.get("generated_at", "")))
                records = newest.get("forecast") or []
            for record in records:
                point_kind = kind
                if kind is PointKind.MEASURED and record.get("imputed_data_used"):
                    point_kind = PointKind.ESTIMATED
                points.append(
                    IntensityPoint(
                        parse_time(str(record["point_time"])),
                        parse_intensity(record["value"], factor),
                        point_kind,
                        f"{self.name}:{region}",
                    )
                )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise self._bad(f"{operation}: malformed record ({exc})", operation) from exc
        if not points:
            raise self._no_data(f"no {operation} data for {region!r}", operation)
        return sorted(points, key=lambda p: p.time)

    def _login(self) -> Secret:
        body = self._request_json(
            "/login",
            operation="login",
            auth=(self._username, self._password.reveal()),
        )
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise self._bad("login: no token in the answer", "login")
        self._token = Secret(token)
        self._token_time = self._clock()
        return self._token

    def _bearer(self) -> Secret:
        age_s = self._clock() - self._token_time
        if self._token is None or age_s >= TOKEN_LIFETIME_S - self.refresh_margin_s:
            return self._login()
        return self._token

    def _authed(self, path: str, operation: str, **params: str) -> Any:
        """GET with the bearer token; on a rejected token, log in again once and retry."""
        for attempt in range(2):
            token = self._bearer()  # a rejected login raises AuthError from here
            headers = {"Authorization": f"Bearer {token.reveal()}"}
            try:
                return self._request_json(path, operation=operation, params=params, headers=headers)
            except AuthError:
                if attempt == 1:
                    raise
                self._token = None
        raise AssertionError("unreachable")  # pragma: no cover

    def _error_for(self, response: requests.Response, operation: str) -> ProviderError:
        status = response.status_code
        message = self._body_message(response)
        kwargs: dict[str, Any] = {"provider": self.name, "operation": operation, "status": status}
        is_json = "json" in response.headers.get("Content-Type", "")
        if status == 403 and operation != "login" and is_json:
            return RegionNotInPlanError(
                f"the account's plan does not cover {self._region!r} for {operation!r} "
                "(free accounts get values only for CAISO_NORTH and the signal index "
                f"elsewhere): {message}",
                **kwargs,
            )
        if status in (401, 403):
            what = "username/password" if operation == "login" else "token"
            return AuthError(f"{what} rejected: {message}", **kwargs)
        if status in (400, 404) and "coverage" in message.lower():
            return NoDataError(message, **kwargs)
        return super()._error_for(response, operation)


def _iso(t: datetime) -> str:
    return as_utc(t).strftime("%Y-%m-%dT%H:%M:%S+00:00")
