"""The simulated GPU: a first-class backend for tests, the demo and what-if runs.

Modules, one concern each:

* :mod:`.gpu`: :class:`SimulatedGPU` (the GPU protocol on a :class:`VirtualClock`), the
  boards' behaviour towards software (:class:`Board`), and building GPUs from a
  :class:`SimulatedSpec`;
* :mod:`.physics`: frequency-dependent time and power of compute- and memory-bound work
  (presets ``"a100"``, ``"h100"``, ``"h200"``);
* :mod:`.traces`: replays measured time and power per power limit (Zeus traces);
* :mod:`.calibration`: a model built from a calibration run on a real GPU.
"""

from __future__ import annotations

from lightning_energy.device.simulated.calibration import (
    CALIBRATION_FORMAT,
    CalibratedModel,
    Calibration,
    load_calibration,
)
from lightning_energy.device.simulated.gpu import (
    BOARDS,
    CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING,
    CLOCK_EVENT_GPU_IDLE,
    CLOCK_EVENT_SW_POWER_CAP,
    FAULT_OPERATIONS,
    Board,
    GPUModel,
    SimulatedGPU,
    SimulatedSpec,
    VirtualClock,
    as_simulated,
    live_simulated_gpus,
    run_in_parallel,
    simulated_gpus,
    track_simulated_gpus,
)
from lightning_energy.device.simulated.physics import PHYSICS_PRESETS, PhysicsModel, physics_preset
from lightning_energy.device.simulated.traces import (
    TRACE_GPUS,
    PowerTrace,
    TraceModel,
    WorkloadTrace,
)

__all__ = [
    "BOARDS",
    "CALIBRATION_FORMAT",
    "CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING",
    "CLOCK_EVENT_GPU_IDLE",
    "CLOCK_EVENT_SW_POWER_CAP",
    "FAULT_OPERATIONS",
    "PHYSICS_PRESETS",
    "TRACE_GPUS",
    "Board",
    "CalibratedModel",
    "Calibration",
    "GPUModel",
    "PhysicsModel",
    "PowerTrace",
    "SimulatedGPU",
    "SimulatedSpec",
    "TraceModel",
    "VirtualClock",
    "WorkloadTrace",
    "as_simulated",
    "live_simulated_gpus",
    "load_calibration",
    "physics_preset",
    "run_in_parallel",
    "simulated_gpus",
    "track_simulated_gpus",
]
