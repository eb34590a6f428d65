"""One rank of a 2-process gloo DDP run on simulated GPUs (run by test_straggler.py).

Rank 1 starts as the straggler (its GPU is 25 % slower); midway the slowdowns swap.
Writes per-phase step times, energies (this rank's) and clocks to a JSON file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_energy.device import SimulatedSpec, StageWork, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.simulated.work import DataParallelSimulation
from lightning_energy.perseus.data_parallel.straggler import (
    StragglerEqualizer,
)

from . import nccl_like

SLOWDOWNS = (1.0, 1.25)
WORK = StageWork(0.2, 0.85)
# Steps a phase's energy is read over: 16-20 s, so the 100 ms energy counter's error (at
# most a period's energy at each end) stays under 1 %.
WINDOW_STEPS = 80


def main() -> None:
    rank, port, out_dir, lease_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    nccl_like.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", first_index=rank, slowdowns=(SLOWDOWNS[rank],)))[
        0
    ]
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    training: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    }
    del model
    sim = DataParallelSimulation(gpu, WORK)
    phases: dict[str, list[dict[str, Any]]] = {"baseline": [], "equalised": [], "swapped": []}

    def step(equalizer: StragglerEqualizer | None) -> dict[str, Any]:
        training["optimizer"].zero_grad()
        loss = training["model"](torch.randn(8, 4)).pow(2).mean()
        loss.backward()  # the real all-reduce of DDP over gloo
        training["optimizer"].step()
        compute_s = sim.compute()
        readings = sim.all_reduce()
        clock = gpu.locked_clocks_mhz()
        if equalizer is not None:
            equalizer.record_step(compute_s, readings)
            equalizer.on_step_end()
        end_s, end_j = readings[2]
        return {"end_s": end_s, "end_j": end_j, "clock": clock}

    try:
        for _ in range(WINDOW_STEPS + 1):
            phases["baseline"].append(step(None))
        with GPUGuard([gpu], lease_dir=lease_dir, install_signal_handlers=False) as guard:
            equalizer = StragglerEqualizer(
                guard,
                gpu.supported_sm_clocks_mhz(),
                steps_per_clock=2,
                window_steps=3,
                counter_period_s=gpu.energy_counter_period_s(),
            )
            while equalizer.profiling:  # the same steps on both ranks: they agree
                step(equalizer)
            for _ in range(WINDOW_STEPS + 1):
                phases["equalised"].append(step(equalizer))
            straggler_before = equalizer.straggler_rank
            gpu.slowdown = SLOWDOWNS[1 - rank]
            for _ in range(WINDOW_STEPS + 6):
                phases["swapped"].append(step(equalizer))
            straggler_after = equalizer.straggler_rank
        reset_clock = gpu.locked_clocks_mhz()
        dist.barrier()
    finally:
        # DDP's reducer must go before its process group, or exiting can hang.
        training.clear()
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "phases": phases,
                "straggler_before": straggler_before,
                "straggler_after": straggler_after,
                "reset_clock": reset_clock,
            }
        )
    )


if __name__ == "__main__":
    main()
