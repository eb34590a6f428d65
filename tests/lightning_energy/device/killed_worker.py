"""Lowers a simulated A40's power limit, then dies of SIGKILL (run by path by
test_simulated.py): ``python killed_worker.py STATE_DIR``.

The limit is kept in the state file under ``STATE_DIR``, as a real board keeps it after
the process that set it is gone.
"""

from __future__ import annotations

import os
import signal
import sys

from lightning_energy.device import SimulatedSpec, simulated_gpus


def main() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a40", state_dir=sys.argv[1]))[0]
    gpu.set_power_limit_w(150.0)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
