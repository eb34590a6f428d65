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

The store-backed :class:`~lightning_energy.optimize.recurring.BatchSizeOptimizer` applies
them to a job's history.

Example:
    >>> pruning_state([32, 64, 128], 64, []).next_batch_size
    64
    >>> first = Observation(batch_size=64, cost=1.0, converged=True)
    >>> pruning_state([32, 64, 128], 64, [first]).next_batch_size
    32
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_energy.errors import ConfigError
from lightning_energy.numbers import is_finite
from lightning_energy.store import JobId, TrialRecord

__all__ = [
    "BestChoice",
    "JobSpec",
    "Observation",
    "PruningState",
    "Trial",
    "best_choice",
    "is_int",
    "pruning_state",
    "thompson_choice",
]


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
        if not is_int(self.gpu_count) or self.gpu_count < 1:
            problems.append(f"gpu_count: {self.gpu_count!r} is not allowed; use an integer >= 1")
        sizes = tuple(self.batch_sizes) if not isinstance(self.batch_sizes, (str, bytes)) else ()
        if not sizes or not all(is_int(b) and b > 0 for b in sizes):
            problems.append(
                f"batch_sizes: {self.batch_sizes!r} is not allowed; give positive integers"
            )
        elif len(set(sizes)) != len(sizes):
            problems.append(f"batch_sizes: {self.batch_sizes!r} has duplicates")
        if self.default_batch_size not in sizes:
            problems.append(
                f"default_batch_size: {self.default_batch_size!r} is not allowed; "
                f"use one of batch_sizes {sorted(b for b in sizes if is_int(b))}"
            )
        if not is_finite(self.target_metric):
            problems.append(f"target_metric: {self.target_metric!r} is not allowed; use a number")
        if not is_int(self.max_epochs) or self.max_epochs < 1:
            problems.append(f"max_epochs: {self.max_epochs!r} is not allowed; use an integer >= 1")
        if not is_finite(self.max_power_limit_w) or not self.max_power_limit_w > 0:
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
    """What one run measured, handed to
    :meth:`~lightning_energy.optimize.recurring.BatchSizeOptimizer.record`.

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


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (numpy's too), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
