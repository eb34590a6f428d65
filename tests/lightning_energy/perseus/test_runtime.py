from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_energy.device import SimulatedSpec, cuda_stream, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.errors import ConfigError
from lightning_energy.perseus import Instruction, PerseusPlanner, Plan, evaluate, one_f_one_b
from lightning_energy.perseus.runtime import (
    BLOCKED_LABEL,
    ClockController,
    InstructionMeter,
    PipelineRuntime,
)
from lightning_energy.perseus.runtime.attribution import EnergyTimeline
from tests.lightning_energy.device.fake_cuda import FakeCuda, cuda_devices

from ..processes import free_port, run_module_ranks
from . import pipeline_worker
from .helpers import simulated_profile


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
    # (over the same clocks; see test_attribution.py).
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


# ---------------------------------------------------------- on a multi-GPU node (CUDA fake)
_CLOCK_THREAD = "lightning-energy-perseus-clock"
_STAGE = torch.device("cuda", 1)


def _clock_thread() -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == _CLOCK_THREAD]
    return thread


def _lock_times(gpu: Any, cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The GPU time (of the CUDA fake) at which each clock lock is applied."""
    times: list[float] = []
    real = gpu.set_locked_clocks_mhz

    def spy(min_mhz: int, max_mhz: int) -> None:
        times.append(cuda.now_s)
        real(min_mhz, max_mhz)

    monkeypatch.setattr(gpu, "set_locked_clocks_mhz", spy)
    return times


def test_the_clock_thread_works_on_the_stage_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of a node: its clock thread waits for cuda:1's stream from cuda:1, and makes
    no CUDA context on GPU 0 (a new thread starts on device 0)."""
    cuda = FakeCuda(cuda_devices(2)).install(monkeypatch)
    torch.cuda.set_device(_STAGE)
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        controller = ClockController(guard, gpu=gpu, device=_STAGE)
        cuda.launch(0.01, torch.cuda.current_stream(_STAGE))
        controller.request(1200)
        controller.flush()
        assert gpu.locked_clocks_mhz() == (1200, 1200)
        controller.reset()
        controller.stop()
    assert cuda.contexts[_CLOCK_THREAD] == {1}


def test_a_clock_change_lands_when_the_stage_stream_reaches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage's kernels go to cuda:1's current stream (a side stream) while the
    training thread's current device is cuda:0: each change lands when cuda:1 reaches it."""
    cuda = FakeCuda(cuda_devices(2)).install(monkeypatch)
    side = torch.cuda.Stream(_STAGE)
    torch.cuda.set_stream(side)  # cuda:1's current stream
    torch.cuda.set_device(0)  # the current device is another one
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    applied_at = _lock_times(gpu, cuda, monkeypatch)
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        controller = ClockController(guard, gpu=gpu, device=_STAGE)
        cuda.launch(0.5, side)  # the instruction before the change
        controller.request(1200)
        cuda.launch(0.3, side)
        controller.request(1005)
        controller.flush()
        assert applied_at == [pytest.approx(0.5), pytest.approx(0.8)]
        controller.reset()
        controller.stop()


def test_restore_never_waits_for_a_stream_that_does_not_advance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer died: the stage's stream is stalled at its receive. Closing the runtime
    resets the clocks at once, and the change requested behind the stall is never applied."""
    cuda = FakeCuda(cuda_devices(2)).install(monkeypatch)
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    schedule = one_f_one_b(1, 2)
    forward, backward = schedule.device_orders[0][:2]
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        runtime = PipelineRuntime(schedule, 0, ClockController(guard, gpu=gpu, device=_STAGE))
        closer = threading.Thread(target=runtime.close)
        try:
            runtime.set_fixed_clock(1200)
            runtime.before(forward)
            runtime.controller.flush()
            assert gpu.locked_clocks_mhz() == (1200, 1200)
            clock_thread = _clock_thread()
            cuda.stall(torch.cuda.current_stream(_STAGE))
            runtime.set_fixed_clock(1005)
            runtime.before(backward)  # behind the stall: never reached
            closer.start()
            closer.join(60)
            assert not closer.is_alive()  # restore returned
            assert gpu.locked_clocks_mhz() is None  # and reset the clocks
        finally:
            cuda.release()
            if closer.ident is not None:
                closer.join(60)
        clock_thread.join(60)
        assert not clock_thread.is_alive()
        assert gpu.locked_clocks_mhz() is None  # the stale request was dropped


def test_a_flush_while_training_waits_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cuda = FakeCuda(cuda_devices(2)).install(monkeypatch)
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False) as guard:
        controller = ClockController(guard, gpu=gpu, device=_STAGE, flush_timeout_s=0.01)
        try:
            cuda.stall(torch.cuda.current_stream(_STAGE))
            controller.request(1200)
            with caplog.at_level(logging.WARNING):
                assert controller.flush() is False
                assert controller.flush() is False
            warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warnings) == 1 and "did not reach" in warnings[0].getMessage()
            controller.reset()
            controller.stop()
        finally:
            cuda.release()
        assert gpu.locked_clocks_mhz() is None


class _SlowCounter:
    """A GPU whose energy counter takes 3 ms of host time to read (NVML calls take 0.1 to
    several ms) and shows 300 W while kernels run, 70 W otherwise."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.reads_s = 0.0  # host time spent reading the counter
        self.busy_s = 0.0

    def clock(self) -> float:
        """The host's time: the GPU's (the host waits for it) plus the counter reads."""
        return 100.0 + self.cuda.now_s + self.reads_s

    def run(self, seconds: float) -> None:
        """Queue ``seconds`` of kernels on the stage's stream (host time: a launch)."""
        self.cuda.launch(seconds, torch.cuda.current_stream(_STAGE))
        self.busy_s += seconds

    def energy_j(self) -> float:
        self.reads_s += 0.003
        return 70.0 * self.cuda.now_s + 230.0 * self.busy_s

    def synchronize(self) -> None:
        self.cuda.synchronize(_STAGE)


def test_instructions_are_timed_on_the_stage_stream_not_around_counter_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = FakeCuda(cuda_devices(2)).install(monkeypatch)
    gpu = _SlowCounter(cuda)
    timeline = EnergyTimeline(counter_period_s=0.0)
    meter = InstructionMeter(
        gpu,  # type: ignore[arg-type]
        timeline,
        lambda inst: "forward",
        gpu.clock,
        stream=cuda_stream(_STAGE),
    )
    inst = Instruction(0, 0, "forward")
    meter.mark(BLOCKED_LABEL)
    for _ in range(3):
        cuda.advance(0.01)  # waiting for the input
        meter.start(inst)
        gpu.run(0.02)
        time_s, energy_j = meter.stop(inst)
        assert time_s == pytest.approx(0.02)
        assert energy_j == pytest.approx(300.0 * 0.02)
    cuda.advance(0.01)
    meter.mark(None)
    fitted = timeline.fit()
    assert fitted["forward"].segment_s == pytest.approx(0.02)
    assert fitted["forward"].power_w == pytest.approx(300.0)
    assert fitted[BLOCKED_LABEL].power_w == pytest.approx(70.0)


@pytest.mark.slow
def test_every_rank_gets_the_last_stages_loss_whatever_its_dtype(tmp_path: Path) -> None:
    """A bfloat16 loss reaches the first stage's rank as it is (float32), not as the
    bytes of a bfloat16 read into a float32."""
    port = str(free_port())
    run_module_ranks(
        "tests.lightning_energy.perseus.pipeline_run_worker",
        [[str(r), port, str(tmp_path), str(tmp_path / "leases")] for r in range(2)],
        tmp_path,
    )
    first, last = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first == last
    assert all(dtype == "torch.float32" and value > 0.1 for value, dtype in last)
