"""Replay a recorded carbon-intensity trace (CSV) as a provider, with an adjustable "now".

Any CSV with a time column (UTC) and an intensity column (gCO2eq/kWh) works; the column
names are detected for the shipped traces and configurable for others. The provider's
clock is a callable, so a simulated job's virtual clock can drive it and replay a year of
real grid data in seconds; times past the end of the trace wrap around to its start.

Shipped traces (``carbon/data/traces/``), by short name:

- ``"CISO"``: California ISO 2023, hourly (Electricity Maps, ODbL).
- ``"DE"``: Germany 2023, hourly (Electricity Maps, ODbL).
- ``"FR"``: France 2019-12-20 .. 2021-01-09, 30 min (Wiesner et al., Middleware'21,
  from ENTSO-E data).

Example:
    >>> from datetime import datetime, timezone
    >>> series = load_trace("CISO")
    >>> series.at(datetime(2023, 1, 1, 0, 30, tzinfo=timezone.utc))
    218.3
    >>> provider = TraceProvider(series, now=lambda: datetime(2023, 1, 1, tzinfo=timezone.utc))
    >>> provider.latest().intensity_g_per_kwh
    218.3
"""

from __future__ import annotations

import csv
import importlib.resources
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from carbon.errors import CarbonConfigError, NoDataError, TraceError
from carbon.forecast import DailyProfileForecaster, interval_ends_s
from carbon.types import IntensityPoint, PointKind, as_utc

__all__ = [
    "SHIPPED_TRACES",
    "TraceProvider",
    "TraceSeries",
    "load_trace",
    "shipped_trace_path",
]

#: Short names of the traces shipped in ``carbon/data/traces/`` and their file names.
SHIPPED_TRACES: dict[str, str] = {
    "CISO": "emaps_CISO_2023_hourly.csv",
    "DE": "emaps_DE_2023_hourly.csv",
    "FR": "letswait_fr_ci_2020.csv",
}

_TIME_COLUMNS = ("datetime (utc)", "time", "datetime", "timestamp", "time (utc)", "date")
_DIRECT_COLUMNS = (
    "carbon intensity gco₂eq/kwh (direct)",
    "carbon intensity gco2eq/kwh (direct)",
    "carbon intensity",
    "carbon_intensity",
    "carbonintensity",
    "intensity",
    "intensity_g_per_kwh",
)
_LIFECYCLE_COLUMNS = (
    "carbon intensity gco₂eq/kwh (lca)",
    "carbon intensity gco2eq/kwh (lca)",
)
_ESTIMATED_COLUMN = "data estimated"
_DAY_S = 86400.0

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def shipped_trace_path(name: str) -> Path:
    """The path of a shipped trace.

    Args:
        name: a short name of :data:`SHIPPED_TRACES` (``"CISO"``, ``"DE"``, ``"FR"``;
            case-insensitive).

    Returns:
        The CSV file inside the installed package.

    Raises:
        TraceError: if there is no shipped trace of that name.
    """
    key = name.upper()
    if key not in SHIPPED_TRACES:
        raise TraceError(
            f"trace: unknown shipped trace {name!r}; allowed: {', '.join(SHIPPED_TRACES)} "
            "or the path of a CSV file"
        )
    resource = importlib.resources.files("carbon") / "data" / "traces" / SHIPPED_TRACES[key]
    return Path(str(resource))


