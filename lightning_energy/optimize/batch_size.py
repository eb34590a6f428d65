"""Batch-size optimisation across recurring runs of a training job (Zeus, NSDI'23 §4.3).

A recurring job (the same model retrained on fresh data, a nightly fine-tune...) is
identified by a user-given key plus the GPU model and count. Every run reports its energy,
time and whether it reached the target metric; the next run's batch size is chosen from
that history:

1. **Pruning.** Starting at the default batch size, explore downwards, then upwards, and
   stop a direction at the first batch size that fails to reach the target. The survivors
   are explored the same way a second time, starting from the cheapest one, so each
   survivor has two observations and a variance estimate.
2. **Gaussian Thompson sampling** over the survivors: each batch size's run cost
   (``eta * E + (1 - eta) * P_max * T`` of a whole run to the target, see
   :func:`~lightning_energy.optimize.cost.zeus_cost`) is modelled as Gaussian with the
   sample variance of its observations; a mean cost is sampled from each posterior and
   the cheapest sample wins. ``window`` limits each batch size to its latest observations
   for workloads that drift.
3. **Early stopping** inside a run: once its cost so far exceeds ``beta`` x the cheapest
   converged run of the job (or it reaches ``max_epochs``), it is stopped and recorded as
   not converged, so a bad batch size costs at most ``beta`` x the best run.

The decisions are pure functions of the stored runs (:func:`pruning_state`,
:func:`thompson_choice`), so several processes sharing one store agree, a crash loses at
most the run in flight, and any decision can be replayed. Runs launched concurrently may
explore the same batch size; the extra result is kept as an ordinary observation.

Example:
    >>> from lightning_energy.store import Store
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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lightning_energy.errors import ConfigError
from lightning_energy.optimize.cost import check_eta, zeus_cost
from lightning_energy.store import JobId, Store, TrialRecord

__all__ = [
    "BatchSizeOptimizer",
    "BestChoice",
    "JobSpec",
    "Observation",
    "PruningState",
    "Trial",
    "best_choice",
    "pruning_state",
    "thompson_choice",
]

log = logging.getLogger(__name__)

#: Settings that define what a job's runs mean; a change makes old runs incomparable.
_IDENTITY_SETTINGS = ("batch_sizes", "default_batch_size", "target_metric", "higher_is_better")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A recurring training job, as its user describes it.

    Attributes:
        key: the user's name for the job (e.g. ``"resnet50-imagenet"``).
        gpu_model: the GPU model name (as NVML reports it).
        gpu_count: GPUs of the whole job (every rank of every node).
        default_batch_size: the batch size the user would use; exploration starts there.
        batch_sizes: every batch size allowed (stored sorted).
        target_metric: the validation metric value that counts as converged.
        max_epochs: a run that has not converged after this many epochs has failed.
        max_power_limit_w: the highest power limit of one GPU (for the cost).
        higher_is_better: True for accuracy-like metrics, False for losses/error rates.

    Raises:
        ConfigError: every invalid field at once.
    """

    key: str
    gpu_model: str
    gpu_count: int
    default_batch_size: int
    batch_sizes: tuple[int, ...]
    target_metric: float
    max_epochs: int
    max_power_limit_w: float
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.key, str) or not self.key.strip():
            problems.append(f"key: {self.key!r} is not allowed; give a non-empty name")
        if not isinstance(self.gpu_model, str) or not self.gpu_model.strip():
            problems.append(f"gpu_model: {self.gpu_model!r} is not allowed; give the model name")
        if not _is_int(self.gpu_count) or self.gpu_count < 1:
            problems.append(f"gpu_count: {self.gpu_count!r} is not allowed; use an integer >= 1")
        sizes = tuple(self.batch_sizes) if not isinstance(self.batch_sizes, (str, bytes)) else ()
        if not sizes or not all(_is_int(b) and b > 0 for b in sizes):
            problems.append(
                f"batch_sizes: {self.batch_sizes!r} is not allowed; give positive integers"
            )
        elif len(set(sizes)) != len(sizes):
            problems.append(f"batch_sizes: {self.batch_sizes!r} has duplicates")
        if self.default_batch_size not in sizes:
            problems.append(
                f"default_batch_size: {self.default_batch_size!r} is not allowed; "
                f"use one of batch_sizes {sorted(b for b in sizes if _is_int(b))}"
            )
        if not _is_number(self.target_metric) or not math.isfinite(self.target_metric):
            problems.append(f"target_metric: {self.target_metric!r} is not allowed; use a number")
        if not _is_int(self.max_epochs) or self.max_epochs < 1:
            problems.append(f"max_epochs: {self.max_epochs!r} is not allowed; use an integer >= 1")
        if not _is_number(self.max_power_limit_w) or not self.max_power_limit_w > 0:
            problems.append(
                f"max_power_limit_w: {self.max_power_limit_w!r} is not allowed; use watts > 0"
            )
        if problems:
            raise ConfigError(problems)
        object.__setattr__(self, "batch_sizes", tuple(sorted(sizes)))

    @property
    def job_id(self) -> JobId:
        """The store's identity of this job."""
        return JobId(self.key, self.gpu_model, self.gpu_count)

    @property
    def max_power_w(self) -> float:
        """Highest power limit x GPUs of the job: the cost's price of one second."""
        return self.max_power_limit_w * self.gpu_count

    def reached(self, metric: float) -> bool:
        """Whether a validation metric value meets the target."""
        if self.higher_is_better:
            return metric >= self.target_metric
        return metric <= self.target_metric

    def settings(self) -> dict[str, Any]:
        """The job's settings as the store keeps them."""
        return {
            "batch_sizes": list(self.batch_sizes),
            "default_batch_size": self.default_batch_size,
            "target_metric": self.target_metric,
            "higher_is_better": self.higher_is_better,
            "max_epochs": self.max_epochs,
            "max_power_limit_w": self.max_power_limit_w,
        }


