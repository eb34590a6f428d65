"""Locked SM clocks vs. power limits, on the simulated GPUs that model clocks.

For every physics preset (``a100``, ``h100``, ``h200``, and ``a100_sxm``, ``a100_pcie`` and
``a40_physics``, fitted on the Perseus artifact's measured runs: the simulated GPUs whose
SM clock is modelled; trace GPUs cannot lock) and four workloads of a 0.5 s step (three of
one phase, compute-bound shares 0.9, 0.6 and 0.3, and one ``phased``: 60 % compute-bound
work at 0.95 then 40 % memory-bound at 0.15, as GEMMs and elementwise/optimizer kernels
alternate in a training step), both knobs are measured:

- **Exhaustively**, on a noiseless GPU: every power limit of a 25 W grid (the configuration's
  default) and every candidate clock (the supported clocks thinned to 90 MHz, the default
  ``power_limit.clock_step_mhz``, and the supported clocks nearest those the caps ran at),
  with the SM clock each ran at.
- **By the search**, on a noisy GPU (``--noise-std``, default 0.02 per step): the
  :class:`~lightning_energy.optimize.power_limit.PowerLimitOptimizer` of each kind, with each
  selector (``energy``, ``time``, ``cost(eta=0.5)``, ``max_slowdown(1.1)``,
  ``target_time(1.2 x the fastest step)``), the controller's loop (apply, settle, measure,
  report). Its choice is scored on the noiseless measurements, and its steps are compared
  with Zeus' sweep (10 warm-up and 40 measured steps at every candidate) of either knob.
- **As** ``power_limit.knob: auto`` **does**: the power limits' search, then the locks'
  search over the grid seeded with the clocks the caps ran at, then the selector's choice
  among both knobs' measured candidates
  (:func:`~lightning_energy.optimize.selectors.select_across`).

Per selector, the cost of each choice uses the selector's own objective over both knobs'
settings (energy for the constrained selectors, whose time bounds are those of full power:
the highest power limit). ``auto_ok`` says whether ``auto``'s choice is no worse than the
power limit's choice by more than the noise tolerance (1 %); ``lock_vs_cap_pct`` compares
the locked clock's own search (``power_limit.knob: locked_clock``) with the cap's.

At equal speed, each power limit is compared with the cheapest lock at least as fast: the
energy change of the lock against the cap, in per cent (negative: the lock saves), with its
median, mean and tails. Under a cap the simulated board's governor sets the clock from the
power it measures every 20 ms, so on phased work the clock follows the phases (high in the
memory-bound phase, where it buys no speed); on single-phase work cap and lock settle at
the same clock. ``synthetic`` holds this over the four workloads above.

Beside it, ``measured`` is the measured data's own lock-vs-cap comparison at equal speed
for the preset's GPU (A100: locks measured on SXM boards, caps on PCIe boards; A40), from
:func:`~lightning_energy.device.simulated.measured.measured_lock_vs_cap_pct` (the one
``benchmarks/calibrate_governor.py`` prints), for the presets fitted on those data
(``a100_sxm``, ``a100_pcie``, ``a40_physics``; null for the others, ``a100`` included: an
A100-SXM4-40GB not fitted on them). The data hold no locked run of a capped job, so that
comparison is made on relative curves: the stage profiles' locked clocks against the jobs'
caps, each over its own top point. The simulated side (``measured_work``,
:func:`measured_work`) runs the same work: ``relative`` is that procedure on simulated runs
of the same stage profiles and jobs on the same boards (locks on the preset fitted on the
locks' boards, caps on the one fitted on the caps'; the A100 presets share it), the check
the data allow; ``same_work`` is the comparison like with like, which the data cannot
show: each capped job (its pipeline bubble and one work phase, fitted on the preset) under
each measured cap against the cheapest lock of the same job no slower, on the preset. The
top-level median, mean, tails and ``n`` are ``same_work``'s where the preset has measured
data (``simulated_on``: ``measured jobs``), else ``synthetic``'s. ``gap_pp`` is
``relative``'s median minus the measured one; ``gap_same_work_pp`` the same for
``same_work``. Where locks and caps were measured on different boards (the A100),
``measured.board_corrected`` is the measured comparison with the locks relative to the
clock each job ran at under its highest cap (as the caps' fitted preset, ``a100_pcie``,
simulates it) instead of to their highest clock (:func:`board_corrected_pct`),
``board_part_pp`` the measured median minus the corrected one, and
``gap_board_corrected_pp`` ``same_work``'s median minus the corrected one. The targets:
``auto`` never worse than caps by more than 1 % at any selector on any preset, and
``|gap_pp| <= 2``; whether each is met is printed (with ``--json``, on stderr), the
same-work gaps beside it.

Usage::

    python benchmarks/clock_vs_limit.py            # a table per preset
    python benchmarks/clock_vs_limit.py --json     # one object: per preset, the median
                                                   # energy change at equal speed (%),
                                                   # simulated and measured, and the details
    python benchmarks/clock_vs_limit.py --preset a100 --noise-std 0.05 --seed 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.calibrate_governor import (  # noqa: E402
    capped_runs,
    fit_job,
    locked_runs,
    same_work_gaps,
)
from lightning_energy.controller.locked_clock import thin_clocks_mhz  # noqa: E402
from lightning_energy.device.simulated import (  # noqa: E402
    PHYSICS_PRESETS,
    Phase,
    SimulatedGPU,
    SimulatedSpec,
    simulated_gpus,
    steady_run,
)
from lightning_energy.device.simulated.measured import (  # noqa: E402
    cap_jobs,
    fitted_cap_jobs,
    lock_curves,
    measured_lock_vs_cap_pct,
    relative_gaps,
    relative_lock_curve,
)
from lightning_energy.optimize.power_limit import (  # noqa: E402
    LOCKED_CLOCK,
    POWER_LIMIT,
    PowerLimitOptimizer,
    SettingKind,
)
from lightning_energy.optimize.selectors import (  # noqa: E402
    Selector,
    make_selector,
    select_across,
)

PRESETS = ("a100", "h100", "h200", "a100_sxm", "a100_pcie", "a40_physics")


@dataclass(frozen=True)
class MeasuredBoards:
    """The measured data a preset was fitted on, and the presets fitted on its boards.

    Attributes:
        lock_suffix: the locked-clock curves' file suffix.
        gpu: the capped runs' GPU.
        lock_preset: the preset fitted on the boards the locks were measured on.
        cap_preset: the preset fitted on the boards the caps were measured on.
    """

    lock_suffix: str
    gpu: str
    lock_preset: str
    cap_preset: str


#: The presets fitted on the measured data (``benchmarks/calibrate_governor.py``). The
#: A100's locks were measured on SXM boards (``a100_sxm``), its caps on PCIe ones
#: (``a100_pcie``). The ``a100`` preset (A100-SXM4-40GB) was not fitted on these data.
_A100 = MeasuredBoards("a100_sxm", "A100", "a100_sxm", "a100_pcie")
MEASURED = {
    "a100_sxm": _A100,
    "a100_pcie": _A100,
    "a40_physics": MeasuredBoards("a40", "A40", "a40_physics", "a40_physics"),
}
GAP_TARGET_PP = 2.0
Work = tuple[Phase, ...]
WORKLOADS: dict[str, Work] = {
    "compute-bound": (Phase(1.0, 0.9),),
    "mixed": (Phase(1.0, 0.6),),
    "memory-bound": (Phase(1.0, 0.3),),
    "phased": (Phase(0.6, 0.95), Phase(0.4, 0.15)),
}
STEP_TIME_S = 0.5
GRID_STEP_W = 25.0
CLOCK_STEP_MHZ = 90.0
TOLERANCE = 0.01
TRUTH_SETTLE_STEPS = 2
TRUTH_STEPS = 4
ZEUS_STEPS_PER_CANDIDATE = 50  # 10 warm-up + 40 measured


@dataclass(frozen=True)
class Point:
    """One setting measured on the noiseless GPU."""

    setting: float
    time_s: float
    energy_j: float
    sm_clock_mhz: float | None


@dataclass(frozen=True)
class Choice:
    """One knob's search under one selector, scored on the noiseless measurements."""

    setting: float
    time_s: float
    energy_j: float
    steps: int
    sweep_steps: int
    best_setting: float


