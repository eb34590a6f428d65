"""``lightning-energy profile -- COMMAND``: the frontier of an unchanged Lightning script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from lightning_energy.cli import main
from lightning_energy.report import load_report

# An unchanged Lightning script; `lightning-energy profile --steps N` limits its fit.
TRAIN_SCRIPT = Path(__file__).with_name("tiny_fit.py")


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("LIGHTNING_ENERGY_CONFIG", raising=False)
    path = tmp_path / "energy.yaml"
    data = {
        # 100 steps an epoch: ~37 s steps, each longer than a profiling window must last.
        "device": {
            "backend": "simulated",
            "gpu": "a40",
            "steps_per_epoch": 100,
            "lease_dir": str(tmp_path / "leases"),
            "start": "2023-06-01T00:00:00",  # a pinned day of the replayed trace
        },
        "power_limit": {"power_limits_w": [300, 250, 200, 150], "warmup_steps": 2},
        "carbon": {"provider": "trace", "region": "DE"},
        "log_every_n_steps": 10,
    }
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_prints_the_frontier_of_a_lightning_script(
    config: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "profile.json"
    args = ["profile", "--steps", "90", "--config", str(config), "--report", str(report)]
    assert main([*args, "--selector", "energy", "--", sys.executable, str(TRAIN_SCRIPT)]) == 0
    out = capfd.readouterr().out
    assert "TRAINED 90" in out  # PL_TRAINER_MAX_STEPS stopped the unchanged script
    assert "Power-limit frontier over 90 steps" in out
    for limit in ("300 W", "250 W", "200 W", "150 W"):
        assert limit in out
    assert out.count("<- chosen") == 1
    assert "The 'energy' selector chooses" in out
    saved = load_report(report)
    assert saved["config"]["power_limit"]["selector"] == "energy"
    assert "carbon" not in saved["config"]  # profiling ignores the carbon section


@pytest.mark.slow
def test_json_output_keeps_stdout_clean(config: Path, capfd: pytest.CaptureFixture[str]) -> None:
    args = ["profile", "--steps", "90", "--config", str(config), "--json"]
    assert main([*args, "--", sys.executable, str(TRAIN_SCRIPT)]) == 0
    captured = capfd.readouterr()
    body = json.loads(captured.out)
    assert "TRAINED 90" in captured.err
    assert body["steps"] == 90 and body["selector"] == "cost"
    assert sorted(m["power_limit_w"] for m in body["frontier"]) == [150.0, 200.0, 250.0, 300.0]
    assert body["chosen_power_limit_w"] in (150.0, 200.0, 250.0, 300.0)


def test_without_a_command_it_explains_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--steps", "10"]) == 2
    assert "give the training command after '--'" in capsys.readouterr().err


def test_unknown_command_is_a_usage_error(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--config", str(config), "--", "no-such-command-xyz"]) == 2
    assert "command not found: no-such-command-xyz" in capsys.readouterr().err


def test_failing_command_exits_1(config: Path, capfd: pytest.CaptureFixture[str]) -> None:
    command = [sys.executable, "-c", "raise SystemExit(3)"]
    assert main(["profile", "--config", str(config), "--", *command]) == 1
    assert "exited with status 3" in capfd.readouterr().err


def test_command_that_writes_no_report_exits_1(
    config: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "--config", str(config), "--", sys.executable, "-c", "pass"]) == 1
    assert "wrote no usable report" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps: 0 is not allowed"),
        (["--selector", "fast"], "--selector: invalid choice"),
        (["--config", "/nonexistent/energy.yaml"], "cannot read the file"),
    ],
)
def test_bad_arguments_and_configs_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", *args, "--", sys.executable, "-c", "pass"]) == 2
    assert message in capsys.readouterr().err


def test_invalid_config_lists_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("power_limit:\n  selector: fastest\n")
    assert main(["profile", "--config", str(bad), "--", sys.executable, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert "power_limit.selector" in err and "fastest" in err
