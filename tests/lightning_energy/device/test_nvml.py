"""The NVML backend against an in-memory pynvml: units, errors, selection, MIG, sampler."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from lightning_energy.device import GPU, work_runner
from lightning_energy.device import nvml as backend
from lightning_energy.device.base import LeaseSource
from lightning_energy.device.nvml import NVMLGPU, PowerSampler, nvml_gpus, visible_gpu_count
from lightning_energy.errors import (
    DeviceError,
    DriverError,
    GPULostError,
    GPUNotFoundError,
    NoPermissionError,
    NotSupportedError,
)
from tests.lightning_energy.device.fake_pynvml import (
    ERROR_CODES,
    FakeDevice,
    FakeNVML,
    a100,
    make_module,
)


def _install(monkeypatch: pytest.MonkeyPatch, devices: list[FakeDevice]) -> FakeNVML:
    """The fake NVML over ``devices``; CUDA numbers GPUs as NVML does (PCI bus order), so
    indices name the same GPUs on both sides, also on mixed models."""
    module = make_module(devices)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return module


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNVML]:
    module = _install(monkeypatch, [a100(0), a100(1, name="NVIDIA H100 80GB HBM3")])
    yield module
    assert module.init_calls == module.shutdown_calls


@pytest.fixture
def gpus(fake: FakeNVML) -> Iterator[list[NVMLGPU]]:
    opened = nvml_gpus()
    yield opened
    for gpu in opened:
        gpu.close()


def test_reads_every_value_in_si_units(fake: FakeNVML, gpus: list[NVMLGPU]) -> None:
    device = fake.devices[0]
    device.enforced_limit_mw = 300_000
    gpu = gpus[0]
    assert isinstance(gpu, GPU)
    assert (gpu.index, gpu.name, gpu.uuid, gpu.is_mig) == (0, device.name, device.uuid, False)
    assert gpus[1].name == "NVIDIA H100 80GB HBM3"
    assert gpu.power_limit_constraints_w() == (100.0, 400.0)
    assert gpu.default_power_limit_w() == 400.0
    assert gpu.power_limit_w() == 400.0
    assert gpu.enforced_power_limit_w() == 300.0
    assert gpu.power_w() == 250.5
    assert gpu.energy_j() == 123.456
    gpu.synchronize()


def test_set_power_limit_converts_to_integer_milliwatts(
    fake: FakeNVML, gpus: list[NVMLGPU]
) -> None:
    gpus[0].set_power_limit_w(250.5)
    assert fake.calls == [("set_power_limit", gpus[0].uuid, 250_500)]
    assert gpus[0].power_limit_w() == 250.5
    with pytest.raises(DriverError, match="outside the supported range") as info:
        gpus[0].set_power_limit_w(401.0)
    assert (info.value.gpu_index, info.value.operation) == (0, "set_power_limit")
    assert len(fake.calls) == 1


def test_clocks_at_the_highest_memory_clock_and_lock(fake: FakeNVML, gpus: list[NVMLGPU]) -> None:
    fake.devices[0].graphics_clocks[1215] = (1005, 1410, 210, 1395, 1410)
    gpu = gpus[0]
    assert gpu.supported_sm_clocks_mhz() == [1410, 1395, 1005, 210]
    assert gpu.locked_clocks_mhz() is None
    gpu.set_locked_clocks_mhz(1005, 1005)
    assert gpu.locked_clocks_mhz() == (1005, 1005)
    assert fake.devices[0].locked == (1005, 1005)
    gpu.reset_locked_clocks()
    assert gpu.locked_clocks_mhz() is None
    assert fake.calls == [
        ("set_locked_clocks", gpu.uuid, 1005, 1005),
        ("reset_locked_clocks", gpu.uuid),
    ]


OPERATIONS = [
    (
        "nvmlDeviceGetPowerManagementLimitConstraints",
        "power_limit_constraints",
        lambda g: g.power_limit_constraints_w(),
    ),
    (
        "nvmlDeviceGetPowerManagementDefaultLimit",
        "default_power_limit",
        lambda g: g.default_power_limit_w(),
    ),
    ("nvmlDeviceGetPowerManagementLimit", "power_limit", lambda g: g.power_limit_w()),
    (
        "nvmlDeviceGetEnforcedPowerLimit",
        "enforced_power_limit",
        lambda g: g.enforced_power_limit_w(),
    ),
    ("nvmlDeviceSetPowerManagementLimit", "set_power_limit", lambda g: g.set_power_limit_w(200.0)),
    (
        "nvmlDeviceGetSupportedMemoryClocks",
        "supported_clocks",
        lambda g: g.supported_sm_clocks_mhz(),
    ),
    (
        "nvmlDeviceGetSupportedGraphicsClocks",
        "supported_clocks",
        lambda g: g.supported_sm_clocks_mhz(),
    ),
    (
        "nvmlDeviceSetGpuLockedClocks",
        "set_locked_clocks",
        lambda g: g.set_locked_clocks_mhz(900, 900),
    ),
    ("nvmlDeviceResetGpuLockedClocks", "reset_locked_clocks", lambda g: g.reset_locked_clocks()),
    ("nvmlDeviceGetTotalEnergyConsumption", "energy", lambda g: g.energy_j()),
    ("nvmlDeviceGetPowerUsage", "power", lambda g: g.power_w()),
    (
        "nvmlDeviceGetComputeRunningProcesses",
        "running_processes",
        lambda g: g.running_process_ids(),
    ),
]
ERRORS = [
    ("NVML_ERROR_NO_PERMISSION", NoPermissionError),
    ("NVML_ERROR_NOT_SUPPORTED", NotSupportedError),
    ("NVML_ERROR_GPU_IS_LOST", GPULostError),
    ("NVML_ERROR_UNKNOWN", DriverError),
    ("NVML_ERROR_INVALID_ARGUMENT", DriverError),
]


# An unsupported energy counter is not an error: it falls back to sampling (tested below).
CASES = [
    (*op, *err)
    for op in OPERATIONS
    for err in ERRORS
    if (op[1], err[0]) != ("energy", "NVML_ERROR_NOT_SUPPORTED")
]


@pytest.mark.parametrize(
    ("fn", "operation", "call", "code", "error"), CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES]
)
def test_every_nvml_error_is_translated_with_context(
    fake: FakeNVML,
    gpus: list[NVMLGPU],
    fn: str,
    operation: str,
    call: object,
    code: str,
    error: type[DeviceError],
) -> None:
    fake.devices[1].errors[fn] = ERROR_CODES[code]
    with pytest.raises(error) as info:
        call(gpus[1])  # type: ignore[operator]
    assert type(info.value) is error
    assert info.value.gpu_index == 1
    assert info.value.operation == operation
    assert isinstance(info.value.__cause__, fake.NVMLError)
    assert code in str(info.value)


@pytest.mark.parametrize("code", ["NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"])
def test_init_failure_is_a_driver_error(fake: FakeNVML, code: str) -> None:
    fake.init_error = ERROR_CODES[code]
    with pytest.raises(DriverError, match=code) as info:
        nvml_gpus()
    assert info.value.operation == "init"
    fake.init_calls = 0


def test_missing_pynvml_is_a_driver_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(DriverError, match="install nvidia-ml-py"):
        visible_gpu_count()


def test_handle_lookup_errors_are_gpu_not_found(fake: FakeNVML) -> None:
    for code in ("NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
        exc = fake.NVMLError(ERROR_CODES[code])
        translated = backend.translate_nvml_error(exc, gpu_index=3, operation="get_handle")
        assert type(translated) is GPUNotFoundError
        assert translated.gpu_index == 3
    with pytest.raises(GPUNotFoundError, match=r"index \[2\]: 2 visible"):
        nvml_gpus([0, 2])


def test_init_is_refcounted(fake: FakeNVML) -> None:
    first = nvml_gpus()
    second = nvml_gpus([1])
    assert fake.init_calls == 1
    for gpu in first:
        gpu.close()
        gpu.close()  # idempotent
    assert fake.shutdown_calls == 0
    assert second[0].power_w() == 250.5
    second[0].close()
    assert fake.shutdown_calls == 1


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("1", [1]),
        ("1,0", [1, 0]),
        (" 0 , 1 ", [0, 1]),
        ("GPU-1aaaaaaa-0000-0000-0000-000000000001", [1]),
        ("GPU-1aaa", [1]),  # a unique prefix, as CUDA accepts
        ("GPU-1aaa,0", [1, 0]),
        ("-1", []),
        ("", []),
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("GPU-", []),  # ambiguous prefix
        ("GPU-zzz,0", []),
    ],
)
def test_cuda_visible_devices_maps_local_indices(
    fake: FakeNVML, monkeypatch: pytest.MonkeyPatch, visible: str, expected: list[int]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_gpu_count() == len(expected)
    opened = nvml_gpus()
    try:
        devices = fake.devices
        assert [g.uuid for g in opened] == [devices[i].uuid for i in expected]
        assert [g.index for g in opened] == list(range(len(expected)))
    finally:
        for gpu in opened:
            gpu.close()


def _mig_setup(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    parent = a100(0, mig_mode=1, power_mw=180_000, energy_mj=9_000)
    instance = FakeDevice(
        name="NVIDIA A100-SXM4-40GB MIG 1g.5gb",
        uuid="MIG-11111111-2222-3333-4444-555555555555",
        parent=parent,
        power_mw=0,
        energy_mj=None,
        errors={"nvmlDeviceGetPowerUsage": ERROR_CODES["NVML_ERROR_NOT_SUPPORTED"]},
    )
    parent.mig_instances = [instance]
    return _install(monkeypatch, [parent, a100(1, mig_mode=None)])


def test_mig_instance_is_observe_only(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _mig_setup(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-11111111-2222-3333-4444-555555555555")
    (gpu,) = nvml_gpus()
    try:
        assert gpu.is_mig
        assert gpu.name.endswith("MIG 1g.5gb")
        assert gpu.uuid.startswith("MIG-")
        # Readings are the physical GPU's.
        assert gpu.power_w() == 180.0
        assert gpu.energy_j() == 9.0
        assert gpu.power_limit_constraints_w() == (100.0, 400.0)
        for call in (
            lambda: gpu.set_power_limit_w(200.0),
            lambda: gpu.set_locked_clocks_mhz(900, 900),
            gpu.reset_locked_clocks,
        ):
            with pytest.raises(NotSupportedError, match="MIG is observe-only"):
                call()
        assert fake.calls == []
    finally:
        gpu.close()


def test_gpu_in_mig_mode_is_observe_only_and_pre_ampere_is_not_mig(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _mig_setup(monkeypatch)
    whole, old = nvml_gpus()
    try:
        assert whole.is_mig
        assert not old.is_mig  # GetMigMode not supported: not a MIG GPU
        with pytest.raises(NotSupportedError, match="observe-only"):
            whole.set_power_limit_w(300.0)
        old.set_power_limit_w(300.0)
    finally:
        whole.close()
        old.close()


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lightning-energy-power-sampler"]


def test_energy_falls_back_to_a_power_sampler_stopped_on_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _install(monkeypatch, [a100(0, energy_mj=None, power_mw=200_000)])
    (gpu,) = nvml_gpus(power_sample_interval_s=0.001)
    first = gpu.energy_j()
    assert len(_sampler_threads()) == 1
    assert gpu.energy_j() >= first >= 0.0
    for fn in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetFieldValues"):  # lost: all fail
        fake.devices[0].errors[fn] = ERROR_CODES["NVML_ERROR_GPU_IS_LOST"]
    with pytest.raises(GPULostError):
        while True:  # the sampler thread stores the failure; energy_j reports it
            gpu.energy_j()
    gpu.close()
    assert _sampler_threads() == []


def test_threads_reading_energy_at_once_start_one_power_sampler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = a100(0, energy_mj=None, power_mw=200_000)
    _install(monkeypatch, [device])
    meet = threading.Barrier(2, timeout=30)  # both threads inside the first energy read
    device.hooks["nvmlDeviceGetTotalEnergyConsumption"] = meet.wait
    (gpu,) = nvml_gpus(power_sample_interval_s=0.001)
    try:
        readings: list[float] = []
        threads = [threading.Thread(target=lambda: readings.append(gpu.energy_j())) for _ in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(readings) == 2
        assert len(_sampler_threads()) == 1
    finally:
        gpu.close()
    assert _sampler_threads() == []


def test_a_closed_gpu_starts_no_power_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, [a100(0, energy_mj=None), a100(1, energy_mj=None)])
    closed, still_open = nvml_gpus()  # NVML stays initialised for the other one
    closed.close()
    try:
        with pytest.raises(DriverError, match="closed"):
            closed.energy_j()
        assert _sampler_threads() == []
    finally:
        still_open.close()


def test_power_sampler_integrates_a_step_function() -> None:
    now = [0.0]
    power = [100.0]
    sampler = PowerSampler(lambda: power[0], clock=lambda: now[0])
    assert sampler.energy_j() == 0.0
    sampler.sample()
    now[0] = 2.0
    assert sampler.energy_j() == 200.0
    power[0] = 300.0
    sampler.sample()  # charges 100 W for [0, 2] and starts holding 300 W
    now[0] = 3.0
    assert sampler.energy_j() == 500.0
    assert not sampler.running
    sampler.stop()


def test_synchronize_uses_torch_cuda_when_available(
    gpus: list[NVMLGPU], monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    gpus[1].synchronize()
    assert synced == [torch.device("cuda", 1)]


def test_a_gpu_whose_stream_never_advances_is_not_waited_for_forever(
    fake: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collective whose peer is gone stalls the stream: a reading's synchronisation
    gives up after the GPU's timeout with a DriverError (measurements go on without it),
    instead of blocking the process, at teardown too."""
    from tests.lightning_energy.device.fake_cuda import FakeCuda

    cuda = FakeCuda(fake.devices).install(monkeypatch)
    (gpu,) = nvml_gpus([0], sync_timeout_s=0.2)
    try:
        cuda.launch(0.01)
        gpu.synchronize()  # work that finishes: waited for
        cuda.stall(torch.cuda.current_stream(0))
        with pytest.raises(DriverError, match="did not finish its queued work"):
            gpu.synchronize()
    finally:
        cuda.release()
        gpu.close()


