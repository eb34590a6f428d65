"""The measured runs the governed presets are fitted on: the shipped files load, and a bad
row is refused naming the file, the row and what is allowed."""

from __future__ import annotations

import csv
import io
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_energy.device.simulated.measured import (
    DATA_DIR,
    load_locked_profile,
    load_power_cap_runs,
    relative_gaps,
    relative_lock_curve,
)
from lightning_energy.errors import ProfileError

LOCKED_HEADER = ["stage", "instruction", "frequency", "time", "energy"]
CAP_HEADER = ["model_name", "dp", "tp", "pp", "num_microbatches", "power_limit_0"]
CAP_HEADER += ["power_limit_1", "time", "energy"]


def test_the_shipped_files_load() -> None:
    profiles = sorted((DATA_DIR / "stage_profile_locked_freq").glob("*.csv"))
    assert len(profiles) == 4
    for path in profiles:
        rows = load_locked_profile(path)
        clocks = {row.freq_mhz for row in rows}
        assert min(clocks) == 855
        assert max(clocks) in (1410, 1740)
        assert {row.instruction for row in rows} == {"forward", "backward"}
    a100 = load_power_cap_runs(DATA_DIR / "zeus_global_power_cap" / "zeus_global_A100.csv")
    a40 = load_power_cap_runs(DATA_DIR / "zeus_global_power_cap" / "zeus_global_A40.csv")
    assert {run.power_limit_w for run in a100} == {300.0, 275.0, 250.0, 225.0, 200.0, 175.0}
    assert min(run.power_limit_w for run in a40) == 125.0
    assert all(run.gpus >= run.pp for run in a100 + a40)


def _write(folder: Path, header: list[str], rows: list[list[str]], name: str = "a.csv") -> Path:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    path = folder / name
    path.write_text(buffer.getvalue(), encoding="utf-8")
    return path


