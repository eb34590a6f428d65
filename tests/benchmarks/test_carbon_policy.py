"""benchmarks/carbon_policy.py: irregular traces, the oracles, and its JSON output."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from carbon.planning import OperatingPoint, frontier_from_profile, plan_steps

HOUR_S = 3600.0
T0_S = datetime(2023, 3, 1, tzinfo=timezone.utc).timestamp()
#: Fastest to slowest; 150 W and 100 W are off the convex frontier (more energy per step)
#: but draw less power.
MEASURED = (
    OperatingPoint(0.40, 0.40 * 250.0, "300 W"),
    OperatingPoint(0.42, 0.42 * 200.0, "225 W"),
    OperatingPoint(0.46, 0.46 * 170.0, "200 W"),
    OperatingPoint(0.70, 0.70 * 140.0, "150 W"),
    OperatingPoint(1.10, 1.10 * 100.0, "100 W"),
)


@pytest.fixture
def bench(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("carbon_policy")


def _irregular_times() -> np.ndarray:
    """Ten days of 30-minute rows, a 6-hour gap, then three days of 15-minute rows."""
    half_hours = T0_S + np.arange(10 * 48) * 1800.0
    resume_s = half_hours[-1] + 6 * HOUR_S
    quarters = resume_s + np.arange(3 * 96) * 900.0
    return np.concatenate([half_hours, quarters])


def _values(times_s: np.ndarray) -> np.ndarray:
    return 300.0 + 200.0 * np.sin((times_s - T0_S) * 2 * np.pi / 86400.0)


def test_starts_leave_room_for_the_longest_job_on_an_irregular_trace(bench: ModuleType) -> None:
    times_s = _irregular_times()
    span_s = 24 * HOUR_S * 1.5
    rows = bench.start_indices(times_s, span_s, 20)
    assert len(rows) == 20
    starts_s = times_s[rows]
    assert np.all(starts_s >= times_s[0] + bench.HISTORY_S)
    assert np.all(starts_s + span_s <= times_s[-1])


def test_a_job_running_past_the_end_of_an_irregular_trace_finishes(bench: ModuleType) -> None:
    times_s = _irregular_times()
    frontier = frontier_from_profile(MEASURED)
    # The last start leaves 6 h of trace for a job of 24 h: it runs on the last value.
    last = int(np.searchsorted(times_s, times_s[-1] - 6 * HOUR_S))
    rows = (int(np.searchsorted(times_s, times_s[0] + bench.HISTORY_S)), 10 * 48 + 3, last)
    task = bench.Task(
        "irregular",
        times_s,
        _values(times_s),
        frontier,
        bench.Shape(24.0, 0.25, True),
        rows,
        "perfect",
        30.0,
        MEASURED,
    )
    result = bench.run_task(task)
    assert sum(result["missed"]) == 0
    for k in range(len(rows)):
        grams = {name: result[name][k] for name in bench.REPORTED}
        assert all(np.isfinite(list(grams.values())))
        assert grams["oracle_all_limits"] <= grams["oracle"] + 1e-9
        assert grams["oracle"] <= grams["oracle_same_action"] + 1e-9
        for name in bench.POLICIES:
            assert grams["oracle"] <= grams[name] + 1e-9


@pytest.mark.parametrize("allow_pause", [False, True])
def test_the_oracle_is_the_planner_on_the_frontier_without_idle_power(
    bench: ModuleType, allow_pause: bool
) -> None:
    rng = np.random.default_rng(3)
    frontier = frontier_from_profile(MEASURED)
    for _ in range(20):
        intensity = rng.uniform(50.0, 600.0, 30)
        durations = rng.choice([900.0, 1800.0, 3600.0], 30)
        need = rng.uniform(0.3, 0.95) * float(durations.sum()) / 0.40
        expected = plan_steps(intensity, durations, need, frontier, allow_pause=allow_pause)
        got = bench.plan_least_carbon(
            intensity, durations, need, frontier, allow_pause=allow_pause, idle_power_w=0.0
        )
        assert got == pytest.approx(expected.emissions_g, rel=1e-12)
        every = bench.plan_least_carbon(
            intensity, durations, need, MEASURED, allow_pause=allow_pause, idle_power_w=0.0
        )
        assert every <= got * (1 + 1e-12)


@pytest.mark.parametrize("allow_pause", [False, True])
def test_the_same_action_oracle_is_the_best_hourly_plan_run_on_the_trace(
    bench: ModuleType, allow_pause: bool
) -> None:
    """Every sequence of one setting or a pause per hour, each run on the trace until the
    work is done: the same-action oracle emits the least of those that finish by
    the deadline (within its work grid), and no less than the oracle that may share hours."""
    points = bench.efficient_points(MEASURED)
    rng = np.random.default_rng(7)
    hours = 5
    for _ in range(10):
        times_s = T0_S + np.arange(2 * hours + 2) * 1800.0
        values = np.repeat(rng.uniform(50.0, 600.0, hours + 1), 2)  # constant within an hour
        trace = bench._Trace("random", times_s, values)
        deadline_s = T0_S + (hours - rng.uniform(0.0, 0.5)) * HOUR_S
        steps = int(rng.uniform(0.4, 0.8) * (deadline_s - T0_S) / points[0].time_per_step_s)
        best = math.inf
        actions = [*range(len(points)), *([-1] if allow_pause else [])]
        for plan in itertools.product(actions, repeat=hours):
            grams, left, t_s = 0.0, float(steps), T0_S
            for action in plan:
                end_s = min(t_s + HOUR_S, deadline_s)
                if left <= 0.0:
                    break
                if action < 0:
                    grams += bench._grams_at_constant_power(trace, t_s, end_s, 30.0)
                else:
                    run_s = min(end_s - t_s, left * points[action].time_per_step_s)
                    grams += bench._grams_at_constant_power(
                        trace, t_s, t_s + run_s, points[action].power_w
                    )
                    left -= run_s / points[action].time_per_step_s
                t_s = end_s
            if left <= 1e-6 * steps:
                best = min(best, grams)
        got = bench.simulate_same_action_oracle(
            trace, points, steps, T0_S, deadline_s, allow_pause, 30.0
        )
        assert best <= got * (1 + 1e-9)
        assert got == pytest.approx(best, rel=1e-6)
        relaxed = bench.simulate_oracle(trace, points, steps, T0_S, deadline_s, allow_pause, 30.0)
        assert relaxed <= got * (1 + 1e-9)


def test_slow_limits_off_the_frontier_lower_the_no_pause_oracle(bench: ModuleType) -> None:
    intensity = np.array([100.0, 800.0, 800.0, 100.0])
    durations = np.full(4, HOUR_S)
    # Two clean hours at 300 W and two dirty ones at 100 W; without the 100 W point the job
    # must run the dirty hours at 200 W at least.
    need = 2 * HOUR_S / 0.40 + 2 * HOUR_S / 1.10
    frontier = frontier_from_profile(MEASURED)
    on_frontier = bench.plan_least_carbon(
        intensity, durations, need, frontier, allow_pause=False, idle_power_w=0.0
    )
    every = bench.plan_least_carbon(
        intensity, durations, need, MEASURED, allow_pause=False, idle_power_w=0.0
    )
    assert every == pytest.approx((2 * 100.0 * 250.0 + 2 * 800.0 * 100.0) * HOUR_S / 3.6e6)
    assert every < on_frontier * 0.9


def test_idle_after_the_end_is_not_charged_to_the_oracle(bench: ModuleType) -> None:
    """A job that fits in the first hour at its least-energy point costs that hour's work,
    not the idle power to the deadline."""
    frontier = frontier_from_profile(MEASURED)
    intensity = np.array([100.0, 500.0, 500.0])
    durations = np.full(3, HOUR_S)
    need = HOUR_S / 0.46
    grams = bench.plan_least_carbon(
        intensity, durations, need, frontier, allow_pause=True, idle_power_w=40.0
    )
    assert grams == pytest.approx(100.0 * 170.0 * HOUR_S / 3.6e6)


def test_json_reports_both_forecasts_pause_modes_and_idle_power(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    times_s = T0_S + np.arange(12 * 24) * HOUR_S
    path = tmp_path / "grid.csv"
    lines = ["Datetime (UTC),Carbon Intensity"] + [
        f"{datetime.fromtimestamp(t, tz=timezone.utc):%Y-%m-%d %H:%M:%S},{v:.1f}"
        for t, v in zip(times_s, _values(times_s), strict=True)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    argv = ["--trace", str(path), "--starts", "2", "--work-hours", "24", "--slack", "0.25"]
    assert bench.main([*argv, "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    settings = {
        (r["settings"]["forecast"], r["settings"]["trace"], r["settings"]["allow_pause"])
        for r in out["results"]
    }
    assert settings == {  # one trace: no summary over "all" traces repeating it
        (mode, "grid", pause) for mode in ("perfect", "daily") for pause in (False, True)
    }
    for result in out["results"]:
        assert result["settings"]["idle_power_w"] == 30.0  # the A40 trace's idle power
        assert set(result["policies"]) == {
            "static",
            "threshold",
            "forecast",
            "oracle",
            "oracle_all_limits",
            "oracle_same_action",
        }
        forecast = result["policies"]["forecast"]
        for key in (
            "oracle_capture",
            "oracle_all_limits_capture",
            "worse_than_static_share",
            "deadline_misses",
            "vs_static_median",
        ):
            assert key in forecast
        assert forecast["jobs"] == 2
    assert out["settings"]["measured_limits"][0] == "300 W"
    assert out["settings"]["emission_factor"] == "direct"  # grams say which factor they use


def test_a_forecast_reaching_further_captures_more_of_the_oracle(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    # Long jobs that may pause on the German grid: past a 24 h forecast the policy relies on
    # its daily profile and a pessimistic outlook; a forecast of the whole run (up to the
    # 108 h deadline) lets it follow nearly the oracle's plan.
    argv = ["--trace", "DE", "--starts", "3", "--work-hours", "72", "--slack", "0.5"]
    argv += ["--pause", "yes", "--forecast", "perfect", "--workers", "1", "--json"]
    captures = {}
    for hours in ("24", "120"):
        assert bench.main([*argv, "--forecast-hours", hours]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["settings"]["forecast_hours"] == float(hours)
        (result,) = [r for r in out["results"] if r["settings"]["trace"] == "DE"]
        forecast = result["policies"]["forecast"]
        assert forecast["deadline_misses"] == 0
        assert forecast["worse_than_static_share"] == 0.0
        captures[hours] = forecast["oracle_capture"]
    assert captures["120"] > captures["24"]


@pytest.mark.parametrize("hours", ["0", "-3", "nan", "inf"])
def test_a_forecast_reach_that_is_not_a_positive_number_is_refused(
    bench: ModuleType, hours: str
) -> None:
    with pytest.raises(SystemExit, match="--forecast-hours must be a number > 0"):
        bench.main(["--trace", "DE", "--forecast-hours", hours])


def test_without_headroom_the_table_gives_grams_and_lists_each_setting_once(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without pausing the frontier oracle is the constant least-energy pace: it saves
    # nothing, and a capture would be a ratio of two roundings.
    argv = ["--trace", "FR", "--starts", "2", "--work-hours", "24", "--slack", "0.1"]
    argv += ["--forecast", "perfect", "--workers", "1"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| FR, ")]
    labels = [tuple(cell.strip() for cell in row.split("|")[1:3]) for row in rows]
    assert len(labels) == len(set(labels)) == 2 * len(bench.REPORTED)  # once each, no "all"
    assert "| all, " not in out
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")]
        captures = cells[6:8]
        for cell in captures:
            if cell.endswith("%"):
                assert abs(float(cell[:-1])) <= 1000, row  # no ratio of roundings
        if row.startswith("| FR, no pause"):
            assert captures[0].startswith("no headroom: oracle 0.0 g, this "), row
    assert bench.main([*argv, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    keys = [
        (r["settings"]["forecast"], r["settings"]["trace"], r["settings"]["allow_pause"])
        for r in results
    ]
    assert sorted(keys) == sorted(set(keys)) == [("perfect", "FR", False), ("perfect", "FR", True)]
    for r in results:
        forecast = r["policies"]["forecast"]
        if not r["settings"]["allow_pause"]:
            assert forecast["oracle_capture"] is None  # no headroom
            assert abs(forecast["oracle_saving_g"]) < 1e-3
        assert isinstance(forecast["saving_g"], float)
