"""The planner that holds one setting per interval, against every such plan enumerated."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carbon.errors import CarbonConfigError
from carbon.planning import OperatingPoint, plan_intervals, plan_steps

HOUR_S = 3600.0
POINTS = (
    OperatingPoint(1.0, 300.0, "300 W"),
    OperatingPoint(1.05, 273.0, "260 W"),
    OperatingPoint(1.25, 250.0, "200 W"),
)


def _run(
    choices: tuple[int, ...],
    intensity: list[float],
    durations: list[float],
    steps: float,
    idle_power_w: float,
) -> tuple[float, bool]:
    """Grams of one sequence of choices (-1 pauses), and whether it finishes in time."""
    grams, work = 0.0, steps
    for k, g_per_kwh, span_s in zip(choices, intensity, durations, strict=True):
        if work <= 0.0:
            break
        if k < 0:
            grams += g_per_kwh * idle_power_w * span_s / 3.6e6
            continue
        point = POINTS[k]
        run_s = min(span_s, work * point.time_per_step_s)
        work -= run_s / point.time_per_step_s
        grams += g_per_kwh * point.power_w * run_s / 3.6e6
    return grams, work <= 1e-9 * steps


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    intensity=st.lists(st.floats(20.0, 600.0), min_size=1, max_size=4),
    share=st.floats(0.05, 1.1),
    allow_pause=st.booleans(),
    idle_power_w=st.floats(0.0, 90.0),
)
def test_the_plan_is_the_cheapest_sequence_of_whole_interval_choices(
    intensity: list[float], share: float, allow_pause: bool, idle_power_w: float
) -> None:
    durations = [HOUR_S] * (len(intensity) - 1) + [0.6 * HOUR_S]
    steps = share * sum(durations) / POINTS[0].time_per_step_s
    options = range(-1 if allow_pause else 0, len(POINTS))
    runs = [
        _run(c, intensity, durations, steps, idle_power_w)
        for c in itertools.product(options, repeat=len(intensity))
    ]
    feasible = [grams for grams, done in runs if done]
    plan = plan_intervals(
        intensity, durations, steps, POINTS, allow_pause=allow_pause, idle_power_w=idle_power_w
    )
    assert plan.feasible == bool(feasible)
    if not feasible:
        return
    # The plan is one of the enumerated sequences (its grams are exact), and the best one
    # up to the work grid's resolution.
    grams, done = _run(tuple(plan.choices), intensity, durations, steps, idle_power_w)
    assert done
    assert plan.emissions_g == pytest.approx(grams, rel=1e-9)
    assert plan.steps.sum() == pytest.approx(steps, rel=1e-9)
    assert plan.emissions_g <= min(feasible) * (1 + 2e-3)
    if not allow_pause:
        assert -1 not in plan.choices[plan.steps > 0]


def test_the_plan_costs_more_than_time_sharing_promises_when_a_split_hour_pays() -> None:
    # 6000 steps over a dirty hour then a clean one: time sharing runs the clean hour at
    # full speed and 2400 steps of the dirty hour at the least-energy limit, then pauses;
    # held per hour, the dirty hour runs whole at that limit and the clean one finishes
    # at the cheapest limit that still fits.
    intensity, durations = [400.0, 50.0], [HOUR_S, HOUR_S]
    sharing = plan_steps(intensity, durations, 6000, POINTS, allow_pause=True, idle_power_w=30.0)
    held = plan_intervals(intensity, durations, 6000, POINTS, allow_pause=True, idle_power_w=30.0)
    assert held.feasible
    assert held.emissions_g > sharing.emissions_g
    assert held.choices.tolist() == [2, 1]


def test_the_plan_rejects_bad_input() -> None:
    with pytest.raises(CarbonConfigError, match="same length"):
        plan_intervals([1.0, 2.0], [HOUR_S], 10, POINTS, allow_pause=True)
    with pytest.raises(CarbonConfigError, match="operating point"):
        plan_intervals([1.0], [HOUR_S], 10, [], allow_pause=True)
    with pytest.raises(CarbonConfigError, match="resolution"):
        plan_intervals([1.0], [HOUR_S], 10, POINTS, allow_pause=True, resolution=0)


def test_nothing_left_to_do_plans_nothing() -> None:
    plan = plan_intervals([100.0, 200.0], [HOUR_S, HOUR_S], 0, POINTS, allow_pause=False)
    assert plan.feasible
    assert plan.emissions_g == 0.0
    assert np.all(plan.choices == -1)
