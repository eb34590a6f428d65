"""EnergyTrainerCallback on a real Transformers Trainer run on CPU with a simulated GPU."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from transformers import Trainer, TrainerCallback

from lightning_energy.config import CONFIG_ENV_VAR
from lightning_energy.controller import EnergyController, Event, Interruption, StepResult
from lightning_energy.device import SimulatedSpec, TraceModel
from lightning_energy.errors import ConfigError
from lightning_energy.integrations.transformers import EnergyTrainerCallback
from tests.lightning_energy.integrations._hf import (
    CANDIDATES_W,
    EXAMPLE,
    PRE_JOB_W,
    hf_config,
    hf_trainer,
    reset_accelerate,
)

pytestmark = pytest.mark.usefixtures("hf_isolated")


def _run_example(
    example: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *args: str,
) -> dict[str, Any]:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *args])
    example.main()
    reset_accelerate()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith('{"')]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@pytest.mark.slow
def test_example_logs_energy_keys_and_resumes_from_its_checkpoint(
    example: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = str(tmp_path / "run")
    first = _run_example(example, monkeypatch, capsys, "--output-dir", out, "--max-steps", "150")
    assert first["steps"] == 150
    assert first["power_limit_w"] < PRE_JOB_W
    assert first["decisions"][-1].startswith("profile complete")
    assert {"energy/step_j", "energy/power_limit_w", "energy/total_j"} <= set(first["logged_keys"])
    # The profile is in the checkpoint, in the Trainer's own trainer_state.json.
    trainer_state = json.loads((Path(out) / "checkpoint-150" / "trainer_state.json").read_text())
    saved = trainer_state["stateful_callbacks"]["EnergyTrainerCallback"]["attributes"]
    assert saved["energy_state"]["steps"] == 150
    assert any(
        entry.get("energy/power_limit_w") == first["power_limit_w"]
        for entry in trainer_state["log_history"]
    )

    second = _run_example(
        example, monkeypatch, capsys, "--output-dir", out, "--max-steps", "170", "--resume"
    )
    assert second["decisions"] == ["resumed from checkpoint"]
    assert second["power_limit_w"] == first["power_limit_w"]
    assert (second["resumed_at_step"], second["steps"]) == (150, 20)


def test_steps_are_optimizer_steps_under_gradient_accumulation(
    example: ModuleType, tmp_path: Path
) -> None:
    callback = EnergyTrainerCallback(hf_config(), report=str(tmp_path / "report.json"))
    trainer = hf_trainer(example, tmp_path, callback, max_steps=5, gradient_accumulation_steps=3)
    trainer.train()
    assert json.loads((tmp_path / "report.json").read_text())
    assert callback.controller is not None and callback.controller.steps == 5
    assert trainer.state.global_step == 5
    assert callback.summary is not None
    assert callback.controller.devices.gpus[0].power_limit_w() == PRE_JOB_W


def test_carbon_section_adds_carbon_keys_to_the_logs(example: ModuleType, tmp_path: Path) -> None:
    config = {**hf_config(), "carbon": {"provider": "trace", "region": "DE"}}
    config["device"]["start"] = "2023-06-01T00:00:00"  # a pinned day of the replayed trace
    callback = EnergyTrainerCallback(config)
    trainer = hf_trainer(example, tmp_path, callback, max_steps=12)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [5, 10]
    for entry in logged:
        assert entry["carbon/intensity_g_per_kwh"] > 0
        assert entry["carbon/emissions_g"] > 0
    assert callback.summary is not None and callback.summary.carbon is not None
    assert callback.summary.carbon["emissions_g"] >= logged[-1]["carbon/emissions_g"]


@pytest.mark.slow
def test_evaluation_interrupts_profiling_which_still_completes(
    example: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reasons: list[str] = []
    original = EnergyController.handle

    def spy(self: EnergyController, event: Event) -> StepResult:
        if isinstance(event, Interruption):
            reasons.append(event.reason)
        return original(self, event)

    monkeypatch.setattr(EnergyController, "handle", spy)
    config = hf_config(selector="energy")
    config["device"]["noise_std"] = 0.0
    callback = EnergyTrainerCallback(config)

    class BusyEvaluation(TrainerCallback):
        """Evaluation keeps the simulated GPU as busy as training does."""

        def on_prediction_step(self, *args: Any, **kwargs: Any) -> None:
            assert callback.controller is not None
            run_step = callback.controller.devices.run_step
            assert run_step is not None
            run_step()

    trainer = hf_trainer(
        example, tmp_path, callback, max_steps=90, eval_strategy="steps", eval_steps=7
    )
    trainer.add_callback(BusyEvaluation())
    trainer.train()
    assert "evaluation" in reasons
    controller = callback.controller
    assert controller is not None and controller.profile_done
    # The evaluation, which runs after the step's end but before ``on_evaluate``, is in
    # no window: every limit's step time is the workload's own.
    _assert_profile_is_the_workloads(controller.profile())


@pytest.mark.slow
def test_checkpoints_written_during_profiling_are_left_out_of_every_window(
    example: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Trainer writes the model before it asks the callbacks for their state: the
    window pauses at the step's end, when the Trainer has decided to save."""
    config = hf_config(selector="energy")
    config["device"]["noise_std"] = 0.0
    callback = EnergyTrainerCallback(config)
    trainer = hf_trainer(
        example, tmp_path, callback, max_steps=90, save_strategy="steps", save_steps=4
    )
    save_model = trainer.save_model

    def slow_save_model(*args: Any, **kwargs: Any) -> None:
        assert callback.controller is not None
        callback.controller.devices.gpus[0].idle(60.0)  # a large model to disk
        save_model(*args, **kwargs)

    monkeypatch.setattr(trainer, "save_model", slow_save_model)
    trainer.train()
    controller = callback.controller
    assert controller is not None and controller.profile_done
    _assert_profile_is_the_workloads(controller.profile())


