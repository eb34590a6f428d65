"""One callback, many fits: every fit is a run of its own, and nothing else changes a GPU.

Real Lightning fits (and Fabric loops) on the simulated A40 on CPU. The conftest leak check
also fails any of these tests that leaves a simulated GPU changed.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.controller import EnergyController
from lightning_energy.device import GPU
from lightning_energy.integrations.adapter import EnergyAdapter
from tests.lightning_energy.integrations._models import (
    energy_config,
    make_loader,
    module_class,
    quiet_trainer,
)


def _controller(callback: EnergyAdapter) -> EnergyController:
    assert callback.controller is not None
    return callback.controller


def _gpu(callback: EnergyAdapter) -> GPU:
    return _controller(callback).devices.gpus[0]


def _windows(controller: Any) -> list[dict[str, Any]]:
    return [d for d in controller.decisions if d.get("purpose") == "profile"]


@pytest.fixture(params=["lightning.pytorch", "pytorch_lightning"])
def namespace(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    ns = importlib.import_module(request.param)
    integ = importlib.import_module(
        "lightning_energy.integrations."
        + ("lightning" if request.param == "lightning.pytorch" else "pytorch_lightning")
    )
    return ns, integ


def test_lr_find_then_fit_restores_counts_the_fit_and_writes_its_report(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    ns, integ = namespace
    tuner_module = importlib.import_module(f"{ns.__name__}.tuner")
    report = tmp_path / "report.json"
    callback = integ.EnergyCallback(energy_config(tmp_path, report=str(report)))
    trainer = quiet_trainer(ns, callback, tmp_path, steps=120)
    model = module_class(ns)()
    tuner_module.Tuner(trainer).lr_find(
        model, train_dataloaders=make_loader(), num_training=30, update_attr=False
    )
    # The lr_find fit was a run of its own: restored, summarised, reported.
    assert callback.summary is not None
    assert _gpu(callback).power_limit_w() == callback.summary.pre_job_power_limit_w
    report.unlink()

    trainer.fit(model, make_loader())
    summary = callback.summary
    assert summary is not None
    assert summary.steps == trainer.global_step == 120
    assert _gpu(callback).power_limit_w() == summary.pre_job_power_limit_w == 300.0
    assert json.loads(report.read_text())["summary"]["steps"] == 120


def test_a_second_fit_is_a_run_of_its_own_and_reuses_the_profile(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    callback = EnergyCallback(energy_config(tmp_path))
    trainer = quiet_trainer(ns, callback, tmp_path, steps=160)
    model = module_class(ns)()
    trainer.fit(model, make_loader())
    first = callback.summary
    assert first is not None and first.power_limit_w is not None
    assert _windows(callback.controller)  # the first fit profiled

    trainer.fit_loop.epoch_loop.max_steps = 220
    trainer.fit(model, make_loader())
    second = callback.summary
    assert second is not None and second is not first
    assert second.steps == 60  # this fit's steps only
    # Same workload: the first fit's choice applies at once, without profiling again.
    assert _windows(callback.controller) == []
    assert second.power_limit_w == first.power_limit_w
    assert _gpu(callback).power_limit_w() == second.pre_job_power_limit_w


def test_a_notebook_cell_run_again_with_a_new_trainer(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    callback = EnergyCallback(energy_config(tmp_path))
    summaries = []
    for _ in range(2):  # the same cell, run twice: a new Trainer, the same callback
        trainer = quiet_trainer(ns, callback, tmp_path, steps=100)
        trainer.fit(module_class(ns)(), make_loader())
        summaries.append(callback.summary)
        assert _gpu(callback).power_limit_w() == 300.0
    first, second = summaries
    assert first is not None and second is not None and second is not first
    assert second.steps == 100
    # The second run applied the first run's choice (the same workload), then restored.
    assert second.power_limit_w == first.power_limit_w is not None


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_other_stages_around_fits_change_nothing(stage: str, tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    callback = EnergyCallback(energy_config(tmp_path))
    trainer = quiet_trainer(ns, callback, tmp_path, steps=60)
    model = module_class(ns)()
    model.test_step = model.validation_step
    model.predict_step = lambda batch, batch_idx: model.net(batch[0])
    getattr(trainer, stage)(model, make_loader(n=32))
    assert callback.controller is None  # no GPU opened, nothing changed

    trainer.fit(model, make_loader())
    fitted = callback.summary
    assert fitted is not None and fitted.steps == 60
    decisions = len(_controller(callback).decisions)
    getattr(trainer, stage)(model, make_loader(n=32))
    assert callback.summary is fitted
    assert len(_controller(callback).decisions) == decisions
    assert _gpu(callback).power_limit_w() == 300.0

    trainer.fit_loop.epoch_loop.max_steps = 90  # and a fit after it is a run of its own
    trainer.fit(model, make_loader())
    assert callback.summary is not fitted
    assert callback.summary is not None and callback.summary.steps == 30
    assert _gpu(callback).power_limit_w() == 300.0


def test_fabric_callback_runs_two_loops(tmp_path: Path) -> None:
    import torch
    from lightning.fabric import Fabric

    from lightning_energy.integrations.fabric import EnergyFabricCallback

    energy = EnergyFabricCallback(energy_config(tmp_path))
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[energy])
    fabric.launch()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)

    def loop(epochs: int) -> Any:
        energy.setup(fabric)
        try:
            for _ in range(epochs):
                for x, y in make_loader():
                    fabric.call("on_train_batch_start")
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    optimizer.zero_grad()
                    fabric.backward(loss)
                    optimizer.step()
                    fabric.call("on_train_batch_end")
        finally:
            summary = energy.teardown()
        assert energy.controller is not None
        assert energy.controller.devices.gpus[0].power_limit_w() == 300.0
        return summary

    first = loop(5)
    assert first is not None and first.steps == 160 and first.power_limit_w is not None
    second = loop(1)
    assert second is not None and second is not first
    assert second.steps == 32
    assert second.power_limit_w == first.power_limit_w
