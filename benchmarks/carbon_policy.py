"""Carbon-aware pacing policies on real grid traces: grams emitted against an oracle.

Simulates training jobs of a given amount of work (24 h and 72 h at full speed by
default) with deadlines 10 %, 25 % and 50 % past the full-speed finish, with and without
pausing, starting at many times spread over each carbon-intensity trace. The job's
energy-time frontier comes from a Zeus power trace (one measured epoch per power limit).
Every policy (``static``, ``threshold``, ``forecast``; see ``docs/carbon-aware.md``) is
called once an hour, as the carbon monitor polls, with every measured power limit (as the
controller passes its profile), and the job runs its decision as the training side does,
at the trace's resolution until the next call: one power limit held for the whole hour (the
least energy that meets the target time, so a target between two limits runs at the faster
one), or a pause at idle power. Grams = energy x intensity of the interval it is used in.

Baselines: ``full`` runs at the fastest point from the start; ``oracle`` is the least-carbon
schedule for the true trace up to the same deadline on the policies' own operating points
(the convex frontier), planned once at the trace's resolution and executed exactly (no
re-planning, no rounding to hourly decisions); ``oracle_all_limits`` is the same with every
measured power limit (a limit off the frontier draws less power, which pays when the job may
not pause and the grid is dirty); ``oracle_same_action`` acts as the policies do: one of their
settings or a pause held for each hour, the least-carbon such plan for the true hourly means
(:func:`carbon.planning.plan_intervals`), executed on the trace. ``oracle`` is the looser
bound (it may also share an hour between settings and pause, and act at a finer
resolution), so a capture of ``oracle``'s saving never overstates one of the same-action
oracle's.

Forecast modes (both by default, reported side by side): ``perfect`` hands the policies the
trace's true values for the next 72 h (``--forecast-hours``, what the carbon monitor asks
for; an upper bound: no real forecast is exact; the policies continue it with their daily
profile); ``daily`` hands them none, so they rely on the daily profile they fit on the past
week.

Capture = the policy's saving over ``static`` / the oracle's saving, in grams summed over
the starts. Where the oracle itself saves nothing (under a millionth of the grams: without
pausing on the convex frontier, a constant pace is already the least-carbon schedule), there
is no headroom: the table says so and gives the grams saved instead of a ratio of two
roundings. A summary over every trace is printed only when there is more than one.

A paused job draws the GPU's idle power (by default the power trace's, as the simulated GPU
in training does); runs with and without pausing allowed are reported separately.

Usage::

    python benchmarks/carbon_policy.py --trace DE            # one trace, 10 starts per shape
    python benchmarks/carbon_policy.py                       # the three shipped traces
    python benchmarks/carbon_policy.py --starts 100          # the full run
    python benchmarks/carbon_policy.py --forecast perfect --forecast-hours 24
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
from itertools import pairwise
from pathlib import Path

import numpy as np
import numpy.typing as npt

from carbon.planning import (
    efficient_points,
    executed_point,
    fill_cheapest,
    interval_offsets,
    plan_intervals,
)
from carbon.policy import JobProgress, OperatingPoint, frontier_from_profile, make_policy
from carbon.providers.trace import SHIPPED_TRACES, TraceSeries, load_trace
from carbon.types import IntensityPoint, PointKind
from lightning_energy.device.simulated import TRACE_GPUS, PowerTrace

FloatArray = npt.NDArray[np.float64]

POLICIES = ("static", "threshold", "forecast")
ORACLES = ("oracle", "oracle_all_limits", "oracle_same_action")
REPORTED = (*POLICIES, *ORACLES)
FORECAST_MODES = ("perfect", "daily")
POLL_S = 3600.0
DAY_S = 86400.0
HISTORY_S = 7 * DAY_S
#: How far the perfect forecast reaches by default: what the carbon monitor asks for.
FORECAST_HOURS = 72.0
#: An oracle saving below this share of the grams is no headroom (rounding, not a saving).
NO_HEADROOM = 1e-6
J_PER_KWH = 3.6e6
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
    """The jobs of one shape on one trace in one forecast mode, run in one worker.

    ``measured`` holds every measured operating point for ``oracle_all_limits``; empty
    means the frontier.
    """

    trace_name: str
    times_s: FloatArray
    values: FloatArray
    frontier: tuple[OperatingPoint, ...]
    shape: Shape
    starts: tuple[int, ...]
    forecast_mode: str
    idle_power_w: float
    measured: tuple[OperatingPoint, ...] = ()
    forecast_horizon_s: float = FORECAST_HOURS * 3600.0


def load_points(path: Path, workload: str, batch_size: int) -> tuple[OperatingPoint, ...]:
    """Time and energy per step at every measured power limit of one workload.

    Args:
        path: a Zeus power trace: a CSV with columns dataset, network, batch_size,
            power_limit, time_per_epoch, average_power.
        workload: ``dataset/network``.
        batch_size: the batch size.

    Returns:
        One point per power limit, fastest first (the policies take the convex frontier).
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
    return tuple(sorted(points, key=lambda p: p.time_per_step_s))


