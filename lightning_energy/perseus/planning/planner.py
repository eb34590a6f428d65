"""Per-instruction GPU frequency planning for pipeline-parallel training (Perseus).

In pipeline parallelism most instructions are not on the critical path: they can run at a
lower clock, and so use less energy, without lengthening the iteration (Chung et al.,
"Reducing Energy Bloat in Large Model Training", SOSP'24). Given a :class:`PipelineProfile`
and a :class:`PipelineSchedule`, :class:`PerseusPlanner` computes

* the **iteration time-energy frontier**: the least energy for every iteration time from
  the all-fastest one to the energy-optimal one (:meth:`PerseusPlanner.frontier`);
* the plan for **no slowdown** (the all-fastest iteration time), for a **target time**
  (e.g. the carbon policy's), or for the **energy-optimal** point.

Every plan comes with its iteration time and energy under the objective of
:func:`~lightning_energy.perseus.planning.plan.evaluate`, and with a lower bound from the
convex relaxation (see :mod:`~lightning_energy.perseus.planning.solver`) that no plan at that
time can beat.

Example:
    >>> from lightning_energy.perseus import PipelineProfile, one_f_one_b
    >>> rows = []
    >>> for s in range(2):
    ...     for kind, t0 in (("forward", 0.02), ("backward", 0.04)):
    ...         for f in (1410, 1200, 1000):
    ...             t = t0 * 1410 / f
    ...             rows.append((s, kind, f, t, t * (80 + 300 * (f / 1410) ** 3)))
    >>> planner = PerseusPlanner(PipelineProfile.from_rows(rows, blocked_power_w=70.0),
    ...                          one_f_one_b(2, 4))
    >>> point = planner.plan_no_slowdown()
    >>> point.iteration_time_s <= planner.min_iteration_time_s + 1e-12
    True
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_energy.errors import ConfigError
from lightning_energy.perseus.planning.plan import Plan
from lightning_energy.perseus.planning.profile import PipelineProfile
from lightning_energy.perseus.planning.schedule import PipelineSchedule
from lightning_energy.perseus.planning.solver import FloatArray, IntArray, LPSolution, Solver

__all__ = ["Frontier", "FrontierPoint", "PerseusPlanner", "ProgressCallback"]

log = logging.getLogger(__name__)

#: ``callback(done, total)``: planning progress in work units.
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class FrontierPoint:
    """A plan with its iteration time and energy.

    Attributes:
        iteration_time_s: longest path through the schedule DAG under the plan.
        energy_j: energy of one iteration (compute + blocked) under the plan.
        plan: the clock of every instruction.
        lower_bound_j: energy no plan with this iteration time can beat (convex
            relaxation), when computed for this point; None otherwise.
    """

    iteration_time_s: float
    energy_j: float
    plan: Plan
    lower_bound_j: float | None = None

    @property
    def gap(self) -> float | None:
        """Relative distance to the lower bound (0.001 = 0.1 %), when known."""
        if self.lower_bound_j is None:
            return None
        return (self.energy_j - self.lower_bound_j) / self.lower_bound_j


class Frontier(Sequence[FrontierPoint]):
    """Pareto-optimal plans sorted by iteration time (energy strictly falling).

    Args:
        points: candidate plans; dominated ones are dropped.
        baseline: the all-fastest plan, for reporting savings.

    Raises:
        ConfigError: no point.
    """

    def __init__(self, points: Sequence[FrontierPoint], baseline: FrontierPoint) -> None:
        if not points:
            raise ConfigError("frontier: at least one point is needed")
        kept: list[FrontierPoint] = []
        for point in sorted(points, key=lambda p: (p.iteration_time_s, p.energy_j)):
            if not kept or point.energy_j < kept[-1].energy_j - 1e-9:
                kept.append(point)
        self._points = kept
        self._times = [p.iteration_time_s for p in kept]
        self.baseline = baseline

    def __len__(self) -> int:
        return len(self._points)

    def __getitem__(self, i: int) -> FrontierPoint:  # type: ignore[override]
        return self._points[i]

    def __iter__(self) -> Iterator[FrontierPoint]:
        return iter(self._points)

    @property
    def fastest(self) -> FrontierPoint:
        """The least-energy plan at the minimum iteration time (no slowdown)."""
        return self._points[0]

    @property
    def energy_optimal(self) -> FrontierPoint:
        """The least-energy plan of all."""
        return self._points[-1]

    def at(self, target_s: float) -> FrontierPoint:
        """The least-energy plan whose iteration time is at most ``target_s``.

        A target below the minimum iteration time gets the fastest plan.
        """
        i = bisect.bisect_right(self._times, target_s + 1e-12) - 1
        return self._points[max(i, 0)]

    def summary(self, rows: int = 8) -> list[tuple[float, float, float]]:
        """About ``rows`` evenly spaced ``(time_s, energy_j, saving vs baseline)`` rows,
        always including both ends."""
        n = len(self._points)
        picks = sorted({round(k * (n - 1) / max(rows - 1, 1)) for k in range(rows)})
        base = self.baseline.energy_j
        return [
            (p.iteration_time_s, p.energy_j, 1.0 - p.energy_j / base)
            for p in (self._points[i] for i in picks)
        ]


class PerseusPlanner:
    """Plans the clock of every instruction of a pipeline schedule.

    Args:
        profile: per-stage, per-instruction, per-frequency time and energy.
        schedule: the pipeline schedule (stages must match the profile's).
        variants: perturbed copies per plan and round of the local search.
        rounds: perturbation rounds for the plans asked for one by one (and the ends and
            anchors of the frontier).
        exact_max_options: instances whose options (Pareto-optimal clocks, summed over all
            instructions) are at most this many are solved exactly by mixed-integer
            programming; larger ones by relaxation, rounding and local search.
        seed: seed of the perturbations; plans are reproducible.

    Raises:
        ProfileError: the profile does not match the schedule.
        ConfigError: ``variants`` or ``rounds`` negative.
    """

    def __init__(
        self,
        profile: PipelineProfile,
        schedule: PipelineSchedule,
        *,
        variants: int = 24,
        rounds: int = 3,
        exact_max_options: int = 48,
        seed: int = 0,
    ) -> None:
        problems = [
            f"{k}: {v!r} is not allowed; use >= 0"
            for k, v in (("variants", variants), ("rounds", rounds))
            if v < 0
        ]
        if problems:
            raise ConfigError(problems, source="PerseusPlanner")
        self.profile = profile
        self.schedule = schedule
        self.variants = variants
        self.rounds = rounds
        self._solver = Solver(profile, schedule, seed=seed)
        self.exact = self._solver.num_options <= exact_max_options
        self._min_time_s = self._solver.min_iteration_time_s()
        self._relaxed: dict[float | None, LPSolution] = {}

    @property
    def min_iteration_time_s(self) -> float:
        """Iteration time with every instruction at its fastest clock."""
        return self._min_time_s

    def baseline(self) -> FrontierPoint:
        """Every instruction at its fastest clock (what runs without planning)."""
        sel = self._solver.fastest()
        return self._point(sel, *self._evaluate_one(sel))

    def _evaluate_one(self, sel: IntArray) -> tuple[float, float]:
        t, e = self._solver.evaluate(sel[:, None])
        return float(t[0]), float(e[0])

    def _point(
        self, sel: IntArray, time_s: float, energy_j: float, bound_j: float | None = None
    ) -> FrontierPoint:
        metadata = {"iteration_time_s": time_s, "energy_j": energy_j}
        if bound_j is not None:
            metadata["lower_bound_j"] = bound_j
        plan = Plan(self.schedule, self._solver.frequencies(sel), metadata)
        return FrontierPoint(time_s, energy_j, plan, bound_j)

    def relaxation(self, iteration_time_s: float | None) -> LPSolution:
        """The convex relaxation at a deadline (None: free, energy-optimal); cached."""
        key = None if iteration_time_s is None else float(iteration_time_s)
        if key not in self._relaxed:
            solution = self._solver.relaxation(key)
            self._relaxed[key] = solution
            if key is None:
                # The free optimum is also the solution at its own deadline.
                self._relaxed.setdefault(solution.iteration_time_s, solution)
        return self._relaxed[key]

    def energy_optimal_time_s(self) -> float:
        """The iteration time of the relaxation's energy optimum (never below the minimum)."""
        return max(self.relaxation(None).iteration_time_s, self._min_time_s)

    # ------------------------------------------------------------------ plans
    def plan_for_time(self, target_s: float) -> FrontierPoint:
        """The least-energy plan (found) whose iteration time is at most ``target_s``.

        Targets below the minimum iteration time get the no-slowdown plan; targets beyond
        the energy-optimal time get the energy-optimal plan (running slower would only
        waste energy).
        """
        if self.exact:
            return self._exact_point(max(float(target_s), self._min_time_s))
        deadline = min(max(float(target_s), self._min_time_s), self.energy_optimal_time_s())
        solution = self.relaxation(deadline)
        sel, t, e = self._solver.plan_batch(
            [(solution.durations_s, solution.starts_s)],
            [deadline],
            variants=self.variants,
            rounds=self.rounds,
        )
        return self._point(sel[:, 0], float(t[0]), float(e[0]), solution.energy_j)

    def plan_no_slowdown(self) -> FrontierPoint:
        """The least-energy plan (found) at the all-fastest iteration time."""
        return self.plan_for_time(self._min_time_s)

    def plan_energy_optimal(self) -> FrontierPoint:
        """The least-energy plan (found) at any iteration time."""
        if self.exact:
            return self._exact_point(None)
        return self.plan_for_time(self.energy_optimal_time_s())

    def _exact_point(self, deadline_s: float | None) -> FrontierPoint:
        """The optimal plan within ``deadline_s`` (None: any), by branch and bound (with
        a blocked power per clock: optimal for the lowest one, and bounded by it).

        The MILP meets its bounds up to the solver's feasibility tolerance; a plan that
        overshoots the deadline by that much is re-solved with the deadline pulled in.
        """
        limit = deadline_s
        margin_s = 0.0
        for _ in range(8):
            found = self._solver.exact(limit)
            if found is None:
                break
            sel, bound_j = found
            time_s, energy_j = self._evaluate_one(sel)
            if deadline_s is None or time_s <= deadline_s + 1e-12:
                return self._point(sel, time_s, energy_j, min(energy_j, bound_j))
            margin_s = max(2 * margin_s, 2 * (time_s - deadline_s), 1e-7 * deadline_s)
            limit = deadline_s - margin_s
        # Only reachable at the minimum time with a tolerance problem: all-fastest is exact.
        sel = self._solver.fastest()
        return self._point(sel, *self._evaluate_one(sel))

    def _exact_frontier(self, progress: ProgressCallback | None) -> Frontier:
        """Every Pareto-optimal plan, from the energy optimum down to the minimum time
        (epsilon-constraint method: each plan bounds the next one's time strictly below)."""
        points = [self._exact_point(None)]
        while points[-1].iteration_time_s > self._min_time_s * (1 + 1e-12):
            last = points[-1].iteration_time_s
            # Steps of 1e-6 relative clear the solver's feasibility tolerance.
            point = self._exact_point(last * (1 - 1e-6))
            if point.iteration_time_s >= last:
                break
            points.append(point)
            if progress is not None:
                progress(len(points), len(points) + 1)
        return Frontier(points, self.baseline())

    # --------------------------------------------------------------- frontier
    def frontier(
        self,
        *,
        time_step_s: float | None = None,
        anchors: int = 2,
        progress: ProgressCallback | None = None,
    ) -> Frontier:
        """The iteration time-energy frontier from no slowdown to the energy optimum.

        The relaxation is solved at both ends and at ``anchors`` evenly spaced times in
        between; every grid time starts from the interpolation of its two neighbouring
        relaxed solutions, is rounded and improved by local search (the ends and anchors
        also by iterated local search), all grid points at once. Small instances (see
        ``exact_max_options``) get every Pareto-optimal plan exactly instead, and ignore
        ``time_step_s`` and ``anchors``.

        Args:
            time_step_s: spacing of the grid of iteration times (default: the smaller of
                1 ms and 0.1 % of the minimum iteration time).
            anchors: relaxations solved between the ends.
            progress: ``callback(done, total)`` after each unit of work.

        Returns:
            The Pareto-optimal plans found, fastest first.

        Raises:
            ConfigError: ``time_step_s`` not positive or ``anchors`` negative.
        """
        problems = []
        if time_step_s is not None and not time_step_s > 0:
            problems.append(f"time_step_s: {time_step_s!r} is not allowed; use > 0")
        if anchors < 0:
            problems.append(f"anchors: {anchors!r} is not allowed; use >= 0")
        if problems:
            raise ConfigError(problems, source="frontier")
        if self.exact:
            return self._exact_frontier(progress)
        t_min = self._min_time_s
        step = time_step_s if time_step_s is not None else min(1e-3, t_min / 1000)
        total = anchors + 2 + 1 + self.rounds
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total)

        t_opt = self.energy_optimal_time_s()
        tick()
        anchor_times = np.linspace(t_min, t_opt, anchors + 2) if t_opt > t_min else [t_min]
        solutions = []
        for t in anchor_times:
            solutions.append(self.relaxation(float(t)))
            tick()
        count = max(int(np.ceil((t_opt - t_min) / step)), 0) + 1
        grid = np.linspace(t_min, t_opt, count) if count > 1 else np.array([t_min])
        # Interpolate the relaxed solutions (durations and starts) between anchors: a convex
        # combination of feasible schedules is feasible for the combined deadline.
        init = []
        for t in grid:
            j = min(int(np.searchsorted(anchor_times, t, side="right")) - 1, len(solutions) - 1)
            lo = solutions[j]
            hi = solutions[min(j + 1, len(solutions) - 1)]
            span = hi.iteration_time_s - lo.iteration_time_s
            w = 0.0 if span <= 0 else (t - lo.iteration_time_s) / span
            init.append(
                (
                    (1 - w) * lo.durations_s + w * hi.durations_s,
                    (1 - w) * lo.starts_s + w * hi.starts_s,
                )
            )
        sel, times, energies = self._solver.plan_batch(init, list(grid), variants=0, rounds=0)
        tick()
        # Anchors (both ends included) get the full iterated local search.
        anchor_sel, anchor_t, anchor_e = self._solver.plan_batch(
            [(s.durations_s, s.starts_s) for s in solutions],
            [s.iteration_time_s for s in solutions],
            variants=self.variants,
            rounds=self.rounds,
            progress=tick,
        )
        all_sel = np.hstack([sel, anchor_sel])
        all_t = np.concatenate([times, anchor_t])
        all_e = np.concatenate([energies, anchor_e])
        bounds: list[float | None] = [None] * len(times) + [s.energy_j for s in solutions]
        points = [
            self._point(all_sel[:, k], float(all_t[k]), float(all_e[k]), bounds[k])
            for k in _pareto(all_t, all_e)
        ]
        return Frontier(points, self.baseline())


def _pareto(times_s: FloatArray, energies_j: FloatArray) -> list[int]:
    """Indices of the points no other point beats in both time and energy, by time."""
    kept: list[int] = []
    best = np.inf
    for k in np.lexsort((energies_j, times_s)).tolist():
        if energies_j[k] < best - 1e-9:
            kept.append(k)
            best = energies_j[k]
    return kept