def spec(preset: str, work: Work, noise_std: float, seed: int) -> SimulatedSpec:
    """An ideal board (the counter and the settings immediate): the knobs are compared,
    not the board's counter period."""
    return SimulatedSpec(
        gpu=preset,
        step_time_s=STEP_TIME_S,
        step_phases=work,
        noise_std=noise_std,
        seed=seed,
        energy_counter_period_s=0.0,
        setting_latency_s=0.0,
        power_average_s=0.0,
    )


def apply(gpu: SimulatedGPU, kind: SettingKind, setting: float) -> None:
    if kind == POWER_LIMIT:
        gpu.set_power_limit_w(setting)
    else:
        gpu.set_locked_clocks_mhz(round(setting), round(setting))


def candidates(gpu: SimulatedGPU, kind: SettingKind) -> list[float]:
    """The controller's default candidates of ``kind``, highest first."""
    if kind == LOCKED_CLOCK:
        return thin_clocks_mhz(gpu.supported_sm_clocks_mhz(), CLOCK_STEP_MHZ)
    lo_w, hi_w = gpu.power_limit_constraints_w()
    limits = []
    limit_w = hi_w
    while limit_w >= lo_w - 1e-9:
        limits.append(limit_w)
        limit_w -= GRID_STEP_W
    return limits