def gpu_idle_power_w(path: Path) -> float:
    """The idle power of the power trace's GPU, as the trace-driven simulated GPU uses it."""
    for file_name, _, idle_power_w in TRACE_GPUS.values():
        if path.name == file_name:
            return idle_power_w
    return PowerTrace.load(path).idle_power_w


def start_indices(times_s: FloatArray, max_span_s: float, count: int) -> list[int]:
    """``count`` start rows spread evenly in time, each with a week of history before it and
    room for the longest job after it, at the first row at or after a whole hour.

    Works by time, not by row counts, so gaps and changes of resolution do not move a
    start too close to the end of the trace.
    """
    first_s = float(times_s[0]) + HISTORY_S
    last_s = float(times_s[-1]) - max_span_s - POLL_S
    if last_s <= first_s:
        raise SystemExit("the trace is too short for a week of history and the longest job")
    hours_s = np.floor(np.linspace(first_s, last_s, count) / POLL_S) * POLL_S
    rows = np.searchsorted(times_s, np.maximum(hours_s, first_s), side="left")
    return [int(r) for r in rows]


class _Trace:
    """Fast lookups into one trace for a simulation (each value holds until the next row;
    the last one holds on)."""

    def __init__(self, name: str, times_s: FloatArray, values: FloatArray) -> None:
        self.name = name
        self.times_s = times_s
        self.values = values
        self.ends_s = np.append(times_s[1:], np.inf)
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

    def forecast(self, t_s: float, horizon_s: float) -> list[IntensityPoint]:
        return self.points[self.index(t_s) + 1 : self.index(t_s + horizon_s) + 1]


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
    forecast_horizon_s: float = FORECAST_HOURS * 3600.0,
) -> tuple[float, bool]:
    """Run one job under a policy; return (grams, deadline missed).

    ``frontier`` holds the operating points the policy sees and the job may run at; a
    ``perfect`` forecast covers the next ``forecast_horizon_s``.
    """
    points = efficient_points(frontier)
    policy = make_policy(policy_name, allow_pause=shape.allow_pause, interval_s=POLL_S)
    policy.observe(trace.history(start_s))
    deadline = datetime.fromtimestamp(deadline_s, tz=timezone.utc)
    t_s, left, grams = start_s, float(steps), 0.0
    while left > 1e-9:
        progress = JobProgress(
            math.ceil(left - 1e-9), datetime.fromtimestamp(t_s, tz=timezone.utc), deadline
        )
        k = trace.index(t_s)
        forecast = trace.forecast(t_s, forecast_horizon_s) if forecast_mode == "perfect" else []
        decision = policy.decide(
            progress, float(trace.values[k]), forecast, frontier, idle_power_w=idle_power_w
        )
        # The training side's hair of slack: rounding never picks a faster limit.
        point = executed_point(points, decision.target_time_per_step_s * (1.0 + 1e-9))
        rate, power_w = 1.0 / point.time_per_step_s, point.power_w
        poll_end_s = t_s + POLL_S
        while t_s < poll_end_s - 1e-9 and left > 1e-9:
            k = trace.index(t_s)
            span_s = min(float(trace.ends_s[k]), poll_end_s) - t_s
            if decision.pause:
                grams += trace.values[k] * idle_power_w * span_s / J_PER_KWH
            else:
                span_s = min(span_s, left / rate)
                grams += trace.values[k] * power_w * span_s / J_PER_KWH
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
    return float(trace.values[k0 : k1 + 1] @ spans) * power_w / J_PER_KWH


