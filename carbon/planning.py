"""The maths of carbon-aware pacing: the energy-time frontier and the least-carbon schedule.

A training job is characterised by its operating points (e.g. one per GPU power limit):
the time and the energy of one step at that point. Switching between two points during an
interval ("time sharing") achieves any mix of them, so the points that matter are those on
the lower convex hull of the (time, energy) cloud between the fastest point and the one of
least energy; a point above that hull costs more energy than a mix of its neighbours at the
same speed, and a point slower than the least-energy one costs more time *and* energy.

In rate space the same hull is a convex, piecewise-linear power curve ``P(r)`` (power in W
against steps per second). Over intervals ``t`` of duration ``D_t`` and carbon intensity
``I_t`` a schedule doing ``n_t`` steps in interval ``t`` emits ``sum_t I_t * D_t *
P(n_t / D_t)``. Minimising that subject to ``sum_t n_t = N`` is a separable convex
problem: the marginal cost of a step in interval ``t`` on hull segment ``j`` is
``I_t * s_j`` (``s_j`` the slope of the curve, joules per step), so filling the cheapest
(interval, segment) pairs first is optimal (an exact greedy; the linear-programming
formulation has the same optimum). :func:`plan_steps` implements it, with or without
pausing allowed.

A controller that holds one setting for a whole interval cannot time-share: each interval
runs one operating point (or pauses), so the convex relaxation can promise savings no such
run achieves. :func:`plan_intervals` plans that way: a dynamic program over the intervals
whose choice in each is one efficient point or a pause, whose state is the remaining work
(on a fine grid, interpolated), and whose deadline is a hard constraint.

Example:
    >>> hull = frontier_from_profile([(1.0, 300.0), (1.2, 220.0), (1.1, 280.0), (2.0, 260.0)])
    >>> [p.time_per_step_s for p in hull]
    [1.0, 1.2]
    >>> plan = plan_steps([500.0, 100.0], [3600.0, 3600.0], 3000, hull, allow_pause=True)
    >>> [round(n) for n in plan.steps]
    [0, 3000]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import numpy.typing as npt

from carbon.errors import CarbonConfigError
from carbon.forecast import DailyProfileForecaster
from carbon.types import IntensityPoint, as_utc

__all__ = [
    "IntensityOutlook",
    "IntervalPlan",
    "OperatingPoint",
    "Schedule",
    "deadline_from_max_slowdown",
    "efficient_points",
    "energy_per_step_j",
    "executed_point",
    "fill_cheapest",
    "frontier_from_profile",
    "interval_offsets",
    "plan_intervals",
    "plan_steps",
]

FloatArray = npt.NDArray[np.float64]

_J_PER_KWH = 3.6e6
_DAY_S = 86400.0


@dataclass(frozen=True)
class OperatingPoint:
    """One way to run a training step: its time and energy (e.g. at one power limit).

    Attributes:
        time_per_step_s: seconds per step at this point (> 0).
        energy_per_step_j: joules per step at this point (> 0).
        label: a name for reports, e.g. ``"250 W"``.

    Raises:
        CarbonConfigError: if a value is not finite and positive.
    """

    time_per_step_s: float
    energy_per_step_j: float
    label: str = ""

    def __post_init__(self) -> None:
        problems = [
            f"frontier {name}: {value!r} is not allowed; use a finite number > 0"
            for name, value in (
                ("time_per_step_s", self.time_per_step_s),
                ("energy_per_step_j", self.energy_per_step_j),
            )
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0)
        ]
        if problems:
            raise CarbonConfigError(problems)
        object.__setattr__(self, "time_per_step_s", float(self.time_per_step_s))
        object.__setattr__(self, "energy_per_step_j", float(self.energy_per_step_j))

    @property
    def power_w(self) -> float:
        """Average power drawn at this point."""
        return self.energy_per_step_j / self.time_per_step_s


def frontier_from_profile(
    points: Iterable[OperatingPoint | tuple[float, float]],
) -> tuple[OperatingPoint, ...]:
    """Keep the points a time-sharing schedule may ever use: the convex Pareto frontier.

    A point is dropped when another is at least as fast with no more energy (dominated),
    or when it lies on or above the segment joining two others (a mix of those two is as
    fast and uses less energy). What remains runs from the fastest point to the point of
    least energy, with energy decreasing and the marginal saving of slowing down shrinking.

    Args:
        points: operating points, or ``(time_per_step_s, energy_per_step_j)`` pairs.

    Returns:
        The frontier, fastest first.

    Raises:
        CarbonConfigError: if ``points`` is empty or holds a non-positive value.

    Example:
        >>> [p.energy_per_step_j for p in frontier_from_profile([(1, 9), (2, 5), (3, 4), (4, 6)])]
        [9.0, 5.0, 4.0]
    """
    efficient = efficient_points(points)
    hull: list[OperatingPoint] = []
    for p in efficient:
        while len(hull) >= 2 and _turn(hull[-2], hull[-1], p) <= 0.0:
            hull.pop()
        hull.append(p)
    return tuple(hull)


def efficient_points(
    points: Iterable[OperatingPoint | tuple[float, float]],
) -> tuple[OperatingPoint, ...]:
    """The points no other point beats on both time and energy (the Pareto front).

    Unlike the convex frontier these include points above a chord: when one setting runs
    for a whole interval (no time sharing), such a point may be the best single choice.

    Args:
        points: operating points, or ``(time_per_step_s, energy_per_step_j)`` pairs.

    Returns:
        The efficient points, fastest first (energy strictly decreasing).

    Raises:
        CarbonConfigError: if ``points`` is empty or holds a non-positive value.

    Example:
        >>> [p.energy_per_step_j for p in efficient_points([(1, 9), (2, 5), (3, 4), (4, 6)])]
        [9.0, 5.0, 4.0]
    """
    pts = [p if isinstance(p, OperatingPoint) else OperatingPoint(*p) for p in points]
    if not pts:
        raise CarbonConfigError("frontier: at least one operating point is needed; got none")
    pts.sort(key=lambda p: (p.time_per_step_s, p.energy_per_step_j))
    efficient: list[OperatingPoint] = []
    for p in pts:
        if not efficient or p.energy_per_step_j < efficient[-1].energy_per_step_j:
            efficient.append(p)
    return tuple(efficient)


def executed_point(points: Sequence[OperatingPoint], time_per_step_s: float) -> OperatingPoint:
    """The one setting that runs a target time per step: the least energy among the points
    at least that fast, or the fastest when none is.

    This is how the training side turns a pace into a power limit (the ``target_time``
    selector); it holds that setting until the next decision, so a target between two
    points runs at the faster one.

    Example:
        >>> executed_point([OperatingPoint(1.0, 9.0), OperatingPoint(2.0, 5.0)], 1.5)
        OperatingPoint(time_per_step_s=1.0, energy_per_step_j=9.0, label='')
    """
    meeting = [p for p in points if p.time_per_step_s <= time_per_step_s]
    if not meeting:
        return min(points, key=lambda p: p.time_per_step_s)
    return min(meeting, key=lambda p: (p.energy_per_step_j, p.time_per_step_s))


def _turn(o: OperatingPoint, a: OperatingPoint, b: OperatingPoint) -> float:
    """Positive when ``o -> a -> b`` turns left in the (time, energy) plane (``a`` below
    the chord ``o b``), relative to the scale of the points so that rounding counts as 0."""
    ax, ay = a.time_per_step_s - o.time_per_step_s, a.energy_per_step_j - o.energy_per_step_j
    bx, by = b.time_per_step_s - o.time_per_step_s, b.energy_per_step_j - o.energy_per_step_j
    cross = ax * by - ay * bx
    return 0.0 if abs(cross) <= 1e-12 * (abs(ax * by) + abs(ay * bx)) else cross


def energy_per_step_j(frontier: Sequence[OperatingPoint], time_per_step_s: float) -> float:
    """Energy of a step run at ``time_per_step_s`` by time sharing between frontier points.

    Args:
        frontier: the convex frontier (:func:`frontier_from_profile`), fastest first.
        time_per_step_s: the target; clipped to the frontier's range (a slower target is
            met by the least-energy point, which then finishes early).

    Returns:
        Joules per step, interpolated linearly between the two neighbouring points.
    """
    times = [p.time_per_step_s for p in frontier]
    energies = [p.energy_per_step_j for p in frontier]
    return float(np.interp(time_per_step_s, times, energies))


def deadline_from_max_slowdown(
    start: datetime, total_steps: int, fastest_time_per_step_s: float, max_slowdown: float
) -> datetime:
    """The deadline a job may take when it may run ``max_slowdown`` times longer than at
    full speed.

    Args:
        start: when the job starts (naive means UTC).
        total_steps: the steps of the whole job.
        fastest_time_per_step_s: seconds per step at full speed.
        max_slowdown: the allowed factor (>= 1); 1.25 means 25 % longer than full speed.

    Returns:
        ``start + total_steps * fastest_time_per_step_s * max_slowdown``, in UTC.

    Raises:
        CarbonConfigError: on a factor below 1, negative steps or a non-positive time.

    Example:
        >>> from datetime import datetime, timezone
        >>> deadline_from_max_slowdown(datetime(2023, 1, 1, tzinfo=timezone.utc), 3600, 1.0,
        ...                            1.5).isoformat()
        '2023-01-01T01:30:00+00:00'
    """
    problems = []
    if not (math.isfinite(max_slowdown) and max_slowdown >= 1.0):
        problems.append(f"max_slowdown: {max_slowdown!r} is not allowed; use a number >= 1")
    if total_steps < 0:
        problems.append(f"total_steps: {total_steps!r} is not allowed; use >= 0")
    if not (math.isfinite(fastest_time_per_step_s) and fastest_time_per_step_s > 0):
        problems.append(
            f"fastest_time_per_step_s: {fastest_time_per_step_s!r} is not allowed; use a number > 0"
        )
    if problems:
        raise CarbonConfigError(problems)
    duration_s = total_steps * fastest_time_per_step_s * max_slowdown
    return as_utc(start) + timedelta(seconds=duration_s)


@dataclass(frozen=True)
class Schedule:
    """The least-carbon way to do the remaining steps over a sequence of intervals.

    Attributes:
        steps: steps planned in each interval.
        energy_j: energy used in each interval (idle power while paused included).
        emissions_g: planned grams of CO2-equivalent, ``sum(intensity * energy)``.
        feasible: False when even full speed in every interval cannot do the work; the
            schedule then runs at full speed everywhere.
    """

    steps: FloatArray
    energy_j: FloatArray
    emissions_g: float
    feasible: bool


@dataclass(frozen=True)
class _PowerCurve:
    """The convex power-versus-rate curve of a frontier, as hull vertices."""

    rates: FloatArray
    powers_w: FloatArray

    @classmethod
    def of(cls, frontier: Sequence[OperatingPoint], idle_power_w: float | None) -> _PowerCurve:
        """Vertices by increasing rate; with ``idle_power_w`` the idle point (rate 0)
        is added and the lower hull recomputed (idling may make slow points useless)."""
        hull = sorted(frontier_from_profile(frontier), key=lambda p: -p.time_per_step_s)
        vertices = [(1.0 / p.time_per_step_s, p.power_w) for p in hull]
        if idle_power_w is not None:
            lower: list[tuple[float, float]] = [(0.0, idle_power_w)]
            for v in vertices:
                while len(lower) >= 2 and _cross(lower[-2], lower[-1], v) <= 0.0:
                    lower.pop()
                lower.append(v)
            vertices = lower
        return cls(
            np.array([v[0] for v in vertices], dtype=np.float64),
            np.array([v[1] for v in vertices], dtype=np.float64),
        )

    @property
    def slopes_j_per_step(self) -> FloatArray:
        """Marginal energy of one more step per unit time, on each segment."""
        return np.diff(self.powers_w) / np.diff(self.rates)

    @property
    def widths(self) -> FloatArray:
        """Steps per second each segment adds."""
        return np.diff(self.rates)


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def fill_cheapest(costs: FloatArray, caps: FloatArray, need: float) -> FloatArray:
    """Allocate ``need`` units to the cheapest capacities first (ties: earliest index).

    The exact solution of the fractional knapsack that both the planner and the
    benchmark's oracles solve (work placed in the cleanest intervals first).

    Returns the allocation, shaped like ``caps``. ``need`` must not exceed ``caps.sum()``.

    Example:
        >>> import numpy as np
        >>> fill_cheapest(np.array([3.0, 1.0, 2.0]), np.array([1.0, 1.0, 1.0]), 1.5).tolist()
        [0.0, 1.0, 0.5]
    """
    flat_costs, flat_caps = costs.ravel(), caps.ravel()
    order = np.lexsort((np.arange(flat_costs.size), flat_costs))
    cum = np.cumsum(flat_caps[order])
    alloc = np.zeros(flat_caps.size, dtype=np.float64)
    k = int(np.searchsorted(cum, need, side="left"))
    full = order[:k]
    alloc[full] = flat_caps[full]
    if k < order.size:
        alloc[order[k]] = need - (cum[k - 1] if k > 0 else 0.0)
    return alloc.reshape(caps.shape)


def plan_steps(
    intensity_g_per_kwh: Sequence[float] | FloatArray,
    duration_s: Sequence[float] | FloatArray,
    remaining_steps: float,
    frontier: Sequence[OperatingPoint],
    *,
    allow_pause: bool,
    idle_power_w: float = 0.0,
) -> Schedule:
    """Plan how many steps to do in each interval to emit the least carbon.

    With pausing allowed, an interval may hold any number of steps from 0 (paused at
    ``idle_power_w``) to full speed; idle power is counted for every non-working second up
    to the end of the last interval with work (a slight overestimate within that interval),
    and not after it: the job is done.
    Without pausing the job runs without a break, at least at its least-energy point,
    until it is done; the planner then also chooses the interval in which the job ends
    (finishing earlier costs nothing afterwards).

    Args:
        intensity_g_per_kwh: carbon intensity of each interval.
        duration_s: length of each interval (the last one ends at the deadline).
        remaining_steps: steps still to do (>= 0).
        frontier: operating points (the convex frontier is taken).
        allow_pause: whether the job may stop during an interval.
        idle_power_w: power drawn while paused.

    Returns:
        The schedule. When the work does not fit even at full speed, every interval runs at
        full speed and ``feasible`` is False.

    Raises:
        CarbonConfigError: on mismatched lengths or an empty frontier.
    """
    intensity = np.asarray(intensity_g_per_kwh, dtype=np.float64)
    durations = np.asarray(duration_s, dtype=np.float64)
    if intensity.shape != durations.shape or intensity.ndim != 1:
        raise CarbonConfigError(
            "plan: intensity_g_per_kwh and duration_s must be 1-D and of the same length; "
            f"got shapes {intensity.shape} and {durations.shape}"
        )
    curve = _PowerCurve.of(frontier, idle_power_w if allow_pause else None)
    return _plan(intensity, durations, float(remaining_steps), curve, allow_pause)


def _plan(
    intensity: FloatArray,
    durations: FloatArray,
    need: float,
    curve: _PowerCurve,
    allow_pause: bool,
) -> Schedule:
    r_max, p_max = float(curve.rates[-1]), float(curve.powers_w[-1])
    if need > r_max * float(durations.sum()) or durations.size == 0:
        steps = r_max * durations
        energy = p_max * durations
        return Schedule(steps, energy, float(intensity @ energy) / _J_PER_KWH, False)
    if need <= 0.0:
        zeros = np.zeros_like(durations)
        return Schedule(zeros, zeros.copy(), 0.0, True)
    slopes, widths = curve.slopes_j_per_step, curve.widths
    if allow_pause:
        alloc = fill_cheapest(np.outer(intensity, slopes), np.outer(durations, widths), need)
        steps = alloc.sum(axis=1)
        # Idle power is the same wherever the work goes; it is paid until the job is done.
        working = np.flatnonzero(steps > 0.0)
        base = curve.powers_w[0] * durations
        base[working[-1] + 1 :] = 0.0
        energy = base + alloc @ slopes
        return Schedule(steps, energy, float(intensity @ energy) / _J_PER_KWH, True)
    return _plan_without_pause(intensity, durations, need, curve)


def _plan_without_pause(
    intensity: FloatArray, durations: FloatArray, need: float, curve: _PowerCurve
) -> Schedule:
    """Try each interval in which the job could end; keep the cheapest plan.

    Before the last interval ``m`` the job runs at least at the least-energy rate for the
    whole interval; in interval ``m`` it may stop early (it is done).
    """
    r_eff, p_eff, r_max = float(curve.rates[0]), float(curve.powers_w[0]), float(curve.rates[-1])
    e_eff = p_eff / r_eff
    slopes = np.concatenate([[e_eff], curve.slopes_j_per_step])
    widths = np.concatenate([[r_eff], curve.widths])
    before = np.concatenate([[0.0], np.cumsum(durations)])
    first = int(np.searchsorted(r_max * before[1:], need, side="left"))
    last = min(int(np.searchsorted(r_eff * before[1:], need, side="left")), durations.size - 1)
    best: tuple[float, FloatArray, FloatArray] | None = None
    for m in range(first, last + 1):
        extra = need - r_eff * before[m]
        if extra < 0.0:
            break
        costs = np.outer(intensity[: m + 1], slopes)
        caps = np.outer(durations[: m + 1], widths)
        caps[:m, 0] = 0.0
        if extra > caps.sum():
            continue
        alloc = fill_cheapest(costs, caps, extra)
        energy = alloc @ slopes
        energy[:m] += p_eff * durations[:m]
        total = float(intensity[: m + 1] @ energy) / _J_PER_KWH
        if best is None or total < best[0]:
            steps = alloc.sum(axis=1)
            steps[:m] += r_eff * durations[:m]
            best = (total, steps, energy)
    assert best is not None, "the full-speed run always ends in a candidate interval"
    total, steps, energy = best
    pad = durations.size - steps.size
    return Schedule(np.pad(steps, (0, pad)), np.pad(energy, (0, pad)), total, True)


#: The shortest planning interval: a shorter last one merges into the one before it (at
#: epoch-second magnitudes a sliver can round to no width at all).
MIN_INTERVAL_S = 1.0


def interval_offsets(span_s: float, step_s: float) -> FloatArray:
    """The edges of the planning intervals from now (0) to ``span_s``: every ``step_s``,
    the last one shorter, a last one under :data:`MIN_INTERVAL_S` merged into the one
    before it.

    Example:
        >>> interval_offsets(7200.5, 3600.0).tolist()
        [0.0, 3600.0, 7200.5]
        >>> interval_offsets(9000.0, 3600.0).tolist()
        [0.0, 3600.0, 7200.0, 9000.0]
    """
    offsets = np.arange(0.0, span_s, step_s, dtype=np.float64)
    if offsets.size > 1 and span_s - offsets[-1] < MIN_INTERVAL_S:
        offsets = offsets[:-1]
    return np.append(offsets, span_s)


@dataclass(frozen=True)
class IntervalPlan:
    """A least-carbon plan holding one setting per interval.

    Attributes:
        choices: per interval, the index of the operating point held (in the order given to
            :func:`plan_intervals`), or -1 for a pause; intervals after the job is done
            hold -1 too (nothing runs and nothing is charged there).
        steps: steps done in each interval.
        energy_j: energy used in each interval (idle power while paused before the job is
            done included).
        emissions_g: planned grams, ``sum(intensity * energy)``.
        feasible: False when no such plan finishes the work by the end of the last interval.
    """

    choices: npt.NDArray[np.int64]
    steps: FloatArray
    energy_j: FloatArray
    emissions_g: float
    feasible: bool


#: Remaining-work grid of :func:`plan_intervals` (points; fewer when there are fewer steps).
PLAN_RESOLUTION = 1000
#: With a delayed start allowed, waiting must save more than this share of the grams of
#: starting now: a difference of rounding (of interval lengths at epoch-second magnitudes,
#: of mean intensities) is a tie, and a tie starts now.
DELAY_MIN_SAVING = 1e-6


def plan_intervals(
    intensity_g_per_kwh: Sequence[float] | FloatArray,
    duration_s: Sequence[float] | FloatArray,
    remaining_steps: float,
    points: Sequence[OperatingPoint],
    *,
    allow_pause: bool,
    idle_power_w: float = 0.0,
    resolution: int = PLAN_RESOLUTION,
    allow_delay: bool = False,
) -> IntervalPlan:
    """Plan the least-carbon run when every interval holds one setting or a pause.

    A dynamic program over the intervals, from the deadline backwards: the state is the
    work left (``resolution`` grid points from 0 to ``remaining_steps``, linear in between),
    and each interval either runs one of ``points`` for all of it (or until the job is done;
    nothing is charged after that) or, when allowed, pauses at ``idle_power_w``. Work left
    at the deadline costs far more than any run, so the deadline is kept whenever it can
    be. The plan is then rolled forward from the exact remaining work.

    With ``allow_delay`` the job may also wait before it starts: an interval before the
    first one that runs costs nothing (nothing is allocated yet), so the plan also chooses
    when to start; it waits only while a later start saves more than
    :data:`DELAY_MIN_SAVING` of the grams, so of two starts of the same grams the earlier
    one is taken. This is
    how :mod:`carbon.window` finds the best time to start a job that cannot pause.

    Args:
        intensity_g_per_kwh: carbon intensity of each interval.
        duration_s: length of each interval (the last one ends at the deadline).
        remaining_steps: steps still to do (>= 0).
        points: the settings the controller can hold (e.g. :func:`efficient_points`).
        allow_pause: whether the job may pause for an interval.
        idle_power_w: power drawn while paused.
        resolution: grid points for the work left.
        allow_delay: whether the job may wait, for free, before its first interval.

    Returns:
        The plan; ``feasible`` is False when even full speed cannot do the work in time.

    Raises:
        CarbonConfigError: on mismatched lengths, no points or a resolution below 1.

    Example:
        >>> pts = [OperatingPoint(1.0, 300.0), OperatingPoint(1.2, 240.0)]
        >>> plan_intervals([500.0, 100.0], [3600.0, 3600.0], 4000, pts, allow_pause=True).choices
        array([1, 1])
    """
    intensity = np.asarray(intensity_g_per_kwh, dtype=np.float64)
    durations = np.asarray(duration_s, dtype=np.float64)
    if intensity.shape != durations.shape or intensity.ndim != 1:
        raise CarbonConfigError(
            "plan: intensity_g_per_kwh and duration_s must be 1-D and of the same length; "
            f"got shapes {intensity.shape} and {durations.shape}"
        )
    if not points:
        raise CarbonConfigError("plan: at least one operating point is needed; got none")
    if resolution < 1:
        raise CarbonConfigError(f"plan: resolution {resolution!r} is not allowed; use >= 1")
    need = float(remaining_steps)
    count = durations.size
    rates = np.array([1.0 / p.time_per_step_s for p in points], dtype=np.float64)
    powers = np.array([p.power_w for p in points], dtype=np.float64)
    if need <= 0.0 or count == 0:
        zeros = np.zeros(count, dtype=np.float64)
        return IntervalPlan(np.full(count, -1), zeros, zeros.copy(), 0.0, need <= 0.0)
    grid_size = int(min(resolution, max(math.ceil(need), 1)))
    left = np.linspace(0.0, need, grid_size + 1)
    scale = intensity / _J_PER_KWH
    # Work left at the deadline: dearer per step than the dirtiest step of any plan.
    penalty = 1e6 * max(float(scale.max()), 1e-12) * float(powers.max() / rates.min())
    values = [penalty * left]
    for t in range(count - 1, -1, -1):
        best = _option_costs(
            left, values[-1], left, scale[t], durations[t], rates, powers, allow_pause, idle_power_w
        ).min(axis=0)
        best[0] = 0.0
        if allow_delay:  # not started yet (all the work left): waiting is free
            best[-1] = min(best[-1], values[-1][-1])
        values.append(best)
    values.reverse()
    choices = np.full(count, -1, dtype=np.int64)
    steps = np.zeros(count, dtype=np.float64)
    energy = np.zeros(count, dtype=np.float64)
    work = need
    for t in range(count):
        if work <= 0.0:
            break
        costs = _option_costs(
            np.array([work]),
            values[t + 1],
            left,
            scale[t],
            durations[t],
            rates,
            powers,
            allow_pause,
            idle_power_w,
        )[:, 0]
        k = int(np.argmin(costs))
        later_g = float(values[t + 1][-1])
        if allow_delay and work == need and later_g < costs[k] * (1.0 - DELAY_MIN_SAVING):
            continue  # not started: choice -1, nothing charged (a tie starts now)
        if k < rates.size:
            run_s = min(float(durations[t]), work / rates[k])
            choices[t], steps[t], energy[t] = k, rates[k] * run_s, powers[k] * run_s
            work -= steps[t]
        else:
            energy[t] = idle_power_w * durations[t]
    return IntervalPlan(
        choices, steps, energy, float(intensity @ energy) / _J_PER_KWH, bool(work <= 1e-6 * need)
    )


def _option_costs(
    work: FloatArray,
    next_values: FloatArray,
    grid: FloatArray,
    scale: float,
    duration_s: float,
    rates: FloatArray,
    powers: FloatArray,
    allow_pause: bool,
    idle_power_w: float,
) -> FloatArray:
    """Grams from the start of one interval on, per option (each point, then the pause when
    allowed) and per amount of ``work`` left; ``next_values`` are those of the next
    interval on ``grid``."""
    done = rates * duration_s
    finish = scale * powers[:, None] * work[None, :] / rates[:, None]
    after = np.interp(work[None, :] - done[:, None], grid, next_values)
    go_on = scale * powers[:, None] * duration_s + after
    costs = np.where(work[None, :] <= done[:, None], finish, go_on)
    if allow_pause:
        pause = scale * idle_power_w * duration_s + np.interp(work, grid, next_values)
        costs = np.vstack([costs, pause[None, :]])
    return costs


class IntensityOutlook:
    """The intensity to expect over coming intervals: the current value, then a forecast,
    then, past its end, a daily profile fitted on the intensities seen and the forecast.

    Pacing and the best start (:mod:`carbon.window`) expect the same intensities from the
    same inputs: both use this class with its defaults.

    Args:
        forecaster: continues a short or missing forecast; by default a
            :class:`~carbon.forecast.DailyProfileForecaster` whose level persists for a day.
        history_s: how much recorded history to keep for it.

    Example:
        >>> out = IntensityOutlook()
        >>> out.means(0.0, 100.0, [], np.array([0.0, 3600.0, 7200.0]), 3600.0).tolist()
        [100.0, 100.0]
    """

    def __init__(
        self, forecaster: DailyProfileForecaster | None = None, history_s: float = 7 * _DAY_S
    ) -> None:
        self._forecaster = forecaster or DailyProfileForecaster(level_decay_s=_DAY_S)
        self._history_s = history_s
        self._history: dict[float, float] = {}
        self._oldest_s = math.inf

    def record(self, time_s: float, intensity_g_per_kwh: float) -> None:
        """Remember an observed intensity (epoch seconds); old ones are dropped."""
        self._history[time_s] = intensity_g_per_kwh
        self._oldest_s = min(self._oldest_s, time_s)
        horizon = time_s - self._history_s
        if self._oldest_s < horizon - 0.1 * self._history_s:
            self._history = {t: v for t, v in self._history.items() if t >= horizon}
            self._oldest_s = min(self._history)

    def means(
        self,
        now_s: float,
        intensity_now_g_per_kwh: float,
        forecast: Sequence[IntensityPoint],
        edges_s: FloatArray,
        step_s: float,
    ) -> FloatArray:
        """Mean expected intensity over each ``[edges_s[i], edges_s[i + 1])``.

        Each value holds until the next one: the current intensity from ``now_s``, then the
        forecast points after ``now_s`` (the last one for the forecast's typical spacing),
        then profile predictions every ``step_s``.

        Args:
            now_s: the current time, epoch seconds.
            intensity_now_g_per_kwh: the current intensity.
            forecast: forecast points, any order (those at or before now are ignored).
            edges_s: increasing interval edges, from ``now_s`` on.
            step_s: spacing of the profile predictions (and of a one-point forecast).

        Returns:
            One mean per interval.
        """
        ahead = sorted(
            (p.time.timestamp(), p.intensity_g_per_kwh)
            for p in forecast
            if p.time.timestamp() > now_s
        )
        knot_t = np.array([now_s] + [t for t, _ in ahead], dtype=np.float64)
        knot_v = np.array([intensity_now_g_per_kwh] + [v for _, v in ahead], dtype=np.float64)
        spacing = float(np.median(np.diff(knot_t[1:]))) if len(ahead) > 1 else step_s
        known_until = knot_t[-1] + spacing
        if known_until < edges_s[-1]:
            ext_t = np.arange(known_until, edges_s[-1], step_s, dtype=np.float64)
            self._fit(knot_t, knot_v)
            knot_t = np.concatenate([knot_t, ext_t])
            knot_v = np.concatenate([knot_v, self._forecaster.predict_arrays(ext_t)])
        cum = np.concatenate([[0.0], np.cumsum(knot_v[:-1] * np.diff(knot_t))])
        k = np.searchsorted(knot_t, edges_s, side="right") - 1
        integral = cum[k] + knot_v[k] * (edges_s - knot_t[k])
        return np.diff(integral) / np.diff(edges_s)

    def worst_same_time_of_day(
        self,
        times_s: FloatArray,
        days: int = 7,
        window_s: float | FloatArray = 0.0,
    ) -> FloatArray:
        """The dirtiest intensity recorded around the same time of day on each of the past
        ``days`` days before each of ``times_s`` (NaN where nothing was recorded).

        A value counts when it was in force within ``window_s`` of that time of day: the
        one recorded last before the window opens (if at most an hour before) and every
        one recorded inside it.

        Args:
            times_s: the times (epoch seconds).
            days: how many past days to look at.
            window_s: how far around the time of day to look, one value or one per time
                (0: the value in force at that time of day only).

        Returns:
            One value per time.
        """
        hist_t = np.array(sorted(self._history), dtype=np.float64)
        hist_v = np.array([self._history[t] for t in hist_t], dtype=np.float64)
        times = np.asarray(times_s, dtype=np.float64)
        window = np.broadcast_to(np.asarray(window_s, dtype=np.float64), times.shape)
        worst = np.full(times.shape, np.nan)
        if hist_t.size == 0 or times.size == 0:
            return worst
        padded = np.append(hist_v, -np.inf)  # reduceat may start at the end
        for k in range(1, days + 1):
            q = times - k * 86400.0
            before = np.searchsorted(hist_t, q - window, side="right") - 1
            recent = (before >= 0) & (q - window - hist_t[np.maximum(before, 0)] <= 3600.0)
            lo = np.where(recent, before, before + 1)
            hi = np.searchsorted(hist_t, q + window, side="right")
            found = np.maximum.reduceat(padded, np.column_stack([lo, hi]).ravel())[::2]
            worst = np.fmax(worst, np.where(hi > lo, found, np.nan))
        return worst

    def _fit(self, knot_t: FloatArray, knot_v: FloatArray) -> None:
        past = [(t, v) for t, v in self._history.items() if t < knot_t[0]]
        times = np.concatenate([np.array([t for t, _ in past], dtype=np.float64), knot_t])
        values = np.concatenate([np.array([v for _, v in past], dtype=np.float64), knot_v])
        self._forecaster.fit_arrays(times, values)
