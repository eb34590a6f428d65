"""One rank of a 2-process gloo job whose carbon pace moves a locked clock, and whose
rank 1 has every lock refused once the pace has moved it (run by test_locked_clock.py).

Arguments: rank, port, output folder, the lease folder. Each rank drives its own simulated
A100 (phased work, on which ``power_limit.knob: auto`` chooses the lock) through 1200 steps
of 36 s of the DE grid, and writes ``rank<r>.json``: whether the lock knob is still on,
the decisions, and the GPU's settings at the end and after teardown.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, simulated_gpus
from lightning_energy.device.simulated import Phase
from lightning_energy.errors import NoPermissionError

ROOT = Path(__file__).resolve().parents[2]
STEPS = 1200


def paced_config(lease_dir: str | Path, **power_limit: Any) -> EnergyConfig:
    """The carbon-pacing example on a simulated A100 whose 36 s steps make 1200 steps half
    a day of the DE grid, at most 10 % slower than full speed, with ``power_limit``."""
    return EnergyConfig.from_yaml(ROOT / "examples" / "carbon_pacing.yaml").merged(
        {
            "device": {
                "backend": "simulated",
                "gpu": "a100",
                "step_time_s": 36.0,
                "lease_dir": str(lease_dir),
            },
            "power_limit": power_limit,
            "carbon": {"max_slowdown": 1.1},
            "report": None,
        }
    )


def main() -> None:
    rank, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config = paced_config(
        sys.argv[4],
        knob="auto",
        selector="energy",
        clock_step_mhz=150,
        power_limits_w=[400, 350, 300, 250, 200, 150],
    )
    spec = dataclasses.replace(
        config.device.simulated_spec(),
        first_index=rank,
        step_phases=(Phase(0.6, 0.95), Phase(0.4, 0.15)),
    )
    (gpu,) = simulated_gpus(spec)
    devices = DeviceSet(gpus=[gpu], clock=gpu.clock.now, backend="simulated", run_step=gpu.run_step)
    controller = EnergyController(
        config, devices=devices, local_rank=rank, install_signal_handlers=False
    )
    controller.setup()
    controller.set_total_steps(STEPS)
    refused_from = None
    for step in range(STEPS):
        controller.on_step_start()
        controller.on_step_end()
        paced = [d for d in controller.decisions if "carbon pace" in d["reason"]]
        if refused_from is None and paced:
            refused_from = step + 1
            if rank == 1:  # from now on this rank's driver refuses every lock
                gpu.inject_fault("set_locked_clocks", NoPermissionError)
    result: dict[str, Any] = {
        "refused_from": refused_from,
        "locks_on": controller.locked_clock.active,
        "decisions": controller.decisions,
        "settings": gpu.settings(),
    }
    controller.teardown()
    result["restored"] = gpu.settings()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
