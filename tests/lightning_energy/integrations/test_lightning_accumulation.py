"""Under gradient accumulation a Lightning step is one optimizer step, as the job's length.

Lightning calls the batch hooks once per micro-batch but counts ``global_step`` (and
``estimated_stepping_batches``, the length carbon pacing plans to) in optimizer steps:
the callback must count the same steps it declares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.lightning_energy.integrations._models import (
    energy_config,
    lightning_namespace,
    make_loader,
    module_class,
    quiet_trainer,
)


@pytest.mark.parametrize("accumulate", [1, 4])
def test_a_step_is_one_optimizer_step_under_gradient_accumulation(
    tmp_path: Path, accumulate: int
) -> None:
    ns, integ = lightning_namespace("lightning.pytorch")
    callback = integ.EnergyCallback(energy_config(tmp_path))
    declared: list[int | None] = []

    class RecordTotal(ns.Callback):  # type: ignore[name-defined]
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            declared.append(callback.controller.total_steps)

    trainer = quiet_trainer(ns, callback, tmp_path, steps=6, accumulate_grad_batches=accumulate)
    trainer.callbacks.append(RecordTotal())
    trainer.fit(module_class(ns)(), make_loader())

    assert trainer.global_step == 6
    assert declared == [6]
    assert callback.summary is not None
    assert callback.summary.steps == trainer.global_step
