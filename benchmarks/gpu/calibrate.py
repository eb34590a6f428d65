"""Calibrate one real NVIDIA GPU, or a simulated one, in one command.

One set of phases runs on one of two backends: a real GPU (NVML for readings and settings,
a bf16 transformer block trained with torch as the workload) or, with ``--simulated
PRESET``, a simulated GPU on its virtual clock (simulated training steps), so the script is
tested on CPU and runs in seconds there. The phases, in order:

1. identity: the GPU's name and UUID, the torch device's UUID and whether they match
   (``lightning_energy.device.mapping``), persistence mode;
2. permissions: whether settings can be changed (a power-limit write of the current
   limit through the guard);
3. counter: the energy counter's update period, and the share of zero deltas over
   5/20/50/100/500 ms windows, under load;
4. readings: average power over one interval from the energy counter, from the integrated
   instantaneous power field, and from ``nvmlDeviceGetPowerUsage`` averaged; idle power;
5. power-limit sweep (from the pre-job limit down to the minimum): time and energy per
   step, actual SM clock, clock event (throttle) reasons, temperature;
6. locked-SM-clock sweep: the actual clock against the lock, time and power per step, the
   energy-optimal clock;
7. set-limit and set-clock latency (until the change shows in the SM clock);
8. restore checks through the guard, each in a child process: a normal exit, SIGTERM, and
   SIGKILL followed by ``lightning-energy recover`` (exact pre-job limit, lock released);
9. a short ``EnergyController`` run (power-limit profiling on the training loop) in which
   no profiling window may read zero energy;
10. the same sweeps computed by the matching simulated preset, with errors in %.

Settings phases (2, 5-8, 9's changes) need root or CAP_SYS_ADMIN; without it they are
skipped (said in ``skipped``) and nothing changes. Every change goes through the project's
guard (``GPUGuard``) with its lease in a private directory, and is undone in ``finally``,
on Ctrl-C and on SIGTERM. A GPU on which another process computes is only read unless
``--force``. Each phase has a budget in seconds taken from ``--budget-s``; a phase that
would overrun it is skipped.

Usage::

    python benchmarks/gpu/calibrate.py [--out runs/calibration.json] [--budget-s 420]
    python benchmarks/gpu/calibrate.py --simulated h200 --out sim.json

Exit status: 0 every check passed, 1 a check failed, 2 no CUDA / NVML / GPU, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import lightning_energy
from lightning_energy.device.base import GPU, DeviceSet
from lightning_energy.device.calibration import CALIBRATION_FORMAT
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.mapping import TorchCuda, normalise_uuid, nvml_gpu_for_device
from lightning_energy.device.nvml import NVMLGPU, nvml_gpus
from lightning_energy.device.physics import PHYSICS_PRESETS
from lightning_energy.device.simulated import SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.device.traces import TRACE_GPUS
from lightning_energy.errors import DeviceError, NotSupportedError

T = TypeVar("T")

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_INTERRUPTED = 0, 1, 2, 130
PRESETS = tuple(sorted([*PHYSICS_PRESETS, *TRACE_GPUS]))
ZERO_DELTA_WINDOWS_S = (0.005, 0.02, 0.05, 0.1, 0.5)
MAX_BUDGET_S = 480.0
DEFAULT_BUDGET_S = 420.0
# A child process (or recover) that takes longer than this to answer is given up on.
CHILD_TIMEOUT_S = 60.0
RESTORE_CHECKS_S = 45.0
# Names of NVML clock event (throttle) reason bits.
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
}
# Presets by the words of a GPU's name.
_NAME_TO_PRESET = (
    ("H200", "h200"),
    ("H100", "h100"),
    ("A100", "a100"),
    ("A40", "a40"),
    ("V100", "v100"),
)


def reason_names(bits: int | None) -> list[str] | None:
    """The names of the reason bits set in ``bits`` (None stays None)."""
    if bits is None:
        return None
    names = [name for bit, name in REASONS.items() if bits & bit]
    unknown = bits & ~sum(REASONS)
    return names + ([f"0x{unknown:x}"] if unknown else [])


def preset_for(name: str) -> str | None:
    """The simulated preset of a GPU's name, or None."""
    for word, preset in _NAME_TO_PRESET:
        if word in name.upper():
            return preset
    return None


