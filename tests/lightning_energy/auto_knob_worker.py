"""One rank of a 2-process gloo job whose controller compares power limits with locked
clocks (``power_limit.knob: auto``; run by test_locked_clock.py).

Arguments: rank, port, output folder, the simulated GPUs' state folder, the lease folder.
Each rank drives its own simulated A100 (its own noise), profiles both knobs and writes
``rank<r>.json``: the knob and setting chosen, the GPU's settings then and after teardown.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController


def main() -> None:
    rank, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config = EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "gpu": "a100",
                "noise_std": 0.02,
                "state_dir": sys.argv[4],
                "lease_dir": sys.argv[5],
            },
            "power_limit": {
                "knob": "auto",
                "selector": "energy",
                "power_limits_w": [400, 300, 200],
                "clock_step_mhz": 300,
                "warmup_steps": 2,
                "settle_steps": 1,
            },
        }
    )
    controller = EnergyController(config, local_rank=rank, install_signal_handlers=False)
    steps = 0
    while not controller.profile_done:  # under auto: both profiles, then the choice
        controller.on_step_start()
        controller.on_step_end()
        steps += 1
        if steps > 3000:
            raise RuntimeError("the profiles did not complete in 3000 steps")
    gpu = controller.devices.gpus[0]
    result: dict[str, Any] = {
        "knob": controller.setting.name,
        "value": controller.setting.value,
        "clocks_profiled": controller.locked_clock.profile_done,
        "settings": gpu.settings(),  # type: ignore[attr-defined]
    }
    controller.teardown()
    result["restored"] = gpu.settings()  # type: ignore[attr-defined]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
