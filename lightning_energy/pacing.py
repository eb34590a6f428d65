"""Carbon-aware pacing: the link between the grid and the power-limit choice.

Rank 0 owns a :class:`CarbonPacer`: a :class:`carbon.monitor.CarbonMonitor` polling the
configured provider and a :mod:`carbon.policy` policy. At fixed step boundaries the
controller asks it for a :class:`PaceUpdate` (intensity now, target scale, pause or not)
and broadcasts it, so every rank applies the same setting; nothing on the training thread
waits for the network, since the monitor answers from memory.

Time: a real GPU runs on the wall clock. A simulated GPU runs on a virtual clock, so the
job's "now" is the start time plus the virtual seconds elapsed; a trace or constant
provider is then polled on that clock (the monitor's ``poll_now``, which reads local data
only), so a day of grid data passes in as many seconds as the simulated steps take. There
it is read again as soon as the value read stops being in force, so every logging interval
is charged at the value in force when it starts. On the wall clock it is charged at the
monitor's latest value, which the monitor polls anew as soon as it is asked after that
value's interval has ended (see :class:`carbon.monitor.CarbonMonitor`).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from carbon.config import CarbonConfig
    from carbon.monitor import CarbonMonitor
    from carbon.policy import Policy

__all__ = ["CarbonPacer", "PaceUpdate"]

log = logging.getLogger(__name__)

#: Providers that read local data, so polling them on a virtual clock costs nothing.
_LOCAL_PROVIDERS = ("trace", "constant")

#: The scale sent to the training side sits this hair (relative) above the policy's, so that
#: rounding never makes the operating point the policy chose miss its own target.
_TARGET_SLACK = 1e-9


@dataclass(frozen=True)
class PaceUpdate:
    """What rank 0 broadcasts at a pacing boundary.

    Attributes:
        intensity_g_per_kwh: grid intensity now.
        scale: target time per step over the fastest measured step time (None: no
            pacing, keep the optimizer's own choice).
        pause: wait at the lowest power limit until the next update.
        reason: why, for logs and reports.
    """

    intensity_g_per_kwh: float
    scale: float | None
    pause: bool
    reason: str


class CarbonPacer:
    """Grid intensity and the pacing policy of one job (rank 0 only).

    Args:
        config: the ``carbon:`` section.
        now: the job's current time (UTC).
        virtual_clock: True when ``now`` follows a simulated GPU's virtual clock.

    Raises:
        CarbonConfigError: the provider or policy cannot be built (missing token, ...).
    """

    def __init__(
        self, config: CarbonConfig, *, now: Callable[[], datetime], virtual_clock: bool
    ) -> None:
        from carbon.config import build_monitor
        from carbon.policy import make_policy

        self.config = config
        self._now = now
        self._poll_on_clock = virtual_clock and config.provider in _LOCAL_PROVIDERS
        self.monitor: CarbonMonitor = build_monitor(config, now=now)
        self.policy: Policy = make_policy(
            config.policy, allow_pause=config.allow_pause, interval_s=config.poll_interval_s
        )
        self.start_time = now()
        self.deadline: datetime | None = None
        if isinstance(config.deadline, datetime):
            self.deadline = config.deadline
        elif isinstance(config.deadline, timedelta):
            self.deadline = self.start_time + config.deadline
        self._observed_s: list[float] = []
        self._observed_g: list[float] = []
        self._next_poll_s = 0.0
        self._next_decision_s = 0.0
        self._last: PaceUpdate | None = None
        self._decided_idle_w: float | None = None
        # (remaining steps, the job's grams) at the policy's first decision of this work.
        self._emitted_origin: tuple[int, float] | None = None

    @property
    def pacing(self) -> bool:
        """Whether a deadline (or allowed slowdown) was given, so the pace may change."""
        return self.config.deadline is not None or self.config.max_slowdown is not None

    def start(self) -> None:
        """Poll once now, then keep polling (in the background on a real clock)."""
        if self._poll_on_clock:
            self._poll_local()
        else:
            self.monitor.start()

    def _poll_local(self) -> None:
        """Read local data on the virtual clock; read it again after ``poll_interval_s``
        or as soon as the value read stops being in force (where the data's next interval
        starts, asked of the provider itself, with or without a forecast fetched),
        whichever comes first, so no value is held past its end."""
        self.monitor.poll_now()
        now = self._now()
        until_s = self.config.poll_interval_s
        ahead = self.monitor.provider.forecast(until_s)
        ends = [p.time for p in ahead if p.time > now]
        if ends:
            until_s = min(until_s, (min(ends) - now).total_seconds())
        self._next_poll_s = self._elapsed_s() + until_s

    def stop(self) -> None:
        """Stop polling (idempotent; leaves no thread)."""
        self.monitor.stop()

    def _elapsed_s(self) -> float:
        return (self._now() - self.start_time).total_seconds()

    def intensity_g_per_kwh(self) -> float:
        """The latest intensity (answered from memory)."""
        if self._poll_on_clock and self._elapsed_s() >= self._next_poll_s:
            self._poll_local()
        value = self.monitor.latest().intensity_g_per_kwh
        t = self._now().timestamp()
        if not self._observed_s or t > self._observed_s[-1]:
            self._observed_s.append(t)
            self._observed_g.append(value)
        return value

    def emissions_at_pace(
        self, start: datetime, steps: int, time_per_step_s: float, energy_per_step_j: float
    ) -> list[tuple[float, float]]:
        """Cumulative grams of a counterfactual run at a constant pace, on the intensities
        observed during the job (each held until the next observation).

        Args:
            start: when the counterfactual run starts.
            steps: how many steps it runs.
            time_per_step_s: its time per step.
            energy_per_step_j: its energy per step.

        Returns:
            (seconds since the job's start, cumulative grams) after every step.
        """
        from carbon.accounting import emissions_g

        out: list[tuple[float, float]] = []
        grams = 0.0
        t0 = start.timestamp()
        offset_s = (start - self.start_time).total_seconds()
        for k in range(steps):
            i = max(bisect.bisect_right(self._observed_s, t0 + k * time_per_step_s) - 1, 0)
            grams += emissions_g(energy_per_step_j, self._observed_g[i])
            out.append((offset_s + (k + 1) * time_per_step_s, grams))
        return out

    def fix_deadline(self, total_steps: int, fastest_time_per_step_s: float) -> None:
        """Turn ``max_slowdown`` into a deadline once the fastest step time is measured."""
        if self.deadline is not None or self.config.max_slowdown is None:
            return
        from carbon.policy import deadline_from_max_slowdown

        self.deadline = deadline_from_max_slowdown(
            self.start_time, total_steps, fastest_time_per_step_s, self.config.max_slowdown
        )
        log.info(
            "carbon pacing: deadline %s (max_slowdown %g)", self.deadline, self.config.max_slowdown
        )

    def update(
        self,
        remaining_steps: int | None,
        frontier: Sequence[tuple[float, float, str]],
        idle_power_w: float,
        *,
        emitted_g: float | None = None,
    ) -> PaceUpdate:
        """The pace until the next update (re-decided once per ``poll_interval_s``).

        The policy holds the setting it chooses for the whole interval, as the training
        side runs it: one power limit (the least energy that meets the target) or a pause.
        A pause is decided again at once when ``idle_power_w`` changes (the pause measured
        it).

        Args:
            remaining_steps: steps still to train (None: unknown, so no pacing).
            frontier: measured (time per step, energy per step, label) points.
            idle_power_w: job-wide power drawn while paused (measured once paused).
            emitted_g: the job's measured grams so far; the policy weighs those emitted
                since its first decision against the carbon-unaware run's.
        """
        intensity = self.intensity_g_per_kwh()
        if remaining_steps is None or not frontier or self.deadline is None:
            return PaceUpdate(intensity, None, False, "no deadline: carbon accounting only")
        previous = self._last
        if (
            previous is not None
            and self._elapsed_s() < self._next_decision_s
            and not (previous.pause and idle_power_w != self._decided_idle_w)
        ):
            return PaceUpdate(intensity, previous.scale, previous.pause, previous.reason)
        from carbon.policy import JobProgress, OperatingPoint

        points = [OperatingPoint(t, e, label) for t, e, label in frontier]
        # The intensities seen so far continue a short forecast (daily seasonality).
        self.policy.observe(self.monitor.history())
        since_g = None
        if emitted_g is not None:
            # Counted from the first decision, afresh when the work grows (a new policy run).
            last = self._emitted_origin
            origin_g = emitted_g if last is None or remaining_steps > last[0] else last[1]
            self._emitted_origin = (remaining_steps, origin_g)
            since_g = max(emitted_g - origin_g, 0.0)
        decision = self.policy.decide(
            JobProgress(remaining_steps, self._now(), self.deadline, emitted_g=since_g),
            intensity,
            self.monitor.forecast(),
            points,
            idle_power_w=idle_power_w,
        )
        self._next_decision_s = self._elapsed_s() + self.config.poll_interval_s
        self._decided_idle_w = idle_power_w
        scale = decision.scale * (1.0 + _TARGET_SLACK)
        self._last = PaceUpdate(intensity, scale, decision.pause, decision.reason)
        return self._last

    def summary(self, finished_at: datetime) -> dict[str, Any]:
        """Deadline facts for the run summary."""
        return {
            "provider": self.config.provider,
            "region": self.config.region,
            "policy": self.config.policy,
            "deadline": self.deadline.isoformat() if self.deadline else None,
            "finished": finished_at.isoformat(),
            "deadline_met": None if self.deadline is None else finished_at <= self.deadline,
        }


def utc_now() -> datetime:
    """The wall-clock time in UTC."""
    return datetime.now(timezone.utc)
