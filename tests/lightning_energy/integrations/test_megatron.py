"""MegatronEnergy with real Megatron-Core pipelines: 2 gloo processes on CPU, simulated GPUs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from megatron.core.pipeline_parallel import schedules

from lightning_energy.errors import ConfigError
from lightning_energy.integrations.megatron import MegatronEnergy, megatron_schedule
from lightning_energy.perseus.planning.schedule import one_f_one_b

from .. import processes
from ..processes import ROOT, free_port, run_launch

MEGATRON_012_ENV = "MEGATRON_CORE_012_PATH"


def run_workers(tmp_path: Path, pythonpath: str | None = None) -> list[dict[str, Any]]:
    """Both ranks of megatron_worker (see :func:`processes.run_ranks`); their results."""
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_ENERGY_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), pythonpath) if p)
    port = str(free_port())
    module = "tests.lightning_energy.integrations.megatron_worker"
    commands = [[sys.executable, "-m", module, str(r), port, str(tmp_path)] for r in range(2)]
    processes.run_ranks(commands, tmp_path, envs=[env, env])
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def check_runs(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        for name in ("1f1b", "interleaved"):
            run = result[name]
            # What the adapter fed Perseus is the schedule built from Megatron-Core's table,
            # iteration after iteration, and the schedule held (Perseus still profiling).
            iterations = len(run["observed"]) - 1
            assert run["fed"] == run["expected"] * iterations, (rank, name)
            assert run["phase"] == "profiling", (rank, name)
            # ... and it is what Megatron-Core ran: forwards of that chunk and micro-batch,
            # backwards at the same places.
            observed = [
                "B" if call[0] == "B" else f"F{call[1] * 2 + rank}.{call[2]}"
                for call in run["observed"][-1]
            ]
            assert observed == [i if i[0] == "F" else "B" for i in run["expected"]], (rank, name)
            # Clocks were locked while it ran and are restored at the end (close / with).
            assert run["locked_during"] is not None, (rank, name)
            assert run["locked_after"] is None, (rank, name)
            assert run["hooks_removed"] and run["summary"], (rank, name)
        # Interleaved: two model chunks a rank, stage = chunk * 2 + rank.
        assert {i.split(".")[0][1:] for i in result["interleaved"]["expected"]} == {
            str(rank),
            str(rank + 2),
        }
        assert result["1f1b"]["evaluation"] == {
            "fed": 0,
            "losses": 4 if rank == 1 else 0,
            "events": ["Interruption"],
        }
        change = result["shape_change"]
        assert "overlap_moe_expert_parallel_comm: True is not allowed" in change["unsupported"]
        assert not change["unsupported_opened"]
        assert change["error"] is not None and "num_microbatches=2" in change["error"]
        assert change["locked_after"] is None and not change["running"]
        assert change["reopened_microbatches"] == 2 and change["hooks_removed"]
        failure = result["failure"]
        assert failure["error"] == "boom"
        assert failure["locked_during"] is not None
        assert failure["locked_after"] is None
        assert failure["hooks_removed"] and failure["summary"]
    # A carbon pace on a dirty day: every rank plans for rank 0's target, above the fastest
    # (all-max) iteration, and the re-planned iterations follow it within the clock-setting
    # latency (50 ms on the simulated A100).
    iterations = ranks[0]["paced"]["iterations"]
    # The first call was the warm-up; the first profiled clock is the maximum, 1410 MHz.
    assert iterations[0]["phase"] == "profiling"
    fastest_s = iterations[0]["time_s"]
    paced = [it for it in iterations if it["target_s"] is not None]
    assert paced, "the carbon pace never reached Perseus"
    assert all(it["target_s"] > fastest_s for it in paced)
    assert paced[-1]["time_s"] == pytest.approx(paced[-1]["target_s"], rel=0.02)
    assert [it["target_s"] for it in ranks[1]["paced"]["iterations"]] == [
        it["target_s"] for it in iterations
    ]


@pytest.mark.slow
def test_two_process_pipelines_run_the_schedule_and_restore(tmp_path: Path) -> None:
    check_runs(run_workers(tmp_path))


@pytest.mark.slow
def test_two_process_pipelines_on_megatron_core_0_12(tmp_path: Path) -> None:
    # Where .ci/run and the README's test command unpack it, unless the variable says.
    path = os.environ.get(MEGATRON_012_ENV) or str(Path(sys.prefix) / "megatron-core-0.12")
    if not Path(path, "megatron", "core").is_dir():
        pytest.skip(f"no megatron-core 0.12 in {path} (set {MEGATRON_012_ENV} to its directory)")
    ranks = run_workers(tmp_path, pythonpath=str(Path(path).resolve()))
    assert all(r["version"].startswith("0.12.") for r in ranks), [r["version"] for r in ranks]
    check_runs(ranks)


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 3, 8])
def test_1f1b_from_megatron_tables_is_synchronous_1f1b(ranks: int, microbatches: int) -> None:
    schedule = megatron_schedule("1f1b", pipeline_ranks=ranks, num_microbatches=microbatches)
    assert schedule.device_orders == one_f_one_b(ranks, microbatches).device_orders


def test_bad_input_is_reported_before_any_gpu_is_touched() -> None:
    energy = MegatronEnergy({"device": {"backend": "simulated", "gpu": "a100"}})
    with pytest.raises(ConfigError, match="forward_backward_pipelining_with_interleaving"):
        energy.wrap(schedules.forward_backward_no_pipelining)
    with pytest.raises(ConfigError, match="is not allowed"):
        energy.wrap(lambda **kwargs: None)
    with pytest.raises(ConfigError) as info:
        megatron_schedule("gpipe", pipeline_ranks=1, num_microbatches=0, virtual_stages=0)
    assert len(info.value.problems) == 4
    assert "use ['1f1b', 'megatron_interleaved_1f1b']" in str(info.value)
    # Without torch.distributed and parallel_state: a clear error, nothing opened.
    wrapped = energy.wrap(schedules.forward_backward_pipelining_without_interleaving)
    with pytest.raises(ConfigError, match="parallel_state must be initialised"):
        wrapped(model=[], num_microbatches=4, forward_step_func=None, data_iterator=None)
    assert energy.pipeline is None and not energy.running


@pytest.mark.slow
def test_example_saves_energy_at_no_slowdown_on_an_imbalanced_pipeline(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_ENERGY_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    done = run_launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "examples" / "megatron" / "train.py"),
            # Warm-up, 3 profiled clocks of 20 s simulated time each, planned iterations.
            "--iterations",
            "30",
            "--microbatches",
            "4",  # the example's default stages: a heavier last one
        ],
        cwd=tmp_path,
        env=env,
        timeout_s=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    assert result["engine"] == "megatron-core"
    assert (result["stages"], result["microbatches"]) == (2, 4)
    assert result["time_ratio"] == pytest.approx(
        result["iteration_time_s_plan"] / result["iteration_time_s_max"]
    )
    # The light first stage runs below the maximum clock: less energy, no slowdown.
    assert result["time_ratio"] <= 1.0 + 1e-3
    assert result["energy_saving"] > 0.02
    assert result["energy_saving"] == pytest.approx(
        1 - result["energy_j_plan"] / result["energy_j_max"]
    )
