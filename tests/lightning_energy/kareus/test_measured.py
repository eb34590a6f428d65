"""Reading measured Kareus partition files."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from lightning_energy.errors import ProfileError
from lightning_energy.kareus.measured import parse_partition_csv, read_partition_csv
from tests.conftest import DATA_DIR

MEASURED = DATA_DIR / "kareus" / "fwd_attn_tp2_bs4_seq4096_default.csv"
HEADER = (
    "overlap_start,overlap_end,comm_sm_number,comm_block_size,"
    "0:time (s),0:total energy (J),1:time (s),1:total energy (J)\n"
)


def test_the_shipped_file_has_every_window_cta_count_and_block_size() -> None:
    rows = read_partition_csv(MEASURED)
    assert (len(rows), rows.repeats) == (640, 3)
    windows = set(zip(rows.window_start.tolist(), rows.window_end.tolist(), strict=True))
    assert (-1, -1) in windows and (0, 6) in windows and len(windows) == 16
    assert sorted(set(rows.ctas.tolist())) == list(range(1, 21))
    assert sorted(set(rows.block_threads.tolist())) == [512, 1024]
    np.testing.assert_allclose(rows.time_s, rows.times_s.mean(axis=1))


def test_noise_is_the_spread_of_the_repeats() -> None:
    text = HEADER + "0,6,4,1024,1.0,10.0,3.0,10.0\n0,6,5,1024,2.0,9.0,2.0,11.0\n"
    rows = parse_partition_csv(io.StringIO(text), source="two rows")
    time_noise, energy_noise = rows.noise()
    # time: deviations +-0.5 and 0, 0 -> sum of squares 0.5 over 4 - 2 degrees of freedom
    assert time_noise == pytest.approx(np.sqrt(0.5 / 2))
    assert energy_noise == pytest.approx(np.sqrt(0.02 / 2))
    # The real file: a fraction of a percent in time, about a percent in energy.
    real_t, real_e = read_partition_csv(MEASURED).noise()
    assert 0 < real_t < 0.01 and 0 < real_e < 0.03


def test_every_problem_is_reported_with_its_line() -> None:
    text = HEADER + (
        "0,6,4,1024,1.0,10.0,1.0,10.0\n"
        "0,6,4,1024,1.0,10.0,1.0,10.0\n"  # duplicate
        "3,1,4,1024,1.0,10.0,1.0,10.0\n"  # end before start
        "0,6,0,1024,1.0,10.0,1.0,10.0\n"  # no CTA
        "0,6,5,1024,-1.0,10.0,1.0,10.0\n"  # negative time
        "0,6,6,1024,x,10.0,1.0,10.0\n"  # not a number
    )
    with pytest.raises(ProfileError) as err:
        parse_partition_csv(io.StringIO(text), source="bad.csv")
    message = str(err.value)
    assert "5 problem(s)" in message and "bad.csv" in message
    for needed in (
        "line 3: setting",
        "line 4: overlap window (3, 1)",
        "line 5: comm_sm_number=0",
        "line 6: times and energies",
        "line 7: not numeric",
    ):
        assert needed in message


def test_missing_columns_and_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"columns \['comm_block_size', '1:total energy"):
        parse_partition_csv(
            io.StringIO("overlap_start,overlap_end,comm_sm_number,1:time (s)\n"), source="x"
        )
    with pytest.raises(ProfileError, match="cannot read"):
        read_partition_csv(tmp_path / "nothing.csv")


@pytest.mark.parametrize("value", [str(10**400), str(-(10**400))])
@pytest.mark.parametrize("column", range(4))
def test_a_setting_no_integer_column_holds_is_named(column: int, value: str) -> None:
    settings = ["0", "6", "4", "1024"]
    settings[column] = value
    text = HEADER + ",".join(settings) + ",1.0,10.0,1.0,10.0\n"
    with pytest.raises(ProfileError, match="line 2: "):
        parse_partition_csv(io.StringIO(text), source="bad.csv")
