"""The read-only phases: what a GPU's readings do, at the settings it has.

Each phase reads the GPU (through a read-only view in a read-only run) while it idles,
trains the workload, or runs square waves of load, and writes its part of the result.
None of them changes a setting.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from gpu_calibration.benches import Wave, read, readers, sample
from gpu_calibration.run import (
    Run,
    counter_period_s,
    distribution,
    poll,
    reason_names,
    window,
    zero_delta_share,
)
from lightning_energy.errors import NotSupportedError

__all__ = [
    "SQUARE_WAVES",
    "ZERO_DELTA_WINDOWS_S",
    "clock_behaviour",
    "counter",
    "identity",
    "nvml_call_cost",
    "power_readings",
    "power_square_waves",
    "processes",
    "workload_step",
]

ZERO_DELTA_WINDOWS_S = (0.005, 0.02, 0.05, 0.1, 0.5)
#: ``(on_s, off_s)`` of the square waves of load.
SQUARE_WAVES = ((0.05, 0.05), (0.01, 0.09))
# Calls timed per reading (after a few untimed ones).
_CALLS = 1000
_WARM_CALLS = 20
# The counter integrates all of the time when it agrees with the integrated instantaneous
# power within this much (a counter that sampled power at its period would miss a 10 ms
# pulse in every 100 ms, or catch it, by far more).
_INTEGRATES_PCT = 5.0


def identity(run: Run) -> None:
    """The GPU's name and UUIDs (torch's and NVML's), limits, clocks and settings now."""
    bench = run.bench
    mapping = bench.identity()
    run.result["gpu"] = {"name": mapping["name"], "uuid": mapping["nvml_uuid"]}
    run.result["mapping"] = mapping
    if mapping["uuid_match"] is False:
        run.problems.append(
            f"torch device UUID {mapping['torch_uuid']} is not NVML's {mapping['nvml_uuid']}"
        )
    gpu = bench.gpu
    lo, hi = gpu.power_limit_constraints_w()
    supported = read(gpu.supported_sm_clocks_mhz) or []
    run.result["limits"] = {
        "min_power_limit_w": lo,
        "max_power_limit_w": hi,
        "default_power_limit_w": gpu.default_power_limit_w(),
        "pre_job_power_limit_w": gpu.power_limit_w(),
        "enforced_power_limit_w": read(gpu.enforced_power_limit_w),
    }
    run.result["clocks"] = {
        "supported_sm_clocks_mhz": supported,
        "max_sm_clock_mhz": supported[0] if supported else None,
        "min_sm_clock_mhz": supported[-1] if supported else None,
        "foreign_clock_setting": read(gpu.foreign_clock_setting),
    }
    run.result["persistence_mode"] = bench.persistence_mode()


def processes(run: Run) -> None:
    """The processes NVML lists on the GPU against this process's own id (inside a
    container NVML may list host ids, so our own may be missing)."""
    pids = run.bench.process_ids()
    own = os.getpid()
    run.result["processes"] = {
        "nvml_pids": pids,
        "own_pid": own,
        "own_pid_listed": None if pids is None else own in pids,
        "other_pids": None if pids is None else [p for p in pids if p != own],
    }


def nvml_call_cost(run: Run) -> None:
    """Wall time per call of each reading a controller makes, the GPU idle (us)."""
    run.need(2.0, "timing the calls")
    costs: dict[str, Any] = {}
    for name, call in readers(run.bench.gpu).items():
        try:
            for _ in range(_WARM_CALLS):
                call()
        except NotSupportedError as exc:
            costs[name] = {"supported": False, "reason": str(exc)}
            continue
        times_us = []
        for _ in range(_CALLS):
            start = time.perf_counter_ns()
            call()
            times_us.append((time.perf_counter_ns() - start) / 1000.0)
        costs[name] = {"supported": True, "us": distribution(times_us)}
    run.result["nvml_call_cost"] = costs


def _counter_behaviour(samples: Sequence[tuple[float, float]]) -> dict[str, Any]:
    return {
        "period_s": counter_period_s(samples),
        "samples": len(samples),
        "poll_interval_s": (samples[-1][0] - samples[0][0]) / max(1, len(samples) - 1),
        "zero_delta_share": {
            f"{w * 1000:g}ms": zero_delta_share(samples, w) for w in ZERO_DELTA_WINDOWS_S
        },
    }


def counter(run: Run) -> None:
    """The energy counter's period and zero-delta shares, polled idle and under load."""
    bench = run.bench
    duration_s = 3.0
    run.need(2 * duration_s + 1, "polling the counter idle and under load")
    bench.wait(0.5)  # past the last work
    idle = poll(bench.now, bench.wait, duration_s, 0.001, bench.gpu.energy_j)
    with bench.loaded():
        bench.wait(0.2)
        load = poll(bench.now, bench.wait, duration_s, 0.001, bench.gpu.energy_j)
    behaviour = {"idle": _counter_behaviour(idle), "load": _counter_behaviour(load)}
    period = behaviour["load"]["period_s"]
    run.result["counter"] = {"period_s": period, **behaviour}
    if period is None:
        run.problems.append("the energy counter did not move three times in 3 s under load")
    else:
        run.period_s = period