@dataclass(frozen=True, kw_only=True)
class Trial:
    """What one run measured, handed to :meth:`BatchSizeOptimizer.record`.

    Attributes:
        batch_size: the batch size used.
        epochs: epochs run.
        energy_j: energy of every GPU of the job together.
        time_s: wall-clock time of the run.
        converged: True when the run reached the target metric.
        started_at: start time, Unix seconds.
        finished_at: end time, Unix seconds.
        power_limit_w: the power limit per GPU the run ended with (None: unchanged).
        metric: the best validation metric reached (None when unknown).
    """

    batch_size: int
    epochs: int
    energy_j: float
    time_s: float
    converged: bool
    started_at: float
    finished_at: float
    power_limit_w: float | None = None
    metric: float | None = None


@dataclass(frozen=True)
class Observation:
    """A run as the decision functions see it."""

    batch_size: int
    cost: float
    converged: bool


@dataclass(frozen=True)
class PruningState:
    """Where the pruning phase stands after replaying the observations.

    Attributes:
        next_batch_size: the batch size to explore next; None once pruning is over.
        survivors: the batch sizes still in the running (the bandit's arms when over).
        round: the pruning round in progress (0-based; ``rounds`` when over).
    """

    next_batch_size: int | None
    survivors: tuple[int, ...]
    round: int


