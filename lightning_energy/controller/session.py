"""The profiling session: which power limit to measure next, and for how long.

Per workload (what is being trained: batch size, model), a
:class:`~lightning_energy.optimize.power_limit.PowerLimitOptimizer` hands out profiling
windows: a power limit, steps to settle at it, steps (and seconds) to measure. The session
counts the steps of the window in progress, reports the job-wide measurement back and
tells the coordinator where the window stands. It changes no GPU and reads none: the
coordinator applies the limits and measures.

A window spans epoch ends and validation: it is paused there (what runs in between is left
out) and measures the training steps on either side, so jobs whose epochs are shorter than
a window still finish profiling. It measures again only once training has run for one
energy-counter period after the boundary: a counter that moves every ~100 ms lags each
reading by up to a period, and a reading whose lag reaches back into the boundary (at
another power than training) would bias every stretch the same way.

Once a window has measured its steps, it is reported again only at steps where it may be
long enough (a few readings and collectives per window, not one at every step).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_energy.controller.records import Profile
    from lightning_energy.optimize.power_limit import PowerLimitOptimizer, Window
    from lightning_energy.optimize.selectors import Selector

__all__ = ["ProfilingSession", "WindowProgress"]

log = logging.getLogger(__name__)


class WindowProgress(enum.Enum):
    """Where a measured window stands once its steps have run."""

    MEASURING = "measuring"
    """Too short for the energy counter (or no energy read yet): it goes on."""
    REPORTED = "reported"
    """Measured and reported; the next window follows."""
    COMPLETE = "complete"
    """Measured and reported, and the profile is complete."""


class ProfilingSession:
    """The profiling-window state machine of one job, over its workloads.

    Args:
        selector: how the optimizer chooses among measured limits.
        build: makes the optimizer of a new workload (the coordinator knows the GPUs,
            their ranges and the ranks).
        settle_s: seconds a window waits after it opened (its limit was set) before
            measuring, besides its settle steps: a board applies a new limit only after
            a while.

    Attributes:
        counter_period_s: how often the job's energy counters move (the coordinator sets it
            when it builds an optimizer): training runs this long after a boundary before
            a window measures again.
        workload: the key of what is being trained.
        window: the window in progress (None: none).
    """

    def __init__(
        self,
        selector: Selector,
        build: Callable[[], PowerLimitOptimizer],
        settle_s: float = 0.0,
    ) -> None:
        self.selector = selector
        self.settle_s = settle_s
        self.counter_period_s = 0.0
        self._build = build
        self._optimizers: dict[str, PowerLimitOptimizer] = {}
        self._restored: dict[str, Any] = {}
        self.workload = "default"
        self.new_run()

    def new_run(self) -> None:
        """Forget the previous run's window; what was learnt about workloads is kept."""
        self.window: Window | None = None
        self.window_opened_s = 0.0
        self.window_steps = 0
        self.window_steps_run = 0
        self.measuring = False
        self.paused = False
        self.stopped = False
        self._boundary = False  # something other than training ran since the last step
        self._training_since_s: float | None = None
        self._report_at = 0
        self._zero_energy_warned = False
        self.fit_warned = False  # the run was said to be too short for its profile

    # ------------------------------------------------------------------ optimizers
    def optimizer(self) -> PowerLimitOptimizer:
        """The current workload's optimizer (built, or resumed from a checkpoint, on first use)."""
        optimizer = self._optimizers.get(self.workload)
        if optimizer is None:
            optimizer = self._build()
            saved = self._restored.pop(self.workload, None)
            if saved is not None:
                optimizer.load_state_dict(saved)
            self._optimizers[self.workload] = optimizer
        return optimizer

    def known_choice(self) -> float | None:
        """The current workload's chosen limit when an earlier run completed its profile."""
        optimizer = self._optimizers.get(self.workload)
        if optimizer is None or not optimizer.done:
            return None
        return optimizer.chosen_power_limit_w

    @property
    def done(self) -> bool:
        """Whether the current workload's profile is complete."""
        optimizer = self._optimizers.get(self.workload)
        return optimizer is not None and optimizer.done

    def profile_by_limit(self) -> Profile:
        """Measured (time, energy) per step by power limit, once the profile is complete."""
        optimizer = self._optimizers.get(self.workload)
        if optimizer is None or not optimizer.done:
            return {}
        return {
            m.power_limit_w: (m.time_per_step_s, m.energy_per_step_j) for m in optimizer.profile()
        }

    def excluded(self) -> frozenset[float]:
        """The current workload's settings never chosen (see the optimizer's ``exclude``)."""
        optimizer = self._optimizers.get(self.workload)
        return frozenset() if optimizer is None else optimizer.excluded

    def progress(self) -> tuple[bool, int, int] | None:
        """The current workload's profile: ``(complete, limits measured, candidates)``;
        None when no profile was started for it."""
        optimizer = self._optimizers.get(self.workload)
        if optimizer is None:
            return None
        return optimizer.done, len(optimizer.profile()), len(optimizer.power_limits_w)

    def profile(self) -> list[dict[str, float]]:
        """The measured profile of the current workload so far (job-wide numbers)."""
        optimizer = self._optimizers.get(self.workload)
        if optimizer is None:
            return []
        return [asdict(m) for m in optimizer.profile()]

    # ------------------------------------------------------------------ windows
    def wants_window(self) -> bool:
        """Whether a new window should open (none in progress, profile not complete)."""
        return self.window is None and not self.stopped and not self.optimizer().done

    def open_window(self, now_s: float) -> Window | None:
        """Start the optimizer's next window at ``now_s``; None once the profile is complete."""
        window = self.optimizer().next_window()
        if window is None:
            return None
        self.window = window
        self.window_opened_s = now_s
        self.window_steps = 0
        self.window_steps_run = 0
        self.measuring = False
        self.paused = False
        self._report_at = 0
        return window

    def start_measuring(self, now_s: float) -> bool:
        """Whether the window has settled (its steps and seconds) and measuring starts
        with the step starting at ``now_s``."""
        window = self.window
        if (
            window is None
            or self.measuring
            or not window.measure_steps
            or self._boundary
            or self.window_steps < window.settle_steps
            or now_s - self.window_opened_s < self.settle_s
        ):
            return False
        self.measuring = True
        self.window_steps = 0
        self._report_at = window.measure_steps
        return True

    def pause(self) -> bool:
        """Something other than training runs next (validation, an epoch's end): whether a
        measuring window pauses (the caller stops measuring it until :meth:`resume`). A
        window still settling keeps settling (its limit stays set), but starts measuring
        only once training has run for a counter period after the boundary."""
        self._boundary = True
        self._training_since_s = None
        if self.window is None or not self.measuring or self.paused:
            return False
        self.paused = True
        return True

    def resume(self, now_s: float) -> bool:
        """A training step starts at ``now_s``: whether a paused window measures again
        from now on (training has run for a counter period since the boundary)."""
        if not self._boundary:
            return False
        if self._training_since_s is None:
            self._training_since_s = now_s
        if now_s - self._training_since_s < self.counter_period_s:
            return False
        self._boundary = False
        if not self.paused:
            return False
        self.paused = False
        return True

    def count_step(self) -> bool:
        """Count a step of the window; whether its measured steps may be reported now.

        The warm-up window (nothing measured) is reported here once it has settled.
        """
        window = self.window
        if window is None:
            return False
        self.window_steps_run += 1
        if self.paused:
            return False
        self.window_steps += 1
        if self.measuring:
            return self.window_steps >= self._report_at
        if not window.measure_steps and self.window_steps >= window.settle_steps:
            self.optimizer().report(window, time_per_step_s=0.0, energy_per_step_j=0.0)
            self.window = None
        return False

    def report(self, energy_j: float, duration_s: float) -> WindowProgress:
        """Report the window's job-wide measurement once it is long enough.

        A window too short for the energy counter (or that read no energy yet) goes on,
        step by step.

        Args:
            energy_j: energy of every GPU of the job over the measured steps.
            duration_s: the slowest rank's time for them.
        """
        window = self.window
        assert window is not None
        steps = self.window_steps
        if duration_s < window.min_duration_s:
            # Halfway to the step where the window should be long enough at the steps'
            # pace: a few readings per window, and it runs no longer than it needs to
            # when the first steps' pace was off (they may run at the previous limit).
            pace = steps * window.min_duration_s / duration_s if duration_s > 0 else steps
            self._report_at = steps + max(1, math.ceil((pace - steps) / 2))
            return WindowProgress.MEASURING
        if energy_j <= 0:
            self._report_at = steps + 1
            if not self._zero_energy_warned:
                self._zero_energy_warned = True
                log.warning(
                    "A %.3f s profiling window read no energy (the GPU energy counter has not "
                    "moved yet): measuring on until it does.",
                    duration_s,
                )
            return WindowProgress.MEASURING
        optimizer = self.optimizer()
        optimizer.report(
            window,
            time_per_step_s=duration_s / steps,
            energy_per_step_j=energy_j / steps,
            steps=steps,
        )
        self.window = None
        self.measuring = False
        self.paused = False
        return WindowProgress.COMPLETE if optimizer.done else WindowProgress.REPORTED

    def discard(self) -> Window | None:
        """Discard the window in progress (its limit is measured again): the workload or the
        profile changed, or the run ends; the window, or None."""
        window = self.window
        if window is None:
            return None
        self.optimizer().report_interrupted(window, steps_run=self.window_steps_run)
        self.window = None
        self.measuring = False
        self.paused = False
        self.window_steps = 0
        return window

    def stop(self) -> None:
        """A GPU stopped answering: discard the window and profile no more in this run."""
        if self.window is not None:
            self.optimizer().report_interrupted(self.window, steps_run=self.window_steps_run)
        self.window = None
        self.measuring = False
        self.paused = False
        self.stopped = True

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every workload's optimizer state (those not resumed yet included)."""
        states = dict(self._restored)
        states.update({k: o.state_dict() for k, o in self._optimizers.items()})
        return states

    def load_state_dict(self, states: Mapping[str, Any], workload: str) -> None:
        """Resume the workloads' optimizers (each on its first use) and the current one."""
        self._optimizers.clear()
        self._restored = dict(states)
        self.workload = workload
