"""WattTime v3 and the UK Carbon Intensity API against recorded answers on a local server."""

from __future__ import annotations

import base64
import csv
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from carbon.errors import (
    AuthError,
    BadResponseError,
    CarbonConfigError,
    NoDataError,
    RegionNotInPlanError,
)
from carbon.providers.uk import UKCarbonIntensityProvider
from carbon.providers.watttime import G_PER_KWH_PER_LB_PER_MWH, WattTimeProvider
from carbon.types import PointKind
from tests.carbon.conftest import ApiServer, FakeSleep, Reply

WT = "watttime"
UK = "uk_carbonintensity"
PASSWORD = "pw-PLANTED-4242"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def wt(
    server: ApiServer, sleep: FakeSleep, region: str = "CAISO_NORTH", **kw: Any
) -> WattTimeProvider:
    return WattTimeProvider(
        region, "alice", PASSWORD, base_url=server.url, sleep=sleep, timeout_s=(2.0, 2.0), **kw
    )


def wt_reply(api_dir: Path, name: str) -> Reply:
    """A recorded WattTime answer (from aiowatttime's fixtures)."""
    return Reply.file(api_dir / WT / f"aiowatttime_{name}_response.json")


def login_tokens(*tokens: str) -> list[Reply]:
    return [Reply.json({"token": t}) for t in tokens]


