"""Calibrate one NVIDIA GPU, or a simulated one, in one command; read-only unless asked.

By default nothing on the GPU changes: no power limit, clock lock, persistence mode, MIG
layout or reset, also when run as root. The run reads the GPU through a view whose setters
refuse (``gpu_calibration.read_only``: the GPU object, and the ``pynvml`` module itself,
refuse every setting change and record the attempt, which is reported as a problem), so a
shared GPU can be measured safely. ``--change-settings`` adds the phases that change
settings, for a GPU the user owns.

Read-only phases, in order (each has its own budget in seconds, see
``READ_ONLY_PHASES``; all share ``--budget-s``):

1. ``identity``: name, NVML and torch UUIDs (do they match), limits, clocks, persistence;
2. ``processes``: the process ids NVML lists on the GPU against our own;
3. ``nvml_call_cost``: wall time per call of the energy, power, instantaneous power and
   clock-event-reason readings (mean, median, 99th percentile, maximum);
4. ``counter``: the energy counter's period and zero-delta shares, idle and under load;
5. ``power_readings``: idle power; under steady load the counter against the integrated
   instantaneous power field and the averaged ``nvmlDeviceGetPowerUsage``;
6. ``power_square_waves``: the same under 50/50 and 10/90 ms on/off waves of load: does
   the counter integrate all of the time?
7. ``clock_behaviour``: SM clock and clock event reasons, idle and under load;
8. ``workload_step``: the bf16 transformer block's time and energy per step at the GPU's
   own settings;
9. ``controller_observe``: the workload without and with a read-only ``EnergyController``
   (``power_limit: {enabled: false}``) around each step: time per step, hook cost, energy;
10. ``callback_overhead``: Lightning fits of the workload without and with
    ``EnergyCallback`` (the same read-only controller): time per step.

``--change-settings`` then adds ``permissions``, ``power_limit_sweep``, ``clock_sweep``,
``setting_latency``, ``restore_checks``, ``controller_run`` and ``simulated_comparison``
(see ``gpu_calibration.change``); in a read-only run they are named in ``skipped``.

Every phase's exception is caught (the next phase runs); the JSON is written after every
phase, and at the end also on SIGTERM and Ctrl-C (exit 130, the phases left named in
``skipped``). Settings changed with ``--change-settings`` are restored in any case; leases
left in the private lease directory are recovered before it is removed.

It needs nothing installed: the repository root is put on ``sys.path`` here, and nothing it
imports needs carbon, SQLAlchemy, APScheduler or platformdirs (torch, lightning and
nvidia-ml-py for a real GPU).

Usage::

    python benchmarks/gpu/calibrate.py --out runs/calibration.json          # read-only
    python benchmarks/gpu/calibrate.py --change-settings --out runs/own.json  # a GPU you own
    python benchmarks/gpu/calibrate.py --simulated h200 --out sim.json        # no GPU

Exit status: 0 every check passed, 1 a check failed, 2 no CUDA / NVML / GPU, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parents[1]):  # gpu_calibration, then lightning_energy first
    if sys.path[:1] != [str(_path)]:
        sys.path.insert(0, str(_path))

from gpu_calibration import change, observe, overhead  # noqa: E402
from gpu_calibration.benches import (  # noqa: E402
    Bench,
    NoGPU,
    SimulatedBench,
    TransformerWorkload,
    open_nvml_bench,
)
from gpu_calibration.read_only import RefusedCalls, read_only_nvml  # noqa: E402
from gpu_calibration.run import Interrupted, Options, Phase, Run, run_phases  # noqa: E402

from lightning_energy.device.guard import recover  # noqa: E402
from lightning_energy.device.simulated import CALIBRATION_FORMAT, PHYSICS_PRESETS, TRACE_GPUS  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_INTERRUPTED = 0, 1, 2, 130
PRESETS = tuple(sorted([*PHYSICS_PRESETS, *TRACE_GPUS]))
MAX_BUDGET_S = 480.0
DEFAULT_BUDGET_S = 240.0
# Presets by the words of a GPU's name.
_NAME_TO_PRESET = (
    ("H200", "h200"),
    ("H100", "h100"),
    ("A100", "a100"),
    ("A40", "a40"),
    ("V100", "v100"),
)

#: The read-only phases, in order: (name, budget, least needed to start, measurement).
READ_ONLY_PHASES: tuple[Phase, ...] = (
    Phase("identity", 10.0, 0.0, observe.identity),
    Phase("processes", 5.0, 0.0, observe.processes),
    Phase("nvml_call_cost", 10.0, 2.0, observe.nvml_call_cost),
    Phase("counter", 12.0, 7.0, observe.counter),
    Phase("power_readings", 20.0, 8.0, observe.power_readings),
    Phase("power_square_waves", 20.0, 11.0, observe.power_square_waves),
    Phase("clock_behaviour", 8.0, 4.0, observe.clock_behaviour),
    Phase("workload_step", 15.0, 5.0, observe.workload_step),
    Phase("controller_observe", 20.0, 8.0, overhead.controller_observe),
    Phase("callback_overhead", 60.0, 20.0, overhead.callback_overhead),
)
#: The phases ``--change-settings`` adds after them.
SETTINGS_PHASES: tuple[Phase, ...] = (
    Phase("permissions", 10.0, 0.0, change.permissions),
    Phase("power_limit_sweep", 60.0, 10.0, change.power_limit_sweep),
    Phase("clock_sweep", 60.0, 10.0, change.clock_sweep),
    Phase("setting_latency", 15.0, 8.0, change.setting_latency),
    Phase("restore_checks", 60.0, 20.0, change.restore_checks),
    Phase("controller_run", 60.0, 30.0, change.controller_run),
    Phase("simulated_comparison", 1.0, 0.0, change.simulated_comparison),
)


def preset_for(name: str) -> str | None:
    """The simulated preset of a GPU's name, or None."""
    for word, preset in _NAME_TO_PRESET:
        if word in name.upper():
            return preset
    return None


