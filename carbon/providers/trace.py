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
from carbon.forecast import DailyProfileForecaster
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
    """A carbon-intensity time series, sorted by time, with a regular step.

    Each value holds from its time until the next one (step/hold); the last one holds for
    one period.

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
        """The typical step between rows in seconds (the median gap)."""
        return float(np.median(np.diff(self.times_s)))

    @property
    def start(self) -> datetime:
        """The start of the first interval (UTC)."""
        return datetime.fromtimestamp(float(self.times_s[0]), tz=timezone.utc)

    @property
    def end(self) -> datetime:
        """The end of the last interval (its start plus one period), UTC."""
        return datetime.fromtimestamp(float(self.times_s[-1]) + self.period_s, tz=timezone.utc)

    def __len__(self) -> int:
        return int(self.times_s.size)

    def index_at(self, t_s: float) -> int:
        """The row whose interval contains ``t_s`` (epoch seconds).

        Raises:
            NoDataError: if ``t_s`` is outside ``[start, end)``.
        """
        if not self.times_s[0] <= t_s < self.times_s[-1] + self.period_s:
            raise NoDataError(
                f"{datetime.fromtimestamp(t_s, tz=timezone.utc).isoformat()} is outside the "
                f"trace {self.name!r} ({self.start.isoformat()} .. {self.end.isoformat()})",
                provider="trace",
            )
        return int(np.searchsorted(self.times_s, t_s, side="right")) - 1

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
        forecast_horizon_s: float = 48 * 3600.0,
        forecaster: Literal["perfect", "daily"] = "perfect",
    ) -> None:
        if forecaster not in ("perfect", "daily"):
            raise CarbonConfigError(f"forecaster must be 'perfect' or 'daily'; got {forecaster!r}")
        if forecast_horizon_s <= 0:
            raise CarbonConfigError(f"forecast_horizon_s must be > 0; got {forecast_horizon_s!r}")
        self.series = series
        self.forecast_horizon_s = float(forecast_horizon_s)
        self.forecaster = forecaster
        self._now = now
        self._fixed_now: datetime | None = None
        duration_s = float(series.times_s[-1]) + series.period_s - float(series.times_s[0])
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

    def _wrap(self, times_s: FloatArray) -> FloatArray:
        """Map caller times into the trace (identity inside it)."""
        origin = float(self.series.times_s[0])
        end = float(self.series.times_s[-1]) + self.series.period_s
        inside = (times_s >= origin) & (times_s < end)
        return np.where(inside, times_s, origin + np.mod(times_s - origin, self.wrap_period_s))

    def _points(
        self, start_s: float, end_s: float, kind: PointKind, include_end: bool = False
    ) -> list[IntensityPoint]:
        """Points of the intervals from the one containing ``start_s`` to those starting
        before ``end_s`` (or at it, with ``include_end``), in the caller's time frame."""
        series = self.series
        period = series.period_s
        wrapped_start = float(self._wrap(np.array([start_s]))[0])
        first_s = start_s - (wrapped_start - float(series.times_s[series.index_at(wrapped_start)]))
        if include_end:
            count = math.floor((end_s - first_s) / period + 1e-9) + 1
        else:
            count = max(1, math.ceil((end_s - first_s) / period - 1e-9))
        times_s = first_s + period * np.arange(count, dtype=np.float64)
        indices = np.searchsorted(series.times_s, self._wrap(times_s), side="right") - 1
        return [
            series._point(int(i), float(t), kind) for i, t in zip(indices, times_s, strict=True)
        ]
