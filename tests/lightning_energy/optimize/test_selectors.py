"""Selectors: choices equal brute force; gaps; validation of parameters."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from lightning_energy.device.simulated import PowerTrace
from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.optimize.selectors import (
    SELECTOR_NAMES,
    CostSelector,
    MaxSlowdownSelector,
    Measurement,
    Selector,
    TargetTimeSelector,
    make_selector,
)

M = Measurement


def brute_force(
    name: str,
    profile: Sequence[Measurement],
    *,
    param: float | None,
    max_power_limit_w: float,
    num_gpus: int,
) -> Measurement:
    """The definition of each selector, written out with plain loops."""
    best: Measurement | None = None
    if name in ("energy", "time", "cost"):
        best_key = (math.inf, math.inf)
        for m in profile:
            if name == "energy":
                key = (m.energy_per_step_j, m.time_per_step_s)
            elif name == "time":
                key = (m.time_per_step_s, m.energy_per_step_j)
            else:
                assert param is not None
                cost = (
                    param * m.energy_per_step_j
                    + (1 - param) * max_power_limit_w * num_gpus * m.time_per_step_s
                )
                key = (cost, m.time_per_step_s)
            if key < best_key:
                best, best_key = m, key
        assert best is not None
        return best
    assert param is not None
    if name == "max_slowdown":
        top = max(profile, key=lambda m: m.power_limit_w)
        bound = param * top.time_per_step_s
    else:
        bound = param
    feasible = [m for m in profile if m.time_per_step_s <= bound]
    if not feasible:
        fastest = profile[0]
        for m in profile:
            if (m.time_per_step_s, m.energy_per_step_j) < (
                fastest.time_per_step_s,
                fastest.energy_per_step_j,
            ):
                fastest = m
        return fastest
    best = feasible[0]
    for m in feasible:
        if m.energy_per_step_j < best.energy_per_step_j:
            best = m
    return best


def synthetic_profile(rng: np.random.Generator, count: int) -> list[Measurement]:
    """A plausible frontier: time falls and power rises with the limit, plus jitter."""
    limits = np.linspace(300.0, 100.0, count)
    knee = rng.uniform(150.0, 250.0)
    base_s = rng.uniform(0.05, 0.5)
    profile = []
    for limit in limits:
        slow = 1.0 + max(0.0, (knee - limit) / knee) ** 1.5 * rng.uniform(1.0, 4.0)
        time_s = base_s * slow * (1 + rng.normal(0, 0.02))
        power_w = min(limit, knee + 30.0) * rng.uniform(0.8, 0.95)
        profile.append(M(float(limit), time_s, power_w * time_s, steps=10))
    order = rng.permutation(len(profile))
    return [profile[i] for i in order]


def selector_cases(profile: Sequence[Measurement]) -> list[tuple[str, float | None]]:
    times = sorted(m.time_per_step_s for m in profile)
    return [
        ("energy", None),
        ("time", None),
        ("cost", 0.0),
        ("cost", 0.5),
        ("cost", 0.9),
        ("cost", 1.0),
        ("max_slowdown", 1.0),
        ("max_slowdown", 1.1),
        ("max_slowdown", 1.5),
        ("target_time", times[0] * 0.9),  # nothing meets it: the fastest
        ("target_time", times[len(times) // 2]),
        ("target_time", times[-1] * 2),
    ]


def build(name: str, param: float | None) -> Selector:
    if name == "cost":
        return make_selector(name, eta=param)
    if name == "max_slowdown":
        return make_selector(name, max_slowdown=param)
    if name == "target_time":
        return make_selector(name, target_time_s=param)
    return make_selector(name)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("num_gpus", [1, 8])
def test_choice_equals_brute_force_on_synthetic_frontiers(seed: int, num_gpus: int) -> None:
    rng = np.random.default_rng(seed)
    profile = synthetic_profile(rng, count=int(rng.integers(2, 14)))
    for name, param in selector_cases(profile):
        chosen = build(name, param).select(profile, max_power_limit_w=300.0, num_gpus=num_gpus)
        expected = brute_force(
            name, profile, param=param, max_power_limit_w=300.0, num_gpus=num_gpus
        )
        assert chosen is expected, (name, param)


def trace_profiles(name: str) -> list[list[Measurement]]:
    trace = PowerTrace.load(name)
    profiles = []
    for workload in trace.workloads():
        w = trace.workload(*workload)
        profiles.append(
            [
                M(
                    p,
                    w.time_per_epoch_s(p) / 100,
                    w.average_power_w(p) * w.time_per_epoch_s(p) / 100,
                    1,
                )
                for p in w.power_limits_w
            ]
        )
    return profiles


@pytest.mark.parametrize("gpu", ["a40", "v100"])
def test_choice_equals_brute_force_on_trace_data(gpu: str) -> None:
    for profile in trace_profiles(gpu):
        top_w = max(m.power_limit_w for m in profile)
        for name, param in selector_cases(profile):
            chosen = build(name, param).select(profile, max_power_limit_w=top_w, num_gpus=1)
            expected = brute_force(name, profile, param=param, max_power_limit_w=top_w, num_gpus=1)
            assert chosen is expected, (name, param)


def test_cost_weighs_time_by_highest_limit_times_gpus_of_the_job() -> None:
    # 200 W: 10 % more time, 20 % less energy.
    profile = [M(300.0, 1.0, 200.0, 1), M(200.0, 1.1, 160.0, 1)]
    cost = make_selector("cost", eta=0.5)
    # one GPU: 0.5*200 + 0.5*300*1.0 = 250 vs 0.5*160 + 0.5*300*1.1 = 245 -> 200 W
    assert cost.select(profile, max_power_limit_w=300.0, num_gpus=1).power_limit_w == 200.0
    # energy is job-wide: with 2 GPUs the time term doubles -> 300 W (400 vs 410)
    assert cost.select(profile, max_power_limit_w=300.0, num_gpus=2).power_limit_w == 300.0


def test_ties_prefer_the_faster_limit_for_energy_and_the_cheaper_for_time() -> None:
    profile = [M(300.0, 1.0, 100.0, 1), M(250.0, 1.2, 100.0, 1), M(200.0, 1.0, 90.0, 1)]
    assert (
        make_selector("energy").select(profile, max_power_limit_w=300, num_gpus=1) is (profile[2])
    )
    tied = profile[:2]
    assert make_selector("energy").select(tied, max_power_limit_w=300, num_gpus=1) is tied[0]
    assert make_selector("time").select(profile, max_power_limit_w=300, num_gpus=1) is profile[2]


def test_max_slowdown_is_relative_to_the_highest_limit_in_any_order() -> None:
    profile = [M(200.0, 1.09, 70.0, 1), M(300.0, 1.0, 100.0, 1), M(150.0, 1.2, 60.0, 1)]
    chosen = make_selector("max_slowdown", max_slowdown=1.1).select(
        profile, max_power_limit_w=300.0, num_gpus=1
    )
    assert chosen.power_limit_w == 200.0


def test_target_time_falls_back_to_the_fastest() -> None:
    profile = [M(300.0, 1.0, 100.0, 1), M(200.0, 1.5, 70.0, 1)]
    selector = make_selector("target_time", target_time_s=0.5)
    assert selector.select(profile, max_power_limit_w=300.0, num_gpus=1).power_limit_w == 300.0


def gaps_of(selector: Selector, profile: Sequence[Measurement], slack: float = 0.0) -> list[float]:
    limits = np.array([m.power_limit_w for m in profile])
    gaps = selector.gaps(
        limits,
        np.array([[m.time_per_step_s for m in profile]]),
        np.array([[m.energy_per_step_j for m in profile]]),
        max_power_limit_w=float(limits.max()),
        num_gpus=1,
        time_slack=slack,
    )
    assert gaps.shape == (1, len(profile))
    return [float(g) for g in gaps[0]]


def test_gaps_are_relative_to_the_best_in_the_selectors_cost() -> None:
    profile = [M(300.0, 1.0, 100.0, 1), M(250.0, 1.05, 90.0, 1), M(200.0, 1.3, 99.0, 1)]
    assert gaps_of(make_selector("energy"), profile) == pytest.approx([1 / 9, 0.0, 0.1])
    assert gaps_of(make_selector("time"), profile) == pytest.approx([0.0, 0.05, 0.3])
    cost = [0.5 * e + 0.5 * 300 * t for e, t in ((100, 1.0), (90, 1.05), (99, 1.3))]
    expected = [c / min(cost) - 1 for c in cost]
    assert gaps_of(make_selector("cost", eta=0.5), profile) == pytest.approx(expected)


def test_gaps_mark_constraint_violations_beyond_the_slack_as_infinite() -> None:
    profile = [M(300.0, 1.0, 100.0, 1), M(250.0, 1.105, 90.0, 1), M(200.0, 1.3, 80.0, 1)]
    selector = make_selector("max_slowdown", max_slowdown=1.1)
    # 250 W is 0.45 % over the bound: a violation without slack, tolerated with 1 %.
    assert gaps_of(selector, profile) == [0.0, math.inf, math.inf]
    assert gaps_of(selector, profile, slack=0.01) == pytest.approx([0.0, 0.0, math.inf])
    # The optimum itself always meets the bound exactly.
    assert selector.select(profile, max_power_limit_w=300, num_gpus=1).power_limit_w == 300.0


def test_target_time_gaps_fall_back_to_time_when_nothing_meets_the_target() -> None:
    profile = [M(300.0, 1.0, 100.0, 1), M(200.0, 1.5, 70.0, 1)]
    selector = make_selector("target_time", target_time_s=0.5)
    assert gaps_of(selector, profile) == pytest.approx([0.0, 0.5])


def test_gaps_of_many_profiles_at_once_match_one_by_one() -> None:
    rng = np.random.default_rng(7)
    profiles = [sorted(synthetic_profile(rng, 6), key=lambda m: -m.power_limit_w) for _ in range(5)]
    for profile0 in profiles:
        assert [m.power_limit_w for m in profile0] == [m.power_limit_w for m in profiles[0]]
    limits = np.array([m.power_limit_w for m in profiles[0]])
    times = np.array([[m.time_per_step_s for m in p] for p in profiles])
    energies = np.array([[m.energy_per_step_j for m in p] for p in profiles])
    for name, param in selector_cases(profiles[0]):
        selector = build(name, param)
        batch = selector.gaps(limits, times, energies, max_power_limit_w=300.0, num_gpus=1)
        for k, profile in enumerate(profiles):
            assert list(batch[k]) == pytest.approx(gaps_of(selector, profile), abs=1e-12)
            chosen = selector.select(profile, max_power_limit_w=300.0, num_gpus=1)
            assert gaps_of(selector, profile)[profile.index(chosen)] == 0.0


def test_describe_and_names() -> None:
    assert SELECTOR_NAMES == ("energy", "time", "cost", "max_slowdown", "target_time")
    assert make_selector("energy").describe() == "energy"
    assert make_selector("time").describe() == "time"
    assert make_selector("cost", eta=0.5).describe() == "cost(eta=0.5)"
    assert make_selector("max_slowdown", max_slowdown=1.1).describe() == "max_slowdown(factor=1.1)"
    assert make_selector("target_time", target_time_s=0.25).describe() == (
        "target_time(target_time_s=0.25)"
    )
    for name in SELECTOR_NAMES:
        selector = build(name, {"cost": 0.5, "max_slowdown": 1.2, "target_time": 1.0}.get(name))
        assert isinstance(selector, Selector)
        assert selector.name == name


def test_parameters_irrelevant_to_the_selector_are_accepted_when_valid() -> None:
    selector = make_selector("energy", eta=0.5, max_slowdown=1.1, target_time_s=None)
    assert selector.describe() == "energy"


@pytest.mark.parametrize(
    ("kwargs", "key", "value", "allowed"),
    [
        (
            {"name": "fastest"},
            "selector",
            "'fastest'",
            "energy, time, cost, max_slowdown, target_time",
        ),
        ({"name": "cost", "eta": 1.5}, "eta", "1.5", "[0, 1]"),
        ({"name": "cost", "eta": -0.1}, "eta", "-0.1", "[0, 1]"),
        ({"name": "cost", "eta": math.nan}, "eta", "nan", "[0, 1]"),
        ({"name": "cost", "eta": True}, "eta", "True", "[0, 1]"),
        ({"name": "cost"}, "eta", "None", "[0, 1]"),
        ({"name": "max_slowdown", "max_slowdown": 0.9}, "max_slowdown", "0.9", ">= 1"),
        ({"name": "max_slowdown"}, "max_slowdown", "None", ">= 1"),
        ({"name": "target_time", "target_time_s": 0.0}, "target_time_s", "0.0", "> 0"),
        ({"name": "target_time", "target_time_s": -2.0}, "target_time_s", "-2.0", "> 0"),
        ({"name": "target_time"}, "target_time_s", "None", "> 0"),
        ({"name": "energy", "max_slowdown": 0.5}, "max_slowdown", "0.5", ">= 1"),
    ],
)
def test_bad_input_names_key_value_and_allowed(
    kwargs: dict[str, object], key: str, value: str, allowed: str
) -> None:
    args = dict(kwargs)
    name = args.pop("name")
    with pytest.raises(ConfigError) as info:
        make_selector(name, **args)  # type: ignore[arg-type]
    (problem,) = info.value.problems
    assert problem.startswith(f"{key}: {value} is not allowed")
    assert allowed in problem


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        make_selector("nope", eta=2.0, max_slowdown=0.5, target_time_s=-1.0)
    keys = [p.split(":")[0] for p in info.value.problems]
    assert keys == ["selector", "eta", "max_slowdown", "target_time_s"]


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match=r"eta: 2\.0"):
        CostSelector(eta=2.0)
    with pytest.raises(ConfigError, match=r"max_slowdown: 0\.5"):
        MaxSlowdownSelector(factor=0.5)
    with pytest.raises(ConfigError, match="target_time_s: 0"):
        TargetTimeSelector(target_time_s=0)


def test_measurements_and_profiles_are_validated() -> None:
    with pytest.raises(ProfileError, match=r"time_per_step_s=0\.0"):
        M(300.0, 0.0, 10.0, 1)
    with pytest.raises(ProfileError, match="energy_per_step_j=nan"):
        M(300.0, 1.0, math.nan, 1)
    with pytest.raises(ProfileError, match="empty profile"):
        make_selector("energy").select([], max_power_limit_w=300.0, num_gpus=1)
    with pytest.raises(ProfileError, match="empty profile"):
        make_selector("max_slowdown", max_slowdown=1.1).select(
            [], max_power_limit_w=300.0, num_gpus=1
        )
