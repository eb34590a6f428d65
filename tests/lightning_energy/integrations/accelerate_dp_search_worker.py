"""One rank of a 2-process gloo Accelerate training under Kareus' online data-parallel
search (test_kareus_ddp.py).

Run with Accelerate's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), ``ENERGY_CFG`` (the energy configuration as JSON) and
``OUT_DIR``. Each rank feeds the same small model its own batches; at every step the CTAs
the hook all-reduces in and the clock lock, and the first step's gradients beside plain
DDP's, go to ``rank<r>.json`` with the search's profile and the run's decisions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from lightning_energy.integrations.accelerate import attach_energy
from lightning_energy.kareus.dp_search import GradientGroups

STEPS = 250


def model() -> torch.nn.Module:
    """The same weights on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def main() -> None:
    out_dir = Path(os.environ["OUT_DIR"])
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator, json.loads(os.environ["ENERGY_CFG"]))
    rank = accelerator.process_index
    torch.manual_seed(100 + rank)  # each rank its own batches
    batches = [torch.randn(8, 16) for _ in range(STEPS)]

    plain = DistributedDataParallel(model())
    plain(batches[0]).square().mean().backward()

    prepared = accelerator.prepare(model())
    assert isinstance(prepared, DistributedDataParallel)
    optimizer = accelerator.prepare(torch.optim.SGD(prepared.parameters(), lr=0.0))
    [(hook, state)] = prepared._comm_hooks
    assert isinstance(state, GradientGroups), state
    controller = energy.controller
    assert controller is not None
    gpu = controller.devices.gpus[0]
    steps = []
    first_grads = None
    for batch in batches:
        steps.append([state.ctas, gpu.locked_clocks_mhz()])
        accelerator.backward(prepared(batch).square().mean())
        if first_grads is None:
            first_grads = [p.grad.flatten().tolist() for p in prepared.module.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    search = energy.search
    assert search is not None
    result: dict[str, Any] = {
        "hook": hook.__name__,
        "steps": steps,
        "prepared": first_grads,
        "plain": [p.grad.flatten().tolist() for p in plain.module.parameters()],
        "profile": search.profile(),
        "chosen": [search.chosen.ctas, search.chosen.clock_mhz] if search.chosen else None,
        "decisions": [[d["kind"], d["value"], d["purpose"]] for d in controller.decisions],
    }
    accelerator.end_training()
    result["clock_after_end"] = gpu.locked_clocks_mhz()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
