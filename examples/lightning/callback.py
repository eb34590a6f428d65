"""Plain-Python example: add the energy callback to a Lightning ``Trainer``.

    python examples/lightning/callback.py --steps 1200 --report runs/callback.json

The callback profiles the power limits during the first steps, keeps the one the ``cost``
selector prefers, paces training by the German grid's carbon intensity (a shipped 2023
trace) within 1.5x the full-speed time, and restores the GPU at the end. Without an NVIDIA
GPU it drives a simulated A40 on a virtual clock, so the run takes seconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning.pytorch import Trainer
from model import BlobData, Classifier

from lightning_energy.integrations.lightning import EnergyCallback
from lightning_energy.report import build_report, format_report


def main(argv: Sequence[str] | None = None) -> EnergyCallback:
    """Train and print the energy summary; returns the callback (for its controller)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200, help="training steps")
    parser.add_argument("--region", default="DE", help="carbon trace: CISO, DE or FR")
    parser.add_argument("--report", help="write the run report (JSON) here")
    parser.add_argument("--backend", default="auto", help="auto, simulated or nvml")
    parser.add_argument(
        "--start", help="simulated GPU only: when its clock starts (UTC), default now"
    )
    args = parser.parse_args(argv)

    energy = EnergyCallback(
        # Long simulated steps (~37 s): the short example finishes its profile.
        device={
            "backend": args.backend,
            "gpu": "a40",
            "steps_per_epoch": 100,
            "noise_std": 0.02,
            "start": args.start,
        },
        power_limit={"selector": "cost", "eta": 0.5},
        carbon={"provider": "trace", "region": args.region, "max_slowdown": 1.5},
        report=args.report,
    )
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="auto",
        devices=1,
        callbacks=[energy],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(Classifier(), datamodule=BlobData(samples=32768))
    assert energy.controller is not None
    print(format_report(build_report(energy.controller)))
    return energy


if __name__ == "__main__":
    main()
