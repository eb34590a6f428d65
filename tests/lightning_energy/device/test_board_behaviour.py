"""The simulated GPU and the in-memory pynvml treat software as real boards do."""

from __future__ import annotations

import importlib
import itertools
import logging
import sys
from pathlib import Path

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import (
    PHYSICS_PRESETS,
    DeviceSet,
    SimulatedGPU,
    SimulatedSpec,
    simulated_gpus,
)
from lightning_energy.device.nvml import NVMLGPU, nvml_gpus
from lightning_energy.device.simulated import (
    BOARDS,
    CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING,
    CLOCK_EVENT_GPU_IDLE,
    Board,
)
from lightning_energy.errors import ConfigError, DriverError, NotSupportedError
from lightning_energy.measure import EnergyMeter
from tests.lightning_energy.device.fake_pynvml import (
    VALUE_TYPES,
    FakeNVML,
    NvmlFieldValue,
    NvmlValue,
    a100,
    make_module,
)


def _gpu(gpu: str = "a100", **spec: object) -> SimulatedGPU:
    return simulated_gpus(SimulatedSpec(gpu=gpu, **spec))[0]  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a40", "v100", "a100", "h100", "h200"])
def test_presets_are_rude_by_default(name: str) -> None:
    board = _gpu(name).board
    assert board == BOARDS[name]
    assert board.energy_counter_period_s == pytest.approx(0.1)
    assert board.setting_latency_s > 0
    # Volta reports (nearly) instantaneous power; Ampere and Hopper a 1 s average.
    assert board.power_average_s == (0.0 if name == "v100" else 1.0)
    assert board.instant_power == (name != "v100")


def test_energy_counter_moves_only_every_period() -> None:
    gpu = _gpu(step_time_s=0.02)
    readings = []
    for _ in range(50):  # 1 s of 20 ms steps
        gpu.run_step()
        readings.append(gpu.energy_j())
    deltas = [b - a for a, b in itertools.pairwise(readings)]
    zero = sum(1 for d in deltas if d == 0)
    assert zero >= 0.7 * len(deltas)  # 4 steps in 5 see the counter standing still
    assert 8 <= len(deltas) - zero <= 11  # it moved about once per 100 ms
    # Over a long window the counter loses at most one period at each end.
    exact = _gpu(step_time_s=0.02, energy_counter_period_s=0.0)
    for _ in range(50):
        exact.run_step()
    assert abs(readings[-1] - exact.energy_j()) <= 0.1 * exact.power_w() + 1e-9


def test_power_usage_is_a_one_second_average_and_the_instant_field_is_not() -> None:
    gpu = _gpu(step_time_s=0.05)
    idle_w = PHYSICS_PRESETS["a100"].idle_power_w
    gpu.idle(2.0)
    gpu.run_step()  # 50 ms of work after 2 s idle
    busy_w = gpu.instant_power_w()
    assert busy_w > 200.0
    averaged = gpu.power_w()
    assert averaged == pytest.approx(0.95 * idle_w + 0.05 * busy_w)
    old = _gpu("v100")
    with pytest.raises(NotSupportedError, match="instantaneous"):
        old.instant_power_w()


def test_settings_take_effect_after_the_set_latency() -> None:
    gpu = _gpu(setting_latency_s=0.1, step_time_s=0.05)
    full_s = gpu.run_step()
    gpu.set_power_limit_w(150.0)
    assert gpu.power_limit_w() == 150.0  # read back at once
    assert gpu.run_step() == pytest.approx(full_s)  # still under the old limit
    gpu.clock.advance(0.1)
    assert gpu.run_step() > full_s
    gpu.set_power_limit_w(400.0)


def test_sticky_cuda_error_fails_every_later_operation() -> None:
    gpu = _gpu()
    gpu.fail_cuda()
    for call in (gpu.synchronize, gpu.run_step, lambda: gpu.run_work(0.1)):
        with pytest.raises(DriverError, match="sticky"):
            call()
    assert gpu.energy_j() >= 0  # NVML still reads


