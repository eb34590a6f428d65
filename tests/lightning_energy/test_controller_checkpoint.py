"""A checkpoint's totals, and the summary of a run resumed from one.

A checkpoint holds the job's exact totals at its step: every step before it and the energy
they used, also between two refreshes of the logged values. The summary of a resumed run
covers this process in every field and says where the job resumed; the logged
``energy/total_j`` carries on from the checkpoint's total.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus


def _controller(tmp_path: Path, log_every_n_steps: int) -> EnergyController:
    config = EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")},
            "power_limit": {
                "power_limits_w": [300, 250, 200, 150],
                "warmup_steps": 2,
                "settle_steps": 1,
            },
            "log_every_n_steps": log_every_n_steps,
        }
    )
    # 100 steps an epoch: ~37 s steps, each longer than a profiling window must last.
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", steps_per_epoch=100))
    devices = DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=lambda: [g.run_step() for g in gpus],
    )
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    return controller


def _run(controller: EnergyController, steps: int) -> None:
    for _ in range(steps):
        controller.on_step_start()
        controller.on_step_end()


def _checkpoint(tmp_path: Path, steps: int) -> dict[str, Any]:
    """The state after ``steps`` steps, between two refreshes (every 10 steps)."""
    controller = _controller(tmp_path, log_every_n_steps=10)
    _run(controller, steps)
    state = controller.state_dict()
    controller.teardown()
    return state


def test_a_checkpoint_between_refreshes_holds_the_energy_of_every_step_before_it(
    tmp_path: Path,
) -> None:
    state = _checkpoint(tmp_path, 17)
    # The same steps on the same GPU, refreshed at every step: the energy of all 17.
    every_step = _controller(tmp_path, log_every_n_steps=1)
    _run(every_step, 17)
    total_j = every_step.metrics["energy/total_j"]
    every_step.teardown()
    assert state["steps"] == 17
    assert state["energy_j"] == pytest.approx(total_j, rel=1e-9)


def test_a_resumed_run_summarises_this_process_and_says_where_the_job_resumed(
    tmp_path: Path,
) -> None:
    state = _checkpoint(tmp_path, 17)
    resumed = _controller(tmp_path, log_every_n_steps=1)
    resumed.load_state_dict(state)
    _run(resumed, 6)
    again = resumed.state_dict()
    total_j = resumed.metrics["energy/total_j"]
    summary = resumed.teardown()
    assert (summary.steps, summary.resumed_at_step) == (6, 17)
    assert summary.energy_before_resume_j == state["energy_j"]
    assert summary.energy_j == pytest.approx(total_j - state["energy_j"], rel=1e-9)
    assert summary.energy_j > 0 and summary.duration_s > 0
    # The next checkpoint holds the job's totals again: both processes' steps and energy.
    assert again["steps"] == 23
    assert again["energy_j"] == pytest.approx(total_j, rel=1e-9)


def test_a_fresh_run_says_it_was_not_resumed(tmp_path: Path) -> None:
    controller = _controller(tmp_path, log_every_n_steps=10)
    _run(controller, 12)
    summary = controller.teardown()
    assert (summary.steps, summary.resumed_at_step, summary.energy_before_resume_j) == (12, 0, 0.0)
