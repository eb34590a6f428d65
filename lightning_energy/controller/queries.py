"""What a controller's run can be asked, in one place: read-only views that each forward to
the collaborator holding the answer (the ledger, the agreement among ranks, the guard,
the knobs, carbon pacing).

:class:`ControllerQueries` is mixed into
:class:`~lightning_energy.controller.EnergyController`, which holds the collaborators and
sequences the run; adapters, knobs and reports read the run through these.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_energy.controller.agreement import RunAgreement
    from lightning_energy.controller.built_in_knobs import BuiltInKnobs
    from lightning_energy.controller.carbon_pace import CarbonPacing
    from lightning_energy.controller.job_plan import RankInfo
    from lightning_energy.controller.knobs import Knob, RegisteredKnobs
    from lightning_energy.controller.ledger import RunLedger
    from lightning_energy.controller.locked_clock import LockedClockKnob
    from lightning_energy.controller.power_limits import PowerLimitKnob
    from lightning_energy.controller.rank_devices import RankDevices
    from lightning_energy.controller.records import Decision
    from lightning_energy.controller.setting_knob import SettingKnob
    from lightning_energy.device.base import GPUInfo
    from lightning_energy.device.guard import GPUGuard
    from lightning_energy.pacing import CarbonPacer

__all__ = ["ControllerQueries"]


class ControllerQueries:
    """Read-only views of a controller's run (see the module docstring)."""

    power_limit: PowerLimitKnob
    locked_clock: LockedClockKnob
    _built_in: BuiltInKnobs
    _registered: RegisteredKnobs
    _devices: RankDevices
    _ledger: RunLedger
    _agreement: RunAgreement
    _guard: GPUGuard | None
    _pacing: CarbonPacing | None
    _total_steps: int | None
    _is_setup: bool

    # ------------------------------------------------------------------ knobs
    @property
    def setting(self) -> SettingKnob:
        """The built-in knob driving the GPUs now: the locked clock where it is in charge
        (active, and under ``auto`` once the power limits are profiled, unless they measured
        better), else the power limit."""
        return self._built_in.setting

    @property
    def knobs(self) -> list[Knob]:
        """Every knob of the job: the power limit, the locked clock when it is active, then
        those registered."""
        return [*self._built_in.active(), *self._registered]

    def clock_owners(self, *, except_name: str | None = None) -> list[str]:
        """The names of the registered knobs holding the clocks (one at most; but the one
        named ``except_name``, which a later fit's knob of that name replaces)."""
        return self._registered.clock_owners(except_name=except_name)

    def paced_knob(self) -> Knob:
        """The knob the carbon pace moves: the one holding the clocks, else the setting
        knob (a knob that leaves the clocks alone leaves the GPU's pace to it)."""
        return self._registered.holding_clocks() or self.setting

    def current_power_limit_w(self) -> float | None:
        """The limit this controller applied last (None: none applied yet)."""
        return self.power_limit.power_limit_w

    def current_locked_clock_mhz(self) -> float | None:
        """The SM clock this controller's locked-clock knob holds locked (None: none)."""
        return self._built_in.locked_clock_mhz()

    @property
    def profile_done(self) -> bool:
        """Whether the current workload's profile (of the setting knob) is complete."""
        return self.setting.profile_done

    def profile(self) -> list[dict[str, float]]:
        """The measured profile of the current workload (job-wide numbers): the setting
        knob's, or under ``auto`` both knobs' (power limits first)."""
        return self._built_in.profile()

    # ------------------------------------------------------------------ the run
    @property
    def guard(self) -> GPUGuard | None:
        """The guard of the run in progress (None outside a run): every other part of the
        job (Perseus clocks) changes the GPUs through it, under the same lease."""
        return self._guard if self._is_setup else None

    @property
    def run_guard(self) -> GPUGuard | None:
        """The guard of the run being set up or in progress (for the knobs)."""
        return self._guard

    @property
    def observe_only(self) -> bool:
        """True when this process may not change GPU settings."""
        return bool(self._guard is not None and self._guard.observe_only)

    @property
    def counts_energy(self) -> bool:
        """Whether this rank measures its GPUs (False: a lower rank measures them)."""
        return self._agreement.counts_energy

    @property
    def ranks(self) -> Sequence[RankInfo]:
        """What every rank drives, as agreed at setup."""
        return self._agreement.ranks

    @property
    def total_steps(self) -> int | None:
        """The job's length in steps, when declared (:meth:`set_total_steps`)."""
        return self._total_steps

    @property
    def pacer(self) -> CarbonPacer | None:
        """Rank 0's carbon pacer of the run in progress (None: no ``carbon:`` section, or
        another rank)."""
        return None if self._pacing is None else self._pacing.pacer

    def clock(self) -> float:
        """The GPUs' clock (seconds)."""
        return self._devices.get().clock()

    def now(self) -> datetime:
        """The job's current time: its start plus the device-clock seconds elapsed.

        On a real GPU this is the wall clock; on a simulated GPU it follows the virtual
        clock, so carbon traces replay at the simulated job's speed.
        """
        return self._ledger.now(running=self._is_setup)

    # ------------------------------------------------------------------ numbers
    @property
    def ledger(self) -> RunLedger:
        """The numbers of the run in progress (or the last one)."""
        return self._ledger

    @property
    def steps(self) -> int:
        """The job's training steps so far (a resumed run counts on from its checkpoint's)."""
        return self._ledger.step

    @property
    def metrics(self) -> dict[str, float]:
        """The ``energy/*`` (and ``carbon/*``) values of the last logging interval."""
        return self._ledger.metrics

    @property
    def timeline(self) -> list[dict[str, Any]]:
        """One entry per logging interval of the run (and per polling period of a pause)."""
        return self._ledger.timeline

    @property
    def decisions(self) -> list[Decision]:
        """Every setting chosen in the run, and why."""
        return self._ledger.decisions

    @property
    def device_info(self) -> list[GPUInfo]:
        """Identity and limits of every GPU, as recorded at setup."""
        return self._ledger.device_info

    @property
    def job(self) -> dict[str, Any] | None:
        """The job's totals once :meth:`gather_job_totals` ran (None before)."""
        return self._ledger.job
