"""Every adapter hands the controller the device the framework computes on, and that
device decides which GPU is driven: the Lightning strategies train on the device Lightning
chose, and a run computing on the CPU on a GPU node leaves the node's GPUs alone unless
``device.backend: nvml`` asks for one."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_energy.controller import EnergyController
from lightning_energy.device import DEVICE_ENV_VAR
from lightning_energy.errors import ConfigError
from lightning_energy.integrations import _lightning_core
from lightning_energy.integrations.adapter import EnergyAdapter
from lightning_energy.integrations.lightning import EnergyCallback
from tests.lightning_energy.device.fake_cuda import FakeCuda
from tests.lightning_energy.device.fake_pynvml import FakeNVML, a100, make_module
from tests.lightning_energy.integrations._models import make_loader, module_class

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
#: The pre-job power limit of the fake A100s, in mW.
PRE_JOB_MW = 400_000


def _namespace(name: str) -> tuple[Any, Any]:
    """A Lightning namespace and the integration module built on it."""
    integration = "lightning" if name == "lightning.pytorch" else "pytorch_lightning"
    return (
        importlib.import_module(name),
        importlib.import_module(f"lightning_energy.integrations.{integration}"),
    )


@pytest.fixture
def gpu_node(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeNVML, FakeCuda]:
    """Two A100s that NVML and CUDA both see, as on a GPU node (CUDA numbers them as NVML)."""
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", DEVICE_ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    # DeepSpeed picks its accelerator once a process, when first imported (Accelerate
    # imports it to unwrap models): the CPU it really runs on here, not the faked CUDA.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    nvml = make_module([a100(0), a100(1)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml, FakeCuda(nvml.devices).install(monkeypatch)


def test_lightning_passes_the_strategy_root_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    class Recording(EnergyController):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(kwargs.get("device"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_lightning_core, "EnergyController", Recording)
    config = {"device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")}}
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        callbacks=[EnergyCallback(config)],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(module_class(pl)(), make_loader())
    assert seen == [trainer.strategy.root_device] == [torch.device("cpu")]


# ------------------------------------------------------------ energy_single_device
def _single_device_trainer(name: str, tmp_path: Path, **flags: Any) -> Any:
    ns, _ = _namespace(name)
    return ns.Trainer(
        strategy=flags.pop("strategy", "energy_single_device"),
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        logger=False,
        **flags,
    )


@pytest.mark.parametrize("name", NAMESPACES)
@pytest.mark.parametrize(
    ("flags", "visible", "expected"),
    [
        ({}, "1", torch.device("cuda", 0)),  # one GPU given to the process, no devices flag
        ({"devices": [1]}, None, torch.device("cuda", 1)),
        ({"devices": 1}, None, torch.device("cuda", 0)),
        ({"accelerator": "gpu", "devices": "1,"}, None, torch.device("cuda", 1)),
        ({"accelerator": "cpu"}, None, torch.device("cpu")),
    ],
)
def test_energy_single_device_trains_on_the_device_lightning_chose(
    gpu_node: tuple[FakeNVML, FakeCuda],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    name: str,
    flags: dict[str, Any],
    visible: str | None,
    expected: torch.device,
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    trainer = _single_device_trainer(name, tmp_path, **flags)
    strategy = trainer.strategy
    assert type(strategy).__module__.startswith("lightning_energy.integrations.")
    strategy.accelerator.setup_device(strategy.root_device)  # what setup_environment runs
    assert strategy.root_device == expected
    assert trainer.num_devices == 1


@pytest.mark.parametrize("name", NAMESPACES)
@pytest.mark.parametrize(
    "flags", [{"devices": 2}, {"devices": [0, 1]}, {}, {"accelerator": "cpu", "devices": 2}]
)
def test_energy_single_device_on_several_devices_names_energy_ddp(
    gpu_node: tuple[FakeNVML, FakeCuda], tmp_path: Path, name: str, flags: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError, match=r"energy_single_device.*devices=.*energy_ddp"):
        _single_device_trainer(name, tmp_path, **flags)


@pytest.mark.parametrize("name", NAMESPACES)
def test_energy_single_device_given_a_device_keeps_it(
    gpu_node: tuple[FakeNVML, FakeCuda], tmp_path: Path, name: str
) -> None:
    """As Lightning's own ``SingleDeviceStrategy(device)``: the device given wins over the
    devices flag (here every GPU)."""
    _, integration = _namespace(name)
    strategy = integration.EnergySingleDeviceStrategy(device="cuda:1")
    trainer = _single_device_trainer(name, tmp_path, strategy=strategy)
    assert trainer.strategy.root_device == torch.device("cuda", 1)


@pytest.mark.parametrize("name", NAMESPACES)
def test_energy_single_device_before_lightning_chose_is_the_current_device(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    from tests.lightning_energy.device.fake_cuda import cuda_devices

    _, integration = _namespace(name)
    cuda = FakeCuda(cuda_devices(2), current=1).install(monkeypatch)
    assert integration.EnergySingleDeviceStrategy().root_device == torch.device("cuda", 1)
    cuda.available = False
    assert integration.EnergySingleDeviceStrategy().root_device == torch.device("cpu")


# ------------------------------------------------ CPU runs on a GPU node, per adapter
def _config(tmp_path: Path, backend: str, **device: Any) -> dict[str, Any]:
    return {
        "device": {"backend": backend, "lease_dir": str(tmp_path / "leases"), **device},
        "power_limit": {"power_limits_w": [300, 250], "warmup_steps": 0, "settle_steps": 0},
    }


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _run_lightning(name: str) -> Callable[[dict[str, Any], Path], EnergyAdapter]:
    def run(config: dict[str, Any], tmp_path: Path) -> EnergyAdapter:
        ns, integration = _namespace(name)
        callback = integration.EnergyCallback(config)
        trainer = ns.Trainer(
            accelerator="cpu",
            max_steps=4,
            callbacks=[callback],
            default_root_dir=str(tmp_path),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
        )
        trainer.fit(module_class(ns)(), make_loader(n=64))
        return callback

    return run


def _run_fabric(config: dict[str, Any], tmp_path: Path) -> EnergyAdapter:
    from lightning.fabric import Fabric

    from lightning_energy.integrations.fabric import EnergyFabricCallback

    energy = EnergyFabricCallback(config)
    fabric = Fabric(accelerator="cpu", callbacks=[energy])
    fabric.launch()
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    energy.setup(fabric)
    try:
        for x, y in make_loader(n=32):
            fabric.call("on_train_batch_start")
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            fabric.call("on_train_batch_end")
    finally:
        energy.teardown()
    return energy


def _run_accelerate(config: dict[str, Any], tmp_path: Path) -> EnergyAdapter:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_energy.integrations.accelerate import attach_energy

    accelerator = Accelerator(cpu=True)
    try:
        energy = attach_energy(accelerator, config)
        model = _model()
        model, optimizer, loader = accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(n=32)
        )
        with energy:
            for x, y in loader:
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return energy


def _run_transformers(config: dict[str, Any], tmp_path: Path) -> EnergyAdapter:
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments
    from transformers.utils import import_utils

    from lightning_energy.integrations.transformers import EnergyTrainerCallback

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}

    dataset = make_loader(n=32).dataset
    assert isinstance(dataset, TensorDataset)
    features, labels = dataset.tensors
    callback = EnergyTrainerCallback(config)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=Classifier(),
        args=args,
        train_dataset=[{"x": x, "labels": y} for x, y in zip(features, labels, strict=True)],
        callbacks=[callback],
    )
    try:
        trainer.train()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        # Transformers caches its hardware probes for the process: forget the faked CUDA.
        for probe in vars(import_utils).values():
            if callable(getattr(probe, "cache_clear", None)):
                probe.cache_clear()
    return callback


ADAPTERS = {
    **{f"lightning[{name}]": _run_lightning(name) for name in NAMESPACES},
    "fabric": _run_fabric,
    "accelerate": _run_accelerate,
    "transformers": _run_transformers,
}


@pytest.fixture(params=sorted(ADAPTERS))
def run(request: pytest.FixtureRequest) -> Callable[[dict[str, Any], Path], EnergyAdapter]:
    return ADAPTERS[request.param]


def _backend_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What the backend choice logged (the guard, a child logger, logs its restores)."""
    return [r for r in caplog.records if r.name == "lightning_energy.device"]


