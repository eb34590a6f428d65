"""Run reports: one JSON file per training run, and the summary table printed from it.

Every integration writes the same report when the configuration names a ``report:`` path
(:func:`write_report`, called once the controller is torn down). The file holds::

    {
      "version": 1,
      "created": "2025-06-01T12:00:00+00:00",
      "config":    {...},   # the configuration (YAML schema); credentials never, only the
                            # names of the environment variables that hold them
      "devices":   [...],   # identity and power-limit range of every GPU driven
      "timeline":  [...],   # one entry per logging interval: power limit, energy, power,
                            # and with carbon-aware pacing intensity, grams and target scale
      "profile":   [...],   # the measured frontier of the knob (power limits or locked
                            # clocks): time and energy per step, average SM clock, throttled
      "decisions": [...],   # every setting applied, when, and why
      "summary":   {...},   # steps, energy, time, chosen limit, savings (RunSummary) of
                            # the writing process's GPUs ("scope" says which rank), its
                            # node's CPU and DRAM energy, and what the totals count
      "job":       {...},   # the whole job: energy, savings and grams summed over every
                            # rank (each GPU and each node once), every GPU with its rank
                            # and node
      "carbon":    {...}    # optional: grams emitted vs. the carbon-unaware and full-power
                            # baselines
    }

:func:`load_report` reads and checks a report; :func:`format_report` renders the summary
table that ``lightning-energy report`` and the demo print; :mod:`lightning_energy.plots`
draws the figures. The schema is documented in ``docs/reports.md``.

Example:
    >>> from lightning_energy.controller import EnergyController
    >>> controller = EnergyController()  # doctest: +SKIP
    >>> ...                              # training  # doctest: +SKIP
    >>> controller.teardown()            # doctest: +SKIP
    >>> write_report(controller, "runs/run.json")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from carbon.accounting import J_PER_KWH
from lightning_energy.controller import EnergyController
from lightning_energy.errors import EnergyError
from lightning_energy.summary_rows import (
    NOT_MEASURED,
    estimates_measured,
    mode_rows,
    node_energy_rows,
    power_limit_rows,
)

__all__ = [
    "REPORT_VERSION",
    "ReportError",
    "build_report",
    "chosen_power_limits_w",
    "format_report",
    "load_report",
    "save_report",
    "write_report",
]

log = logging.getLogger(__name__)

#: The version of the report schema this module writes and reads.
REPORT_VERSION = 1

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "version": int,
    "created": str,
    "config": dict,
    "devices": list,
    "timeline": list,
    "profile": list,
    "decisions": list,
    "summary": dict,
}


class ReportError(EnergyError, ValueError):
    """A run report cannot be read: missing, not JSON, another version or a bad shape."""


# --------------------------------------------------------------------------- building
def build_report(controller: EnergyController) -> dict[str, Any]:
    """The report of a run, as plain JSON-ready data.

    Call it after ``controller.teardown()``: the summary is the one teardown returned
    (``teardown`` is idempotent, so calling it here on a finished run changes nothing; on a
    running one it ends the run and restores the GPUs).

    Args:
        controller: the run's controller.

    Returns:
        The report (see the module docstring for the schema).
    """
    summary = controller.teardown().to_dict()
    carbon = summary.pop("carbon", None)
    report: dict[str, Any] = {
        "version": REPORT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": controller.config.to_mapping(),
        "devices": _devices(controller),
        "timeline": list(controller.timeline),
        "profile": controller.profile(),
        "decisions": list(controller.decisions),
        "summary": summary,
    }
    summary["scope"] = f"rank {controller.collective.rank}"
    if controller.job is not None:
        report["job"] = controller.job
    if carbon:
        report["carbon"] = carbon
    return _jsonable(report)


def _devices(controller: EnergyController) -> list[dict[str, Any]]:
    """Identity and limits of every GPU, as recorded when the controller set up."""
    return [dataclasses.asdict(info) for info in controller.device_info]


def _jsonable(value: Any) -> Any:
    """Plain JSON data: non-finite floats become null, times ISO strings, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


