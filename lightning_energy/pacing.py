"""Carbon-aware pacing: the link between the grid and the power-limit choice.

Rank 0 owns a :class:`CarbonPacer`: a :class:`carbon.monitor.CarbonMonitor` polling the
configured provider and a :mod:`carbon.policy` policy. At fixed step boundaries the
controller asks it for a :class:`PaceUpdate` (intensity now, target scale, pause or not)
and broadcasts it, so every rank applies the same setting; nothing on the training thread
waits for the network, since the monitor answers from memory, nor for the policy: on the
wall clock a decision (a plan over every interval up to the deadline, up to seconds of
CPU for a deadline days away) is made by a background thread
(``lightning-energy-pace-planner``) from the inputs of the boundary that asked for it, and
the first boundary after it is ready applies it. Until the first plan is ready the
optimizer's own choice holds. While paused, the pause loop waits for its decision (no
step is held up then).

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
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from carbon.config import CarbonConfig
    from carbon.monitor import CarbonMonitor
    from carbon.policy import JobProgress, OperatingPoint, PacingDecision, Policy
    from carbon.providers.base import IntensityPoint

__all__ = ["CarbonPacer", "PaceUpdate"]

log = logging.getLogger(__name__)

#: How long :meth:`CarbonPacer.start` waits for the first poll of a provider that makes no
#: HTTP request (a trace, a constant), on a real clock.
_LOCAL_POLL_WAIT_S = 5.0

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


@dataclass(frozen=True)
class _Request:
    """The inputs of one policy decision, taken at the boundary that asked for it."""

    progress: JobProgress
    intensity_g_per_kwh: float
    forecast: list[IntensityPoint]
    history: list[IntensityPoint]
    points: list[OperatingPoint]
    idle_power_w: float


class _Planner:
    """Makes one policy decision at a time on a background thread.

    Args:
        decide: the decision of a request (runs on the thread).
    """

    def __init__(self, decide: Callable[[_Request], PacingDecision]) -> None:
        self._decide = decide
        self._cond = threading.Condition()
        self._request: _Request | None = None
        self._result: PacingDecision | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def submit(self, request: _Request) -> None:
        """Decide ``request`` in the background (one at a time: the caller waits for the
        result of the previous one before submitting)."""
        with self._cond:
            self._request = request
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="lightning-energy-pace-planner", daemon=True
            )
            self._thread.start()

    def take(self, *, wait: bool) -> PacingDecision | None:
        """The finished decision (once), or None while it is being made; ``wait``: block
        until it is made.

        Raises:
            Exception: what the decision raised.
        """
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: self._request is None or self._stopping)
            result, self._result = self._result, None
            error, self._error = self._error, None
        if error is not None:
            raise error
        return result

    def stop(self) -> None:
        """Stop the thread and wait for it (a decision in progress is finished first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._request is not None or self._stopping)
                if self._stopping:
                    return
                request = self._request
            assert request is not None
            result: PacingDecision | None = None
            error: BaseException | None = None
            try:
                result = self._decide(request)
            except Exception as exc:  # handed to the training thread
                error = exc
            with self._cond:
                self._result, self._error, self._request = result, error, None
                self._cond.notify_all()