def test_a_cpu_run_on_a_gpu_node_simulates_under_auto(
    gpu_node: tuple[FakeNVML, FakeCuda],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    run: Callable[[dict[str, Any], Path], EnergyAdapter],
) -> None:
    nvml, _ = gpu_node
    with caplog.at_level(logging.INFO, logger="lightning_energy.device"):
        adapter = run(_config(tmp_path, "auto"), tmp_path)
    assert nvml.calls == []
    assert adapter.controller is not None
    assert adapter.controller.devices.backend == "simulated"
    (line,) = _backend_lines(caplog)
    assert line.levelno == logging.INFO
    assert "'cpu'" in line.getMessage() and "backend: nvml" in line.getMessage()


def test_a_cpu_run_on_a_gpu_node_drives_the_gpu_with_backend_nvml(
    gpu_node: tuple[FakeNVML, FakeCuda],
    tmp_path: Path,
    run: Callable[[dict[str, Any], Path], EnergyAdapter],
) -> None:
    nvml, _ = gpu_node
    adapter = run(_config(tmp_path, "nvml"), tmp_path)
    assert adapter.controller is not None
    assert adapter.controller.devices.backend == "nvml"
    first = nvml.devices[0].uuid
    limits_mw = [c[2] for c in nvml.calls if c[:2] == ("set_power_limit", first)]
    assert 300_000 in limits_mw  # profiled
    assert limits_mw[-1] == PRE_JOB_MW  # and restored
    assert nvml.devices[0].limit_mw == PRE_JOB_MW
    assert all(c[1] == first for c in nvml.calls)  # the other GPU is left alone


def test_megatron_passes_the_device_its_model_is_on(
    gpu_node: tuple[FakeNVML, FakeCuda],
) -> None:
    """Megatron-Core has no device object: its model chunks' parameters tell where it
    computes (here the CPU, although CUDA is available)."""
    from lightning_energy.integrations import megatron

    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    assert megatron._device(chunks) == torch.device("cpu")


def test_perseus_alone_on_a_cpu_run_simulates_under_auto(
    gpu_node: tuple[FakeNVML, FakeCuda], tmp_path: Path
) -> None:
    from lightning_energy.config import EnergyConfig
    from lightning_energy.perseus.runtime.rank_gpu import open_rank_gpu

    nvml, _ = gpu_node
    config = EnergyConfig.from_mapping(_config(tmp_path, "auto", gpu="a100"))
    rank = open_rank_gpu(
        config, local_rank=1, device=torch.device("cpu"), install_signal_handlers=False
    )
    try:
        assert rank.owned and rank.devices.backend == "simulated"
        lowest_mhz = min(rank.gpu.supported_sm_clocks_mhz())
        assert rank.guard.lock_clocks_mhz(lowest_mhz, lowest_mhz) is not None
        assert rank.gpu.locked_clocks_mhz() == (lowest_mhz, lowest_mhz)
    finally:
        rank.close()
    assert nvml.calls == []
