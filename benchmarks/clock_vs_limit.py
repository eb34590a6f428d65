"""Locked SM clocks vs. power limits, on the simulated GPUs that model clocks.

For every physics preset (``a100``, ``h100``, ``h200``: the simulated GPUs whose SM clock is
modelled; trace GPUs cannot lock) and four workloads of a 0.5 s step (three of one phase,
compute-bound shares 0.9, 0.6 and 0.3, and one ``phased``: 60 % compute-bound work at 0.95
then 40 % memory-bound at 0.15, as GEMMs and elementwise/optimizer kernels alternate in a
training step), both knobs are measured:

- **Exhaustively**, on a noiseless GPU: every power limit of a 25 W grid (the configuration's
  default) and every candidate clock (the supported clocks thinned to 90 MHz, the default
  ``power_limit.clock_step_mhz``), with the average SM clock each ran at.
- **By the search**, on a noisy GPU (``--noise-std``, default 0.02 per step): the
  :class:`~lightning_energy.optimize.power_limit.PowerLimitOptimizer` of each kind, with each
  selector (``energy``, ``time``, ``cost(eta=0.5)``, ``max_slowdown(1.1)``,
  ``target_time(1.2 x the fastest step)``), the controller's loop (apply, settle, measure,
  report). Its choice is scored on the noiseless measurements, and its steps are compared
  with Zeus' sweep (10 warm-up and 40 measured steps at every candidate) of either knob.

Per selector, the cost of each knob's choice uses the selector's own objective over both
knobs' settings (energy for the constrained selectors, whose time bounds are those of
full power: the highest power limit). ``auto_ok`` says whether the locked clock, which
``power_limit.knob: auto`` uses where the job may lock, is no worse than the power limit's
choice by more than the noise tolerance (1 %).

At equal speed, each power limit is compared with the cheapest lock at least as fast: the
energy change of the lock against the cap, in per cent (negative: the lock saves), with its
median and tails per preset. Under a cap the simulated board's governor sets the clock from
the power it measures every 20 ms, so on phased work the clock follows the phases (high in
the memory-bound phase, where it buys no speed); on single-phase work cap and lock settle at
the same clock. The measured lock-vs-cap comparison (the Perseus artifact's data) is
``benchmarks/calibrate_governor.py``'s; ``measured`` here is null.

Usage::

    python benchmarks/clock_vs_limit.py            # a table per preset
    python benchmarks/clock_vs_limit.py --json     # one object: per preset, the median
                                                   # energy change at equal speed (%) and
                                                   # the details
    python benchmarks/clock_vs_limit.py --preset a100 --noise-std 0.05 --seed 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_energy.controller.locked_clock import thin_clocks_mhz
from lightning_energy.device.simulated import Phase, SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.optimize.power_limit import (
    LOCKED_CLOCK,
    POWER_LIMIT,
    PowerLimitOptimizer,
    SettingKind,
)
from lightning_energy.optimize.selectors import Selector, make_selector

PRESETS = ("a100", "h100", "h200")
Work = tuple[Phase, ...]
WORKLOADS: dict[str, Work] = {
    "compute-bound": (Phase(1.0, 0.9),),
    "mixed": (Phase(1.0, 0.6),),
    "memory-bound": (Phase(1.0, 0.3),),
    "phased": (Phase(0.6, 0.95), Phase(0.4, 0.15)),
}
STEP_TIME_S = 0.5
GRID_STEP_W = 25.0
CLOCK_STEP_MHZ = 90.0
TOLERANCE = 0.01
TRUTH_SETTLE_STEPS = 2
TRUTH_STEPS = 4
ZEUS_STEPS_PER_CANDIDATE = 50  # 10 warm-up + 40 measured


@dataclass(frozen=True)
class Point:
    """One setting measured on the noiseless GPU."""

    setting: float
    time_s: float
    energy_j: float
    sm_clock_mhz: float | None


@dataclass(frozen=True)
class Choice:
    """One knob's search under one selector, scored on the noiseless measurements."""

    setting: float
    time_s: float
    energy_j: float
    steps: int
    sweep_steps: int
    best_setting: float


def spec(preset: str, work: Work, noise_std: float, seed: int) -> SimulatedSpec:
    """An ideal board (the counter and the settings immediate): the knobs are compared,
    not the board's counter period."""
    return SimulatedSpec(
        gpu=preset,
        step_time_s=STEP_TIME_S,
        step_phases=work,
        noise_std=noise_std,
        seed=seed,
        energy_counter_period_s=0.0,
        setting_latency_s=0.0,
        power_average_s=0.0,
    )


