"""Carbon-aware training end to end: Lightning on CPU, a simulated A40 on a virtual clock,
and a real grid trace replayed on that clock, so days of grid data pass in seconds."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.lightning_energy.integrations._models import make_loader, module_class
from tests.lightning_energy.processes import run_launch

STEPS = 1200
# The simulated job's clock starts here, so every run replays the same days of each trace.
START = "2023-09-04T00:00:00"


def _config(
    tmp_path: Path, region: str, deadline: str, allow_pause: bool, start: str = START
) -> dict[str, Any]:
    return {
        # One step of this simulated A40 takes ~3 minutes: 1200 steps are ~2.5 days.
        "device": {
            "backend": "simulated",
            "gpu": "a40",
            "steps_per_epoch": 20,
            "noise_std": 0.02,
            "lease_dir": str(tmp_path / "leases"),
            "start": start,
        },
        "power_limit": {"selector": "energy", "warmup_steps": 2, "settle_steps": 1},
        "carbon": {
            "provider": "trace",
            "region": region,
            "policy": "forecast",
            "deadline": deadline,
            "allow_pause": allow_pause,
            "poll_interval_s": 3600,
        },
        "log_every_n_steps": 5,
    }


def _fit(cfg: dict[str, Any]) -> Any:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    callback = EnergyCallback(cfg)
    trainer = ns.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module_class(ns)(), make_loader(n=4096))
    return callback


@pytest.mark.slow
def test_tight_deadline_speeds_up_when_clean_and_meets_the_deadline(tmp_path: Path) -> None:
    # The least-energy limit alone would miss this deadline: the pace must vary.
    callback = _fit(_config(tmp_path, "CISO", "66h", allow_pause=False))
    carbon = callback.summary.carbon
    assert carbon["deadline_met"] is True
    assert carbon["carbon_unaware_meets_deadline"] is False
    paced = [e for e in callback.controller.timeline if e.get("scale") is not None]
    scales = np.array([e["scale"] for e in paced])
    intensity = np.array([e["intensity_g_per_kwh"] for e in paced])
    assert len(set(np.round(scales, 3))) > 2
    # Slower (larger scale) when the grid is dirtier.
    assert np.corrcoef(intensity, scales)[0, 1] > 0.2
    assert carbon["emissions_g"] < carbon["full_power_emissions_g"]


@pytest.mark.slow
def test_pausing_shifts_work_to_clean_hours_and_emits_less(tmp_path: Path) -> None:
    callback = _fit(_config(tmp_path, "DE", "96h", allow_pause=True))
    carbon = callback.summary.carbon
    decisions = callback.controller.decisions
    assert any(d["purpose"] == "pause" for d in decisions)
    # Idle GPUs still draw power while paused: those intervals count, at their intensity.
    timeline = callback.controller.timeline
    paused = [e for e in timeline if e["steps"] == 0]
    assert paused and all(e["energy_j"] > 0 and e["emissions_g"] > 0 for e in paused)
    busy_w = min(e["power_w"] for e in timeline if e["steps"] > 0)
    assert all(e["power_w"] < busy_w for e in paused)
    assert sum(e.get("emissions_g", 0.0) for e in timeline) == pytest.approx(carbon["emissions_g"])
    assert carbon["deadline_met"] is True
    assert carbon["emissions_g"] < carbon["carbon_unaware_emissions_g"]
    # Every GPU setting is back as it was.
    gpu = callback.controller.devices.gpus[0]
    assert gpu.power_limit_w() == callback.summary.pre_job_power_limit_w


@pytest.mark.slow
@pytest.mark.parametrize(
    "start",
    [
        "2023-01-16T00:00:00",
        "2023-03-06T00:00:00",
        "2023-06-12T00:00:00",
    ],
)
def test_pausing_never_emits_more_than_the_carbon_unaware_run(tmp_path: Path, start: str) -> None:
    # Start days on which a plan looks good with the day-ahead forecast but real execution
    # (one power limit per interval, the measured idle power) used to lose to doing nothing.
    callback = _fit(_config(tmp_path, "DE", "96h", allow_pause=True, start=start))
    carbon = callback.summary.carbon
    assert carbon["deadline_met"] is True
    assert carbon["emissions_g"] <= carbon["carbon_unaware_emissions_g"]


@pytest.mark.slow
def test_two_process_ddp_ranks_follow_the_same_pace(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=str(Path(__file__).resolve().parents[3]),
        ENERGY_CFG=json.dumps(_config(tmp_path, "CISO", "66h", allow_pause=False)),
        OUT_DIR=str(tmp_path),
        STEPS=str(STEPS),
    )
    worker = "tests.lightning_energy.integrations.ddp_carbon_worker"
    out = run_launch([sys.executable, "-m", worker], env=env, timeout_s=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["decisions"] == rank1["decisions"]
    assert rank0["scales"] == rank1["scales"]
    assert len({s for s in rank0["scales"] if s is not None}) > 1
    # Only rank 0 polls the grid and knows the deadline; it was met.
    assert rank0["carbon"]["deadline_met"] is True
    assert "deadline_met" not in rank1["carbon"]
