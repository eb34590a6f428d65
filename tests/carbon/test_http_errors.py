"""Failure handling shared by every web provider, and that no credential ever leaks.

Each case runs against Electricity Maps, WattTime and the UK API, served by a real local
HTTP server: 401, 403, 429 with Retry-After, 500, timeouts, malformed JSON, empty data.
"""

from __future__ import annotations

import json
import logging
import pickle
import traceback
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from carbon.errors import (
    AuthError,
    BadResponseError,
    CarbonError,
    NoDataError,
    ProviderUnavailableError,
    QuotaError,
)
from carbon.providers.base import Secret
from carbon.providers.electricitymaps import ElectricityMapsProvider
from carbon.providers.uk import UKCarbonIntensityProvider
from carbon.providers.watttime import WattTimeProvider
from tests.carbon.conftest import ApiServer, FakeSleep, Reply

TOKEN = "tok-PLANTED-9c41e7b2"
PASSWORD = "pw-PLANTED-77aa01"
WT_TOKEN = "wt-bearer-PLANTED-31d0"

LATEST_PATH = {
    "electricitymaps": "/v3/carbon-intensity/latest",
    "watttime": "/v3/forecast",
    "uk": "/intensity",
}
GOOD_FILE = {
    "electricitymaps": "electricitymaps/em_v3_latest_US-MIDW-MISO_direct.json",
    "watttime": "watttime/aiowatttime_forecasted_emissions_response.json",
    "uk": "uk_carbonintensity/uk_intensity_current.json",
}
EMPTY_BODY = {
    "electricitymaps": {"zone": "DE", "history": []},
    "watttime": {"data": [], "meta": {"units": "lbs_co2_per_mwh"}},
    "uk": {"data": []},
}

WebProvider = ElectricityMapsProvider | WattTimeProvider | UKCarbonIntensityProvider
Factory = Callable[..., WebProvider]


def _factory(name: str, server: ApiServer) -> Factory:
    def make(**kw: Any) -> WebProvider:
        kw.setdefault("timeout_s", (2.0, 2.0))
        if name == "electricitymaps":
            return ElectricityMapsProvider("DE", TOKEN, base_url=server.url + "/v3", **kw)
        if name == "watttime":
            server.route("/login", Reply.json({"token": WT_TOKEN}))
            return WattTimeProvider("CAISO_NORTH", "user", PASSWORD, base_url=server.url, **kw)
        return UKCarbonIntensityProvider("national", base_url=server.url, **kw)

    return make


