"""Electricity Maps v4 (the default) and v3 against answers served by a local HTTP server."""

from __future__ import annotations

import itertools
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
    assert seen.query == {
        "zone": ["US-MIDW-MISO"],
        "emissionFactorType": ["direct"],
        "disableCallerLookup": ["true"],
    }


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
    point = make(
        api_server, fake_sleep, region="35.78,-78.64", emission_factor="lifecycle"
    ).latest()
    assert point.intensity_g_per_kwh == 216.0
    assert point.source == "electricitymaps:US-CAR-DUK"
    (seen,) = api_server.requests_to("/v3/carbon-intensity/latest")
    assert seen.query["lat"] == ["35.78"] and seen.query["lon"] == ["-78.64"]
    assert "zone" not in seen.query
    assert seen.query["disableCallerLookup"] == ["true"]


def test_history_last_24h(api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep) -> None:
    api_server.route(
        "/v3/carbon-intensity/history",
        Reply.file(api_dir / EM / "em_v3_history_US-MIDW-MISO_2024-11-30.json"),
    )
    now = datetime(2024, 12, 1, 6, tzinfo=timezone.utc)
    provider = make(api_server, fake_sleep, now=lambda: now, emission_factor="lifecycle")
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
        emission_factor="lifecycle",
    )
    start = datetime(2024, 3, 18, 2, tzinfo=timezone.utc)
    points = provider.history(start, start + timedelta(hours=2))
    assert [p.intensity_g_per_kwh for p in points] == [161.0, 167.0]
    (seen,) = api_server.requests_to("/v3/carbon-intensity/past-range")
    assert seen.query["start"] == ["2024-03-18T02:00:00Z"]
    assert seen.query["end"] == ["2024-03-18T04:00:00Z"]
    assert seen.query["zone"] == ["DK-DK2"] and seen.query["disableCallerLookup"] == ["true"]


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
        emission_factor="lifecycle",
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
    for seen in api_server.requests_to("/v3/carbon-intensity/forecast"):
        # v3 takes no horizon, and it too must answer for the zone, not the caller's IP
        assert seen.query == {
            "zone": ["DE"],
            "emissionFactorType": ["direct"],
            "disableCallerLookup": ["true"],
        }


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


# -- v4 ---------------------------------------------------------------------------------

V4_NOW = datetime(2026, 2, 10, 14, 20, tzinfo=timezone.utc)


def make_v4(
    server: ApiServer, sleep: FakeSleep, region: str = "DE", **kw: Any
) -> ElectricityMapsProvider:
    return ElectricityMapsProvider(
        region,
        TOKEN,
        base_url=server.url + "/v4",
        sleep=sleep,
        timeout_s=(2.0, 2.0),
        **{"now": lambda: V4_NOW, **kw},
    )


def test_v4_is_the_default_api() -> None:
    provider = ElectricityMapsProvider("DE", TOKEN)
    assert provider.api_version == "v4"
    assert provider.base_url == "https://api.electricitymaps.com/v4"
    assert ElectricityMapsProvider("DE", TOKEN, api_version="v3").base_url.endswith("/v3")


@pytest.mark.parametrize(("factor", "grams"), [("lifecycle", 75.0), ("direct", 20.0)])
def test_v4_latest_names_the_factor_and_never_the_callers_location(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep, factor: str, grams: float
) -> None:
    api_server.route(
        "/v4/carbon-intensity/latest",
        Reply.file(api_dir / EM / f"em_v4_latest_DK-DK2_{factor}.json"),
    )
    point = make_v4(api_server, fake_sleep, region="DK-DK2", emission_factor=factor).latest()
    assert point.intensity_g_per_kwh == grams
    assert point.time == datetime(2026, 2, 10, 13, tzinfo=timezone.utc)
    assert point.kind is PointKind.MEASURED
    (seen,) = api_server.requests_to("/v4/carbon-intensity/latest")
    assert seen.query == {
        "zone": ["DK-DK2"],
        "emissionFactorType": [factor],
        "disableCallerLookup": ["true"],
    }
    assert seen.headers["auth-token"] == TOKEN and TOKEN not in seen.raw_target


