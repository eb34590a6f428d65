"""The phases that change GPU settings: only with ``--change-settings``, on a GPU one owns.

Every change goes through the project's guard (``GPUGuard``, its lease in the run's lease
directory), which the phase runner restores at the end, on an exception and on an
interrupt. The phases, in order:

* ``permissions``: whether settings may change (the guard writes the current limit back);
  refused while other processes compute on the GPU (unless ``--force``) or on MIG;
* ``power_limit_sweep``: a measurement window at limits from the pre-job one down to the
  minimum;
* ``clock_sweep``: a window at SM clocks locked from the top down to 40 % of it;
* ``setting_latency``: under load, the time until power settles under a new (minimum) cap,
  and until the SM clock reaches a new lock;
* ``restore_checks``: child processes change the GPU through their guard, then exit, are
  sent SIGTERM, or are killed (then ``recover`` restores); if the run is interrupted while
  a child holds a change, the child is sent SIGTERM first (it restores), killed only if it
  does not end;
* ``controller_run``: ``EnergyController`` profiling two limits on the workload;
* ``simulated_comparison``: the matching simulated preset's rows against the sweeps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_calibration.benches import Bench, read, sample
from gpu_calibration.run import Run, Skip, poll, signals_deferred, window
from lightning_energy.device.base import GPU, DeviceSet
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.nvml import nvml_gpus
from lightning_energy.device.simulated import SimulatedSpec, simulated_gpus

__all__ = [
    "clock_sweep",
    "controller_run",
    "permissions",
    "power_limit_sweep",
    "recover_child",
    "recover_leases",
    "restore_checks",
    "restore_child",
    "setting_latency",
    "settle_latency_s",
    "simulated_comparison",
]

# A child process (or recover) that takes longer than this to answer is given up on.
_CHILD_TIMEOUT_S = 60.0
# How long a child sent SIGTERM gets to restore and end before it is killed.
_CHILD_TERM_S = 10.0
# How long readings are polled after a change to see them settle.
_SETTLE_S = 1.0
# The SM clock moves in steps of the supported-clock table (15 MHz on recent GPUs).
_CLOCK_STEP_MHZ = 15.5


def _guard(run: Run) -> GPUGuard:
    """The guard, when settings may be changed; otherwise :class:`Skip`."""
    guard = run.guard
    if guard is None or guard.observe_only:
        reason = run.result.get("permissions", {}).get("reason") or "no permission"
        raise Skip(f"settings cannot be changed: {reason}")
    return guard


def permissions(run: Run) -> None:
    """Whether the guard may change settings (it writes the current limit back); the guard
    stays for the next phases."""
    run.requires("limits")
    bench = run.bench
    pids = read(bench.process_ids) or []
    others = [p for p in pids if p != os.getpid()]
    outcome: dict[str, Any] = {"other_processes": others, "can_change_settings": False}
    run.result["permissions"] = outcome
    if others and not run.options.force:
        outcome["reason"] = f"other processes compute on it ({others}); --force to change"
        raise Skip(outcome["reason"])
    if bench.gpu.is_mig:
        outcome["reason"] = "a MIG instance: observe-only"
        raise Skip(outcome["reason"])
    guard = GPUGuard([bench.gpu], lease_dir=run.options.lease_dir)
    run.guard = guard
    guard.set_power_limit_w(guard.pre_job_power_limit_w(0))  # a write of the same limit
    outcome["can_change_settings"] = not guard.observe_only
    outcome["reason"] = guard.observe_only_reason
    if guard.observe_only:
        raise Skip(f"settings cannot be changed: {guard.observe_only_reason}")


def power_limit_sweep(run: Run) -> None:
    """A window at each of ``--limit-points`` limits from the pre-job one to the minimum."""
    guard = _guard(run)
    lo = run.result["limits"]["min_power_limit_w"]
    top = guard.pre_job_power_limit_w(0)
    points = run.options.limit_points
    limits = sorted(
        {round(top - (top - lo) * k / (points - 1)) for k in range(points)}, reverse=True
    )
    rows: list[dict[str, Any]] = []
    run.result["power_limit_sweep"] = rows
    try:
        for limit_w in limits:
            if not run.fits(run.window_s + 2):
                run.skip("power_limit_sweep", f"budget: {len(rows)} of {len(limits)} limits")
                break
            applied_w = guard.set_power_limit_w(float(limit_w))
            rows.append({"power_limit_w": applied_w, **window(run)})
    finally:
        guard.set_power_limit_w(top)


def clock_sweep(run: Run) -> None:
    """A window at each of ``--clock-points`` locked SM clocks, top down to 40 % of it."""
    guard = _guard(run)
    clocks = run.result["clocks"]["supported_sm_clocks_mhz"]
    if not clocks:
        raise Skip("the GPU reports no SM clocks")
    # From the top clock down to 40 % of it: lower clocks cost more energy on every GPU.
    usable = [f for f in clocks if f >= 0.4 * clocks[0]]
    points = run.options.clock_points
    chosen = sorted(
        {usable[round(k * (len(usable) - 1) / (points - 1))] for k in range(points)}, reverse=True
    )
    rows: list[dict[str, Any]] = []
    run.result["clock_sweep"] = rows
    try:
        for lock_mhz in chosen:
            if not run.fits(run.window_s + 2):
                run.skip("clock_sweep", f"budget: {len(rows)} of {len(chosen)} clocks")
                break
            applied = guard.lock_clocks_mhz(lock_mhz, lock_mhz)
            if applied is None:
                raise Skip("clock locking is not supported here")
            row = {"locked_sm_clock_mhz": applied[1], **window(run)}
            actual = row["sm_clock_mhz"]
            # Within one clock step of the lock: the reading moves in steps of the table.
            row["clock_matches_lock"] = (
                actual is not None and abs(actual - applied[1]) <= _CLOCK_STEP_MHZ
            )
            rows.append(row)
    finally:
        guard.reset_clocks()
    if rows:
        best = min(rows, key=lambda r: r["energy_per_step_j"])
        run.result["energy_optimal_clock_mhz"] = best["locked_sm_clock_mhz"]
    for row in rows:
        if not row["clock_matches_lock"] and "sw_power_cap" not in (row["throttle_reasons"] or []):
            run.problems.append(
                f"clock locked at {row['locked_sm_clock_mhz']} MHz ran at "
                f"{row['sm_clock_mhz']} MHz without a power cap"
            )


def settle_latency_s(
    bench: Bench,
    change: Callable[[], object],
    read: Callable[[dict[str, Any]], float | None],
    band: float,
    target: float | None = None,
) -> tuple[float | None, float | None]:
    """Under load, how long after ``change()`` a reading settles: it is polled every
    millisecond for a second, and settles at the first sample from which every later one
    is within ``band`` of ``target`` (None: of its median over the last 0.2 s).

    Returns:
        ``(seconds, settled value)``; seconds is None when the last sample is not settled.
    """
    with bench.loaded():
        bench.wait(0.3)
        start_s = bench.now()
        change()
        samples = poll(bench.now, bench.wait, _SETTLE_S, 0.001, lambda: read(sample(bench.gpu)))
    tail = [v for t, v in samples if t >= start_s + 0.8 * _SETTLE_S and v is not None]
    if not tail:
        return None, None
    final = statistics.median(tail) if target is None else target
    first_s: float | None = None
    for t, value in samples:
        if value is None or abs(value - final) > band:
            first_s = None
        elif first_s is None:
            first_s = t
    return (None if first_s is None else first_s - start_s), statistics.median(tail)


def setting_latency(run: Run) -> None:
    """Under load: the time until power settles at its level under a new cap (the minimum
    limit), and until the SM clock reaches a new lock (the middle clock)."""
    guard = _guard(run)
    run.need(2 * _SETTLE_S + 4, "two settling measurements")
    bench = run.bench
    clocks = run.result["clocks"]["supported_sm_clocks_mhz"]
    cap_w = float(run.result["limits"]["min_power_limit_w"])
    top = guard.pre_job_power_limit_w(0)
    with bench.loaded():
        bench.wait(1.0)  # past the latency of the last change
        before_w = sample(bench.gpu)["power_w"]
    latency: dict[str, Any] = {
        "set_power_limit_s": None,
        "set_locked_clocks_s": None,
        "cap_w": cap_w,
        "power_before_w": before_w,
    }
    run.result["setting_latency_s"] = latency
    band_w = max(5.0, 0.03 * cap_w)
    try:
        seconds, settled_w = settle_latency_s(
            bench, lambda: guard.set_power_limit_w(cap_w), lambda s: s["power_w"], band_w
        )
    finally:
        guard.set_power_limit_w(top)
    latency["power_settled_w"] = settled_w
    moved = before_w is not None and settled_w is not None and before_w - settled_w > band_w
    latency["set_power_limit_s"] = seconds if moved else None
    if not moved:
        latency["note"] = "power did not fall under the minimum limit: nothing to settle"
    if clocks:
        target = clocks[len(clocks) // 2]
        try:
            latency["set_locked_clocks_s"], _ = settle_latency_s(
                bench,
                lambda: guard.lock_clocks_mhz(target, target),
                lambda s: s["sm_clock_mhz"],
                _CLOCK_STEP_MHZ,
                target,
            )
        finally:
            guard.reset_clocks()


# --------------------------------------------------------------------------- restore checks
def _child_env() -> dict[str, str]:
    """The environment of child processes: this one's, importing this lightning_energy."""
    import lightning_energy

    root = str(Path(lightning_energy.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else os.pathsep.join([root, path])}


def recover_leases(run: Run, timeout_s: float) -> int | None:
    """Run ``lightning-energy recover`` (its command, in a child process) on the lease
    directory; its exit status (None: it did not finish in time)."""
    command = [
        sys.executable,
        run.options.script,
        "--recover-child",
        "--lease-dir",
        run.options.lease_dir,
    ]
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


def _end_child(child: subprocess.Popen[str], check: dict[str, Any]) -> None:
    """A child still running is sent SIGTERM (its guard restores), and killed only if it
    does not end in time (``recover`` then repairs what it left). An interrupt of this
    run waits until the child has ended."""
    with signals_deferred():
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=_CHILD_TERM_S)
            except subprocess.TimeoutExpired:
                check["child_killed"] = True
                child.kill()
                child.wait()
        check["child_exit"] = child.returncode


