"""Fit the governed physics presets on the Perseus artifact's measured runs, and check them.

Data (``lightning_energy/data/perseus_sosp24/``, see its README): per pipeline stage, the
forward and backward time and energy of a micro-batch at every locked SM clock (A100 SXM
and A40), and pipeline-parallel jobs under one power cap on every GPU (A100 PCIe and A40).

Model of the measured work:

* each locked-clock curve (model, stage, instruction) is single-phase work: its ``t0``
  (time at ``f_max``) and ``beta`` (compute-bound share) come from a least-squares fit of
  ``t(f) = t0 (beta f_max / f + 1 - beta)`` on the clocks the default power limit leaves
  alone; it runs at the lock unless its power under the default limit forces the clock
  down (the A40's highest clocks);
* each capped job's iteration is its pipeline bubble, ``(pp - 1) / (m + pp - 1)`` of it
  (``m`` micro-batches), blocked in collectives (half before, half after the work), and the
  work, one phase of compute-bound share ``beta``; ``t0`` and ``beta`` are fitted per job
  on its time and energy at every cap.

The preset's constants (static, compute, memory and idle power, the voltage curve, the
governor's ``cap_margin``) are fitted with ``--fit`` (quasi-static: each phase at the
continuous clock where its power meets the setpoint) and printed to be pasted into
``lightning_energy/device/simulated/physics.py``. Without ``--fit`` the shipped presets are
checked: the workloads' ``t0`` and ``beta`` are fitted with the preset fixed, then every
measured run is simulated with the governor (:func:`steady_run`) and compared.

Printed per preset: the median and maximum relative error of time and energy, locked
clocks and caps separately; then the lock-vs-cap comparison at equal speed. For each
capped run below a job's highest cap: the locked clock with the same or lower time and the
least energy, its energy vs the cap's, per cent (negative: the lock uses less). The
measured data have no locked runs of the capped jobs, so the measured comparison is made
on relative curves (time and energy over those at the highest clock, summed over the
stage profiles; over those at the highest cap, per job), and the simulated one likewise
on the simulated curves (``relative``); ``same work`` is the simulator's comparison on
the capped jobs themselves, locked on the same preset. The A100's locked clocks were
measured on SXM boards and its caps on PCIe boards: its relative comparison crosses boards.
The measured comparison is
:func:`~lightning_energy.device.simulated.measured.measured_lock_vs_cap_pct`, which
``benchmarks/clock_vs_limit.py`` shows beside its simulated one.

Usage::

    python benchmarks/calibrate_governor.py          # check the shipped presets
    python benchmarks/calibrate_governor.py --fit    # refit their constants (about a minute)
    python benchmarks/calibrate_governor.py --loop-sensitivity  # and with other loops
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
from scipy.optimize import least_squares

from lightning_energy.device.simulated import (
    PHYSICS_PRESETS,
    Phase,
    PhysicsModel,
    steady_run,
)
from lightning_energy.device.simulated.measured import (
    UNFITTED_JOBS,
    Curve,
    Job,
    Point,
    cap_jobs,
    fitted_cap_jobs,
    lock_curves,
    measured_lock_vs_cap_pct,
    relative_gaps,
    relative_lock_curve,
)

#: (preset, data) pairs: locked-clock profiles by file suffix, cap runs by file suffix.
LOCK_PRESETS = {"a100_sxm": "a100_sxm", "a40_physics": "a40"}
CAP_PRESETS = {"a100_pcie": "A100", "a40_physics": "A40"}
#: Each cap preset's lock preset (the A100's locks were measured on SXM boards).
CAP_LOCKS = {"a100_pcie": "a100_sxm", "a40_physics": "a40_physics"}


def job_phases(bubble_share: float, beta: float) -> tuple[Phase, ...]:
    """An iteration: half the bubble blocked, the work, the other half blocked."""
    if bubble_share <= 0:
        return (Phase(1.0, beta),)
    half = bubble_share / 2
    return (Phase(half, 0.0, blocked=True), Phase(1.0 - bubble_share, beta), Phase(half, 0.0, True))


def continuous_clock(model: PhysicsModel, beta: float, setpoint_w: float, ceiling: float) -> float:
    """The continuous clock where work of share ``beta`` draws ``setpoint_w`` (at most
    ``ceiling``, at least the lowest clock): the governor's average for steady work."""
    low, high = float(model.sm_clocks_mhz[-1]), ceiling
    if model.work_power_w(beta, high) <= setpoint_w:
        return high
    if model.work_power_w(beta, low) >= setpoint_w:
        return low
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if model.work_power_w(beta, mid) <= setpoint_w else (low, mid)
    return low


