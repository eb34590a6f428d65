"""A job for the GPUGuard subprocess tests: run with ``sys.executable guard_child.py MODE ...``.

Modes:
    hold: guard simulated GPUs (state files in STATE_DIR, leases in LEASE_DIR), set their
        power limit, print one JSON line (pid, observe-only state, the limit applied) and
        wait for a signal.
    identity: print this process's identity as JSON and wait, holding no lease.
    exit: guard and set as ``hold`` without a ``with`` block or restore(), print the JSON
        line and exit with status 3, leaving the restore to the atexit safety net.

Options:
    --count N: how many simulated A40s (default 1).
    --power-w W: the power limit to set (default 150).
    --chain MARKER: before the guard, install a SIGTERM handler that writes MARKER and then
        dies of SIGTERM, to check that the guard chains to it.
    --fork-worker: once the limit is set, fork a child that outlives the job (as a
        DataLoader worker or a pool process may); its pid is in the JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.lease import ProcessIdentity
from lightning_energy.device.simulated import SimulatedSpec, simulated_gpus


def _wait_for_signals() -> None:
    while True:
        signal.pause()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["hold", "identity", "exit"])
    parser.add_argument("lease_dir")
    parser.add_argument("state_dir")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--power-w", type=float, default=150.0)
    parser.add_argument("--chain", default=None)
    parser.add_argument("--fork-worker", action="store_true")
    args = parser.parse_args()

    if args.mode == "identity":
        print(json.dumps(dataclasses.asdict(ProcessIdentity.current())), flush=True)
        _wait_for_signals()

    if args.chain is not None:
        marker = Path(args.chain)

        def previous_handler(signum: int, frame: FrameType | None) -> None:
            marker.write_text("previous handler ran", encoding="utf-8")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, previous_handler)

    gpus = simulated_gpus(SimulatedSpec(gpu="a40", count=args.count, state_dir=args.state_dir))
    guard = GPUGuard(gpus, lease_dir=args.lease_dir)
    if args.mode == "exit":
        _report(guard, guard.set_power_limit_w(args.power_w))
        sys.exit(3)
    with guard:
        applied_w = guard.set_power_limit_w(args.power_w)
        worker = _fork_worker() if args.fork_worker else None
        _report(guard, applied_w, worker=worker)
        _wait_for_signals()


def _fork_worker() -> int:
    """Fork a child that waits for signals; return once it runs Python code (the fork's
    handlers have run in it), so that the job can be killed at once after."""
    started, ready = os.pipe()
    worker = os.fork()
    if worker == 0:
        os.close(started)
        os.write(ready, b"1")
        os.close(ready)
        _wait_for_signals()
    os.close(ready)
    os.read(started, 1)
    os.close(started)
    return worker


def _report(guard: GPUGuard, applied_w: float, *, worker: int | None = None) -> None:
    state = {
        "pid": os.getpid(),
        "observe_only": guard.observe_only,
        "reason": guard.observe_only_reason,
        "applied_w": applied_w,
        "worker": worker,
    }
    print(json.dumps(state), flush=True)


if __name__ == "__main__":
    main()