# --------------------------------------------------------------------------- files
def save_report(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a report atomically (temporary file, then rename), creating parent folders.

    Args:
        report: the report data.
        path: where to write it.

    Returns:
        The path written.

    Raises:
        ReportError: the file cannot be written.
    """
    target = Path(path)
    # A name of our own rather than mkstemp's, so the file gets the umask's usual
    # permissions (mkstemp creates it readable by its owner only).
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with tmp.open("x", encoding="utf-8") as f:
                json.dump(_jsonable(report), f, indent=2, allow_nan=False)
                f.write("\n")
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ReportError(f"cannot write the report {target}: {exc.strerror or exc}") from exc
    return target


def write_report(controller: EnergyController, path: str | os.PathLike[str]) -> Path:
    """Build the report of a finished run and write it to ``path`` (JSON).

    Integrations call this at the end of training when the configuration has ``report:``.

    Args:
        controller: the run's controller (after ``teardown()``).
        path: the file to write; parent folders are created.

    Returns:
        The path written.

    Raises:
        ReportError: the file cannot be written.
    """
    written = save_report(build_report(controller), path)
    log.info("energy report written to %s", written)
    return written


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a report written by :func:`write_report`.

    Args:
        path: the JSON file.

    Returns:
        The report data.

    Raises:
        ReportError: the file is missing, unreadable, not JSON, of another schema version,
            or lacks a section (every missing or mistyped section is named).
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"cannot read the report {source}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ReportError(
            f"{source} is not a JSON report: not UTF-8 text (byte {exc.start})"
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(
            f"{source} is not a JSON report: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from exc
    except (ValueError, RecursionError) as exc:  # a number too long, nesting too deep
        raise ReportError(f"{source} is not a JSON report: {exc}") from exc
    if not isinstance(data, dict):
        raise ReportError(f"{source} is not a report: expected a JSON object")
    version = data.get("version")
    if version != REPORT_VERSION:
        raise ReportError(
            f"{source}: report version {version!r} cannot be read; this version of "
            f"lightning-energy reads version {REPORT_VERSION}"
        )
    problems = [
        f"{key!r} is missing" if key not in data else f"{key!r} should be a {_kind(kind)}"
        for key, kind in _REQUIRED.items()
        if not isinstance(data.get(key), kind)
    ]
    for section in ("carbon", "job"):
        if section in data and not isinstance(data[section], dict):
            problems.append(f"'{section}' should be an object")
    if not problems:
        problems = _field_problems(data)
    if problems:
        raise ReportError(f"{source} is not a valid report: " + "; ".join(problems))
    return data


#: What the readers (summary table, plots) take from each section: a field's kind is
#: ``num`` (a finite number), ``num?`` (a number or null), ``bool?``, ``str?`` or ``obj?``.
#: Fields marked ``!`` are required. Other fields are kept as they are.
_ITEM_FIELDS: dict[str, dict[str, str]] = {
    "devices": {"min_power_limit_w": "num?", "max_power_limit_w": "num?"},
    "timeline": {
        key: "num?"
        for key in (
            "step",
            "time_s",
            "duration_s",
            "steps",
            "energy_j",
            "power_w",
            "power_limit_w",
            "locked_clock_mhz",
            "intensity_g_per_kwh",
            "emissions_g",
            "scale",
        )
    },
    "profile": {
        "power_limit_w": "num?",
        "locked_clock_mhz": "num?",
        "sm_clock_mhz": "num?",
        "throttled": "bool?",
        "time_per_step_s": "num!",
        "energy_per_step_j": "num!",
        "steps": "num?",
    },
    "decisions": {
        "time_s": "num?",
        "value": "num?",
        "kind": "str?",
        "purpose": "str?",
        "reason": "str?",
    },
}
_SECTION_FIELDS: dict[str, dict[str, str]] = {
    "summary": {
        "steps": "num?",
        "energy_j": "num?",
        "duration_s": "num?",
        "power_limit_w": "num?",
        "pre_job_power_limit_w": "num?",
        "energy_saved_j": "num?",
        "slowdown": "num?",
        "observe_only": "bool?",
        "job_energy_j": "num?",
        "scope": "str?",
        "profile_complete": "bool?",
        "power_limits_measured": "num?",
        "power_limit_candidates": "num?",
        "power_limits_applied": "num?",
        "knob": "str?",
        "locked_clock_mhz": "num?",
        "node_energy": "obj?",
        "job_node_energy_j": "num?",
        "energy_counted": "str?",
        "read_error": "str?",
    },
    "job": {
        "ranks": "num!",
        "nodes": "num?",
        "energy_j": "num!",
        "node_energy_j": "num?",
        "node_emissions_g": "num?",
        "total_energy_j": "num?",
        "total_emissions_g": "num?",
        "counted": "str?",
    },
    "carbon": {
        "emissions_g": "num?",
        "node_emissions_g": "num?",
        "total_emissions_g": "num?",
        "carbon_unaware_emissions_g": "num?",
        "full_power_emissions_g": "num?",
        "deadline_met": "bool?",
        "carbon_unaware_meets_deadline": "bool?",
        "full_power_meets_deadline": "bool?",
        "provider": "str?",
        "region": "str?",
        "emission_factor": "str?",
        "policy": "str?",
        "forecast_horizon_s": "num?",
        "forecast_reach_s": "num?",
        "deadline": "str?",
        "finished": "str?",
        "baselines": "obj?",
    },
    "config": {"power_limit": "obj?"},
}
#: What the readers take from ``summary.node_energy`` (the node's CPUs and DRAM).
_NODE_FIELDS = {
    "measured": "bool?",
    "energy_j": "num?",
    "complete": "bool?",
    "note": "str?",
    "why": "str?",
    "reason": "str?",
}
#: The largest magnitude a number in a report may have (far beyond any real run).
_MAX_NUMBER = 1e18


def _field_problems(data: Mapping[str, Any]) -> list[str]:
    """Every field the readers use that has the wrong type, named by its path."""
    problems: list[str] = []
    for section, fields in _SECTION_FIELDS.items():
        if isinstance(data.get(section), dict):
            problems.extend(_check_fields(data[section], fields, section))
    node = data["summary"].get("node_energy")
    if isinstance(node, dict):
        problems.extend(_check_fields(node, _NODE_FIELDS, "summary.node_energy"))
    for section, fields in _ITEM_FIELDS.items():
        for i, item in enumerate(data[section]):
            where = f"{section}[{i}]"
            if not isinstance(item, dict):
                problems.append(f"'{where}' should be an object")
            else:
                problems.extend(_check_fields(item, fields, where))
            if len(problems) >= 10:
                return problems
    for i, entry in enumerate(data["profile"]):
        if isinstance(entry, dict) and not any(
            _is_number(entry.get(k)) for k in ("power_limit_w", "locked_clock_mhz")
        ):
            problems.append(f"'profile[{i}]' should have a power_limit_w or a locked_clock_mhz")
    for i, entry in enumerate(data["timeline"]):
        lasted = isinstance(entry, dict) and _is_number(entry.get("duration_s"))
        if lasted and entry["duration_s"] > 0 and not _is_number(entry.get("time_s")):
            problems.append(f"'timeline[{i}].time_s' should be a finite number")
    power_limit = data["config"].get("power_limit")
    selector = power_limit.get("selector") if isinstance(power_limit, dict) else None
    if selector is not None and not isinstance(selector, str):
        problems.append("'config.power_limit.selector' should be a string")
    baselines = (data.get("carbon") or {}).get("baselines")
    for name, series in baselines.items() if isinstance(baselines, dict) else ():
        if not isinstance(series, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(_is_number(v) for v in p) for p in series
        ):
            problems.append(f"'carbon.baselines.{name}' should be a list of [time, grams] pairs")
    return problems


def _check_fields(section: Mapping[str, Any], fields: Mapping[str, str], where: str) -> list[str]:
    problems = []
    for key, kind in fields.items():
        if key not in section:
            if kind.endswith("!"):
                problems.append(f"'{where}.{key}' is missing")
            continue
        value = section[key]
        if value is None and kind.endswith("?"):
            continue
        ok = {
            "num": _is_number,
            "bool": lambda v: isinstance(v, bool),
            "str": lambda v: isinstance(v, str),
            "obj": lambda v: isinstance(v, dict),
        }[kind[:-1]](value)
        if not ok:
            wanted = {
                "num": f"a finite number (at most {_MAX_NUMBER:g} in size)",
                "bool": "true or false",
                "str": "a string",
                "obj": "an object",
            }[kind[:-1]]
            nullable = " or null" if kind.endswith("?") else ""
            problems.append(f"'{where}.{key}' should be {wanted}{nullable}")
    return problems


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and -_MAX_NUMBER <= value <= _MAX_NUMBER
    )


def _kind(kind: type | tuple[type, ...]) -> str:
    names = {dict: "object", list: "list", int: "integer", str: "string"}
    return names.get(kind, str(kind)) if isinstance(kind, type) else "value"


# --------------------------------------------------------------------------- summary
def profile_setting(entry: Mapping[str, Any]) -> tuple[float, str]:
    """The setting a (checked) profile entry measured and its unit: a locked clock in MHz
    or a power limit in W."""
    if entry.get("locked_clock_mhz") is not None:
        return float(entry["locked_clock_mhz"]), "MHz"
    return float(entry["power_limit_w"]), "W"


def chosen_power_limits_w(report: Mapping[str, Any]) -> list[float]:
    """The settings of the run's knob applied after profiling (the selector's and any later
    re-choices), in the order they were applied, without repeats: power limits, or locked
    clocks when the summary's ``knob`` is ``locked_clock``."""
    knob = report.get("summary", {}).get("knob") or "power_limit"
    limits: list[float] = []
    for decision in report.get("decisions", []):
        value = decision.get("value")
        kind = decision.get("kind") or "power_limit"
        if decision.get("purpose") != "choice" or value is None or kind != knob:
            continue
        if float(value) not in limits:
            limits.append(float(value))
    return limits