def measure(gpu: SimulatedGPU, steps: int) -> tuple[float, float]:
    start_s, start_j = gpu.now_s(), gpu.energy_j()
    gpu.run_step(steps)
    return (gpu.now_s() - start_s) / steps, (gpu.energy_j() - start_j) / steps


def truth(preset: str, work: Work, kind: SettingKind, settings: Sequence[float]) -> list[Point]:
    """Each of ``settings`` of ``kind`` on a noiseless GPU, in the order given."""
    (gpu,) = simulated_gpus(spec(preset, work, 0.0, 0))
    points = []
    for setting in settings:
        apply(gpu, kind, setting)
        gpu.run_step(TRUTH_SETTLE_STEPS)
        time_s, energy_j = measure(gpu, TRUTH_STEPS)
        clock = gpu.sm_clock_mhz()
        points.append(Point(setting, time_s, energy_j, None if clock is None else float(clock)))
    return points


def seeded_clocks(gpu: SimulatedGPU, caps: Sequence[Point]) -> list[float]:
    """The lock candidates of ``power_limit.knob: auto``: the thinned clocks and the
    supported clock nearest the clock each cap ran at, highest first."""
    supported = sorted(gpu.supported_sm_clocks_mhz())
    ran_at = [p.sm_clock_mhz for p in caps if p.sm_clock_mhz is not None]
    seeds = {float(min(supported, key=lambda c: abs(c - clock))) for clock in ran_at}
    return sorted(set(candidates(gpu, LOCKED_CLOCK)) | seeds, reverse=True)


def search(
    preset: str,
    work: Work,
    kind: SettingKind,
    settings: Sequence[float],
    selector: Selector,
    noise: float,
    seed: int,
) -> PowerLimitOptimizer:
    """The optimizer of ``kind`` over ``settings``, run to its choice on a noisy GPU."""
    (gpu,) = simulated_gpus(spec(preset, work, noise, seed))
    optimizer = PowerLimitOptimizer(
        list(settings),
        selector,
        num_gpus=1,
        seed=seed,
        max_power_limit_w=gpu.power_limit_constraints_w()[1],
        kind=kind,
    )
    while (window := optimizer.next_window()) is not None:
        apply(gpu, kind, window.power_limit_w)
        gpu.run_step(window.settle_steps)
        if window.measure_steps == 0:
            optimizer.report(window, time_per_step_s=0.0, energy_per_step_j=0.0)
            continue
        time_s, energy_j = measure(gpu, window.measure_steps)
        optimizer.report(window, time_per_step_s=time_s, energy_per_step_j=energy_j)
    return optimizer


