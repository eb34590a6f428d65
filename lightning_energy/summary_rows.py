"""Summary rows that both the logged run summary and the report's table print.

Kept apart from :mod:`lightning_energy.report` (which reads carbon units) so that printing a
run's summary imports nothing of the ``carbon`` package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "NOT_MEASURED",
    "estimates_measured",
    "mode_rows",
    "node_energy_rows",
    "power_limit_rows",
]

#: What a summary shows for a value the run does not hold (null or absent, or a placeholder
#: after a failed reading): a reading that failed or never happened, never a made-up zero.
NOT_MEASURED = "not measured"


def power_limit_rows(summary: Mapping[str, Any], chosen: Sequence[float]) -> list[tuple[str, str]]:
    """What a run did with its setting knob, as summary rows: the knob, the settings
    chosen, a profile that did not finish, and what every GPU was put back to at the end.

    Args:
        summary: a run summary (``RunSummary.to_dict()`` or a checked report's section).
        chosen: the settings chosen after profiling (power limits in W, or locked clocks
            in MHz when ``summary["knob"]`` is ``locked_clock``), in the order applied.
    """
    applied = summary.get("power_limits_applied") or 0
    rows: list[tuple[str, str]] = []
    clocks = summary.get("knob") == "locked_clock"
    if clocks:
        rows.append(("knob", "locked SM clock (power limit left at its pre-job value)"))
    if summary.get("profile_complete") is False:
        measured = summary.get("power_limits_measured") or 0
        candidates = summary.get("power_limit_candidates") or 0
        name, what = ("locked-clock", "clocks") if clocks else ("power-limit", "limits")
        rows.append(
            (
                f"{name} profile",
                f"not finished: {measured:.0f} of {candidates:.0f} {what} measured",
            )
        )
    if clocks:
        chose = ", ".join(f"{c:.0f} MHz" for c in chosen) if chosen else "none"
        rows.append(("locked clocks chosen", chose))
    elif chosen:
        rows.append(("power limits chosen", ", ".join(f"{p:.0f} W" for p in chosen)))
    elif applied:
        plural = "limit" if applied == 1 else "limits"
        rows.append(("power limits chosen", f"none ({applied:.0f} {plural} set while profiling)"))
    else:
        rows.append(("power limits chosen", "none (GPU settings unchanged)"))
    pre = summary.get("pre_job_power_limit_w")
    if pre is not None:
        restored = " (every GPU put back to it at the end)" if chosen or applied else ""
        restored = " (every clock lock released at the end)" if clocks else restored
        rows.append(("pre-job power limit", f"{float(pre):.0f} W{restored}"))
    return rows


def node_energy_rows(
    summary: Mapping[str, Any], energy: Callable[[float], str]
) -> list[tuple[str, str]]:
    """The CPU and DRAM energy beside the GPUs', and the total with what it counts, as
    summary rows (none for a summary without ``node_energy``).

    Args:
        summary: a run summary (``RunSummary.to_dict()`` or a checked report's section).
        energy: formats joules in the table's unit.
    """
    node = summary.get("node_energy")
    if not isinstance(node, Mapping):
        return []
    own_j = node.get("energy_j") if node.get("measured") else None
    node_j = summary.get("job_node_energy_j")
    if node_j is not None and node_j != own_j:  # other nodes of the job, or another rank's
        rows = [("CPU + DRAM energy (whole job)", energy(float(node_j)))]
    elif own_j is not None:
        node_j = float(own_j)
        note = "" if node.get("note") is None else f" (incomplete: {node['note']})"
        rows = [("CPU + DRAM energy", energy(node_j) + note)]
    else:
        why = node.get("reason") or node.get("why") or "no reason recorded"
        rows = [("CPU + DRAM energy", f"not measured: {why}")]
    gpu_j = summary.get("job_energy_j")
    gpu_j = summary.get("energy_j") if gpu_j is None else gpu_j
    if gpu_j is not None:
        counted = summary.get("energy_counted")
        total = energy(float(gpu_j) + (node_j or 0.0))
        rows.append(("total energy", f"{total} ({counted})" if counted else total))
    return rows


def estimates_measured(summary: Mapping[str, Any]) -> bool:
    """Whether the summary's savings and slowdown were measured: a GPU reading that failed
    mid-run ends every measurement, and they are then only the summary's placeholders."""
    return summary.get("read_error") is None


def mode_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Failed readings and observe-only mode, as summary rows: an observe-only run that had
    set limits before a GPU failed says they were restored, not that none could be set."""
    rows: list[tuple[str, str]] = []
    if summary.get("read_error") is not None:
        rows.append(
            ("GPU readings", f"failed mid-run, energy incomplete ({summary['read_error']})")
        )
    if summary.get("observe_only"):
        if summary.get("power_limits_applied"):
            why = "from mid-run (the settings it had changed were restored)"
        else:
            why = "(GPU settings could not be changed)"
        rows.append(("mode", f"observe-only {why}"))
    return rows
