"""The Accelerate contract: ``attach_energy(accelerator)`` changes the energy a training
takes, and nothing else a script can see (docs/accelerate.md, "The contract").

It may add: ``energy/*`` and ``carbon/*`` values logged to the trackers that take them, and,
when active, one file (``lightning_energy.json``) in each checkpoint ``save_state`` writes.

It never changes: what Accelerate and the training loop return, the trackers (one that
refuses our values is left out, never broken), pickling, when objects are freed, the
checkpoints Accelerate reads and writes, its teardown (``end_training``), the exceptions a
script sees; and every GPU is put back however the script ends.
"""

from __future__ import annotations

import csv
import gc
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import weakref
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from accelerate import Accelerator, debug_launcher
from accelerate.tracking import GeneralTracker
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.utils.data import DataLoader

from lightning_energy.config import CONFIG_ENV_VAR
from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.integrations.accelerate import (
    CHECKPOINT_FILE,
    AcceleratorEnergy,
    EnergyTracker,
    attach_energy,
)
from tests.lightning_energy.integrations._accelerate import (
    PRE_JOB_W,
    energy_config,
    fresh_accelerate_state,  # noqa: F401 - the autouse fixture
    gpu_limit_w,
    reset_accelerate_state,
    train,
    train_until_the_limit_changes,
    training_parts,
)

ROOT = Path(__file__).resolve().parents[3]
LOGGER = "lightning_energy.integrations.accelerate"


class CsvTracker(GeneralTracker):
    """A tracker with a fixed schema, as Accelerate's own test tracker: ``csv.DictWriter``
    rejects any key it was not built with."""

    name = "csv"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.finished = False
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None

    def start(self) -> None:
        self._file = self.path.open("w", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=["loss"])
        self._writer.writeheader()

    @property
    def tracker(self) -> csv.DictWriter[str] | None:
        return self._writer

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        assert self._writer is not None
        self._writer.writerow(values)

    def finish(self) -> None:
        assert self._file is not None
        self._file.close()
        self.finished = True

    def rows(self) -> list[dict[str, str]]:
        with self.path.open(encoding="utf-8") as f:
            return list(csv.DictReader(f))


def lease_files(tmp_path: Path) -> list[str]:
    leases = tmp_path / "leases"
    return sorted(p.name for p in leases.glob("*.json")) if leases.exists() else []


