"""What ``EnergyTrainerCallback`` may change in a Transformers ``Trainer``, and what it never does.

It may add ``energy/*`` (and ``carbon/*``) values to the training logs (what the console and
the callbacks after it receive every ``logging_steps``) and to their ``log_history``
entries, and, while a run is open, its own state to each checkpoint's
``trainer_state.json``. It never changes training, what ``train()``, ``evaluate()`` and
``predict()`` return (so ``hyperparameter_search``'s default objective is unchanged), or the
exceptions training raises; ``auto_find_batch_size`` retrying with a smaller batch is told
as what it is. Real Trainers on CPU, a simulated A40.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import default_compute_objective

from lightning_energy.integrations.transformers import EnergyTrainerCallback
from tests.lightning_energy.integrations._hf import PRE_JOB_W, hf_config, hf_trainer

pytestmark = pytest.mark.usefixtures("hf_isolated")


class _LogRecorder(TrainerCallback):
    """What a callback placed after the energy callback receives in ``on_log``."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs or {}))


class _Pickling(TrainerCallback):
    """Pickles the energy callback at the end of every step (while its run is open)."""

    def __init__(self, energy: EnergyTrainerCallback) -> None:
        self.energy = energy
        self.copies: list[EnergyTrainerCallback] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.copies.append(pickle.loads(pickle.dumps(self.energy)))


def _energy_keys(values: dict[str, Any]) -> set[str]:
    return {k for k in values if k.startswith(("energy/", "carbon/"))}


def _outcome(example: ModuleType, tmp_path: Path, callback: Any) -> dict[str, Any]:
    """Train (evaluating on the way), evaluate and predict one seeded model."""
    torch.manual_seed(0)
    trainer = hf_trainer(
        example, tmp_path, callback, max_steps=12, eval_strategy="steps", eval_steps=6
    )
    train = trainer.train()
    evaluated = trainer.evaluate()
    predicted = trainer.predict(example.SyntheticRegression(size=16))
    return {
        "global_step": train.global_step,
        "training_loss": train.training_loss,
        "train_metrics": sorted(train.metrics),
        "evaluate": sorted(evaluated),
        "eval_loss": evaluated["eval_loss"],
        "objective": default_compute_objective(evaluated),
        "predictions": predicted.predictions.tolist(),
        "predict_metrics": sorted(predicted.metrics or {}),
        "weights": [p.detach().clone() for p in trainer.model.parameters()],
    }


def test_training_and_what_train_evaluate_and_predict_return_are_unchanged(
    example: ModuleType, tmp_path: Path
) -> None:
    from tests.lightning_energy.integrations._hf import reset_accelerate

    without = _outcome(example, tmp_path, None)
    reset_accelerate()
    callback = EnergyTrainerCallback(hf_config())
    with_energy = _outcome(example, tmp_path, callback)
    weights = with_energy.pop("weights")
    assert all(torch.equal(a, b) for a, b in zip(weights, without.pop("weights"), strict=True))
    assert with_energy == without
    assert with_energy["objective"] == with_energy["eval_loss"]
    assert callback.summary is not None and callback.summary.steps == 12


def test_energy_values_go_to_the_training_logs_and_their_history_only(
    example: ModuleType, tmp_path: Path
) -> None:
    recorder = _LogRecorder()
    trainer = hf_trainer(
        example, tmp_path, EnergyTrainerCallback(hf_config()), max_steps=12, eval_strategy="steps"
    )
    trainer.add_callback(recorder)  # after the energy callback
    trainer.train()
    trainer.evaluate()
    training_logs = [logs for logs in recorder.logs if "loss" in logs]
    assert [bool(_energy_keys(logs)) for logs in training_logs] == [True, True]
    assert not any(_energy_keys(logs) for logs in recorder.logs if "loss" not in logs)
    history = trainer.state.log_history
    assert [bool(_energy_keys(entry)) for entry in history] == ["loss" in e for e in history]


def test_a_checkpoint_holds_the_energy_up_to_its_own_step(
    example: ModuleType, tmp_path: Path
) -> None:
    # A checkpoint at step 7 falls between two refreshes of the logged values (every 5).
    callback = EnergyTrainerCallback(hf_config())
    trainer = hf_trainer(
        example, tmp_path, callback, max_steps=7, save_strategy="steps", save_steps=7
    )
    trainer.train()
    state = json.loads((tmp_path / "out" / "checkpoint-7" / "trainer_state.json").read_text())
    saved = state["stateful_callbacks"]["EnergyTrainerCallback"]["attributes"]["energy_state"]
    assert callback.summary is not None and callback.summary.steps == saved["steps"] == 7
    assert saved["energy_j"] == pytest.approx(callback.summary.energy_j, rel=1e-9)


def test_a_smaller_batch_retried_after_running_out_of_memory_is_no_failure(
    example: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    callback = EnergyTrainerCallback(hf_config())
    trainer = hf_trainer(
        example, tmp_path, callback, per_device_train_batch_size=6, auto_find_batch_size=True
    )
    model = trainer.model
    forward = model.forward
    batch_sizes: list[int] = []

    def forward_fitting_four(x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        batch_sizes.append(len(x))
        if len(x) > 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(x, labels)

    monkeypatch.setattr(model, "forward", forward_fitting_four)
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        trainer.train()
    assert sorted(set(batch_sizes), reverse=True) == [6, 5, 4]
    ours = [r for r in caplog.records if r.name.startswith("lightning_energy")]
    assert not [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
    retries = [r.getMessage() for r in ours if "smaller batch" in r.getMessage()]
    assert len(retries) == 2 and "out of memory" in retries[0]
    assert callback.summary is not None and callback.summary.steps == 10
    assert callback.controller is not None
    assert callback.controller.devices.gpus[0].power_limit_w() == PRE_JOB_W


def test_an_exception_in_training_reaches_the_caller_as_it_was_raised(
    example: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = EnergyTrainerCallback(hf_config())
    trainer = hf_trainer(example, tmp_path, callback)
    error = KeyError("raised by forward")

    def failing_forward(x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        raise error

    monkeypatch.setattr(trainer.model, "forward", failing_forward)
    with pytest.raises(KeyError) as raised, callback:
        trainer.train()
    assert raised.value is error
    assert callback.summary is not None and not callback.running


def test_the_callback_pickles_before_during_and_after_training(
    example: ModuleType, tmp_path: Path
) -> None:
    callback = EnergyTrainerCallback(hf_config())
    before = pickle.loads(pickle.dumps(callback))
    pickling = _Pickling(callback)
    trainer = hf_trainer(example, tmp_path, callback, max_steps=3)
    trainer.add_callback(pickling)
    trainer.train()
    copies = [before, *pickling.copies, pickle.loads(pickle.dumps(callback))]
    assert len(copies) == 5
    for copy in copies:  # the configuration travels; the run, its GPUs and lease stay here
        assert copy.config == callback.config
        assert copy.controller is None and not copy.running
    assert copies[-1].summary == callback.summary is not None
