"""The ``carbon:`` YAML section: validation (every problem at once) and the factories."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from carbon.config import (
    CarbonConfig,
    build_monitor,
    build_provider,
    load_carbon_config,
    parse_deadline,
)
from carbon.errors import CarbonConfigError
from carbon.providers.constant import ConstantProvider
from carbon.providers.electricitymaps import ElectricityMapsProvider
from carbon.providers.trace import TraceProvider
from carbon.providers.uk import UKCarbonIntensityProvider
from carbon.providers.watttime import WattTimeProvider
from carbon.types import ReadingStatus
from tests.carbon.conftest import ApiServer, Reply

UTC = timezone.utc
SECRET_VALUE = "em-secret-PLANTED-0b7e"

ISSUE_EXAMPLE = """\
carbon:
  provider: electricitymaps     # electricitymaps | watttime | uk | trace | constant
  region: DE
  token_env: ELECTRICITYMAPS_TOKEN
  poll_interval_s: 900
  max_staleness_s: 7200
  fallback_g_per_kwh: 400
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_documented_example_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELECTRICITYMAPS_TOKEN", SECRET_VALUE)
    config = load_carbon_config(write(tmp_path, ISSUE_EXAMPLE))
    assert config.provider == "electricitymaps" and config.region == "DE"
    assert (config.poll_interval_s, config.max_staleness_s) == (900, 7200)
    assert config.fallback_g_per_kwh == 400 and config.policy == "forecast"
    assert config.allow_pause is False and config.deadline is None
    assert SECRET_VALUE not in repr(config)
    provider = build_provider(config)
    assert isinstance(provider, ElectricityMapsProvider)
    assert SECRET_VALUE not in repr(provider)


def test_every_problem_is_reported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    with pytest.raises(CarbonConfigError) as info:
        CarbonConfig.from_mapping(
            {
                "provider": "electricitymaps",
                "region": "germany",
                "token_env": "NO_SUCH_TOKEN_VAR",
                "poll_interval_s": -5,
                "fallback": "guess",
                "colour": "green",
            },
            source="job.yaml",
        )
    problems = info.value.problems
    assert len(problems) == 5, problems
    text = "\n".join(problems)
    assert "region: 'germany'" in text and "zone key" in text
    assert "token_env" in text and "'NO_SUCH_TOKEN_VAR'" in text and "not set" in text
    assert "poll_interval_s: -5" in text and "> 0" in text
    assert "fallback: 'guess'" in text and "constant, daily" in text
    assert "colour: unknown key" in text and "allowed keys" in text
    assert "job.yaml" in str(info.value)


def test_unknown_provider_lists_the_allowed_ones() -> None:
    with pytest.raises(CarbonConfigError) as info:
        CarbonConfig.from_mapping({"provider": "greenpower", "region": "DE"})
    assert info.value.problems == [
        "provider: 'greenpower' is not allowed; allowed: electricitymaps, watttime, uk, "
        "trace, constant"
    ]


