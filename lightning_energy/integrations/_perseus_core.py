"""What the Perseus adapters of both Lightning namespaces share.

``lightning.pytorch`` and ``pytorch_lightning`` have distinct strategy and callback classes
that reject each other's objects, so each namespace gets its own thin subclasses
(:mod:`.perseus_lightning`, :mod:`.perseus_pytorch_lightning`) of the mixins here, which
import neither. The mixins only translate hooks: the work is done by
:class:`~lightning_energy.perseus.runtime.pipeline_run.PipelineRun` and
:class:`~lightning_energy.perseus.data_parallel.StragglerRun` over this rank's GPU
(:func:`~lightning_energy.perseus.runtime.rank_gpu.open_rank_gpu`), shared with the energy
callback of the same Trainer when there is one.

Settings come from the ``perseus:``, ``device:`` and ``strict`` keys of the energy
configuration; an argument given to a strategy overrides the key it names.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_energy.config import DeviceConfig, EnergyConfig, load_config
from lightning_energy.errors import ConfigError
from lightning_energy.integrations._lightning_types import Module, Trainer, trainer_callbacks
from lightning_energy.integrations.adapter import EnergyAdapter, build_config
from lightning_energy.perseus.data_parallel import StragglerClocks, StragglerRun
from lightning_energy.perseus.runtime.pipeline_run import (
    PipelineModule,
    PipelinePace,
    PipelineRun,
    pipeline_schedule,
)
from lightning_energy.perseus.runtime.rank_gpu import RankGPU, open_rank_gpu

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

    # Type-checked as a Lightning callback, so ``@override`` is checked against its hooks;
    # at run time the core imports neither namespace (each subclass adds its own base).
    from lightning.pytorch.callbacks import Callback as _CallbackBase
    from lightning.pytorch.strategies import DDPStrategy as _DDPStrategyBase

    from lightning_energy.controller import EnergyController
    from lightning_energy.device.base import DeviceSet
    from lightning_energy.device.guard import GPUGuard
else:
    _CallbackBase = object
    _DDPStrategyBase = object

__all__ = [
    "PerseusCallbackCore",
    "PerseusDDPCore",
    "PerseusPipelineCore",
    "PerseusStrategyCore",
    "PipelineModule",
    "register_perseus_strategies",
    "shared_gpus",
    "strategy_config",
]

log = logging.getLogger(__name__)

EnergyArg = str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig | None

#: Simulated GPU of a strategy given no configuration: Perseus needs one modelling clocks.
_DEFAULT_SIMULATED_GPU = "a100"


def strategy_config(
    energy: EnergyArg,
    *,
    perseus: Mapping[str, Any],
    device: Mapping[str, Any],
    strict: bool | None,
    owner: str,
) -> EnergyConfig:
    """A strategy's configuration: its arguments > the energy configuration > defaults.

    The energy configuration is ``energy`` when given, else the file named by
    ``LIGHTNING_ENERGY_CONFIG``; without either, simulated GPUs are ``a100``.

    Args:
        energy: a YAML path, a mapping of the YAML schema, a built config, or None.
        perseus: ``perseus:`` keys given as arguments (None values are not given).
        device: ``device:`` keys given as arguments (None values are not given).
        strict: the ``strict`` argument (None: not given).
        owner: the strategy's name, for error messages.

    Raises:
        ConfigError: every problem found, naming the key.
    """
    given = energy if energy is not None else load_config()
    if given is None:
        base = EnergyConfig(device=DeviceConfig(gpu=_DEFAULT_SIMULATED_GPU))
    else:
        base = build_config(given, {})
    data = base.to_mapping()
    data["perseus"].update({k: v for k, v in perseus.items() if v is not None})
    data["device"].update({k: v for k, v in device.items() if v is not None})
    if strict is not None:
        data["strict"] = strict
    if data == base.to_mapping():
        return base
    return EnergyConfig.from_mapping(data, source=f"{owner} arguments over {base.source}")


def energy_owner(trainer: Trainer) -> EnergyAdapter | None:
    """The energy callback of ``trainer`` during its run (the adapter that owns the run),
    if any."""
    for callback in trainer_callbacks(trainer):
        if not isinstance(callback, EnergyAdapter) or not callback.owns_runs:
            continue
        controller = callback.controller
        if callback.running and controller is not None and controller.guard is not None:
            return callback
    return None


def energy_controller(trainer: Trainer) -> EnergyController | None:
    """The controller of the energy callback of ``trainer`` during its run, if any."""
    owner = energy_owner(trainer)
    return owner.controller if owner is not None else None


def shared_gpus(trainer: Trainer) -> tuple[DeviceSet, GPUGuard] | None:
    """The GPUs and guard of the energy callback of ``trainer`` during its run, if any."""
    controller = energy_controller(trainer)
    if controller is None or controller.guard is None:
        return None
    return controller.devices, controller.guard


def _open(config: EnergyConfig, trainer: Trainer, local_rank: int, device: torch.device) -> RankGPU:
    return open_rank_gpu(
        config,
        local_rank=local_rank,
        device=device,
        install_signal_handlers=threading.current_thread() is threading.main_thread(),
        shared=shared_gpus(trainer),
    )


class PerseusStrategyCore(_DDPStrategyBase):
    """A Perseus run over this rank's GPU, closed at teardown and on exceptions.

    A strategy, not an adapter: Lightning hands its strategy the model, the training step
    and the backward pass, which Perseus' pipeline replaces, so the strategies run
    Perseus themselves and register its clocks with the energy callback's controller as a
    knob. Type-checked as ``lightning.pytorch``'s ``DDPStrategy`` (each namespace's
    subclass adds its own at run time). Subclasses set ``self.config`` in ``__init__`` and
    ``self._run`` in ``setup``.
    """

    config: EnergyConfig
    _run: PipelineRun | StragglerRun | None = None

    @property
    def gpu(self) -> Any:
        """This rank's GPU (None before ``setup``)."""
        return self._run.rank.gpu if self._run is not None else None

    def _close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.close()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Put the GPU back before the exception propagates."""
        self._close()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Reset the clocks (and restore the GPU if Perseus opened it), then tear down."""
        self._close()
        super().teardown()