# --------------------------------------------------------------------------- backends
class Bench(Protocol):
    """What the phases need from a backend: one GPU, its clock, its workload."""

    backend: str

    @property
    def gpu(self) -> GPU:
        """The GPU calibrated."""
        ...

    def now(self) -> float:
        """Seconds on the GPU's clock."""
        ...

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass (working when inside :meth:`loaded`)."""
        ...

    def loaded(self) -> contextlib.AbstractContextManager[None]:
        """Keep the GPU busy with the workload during the block."""
        ...

    def step(self) -> None:
        """Start one training step (it may still run when this returns)."""
        ...

    def synchronize(self) -> None:
        """Wait for the steps started."""
        ...

    def sample(self) -> dict[str, Any]:
        """SM clock, clock event reasons, temperature and power (the instantaneous field,
        else the driver's power usage) now; None when unreadable."""
        ...

    def instant_power_w(self) -> float:
        """The instantaneous power field (raises NotSupportedError without it)."""
        ...

    def identity(self) -> dict[str, Any]:
        """Name, UUIDs and whether torch and NVML name the same GPU."""
        ...

    def persistence_mode(self) -> bool | None:
        """Persistence mode (None: not applicable or unreadable)."""
        ...

    def other_processes(self) -> list[int]:
        """Other processes computing on the GPU."""
        ...

    def fresh_settings(self) -> tuple[float, bool]:
        """``(power limit in W, whether any clock lock is in force)`` read anew."""
        ...

    def child_args(self) -> list[str]:
        """Arguments by which a child process opens the same GPU."""
        ...

    def device_set(self) -> DeviceSet:
        """The GPU as the controller takes it."""
        ...

    def close(self) -> None:
        """Release what the backend holds."""
        ...


def _read(read: Callable[[], T]) -> T | None:
    """``read()``, or None when the GPU cannot answer."""
    try:
        return read()
    except DeviceError:
        return None


class SimulatedBench:
    """A simulated GPU (a preset) whose settings live in a state file, so that child
    processes share them as they would a real GPU's. Methods: see :class:`Bench`."""

    backend = "simulated"

    def __init__(self, preset: str, state_dir: str) -> None:
        self.preset = preset
        self.state_dir = state_dir
        (self.gpu,) = simulated_gpus(SimulatedSpec(gpu=preset, state_dir=state_dir))
        self._sim: SimulatedGPU = self.gpu
        self._busy = False
        self._t0_s, self._beta = self._sim.model.step_work()

    def now(self) -> float:
        return self._sim.clock.now()

    def wait(self, seconds: float) -> None:
        if self._busy:
            self._sim.run_work(seconds, self._beta)
        else:
            self._sim.idle(seconds)

    @contextlib.contextmanager
    def loaded(self) -> Iterator[None]:
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def step(self) -> None:
        self._sim.run_step()

    def synchronize(self) -> None:
        self._sim.synchronize()

    def sample(self) -> dict[str, Any]:
        return {
            "sm_clock_mhz": _read(self._sim.sm_clock_mhz),
            "reasons": _read(self._sim.clock_event_reasons),
            "temperature_c": None,
            "power_w": _read(self._sim.instant_power_w) or _read(self._sim.power_w),
        }

    def instant_power_w(self) -> float:
        return self._sim.instant_power_w()

    def identity(self) -> dict[str, Any]:
        return {
            "name": self.gpu.name,
            "nvml_uuid": self.gpu.uuid,
            "torch_uuid": None,
            "uuid_match": None,
            "note": "simulated GPU: no CUDA device to map",
        }

    def persistence_mode(self) -> bool | None:
        return None

    def other_processes(self) -> list[int]:
        return []

    def fresh_settings(self) -> tuple[float, bool]:
        (fresh,) = simulated_gpus(SimulatedSpec(gpu=self.preset, state_dir=self.state_dir))
        limit_w, lock = fresh.settings()
        return limit_w, lock is not None

    def child_args(self) -> list[str]:
        return ["--simulated", self.preset, "--state-dir", self.state_dir]

    def device_set(self) -> DeviceSet:
        # The phase runs each step itself (run_step None), as on a real GPU.
        return DeviceSet(gpus=[self._sim], clock=self._sim.clock.now, backend="simulated")

    def close(self) -> None:
        """Nothing to release."""


class CudaBench:
    """A real GPU: NVML through the torch device's UUID; the workload a bf16 transformer
    block (forward, backward, SGD step). Methods: see :class:`Bench`."""

    backend = "nvml"

    def __init__(self, device_index: int, d_model: int, batch: int, seq: int) -> None:
        import torch

        self._torch = torch
        self.device = torch.device("cuda", device_index)
        self._cuda = TorchCuda()
        self.gpu: NVMLGPU = nvml_gpu_for_device(self.device, self._cuda)
        torch.cuda.set_device(self.device)
        self._block = torch.nn.TransformerEncoderLayer(
            d_model,
            d_model // 128,
            4 * d_model,
            batch_first=True,
            device=self.device,
            dtype=torch.bfloat16,
        )
        self._x = torch.randn(batch, seq, d_model, device=self.device, dtype=torch.bfloat16)
        self._opt = torch.optim.SGD(self._block.parameters(), lr=1e-6)
        self._events: list[Any] = []
        self._stop = threading.Event()

    def now(self) -> float:
        return time.perf_counter()

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    @contextlib.contextmanager
    def loaded(self) -> Iterator[None]:
        self._stop.clear()

        def run() -> None:
            self._torch.cuda.set_device(self.device)  # the current device is per thread
            while not self._stop.is_set():
                self.step()
                if len(self._events) > 2:  # at most two steps queued (waits without the GIL)
                    self._events.pop(0).synchronize()

        thread = threading.Thread(target=run, name="calibrate-load", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()
            self.synchronize()

    def step(self) -> None:
        torch = self._torch
        out = self._block(self._x)
        loss = out.float().pow(2).mean()
        loss.backward()
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._events.append(event)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device)
        self._events.clear()

    def sample(self) -> dict[str, Any]:
        return {
            "sm_clock_mhz": _read(self.gpu.sm_clock_mhz),
            "reasons": _read(self.gpu.clock_event_reasons),
            "temperature_c": _read(self.gpu.temperature_c),
            "power_w": _read(self.gpu.instant_power_w) or _read(self.gpu.power_w),
        }

    def instant_power_w(self) -> float:
        return self.gpu.instant_power_w()

    def identity(self) -> dict[str, Any]:
        torch_uuid = self._cuda.uuid(self.device.index or 0)
        return {
            "name": self.gpu.name,
            "nvml_uuid": self.gpu.uuid,
            "torch_uuid": torch_uuid,
            "uuid_match": normalise_uuid(torch_uuid) == normalise_uuid(self.gpu.uuid),
        }

    def persistence_mode(self) -> bool | None:
        return _read(self.gpu.persistence_mode)

    def other_processes(self) -> list[int]:
        pids = _read(self.gpu.running_process_ids) or []
        return [p for p in pids if p != os.getpid()]

    def fresh_settings(self) -> tuple[float, bool]:
        # NVML cannot read a lock back: a lock in force shows as a foreign clock setting.
        return self.gpu.power_limit_w(), self.gpu.foreign_clock_setting() is not None

    def child_args(self) -> list[str]:
        return ["--uuid", self.gpu.uuid]

    def device_set(self) -> DeviceSet:
        return DeviceSet(gpus=[self.gpu], clock=time.perf_counter, backend="nvml")

    def close(self) -> None:
        self.gpu.close()


# --------------------------------------------------------------------------- budget
@dataclass
class Budget:
    """Seconds left for the phases, on the backend's clock."""

    total_s: float
    now: Callable[[], float]
    start_s: float = 0.0

    def __post_init__(self) -> None:
        self.start_s = self.now()

    def left_s(self) -> float:
        """Seconds left."""
        return self.total_s - (self.now() - self.start_s)


@dataclass
class Run:
    """The calibration being made: its backend, guard, result and problems."""

    bench: Bench
    budget: Budget
    lease_dir: str
    result: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    guard: GPUGuard | None = None
    period_s: float = 0.1

    def skip(self, phase: str, reason: str) -> None:
        """Record that ``phase`` did not run, and why."""
        self.skipped[phase] = reason

    def fits(self, phase: str, needed_s: float) -> bool:
        """Whether ``needed_s`` is left; otherwise record the phase as skipped."""
        if self.budget.left_s() < needed_s:
            self.skip(phase, f"budget: needs {needed_s:.0f} s, {self.budget.left_s():.0f} s left")
            return False
        return True

    @property
    def window_s(self) -> float:
        """A measurement window: 50 counter periods (2 % quantisation), at least 2 s."""
        return max(2.0, 50 * self.period_s)


# --------------------------------------------------------------------------- phases
def phase_identity(run: Run) -> None:
    """Phase 1: name, UUIDs (torch and NVML), power-limit range, supported clocks."""
    bench = run.bench
    identity = bench.identity()
    run.result["gpu"] = {"name": identity["name"], "uuid": identity["nvml_uuid"]}
    run.result["mapping"] = identity
    if identity["uuid_match"] is False:
        run.problems.append(
            f"torch device UUID {identity['torch_uuid']} is not NVML's {identity['nvml_uuid']}"
        )
    gpu = bench.gpu
    lo, hi = gpu.power_limit_constraints_w()
    clocks = _read(gpu.supported_sm_clocks_mhz) or []
    run.result["limits"] = {
        "min_power_limit_w": lo,
        "max_power_limit_w": hi,
        "default_power_limit_w": gpu.default_power_limit_w(),
        "pre_job_power_limit_w": gpu.power_limit_w(),
    }
    run.result["clocks"] = {
        "supported_sm_clocks_mhz": clocks,
        "max_sm_clock_mhz": clocks[0] if clocks else None,
        "min_sm_clock_mhz": clocks[-1] if clocks else None,
    }


def phase_permissions(run: Run, force: bool) -> None:
    """Phase 2: persistence mode, other processes, and whether the guard may change
    settings (it writes the current limit back; the guard stays for the settings phases)."""
    bench = run.bench
    others = bench.other_processes()
    permissions: dict[str, Any] = {
        "persistence_mode": bench.persistence_mode(),
        "other_processes": others,
        "can_change_settings": False,
        "reason": None,
    }
    run.result["permissions"] = permissions
    if others and not force:
        permissions["reason"] = f"other processes compute on it ({others}); --force to change"
        return
    if bench.gpu.is_mig:
        permissions["reason"] = "a MIG instance: observe-only"
        return
    guard = GPUGuard([bench.gpu], lease_dir=run.lease_dir)
    run.guard = guard
    guard.set_power_limit_w(guard.pre_job_power_limit_w(0))  # a write of the same limit
    permissions["can_change_settings"] = not guard.observe_only
    permissions["reason"] = guard.observe_only_reason


def _poll(
    bench: Bench, duration_s: float, interval_s: float, read: Callable[[], Any]
) -> list[tuple[float, Any]]:
    """``(time, read())`` every ``interval_s`` for ``duration_s``."""
    samples = []
    end_s = bench.now() + duration_s
    while bench.now() < end_s:
        samples.append((bench.now(), read()))
        bench.wait(interval_s)
    return samples


def zero_delta_share(samples: Sequence[tuple[float, float]], window_s: float) -> float | None:
    """Share of windows of ``window_s`` (one starting at each sample) whose counter delta is
    zero; None when the samples span less than two windows."""
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


def phase_counter(run: Run) -> None:
    """Phase 3: the energy counter's period and zero-delta shares, polled under load."""
    bench = run.bench
    duration_s = 3.0
    if not run.fits("counter", duration_s + 1):
        return
    with bench.loaded():
        bench.wait(0.2)
        samples = _poll(bench, duration_s, 0.001, bench.gpu.energy_j)
    period = counter_period_s(samples)
    shares = {f"{w * 1000:g}ms": zero_delta_share(samples, w) for w in ZERO_DELTA_WINDOWS_S}
    run.result["counter"] = {
        "period_s": period,
        "samples": len(samples),
        "poll_interval_s": (samples[-1][0] - samples[0][0]) / max(1, len(samples) - 1),
        "zero_delta_share": shares,
    }
    if period is None:
        run.problems.append("the energy counter did not move three times in 3 s under load")
    else:
        run.period_s = period


def phase_readings(run: Run) -> None:
    """Phase 4: idle power; counter vs integrated instantaneous power vs power usage."""
    bench = run.bench
    gpu = bench.gpu
    duration_s = max(4.0, 20 * run.period_s)
    if not run.fits("readings", duration_s + run.window_s + 4):
        return
    bench.wait(max(1.0, 2 * run.period_s))  # the counter catches up with the work before
    start_j = gpu.energy_j()
    start_s = bench.now()
    bench.wait(run.window_s)
    idle_w = (gpu.energy_j() - start_j) / (bench.now() - start_s)
    try:
        bench.instant_power_w()
        instant = True
    except NotSupportedError:
        instant = False
    with bench.loaded():
        bench.wait(1.5)  # past the 1 s average of the power usage
        start_j, start_s = gpu.energy_j(), bench.now()
        samples = _poll(
            bench,
            duration_s,
            0.01,
            lambda: (bench.instant_power_w() if instant else math.nan, gpu.power_w()),
        )
        counter_w = (gpu.energy_j() - start_j) / (bench.now() - start_s)
    integrated_w = None
    if instant:
        joules = sum(p0[0] * (t1 - t0) for (t0, p0), (t1, _) in itertools.pairwise(samples))
        integrated_w = joules / (samples[-1][0] - samples[0][0])
    usage_w = statistics.fmean(p for _, (_, p) in samples)

    def error_pct(value: float | None) -> float | None:
        return None if value is None else 100.0 * (value - counter_w) / counter_w

    run.result["idle_power_w"] = idle_w
    run.result["power_readings"] = {
        "interval_s": duration_s,
        "counter_w": counter_w,
        "instant_power_available": instant,
        "instant_integrated_w": integrated_w,
        "power_usage_mean_w": usage_w,
        "instant_vs_counter_pct": error_pct(integrated_w),
        "power_usage_vs_counter_pct": error_pct(usage_w),
    }


def _window(run: Run) -> dict[str, Any]:
    """Steps for one measurement window: time and energy per step, and the mean readings."""
    bench = run.bench
    gpu = bench.gpu
    for _ in range(2):  # settle under the new setting
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
        reading = bench.sample()
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


def _settable(run: Run, phase: str) -> GPUGuard | None:
    """The guard when settings may be changed; else None, with the phase skipped."""
    guard = run.guard
    if guard is None or guard.observe_only:
        reason = run.result.get("permissions", {}).get("reason") or "no permission"
        run.skip(phase, f"settings cannot be changed: {reason}")
        return None
    return guard


def phase_power_limit_sweep(run: Run, points: int) -> None:
    """Phase 5: a window at each of ``points`` limits from the pre-job one to the minimum."""
    guard = _settable(run, "power_limit_sweep")
    if guard is None:
        return
    lo = run.result["limits"]["min_power_limit_w"]
    top = guard.pre_job_power_limit_w(0)
    limits = sorted(
        {round(top - (top - lo) * k / (points - 1)) for k in range(points)}, reverse=True
    )
    rows = []
    for limit_w in limits:
        if not run.fits("power_limit_sweep", run.window_s + 2):
            break
        applied_w = guard.set_power_limit_w(float(limit_w))
        rows.append({"power_limit_w": applied_w, **_window(run)})
    guard.set_power_limit_w(top)
    run.result["power_limit_sweep"] = rows


def phase_clock_sweep(run: Run, points: int) -> None:
    """Phase 6: a window at each of ``points`` locked SM clocks, top down to 40 % of it."""
    guard = _settable(run, "clock_sweep")
    clocks = run.result["clocks"]["supported_sm_clocks_mhz"]
    if guard is None:
        return
    if not clocks:
        run.skip("clock_sweep", "the GPU reports no SM clocks")
        return
    # From the top clock down to 40 % of it: lower clocks cost more energy on every GPU.
    usable = [f for f in clocks if f >= 0.4 * clocks[0]]
    chosen = sorted(
        {usable[round(k * (len(usable) - 1) / (points - 1))] for k in range(points)}, reverse=True
    )
    rows = []
    try:
        for lock_mhz in chosen:
            if not run.fits("clock_sweep", run.window_s + 2):
                break
            applied = guard.lock_clocks_mhz(lock_mhz, lock_mhz)
            if applied is None:
                run.skip("clock_sweep", "clock locking is not supported here")
                break
            row = {"locked_sm_clock_mhz": applied[1], **_window(run)}
            actual = row["sm_clock_mhz"]
            # Within one clock step of the lock: the reading moves in steps of the table.
            row["clock_matches_lock"] = actual is not None and abs(actual - applied[1]) <= 15.5
            rows.append(row)
    finally:
        guard.reset_clocks()
    run.result["clock_sweep"] = rows
    if rows:
        best = min(rows, key=lambda r: r["energy_per_step_j"])
        run.result["energy_optimal_clock_mhz"] = best["locked_sm_clock_mhz"]
        for row in rows:
            if not row["clock_matches_lock"] and "sw_power_cap" not in (
                row["throttle_reasons"] or []
            ):
                run.problems.append(
                    f"clock locked at {row['locked_sm_clock_mhz']} MHz ran at "
                    f"{row['sm_clock_mhz']} MHz without a power cap"
                )


def _latency(
    run: Run, change: Callable[[], object], shows: Callable[[dict[str, Any]], bool]
) -> float | None:
    """Seconds from a change until a reading under load shows it (None: not within 2 s)."""
    bench = run.bench
    with bench.loaded():
        bench.wait(0.3)
        start_s = bench.now()
        change()
        while bench.now() - start_s < 2.0:
            bench.wait(0.001)
            if shows(bench.sample()):
                return bench.now() - start_s
    return None


def phase_latency(run: Run) -> None:
    """Phase 7: how long a new power limit and a clock lock take to show under load."""
    guard = _settable(run, "setting_latency")
    if guard is None or not run.fits("setting_latency", 6):
        return
    clocks = run.result["clocks"]["supported_sm_clocks_mhz"]
    lo = run.result["limits"]["min_power_limit_w"]
    top = guard.pre_job_power_limit_w(0)
    latency: dict[str, float | None] = {"set_power_limit_s": None, "set_locked_clocks_s": None}
    with run.bench.loaded():
        run.bench.wait(0.5)  # past the latency of the last change
        run.bench.wait(0.05)  # work started under the settings in force now
        before = run.bench.sample()

    def limited(reading: dict[str, Any]) -> bool:
        # The clock falls by a step or more, or the power comes half-way down to the limit.
        clock, power_w = reading["sm_clock_mhz"], reading["power_w"]
        clock_before, power_before = before["sm_clock_mhz"], before["power_w"]
        return (clock is not None and clock_before is not None and clock < clock_before - 15.5) or (
            power_w is not None and power_before is not None and power_w <= (power_before + lo) / 2
        )

    latency["set_power_limit_s"] = _latency(run, lambda: guard.set_power_limit_w(lo), limited)
    guard.set_power_limit_w(top)
    if clocks:
        target = clocks[len(clocks) // 2]
        try:
            latency["set_locked_clocks_s"] = _latency(
                run,
                lambda: guard.lock_clocks_mhz(target, target),
                lambda s: s["sm_clock_mhz"] is not None and abs(s["sm_clock_mhz"] - target) <= 15.5,
            )
        finally:
            guard.reset_clocks()
    run.result["setting_latency_s"] = latency


# --------------------------------------------------------------------------- restore checks
def _child_env() -> dict[str, str]:
    """The environment of child processes: this one's, importing this lightning_energy."""
    root = str(Path(lightning_energy.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else os.pathsep.join([root, path])}


def _recover(run: Run, timeout_s: float) -> int | None:
    """Run ``lightning-energy recover`` on the lease directory; its exit status (None: it
    did not finish in time)."""
    command = [sys.executable, "-m", "lightning_energy", "recover", "--lease-dir", run.lease_dir]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=_child_env(),
        )
    except subprocess.TimeoutExpired:
        return None
    return done.returncode


def _child(run: Run, mode: str, target_w: float, lock_mhz: int | None) -> dict[str, Any]:
    """One restore check: a child changes the GPU through its guard, then exits, is
    terminated or is killed; what is found afterwards."""
    bench = run.bench
    # Each wait of a check gets a share of what is left (the budget's clock is the GPU's).
    timeout_s = max(5.0, min(CHILD_TIMEOUT_S, run.budget.left_s() / 9))
    pre_w, pre_locked = bench.fresh_settings()
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--restore-child",
        mode,
        "--lease-dir",
        run.lease_dir,
        "--target-w",
        str(target_w),
        *(["--lock-mhz", str(lock_mhz)] if lock_mhz is not None else []),
        *bench.child_args(),
    ]
    check: dict[str, Any] = {"mode": mode, "pre_job_power_limit_w": pre_w}
    with subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    ) as child:
        try:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], timeout_s)
            line = child.stdout.readline().strip() if ready else ""
            check["child_ready"] = line == "READY"
            during_w, during_locked = bench.fresh_settings()
            check["during"] = {"power_limit_w": during_w, "clock_locked": during_locked}
            assert child.stdin is not None
            child.stdin.close()  # an "exit" child ends its job now
            if mode == "sigterm":
                child.send_signal(signal.SIGTERM)
            elif mode == "sigkill":
                child.kill()
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            check["child_hung"] = True
        finally:
            if child.poll() is None:  # a child that hangs is killed; recover repairs it
                child.kill()
                child.wait()
        check["child_exit"] = child.returncode
        stderr = child.stderr.read() if child.stderr else ""
    if not check["child_ready"]:
        check["child_stderr"] = stderr[-2000:]
    if mode == "sigkill" or check.get("child_hung"):
        left_w, left_locked = bench.fresh_settings()
        check["left_by_kill"] = {"power_limit_w": left_w, "clock_locked": left_locked}
        check["recover_exit"] = _recover(run, timeout_s)
    after_w, after_locked = bench.fresh_settings()
    check["after"] = {"power_limit_w": after_w, "clock_locked": after_locked}
    check["changed_during"] = during_w != pre_w
    check["exact_power_limit_restored"] = after_w == pre_w
    check["lock_released"] = not after_locked if lock_mhz is not None else None
    check["ok"] = bool(
        check["child_ready"]
        and check["changed_during"]
        and check["exact_power_limit_restored"]
        and after_locked == pre_locked
        and check.get("recover_exit", 0) == 0
        and not check.get("child_hung")
    )
    return check