def quasi_static(
    model: PhysicsModel, t0_s: float, phases: Sequence[Phase], cap_w: float, lock: float
) -> tuple[float, float]:
    """``(time_s, energy_j)`` with each phase at its :func:`continuous_clock`."""
    setpoint_w = cap_w * (1.0 - model.governor.cap_margin)
    time_s = energy_j = 0.0
    for phase in phases:
        if phase.blocked:
            dt_s = phase.share * t0_s
            power_w = model.blocked_power_w(lock)
        else:
            freq = continuous_clock(model, phase.compute_bound_share, setpoint_w, lock)
            dt_s = model.work_time_s(phase.share * t0_s, phase.compute_bound_share, freq)
            power_w = model.work_power_w(phase.compute_bound_share, freq)
        time_s += dt_s
        energy_j += dt_s * power_w
    return time_s, energy_j


def fit_curve(model: PhysicsModel, curve: Curve) -> tuple[float, float]:
    """``(t0_s, beta)`` of a locked-clock curve from its times at unthrottled clocks."""
    f_max = model.max_clock_mhz
    rows = sorted(curve.points.items())
    keep = [
        (f, t)
        for f, (t, e) in rows
        if e / t < model.default_power_limit_w * (1.0 - model.governor.cap_margin) * 0.97
    ] or [(f, t) for f, (t, _) in rows]
    a = np.array([[f_max / f, 1.0] for f, _ in keep])
    (compute_s, memory_s), *_ = np.linalg.lstsq(a, np.array([t for _, t in keep]), rcond=None)
    compute_s, memory_s = max(compute_s, 1e-12), max(memory_s, 0.0)
    return compute_s + memory_s, compute_s / (compute_s + memory_s)


def lock_residuals(model: PhysicsModel, curves: Sequence[Curve]) -> list[float]:
    """Relative errors, time then energy, of every locked point (quasi-static)."""
    out = []
    for curve in curves:
        t0_s, beta = fit_curve(model, curve)
        for freq, (time_s, energy_j) in sorted(curve.points.items()):
            sim_s, sim_j = quasi_static(
                model, t0_s, (Phase(1.0, beta),), model.default_power_limit_w, freq
            )
            out += [sim_s / time_s - 1.0, sim_j / energy_j - 1.0]
    return out


def cap_residuals(model: PhysicsModel, job: Job, t0_s: float, beta: float) -> list[float]:
    """Relative errors, time then energy, of a job at every cap (quasi-static)."""
    out = []
    phases = job_phases(job.bubble_share, beta)
    for cap_w, (time_s, energy_j) in sorted(job.points.items()):
        sim_s, sim_j = quasi_static(model, t0_s, phases, cap_w, model.max_clock_mhz)
        out += [sim_s / time_s - 1.0, sim_j / energy_j - 1.0]
    return out


def fit_job(model: PhysicsModel, job: Job) -> tuple[float, float]:
    """``(t0_s, beta)`` of a capped job, the preset fixed."""
    top_s = job.points[max(job.points)][0]

    def residuals(x: np.ndarray) -> list[float]:
        return cap_residuals(model, job, x[0] * top_s, x[1])

    sol = least_squares(residuals, [0.9, 0.7], bounds=([0.2, 0.0], [2.0, 1.0]), diff_step=1e-4)
    return sol.x[0] * top_s, sol.x[1]


