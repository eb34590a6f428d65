"""Faults at start-up and mid-run: training goes on observe-only, the GPU is left as it was."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.errors import GPULostError, NoPermissionError, NotSupportedError
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, FakeNVML, a100, make_module


def _config(tmp_path: Path, *, backend: str = "simulated", strict: bool = False) -> EnergyConfig:
    return EnergyConfig.from_mapping(
        {
            "device": {"backend": backend, "lease_dir": str(tmp_path / "leases")},
            "power_limit": {
                "power_limits_w": [300, 250, 200, 150],
                "warmup_steps": 2,
                "settle_steps": 1,
            },
            "log_every_n_steps": 10,
            "strict": strict,
        }
    )


def _devices(**spec: Any) -> DeviceSet:
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", **spec))
    return DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=lambda: [g.run_step() for g in gpus],
    )


def _run(controller: EnergyController, steps: int) -> None:
    for _ in range(steps):
        controller.on_step_start()
        controller.on_step_end()


def _observe_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "observe-only" in r.getMessage()
    ]


@pytest.mark.parametrize(
    ("operation", "error"),
    [
        ("any", GPULostError),  # the GPU fell off the bus before the job
        ("power_limit_constraints", NotSupportedError),  # no power management
    ],
)
def test_unusable_gpu_at_start_up_observes_only_with_one_warning(
    operation: str, error: type[Exception], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    devices = _devices()
    gpu = devices.gpus[0]
    assert isinstance(gpu, SimulatedGPU)
    gpu.inject_fault(operation, error)  # type: ignore[arg-type]
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        _run(controller, 30)
        summary = controller.teardown()
    assert summary.observe_only and summary.steps == 30
    assert len(_observe_warnings(caplog)) == 1
    assert gpu.settings() == gpu.initial_settings


def test_unusable_gpu_at_start_up_raises_in_strict_mode(tmp_path: Path) -> None:
    devices = _devices()
    gpu = devices.gpus[0]
    assert isinstance(gpu, SimulatedGPU)
    gpu.inject_fault("any", GPULostError)
    controller = EnergyController(
        _config(tmp_path, strict=True), devices=devices, install_signal_handlers=False
    )
    with pytest.raises(GPULostError):
        controller.setup()
    controller.teardown()
    assert gpu.settings() == gpu.initial_settings


def test_the_permission_probe_leaves_every_gpu_at_its_own_limit(tmp_path: Path) -> None:
    """Setup finds out whether settings may change by setting what is there: GPUs whose
    operators left different limits keep them (the guard keeps limits equal across GPUs
    only when it is asked for one limit for all)."""
    devices = _devices(count=2)
    capped, full = devices.gpus
    assert isinstance(capped, SimulatedGPU) and isinstance(full, SimulatedGPU)
    capped.set_power_limit_w(250.0)  # an operator's cap before the job
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    try:
        controller.setup()
        assert not controller.observe_only
        assert [g.power_limit_w() for g in (capped, full)] == [250.0, 300.0]
    finally:
        controller.teardown()
        capped.set_power_limit_w(capped.initial_settings[0])


def test_gpu_lost_mid_run_restores_what_it_can_and_keeps_observing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    devices = _devices(count=2)
    lost, healthy = devices.gpus
    assert isinstance(lost, SimulatedGPU) and isinstance(healthy, SimulatedGPU)
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    steps = 0
    while healthy.settings()[0] == healthy.initial_settings[0]:
        _run(controller, 1)  # profiling, until both GPUs are below their pre-job limit
        steps += 1
    lost.inject_fault("any", GPULostError)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        _run(controller, 40)
    assert controller.observe_only
    assert healthy.settings() == healthy.initial_settings  # restored at once, not at the end
    assert len(_observe_warnings(caplog)) == 1
    summary = controller.teardown()
    assert summary.steps == steps + 40 and summary.observe_only
    lost.clear_faults()
    lost.set_power_limit_w(lost.initial_settings[0])  # what `recover` does once it is back


def _install(monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> FakeNVML:
    module = make_module([a100(0, **overrides)])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return module


def test_failed_start_leaks_no_nvml_session(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    denied = ERROR_CODES["NVML_ERROR_NO_PERMISSION"]
    fake = _install(monkeypatch, errors={"nvmlDeviceSetPowerManagementLimit": denied})
    controller = EnergyController(
        _config(tmp_path, backend="nvml", strict=True), install_signal_handlers=False
    )
    with pytest.raises(NoPermissionError):
        controller.setup()
    assert fake.init_calls == fake.shutdown_calls == 1
    controller.teardown()  # nothing to tear down: no new session, no new lease
    assert fake.init_calls == fake.shutdown_calls == 1
    assert not list((tmp_path / "leases").glob("*.json"))


def test_gpu_without_power_management_on_nvml_observes_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unsupported = ERROR_CODES["NVML_ERROR_NOT_SUPPORTED"]
    fake = _install(
        monkeypatch,
        errors={
            "nvmlDeviceGetPowerManagementLimitConstraints": unsupported,
            "nvmlDeviceGetPowerManagementDefaultLimit": unsupported,
            "nvmlDeviceGetPowerManagementLimit": unsupported,
            "nvmlDeviceGetEnforcedPowerLimit": unsupported,
            "nvmlDeviceSetPowerManagementLimit": unsupported,
        },
    )
    controller = EnergyController(_config(tmp_path, backend="nvml"), install_signal_handlers=False)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        _run(controller, 5)
        summary = controller.teardown()
    assert summary.observe_only and summary.steps == 5
    assert len(_observe_warnings(caplog)) == 1
    assert not [c for c in fake.calls if c[0] == "set_power_limit"]
    assert fake.init_calls == fake.shutdown_calls


def test_gpu_lost_before_nvml_can_open_it_observes_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The handle is found, but every call on it (name, UUID, limits, energy) answers that
    the GPU fell off the bus: training runs observe-only instead of failing at setup."""
    lost = ERROR_CODES["NVML_ERROR_GPU_IS_LOST"]
    module = make_module([a100(0)])
    device_calls = [
        name
        for name in dir(module)
        if name.startswith("nvmlDevice")
        and name not in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetCount")
    ]
    fake = _install(monkeypatch, errors=dict.fromkeys(device_calls, lost))
    controller = EnergyController(_config(tmp_path, backend="nvml"), install_signal_handlers=False)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        _run(controller, 5)
        summary = controller.teardown()
    assert summary.observe_only and summary.steps == 5
    assert len(_observe_warnings(caplog)) == 1
    assert fake.init_calls == fake.shutdown_calls
    assert not list((tmp_path / "leases").glob("*.json"))