def _child(run: Run, mode: str, target_w: float, lock_mhz: int | None) -> dict[str, Any]:
    """One restore check: a child changes the GPU through its guard, then exits, is
    terminated or is killed; what is found afterwards."""
    bench = run.bench
    # Each wait of a check gets a share of what is left (the budget's clock is the GPU's).
    timeout_s = max(5.0, min(_CHILD_TIMEOUT_S, run.left_s() / 9))
    pre_w, pre_locked = bench.fresh_settings()
    args = [
        sys.executable,
        run.options.script,
        "--restore-child",
        mode,
        "--lease-dir",
        run.options.lease_dir,
        "--target-w",
        str(target_w),
        *(["--lock-mhz", str(lock_mhz)] if lock_mhz is not None else []),
        *bench.child_args(),
    ]
    check: dict[str, Any] = {"mode": mode, "pre_job_power_limit_w": pre_w}
    run.result["restore_checks"][mode] = check
    stderr = ""
    with subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    ) as child:
        try:
            assert child.stdout is not None and child.stdin is not None
            ready, _, _ = select.select([child.stdout], [], [], timeout_s)
            line = child.stdout.readline().strip() if ready else ""
            check["child_ready"] = line == "READY"
            during_w, during_locked = bench.fresh_settings()
            check["during"] = {"power_limit_w": during_w, "clock_locked": during_locked}
            child.stdin.close()  # an "exit" child ends its job now
            if mode == "sigterm":
                child.send_signal(signal.SIGTERM)
            elif mode == "sigkill":
                child.kill()
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            check["child_hung"] = True
        finally:
            _end_child(child, check)
        stderr = child.stderr.read() if child.stderr else ""
    if not check["child_ready"]:
        check["child_stderr"] = stderr[-2000:]
    if mode == "sigkill" or check.get("child_hung") or check.get("child_killed"):
        left_w, left_locked = bench.fresh_settings()
        check["left_by_kill"] = {"power_limit_w": left_w, "clock_locked": left_locked}
        check["recover_exit"] = recover_leases(run, timeout_s)
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


