"""Train a tiny Megatron-Core GPT whose layers overlap two nano-batches (Kareus).

Four processes on CPU with gloo (tensor parallel 2, pipeline parallel 2) and simulated GPUs:

    torchrun --nproc_per_node 4 examples/megatron/kareus_gpt.py
    torchrun --nproc_per_node 4 examples/megatron/kareus_gpt.py --plan kareus_plan.json \\
        --microbatches 8

Without ``--plan`` the layers run plain nano-batching; a plan (``lightning-energy plan
--config``, made for 1F1B over 2 stages with ``--microbatches`` micro-batches, 2 layers
per stage, ``tp_size`` 2) sets each instruction's CTAs, launch slots and clocks. The same
GPT with Megatron-Core's own layers (the same weights) trains the same iterations first;
the last pipeline rank of tensor-parallel rank 0 prints one JSON line: both runs' losses
and their largest relative difference (float32 reduction order only).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import megatron_cpu as mc  # the CPU shim and the tiny GPT, next to this script
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func

from lightning_energy.integrations.megatron import MegatronEnergy
from lightning_energy.kareus.megatron_layer import KareusMegatron


def train(model: Any, forward_backward: Any, args: argparse.Namespace) -> list[float]:
    """``args.iterations`` SGD steps; the mean loss of each (on the last pipeline stage)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for iteration in range(args.iterations):
        out = forward_backward(
            forward_step_func=mc.gpt_forward_step,
            data_iterator=mc.gpt_batches(args.microbatches, seed=iteration),
            model=[model],
            num_microbatches=args.microbatches,
            seq_length=mc.GPT_SEQ_LENGTH,
            micro_batch_size=mc.GPT_MICRO_BATCH_SIZE,
        )
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(float(o["loss"]) for o in out) / args.microbatches if out else 0.0)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="a Kareus plan file (default: plain nano-batching)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--iterations", type=int, default=3, help="training steps")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    with mc.cuda_calls_on_cpu():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2
        )
        reference = mc.build_gpt(get_gpt_layer_local_spec())
        kareus = KareusMegatron(args.plan)  # every rank, before the model
        model = mc.build_gpt(kareus.layer_spec())
        model.load_state_dict(reference.state_dict())  # the same parameters
        plain = train(reference, get_forward_backward_func(), args)
        energy = MegatronEnergy(
            {"device": {"backend": "simulated", "gpu": "a100"}, "perseus": {"enabled": False}},
            kareus=kareus,  # a plan enables Perseus with the plan's clocks
        )
        with energy:
            overlapped = train(model, energy.wrap(get_forward_backward_func()), args)
    if (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
    ):
        diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain, overlapped, strict=True))
        result = {"plan": args.plan, "plain": plain, "kareus": overlapped, "max_rel_diff": diff}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
