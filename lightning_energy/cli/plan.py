"""``lightning-energy plan``: plan per-instruction GPU clocks for a pipeline (Perseus).

Reads a pipeline profile (``stage,instruction,frequency,time,energy`` CSV), computes the
iteration time-energy frontier of the schedule, prints a summary of it and writes the plan
for no slowdown (default), a target iteration time, or the energy optimum as JSON::

    lightning-energy plan --profile profile.csv --schedule 1f1b --microbatches 8 \\
        --p2p-power-w 70 --target-time 1.9 --output plan.json

With ``--config energy.yaml`` whose ``kareus:`` section is enabled it plans with Kareus
instead: the instruction options come from the partition searches' measurements, the
pipeline (schedule, micro-batches) from the ``perseus:`` section unless given here, and the
plan carries the clock and partition settings of every instruction (docs/kareus.md)::

    lightning-energy plan --config energy.yaml --p2p-power-w 640 --output kareus_plan.json

Exit codes: 0 ok, 2 bad arguments or a malformed profile, 1 planning failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from lightning_energy.argtypes import float_in, int_in
from lightning_energy.cli import EXIT_OK
from lightning_energy.config import EnergyConfig
from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.kareus.compose import KareusPlanner, planner_from_files
from lightning_energy.perseus.planning.plan import Plan
from lightning_energy.perseus.planning.planner import FrontierPoint, PerseusPlanner
from lightning_energy.perseus.planning.profile import PipelineProfile
from lightning_energy.perseus.planning.schedule import SCHEDULES, PipelineSchedule, build_schedule

__all__ = ["register", "run"]

log = logging.getLogger(__name__)

#: Power an A100 draws while blocked on a pipeline send/recv (the shipped profiles' value).
DEFAULT_P2P_POWER_W = 70.0

#: The most microbatches per iteration and virtual stages per GPU a plan may have.
MAX_MICROBATCHES = 1024
MAX_VIRTUAL_STAGES = 64
#: The most iteration times the frontier grid may have (``--time-step-s`` too fine).
MAX_GRID_POINTS = 10_000


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``plan`` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="plan per-instruction GPU clocks for pipeline parallelism (Perseus)",
        description="Compute the iteration time-energy frontier of a pipeline schedule from "
        "a profile and write the frequency plan for no slowdown, a target iteration time or "
        "the energy optimum.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", type=Path, metavar="FILE", help="profile CSV (Perseus)")
    source.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="YAML configuration whose kareus section is enabled: plan with Kareus",
    )
    parser.add_argument(
        "--schedule",
        default=None,
        choices=SCHEDULES,
        help="pipeline schedule (default 1f1b, or perseus.schedule with --config)",
    )
    parser.add_argument(
        "--microbatches",
        default=None,
        type=int_in(1, MAX_MICROBATCHES),
        metavar="M",
        help=f"microbatches per iteration (1 to {MAX_MICROBATCHES}; required with --profile, "
        "perseus.microbatches with --config)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int_in(1, MAX_VIRTUAL_STAGES),
        default=None,
        metavar="V",
        help="stages per GPU (interleaved_1f1b; the profile lists all virtual stages)",
    )
    parser.add_argument(
        "--p2p-power-w",
        type=float_in(0, 10_000),
        default=DEFAULT_P2P_POWER_W,
        metavar="W",
        help=f"power drawn while blocked on bubbles/send/recv (default {DEFAULT_P2P_POWER_W} W)",
    )
    goal = parser.add_mutually_exclusive_group()
    goal.add_argument(
        "--target-time",
        type=float_in(0, 86_400, low_inclusive=False),
        metavar="S",
        help="plan for this iteration time (s)",
    )
    goal.add_argument(
        "--no-slowdown", action="store_true", help="plan for the fastest iteration (default)"
    )
    goal.add_argument(
        "--energy-optimal", action="store_true", help="plan for the least energy at any time"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="where to write the plan (default perseus_plan.json, kareus_plan.json with --config)",
    )
    parser.add_argument(
        "--time-step-s",
        type=float_in(0, 86_400, low_inclusive=False),
        default=None,
        metavar="S",
        help=f"frontier grid spacing (at most {MAX_GRID_POINTS} iteration times)",
    )
    parser.add_argument(
        "--rows",
        type=int_in(1, 1000),
        default=8,
        help="frontier rows to print (1 to 1000, default 8)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def _progress_bar(enabled: bool) -> tuple[Any, Any]:
    """A tqdm bar on stderr (only on a terminal) and the callback that advances it."""
    if not enabled or not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=1, desc="planning", unit="step", file=sys.stderr, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return bar, update


def run(args: argparse.Namespace) -> int:
    """Plan, print the frontier summary and the chosen plan, write the plan JSON."""
    if args.output is None:
        args.output = Path("kareus_plan.json" if args.config else "perseus_plan.json")
    if args.output.is_dir():
        raise ConfigError(f"--output {args.output}: is a folder; give a file path", "command line")
    if args.config is not None:
        kareus = _kareus_planner(args)
        planner, baseline_label = kareus.perseus, "every instruction at its fastest option"
    else:
        kareus, planner = None, _perseus_planner(args)
        baseline_label = f"all {planner.profile.frequencies_mhz[0]} MHz"
    schedule, profile = planner.schedule, planner.profile
    _check_time_step(planner, args.time_step_s)
    bar, callback = _progress_bar(not args.no_progress and not args.json)
    try:
        frontier = planner.frontier(time_step_s=args.time_step_s, progress=callback)
        if args.target_time is not None:
            if args.target_time < planner.min_iteration_time_s:
                log.warning(
                    "Target %.4f s is below the fastest iteration time %.4f s: planning for no "
                    "slowdown.",
                    args.target_time,
                    planner.min_iteration_time_s,
                )
            candidates = [planner.plan_for_time(args.target_time), frontier.at(args.target_time)]
        elif args.energy_optimal:
            candidates = [planner.plan_energy_optimal(), frontier.energy_optimal]
        else:
            candidates = [planner.plan_no_slowdown(), frontier.fastest]
    finally:
        if bar is not None:
            bar.close()
    chosen = min(candidates, key=lambda p: (p.energy_j, p.iteration_time_s))
    baseline = frontier.baseline
    metadata = dict(chosen.plan.metadata or {})
    metadata["baseline_energy_j"] = baseline.energy_j
    metadata["baseline_iteration_time_s"] = baseline.iteration_time_s
    if args.target_time is not None:
        metadata["target_time_s"] = args.target_time
    plan = Plan(schedule, chosen.plan.frequencies_mhz, metadata)
    try:
        (plan if kareus is None else kareus.kareus_plan(plan)).save(args.output)
    except OSError as exc:
        raise ConfigError(
            f"--output {args.output}: cannot write the plan ({exc.strerror or exc}); give a "
            "file path in a writable folder",
            "command line",
        ) from exc
    rows = frontier.summary(args.rows)
    if args.json:
        summary = _summary(args, schedule, baseline, chosen, rows, len(frontier))
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    print(
        f"{schedule.name}: {schedule.num_stages} stages on {schedule.num_devices} GPUs, "
        f"{schedule.num_microbatches} microbatches, blocked power {profile.blocked_power_w:g} W"
    )
    print(
        f"baseline ({baseline_label}): {baseline.iteration_time_s:.4f} s, "
        f"{baseline.energy_j:.1f} J per iteration"
    )
    print(f"frontier: {len(frontier)} plans")
    print(f"  {'time (s)':>10} {'slowdown':>9} {'energy (J)':>11} {'saving':>7}")
    for time_s, energy_j, saving in rows:
        slowdown = time_s / baseline.iteration_time_s - 1
        print(f"  {time_s:10.4f} {slowdown:9.2%} {energy_j:11.1f} {saving:7.1%}")
    gap = "" if chosen.gap is None else f", within {chosen.gap:.2%} of the lower bound"
    print(
        f"plan: {chosen.iteration_time_s:.4f} s, {chosen.energy_j:.1f} J "
        f"({1 - chosen.energy_j / baseline.energy_j:.1%} less energy{gap}) -> {args.output}"
    )
    return EXIT_OK


def _perseus_planner(args: argparse.Namespace) -> PerseusPlanner:
    """The Perseus planner of ``--profile``."""
    if args.microbatches is None:
        raise ConfigError("--microbatches: required with --profile", "command line")
    try:
        profile = PipelineProfile.from_csv(args.profile, blocked_power_w=args.p2p_power_w)
        schedule = build_schedule(
            args.schedule or "1f1b",
            profile.num_stages,
            args.microbatches,
            virtual_stages=args.virtual_stages or 1,
        )
        return PerseusPlanner(profile, schedule)
    except ProfileError as exc:
        raise ConfigError(str(exc), source=str(args.profile)) from exc


def _kareus_planner(args: argparse.Namespace) -> KareusPlanner:
    """The Kareus planner of ``--config``: its kareus section, the pipeline of its perseus
    section (command-line values first)."""
    config = EnergyConfig.from_yaml(args.config)
    kareus, perseus = config.kareus, config.perseus
    if not kareus.enabled:
        raise ConfigError(
            "kareus.enabled: false is not allowed with --config; set it to true (and its "
            "measurements_dir, non_partition_profile, layers_per_stage), or plan Perseus "
            "with --profile",
            str(args.config),
        )
    assert kareus.measurements_dir and kareus.non_partition_profile and kareus.layers_per_stage
    try:
        schedule = build_schedule(
            args.schedule or perseus.schedule,
            len(kareus.layers_per_stage),
            args.microbatches or perseus.microbatches,
            virtual_stages=args.virtual_stages or perseus.virtual_stages,
        )
        return planner_from_files(
            kareus.measurements_dir,
            kareus.non_partition_profile,
            kareus.layers_per_stage,
            schedule,
            blocked_power_w=args.p2p_power_w,
            tp_size=kareus.tp_size,
        )
    except ProfileError as exc:
        raise ConfigError(str(exc), source=str(args.config)) from exc


def _check_time_step(planner: PerseusPlanner, time_step_s: float | None) -> None:
    """Refuse a grid spacing that would make the frontier too large to compute."""
    if time_step_s is None or planner.exact:
        return
    span_s = planner.energy_optimal_time_s() - planner.min_iteration_time_s
    if span_s / time_step_s > MAX_GRID_POINTS:
        raise ConfigError(
            f"--time-step-s={time_step_s:g}: {span_s / time_step_s:.3g} iteration times from "
            f"{planner.min_iteration_time_s:.4f} s to {planner.min_iteration_time_s + span_s:.4f}"
            f" s; allowed: >= {span_s / MAX_GRID_POINTS:.3g} s for this profile (at most "
            f"{MAX_GRID_POINTS} iteration times)",
            "command line",
        )


def _summary(
    args: argparse.Namespace,
    schedule: PipelineSchedule,
    baseline: FrontierPoint,
    chosen: FrontierPoint,
    rows: list[tuple[float, float, float]],
    points: int,
) -> dict[str, Any]:
    source = {"profile": str(args.profile)} if args.config is None else {"config": str(args.config)}
    return {
        **source,
        "planner": "perseus" if args.config is None else "kareus",
        "schedule": schedule.name,
        "microbatches": schedule.num_microbatches,
        "baseline": {"iteration_time_s": baseline.iteration_time_s, "energy_j": baseline.energy_j},
        "frontier": {
            "points": points,
            "rows": [{"iteration_time_s": t, "energy_j": e, "saving": s} for t, e, s in rows],
        },
        "plan": {
            "iteration_time_s": chosen.iteration_time_s,
            "energy_j": chosen.energy_j,
            "lower_bound_j": chosen.lower_bound_j,
            "path": str(args.output),
        },
    }
