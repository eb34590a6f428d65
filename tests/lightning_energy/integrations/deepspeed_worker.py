"""One rank of a 2-process gloo DeepSpeed pipeline on simulated GPUs (test_deepspeed.py).

Run as ``python -m tests.lightning_energy.integrations.deepspeed_worker OUT_DIR`` with the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). On one
engine it runs, in order:

1. ``online``: Perseus attached from a YAML mapping; warm-up, online profiling, then
   planned iterations on an imbalanced pipeline (the last stage is heavier). Per
   iteration: the phase, the simulated time and energy, and the instructions the engine
   executed, recorded independently of the adapter (the n-th forward or backward of an
   iteration is micro-batch n in DeepSpeed, with its buffer). Then ``close()``, the GPU's
   settings afterwards and whether the engine was unhooked.
2. ``bad``: the ConfigErrors of a ``perseus:`` section DeepSpeed cannot run (given, and
   from the file ``LIGHTNING_ENERGY_CONFIG`` names) and of an engine with data parallelism.
3. ``batch_size_change``: a second attach refused; the micro-batch count changed after
   attach ends the run while training goes on.
4. ``observed``: ``perseus.enabled: false``: the clocks after each iteration, the summary.
   ``evaluated``: power limits profiled with and without a busy ``eval_batch`` between
   iterations.
5. ``paced``: online planning under a carbon pace replayed from a grid trace; the target
   iteration time Perseus was given at each iteration.
6. ``failure``: attached again with the plan of step 1; a layer raises in the middle of
   ``train_batch``; the clocks while it raised and the GPU's settings afterwards.

Results go to ``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.ops
import torch
import yaml
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

from lightning_energy.config import EnergyConfig
from lightning_energy.device import open_devices
from lightning_energy.device.simulated import as_simulated
from lightning_energy.errors import ConfigError
from lightning_energy.integrations.deepspeed import DeepSpeedEnergy, attach_energy

MICRO_BATCHES = 4
#: The DeepSpeed class's own attributes (an attachment changes one engine, never these).
CLASS_INSTRUCTION_MAP = dict(PipelineEngine._INSTRUCTION_MAP)
CLASS_TRAIN_BATCH = vars(PipelineEngine)["train_batch"]
CLASS_TRAIN_SCHEDULE = vars(PipelineEngine)["_train_schedule"]
#: [forward, backward] seconds at the maximum clock per stage: the last stage is heavier.
#: Instructions far longer than the A100's 50 ms clock-setting latency.
STAGE_TIMES_S = [[0.2, 0.4], [0.3, 0.6]]
PLANNED_ITERATIONS = 10
#: A day of the German grid trace whose pace is slower than full speed.
PACED_START = "2023-04-17T00:00:00Z"


def energy_config(out_dir: Path, **perseus: Any) -> dict[str, Any]:
    """Simulated A100s whose settings live in files (observable from outside the run)."""
    return {
        "device": {
            "backend": "simulated",
            "gpu": "a100",
            "start": "2026-06-01T00:00:00",
            "state_dir": str(out_dir / "gpu_state"),
            "lease_dir": str(out_dir / "leases"),
        },
        "power_limit": {"enabled": False},
        "perseus": {
            "enabled": True,
            "mode": "pipeline",
            "profile_clocks_mhz": [1410, 1200, 990],
            "warmup_iterations": 2,
            **perseus,
        },
    }


class Tripwire(torch.nn.Module):
    """Identity; raises on the ``fail_at``-th call once armed (a failing model layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: int | None = None
        self.calls = 0
        self.on_fail: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_at is not None:
            self.calls += 1
            if self.calls == self.fail_at:
                self.on_fail()
                raise RuntimeError("layer failed mid-batch")
        return x


def build_engine(num_stages: int, tripwire: Tripwire) -> Any:
    """Two layers per stage: a linear layer and ``tripwire`` (on every stage)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), tripwire, torch.nn.Linear(8, 8), tripwire]
    module = PipelineModule(
        layers=layers,
        num_stages=num_stages,
        loss_fn=torch.nn.MSELoss(),
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=list(module.parameters()), config=config
    )
    return engine


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(2, 8, generator=generator), torch.randn(2, 8, generator=generator)


def record_executed(engine: Any, executed: list[tuple[str, int]]) -> dict[Any, Any]:
    """Record every forward and backward pass ``engine`` runs (instance-level map)."""
    instruction_map = dict(engine._INSTRUCTION_MAP)
    for command, kind in ((ForwardPass, "forward"), (BackwardPass, "backward")):
        original = instruction_map[command]

        def run(self: Any, buffer_id: int, _kind: str = kind, _original: Any = original) -> Any:
            executed.append((_kind, buffer_id))
            return _original(self, buffer_id)

        instruction_map[command] = run
    engine._INSTRUCTION_MAP = instruction_map
    return instruction_map


def as_instructions(executed: list[tuple[str, int]], stage: int, buffers: int) -> list[str]:
    """DeepSpeed runs forwards, and backwards, in micro-batch order, micro-batch m in
    buffer ``m % buffers``: name each executed pass by its micro-batch."""
    seen = {"forward": 0, "backward": 0}
    names = []
    for kind, buffer_id in executed:
        microbatch = seen[kind]
        seen[kind] += 1
        assert buffer_id == microbatch % buffers, (kind, microbatch, buffer_id)
        names.append(f"{kind[0].upper()}{stage}.{microbatch}")
    return names


def gpu_settings(out_dir: Path, local_rank: int) -> list[Any]:
    """This rank's GPU settings as another process would read them (the state files)."""
    spec = EnergyConfig.from_mapping(energy_config(out_dir)).device.simulated_spec()
    devices = open_devices("simulated", simulated=spec, local_rank=local_rank)
    try:
        gpu = as_simulated(devices.gpus[0])
        assert gpu is not None
        limit_w, clocks = gpu.settings()
        return [limit_w, None if clocks is None else list(clocks)]
    finally:
        devices.close()


def hooked(engine: Any, recorder: dict[Any, Any] | None = None) -> list[str]:
    """The engine's instance attributes the adapter sets, other than the test's recorder."""
    names = ("_INSTRUCTION_MAP", "_train_schedule", "train_batch", "eval_batch")
    return [n for n in names if n in vars(engine) and vars(engine)[n] is not recorder]


def run_online(engine: Any, out_dir: Path, local_rank: int) -> dict[str, Any]:
    executed: list[tuple[str, int]] = []
    recorder = record_executed(engine, executed)
    energy = attach_energy(engine, energy_config(out_dir), stage_times_s=STAGE_TIMES_S)
    pipeline = energy.pipeline
    assert pipeline is not None and pipeline.online is not None
    gpu = pipeline.rank.gpu
    buffers = engine._train_schedule().num_pipe_buffers()
    data = batches()
    iterations = []
    planned = 0
    with energy:
        while planned < PLANNED_ITERATIONS:
            phase = pipeline.online.phase
            executed.clear()
            start_s = gpu.now_s()
            engine.train_batch(data)
            planned += phase == "planned"
            iterations.append(
                {
                    "phase": phase,
                    "time_s": gpu.now_s() - start_s,
                    "end_j": gpu.energy_j(),
                    "executed": as_instructions(executed, engine.stage_id, buffers),
                }
            )
        active = pipeline.active  # False had the order Perseus was fed not matched
        class_untouched = (
            PipelineEngine._INSTRUCTION_MAP == CLASS_INSTRUCTION_MAP
            and vars(PipelineEngine)["train_batch"] is CLASS_TRAIN_BATCH
            and vars(PipelineEngine)["_train_schedule"] is CLASS_TRAIN_SCHEDULE
        )
        plan = pipeline.runtime.plan
        assert plan is not None
        if engine.global_rank == 0:
            plan.save(out_dir / "plan.json")
    after = gpu_settings(out_dir, local_rank)
    still_hooked = hooked(engine, recorder)
    del vars(engine)["_INSTRUCTION_MAP"]  # the recorder: the class's map again
    engine.train_batch(data)  # training goes on, unhooked
    return {
        "iterations": iterations,
        "schedule": [[str(i) for i in order] for order in energy.schedule.device_orders],
        "perseus_active": active,
        "class_untouched": class_untouched,
        "settings_after": after,
        "still_hooked": still_hooked,
        "plan_clocks": sorted({f for _, f in plan.device_plan(engine.stage_id)}),
    }


def error_text(call: Callable[[], Any]) -> str | None:
    try:
        energy = call()
    except ConfigError as exc:
        return str(exc)
    energy.close()
    return None


def run_batch_size_change(engine: Any, out_dir: Path, local_rank: int) -> dict[str, Any]:
    """Attached twice: refused. The micro-batch count changes after attach: the run ends,
    training goes on."""
    energy = attach_energy(engine, energy_config(out_dir), stage_times_s=STAGE_TIMES_S)
    twice = error_text(lambda: attach_energy(engine, energy_config(out_dir)))
    data = batches()
    engine.train_batch(data)
    engine.set_train_batch_size(engine.train_batch_size() * 2)
    try:
        loss = engine.train_batch(data)
    finally:
        engine.set_train_batch_size(engine.train_batch_size() // 2)
    return {
        "attached_twice": twice,
        "loss_finite": bool(torch.isfinite(loss)),
        "running": energy.running,
        "hooked": hooked(engine),
        "settings_after": gpu_settings(out_dir, local_rank),
    }


def attach_from_env(engine: Any, out_dir: Path) -> str | None:
    """attach_energy(engine) with LIGHTNING_ENERGY_CONFIG naming a YAML file of a
    ``perseus:`` section DeepSpeed cannot run: its error shows the file was read."""
    path = out_dir / f"env_energy_{engine.global_rank}.yaml"
    path.write_text(yaml.safe_dump(energy_config(out_dir, schedule="gpipe")))
    os.environ["LIGHTNING_ENERGY_CONFIG"] = str(path)
    try:
        return error_text(lambda: attach_energy(engine))
    finally:
        del os.environ["LIGHTNING_ENERGY_CONFIG"]


def run_bad(engine: Any, out_dir: Path) -> dict[str, Any]:
    data_parallel = build_engine(1, Tripwire())  # one stage on both ranks: data parallel 2
    return {
        "gpipe_from_env": attach_from_env(engine, out_dir),
        "gpipe": error_text(
            lambda: attach_energy(engine, energy_config(out_dir, schedule="gpipe"))
        ),
        "data_parallel": error_text(lambda: attach_energy(data_parallel, energy_config(out_dir))),
        "hooked_after_errors": hooked(engine),
    }


def run_observed(engine: Any, out_dir: Path, local_rank: int) -> dict[str, Any]:
    """``perseus.enabled: false``: energy measured and reported, clocks never touched."""
    config = energy_config(out_dir, enabled=False)
    config["report"] = str(out_dir / "observed_report.json")
    energy = attach_energy(engine, config, stage_times_s=STAGE_TIMES_S)
    data = batches()
    clocks = []
    with energy:
        for _ in range(3):
            engine.train_batch(data)
            clocks.append(gpu_settings(out_dir, local_rank)[1])
    summary = energy.summary
    assert summary is not None
    return {"clocks": clocks, "steps": summary.steps, "energy_j": summary.energy_j}


def run_evaluated(engine: Any, tripwire: Tripwire, out_dir: Path) -> dict[str, Any]:
    """Power limits profiled with Perseus off, twice: alone, then with an ``eval_batch``
    after every third iteration that keeps the GPU busy (each stage's layer runs 2 s at
    idle power). The profile each run measured, per limit: [time, energy] per step."""
    config = energy_config(out_dir, enabled=False)
    config["power_limit"] = {"power_limits_w": [400.0, 300.0, 200.0], "settle_steps": 1}
    profiles = []
    for evaluate in (False, True):
        energy = attach_energy(engine, config, stage_times_s=STAGE_TIMES_S)
        assert energy.controller is not None
        gpu = energy.controller.devices.gpus[0]
        data = batches()
        with energy:
            for iteration in itertools.count(1):
                if energy.controller.profile_done or iteration > 200:
                    break
                engine.train_batch(data)
                if evaluate and iteration % 3 == 0:
                    busy = tripwire.register_forward_hook(lambda *_, gpu=gpu: gpu.idle(2.0))
                    engine.eval_batch(data)
                    busy.remove()
            profiles.append(
                {
                    str(m["power_limit_w"]): [m["time_per_step_s"], m["energy_per_step_j"]]
                    for m in energy.controller.profile()
                }
            )
    return {"alone": profiles[0], "with_evaluation": profiles[1]}


def run_paced(engine: Any, out_dir: Path) -> dict[str, Any]:
    """Online planning under a carbon pace (a replayed grid trace): the pace's target
    iteration time reaches Perseus."""
    config = energy_config(out_dir, replan_every_iterations=1)
    config["device"]["start"] = PACED_START
    config["log_every_n_steps"] = 2  # the pace moves at logging boundaries
    config["carbon"] = {
        "provider": "trace",
        "region": "DE",
        "policy": "forecast",
        "max_slowdown": 1.3,
        "allow_pause": False,
        "poll_interval_s": 3600,
    }
    energy = attach_energy(engine, config, total_steps=200, stage_times_s=STAGE_TIMES_S)
    pipeline = energy.pipeline
    assert pipeline is not None and pipeline.online is not None
    online, gpu = pipeline.online, pipeline.rank.gpu
    data = batches()
    iterations = []
    with energy:
        planned = 0
        while planned < PLANNED_ITERATIONS:
            phase = online.phase
            start_s = gpu.now_s()
            engine.train_batch(data)
            planned += phase == "planned"
            iterations.append(
                {"phase": phase, "time_s": gpu.now_s() - start_s, "target_s": online.target_time_s}
            )
    return {"iterations": iterations}


def run_failure(engine: Any, tripwire: Tripwire, out_dir: Path, local_rank: int) -> dict[str, Any]:
    config = energy_config(out_dir, plan=str(out_dir / "plan.json"))
    energy: DeepSpeedEnergy = attach_energy(engine, config, stage_times_s=STAGE_TIMES_S)
    data = batches()
    engine.train_batch(data)
    during: list[Any] = []
    tripwire.on_fail = lambda: during.append(gpu_settings(out_dir, local_rank))
    # Rank 0 fails in its forward of micro-batch 2, rank 1 in micro-batch 1: every send
    # before has its receive, so neither rank is left waiting for the other.
    tripwire.fail_at = 3 if engine.stage_id == 0 else 2
    tripwire.calls = 0
    raised = None
    try:
        engine.train_batch(data)
    except RuntimeError as exc:
        raised = str(exc)
    return {
        "raised": raised,
        "settings_during": during[0] if during else None,
        "settings_after": gpu_settings(out_dir, local_rank),
        "hooked_after": hooked(engine),
        "running_after": energy.running,
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    tripwire = Tripwire()
    engine = build_engine(2, tripwire)
    results: dict[str, Any] = {"initial_settings": gpu_settings(out_dir, local_rank)}
    results["online"] = run_online(engine, out_dir, local_rank)
    results["bad"] = run_bad(engine, out_dir)
    results["batch_size_change"] = run_batch_size_change(engine, out_dir, local_rank)
    results["observed"] = run_observed(engine, out_dir, local_rank)
    results["evaluated"] = run_evaluated(engine, tripwire, out_dir)
    results["paced"] = run_paced(engine, out_dir)
    torch.distributed.barrier()  # rank 0 wrote the plan
    results["failure"] = run_failure(engine, tripwire, out_dir, local_rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()  # gloo's threads must not outlive the interpreter


if __name__ == "__main__":
    main()
