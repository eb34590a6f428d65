"""What the energy callback may change in a Lightning ``Trainer``, and what it never does.

It may add logged values (``energy/*`` and ``carbon/*`` in the loggers, the progress bar and
``trainer.callback_metrics``) and, while a run is open, its own entry in a checkpoint's
``callbacks``. It never changes what ``fit``, ``validate`` and ``test`` compute or return,
the callbacks lists (the user's own list, one energy callback per ``Trainer``, checkpoint
callbacks last), ``fast_dev_run``, pickling, checkpoints besides its entry, or the
exceptions training raises. Both namespaces (``lightning.pytorch``, ``pytorch_lightning``),
real Trainers on CPU, a simulated A40.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_energy.config import CONFIG_ENV_VAR
from tests.lightning_energy.integrations._models import (
    energy_config,
    lightning_namespace,
    make_loader,
    module_class,
    quiet_trainer,
)


@pytest.fixture(params=["lightning.pytorch", "pytorch_lightning"])
def namespace(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """A Lightning namespace and its integration module."""
    return lightning_namespace(request.param)


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A configuration file for the entry point (``LIGHTNING_ENERGY_CONFIG`` left unset)."""
    path = tmp_path / "energy.yaml"
    path.write_text(yaml.safe_dump(energy_config(tmp_path)))
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    return path


def _user_callback(ns: Any) -> Any:
    class UserCallback(ns.Callback):
        """A callback of the user's own."""

    return UserCallback()


def _types(callbacks: list[Any]) -> list[str]:
    return [type(c).__name__ for c in callbacks]


def _energy_callbacks(trainer: Any, integ: Any) -> list[Any]:
    return [c for c in trainer.callbacks if isinstance(c, integ.EnergyCallback)]


