"""Kareus' data-parallel setting applied by the energy DDP strategy of both Lightning
namespaces when it wraps the model, and by Accelerate's attachment when it prepares one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as lightning_ns
import pytest
import pytorch_lightning as pytorch_lightning_ns
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch.nn.parallel import DistributedDataParallel

from lightning_energy.config import EnergyConfig
from lightning_energy.device.simulated import SimulatedSpec, simulated_gpus
from lightning_energy.errors import ConfigError
from lightning_energy.integrations import lightning, pytorch_lightning
from lightning_energy.integrations.accelerate import AcceleratorEnergy, attach_energy
from lightning_energy.kareus.data_parallel import DataParallelSetting
from tests.lightning_energy.integrations._accelerate import (
    fresh_accelerate_state,  # noqa: F401 - the autouse fixture
    training_parts,
)
from tests.lightning_energy.integrations._models import make_loader, module_class
from tests.lightning_energy.processes import ROOT, free_port, run_ranks

NAMESPACES = [lightning.EnergyDDPStrategy, pytorch_lightning.EnergyDDPStrategy]


def wrap(strategy_class: Any, **kwargs: Any) -> Any:
    """A model wrapped as the strategy wraps it on a CPU rank."""
    strategy = strategy_class(**kwargs)
    strategy.parallel_devices = [torch.device("cpu")]
    return strategy._setup_model(torch.nn.Linear(4, 4))


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_the_setting_decides_the_buckets_and_the_gradient_group(strategy_class: Any) -> None:
    setting = DataParallelSetting(ctas=4, bucket_cap_mb=3)
    ddp = wrap(strategy_class, data_parallel=setting, find_unused_parameters=True)
    assert ddp.bucket_bytes_cap == 3 * 1024 * 1024
    assert ddp.process_group is not dist.group.WORLD  # the CTA-limited copy (plain on gloo)
    assert dist.get_process_group_ranks(ddp.process_group) == [0]
    assert ddp.find_unused_parameters  # the strategy's own DDP arguments stay


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_without_a_setting_ddp_keeps_its_own(strategy_class: Any) -> None:
    ddp = wrap(strategy_class, bucket_cap_mb=7)
    assert ddp.bucket_bytes_cap == 7 * 1024 * 1024
    assert ddp.process_group is dist.group.WORLD


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_the_kareus_section_gives_the_setting(strategy_class: Any) -> None:
    section = {"data_parallel_ctas": 2, "data_parallel_bucket_cap_mb": 5.0}
    ddp = wrap(strategy_class, energy={"kareus": section})
    assert ddp.bucket_bytes_cap == 5 * 1024 * 1024
    assert ddp.process_group is not dist.group.WORLD
    # An argument wins over the section.
    ddp = wrap(
        strategy_class,
        energy={"kareus": section},
        data_parallel=DataParallelSetting(bucket_cap_mb=9),
    )
    assert ddp.bucket_bytes_cap == 9 * 1024 * 1024
    assert ddp.process_group is dist.group.WORLD


@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_a_setting_with_ddps_bucket_size_is_refused(strategy_class: Any) -> None:
    with pytest.raises(ConfigError, match="bucket_cap_mb come from the data-parallel setting"):
        strategy_class(data_parallel=DataParallelSetting(), bucket_cap_mb=5)
    with pytest.raises(ConfigError, match="process_group come from the data-parallel setting"):
        strategy_class(energy={"kareus": {"data_parallel_ctas": 4}}, process_group=None)


@pytest.mark.parametrize("strategy_class", NAMESPACES)
def test_the_strategy_refuses_the_online_search_clearly(strategy_class: Any) -> None:
    kareus = {"data_parallel_search": True, "data_parallel_search_ctas": [4, 8]}
    with pytest.raises(ConfigError, match=r"cannot search online .* under Accelerate"):
        strategy_class(energy={"kareus": kareus})


def accelerate_config(tmp_path: Path, **kareus: Any) -> dict[str, Any]:
    """A simulated GPU and the ``kareus`` section ``kareus``; leases in ``tmp_path``."""
    return {
        "device": {"backend": "simulated", "gpu": "a40", "lease_dir": str(tmp_path / "leases")},
        "kareus": kareus,
    }


@pytest.mark.parametrize(
    ("handler", "kareus", "message"),
    [
        (
            DistributedDataParallelKwargs(bucket_cap_mb=10),
            {"data_parallel_bucket_cap_mb": 5},
            r"bucket_cap_mb=10\) conflicts with the setting's 5 MB",
        ),
        (
            DistributedDataParallelKwargs(comm_hook="fp16"),
            {"data_parallel_ctas": 4},
            "comm_hook='fp16'.*drop it or kareus.data_parallel_ctas",
        ),
        (
            DistributedDataParallelKwargs(comm_wrapper="bf16"),
            {"data_parallel_ctas": 4},
            "comm_wrapper='bf16'",
        ),
        (
            DistributedDataParallelKwargs(comm_hook="fp16"),
            {"data_parallel_search": True, "data_parallel_search_ctas": [4, 8]},
            "comm_hook='fp16'.*drop it or kareus.data_parallel_search",
        ),
    ],
)
def test_accelerate_refuses_ddp_arguments_the_setting_decides(
    tmp_path: Path, handler: DistributedDataParallelKwargs, kareus: dict[str, Any], message: str
) -> None:
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    with pytest.raises(ConfigError, match=message):
        attach_energy(accelerator, accelerate_config(tmp_path, **kareus))
    assert accelerator.ddp_handler is handler  # nothing was changed


def test_accelerate_keeps_the_users_ddp_arguments_the_setting_does_not_decide(
    tmp_path: Path,
) -> None:
    handler = DistributedDataParallelKwargs(
        bucket_cap_mb=5, comm_hook="fp16", find_unused_parameters=True
    )
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    energy = attach_energy(accelerator, accelerate_config(tmp_path, data_parallel_bucket_cap_mb=5))
    applied = accelerator.ddp_handler
    assert applied is not None and applied is not handler
    assert applied.to_kwargs() == {"bucket_cap_mb": 5, "find_unused_parameters": True}
    energy.close()
    assert accelerator.ddp_handler is handler  # the user's own again


@pytest.mark.usefixtures("single_process_group")
def test_accelerate_refuses_a_setting_after_a_model_was_prepared_in_ddp(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    accelerator._models.append(DistributedDataParallel(torch.nn.Linear(4, 4)))  # as prepare does
    with pytest.raises(ConfigError, match=r"call attach_energy\(accelerator\) before"):
        attach_energy(accelerator, accelerate_config(tmp_path, data_parallel_ctas=2))


def _run_accelerate_ranks(
    worker: str, config: dict[str, Any], tmp_path: Path
) -> list[dict[str, Any]]:
    """Run ``worker`` (a module of this package) on 2 ranks with the energy ``config``;
    what each rank wrote to ``rank<r>.json``."""
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_ENERGY_CONFIG"}
    env.update(
        PYTHONPATH=str(ROOT),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        ENERGY_CFG=json.dumps(config),
        OUT_DIR=str(tmp_path),
    )
    envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(2)]
    module = f"tests.lightning_energy.integrations.{worker}"
    run_ranks([[sys.executable, "-m", module]] * 2, tmp_path, envs=envs, timeout_s=240)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_accelerate_averages_gradients_in_the_cta_limited_group(tmp_path: Path) -> None:
    config = accelerate_config(tmp_path, data_parallel_ctas=4, data_parallel_bucket_cap_mb=0.001)
    ranks = _run_accelerate_ranks("accelerate_kareus_worker", config, tmp_path)
    for rank in ranks:
        assert rank["bucket_bytes_cap"] == int(0.001 * 1024 * 1024)
        # The CTA-limited copy of the DDP model's group, all of its ranks: averaged over both.
        assert rank["hooks"] == [{"hook": "allreduce_hook", "ranks": [0, 1]}]
        assert rank["hook_group_is_world"] == [False]
        for name, local in ranks[0]["local"].items():
            mean = [sum(v) / 2 for v in zip(local, ranks[1]["local"][name], strict=True)]
            assert rank["plain"][name] == pytest.approx(mean, rel=1e-5, abs=1e-7), name
            assert rank["prepared"][name] == pytest.approx(rank["plain"][name], rel=1e-6), name
        # Closed: Accelerate's own DDP arguments and prepare_model again.
        assert rank["after_end"] == {"ddp_handler": "None", "prepare_model_replaced": False}


@pytest.mark.usefixtures("single_process_group")
def test_accelerate_searches_one_ddp_model(tmp_path: Path) -> None:
    config = accelerate_config(
        tmp_path, data_parallel_search=True, data_parallel_search_ctas=[2, 4]
    )
    config["power_limit"] = {"enabled": False}
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator, config)
    first = accelerator.prepare_model(DistributedDataParallel(torch.nn.Linear(4, 4)))
    assert energy.search is not None and energy.search.groups.ctas == 2
    assert [hook.__name__ for hook, _ in first._comm_hooks] == ["cta_allreduce_hook"]
    with pytest.raises(ConfigError, match="a second model was prepared in DDP"):
        accelerator.prepare_model(DistributedDataParallel(torch.nn.Linear(4, 4)))
    assert not energy.running  # the run ended, every GPU restored


@pytest.mark.slow
def test_accelerate_searches_the_ctas_and_clock_online_and_applies_the_choice(
    tmp_path: Path,
) -> None:
    clocks = a100_clocks()
    candidates = [clocks[0], clocks[len(clocks) // 2]]
    config = accelerate_config(
        tmp_path,
        data_parallel_search=True,
        data_parallel_search_ctas=[2, 16],
        data_parallel_search_clocks_mhz=candidates,
        data_parallel_search_steps=2,
    )
    config["device"]["gpu"] = "a100"
    config["power_limit"] = {"warmup_steps": 2, "settle_steps": 1, "selector": "energy"}
    ranks = _run_accelerate_ranks("accelerate_dp_search_worker", config, tmp_path)
    grid = {(n, c) for n in (2, 16) for c in candidates}
    for rank in ranks:
        assert rank["hook"] == "cta_allreduce_hook"
        # Averaged over both ranks in the CTA-limited group, as plain DDP does.
        for mine, plain in zip(rank["prepared"], rank["plain"], strict=True):
            assert mine == pytest.approx(plain, rel=1e-6, abs=1e-8)
        # Every candidate ran with its CTAs and clock, then the choice for good.
        ran = {(n, lock[1]) for n, lock in rank["steps"] if lock is not None}
        assert ran == grid
        assert {(p["ctas"], p["clock_mhz"]) for p in rank["profile"]} == grid
        least = min(rank["profile"], key=lambda p: p["energy_per_step_j"])
        assert rank["chosen"] == [least["ctas"], least["clock_mhz"]]
        chosen_ctas, chosen_clock = rank["chosen"]
        assert rank["steps"][-1] == [chosen_ctas, [chosen_clock, chosen_clock]]
        measured = [d for d in rank["decisions"] if d[0] == "kareus_dp_measured_energy_per_step_j"]
        assert len(measured) == len(grid)
        assert rank["clock_after_end"] is None  # released when the run ended
    # Decided alike on every rank, on the job-wide windows.
    assert ranks[0]["chosen"] == ranks[1]["chosen"]
    assert ranks[0]["profile"] == ranks[1]["profile"]


def a100_clocks() -> list[int]:
    """The simulated A100's supported SM clocks, highest first."""
    return simulated_gpus(SimulatedSpec(gpu="a100"))[0].supported_sm_clocks_mhz()