def phase_restore_checks(run: Run) -> None:
    """Phase 8: exit, SIGTERM and SIGKILL + recover of children changing the GPU."""
    guard = _settable(run, "restore_checks")
    if guard is None or not run.fits("restore_checks", RESTORE_CHECKS_S):
        return
    guard.restore()  # the children take the GPU's lease in turn
    limits = run.result["limits"]
    target_w = float(round((limits["min_power_limit_w"] + limits["pre_job_power_limit_w"]) / 2))
    clocks = run.result["clocks"]["supported_sm_clocks_mhz"]
    lock_mhz = clocks[len(clocks) // 2] if clocks else None
    checks = {
        mode: _child(run, mode, target_w, lock_mhz) for mode in ("exit", "sigterm", "sigkill")
    }
    run.result["restore_checks"] = checks
    for mode, check in checks.items():
        if not check["ok"]:
            run.problems.append(f"restore check {mode!r} failed: {json.dumps(check)}")


def restore_child(args: argparse.Namespace) -> int:
    """The child of a restore check: change the GPU through the guard, say READY, then
    exit (``exit``) or wait for the signal (``sigterm``, ``sigkill``)."""
    if args.simulated:
        gpus: list[GPU] = list(
            simulated_gpus(SimulatedSpec(gpu=args.simulated, state_dir=args.state_dir))
        )
    else:
        gpus = []
        for candidate in nvml_gpus():
            if candidate.uuid == args.uuid:
                gpus.append(candidate)
            else:
                candidate.close()
    backend = "simulated" if args.simulated else "nvml"
    devices = DeviceSet(gpus=gpus, clock=time.perf_counter, backend=backend)
    with devices, GPUGuard(gpus, lease_dir=args.lease_dir, strict=True) as guard:
        guard.set_power_limit_w(args.target_w)
        if args.lock_mhz is not None:
            guard.lock_clocks_mhz(args.lock_mhz, args.lock_mhz)
        print("READY", flush=True)
        if args.restore_child == "exit":
            sys.stdin.read()  # until the parent has seen the change
        else:
            while True:
                time.sleep(0.1)
    return EXIT_OK


# --------------------------------------------------------------------------- controller run
class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def phase_controller(run: Run) -> None:
    """Phase 9: EnergyController profiling two limits on the loop; no zero-energy window."""
    # Imported here: torch comes with them, and restore-check children need neither.
    from lightning_energy.config import EnergyConfig
    from lightning_energy.controller import EnergyController

    guard = _settable(run, "controller_run")
    if guard is None or not run.fits("controller_run", 60):
        return
    guard.restore()
    bench = run.bench
    limits = run.result["limits"]
    top = limits["pre_job_power_limit_w"]
    mid = float(round((limits["min_power_limit_w"] + top) / 2))
    config = EnergyConfig.from_mapping(
        {
            "device": {"lease_dir": run.lease_dir},
            "power_limit": {"power_limits_w": [top, mid], "warmup_steps": 3, "settle_steps": 2},
        }
    )
    warnings = _Warnings()
    logger = logging.getLogger("lightning_energy")
    logger.addHandler(warnings)
    controller = EnergyController(config, devices=bench.device_set(), install_signal_handlers=False)
    end_s = bench.now() + min(60.0, run.budget.left_s() - 5)
    try:
        controller.setup()
        while not controller.profile_done and bench.now() < end_s:
            controller.on_step_start()
            bench.step()
            bench.synchronize()
            controller.on_step_end()
        profile = controller.profile()
    finally:
        summary = controller.teardown()
        logger.removeHandler(warnings)
    zero = [m for m in warnings.messages if "read no energy" in m]
    after_w, _ = bench.fresh_settings()
    outcome = {
        "steps": summary.steps,
        "profile_done": controller.profile_done,
        "windows": profile,
        "zero_energy_windows": len(zero) + sum(1 for w in profile if w["energy_per_step_j"] <= 0),
        "energy_j": summary.energy_j,
        "power_limit_restored": after_w == top,
    }
    run.result["controller_run"] = outcome
    if (
        outcome["zero_energy_windows"]
        or not controller.profile_done
        or not outcome["power_limit_restored"]
    ):
        run.problems.append(f"controller run: {json.dumps(outcome)}")


# --------------------------------------------------------------------------- comparison
def phase_comparison(run: Run, preset: str | None) -> None:
    """Phase 10: the simulated preset's time, power and energy for every sweep row."""
    if preset is None:
        run.skip("simulated_comparison", f"no simulated preset for {run.result['gpu']['name']!r}")
        return
    model = SimulatedSpec(gpu=preset).model()
    _, beta = model.step_work()
    limit_rows = run.result.get("power_limit_sweep", [])
    clock_rows = run.result.get("clock_sweep", [])
    top = clock_rows[0] if clock_rows else (limit_rows[0] if limit_rows else None)
    if top is None:
        run.skip("simulated_comparison", "no sweep was measured")
        return
    # The measured step at the top clock stands for the preset's step at its maximum clock.
    t0_s = top["time_per_step_s"]
    if clock_rows and model.sm_clocks_mhz:
        t0_s = top["time_per_step_s"] / (
            beta * model.sm_clocks_mhz[0] / top["locked_sm_clock_mhz"] + 1 - beta
        )
    max_w = run.result["limits"]["pre_job_power_limit_w"]
    rows = []
    for row in limit_rows:
        rows.append(
            (
                "power_limit_w",
                row["power_limit_w"],
                row,
                model.run(t0_s, beta, row["power_limit_w"], None),
            )
        )
    for row in clock_rows:
        lock = row["locked_sm_clock_mhz"]
        rows.append(("locked_sm_clock_mhz", lock, row, model.run(t0_s, beta, max_w, lock)))
    compared = []
    for key, value, row, (sim_time_s, sim_power_w) in rows:
        compared.append(
            {
                key: value,
                "time_error_pct": 100
                * (sim_time_s - row["time_per_step_s"])
                / row["time_per_step_s"],
                "power_error_pct": 100 * (sim_power_w - row["power_w"]) / row["power_w"],
                "energy_error_pct": 100
                * (sim_time_s * sim_power_w - row["energy_per_step_j"])
                / row["energy_per_step_j"],
            }
        )
    run.result["simulated_comparison"] = {
        "preset": preset,
        "rows": compared,
        "max_abs_error_pct": {
            kind: max(abs(r[f"{kind}_error_pct"]) for r in compared)
            for kind in ("time", "power", "energy")
        },
    }


# --------------------------------------------------------------------------- main
def calibrate(
    bench: Bench, args: argparse.Namespace, lease_dir: str, preset: str | None
) -> dict[str, Any]:
    """Run every phase on ``bench``; the calibration document (restored in any case)."""
    run = Run(bench, Budget(args.budget_s, bench.now), lease_dir)
    run.result.update({"format": CALIBRATION_FORMAT, "backend": bench.backend, "preset": preset})
    wall_start = time.perf_counter()
    phases: list[tuple[str, Callable[[], None]]] = [
        ("permissions", lambda: phase_permissions(run, args.force)),
        ("counter", lambda: phase_counter(run)),
        ("readings", lambda: phase_readings(run)),
        ("power_limit_sweep", lambda: phase_power_limit_sweep(run, args.limit_points)),
        ("clock_sweep", lambda: phase_clock_sweep(run, args.clock_points)),
        ("setting_latency", lambda: phase_latency(run)),
        ("restore_checks", lambda: phase_restore_checks(run)),
        ("controller_run", lambda: phase_controller(run)),
    ]
    try:
        phase_identity(run)
        for name, phase in phases:
            try:
                phase()
            except DeviceError as exc:  # the next phases still run; the guard restores
                run.problems.append(f"{name}: {exc}")
                run.skip(name, f"stopped by a GPU error: {exc}")
    finally:
        if run.guard is not None:
            run.guard.restore()
    phase_comparison(run, preset)
    limits = run.result["limits"]
    after_w, locked = bench.fresh_settings()
    run.result["settings_restored"] = after_w == limits["pre_job_power_limit_w"] and not locked
    if not run.result["settings_restored"]:
        run.problems.append(
            f"GPU left changed: {after_w} W (was {limits['pre_job_power_limit_w']} W), "
            f"clock lock in force: {locked}"
        )
    sweeps = [*run.result.get("power_limit_sweep", []), *run.result.get("clock_sweep", [])]
    run.result["peak_power_w"] = max((r["power_w"] for r in sweeps), default=None)
    run.result["budget_s"] = args.budget_s
    run.result["elapsed_s"] = bench.now() - run.budget.start_s
    run.result["wall_s"] = time.perf_counter() - wall_start
    run.result["skipped"] = run.skipped
    run.result["problems"] = run.problems
    return run.result


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="runs/calibration.json", help="JSON file to write")
    parser.add_argument("--simulated", choices=PRESETS, help="calibrate a simulated GPU instead")
    parser.add_argument("--device", type=int, default=0, help="torch CUDA device index")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for all phases (at most {MAX_BUDGET_S:g})",
    )
    parser.add_argument("--force", action="store_true", help="change a GPU others are using")
    parser.add_argument("--limit-points", type=int, default=5, help="power limits swept (>= 2)")
    parser.add_argument("--clock-points", type=int, default=6, help="SM clocks swept (>= 2)")
    parser.add_argument("--d-model", type=int, default=4096, help="transformer width")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--lease-dir", help="lease directory (default: a private temporary one)")
    # A restore check's child process (not for direct use).
    parser.add_argument(
        "--restore-child", choices=("exit", "sigterm", "sigkill"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--state-dir", help="--simulated: directory of the GPU's state file (default: temporary)"
    )
    parser.add_argument("--uuid", help=argparse.SUPPRESS)
    parser.add_argument("--target-w", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--lock-mhz", type=int, help=argparse.SUPPRESS)
    return parser


def _open_bench(args: argparse.Namespace, workdir: str) -> tuple[Bench, str | None] | str:
    """The backend and its preset, or why there is no GPU to calibrate."""
    if args.simulated:
        state_dir = args.state_dir or str(Path(workdir) / "state")
        return SimulatedBench(args.simulated, state_dir), args.simulated
    try:
        import torch
    except ImportError:
        return "torch is not installed: the calibration needs torch with CUDA"
    if not torch.cuda.is_available():
        return (
            "torch.cuda is not available: the calibration needs one NVIDIA GPU with CUDA "
            "(--simulated PRESET runs it on a simulated GPU)"
        )
    try:
        bench = CudaBench(args.device, args.d_model, args.batch, args.seq)
    except DeviceError as exc:
        return f"no NVIDIA GPU usable through NVML for cuda:{args.device}: {exc}"
    return bench, preset_for(bench.gpu.name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.restore_child:
        return restore_child(args)
    problems = []
    if not 0 < args.budget_s <= MAX_BUDGET_S:
        problems.append(f"--budget-s {args.budget_s:g}: use 0 < seconds <= {MAX_BUDGET_S:g}")
    if args.limit_points < 2 or args.clock_points < 2:
        problems.append("--limit-points and --clock-points: use 2 or more")
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return EXIT_FAILED
    with tempfile.TemporaryDirectory(prefix="calibrate-") as workdir:
        lease_dir = args.lease_dir or str(Path(workdir) / "leases")
        opened = _open_bench(args, workdir)
        if isinstance(opened, str):
            print(opened, file=sys.stderr)
            return EXIT_NO_GPU
        bench, preset = opened
        try:
            result = calibrate(bench, args, lease_dir, preset)
        except KeyboardInterrupt:
            print("Interrupted: settings changed so far were restored.", file=sys.stderr)
            return EXIT_INTERRUPTED
        except DeviceError as exc:
            print(f"The GPU cannot be read: {exc} (nothing was changed)", file=sys.stderr)
            return EXIT_FAILED
        finally:
            bench.close()
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return EXIT_FAILED if result["problems"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
