"""Energy optimisation for Hugging Face Accelerate training loops.

Accelerate has no callbacks and rejects unknown keys in its own config file, so the switch
is an environment variable naming our YAML file, which ``accelerate launch``, ``torchrun``
and Slurm pass to every process unchanged, plus one line in the script::

    from accelerate import Accelerator
    from lightning_energy.integrations.accelerate import attach_energy

    accelerator = Accelerator(gradient_accumulation_steps=4)
    energy = attach_energy(accelerator)      # reads $LIGHTNING_ENERGY_CONFIG; off when unset
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            ...                              # forward, accelerator.backward(loss)
            optimizer.step()                 # one energy step per real optimizer step
            optimizer.zero_grad()
    accelerator.end_training()               # restores every GPU, logs the summary

run as ``LIGHTNING_ENERGY_CONFIG=energy.yaml accelerate launch train.py``.

What :func:`attach_energy` wires up:

* steps: the optimizer's own step hooks. Under gradient accumulation Accelerate only calls
  the wrapped optimizer's ``step`` on synchronising micro-batches, so one energy step is
  one real optimizer step. It works whether called before or after ``prepare``.
* checkpoints: the returned object is registered with ``register_for_checkpointing``, so
  ``save_state``/``load_state`` carry the power-limit profile and choice (no profiling
  again after a restart).
* metrics: ``energy/*`` values go to every tracker of the Accelerator (``log_with``,
  including :class:`EnergyTracker`) and to this module's logger.
* ranks: they agree through Accelerate's own ``gather`` and ``broadcast_object_list``.
* restore: ``accelerator.end_training()``, :meth:`AcceleratorEnergy.close`, the ``with``
  block, SIGTERM/SIGINT and interpreter exit all put the pre-job settings back; an
  exception in the ``with`` block also writes the report (without a collective).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.tracking import GeneralTracker
from accelerate.utils import broadcast_object_list
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_energy.config import CONFIG_ENV_VAR, EnergyConfig, load_config
from lightning_energy.controller import (
    EnergyController,
    Interruption,
    RunSummary,
    StepEnd,
    StepResult,
    StepStart,
)
from lightning_energy.errors import ConfigError, EnergyError
from lightning_energy.integrations._common import (
    EnergyAdapter,
    build_config,
    summary_values,
    tensor_collective,
)

__all__ = ["AcceleratorEnergy", "EnergyTracker", "attach_energy"]

log = logging.getLogger(__name__)

ConfigLike = str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig


def attach_energy(
    accelerator: Accelerator,
    config: ConfigLike | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> AcceleratorEnergy:
    """Attach energy optimisation to ``accelerator`` (any ``Accelerator`` subclass too).

    Call it once per process, before training, after the ``Accelerator`` is built (before
    or after ``prepare``). The GPUs are opened and validated here, so a bad configuration
    fails before the first step.

    Args:
        accelerator: the job's ``Accelerator``.
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``. None reads
            the file named by ``LIGHTNING_ENERGY_CONFIG``; when that variable is unset or
            empty the returned object is inactive and nothing about training changes.
        optimizer: the optimizer whose steps count as training steps (prepared or not).
            None: the first optimizer that steps (with several optimizers, the one stepped
            first in an iteration).

    Returns:
        The attachment, registered for checkpointing; use it as a context manager or call
        :meth:`AcceleratorEnergy.close` (``accelerator.end_training()`` does too).

    Raises:
        ConfigError: the configuration (or the file ``LIGHTNING_ENERGY_CONFIG`` names) is
            missing or invalid, or candidate power limits are outside the GPU's range.
        EnergyError: energy optimisation is already attached to ``accelerator``; in strict
            mode, the GPUs cannot be controlled.

    Example:
        >>> accelerator = Accelerator(cpu=True)
        >>> energy = attach_energy(accelerator)  # LIGHTNING_ENERGY_CONFIG unset: inactive
        >>> energy.active
        False
    """
    if isinstance(getattr(accelerator, "end_training", None), _EndTraining):
        raise EnergyError("energy optimisation is already attached to this Accelerator")
    resolved = _config_from_env() if config is None else build_config(config, {})
    energy = AcceleratorEnergy(accelerator, resolved, optimizer=optimizer)
    energy.start()
    # Registered even when inactive, so checkpoints keep the same layout whether the
    # variable is set or not and stay loadable when it is switched on or off.
    accelerator.register_for_checkpointing(energy)
    return energy


def _config_from_env() -> EnergyConfig | None:
    try:
        return load_config()
    except ConfigError as exc:
        source = f"{exc.source} (named by ${CONFIG_ENV_VAR})"
        raise ConfigError(exc.problems, source) from exc


class AcceleratorEnergy(EnergyAdapter):
    """Energy optimisation attached to an ``Accelerator``; built by :func:`attach_energy`.

    Args:
        accelerator: the job's ``Accelerator``.
        config: the configuration; None makes an inactive attachment (nothing changes).
        optimizer: the optimizer whose steps count (None: the first one that steps).

    Attributes:
        controller: the energy controller (None when inactive).
        summary: the run summary once closed.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        config: EnergyConfig | None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        super().__init__(config if config is not None else EnergyConfig())
        self.accelerator = accelerator
        self._active = config is not None
        if isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        self._optimizer = optimizer
        self._handles: list[RemovableHandle] = []
        self._step_open = False

    @property
    def active(self) -> bool:
        """Whether energy optimisation runs (a configuration was given or found)."""
        return self._active

    @property
    def metrics(self) -> dict[str, float]:
        """The latest ``energy/*`` metrics (empty when inactive or before the first ones)."""
        return dict(self.controller.metrics) if self.controller is not None else {}

    def start(self) -> None:
        """Open this rank's GPU, take its lease and hook the optimizer steps.

        A state loaded before (:meth:`load_state_dict`) is resumed here.

        Raises:
            ConfigError: candidate power limits outside the GPU's range.
            EnergyError: strict mode, when the GPU cannot be controlled.
        """
        if not self.active:
            log.info("%s is not set: energy optimisation is off", CONFIG_ENV_VAR)
            return
        if self.controller is not None:
            return
        accelerator = self.accelerator
        controller = EnergyController(
            self.config,
            collective=tensor_collective(
                accelerator.process_index,
                accelerator.num_processes,
                accelerator.gather,
                _broadcast,
                accelerator.device,
            ),
            local_rank=accelerator.local_process_index,
            device=accelerator.device,
        )
        self._begin_run(controller, main_process=accelerator.is_main_process)
        self._handles = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]
        original = accelerator.end_training
        accelerator.end_training = _EndTraining(self, original)

    # ------------------------------------------------------------------ steps
    def _tracks(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._optimizer is None:
            self._optimizer = optimizer
        return optimizer is self._optimizer

    def _before_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if self.controller is None or self._step_open or not self._tracks(optimizer):
            return
        self.controller.handle(StepStart())
        self._step_open = True

    def _after_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        controller = self.controller
        if controller is None or not self._tracks(optimizer):
            return
        # A step runs from one optimizer step to the next, so a measurement window covers
        # whole iterations (forward, backward, data loading) and nothing is left out.
        self._publish(controller.handle(StepEnd()), controller.steps)
        controller.handle(StepStart())

    def _publish(self, result: StepResult, step: int) -> None:
        if result.metrics is None:
            return
        metrics = dict(result.metrics)
        self.accelerator.log(metrics, step=step)
        if self.accelerator.is_main_process:
            log.info(
                "energy at step %d: %s",
                step,
                ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()),
            )

    def interrupt(self, reason: str) -> None:
        """Discard the profiling window in progress; call it on every rank before evaluation.

        The power limit being profiled is measured again afterwards.
        """
        if self.controller is not None:
            self.controller.handle(Interruption(reason))

    def set_workload(self, key: str) -> None:
        """Declare a new workload (batch size or model change): it is profiled again.

        Build the key with :func:`~lightning_energy.integrations._common.workload_key`.
        """
        if self.controller is not None:
            self.controller.set_workload(key)

    def set_total_steps(self, total_steps: int | None) -> None:
        """Declare how many optimizer steps the whole job runs (carbon pacing plans to it)."""
        if self.controller is not None:
            self.controller.set_total_steps(total_steps)

    # ------------------------------------------------------------------ end
    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        hook = self.accelerator.__dict__.get("end_training")
        if isinstance(hook, _EndTraining) and hook.energy is self:
            del self.accelerator.end_training
        self._step_open = False

    def close(self) -> RunSummary | None:
        """Unhook, restore every GPU and log the run summary. Idempotent.

        Call it on every rank at a normal end (the job's totals are a collective).

        Returns:
            The run summary (None when inactive).
        """
        return self._finish()

    @override
    def _finish(self) -> RunSummary | None:
        """Unhook, then end the run normally and log its summary to the trackers."""
        if not self.running:
            return self.summary
        self._unhook()
        summary = super()._finish()
        if summary is not None and self.controller is not None:
            self.accelerator.log(summary_values(summary), step=self.controller.steps)
        return summary

    @override
    def _abort(self, failure: str) -> RunSummary | None:
        """Unhook, then end the run on an exception (restore, summary, report)."""
        if self.running:
            self._unhook()
        return super()._abort(failure)

    # ------------------------------------------------------------------ checkpoints
    @override
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume the profile and choice; ``accelerator.load_state`` calls this.

        Raises:
            CheckpointMismatchError: the state was measured on another GPU model.
        """
        if state_dict and not self.active:
            log.debug("energy state in the checkpoint ignored: energy optimisation is off")
            return
        super().load_state_dict(state_dict)


class _EndTraining:
    """``accelerator.end_training`` replacement: close the attachment, then end training.

    Closing first lets the summary reach the trackers before they finish and before the
    process group is destroyed.
    """

    def __init__(self, energy: AcceleratorEnergy, original: Callable[[], None]) -> None:
        self.energy = energy
        self.original = original

    def __call__(self) -> None:
        self.energy.close()
        self.original()


def _broadcast(obj: Any, src: int) -> Any:
    return broadcast_object_list([obj], from_process=src)[0]


class EnergyTracker(GeneralTracker):
    """An Accelerate tracker that records the ``energy/*`` and ``carbon/*`` values logged.

    Pass it in ``log_with`` beside (or instead of) TensorBoard or W&B; it keeps the values
    in :attr:`history` and, given a path, appends them as JSON lines (one object per
    ``accelerator.log`` call that carried such values, with its ``step``).

    Args:
        path: a JSON-lines file to append to (None: memory only).
        prefixes: which keys to keep.

    Example:
        >>> tracker = EnergyTracker()
        >>> accelerator = Accelerator(cpu=True, log_with=[tracker])
        >>> accelerator.init_trackers("demo")
        >>> accelerator.log({"energy/step_j": 12.5, "loss": 0.3}, step=7)
        >>> tracker.history
        [{'step': 7, 'energy/step_j': 12.5}]
    """

    name = "lightning_energy"
    requires_logging_directory = False
    main_process_only = True

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        prefixes: tuple[str, ...] = ("energy/", "carbon/"),
    ) -> None:
        super().__init__()
        self.path = Path(path) if path is not None else None
        self.prefixes = prefixes
        self.history: list[dict[str, Any]] = []
        self._file: IO[str] | None = None

    @property
    @override
    def tracker(self) -> list[dict[str, Any]]:
        """The recorded values (Accelerate's ``get_tracker(..., unwrap=True)`` returns this)."""
        return self.history

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record the energy and carbon values among ``values``."""
        kept = {k: v for k, v in values.items() if k.startswith(self.prefixes)}
        if not kept:
            return
        record: dict[str, Any] = {"step": step, **kept}
        self.history.append(record)
        if self.path is not None:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    @override
    def finish(self) -> None:
        """Close the file (``accelerator.end_training()`` calls this)."""
        if self._file is not None:
            self._file.close()
            self._file = None
