"""Controller overhead per training step, and Lightning fit time with/without the callback.

Two measurements, in one run:

1. ``median_step_overhead_us``: the time spent inside ``EnergyController.on_step_start``
   plus ``on_step_end`` per step, over a whole profile-and-train run (profiling windows,
   interval closes and metric updates included). The GPU is a simulated A40 whose
   simulated work is excluded (``run_step`` is not called), so only the controller's own
   bookkeeping and the energy-counter reads are timed.
2. ``fit_time_ratio``: wall time of ``Trainer.fit`` on a small MLP with the
   ``EnergyCallback`` over the same fit without it; runs alternate (A, B, A, B, ...) and the
   ratio of the medians is reported, so machine noise hits both sides alike.

Targets (benchmarks/README.md): median overhead <= 50 us, fit ratio <= 1.01.

Usage::

    python benchmarks/overhead.py [--steps 3000] [--fit-steps 300] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus


def step_overhead_us(steps: int, lease_dir: str) -> dict[str, float]:
    """Median and p99 of the controller's time per step, in microseconds."""
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", noise_std=0.02))
    devices = DeviceSet(gpus=gpus, clock=gpus[0].clock.now, backend="simulated")
    config = EnergyConfig.from_mapping(
        {"device": {"backend": "simulated", "lease_dir": lease_dir}, "log_every_n_steps": 50}
    )
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    samples: list[float] = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            controller.on_step_start()
            t1 = time.perf_counter()
            gpus[0].run_step()  # the "training step": simulated GPU work, not timed
            t2 = time.perf_counter()
            controller.on_step_end()
            t3 = time.perf_counter()
            samples.append((t1 - t0) + (t3 - t2))
    finally:
        controller.teardown()
    samples.sort()
    return {
        "median_step_overhead_us": statistics.median(samples) * 1e6,
        "p99_step_overhead_us": samples[int(0.99 * (len(samples) - 1))] * 1e6,
        "profile_complete": float(controller.profile_done),
    }


def _fit_seconds(with_callback: bool, steps: int, lease_dir: str) -> tuple[float, float]:
    """Wall and process-CPU seconds of one ``Trainer.fit``."""
    import lightning.pytorch as pl

    from lightning_energy.integrations.lightning import EnergyCallback

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024 * 16, 256, generator=g)
    data = TensorDataset(x, torch.randint(0, 10, (1024 * 16,), generator=g))
    callbacks: list[pl.Callback] = []
    if with_callback:
        callbacks.append(
            EnergyCallback(device={"backend": "simulated", "gpu": "a40", "lease_dir": lease_dir})
        )
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.fit(MLP(), DataLoader(data, batch_size=1024))
    return time.perf_counter() - t0, time.process_time() - c0


def fit_time_ratio(steps: int, repeats: int, lease_dir: str) -> dict[str, float]:
    """Median fit time with the callback over the median without it (alternating runs).

    Wall time is what a user sees; process CPU time is reported too because it is far
    less disturbed by other load on a shared machine.
    """
    _fit_seconds(False, 20, lease_dir)  # warm-up: imports, allocator, thread pools
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(repeats):
        for with_callback in (False, True):
            runs[with_callback].append(_fit_seconds(with_callback, steps, lease_dir))

    def median(with_callback: bool, i: int) -> float:
        return statistics.median(r[i] for r in runs[with_callback])

    return {
        "fit_time_ratio": median(True, 0) / median(False, 0),
        "fit_cpu_time_ratio": median(True, 1) / median(False, 1),
        "fit_with_callback_s": median(True, 0),
        "fit_without_callback_s": median(False, 0),
    }


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="controller steps to time")
    parser.add_argument("--fit-steps", type=int, default=500, help="training steps per fit")
    parser.add_argument("--repeats", type=int, default=5, help="fits with and without")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as lease_dir:
        result = step_overhead_us(args.steps, lease_dir)
        result.update(fit_time_ratio(args.fit_steps, args.repeats, lease_dir))
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"controller overhead per step: median {result['median_step_overhead_us']:.1f} us, "
        f"p99 {result['p99_step_overhead_us']:.1f} us (target median <= 50 us)"
    )
    print(
        f"Lightning fit time with/without EnergyCallback: {result['fit_time_ratio']:.4f} wall "
        f"({result['fit_with_callback_s']:.2f} s / {result['fit_without_callback_s']:.2f} s), "
        f"{result['fit_cpu_time_ratio']:.4f} process CPU; medians of {args.repeats} "
        "(target <= 1.01)"
    )


if __name__ == "__main__":
    main()
