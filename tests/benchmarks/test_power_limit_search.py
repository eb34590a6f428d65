"""benchmarks/power_limit_search.py: measured candidates and the strict count."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lightning_energy.device.simulated import PowerTrace, SimulatedSpec, TraceModel

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


def _run_json(
    bench: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> dict[str, Any]:
    assert bench.main([*argv, "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_runs_of_one_seed_each_merge_into_the_run_of_both_seeds(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(_trace(tmp_path / "toy.csv"))
    common = ["--power-trace", trace, "--noise-std", "0.05"]
    files = []
    for seed in (1, 0):
        path = tmp_path / f"seed{seed}.json"
        path.write_text(json.dumps(_run_json(bench, capsys, [*common, "--seed", str(seed)])))
        files += ["--merge", str(path)]
    both = _run_json(bench, capsys, [*common, "--seed", "0", "--seed", "1"])
    merged = _run_json(bench, capsys, files)
    assert merged["config"] == both["config"]
    assert merged["rows"] == both["rows"]
    assert {k: v for k, v in merged["totals"].items() if k != "wall_s"} == {
        k: v for k, v in both["totals"].items() if k != "wall_s"
    }
    assert merged["totals"]["rows"] == 10


def test_merge_refuses_runs_that_do_not_belong_together(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(_trace(tmp_path / "toy.csv"))
    runs = {
        "a.json": ["--noise-std", "0.05", "--seed", "0"],
        "b.json": ["--noise-std", "0.03", "--seed", "1"],
        "c.json": ["--noise-std", "0.05", "--seed", "0"],
    }
    for name, argv in runs.items():
        out = _run_json(bench, capsys, ["--power-trace", trace, *argv])
        (tmp_path / name).write_text(json.dumps(out))
    (tmp_path / "other.json").write_text('{"totals": {}}')

    def refused(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2
        return capsys.readouterr().err

    a, b, c = (str(tmp_path / n) for n in ("a.json", "b.json", "c.json"))
    err = refused(["--merge", a, "--merge", b])
    assert "noise_std" in err and "0.03" in err and "0.05" in err
    assert "seed 0" in refused(["--merge", a, "--merge", c])
    assert "other.json" in refused(["--merge", a, "--merge", str(tmp_path / "other.json")])
    assert "missing.json" in refused(["--merge", str(tmp_path / "missing.json")])
    assert "--seed" in refused(["--merge", a, "--seed", "3"])


def test_shipped_traces_run_although_their_preset_counter_moves_every_100_ms(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The A40 preset's counter moves every 100 ms: a few 14 ms steps can read 0 J.
    assert SimulatedSpec(gpu="a40").board().energy_counter_period_s == pytest.approx(0.1)
    monkeypatch.setattr(PowerTrace, "workloads", lambda self: [("movielens-1m", "ncf", 16)])
    model = SimulatedSpec(gpu="a40", workload="movielens-1m/ncf", batch_size=16).model()
    assert isinstance(model, TraceModel)
    limits, _ = bench.candidates_for(model)
    rows = bench.run_trace("a40", 0.03, [0, 1])
    assert len(rows) == 10  # five selectors, two seeds
    for row in rows:
        assert row.chosen_w in limits
        assert row.profiled_steps > 0
        assert row.gap >= 0 and row.strict_gap >= row.gap
