"""Train a tiny Megatron-Core pipeline while Perseus plans per-instruction GPU clocks.

One process per pipeline rank, on CPU with simulated GPUs (energy.yaml next to this script,
or the file named by LIGHTNING_ENERGY_CONFIG, or --config):

    torchrun --nproc_per_node 2 examples/megatron/train.py
    torchrun --nproc_per_node 2 examples/megatron/train.py --virtual-stages 2
    torchrun --nproc_per_node 4 examples/megatron/train.py \\
        --stage-times-s 0.1:0.2,0.1:0.2,0.1:0.2,0.2:0.4

The script runs ``--iterations`` iterations at the maximum clocks (Perseus' warm-up),
lets Perseus profile online and plan (as many iterations as the profile needs), then runs
``--iterations`` iterations with the plan. Rank 0 prints one JSON line: the iteration time
and the energy of one iteration (all ranks together) at all-max clocks and with the plan,
their ratio and the energy saved. With ``--virtual-stages`` above 1 Megatron-Core runs its
interleaved 1F1B schedule, else 1F1B. ``--stage-times-s`` gives each stage's forward and
backward time of one micro-batch at the maximum clock (all ``ranks x virtual stages``
stages, in stage order; default: balanced).
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

DEFAULT_STAGE_TIMES_S = (0.1, 0.2)
#: Iterations Perseus may take to profile before the script gives up.
MAX_PROFILE_ITERATIONS = 5000


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
        "--iterations", type=int, default=10, help="iterations measured at max clocks and plan"
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per iteration")
    parser.add_argument(
        "--stage-times-s",
        type=stage_times,
        help="F:B seconds at the maximum clock, one pair per stage (default: balanced)",
    )
    parser.add_argument("--gpu", default="a100", help="simulated GPU preset (a100, h100)")
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


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    ranks, virtual = dist.get_world_size(), args.virtual_stages
    stages = ranks * virtual
    times = args.stage_times_s or [list(DEFAULT_STAGE_TIMES_S)] * stages
    if len(times) != stages:
        raise SystemExit(
            f"--stage-times-s: {len(times)} pairs is not allowed; use one per stage "
            f"({ranks} ranks x {virtual} virtual stages = {stages})"
        )
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=ranks,
        virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
    )
    energy = MegatronEnergy(
        args.config,
        device={"gpu": args.gpu},
        # The warm-up at full clock is the all-max measurement (plus one to align ranks).
        perseus={"warmup_iterations": args.iterations + 1},
        stage_times_s=times,
    )
    with megatron_cpu.cuda_calls_on_cpu(), energy:
        model, _ = megatron_cpu.build_chunks(ranks, virtual)
        optimizer = torch.optim.SGD([p for chunk in model for p in chunk.parameters()], lr=0.01)
        forward_backward = energy.wrap(get_forward_backward_func())
        seed = 0

        def iteration() -> None:
            nonlocal seed
            seed += 1
            data: Any = [megatron_cpu.batches(args.microbatches, seed) for _ in model]
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

        def window() -> tuple[float, float]:
            """``(seconds, joules of all ranks)`` of ``--iterations`` iterations."""
            pipeline = energy.pipeline
            assert pipeline is not None
            gpu = pipeline.rank.gpu
            start_s, start_j = gpu.now_s(), gpu.energy_j()
            for _ in range(args.iterations):
                iteration()
            energy_j = torch.tensor([gpu.energy_j() - start_j], dtype=torch.float64)
            dist.all_reduce(energy_j)
            return gpu.now_s() - start_s, float(energy_j.item())

        iteration()  # the first iteration aligns the ranks' clocks
        max_s, max_j = window()
        online = energy.pipeline.online if energy.pipeline is not None else None
        if online is None:
            raise SystemExit(f"{args.config}: set perseus.enabled: true without a plan file")
        for _ in range(MAX_PROFILE_ITERATIONS):
            if online.phase != "profiling":
                break
            iteration()
        if online.phase != "planned":
            raise SystemExit(f"Perseus did not plan (phase {online.phase!r})")
        iteration()  # the plan's first clock changes land
        plan_s, plan_j = window()
    if dist.get_rank() == 0:
        n = args.iterations
        result = {
            "engine": "megatron-core",
            "stages": stages,
            "microbatches": args.microbatches,
            "iteration_time_s_max": max_s / n,
            "energy_j_max": max_j / n,
            "iteration_time_s_plan": plan_s / n,
            "energy_j_plan": plan_j / n,
            "time_ratio": plan_s / max_s,
            "energy_saving": 1.0 - plan_j / max_j,
        }
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
