"""An in-memory stand-in for the ``pynvml`` module, for tests of the NVML backend.

It keeps the real module's calling conventions (milliwatts, millijoules, MHz, handles,
``NVMLError`` carrying the return code in ``value``) and records every setter call.

It can be as rude as real boards: with ``draw_mw`` set, a device draws that power on the
module's own clock (:meth:`FakeNVML.advance`, also its ``sleep``); its energy counter
moves only every ``energy_update_period_s`` and ``nvmlDeviceGetPowerUsage`` returns the
average over the last ``power_average_s`` (1 s on Ampere and Hopper), while the
instantaneous power field (``NVML_FI_DEV_POWER_INSTANT``) gives the draw now, or is
missing as on older drivers (which answer for that field with their own error code), in
the union member its ``valueType`` names, as the real ``nvmlFieldValue_t`` holds it. Each
counter update may come early or late (``energy_update_jitter_s``), as the updates of real
boards do. :meth:`FakeDevice.reload_driver` sends the energy counter back to 0.

A clock lock (``locked``: this process's or an administrator's ``nvidia-smi -lgc``) cannot
be read back; it shows only in the clock event reasons, and only while the GPU is
``busy``: an idle GPU reports ``GpuIdle`` (0x1) and nothing else, as NVML does. A ``lost``
GPU answers every call with ``GPU_IS_LOST`` (its handle is still listed by index), and
``nvmlDeviceGetHandleByUUID``, which initialises the GPUs it searches, fails the same way
when it meets a lost GPU before the one asked for. ``call_counts`` counts every call, and a
device's ``hooks`` run inside the calls they name (threads can be made to meet there).

With ``require_root`` set, the module answers the setters with ``NO_PERMISSION``, as NVML
answers a process without root or ``CAP_SYS_ADMIN``, except inside :meth:`FakeNVML.as_root`
on the calling thread (a privileged daemon sharing the driver, such as the fake zeusd).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import math
import random
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

ERROR_CODES = {
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_UNKNOWN": 999,
}


class NVMLError(Exception):
    """Mirrors ``pynvml.NVMLError``: ``value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        names = {v: k for k, v in ERROR_CODES.items()}
        return names.get(self.value, f"NVML error {self.value}")


# pynvml's valueType constants: each names the member of nvmlValue_t, in its order.
VALUE_TYPES = {
    "NVML_VALUE_TYPE_DOUBLE": 0,
    "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
    "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3,
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
    "NVML_VALUE_TYPE_SIGNED_INT": 5,
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": 6,
}
#: The functions that need root (or CAP_SYS_ADMIN).
SETTERS = frozenset(
    {
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceSetMemoryLockedClocks",
        "nvmlDeviceResetMemoryLockedClocks",
        "nvmlDeviceSetPersistenceMode",
    }
)
CLOCK_EVENT_GPU_IDLE = 0x1
CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING = 0x2


class NvmlValue(ctypes.Union):
    """``pynvml.c_nvmlValue_t``: one value, read through the member its type names (the
    others reinterpret the same bytes)."""

    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class NvmlFieldValue(ctypes.Structure):
    """``pynvml.c_nvmlFieldValue_t``: one field's answer, with its own return code."""

    _fields_ = [
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", NvmlValue),
    ]


@dataclass
class Process:
    pid: int
    usedGpuMemory: int = 0


@dataclass(frozen=True)
class PciInfo:
    """``pynvml.nvmlPciInfo_t``: the fields read here (``busId`` as NVML formats it)."""

    domain: int
    bus: int
    device: int
    busId: bytes  # pynvml's name


