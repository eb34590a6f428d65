"""The numerical core of the planner: the time-cost tradeoff on a schedule DAG.

Problem (fixed iteration time ``T``): choose one profiled clock per instruction so that the
longest path is at most ``T`` and the energy is least. With ``P`` the blocked power and
``D`` the number of devices, ``E = sum(e_i) + P * (D * T - sum(t_i))``, so at fixed ``T``
the planner minimises ``sum(c_i)`` with the *effective cost* ``c_i = e_i - P * t_i`` of
each instruction (as Perseus does, SOSP'24). This is the discrete time-cost tradeoff
problem (De, Dunne, Ghosh and Wells, 1997), NP-hard in general; the solver is built from
two exact pieces and one heuristic:

1. **Convex relaxation, exactly.** Each instruction's effective cost is replaced by the
   lower convex hull of its Pareto-optimal options; the relaxed problem is the classic
   linear time-cost tradeoff (Fulkerson 1961, Kelley 1961), an LP over start times and
   per-segment durations, solved by HiGHS. Its value is a lower bound on every plan with
   that iteration time and is convex and piecewise linear in ``T``: a convex combination
   of solutions at two times is feasible (and near-optimal) in between.
2. **Rounding that keeps the deadline.** Every relaxed duration is rounded down to the
   slowest profiled option not slower than it; the relaxed schedule stays feasible.
3. **Local search that only improves.** Forward and backward passes over the DAG move
   every instruction as early (late) as its neighbours allow and give it the slowest
   option fitting its window; iterated with random perturbations (round some instructions
   one option faster, re-time, search again), keeping the best plan. All of it is
   vectorised over a batch of (time target, perturbation) pairs, so a whole frontier costs
   about as much as one point.

With a blocked power per clock (a GPU blocked in NCCL spins at the locked clock), each
wait draws the blocked power of the clock in force during it (:class:`DeviceWaits`):
plans are evaluated that way, exactly. The search above (and the exact program below)
runs with ``P`` the lowest blocked power of the profile, the power every wait draws at
least: the relaxation stays a lower bound, and the plans found are compared at their
exact energy.

The gap to the lower bound is reported with each plan. On the shipped profiles it is
about 0.1 % at the fastest iteration time. Small instances are solved exactly instead
(:meth:`Solver.exact`: the discrete problem as a mixed-integer program, HiGHS branch and
bound; with a blocked power per clock, exactly for the lowest one, which bounds the rest).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from numpy.typing import NDArray
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from lightning_energy.errors import EnergyError, ProfileError
from lightning_energy.perseus.planning.profile import InstructionProfile, PipelineProfile
from lightning_energy.perseus.planning.schedule import PipelineSchedule

__all__ = ["DeviceWaits", "LPSolution", "OptionTable", "Solver"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

# Absolute time tolerance when comparing durations with windows (seconds).
_EPS_S = 1e-12


@dataclass(frozen=True)
class OptionTable:
    """The Pareto-optimal options of one instruction kind on one stage, fastest first.

    Attributes:
        frequencies_mhz: clock of each option.
        times_s: time of each option (ascending).
        energies_j: energy of each option.
        costs_j: effective cost ``energy - blocked_power * time`` (descending), with the
            profile's lowest blocked power.
        hull: indices of the lower convex hull vertices of ``(time, cost)``, ascending.
        blocked_w: blocked power at each option's clock (what a wait before the option
            draws).
    """

    frequencies_mhz: IntArray
    times_s: FloatArray
    energies_j: FloatArray
    costs_j: FloatArray
    hull: IntArray
    blocked_w: FloatArray

    @classmethod
    def build(cls, entry: InstructionProfile, profile: PipelineProfile) -> OptionTable:
        """Keep the options no other option beats in both time and effective cost."""
        freqs = np.asarray(entry.frequencies_mhz, dtype=np.int64)
        times = np.asarray(entry.times_s, dtype=np.float64)
        energies = np.asarray(entry.energies_j, dtype=np.float64)
        blocked = np.asarray([profile.blocked_power_at(int(f)) for f in freqs], dtype=np.float64)
        costs = energies - profile.min_blocked_power_w * times
        order = np.lexsort((costs, times))
        keep: list[int] = []
        best = np.inf
        for i in order:
            if costs[i] < best:
                keep.append(int(i))
                best = costs[i]
        idx = np.asarray(keep, dtype=np.int64)
        t, c = times[idx], costs[idx]
        hull: list[int] = []
        for k in range(len(idx)):
            while len(hull) >= 2:
                a, b = hull[-2], hull[-1]
                # Drop b when it lies on or above the segment a -> k.
                if (c[b] - c[a]) * (t[k] - t[a]) >= (c[k] - c[a]) * (t[b] - t[a]):
                    hull.pop()
                else:
                    break
            hull.append(k)
        return cls(freqs[idx], t, energies[idx], c, np.asarray(hull, dtype=np.int64), blocked[idx])


class DeviceWaits:
    """Where each device of a schedule waits, and at which clock.

    A device runs its instructions in order, each as soon as its inputs are there (the
    earliest schedule). Before each instruction it waits for its input at that
    instruction's clock (the runtime sets the clock, then receives), and after its last
    one it waits for the iteration's end at the last clock. A wait draws the blocked power
    of its clock.

    Args:
        schedule: the pipeline schedule (its nodes are laid out device by device, in
            execution order).
    """

    def __init__(self, schedule: PipelineSchedule) -> None:
        n = len(schedule.nodes)
        self.before = np.arange(-1, n - 1)  # the previous node of the device
        self.last = np.empty(schedule.num_devices, dtype=np.int64)
        first = 0
        for device, order in enumerate(schedule.device_orders):
            self.before[first] = n  # padding row: the iteration's start (time 0)
            first += len(order)
            self.last[device] = first - 1

    def blocked_energy_j(
        self,
        starts_s: FloatArray,
        times_s: FloatArray,
        blocked_w: FloatArray,
        iteration_s: FloatArray,
    ) -> FloatArray:
        """Energy of every device's waits over one iteration, for a batch of plans.

        Args:
            starts_s: start of every node (nodes, batch).
            times_s: duration of every node (nodes, batch).
            blocked_w: blocked power at every node's clock (nodes, batch).
            iteration_s: the iteration time of each plan (batch,).

        Returns:
            The blocked energy of each plan (batch,).
        """
        finish = np.vstack([starts_s + times_s, np.zeros((1, starts_s.shape[1]))])
        waits = starts_s - finish[self.before]
        tail = iteration_s[None, :] - finish[self.last]
        return np.asarray(
            (blocked_w * waits).sum(axis=0) + (blocked_w[self.last] * tail).sum(axis=0)
        )


@dataclass(frozen=True)
class LPSolution:
    """A solution of the convex relaxation.

    Attributes:
        iteration_time_s: the deadline it was solved for (or chose, when free).
        durations_s: relaxed duration of every node.
        starts_s: start time of every node (a feasible schedule for the durations).
        energy_j: relaxed energy: a lower bound for any plan with this iteration time.
    """

    iteration_time_s: float
    durations_s: FloatArray
    starts_s: FloatArray
    energy_j: float


class Solver:
    """Planning machinery for one profile and one schedule.

    Args:
        profile: the measurements; its stages must match the schedule's.
        schedule: the pipeline schedule.
        seed: seed of the random perturbations (plans are reproducible).

    Raises:
        ProfileError: the profile lacks stages or instructions the schedule needs.
    """

    def __init__(self, profile: PipelineProfile, schedule: PipelineSchedule, seed: int = 0) -> None:
        if profile.num_stages != schedule.num_stages:
            raise ProfileError(
                f"the profile has {profile.num_stages} stages but the schedule "
                f"{schedule.name!r} has {schedule.num_stages}"
            )
        self.profile = profile
        self.schedule = schedule
        #: The lowest blocked power of the profile: the search's (and bound's) model.
        self.blocked_power_w = profile.min_blocked_power_w
        self.num_devices = schedule.num_devices
        self._waits = DeviceWaits(schedule)
        self._rng = np.random.default_rng(seed)
        classes: dict[tuple[int, str], int] = {}
        self.tables: list[OptionTable] = []
        node_class = []
        for inst in schedule.nodes:
            key = (inst.stage, inst.kind)
            if key not in classes:
                classes[key] = len(self.tables)
                self.tables.append(OptionTable.build(profile.entry(*key), profile))
            node_class.append(classes[key])
        self.node_class = np.asarray(node_class, dtype=np.int64)
        self.num_nodes = len(node_class)
        self._dag = _LevelledDAG(schedule, self.node_class, self.tables)
        self._lp: _HullLP | None = None
        self._milp: _ExactMILP | None = None

    # ---------------------------------------------------------------- helpers
    def fastest(self) -> IntArray:
        """Option index 0 (the fastest) for every node."""
        return np.zeros(self.num_nodes, dtype=np.int64)

    def min_iteration_time_s(self) -> float:
        """The iteration time with every instruction at its fastest option."""
        t, _ = self.evaluate(self.fastest()[:, None])
        return float(t[0])

    def frequencies(self, sel: IntArray) -> tuple[int, ...]:
        """Clocks of an option selection (one per node)."""
        return tuple(self._dag.freqs[self._dag.node_start + sel].tolist())

    def evaluate(self, sel: IntArray) -> tuple[FloatArray, FloatArray]:
        """Iteration times and energies of a batch of selections (nodes, batch), each
        wait at the blocked power of its clock (:class:`DeviceWaits`)."""
        dag = self._dag
        times = dag.gather(dag.times, sel)
        start = dag.asap(times)[:-1]
        iteration = (start + times).max(axis=0)
        blocked_j = self._waits.blocked_energy_j(
            start, times, dag.gather(dag.blocked, sel), iteration
        )
        return iteration, dag.gather(dag.energies, sel).sum(axis=0) + blocked_j

    def asap(self, sel: IntArray) -> FloatArray:
        """Earliest start of every node for a batch of selections (nodes, batch)."""
        return self._dag.asap(self._dag.gather(self._dag.times, sel))[:-1]

    # --------------------------------------------------------------- relaxation
    def relaxation(self, iteration_time_s: float | None) -> LPSolution:
        """Solve the convex relaxation at a deadline, or with a free one (energy-optimal).

        Raises:
            EnergyError: the LP solver failed (a deadline below the minimum time).
        """
        if self._lp is None:
            self._lp = _HullLP(self)
        return self._lp.solve(iteration_time_s)

    def round_down(self, durations_s: FloatArray) -> IntArray:
        """Per node, the slowest option not slower than the relaxed duration (nodes, batch)."""
        nodes = np.arange(self.num_nodes)
        k = self._dag.slowest_fitting(nodes, durations_s)
        return np.maximum(k, 0)

    def project(self, sel: IntArray, starts_s: FloatArray, deadline_s: FloatArray) -> FloatArray:
        """A feasible schedule for ``sel`` close to ``starts_s``: each node starts at its
        planned start or when its predecessors finish, whichever is later. Falls back to
        the earliest schedule where that overshoots the deadline (numerical tolerance)."""
        dag = self._dag
        times = dag.gather(dag.times, sel)
        start = dag.asap(times, not_before=starts_s)[:-1]
        late = (start + times).max(axis=0) > deadline_s + _EPS_S
        if np.any(late):
            start[:, late] = dag.asap(times[:, late])[:-1]
        return start

    # ------------------------------------------------------------- local search
    def local_search(
        self, sel: IntArray, start: FloatArray, deadline_s: FloatArray, passes: int = 3
    ) -> IntArray:
        """Slow instructions down as far as their windows allow, keeping every deadline.

        Each pass moves every node as early as its predecessors allow (in topological
        order) and extends it to the slowest option that ends before its successors start,
        then does the mirror image backwards. The schedule stays feasible and no node gets
        faster, so the cost never rises.

        Args:
            sel: option index per node and batch member (nodes, batch); updated in place.
            start: a feasible schedule for ``sel`` (nodes, batch).
            deadline_s: the deadline of each batch member (batch,).
            passes: forward-backward passes.

        Returns:
            ``sel``.
        """
        dag = self._dag
        batch = sel.shape[1]
        # Positions of the selected options in the concatenated tables.
        pos_of = dag.node_start[:, None] + sel
        # One extra row: finish reads it as 0 (no predecessor), start as the deadline.
        cur_start = np.vstack([start, deadline_s[None, :]])
        for _ in range(passes):
            finish = np.zeros((self.num_nodes + 1, batch))
            for level in dag.levels:
                ready = finish[level.preds].max(axis=1)
                limit = cur_start[level.succs].min(axis=1)
                pos = np.maximum(dag.fit_level(level, limit - ready), pos_of[level.nodes])
                pos_of[level.nodes] = pos
                finish[level.nodes] = ready + dag.times[pos]
            new_start = np.empty_like(cur_start)
            new_start[-1] = deadline_s
            for level in reversed(dag.levels):
                limit = new_start[level.succs].min(axis=1)
                ready = finish[level.preds].max(axis=1)
                pos = np.maximum(dag.fit_level(level, limit - ready), pos_of[level.nodes])
                pos_of[level.nodes] = pos
                new_start[level.nodes] = limit - dag.times[pos]
            cur_start = new_start
        sel[:] = pos_of - dag.node_start[:, None]
        return sel

    def iterated_local_search(
        self,
        sel: IntArray,
        start: FloatArray,
        deadline_s: FloatArray,
        *,
        variants: int,
        rounds: int,
        progress: Callable[[], None] | None = None,
    ) -> tuple[IntArray, FloatArray, FloatArray]:
        """Local search, then rounds of perturb-and-search keeping each point's best plan.

        Args:
            sel: initial option selection (nodes, points), feasible for ``deadline_s``.
            start: a feasible schedule for it.
            deadline_s: deadline of each point (points,).
            variants: perturbed copies per point per round (0: plain local search).
            rounds: perturbation rounds.
            progress: called after each round.

        Returns:
            ``(sel, iteration_times_s, energies_j)`` of the best plan of every point.
        """
        best = self.local_search(sel, start, deadline_s)
        best_t, best_e = self.evaluate(best)
        points = best.shape[1]
        if variants == 0:
            return best, best_t, best_e
        # Perturbation strengths spread over the variants: gentle and strong kicks.
        strength = np.linspace(0.03, 0.25, variants)
        for _ in range(rounds):
            cand = np.repeat(best, variants, axis=1)
            kick = self._rng.random(cand.shape) < np.tile(strength, points)
            cand = np.maximum(cand - kick, 0)
            deadlines = np.repeat(deadline_s, variants)
            cand = self.local_search(cand, self.asap(cand), deadlines)
            t, e = self.evaluate(cand)
            e = e.reshape(points, variants)
            pick = e.argmin(axis=1)
            better = e[np.arange(points), pick] < best_e - 1e-9
            cols = np.arange(points) * variants + pick
            best[:, better] = cand[:, cols[better]]
            best_t[better] = t[cols[better]]
            best_e[better] = e[np.arange(points), pick][better]
            if progress is not None:
                progress()
        return best, best_t, best_e

    @property
    def num_options(self) -> int:
        """Total number of (Pareto-optimal) options over all nodes."""
        return int(self._dag.class_size[self.node_class].sum())

    def exact(self, deadline_s: float | None) -> tuple[IntArray, float] | None:
        """The least-energy selection with iteration time at most ``deadline_s`` (None: any),
        by mixed-integer programming (HiGHS branch and bound); for small instances.

        Every wait is priced at the profile's lowest blocked power: with one blocked power
        the selection is optimal; with one per clock it is optimal for that lower model.

        Returns:
            The selection and the program's optimum (a lower bound on the energy of every
            plan meeting the deadline), or None when no plan meets the deadline.
        """
        if self._milp is None:
            self._milp = _ExactMILP(self)
        return self._milp.solve(deadline_s)

    def plan_batch(
        self,
        solutions: Sequence[tuple[FloatArray, FloatArray]],
        deadlines_s: Sequence[float],
        *,
        variants: int,
        rounds: int,
        progress: Callable[[], None] | None = None,
    ) -> tuple[IntArray, FloatArray, FloatArray]:
        """Discrete plans from relaxed ``(durations, starts)`` at the given deadlines."""
        durations = np.stack([d for d, _ in solutions], axis=1)
        starts = np.stack([s for _, s in solutions], axis=1)
        deadline = np.minimum(np.asarray(deadlines_s, dtype=np.float64), self._dag.max_deadline_s)
        sel = self.round_down(durations)
        start = self.project(sel, starts, deadline)
        return self.iterated_local_search(
            sel, start, deadline, variants=variants, rounds=rounds, progress=progress
        )


class _LevelLayout:
    """The nodes of one topological level, with what a pass over them needs precomputed.

    Attributes:
        nodes: the nodes.
        preds: padded predecessor indices (nodes, max in-degree).
        succs: padded successor indices (nodes, max out-degree).
        first: index of each node's first option in the concatenated tables (nodes, 1).
        shift: offset of each node's class in the shifted search table (nodes, 1).
    """

    def __init__(
        self, nodes: IntArray, preds: IntArray, succs: IntArray, first: IntArray, shift: FloatArray
    ) -> None:
        self.nodes = nodes
        self.preds = preds
        self.succs = succs
        self.first = first
        self.shift = shift


class _LevelledDAG:
    """The schedule DAG grouped into levels (longest distance from a source, in edges).

    Nodes of a level share no edge, so a pass over the DAG handles a whole level at once;
    every pass below is vectorised over the nodes of a level and over a batch of plans.
    Padding index ``num_nodes`` stands for "no predecessor / successor".

    The option times of all classes are concatenated, each class shifted by its own
    offset, so one ``searchsorted`` finds the slowest fitting option of many nodes with
    different option tables.
    """

    def __init__(
        self, schedule: PipelineSchedule, node_class: IntArray, tables: Sequence[OptionTable]
    ) -> None:
        n = len(node_class)
        preds, succs = schedule.predecessors, schedule.successors
        depth = np.zeros(n, dtype=np.int64)
        for node in schedule.topological_order:
            if preds[node]:
                depth[node] = 1 + max(depth[p] for p in preds[node])
        self.class_start = np.cumsum([0] + [len(t.times_s) for t in tables[:-1]])
        self.class_size = np.asarray([len(t.times_s) for t in tables])
        self.times = np.concatenate([t.times_s for t in tables])
        self.energies = np.concatenate([t.energies_j for t in tables])
        self.blocked = np.concatenate([t.blocked_w for t in tables])
        self.freqs = np.concatenate([t.frequencies_mhz for t in tables])
        self.node_class = node_class
        self.node_start = self.class_start[node_class]
        # Every window the passes look at is at most the deadline, itself at most the sum
        # of the slowest times (the planner clamps to that); classes are spaced twice that.
        self.max_deadline_s = float(sum(tables[c].times_s[-1] for c in node_class)) + 1.0
        self._offset: FloatArray = (
            2.0 * self.max_deadline_s * np.arange(len(tables), dtype=np.float64)
        )
        self._shifted = np.concatenate(
            [t.times_s + off for t, off in zip(tables, self._offset, strict=True)]
        )
        self.levels: list[_LevelLayout] = []
        for d in range(int(depth.max()) + 1):
            nodes = np.flatnonzero(depth == d)
            width_p = max(1, max(len(preds[i]) for i in nodes))
            width_s = max(1, max(len(succs[i]) for i in nodes))
            pmat = np.full((len(nodes), width_p), n, dtype=np.int64)
            smat = np.full((len(nodes), width_s), n, dtype=np.int64)
            for row, member in enumerate(nodes.tolist()):
                pmat[row, : len(preds[member])] = preds[member]
                smat[row, : len(succs[member])] = succs[member]
            classes = node_class[nodes]
            self.levels.append(
                _LevelLayout(
                    nodes,
                    pmat,
                    smat,
                    self.class_start[classes][:, None],
                    (self._offset[classes] + _EPS_S)[:, None],
                )
            )

    def gather(self, values: FloatArray, sel: IntArray) -> FloatArray:
        """``values`` (concatenated per class) of the selected option of every node."""
        return values[self.node_start[:, None] + sel]

    def slowest_fitting(self, nodes: IntArray, window_s: FloatArray) -> IntArray:
        """Index of the slowest option of each node taking at most ``window_s`` (-1: none)."""
        classes = self.node_class[nodes]
        w = window_s + (self._offset[classes] + _EPS_S)[:, None]
        return (
            np.searchsorted(self._shifted, w, side="right") - 1 - self.class_start[classes][:, None]
        )

    def fit_level(self, level: _LevelLayout, window_s: FloatArray) -> IntArray:
        """:meth:`slowest_fitting` for the nodes of a level, as a position in the tables."""
        return np.searchsorted(self._shifted, window_s + level.shift, side="right") - 1

    def asap(self, times: FloatArray, not_before: FloatArray | None = None) -> FloatArray:
        """Earliest starts (with a padding row) for durations ``times`` (nodes, batch)."""
        finish = np.zeros((times.shape[0] + 1, times.shape[1]))
        start = np.zeros_like(finish)
        for level in self.levels:
            ready = finish[level.preds].max(axis=1)
            if not_before is not None:
                ready = np.maximum(ready, not_before[level.nodes])
            start[level.nodes] = ready
            finish[level.nodes] = ready + times[level.nodes]
        return start


class _HullLP:
    """The convex relaxation as an LP, built once per solver and re-solved per deadline.

    Variables: the start time of every node, then per node one variable per hull segment
    (fastest to slowest) holding how far the node is slowed within that segment; cost per
    second of a segment is its (negative) slope, so slopes fill steepest first. Rows: one
    per edge (``start_a + duration_a <= start_b``) and one per sink (``<= T``).
    """

    def __init__(self, solver: Solver) -> None:
        self.solver = solver
        n = solver.num_nodes
        self.base_time = np.empty(n)
        self.base_cost = np.empty(n)
        seg_len: list[FloatArray] = []
        seg_slope: list[FloatArray] = []
        offsets = [n]
        for node in range(n):
            table = solver.tables[solver.node_class[node]]
            t, c = table.times_s[table.hull], table.costs_j[table.hull]
            self.base_time[node], self.base_cost[node] = t[0], c[0]
            dt = np.diff(t)
            seg_len.append(dt)
            seg_slope.append(np.diff(c) / dt)
            offsets.append(offsets[-1] + len(dt))
        self.offsets = np.asarray(offsets)
        self.num_vars = int(self.offsets[-1])
        self.cost = np.concatenate([np.zeros(n), *seg_slope])
        self.upper = np.concatenate([np.full(n, np.inf), *seg_len])
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        rhs: list[float] = []
        sinks: list[int] = []

        def duration_terms(row: int, node: int) -> None:
            rows.append(row)
            cols.append(node)
            vals.append(1.0)
            seg = range(int(self.offsets[node]), int(self.offsets[node + 1]))
            rows.extend([row] * len(seg))
            cols.extend(seg)
            vals.extend([1.0] * len(seg))

        for a, b in solver.schedule.edges:
            row = len(rhs)
            duration_terms(row, a)
            rows.append(row)
            cols.append(b)
            vals.append(-1.0)
            rhs.append(-self.base_time[a])
        for node in range(n):
            if not solver.schedule.successors[node]:
                sinks.append(len(rhs))
                duration_terms(len(rhs), node)
                rhs.append(-self.base_time[node])
        self.sink_rows = np.asarray(sinks)
        self.rhs = np.asarray(rhs)
        self.matrix = sp.csr_matrix(
            (vals, (rows, cols)), shape=(len(rhs), self.num_vars), dtype=np.float64
        )
        # The same rows with the deadline as a variable (last column), for the free LP.
        deadline_col = sp.csr_matrix(
            (-np.ones(len(sinks)), (self.sink_rows, np.zeros(len(sinks), dtype=np.int64))),
            shape=(len(rhs), 1),
        )
        self.free_matrix = sp.hstack([self.matrix, deadline_col], format="csr")

    def solve(self, deadline_s: float | None) -> LPSolution:
        solver = self.solver
        n = solver.num_nodes
        bounds = np.column_stack([np.zeros(self.num_vars), self.upper])
        if deadline_s is None:
            energy_rate = solver.blocked_power_w * solver.num_devices
            cost = np.append(self.cost, energy_rate)
            bounds = np.vstack([bounds, [0.0, np.inf]])
            with _stdout_silenced():
                result = linprog(
                    cost, A_ub=self.free_matrix, b_ub=self.rhs, bounds=bounds, method="highs"
                )
        else:
            rhs = self.rhs.copy()
            rhs[self.sink_rows] += deadline_s
            with _stdout_silenced():
                result = linprog(
                    self.cost, A_ub=self.matrix, b_ub=rhs, bounds=bounds, method="highs"
                )
        if result.status != 0:
            raise EnergyError(
                f"the relaxation at T={deadline_s} s could not be solved: {result.message}"
            )
        x = result.x
        durations = self.base_time.copy()
        np.add.at(durations, np.repeat(np.arange(n), np.diff(self.offsets)), x[n : self.num_vars])
        if deadline_s is None:
            deadline_s = float(x[-1])
        relaxed_cost = float(self.base_cost.sum() + self.cost @ x[: self.num_vars])
        energy = relaxed_cost + solver.blocked_power_w * solver.num_devices * deadline_s
        return LPSolution(float(deadline_s), durations, x[:n].copy(), energy)


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """Send what is written to file descriptor 1 meanwhile to the null device.

    Every HiGHS call of this module runs inside it: HiGHS' MIP solver prints debug lines
    (``HighsMipSolverData::...``) straight to the C-level stdout whatever its display
    options (ERGO-Code/HiGHS issue 2783), which would corrupt machine-readable output such
    as ``lightning-energy plan --json``. Python's buffered stdout is flushed first. The
    redirection is process-wide: what other threads write to stdout meanwhile is discarded
    too. Where descriptor 1 cannot be duplicated (closed), nothing is redirected.
    """
    for stream in (sys.stdout, sys.__stdout__):
        if stream is not None:
            stream.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 1)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class _ExactMILP:
    """The discrete problem as a mixed-integer program.

    Variables: node start times, one binary per (node, option), the iteration time.
    Each node takes exactly one option; ``start_a + time_a <= start_b`` on every edge and
    ``start + time <= T`` on sinks; the objective is the energy
    ``sum(effective cost) + blocked_power * devices * T``, with ``T <= deadline``.
    """

    def __init__(self, solver: Solver) -> None:
        self.solver = solver
        dag = solver._dag
        n = solver.num_nodes
        sizes = dag.class_size[solver.node_class]
        first = n + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.first = first
        self.num_binary = int(sizes.sum())
        self.num_vars = n + self.num_binary + 1
        t_col = self.num_vars - 1
        costs = np.concatenate([solver.tables[c].costs_j for c in range(len(solver.tables))])
        self.objective = np.zeros(self.num_vars)
        for node in range(n):
            k = np.arange(sizes[node])
            self.objective[first[node] + k] = costs[dag.node_start[node] + k]
        self.objective[t_col] = solver.blocked_power_w * solver.num_devices
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        lower: list[float] = []
        upper: list[float] = []

        def finish_terms(row: int, node: int) -> None:
            k = np.arange(sizes[node])
            rows.extend([row, *([row] * len(k))])
            cols.extend([node, *(first[node] + k).tolist()])
            vals.extend([1.0, *dag.times[dag.node_start[node] + k].tolist()])

        for node in range(n):
            row = len(lower)
            k = np.arange(sizes[node])
            rows.extend([row] * len(k))
            cols.extend((first[node] + k).tolist())
            vals.extend([1.0] * len(k))
            lower.append(1.0)
            upper.append(1.0)
        for a, b in solver.schedule.edges:
            row = len(lower)
            finish_terms(row, a)
            rows.append(row)
            cols.append(b)
            vals.append(-1.0)
            lower.append(-np.inf)
            upper.append(0.0)
        for node in range(n):
            if not solver.schedule.successors[node]:
                row = len(lower)
                finish_terms(row, node)
                rows.append(row)
                cols.append(t_col)
                vals.append(-1.0)
                lower.append(-np.inf)
                upper.append(0.0)
        matrix = sp.csr_matrix((vals, (rows, cols)), shape=(len(lower), self.num_vars))
        self.constraints = LinearConstraint(matrix, np.asarray(lower), np.asarray(upper))
        self.integrality = np.zeros(self.num_vars)
        self.integrality[n : n + self.num_binary] = 1
        self.sizes = sizes

    def solve(self, deadline_s: float | None) -> tuple[IntArray, float] | None:
        n = self.solver.num_nodes
        upper = np.full(self.num_vars, np.inf)
        upper[n : n + self.num_binary] = 1.0
        if deadline_s is not None:
            upper[-1] = deadline_s
        with _stdout_silenced():
            result = milp(
                self.objective,
                integrality=self.integrality,
                bounds=Bounds(np.zeros(self.num_vars), upper),
                constraints=self.constraints,
                options={"disp": False, "mip_rel_gap": 1e-9},
            )
        if result.x is None:
            return None
        x = result.x
        sel = np.asarray(
            [int(np.argmax(x[self.first[i] : self.first[i] + self.sizes[i]])) for i in range(n)],
            dtype=np.int64,
        )
        return sel, float(result.fun)