def _readings(run: Run, duration_s: float, interval_s: float) -> dict[str, Any]:
    """Over one interval of the load running now: counter energy / time, the integrated
    instantaneous power field, the mean of ``nvmlDeviceGetPowerUsage``."""
    bench = run.bench
    gpu = bench.gpu
    instant_w = readers(gpu)["instant_power"]
    try:
        instant_w()
        instant = True
    except NotSupportedError:
        instant, instant_w = False, lambda: math.nan
    start_j, start_s = gpu.energy_j(), bench.now()
    samples = poll(
        bench.now, bench.wait, duration_s, interval_s, lambda: (instant_w(), gpu.power_w())
    )
    counter_w = (gpu.energy_j() - start_j) / (bench.now() - start_s)
    integrated_w = low_w = high_w = None
    if instant:
        joules = sum(p0[0] * (t1 - t0) for (t0, p0), (t1, _) in itertools.pairwise(samples))
        integrated_w = joules / (samples[-1][0] - samples[0][0])
        low_w = min(p for _, (p, _) in samples)
        high_w = max(p for _, (p, _) in samples)
    usage_w = statistics.fmean(p for _, (_, p) in samples)

    def error_pct(value: float | None, reference: float | None) -> float | None:
        if value is None or not reference:
            return None
        return 100.0 * (value - reference) / reference

    return {
        "interval_s": duration_s,
        "poll_interval_s": interval_s,
        "counter_w": counter_w,
        "instant_power_available": instant,
        "instant_integrated_w": integrated_w,
        "instant_min_w": low_w,
        "instant_max_w": high_w,
        "power_usage_mean_w": usage_w,
        "instant_vs_counter_pct": error_pct(integrated_w, counter_w),
        "power_usage_vs_counter_pct": error_pct(usage_w, counter_w),
    }


def power_readings(run: Run) -> None:
    """Idle power from the counter; under steady load the counter against the integrated
    instantaneous power field and against ``nvmlDeviceGetPowerUsage`` (a 1 s average on
    Ampere and Hopper)."""
    bench = run.bench
    gpu = bench.gpu
    duration_s = max(4.0, 20 * run.period_s)
    run.need(duration_s + run.window_s + 4, "an idle window and the readings under load")
    bench.wait(max(1.0, 2 * run.period_s))  # the counter catches up with the work before
    start_j, start_s = gpu.energy_j(), bench.now()
    bench.wait(run.window_s)
    run.result["idle_power_w"] = (gpu.energy_j() - start_j) / (bench.now() - start_s)
    with bench.loaded():
        bench.wait(1.5)  # past the 1 s average of the power usage
        run.result["power_readings"] = _readings(run, duration_s, 0.01)


def _wave_name(wave: tuple[float, float]) -> str:
    on_s, off_s = wave
    return f"{on_s * 1000:g}/{off_s * 1000:g}ms"


def power_square_waves(run: Run) -> None:
    """The same readings under square waves of load (50/50 and 10/90 ms on/off), sampled
    every millisecond: does the counter integrate all of the time, or sample?"""
    bench = run.bench
    duration_s = max(4.0, 40 * run.period_s)
    waves: dict[str, Any] = {}
    run.result["power_square_waves"] = waves
    for wave in SQUARE_WAVES:
        run.need(duration_s + 1.5, f"the {_wave_name(wave)} square wave")
        load: Wave = wave
        with bench.loaded(load):
            bench.wait(1.2)  # past the 1 s average of the power usage
            readings = _readings(run, duration_s, 0.001)
        error = readings["instant_vs_counter_pct"]
        waves[_wave_name(wave)] = {
            "on_s": wave[0],
            "off_s": wave[1],
            "duty": wave[0] / (wave[0] + wave[1]),
            **readings,
            "counter_integrates_all_time": None if error is None else abs(error) <= _INTEGRATES_PCT,
        }


def _clock_behaviour(samples: Sequence[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    clocks = [s["sm_clock_mhz"] for _, s in samples if s["sm_clock_mhz"] is not None]
    seen: dict[str, int] = {}
    for _, reading in samples:
        for name in reason_names(reading["reasons"]) or []:
            seen[name] = seen.get(name, 0) + 1
    return {
        "samples": len(samples),
        "sm_clock_mhz": distribution(clocks),
        "reasons_share": {name: count / len(samples) for name, count in sorted(seen.items())},
    }


def clock_behaviour(run: Run) -> None:
    """SM clock and clock event reasons, sampled every 10 ms idle and under load."""
    bench = run.bench
    run.need(4.0, "sampling clocks idle and under load")
    bench.wait(0.5)
    idle = poll(bench.now, bench.wait, 1.0, 0.01, lambda: sample(bench.gpu))
    with bench.loaded():
        bench.wait(0.3)
        load = poll(bench.now, bench.wait, 1.0, 0.01, lambda: sample(bench.gpu))
    run.result["clock_behaviour"] = {"idle": _clock_behaviour(idle), "load": _clock_behaviour(load)}


def workload_step(run: Run) -> None:
    """The workload's time and energy per step at the GPU's own settings."""
    run.requires("limits")
    run.need(run.window_s + 3, "one measurement window")
    gpu = run.bench.gpu
    run.result["workload_step"] = {
        "power_limit_w": gpu.power_limit_w(),
        "enforced_power_limit_w": read(gpu.enforced_power_limit_w),
        **window(run),
    }