def test_driver_reload_sends_the_counter_back_and_the_meter_carries_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpu = _gpu(energy_counter_period_s=0.0)
    devices = DeviceSet(gpus=[gpu], clock=gpu.clock.now, backend="simulated")
    meter = EnergyMeter(devices)
    gpu.run_step(3)
    meter.begin("run")
    before = gpu.energy_j()
    gpu.reload_driver()
    assert gpu.energy_j() < before
    step_j = gpu.energy_j()
    gpu.run_step()
    step_j = gpu.energy_j() - step_j
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        m = meter.end("run")
    assert m.energy_j == pytest.approx(step_j)  # what was used since the reload
    assert not m.missing
    assert sum("went backwards" in r.getMessage() for r in caplog.records) == 1


def test_board_options_are_validated_together() -> None:
    with pytest.raises(ConfigError) as info:
        SimulatedSpec(energy_counter_period_s=-1.0, foreign_clock_lock_mhz=(900, 300))
    assert "energy_counter_period_s" in str(info.value)
    assert "foreign_clock_lock_mhz" in str(info.value)
    with pytest.raises(ConfigError, match="enforced_power_limit_w"):
        SimulatedGPU(PHYSICS_PRESETS["a100"], board=Board(enforced_power_limit_w=0.0))


# ---------------------------------------------------------------- enforced power limit
def _controller(tmp_path: Path, gpu: SimulatedGPU, limits: list[float]) -> EnergyController:
    config = EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")},
            "power_limit": {"power_limits_w": limits, "warmup_steps": 2, "settle_steps": 1},
            "log_every_n_steps": 10,
        }
    )
    devices = DeviceSet(
        gpus=[gpu],
        clock=gpu.clock.now,
        backend="simulated",
        run_step=gpu.run_step,
    )
    return EnergyController(config, devices=devices, install_signal_handlers=False)