# --------------------------------------------------------------------------- fitting
#: The constants ``--fit`` moves, with their bounds.
FIT_KEYS: dict[str, tuple[float, float]] = {
    "static_power_w": (0.0, 300.0),
    "compute_power_w": (50.0, 800.0),
    "memory_power_w": (0.0, 300.0),
    "memory_sm_power_w": (0.0, 400.0),
    "v_low": (0.4, 1.0),
    "f_v_low_mhz": (300.0, 1700.0),
    "idle_power_w": (10.0, 150.0),
    "cap_margin": (0.0, 0.2),
    # Scales compute, memory and memory-SM power together (another board of the same chip).
    "dynamic_scale": (0.3, 2.0),
}
_DYNAMIC = ("compute_power_w", "memory_power_w", "memory_sm_power_w")
#: Which constants each preset's data pin down. A100 SXM: its locked clocks run at the
#: default limit, which never binds (no ``cap_margin``), and its curves have no waits (no
#: idle power). A100 PCIe: caps alone do not pin the voltage curve or the memory power
#: (the SXM fit's shape, same GA100 chip, its dynamic powers scaled by one factor; refit
#: after the SXM one) nor the idle power (a PCIe board's 60 W). A40: its idle power is the
#: A40 trace's 30 W (the bubbles alone would trade it against the static power).
_SHAPE = ["static_power_w", "compute_power_w", "memory_power_w", "memory_sm_power_w"]
_SHAPE += ["v_low", "f_v_low_mhz"]
FITTED = {
    "a100_sxm": _SHAPE,
    "a40_physics": [*_SHAPE, "cap_margin"],
    "a100_pcie": ["static_power_w", "dynamic_scale", "cap_margin"],
}


def with_constants(model: PhysicsModel, values: dict[str, float]) -> PhysicsModel:
    """``model`` with the given constants (``cap_margin`` goes to its governor,
    ``dynamic_scale`` multiplies its dynamic powers)."""
    fields = {k: v for k, v in values.items() if k not in ("cap_margin", "dynamic_scale")}
    if "dynamic_scale" in values:
        fields.update({k: getattr(model, k) * values["dynamic_scale"] for k in _DYNAMIC})
    if "f_v_low_mhz" in fields:  # fitted as a real number, shipped rounded
        fields["f_v_low_mhz"] = min(fields["f_v_low_mhz"], model.max_clock_mhz - 1.0)
    governor = model.governor
    if "cap_margin" in values:
        governor = replace(governor, cap_margin=values["cap_margin"])
    return replace(model, **fields, governor=governor)  # type: ignore[arg-type]


def fit_preset(name: str) -> PhysicsModel:
    """Refit a preset's constants on its locked curves and capped jobs (quasi-static)."""
    model = PHYSICS_PRESETS[name]
    curves = lock_curves(LOCK_PRESETS[name]) if name in LOCK_PRESETS else []
    gpu = CAP_PRESETS.get(name)
    jobs = [j for j in cap_jobs(gpu) if (gpu, j.name) not in UNFITTED_JOBS] if gpu else []
    keys = FITTED[name]
    current = {"cap_margin": model.governor.cap_margin, "dynamic_scale": 1.0}
    start = [current[k] if k in current else float(getattr(model, k)) for k in keys]
    start_jobs = [fit_job(model, job) for job in jobs]

    def build(x: np.ndarray) -> PhysicsModel:
        return with_constants(model, dict(zip(keys, x[: len(keys)], strict=True)))

    def residuals(x: np.ndarray) -> np.ndarray:
        trial = build(x)
        out = lock_residuals(trial, curves)
        for i, job in enumerate(jobs):
            t0_s, beta = x[len(keys) + 2 * i : len(keys) + 2 * i + 2]
            out += cap_residuals(trial, job, t0_s, beta)
        return np.array(out)

    x0 = start + [v for t0_beta in start_jobs for v in t0_beta]
    low = [FIT_KEYS[k][0] for k in keys] + [0.0, 0.0] * len(jobs)
    high = [FIT_KEYS[k][1] for k in keys] + [1e4, 1.0] * len(jobs)
    x0 = [min(max(v, lo + 1e-9), hi - 1e-9) for v, lo, hi in zip(x0, low, high, strict=True)]
    sol = least_squares(residuals, x0, bounds=(low, high), diff_step=1e-4)
    return build(sol.x)