def auto_choice(caps: PowerLimitOptimizer, locks: PowerLimitOptimizer) -> tuple[str, float]:
    """``power_limit.knob: auto``'s choice: the selector's best among both knobs' measured
    candidates (what the controller does once both profiles are complete)."""
    index, best = select_across(
        caps.selector,
        [caps.choosable(), locks.choosable()],
        max_power_limit_w=caps.max_power_limit_w,
        num_gpus=caps.num_gpus,
    )
    return (POWER_LIMIT, LOCKED_CLOCK)[index].name, best.power_limit_w


def objective(name: str, point: Point, max_power_w: float, bound_s: float | None) -> float:
    """The selector's cost of ``point`` (inf: over its time bound by more than 1 %)."""
    if bound_s is not None and point.time_s > bound_s * (1.0 + TOLERANCE):
        return float("inf")
    if name == "time":
        return point.time_s
    if name == "cost":
        return 0.5 * point.energy_j + 0.5 * max_power_w * point.time_s
    return point.energy_j


def selectors(caps: Sequence[Point]) -> dict[str, tuple[Selector, float | None]]:
    """Each selector and its time bound (None: unconstrained), from full power's step."""
    full_s = caps[0].time_s
    fastest_s = min(p.time_s for p in caps)
    return {
        "energy": (make_selector("energy"), None),
        "time": (make_selector("time"), None),
        "cost": (make_selector("cost", eta=0.5), None),
        "max_slowdown": (make_selector("max_slowdown", max_slowdown=1.1), 1.1 * full_s),
        "target_time": (
            make_selector("target_time", target_time_s=1.2 * fastest_s),
            1.2 * fastest_s,
        ),
    }


def equal_speed_changes_pct(caps: Sequence[Point], locks: Sequence[Point]) -> list[float]:
    """Per power limit: the energy change of the cheapest lock at least as fast, in %."""
    changes = []
    for cap in caps:
        faster = [p for p in locks if p.time_s <= cap.time_s * (1.0 + 1e-3)]
        if faster:
            lock = min(faster, key=lambda p: p.energy_j)
            changes.append(100.0 * (lock.energy_j / cap.energy_j - 1.0))
    return changes


def workload_result(preset: str, work: Work, noise: float, seed: int) -> dict[str, Any]:
    (gpu,) = simulated_gpus(spec(preset, work, 0.0, 0))
    max_power_w = gpu.power_limit_constraints_w()[1]
    caps = truth(preset, work, POWER_LIMIT, candidates(gpu, POWER_LIMIT))
    grid = candidates(gpu, LOCKED_CLOCK)
    seeded = seeded_clocks(gpu, caps)
    locks = truth(preset, work, LOCKED_CLOCK, seeded)
    by_kind = {POWER_LIMIT.name: caps, LOCKED_CLOCK.name: locks}
    settings = {POWER_LIMIT.name: [p.setting for p in caps], LOCKED_CLOCK.name: grid}
    rows: dict[str, Any] = {}
    for name, (selector, bound_s) in selectors(caps).items():

        def cost(point: Point, name: str = name, bound_s: float | None = bound_s) -> float:
            return objective(name, point, max_power_w, bound_s)

        choices: dict[str, Choice] = {}
        optimizers = {}
        for kind in (POWER_LIMIT, LOCKED_CLOCK):
            points = by_kind[kind.name]
            optimizer = search(preset, work, kind, settings[kind.name], selector, noise, seed)
            optimizers[kind.name] = optimizer
            chosen = optimizer.chosen_power_limit_w
            point = next(p for p in points if p.setting == chosen)
            choices[kind.name] = Choice(
                point.setting,
                point.time_s,
                point.energy_j,
                optimizer.profiled_steps(),
                ZEUS_STEPS_PER_CANDIDATE * len(settings[kind.name]),
                min(points, key=cost).setting,
            )
        # auto: the limits' profile, then locks seeded at the clocks the caps ran at.
        seeded_locks = search(preset, work, LOCKED_CLOCK, seeded, selector, noise, seed)
        knob, setting = auto_choice(optimizers[POWER_LIMIT.name], seeded_locks)
        auto = next(p for p in by_kind[knob] if p.setting == setting)
        lock_cost, cap_cost = (
            cost(Point(c.setting, c.time_s, c.energy_j, None))
            for c in (choices[LOCKED_CLOCK.name], choices[POWER_LIMIT.name])
        )
        auto_cost = cost(auto)
        rows[name] = {
            **{k: asdict(c) for k, c in choices.items()},
            "auto": {
                "knob": knob,
                "setting": setting,
                "time_s": auto.time_s,
                "energy_j": auto.energy_j,
                "steps": optimizers[POWER_LIMIT.name].profiled_steps()
                + seeded_locks.profiled_steps(),
            },
            "lock_vs_cap_pct": _change_pct(lock_cost, cap_cost),
            "auto_vs_cap_pct": _change_pct(auto_cost, cap_cost),
            "auto_ok": auto_cost <= cap_cost * (1.0 + TOLERANCE),
        }
    return {
        "selectors": rows,
        "equal_speed_changes_pct": equal_speed_changes_pct(caps, locks),
        "average_clock_under_caps_mhz": {f"{p.setting:g}": p.sm_clock_mhz for p in caps},
    }