def apply(gpu: SimulatedGPU, kind: SettingKind, setting: float) -> None:
    if kind == POWER_LIMIT:
        gpu.set_power_limit_w(setting)
    else:
        gpu.set_locked_clocks_mhz(round(setting), round(setting))


def candidates(gpu: SimulatedGPU, kind: SettingKind) -> list[float]:
    """The controller's default candidates of ``kind``, highest first."""
    if kind == LOCKED_CLOCK:
        return thin_clocks_mhz(gpu.supported_sm_clocks_mhz(), CLOCK_STEP_MHZ)
    lo_w, hi_w = gpu.power_limit_constraints_w()
    limits = []
    limit_w = hi_w
    while limit_w >= lo_w - 1e-9:
        limits.append(limit_w)
        limit_w -= GRID_STEP_W
    return limits


def measure(gpu: SimulatedGPU, steps: int) -> tuple[float, float]:
    start_s, start_j = gpu.now_s(), gpu.energy_j()
    gpu.run_step(steps)
    return (gpu.now_s() - start_s) / steps, (gpu.energy_j() - start_j) / steps


def truth(preset: str, work: Work, kind: SettingKind) -> list[Point]:
    """Every candidate of ``kind`` on a noiseless GPU, highest first."""
    (gpu,) = simulated_gpus(spec(preset, work, 0.0, 0))
    points = []
    for setting in candidates(gpu, kind):
        apply(gpu, kind, setting)
        gpu.run_step(TRUTH_SETTLE_STEPS)
        time_s, energy_j = measure(gpu, TRUTH_STEPS)
        clock = gpu.sm_clock_mhz()
        points.append(Point(setting, time_s, energy_j, None if clock is None else float(clock)))
    return points


def search(
    preset: str, work: Work, kind: SettingKind, selector: Selector, noise: float, seed: int
) -> tuple[float, int]:
    """The optimizer's choice of ``kind`` on a noisy GPU, and the steps it took."""
    (gpu,) = simulated_gpus(spec(preset, work, noise, seed))
    optimizer = PowerLimitOptimizer(
        candidates(gpu, kind),
        selector,
        num_gpus=1,
        seed=seed,
        max_power_limit_w=gpu.power_limit_constraints_w()[1],
        kind=kind,
    )
    while (window := optimizer.next_window()) is not None:
        apply(gpu, kind, window.power_limit_w)
        gpu.run_step(window.settle_steps)
        if window.measure_steps == 0:
            optimizer.report(window, time_per_step_s=0.0, energy_per_step_j=0.0)
            continue
        time_s, energy_j = measure(gpu, window.measure_steps)
        optimizer.report(window, time_per_step_s=time_s, energy_per_step_j=energy_j)
    chosen = optimizer.chosen_power_limit_w
    assert chosen is not None
    return chosen, optimizer.profiled_steps()


def objective(name: str, point: Point, max_power_w: float, bound_s: float | None) -> float:
    """The selector's cost of ``point`` (inf: over its time bound by more than 1 %)."""
    if bound_s is not None and point.time_s > bound_s * (1.0 + TOLERANCE):
        return float("inf")
    if name == "time":
        return point.time_s
    if name == "cost":
        return 0.5 * point.energy_j + 0.5 * max_power_w * point.time_s
    return point.energy_j


def selectors(caps: Sequence[Point]) -> dict[str, tuple[Selector, float | None]]:
    """Each selector and its time bound (None: unconstrained), from full power's step."""
    full_s = caps[0].time_s
    fastest_s = min(p.time_s for p in caps)
    return {
        "energy": (make_selector("energy"), None),
        "time": (make_selector("time"), None),
        "cost": (make_selector("cost", eta=0.5), None),
        "max_slowdown": (make_selector("max_slowdown", max_slowdown=1.1), 1.1 * full_s),
        "target_time": (
            make_selector("target_time", target_time_s=1.2 * fastest_s),
            1.2 * fastest_s,
        ),
    }


def equal_speed_changes_pct(caps: Sequence[Point], locks: Sequence[Point]) -> list[float]:
    """Per power limit: the energy change of the cheapest lock at least as fast, in %."""
    changes = []
    for cap in caps:
        faster = [p for p in locks if p.time_s <= cap.time_s * (1.0 + 1e-3)]
        if faster:
            lock = min(faster, key=lambda p: p.energy_j)
            changes.append(100.0 * (lock.energy_j / cap.energy_j - 1.0))
    return changes


