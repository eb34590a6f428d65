"""Perseus planner vs. the ``lowtime`` package on the same pipeline profile.

Both planners compute the whole iteration time-energy frontier of a synchronous 1F1B
pipeline; every plan either returns is evaluated with the same objective
(``lightning_energy.perseus.evaluate``: longest path through the DAG, compute energy plus
blocked power over every device's idle time). Reported per planner:

* ``energy_j`` / ``iteration_time_s``: its no-slowdown plan. Ours: the least-energy plan at
  the all-fastest iteration time. lowtime: its fastest frontier point (the plan its
  Phillips-Dessouky iteration ends at; its time quantisation can leave it a little slower
  than the baseline).
* ``energy_within_tol_j``: for both, the least-energy frontier plan whose iteration time is
  at most the baseline's plus ``--tol`` (0.2 % by default, what the profiles' README allows
  a planner that quantises time): equal footing at equal time.
* ``frontier_wall_s``: wall time to compute the whole frontier (lowtime: from its
  all-slowest start down to its minimum time, as it works; ours: from no slowdown to the
  energy optimum), including building the inputs.
* ``same_range_wall_s`` (lowtime): building its inputs plus only the Phillips-Dessouky
  iterations whose plan is within our frontier's time range (no slower than our energy
  optimum), so ``ratio.frontier_speedup_same_range`` compares the same stretch of the
  frontier; ``ratio.frontier_speedup`` compares the whole runs.

lowtime is driven as its authors' driver does: time quantised to ``--unit-time-s`` (1 ms),
effective cost = energy - blocked power x time, then the Pareto filter and deduplication of
``CandidateExecutionOptions`` on those effective costs, the exponential cost model fitted
with ``search_strategy="best"`` (the least-error fit of its grid of initial guesses), and
``PhillipsDessouky(dag).run()``.

Usage::

    pip install lowtime==0.3.0        # the `bench` extra
    python benchmarks/perseus_vs_lowtime.py \
        --profile tests/data/perseus_profiles/profile_S4_M8.csv --microbatches 8
    python benchmarks/perseus_vs_lowtime.py --profile ... --microbatches 32 --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from lightning_energy.perseus import (
    Frontier,
    PerseusPlanner,
    PipelineProfile,
    Plan,
    evaluate,
    one_f_one_b,
)
from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule


def run_ours(profile: PipelineProfile, schedule: PipelineSchedule) -> tuple[Frontier, float]:
    """Our whole frontier and its wall time."""
    start = time.perf_counter()
    frontier = PerseusPlanner(profile, schedule).frontier()
    return frontier, time.perf_counter() - start


def run_lowtime(
    profile: PipelineProfile, schedule: PipelineSchedule, unit_time_s: float
) -> tuple[list[Plan], float, list[float]]:
    """lowtime's whole frontier (one plan per Phillips-Dessouky iteration), its wall time,
    and the seconds spent before the first iteration and in each one (building the inputs
    in the first entry)."""
    import networkx as nx
    from lowtime.cost_model import ExponentialModel
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Backward, Forward
    from lowtime.solver import PhillipsDessouky

    kinds = {"forward": Forward, "backward": Backward}
    start = time.perf_counter()
    specs: dict[tuple[int, str], OperationSpec[int]] = {}
    for (stage, kind), entry in profile.entries().items():
        options = [
            ExecutionOption[int](real_time=t, unit_time=unit_time_s, cost=e, knob=f)
            for f, t, e in zip(entry.frequencies_mhz, entry.times_s, entry.energies_j, strict=True)
        ]
        for option in options:  # effective energy first, then the Pareto filter
            option.cost -= profile.blocked_power_w * option.quant_time * option.unit_time
        candidates = CandidateExecutionOptions[int](options=options)
        specs[(stage, kind)] = OperationSpec[int](
            options=candidates,
            cost_model=ExponentialModel(candidates, search_strategy="best"),
        )
    dag = nx.DiGraph()
    ops: dict[Instruction, Any] = {}
    node_of: dict[Instruction, int] = {}
    for order in schedule.device_orders:
        for inst in order:
            node_of[inst] = len(node_of) + 2  # 0 and 1: source and sink
            ops[inst] = kinds[inst.kind](
                spec=specs[(inst.stage, inst.kind)],
                stage_id=inst.stage,
                micro_batch_id=inst.microbatch,
            )
            dag.add_node(node_of[inst], op=ops[inst])
    nodes = schedule.nodes
    for a, b in schedule.edges:
        dag.add_edge(node_of[nodes[a]], node_of[nodes[b]])
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1
    plans = []
    marks = [time.perf_counter()]
    for _ in PhillipsDessouky(dag).run():
        plans.append(Plan(schedule, tuple(int(ops[inst].assigned_knob) for inst in schedule.nodes)))
        marks.append(time.perf_counter())
    spans = [marks[0] - start, *(b - a for a, b in itertools.pairwise(marks))]
    return plans, marks[-1] - start, spans


def same_range_wall_s(spans_s: list[float], plan_times_s: list[float], slowest_s: float) -> float:
    """Seconds of a run spent building its inputs (``spans_s[0]``) and in the iterations
    whose plan takes at most ``slowest_s`` (``spans_s[i + 1]`` made ``plan_times_s[i]``)."""
    inside = (span for span, t in zip(spans_s[1:], plan_times_s, strict=True) if t <= slowest_s)
    return spans_s[0] + sum(inside)


def best_within(points: list[tuple[float, float]], limit_s: float) -> tuple[float, float] | None:
    """Least-energy ``(time, energy)`` with time at most ``limit_s``."""
    ok = [p for p in points if p[0] <= limit_s]
    return min(ok, key=lambda p: p[1]) if ok else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, type=Path, help="profile CSV")
    parser.add_argument("--microbatches", required=True, type=int, help="microbatches M")
    parser.add_argument("--p2p-power-w", type=float, default=70.0, help="blocked power (W)")
    parser.add_argument("--unit-time-s", type=float, default=1e-3, help="lowtime time unit")
    parser.add_argument("--tol", type=float, default=0.002, help="time tolerance (0.002)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    logging.getLogger("lowtime").setLevel(logging.WARNING)

    profile = PipelineProfile.from_csv(args.profile, blocked_power_w=args.p2p_power_w)
    schedule = one_f_one_b(profile.num_stages, args.microbatches)
    baseline = evaluate(Plan.uniform(schedule, profile.frequencies_mhz[0]), profile)
    limit_s = baseline.iteration_time_s * (1 + args.tol) + 1e-12

    frontier, ours_wall = run_ours(profile, schedule)
    ours_points = [(p.iteration_time_s, p.energy_j) for p in frontier]
    try:
        lt_plans, lt_wall, lt_spans = run_lowtime(profile, schedule, args.unit_time_s)
    except ImportError:
        print("lowtime is not installed: pip install lowtime==0.3.0", file=sys.stderr)
        return 2
    lt_evals = [evaluate(plan, profile) for plan in lt_plans]
    lt_points = [(e.iteration_time_s, e.energy_j) for e in lt_evals]
    lt_fastest = min(lt_points, key=lambda p: (p[0], p[1]))
    ours_tol = best_within(ours_points, limit_s)
    lt_tol = best_within(lt_points, limit_s)
    fastest = frontier.fastest
    slowest_s = max(t for t, _ in ours_points) * (1 + 1e-12)
    lt_same_range = same_range_wall_s(lt_spans, [t for t, _ in lt_points], slowest_s)

    ours: dict[str, Any] = {
        "energy_j": fastest.energy_j,
        "iteration_time_s": fastest.iteration_time_s,
        "frontier_wall_s": ours_wall,
        "frontier_points": len(frontier),
        "lower_bound_j": fastest.lower_bound_j,
        "energy_within_tol_j": ours_tol[1] if ours_tol else None,
    }
    lowtime: dict[str, Any] = {
        "energy_j": lt_fastest[1],
        "iteration_time_s": lt_fastest[0],
        "frontier_wall_s": lt_wall,
        "frontier_points": len(lt_points),
        "same_range_wall_s": lt_same_range,
        "same_range_points": sum(t <= slowest_s for t, _ in lt_points),
        "energy_within_tol_j": lt_tol[1] if lt_tol else None,
    }
    ratio = {
        "energy_ours_over_lowtime": fastest.energy_j / lt_fastest[1],
        "frontier_speedup": lt_wall / ours_wall,
        "frontier_speedup_same_range": lt_same_range / ours_wall,
    }
    result = {
        "profile": str(args.profile),
        "stages": profile.num_stages,
        "microbatches": args.microbatches,
        "baseline": {
            "energy_j": baseline.energy_j,
            "iteration_time_s": baseline.iteration_time_s,
        },
        "ours": ours,
        "lowtime": lowtime,
        "ratio": ratio,
        "tol": args.tol,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    base_e = baseline.energy_j
    print(f"profile {args.profile} (S={profile.num_stages}, M={args.microbatches}, 1F1B)")
    print(
        f"baseline (all {profile.frequencies_mhz[0]} MHz): T={baseline.iteration_time_s:.4f} s,"
        f" E={base_e:.1f} J"
    )
    header = (
        f"{'planner':8} {'E no-slowdown (J)':>18} {'saving':>7} {'T (s)':>8} "
        f"{'E within +' + format(args.tol, '.1%'):>18} {'frontier (s)':>13} {'points':>7}"
    )
    print(header)
    for name, r in (("ours", ours), ("lowtime", lowtime)):
        tol = r["energy_within_tol_j"]
        tol_text = "n/a" if tol is None else f"{tol:.1f}"
        print(
            f"{name:8} {r['energy_j']:18.1f} {1 - r['energy_j'] / base_e:7.1%} "
            f"{r['iteration_time_s']:8.4f} {tol_text:>18} "
            f"{r['frontier_wall_s']:13.2f} {r['frontier_points']:7d}"
        )
    print(
        f"ratio: energy ours/lowtime = {ratio['energy_ours_over_lowtime']:.4f}, "
        f"frontier speedup = {ratio['frontier_speedup']:.1f}x whole, "
        f"{ratio['frontier_speedup_same_range']:.1f}x over our time range "
        f"(lowtime {lt_same_range:.2f} s, {lowtime['same_range_points']} points)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
