"""``lightning-energy report``: the summary table, JSON output, PNG plots and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_energy.cli import main
from lightning_energy.report import write_report
from tests.lightning_energy.test_report import _config, _run


@pytest.fixture
def run_json(tmp_path: Path) -> Path:
    carbon = {"provider": "trace", "region": "FR", "policy": "forecast", "max_slowdown": 1.5}
    return write_report(_run(_config(tmp_path, carbon), steps=160), tmp_path / "run.json")


def test_prints_the_summary_and_draws_three_plots(
    run_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "plots"
    assert main(["report", str(run_json), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert f"Run report {run_json}" in out
    assert "1x NVIDIA A40 (simulated)" in out and "steps" in out
    assert "FR via trace (direct emission factors), forecast policy" in out
    assert "vs. full power" in out
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "emissions.png",
        "frontier.png",
        "power.png",
    ]
    assert "plots: " in out


def test_json_output_is_machine_readable(
    run_json: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(run_json), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["summary"]["steps"] == 160
    assert body["carbon"]["region"] == "FR"
    assert body["power_limits_chosen_w"][0] in (300.0, 250.0, 200.0, 150.0)
    assert body["devices"][0]["name"] == "NVIDIA A40 (simulated)"


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read the report"), ("not json", "is not a JSON report")],
)
def test_missing_or_malformed_files_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report"]) == 2
    assert "RUN.json" in capsys.readouterr().err
    assert main(["report", "x.json", "--bogus"]) == 2


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--help"]) == 0
    assert "frontier.png" in capsys.readouterr().out


def test_unwritable_plot_folder_is_a_runtime_failure(
    run_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    assert main(["report", str(run_json), "--out", str(blocker / "plots")]) == 1
    assert "cannot create the folder" in capsys.readouterr().err
