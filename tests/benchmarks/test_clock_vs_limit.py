"""benchmarks/clock_vs_limit.py: the equal-speed comparison and the selectors' costs."""

from __future__ import annotations

import statistics
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
    results: dict[str, dict[str, object]] = {
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
    assert "-1.50 pp: met" in a40 and "same work" not in a40
    assert "2 pp: no measured data" in h100 and "NOT" not in h100
    a100 = {
        **results["a40_physics"],
        "auto_ok": 2,
        "gap_pp": 3.0,
        "gap_ok": False,
        "gap_same_work_pp": 19.0,
        "gap_board_corrected_pp": -1.0,
    }
    (line,) = bench.targets({"a100_pcie": a100})
    assert (
        "+3.00 pp: NOT met (same work, which the data cannot show: vs the measured median "
        "+19.00 pp, vs the board-corrected one -1.00 pp)"
    ) in line


def test_the_measured_data_show_the_lock_cheaper_at_equal_speed(bench: ModuleType) -> None:
    for preset in ("a100_pcie", "a40_physics"):
        data = bench.measured(preset)
        assert data is not None and data["n"] > 0
        assert data["median_energy_change_pct"] < 0  # the measured direction
        assert data["min_energy_change_pct"] <= data["median_energy_change_pct"]
    assert bench.measured("h100") is None  # no measured data for this GPU


def test_the_simulated_side_runs_the_measured_comparisons_own_runs(bench: ModuleType) -> None:
    from lightning_energy.device.simulated.measured import fitted_cap_jobs

    below_top = sum(len(points) - 1 for points in fitted_cap_jobs("A100").values())
    data = bench.measured("a100_pcie")
    work = bench.measured_work("a100_pcie")
    assert data is not None and work is not None
    assert data["n"] == below_top  # every run below its job's highest cap
    for name in ("same_work", "relative"):
        stats = work[name]
        assert stats["n"] == below_top, name
        assert stats["min_energy_change_pct"] <= stats["median_energy_change_pct"]
        assert stats["median_energy_change_pct"] <= stats["max_energy_change_pct"]
    assert bench.measured_work("h100") is None


def test_the_measured_procedure_is_simulated_on_the_boards_it_was_measured_on(
    bench: ModuleType,
) -> None:
    from benchmarks.calibrate_governor import capped_runs, locked_runs
    from lightning_energy.device.simulated import PHYSICS_PRESETS
    from lightning_energy.device.simulated.measured import (
        cap_jobs,
        fitted_cap_jobs,
        lock_curves,
        relative_gaps,
        relative_lock_curve,
    )

    sxm, pcie = bench.measured_work("a100_sxm"), bench.measured_work("a100_pcie")
    assert sxm is not None and pcie is not None
    # Locks on SXM boards, caps on PCIe boards, whichever A100 preset is asked about ...
    assert sxm["relative"] == pcie["relative"]
    assert sxm["relative"]["boards"] == "locks on a100_sxm, caps on a100_pcie"
    # ... which is not the procedure with both on one board.
    one_board = PHYSICS_PRESETS["a100_sxm"]
    locks = relative_lock_curve(locked_runs(one_board, lock_curves("a100_sxm")))
    fitted = fitted_cap_jobs("A100")
    jobs = {j.name: capped_runs(one_board, j)[2] for j in cap_jobs("A100") if j.name in fitted}
    assert statistics.median(relative_gaps(locks, jobs)) != pytest.approx(
        sxm["relative"]["median_energy_change_pct"], abs=1.0
    )
    # The same work, like with like, stays on the preset asked about.
    assert sxm["same_work"] != pcie["same_work"]
    # The a100 preset (an A100-SXM4-40GB) was fitted on none of these boards.
    assert bench.measured("a100") is None and bench.measured_work("a100") is None


def test_the_board_correction_moves_the_locks_reference_to_the_caps_clock(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_energy.device.simulated.governor import GovernedRun
    from lightning_energy.device.simulated.measured import (
        fitted_cap_jobs,
        lock_curves,
        measured_lock_vs_cap_pct,
        relative_gaps,
        relative_lock_curve,
    )

    def ran_at(clock_mhz: float) -> None:
        run = GovernedRun(1.0, 250.0, round(clock_mhz), clock_mhz, 250.0, True, False, False)
        monkeypatch.setattr(bench, "steady_run", lambda *args, **kwargs: run)

    # Caps whose highest one left the clock at the locks' highest: nothing to correct.
    ran_at(1410.0)
    assert bench.board_corrected_pct("a100_sxm", "A100", "a100_pcie") == pytest.approx(
        measured_lock_vs_cap_pct("a100_sxm", "A100")
    )
    # A highest cap that ran at 1152 MHz: the locks relative to the nearest clock, 1155.
    ran_at(1152.0)
    curves = {c.name: c.points for c in lock_curves("a100_sxm")}
    expected = [
        change
        for name, points in fitted_cap_jobs("A100").items()
        for change in relative_gaps(relative_lock_curve(curves, 1155), {name: points})
    ]
    assert bench.board_corrected_pct("a100_sxm", "A100", "a100_pcie") == pytest.approx(expected)
    assert expected != pytest.approx(measured_lock_vs_cap_pct("a100_sxm", "A100"))


def test_the_board_correction_is_made_only_where_locks_and_caps_crossed_boards(
    bench: ModuleType,
) -> None:
    a40, a100 = bench.measured("a40_physics"), bench.measured("a100_pcie")
    assert a40 is not None and a40["board_corrected"] is None  # locks and caps on A40s
    assert a100 is not None
    corrected = a100["board_corrected"]
    assert corrected["n"] == a100["n"]
    assert corrected["board_part_pp"] == pytest.approx(
        a100["median_energy_change_pct"] - corrected["median_energy_change_pct"]
    )