def test_v4_coordinates_never_fall_back_to_the_callers_location(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v4/carbon-intensity/latest", Reply.file(api_dir / EM / "em_v4_latest_DK-DK2_direct.json")
    )
    make_v4(api_server, fake_sleep, region="55.68,12.57").latest()
    (seen,) = api_server.requests_to("/v4/carbon-intensity/latest")
    assert seen.query["lat"] == ["55.68"] and seen.query["lon"] == ["12.57"]
    assert seen.query["disableCallerLookup"] == ["true"]


@pytest.mark.parametrize("asked", ["lifecycle", "direct"])
def test_an_answer_in_another_emission_factor_is_refused(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep, asked: str
) -> None:
    other = "direct" if asked == "lifecycle" else "lifecycle"
    api_server.route(
        "/v4/carbon-intensity/latest",
        Reply.file(api_dir / EM / f"em_v4_latest_DK-DK2_{other}.json"),
    )
    with pytest.raises(BadResponseError, match=f"asked for '{asked}'.*'{other}'"):
        make_v4(api_server, fake_sleep, region="DK-DK2", emission_factor=asked).latest()
    # the forecast's own factor (at the top of the body) is checked too
    api_server.route(
        "/v4/carbon-intensity/forecast",
        Reply.file(api_dir / EM / "em_v4_forecast_DE_direct_72h.json"),
    )
    provider = make_v4(api_server, fake_sleep, emission_factor=asked)
    if asked == "direct":
        assert len(provider.forecast()) == 72
    else:
        with pytest.raises(BadResponseError, match="asked for 'lifecycle'"):
            provider.forecast()


@pytest.mark.parametrize(
    ("horizon_h", "asked_h", "kept"),
    [(None, "72", 72), (100.0, "72", 72), (72.0, "72", 72), (30.0, "48", 31), (6.0, "6", 7)],
)
def test_v4_forecast_asks_for_the_horizon_it_needs(
    api_server: ApiServer,
    api_dir: Path,
    fake_sleep: FakeSleep,
    horizon_h: float | None,
    asked_h: str,
    kept: int,
) -> None:
    api_server.route(
        "/v4/carbon-intensity/forecast",
        Reply.file(api_dir / EM / "em_v4_forecast_DE_direct_72h.json"),
    )
    provider = make_v4(api_server, fake_sleep)
    points = provider.forecast(None if horizon_h is None else horizon_h * 3600.0)
    (seen,) = api_server.requests_to("/v4/carbon-intensity/forecast")
    assert seen.query["horizonHours"] == [asked_h]
    assert seen.query["disableCallerLookup"] == ["true"]
    assert len(points) == kept
    assert points[0].time == datetime(2026, 2, 10, 14, tzinfo=timezone.utc)
    assert points[0].intensity_g_per_kwh == 406.0
    assert all(p.kind is PointKind.FORECAST for p in points)


def test_v4_forecast_of_15_minute_rows(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v4/carbon-intensity/forecast",
        Reply.file(api_dir / EM / "em_v4_forecast_DE_direct_15min.json"),
    )
    points = make_v4(api_server, fake_sleep).forecast(3600.0)
    # now is 14:20: the quarter from 14:00 is in force, those from 15:20 on are cut
    assert [p.time.minute for p in points] == [0, 15, 30, 45, 0, 15]
    assert [p.intensity_g_per_kwh for p in points] == [280, 278, 276, 274, 272, 270]


def test_v4_history_and_past_range(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v4/carbon-intensity/history", Reply.file(api_dir / EM / "em_v4_history_DE_direct.json")
    )
    api_server.route(
        "/v4/carbon-intensity/past-range",
        Reply.file(api_dir / EM / "em_v4_past-range_DE_direct.json"),
    )
    provider = make_v4(api_server, fake_sleep)
    recent = provider.history(V4_NOW - timedelta(hours=24), V4_NOW)
    assert len(recent) == 23  # the hour from 14:00 the day before starts before the range
    assert [p.kind for p in recent[-3:]] == [
        PointKind.MEASURED,
        PointKind.ESTIMATED,
        PointKind.ESTIMATED,
    ]
    start = datetime(2026, 1, 5, tzinfo=timezone.utc)
    older = provider.history(start, start + timedelta(hours=3))
    assert [p.intensity_g_per_kwh for p in older] == [412.0, 405.0, 398.0]
    (seen,) = api_server.requests_to("/v4/carbon-intensity/past-range")
    assert seen.query["start"] == ["2026-01-05T00:00:00Z"]
    assert seen.query["disableCallerLookup"] == ["true"]


