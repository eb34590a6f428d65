"""One rank of a 2-process gloo ``PipelineRun`` whose loss is bfloat16 (run by
test_runtime.py): writes the loss every step returned on this rank to a JSON file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_energy.config import EnergyConfig
from lightning_energy.perseus.runtime.pipeline_run import PipelineRun
from lightning_energy.perseus.runtime.rank_gpu import open_rank_gpu

from . import nccl_like

STEPS = 3


class TwoStages(torch.nn.Module):
    """Two linear stages; the loss is computed in bfloat16 (as with bf16-true training)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stages = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

    def pipeline_stages(self) -> list[torch.nn.Module]:
        return list(self.stages)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target).to(torch.bfloat16)


def main() -> None:
    rank, port, out_dir, lease_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    nccl_like.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config = EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "gpu": "a100", "lease_dir": lease_dir},
            "perseus": {"schedule": "1f1b", "microbatches": 2},
        }
    )
    losses = []
    try:
        rank_gpu = open_rank_gpu(config, local_rank=rank, install_signal_handlers=False)
        run = PipelineRun(
            rank_gpu,
            config.perseus,
            TwoStages(),
            global_rank=rank,
            world_size=2,
            root_device=torch.device("cpu"),
        )
        try:
            generator = torch.Generator().manual_seed(1)
            for _ in range(STEPS):
                x, y = (
                    torch.randn(4, 8, generator=generator),
                    torch.randn(4, 8, generator=generator),
                )
                loss = run.step(x, y)
                losses.append([float(loss), str(loss.dtype)])
        finally:
            run.close()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
