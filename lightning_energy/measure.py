"""Energy and time measurement windows over a set of GPUs.

A window reads every GPU's cumulative energy counter and the device clock when it opens
and again when it closes; the device is synchronised first, so the numbers describe the
GPU's work rather than the CPU's kernel-launch time. Windows are named and nest freely
(an epoch window around step windows): each one only remembers its own starting readings.
A window can be paused and resumed: what runs in between (validation, an epoch's end) is
left out, and the window measures the stretches on either side.

Readings are as rude as the hardware: an energy counter moves only every ~100 ms on many
boards (a short window may read 0 J: size windows in seconds, see
:func:`lightning_energy.optimize.power_limit.min_window_s`), it restarts from 0 when the
driver reloads (the meter carries on from where it was, with one warning), and a GPU may
stop answering (lost, driver failure): its energy is then NaN
(:attr:`Measurement.missing`), with one warning per GPU, and training goes on.

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

import logging
import math
from dataclasses import dataclass, field

from lightning_energy.device.base import DeviceSet
from lightning_energy.errors import DeviceError, EnergyError

__all__ = ["EnergyMeter", "Measurement", "WindowError"]

log = logging.getLogger(__name__)


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
    def missing(self) -> bool:
        """True when a GPU could not be read at an end of the window (its energy is NaN)."""
        return any(math.isnan(e) for e in self.energy_per_gpu_j)

    @property
    def average_power_w(self) -> float:
        """Average total power over the window (0 for an empty window)."""
        return self.energy_j / self.duration_s if self.duration_s > 0 else 0.0


@dataclass
class _Open:
    """A window: what its closed stretches measured, and the readings at the start of the
    stretch in progress (None while paused)."""

    start: tuple[float, tuple[float, ...]] | None
    duration_s: float = 0.0
    energy_j: list[float] = field(default_factory=list)


class EnergyMeter:
    """Opens and closes named measurement windows on a :class:`DeviceSet`.

    Args:
        devices: the GPUs to measure and the clock their work is timed on.
        synchronize: synchronise the GPUs before every reading (turn off only when the
            caller has just synchronised).

    Attributes:
        last_error: the last failure met while reading (a GPU that could not be
            synchronised or read); None while every reading succeeded.
    """

    def __init__(self, devices: DeviceSet, *, synchronize: bool = True) -> None:
        self._devices = devices
        self._synchronize = synchronize
        self._open: dict[str, _Open] = {}
        n = len(devices.gpus)
        self._last_raw_j: list[float | None] = [None] * n
        self._offset_j = [0.0] * n
        self._warned: set[tuple[int, str]] = set()
        self.last_error: DeviceError | None = None

    def _warn_once(self, i: int, kind: str, message: str, *args: object) -> None:
        if (i, kind) not in self._warned:
            self._warned.add((i, kind))
            log.warning(message, *args)

    def _read(self) -> tuple[float, tuple[float, ...]]:
        if self._synchronize:
            try:
                self._devices.synchronize()
            except DeviceError as exc:
                self.last_error = exc
                self._warn_once(
                    -1, "sync", "Cannot synchronise the GPUs (%s): energy is read without it.", exc
                )
        return self._devices.clock(), tuple(self._energy_j(i) for i in range(len(self._devices)))

    def _energy_j(self, i: int) -> float:
        """GPU ``i``'s energy, carried on across counter restarts; NaN when unreadable."""
        gpu = self._devices.gpus[i]
        try:
            raw_j = gpu.energy_j()
        except DeviceError as exc:
            self.last_error = exc
            self._warn_once(
                i,
                "read",
                "The energy of GPU %d (%s) cannot be read (%s): its measurements are missing "
                "until it reads again.",
                gpu.index,
                gpu.uuid,
                exc,
            )
            return math.nan
        last_j = self._last_raw_j[i]
        if last_j is not None and raw_j < last_j:
            # The counter restarted (driver reload): continue from the last reading; the
            # energy between that reading and the restart is not seen.
            self._offset_j[i] += last_j
            self._warn_once(
                i,
                "backwards",
                "The energy counter of GPU %d (%s) went backwards (%.1f J -> %.1f J; the "
                "driver was reloaded?): measuring on from the new origin.",
                gpu.index,
                gpu.uuid,
                last_j,
                raw_j,
            )
        self._last_raw_j[i] = raw_j
        return raw_j + self._offset_j[i]

    def begin(self, name: str) -> None:
        """Open the window ``name``.

        Raises:
            WindowError: a window of that name is already open.
        """
        if name in self._open:
            raise WindowError(f"measurement window {name!r} is already open")
        self._open[name] = _Open(self._read(), energy_j=[0.0] * len(self._devices))

    def end(self, name: str) -> Measurement:
        """Close the window ``name`` and return what it measured.

        Raises:
            WindowError: no window of that name is open.
        """
        measurement = self.peek(name)
        del self._open[name]
        return measurement

    def peek(self, name: str) -> Measurement:
        """What the window ``name`` has measured so far; it stays open.

        Raises:
            WindowError: no window of that name is open.
        """
        window = self._window(name)
        duration_s, energy_j = window.duration_s, list(window.energy_j)
        if window.start is not None:
            start_s, start_j = window.start
            end_s, end_j = self._read()
            duration_s += end_s - start_s
            for i, (e0, e1) in enumerate(zip(start_j, end_j, strict=True)):
                energy_j[i] += e1 - e0
        return Measurement(name=name, duration_s=duration_s, energy_per_gpu_j=tuple(energy_j))

    def pause(self, name: str) -> None:
        """Stop measuring the window ``name`` until :meth:`resume` (no-op while paused).

        Raises:
            WindowError: no window of that name is open.
        """
        window = self._window(name)
        if window.start is None:
            return
        m = self.peek(name)
        window.start = None
        window.duration_s, window.energy_j = m.duration_s, list(m.energy_per_gpu_j)

    def resume(self, name: str) -> None:
        """Measure the paused window ``name`` again from now on (no-op while measuring).

        Raises:
            WindowError: no window of that name is open.
        """
        window = self._window(name)
        if window.start is None:
            window.start = self._read()

    def is_paused(self, name: str) -> bool:
        """Whether the window ``name`` is open and paused."""
        window = self._open.get(name)
        return window is not None and window.start is None

    def _window(self, name: str) -> _Open:
        try:
            return self._open[name]
        except KeyError:
            raise WindowError(f"measurement window {name!r} was never opened") from None

    def cancel(self, name: str) -> None:
        """Discard the window ``name`` if it is open (no reading taken)."""
        self._open.pop(name, None)

    def is_open(self, name: str) -> bool:
        """Whether the window ``name`` is open."""
        return name in self._open