def _change_pct(cost: float, reference: float) -> float | None:
    """``cost`` against ``reference``, per cent (None: either breaks its time bound)."""
    if cost == float("inf") or reference == float("inf"):
        return None
    return 100.0 * (cost / reference - 1.0)


def _stats(changes: Sequence[float]) -> dict[str, Any]:
    """Median, mean, tails and count of energy changes, per cent."""
    return {
        "median_energy_change_pct": statistics.median(changes) if changes else None,
        "mean_energy_change_pct": statistics.fmean(changes) if changes else None,
        "min_energy_change_pct": min(changes, default=None),
        "max_energy_change_pct": max(changes, default=None),
        "n": len(changes),
    }


def measured_work(preset: str) -> dict[str, Any] | None:
    """The measured comparison's work simulated on ``preset`` (None: no measured data for
    its GPU). Every capped job the measured comparison uses (its bubble and one work phase,
    ``t0`` and ``beta`` fitted on its measured caps with the preset fixed) is run under each
    measured cap and at every supported locked clock, on the preset's governor:

    - ``same_work``: per capped run below the job's highest cap, the cheapest lock of the
      same job no slower, its energy vs the cap's, per cent; the set of runs is the
      measured comparison's;
    - ``relative``: the measured comparison's own procedure on simulated runs of the same
      work on the same boards: the stage profiles (each fitted single-phase work) at every
      measured clock on the preset fitted on the locks' boards, the jobs at every measured
      cap on the one fitted on the caps' boards, as relative curves
      (:func:`~lightning_energy.device.simulated.measured.relative_gaps`)."""
    boards = MEASURED.get(preset)
    if boards is None:
        return None
    model = PHYSICS_PRESETS[preset]
    cap_model = PHYSICS_PRESETS[boards.cap_preset]
    fitted = fitted_cap_jobs(boards.gpu)
    jobs, same = {}, []
    for job in cap_jobs(boards.gpu):
        if job.name in fitted:
            t0_s, beta, runs = capped_runs(model, job)
            same += same_work_gaps(model, t0_s, beta, job, runs)
            jobs[job.name] = runs if cap_model is model else capped_runs(cap_model, job)[2]
    lock_model = PHYSICS_PRESETS[boards.lock_preset]
    locks = relative_lock_curve(locked_runs(lock_model, lock_curves(boards.lock_suffix)))
    return {
        "same_work": _stats(same),
        "relative": {
            "boards": f"locks on {boards.lock_preset}, caps on {boards.cap_preset}",
            **_stats(relative_gaps(locks, jobs)),
        },
    }


