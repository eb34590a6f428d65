"""The power limit: the controller's built-in knob.

:class:`PowerLimitKnob` is the :class:`~lightning_energy.controller.setting_knob.SettingKnob`
of the power limit (profiling windows, the choice and the pace are the base's): it adds
the limits' range (a GPU's allowed range, its pre-job limit, a board or rack limiter),
the permission probe, and the carbon pause at the lowest limit.

It is the one knob every job has; its profiling is off when power limits are off in the
configuration, when the job only observes, when the locked-clock knob profiles instead
(``power_limit.knob``), or while a knob that holds the clocks is registered (see
:mod:`~lightning_energy.controller.knobs`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lightning_energy.controller.setting_knob import SettingKnob, SettingRun
from lightning_energy.errors import ConfigError, DeviceError
from lightning_energy.optimize.power_limit import POWER_LIMIT

if TYPE_CHECKING:
    from lightning_energy.device.guard import GPUGuard
    from lightning_energy.optimize.power_limit import PowerLimitOptimizer

__all__ = ["PowerLimitKnob"]

log = logging.getLogger(__name__)


class PowerLimitKnob(SettingKnob):
    """Profiles, chooses and paces the power limit of a job's GPUs.

    Args:
        run: the controller running the job.

    Attributes:
        profiling_off: why power-limit profiling is off in this run although power limits
            are on (the locked-clock knob profiles instead, or a knob holding the clocks is
            registered); None: it is on.
    """

    name = "power_limit"
    holds_clocks = False

    def __init__(self, run: SettingRun) -> None:
        super().__init__(run, POWER_LIMIT)

    def new_run(self) -> None:
        """Forget the previous run's limits and window (what was learnt is kept)."""
        self._enforced_limit_w: float | None = None
        super().new_run()

    @property
    def power_limit_w(self) -> float | None:
        """The limit applied last in this run (None: none yet)."""
        return self.value

    @property
    def static_limit_w(self) -> float | None:
        """The profile's chosen limit in this run (None: none yet)."""
        return self.static_value

    @property
    def enabled(self) -> bool:
        """Whether power limits are on in the configuration."""
        return self.run.config.power_limit.enabled

    # ------------------------------------------------------------------ setup
    def check_candidates(self) -> None:
        """Refuse candidate limits outside a GPU's allowed range, before any change.

        Raises:
            ConfigError: every candidate outside the range of a GPU, named with it.
        """
        section = self.run.config.power_limit
        if section.power_limits_w is None:
            return
        problems = []
        for gpu in self.run.devices.gpus:
            try:
                lo, hi = gpu.power_limit_constraints_w()
            except DeviceError:
                continue  # no power management, or lost: the guard runs observe-only
            bad = [p for p in section.power_limits_w if not lo <= p <= hi]
            if bad:
                problems.append(
                    f"power_limit.power_limits_w: {bad} outside the allowed range "
                    f"{lo:g}-{hi:g} W of GPU {gpu.index} ({gpu.name})"
                )
        if problems:
            raise ConfigError(problems, self.run.config.source)

    def probe_permission(self, guard: GPUGuard) -> None:
        """Find out now, before training, whether limits may be changed.

        Setting each GPU, on its own, to its pre-job limit changes nothing but fails
        without permission (observe-only, or an error in strict mode). One limit for all
        GPUs would not do: the guard keeps a request for several GPUs equal across them,
        lowering those whose pre-job limits are higher.
        """
        if self.enabled and not guard.observe_only:
            for i in range(len(self.run.devices)):  # after a refusal nothing changes more
                guard.set_power_limit_w(guard.pre_job_power_limit_w(i), gpus=[i])

    def start(self, guard: GPUGuard) -> None:
        """At setup, while every GPU still has its pre-job limit: find a board or rack
        limiter below it (limits above it do not differ)."""
        if self.enabled and not guard.observe_only:
            self._enforced_limit_w = self._board_limiter_w(guard)

    def _board_limiter_w(self, guard: GPUGuard) -> float | None:
        devices = self.run.devices
        pre = min(guard.pre_job_power_limit_w(i) for i in range(len(devices)))
        try:
            enforced = min(g.enforced_power_limit_w() for g in devices.gpus)
        except DeviceError:
            return None
        if not enforced < pre:
            return None
        reason = (
            f"the GPU enforces {enforced:g} W, below its {pre:g} W limit (a board or rack "
            "power limiter): candidate limits above it are capped at it"
        )
        log.warning("Power limits: %s.", reason)
        self.run.ledger.decide("enforced_power_limit", enforced, reason)
        return enforced

    def _new_optimizer(self) -> PowerLimitOptimizer:
        run = self.run
        section = run.config.power_limit
        lo, hi = self.job_limit_range()
        # What the guard would apply: above the pre-job limit (or an enforced one below
        # it) limits do not differ, so the profile is labelled with the limits applied.
        requested = section.candidates_w(lo, hi)
        candidates = [min(max(c, lo), hi) for c in requested]
        clamped = sorted({c for c in requested if c > hi}, reverse=True)
        if clamped and run.collective.rank == 0:
            log.info(
                "Power limits %s W are above %g W, the highest limit this job may set (the "
                "GPUs' pre-job or enforced limit): they are measured, and reported, as %g W.",
                ", ".join(f"{c:g}" for c in clamped),
                hi,
                hi,
            )
        return self._build_optimizer(candidates)

    def limit_range(self) -> tuple[float, float]:
        """The range every local GPU accepts, capped at the lowest pre-job limit and at a
        board or rack limiter below it (this rank's: see :meth:`job_limit_range`)."""
        guard, devices = self._guard, self.run.devices
        los, his = zip(*(g.power_limit_constraints_w() for g in devices.gpus), strict=True)
        pre = [guard.pre_job_power_limit_w(i) for i in range(len(devices))]
        enforced = [] if self._enforced_limit_w is None else [self._enforced_limit_w]
        return max(los), min(*his, *pre, *enforced)

    def job_limit_range(self) -> tuple[float, float]:
        """The range every GPU of the job accepts (a collective): every rank profiles the
        same candidates, or one with fewer windows would end its profile while another
        waits in a window's collective (a GPU capped by an administrator, another model).

        Raises:
            ConfigError: no limit lies in every GPU's range (every rank).
        """
        lo, hi = self.limit_range()
        _, (lo, neg_hi) = self.run.collective.sum_and_max([], [lo, -hi])
        if lo > -neg_hi:
            raise ConfigError(
                [
                    f"power limits: no limit lies in every GPU's range: the highest minimum "
                    f"is {lo:g} W and the lowest maximum (or pre-job limit) {-neg_hi:g} W; "
                    "profile GPUs of one kind, or use power_limit.enabled: false"
                ],
                self.run.config.source,
            )
        return lo, -neg_hi

    def restore_highest(self, reason: str) -> None:
        """Back to the highest limit this job may set (its pre-job limit, or a board
        limiter's), when a lower limit of this run is applied."""
        highest_w = self.limit_range()[1]
        if self.value is not None and self.value != highest_w:
            self._apply(highest_w, reason, purpose="profile")

    def _change(self, value: float) -> float | None:
        return self._guard.set_power_limit_w(value)

    # ------------------------------------------------------------------ carbon pause
    def pause(self, reason: str) -> float | None:
        """Wait at the lowest limit (a carbon pause); the limit to resume at (a job that
        never set one, because Perseus plans clocks instead, resumes at the cap)."""
        lo, hi = self.limit_range()
        before = self.power_limit_w if self.power_limit_w is not None else hi
        self._apply(lo, f"paused: {reason}", purpose="pause")
        return before

    def resume(self, power_limit_w: float | None) -> None:
        """Back to ``power_limit_w`` after a pause."""
        self._apply(power_limit_w, "resumed", purpose="resume")
