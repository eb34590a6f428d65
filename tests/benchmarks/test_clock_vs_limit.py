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
