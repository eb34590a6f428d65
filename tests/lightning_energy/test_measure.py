"""Measurement windows: device-clock durations, per-GPU energy, nesting, synchronisation."""

from __future__ import annotations

import pytest

from lightning_energy.device import DeviceSet, SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.measure import EnergyMeter, WindowError


def _devices(count: int = 2) -> tuple[DeviceSet, list[SimulatedGPU]]:
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", count=count))
    return DeviceSet(gpus=gpus, clock=gpus[0].clock.now, backend="simulated"), gpus


def test_window_measures_the_gpu_work_on_the_device_clock() -> None:
    devices, gpus = _devices()
    meter = EnergyMeter(devices)
    meter.begin("step")
    durations = [gpu.run_step() for gpu in gpus]
    m = meter.end("step")
    # The GPUs share one virtual clock and ran one after the other.
    assert m.duration_s == pytest.approx(sum(durations))
    assert len(m.energy_per_gpu_j) == 2
    assert all(e > 0 for e in m.energy_per_gpu_j)
    assert m.energy_j == pytest.approx(sum(m.energy_per_gpu_j))
    assert m.average_power_w == pytest.approx(m.energy_j / m.duration_s)


def test_windows_nest_and_add_up() -> None:
    devices, (gpu,) = _devices(1)
    meter = EnergyMeter(devices)
    meter.begin("epoch")
    steps = []
    for _ in range(3):
        meter.begin("step")
        gpu.run_step()
        steps.append(meter.end("step"))
    epoch = meter.end("epoch")
    assert epoch.duration_s == pytest.approx(sum(s.duration_s for s in steps))
    assert epoch.energy_j == pytest.approx(sum(s.energy_j for s in steps))


def test_readings_synchronise_the_devices_first(monkeypatch: pytest.MonkeyPatch) -> None:
    devices, (gpu,) = _devices(1)
    calls = []
    real = gpu.synchronize

    def counted() -> None:
        calls.append(1)
        real()

    monkeypatch.setattr(gpu, "synchronize", counted)
    meter = EnergyMeter(devices)
    meter.begin("w")
    meter.end("w")
    assert len(calls) == 2
    unsynced = EnergyMeter(devices, synchronize=False)
    unsynced.begin("w")
    unsynced.end("w")
    assert len(calls) == 2


def test_misuse_is_reported() -> None:
    meter = EnergyMeter(_devices(1)[0])
    with pytest.raises(WindowError, match="never opened"):
        meter.end("nope")
    meter.begin("a")
    with pytest.raises(WindowError, match="already open"):
        meter.begin("a")
    meter.cancel("a")
    assert not meter.is_open("a")
    meter.cancel("a")  # cancelling twice is harmless
