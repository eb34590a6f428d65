"""One rank of a 2-process gloo Accelerate training step under a Kareus data-parallel
setting (test_kareus_ddp.py).

Run with Accelerate's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), ``ENERGY_CFG`` (the energy configuration as JSON) and
``OUT_DIR``. Each rank feeds the same small model its own batch: once alone, once in plain
DDP and once prepared by the Accelerator the energy optimisation is attached to. Every
parameter's gradient per run, the prepared DDP model's buckets and communication hook, and
what the Accelerator holds after ``end_training()`` go to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from lightning_energy.integrations.accelerate import attach_energy
from tests.lightning_energy.kareus.ddp_knobs_worker import grads, model


def main() -> None:
    out_dir = Path(os.environ["OUT_DIR"])
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator, json.loads(os.environ["ENERGY_CFG"]))
    rank = accelerator.process_index
    torch.manual_seed(100 + rank)  # each rank its own batch
    batch = torch.randn(8, 16)

    local = model()
    local(batch).square().mean().backward()
    plain = DistributedDataParallel(model())
    plain(batch).square().mean().backward()

    prepared = accelerator.prepare(model())
    assert isinstance(prepared, DistributedDataParallel)
    accelerator.backward(prepared(batch).square().mean())
    hooks = []
    for hook, state in prepared._comm_hooks:
        assert isinstance(state, dist.ProcessGroup), state  # allreduce_hook's state
        hooks.append({"hook": hook.__name__, "ranks": dist.get_process_group_ranks(state)})
    result = {
        "local": grads(local),
        "plain": grads(plain.module),
        "prepared": grads(prepared.module),
        "bucket_bytes_cap": prepared.bucket_bytes_cap,
        "hooks": hooks,
        "hook_group_is_world": [state is dist.group.WORLD for _, state in prepared._comm_hooks],
        "setting": str(energy.data_parallel),
    }
    accelerator.end_training()
    result["after_end"] = {
        "ddp_handler": repr(accelerator.ddp_handler),
        "prepare_model_replaced": "prepare_model" in vars(accelerator),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
