"""Train a tiny Megatron-Core pipeline while Perseus plans per-instruction GPU clocks.

One process per pipeline rank, on CPU with simulated GPUs (energy.yaml next to this script,
or the file named by LIGHTNING_ENERGY_CONFIG, or --config):

    torchrun --nproc_per_node 2 examples/megatron/train.py
    torchrun --nproc_per_node 2 examples/megatron/train.py --virtual-stages 2
    torchrun --nproc_per_node 4 examples/megatron/train.py \\
        --stage-times-s 0.2:0.4,0.2:0.4,0.2:0.4,0.3:0.6

``--iterations`` forward-backward calls (one training iteration each) run: Perseus first
runs ``perseus.warmup_iterations`` of them at the maximum clock, profiles a few clocks
online, then applies its plan. Rank 0 prints one JSON line: the iteration time and the
energy of all GPUs per iteration at the maximum clock (``*_max``, the warm-up) and with the
plan (``*_plan``), their ratio and the energy saving; the first iteration of each phase is
left out (the clocks of the phase before are still landing). With ``--virtual-stages``
above 1 Megatron-Core runs its interleaved 1F1B schedule, else 1F1B. ``--stage-times-s``
gives each stage's forward and backward time of one micro-batch at the maximum clock (all
``ranks x virtual stages`` stages, in stage order). The default is 0.2:0.4 on every stage
but the last, which is 1.5 times heavier (0.3:0.6): the other stages then wait for it, and
Perseus runs their forwards and backwards at lower clocks in that slack. With balanced
stages a two-stage 1F1B pipeline has no such slack: every forward and backward is on the
critical path (the only idle time is the fill and drain bubbles, where no instruction
runs), so the plan keeps the maximum clock and saves nothing. Every GPU setting is
restored at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import megatron_cpu  # the CPU shim and tiny model, next to this script
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from lightning_energy.config import CONFIG_ENV_VAR
from lightning_energy.integrations.megatron import MegatronEnergy

#: Forward and backward seconds of a stage at the maximum clock, and of the heavier last.
DEFAULT_STAGE_TIMES_S = (0.2, 0.4)
DEFAULT_LAST_STAGE_TIMES_S = (0.3, 0.6)


def stage_times(text: str) -> list[list[float]]:
    """``F:B,F:B,...`` -> ``[[F, B], ...]`` (seconds, each > 0)."""
    pairs = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 2 or not all(v > 0 for v in values):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not allowed; use FORWARD:BACKWARD seconds, both > 0"
            )
        pairs.append(values)
    return pairs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--iterations", type=int, default=40, help="forward-backward calls (iterations)"
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per iteration")
    parser.add_argument(
        "--stage-times-s",
        type=stage_times,
        help="F:B seconds at the maximum clock, one pair per stage (default: 0.2:0.4, the last "
        "stage 0.3:0.6)",
    )
    parser.add_argument("--gpu", choices=["a100", "h100"], default="a100", help="simulated GPU")
    parser.add_argument(
        "--virtual-stages", type=int, default=1, help="model chunks per rank (>1: interleaved)"
    )
    parser.add_argument(
        "--config",
        default=os.environ.get(CONFIG_ENV_VAR) or str(Path(__file__).with_name("energy.yaml")),
        help=f"energy YAML (default: ${CONFIG_ENV_VAR}, else energy.yaml next to this script)",
    )
    args = parser.parse_args()
    for name in ("iterations", "microbatches", "virtual_stages"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')}: {getattr(args, name)} is not allowed; use >= 1"
            )
    return args


def per_iteration(records: list[list[dict[str, Any]]], phase: str) -> tuple[float, float]:
    """``(seconds, joules of all ranks)`` per iteration of ``phase``, its first left out.

    Raises:
        SystemExit: fewer than two iterations of ``phase`` to measure.
    """
    indices = [i for i, record in enumerate(records[0]) if record["phase"] == phase][1:]
    if len(indices) < 2:
        raise SystemExit(
            f"--iterations: too few to measure the {phase!r} phase; run more (it needs "
            "perseus.warmup_iterations, the online profile and a few planned iterations)"
        )
    before, last = indices[0] - 1, indices[-1]
    count = last - before
    time_s = records[0][last]["end_s"] - records[0][before]["end_s"]
    energy_j = sum(rank[last]["end_j"] - rank[before]["end_j"] for rank in records)
    return time_s / count, energy_j / count


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    ranks, virtual = dist.get_world_size(), args.virtual_stages
    stages = ranks * virtual
    times = args.stage_times_s or [list(DEFAULT_STAGE_TIMES_S)] * (stages - 1) + [
        list(DEFAULT_LAST_STAGE_TIMES_S)
    ]
    if len(times) != stages:
        raise SystemExit(
            f"--stage-times-s: {len(times)} pairs is not allowed; use one per stage "
            f"({ranks} ranks x {virtual} virtual stages = {stages})"
        )
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=ranks,
        virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
    )
    # The one line: Perseus on Megatron-Core's schedule (the GPU model overrides the file's).
    energy = MegatronEnergy(args.config, device={"gpu": args.gpu}, stage_times_s=times)
    records: list[dict[str, Any]] = []
    with megatron_cpu.cuda_calls_on_cpu(), energy:
        model, _ = megatron_cpu.build_chunks(ranks, virtual)
        optimizer = torch.optim.SGD([p for chunk in model for p in chunk.parameters()], lr=0.01)
        forward_backward = energy.wrap(get_forward_backward_func())
        for iteration in range(args.iterations):
            data = [megatron_cpu.batches(args.microbatches, seed=iteration) for _ in model]
            pipeline = energy.pipeline  # opened by the first call
            phase = pipeline.online.phase if pipeline and pipeline.online else "warmup"
            forward_backward(
                forward_step_func=megatron_cpu.forward_step,
                data_iterator=data if virtual > 1 else data[0],
                model=model,
                num_microbatches=args.microbatches,
                seq_length=megatron_cpu.SEQ_LENGTH,
                micro_batch_size=megatron_cpu.MICRO_BATCH_SIZE,
            )
            optimizer.step()
            optimizer.zero_grad()
            pipeline = energy.pipeline
            if pipeline is None or pipeline.online is None:
                raise SystemExit(f"{args.config}: set perseus.enabled: true, without a plan file")
            gpu = pipeline.rank.gpu
            records.append({"phase": phase, "end_s": gpu.now_s(), "end_j": gpu.energy_j()})
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        max_s, max_j = per_iteration(gathered, "warmup")
        plan_s, plan_j = per_iteration(gathered, "planned")
        result = {
            "engine": "megatron-core",
            "stages": stages,
            "microbatches": args.microbatches,
            "iteration_time_s_max": max_s,
            "energy_j_max": max_j,
            "iteration_time_s_plan": plan_s,
            "energy_j_plan": plan_j,
            "time_ratio": plan_s / max_s,
            "energy_saving": 1.0 - plan_j / max_j,
        }
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
