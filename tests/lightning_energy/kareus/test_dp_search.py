"""Kareus' data-parallel settings searched online: the switchable CTA-limited gradient
groups and their DDP hook, and the search over CTAs and clocks on a simulated A100 whose
backward's time comes from the overlap model (SIMULATED)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController, Interruption, StepEnd, StepStart
from lightning_energy.device.base import DeviceSet
from lightning_energy.device.simulated import SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.device.simulated.work import DataParallelSimulation
from lightning_energy.errors import ConfigError
from lightning_energy.kareus.dp_search import (
    DataParallelSearch,
    GradientGroups,
    cta_allreduce_hook,
)
from lightning_energy.kareus.dp_workload import SimulatedDataParallel
from lightning_energy.kareus.model import OverlapModel, shipped_physics
from lightning_energy.kareus.workload import LLAMA_3_2_3B

BUCKET_MB = 25.0


def controller_over_a100(
    tmp_path: Path, spec: dict[str, Any] | None = None, **power_limit: Any
) -> EnergyController:
    """An energy controller over one simulated A100 (``spec``: more of its
    :class:`SimulatedSpec`; no step work of its own), set up."""
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", **(spec or {})))
    devices = DeviceSet(gpus=gpus, clock=gpus[0].clock.now, backend="simulated")
    config = EnergyConfig.from_mapping(
        {
            "device": {"lease_dir": str(tmp_path / "leases")},
            "power_limit": {"warmup_steps": 2, "settle_steps": 1, **power_limit},
        }
    )
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    return controller


def simulated_dp() -> SimulatedDataParallel:
    """Llama 3.2 3B (TP 8) in 2 replicas, DDP's 25 MB buckets (SIMULATED)."""
    return SimulatedDataParallel(
        OverlapModel(shipped_physics()), LLAMA_3_2_3B, dp_size=2, bucket_caps_mb=(BUCKET_MB,)
    )


def train(
    controller: EnergyController, search: DataParallelSearch, steps: int, *, eval_every: int = 0
) -> list[tuple[int, tuple[int, int] | None]]:
    """Run ``steps`` training steps as the Accelerate adapter drives them: each step's
    backward runs on the simulated GPU under the CTAs the hook's state uses then; every
    ``eval_every`` steps (0: never) an evaluation of 3 s runs, announced as the adapter
    does. Returns the CTAs and clock lock of every step."""
    dp = simulated_dp()
    gpu = controller.devices.gpus[0]
    assert isinstance(gpu, SimulatedGPU)
    f_max = gpu.supported_sm_clocks_mhz()[0]
    sim = DataParallelSimulation(gpu, dp.step_work(search.groups.ctas, BUCKET_MB, f_max))
    seen = []
    for step in range(steps):
        if eval_every and step % eval_every == eval_every - 1:
            controller.handle(Interruption("evaluation"))
            search.pause()
            gpu.run_work(3.0, 0.5)
        controller.handle(StepStart())
        search.step_start()
        sim.work = dp.step_work(search.groups.ctas, BUCKET_MB, f_max)
        seen.append((search.groups.ctas, gpu.locked_clocks_mhz()))
        sim.compute()
        sim.all_reduce()
        controller.handle(StepEnd())
        search.step_end()
    return seen