def _assert_profile_is_the_workloads(profile: list[dict[str, float]]) -> None:
    """Every candidate measured at the noiseless A40 trace's own step time."""
    model = SimulatedSpec(gpu="a40", steps_per_epoch=100).model()
    assert isinstance(model, TraceModel)
    assert sorted(m["power_limit_w"] for m in profile) == sorted(CANDIDATES_W)
    for m in profile:
        true_s = model.workload.time_per_epoch_s(m["power_limit_w"]) / model.steps_per_epoch
        assert m["time_per_step_s"] == pytest.approx(true_s, rel=0.01), m


def _fail_once_the_limit_is_lowered(
    trainer: Trainer, callback: EnergyTrainerCallback, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Any]:
    """Make the model raise as soon as the controller has lowered the power limit.

    Returns:
        The model's own ``forward``, to put back.
    """
    model = trainer.model
    assert model is not None
    forward = model.forward

    def failing_forward(x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        assert callback.controller is not None
        if callback.controller.current_power_limit_w() not in (None, PRE_JOB_W):
            raise RuntimeError("boom")
        return forward(x, labels)

    monkeypatch.setattr(model, "forward", failing_forward)
    return forward


def test_exception_during_training_restores_with_the_context_manager(
    example: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = EnergyTrainerCallback(hf_config())
    trainer = hf_trainer(example, tmp_path, callback, max_steps=40)
    _fail_once_the_limit_is_lowered(trainer, callback, monkeypatch)
    with pytest.raises(RuntimeError, match="boom"), callback:
        trainer.train()
    assert callback.summary is not None
    assert callback.controller is not None
    assert callback.controller.devices.gpus[0].power_limit_w() == PRE_JOB_W


def test_exception_in_the_with_block_writes_the_report_without_a_collective(
    example: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "report.json"
    callback = EnergyTrainerCallback({**hf_config(), "report": str(report)})
    trainer = hf_trainer(example, tmp_path, callback, max_steps=40)
    _fail_once_the_limit_is_lowered(trainer, callback, monkeypatch)
    with pytest.raises(RuntimeError, match="boom"), callback:
        trainer.train()
    controller = callback.controller
    assert controller is not None and not callback.running
    assert controller.devices.gpus[0].power_limit_w() == PRE_JOB_W
    written = json.loads(report.read_text())
    assert written["summary"]["steps"] == controller.steps > 0
    assert "job" not in written  # no collective on an exception path: another rank may be gone


def test_train_again_after_a_failure_outside_with_restores_the_first_run(
    example: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = EnergyTrainerCallback(hf_config())
    trainer = hf_trainer(example, tmp_path, callback, max_steps=40)
    forward = _fail_once_the_limit_is_lowered(trainer, callback, monkeypatch)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    first = callback.controller
    assert first is not None and callback.summary is None
    assert first.devices.gpus[0].power_limit_w() < PRE_JOB_W  # not restored yet

    monkeypatch.setattr(trainer.model, "forward", forward)
    trainer.train()
    assert first.devices.gpus[0].power_limit_w() == PRE_JOB_W
    assert callback.controller is not first and callback.summary is not None


@pytest.mark.slow
def test_restoring_callback_states_rebuilds_the_callback_with_its_profile(
    example: ModuleType, tmp_path: Path
) -> None:
    first = EnergyTrainerCallback(hf_config())
    hf_trainer(example, tmp_path, first, max_steps=60, save_strategy="steps", save_steps=60).train()
    assert first.summary is not None
    reset_accelerate()

    second = EnergyTrainerCallback(hf_config(selector="time"))
    trainer = hf_trainer(
        example,
        tmp_path,
        second,
        max_steps=70,
        restore_callback_states_from_checkpoint=True,
    )
    trainer.train(resume_from_checkpoint=True)
    # The Trainer replaced the callback by one rebuilt from the checkpoint's arguments.
    (rebuilt,) = [
        c for c in trainer.callback_handler.callbacks if isinstance(c, EnergyTrainerCallback)
    ]
    assert rebuilt is not second
    assert rebuilt.config.power_limit.selector == first.config.power_limit.selector
    assert rebuilt.controller is not None and rebuilt.summary is not None
    assert [d["reason"] for d in rebuilt.controller.decisions] == ["resumed from checkpoint"]
    assert rebuilt.summary.power_limit_w == first.summary.power_limit_w


def test_invalid_configuration_fails_when_the_callback_is_built() -> None:
    with pytest.raises(ConfigError) as info:
        EnergyTrainerCallback(power_limit={"selector": "fastest", "warmup_steps": -1})
    assert "selector" in str(info.value) and "warmup_steps" in str(info.value)


def test_missing_file_named_by_env_var_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nowhere.yaml"
    monkeypatch.setenv(CONFIG_ENV_VAR, str(missing))
    with pytest.raises(ConfigError, match="cannot read the file") as info:
        EnergyTrainerCallback()
    assert str(missing) in str(info.value)
