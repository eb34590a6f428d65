"""Composition of partition points into instruction options, and Kareus planning."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.kareus.compose import (
    KareusPlan,
    KareusPlanner,
    instruction_options,
    reprice,
)
from lightning_energy.kareus.partition import PARTITION_KEYS, SEQUENTIAL, PartitionSetting
from lightning_energy.kareus.search import MeasuredPoint, SearchSpace, search_partition
from lightning_energy.perseus.planning.planner import PerseusPlanner
from lightning_energy.perseus.planning.profile import PipelineProfile
from lightning_energy.perseus.planning.schedule import Instruction, one_f_one_b
from tests.lightning_energy.kareus.meters import STATIC_W, ExactMeter

CLOCKS = (1410, 1200, 1005)
LAYERS = (3, 2)


def rest_profile(meter: ExactMeter) -> PipelineProfile:
    return PipelineProfile.from_rows(
        meter.group.non_partition_rows(LAYERS, CLOCKS), blocked_power_w=STATIC_W
    )


@pytest.fixture(scope="module")
def points() -> dict[str, list[MeasuredPoint]]:
    """Every setting of a small grid of each partition, noise-free."""
    meter = ExactMeter()
    out = {}
    for key in PARTITION_KEYS:
        space = SearchSpace(CLOCKS, (2, 6, 12, 20), meter.group.partition(key).slots)
        out[key] = list(
            search_partition(
                meter, key, space, budget=1, static_power_w=STATIC_W, sampler="exhaustive"
            ).points
        )
    return out


def one_per_clock(meter: ExactMeter, ctas: int, slot: int) -> dict[str, list[MeasuredPoint]]:
    out = {}
    for key in PARTITION_KEYS:
        settings = [PartitionSetting(f, ctas, slot) for f in CLOCKS]
        out[key] = [
            MeasuredPoint(s, t, e)
            for s, (t, e) in zip(settings, meter.measure(key, settings), strict=True)
        ]
    return out


def test_an_option_is_layers_times_nanobatches_times_its_partitions_plus_the_rest() -> None:
    def pts(clock: int, t: float, e: float) -> MeasuredPoint:
        return MeasuredPoint(PartitionSetting(clock, 4, 0), t, e)

    points = {
        "fwd_attn": [pts(1410, 1.0, 10.0), pts(1200, 1.2, 9.0), pts(1005, 9.0, 99.0)],
        "fwd_mlp": [pts(1410, 2.0, 20.0), pts(1200, 2.4, 18.0)],
        "bwd_attn": [pts(1410, 3.0, 30.0), pts(1200, 3.6, 27.0)],
        "bwd_mlp": [pts(1410, 4.0, 40.0), pts(1200, 4.8, 36.0)],
    }
    rows = [
        (s, k, f, 0.5, 5.0)
        for s in (0, 1)
        for k in ("forward", "backward")
        for f in (1410, 1200, 1005)
    ]
    rest = PipelineProfile.from_rows(rows, blocked_power_w=1.0)
    options = instruction_options(points, rest, [3, 2])
    # 1005 MHz is not measured for fwd_mlp: no forward option there.
    assert {o.clock_mhz for o in options[(0, "forward")]} == {1410, 1200}
    fastest = options[(0, "forward")][0]
    assert fastest.clock_mhz == 1410
    assert fastest.time_s == pytest.approx(3 * 2 * (1.0 + 2.0) + 0.5)
    assert fastest.energy_j == pytest.approx(3 * 2 * (10.0 + 20.0) + 5.0)
    assert dict(fastest.partitions) == {
        "fwd_attn": points["fwd_attn"][0].setting,
        "fwd_mlp": points["fwd_mlp"][0].setting,
    }
    assert options[(1, "backward")][-1].time_s == pytest.approx(2 * 2 * (3.6 + 4.8) + 0.5)
    whole = instruction_options(points, rest, [3, 2], nanobatches=1)
    assert whole[(0, "forward")][0].time_s == pytest.approx(3 * (1.0 + 2.0) + 0.5)


def test_options_that_cannot_compose_are_refused_with_the_reason() -> None:
    meter = ExactMeter()
    points = one_per_clock(meter, 8, 0)
    rest = rest_profile(meter)
    with pytest.raises(ProfileError, match=r"no measured points for partitions \['bwd_mlp'\]"):
        instruction_options({k: v for k, v in points.items() if k != "bwd_mlp"}, rest, LAYERS)
    shifted = dict(points, fwd_mlp=[MeasuredPoint(PartitionSetting(915, 8, 0), 1.0, 1.0)])
    with pytest.raises(ProfileError, match="forward: no clock is measured for all of"):
        instruction_options(shifted, rest, LAYERS)
    with pytest.raises(ProfileError, match="2 stages, layers_per_stage 3"):
        instruction_options(points, rest, [1, 1, 1])
    with pytest.raises(ConfigError, match="layers_per_stage"):
        instruction_options(points, rest, [3, 0])


def test_one_option_per_clock_plans_exactly_as_perseus() -> None:
    """Kareus planning is the Perseus planner over labelled options: with one option per
    clock it must give Perseus' own frontier."""
    meter = ExactMeter(nanobatched=False)
    points = one_per_clock(meter, 20, SEQUENTIAL)
    rest = rest_profile(meter)
    schedule = one_f_one_b(2, 4)
    options = instruction_options(points, rest, LAYERS, nanobatches=1)
    kareus = KareusPlanner(options, schedule, blocked_power_w=STATIC_W, exact_max_options=0)
    profile = PipelineProfile.from_rows(
        [
            (s, k, o.clock_mhz, o.time_s, o.energy_j)
            for (s, k), opts in options.items()
            for o in opts
        ],
        blocked_power_w=STATIC_W,
    )
    perseus = PerseusPlanner(profile, schedule, exact_max_options=0).frontier()
    ours = kareus.frontier()
    np.testing.assert_allclose(
        [(p.iteration_time_s, p.energy_j) for p in ours],
        [(p.iteration_time_s, p.energy_j) for p in perseus],
        rtol=1e-12,
    )
    assert [p.plan.clock_plan().frequencies_mhz for p in ours] == [
        p.plan.frequencies_mhz for p in perseus
    ]


