"""The power limit: the controller's built-in knob.

:class:`PowerLimitKnob` profiles the job's candidate limits in windows of training steps
(the :class:`~lightning_energy.controller.session.ProfilingSession` decides which limit is
measured next and for how long; the
:class:`~lightning_energy.optimize.power_limit.PowerLimitOptimizer` of the workload
chooses), applies the selector's choice, and moves the limit when the carbon pace asks for
a slower or faster step. Every change goes through the run's guard and is recorded in its
ledger. The knob keeps what was learnt about workloads across runs (a later fit of a known
workload applies its choice without profiling again).

It is the one knob every job has; its profiling is off when power limits are off in the
configuration, when the job only observes, or while a knob that holds the clocks is
registered (see :mod:`~lightning_energy.controller.knobs`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from lightning_energy.controller.knobs import KnobDecision
from lightning_energy.controller.readings import WINDOW
from lightning_energy.controller.session import ProfilingSession, WindowProgress
from lightning_energy.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    from lightning_energy.collectives import Collective
    from lightning_energy.config import EnergyConfig
    from lightning_energy.controller.ledger import RunLedger
    from lightning_energy.controller.records import Profile
    from lightning_energy.device.base import DeviceSet
    from lightning_energy.device.guard import GPUGuard
    from lightning_energy.optimize.power_limit import PowerLimitOptimizer

__all__ = ["PowerLimitKnob", "PowerLimitRun"]

log = logging.getLogger(__name__)


class PowerLimitRun(Protocol):
    """What the power-limit knob uses of the run it belongs to (the controller)."""

    config: EnergyConfig

    @property
    def devices(self) -> DeviceSet: ...

    @property
    def collective(self) -> Collective: ...

    @property
    def run_guard(self) -> GPUGuard | None: ...

    @property
    def ledger(self) -> RunLedger: ...

    @property
    def counts_energy(self) -> bool: ...

    @property
    def total_steps(self) -> int | None: ...

    def changes_settings(self) -> bool: ...

    def now(self) -> datetime: ...

    def clock(self) -> float: ...


class PowerLimitKnob:
    """Profiles, chooses and paces the power limit of a job's GPUs.

    Args:
        run: the controller running the job.

    Attributes:
        profiling_off: why power-limit profiling is off in this run although power limits
            are on (a knob holding the clocks is registered); None: it is on.
    """

    name = "power_limit"
    holds_clocks = False

    def __init__(self, run: PowerLimitRun) -> None:
        self.run = run
        section = run.config.power_limit
        self.session = ProfilingSession(
            section.make_selector(), self._new_optimizer, settle_s=section.settle_s
        )
        self.profiling_off: str | None = None
        self.new_run()

    def new_run(self) -> None:
        """Forget the previous run's limits and window (what was learnt is kept)."""
        self.power_limit_w: float | None = None
        self.static_limit_w: float | None = None
        self._enforced_limit_w: float | None = None
        self.session.new_run()

    @property
    def _guard(self) -> GPUGuard:
        guard = self.run.run_guard
        assert guard is not None  # a run is set up
        return guard

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

    def reuse_known_choice(self) -> None:
        """A workload profiled by an earlier run (or a checkpoint) gets its choice at once."""
        chosen = self.session.known_choice()
        if chosen is not None:
            self._use_profile(chosen, f"reuse profile of workload {self.session.workload}")

    def _new_optimizer(self) -> PowerLimitOptimizer:
        from lightning_energy.optimize.power_limit import PowerLimitOptimizer

        run = self.run
        section = run.config.power_limit
        devices = run.devices
        lo, hi = self.limit_range()
        # The Zeus cost weighs time by the highest power limit of the GPUs (x every
        # GPU of the job), not the highest candidate.
        top_w = min(g.power_limit_constraints_w()[1] for g in devices.gpus)
        # Every rank sizes its windows alike: by the slowest energy counter of the job.
        period = max(g.energy_counter_period_s() for g in devices.gpus)
        _, (period,) = run.collective.sum_and_max([], [period])
        self.session.counter_period_s = period
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
        return PowerLimitOptimizer(
            candidates,
            self.session.selector,
            max_power_limit_w=top_w,
            num_gpus=len(devices) * run.collective.world_size,
            warmup_steps=section.warmup_steps,
            settle_steps=section.settle_steps,
            seed=run.config.device.seed,
            counter_period_s=period,
        )

    def limit_range(self) -> tuple[float, float]:
        """The range every local GPU accepts, capped at the lowest pre-job limit and at a
        board or rack limiter below it."""
        guard, devices = self._guard, self.run.devices
        los, his = zip(*(g.power_limit_constraints_w() for g in devices.gpus), strict=True)
        pre = [guard.pre_job_power_limit_w(i) for i in range(len(devices))]
        enforced = [] if self._enforced_limit_w is None else [self._enforced_limit_w]
        return max(los), min(*his, *pre, *enforced)

    # ------------------------------------------------------------------ steps
    def profiles(self) -> bool:
        """Whether this run profiles power limits (decided alike on every rank)."""
        return self.enabled and self.profiling_off is None and self.run.changes_settings()

    def step_start(self) -> None:
        """Open the next window when one is due, then (re)start measuring it."""
        session = self.session
        if session.window is None and self.profiles() and session.wants_window():
            window = session.open_window(self.run.clock())
            if window is None:
                self._finish_profile()
            else:
                self._apply(window.power_limit_w, f"{window.purpose} window", purpose="profile")
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
        log.debug("profiling window at %.0f W discarded: %s", window.power_limit_w, reason)

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
        (energy_j,), (duration_s,) = run.collective.sum_and_max([energy_j], [duration_s])
        if math.isnan(energy_j):
            self._device_fault()
            return
        steps = self.session.window_steps
        progress = self.session.report(energy_j, duration_s)
        if progress is WindowProgress.MEASURING:
            return
        readings.cancel(WINDOW)
        if progress is WindowProgress.COMPLETE:
            self._finish_profile()
        else:
            self._check_profile_fits(duration_s / steps)

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
                "The power-limit profile cannot finish in this run: %d steps are left and the "
                "limits not measured yet need at least %d more (at %.3f s per step, each "
                "window measures %.0f s or more so that the energy counter, which moves every "
                "%.2f s, tells limits apart within 1 %%). The GPUs are put back to their "
                "pre-job limits at the end; a run of at least %d steps profiles fully (a "
                "checkpoint carries the profile so far to a resumed run).",
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
                "power-limit profile complete after %d steps: %.0f W chosen by the %s "
                "selector (%.1f %% less energy and %+.1f %% time per step than %.0f W)",
                self.run.ledger.step,
                chosen,
                selector,
                100.0 * (1.0 - e / e_top),
                100.0 * (t / t_top - 1.0),
                top_w,
            )
        self._use_profile(chosen, f"profile complete; selector {selector}")

    def _use_profile(self, chosen: float | None, reason: str) -> None:
        """Apply the profile's choice and start measuring the steps that run at it."""
        self.static_limit_w = chosen
        self.run.ledger.start_baselines(self.power_limit_w, self.run.now())
        self._apply(chosen, reason)

    def _apply(self, power_limit_w: float | None, reason: str, purpose: str = "choice") -> None:
        """Set the power limit on every local GPU and record why.

        ``purpose`` tells reports what the change was for: ``profile`` (a profiling
        window), ``choice`` (the optimizer's or the carbon pace's limit), ``pause`` or
        ``resume``. Every decision is recorded, also one that keeps the limit already
        set (the GPU is then left alone).
        """
        if power_limit_w is None:
            return
        applied = self._set(power_limit_w)
        if applied is not None:
            self.run.ledger.decide("power_limit", applied, reason, purpose)

    def _set(self, power_limit_w: float) -> float | None:
        """Set the limit (unless already set); what was applied, None when observing."""
        guard = self._guard
        applied = self.power_limit_w
        if power_limit_w != applied:
            applied = guard.set_power_limit_w(power_limit_w)
        if guard.observe_only or guard.restored:
            return None
        self.power_limit_w = applied
        return applied

    # ------------------------------------------------------------------ workloads
    def set_workload(self, key: str) -> None:
        """A new key starts a new profile (or resumes the one saved for it); returning to a
        known key reuses its choice."""
        if key == self.session.workload:
            return
        self.discard_window("workload change")
        self.session.workload = key
        self.run.ledger.forget_baselines()
        self.reuse_known_choice()

    # ------------------------------------------------------------------ carbon pace
    def pace_frontier(self) -> list[tuple[float, float, str]]:
        """Rank 0: the measured profile, from the highest limit down (empty until the
        profile is complete)."""
        profile = self.session.profile_by_limit()
        return [(t, e, f"{p:g} W") for p, (t, e) in sorted(profile.items(), reverse=True)]

    def apply_pace(self, scale: float) -> KnobDecision | None:
        """The least-energy limit meeting ``scale`` times the fastest measured step (chosen
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
        return None if applied is None else KnobDecision("power_limit", applied, "choice")

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

    # ------------------------------------------------------------------ results
    @property
    def profile_done(self) -> bool:
        """Whether the current workload's profile is complete."""
        return self.session.done

    def profile_by_limit(self) -> Profile:
        """Measured (time, energy) per step by limit, once the profile is complete."""
        return self.session.profile_by_limit()

    def progress(self) -> tuple[bool, int, int] | None:
        """The profile of this run: ``(complete, limits measured, candidates)``; None when
        power limits are off (whether the run changed settings at all is the caller's)."""
        if not self.enabled or self.profiling_off is not None:
            return None
        return self.session.progress()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every workload's profile, and the current workload."""
        return {"workload": self.session.workload, "optimizers": self.session.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], *, running: bool) -> None:
        """Resume the profiles and the current workload; a complete one applies its
        choice at once when a run is set up."""
        self.discard_window("checkpoint restore")
        self.session.load_state_dict(
            state.get("optimizers", {}), str(state.get("workload", "default"))
        )
        if running:
            self.session.optimizer()
            chosen = self.session.known_choice()
            if chosen is not None:
                self._use_profile(chosen, "resumed from checkpoint")
