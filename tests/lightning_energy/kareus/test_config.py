"""The ``kareus:`` section of the configuration."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.errors import ConfigError
from lightning_energy.kareus.data_parallel import DDP_DEFAULT_BUCKET_CAP_MB

SECTION = {
    "enabled": True,
    "measurements_dir": "runs/kareus",
    "non_partition_profile": "runs/kareus/non_partition.csv",
    "layers_per_stage": [15, 13],
    "tp_size": 8,
}


def problems(section: Any) -> list[str]:
    with pytest.raises(ConfigError) as err:
        EnergyConfig.from_mapping({"kareus": section})
    return err.value.problems


def test_a_complete_section_is_read_and_round_trips() -> None:
    config = EnergyConfig.from_mapping({"kareus": SECTION})
    assert config.kareus.enabled and config.kareus.layers_per_stage == (15, 13)
    assert config.kareus.tp_size == 8
    assert EnergyConfig.from_mapping(config.to_mapping()) == config
    assert not EnergyConfig.from_mapping({}).kareus.enabled  # off by default


def test_enabled_needs_its_files_and_layers() -> None:
    assert problems({"enabled": True}) == [
        "kareus.enabled: true is not allowed without kareus.measurements_dir, "
        "kareus.non_partition_profile, kareus.layers_per_stage; set them or use false"
    ]


def test_every_bad_value_is_reported_at_once() -> None:
    found = problems(
        {
            "enabled": "yes",
            "measurements_dir": "  ",
            "layers_per_stage": [15, 0],
            "nanobatches": 4,
        }
    )
    assert len(found) == 4
    assert "kareus.enabled: 'yes' is not allowed; use true or false" in found
    assert "kareus.measurements_dir: '  ' is not allowed; use a path or null" in found
    assert any(p.startswith("kareus.layers_per_stage: [15, 0] is not allowed") for p in found)
    assert any(
        p.startswith(
            "kareus.nanobatches: unknown key; allowed keys: data_parallel_bucket_cap_mb, "
            "data_parallel_clock_mhz, data_parallel_ctas, data_parallel_search, "
            "data_parallel_search_clocks_mhz, data_parallel_search_ctas, "
            "data_parallel_search_steps, enabled,"
        )
        for p in found
    )
    assert problems({**SECTION, "layers_per_stage": "15,13"}) == [
        "kareus.layers_per_stage: '15,13' is not allowed; use a list of integers"
    ]


def test_a_tensor_parallel_size_below_two_is_refused() -> None:
    assert problems({**SECTION, "tp_size": 1}) == [
        "kareus.tp_size: 1 is not allowed; use an integer >= 2 or null"
    ]
    assert (
        EnergyConfig.from_mapping({"kareus": {**SECTION, "tp_size": None}}).kareus.tp_size is None
    )


def test_the_data_parallel_keys_give_a_setting() -> None:
    kareus = EnergyConfig.from_mapping({"kareus": {"data_parallel_ctas": 8}}).kareus
    setting = kareus.data_parallel()
    assert setting is not None
    assert (setting.ctas, setting.bucket_cap_mb) == (8, DDP_DEFAULT_BUCKET_CAP_MB)
    section = {"data_parallel_bucket_cap_mb": 100}
    setting = EnergyConfig.from_mapping({"kareus": section}).kareus.data_parallel()
    assert setting is not None and (setting.ctas, setting.bucket_cap_mb) == (None, 100.0)
    assert setting.clock_mhz is None
    section = {"data_parallel_clock_mhz": 1200}
    setting = EnergyConfig.from_mapping({"kareus": section}).kareus.data_parallel()
    assert setting is not None
    assert (setting.ctas, setting.bucket_cap_mb, setting.clock_mhz) == (
        None,
        DDP_DEFAULT_BUCKET_CAP_MB,
        1200,
    )
    assert EnergyConfig.from_mapping({}).kareus.data_parallel() is None


def test_bad_data_parallel_keys_are_named() -> None:
    section = {
        "data_parallel_ctas": 33,
        "data_parallel_bucket_cap_mb": -1,
        "data_parallel_clock_mhz": 0,
    }
    with pytest.raises(ConfigError) as info:
        EnergyConfig.from_mapping({"kareus": section})
    found = str(info.value)
    assert "kareus.data_parallel_ctas: 33 is not allowed; use 1 to 32" in found
    assert "kareus.data_parallel_bucket_cap_mb: -1.0 is not allowed; use a positive" in found
    assert "kareus.data_parallel_clock_mhz: 0 is not allowed; use a positive clock" in found
