"""EnergyConfig: validation reports every problem at once; YAML, env var and merging."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_energy.config import CONFIG_ENV_VAR, EnergyConfig, load_config
from lightning_energy.errors import ConfigError


def test_defaults_are_valid() -> None:
    config = EnergyConfig.from_mapping({})
    assert config.power_limit.selector == "cost"
    assert config.device.backend == "auto"
    assert config.carbon is None


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        EnergyConfig.from_mapping(
            {
                "device": {"backend": "cuda", "noise_std": 2.0, "colour": "red"},
                "power_limit": {"selector": "cost", "eta": 1.5, "step_w": -5},
                "strict": "yes",
                "extra": 1,
            },
            source="job.yaml",
        )
    problems = info.value.problems
    text = str(info.value)
    assert "job.yaml" in text
    for needle in ("device.backend", "'cuda'", "device.noise_std", "device.colour", "eta"):
        assert needle in text
    assert any("power_limit.step_w" in p for p in problems)
    assert any(p.startswith("strict") for p in problems)
    assert any("'extra'" in p for p in problems)
    assert len(problems) >= 7


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"power_limit": {"selector": "fastest"}}, "fastest"),
        ({"power_limit": {"selector": "max_slowdown", "max_slowdown": 0.5}}, "max_slowdown"),
        ({"power_limit": {"power_limits_w": []}}, "power_limits_w"),
        ({"power_limit": {"power_limits_w": ["high"]}}, "list of numbers"),
        ({"device": {"gpu": "nosuch"}}, "device.gpu 'nosuch'"),
        ({"device": {"start": "yesterday"}}, "device.start"),
        ({"device": {"gpu": "a40", "step_time_s": 2.0}}, "step_time_s"),
        ({"device": {"slowdowns": [1.0, 0.5]}}, "device.slowdowns"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"carbon": {"provider": "smoke-signals"}}, "carbon.provider"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(section: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        EnergyConfig.from_mapping(section)


def test_yaml_round_trip_and_merge(tmp_path: Path) -> None:
    path = tmp_path / "energy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "device": {"backend": "simulated", "gpu": "v100", "slowdowns": [1, 1.2]},
                "power_limit": {"selector": "max_slowdown", "max_slowdown": 1.05},
                "carbon": {"provider": "trace", "region": "FR", "deadline": "2d"},
            }
        )
    )
    config = EnergyConfig.from_yaml(path)
    assert config.source == str(path)
    assert config.device.slowdowns == (1.0, 1.2)
    again = EnergyConfig.from_mapping(config.to_mapping())
    assert again.to_mapping() == config.to_mapping()
    merged = config.merged({"power_limit": {"selector": "energy"}})
    assert merged.power_limit.selector == "energy"
    assert merged.power_limit.max_slowdown == 1.05  # other keys of the section kept
    assert merged.device.gpu == "v100"


def test_candidates_default_to_a_25_w_grid_from_max_to_min() -> None:
    config = EnergyConfig.from_mapping({})
    assert config.power_limit.candidates_w(100, 250) == [250, 225, 200, 175, 150, 125, 100]
    explicit = EnergyConfig.from_mapping({"power_limit": {"power_limits_w": [150, 300]}})
    assert explicit.power_limit.candidates_w(100, 300) == [300.0, 150.0]


def test_env_var_names_the_file(tmp_path: Path) -> None:
    assert load_config(env={}) is None
    assert load_config(env={CONFIG_ENV_VAR: "  "}) is None
    path = tmp_path / "energy.yaml"
    path.write_text("power_limit:\n  selector: time\n")
    config = load_config(env={CONFIG_ENV_VAR: str(path)})
    assert config is not None and config.power_limit.selector == "time"
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(env={CONFIG_ENV_VAR: str(tmp_path / "missing.yaml")})
    path.write_text("power_limit: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_carbon_token_is_never_in_the_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EM_TOKEN", "secret-token-123")
    config = EnergyConfig.from_mapping(
        {"carbon": {"provider": "electricitymaps", "region": "DE", "token_env": "EM_TOKEN"}}
    )
    assert "secret-token-123" not in repr(config.to_mapping())
    assert config.to_mapping()["carbon"]["token_env"] == "EM_TOKEN"


def test_simulated_start_sets_the_jobs_clock(tmp_path: Path) -> None:
    from datetime import datetime, timezone

    from lightning_energy.controller import EnergyController

    config = EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "start": "2023-04-17T06:00:00",
                "lease_dir": str(tmp_path),
            }
        }
    )
    assert config.device.start_time() == datetime(2023, 4, 17, 6, tzinfo=timezone.utc)
    controller = EnergyController(config, install_signal_handlers=False)
    controller.setup()
    try:
        start = controller.now()
        controller.on_step_start()
        controller.on_step_end()
        assert start == datetime(2023, 4, 17, 6, tzinfo=timezone.utc)
        assert controller.now() > start  # the virtual clock moved by one simulated step
    finally:
        controller.teardown()


def test_perseus_and_batch_size_sections_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "energy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "perseus": {"enabled": True, "mode": "ddp", "profile_clocks_mhz": [1410, 990]},
                "batch_size": {
                    "enabled": True,
                    "job_key": "toy",
                    "monitor": "val_acc",
                    "target": 0.9,
                    "batch_sizes": [32, 16],
                    "default_batch_size": 16,
                },
            }
        )
    )
    config = EnergyConfig.from_yaml(path)
    assert config.perseus.enabled and config.perseus.profile_clocks_mhz == (1410, 990)
    assert config.batch_size.batch_sizes == (32, 16)
    assert EnergyConfig.from_mapping(config.to_mapping(), source=str(path)) == config
    merged = config.merged({"perseus": {"window_steps": 4}})
    assert merged.perseus.window_steps == 4 and merged.perseus.mode == "ddp"


def test_perseus_and_batch_size_problems_are_collected_with_the_others() -> None:
    with pytest.raises(ConfigError) as info:
        EnergyConfig.from_mapping(
            {
                "device": {"backend": "cuda"},
                "perseus": {"mode": "tensor", "window_steps": 0, "speed": 1},
                "batch_size": {"enabled": True, "beta": 0.5},
            }
        )
    problems = info.value.problems
    for key in (
        "device.backend",
        "perseus.mode",
        "perseus.window_steps",
        "perseus.speed",
        "batch_size.beta",
        "batch_size.enabled",
    ):
        assert any(p.startswith(key) for p in problems), (key, problems)


def test_the_perseus_example_file_is_valid_and_enables_the_equaliser() -> None:
    path = Path(__file__).parents[2] / "examples" / "perseus_ddp.yaml"
    config = EnergyConfig.from_yaml(path)
    assert config.perseus.enabled and config.perseus.mode == "ddp"
    # No hand-made switch: a job running Perseus does not profile power limits on its own.
    assert config.device.gpu == "a100" and config.power_limit.enabled
