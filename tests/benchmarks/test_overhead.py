"""benchmarks/overhead.py: the per-step statistics and the power-sampler share."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from types import ModuleType

import pytest


def test_json_reports_mean_tail_first_step_and_sampler_share(
    load_benchmark: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("overhead")
    bench.main(
        ["--steps", "300", "--sampler-s", "0.3", "--repeats", "0", "--decisions", "2", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert (
        out["median_step_overhead_us"]
        <= out["p99_step_overhead_us"]
        <= out["p999_step_overhead_us"]
        <= out["max_step_overhead_us"]
    )
    assert 0 < out["mean_step_overhead_us"] <= out["max_step_overhead_us"]
    assert out["first_step_overhead_us"] > 0
    assert 0 < out["sampler_cpu_share"] < 1
    assert out["sampler_wall_s"] >= 0.3
    assert "fit_time_ratio" not in out  # --repeats 0: no fit comparison
    for prefix in ("pacing_wait_ms", "pacing_inline_ms", "pacing_decision_ms"):
        assert 0 < out[f"{prefix}_median"] <= out[f"{prefix}_p99"] <= out[f"{prefix}_max"]
    assert not [t for t in threading.enumerate() if t.name.endswith("pace-planner")]
    # The sampler thread is stopped and the real (or absent) pynvml is back.
    assert not [t for t in threading.enumerate() if t.name == bench.SAMPLER_THREAD]
    assert not hasattr(sys.modules.get("pynvml"), "init_calls")  # not the fake any more
