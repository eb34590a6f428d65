"""EnergyController driven directly, as an adapter would, on simulated GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus
from lightning_energy.errors import CheckpointMismatchError, ConfigError, NoPermissionError


def _config(tmp_path: Path, **power_limit: Any) -> EnergyConfig:
    section = {"power_limits_w": [300, 250, 200, 150], "warmup_steps": 2, "settle_steps": 1}
    section.update(power_limit)
    return EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")},
            "power_limit": section,
            "log_every_n_steps": 10,
        }
    )


def _devices(**spec: Any) -> DeviceSet:
    # 100 steps an epoch: ~37 s steps, each longer than a profiling window must last.
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", steps_per_epoch=100, **spec))
    return DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=lambda: [g.run_step() for g in gpus] and None,
    )


def _run(controller: EnergyController, steps: int) -> None:
    for _ in range(steps):
        controller.on_step_start()
        controller.on_step_end()


def _windows(controller: EnergyController) -> list[dict[str, Any]]:
    return [d for d in controller.decisions if "window" in d["reason"]]


def test_profiles_then_keeps_the_choice_and_restores(tmp_path: Path) -> None:
    devices = _devices()
    controller = EnergyController(
        _config(tmp_path, selector="energy"), devices=devices, install_signal_handlers=False
    )
    _run(controller, 150)
    assert controller.profile_done
    chosen = controller.current_power_limit_w()
    assert chosen in (300.0, 250.0, 200.0, 150.0)
    assert devices.gpus[0].power_limit_w() == chosen
    assert controller.metrics["energy/power_limit_w"] == chosen
    summary = controller.teardown()
    assert devices.gpus[0].power_limit_w() == 300.0
    assert summary.power_limit_w == chosen
    assert summary.energy_j > 0 and summary.steps == 150
    assert summary.energy_saved_j > 0  # the least-energy limit beats full power
    assert controller.teardown() is summary  # idempotent


def test_workload_change_profiles_again_and_known_workloads_reuse(tmp_path: Path) -> None:
    controller = EnergyController(
        _config(tmp_path), devices=_devices(), install_signal_handlers=False
    )
    controller.set_workload("batch=32")
    _run(controller, 150)
    first = len(_windows(controller))
    choice_32 = controller.current_power_limit_w()
    controller.set_workload("batch=64")
    _run(controller, 150)
    second = len(_windows(controller))
    assert second > first  # profiled again
    controller.set_workload("batch=32")
    _run(controller, 20)
    assert len(_windows(controller)) == second  # reused, no new windows
    assert controller.current_power_limit_w() == choice_32
    controller.teardown()


def test_state_dict_resumes_without_profiling(tmp_path: Path) -> None:
    first = EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)
    _run(first, 150)
    state = first.state_dict()
    first.teardown()

    second = EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)
    second.setup()
    second.load_state_dict(state)
    _run(second, 20)
    assert _windows(second) == []
    assert second.current_power_limit_w() == state_choice(state)
    second.teardown()


def state_choice(state: dict[str, Any]) -> float:
    (optimizer,) = state["optimizers"].values()
    from lightning_energy.optimize.power_limit import PowerLimitOptimizer
    from lightning_energy.optimize.selectors import make_selector

    probe = PowerLimitOptimizer(
        [300.0, 250.0, 200.0, 150.0], make_selector("cost", eta=0.5), num_gpus=1
    )
    probe.load_state_dict(optimizer)
    assert probe.chosen_power_limit_w is not None
    return probe.chosen_power_limit_w


def test_state_from_another_gpu_model_or_version_is_refused(tmp_path: Path) -> None:
    a40 = EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)
    _run(a40, 5)
    state = a40.state_dict()
    a40.teardown()
    v100_devices = DeviceSet(
        gpus=simulated_gpus(SimulatedSpec(gpu="v100")), clock=lambda: 0.0, backend="simulated"
    )
    v100 = EnergyController(
        _config(tmp_path, power_limits_w=[250, 200]),
        devices=v100_devices,
        install_signal_handlers=False,
    )
    with pytest.raises(CheckpointMismatchError, match="V100"):
        v100.load_state_dict(state)
    with pytest.raises(CheckpointMismatchError, match="version"):
        v100.load_state_dict({**state, "version": 99})


def test_no_permission_observes_only_and_changes_nothing(tmp_path: Path) -> None:
    devices = _devices(permission_denied=True)
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    _run(controller, 60)
    assert controller.observe_only
    assert controller.current_power_limit_w() is None
    assert devices.gpus[0].power_limit_w() == 300.0
    summary = controller.teardown()
    assert summary.observe_only and summary.energy_j > 0
    assert controller.decisions[0]["kind"] == "observe-only"


def test_strict_mode_raises_without_permission(tmp_path: Path) -> None:
    config = _config(tmp_path).merged({"strict": True})
    controller = EnergyController(
        config, devices=_devices(permission_denied=True), install_signal_handlers=False
    )
    with pytest.raises(NoPermissionError):
        controller.setup()


def test_candidates_outside_the_gpu_range_fail_before_any_change(tmp_path: Path) -> None:
    devices = _devices()
    controller = EnergyController(
        _config(tmp_path, power_limits_w=[300, 40]), devices=devices, install_signal_handlers=False
    )
    with pytest.raises(ConfigError, match=r"\[40\.0\] outside the allowed range 100-300 W"):
        controller.setup()
    assert devices.gpus[0].power_limit_w() == 300.0


def test_interrupted_windows_are_retried(tmp_path: Path) -> None:
    controller = EnergyController(
        _config(tmp_path, selector="energy"), devices=_devices(), install_signal_handlers=False
    )
    for step in range(200):
        controller.on_step_start()
        controller.on_step_end()
        if step % 7 == 6:
            controller.interrupt("validation")
    assert controller.profile_done
    measured = {m["power_limit_w"] for m in controller.profile()}
    assert measured == {300.0, 250.0, 200.0, 150.0}
    controller.teardown()


def test_carbon_problem_at_setup_is_a_config_error_and_leaves_nothing_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EM_TOKEN", "t0ken-value")
    config = _config(tmp_path).merged(
        {"carbon": {"provider": "electricitymaps", "region": "DE", "token_env": "EM_TOKEN"}}
    )
    monkeypatch.delenv("EM_TOKEN")  # gone by the time the job starts
    devices = _devices()
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    with pytest.raises(ConfigError, match=r"carbon\.token_env") as info:
        controller.setup()
    assert "t0ken-value" not in str(info.value)
    assert devices.gpus[0].power_limit_w() == 300.0