def test_a_sticky_cuda_error_in_a_synchronisation_is_a_driver_error(
    fake: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.lightning_energy.device.fake_cuda import FakeCuda

    cuda = FakeCuda(fake.devices).install(monkeypatch)
    (gpu,) = nvml_gpus([0])
    try:
        cuda.lose(0)
        with pytest.raises(DriverError, match="unspecified launch failure"):
            gpu.synchronize()
    finally:
        gpu.close()


def test_a_real_gpu_is_timed_on_the_wall_clock_and_reopened_through_nvml(
    gpus: list[NVMLGPU], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = gpus[0]
    assert gpu.lease_source() == LeaseSource("nvml")
    slept: list[float] = []
    with monkeypatch.context() as patch:
        patch.setattr(backend.time, "sleep", slept.append)
        patch.setattr(backend.time, "perf_counter", lambda: 42.5)
        gpu.idle(0.25)
        assert gpu.now_s() == 42.5
    assert slept == [0.25]


def test_a_real_gpu_leaves_its_work_to_the_framework(gpus: list[NVMLGPU]) -> None:
    """No work runner: a real GPU's work is the framework's kernels."""
    assert work_runner(gpus[0]) is None


def test_running_process_ids(fake: FakeNVML, gpus: list[NVMLGPU]) -> None:
    fake.devices[1].processes = [4242, 77]
    assert gpus[1].running_process_ids() == [4242, 77]
    assert gpus[0].running_process_ids() == []