def test_watttime_login_and_latest_in_g_per_kwh(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route("/login", *login_tokens("bearer-1"))
    api_server.route("/v3/forecast", wt_reply(api_dir, "forecasted_emissions"))
    point = wt(api_server, fake_sleep).latest()
    assert point.intensity_g_per_kwh == pytest.approx(870 * 0.4536)
    assert G_PER_KWH_PER_LB_PER_MWH == 0.4536
    assert point.kind is PointKind.MEASURED
    assert point.time == datetime(2022, 7, 15, tzinfo=timezone.utc)
    assert point.source == "watttime:CAISO_NORTH"
    (login,) = api_server.requests_to("/login")
    expected = "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    assert login.headers["Authorization"] == expected
    assert PASSWORD not in login.raw_target
    (data,) = api_server.requests_to("/v3/forecast")
    assert data.headers["Authorization"] == "Bearer bearer-1"
    assert data.query == {
        "region": ["CAISO_NORTH"],
        "signal_type": ["co2_moer"],
        "horizon_hours": ["0"],
    }


def test_watttime_forecast_and_history(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route("/login", *login_tokens("bearer-1"))
    api_server.route("/v3/forecast", wt_reply(api_dir, "forecasted_emissions"))
    api_server.route(
        "/v3/historical",
        wt_reply(api_dir, "historical_emissions"),
    )
    provider = wt(api_server, fake_sleep)
    forecast = provider.forecast(3 * 3600)
    assert [p.kind for p in forecast] == [PointKind.FORECAST] * 3
    assert api_server.requests_to("/v3/forecast")[0].query["horizon_hours"] == ["3"]
    start = datetime(2022, 7, 15, tzinfo=timezone.utc)
    history = provider.history(start, start + timedelta(hours=1))
    assert [p.intensity_g_per_kwh for p in history] == pytest.approx([870 * 0.4536, 860 * 0.4536])
    assert {p.kind for p in history} == {PointKind.ESTIMATED}  # imputed_data_used
    (seen,) = api_server.requests_to("/v3/historical")
    assert seen.query["start"] == ["2022-07-15T00:00:00+00:00"]
    assert seen.query["end"] == ["2022-07-15T01:00:00+00:00"]
    assert len(api_server.requests_to("/login")) == 1  # the token is reused


def test_watttime_signal_index_and_region_from_location(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route("/login", *login_tokens("bearer-1"))
    api_server.route("/v3/region-from-loc", wt_reply(api_dir, "grid_region"))
    api_server.route(
        "/v3/signal-index",
        wt_reply(api_dir, "realtime_emissions"),
    )
    provider = wt(api_server, fake_sleep, region="39.74,-104.99")
    when, percent = provider.signal_index()
    assert percent == 96.0 and when == datetime(2024, 6, 18, 18, 40, tzinfo=timezone.utc)
    assert provider.grid_region() == "PSCO"
    (loc,) = api_server.requests_to("/v3/region-from-loc")  # looked up once
    assert loc.query["latitude"] == ["39.74"] and loc.query["longitude"] == ["-104.99"]
    assert api_server.requests_to("/v3/signal-index")[0].query["region"] == ["PSCO"]


def test_watttime_percentile_is_not_an_intensity(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route("/login", *login_tokens("bearer-1"))
    api_server.route("/v3/forecast", wt_reply(api_dir, "realtime_emissions"))
    with pytest.raises(BadResponseError, match="percentile"):
        wt(api_server, fake_sleep).latest()


def test_watttime_token_is_renewed_before_expiry(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route("/login", *login_tokens("bearer-1", "bearer-2"))
    api_server.route("/v3/forecast", wt_reply(api_dir, "forecasted_emissions"))
    clock = Clock()
    provider = wt(api_server, fake_sleep, clock=clock)
    provider.latest()
    clock.t += 20 * 60  # still valid
    provider.latest()
    clock.t += 6 * 60  # 26 minutes: inside the 5-minute margin before the 30 are up
    provider.latest()
    bearers = [s.headers["Authorization"] for s in api_server.requests_to("/v3/forecast")]
    assert bearers == ["Bearer bearer-1", "Bearer bearer-1", "Bearer bearer-2"]
    assert len(api_server.requests_to("/login")) == 2


def test_watttime_rejected_token_logs_in_again_once(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route("/login", *login_tokens("old", "new"))
    api_server.route(
        "/v3/forecast",
        Reply.file(api_dir / WT / "aiowatttime_403_forbidden_response.html", status=403),
        wt_reply(api_dir, "forecasted_emissions"),
    )
    assert wt(api_server, fake_sleep).latest().intensity_g_per_kwh > 0
    bearers = [s.headers["Authorization"] for s in api_server.requests_to("/v3/forecast")]
    assert bearers == ["Bearer old", "Bearer new"]


def test_watttime_plan_and_credential_errors(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route("/login", *login_tokens("bearer-1"))
    api_server.route(
        "/v3/forecast", Reply.file(api_dir / WT / "aiowatttime_invalid_scope_response.json", 403)
    )
    with pytest.raises(RegionNotInPlanError, match="CAISO_NORTH") as info:
        wt(api_server, fake_sleep, region="PJM_DC").latest()
    assert "Invalid scope" in str(info.value)
    api_server.route(
        "/login", Reply.file(api_dir / WT / "aiowatttime_403_forbidden_response.html", 403)
    )
    with pytest.raises(AuthError, match="username/password"):
        wt(api_server, fake_sleep).latest()


def test_watttime_location_without_coverage(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route("/login", *login_tokens("bearer-1"))
    api_server.route(
        "/v3/region-from-loc",
        Reply.file(api_dir / WT / "aiowatttime_coordinates_not_found_response.json", 400),
    )
    with pytest.raises(NoDataError, match="No coverage"):
        wt(api_server, fake_sleep, region="0,0").latest()


def test_watttime_region_is_validated() -> None:
    with pytest.raises(CarbonConfigError):
        WattTimeProvider("caiso north", "a", "b")


# -- UK ---------------------------------------------------------------------------------


def uk(
    server: ApiServer, sleep: FakeSleep, region: str = "national", **kw: Any
) -> UKCarbonIntensityProvider:
    return UKCarbonIntensityProvider(region, base_url=server.url, sleep=sleep, **kw)


def fw48h_from_snapshot(path: Path) -> dict[str, Any]:
    """The recorded 48 h national forecast (CSV export) in the API's JSON shape."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    data = []
    for row in rows:
        start = datetime.strptime(row["from"], "%Y-%m-%dT%H:%MZ")
        end = start + timedelta(minutes=30)
        actual = int(row["intensity.actual"]) if row["intensity.actual"] else None
        data.append(
            {
                "from": row["from"],
                "to": end.strftime("%Y-%m-%dT%H:%MZ"),
                "intensity": {
                    "forecast": int(row["intensity.forecast"]),
                    "actual": actual,
                    "index": "low",
                },
            }
        )
    return {"data": data}


def test_uk_national_now(api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep) -> None:
    api_server.route("/intensity", Reply.file(api_dir / UK / "uk_intensity_current.json"))
    point = uk(api_server, fake_sleep).latest()
    assert point.intensity_g_per_kwh == 255.0
    assert point.kind is PointKind.ESTIMATED  # no actual yet for the current half hour
    assert point.time == datetime(2021, 4, 30, 22, 30, tzinfo=timezone.utc)
    assert point.source == "uk:national"


@pytest.mark.parametrize(
    ("region", "path", "file", "value"),
    [
        ("13", "/regional/regionid/13", "uk_regional_regionid_13_current.json", 210.0),
        ("en2", "/regional/postcode/EN2", "uk_regional_postcode_EN2_current.json", 309.0),
        ("SW1A", "/regional/postcode/SW1A", "uk_regional_england_current.json", 243.0),
    ],
)
def test_uk_regional_now(
    api_server: ApiServer,
    api_dir: Path,
    fake_sleep: FakeSleep,
    region: str,
    path: str,
    file: str,
    value: float,
) -> None:
    api_server.route(path, Reply.file(api_dir / UK / file))
    point = uk(api_server, fake_sleep, region=region).latest()
    assert point.intensity_g_per_kwh == value
    assert point.kind is PointKind.ESTIMATED  # regional values are modelled


def test_uk_national_forecast(api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep) -> None:
    snapshot = api_dir / UK / "nmpowell_national_fw48h_2023-03-14T0331Z.csv"
    api_server.route(
        "/intensity/2023-03-14T03:31Z/fw48h", Reply.json(fw48h_from_snapshot(snapshot))
    )
    now = datetime(2023, 3, 14, 3, 31, tzinfo=timezone.utc)
    provider = uk(api_server, fake_sleep, now=lambda: now)
    points = provider.forecast()
    assert len(points) == 96
    assert points[0].intensity_g_per_kwh == 69.0
    assert points[0].time == datetime(2023, 3, 14, 3, 30, tzinfo=timezone.utc)
    assert {p.kind for p in points} == {PointKind.FORECAST}
    assert len(provider.forecast(2 * 3600)) == 5  # 03:30 .. 05:30


def test_uk_regional_forecast_and_history(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    regional = api_dir / UK / "uk_regional_intensity_2020-01-01_2020-01-02_regionid_13.json"
    now = datetime(2019, 12, 31, 23, 45, tzinfo=timezone.utc)
    api_server.route(
        "/regional/intensity/2019-12-31T23:45Z/fw48h/regionid/13", Reply.file(regional)
    )
    provider = uk(api_server, fake_sleep, region="13", now=lambda: now)
    forecast = provider.forecast()
    assert forecast[1].intensity_g_per_kwh == 206.0 and forecast[1].kind is PointKind.FORECAST
    api_server.route(
        "/regional/intensity/2020-01-01T00:00Z/2020-01-02T00:00Z/regionid/13", Reply.file(regional)
    )
    start = datetime(2020, 1, 1, tzinfo=timezone.utc)
    history = provider.history(start, start + timedelta(days=1))
    assert len(history) == 48
    assert history[0].intensity_g_per_kwh == 206.0 and history[0].kind is PointKind.ESTIMATED
    api_server.route(
        "/regional/intensity/2019-12-31T23:45Z/fw48h/postcode/EN2", Reply.file(regional)
    )
    by_postcode = uk(api_server, fake_sleep, region="EN2", now=lambda: now).forecast(3600)
    assert [p.intensity_g_per_kwh for p in by_postcode] == [199.0, 206.0, 215.0]


def test_uk_national_history_prefers_actual(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    recorded = api_dir / UK / "uk_intensity_2020-01-01_to_2020-01-02.json"
    api_server.route("/intensity/2020-01-01T00:00Z/2020-01-02T00:00Z", Reply.file(recorded))
    start = datetime(2020, 1, 1, tzinfo=timezone.utc)
    history = uk(api_server, fake_sleep).history(start, start + timedelta(days=1))
    assert len(history) == 48
    assert history[0].intensity_g_per_kwh == 182.0  # the actual, not the forecast 178
    assert history[0].kind is PointKind.MEASURED
    expected = {
        d["from"]: d["intensity"]["actual"] for d in json.loads(recorded.read_text())["data"]
    }
    for p in history:
        assert p.intensity_g_per_kwh == expected[p.time.strftime("%Y-%m-%dT%H:%MZ")]


def test_uk_history_is_split_in_14_day_windows(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    recorded = Reply.file(api_dir / UK / "uk_intensity_2020-01-01_to_2020-01-02.json")
    api_server.route("/intensity/2020-01-01T00:00Z/2020-01-15T00:00Z", recorded)
    api_server.route("/intensity/2020-01-15T00:00Z/2020-01-21T00:00Z", recorded)
    start = datetime(2020, 1, 1, tzinfo=timezone.utc)
    uk(api_server, fake_sleep).history(start, start + timedelta(days=20))
    assert len(api_server.seen) == 2


@pytest.mark.parametrize("region", ["scotland", "0", "18", "EN2 1AB", ""])
def test_uk_region_is_validated(region: str) -> None:
    with pytest.raises(CarbonConfigError, match="outward code"):
        UKCarbonIntensityProvider(region)