def format_report(report: Mapping[str, Any]) -> str:
    """The summary table of a report, as ``lightning-energy report`` and the demo print it.

    Args:
        report: a report (from :func:`build_report` or :func:`load_report`).

    Returns:
        Aligned ``name  value`` lines.
    """
    summary = report.get("summary", {})
    rows: list[tuple[str, str]] = [("GPUs", _gpus(report.get("devices", [])))]
    steps = _measured(summary, "steps")
    rows.append(("steps", NOT_MEASURED if steps is None else f"{steps:.0f}"))
    energy_j = _measured(summary, "energy_j")
    kwh = abs(energy_j or 0.0) >= 0.1 * J_PER_KWH  # one energy unit for the whole table
    rows.append(("energy", NOT_MEASURED if energy_j is None else _energy(energy_j, kwh)))
    job = report.get("job")
    if isinstance(job, Mapping) and job["ranks"] > 1:  # load_report checked the fields
        rows[-1] = (f"energy ({summary.get('scope') or 'rank 0'})", rows[-1][1])
        scope = f"whole job: {job['ranks']:.0f} ranks on {job.get('nodes') or 1:.0f} node(s)"
        rows.append((f"energy ({scope})", _energy(float(job["energy_j"]), kwh)))
    duration_s = _measured(summary, "duration_s")
    rows.extend(node_energy_rows(summary, lambda j: _energy(j, kwh)))
    rows.append(
        ("time (device clock)", NOT_MEASURED if duration_s is None else _duration(duration_s))
    )
    pauses, paused_s = _pauses(report)
    if pauses:
        times = "1 time" if pauses == 1 else f"{pauses} times"
        share = (
            ""
            if duration_s is None
            else f" ({_share(paused_s, duration_s, base=True)} of the time)"
        )
        rows.append(("paused (carbon pacing)", f"{times}, {_duration(paused_s)}{share}"))
    rows.extend(power_limit_rows(summary, chosen_power_limits_w(report)))
    measured = estimates_measured(summary)
    saved_j = _measured(summary, "energy_saved_j") if measured else None
    if saved_j is None or energy_j is None:
        saved = NOT_MEASURED
    else:
        saved = f"{_energy(saved_j, kwh)} ({_share(saved_j, energy_j)})"
    rows.append(("energy saved vs. full power", saved))
    slowdown = _measured(summary, "slowdown") if measured else None
    if slowdown is None:
        rows.append(("slowdown vs. full power", NOT_MEASURED))
    else:
        paused_note = " (pauses included)" if pauses else ""
        rows.append(("slowdown vs. full power", f"{(slowdown - 1) * 100:+.1f} %{paused_note}"))
    pace = _pace(report, paused=bool(pauses))
    if pace:
        rows.append(("carbon pace (step time)", pace))
    rows.extend(_carbon_rows(report.get("carbon"), energy_j or 0.0, summary.get("energy_counted")))
    rows.extend(mode_rows(summary))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _measured(section: Mapping[str, Any], key: str) -> float | None:
    """A number of a checked report section; None when absent or null."""
    value = section.get(key)
    return None if value is None else float(value)