def test_candidates_above_the_enforced_limit_are_capped_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = _gpu("a40", enforced_power_limit_w=220.0)
    controller = _controller(tmp_path, gpu, [300.0, 250.0, 200.0, 150.0])
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        for _ in range(200):
            controller.on_step_start()
            controller.on_step_end()
    controller.teardown()
    assert gpu.settings() == gpu.initial_settings
    profiled = sorted(m["power_limit_w"] for m in controller.profile())
    assert profiled == [150.0, 200.0, 220.0]  # 300 and 250 W would both run at 220 W
    entries = [d for d in controller.decisions if d["kind"] == "enforced_power_limit"]
    assert [e["value"] for e in entries] == [220.0]
    assert sum("limiter" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------ in-memory pynvml
@pytest.fixture
def rude(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    device = a100(0, draw_mw=300_000.0, energy_update_period_s=0.1, power_average_s=1.0)
    module = make_module([device])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return module


def test_fake_counter_ticks_every_period_and_power_usage_lags(rude: FakeNVML) -> None:
    (gpu,) = nvml_gpus()
    try:
        start = gpu.energy_j()
        rude.advance(0.05)
        assert gpu.energy_j() == start  # not a whole period yet
        rude.advance(0.1)
        assert gpu.energy_j() == pytest.approx(start + 30.0)  # 300 W x 0.1 s
        rude.advance(2.0)
        rude.devices[0].draw_mw = 100_000.0
        rude.advance(0.2)
        assert gpu.instant_power_w() == 100.0
        assert gpu.power_w() == pytest.approx(0.8 * 300.0 + 0.2 * 100.0, abs=0.01)
    finally:
        gpu.close()


def test_nvml_counter_period_is_measured(rude: FakeNVML) -> None:
    gpu = NVMLGPU(rude.devices[0], 0, clock=rude.clock, sleep=rude.sleep)
    try:
        assert gpu.energy_counter_period_s() == pytest.approx(0.1, abs=0.003)
    finally:
        gpu.close()


def test_nvml_counter_period_is_the_median_of_a_jittery_counter(rude: FakeNVML) -> None:
    """Updates come up to 40 ms early or late: some intervals are 20 ms, some 180 ms."""
    rude.devices[0].energy_update_jitter_s = 0.04
    gpu = NVMLGPU(rude.devices[0], 0, clock=rude.clock, sleep=rude.sleep)
    try:
        start_s = rude.now_s
        assert gpu.energy_counter_period_s() == pytest.approx(0.1, abs=0.015)
        assert rude.now_s - start_s == pytest.approx(1.0, abs=0.01)  # polled for about 1 s
    finally:
        gpu.close()


def test_nvml_counter_period_is_probed_once_per_gpu(rude: FakeNVML) -> None:
    device = rude.devices[0]
    first = NVMLGPU(device, 0, clock=rude.clock, sleep=rude.sleep)
    second = NVMLGPU(device, 1, clock=rude.clock, sleep=rude.sleep)
    try:
        period_s = first.energy_counter_period_s()
        reads = rude.call_counts["nvmlDeviceGetTotalEnergyConsumption"]
        probed_at_s = rude.now_s
        assert second.energy_counter_period_s() == period_s  # the same GPU, opened again
        assert rude.now_s == probed_at_s
        assert rude.call_counts["nvmlDeviceGetTotalEnergyConsumption"] == reads
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("instant", ["function_not_found", "unsupported", "unknown_field"])
def test_power_sampler_prefers_the_instant_field_and_falls_back(
    instant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = a100(0, energy_mj=None, draw_mw=300_000.0, power_average_s=1.0)
    module = make_module([device])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (gpu,) = nvml_gpus()
    try:
        assert gpu._sample_power_w() == 300.0  # the instant field where the driver has it
        device.instant_power = instant
        gpu._instant_power = None
        device.power_mw = 123_000
        assert gpu._sample_power_w() == 123.0  # older driver: GetPowerUsage, no error
        with pytest.raises(NotSupportedError):
            gpu.instant_power_w()
    finally:
        gpu.close()


@pytest.mark.parametrize(
    "value_type",
    [
        "NVML_VALUE_TYPE_DOUBLE",
        "NVML_VALUE_TYPE_UNSIGNED_INT",
        "NVML_VALUE_TYPE_UNSIGNED_LONG",
        "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG",
        "NVML_VALUE_TYPE_SIGNED_LONG_LONG",
        "NVML_VALUE_TYPE_SIGNED_INT",
    ],
)
def test_instant_power_is_read_from_the_member_its_value_type_names(
    rude: FakeNVML, value_type: str
) -> None:
    """Drivers differ in the type they give field 186; the other union members hold the
    same bytes read as another type."""
    rude.devices[0].instant_power_value_type = VALUE_TYPES[value_type]
    (gpu,) = nvml_gpus()
    try:
        assert gpu.instant_power_w() == 300.0
    finally:
        gpu.close()


def test_the_fake_field_value_is_laid_out_as_pynvmls() -> None:
    real = importlib.import_module("pynvml")
    assert not isinstance(real, FakeNVML)

    def layout(struct: type) -> list[tuple[str, str]]:
        return [(name, kind.__name__) for name, kind in struct._fields_]  # type: ignore[attr-defined]

    assert layout(NvmlFieldValue)[:-1] == layout(real.c_nvmlFieldValue_t)[:-1]
    assert layout(NvmlValue) == layout(real.c_nvmlValue_t)
    assert {name: getattr(real, name) for name in VALUE_TYPES} == VALUE_TYPES
    assert real.NVML_FI_DEV_POWER_INSTANT == FakeNVML.NVML_FI_DEV_POWER_INSTANT


def test_nvml_sees_an_administrators_clock_lock_only_under_load(rude: FakeNVML) -> None:
    device = rude.devices[0]
    device.locked = (1005, 1005)  # `nvidia-smi -lgc 1005,1005` before the job
    (gpu,) = nvml_gpus()
    try:
        assert gpu.locked_clocks_mhz() is None  # NVML cannot read a lock back
        assert gpu.clock_event_reasons() == CLOCK_EVENT_GPU_IDLE
        assert gpu.foreign_clock_setting() is None  # idle: the lock does not show
        device.busy = True
        assert gpu.clock_event_reasons() & CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING
        assert "nvidia-smi -lgc" in (gpu.foreign_clock_setting() or "")
    finally:
        gpu.close()


def test_nvml_sees_application_clocks_idle_or_busy(rude: FakeNVML) -> None:
    rude.devices[0].applications_clock_mhz = 1005  # `nvidia-smi -ac`
    (gpu,) = nvml_gpus()
    try:
        assert "1005 MHz" in (gpu.foreign_clock_setting() or "")
    finally:
        gpu.close()