@pytest.mark.parametrize("provider", ["electricitymaps", "watttime", "uk", "trace"])
def test_region_is_never_guessed(provider: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ELECTRICITYMAPS_TOKEN", "WATTTIME_USER", "WATTTIME_PASSWORD"):
        monkeypatch.setenv(name, "x")
    with pytest.raises(CarbonConfigError, match="region: missing") as info:
        CarbonConfig.from_mapping({"provider": provider})
    assert "no region is guessed" in str(info.value)


@pytest.mark.parametrize(
    ("provider", "region", "ok"),
    [
        ("electricitymaps", "US-CAL-CISO", True),
        ("electricitymaps", "52.52,13.40", True),
        ("electricitymaps", "52.52;13.40", False),
        ("electricitymaps", "95,13", False),
        ("watttime", "CAISO_NORTH", True),
        ("watttime", "caiso_north", False),
        ("uk", "national", True),
        ("uk", 13, True),
        ("uk", "17", True),
        ("uk", "18", False),
        ("uk", "RG10", True),
        ("uk", "RG10 1AB", False),
        ("trace", "FR", True),
        ("trace", "no/such/file.csv", False),
    ],
)
def test_region_format_per_provider(
    provider: str, region: object, ok: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("ELECTRICITYMAPS_TOKEN", "WATTTIME_USER", "WATTTIME_PASSWORD"):
        monkeypatch.setenv(name, "x")
    mapping = {"provider": provider, "region": region}
    if ok:
        assert CarbonConfig.from_mapping(mapping).region == str(region)
    else:
        with pytest.raises(CarbonConfigError, match=r"region: .* is not allowed"):
            CarbonConfig.from_mapping(mapping)


def test_credentials_never_appear_in_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WT_USER", "alice")
    monkeypatch.setenv("WT_PASS", SECRET_VALUE)
    with pytest.raises(CarbonConfigError) as info:
        CarbonConfig.from_mapping(
            {
                "provider": "watttime",
                "region": "CAISO_NORTH",
                "username_env": "WT_USER",
                "password_env": "WT_PASS",
                "poll_interval_s": 0,
                "token_env": SECRET_VALUE,
            }
        )
    assert SECRET_VALUE not in str(info.value)  # it may be the credential: never quoted
    monkeypatch.delenv("WT_USER")
    with pytest.raises(CarbonConfigError) as missing:
        CarbonConfig.from_mapping(
            {
                "provider": "watttime",
                "region": "CAISO_NORTH",
                "username_env": "WT_USER",
                "password_env": "WT_PASS",
            }
        )
    assert "'WT_USER'" in str(missing.value)
    assert SECRET_VALUE not in str(missing.value)


def test_credential_given_instead_of_a_variable_name() -> None:
    with pytest.raises(CarbonConfigError, match="NAME of an environment variable"):
        CarbonConfig.from_mapping(
            {"provider": "electricitymaps", "region": "DE", "token_env": "abc-123=="}
        )


def test_keys_for_another_provider_are_flagged() -> None:
    with pytest.raises(CarbonConfigError) as info:
        CarbonConfig.from_mapping(
            {
                "provider": "uk",
                "region": "national",
                "token_env": "ELECTRICITYMAPS_TOKEN",
                "forecaster": "daily",
            }
        )
    text = str(info.value)
    assert "token_env: 'ELECTRICITYMAPS_TOKEN' is not used by provider 'uk'" in text
    assert "forecaster: 'daily' is not used" in text


def test_numbers_and_choices() -> None:
    with pytest.raises(CarbonConfigError) as info:
        CarbonConfig.from_mapping(
            {
                "provider": "trace",
                "region": "DE",
                "poll_interval_s": 600,
                "max_staleness_s": 60,
                "fallback_g_per_kwh": -1,
                "emission_factor": "gross",
                "policy": "magic",
                "allow_pause": "yes",
                "base_url": "ftp://x",
                "forecast_horizon_s": True,
            }
        )
    text = "\n".join(info.value.problems)
    assert len(info.value.problems) == 7, text
    for needle in (
        "max_staleness_s: 60",
        ">= poll_interval_s (600)",
        "fallback_g_per_kwh: -1",
        "emission_factor: 'gross'",
        "direct, lifecycle",
        "policy: 'magic'",
        "static, threshold, forecast",
        "allow_pause: 'yes'",
        "base_url: 'ftp://x'",
        "forecast_horizon_s: True",
    ):
        assert needle in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("36h", timedelta(hours=36)),
        ("2d 4h", timedelta(days=2, hours=4)),
        ("1d12h30m", timedelta(days=1, hours=12, minutes=30)),
        ("90m", timedelta(minutes=90)),
        ("PT36H", timedelta(hours=36)),
        ("P2DT4H", timedelta(days=2, hours=4)),
        ("P1W", timedelta(weeks=1)),
        ("2025-06-01T18:00:00Z", datetime(2025, 6, 1, 18, tzinfo=UTC)),
        ("2025-06-01T20:00:00+02:00", datetime(2025, 6, 1, 18, tzinfo=UTC)),
        (datetime(2025, 6, 1, 18, tzinfo=UTC), datetime(2025, 6, 1, 18, tzinfo=UTC)),
        (timedelta(hours=5), timedelta(hours=5)),
    ],
)
def test_deadline_forms(text: object, expected: object) -> None:
    assert parse_deadline(text) == expected
    config = CarbonConfig.from_mapping({"provider": "constant", "deadline": text})
    assert config.deadline == expected


