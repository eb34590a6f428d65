"""The partition search: exhaustive and Optuna, Pareto sets, hypervolume, resuming."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.kareus.partition import SEQUENTIAL, PartitionSetting
from lightning_energy.kareus.search import (
    MeasuredPoint,
    MeasurementCache,
    SearchSpace,
    hypervolume,
    pareto_front,
    read_measurements,
    search_partition,
)
from tests.lightning_energy.kareus.meters import STATIC_W, ExactMeter

SMALL = SearchSpace(clocks_mhz=(1410, 1200, 1005), ctas=(2, 8, 20), slots=(SEQUENTIAL, 0, 3, 6))
MEDIUM = SearchSpace(
    clocks_mhz=range(1410, 899, -60), ctas=range(2, 21, 2), slots=range(SEQUENTIAL, 7)
)


def point(t: float, e: float, ctas: int = 1) -> MeasuredPoint:
    return MeasuredPoint(PartitionSetting(1410, ctas, 0), t, e)


def test_pareto_front_keeps_what_nothing_beats_in_time_and_effective_energy() -> None:
    points = [point(1.0, 10.0, 1), point(2.0, 9.0, 2), point(2.0, 12.0, 3), point(3.0, 14.0, 4)]
    # Effective energy with 2 W static: 8, 5, 8, 8 -> (3.0, 14) is beaten by (2.0, 9).
    assert [p.setting.ctas for p in pareto_front(points, 2.0)] == [1, 2]
    # Without static power (3.0, 14) is still beaten; (2.0, 12) too.
    assert [p.setting.ctas for p in pareto_front(points, 0.0)] == [1, 2]


def test_hypervolume_is_the_dominated_area_inside_the_reference() -> None:
    # [1, 2) x [3, 4) and [2, 4) x [1, 4)
    assert hypervolume([(1.0, 3.0), (2.0, 1.0)], (4.0, 4.0)) == pytest.approx(1 * 1 + 2 * 3)
    assert hypervolume([(1.0, 3.0), (5.0, 0.0)], (4.0, 4.0)) == pytest.approx(3.0)
    assert hypervolume([], (1.0, 1.0)) == 0.0


def test_exhaustive_search_measures_the_grid_once_and_returns_its_front() -> None:
    meter = ExactMeter()
    result = search_partition(
        meter, "fwd_attn", SMALL, budget=1, static_power_w=STATIC_W, sampler="exhaustive"
    )
    assert sorted(meter.settings) == sorted(SMALL.grid()) and result.measured == SMALL.size
    everything = [
        MeasuredPoint(s, t, e)
        for s, (t, e) in zip(SMALL.grid(), meter.group.exact("fwd_attn", SMALL.grid()), strict=True)
    ]
    assert list(result.front) == pareto_front(everything, STATIC_W)
    # The front trades time for effective energy, and holds more than one clock and slot.
    assert len({p.setting.clock_mhz for p in result.front}) > 1
    assert len({p.setting.slot for p in result.front}) > 1


@pytest.mark.parametrize("sampler", ["tpe", "nsga2"])
def test_optuna_search_finds_the_exhaustive_pareto_set_of_a_small_grid(sampler: str) -> None:
    pytest.importorskip("optuna")
    meter = ExactMeter()
    result = search_partition(
        meter,
        "fwd_attn",
        SMALL,
        budget=SMALL.size,
        static_power_w=STATIC_W,
        sampler=sampler,
        batch_size=5,
    )
    exhaustive = search_partition(
        ExactMeter(), "fwd_attn", SMALL, budget=1, static_power_w=STATIC_W, sampler="exhaustive"
    )
    assert len(meter.settings) == len(set(meter.settings)) == SMALL.size  # each measured once
    assert result.front == exhaustive.front
    import optuna

    assert optuna.logging.get_verbosity() == optuna.logging.INFO  # left as it was


@pytest.mark.parametrize("sampler", ["tpe", "nsga2"])
def test_a_third_of_a_grid_reaches_95_percent_of_its_hypervolume(sampler: str) -> None:
    pytest.importorskip("optuna")
    budget = MEDIUM.size * 3 // 10
    found = search_partition(
        ExactMeter(),
        "bwd_attn",
        MEDIUM,
        budget=budget,
        static_power_w=STATIC_W,
        sampler=sampler,
        seed=1,
    )
    grid = search_partition(
        ExactMeter(), "bwd_attn", MEDIUM, budget=1, static_power_w=STATIC_W, sampler="exhaustive"
    )
    assert len(found.points) == budget
    reference = (
        1.1 * max(p.time_s for p in grid.front),
        1.1 * max(p.effective_energy_j(STATIC_W) for p in grid.front),
    )

    def hv(points: tuple[MeasuredPoint, ...]) -> float:
        return hypervolume([(p.time_s, p.effective_energy_j(STATIC_W)) for p in points], reference)

    assert hv(found.front) >= 0.95 * hv(grid.front)


@pytest.mark.parametrize("sampler", ["tpe", "exhaustive"])
def test_a_search_resumes_from_its_file_without_measuring_again(
    tmp_path: Path, sampler: str
) -> None:
    if sampler != "exhaustive":
        pytest.importorskip("optuna")
    path = tmp_path / "fwd_attn.jsonl"
    crashing = ExactMeter(fail_after=20)
    with pytest.raises(RuntimeError, match="fell off the bus"):
        search_partition(
            crashing,
            "fwd_attn",
            SMALL,
            budget=30,
            static_power_w=STATIC_W,
            sampler=sampler,
            cache=MeasurementCache("fwd_attn", path),
            batch_size=8,
        )
    saved = read_measurements(path, "fwd_attn")
    assert [p.setting for p in saved] == crashing.settings  # every finished batch, no more
    assert len(saved) == 16
    resumed = ExactMeter()
    result = search_partition(
        resumed,
        "fwd_attn",
        SMALL,
        budget=30,
        static_power_w=STATIC_W,
        sampler=sampler,
        cache=MeasurementCache("fwd_attn", path),
        batch_size=8,
    )
    assert not set(resumed.settings) & {p.setting for p in saved}
    expected = SMALL.size if sampler == "exhaustive" else 30
    assert len(result.points) == expected and result.measured == expected - 16
    assert len(read_measurements(path)) == expected


def test_measurement_files_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("not json\n")
    with pytest.raises(ProfileError, match="not a partition measurement file"):
        MeasurementCache("fwd_attn", path)
    header = json.dumps({"format": "lightning-energy/kareus-measurements", "key": "fwd_mlp"})
    path.write_text(header + "\n")
    with pytest.raises(ProfileError, match="holds partition 'fwd_mlp', not 'fwd_attn'"):
        MeasurementCache("fwd_attn", path)
    row = {
        "clock_mhz": 1410,
        "ctas": 4,
        "slot": 0,
        "block_threads": 1024,
        "time_s": -1.0,
        "energy_j": 2.0,
    }
    path.write_text(header + "\n" + json.dumps(row) + "\n{\n")
    with pytest.raises(ProfileError, match=r"2 problem\(s\)") as err:
        read_measurements(path, "fwd_mlp")
    assert "line 2: time_s and energy_j" in str(err.value) and "line 3" in str(err.value)


def test_bad_search_arguments_are_all_reported() -> None:
    with pytest.raises(ConfigError) as err:
        search_partition(
            ExactMeter(),
            "fwd_attn",
            SMALL,
            budget=0,
            static_power_w=-1.0,
            sampler="grid",
            batch_size=0,
            cache=MeasurementCache("fwd_mlp"),
        )
    message = str(err.value)
    for needed in (
        "sampler: 'grid' is not allowed; allowed: tpe, nsga2, exhaustive",
        "budget: 0",
        "batch_size: 0",
        "static_power_w: -1.0",
        "cache: holds 'fwd_mlp'",
    ):
        assert needed in message
    with pytest.raises(ConfigError, match="ctas"):
        SearchSpace(clocks_mhz=(1410,), ctas=(0,), slots=(0,))


def test_a_sampler_without_optuna_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna -> ImportError
    with pytest.raises(ConfigError, match=r"lightning-energy\[kareus\].*sampler='exhaustive'"):
        search_partition(ExactMeter(), "fwd_attn", SMALL, budget=4, static_power_w=STATIC_W)


@pytest.mark.parametrize("value", [10**400, -(10**400), "1e400"])
@pytest.mark.parametrize("field", ["clock_mhz", "ctas", "time_s", "energy_j"])
def test_a_number_no_float_holds_is_a_bad_line(tmp_path: Path, field: str, value: object) -> None:
    """JSON reads 1 followed by 400 zeros as an exact int (and 1e400 as infinity): the line
    is named as bad, no OverflowError escapes."""
    header = json.dumps({"format": "lightning-energy/kareus-measurements", "key": "fwd_mlp"})
    row = json.dumps({"clock_mhz": 1410, "ctas": 4, "slot": 0, "block_threads": 1024})[:-1]
    shown = value if isinstance(value, str) else json.dumps(value)
    path = tmp_path / "m.jsonl"
    path.write_text(f'{header}\n{row}, "time_s": 1.0, "energy_j": 2.0, "{field}": {shown}}}\n')
    with pytest.raises(ProfileError, match="line 2"):
        read_measurements(path, "fwd_mlp")
