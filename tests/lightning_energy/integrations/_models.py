"""A tiny real LightningModule and data for integration tests (both namespaces)."""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset


def make_loader(n: int = 256, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Synthetic binary classification data."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x.sum(dim=1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


@functools.cache
def module_class(namespace: Any) -> type:
    """A small MLP classifier as a LightningModule of the given namespace (one class per
    namespace, found again by name in this module: it pickles, as ``ddp_spawn`` needs)."""

    class TinyClassifier(namespace.LightningModule):
        def __init__(self, fail_at_step: int | None = None) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
            )
            self.fail_at_step = fail_at_step

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.fail_at_step is not None and self.global_step >= self.fail_at_step:
                raise RuntimeError("boom in training_step")
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    name = f"TinyClassifier_{namespace.__name__.replace('.', '_')}"
    TinyClassifier.__name__ = TinyClassifier.__qualname__ = name
    globals()[name] = TinyClassifier
    return TinyClassifier


#: The candidate power limits (W) the integration tests profile on the simulated A40.
CANDIDATES = [300.0, 250.0, 200.0, 150.0, 100.0]


def energy_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """A configuration whose profile completes in a few dozen steps: a simulated A40 at
    100 steps an epoch (~37 s steps, longer than a profiling window must last), the
    energy selector over :data:`CANDIDATES`, leases under ``tmp_path``."""
    config: dict[str, Any] = {
        "device": {
            "backend": "simulated",
            "gpu": "a40",
            "steps_per_epoch": 100,
            "lease_dir": str(tmp_path / "leases"),
        },
        "power_limit": {
            "selector": "energy",
            "power_limits_w": CANDIDATES,
            "warmup_steps": 2,
            "settle_steps": 1,
        },
        "log_every_n_steps": 5,
    }
    config.update(extra)
    return config


def quiet_trainer(ns: Any, callback: Any, tmp_path: Path, steps: int, **kw: Any) -> Any:
    """A CPU ``Trainer`` of namespace ``ns`` with one callback and nothing else: no progress
    bar, summary, checkpoints, sanity validation or logger (``kw`` adds to or overrides)."""
    options: dict[str, Any] = {
        "max_steps": steps,
        "accelerator": "cpu",
        "devices": 1,
        "callbacks": [callback],
        "default_root_dir": str(tmp_path),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "logger": False,
    }
    return ns.Trainer(**{**options, **kw})


def lightning_namespace(name: str) -> tuple[Any, Any]:
    """A Lightning namespace (``lightning.pytorch`` or ``pytorch_lightning``) and the
    integration module built on it."""
    ns = importlib.import_module(name)
    integ = importlib.import_module(
        "lightning_energy.integrations."
        + ("lightning" if name == "lightning.pytorch" else "pytorch_lightning")
    )
    return ns, integ
