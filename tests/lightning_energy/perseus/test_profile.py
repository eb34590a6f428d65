from __future__ import annotations

from pathlib import Path

import pytest

from lightning_energy.errors import ProfileError
from lightning_energy.perseus import PipelineProfile


def _rows() -> list[tuple[int, str, int, float, float]]:
    return [
        (stage, kind, f, t * 1410 / f, 18.0 * f / 1410)
        for stage in range(2)
        for kind, t in (("forward", 0.05), ("backward", 0.1))
        for f in (1410, 1200)
    ]


def test_shipped_profiles_load(data_dir: Path) -> None:
    for name, stages in (("S4_M8", 4), ("S8_M16", 8), ("S8_M32", 8)):
        profile = PipelineProfile.from_csv(
            data_dir / "perseus_profiles" / f"profile_{name}.csv", blocked_power_w=70.0
        )
        assert profile.num_stages == stages
        assert profile.instructions == ("forward", "backward")
        assert profile.frequencies_mhz[0] == 1410
        assert profile.frequencies_mhz[-1] == 510
        assert len(profile.frequencies_mhz) == 61


def test_csv_round_trip(tmp_path: Path) -> None:
    profile = PipelineProfile.from_rows(_rows(), blocked_power_w=60.0)
    path = tmp_path / "p.csv"
    profile.to_csv(path)
    again = PipelineProfile.from_csv(path, blocked_power_w=60.0)
    assert again.rows() == profile.rows()
    assert again.entry(1, "backward").at(1200) == profile.entry(1, "backward").at(1200)


def test_every_problem_is_reported_at_once() -> None:
    rows = _rows()
    rows.append(rows[0])  # duplicate
    rows = [r for r in rows if not (r[0] == 1 and r[1] == "forward" and r[2] == 1200)]
    rows.append((3, "forward", 1410, 0.05, 18.0))  # stage 2 missing
    rows.append((0, "forward", 1000, -0.1, 0.0))  # non-positive
    with pytest.raises(ProfileError) as info:
        PipelineProfile.from_rows(rows, blocked_power_w=-5.0)
    message = str(info.value)
    assert "duplicate row" in message
    assert "stages [2] missing" in message
    assert "stage 1 forward: frequencies [1200, 1000] MHz missing" in message
    assert "time=-0.1" in message and "energy=0.0" in message
    assert "stage 3 backward: missing" in message
    assert "blocked_power_w: -5.0 is not allowed" in message


def test_csv_errors(tmp_path: Path) -> None:
    bad_header = tmp_path / "h.csv"
    bad_header.write_text("stage,instruction,freq,time,energy\n0,forward,1410,1,1\n")
    with pytest.raises(ProfileError, match="columns \\['frequency'\\] missing"):
        PipelineProfile.from_csv(bad_header, blocked_power_w=70.0)
    bad_value = tmp_path / "v.csv"
    bad_value.write_text("stage,instruction,frequency,time,energy\n0,forward,1410,fast,1\n")
    with pytest.raises(ProfileError, match="line 2: not numeric"):
        PipelineProfile.from_csv(bad_value, blocked_power_w=70.0)
    with pytest.raises(ProfileError, match="cannot read"):
        PipelineProfile.from_csv(tmp_path / "missing.csv", blocked_power_w=70.0)


def test_entry_and_frequency_lookup_errors() -> None:
    profile = PipelineProfile.from_rows(_rows(), blocked_power_w=70.0)
    with pytest.raises(ProfileError, match="not in the profile"):
        profile.entry(5, "forward")
    with pytest.raises(ProfileError, match="900 MHz is not in the profile"):
        profile.entry(0, "forward").at(900)


def test_restricted_keeps_only_given_clocks() -> None:
    profile = PipelineProfile.from_rows(_rows(), blocked_power_w=70.0)
    assert profile.restricted([1200, 999]).frequencies_mhz == (1200,)
    with pytest.raises(ProfileError, match="none of the clocks"):
        profile.restricted([1])


def test_blocked_power_per_clock(tmp_path: Path) -> None:
    """A GPU blocked in NCCL spins at the locked clock: one blocked power per clock. A
    single number still loads (profiles on disk carry none)."""
    path = tmp_path / "p.csv"
    PipelineProfile.from_rows(_rows(), blocked_power_w=70.0).to_csv(path)
    per_clock = {1410: 100.0, 1200: 90.0, 900: 75.0}  # clocks not profiled are dropped
    profile = PipelineProfile.from_csv(path, blocked_power_w=per_clock)
    assert profile.blocked_power_w == {1410: 100.0, 1200: 90.0}
    assert (profile.blocked_power_at(1410), profile.blocked_power_at(1200)) == (100.0, 90.0)
    assert profile.min_blocked_power_w == 90.0
    assert profile.restricted([1200]).blocked_power_w == {1200: 90.0}
    single = PipelineProfile.from_csv(path, blocked_power_w=70.0)
    assert (single.blocked_power_at(1410), single.min_blocked_power_w) == (70.0, 70.0)
    with pytest.raises(ProfileError, match="blocked power at 900 MHz: not a profiled clock"):
        profile.blocked_power_at(900)
    with pytest.raises(ProfileError) as info:
        PipelineProfile.from_rows(_rows(), blocked_power_w={1410: -1.0, 1000: float("nan")})
    message = str(info.value)
    assert "blocked_power_w at 1410 MHz: -1.0 is not allowed" in message
    assert "blocked_power_w at 1000 MHz: nan is not allowed" in message
    assert "blocked_power_w: no value at [1200] MHz" in message


@pytest.mark.parametrize("column", ["frequency", "time", "energy"])
@pytest.mark.parametrize("value", ["1e400", str(10**400), str(-(10**400))])
def test_a_csv_number_no_float_holds_is_named(tmp_path: Path, column: str, value: str) -> None:
    row = {"stage": "0", "instruction": "forward", "frequency": "1410", "time": "1", "energy": "1"}
    row[column] = value
    path = tmp_path / "p.csv"
    path.write_text("stage,instruction,frequency,time,energy\n" + ",".join(row.values()) + "\n")
    with pytest.raises(ProfileError, match=r"line 2: |at 1410 MHz: "):
        PipelineProfile.from_csv(path, blocked_power_w=70.0)


@pytest.mark.parametrize("huge", [10**400, -(10**400)])
def test_numbers_no_float_holds_are_named(huge: int) -> None:
    with pytest.raises(ProfileError, match=r"blocked_power_w: .* is not allowed"):
        PipelineProfile.from_rows(_rows(), blocked_power_w=huge)
    with pytest.raises(ProfileError, match=r"blocked_power_w at 1410 MHz: .* is not allowed"):
        PipelineProfile.from_rows(_rows(), blocked_power_w={1410: huge, 1200: 70.0})
    rows = [*_rows()[1:], (0, "forward", 1410, huge, 1.0)]
    with pytest.raises(ProfileError, match="stage 0 forward at 1410 MHz: time="):
        PipelineProfile.from_rows(rows, blocked_power_w=70.0)
