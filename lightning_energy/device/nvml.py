"""Real NVIDIA GPUs through NVML (the ``pynvml`` module of the ``nvidia-ml-py`` distribution).

Units: NVML speaks milliwatts and millijoules; this module converts them to watts and
joules at each call and nothing else in the package sees them. Every ``pynvml.NVMLError``
becomes a typed :class:`~lightning_energy.errors.DeviceError` carrying the GPU index and the
operation (see :func:`translate_nvml_error`).

GPU selection follows ``CUDA_VISIBLE_DEVICES`` so that process-local index ``i`` is the GPU
that ``torch.device("cuda", i)`` uses: entries may be indices, GPU UUIDs (``GPU-...``,
unique prefixes accepted as CUDA does) or MIG instance UUIDs (``MIG-...``). Indices count in
CUDA's order, which is NVML's (PCI bus) order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or
when every GPU is the same model; otherwise CUDA is asked for the UUID of each
process-local GPU, and without CUDA the indices are refused (:class:`ConfigError`). UUIDs
are looked up with ``nvmlDeviceGetHandleByUUID``, then, when that fails (it answers
``GPU_IS_LOST`` if it meets a GPU that fell off the bus while searching), among the GPUs
that answer: a lost GPU elsewhere on the node does not stop the others being found.

MIG instances are observed, never changed: power and clock settings belong to the whole
physical GPU, shared with other instances, so their setters raise
:class:`~lightning_energy.errors.NotSupportedError`; their power and energy readings are
those of the physical GPU.

The cumulative energy counter (``nvmlDeviceGetTotalEnergyConsumption``) exists on Volta and
newer GPUs; it moves only every ~100 ms on many boards (:meth:`NVMLGPU.energy_counter_period_s`
measures it). Elsewhere energy is integrated from sampled power by a background thread named
``lightning-energy-power-sampler``, started on the first energy reading and stopped by
:meth:`NVMLGPU.close`. It samples the instantaneous power field
(``NVML_FI_DEV_POWER_INSTANT``) where the driver has it, because
``nvmlDeviceGetPowerUsage`` is a 1 s average on Ampere and Hopper; older drivers
(``FUNCTION_NOT_FOUND``, or an error code for the field itself: ``NOT_SUPPORTED``, or
``INVALID_ARGUMENT`` from a driver that does not know it) fall back to
``nvmlDeviceGetPowerUsage``. The field's value is read from the union member its
``valueType`` names, which differs between drivers.

NVML cannot read a clock lock back, so an administrator's ``nvidia-smi -lgc`` (or
application clocks set with ``-ac``) is found through its side effects:
:meth:`NVMLGPU.foreign_clock_setting` reports the applications-clocks-setting clock event
reason while this process holds no lock (NVML shows it only while work runs held back by
the lock), or application clocks away from their default.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

from lightning_energy.device.base import LeaseSource
from lightning_energy.device.cuda import (
    ORDER_VAR,
    CudaRuntime,
    TorchCuda,
    cuda_device_order,
    normalise_uuid,
)
from lightning_energy.errors import (
    ConfigError,
    DeviceError,
    DriverError,
    GPULostError,
    GPUNotFoundError,
    NoPermissionError,
    NotSupportedError,
)

__all__ = [
    "NVMLGPU",
    "NVMLSession",
    "PowerSampler",
    "nvml_gpus",
    "translate_nvml_error",
    "visible_gpu_count",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_HANDLE_OPERATIONS = frozenset({"get_handle"})
# pynvml names, with their values for versions of nvidia-ml-py that lack them.
_FIELD_POWER_INSTANT = ("NVML_FI_DEV_POWER_INSTANT", 186)
_FUNCTION_NOT_FOUND = ("NVML_ERROR_FUNCTION_NOT_FOUND", 13)
# The member of a field value's union that each value type names (nvmlValueType_t order).
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
_APPLICATIONS_CLOCKS_SETTING = 0x2  # nvmlClocksEventReasonApplicationsClocksSetting
_NVML_CLOCK_GRAPHICS = 0
# How long, and how often, energy_counter_period_s polls the counter.
_COUNTER_PROBE_S = 1.0
_COUNTER_PROBE_INTERVAL_S = 0.002
#: How long a synchronisation waits for a GPU's queued work before measuring without it.
SYNC_TIMEOUT_S = 120.0
# The period assumed when the counter does not move twice during the probe.
_DEFAULT_COUNTER_PERIOD_S = 0.1
# The counter period measured on each physical GPU (by UUID), for the life of the process.
_counter_periods_s: dict[str, float] = {}
_counter_periods_lock = threading.Lock()
_session_lock = threading.Lock()
_session_refs = 0


def _pynvml() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise DriverError(
            "the pynvml module is missing: install nvidia-ml-py", operation="import"
        ) from exc


def translate_nvml_error(
    exc: Exception, *, gpu_index: int | None = None, operation: str
) -> DeviceError:
    """The typed error for an NVML failure.

    ``NO_PERMISSION`` -> :class:`NoPermissionError`; ``NOT_SUPPORTED`` or
    ``FUNCTION_NOT_FOUND`` (a driver too old for the call) -> :class:`NotSupportedError`;
    ``GPU_IS_LOST`` -> :class:`GPULostError`; ``NOT_FOUND`` or
    ``INVALID_ARGUMENT`` while looking a GPU up -> :class:`GPUNotFoundError`; everything else
    (uninitialised, library or driver missing, ...) -> :class:`DriverError`.

    Args:
        exc: the ``pynvml.NVMLError`` (its ``value`` is the NVML return code).
        gpu_index: the process-local GPU index, when there is one.
        operation: what was being done (e.g. ``"set_power_limit"``).

    Returns:
        The exception to raise (chain it with ``from exc``).
    """
    nvml = _pynvml()
    code = getattr(exc, "value", None)
    message = f"NVML: {exc}"
    kind: type[DeviceError] = DriverError
    if code == nvml.NVML_ERROR_NO_PERMISSION:
        kind = NoPermissionError
        message += " (changing GPU settings needs root or CAP_SYS_ADMIN)"
    elif code in (nvml.NVML_ERROR_NOT_SUPPORTED, getattr(nvml, *_FUNCTION_NOT_FOUND)):
        kind = NotSupportedError
    elif code == nvml.NVML_ERROR_GPU_IS_LOST:
        kind = GPULostError
    elif operation in _HANDLE_OPERATIONS and code in (
        nvml.NVML_ERROR_NOT_FOUND,
        nvml.NVML_ERROR_INVALID_ARGUMENT,
    ):
        kind = GPUNotFoundError
    return kind(message, gpu_index=gpu_index, operation=operation)


def _call(operation: str, gpu_index: int | None, fn: Callable[..., T], *args: Any) -> T:
    nvml = _pynvml()
    try:
        return fn(*args)
    except nvml.NVMLError as exc:
        raise translate_nvml_error(exc, gpu_index=gpu_index, operation=operation) from exc


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NVMLSession:
    """A reference on the process-wide NVML initialisation.

    NVML is initialised by the first reference and shut down when the last is released;
    :class:`NVMLGPU` objects hold one each until closed. Usable as a context manager.

    Raises:
        DriverError: pynvml is missing or NVML fails to initialise (no driver, no library).
    """

    def __init__(self) -> None:
        global _session_refs
        nvml = _pynvml()
        with _session_lock:
            if _session_refs == 0:
                _call("init", None, nvml.nvmlInit)
            _session_refs += 1
        self._open = True

    def release(self) -> None:
        """Drop this reference (idempotent); the last one shuts NVML down."""
        global _session_refs
        with _session_lock:
            if not self._open:
                return
            self._open = False
            _session_refs -= 1
            if _session_refs == 0:
                nvml = _pynvml()
                try:
                    nvml.nvmlShutdown()
                except nvml.NVMLError as exc:
                    logger.debug("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> NVMLSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class PowerSampler:
    """Integrates sampled power into energy for GPUs without an energy counter.

    Each sample charges the previous reading for the time since it (a step function), and
    :meth:`energy_j` adds the latest reading times the time since it.

    Args:
        read_power_w: reads the current power draw in watts.
        interval_s: seconds between samples of the background thread.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        read_power_w: Callable[[], float],
        interval_s: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._read_power_w = read_power_w
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._energy_j = 0.0
        self._last: tuple[float, float] | None = None
        self._error: DeviceError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Take one sample now (the background thread calls this every interval)."""
        power_w = self._read_power_w()
        now = self._clock()
        with self._lock:
            if self._last is not None:
                last_t, last_p = self._last
                self._energy_j += last_p * (now - last_t)
            self._last = (now, power_w)

    def energy_j(self) -> float:
        """Energy since the first sample.

        Raises:
            DeviceError: the background thread's last sample failed.
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._last is None:
                return 0.0
            last_t, last_p = self._last
            return self._energy_j + last_p * (self._clock() - last_t)

    @property
    def running(self) -> bool:
        """Whether the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Take a first sample and start the background thread (idempotent)."""
        if self._thread is not None:
            return
        self.sample()
        self._thread = threading.Thread(
            target=self._run, name="lightning-energy-power-sampler", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sample()
            except DeviceError as exc:
                with self._lock:
                    self._error = exc
                return

    def stop(self) -> None:
        """Stop the background thread and wait for it (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class NVMLGPU:
    """A real NVIDIA GPU (or MIG instance) driven through NVML.

    Build them with :func:`nvml_gpus`. Call :meth:`close` when done (or use ``with``).

    Args:
        handle: the NVML device handle.
        index: the process-local index.
        power_sample_interval_s: sampling period of the fallback energy integration.
        clock: monotonic seconds (probing the energy counter's period).
        sleep: waits that many seconds (probing the energy counter's period).
        sync_timeout_s: how long :meth:`synchronize` waits for the GPU's queued work.
    """

    def __init__(
        self,
        handle: object,
        index: int,
        *,
        power_sample_interval_s: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
    ) -> None:
        self._session = NVMLSession()
        self._nvml = _pynvml()
        self._handle = handle
        self._index = index
        self._power_sample_interval_s = power_sample_interval_s
        self._sampler: PowerSampler | None = None
        self._sampler_lock = threading.Lock()  # one sampler, however many threads read
        self._closed = False
        self._locked: tuple[int, int] | None = None
        self._clocks: list[int] | None = None
        self._synchronize: Callable[[], None] | None = None
        self._sync_timeout_s = sync_timeout_s
        self._clock = clock
        self._sleep = sleep
        self._counter_period_s: float | None = None
        self._instant_power: bool | None = None  # None: not tried yet
        try:
            nvml = self._nvml
            try:
                self._name = _text(self._get("get_name", nvml.nvmlDeviceGetName, handle))
                self._uuid = _text(self._get("get_uuid", nvml.nvmlDeviceGetUUID, handle))
                self._is_mig, self._physical = self._mig_info()
                self._physical_uuid = (
                    self._uuid
                    if self._physical is handle
                    else _text(self._get("get_uuid", nvml.nvmlDeviceGetUUID, self._physical))
                )
            except GPULostError:
                # Fell off the bus before the job: it keeps an identity of its own, every
                # later call raises GPULostError, and the job observes (missing readings).
                self._name = "NVIDIA GPU (lost)"
                self._uuid = self._physical_uuid = f"GPU-lost-{index}"
                self._is_mig, self._physical = False, handle
        except BaseException:
            self._session.release()
            raise

    def _get(self, operation: str, fn: Callable[..., T], *args: Any) -> T:
        return _call(operation, self._index, fn, *args)

    def _mig_info(self) -> tuple[bool, object]:
        """``(is_mig, handle of the physical GPU)``; GPUs or drivers without MIG: not MIG."""
        nvml = self._nvml
        try:
            is_instance = self._get("is_mig_handle", nvml.nvmlDeviceIsMigDeviceHandle, self._handle)
        except (NotSupportedError, DriverError):
            is_instance = False
        if is_instance:
            parent = self._get(
                "get_parent_handle", nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, self._handle
            )
            return True, parent
        try:
            current, _pending = self._get("get_mig_mode", nvml.nvmlDeviceGetMigMode, self._handle)
        except (NotSupportedError, DriverError):
            return False, self._handle
        return current == nvml.NVML_DEVICE_MIG_ENABLE, self._handle

    def __repr__(self) -> str:
        return f"NVMLGPU(index={self._index}, name={self._name!r}, uuid={self._uuid!r})"

    @property
    def index(self) -> int:
        """The process-local index (after ``CUDA_VISIBLE_DEVICES``)."""
        return self._index

    @property
    def name(self) -> str:
        """The product name NVML reports."""
        return self._name

    @property
    def uuid(self) -> str:
        """The GPU's (or MIG instance's) UUID."""
        return self._uuid

    @property
    def is_mig(self) -> bool:
        """True for a MIG instance or a GPU in MIG mode: observe-only."""
        return self._is_mig

    @property
    def physical_uuid(self) -> str:
        """The UUID of the physical GPU: a MIG instance's parent, else :attr:`uuid`."""
        return self._physical_uuid

    def nvml_index(self) -> int:
        """The physical GPU's index in NVML's numbering of every GPU of the node (PCI bus
        order, whatever ``CUDA_VISIBLE_DEVICES`` says)."""
        return int(self._get("get_index", self._nvml.nvmlDeviceGetIndex, self._physical))

    def pci_address(self) -> str:
        """The physical GPU's PCI address as ``lspci -D`` prints it
        (``domain:bus:device.function``, lower-case hexadecimal)."""
        pci = self._get("get_pci_info", self._nvml.nvmlDeviceGetPciInfo, self._physical)
        return f"{int(pci.domain):04x}:{int(pci.bus):02x}:{int(pci.device):02x}.0"

    def _check_settable(self, operation: str) -> None:
        if self._is_mig:
            raise NotSupportedError(
                "MIG is observe-only: power and clock settings belong to the whole physical "
                "GPU, which other MIG instances share",
                gpu_index=self._index,
                operation=operation,
            )

    def power_limit_constraints_w(self) -> tuple[float, float]:
        """The (min, max) power limit the driver accepts, in watts."""
        lo_mw, hi_mw = self._get(
            "power_limit_constraints",
            self._nvml.nvmlDeviceGetPowerManagementLimitConstraints,
            self._physical,
        )
        return lo_mw / 1000.0, hi_mw / 1000.0

    def default_power_limit_w(self) -> float:
        """The vendor default power limit in watts."""
        nvml = self._nvml
        mw = self._get(
            "default_power_limit", nvml.nvmlDeviceGetPowerManagementDefaultLimit, self._physical
        )
        return float(mw) / 1000.0

    def power_limit_w(self) -> float:
        """The power management limit currently set, in watts."""
        nvml = self._nvml
        mw = self._get("power_limit", nvml.nvmlDeviceGetPowerManagementLimit, self._physical)
        return float(mw) / 1000.0

    def enforced_power_limit_w(self) -> float:
        """The limit actually enforced (lowest of all limiters), in watts."""
        nvml = self._nvml
        mw = self._get("enforced_power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit, self._physical)
        return float(mw) / 1000.0

    def set_power_limit_w(self, power_limit_w: float) -> None:
        """Set the power management limit.

        Raises:
            NotSupportedError: a MIG instance, or the GPU does not support it.
            NoPermissionError: the process lacks root / CAP_SYS_ADMIN.
            DriverError: the limit is outside :meth:`power_limit_constraints_w`.
        """
        self._check_settable("set_power_limit")
        lo, hi = self.power_limit_constraints_w()
        if not lo <= power_limit_w <= hi:
            raise DriverError(
                f"power limit {power_limit_w} W is outside the supported range [{lo}, {hi}] W",
                gpu_index=self._index,
                operation="set_power_limit",
            )
        self._write_power_limit_mw(round(power_limit_w * 1000.0))

    def _write_power_limit_mw(self, power_limit_mw: int) -> None:
        """Apply a checked power limit (the one place a limit is written)."""
        self._get(
            "set_power_limit",
            self._nvml.nvmlDeviceSetPowerManagementLimit,
            self._handle,
            power_limit_mw,
        )

    def supported_sm_clocks_mhz(self) -> list[int]:
        """Supported graphics clocks at the highest memory clock, descending (cached)."""
        if self._clocks is None:
            nvml = self._nvml
            memory = self._get(
                "supported_clocks", nvml.nvmlDeviceGetSupportedMemoryClocks, self._physical
            )
            graphics = self._get(
                "supported_clocks",
                nvml.nvmlDeviceGetSupportedGraphicsClocks,
                self._physical,
                max(memory),
            )
            self._clocks = sorted({int(f) for f in graphics}, reverse=True)
        return list(self._clocks)

    def set_locked_clocks_mhz(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into ``[min_mhz, max_mhz]``.

        Raises:
            NotSupportedError: a MIG instance, or a GPU older than Volta.
            NoPermissionError: the process lacks root / CAP_SYS_ADMIN.
        """
        self._check_settable("set_locked_clocks")
        self._write_locked_clocks_mhz(int(min_mhz), int(max_mhz))
        self._locked = (int(min_mhz), int(max_mhz))

    def _write_locked_clocks_mhz(self, min_mhz: int, max_mhz: int) -> None:
        """Apply an SM clock lock (the one place a lock is written)."""
        self._get(
            "set_locked_clocks",
            self._nvml.nvmlDeviceSetGpuLockedClocks,
            self._handle,
            min_mhz,
            max_mhz,
        )

    def reset_locked_clocks(self) -> None:
        """Release any SM clock lock.

        Raises:
            NotSupportedError: a MIG instance, or a GPU older than Volta.
            NoPermissionError: the process lacks root / CAP_SYS_ADMIN.
        """
        self._check_settable("reset_locked_clocks")
        self._write_reset_locked_clocks()
        self._locked = None

    def _write_reset_locked_clocks(self) -> None:
        """Release the SM clock lock (the one place a lock is released)."""
        self._get("reset_locked_clocks", self._nvml.nvmlDeviceResetGpuLockedClocks, self._handle)

    def locked_clocks_mhz(self) -> tuple[int, int] | None:
        """The clock lock this process set, or None (NVML cannot read a lock back)."""
        return self._locked

    def foreign_clock_setting(self) -> str | None:
        """Why the SM clocks are under a setting this process did not make, or None.

        NVML cannot read a clock lock back; an administrator's lock (``nvidia-smi -lgc``)
        shows as the applications-clocks-setting clock event reason, and only while work
        runs under it (an idle GPU reports ``GpuIdle`` alone), and application clocks
        (``-ac``) as a graphics application clock away from its default. The application
        clocks are read once (they do not follow the load), so every later call costs one
        NVML call. Drivers that report neither are taken to have no foreign setting.
        """
        if self._locked is None:
            try:
                reasons = self.clock_event_reasons()
            except NotSupportedError:
                reasons = 0
            if reasons & _APPLICATIONS_CLOCKS_SETTING:
                return (
                    "its clocks are limited by a clock setting this job did not make (the "
                    "applications-clocks-setting clock event reason: an administrator's "
                    "`nvidia-smi -lgc` or `-ac`)"
                )
        return self._applications_clock_setting

    @functools.cached_property
    def _applications_clock_setting(self) -> str | None:
        """Why the graphics application clock is away from its default (``-ac``), or None."""
        nvml = self._nvml
        read = functools.partial(self._get, "applications_clock")
        graphics = (self._physical, _NVML_CLOCK_GRAPHICS)
        try:
            current = int(read(nvml.nvmlDeviceGetApplicationsClock, *graphics))
            default = int(read(nvml.nvmlDeviceGetDefaultApplicationsClock, *graphics))
        except NotSupportedError:
            return None
        if current != default:
            return (
                f"its graphics application clock is {current} MHz, not the default "
                f"{default} MHz (an administrator's `nvidia-smi -ac`)"
            )
        return None

    def sm_clock_mhz(self) -> int:
        """The SM clock now (``nvmlDeviceGetClockInfo``), in MHz."""
        nvml = self._nvml
        sm = getattr(nvml, "NVML_CLOCK_SM", 1)
        return int(self._get("clock", nvml.nvmlDeviceGetClockInfo, self._physical, sm))

    def temperature_c(self) -> float:
        """The GPU core temperature now, in degrees Celsius."""
        nvml = self._nvml
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        return float(
            self._get("temperature", nvml.nvmlDeviceGetTemperature, self._physical, sensor)
        )

    def clock_event_reasons(self) -> int:
        """NVML clock event (throttle) reason bits now.

        Raises:
            NotSupportedError: this pynvml or driver reports none.
        """
        nvml = self._nvml
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        if reasons_fn is None:
            raise NotSupportedError(
                "this pynvml has no clock event reasons",
                gpu_index=self._index,
                operation="clock_event_reasons",
            )
        return int(self._get("clock_event_reasons", reasons_fn, self._physical))

    def persistence_mode(self) -> bool:
        """Whether persistence mode is on (the driver keeps settings between processes)."""
        nvml = self._nvml
        mode = self._get("persistence_mode", nvml.nvmlDeviceGetPersistenceMode, self._physical)
        return int(mode) == int(getattr(nvml, "NVML_FEATURE_ENABLED", 1))

    def power_w(self) -> float:
        """Board power in watts as ``nvmlDeviceGetPowerUsage`` reports it: a 1 s average on
        Ampere and Hopper (the physical GPU's for a MIG instance)."""
        mw = self._get("power", self._nvml.nvmlDeviceGetPowerUsage, self._physical)
        return float(mw) / 1000.0

    def instant_power_w(self) -> float:
        """The power drawn now, from the ``NVML_FI_DEV_POWER_INSTANT`` field.

        Raises:
            NotSupportedError: the driver lacks ``nvmlDeviceGetFieldValues``
                (``FUNCTION_NOT_FOUND``), or answers for the field with an error code
                (``NOT_SUPPORTED``, ``INVALID_ARGUMENT`` for a field it does not know...)
                or a value type this package does not read.
            GPULostError: the GPU fell off the bus.
        """
        nvml = self._nvml
        get_fields = getattr(nvml, "nvmlDeviceGetFieldValues", None)
        if get_fields is None:
            raise NotSupportedError(
                "this pynvml has no nvmlDeviceGetFieldValues",
                gpu_index=self._index,
                operation="instant_power",
            )
        field = getattr(nvml, *_FIELD_POWER_INSTANT)
        (value,) = self._get("instant_power", get_fields, self._physical, [field])
        code, kind = int(value.nvmlReturn), int(value.valueType)
        if code == nvml.NVML_ERROR_GPU_IS_LOST:
            raise translate_nvml_error(
                nvml.NVMLError(code), gpu_index=self._index, operation="instant_power"
            )
        if code != 0 or not 0 <= kind < len(_VALUE_MEMBERS):
            # A driver that does not know the field answers for it with its own code
            # (NOT_SUPPORTED, or INVALID_ARGUMENT on older drivers).
            why = nvml.NVMLError(code) if code != 0 else f"value type {kind}"
            raise NotSupportedError(
                f"the driver does not give field {field} ({why})",
                gpu_index=self._index,
                operation="instant_power",
            )
        # Milliwatts, in the union member its value type names (drivers differ).
        return float(getattr(value.value, _VALUE_MEMBERS[kind])) / 1000.0

    def _sample_power_w(self) -> float:
        """Power for the energy integration: instantaneous where the driver has it."""
        if self._instant_power is not False:
            try:
                power_w = self.instant_power_w()
            except NotSupportedError as exc:
                self._instant_power = False
                logger.info(
                    "GPU %d (%s) has no instantaneous power field (%s): integrating "
                    "nvmlDeviceGetPowerUsage, a 1 s average on Ampere and newer.",
                    self._index,
                    self._name,
                    exc,
                )
            else:
                self._instant_power = True
                return power_w
        return self.power_w()

    def energy_counter_period_s(self) -> float:
        """How often the energy counter moves, measured by polling it (once per GPU).

        The counter is polled every 2 ms for about 1 s; the period is the median interval
        between two changes, so an update that comes early or late does not decide it. The
        measurement is kept for the physical GPU for the life of the process: opening the
        GPU again (another fit, a MIG instance of it) does not poll again. If the counter
        does not change twice (a slow counter), 0.1 s is assumed, and polled again on the
        next opening. GPUs without a counter integrate sampled power: their period is the
        sampling interval.
        """
        if self._counter_period_s is None:
            with _counter_periods_lock:
                known_s = _counter_periods_s.get(self._physical_uuid)
            if known_s is None:
                known_s = self._probe_counter_period_s()
            self._counter_period_s = known_s
        return self._counter_period_s

    def _probe_counter_period_s(self) -> float:
        read = self._nvml.nvmlDeviceGetTotalEnergyConsumption
        try:
            last = self._get("energy", read, self._physical)
        except NotSupportedError:
            return self._power_sample_interval_s
        changes: list[float] = []
        start = self._clock()
        while self._clock() - start < _COUNTER_PROBE_S:
            self._sleep(_COUNTER_PROBE_INTERVAL_S)
            value = self._get("energy", read, self._physical)
            if value != last:
                changes.append(self._clock())
                last = value
        if len(changes) < 2:
            logger.debug(
                "GPU %d: the energy counter did not move twice in %.2f s; assuming it moves "
                "every %.2f s.",
                self._index,
                _COUNTER_PROBE_S,
                _DEFAULT_COUNTER_PERIOD_S,
            )
            return _DEFAULT_COUNTER_PERIOD_S
        period_s = statistics.median(b - a for a, b in itertools.pairwise(changes))
        with _counter_periods_lock:
            _counter_periods_s[self._physical_uuid] = period_s
        return period_s

    def energy_j(self) -> float:
        """Cumulative energy in joules: the hardware counter, or sampled power where the GPU
        has none (pre-Volta)."""
        sampler = self._sampler
        if sampler is None:
            try:
                mj = self._get(
                    "energy", self._nvml.nvmlDeviceGetTotalEnergyConsumption, self._physical
                )
            except NotSupportedError:
                sampler = self._power_sampler()
            else:
                return float(mj) / 1000.0
        return sampler.energy_j()

    def _power_sampler(self) -> PowerSampler:
        """The power sampler, started by the first thread that needs it."""
        with self._sampler_lock:
            if self._sampler is None:
                if self._closed:
                    raise DriverError(
                        "the GPU was closed", gpu_index=self._index, operation="energy"
                    )
                logger.info(
                    "GPU %d (%s) has no energy counter: integrating sampled power instead.",
                    self._index,
                    self._name,
                )
                sampler = PowerSampler(self._sample_power_w, self._power_sample_interval_s)
                sampler.start()
                self._sampler = sampler
            return self._sampler

    def synchronize(self) -> None:
        """Wait for queued CUDA work on this GPU (no-op without CUDA in torch), at most
        ``sync_timeout_s``: a stream stalled in a collective whose peer is gone never
        advances, and a measurement (at teardown too) must not wait for it forever.

        Raises:
            DriverError: the work did not finish in time (the wait goes on in a daemon
                thread, and the caller measures without it), or CUDA failed (a sticky
                error: every later CUDA call fails too).
        """
        if self._synchronize is None:
            self._synchronize = _cuda_synchronizer(self._index)
        done = threading.Event()
        failed: list[BaseException] = []
        synchronize = self._synchronize

        def wait() -> None:
            try:
                synchronize()
            except BaseException as exc:  # handed to the caller below
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait, name="lightning-energy-cuda-sync", daemon=True).start()
        if not done.wait(self._sync_timeout_s):
            raise DriverError(
                f"GPU {self._index} did not finish its queued work within "
                f"{self._sync_timeout_s:g} s (a collective whose peer is gone?): measured "
                "without waiting for it",
                gpu_index=self._index,
                operation="synchronize",
            )
        if failed:
            raise DriverError(
                f"CUDA: {failed[0]}", gpu_index=self._index, operation="synchronize"
            ) from failed[0]

    def now_s(self) -> float:
        """``time.perf_counter``: a real GPU's work takes wall-clock time."""
        return time.perf_counter()

    def idle(self, seconds: float) -> None:
        """Sleep ``seconds``."""
        time.sleep(seconds)

    def lease_source(self) -> LeaseSource:
        """Re-opened through NVML by its UUID."""
        return LeaseSource("nvml")

    def running_process_ids(self) -> list[int]:
        """Process ids with compute work on this GPU (any user's, as NVML reports)."""
        nvml = self._nvml
        processes = self._get(
            "running_processes", nvml.nvmlDeviceGetComputeRunningProcesses, self._handle
        )
        return [int(p.pid) for p in processes]

    def close(self) -> None:
        """Stop the power sampler, if any, and release NVML (idempotent)."""
        with self._sampler_lock:
            self._closed = True
            sampler = self._sampler
        if sampler is not None:
            sampler.stop()
        self._session.release()

    def __enter__(self) -> NVMLGPU:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _cuda_synchronizer(index: int) -> Callable[[], None]:
    try:
        import torch
    except ImportError:
        return lambda: None
    if not torch.cuda.is_available():
        return lambda: None
    device = torch.device("cuda", index)
    return lambda: torch.cuda.synchronize(device)


def _visible(nvml: ModuleType) -> list[int | object]:
    """What ``CUDA_VISIBLE_DEVICES`` names, in process-local order: an ``int`` is an index
    into CUDA's numbering of every GPU, anything else the NVML handle a UUID entry names.

    As CUDA does, the first entry that names no GPU (``-1``, an index out of range, an
    unknown or ambiguous UUID) ends the list. Without the variable every GPU is visible.
    """
    count = _call("get_count", None, nvml.nvmlDeviceGetCount)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    named: list[int | object] = []
    for entry in (e.strip() for e in visible.split(",")):
        item: int | object | None
        if entry.lstrip("-").isdigit():
            item = int(entry) if 0 <= int(entry) < count else None
        else:
            item = _handle_by_uuid(nvml, entry, len(named))
        if item is None:
            if entry != "-1":
                logger.info(
                    "CUDA_VISIBLE_DEVICES entry %r names no GPU: it and later entries are "
                    "ignored, as CUDA does.",
                    entry,
                )
            break
        named.append(item)
    return named


def _visible_handles(nvml: ModuleType, cuda: CudaRuntime | None = None) -> list[object]:
    """NVML handles of the GPUs CUDA lets this process see, in process-local order.

    Index entries of ``CUDA_VISIBLE_DEVICES`` (and process-local indices without it) count
    in CUDA's order, which is NVML's (PCI bus) order only under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or on GPUs that are all one model. Otherwise CUDA is
    asked for the UUID of each process-local GPU.

    Args:
        nvml: the pynvml module.
        cuda: the CUDA side (default :class:`~lightning_energy.device.cuda.TorchCuda`).

    Raises:
        ConfigError: CUDA may number the GPUs differently from NVML and is not available to
            say how.
    """
    named = _visible(nvml)
    if not any(isinstance(item, int) for item in named):
        return named
    models = _models(nvml)
    if cuda_device_order() == "PCI_BUS_ID" or len(models) <= 1:
        return [
            _call("get_handle", local, nvml.nvmlDeviceGetHandleByIndex, item)
            if isinstance(item, int)
            else item
            for local, item in enumerate(named)
        ]
    runtime = cuda if cuda is not None else TorchCuda()
    if not runtime.is_available():
        raise ConfigError(
            f"{ORDER_VAR}={cuda_device_order()!r} with different GPU models {sorted(models)}: "
            "CUDA numbers them fastest first, NVML by PCI bus, and CUDA is not available to "
            f"tell which GPU a process-local index is; set {ORDER_VAR}=PCI_BUS_ID, or pass "
            "the framework's CUDA device",
            source=f"env {ORDER_VAR}",
        )
    handles: list[object] = []
    for local in range(runtime.device_count()):
        uuid = runtime.uuid(local)
        handle = _handle_for_cuda_uuid(nvml, uuid, local)
        if handle is None:
            raise GPUNotFoundError(
                f"CUDA's GPU {local} has UUID {uuid!r}, which no NVML GPU that answers has",
                gpu_index=local,
                operation="get_handle",
            )
        handles.append(handle)
    return handles


def _models(nvml: ModuleType) -> set[str]:
    """The model names of every GPU NVML lists (a GPU that fell off the bus has none)."""
    models = set()
    for i in range(_call("get_count", None, nvml.nvmlDeviceGetCount)):
        try:
            handle = _call("get_handle", i, nvml.nvmlDeviceGetHandleByIndex, i)
            models.add(_text(_call("get_name", i, nvml.nvmlDeviceGetName, handle)))
        except GPULostError:
            continue
    return models


def _asked_by_uuid(nvml: ModuleType, uuids: Sequence[str], local: int) -> object | None:
    """The handle NVML gives for the first of ``uuids`` it finds, or None.

    ``nvmlDeviceGetHandleByUUID`` may initialise other GPUs while it searches and then
    answers ``GPU_IS_LOST`` for a GPU that is not the one asked for: any failure is None,
    and the caller lists the GPUs instead (:func:`_answering`).
    """
    lookup = getattr(nvml, "nvmlDeviceGetHandleByUUID", None)
    if lookup is None:
        return None
    for uuid in uuids:
        try:
            return _call("get_handle", local, lookup, uuid.encode())
        except DeviceError:
            continue
    return None


def _answering(nvml: ModuleType, local: int) -> tuple[list[tuple[str, object]], list[int]]:
    """Every GPU and MIG instance that answers, as ``(UUID, handle)``, and the NVML
    indices of the GPUs that fell off the bus (left out)."""
    found: list[tuple[str, object]] = []
    lost: list[int] = []
    for i in range(_call("get_count", local, nvml.nvmlDeviceGetCount)):
        try:
            handle = _call("get_handle", local, nvml.nvmlDeviceGetHandleByIndex, i)
            found.append((_text(_call("get_uuid", local, nvml.nvmlDeviceGetUUID, handle)), handle))
        except GPULostError:
            lost.append(i)
            continue
        found.extend(_mig_instances(nvml, handle, local))
    return found, lost


def _handle_by_uuid(nvml: ModuleType, entry: str, local: int) -> object | None:
    """The GPU or MIG instance whose UUID is the ``CUDA_VISIBLE_DEVICES`` entry ``entry``,
    or uniquely starts with it (as CUDA accepts), or None."""
    if not entry:
        return None
    handle = _asked_by_uuid(nvml, [entry], local)
    if handle is not None:
        return handle
    candidates, _lost = _answering(nvml, local)
    matches = [h for uuid, h in candidates if uuid == entry]
    if not matches:
        matches = [h for uuid, h in candidates if uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def _handle_for_cuda_uuid(nvml: ModuleType, uuid: str, local: int) -> object | None:
    """The GPU or MIG instance CUDA reports as ``uuid`` (bare, as CUDA gives it, or with
    NVML's prefix), or None when no GPU that answers has it."""
    bare = normalise_uuid(uuid)
    handle = _asked_by_uuid(nvml, [f"GPU-{bare}", f"MIG-{bare}"], local)
    if handle is not None:
        return handle
    candidates, _lost = _answering(nvml, local)
    return next((h for text, h in candidates if normalise_uuid(text) == bare), None)


def _mig_instances(nvml: ModuleType, handle: object, local: int) -> list[tuple[str, object]]:
    try:
        slots = _call("get_mig_count", local, nvml.nvmlDeviceGetMaxMigDeviceCount, handle)
    except (NotSupportedError, DriverError):
        return []
    found = []
    for slot in range(slots):
        try:
            mig = _call("get_handle", local, nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        except GPUNotFoundError:
            continue
        found.append((_text(_call("get_uuid", local, nvml.nvmlDeviceGetUUID, mig)), mig))
    return found


def visible_gpu_count() -> int:
    """How many GPUs this process may use (NVML's count filtered by CUDA_VISIBLE_DEVICES).

    Raises:
        DriverError: pynvml is missing or NVML fails to initialise.
    """
    with NVMLSession():
        return len(_visible(_pynvml()))


def nvml_gpus(
    indices: Sequence[int] | None = None,
    *,
    power_sample_interval_s: float = 0.05,
    cuda: CudaRuntime | None = None,
    sync_timeout_s: float = SYNC_TIMEOUT_S,
    factory: Callable[..., NVMLGPU] = NVMLGPU,
) -> list[NVMLGPU]:
    """Open GPUs through NVML.

    Args:
        indices: process-local indices (positions in ``CUDA_VISIBLE_DEVICES``); None: all
            visible GPUs.
        power_sample_interval_s: sampling period of the fallback energy integration on GPUs
            without an energy counter.
        sync_timeout_s: how long each GPU's ``synchronize`` waits for its queued work.
        cuda: the CUDA side, asked when CUDA may number the GPUs differently from NVML
            (default :class:`~lightning_energy.device.cuda.TorchCuda`).
        factory: builds each GPU from its NVML handle and process-local index, with
            the keyword arguments above (a subclass of :class:`NVMLGPU` that writes
            settings another way: :class:`~lightning_energy.device.zeusd.ZeusdGPU`).

    Returns:
        One GPU per index; close each when done.

    Raises:
        ConfigError: CUDA may number the GPUs differently from NVML and is not available
            to say how (set ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).
        DriverError: pynvml is missing or NVML fails to initialise.
        GPUNotFoundError: an index or ``CUDA_VISIBLE_DEVICES`` entry matches no GPU.
    """
    with NVMLSession():
        handles = _visible_handles(_pynvml(), cuda)
        wanted = range(len(handles)) if indices is None else indices
        bad = [i for i in wanted if not 0 <= i < len(handles)]
        if bad:
            raise GPUNotFoundError(
                f"no GPU with process-local index {bad}: {len(handles)} visible",
                gpu_index=bad[0],
                operation="get_handle",
            )
        gpus: list[NVMLGPU] = []
        try:
            for i in wanted:
                gpus.append(
                    factory(
                        handles[i],
                        i,
                        power_sample_interval_s=power_sample_interval_s,
                        sync_timeout_s=sync_timeout_s,
                    )
                )
        except BaseException:
            for gpu in gpus:
                gpu.close()
            raise
        return gpus
