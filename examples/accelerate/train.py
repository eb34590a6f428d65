"""Train a small regression model with Accelerate while lightning-energy picks the power limit.

Run it on 2 processes (on CPU when no GPU is present; the GPU is simulated by energy.yaml):

    LIGHTNING_ENERGY_CONFIG=examples/accelerate/energy.yaml \
        accelerate launch --config_file examples/accelerate/accelerate_config.yaml \
        examples/accelerate/train.py

Each rank prints JSON lines on stdout: the power limit it applies once the profile is
complete, and a summary at the end. ``--checkpoint-dir`` saves the Accelerate state (the
energy profile included) at the end; ``--resume-from`` loads it first, so the chosen
limit is applied again without profiling. ``--fail-at-step`` raises an error at that
optimizer step, to see the GPU settings restored on an exception. Without
``LIGHTNING_ENERGY_CONFIG`` the same script trains exactly as before.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_energy.integrations.accelerate import EnergyTracker, attach_energy


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--checkpoint-dir", help="save_state here at the end")
    parser.add_argument("--resume-from", help="load_state from here before training")
    parser.add_argument("--fail-at-step", type=int, help="raise an error at this optimizer step")
    return parser.parse_args()


def emit(event: str, accelerator: Accelerator, **fields: Any) -> None:
    """Print one JSON line for this rank (one write, so ranks' lines never interleave)."""
    line = json.dumps({"event": event, "rank": accelerator.process_index, **fields})
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=[EnergyTracker()],
    )
    accelerator.init_trackers("lightning-energy-accelerate-example")
    energy = attach_energy(accelerator)  # the one line: reads $LIGHTNING_ENERGY_CONFIG

    torch.manual_seed(0)
    micro_batches = args.steps * args.gradient_accumulation_steps
    features = torch.randn(micro_batches * args.batch_size * accelerator.num_processes, 16)
    targets = features @ torch.randn(16, 1) + 0.1 * torch.randn(len(features), 1)
    loader = DataLoader(TensorDataset(features, targets), batch_size=args.batch_size)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.resume_from:
        accelerator.load_state(args.resume_from)

    controller = energy.controller
    reported_limit_w = None
    try:
        with energy:  # restores every GPU on exit, also when training raises
            for features_batch, target_batch in loader:
                with accelerator.accumulate(model):
                    loss = nn.functional.mse_loss(model(features_batch), target_batch)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                if controller is None or not accelerator.sync_gradients:
                    continue
                if args.fail_at_step is not None and controller.steps >= args.fail_at_step:
                    raise RuntimeError(f"simulated failure at step {controller.steps}")
                limit_w = controller.current_power_limit_w()
                if controller.profile_done and limit_w != reported_limit_w:
                    reported_limit_w = limit_w
                    emit("power_limit", accelerator, step=controller.steps, power_limit_w=limit_w)
            if args.checkpoint_dir:
                accelerator.save_state(args.checkpoint_dir)
    except RuntimeError as exc:
        if controller is not None and energy.summary is not None:  # the GPU is restored
            emit(
                "failed",
                accelerator,
                error=str(exc),
                gpu_power_limit_w=controller.devices.gpus[0].power_limit_w(),
                pre_job_power_limit_w=energy.summary.pre_job_power_limit_w,
                decisions=[d["reason"] for d in controller.decisions],
            )
        raise
    summary = energy.summary
    emit(
        "summary",
        accelerator,
        loss=loss.item(),
        energy_active=energy.active,
        steps=summary.steps if summary else None,
        power_limit_w=summary.power_limit_w if summary else None,
        decisions=[d["reason"] for d in controller.decisions] if controller else [],
        profile=controller.profile() if controller else [],
        logged_steps=[r["step"] for r in accelerator.get_tracker("lightning_energy", unwrap=True)]
        if accelerator.is_main_process
        else [],
    )
    # Every rank has finished before any tears the process group down.
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