@dataclass
class FakeDevice:
    """One GPU (or MIG instance) as the fake driver holds it (vendor units)."""

    name: str = "NVIDIA A100-SXM4-40GB"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    min_limit_mw: int = 100_000
    max_limit_mw: int = 400_000
    default_limit_mw: int = 400_000
    limit_mw: int = 400_000
    enforced_limit_mw: int | None = None
    memory_clocks: tuple[int, ...] = (1215, 405)
    graphics_clocks: dict[int, tuple[int, ...]] = field(
        default_factory=lambda: {1215: (1410, 1395, 1005, 210), 405: (405, 210)}
    )
    locked: tuple[int, int] | None = None
    energy_mj: int | None = 123_456  # None: the counter is not supported (pre-Volta)
    power_mw: int = 250_500
    mig_mode: int | None = 0  # None: MIG not supported
    parent: FakeDevice | None = None  # set for MIG instances
    mig_instances: list[FakeDevice] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML code
    # function name -> called inside that call before it answers (threads can meet there)
    hooks: dict[str, Callable[[], object]] = field(default_factory=dict)
    # Reason bits reported while busy besides a lock's 0x2 (e.g. 0x4 software power cap).
    clock_event_reasons: int = 0
    busy: bool = False  # running work: idle GPUs report GpuIdle (0x1) only
    lost: bool = False  # fell off the bus: every call on it answers GPU_IS_LOST
    sm_clock_mhz: int = 1410  # the SM clock now when no lock holds it
    temperature_c: int = 45
    persistence_mode: int = 1
    mem_locked: tuple[int, int] | None = None
    pci_bus: int | None = None  # None: 0x10 plus the GPU's NVML index
    applications_clock_mhz: int = 1410
    default_applications_clock_mhz: int = 1410
    # "supported", "unsupported" (the field answers NOT_SUPPORTED), "unknown_field" (a
    # driver that does not know field 186: INVALID_ARGUMENT) or "function_not_found" (a
    # driver without nvmlDeviceGetFieldValues).
    instant_power: str = "supported"
    instant_power_value_type: int = VALUE_TYPES["NVML_VALUE_TYPE_UNSIGNED_INT"]
    draw_mw: float | None = None  # set: power and energy follow the module's clock
    energy_update_period_s: float = 0.0
    # Each update comes up to this much early or late (below half the period).
    energy_update_jitter_s: float = 0.0
    power_average_s: float = 0.0
    true_energy_mj: float = 0.0
    history: list[tuple[float, float]] = field(default_factory=list)

    def true_energy_at(self, t_s: float) -> float:
        """True energy (mJ) at ``t_s``, linear between the recorded points."""
        points = self.history
        if not points or t_s <= points[0][0]:
            return points[0][1] if points else self.true_energy_mj
        k = bisect.bisect_left(points, (t_s, -math.inf))  # the first point at or after t_s
        if k == len(points):
            return points[-1][1]
        (t0, e0), (t1, e1) = points[k - 1], points[k]
        return e0 if t1 == t0 else e0 + (e1 - e0) * (t_s - t0) / (t1 - t0)

    def last_update_s(self, t_s: float) -> float:
        """When the energy counter last moved at or before ``t_s``."""
        period = self.energy_update_period_s
        if period <= 0:
            return t_s
        jitter = self.energy_update_jitter_s

        def update(k: int) -> float:
            return k * period + jitter * (2.0 * random.Random(k).random() - 1.0)

        k = math.floor(t_s / period)
        return max(u for u in (update(k - 1), update(k), update(k + 1)) if u <= t_s)

    def reload_driver(self) -> None:
        """The driver reloads: the energy counter starts again from 0."""
        self.energy_mj = 0
        self.history = [(t, e - self.true_energy_mj) for t, e in self.history]
        self.true_energy_mj = 0.0


