"""The records adapters read from the controller: decisions, step results, run summaries.

:class:`Decision` is one setting chosen and why (reports list them), :class:`StepResult`
what :meth:`EnergyController.handle <lightning_energy.controller.EnergyController.handle>`
answers to an event, :class:`RunSummary` what a run used and saved, and :data:`Profile` a
measured power-limit profile as the ledger reads it. They hold data only.

Example:
    >>> StepResult().metrics is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

__all__ = ["Decision", "Profile", "RunSummary", "StepResult"]

#: Measured (time, energy) per step by power limit: the profile as the ledger reads it.
Profile = dict[float, tuple[float, float]]


class Decision(TypedDict):
    """One setting the controller chose, and why (as written to reports).

    Keys: ``step`` (training steps seen), ``time_s`` (device-clock seconds since setup),
    ``kind`` (``power_limit``, ``observe-only``, ``enforced_power_limit``,
    ``target_time_s``, ``batch_size``), ``purpose`` (``profile``, ``choice``, ``pause``,
    ``resume``, ``pace`` or None), ``value`` (watts; seconds per step for
    ``target_time_s``; samples for ``batch_size``; or None) and ``reason``.
    """

    step: int
    time_s: float
    kind: str
    purpose: str | None
    value: float | None
    reason: str


@dataclass(frozen=True)
class RunSummary:
    """What a run used and saved.

    Every field covers this process's run, from setup to teardown, also when the run
    resumed a job from a checkpoint: ``resumed_at_step`` and ``energy_before_resume_j``
    say where the job stood then (add them for the job's totals so far).

    Attributes:
        steps: training steps run.
        energy_j: energy used by this process's GPUs.
        duration_s: device-clock time from setup to teardown.
        power_limit_w: the power limit chosen and in force at the end of the run (None:
            none was chosen: the profile did not finish, or nothing was changed). Every
            GPU is put back to its pre-job limit at the end either way.
        pre_job_power_limit_w: the limit each GPU had before the job.
        profile_complete: whether the power-limit profile was complete at the end (None:
            the run profiled nothing: power limits off, observe-only, or Perseus planned
            clocks instead).
        power_limits_measured: candidate limits measured (by this run or an earlier one
            of the same workload).
        power_limit_candidates: candidate limits of the profile.
        power_limits_applied: distinct limits this run set (profiling windows included).
        knob: what the run profiled and chose: ``power_limit`` or ``locked_clock`` (then
            the ``power_limit*`` counts above are of locked clocks, and the power limit
            stayed at its pre-job value).
        locked_clock_mhz: the SM clock locked by the choice and in force at the end of the
            run (None: the knob is the power limit, or no lock was chosen).
        energy_saved_j: energy measured over the steps after profiling, subtracted from
            the same steps at the highest profiled limit (per the measured profile; 0
            before the profile completes).
        slowdown: the time those steps took over their time at the highest profiled
            limit (pauses included).
        observe_only: True when GPU settings could not be changed.
        read_error: why GPU readings failed during the run (None: they never did); the
            energy from then on is missing and the settings were restored at that point.
        carbon: with a ``carbon:`` section: grams emitted by this process's GPUs; on rank 0
            also the same job run carbon-unaware (the selector's limit, no pacing) and at
            full power, from the end of profiling on the intensities observed (cumulative
            series in ``baselines``), and the deadline and whether it was met.
        job_energy_j: energy used by every GPU of the job in this run, each counted once
            (None until the ranks have compared numbers at the end of a run; ``energy_j``
            is this process's own share).
        read_error: why GPU readings failed during the run (None: they never did).
        resumed_at_step: the steps the job had run when this run resumed it from a
            checkpoint (0: not resumed).
        energy_before_resume_j: the energy the checkpoint counted for those steps (0: not
            resumed).
        node_energy: the CPU packages and DRAM of this process's node (RAPL), when this
            rank measures them: ``energy_j`` (with ``package_energy_j`` and
            ``dram_energy_j``), the domains counted and left out, ``complete`` and its
            ``note``; otherwise ``measured: false`` and why (``measured_by`` another rank
            of the node). None: the run never started.
        job_node_energy_j: the CPUs and DRAM of every node of the job, each once (None
            until the ranks compared numbers, or when no node was measured).
        energy_counted: what the energy and grams count, in words (``GPUs + CPU packages
            + DRAM``, ``GPUs only: RAPL not readable (permission)``); the job's once the
            ranks compared numbers.
    """

    steps: int
    energy_j: float
    duration_s: float
    power_limit_w: float | None
    pre_job_power_limit_w: float | None
    energy_saved_j: float
    slowdown: float
    observe_only: bool
    carbon: dict[str, Any] | None = None
    job_energy_j: float | None = None
    read_error: str | None = None
    profile_complete: bool | None = None
    power_limits_measured: int = 0
    power_limit_candidates: int = 0
    power_limits_applied: int = 0
    knob: str = "power_limit"
    locked_clock_mhz: float | None = None
    resumed_at_step: int = 0
    energy_before_resume_j: float = 0.0
    node_energy: dict[str, Any] | None = None
    job_node_energy_j: float | None = None
    energy_counted: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for logs and reports."""
        return asdict(self)


@dataclass(frozen=True)
class StepResult:
    """What the controller answers to an event.

    Attributes:
        metrics: the ``energy/*`` (and ``carbon/*``) values to log, when a logging interval
            closed during the event; None when there is nothing new to log.
        decisions: the settings chosen while handling the event, in order.
        state: for :class:`CheckpointSave`, the state to store (JSON-serialisable).
        summary: for :class:`End`, the run summary.
    """

    metrics: Mapping[str, float] | None = None
    decisions: tuple[Decision, ...] = field(default_factory=tuple)
    state: dict[str, Any] | None = None
    summary: RunSummary | None = None
