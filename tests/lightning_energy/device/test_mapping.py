"""The framework's torch device is matched to its NVML GPU by UUID, whatever
CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER and the launcher do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DEVICE_ENV_VAR, NVMLGPU, SimulatedSpec, mapping, open_devices
from lightning_energy.device.mapping import normalise_uuid, nvml_gpu_for_device
from lightning_energy.device.nvml import nvml_gpus, visible_gpu_count
from lightning_energy.errors import ConfigError, DriverError, GPULostError, GPUNotFoundError
from tests.lightning_energy.device.fake_cuda import FakeCuda
from tests.lightning_energy.device.fake_pynvml import FakeDevice, FakeNVML, a100, make_module

_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", DEVICE_ENV_VAR)


def a40(index: int) -> FakeDevice:
    return a100(index, name="NVIDIA A40")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)


def install(monkeypatch: pytest.MonkeyPatch, devices: list[FakeDevice]) -> FakeNVML:
    module = make_module(devices)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def nvml_index(fake: FakeNVML, gpu: NVMLGPU) -> int:
    """Position in NVML's (PCI bus) order of the GPU ``gpu`` is."""
    return [d.uuid for d in fake.devices].index(gpu.uuid)


def opened(device: torch.device, cuda: FakeCuda, **kwargs: object) -> NVMLGPU:
    devices = open_devices("nvml", device=device, cuda=cuda, **kwargs)  # type: ignore[arg-type]
    try:
        (gpu,) = devices.gpus
        assert isinstance(gpu, NVMLGPU)
        return gpu
    finally:
        devices.close()


def test_trainer_devices_1_drives_gpu_1_not_gpu_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Trainer(devices=[1])``: one process, local rank 0, training on cuda:1."""
    fake = install(monkeypatch, [a100(i) for i in range(4)])
    gpu = opened(torch.device("cuda", 1), FakeCuda(fake.devices), local_rank=0)
    assert (gpu.index, nvml_index(fake, gpu)) == (1, 1)


def test_trainer_devices_2_3_drives_one_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, [a100(i) for i in range(4)])
    cuda = FakeCuda(fake.devices)
    for local_rank, device_index in enumerate((2, 3)):
        gpu = opened(torch.device("cuda", device_index), cuda, local_rank=local_rank)
        assert nvml_index(fake, gpu) == device_index


def test_visible_devices_are_numbered_fastest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML (PCI bus) order: A40, A100, A40, A100. CUDA's default order puts the A100s
    first, so CUDA_VISIBLE_DEVICES=3,1 names CUDA's 4th and 2nd GPUs, not NVML's."""
    fake = install(monkeypatch, [a40(0), a100(1), a40(2), a100(3)])
    cuda = FakeCuda(fake.devices, speed={"NVIDIA A100-SXM4-40GB": 2.0, "NVIDIA A40": 1.0})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    # Fastest first: [A100 (nvml 1), A100 (nvml 3), A40 (nvml 0), A40 (nvml 2)].
    assert nvml_index(fake, opened(torch.device("cuda", 0), cuda)) == 2
    assert nvml_index(fake, opened(torch.device("cuda", 1), cuda)) == 3
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert nvml_index(fake, opened(torch.device("cuda", 0), cuda)) == 3
    assert nvml_index(fake, opened(torch.device("cuda", 1), cuda)) == 1


