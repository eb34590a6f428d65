"""The ``lightning-energy`` command.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``handler`` (a function taking the
parsed arguments and returning the exit code). Exit codes: 0 ok, 2 bad usage or
configuration, 1 runtime failure.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from lightning_energy import __version__
from lightning_energy.errors import ConfigError, EnergyError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "main",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS: tuple[str, ...] = (
    "demo",
    "report",
    "profile",
    "plan",
    "carbon",
    "history",
    "recover",
    "doctor",
)


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="lightning-energy",
        description="Less energy and carbon for GPU training: power limits, batch sizes, "
        "pipeline frequencies and carbon-aware pacing.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at DEBUG level (never shows tokens)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"lightning_energy.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (also used as the console script)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage and 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.handler(args)
        sys.stdout.flush()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EnergyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        _discard_stdout()
        print("error: the output was closed before all of it was written", file=sys.stderr)
        return EXIT_FAILURE
    return code


def _discard_stdout() -> None:
    """Point stdout at /dev/null after its reader went away (``... | head``), so the
    interpreter's final flush does not fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a test's capture): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
