"""One rank of a 2-process gloo run where rank 1's GPU cannot list its clocks (run by
test_data_parallel.py): every Perseus run still votes on clock control on every rank.

In turn: a straggler run, a strict straggler run (rank 1 raises, after voting), and an
online pipeline run. Writes ``rank{r}.json`` with what each run decided.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.config import PerseusConfig
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.errors import DeviceError, NotSupportedError
from lightning_energy.perseus.data_parallel import StragglerRun
from lightning_energy.perseus.planning.schedule import one_f_one_b
from lightning_energy.perseus.runtime.pipeline_run import RankPipeline
from lightning_energy.perseus.runtime.rank_gpu import RankGPU

from . import nccl_like


def open_rank(rank: int, lease_dir: str, group: Any) -> RankGPU:
    """This rank's simulated GPU; rank 1's fails to list its supported clocks."""
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", first_index=rank))[0]
    if rank == 1:
        gpu.inject_fault("supported_clocks", NotSupportedError)
    guard = GPUGuard([gpu], lease_dir=lease_dir, install_signal_handlers=False)
    guard.acquire()
    return RankGPU(DeviceSet([gpu], gpu.now_s, "simulated"), guard, owned=True, group=group)


def _steps(run: StragglerRun) -> None:
    """The steps until the ranks vote on clock control."""
    for _ in range(3):
        run.step_start()
        run.step_end()


def main() -> None:
    rank, port, out_dir, lease_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    nccl_like.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = cpu_collective_group()
    section = PerseusConfig(enabled=True, profile_clocks_mhz=(1410, 1200, 1005))
    result: dict[str, Any] = {}
    try:
        straggler = StragglerRun(open_rank(rank, lease_dir, group), section)
        _steps(straggler)  # the ranks vote on clock control after the first steps
        assert straggler.equalizer is not None
        result["straggler"] = straggler.equalizer.enabled
        straggler.close()
        strict_rank = open_rank(rank, lease_dir, group)
        strict = StragglerRun(strict_rank, section, strict=rank == 1)
        try:
            _steps(strict)
        except DeviceError as exc:
            result["strict"] = f"raised {type(exc).__name__}"
        else:
            assert strict.equalizer is not None
            result["strict"] = strict.equalizer.enabled
        finally:
            strict.close()
        schedule = one_f_one_b(2, 2)
        pipeline = RankPipeline(
            open_rank(rank, lease_dir, group), section, schedule, global_rank=rank
        )
        assert pipeline.online is not None
        pipeline.iteration_start()  # after its first iteration, the pipeline's ranks vote
        for inst in schedule.device_orders[rank]:
            pipeline.before(inst)
            pipeline.after(inst)
        pipeline.iteration_end()
        result["pipeline"] = pipeline.online.phase
        pipeline.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
