"""Power-limit search: profile a few steps per limit, then race the contenders.

The optimizer is a pure state machine. The controller asks it for a :class:`Window` (a
power limit, steps to let the limit settle, steps to measure), runs those steps, and
reports the job-wide time and energy per measured step. Once it has seen enough, the
optimizer picks a limit with its :class:`~lightning_energy.optimize.selectors.Selector`.

Why not sweep every limit? Zeus (You, Chung, Chowdhury, "Zeus: Understanding and Optimizing
GPU Energy Consumption of DNN Training", NSDI'23) profiles every limit of a 25 W grid from
the highest to the lowest, with warm-up and profiling steps at each (by default 10 + 40,
50 steps per limit). Most of those steps are wasted: a limit that costs 30 % more than the
best is recognised after a handful of steps, and the steps that matter are those that
separate the two or three limits within a few percent of each other. This module spends
its steps there.

The method, in three stages:

1. **Warm-up, once.** ``warmup_steps`` unmeasured steps at the first limit (compilation,
   cuDNN autotuning, data-loader start-up), not at every limit.
2. **Coarse pass over every candidate.** Descending from the highest limit, each limit gets
   ``settle_steps`` unmeasured steps after the change and ``initial_steps`` measured
   steps, reported as two back-to-back windows (the second needs no settling). The two
   halves give a noise estimate that needs nothing but window totals: the spread of window
   means at the same limit, pooled over limits as a relative per-step covariance of time and
   energy (a weak prior, ``noise_prior``, covers the start). Every candidate is measured
   because real profiles are not unimodal (on memory-bound workloads the limit does not
   bind and the profile is flat and noisy) and because :meth:`PowerLimitOptimizer.reselect`
   needs the whole time-energy frontier later.
3. **Racing.** The measurement means and their standard errors define a posterior over the
   true profile. The optimizer draws ``samples`` profiles from it (a seeded generator, so
   every rank draws the same) and asks the selector, for every draw, how far each limit is
   from that draw's optimum (:meth:`~lightning_energy.optimize.selectors.Selector.gaps`).
   The *risk* of a limit is the share of draws in which it is more than ``tolerance``
   (1 %) worse than the optimum or breaks the selector's time constraint by more than
   ``tolerance``. The candidate choice is the limit of least risk. If that risk is at most
   ``1 - confidence`` the search stops. Otherwise it measures ``refine_steps`` more steps
   at the limit whose extra steps would lower the risk most per step spent (settling
   counts; the risk is recomputed with that limit's standard error shrunk, on the same
   draws), which is a racing / successive-elimination scheme that works for every
   selector, including the constrained ones where the limits near the time bound and the
   highest limit (whose time sets a ``max_slowdown`` bound) are the ones to refine.
   ``max_profile_steps`` (default 30 per candidate: 60 % of Zeus' sweep) caps the whole
   search; when it is spent the least-risk limit is chosen. Easy profiles stop long before
   the cap: on the Zeus A40 and V100 traces with 3 % noise per step the search uses about
   35 % of the sweep's steps in total (``benchmarks/power_limit_search.py``).

The coarse pass never stops a descent early, even when the lowest limits are clearly too
slow for the selector: skipping them would save a few percent of the steps but leave
:meth:`~PowerLimitOptimizer.reselect` blind for slower targets (the carbon policy slows
training down when the grid is dirty), and on flat, memory-bound profiles "clearly
dominated" is not clear at all. So every limit a re-selection could want is measured: after
racing, the limits near the first selector's choice precisely and the rest to
``initial_steps`` steps, which bounds the error of a later re-selection at a few percent.

Every decision is a function of the reported numbers, the constructor arguments and
``seed``: ranks that make the same calls in the same order get the same windows (with the
same NumPy version), and :meth:`~PowerLimitOptimizer.state_dict` holds only the reported
numbers. The arithmetic is elementwise, minima, exact sums (``math.fsum``) and counts of
boolean outcomes, so it does not depend on how a CPU orders floating-point reductions.

Example:
    >>> from lightning_energy.optimize.selectors import make_selector
    >>> opt = PowerLimitOptimizer([300.0, 250.0, 200.0], make_selector("energy"), num_gpus=1)
    >>> window = opt.next_window()
    >>> window.purpose, window.power_limit_w, window.settle_steps
    ('warmup', 300.0, 10)
    >>> while (window := opt.next_window()) is not None:
    ...     energy_j = {300.0: 30.0, 250.0: 24.0, 200.0: 27.0}[window.power_limit_w]
    ...     opt.report(window, time_per_step_s=0.1, energy_per_step_j=energy_j)
    >>> opt.done, opt.chosen_power_limit_w
    (True, 250.0)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lightning_energy.errors import CheckpointMismatchError, ConfigError, ProfileError
from lightning_energy.optimize.selectors import Measurement, Selector

__all__ = [
    "LOCKED_CLOCK",
    "POWER_LIMIT",
    "PURPOSES",
    "SETTING_KINDS",
    "PowerLimitOptimizer",
    "SettingKind",
    "Window",
    "min_window_s",
]

log = logging.getLogger(__name__)

PURPOSES: tuple[str, ...] = ("warmup", "profile", "refine")

_STATE_VERSION = 1
# A sampled time or energy never drops below this share of its mean (keeps draws positive).
_MIN_SAMPLE_RATIO = 0.05
# Default step budget per candidate: 60 % of Zeus' 50 (10 warm-up + 40 profiled) per limit.
_DEFAULT_BUDGET_PER_LIMIT = 30
# The shortest refinement window worth its settling steps.
_MIN_REFINE_STEPS = 2
# Prior weight, in degrees of freedom, of ``noise_prior``.
_PRIOR_DOF = 2.0
# Correlation of time and energy noise is clipped to this (keeps the Cholesky factor finite).
_MAX_CORRELATION = 0.99


@dataclass(frozen=True)
class SettingKind:
    """What an optimizer searches: one setting applied to every GPU of the job.

    Both kinds are searched alike: a higher setting runs no slower (a higher power limit,
    a higher locked SM clock), so the highest candidate is the fastest (the reference of
    ``max_slowdown``). Windows and measurements carry the setting in the kind's unit in
    their ``power_limit_w`` field (the selectors' name for it).

    Attributes:
        name: ``power_limit`` or ``locked_clock`` (what reports and checkpoints call it).
        unit: ``W`` or ``MHz``.
    """

    name: str
    unit: str

    def label(self, value: float) -> str:
        """``value`` with its unit, e.g. ``250 W`` or ``1410 MHz``."""
        return f"{value:g} {self.unit}"


#: The power limit of every GPU, in watts.
POWER_LIMIT = SettingKind("power_limit", "W")
#: The SM clock every GPU is locked at (minimum = maximum), in MHz.
LOCKED_CLOCK = SettingKind("locked_clock", "MHz")
#: Every kind by name.
SETTING_KINDS: dict[str, SettingKind] = {k.name: k for k in (POWER_LIMIT, LOCKED_CLOCK)}


def min_window_s(counter_period_s: float, tolerance: float) -> float:
    """The shortest window whose energy is within ``tolerance`` despite the counter period.

    An energy counter that moves every ``counter_period_s`` misses up to one period's
    energy at each end of a window, so a window of ``d`` seconds is off by up to
    ``counter_period_s / d`` (3 steps of 0.3 s on a 100 ms counter: about 10 %). Windows
    at least ``counter_period_s / tolerance`` long keep that error within ``tolerance``
    (10 s for a 100 ms counter and a 1 % tolerance).

    Args:
        counter_period_s: how often the energy counter moves (0: continuously).
        tolerance: the relative error allowed, in (0, 1).

    Returns:
        Seconds (0 for a continuous counter).
    """
    return counter_period_s / tolerance


@dataclass(frozen=True)
class Window:
    """What the controller runs next.

    Attributes:
        power_limit_w: the limit to apply to every GPU of the job.
        settle_steps: steps run at this limit before measuring (not measured).
        measure_steps: steps measured in this window at least (0 for the warm-up window).
        purpose: ``"warmup"``, ``"profile"`` (first pass over every limit) or
            ``"refine"`` (more steps at a contender).
        min_duration_s: seconds measured at least: the window goes on, step by step,
            until both ``measure_steps`` and this are reached (see :func:`min_window_s`).
    """

    power_limit_w: float
    settle_steps: int
    measure_steps: int
    purpose: str
    min_duration_s: float = 0.0


@dataclass(frozen=True)
class _Result:
    """One measured window."""

    power_limit_w: float
    steps: int
    time_per_step_s: float
    energy_per_step_j: float
    purpose: str


@dataclass(frozen=True)
class _Posterior:
    """Means, step counts and pooled relative noise of the measured limits."""

    limits_w: NDArray[np.float64]
    steps: NDArray[np.float64]
    time_s: NDArray[np.float64]
    energy_j: NDArray[np.float64]
    # Lower Cholesky factor of the per-step relative covariance of (time, energy).
    noise_factor: NDArray[np.float64]


class PowerLimitOptimizer:
    """Finds the setting a selector prefers, profiling as few steps as it can.

    See the module docstring for the method, written for power limits; a locked SM clock
    (``kind=LOCKED_CLOCK``) is searched the same way, its candidates in MHz.

    Args:
        power_limits_w: candidate settings, in the kind's unit (any order; duplicates are
            dropped).
        selector: what "best" means.
        num_gpus: GPUs of the whole job (all ranks): scales the Zeus cost's time term.
        warmup_steps: unmeasured steps before the first measurement.
        settle_steps: unmeasured steps after every change of limit.
        initial_steps: measured steps per limit in the first pass (>= 2; split into two
            windows).
        refine_steps: measured steps per racing window.
        max_profile_steps: cap on warm-up + settle + measured steps; the first pass always
            completes, racing stops when the next window would not fit. Default: 30 per
            candidate (60 % of Zeus' 50 per limit).
        tolerance: a limit within this fraction of the optimum's cost, meeting any time
            constraint within this fraction, is good enough.
        confidence: stop racing once the chosen limit is good enough with this posterior
            probability.
        noise_prior: prior per-step relative standard deviation of time and energy, used
            until repeated windows estimate it.
        samples: posterior draws per decision.
        max_power_limit_w: the GPU's highest limit (``P_max`` of the Zeus cost); default
            the highest candidate (required for locked clocks).
        seed: seeds the posterior draws.
        counter_period_s: how often the GPUs' energy counters move: every measured window
            lasts at least :func:`min_window_s` of it and ``tolerance`` seconds.
        kind: what the candidates are (:data:`POWER_LIMIT` or :data:`LOCKED_CLOCK`).

    Raises:
        ConfigError: a parameter is out of range (every problem is listed).
    """

    def __init__(
        self,
        power_limits_w: Sequence[float],
        selector: Selector,
        *,
        num_gpus: int,
        warmup_steps: int = 10,
        settle_steps: int = 2,
        initial_steps: int = 6,
        refine_steps: int = 6,
        max_profile_steps: int | None = None,
        tolerance: float = 0.01,
        confidence: float = 0.995,
        noise_prior: float = 0.05,
        samples: int = 1024,
        max_power_limit_w: float | None = None,
        seed: int = 0,
        counter_period_s: float = 0.0,
        kind: SettingKind = POWER_LIMIT,
    ) -> None:
        problems: list[str] = []
        try:
            limits = sorted({float(p) for p in power_limits_w}, reverse=True)
        except (TypeError, ValueError):
            limits = []
        if not limits or not all(0 < p < math.inf for p in limits):
            problems.append(
                f"power_limits_w: {list(power_limits_w)!r} is not allowed; use a non-empty "
                f"list of positive, finite numbers ({kind.unit})"
            )
        integers = {
            "num_gpus": (num_gpus, 1),
            "warmup_steps": (warmup_steps, 0),
            "settle_steps": (settle_steps, 0),
            "initial_steps": (initial_steps, 2),
            "refine_steps": (refine_steps, _MIN_REFINE_STEPS),
            "samples": (samples, 16),
        }
        if max_profile_steps is not None:
            integers["max_profile_steps"] = (max_profile_steps, 0)
        for key, (value, least) in integers.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                problems.append(f"{key}: {value!r} is not allowed; use an integer >= {least}")
        reals = {
            "tolerance": (tolerance, 0.0, 1.0),
            "confidence": (confidence, 0.0, 1.0),
            "noise_prior": (noise_prior, 0.0, 1.0),
        }
        for key, (real, low, high) in reals.items():
            if not low < real < high:
                problems.append(f"{key}: {real!r} is not allowed; use a number in ({low}, {high})")
        if not 0.0 <= counter_period_s < math.inf:
            problems.append(
                f"counter_period_s: {counter_period_s!r} is not allowed; use a finite number "
                "of seconds >= 0"
            )
        if kind != POWER_LIMIT:
            if max_power_limit_w is None or not 0 < max_power_limit_w < math.inf:
                problems.append(
                    f"max_power_limit_w: {max_power_limit_w!r} is not allowed for "
                    f"{kind.name} candidates; use the GPU's highest power limit in watts"
                )
        elif max_power_limit_w is not None and not (limits and max_power_limit_w >= limits[0]):
            problems.append(
                f"max_power_limit_w: {max_power_limit_w!r} is not allowed; use a number >= the "
                "highest candidate"
            )
        if problems:
            raise ConfigError(problems, source="PowerLimitOptimizer")
        self._kind = kind
        self._limits = tuple(limits)
        self._selector = selector
        self._num_gpus = num_gpus
        self._warmup_steps = warmup_steps
        self._settle_steps = settle_steps
        self._refine_steps = refine_steps
        self._budget = (
            _DEFAULT_BUDGET_PER_LIMIT * len(limits)
            if max_profile_steps is None
            else max_profile_steps
        )
        self._tolerance = tolerance
        self._confidence = confidence
        self._noise_prior = noise_prior
        self._samples = samples
        self._max_power_limit_w = limits[0] if max_power_limit_w is None else max_power_limit_w
        self._seed = seed
        self._min_window_s = min_window_s(counter_period_s, tolerance)
        half = (initial_steps + 1) // 2
        self._plan = [(limit, steps) for limit in limits for steps in (half, initial_steps - half)]
        self._results: list[_Result] = []
        self._excluded: set[float] = set()
        self._profiled_steps = 0
        self._chosen: float | None = limits[0] if len(limits) == 1 else None
        self._warm = warmup_steps == 0
        self._current_limit_w: float | None = None
        self._pending: Window | None = None
        self._advance()

    # ------------------------------------------------------------------ public API
    @property
    def selector(self) -> Selector:
        """The selector the current choice follows."""
        return self._selector

    @property
    def kind(self) -> SettingKind:
        """What the candidates are."""
        return self._kind

    @property
    def power_limits_w(self) -> tuple[float, ...]:
        """The candidate settings, highest first."""
        return self._limits

    @property
    def max_power_limit_w(self) -> float:
        """The GPU's highest power limit (``P_max`` of the Zeus cost)."""
        return self._max_power_limit_w

    @property
    def num_gpus(self) -> int:
        """GPUs of the whole job."""
        return self._num_gpus

    @property
    def min_window_duration_s(self) -> float:
        """Seconds every measured window lasts at least (see :func:`min_window_s`)."""
        return self._min_window_s

    @property
    def done(self) -> bool:
        """Whether the profile is complete (then use :attr:`chosen_power_limit_w`)."""
        return self._chosen is not None

    @property
    def chosen_power_limit_w(self) -> float | None:
        """The chosen limit once :attr:`done`, else None."""
        return self._chosen

    def next_window(self) -> Window | None:
        """The window to run next; the same one until it is reported or interrupted.

        Returns:
            The window, or None once the profile is complete.
        """
        return self._pending

    def report(
        self,
        window: Window,
        *,
        time_per_step_s: float,
        energy_per_step_j: float,
        steps: int | None = None,
    ) -> None:
        """Record a finished window.

        Args:
            window: the window from :meth:`next_window`.
            time_per_step_s: job-wide time per measured step (the slowest rank's).
            energy_per_step_j: job-wide energy per measured step (all GPUs of all ranks).
                Both are ignored for the warm-up window (``measure_steps == 0``).
            steps: steps actually measured, when the window ran longer than
                ``measure_steps`` to reach ``min_duration_s`` (default ``measure_steps``).

        Raises:
            ProfileError: ``window`` is not the pending window, a value is not a positive
                finite number, or ``steps`` is below the window's ``measure_steps``.
        """
        self._check_pending(window)
        measured = window.measure_steps if steps is None else steps
        if measured < window.measure_steps:
            raise ProfileError(
                f"window at {self._kind.label(window.power_limit_w)}: steps={steps!r} is "
                f"fewer than the {window.measure_steps} the window measures"
            )
        if window.measure_steps > 0:
            bad = {
                k: v
                for k, v in (
                    ("time_per_step_s", time_per_step_s),
                    ("energy_per_step_j", energy_per_step_j),
                )
                if not 0 < v < math.inf
            }
            if bad:
                raise ProfileError(
                    f"window at {self._kind.label(window.power_limit_w)}: {bad} must be "
                    "positive and finite"
                )
            self._results.append(
                _Result(
                    window.power_limit_w,
                    measured,
                    float(time_per_step_s),
                    float(energy_per_step_j),
                    window.purpose,
                )
            )
        else:
            self._warm = True
        self._profiled_steps += window.settle_steps + measured
        self._current_limit_w = window.power_limit_w
        self._pending = None
        self._advance()

    def report_interrupted(self, window: Window, *, steps_run: int = 0) -> None:
        """Discard a window cut short (the workload changed, the run ended); it is issued
        again.

        Args:
            window: the window from :meth:`next_window`.
            steps_run: steps of it that ran before the interruption (counted in
                :meth:`profiled_steps`, not measured).

        Raises:
            ProfileError: ``window`` is not the pending window.
        """
        self._check_pending(window)
        self._profiled_steps += max(int(steps_run), 0)
        self._current_limit_w = None
        self._pending = None
        self._advance()

    def min_steps_left(self, time_per_step_s: float) -> int:
        """The fewest steps the profile still needs at ``time_per_step_s`` per step.

        The first pass's windows left (each its settling and at least its measured steps
        and :func:`min_window_s` of time) and the warm-up when it is due; racing may add
        more. 0 once the profile is complete.

        Args:
            time_per_step_s: how long a step takes (the job's measured step time).

        Raises:
            ProfileError: ``time_per_step_s`` is not a positive finite number.
        """
        if not 0 < time_per_step_s < math.inf:
            raise ProfileError(
                f"time_per_step_s: {time_per_step_s!r} must be a positive, finite number"
            )
        if self.done:
            return 0
        done = sum(1 for r in self._results if r.purpose == "profile")
        steps = 0 if self._warm else self._warmup_steps
        current = self._current_limit_w
        for limit_w, measured in self._plan[done:]:
            steps += 0 if limit_w == current else self._settle_steps
            steps += max(measured, math.ceil(self._min_window_s / time_per_step_s))
            current = limit_w
        return steps

    def profiled_steps(self) -> int:
        """Steps spent in warm-up, settling and measuring so far."""
        return self._profiled_steps

    def exclude(self, setting: float) -> None:
        """Never choose ``setting`` (e.g. a lock the GPU could not hold); it is still
        measured and in :meth:`profile`. While every measured setting is excluded, the
        choice is among all of them.

        Raises:
            ProfileError: ``setting`` is not a candidate.
        """
        if setting not in self._limits:
            raise ProfileError(
                f"exclude({setting!r}): not a candidate; candidates: {list(self._limits)}"
            )
        self._excluded.add(float(setting))

    @property
    def excluded(self) -> frozenset[float]:
        """The settings never chosen (see :meth:`exclude`)."""
        return frozenset(self._excluded)

    def choosable(self) -> list[Measurement]:
        """The measured settings a choice is made among (the excluded left out)."""
        profile = self.profile()
        return [m for m in profile if m.power_limit_w not in self._excluded] or profile

    def profile(self) -> list[Measurement]:
        """Every measured limit (windows merged, weighted by steps), highest limit first."""
        merged: dict[float, list[_Result]] = {}
        for r in self._results:
            merged.setdefault(r.power_limit_w, []).append(r)
        profile = []
        for limit, results in merged.items():
            steps = sum(r.steps for r in results)
            profile.append(
                Measurement(
                    power_limit_w=limit,
                    time_per_step_s=math.fsum(r.time_per_step_s * r.steps for r in results) / steps,
                    energy_per_step_j=math.fsum(r.energy_per_step_j * r.steps for r in results)
                    / steps,
                    steps=steps,
                )
            )
        return sorted(profile, key=lambda m: -m.power_limit_w)

    def reselect(self, selector: Selector) -> float:
        """Choose again with another selector from what was measured, without profiling.

        The choice is the limit most likely to be within ``tolerance`` of the new
        selector's optimum, given the measurements. If the profile is not complete yet, the
        search continues for the new selector and the return value is the best choice so
        far (the highest candidate if nothing was measured).

        Args:
            selector: the new goal (e.g. a ``target_time`` selector from the carbon policy).

        Returns:
            The chosen limit.
        """
        self._selector = selector
        if len(self._limits) == 1:
            return self._limits[0]
        posterior = self._posterior()
        if posterior is None:
            return self._limits[0]
        choice, _ = self._least_risk(posterior, self._draws(posterior))
        limit = float(posterior.limits_w[choice])
        if self.done:
            self._chosen = limit
        return limit

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, JSON-serialisable."""
        return {
            "version": _STATE_VERSION,
            "kind": self._kind.name,
            "power_limits_w": list(self._limits),
            "num_gpus": self._num_gpus,
            "selector": self._selector.describe(),
            "windows": [
                [r.power_limit_w, r.steps, r.time_per_step_s, r.energy_per_step_j, r.purpose]
                for r in self._results
            ],
            "profiled_steps": self._profiled_steps,
            "chosen_power_limit_w": self._chosen,
            "excluded": sorted(self._excluded),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`.

        A finished profile stays finished (no window is issued). If it was finished under
        another selector than this optimizer's, the limit is chosen again for this one from
        the saved measurements. An unfinished profile continues where it stopped, after a
        new warm-up window (a new process compiles and tunes its kernels again).

        Args:
            state: a dict from :meth:`state_dict`.

        Raises:
            CheckpointMismatchError: the state is from other candidates or another number
                of GPUs.
            ProfileError: the state is malformed.
        """
        try:
            version = state["version"]
            kind = str(state.get("kind", POWER_LIMIT.name))  # states before clocks: limits
            limits = tuple(float(p) for p in state["power_limits_w"])
            num_gpus = int(state["num_gpus"])
            described = str(state["selector"])
            results = [
                _Result(float(p), int(n), float(t), float(e), str(purpose))
                for p, n, t, e, purpose in state["windows"]
            ]
            profiled_steps = int(state["profiled_steps"])
            chosen = state["chosen_power_limit_w"]
            chosen = None if chosen is None else float(chosen)
            excluded = {float(x) for x in state.get("excluded", [])}
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ProfileError(f"malformed power-limit optimizer state: {exc!r}") from exc
        if version != _STATE_VERSION:
            raise ProfileError(
                f"power-limit optimizer state version {version!r}; this version reads "
                f"{_STATE_VERSION}"
            )
        if kind != self._kind.name or limits != self._limits or num_gpus != self._num_gpus:
            raise CheckpointMismatchError(
                f"saved profile is for {kind.replace('_', ' ')}s {list(limits)} on {num_gpus} "
                f"GPUs; this job has {self._kind.name.replace('_', ' ')}s {list(self._limits)} "
                f"{self._kind.unit} on {self._num_gpus} GPUs"
            )
        bad = [
            r
            for r in results
            if r.power_limit_w not in limits
            or r.steps < 1
            or not 0 < r.time_per_step_s < math.inf
            or not 0 < r.energy_per_step_j < math.inf
            or r.purpose not in PURPOSES
        ]
        if bad or (chosen is not None and chosen not in limits) or not excluded <= set(limits):
            raise ProfileError(
                f"malformed power-limit optimizer state: windows {bad}, chosen {chosen!r}, "
                f"excluded {sorted(excluded)}"
            )
        self._results = results
        self._excluded = excluded
        self._profiled_steps = profiled_steps
        self._chosen = chosen
        self._current_limit_w = None
        self._pending = None
        if chosen is not None:
            if described != self._selector.describe() and len(limits) > 1:
                self.reselect(self._selector)
            return
        self._warm = self._warmup_steps == 0
        self._advance()

    # ------------------------------------------------------------------ internals
    def _check_pending(self, window: Window) -> None:
        if self._pending is None or window != self._pending:
            raise ProfileError(
                f"window {window} was not issued by this optimizer (pending: {self._pending})"
            )

    def _advance(self) -> None:
        """Decide the pending window, or finish the profile."""
        if self.done:
            return
        measure = self._next_measurement()
        if measure is None:
            return
        limit_w, steps, purpose = measure
        if not self._warm:
            self._pending = Window(limit_w, self._warmup_steps, 0, "warmup")
            return
        settle = 0 if limit_w == self._current_limit_w else self._settle_steps
        self._pending = Window(limit_w, settle, steps, purpose, self._min_window_s)

    def _next_measurement(self) -> tuple[float, int, str] | None:
        """The next (limit, measured steps, purpose); None after finishing the profile."""
        done_profile = sum(1 for r in self._results if r.purpose == "profile")
        if done_profile < len(self._plan):
            limit_w, steps = self._plan[done_profile]
            return limit_w, steps, "profile"
        posterior = self._posterior()
        assert posterior is not None  # the first pass measured every limit
        draws = self._draws(posterior)
        choice, bad = self._least_risk(posterior, draws)
        risk = bad / self._samples
        if risk <= 1.0 - self._confidence:
            self._finish(posterior, choice, risk, "confident")
            return None
        target = self._most_informative(posterior, draws, choice)
        if target is None:
            self._finish(posterior, choice, risk, "step budget spent")
            return None
        limit_w, steps = target
        log.debug(
            "racing: %g W at risk %.3f, measuring %d steps at %g W",
            float(posterior.limits_w[choice]),
            risk,
            steps,
            limit_w,
        )
        return limit_w, steps, "refine"

    def _finish(self, posterior: _Posterior, choice: int, risk: float, why: str) -> None:
        self._chosen = float(posterior.limits_w[choice])
        self._pending = None
        log.debug(
            "%s profile complete (%s) after %d steps: %s for %s "
            "(%.1f %% chance of being more than %g %% off)",
            self._kind.name,
            why,
            self._profiled_steps,
            self._kind.label(self._chosen),
            self._selector.describe(),
            100.0 * risk,
            100.0 * self._tolerance,
        )

    def _posterior(self) -> _Posterior | None:
        """Per-limit means and the pooled noise of the choosable limits; None before any
        measurement."""
        profile = self.choosable()
        if not profile:
            return None
        by_limit = {m.power_limit_w: m for m in profile}
        ss_tt: list[float] = []
        ss_ee: list[float] = []
        ss_te: list[float] = []
        dof = 0
        for limit_w, m in by_limit.items():
            results = [r for r in self._results if r.power_limit_w == limit_w]
            dof += len(results) - 1
            for r in results:
                dt = r.time_per_step_s / m.time_per_step_s - 1.0
                de = r.energy_per_step_j / m.energy_per_step_j - 1.0
                ss_tt.append(r.steps * dt * dt)
                ss_ee.append(r.steps * de * de)
                ss_te.append(r.steps * dt * de)
        prior = _PRIOR_DOF * self._noise_prior**2
        var_t = (prior + math.fsum(ss_tt)) / (_PRIOR_DOF + dof)
        var_e = (prior + math.fsum(ss_ee)) / (_PRIOR_DOF + dof)
        cov = math.fsum(ss_te) / (_PRIOR_DOF + dof)
        corr = max(-_MAX_CORRELATION, min(_MAX_CORRELATION, cov / math.sqrt(var_t * var_e)))
        sd_t, sd_e = math.sqrt(var_t), math.sqrt(var_e)
        factor = np.array([[sd_t, 0.0], [corr * sd_e, sd_e * math.sqrt(1.0 - corr * corr)]])
        return _Posterior(
            limits_w=np.array([m.power_limit_w for m in profile]),
            steps=np.array([float(m.steps) for m in profile]),
            time_s=np.array([m.time_per_step_s for m in profile]),
            energy_j=np.array([m.energy_per_step_j for m in profile]),
            noise_factor=factor,
        )

    def _draws(self, posterior: _Posterior) -> NDArray[np.float64]:
        """Shape ``(samples, L, 2)``: correlated relative (time, energy) noise per step."""
        rng = np.random.default_rng([self._seed, len(self._results)])
        z = rng.standard_normal((self._samples, len(posterior.limits_w), 2))
        # Elementwise products and sums only (no BLAS), so every CPU rounds the same way.
        f = posterior.noise_factor
        return np.stack((z[..., 0] * f[0, 0], z[..., 0] * f[1, 0] + z[..., 1] * f[1, 1]), axis=-1)

    def _gaps(
        self, posterior: _Posterior, draws: NDArray[np.float64], steps: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """Shape ``(samples, L)``: each limit's gap to each draw's optimum (see selectors)."""
        scale = 1.0 / np.sqrt(steps)
        time_s = posterior.time_s * np.maximum(1.0 + draws[..., 0] * scale, _MIN_SAMPLE_RATIO)
        energy_j = posterior.energy_j * np.maximum(1.0 + draws[..., 1] * scale, _MIN_SAMPLE_RATIO)
        return self._selector.gaps(
            posterior.limits_w,
            time_s,
            energy_j,
            max_power_limit_w=self._max_power_limit_w,
            num_gpus=self._num_gpus,
            time_slack=self._tolerance,
        )

    def _least_risk(self, posterior: _Posterior, draws: NDArray[np.float64]) -> tuple[int, int]:
        """The least-risk limit's index and its count of bad draws.

        Ties go to the selector's choice on the means, then to the higher limit.
        """
        bad = (self._gaps(posterior, draws, posterior.steps) > self._tolerance).sum(axis=0)
        profile = self.choosable()
        on_means = self._selector.select(
            profile, max_power_limit_w=self._max_power_limit_w, num_gpus=self._num_gpus
        )
        preferred = profile.index(on_means)
        choice = min(range(len(bad)), key=lambda i: (int(bad[i]), i != preferred, i))
        return choice, int(bad[choice])

    def _window_cost(self, limit_w: float) -> tuple[int, int] | None:
        """(measured steps, total steps) of a racing window at ``limit_w`` within budget."""
        settle = 0 if limit_w == self._current_limit_w else self._settle_steps
        left = self._budget - self._profiled_steps - settle
        if not self._warm:
            left -= self._warmup_steps
        steps = min(self._refine_steps, left)
        if steps < _MIN_REFINE_STEPS:
            return None
        return steps, steps + settle

    def _most_informative(
        self, posterior: _Posterior, draws: NDArray[np.float64], choice: int
    ) -> tuple[float, int] | None:
        """The racing window that lowers the least risk most per step; None if none fits."""
        gaps = self._gaps(posterior, draws, posterior.steps)
        base = int((gaps > self._tolerance).sum(axis=0).min())
        best: tuple[float, int, int] | None = None  # (-gain per step, steps, index)
        fallback: list[tuple[float, int, int]] = []
        for j, limit_w in enumerate(posterior.limits_w):
            cost = self._window_cost(float(limit_w))
            if cost is None:
                continue
            steps, total = cost
            grown = posterior.steps.copy()
            grown[j] += steps
            after = int((self._gaps(posterior, draws, grown) > self._tolerance).sum(axis=0).min())
            key = (-(base - after) / total, steps, j)
            if after < base and (best is None or key < best):
                best = key
            fallback.append((posterior.steps[j], steps, j))
        if best is not None:
            _, steps, j = best
            return float(posterior.limits_w[j]), steps
        # No single limit helps on its own: refine the choice or its strongest rival.
        rival = self._rival(gaps, choice)
        contenders = [f for f in fallback if f[2] in (choice, rival)]
        if not contenders:
            return None
        _, steps, j = min(contenders)
        return float(posterior.limits_w[j]), steps

    def _rival(self, gaps: NDArray[np.float64], choice: int) -> int:
        """The limit that is most often the optimum in the draws where ``choice`` is bad."""
        rows = gaps[:, choice] > self._tolerance  # some: racing only runs while at risk
        winners = np.argmin(gaps[rows], axis=1)
        counts = np.bincount(winners, minlength=gaps.shape[1])
        counts[choice] = -1
        return int(np.argmax(counts))
