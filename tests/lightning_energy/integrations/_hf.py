"""The Transformers ``Trainer`` of the integration tests: the example's tiny model and data,
a configuration whose profile completes in a few dozen steps, and a quiet CPU Trainer."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "transformers" / "train.py"
#: The simulated A40's own power limit, and the candidates the tests profile.
PRE_JOB_W = 300.0
CANDIDATES_W = [300.0, 250.0, 200.0, 150.0]


def load_example() -> ModuleType:
    """examples/transformers/train.py, imported (its model and dataset are reused)."""
    spec = importlib.util.spec_from_file_location("transformers_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reset_accelerate() -> None:
    """Forget the process-wide Accelerate state a Trainer leaves (the next one starts anew)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def hf_config(**power_limit: Any) -> dict[str, Any]:
    """A simulated A40 at 100 steps an epoch (~37 s steps, longer than a profiling window
    must last) with a little noise, profiling :data:`CANDIDATES_W` (``power_limit``
    adds to the section)."""
    return {
        "device": {"backend": "simulated", "gpu": "a40", "steps_per_epoch": 100, "noise_std": 0.02},
        "power_limit": {
            "power_limits_w": CANDIDATES_W,
            "warmup_steps": 2,
            "settle_steps": 1,
            **power_limit,
        },
        "log_every_n_steps": 5,
    }


def hf_trainer(example: ModuleType, tmp_path: Path, callback: Any, **args: Any) -> Any:
    """A quiet CPU ``Trainer`` of the example's model with ``callback`` (``args`` add to or
    override the ``TrainingArguments``; ``callback=None`` for none)."""
    from transformers import Trainer, TrainingArguments

    defaults: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "max_steps": 10,
        "logging_steps": 5,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
    }
    defaults.update(args)
    return Trainer(
        model=example.TinyRegressor(),
        args=TrainingArguments(**defaults),
        train_dataset=example.SyntheticRegression(size=512),
        eval_dataset=example.SyntheticRegression(size=16),
        callbacks=[] if callback is None else [callback],
    )
