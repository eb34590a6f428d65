"""Profiling on an energy counter that moves every 100 ms: windows sized in seconds."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import PHYSICS_PRESETS, DeviceSet, SimulatedSpec, simulated_gpus
from lightning_energy.device.simulated import steady_run
from lightning_energy.optimize.power_limit import min_window_s
from tests.lightning_energy.integrations._models import make_loader, module_class, quiet_trainer

LIMITS = [400.0, 250.0]


def _section(tmp_path: Path, step_time_s: float) -> dict[str, Any]:
    return {
        "device": {
            "backend": "simulated",
            "gpu": "a100",
            "step_time_s": step_time_s,
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


def _exact_step(limit_w: float, step_time_s: float) -> tuple[float, float]:
    """``(seconds, joules)`` of one simulated step at ``limit_w`` once the governor has
    settled (under a binding limit it holds the power at the limit, its clock dithering
    between the two supported clocks around it)."""
    model = PHYSICS_PRESETS["a100"]
    run = steady_run(model, step_time_s, model.step_shape(), limit_w)
    return run.duration_s, run.energy_j


def _exact_energy_per_step_j(limit_w: float, step_time_s: float) -> float:
    return _exact_step(limit_w, step_time_s)[1]


def _a100(step_time_s: float) -> DeviceSet:
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", step_time_s=step_time_s))
    return DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=gpus[0].run_step,
    )


def test_window_length_follows_the_precision_needed() -> None:
    assert min_window_s(0.1, 0.01) == pytest.approx(10.0)
    assert min_window_s(0.0, 0.01) == 0.0
    # 3 steps of 0.3 s on a 100 ms counter: up to ~10 % off, ten times the tolerance.
    assert 0.1 / (3 * 0.3) > 10 * 0.01


@pytest.mark.parametrize("step_time_s", [0.02, 0.3])
def test_short_steps_on_a_slow_counter_profile_accurately(
    step_time_s: float, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", step_time_s=step_time_s))
    assert gpus[0].energy_counter_period_s() == pytest.approx(0.1)
    devices = DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=gpus[0].run_step,
    )
    config = EnergyConfig.from_mapping(_section(tmp_path, step_time_s))
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    steps = 0
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        while not controller.profile_done:
            controller.on_step_start()
            controller.on_step_end()
            steps += 1
    controller.teardown()
    profile = {m["power_limit_w"]: m for m in controller.profile()}
    assert sorted(profile) == sorted(LIMITS)
    for limit_w, m in profile.items():
        # Two windows per limit, each at least 10 s of steps.
        assert m["steps"] * m["time_per_step_s"] >= 2 * 10.0 - 1e-9
        exact_j = _exact_energy_per_step_j(limit_w, step_time_s)
        assert m["energy_per_step_j"] == pytest.approx(exact_j, rel=0.01)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_lightning_fit_with_20ms_steps_on_a_100ms_counter(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    callback = EnergyCallback(_section(tmp_path, 0.02))
    trainer = quiet_trainer(ns, callback, tmp_path, 2200, limit_val_batches=0)
    trainer.fit(module_class(ns)(), make_loader(n=4096, batch_size=1))  # no epoch end mid-window
    controller = callback.controller
    assert controller is not None and callback.summary is not None
    assert controller.profile_done  # it used to fail at step 8 on a 0 J window
    profile = {m["power_limit_w"]: m["energy_per_step_j"] for m in controller.profile()}
    assert sorted(profile) == sorted(LIMITS)
    for limit_w, energy_j in profile.items():
        assert energy_j == pytest.approx(_exact_energy_per_step_j(limit_w, 0.02), rel=0.01)
    gpu = controller.devices.gpus[0]
    assert gpu.power_limit_w() == callback.summary.pre_job_power_limit_w


def test_a_window_that_reads_no_energy_goes_on_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The counter moves every 0.5 s but the GPU claims a continuous one: windows are
    # sized in steps only, and most of them read 0 J at first.
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", step_time_s=0.02, energy_counter_period_s=0.5))
    monkeypatch.setattr(gpus[0], "energy_counter_period_s", lambda: 0.0)
    devices = DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=gpus[0].run_step,
    )
    config = EnergyConfig.from_mapping(_section(tmp_path, 0.02))
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        for _ in range(400):
            controller.on_step_start()
            controller.on_step_end()
    controller.teardown()
    assert controller.profile_done
    assert all(m["energy_per_step_j"] > 0 for m in controller.profile())
    warnings = [r for r in caplog.records if "read no energy" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("settle_s", [0.0, 1.0])
def test_a_window_waits_until_its_limit_has_landed(settle_s: float, tmp_path: Path) -> None:
    """A board that applies a new limit 0.8 s after it was set, 20 ms steps: one settle
    step would measure 0.8 s of every window at the previous limit (over 1 % off on a
    10 s window, more than the counter's 100 ms resolution); waiting ``settle_s`` seconds
    as well measures the limit itself."""
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", step_time_s=0.02, setting_latency_s=0.8))
    devices = DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=gpus[0].run_step,
    )
    section = _section(tmp_path, 0.02)
    section["power_limit"]["settle_s"] = settle_s
    controller = EnergyController(
        EnergyConfig.from_mapping(section), devices=devices, install_signal_handlers=False
    )
    while not controller.profile_done:
        controller.on_step_start()
        controller.on_step_end()
    controller.teardown()
    errors = [
        abs(m["energy_per_step_j"] / _exact_energy_per_step_j(m["power_limit_w"], 0.02) - 1)
        for m in controller.profile()
    ]
    if settle_s:
        assert max(errors) < 0.005
    else:
        assert max(errors) > 0.01  # the rude board makes the missing wait visible


def test_short_epochs_on_a_100ms_counter_finish_profiling_without_their_boundaries(
    tmp_path: Path,
) -> None:
    """Epochs of 64 steps of 20 ms (1.3 s, far shorter than a 10 s window), each followed
    by 0.5 s of validation at idle power: windows span the epochs and measure only the
    training steps on either side, so profiling finishes and measures the limits (it
    never finished when every epoch end discarded the window)."""
    devices = _a100(0.02)
    config = EnergyConfig.from_mapping(_section(tmp_path, 0.02))
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    steps = 0
    while not controller.profile_done and steps < 8000:
        controller.on_step_start()
        controller.on_step_end()
        steps += 1
        if steps % 64 == 0:
            controller.interrupt("epoch end")
            devices.gpus[0].idle(0.5)
    controller.teardown()
    assert controller.profile_done
    profile = {m["power_limit_w"]: m for m in controller.profile()}
    assert sorted(profile) == sorted(LIMITS)
    for limit_w, m in profile.items():
        # Neither the validation's time nor its energy, nor the counter's lag into it.
        exact_s, exact_j = _exact_step(limit_w, 0.02)
        assert m["time_per_step_s"] == pytest.approx(exact_s, rel=0.01)
        assert m["energy_per_step_j"] == pytest.approx(exact_j, rel=0.01)


def test_a_window_reads_the_counter_a_few_times_not_at_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 10 s window of 20 ms steps is 500 steps: it is checked (one synchronised reading
    and one collective) a few times on the way, not at each of them."""
    controller = EnergyController(
        EnergyConfig.from_mapping(_section(tmp_path, 0.02)),
        devices=_a100(0.02),
        install_signal_handlers=False,
    )
    checks: list[int] = []
    sum_and_max = controller.collective.sum_and_max

    def counted(sums: list[float], maxima: list[float]) -> tuple[list[float], list[float]]:
        checks.append(controller.steps)
        return sum_and_max(sums, maxima)

    monkeypatch.setattr(controller.collective, "sum_and_max", counted)
    while not controller.profile_done:
        controller.on_step_start()
        controller.on_step_end()
    controller.teardown()
    windows = sum(1 for d in controller.decisions if d["purpose"] == "profile") - 1  # warm-up
    assert windows == 2 * len(LIMITS)
    assert len(checks) <= windows * 12