def clock_config(tmp_path: Path, clock_mhz: int) -> dict[str, Any]:
    """A simulated A100 whose data-parallel setting locks ``clock_mhz``."""
    config = accelerate_config(tmp_path, data_parallel_clock_mhz=clock_mhz)
    config["device"]["gpu"] = "a100"
    return config


def step_clocks(energy: Any, steps: int) -> list[tuple[int, int] | None]:
    """The clock lock of this rank's simulated GPU at each of ``steps`` training steps."""
    accelerator = energy._accelerator()
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=steps))
    gpu = energy.controller.devices.gpus[0]
    seen = []
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        seen.append(gpu.locked_clocks_mhz())
    return seen


def test_accelerate_locks_the_settings_clock_for_training_and_releases_it(
    tmp_path: Path,
) -> None:
    clock = a100_clocks()[20]
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator, clock_config(tmp_path, clock))
    assert energy.controller is not None
    gpu = energy.controller.devices.gpus[0]
    assert step_clocks(energy, 6) == [(clock, clock)] * 6
    # The knob holds the clocks: no power limit nor locked clock is profiled under it.
    limits = energy.controller.power_limit
    assert limits.profiling_off == "kareus_data_parallel_clock holds the clocks"
    assert not energy.controller.locked_clock.active
    accelerator.end_training()
    assert gpu.locked_clocks_mhz() is None


