"""Check the NVML backend on the real NVIDIA GPUs of this machine.

For every visible GPU it reads each value the backend exposes, then (unless
``--read-only``) sets a lower power limit and a clock lock, reads them back, and restores
the original power limit and releases the lock, in a ``finally`` that also runs on Ctrl-C
and SIGTERM. It prints a before / set / after table (``--json`` for machine-readable output).

Safe on a shared machine: a GPU on which another process is computing is only read unless
``--force``; MIG instances are only read (their settings belong to the whole GPU). Changing
settings needs root or CAP_SYS_ADMIN; without it the refusal is reported and nothing
changes. NVML cannot report a clock lock set by someone else, so the release at the end
also clears such a lock: use ``--read-only`` on GPUs where an administrator locked clocks.

Usage::

    python benchmarks/gpu/check_nvml.py [--read-only] [--force] [--indices 0,1] [--json]

Exit status: 0 all checks passed, 1 a check failed, 2 no NVML or no GPU, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

from lightning_energy.device.nvml import NVMLGPU, nvml_gpus
from lightning_energy.errors import DeviceError, NotSupportedError

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass
class Settings:
    """The settable state of a GPU at one moment."""

    power_limit_w: float
    enforced_power_limit_w: float
    locked_clocks_mhz: tuple[int, int] | None


@dataclass
class GPUReport:
    """What was read and done on one GPU."""

    index: int
    name: str = ""
    uuid: str = ""
    is_mig: bool = False
    values: dict[str, Any] = field(default_factory=dict)
    before: Settings | None = None
    during: Settings | None = None
    after: Settings | None = None
    skipped: str | None = None
    problems: list[str] = field(default_factory=list)


def _read(report: GPUReport, key: str, read: Any) -> Any:
    try:
        value = read()
    except NotSupportedError as exc:
        report.values[key] = f"not supported: {exc}"
        return None
    except DeviceError as exc:
        report.values[key] = f"error: {exc}"
        report.problems.append(f"reading {key}: {exc}")
        return None
    report.values[key] = value
    return value


def read_values(gpu: NVMLGPU, report: GPUReport, energy_window_s: float) -> None:
    """Read every value the backend exposes into ``report.values``."""
    report.name, report.uuid, report.is_mig = gpu.name, gpu.uuid, gpu.is_mig
    _read(report, "power_limit_constraints_w", gpu.power_limit_constraints_w)
    _read(report, "default_power_limit_w", gpu.default_power_limit_w)
    _read(report, "power_w", gpu.power_w)
    clocks = _read(report, "supported_sm_clocks_mhz", gpu.supported_sm_clocks_mhz)
    if clocks:
        report.values["supported_sm_clocks_mhz"] = f"{len(clocks)} clocks, {clocks[0]}-{clocks[-1]}"
    _read(report, "running_process_ids", gpu.running_process_ids)
    start_j = _read(report, "energy_j", gpu.energy_j)
    if start_j is not None:
        time.sleep(energy_window_s)
        end_j = _read(report, "energy_j_after_window", gpu.energy_j)
        if end_j is not None and end_j < start_j:
            report.problems.append(f"energy counter went backwards: {start_j} -> {end_j} J")
        if end_j is not None and energy_window_s > 0:
            report.values["average_power_over_window_w"] = (end_j - start_j) / energy_window_s


def read_settings(gpu: NVMLGPU) -> Settings:
    """The power limits and the clock lock known now."""
    return Settings(gpu.power_limit_w(), gpu.enforced_power_limit_w(), gpu.locked_clocks_mhz())


def lower_power_limit_w(min_w: float, max_w: float, current_w: float) -> float:
    """A power limit below ``current_w``: the midpoint of the range, or halfway down to the
    minimum when the current limit is already at or below the midpoint (whole watts)."""
    midpoint = (min_w + max_w) / 2
    target = midpoint if midpoint < current_w else (min_w + current_w) / 2
    return float(max(min_w, min(current_w, round(target))))


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt inside the block, so ``finally`` clauses run."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exercise_settings(gpu: NVMLGPU, report: GPUReport) -> None:
    """Set a lower power limit and a mid clock lock, read them back, restore both."""
    before = read_settings(gpu)
    report.before = before
    min_w, max_w = gpu.power_limit_constraints_w()
    target_w = lower_power_limit_w(min_w, max_w, before.power_limit_w)
    clocks = gpu.supported_sm_clocks_mhz()
    mid_mhz = clocks[len(clocks) // 2]
    # Marked before each call: an interrupt may land after the driver applied the change.
    limit_set = locked = False
    try:
        limit_set = True
        try:
            gpu.set_power_limit_w(target_w)
        except DeviceError:
            limit_set = False
            raise
        locked = True
        try:
            gpu.set_locked_clocks_mhz(mid_mhz, mid_mhz)
        except DeviceError:
            locked = False
            raise
        report.during = read_settings(gpu)
        if report.during.power_limit_w != target_w:
            report.problems.append(
                f"power limit read back {report.during.power_limit_w} W, set {target_w} W"
            )
    except DeviceError as exc:
        report.problems.append(f"changing settings: {exc}")
    finally:
        restore(gpu, report, before.power_limit_w if limit_set else None, locked)
    report.after = read_settings(gpu)
    if report.after.power_limit_w != before.power_limit_w:
        report.problems.append(
            f"power limit not restored: {report.after.power_limit_w} W, was "
            f"{before.power_limit_w} W"
        )


def restore(gpu: NVMLGPU, report: GPUReport, power_limit_w: float | None, locked: bool) -> None:
    """Put back the power limit (when given) and release the clock lock (when set)."""
    if power_limit_w is not None:
        try:
            gpu.set_power_limit_w(power_limit_w)
        except DeviceError as exc:
            report.problems.append(f"RESTORING the power limit to {power_limit_w} W: {exc}")
    if locked:
        try:
            gpu.reset_locked_clocks()
        except DeviceError as exc:
            report.problems.append(f"RELEASING the clock lock: {exc}")


def check_gpu(gpu: NVMLGPU, *, read_only: bool, force: bool, energy_window_s: float) -> GPUReport:
    """Read, and unless told otherwise exercise, one GPU."""
    report = GPUReport(index=gpu.index)
    read_values(gpu, report, energy_window_s)
    others = [p for p in report.values.get("running_process_ids") or [] if p != os.getpid()]
    if read_only:
        report.skipped = "--read-only"
    elif gpu.is_mig:
        report.skipped = "MIG: observe-only"
    elif others and not force:
        report.skipped = f"other processes are using it ({others}); --force to change anyway"
    else:
        exercise_settings(gpu, report)
    return report


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return f"{value[0]}-{value[1]}"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def format_report(report: GPUReport) -> str:
    """A human-readable block for one GPU."""
    lines = [
        f"GPU {report.index}: {report.name}  {report.uuid}" + ("  [MIG]" if report.is_mig else "")
    ]
    for key, value in report.values.items():
        lines.append(f"  {key:<30} {_fmt(value)}")
    if report.skipped:
        lines.append(f"  settings not changed: {report.skipped}")
    else:
        lines.append(f"  {'setting':<30} {'before':>12} {'set/read':>12} {'after':>12}")
        for key in ("power_limit_w", "enforced_power_limit_w", "locked_clocks_mhz"):
            row = [
                getattr(s, key) if s else None for s in (report.before, report.during, report.after)
            ]
            lines.append(f"  {key:<30} " + " ".join(f"{_fmt(v):>12}" for v in row))
    lines.extend(f"  PROBLEM: {p}" for p in report.problems)
    lines.append("  OK" if not report.problems else "  FAILED")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read-only", action="store_true", help="only read values")
    parser.add_argument("--force", action="store_true", help="change GPUs others are using")
    parser.add_argument("--indices", help="comma-separated process-local indices (default all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--energy-window-s", type=float, default=1.0, help="seconds between energy readings"
    )
    args = parser.parse_args(argv)
    indices = [int(i) for i in args.indices.split(",")] if args.indices else None
    try:
        gpus = nvml_gpus(indices)
    except DeviceError as exc:
        print(f"No NVIDIA GPU usable through NVML: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    if not gpus:
        print("NVML sees no GPU (check CUDA_VISIBLE_DEVICES).", file=sys.stderr)
        return EXIT_NO_GPU
    reports: list[GPUReport] = []
    status = EXIT_OK
    try:
        with sigterm_raises():
            for gpu in gpus:
                reports.append(
                    check_gpu(
                        gpu,
                        read_only=args.read_only,
                        force=args.force,
                        energy_window_s=args.energy_window_s,
                    )
                )
    except KeyboardInterrupt:
        print("Interrupted: settings changed so far were restored.", file=sys.stderr)
        status = EXIT_INTERRUPTED
    finally:
        for gpu in gpus:
            gpu.close()
    if status == EXIT_OK and any(r.problems for r in reports):
        status = EXIT_FAILED
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=2))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    return status


if __name__ == "__main__":
    sys.exit(main())
