"""The simulated GPU: a first-class backend for tests, the demo and what-if runs.

A :class:`SimulatedGPU` implements the :class:`~lightning_energy.device.base.GPU` protocol
on a :class:`VirtualClock`. Its behaviour comes from a model:

* a trace model (:mod:`.traces`): replays the measured epoch time and average power of one
  Zeus workload at each power limit (A40, V100, or any Zeus-format CSV);
* a physics model (:mod:`.physics`): frequency-dependent time and power of compute- and
  memory-bound work, with clock locking and a power limit that caps the clock (presets
  ``"a100"``, ``"h100"``).

Work (:meth:`SimulatedGPU.run_step`, :meth:`SimulatedGPU.run_work`) advances the shared
virtual clock and the GPU's energy counter. Whenever the clock moves on without the GPU
working (another GPU's work, :meth:`SimulatedGPU.idle`, :meth:`VirtualClock.advance`), the
GPU draws its idle power for that time, so energy counters always cover the whole timeline.
A wait blocked in a collective (:meth:`SimulatedGPU.wait_in_collective`) is not idle: NCCL
spins at the locked clock, drawing the physics model's blocked power at that clock.
:func:`run_in_parallel` runs steps on several GPUs at once, as synchronous data parallelism
does: the clock moves by the slowest GPU's step and the others wait at idle power.

Realism knobs: ``noise_std`` (relative Gaussian noise on work duration and power, seeded),
``slowdown`` (a straggler: all work takes that factor longer at the same power), fault
injection (:meth:`SimulatedGPU.inject_fault`), ``permission_denied`` and
``supports_setting`` flags, and ``state_path``: the settable state (power limit, clock
lock) persists in a JSON file, written atomically, so it outlives the process as a real
driver's state does.

Example:
    >>> gpus = simulated_gpus(SimulatedSpec(gpu="a40", count=2))
    >>> gpus[0].set_power_limit_w(200.0)
    >>> duration_s = run_in_parallel(gpus)
    >>> gpus[1].energy_j() > 0
    True
    >>> gpus[0].set_power_limit_w(gpus[0].default_power_limit_w())
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import random
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from lightning_energy.device.base import GPU, LeaseSource
from lightning_energy.device.simulated.calibration import CalibratedModel, load_calibration
from lightning_energy.device.simulated.governor import Governor
from lightning_energy.device.simulated.physics import (
    PHYSICS_PRESETS,
    Phase,
    PhysicsModel,
    phase_problems,
    physics_preset,
)
from lightning_energy.device.simulated.traces import TRACE_GPUS, PowerTrace, TraceModel
from lightning_energy.errors import (
    ConfigError,
    DeviceError,
    DriverError,
    NoPermissionError,
    NotSupportedError,
)
from lightning_energy.files import write_atomically
from lightning_energy.numbers import is_finite

__all__ = [
    "BOARDS",
    "CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING",
    "CLOCK_EVENT_GPU_IDLE",
    "CLOCK_EVENT_SW_POWER_CAP",
    "CLOCK_EVENT_SW_THERMAL_SLOWDOWN",
    "FAULT_OPERATIONS",
    "Board",
    "GPUModel",
    "SimulatedGPU",
    "SimulatedSpec",
    "VirtualClock",
    "live_simulated_gpus",
    "run_in_parallel",
    "simulated_gpus",
    "track_simulated_gpus",
]

# Operations of the GPU protocol; "any" faults count and fail all of these.
_PROTOCOL_OPERATIONS = frozenset(
    {
        "power_limit_constraints",
        "default_power_limit",
        "power_limit",
        "enforced_power_limit",
        "set_power_limit",
        "supported_clocks",
        "set_locked_clocks",
        "reset_locked_clocks",
        "locked_clocks",
        "energy",
        "power",
        "instant_power",
        "clock_event_reasons",
        "clock",
        "temperature",
        "synchronize",
    }
)
_SETTERS = frozenset({"set_power_limit", "set_locked_clocks", "reset_locked_clocks"})
# Operations a fault can target: the protocol's, the simulated workload's, and "any".
FAULT_OPERATIONS = frozenset(_PROTOCOL_OPERATIONS | {"run_step", "run_work", "idle", "any"})

_LIVE: weakref.WeakSet[SimulatedGPU] = weakref.WeakSet()
_TRACKERS: list[list[SimulatedGPU]] = []

Settings = tuple[float, tuple[int, int] | None]


#: NVML clock event (throttle) reason bits reported by :meth:`SimulatedGPU.clock_event_reasons`.
CLOCK_EVENT_GPU_IDLE = 0x1
CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING = 0x2
CLOCK_EVENT_SW_POWER_CAP = 0x4
CLOCK_EVENT_SW_THERMAL_SLOWDOWN = 0x20


@dataclass(frozen=True)
class Board:
    """How a simulated board treats software, as real boards and drivers do.

    The default is an ideal board (every reading exact and immediate); the presets of
    :data:`BOARDS` are as rude as the real ones.

    Attributes:
        energy_counter_period_s: the energy counter moves only every this many seconds (a
            window shorter than that may read 0 J); 0: it moves continuously.
        power_average_s: :meth:`SimulatedGPU.power_w` (``nvmlDeviceGetPowerUsage``) is the
            average power over the last this many seconds (1 s on Ampere and Hopper); 0:
            the power drawn now.
        instant_power: whether :meth:`SimulatedGPU.instant_power_w` (the driver's
            instantaneous power field) exists; without it, it raises
            :class:`NotSupportedError`, as an older driver does.
        setting_latency_s: a new power limit or clock lock is read back at once but only
            governs work that starts this many seconds after it was set.
        enforced_power_limit_w: a board or rack power limiter below the settable range's
            top: the enforced limit is the lower of it and the set limit (None: none).
        foreign_clock_lock_mhz: an SM clock lock an administrator set before the job
            (``nvidia-smi -lgc``): work runs under it, :meth:`SimulatedGPU.locked_clocks_mhz`
            does not show it (NVML cannot read a lock back), the clock event reasons do,
            but only under load (see :meth:`SimulatedGPU.clock_event_reasons`). Locking or
            resetting clocks replaces it.
    """

    energy_counter_period_s: float = 0.0
    power_average_s: float = 0.0
    instant_power: bool = True
    setting_latency_s: float = 0.0
    enforced_power_limit_w: float | None = None
    foreign_clock_lock_mhz: tuple[int, int] | None = None

    def problems(self) -> list[str]:
        """What is out of range, one line each (empty when valid)."""
        problems = []
        for key in ("energy_counter_period_s", "power_average_s", "setting_latency_s"):
            value = getattr(self, key)
            if not 0.0 <= value < float("inf"):
                problems.append(
                    f"{key}: {value!r} is not allowed; use a finite number of seconds >= 0"
                )
        limit = self.enforced_power_limit_w
        if limit is not None and not 0.0 < limit < float("inf"):
            problems.append(
                f"enforced_power_limit_w: {limit!r} is not allowed; use > 0 watts or None"
            )
        lock = self.foreign_clock_lock_mhz
        if lock is not None and not (len(lock) == 2 and 0 < lock[0] <= lock[1]):
            problems.append(f"foreign_clock_lock_mhz={lock!r}: need (min, max) with 0 < min <= max")
        return problems


# What the shipped GPUs do to software: the energy counter of these boards moves about every
# 100 ms; Ampere and Hopper report a 1 s average as their power usage and have the
# instantaneous power field on recent drivers; Volta reports (nearly) instantaneous power
# and predates that field. Setting a limit or a lock takes effect after tens of ms.
BOARDS: dict[str, Board] = {
    "v100": Board(0.1, 0.0, False, 0.05),
    "a40": Board(0.1, 1.0, True, 0.05),
    "a100": Board(0.1, 1.0, True, 0.05),
    "h100": Board(0.1, 1.0, True, 0.05),
    "h200": Board(0.1, 1.0, True, 0.05),
    "a100_sxm": Board(0.1, 1.0, True, 0.05),
    "a100_pcie": Board(0.1, 1.0, True, 0.05),
    "a40_physics": Board(0.1, 1.0, True, 0.05),
}


class VirtualClock:
    """A thread-safe simulated clock in seconds; it only moves when told to.

    Args:
        start_s: the initial reading.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s
        self._lock = threading.Lock()

    def now(self) -> float:
        """The current time in seconds."""
        with self._lock:
            return self._now_s

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``.

        Raises:
            ConfigError: ``seconds`` is negative.
        """
        if seconds < 0:
            raise ConfigError(f"seconds={seconds!r}: the clock only moves forward (>= 0)")
        with self._lock:
            self._now_s += seconds

    def sleep(self, seconds: float) -> None:
        """Same as :meth:`advance`: a simulated sleep passes instantly."""
        self.advance(seconds)


class GPUModel(Protocol):
    """What a simulated GPU needs from its model (trace or physics)."""

    @property
    def name(self) -> str: ...

    @property
    def min_power_limit_w(self) -> float: ...

    @property
    def max_power_limit_w(self) -> float: ...

    @property
    def default_power_limit_w(self) -> float: ...

    @property
    def idle_power_w(self) -> float: ...

    @property
    def sm_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks, descending; empty when the model has no clocks."""
        ...

    def step_work(self) -> tuple[float, float]:
        """``(t0_s, compute_bound_share)`` of one training step."""
        ...

    def run(
        self,
        t0_s: float,
        compute_bound_share: float,
        power_limit_w: float,
        max_clock_mhz: int | None,
    ) -> tuple[float, float]:
        """``(duration_s, power_w)`` of a piece of work under the given settings."""
        ...


