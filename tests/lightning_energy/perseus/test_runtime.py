from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.errors import ConfigError
from lightning_energy.perseus import Instruction, PerseusPlanner, Plan, evaluate, one_f_one_b
from lightning_energy.perseus.runtime import ClockController, PipelineRuntime, simulated_profile

from ..processes import free_port, run_module_ranks
from . import pipeline_worker


@pytest.mark.slow
def test_two_process_pipeline_applies_the_plan(tmp_path: Path) -> None:
    port = str(free_port())
    run_module_ranks(
        "tests.lightning_energy.perseus.pipeline_worker",
        [[str(r), "2", port, str(tmp_path), str(tmp_path / "leases")] for r in range(2)],
        tmp_path,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in pipeline_worker.CASES:
        plan = Plan.from_dict(ranks[0][name]["plan"])
        model_profile = simulated_profile(
            pipeline_worker.physics_preset("a100"),
            pipeline_worker.works(plan.schedule.num_stages),
            range(1410, 885, -15),
        )
        expected = evaluate(plan, model_profile)
        for result in (r[name] for r in ranks):
            # The DAG's device order is the order torch.distributed.pipelining executed.
            assert result["order"] == result["expected_order"], name
            # Each instruction ran at its planned clock: it was locked before the work.
            assert result["clocks"] == result["planned"], name
            assert result["locked_during"] is not None
            assert result["locked_after"] is None  # reset at the end
            # The simulated iteration takes the planned iteration time.
            assert result["iteration_s"] == pytest.approx(expected.iteration_time_s, rel=1e-9)
        assert len(set(ranks[0][name]["planned"])) > 1  # a real per-instruction plan
        energy = sum(r[name]["energy_j"] for r in ranks)
        assert energy == pytest.approx(expected.energy_j, rel=1e-9), name
    check_online(ranks)


class FakeStream:
    """A GPU stream the test advances by hand; its markers block until reached."""

    def __init__(self) -> None:
        self.recorded = 0
        self.reached = 0
        self.cond = threading.Condition()

    def marker(self) -> FakeMarker:
        self.recorded += 1
        return FakeMarker(self, self.recorded)

    def advance(self, markers: int) -> None:
        with self.cond:
            self.reached += markers
            self.cond.notify_all()


class FakeMarker:
    def __init__(self, stream: FakeStream, position: int) -> None:
        self.stream = stream
        self.position = position

    def query(self) -> bool:
        return self.stream.reached >= self.position

    def synchronize(self) -> None:
        with self.stream.cond:
            self.stream.cond.wait_for(self.query)


def locks_applied(
    gpu: Any, monkeypatch: pytest.MonkeyPatch, applied: threading.Event | None = None
) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = gpu.set_locked_clocks_mhz

    def spy(min_mhz: int, max_mhz: int) -> None:
        calls.append((min_mhz, max_mhz))
        real(min_mhz, max_mhz)
        if applied is not None:
            applied.set()

    monkeypatch.setattr(gpu, "set_locked_clocks_mhz", spy)
    return calls


def test_clock_controller_applies_requests_as_the_stream_reaches_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    calls = locks_applied(gpu, monkeypatch)
    stream = FakeStream()
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        controller = ClockController(guard, gpu=gpu, marker=stream.marker)
        for freq in (1200, 1200, 1005, 1410):
            controller.request(freq)
            stream.advance(1)
            controller.flush()
        assert calls == [(1200, 1200), (1005, 1005), (1410, 1410)]  # the repeat is dropped
        assert controller.changes == 3
        controller.reset()
        assert gpu.locked_clocks_mhz() is None
        controller.stop()


def test_requests_the_stream_passed_coalesce_to_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Setting a clock is slower than the instructions: by the time the thread can act,
    the GPU is past three requests; only the newest is applied."""
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    applied = threading.Event()
    calls = locks_applied(gpu, monkeypatch, applied)
    stream = FakeStream()
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        controller = ClockController(guard, gpu=gpu, marker=stream.marker)
        for freq in (1200, 1005, 1410, 990):
            controller.request(freq)
        stream.advance(3)  # the GPU reached the first three markers, not the fourth
        assert applied.wait(60)
        assert calls == [(1410, 1410)]
        stream.advance(1)
        controller.flush()
        assert calls == [(1410, 1410), (990, 990)]
        assert controller.changes == 2
        controller.stop()


def test_the_clock_recorded_is_the_one_read_back(tmp_path: Path) -> None:
    """An administrator locked the GPU at 1005 MHz before the job: asking 1410 gets 1005."""
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    gpu.set_locked_clocks_mhz(1005, 1005)
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        controller = ClockController(guard, gpu=gpu)
        controller.request(1410)
        controller.flush()
        assert controller.current_mhz == 1005
        controller.stop()
    assert gpu.locked_clocks_mhz() == (1005, 1005)
    gpu.reset_locked_clocks()


def test_runtime_resets_clocks_on_failure(tmp_path: Path) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    schedule = one_f_one_b(1, 2)
    plan = Plan.uniform(schedule, 1005)
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        runtime = PipelineRuntime(schedule, 0, ClockController(guard), plan=plan)
        with pytest.raises(RuntimeError, match="boom"), runtime:
            runtime.before(Instruction(0, 0, "forward"))
            runtime.controller.flush()
            assert gpu.locked_clocks_mhz() == (1005, 1005)
            raise RuntimeError("boom")
        assert gpu.locked_clocks_mhz() is None
        assert runtime.trace == []


def test_runtime_rejects_foreign_plans_and_instructions(tmp_path: Path) -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        with PipelineRuntime(one_f_one_b(2, 2), 0, ClockController(guard)) as runtime:
            with pytest.raises(ConfigError, match="the plan is for"):
                runtime.set_plan(Plan.uniform(one_f_one_b(2, 3), 1410))
            with pytest.raises(ConfigError, match="does not run on pipeline rank 0"):
                runtime.before(Instruction(1, 0, "forward"))
        with pytest.raises(ConfigError, match="rank=2"):
            PipelineRuntime(one_f_one_b(2, 2), 2, ClockController(guard))


def check_online(ranks: list[dict[str, Any]]) -> None:
    """Assertions on the online-profiling run of the 2-process test (100 ms counter)."""
    schedule = one_f_one_b(2, pipeline_worker.MICROBATCHES)
    # The clocks the online profile covers (it profiled 1410, 1200 and 990 MHz).
    truth = simulated_profile(
        pipeline_worker.physics_preset("a100"), pipeline_worker.works(2), range(1410, 985, -15)
    )
    planner = PerseusPlanner(truth, schedule)
    iterations = ranks[0]["online"]["iterations"]
    phases = [it["phase"] for it in iterations]
    k = pipeline_worker.WINDOW_ITERATIONS
    profiled = phases.index("planned")
    assert phases[:k] == ["warmup"] * k
    assert phases[k:profiled] == ["profiling"] * (profiled - k)
    assert phases[profiled:] == ["planned"] * (2 * k + 1)

    def per_iteration_j(first: int, last: int) -> float:
        """Both GPUs' energy per iteration over iterations ``first..last`` (counters)."""
        total = 0.0
        for r in ranks:
            its = r["online"]["iterations"]
            total += its[last]["end_j"] - its[first - 1]["end_j"]
        return total / (last - first + 1)

    time_s = [it["time_s"] for it in iterations]
    baseline = planner.baseline()
    assert time_s[1] == pytest.approx(baseline.iteration_time_s)
    assert per_iteration_j(1, k - 1) == pytest.approx(baseline.energy_j, rel=0.01)
    # Planned from the online fit: no slowdown, within 1 % of the offline plan's energy
    # (over the same clocks; see test_counter.py).
    first_plan = evaluate(Plan.from_dict(ranks[0]["online"]["first_plan"]), truth)
    assert first_plan.iteration_time_s <= baseline.iteration_time_s * (1 + 1e-9)
    assert first_plan.energy_j <= planner.plan_no_slowdown().energy_j * 1.01
    assert max(time_s[profiled : profiled + k]) <= baseline.iteration_time_s * (1 + 1e-9)
    planned_j = per_iteration_j(profiled + 1, profiled + k - 1)
    assert planned_j < baseline.energy_j
    # Re-planned for the new target at the iteration boundary.
    assert max(time_s[profiled + k + 1 :]) <= pipeline_worker.TARGET_S * (1 + 1e-9)
    assert per_iteration_j(profiled + k + 1, len(iterations) - 1) < planned_j
    # Blocked power per clock (NCCL spins at the locked clock), fitted through the
    # profiled clocks and predicted at each clock of the plan.
    blocked_w = ranks[0]["online"]["blocked_power_w"]
    for f in (1410, 1200, 990):
        assert blocked_w[str(f)] == pytest.approx(truth.blocked_power_at(f), rel=0.05)
    assert ranks[1]["online"]["fitted"] is None  # rank 0 plans for everyone
    assert ranks[0]["online"]["plan"] == ranks[1]["online"]["plan"]
