"""Whole classes of bad input end in one clear error, never in another exception.

Property-based: any YAML-able value in any configuration key, any bytes or JSON as a
report, any store whose bookkeeping rows were tampered with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carbon.config import CarbonConfig
from carbon.errors import CarbonConfigError
from lightning_energy.config import (
    BatchSizeConfig,
    DeviceConfig,
    EnergyConfig,
    PerseusConfig,
    PowerLimitConfig,
)
from lightning_energy.errors import ConfigError

_SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

#: Scalars YAML can hold, the rude ones included.
_RUDE = st.sampled_from(
    [
        "",
        " ",
        "\0",
        "nan",
        "-1",
        "36h",
        "99999999999999h",
        "P99999999999W",
        "0001-01-01T00:00:00+01:00",
        float("nan"),
        float("inf"),
        -float("inf"),
        1e-300,
        1e308,
        -1,
        0,
        2**64,
        10**400,
        -(10**400),
    ]
)
_SCALARS = st.one_of(
    _RUDE,
    _RUDE,
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["", " ", "\0", "a40", "DE", "36h", "99999999999999h", "nan", "-1"]),
    st.datetimes(),
    st.dates(),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def _keys(cls: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


_SECTION_KEYS = {
    "device": _keys(DeviceConfig),
    "power_limit": _keys(PowerLimitConfig),
    "perseus": _keys(PerseusConfig),
    "batch_size": _keys(BatchSizeConfig),
    "carbon": [f.name for f in dataclasses.fields(CarbonConfig) if f.name != "source"],
}


_ALL_KEYS = [
    *((section, key) for section, keys in _SECTION_KEYS.items() for key in keys),
    *((None, key) for key in ("strict", "report", "log_every_n_steps")),
]


def _config(section: str | None, key: str, value: Any) -> dict[str, Any]:
    """A configuration with ``key`` of ``section`` (or a top-level key) set to ``value``."""
    if section is None:
        return {key: value}
    body: dict[str, Any] = {key: value}
    if section == "carbon" and key != "provider":
        # Providers that need no file and no network; trace-only keys get a shipped trace.
        trace_only = {"time_col", "value_col", "forecaster", "emission_factor"}
        body["provider"] = "trace" if key in trace_only else "uk"
        if key != "region":
            body["region"] = "DE" if key in trace_only else "13"
    return {section: body}


@pytest.mark.parametrize(("section", "key"), _ALL_KEYS, ids=lambda k: str(k))
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=_VALUES)
def test_any_value_in_any_key_gives_a_config_or_a_config_error_naming_it(
    section: str | None, key: str, value: Any
) -> None:
    name = key if section is None else f"{section}.{key}"
    try:
        config = EnergyConfig.from_mapping(_config(section, key, value))
    except ConfigError as exc:
        assert any(name in p for p in exc.problems), exc.problems
        return
    # What is accepted is usable: it round-trips through its own schema.
    assert EnergyConfig.from_mapping(config.to_mapping()) == config


@_SETTINGS
@given(st.dictionaries(st.text(max_size=12), _VALUES, max_size=4))
def test_any_carbon_section_gives_a_config_or_a_carbon_config_error(
    section: dict[str, Any],
) -> None:
    try:
        CarbonConfig.from_mapping(section)
    except CarbonConfigError as exc:
        assert exc.problems
        assert all(isinstance(p, str) and p for p in exc.problems)


@_SETTINGS
@given(st.binary(max_size=200))
def test_any_bytes_as_a_config_file_give_a_config_error(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(blob)
    try:
        EnergyConfig.from_yaml(path)
    except ConfigError as exc:
        assert str(path) in str(exc)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"power_limit": {"power_limits_w": "300"}}, "power_limit.power_limits_w: '300'"),
        ({"device": {"workload": 5}}, "device.workload: 5"),
        ({"device": {"start": 1685577600}}, "device.start: 1685577600"),
        ({"device": {"lease_dir": 123}}, "device.lease_dir: 123"),
        ({"device": {"lease_dir": ""}}, "device.lease_dir: ''"),
        ({"power_limit": {"step_w": float("nan")}}, "power_limit.step_w: nan"),
        ({"power_limit": {"step_w": 1e-300}}, "power_limit.step_w: 1e-300"),
        ({"device": {"steps_per_epoch": 10**30}}, "device.steps_per_epoch"),
        (
            {"carbon": {"provider": "uk", "region": "13", "deadline": "99999999999999h"}},
            "at most 366 days",
        ),
        ({"carbon": {"provider": "constant", "poll_interval_s": 10**400}}, "finite number > 0"),
        ({"perseus": {"mode": "tensor"}}, "perseus.mode: 'tensor' is not allowed; allowed: ddp"),
        ({"perseus": {"schedule": "zigzag"}}, "perseus.schedule: 'zigzag' is not allowed"),
        ({"perseus": {"microbatches": 0}}, "perseus.microbatches: 0 is not allowed; use an"),
        ({"perseus": {"margin": 0.9}}, "perseus.margin: 0.9 is not allowed; use 0 <= x < 0.5"),
        ({"perseus": {"profile_clocks_mhz": [1410.5]}}, "perseus.profile_clocks_mhz: [1410.5]"),
        ({"perseus": {"profile_clocks_mhz": []}}, "perseus.profile_clocks_mhz: [] is not"),
        ({"perseus": {"clocks": [1]}}, "perseus.clocks: unknown key; allowed keys:"),
        ({"batch_size": {"eta": 2}}, "batch_size.eta: 2.0 is not allowed; use a number from 0"),
        ({"batch_size": {"batch_sizes": [8, 8]}}, "batch_size.batch_sizes: [8, 8] is not"),
        (
            {"batch_size": {"batch_sizes": [8, 16], "default_batch_size": 4}},
            "batch_size.default_batch_size: 4 is not allowed; use one of batch_sizes [8, 16]",
        ),
        (
            {"batch_size": {"enabled": True, "job_key": "j"}},
            "batch_size.enabled: true is not allowed without batch_size.monitor",
        ),
        ({"batch_size": {"store": "sqlite://"}}, "batch_size.store: unknown key"),
    ],
)
def test_named_bad_values_are_refused(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        EnergyConfig.from_mapping(data)
    assert any(needle in p for p in info.value.problems), info.value.problems


def test_a_non_utf8_config_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(b"device:\n  gpu: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        EnergyConfig.from_yaml(path)


def test_every_problem_of_a_bad_file_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {"device": {"workload": 5, "lease_dir": 123}, "power_limit": {"step_w": ".nan"}}
        ),
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as info:
        EnergyConfig.from_yaml(path)
    keys = ("device.workload", "device.lease_dir", "power_limit.step_w")
    assert all(any(k in p for p in info.value.problems) for k in keys)
