"""Electricity Maps v3 against recorded answers served by a local HTTP server."""

from __future__ import annotations

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
from carbon.providers.electricitymaps import ElectricityMapsProvider
from carbon.types import PointKind
from tests.carbon.conftest import ApiServer, FakeSleep, Reply

TOKEN = "em-tok-PLANTED-5f1d2c"
EM = "electricitymaps"


def make(
    server: ApiServer, sleep: FakeSleep, region: str = "US-MIDW-MISO", **kw: Any
) -> ElectricityMapsProvider:
    return ElectricityMapsProvider(
        region, TOKEN, base_url=server.url + "/v3", sleep=sleep, timeout_s=(2.0, 2.0), **kw
    )


def test_latest_direct_sends_token_in_header_only(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v3/carbon-intensity/latest",
        Reply.file(api_dir / EM / "em_v3_latest_US-MIDW-MISO_direct.json"),
    )
    point = make(api_server, fake_sleep).latest()
    assert point.intensity_g_per_kwh == 506.0
    assert point.time == datetime(2024, 9, 27, tzinfo=timezone.utc)
    assert point.kind is PointKind.ESTIMATED  # isEstimated: true
    assert point.source == "electricitymaps:US-MIDW-MISO"
    (seen,) = api_server.requests_to("/v3/carbon-intensity/latest")
    assert seen.headers["auth-token"] == TOKEN
    assert TOKEN not in seen.raw_target
    assert seen.query == {"zone": ["US-MIDW-MISO"], "emissionFactorType": ["direct"]}


def test_latest_lifecycle_and_disable_estimations(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v3/carbon-intensity/latest",
        Reply.file(api_dir / EM / "em_v3_latest_US-MIDW-MISO_lifecycle.json"),
    )
    provider = make(api_server, fake_sleep, emission_factor="lifecycle", disable_estimations=True)
    assert provider.latest().intensity_g_per_kwh == 466.0
    (seen,) = api_server.requests_to("/v3/carbon-intensity/latest")
    assert seen.query["emissionFactorType"] == ["lifecycle"]
    assert seen.query["disableEstimations"] == ["true"]


def test_latest_by_coordinates(api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep) -> None:
    api_server.route(
        "/v3/carbon-intensity/latest",
        Reply.file(api_dir / EM / "aioelectricitymaps_latest_carbon_intensity.json"),
    )
    point = make(api_server, fake_sleep, region="35.78,-78.64").latest()
    assert point.intensity_g_per_kwh == 216.0
    assert point.source == "electricitymaps:US-CAR-DUK"
    (seen,) = api_server.requests_to("/v3/carbon-intensity/latest")
    assert seen.query["lat"] == ["35.78"] and seen.query["lon"] == ["-78.64"]
    assert "zone" not in seen.query


def test_history_last_24h(api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep) -> None:
    api_server.route(
        "/v3/carbon-intensity/history",
        Reply.file(api_dir / EM / "em_v3_history_US-MIDW-MISO_2024-11-30.json"),
    )
    now = datetime(2024, 12, 1, 6, tzinfo=timezone.utc)
    provider = make(api_server, fake_sleep, now=lambda: now)
    points = provider.history(now - timedelta(hours=24), now)
    assert len(points) == 24
    assert points[0].time == datetime(2024, 11, 30, 6, tzinfo=timezone.utc)
    assert points[0].intensity_g_per_kwh == 501.0 and points[0].kind is PointKind.ESTIMATED
    assert points[1].intensity_g_per_kwh == 419.0 and points[1].kind is PointKind.MEASURED
    assert [p.time for p in points] == sorted(p.time for p in points)
    # a narrower range is filtered client-side
    assert len(provider.history(now - timedelta(hours=3), now)) == 3


def test_history_older_uses_past_range(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v3/carbon-intensity/past-range",
        Reply.file(api_dir / EM / "if-electricitymaps_past-range_DK-DK2.json"),
    )
    provider = make(
        api_server,
        fake_sleep,
        region="DK-DK2",
        now=lambda: datetime(2025, 1, 1, tzinfo=timezone.utc),
    )
    start = datetime(2024, 3, 18, 2, tzinfo=timezone.utc)
    points = provider.history(start, start + timedelta(hours=2))
    assert [p.intensity_g_per_kwh for p in points] == [161.0, 167.0]
    (seen,) = api_server.requests_to("/v3/carbon-intensity/past-range")
    assert seen.query["start"] == ["2024-03-18T02:00:00Z"]
    assert seen.query["end"] == ["2024-03-18T04:00:00Z"]