def board_corrected_pct(lock_suffix: str, gpu: str, cap_preset: str) -> list[float]:
    """The measured comparison with the locks' reference moved to the caps' board: per
    job, the locked curves over their point at the measured clock nearest the one the
    job's work ran at under its highest cap (simulated on ``cap_preset``, fitted on these
    runs) instead of over their highest clock. Where locks and caps were measured on
    different boards, the highest clock of one and the highest cap of the other are not
    the same operating point, and the relative curves compare from different starts."""
    model = PHYSICS_PRESETS[cap_preset]
    curves = {c.name: c.points for c in lock_curves(lock_suffix)}
    clocks = sorted({f for points in curves.values() for f in points})
    changes = []
    for job in cap_jobs(gpu):
        points = fitted_cap_jobs(gpu).get(job.name)
        if points is None:
            continue
        t0_s, beta = fit_job(model, job)
        top = steady_run(model, t0_s, (Phase(1.0, beta),), max(points), settle_s=t0_s)
        reference = min(clocks, key=lambda f: abs(f - top.mean_clock_mhz))
        changes += relative_gaps(relative_lock_curve(curves, reference), {job.name: points})
    return changes


def measured(preset: str) -> dict[str, Any] | None:
    """The measured data's own lock-vs-cap comparison at equal speed for ``preset``'s GPU
    (None: no measured data for it), and where locks and caps were measured on different
    boards, the same comparison corrected for it (:func:`board_corrected_pct`)."""
    boards = MEASURED.get(preset)
    if boards is None:
        return None
    lock_suffix, gpu = boards.lock_suffix, boards.gpu
    data = _stats(measured_lock_vs_cap_pct(lock_suffix, gpu))
    corrected = None
    if boards.lock_preset != boards.cap_preset:
        corrected = _stats(board_corrected_pct(lock_suffix, gpu, boards.cap_preset))
        corrected["board_part_pp"] = (
            data["median_energy_change_pct"] - corrected["median_energy_change_pct"]
        )
    return {
        "data": f"Perseus artifact: locks {lock_suffix}, caps {gpu}",
        **data,
        "board_corrected": corrected,
    }


def preset_result(preset: str, noise: float, seed: int) -> dict[str, Any]:
    workloads = {
        name: workload_result(preset, work, noise, seed) for name, work in WORKLOADS.items()
    }
    changes = [c for w in workloads.values() for c in w["equal_speed_changes_pct"]]
    rows = [r for w in workloads.values() for r in w["selectors"].values()]
    synthetic = _stats(changes)
    work = measured_work(preset)
    data = measured(preset)
    gaps: dict[str, float | None] = {"gap_pp": None, "gap_board_corrected_pp": None}
    gaps["gap_same_work_pp"] = None
    if work is not None and data is not None:
        simulated_pct = work["same_work"]["median_energy_change_pct"]
        gaps["gap_pp"] = (
            work["relative"]["median_energy_change_pct"] - data["median_energy_change_pct"]
        )
        gaps["gap_same_work_pp"] = simulated_pct - data["median_energy_change_pct"]
        if data["board_corrected"] is not None:
            corrected_pct = data["board_corrected"]["median_energy_change_pct"]
            gaps["gap_board_corrected_pp"] = simulated_pct - corrected_pct
    return {
        "simulated_on": "synthetic workloads" if work is None else "measured jobs",
        **(synthetic if work is None else work["same_work"]),
        "auto_ok": sum(r["auto_ok"] for r in rows),
        "auto_rows": len(rows),
        "measured": data,
        **gaps,
        **{
            name.replace("_pp", "_ok"): None if gap is None else abs(gap) <= GAP_TARGET_PP
            for name, gap in gaps.items()
        },
        "synthetic": synthetic,
        "measured_work": work,
        "workloads": workloads,
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f} %"