@dataclass(frozen=True)
class TraceSeries:
    """A carbon-intensity time series, sorted by time; the step may change and rows may
    be missing.

    Each value holds from its time until the next row (step/hold), so a change of
    resolution (30 min rows, then 15 min rows) is followed row by row and a gap in the
    data holds the last value until data resumes (:meth:`gaps` lists them); the last row
    holds for its own step (the distance from the row before it). Nothing assumes a
    "typical" period.

    Attributes:
        times_s: interval starts, seconds since the Unix epoch (UTC), strictly increasing.
        values_g_per_kwh: intensity of each interval in gCO2eq/kWh.
        name: a label used in point sources (``"CISO"``, a file stem...).
        estimated: per interval, whether the data source marks it as estimated.
    """

    times_s: FloatArray
    values_g_per_kwh: FloatArray
    name: str = "trace"
    estimated: BoolArray = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))

    def __post_init__(self) -> None:
        times = np.asarray(self.times_s, dtype=np.float64)
        values = np.asarray(self.values_g_per_kwh, dtype=np.float64)
        estimated = np.asarray(self.estimated, dtype=np.bool_)
        if estimated.size == 0:
            estimated = np.zeros(times.size, dtype=np.bool_)
        problems = []
        if times.ndim != 1 or times.shape != values.shape or estimated.shape != times.shape:
            problems.append("times, values and estimated flags must have the same length")
        elif times.size < 2:
            problems.append(f"a trace needs at least 2 rows; got {times.size}")
        else:
            if not np.all(np.diff(times) > 0):
                problems.append("times must be strictly increasing (no duplicates)")
            if not np.all(np.isfinite(values)) or np.any(values < 0):
                problems.append("intensities must be finite and >= 0")
        if problems:
            raise TraceError([f"trace {self.name!r}: {p}" for p in problems])
        for arr in (times, values, estimated):
            arr.setflags(write=False)
        object.__setattr__(self, "times_s", times)
        object.__setattr__(self, "values_g_per_kwh", values)
        object.__setattr__(self, "estimated", estimated)

    @cached_property
    def period_s(self) -> float:
        """The most common kind of step between rows in seconds (the median), for
        display only: every computation uses each row's own interval (:attr:`ends_s`)."""
        return float(np.median(np.diff(self.times_s)))

    @cached_property
    def ends_s(self) -> FloatArray:
        """Where each row's interval ends (epoch seconds): at the next row; the last row
        after its own step."""
        ends = interval_ends_s(self.times_s)
        ends.setflags(write=False)
        return ends

    @property
    def start_s(self) -> float:
        """The start of the first interval, epoch seconds."""
        return float(self.times_s[0])

    @property
    def end_s(self) -> float:
        """The end of the last interval, epoch seconds: the first time with no data."""
        return float(self.ends_s[-1])

    @property
    def start(self) -> datetime:
        """The start of the first interval (UTC)."""
        return datetime.fromtimestamp(self.start_s, tz=timezone.utc)

    @property
    def end(self) -> datetime:
        """The end of the last interval (UTC): :attr:`end_s` as a datetime."""
        return datetime.fromtimestamp(self.end_s, tz=timezone.utc)

    def __len__(self) -> int:
        return int(self.times_s.size)

    def index_at(self, t_s: float) -> int:
        """The row whose interval contains ``t_s`` (epoch seconds).

        Raises:
            NoDataError: if ``t_s`` is outside ``[start, end)``.
        """
        if not self.start_s <= t_s < self.end_s:
            raise self._outside(t_s)
        return int(np.searchsorted(self.times_s, t_s, side="right")) - 1

    def gaps(self) -> list[tuple[float, float]]:
        """The rows held across missing data: ``(start_s, end_s)`` of each interval
        longer than the steps on both sides of it (the first and last compare with their
        one neighbour). A change of resolution is not a gap; a lone row between two
        equally long gaps is not told apart from a coarser resolution.

        Returns:
            The held intervals, oldest first (empty for a gap-free trace).
        """
        steps = np.diff(self.times_s)
        if steps.size < 2:
            return []
        before = np.concatenate([[0.0], steps[:-1]])
        after = np.concatenate([steps[1:], [0.0]])
        held = np.flatnonzero((steps > before) & (steps > after))
        return [(float(self.times_s[i]), float(self.times_s[i + 1])) for i in held]

    def integral_g_s_per_kwh(self, start_s: float, end_s: float) -> float:
        """The intensity integrated over ``[start_s, end_s)``, row by row, in
        gCO2eq/kWh x s: divide by the duration for the mean intensity, or multiply by a
        constant power in W and divide by 3.6e6 J/kWh for grams.

        Args:
            start_s: epoch seconds, inside the trace.
            end_s: epoch seconds, at most :attr:`end_s`; 0 when ``end_s <= start_s``.

        Raises:
            NoDataError: if the range leaves ``[start, end]``.
        """
        if end_s <= start_s:
            return 0.0
        self._check_range(start_s, end_s)
        return self._integral_to(end_s) - self._integral_to(start_s)

    def segments(self, start_s: float, end_s: float) -> tuple[FloatArray, FloatArray]:
        """The intensities and durations of the rows overlapping ``[start_s, end_s)``,
        the first and last clipped to the range (the input of a planner that works
        interval by interval, such as :func:`carbon.planning.plan_steps`).

        Args:
            start_s: epoch seconds, inside the trace.
            end_s: epoch seconds, at most :attr:`end_s`.

        Returns:
            ``(intensities_g_per_kwh, durations_s)``; empty when ``end_s <= start_s``.

        Raises:
            NoDataError: if the range leaves ``[start, end]``.
        """
        if end_s <= start_s:
            return np.zeros(0), np.zeros(0)
        self._check_range(start_s, end_s)
        first = self.index_at(start_s)
        last = int(np.searchsorted(self.times_s, end_s, side="left")) - 1
        edges = np.concatenate([[start_s], self.times_s[first + 1 : last + 1], [end_s]])
        return self.values_g_per_kwh[first : last + 1].copy(), np.diff(edges)

    @cached_property
    def _cumulative(self) -> FloatArray:
        """The integral from the start to each row's start."""
        spans = self.ends_s - self.times_s
        return np.concatenate([[0.0], np.cumsum(self.values_g_per_kwh * spans)])

    def _integral_to(self, t_s: float) -> float:
        k = min(int(np.searchsorted(self.times_s, t_s, side="right")) - 1, len(self) - 1)
        return float(self._cumulative[k] + self.values_g_per_kwh[k] * (t_s - self.times_s[k]))

    def _check_range(self, start_s: float, end_s: float) -> None:
        for t_s in (start_s, end_s):
            if not self.start_s <= t_s <= self.end_s:
                raise self._outside(t_s)

    def _outside(self, t_s: float) -> NoDataError:
        try:
            when = datetime.fromtimestamp(t_s, tz=timezone.utc).isoformat()
        except (OverflowError, OSError, ValueError):
            when = f"{t_s!r} s after the epoch"
        return NoDataError(
            f"{when} is outside the trace {self.name!r} "
            f"({self.start.isoformat()} .. {self.end.isoformat()})",
            provider="trace",
        )

    def at(self, t: datetime) -> float:
        """The intensity of the interval containing ``t``.

        Args:
            t: a time inside the trace (naive means UTC).

        Returns:
            gCO2eq/kWh.

        Raises:
            NoDataError: if ``t`` is outside the trace.
        """
        return float(self.values_g_per_kwh[self.index_at(as_utc(t).timestamp())])

    def between(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        """The rows whose interval starts in ``[start, end)``, as measured/estimated points.

        Args:
            start: inclusive lower bound.
            end: exclusive upper bound.

        Returns:
            Points in time order (empty when the range misses the trace).
        """
        lo = int(np.searchsorted(self.times_s, as_utc(start).timestamp(), side="left"))
        hi = int(np.searchsorted(self.times_s, as_utc(end).timestamp(), side="left"))
        return [self._point(i, float(self.times_s[i]), PointKind.MEASURED) for i in range(lo, hi)]

    def _point(self, index: int, time_s: float, kind: PointKind) -> IntensityPoint:
        if kind is PointKind.MEASURED and self.estimated[index]:
            kind = PointKind.ESTIMATED
        return IntensityPoint(
            datetime.fromtimestamp(time_s, tz=timezone.utc),
            float(self.values_g_per_kwh[index]),
            kind,
            f"trace:{self.name}",
        )


def load_trace(
    path: str | Path,
    time_col: str | None = None,
    value_col: str | None = None,
    emission_factor: Literal["direct", "lifecycle"] = "direct",
) -> TraceSeries:
    """Read a carbon-intensity trace from a CSV file.

    Args:
        path: a CSV file, or the short name of a shipped trace (``"CISO"``, ``"DE"``,
            ``"FR"``).
        time_col: the time column (UTC; ISO 8601, naive means UTC). Detected when ``None``
            (``Datetime (UTC)``, ``Time``, ...).
        value_col: the intensity column in gCO2eq/kWh. Detected when ``None``: the direct
            emission factor column of Electricity Maps exports, or ``Carbon Intensity``.
        emission_factor: with ``value_col=None``, ``"lifecycle"`` picks the LCA column of
            Electricity Maps exports instead of the direct one.

    Returns:
        The series, sorted by time.

    Raises:
        TraceError: if the file is missing, a column is not found (the message lists the
            available ones), or a row cannot be parsed.
    """
    if isinstance(path, str) and path.upper() in SHIPPED_TRACES:
        file, name = shipped_trace_path(path), path.upper()
    else:
        file = Path(path)
        name = file.stem
    try:
        with file.open(newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.reader(handle))
    except OSError as exc:
        raise TraceError(f"trace: cannot read {str(file)!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(f"trace: {str(file)!r} is not a UTF-8 CSV file") from exc
    if not rows:
        raise TraceError(f"trace: {str(file)!r} is empty")
    header = [h.strip() for h in rows[0]]
    value_candidates = _LIFECYCLE_COLUMNS if emission_factor == "lifecycle" else _DIRECT_COLUMNS
    problems = []
    t_idx = _find_column(header, time_col, _TIME_COLUMNS)
    v_idx = _find_column(header, value_col, value_candidates)
    available = ", ".join(repr(h) for h in header)
    if t_idx is None:
        wanted = repr(time_col) if time_col else "a time column"
        problems.append(
            f"trace {str(file)!r}: time_col: {wanted} not found; available: {available}"
        )
    if v_idx is None:
        wanted = repr(value_col) if value_col else f"an intensity column ({emission_factor})"
        problems.append(
            f"trace {str(file)!r}: value_col: {wanted} not found; available: {available}"
        )
    if problems:
        raise TraceError(problems)
    assert t_idx is not None and v_idx is not None
    e_idx = _find_column(header, None, (_ESTIMATED_COLUMN,))
    times: list[float] = []
    values: list[float] = []
    estimated: list[bool] = []
    for line_no, row in enumerate(rows[1:], start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        try:
            times.append(_parse_time(row[t_idx]))
            values.append(float(row[v_idx]))
        except (ValueError, IndexError) as exc:
            raise TraceError(
                f"trace {str(file)!r}, line {line_no}: cannot parse row: {exc}"
            ) from exc
        estimated.append(e_idx is not None and row[e_idx].strip().lower() == "true")
    order = np.argsort(np.array(times, dtype=np.float64), kind="stable")
    return TraceSeries(
        np.array(times, dtype=np.float64)[order],
        np.array(values, dtype=np.float64)[order],
        name=name,
        estimated=np.array(estimated, dtype=np.bool_)[order],
    )


def _find_column(
    header: Sequence[str], wanted: str | None, candidates: Sequence[str]
) -> int | None:
    if wanted is not None:
        return header.index(wanted) if wanted in header else None
    lowered = [h.lower() for h in header]
    for candidate in candidates:
        if candidate in lowered:
            return lowered.index(candidate)
    return None


def _parse_time(text: str) -> float:
    text = text.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    return as_utc(datetime.fromisoformat(text)).timestamp()


class TraceProvider:
    """Serve a :class:`TraceSeries` as a carbon-intensity provider.

    "Now" comes from ``now`` (a callable, e.g. a simulated job's virtual clock) or from
    :meth:`set_now`; by default the wall clock. A time outside the trace is mapped into
    it by wrapping around: the wrap period is the trace's length rounded down to whole
    days (so the hour of day is kept), and times before the start wrap backwards. Times
    inside the trace map to themselves.

    Args:
        series: the trace.
        now: returns the current time; ``None`` means the wall clock.
        forecast_horizon_s: default horizon of :meth:`forecast` in seconds.
        forecaster: ``"perfect"`` serves the trace's own future values as the forecast;
            ``"daily"`` a :class:`~carbon.forecast.DailyProfileForecaster` fitted on the
            week before now.

    Raises:
        CarbonConfigError: on an unknown forecaster or a non-positive horizon.
    """

    name = "trace"

    def __init__(
        self,
        series: TraceSeries,
        now: Callable[[], datetime] | None = None,
        forecast_horizon_s: float = 72 * 3600.0,
        forecaster: Literal["perfect", "daily"] = "perfect",
    ) -> None:
        if forecaster not in ("perfect", "daily"):
            raise CarbonConfigError(
                f"forecaster: {forecaster!r} is not allowed; allowed: 'perfect', 'daily'"
            )
        if forecast_horizon_s <= 0:
            raise CarbonConfigError(
                f"forecast_horizon_s: {forecast_horizon_s!r} is not allowed; use > 0"
            )
        self.series = series
        self.forecast_horizon_s = float(forecast_horizon_s)
        self.forecaster = forecaster
        self._now = now
        self._fixed_now: datetime | None = None
        duration_s = series.end_s - series.start_s
        whole_days_s = math.floor(duration_s / _DAY_S) * _DAY_S
        self.wrap_period_s = whole_days_s if whole_days_s > 0 else duration_s

    @property
    def region(self) -> str:
        """The trace's name (``"CISO"``, ``"DE"``, ``"FR"`` or the file stem)."""
        return self.series.name

    def __repr__(self) -> str:
        return (
            f"TraceProvider(region={self.region!r}, forecaster={self.forecaster!r}, "
            f"start={self.series.start.isoformat()}, end={self.series.end.isoformat()})"
        )

    def set_now(self, t: datetime | None) -> None:
        """Fix "now" to ``t`` (``None`` returns to the ``now`` callable or the wall clock)."""
        self._fixed_now = as_utc(t) if t is not None else None

    def now(self) -> datetime:
        """The provider's current time (UTC), before wrapping into the trace."""
        if self._fixed_now is not None:
            return self._fixed_now
        if self._now is not None:
            return as_utc(self._now())
        return datetime.now(timezone.utc)

    def latest(self) -> IntensityPoint:
        """The value of the interval containing now, timed at that interval's start."""
        now_s = self.now().timestamp()
        return self._points(now_s, now_s, PointKind.MEASURED)[0]

    def history(self, start: datetime, end: datetime) -> list[IntensityPoint]:
        """Points of the intervals overlapping ``[start, end)``, in time order.

        Args:
            start: the earliest time wanted.
            end: the end of the range; capped at now (the interval containing now is
                included): the future is the forecast's business.

        Returns:
            Measured (or estimated) points, wrapped around the trace as needed.
        """
        now_s = self.now().timestamp()
        start_s, end_s = as_utc(start).timestamp(), as_utc(end).timestamp()
        if end_s >= now_s:
            if start_s > now_s:
                return []
            return self._points(start_s, now_s, PointKind.MEASURED, include_end=True)
        if end_s <= start_s:
            return []
        return self._points(start_s, end_s, PointKind.MEASURED)

    def forecast(self, horizon_s: float | None = None) -> list[IntensityPoint]:
        """Forecast points from the interval containing now until now + ``horizon_s``.

        Args:
            horizon_s: how far ahead; defaults to ``forecast_horizon_s``.

        Returns:
            ``FORECAST`` points: the trace's own values (``"perfect"``) or the daily profile
            fitted on the previous week up to now (``"daily"``).
        """
        now_s = self.now().timestamp()
        horizon = self.forecast_horizon_s if horizon_s is None else float(horizon_s)
        points = self._points(now_s, now_s + horizon, PointKind.FORECAST)
        if self.forecaster == "perfect":
            return points
        model = DailyProfileForecaster(source=f"trace:{self.region}:daily")
        past = self._points(now_s - 7 * _DAY_S, now_s, PointKind.MEASURED, include_end=True)
        times_s = np.array([p.time.timestamp() for p in past], dtype=np.float64)
        values = np.array([p.intensity_g_per_kwh for p in past], dtype=np.float64)
        model.fit_arrays(times_s, values)
        predicted = model.predict_arrays(np.array([p.time.timestamp() for p in points]))
        return [
            IntensityPoint(p.time, float(v), PointKind.FORECAST, model.source)
            for p, v in zip(points, predicted, strict=True)
        ]

    def _region(self, t_s: float) -> tuple[float, float]:
        """How a caller time maps into the trace: ``(offset_s, region_end_s)``.

        Inside the trace the offset is 0; outside it is a whole number of wrap periods,
        and the caller time ``t_s`` reads the trace at ``t_s - offset_s`` until
        ``region_end_s`` (caller frame), where the mapping changes.
        """
        series = self.series
        if series.start_s <= t_s < series.end_s:
            return 0.0, series.end_s
        k = math.floor((t_s - series.start_s) / self.wrap_period_s)
        if series.start_s + (k + 1) * self.wrap_period_s <= t_s:  # rounding at a boundary
            k += 1
        offset_s = k * self.wrap_period_s
        return offset_s, series.start_s + offset_s + self.wrap_period_s

    def _points(
        self, start_s: float, end_s: float, kind: PointKind, include_end: bool = False
    ) -> list[IntensityPoint]:
        """Points of the intervals from the one containing ``start_s`` to those starting
        before ``end_s`` (or at it, with ``include_end``), in the caller's time frame.

        Rows are followed one by one, whatever their spacing; where the mapping into the
        trace changes (wrapping past its end), a point starts at the caller time of the
        change.
        """
        series = self.series
        side: Literal["left", "right"] = "right" if include_end else "left"
        points: list[IntensityPoint] = []
        t_s = start_s
        while True:
            offset_s, region_end_s = self._region(t_s)
            local_s = t_s - offset_s
            row = int(np.searchsorted(series.times_s, local_s, side="right")) - 1
            row = min(max(row, 0), len(series) - 1)
            lead_s = float(series.times_s[row]) + offset_s if not points else t_s
            points.append(series._point(row, lead_s, kind))
            if region_end_s > end_s:
                stop = int(np.searchsorted(series.times_s, end_s - offset_s, side=side))
            else:
                stop = int(np.searchsorted(series.times_s, region_end_s - offset_s, side="left"))
            for i in range(row + 1, stop):
                points.append(series._point(i, float(series.times_s[i]) + offset_s, kind))
            beyond = region_end_s > end_s or (region_end_s == end_s and not include_end)
            if beyond:
                return points
            t_s = region_end_s