def _lower_hull(vertices: Sequence[tuple[float, float]]) -> FloatArray:
    """The lower convex hull of (rate, power) vertices, by increasing rate, as rows."""
    hull: list[tuple[float, float]] = []
    for v in sorted(set(vertices)):
        if hull and hull[-1][0] == v[0]:
            continue  # the same rate at a higher power
        while len(hull) >= 2:
            (r0, p0), (r1, p1) = hull[-2], hull[-1]
            if (r1 - r0) * (v[1] - p0) - (p1 - p0) * (v[0] - r0) > 0.0:
                break
            hull.pop()
        hull.append(v)
    return np.array(hull, dtype=np.float64)


def plan_least_carbon(
    intensity: FloatArray,
    durations: FloatArray,
    need: float,
    points: Sequence[OperatingPoint],
    *,
    allow_pause: bool,
    idle_power_w: float,
) -> float:
    """Grams of the least-carbon schedule on given operating points, for the true trace.

    Any mix of the points may run in an interval: a point on the lower convex hull of
    power against rate. Until the interval in which the job ends, it runs at least at its
    slowest point (no pausing) or idles at ``idle_power_w`` (pausing); in that last
    interval it may also stop, which costs nothing (the hull with the origin). Each
    possible last interval is tried and the cheapest plan kept, so idle time after the
    end is never charged. With the convex frontier as ``points`` and no idle power this
    is the schedule of :func:`carbon.planning.plan_steps`.

    Args:
        intensity: carbon intensity of each interval.
        duration_s: length of each interval (the last one ends at the deadline).
        need: steps to do.
        points: the operating points the schedule may use.
        allow_pause: whether the job may stop during an interval before it ends.
        idle_power_w: power drawn while paused.

    Returns:
        The grams; when the work does not fit even at full speed, those of full speed in
        every interval.
    """
    vertices = [(1.0 / p.time_per_step_s, p.power_w) for p in points]
    r_max = max(r for r, _ in vertices)
    if need > r_max * float(durations.sum()):
        p_fast = min(p for r, p in vertices if r == r_max)
        return float(intensity @ durations) * p_fast / J_PER_KWH

    def segments(hull: FloatArray) -> tuple[FloatArray, FloatArray]:
        widths = np.diff(hull[:, 0])
        return np.diff(hull[:, 1]) / widths, widths

    run = _lower_hull([(0.0, idle_power_w), *vertices] if allow_pause else vertices)
    run_slopes, run_widths = segments(run)
    stop_slopes, stop_widths = segments(_lower_hull([(0.0, 0.0), *vertices]))
    r_base, p_base = float(run[0, 0]), float(run[0, 1])
    before = np.concatenate([[0.0], np.cumsum(durations)])
    first = int(np.searchsorted(r_max * before[1:], need, side="left"))
    last = min(int(np.searchsorted(r_base * before[1:], need, side="left")), durations.size - 1)
    best = math.inf
    k = run_slopes.size
    for m in range(first, last + 1):
        extra = need - r_base * before[m]
        if extra < 0.0:
            break
        costs = np.concatenate(
            [np.outer(intensity[:m], run_slopes).ravel(), intensity[m] * stop_slopes]
        )
        caps = np.concatenate(
            [np.outer(durations[:m], run_widths).ravel(), durations[m] * stop_widths]
        )
        if extra > caps.sum():
            continue
        alloc = fill_cheapest(costs, caps, extra)
        energy_j = p_base * durations[:m] + alloc[: m * k].reshape(m, k) @ run_slopes
        grams = (
            float(intensity[:m] @ energy_j) + intensity[m] * float(alloc[m * k :] @ stop_slopes)
        ) / J_PER_KWH
        best = min(best, grams)
    assert math.isfinite(best), "the full-speed run always ends in a candidate interval"
    return best


def simulate_oracle(
    trace: _Trace,
    points: tuple[OperatingPoint, ...],
    steps: int,
    start_s: float,
    deadline_s: float,
    allow_pause: bool,
    idle_power_w: float,
) -> float:
    """Grams of the least-carbon schedule on ``points`` for the true trace (perfect
    foresight), at the trace's resolution, up to the deadline."""
    k0, k1 = trace.index(start_s), trace.index(deadline_s - 1e-6)
    edges = np.append(np.clip(trace.times_s[k0 : k1 + 1], start_s, None), deadline_s)
    return plan_least_carbon(
        trace.values[k0 : k1 + 1],
        np.diff(edges),
        steps,
        points,
        allow_pause=allow_pause,
        idle_power_w=idle_power_w,
    )


