"""Carbon accounting: joules times grid intensity gives grams of CO2-equivalent.

``emissions_g = energy_j / 3.6e6 * intensity_g_per_kwh`` (3.6e6 J per kWh), summed over
the intervals of a job, each at the intensity of its own time.

Example:
    >>> from datetime import datetime, timedelta, timezone
    >>> t0 = datetime(2023, 1, 1, tzinfo=timezone.utc)
    >>> ledger = CarbonLedger()
    >>> _ = ledger.add(t0, t0 + timedelta(hours=1), 3.6e6, 200.0)    # 1 kWh at 200 g/kWh
    >>> _ = ledger.add(t0 + timedelta(hours=1), t0 + timedelta(hours=2), 7.2e6, 50.0)
    >>> ledger.total_emissions_g, ledger.total_energy_j
    (300.0, 10800000.0)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from carbon.errors import AccountingError
from carbon.types import IntensityPoint, as_utc

__all__ = ["J_PER_KWH", "CarbonLedger", "LedgerEntry", "emissions_g"]

#: Joules in one kilowatt-hour.
J_PER_KWH = 3.6e6


def emissions_g(energy_j: float, intensity_g_per_kwh: float) -> float:
    """Grams of CO2-equivalent emitted by consuming ``energy_j`` at an intensity.

    Args:
        energy_j: energy in joules.
        intensity_g_per_kwh: grid carbon intensity in gCO2eq/kWh.

    Returns:
        ``energy_j / 3.6e6 * intensity_g_per_kwh``.

    Example:
        >>> emissions_g(3.6e6, 250.0)
        250.0
    """
    return energy_j / J_PER_KWH * intensity_g_per_kwh


@dataclass(frozen=True)
class LedgerEntry:
    """One accounted interval.

    Attributes:
        start: interval start (UTC).
        end: interval end (UTC).
        energy_j: energy consumed in the interval.
        intensity_g_per_kwh: the grid intensity applied.
        emissions_g: ``emissions_g(energy_j, intensity_g_per_kwh)``.
        source: where the intensity came from, when known.
    """

    start: datetime
    end: datetime
    energy_j: float
    intensity_g_per_kwh: float
    emissions_g: float
    source: str | None = None

    @property
    def duration_s(self) -> float:
        """Length of the interval in seconds."""
        return (self.end - self.start).total_seconds()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (ISO 8601 times)."""
        return {
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "duration_s": self.duration_s,
            "energy_j": self.energy_j,
            "intensity_g_per_kwh": self.intensity_g_per_kwh,
            "emissions_g": self.emissions_g,
            "source": self.source,
        }


class CarbonLedger:
    """Accumulate intervals of energy use with the intensity at their time.

    Thread-safe: intervals may be added from several threads.
    """

    def __init__(self) -> None:
        self._entries: list[LedgerEntry] = []
        self._lock = threading.Lock()

    def add(
        self,
        start: datetime,
        end: datetime,
        energy_j: float,
        intensity_g_per_kwh: float,
        source: str | None = None,
    ) -> LedgerEntry:
        """Account one interval at one intensity.

        Args:
            start: interval start (naive means UTC).
            end: interval end, not before ``start``.
            energy_j: energy consumed (>= 0).
            intensity_g_per_kwh: intensity during the interval (>= 0).
            source: a label of where the intensity came from.

        Returns:
            The entry added.

        Raises:
            AccountingError: on a reversed interval or a negative/non-finite number.
        """
        start, end = as_utc(start), as_utc(end)
        problems = []
        if end < start:
            problems.append(f"end {end.isoformat()} is before start {start.isoformat()}")
        if not (math.isfinite(energy_j) and energy_j >= 0):
            problems.append(f"energy_j: {energy_j!r} is not allowed; use a finite number >= 0")
        if not (math.isfinite(intensity_g_per_kwh) and intensity_g_per_kwh >= 0):
            problems.append(
                f"intensity_g_per_kwh: {intensity_g_per_kwh!r} is not allowed; "
                "use a finite number >= 0"
            )
        if problems:
            raise AccountingError("; ".join(problems))
        entry = LedgerEntry(
            start,
            end,
            float(energy_j),
            float(intensity_g_per_kwh),
            emissions_g(energy_j, intensity_g_per_kwh),
            source,
        )
        with self._lock:
            self._entries.append(entry)
        return entry

    def add_spanning(
        self,
        start: datetime,
        end: datetime,
        energy_j: float,
        points: Sequence[IntensityPoint],
    ) -> list[LedgerEntry]:
        """Account an interval that may cross several intensity intervals.

        The energy is spread over time at constant power, and each part is charged at
        the intensity of the point in force then (a point holds until the next one; the
        first one also covers any part before it).

        Args:
            start: interval start.
            end: interval end, after ``start``.
            energy_j: energy consumed over the whole interval.
            points: intensity points, any order, at least one.

        Returns:
            One entry per intensity interval crossed.

        Raises:
            AccountingError: with no points, a non-positive interval or bad numbers.
        """
        start, end = as_utc(start), as_utc(end)
        if not points:
            raise AccountingError("add_spanning needs at least one intensity point")
        if end <= start:
            raise AccountingError(f"end {end.isoformat()} must be after start {start.isoformat()}")
        ordered = sorted(points, key=lambda p: p.time)
        total_s = (end - start).total_seconds()
        bounds = [p.time for p in ordered[1:]]
        entries = []
        cursor = start
        for index, point in enumerate(ordered):
            part_end = min(end, bounds[index]) if index < len(bounds) else end
            if part_end <= cursor:
                continue
            share = (part_end - cursor).total_seconds() / total_s
            entries.append(
                self.add(
                    cursor, part_end, energy_j * share, point.intensity_g_per_kwh, point.source
                )
            )
            cursor = part_end
            if cursor >= end:
                break
        return entries

    @property
    def entries(self) -> list[LedgerEntry]:
        """The intervals, in the order added."""
        with self._lock:
            return list(self._entries)

    @property
    def total_energy_j(self) -> float:
        """Energy of all intervals."""
        return math.fsum(e.energy_j for e in self.entries)

    @property
    def total_emissions_g(self) -> float:
        """Emissions of all intervals in grams of CO2-equivalent."""
        return math.fsum(e.emissions_g for e in self.entries)

    @property
    def mean_intensity_g_per_kwh(self) -> float | None:
        """Energy-weighted mean intensity; ``None`` before any energy was accounted."""
        energy_j = self.total_energy_j
        if energy_j == 0:
            return None
        return self.total_emissions_g / energy_j * J_PER_KWH

    def to_dict(self) -> dict[str, Any]:
        """Totals and the per-interval breakdown, JSON-ready."""
        entries = self.entries
        return {
            "total_energy_j": math.fsum(e.energy_j for e in entries),
            "total_emissions_g": math.fsum(e.emissions_g for e in entries),
            "mean_intensity_g_per_kwh": self.mean_intensity_g_per_kwh,
            "intervals": [e.to_dict() for e in entries],
        }
