"""What every framework adapter shares: configuration, the run's life and the report.

The adapters (Lightning and its twin namespace, Fabric, Accelerate, the Transformers
``Trainer``, and the DeepSpeed and Megatron-Core pipeline engines through
:mod:`._pipeline_engine`) only translate their framework's hooks into controller events;
the contract they follow (docs/adapters.md) lives here, once: resolving the
configuration, loading a checkpoint's state before or after setup, finishing a run
(restore, totals, summary, report) or aborting it on an exception (restore, summary,
report, no collective), the workload key and the ranks' collectives over the framework's
own ``all_gather``.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Protocol, TypeVar

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
from lightning_energy.errors import ConfigError, EnergyError
from lightning_energy.summary_rows import (
    NOT_MEASURED,
    estimates_measured,
    mode_rows,
    node_energy_rows,
    power_limit_rows,
)

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

R = TypeVar("R")


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
    alike from each. Methods of the framework's objects are held weakly: a run that ended
    never keeps the user's ``Fabric`` or ``Trainer`` alive.

    Args:
        rank: this process's global rank.
        world_size: number of processes.
        all_gather: gathers a tensor from every rank (on ``device``).
        broadcast: takes an object and a source rank, returns the source's object.
        device: where the framework's collectives expect tensors (NCCL rejects CPU ones).
    """

    gather = _held_weakly(all_gather)

    def gather_rows(values: list[float]) -> list[list[float]]:
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        gathered = gather(tensor).reshape(-1, len(values))
        return [row.tolist() for row in gathered.cpu()]

    return GatherCollective(rank, world_size, gather_rows, _held_weakly(broadcast))