class FakeNVML(types.ModuleType):
    """The fake module: pynvml's functions plus what tests inspect or steer.

    Attributes:
        devices: the GPUs the fake driver sees.
        init_calls: ``nvmlInit`` calls so far.
        shutdown_calls: ``nvmlShutdown`` calls so far.
        calls: setter calls, e.g. ``("set_power_limit", uuid, milliwatts)``.
        init_error: an NVML code ``nvmlInit`` fails with (None: it succeeds).
        now_s: the module's clock, moved by :meth:`advance` (and ``sleep``).
        call_counts: how many times each NVML function was called.
        require_root: the setters answer ``NO_PERMISSION`` outside :meth:`as_root`.
    """

    NVMLError = NVMLError
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_FI_DEV_POWER_INSTANT = 186
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_FEATURE_ENABLED = 1

    def __init__(self, devices: list[FakeDevice]) -> None:
        super().__init__("pynvml")
        self.devices = devices
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[tuple[Any, ...]] = []
        self.init_error: int | None = None
        self.now_s = 0.0
        self.call_counts: Counter[str] = Counter()
        self.require_root = False
        self._root = threading.local()

    @contextlib.contextmanager
    def as_root(self) -> Iterator[None]:
        """Call the setters with root's privileges on this thread (a privileged daemon)."""
        self._root.depth = getattr(self._root, "depth", 0) + 1
        try:
            yield
        finally:
            self._root.depth -= 1

    @property
    def caller_is_root(self) -> bool:
        """Whether a setter called now on this thread is allowed."""
        return not self.require_root or getattr(self._root, "depth", 0) > 0

    def clock(self) -> float:
        """The module's clock in seconds."""
        return self.now_s

    def advance(self, seconds: float) -> None:
        """Move the clock: devices with ``draw_mw`` use energy, their counters tick."""
        start, end = self.now_s, self.now_s + seconds
        for device in self.devices:
            if device.draw_mw is None:
                continue
            if not device.history:
                device.true_energy_mj = float(device.energy_mj or 0)
                device.history.append((start, device.true_energy_mj))
            device.true_energy_mj += device.draw_mw * seconds
            device.history.append((end, device.true_energy_mj))
            if device.energy_mj is not None:  # None: no counter (pre-Volta)
                device.energy_mj = int(device.true_energy_at(device.last_update_s(end)))
            average = device.power_average_s
            if average > 0:
                since = max(end - average, device.history[0][0])
                if end > since:
                    used = device.true_energy_mj - device.true_energy_at(since)
                    device.power_mw = int(used / (end - since))
            else:
                device.power_mw = int(device.draw_mw)
        self.now_s = end

    sleep = advance


