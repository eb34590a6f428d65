"""A training job whose GPU settings change through zeusd, for the process tests: run as
``python -m tests.lightning_energy.device.zeusd_child LEASE_DIR DEVICES_JSON`` from the
repository root, with ``ZEUSD_SOCK_PATH`` and ``ZEUSD_TOKEN`` set.

The GPUs are the parent's fake GPUs as this process's NVML sees them (``DEVICES_JSON``: the
fields of each ``FakeDevice``), an NVML that refuses every setter (an ordinary user); the
daemon serves the parent's. The job profiles power limits with an ``EnergyController``
(``device.backend: zeusd``) on a tiny CPU model, prints one JSON line once set up, and
trains until a signal ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tests.lightning_energy.device.fake_pynvml import FakeDevice, make_module


def main() -> None:
    lease_dir, devices = sys.argv[1], json.loads(sys.argv[2])
    nvml = make_module([FakeDevice(**fields) for fields in devices])
    nvml.require_root = True
    sys.modules["pynvml"] = nvml

    import torch

    from lightning_energy.config import EnergyConfig
    from lightning_energy.controller import EnergyController

    config = EnergyConfig.from_mapping(
        {
            "device": {"backend": "zeusd", "lease_dir": lease_dir},
            "power_limit": {"power_limits_w": [300, 250], "warmup_steps": 0, "settle_steps": 0},
        }
    )
    controller = EnergyController(config, local_rank=0)
    controller.setup()
    guard = controller.guard
    assert guard is not None
    print(json.dumps({"pid": os.getpid(), "observe_only": guard.observe_only}), flush=True)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    while True:  # until SIGTERM or SIGKILL
        controller.on_step_start()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        controller.on_step_end()
        time.sleep(0.005)  # a step of a few milliseconds, gentle on a shared machine


if __name__ == "__main__":
    main()
