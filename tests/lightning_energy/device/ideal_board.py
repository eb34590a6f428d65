"""A simulated board whose readings are exact and settings immediate, for the tests that
check a GPU model itself: ``SimulatedSpec(gpu="a100", **IDEAL)``."""

from __future__ import annotations

from typing import TypedDict


class IdealBoard(TypedDict):
    """The :class:`~lightning_energy.device.SimulatedSpec` fields of an ideal board."""

    energy_counter_period_s: float
    power_average_s: float
    setting_latency_s: float


IDEAL: IdealBoard = {
    "energy_counter_period_s": 0.0,
    "power_average_s": 0.0,
    "setting_latency_s": 0.0,
}