class PerseusPipelineCore(PerseusStrategyCore):
    """Pipeline parallel with per-instruction GPU clocks; see
    :class:`lightning_energy.integrations.perseus_lightning.PerseusPipelineStrategy`.

    Raises:
        ConfigError: bad settings (at construction) or a module without a stage split
            (at setup).
    """

    strategy_name = "perseus_pipeline"
    _pace: PipelinePace | None = None
    _step_start_s: float | None = None

    def __init__(
        self,
        *,
        energy: EnergyArg = None,
        schedule: str | None = None,
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        plan: str | None = None,
        target_time_s: float | None = None,
        profile_clocks_mhz: list[int] | None = None,
        warmup_iterations: int | None = None,
        iterations_per_clock: int | None = None,
        replan_every_iterations: int | None = None,
        device_backend: str | None = None,
        simulated_gpu: str | None = None,
        simulated_stage_times_s: list[list[float]] | None = None,
        compute_bound_share: float | None = None,
        lease_dir: str | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = strategy_config(
            energy,
            perseus={
                "schedule": schedule,
                "microbatches": microbatches,
                "virtual_stages": virtual_stages,
                "plan": plan,
                "target_time_s": target_time_s,
                "profile_clocks_mhz": profile_clocks_mhz,
                "warmup_iterations": warmup_iterations,
                "iterations_per_clock": iterations_per_clock,
                "replan_every_iterations": replan_every_iterations,
                "compute_bound_share": compute_bound_share,
            },
            device={"backend": device_backend, "gpu": simulated_gpu, "lease_dir": lease_dir},
            strict=strict,
            owner=type(self).__name__,
        )
        super().__init__(**kwargs)
        self.simulated_stage_times_s = simulated_stage_times_s

    @property
    def runtime(self) -> Any:
        """The pipeline runtime (None before ``setup``)."""
        return self._run.runtime if isinstance(self._run, PipelineRun) else None

    @property
    def online(self) -> Any:
        """Online profiling and planning (None before ``setup`` or with a plan file)."""
        return self._run.online if isinstance(self._run, PipelineRun) else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every pipeline rank reads the same batches."""
        return {"num_replicas": 1, "rank": 0}

    @override
    def configure_ddp(self) -> None:
        """Pipeline parallel: no DDP wrapper, each rank owns its stages' parameters."""

    @override
    def model_to_device(self) -> None:
        """Place only this rank's stages on its device; the other ranks' stay on the CPU."""
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            return  # reported at setup
        schedule = pipeline_schedule(self.config.perseus, self.world_size)
        stages = list(module.pipeline_stages())
        if len(stages) != schedule.num_stages:
            return  # reported at setup
        for s, stage in enumerate(stages):
            if schedule.device_of(s) == self.global_rank:
                stage.to(self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Set up as DDP does (process group, devices, optimizers), then the pipeline."""
        super().setup(trainer)
        rank = _open(self.config, trainer, self.local_rank, self.root_device)
        try:
            self._run = PipelineRun(
                rank,
                self.config.perseus,
                self.lightning_module,
                global_rank=self.global_rank,
                world_size=self.world_size,
                root_device=self.root_device,
                stage_times_s=self.simulated_stage_times_s,
                owner=type(self).__name__,
            )
        except BaseException:
            rank.close()
            raise
        controller = energy_controller(trainer)
        if controller is not None:
            # Perseus' clocks are a knob of the energy callback's job: no power limits are
            # profiled beside them, and the carbon pace moves Perseus' target time.
            self._pace = PipelinePace(self._run.pipeline)
            controller.add_knob(self._pace)
            self._step_start_s = None

    def set_target_time(self, target_s: float | None) -> None:
        """Re-plan for ``target_s`` at the next iteration (rank 0's value counts)."""
        if isinstance(self._run, PipelineRun):
            self._run.set_target_time(target_s)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One pipeline step at the planned clocks; logs and returns the mean loss."""
        assert isinstance(self._run, PipelineRun)
        if self._pace is not None:  # the whole step, optimizer included, for the pace
            now_s = self._run.pipeline.rank.clock()
            if self._step_start_s is not None:
                self._pace.observe_step(now_s - self._step_start_s)
            self._step_start_s = now_s
        inputs, target = args[0]
        loss = self._run.step(inputs, target)
        module = self.lightning_module
        assert module is not None  # set up with it
        module.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def backward(self, closure_loss: Any, *args: Any, **kwargs: Any) -> Any:
        """Nothing to do: the pipeline schedule ran every backward in ``training_step``."""
        return closure_loss


class PerseusDDPCore(PerseusStrategyCore):
    """DDP whose faster ranks finish their compute with the straggler; see
    :class:`lightning_energy.integrations.perseus_lightning.PerseusDDPStrategy`.

    Raises:
        ConfigError: bad settings (at construction).
    """

    strategy_name = "perseus_ddp"

    def __init__(
        self,
        *,
        energy: EnergyArg = None,
        window_steps: int | None = None,
        steps_per_clock: int | None = None,
        margin: float | None = None,
        profile_clocks_mhz: list[int] | None = None,
        device_backend: str | None = None,
        simulated_gpu: str | None = None,
        simulated_step_s: float | None = None,
        compute_bound_share: float | None = None,
        slowdowns: list[float] | None = None,
        lease_dir: str | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = strategy_config(
            energy,
            perseus={
                "window_steps": window_steps,
                "steps_per_clock": steps_per_clock,
                "margin": margin,
                "profile_clocks_mhz": profile_clocks_mhz,
                "simulated_step_s": simulated_step_s,
                "compute_bound_share": compute_bound_share,
            },
            device={
                "backend": device_backend,
                "gpu": simulated_gpu,
                "slowdowns": slowdowns,
                "lease_dir": lease_dir,
            },
            strict=strict,
            owner=type(self).__name__,
        )
        super().__init__(**kwargs)

    @property
    def equalizer(self) -> Any:
        """The straggler equalizer (None before ``setup``, or when clocks are fixed)."""
        return self._run.equalizer if isinstance(self._run, StragglerRun) else None

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Set up DDP, then this rank's straggler equalisation."""
        super().setup(trainer)
        rank = _open(self.config, trainer, self.local_rank, self.root_device)
        try:
            self._run = StragglerRun(
                rank, self.config.perseus, ddp_model=self.model, strict=self.config.strict
            )
        except BaseException:
            rank.close()
            raise
        controller = energy_controller(trainer)
        if controller is not None:
            controller.add_knob(StragglerClocks())

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Mark the step start, then the usual training step."""
        if isinstance(self._run, StragglerRun):
            self._run.step_start()
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        """The usual optimizer step, then report the step and re-evaluate the clock."""
        out = super().optimizer_step(*args, **kwargs)
        if isinstance(self._run, StragglerRun):
            self._run.step_end()
        return out


class PerseusCallbackCore(EnergyAdapter, _CallbackBase):
    """Perseus switched on by the configuration alone (``perseus: {enabled: true}``).

    The Lightning entry point adds it when ``LIGHTNING_ENERGY_CONFIG`` names such a file.
    ``mode: ddp`` equalises the data-parallel ranks (the straggler equaliser of
    ``perseus_ddp``) on any DDP strategy; ``mode: pipeline`` cannot be injected into a
    Trainer (the strategy runs the pipeline schedule), so unless the strategy is
    ``perseus_pipeline`` it warns once (strict mode raises) and changes nothing.

    With an energy callback in the same Trainer it takes part in that callback's run
    (:meth:`~lightning_energy.integrations.adapter.EnergyAdapter._join_run`): the
    equaliser's clocks are a knob of its controller, changed through its guard. Alone, it
    opens this rank's GPU itself and has no run of a controller to join.

    Args:
        config: the energy configuration.
    """

    owns_runs = False
    applied_sections = frozenset({"perseus", "batch_size"})

    def __init__(self, config: EnergyConfig) -> None:
        super().__init__(config)
        self.run: StragglerRun | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Check that the strategy can do what the configuration asks."""
        if stage != "fit" or self.config.perseus.mode != "pipeline":
            return
        if isinstance(trainer.strategy, PerseusPipelineCore):
            return
        message = (
            f"perseus.mode: 'pipeline' needs the perseus_pipeline strategy, not "
            f"{type(trainer.strategy).__name__}; set strategy='perseus_pipeline' and "
            "define pipeline_stages() and pipeline_loss() on the module (the strategy "
            "reads this file)"
        )
        if self.config.strict:
            raise ConfigError(message, self.config.source)
        log.warning("Perseus not applied: %s.", message)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        """Start equalising the ranks (the DDP model and the energy callback's GPUs exist)."""
        strategy = trainer.strategy
        if self.config.perseus.mode != "ddp" or isinstance(strategy, PerseusStrategyCore):
            return
        if trainer.world_size < 2:
            log.info("Perseus ddp: a single process has no straggler to wait for.")
            return
        rank = open_rank_gpu(
            self.config,
            local_rank=trainer.local_rank,
            device=strategy.root_device,
            install_signal_handlers=False,
            shared=shared_gpus(trainer),
        )
        try:
            self.run = StragglerRun(
                rank, self.config.perseus, ddp_model=strategy.model, strict=self.config.strict
            )
        except BaseException:
            rank.close()
            raise
        owner = energy_owner(trainer)
        if owner is not None:
            self._join_run(owner).add_knob(StragglerClocks())
        if rank.owned:
            # Lightning installed its SIGTERM handler before this hook: restore first.
            rank.guard.handle_signals()

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int
    ) -> None:
        """A step starts."""
        if self.run is not None:
            self.run.step_start()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A step ended (after the optimizer step)."""
        if self.run is not None:
            self.run.step_end()

    @override
    def on_exception(self, trainer: Trainer, pl_module: Module, exception: BaseException) -> None:
        """Put the clocks back before the exception propagates; leave the run."""
        self._close()
        self._abort(type(exception).__name__)

    @override
    def teardown(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Put the clocks back at the end of fit; leave the run."""
        if stage == "fit":
            self._close()
            self._finish()

    def _close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.close()


def register_perseus_strategies(registry: Any, pipeline_class: type, ddp_class: type) -> None:
    """Register ``perseus_pipeline`` and ``perseus_ddp`` in a namespace's ``StrategyRegistry``."""
    registry.register(
        PerseusPipelineCore.strategy_name,
        pipeline_class,
        description="Pipeline parallel with per-instruction GPU clocks (Perseus)",
        override=True,
    )
    registry.register(
        PerseusDDPCore.strategy_name,
        ddp_class,
        description="DDP with straggler-aware GPU clocks (Perseus)",
        override=True,
    )
