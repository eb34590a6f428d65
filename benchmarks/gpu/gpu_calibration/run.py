"""The calibration being made, how its phases run, and the measurements they share.

A :class:`Run` holds the result document, the phases skipped (and why), the problems found,
the setter calls refused, and the budget. :func:`run_phases` runs phases in order, each
within its own budget (and what is left of the total): a phase that raises :class:`Skip`
is recorded as skipped with the reason; any other exception as a failed phase (a problem,
with the traceback's tail in ``errors``), and the next phase runs. :class:`Interrupted`
(SIGTERM, SIGINT) and ``KeyboardInterrupt`` end the run: the phases left are recorded as
skipped, the guard (if any) restores, and the caller writes the partial result.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpu_calibration.benches import sample

if TYPE_CHECKING:
    from gpu_calibration.benches import Bench
    from gpu_calibration.read_only import RefusedCalls
    from lightning_energy.device.guard import GPUGuard

__all__ = [
    "REASONS",
    "Interrupted",
    "Options",
    "Phase",
    "Run",
    "Skip",
    "counter_period_s",
    "distribution",
    "poll",
    "reason_names",
    "run_phases",
    "signals_deferred",
    "window",
    "zero_delta_share",
]

#: NVML clock event (formerly throttle) reason bits, as nvml.h names them
#: (``nvmlClocksEventReason*``; the last two only as ``nvmlClocksThrottleReason*``).
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}
_TRACEBACK_CHARS = 3000


def reason_names(bits: int | None) -> list[str] | None:
    """The names of the clock event reason bits set in ``bits``; bits NVML did not
    define when this was written appear in hex. None stays None."""
    if bits is None:
        return None
    names = [name for bit, name in REASONS.items() if bits & bit]
    unknown = bits & ~sum(REASONS)
    return names + ([f"0x{unknown:x}"] if unknown else [])


class Skip(Exception):
    """A phase cannot run here; its message is the reason recorded in ``skipped``."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived: the run stops, restores and writes what it has.

    Args:
        signal_name: ``"SIGTERM"`` or ``"SIGINT"``.
    """

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@dataclass(frozen=True)
class Options:
    """What the command line asked for, as the phases need it.

    Attributes:
        change_settings: run the phases that change settings (a GPU the user owns).
        force: change settings although other processes compute on the GPU.
        limit_points: power limits swept.
        clock_points: SM clocks swept.
        lease_dir: the lease directory (private to the run unless given).
        script: the calibration script (restore-check children run it).
    """

    change_settings: bool = False
    force: bool = False
    limit_points: int = 5
    clock_points: int = 6
    lease_dir: str = ""
    script: str = ""


@dataclass(frozen=True)
class Phase:
    """One phase of the calibration.

    Attributes:
        name: its key in the result (and in ``skipped``).
        budget_s: the most seconds it may take (on the GPU's clock).
        needs_s: the least it needs to be worth starting.
        run: the measurement; raises :class:`Skip` when it cannot run here.
    """

    name: str
    budget_s: float
    needs_s: float
    run: Callable[[Run], None]


@dataclass
class Run:
    """The calibration being made.

    Attributes:
        bench: the GPU and its workload.
        options: the command line's choices.
        total_s: seconds for every phase together.
        refused: setter calls refused (read-only runs).
        result: the document written.
        problems: failed checks, in words.
        skipped: phase -> why it did not run (or stopped).
        errors: phase -> the end of the traceback of the exception that stopped it.
        guard: the guard changing settings (``--change-settings``, after ``permissions``).
        period_s: the energy counter's period (measured by ``counter``).
        interrupted: the signal that ended the run, if any.
    """

    bench: Bench
    options: Options
    total_s: float
    refused: RefusedCalls
    result: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    guard: GPUGuard | None = None
    period_s: float = 0.1
    interrupted: str | None = None
    start_s: float = field(init=False)
    _phase_end_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.start_s = self.bench.now()
        self._phase_end_s = math.inf

    def total_left_s(self) -> float:
        """Seconds left of the whole run."""
        return self.total_s - (self.bench.now() - self.start_s)

    def left_s(self) -> float:
        """Seconds left for the phase running (its budget, or the run's if less)."""
        return min(self.total_left_s(), self._phase_end_s - self.bench.now())

    def fits(self, seconds: float) -> bool:
        """Whether ``seconds`` more fit in the phase running."""
        return self.left_s() >= seconds

    def need(self, seconds: float, what: str) -> None:
        """Raise :class:`Skip` unless ``seconds`` fit for ``what``."""
        if not self.fits(seconds):
            raise Skip(f"budget: {what} needs {seconds:.0f} s, {self.left_s():.0f} s left")

    def requires(self, *keys: str) -> None:
        """Raise :class:`Skip` unless the result has ``keys`` (measured by earlier phases)."""
        missing = [k for k in keys if k not in self.result]
        if missing:
            raise Skip(f"needs {', '.join(missing)}, which an earlier phase did not measure")

    @property
    def window_s(self) -> float:
        """A measurement window: 50 counter periods (2 % quantisation), at least 2 s."""
        return max(2.0, 50 * self.period_s)

    def skip(self, phase: str, reason: str) -> None:
        """Record that ``phase`` did not run (or stopped), and why."""
        self.skipped[phase] = reason

    def run_phase(self, phase: Phase) -> None:
        """Run ``phase`` within its budget; record a skip or a failure."""
        if self.total_left_s() < phase.needs_s:
            self.skip(
                phase.name,
                f"budget: needs {phase.needs_s:.0f} s, {self.total_left_s():.0f} s left",
            )
            return
        wall_start = time.perf_counter()
        self._phase_end_s = self.bench.now() + phase.budget_s
        try:
            phase.run(self)
        except Skip as exc:
            self.skip(phase.name, str(exc))
        except Exception as exc:  # the next phases still run; the guard restores at the end
            self.problems.append(f"{phase.name}: {type(exc).__name__}: {exc}")
            self.skip(phase.name, f"failed: {type(exc).__name__}: {exc}")
            self.errors[phase.name] = traceback.format_exc()[-_TRACEBACK_CHARS:]
        finally:
            self._phase_end_s = math.inf
            self.phase_seconds[phase.name] = round(time.perf_counter() - wall_start, 3)


def run_phases(
    run: Run, phases: Sequence[Phase], after_each: Callable[[], None] = lambda: None
) -> None:
    """Run ``phases`` in order, calling ``after_each`` after every one (to write the
    partial result). An interrupt records the phase running and those left as skipped
    and ends the loop; the guard restores in any case."""
    names = [p.name for p in phases]
    done = 0
    try:
        for phase in phases:
            run.run_phase(phase)
            done += 1
            after_each()
    except (Interrupted, KeyboardInterrupt) as exc:
        run.interrupted = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
        for name in names[done:]:
            run.skip(name, f"interrupted by {run.interrupted}")
    finally:
        if run.guard is not None:
            run.guard.restore()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT wait until the block has ended (for steps that must not be cut
    short, such as ending a child process that holds a change)."""
    signals = {signal.SIGTERM, signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# --------------------------------------------------------------------------- measurements
def poll(
    now: Callable[[], float],
    wait: Callable[[float], None],
    duration_s: float,
    interval_s: float,
    read: Callable[[], Any],
) -> list[tuple[float, Any]]:
    """``(time, read())`` every ``interval_s`` for ``duration_s``."""
    samples = []
    end_s = now() + duration_s
    while now() < end_s:
        samples.append((now(), read()))
        wait(interval_s)
    return samples


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean, minimum, median, 99th percentile and maximum of ``values`` (None
    when empty)."""
    if not values:
        return {"n": 0, "mean": None, "min": None, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "n": len(ordered),
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
        "p50": statistics.median(ordered),
        "p99": p99,
        "max": ordered[-1],
    }


def zero_delta_share(samples: Sequence[tuple[float, float]], window_s: float) -> float | None:
    """Share of windows of ``window_s`` (one starting at each sample) whose counter delta is
    zero; None when the samples span fewer than ten windows."""
    times = [t for t, _ in samples]
    zeros = total = 0
    j = 0
    for i, (t, value) in enumerate(samples):
        while j < len(samples) and times[j] < t + window_s:
            j += 1
        if j == len(samples):
            break
        j = max(j, i + 1)
        total += 1
        zeros += samples[j][1] == value
    return zeros / total if total >= 10 else None


def counter_period_s(samples: Sequence[tuple[float, float]]) -> float | None:
    """The median time between changes of the counter (None: fewer than 3 changes)."""
    changes = [t for (_, prev), (t, v) in itertools.pairwise(samples) if v != prev]
    intervals = [b - a for a, b in itertools.pairwise(changes)]
    return statistics.median(intervals) if len(intervals) >= 2 else None


def window(run: Run) -> dict[str, Any]:
    """Training steps for one measurement window under the settings in force: time and
    energy per step, and the mean readings (after 2 steps and 0.5 s settling)."""
    bench = run.bench
    gpu = bench.gpu
    for _ in range(2):
        bench.step()
    bench.synchronize()
    settle_end = bench.now() + 0.5
    while bench.now() < settle_end:
        bench.step()
        bench.synchronize()
    start_j, start_s = gpu.energy_j(), bench.now()
    steps, clocks, temps, reasons = 0, [], [], 0
    while bench.now() - start_s < run.window_s or steps < 3:
        bench.step()
        reading = sample(gpu)
        bench.synchronize()
        steps += 1
        if reading["sm_clock_mhz"] is not None:
            clocks.append(reading["sm_clock_mhz"])
        if reading["temperature_c"] is not None:
            temps.append(reading["temperature_c"])
        reasons |= reading["reasons"] or 0
    duration_s = bench.now() - start_s
    energy_j = gpu.energy_j() - start_j
    return {
        "steps": steps,
        "time_per_step_s": duration_s / steps,
        "energy_per_step_j": energy_j / steps,
        "power_w": energy_j / duration_s,
        "sm_clock_mhz": statistics.fmean(clocks) if clocks else None,
        "throttle_reasons": reason_names(reasons),
        "temperature_c": max(temps) if temps else None,
    }
