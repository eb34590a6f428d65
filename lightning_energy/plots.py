"""Figures of a run report (PNG, matplotlib's Agg renderer; no display needed).

:func:`render_plots` draws three files from a report (:mod:`lightning_energy.report`):

- ``power.png``: the power limit applied and the average power drawn over the run, with
  the grid's carbon intensity on a second axis and, below, the target step-time scale of
  carbon-aware pacing (when the run had a ``carbon:`` section);
- ``frontier.png``: the measured energy-time frontier (energy per step against time per
  step, one point per power limit) with the selector's choice and later re-choices marked;
- ``emissions.png``: cumulative grams of CO2eq against the training step, compared with
  the carbon-unaware and the full-power baselines the controller estimates for the same
  intervals (cumulative energy against the full-power estimate for runs without carbon
  data).

Figures are built with :class:`matplotlib.figure.Figure` directly, never through
``pyplot``, so nothing global (backend, open figures) is touched.

Example:
    >>> from lightning_energy.report import load_report
    >>> render_plots(load_report("runs/demo.json"), "runs/plots")  # doctest: +SKIP
    [PosixPath('runs/plots/power.png'), PosixPath('runs/plots/frontier.png'), ...]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from carbon.accounting import J_PER_KWH
from lightning_energy.report import ReportError, chosen_power_limits_w, profile_setting

__all__ = ["plot_emissions", "plot_frontier", "plot_power", "render_plots"]

log = logging.getLogger(__name__)

_DPI = 120
_COLORS = {
    "limit": "#1f77b4",
    "power": "#ff7f0e",
    "intensity": "#2ca02c",
    "scale": "#9467bd",
    "run": "#1f77b4",
    "unaware": "#7f7f7f",
    "full": "#d62728",
}


def render_plots(report: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Draw the report's figures into ``out_dir`` (created if needed).

    Args:
        report: a run report.
        out_dir: the folder to write ``power.png``, ``frontier.png`` and ``emissions.png``.

    Returns:
        The files written.

    Raises:
        ReportError: the folder cannot be created or a file cannot be written.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"cannot create the folder {out}: {exc.strerror or exc}") from exc
    paths = [
        plot_power(report, out / "power.png"),
        plot_frontier(report, out / "frontier.png"),
        plot_emissions(report, out / "emissions.png"),
    ]
    log.info("plots written to %s", out)
    return paths


# --------------------------------------------------------------------------- helpers
def _time_unit(total_s: float) -> tuple[float, str]:
    """A divisor and a unit name that make the time axis readable."""
    if total_s >= 2 * 3600:
        return 3600.0, "h"
    if total_s >= 2 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _measured(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The timeline's intervals that lasted (the last one may be empty at teardown)."""
    return [e for e in report.get("timeline", []) if float(e.get("duration_s", 0.0)) > 0]


