"""What the two built-in setting knobs share: profiling windows, the choice, the pace.

A :class:`SettingKnob` applies one setting to every GPU of the job: the power limit
(:class:`~lightning_energy.controller.power_limits.PowerLimitKnob`) or a locked SM clock
(:class:`~lightning_energy.controller.locked_clock.LockedClockKnob`). It profiles its
candidates in windows of training steps (the
:class:`~lightning_energy.controller.session.ProfilingSession` decides which setting is
measured next and for how long; the workload's
:class:`~lightning_energy.optimize.power_limit.PowerLimitOptimizer`, of the knob's
:class:`~lightning_energy.optimize.power_limit.SettingKind`, chooses), applies the
selector's choice, and moves the setting when the carbon pace asks for a slower or faster
step. Every change goes through the run's guard and is recorded in its ledger. What was
learnt about workloads is kept across runs and in checkpoints.

A job profiles one of them, or under ``auto`` both, one after the other
(``power_limit.knob``: see :meth:`~lightning_energy.controller.locked_clock.LockedClockKnob.start`).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from lightning_energy.controller.knobs import ControllerRun, KnobDecision
from lightning_energy.controller.session import ProfilingSession, WindowProgress
from lightning_energy.controller.windows import WINDOW
from lightning_energy.errors import DeviceError, ProfileError
from lightning_energy.numbers import is_finite

if TYPE_CHECKING:
    from lightning_energy.controller.records import Profile
    from lightning_energy.device.base import GPU
    from lightning_energy.device.guard import GPUGuard
    from lightning_energy.optimize.power_limit import PowerLimitOptimizer, SettingKind

__all__ = ["CLOCK_EVENT_IDLE", "POWER_LIMIT_KEYS", "SettingKnob", "SettingRun"]

#: NVML clock-event reason of an idle GPU (it shows nothing of a setting).
CLOCK_EVENT_IDLE = 0x1

log = logging.getLogger(__name__)

#: The key of a profile entry's setting in reports, by kind.
POWER_LIMIT_KEYS = {"power_limit": "power_limit_w", "locked_clock": "locked_clock_mhz"}


def _busy_clock(gpu: GPU) -> tuple[int, int | None] | None:
    """``(clock-event reasons, SM clock in MHz)`` of a busy GPU; None when it is idle or
    its backend cannot tell."""
    try:
        reasons = int(gpu.clock_event_reasons())  # type: ignore[attr-defined]
        clock_mhz = gpu.sm_clock_mhz()  # type: ignore[attr-defined]
    except (AttributeError, DeviceError):
        return None
    if reasons & CLOCK_EVENT_IDLE:
        return None
    return reasons, None if clock_mhz is None else int(clock_mhz)


class SettingRun(ControllerRun, Protocol):
    """What a setting knob uses of the run it belongs to (the controller)."""

    def current_power_limit_w(self) -> float | None: ...

    def current_locked_clock_mhz(self) -> float | None: ...

    def clock(self) -> float: ...


class SettingKnob(ABC):
    """Profiles, chooses and paces one setting of a job's GPUs.

    Args:
        run: the controller running the job.
        kind: the setting.

    Attributes:
        profiling_off: why profiling is off in this run although the knob is on (a knob
            holding the clocks is registered); None: it is on.
        compared: under ``auto``, another knob is profiled after this one and the choice is
            made among both: this knob's profile ends without applying its own choice.
        value: the setting applied last in this run (None: none yet).
        static_value: the profile's choice in this run (None: none yet).
    """

    name: str
    holds_clocks: bool

    def __init__(self, run: SettingRun, kind: SettingKind) -> None:
        self.run = run
        self.kind = kind
        section = run.config.power_limit
        self.session = ProfilingSession(
            section.make_selector(), self._new_optimizer, settle_s=section.settle_s
        )
        self.profiling_off: str | None = None
        self.compared = False
        # SM clocks read at measured steps' ends, by (workload, setting): reports show the
        # average clock each setting ran at.
        self._clocks_mhz: dict[tuple[str, float], list[float]] = {}
        self.new_run()

    def new_run(self) -> None:
        """Forget the previous run's setting and window (what was learnt is kept)."""
        self.value: float | None = None
        self.static_value: float | None = None
        self.session.new_run()

    @property
    def _guard(self) -> GPUGuard:
        guard = self.run.run_guard
        assert guard is not None  # a run is set up
        return guard

    @property
    @abstractmethod
    def enabled(self) -> bool:
        """Whether this knob profiles and chooses in this job."""

    @abstractmethod
    def _new_optimizer(self) -> PowerLimitOptimizer:
        """The optimizer of a new workload, over this knob's candidates."""

    @abstractmethod
    def _change(self, value: float) -> float | None:
        """Apply ``value`` through the guard; what was applied, None when nothing was."""

    def _build_optimizer(
        self, candidates: list[float], warmup_steps: int | None = None
    ) -> PowerLimitOptimizer:
        """The optimizer of a new workload over ``candidates`` (the knob's unit), warming up
        ``warmup_steps`` (None: the configuration's)."""
        from lightning_energy.optimize.power_limit import PowerLimitOptimizer

        run = self.run
        section = run.config.power_limit
        devices = run.devices
        # The Zeus cost weighs time by the highest power limit of the GPUs (x every
        # GPU of the job), not the highest candidate, whatever the knob: the job's lowest,
        # so that every rank's selector chooses alike.
        top_w = min(g.power_limit_constraints_w()[1] for g in devices.gpus)
        # Every rank sizes its windows alike: by the slowest energy counter of the job.
        period = max(g.energy_counter_period_s() for g in devices.gpus)
        _, (period, neg_top_w) = run.collective.sum_and_max([], [period, -top_w])
        top_w = -neg_top_w
        self.session.counter_period_s = period
        return PowerLimitOptimizer(
            candidates,
            self.session.selector,
            max_power_limit_w=top_w,
            num_gpus=len(devices) * run.collective.world_size,
            warmup_steps=section.warmup_steps if warmup_steps is None else warmup_steps,
            settle_steps=section.settle_steps,
            seed=run.config.device.seed,
            counter_period_s=period,
            kind=self.kind,
        )

    def reuse_known_choice(self) -> None:
        """A workload profiled by an earlier run (or a checkpoint) gets its choice at once."""
        chosen = self.session.known_choice()
        if chosen is not None:
            self.use_choice(chosen, f"reuse profile of workload {self.session.workload}")

    # ------------------------------------------------------------------ steps
    def profiles(self) -> bool:
        """Whether this run profiles this knob (decided alike on every rank)."""
        return self.enabled and self.profiling_off is None and self.run.changes_settings()

    def step_start(self) -> None:
        """Open the next window when one is due, then (re)start measuring it."""
        session = self.session
        if session.window is None and self.profiles() and session.wants_window():
            window = session.open_window(self.run.clock())
            if window is None:
                self._finish_profile()
            else:
                self._apply_window(window.power_limit_w, window.purpose)
        now_s = self.run.clock()
        if session.resume(now_s):
            self.run.ledger.readings.resume(WINDOW)
        elif session.start_measuring(now_s):
            self.run.ledger.readings.begin(WINDOW)

    def step_end(self) -> None:
        """Count the step; report the window when it may be long enough."""
        if self.session.count_step():
            self._close_window()

    def pause_window(self, reason: str) -> None:
        """Something other than training runs next: a measuring window pauses (what runs
        until the next step start is left out of it)."""
        if self.session.pause():
            self.run.ledger.readings.pause(WINDOW)
            log.debug("profiling window paused: %s", reason)

    def discard_window(self, reason: str) -> None:
        """Discard the window in progress; its limit is measured again later."""
        if self.session.window is None:
            return
        self.run.ledger.readings.cancel(WINDOW)
        window = self.session.discard()
        assert window is not None
        log.debug(
            "profiling window at %s discarded: %s", self.kind.label(window.power_limit_w), reason
        )

    def _close_window(self) -> None:
        """Report the window once it is long enough; it goes on while it is too short for
        the energy counter (or read no energy yet). Every rank decides on the job-wide sums:
        a rank whose readings failed sends NaN, so every rank learns it in this collective;
        a rank observing a GPU that a lower rank measures sends 0 (each GPU counted once)."""
        run = self.run
        readings = run.ledger.readings
        m = readings.peek(WINDOW)
        if m is None:
            energy_j, duration_s = math.nan, math.nan
        else:
            energy_j = m.energy_j if run.counts_energy else 0.0
            duration_s = m.duration_s
        (energy_j,), (duration_s, throttled) = run.collective.sum_and_max(
            [energy_j], [duration_s, float(self._read_window())]
        )
        if math.isnan(energy_j):
            self._device_fault()
            return
        if throttled > 0:
            self._exclude_throttled()
        steps = self.session.window_steps
        progress = self.session.report(energy_j, duration_s)
        if progress is WindowProgress.MEASURING:
            return
        readings.cancel(WINDOW)
        if progress is WindowProgress.COMPLETE:
            self._finish_profile()
        else:
            self._check_profile_fits(duration_s / steps)

    def _read_window(self) -> bool:
        """At a measured step's end, while the GPUs are busy: record their SM clocks for
        the window's setting; whether the setting did not hold on one of them."""
        window = self.session.window
        assert window is not None
        readings = [r for r in map(_busy_clock, self.run.devices.gpus) if r is not None]
        clocks = self._clocks_mhz.setdefault((self.session.workload, window.power_limit_w), [])
        clocks.extend(float(c) for _, c in readings if c is not None)
        return any(self._throttled(reasons, clock) for reasons, clock in readings)

    def _throttled(self, reasons: int, clock_mhz: int | None) -> bool:
        """Whether a busy GPU's clock-event ``reasons`` and SM clock say the setting in
        force did not hold; a setting that holds by itself, like a power limit, always
        does."""
        return False

    def _exclude_throttled(self) -> None:
        """The window's setting did not hold on some rank: it is measured but never chosen."""
        window = self.session.window
        assert window is not None
        optimizer = self.session.optimizer()
        if window.power_limit_w in optimizer.excluded:
            return
        optimizer.exclude(window.power_limit_w)
        if self.run.collective.rank == 0:
            log.warning(
                "%s %s is throttled (power or thermal clock events, or the clock measured "
                "below it): it is profiled but never chosen.",
                self.kind.name.replace("_", " ").capitalize(),
                self.kind.label(window.power_limit_w),
            )

    def throttled(self) -> frozenset[float]:
        """The current workload's settings that did not hold (never chosen)."""
        return self.session.excluded()

    def _check_profile_fits(self, time_per_step_s: float) -> None:
        """Say once, at INFO, when the job is too short for its profile to finish, and what
        it would need (every rank decides alike; rank 0 says it)."""
        total = self.run.total_steps
        session = self.session
        if total is None or session.fit_warned:
            return
        step = self.run.ledger.step
        needed = session.optimizer().min_steps_left(time_per_step_s)
        if needed <= total - step:
            return
        session.fit_warned = True
        if self.run.collective.rank == 0:
            log.info(
                "The %s profile cannot finish in this run: %d steps are left and the "
                "limits not measured yet need at least %d more (at %.3f s per step, each "
                "window measures %.0f s or more so that the energy counter, which moves every "
                "%.2f s, tells settings apart within 1 %%). The GPUs are put back to their "
                "pre-job settings at the end; a run of at least %d steps profiles fully (a "
                "checkpoint carries the profile so far to a resumed run).",
                self.kind.name.replace("_", "-"),
                total - step,
                needed,
                time_per_step_s,
                session.optimizer().min_window_duration_s,
                session.counter_period_s,
                step + needed,
            )

    def _device_fault(self) -> None:
        """A GPU stopped answering in a profiling window (every rank sees the job-wide NaN):
        restore what can be restored now and only observe for the rest of the run; the
        window is measured again by a later run."""
        guard = self._guard
        ledger = self.run.ledger
        readings = ledger.readings
        self.session.stop()
        readings.cancel(WINDOW)
        error = readings.last_error or DeviceError(readings.error or "a GPU stopped answering")
        guard.stop_changes(f"a GPU failed mid-run ({error})", error)
        ledger.decide("observe-only", None, guard.observe_only_reason or str(error))

    def _finish_profile(self) -> None:
        session = self.session
        chosen = self.run.collective.broadcast(session.optimizer().chosen_power_limit_w)
        selector = session.selector.describe()
        profile = session.profile_by_limit()
        if chosen in profile:
            top_w = max(profile)
            (t, e), (t_top, e_top) = profile[chosen], profile[top_w]
            log.info(
                "%s profile complete after %d steps: %s chosen by the %s selector "
                "(%.1f %% less energy and %+.1f %% time per step than %s)%s",
                self.kind.name.replace("_", "-"),
                self.run.ledger.step,
                self.kind.label(chosen),
                selector,
                100.0 * (1.0 - e / e_top),
                100.0 * (t / t_top - 1.0),
                self.kind.label(top_w),
                "; not applied: the choice among both knobs follows" if self.compared else "",
            )
        if self.compared:
            self.static_value = chosen  # applied only if it wins (see ``compared``)
        else:
            self.use_choice(chosen, f"profile complete; selector {selector}")

    def use_choice(self, chosen: float | None, reason: str) -> None:
        """Apply the profile's choice (``chosen``, None: none) and start measuring the steps
        that run at it."""
        self.static_value = chosen
        run = self.run
        run.ledger.start_baselines(
            run.current_power_limit_w(), run.current_locked_clock_mhz(), run.now()
        )
        self._apply(chosen, reason)

    def _apply_window(self, value: float, purpose: str) -> None:
        """Apply a profiling window's setting."""
        self._apply(value, f"{purpose} window", purpose="profile")

    def _apply(self, value: float | None, reason: str, purpose: str = "choice") -> None:
        """Set ``value`` on every local GPU and record why.

        ``purpose`` tells reports what the change was for: ``profile`` (a profiling
        window), ``choice`` (the optimizer's or the carbon pace's setting), ``pause`` or
        ``resume``. Every decision is recorded, also one that keeps the setting already
        applied (the GPU is then left alone).
        """
        if value is None:
            return
        applied = self._set(value)
        if applied is not None:
            self.run.ledger.decide(self.kind.name, applied, reason, purpose)

    def _set(self, value: float) -> float | None:
        """Set ``value`` (unless already set); what was applied, None when observing."""
        guard = self._guard
        applied = self.value
        if value != applied:
            applied = self._change(value)
        if applied is None or guard.observe_only or guard.restored:
            return None
        self.value = applied
        return applied

    # ------------------------------------------------------------------ workloads
    def set_workload(self, key: str, *, reuse: bool = True) -> None:
        """A new key starts a new profile (or resumes the one saved for it); returning to a
        known key reuses its choice (unless not ``reuse``: the caller applies it)."""
        if key == self.session.workload:
            return
        self.discard_window("workload change")
        self.session.workload = key
        self.run.ledger.forget_baselines()
        if reuse:
            self.reuse_known_choice()

    # ------------------------------------------------------------------ carbon pace
    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """Rank 0: the measured profile, from the highest setting down (empty until the
        profile is complete)."""
        profile = self.session.profile_by_limit()
        return [(t, e, self.kind.label(p)) for p, (t, e) in sorted(profile.items(), reverse=True)]

    def apply_pace(self, scale: float) -> KnobDecision | None:
        """The least-energy setting meeting ``scale`` times the fastest measured step (chosen
        again from the profile, without profiling)."""
        from lightning_energy.optimize.selectors import make_selector

        profile = self.session.profile_by_limit()
        if not profile:
            return None
        target_s = scale * min(t for t, _ in profile.values())
        limit = self.session.optimizer().reselect(
            make_selector("target_time", target_time_s=target_s)
        )
        applied = self._set(limit)
        return None if applied is None else KnobDecision(self.kind.name, applied, "choice")

    # ------------------------------------------------------------------ results
    @property
    def profile_done(self) -> bool:
        """Whether the current workload's profile is complete."""
        return self.session.done

    def profile(self) -> list[dict[str, Any]]:
        """The current workload's measured profile so far, for reports: per setting, the
        job-wide time and energy per step and steps measured, the average SM clock this
        rank's GPUs ran at (None: not read) and whether the setting was throttled (never
        chosen). The setting is ``power_limit_w`` or ``locked_clock_mhz``."""
        throttled = self.throttled()
        clocks = self.average_clocks_mhz(self.session.workload)
        entries = []
        for entry in self.session.profile():
            setting = entry.pop("power_limit_w")
            entries.append(
                {
                    POWER_LIMIT_KEYS[self.kind.name]: setting,
                    **entry,
                    "sm_clock_mhz": clocks.get(setting),
                    "throttled": setting in throttled,
                }
            )
        return entries

    def average_clocks_mhz(self, workload: str) -> dict[float, float]:
        """The average SM clock this rank's GPUs ran at in the measured steps of each
        setting of ``workload`` (settings whose clock was never read are left out)."""
        return {
            setting: math.fsum(clocks) / len(clocks)
            for (key, setting), clocks in self._clocks_mhz.items()
            if key == workload and clocks
        }

    def profile_by_limit(self) -> Profile:
        """Measured (time, energy) per step by setting, once the profile is complete."""
        return self.session.profile_by_limit()

    def progress(self) -> tuple[bool, int, int] | None:
        """The profile of this run: ``(complete, settings measured, candidates)``; None when
        the knob is off (whether the run changed settings at all is the caller's)."""
        if not self.enabled or self.profiling_off is not None:
            return None
        return self.session.progress()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every workload's profile, the average SM clock each measured setting ran at (the
        locked clocks' candidates under ``auto``), and the current workload."""
        return {
            "workload": self.session.workload,
            "optimizers": self.session.state_dict(),
            "sm_clocks_mhz": [
                [workload, setting, math.fsum(clocks) / len(clocks)]
                for (workload, setting), clocks in self._clocks_mhz.items()
                if clocks
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any], *, running: bool) -> None:
        """Resume the profiles and the current workload; a complete one applies its
        choice at once when a run is set up."""
        rows = state.get("sm_clocks_mhz", [])
        if not (isinstance(rows, list) and all(_is_clock_row(row) for row in rows)):
            raise ProfileError(
                f"malformed {self.name} state: sm_clocks_mhz {str(rows)[:80]} is not allowed; "
                "use a list of [workload, setting, clock in MHz] rows of finite numbers"
            )
        self.discard_window("checkpoint restore")
        for workload, setting, clock_mhz in rows:
            self._clocks_mhz[(str(workload), float(setting))] = [float(clock_mhz)]
        self.session.load_state_dict(
            state.get("optimizers", {}), str(state.get("workload", "default"))
        )
        if running:
            self.resume_choice()

    def resume_choice(self) -> None:
        """In a run set up: apply the current workload's choice restored from a checkpoint
        (none when its profile is not complete)."""
        self.session.optimizer()
        chosen = self.session.known_choice()
        if chosen is not None:
            self.use_choice(chosen, "resumed from checkpoint")


def _is_clock_row(row: object) -> bool:
    """Whether a checkpoint's ``sm_clocks_mhz`` row is ``[workload, setting, clock]``."""
    return (
        isinstance(row, list)
        and len(row) == 3
        and isinstance(row[0], str)
        and is_finite(row[1])
        and is_finite(row[2])
    )
