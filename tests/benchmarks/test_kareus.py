"""benchmarks/kareus.py: the check of the model, a small comparison, the statistics."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from tests.conftest import DATA_DIR


def test_check_reports_the_errors_on_a_file_not_fitted_to(
    load_benchmark: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("kareus")
    held_out = DATA_DIR / "kareus" / "fwd_attn_tp2_bs4_seq4096_1200mhz.csv"
    assert bench.main(["--check", str(held_out), "--clock-mhz", "1200"]) == 0
    text = capsys.readouterr().out
    assert "settings: 236" in text and "time_median_error:" in text
    with pytest.raises(SystemExit):
        bench.main(["--check", str(held_out)])  # the clock is required


def test_a_small_comparison_saves_energy_and_is_labelled_simulated(
    load_benchmark: Callable[[str], ModuleType],
) -> None:
    pytest.importorskip("optuna")
    bench = load_benchmark("kareus")
    run = bench.compare(
        0, clocks=(1410, 1200, 1005), ctas=(4, 12, 20), budget_fraction=0.5, sampler="nsga2"
    )
    assert run["simulated"] is True
    kareus = run["methods"]["kareus"]
    assert kareus["energy_saving_at_perseus_fastest"] > 0.1
    assert kareus["time_saving_at_perseus_least_energy"] > 0.1
    for search in run["searches"].values():
        assert search["share"] == pytest.approx(0.5, abs=0.02)
        assert search["hypervolume_vs_grid_true"] > 0.8
    summary = bench.aggregate([run, run])
    assert summary["methods"]["kareus"]["planning_s"]["median"] == kareus["planning_s"]
    lines = bench.report([run, run], summary)
    assert lines[0].startswith("SIMULATED") and any("kareus" in line for line in lines)
