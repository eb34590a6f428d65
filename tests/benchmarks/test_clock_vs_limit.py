"""benchmarks/clock_vs_limit.py: the equal-speed comparison and the selectors' costs."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture
def bench(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("clock_vs_limit")


def test_each_cap_meets_the_cheapest_lock_at_least_as_fast(bench: ModuleType) -> None:
    point = bench.Point
    caps = [point(300.0, 1.0, 100.0, None), point(200.0, 1.5, 80.0, None)]
    locks = [
        point(1400.0, 0.9, 110.0, None),  # faster than both caps, dearer
        point(1200.0, 1.0, 90.0, None),  # as fast as 300 W, 10 % cheaper
        point(900.0, 1.6, 60.0, None),  # slower than both caps: never compared
    ]
    assert bench.equal_speed_changes_pct(caps, locks) == pytest.approx([-10.0, 12.5])
    assert bench.equal_speed_changes_pct(caps, locks[2:]) == []


def test_a_choice_over_its_time_bound_costs_infinitely(bench: ModuleType) -> None:
    slow = bench.Point(1000.0, 1.2, 50.0, None)
    assert bench.objective("energy", slow, 400.0, None) == 50.0
    assert bench.objective("max_slowdown", slow, 400.0, 1.1) == float("inf")
    assert bench.objective("cost", slow, 400.0, None) == pytest.approx(0.5 * 50 + 0.5 * 400 * 1.2)
    assert bench.objective("time", slow, 400.0, None) == 1.2


def test_auto_candidates_add_the_clocks_the_caps_ran_at(bench: ModuleType) -> None:
    from lightning_energy.device import SimulatedSpec, simulated_gpus

    (gpu,) = simulated_gpus(SimulatedSpec(gpu="a100"))
    supported = sorted(gpu.supported_sm_clocks_mhz())
    caps = [bench.Point(400.0, 0.5, 180.0, 1410.0), bench.Point(250.0, 0.6, 150.0, 1153.5)]
    seeded = bench.seeded_clocks(gpu, caps)
    nearest = float(min(supported, key=lambda c: abs(c - 1153.5)))
    assert nearest not in bench.candidates(gpu, bench.LOCKED_CLOCK)  # off the 90 MHz grid
    assert set(seeded) == set(bench.candidates(gpu, bench.LOCKED_CLOCK)) | {nearest}
    assert seeded == sorted(seeded, reverse=True)


def test_the_targets_name_each_pair_that_misses(bench: ModuleType) -> None:
    def row(ok: bool, change: float) -> dict[str, object]:
        return {"auto_ok": ok, "auto_vs_cap_pct": change}

    mixed = {"energy": row(True, 0.0), "cost": row(False, 2.5)}
    results = {
        "a40_physics": {
            "auto_ok": 1,
            "auto_rows": 2,
            "gap_pp": -1.5,
            "gap_ok": True,
            "workloads": {"mixed": {"selectors": mixed}},
        },
        "h100": {
            "auto_ok": 1,
            "auto_rows": 1,
            "gap_pp": None,
            "gap_ok": None,
            "workloads": {"mixed": {"selectors": {"energy": row(True, -1.0)}}},
        },
    }
    a40, h100 = bench.targets(results)
    assert "1/2 pairs: NOT met (mixed/cost +2.50 %)" in a40
    assert "-1.50 pp: met" in a40
    assert "2 pp: no measured data" in h100 and "NOT" not in h100


def test_the_measured_data_show_the_lock_cheaper_at_equal_speed(bench: ModuleType) -> None:
    for preset in ("a100_pcie", "a40_physics"):
        data = bench.measured(preset)
        assert data is not None and data["n"] > 0
        assert data["median_energy_change_pct"] < 0  # the measured direction
        assert data["min_energy_change_pct"] <= data["median_energy_change_pct"]
    assert bench.measured("h100") is None  # no measured data for this GPU