#: Work-left grid of the same-action oracle's plan (finer than the policies' own).
SAME_ACTION_RESOLUTION = 4000


def simulate_same_action_oracle(
    trace: _Trace,
    points: Sequence[OperatingPoint],
    steps: int,
    start_s: float,
    deadline_s: float,
    allow_pause: bool,
    idle_power_w: float,
) -> float:
    """Grams of the least-carbon plan holding one of ``points`` or a pause for each hour
    from the start (the policies' actions), for the true trace, executed on it: each hour's
    intensity is the trace's mean over it, and the last run ends when the work is done
    (nothing is charged after that)."""
    edges = interval_offsets(deadline_s - start_s, POLL_S) + start_s
    means = np.array(
        [_grams_at_constant_power(trace, a, b, J_PER_KWH) / (b - a) for a, b in pairwise(edges)]
    )
    plan = plan_intervals(
        means,
        np.diff(edges),
        steps,
        points,
        allow_pause=allow_pause,
        idle_power_w=idle_power_w,
        resolution=SAME_ACTION_RESOLUTION,
    )
    assert plan.feasible, "the full-speed run always ends before the deadline"
    grams, left = 0.0, float(steps)
    for choice, (a_s, b_s) in zip(plan.choices, pairwise(edges), strict=True):
        if left <= 1e-9 * steps:  # done: the plan's pauses from here are no pauses
            break
        if choice < 0:
            grams += _grams_at_constant_power(trace, a_s, b_s, idle_power_w)
            continue
        point = points[int(choice)]
        run_s = min(b_s - a_s, left * point.time_per_step_s)
        grams += _grams_at_constant_power(trace, a_s, a_s + run_s, point.power_w)
        left -= run_s / point.time_per_step_s
    return grams


#: Traces already prepared in this worker process, by name and extent.
_TRACES: dict[tuple[str, int, float, float], _Trace] = {}


