"""Backend selection: argument, environment variable, auto fallback, DDP local rank."""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch

from lightning_energy.device import (
    DEVICE_ENV_VAR,
    NVMLGPU,
    SimulatedGPU,
    SimulatedSpec,
    open_devices,
)
from lightning_energy.errors import ConfigError, DriverError, GPUNotFoundError
from tests.lightning_energy.device.fake_cuda import FakeCuda
from tests.lightning_energy.device.fake_pynvml import ERROR_CODES, FakeNVML, a100, make_module


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    module = make_module([a100(0), a100(1)])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)
    return module


@pytest.fixture
def no_nvml(fake: FakeNVML) -> FakeNVML:
    fake.init_error = ERROR_CODES["NVML_ERROR_LIBRARY_NOT_FOUND"]
    return fake


def test_simulated_backend_runs_steps_on_a_virtual_clock(fake: FakeNVML) -> None:
    with open_devices("simulated", simulated=SimulatedSpec(gpu="a100", count=2)) as devices:
        assert devices.backend == "simulated"
        assert all(isinstance(g, SimulatedGPU) for g in devices.gpus)
        assert devices.clock() == 0.0
        assert devices.run_step is not None
        devices.run_step()
        assert devices.clock() == pytest.approx(0.25)
        devices.synchronize()
    assert fake.init_calls == 0


def test_auto_uses_nvml_when_it_sees_a_gpu(fake: FakeNVML) -> None:
    devices = open_devices()
    try:
        assert devices.backend == "nvml"
        assert all(isinstance(g, NVMLGPU) for g in devices.gpus)
        assert devices.clock is time.perf_counter
        assert devices.run_step is None
        assert len(devices) == 2
    finally:
        devices.close()
    assert fake.shutdown_calls == fake.init_calls


def test_auto_falls_back_to_simulated_with_one_info_line(
    no_nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_energy.device"):
        devices = open_devices("auto", simulated=SimulatedSpec(gpu="v100"))
    assert devices.backend == "simulated"
    assert devices.gpus[0].name == "NVIDIA V100 (simulated)"
    lines = [r for r in caplog.records if r.name.startswith("lightning_energy.device")]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert "simulated" in lines[0].getMessage()
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in lines[0].getMessage()


def test_auto_falls_back_when_nvml_sees_no_gpu(fake: FakeNVML) -> None:
    fake.devices.clear()
    assert open_devices().backend == "simulated"
    assert fake.init_calls == fake.shutdown_calls == 1


def test_nvml_requested_without_nvml_is_a_driver_error(no_nvml: FakeNVML) -> None:
    with pytest.raises(DriverError, match="LIBRARY_NOT_FOUND"):
        open_devices("nvml")


def test_environment_variable_sets_the_default_backend(
    no_nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DEVICE_ENV_VAR, "nvml")
    with pytest.raises(DriverError):
        open_devices()
    # An explicit argument wins over the environment.
    assert open_devices("simulated").backend == "simulated"
    monkeypatch.setenv(DEVICE_ENV_VAR, " Simulated ")
    assert open_devices().backend == "simulated"
    monkeypatch.setenv(DEVICE_ENV_VAR, "cuda")
    with pytest.raises(ConfigError, match=r"env LIGHTNING_ENERGY_DEVICE.*'cuda'.*allowed") as info:
        open_devices()
    assert info.value.source == f"env {DEVICE_ENV_VAR}"


def test_local_rank_selects_this_ranks_gpu(fake: FakeNVML) -> None:
    spec = SimulatedSpec(gpu="a100", count=4, slowdowns=(1.0, 1.0, 1.0, 1.4))
    (gpu,) = open_devices("simulated", simulated=spec, local_rank=3).gpus
    assert isinstance(gpu, SimulatedGPU)
    assert (gpu.index, gpu.uuid, gpu.slowdown) == (3, "GPU-sim-a100-3", 1.4)
    (other,) = open_devices("simulated", simulated=spec, local_rank=1).gpus
    assert isinstance(other, SimulatedGPU)
    assert other.slowdown == 1.0
    devices = open_devices("nvml", local_rank=1)
    try:
        assert [(g.index, g.uuid) for g in devices.gpus] == [(1, fake.devices[1].uuid)]
    finally:
        devices.close()
    with pytest.raises(GPUNotFoundError):
        open_devices("nvml", local_rank=2)


def test_indices_select_gpus(fake: FakeNVML) -> None:
    devices = open_devices("simulated", simulated=SimulatedSpec(count=3), indices=[2, 0])
    assert [g.index for g in devices.gpus] == [2, 0]
    with pytest.raises(ConfigError, match=r"\[5\] not among"):
        open_devices("simulated", simulated=SimulatedSpec(count=3), indices=[5])
    devices = open_devices("nvml", indices=[1])
    try:
        assert [g.uuid for g in devices.gpus] == [fake.devices[1].uuid]
    finally:
        devices.close()


def test_invalid_arguments_are_reported_together(fake: FakeNVML) -> None:
    with pytest.raises(ConfigError) as info:
        open_devices("tpu", indices=[0], local_rank=-1)
    assert len(info.value.problems) == 3


def test_opening_a_local_rank_initialises_nvml_once_and_closing_shuts_it_down(
    fake: FakeNVML,
) -> None:
    devices = open_devices("nvml", local_rank=1)
    assert [g.index for g in devices.gpus] == [1]
    assert fake.init_calls == 1 and fake.shutdown_calls == 0  # the device-order check included
    devices.close()
    assert fake.init_calls == fake.shutdown_calls == 1


def test_auto_with_a_cpu_device_simulates_and_leaves_the_gpus_alone(
    fake: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    """A framework computing on the CPU on a GPU node: its local rank's GPU may be another
    job's; ``auto`` must not open it, one INFO line says why and how to drive it anyway."""
    spec = SimulatedSpec(count=2)
    with (
        caplog.at_level(logging.INFO, logger="lightning_energy.device"),
        open_devices("auto", device=torch.device("cpu"), local_rank=1, simulated=spec) as devices,
    ):
        assert devices.backend == "simulated"
        assert [g.index for g in devices.gpus] == [1]
    assert fake.init_calls == 0
    lines = [r for r in caplog.records if r.name.startswith("lightning_energy.device")]
    assert len(lines) == 1
    message = lines[0].getMessage()
    assert lines[0].levelno == logging.INFO
    assert "'cpu'" in message and "simulated" in message and "backend: nvml" in message


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_nvml_asked_for_with_a_cpu_device_drives_the_local_ranks_gpu(
    fake: FakeNVML, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "environment":
        monkeypatch.setenv(DEVICE_ENV_VAR, "nvml")
    devices = open_devices(
        "nvml" if how == "argument" else None, device=torch.device("cpu"), local_rank=1
    )
    try:
        assert devices.backend == "nvml"
        assert [g.uuid for g in devices.gpus] == [fake.devices[1].uuid]
    finally:
        devices.close()


def test_auto_with_a_cuda_device_drives_that_gpu(
    fake: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = FakeCuda(fake.devices).install(monkeypatch)
    devices = open_devices("auto", device=torch.device("cuda", 1), local_rank=0, cuda=cuda)
    try:
        assert devices.backend == "nvml"
        assert [g.uuid for g in devices.gpus] == [fake.devices[1].uuid]
    finally:
        devices.close()