@dataclass(frozen=True)
class BestChoice:
    """The cheapest configuration found so far.

    Attributes:
        batch_size: the batch size with the lowest mean cost over its converged runs.
        power_limit_w: the power limit of its latest converged run (None: unchanged).
        mean_cost: mean cost of its converged runs.
        mean_energy_j: mean energy of those runs.
        mean_time_s: mean time of those runs.
        runs: how many converged runs the means are over.
    """

    batch_size: int
    power_limit_w: float | None
    mean_cost: float
    mean_energy_j: float
    mean_time_s: float
    runs: int

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for ``--json``)."""
        return {
            "batch_size": self.batch_size,
            "power_limit_w": self.power_limit_w,
            "mean_cost": self.mean_cost,
            "mean_energy_j": self.mean_energy_j,
            "mean_time_s": self.mean_time_s,
            "runs": self.runs,
        }


def pruning_state(
    batch_sizes: Sequence[int],
    default_batch_size: int,
    observations: Sequence[Observation],
    *,
    rounds: int = 2,
) -> PruningState:
    """Replay the pruning phase over the observations, in the order they were recorded.

    Each round walks down from its start batch size (the default in the first round, the
    cheapest converged batch size of the previous round after that), then up from the one
    above it; a direction ends at the first batch size that does not converge. Only the
    batch sizes that converged in a round take part in the next. An observation of a batch
    size other than the one expected (a concurrent run) is skipped here; it still counts
    for Thompson sampling.

    Args:
        batch_sizes: the allowed batch sizes.
        default_batch_size: where the first round starts.
        observations: the job's runs, oldest first.
        rounds: how many pruning rounds.

    Returns:
        The batch size to explore next, or the survivors when pruning is over.
    """
    candidates = sorted(set(batch_sizes))
    start = default_batch_size
    position = 0
    for round_index in range(rounds):
        good: list[int] = []
        cheapest, cheapest_cost = start, math.inf
        index = candidates.index(start)
        for direction in (candidates[index::-1], candidates[index + 1 :]):
            for batch_size in direction:
                match = next(
                    (
                        k
                        for k in range(position, len(observations))
                        if observations[k].batch_size == batch_size
                    ),
                    None,
                )
                if match is None:
                    return PruningState(batch_size, tuple(candidates), round_index)
                position = match + 1
                observation = observations[match]
                if not observation.converged:
                    break
                good.append(batch_size)
                if observation.cost < cheapest_cost:
                    cheapest, cheapest_cost = batch_size, observation.cost
        candidates = sorted(good)
        if not candidates:
            return PruningState(None, (), rounds)
        start = cheapest
    return PruningState(None, tuple(candidates), rounds)


def thompson_choice(
    arms: Sequence[int],
    observations: Sequence[Observation],
    rng: np.random.Generator,
    *,
    window: int | None = None,
) -> int:
    """Gaussian Thompson sampling: the arm whose sampled mean cost is lowest.

    Each arm's mean cost has a flat prior; with ``n`` observations of sample variance
    ``s2`` its posterior is ``N(mean, s2 / n)`` (reward = -cost). An arm with fewer than
    two observations (in the window) is pulled first, fewest observations first; an arm
    whose observations are all equal is sampled at its mean.

    Args:
        arms: candidate batch sizes.
        observations: the job's runs, oldest first (other batch sizes are ignored).
        rng: the random generator (seeded by the caller for reproducibility).
        window: use only each arm's latest ``window`` observations (None: all).

    Returns:
        The chosen batch size.
    """
    costs: dict[int, list[float]] = {arm: [] for arm in sorted(set(arms))}
    for observation in observations:
        if observation.batch_size in costs:
            costs[observation.batch_size].append(observation.cost)
    if window is not None:
        costs = {arm: values[-window:] for arm, values in costs.items()}
    unexplored = [arm for arm, values in costs.items() if len(values) < 2]
    if unexplored:
        return min(unexplored, key=lambda arm: (len(costs[arm]), arm))
    samples: dict[int, float] = {}
    for arm, values in costs.items():
        array = np.asarray(values, dtype=float)
        mean, variance = float(array.mean()), float(array.var())
        samples[arm] = (
            mean if variance == 0.0 else float(rng.normal(mean, math.sqrt(variance / array.size)))
        )
    return min(samples, key=lambda arm: samples[arm])


def best_choice(
    trials: Sequence[TrialRecord], cost: Callable[[TrialRecord], float] | None = None
) -> BestChoice | None:
    """The batch size with the lowest mean cost over its converged runs (None: none yet).

    Args:
        trials: a job's runs.
        cost: how to score a run (default: the cost stored with it).
    """
    score = cost or (lambda trial: trial.cost)
    by_size: dict[int, list[TrialRecord]] = {}
    for trial in trials:
        if trial.converged:
            by_size.setdefault(trial.batch_size, []).append(trial)
    if not by_size:
        return None
    choices = [
        BestChoice(
            batch_size=size,
            power_limit_w=runs[-1].power_limit_w,
            mean_cost=float(np.mean([score(t) for t in runs])),
            mean_energy_j=float(np.mean([t.energy_j for t in runs])),
            mean_time_s=float(np.mean([t.time_s for t in runs])),
            runs=len(runs),
        )
        for size, runs in by_size.items()
    ]
    return min(choices, key=lambda choice: (choice.mean_cost, choice.batch_size))


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
        if not _is_number(beta) or not beta >= 1.0:
            problems.append(
                f"beta: {beta!r} is not allowed; use a number >= 1 (math.inf disables it)"
            )
        if window is not None and (not _is_int(window) or window < 2):
            problems.append(f"window: {window!r} is not allowed; use None or an integer >= 2")
        if not _is_int(seed):
            problems.append(f"seed: {seed!r} is not allowed; use an integer")
        if not _is_int(pruning_rounds) or pruning_rounds < 1:
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
            if not _is_number(value) or not math.isfinite(value) or value < 0:
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


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