def run_task(task: Task) -> dict[str, list[float]]:
    """Simulate every start of one shape on one trace."""
    key = (task.trace_name, task.times_s.size, float(task.times_s[0]), float(task.times_s[-1]))
    trace = _TRACES.get(key)
    if trace is None or not (
        np.array_equal(trace.times_s, task.times_s) and np.array_equal(trace.values, task.values)
    ):
        trace = _TRACES[key] = _Trace(task.trace_name, task.times_s, task.values)
    fastest_s = task.frontier[0].time_per_step_s
    steps = round(task.shape.work_hours * 3600.0 / fastest_s)
    out: dict[str, list[float]] = {name: [] for name in ("full", *REPORTED)}
    out["missed"] = []
    for row in task.starts:
        start_s = float(trace.times_s[row])
        deadline_s = start_s + steps * fastest_s * (1.0 + task.shape.slack)
        out["full"].append(simulate_full(trace, task.frontier, steps, start_s))
        for name, points in (
            ("oracle", task.frontier),
            ("oracle_all_limits", task.measured or task.frontier),
        ):
            out[name].append(
                simulate_oracle(
                    trace,
                    points,
                    steps,
                    start_s,
                    deadline_s,
                    task.shape.allow_pause,
                    task.idle_power_w,
                )
            )
        out["oracle_same_action"].append(
            simulate_same_action_oracle(
                trace,
                efficient_points(task.measured or task.frontier),
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
                task.measured or task.frontier,
                steps,
                start_s,
                deadline_s,
                task.shape,
                task.forecast_mode,
                task.idle_power_w,
                task.forecast_horizon_s,
            )
            out[name].append(grams)
            missed.append(float(miss))
        out["missed"].extend(missed)
    return out


def summarise(results: Sequence[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per policy: ratios to full power and to static, grams saved over static, oracle
    captures (NaN where the oracle has no headroom), worse share, misses."""
    arrays = {k: np.concatenate([np.asarray(r[k]) for r in results]) for k in results[0]}
    full, static = arrays["full"], arrays["static"]
    missed = arrays["missed"].reshape(-1, len(POLICIES))
    gains = {name: float(np.sum(static - arrays[name])) for name in ORACLES}
    headroom = {name: gain > NO_HEADROOM * float(np.sum(static)) for name, gain in gains.items()}
    summary: dict[str, dict[str, float]] = {}
    for name in REPORTED:
        grams = arrays[name]
        vs_full, vs_static = grams / full, grams / static
        saving_g = float(np.sum(static - grams))
        captures = {
            f"{oracle}_capture": saving_g / gain if headroom[oracle] else math.nan
            for oracle, gain in gains.items()
        }
        summary[name] = {
            "jobs": float(grams.size),
            "vs_full_median": float(np.median(vs_full)),
            "vs_full_p10": float(np.percentile(vs_full, 10)),
            "vs_full_p90": float(np.percentile(vs_full, 90)),
            "vs_static_median": float(np.median(vs_static)),
            "vs_static_p10": float(np.percentile(vs_static, 10)),
            "vs_static_p90": float(np.percentile(vs_static, 90)),
            "vs_static_mean": float(np.sum(grams) / np.sum(static)),
            "saving_g": saving_g,
            **{f"{oracle}_saving_g": gain for oracle, gain in gains.items()},
            **captures,
            "worse_than_static_share": float(np.mean(grams > static * (1 + 1e-9))),
            "deadline_misses": float(missed[:, POLICIES.index(name)].sum())
            if name in POLICIES
            else 0.0,
        }
    return summary


def _percent(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.0%}"


def _capture(s: dict[str, float], oracle: str) -> str:
    """A capture, or where the oracle saves nothing, "no headroom" and the grams saved."""
    capture = s[f"{oracle}_capture"]
    if not math.isnan(capture):
        return f"{capture:.0%}"
    return f"no headroom: oracle {s[f'{oracle}_saving_g']:.1f} g, this {s['saving_g']:+.1f} g"


def format_table(rows: Sequence[tuple[str, dict[str, dict[str, float]]]]) -> str:
    """A Markdown table: one row per policy of each labelled summary."""
    lines = [
        "| trace, pausing | policy | jobs | g / static: median [p10, p90] | g / static: total "
        "| oracle capture | all-limits oracle capture | same-action oracle capture "
        "| worse than static | deadline misses |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, summary in rows:
        for name in REPORTED:
            s = summary[name]
            lines.append(
                f"| {label} | {name} | {int(s['jobs'])} | {s['vs_static_median']:.3f} "
                f"[{s['vs_static_p10']:.3f}, {s['vs_static_p90']:.3f}] | "
                f"{s['vs_static_mean']:.4f} | {_capture(s, 'oracle')} | "
                f"{_capture(s, 'oracle_all_limits')} | {_capture(s, 'oracle_same_action')} | "
                f"{s['worse_than_static_share']:.1%} | {int(s['deadline_misses'])} |"
            )
    return "\n".join(lines)


def _json_value(key: str, value: float) -> float | int | None:
    """Counts as integers, NaN (no oracle gain to capture) as null."""
    if math.isnan(value):
        return None
    return int(value) if key in ("deadline_misses", "jobs") else value


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
    parser.add_argument(
        "--emission-factor",
        choices=("direct", "lifecycle"),
        default="direct",
        help="which column of an Electricity Maps export to read (default: direct; grams of "
        "the two are not comparable)",
    )
    parser.add_argument("--power-trace", type=Path, default=Path(str(default_power)))
    parser.add_argument("--workload", default="imagenet/resnet50", help="dataset/network")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--forecast",
        choices=("both", *FORECAST_MODES),
        default="both",
        help="perfect: the true next --forecast-hours (an upper bound); daily: the past "
        "week's daily profile only; default: both, side by side",
    )
    parser.add_argument(
        "--forecast-hours",
        type=float,
        default=FORECAST_HOURS,
        help=f"how far the perfect forecast reaches (default {FORECAST_HOURS:g}, what the carbon "
        "monitor asks for; real forecasts reach 24-72 h)",
    )
    parser.add_argument(
        "--starts",
        type=int,
        default=10,
        help="start times per job shape (default 10; the published full run uses 100)",
    )
    parser.add_argument("--work-hours", type=float, nargs="+", default=[24.0, 72.0])
    parser.add_argument("--slack", type=float, nargs="+", default=[0.10, 0.25, 0.50])
    parser.add_argument("--pause", choices=("both", "yes", "no"), default="both")
    parser.add_argument(
        "--idle-power-w",
        type=float,
        help="power drawn while paused (default: the power trace's GPU idle power)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the tables (or JSON)."""
    args = parse_args(argv)
    if args.starts < 1:
        raise SystemExit(f"--starts must be at least 1; got {args.starts}")
    if not (math.isfinite(args.forecast_hours) and args.forecast_hours > 0):
        raise SystemExit(f"--forecast-hours must be a number > 0; got {args.forecast_hours}")
    measured = load_points(args.power_trace, args.workload, args.batch_size)
    frontier = frontier_from_profile(measured)
    idle_power_w = (
        gpu_idle_power_w(args.power_trace) if args.idle_power_w is None else args.idle_power_w
    )
    modes = FORECAST_MODES if args.forecast == "both" else (args.forecast,)
    pauses = {"both": (False, True), "yes": (True,), "no": (False,)}[args.pause]
    shapes = [Shape(h, s, p) for h in args.work_hours for s in args.slack for p in pauses]
    max_span_s = max(s.work_hours * 3600.0 * (1 + s.slack) for s in shapes)
    traces: list[TraceSeries] = [
        load_trace(
            name,
            time_col=args.time_col,
            value_col=args.value_col,
            emission_factor="lifecycle" if args.emission_factor == "lifecycle" else "direct",
        )
        for name in (args.trace or list(SHIPPED_TRACES))
    ]
    tasks = []
    for series in traces:
        times_s = np.asarray(series.times_s, dtype=np.float64)
        start_rows = tuple(start_indices(times_s, max_span_s, args.starts))
        values = np.asarray(series.values_g_per_kwh, dtype=np.float64)
        for mode in modes:
            for shape in shapes:
                tasks.append(
                    Task(
                        series.name,
                        times_s,
                        values,
                        frontier,
                        shape,
                        start_rows,
                        mode,
                        idle_power_w,
                        measured,
                        args.forecast_hours * 3600.0,
                    )
                )
    began = time.perf_counter()
    workers = max(1, min(args.workers, len(tasks)))
    if workers == 1:
        results = [run_task(task) for task in tasks]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(run_task, tasks))
    elapsed_s = time.perf_counter() - began
    groups: dict[tuple[str, str, bool], list[dict[str, list[float]]]] = {}
    overall = ("all",) if len(traces) > 1 else ()  # one trace is its own summary
    for task, result in zip(tasks, results, strict=True):
        for trace in (task.trace_name, *overall):
            groups.setdefault((task.forecast_mode, trace, task.shape.allow_pause), []).append(
                result
            )
    summaries = {key: summarise(res) for key, res in groups.items()}
    if args.json:
        out = {
            "settings": {
                "workload": args.workload,
                "batch_size": args.batch_size,
                "starts": args.starts,
                "forecast_hours": args.forecast_hours,
                "work_hours": args.work_hours,
                "slack": args.slack,
                "frontier": [p.label for p in frontier],
                "measured_limits": [p.label for p in measured],
                "emission_factor": args.emission_factor,
            },
            "elapsed_s": elapsed_s,
            "results": [
                {
                    "settings": {
                        "forecast": mode,
                        "trace": trace,
                        "allow_pause": allow_pause,
                        "idle_power_w": idle_power_w,
                    },
                    "policies": {
                        name: {k: _json_value(k, v) for k, v in summary[name].items()}
                        for name in REPORTED
                    },
                }
                for (mode, trace, allow_pause), summary in summaries.items()
            ],
        }
        print(json.dumps(out, indent=2))
        return 0
    hull = ", ".join(
        f"{p.label} ({p.time_per_step_s / frontier[0].time_per_step_s:.3f}x)" for p in frontier
    )
    print(
        f"workload {args.workload} bs {args.batch_size}; frontier: {hull} (of "
        f"{len(measured)} measured limits); idle {idle_power_w:g} W; {len(shapes)} shapes x "
        f"{args.starts} starts per trace and forecast mode; {args.emission_factor} emission "
        f"factors; {elapsed_s:.0f} s"
    )
    for mode in modes:
        title = {
            "perfect": f"perfect forecast of the next {args.forecast_hours:g} h (an upper bound)",
            "daily": "no forecast: daily profile of the past week",
        }[mode]
        rows = [
            (f"{trace}, {'pause' if allow_pause else 'no pause'}", summary)
            for (m, trace, allow_pause), summary in summaries.items()
            if m == mode
        ]
        print()
        print(f"**{title}**")
        print()
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
