"""The controller's two built-in setting knobs, and which of them drives the GPUs.

The power limit (:mod:`.power_limits`) and its sibling the locked SM clock
(:mod:`.locked_clock`) each profile, choose and pace one setting of every GPU of the job.
:class:`BuiltInKnobs` holds both: which is in charge now (the locked clock where it is
active and, under ``auto``, once the power limits are profiled, unless they measured
better), the workload both follow, their profiles and their checkpoint state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_energy.controller.locked_clock import LockedClockKnob
from lightning_energy.controller.power_limits import PowerLimitKnob

if TYPE_CHECKING:
    from lightning_energy.controller.knobs import Knob
    from lightning_energy.controller.setting_knob import SettingKnob, SettingRun
    from lightning_energy.device.guard import GPUGuard

__all__ = ["BuiltInKnobs"]


class BuiltInKnobs:
    """The power-limit and locked-clock knobs of one controller.

    Args:
        run: the controller running the job.

    Attributes:
        power_limit: the built-in power-limit knob.
        locked_clock: the built-in locked-clock knob.
    """

    def __init__(self, run: SettingRun) -> None:
        self.power_limit = PowerLimitKnob(run)
        self.locked_clock = LockedClockKnob(run, self.power_limit)

    def new_run(self) -> None:
        """Forget the previous run's settings and windows (what was learnt is kept)."""
        self.power_limit.new_run()
        self.locked_clock.new_run()

    def start(self, guard: GPUGuard) -> None:
        """At setup: both knobs start under the run's guard (the locked clock decides
        whether this job may lock its clocks)."""
        self.power_limit.start(guard)
        self.locked_clock.start(guard)

    @property
    def setting(self) -> SettingKnob:
        """The knob driving the GPUs now."""
        return self.locked_clock if self.locked_clock.in_charge else self.power_limit

    @property
    def _compared(self) -> bool:
        """``auto``: both knobs profile every workload, and the choice is made among both."""
        clocks = self.locked_clock
        return clocks.active and clocks.after_limits

    def active(self) -> list[Knob]:
        """The power limit, and the locked clock when it is active."""
        clocks: list[Knob] = [self.locked_clock] if self.locked_clock.active else []
        return [self.power_limit, *clocks]

    def locked_clock_mhz(self) -> float | None:
        """The SM clock the locked-clock knob holds locked (None: none)."""
        clocks = self.locked_clock
        return clocks.value if clocks.active else None

    def set_workload(self, key: str) -> None:
        """What is being trained changed (or is declared): see
        :meth:`EnergyController.set_workload
        <lightning_energy.controller.EnergyController.set_workload>`."""
        if not self._compared:
            self.setting.set_workload(key)
            return
        # auto: both knobs follow the workload; the one in charge for it applies its choice.
        self.power_limit.set_workload(key, reuse=False)
        self.locked_clock.set_workload(key, reuse=False)
        self.locked_clock.hand_over()
        self.setting.reuse_known_choice()

    def profile(self) -> list[dict[str, float]]:
        """The current workload's measured profile: the setting knob's, or under ``auto``
        both knobs' (power limits first)."""
        if self._compared:
            return [*self.power_limit.profile(), *self.locked_clock.profile()]
        return self.setting.profile()

    def state_dict(self) -> dict[str, Any]:
        """Both knobs' profiles and choices, as a checkpoint holds them."""
        return {
            **self.power_limit.state_dict(),
            LockedClockKnob.name: self.locked_clock.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, running: bool) -> None:
        """Resume both knobs from :meth:`state_dict`; in a run set up (``running``), the
        knob in charge applies its restored choice."""
        self.power_limit.load_state_dict(state, running=False)
        self.locked_clock.load_state_dict(state.get(LockedClockKnob.name, {}), running=False)
        if not running:
            return
        # Both profiles are read back before the one in charge is known (under auto the
        # choice is made among both).
        for knob in (self.power_limit, self.locked_clock):
            if knob.enabled:
                knob.session.optimizer()
        self.locked_clock.hand_over()
        self.setting.resume_choice()
