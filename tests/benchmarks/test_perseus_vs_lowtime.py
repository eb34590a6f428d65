"""benchmarks/perseus_vs_lowtime.py: the same-range timing, and a run when lowtime is there."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

PROFILE = Path(__file__).parents[1] / "data" / "perseus_profiles" / "profile_S4_M8.csv"


@pytest.fixture
def bench(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("perseus_vs_lowtime")


def test_same_range_counts_setup_and_only_the_iterations_inside_it(bench: ModuleType) -> None:
    spans_s = [2.0, 5.0, 3.0, 1.0, 0.5]  # setup, then four iterations
    plan_times_s = [4.0, 3.0, 2.5, 2.0]  # lowtime goes from slow to fast
    assert bench.same_range_wall_s(spans_s, plan_times_s, 3.0) == pytest.approx(
        2.0 + 3.0 + 1.0 + 0.5
    )
    assert bench.same_range_wall_s(spans_s, plan_times_s, 10.0) == pytest.approx(sum(spans_s))
    assert bench.same_range_wall_s(spans_s, plan_times_s, 1.0) == pytest.approx(2.0)


def test_json_has_both_speedups(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lowtime", reason="the bench extra (lowtime) is not installed")
    assert bench.main(["--profile", str(PROFILE), "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ratio = out["ratio"]
    assert ratio["frontier_speedup_same_range"] <= ratio["frontier_speedup"]
    assert out["lowtime"]["same_range_wall_s"] <= out["lowtime"]["frontier_wall_s"]
    assert 0 < out["lowtime"]["same_range_points"] <= out["lowtime"]["frontier_points"]
