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
import sys
from collections.abc import Sequence

from lightning_energy import __version__
from lightning_energy.errors import ConfigError, EnergyError

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "build_parser", "main", "positive_int"]

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


def positive_int(text: str) -> int:
    """``argparse`` type: an integer >= 1, with a message naming the bad value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; use an integer >= 1")
    return value


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
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EnergyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