@pytest.mark.parametrize("entry", ["GPU-3aaaaaaa-0000-0000-0000-000000000003", "GPU-3a"])
def test_visible_devices_as_uuids_and_prefixes(monkeypatch: pytest.MonkeyPatch, entry: str) -> None:
    fake = install(monkeypatch, [a100(i) for i in range(4)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{entry},GPU-0aaaaaaa-0000-0000-0000-000000000000")
    cuda = FakeCuda(fake.devices)
    assert nvml_index(fake, opened(torch.device("cuda", 0), cuda)) == 3
    assert nvml_index(fake, opened(torch.device("cuda", 1), cuda)) == 0


def test_a_mig_instance_is_matched_and_observed(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = a100(1, mig_mode=1)
    instance = FakeDevice(uuid="MIG-1bbbbbbb-0000-0000-0000-000000000001", parent=parent)
    parent.mig_instances.append(instance)
    fake = install(monkeypatch, [a100(0), parent])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", instance.uuid)
    gpu = opened(torch.device("cuda", 0), FakeCuda(fake.devices))
    assert gpu.uuid == instance.uuid
    assert gpu.is_mig


@pytest.mark.parametrize("lost", [0, 3])
def test_a_gpu_lost_elsewhere_does_not_stop_the_mapping(
    monkeypatch: pytest.MonkeyPatch, lost: int
) -> None:
    """NVML lists a GPU that fell off the bus before (its UUID cannot be read; NVML's lookup
    by UUID may meet it while searching) or after the one this rank trains on."""
    fake = install(monkeypatch, [a100(i) for i in range(4)])
    cuda = FakeCuda(fake.devices)
    fake.devices[lost].lost = True
    for index in (1, 2):
        assert nvml_index(fake, opened(torch.device("cuda", index), cuda)) == index
    assert fake.init_calls == fake.shutdown_calls


def test_a_mig_instance_is_matched_past_a_lost_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = a100(1, mig_mode=1)
    instance = FakeDevice(uuid="MIG-1bbbbbbb-0000-0000-0000-000000000001", parent=parent)
    parent.mig_instances.append(instance)
    fake = install(monkeypatch, [a100(0, lost=True), parent])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", instance.uuid)
    gpu = opened(torch.device("cuda", 0), FakeCuda(fake.devices))
    assert gpu.uuid == instance.uuid
    assert gpu.physical_uuid == parent.uuid


def test_the_lost_gpu_itself_is_reported_as_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, [a100(0), a100(1)])
    cuda = FakeCuda(fake.devices)
    fake.devices[1].lost = True
    with pytest.raises(GPULostError, match=r"cuda:1.*index \[1\] fell off the bus"):
        opened(torch.device("cuda", 1), cuda)
    assert fake.init_calls == fake.shutdown_calls


def test_one_visible_gpu_per_process_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray Train / Slurm --gpu-bind: local rank 1 sees only its GPU, as cuda:0."""
    fake = install(monkeypatch, [a100(i) for i in range(2)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpu = opened(torch.device("cuda", 0), FakeCuda(fake.devices), local_rank=1)
    assert (gpu.index, nvml_index(fake, gpu)) == (0, 1)


def test_cuda_device_without_index_is_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, [a100(i) for i in range(3)])
    gpu = opened(torch.device("cuda"), FakeCuda(fake.devices, current=2))
    assert nvml_index(fake, gpu) == 2


def test_unmatched_devices_are_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, [a100(0), a100(1)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cuda = FakeCuda(fake.devices)
    with pytest.raises(
        GPUNotFoundError, match=r"cuda:1.*CUDA sees 1 GPU.*CUDA_VISIBLE_DEVICES='1'"
    ):
        opened(torch.device("cuda", 1), cuda)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    other = FakeCuda([a100(7)])  # CUDA sees a GPU NVML does not list
    with pytest.raises(GPUNotFoundError, match=r"UUID '7aaaaaaa.*which no NVML GPU has"):
        opened(torch.device("cuda", 0), other)
    with pytest.raises(DriverError, match="CUDA is not available"):
        opened(torch.device("cuda", 0), FakeCuda(fake.devices, available=False))
    with pytest.raises(ConfigError, match=r"an NVML GPU needs a 'cuda' device"):
        nvml_gpu_for_device(torch.device("cpu"), cuda)
    with pytest.raises(ConfigError, match=r"indices=\[0\] and device='cuda:0'"):
        open_devices("nvml", indices=[0], device=torch.device("cuda", 0), cuda=cuda)
    assert fake.init_calls == fake.shutdown_calls


def test_an_index_on_mixed_models_needs_pci_bus_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a CUDA device, a process-local index can only be matched when CUDA numbers
    the GPUs as NVML does."""
    fake = install(monkeypatch, [a40(0), a100(1)])
    FakeCuda(fake.devices, available=False).install(monkeypatch)
    with pytest.raises(ConfigError, match=r"CUDA_DEVICE_ORDER='FASTEST_FIRST'.*PCI_BUS_ID"):
        open_devices("nvml", local_rank=0, device=torch.device("cpu"))
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    devices = open_devices("nvml", local_rank=0, device=torch.device("cpu"))
    try:
        assert [g.uuid for g in devices.gpus] == [fake.devices[0].uuid]
    finally:
        devices.close()
    assert fake.init_calls == fake.shutdown_calls


MIXED_SPEED = {"NVIDIA A100-SXM4-40GB": 2.0, "NVIDIA A40": 1.0}


@pytest.mark.parametrize("visible", ["3,1", None])
def test_integer_entries_on_mixed_models_are_numbered_by_cuda(
    monkeypatch: pytest.MonkeyPatch, visible: str | None
) -> None:
    """NVML order A40, A100, A40, A100; CUDA's fastest-first order A100 (NVML 1), A100 (3),
    A40 (0), A40 (2): ``3,1`` are CUDA's 4th and 2nd GPUs, NVML's 2 and 3, not NVML's 3 and
    1, and without the variable process-local GPU ``i`` is CUDA's ``i``-th."""
    fake = install(monkeypatch, [a40(0), a100(1), a40(2), a100(3)])
    cuda = FakeCuda(fake.devices, speed=MIXED_SPEED).install(monkeypatch)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpus = nvml_gpus()
    try:
        assert [normalise_uuid(g.uuid) for g in gpus] == [
            normalise_uuid(cuda.uuid(i)) for i in range(cuda.device_count())
        ]
        assert [nvml_index(fake, g) for g in gpus] == ([2, 3] if visible else [1, 3, 0, 2])
        assert visible_gpu_count() == len(gpus)
    finally:
        for gpu in gpus:
            gpu.close()


def test_integer_entries_on_mixed_models_without_cuda_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = install(monkeypatch, [a40(0), a100(1), a40(2), a100(3)])
    FakeCuda(fake.devices, speed=MIXED_SPEED, available=False).install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with pytest.raises(ConfigError, match=r"CUDA_DEVICE_ORDER='FASTEST_FIRST'.*PCI_BUS_ID"):
        nvml_gpus()
    assert visible_gpu_count() == 2  # counting needs no order
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA numbers as NVML does
    gpus = nvml_gpus()
    try:
        assert [nvml_index(fake, g) for g in gpus] == [3, 1]
    finally:
        for gpu in gpus:
            gpu.close()
    assert fake.init_calls == fake.shutdown_calls


def test_integer_entries_on_one_model_need_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, [a100(i) for i in range(4)])
    FakeCuda(fake.devices, available=False).install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    gpus = nvml_gpus()
    try:
        assert [nvml_index(fake, g) for g in gpus] == [3, 1]
    finally:
        for gpu in gpus:
            gpu.close()


def test_simulated_backend_follows_the_device_index_else_the_rank() -> None:
    spec = SimulatedSpec(gpu="a100", count=4)
    (gpu,) = open_devices(
        "simulated", simulated=spec, device=torch.device("cuda", 2), local_rank=0
    ).gpus
    assert gpu.index == 2
    (gpu,) = open_devices(
        "simulated", simulated=spec, device=torch.device("cpu"), local_rank=1
    ).gpus
    assert gpu.index == 1


def test_controller_opens_the_framework_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = install(monkeypatch, [a100(i) for i in range(4)])
    cuda = FakeCuda(fake.devices)
    monkeypatch.setattr(mapping, "TorchCuda", lambda: cuda)
    config = EnergyConfig.from_mapping(
        {"device": {"backend": "nvml", "lease_dir": str(tmp_path / "leases")}}
    )
    controller = EnergyController(
        config, local_rank=1, device=torch.device("cuda", 3), install_signal_handlers=False
    )
    try:
        (gpu,) = controller.devices.gpus
        assert gpu.uuid == fake.devices[3].uuid
    finally:
        controller.devices.close()


def test_uuids_match_with_or_without_prefix_and_case() -> None:
    assert normalise_uuid("GPU-ABCD-1") == normalise_uuid("abcd-1") == "abcd-1"
    assert normalise_uuid(" MIG-abcd-2") == "abcd-2"


@settings(max_examples=40, deadline=None)
@given(
    order=st.permutations(range(4)),
    size=st.integers(1, 4),
    pci=st.booleans(),
    data=st.data(),
)
def test_every_visible_device_maps_to_the_gpu_cuda_names(
    order: list[int], size: int, pci: bool, data: st.DataObject
) -> None:
    """For any CUDA_VISIBLE_DEVICES permutation and device order, cuda:i is the GPU CUDA
    reports for i, and no two devices share an NVML GPU."""
    devices = [a40(0), a100(1), a40(2), a100(3)]
    fake = make_module(devices)
    cuda = FakeCuda(devices, speed={"NVIDIA A100-SXM4-40GB": 2.0})
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "pynvml", fake)
        mp.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, order[:size])))
        mp.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID" if pci else "FASTEST_FIRST")
        index = data.draw(st.integers(0, size - 1))
        gpu = nvml_gpu_for_device(torch.device("cuda", index), cuda)
        try:
            assert normalise_uuid(gpu.uuid) == normalise_uuid(cuda.uuid(index))
            assert gpu.index == index
        finally:
            gpu.close()
