"""Perseus on DeepSpeed's PipelineEngine: a real 2-process gloo pipeline on CPU with
simulated A100s (deepspeed_worker.py), the schedule built from DeepSpeed's own
TrainSchedule, bad input, and the example script."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")

import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_energy.errors import ConfigError
from lightning_energy.integrations.deepspeed import DeepSpeedEnergy, train_schedule
from lightning_energy.perseus import one_f_one_b

from .. import processes
from ..processes import ROOT, free_port, run_launch
from . import deepspeed_worker


def run_ranks(command: list[str], world: int, log_dir: Path) -> None:
    """Run ``command`` once per rank with torchrun's environment (see
    :func:`processes.run_ranks`)."""
    port = str(free_port())
    envs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        env.pop("LIGHTNING_ENERGY_CONFIG", None)
        envs.append(env)
    processes.run_ranks([command] * world, log_dir, envs=envs)


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the 2-process worker ran (results, reports, GPU state files)."""
    out = tmp_path_factory.mktemp("deepspeed")
    module = "tests.lightning_energy.integrations.deepspeed_worker"
    run_ranks([sys.executable, "-m", module, str(out)], 2, out)
    return out


@pytest.fixture(scope="module")
def ranks(ranks_dir: Path) -> list[dict[str, Any]]:
    return [json.loads((ranks_dir / f"rank{r}.json").read_text()) for r in range(2)]


# ------------------------------------------------------------------ the schedule
@given(stages=st.integers(1, 8), micro_batches=st.integers(1, 24))
def test_the_schedule_of_train_schedule_is_synchronous_1f1b(
    stages: int, micro_batches: int
) -> None:
    schedule = train_schedule(micro_batches, stages)
    assert schedule.device_orders == one_f_one_b(stages, micro_batches).device_orders
    assert (schedule.num_stages, schedule.num_microbatches) == (stages, micro_batches)


def test_the_engine_executes_the_schedule_built_from_train_schedule(
    ranks: list[dict[str, Any]],
) -> None:
    for stage, result in enumerate(ranks):
        expected = result["online"]["schedule"][stage]
        iterations = result["online"]["iterations"]
        assert [it["executed"] for it in iterations] == [expected] * len(iterations)
        assert len(expected) == 2 * deepspeed_worker.MICRO_BATCHES
    # What the hooks fed Perseus is that order too: its check never switched it off.
    assert all(result["online"]["perseus_active"] for result in ranks)
    # Hooked on the engine instance: the DeepSpeed class (every other engine) unchanged.
    assert all(result["online"]["class_untouched"] for result in ranks)


# ------------------------------------------------------------ online planning
def test_online_profiling_then_a_plan_saves_energy_at_no_slowdown(
    ranks: list[dict[str, Any]],
) -> None:
    iterations = [r["online"]["iterations"] for r in ranks]
    phases = [it["phase"] for it in iterations[0]]
    assert phases[:2] == ["starting", "warmup"] and "profiling" in phases  # vote after one
    planned = phases.index("planned")
    assert phases[planned:] == ["planned"] * deepspeed_worker.PLANNED_ITERATIONS

    def per_iteration(first: int, last: int) -> tuple[float, float]:
        """Time and both GPUs' energy per iteration over iterations first..last."""
        time_s = sum(it["time_s"] for it in iterations[0][first : last + 1])
        energy_j = sum(its[last]["end_j"] - its[first - 1]["end_j"] for its in iterations)
        return time_s / (last - first + 1), energy_j / (last - first + 1)

    max_time_s, max_energy_j = per_iteration(1, phases.index("profiling") - 1)
    # The first planned iteration lands the new clocks; then the plan holds.
    plan_time_s, plan_energy_j = per_iteration(planned + 1, len(phases) - 1)
    assert plan_time_s <= max_time_s * 1.01
    assert plan_energy_j < max_energy_j
    # The light first stage runs below the maximum clock for some instructions.
    assert min(ranks[0]["online"]["plan_clocks"]) < 1410


def test_a_carbon_pace_moves_perseus_target_iteration_time(ranks: list[dict[str, Any]]) -> None:
    iterations = ranks[0]["paced"]["iterations"]
    no_slowdown_s = iterations[1]["time_s"]  # all clocks at the maximum
    paced = [it for it in iterations if it["target_s"] is not None]
    assert paced, "the carbon pace never reached Perseus"
    # The dirty grid slows the job down: a target above the fastest iteration, which the
    # re-planned iterations follow.
    assert all(it["target_s"] > no_slowdown_s for it in paced)
    assert paced[-1]["time_s"] > no_slowdown_s
    # Within the clock-setting latency (50 ms on the simulated A100) of the target.
    assert paced[-1]["time_s"] == pytest.approx(paced[-1]["target_s"], rel=0.02)
    # Every rank runs the same target (rank 0's).
    assert [it["target_s"] for it in ranks[1]["paced"]["iterations"]] == [
        it["target_s"] for it in iterations
    ]


