"""benchmarks/overhead.py: the per-step statistics, the power-sampler share and the
pipeline ranks' costs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parents[2]


def test_json_reports_mean_tail_first_step_and_sampler_share(
    load_benchmark: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("overhead")
    skip_others = ["--repeats", "0", "--pipeline-steps", "0", "--decisions", "2"]
    bench.main(["--steps", "300", "--sampler-s", "0.3", *skip_others, "--json"])
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
    assert not [k for k in out if k.startswith("pipeline_")]  # --pipeline-steps 0
    # The sampler thread is stopped and the real (or absent) pynvml is back.
    assert not [t for t in threading.enumerate() if t.name == bench.SAMPLER_THREAD]
    assert not hasattr(sys.modules.get("pynvml"), "init_calls")  # not the fake any more


@pytest.mark.slow
def test_json_reports_each_pipeline_ranks_hooks_and_loss_hand_off() -> None:
    """The pipeline part spawns its two ranks: run as the script is run."""
    command = [sys.executable, str(ROOT / "benchmarks" / "overhead.py")]
    command += ["--steps", "0", "--sampler-s", "0", "--repeats", "0", "--decisions", "0"]
    command += ["--pipeline-steps", "20", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [k for k in out if not k.startswith("pipeline_")]  # only the pipeline part
    for rank in (0, 1):
        for part in ("hooks", "loss"):
            key = f"pipeline_rank{rank}_{part}"
            assert 0 < out[f"{key}_median_us"] <= out[f"{key}_p99_us"]
            assert out[f"{key}_mean_us"] > 0
