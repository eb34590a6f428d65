"""benchmarks/power_limit_search.py: measured candidates and the strict count."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from lightning_energy.device.simulated import SimulatedSpec
from lightning_energy.device.traces import TraceModel

#: A GPU whose highest limit (260 W) is off the 25 W grid.
LIMITS_W = (100, 125, 150, 175, 200, 225, 250, 260)


def _trace(path: Path) -> Path:
    lines = ["dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power"]
    for limit_w in LIMITS_W:
        time_s = 100.0 * (1.0 + 0.6 * (260 - limit_w) / 160) ** 1.5
        lines.append(f"toy,net,64,adam,{limit_w},{time_s:.3f},{0.9 * limit_w:.1f}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def bench(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("power_limit_search")


def test_candidates_are_the_measured_limits_when_the_maximum_is_off_grid(
    bench: ModuleType, tmp_path: Path
) -> None:
    spec = SimulatedSpec(gpu=str(_trace(tmp_path / "toy.csv")), workload="toy/net", batch_size=64)
    model = spec.model()
    assert isinstance(model, TraceModel)
    limits, measured = bench.candidates_for(model)
    assert measured
    assert limits == sorted(map(float, LIMITS_W), reverse=True)
    assert bench.candidates_w(100.0, 260.0)[1] == 235.0  # the grid would interpolate


def test_json_has_strict_failures_beside_the_tolerant_count(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _trace(tmp_path / "toy.csv")
    assert bench.main(["--power-trace", str(path), "--noise-std", "0.05", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    totals = out["totals"]
    assert totals["rows"] == 5  # one workload, five selectors
    assert totals["rows_on_measured_limits"] == 5
    assert totals["strict_failures"] >= totals["failures"]
    assert totals["zeus_sweep_strict_failures"] >= totals["zeus_sweep_failures"]
    for row in out["rows"]:
        assert row["candidates_measured"] is True
        assert row["strict_gap"] >= row["gap"]
        assert row["chosen_w"] in LIMITS_W
