"""Read-only GPU access: every way of changing a setting refuses, and is recorded.

A read-only calibration runs on shared GPUs whose settings must never change, also when it
runs as root. Two layers make that structural rather than a matter of care:

* :class:`ReadOnlyGPU` wraps a GPU of the project's GPU protocol: readings pass through;
  its setters (power limit, clock lock, releasing a lock) raise
  :class:`~lightning_energy.errors.NoPermissionError`, so a guard or controller that tries
  one falls back to observing;
* :func:`read_only_nvml` puts a view of the ``pynvml`` module in ``sys.modules`` for the
  duration of a block: it passes NVML's reading functions through (``nvmlInit*``,
  ``nvmlShutdown``, ``nvmlSystemGet*``, ``nvmlDeviceGet*``, ...) and refuses every other
  NVML function (``nvmlDeviceSet*``, ``Reset*``, ``Clear*``, ``Create*``, ``Destroy*``,
  ``Modify*``, ``Remove*``: power limits, clocks, persistence mode, MIG layout, GPU reset),
  whoever calls it (this package, torch, Lightning). A refused function raises NVML's
  ``NO_PERMISSION`` error without reaching the driver. Code that took NVML's functions
  before the block keeps them: open NVML only inside it.

Every refusal is recorded in a :class:`RefusedCalls` log, which the calibration reports as
a problem.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from lightning_energy.device.base import GPU, LeaseSource
from lightning_energy.errors import NoPermissionError

__all__ = ["NVML_READERS", "ReadOnlyGPU", "RefusedCalls", "is_nvml_reader", "read_only_nvml"]

#: NVML functions that only read: these exact names, and names with these prefixes.
NVML_READERS = (
    frozenset(
        {
            "nvmlInit",
            "nvmlInit_v2",
            "nvmlInitWithFlags",
            "nvmlShutdown",
            "nvmlErrorString",
            "nvmlDeviceIsMigDeviceHandle",
        }
    ),
    ("nvmlSystemGet", "nvmlDeviceGet"),
)


def is_nvml_reader(name: str) -> bool:
    """Whether the NVML function ``name`` only reads (see :data:`NVML_READERS`)."""
    exact, prefixes = NVML_READERS
    return name in exact or name.startswith(prefixes)


class RefusedCalls:
    """The setting changes refused during a read-only run (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: list[str] = []

    def record(self, name: str) -> None:
        """Note that ``name`` was called and refused."""
        with self._lock:
            self._names.append(name)

    @property
    def names(self) -> list[str]:
        """What was refused, in call order."""
        with self._lock:
            return list(self._names)


_SETTER_HELP = "a read-only calibration changes no GPU setting (--change-settings: a GPU you own)"


class ReadOnlyGPU:
    """A GPU whose readings are those of ``gpu`` and whose setters refuse.

    Methods of the GPU protocol are delegated; any other attribute (``instant_power_w``,
    ``sm_clock_mhz``, ``close``...) is the wrapped GPU's, except names starting with
    ``set_`` or ``reset_``, which refuse as the protocol's setters do.

    Args:
        gpu: the GPU read.
        refused: where refused setter calls are recorded.
    """

    def __init__(self, gpu: GPU, refused: RefusedCalls) -> None:
        self._gpu = gpu
        self._refused = refused

    def __repr__(self) -> str:
        return f"ReadOnlyGPU({self._gpu!r})"

    def _refuse(self, operation: str) -> NoPermissionError:
        self._refused.record(f"GPU.{operation}")
        return NoPermissionError(_SETTER_HELP, gpu_index=self._gpu.index, operation=operation)

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("set_", "reset_")):

            def refuse(*args: object, **kwargs: object) -> None:
                raise self._refuse(name)

            return refuse
        return getattr(self._gpu, name)

    @property
    def wrapped(self) -> GPU:
        """The GPU read."""
        return self._gpu

    @property
    def index(self) -> int:
        return self._gpu.index

    @property
    def name(self) -> str:
        return self._gpu.name

    @property
    def uuid(self) -> str:
        return self._gpu.uuid

    @property
    def is_mig(self) -> bool:
        return self._gpu.is_mig

    def power_limit_constraints_w(self) -> tuple[float, float]:
        return self._gpu.power_limit_constraints_w()

    def default_power_limit_w(self) -> float:
        return self._gpu.default_power_limit_w()

    def power_limit_w(self) -> float:
        return self._gpu.power_limit_w()

    def enforced_power_limit_w(self) -> float:
        return self._gpu.enforced_power_limit_w()

    def set_power_limit_w(self, power_limit_w: float) -> None:
        """Refused (see the class)."""
        raise self._refuse("set_power_limit_w")

    def supported_sm_clocks_mhz(self) -> list[int]:
        return self._gpu.supported_sm_clocks_mhz()

    def set_locked_clocks_mhz(self, min_mhz: int, max_mhz: int) -> None:
        """Refused (see the class)."""
        raise self._refuse("set_locked_clocks_mhz")

    def reset_locked_clocks(self) -> None:
        """Refused (see the class)."""
        raise self._refuse("reset_locked_clocks")

    def locked_clocks_mhz(self) -> tuple[int, int] | None:
        return self._gpu.locked_clocks_mhz()

    def foreign_clock_setting(self) -> str | None:
        return self._gpu.foreign_clock_setting()

    def energy_j(self) -> float:
        return self._gpu.energy_j()

    def energy_counter_period_s(self) -> float:
        return self._gpu.energy_counter_period_s()

    def power_w(self) -> float:
        return self._gpu.power_w()

    def synchronize(self) -> None:
        self._gpu.synchronize()

    def now_s(self) -> float:
        return self._gpu.now_s()

    def idle(self, seconds: float) -> None:
        self._gpu.idle(seconds)

    def lease_source(self) -> LeaseSource:
        return self._gpu.lease_source()


class _ReadOnlyNVML(types.ModuleType):
    """A view of the ``pynvml`` module that refuses every function but readers."""

    def __init__(self, nvml: types.ModuleType, refused: RefusedCalls) -> None:
        super().__init__(nvml.__name__, nvml.__doc__)
        self.__dict__["_read_only_source"] = nvml
        self.__dict__["_read_only_refused"] = refused

    def __getattr__(self, name: str) -> Any:
        nvml: types.ModuleType = self.__dict__["_read_only_source"]
        value = getattr(nvml, name)
        if name.startswith("nvml") and callable(value) and not is_nvml_reader(name):
            value = self._refuser(nvml, name)
        # Kept: later look-ups cost what the module's own do (the call costs are measured).
        self.__dict__[name] = value
        return value

    def _refuser(self, nvml: types.ModuleType, name: str) -> Callable[..., Any]:
        refused: RefusedCalls = self.__dict__["_read_only_refused"]

        def refuse(*args: object, **kwargs: object) -> Any:
            refused.record(f"pynvml.{name}")
            raise nvml.NVMLError(nvml.NVML_ERROR_NO_PERMISSION)

        refuse.__name__ = name
        return refuse


@contextlib.contextmanager
def read_only_nvml(refused: RefusedCalls) -> Iterator[bool]:
    """Make ``import pynvml`` give a read-only view of it inside the block.

    Args:
        refused: where refused NVML calls are recorded.

    Yields:
        Whether a ``pynvml`` module was found to guard (without one NVML cannot be reached
        at all).
    """
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        yield False
        return
    previous = sys.modules.get("pynvml")
    sys.modules["pynvml"] = _ReadOnlyNVML(nvml, refused)
    try:
        yield True
    finally:
        if previous is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = previous