# --------------------------------------------------------------------------- checking
def _errors(values: Sequence[float]) -> str:
    mags = [abs(v) * 100 for v in values]
    return f"median {statistics.median(mags):5.2f} %  max {max(mags):5.2f} %"


def locked_runs(model: PhysicsModel, curves: Sequence[Curve]) -> dict[str, dict[int, Point]]:
    """Every curve simulated with the governor at every measured clock."""
    out: dict[str, dict[int, Point]] = {}
    for curve in curves:
        t0_s, beta = fit_curve(model, curve)
        out[curve.name] = {}
        for freq in curve.points:
            run = steady_run(
                model,
                t0_s,
                (Phase(1.0, beta),),
                model.default_power_limit_w,
                freq,
                settle_s=0.5,
                measure_s=0.5,
            )
            out[curve.name][freq] = (run.duration_s, run.energy_j)
    return out


def capped_runs(model: PhysicsModel, job: Job) -> tuple[float, float, dict[float, Point]]:
    """``(t0_s, beta, {cap: (time_s, energy_j)})`` of a job simulated with the governor."""
    t0_s, beta = fit_job(model, job)
    phases = job_phases(job.bubble_share, beta)
    out = {}
    for cap_w in job.points:
        run = steady_run(model, t0_s, phases, cap_w, settle_s=t0_s, measure_s=t0_s)
        out[cap_w] = (run.duration_s, run.energy_j)
    return t0_s, beta, out


def same_work_gaps(
    model: PhysicsModel, t0_s: float, beta: float, job: Job, runs: dict[float, Point]
) -> list[float]:
    """The simulator's comparison on the job itself: per capped run below the highest
    cap, the cheapest lock no slower, energy vs the cap's, per cent."""
    phases = job_phases(job.bubble_share, beta)
    locks = [
        steady_run(model, t0_s, phases, model.max_power_limit_w, f, settle_s=0.0, measure_s=0.0)
        for f in model.sm_clocks_mhz
    ]
    gaps = []
    for cap_w, (time_s, energy_j) in runs.items():
        if cap_w == max(runs):
            continue
        fits = [r.energy_j for r in locks if r.duration_s <= time_s * (1 + 1e-9)]
        if fits:
            gaps.append((min(fits) / energy_j - 1.0) * 100)
    return gaps


def _range(gaps: Sequence[float]) -> str:
    if not gaps:
        return "no run"
    median = statistics.median(gaps)
    return f"median {median:+6.1f} %  range {min(gaps):+6.1f}..{max(gaps):+6.1f} % (n={len(gaps)})"


