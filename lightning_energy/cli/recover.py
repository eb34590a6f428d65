"""``lightning-energy recover``: restore GPUs that killed jobs left changed.

A job killed with SIGKILL (or by the OOM killer, or a node crash) cannot put its GPUs'
power limits and clocks back; its lease files keep the pre-job settings. This command
restores every GPU whose lease belongs to a process that is gone, skips GPUs still used by
a live job, and says what it did. Run it from a Slurm epilog, a Kubernetes init container
or by hand (see docs/permissions.md). Root restores through NVML; an ordinary user restores
through zeusd (the daemon their own lease records, else ``ZEUSD_SOCK_PATH`` or
``ZEUSD_HOST_PORT``, with ``ZEUSD_TOKEN``).

It usually runs as root over a directory every user may write to: anything it cannot
trust (a symbolic link, a FIFO, another user's malformed lease, a lease of another user
asking for a lower limit, a directory others could rewrite) is refused, explained and left
alone.

Exit codes: 0 when nothing failed (refused files included: they are another user's, and
are reported), 1 when a GPU could not be restored (its lease is kept) or the directory is
unsafe, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json

from lightning_energy.argtypes import non_empty
from lightning_energy.cli import EXIT_FAILURE, EXIT_OK
from lightning_energy.device.guard import recover
from lightning_energy.device.lease import DEFAULT_LEASE_DIR, LEASE_DIR_ENV, resolve_lease_dir

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``recover`` subcommand."""
    parser = subparsers.add_parser(
        "recover",
        help="restore GPU settings left changed by jobs that were killed",
        description="Restore the pre-job power limit and clock state of every GPU whose "
        "lease outlived its job; leases of running jobs are left alone.",
    )
    parser.add_argument(
        "--lease-dir",
        metavar="DIR",
        default=None,
        type=non_empty,
        help=f"lease directory (default: ${LEASE_DIR_ENV}, else {DEFAULT_LEASE_DIR})",
    )
    parser.add_argument("--dry-run", action="store_true", help="only list what would be restored")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Restore stale leases and print the outcome; returns the exit code."""
    lease_dir = resolve_lease_dir(args.lease_dir)
    results = recover(lease_dir, dry_run=args.dry_run)
    if args.json:
        print(
            json.dumps(
                {"lease_dir": str(lease_dir), "results": [r.to_dict() for r in results]},
                indent=2,
            )
        )
    elif not results:
        print(f"No leases in {lease_dir}: nothing to restore.")
    else:
        width = max(len(r.status) for r in results)
        for r in results:
            owner = f" [{r.owner}]" if r.owner else ""
            print(f"{r.status:<{width}}  {r.gpu_uuid}{owner}: {r.message}")
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAILURE
