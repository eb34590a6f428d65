"""The one small interface every GPU backend implements.

Everything above the device layer (measurement, the guard, optimizers' runtime, Perseus)
talks to a :class:`GPU`; the NVML backend (:mod:`.nvml`) drives real NVIDIA GPUs, the zeusd
backend (:mod:`.zeusd`) the same GPUs through Zeus' privileged daemon, the simulated
backend (:mod:`.simulated`) replays measured profiles or a physics model on a virtual clock.
Units are SI at this interface: watts, joules, seconds, MHz. Vendor units (mW, mJ) never
leave the backend that speaks them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lightning_energy.errors import DeviceError

__all__ = ["GPU", "DeviceSet", "GPUInfo", "LeaseSource", "StageWork"]


@dataclass(frozen=True)
class StageWork:
    """GPU work of one kind (an instruction of a stage, a data-parallel step), as a
    simulated GPU runs it.

    Attributes:
        t0_s: its time at the maximum clock.
        compute_bound_share: the share of that time that scales with the clock.
    """

    t0_s: float
    compute_bound_share: float = 1.0


@dataclass(frozen=True)
class GPUInfo:
    """Identity and static limits of a GPU, as reports and checkpoints record them."""

    index: int
    name: str
    uuid: str
    min_power_limit_w: float
    max_power_limit_w: float
    default_power_limit_w: float
    is_mig: bool = False


@dataclass(frozen=True)
class LeaseSource:
    """How another process (the next job, ``lightning-energy recover``) re-opens a GPU to
    put back the settings its lease records.

    Args:
        backend: ``"nvml"``, ``"zeusd"`` or ``"simulated"``.
        persistent: whether the GPU's settings outlive this process; only such a GPU
            needs a lease file (an in-memory simulated GPU does not).
        simulated_gpu: simulated GPUs: the shipped model (``"a40"``, ``"a100"``...) to
            rebuild, or None for a model that cannot be rebuilt.
        state_path: simulated GPUs: the absolute path of the file holding the settings.
        zeusd_address: zeusd GPUs: the daemon that changed them (``unix:<path>`` or
            ``tcp:<host>:<port>``; never a token).
    """

    backend: str
    persistent: bool = True
    simulated_gpu: str | None = None
    state_path: str | None = None
    zeusd_address: str | None = None


@runtime_checkable
class GPU(Protocol):
    """A GPU as seen by ``lightning_energy``.

    ``index`` is the process-local index (after ``CUDA_VISIBLE_DEVICES``); ``uuid`` is the
    stable identity used for leases and checkpoints.
    """

    @property
    def index(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def uuid(self) -> str: ...

    @property
    def is_mig(self) -> bool:
        """True for a MIG instance: settings are per physical GPU, so we only observe."""
        ...

    @property
    def physical_uuid(self) -> str:
        """The UUID of the physical GPU whose power and energy this GPU reports: a MIG
        instance's parent (every instance reports the whole GPU's), else :attr:`uuid`."""
        ...

    def power_limit_constraints_w(self) -> tuple[float, float]:
        """The (min, max) power limit the driver accepts."""
        ...

    def default_power_limit_w(self) -> float:
        """The vendor default power limit."""
        ...

    def power_limit_w(self) -> float:
        """The power management limit currently set."""
        ...

    def enforced_power_limit_w(self) -> float:
        """The limit actually enforced (the lowest of all limiters)."""
        ...

    def set_power_limit_w(self, power_limit_w: float) -> None:
        """Set the power management limit (needs privileges)."""
        ...

    def supported_sm_clocks_mhz(self) -> list[int]:
        """Supported graphics (SM) clocks at the highest memory clock, descending."""
        ...

    def set_locked_clocks_mhz(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into [min_mhz, max_mhz] (needs privileges)."""
        ...

    def reset_locked_clocks(self) -> None:
        """Release any SM clock lock."""
        ...

    def locked_clocks_mhz(self) -> tuple[int, int] | None:
        """The SM clock lock this process knows to be in force, or None."""
        ...

    def foreign_clock_setting(self) -> str | None:
        """Why the SM clocks are under a setting this process did not make (an
        administrator's ``nvidia-smi -lgc``), or None. NVML cannot read a lock back, so
        this is found from clock event reasons and application clocks."""
        ...

    def energy_j(self) -> float:
        """Cumulative energy consumed since an arbitrary origin, in joules."""
        ...

    def energy_counter_period_s(self) -> float:
        """How often :meth:`energy_j` moves, in seconds (about 0.1 on many boards; 0:
        continuously). Windows shorter than a few periods may read 0 J."""
        ...

    def power_w(self) -> float:
        """Board power draw in watts as the driver reports it (a 1 s average on Ampere
        and Hopper GPUs)."""
        ...

    def synchronize(self) -> None:
        """Wait until work queued on the GPU has finished."""
        ...

    def now_s(self) -> float:
        """Monotonic seconds in the time base the GPU's work is timed on:
        ``time.perf_counter`` for a real GPU, the virtual clock for a simulated one."""
        ...

    def idle(self, seconds: float) -> None:
        """Let ``seconds`` pass with no work on the GPU (a pipeline bubble, a wait for a
        slower rank), on the clock of :meth:`now_s`."""
        ...

    def lease_source(self) -> LeaseSource:
        """How another process re-opens this GPU to restore the settings of its lease."""
        ...


def gpu_info(gpu: GPU) -> GPUInfo:
    """Snapshot the identity and static limits of ``gpu``.

    Limits the GPU cannot report (no power management, a lost GPU) are NaN.
    """
    try:
        lo, hi = gpu.power_limit_constraints_w()
    except DeviceError:
        lo = hi = math.nan
    try:
        default_w = gpu.default_power_limit_w()
    except DeviceError:
        default_w = math.nan
    return GPUInfo(
        index=gpu.index,
        name=gpu.name,
        uuid=gpu.uuid,
        min_power_limit_w=lo,
        max_power_limit_w=hi,
        default_power_limit_w=default_w,
        is_mig=gpu.is_mig,
    )


@dataclass
class DeviceSet:
    """The GPUs this process drives, with the clock their work is timed on.

    Args:
        gpus: the local GPUs (one per rank in DDP, or several in one process).
        clock: monotonic seconds in the GPUs' time base: ``time.perf_counter`` for real
            GPUs, the virtual clock for simulated ones.
        backend: ``"nvml"``, ``"zeusd"`` or ``"simulated"``.
        run_step: for simulated GPUs, executes one training step of simulated work on every
            GPU (advancing the virtual clock); ``None`` for real GPUs, whose work is the
            training step itself.
    """

    gpus: Sequence[GPU]
    clock: Callable[[], float]
    backend: str
    run_step: Callable[[], object] | None = None

    @property
    def virtual_time(self) -> bool:
        """Whether the GPUs' time is virtual (simulated GPUs): their work is simulated, not
        run, and their clock, the job's start and the host's own counters do not follow the
        wall clock together."""
        return self.backend == "simulated"

    def synchronize(self) -> None:
        """Synchronise every GPU of the set."""
        for gpu in self.gpus:
            gpu.synchronize()

    def close(self) -> None:
        """Release what the backend holds (NVML references, power-sampler threads).

        Idempotent; GPUs without a ``close`` method (simulated ones) hold nothing.
        """
        for gpu in self.gpus:
            close = getattr(gpu, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> DeviceSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.gpus)