class Signals:
    """SIGTERM and SIGINT while the phases run: the first raises :class:`Interrupted` in
    the main thread; once :meth:`quiet` (restoring and writing), signals are only noted."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._raising = True
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.received = self.received or name
        if self._raising:
            self._raising = False
            raise Interrupted(name)

    def quiet(self) -> None:
        """From now on a signal is noted, not raised."""
        self._raising = False

    def __enter__(self) -> Signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


_READ_ONLY_SKIP = "changes GPU settings: only with --change-settings (on a GPU you own)"


def calibrate(run: Run, after_each: Callable[[dict[str, Any]], None]) -> None:
    """Run the phases of ``run``'s mode on its bench, ``after_each(document)`` after each.

    The settings found at the start are recorded first (``settings_at_start``); an
    interrupt ends the phases (see :func:`~gpu_calibration.run.run_phases`).
    """
    phases = READ_ONLY_PHASES
    if run.options.change_settings:
        phases += SETTINGS_PHASES
    else:
        for phase in SETTINGS_PHASES:
            run.skip(phase.name, _READ_ONLY_SKIP)
    limit_w, locked = run.bench.fresh_settings()
    run.result["settings_at_start"] = {"power_limit_w": limit_w, "clock_locked": locked}
    run_phases(run, phases, lambda: after_each(document(run)))


def check_settings(run: Run) -> None:
    """Read-only: the settings are still those found at the start (``settings_unchanged``).
    Changing: the power limit is the pre-job one and no lock is in force
    (``settings_restored``)."""
    start = run.result.get("settings_at_start")
    if start is None:
        return
    after_w, locked = run.bench.fresh_settings()
    before_w = start["power_limit_w"]
    if not run.options.change_settings:
        unchanged = (after_w, locked) == (before_w, start["clock_locked"])
        run.result["settings_unchanged"] = unchanged
        if not unchanged:
            run.problems.append(
                f"GPU settings moved during the run: {after_w} W, clock lock in force: "
                f"{locked} (at the start: {before_w} W, {start['clock_locked']})"
            )
        return
    restored = after_w == before_w and not locked
    run.result["settings_restored"] = restored
    if not restored:
        run.problems.append(
            f"GPU left changed: {after_w} W (was {before_w} W), clock lock in force: {locked}"
        )


def document(run: Run) -> dict[str, Any]:
    """The result as written: what was measured, what was skipped and every problem."""
    problems = list(run.problems)
    refused = run.refused.names
    if refused:
        problems.append(f"setting changes attempted and refused (read-only run): {refused}")
    sweeps = [*run.result.get("power_limit_sweep", []), *run.result.get("clock_sweep", [])]
    return {
        **run.result,
        "peak_power_w": max((r["power_w"] for r in sweeps), default=None),
        "elapsed_s": run.bench.now() - run.start_s,
        "phase_wall_s": run.phase_seconds,
        "setter_calls_refused": refused,
        "interrupted": run.interrupted,
        "skipped": run.skipped,
        "errors": run.errors,
        "problems": problems,
    }


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="runs/calibration.json", help="JSON file to write")
    parser.add_argument("--simulated", choices=PRESETS, help="calibrate a simulated GPU instead")
    parser.add_argument("--device", type=int, default=0, help="torch CUDA device index")
    parser.add_argument(
        "--change-settings",
        action="store_true",
        help="also run the phases that change power limits and clocks (a GPU you own; "
        "needs root or CAP_SYS_ADMIN)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for all phases (at most {MAX_BUDGET_S:g}); each phase has its own too",
    )
    parser.add_argument(
        "--force", action="store_true", help="--change-settings: also while others use the GPU"
    )
    parser.add_argument("--limit-points", type=int, default=5, help="power limits swept (>= 2)")
    parser.add_argument("--clock-points", type=int, default=6, help="SM clocks swept (>= 2)")
    parser.add_argument("--d-model", type=int, default=4096, help="transformer width")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--lease-dir", help="lease directory (default: a private temporary one)")
    parser.add_argument(
        "--state-dir", help="--simulated: directory of the GPU's state file (default: temporary)"
    )
    # The child processes of the restore checks (not for direct use).
    parser.add_argument(
        "--restore-child", choices=("exit", "sigterm", "sigkill"), help=argparse.SUPPRESS
    )
    parser.add_argument("--recover-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--uuid", help=argparse.SUPPRESS)
    parser.add_argument("--target-w", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--lock-mhz", type=int, help=argparse.SUPPRESS)
    return parser


def _open_bench(
    args: argparse.Namespace, workdir: Path, refused: RefusedCalls | None
) -> tuple[Bench, str | None]:
    """The backend and its simulated preset (raises :class:`NoGPU` without a GPU)."""
    if args.simulated:
        state_dir = args.state_dir or str(workdir / "state")
        return SimulatedBench(args.simulated, state_dir, refused), args.simulated

    def workload(index: int) -> TransformerWorkload:
        return TransformerWorkload(index, args.d_model, args.batch, args.seq)

    bench = open_nvml_bench(args.device, workload, refused)
    return bench, preset_for(bench.gpu.name)


def _recover_private_leases(lease_dir: Path) -> list[dict[str, Any]]:
    """Restore what leases left in the run's private directory say (a child killed, or
    the run interrupted, before its recover ran)."""
    if not lease_dir.is_dir() or not any(lease_dir.glob("*.json")):
        return []
    return [r.to_dict() for r in recover(lease_dir)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the calibration; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.restore_child:
        return change.restore_child(args)
    if args.recover_child:
        return change.recover_child(args)
    problems = []
    if not 0 < args.budget_s <= MAX_BUDGET_S:
        problems.append(f"--budget-s {args.budget_s:g}: use 0 < seconds <= {MAX_BUDGET_S:g}")
    if args.limit_points < 2 or args.clock_points < 2:
        problems.append("--limit-points and --clock-points: use 2 or more")
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return EXIT_FAILED
    with Signals() as signals:
        return _calibrate_and_write(args, signals)


def _calibrate_and_write(args: argparse.Namespace, signals: Signals) -> int:
    """Open the GPU, run the phases, restore, clean up and write the JSON (in any case)."""
    out = Path(args.out)
    workdir = Path(tempfile.mkdtemp(prefix="calibrate-"))
    options = Options(
        change_settings=args.change_settings,
        force=args.force,
        limit_points=args.limit_points,
        clock_points=args.clock_points,
        lease_dir=args.lease_dir or str(workdir / "leases"),
        script=str(Path(__file__).resolve()),
    )
    refused = RefusedCalls()
    head: dict[str, Any] = {
        "format": CALIBRATION_FORMAT,
        "mode": "change-settings" if args.change_settings else "read-only",
        "budget_s": args.budget_s,
    }
    bench: Bench | None = None
    run: Run | None = None
    extra: dict[str, Any] = {}
    problems: list[str] = []
    status = EXIT_OK
    wall_start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            if not args.change_settings:
                stack.enter_context(read_only_nvml(refused))
            bench, preset = _open_bench(args, workdir, None if args.change_settings else refused)
            run = Run(bench, options, args.budget_s, refused)
            run.result.update({**head, "backend": bench.backend, "preset": preset})
            calibrate(run, lambda partial: write_json(out, partial))
    except NoGPU as exc:
        print(exc, file=sys.stderr)
        extra["no_gpu"] = str(exc)
        problems.append(str(exc))
        status = EXIT_NO_GPU
    except (Interrupted, KeyboardInterrupt) as exc:  # while opening the GPU
        extra["interrupted"] = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
    except Exception as exc:  # the GPU or its workload could not be set up
        problems.append(f"setting up: {type(exc).__name__}: {exc}")
    finally:
        signals.quiet()  # from here on nothing may be cut short
        problems += _finish(run, bench, options, args, extra)
        shutil.rmtree(workdir, ignore_errors=True)
    result = {**head, "problems": []} if run is None else document(run)
    result.update(extra)
    result["problems"] += problems
    result["interrupted"] = result.get("interrupted") or signals.received
    result["wall_s"] = time.perf_counter() - wall_start
    write_json(out, result)
    print(json.dumps(result, indent=2))
    if result["interrupted"]:
        done = "settings restored" if args.change_settings else "nothing was changed"
        print(
            f"Interrupted by {result['interrupted']} ({done}); partial JSON written to {out}.",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if status != EXIT_OK:
        return status
    return EXIT_FAILED if result["problems"] else EXIT_OK


def _finish(
    run: Run | None,
    bench: Bench | None,
    options: Options,
    args: argparse.Namespace,
    extra: dict[str, Any],
) -> list[str]:
    """Check the settings, release the GPU, recover what leases the private directory
    kept (``--change-settings``: into ``extra``); the problems found (none of it raises)."""
    problems = []
    steps: list[tuple[str, Callable[[], None]]] = []
    if run is not None:
        steps.append(("checking the settings at the end", lambda: check_settings(run)))
    if bench is not None:
        steps.append(("releasing the GPU", bench.close))
    if args.change_settings and args.lease_dir is None:

        def recover_leases() -> None:
            extra["leases_recovered_at_exit"] = recovered = _recover_private_leases(
                Path(options.lease_dir)
            )
            if any(r["status"] == "failed" for r in recovered):
                problems.append(f"leases the private directory kept: {recovered}")

        steps.append(("recovering the private leases", recover_leases))
    for what, step in steps:
        try:
            step()
        except Exception as exc:
            problems.append(f"{what}: {type(exc).__name__}: {exc}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
