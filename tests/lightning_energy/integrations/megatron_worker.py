"""One rank of a 2-process gloo Megatron-Core pipeline on simulated GPUs (test_megatron.py).

Runs, in one process group: a 1F1B run with an evaluation call, ended by ``close()``; an
interleaved run (2 model chunks a rank) ended by its ``with`` block; a run refused for an
unsupported option, then whose ``num_microbatches`` changes; a run that fails
mid-iteration (rank 0 in its second forward, rank 1 in its first, so no rank waits for
the other); and a 1F1B run paced by a replayed grid trace. For each it writes what ran
and what the GPU was left with to ``rank<r>.json``.

Usage: ``python -m tests.lightning_energy.integrations.megatron_worker RANK PORT OUT_DIR``
(with the Megatron-Core to test first on ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import megatron.core
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules

from lightning_energy.errors import ConfigError
from lightning_energy.integrations.megatron import MegatronEnergy

WORLD = 2
MICROBATCHES = 4
ITERATIONS = 3
ROOT = Path(__file__).resolve().parents[3]
#: The paced run: instructions far longer than the A100's 50 ms clock-setting latency, a
#: day of the German grid trace whose pace is slower than full speed.
PACED_STAGE_TIMES_S = [[0.2, 0.4], [0.3, 0.6]]
PACED_START = "2023-04-17T00:00:00Z"
PACED_ITERATIONS = 8


#: Megatron-Core's own step functions, before any hook.
STEPS = (schedules.forward_step, schedules.backward_step)


def hooks_removed() -> bool:
    return (schedules.forward_step, schedules.backward_step) == STEPS


def _load_cpu_harness() -> Any:
    path = ROOT / "examples" / "megatron" / "megatron_cpu.py"
    spec = importlib.util.spec_from_file_location("megatron_cpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["megatron_cpu"] = module
    spec.loader.exec_module(module)
    return module


mc = _load_cpu_harness()


def config(out_dir: Path) -> dict[str, Any]:
    return {
        "device": {
            "backend": "simulated",
            "gpu": "a100",
            "start": "2026-01-05T12:00:00",
            "lease_dir": str(out_dir / "leases"),
        },
        "perseus": {"enabled": True, "warmup_iterations": 1, "profile_clocks_mhz": [1410, 1110]},
    }


class Observer:
    """What Megatron-Core ran: ``("F", chunk, micro-batch)`` for a forward, ``("B",)`` for
    a backward. Installed before each call, it sees every call only if the adapter wraps
    the functions it finds at call time (not those of import time)."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks
        self.calls: list[tuple[Any, ...]] = []
        self.forward = schedules.forward_step
        self.backward = schedules.backward_step

    def __enter__(self) -> Observer:
        def forward(*args: Any, **kwargs: Any) -> Any:
            chunk = next(v for v, c in enumerate(self.chunks) if c is args[2])
            self.calls.append(("F", chunk, kwargs["current_microbatch"]))
            return self.forward(*args, **kwargs)

        def backward(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(("B",))
            return self.backward(*args, **kwargs)

        schedules.forward_step, schedules.backward_step = forward, backward
        return self

    def __exit__(self, *exc: object) -> None:
        schedules.forward_step, schedules.backward_step = self.forward, self.backward


def record_fed(energy: MegatronEnergy, fed: list[str]) -> None:
    """Record every instruction the adapter hands to its RankPipeline."""
    pipeline = energy.pipeline
    assert pipeline is not None
    before = pipeline.before

    def logged(inst: Any) -> None:
        fed.append(str(inst))
        before(inst)

    pipeline.before = logged  # type: ignore[method-assign]


def data(virtual: int, seed: int) -> Any:
    if virtual == 1:
        return mc.batches(MICROBATCHES, seed)
    return [mc.batches(MICROBATCHES, seed) for _ in range(virtual)]


def step(forward_backward: Callable[..., Any], model: list[Any], virtual: int, seed: int) -> Any:
    return forward_backward(
        forward_step_func=mc.forward_step,
        data_iterator=data(virtual, seed),
        model=model,
        num_microbatches=MICROBATCHES,
        seq_length=mc.SEQ_LENGTH,
        micro_batch_size=mc.MICRO_BATCH_SIZE,
    )


def init(virtual: int) -> tuple[list[Any], Any]:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=WORLD,
        virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
    )
    return mc.build_chunks(WORLD, virtual)


