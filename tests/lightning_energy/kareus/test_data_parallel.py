"""Kareus' data-parallel knobs: the setting, the CTA-limited gradient group, DDP's
arguments, and a 2-process gloo DDP step under them."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController, Knob
from lightning_energy.device.base import DeviceSet
from lightning_energy.device.simulated import SimulatedSpec, simulated_gpus
from lightning_energy.errors import ConfigError
from lightning_energy.kareus import data_parallel
from lightning_energy.kareus.data_parallel import (
    DDP_DEFAULT_BUCKET_CAP_MB,
    DataParallelSetting,
    ddp_kwargs,
    gradient_group,
    hold_clock,
    wrap_ddp,
)
from lightning_energy.kareus.runtime import NCCL_MAX_CTAS
from lightning_energy.perseus.data_parallel import StragglerClocks

from .. import processes
from ..processes import ROOT, free_port
from .ddp_knobs_worker import WORLD
from .test_runtime import FakeDist


class FakeWorldDist(FakeDist):
    """``torch.distributed`` of rank 2 of 4 whose data-parallel group is the world."""

    def __init__(self, backend: str = "nccl") -> None:
        super().__init__()
        self.backend = backend
        self.group = type("group", (), {"WORLD": {"ranks": [0, 1, 2, 3], "backend": backend}})

    def all_gather_object(self, out: list[Any], obj: Any) -> None:
        out[:] = [[0, 1, 2, 3]] * self.world


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeDist) -> None:
    """``fake`` as ``torch.distributed`` wherever the gradient group is made."""
    monkeypatch.setattr(data_parallel, "dist", fake)
    monkeypatch.setattr("lightning_energy.collectives.dist", fake)
    monkeypatch.setattr("lightning_energy.kareus.runtime.dist", fake)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> FakeWorldDist:
    fake = FakeWorldDist()
    install(monkeypatch, fake)
    return fake


def test_the_default_setting_is_ddps_own() -> None:
    setting = DataParallelSetting()
    assert (setting.ctas, setting.bucket_cap_mb, setting.clock_mhz) == (None, 25.0, None)
    assert ddp_kwargs(setting) == {
        "bucket_cap_mb": DDP_DEFAULT_BUCKET_CAP_MB,
        "process_group": None,
    }


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"ctas": 0}, f"ctas: 0 is not allowed; use 1 to {NCCL_MAX_CTAS}"),
        ({"ctas": NCCL_MAX_CTAS + 1}, f"ctas: {NCCL_MAX_CTAS + 1} is not allowed"),
        ({"ctas": True}, "ctas: True is not allowed"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb: 0 is not allowed; use a positive number of MB"),
        ({"bucket_cap_mb": math.inf}, "bucket_cap_mb: inf is not allowed"),
        ({"bucket_cap_mb": "25"}, "bucket_cap_mb: '25' is not allowed"),
        ({"clock_mhz": -1}, "clock_mhz: -1 is not allowed; use a positive clock in MHz"),
    ],
)
def test_bad_settings_are_refused_naming_what_is_allowed(
    kwargs: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        DataParallelSetting(**kwargs)
    assert expected in str(info.value)


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        DataParallelSetting(ctas=0, bucket_cap_mb=-1, clock_mhz=0)
    assert all(name in str(info.value) for name in ("ctas: 0", "bucket_cap_mb: -1", "clock_mhz: 0"))


def test_the_gradient_group_is_limited_to_the_ctas_per_communicator(
    world: FakeWorldDist, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NCCL_MIN_CTAS", raising=False)
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    kwargs = ddp_kwargs(DataParallelSetting(ctas=6, bucket_cap_mb=4))
    assert kwargs["bucket_cap_mb"] == 4.0
    group = kwargs["process_group"]
    assert group["ranks"] == [0, 1, 2, 3] and group["backend"] == "nccl"
    assert (group["options"].config.min_ctas, group["options"].config.max_ctas) == (6, 6)
    assert [(ranks, backend) for ranks, backend, _ in world.created] == [([0, 1, 2, 3], "nccl")]
    assert "NCCL_MIN_CTAS" not in os.environ and "NCCL_MAX_CTAS" not in os.environ


def test_a_given_data_parallel_group_is_the_one_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDist()  # rank 2 of 4, data-parallel pairs [0, 1] and [2, 3]
    install(monkeypatch, fake)
    dp_group = {"ranks": [2, 3], "backend": "nccl"}
    group = gradient_group(DataParallelSetting(ctas=2), dp_group)
    assert group["ranks"] == [2, 3] and group["options"].config.max_ctas == 2
    assert [ranks for ranks, _, _ in fake.created] == [[0, 1], [2, 3]]
    assert gradient_group(DataParallelSetting(), dp_group) is dp_group


def test_gloo_has_no_ctas_to_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeWorldDist("gloo"))
    group = gradient_group(DataParallelSetting(ctas=3))
    assert group["backend"] == "gloo" and group["options"] is None


def test_wrap_ddp_refuses_arguments_the_setting_decides() -> None:
    with pytest.raises(ConfigError, match="bucket_cap_mb, process_group come from the"):
        wrap_ddp(torch.nn.Linear(2, 2), DataParallelSetting(), bucket_cap_mb=1, process_group=None)


@pytest.mark.slow
def test_ddp_gradients_do_not_depend_on_the_buckets_or_the_group(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_ENERGY_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    port = str(free_port())
    module = "tests.lightning_energy.kareus.ddp_knobs_worker"
    commands = [[sys.executable, "-m", module, str(r), port, str(tmp_path)] for r in range(WORLD)]
    processes.run_ranks(commands, tmp_path, envs=[env] * WORLD, timeout_s=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    local = [rank["local"]["grads"] for rank in ranks]
    for rank in ranks:
        assert rank["default"]["default_group"] and not rank["tiny_buckets"]["default_group"]
        for name in local[0]:
            mean = [sum(values) / WORLD for values in zip(*(g[name] for g in local), strict=True)]
            for run in ("default", "tiny_buckets"):
                assert rank[run]["grads"][name] == pytest.approx(mean, rel=1e-5, abs=1e-7), name


def a100_controller(tmp_path: Path, **spec: Any) -> EnergyController:
    """An energy controller over one simulated A100, its run set up."""
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", **spec))
    devices = DeviceSet(gpus=gpus, clock=gpus[0].clock.now, backend="simulated")
    config = EnergyConfig.from_mapping({"device": {"lease_dir": str(tmp_path / "leases")}})
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    return controller


def test_the_clock_is_held_as_a_knob_that_owns_the_clocks(tmp_path: Path) -> None:
    controller = a100_controller(tmp_path)
    gpu = controller.devices.gpus[0]
    clock = gpu.supported_sm_clocks_mhz()[-1]
    knob = hold_clock(controller, clock)
    assert isinstance(knob, Knob) and knob.holds_clocks
    assert controller.knobs[-1] is knob
    assert knob.pace_frontier() == []  # the setting fixes the clock: nothing to pace
    assert gpu.locked_clocks_mhz() == (clock, clock)
    controller.teardown()
    assert gpu.locked_clocks_mhz() is None


def test_a_job_that_may_not_lock_clocks_is_refused_clearly(tmp_path: Path) -> None:
    controller = a100_controller(tmp_path, permission_denied=True)  # observe-only
    gpu = controller.devices.gpus[0]
    clock = gpu.supported_sm_clocks_mhz()[0]
    with pytest.raises(ConfigError, match="data_parallel_clock_mhz: this job only observes"):
        hold_clock(controller, clock)
    assert gpu.locked_clocks_mhz() is None
    controller.teardown()


def test_a_clock_before_the_run_is_set_up_is_refused(tmp_path: Path) -> None:
    gpus = simulated_gpus(SimulatedSpec(gpu="a100"))
    devices = DeviceSet(gpus=gpus, clock=gpus[0].clock.now, backend="simulated")
    controller = EnergyController(EnergyConfig(), devices=devices, install_signal_handlers=False)
    with pytest.raises(ConfigError, match="the energy run is not set up"):
        hold_clock(controller, 1410)
    assert gpus[0].locked_clocks_mhz() is None


def test_a_clock_beside_another_owner_of_the_clocks_is_refused(tmp_path: Path) -> None:
    controller = a100_controller(tmp_path)
    gpu = controller.devices.gpus[0]
    controller.add_knob(StragglerClocks())
    with pytest.raises(ConfigError, match="straggler_clocks already holds the clocks"):
        hold_clock(controller, gpu.supported_sm_clocks_mhz()[0])
    assert gpu.locked_clocks_mhz() is None
    controller.teardown()
