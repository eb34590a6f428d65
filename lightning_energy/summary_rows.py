"""Summary rows that both the logged run summary and the report's table print.

Kept apart from :mod:`lightning_energy.report` (which reads carbon units) so that printing a
run's summary imports nothing of the ``carbon`` package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["power_limit_rows"]


def power_limit_rows(summary: Mapping[str, Any], chosen: Sequence[float]) -> list[tuple[str, str]]:
    """What a run did with power limits, as summary rows: the limits chosen, a profile that
    did not finish, and what every GPU was put back to at the end.

    Args:
        summary: a run summary (``RunSummary.to_dict()`` or a checked report's section).
        chosen: the limits chosen after profiling, in the order applied.
    """
    applied = summary.get("power_limits_applied") or 0
    rows: list[tuple[str, str]] = []
    if summary.get("profile_complete") is False:
        measured = summary.get("power_limits_measured") or 0
        candidates = summary.get("power_limit_candidates") or 0
        rows.append(
            (
                "power-limit profile",
                f"not finished: {measured:.0f} of {candidates:.0f} limits measured",
            )
        )
    if chosen:
        rows.append(("power limits chosen", ", ".join(f"{p:.0f} W" for p in chosen)))
    elif applied:
        plural = "limit" if applied == 1 else "limits"
        rows.append(("power limits chosen", f"none ({applied:.0f} {plural} set while profiling)"))
    else:
        rows.append(("power limits chosen", "none (GPU settings unchanged)"))
    pre = summary.get("pre_job_power_limit_w")
    if pre is not None:
        restored = " (every GPU put back to it at the end)" if chosen or applied else ""
        rows.append(("pre-job power limit", f"{float(pre):.0f} W{restored}"))
    return rows
