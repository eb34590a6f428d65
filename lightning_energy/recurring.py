"""One run of a recurring job: its batch size, its verdicts, its record in the history.

:class:`RecurringRun` is the batch-size optimisation of one training run, independent of
any framework: rank 0 opens the tuning store and asks the
:class:`~lightning_energy.optimize.batch_size.BatchSizeOptimizer` for the batch size
(:meth:`RecurringRun.choose`); after each validation the job-wide energy and time so far
and the monitored metric give a verdict (:meth:`RecurringRun.judge`: converged, too
expensive, or go on); at the end rank 0 records the run (:meth:`RecurringRun.record`).
The adapter (``BatchSizeCallback``) only translates framework hooks into these calls and
broadcasts rank 0's answers with the framework's collectives.

Example:
    >>> from lightning_energy.config import BatchSizeConfig
    >>> settings = BatchSizeConfig(job_key="demo", monitor="val_acc", target=0.9,
    ...                            batch_sizes=(32, 64), default_batch_size=64)
    >>> run = RecurringRun(settings, store="sqlite://")
    >>> spec = run.spec(gpu_model="NVIDIA A40", gpu_count=1, max_epochs=10,
    ...                 max_power_limit_w=300.0)
    >>> run.choose(spec)
    (64, None, None)
    >>> run.add(energy_j=1e5, time_s=600.0, epochs=1)
    >>> run.judge(0.95)
    (True, False, 0.95)
    >>> run.close()
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from lightning_energy.config import BatchSizeConfig
from lightning_energy.errors import ConfigError, EnergyError
from lightning_energy.optimize.batch_size import BatchSizeOptimizer, JobSpec, Trial
from lightning_energy.store import Store

__all__ = ["Choice", "RecurringRun", "Verdict"]

log = logging.getLogger(__name__)

#: Rank 0's choice: the batch size, its saved power-limit profile, and an error to raise
#: on every rank (``("config" | "store", message)``) or None.
Choice = tuple[int, dict[str, Any] | None, tuple[str, str] | None]

#: Rank 0's verdict after a validation: converged, stop early, best metric so far.
Verdict = tuple[bool, bool, float | None]


class RecurringRun:
    """The batch-size optimisation of one run of a recurring job.

    Args:
        settings: the ``batch_size:`` section, with ``job_key``, ``monitor``, ``target``,
            ``batch_sizes`` and ``default_batch_size`` set.
        store: a store URL or an open :class:`Store` (None: ``LIGHTNING_ENERGY_STORE_URL``,
            else SQLite in the user's data directory); only rank 0 opens it.
        strict: raise when the store fails instead of training with the default batch size.

    Raises:
        ConfigError: a required setting is missing.
    """

    def __init__(
        self, settings: BatchSizeConfig, *, store: str | Store | None = None, strict: bool = False
    ) -> None:
        missing = [
            key
            for key in ("job_key", "monitor", "target", "batch_sizes", "default_batch_size")
            if getattr(settings, key) is None
        ]
        if missing:
            raise ConfigError(
                [
                    f"batch_size.{key}: missing; set it in the batch_size: section (or as "
                    "the callback's argument of that name)"
                    for key in missing
                ]
            )
        self.settings = settings
        self.strict = strict
        self.optimizer: BatchSizeOptimizer | None = None
        self._store_arg = store
        self._store: Store | None = None
        self._owns_store = False
        self.energy_j = 0.0
        self.time_s = 0.0
        self.epochs = 0
        self.best_metric: float | None = None
        self.converged = False
        self.started_at = time.time()

    @property
    def default_batch_size(self) -> int:
        """The batch size used when the history cannot be read."""
        assert self.settings.default_batch_size is not None
        return self.settings.default_batch_size

    def spec(
        self, *, gpu_model: str, gpu_count: int, max_epochs: int | None, max_power_limit_w: float
    ) -> JobSpec:
        """The job as this run trains it.

        Args:
            gpu_model: the GPUs' model name.
            gpu_count: GPUs of the whole job.
            max_epochs: the framework's epoch limit (``batch_size.max_epochs`` wins).
            max_power_limit_w: the highest power limit of one GPU.

        Raises:
            ConfigError: no epoch limit, or invalid job settings.
        """
        s = self.settings
        epochs = s.max_epochs or max_epochs
        if epochs is None or epochs < 1:
            raise ConfigError(
                "batch_size.max_epochs: missing while the trainer runs without an epoch limit; "
                "give it (a run not converged by then has failed)"
            )
        assert s.job_key is not None and s.batch_sizes is not None and s.target is not None
        return JobSpec(
            key=s.job_key,
            gpu_model=gpu_model,
            gpu_count=gpu_count,
            default_batch_size=self.default_batch_size,
            batch_sizes=s.batch_sizes,
            target_metric=s.target,
            higher_is_better=s.higher_is_better,
            max_epochs=epochs,
            max_power_limit_w=max_power_limit_w,
        )

    def choose(self, spec: JobSpec) -> Choice:
        """Rank 0: the batch size for this run, its saved power-limit profile, or an error."""
        s = self.settings
        try:
            if isinstance(self._store_arg, Store):
                self._store, self._owns_store = self._store_arg, False
            else:
                self._store = Store.open(self._store_arg, allow_network_fs=s.allow_network_fs)
                self._owns_store = True
            self.optimizer = BatchSizeOptimizer(
                spec, self._store, eta=s.eta, beta=s.beta, window=s.window, seed=s.seed
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

    def add(self, *, energy_j: float, time_s: float, epochs: int) -> None:
        """Count the job-wide energy and time since the last validation; epochs done."""
        self.energy_j += energy_j
        self.time_s += time_s
        self.epochs = epochs

    def judge(self, metric: float) -> Verdict:
        """Rank 0: (converged, stop early, best metric so far) after a validation."""
        s = self.settings
        assert s.target is not None
        best = self.best_metric
        if best is None or (metric > best if s.higher_is_better else metric < best):
            best = metric
        reached = math.isfinite(metric) and (
            metric >= s.target if s.higher_is_better else metric <= s.target
        )
        if reached or self.optimizer is None:
            return reached, False, best
        cost = self.optimizer.cost(self.energy_j, self.time_s)
        stop = self.optimizer.should_stop_early(cost, epochs=self.epochs)
        if stop:
            log.info(
                "stopping the run: %s = %g after %d epochs has not reached %g and costs %.0f J "
                "(best run: %s J)",
                s.monitor,
                metric,
                self.epochs,
                s.target,
                cost,
                self.optimizer.best_cost(),
            )
        return False, stop, best

    def accept(self, verdict: Verdict) -> bool:
        """Take rank 0's verdict (every rank); True when the run must stop."""
        converged, stop, metric = verdict
        if metric is not None:
            self.best_metric = metric
        if converged:
            self.converged = True
        return converged or stop

    def trial(self, batch_size: int, power_limit_w: float | None) -> Trial:
        """The run as the history records it."""
        return Trial(
            batch_size=batch_size,
            epochs=self.epochs,
            energy_j=self.energy_j,
            time_s=self.time_s,
            converged=self.converged,
            started_at=self.started_at,
            finished_at=time.time(),
            power_limit_w=power_limit_w,
            metric=self.best_metric,
        )

    def record(self, trial: Trial, profile: dict[str, Any] | None) -> None:
        """Rank 0: record the run and the power-limit profile of its batch size.

        A store failure is logged (strict mode: raised); training has ended either way.
        """
        if self.optimizer is None:
            return
        try:
            self.optimizer.record(trial)
            if profile:
                kept = {k: v for k, v in profile.items() if k not in ("steps", "energy_j")}
                self.optimizer.save_power_profile(trial.batch_size, kept)
        except EnergyError as exc:
            if self.strict:
                raise
            log.warning("could not record the run in the tuning store: %s", exc)

    def close(self) -> None:
        """Close the store this run opened."""
        if self._store is not None and self._owns_store:
            self._store.close()
        self._store = None
        self.optimizer = None
