"""Batch-size optimisation across recurring Lightning runs (companion of ``EnergyCallback``).

Add it next to the energy callback; every run of the job then uses the batch size the
history suggests, stops once the target is reached (or once it costs too much), and records
itself::

    from lightning.pytorch import Trainer
    from lightning_energy.integrations.lightning import BatchSizeCallback, EnergyCallback

    trainer = Trainer(
        max_epochs=30,
        callbacks=[
            EnergyCallback(power_limit={"selector": "cost", "eta": 0.5}),
            BatchSizeCallback("resnet50-imagenet", monitor="val_acc", target=0.65,
                              batch_sizes=[64, 128, 256, 512], default_batch_size=256),
            # or BatchSizeCallback(config="energy.yaml"), with a batch_size: section
        ],
    )
    trainer.fit(model, datamodule=datamodule)   # datamodule.batch_size is set for you

The callback is defined, like the energy callback, in each namespace's module:
``lightning_energy.integrations.lightning.BatchSizeCallback`` and
``lightning_energy.integrations.pytorch_lightning.BatchSizeCallback`` (also reachable here as
``BatchSizeCallback`` and ``PLBatchSizeCallback``, or through
``batch_size_callback_class(namespace)``); importing this module imports neither namespace
until one of the classes is used.

Settings come from the ``batch_size:`` section of the energy configuration (``config=``,
else ``LIGHTNING_ENERGY_CONFIG``); an argument overrides the key it names. With
``batch_size: {enabled: true}`` in the file named by ``LIGHTNING_ENERGY_CONFIG``, the
Lightning entry point adds the callback by itself.

The callback only translates hooks; :class:`~lightning_energy.optimize.recurring.RecurringRun`
does the work. What happens in a run: at ``setup`` (before the dataloaders are built) rank
0 opens the store, asks :class:`~lightning_energy.optimize.recurring.BatchSizeOptimizer`
for the batch size and loads the power-limit profile saved for it; both are broadcast with
the strategy's collectives and every rank sets ``batch_size`` on the datamodule, the module
or its ``hparams``. After each validation, the job-wide energy (summed over ranks) and time (the
slowest rank's) are compared with the target and the early-stopping bound, and rank 0's
verdict is broadcast; the Trainer stops when the target is reached or the run is stopped
early. When training ends, rank 0 records the run and saves the power-limit profile for the
batch size, so the next run with it skips profiling. Only rank 0 talks to the store.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_energy.config import EnergyConfig
from lightning_energy.errors import ConfigError, StoreError
from lightning_energy.integrations._lightning_core import EnergyCallbackCore
from lightning_energy.integrations._lightning_types import (
    Module,
    Trainer,
    trainer_callbacks,
    trainer_datamodule,
)
from lightning_energy.integrations.adapter import EnergyAdapter
from lightning_energy.measure import EnergyMeter

if TYPE_CHECKING:
    # Type-checked as a Lightning callback, so ``@override`` is checked against its hooks;
    # at run time the core imports neither namespace (each subclass adds its own base).
    from lightning.pytorch.callbacks import Callback as _CallbackBase

    from lightning_energy.optimize.batch_size import Trial
    from lightning_energy.optimize.recurring import (
        BatchSizeKnob,
        BatchSizeOptimizer,
        Choice,
        RecurringRun,
        Verdict,
    )
    from lightning_energy.store import Store
else:
    _CallbackBase = object

# ``BatchSizeCallback`` (lightning.pytorch) and ``PLBatchSizeCallback`` (pytorch_lightning)
# are the namespaces' own classes, imported on first access by ``__getattr__`` below.
__all__ = ["BatchSizeCallbackCore", "batch_size_callback_class"]

log = logging.getLogger(__name__)

_RUN = "batch-size-run"
_NAMESPACES = {  # namespace: (the name here, the module defining its class)
    "lightning.pytorch": ("BatchSizeCallback", "lightning_energy.integrations.lightning"),
    "pytorch_lightning": ("PLBatchSizeCallback", "lightning_energy.integrations.pytorch_lightning"),
}


class BatchSizeCallbackCore(EnergyAdapter, _CallbackBase):
    """Chooses each run's batch size from the job's history; see the module docstring.

    An adapter that takes part in the run of the energy callback of the same ``Trainer``
    (:meth:`~lightning_energy.integrations.adapter.EnergyAdapter._join_run`): the batch
    size is a knob of that run's controller
    (:class:`~lightning_energy.optimize.recurring.BatchSizeKnob`), recorded in its ledger
    and listed in its report's decisions.

    Every argument but ``config``, ``store`` and ``strict`` overrides the ``batch_size:``
    key named after it (None: the configuration's value).

    Args:
        job_key: the name of the recurring job (with the GPU model and count, its identity).
        config: the energy configuration (YAML path, mapping or ``EnergyConfig``; None:
            ``LIGHTNING_ENERGY_CONFIG``, else defaults).
        monitor: the validation metric logged by the module (e.g. ``"val_acc"``).
        target: the value of ``monitor`` that counts as converged.
        batch_sizes: every batch size allowed.
        default_batch_size: the batch size exploration starts from.
        higher_is_better: False for losses and error rates.
        max_epochs: a run not converged after this many epochs has failed (default: the
            Trainer's ``max_epochs``).
        attribute: the batch-size attribute to set on the datamodule, module or hparams.
        store: a store URL or an open :class:`Store` (default: ``LIGHTNING_ENERGY_STORE_URL``,
            else SQLite in the user's data directory).
        eta: energy weight of the cost (0: time only, 1: energy only).
        beta: a run stops once its cost exceeds ``beta`` x the cheapest converged run.
        window: Thompson sampling uses each batch size's latest ``window`` runs (None: all).
        seed: seed of the sampling.
        allow_network_fs: accept a SQLite store on a network file system.
        strict: raise when the store fails instead of training with the default batch size
            (None: the configuration's ``strict``).

    Raises:
        ConfigError: invalid or missing settings (checked again against the GPUs at
            ``setup``).
    """

    owns_runs = False
    applied_sections = frozenset({"perseus", "batch_size"})

    def __init__(
        self,
        job_key: str | None = None,
        *,
        config: str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig | None = None,
        monitor: str | None = None,
        target: float | None = None,
        batch_sizes: Sequence[int] | None = None,
        default_batch_size: int | None = None,
        higher_is_better: bool | None = None,
        max_epochs: int | None = None,
        attribute: str | None = None,
        store: str | Store | None = None,
        eta: float | None = None,
        beta: float | None = None,
        window: int | None = None,
        seed: int | None = None,
        allow_network_fs: bool | None = None,
        strict: bool | None = None,
    ) -> None:
        overrides = {
            "job_key": job_key,
            "monitor": monitor,
            "target": target,
            "batch_sizes": list(batch_sizes) if batch_sizes is not None else None,
            "default_batch_size": default_batch_size,
            "higher_is_better": higher_is_better,
            "max_epochs": max_epochs,
            "attribute": attribute,
            "eta": eta,
            "beta": beta,
            "window": window,
            "seed": seed,
            "allow_network_fs": allow_network_fs,
        }
        given = {k: v for k, v in overrides.items() if v is not None}
        super().__init__(config, strict=strict)
        if given:
            data = self.config.to_mapping()
            data["batch_size"].update(given)
            self.config = EnergyConfig.from_mapping(
                data, source=f"{type(self).__name__} arguments over {self.config.source}"
            )
        self.settings = self.config.batch_size
        self.strict = self.config.strict
        self._store_arg = store
        # The store and its database drivers load only once a callback is built: importing
        # the Lightning module (for the energy callback alone) does not load them.
        from lightning_energy.optimize.recurring import RecurringRun

        RecurringRun(self.settings)  # every required setting is there, before training
        self.batch_size: int | None = None
        self.recorded: Trial | None = None
        self.run: RecurringRun | None = None
        self._energy_cb: EnergyCallbackCore | None = None
        self._knob: BatchSizeKnob | None = None
        self._meter: EnergyMeter | None = None

    @property
    def optimizer(self) -> BatchSizeOptimizer | None:
        """The batch-size optimizer of the run in progress (rank 0; None elsewhere)."""
        return self.run.optimizer if self.run is not None else None

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Choose the batch size (rank 0), broadcast it and set it before dataloaders exist;
        record it as a decision of the energy callback's run."""
        if stage != "fit":
            return
        callbacks = trainer_callbacks(trainer)
        energy_cb = next((c for c in callbacks if isinstance(c, EnergyCallbackCore)), None)
        if energy_cb is None:
            raise ConfigError(
                "callbacks: BatchSizeCallback needs an EnergyCallback in the same Trainer "
                "(it measures the energy of the GPUs and sets their power limit)"
            )
        self._energy_cb = energy_cb
        energy_cb.setup(trainer, pl_module, stage)  # idempotent: makes sure the GPUs are open
        controller = self._join_run(energy_cb)
        self.recorded = None
        from lightning_energy.optimize.recurring import RecurringRun

        self.run = RecurringRun(self.settings, store=self._store_arg, strict=self.strict)
        gpus = controller.devices.gpus
        # Every rank builds the spec: invalid settings fail everywhere.
        spec = self.run.spec(
            gpu_model=gpus[0].name,
            gpu_count=len(gpus) * controller.collective.world_size,
            max_epochs=trainer.max_epochs,
            max_power_limit_w=max(g.power_limit_constraints_w()[1] for g in gpus),
        )
        choice: tuple[Choice, str] | None = None
        if trainer.is_global_zero:
            choice = self.run.choose(spec), self.run.reason
        chosen = trainer.strategy.broadcast(choice, src=0)
        assert chosen is not None  # rank 0 chose
        (batch_size, profile, error), reason = chosen
        if error is not None:  # raised on every rank, so no rank waits for the others
            kind, message = error
            raise ConfigError(message) if kind == "config" else StoreError(message)
        self.batch_size = batch_size
        self._set_batch_size(trainer, pl_module, batch_size)
        from lightning_energy.optimize.recurring import BatchSizeKnob

        knob = self._knob
        if knob is None or all(k is not knob for k in controller.knobs):
            knob = self._knob = BatchSizeKnob(batch_size)
            controller.add_knob(knob)  # once per controller: a later fit reuses it
        knob.batch_size = batch_size
        controller.record(knob, knob.decision(), reason)
        if profile is not None:
            energy_cb.load_state_dict(profile)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        """Start measuring the run."""
        if self.controller is None:
            return
        self._meter = EnergyMeter(self.controller.devices)
        self._meter.begin(_RUN)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None:
        """After each validation: converged, too expensive, or go on (rank 0 decides)."""
        if trainer.sanity_checking or self._meter is None:
            return
        controller = self.controller
        assert controller is not None and self.run is not None
        window = self._meter.end(_RUN)
        self._meter.begin(_RUN)
        (energy_j,), (time_s,) = controller.collective.sum_and_max(
            [window.energy_j], [window.duration_s]
        )
        self.run.add(energy_j=energy_j, time_s=time_s, epochs=trainer.current_epoch + 1)
        monitor = self.settings.monitor
        assert monitor is not None  # checked when the callback was built
        value = trainer.callback_metrics.get(monitor)
        if value is None:
            available = ", ".join(sorted(trainer.callback_metrics)) or "none"
            raise ConfigError(
                f"batch_size.monitor: {monitor!r} was not logged during validation "
                f"(logged: {available})"
            )
        verdict: Verdict | None = self.run.judge(float(value)) if trainer.is_global_zero else None
        agreed = trainer.strategy.broadcast(verdict, src=0)
        assert agreed is not None  # rank 0 judged
        if self.run.accept(agreed):
            trainer.should_stop = True

    @override
    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None:
        """Record the run and save the power-limit profile for its batch size (rank 0)."""
        energy_cb = self._energy_cb
        if self._meter is None or energy_cb is None or self.batch_size is None:
            return
        assert self.run is not None
        self._meter.cancel(_RUN)
        self._meter = None
        controller = self.controller
        power_limit_w = controller.current_power_limit_w() if controller is not None else None
        self.recorded = self.run.trial(self.batch_size, power_limit_w)
        profile = energy_cb.state_dict()
        if trainer.is_global_zero:
            self.run.record(self.recorded, profile)

    @override
    def teardown(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Close the store this callback opened and leave the energy callback's run."""
        if stage != "fit":
            return
        if self._meter is not None:
            self._meter.cancel(_RUN)
            self._meter = None
        if self.run is not None:
            self.run.close()
        self._finish()

    # ------------------------------------------------------------------ helpers
    def _set_batch_size(self, trainer: Trainer, pl_module: Module, batch_size: int) -> None:
        """Set the batch size wherever the user keeps it (datamodule, module, hparams)."""
        attribute = self.settings.attribute
        done = False
        for obj in (trainer_datamodule(trainer), pl_module):
            if obj is not None and hasattr(obj, attribute):
                setattr(obj, attribute, batch_size)
                done = True
        hparams = getattr(pl_module, "hparams", None)
        if hparams is not None and attribute in hparams:
            hparams[attribute] = batch_size
            done = True
        if not done:
            raise ConfigError(
                f"batch_size.attribute: {attribute!r} is on neither the datamodule, the "
                "LightningModule nor its hparams; keep the batch size there so the "
                "dataloaders are built with the chosen one"
            )


def batch_size_callback_class(namespace: str = "lightning.pytorch") -> type[BatchSizeCallbackCore]:
    """The batch-size callback for a Lightning namespace.

    Args:
        namespace: ``"lightning.pytorch"`` or ``"pytorch_lightning"``.

    Returns:
        The namespace module's ``BatchSizeCallback``: a subclass of
        :class:`BatchSizeCallbackCore` and of the namespace's ``Callback``.

    Raises:
        ConfigError: an unknown namespace.
    """
    if namespace not in _NAMESPACES:
        raise ConfigError(
            f"namespace: {namespace!r} is not allowed; use one of {sorted(_NAMESPACES)}"
        )
    callback: type[BatchSizeCallbackCore] = importlib.import_module(
        _NAMESPACES[namespace][1]
    ).BatchSizeCallback
    return callback


def __getattr__(name: str) -> type[BatchSizeCallbackCore]:
    for namespace, (class_name, _) in _NAMESPACES.items():
        if name == class_name:
            return batch_size_callback_class(namespace)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