def make_module(devices: list[FakeDevice]) -> FakeNVML:
    """Build a fake ``pynvml`` module over ``devices``."""
    mod = FakeNVML(devices)
    state: dict[str, Any] = {"initialised": 0}
    for name, code in {**ERROR_CODES, **VALUE_TYPES}.items():
        setattr(mod, name, code)

    def check(fn: str, device: FakeDevice | None = None) -> None:
        mod.call_counts[fn] += 1
        if not state["initialised"]:
            raise NVMLError(ERROR_CODES["NVML_ERROR_UNINITIALIZED"])
        if device is not None and fn in device.hooks:
            device.hooks[fn]()
        if device is not None and device.lost:
            raise NVMLError(ERROR_CODES["NVML_ERROR_GPU_IS_LOST"])
        if device is not None and fn in device.errors:
            raise NVMLError(device.errors[fn])
        if fn in SETTERS and not mod.caller_is_root:
            raise NVMLError(ERROR_CODES["NVML_ERROR_NO_PERMISSION"])

    def nvmlInit() -> None:
        mod.init_calls += 1
        if mod.init_error is not None:
            raise NVMLError(mod.init_error)
        state["initialised"] += 1

    def nvmlShutdown() -> None:
        check("nvmlShutdown")
        mod.shutdown_calls += 1
        state["initialised"] -= 1

    def nvmlDeviceGetCount() -> int:
        check("nvmlDeviceGetCount")
        return len(devices)

    def nvmlDeviceGetHandleByIndex(i: int) -> FakeDevice:
        check("nvmlDeviceGetHandleByIndex")
        if not 0 <= i < len(devices):
            raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
        return devices[i]

    def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> FakeDevice:
        check("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        if not text.startswith(("GPU-", "MIG-")):
            raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
        for device in devices:  # initialising each GPU it meets, a lost one included
            if device.lost:
                raise NVMLError(ERROR_CODES["NVML_ERROR_GPU_IS_LOST"])
            for candidate in (device, *device.mig_instances):
                if candidate.uuid == text:
                    return candidate
        raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_FOUND"])

    def getter(fn: str, attr: str) -> Any:
        def get(handle: FakeDevice) -> Any:
            check(fn, handle)
            return getattr(handle, attr)

        get.__name__ = fn
        return get

    for fn, attr in {
        "nvmlDeviceGetName": "name",
        "nvmlDeviceGetUUID": "uuid",
        "nvmlDeviceGetPowerManagementDefaultLimit": "default_limit_mw",
        "nvmlDeviceGetPowerManagementLimit": "limit_mw",
        "nvmlDeviceGetPowerUsage": "power_mw",
    }.items():
        setattr(mod, fn, getter(fn, attr))

    def nvmlDeviceGetPowerManagementLimitConstraints(handle: FakeDevice) -> list[int]:
        check("nvmlDeviceGetPowerManagementLimitConstraints", handle)
        return [handle.min_limit_mw, handle.max_limit_mw]

    def nvmlDeviceGetEnforcedPowerLimit(handle: FakeDevice) -> int:
        check("nvmlDeviceGetEnforcedPowerLimit", handle)
        # The lowest of all limiters: a board or rack limiter, or the limit set.
        if handle.enforced_limit_mw is None:
            return handle.limit_mw
        return min(handle.enforced_limit_mw, handle.limit_mw)

    def nvmlDeviceSetPowerManagementLimit(handle: FakeDevice, limit_mw: int) -> None:
        check("nvmlDeviceSetPowerManagementLimit", handle)
        if not isinstance(limit_mw, int):
            raise TypeError("pynvml takes an integer number of milliwatts")
        if not handle.min_limit_mw <= limit_mw <= handle.max_limit_mw:
            raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
        mod.calls.append(("set_power_limit", handle.uuid, limit_mw))
        handle.limit_mw = limit_mw

    def nvmlDeviceGetSupportedMemoryClocks(handle: FakeDevice) -> list[int]:
        check("nvmlDeviceGetSupportedMemoryClocks", handle)
        return list(handle.memory_clocks)

    def nvmlDeviceGetSupportedGraphicsClocks(handle: FakeDevice, memory_mhz: int) -> list[int]:
        check("nvmlDeviceGetSupportedGraphicsClocks", handle)
        return list(handle.graphics_clocks[memory_mhz])

    def nvmlDeviceSetGpuLockedClocks(handle: FakeDevice, min_mhz: int, max_mhz: int) -> None:
        check("nvmlDeviceSetGpuLockedClocks", handle)
        mod.calls.append(("set_locked_clocks", handle.uuid, min_mhz, max_mhz))
        handle.locked = (min_mhz, max_mhz)

    def nvmlDeviceResetGpuLockedClocks(handle: FakeDevice) -> None:
        check("nvmlDeviceResetGpuLockedClocks", handle)
        mod.calls.append(("reset_locked_clocks", handle.uuid))
        handle.locked = None

    def nvmlDeviceSetMemoryLockedClocks(handle: FakeDevice, min_mhz: int, max_mhz: int) -> None:
        check("nvmlDeviceSetMemoryLockedClocks", handle)
        mod.calls.append(("set_mem_locked_clocks", handle.uuid, min_mhz, max_mhz))
        handle.mem_locked = (min_mhz, max_mhz)

    def nvmlDeviceResetMemoryLockedClocks(handle: FakeDevice) -> None:
        check("nvmlDeviceResetMemoryLockedClocks", handle)
        mod.calls.append(("reset_mem_locked_clocks", handle.uuid))
        handle.mem_locked = None

    def nvmlDeviceSetPersistenceMode(handle: FakeDevice, mode: int) -> None:
        check("nvmlDeviceSetPersistenceMode", handle)
        mod.calls.append(("set_persistence_mode", handle.uuid, mode))
        handle.persistence_mode = int(mode)

    def index_of(handle: FakeDevice) -> int:
        return next(i for i, d in enumerate(devices) if d is handle)

    def nvmlDeviceGetIndex(handle: FakeDevice) -> int:
        check("nvmlDeviceGetIndex", handle)
        if handle.parent is not None:
            raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
        return index_of(handle)

    def nvmlDeviceGetPciInfo(handle: FakeDevice) -> PciInfo:
        check("nvmlDeviceGetPciInfo", handle)
        physical = handle.parent or handle
        bus = physical.pci_bus if physical.pci_bus is not None else 0x10 + index_of(physical)
        return PciInfo(domain=0, bus=bus, device=0, busId=f"00000000:{bus:02X}:00.0".encode())

    def nvmlDeviceGetTotalEnergyConsumption(handle: FakeDevice) -> int:
        check("nvmlDeviceGetTotalEnergyConsumption", handle)
        if handle.energy_mj is None:
            raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_SUPPORTED"])
        return handle.energy_mj

    def nvmlDeviceGetCurrentClocksEventReasons(handle: FakeDevice) -> int:
        check("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if not handle.busy:
            return CLOCK_EVENT_GPU_IDLE
        held = CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING if handle.locked is not None else 0
        return handle.clock_event_reasons | held

    def nvmlDeviceGetClockInfo(handle: FakeDevice, clock_type: int) -> int:
        check("nvmlDeviceGetClockInfo", handle)
        if clock_type != mod.NVML_CLOCK_SM:
            raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
        return handle.sm_clock_mhz if handle.locked is None else handle.locked[1]

    def nvmlDeviceGetTemperature(handle: FakeDevice, sensor: int) -> int:
        check("nvmlDeviceGetTemperature", handle)
        if sensor != mod.NVML_TEMPERATURE_GPU:
            raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
        return handle.temperature_c

    def nvmlDeviceGetPersistenceMode(handle: FakeDevice) -> int:
        check("nvmlDeviceGetPersistenceMode", handle)
        return handle.persistence_mode

    def nvmlDeviceGetApplicationsClock(handle: FakeDevice, clock_type: int) -> int:
        check("nvmlDeviceGetApplicationsClock", handle)
        return handle.applications_clock_mhz

    def nvmlDeviceGetDefaultApplicationsClock(handle: FakeDevice, clock_type: int) -> int:
        check("nvmlDeviceGetDefaultApplicationsClock", handle)
        return handle.default_applications_clock_mhz

    def nvmlDeviceGetFieldValues(handle: FakeDevice, field_ids: list[int]) -> list[Any]:
        check("nvmlDeviceGetFieldValues", handle)
        if handle.instant_power == "function_not_found":
            raise NVMLError(ERROR_CODES["NVML_ERROR_FUNCTION_NOT_FOUND"])
        values = (NvmlFieldValue * len(field_ids))()
        draw = handle.draw_mw if handle.draw_mw is not None else handle.power_mw
        for value, field_id in zip(values, field_ids, strict=True):
            value.fieldId = field_id
            known = field_id == mod.NVML_FI_DEV_POWER_INSTANT
            if known and handle.instant_power == "supported":
                value.valueType = handle.instant_power_value_type
                member = NvmlValue._fields_[value.valueType][0]
                setattr(value.value, member, float(draw) if member == "dVal" else int(draw))
            elif known and handle.instant_power == "unsupported":
                value.nvmlReturn = ERROR_CODES["NVML_ERROR_NOT_SUPPORTED"]
            else:
                value.nvmlReturn = ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"]
        return list(values)

    def nvmlDeviceGetMigMode(handle: FakeDevice) -> list[int]:
        check("nvmlDeviceGetMigMode", handle)
        if handle.mig_mode is None:
            raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_SUPPORTED"])
        return [handle.mig_mode, handle.mig_mode]

    def nvmlDeviceIsMigDeviceHandle(handle: FakeDevice) -> int:
        check("nvmlDeviceIsMigDeviceHandle", handle)
        return int(handle.parent is not None)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: FakeDevice) -> FakeDevice:
        check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if handle.parent is None:
            raise NVMLError(ERROR_CODES["NVML_ERROR_INVALID_ARGUMENT"])
        return handle.parent

    def nvmlDeviceGetMaxMigDeviceCount(handle: FakeDevice) -> int:
        check("nvmlDeviceGetMaxMigDeviceCount", handle)
        if handle.mig_mode is None:
            raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_SUPPORTED"])
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(handle: FakeDevice, slot: int) -> FakeDevice:
        check("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if slot >= len(handle.mig_instances):
            raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_FOUND"])
        return handle.mig_instances[slot]

    def nvmlDeviceGetComputeRunningProcesses(handle: FakeDevice) -> list[Process]:
        check("nvmlDeviceGetComputeRunningProcesses", handle)
        return [Process(pid) for pid in handle.processes]

    for fn in list(locals().values()):
        if callable(fn) and getattr(fn, "__name__", "").startswith("nvml"):
            setattr(mod, fn.__name__, fn)
    return mod


def a100(index: int, **overrides: Any) -> FakeDevice:
    """A fake A100 with a deterministic UUID ``GPU-<index>aaaaaaa-...``."""
    fields: dict[str, Any] = {"uuid": f"GPU-{index}aaaaaaa-0000-0000-0000-00000000000{index}"}
    fields.update(overrides)
    return FakeDevice(**fields)