@dataclass
class _Fault:
    operation: str
    error: type[DeviceError] | DeviceError
    after_calls: int
    times: int | None
    calls: int = 0
    fired: int = 0


class SimulatedGPU:
    """A simulated GPU driven by a trace or physics model on a virtual clock.

    Args:
        model: the behaviour (a :class:`~.traces.TraceModel` or :class:`~.physics.PhysicsModel`).
        index: the process-local index.
        uuid: the stable identity (default ``"GPU-sim-<index>"``).
        clock: the virtual clock shared with other GPUs (a new one by default).
        slowdown: straggler factor >= 1: every piece of work takes this much longer.
        noise_std: relative standard deviation of Gaussian noise on work duration and power.
        seed: seeds the noise (with the uuid), so runs are reproducible.
        permission_denied: setters raise :class:`NoPermissionError`.
        supports_setting: when False, setters raise :class:`NotSupportedError`.
        state_path: JSON file holding the settable state across processes; read here if it
            exists, rewritten atomically on every change.

    Raises:
        ConfigError: a parameter is out of range.
        DriverError: ``state_path`` exists but is unreadable, malformed or another GPU's.
    """

    def __init__(
        self,
        model: GPUModel,
        *,
        index: int = 0,
        uuid: str | None = None,
        clock: VirtualClock | None = None,
        slowdown: float = 1.0,
        noise_std: float = 0.0,
        seed: int = 0,
        permission_denied: bool = False,
        supports_setting: bool = True,
        state_path: str | Path | None = None,
        board: Board | None = None,
    ) -> None:
        problems = []
        if not slowdown >= 1.0:
            problems.append(
                f"slowdown: {slowdown!r} is not allowed; use >= 1 (1 = not a straggler)"
            )
        if not noise_std >= 0.0:
            problems.append(f"noise_std: {noise_std!r} is not allowed; use >= 0")
        if index < 0:
            problems.append(f"index: {index!r} is not allowed; use >= 0")
        if board is not None:
            problems.extend(board.problems())
        if problems:
            raise ConfigError(problems, source="SimulatedGPU")
        self.model = model
        self._index = index
        self._uuid = uuid if uuid is not None else f"GPU-sim-{index}"
        self.clock = clock if clock is not None else VirtualClock()
        self.slowdown = slowdown
        self.noise_std = noise_std
        self._rng = random.Random(f"{seed}/{self._uuid}")
        self.permission_denied = permission_denied
        self.supports_setting = supports_setting
        self.state_path = Path(state_path) if state_path is not None else None
        self._lock = threading.RLock()
        self._faults: list[_Fault] = []
        self.board = board if board is not None else Board()
        self._power_limit_w = model.default_power_limit_w
        self._locked: tuple[int, int] | None = None
        # Settings in force before the last change, and when that change takes effect.
        self._previous: Settings = (self._power_limit_w, None)
        self._settings_effective_s = self.clock.now()
        self._energy_j = 0.0
        self._accounted_until_s = self.clock.now()
        self._last_work_power_w: float | None = None
        # (time, true cumulative energy) breakpoints; energy is linear between them.
        self._history: list[tuple[float, float]] = [(self._accounted_until_s, 0.0)]
        self._created_s = self._accounted_until_s
        self._counter_phase_s = random.Random(f"phase/{self._uuid}").random()
        self._counter_offset_j = 0.0
        self._cuda_error: str | None = None
        self._foreign_lock = self.board.foreign_clock_lock_mhz
        self._power_capped = False
        self._clock_held = False  # the last work ran below its clock because of a lock
        self._thermal_slowdown = False
        self._work_clock_mhz: int | None = None
        # Physics models run under the board's power and thermal governor.
        self._governor = (
            Governor(model, self._accounted_until_s) if isinstance(model, PhysicsModel) else None
        )
        if self.state_path is not None and self.state_path.exists():
            self._load_state(self.state_path)
        self.initial_settings: Settings = self.settings()
        _LIVE.add(self)
        for tracker in _TRACKERS:
            tracker.append(self)

    def __repr__(self) -> str:
        return f"SimulatedGPU(index={self._index}, name={self.name!r}, uuid={self._uuid!r})"

    # ----------------------------------------------------------------- identity
    @property
    def index(self) -> int:
        """The process-local index."""
        return self._index

    @property
    def name(self) -> str:
        """The model's GPU name with ``" (simulated)"`` appended."""
        return f"{self.model.name} (simulated)"

    @property
    def uuid(self) -> str:
        """The stable identity."""
        return self._uuid

    @property
    def is_mig(self) -> bool:
        """Always False: simulated GPUs are whole GPUs."""
        return False

    @property
    def physical_uuid(self) -> str:
        """The :attr:`uuid`: a whole GPU is its own physical GPU."""
        return self._uuid

    # ------------------------------------------------------------------- faults
    def inject_fault(
        self,
        operation: str,
        error: type[DeviceError] | DeviceError,
        *,
        after_calls: int = 0,
        times: int | None = None,
    ) -> None:
        """Make an operation fail.

        Args:
            operation: one of :data:`FAULT_OPERATIONS`: a protocol operation
                (``"set_power_limit"``, ``"set_locked_clocks"``, ``"energy"``, ...), a
                workload operation (``"run_step"``, ``"run_work"``, ``"idle"``), or
                ``"any"``: every protocol operation (e.g. a GPU lost mid-run with
                ``GPULostError``); workload operations fail only when named.
            error: the exception class (instantiated with this GPU's index and the
                operation) or instance to raise.
            after_calls: calls of the operation that still succeed before the fault starts.
            times: how many calls fail (None: every call from then on).

        Raises:
            ConfigError: unknown operation or negative counts.
        """
        problems = []
        if operation not in FAULT_OPERATIONS:
            problems.append(f"operation={operation!r}: allowed: {sorted(FAULT_OPERATIONS)}")
        if after_calls < 0:
            problems.append(f"after_calls: {after_calls!r} is not allowed; use >= 0")
        if times is not None and times < 1:
            problems.append(f"times: {times!r} is not allowed; use >= 1 or None")
        if problems:
            raise ConfigError(problems, source="inject_fault")
        with self._lock:
            self._faults.append(_Fault(operation, error, after_calls, times))

    def clear_faults(self) -> None:
        """Remove every injected fault."""
        with self._lock:
            self._faults.clear()

    def _check(self, operation: str) -> None:
        """Raise the fault, permission or support error due for ``operation``."""
        for fault in self._faults:
            if fault.operation != operation and not (
                fault.operation == "any" and operation in _PROTOCOL_OPERATIONS
            ):
                continue
            fault.calls += 1
            if fault.calls > fault.after_calls and (
                fault.times is None or fault.fired < fault.times
            ):
                fault.fired += 1
                if isinstance(fault.error, DeviceError):
                    raise fault.error
                raise fault.error("injected fault", gpu_index=self._index, operation=operation)
        if operation in _SETTERS:
            if not self.supports_setting:
                raise NotSupportedError(
                    "this GPU does not support changing settings",
                    gpu_index=self._index,
                    operation=operation,
                )
            if self.permission_denied:
                raise NoPermissionError(
                    "changing GPU settings needs root or CAP_SYS_ADMIN",
                    gpu_index=self._index,
                    operation=operation,
                )

    # --------------------------------------------------------------- settings
    def power_limit_constraints_w(self) -> tuple[float, float]:
        """The (min, max) power limit the model accepts."""
        with self._lock:
            self._check("power_limit_constraints")
            return self.model.min_power_limit_w, self.model.max_power_limit_w

    def default_power_limit_w(self) -> float:
        """The default power limit."""
        with self._lock:
            self._check("default_power_limit")
            return self.model.default_power_limit_w

    def power_limit_w(self) -> float:
        """The power limit currently set."""
        with self._lock:
            self._check("power_limit")
            return self._power_limit_w

    def enforced_power_limit_w(self) -> float:
        """The enforced limit: the set limit, or the board's limiter when that is lower."""
        with self._lock:
            self._check("enforced_power_limit")
            return self._enforced(self._power_limit_w)

    def _enforced(self, power_limit_w: float) -> float:
        limiter = self.board.enforced_power_limit_w
        return power_limit_w if limiter is None else min(power_limit_w, limiter)

    def _change_settings(self, power_limit_w: float, locked: tuple[int, int] | None) -> None:
        """Apply new settings; work starting within the board's latency still runs under
        the settings in force before."""
        now = self.clock.now()
        self._previous = self._effective_settings(now)
        self._settings_effective_s = now + self.board.setting_latency_s
        self._power_limit_w, self._locked = float(power_limit_w), locked
        self._save_state()

    def _effective_settings(self, at_s: float) -> Settings:
        """``(power limit, clock lock)`` governing work that starts at ``at_s``."""
        if at_s < self._settings_effective_s:
            return self._previous
        return self._power_limit_w, self._locked if self._locked is not None else self._foreign_lock

    def set_power_limit_w(self, power_limit_w: float) -> None:
        """Set the power limit.

        Raises:
            NoPermissionError: constructed with ``permission_denied=True``.
            NotSupportedError: constructed with ``supports_setting=False``.
            DriverError: the limit is outside :meth:`power_limit_constraints_w` (NVML
                rejects it as an invalid argument).
        """
        with self._lock:
            self._check("set_power_limit")
            lo, hi = self.model.min_power_limit_w, self.model.max_power_limit_w
            if not lo <= power_limit_w <= hi:
                raise DriverError(
                    f"power limit {power_limit_w} W is outside the supported range [{lo}, {hi}] W",
                    gpu_index=self._index,
                    operation="set_power_limit",
                )
            self._change_settings(power_limit_w, self._locked)

    def supported_sm_clocks_mhz(self) -> list[int]:
        """Supported SM clocks, descending.

        Raises:
            NotSupportedError: trace GPUs do not model clocks.
        """
        with self._lock:
            self._check("supported_clocks")
            return list(self._clocks("supported_clocks"))

    def _clocks(self, operation: str) -> tuple[int, ...]:
        clocks = self.model.sm_clocks_mhz
        if not clocks:
            raise NotSupportedError(
                "trace-driven simulated GPUs do not model SM clocks (use a physics preset "
                "such as 'a100' for clock control)",
                gpu_index=self._index,
                operation=operation,
            )
        return clocks

    def set_locked_clocks_mhz(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into ``[min_mhz, max_mhz]``; work runs at the highest
        supported clock in that range that the power limit allows.

        Raises:
            NoPermissionError: constructed with ``permission_denied=True``.
            NotSupportedError: ``supports_setting=False``, or a trace GPU.
            DriverError: ``min_mhz > max_mhz`` or ``max_mhz`` below the lowest clock.
        """
        with self._lock:
            self._check("set_locked_clocks")
            clocks = self._clocks("set_locked_clocks")
            if not min_mhz <= max_mhz or max_mhz < clocks[-1]:
                raise DriverError(
                    f"invalid clock lock [{min_mhz}, {max_mhz}] MHz (supported: "
                    f"{clocks[-1]}-{clocks[0]} MHz)",
                    gpu_index=self._index,
                    operation="set_locked_clocks",
                )
            self._change_settings(self._power_limit_w, (int(min_mhz), int(max_mhz)))
            self._foreign_lock = None  # a new lock replaces whoever's lock was there

    def reset_locked_clocks(self) -> None:
        """Release the SM clock lock, an administrator's included (a no-op when none)."""
        with self._lock:
            self._check("reset_locked_clocks")
            self._change_settings(self._power_limit_w, None)
            self._foreign_lock = None

    def locked_clocks_mhz(self) -> tuple[int, int] | None:
        """The clock lock this process set, or None.

        Like NVML, a lock set by someone else (:attr:`Board.foreign_clock_lock_mhz`) is
        not shown; :meth:`clock_event_reasons` reveals it.
        """
        with self._lock:
            self._check("locked_clocks")
            return self._locked

    def foreign_clock_lock_mhz(self) -> tuple[int, int] | None:
        """The administrator's clock lock still in force, bypassing faults (for tests)."""
        with self._lock:
            return self._foreign_lock

    def clock_event_reasons(self) -> int:
        """NVML clock event (throttle) reason bits now.

        NVML reports what held the clocks back in its latest sample of the GPU, so the
        reasons describe the last piece of work while no time has passed since it ended
        (or while it runs, seen from another thread):
        :data:`CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING` when a clock lock (this process's
        or an administrator's) held it below the clock it would have run at,
        :data:`CLOCK_EVENT_SW_POWER_CAP` when the power limit did (for a physics model: the
        governor held the clock under its ceiling at some point of that work),
        :data:`CLOCK_EVENT_SW_THERMAL_SLOWDOWN` when the temperature did.
        Once the clock has moved on without work on this GPU (:meth:`idle`, another GPU's
        work on the shared clock), the GPU is idle and reports :data:`CLOCK_EVENT_GPU_IDLE`
        alone: a lock does not show on an idle GPU.
        """
        with self._lock:
            self._check("clock_event_reasons")
            self._settle()
            if self._last_work_power_w is None:
                return CLOCK_EVENT_GPU_IDLE
            reasons = 0
            if self._clock_held:
                reasons |= CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING
            if self._power_capped:
                reasons |= CLOCK_EVENT_SW_POWER_CAP
            if self._thermal_slowdown:
                reasons |= CLOCK_EVENT_SW_THERMAL_SLOWDOWN
            return reasons

    def sm_clock_mhz(self) -> int | None:
        """The SM clock the last piece of work ran at (``nvmlDeviceGetClockInfo``), or None
        while the GPU is idle or for trace GPUs, which do not model clocks."""
        with self._lock:
            self._check("clock")
            self._settle()
            return None if self._last_work_power_w is None else self._work_clock_mhz

    def temperature_c(self) -> float:
        """The GPU's temperature (``nvmlDeviceGetTemperature``) from the model's thermal
        model, the idle stretch since the last work included.

        Raises:
            NotSupportedError: the model has no thermal model (no shipped preset has one).
        """
        with self._lock:
            self._check("temperature")
            governor = self._governor
            if governor is None or governor.model.thermal is None:
                raise NotSupportedError(
                    "this simulated GPU has no thermal model",
                    gpu_index=self._index,
                    operation="temperature",
                )
            return governor.temperature_at(self.clock.now())

    def foreign_clock_setting(self) -> str | None:
        """Why the SM clocks are under a setting this process did not make, or None.

        Detected as on NVML: the applications-clocks-setting event reason while this
        process holds no lock, so only right after work the lock held back (see
        :meth:`clock_event_reasons`).
        """
        reasons = self.clock_event_reasons()
        with self._lock:
            if self._locked is None and reasons & CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING:
                return (
                    "its clocks are limited by a clock setting this job did not make "
                    "(an administrator's `nvidia-smi -lgc` or `-ac`)"
                )
            return None

    def settings(self) -> Settings:
        """``(power_limit_w, locked_clocks_mhz)`` as they are now, bypassing faults.

        Used by leak checks and by tests to inspect the state.
        """
        with self._lock:
            return self._power_limit_w, self._locked

    # ----------------------------------------------------------------- energy
    def _settle(self) -> None:
        """Charge idle power for clock time that passed without work on this GPU."""
        now = self.clock.now()
        if now > self._accounted_until_s:
            self._energy_j += self.model.idle_power_w * (now - self._accounted_until_s)
            self._accounted_until_s = now
            self._last_work_power_w = None
            self._record()

    def _record(self) -> None:
        """Add a breakpoint of the true energy; forget what no reading can need any more."""
        self._history.append((self._accounted_until_s, self._energy_j))
        horizon = self.clock.now() - 2.0 * max(
            self.board.energy_counter_period_s, self.board.power_average_s, 1.0
        )
        drop = bisect.bisect_left(self._history, (horizon, -math.inf)) - 1
        if drop > 0:
            del self._history[:drop]

    def _true_energy_at(self, t_s: float) -> float:
        """True cumulative energy at ``t_s`` (linear between breakpoints)."""
        history = self._history
        if t_s <= history[0][0]:
            return history[0][1]
        k = bisect.bisect_left(history, (t_s, -math.inf))
        if k == len(history):
            return history[-1][1]
        (t0, e0), (t1, e1) = history[k - 1], history[k]
        return e1 if t1 <= t0 else e0 + (e1 - e0) * (t_s - t0) / (t1 - t0)

    def energy_j(self) -> float:
        """The energy counter in joules.

        With :attr:`Board.energy_counter_period_s`, the counter moves only at the end of
        each period (the energy used up to then); after :meth:`reload_driver` it starts
        again from 0.
        """
        with self._lock:
            self._check("energy")
            self._settle()
            now = self.clock.now()
            period = self.board.energy_counter_period_s
            if period > 0:
                ticks = math.floor((now - self._created_s) / period + self._counter_phase_s)
                now = self._created_s + (ticks - self._counter_phase_s) * period
            return self._true_energy_at(now) - self._counter_offset_j

    def energy_counter_period_s(self) -> float:
        """How often the energy counter moves (:attr:`Board.energy_counter_period_s`)."""
        return self.board.energy_counter_period_s

    def power_w(self) -> float:
        """Power as the driver reports it (``nvmlDeviceGetPowerUsage``).

        The average over the last :attr:`Board.power_average_s` seconds (Ampere and
        Hopper report 1 s averages), or the power drawn now when that is 0.
        """
        with self._lock:
            self._check("power")
            return self._power_now_w(self.board.power_average_s)

    def instant_power_w(self) -> float:
        """The power drawn now (the driver's instantaneous power field).

        Raises:
            NotSupportedError: the board's driver has no such field
                (:attr:`Board.instant_power` is False).
        """
        with self._lock:
            self._check("instant_power")
            if not self.board.instant_power:
                raise NotSupportedError(
                    "this driver has no instantaneous power field",
                    gpu_index=self._index,
                    operation="instant_power",
                )
            return self._power_now_w(0.0)

    def _power_now_w(self, average_s: float) -> float:
        self._settle()
        now = self.clock.now()
        start = max(now - average_s, self._created_s)
        if average_s > 0 and now > start:
            return (self._true_energy_at(now) - self._true_energy_at(start)) / (now - start)
        if self._last_work_power_w is not None:
            return self._last_work_power_w
        return self.model.idle_power_w

    def reload_driver(self) -> None:
        """Simulate a driver reload: the energy counter starts again from 0."""
        with self._lock:
            self._settle()
            self._counter_offset_j = self._energy_j

    def fail_cuda(self, message: str = "an illegal memory access was encountered") -> None:
        """Make a CUDA error sticky: every later synchronise and piece of work raises it,
        as a CUDA context does after an asynchronous error."""
        with self._lock:
            self._cuda_error = message

    def _check_cuda(self, operation: str) -> None:
        if self._cuda_error is not None:
            raise DriverError(
                f"CUDA error: {self._cuda_error} (sticky: the CUDA context is unusable)",
                gpu_index=self._index,
                operation=operation,
            )

    def synchronize(self) -> None:
        """Wait for queued work: a no-op (simulated work completes when it is run),
        unless a sticky CUDA error (:meth:`fail_cuda`) is raised again."""
        with self._lock:
            self._check("synchronize")
            self._check_cuda("synchronize")

    # --------------------------------------------------------------- workload
    def _noisy(self, value: float) -> float:
        if self.noise_std == 0.0:
            return value
        return value * max(0.05, 1.0 + self._rng.gauss(0.0, self.noise_std))

    def _plan_work(
        self, operation: str, t0_s: float, phases: Sequence[Phase]
    ) -> tuple[float, float]:
        """Settle idle time, run this work's phases under the settings in force and return
        its ``(duration_s, power_w)``."""
        problems = []
        if not t0_s >= 0:
            problems.append(f"t0_s: {t0_s!r} is not allowed; use >= 0")
        problems.extend(phase_problems(phases))
        if problems:
            raise ConfigError(problems, source=operation)
        self._check(operation)
        self._check_cuda(operation)
        self._settle()
        limit_w, locked = self._effective_settings(self.clock.now())
        enforced_w = self._enforced(limit_w)
        max_clock = locked[1] if locked is not None else None
        if self._governor is not None:
            run = self._governor.run(
                self.clock.now(), t0_s, phases, enforced_w, max_clock, self.slowdown
            )
            self._work_clock_mhz = run.clock_mhz
            self._power_capped, self._clock_held = run.power_capped, run.lock_held
            self._thermal_slowdown = run.thermal_slowdown
            return self._noisy(run.duration_s), self._noisy(run.power_w)
        duration_s, power_w = self._static_work(t0_s, phases, enforced_w, max_clock)
        return self._noisy(duration_s * self.slowdown), self._noisy(power_w)

    def _static_work(
        self, t0_s: float, phases: Sequence[Phase], limit_w: float, max_clock: int | None
    ) -> tuple[float, float]:
        """``(duration_s, power_w)`` of work on a model without a governor (traces and
        calibrations): each phase at the model's one answer for it, a blocked phase at
        idle power; sets the clock and the clock event reasons of the last phase."""
        model = self.model
        clock_for = getattr(model, "clock_for", None)
        duration_s = energy_j = 0.0
        capped = held = False
        clock: int | None = None
        for phase in phases:
            phase_t0_s, beta = phase.share * t0_s, phase.compute_bound_share
            if phase.blocked:
                duration_s += phase_t0_s
                energy_j += phase_t0_s * model.idle_power_w
                continue
            phase_s, phase_w = model.run(phase_t0_s, beta, limit_w, max_clock)
            unlimited_s, _ = model.run(phase_t0_s, beta, model.max_power_limit_w, max_clock)
            capped = capped or phase_s > unlimited_s
            if clock_for is not None:  # trace models have no clocks: a lock holds nothing back
                clock = clock_for(beta, limit_w, max_clock)
                held = held or clock < clock_for(beta, limit_w)
            duration_s += phase_s
            energy_j += phase_s * phase_w
        self._work_clock_mhz, self._power_capped, self._clock_held = clock, capped, held
        self._thermal_slowdown = False
        if duration_s > 0:
            return duration_s, energy_j / duration_s
        return 0.0, model.run(0.0, phases[0].compute_bound_share, limit_w, max_clock)[1]

    def _account_work(self, duration_s: float, power_w: float) -> None:
        self._energy_j += power_w * duration_s
        self._accounted_until_s += duration_s
        self._last_work_power_w = power_w
        self._record()

    def run_work(self, t0_s: float, compute_bound_share: float = 1.0) -> float:
        """Run a piece of work taking ``t0_s`` at the maximum clock (or highest limit).

        It runs at the locked clock if any, else the maximum clock, held back by the power
        limit through the governor (physics model: :mod:`.governor`), or slowed as the
        traced workload was at this power limit (trace model). The clock and the energy
        counter advance.

        Args:
            t0_s: the work's duration at the maximum SM clock / highest power limit.
            compute_bound_share: the share of ``t0_s`` that scales with the clock.

        Returns:
            The work's duration in seconds.
        """
        return self._run("run_work", t0_s, (Phase(1.0, compute_bound_share),))

    def run_phases(self, t0_s: float, phases: Sequence[Phase]) -> float:
        """Run a piece of work made of phases of different intensity, in order (GEMMs,
        elementwise kernels, waits in collectives...), as :meth:`run_work` runs one.

        Under a power limit the governor moves the clock with the phases; under a lock
        (and no binding limit) they take ``t0_s * (beta f_max / f + 1 - beta)`` with
        ``beta`` their :func:`~.physics.mean_compute_bound_share`. Models without a
        governor run each phase at their one answer for it and blocked phases at idle
        power.

        Args:
            t0_s: the work's duration at the maximum SM clock.
            phases: its phases, their shares adding up to 1.

        Returns:
            The work's duration in seconds.

        Raises:
            ConfigError: ``t0_s`` is negative or a phase is out of range.
        """
        return self._run("run_work", t0_s, tuple(phases))

    def _step(self) -> tuple[float, tuple[Phase, ...]]:
        """``(t0_s, phases)`` of one training step of the model's workload."""
        if isinstance(self.model, PhysicsModel):
            return self.model.step_time_s, self.model.step_shape()
        t0_s, beta = self.model.step_work()
        return t0_s, (Phase(1.0, beta),)

    def run_step(self, steps: int = 1) -> float:
        """Run ``steps`` training steps of the model's workload under the current settings
        (a physics preset's step phases, when it has them).

        Returns:
            Their total duration in seconds.
        """
        t0_s, phases = self._step()
        return sum(self._run("run_step", t0_s, phases) for _ in range(steps))

    def _run(self, operation: str, t0_s: float, phases: Sequence[Phase]) -> float:
        with self._lock:
            duration_s, power_w = self._plan_work(operation, t0_s, phases)
            self._account_work(duration_s, power_w)
        self.clock.advance(duration_s)
        return duration_s

    def idle(self, seconds: float) -> None:
        """Let ``seconds`` pass with nothing queued on the GPU (a carbon pause, data
        loading), drawing idle power."""
        with self._lock:
            self._check("idle")
        self.clock.advance(seconds)

    def wait_in_collective(self, seconds: float) -> None:
        """Wait ``seconds`` blocked in a collective (a P2P receive in a pipeline bubble, an
        all-reduce waiting for a slower rank).

        The GPU is not idle: NCCL's kernels spin until the peer arrives, at the clock the
        governor runs (the lock's upper end, or the maximum clock, unless the limit or the
        temperature holds it lower), drawing the physics model's blocked power at that
        clock (:meth:`~.physics.PhysicsModel.blocked_power_w`: more than idle, rising with
        the clock). Models without it (traces, calibrations) wait at idle power. As for
        work, a setting changed less than the board's latency before the wait starts does
        not govern it yet.

        Raises:
            ConfigError: ``seconds`` is negative.
        """
        if not seconds >= 0:
            raise ConfigError(f"seconds={seconds!r}: a wait lasts >= 0 s", source="wait")
        with self._lock:
            self._check("idle")
            governor = self._governor
            if governor is not None and seconds > 0:
                self._settle()
                limit_w, locked = self._effective_settings(self.clock.now())
                run = governor.run(
                    self.clock.now(),
                    seconds,
                    (Phase(1.0, 0.0, blocked=True),),
                    self._enforced(limit_w),
                    locked[1] if locked else None,
                )
                self._power_capped, self._clock_held = run.power_capped, run.lock_held
                self._thermal_slowdown = run.thermal_slowdown
                self._work_clock_mhz = run.clock_mhz
                self._account_work(run.duration_s, self._noisy(run.power_w))
        self.clock.advance(seconds)

    def now_s(self) -> float:
        """The virtual clock's time."""
        return self.clock.now()

    def lease_source(self) -> LeaseSource:
        """Rebuilt from its shipped model and its state file; without a state file its
        settings live and die with this process."""
        # A physics preset and a trace may model the same board: look among the model's kind.
        if isinstance(self.model, PhysicsModel):
            names = {model.name: key for key, model in PHYSICS_PRESETS.items()}
        else:
            names = {gpu_name: key for key, (_file, gpu_name, _idle) in TRACE_GPUS.items()}
        state_path = None if self.state_path is None else str(self.state_path.absolute())
        return LeaseSource(
            "simulated",
            persistent=state_path is not None,
            simulated_gpu=names.get(self.model.name),
            state_path=state_path,
        )

    # ------------------------------------------------------------ persistence
    def _load_state(self, path: Path) -> None:
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            uuid = state["uuid"]
            limit_w = state["power_limit_w"]
            locked = state["locked_clocks_mhz"]
            if not is_finite(limit_w):
                raise ValueError(f"power_limit_w {str(limit_w)[:40]} is not a finite number")
            if locked is not None and not (
                isinstance(locked, list) and len(locked) == 2 and all(map(is_finite, locked))
            ):
                raise ValueError(f"locked_clocks_mhz {str(locked)[:40]} is not null or 2 clocks")
            locked_t = None if locked is None else (int(locked[0]), int(locked[1]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DriverError(
                f"simulated GPU state file {path} is unreadable or malformed: {exc}",
                gpu_index=self._index,
                operation="load_state",
            ) from exc
        if uuid != self._uuid:
            raise DriverError(
                f"simulated GPU state file {path} belongs to {uuid}, not {self._uuid}",
                gpu_index=self._index,
                operation="load_state",
            )
        self._power_limit_w = float(limit_w)
        self._locked = locked_t

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        state = {
            "uuid": self._uuid,
            "power_limit_w": self._power_limit_w,
            "locked_clocks_mhz": list(self._locked) if self._locked is not None else None,
        }
        write_atomically(self.state_path, json.dumps(state))


def run_in_parallel(gpus: Sequence[SimulatedGPU], steps: int = 1) -> float:
    """Run training steps on several GPUs at once, in lock-step (synchronous data parallel).

    Each step, every GPU runs its step; the shared clock advances by the slowest GPU's
    duration and the faster GPUs wait at idle power.

    Args:
        gpus: GPUs sharing one :class:`VirtualClock`.
        steps: how many steps.

    Returns:
        The total duration in seconds.

    Raises:
        ConfigError: the GPUs do not share one clock.
    """
    if not gpus:
        return 0.0
    clock = gpus[0].clock
    if any(gpu.clock is not clock for gpu in gpus):
        raise ConfigError("gpus: all GPUs run in parallel must share one VirtualClock")
    total_s = 0.0
    for _ in range(steps):
        longest_s = 0.0
        for gpu in gpus:
            t0_s, phases = gpu._step()
            with gpu._lock:
                duration_s, power_w = gpu._plan_work("run_step", t0_s, phases)
                gpu._account_work(duration_s, power_w)
            longest_s = max(longest_s, duration_s)
        clock.advance(longest_s)
        total_s += longest_s
    return total_s


def as_simulated(gpu: GPU) -> SimulatedGPU | None:
    """The simulated GPU ``gpu`` is, or None for a real one.

    Work timed on a simulated GPU is simulated (it advances the virtual clock); on a real
    GPU the work is the training step itself.
    """
    return gpu if isinstance(gpu, SimulatedGPU) else None


def live_simulated_gpus() -> list[SimulatedGPU]:
    """Every :class:`SimulatedGPU` still alive in this process (for leak checks)."""
    return list(_LIVE)


@contextlib.contextmanager
def track_simulated_gpus() -> Iterator[list[SimulatedGPU]]:
    """Collect every :class:`SimulatedGPU` constructed inside the block.

    The list holds strong references until the block ends, so a leak check can inspect
    GPUs that the code under test already dropped.

    Yields:
        The GPUs constructed so far, in order.
    """
    created: list[SimulatedGPU] = []
    _TRACKERS.append(created)
    try:
        yield created
    finally:
        _TRACKERS.remove(created)


@dataclass(frozen=True)
class SimulatedSpec:
    """What simulated GPUs to build.

    Attributes:
        gpu: a shipped trace (``"a40"``, ``"v100"``), the path of a Zeus-format CSV, or a
            physics preset (``"a100"``, ``"h100"``).
        workload: ``"dataset/network"`` of the trace to replay (default
            ``imagenet/resnet50`` when the trace has it, else its first workload). Trace
            GPUs only.
        batch_size: measured batch size to replay (default: the middle measured one).
        optimizer: which optimizer's measurements when several exist (default: the first).
        steps_per_epoch: trace GPUs: a step takes epoch time / this (None: the
            dataset's training set in batches, e.g. 10,010 for ImageNet at batch size 128:
            0.37 s a step on the A40).
        step_time_s: physics GPUs: duration of a step at the maximum clock.
        compute_bound_share: physics GPUs: compute-bound share of a step.
        step_phases: physics presets: the phases of a step, in order (work of different
            compute/memory intensity: under a power limit the governor moves the clock with
            them); not with ``compute_bound_share``.
        count: how many GPUs.
        first_index: index of the first GPU (DDP: the local rank).
        noise_std: relative Gaussian noise on work duration and power.
        seed: noise seed.
        slowdowns: per-GPU straggler factors (missing entries: 1.0).
        state_dir: directory of per-GPU state files ``<uuid>.json`` (None: in memory).
        uuid_prefix: uuids are ``<uuid_prefix>-<index>`` (default ``GPU-sim-<gpu>``).
        permission_denied: setters raise :class:`NoPermissionError`.
        supports_setting: when False, setters raise :class:`NotSupportedError`.
        energy_counter_period_s, power_average_s, instant_power, setting_latency_s,
        enforced_power_limit_w, foreign_clock_lock_mhz: how the board treats software
            (see :class:`Board`); None: the preset's (:data:`BOARDS`; an ideal board for
            CSV traces; the measured one for a calibration), no limiter and no foreign lock.
        calibration: the path of a calibration JSON written by
            ``benchmarks/gpu/calibrate.py``: simulate the measured GPU (see
            :mod:`.calibration`) instead of ``gpu``; ``step_time_s`` and
            ``compute_bound_share`` replace the measured step's when given.
    """

    gpu: str = "a40"
    workload: str | None = None
    batch_size: int | None = None
    optimizer: str | None = None
    steps_per_epoch: int | None = None
    step_time_s: float | None = None
    compute_bound_share: float | None = None
    step_phases: tuple[Phase, ...] | None = None
    count: int = 1
    first_index: int = 0
    noise_std: float = 0.0
    seed: int = 0
    slowdowns: tuple[float, ...] = ()
    state_dir: str | None = None
    uuid_prefix: str | None = None
    permission_denied: bool = False
    supports_setting: bool = True
    energy_counter_period_s: float | None = None
    power_average_s: float | None = None
    instant_power: bool | None = None
    setting_latency_s: float | None = None
    enforced_power_limit_w: float | None = None
    foreign_clock_lock_mhz: tuple[int, int] | None = None
    calibration: str | None = None

    def board(self) -> Board:
        """The board behaviour: the preset's (or the calibration's), with the fields given
        here replacing it."""
        if self.calibration is not None:
            measured = load_calibration(self.calibration)
            preset = Board(
                energy_counter_period_s=measured.energy_counter_period_s,
                power_average_s=1.0 if measured.instant_power else 0.0,
                instant_power=measured.instant_power,
                setting_latency_s=measured.setting_latency_s,
            )
        else:
            preset = BOARDS.get(self.gpu, Board())
        overrides = {
            key: getattr(self, key)
            for key in (
                "energy_counter_period_s",
                "power_average_s",
                "instant_power",
                "setting_latency_s",
                "enforced_power_limit_w",
                "foreign_clock_lock_mhz",
            )
            if getattr(self, key) is not None
        }
        return replace(preset, **overrides)

    def __post_init__(self) -> None:
        problems = []
        physics = self.gpu in PHYSICS_PRESETS or self.calibration is not None
        calibration_ok = True
        if self.calibration is not None:
            try:
                load_calibration(self.calibration)
            except ConfigError as exc:
                problems.extend(exc.problems)
                calibration_ok = False
        if self.count < 1:
            problems.append(f"count: {self.count!r} is not allowed; use >= 1")
        if self.first_index < 0:
            problems.append(f"first_index: {self.first_index!r} is not allowed; use >= 0")
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            problems.append(f"steps_per_epoch: {self.steps_per_epoch!r} is not allowed; use >= 1")
        if self.noise_std < 0:
            problems.append(f"noise_std: {self.noise_std!r} is not allowed; use >= 0")
        if len(self.slowdowns) > self.count or any(not s >= 1.0 for s in self.slowdowns):
            problems.append(
                f"slowdowns: {self.slowdowns!r} is not allowed; "
                f"use at most count={self.count} factors, each >= 1"
            )
        if calibration_ok:
            problems.extend(self.board().problems())
        if self.workload is not None and self.workload.count("/") != 1:
            problems.append(f"workload: {self.workload!r} is not allowed; use 'dataset/network'")
        if self.step_phases is not None and (not physics or self.calibration is not None):
            problems.append(
                f"step_phases: {self.step_phases!r} is not allowed; it only applies to "
                "physics presets"
            )
        elif self.step_phases is not None:
            problems.extend(f"step_{issue}" for issue in phase_problems(self.step_phases))
            if self.compute_bound_share is not None:
                problems.append(
                    "compute_bound_share: not allowed with step_phases (the share of phased "
                    "steps is their mean); give one of them"
                )
        trace_only = ("workload", "batch_size", "optimizer")
        physics_only = ("step_time_s", "compute_bound_share")
        for key in trace_only if physics else physics_only:
            if getattr(self, key) is not None:
                kind = (
                    "trace GPUs ('a40', 'v100', a CSV)"
                    if physics
                    else "physics presets and calibrations"
                )
                problems.append(
                    f"{key}: {getattr(self, key)!r} is not allowed; it only applies to {kind}"
                )
        if problems:
            raise ConfigError(problems, source="SimulatedSpec")

    @property
    def label(self) -> str:
        """Short name of the GPU kind (a path's file stem)."""
        if self.calibration is not None:
            return Path(self.calibration).stem
        if self.gpu in PHYSICS_PRESETS or self.gpu in TRACE_GPUS:
            return self.gpu
        return Path(self.gpu).stem

    def model(self) -> TraceModel | PhysicsModel | CalibratedModel:
        """Build the model every GPU of the spec shares.

        Raises:
            ConfigError: a physics step parameter is out of range, or the calibration file
                is missing or malformed.
            ProfileError: the trace is malformed or lacks the workload / batch size.
        """
        if self.calibration is not None:
            model = load_calibration(self.calibration).model
            return replace(
                model,
                step_time_s=model.step_time_s if self.step_time_s is None else self.step_time_s,
                step_compute_bound_share=(
                    model.step_compute_bound_share
                    if self.compute_bound_share is None
                    else self.compute_bound_share
                ),
            )
        if self.gpu in PHYSICS_PRESETS:
            return physics_preset(
                self.gpu,
                step_time_s=self.step_time_s,
                compute_bound_share=self.compute_bound_share,
                step_phases=self.step_phases,
            )
        trace = PowerTrace.load(self.gpu)
        workloads = trace.workloads()
        if self.workload is not None:
            dataset, network = self.workload.split("/")
        elif any(w[:2] == ("imagenet", "resnet50") for w in workloads):
            dataset, network = "imagenet", "resnet50"
        else:
            dataset, network = workloads[0][:2]
        batch_size = self.batch_size
        if batch_size is None:
            sizes = sorted(b for d, n, b in workloads if (d, n) == (dataset, network))
            batch_size = sizes[len(sizes) // 2] if sizes else 0
        workload = trace.workload(dataset, network, batch_size, self.optimizer)
        return TraceModel.from_trace(trace, workload, self.steps_per_epoch)


def simulated_gpus(spec: SimulatedSpec, *, clock: VirtualClock | None = None) -> list[SimulatedGPU]:
    """Build the simulated GPUs described by ``spec``, all on one virtual clock.

    Args:
        spec: what to build.
        clock: the clock to share (a new one by default).

    Returns:
        ``spec.count`` GPUs with indices ``first_index, first_index + 1, ...`` and uuids
        ``<uuid_prefix>-<index>``.

    Raises:
        ConfigError: a spec parameter is out of range.
        ProfileError: the trace is malformed or lacks the workload.
        DriverError: a state file is malformed.
    """
    model = spec.model()
    board = spec.board()
    clock = clock if clock is not None else VirtualClock()
    prefix = spec.uuid_prefix if spec.uuid_prefix is not None else f"GPU-sim-{spec.label}"
    gpus = []
    for i in range(spec.count):
        index = spec.first_index + i
        uuid = f"{prefix}-{index}"
        gpus.append(
            SimulatedGPU(
                model,
                index=index,
                uuid=uuid,
                clock=clock,
                slowdown=spec.slowdowns[i] if i < len(spec.slowdowns) else 1.0,
                noise_std=spec.noise_std,
                seed=spec.seed,
                permission_denied=spec.permission_denied,
                supports_setting=spec.supports_setting,
                state_path=Path(spec.state_dir) / f"{uuid}.json" if spec.state_dir else None,
                board=board,
            )
        )
    return gpus
