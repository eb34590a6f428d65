"""``lightning-energy report``: print a run report's summary and draw its plots.

Examples::

    lightning-energy report runs/demo.json
    lightning-energy report runs/demo.json --out runs/plots  # power, frontier, emissions PNGs
    lightning-energy report runs/demo.json --json            # the summary sections as JSON

Exit codes: 0 ok, 2 the file is missing or not a report, 1 the plots cannot be written.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_energy.argtypes import non_empty
from lightning_energy.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand."""
    parser = subparsers.add_parser(
        "report",
        help="print a run report's summary and render its plots (PNG)",
        description="Print the summary of a run report (written by any integration with "
        "'report: PATH' in its configuration, or by 'lightning-energy demo --report PATH') "
        "and, with --out, draw power.png (power limit and power over time, carbon intensity "
        "on a second axis), frontier.png (the measured energy-time frontier with the chosen "
        "point) and emissions.png (cumulative grams vs. the baselines).",
    )
    parser.add_argument("path", metavar="RUN.json", help="the report file")
    parser.add_argument(
        "--out", type=non_empty, metavar="DIR", help="write the PNG plots into this folder"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the summary, carbon and chosen power limits as JSON instead of a table",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the summary (and draw the plots); returns the exit code."""
    from lightning_energy.report import (
        ReportError,
        chosen_power_limits_w,
        format_report,
        load_report,
    )

    try:
        report = load_report(args.path)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        body = {
            "summary": report["summary"],
            "carbon": report.get("carbon"),
            "power_limits_chosen_w": chosen_power_limits_w(report),
            "devices": report["devices"],
        }
        print(json.dumps(body, indent=2))
    else:
        print(f"Run report {args.path} (created {report['created']})")
        print(format_report(report))
    if args.out:
        from lightning_energy.plots import render_plots

        try:
            paths = render_plots(report, args.out)
        except ReportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        stream = sys.stderr if args.json else sys.stdout
        print("plots: " + ", ".join(str(p) for p in paths), file=stream)
    return EXIT_OK
