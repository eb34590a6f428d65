"""Recurring jobs: the batch-size optimizer over a job's history, and one run of the job.

:class:`BatchSizeOptimizer` applies the pure decisions of
:mod:`lightning_energy.optimize.batch_size` to a job's history in a :class:`Store`: it
reads the runs, chooses the next batch size, judges a run in flight and records it.
:class:`RecurringRun` is the batch-size optimisation of one training run, independent of
any framework: rank 0 opens the tuning store and asks the
:class:`BatchSizeOptimizer` for the batch size
(:meth:`RecurringRun.choose`); after each validation the job-wide energy and time so far
and the monitored metric give a verdict (:meth:`RecurringRun.judge`: converged, too
expensive, or go on); at the end rank 0 records the run (:meth:`RecurringRun.record`).
The adapter (``BatchSizeCallback``) only translates framework hooks into these calls and
broadcasts rank 0's answers with the framework's collectives.

Example:
    >>> store = Store.open("sqlite://")
    >>> spec = JobSpec(key="demo", gpu_model="NVIDIA A40", gpu_count=1,
    ...                default_batch_size=64, batch_sizes=(32, 64, 128),
    ...                target_metric=0.9, max_epochs=20, max_power_limit_w=300.0)
    >>> optimizer = BatchSizeOptimizer(spec, store)
    >>> optimizer.next_batch_size()
    64
    >>> _ = optimizer.record(Trial(batch_size=64, epochs=5, energy_j=9e5, time_s=3600.0,
    ...                            converged=True, started_at=0.0, finished_at=3600.0))
    >>> optimizer.next_batch_size()
    32
    >>> store.close()
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
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from lightning_energy.config import BatchSizeConfig
from lightning_energy.controller.knobs import KnobDecision
from lightning_energy.errors import ConfigError, EnergyError
from lightning_energy.numbers import is_finite
from lightning_energy.optimize.batch_size import (
    BestChoice,
    JobSpec,
    Observation,
    Trial,
    best_choice,
    is_int,
    pruning_state,
    thompson_choice,
)
from lightning_energy.optimize.cost import check_eta, zeus_cost
from lightning_energy.store import Store, TrialRecord

__all__ = ["BatchSizeKnob", "BatchSizeOptimizer", "Choice", "RecurringRun", "Verdict"]

log = logging.getLogger(__name__)

#: Rank 0's choice: the batch size, its saved power-limit profile, and an error to raise
#: on every rank (``("config" | "store", message)``) or None.
Choice = tuple[int, dict[str, Any] | None, tuple[str, str] | None]

#: Rank 0's verdict after a validation: converged, stop early, best metric so far.
Verdict = tuple[bool, bool, float | None]


class BatchSizeKnob:
    """The batch size of one run of a recurring job, as a knob of the job's controller.

    It is chosen once, before training (:meth:`RecurringRun.choose`), and recorded in the
    run's ledger as a decision (:meth:`decision`). It leaves the clocks alone, so power
    limits are profiled beside it, and it is never paced: a batch size changes what a step
    is, so no step-time frontier compares its values.

    Args:
        batch_size: the batch size of this run.

    Example:
        >>> knob = BatchSizeKnob(64)
        >>> knob.pace_frontier(), knob.decision()
        ([], KnobDecision(kind='batch_size', value=64.0, purpose='choice'))
    """

    name = "batch_size"
    holds_clocks = False

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """Nothing to pace: the batch size is fixed for the run."""
        return []

    def apply_pace(self, scale: float) -> None:
        """Nothing: the batch size is fixed for the run."""
        return None

    def decision(self) -> KnobDecision:
        """The batch size chosen, for the ledger."""
        return KnobDecision(self.name, float(self.batch_size), "choice")


#: Settings that define what a job's runs mean; a change makes old runs incomparable.
_IDENTITY_SETTINGS = ("batch_sizes", "default_batch_size", "target_metric", "higher_is_better")


class BatchSizeOptimizer:
    """Chooses each run's batch size from the job's history in a :class:`Store`.

    Args:
        job: the job.
        store: where the history lives (shared by every run of the job).
        eta: energy weight of the cost, 0 (time only) to 1 (energy only).
        beta: a run is stopped once its cost exceeds ``beta`` x the cheapest converged run.
        window: Thompson sampling uses each batch size's latest ``window`` runs (None: all).
        seed: seeds the sampling; a decision depends only on it and the history.
        pruning_rounds: rounds of the pruning phase.

    Raises:
        ConfigError: an invalid argument, or a job key already stored with other settings
            (target, batch sizes...): its runs would not be comparable, use a new key.
    """

    def __init__(
        self,
        job: JobSpec,
        store: Store,
        *,
        eta: float = 0.5,
        beta: float = 2.0,
        window: int | None = None,
        seed: int = 0,
        pruning_rounds: int = 2,
    ) -> None:
        problems = check_eta(eta)
        if not (is_finite(beta) or beta == math.inf) or not beta >= 1.0:
            problems.append(
                f"beta: {beta!r} is not allowed; use a number >= 1 (math.inf disables it)"
            )
        if window is not None and (not is_int(window) or window < 2):
            problems.append(f"window: {window!r} is not allowed; use None or an integer >= 2")
        if not is_int(seed):
            problems.append(f"seed: {seed!r} is not allowed; use an integer")
        if not is_int(pruning_rounds) or pruning_rounds < 1:
            problems.append(f"pruning_rounds: {pruning_rounds!r} is not allowed; use >= 1")
        if problems:
            raise ConfigError(problems)
        self.job = job
        self.store = store
        self.eta = float(eta)
        self.beta = float(beta)
        self.window = window
        self.seed = seed
        self.pruning_rounds = pruning_rounds
        stored = store.register_job(job.job_id, job.settings())
        fresh = job.settings()
        mismatched = [
            f"{name}: {fresh[name]!r} differs from {stored.get(name)!r} stored for job "
            f"{job.job_id} in {store.url}; use a new job key for a new setup"
            for name in _IDENTITY_SETTINGS
            if stored.get(name) != fresh[name]
        ]
        if mismatched:
            raise ConfigError(mismatched)
        self._best_cost: float | None = None
        self._best_loaded = False

    # ------------------------------------------------------------------ decisions
    def cost(self, energy_j: float, time_s: float) -> float:
        """The Zeus cost of a run (or of a run so far) of this job."""
        return zeus_cost(energy_j, time_s, eta=self.eta, max_power_w=self.job.max_power_w)

    def next_batch_size(self) -> int:
        """The batch size the next run should use."""
        trials = self.store.trials(self.job.job_id)
        observations = self._observations(trials)
        self._update_best(observations)
        state = pruning_state(
            self.job.batch_sizes,
            self.job.default_batch_size,
            observations,
            rounds=self.pruning_rounds,
        )
        if state.next_batch_size is not None:
            log.info(
                "%s: pruning round %d explores batch size %d",
                self.job.job_id,
                state.round + 1,
                state.next_batch_size,
            )
            return state.next_batch_size
        if not state.survivors:
            log.warning(
                "%s: no batch size reached the target %g during pruning; using the default %d "
                "(is the target reachable within max_epochs=%d?)",
                self.job.job_id,
                self.job.target_metric,
                self.job.default_batch_size,
                self.job.max_epochs,
            )
            return self.job.default_batch_size
        rng = np.random.default_rng([self.seed, len(trials)])
        choice = thompson_choice(state.survivors, observations, rng, window=self.window)
        log.info(
            "%s: Thompson sampling over %s chose batch size %d",
            self.job.job_id,
            list(state.survivors),
            choice,
        )
        return choice

    @property
    def phase(self) -> Literal["pruning", "thompson"]:
        """``"pruning"`` while batch sizes are being pruned, then ``"thompson"``."""
        observations = self._observations(self.store.trials(self.job.job_id))
        state = pruning_state(
            self.job.batch_sizes,
            self.job.default_batch_size,
            observations,
            rounds=self.pruning_rounds,
        )
        return "pruning" if state.next_batch_size is not None else "thompson"

    def best_cost(self) -> float | None:
        """The cost of the cheapest converged run of the job (None: none yet)."""
        if not self._best_loaded:
            self._update_best(self._observations(self.store.trials(self.job.job_id)))
        return self._best_cost

    def should_stop_early(self, cost_so_far: float, *, epochs: int = 0) -> bool:
        """Whether a run that has not reached the target yet should stop now.

        Call it after each epoch's validation, once the metric has been checked.

        Args:
            cost_so_far: the run's cost up to now (:meth:`cost` of its energy and time).
            epochs: epochs completed.

        Returns:
            True when ``epochs >= max_epochs`` or the cost exceeds ``beta`` x the cheapest
            converged run known when the run's batch size was chosen (or recorded since).
        """
        if epochs >= self.job.max_epochs:
            return True
        best = self.best_cost()
        return best is not None and cost_so_far > self.beta * best

    def best(self) -> BestChoice | None:
        """The cheapest batch size so far (by mean cost of its converged runs)."""
        return best_choice(
            self.store.trials(self.job.job_id),
            cost=lambda trial: self.cost(trial.energy_j, trial.time_s),
        )

    # ------------------------------------------------------------------ recording
    def record(self, trial: Trial) -> TrialRecord:
        """Store a finished run (converged, stopped early or at ``max_epochs``).

        Returns:
            The stored record, with its cost and database id.

        Raises:
            ConfigError: a batch size outside the job's, or negative measurements.
            StoreError: the store failed.
        """
        problems = []
        if trial.batch_size not in self.job.batch_sizes:
            problems.append(
                f"batch_size: {trial.batch_size!r} is not one of the job's batch sizes "
                f"{list(self.job.batch_sizes)}"
            )
        for name in ("energy_j", "time_s", "epochs"):
            value = getattr(trial, name)
            if not is_finite(value) or value < 0:
                problems.append(f"{name}: {value!r} is not allowed; use a finite number >= 0")
        if problems:
            raise ConfigError(problems)
        cost = self.cost(trial.energy_j, trial.time_s)
        stored = self.store.add_trial(
            TrialRecord(
                job=self.job.job_id,
                batch_size=trial.batch_size,
                power_limit_w=trial.power_limit_w,
                epochs=trial.epochs,
                energy_j=trial.energy_j,
                time_s=trial.time_s,
                cost=cost,
                eta=self.eta,
                converged=trial.converged,
                started_at=trial.started_at,
                finished_at=trial.finished_at,
                metric=trial.metric,
            )
        )
        if trial.converged and (self._best_cost is None or cost < self._best_cost):
            self._best_cost = cost
        log.info(
            "%s: recorded batch size %d, %d epochs, %.0f J, %.0f s, cost %.0f, %s",
            self.job.job_id,
            trial.batch_size,
            trial.epochs,
            trial.energy_j,
            trial.time_s,
            cost,
            "converged" if trial.converged else "not converged",
        )
        return stored

    # ------------------------------------------------------------------ power profiles
    def load_power_profile(self, batch_size: int) -> dict[str, Any] | None:
        """The power-limit optimizer's saved state for this job at ``batch_size``."""
        return self.store.load_power_profile(self.job.job_id, batch_size)

    def save_power_profile(self, batch_size: int, state: dict[str, Any]) -> None:
        """Save the power-limit optimizer's state so later runs skip profiling."""
        self.store.save_power_profile(self.job.job_id, batch_size, state)

    # ------------------------------------------------------------------ helpers
    def _observations(self, trials: Sequence[TrialRecord]) -> list[Observation]:
        sizes = set(self.job.batch_sizes)
        return [
            Observation(t.batch_size, self.cost(t.energy_j, t.time_s), t.converged)
            for t in trials
            if t.batch_size in sizes
        ]

    def _update_best(self, observations: Sequence[Observation]) -> None:
        converged = [o.cost for o in observations if o.converged]
        self._best_cost = min(converged) if converged else None
        self._best_loaded = True


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
        #: Rank 0, after :meth:`choose`: why the run uses its batch size.
        self.reason = "the default batch size"
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
            self.reason = "the default batch size: the tuning store is unavailable"
            return self.default_batch_size, None, None
        self.reason = f"the next batch size of the search over the history of {spec.job_id}"
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
