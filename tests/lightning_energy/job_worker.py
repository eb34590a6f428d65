"""One rank of a 2-process gloo job driving an EnergyController directly (run by
test_job_plan.py).

Arguments: rank, port, output folder, then a JSON object of options: ``local_rank``,
``node_rank``, ``env`` (variables set first, as a launcher would), ``strict``,
``state_dir`` and ``lease_dir`` (the simulated GPUs' settings and leases live in files,
shared by every process, as a real GPU's are), ``steps``, ``powercap_root`` (a fake
powercap tree the node's CPU energy is read from) and ``node_counter`` (``[energy_uj
path, range_uj, joules]``: rank 0 moves that counter on by ``joules`` after each of its
steps, as the node's CPUs would).
Writes ``rank<r>.json`` with the summary, the decisions, the job totals or the error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.errors import EnergyError
from tests.lightning_energy.device.fake_powercap import add_energy_j


def main() -> None:
    rank, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    options: dict[str, Any] = json.loads(sys.argv[4])
    os.environ.update(options.get("env", {}))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config = EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "gpu": "a40",
                "noise_std": 0.01,
                "state_dir": options["state_dir"],
                "lease_dir": options["lease_dir"],
            },
            "power_limit": {
                "selector": "energy",
                "power_limits_w": [300, 250, 200, 150],
                "warmup_steps": 2,
                "settle_steps": 1,
            },
            "strict": options.get("strict", False),
            "log_every_n_steps": 5,
            "node_energy": {"powercap_root": options.get("powercap_root")},
        }
    )
    controller = EnergyController(
        config,
        local_rank=options["local_rank"],
        node_rank=options.get("node_rank"),
        install_signal_handlers=False,
    )
    result: dict[str, Any] = {}
    try:
        controller.setup()
    except EnergyError as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        result["power_limit_w"] = controller.devices.gpus[0].power_limit_w()
    else:
        counter = options.get("node_counter")
        for _ in range(options.get("steps", 80)):
            controller.on_step_start()
            controller.on_step_end()
            if counter is not None and rank == 0:
                add_energy_j(Path(counter[0]), counter[2], counter[1])
        controller.teardown()
        job = controller.gather_job_totals()
        summary = controller.teardown()
        result.update(
            summary=summary.to_dict(),
            job=job,
            uuid=controller.devices.gpus[0].uuid,
            decisions=[(d["kind"], d["value"], d["reason"]) for d in controller.decisions],
            profile=controller.profile(),
            power_limit_w=controller.devices.gpus[0].power_limit_w(),
        )
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
