"""Carbon-aware pacing policies on real grid traces: grams emitted against an oracle.

Simulates training jobs of a given amount of work (24 h and 72 h at full speed by
default) with deadlines 10 %, 25 % and 50 % past the full-speed finish, with and without
pausing, starting at many times spread over each carbon-intensity trace. The job's
energy-time frontier comes from a Zeus power trace (one measured epoch per power limit).
Every policy (``static``, ``threshold``, ``forecast``; see ``docs/carbon-aware.md``) is
called once an hour, as the carbon monitor polls, and the job runs its decision at the
trace's resolution until the next call; a target time between two frontier points is run
by time sharing. Grams = energy x intensity of the interval it is used in.

Baselines: ``full`` runs at the fastest point from the start; ``oracle`` is the least-carbon
schedule for the true trace up to the same deadline, planned once at the trace's
resolution and executed exactly (no re-planning, no rounding to hourly decisions).

Forecast modes: ``perfect`` hands the policies the trace's true values for the next 24 h
(a perfect day-ahead forecast; the policies continue it with their daily profile);
``daily`` hands them none, so they rely on the daily profile they fit on the past week.

Usage::

    python benchmarks/carbon_policy.py                       # the three shipped traces
    python benchmarks/carbon_policy.py --trace my.csv --time-col Time --value-col CI --json

Data: Electricity Maps 2023 (CISO, DE; ODbL), Wiesner et al. 2021 (FR); Zeus A40 power
traces (Apache-2.0).
"""

from __future__ import annotations

import argparse
import csv
import importlib.resources
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import numpy.typing as npt

from carbon.planning import energy_per_step_j, plan_steps
from carbon.policy import JobProgress, OperatingPoint, frontier_from_profile, make_policy
from carbon.providers.trace import SHIPPED_TRACES, TraceSeries, load_trace
from carbon.types import IntensityPoint, PointKind

FloatArray = npt.NDArray[np.float64]

POLICIES = ("static", "threshold", "forecast")
REPORTED = (*POLICIES, "oracle")
POLL_S = 3600.0
DAY_S = 86400.0
HISTORY_S = 7 * DAY_S
FORECAST_HORIZON_S = DAY_S
#: The simulation splits one measured epoch into this many steps; ratios do not depend on it.
STEPS_PER_EPOCH = 1000


@dataclass(frozen=True)
class Shape:
    """One kind of job: its work at full speed, its slack and whether it may pause."""

    work_hours: float
    slack: float
    allow_pause: bool

    @property
    def label(self) -> str:
        pause = "pause" if self.allow_pause else "no pause"
        return f"{self.work_hours:g} h, +{self.slack:.0%}, {pause}"


@dataclass(frozen=True)
class Task:
    """The jobs of one shape on one trace, run in one worker."""

    trace_name: str
    times_s: FloatArray
    values: FloatArray
    frontier: tuple[OperatingPoint, ...]
    shape: Shape
    starts: tuple[int, ...]
    forecast_mode: str
    idle_power_w: float


def load_frontier(path: Path, workload: str, batch_size: int) -> tuple[OperatingPoint, ...]:
    """Time and energy per step at each power limit of one workload of a Zeus power trace.

    Args:
        path: a CSV with columns dataset, network, batch_size, power_limit, time_per_epoch,
            average_power.
        workload: ``dataset/network``.
        batch_size: the batch size.

    Returns:
        The convex frontier, fastest first.
    """
    dataset, _, network = workload.partition("/")
    points = []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            if (row["dataset"], row["network"], row["batch_size"]) != (
                dataset,
                network,
                str(batch_size),
            ):
                continue
            step_s = float(row["time_per_epoch"]) / STEPS_PER_EPOCH
            power_w = float(row["average_power"])
            label = f"{float(row['power_limit']):g} W"
            points.append(OperatingPoint(step_s, step_s * power_w, label))
    if not points:
        raise SystemExit(f"no rows for workload {workload!r} at batch size {batch_size} in {path}")
    return frontier_from_profile(points)


