"""benchmarks/recurring_jobs.py: energy gaps against both fixed choices."""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Callable
from types import ModuleType

import pytest


def test_json_reports_the_gap_to_the_least_energy_fixed_choice(
    load_benchmark: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("recurring_jobs")
    a40 = (
        importlib.resources.files("lightning_energy")
        / "data"
        / "gpu_profiles"
        / "zeus_summary_power_a40.csv"
    )
    argv = ["--power-trace", str(a40), "--recurrences", "3", "--repeats", "1", "--json"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["results"]["a40"]
    assert len(rows) == 6
    for r in rows.values():
        # The least-energy fixed choice uses no more energy than the least-cost one.
        assert r["least_energy_fixed_energy_mj"] <= r["best_fixed_energy_mj"]
        assert r["energy_gap_vs_least_energy_fixed"] >= r["energy_gap_vs_best_fixed"]
        assert set(r["least_energy_fixed"]) == {"batch_size", "power_limit_w"}
    assert any(
        r["least_energy_fixed"] != r["best_fixed"] for r in rows.values()
    )  # eta = 0.5 trades energy for time on some workload