# ---------------------------------------------------------------------- callbacks lists
def test_one_config_builds_many_trainers_each_with_one_energy_callback(
    namespace: tuple[Any, Any], config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, integ = namespace
    plain: dict[str, Any] = {
        "callbacks": [_user_callback(ns)],
        "logger": False,
        "enable_model_summary": False,
    }
    ns.Trainer(**plain)  # what Lightning alone leaves in the user's list
    monkeypatch.setenv(CONFIG_ENV_VAR, str(config_file))
    config: dict[str, Any] = {
        "callbacks": [_user_callback(ns)],
        "logger": False,
        "enable_model_summary": False,
    }
    trainers = [ns.Trainer(**config) for _ in range(3)]
    energy = [_energy_callbacks(t, integ) for t in trainers]
    assert [len(found) for found in energy] == [1, 1, 1]
    assert len({id(found[0]) for found in energy}) == 3  # each Trainer has its own
    assert _types(config["callbacks"]) == _types(plain["callbacks"])


def test_a_users_own_energy_callback_wins_over_the_entry_point(
    namespace: tuple[Any, Any], tmp_path: Path, config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns, integ = namespace
    monkeypatch.setenv(CONFIG_ENV_VAR, str(config_file))
    for selector in ("energy", "time"):  # the entry point's state key, or another one
        config = energy_config(tmp_path)
        config["power_limit"]["selector"] = selector
        mine = integ.EnergyCallback(config)
        trainer = ns.Trainer(callbacks=[mine], logger=False)
        assert _energy_callbacks(trainer, integ) == [mine]


def test_the_energy_strategy_leaves_the_users_list_and_checkpoints_last(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    ns, integ = namespace
    strategy = integ.EnergySingleDeviceStrategy(
        device=torch.device("cpu"), energy=energy_config(tmp_path)
    )
    summaries = []
    for _ in range(2):  # one strategy object, two Trainers in turn
        mine = [_user_callback(ns)]
        trainer = quiet_trainer(
            ns,
            mine[0],
            tmp_path,
            12,
            callbacks=mine,
            strategy=strategy,
            accelerator="auto",  # a strategy used before has its accelerator
            enable_checkpointing=True,
        )
        users_list = list(mine)  # as Lightning left it
        trainer.fit(module_class(ns)(), make_loader())
        assert mine == users_list
        assert _energy_callbacks(trainer, integ) == [strategy.energy_callback]
        assert isinstance(trainer.callbacks[-1], ns.callbacks.ModelCheckpoint)
        summaries.append(strategy.energy_callback.summary)
    assert summaries[0] is not None and summaries[1] is not None
    assert summaries[0] is not summaries[1]  # each fit is a run of its own


# ---------------------------------------------------------------------- logged values
def _recording_logger(ns: Any) -> Any:
    class Recording(ns.loggers.Logger):
        """Keeps every logged value."""

        def __init__(self) -> None:
            super().__init__()
            self.logged: dict[str, float] = {}

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.logged.update(metrics)

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return Recording()


def test_a_training_step_taking_the_dataloader_iterator_gets_energy_values_logged(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    ns, integ = namespace

    class IteratorModule(module_class(ns)):  # type: ignore[misc]
        def training_step(self, dataloader_iter: Any) -> torch.Tensor:
            (x, y), _, _ = next(dataloader_iter)
            return torch.nn.functional.cross_entropy(self.net(x), y)

    logger = _recording_logger(ns)
    callback = integ.EnergyCallback(energy_config(tmp_path))
    trainer = quiet_trainer(ns, callback, tmp_path, 12, logger=logger, log_every_n_steps=1)
    trainer.fit(IteratorModule(), make_loader())
    assert logger.logged["energy/total_j"] > 0
    assert "energy/total_j" in trainer.callback_metrics


def test_a_logger_refusing_the_energy_summary_leaves_the_fit_as_it_was(
    namespace: tuple[Any, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ns, integ = namespace

    class OnlyItsOwnKeys(_recording_logger(ns).__class__):  # type: ignore[misc]
        """Rejects a dictionary without its own key, as a logger with a schema does."""

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            if not any(key.startswith("loss") for key in metrics):
                raise ValueError(f"unexpected keys {sorted(metrics)}")
            super().log_metrics(metrics, step)

    class LoggingLoss(module_class(ns)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(batch, batch_idx)
            self.log("loss", loss)
            return loss

    logger = OnlyItsOwnKeys()
    callback = integ.EnergyCallback(energy_config(tmp_path))
    trainer = quiet_trainer(ns, callback, tmp_path, 12, logger=logger, log_every_n_steps=1)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        trainer.fit(LoggingLoss(), make_loader())
    assert trainer.global_step == 12 and callback.summary is not None and not callback.running
    assert "loss" in logger.logged
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "OnlyItsOwnKeys" in warning and "unexpected keys" in warning


# ---------------------------------------------------------------------- unchanged outcomes
def _outcome(ns: Any, callback: Any, tmp_path: Path, **trainer_kw: Any) -> dict[str, Any]:
    """Fit, validate and test one seeded model; what Lightning returns and keeps."""
    torch.manual_seed(0)
    model = module_class(ns)()
    trainer = quiet_trainer(ns, callback, tmp_path, 12, **trainer_kw)
    trainer.fit(model, make_loader(), make_loader(n=32))
    return {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "weights": [p.detach().clone() for p in model.parameters()],
        "validate": trainer.validate(model, make_loader(n=32), verbose=False),
    }


@pytest.mark.parametrize("trainer_kw", [{}, {"fast_dev_run": True}], ids=["fit", "fast_dev_run"])
def test_training_and_what_the_trainer_returns_are_unchanged(
    namespace: tuple[Any, Any], tmp_path: Path, trainer_kw: dict[str, Any]
) -> None:
    ns, integ = namespace
    without = _outcome(ns, _user_callback(ns), tmp_path, **trainer_kw)
    callback = integ.EnergyCallback(energy_config(tmp_path))
    with_energy = _outcome(ns, callback, tmp_path, **trainer_kw)
    weights = with_energy.pop("weights")
    assert all(torch.equal(a, b) for a, b in zip(weights, without.pop("weights"), strict=True))
    assert with_energy == without
    assert callback.summary is not None and not callback.running


def test_a_checkpoint_gains_only_the_energy_entry(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    ns, integ = namespace

    def checkpoint(callback: Any, name: str) -> dict[str, Any]:
        trainer = quiet_trainer(ns, callback, tmp_path, 12)
        trainer.fit(module_class(ns)(), make_loader())
        trainer.save_checkpoint(tmp_path / name)
        saved: dict[str, Any] = torch.load(tmp_path / name, weights_only=False)
        return saved

    plain = checkpoint(_user_callback(ns), "plain.ckpt")
    callback = integ.EnergyCallback(energy_config(tmp_path))
    energy = checkpoint(callback, "energy.ckpt")
    assert set(energy) == set(plain)
    assert set(energy["callbacks"]) - set(plain["callbacks"]) == {callback.state_key}


def test_an_exception_in_training_reaches_the_caller_as_it_was_raised(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    ns, integ = namespace
    error = KeyError("raised by training_step")

    class Failing(module_class(ns)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 7:
                raise error
            return super().training_step(batch, batch_idx)

    callback = integ.EnergyCallback(energy_config(tmp_path))
    with pytest.raises(KeyError) as raised:
        quiet_trainer(ns, callback, tmp_path, 12).fit(Failing(), make_loader())
    assert raised.value is error
    assert callback.summary is not None and not callback.running


def test_a_fit_whose_exception_skips_the_callback_leaves_no_run_open_for_the_next(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    """``Tuner.lr_find`` swaps the Trainer's callbacks for its own and raises with a model
    of two optimizers: neither ``on_exception`` nor ``teardown`` reaches the callback."""
    ns, integ = namespace

    class TwoOptimizers(module_class(ns)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.lr = 0.1

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(2)]

    skipped = integ.EnergyCallback(energy_config(tmp_path))
    trainer = quiet_trainer(ns, skipped, tmp_path, 12)
    with pytest.raises(ns.utilities.exceptions.MisconfigurationException, match="optimizer"):
        ns.tuner.Tuner(trainer).lr_find(TwoOptimizers(), make_loader())
    assert trainer.state.status == "interrupted"
    after = integ.EnergyCallback(energy_config(tmp_path))
    quiet_trainer(ns, after, tmp_path, 12).fit(module_class(ns)(), make_loader())
    assert not skipped.running and skipped.summary is not None
    assert after.summary is not None and not after.summary.observe_only


# ---------------------------------------------------------------------- pickling
def test_the_callback_pickles_before_during_and_after_a_fit(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    ns: Any
    ns, integ = namespace
    callback = integ.EnergyCallback(energy_config(tmp_path))
    copies = [pickle.loads(pickle.dumps(callback))]

    class Pickling(ns.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            copies.append(pickle.loads(pickle.dumps(callback)))

    trainer = quiet_trainer(ns, callback, tmp_path, 3, callbacks=[callback, Pickling()])
    trainer.fit(module_class(ns)(), make_loader())
    copies.append(pickle.loads(pickle.dumps(callback)))
    assert len(copies) == 5
    for copy in copies:  # the configuration travels; the run, its GPUs and lease stay here
        assert copy.config == callback.config
        assert copy.controller is None and not copy.running
