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
from collections.abc import Mapping
from typing import Any

import torch

from lightning_energy.collectives import GatherCollective
from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.integrations._common import EnergyAdapter, summary_values

__all__ = ["EnergyCallbackCore", "EnergyStrategyCore", "register_energy_strategies"]

log = logging.getLogger(__name__)


class EnergyCallbackCore(EnergyAdapter):
    """Power-limit optimisation for a Lightning ``Trainer``; see :class:`.lightning.EnergyCallback`.

    Takes the arguments of :class:`~lightning_energy.integrations._common.EnergyAdapter`.
    """

    _pending_state: dict[str, Any] | None = None
    _running = False

    @property
    def state_key(self) -> str:
        """Distinguishes energy callbacks with different selectors in one checkpoint."""
        section = self.config.power_limit
        return f"{type(self).__qualname__}[selector={section.selector}]"

    # ----------------------------------------------------------------- hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Start a run for this fit once the strategy (and its process group) exists.

        Every ``fit`` (also the one ``Tuner.lr_find`` runs, or a notebook cell run again
        with a new ``Trainer``) is a run of its own: set up, optimised (a workload
        profiled by an earlier fit reuses its profile), restored, summarised, reported.
        Other stages (validate, test, predict) change nothing.
        """
        if stage != "fit":
            return
        if self._running:
            self._finish_run(trainer)  # a fit that ended without its teardown hook
        strategy = trainer.strategy

        def all_gather(values: list[float]) -> list[list[float]]:
            tensor = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
            gathered = strategy.all_gather(tensor)
            if gathered.dim() == 1:
                gathered = gathered.unsqueeze(0)
            return [row.tolist() for row in gathered.cpu()]

        collective = GatherCollective(
            trainer.global_rank, trainer.world_size, all_gather, strategy.broadcast
        )
        self.summary = None
        if self.controller is None:
            self.controller = EnergyController(
                self.config,
                collective=collective,
                local_rank=trainer.local_rank,
                node_rank=trainer.node_rank,
                device=strategy.root_device,
                # Lightning installs its SIGTERM handler after this hook; the guard's is
                # installed at train start, on top of it (see ``on_train_start``).
                install_signal_handlers=False,
            )
        self.controller.setup(collective=collective)
        self._running = True
        if self._pending_state is not None:
            self.controller.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Declare the workload and the job's length (carbon pacing plans to the end).

        Installs the guard's SIGTERM/SIGINT handler on top of Lightning's: a signal
        restores every GPU at once, even mid-step or mid-pause, then Lightning handles it
        as usual (it stops at the next batch and calls ``on_exception``).
        """
        if not self._running or self.controller is None:
            return
        self.controller.handle_signals()
        self._declare_workload(trainer, pl_module)
        total = trainer.estimated_stepping_batches
        self.controller.set_total_steps(int(total) if math.isfinite(total) else None)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Re-check the workload at every epoch (a datamodule may change its batch size)."""
        self._declare_workload(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """Open a step."""
        if self._running and self.controller is not None:
            self.controller.on_step_start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close a step; log fresh metrics to the loggers and the progress bar."""
        controller = self.controller
        if not self._running or controller is None:
            return
        before = controller.metrics
        controller.on_step_end()
        if controller.metrics is before or not controller.metrics:
            return
        if trainer.loggers:
            pl_module.log_dict(
                controller.metrics, on_step=True, on_epoch=False, prog_bar=False, logger=True
            )
        if trainer.progress_bar_callback is not None:
            pl_module.log(
                "power_limit_w",
                controller.metrics["energy/power_limit_w"],
                on_step=True,
                on_epoch=False,
                prog_bar=True,
                logger=False,
            )

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """A profiling window must not span an epoch boundary."""
        if self._running and self.controller is not None:
            self.controller.interrupt("epoch end")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """Pause profiling during validation (the window in progress is retried)."""
        if self._running and self.controller is not None and trainer.training:
            self.controller.interrupt("validation")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Restore every GPU before the exception propagates."""
        if self._running and self.controller is not None:
            self._running = False
            self.summary = self.controller.teardown()
            log.warning("training failed (%s); GPU settings restored", type(exception).__name__)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Restore every GPU, then print and log the run summary (and write the report)."""
        if stage == "fit" and self._running:
            self._finish_run(trainer)

    def _finish_run(self, trainer: Any) -> None:
        assert self.controller is not None
        self._running = False
        summary = self._finish(self.controller, main_process=trainer.is_global_zero)
        for logger in trainer.loggers:
            logger.log_metrics(summary_values(summary), step=trainer.global_step)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The controller's state, saved in Lightning checkpoints."""
        return self.controller.state_dict() if self.controller is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the profile and choice (no profiling again)."""
        if not state_dict:
            return
        if self.controller is None:
            self._pending_state = dict(state_dict)
        else:
            self.controller.load_state_dict(dict(state_dict))

    # ----------------------------------------------------------------- helpers
    def _declare_workload(self, trainer: Any, pl_module: Any) -> None:
        if not self._running or self.controller is None:
            return
        params = sum(p.numel() for p in pl_module.parameters())
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None)
        self.controller.set_workload(f"batch_size={batch_size},params={params}")


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
        """Set up the base strategy, then attach the energy callback to the trainer."""
        super().setup_environment()  # type: ignore[misc]
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if not any(isinstance(cb, EnergyCallbackCore) for cb in trainer.callbacks):
            trainer.callbacks.append(self.energy_callback)


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
        description="Single device with energy optimisation",
        override=True,
        device="cpu",
    )