def check(
    name: str,
    lock_preset: str | None,
    report: Callable[[str], None],
    model: PhysicsModel | None = None,
) -> None:
    """Print a cap preset's errors (per job unless ``model`` replaces the preset) and the
    lock-vs-cap comparison (the relative ones against ``lock_preset``'s locked curves)."""
    model = PHYSICS_PRESETS[name] if model is None else model
    gpu = CAP_PRESETS[name]
    time_errors, energy_errors, sim_jobs, same = [], [], {}, []
    for job in cap_jobs(gpu):
        t0_s, beta, runs = capped_runs(model, job)
        sim_jobs[job.name] = runs
        errs = [(runs[c][0] / t - 1.0, runs[c][1] / e - 1.0) for c, (t, e) in job.points.items()]
        flag = "  (not fitted: time falls with the cap)" if (gpu, job.name) in UNFITTED_JOBS else ""
        if lock_preset is not None:
            report(
                f"   {job.name:18s} t0 {t0_s:7.2f} s  beta {beta:4.2f}"
                f"  bubble {job.bubble_share:4.2f}"
                f"  time err max {max(abs(t) for t, _ in errs) * 100:4.1f} %"
                f"  energy err max {max(abs(e) for _, e in errs) * 100:4.1f} %{flag}"
            )
        if (gpu, job.name) not in UNFITTED_JOBS:
            time_errors += [t for t, _ in errs]
            energy_errors += [e for _, e in errs]
            same += same_work_gaps(model, t0_s, beta, job, runs)
    report(f"   caps:   time {_errors(time_errors)}   energy {_errors(energy_errors)}")
    if lock_preset is None:
        report(f"   lock vs cap at equal speed (same work): {_range(same)}")
        return
    curves = lock_curves(LOCK_PRESETS[lock_preset])
    measured = measured_lock_vs_cap_pct(LOCK_PRESETS[lock_preset], gpu)
    simulated_lock = relative_lock_curve(locked_runs(PHYSICS_PRESETS[lock_preset], curves))
    fitted = {k: v for k, v in sim_jobs.items() if k in fitted_cap_jobs(gpu)}
    report("   lock vs cap at equal speed, energy of the lock vs the cap:")
    report(f"     measured (relative)  {_range(measured)}")
    report(f"     simulated (relative) {_range(relative_gaps(simulated_lock, fitted))}")
    report(f"     simulated (same work) {_range(same)}")


def loop_sensitivity(report: Callable[[str], None]) -> None:
    """Print the cap presets' errors and same-work comparison with a governor loop twice as
    fast and twice as slow (period and response scaled together, the same workloads)."""
    for name in CAP_PRESETS:
        base = PHYSICS_PRESETS[name]
        for factor in (0.5, 2.0):
            loop = base.governor
            loop = replace(
                loop,
                control_period_s=loop.control_period_s * factor,
                response_s=loop.response_s * factor,
            )
            report(f"== {name}, governor loop x{factor:g} ({loop.control_period_s * 1e3:g} ms)")
            check(name, None, report, replace(base, governor=loop))


def check_locks(name: str, report: Callable[[str], None]) -> None:
    """Print a lock preset's errors on its locked-clock curves."""
    model = PHYSICS_PRESETS[name]
    curves = lock_curves(LOCK_PRESETS[name])
    runs = locked_runs(model, curves)
    time_errors, energy_errors = [], []
    for curve in curves:
        for freq, (time_s, energy_j) in curve.points.items():
            sim_s, sim_j = runs[curve.name][freq]
            time_errors.append(sim_s / time_s - 1.0)
            energy_errors.append(sim_j / energy_j - 1.0)
    report(f"== {name} ({model.name}): {len(curves)} locked-clock curves")
    report(f"   locks:  time {_errors(time_errors)}   energy {_errors(energy_errors)}")


def print_constants(model: PhysicsModel) -> None:
    """The fitted constants, to paste into the preset."""
    keys = [k for k in FIT_KEYS if k not in ("cap_margin", "dynamic_scale")]
    values = ", ".join(
        f"{k}={round(getattr(model, k)) if k == 'f_v_low_mhz' else round(getattr(model, k), 3)}"
        for k in keys
    )
    print(
        f"   fitted: {values}, governor=GovernorConstants(cap_margin="
        f"{round(model.governor.cap_margin, 4)})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="refit the presets' constants")
    parser.add_argument("--preset", action="append", choices=sorted(FITTED), help="fit these")
    parser.add_argument(
        "--loop-sensitivity",
        action="store_true",
        help="also check the caps with a governor loop twice as fast and twice as slow",
    )
    args = parser.parse_args(argv)
    if args.fit:
        for name in args.preset or sorted(FITTED):
            print(f"== fitting {name}")
            print_constants(fit_preset(name))
        return
    check_locks("a100_sxm", print)
    check_locks("a40_physics", print)
    for name, lock_preset in CAP_LOCKS.items():
        model = PHYSICS_PRESETS[name]
        print(f"== {name} ({model.name}): caps on {CAP_PRESETS[name]}")
        check(name, lock_preset, print)
    if args.loop_sensitivity:
        loop_sensitivity(print)


if __name__ == "__main__":
    main()
