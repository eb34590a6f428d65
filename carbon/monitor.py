"""CarbonMonitor: poll a provider in the background, answer instantly from memory.

An APScheduler ``BackgroundScheduler`` job polls the provider every ``poll_interval_s``
(the first poll right after :meth:`CarbonMonitor.start`, in the background) and keeps the
latest value, the forecast and the values seen so far. :meth:`CarbonMonitor.latest` never
touches the network: it reads memory under a lock held for microseconds. When the value
it holds stops being in force (the forecast's next interval has begun) before the next
poll is due, the first :meth:`~CarbonMonitor.latest` after that asks for one poll at once,
in the background, so the new interval's value is not served late by up to a polling
period; if the provider has not published it yet, the scheduled polls pick it up.

When polls fail, the last good value is served (status ``stale``) until it is
``max_staleness_s`` old; then the fallback (status ``fallback``): a constant, or a daily
profile learnt from the values seen so far. One WARNING is logged when an outage starts
and one INFO when it ends, however many polls fail in between. A poll still running when
the next one is due starts an outage too (polls never overlap; those due meanwhile are
skipped quietly), and a rate limit's ``Retry-After`` holds back every poll until then.

Example:
    >>> from carbon.providers.constant import ConstantProvider
    >>> with CarbonMonitor(ConstantProvider(120.0), poll_interval_s=60) as monitor:
    ...     reading = monitor.poll_now()
    >>> reading.intensity_g_per_kwh, reading.status.value
    (120.0, 'fresh')
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from types import TracebackType
from typing import Literal

import numpy as np
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from carbon.errors import CarbonConfigError, QuotaError
from carbon.forecast import DailyProfileForecaster, forecast_reach_s, interval_ends_s
from carbon.providers.base import CarbonProvider
from carbon.types import IntensityPoint, Reading, ReadingStatus

__all__ = ["CarbonMonitor"]

#: Runs of the polling job that may be in flight or queued at once (one hung poll, the
#: rest returning at once because the poll lock is taken).
_MAX_QUEUED_RUNS = 16

logger = logging.getLogger(__name__)

#: The longest ``Retry-After`` the monitor waits for before polling again (one day).
MAX_HOLD_BACK_S = 86400.0


def _turn_s(
    point: IntensityPoint, forecast: list[IntensityPoint], now_s: float, poll_interval_s: float
) -> float | None:
    """Where ``point`` stops being in force (the start of the forecast's next interval), if
    that is after ``now_s`` and before the next poll is due; else None (a value that is
    already over was not published anew yet: the scheduled polls pick the new one up)."""
    starts = [p.time.timestamp() for p in forecast if p.time > point.time]
    turn = min(starts, default=None)
    if turn is None or not now_s < turn < now_s + poll_interval_s:
        return None
    return turn


class CarbonMonitor:
    """Keep the grid carbon intensity of one provider up to date, off the caller's thread.

    Args:
        provider: where values come from.
        poll_interval_s: seconds between polls (> 0; small values such as 0.05 are fine).
        max_staleness_s: how long the last good value is served during an outage
            (>= ``poll_interval_s``), measured on ``clock``.
        fallback: after that, ``"constant"`` serves ``fallback_g_per_kwh``; ``"daily"``
            serves a daily profile learnt from the values seen so far (the constant while
            none were seen).
        fallback_g_per_kwh: the constant fallback (>= 0).
        forecast_horizon_s: how far ahead to fetch the forecast at each poll (by default
            72 h, the longest a provider gives; a provider serves what it has, e.g. the UK
            API 48 h); 0 disables.
        history_window_s: how much of the values seen is kept (by their time).
        seed_history_s: at the first successful poll, also fetch this much history from
            the provider (feeds the daily fallback and forecasters); 0 disables.
        clock: seconds since the epoch; the wall clock by default, a simulated job's
            virtual clock in replays. Ages and the daily fallback use it; the polling
            cadence is wall-clock time.
        monotonic: real seconds (``time.monotonic``) for the server's ``Retry-After``
            and the length of a poll, which are real time even in a replay.

    Raises:
        CarbonConfigError: on out-of-range arguments.
    """

    def __init__(
        self,
        provider: CarbonProvider,
        poll_interval_s: float = 900.0,
        max_staleness_s: float = 7200.0,
        fallback: Literal["constant", "daily"] = "constant",
        fallback_g_per_kwh: float = 400.0,
        forecast_horizon_s: float = 72 * 3600.0,
        history_window_s: float = 7 * 86400.0,
        seed_history_s: float = 24 * 3600.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        problems = []
        if not poll_interval_s > 0:
            problems.append(f"poll_interval_s: {poll_interval_s!r} is not allowed; use > 0")
        if not max_staleness_s >= poll_interval_s:
            problems.append(
                f"max_staleness_s must be >= poll_interval_s ({poll_interval_s!r}); "
                f"got {max_staleness_s!r}"
            )
        if fallback not in ("constant", "daily"):
            problems.append(f"fallback: {fallback!r} is not allowed; allowed: 'constant', 'daily'")
        if not fallback_g_per_kwh >= 0:
            problems.append(f"fallback_g_per_kwh: {fallback_g_per_kwh!r} is not allowed; use >= 0")
        if forecast_horizon_s < 0 or history_window_s <= 0 or seed_history_s < 0:
            problems.append(
                "forecast_horizon_s and seed_history_s must be >= 0 and history_window_s > 0"
            )
        if problems:
            raise CarbonConfigError("; ".join(problems))
        self.provider = provider
        self.poll_interval_s = float(poll_interval_s)
        self.max_staleness_s = float(max_staleness_s)
        self.fallback = fallback
        self.fallback_g_per_kwh = float(fallback_g_per_kwh)
        self.forecast_horizon_s = float(forecast_horizon_s)
        self.history_window_s = float(history_window_s)
        self.seed_history_s = float(seed_history_s)
        self._clock = clock
        self._monotonic = monotonic
        self._lifecycle_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._polled = threading.Event()  # set once a first poll has ended, however
        self._scheduler: BackgroundScheduler | None = None
        self._last_good: IntensityPoint | None = None
        self._last_good_at: float | None = None
        self._forecast: list[IntensityPoint] = []
        self._forecast_reach_s: float | None = None
        self._history: dict[datetime, IntensityPoint] = {}
        self._profile: DailyProfileForecaster | None = None
        self._outage_since: float | None = None
        self._failed_polls = 0
        self._failure_logged = False
        self._poll_started: float | None = None
        self._overrun_noted = False
        self._not_before: float | None = None
        self._forecast_failing = False
        self._seeded = seed_history_s == 0
        # When the value held stops being in force (clock seconds), if before the next poll.
        self._turn_s: float | None = None

    def __repr__(self) -> str:
        return (
            f"CarbonMonitor(provider={self.provider!r}, poll_interval_s={self.poll_interval_s:g}, "
            f"running={self.running})"
        )

    # -- lifecycle -------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the background polling job is scheduled."""
        return self._scheduler is not None

    def start(self) -> CarbonMonitor:
        """Start polling in the background (the first poll runs at once); idempotent.

        Returns:
            ``self``.
        """
        with self._lifecycle_lock:
            if self._scheduler is not None:
                return self
            # Two workers, and room for runs queued behind a hung poll: a run due while a
            # poll is still going finds the poll lock taken and returns at once (see
            # _poll_job). Those runs count as running instances until a worker takes
            # them, which can lag behind a short interval on a busy machine; with room
            # for _MAX_QUEUED_RUNS the scheduler has no run to skip and log.
            scheduler = BackgroundScheduler(
                executors={
                    "default": ThreadPoolExecutor(
                        2, pool_kwargs={"thread_name_prefix": "carbon-monitor"}
                    )
                },
                job_defaults={
                    "coalesce": True,
                    "max_instances": _MAX_QUEUED_RUNS,
                    "misfire_grace_time": None,
                },
                timezone=timezone.utc,
            )
            scheduler.add_job(
                self._poll_job,
                IntervalTrigger(seconds=self.poll_interval_s, timezone=timezone.utc),
                next_run_time=datetime.now(timezone.utc),
                id="carbon-monitor-poll",
                name=f"poll {self.provider.name}",
            )
            scheduler.start()
            self._scheduler = scheduler
            logger.debug("carbon monitor started: %r", self)
            return self

    def stop(self) -> None:
        """Stop polling and close the provider's connections; idempotent, never waits.

        A poll in flight is not waited for: its thread ends when the request returns or
        times out (its answer is still recorded); closing the provider releases its
        connections. With no poll in flight, the polling thread has ended on return. A
        later :meth:`start` polls again.
        """
        with self._lifecycle_lock:
            scheduler, self._scheduler = self._scheduler, None
            if scheduler is not None:
                scheduler.shutdown(wait=not self._poll_lock.locked())
                logger.debug("carbon monitor stopped")
            close = getattr(self.provider, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> CarbonMonitor:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- answers (memory only) -------------------------------------------------------

    def latest(self) -> Reading:
        """The intensity to use now, from memory; never waits for the network.

        Returns:
            A fresh value, the last good one while it is younger than ``max_staleness_s``
            (stale), or the fallback.
        """
        now_s = self._clock()
        self._poll_if_turned(now_s)
        with self._state_lock:
            point, good_at = self._last_good, self._last_good_at
            outage = self._outage_since is not None
            age_s = None if good_at is None else max(0.0, now_s - good_at)
            if point is not None and age_s is not None and age_s <= self.max_staleness_s:
                status = ReadingStatus.STALE if outage else ReadingStatus.FRESH
                return Reading(point.intensity_g_per_kwh, point.time, status, point.source, age_s)
            profile = self._daily_profile() if self.fallback == "daily" else None
        if profile is not None:
            when = datetime.fromtimestamp(now_s, tz=timezone.utc)
            value = profile.predict([when])[0]
            return Reading(value, when, ReadingStatus.FALLBACK, "fallback:daily", age_s)
        return Reading(
            self.fallback_g_per_kwh, None, ReadingStatus.FALLBACK, "fallback:constant", age_s
        )

    def forecast(self) -> list[IntensityPoint]:
        """The last forecast fetched, without the intervals already over (oldest first).

        Each point's interval ends where the next one starts (the last lasts as long as
        the step before it), so forecasts whose resolution changes are cut correctly.
        """
        now_s = self._clock()
        with self._state_lock:
            points = sorted(self._forecast, key=lambda p: p.time)
        if not points:
            return []
        ends_s = interval_ends_s(np.array([p.time.timestamp() for p in points]))
        return [p for p, end_s in zip(points, ends_s, strict=True) if end_s > now_s]

    def history(self) -> list[IntensityPoint]:
        """The values seen so far (and the seeded history), oldest first, within
        ``history_window_s``."""
        with self._state_lock:
            return sorted(self._history.values(), key=lambda p: p.time)

    @property
    def forecast_reach_s(self) -> float | None:
        """How far ahead the last forecast fetched reached when it came (the end of its
        last interval, in seconds after that poll): what the provider gave of the
        ``forecast_horizon_s`` asked for. ``None`` before any forecast came."""
        with self._state_lock:
            return self._forecast_reach_s

    @property
    def in_outage(self) -> bool:
        """Whether the last poll failed."""
        with self._state_lock:
            return self._outage_since is not None

    # -- polling ---------------------------------------------------------------------

    def poll_now(self) -> Reading:
        """Poll the provider on the calling thread, then answer like :meth:`latest`.

        For command lines and tests; a training loop reads :meth:`latest` instead.
        """
        self._poll()
        return self.latest()

    def _poll_if_turned(self, now_s: float) -> None:
        """Ask for one background poll now if the value held is no longer in force."""
        with self._state_lock:
            if self._turn_s is None or now_s < self._turn_s:
                return
            self._turn_s = None
        scheduler = self._scheduler
        if scheduler is not None:  # one run, now (a scheduler stopped meanwhile drops it)
            scheduler.add_job(
                self._poll_job,
                id="carbon-monitor-turn",
                name=f"poll {self.provider.name} at the turn of its interval",
                replace_existing=True,
            )

    def _poll_job(self) -> None:
        if not self._poll_lock.acquire(blocking=False):
            self._note_overrun()
            return
        try:
            self._poll_locked()
        except Exception:  # never let a bug kill the background job silently
            logger.exception("carbon monitor: unexpected error while polling")
        finally:
            self._poll_lock.release()

    def _poll(self) -> None:
        with self._poll_lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        if self._not_before is not None:
            wait_s = self._not_before - self._monotonic()
            if wait_s > 0:
                logger.debug(
                    "not polling %s: the server asked to wait %.0f s more (Retry-After)",
                    self.provider.name,
                    wait_s,
                )
                return
            self._not_before = None
        with self._state_lock:
            self._poll_started = self._monotonic()
        try:
            self._poll_provider()
        finally:
            with self._state_lock:
                self._poll_started = None
                self._overrun_noted = False
            self._polled.set()

    def wait_for_first_poll(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a first poll to end (answered or failed), so that
        :meth:`latest` gives the provider's value rather than the fallback of a poll still
        on its way; whether one has ended.

        Raises:
            CarbonConfigError: ``timeout_s`` is not a number >= 0.
        """
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise CarbonConfigError(f"timeout_s: {timeout_s!r} is not allowed; use a finite >= 0")
        return self._polled.wait(timeout_s)

    def _note_overrun(self) -> None:
        """A run came due while a poll is still going: start an outage (one WARNING) once
        that poll has run for ``poll_interval_s``; a younger one is on its way (a poll
        asked for at the turn of an interval, or one a run at the turn met)."""
        now_s = self._clock()
        with self._state_lock:
            started = self._poll_started
            if started is None:  # the poll lock is held by poll_now() between polls
                return
            running_s = self._monotonic() - started
            young = running_s < self.poll_interval_s
            starting = not (young or self._overrun_noted) and self._outage_since is None
            if not young:
                self._overrun_noted = True
            if starting:
                self._outage_since = now_s
            last = self._last_good
        if young:
            logger.debug(
                "carbon intensity poll of %s already on its way (%.1f s)",
                self.provider.name,
                running_s,
            )
            return
        if not starting:
            logger.debug(
                "carbon intensity poll of %s still waiting for an answer after %.0f s",
                self.provider.name,
                running_s,
            )
            return
        logger.warning(
            "carbon intensity from %s: no answer after %.0f s, longer than poll_interval_s "
            "(%g s); the next polls wait for this one (still waiting); %s",
            self.provider.name,
            running_s,
            self.poll_interval_s,
            self._what_is_served(last),
        )

    def _poll_provider(self) -> None:
        try:
            point = self.provider.latest()
        except Exception as exc:
            self._record_failure(exc)
            return
        forecast = self._fetch_forecast()
        seeded = self._fetch_seed()
        now_s = self._clock()
        with self._state_lock:
            recovered_after = self._outage_since
            failed, self._failed_polls = self._failed_polls, 0
            self._outage_since = None
            self._failure_logged = False
            self._last_good, self._last_good_at = point, now_s
            if forecast is not None:
                self._forecast = forecast
                self._forecast_reach_s = forecast_reach_s(forecast, now_s)
            self._turn_s = _turn_s(point, self._forecast, now_s, self.poll_interval_s)
            for p in [*seeded, point]:
                self._history[p.time] = p
            self._trim_history(point.time.timestamp())
            self._profile = None
        if recovered_after is not None:
            logger.info(
                "carbon intensity from %s available again after %.0f s (%d failed polls): "
                "%.1f gCO2eq/kWh",
                self.provider.name,
                now_s - recovered_after,
                failed,
                point.intensity_g_per_kwh,
            )

    def _record_failure(self, exc: Exception) -> None:
        self._hold_back(exc)
        now_s = self._clock()
        with self._state_lock:
            starting = self._outage_since is None
            if starting:
                self._outage_since = now_s
            self._failed_polls += 1
            first_reason = not self._failure_logged
            self._failure_logged = True
            last = self._last_good
        if starting:
            wait = ""
            if isinstance(exc, QuotaError) and exc.retry_after_s:
                hold_s = min(exc.retry_after_s, MAX_HOLD_BACK_S)
                wait = f"not polling again for {hold_s:.0f} s (Retry-After); "
            logger.warning(
                "carbon intensity from %s unavailable (%s: %s); %s%s",
                self.provider.name,
                type(exc).__name__,
                exc,
                wait,
                self._what_is_served(last),
            )
        elif first_reason:  # an outage that began with a poll outlasting its interval
            logger.info(
                "carbon intensity poll of %s failed (%s: %s)",
                self.provider.name,
                type(exc).__name__,
                exc,
            )
        else:
            logger.debug("carbon intensity poll failed again: %s", exc)

    def _what_is_served(self, last: IntensityPoint | None) -> str:
        if last is not None:
            return (
                f"keeping the last value ({last.intensity_g_per_kwh:.1f} gCO2eq/kWh) for up "
                f"to {self.max_staleness_s:.0f} s, then the {self.fallback} fallback"
            )
        return f"using the {self.fallback} fallback"

    def _hold_back(self, exc: Exception) -> None:
        """Remember a rate limit's ``Retry-After``: no poll before it is over (at most
        :data:`MAX_HOLD_BACK_S`, so a server's absurd date cannot stop polling)."""
        if isinstance(exc, QuotaError) and exc.retry_after_s:
            self._not_before = self._monotonic() + min(exc.retry_after_s, MAX_HOLD_BACK_S)

    def _fetch_forecast(self) -> list[IntensityPoint] | None:
        if self.forecast_horizon_s <= 0:
            return None
        try:
            points = self.provider.forecast(self.forecast_horizon_s)
        except Exception as exc:
            self._hold_back(exc)
            if not self._forecast_failing:
                self._forecast_failing = True
                logger.warning(
                    "carbon intensity forecast from %s unavailable (%s: %s); keeping the "
                    "previous one",
                    self.provider.name,
                    type(exc).__name__,
                    exc,
                )
            return None
        if self._forecast_failing:
            self._forecast_failing = False
            logger.info("carbon intensity forecast from %s available again", self.provider.name)
        return points

    def _fetch_seed(self) -> list[IntensityPoint]:
        if self._seeded:
            return []
        self._seeded = True
        now = datetime.fromtimestamp(self._clock(), tz=timezone.utc)
        start = datetime.fromtimestamp(now.timestamp() - self.seed_history_s, tz=timezone.utc)
        try:
            return self.provider.history(start, now)
        except Exception as exc:
            logger.debug("no history to seed from %s: %s", self.provider.name, exc)
            return []

    def _trim_history(self, newest_s: float) -> None:
        cutoff_s = newest_s - self.history_window_s
        for t in [t for t in self._history if t.timestamp() < cutoff_s]:
            del self._history[t]

    def _daily_profile(self) -> DailyProfileForecaster | None:
        """The daily profile of the history seen (cached until the next good poll);
        call with the state lock held."""
        if self._profile is None and self._history:
            points = list(self._history.values())
            self._profile = DailyProfileForecaster(source="fallback:daily").fit(points)
        return self._profile
