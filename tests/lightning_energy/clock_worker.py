"""Profiles locked clocks on a simulated A100 until one is locked, then waits for a signal
(run by path by test_locked_clock.py): ``python clock_worker.py LEASE_DIR STATE_DIR``.

It prints one JSON line, ``{"locked": [min, max]}``, once the GPU is locked; the lock is
kept in the state file under ``STATE_DIR``, as a real board keeps it after the process
that set it is gone.
"""

from __future__ import annotations

import json
import sys
import time

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus


def main() -> None:
    lease_dir, state_dir = sys.argv[1], sys.argv[2]
    gpus = simulated_gpus(SimulatedSpec(gpu="a100", step_time_s=0.5, state_dir=state_dir))
    devices = DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=lambda: [g.run_step() for g in gpus] and None,
    )
    config = EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "lease_dir": lease_dir},
            "power_limit": {"knob": "locked_clock", "warmup_steps": 1, "settle_steps": 1},
        }
    )
    controller = EnergyController(config, devices=devices)  # restores on SIGTERM
    while gpus[0].settings()[1] is None:
        controller.on_step_start()
        controller.on_step_end()
    print(json.dumps({"locked": list(gpus[0].settings()[1] or ())}), flush=True)
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    main()
