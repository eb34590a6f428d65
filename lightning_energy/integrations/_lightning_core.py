"""What the Lightning callbacks of both namespaces share.

``lightning.pytorch`` and ``pytorch_lightning`` have distinct ``Callback`` classes that
reject each other's objects, so each namespace gets its own thin subclass
(:mod:`.lightning`, :mod:`.pytorch_lightning`) of :class:`EnergyCallbackCore`, which
imports neither: it only translates trainer hooks into controller calls.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController, Interruption, StepEnd, StepStart
from lightning_energy.device import current_torch_device
from lightning_energy.errors import ConfigError
from lightning_energy.integrations._lightning_types import Module, Trainer
from lightning_energy.integrations.adapter import (
    EnergyAdapter,
    count_parameters,
    summary_values,
    tensor_collective,
    workload_key,
)

if TYPE_CHECKING:
    import torch

    # Type-checked as a Lightning callback, so ``@override`` is checked against its hooks;
    # at run time the core imports neither namespace (each subclass adds its own base).
    from lightning.pytorch.callbacks import Callback as _CallbackBase

    from lightning_energy.kareus.data_parallel import DataParallelSetting
else:
    _CallbackBase = object

__all__ = [
    "EnergyCallbackCore",
    "EnergySingleDeviceCore",
    "EnergyStrategyCore",
    "register_energy_strategies",
]

log = logging.getLogger(__name__)


class EnergyCallbackCore(EnergyAdapter, _CallbackBase):
    """Power-limit optimisation for a Lightning ``Trainer``; see :class:`.lightning.EnergyCallback`.

    Takes the arguments of :class:`~lightning_energy.integrations.adapter.EnergyAdapter`.
    """

    applied_sections = frozenset({"perseus", "batch_size"})
    #: ``trainer.global_step`` when the step in progress opened (None: no step open).
    #: Under gradient accumulation a step ends at the batch whose optimizer step moves
    #: ``global_step``: one step per optimizer step, as ``estimated_stepping_batches``.
    _step_opened_at: int | None = None
    # The Trainer of the open run (held weakly), to tell a fit ended without our hooks.
    _trainer: weakref.ref[Trainer] | None = None
    # Whether the open run's training started (``on_train_start``).
    _training_started = False

    @property
    @override
    def state_key(self) -> str:
        """Distinguishes energy callbacks with different selectors in one checkpoint."""
        section = self.config.power_limit
        return f"{type(self).__qualname__}[selector={section.selector}]"

    # ----------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Start a run for this fit once the strategy (and its process group) exists.

        Every ``fit`` (also the one ``Tuner.lr_find`` runs, or a notebook cell run again
        with a new ``Trainer``) is a run of its own: set up, optimised (a workload
        profiled by an earlier fit reuses its profile), restored, summarised, reported.
        Other stages (validate, test, predict) change nothing. A checkpoint's state
        loaded before this hook is resumed right after setup. Called again before
        training starts, by the same running ``Trainer`` (the batch-size callback sets
        the run up first when it comes first), it changes nothing.
        """
        if stage != "fit":
            return
        if self.running:
            if self._set_up_for(trainer):
                return
            self._finish_run(trainer)  # a fit that ended without its teardown hook
        strategy = trainer.strategy
        collective = tensor_collective(
            trainer.global_rank,
            trainer.world_size,
            strategy.all_gather,
            strategy.broadcast,
            strategy.root_device,
        )
        controller = self.controller or EnergyController(
            self.config,
            collective=collective,
            local_rank=trainer.local_rank,
            node_rank=trainer.node_rank,
            device=strategy.root_device,
            # Lightning installs its SIGTERM handler after this hook; the guard's is
            # installed at train start, on top of it (see ``on_train_start``).
            install_signal_handlers=False,
        )
        self._step_opened_at = None
        self._training_started = False
        self._trainer = weakref.ref(trainer)
        self._begin_run(controller, main_process=trainer.is_global_zero, collective=collective)

    def __getstate__(self) -> dict[str, Any]:
        """What a copy gets (see :class:`EnergyAdapter`), without the Trainer's reference."""
        state = super().__getstate__()
        state.pop("_trainer", None)
        return state

    def _set_up_for(self, trainer: Trainer) -> bool:
        """Whether the open run was set up for the fit ``trainer`` is starting (its
        training has not started)."""
        mine = self._trainer() if self._trainer is not None else None
        return mine is trainer and not self._training_started and self._abandoned() is None

    def _abandoned(self) -> str | None:
        """The fit of this run's Trainer ended without calling ``on_exception`` or
        ``teardown`` on this callback (``Tuner.lr_find`` raising while it has swapped the
        Trainer's callbacks for its own), or the Trainer is gone."""
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            return "outlived its Trainer"
        status = str(getattr(trainer.state.status, "value", trainer.state.status))
        if status == "running":
            return None
        return f"was left open by a fit that ended ({status}) without the callback's hooks"

    @override
    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        """Declare the workload and the job's length (carbon pacing plans to the end).

        Installs the guard's SIGTERM/SIGINT handler on top of Lightning's: a signal
        restores every GPU at once, even mid-step or mid-pause, then Lightning handles it
        as usual (it stops at the next batch and calls ``on_exception``).
        """
        if not self.running or self.controller is None:
            return
        self._training_started = True
        self.controller.handle_signals()
        self._declare_workload(trainer, pl_module)
        total = trainer.estimated_stepping_batches
        self.controller.set_total_steps(int(total) if math.isfinite(total) else None)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        """Re-check the workload at every epoch (a datamodule may change its batch size)."""
        self._declare_workload(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int
    ) -> None:
        """Open a step, unless one is open (gradient accumulation: its first micro-batch
        opened it)."""
        if self.running and self.controller is not None and self._step_opened_at is None:
            self._step_opened_at = trainer.global_step
            self.controller.handle(StepStart())

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the step, unless the batch only accumulated gradients (the optimizer did
        not step); log fresh metrics to the loggers and the progress bar.

        The values are logged per step, never averaged over batches: they carry a batch
        size of their own, since Lightning cannot infer one for every ``training_step``
        (``def training_step(self, dataloader_iter)`` has no batch).
        """
        opened_at = self._step_opened_at
        if not self.running or self.controller is None or opened_at is None:
            return
        if trainer.accumulate_grad_batches > 1 and trainer.global_step == opened_at:
            return
        self._step_opened_at = None
        metrics = self.controller.handle(StepEnd()).metrics
        if metrics is None:
            return
        if trainer.loggers:
            pl_module.log_dict(
                dict(metrics),
                on_step=True,
                on_epoch=False,
                prog_bar=False,
                logger=True,
                batch_size=1,
            )
        if trainer.progress_bar_callback is not None:
            pl_module.log(
                "power_limit_w",
                metrics["energy/power_limit_w"],
                on_step=True,
                on_epoch=False,
                prog_bar=True,
                logger=False,
                batch_size=1,
            )

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        """A profiling window must not span an epoch boundary."""
        if self.running and self.controller is not None:
            self.controller.handle(Interruption("epoch end"))

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None:
        """Leave validation out of the profiling window in progress (inside ``fit``,
        Lightning has already set its stage to validating: ``trainer.training`` is False)."""
        if self.running and self.controller is not None:
            self.controller.handle(Interruption("validation"))

    @override
    def on_exception(self, trainer: Trainer, pl_module: Module, exception: BaseException) -> None:
        """Restore every GPU before the exception propagates, then write the report."""
        self._abort(type(exception).__name__)

    @override
    def teardown(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Restore every GPU, then print and log the run summary (and write the report)."""
        if stage == "fit" and self.running:
            self._finish_run(trainer)

    def _finish_run(self, trainer: Trainer) -> None:
        """End the run and log its summary to every logger; a logger that refuses the
        values (a fixed schema) is warned about, and the fit ends as it would without us."""
        summary = self._finish()
        if summary is None:
            return
        for logger in trainer.loggers:
            try:
                logger.log_metrics(summary_values(summary), step=trainer.global_step)
            except Exception as exc:
                log.warning(
                    "The %s logger refused the energy summary (%s: %s); training is unaffected.",
                    type(logger).__name__,
                    type(exc).__name__,
                    exc,
                )

    # ----------------------------------------------------------------- helpers
    def _declare_workload(self, trainer: Trainer, pl_module: Module) -> None:
        if not self.running or self.controller is None:
            return
        batch_size = getattr(trainer.train_dataloader, "batch_size", None)
        self.controller.set_workload(
            workload_key(batch_size=batch_size, params=count_parameters(pl_module))
        )


