from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_energy.errors import ProfileError
from lightning_energy.perseus import Instruction, PipelineProfile, Plan, evaluate, one_f_one_b

# Baseline energies in the profiles' README (every instruction at 1410 MHz).
README_BASELINE_J = {"S4_M8": 1921.9, "S8_M16": 3804.0, "S8_M32": 7367.2}


@pytest.mark.parametrize("name", sorted(README_BASELINE_J))
def test_evaluate_matches_the_readme_baseline(data_dir: Path, name: str) -> None:
    stages, microbatches = (int(x[1:]) for x in name.split("_"))
    profile = PipelineProfile.from_csv(
        data_dir / "perseus_profiles" / f"profile_{name}.csv", blocked_power_w=70.0
    )
    result = evaluate(Plan.uniform(one_f_one_b(stages, microbatches), 1410), profile)
    assert result.energy_j == pytest.approx(README_BASELINE_J[name], abs=0.05)
    assert result.compute_energy_j + result.blocked_energy_j == pytest.approx(result.energy_j)


def test_blocked_energy_counts_every_idle_device_second() -> None:
    rows = [
        (s, kind, 1000, t, 10.0 * t)
        for s in range(2)
        for kind, t in (("forward", 1.0), ("backward", 2.0))
    ]
    profile = PipelineProfile.from_rows(rows, blocked_power_w=5.0)
    result = evaluate(Plan.uniform(one_f_one_b(2, 1), 1000), profile)
    # F0 F1 B1 B0 in sequence: T = 6 s, each device busy 3 s and idle 3 s.
    assert result.iteration_time_s == pytest.approx(6.0)
    assert result.compute_energy_j == pytest.approx(60.0)
    assert result.blocked_energy_j == pytest.approx(5.0 * (2 * 6.0 - 6.0))


def test_each_wait_draws_the_blocked_power_of_the_clock_in_force() -> None:
    """A device waits for an instruction's input at that instruction's clock (the runtime
    sets it, then receives), and for the iteration's end at its last clock."""
    rows = [
        (s, kind, f, t, 10.0 * t)
        for s in range(2)
        for kind, times in (
            ("forward", {1410: 1.0, 1005: 2.0}),
            ("backward", {1410: 2.0, 1005: 3.0}),
        )
        for f, t in times.items()
    ]
    profile = PipelineProfile.from_rows(rows, blocked_power_w={1410: 100.0, 1005: 80.0})
    schedule = one_f_one_b(2, 1)  # device 0: F0 then B0; device 1: F1 then B1
    clocks = {"F0": 1410, "B0": 1005, "F1": 1005, "B1": 1410}
    plan = Plan(schedule, tuple(clocks[f"{i.kind[0].upper()}{i.stage}"] for i in schedule.nodes))
    result = evaluate(plan, profile)
    # F0 [0, 1], F1 [1, 3], B1 [3, 5], B0 [5, 8]: T = 8 s.
    assert result.iteration_time_s == pytest.approx(8.0)
    # Device 0 waits 4 s before B0 (1005 MHz); device 1 waits 1 s before F1 (1005 MHz)
    # and 3 s after B1 (1410 MHz).
    assert result.blocked_energy_j == pytest.approx(4 * 80.0 + 1 * 80.0 + 3 * 100.0)
    assert profile.min_blocked_power_w == 80.0


def test_json_round_trip(tmp_path: Path) -> None:
    schedule = one_f_one_b(2, 3)
    freqs = tuple(1410 - 15 * (i % 5) for i in range(len(schedule.nodes)))
    plan = Plan(schedule, freqs, {"energy_j": 12.5})
    path = tmp_path / "sub" / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.metadata == {"energy_j": 12.5}
    assert loaded.frequency_mhz(Instruction(1, 2, "backward")) == plan.frequency_mhz(
        Instruction(1, 2, "backward")
    )
    assert [i for i, _ in loaded.device_plan(1)] == list(schedule.device_orders[1])
    assert json.loads(path.read_text())["schedule"]["name"] == "1f1b"


def test_malformed_plans_are_rejected(tmp_path: Path) -> None:
    schedule = one_f_one_b(2, 2)
    good = Plan.uniform(schedule, 1200).to_dict()
    with pytest.raises(ProfileError, match="not valid JSON"):
        Plan.from_json("[1, 2")
    with pytest.raises(ProfileError, match="format"):
        Plan.from_dict({**good, "format": "python"})
    with pytest.raises(ProfileError, match="version"):
        Plan.from_dict({**good, "version": 99})
    bad = json.loads(json.dumps(good))
    bad["frequencies_mhz"][0]["forward"][0] = "__import__('os')"
    with pytest.raises(ProfileError, match="not an integer clock"):
        Plan.from_dict(bad)
    short = json.loads(json.dumps(good))
    short["frequencies_mhz"][1]["backward"] = [1200]
    with pytest.raises(ProfileError, match="missing"):
        Plan.from_dict(short)
    with pytest.raises(ProfileError, match="cannot read"):
        Plan.load(tmp_path / "nope.json")
    with pytest.raises(ProfileError, match="clocks for"):
        Plan(schedule, (1200,))
    with pytest.raises(ProfileError, match="not positive"):
        Plan(schedule, (0,) * len(schedule.nodes))


def test_evaluate_rejects_a_clock_the_profile_lacks() -> None:
    rows = [(s, k, 1410, 0.1, 1.0) for s in range(2) for k in ("forward", "backward")]
    profile = PipelineProfile.from_rows(rows, blocked_power_w=70.0)
    with pytest.raises(ProfileError, match="1200 MHz is not in the profile"):
        evaluate(Plan.uniform(one_f_one_b(2, 2), 1200), profile)


@pytest.mark.parametrize(
    "text",
    [
        '"metadata": {"time_s": 1%s}' % ("0" * 400),
        '"metadata": {"time_s": -1%s}' % ("0" * 400),
        '"schedule": {"name": "1f1b", "num_stages": 1e400, "num_microbatches": 2}',
    ],
)
def test_a_plan_number_no_float_holds_is_malformed(text: str) -> None:
    good = Plan.uniform(one_f_one_b(2, 2), 1200).to_dict()
    key = text.split('"')[1]
    data = json.dumps({k: v for k, v in good.items() if k != key})
    with pytest.raises(ProfileError, match="malformed plan"):
        Plan.from_json(data[:-1] + ", " + text + "}")


@pytest.mark.parametrize("count", ["num_stages", "num_microbatches"])
def test_a_plan_for_more_instructions_than_a_schedule_holds_is_refused(count: str) -> None:
    data = Plan.uniform(one_f_one_b(2, 2), 1200).to_dict()
    data["schedule"][count] = 10**400
    with pytest.raises(ProfileError, match=f"{count}=.*instructions is not allowed"):
        Plan.from_dict(data)
