"""benchmarks/pause_guard.py: the paced job against its carbon-unaware run, both measured."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType

import pytest


def test_each_start_compares_two_measured_runs(
    load_benchmark: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("pause_guard")
    # 2023-03-06 pauses on the German grid; 2023-09-04 does not (no pause pays at 30 W).
    assert bench.main(["--first", "2023-03-06", "--weeks", "1", "--json"]) == 0
    assert bench.main(["--first", "2023-09-04", "--weeks", "1", "--json"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    paused, unpaused = (json.loads(line) for line in lines)
    assert paused["pauses"] >= 1 and paused["vs_carbon_unaware"] < 0
    assert unpaused["pauses"] == 0
    assert unpaused["emissions_g"] == pytest.approx(unpaused["carbon_unaware_g"], rel=1e-12)
    for row in (paused, unpaused):
        assert row["deadline_met"]
        assert row["vs_carbon_unaware"] == pytest.approx(
            row["emissions_g"] / row["carbon_unaware_g"] - 1
        )
