"""Ray Train: ``TorchTrainer`` with two CPU workers, each a Lightning fit with the callback.

Runs ``examples/ray/train.py`` in its own process (Ray starts a local cluster), so what is
tested is what a user runs: every worker drives its own simulated GPU, the ranks agree on
one profile, rank 0's report carries the job's totals, and every GPU is restored.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.report import load_report

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_torch_trainer_with_two_workers_reports_the_whole_job(tmp_path: Path) -> None:
    if importlib.util.find_spec("ray") is None:  # importing Ray here would set env vars
        pytest.skip("the `ray` extra is not installed")
    out = tmp_path / "run"
    config = yaml.safe_load((ROOT / "examples" / "ray" / "energy.yaml").read_text())
    # GPU settings and leases in files, so the test reads back what each worker left.
    config["device"].update(state_dir=str(tmp_path / "gpus"), lease_dir=str(tmp_path / "leases"))
    (tmp_path / "energy.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "ray" / "train.py"),
            "--out",
            str(out),
            "--config",
            str(tmp_path / "energy.yaml"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = load_report(out / "energy.json")
    job = report["job"]
    assert job["ranks"] == 2 and len(job["gpus"]) == 2
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert job["energy_j"] == pytest.approx(sum(r["energy_j"] for r in ranks))
    assert all(r["job_energy_j"] == pytest.approx(job["energy_j"]) for r in ranks)
    # One job-wide profile, one choice, on both ranks; both GPUs back at their pre-job limit.
    assert len({r["power_limit_w"] for r in ranks}) == 1 and ranks[0]["power_limit_w"] < 300
    spec = SimulatedSpec(gpu="a40", count=2, state_dir=str(tmp_path / "gpus"))
    assert [gpu.power_limit_w() for gpu in simulated_gpus(spec)] == [300.0, 300.0]
    assert report["summary"]["scope"] == "rank 0"
