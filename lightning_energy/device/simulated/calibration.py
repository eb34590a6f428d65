"""A simulated GPU built from a calibration run on a real one.

``benchmarks/gpu/calibrate.py`` measures a real GPU (its energy counter's period, idle
power, power-limit range, clock range, and a training step's time and power across power
limits and locked SM clocks) and writes one JSON file. :func:`load_calibration` reads such
a file back and :class:`CalibratedModel` replays it as a simulated GPU's model, so that
``device: {backend: simulated, calibration: FILE}`` simulates the measured GPU (a file of a
read-only run, which sweeps no setting, cannot: its sweeps come from ``--change-settings``):

* every sweep row (a power limit or a locked clock) gives a point ``(SM clock, time per
  step, power)``; power at a clock is interpolated linearly between the measured clocks
  (extrapolated along the outer segments, never below the idle power);
* the step's compute-bound share ``beta`` is fitted to the measured times
  (``t(f) / t(f_max) - 1 = beta * (f_max / f - 1)``, least squares); a step takes the
  measured time at the maximum clock;
* a power limit caps the clock as in the physics model: work runs at the highest
  supported clock (at most a lock's upper bound) whose interpolated power fits under it;
* the board (:class:`~.simulated.Board`) has the measured counter period, the measured
  setting latency, and the instantaneous power field when the driver had it (then
  ``nvmlDeviceGetPowerUsage`` is taken to be a 1 s average, as on Ampere and Hopper;
  without it, the power drawn now, as on Volta).

Power is that of the calibrated workload at each clock, whatever the compute-bound share
of the work run on it (other work takes its own time but draws the calibrated power).

Example:
    >>> calibration = load_calibration("runs/calibration.json")  # doctest: +SKIP
    >>> calibration.model.max_power_limit_w  # doctest: +SKIP
    700.0
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_energy.device.simulated.clocked_model import ClockedModel
from lightning_energy.errors import ConfigError
from lightning_energy.numbers import is_finite

__all__ = ["CALIBRATION_FORMAT", "CalibratedModel", "Calibration", "load_calibration"]

#: The ``format`` field every calibration file carries.
CALIBRATION_FORMAT = "lightning-energy-calibration/1"

_SWEEPS = ("power_limit_sweep", "clock_sweep")


@dataclass(frozen=True)
class CalibratedModel(ClockedModel):
    """Time and power of work on a calibrated GPU (a :class:`~.simulated.GPUModel`).

    Attributes:
        name: the GPU's name with ``" (calibrated)"`` appended.
        sm_clocks_mhz: supported SM clocks, descending.
        min_power_limit_w: lowest power limit the GPU accepts.
        max_power_limit_w: highest power limit the GPU accepts.
        default_power_limit_w: the vendor default power limit.
        idle_power_w: measured power of the GPU doing nothing.
        points: measured ``(sm_clock_mhz, power_w)`` of the calibrated step, ascending
            clocks, one per clock.
        step_time_s: duration of one step at the maximum clock.
        step_compute_bound_share: the fitted compute-bound share of that step.
    """

    name: str
    sm_clocks_mhz: tuple[int, ...]
    min_power_limit_w: float
    max_power_limit_w: float
    default_power_limit_w: float
    idle_power_w: float
    points: tuple[tuple[float, float], ...]
    step_time_s: float
    step_compute_bound_share: float

    def __post_init__(self) -> None:
        problems = self.step_problems()
        if problems:
            raise ConfigError(problems, source=f"calibrated model {self.name!r}")

    def power_w(self, freq_mhz: float) -> float:
        """Power of the calibrated step at ``freq_mhz`` (interpolated, never below idle)."""
        clocks = [f for f, _ in self.points]
        if len(self.points) == 1:
            return self.points[0][1]
        k = min(max(bisect.bisect_left(clocks, freq_mhz), 1), len(clocks) - 1)
        (f0, p0), (f1, p1) = self.points[k - 1], self.points[k]
        power_w = p0 + (p1 - p0) * (freq_mhz - f0) / (f1 - f0)
        return max(self.idle_power_w, power_w)

    def work_power_w(self, compute_bound_share: float, freq_mhz: float) -> float:
        """The calibrated step's power at ``freq_mhz``, whatever the work's compute-bound
        share (see the module's docstring)."""
        return self.power_w(freq_mhz)


@dataclass(frozen=True)
class Calibration:
    """What a calibration file says, as far as a simulated GPU needs it.

    Attributes:
        path: the file read.
        gpu_name: the measured GPU's name.
        energy_counter_period_s: how often its energy counter moved.
        instant_power: whether its driver had the instantaneous power field.
        setting_latency_s: the longest measured set-limit / set-clock latency (0: none
            measured).
        model: the calibrated model.
    """

    path: Path
    gpu_name: str
    energy_counter_period_s: float
    instant_power: bool
    setting_latency_s: float
    model: CalibratedModel


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Reads fields of a calibration document, collecting every problem."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def section(self, data: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
        value = data.get(key)
        if not isinstance(value, Mapping):
            shown = "missing" if key not in data else f"{_shown(value)} is not allowed"
            self.problems.append(f"{key}: {shown}; use an object as calibrate.py writes it")
            return None
        return value

    def number(
        self,
        data: Mapping[str, Any],
        key: str,
        where: str,
        *,
        low: float = 0.0,
        strict: bool = True,
        optional: bool = False,
    ) -> float | None:
        value = data.get(key)
        if value is None and optional:
            return None
        number = float(value) if is_finite(value) else math.nan
        if not (number > low if strict else number >= low):
            shown = "missing" if key not in data else f"{_shown(value)} is not allowed"
            bound = f"> {low:g}" if strict else f">= {low:g}"
            name = f"{where}.{key}" if where else key
            self.problems.append(f"{name}: {shown}; use a finite number {bound}")
            return None
        return number

    def clocks(self, data: Mapping[str, Any], where: str) -> tuple[int, ...]:
        value = data.get("supported_sm_clocks_mhz")
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(f, int) and is_finite(f) and f > 0 for f in value)
        ):
            shown = (
                "missing"
                if "supported_sm_clocks_mhz" not in data
                else f"{_shown(value)} is not allowed"
            )
            self.problems.append(
                f"{where}.supported_sm_clocks_mhz: {shown}; use a non-empty list of positive "
                "integer MHz"
            )
            return ()
        return tuple(sorted(set(value), reverse=True))

    def rows(self, data: Mapping[str, Any]) -> list[tuple[float, float, float]]:
        """``(sm_clock_mhz, time_per_step_s, power_w)`` of every sweep row."""
        points: list[tuple[float, float, float]] = []
        for sweep in _SWEEPS:
            rows = data.get(sweep, [])
            if not isinstance(rows, list):
                self.problems.append(
                    f"{sweep}: {_shown(rows)} is not allowed; use a list of rows (objects)"
                )
                continue
            for i, row in enumerate(rows):
                where = f"{sweep}[{i}]"
                if not isinstance(row, Mapping):
                    self.problems.append(f"{where}: {_shown(row)} is not allowed; use an object")
                    continue
                clock = self.number(row, "sm_clock_mhz", where)
                time_s = self.number(row, "time_per_step_s", where)
                power_w = self.number(row, "power_w", where)
                if clock is not None and time_s is not None and power_w is not None:
                    points.append((clock, time_s, power_w))
        return points


