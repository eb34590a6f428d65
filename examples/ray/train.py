"""Ray Train: Lightning under ``TorchTrainer`` with the energy callback on every worker.

Run (CPU, simulated GPUs; two workers)::

    python examples/ray/train.py --workers 2 --steps 60

Each Ray worker is one process of the job: ``RayDDPStrategy`` sets up the process group and
the energy callback drives the GPU that worker trains on (with ``use_gpu=True`` Ray gives
each worker exactly one visible GPU). Rank 0 writes the report with the job's totals.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lightning"))


def train_loop(config: dict[str, Any]) -> None:
    """What every Ray worker runs: an ordinary Lightning fit plus the energy callback."""
    import lightning.pytorch as pl
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    from lightning_energy.integrations.lightning import EnergyCallback

    sys.path.insert(0, config["model_dir"])
    from model import BlobData, Classifier

    energy = EnergyCallback(config["energy"])
    trainer = pl.Trainer(
        max_steps=config["steps"],
        accelerator="gpu" if config["use_gpu"] else "cpu",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[energy],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=config["out_dir"],
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(Classifier(), datamodule=BlobData(samples=2048, batch_size=32))
    assert energy.summary is not None
    path = Path(config["out_dir"]) / f"rank{trainer.global_rank}.json"
    path.write_text(json.dumps(energy.summary.to_dict()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Launch the job on a local Ray cluster and return rank 0's summary."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--config", default=str(Path(__file__).with_name("energy.yaml")))
    parser.add_argument("--out", default="runs/ray")
    args = parser.parse_args(argv)
    import yaml

    energy = yaml.safe_load(Path(args.config).read_text(encoding="utf-8"))
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    energy["report"] = str(out_dir / "energy.json")
    ray.init(num_cpus=max(args.workers, 1), include_dashboard=False, log_to_driver=True)
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={
                "energy": energy,
                "steps": args.steps,
                "use_gpu": args.use_gpu,
                "out_dir": str(out_dir),
                "model_dir": str(Path(__file__).resolve().parent.parent / "lightning"),
            },
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.use_gpu),
            run_config=RunConfig(storage_path=str(out_dir / "ray_results"), name="energy"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    return json.loads((out_dir / "rank0.json").read_text())


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
