"""Batch-size optimisation across recurring Lightning runs (companion of ``EnergyCallback``).

Add it next to the energy callback; every run of the job then uses the batch size the
history suggests, stops once the target is reached (or once it costs too much), and records
itself::

    from lightning.pytorch import Trainer
    from lightning_energy.integrations.batch_size import BatchSizeCallback
    from lightning_energy.integrations.lightning import EnergyCallback

    trainer = Trainer(
        max_epochs=30,
        callbacks=[
            EnergyCallback(power_limit={"selector": "cost", "eta": 0.5}),
            BatchSizeCallback("resnet50-imagenet", monitor="val_acc", target=0.65,
                              batch_sizes=[64, 128, 256, 512], default_batch_size=256),
        ],
    )
    trainer.fit(model, datamodule=datamodule)   # datamodule.batch_size is set for you

For ``pytorch_lightning``, use ``PLBatchSizeCallback`` (or
``batch_size_callback_class("pytorch_lightning")``); importing this module imports neither
namespace until one of the classes is used.

What happens in a run: at ``setup`` (before the dataloaders are built) rank 0 opens the
store, asks :class:`~lightning_energy.optimize.batch_size.BatchSizeOptimizer` for the batch
size and loads the power-limit profile saved for it; both are broadcast with the strategy's
collectives and every rank sets ``batch_size`` on the datamodule, the module or its
``hparams``. After each validation, the job-wide energy (summed over ranks) and time (the
slowest rank's) are compared with the target and the early-stopping bound, and rank 0's
verdict is broadcast; the Trainer stops when the target is reached or the run is stopped
early. When training ends, rank 0 records the run and saves the power-limit profile for the
batch size, so the next run with it skips profiling. Only rank 0 talks to the store.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from lightning_energy.errors import ConfigError, EnergyError, StoreError
from lightning_energy.integrations._lightning_core import EnergyCallbackCore
from lightning_energy.measure import EnergyMeter
from lightning_energy.optimize.batch_size import BatchSizeOptimizer, JobSpec, Trial
from lightning_energy.store import Store

# ``BatchSizeCallback`` (lightning.pytorch) and ``PLBatchSizeCallback`` (pytorch_lightning)
# are built on first access by the module ``__getattr__`` below.
__all__ = ["BatchSizeCallbackCore", "batch_size_callback_class"]

log = logging.getLogger(__name__)

_RUN = "batch-size-run"
_CLASS_NAMES = {
    "lightning.pytorch": "BatchSizeCallback",
    "pytorch_lightning": "PLBatchSizeCallback",
}


class BatchSizeCallbackCore:
    """Chooses each run's batch size from the job's history; see the module docstring.

    Args:
        job_key: the name of the recurring job (with the GPU model and count, its identity).
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
        strict: raise when the store fails instead of training with the default batch size.

    Raises:
        ConfigError: invalid arguments (checked again against the GPUs at ``setup``).
    """

    def __init__(
        self,
        job_key: str,
        *,
        monitor: str,
        target: float,
        batch_sizes: Sequence[int],
        default_batch_size: int,
        higher_is_better: bool = True,
        max_epochs: int | None = None,
        attribute: str = "batch_size",
        store: str | Store | None = None,
        eta: float = 0.5,
        beta: float = 2.0,
        window: int | None = None,
        seed: int = 0,
        allow_network_fs: bool = False,
        strict: bool = False,
    ) -> None:
        problems = []
        if not isinstance(monitor, str) or not monitor:
            problems.append(f"monitor: {monitor!r} is not allowed; name a logged metric")
        if not isinstance(attribute, str) or not attribute.isidentifier():
            problems.append(f"attribute: {attribute!r} is not allowed; give an attribute name")
        if problems:
            raise ConfigError(problems)
        # Validate the job fields now (placeholders for what only setup knows).
        JobSpec(
            key=job_key,
            gpu_model="(checked at setup)",
            gpu_count=1,
            default_batch_size=default_batch_size,
            batch_sizes=tuple(batch_sizes),
            target_metric=target,
            higher_is_better=higher_is_better,
            max_epochs=max_epochs if max_epochs is not None else 1,
            max_power_limit_w=1.0,
        )
        self.job_key = job_key
        self.monitor = monitor
        self.target = float(target)
        self.batch_sizes = tuple(batch_sizes)
        self.default_batch_size = default_batch_size
        self.higher_is_better = higher_is_better
        self.max_epochs = max_epochs
        self.attribute = attribute
        self.eta = eta
        self.beta = beta
        self.window = window
        self.seed = seed
        self.allow_network_fs = allow_network_fs
        self.strict = strict
        self._store_arg = store
        self.batch_size: int | None = None
        self.optimizer: BatchSizeOptimizer | None = None
        self.recorded: Trial | None = None
        self._energy_cb: EnergyCallbackCore | None = None
        self._meter: EnergyMeter | None = None
        self._store: Store | None = None
        self._owns_store = False
        self._energy_j = 0.0
        self._time_s = 0.0
        self._epochs = 0
        self._best_metric: float | None = None
        self._converged = False
        self._started_at = 0.0

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Choose the batch size (rank 0), broadcast it and set it before dataloaders exist."""
        if stage != "fit":
            return
        energy_cb = next((c for c in trainer.callbacks if isinstance(c, EnergyCallbackCore)), None)
        if energy_cb is None:
            raise ConfigError(
                "callbacks: BatchSizeCallback needs an EnergyCallback in the same Trainer "
                "(it measures the energy of the GPUs and sets their power limit)"
            )
        self._energy_cb = energy_cb
        energy_cb.setup(trainer, pl_module, stage)  # idempotent: makes sure the GPUs are open
        controller = energy_cb.controller
        assert controller is not None
        self._reset_run()
        spec = self._spec(trainer, controller)  # every rank: invalid settings fail everywhere
        choice: tuple[int, dict[str, Any] | None, tuple[str, str] | None] | None = None
        if trainer.is_global_zero:
            choice = self._choose(spec)
        batch_size, profile, error = trainer.strategy.broadcast(choice, src=0)
        if error is not None:  # raised on every rank, so no rank waits for the others
            kind, message = error
            raise ConfigError(message) if kind == "config" else StoreError(message)
        self.batch_size = batch_size
        self._set_batch_size(trainer, pl_module, batch_size)
        if profile is not None:
            energy_cb.load_state_dict(profile)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start measuring the run."""
        if self._energy_cb is None or self._energy_cb.controller is None:
            return
        self._meter = EnergyMeter(self._energy_cb.controller.devices)
        self._meter.begin(_RUN)
        self._started_at = time.time()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """After each validation: converged, too expensive, or go on (rank 0 decides)."""
        if trainer.sanity_checking or self._meter is None or self._energy_cb is None:
            return
        controller = self._energy_cb.controller
        assert controller is not None
        window = self._meter.end(_RUN)
        self._meter.begin(_RUN)
        (energy_j,), (time_s,) = controller.collective.sum_and_max(
            [window.energy_j], [window.duration_s]
        )
        self._energy_j += energy_j
        self._time_s += time_s
        self._epochs = trainer.current_epoch + 1
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            available = ", ".join(sorted(trainer.callback_metrics)) or "none"
            raise ConfigError(
                f"monitor: {self.monitor!r} was not logged during validation (logged: {available})"
            )
        verdict: tuple[bool, bool, float | None] | None = None
        if trainer.is_global_zero:
            verdict = self._judge(float(value))
        converged, stop, metric = trainer.strategy.broadcast(verdict, src=0)
        if metric is not None:
            self._best_metric = metric
        if converged:
            self._converged = True
        if converged or stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Record the run and save the power-limit profile for its batch size (rank 0)."""
        if self._meter is None or self._energy_cb is None or self.batch_size is None:
            return
        self._meter.cancel(_RUN)
        self._meter = None
        trial = Trial(
            batch_size=self.batch_size,
            epochs=self._epochs,
            energy_j=self._energy_j,
            time_s=self._time_s,
            converged=self._converged,
            started_at=self._started_at,
            finished_at=time.time(),
            power_limit_w=self._current_power_limit_w(),
            metric=self._best_metric,
        )
        self.recorded = trial
        profile = self._energy_cb.state_dict()
        if not trainer.is_global_zero or self.optimizer is None:
            return
        try:
            self.optimizer.record(trial)
            if profile:
                profile = {k: v for k, v in profile.items() if k not in ("steps", "energy_j")}
                self.optimizer.save_power_profile(self.batch_size, profile)
        except EnergyError as exc:
            if self.strict:
                raise
            log.warning("could not record the run in the tuning store: %s", exc)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Close the store this callback opened."""
        if stage != "fit":
            return
        if self._meter is not None:
            self._meter.cancel(_RUN)
            self._meter = None
        if self._store is not None and self._owns_store:
            self._store.close()
        self._store = None
        self.optimizer = None

    # ------------------------------------------------------------------ helpers
    def _reset_run(self) -> None:
        self._energy_j = self._time_s = 0.0
        self._epochs = 0
        self._best_metric = None
        self._converged = False
        self.recorded = None

    def _spec(self, trainer: Any, controller: Any) -> JobSpec:
        """The job as this Trainer runs it (GPU model and count from the open GPUs)."""
        gpus = controller.devices.gpus
        max_epochs = self.max_epochs or trainer.max_epochs
        if max_epochs is None or max_epochs < 1:
            raise ConfigError(
                "max_epochs: the Trainer runs without an epoch limit; give BatchSizeCallback "
                "max_epochs (a run not converged by then has failed)"
            )
        return JobSpec(
            key=self.job_key,
            gpu_model=gpus[0].name,
            gpu_count=len(gpus) * controller.collective.world_size,
            default_batch_size=self.default_batch_size,
            batch_sizes=self.batch_sizes,
            target_metric=self.target,
            higher_is_better=self.higher_is_better,
            max_epochs=max_epochs,
            max_power_limit_w=max(g.power_limit_constraints_w()[1] for g in gpus),
        )

    def _choose(self, spec: JobSpec) -> tuple[int, dict[str, Any] | None, tuple[str, str] | None]:
        """Rank 0: the batch size for this run, its saved power-limit profile, or an error."""
        try:
            if isinstance(self._store_arg, Store):
                self._store, self._owns_store = self._store_arg, False
            else:
                self._store = Store.open(self._store_arg, allow_network_fs=self.allow_network_fs)
                self._owns_store = True
            self.optimizer = BatchSizeOptimizer(
                spec, self._store, eta=self.eta, beta=self.beta, window=self.window, seed=self.seed
            )
            batch_size = self.optimizer.next_batch_size()
            profile = self.optimizer.load_power_profile(batch_size)
        except ConfigError as exc:
            return self.default_batch_size, None, ("config", "; ".join(exc.problems))
        except EnergyError as exc:
            if self.strict:
                return self.default_batch_size, None, ("store", f"tuning store unavailable: {exc}")
            log.warning(
                "tuning store unavailable (%s); this run uses the default batch size %d and "
                "is not recorded",
                exc,
                self.default_batch_size,
            )
            self.optimizer = None
            return self.default_batch_size, None, None
        log.info("%s: run with batch size %d", spec.job_id, batch_size)
        return batch_size, profile, None

    def _judge(self, metric: float) -> tuple[bool, bool, float | None]:
        """Rank 0: (converged, stop early, best metric so far)."""
        best = self._best_metric
        if best is None or (metric > best if self.higher_is_better else metric < best):
            best = metric
        reached = math.isfinite(metric) and (
            metric >= self.target if self.higher_is_better else metric <= self.target
        )
        if reached or self.optimizer is None:
            return reached, False, best
        cost = self.optimizer.cost(self._energy_j, self._time_s)
        stop = self.optimizer.should_stop_early(cost, epochs=self._epochs)
        if stop:
            log.info(
                "stopping the run: %s = %g after %d epochs has not reached %g and costs %.0f J "
                "(best run: %s J)",
                self.monitor,
                metric,
                self._epochs,
                self.target,
                cost,
                self.optimizer.best_cost(),
            )
        return False, stop, best

    def _set_batch_size(self, trainer: Any, pl_module: Any, batch_size: int) -> None:
        """Set the batch size wherever the user keeps it (datamodule, module, hparams)."""
        targets = [trainer.datamodule, pl_module]
        done = False
        for obj in targets:
            if obj is not None and hasattr(obj, self.attribute):
                setattr(obj, self.attribute, batch_size)
                done = True
        hparams = getattr(pl_module, "hparams", None)
        if hparams is not None and self.attribute in hparams:
            hparams[self.attribute] = batch_size
            done = True
        if not done:
            raise ConfigError(
                f"attribute: {self.attribute!r} is on neither the datamodule, the "
                "LightningModule nor its hparams; keep the batch size there so the "
                "dataloaders are built with the chosen one"
            )

    def _current_power_limit_w(self) -> float | None:
        controller = self._energy_cb.controller if self._energy_cb is not None else None
        return controller.current_power_limit_w() if controller is not None else None


@functools.cache
def batch_size_callback_class(namespace: str = "lightning.pytorch") -> type[BatchSizeCallbackCore]:
    """The batch-size callback for a Lightning namespace.

    Args:
        namespace: ``"lightning.pytorch"`` or ``"pytorch_lightning"``.

    Returns:
        A subclass of :class:`BatchSizeCallbackCore` and of the namespace's ``Callback``.

    Raises:
        ConfigError: an unknown namespace.
    """
    if namespace not in _CLASS_NAMES:
        raise ConfigError(
            f"namespace: {namespace!r} is not allowed; use one of {sorted(_CLASS_NAMES)}"
        )
    callback_base = importlib.import_module(f"{namespace}.callbacks").Callback
    name = _CLASS_NAMES[namespace]
    return type(
        name,
        (BatchSizeCallbackCore, callback_base),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"Batch-size optimisation for ``{namespace}``; see "
            ":class:`BatchSizeCallbackCore` for the arguments.",
        },
    )


def __getattr__(name: str) -> type[BatchSizeCallbackCore]:
    for namespace, class_name in _CLASS_NAMES.items():
        if name == class_name:
            return batch_size_callback_class(namespace)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
