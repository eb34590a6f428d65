"""Selectors: which power limit of a measured profile is best for a given goal.

A profile is one :class:`Measurement` per power limit: the job-wide time per step (the
slowest rank's) and energy per step (summed over every GPU of every rank). A selector picks
one of them. The goals, after Zeus (You, Chung, Chowdhury, "Zeus: Understanding and
Optimizing GPU Energy Consumption of DNN Training", NSDI'23, §3):

``energy``
    least energy per step.
``time``
    least time per step.
``cost``
    least Zeus cost ``eta * E + (1 - eta) * P_max * T``, with ``P_max`` the highest power
    limit times the number of GPUs of the whole job, so both terms are joules per step
    (Zeus eq. 2; ``eta = 1`` is ``energy``, ``eta = 0`` is ``time``).
``max_slowdown``
    least energy among limits whose time per step is at most ``factor`` times the time at
    the highest measured limit.
``target_time``
    least energy among limits meeting a time per step; when none meets it, the fastest.
    The carbon pacing policy turns grid intensity into such a target.

Besides :meth:`Selector.select`, every selector scores many profiles at once with
:meth:`Selector.gaps`: how much worse each limit is than the best one, as a fraction of the
best one's cost, with constraint violations as infinity. The power-limit search uses it on
sampled profiles to judge how sure it is of its choice; the benchmark uses it to compare a
choice with the exhaustive optimum.

Example:
    >>> profile = [
    ...     Measurement(300.0, time_per_step_s=0.100, energy_per_step_j=25.0, steps=40),
    ...     Measurement(250.0, time_per_step_s=0.104, energy_per_step_j=22.0, steps=40),
    ...     Measurement(200.0, time_per_step_s=0.130, energy_per_step_j=23.0, steps=40),
    ... ]
    >>> selector = make_selector("cost", eta=0.5)
    >>> selector.select(profile, max_power_limit_w=300.0, num_gpus=1).power_limit_w
    250.0
    >>> selector.describe()
    'cost(eta=0.5)'
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from lightning_energy.errors import ConfigError, ProfileError

__all__ = [
    "SELECTOR_NAMES",
    "CostSelector",
    "EnergySelector",
    "MaxSlowdownSelector",
    "Measurement",
    "Selector",
    "TargetTimeSelector",
    "TimeSelector",
    "make_selector",
    "select_across",
]

SELECTOR_NAMES: tuple[str, ...] = ("energy", "time", "cost", "max_slowdown", "target_time")

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]


@dataclass(frozen=True)
class Measurement:
    """Time and energy per step of the whole job at one power limit.

    Attributes:
        power_limit_w: the power limit every GPU ran at.
        time_per_step_s: job-wide time per step (the slowest rank's).
        energy_per_step_j: job-wide energy per step (summed over all GPUs of all ranks).
        steps: how many measured steps this estimate averages (weights merges).

    Raises:
        ProfileError: a value is not finite, the limit or time is not positive, the energy
            is negative or ``steps`` is negative.
    """

    power_limit_w: float
    time_per_step_s: float
    energy_per_step_j: float
    steps: int

    def __post_init__(self) -> None:
        bad = [
            f"{key}={value!r}"
            for key, value, ok in (
                ("power_limit_w", self.power_limit_w, self.power_limit_w > 0),
                ("time_per_step_s", self.time_per_step_s, self.time_per_step_s > 0),
                ("energy_per_step_j", self.energy_per_step_j, self.energy_per_step_j >= 0),
                ("steps", self.steps, self.steps >= 0),
            )
            if not (ok and math.isfinite(value))
        ]
        if bad:
            raise ProfileError(
                "invalid measurement: "
                + ", ".join(bad)
                + " (limit and time must be > 0, energy >= 0, steps >= 0, all finite)"
            )


@runtime_checkable
class Selector(Protocol):
    """Chooses a power limit from a profile."""

    @property
    def name(self) -> str:
        """One of :data:`SELECTOR_NAMES`."""
        ...

    def select(
        self, profile: Sequence[Measurement], *, max_power_limit_w: float, num_gpus: int
    ) -> Measurement:
        """The best measurement of ``profile`` (one of its elements).

        Args:
            profile: one measurement per power limit, in any order.
            max_power_limit_w: the GPU's highest power limit (``P_max`` of the Zeus cost).
            num_gpus: GPUs of the whole job.

        Raises:
            ProfileError: ``profile`` is empty.
        """
        ...

    def describe(self) -> str:
        """The selector and its parameters, e.g. ``"cost(eta=0.5)"``."""
        ...

    def gaps(
        self,
        power_limits_w: FloatArray,
        time_per_step_s: FloatArray,
        energy_per_step_j: FloatArray,
        *,
        max_power_limit_w: float,
        num_gpus: int,
        time_slack: float = 0.0,
    ) -> FloatArray:
        """How much worse each limit is than the best, in many profiles at once.

        Args:
            power_limits_w: shape ``(L,)``: the limits, in any order.
            time_per_step_s: shape ``(K, L)``: ``K`` profiles' times per step.
            energy_per_step_j: shape ``(K, L)``: their energies per step.
            max_power_limit_w: the GPU's highest power limit.
            num_gpus: GPUs of the whole job.
            time_slack: a limit breaks a time constraint only when its time exceeds the
                bound by more than this fraction (the best limit still meets it exactly).

        Returns:
            Shape ``(K, L)``: ``cost / best_cost - 1`` (0 for the best, never negative),
            with the selector's own cost (energy for the constrained selectors), and
            ``inf`` where a limit breaks the time constraint.
        """
        ...


def _check_profile(profile: Sequence[Measurement]) -> None:
    if not profile:
        raise ProfileError("cannot select a power limit from an empty profile")


def _relative_gap(cost: FloatArray, eligible: BoolArray) -> FloatArray:
    """``cost / min(cost over eligible) - 1`` per row, floored at 0."""
    best = np.where(eligible, cost, np.inf).min(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.where(best > 0, cost / best - 1.0, np.where(cost > 0, np.inf, 0.0))
    return np.maximum(gap, 0.0)


class _CostSelector(ABC):
    """Shared machinery of the unconstrained selectors: a cost per limit, lowest wins."""

    name: str

    @abstractmethod
    def _cost(self, time_s: FloatArray, energy_j: FloatArray, p_max_job_w: float) -> FloatArray:
        """The cost per step of each limit (same shape as the inputs)."""

    def _secondary(self, m: Measurement) -> float:
        """Tie-break between equal costs: the faster limit."""
        return m.time_per_step_s

    def select(
        self, profile: Sequence[Measurement], *, max_power_limit_w: float, num_gpus: int
    ) -> Measurement:
        """See :meth:`Selector.select`."""
        _check_profile(profile)
        p_max_job_w = max_power_limit_w * num_gpus
        costs = self._cost(
            np.array([m.time_per_step_s for m in profile]),
            np.array([m.energy_per_step_j for m in profile]),
            p_max_job_w,
        )
        best = min(range(len(profile)), key=lambda i: (costs[i], self._secondary(profile[i])))
        return profile[best]

    def gaps(
        self,
        power_limits_w: FloatArray,
        time_per_step_s: FloatArray,
        energy_per_step_j: FloatArray,
        *,
        max_power_limit_w: float,
        num_gpus: int,
        time_slack: float = 0.0,
    ) -> FloatArray:
        """See :meth:`Selector.gaps`."""
        cost = self._cost(time_per_step_s, energy_per_step_j, max_power_limit_w * num_gpus)
        return _relative_gap(cost, np.ones(cost.shape, dtype=bool))


@dataclass(frozen=True)
class EnergySelector(_CostSelector):
    """Least energy per step (ties: the faster limit)."""

    name: str = field(default="energy", init=False)

    def _cost(self, time_s: FloatArray, energy_j: FloatArray, p_max_job_w: float) -> FloatArray:
        return energy_j

    def describe(self) -> str:
        """``"energy"``."""
        return "energy"


@dataclass(frozen=True)
class TimeSelector(_CostSelector):
    """Least time per step (ties: the lower-energy limit)."""

    name: str = field(default="time", init=False)

    def _cost(self, time_s: FloatArray, energy_j: FloatArray, p_max_job_w: float) -> FloatArray:
        return time_s

    def _secondary(self, m: Measurement) -> float:
        return m.energy_per_step_j

    def describe(self) -> str:
        """``"time"``."""
        return "time"


@dataclass(frozen=True)
class CostSelector(_CostSelector):
    """Least Zeus cost ``eta * E + (1 - eta) * P_max * num_gpus * T`` per step.

    Attributes:
        eta: weight of energy, in [0, 1].

    Raises:
        ConfigError: ``eta`` is outside [0, 1].
    """

    eta: float
    name: str = field(default="cost", init=False)

    def __post_init__(self) -> None:
        _raise_if_bad("eta", self.eta)

    def _cost(self, time_s: FloatArray, energy_j: FloatArray, p_max_job_w: float) -> FloatArray:
        return self.eta * energy_j + (1.0 - self.eta) * p_max_job_w * time_s

    def describe(self) -> str:
        """E.g. ``"cost(eta=0.5)"``."""
        return f"cost(eta={self.eta:g})"


class _ConstrainedSelector(ABC):
    """Shared machinery: least energy among limits meeting a time bound."""

    name: str

    @abstractmethod
    def _bounds_s(self, power_limits_w: FloatArray, time_s: FloatArray) -> FloatArray:
        """Shape ``(K, 1)``: the time bound of each profile."""

    def _fallback_to_fastest(self) -> bool:
        """Whether a profile with no limit meeting the bound picks the fastest."""
        return False

    def select(
        self, profile: Sequence[Measurement], *, max_power_limit_w: float, num_gpus: int
    ) -> Measurement:
        """See :meth:`Selector.select`."""
        _check_profile(profile)
        limits = np.array([m.power_limit_w for m in profile])
        times = np.array([[m.time_per_step_s for m in profile]])
        bound_s = float(self._bounds_s(limits, times)[0, 0])
        feasible = [m for m in profile if m.time_per_step_s <= bound_s]
        if not feasible:
            return min(profile, key=lambda m: (m.time_per_step_s, m.energy_per_step_j))
        return min(feasible, key=lambda m: (m.energy_per_step_j, m.time_per_step_s))

    def gaps(
        self,
        power_limits_w: FloatArray,
        time_per_step_s: FloatArray,
        energy_per_step_j: FloatArray,
        *,
        max_power_limit_w: float,
        num_gpus: int,
        time_slack: float = 0.0,
    ) -> FloatArray:
        """See :meth:`Selector.gaps`."""
        bound_s = self._bounds_s(power_limits_w, time_per_step_s)
        feasible = time_per_step_s <= bound_s
        gap = _relative_gap(energy_per_step_j, feasible)
        gap = np.where(time_per_step_s > bound_s * (1.0 + time_slack), np.inf, gap)
        if self._fallback_to_fastest():
            none = ~feasible.any(axis=1, keepdims=True)
            fastest = _relative_gap(time_per_step_s, np.ones(feasible.shape, dtype=bool))
            gap = np.where(none, fastest, gap)
        return gap


@dataclass(frozen=True)
class MaxSlowdownSelector(_ConstrainedSelector):
    """Least energy with time per step at most ``factor`` x the time at the highest limit.

    The highest limit always qualifies, so there is always a choice.

    Attributes:
        factor: the allowed slowdown, >= 1.

    Raises:
        ConfigError: ``factor`` is below 1.
    """

    factor: float
    name: str = field(default="max_slowdown", init=False)

    def __post_init__(self) -> None:
        _raise_if_bad("max_slowdown", self.factor)

    def _bounds_s(self, power_limits_w: FloatArray, time_s: FloatArray) -> FloatArray:
        top = int(np.argmax(power_limits_w))
        return self.factor * time_s[:, top : top + 1]

    def describe(self) -> str:
        """E.g. ``"max_slowdown(factor=1.1)"``."""
        return f"max_slowdown(factor={self.factor:g})"


@dataclass(frozen=True)
class TargetTimeSelector(_ConstrainedSelector):
    """Least energy with time per step at most ``target_time_s``; else the fastest.

    Attributes:
        target_time_s: the target time per step (job-wide), > 0.

    Raises:
        ConfigError: ``target_time_s`` is not positive.
    """

    target_time_s: float
    name: str = field(default="target_time", init=False)

    def __post_init__(self) -> None:
        _raise_if_bad("target_time_s", self.target_time_s)

    def _bounds_s(self, power_limits_w: FloatArray, time_s: FloatArray) -> FloatArray:
        return np.full((time_s.shape[0], 1), self.target_time_s)

    def _fallback_to_fastest(self) -> bool:
        return True

    def describe(self) -> str:
        """E.g. ``"target_time(target_time_s=0.25)"``."""
        return f"target_time(target_time_s={self.target_time_s:g})"


_ALLOWED = {
    "eta": "a number in [0, 1]",
    "max_slowdown": "a number >= 1",
    "target_time_s": "a number of seconds > 0",
}
_REQUIRED_BY = {"cost": "eta", "max_slowdown": "max_slowdown", "target_time": "target_time_s"}


def _parameter_problem(key: str, value: object) -> str | None:
    """The problem with a selector parameter's value, or None when it is valid."""
    ok = False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
        if key == "eta":
            ok = 0.0 <= v <= 1.0
        elif key == "max_slowdown":
            ok = 1.0 <= v < math.inf
        else:
            ok = 0.0 < v < math.inf
    return None if ok else f"{key}: {value!r} is not allowed; use {_ALLOWED[key]}"


def _raise_if_bad(key: str, value: object) -> None:
    problem = _parameter_problem(key, value)
    if problem is not None:
        raise ConfigError(problem)


def make_selector(
    name: str,
    *,
    eta: float | None = None,
    max_slowdown: float | None = None,
    target_time_s: float | None = None,
) -> Selector:
    """Build a selector by name.

    Every parameter given is validated, used or not, and every problem is reported at once.

    Args:
        name: one of :data:`SELECTOR_NAMES`.
        eta: ``cost``: weight of energy in [0, 1] (required).
        max_slowdown: ``max_slowdown``: allowed slowdown factor >= 1 (required).
        target_time_s: ``target_time``: target time per step in seconds > 0 (required).

    Returns:
        The selector.

    Raises:
        ConfigError: unknown name, a parameter out of range, or a required one missing;
            each problem names the key, the value and what is allowed.

    Example:
        >>> make_selector("max_slowdown", max_slowdown=1.1).describe()
        'max_slowdown(factor=1.1)'
    """
    problems: list[str] = []
    if name not in SELECTOR_NAMES:
        problems.append(f"selector: {name!r} is not allowed; allowed: {', '.join(SELECTOR_NAMES)}")
    values = {"eta": eta, "max_slowdown": max_slowdown, "target_time_s": target_time_s}
    for key, value in values.items():
        if value is None:
            if _REQUIRED_BY.get(name) == key:
                problems.append(
                    f"{key}: None is not allowed; selector {name!r} needs {_ALLOWED[key]}"
                )
            continue
        problem = _parameter_problem(key, value)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise ConfigError(problems)
    if name == "cost" and eta is not None:
        return CostSelector(eta=float(eta))
    if name == "max_slowdown" and max_slowdown is not None:
        return MaxSlowdownSelector(factor=float(max_slowdown))
    if name == "target_time" and target_time_s is not None:
        return TargetTimeSelector(target_time_s=float(target_time_s))
    return TimeSelector() if name == "time" else EnergySelector()


def select_across(
    selector: Selector,
    profiles: Sequence[Sequence[Measurement]],
    *,
    max_power_limit_w: float,
    num_gpus: int,
) -> tuple[int, Measurement]:
    """The best measurement of several knobs' profiles together (e.g. power limits and
    locked clocks), and which profile it is from.

    The first profile is the reference: ``max_slowdown`` bounds time by its highest
    setting (the GPU as it was before the job, for power limits). Settings of different
    knobs are not comparable (watts, megahertz), so each measurement is judged by its time
    and energy alone.

    Args:
        selector: the goal.
        profiles: one profile per knob, the reference first; each measurement's
            ``power_limit_w`` is that knob's setting.
        max_power_limit_w: the GPU's highest power limit (``P_max`` of the Zeus cost).
        num_gpus: GPUs of the whole job.

    Returns:
        ``(index of the profile, its measurement)``.

    Raises:
        ProfileError: the reference profile is empty.

    Example:
        >>> limits = [Measurement(300.0, 0.100, 25.0, 40), Measurement(250.0, 0.104, 22.0, 40)]
        >>> clocks = [Measurement(1410.0, 0.100, 24.0, 40), Measurement(1200.0, 0.103, 20.0, 40)]
        >>> select_across(make_selector("energy"), [limits, clocks],
        ...               max_power_limit_w=300.0, num_gpus=1)[1].power_limit_w
        1200.0
    """
    if not profiles or not profiles[0]:
        raise ProfileError("cannot select across knobs without a measured reference profile")
    # Rank keys stand for the settings: the reference's highest setting ranks highest.
    others = [(k, m) for k, profile in enumerate(profiles[1:], 1) for m in profile]
    reference = sorted(((0, m) for m in profiles[0]), key=lambda km: km[1].power_limit_w)
    ranked = others + reference
    surrogate = [replace(m, power_limit_w=float(i + 1)) for i, (_, m) in enumerate(ranked)]
    best = selector.select(surrogate, max_power_limit_w=max_power_limit_w, num_gpus=num_gpus)
    return ranked[next(i for i, m in enumerate(surrogate) if m is best)]
