"""An administrator's clock lock (``nvidia-smi -lgc``) shows only under load: it is looked
for during the first training steps and before each lock, then respected to the end."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.simulated import (
    CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING,
    CLOCK_EVENT_GPU_IDLE,
)
from tests.lightning_energy.device.fake_pynvml import FakeNVML, a100, make_module

ADMIN_LOCK = (1005, 1005)


def _gpu(**spec: object) -> SimulatedGPU:
    return simulated_gpus(SimulatedSpec(gpu="a100", setting_latency_s=0.0, **spec))[0]  # type: ignore[arg-type]


def _left_alone(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]


def _config(tmp_path: Path, backend: str) -> EnergyConfig:
    return EnergyConfig.from_mapping(
        {
            "device": {"backend": backend, "lease_dir": str(tmp_path / "leases")},
            "power_limit": {"enabled": False},
        }
    )


# ------------------------------------------------------------------ the simulated board
def test_a_lock_shows_only_right_after_work_held_below_its_clock() -> None:
    gpu = _gpu(foreign_clock_lock_mhz=ADMIN_LOCK)
    assert gpu.locked_clocks_mhz() is None  # as on NVML, a lock cannot be read back
    assert gpu.clock_event_reasons() == CLOCK_EVENT_GPU_IDLE  # idle: GpuIdle, nothing else
    assert gpu.foreign_clock_setting() is None
    assert gpu.run_work(0.1, 1.0) == pytest.approx(0.1 * 1410 / 1005)  # held at 1005 MHz
    assert gpu.clock_event_reasons() & CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING
    assert gpu.foreign_clock_setting() is not None
    gpu.idle(0.01)  # any idle time since the work: the driver samples an idle GPU
    assert gpu.clock_event_reasons() == CLOCK_EVENT_GPU_IDLE
    gpu.run_work(0.1)
    gpu.clock.advance(0.01)  # another GPU's work on the shared clock: idle here too
    assert gpu.foreign_clock_setting() is None
    at_the_top = _gpu(foreign_clock_lock_mhz=(1410, 1410))
    at_the_top.run_work(0.1)  # a lock that holds nothing back is not reported
    assert not at_the_top.clock_event_reasons() & CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING


# ------------------------------------------------------------------------------ guard
def test_the_guard_finds_a_lock_under_load_and_never_locks_or_resets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = _gpu(foreign_clock_lock_mhz=ADMIN_LOCK)
    with (
        caplog.at_level(logging.WARNING, logger="lightning_energy"),
        GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard,
    ):
        guard.check_foreign_clocks()  # idle: nothing to see yet
        assert _left_alone(caplog) == []
        gpu.run_step()
        guard.check_foreign_clocks()  # under load: found
        gpu.idle(1.0)
        assert guard.lock_clocks_mhz(600, 900) is None
        guard.reset_clocks()
        assert guard.set_power_limit_w(300.0) == 300.0  # power limits still apply
        guard.check_foreign_clocks()
    assert gpu.foreign_clock_lock_mhz() == ADMIN_LOCK  # never replaced, never reset
    assert len(_left_alone(caplog)) == 1  # reported once


def test_a_lock_found_just_before_a_lock_is_respected(tmp_path: Path) -> None:
    gpu = _gpu(foreign_clock_lock_mhz=ADMIN_LOCK)
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        gpu.run_step()  # the lock is asked for while work runs
        assert guard.lock_clocks_mhz(600, 900) is None
    assert gpu.foreign_clock_lock_mhz() == ADMIN_LOCK


# ------------------------------------------------------------------------- controller
def test_the_first_steps_find_a_lock_that_an_idle_gpu_hid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Setup sees an idle GPU; the first steps run under the lock and reveal it, so a lock
    asked for later, while the GPU idles (a checkpoint, a validation), changes nothing."""
    gpu = _gpu(foreign_clock_lock_mhz=ADMIN_LOCK)
    devices = DeviceSet(
        gpus=[gpu],
        clock=gpu.clock.now,
        backend="simulated",
        run_step=gpu.run_step,
    )
    controller = EnergyController(
        _config(tmp_path, "simulated"), devices=devices, install_signal_handlers=False
    )
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        for _ in range(5):
            controller.on_step_start()
            controller.on_step_end()
        gpu.idle(2.0)
        guard = controller.guard
        assert guard is not None
        assert guard.lock_clocks_mhz(900, 900) is None
        controller.teardown()
    assert gpu.foreign_clock_lock_mhz() == ADMIN_LOCK
    assert gpu.settings() == gpu.initial_settings
    assert len(_left_alone(caplog)) == 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    module = make_module([a100(0)])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return module


def _steps(controller: EnergyController, n: int) -> None:
    for _ in range(n):
        controller.on_step_start()
        controller.on_step_end()


def test_on_nvml_the_first_steps_find_the_lock_at_one_call_a_check(
    fake: FakeNVML, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    device = fake.devices[0]
    device.locked = ADMIN_LOCK  # `nvidia-smi -lgc 1005,1005`, invisible to an idle read
    controller = EnergyController(_config(tmp_path, "nvml"), install_signal_handlers=False)
    try:
        controller.setup()
        counts = fake.call_counts
        before = dict(counts)
        device.busy = True  # training runs
        with caplog.at_level(logging.WARNING, logger="lightning_energy"):
            _steps(controller, 1)
            reads = counts["nvmlDeviceGetCurrentClocksEventReasons"]
            assert reads - before["nvmlDeviceGetCurrentClocksEventReasons"] == 1
            for name in ("nvmlDeviceGetApplicationsClock", "nvmlDeviceGetDefaultApplicationsClock"):
                assert counts[name] == before[name]  # one NVML call a check
            _steps(controller, 20)
            device.busy = False
            guard = controller.guard
            assert guard is not None
            assert guard.lock_clocks_mhz(900, 900) is None
    finally:
        controller.teardown()
    assert device.locked == ADMIN_LOCK
    assert not [c for c in fake.calls if c[0] in ("set_locked_clocks", "reset_locked_clocks")]
    assert len(_left_alone(caplog)) == 1
    assert fake.init_calls == fake.shutdown_calls


def test_on_nvml_only_the_first_steps_are_checked(fake: FakeNVML, tmp_path: Path) -> None:
    fake.devices[0].busy = True
    controller = EnergyController(_config(tmp_path, "nvml"), install_signal_handlers=False)
    counts = fake.call_counts
    applications = ("nvmlDeviceGetApplicationsClock", "nvmlDeviceGetDefaultApplicationsClock")
    try:
        controller.setup()
        set_up = counts["nvmlDeviceGetCurrentClocksEventReasons"]
        read_at_setup = [counts[name] for name in applications]
        _steps(controller, 10)
        checked = counts["nvmlDeviceGetCurrentClocksEventReasons"]
        assert checked > set_up
        assert [counts[name] for name in applications] == read_at_setup  # one call a check
        _steps(controller, 10)
        assert counts["nvmlDeviceGetCurrentClocksEventReasons"] == checked  # no cost later on
        guard = controller.guard
        assert guard is not None
        assert guard.lock_clocks_mhz(900, 900) == (900, 900)  # nothing foreign: locks apply
        assert counts["nvmlDeviceGetCurrentClocksEventReasons"] == checked + 1  # checked first
    finally:
        controller.teardown()
    assert fake.devices[0].locked is None
