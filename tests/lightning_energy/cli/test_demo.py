"""``lightning-energy demo`` (and ``examples/demo.py``): a real Lightning run on CPU."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_energy.cli import main
from lightning_energy.device.lease import LEASE_DIR_ENV
from lightning_energy.report import load_report

ROOT = Path(__file__).parents[3]


@pytest.fixture(autouse=True)
def _leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEASE_DIR_ENV, str(tmp_path / "leases"))


@pytest.mark.slow
def test_demo_trains_prints_the_summary_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    report_path = tmp_path / "runs" / "demo.json"
    args = ["demo", "--steps", "200", "--region", "CISO", "--backend", "simulated"]
    with caplog.at_level(logging.INFO):
        assert main([*args, "--no-progress", "--report", str(report_path), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    # One summary: the callback's own (in other units) is not logged besides the table.
    assert not [r for r in caplog.records if "energy summary" in r.getMessage()]
    assert out.count("Summary\n") == 1
    assert "simulated NVIDIA A40" in out and "CISO grid" in out
    summary = out.split("Summary\n", 1)[1]
    rows = ("energy", "power limits chosen", "carbon pace", "emissions", "vs. carbon-unaware")
    for row in (*rows, "vs. full"):
        assert row in summary
    assert f"Report written to {report_path}" in out
    assert "Electricity Maps (ODbL)" in out
    report = load_report(report_path)
    assert report["summary"]["steps"] == 200
    assert report["config"]["device"]["seed"] == 3
    assert report["carbon"]["region"] == "CISO"
    assert all(e["intensity_g_per_kwh"] > 0 for e in report["timeline"])
    # each simulated step takes the A40 trace's ~37 s: 200 steps are hours of grid time
    assert report["summary"]["duration_s"] > 2 * 3600


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "argument --steps: 0 is not allowed"),
        (["--steps", "many"], "argument --steps: 'many' is not an integer"),
        (["--region", "XX"], "argument --region: invalid choice: 'XX'"),
        (["--selector", "fastest"], "argument --selector: invalid choice"),
        (["--gpu", "nosuch-gpu"], "device.gpu 'nosuch-gpu'"),
        (["--gpu", "/nonexistent/trace.csv"], "a40, v100, a100, h100"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--gpu", "--region", "--steps", "--report", "--selector", "--seed"):
        assert option in out


def test_example_script_shares_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "-1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "--steps: -1 is not allowed" in result.stderr


def test_the_demo_does_not_import_the_command_line() -> None:
    # The demo and the command share their argparse types through a neutral module.
    probe = ["tests.import_probe", "--prefix", "lightning_energy.cli", "lightning_energy.demo"]
    out = subprocess.run(
        [sys.executable, "-m", *probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
