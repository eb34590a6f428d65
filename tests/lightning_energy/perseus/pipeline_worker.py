"""One rank of a 2-process gloo pipeline on simulated GPUs (run by test_runtime.py).

For each schedule it builds the tiny model's stages as ``PerseusPipelineStage``, runs one
iteration of ``torch.distributed.pipelining`` with the plan, and writes what ran (order,
clocks) and the simulated iteration time and energy to a JSON file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_energy.device import SimulatedSpec, StageWork, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.simulated import physics_preset
from lightning_energy.device.simulated.work import PipelineSimulation
from lightning_energy.perseus import PerseusPlanner, build_schedule
from lightning_energy.perseus.runtime import (
    ClockController,
    PerseusPipelineStage,
    PipelineRuntime,
)
from lightning_energy.perseus.runtime.online import OnlinePerseus

from . import nccl_like
from .helpers import simulated_profile

MICROBATCHES = 4
TARGET_S = 0.45
# Iterations the energy of a phase is read over (about 18 s: the 100 ms energy counter's
# error, at most a period's energy at each end, stays under 1 %).
WINDOW_ITERATIONS = 40


def exact_clock_spec(rank: int) -> SimulatedSpec:
    """The default A100 board, except that clock changes govern the work at once: these
    runs compare simulated iterations with the planner's time to 1e-9, which per-instruction
    clocks can only meet when each change lands before its instruction (the presets' 50 ms
    set latency is longer than these 20-60 ms instructions; the clock controller's
    coalescing covers that case)."""
    return SimulatedSpec(gpu="a100", count=1, first_index=rank, setting_latency_s=0.0)


CASES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
}


def works(num_stages: int) -> dict[tuple[int, str], StageWork]:
    """Unequal stages: the last is heaviest, backward twice the forward."""
    out = {}
    for s in range(num_stages):
        base = 0.02 * (1.0 + 0.3 * s)
        out[(s, "forward")] = StageWork(base, 0.9)
        out[(s, "backward")] = StageWork(2 * base, 0.8)
    return out


def run_case(name: str, rank: int, world: int, lease_dir: str, group: Any) -> dict[str, Any]:
    cls, virtual = CASES[name]
    num_stages = world * virtual
    schedule = build_schedule(name, num_stages, MICROBATCHES, virtual_stages=virtual)
    stage_works = works(num_stages)
    model = physics_preset("a100")
    profile = simulated_profile(model, stage_works, range(1410, 885, -15))
    planner = PerseusPlanner(profile, schedule)
    plan = planner.plan_for_time(planner.min_iteration_time_s * 1.05).plan

    # One iteration's energy is compared with the planner's: read on a continuous counter.
    gpu = simulated_gpus(
        SimulatedSpec(
            gpu="a100",
            count=1,
            first_index=rank,
            setting_latency_s=0.0,
            energy_counter_period_s=0.0,
        )
    )[0]
    mine = {k: w for k, w in stage_works.items() if schedule.device_of(k[0]) == rank}
    with GPUGuard([gpu], lease_dir=lease_dir, install_signal_handlers=False) as guard:
        simulation = PipelineSimulation(gpu, mine, group=group)
        with PipelineRuntime(
            schedule, rank, ClockController(guard), plan=plan, work=simulation
        ) as runtime:
            torch.manual_seed(0)
            stages = []
            for local in range(virtual):
                index = local * world + rank
                module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                stages.append(
                    PerseusPipelineStage(
                        module, index, num_stages, torch.device("cpu"), runtime=runtime
                    )
                )
            loss_fn = torch.nn.MSELoss()
            pipe = cls(
                stages if virtual > 1 else stages[0], n_microbatches=MICROBATCHES, loss_fn=loss_fn
            )
            x = torch.randn(MICROBATCHES * 2, 8)
            y = torch.randn(MICROBATCHES * 2, 8)
            start_e = gpu.energy_j()
            has_first = any(s.is_first for s in stages)
            has_last = any(s.is_last for s in stages)
            if has_first and has_last:
                pipe.step(x, target=y)
            elif has_first:
                pipe.step(x)
            elif has_last:
                pipe.step(target=y)
            else:
                pipe.step()
            iteration_s, end_e = runtime.end_iteration()  # type: ignore[misc]
            locked_during = gpu.locked_clocks_mhz()
        locked_after = gpu.locked_clocks_mhz()
    return {
        "order": [str(e.instruction) for e in runtime.trace],
        "clocks": [e.freq_mhz for e in runtime.trace],
        "planned": [f for _, f in plan.device_plan(rank)],
        "expected_order": [str(i) for i in schedule.device_orders[rank]],
        "iteration_s": iteration_s,
        "energy_j": end_e - start_e,
        "locked_during": locked_during,
        "locked_after": locked_after,
        "plan": plan.to_dict(),
    }


def run_online(rank: int, world: int, lease_dir: str, group: Any) -> dict[str, Any]:
    """1F1B profiled online on a 100 ms energy counter: warm up, profile 3 clocks, plan,
    then re-plan for a target; every phase lasts ``WINDOW_ITERATIONS`` iterations at
    least."""
    schedule = build_schedule("1f1b", world, MICROBATCHES)
    stage_works = works(world)
    gpu = simulated_gpus(exact_clock_spec(rank))[0]
    mine = {k: w for k, w in stage_works.items() if k[0] == rank}
    iterations = []
    with GPUGuard([gpu], lease_dir=lease_dir, install_signal_handlers=False) as guard:
        simulation = PipelineSimulation(gpu, mine, group=group)
        with PipelineRuntime(schedule, rank, ClockController(guard), work=simulation) as runtime:
            online = OnlinePerseus(
                runtime,
                gpu,
                supported_clocks_mhz=gpu.supported_sm_clocks_mhz(),
                profile_clocks_mhz=[1410, 1200, 990],
                warmup_iterations=WINDOW_ITERATIONS,
                replan_every_iterations=1,
                group=group,
                clock=gpu.clock.now,
            )
            online.start()  # what RankPipeline does after the first iteration
            torch.manual_seed(0)
            module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
            stage = PerseusPipelineStage(module, rank, world, torch.device("cpu"), runtime=runtime)
            pipe = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=torch.nn.MSELoss())
            x, y = torch.randn(MICROBATCHES * 2, 8), torch.randn(MICROBATCHES * 2, 8)
            first_plan = None
            planned = 0
            while planned < 2 * WINDOW_ITERATIONS + 1:
                if planned == WINDOW_ITERATIONS:
                    online.set_target_time(TARGET_S)
                    first_plan = runtime.plan
                phase = online.phase
                start_t = gpu.clock.now()
                online.on_iteration_start()
                if rank == 0:
                    pipe.step(x)
                else:
                    pipe.step(target=y)
                online.on_iteration_end()
                planned += phase == "planned"
                iterations.append(
                    {"phase": phase, "time_s": gpu.clock.now() - start_t, "end_j": gpu.energy_j()}
                )
            plan = runtime.plan
    return {
        "iterations": iterations,
        "plan": None if plan is None else plan.to_dict(),
        "first_plan": None if first_plan is None else first_plan.to_dict(),
        "fitted": None if online.profile is None else online.profile.rows(),
        "blocked_power_w": None if online.profile is None else online.profile.blocked_power_w,
    }


def main() -> None:
    rank, world, port, out_dir, lease_dir = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    nccl_like.install()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        group = dist.new_group(backend="gloo")
        results = {name: run_case(name, rank, world, lease_dir, group) for name in CASES}
        results["online"] = run_online(rank, world, lease_dir, group)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