def start_indices(series_len: int, period_s: float, max_span_s: float, count: int) -> list[int]:
    """``count`` start rows spread evenly, each with a week of history before it and room
    for the longest job after it, aligned to whole hours."""
    first = math.ceil(HISTORY_S / period_s)
    last = series_len - math.ceil((max_span_s + POLL_S) / period_s) - 1
    if last <= first:
        raise SystemExit("the trace is too short for a week of history and the longest job")
    step_rows = max(1, round(POLL_S / period_s))
    rows = np.linspace(first, last, count)
    return [int(r) // step_rows * step_rows for r in rows]


class _Trace:
    """Fast lookups into one trace for a simulation."""

    def __init__(self, name: str, times_s: FloatArray, values: FloatArray) -> None:
        self.name = name
        self.times_s = times_s
        self.values = values
        self.period_s = float(np.median(np.diff(times_s)))
        self.points = [
            IntensityPoint(
                datetime.fromtimestamp(float(t), tz=timezone.utc),
                float(v),
                PointKind.FORECAST,
                f"trace:{name}",
            )
            for t, v in zip(times_s, values, strict=True)
        ]

    def index(self, t_s: float) -> int:
        return int(np.searchsorted(self.times_s, t_s + 1e-6, side="right")) - 1

    def history(self, t_s: float) -> list[IntensityPoint]:
        lo, hi = self.index(t_s - HISTORY_S), self.index(t_s)
        return [
            IntensityPoint(p.time, p.intensity_g_per_kwh, PointKind.MEASURED, p.source)
            for p in self.points[max(lo, 0) : hi]
        ]

    def forecast(self, t_s: float) -> list[IntensityPoint]:
        k = self.index(t_s)
        return self.points[k + 1 : k + 1 + round(FORECAST_HORIZON_S / self.period_s)]


def simulate_policy(
    trace: _Trace,
    policy_name: str,
    frontier: tuple[OperatingPoint, ...],
    steps: int,
    start_s: float,
    deadline_s: float,
    shape: Shape,
    forecast_mode: str,
    idle_power_w: float,
) -> tuple[float, bool]:
    """Run one job under a policy; return (grams, deadline missed)."""
    policy = make_policy(policy_name, allow_pause=shape.allow_pause, interval_s=POLL_S)
    policy.observe(trace.history(start_s))
    deadline = datetime.fromtimestamp(deadline_s, tz=timezone.utc)
    t_s, left, grams = start_s, float(steps), 0.0
    while left > 1e-9:
        progress = JobProgress(
            math.ceil(left - 1e-9), datetime.fromtimestamp(t_s, tz=timezone.utc), deadline
        )
        k = trace.index(t_s)
        forecast = trace.forecast(t_s) if forecast_mode == "perfect" else []
        decision = policy.decide(
            progress, float(trace.values[k]), forecast, frontier, idle_power_w=idle_power_w
        )
        rate = 1.0 / decision.target_time_per_step_s
        power_w = rate * energy_per_step_j(frontier, decision.target_time_per_step_s)
        poll_end_s = t_s + POLL_S
        while t_s < poll_end_s - 1e-9 and left > 1e-9:
            k = trace.index(t_s)
            span_s = min(float(trace.times_s[k]) + trace.period_s, poll_end_s) - t_s
            if decision.pause:
                grams += trace.values[k] * idle_power_w * span_s / 3.6e6
            else:
                span_s = min(span_s, left / rate)
                grams += trace.values[k] * power_w * span_s / 3.6e6
                left -= rate * span_s
            t_s += span_s
    return grams, t_s > deadline_s + 1e-6


def simulate_full(
    trace: _Trace, frontier: tuple[OperatingPoint, ...], steps: int, start_s: float
) -> float:
    """Grams of running at the fastest point from the start."""
    fastest = frontier[0]
    end_s = start_s + steps * fastest.time_per_step_s
    return _grams_at_constant_power(trace, start_s, end_s, fastest.power_w)


def _grams_at_constant_power(trace: _Trace, start_s: float, end_s: float, power_w: float) -> float:
    k0, k1 = trace.index(start_s), trace.index(end_s)
    edges = np.clip(trace.times_s[k0 : k1 + 2], start_s, end_s)
    if edges.size < k1 - k0 + 2:
        edges = np.append(edges, end_s)
    spans = np.diff(edges)
    return float(trace.values[k0 : k1 + 1] @ spans) * power_w / 3.6e6


def simulate_oracle(
    trace: _Trace,
    frontier: tuple[OperatingPoint, ...],
    steps: int,
    start_s: float,
    deadline_s: float,
    allow_pause: bool,
    idle_power_w: float,
) -> float:
    """Grams of the least-carbon schedule for the true trace (perfect foresight)."""
    k0, k1 = trace.index(start_s), trace.index(deadline_s - 1e-6)
    edges = np.append(np.clip(trace.times_s[k0 : k1 + 1], start_s, None), deadline_s)
    intensity = trace.values[k0 : k1 + 1]
    plan = plan_steps(
        intensity,
        np.diff(edges),
        steps,
        frontier,
        allow_pause=allow_pause,
        idle_power_w=idle_power_w,
    )
    working = np.flatnonzero(plan.steps > 0)
    after = slice(int(working[-1]) + 1 if working.size else 0, None)
    idle_after = float(intensity[after] @ np.diff(edges)[after]) * idle_power_w / 3.6e6
    return plan.emissions_g - (idle_after if allow_pause else 0.0)


def run_task(task: Task) -> dict[str, list[float]]:
    """Simulate every start of one shape on one trace."""
    trace = _Trace(task.trace_name, task.times_s, task.values)
    fastest_s = task.frontier[0].time_per_step_s
    steps = round(task.shape.work_hours * 3600.0 / fastest_s)
    out: dict[str, list[float]] = {name: [] for name in ("full", *REPORTED)}
    out["missed"] = []
    for row in task.starts:
        start_s = float(trace.times_s[row])
        deadline_s = start_s + steps * fastest_s * (1.0 + task.shape.slack)
        out["full"].append(simulate_full(trace, task.frontier, steps, start_s))
        out["oracle"].append(
            simulate_oracle(
                trace,
                task.frontier,
                steps,
                start_s,
                deadline_s,
                task.shape.allow_pause,
                task.idle_power_w,
            )
        )
        missed = []
        for name in POLICIES:
            grams, miss = simulate_policy(
                trace,
                name,
                task.frontier,
                steps,
                start_s,
                deadline_s,
                task.shape,
                task.forecast_mode,
                task.idle_power_w,
            )
            out[name].append(grams)
            missed.append(float(miss))
        out["missed"].extend(missed)
    return out


def summarise(results: Sequence[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per policy: ratios to full power and to static, oracle capture, worse share, misses."""
    arrays = {k: np.concatenate([np.asarray(r[k]) for r in results]) for k in results[0]}
    full, static, oracle = arrays["full"], arrays["static"], arrays["oracle"]
    missed = arrays["missed"].reshape(-1, len(POLICIES))
    oracle_gain = float(np.sum(static - oracle))
    summary: dict[str, dict[str, float]] = {}
    for name in REPORTED:
        grams = arrays[name]
        vs_full, vs_static = grams / full, grams / static
        summary[name] = {
            "jobs": float(grams.size),
            "vs_full_median": float(np.median(vs_full)),
            "vs_full_p10": float(np.percentile(vs_full, 10)),
            "vs_full_p90": float(np.percentile(vs_full, 90)),
            "vs_static_median": float(np.median(vs_static)),
            "vs_static_p10": float(np.percentile(vs_static, 10)),
            "vs_static_p90": float(np.percentile(vs_static, 90)),
            "oracle_capture": float(np.sum(static - grams)) / oracle_gain
            if oracle_gain > 0
            else float("nan"),
            "worse_than_static_share": float(np.mean(grams > static * (1 + 1e-9))),
            "deadline_misses": float(missed[:, POLICIES.index(name)].sum())
            if name in POLICIES
            else 0.0,
        }
    return summary


def format_table(title: str, summary: dict[str, dict[str, float]]) -> str:
    """A Markdown table of one summary."""
    lines = [
        f"**{title}** ({int(summary['static']['jobs'])} jobs)",
        "",
        "| policy | g / full: median [p10, p90] | g / static: median [p10, p90] "
        "| oracle capture | worse than static | deadline misses |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in REPORTED:
        s = summary[name]
        capture = "n/a" if math.isnan(s["oracle_capture"]) else f"{s['oracle_capture']:.0%}"
        lines.append(
            f"| {name} | {s['vs_full_median']:.3f} [{s['vs_full_p10']:.3f}, "
            f"{s['vs_full_p90']:.3f}] | {s['vs_static_median']:.3f} "
            f"[{s['vs_static_p10']:.3f}, {s['vs_static_p90']:.3f}] | {capture} "
            f"| {s['worse_than_static_share']:.1%} | {int(s['deadline_misses'])} |"
        )
    return "\n".join(lines)


def _json_value(key: str, value: float) -> float | int | None:
    """Counts as integers, NaN (no oracle gain to capture) as null."""
    if math.isnan(value):
        return None
    return int(value) if key == "deadline_misses" else value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    default_power = (
        importlib.resources.files("lightning_energy")
        / "data"
        / "gpu_profiles"
        / "zeus_summary_power_a40.csv"
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace",
        action="append",
        help="a carbon-intensity CSV or a shipped trace name (CISO, DE, FR); repeatable; "
        "default: the three shipped traces",
    )
    parser.add_argument("--time-col", help="the trace's time column (detected by default)")
    parser.add_argument("--value-col", help="the trace's intensity column (detected by default)")
    parser.add_argument("--power-trace", type=Path, default=Path(str(default_power)))
    parser.add_argument("--workload", default="imagenet/resnet50", help="dataset/network")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--forecast", choices=("perfect", "daily"), default="perfect")
    parser.add_argument("--starts", type=int, default=100, help="start times per job shape")
    parser.add_argument("--work-hours", type=float, nargs="+", default=[24.0, 72.0])
    parser.add_argument("--slack", type=float, nargs="+", default=[0.10, 0.25, 0.50])
    parser.add_argument("--pause", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--idle-power-w", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the tables (or JSON)."""
    args = parse_args(argv)
    frontier = load_frontier(args.power_trace, args.workload, args.batch_size)
    pauses = {"both": (False, True), "yes": (True,), "no": (False,)}[args.pause]
    shapes = [Shape(h, s, p) for h in args.work_hours for s in args.slack for p in pauses]
    max_span_s = max(s.work_hours * 3600.0 * (1 + s.slack) for s in shapes)
    traces: list[TraceSeries] = [
        load_trace(name, time_col=args.time_col, value_col=args.value_col)
        for name in (args.trace or list(SHIPPED_TRACES))
    ]
    tasks = []
    for series in traces:
        rows = start_indices(len(series), series.period_s, max_span_s, args.starts)
        for shape in shapes:
            tasks.append(
                Task(
                    series.name,
                    np.asarray(series.times_s),
                    np.asarray(series.values_g_per_kwh),
                    frontier,
                    shape,
                    tuple(rows),
                    args.forecast,
                    args.idle_power_w,
                )
            )
    began = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        results = list(pool.map(run_task, tasks))
    elapsed_s = time.perf_counter() - began
    by_trace: dict[str, list[dict[str, list[float]]]] = {}
    by_shape: dict[tuple[str, bool], list[dict[str, list[float]]]] = {}
    for task, result in zip(tasks, results, strict=True):
        by_trace.setdefault(task.trace_name, []).append(result)
        by_shape.setdefault((task.trace_name, task.shape.allow_pause), []).append(result)
    overall = summarise(results)
    if args.json:
        keys = ("oracle_capture", "worse_than_static_share", "deadline_misses")
        trace_summaries = {trace: summarise(res) for trace, res in by_trace.items()}
        out: dict[str, dict[str, object]] = {}
        for name in REPORTED:
            out[name] = {key: _json_value(key, overall[name][key]) for key in keys}
            out[name]["by_trace"] = {
                trace: {key: _json_value(key, summary[name][key]) for key in keys}
                for trace, summary in trace_summaries.items()
            }
        print(json.dumps(out, indent=2))
        return 0
    hull = ", ".join(
        f"{p.label} ({p.time_per_step_s / frontier[0].time_per_step_s:.3f}x)" for p in frontier
    )
    print(
        f"workload {args.workload} bs {args.batch_size}; frontier: {hull}; forecast "
        f"{args.forecast}; idle {args.idle_power_w:g} W; {len(shapes)} shapes x "
        f"{args.starts} starts; {elapsed_s:.0f} s"
    )
    for trace, res in by_trace.items():
        print()
        print(format_table(f"{trace}, all shapes", summarise(res)))
        for allow_pause in pauses:
            label = "pause allowed" if allow_pause else "no pause"
            print()
            print(format_table(f"{trace}, {label}", summarise(by_shape[(trace, allow_pause)])))
    print()
    print(format_table("all traces", overall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