def _held_weakly(function: Callable[..., R]) -> Callable[..., R]:
    """``function``, without keeping the object it is a method of alive.

    Raises (when called):
        EnergyError: that object is gone (its run ended with it).
    """
    if not inspect.ismethod(function):
        return function
    method = weakref.WeakMethod(function)
    name = function.__qualname__

    def call(*args: Any, **kwargs: Any) -> R:
        bound = method()
        if bound is None:
            raise EnergyError(f"{name}: its object no longer exists (the run using it ended)")
        return bound(*args, **kwargs)

    return call


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
    """A short human-readable table of a run summary (this process's run; a resumed run
    also says where the job resumed)."""
    rows = [
        ("steps", f"{summary.steps}"),
        ("energy (this process)", f"{summary.energy_j / 1000:.2f} kJ"),
    ]
    if summary.resumed_at_step:
        before = f"{summary.energy_before_resume_j / 1000:.2f} kJ"
        rows.insert(1, ("resumed at step", f"{summary.resumed_at_step} ({before} before)"))
    if summary.job_energy_j is not None and summary.job_energy_j != summary.energy_j:
        rows.append(("energy (whole job)", f"{summary.job_energy_j / 1000:.2f} kJ"))
    rows += node_energy_rows(summary.to_dict(), lambda j: f"{j / 1000:.2f} kJ")
    rows.append(("time", f"{summary.duration_s:.1f} s"))
    setting = summary.locked_clock_mhz if summary.knob == "locked_clock" else summary.power_limit_w
    chosen = [] if setting is None else [setting]
    rows += power_limit_rows(summary.to_dict(), chosen)
    measured = estimates_measured(summary.to_dict())
    rows += [
        (
            "energy saved (estimate)",
            f"{summary.energy_saved_j / 1000:.2f} kJ" if measured else NOT_MEASURED,
        ),
        ("slowdown", f"{(summary.slowdown - 1) * 100:+.1f} %" if measured else NOT_MEASURED),
    ]
    rows += mode_rows(summary.to_dict())
    carbon = summary.carbon or {}
    if "emissions_g" in carbon:
        factor = carbon.get("emission_factor")
        of = f" ({factor} emission factors)" if factor else ""
        rows.append(("CO2eq emitted (this process)", f"{carbon['emissions_g']:.1f} g{of}"))
    if "node_emissions_g" in carbon:
        rows.append(("CO2eq emitted (CPU + DRAM)", f"{carbon['node_emissions_g']:.1f} g"))
        rows.append(("CO2eq emitted (total)", f"{carbon['total_emissions_g']:.1f} g"))
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
    node_j = (summary.node_energy or {}).get("energy_j")
    if node_j is not None:
        values["energy/summary/node_energy_j"] = float(node_j)
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
    it when the block raises. A run still open at interpreter exit is ended then, with one
    warning. An adapter pickles at every point of its life: the copy (``ddp_spawn``
    workers) carries the configuration, the last summary and a state loaded before
    setup, never the open run, its GPUs or lease.

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
    #: Whether the adapter's runs are its own (it sets them up and ends them), or it takes
    #: part in the run of the energy adapter of the same framework object
    #: (:meth:`_join_run`: the Lightning batch-size and Perseus callbacks).
    owns_runs: ClassVar[bool] = True
    #: What the user writes to end a run of this adapter, for the messages about a run
    #: that did not end.
    ended_by: ClassVar[str] = "`with energy:`"
    #: The adapters with a run open, in this process and others forked from it.
    _open_runs: ClassVar[weakref.WeakSet[EnergyAdapter]] = weakref.WeakSet()

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
        self._run_pid: int | None = None
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

    def __getstate__(self) -> dict[str, Any]:
        """What a copy gets: everything but the open run (its controller stays here)."""
        state = self.__dict__.copy()
        state.update(controller=None, _running=False, _run_pid=None)
        return state

    def _begin_run(
        self,
        controller: EnergyController,
        *,
        main_process: bool,
        collective: GatherCollective | None = None,
    ) -> EnergyController:
        """Set up a run of ``controller``, then resume the state loaded before setup.

        A GPU that a run of another adapter of this process drives (set up and not ended)
        is only observed by this run, which says so.

        Args:
            controller: this adapter's controller (a new one, or the last run's).
            main_process: whether this is global rank 0 (it logs and writes the report).
            collective: the ranks' collectives of this run (None: the controller's own).
        """
        self.controller = controller
        self.summary = None
        self._main_process = main_process
        if main_process and self.config.report:
            # Loaded now: a run ended at interpreter exit may import nothing any more
            # (the report's imports register exit handlers of their own).
            importlib.import_module("lightning_energy.report")
        self._end_abandoned_runs()
        controller.setup(collective=collective, observe=self._driven_elsewhere(controller))
        self._running = True
        self._run_pid = os.getpid()
        self._open_runs.add(self)
        atexit.register(self._end_at_exit)
        pending, self._pending_state = self._pending_state, None
        if pending is not None:
            controller.handle(CheckpointLoad(pending))
        return controller

    def _join_run(self, owner: EnergyAdapter) -> EnergyController:
        """Take part in the open run of ``owner``, which set it up and ends it.

        The run's controller is ``owner``'s: this adapter registers its knobs and reads
        its GPUs there, and its own :meth:`_finish` and :meth:`_abort` only end its part
        (``owner`` restores, summarises and reports). Its checkpoint entry is empty:
        ``owner``'s carries the run's state.

        Raises:
            EnergyError: ``owner`` has no open run.
        """
        if not owner.running or owner.controller is None:
            raise EnergyError(
                f"{type(self).__name__} joins the run of {type(owner).__name__}, which has "
                "not set one up"
            )
        self.controller = owner.controller
        self.summary = None
        self._main_process = owner._main_process
        self._running = True
        self._run_pid = os.getpid()
        return owner.controller

    def _abandoned(self) -> str | None:
        """Why the framework can no longer end this adapter's open run (None: it can)."""
        return None

    def _end_abandoned_runs(self) -> None:
        """End the open runs of other adapters of this process that their framework can no
        longer end (see :meth:`_abandoned`), so they leave the GPUs to this run."""
        for other in list(self._open_runs):
            if other is self or other._run_pid != os.getpid():
                continue
            reason = other._abandoned()
            if reason is not None:
                other._end_alone(
                    f"the {type(other).__name__} run {reason}; it ended now (GPU settings restored)"
                )

    def _driven_elsewhere(self, controller: EnergyController) -> str | None:
        """Why ``controller`` may only observe: a GPU of it that an open run of another
        adapter of this process drives (None: none is)."""
        others = [
            (other, other.controller)
            for other in list(self._open_runs)
            if other is not self and other._run_pid == os.getpid() and other.controller
        ]
        if not others:
            return None
        mine = {gpu.uuid: gpu for gpu in controller.devices.gpus}
        for other, driving in others:
            shared = [mine[g.uuid] for g in driving.devices.gpus if g.uuid in mine]
            if shared:
                gpus = ", ".join(f"GPU {g.index} ({g.name})" for g in shared)
                return (
                    f"{gpus} is driven by the {type(other).__name__} run set up earlier in "
                    f"this process, which has not ended: end a run with {other.ended_by} "
                    "before setting up another"
                )
        return None

    def _finish(self) -> RunSummary | None:
        """End the run normally (every rank): see :func:`finish_run`. An adapter that
        joined the run (:meth:`_join_run`) only ends its part."""
        if not self._mark_ended() or not self.owns_runs:
            return self.summary
        assert self.controller is not None
        self.summary = finish_run(
            self.controller, self.config.report, main_process=self._main_process
        )
        return self.summary

    def _abort(self, failure: str) -> RunSummary | None:
        """End the run on an exception: see :meth:`_end_alone`.

        Args:
            failure: what failed (the exception's type), for the warning.
        """
        return self._end_alone(f"training failed ({failure}); GPU settings restored")

    def _end_alone(self, message: str, level: int = logging.WARNING) -> RunSummary | None:
        """End the run where another rank may not be there to answer: restore every GPU,
        summarise, log ``message`` at ``level`` and, on the main process, write the
        report; no collective.
        """
        if not self._mark_ended() or not self.owns_runs:
            return self.summary
        assert self.controller is not None
        controller = self.controller
        self.summary = controller.handle(End()).summary
        log.log(level, "%s", message)
        if self._main_process and self.config.report:
            from lightning_energy.report import ReportError, write_report

            try:
                write_report(controller, self.config.report)
            except ReportError as exc:  # the training error matters more than the report
                log.warning("the run report could not be written: %s", exc)
        return self.summary

    def _mark_ended(self) -> bool:
        """Mark the open run ended; False when there was none."""
        if not self._running or self.controller is None:
            return False
        self._running = False
        self._open_runs.discard(self)
        atexit.unregister(self._end_at_exit)
        return True

    def _end_at_exit(self) -> None:
        """The interpreter exits with the run still open: end it, saying so.

        The run ends as on an exception (restore, summary, report), without what a
        subclass undoes of the framework's objects at an exception: the process ends.
        """
        if self._run_pid != os.getpid():
            return  # a forked copy: the process that set the run up ends it
        self._end_alone(
            f"the {type(self).__name__} run set up in this process never ended; it ended at "
            f"interpreter exit (GPU settings restored): end a run with {self.ended_by}"
        )

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The controller's state, for the framework's checkpoints (JSON-serialisable);
        empty for an adapter that joins another's runs (that one's entry carries it)."""
        if not self.owns_runs:
            return {}
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
