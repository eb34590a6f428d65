"""Readings the calibration run takes besides power and energy: the SM clock, clock event
reasons, temperature and persistence mode, on NVML (in-memory pynvml) and simulated GPUs."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.device.nvml import NVMLGPU, nvml_gpus
from lightning_energy.device.simulated import (
    CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING,
    CLOCK_EVENT_SW_POWER_CAP,
)
from lightning_energy.errors import GPULostError, NoPermissionError, NotSupportedError
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, FakeNVML, a100, make_module


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNVML]:
    module = make_module([a100(0)])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield module
    assert module.init_calls == module.shutdown_calls


@pytest.fixture
def gpu(fake: FakeNVML) -> Iterator[NVMLGPU]:
    (opened,) = nvml_gpus()
    yield opened
    opened.close()


def test_nvml_clock_temperature_persistence(fake: FakeNVML, gpu: NVMLGPU) -> None:
    device = fake.devices[0]
    device.sm_clock_mhz, device.temperature_c, device.persistence_mode = 1395, 71, 0
    assert gpu.sm_clock_mhz() == 1395
    assert gpu.temperature_c() == 71.0
    assert gpu.persistence_mode() is False
    device.persistence_mode = 1
    assert gpu.persistence_mode() is True
    gpu.set_locked_clocks_mhz(1005, 1005)
    try:
        assert gpu.sm_clock_mhz() == 1005
        assert gpu.clock_event_reasons() == 0x1  # idle: GpuIdle, the lock does not show
        device.busy = True
        assert gpu.clock_event_reasons() & 0x2
    finally:
        gpu.reset_locked_clocks()


@pytest.mark.parametrize(
    ("function", "code", "error"),
    [
        ("nvmlDeviceGetClockInfo", "NVML_ERROR_GPU_IS_LOST", GPULostError),
        ("nvmlDeviceGetTemperature", "NVML_ERROR_NOT_SUPPORTED", NotSupportedError),
        ("nvmlDeviceGetPersistenceMode", "NVML_ERROR_NO_PERMISSION", NoPermissionError),
        ("nvmlDeviceGetCurrentClocksEventReasons", "NVML_ERROR_NOT_SUPPORTED", NotSupportedError),
    ],
)
def test_nvml_reading_errors_are_typed(
    fake: FakeNVML, gpu: NVMLGPU, function: str, code: str, error: type[Exception]
) -> None:
    fake.devices[0].errors[function] = ERROR_CODES[code]
    read = {
        "nvmlDeviceGetClockInfo": gpu.sm_clock_mhz,
        "nvmlDeviceGetTemperature": gpu.temperature_c,
        "nvmlDeviceGetPersistenceMode": gpu.persistence_mode,
        "nvmlDeviceGetCurrentClocksEventReasons": gpu.clock_event_reasons,
    }[function]
    with pytest.raises(error):
        read()


def test_simulated_sm_clock_is_the_clock_work_ran_at() -> None:
    (gpu,) = simulated_gpus(SimulatedSpec(gpu="a100", setting_latency_s=0.05))
    assert gpu.sm_clock_mhz() is None  # idle
    gpu.run_step()
    assert gpu.sm_clock_mhz() == 1410
    gpu.set_locked_clocks_mhz(900, 900)
    try:
        gpu.run_work(0.01)  # starts within the setting latency: the old clock
        assert gpu.sm_clock_mhz() == 1410
        gpu.idle(0.05)
        assert gpu.sm_clock_mhz() is None
        gpu.run_work(0.01)
        assert gpu.sm_clock_mhz() == 900
        assert gpu.clock_event_reasons() & CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING
        gpu.reset_locked_clocks()
        gpu.set_power_limit_w(150.0)
        gpu.idle(0.1)
        gpu.run_step()
        capped = gpu.sm_clock_mhz()
        assert capped is not None and capped < 1410
        assert gpu.clock_event_reasons() & CLOCK_EVENT_SW_POWER_CAP
    finally:
        gpu.reset_locked_clocks()
        gpu.set_power_limit_w(gpu.default_power_limit_w())


def test_trace_gpus_report_no_clock() -> None:
    (gpu,) = simulated_gpus(SimulatedSpec(gpu="a40"))
    gpu.run_step()
    assert gpu.sm_clock_mhz() is None