def with_state_files(config: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The configuration with the simulated GPUs' settings kept in files, as a driver keeps
    them, so this process reads what another process left."""
    config["device"]["state_dir"] = str(tmp_path / "gpus")
    return config


def persisted_limits_w(tmp_path: Path, count: int) -> list[float]:
    spec = SimulatedSpec(gpu="a40", count=count, state_dir=str(tmp_path / "gpus"))
    return [gpu.power_limit_w() for gpu in simulated_gpus(spec)]


# ------------------------------------------------------------------ returned values
def test_training_returns_and_learns_the_same_with_and_without_us(tmp_path: Path) -> None:
    def run(attached: bool) -> tuple[list[type], list[Any], dict[str, torch.Tensor]]:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        if attached:
            attach_energy(accelerator, energy_config(tmp_path))
        prepared = accelerator.prepare(*training_parts(micro_batches=40))
        model, optimizer, loader = prepared
        returned = []
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                returned.append(optimizer.step())
                optimizer.zero_grad()
        accelerator.end_training()
        reset_accelerate_state()
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        return [type(p) for p in prepared], returned, weights

    types, returned, weights = run(attached=False)
    attached_types, attached_returned, attached_weights = run(attached=True)
    assert (attached_types, attached_returned) == (types, returned)
    assert all(torch.equal(attached_weights[k], v) for k, v in weights.items())


# ------------------------------------------------------------------ trackers
def test_a_tracker_refusing_our_values_is_warned_about_once_and_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    refusing, energy_tracker = CsvTracker(tmp_path / "log.csv"), EnergyTracker()
    accelerator = Accelerator(cpu=True, log_with=[refusing, energy_tracker])
    accelerator.init_trackers("test")
    attach_energy(accelerator, energy_config(tmp_path))
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=12))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": loss.item()})
        accelerator.end_training()
    assert refusing.finished  # Accelerate's own teardown ran
    assert [list(row) for row in refusing.rows()] == [["loss"]] * 12  # the script's rows only
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "csv" in warnings[0]
    # A tracker that takes the values still gets every one, the summary included.
    assert [r["step"] for r in energy_tracker.history][-1] == 12
    assert "energy/summary/energy_j" in energy_tracker.history[-1]


def test_a_run_without_steps_logs_nothing(tmp_path: Path) -> None:
    refusing, energy_tracker = CsvTracker(tmp_path / "log.csv"), EnergyTracker()
    accelerator = Accelerator(cpu=True, log_with=[refusing, energy_tracker])
    accelerator.init_trackers("test")
    energy = attach_energy(accelerator, energy_config(tmp_path))
    accelerator.end_training()
    assert energy.summary is not None and energy.summary.steps == 0
    assert energy_tracker.history == [] and refusing.rows() == []
    assert refusing.finished


# ------------------------------------------------------------------ pickling
@pytest.mark.parametrize("when", ["training", "after_end_training"])
def test_an_attached_accelerator_pickles_as_without_us(tmp_path: Path, when: str) -> None:
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator, energy_config(tmp_path))
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=40))
    train(accelerator, model, optimizer, loader)
    if when == "after_end_training":
        accelerator.end_training()
    limit_w = gpu_limit_w(energy)

    copy = pickle.loads(pickle.dumps(accelerator))

    assert len(copy._optimizers) == len(copy._models) == 1
    assert copy._custom_objects == []
    # The copy is a plain Accelerator: it owns no GPU, saves no energy state.
    copy.save_state(str(tmp_path / "copy"))
    assert CHECKPOINT_FILE not in os.listdir(tmp_path / "copy")
    copy.load_state(str(tmp_path / "copy"))
    copy.end_training()
    assert gpu_limit_w(energy) == limit_w
    assert energy.running == (when == "training")
    accelerator.end_training()


# ------------------------------------------------------------------ object lifetimes
def test_deleting_the_accelerator_frees_it_and_puts_the_gpu_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hooks_before = (
        dict(torch_optimizer._global_optimizer_pre_hooks),
        dict(torch_optimizer._global_optimizer_post_hooks),
    )
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator, energy_config(tmp_path))
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=40))
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if gpu_limit_w(energy) < PRE_JOB_W:
            break
    # No process-wide hook: other optimizers of the process never call into us.
    assert (
        dict(torch_optimizer._global_optimizer_pre_hooks),
        dict(torch_optimizer._global_optimizer_post_hooks),
    ) == hooks_before
    freed = [weakref.ref(o) for o in (accelerator, model, optimizer, optimizer.optimizer)]

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        del accelerator, model, optimizer, loader
        gc.collect()

    assert [ref() for ref in freed] == [None] * len(freed)
    assert not energy.running and gpu_limit_w(energy) == PRE_JOB_W
    assert lease_files(tmp_path) == []
    assert "accelerator.end_training()" in caplog.text
    attachment = weakref.ref(energy)
    del energy
    gc.collect()
    assert attachment() is None


@pytest.mark.parametrize("foreign", ["never_prepared", "another_accelerators"])
def test_only_the_optimizers_this_accelerator_prepared_count(tmp_path: Path, foreign: str) -> None:
    accelerator = Accelerator(cpu=True)
    stranger_model = nn.Linear(8, 1)
    stranger = torch.optim.SGD(stranger_model.parameters(), lr=0.01)
    if foreign == "another_accelerators":
        stranger_model, stranger = Accelerator(cpu=True).prepare(stranger_model, stranger)
    with attach_energy(accelerator, energy_config(tmp_path)) as energy:
        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=6))
        for x, y in loader:
            stranger_model(x).sum().backward()
            stranger.step()  # steps first in every iteration
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
        stranger.step()
        assert energy.controller is not None and energy.controller.steps == 6


def test_free_memory_between_two_trainings_counts_the_second_as_a_new_workload(
    tmp_path: Path,
) -> None:
    accelerator = Accelerator(cpu=True)
    with attach_energy(accelerator, energy_config(tmp_path)) as energy:
        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=5))
        train(accelerator, model, optimizer, loader)
        first_optimizer = weakref.ref(optimizer.optimizer)
        first_workload = energy.state_dict()["workload"]
        model, optimizer, loader = accelerator.free_memory(model, optimizer, loader)
        assert first_optimizer() is None

        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=5, width=2))
        train(accelerator, model, optimizer, loader)

        assert energy.controller is not None and energy.controller.steps == 10
        state = energy.state_dict()
        assert state["workload"] != first_workload
        assert set(state["optimizers"]) == {first_workload, state["workload"]}


def test_the_same_optimizer_prepared_again_after_free_memory_starts_a_new_training(
    tmp_path: Path,
) -> None:
    """``free_memory()`` without arguments, the user keeping the model and optimizer, then
    ``prepare`` again with another loader: Accelerate wraps the same optimizer again."""
    accelerator = Accelerator(cpu=True)
    with attach_energy(accelerator, energy_config(tmp_path)) as energy:
        raw_model, raw_optimizer, loader = training_parts(micro_batches=5)
        train(accelerator, *accelerator.prepare(raw_model, raw_optimizer, loader))
        first_workload = energy.state_dict()["workload"]
        accelerator.free_memory()

        wider = DataLoader(loader.dataset, batch_size=8)
        train(accelerator, *accelerator.prepare(raw_model, raw_optimizer, wider))

        assert energy.controller is not None and energy.controller.steps == 8
        state = energy.state_dict()
        assert state["workload"] != first_workload
        assert set(state["optimizers"]) == {first_workload, state["workload"]}


# ------------------------------------------------------------------ checkpoints
def test_an_active_attachment_adds_one_file_to_a_checkpoint(tmp_path: Path) -> None:
    written = {}
    for attached in (False, True):
        accelerator = Accelerator(cpu=True)
        if attached:
            attach_energy(accelerator, energy_config(tmp_path))
        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=10))
        train(accelerator, model, optimizer, loader)
        accelerator.save_state(str(tmp_path / str(attached)))
        written[attached] = set(os.listdir(tmp_path / str(attached)))
        accelerator.end_training()
        reset_accelerate_state()
    assert written[True] - written[False] == {CHECKPOINT_FILE}
    assert written[False] <= written[True]


def test_an_inactive_attachment_leaves_the_accelerator_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    accelerator = Accelerator(cpu=True)
    before = dict(vars(accelerator))
    energy = attach_energy(accelerator)
    assert not energy.active
    assert vars(accelerator) == before
    assert accelerator._custom_objects == []
    assert not accelerator._save_model_state_pre_hook and not accelerator._load_model_state_pre_hook


@pytest.mark.parametrize("loaded_by", ["plain", "inactive", "active"])
@pytest.mark.parametrize("saved_by", ["plain", "inactive", "active"])
def test_checkpoints_load_whoever_wrote_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_by: str, loaded_by: str
) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)

    def start(who: str, micro_batches: int) -> tuple[Accelerator, AcceleratorEnergy | None, Any]:
        accelerator = Accelerator(cpu=True)
        energy = None
        if who != "plain":
            energy = attach_energy(
                accelerator, energy_config(tmp_path) if who == "active" else None
            )
        return accelerator, energy, accelerator.prepare(*training_parts(micro_batches))

    accelerator, energy, (model, optimizer, loader) = start(saved_by, micro_batches=60)
    train(accelerator, model, optimizer, loader)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.save_state(str(tmp_path / "checkpoint"))
    accelerator.end_training()
    reset_accelerate_state()

    accelerator, energy, (model, optimizer, loader) = start(loaded_by, micro_batches=10)
    accelerator.load_state(str(tmp_path / "checkpoint"))

    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved_weights.items())
    if loaded_by == "active":
        assert energy is not None and energy.controller is not None
        resumed = [d["reason"] for d in energy.controller.decisions]
        assert resumed == (["resumed from checkpoint"] if saved_by == "active" else [])
    accelerator.end_training()


# ------------------------------------------------------------------ teardown
def test_end_training_runs_accelerates_teardown_when_our_part_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = CsvTracker(tmp_path / "log.csv")
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("test")
    unwritable = tmp_path / "report"
    unwritable.mkdir()  # a folder: the run report cannot be written there
    energy = attach_energy(accelerator, {**energy_config(tmp_path), "report": str(unwritable)})
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=10))
    train(accelerator, model, optimizer, loader)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        accelerator.end_training()
    assert tracker.finished
    assert gpu_limit_w(energy) == PRE_JOB_W
    assert str(unwritable) in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_launched_workers_put_the_gpus_back_when_the_function_ends(
    tmp_path: Path, fail: bool
) -> None:
    config = with_state_files(energy_config(tmp_path), tmp_path)
    args = (config, str(tmp_path), fail)
    if fail:
        with pytest.raises(Exception, match="boom"):
            debug_launcher(train_until_the_limit_changes, args=args, num_processes=2)
    else:
        debug_launcher(train_until_the_limit_changes, args=args, num_processes=2)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(s["power_limit_w"] < PRE_JOB_W for s in seen)  # changed while training
    assert persisted_limits_w(tmp_path, count=2) == [PRE_JOB_W, PRE_JOB_W]
    assert lease_files(tmp_path) == []


@pytest.mark.slow
def test_interpreter_exit_puts_the_gpu_back_and_names_what_to_write(tmp_path: Path) -> None:
    config = with_state_files(energy_config(tmp_path), tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(CONFIG_ENV_VAR, None)
    script = "tests.lightning_energy.integrations._accelerate"
    result = subprocess.run(
        [sys.executable, "-m", script, json.dumps(config), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "rank0.json").read_text())["power_limit_w"] < PRE_JOB_W
    assert persisted_limits_w(tmp_path, count=1) == [PRE_JOB_W]
    assert lease_files(tmp_path) == []
    assert "at interpreter exit" in result.stderr
    assert "attach_energy(accelerator)" in result.stderr
    assert "accelerator.end_training()" in result.stderr
    assert "GPUGuard" not in result.stderr


def test_attachments_ended_in_creation_order_put_the_signal_handlers_back(
    tmp_path: Path,
) -> None:
    signals = (signal.SIGINT, signal.SIGTERM)
    before = [signal.getsignal(s) for s in signals]
    accelerators = [Accelerator(cpu=True), Accelerator(cpu=True)]
    for i, accelerator in enumerate(accelerators):
        attach_energy(accelerator, energy_config(tmp_path / str(i)))  # a GPU lease each
    assert [signal.getsignal(s) for s in signals] != before
    for accelerator in accelerators:
        accelerator.end_training()
    assert [signal.getsignal(s) for s in signals] == before


# ------------------------------------------------------------------ exceptions
def test_exceptions_reach_the_script_unchanged(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=10))
    error = RuntimeError("boom")
    with pytest.raises(RuntimeError) as raised:  # noqa: SIM117 - the order is the point
        with attach_energy(accelerator, energy_config(tmp_path)):
            train(accelerator, model, optimizer, loader)
            raise error
    assert raised.value is error
    with pytest.raises(ValueError, match="does not exist"):  # Accelerate's own, as raised
        accelerator.load_state(str(tmp_path / "missing"))
