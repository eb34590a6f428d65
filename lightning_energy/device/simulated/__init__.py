"""The simulated GPU: a first-class backend for tests, the demo and what-if runs.

Modules, one concern each:

* :mod:`.gpu`: :class:`SimulatedGPU` (the GPU protocol on a :class:`VirtualClock`), the
  boards' behaviour towards software (:class:`Board`), and building GPUs from a
  :class:`SimulatedSpec`;
* :mod:`.physics`: frequency-dependent time and power of compute- and memory-bound work,
  work made of phases, the governor's and the thermal constants (presets);
* :mod:`.governor`: the board's power and thermal governor, which sets the SM clock every
  control period from the power it measures;
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
from lightning_energy.device.simulated.governor import GovernedRun, Governor, steady_run
from lightning_energy.device.simulated.gpu import (
    BOARDS,
    CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING,
    CLOCK_EVENT_GPU_IDLE,
    CLOCK_EVENT_SW_POWER_CAP,
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN,
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
from lightning_energy.device.simulated.physics import (
    PHYSICS_PRESETS,
    GovernorConstants,
    Phase,
    PhysicsModel,
    ThermalModel,
    mean_compute_bound_share,
    physics_preset,
)
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
    "CLOCK_EVENT_SW_THERMAL_SLOWDOWN",
    "FAULT_OPERATIONS",
    "PHYSICS_PRESETS",
    "TRACE_GPUS",
    "Board",
    "CalibratedModel",
    "Calibration",
    "GPUModel",
    "GovernedRun",
    "Governor",
    "GovernorConstants",
    "Phase",
    "PhysicsModel",
    "PowerTrace",
    "SimulatedGPU",
    "SimulatedSpec",
    "ThermalModel",
    "TraceModel",
    "VirtualClock",
    "WorkloadTrace",
    "as_simulated",
    "live_simulated_gpus",
    "load_calibration",
    "mean_compute_bound_share",
    "physics_preset",
    "run_in_parallel",
    "simulated_gpus",
    "steady_run",
    "track_simulated_gpus",
]
