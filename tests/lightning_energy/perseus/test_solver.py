from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_energy.perseus import PerseusPlanner, PipelineProfile, one_f_one_b

ROOT = Path(__file__).resolve().parents[3]


def _tiny_profile(data_dir: Path, path: Path) -> Path:
    """Stages 0 and 1 of the 4-stage profile at 4 clocks: small enough to solve exactly."""
    clocks_mhz = {"1410", "1200", "990", "800"}
    with open(data_dir / "perseus_profiles" / "profile_S4_M8.csv", newline="") as source:
        rows = [
            row
            for row in csv.DictReader(source)
            if row["stage"] in {"0", "1"} and row["frequency"] in clocks_mhz
        ]
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_exact_solver_writes_nothing_to_stdout(
    data_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    profile = PipelineProfile.from_csv(
        _tiny_profile(data_dir, tmp_path / "tiny.csv"), blocked_power_w=70.0
    )
    planner = PerseusPlanner(profile, one_f_one_b(num_stages=2, num_microbatches=3))
    assert planner.exact
    print("before")
    frontier = planner.frontier()
    print("after")
    assert len(frontier) > 1
    # Python's own output around the solver still arrives, in order; HiGHS' does not.
    assert capfd.readouterr().out == "before\nafter\n"


def test_plan_json_on_a_tiny_profile_is_valid_json(data_dir: Path, tmp_path: Path) -> None:
    profile = _tiny_profile(data_dir, tmp_path / "tiny.csv")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_energy",
            "plan",
            "--profile",
            str(profile),
            "--microbatches",
            "3",
            "--json",
            "--output",
            str(tmp_path / "plan.json"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["plan"]["energy_j"] <= summary["baseline"]["energy_j"]
    assert (tmp_path / "plan.json").exists()