def test_kareus_is_never_worse_than_perseus_alone_on_the_model(
    points: dict[str, list[MeasuredPoint]],
) -> None:
    meter = ExactMeter()
    whole = ExactMeter(nanobatched=False)
    rest = rest_profile(meter)
    schedule = one_f_one_b(2, 4)
    perseus = KareusPlanner(
        instruction_options(one_per_clock(whole, 20, SEQUENTIAL), rest, LAYERS, nanobatches=1),
        schedule,
        blocked_power_w=STATIC_W,
        exact_max_options=0,
    )
    kareus = KareusPlanner(
        instruction_options(points, rest, LAYERS), schedule, blocked_power_w=STATIC_W
    )
    base = perseus.frontier()
    for target in np.linspace(base[0].iteration_time_s, base[-1].iteration_time_s, 4):
        ours = kareus.plan_for_time(float(target))
        theirs = perseus.plan_for_time(float(target))
        assert ours.iteration_time_s <= target * (1 + 1e-9)
        assert ours.energy_j <= theirs.energy_j
    # And at Perseus' fastest time the overlap leaves room to save a good share.
    assert kareus.plan_for_time(base[0].iteration_time_s).energy_j < 0.9 * base[0].energy_j


def test_plans_carry_clock_and_partition_settings_and_round_trip(
    tmp_path: Path, points: dict[str, list[MeasuredPoint]]
) -> None:
    options = instruction_options(points, rest_profile(ExactMeter()), LAYERS)
    planner = KareusPlanner(options, one_f_one_b(2, 4), blocked_power_w=STATIC_W)
    point = planner.plan_no_slowdown()
    plan = point.plan
    first = plan.choice(Instruction(0, 0, "forward"))
    assert first in options[(0, "forward")]
    assert {k for k, _ in first.partitions} == {"fwd_attn", "fwd_mlp"}
    assert {s.clock_mhz for _, s in first.partitions} == {first.clock_mhz}
    path = tmp_path / "kareus_plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "lightning-energy/kareus-plan"
    assert set(data["stages"][0]["backward"][0]) == {"clock_mhz", "bwd_attn", "bwd_mlp"}
    again = KareusPlan.load(path)
    assert [(c.clock_mhz, c.partitions) for c in again.choices] == [
        (c.clock_mhz, c.partitions) for c in plan.choices
    ]
    assert again.clock_plan().frequencies_mhz == plan.clock_plan().frequencies_mhz
    data["stages"][0]["forward"][0].pop("fwd_mlp")
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="malformed kareus plan"):
        KareusPlan.load(path)
    path.write_text(json.dumps({"format": "lightning-energy/perseus-plan"}))
    with pytest.raises(ProfileError, match="not a kareus plan"):
        KareusPlan.load(path)


def test_a_plan_is_costed_again_on_other_values_of_its_settings(
    points: dict[str, list[MeasuredPoint]],
) -> None:
    rest = rest_profile(ExactMeter())
    options = instruction_options(points, rest, LAYERS)
    planner = KareusPlanner(options, one_f_one_b(2, 4), blocked_power_w=STATIC_W)
    point = planner.plan_no_slowdown()
    lookup = {key: {p.setting: p for p in pts} for key, pts in points.items()}
    same = planner.evaluate(point, reprice(planner.options, lookup, rest, LAYERS))
    assert (same.iteration_time_s, same.energy_j) == pytest.approx(
        (point.iteration_time_s, point.energy_j)
    )
    doubled = {
        key: {s: MeasuredPoint(s, 2 * p.time_s, 2 * p.energy_j) for s, p in table.items()}
        for key, table in lookup.items()
    }
    slower = planner.evaluate(point, reprice(planner.options, doubled, rest, LAYERS))
    assert slower.iteration_time_s > 1.5 * point.iteration_time_s


@pytest.mark.parametrize(
    ("where", "value"),
    [("metadata", 10**400), ("metadata", -(10**400)), ("num_stages", float("inf"))],
)
def test_a_plan_number_no_float_holds_is_malformed(where: str, value: float) -> None:
    data: dict[str, object] = {
        "format": "lightning-energy/kareus-plan",
        "version": 1,
        "schedule": {"name": "1f1b", "num_stages": 1, "num_microbatches": 1},
        "stages": [],
        "metadata": {"time_s": 1.0},
    }
    if where == "metadata":
        data["metadata"] = {"time_s": value}
    else:
        data["schedule"] = {"name": "1f1b", "num_stages": value, "num_microbatches": 1}
    with pytest.raises(ProfileError, match="malformed kareus plan"):
        KareusPlan.from_dict(data)