class EnergyStrategyCore:
    """Mixin turning a Lightning strategy into one that optimises energy.

    It attaches the namespace's energy callback to the trainer when the strategy sets up
    its environment, so configuring the strategy alone is enough. Subclasses set
    ``callback_class`` and list the base strategy second.

    Args:
        energy: the energy configuration (YAML path, mapping or ``EnergyConfig``; None:
            ``LIGHTNING_ENERGY_CONFIG`` or defaults).
        *args: passed to the base strategy.
        **kwargs: passed to the base strategy.

    Raises:
        ConfigError: invalid energy configuration, when the strategy is built.
    """

    callback_class: type[EnergyCallbackCore]

    def __init__(
        self,
        *args: Any,
        energy: str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.energy_callback = self.callback_class(energy)

    def setup_environment(self) -> None:
        """Set up the base strategy, then attach the energy callback to the trainer.

        A trainer that has an energy callback keeps it. The callback goes before the
        checkpoint callbacks, which Lightning runs last, in a new list: no list the user
        holds is changed.
        """
        super().setup_environment()  # type: ignore[misc]
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        callbacks = list(trainer.callbacks)
        if any(isinstance(cb, EnergyCallbackCore) for cb in callbacks):
            return
        checkpoints = [id(cb) for cb in trainer.checkpoint_callbacks]
        at = next((i for i, cb in enumerate(callbacks) if id(cb) in checkpoints), len(callbacks))
        trainer.callbacks = [*callbacks[:at], self.energy_callback, *callbacks[at:]]


class KareusDDPCore:
    """Mixin applying a Kareus data-parallel setting when a DDP strategy wraps the model.

    DDP takes its process group and bucket size only at construction, so the setting
    (:class:`~lightning_energy.kareus.data_parallel.DataParallelSetting`) goes into the
    strategy's DDP arguments as it wraps the model, after the process group exists: every
    rank wraps at the same point, as the CTA-limited gradient group needs. DDP reduces and
    averages in that group, a copy of its own: the same ranks. The setting's clock is
    locked when training starts, through the energy run's guard
    (:func:`~lightning_energy.kareus.data_parallel.hold_clock`), and released when the
    run ends. Subclasses list it before :class:`EnergyStrategyCore` and the DDP strategy.

    Args:
        *args: passed to the base strategy.
        data_parallel: the setting (None: that of the energy configuration's ``kareus``
            section, ``data_parallel_ctas``, ``data_parallel_bucket_cap_mb`` and
            ``data_parallel_clock_mhz``; without those, DDP's own group and buckets).
        **kwargs: passed to the base strategy (DDP's own arguments among them).

    Raises:
        ConfigError: a setting together with DDP's ``bucket_cap_mb`` or ``process_group``
            (the setting decides them); ``kareus.data_parallel_search`` (Accelerate only);
            at train start, a clock the GPUs do not support or
            may not be locked at, or a clock without an energy run to hold it.
    """

    _ddp_kwargs: dict[str, Any]  # the DDP strategy's own DDP arguments
    energy_callback: EnergyCallbackCore  # set by EnergyStrategyCore

    def __init__(
        self, *args: Any, data_parallel: DataParallelSetting | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.energy_callback.config.kareus.data_parallel_search:
            raise ConfigError(
                f"kareus.data_parallel_search: {type(self).__name__} cannot search online (DDP "
                "reduces in the group it was built with; the search switches groups through a "
                "communication hook, under Accelerate's attach_energy); set "
                "kareus.data_parallel_ctas and kareus.data_parallel_clock_mhz instead, or false"
            )
        if data_parallel is None:
            data_parallel = self.energy_callback.config.kareus.data_parallel()
        if data_parallel is not None:
            from lightning_energy.kareus.data_parallel import refuse_decided

            refuse_decided(kwargs, type(self).__name__)
        self.data_parallel = data_parallel

    def _setup_model(self, model: torch.nn.Module) -> Any:
        """Wrap ``model`` in DDP under the data-parallel setting."""
        if self.data_parallel is not None:
            from lightning_energy.kareus.data_parallel import ddp_kwargs

            self._ddp_kwargs = {**self._ddp_kwargs, **ddp_kwargs(self.data_parallel)}
        return super()._setup_model(model)  # type: ignore[misc]

    def on_train_start(self) -> None:
        """Lock the setting's clock (the energy run is set up, no step has run)."""
        super().on_train_start()  # type: ignore[misc]
        clock_mhz = self.data_parallel.clock_mhz if self.data_parallel is not None else None
        if clock_mhz is None:
            return
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        runs = [
            cb.controller
            for cb in trainer.callbacks
            if isinstance(cb, EnergyCallbackCore) and cb.running and cb.controller is not None
        ]
        if not runs:
            raise ConfigError(
                "kareus.data_parallel_clock_mhz: no energy run holds the GPUs to lock the "
                "clock through; keep the energy callback in the Trainer's callbacks"
            )
        from lightning_energy.kareus.data_parallel import hold_clock

        hold_clock(runs[0], clock_mhz)


class EnergySingleDeviceCore(EnergyStrategyCore):
    """:class:`EnergyStrategyCore` for one device: the one the ``Trainer`` chose.

    Lightning's accelerator connector gives a strategy that has ``parallel_devices`` the
    devices it parsed from the ``Trainer``'s ``accelerator`` and ``devices`` flags
    (``devices=[1]`` on CUDA: ``cuda:1``; ``accelerator="cpu"``: the CPU); the strategy
    trains on that one. A device given to the strategy wins, as with Lightning's own
    ``SingleDeviceStrategy``. The strategy pins no devices itself (``parallel_devices``
    reads None), so each ``Trainer`` it is passed to gives it its own, as a
    ``SingleDeviceStrategy`` object is reused.

    Args:
        device: the device to train on; None: the one the ``Trainer`` chose (before it
            chose: the current CUDA device when CUDA is available, else the CPU).
        *args: passed to the base strategy.
        energy: the energy configuration (see :class:`EnergyStrategyCore`).
        **kwargs: passed to the base strategy.

    Raises:
        ConfigError: invalid energy configuration, when the strategy is built; more than
            one device parsed (e.g. ``devices=2``, or ``devices="auto"`` on a machine with
            several GPUs), when the ``Trainer`` is built.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *args: Any,
        energy: str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig | None = None,
        **kwargs: Any,
    ) -> None:
        # The base needs a device; ``root_device`` ignores it when none was given.
        super().__init__("cpu" if device is None else device, *args, energy=energy, **kwargs)
        self._device_given = device is not None
        self._parallel_devices: list[torch.device] | None = None

    @property
    def parallel_devices(self) -> None:
        """None: the strategy pins no devices; Lightning's connector sets the ``Trainer``'s
        (the setter) whenever the strategy is given to a ``Trainer``."""
        return None

    @parallel_devices.setter
    def parallel_devices(self, devices: Sequence[torch.device | str | int] | None) -> None:
        import torch

        parsed = None if devices is None else [torch.device(d) for d in devices]
        if parsed is not None and len(parsed) > 1 and not self._device_given:
            names = ", ".join(str(d) for d in parsed)
            raise ConfigError(
                f"strategy='energy_single_device' trains on one device, but the Trainer's "
                f"accelerator and devices flags give {len(parsed)} ({names}; devices='auto', "
                "the default, takes them all): pass devices=1 or devices=[<index>] for one, "
                "or use strategy='energy_ddp' for all of them",
                source="Trainer",
            )
        self._parallel_devices = parsed

    @property
    def root_device(self) -> torch.device:
        """The device given, else the one the ``Trainer`` chose, else the current one."""
        if self._device_given:
            return super().root_device  # type: ignore[misc]
        if self._parallel_devices:
            return self._parallel_devices[0]
        return current_torch_device()


def register_energy_strategies(registry: Any, ddp_class: type, single_class: type) -> None:
    """Register ``energy_ddp``, ``energy_ddp_spawn`` and ``energy_single_device``."""
    for name, start_method in (("energy_ddp", "popen"), ("energy_ddp_spawn", "spawn")):
        registry.register(
            name,
            ddp_class,
            description=f"DDP with energy optimisation (start_method '{start_method}')",
            override=True,
            start_method=start_method,
        )
    registry.register(
        "energy_single_device",
        single_class,
        description="Single device (the Trainer's) with energy optimisation",
        override=True,
    )
