"""One rank of a gloo DDP run on a CUDA machine as Perseus sees it (run by
test_data_parallel.py).

``FakeCuda`` is installed (CUDA available; events complete only once the GPU's time has
passed them) and the rank's GPU is not a simulated one, so ``StragglerRun`` times the
steps with CUDA events, as on real GPUs. Every rank trains two copies of one model on the
same batches: one with Perseus' straggler equaliser, one without, each wrapped the same
way, and checks that their gradients are bit-identical after every step.

Arguments: ``rank world port out_dir lease_dir``.

* world 2: one DDP over both ranks, with a communication hook of the user's (a sum, not
  DDP's mean) registered before Perseus starts. After profiling, rank 0 lets the GPU's
  time pass after every step (its events complete), rank 1 never does (its events stay
  pending): the ranks' step counts must not drift apart.
* world 4: two DDP replicas over the sub-groups {0, 1} and {2, 3} (as HSDP's), DDP's own
  all-reduce.

Writes ``rank{r}.json``: whether every gradient was identical, the equaliser's step
count, the straggler it found and the steps run.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.config import PerseusConfig
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.perseus.data_parallel import StragglerRun
from lightning_energy.perseus.runtime.rank_gpu import RankGPU
from tests.lightning_energy.device.fake_cuda import FakeCuda, cuda_devices

from . import nccl_like
from .helpers import CudaTimedGPU

SLOWDOWNS = (1.0, 1.25, 1.0, 1.1)
SECTION = PerseusConfig(
    enabled=True, window_steps=3, steps_per_clock=2, profile_clocks_mhz=(1410, 1200, 1005)
)
#: Steps after profiling: several windows, so the equaliser's collectives run often.
STEPS_AFTER_PROFILING = 10


def sum_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user's communication hook: the sum of the gradients over ``group`` (no mean)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out_dir, lease_dir = sys.argv[4], sys.argv[5]
    nccl_like.install()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    replicas = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
    cuda = FakeCuda(cuda_devices(1)).install(pytest.MonkeyPatch())
    sim = simulated_gpus(SimulatedSpec(gpu="a100", first_index=rank))[0]
    gpu = CudaTimedGPU(sim, cuda)
    guard = GPUGuard([gpu], lease_dir=lease_dir, install_signal_handlers=False)
    guard.acquire()
    ranks = RankGPU(
        DeviceSet([gpu], gpu.now_s, "nvml"), guard, owned=True, group=cpu_collective_group()
    )

    def wrapped() -> DistributedDataParallel:
        torch.manual_seed(0)
        if world == 4:
            return DistributedDataParallel(torch.nn.Linear(4, 2), process_group=replicas[rank // 2])
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        model.register_comm_hook(None, sum_hook)
        return model

    models: dict[str, Any] = {"probed": wrapped(), "plain": wrapped()}
    run = StragglerRun(ranks, SECTION, ddp_model=models["probed"])
    equalizer = run.equalizer
    assert equalizer is not None and run._probe is not None
    identical = True
    steps = 0
    data = torch.Generator().manual_seed(rank)

    def step(let_time_pass: bool) -> None:
        nonlocal identical
        x = torch.randn(8, 4, generator=data)
        run.step_start()
        compute_s = 0.1 * SLOWDOWNS[rank] * (0.15 + 0.85 * 1410 / gpu.locked_mhz())
        cuda.launch(compute_s)  # this rank's forward and backward kernels
        for model in models.values():
            model.zero_grad()
            model(x).pow(2).sum().backward()
        cuda.launch(0.05)  # blocked in the all-reduce, then the optimizer step
        for a, b in zip(models["probed"].parameters(), models["plain"].parameters(), strict=True):
            identical = identical and a.grad is not None and torch.equal(a.grad, b.grad)
        if let_time_pass:
            cuda.advance(1.0)
        run.step_end()

    try:
        while equalizer.profiling:
            step(True)
            steps += 1
        for _ in range(STEPS_AFTER_PROFILING):
            step(rank != 1)
            steps += 1
        counted = equalizer.step
        straggler = equalizer.straggler_rank
        dist.barrier()
    finally:
        run.close()
        models.clear()  # DDP's reducers must go before their process groups
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {"identical": identical, "steps": steps, "counted": counted, "straggler": straggler}
        )
    )


if __name__ == "__main__":
    main()