def _edges(timeline: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Interval boundaries (device-clock seconds from the start) of the timeline."""
    ends = np.array([float(e["time_s"]) for e in timeline])
    starts = ends - np.array([float(e.get("duration_s", 0.0)) for e in timeline])
    return np.concatenate([[starts[0]], ends]) if len(ends) else np.array([0.0])


def _series(timeline: Sequence[Mapping[str, Any]], key: str) -> np.ndarray | None:
    """Values of ``key`` per interval (NaN where missing); None when no interval has it."""
    values = [e.get(key) for e in timeline]
    if all(v is None for v in values):
        return None
    return np.array([np.nan if v is None else float(v) for v in values])


def _save(fig: Figure, path: Path) -> Path:
    try:
        fig.savefig(path, dpi=_DPI)
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


def _gpu_label(report: Mapping[str, Any]) -> str:
    names = sorted({str(d.get("name", "GPU")) for d in report.get("devices", [])})
    count = len(report.get("devices", []))
    if not names:
        return "no GPU"
    return f"{count}x {' / '.join(names)}" if count > 1 else names[0]


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _note(ax: Axes, message: str) -> None:
    """Say in words what a panel would show (its time axis is kept)."""
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_yticks([])


# --------------------------------------------------------------------------- power
def _limit_steps(report: Mapping[str, Any], end_s: float) -> tuple[list[float], list[float]]:
    """Times and values of the power limit as a step function from 0 to ``end_s``."""
    summary = report.get("summary", {})
    decisions = [
        d
        for d in report.get("decisions", [])
        if d.get("kind") == "power_limit" and d.get("value") is not None
    ]
    times: list[float] = []
    values: list[float] = []
    pre = summary.get("pre_job_power_limit_w")
    if pre is not None and (not decisions or float(decisions[0]["time_s"]) > 0):
        times.append(0.0)
        values.append(float(pre))
    for d in decisions:
        times.append(float(d["time_s"]))
        values.append(float(d["value"]))
    if values:
        times.append(max(end_s, times[-1]))
        values.append(values[-1])
    return times, values


def plot_power(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Power limit and average power over time, carbon intensity on a second axis.

    Args:
        report: a run report.
        path: the PNG to write.

    Returns:
        The path written.
    """
    timeline = _measured(report)
    scale = _series(timeline, "scale")
    rows = 2 if scale is not None else 1
    fig = Figure(figsize=(10, 5.5 if rows == 1 else 7.5), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False, height_ratios=[3, 1][:rows])
    ax: Axes = axes[0][0]
    fig.suptitle(f"Power limit and power draw over time: {_gpu_label(report)}")
    if not timeline:
        _empty(ax, "no interval was measured (the run was shorter than one logging interval)")
        return _save(fig, Path(path))
    edges = _edges(timeline)
    div, unit = _time_unit(float(edges[-1]))
    x = edges / div
    limit_t, limit_w = _limit_steps(report, float(edges[-1]))
    handles: list[Artist] = []
    if limit_w:
        (line,) = ax.step(
            np.array(limit_t) / div,
            limit_w,
            where="post",
            color=_COLORS["limit"],
            linewidth=2,
            label="power limit (W)",
        )
        handles.append(line)
    power = _series(timeline, "power_w")
    if power is not None:
        handles.append(
            ax.stairs(
                power,
                x,
                baseline=None,
                color=_COLORS["power"],
                linewidth=1.5,
                label="average power (W)",
            )
        )
    ax.set_ylabel("power (W)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    intensity = _series(timeline, "intensity_g_per_kwh")
    if intensity is not None:
        twin = ax.twinx()
        handles.append(
            twin.stairs(
                intensity,
                x,
                baseline=None,
                color=_COLORS["intensity"],
                linewidth=1.5,
                linestyle="--",
                label="carbon intensity (gCO2eq/kWh)",
            )
        )
        twin.set_ylabel("carbon intensity (gCO2eq/kWh)", color=_COLORS["intensity"])
        twin.set_ylim(bottom=0)
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small")
    bottom: Axes = axes[-1][0]
    if scale is not None and round(float(np.nanmin(scale)), 2) == round(float(np.nanmax(scale)), 2):
        bottom.set_title("carbon-aware pace", fontsize="small", loc="left")
        paused = any(d.get("purpose") == "pause" for d in report.get("decisions", []))
        _note(
            bottom,
            f"the pace never moved: x{float(np.nanmin(scale)):.2f} of the fastest step time "
            f"throughout{' (between pauses)' if paused else ''}\nthe least-energy power limit "
            "already meets the deadline (see docs/carbon-aware.md)",
        )
    elif scale is not None:
        bottom.stairs(scale, x, baseline=None, color=_COLORS["scale"], linewidth=1.5)
        bottom.axhline(1.0, color="black", linewidth=0.8, alpha=0.5)
        bottom.set_ylabel("target time per step\n(x fastest)")
        bottom.set_title("carbon-aware pace (1 = full speed)", fontsize="small", loc="left")
        bottom.grid(True, alpha=0.3)
    bottom.set_xlabel(f"time since start ({unit}, device clock)")
    return _save(fig, Path(path))


# --------------------------------------------------------------------------- frontier
def _pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both time and energy, fastest first."""
    frontier: list[tuple[float, float]] = []
    for t, e in sorted(points):
        if not frontier or e < frontier[-1][1]:
            frontier.append((t, e))
    return frontier


def plot_frontier(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """The measured energy-time frontier with the chosen power limits marked.

    Args:
        report: a run report.
        path: the PNG to write.

    Returns:
        The path written.
    """
    profile = [m for m in report.get("profile", []) if float(m.get("time_per_step_s", 0)) > 0]
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax = fig.subplots()
    clocks = report.get("summary", {}).get("knob") == "locked_clock"
    units = {profile_setting(m)[1] for m in profile}
    knob = (
        "power limits and locked clocks"
        if len(units) > 1
        else ("locked clocks" if clocks else "power limits")
    )
    fig.suptitle(f"Measured energy-time frontier of {knob}: {_gpu_label(report)}")
    if not profile:
        _empty(ax, "no profile was measured\n(observe-only, or profiling disabled)")
        return _save(fig, Path(path))
    settings = [profile_setting(m) for m in profile]
    unit = "MHz" if clocks else "W"
    times = [float(m["time_per_step_s"]) for m in profile]
    energies = [float(m["energy_per_step_j"]) for m in profile]
    kilo = max(energies) >= 10_000
    e_div, e_unit = (1000.0, "kJ") if kilo else (1.0, "J")
    ax.scatter(
        times, np.array(energies) / e_div, color=_COLORS["limit"], zorder=3, label="measured"
    )
    for m, (p, u), t, e in zip(profile, settings, times, energies, strict=True):
        clock = m.get("sm_clock_mhz")
        ran_at = f", ran at {clock:.0f} MHz" if clock is not None and clock != p else ""
        ax.annotate(
            f"{p:.0f} {u}{ran_at}{', throttled' if m.get('throttled') else ''}",
            (t, e / e_div),
            textcoords="offset points",
            xytext=(6, 4),
            fontsize=8,
        )
    front = _pareto(list(zip(times, energies, strict=True)))
    ax.plot(
        [t for t, _ in front],
        [e / e_div for _, e in front],
        color=_COLORS["limit"],
        alpha=0.5,
        label="frontier (no point is both faster and cheaper)",
    )
    points = dict(zip(settings, zip(times, energies, strict=True), strict=True))
    by_limit = {p: te for (p, u), te in points.items() if u == unit}
    chosen = [p for p in chosen_power_limits_w(report) if p in by_limit]
    selector = report.get("config", {}).get("power_limit", {}).get("selector", "selector")
    if chosen:
        t, e = by_limit[chosen[0]]
        ax.scatter(
            [t],
            [e / e_div],
            marker="*",
            s=320,
            color=_COLORS["full"],
            zorder=4,
            label=f"chosen by the '{selector}' selector ({chosen[0]:.0f} {unit})",
        )
    if len(chosen) > 1:
        later = [by_limit[p] for p in chosen[1:]]
        ax.scatter(
            [t for t, _ in later],
            [e / e_div for _, e in later],
            s=160,
            facecolors="none",
            edgecolors=_COLORS["power"],
            linewidths=2,
            zorder=4,
            label="re-chosen later (carbon-aware pacing)",
        )
    ax.set_xlabel("time per step (s, device clock)")
    ax.set_ylabel(f"energy per step ({e_unit}, all GPUs)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, Path(path))


# --------------------------------------------------------------------------- emissions
def _energy_per_step_j(report: Mapping[str, Any], limit_w: float | None) -> float | None:
    for m in report.get("profile", []):
        if limit_w is not None and profile_setting(m)[0] == limit_w:
            return float(m["energy_per_step_j"])
    return None


def plot_emissions(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Cumulative grams CO2eq over time against the carbon-unaware and full-power runs.

    The baselines are the controller's counterfactuals (``carbon.baselines``): the same
    steps after profiling, at the selector's limit or at the highest limit, on the
    intensities observed, each at its own pace (the full-power run ends first). Without
    carbon data the figure shows cumulative energy by step against the full-power
    estimate (every step at the highest profiled limit's measured energy, this rank's
    share of the job's).

    Args:
        report: a run report.
        path: the PNG to write.

    Returns:
        The path written.
    """
    timeline = _measured(report)
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax = fig.subplots()
    if not timeline:
        fig.suptitle("Cumulative emissions")
        _empty(ax, "no interval was measured")
        return _save(fig, Path(path))
    emissions = _series(timeline, "emissions_g")
    if emissions is None:
        _energy_by_step(report, timeline, fig, ax)
    else:
        _emissions_over_time(report, timeline, emissions, fig, ax)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    return _save(fig, Path(path))


_BASELINES = (
    ("carbon_unaware", "carbon-unaware (selector's limit, no pacing)", _COLORS["unaware"], "--"),
    ("full_power", "full power (highest limit)", _COLORS["full"], ":"),
)


def _emissions_over_time(
    report: Mapping[str, Any],
    timeline: Sequence[Mapping[str, Any]],
    emissions: np.ndarray,
    fig: Figure,
    ax: Axes,
) -> None:
    carbon = report.get("carbon") or {}
    edges = _edges(timeline)
    baselines = carbon.get("baselines") or {}
    ends = [float(edges[-1])] + [float(v[-1][0]) for v in baselines.values() if v]
    div, unit = _time_unit(max(ends))
    run_g = np.concatenate([[0.0], np.cumsum(np.nan_to_num(emissions))])
    totals = [float(run_g[-1])] + [
        float(carbon[f"{k}_emissions_g"]) for k, *_ in _BASELINES if f"{k}_emissions_g" in carbon
    ]
    g_div, g_unit = (1000.0, "kgCO2eq") if max(totals) >= 10_000 else (1.0, "gCO2eq")
    fig.suptitle("Cumulative emissions: this run vs. the baselines")
    ax.plot(
        edges / div,
        run_g / g_div,
        color=_COLORS["run"],
        linewidth=2,
        label=f"this run ({run_g[-1] / g_div:,.2f} {g_unit})",
    )
    for key, label, color, style in _BASELINES:
        series = baselines.get(key)
        if not series:
            continue
        times = np.array([float(t) for t, _ in series]) / div
        grams = np.array([float(g) for _, g in series]) / g_div
        total = float(carbon.get(f"{key}_emissions_g", grams[-1] * g_div)) / g_div
        late = ", misses the deadline" if carbon.get(f"{key}_meets_deadline") is False else ""
        ax.plot(
            times,
            grams,
            color=color,
            linestyle=style,
            linewidth=2,
            label=f"{label} ({total:,.2f} {g_unit}{late})",
        )
    deadline_s = _deadline_s(report)
    if deadline_s is not None:
        ax.axvline(deadline_s / div, color="black", linestyle="-.", linewidth=1, label="deadline")
    ax.set_xlabel(f"time since start ({unit}, device clock)")
    ax.set_ylabel(f"cumulative emissions ({g_unit})")


def _deadline_s(report: Mapping[str, Any]) -> float | None:
    """The deadline in seconds from the start, when the report has one."""
    carbon = report.get("carbon") or {}
    try:
        deadline = datetime.fromisoformat(str(carbon["deadline"]))
        finished = datetime.fromisoformat(str(carbon["finished"]))
    except (KeyError, ValueError):
        return None
    duration_s = float(report.get("summary", {}).get("duration_s", 0.0))
    return (deadline - finished).total_seconds() + duration_s


def _energy_by_step(
    report: Mapping[str, Any], timeline: Sequence[Mapping[str, Any]], fig: Figure, ax: Axes
) -> None:
    fig.suptitle("Cumulative energy vs. full power (no carbon data in this run)")
    steps = np.concatenate([[0.0], np.cumsum([float(e.get("steps", 0)) for e in timeline])])
    energy = _series(timeline, "energy_j")
    series = {"this run": np.zeros(len(timeline)) if energy is None else np.nan_to_num(energy)}
    top = max((profile_setting(m)[0] for m in report.get("profile", [])), default=None)
    full = _energy_per_step_j(report, top)
    if full is not None:
        # The profile is the whole job's; the run's line is this rank's own energy: set
        # beside it this rank's share (as the summary's saving is), not the job's.
        ranks = (report.get("job") or {}).get("ranks") or 1
        series["full power (every step at the highest limit)"] = np.diff(steps) * full / ranks
    total = max(float(np.sum(v)) for v in series.values())
    unit, div = ("kWh", J_PER_KWH) if total >= 0.1 * J_PER_KWH else ("kJ", 1000.0)
    for (name, values), (color, style) in zip(
        series.items(), ((_COLORS["run"], "-"), (_COLORS["full"], ":")), strict=False
    ):
        cumulative = np.concatenate([[0.0], np.cumsum(values)]) / div
        ax.plot(
            steps,
            cumulative,
            color=color,
            linestyle=style,
            linewidth=2,
            label=f"{name} ({cumulative[-1]:,.2f} {unit})",
        )
    ax.set_xlabel("training step")
    ax.set_ylabel(f"cumulative energy ({unit})")