class CarbonPacer:
    """Grid intensity and the pacing policy of one job (rank 0 only).

    Args:
        config: the ``carbon:`` section.
        now: the job's current time (UTC).
        virtual_clock: True when ``now`` follows a simulated GPU's virtual clock: decisions
            are then made at once (no wall time passes in the job while they are made);
            on the wall clock they are made in the background.

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
        self._planner = None if virtual_clock else _Planner(self._decide)
        self._planning = False
        # (remaining steps, the job's grams) at the policy's first decision of this work.
        self._emitted_origin: tuple[int, float] | None = None

    @property
    def pacing(self) -> bool:
        """Whether a deadline (or allowed slowdown) was given, so the pace may change."""
        return self.config.deadline is not None or self.config.max_slowdown is not None

    def start(self) -> None:
        """Poll once now, then keep polling (in the background on a real clock).

        On a real clock the first poll runs in the background, and this waits for it as
        long as one request to the provider may take (its connect and read timeouts, no
        retries): the intensity read next charges the run's first logging interval, and
        should be the grid's, not the fallback of a poll on its way. A slower provider
        leaves the fallback there, as before; training is never held longer."""
        from carbon.providers.base import HttpProvider

        if self._poll_on_clock:
            self._poll_local()
            return
        self.monitor.start()
        provider = self.monitor.provider
        one_request_s = sum(provider.timeout_s) if isinstance(provider, HttpProvider) else 0.0
        self.monitor.wait_for_first_poll(max(one_request_s, _LOCAL_POLL_WAIT_S))

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
        """Stop polling and planning (idempotent; leaves no thread)."""
        self.monitor.stop()
        if self._planner is not None:
            self._planner.stop()

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
        wait: bool = False,
    ) -> PaceUpdate:
        """The pace until the next update (re-decided once per ``poll_interval_s``).

        The policy holds the setting it chooses for the whole interval, as the training
        side runs it: one power limit (the least energy that meets the target) or a pause.
        A pause is decided again at once when ``idle_power_w`` changes (the pause measured
        it). On the wall clock a decision due is made in the background from these inputs
        and applies from the first update after it is ready; meanwhile the last one holds
        (before the first: no pacing).

        Args:
            remaining_steps: steps still to train (None: unknown, so no pacing).
            frontier: measured (time per step, energy per step, label) points.
            idle_power_w: job-wide power drawn while paused (measured once paused).
            emitted_g: the job's measured grams so far; the policy weighs those emitted
                since its first decision against the carbon-unaware run's.
            wait: wait for a decision being made (the pause loop: no step is held up).
        """
        intensity = self.intensity_g_per_kwh()
        if remaining_steps is None or not frontier or self.deadline is None:
            return PaceUpdate(intensity, None, False, "no deadline: carbon accounting only")
        self._take(wait=False)
        previous = self._last
        due = not self._planning and (
            previous is None
            or self._elapsed_s() >= self._next_decision_s
            or (previous.pause and idle_power_w != self._decided_idle_w)
        )
        if due:
            request = self._request(remaining_steps, frontier, idle_power_w, emitted_g, intensity)
            self._next_decision_s = self._elapsed_s() + self.config.poll_interval_s
            self._decided_idle_w = idle_power_w
            if self._planner is None:
                self._adopt(self._decide(request))
            else:
                self._planner.submit(request)
                self._planning = True
        if wait:
            self._take(wait=True)
        last = self._last
        if last is None:
            return PaceUpdate(intensity, None, False, "planning the pace")
        return PaceUpdate(intensity, last.scale, last.pause, last.reason)

    def _request(
        self,
        remaining_steps: int,
        frontier: Sequence[tuple[float, float, str]],
        idle_power_w: float,
        emitted_g: float | None,
        intensity: float,
    ) -> _Request:
        """The inputs of a decision, as they are at this boundary."""
        from carbon.policy import JobProgress, OperatingPoint

        since_g = None
        if emitted_g is not None:
            # Counted from the first decision, afresh when the work grows (a new policy run).
            last = self._emitted_origin
            origin_g = emitted_g if last is None or remaining_steps > last[0] else last[1]
            self._emitted_origin = (remaining_steps, origin_g)
            since_g = max(emitted_g - origin_g, 0.0)
        assert self.deadline is not None
        return _Request(
            JobProgress(remaining_steps, self._now(), self.deadline, emitted_g=since_g),
            intensity,
            self.monitor.forecast(),
            self.monitor.history(),
            [OperatingPoint(t, e, label) for t, e, label in frontier],
            idle_power_w,
        )

    def _decide(self, request: _Request) -> PacingDecision:
        """The policy's decision (on the background thread on the wall clock)."""
        # The intensities seen so far continue a short forecast (daily seasonality).
        self.policy.observe(request.history)
        return self.policy.decide(
            request.progress,
            request.intensity_g_per_kwh,
            request.forecast,
            request.points,
            idle_power_w=request.idle_power_w,
        )

    def _adopt(self, decision: PacingDecision) -> None:
        """Hold ``decision`` until the next one (the intensity is filled in per update)."""
        scale = decision.scale * (1.0 + _TARGET_SLACK)
        self._last = PaceUpdate(math.nan, scale, decision.pause, decision.reason)

    def _take(self, *, wait: bool) -> None:
        """Adopt the background decision once it is made (raising what it raised)."""
        if self._planner is None or not self._planning:
            return
        try:
            decision = self._planner.take(wait=wait)
        except Exception:
            self._planning = False
            raise
        if decision is not None:
            self._planning = False
            self._adopt(decision)

    def summary(self, finished_at: datetime) -> dict[str, Any]:
        """Where the intensities came from (provider, region, emission factor, the forecast
        asked for and how far the last one reached) and the deadline facts, for the run
        summary."""
        return {
            "provider": self.config.provider,
            "region": self.config.region,
            "emission_factor": self.config.emission_factor_reported,
            "policy": self.config.policy,
            "forecast_horizon_s": self.config.forecast_horizon_s,
            "forecast_reach_s": self.monitor.forecast_reach_s,
            "deadline": self.deadline.isoformat() if self.deadline else None,
            "finished": finished_at.isoformat(),
            "deadline_met": None if self.deadline is None else finished_at <= self.deadline,
        }


def utc_now() -> datetime:
    """The wall-clock time in UTC."""
    return datetime.now(timezone.utc)