def test_python_keywords_take_typed_values_and_text_is_parsed_from_mappings() -> None:
    with pytest.raises(CarbonConfigError, match=r"deadline: '36h' is not allowed") as info:
        CarbonConfig(provider="constant", deadline="36h")  # type: ignore[arg-type]
    assert "from_mapping" in str(info.value)
    with pytest.raises(CarbonConfigError, match=r"region: 13 is not allowed"):
        CarbonConfig(provider="uk", region=13)  # type: ignore[arg-type]
    assert CarbonConfig.from_mapping({"provider": "uk", "region": 13}).region == "13"
    with pytest.raises(CarbonConfigError, match=r"region: True is not allowed"):
        CarbonConfig.from_mapping({"provider": "uk", "region": True})


@pytest.mark.parametrize(
    "bad", ["soon", "36", "2025-06-01T18:00:00", "P", "0h", 36, datetime(2025, 6, 1, 18)]
)
def test_bad_deadlines(bad: object) -> None:
    with pytest.raises(CarbonConfigError, match="deadline"):
        CarbonConfig.from_mapping({"provider": "constant", "deadline": bad})


def test_deadline_and_max_slowdown_are_exclusive() -> None:
    with pytest.raises(CarbonConfigError, match="one of them, not both"):
        CarbonConfig.from_mapping({"provider": "constant", "deadline": "36h", "max_slowdown": 1.5})
    assert CarbonConfig(provider="constant", max_slowdown=1.5).max_slowdown == 1.5


def test_yaml_timestamp_deadline(tmp_path: Path) -> None:
    path = write(tmp_path, "carbon:\n  provider: constant\n  deadline: 2025-06-01T18:00:00Z\n")
    assert load_carbon_config(path).deadline == datetime(2025, 6, 1, 18, tzinfo=UTC)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(CarbonConfigError, match="cannot read"):
        load_carbon_config(tmp_path / "missing.yaml")
    with pytest.raises(CarbonConfigError, match="not valid YAML at line"):
        load_carbon_config(write(tmp_path, "carbon:\n  provider: [unclosed\n"))
    with pytest.raises(CarbonConfigError, match="no 'carbon:' section"):
        load_carbon_config(write(tmp_path, "energy:\n  x: 1\n"))
    with pytest.raises(CarbonConfigError, match="provider: missing"):
        load_carbon_config(write(tmp_path, "carbon:\n"))


def test_trace_csv_relative_to_the_yaml_file(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "grid.csv").write_text(
        "time,intensity\n2024-01-01T00:00Z,10\n2024-01-01T01:00Z,20\n", encoding="utf-8"
    )
    path = write(tmp_path, "carbon:\n  provider: trace\n  region: traces/grid.csv\n")
    config = load_carbon_config(path)
    assert config.region == str(tmp_path / "traces" / "grid.csv")
    now = datetime(2024, 1, 1, 1, 30, tzinfo=UTC)
    provider = build_provider(config, now=lambda: now)
    assert isinstance(provider, TraceProvider)
    assert provider.latest().intensity_g_per_kwh == 20.0


def test_build_every_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATTTIME_USER", "alice")
    monkeypatch.setenv("WATTTIME_PASSWORD", SECRET_VALUE)
    wt = build_provider(
        CarbonConfig(provider="watttime", region="CAISO_NORTH", base_url="http://127.0.0.1:1")
    )
    assert isinstance(wt, WattTimeProvider) and wt.base_url == "http://127.0.0.1:1"
    assert SECRET_VALUE not in repr(wt)
    assert isinstance(
        build_provider(CarbonConfig(provider="uk", region="EN2")), UKCarbonIntensityProvider
    )
    constant = build_provider(CarbonConfig(provider="constant", constant_g_per_kwh=55.0))
    assert isinstance(constant, ConstantProvider) and constant.latest().intensity_g_per_kwh == 55
    lca = build_provider(
        CarbonConfig(provider="trace", region="DE", emission_factor="lifecycle", forecaster="daily")
    )
    assert isinstance(lca, TraceProvider) and lca.series.values_g_per_kwh[0] == 199.59
    assert lca.forecaster == "daily"