def _carbon_rows(
    carbon: Mapping[str, Any] | None, energy_j: float, counted: str | None
) -> list[tuple[str, str]]:
    """Where the intensity came from, the grams emitted and the baselines; with the node's
    CPUs and DRAM measured, their grams and the total too (the baselines are the GPUs')."""
    if not carbon:
        return []
    rows: list[tuple[str, str]] = []
    if carbon.get("provider"):
        grid = f"{carbon.get('region') or 'no region'} via {carbon['provider']}"
        if carbon.get("emission_factor"):
            grid += f" ({carbon['emission_factor']} emission factors)"
        if carbon.get("policy"):
            grid += f", {carbon['policy']} policy"
        rows.append(("carbon intensity from", grid))
    if carbon.get("forecast_horizon_s") is not None:
        forecast = f"{float(carbon['forecast_horizon_s']) / 3600:g} h asked"
        if carbon.get("forecast_reach_s") is not None:
            forecast += f", the last one reached {float(carbon['forecast_reach_s']) / 3600:.0f} h"
        rows.append(("forecast for pacing", forecast))
    deadline = carbon.get("deadline")
    if deadline:
        met = carbon.get("deadline_met")
        status = "" if met is None else (" met" if met else " MISSED")
        rows.append(("deadline", f"{_utc_minutes(str(deadline))}{status}"))
    emitted = carbon.get("emissions_g")
    if emitted is None:
        return rows
    emitted = float(emitted)
    node_g = carbon.get("node_emissions_g")
    total_g = emitted + float(node_g or 0.0)
    kg = abs(total_g) >= 1000  # one mass unit for the whole table
    if energy_j > 0:
        rows.append(("mean intensity", f"{emitted / (energy_j / J_PER_KWH):.0f} gCO2eq/kWh"))
    gpus = "" if node_g is None else " (GPUs)"
    rows.append((f"emissions{gpus}", _grams(emitted, kg)))
    if node_g is not None:
        rows.append(("emissions (CPU + DRAM)", _grams(float(node_g), kg)))
        what = f" ({counted})" if counted else ""
        rows.append(("emissions (total)", _grams(total_g, kg) + what))
    for name, label in (("carbon_unaware", "vs. carbon-unaware"), ("full_power", "vs. full power")):
        label += gpus
        baseline = carbon.get(f"{name}_emissions_g")
        if baseline is None:
            continue
        baseline = float(baseline)
        saved = baseline - emitted
        share = _share(abs(saved), baseline, base=True)
        outcome = (
            f"saved {_grams(saved, kg)} ({share})"
            if saved >= 0
            else f"emitted {_grams(-saved, kg)} more ({share})"
        )
        late = (
            " (it would miss the deadline)" if carbon.get(f"{name}_meets_deadline") is False else ""
        )
        rows.append((label, f"{_grams(baseline, kg)}; this run {outcome}{late}"))
    return rows