def run_schedule(virtual: int, out_dir: Path, rank: int) -> dict[str, Any]:
    """ITERATIONS iterations; the executed order against the schedule, then the end."""
    model, _ = init(virtual)
    energy = MegatronEnergy(config(out_dir))
    forward_backward = energy.wrap(schedules.get_forward_backward_func())
    fed: list[str] = []
    observed: list[list[tuple[Any, ...]]] = []
    expected: list[str] = []
    gpu = None
    phase = None

    def iterate() -> None:
        nonlocal gpu, phase, expected
        for it in range(ITERATIONS):
            with Observer(model) as observer:
                step(forward_backward, model, virtual, seed=it)
            observed.append(observer.calls)
            if it == 0:
                pipeline = energy.pipeline
                assert pipeline is not None
                gpu = pipeline.rank.gpu
                expected = [str(i) for i in pipeline.schedule.device_orders[rank]]
                record_fed(energy, fed)
        assert energy.pipeline is not None and energy.pipeline.online is not None
        phase = energy.pipeline.online.phase

    evaluation: dict[str, Any] = {}
    if virtual == 1:
        iterate()
        locked_during = gpu.locked_clocks_mhz() if gpu is not None else None
        # Evaluation (forward_only) runs untouched: nothing fed, not an iteration, and the
        # profiling window in progress is paused before it (an Interruption).
        fed_before = len(fed)
        controller = energy.controller
        assert controller is not None
        handled: list[str] = []
        handle = controller.handle

        def recorded(event: Any) -> Any:
            handled.append(type(event).__name__)
            return handle(event)

        controller.handle = recorded  # type: ignore[method-assign]
        losses = forward_backward(
            forward_step_func=mc.forward_step,
            data_iterator=data(1, 99),
            model=model,
            num_microbatches=MICROBATCHES,
            seq_length=mc.SEQ_LENGTH,
            micro_batch_size=mc.MICRO_BATCH_SIZE,
            forward_only=True,
        )
        del controller.handle
        evaluation = {"fed": len(fed) - fed_before, "losses": len(losses), "events": handled}
        energy.close()
    else:
        with energy:
            iterate()
            locked_during = gpu.locked_clocks_mhz() if gpu is not None else None
    assert gpu is not None
    return {
        "expected": expected,
        "fed": fed,
        "observed": observed,
        "phase": phase,
        "locked_during": locked_during,
        "locked_after": gpu.locked_clocks_mhz(),
        "hooks_removed": hooks_removed(),
        "summary": energy.summary is not None,
        "evaluation": evaluation,
    }


def run_shape_change(out_dir: Path) -> dict[str, Any]:
    """A schedule Perseus cannot follow is refused before any GPU is opened; a second call
    with other micro-batch counts is a clear error, the GPU restored; the call after that
    opens a new run."""
    model, megatron_config = init(1)
    energy = MegatronEnergy(config(out_dir))
    forward_backward = energy.wrap(schedules.get_forward_backward_func())
    # A schedule Perseus cannot follow: refused before any GPU is opened.
    megatron_config.overlap_moe_expert_parallel_comm = True
    unsupported = None
    try:
        step(forward_backward, model, 1, seed=0)
    except ConfigError as exc:
        unsupported = str(exc)
    unsupported_opened = energy.pipeline is not None or energy.running
    megatron_config.overlap_moe_expert_parallel_comm = False
    step(forward_backward, model, 1, seed=0)
    assert energy.pipeline is not None
    gpu = energy.pipeline.rank.gpu
    error = None
    try:
        forward_backward(
            forward_step_func=mc.forward_step,
            data_iterator=mc.batches(2, 0),
            model=model,
            num_microbatches=2,
            seq_length=mc.SEQ_LENGTH,
            micro_batch_size=mc.MICRO_BATCH_SIZE,
        )
    except ConfigError as exc:
        error = str(exc)
    locked_after = gpu.locked_clocks_mhz()
    running = energy.running
    # The next call opens a new run, with its own schedule.
    forward_backward(
        forward_step_func=mc.forward_step,
        data_iterator=mc.batches(2, 0),
        model=model,
        num_microbatches=2,
        seq_length=mc.SEQ_LENGTH,
        micro_batch_size=mc.MICRO_BATCH_SIZE,
    )
    assert energy.pipeline is not None
    reopened = energy.pipeline.schedule.num_microbatches
    energy.close()
    return {
        "unsupported": unsupported,
        "unsupported_opened": unsupported_opened,
        "error": error,
        "locked_after": locked_after,
        "running": running,
        "reopened_microbatches": reopened,
        "hooks_removed": hooks_removed(),
    }


