from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_energy.cli import EXIT_OK, EXIT_USAGE, main
from lightning_energy.perseus import PipelineProfile, Plan, evaluate


def _profile(data_dir: Path) -> str:
    return str(data_dir / "perseus_profiles" / "profile_S4_M8.csv")


def test_no_slowdown_plan_is_written(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--profile",
            _profile(data_dir),
            "--schedule",
            "1f1b",
            "--microbatches",
            "8",
            "--p2p-power-w",
            "70",
            "--no-slowdown",
            "--output",
            str(out),
        ]
    )
    assert code == EXIT_OK
    text = capsys.readouterr().out
    assert "baseline (all 1410 MHz): 1.7572 s, 1921.9 J" in text
    assert "frontier:" in text and "plan: 1.7572 s" in text
    plan = Plan.load(out)
    profile = PipelineProfile.from_csv(_profile(data_dir), blocked_power_w=70.0)
    result = evaluate(plan, profile)
    assert result.iteration_time_s == pytest.approx(1.7571551285015043)
    assert result.energy_j < 1731.4  # lowtime's, in the profiles' README
    assert plan.metadata is not None
    assert plan.metadata["energy_j"] == pytest.approx(result.energy_j)


def test_target_time_and_json_summary(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--profile",
            _profile(data_dir),
            "--microbatches",
            "8",
            "--target-time",
            "2.0",
            "--output",
            str(out),
            "--json",
            "--time-step-s",
            "0.01",
        ]
    )
    assert code == EXIT_OK
    summary = json.loads(capsys.readouterr().out)
    assert summary["plan"]["iteration_time_s"] <= 2.0
    assert summary["plan"]["energy_j"] < summary["baseline"]["energy_j"]
    rows = summary["frontier"]["rows"]
    assert rows[0]["iteration_time_s"] < rows[-1]["iteration_time_s"]
    assert Plan.load(out).metadata["target_time_s"] == 2.0  # type: ignore[index]


def test_bad_inputs_exit_with_usage_error(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("stage,instruction,frequency,time,energy\n0,forward,1410,-1,1\n")
    assert main(["plan", "--profile", str(bad), "--microbatches", "2"]) == EXIT_USAGE
    assert "time=-1.0" in capsys.readouterr().err
    assert main(["plan", "--profile", _profile(data_dir), "--microbatches", "0"]) == EXIT_USAGE
    assert (
        main(["plan", "--profile", _profile(data_dir), "--microbatches", "8", "--schedule", "zb"])
        == EXIT_USAGE
    )