@pytest.fixture(params=["electricitymaps", "watttime", "uk"])
def provider_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_429_honours_retry_after(
    provider_name: str, api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    path = LATEST_PATH[provider_name]
    api_server.route(
        path,
        Reply.json({"error": "slow down"}, 429, headers={"Retry-After": "7"}),
        Reply.file(api_dir / GOOD_FILE[provider_name]),
    )
    provider = _factory(provider_name, api_server)(sleep=fake_sleep)
    point = provider.latest()
    assert point.intensity_g_per_kwh > 0
    assert fake_sleep.calls == [7.0]
    assert len(api_server.requests_to(path)) == 2


def test_429_exhausted_raises_quota_error(
    provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        LATEST_PATH[provider_name],
        Reply.json({"error": "quota"}, 429, headers={"Retry-After": "3"}),
    )
    provider = _factory(provider_name, api_server)(sleep=fake_sleep, max_retries=2)
    with pytest.raises(QuotaError) as info:
        provider.latest()
    assert info.value.retry_after_s == 3.0 and info.value.status == 429
    assert fake_sleep.calls == [3.0, 3.0]


def test_retry_after_too_long_is_not_slept(
    provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        LATEST_PATH[provider_name],
        Reply.json({"error": "quota"}, 429, headers={"Retry-After": "3600"}),
    )
    provider = _factory(provider_name, api_server)(sleep=fake_sleep, max_retry_after_s=60.0)
    with pytest.raises(QuotaError, match="3600"):
        provider.latest()
    assert fake_sleep.calls == []


def test_500_is_retried_with_backoff_then_unavailable(
    provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep
) -> None:
    path = LATEST_PATH[provider_name]
    api_server.route(path, Reply.json({"error": "boom"}, 500))
    provider = _factory(provider_name, api_server)(sleep=fake_sleep, max_retries=3, backoff_s=0.5)
    with pytest.raises(ProviderUnavailableError) as info:
        provider.latest()
    assert info.value.status == 500
    assert fake_sleep.calls == [0.5, 1.0, 2.0]
    assert len(api_server.requests_to(path)) == 4


def test_500_then_success(
    provider_name: str, api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        LATEST_PATH[provider_name],
        Reply(503, b"<html>busy</html>"),
        Reply.file(api_dir / GOOD_FILE[provider_name]),
    )
    provider = _factory(provider_name, api_server)(sleep=fake_sleep)
    assert provider.latest().intensity_g_per_kwh > 0
    assert len(fake_sleep.calls) == 1


def test_timeout_is_retried_then_unavailable(
    provider_name: str, api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    path = LATEST_PATH[provider_name]
    api_server.route(path, Reply.file(api_dir / GOOD_FILE[provider_name], delay_s=0.3))
    provider = _factory(provider_name, api_server)(
        sleep=fake_sleep, max_retries=1, timeout_s=(1.0, 0.05)
    )
    with pytest.raises(ProviderUnavailableError, match="timeouts"):
        provider.latest()
    assert len(fake_sleep.calls) == 1
    assert len(api_server.requests_to(path)) == 2


def test_connection_refused_is_unavailable(provider_name: str, fake_sleep: FakeSleep) -> None:
    kw: dict[str, Any] = {"sleep": fake_sleep, "max_retries": 1, "base_url": "http://127.0.0.1:9"}
    provider: WebProvider
    if provider_name == "electricitymaps":
        provider = ElectricityMapsProvider("DE", TOKEN, **kw)
    elif provider_name == "watttime":
        provider = WattTimeProvider("CAISO_NORTH", "user", PASSWORD, **kw)
    else:
        provider = UKCarbonIntensityProvider("national", **kw)
    with pytest.raises(ProviderUnavailableError, match="cannot reach"):
        provider.latest()


def test_malformed_json(provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep) -> None:
    api_server.route(
        LATEST_PATH[provider_name],
        Reply(200, b'{"data": [', {"Content-Type": "application/json"}),
    )
    provider = _factory(provider_name, api_server)(sleep=fake_sleep)
    with pytest.raises(BadResponseError, match="not valid JSON"):
        provider.latest()
    assert fake_sleep.calls == []


def test_empty_data(provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep) -> None:
    path = LATEST_PATH[provider_name]
    if provider_name == "electricitymaps":
        path = "/v3/carbon-intensity/history"
    api_server.route(path, Reply.json(EMPTY_BODY[provider_name]))
    provider = _factory(provider_name, api_server)(sleep=fake_sleep)
    with pytest.raises(NoDataError):
        if provider_name == "electricitymaps":
            now = datetime.now(timezone.utc)
            provider.history(now - timedelta(hours=2), now)
        else:
            provider.latest()


def test_401_is_auth_error(
    provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep
) -> None:
    api_server.route(LATEST_PATH[provider_name], Reply.json({"error": "unauthorized"}, 401))
    provider = _factory(provider_name, api_server)(sleep=fake_sleep)
    with pytest.raises(AuthError) as info:
        provider.latest()
    assert info.value.status == 401


def test_403_is_typed(provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep) -> None:
    api_server.route(LATEST_PATH[provider_name], Reply.json({"error": "forbidden"}, 403))
    provider = _factory(provider_name, api_server)(sleep=fake_sleep)
    with pytest.raises(CarbonError) as info:
        provider.latest()
    expected = {
        "electricitymaps": "RegionNotInPlanError",
        "watttime": "RegionNotInPlanError",
        "uk": "AuthError",
    }
    assert type(info.value).__name__ == expected[provider_name]


def test_redirect_is_not_followed(
    provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep
) -> None:
    api_server.route(
        LATEST_PATH[provider_name], Reply(302, b"", {"Location": "http://127.0.0.1:9/steal"})
    )
    provider = _factory(provider_name, api_server)(sleep=fake_sleep)
    with pytest.raises(BadResponseError, match="redirect"):
        provider.latest()


def test_secret_does_not_show() -> None:
    secret = Secret(TOKEN)
    assert TOKEN not in repr(secret) and TOKEN not in str(secret) and TOKEN not in f"{secret}"
    assert secret.reveal() == TOKEN
    with pytest.raises(TypeError):
        pickle.dumps(secret)


def test_planted_credentials_never_leak(
    api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep, caplog: pytest.LogCaptureFixture
) -> None:
    """Run successes and every failure with urllib3 DEBUG logging on; no credential may
    appear in a log record, an exception message or traceback, or a repr."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="urllib3")
    texts: list[str] = []
    em = ElectricityMapsProvider(
        "DE",
        TOKEN,
        base_url=api_server.url + "/v3",
        sleep=fake_sleep,
        timeout_s=(1.0, 0.05),
        max_retries=1,
    )
    api_server.route("/login", Reply.json({"token": WT_TOKEN}))
    wt = WattTimeProvider(
        "CAISO_NORTH",
        "user",
        PASSWORD,
        base_url=api_server.url,
        sleep=fake_sleep,
        timeout_s=(1.0, 0.05),
        max_retries=1,
    )
    good_em = Reply.file(api_dir / GOOD_FILE["electricitymaps"])
    good_wt = Reply.file(api_dir / GOOD_FILE["watttime"])
    # An error body echoing the credential must be scrubbed from the message.
    echo_em = Reply.json({"error": f"bad token {TOKEN}"}, 400)
    echo_wt = Reply.json({"error": f"bad token {WT_TOKEN}"}, 400)
    scenarios = [
        good_em,
        Reply.json({"error": "no"}, 401),
        Reply.json({"error": "no"}, 403),
        Reply.json({"error": "quota"}, 429, headers={"Retry-After": "1"}),
        Reply.json({"error": "boom"}, 500),
        Reply(200, b"{not json", {"Content-Type": "application/json"}),
        Reply(200, b"{}", {"Content-Type": "application/json"}, delay_s=0.3),
    ]
    for provider, path, good, echo in (
        (em, LATEST_PATH["electricitymaps"], good_em, echo_em),
        (wt, LATEST_PATH["watttime"], good_wt, echo_wt),
    ):
        for reply in [good, *scenarios[1:], echo]:
            api_server.route(path, reply)
            try:
                provider.latest()
            except CarbonError as exc:
                texts.append(str(exc))
                texts.append(repr(exc))
                texts.append("".join(traceback.format_exception(exc)))
        texts.append(repr(provider))
    texts.extend(record.getMessage() for record in caplog.records)
    texts.extend(s.raw_target for s in api_server.seen)
    assert any("urllib3" in r.name for r in caplog.records), "urllib3 DEBUG logging was not on"
    assert "token=***" in repr(em) and "password=***" in repr(wt)
    for text in texts:
        for secret in (TOKEN, PASSWORD, WT_TOKEN):
            assert secret not in text, text
    # and yet the credentials were sent, in headers
    assert any(s.headers.get("auth-token") == TOKEN for s in api_server.seen)
    assert any(s.headers.get("Authorization") == f"Bearer {WT_TOKEN}" for s in api_server.seen)


@pytest.mark.parametrize("offset", [0, 150, 190, 195, 199, 250])
def test_plain_text_5xx_body_never_leaks_a_token_prefix(
    provider_name: str,
    api_server: ApiServer,
    fake_sleep: FakeSleep,
    caplog: pytest.LogCaptureFixture,
    offset: int,
) -> None:
    """A long plain-text error body echoing the credential, cut where the excerpt ends:
    neither the credential nor a prefix of it may show."""
    secret = {"electricitymaps": TOKEN, "watttime": WT_TOKEN, "uk": "uk-no-secret"}[provider_name]
    body = ("e" * offset + secret + " trailing words" * 30).encode()
    caplog.set_level(logging.DEBUG)
    api_server.route(LATEST_PATH[provider_name], Reply(503, body, {"Content-Type": "text/plain"}))
    provider = _factory(provider_name, api_server)(sleep=fake_sleep, max_retries=1)
    with pytest.raises(ProviderUnavailableError) as info:
        provider.latest()
    texts = [str(info.value), *(r.getMessage() for r in caplog.records)]
    assert "server error: " in texts[0] and texts[0].count("trailing") < 30  # shortened
    for text in texts:
        for leaked in (TOKEN[:6], WT_TOKEN[:6], PASSWORD[:6]):
            assert leaked not in text, text


def test_credentials_in_base_url_are_masked(
    provider_name: str, api_server: ApiServer, api_dir: Path, fake_sleep: FakeSleep
) -> None:
    """A proxy password in base_url is used but never shown: repr, attribute, errors."""
    proxy_password = "proxy-PW-PLANTED-5e1f"
    port = api_server.url.rsplit(":", 1)[1]
    creds_url = f"http://proxyuser:{proxy_password}@127.0.0.1:{port}"
    kw: dict[str, Any] = {"sleep": fake_sleep, "max_retries": 0, "timeout_s": (2.0, 2.0)}
    provider: WebProvider
    if provider_name == "electricitymaps":
        provider = ElectricityMapsProvider("DE", TOKEN, base_url=creds_url + "/v3", **kw)
    elif provider_name == "watttime":
        api_server.route("/login", Reply.json({"token": WT_TOKEN}))
        provider = WattTimeProvider("CAISO_NORTH", "user", PASSWORD, base_url=creds_url, **kw)
    else:
        provider = UKCarbonIntensityProvider("national", base_url=creds_url, **kw)
    path = LATEST_PATH[provider_name]
    api_server.route(path, Reply.file(api_dir / GOOD_FILE[provider_name]))
    assert provider.latest().intensity_g_per_kwh > 0  # the URL works
    texts = [repr(provider), provider.base_url]
    api_server.route(path, Reply(500, f"proxy says {proxy_password}".encode()))
    with pytest.raises(ProviderUnavailableError) as info:
        provider.latest()
    texts.append("".join(traceback.format_exception(info.value)))
    refused = type(provider)(
        *{"electricitymaps": ("DE", TOKEN), "watttime": ("CAISO_NORTH", "u", PASSWORD)}.get(
            provider_name, ("national",)
        ),
        base_url=f"http://proxyuser:{proxy_password}@127.0.0.1:9",
        **kw,
    )
    with pytest.raises(ProviderUnavailableError, match="cannot reach") as info:
        refused.latest()
    texts.append("".join(traceback.format_exception(info.value)))
    assert "***@127.0.0.1" in repr(provider) and "***@127.0.0.1:9" in str(info.value)
    for text in texts:
        assert proxy_password not in text and "proxyuser" not in text, text


@pytest.mark.parametrize("value", [-12.5, "NaN", "Infinity", "-Infinity", True, "abc"])
def test_impossible_intensity_is_a_bad_response(
    provider_name: str, api_server: ApiServer, fake_sleep: FakeSleep, value: object
) -> None:
    """Negative, NaN and infinite values (JSON parsers accept NaN and Infinity) are not
    intensities: the answer is a BadResponseError, never a point."""
    literal = value if isinstance(value, str) and value[-1] in "Ny" else json.dumps(value)
    if provider_name == "electricitymaps":
        body = (
            '{"zone": "DE", "datetime": "2024-03-05T20:00:00.000Z", '
            f'"carbonIntensity": {literal}, "isEstimated": false}}'
        )
    elif provider_name == "watttime":
        body = (
            '{"data": [{"point_time": "2024-03-05T20:00:00+00:00", '
            f'"value": {literal}}}], "meta": {{"units": "lbs_co2_per_mwh"}}}}'
        )
    else:
        body = (
            '{"data": [{"from": "2024-03-05T20:00Z", "to": "2024-03-05T20:30Z", '
            f'"intensity": {{"forecast": {literal}, "actual": {literal}, "index": "low"}}}}]}}'
        )
    api_server.route(
        LATEST_PATH[provider_name], Reply(200, body.encode(), {"Content-Type": "application/json"})
    )
    provider = _factory(provider_name, api_server)(sleep=fake_sleep)
    with pytest.raises(BadResponseError, match="intensity"):
        provider.latest()