def test_the_last_day_comes_from_history_on_a_clock_that_moves(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    """A caller asks for "the last 24 hours" from its own reading of the clock, which is
    earlier than the provider's: the free tier's ``/history`` must still answer it, not
    ``/past-range`` (outside the free tier: a 401 and no history at all)."""
    api_server.route(
        "/v4/carbon-intensity/history", Reply.file(api_dir / EM / "em_v4_history_DE_direct.json")
    )
    api_server.route(
        "/v4/carbon-intensity/past-range", Reply.json({"message": "Unauthorized"}, 401)
    )
    ticks = itertools.count()

    def clock() -> datetime:
        return V4_NOW + timedelta(seconds=next(ticks))

    provider = make_v4(api_server, fake_sleep, now=clock)
    now = clock()
    recent = provider.history(now - timedelta(hours=24), now)
    assert len(recent) == 23
    assert len(api_server.requests_to("/v4/carbon-intensity/history")) == 1
    assert api_server.requests_to("/v4/carbon-intensity/past-range") == []


def test_a_401_after_the_token_was_accepted_is_the_plan_not_the_token(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v4/carbon-intensity/latest", Reply.file(api_dir / EM / "em_v4_latest_DK-DK2_direct.json")
    )
    api_server.route(
        "/v4/carbon-intensity/forecast", Reply.json({"message": f"Unauthorized {TOKEN}"}, 401)
    )
    provider = make_v4(api_server, fake_sleep, region="DK-DK2")
    provider.latest()
    with pytest.raises(RegionNotInPlanError) as err:
        provider.forecast()
    text = str(err.value)
    assert "/carbon-intensity/forecast" in text and "'DK-DK2'" in text
    assert "token itself was accepted" in text
    assert TOKEN not in text and err.value.status == 401
    assert fake_sleep.calls == []


def test_a_first_401_may_be_the_token_or_the_plan_and_says_both(
    api_server: ApiServer, fake_sleep: FakeSleep
) -> None:
    api_server.route("/v4/carbon-intensity/latest", Reply.json({"message": "Unauthorized"}, 401))
    with pytest.raises(AuthError) as err:
        make_v4(api_server, fake_sleep).latest()
    text = str(err.value)
    assert "token was rejected" in text and "plan does not include" in text
    assert "/carbon-intensity/latest" in text and TOKEN not in text


def test_past_range_outside_the_plan_says_that_a_replay_needs_a_trace(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        "/v4/carbon-intensity/latest", Reply.file(api_dir / EM / "em_v4_latest_DK-DK2_direct.json")
    )
    api_server.route(
        "/v4/carbon-intensity/past-range", Reply.json({"message": "Unauthorized"}, 401)
    )
    provider = make_v4(api_server, fake_sleep)
    provider.latest()
    start = datetime(2026, 1, 5, tzinfo=timezone.utc)
    with pytest.raises(RegionNotInPlanError, match=r"no past-range.*provider: trace"):
        provider.history(start, start + timedelta(hours=3))


def test_api_version_is_validated_against_the_base_url() -> None:
    with pytest.raises(
        CarbonConfigError, match="api_version: 'v5' is not allowed; allowed: v4, v3"
    ):
        ElectricityMapsProvider("DE", TOKEN, api_version="v5")  # type: ignore[arg-type]
    with pytest.raises(CarbonConfigError, match="ends in '/v3'"):
        ElectricityMapsProvider("DE", TOKEN, api_version="v4", base_url="http://proxy/v3")
    assert ElectricityMapsProvider("DE", TOKEN, base_url="http://proxy/v3/").api_version == "v3"
    assert ElectricityMapsProvider("DE", TOKEN, base_url="http://proxy").api_version == "v4"
