"""What every framework adapter shares: configuration, the run summary and the report.

The adapters (Lightning and its twin namespace, Fabric, Accelerate, the Transformers
``Trainer``) only translate their framework's hooks into controller calls; resolving the
configuration and finishing a run (restore, summary, report) happen here, once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_energy.config import EnergyConfig, load_config
from lightning_energy.controller import EnergyController, RunSummary

__all__ = ["EnergyAdapter", "build_config", "finish_run", "format_summary", "summary_values"]

log = logging.getLogger(__name__)


def build_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig | None,
    overrides: Mapping[str, Any],
) -> EnergyConfig:
    """Resolve a callback's configuration: explicit > ``LIGHTNING_ENERGY_CONFIG`` > defaults.

    Args:
        config: a YAML path, a mapping of the YAML schema, a built config, or None.
        overrides: sections given as keyword arguments (applied on top, section by section).

    Raises:
        ConfigError: every problem found, before any GPU is touched.
    """
    if isinstance(config, EnergyConfig):
        base = config
    elif isinstance(config, Mapping):
        base = EnergyConfig.from_mapping(config)
    elif config is not None:
        base = EnergyConfig.from_yaml(Path(config))
    else:
        base = load_config() or EnergyConfig()
    given = {k: v for k, v in overrides.items() if v is not None}
    return base.merged(given) if given else base


def format_summary(summary: RunSummary) -> str:
    """A short human-readable table of a run summary."""
    limit = f"{summary.power_limit_w:.0f} W" if summary.power_limit_w is not None else "unchanged"
    pre = (
        f"{summary.pre_job_power_limit_w:.0f} W"
        if summary.pre_job_power_limit_w is not None
        else "n/a"
    )
    rows = [
        ("steps", f"{summary.steps}"),
        ("energy (this process)", f"{summary.energy_j / 1000:.2f} kJ"),
    ]
    if summary.job_energy_j is not None and summary.job_energy_j != summary.energy_j:
        rows.append(("energy (whole job)", f"{summary.job_energy_j / 1000:.2f} kJ"))
    rows += [
        ("time", f"{summary.duration_s:.1f} s"),
        ("power limit chosen", limit),
        ("pre-job power limit", pre),
        ("energy saved (estimate)", f"{summary.energy_saved_j / 1000:.2f} kJ"),
        ("slowdown", f"{(summary.slowdown - 1) * 100:+.1f} %"),
    ]
    if summary.observe_only:
        rows.append(("mode", "observe-only (GPU settings unchanged)"))
    if summary.read_error is not None:
        rows.append(("GPU readings", f"failed mid-run, energy incomplete ({summary.read_error})"))
    carbon = summary.carbon or {}
    if "emissions_g" in carbon:
        rows.append(("CO2eq emitted (this process)", f"{carbon['emissions_g']:.1f} g"))
    for key, label in (
        ("carbon_unaware_emissions_g", "CO2eq if carbon-unaware"),
        ("full_power_emissions_g", "CO2eq at full power"),
    ):
        if key in carbon:
            rows.append((label, f"{carbon[key]:.1f} g"))
    if carbon.get("deadline_met") is not None:
        met = "met" if carbon["deadline_met"] else "MISSED"
        rows.append(("deadline", f"{carbon['deadline']} ({met})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def summary_values(summary: RunSummary) -> dict[str, float]:
    """The run summary as logger values (``energy/summary/*``, ``carbon/summary/*``)."""
    values = {
        "energy/summary/energy_j": summary.energy_j,
        "energy/summary/energy_saved_j": summary.energy_saved_j,
        "energy/summary/slowdown": summary.slowdown,
    }
    if summary.power_limit_w is not None:
        values["energy/summary/power_limit_w"] = summary.power_limit_w
    for key, value in (summary.carbon or {}).items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values[f"carbon/summary/{key}"] = float(value)
    return values


class EnergyAdapter:
    """The configuration of an adapter and how it finishes a run.

    Args:
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``; None
            reads the file named by ``LIGHTNING_ENERGY_CONFIG``, else uses defaults.
        device: the ``device:`` section (overrides the file's).
        power_limit: the ``power_limit:`` section (overrides the file's).
        carbon: the ``carbon:`` section (overrides the file's).
        strict: raise instead of observing when GPU settings cannot be changed.
        report: write the run report (JSON) to this path at the end of training.

    Raises:
        ConfigError: invalid configuration, raised here, before training starts.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig | None = None,
        *,
        device: dict[str, Any] | None = None,
        power_limit: dict[str, Any] | None = None,
        carbon: dict[str, Any] | None = None,
        strict: bool | None = None,
        report: str | None = None,
    ) -> None:
        self.config = build_config(
            config,
            {
                "device": device,
                "power_limit": power_limit,
                "carbon": carbon,
                "strict": strict,
                "report": report,
            },
        )
        self.controller: EnergyController | None = None
        self.summary: RunSummary | None = None

    def _finish(self, controller: EnergyController, *, main_process: bool) -> RunSummary:
        """Finish the run (see :func:`finish_run`) and keep its summary."""
        self.summary = finish_run(controller, self.config.report, main_process=main_process)
        return self.summary


def finish_run(
    controller: EnergyController, report: str | None, *, main_process: bool
) -> RunSummary:
    """Restore every GPU, gather the job's totals; on the main process, log the summary
    and write the report.

    Every rank must call it on a normal end (the totals are a collective).

    Args:
        controller: the run's controller.
        report: where to write the JSON report (None: nowhere).
        main_process: whether this is global rank 0.
    """
    controller.teardown()
    controller.gather_job_totals()  # every rank takes part: the job's own numbers
    summary = controller.teardown()
    if main_process:
        log.info("energy summary:\n%s", format_summary(summary))
        if report:
            from lightning_energy.report import write_report

            write_report(controller, report)
    return summary
