"""A seasonal (time-of-day) forecaster of grid carbon intensity.

Grid intensity has a strong daily cycle where solar matters (California) and a weaker one
elsewhere; the simplest forecaster that captures it averages the recent history by slot of
the day (hour of day by default, in UTC) and, optionally, shifts that profile towards the
current level: the gap between the last observation and the profile decays exponentially
with the lead time (a persistence term). It fills forecasts a provider does not give
(free plans, short horizons, outages) and serves the monitor's ``daily`` fallback.

Example:
    >>> from datetime import datetime, timedelta, timezone
    >>> from carbon.types import IntensityPoint, PointKind
    >>> t0 = datetime(2023, 1, 1, tzinfo=timezone.utc)
    >>> hist = [IntensityPoint(t0 + timedelta(hours=h), 100.0 + (h % 24), PointKind.MEASURED,
    ...                        "x") for h in range(72)]
    >>> f = DailyProfileForecaster(level_decay_s=None).fit(hist)
    >>> f.predict([t0 + timedelta(days=5, hours=3)])
    [103.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timezone

import numpy as np
import numpy.typing as npt

from carbon.errors import CarbonConfigError, CarbonError
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = ["DailyProfileForecaster", "forecast_reach_s", "interval_ends_s"]

_DAY_S = 86400.0

FloatArray = npt.NDArray[np.float64]


class DailyProfileForecaster:
    """Forecast intensity as a daily profile, optionally anchored to the recent level.

    Args:
        slot_s: width of a slot of the day in seconds (must divide 86400); 3600 = hourly.
        window_days: only the last ``window_days`` days of history before the newest point
            shape the profile; ``None`` uses all of it.
        level_decay_s: time constant of the persistence term: the gap between the last
            observation and the profile is added to predictions with weight
            ``exp(-lead_s / level_decay_s)``. ``None`` disables it (pure profile).
        source: the ``source`` of the points :meth:`extend` creates.

    Raises:
        CarbonConfigError: on a slot width that does not divide a day, or non-positive values.
    """

    def __init__(
        self,
        slot_s: float = 3600.0,
        window_days: float | None = 7.0,
        level_decay_s: float | None = 6 * 3600.0,
        source: str = "forecast:daily-profile",
    ) -> None:
        if slot_s <= 0 or not math.isclose(_DAY_S / slot_s, round(_DAY_S / slot_s)):
            raise CarbonConfigError(f"slot_s: {slot_s!r} is not allowed; use a divisor of 86400 s")
        if window_days is not None and window_days <= 0:
            raise CarbonConfigError(f"window_days: {window_days!r} is not allowed; use > 0 or None")
        if level_decay_s is not None and level_decay_s <= 0:
            raise CarbonConfigError(
                f"level_decay_s: {level_decay_s!r} is not allowed; use > 0 or None"
            )
        self.slot_s = float(slot_s)
        self.window_days = window_days
        self.level_decay_s = level_decay_s
        self.source = source
        self._n_slots = round(_DAY_S / self.slot_s)
        self._profile: FloatArray | None = None
        self._anchor_time_s = 0.0
        self._anchor_gap = 0.0

    @property
    def is_fitted(self) -> bool:
        """Whether :meth:`fit` has seen at least one point."""
        return self._profile is not None

    @property
    def profile_g_per_kwh(self) -> list[float]:
        """The fitted mean intensity of each slot of the day (UTC), from midnight.

        Raises:
            CarbonError: if the forecaster is not fitted.
        """
        return [float(v) for v in self._require_profile()]

    def fit(self, points: Sequence[IntensityPoint]) -> DailyProfileForecaster:
        """Learn the daily profile from past points (any order; forecasts are fine too).

        Args:
            points: observed intensities.

        Returns:
            ``self``, fitted.

        Raises:
            CarbonError: if ``points`` is empty.
        """
        times_s = np.array([p.time.timestamp() for p in points], dtype=np.float64)
        values = np.array([p.intensity_g_per_kwh for p in points], dtype=np.float64)
        return self.fit_arrays(times_s, values)

    def fit_arrays(
        self, times_s: FloatArray, values_g_per_kwh: FloatArray
    ) -> DailyProfileForecaster:
        """Like :meth:`fit`, from arrays of epoch seconds and intensities (no objects).

        Each value is weighted by the time it holds (until the next time, at most one
        slot), so a history whose resolution changes is averaged over time, not rows.

        Args:
            times_s: interval start times, seconds since the Unix epoch (UTC), any order.
            values_g_per_kwh: intensities, same length.

        Returns:
            ``self``, fitted.

        Raises:
            CarbonError: if the arrays are empty or of different lengths.
        """
        times_s = np.asarray(times_s, dtype=np.float64)
        values = np.asarray(values_g_per_kwh, dtype=np.float64)
        if times_s.shape != values.shape or times_s.ndim != 1:
            raise CarbonError("times and values must be 1-D arrays of the same length")
        if times_s.size == 0:
            raise CarbonError("cannot fit a daily profile on an empty history")
        order = np.argsort(times_s, kind="stable")
        times_s, values = times_s[order], values[order]
        # Each value stands for the time until the next one, capped at one slot: rows of
        # mixed resolution weigh by the time they cover, and a value held across a gap
        # counts no more than a slot.
        weights = np.minimum(interval_ends_s(times_s, self.slot_s) - times_s, self.slot_s)
        newest = float(times_s[-1])
        if self.window_days is not None:
            keep = times_s > newest - self.window_days * _DAY_S
            times_s, values, weights = times_s[keep], values[keep], weights[keep]
        slots = self._slot_of(times_s)
        sums = np.bincount(slots, weights=values * weights, minlength=self._n_slots)
        covered = np.bincount(slots, weights=weights, minlength=self._n_slots)
        self._profile = _fill_circular(sums.astype(np.float64), covered.astype(np.float64))
        last = int(np.argmax(times_s))
        self._anchor_time_s = float(times_s[last])
        self._anchor_gap = float(values[last] - self._profile[slots[last]])
        return self

    def predict(self, times: Sequence[datetime]) -> list[float]:
        """Predict the intensity at each time.

        Args:
            times: when (timezone-aware, or naive UTC).

        Returns:
            One intensity in gCO2eq/kWh per time, never negative.

        Raises:
            CarbonError: if the forecaster is not fitted.
        """
        times_s = np.array([as_utc(t).timestamp() for t in times], dtype=np.float64)
        return [float(v) for v in self.predict_arrays(times_s)]

    def predict_arrays(self, times_s: FloatArray) -> FloatArray:
        """Like :meth:`predict`, for epoch seconds, returning an array.

        Args:
            times_s: seconds since the Unix epoch (UTC).

        Returns:
            Predicted intensities in gCO2eq/kWh.

        Raises:
            CarbonError: if the forecaster is not fitted.
        """
        return self._predict(
            np.asarray(times_s, dtype=np.float64), self._anchor_time_s, self._anchor_gap
        )

    def extend(
        self,
        forecast_points: Sequence[IntensityPoint],
        until: datetime,
        step_s: float,
        start: datetime | None = None,
    ) -> list[IntensityPoint]:
        """Continue a (possibly short or empty) forecast with the profile until ``until``.

        The given points are kept as they are; new points follow the last one every
        ``step_s`` seconds while they start before ``until``. The persistence term is
        anchored on the last given point (or on the fitted history when none is given).

        Args:
            forecast_points: the provider's forecast (any order), possibly empty.
            until: the end of the horizon wanted.
            step_s: spacing of the added points in seconds (> 0).
            start: where to begin when ``forecast_points`` is empty; defaults to one step
                after the newest fitted point.

        Returns:
            The given points, sorted, followed by the added ``FORECAST`` points.

        Raises:
            CarbonError: if the forecaster is not fitted.
            CarbonConfigError: if ``step_s`` is not positive.
        """
        if step_s <= 0:
            raise CarbonConfigError(f"step_s: {step_s!r} is not allowed; use > 0")
        profile = self._require_profile()
        given = sorted(forecast_points, key=lambda p: p.time)
        until_s = as_utc(until).timestamp()
        if given:
            last = given[-1]
            anchor_s = last.time.timestamp()
            slot = self._slot_of(np.array([anchor_s]))[0]
            gap = last.intensity_g_per_kwh - float(profile[slot])
            first_s = anchor_s + step_s
        else:
            anchor_s, gap = self._anchor_time_s, self._anchor_gap
            first_s = as_utc(start).timestamp() if start is not None else anchor_s + step_s
        if first_s >= until_s:
            return given
        new_times_s = np.arange(first_s, until_s, step_s, dtype=np.float64)
        values = self._predict(new_times_s, anchor_s, gap)
        added = [
            IntensityPoint(
                datetime.fromtimestamp(float(t), tz=timezone.utc),
                float(v),
                PointKind.FORECAST,
                self.source,
            )
            for t, v in zip(new_times_s, values, strict=True)
        ]
        return given + added

    def _predict(self, times_s: FloatArray, anchor_s: float, gap: float) -> FloatArray:
        profile = self._require_profile()
        base = profile[self._slot_of(times_s)]
        if self.level_decay_s is not None and gap != 0.0:
            lead_s = np.maximum(times_s - anchor_s, 0.0)
            base = base + gap * np.exp(-lead_s / self.level_decay_s)
        return np.maximum(base, 0.0)

    def _slot_of(self, times_s: FloatArray) -> npt.NDArray[np.int64]:
        seconds_of_day = np.mod(times_s, _DAY_S)
        return np.minimum((seconds_of_day // self.slot_s).astype(np.int64), self._n_slots - 1)

    def _require_profile(self) -> FloatArray:
        if self._profile is None:
            raise CarbonError("the daily profile forecaster is not fitted; call fit() first")
        return self._profile


def _fill_circular(sums: FloatArray, counts: FloatArray) -> FloatArray:
    """Mean per slot; slots without data interpolated linearly between their neighbours
    around the clock (a single filled slot makes a flat profile)."""
    n = sums.size
    filled = counts > 0
    means = np.zeros(n, dtype=np.float64)
    means[filled] = sums[filled] / counts[filled]
    if filled.all():
        return means
    idx = np.flatnonzero(filled)
    xs = np.concatenate([idx - n, idx, idx + n]).astype(np.float64)
    ys = np.concatenate([means[idx]] * 3)
    return np.interp(np.arange(n, dtype=np.float64), xs, ys)


def interval_ends_s(times_s: FloatArray, default_s: float = 3600.0) -> FloatArray:
    """Where the interval of each value of a step series ends, row by row.

    A value holds from its time until the next time, so a change of resolution (30 min
    rows, then 15 min rows) and a gap in the data are handled at each row, with no
    "typical period". The last value holds as long as the last positive step before it
    (its own resolution); a series with a single distinct time holds for ``default_s``.

    Args:
        times_s: interval starts in epoch seconds, sorted (equal times are allowed: all
            but the last of them end where they start).
        default_s: the length of the last interval when there is no step to copy.

    Returns:
        One end per time, in epoch seconds.

    Example:
        >>> interval_ends_s(np.array([0.0, 1800.0, 3600.0, 4500.0])).tolist()
        [1800.0, 3600.0, 4500.0, 5400.0]
    """
    times = np.asarray(times_s, dtype=np.float64)
    if times.size == 0:
        return times.copy()
    steps = np.diff(times)
    positive = steps[steps > 0]
    last_s = float(positive[-1]) if positive.size else float(default_s)
    return np.append(times[1:], times[-1] + last_s)


def forecast_reach_s(points: Sequence[IntensityPoint], now_s: float) -> float:
    """How far a forecast reaches: seconds from ``now_s`` to the end of its last interval
    (:func:`interval_ends_s`), 0 for an empty or past one.

    Example:
        >>> from datetime import datetime, timezone
        >>> from carbon.types import PointKind
        >>> t = [datetime(2023, 1, 1, h, tzinfo=timezone.utc) for h in (0, 1, 2)]
        >>> points = [IntensityPoint(x, 100.0, PointKind.FORECAST, "x") for x in t]
        >>> forecast_reach_s(points, t[0].timestamp()) / 3600
        3.0
    """
    times = np.array(sorted(p.time.timestamp() for p in points), dtype=np.float64)
    if times.size == 0:
        return 0.0
    return max(float(interval_ends_s(times)[-1]) - now_s, 0.0)