def test_with_perseus_off_energy_is_measured_and_reported_and_clocks_untouched(
    ranks: list[dict[str, Any]], ranks_dir: Path
) -> None:
    for result in ranks:
        observed = result["observed"]
        assert observed["clocks"] == [None, None, None]
        assert observed["steps"] == 3
        assert observed["energy_j"] > 0
    # Rank 0's report: the job's energy is both ranks' (gathered at close()).
    summary = json.loads((ranks_dir / "observed_report.json").read_text())["summary"]
    assert summary["steps"] == 3
    assert summary["job_energy_j"] == pytest.approx(sum(r["observed"]["energy_j"] for r in ranks))


def test_eval_batch_is_left_out_of_the_power_limit_profile(
    ranks: list[dict[str, Any]],
) -> None:
    """``eval_batch`` runs between iterations, where a window measures: the busy
    evaluation must change no limit's measured time or energy per step."""
    for result in ranks:
        alone, evaluated = result["evaluated"]["alone"], result["evaluated"]["with_evaluation"]
        assert sorted(alone) == sorted(evaluated) == ["200.0", "300.0", "400.0"]
        for limit, (time_s, energy_j) in alone.items():
            assert evaluated[limit][0] == pytest.approx(time_s, rel=0.01), limit
            assert evaluated[limit][1] == pytest.approx(energy_j, rel=0.01), limit


# ------------------------------------------------------------------- restore
def test_clocks_and_power_limit_are_restored_after_a_normal_end(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        assert result["online"]["settings_after"] == result["initial_settings"]
        assert result["online"]["settings_after"][1] is None
        assert result["online"]["still_hooked"] == []


def test_an_exception_in_train_batch_restores_the_gpu_and_propagates(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        failure = result["failure"]
        assert failure["raised"] == "layer failed mid-batch"
        assert failure["settings_after"] == result["initial_settings"]
        assert failure["hooked_after"] == []
        assert failure["running_after"] is False
    # The plan was in force when the layer raised: the light stage's clock was locked.
    assert ranks[0]["failure"]["settings_during"][1] is not None


# ------------------------------------------------------------------ bad input
def test_what_deepspeed_cannot_run_is_a_clear_error(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        bad = result["bad"]
        for key in ("gpipe", "gpipe_from_env"):
            assert "perseus.schedule: 'gpipe' is not allowed" in bad[key]
            assert "'1f1b'" in bad[key]
        assert "data parallel size: 2 is not allowed; use 1" in bad["data_parallel"]
        assert bad["hooked_after_errors"] == []


def test_a_changed_micro_batch_count_ends_the_run_and_training_goes_on(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        changed = result["batch_size_change"]
        assert "energy optimisation is already attached to this engine" in changed["attached_twice"]
        assert changed["loss_finite"] is True
        assert changed["running"] is False
        assert changed["hooked"] == []
        assert changed["settings_after"] == result["initial_settings"]


def test_an_engine_that_is_not_a_pipeline_engine_is_refused(tmp_path: Path) -> None:
    config = {"device": {"backend": "simulated", "gpu": "a100"}}
    with pytest.raises(ConfigError, match="Linear is not allowed; use the PipelineEngine"):
        DeepSpeedEnergy(torch.nn.Linear(2, 2), config)


@pytest.mark.parametrize(("stages", "micro_batches"), [(0, 4), (2, 0)])
def test_train_schedule_counts_below_one_are_refused(stages: int, micro_batches: int) -> None:
    with pytest.raises(ConfigError, match="is not allowed; use an integer >= 1"):
        train_schedule(micro_batches, stages)


# -------------------------------------------------------------------- example
def test_the_example_saves_energy_at_no_slowdown_on_an_imbalanced_pipeline(
    tmp_path: Path,
) -> None:
    script = ROOT / "examples" / "deepspeed" / "train.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(script)]
    command += ["--iterations", "36"]  # the example's default stages: a heavier last one
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    env.pop("LIGHTNING_ENERGY_CONFIG", None)
    done = run_launch(command, cwd=tmp_path, env=env, timeout_s=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout[-4000:]
    result = lines[0]
    assert (result["engine"], result["stages"], result["microbatches"]) == ("deepspeed", 2, 4)
    # At the maximum clock an iteration is the longest path through DeepSpeed's schedule.
    times = {(0, "forward"): 0.2, (0, "backward"): 0.4, (1, "forward"): 0.3, (1, "backward"): 0.6}
    schedule = train_schedule(4, 2)
    longest_s = schedule.longest_path([times[(i.stage, i.kind)] for i in schedule.nodes])
    assert result["iteration_time_s_max"] == pytest.approx(longest_s, rel=1e-6)
    # energy_saving and time_ratio are what the per-iteration figures say.
    assert result["time_ratio"] == pytest.approx(
        result["iteration_time_s_plan"] / result["iteration_time_s_max"]
    )
    assert result["energy_saving"] == pytest.approx(
        1 - result["energy_j_plan"] / result["energy_j_max"]
    )
    assert result["energy_saving"] > 0
    assert result["time_ratio"] <= 1 + 1e-9  # the plan's target: no slowdown
