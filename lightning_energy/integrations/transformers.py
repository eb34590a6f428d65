"""Energy optimisation for the Hugging Face Transformers ``Trainer`` (the ``hf`` extra).

One callback::

    from transformers import Trainer
    from lightning_energy.integrations.transformers import EnergyTrainerCallback

    energy = EnergyTrainerCallback("energy.yaml")   # or None: $LIGHTNING_ENERGY_CONFIG
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[energy])
    with energy:                                    # restores the GPUs if training raises
        trainer.train()

What it does with the Trainer's events:

* ``on_step_begin``/``on_step_end`` fire once per optimizer step, also under
  ``gradient_accumulation_steps``: one energy step is one real optimizer step.
* The controller's state (power-limit profile and choice) is saved in every checkpoint's
  ``trainer_state.json`` (the Trainer's own mechanism for stateful callbacks) and read
  back by ``trainer.train(resume_from_checkpoint=...)``: no profiling again.
* ``energy/*`` (and ``carbon/*``) values are added to the training logs (the loss logged
  every ``logging_steps``: the console and the callbacks after this one) and to their
  entries of ``trainer.state.log_history``; never to other logs, so ``train()``,
  ``evaluate()`` and ``predict()`` return what they return without this callback.
* A profiling window spanning an evaluation or an epoch end is discarded and retried.
* ``on_train_end`` (or the ``with`` block, SIGTERM/SIGINT, interpreter exit) restores
  every GPU exactly once; an exception in the ``with`` block also writes the report.
* ``auto_find_batch_size`` retrying ``train()`` with a smaller batch after running out of
  memory ends the run of the failed attempt (GPUs restored) and starts another.

Requires ``pip install "lightning-energy[hf]"``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from typing_extensions import override

from lightning_energy.controller import EnergyController, Interruption, StepEnd, StepStart
from lightning_energy.integrations.adapter import (
    EnergyAdapter,
    count_parameters,
    workload_key,
)

__all__ = ["EnergyTrainerCallback"]


class EnergyTrainerCallback(EnergyAdapter, TrainerCallback, ExportableState):
    """Power-limit optimisation and carbon-aware control for a Transformers ``Trainer``.

    Args:
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``; None
            reads the file named by ``LIGHTNING_ENERGY_CONFIG``, else uses defaults.
        device: the ``device:`` section (overrides the file's).
        power_limit: the ``power_limit:`` section (overrides the file's).
        carbon: the ``carbon:`` section (overrides the file's).
        strict: raise instead of observing when GPU settings cannot be changed.
        report: write the run report (JSON) to this path at the end of training.

    Attributes:
        controller: the controller of the current (or last) ``train()`` call.
        summary: the run summary once training ended.

    Raises:
        ConfigError: invalid configuration, raised here, before training starts.
    """

    ended_by: ClassVar[str] = "`with energy:` around `trainer.train()`"
    # The step at which the Trainer logs the training loss next (None: no log expected).
    _training_log_step: int | None = None
    _batch_size: int | None = None

    # ----------------------------------------------------------------- state
    @override
    def state(self) -> dict[str, Any]:
        """What the Trainer writes to ``trainer_state.json`` at every checkpoint.

        ``args`` rebuild this callback (with ``restore_callback_states_from_checkpoint``);
        ``attributes`` hold the controller's state, read back in :meth:`on_train_begin`.
        """
        energy_state = self.state_dict() if self.running else {}
        return {
            "args": {"config": self.config.to_mapping()},
            "attributes": {"energy_state": energy_state},
        }

    @classmethod
    def _saved_state(cls, state: TrainerState) -> dict[str, Any]:
        """The controller state in a resumed ``TrainerState`` (empty when none)."""
        # Loaded from trainer_state.json, ``stateful_callbacks`` maps class names to states.
        stored: Any = state.stateful_callbacks
        entry = stored.get(cls.__name__) if isinstance(stored, Mapping) else None
        if isinstance(entry, list):
            entry = entry[0] if entry else None
        if not isinstance(entry, Mapping):
            return {}
        saved = entry.get("attributes", {}).get("energy_state")
        return dict(saved) if isinstance(saved, Mapping) else {}

    # ----------------------------------------------------------------- hooks
    @override
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Open this rank's GPU, resume a saved profile, declare the workload and its length.

        A run still open is that of an earlier ``train()`` call that raised: it ends here,
        quietly when ``auto_find_batch_size`` retries with a smaller batch.
        """
        previous_batch_size, self._batch_size = self._batch_size, state.train_batch_size
        if self.running:
            smaller = (state.train_batch_size or 0) < (previous_batch_size or 0)
            if args.auto_find_batch_size and smaller:
                self._end_alone(
                    f"train() ran out of memory at a batch size of {previous_batch_size} and "
                    f"auto_find_batch_size retries it with a smaller batch "
                    f"({state.train_batch_size}): the energy run of the failed attempt "
                    "ended (GPU settings restored) and a new one starts",
                    logging.INFO,
                )
            else:  # raised outside ``with energy:``
                self._abort("an earlier train() call that did not end")
        if state.global_step > 0:  # resumed: the checkpoint's trainer_state.json was loaded
            self.load_state_dict(self._saved_state(state))  # resumed right after setup
        controller = self._begin_run(
            EnergyController(self.config, local_rank=args.local_process_index, device=args.device),
            main_process=state.is_world_process_zero,
        )
        controller.set_total_steps(state.max_steps if state.max_steps > 0 else None)
        model = kwargs.get("model")
        controller.set_workload(
            workload_key(
                batch_size=state.train_batch_size,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                params=count_parameters(model) if model is not None else 0,
            )
        )

    @override
    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Open an optimizer step (the first micro-batch of an accumulation)."""
        if self.running and self.controller is not None:
            self.controller.handle(StepStart())

    @override
    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Close an optimizer step (its metrics reach the Trainer's next log, in ``on_log``).

        An evaluation or a checkpoint the Trainer runs after this step (its flow callback,
        called first, has set ``control.should_evaluate`` / ``should_save``) is left out
        of the profiling window in progress: ``on_evaluate`` comes only once the
        evaluation has run."""
        if self.running and self.controller is not None:
            self.controller.handle(StepEnd())
            if control.should_evaluate or control.should_save:
                self.controller.handle(
                    Interruption("evaluation" if control.should_evaluate else "checkpoint")
                )
        self._expect_training_log(state, control)

    @override
    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """An evaluation run some other way than the step's ``control`` (already over):
        the window that spanned it is paused from here."""
        if self.running and self.controller is not None:
            self.controller.handle(Interruption("evaluation"))

    @override
    def on_epoch_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """A profiling window must not span an epoch boundary."""
        if self.running and self.controller is not None:
            self.controller.handle(Interruption("epoch end"))
        self._expect_training_log(state, control)

    def _expect_training_log(self, state: TrainerState, control: TrainerControl) -> None:
        """Note whether the Trainer logs the training loss next: after a step or an epoch
        at which it asks for a log (``control.should_log``), before anything else."""
        self._training_log_step = state.global_step if control.should_log else None

    @override
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the latest ``energy/*`` values to a training log and its history entry.

        A training log is the dictionary the Trainer builds for the loss it logs after a
        step (and drops after this event); every other log is left as it is: evaluation
        metrics and the final training metrics are what ``evaluate()`` and ``train()``
        return.
        """
        expected, self._training_log_step = self._training_log_step, None
        training_log = expected == state.global_step and logs is not None and "loss" in logs
        if not training_log or not self.running or self.controller is None:
            return
        metrics = dict(self.controller.metrics)
        if not metrics:
            return
        assert logs is not None
        logs.update(metrics)
        # The Trainer appended a copy of ``logs`` (plus the step) just before this event.
        last = state.log_history[-1] if state.log_history else {}
        if last.get("step") == state.global_step and "loss" in last:
            last.update(metrics)

    @override
    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Restore every GPU, then log the run summary (and write the report)."""
        self._finish()
