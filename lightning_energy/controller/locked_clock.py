"""The locked SM clock: the power limit's sibling knob.

Under a power limit the GPU's DVFS moves the SM clock with the workload's phases; since
power grows faster than linearly with the clock, a clock locked at the average frequency
a limit produces can run as fast on less energy. Whether it does on this job is measured,
not assumed: :class:`LockedClockKnob` profiles locked clocks in the same windows, with the
same selectors, as the power-limit knob (both are
:class:`~lightning_energy.controller.setting_knob.SettingKnob`), and ``power_limit.knob``
says which of the two a job profiles:

- ``power_limit``: power limits (the default);
- ``locked_clock``: locked clocks; where this job may not lock them (no permission, a GPU
  older than Volta, an administrator's lock), a warning and power limits (strict mode: a
  :class:`~lightning_energy.errors.ConfigError`);
- ``auto``: where this job may lock clocks, both, measured against each other: power
  limits first (the average SM clock each limit runs at is read meanwhile), then locked
  clocks seeded at those clocks; the selector then chooses among every candidate of
  either knob (:func:`~lightning_energy.optimize.selectors.select_across`), so the lock is
  used only where it measured better. Elsewhere power limits.

With a lock the power limit stays at its pre-job value. Every lock goes through the run's
guard: it is released at the end (an administrator's lock found before is never replaced
nor raised) and recorded in the lease first, so ``lightning-energy recover`` releases it
after a crash.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lightning_energy.controller.setting_knob import SettingKnob, SettingRun
from lightning_energy.errors import ConfigError, DeviceError
from lightning_energy.optimize.power_limit import LOCKED_CLOCK, POWER_LIMIT
from lightning_energy.optimize.selectors import select_across

if TYPE_CHECKING:
    from lightning_energy.controller.knobs import KnobDecision
    from lightning_energy.controller.power_limits import PowerLimitKnob
    from lightning_energy.device.guard import GPUGuard
    from lightning_energy.optimize.power_limit import PowerLimitOptimizer

__all__ = ["FOREIGN_CLOCK_CHECK_STEPS", "LockedClockKnob", "thin_clocks_mhz"]

log = logging.getLogger(__name__)

#: At the ends of this many first steps of a run the controller lets the guard look for a
#: clock lock the job did not make (NVML shows one only while work runs under it).
FOREIGN_CLOCK_CHECK_STEPS = 3

# NVML clock-event reasons that hold a clock below its lock (software power cap, hardware
# slowdown, software and hardware thermal, power brake).
_THROTTLED = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def thin_clocks_mhz(supported_mhz: list[int], step_mhz: float) -> list[float]:
    """Candidate clocks: the highest supported clock, then every supported clock at least
    ``step_mhz`` below the previous candidate.

    Args:
        supported_mhz: the supported SM clocks (any order).
        step_mhz: the least spacing, in MHz.

    Returns:
        The candidates, highest first.

    Example:
        >>> thin_clocks_mhz([1410, 1395, 1380, 1300, 1200, 1185], 100)
        [1410.0, 1300.0, 1200.0]
    """
    candidates: list[float] = []
    for clock in sorted(set(supported_mhz), reverse=True):
        if not candidates or candidates[-1] - clock >= step_mhz:
            candidates.append(float(clock))
    return candidates


class LockedClockKnob(SettingKnob):
    """Profiles, chooses and paces one locked SM clock for all of a job's GPUs.

    Args:
        run: the controller running the job.
        limits: the job's power-limit knob: the average clocks it measured under each
            limit of a workload (an earlier run's profile) are candidates too.

    Attributes:
        active: this job profiles locked clocks (decided at setup and at the first lock,
            alike on every rank).
        after_limits: ``auto``: power limits are profiled first and the choice is made
            among the candidates of both knobs.
    """

    name = "locked_clock"
    holds_clocks = True

    def __init__(self, run: SettingRun, limits: PowerLimitKnob) -> None:
        super().__init__(run, LOCKED_CLOCK)
        self.limits = limits
        self.active = False
        self.after_limits = False
        # Under ``auto``, by workload: the knob whose candidate the selector chose.
        self._winners: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        """Whether this job profiles locked clocks (see :meth:`start`)."""
        return self.active

    def start(self, guard: GPUGuard) -> None:
        """At setup: whether this job may lock its clocks (``power_limit.knob``, every GPU
        lists supported clocks), decided alike on every rank (a rank that may not makes
        every rank use power limits). Whether the GPUs accept a lock is known at each lock,
        the first after the warm-up: see :meth:`_apply`.

        Raises:
            ConfigError: strict mode, ``locked_clock`` is forced and may not be used.
        """
        section = self.run.config.power_limit
        self.active = self.limits.compared = False
        self.after_limits = section.knob == "auto"
        if section.knob == "power_limit" or not section.enabled:
            return
        if self.profiling_off is not None:
            log.info(
                "power_limit.knob %s: %s; power limits apply.", section.knob, self.profiling_off
            )
            return
        self.active = self.run.changes_settings()
        self._agree(None if guard.observe_only else self._refusal())
        self.limits.compared = self.active and self.after_limits

    @property
    def in_charge(self) -> bool:
        """Whether this knob drives the GPUs now: it is active and, under ``auto``, the
        workload's power limits are profiled and its locks were not measured worse."""
        if not self.active:
            return False
        if not self.after_limits:
            return True
        if not self.limits.profile_done:
            return False
        return not self.profile_done or self._winner() == self.name

    def hand_over(self) -> None:
        """Under ``auto``, at a step's start: only the knob in charge holds a setting (a
        lock is released while power limits are profiled or chosen; locks run at the
        highest power limit)."""
        if not (self.active and self.after_limits):
            return
        if self.in_charge:
            self.limits.restore_highest("locked clocks run at the highest power limit")
        elif self.value is not None:
            self.discard_window("power limits drive the GPUs")
            self._guard.reset_clocks()
            self.value = None

    def _winner(self) -> str:
        """The knob chosen for the current workload (both profiles are complete)."""
        workload = self.session.workload
        if workload not in self._winners:  # a profile resumed from a checkpoint
            self._winners[workload] = self._compare()[0]
        return self._winners[workload]

    def _compare(self) -> tuple[str, float]:
        """The selector's choice among both knobs' measured candidates (throttled locks
        left out): ``(knob, setting)``. The profiles are job-wide sums, alike on every rank."""
        limits = self.limits.session.optimizer()
        clocks = self.session.optimizer()
        index, best = select_across(
            self.session.selector,
            [limits.choosable(), clocks.choosable()],
            max_power_limit_w=limits.max_power_limit_w,
            num_gpus=limits.num_gpus,
        )
        return (POWER_LIMIT, LOCKED_CLOCK)[index].name, best.power_limit_w

    def _finish_profile(self) -> None:
        """Under ``auto``: apply the best candidate of either knob (rank 0's comparison,
        alike on every rank), saying which won and by how much."""
        if not self.after_limits:
            super()._finish_profile()
            return
        knob, value = self.run.collective.broadcast(self._compare())
        self._winners[self.session.workload] = knob
        limits_best = self.limits.static_value
        clocks = self.session.profile_by_limit()
        own = self.session.optimizer().chosen_power_limit_w
        selector = self.session.selector.describe()
        measured = self.limits.session.profile_by_limit()
        if limits_best in measured and own in clocks:
            assert limits_best is not None and own is not None
            (t_l, e_l), (t_c, e_c) = measured[limits_best], clocks[own]
            versus = (
                f"locked clock {LOCKED_CLOCK.label(own)} measured {100.0 * (e_c / e_l - 1.0):+.1f} "
                f"% energy and {100.0 * (t_c / t_l - 1.0):+.1f} % time per step against power "
                f"limit {POWER_LIMIT.label(limits_best)}"
            )
        else:
            versus = "no power limit was chosen to compare with"
        if self.run.collective.rank == 0:
            log.info(
                "power_limit.knob auto: the %s selector chose %s %s among power limits and "
                "locked clocks (%s).",
                selector,
                knob.replace("_", " "),
                (LOCKED_CLOCK if knob == self.name else POWER_LIMIT).label(value),
                versus,
            )
        reason = f"profile complete; selector {selector}; auto chose {knob.replace('_', ' ')}"
        if knob == self.name:
            self.use_choice(value, reason)
            return
        self.discard_window("power limits won")
        if self.value is not None:
            self._guard.reset_clocks()
            self.value = None
        self.limits.use_choice(value, reason)

    def _agree(self, refused: str | None) -> None:
        """Every rank alike: fall back to power limits when ``refused`` on some rank."""
        (refusals,), _ = self.run.collective.sum_and_max([float(refused is not None)], [])
        if refusals > 0:
            self._fall_back(refused or "another rank of the job may not lock its GPUs' clocks")

    def _fall_back(self, reason: str) -> None:
        """Power limits from now on: this knob is off for the run (a lock it set is
        released), with one line saying why (strict mode and ``locked_clock``: an error)."""
        config = self.run.config
        knob = config.power_limit.knob
        self._switch_off(reason)
        if knob == "auto":
            log.info("power_limit.knob auto: %s; power limits are profiled.", reason)
        elif config.strict:
            raise ConfigError(
                f"power_limit.knob: 'locked_clock' is not possible here ({reason}); allowed "
                "here: auto or power_limit",
                config.source,
            )
        else:
            log.warning(
                "power_limit.knob is locked_clock, but %s: power limits are profiled instead.",
                reason,
            )

    def _switch_off(self, reason: str) -> None:
        """Off for the rest of the run: the window in progress discarded, a lock released."""
        if not self.active:
            return
        self.active = False
        self.limits.compared = False
        self.discard_window(reason)
        guard = self.run.run_guard
        if guard is not None and self.value is not None:
            guard.reset_clocks()
        self.value = None

    def yield_clocks(self, owner: str) -> None:
        """Another knob (``owner``) holds the clocks from now on: this knob is off for the
        rest of the job (one owner of the clocks at a time), and a lock it set is released."""
        self.profiling_off = f"{owner} holds the clocks"
        if self.active and self.run.collective.rank == 0:
            log.info("Locked clocks are not profiled: %s.", self.profiling_off)
        self._switch_off(self.profiling_off)

    def _refusal(self) -> str | None:
        """Why this rank's GPUs cannot lock their clocks (none listed), or None."""
        try:
            supported = [g.supported_sm_clocks_mhz() for g in self.run.devices.gpus]
        except DeviceError as exc:
            return f"the supported SM clocks cannot be read ({exc})"
        if not all(supported):
            return "a GPU supports no clock locking (it is older than Volta)"
        return None

    def _new_optimizer(self) -> PowerLimitOptimizer:
        """Candidates: the supported clocks thinned to ``clock_step_mhz``, and the supported
        clock nearest the average clock each power limit of this workload ran at where
        the limits were profiled (rank 0's readings: every rank has the same candidates)."""
        run = self.run
        gpus = run.devices.gpus
        common = set.intersection(*(set(g.supported_sm_clocks_mhz()) for g in gpus))
        supported = sorted(common or set(gpus[0].supported_sm_clocks_mhz()))
        # Rank 0's, on every rank: another GPU model elsewhere supports other clocks, and
        # a rank with other windows would wait in a collective the others never reach.
        candidates = run.collective.broadcast(
            thin_clocks_mhz(supported, run.config.power_limit.clock_step_mhz)
        )
        seen = self.limits.average_clocks_mhz(self.session.workload).values()
        seeds: list[float] = run.collective.broadcast(sorted(seen))
        nearest = {float(min(supported, key=lambda c: abs(c - s))) for s in seeds}
        # The warm-up covers the steps at whose ends the guard looks for an administrator's
        # lock (NVML shows one only under load): none is replaced by this job's first lock.
        warmup_steps = max(run.config.power_limit.warmup_steps, FOREIGN_CLOCK_CHECK_STEPS)
        return self._build_optimizer(
            sorted(set(candidates) | nearest, reverse=True), warmup_steps=warmup_steps
        )

    def _apply_window(self, value: float, purpose: str) -> None:
        """The warm-up runs unlocked (at the top clock, as a lock there would)."""
        if purpose != "warmup":
            super()._apply_window(value, purpose)

    def _apply(self, value: float | None, reason: str, purpose: str = "choice") -> None:
        """Lock ``value``, then learn whether the GPUs accepted it: where a rank's refused
        (no permission, not supported, an administrator's lock found in the warm-up), at
        the first lock or any later one, every rank falls back to power limits from here
        on, and applies their choice where they were profiled already (``auto``)."""
        super()._apply(value, reason, purpose)
        if value is not None and self.active:
            self._lock_held()

    def apply_pace(self, scale: float) -> KnobDecision | None:
        """The carbon pace's lock; where a rank's GPUs refuse it, every rank falls back to
        power limits, which take the pace (where they were profiled already: ``auto``;
        otherwise once they are). Every rank agrees after each paced lock (the profile is
        job-wide, so all ranks get here alike), not only one whose lock was refused."""
        decision = super().apply_pace(scale)
        if not self.session.profile_by_limit() or self._lock_held():
            return decision
        return self.limits.apply_pace(scale)

    def _lock_held(self) -> bool:
        """After a lock, every rank alike: whether every rank's GPUs accepted it. Where a
        rank's refused, power limits from here on, their choice applied where they were
        profiled already."""
        guard = self._guard
        self._agree(None if guard.observe_only else guard.clocks_off_reason)
        if not self.active:
            self.limits.reuse_known_choice()
        return self.active

    def _throttled(self, reasons: int, clock_mhz: int | None) -> bool:
        """A busy GPU ran below the lock: power or thermal clock-event reasons, or its SM
        clock below the lock."""
        lock_mhz = self.value
        if lock_mhz is None:
            return False
        return bool(reasons & _THROTTLED) or (clock_mhz is not None and clock_mhz < lock_mhz)

    def _change(self, value: float) -> float | None:
        clock = round(value)
        applied = self._guard.lock_clocks_mhz(clock, clock, refusal_stops_clocks=True)
        return None if applied is None else float(applied[1])
