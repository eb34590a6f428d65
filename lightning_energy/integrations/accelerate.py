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

What :func:`attach_energy` wires up (nothing at all when inactive):

* steps: step hooks on the optimizers this ``Accelerator`` prepares, and on no other. Under
  gradient accumulation Accelerate only calls the wrapped optimizer's ``step`` on
  synchronising micro-batches, so one energy step is one real optimizer step. It works
  whether called before or after ``prepare``; after ``free_memory()`` the next optimizer
  prepared starts a new training, declared as its own workload.
* Kareus' data-parallel setting (the ``kareus`` section's ``data_parallel_*`` keys, see
  docs/kareus.md): the bucket size goes into Accelerate's DDP arguments before a model is
  prepared, and the CTA-limited gradient group into a DDP communication hook
  (``allreduce_hook``, averaging over the DDP model's own group) registered on the DDP
  model as Accelerate wraps it (attach before ``prepare`` then); its clock is locked
  through the run's guard from ``attach_energy`` until the run ends. With
  ``data_parallel_search``, the hook's state holds one CTA-limited group per candidate and
  :class:`~lightning_energy.kareus.dp_search.DataParallelSearch` measures the candidate
  CTAs (and clocks) over the training steps, then applies the best
  (:attr:`AcceleratorEnergy.search`).
* checkpoints: ``save_state`` writes the power-limit profile and choice to a file of its
  own (:data:`CHECKPOINT_FILE`) and ``load_state`` reads it when it is there (no profiling
  again after a restart); Accelerate's own files and custom objects are left as they are.
* metrics: ``energy/*`` values go to every tracker of the Accelerator that takes them
  (``log_with``, including :class:`EnergyTracker`) and to this module's logger.
* ranks: they agree through Accelerate's ``gather`` and ``broadcast_object_list``.
* restore: ``accelerator.end_training()``, :meth:`AcceleratorEnergy.close`, the ``with``
  block, SIGTERM/SIGINT, the end of a launcher's worker process (``notebook_launcher``,
  ``debug_launcher``), the ``Accelerator`` being freed and interpreter exit all put the
  pre-job settings back; an exception in the ``with`` block also writes the report
  (without a collective).

The attachment holds the ``Accelerator`` weakly and its optimizers' hooks hold the
attachment weakly, so ``del accelerator`` frees the Accelerator, its models and optimizers
as without it; a pickled copy of the Accelerator carries no energy optimisation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing.util
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.tracking import GeneralTracker
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    broadcast_object_list,
    gather,
)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
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
from lightning_energy.integrations.adapter import (
    EnergyAdapter,
    build_config,
    summary_values,
    tensor_collective,
    workload_key,
)

if TYPE_CHECKING:
    from lightning_energy.kareus.data_parallel import DataParallelSetting
    from lightning_energy.kareus.dp_search import DataParallelSearch

__all__ = ["CHECKPOINT_FILE", "AcceleratorEnergy", "EnergyTracker", "attach_energy"]

log = logging.getLogger(__name__)

ConfigLike = str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig

#: The file ``save_state`` writes the energy state to, beside Accelerate's own files.
CHECKPOINT_FILE = "lightning_energy.json"


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
            None: the first optimizer this Accelerator prepared that steps (with several
            optimizers, the one stepped first in an iteration).

    Returns:
        The attachment; use it as a context manager or call
        :meth:`AcceleratorEnergy.close` (``accelerator.end_training()`` does too).

    Raises:
        ConfigError: the configuration (or the file ``LIGHTNING_ENERGY_CONFIG`` names) is
            missing or invalid, or candidate power limits are outside the GPU's range; a
            Kareus data-parallel setting with a model already prepared in DDP, with a
            ``DistributedDataParallelKwargs`` whose ``bucket_cap_mb`` differs from the
            setting's, or with one that sets ``comm_hook`` or ``comm_wrapper``; a setting's
            clock the GPUs do not support or this job may not lock (the run is ended).
            Under ``kareus.data_parallel_search``, when the model is prepared: a second DDP
            model, a clock the GPUs do not support, or CTAs searched beside power-limit
            profiling (the run is ended).
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
        accelerator: the job's ``Accelerator`` (held weakly: the attachment never keeps
            it alive).
        config: the configuration; None makes an inactive attachment (nothing changes).
        optimizer: the optimizer whose steps count (None: the first one this Accelerator
            prepared that steps).

    Attributes:
        controller: the energy controller (None when inactive).
        summary: the run summary once closed.
        data_parallel: the Kareus data-parallel setting applied to the DDP models prepared
            while the run is open (None: DDP's own; always None when inactive).
        search: the Kareus online data-parallel search of the DDP model prepared in this
            run (None: not searching, or no DDP model prepared yet).
    """

    ended_by: ClassVar[str] = (
        "`accelerator.end_training()` (after `attach_energy(accelerator)`), or train inside "
        "`with attach_energy(accelerator):`"
    )

    def __init__(
        self,
        accelerator: Accelerator,
        config: EnergyConfig | None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        super().__init__(config if config is not None else EnergyConfig())
        self._accelerator = weakref.ref(accelerator)
        self._active = config is not None
        if isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        self._choice = weakref.ref(optimizer) if optimizer is not None else None
        # The optimizer whose steps count in the current training (see _counts).
        self._counted: weakref.ref[torch.optim.Optimizer] | None = None
        self._hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[RemovableHandle]]
        self._hooked = weakref.WeakKeyDictionary()
        self._step_open = False
        self._workload_pending = False
        self._refused: list[weakref.ref[GeneralTracker]] = []
        self._freed: weakref.finalize | None = None
        self._pid = os.getpid()
        self.data_parallel = self.config.kareus.data_parallel() if self._active else None
        self._searches = self._active and self.config.kareus.data_parallel_search
        self.search: DataParallelSearch | None = None
        self._ddp_handler: DistributedDataParallelKwargs | None = None  # the user's own

    @property
    def active(self) -> bool:
        """Whether energy optimisation runs (a configuration was given or found)."""
        return self._active

    @property
    def accelerator(self) -> Accelerator | None:
        """The ``Accelerator`` attached to (None once it has been freed)."""
        return self._accelerator()

    @property
    def metrics(self) -> dict[str, float]:
        """The latest ``energy/*`` metrics (empty when inactive or before the first ones)."""
        return dict(self.controller.metrics) if self.controller is not None else {}

    def start(self) -> None:
        """Open this rank's GPU, take its lease and hook the Accelerator.

        A state loaded before (:meth:`load_state_dict`) is resumed here.

        Raises:
            ConfigError: candidate power limits outside the GPU's range.
            EnergyError: strict mode, when the GPU cannot be controlled.
        """
        if not self.active:
            log.info("%s is not set: energy optimisation is off", CONFIG_ENV_VAR)
            return
        accelerator = self._accelerator()
        if self.controller is not None or accelerator is None:
            return
        if self.data_parallel is not None or self._searches:
            _refuse_ddp_conflicts(accelerator, self.data_parallel, searches=self._searches)
        controller = EnergyController(
            self.config,
            collective=tensor_collective(
                accelerator.process_index,
                accelerator.num_processes,
                gather,  # what accelerator.gather calls, without holding the Accelerator
                _broadcast,
                accelerator.device,
            ),
            local_rank=accelerator.local_process_index,
            device=accelerator.device,
        )
        self._begin_run(controller, main_process=accelerator.is_main_process)
        self._hook(accelerator)
        self._hold_clock(controller)

    def _hold_clock(self, controller: EnergyController) -> None:
        """Lock the data-parallel setting's clock for the run; when it cannot be, end the
        run (every GPU restored) and raise."""
        setting = self.data_parallel
        if setting is None or setting.clock_mhz is None:
            return
        from lightning_energy.kareus.data_parallel import hold_clock

        try:
            hold_clock(controller, setting.clock_mhz)
        except BaseException as exc:
            self._abort(type(exc).__name__)
            raise

    def _hook(self, accelerator: Accelerator) -> None:
        """Replace ``end_training`` and ``prepare_optimizer`` (with a data-parallel setting,
        ``prepare_model`` and the DDP arguments too) on this instance, add the checkpoint
        hooks, hook the optimizers prepared so far, and set the last resorts that restore
        the GPUs when the script never ends the run."""
        _EndTraining(accelerator, self)
        _PrepareOptimizer(accelerator, self)
        if self.data_parallel is not None or self._searches:
            _PrepareModel(accelerator, self)
        if self.data_parallel is not None:
            self._ddp_handler = accelerator.ddp_handler
            accelerator.ddp_handler = dataclasses.replace(
                self._ddp_handler or DistributedDataParallelKwargs(),
                bucket_cap_mb=self.data_parallel.bucket_cap_mb,
            )
        accelerator.register_save_state_pre_hook(_StateHook(self, save=True))
        accelerator.register_load_state_pre_hook(_StateHook(self, save=False))
        self._training_boundary()
        for prepared in accelerator._optimizers:
            self._discover(prepared)
        # Holds the attachment until the Accelerator is gone, then ends the run it left open.
        self._freed = weakref.finalize(accelerator, self._release, "when the Accelerator was freed")
        self._freed.atexit = False  # interpreter exit: the base class's _end_at_exit
        # A launcher's worker process (notebook_launcher, debug_launcher) ends with
        # os._exit once the launched function returns or raises: no atexit handler runs.
        multiprocessing.util.Finalize(
            None,
            _release,
            args=(weakref.ref(self), "when the worker process ended"),
            exitpriority=0,
        )

    # ------------------------------------------------------------------ steps
    def _training_boundary(self) -> None:
        """Before an optimizer is prepared: when none counted so far is prepared (the
        first training, or ``free_memory()`` let go of it, even if the same optimizer is
        prepared again next), the next one to step starts a new training."""
        if self._counted_optimizer() is None:
            self._counted = None
            self._workload_pending = True

    def _discover(self, prepared: object) -> None:
        """Hook an optimizer this Accelerator prepared (once)."""
        optimizer = getattr(prepared, "optimizer", prepared)  # inside AcceleratedOptimizer
        if not isinstance(optimizer, torch.optim.Optimizer) or optimizer in self._hooked:
            return
        self._hooked[optimizer] = [
            optimizer.register_step_pre_hook(_StepHook(self, before=True)),
            optimizer.register_step_post_hook(_StepHook(self, before=False)),
        ]

    def _hook_gradients(self, prepared: object) -> None:
        """A model Accelerate just wrapped in DDP: its gradients are all-reduced in the
        setting's CTA-limited copy of the DDP model's own group (a collective: every rank
        prepares its models at the same point), averaged over that group's ranks. Under the
        online search, in the copy the search uses now, one per candidate CTA count."""
        if not isinstance(prepared, DistributedDataParallel):
            return
        setting = self.data_parallel
        if not self._searches and (setting is None or setting.ctas is None):
            return
        key = "kareus.data_parallel_search" if self._searches else "kareus.data_parallel_ctas"
        if prepared._comm_hooks:
            raise ConfigError(
                f"{key}: the DDP model Accelerate prepared already has a communication hook; "
                f"the CTAs need their own: drop that hook or {key}"
            )
        if not self._searches:
            from lightning_energy.kareus.data_parallel import gradient_group

            assert setting is not None
            prepared.register_comm_hook(
                gradient_group(setting, prepared.process_group), allreduce_hook
            )
            return
        self._start_search(prepared)

    def _start_search(self, prepared: DistributedDataParallel) -> None:
        """Search the CTAs (and clocks) of ``prepared``'s gradient all-reduce from the next
        step on; when it cannot run, end the run (every GPU restored) and raise."""
        from lightning_energy.kareus.dp_search import (
            DataParallelSearch,
            GradientGroups,
            cta_allreduce_hook,
        )

        controller = self.controller
        assert controller is not None  # a run is open while prepare_model is replaced
        section = self.config.kareus
        assert section.data_parallel_search_ctas is not None  # validated with the config
        try:
            if self.search is not None:
                raise ConfigError(
                    "kareus.data_parallel_search: a second model was prepared in DDP; the "
                    "search measures the steps of one DDP model: prepare one, or set it to false"
                )
            groups = GradientGroups(prepared.process_group, section.data_parallel_search_ctas)
            self.search = DataParallelSearch(
                controller,
                groups,
                section.data_parallel_search_clocks_mhz,
                steps=section.data_parallel_search_steps,
            )
        except BaseException as exc:
            self._abort(type(exc).__name__)
            raise
        prepared.register_comm_hook(groups, cta_allreduce_hook)

    def _prepared(self, optimizer: torch.optim.Optimizer) -> bool:
        accelerator = self._accelerator()
        return accelerator is not None and any(
            getattr(prepared, "optimizer", prepared) is optimizer
            for prepared in accelerator._optimizers
        )

    def _counted_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer counted in the current training, while this Accelerator holds it."""
        counted = self._counted() if self._counted is not None else None
        return counted if counted is not None and self._prepared(counted) else None

    def _counts(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s steps are training steps: one of this Accelerator's
        prepared optimizers, the one chosen at attach time while it is prepared, else the
        first one that steps in this training."""
        if not self._prepared(optimizer):
            return False
        counted = self._counted_optimizer()
        if counted is not None:
            return optimizer is counted
        choice = self._choice() if self._choice is not None else None
        if choice is not None and choice is not optimizer and self._prepared(choice):
            return False
        self._counted = weakref.ref(optimizer)
        return True

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        controller = self.controller
        if controller is None or not self.running or not self._counts(optimizer):
            return
        if self._workload_pending:
            self._workload_pending = False
            self._declare_workload(controller, optimizer)
        if not self._step_open:
            controller.handle(StepStart())
            self._step_open = True
            if self.search is not None:
                self.search.step_start()

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        controller = self.controller
        if controller is None or not self.running or not self._counts(optimizer):
            return
        # A step runs from one optimizer step to the next, so a measurement window covers
        # whole iterations (forward, backward, data loading) and nothing is left out.
        self._publish(controller.handle(StepEnd()), controller.steps)
        search = self.search
        if search is not None:
            search.step_end()
        controller.handle(StepStart())
        if search is not None:
            search.step_start()

    def _declare_workload(
        self, controller: EnergyController, optimizer: torch.optim.Optimizer
    ) -> None:
        """A training starts: the window in progress (of an earlier training) pauses, and
        is discarded when the workload declared differs: the per-device batch size of the
        first data loader prepared, the accumulation steps and the parameters trained."""
        accelerator = self._accelerator()
        assert accelerator is not None  # it prepared the optimizer stepping now
        controller.handle(Interruption("a new training"))
        if self.search is not None:
            self.search.pause()
        controller.set_workload(
            workload_key(
                batch_size=_batch_size(accelerator),
                gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
                params=sum(p.numel() for group in optimizer.param_groups for p in group["params"]),
            )
        )

    def _publish(self, result: StepResult, step: int) -> None:
        if result.metrics is None:
            return
        metrics = dict(result.metrics)
        self._log(metrics, step)
        if self._main_process:
            log.info(
                "energy at step %d: %s",
                step,
                ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()),
            )

    def _log(self, values: dict[str, float], step: int) -> None:
        """Send ``values`` to every tracker that takes them, on the main process (as
        ``accelerator.log``); a tracker that refuses them is warned about once and left
        out, so our values never break training or teardown."""
        accelerator = self._accelerator()
        if accelerator is None or not self._main_process:
            return
        for tracker in accelerator.trackers:
            if any(refused() is tracker for refused in self._refused):
                continue
            try:
                tracker.log(values, step=step)
            except Exception as exc:  # e.g. a fixed schema: training goes on without it
                self._refused.append(weakref.ref(tracker))
                log.warning(
                    "The %r tracker refused the energy values (%s: %s): they are no longer "
                    "sent to it; training goes on.",
                    tracker.name,
                    type(exc).__name__,
                    exc,
                )

    def interrupt(self, reason: str) -> None:
        """Pause the profiling window in progress; call it on every rank before evaluation.

        The window leaves out what runs until the next optimizer step and measures the
        training steps on either side.
        """
        if self.controller is not None:
            self.controller.handle(Interruption(reason))
        if self.search is not None:
            self.search.pause()

    def set_workload(self, key: str) -> None:
        """Declare a new workload (batch size or model change): it is profiled again.

        It replaces the workload declared for the current training. Build the key with
        :func:`~lightning_energy.integrations.adapter.workload_key`.
        """
        self._workload_pending = False
        if self.controller is not None:
            self.controller.set_workload(key)

    def set_total_steps(self, total_steps: int | None) -> None:
        """Declare how many optimizer steps the whole job runs (carbon pacing plans to it)."""
        if self.controller is not None:
            self.controller.set_total_steps(total_steps)

    # ------------------------------------------------------------------ end
    def _unhook(self) -> None:
        """Remove the optimizer hooks, put the Accelerator's own methods back and stop
        waiting for it to be freed. The checkpoint hooks stay: a checkpoint saved after the
        run still carries its profile."""
        for handles in list(self._hooked.values()):
            for handle in handles:
                handle.remove()
        self._hooked.clear()
        accelerator = self._accelerator()
        if accelerator is not None:
            for override in (_EndTraining, _PrepareOptimizer, _PrepareModel):
                override.remove(accelerator, self)
            if self.data_parallel is not None:
                accelerator.ddp_handler = self._ddp_handler
        self.search = None
        if self._freed is not None:
            self._freed.detach()
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
        """Unhook, then end the run normally and log its summary (not for a run of 0
        steps) to the trackers that take it."""
        if not self.running:
            return self.summary
        self._unhook()
        summary = super()._finish()
        if summary is not None and summary.steps > 0 and self.controller is not None:
            self._log(summary_values(summary), step=self.controller.steps)
        return summary

    @override
    def _abort(self, failure: str) -> RunSummary | None:
        """Unhook, then end the run on an exception (restore, summary, report)."""
        if self.running:
            self._unhook()
        return super()._abort(failure)

    def _release(self, when: str) -> None:
        """The last resort, when the script never ended the run: unhook, then end it as
        on an exception (restore every GPU, no collective: the other ranks may be gone),
        with one warning naming what the script should call. A no-op once the run ended,
        and in another process (a forked child)."""
        if not self.running or os.getpid() != self._pid:
            return
        try:
            self._unhook()
            self._end_alone(
                f"Energy optimisation was still running {when}: GPU settings restored; end "
                f"a run with {self.ended_by}"
            )
        except Exception:  # a finaliser must not raise; the guard's own last resort remains
            log.exception("ending the energy optimisation run %s failed", when)

    @override
    def _end_at_exit(self) -> None:
        """The interpreter exits with the run still open: end it, naming what to call."""
        self._release("at interpreter exit")

    # ------------------------------------------------------------------ checkpoints
    def _save_state(self, directory: Path) -> None:
        """``save_state``: write the state on the processes that write Accelerate's own
        custom states (the main one, or each node's with ``save_on_each_node``)."""
        accelerator = self._accelerator()
        assert accelerator is not None  # saving its state now
        state = self.state_dict()
        on_each_node = accelerator.project_configuration.save_on_each_node
        if accelerator.is_main_process or (on_each_node and accelerator.is_local_main_process):
            (directory / CHECKPOINT_FILE).write_text(json.dumps(state), encoding="utf-8")

    def _load_state(self, directory: Path) -> None:
        """``load_state``: resume the state when the checkpoint has one."""
        path = directory / CHECKPOINT_FILE
        if not path.is_file():
            log.info("%s holds no energy state: the power limits are profiled", directory)
            return
        self.load_state_dict(json.loads(path.read_text(encoding="utf-8")))

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


def _release(energy: weakref.ref[AcceleratorEnergy], when: str) -> None:
    """Process end: release the run of an attachment still alive (it holds the GPUs)."""
    attachment = energy()
    if attachment is not None:
        attachment._release(when)


def _batch_size(accelerator: Accelerator) -> int | None:
    """The per-device batch size of the first data loader prepared (None: unknown)."""
    if not accelerator._dataloaders:
        return None
    try:
        return int(accelerator._dataloaders[0].total_batch_size) // accelerator.num_processes
    except (AttributeError, TypeError):  # not a prepared loader, or no fixed batch size
        return None


class _StepHook:
    """An optimizer step hook that holds its attachment weakly: an optimizer never keeps
    the attachment (nor, through it, anything else) alive."""

    def __init__(self, energy: AcceleratorEnergy, *, before: bool) -> None:
        self._energy = weakref.ref(energy)
        self._before = before

    def __call__(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        energy = self._energy()
        if energy is None:
            return
        if self._before:
            energy._before_step(optimizer)
        else:
            energy._after_step(optimizer)


class _Override:
    """An ``Accelerator`` method replaced on one instance while a run is open.

    It calls what it replaced (an instance attribute set before, else the class's method)
    and puts that back when removed. Pickled, it is what it replaced, so a copy of the
    Accelerator carries no energy optimisation.
    """

    name = ""

    def __init__(self, accelerator: Accelerator, energy: AcceleratorEnergy) -> None:
        self._accelerator = weakref.ref(accelerator)
        self.energy = energy
        self.previous = vars(accelerator).get(self.name)
        setattr(accelerator, self.name, self)

    def original(self) -> Callable[..., Any]:
        """What this replaced, bound to the Accelerator."""
        if self.previous is not None:
            return self.previous
        accelerator = self._accelerator()
        return getattr(type(accelerator), self.name).__get__(accelerator)

    @classmethod
    def remove(cls, accelerator: Accelerator, energy: AcceleratorEnergy) -> None:
        """Put back what ``energy``'s override replaced (unless replaced again since)."""
        override = vars(accelerator).get(cls.name)
        if not isinstance(override, cls) or override.energy is not energy:
            return
        if override.previous is None:
            delattr(accelerator, cls.name)
        else:
            setattr(accelerator, cls.name, override.previous)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.previous is not None:
            return (_same, (self.previous,))
        return (getattr, (self._accelerator(), self.name))


def _same(value: object) -> object:
    """Unpickles an override as the instance attribute it replaced."""
    return value


class _EndTraining(_Override):
    """``accelerator.end_training``: close the attachment, then end training as Accelerate
    does, always (a failure of ours is a warning).

    Closing first lets the summary reach the trackers before they finish and before the
    process group is destroyed.
    """

    name = "end_training"

    def __call__(self) -> None:
        original = self.original()
        try:
            self.energy.close()
        except Exception as exc:  # the GPUs are restored first, whatever fails after
            log.warning(
                "Ending energy optimisation failed (%s: %s); GPU settings are restored and "
                "Accelerate's end_training() runs.",
                type(exc).__name__,
                exc,
            )
        finally:
            original()


class _PrepareOptimizer(_Override):
    """``accelerator.prepare_optimizer`` (``prepare`` calls it too): prepare as Accelerate
    does, then hook the optimizer prepared."""

    name = "prepare_optimizer"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.energy._training_boundary()
        prepared = self.original()(*args, **kwargs)
        self.energy._discover(prepared)
        return prepared


class _PrepareModel(_Override):
    """``accelerator.prepare_model`` (``prepare`` calls it too), with a data-parallel
    setting: prepare as Accelerate does, then hook the DDP model's gradients."""

    name = "prepare_model"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prepared = self.original()(*args, **kwargs)
        self.energy._hook_gradients(prepared)
        return prepared


def _refuse_ddp_conflicts(
    accelerator: Accelerator, setting: DataParallelSetting | None, *, searches: bool
) -> None:
    """Refuse what a data-parallel setting (or the online search, when ``searches``)
    cannot be applied beside.

    Raises:
        ConfigError: a model already prepared in DDP (its buckets and group are fixed), or
            the Accelerator's ``DistributedDataParallelKwargs`` sets another bucket size or,
            with the setting's CTAs or the search, a communication hook.
    """
    where = (
        "kareus.data_parallel_search"
        if searches
        else "kareus.data_parallel_ctas / kareus.data_parallel_bucket_cap_mb"
    )
    if any(isinstance(model, DistributedDataParallel) for model in accelerator._models):
        raise ConfigError(
            f"{where}: a model was already prepared in DDP, whose buckets and gradient group "
            "are fixed; call attach_energy(accelerator) before accelerator.prepare(...)"
        )
    handler = accelerator.ddp_handler
    if handler is None:
        return
    default = DistributedDataParallelKwargs().bucket_cap_mb
    bucket_cap_mb = default if setting is None else setting.bucket_cap_mb
    if handler.bucket_cap_mb not in (default, bucket_cap_mb):
        raise ConfigError(
            f"{where}: DistributedDataParallelKwargs(bucket_cap_mb={handler.bucket_cap_mb}) "
            f"conflicts with the setting's {bucket_cap_mb:g} MB; give the bucket size in "
            "kareus.data_parallel_bucket_cap_mb only"
        )
    hooks = {  # a name or the enum, as the user gave it
        "comm_hook": DDPCommunicationHookType(handler.comm_hook),
        "comm_wrapper": DDPCommunicationHookType(handler.comm_wrapper),
    }
    given = [f"{k}={v.value!r}" for k, v in hooks.items() if v != DDPCommunicationHookType.NO]
    key = "kareus.data_parallel_search" if searches else "kareus.data_parallel_ctas"
    if given and (searches or (setting is not None and setting.ctas is not None)):
        raise ConfigError(
            f"{where}: DistributedDataParallelKwargs({', '.join(given)}) replaces the "
            f"gradient all-reduce the CTA-limited groups run in; drop it or {key}"
        )


class _StateHook:
    """A ``save_state``/``load_state`` pre-hook carrying the energy state in its own file."""

    def __init__(self, energy: AcceleratorEnergy, *, save: bool) -> None:
        self.energy = energy
        self.save = save

    def __call__(self, *args: Any) -> None:
        directory = Path(args[-1])  # save: (models, weights, output_dir); load: (models, input_dir)
        if self.save:
            self.energy._save_state(directory)
        else:
            self.energy._load_state(directory)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_NoEnergyState, ())


class _NoEnergyState:
    """What a checkpoint hook is in a pickled copy of the Accelerator: nothing to save or
    load (the copy carries no energy optimisation)."""

    def __call__(self, *args: Any) -> None:
        return None


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