def test_history_longer_than_ten_days_is_split(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v3/carbon-intensity/past-range",
        Reply.file(api_dir / EM / "if-electricitymaps_past-range_DK-DK2.json"),
    )
    provider = make(
        api_server,
        fake_sleep,
        region="DK-DK2",
        now=lambda: datetime(2025, 1, 1, tzinfo=timezone.utc),
    )
    start = datetime(2024, 3, 10, tzinfo=timezone.utc)
    points = provider.history(start, start + timedelta(days=25))
    assert len(api_server.requests_to("/v3/carbon-intensity/past-range")) == 3
    assert len(points) == 2  # the same two records, deduplicated


def test_forecast(api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep) -> None:
    api_server.route(
        "/v3/carbon-intensity/forecast",
        Reply.file(api_dir / EM / "green-elephpant_forecast_DE_2023-05-02.json"),
    )
    now = datetime(2023, 5, 2, 20, 10, tzinfo=timezone.utc)
    provider = make(api_server, fake_sleep, region="DE", now=lambda: now)
    everything = provider.forecast()
    assert everything[0].intensity_g_per_kwh == 557.0
    assert everything[0].time == datetime(2023, 5, 2, 20, tzinfo=timezone.utc)
    assert all(p.kind is PointKind.FORECAST for p in everything)
    assert len(everything) > 24
    six_hours = provider.forecast(6 * 3600)
    assert [p.intensity_g_per_kwh for p in six_hours] == [557, 552, 538, 527, 520, 512, 537]


def test_no_data_answers(api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep) -> None:
    provider = make(api_server, fake_sleep, region="DE")
    api_server.route(
        "/v3/carbon-intensity/latest",
        Reply.file(api_dir / EM / "aioelectricitymaps_no-data-response.json"),
    )
    with pytest.raises(NoDataError):
        provider.latest()
    api_server.route(
        "/v3/carbon-intensity/latest",
        Reply.file(api_dir / EM / "em_v3_latest_error_no_recent_data.json", status=404),
    )
    with pytest.raises(NoDataError, match="No recent data"):
        provider.latest()
    api_server.route("/v3/carbon-intensity/history", Reply.json({"zone": "DE", "history": []}))
    with pytest.raises(NoDataError):
        provider.history(
            datetime.now(timezone.utc) - timedelta(hours=1), datetime.now(timezone.utc)
        )


def test_auth_and_plan_errors(api_server: ApiServer, fake_sleep: FakeSleep) -> None:
    provider = make(api_server, fake_sleep, region="DE")
    api_server.route("/v3/carbon-intensity/latest", Reply.json({"message": "Invalid token"}, 401))
    with pytest.raises(AuthError) as auth:
        provider.latest()
    assert auth.value.status == 401 and auth.value.provider == "electricitymaps"
    api_server.route("/v3/carbon-intensity/forecast", Reply(403, b"Access denied"))
    with pytest.raises(RegionNotInPlanError, match="'DE'"):
        provider.forecast()
    assert fake_sleep.calls == []  # client errors are not retried


def test_bad_shapes(api_server: ApiServer, fake_sleep: FakeSleep) -> None:
    provider = make(api_server, fake_sleep, region="DE")
    api_server.route(
        "/v3/carbon-intensity/latest",
        Reply.json({"zone": "DE", "carbonIntensity": "n/a", "datetime": "2024-01-01T00:00Z"}),
    )
    with pytest.raises(BadResponseError, match="malformed"):
        provider.latest()
    api_server.route("/v3/carbon-intensity/forecast", Reply.json({"zone": "DE"}))
    with pytest.raises(BadResponseError, match="'forecast' list"):
        provider.forecast()


def test_region_is_validated() -> None:
    with pytest.raises(CarbonConfigError, match="zone key"):
        ElectricityMapsProvider("germany", TOKEN)
    with pytest.raises(CarbonConfigError, match="emission_factor"):
        ElectricityMapsProvider("DE", TOKEN, emission_factor="mixed")  # type: ignore[arg-type]