def test_accelerate_releases_the_settings_clock_on_an_exception(tmp_path: Path) -> None:
    clock = a100_clocks()[-1]
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator, clock_config(tmp_path, clock))
    assert energy.controller is not None
    gpu = energy.controller.devices.gpus[0]
    with pytest.raises(RuntimeError, match="boom"), energy:
        assert step_clocks(energy, 2) == [(clock, clock)] * 2
        raise RuntimeError("boom")
    assert gpu.locked_clocks_mhz() is None
    assert not energy.running


def test_accelerate_refuses_a_clock_the_gpu_does_not_support(tmp_path: Path) -> None:
    clocks = a100_clocks()
    between = clocks[0] - 1  # the supported clocks are 15 MHz apart
    accelerator = Accelerator(cpu=True)
    energy = AcceleratorEnergy(
        accelerator, EnergyConfig.from_mapping(clock_config(tmp_path, between))
    )
    with pytest.raises(
        ConfigError,
        match=f"{between} MHz is not a supported SM clock; use one of {clocks[0]}, {clocks[1]}",
    ):
        energy.start()
    assert not energy.running  # the run ended: nothing locked, the lease dropped
    assert energy.controller is not None
    assert energy.controller.devices.gpus[0].locked_clocks_mhz() is None
    assert "end_training" not in vars(accelerator)  # unhooked


