"""``lightning-energy demo``: train a small model while the energy callback drives a GPU.

Runs on any machine: without an NVIDIA GPU the GPU is simulated (Zeus' measured A40 traces
by default) and the grid's carbon intensity is replayed from a real trace, on a virtual
clock, so a day of grid data passes in seconds. See :mod:`lightning_energy.demo`.

Examples::

    lightning-energy demo
    lightning-energy demo --report runs/demo.json
    lightning-energy report runs/demo.json --out runs/plots
    lightning-energy demo --gpu v100 --region CISO --steps 4800 --selector energy

Exit codes: 0 ok, 2 bad option, 1 the run failed.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_energy.cli import EXIT_OK

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand."""
    from lightning_energy.demo import add_arguments

    parser = subparsers.add_parser(
        "demo",
        help="train a small model on CPU while a simulated GPU follows real grid carbon data",
        description="Train a small MLP with Lightning while the energy callback profiles and "
        "paces a GPU (simulated when none is present) against a real carbon-intensity "
        "trace, then print the summary (energy, time, power limits, grams CO2eq, savings).",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code."""
    from lightning_energy.demo import options_from_args, run_demo

    run_demo(options_from_args(args))
    return EXIT_OK
