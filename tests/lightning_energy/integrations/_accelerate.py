"""What the Accelerate tests share: the configuration, a tiny training loop, the GPU's limit
and a worker that trains until the power limit changes, then stops without
``end_training()`` (run in a launcher's worker process or as a script)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_energy.integrations.accelerate import AcceleratorEnergy, attach_energy

PRE_JOB_W = 300.0  # the simulated A40's default power limit

# The Accelerators of train_until_the_limit_changes, alive until the process ends, as a
# script's global one is: only the end of the process can put the GPU back.
KEPT: list[Accelerator] = []


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide singletons; each test builds its own Accelerator."""
    yield
    reset_accelerate_state()


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state, as a new process would start."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def energy_config(tmp_path: Path, **power_limit: Any) -> dict[str, Any]:
    """A simulated A40 profiling four limits, logging every 5 steps; leases in ``tmp_path``."""
    return {
        "device": {
            "backend": "simulated",
            "gpu": "a40",
            # 100 steps an epoch: ~37 s steps, each longer than a profiling window must last.
            "steps_per_epoch": 100,
            "noise_std": 0.02,
            "lease_dir": str(tmp_path / "leases"),
        },
        "power_limit": {
            "power_limits_w": [300, 250, 200, 150],
            "warmup_steps": 2,
            "settle_steps": 1,
            **power_limit,
        },
        "log_every_n_steps": 5,
    }


def training_parts(
    micro_batches: int, width: int = 1
) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    """A linear model (``width`` outputs), its SGD optimizer and ``micro_batches`` batches."""
    torch.manual_seed(0)
    x = torch.randn(micro_batches * 4, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).expand(-1, width)), batch_size=4)
    model = nn.Linear(8, width)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), loader


def train(accelerator: Accelerator, model: Any, optimizer: Any, loader: Any) -> None:
    """One pass over ``loader``, with Accelerate's gradient accumulation."""
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()


def gpu_limit_w(energy: AcceleratorEnergy) -> float:
    """The power limit this rank's GPU has now."""
    assert energy.controller is not None
    return float(energy.controller.devices.gpus[0].power_limit_w())


def train_until_the_limit_changes(config: dict[str, Any], out_dir: str, fail: bool) -> None:
    """Train until this rank's GPU runs below its pre-job limit, write that limit to
    ``out_dir/rank<r>.json``, then return (or raise) without ``end_training()``, the
    Accelerator kept alive in :data:`KEPT`.

    Args:
        config: the energy configuration.
        out_dir: where to write what this rank saw.
        fail: raise ``RuntimeError("boom")`` instead of returning.
    """
    if torch.distributed.is_initialized():  # debug_launcher: its ranks share the CPU
        os.environ["LOCAL_RANK"] = str(torch.distributed.get_rank())  # a GPU each
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    KEPT.append(accelerator)
    energy = attach_energy(accelerator, config)
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=60))
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if gpu_limit_w(energy) < PRE_JOB_W:
            break
    seen = {"power_limit_w": gpu_limit_w(energy)}
    (Path(out_dir) / f"rank{accelerator.process_index}.json").write_text(json.dumps(seen))
    if fail:
        raise RuntimeError("boom")


if __name__ == "__main__":  # a script that ends without end_training(): CONFIG_JSON OUT_DIR
    train_until_the_limit_changes(json.loads(sys.argv[1]), sys.argv[2], fail=False)