def _spread(stats: dict[str, Any]) -> str:
    """Median, mean and tails of energy changes."""
    return (
        f"median {_pct(stats['median_energy_change_pct'])}, mean "
        f"{_pct(stats['mean_energy_change_pct'])}, min {_pct(stats['min_energy_change_pct'])}, "
        f"max {_pct(stats['max_energy_change_pct'])} (n={stats['n']})"
    )


def targets(results: dict[str, Any]) -> list[str]:
    """Whether each target is met, per preset, in words."""
    lines = []
    for preset, result in results.items():
        worse = [
            f"{workload}/{name} {_pct(row['auto_vs_cap_pct'])}"
            for workload, w in result["workloads"].items()
            for name, row in w["selectors"].items()
            if not row["auto_ok"]
        ]
        auto = "met" if not worse else f"NOT met ({', '.join(worse)})"
        gap = result["gap_pp"]
        measured_gap = (
            "no measured data for this board"
            if gap is None
            else f"{gap:+.2f} pp: {'met' if result['gap_ok'] else 'NOT met'}"
        )
        beside = [
            f"{what} {result[key]:+.2f} pp"
            for what, key in (
                ("vs the measured median", "gap_same_work_pp"),
                ("vs the board-corrected one", "gap_board_corrected_pp"),
            )
            if result.get(key) is not None
        ]
        if beside:
            measured_gap += f" (same work, which the data cannot show: {', '.join(beside)})"
        lines.append(
            f"{preset}: auto no worse than caps by > {100 * TOLERANCE:g} % in "
            f"{result['auto_ok']}/{result['auto_rows']} pairs: {auto}; simulated vs measured "
            f"median gap, by the measured comparison's procedure, within {GAP_TARGET_PP:g} pp: "
            f"{measured_gap}"
        )
    return lines


def table(results: dict[str, Any]) -> str:
    lines = []
    for preset, result in results.items():
        data, work = result["measured"], result["measured_work"]
        lines.append(f"{preset}: lock vs cap at equal speed, SIMULATED")
        if work is not None:
            lines.append(f"  measured jobs, same work: {_spread(work['same_work'])}")
            relative = work["relative"]
            lines.append(
                f"  measured jobs and stages, relative ({relative['boards']}): {_spread(relative)}"
            )
        lines.append(f"  synthetic workloads: {_spread(result['synthetic'])}")
        lines.append(
            f"  measured: {'no data' if data is None else data['data'] + ': ' + _spread(data)}"
        )
        if data is not None and data["board_corrected"] is not None:
            lines.append(f"  measured, board-corrected: {_spread(data['board_corrected'])}")
        lines.append(
            f"  {'workload':14} {'selector':13} {'cap W':>6} {'cap J':>8} {'cap s':>6} "
            f"{'lock MHz':>8} {'lock J':>8} {'lock s':>6} {'lock-cap':>9} {'auto':>11} "
            f"{'auto-cap':>9} {'steps cap/lock (sweeps)':>26}"
        )
        for workload, w in result["workloads"].items():
            for name, row in w["selectors"].items():
                cap, lock, auto = row[POWER_LIMIT.name], row[LOCKED_CLOCK.name], row["auto"]
                unit = "W" if auto["knob"] == POWER_LIMIT.name else "MHz"
                lines.append(
                    f"  {workload:14} {name:13} {cap['setting']:6.0f} {cap['energy_j']:8.1f} "
                    f"{cap['time_s']:6.3f} {lock['setting']:8.0f} {lock['energy_j']:8.1f} "
                    f"{lock['time_s']:6.3f} {_pct(row['lock_vs_cap_pct']):>9} "
                    f"{auto['setting']:7.0f} {unit:3} {_pct(row['auto_vs_cap_pct']):>9} "
                    f"{cap['steps']:>5}/{lock['steps']:<5} ({cap['sweep_steps']}/"
                    f"{lock['sweep_steps']})"
                )
    return "\n".join([*lines, "targets:", *targets(results)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=PRESETS, help="default: all")
    parser.add_argument("--noise-std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    results = {p: preset_result(p, args.noise_std, args.seed) for p in args.preset or PRESETS}
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
        print("\n".join(targets(results)), file=sys.stderr)
    else:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