def restore_checks(run: Run) -> None:
    """Exit, SIGTERM and SIGKILL + recover of children changing the GPU."""
    guard = _guard(run)
    run.need(20.0, "three child processes")
    guard.restore()  # the children take the GPU's lease in turn
    limits = run.result["limits"]
    target_w = float(round((limits["min_power_limit_w"] + limits["pre_job_power_limit_w"]) / 2))
    clocks = run.result["clocks"]["supported_sm_clocks_mhz"]
    lock_mhz = clocks[len(clocks) // 2] if clocks else None
    run.result["restore_checks"] = {}
    for mode in ("exit", "sigterm", "sigkill"):
        check = _child(run, mode, target_w, lock_mhz)
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
    return 0


def recover_child(args: argparse.Namespace) -> int:
    """``lightning-energy recover --lease-dir DIR``: the command's own handler, without
    the rest of the command line (whose other commands need packages a GPU machine may
    lack)."""
    from lightning_energy.cli.recover import run as recover_command

    return recover_command(argparse.Namespace(lease_dir=args.lease_dir, dry_run=False, json=False))


# --------------------------------------------------------------------------- controller run
class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def controller_run(run: Run) -> None:
    """EnergyController profiling two limits on the workload; no zero-energy window."""
    from lightning_energy.config import EnergyConfig
    from lightning_energy.controller import EnergyController

    guard = _guard(run)
    run.need(30.0, "profiling two limits")
    guard.restore()
    bench = run.bench
    limits = run.result["limits"]
    top = limits["pre_job_power_limit_w"]
    mid = float(round((limits["min_power_limit_w"] + top) / 2))
    config = EnergyConfig.from_mapping(
        {
            "device": {"lease_dir": run.options.lease_dir},
            "power_limit": {"power_limits_w": [top, mid], "warmup_steps": 3, "settle_steps": 2},
        }
    )
    warnings = _Warnings()
    logger = logging.getLogger("lightning_energy")
    logger.addHandler(warnings)
    controller = EnergyController(config, devices=bench.device_set(), install_signal_handlers=False)
    end_s = bench.now() + run.left_s() - 5
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
def simulated_comparison(run: Run) -> None:
    """The simulated preset's time, power and energy for every sweep row."""
    preset = run.result.get("preset")
    if preset is None:
        raise Skip(f"no simulated preset for {run.result.get('gpu', {}).get('name')!r}")
    model = SimulatedSpec(gpu=preset).model()
    _, beta = model.step_work()
    limit_rows = run.result.get("power_limit_sweep", [])
    clock_rows = run.result.get("clock_sweep", [])
    top = clock_rows[0] if clock_rows else (limit_rows[0] if limit_rows else None)
    if top is None:
        raise Skip("no sweep was measured")
    # The measured step at the top clock stands for the preset's step at its maximum clock.
    t0_s = top["time_per_step_s"]
    if clock_rows and model.sm_clocks_mhz:
        t0_s = top["time_per_step_s"] / (
            beta * model.sm_clocks_mhz[0] / top["locked_sm_clock_mhz"] + 1 - beta
        )
    max_w = run.result["limits"]["pre_job_power_limit_w"]
    rows: list[tuple[str, float, dict[str, Any], tuple[float, float]]] = [
        ("power_limit_w", r["power_limit_w"], r, model.run(t0_s, beta, r["power_limit_w"], None))
        for r in limit_rows
    ]
    rows += [
        (
            "locked_sm_clock_mhz",
            r["locked_sm_clock_mhz"],
            r,
            model.run(t0_s, beta, max_w, r["locked_sm_clock_mhz"]),
        )
        for r in clock_rows
    ]

    def error_pct(simulated: float, measured: float) -> float:
        return 100 * (simulated - measured) / measured

    compared = [
        {
            key: value,
            "time_error_pct": error_pct(sim_time_s, row["time_per_step_s"]),
            "power_error_pct": error_pct(sim_power_w, row["power_w"]),
            "energy_error_pct": error_pct(sim_time_s * sim_power_w, row["energy_per_step_j"]),
        }
        for key, value, row, (sim_time_s, sim_power_w) in rows
    ]
    run.result["simulated_comparison"] = {
        "preset": preset,
        "rows": compared,
        "max_abs_error_pct": {
            kind: max(abs(r[f"{kind}_error_pct"]) for r in compared)
            for kind in ("time", "power", "energy")
        },
    }