@pytest.mark.parametrize(
    ("strategy_class", "ns"),
    [
        (lightning.EnergyDDPStrategy, lightning_ns),
        (pytorch_lightning.EnergyDDPStrategy, pytorch_lightning_ns),
    ],
)
def test_lightning_locks_the_settings_clock_for_training_and_releases_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy_class: Any, ns: Any
) -> None:
    # Lightning's DDP sets these for the process: put back as they were after the test.
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # recorded, even if unset
        monkeypatch.delenv(name)
    clock = a100_clocks()[10]
    strategy = strategy_class(energy=clock_config(tmp_path, clock))
    seen: list[tuple[int, int] | None] = []
    gpus: list[Any] = []

    class Clocks(ns.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            gpu = strategy.energy_callback.controller.devices.gpus[0]
            gpus.append(gpu)
            seen.append(gpu.locked_clocks_mhz())

    trainer = ns.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=[Clocks()],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    model = module_class(ns)()
    try:
        trainer.fit(model, make_loader())
        assert seen == [(clock, clock)] * 4
        assert gpus[0].locked_clocks_mhz() is None  # released at the end of the fit
        # A second fit of the same Trainer (4 more steps) locks it again.
        trainer.fit_loop.epoch_loop.max_steps = 8
        trainer.fit(model, make_loader())
    finally:  # Lightning's DDP leaves its process group for the process: not for later tests
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == [(clock, clock)] * 8
    assert gpus[-1].locked_clocks_mhz() is None