def workload_result(preset: str, work: Work, noise: float, seed: int) -> dict[str, Any]:
    caps, locks = truth(preset, work, POWER_LIMIT), truth(preset, work, LOCKED_CLOCK)
    (gpu,) = simulated_gpus(spec(preset, work, 0.0, 0))
    max_power_w = gpu.power_limit_constraints_w()[1]
    by_kind = {POWER_LIMIT.name: caps, LOCKED_CLOCK.name: locks}
    rows: dict[str, Any] = {}
    for name, (selector, bound_s) in selectors(caps).items():
        choices: dict[str, Choice] = {}
        for kind in (POWER_LIMIT, LOCKED_CLOCK):
            points = by_kind[kind.name]
            chosen, steps = search(preset, work, kind, selector, noise, seed)
            point = next(p for p in points if p.setting == chosen)
            best = min(points, key=lambda p: objective(name, p, max_power_w, bound_s))
            choices[kind.name] = Choice(
                chosen,
                point.time_s,
                point.energy_j,
                steps,
                ZEUS_STEPS_PER_CANDIDATE * len(points),
                best.setting,
            )
        cost = {
            k: objective(name, Point(c.setting, c.time_s, c.energy_j, None), max_power_w, bound_s)
            for k, c in choices.items()
        }
        lock_cost, cap_cost = cost[LOCKED_CLOCK.name], cost[POWER_LIMIT.name]
        rows[name] = {
            **{k: asdict(c) for k, c in choices.items()},
            "lock_vs_cap_pct": 100.0 * (lock_cost / cap_cost - 1.0)
            if cap_cost < float("inf") and lock_cost < float("inf")
            else None,
            "auto_ok": lock_cost <= cap_cost * (1.0 + TOLERANCE),
        }
    return {
        "selectors": rows,
        "equal_speed_changes_pct": equal_speed_changes_pct(caps, locks),
        "average_clock_under_caps_mhz": {f"{p.setting:g}": p.sm_clock_mhz for p in caps},
    }


def preset_result(preset: str, noise: float, seed: int) -> dict[str, Any]:
    workloads = {
        name: workload_result(preset, work, noise, seed) for name, work in WORKLOADS.items()
    }
    changes = [c for w in workloads.values() for c in w["equal_speed_changes_pct"]]
    rows = [r for w in workloads.values() for r in w["selectors"].values()]
    return {
        "median_energy_change_pct": statistics.median(changes) if changes else None,
        "min_energy_change_pct": min(changes, default=None),
        "max_energy_change_pct": max(changes, default=None),
        "auto_ok": sum(r["auto_ok"] for r in rows),
        "auto_rows": len(rows),
        "measured": None,  # no measured lock-vs-cap data ships yet
        "workloads": workloads,
    }


def table(results: dict[str, Any]) -> str:
    lines = []
    for preset, result in results.items():
        lines.append(
            f"{preset}: lock vs cap at equal speed: median "
            f"{result['median_energy_change_pct']:+.2f} % (min "
            f"{result['min_energy_change_pct']:+.2f} %, max "
            f"{result['max_energy_change_pct']:+.2f} %); auto no worse than caps in "
            f"{result['auto_ok']}/{result['auto_rows']} (workload, selector) pairs"
        )
        lines.append(
            f"  {'workload':14} {'selector':13} {'cap W':>6} {'cap J':>8} {'cap s':>6} "
            f"{'lock MHz':>8} {'lock J':>8} {'lock s':>6} {'lock-cap':>8} "
            f"{'steps cap/lock (sweeps)':>26}"
        )
        for workload, w in result["workloads"].items():
            for name, row in w["selectors"].items():
                cap, lock = row[POWER_LIMIT.name], row[LOCKED_CLOCK.name]
                delta = row["lock_vs_cap_pct"]
                lines.append(
                    f"  {workload:14} {name:13} {cap['setting']:6.0f} {cap['energy_j']:8.1f} "
                    f"{cap['time_s']:6.3f} {lock['setting']:8.0f} {lock['energy_j']:8.1f} "
                    f"{lock['time_s']:6.3f} "
                    f"{'-' if delta is None else f'{delta:+.2f}%':>8} "
                    f"{cap['steps']:>5}/{lock['steps']:<5} ({cap['sweep_steps']}/"
                    f"{lock['sweep_steps']})"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=PRESETS, help="default: all")
    parser.add_argument("--noise-std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    results = {p: preset_result(p, args.noise_std, args.seed) for p in args.preset or PRESETS}
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
    else:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