def _fit(
    points: Sequence[tuple[float, float, float]], max_clock_mhz: int
) -> tuple[tuple[tuple[float, float], ...], float, float]:
    """Per-clock mean power, the step time at the maximum clock and the fitted ``beta``."""
    by_clock: dict[float, list[tuple[float, float]]] = {}
    for clock, time_s, power_w in points:
        by_clock.setdefault(clock, []).append((time_s, power_w))
    table = sorted(
        (clock, sum(t for t, _ in rows) / len(rows), sum(p for _, p in rows) / len(rows))
        for clock, rows in by_clock.items()
    )
    top_clock, top_time_s, _ = table[-1]
    # Time scales as beta * f_max / f + (1 - beta); fit on the ratios to the top clock.
    xs = [top_clock / clock - 1.0 for clock, _, _ in table]
    ys = [time_s / top_time_s - 1.0 for _, time_s, _ in table]
    sxx = sum(x * x for x in xs)
    beta = min(1.0, max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx)) if sxx else 1.0
    # The step time at f_max, from the top measured clock along the fitted curve.
    step_time_s = top_time_s / (beta * max_clock_mhz / top_clock + 1.0 - beta)
    return tuple((clock, power_w) for clock, _, power_w in table), step_time_s, beta


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file written by ``benchmarks/gpu/calibrate.py``.

    Args:
        path: the JSON file.

    Returns:
        The calibration, with its model built.

    Raises:
        ConfigError: the file is missing or unreadable, is not JSON, or a field is missing
            or out of range; every problem is named (key, bad value, what is allowed),
            each line starting with ``calibration``.
    """
    path = Path(path)
    where = f"calibration {str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{where}: no such file; use the path of a JSON file written by "
            "benchmarks/gpu/calibrate.py --out FILE"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{where}: cannot be read ({exc}); use a readable UTF-8 JSON file"
        ) from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            f"{where}: not JSON ({exc}); use the file benchmarks/gpu/calibrate.py wrote"
        ) from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: {_shown(data)} is not allowed; use a JSON object")
    if data.get("format") != CALIBRATION_FORMAT:
        raise ConfigError(
            f"{where}: format {_shown(data.get('format'))} is not allowed; use "
            f"{CALIBRATION_FORMAT!r} (a file written by benchmarks/gpu/calibrate.py)"
        )
    return _parse(data, path)


def _parse(data: Mapping[str, Any], path: Path) -> Calibration:
    read = _Reader()
    gpu = read.section(data, "gpu")
    name = None if gpu is None else gpu.get("name")
    if gpu is not None and (not isinstance(name, str) or not name.strip()):
        shown = "missing" if "name" not in gpu else f"{_shown(name)} is not allowed"
        read.problems.append(f"gpu.name: {shown}; use a non-empty string")
    counter = read.section(data, "counter")
    period_s = None
    if counter is not None:
        period_s = read.number(counter, "period_s", "counter", strict=False)
    idle_w = read.number(data, "idle_power_w", "")
    limits = read.section(data, "limits")
    bounds = [
        None if limits is None else read.number(limits, key, "limits")
        for key in ("min_power_limit_w", "default_power_limit_w", "max_power_limit_w")
    ]
    clocks_section = read.section(data, "clocks")
    clocks = () if clocks_section is None else read.clocks(clocks_section, "clocks")
    points = read.rows(data)
    readings = data.get("power_readings")
    instant = isinstance(readings, Mapping) and readings.get("instant_power_available") is True
    latency = data.get("setting_latency_s")
    latencies = []
    if isinstance(latency, Mapping):
        for key in ("set_power_limit_s", "set_locked_clocks_s"):
            value = read.number(latency, key, "setting_latency_s", strict=False, optional=True)
            if value is not None:
                latencies.append(value)
    lo, default, hi = bounds
    if lo is not None and default is not None and hi is not None and not lo <= default <= hi:
        read.problems.append(
            f"limits: (min, default, max)=({lo:g}, {default:g}, {hi:g}) W is not allowed; "
            "use min <= default <= max"
        )
    if not read.problems and len({clock for clock, _, _ in points}) < 2:
        read.problems.append(
            f"{' and '.join(_SWEEPS)}: {len(points)} usable row(s) at "
            f"{len({c for c, _, _ in points})} clock(s) is not enough; use rows at two or more "
            "SM clocks (each with sm_clock_mhz, time_per_step_s, power_w)"
            + (
                " (a read-only calibration sweeps nothing: run calibrate.py with "
                "--change-settings on a GPU you own)"
                if data.get("mode") == "read-only"
                else ""
            )
        )
    if read.problems:
        where = f"calibration {str(path)!r}"
        raise ConfigError([f"{where}: {p}" for p in read.problems], source=str(path))
    assert isinstance(name, str) and period_s is not None and idle_w is not None
    assert lo is not None and default is not None and hi is not None
    table, step_time_s, beta = _fit(points, clocks[0])
    model = CalibratedModel(
        name=f"{name} (calibrated)",
        sm_clocks_mhz=clocks,
        min_power_limit_w=lo,
        max_power_limit_w=hi,
        default_power_limit_w=default,
        idle_power_w=idle_w,
        points=table,
        step_time_s=step_time_s,
        step_compute_bound_share=beta,
    )
    return Calibration(
        path=path,
        gpu_name=name,
        energy_counter_period_s=period_s,
        instant_power=instant,
        setting_latency_s=max(latencies, default=0.0),
        model=model,
    )
