"""Fixtures of the device tests."""

from __future__ import annotations

import pytest

from lightning_energy.device import nvml


@pytest.fixture(autouse=True)
def _fresh_counter_periods(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test measures the energy counters of its own fake GPUs: the periods NVML
    measured are kept per GPU UUID for the life of the process, and fake GPUs of different
    tests share UUIDs."""
    monkeypatch.setattr(nvml, "_counter_periods_s", {})
