"""StragglerRun on CUDA GPUs (the CUDA fake) and on ranks that cannot control clocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.perseus.data_parallel import StragglerRun
from lightning_energy.perseus.runtime.rank_gpu import RankGPU
from tests.lightning_energy.device.fake_cuda import FakeCuda, cuda_devices

from ..processes import free_port, run_module_ranks
from . import ddp_cuda_worker
from .helpers import CudaTimedGPU


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(cuda_devices(1)).install(monkeypatch)


def cuda_rank(cuda: FakeCuda, lease_dir: Path) -> tuple[RankGPU, CudaTimedGPU]:
    """A rank whose GPU Perseus times with CUDA events (not simulated)."""
    gpu = CudaTimedGPU(simulated_gpus(SimulatedSpec(gpu="a100"))[0], cuda)
    guard = GPUGuard([gpu], lease_dir=lease_dir, install_signal_handlers=False)
    guard.acquire()
    return RankGPU(DeviceSet([gpu], gpu.now_s, "nvml"), guard, owned=True), gpu


def test_every_step_is_counted_when_its_cuda_events_complete_late(
    single_process_group: None, cuda: FakeCuda, tmp_path: Path
) -> None:
    """Once profiling is over, steps are timed by events read one step later without
    waiting. Events the GPU has not reached yet give no sample, but the step still counts:
    the equaliser's collectives happen at step counts, the same on every rank."""
    rank, gpu = cuda_rank(cuda, tmp_path)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    run = StragglerRun(rank, ddp_cuda_worker.SECTION, ddp_model=model)
    equalizer = run.equalizer
    assert equalizer is not None

    def step(let_time_pass: bool) -> None:
        run.step_start()
        cuda.launch(0.1 * 1410 / gpu.locked_mhz())
        model(torch.ones(8, 4)).sum().backward()
        cuda.launch(0.02)
        if let_time_pass:
            cuda.advance(1.0)
        run.step_end()

    try:
        steps = 0
        while equalizer.profiling:
            step(True)
            steps += 1
        assert equalizer.enabled and equalizer.model is not None
        for _ in range(7):  # the GPU's time never passes: no event completes
            step(False)
        assert equalizer.step == steps + 7
        assert equalizer.straggler_rank == 0  # re-evaluated at each window's end
        for _ in range(3):
            step(True)
        assert equalizer.step == steps + 10
    finally:
        run.close()
    assert gpu.locked_clocks_mhz() is None


def test_the_models_communication_hook_and_gradients_stay_as_they_were(
    single_process_group: None, cuda: FakeCuda, tmp_path: Path
) -> None:
    """A model whose strategy registered its own communication hook keeps it (DDP allows
    one): the gradients are those of the same model without Perseus, bit for bit, and
    closing the run removes every hook Perseus added."""
    rank, _ = cuda_rank(cuda, tmp_path)

    def wrapped() -> DistributedDataParallel:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        model.register_comm_hook(None, ddp_cuda_worker.sum_hook)
        return model

    probed, plain = wrapped(), wrapped()
    run = StragglerRun(rank, ddp_cuda_worker.SECTION, ddp_model=probed)
    try:
        for k in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(k))
            run.step_start()
            cuda.launch(0.1)
            for model in (probed, plain):
                model(x).pow(2).sum().backward()
            run.step_end()
            for a, b in zip(probed.parameters(), plain.parameters(), strict=True):
                assert a.grad is not None and b.grad is not None
                assert torch.equal(a.grad, b.grad)
    finally:
        run.close()
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in probed.parameters())


@pytest.mark.slow
def test_ranks_stay_in_step_and_gradients_identical_when_events_complete_on_one_rank_only(
    tmp_path: Path,
) -> None:
    """2 ranks, a user's communication hook; rank 1's events never complete once
    profiling is over. A rank that stopped counting its steps would enter the equaliser's
    collectives alone and the next all-reduce would never end (the test would time out)."""
    ranks = run_cuda_ranks(tmp_path, 2)
    for r in ranks:
        assert r["identical"]
        assert r["counted"] == r["steps"] == ranks[0]["steps"]
        assert r["steps"] > ddp_cuda_worker.STEPS_AFTER_PROFILING
        assert r["straggler"] == 1


@pytest.mark.slow
def test_a_ddp_over_a_sub_group_keeps_its_gradients(tmp_path: Path) -> None:
    """4 ranks, two DDP replicas over {0, 1} and {2, 3}: each averages over its own group,
    with or without Perseus."""
    ranks = run_cuda_ranks(tmp_path, 4)
    for r in ranks:
        assert r["identical"]
        assert r["counted"] == r["steps"] == ranks[0]["steps"]


def run_cuda_ranks(tmp_path: Path, world: int) -> list[dict[str, Any]]:
    port = str(free_port())
    run_module_ranks(
        "tests.lightning_energy.perseus.ddp_cuda_worker",
        [[str(r), str(world), port, str(tmp_path), str(tmp_path / "leases")] for r in range(world)],
        tmp_path,
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_a_rank_that_cannot_list_its_clocks_still_votes(tmp_path: Path) -> None:
    """Rank 1's GPU cannot list its supported clocks. It votes against clock control with
    the other rank instead of leaving it waiting in the vote: nobody changes clocks, the
    strict rank raises after voting, and the pipeline's online profiler is off too."""
    port = str(free_port())
    run_module_ranks(
        "tests.lightning_energy.perseus.clock_vote_worker",
        [[str(r), port, str(tmp_path), str(tmp_path / "leases")] for r in range(2)],
        tmp_path,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == {"straggler": False, "strict": False, "pipeline": "disabled"}
    assert ranks[1] == {
        "straggler": False,
        "strict": "raised NotSupportedError",
        "pipeline": "disabled",
    }