@pytest.mark.usefixtures("single_process_group")
def test_the_hook_averages_in_the_group_it_uses_now() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 4)
    hooked = DistributedDataParallel(torch.nn.Linear(8, 4), bucket_cap_mb=0.0001)
    hooked.module.load_state_dict(plain.state_dict())
    groups = GradientGroups(None, (4, 2))
    assert groups.ctas == 4 and groups.groups[4] is not groups.groups[2]
    hooked.register_comm_hook(groups, cta_allreduce_hook)
    batch = torch.randn(3, 8)
    plain(batch).square().mean().backward()
    groups.use(2)
    hooked(batch).square().mean().backward()
    assert groups.group is groups.groups[2]
    for mine, theirs in zip(hooked.module.parameters(), plain.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert torch.allclose(mine.grad, theirs.grad)
    with pytest.raises(ConfigError, match=r"no group was created for it; use one of \[2, 4\]"):
        groups.use(8)


def test_the_ctas_change_the_simulated_backward() -> None:
    dp = simulated_dp()
    works = {n: dp.step_work(n, BUCKET_MB, 1410) for n in (1, 8, 32)}
    # One CTA starves the all-reduce, 32 take SMs from the compute: 8 is faster than both.
    assert works[1].t0_s > works[8].t0_s < works[32].t0_s
    assert all(0.0 < w.compute_bound_share < 1.0 for w in works.values())
    with pytest.raises(ConfigError, match="bucket_cap_mb: 40 is not allowed; use one of 25"):
        dp.step_work(8, 40, 1410)


@pytest.mark.usefixtures("single_process_group")
def test_the_search_measures_each_cta_count_and_applies_the_fastest(tmp_path: Path) -> None:
    controller = controller_over_a100(tmp_path, enabled=False, selector="time")
    ctas = (1, 8, 32)
    search = DataParallelSearch(controller, GradientGroups(None, ctas), None, steps=3)
    assert controller.knobs[-1] is search and not search.holds_clocks
    seen = train(controller, search, 200, eval_every=7)
    assert search.done
    profile = search.profile()
    assert [p["ctas"] for p in profile] == [32, 8, 1]
    # The measured time per step differs as the model's backward does: the effect is real
    # (and the evaluations are left out of the windows).
    dp = simulated_dp()
    model_s = {n: dp.step_work(n, BUCKET_MB, 1410).t0_s for n in ctas}
    measured_s = {p["ctas"]: p["time_per_step_s"] for p in profile}
    for n in ctas:
        assert measured_s[n] == pytest.approx(model_s[n], rel=1e-6)
    fastest = min(model_s, key=model_s.__getitem__)
    assert search.chosen is not None and search.chosen.ctas == fastest
    assert seen[-1] == (fastest, None)  # applied, the clock left alone
    # Every candidate measured is in the run's decisions, then the choice.
    decisions = controller.decisions
    measured = [d for d in decisions if d["kind"] == "kareus_dp_measured_energy_per_step_j"]
    assert len(measured) == len(ctas)
    assert decisions[-1]["kind"] == "kareus_dp_ctas" and decisions[-1]["purpose"] == "choice"
    assert decisions[-1]["value"] == fastest
    controller.teardown()


@pytest.mark.usefixtures("single_process_group")
def test_the_search_over_clocks_chooses_with_the_selector_and_releases_the_clock(
    tmp_path: Path,
) -> None:
    controller = controller_over_a100(tmp_path, selector="energy")
    gpu = controller.devices.gpus[0]
    clocks = gpu.supported_sm_clocks_mhz()
    candidates = [clocks[0], clocks[len(clocks) // 2]]
    search = DataParallelSearch(controller, GradientGroups(None, (2, 16)), candidates, steps=2)
    assert search.holds_clocks
    assert controller.power_limit.profiling_off is not None  # one owner of the clocks
    seen = train(controller, search, 300)
    assert search.done and search.chosen is not None
    profile = search.profile()
    assert {(p["ctas"], p["clock_mhz"]) for p in profile} == {
        (n, c) for n in (2, 16) for c in candidates
    }
    least = min(profile, key=lambda p: p["energy_per_step_j"])
    assert (search.chosen.ctas, search.chosen.clock_mhz) == (least["ctas"], least["clock_mhz"])
    clock = search.chosen.clock_mhz
    assert clock is not None and seen[-1] == (search.chosen.ctas, (clock, clock))
    # Each candidate was measured at its own clock and CTAs.
    assert {(n, lock) for n, lock in seen} >= {(n, (c, c)) for n in (2, 16) for c in candidates}
    controller.teardown()
    assert gpu.locked_clocks_mhz() is None


@pytest.mark.usefixtures("single_process_group")
def test_a_search_of_ctas_beside_power_limit_profiling_is_refused(tmp_path: Path) -> None:
    controller = controller_over_a100(tmp_path)
    with pytest.raises(ConfigError, match=r"power_limit\.enabled: false, or search the clocks"):
        DataParallelSearch(controller, GradientGroups(None, (4,)), None, steps=2)
    controller.teardown()


@pytest.mark.usefixtures("single_process_group")
def test_a_clock_the_gpu_does_not_support_is_refused(tmp_path: Path) -> None:
    controller = controller_over_a100(tmp_path)
    gpu = controller.devices.gpus[0]
    clocks = gpu.supported_sm_clocks_mhz()
    between = (clocks[0] + clocks[1]) // 2
    with pytest.raises(ConfigError, match=rf"search_clocks_mhz: {between} MHz is not a supported"):
        DataParallelSearch(controller, GradientGroups(None, (4,)), [clocks[0], between], steps=2)
    assert gpu.locked_clocks_mhz() is None
    controller.teardown()


@pytest.mark.usefixtures("single_process_group")
def test_clocks_in_a_job_that_only_observes_are_refused(tmp_path: Path) -> None:
    controller = controller_over_a100(tmp_path, {"supports_setting": False})
    gpu = controller.devices.gpus[0]
    with pytest.raises(ConfigError, match="search_clocks_mhz: this job only observes its GPUs"):
        DataParallelSearch(
            controller, GradientGroups(None, (4,)), [gpu.supported_sm_clocks_mhz()[0]], steps=2
        )
    assert gpu.locked_clocks_mhz() is None
    controller.teardown()


@pytest.mark.parametrize(
    ("kareus", "message"),
    [
        ({"data_parallel_search": True}, "data_parallel_search_ctas: None is not allowed"),
        (
            {"data_parallel_search": True, "data_parallel_search_ctas": [4, 4, 40]},
            r"\[4, 4, 40\] is not allowed; use distinct CTA counts, each 1 to 32",
        ),
        (
            {
                "data_parallel_search": True,
                "data_parallel_search_ctas": [4],
                "data_parallel_search_clocks_mhz": [0],
            },
            "data_parallel_search_clocks_mhz: .* use a list of distinct positive clocks",
        ),
        (
            {
                "data_parallel_search": True,
                "data_parallel_search_ctas": [4],
                "data_parallel_search_steps": 0,
            },
            "data_parallel_search_steps: 0 is not allowed; use an integer >= 1",
        ),
        (
            {
                "data_parallel_search": True,
                "data_parallel_search_ctas": [4],
                "data_parallel_ctas": 8,
            },
            "data_parallel_ctas: not allowed with kareus.data_parallel_search: true",
        ),
        (
            {
                "data_parallel_search": True,
                "data_parallel_search_ctas": [4],
                "data_parallel_search_clocks_mhz": [1410],
                "data_parallel_clock_mhz": 1200,
            },
            "data_parallel_clock_mhz: not allowed with kareus.data_parallel_search_clocks_mhz",
        ),
        (
            {"data_parallel_search_ctas": [4]},
            "data_parallel_search_ctas: set kareus.data_parallel_search: true",
        ),
    ],
)
def test_bad_search_configurations_are_refused_clearly(
    kareus: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        EnergyConfig.from_mapping({"kareus": kareus})


def test_a_good_search_configuration_is_read() -> None:
    section = EnergyConfig.from_mapping(
        {
            "kareus": {
                "data_parallel_search": True,
                "data_parallel_search_ctas": [2, 8],
                "data_parallel_search_clocks_mhz": [1410, 1200],
                "data_parallel_bucket_cap_mb": 100,
            }
        }
    ).kareus
    assert section.data_parallel_search_ctas == (2, 8)
    assert section.data_parallel_search_clocks_mhz == (1410, 1200)
    assert section.data_parallel_search_steps == 5
    setting = section.data_parallel()
    assert setting is not None and setting.ctas is None and setting.bucket_cap_mb == 100
