"""Train a pipeline-parallel model with DeepSpeed while Perseus plans per-instruction clocks.

One pipeline stage per process; on CPU (gloo) the GPUs are simulated (energy.yaml):

    torchrun --nproc_per_node 2 examples/deepspeed/train.py \
        --iterations 40 --microbatches 4 --stage-times-s 0.2:0.4,0.3:0.6

``--stage-times-s`` gives each stage's forward and backward time of one micro-batch at the
maximum clock (simulated GPUs), ``--gpu`` the simulated GPU. The default is 0.2:0.4 on every
stage but the last, which is 1.5 times heavier (0.3:0.6): the other stages then wait for
it, and Perseus runs their forwards and backwards at lower clocks in that slack. With
balanced stages a two-stage 1F1B pipeline has no such slack: every forward and backward
is on the critical path (the only idle time is the fill and drain bubbles, where no
instruction runs), so no instruction can run slower without lengthening the iteration, and
the plan keeps the maximum clock and saves nothing.
Perseus runs the first iterations at the maximum clock, profiles a few clocks online,
then applies its plan. Rank 0 prints one JSON line: the iteration time and the energy of
all GPUs per iteration at the maximum clock (``*_max``) and with the plan (``*_plan``),
their ratio and the energy saving. Every GPU setting is restored at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from lightning_energy.integrations.deepspeed import attach_energy

CONFIG = Path(__file__).with_name("energy.yaml")
FEATURES = 16


def stage_times(text: str) -> list[list[float]]:
    """``F:B,F:B,...`` -> ``[[F, B], ...]`` (positive seconds)."""
    try:
        pairs = [[float(v) for v in pair.split(":")] for pair in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) <= 0 for p in pairs):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed; use F:B pairs of positive seconds, one per stage, "
            "e.g. 0.2:0.4,0.3:0.6"
        )
    return pairs


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; use an integer >= 1")
    return value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=positive, default=40, help="train_batch calls")
    parser.add_argument("--microbatches", type=positive, default=4, help="per batch")
    parser.add_argument(
        "--stage-times-s",
        type=stage_times,
        help="F:B seconds per stage at the maximum clock (default: 0.2:0.4, the last stage "
        "0.3:0.6)",
    )
    parser.add_argument("--gpu", choices=["a100", "h100"], default="a100")
    parser.add_argument("--config", default=str(CONFIG), help="lightning-energy YAML")
    return parser.parse_args()


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    while True:
        x = torch.randn(2, FEATURES, generator=generator)
        yield x, x.sin()


def per_iteration(
    records: Sequence[Sequence[dict[str, Any]]], phase: str
) -> tuple[float, float] | None:
    """Time and all ranks' energy per iteration over the iterations of ``phase``, leaving
    out the first (the clocks of the phase before are still landing)."""
    indices = [i for i, r in enumerate(records[0]) if r["phase"] == phase][1:]
    if len(indices) < 2:
        return None
    first, last = indices[0], indices[-1]
    count = last - first + 1
    time_s = (records[0][last]["end_s"] - records[0][first - 1]["end_s"]) / count
    energy_j = sum(r[last]["end_j"] - r[first - 1]["end_j"] for r in records) / count
    return time_s, energy_j


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        # DeepSpeed's CPU shared-memory collectives are a JIT-compiled op; gloo needs none.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    try:
        run(args)
    finally:
        # Before the interpreter exits: gloo's worker threads must not outlive it (an abort,
        # "terminate called without an active exception", otherwise).
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    """Train the pipeline on this rank; rank 0 prints the result."""
    stages = dist.get_world_size()
    times = args.stage_times_s or [[0.2, 0.4]] * (stages - 1) + [[0.3, 0.6]]
    if len(times) != stages:
        sys.exit(
            f"--stage-times-s: {len(times)} stages given; this run has {stages} (one per process)"
        )

    torch.manual_seed(0)
    layers = [
        torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), torch.nn.Tanh())
        for _ in range(stages)
    ]
    module = PipelineModule(
        layers=layers, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform"
    )
    engine, *_ = deepspeed.initialize(
        model=module,
        model_parameters=list(module.parameters()),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": args.microbatches,
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
            "steps_per_print": 10**9,
        },
    )

    # The one line: Perseus on this engine (the GPU model overrides the file's).
    energy = attach_energy(engine, args.config, device={"gpu": args.gpu}, stage_times_s=times)
    pipeline = energy.pipeline
    if pipeline is None or pipeline.online is None:
        sys.exit(f"{args.config}: this example needs perseus: enabled with online planning")
    gpu = pipeline.rank.gpu
    records = []
    data = batches()
    with energy:
        for _ in range(args.iterations):
            phase = pipeline.online.phase
            engine.train_batch(data)
            records.append({"phase": phase, "end_s": gpu.now_s(), "end_j": gpu.energy_j()})
    gathered: list[Any] = [None] * stages
    dist.all_gather_object(gathered, records)
    if dist.get_rank() != 0:
        return
    at_max, with_plan = per_iteration(gathered, "warmup"), per_iteration(gathered, "planned")
    if at_max is None or with_plan is None:
        sys.exit(
            f"--iterations {args.iterations} is too few: it needs a few warm-up iterations "
            "(perseus.warmup_iterations), the online profile and a few planned iterations"
        )
    result = {
        "engine": "deepspeed",
        "stages": stages,
        "microbatches": args.microbatches,
        "iteration_time_s_max": at_max[0],
        "energy_j_max": at_max[1],
        "iteration_time_s_plan": with_plan[0],
        "energy_j_plan": with_plan[1],
        "time_ratio": with_plan[0] / at_max[0],
        "energy_saving": 1.0 - with_plan[1] / at_max[1],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
