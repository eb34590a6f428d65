"""Partition meters for the Kareus tests: the simulated group, noise-free, counted."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_energy.kareus.model import OverlapModel, shipped_physics
from lightning_energy.kareus.partition import PartitionSetting
from lightning_energy.kareus.workload import LLAMA_3_2_3B, SimulatedPartitions


class ExactMeter:
    """Noise-free measurements of the simulated Llama 3.2 3B group, every setting counted;
    raises after ``fail_after`` settings (a crash mid-search)."""

    def __init__(self, *, fail_after: int | None = None, nanobatched: bool = True) -> None:
        self.group = SimulatedPartitions(
            OverlapModel(shipped_physics()), LLAMA_3_2_3B, nanobatched=nanobatched
        )
        self.settings: list[PartitionSetting] = []
        self.fail_after = fail_after

    def measure(self, key: str, settings: Sequence[PartitionSetting]) -> list[tuple[float, float]]:
        if self.fail_after is not None and len(self.settings) + len(settings) > self.fail_after:
            raise RuntimeError("the GPU fell off the bus")
        self.settings.extend(settings)
        return self.group.exact(key, settings)


STATIC_W = LLAMA_3_2_3B.tp_size * shipped_physics().static_power_w