def test_token_removed_after_validation_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELECTRICITYMAPS_TOKEN", SECRET_VALUE)
    config = CarbonConfig(provider="electricitymaps", region="DE")
    monkeypatch.delenv("ELECTRICITYMAPS_TOKEN")
    with pytest.raises(CarbonConfigError, match="ELECTRICITYMAPS_TOKEN"):
        build_provider(config)


def test_build_monitor_shares_the_virtual_clock() -> None:
    t = {"s": datetime(2023, 7, 1, 13, 20, tzinfo=UTC).timestamp()}
    config = CarbonConfig(
        provider="trace", region="CISO", poll_interval_s=0.05, max_staleness_s=60, fallback="daily"
    )
    monitor = build_monitor(config, clock=lambda: t["s"])
    assert monitor.poll_interval_s == 0.05 and monitor.fallback == "daily"
    reading = monitor.poll_now()
    assert isinstance(monitor.provider, TraceProvider)
    assert reading.status is ReadingStatus.FRESH
    assert reading.intensity_g_per_kwh == monitor.provider.series.at(
        datetime(2023, 7, 1, 13, tzinfo=UTC)
    )
    t["s"] += 3600
    assert monitor.poll_now().time == datetime(2023, 7, 1, 14, tzinfo=UTC)


def test_build_monitor_from_now_and_a_local_server(
    api_server: ApiServer, api_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api_server.route(
        "/intensity", Reply.file(api_dir / "uk_carbonintensity" / "uk_intensity_current.json")
    )
    config = CarbonConfig(
        provider="uk", region="national", base_url=api_server.url, forecast_horizon_s=0
    )
    now = datetime(2021, 4, 30, 22, 40, tzinfo=UTC)
    monitor = build_monitor(config, now=lambda: now)
    reading = monitor.poll_now()
    assert (reading.intensity_g_per_kwh, reading.status) == (255.0, ReadingStatus.FRESH)
    assert reading.age_s == 0.0


@pytest.mark.parametrize("key", ["token_env", "username_env", "password_env"])
@pytest.mark.parametrize(
    "pasted",
    [
        "kG8rTq2LmZ9xW4vB7nC1",  # a mixed-case token: a valid identifier, never a name
        "9c41e7b2a0f3d5e6b7c8",  # hex
        "em-secret-PLANTED-0b7e",  # with dashes
        "eyJhbGciOiJIUzI1NiJ9.e30.sig",  # a JWT
    ],
)
def test_a_credential_pasted_as_a_variable_name_is_never_echoed(
    key: str, pasted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(pasted, raising=False)
    provider = "electricitymaps" if key == "token_env" else "watttime"
    region = "DE" if key == "token_env" else "CAISO_NORTH"
    for chosen in (provider, "uk"):  # its own provider, and one that does not use the key
        mapping = {
            "provider": chosen,
            "region": region if chosen == provider else "13",
            key: pasted,
        }
        with pytest.raises(CarbonConfigError) as info:
            CarbonConfig.from_mapping(mapping)
        text = str(info.value)
        assert key in text and "looks like a credential" in text, text
        assert pasted not in text and pasted[:8] not in text, text


def test_credentials_in_base_url_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EM_TOKEN", SECRET_VALUE)
    url = "https://proxyuser:pw-PLANTED-81c2@proxy.example:8443/v3"
    config = CarbonConfig.from_mapping(
        {"provider": "electricitymaps", "region": "DE", "token_env": "EM_TOKEN", "base_url": url}
    )
    assert config.base_url == url  # used as given
    provider = build_provider(config)
    assert isinstance(provider, ElectricityMapsProvider)
    shown = [repr(config), str(config.to_mapping()), repr(provider), provider.base_url]
    assert config.to_mapping()["base_url"] == "https://***@proxy.example:8443/v3"
    provider.close()
    with pytest.raises(CarbonConfigError) as info:
        CarbonConfig.from_mapping(
            {"provider": "uk", "region": "13", "base_url": "ftp://proxyuser:pw-PLANTED-81c2@x"}
        )
    shown.append(str(info.value))
    assert "ftp://***@x" in str(info.value)
    for text in shown:
        assert "pw-PLANTED" not in text and "proxyuser" not in text and SECRET_VALUE not in text


def test_electricitymaps_speaks_v4_by_default_and_v3_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ELECTRICITYMAPS_TOKEN", SECRET_VALUE)
    config = CarbonConfig.from_mapping({"provider": "electricitymaps", "region": "DE"})
    assert config.electricitymaps_api_version == "v4"
    assert config.forecast_horizon_s == 72 * 3600.0  # the longest forecast a provider gives
    provider = build_provider(config)
    assert isinstance(provider, ElectricityMapsProvider)
    assert provider.base_url == "https://api.electricitymaps.com/v4"
    legacy = CarbonConfig.from_mapping(
        {"provider": "electricitymaps", "region": "DE", "api_version": "v3"}
    )
    old = build_provider(legacy)
    assert isinstance(old, ElectricityMapsProvider) and old.api_version == "v3"
    assert old.base_url == "https://api.electricitymaps.com/v3"
    # a configured base_url of one version speaks that version
    proxied = CarbonConfig.from_mapping(
        {"provider": "electricitymaps", "region": "DE", "base_url": "http://proxy:8080/v3"}
    )
    assert proxied.electricitymaps_api_version == "v3"
    for p in (provider, old):
        p.close()


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"api_version": "v5"}, "api_version: 'v5' is not allowed; allowed: v4, v3"),
        ({"api_version": 4}, "api_version: 4 is not allowed; allowed: v4, v3"),
        (
            {"api_version": "v4", "base_url": "http://proxy:8080/v3"},
            "api_version: 'v4' does not match base_url, which ends in '/v3'",
        ),
    ],
)
def test_a_bad_api_version_is_named_with_what_is_allowed(
    monkeypatch: pytest.MonkeyPatch, mapping: dict[str, object], message: str
) -> None:
    monkeypatch.setenv("ELECTRICITYMAPS_TOKEN", SECRET_VALUE)
    with pytest.raises(CarbonConfigError) as info:
        CarbonConfig.from_mapping({"provider": "electricitymaps", "region": "DE", **mapping})
    assert message in str(info.value)
    with pytest.raises(CarbonConfigError, match="api_version: 'v4' is not used by provider 'uk'"):
        CarbonConfig(provider="uk", region="13", api_version="v4")


@pytest.mark.parametrize(
    ("mapping", "factor"),
    [
        ({"provider": "electricitymaps", "region": "DE"}, "direct"),
        (
            {"provider": "electricitymaps", "region": "DE", "emission_factor": "lifecycle"},
            "lifecycle",
        ),
        ({"provider": "trace", "region": "DE", "emission_factor": "lifecycle"}, "lifecycle"),
        ({"provider": "uk", "region": "national"}, "direct"),
        ({"provider": "watttime", "region": "CAISO_NORTH"}, "marginal"),
        ({"provider": "constant"}, "unspecified"),
    ],
)
def test_every_configuration_says_which_emission_factor_its_values_use(
    monkeypatch: pytest.MonkeyPatch, mapping: dict[str, str], factor: str
) -> None:
    monkeypatch.setenv("ELECTRICITYMAPS_TOKEN", SECRET_VALUE)
    monkeypatch.setenv("WATTTIME_USER", "user")
    monkeypatch.setenv("WATTTIME_PASSWORD", SECRET_VALUE)
    assert CarbonConfig.from_mapping(mapping).emission_factor_reported == factor
