"""What every framework adapter shares: configuration, the run's life and the report.

The adapters (Lightning and its twin namespace, Fabric, Accelerate, the Transformers
``Trainer``) only translate their framework's hooks into controller events; the contract
they follow (docs/adapters.md) lives here, once: resolving the configuration, loading a
checkpoint's state before or after setup, finishing a run (restore, totals, summary,
report) or aborting it on an exception (restore, summary, report, no collective), the
workload key and the ranks' collectives over the framework's own ``all_gather``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Protocol

import torch
from typing_extensions import Self

from lightning_energy.collectives import GatherCollective
from lightning_energy.config import EnergyConfig, load_config
from lightning_energy.controller import (
    CheckpointLoad,
    CheckpointSave,
    End,
    EnergyController,
    RunSummary,
)
from lightning_energy.errors import ConfigError
from lightning_energy.report import power_limit_rows

__all__ = [
    "EnergyAdapter",
    "build_config",
    "count_parameters",
    "finish_run",
    "format_summary",
    "summary_values",
    "tensor_collective",
    "workload_key",
]

log = logging.getLogger(__name__)


class HasParameters(Protocol):
    """A model: anything with ``parameters()`` (a ``torch.nn.Module``)."""

    def parameters(self) -> Iterable[torch.Tensor]: ...


def count_parameters(model: HasParameters) -> int:
    """How many parameters ``model`` has (part of the workload key)."""
    return sum(p.numel() for p in model.parameters())


def workload_key(*, batch_size: int | None, params: int, **extra: int | str | None) -> str:
    """The key that names a workload: what, once changed, is profiled again.

    Every adapter builds its key here, so one training run reads the same key under every
    framework and a checkpoint's profile is found again.

    Args:
        batch_size: the per-device batch size (None: unknown).
        params: the model's parameter count (see :func:`count_parameters`).
        **extra: anything else that changes the time and energy of a step, in order.

    Example:
        >>> workload_key(batch_size=32, params=1_000, gradient_accumulation_steps=4)
        'batch_size=32,gradient_accumulation_steps=4,params=1000'
    """
    parts = {"batch_size": batch_size, **extra, "params": params}
    return ",".join(f"{k}={v}" for k, v in parts.items())


def tensor_collective(
    rank: int,
    world_size: int,
    all_gather: Callable[[torch.Tensor], torch.Tensor],
    broadcast: Callable[[Any, int], Any],
    device: torch.device,
) -> GatherCollective:
    """The ranks' collectives over a framework's tensor ``all_gather`` and object broadcast.

    Lightning's and Fabric's ``all_gather`` stack one row per rank (a single process gets
    the tensor back as is), Accelerate's ``gather`` concatenates: the rows are read back
    alike from each.

    Args:
        rank: this process's global rank.
        world_size: number of processes.
        all_gather: gathers a tensor from every rank (on ``device``).
        broadcast: takes an object and a source rank, returns the source's object.
        device: where the framework's collectives expect tensors (NCCL rejects CPU ones).
    """

    def gather_rows(values: list[float]) -> list[list[float]]:
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        gathered = all_gather(tensor).reshape(-1, len(values))
        return [row.tolist() for row in gathered.cpu()]

    return GatherCollective(rank, world_size, gather_rows, broadcast)


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
    rows = [
        ("steps", f"{summary.steps}"),
        ("energy (this process)", f"{summary.energy_j / 1000:.2f} kJ"),
    ]
    if summary.job_energy_j is not None and summary.job_energy_j != summary.energy_j:
        rows.append(("energy (whole job)", f"{summary.job_energy_j / 1000:.2f} kJ"))
    rows.append(("time", f"{summary.duration_s:.1f} s"))
    chosen = [] if summary.power_limit_w is None else [summary.power_limit_w]
    rows += power_limit_rows(summary.to_dict(), chosen)
    rows += [
        ("energy saved (estimate)", f"{summary.energy_saved_j / 1000:.2f} kJ"),
        ("slowdown", f"{(summary.slowdown - 1) * 100:+.1f} %"),
    ]
    if summary.observe_only:
        rows.append(("mode", "observe-only (GPU settings unchanged)"))
    if summary.read_error is not None:
        rows.append(("GPU readings", f"failed mid-run, energy incomplete ({summary.read_error})"))
    carbon = summary.carbon or {}
    if "emissions_g" in carbon:
        factor = carbon.get("emission_factor")
        of = f" ({factor} emission factors)" if factor else ""
        rows.append(("CO2eq emitted (this process)", f"{carbon['emissions_g']:.1f} g{of}"))
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
    """The configuration of an adapter and the life of its runs (docs/adapters.md).

    A run opens with :meth:`_begin_run` (setup, then the state of a checkpoint loaded
    before it) and ends once: :meth:`_finish` on a normal end (every rank: the job's
    totals are a collective), :meth:`_abort` on an exception (no collective). Both restore
    every GPU first, keep the summary and write the report on the main process. Used as a
    context manager, an adapter finishes the run when the block ends normally and aborts
    it when the block raises.

    Args:
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``; None
            reads the file named by ``LIGHTNING_ENERGY_CONFIG``, else uses defaults.
        device: the ``device:`` section (overrides the file's).
        power_limit: the ``power_limit:`` section (overrides the file's).
        carbon: the ``carbon:`` section (overrides the file's).
        strict: raise instead of observing when GPU settings cannot be changed.
        report: write the run report (JSON) to this path at the end of training.

    Attributes:
        controller: the controller of the current (or last) run; None before the first.
        summary: the run summary once the run ended.

    Raises:
        ConfigError: invalid configuration, raised here, before training starts; in
            strict mode also a ``perseus:`` or ``batch_size:`` section enabled for an
            adapter that does not apply it.
    """

    #: Which of the ``perseus:`` and ``batch_size:`` sections the framework applies (the
    #: Lightning Trainer both, through its callbacks entry point and strategies; the
    #: pipeline engines ``perseus:``).
    applied_sections: ClassVar[frozenset[str]] = frozenset()

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
        self._check_sections_applied()
        self.controller: EnergyController | None = None
        self.summary: RunSummary | None = None
        self._running = False
        self._main_process = True
        self._pending_state: dict[str, Any] | None = None

    def _check_sections_applied(self) -> None:
        """One warning (strict: a ConfigError) for enabled sections this framework ignores."""
        enabled = [
            name
            for name in ("perseus", "batch_size")
            if getattr(self.config, name).enabled and name not in self.applied_sections
        ]
        if not enabled:
            return
        message = (
            f"{', '.join(name + ': enabled' for name in enabled)} is not applied by "
            f"{type(self).__name__}: the Lightning Trainer applies these sections, the "
            "DeepSpeed and Megatron-Core adapters perseus: (docs/perseus.md, "
            "docs/batch-size.md); training runs without them"
        )
        if self.config.strict:
            raise ConfigError([message], source=type(self).__name__)
        log.warning("%s.", message)

    @property
    def running(self) -> bool:
        """Whether a run is open (set up and not yet finished or aborted)."""
        return self._running

    def _begin_run(
        self,
        controller: EnergyController,
        *,
        main_process: bool,
        collective: GatherCollective | None = None,
    ) -> EnergyController:
        """Set up a run of ``controller``, then resume the state loaded before setup.

        Args:
            controller: this adapter's controller (a new one, or the last run's).
            main_process: whether this is global rank 0 (it logs and writes the report).
            collective: the ranks' collectives of this run (None: the controller's own).
        """
        self.controller = controller
        self.summary = None
        self._main_process = main_process
        controller.setup(collective=collective)
        self._running = True
        pending, self._pending_state = self._pending_state, None
        if pending is not None:
            controller.handle(CheckpointLoad(pending))
        return controller

    def _finish(self) -> RunSummary | None:
        """End the run normally (every rank): see :func:`finish_run`."""
        if not self._running or self.controller is None:
            return self.summary
        self._running = False
        self.summary = finish_run(
            self.controller, self.config.report, main_process=self._main_process
        )
        return self.summary

    def _abort(self, failure: str) -> RunSummary | None:
        """End the run on an exception: restore every GPU, summarise and, on the main
        process, write the report; no collective, since another rank may not be there.

        Args:
            failure: what failed (the exception's type), for the warning.
        """
        if not self._running or self.controller is None:
            return self.summary
        self._running = False
        controller = self.controller
        self.summary = controller.handle(End()).summary
        log.warning("training failed (%s); GPU settings restored", failure)
        if self._main_process and self.config.report:
            from lightning_energy.report import write_report

            try:
                write_report(controller, self.config.report)
            except OSError as exc:  # the training error matters more than the report
                log.warning("the run report could not be written: %s", exc)
        return self.summary

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The controller's state, for the framework's checkpoints (JSON-serialisable)."""
        if self.controller is None:
            return dict(self._pending_state or {})
        return self.controller.handle(CheckpointSave()).state or {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume the profile and choice of a checkpoint (no profiling again).

        Before a run is set up, the state is kept and resumed right after setup.

        Raises:
            CheckpointMismatchError: the state was measured on another GPU model.
        """
        if not state_dict:
            return
        if self._running and self.controller is not None:
            self.controller.handle(CheckpointLoad(dict(state_dict)))
        else:
            self._pending_state = dict(state_dict)

    # ----------------------------------------------------------------- with
    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Finish the open run, or abort it when the block raised."""
        if exc_type is None:
            self._finish()
        else:
            self._abort(exc_type.__name__)


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
    controller.handle(End())
    controller.gather_job_totals()  # every rank takes part: the job's own numbers
    summary = controller.teardown()
    if main_process:
        log.info("energy summary:\n%s", format_summary(summary))
        if report:
            from lightning_energy.report import write_report

            write_report(controller, report)
    return summary
