"""What a run says about a power-limit profile it did not finish, or measured at other
limits than asked for: summaries and reports name what was applied and restored."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus
from lightning_energy.integrations.adapter import format_summary
from lightning_energy.report import build_report, format_report
from tests.lightning_energy.integrations._models import make_loader, module_class, quiet_trainer

LIMITS = [400.0, 300.0, 250.0, 200.0]


def _section(tmp_path: Path) -> dict[str, Any]:
    # 20 ms steps on a 100 ms counter: every window measures 10 s, about 500 steps.
    return {
        "device": {
            "backend": "simulated",
            "gpu": "a100",
            "step_time_s": 0.02,
            "lease_dir": str(tmp_path / "leases"),
        },
        "power_limit": {
            "selector": "energy",
            "power_limits_w": LIMITS,
            "warmup_steps": 2,
            "settle_steps": 1,
        },
        "log_every_n_steps": 50,
    }


def _rows(table: str) -> dict[str, str]:
    return {k: v.strip() for k, v in (line.strip().split("  ", 1) for line in table.splitlines())}


def test_a_fit_that_ends_before_its_profile_finishes_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    callback = EnergyCallback(_section(tmp_path))
    trainer = quiet_trainer(ns, callback, tmp_path, 1200, limit_val_batches=0)
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        trainer.fit(module_class(ns)(), make_loader(n=4096, batch_size=1))
    summary = callback.summary
    controller = callback.controller
    assert summary is not None and controller is not None
    assert not controller.profile_done
    # Nothing was chosen: the limit of the window being measured is no choice.
    assert summary.power_limit_w is None
    assert summary.profile_complete is False
    assert summary.power_limit_candidates == len(LIMITS)
    assert 1 <= summary.power_limits_measured < len(LIMITS)
    assert summary.power_limits_applied >= 2
    assert controller.devices.gpus[0].power_limit_w() == summary.pre_job_power_limit_w

    for table in (format_summary(summary), format_report(build_report(controller))):
        rows = _rows(table)
        assert rows["power-limit profile"] == (
            f"not finished: {summary.power_limits_measured} of {len(LIMITS)} limits measured"
        )
        assert rows["power limits chosen"] == (
            f"none ({summary.power_limits_applied} limits set while profiling)"
        )
        assert rows["pre-job power limit"] == "400 W (every GPU put back to it at the end)"

    too_short = [r.getMessage() for r in caplog.records if "cannot finish" in r.getMessage()]
    assert len(too_short) == 1
    assert "a run of at least" in too_short[0]


def test_a_finished_profile_says_nothing_about_being_too_short(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", step_time_s=0.02))
    devices = DeviceSet(
        gpus=gpus, clock=gpus[0].clock.now, backend="simulated", run_step=gpus[0].run_step
    )
    config = EnergyConfig.from_mapping(_section(tmp_path))
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    controller.set_total_steps(20_000)
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        while not controller.profile_done:
            controller.on_step_start()
            controller.on_step_end()
    summary = controller.teardown()
    assert summary.profile_complete is True
    assert summary.power_limit_w is not None
    assert not [r for r in caplog.records if "cannot finish" in r.getMessage()]
    assert _rows(format_summary(summary))["power limits chosen"] == f"{summary.power_limit_w:.0f} W"


def test_candidates_above_the_pre_job_limit_are_profiled_as_the_limit_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", step_time_s=0.02))
    initial_w = gpus[0].power_limit_w()
    gpus[0].set_power_limit_w(250.0)  # an operator's cap before the job
    devices = DeviceSet(
        gpus=gpus, clock=gpus[0].clock.now, backend="simulated", run_step=gpus[0].run_step
    )
    config = EnergyConfig.from_mapping(_section(tmp_path))
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    try:
        with caplog.at_level(logging.INFO, logger="lightning_energy"):
            while not controller.profile_done:
                controller.on_step_start()
                controller.on_step_end()
        summary = controller.teardown()
        profiled = sorted(m["power_limit_w"] for m in controller.profile())
        assert profiled == [200.0, 250.0]  # 400 and 300 W ran at 250 W
        assert summary.power_limit_candidates == 2
        assert gpus[0].power_limit_w() == 250.0
        clamped = [r.getMessage() for r in caplog.records if "above 250 W" in r.getMessage()]
        assert clamped and "400, 300 W" in clamped[0]
    finally:
        gpus[0].set_power_limit_w(initial_w)