def run_failure(out_dir: Path, rank: int) -> dict[str, Any]:
    """The second iteration raises in a forward of every rank (no rank waits for another)."""
    model, _ = init(1)
    energy = MegatronEnergy(config(out_dir))
    forward_backward = energy.wrap(schedules.get_forward_backward_func())
    calls = 0

    def failing(data_iterator: Iterator[Any], chunk: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == MICROBATCHES + 1 + (1 - rank):
            raise RuntimeError("boom")
        return mc.forward_step(data_iterator, chunk)

    error = None
    gpu = None
    locked_during = None
    try:
        with energy:
            for it in range(ITERATIONS):
                forward_backward(
                    forward_step_func=failing,
                    data_iterator=data(1, it),
                    model=model,
                    num_microbatches=MICROBATCHES,
                    seq_length=mc.SEQ_LENGTH,
                    micro_batch_size=mc.MICRO_BATCH_SIZE,
                )
                assert energy.pipeline is not None
                gpu = energy.pipeline.rank.gpu
                locked_during = gpu.locked_clocks_mhz()
    except RuntimeError as exc:
        error = str(exc)
    assert gpu is not None
    return {
        "error": error,
        "locked_during": locked_during,
        "locked_after": gpu.locked_clocks_mhz(),
        "hooks_removed": hooks_removed(),
        "summary": energy.summary is not None,
    }


def run_paced(out_dir: Path) -> dict[str, Any]:
    """Online planning under a carbon pace: the pace's target iteration time reaches
    Perseus on every rank, and the re-planned iterations follow it."""
    model, _ = init(1)
    paced = config(out_dir)
    paced["device"]["start"] = PACED_START
    paced["perseus"]["replan_every_iterations"] = 1
    paced["log_every_n_steps"] = 2  # the pace moves at logging boundaries
    paced["carbon"] = {
        "provider": "trace",
        "region": "DE",
        "policy": "forecast",
        "max_slowdown": 1.3,
        "allow_pause": False,
        "poll_interval_s": 3600,
    }
    energy = MegatronEnergy(paced, total_steps=200, stage_times_s=PACED_STAGE_TIMES_S)
    forward_backward = energy.wrap(schedules.get_forward_backward_func())
    iterations = []
    with energy:
        step(forward_backward, model, 1, seed=0)  # the run opens at the first call
        pipeline = energy.pipeline
        assert pipeline is not None and pipeline.online is not None
        online, gpu = pipeline.online, pipeline.rank.gpu
        planned, seed = 0, 1
        while planned < PACED_ITERATIONS:
            phase, start_s = online.phase, gpu.now_s()
            step(forward_backward, model, 1, seed=seed)
            seed += 1
            planned += phase == "planned"
            iterations.append(
                {"phase": phase, "time_s": gpu.now_s() - start_s, "target_s": online.target_time_s}
            )
    return {"iterations": iterations}


def main() -> None:
    rank, port, out_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results: dict[str, Any] = {"version": megatron.core.__version__}
    try:
        with mc.cuda_calls_on_cpu():
            results["1f1b"] = run_schedule(1, out_dir, rank)
            results["interleaved"] = run_schedule(2, out_dir, rank)
            results["shape_change"] = run_shape_change(out_dir)
            results["failure"] = run_failure(out_dir, rank)
            results["paced"] = run_paced(out_dir)
    finally:
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
