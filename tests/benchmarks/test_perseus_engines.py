"""benchmarks/perseus_engines.py: the per-phase figures of a row and the table."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


def records(phases: list[str], time_s: list[float], power_w: list[float]) -> list[dict[str, Any]]:
    """One rank's iterations: the phase, and the clock and energy counter at each end."""
    out, now_s, energy_j = [], 0.0, 0.0
    for phase, t, p in zip(phases, time_s, power_w, strict=True):
        now_s += t
        energy_j += t * p
        out.append({"phase": phase, "end_s": now_s, "end_j": energy_j})
    return out


def test_a_row_compares_the_warm_up_with_the_plan_leaving_each_phases_first_out(
    load_benchmark: Callable[[str], ModuleType],
) -> None:
    bench = load_benchmark("perseus_engines")
    phases = ["warmup"] * 4 + ["profiling"] * 2 + ["planned"] * 4
    # The first iteration of each phase differs (clocks still landing): left out.
    times = [9.0, 2.0, 2.0, 2.0, 3.0, 3.0, 7.0, 2.0, 2.0, 2.0]
    rank0 = records(phases, times, [100.0] * 4 + [90.0] * 2 + [50.0] + [80.0] * 3)
    rank1 = records(phases, times, [60.0] * 4 + [50.0] * 2 + [50.0] + [40.0] * 3)
    row = bench.summary("engine", [rank0, rank1], 8)
    assert (row["stages"], row["microbatches"]) == (2, 8)
    assert row["iteration_time_s_max"] == pytest.approx(2.0)
    assert row["energy_j_max"] == pytest.approx(2.0 * 160.0)
    assert row["iteration_time_s_plan"] == pytest.approx(2.0)
    assert row["energy_j_plan"] == pytest.approx(2.0 * 120.0)
    assert row["time_ratio"] == pytest.approx(1.0)
    assert row["energy_saving"] == pytest.approx(0.25)
    (header, _, line) = bench.table({"engine": row})
    assert header.count("|") == line.count("|")
    assert "25.0 %" in line


def test_a_run_too_short_to_reach_the_plan_says_to_raise_iterations(
    load_benchmark: Callable[[str], ModuleType],
) -> None:
    bench = load_benchmark("perseus_engines")
    rank = records(["warmup"] * 3 + ["profiling"] * 3, [1.0] * 6, [100.0] * 6)
    with pytest.raises(SystemExit, match="raise --iterations"):
        bench.summary("engine", [rank], 4)
