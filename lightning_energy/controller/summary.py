"""The end of a run: its summary, and the job's totals gathered from every rank.

:func:`final_summary` closes what the run still has open (the profiling window in
progress, cut short, is measured by a later run; the logging interval; the node's meter)
and builds the :class:`~.records.RunSummary` from the ledger's numbers and the setting
knob's profile. :func:`gather_job_totals` compares every rank's numbers and keeps the job's
(a collective, on a normal end only). Both read the controller through :class:`EndingRun`
and change the ledger only through its methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from lightning_energy.controller.job_plan import job_totals
from lightning_energy.controller.knobs import ControllerRun

if TYPE_CHECKING:
    from lightning_energy.controller.locked_clock import LockedClockKnob
    from lightning_energy.controller.power_limits import PowerLimitKnob
    from lightning_energy.controller.records import RunSummary
    from lightning_energy.controller.setting_knob import SettingKnob
    from lightning_energy.pacing import CarbonPacer

__all__ = ["EndingRun", "final_summary", "gather_job_totals"]


class EndingRun(ControllerRun, Protocol):
    """What the end of a run reads of the controller."""

    @property
    def power_limit(self) -> PowerLimitKnob: ...

    @property
    def locked_clock(self) -> LockedClockKnob: ...

    @property
    def setting(self) -> SettingKnob: ...

    @property
    def pacer(self) -> CarbonPacer | None: ...

    @property
    def observe_only(self) -> bool: ...

    def optimises(self) -> bool: ...

    def current_locked_clock_mhz(self) -> float | None: ...


def final_summary(run: EndingRun, *, stop_clock: bool) -> RunSummary:
    """Close the run's open windows (what can still be read) and build its summary.

    Args:
        run: the controller whose run ends (its GPUs are restored already).
        stop_clock: whether the devices are there to read the end time from.
    """
    ledger = run.ledger
    limits = run.power_limit
    setting = run.setting
    try:
        setting.discard_window("end of the run")  # a window cut short is measured later
    except Exception as exc:  # e.g. a sticky CUDA error: the GPUs are restored already
        ledger.fail(exc)
    else:
        ledger.close(limits.power_limit_w, run.current_locked_clock_mhz(), stop_clock=stop_clock)
    ledger.close_node()
    profile = setting.profile_by_limit()
    world_size = run.collective.world_size
    carbon = None
    if run.config.carbon is not None:
        carbon = ledger.carbon_summary(
            run.pacer, profile, setting.static_value, world_size, run.now()
        )
    guard = run.run_guard
    progress = setting.progress() if run.optimises() else None
    chosen = progress is None or progress[0]
    return ledger.build_summary(
        power_limit_w=limits.power_limit_w if chosen or setting is not limits else None,
        pre_job_power_limit_w=guard.pre_job_power_limit_w(0) if guard is not None else None,
        observe_only=run.observe_only,
        profile=profile,
        progress=progress,
        world_size=world_size,
        carbon=carbon,
        knob=setting.name,
        locked_clock_mhz=run.locked_clock.value if chosen and setting is not limits else None,
    )


def gather_job_totals(run: EndingRun, summary: RunSummary, node: str) -> dict[str, Any]:
    """Every rank: compare this rank's numbers with the others'; the job's totals (kept in
    the ledger, and in its summary's ``job_energy_j``).

    Args:
        run: the controller whose run ended.
        summary: this rank's run summary.
        node: this rank's node.
    """
    ledger = run.ledger
    mine = ledger.own_totals(run.collective.rank, node, run.counts_energy)
    job = job_totals(run.collective.all_gather_object(mine))
    ledger.keep_job_totals(job, summary)
    return job
