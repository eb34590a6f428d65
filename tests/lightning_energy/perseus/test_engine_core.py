"""Perseus over any pipeline engine: schedules from executed orders, the per-rank pipeline
and the adapter the DeepSpeed and Megatron-Core integrations build on (one process)."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController, KnobDecision
from lightning_energy.device import DeviceSet, simulated_gpus
from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.integrations._pipeline_engine import PipelineEngineAdapter
from lightning_energy.perseus import BACKWARD, FORWARD, Instruction, Plan, build_schedule
from lightning_energy.perseus.planning.schedule import PipelineSchedule
from lightning_energy.perseus.runtime.pipeline_run import schedule_from_orders
from tests.lightning_energy.device.fake_cuda import FakeCuda
from tests.lightning_energy.device.fake_pynvml import a100, make_module

_SCHEDULES = st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"])


@st.composite
def _known_schedules(draw: st.DrawFn) -> PipelineSchedule:
    name = draw(_SCHEDULES)
    devices = draw(st.integers(1, 4))
    virtual = draw(st.integers(2, 3)) if name == "interleaved_1f1b" else 1
    microbatches = draw(st.integers(1, 6))
    if name == "interleaved_1f1b":
        rounds = max(1, microbatches // devices)
        microbatches -= microbatches % rounds
    return build_schedule(name, devices * virtual, microbatches, virtual_stages=virtual)


@settings(max_examples=60, deadline=None)
@given(_known_schedules())
def test_an_engine_schedule_is_the_dag_of_its_orders(schedule: PipelineSchedule) -> None:
    built = schedule_from_orders(
        "engine", schedule.device_orders, num_microbatches=schedule.num_microbatches
    )
    assert built.device_orders == schedule.device_orders
    assert (built.num_stages, built.num_devices) == (schedule.num_stages, schedule.num_devices)
    durations = [1.0 + (i % 3) for i in range(len(schedule.nodes))]
    assert built.longest_path(durations) == schedule.longest_path(durations)


def _drop(orders: list[list[Instruction]], device: int, i: int) -> str:
    inst = orders[device].pop(i)
    return f"{inst} is missing"


def _repeat(orders: list[list[Instruction]], device: int, i: int) -> str:
    inst = orders[device][i]
    orders[device].append(inst)
    return f"{inst} runs 2 times"


def _backward_first(orders: list[list[Instruction]], device: int, i: int) -> str:
    inst = orders[device][i]
    forward = replace(inst, kind=FORWARD)
    backward = replace(inst, kind=BACKWARD)
    order = [x for x in orders[device] if x not in (forward, backward)]
    orders[device] = [backward, forward, *order]
    return f"{backward} runs before its forward"


def _wrong_device(orders: list[list[Instruction]], device: int, i: int) -> str:
    if len(orders) < 2:
        return _drop(orders, device, i)
    inst = orders[device].pop(i)
    other = (device + 1) % len(orders)
    orders[other].append(inst)
    return f"{inst} runs on device {other}, not {device}"


def _bad_kind(orders: list[list[Instruction]], device: int, i: int) -> str:
    inst = orders[device][i]
    orders[device][i] = replace(inst, kind="recompute")
    return "kind 'recompute'"


@settings(max_examples=80, deadline=None)
@given(
    _known_schedules(),
    st.sampled_from([_drop, _repeat, _backward_first, _wrong_device, _bad_kind]),
    st.data(),
)
def test_a_wrong_description_of_an_engine_is_refused_with_what_is_wrong(
    schedule: PipelineSchedule, mutate: Any, data: st.DataObject
) -> None:
    orders = [list(order) for order in schedule.device_orders]
    device = data.draw(st.integers(0, len(orders) - 1))
    i = data.draw(st.integers(0, len(orders[device]) - 1))
    expected = mutate(orders, device, i)
    with pytest.raises(ConfigError) as info:
        schedule_from_orders("engine", orders, num_microbatches=schedule.num_microbatches)
    assert expected in str(info.value)


def test_orders_that_deadlock_are_refused() -> None:
    # Device 1 starts with microbatch 1, whose forward device 0 runs only after B0.0,
    # which needs B1.0, which device 1 runs after microbatch 1: a cycle.
    orders = [
        [Instruction(0, m, kind) for m in (0, 1) for kind in (FORWARD, BACKWARD)],
        [Instruction(1, m, kind) for m in (1, 0) for kind in (FORWARD, BACKWARD)],
    ]
    with pytest.raises(ConfigError, match="deadlock"):
        schedule_from_orders("engine", orders, num_microbatches=2)


def test_a_plan_is_bound_to_the_engine_schedule_it_was_made_for() -> None:
    orders = build_schedule("1f1b", 2, 3).device_orders
    engine = schedule_from_orders("engine-1f1b", orders, num_microbatches=3)
    plan = Plan.uniform(engine, 1200)
    assert Plan.from_json(plan.to_json(), schedule=engine) == plan
    with pytest.raises(ProfileError, match="engine-1f1b"):
        Plan.from_json(plan.to_json())  # the name alone cannot rebuild an engine's schedule
    other = schedule_from_orders(
        "engine-1f1b", build_schedule("1f1b", 2, 4).device_orders, num_microbatches=4
    )
    with pytest.raises(
        ProfileError, match=r"3 microbatches, the pipeline runs engine-1f1b with 2 and 4"
    ):
        Plan.from_json(plan.to_json(), schedule=other)


# ----------------------------------------------------------------- the adapter, one process
_MICROBATCHES = 4


def _config(tmp_path: Path, **perseus: Any) -> EnergyConfig:
    return EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "gpu": "a100",
                "start": "2023-01-16T00:00:00Z",
                "lease_dir": str(tmp_path / "leases"),
            },
            "perseus": {
                "enabled": True,
                "mode": "pipeline",
                "microbatches": _MICROBATCHES,
                "profile_clocks_mhz": [1410, 1200, 1005],
                **perseus,
            },
            "report": str(tmp_path / "run.json"),
            "log_every_n_steps": 5,
        }
    )


class _Engine(PipelineEngineAdapter):
    """A one-rank engine running two virtual stages in its own order."""

    def __init__(self, config: EnergyConfig, order: list[Instruction] | None = None) -> None:
        super().__init__(config)
        self.schedule = build_schedule("interleaved_1f1b", 2, _MICROBATCHES, virtual_stages=2)
        self.order = order or list(self.schedule.device_orders[0])

    def begin(self, device: torch.device | None = None) -> None:
        self._begin_pipeline(
            schedule=schedule_from_orders(
                "engine", self.schedule.device_orders, num_microbatches=_MICROBATCHES
            ),
            global_rank=0,
            world_size=1,
            local_rank=0,
            device=device or torch.device("cpu"),
            workload="engine-test",
            stage_times_s=[[0.02, 0.04], [0.03, 0.06]],
        )

    def train(self, iterations: int, fail_at: Instruction | None = None) -> None:
        for _ in range(iterations):
            self._iteration_start()
            for inst in self.order:
                self._before(inst)
                if inst == fail_at:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                self._after(inst)
            self._iteration_end()


def _gpu(engine: _Engine) -> Any:
    pipeline = engine.pipeline
    assert pipeline is not None
    return pipeline.rank.gpu


def test_an_engine_job_profiles_plans_and_restores_at_the_end(tmp_path: Path) -> None:
    engine = _Engine(_config(tmp_path))
    assert engine.config.power_limit.enabled  # but not profiled: Perseus holds the clocks
    engine.begin()
    assert engine.controller is not None
    assert engine.controller.power_limit.profiling_off == "perseus_clocks holds the clocks"
    gpu = _gpu(engine)
    pre_limit_w = gpu.power_limit_w()
    with engine:
        pipeline = engine.pipeline
        assert pipeline is not None and pipeline.online is not None
        iterations = 0
        while pipeline.online.phase != "planned" and iterations < 400:
            engine.train(1)
            iterations += 1
        assert pipeline.online.phase == "planned"
        engine.train(3)
        assert gpu.locked_clocks_mhz() is not None  # the plan runs
        # The carbon pace's view: whole steps, fastest first, each slower one cheaper.
        pace = engine._pace
        assert pace is not None
        frontier = pace.pace_frontier()
        assert len(frontier) > 1
        times, energies = [t for t, _, _ in frontier], [e for _, e, _ in frontier]
        assert times == sorted(times) and energies == sorted(energies, reverse=True)
        fastest = pipeline.runtime.plan
        assert fastest is not None and fastest.metadata is not None
        decision = pace.apply_pace(1.15)
        assert decision is not None and decision.value is not None
        target_s, overhead_s = decision.value, pace.overhead_s
        assert target_s == pytest.approx(1.15 * times[0])
        engine.train(engine.config.perseus.replan_every_iterations)
        slower = pipeline.runtime.plan
        assert slower is not None and slower.metadata is not None
        planned_s = pipeline.online.target_time_s
        assert planned_s is not None and planned_s == pytest.approx(target_s - overhead_s)
        assert slower.metadata["iteration_time_s"] > fastest.metadata["iteration_time_s"]
        assert slower.metadata["iteration_time_s"] <= planned_s + 1e-9
        assert slower.metadata["energy_j"] < fastest.metadata["energy_j"]
        iterations += engine.config.perseus.replan_every_iterations
    assert gpu.locked_clocks_mhz() is None
    assert gpu.power_limit_w() == pre_limit_w
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["summary"]["steps"] == iterations + 3 and report["job"]["energy_j"] > 0


def test_an_exception_mid_iteration_restores_the_clocks(tmp_path: Path) -> None:
    engine = _Engine(_config(tmp_path, profile_clocks_mhz=[1005, 810]))
    engine.begin()
    gpu = _gpu(engine)
    with pytest.raises(RuntimeError, match="illegal memory access"), engine:
        engine.train(2)  # warm-up, then profiling at 1005 MHz
        assert gpu.locked_clocks_mhz() is not None
        engine.train(1, fail_at=engine.order[3])
    assert gpu.locked_clocks_mhz() is None
    assert engine.pipeline is None and not engine.running
    report = json.loads((tmp_path / "run.json").read_text())
    assert "job" not in report  # an aborted run has no job totals


def test_an_engine_running_another_order_switches_perseus_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The engine runs every forward first (a valid order, but not the planned one).
    planned = build_schedule("interleaved_1f1b", 2, _MICROBATCHES, virtual_stages=2)
    swapped = [Instruction(s, m, FORWARD) for s in (0, 1) for m in range(_MICROBATCHES)]
    swapped += [Instruction(s, m, BACKWARD) for s in (1, 0) for m in range(_MICROBATCHES)]
    pairs = zip(swapped, planned.device_orders[0], strict=True)
    first = next(i for i, (ran, plan) in enumerate(pairs) if ran != plan)
    expected = f"ran {swapped[first]} where the 'engine' schedule runs "
    expected += f"{planned.device_orders[0][first]} (position {first})"
    engine = _Engine(_config(tmp_path, warmup_iterations=0), order=swapped)
    engine.begin()
    gpu = _gpu(engine)
    with caplog.at_level(logging.WARNING), engine:
        engine.train(3)
        pipeline = engine.pipeline
        assert pipeline is not None and not pipeline.active
        assert gpu.locked_clocks_mhz() is None  # reset at once, left alone after
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert expected in warnings[0]

    strict = _Engine(replace(_config(tmp_path), strict=True), order=swapped)
    strict.begin()
    gpu = _gpu(strict)
    with pytest.raises(ConfigError, match=re.escape(expected)), strict:
        strict.train(1)
    assert gpu.locked_clocks_mhz() is None


def test_without_perseus_the_engine_job_only_measures(tmp_path: Path) -> None:
    engine = _Engine(_config(tmp_path, enabled=False))
    assert engine.config.power_limit.enabled is True  # the power limit is optimised instead
    engine.begin()
    gpu = _gpu(engine)
    with engine:
        engine.train(3)
        assert gpu.locked_clocks_mhz() is None
    assert engine.summary is not None and engine.summary.energy_j > 0


# ------------------------------------------------------------------ the carbon pace target
class _Target:
    """A knob holding the clocks with two settings: fast, or 10 % slower at 15 % less
    energy."""

    name = "two_clocks"
    holds_clocks = True

    def __init__(self, step_s: float, step_j: float) -> None:
        self.frontier = [(step_s, step_j, "fast"), (1.1 * step_s, 0.85 * step_j, "slow")]
        self.scales: list[float] = []

    def pace_frontier(self) -> list[tuple[float, float, str]]:
        return list(self.frontier)

    def apply_pace(self, scale: float) -> KnobDecision:
        self.scales.append(scale)
        return KnobDecision("target_time_s", scale * self.frontier[0][0], "pace")


def test_the_carbon_pace_moves_a_registered_knob_and_power_limits_are_not_profiled(
    tmp_path: Path,
) -> None:
    example = Path(__file__).parents[3] / "examples" / "carbon_pacing.yaml"
    config = EnergyConfig.from_yaml(example).merged(
        {
            "device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")},
            "carbon": {"max_slowdown": 1.05},
            "report": None,
        }
    )
    (gpu,) = simulated_gpus(config.device.simulated_spec())
    devices = DeviceSet(gpus=[gpu], clock=gpu.clock.now, backend="simulated")
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    t0_s, e0_j = gpu.now_s(), gpu.energy_j()
    gpu.run_step()
    target = _Target(gpu.now_s() - t0_s, gpu.energy_j() - e0_j)
    controller.add_knob(target)  # it holds the clocks: no power limit is profiled
    controller.set_total_steps(1200)
    for _ in range(1200):
        controller.on_step_start()
        gpu.run_step()  # the target's slow setting takes 10 % longer
        if target.scales and target.scales[-1] > 1.0:
            gpu.idle((target.scales[-1] - 1.0) * target.frontier[0][0])
        controller.on_step_end()
    summary = controller.teardown()
    devices.close()
    paced = [d for d in controller.decisions if d["kind"] == "target_time_s"]
    assert len(set(target.scales)) > 1  # the pace moved with the grid
    assert [d["value"] for d in paced] == [s * target.frontier[0][0] for s in target.scales]
    assert all(d["purpose"] == "pace" for d in paced)
    assert not [d for d in controller.decisions if d["kind"] == "power_limit"]
    assert summary.carbon is not None and summary.carbon["deadline_met"] is True


# ------------------------------------------------------- a rank of a multi-GPU node (CUDA)
def test_a_rank_on_cuda_1_changes_clocks_from_cuda_1_and_restores_past_a_dead_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine trains on cuda:1 of a 2-GPU node (NVML GPUs, CUDA fake). The clock thread
    follows cuda:1's stream from cuda:1 (no CUDA context on GPU 0); when a peer dies (the
    stream stalls at a receive), the pipeline resets the clocks without waiting for it."""
    nvml = make_module([a100(0), a100(1)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    cuda = FakeCuda(nvml.devices).install(monkeypatch)
    torch.cuda.set_device(1)
    stage = torch.device("cuda", 1)
    orders = build_schedule("interleaved_1f1b", 2, _MICROBATCHES, virtual_stages=2).device_orders
    schedule = schedule_from_orders("engine", orders, num_microbatches=_MICROBATCHES)
    plan = Plan(schedule, tuple(1410 if i % 2 else 1005 for i in range(len(schedule.nodes))))
    (tmp_path / "plan.json").write_text(plan.to_json())
    engine = _Engine(
        _config(tmp_path, plan=str(tmp_path / "plan.json")).merged({"device": {"backend": "nvml"}})
    )
    engine.begin(device=stage)
    with engine:
        pipeline = engine.pipeline
        assert pipeline is not None
        stream = torch.cuda.current_stream(stage)
        for _ in range(2):  # the plan applies from the second iteration
            engine._iteration_start()
            for inst in engine.order:
                engine._before(inst)
                cuda.launch(0.01, stream)
                engine._after(inst)
            engine._iteration_end()
        assert pipeline.runtime.plan == plan
        pipeline.runtime.controller.flush()
        assert nvml.devices[1].locked is not None and nvml.devices[0].locked is None
        cuda.stall(stream)
        engine._iteration_start()
        engine._before(engine.order[0])  # its clock waits behind the stalled receive
        hung: list[bool] = []

        def unstick() -> None:
            hung.append(True)
            cuda.release()

        watchdog = threading.Timer(60, unstick)
        watchdog.start()
        try:
            engine._close_pipeline()  # the pipeline's part of ending the run
        finally:
            watchdog.cancel()
            cuda.release()
        assert not hung  # the clocks were reset without waiting for the stalled stream
        assert nvml.devices[1].locked is None
    ours = {name: gpus for name, gpus in cuda.contexts.items() if name.startswith("lightning")}
    assert "lightning-energy-perseus-clock" in ours
    assert all(gpus == {1} for gpus in ours.values()), ours  # no thread of ours on GPU 0