def _locked_rows(n: int) -> list[list[str]]:
    return [[str(i // 2), ("forward", "backward")[i % 2], "1410", "0.05", "24.0"] for i in range(n)]


def _cap_rows(n: int) -> list[list[str]]:
    return [
        ["gpt3-xl", "1", "1", "2", "8", str(300 - 25 * i), str(300 - 25 * i), "6.3", "6819"]
        for i in range(n)
    ]


BAD_NUMBERS = st.sampled_from(["", "x", "nan", "inf", "-1", "0", "1e999"])
# (column, bad values, words of what the error says is allowed)
LOCKED_BAD = {
    "stage": (st.sampled_from(["", "-1", "1.5", "a"]), "whole number >= 0"),
    "instruction": (st.sampled_from(["", "fwd", "Forward", "optimizer"]), "forward"),
    "frequency": (st.sampled_from(["", "0", "-15", "1410.5", "x"]), "whole number >= 1"),
    "time": (BAD_NUMBERS, "number > 0"),
    "energy": (BAD_NUMBERS, "number > 0"),
}
CAP_BAD = {
    "model_name": (st.sampled_from(["", "  "]), "name the trained model"),
    "dp": (st.sampled_from(["", "0", "1.5", "-2"]), "whole number >= 1"),
    "pp": (st.sampled_from(["", "0", "x"]), "whole number >= 1"),
    "num_microbatches": (st.sampled_from(["0", "", "two"]), "whole number >= 1"),
    "power_limit_1": (st.sampled_from(["250", "", "0", "-300"]), "power"),
    "time": (BAD_NUMBERS, "number > 0"),
    "energy": (BAD_NUMBERS, "number > 0"),
}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(min_value=1, max_value=6))
def test_a_bad_locked_profile_row_is_named(data: st.DataObject, n: int) -> None:
    folder = Path(tempfile.mkdtemp())
    rows = _locked_rows(n)
    assert len(load_locked_profile(_write(folder, LOCKED_HEADER, rows, "good.csv"))) == n
    column = data.draw(st.sampled_from(sorted(LOCKED_BAD)))
    values, allowed = LOCKED_BAD[column]
    index = data.draw(st.integers(min_value=0, max_value=n - 1))
    rows[index][LOCKED_HEADER.index(column)] = data.draw(values)
    path = _write(folder, LOCKED_HEADER, rows)
    with pytest.raises(ProfileError) as info:
        load_locked_profile(path)
    shutil.rmtree(folder)
    message = str(info.value)
    assert str(path) in message
    assert f"row {index + 2}:" in message
    assert column in message and allowed in message


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(min_value=1, max_value=6))
def test_a_bad_power_cap_row_is_named(data: st.DataObject, n: int) -> None:
    folder = Path(tempfile.mkdtemp())
    rows = _cap_rows(n)
    assert len(load_power_cap_runs(_write(folder, CAP_HEADER, rows, "good.csv"))) == n
    column = data.draw(st.sampled_from(sorted(CAP_BAD)))
    values, allowed = CAP_BAD[column]
    index = data.draw(st.integers(min_value=0, max_value=n - 1))
    rows[index][CAP_HEADER.index(column)] = data.draw(values)
    path = _write(folder, CAP_HEADER, rows)
    with pytest.raises(ProfileError) as info:
        load_power_cap_runs(path)
    shutil.rmtree(folder)
    message = str(info.value)
    assert str(path) in message
    assert f"row {index + 2}:" in message
    assert allowed in message


def test_a_repeated_clock_a_missing_column_and_an_empty_file_are_refused(tmp_path: Path) -> None:
    rows = [*_locked_rows(2), _locked_rows(1)[0]]
    with pytest.raises(ProfileError, match=r"row 4: repeats row 2"):
        load_locked_profile(_write(tmp_path, LOCKED_HEADER, rows))
    with pytest.raises(ProfileError, match=r"missing columns \['energy'\]"):
        load_locked_profile(_write(tmp_path, LOCKED_HEADER[:-1], [r[:-1] for r in _locked_rows(1)]))
    with pytest.raises(ProfileError, match="no rows"):
        load_power_cap_runs(_write(tmp_path, CAP_HEADER, []))
    with pytest.raises(ProfileError, match="cannot read"):
        load_power_cap_runs(tmp_path / "absent.csv")


def test_each_cap_is_compared_with_the_cheapest_relative_lock_no_slower() -> None:
    # Relative lock curve: (time, energy) over those at the top clock.
    locks = [(1.0, 1.0), (1.1, 0.85), (1.3, 0.7)]
    job = {300.0: (2.0, 100.0), 250.0: (2.2, 90.0), 200.0: (1.9, 120.0)}
    # 250 W: 1.1 x the time, 0.9 x the energy; the locks no slower cost 1.0 and 0.85.
    # 200 W: faster than every lock: left out. 300 W: the reference, left out.
    assert relative_gaps(locks, {"job": job}) == pytest.approx([(0.85 / 0.9 - 1.0) * 100])


def test_a_lock_curve_is_relative_to_its_top_clock_or_to_the_reference_given() -> None:
    runs = {
        "stage 0": {1400: (1.0, 40.0), 1200: (1.1, 30.0), 1000: (1.3, 28.0)},
        "stage 1": {1400: (3.0, 120.0), 1200: (3.3, 90.0), 1000: (3.9, 84.0)},
    }
    top = dict(zip((1400, 1200, 1000), relative_lock_curve(runs), strict=True))
    assert top[1400] == pytest.approx((1.0, 1.0))
    assert top[1200] == pytest.approx((4.4 / 4.0, 120.0 / 160.0))
    moved = dict(zip((1400, 1200, 1000), relative_lock_curve(runs, 1200), strict=True))
    assert moved[1200] == pytest.approx((1.0, 1.0))
    assert moved[1400] == pytest.approx((4.0 / 4.4, 160.0 / 120.0))
    assert moved[1000] == pytest.approx((5.2 / 4.4, 112.0 / 120.0))
    with pytest.raises(ValueError, match=r"reference_mhz=1300 .*1000-1400 MHz"):
        relative_lock_curve(runs, 1300)
