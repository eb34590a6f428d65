"""Train a tiny model with the Transformers ``Trainer`` while lightning-energy picks the limit.

Runs on CPU in a few seconds; the GPU is simulated by energy.yaml, nothing is downloaded:

    python examples/transformers/train.py --output-dir /tmp/energy-trainer
    python examples/transformers/train.py --output-dir /tmp/energy-trainer --max-steps 170 --resume

The second command resumes from the last checkpoint: the power-limit profile saved in it
is reused, nothing is profiled again. The script prints one JSON line at the end: the
chosen power limit, the steps this process ran (and the step it resumed at), and the
energy keys found in the Trainer's log history.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from lightning_energy.integrations.transformers import EnergyTrainerCallback


class TinyRegressor(nn.Module):
    """A two-layer regressor returning ``{"loss", "logits"}`` as the Trainer expects."""

    def __init__(self, features: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.mse_loss(logits, labels)
        return out


class SyntheticRegression(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random features with a noisy linear target (seeded)."""

    def __init__(self, size: int, features: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, features, generator=generator)
        weights = torch.randn(features, 1, generator=generator)
        self.y = self.x @ weights + 0.1 * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="checkpoints go here")
    parser.add_argument("--max-steps", type=int, default=150, help="optimizer steps in total")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=30)
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    parser.add_argument(
        "--config",
        default=str(Path(__file__).with_name("energy.yaml")),
        help="the lightning-energy YAML file",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=1e-2,
        logging_steps=10,
        save_steps=args.save_steps,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    energy = EnergyTrainerCallback(args.config)
    trainer = Trainer(
        model=TinyRegressor(),
        args=training_args,
        train_dataset=SyntheticRegression(size=8 * args.gradient_accumulation_steps * 50),
        callbacks=[energy],
    )
    with energy:  # restores the GPU settings at once if training raises
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    summary = energy.summary
    assert summary is not None and energy.controller is not None
    logged = sorted({k for entry in trainer.state.log_history for k in entry if "/" in k})
    result = {
        "power_limit_w": summary.power_limit_w,
        "steps": summary.steps,
        "resumed_at_step": summary.resumed_at_step,
        "energy_saved_j": summary.energy_saved_j,
        "decisions": [d["reason"] for d in energy.controller.decisions],
        "logged_keys": logged,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
