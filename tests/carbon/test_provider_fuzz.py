"""Property-based tests of the web providers' answers: whatever JSON (or not) a server
sends, with whatever status, a provider returns valid points or raises a typed
:class:`~carbon.errors.ProviderError`, never another exception, and its message never
holds a credential. Served by a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carbon.errors import ProviderError
from carbon.providers.electricitymaps import ElectricityMapsProvider
from carbon.providers.uk import UKCarbonIntensityProvider
from carbon.providers.watttime import WattTimeProvider
from carbon.types import IntensityPoint
from tests.carbon.conftest import ApiServer, Reply

TOKEN = "tok-FUZZ-PLANTED-71c9e2"
PASSWORD = "pw-FUZZ-PLANTED-0d3a"
WT_TOKEN = "wt-FUZZ-PLANTED-b84f"
PROXY_PASSWORD = "proxy-FUZZ-PLANTED-5aa1"
SECRETS = (TOKEN, PASSWORD, WT_TOKEN, PROXY_PASSWORD)
#: The credentials each provider holds (and so must keep out of its messages).
OWN_SECRETS = {
    "electricitymaps": (TOKEN, PROXY_PASSWORD),
    "watttime": (PASSWORD, WT_TOKEN, PROXY_PASSWORD),
    "uk": (PROXY_PASSWORD,),
}
NOW = datetime(2024, 3, 5, 20, 0, tzinfo=timezone.utc)

KEYS = [
    "carbonIntensity", "datetime", "zone", "isEstimated", "history", "forecast", "data",
    "point_time", "value", "meta", "units", "region", "intensity", "from", "to", "actual",
    "generated_at", "status", "error", "message", "detail", "token", "imputed_data_used",
]  # fmt: skip

planted = st.sampled_from(SECRETS).flatmap(
    lambda s: st.sampled_from([s, f"bad token {s}", "x" * 190 + s, s + " " * 300])
)
times = st.datetimes(timezones=st.just(timezone.utc)).map(lambda t: t.isoformat())
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from([10**400, -(10**400)]),  # JSON integers beyond any float
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    planted,
    times,
    st.sampled_from(["lbs_co2_per_mwh", "g_co2_per_kwh", "percentile", "no-data", "NaN"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(
            st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), children, max_size=6
        ),
    ),
    max_leaves=25,
)


def _record(time_key: str, value_key: str) -> st.SearchStrategy[dict[str, Any]]:
    """A record of roughly the right shape, with values of any kind."""
    return st.fixed_dictionaries(
        {time_key: st.one_of(times, scalars), value_key: scalars},
        optional={"zone": scalars, "isEstimated": scalars, "imputed_data_used": scalars},
    )


def _near_valid(name: str) -> st.SearchStrategy[Any]:
    if name == "electricitymaps":
        record = _record("datetime", "carbonIntensity")
        return st.one_of(
            record,
            st.fixed_dictionaries({"zone": scalars, "forecast": st.lists(record, max_size=4)}),
        )
    if name == "watttime":
        record = _record("point_time", "value")
        meta = st.fixed_dictionaries({}, optional={"units": scalars, "region": scalars})
        data = st.one_of(
            st.lists(record, max_size=4),
            st.lists(
                st.fixed_dictionaries(
                    {"generated_at": scalars, "forecast": st.lists(record, max_size=3)}
                ),
                max_size=3,
            ),
        )
        return st.fixed_dictionaries({"data": data}, optional={"meta": meta})
    intensity = st.fixed_dictionaries({}, optional={"forecast": scalars, "actual": scalars})
    half_hour = st.fixed_dictionaries({"from": st.one_of(times, scalars), "intensity": intensity})
    return st.fixed_dictionaries(
        {
            "data": st.one_of(
                st.lists(half_hour, max_size=4),
                st.fixed_dictionaries({"data": st.lists(half_hour, max_size=4)}),
                st.lists(
                    st.fixed_dictionaries({"data": st.lists(half_hour, max_size=3)}), max_size=2
                ),
            )
        }
    )


def replies(name: str) -> st.SearchStrategy[Reply]:
    body = st.one_of(
        _near_valid(name).map(lambda v: json.dumps(v).encode()),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=300),
        planted.map(str.encode),
    )
    header_text = st.text(
        st.characters(min_codepoint=32, max_codepoint=126), max_size=40
    )  # what HTTP allows in a header
    return st.builds(
        Reply,
        status=st.sampled_from([200, 200, 200, 200, 204, 302, 400, 401, 403, 404, 429, 500, 503]),
        body=body,
        headers=st.fixed_dictionaries(
            {"Content-Type": st.sampled_from(["application/json", "text/plain", "text/html"])},
            optional={
                "Retry-After": st.one_of(
                    header_text,
                    st.sampled_from(["inf", "nan", "1e400", "Fri, 31 Dec 9999 23:59:59 GMT"]),
                )
            },
        ),
    )


def _provider(name: str, server: ApiServer) -> Any:
    port = server.url.rsplit(":", 1)[1]
    root = f"http://proxyuser:{PROXY_PASSWORD}@127.0.0.1:{port}"
    kw: dict[str, Any] = {"sleep": lambda s: None, "max_retries": 0, "timeout_s": (2.0, 2.0)}
    if name == "electricitymaps":
        return ElectricityMapsProvider("DE", TOKEN, base_url=root + "/v3", now=lambda: NOW, **kw)
    if name == "watttime":
        server.route("/login", Reply.json({"token": WT_TOKEN}))
        return WattTimeProvider("CAISO_NORTH", "user", PASSWORD, base_url=root, **kw)
    return UKCarbonIntensityProvider("national", base_url=root, now=lambda: NOW, **kw)


OPERATIONS: dict[str, dict[str, tuple[str, Callable[[Any], Any]]]] = {
    "electricitymaps": {
        "latest": ("/v3/carbon-intensity/latest", lambda p: [p.latest()]),
        "forecast": ("/v3/carbon-intensity/forecast", lambda p: p.forecast(86400.0)),
    },
    "watttime": {
        "latest": ("/v3/forecast", lambda p: [p.latest()]),
        "signal-index": ("/v3/signal-index", lambda p: p.signal_index()),
    },
    "uk": {
        "latest": ("/intensity", lambda p: [p.latest()]),
        "forecast": ("/intensity/2024-03-05T20:00Z/fw48h", lambda p: p.forecast(86400.0)),
    },
}
CASES = [(name, op) for name, ops in OPERATIONS.items() for op in ops]


def _check_error_text(name: str, exc: ProviderError) -> None:
    text = f"{exc} {exc!r}"
    for secret in OWN_SECRETS[name]:
        assert secret[:10] not in text, text


@pytest.mark.parametrize(("name", "operation"), CASES)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_answer_gives_points_or_a_typed_error(
    api_server: ApiServer, name: str, operation: str, data: st.DataObject
) -> None:
    path, call = OPERATIONS[name][operation]
    api_server.route(path, data.draw(replies(name)))
    provider = _provider(name, api_server)
    try:
        result = call(provider)
    except ProviderError as exc:
        _check_error_text(name, exc)
        return
    finally:
        provider.close()
    if operation == "signal-index":
        when, percentile = result
        assert when.tzinfo is not None and 0.0 <= percentile <= 100.0
        return
    assert result and all(isinstance(p, IntensityPoint) for p in result)
    for point in result:
        assert math.isfinite(point.intensity_g_per_kwh) and point.intensity_g_per_kwh >= 0
        assert point.time.tzinfo is timezone.utc


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_login_answer_gives_a_token_or_a_typed_error(
    api_server: ApiServer, data: st.DataObject
) -> None:
    provider = _provider("watttime", api_server)
    token_body = st.one_of(
        json_values,
        st.fixed_dictionaries({"token": st.one_of(scalars, st.text(max_size=40))}),
    )
    status = data.draw(st.sampled_from([200, 200, 401, 403, 500]))
    body = data.draw(token_body.map(lambda v: json.dumps(v).encode()))
    api_server.route("/login", Reply(status, body))
    api_server.route(
        "/v3/forecast", Reply.json({"data": [{"point_time": NOW.isoformat(), "value": 500.0}]})
    )
    try:
        point = provider.latest()
    except ProviderError as exc:
        if status == 200:
            _check_error_text("watttime", exc)
        else:  # a refused login hands out no token: the client holds only its password
            text = f"{exc} {exc!r}"
            assert PASSWORD[:10] not in text and PROXY_PASSWORD[:10] not in text, text
    else:
        assert point.intensity_g_per_kwh == pytest.approx(500.0 * 0.4536)
    finally:
        provider.close()


def test_absurdly_deep_json_is_a_bad_response(api_server: ApiServer) -> None:
    api_server.route("/intensity", Reply(200, b"[" * 100_000 + b"]" * 100_000))
    provider = _provider("uk", api_server)
    with pytest.raises(ProviderError, match="not valid JSON"):
        provider.latest()
    provider.close()
