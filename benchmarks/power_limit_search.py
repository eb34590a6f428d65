"""Power-limit search vs. Zeus' exhaustive sweep, on trace-driven simulated GPUs.

For every (workload, batch size) of each power trace and every selector, a
:class:`~lightning_energy.optimize.power_limit.PowerLimitOptimizer` profiles a simulated GPU
that replays the trace with per-step noise on time and power. The loop is the controller's:
ask for a window, apply its limit, run its settle steps, read the GPU's energy counter and
the virtual clock, run the measured steps, read them again, report time and energy per step.

The simulated board is ideal (an energy counter that moves continuously, a limit that
applies at once), for the search and the sweep alike: the statistics of the search are
measured, not the board's counter period (the controller's window rule handles that).

Candidate limits are the limits the trace measured for the workload (highest first), so no
candidate is interpolated; a workload with fewer than two measured limits falls back to
every 25 W from the GPU's highest limit down (``candidates_measured`` says which).

The chosen limit is then scored on the noiseless trace against the brute-force optimum over
the same candidates, with the selector's own cost (energy for ``max_slowdown`` and
``target_time``): the gap is ``cost(chosen) / cost(optimum) - 1``. A row passes when the gap
is at most the tolerance (1 %); for the constrained selectors a time more than 1 % over the
bound is a failure (gap = inf). ``strict_failures`` counts the rows that fail with no such
tolerance (a gap over 1 % or any time over the bound), ``strict_violations`` the rows over
a bound at all. Steps are compared with Zeus' sweep: 10 warm-up and 40 profiled steps at
every limit (50 per limit).

Zeus' sweep itself is run on the same noisy GPU and scored the same way (``zeus_sweep_*``):
with noise, even 40 measured steps per limit do not always find the optimum.

After each ``cost`` run, the finished profile is also re-selected (no new steps) with
``target_time`` selectors at 8 targets spread from the fastest to the slowest step time of
the trace, as the carbon policy does. ``reselect_within_1pct`` is the share of those choices
within 1 % (energy and target time), ``reselect_within_3pct`` within 3 %, and
``reselect_max_gap_3pct_slack`` the worst energy gap with a 3 % slack on the target.

Usage::

    python benchmarks/power_limit_search.py                 # A40 and V100 traces
    python benchmarks/power_limit_search.py --seed 0 --seed 1 --json
    python benchmarks/power_limit_search.py --power-trace my_trace.csv --noise-std 0.05
    python benchmarks/power_limit_search.py --seed 3 --json > seed3.json   # one seed per run,
    python benchmarks/power_limit_search.py --merge seed0.json --merge seed3.json --json
                                                            # then their totals together
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_energy.device.simulated import PowerTrace, SimulatedSpec, TraceModel, simulated_gpus
from lightning_energy.optimize.power_limit import PowerLimitOptimizer
from lightning_energy.optimize.selectors import Measurement, Selector, make_selector

TOLERANCE = 0.01
ZEUS_WARMUP_STEPS = 10  # Zeus' defaults: 10 warm-up and 40 profiled steps per limit
ZEUS_PROFILE_STEPS = 40
ZEUS_STEPS_PER_LIMIT = ZEUS_WARMUP_STEPS + ZEUS_PROFILE_STEPS
GRID_STEP_W = 25.0
RESELECT_TARGETS = 8
SEED_STRIDE = 1000  # noise seed of a row: SEED_STRIDE * --seed + the workload's index


@dataclass(frozen=True)
class Row:
    """One optimizer run."""

    trace: str
    workload: str
    batch_size: int
    selector: str
    seed: int
    chosen_w: float
    optimum_w: float
    gap: float
    strict_gap: float
    strict_violation: bool
    profiled_steps: int
    exhaustive_steps: int
    zeus_chosen_w: float
    zeus_gap: float
    zeus_strict_gap: float
    zeus_strict_violation: bool
    reselect: tuple[tuple[float, float], ...]
    candidates_measured: bool

    @property
    def passed(self) -> bool:
        return self.gap <= TOLERANCE

    @property
    def strict_passed(self) -> bool:
        return self.strict_gap <= TOLERANCE


def candidates_w(lo_w: float, hi_w: float) -> list[float]:
    """Every 25 W from the highest limit down to the lowest, as the controller's default."""
    count = int((hi_w - lo_w) // GRID_STEP_W) + 1
    return [hi_w - i * GRID_STEP_W for i in range(count)]


def candidates_for(model: TraceModel) -> tuple[list[float], bool]:
    """The limits the trace measured for the workload, highest first, and True; or, when it
    measured fewer than two, the 25 W grid from the highest limit down, and False."""
    lo_w, hi_w = model.min_power_limit_w, model.max_power_limit_w
    measured = sorted({w for w in model.workload.power_limits_w if lo_w <= w <= hi_w})
    if len(measured) >= 2:
        return measured[::-1], True
    return candidates_w(lo_w, hi_w), False


def true_profile(model: TraceModel, limits_w: Sequence[float]) -> list[Measurement]:
    """Noiseless time and energy per step at each limit."""
    t0_s, share = model.step_work()
    profile = []
    for limit_w in limits_w:
        duration_s, power_w = model.run(t0_s, share, limit_w, None)
        profile.append(Measurement(limit_w, duration_s, duration_s * power_w, steps=0))
    return profile


def gap_of(
    selector: Selector, profile: Sequence[Measurement], limit_w: float, slack: float
) -> float:
    """The selector's gap of ``limit_w`` in ``profile`` (inf: breaks its time constraint)."""
    limits = np.array([m.power_limit_w for m in profile])
    gaps = selector.gaps(
        limits,
        np.array([[m.time_per_step_s for m in profile]]),
        np.array([[m.energy_per_step_j for m in profile]]),
        max_power_limit_w=float(limits.max()),
        num_gpus=1,
        time_slack=slack,
    )
    return float(gaps[0, int(np.flatnonzero(limits == limit_w)[0])])


def selectors_for(profile: Sequence[Measurement]) -> list[Selector]:
    fastest_s = min(m.time_per_step_s for m in profile)
    return [
        make_selector("energy"),
        make_selector("time"),
        make_selector("cost", eta=0.5),
        make_selector("max_slowdown", max_slowdown=1.1),
        make_selector("target_time", target_time_s=1.2 * fastest_s),
    ]


def run_search(
    spec: SimulatedSpec, selector: Selector, seed: int, limits: Sequence[float]
) -> PowerLimitOptimizer:
    """Drive an optimizer over ``limits`` on a simulated GPU the way the controller does."""
    (gpu,) = simulated_gpus(spec)
    optimizer = PowerLimitOptimizer(list(limits), selector, num_gpus=1, seed=seed)
    while (window := optimizer.next_window()) is not None:
        gpu.set_power_limit_w(window.power_limit_w)
        gpu.run_step(window.settle_steps)
        if window.measure_steps == 0:
            optimizer.report(window, time_per_step_s=0.0, energy_per_step_j=0.0)
            continue
        start_s, start_j = gpu.clock.now(), gpu.energy_j()
        gpu.run_step(window.measure_steps)
        optimizer.report(
            window,
            time_per_step_s=(gpu.clock.now() - start_s) / window.measure_steps,
            energy_per_step_j=(gpu.energy_j() - start_j) / window.measure_steps,
        )
    gpu.set_power_limit_w(gpu.default_power_limit_w())
    return optimizer


def zeus_sweep(spec: SimulatedSpec, limits: Sequence[float]) -> list[Measurement]:
    """Zeus' exhaustive sweep on the same noisy GPU: 10 warm-up + 40 measured steps per limit."""
    (gpu,) = simulated_gpus(spec)
    profile = []
    for limit_w in limits:
        gpu.set_power_limit_w(limit_w)
        gpu.run_step(ZEUS_WARMUP_STEPS)
        start_s, start_j = gpu.clock.now(), gpu.energy_j()
        gpu.run_step(ZEUS_PROFILE_STEPS)
        profile.append(
            Measurement(
                limit_w,
                (gpu.clock.now() - start_s) / ZEUS_PROFILE_STEPS,
                (gpu.energy_j() - start_j) / ZEUS_PROFILE_STEPS,
                ZEUS_PROFILE_STEPS,
            )
        )
    gpu.set_power_limit_w(gpu.default_power_limit_w())
    return profile


def reselect_gaps(
    optimizer: PowerLimitOptimizer, truth: Sequence[Measurement]
) -> tuple[tuple[float, float], ...]:
    """Gaps (1 % and 3 % slack) of re-selections with target_time across the trace's range."""
    times = [m.time_per_step_s for m in truth]
    gaps = []
    for target_s in np.linspace(min(times), max(times), RESELECT_TARGETS):
        selector = make_selector("target_time", target_time_s=float(target_s))
        chosen_w = optimizer.reselect(selector)
        gaps.append(
            (gap_of(selector, truth, chosen_w, 0.01), gap_of(selector, truth, chosen_w, 0.03))
        )
    return tuple(gaps)


def run_trace(trace_name: str, noise_std: float, seeds: Sequence[int]) -> list[Row]:
    trace = PowerTrace.load(trace_name)
    rows = []
    for index, (dataset, network, batch_size) in enumerate(trace.workloads()):
        for seed in seeds:
            spec = SimulatedSpec(
                gpu=trace_name,
                workload=f"{dataset}/{network}",
                batch_size=batch_size,
                noise_std=noise_std,
                # Every workload gets its own noise sequence (one seed would replay the same
                # relative noise on every workload and correlate their outcomes).
                seed=SEED_STRIDE * seed + index,
                # An ideal board for the search and the sweep alike: the presets' 100 ms
                # energy counter would make the controller stretch every window to 10 s
                # (min_window_s) and their 50 ms set latency would outlast the settle steps
                # of the fastest workloads; this measures the search's statistics only.
                energy_counter_period_s=0.0,
                setting_latency_s=0.0,
            )
            model = spec.model()
            assert isinstance(model, TraceModel)
            limits, measured = candidates_for(model)
            truth = true_profile(model, limits)
            zeus = zeus_sweep(spec, limits)
            for selector in selectors_for(truth):
                zeus_w = selector.select(
                    zeus, max_power_limit_w=limits[0], num_gpus=1
                ).power_limit_w
                optimizer = run_search(spec, selector, spec.seed, limits)
                chosen_w = optimizer.chosen_power_limit_w
                assert chosen_w is not None
                optimum = selector.select(truth, max_power_limit_w=limits[0], num_gpus=1)
                rows.append(
                    Row(
                        trace=spec.label,
                        workload=f"{dataset}/{network}",
                        batch_size=batch_size,
                        selector=selector.describe(),
                        seed=seed,
                        chosen_w=chosen_w,
                        optimum_w=optimum.power_limit_w,
                        gap=gap_of(selector, truth, chosen_w, TOLERANCE),
                        strict_gap=gap_of(selector, truth, chosen_w, 0.0),
                        strict_violation=gap_of(selector, truth, chosen_w, 0.0) == float("inf"),
                        profiled_steps=optimizer.profiled_steps(),
                        exhaustive_steps=ZEUS_STEPS_PER_LIMIT * len(limits),
                        zeus_chosen_w=zeus_w,
                        zeus_gap=gap_of(selector, truth, zeus_w, TOLERANCE),
                        zeus_strict_gap=gap_of(selector, truth, zeus_w, 0.0),
                        zeus_strict_violation=gap_of(selector, truth, zeus_w, 0.0) == float("inf"),
                        reselect=reselect_gaps(optimizer, truth) if selector.name == "cost" else (),
                        candidates_measured=measured,
                    )
                )
    return rows


def totals(rows: Sequence[Row]) -> dict[str, Any]:
    profiled = sum(r.profiled_steps for r in rows)
    exhaustive = sum(r.exhaustive_steps for r in rows)
    reselect = [g for r in rows for g in r.reselect]
    return {
        "rows": len(rows),
        "failures": sum(not r.passed for r in rows),
        "strict_failures": sum(not r.strict_passed for r in rows),
        "strict_violations": sum(r.strict_violation for r in rows),
        "max_cost_gap": max(r.gap for r in rows),
        "median_cost_gap": float(np.median([r.gap for r in rows])),
        "profiled_steps": profiled,
        "exhaustive_steps": exhaustive,
        "profiled_fraction": profiled / exhaustive,
        "max_row_profiled_fraction": max(r.profiled_steps / r.exhaustive_steps for r in rows),
        "zeus_sweep_failures": sum(r.zeus_gap > TOLERANCE for r in rows),
        "zeus_sweep_strict_failures": sum(r.zeus_strict_gap > TOLERANCE for r in rows),
        "zeus_sweep_max_cost_gap": max(r.zeus_gap for r in rows),
        "zeus_sweep_strict_violations": sum(r.zeus_strict_violation for r in rows),
        "rows_on_measured_limits": sum(r.candidates_measured for r in rows),
        "reselect_checks": len(reselect),
        "reselect_within_1pct": sum(g1 <= 0.01 for g1, _ in reselect) / max(len(reselect), 1),
        "reselect_within_3pct": sum(g3 <= 0.03 for _, g3 in reselect) / max(len(reselect), 1),
        "reselect_max_gap_3pct_slack": max((g3 for _, g3 in reselect), default=None),
    }


class MergeError(ValueError):
    """Runs given to ``--merge`` that cannot be reported together."""


def merge_runs(paths: Sequence[Path]) -> tuple[dict[str, Any], list[Row], float]:
    """The config, rows and summed wall time of earlier ``--json`` runs taken together.

    Rows are ordered as one run over all the seeds orders them (trace, workload, seed), so
    the totals equal that run's.

    Raises:
        MergeError: a file cannot be read or is not such a run's output, the runs differ in
            traces, noise or tolerance, or a seed appears in more than one run.
    """
    config: dict[str, Any] | None = None
    runs: dict[int, list[Row]] = {}
    seed_file: dict[int, Path] = {}
    wall_s = 0.0
    for path in paths:
        try:
            out = json.loads(path.read_text(encoding="utf-8"))
            run_config = {key: out["config"][key] for key in ("traces", "noise_std", "tolerance")}
            seeds = [int(seed) for seed in out["config"]["seeds"]]
            rows = [
                Row(**{**row, "reselect": tuple(tuple(g) for g in row["reselect"])})
                for row in out["rows"]
            ]
            wall_s += float(out["totals"]["wall_s"])
        except OSError as exc:
            raise MergeError(f"cannot read {path}: {exc.strerror}") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise MergeError(
                f"{path} is not the output of power_limit_search.py --json ({exc!r})"
            ) from exc
        if config is None:
            config = run_config
        for key, value in run_config.items():
            if value != config[key]:
                raise MergeError(
                    f"{path} has {key} {value}, the first file {config[key]}: "
                    "merge only runs of the same traces, noise_std and tolerance"
                )
        for seed in seeds:
            if seed in seed_file:
                raise MergeError(f"seed {seed} is in both {seed_file[seed]} and {path}")
            seed_file[seed] = path
            runs[seed] = [r for r in rows if r.seed == seed]
    assert config is not None  # argparse gives at least one path
    rows = [r for seed in sorted(runs) for r in runs[seed]]
    workloads = list(dict.fromkeys((r.trace, r.workload, r.batch_size) for r in rows))
    position = {key: i for i, key in enumerate(workloads)}
    rows.sort(key=lambda r: (position[(r.trace, r.workload, r.batch_size)], r.seed))
    return {**config, "seeds": sorted(runs)}, rows, wall_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--power-trace",
        action="append",
        help="shipped trace name (a40, v100) or Zeus-format CSV path; repeatable "
        "(default: a40 and v100)",
    )
    parser.add_argument("--noise-std", type=float, help="relative noise per step (default 0.03)")
    parser.add_argument(
        "--seed", type=int, action="append", help="noise/optimizer seed; repeatable"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        action="append",
        help="JSON output of an earlier --json run; repeatable: report the rows of all of them "
        "together (runs of the same traces and noise, no seed twice) instead of running",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.merge:
        given = [
            flag
            for flag, value in (
                ("--power-trace", args.power_trace),
                ("--noise-std", args.noise_std),
                ("--seed", args.seed),
            )
            if value is not None
        ]
        if given:
            parser.error(f"--merge takes its settings from the files; drop {', '.join(given)}")
        try:
            config, rows, wall_s = merge_runs(args.merge)
        except MergeError as exc:
            parser.error(f"--merge: {exc}")
    else:
        traces = args.power_trace or ["a40", "v100"]
        noise_std = 0.03 if args.noise_std is None else args.noise_std
        seeds = args.seed or [0]
        started = time.perf_counter()
        rows = [row for name in traces for row in run_trace(name, noise_std, seeds)]
        wall_s = time.perf_counter() - started
        config = {"traces": traces, "noise_std": noise_std, "seeds": seeds, "tolerance": TOLERANCE}
    summary = totals(rows)
    summary["wall_s"] = wall_s
    if args.json:
        # Gaps of choices that break a time constraint are Infinity (Python's json reads it).
        out = {"config": config, "rows": [r.__dict__ for r in rows], "totals": summary}
        json.dump(out, sys.stdout)
        print()
        return 0
    header = (
        f"{'gpu':<5} {'workload':<31} {'batch':>5} {'selector':<32} {'seed':>4} "
        f"{'chosen':>6} {'optimum':>7} {'gap':>7} {'steps':>5} {'sweep':>5} "
        f"{'zeus':>5} {'zeus gap':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        flag = "" if r.passed else "  FAIL"
        print(
            f"{r.trace:<5} {r.workload:<31} {r.batch_size:>5} {r.selector:<32} {r.seed:>4} "
            f"{r.chosen_w:>6.0f} {r.optimum_w:>7.0f} {_percent(r.gap):>7} "
            f"{r.profiled_steps:>5} {r.exhaustive_steps:>5} {r.zeus_chosen_w:>5.0f} "
            f"{_percent(r.zeus_gap):>8}{flag}"
        )
    print()
    print(f"config: {config}")
    for key, value in summary.items():
        print(f"{key}: {value}")
    return 0


def _percent(fraction: float) -> str:
    return "inf" if fraction == float("inf") else f"{100 * fraction:.2f}%"


if __name__ == "__main__":
    raise SystemExit(main())
