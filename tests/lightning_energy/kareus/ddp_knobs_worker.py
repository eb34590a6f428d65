"""One rank of a 2-process gloo DDP training step under Kareus data-parallel settings
(test_data_parallel.py).

Each rank builds the same small model and feeds it its own batch; the model is wrapped by
:func:`~lightning_energy.kareus.data_parallel.wrap_ddp` once per setting (NCCL's default
buckets and group; tiny buckets in a CTA-limited copy of the group) and runs one backward.
Every parameter's gradient per setting, and whether DDP reduced in the default group, go
to ``rank<r>.json``.

Usage: ``python -m tests.lightning_energy.kareus.ddp_knobs_worker RANK PORT OUT_DIR``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_energy.kareus.data_parallel import DataParallelSetting, wrap_ddp

WORLD = 2
SETTINGS = {
    "default": DataParallelSetting(),
    "tiny_buckets": DataParallelSetting(ctas=4, bucket_cap_mb=0.001),
}


def model() -> torch.nn.Module:
    """The same weights on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )


def grads(module: torch.nn.Module) -> dict[str, list[float]]:
    """Every parameter's gradient, flat."""
    out = {}
    for name, param in module.named_parameters():
        assert param.grad is not None, name
        out[name] = param.grad.flatten().tolist()
    return out


def main(rank: int, port: int, out_dir: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    torch.manual_seed(100 + rank)  # each rank its own batch
    batch = torch.randn(8, 16)
    local = model()
    local(batch).square().mean().backward()
    result: dict[str, object] = {"local": {"grads": grads(local)}}
    for name, setting in SETTINGS.items():
        ddp = wrap_ddp(model(), setting)
        ddp(batch).square().mean().backward()
        result[name] = {
            "grads": grads(ddp.module),
            "default_group": ddp.process_group is dist.group.WORLD,
        }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
