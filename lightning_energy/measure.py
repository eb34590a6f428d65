"""Energy and time measurement windows over a set of GPUs.

A window reads every GPU's cumulative energy counter and the device clock when it opens
and again when it closes; the device is synchronised first, so the numbers describe the
GPU's work rather than the CPU's kernel-launch time. Windows are named and nest freely
(an epoch window around step windows): each one only remembers its own starting readings.

Example:
    >>> from lightning_energy.device import SimulatedSpec, open_devices
    >>> devices = open_devices("simulated", simulated=SimulatedSpec(gpu="a40"))
    >>> meter = EnergyMeter(devices)
    >>> meter.begin("step")
    >>> devices.run_step()
    >>> result = meter.end("step")
    >>> result.energy_j > 0 and result.duration_s > 0
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_energy.device.base import DeviceSet
from lightning_energy.errors import EnergyError

__all__ = ["EnergyMeter", "Measurement", "WindowError"]


class WindowError(EnergyError, KeyError):
    """A window was closed that was never opened, or opened twice."""


@dataclass(frozen=True)
class Measurement:
    """The result of one closed window.

    Attributes:
        name: the window's name.
        duration_s: device-clock seconds between opening and closing.
        energy_per_gpu_j: energy used by each GPU of the set, in joules.
    """

    name: str
    duration_s: float
    energy_per_gpu_j: tuple[float, ...]

    @property
    def energy_j(self) -> float:
        """Total energy over all GPUs of the set, in joules."""
        return sum(self.energy_per_gpu_j)

    @property
    def average_power_w(self) -> float:
        """Average total power over the window (0 for an empty window)."""
        return self.energy_j / self.duration_s if self.duration_s > 0 else 0.0


class EnergyMeter:
    """Opens and closes named measurement windows on a :class:`DeviceSet`.

    Args:
        devices: the GPUs to measure and the clock their work is timed on.
        synchronize: synchronise the GPUs before every reading (turn off only when the
            caller has just synchronised).
    """

    def __init__(self, devices: DeviceSet, *, synchronize: bool = True) -> None:
        self._devices = devices
        self._synchronize = synchronize
        self._open: dict[str, tuple[float, tuple[float, ...]]] = {}

    def _read(self) -> tuple[float, tuple[float, ...]]:
        if self._synchronize:
            self._devices.synchronize()
        return self._devices.clock(), tuple(gpu.energy_j() for gpu in self._devices.gpus)

    def begin(self, name: str) -> None:
        """Open the window ``name``.

        Raises:
            WindowError: a window of that name is already open.
        """
        if name in self._open:
            raise WindowError(f"measurement window {name!r} is already open")
        self._open[name] = self._read()

    def end(self, name: str) -> Measurement:
        """Close the window ``name`` and return what it measured.

        Raises:
            WindowError: no window of that name is open.
        """
        try:
            start_s, start_j = self._open.pop(name)
        except KeyError:
            raise WindowError(f"measurement window {name!r} was never opened") from None
        end_s, end_j = self._read()
        return Measurement(
            name=name,
            duration_s=end_s - start_s,
            energy_per_gpu_j=tuple(e1 - e0 for e0, e1 in zip(start_j, end_j, strict=True)),
        )

    def cancel(self, name: str) -> None:
        """Discard the window ``name`` if it is open (no reading taken)."""
        self._open.pop(name, None)

    def is_open(self, name: str) -> bool:
        """Whether the window ``name`` is open."""
        return name in self._open