def _utc_minutes(text: str) -> str:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return text
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return f"{moment:%Y-%m-%d %H:%M} UTC"


def _gpus(devices: Sequence[Mapping[str, Any]]) -> str:
    if not devices:
        return "none"
    names: dict[str, int] = {}
    for device in devices:
        name = str(device.get("name", "unknown"))
        names[name] = names.get(name, 0) + 1
    return ", ".join(f"{count}x {name}" for name, count in names.items())


def _pauses(report: Mapping[str, Any]) -> tuple[int, float]:
    """How many times the carbon pacing paused training, and for how long in all (the
    logging intervals without a step)."""
    count = sum(1 for d in report.get("decisions", []) if d.get("purpose") == "pause")
    if not count:
        return 0, 0.0
    timeline = report.get("timeline", [])
    return count, sum(float(e.get("duration_s", 0.0)) for e in timeline if not e.get("steps"))


def _pace(report: Mapping[str, Any], *, paused: bool) -> str | None:
    """The range of the carbon pace (target step time over the fastest), or that it
    never moved (between pauses); None without carbon pacing."""
    scales = [float(e["scale"]) for e in report.get("timeline", []) if e.get("scale") is not None]
    if not scales:
        return None
    lo, hi = min(scales), max(scales)
    if round(lo, 2) == round(hi, 2):
        return (
            f"x{lo:.2f} throughout{' between pauses' if paused else ''}: the pace never "
            "moved (the least-energy limit meets the deadline; see docs/carbon-aware.md)"
        )
    return f"x{lo:.2f} to x{hi:.2f} of the fastest step time, as the grid's intensity changed"


def _energy(energy_j: float, kwh: bool) -> str:
    if kwh:
        return f"{energy_j / J_PER_KWH:.2f} kWh"
    return f"{energy_j / 1000:.2f} kJ"


def _grams(grams: float, kg: bool) -> str:
    return f"{grams / 1000:.2f} kgCO2eq" if kg else f"{grams:.1f} gCO2eq"


def _share(part: float, total: float, *, base: bool = False) -> str:
    """``part`` as a percentage of ``total`` (or of ``total + part`` for savings)."""
    whole = total if base else total + part
    return f"{part / whole * 100:.1f} %" if whole > 0 else "n/a"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        hours, minutes = divmod(round(seconds / 60), 60)
        return f"{hours} h {minutes:02d} min"
    if seconds >= 60:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest:02d} s"
    return f"{seconds:.1f} s"
