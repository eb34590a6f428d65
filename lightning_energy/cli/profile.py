"""``lightning-energy profile``: measure the power-limit frontier of a training script.

Runs the script unchanged for ``--steps`` steps with ``LIGHTNING_ENERGY_CONFIG`` pointing
at a generated configuration (the profile settings and a report path): Lightning scripts
get the energy callback automatically through Lightning's ``callbacks_factory`` entry
point, and ``PL_TRAINER_MAX_STEPS`` makes the ``Trainer`` stop after that many steps (a
script that passes ``max_steps`` or ``max_epochs`` itself keeps its own values). Then it
prints the frontier from the run report: time and energy per step at every power limit,
and the limit the selector chooses.

Examples::

    lightning-energy profile --steps 300 -- python train.py --lr 0.1
    lightning-energy profile --selector energy --report runs/profile.json -- python train.py
    lightning-energy profile --config energy.yaml --json -- python train.py

Exit codes: 0 ok, 2 bad usage or configuration (or the command cannot be found), 1 the
script failed or wrote no report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from lightning_energy.argtypes import positive_int
from lightning_energy.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

__all__ = ["MAX_STEPS_ENV", "register", "run"]

#: Lightning reads ``Trainer`` defaults from ``PL_TRAINER_<ARGUMENT>`` variables.
MAX_STEPS_ENV = "PL_TRAINER_MAX_STEPS"
_DEFAULT_STEPS = 300
_STDERR_FD = 2  # the command's stdout goes to our stderr with --json (a file descriptor:
# sys.stderr may be an object without one)
_SELECTORS = ("energy", "time", "cost", "max_slowdown")


def register(subparsers: Any) -> None:
    """Add the ``profile`` subcommand."""
    parser = subparsers.add_parser(
        "profile",
        help="measure the power-limit frontier of your training script (-- COMMAND ...)",
        description="Run a training command for N steps with the energy callback attached "
        "(through LIGHTNING_ENERGY_CONFIG) and print the measured time and energy per step "
        "at every power limit. Put the command after '--'.",
        usage="lightning-energy profile [-h] [--steps N] [--config FILE] [--selector NAME] "
        "[--report PATH] [--json] -- COMMAND [ARG ...]",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=_DEFAULT_STEPS,
        metavar="N",
        help=f"training steps to run (default: {_DEFAULT_STEPS}; profiling 9 candidate "
        "limits takes about 100-180)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML configuration to start from (device, power_limit, ...; default: "
        "$LIGHTNING_ENERGY_CONFIG, else the defaults); its carbon section is ignored",
    )
    parser.add_argument(
        "--selector",
        choices=_SELECTORS,
        help="selector that picks the limit to report (default: the configuration's)",
    )
    parser.add_argument(
        "--report", metavar="PATH", help="keep the run report here (default: a temporary file)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the frontier as JSON on stdout (the command's own output goes to stderr)",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the training command, after '--'"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the command under the energy callback and print the frontier."""
    from lightning_energy.config import EnergyConfig, load_config

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "error: give the training command after '--', e.g. "
            "lightning-energy profile --steps 300 -- python train.py",
            file=sys.stderr,
        )
        return EXIT_USAGE
    base = load_config(args.config)
    with tempfile.TemporaryDirectory(prefix="lightning-energy-profile-") as tmp:
        report_path = Path(args.report) if args.report else Path(tmp) / "report.json"
        overrides: dict[str, Any] = {"report": str(report_path.resolve()), "carbon": None}
        if args.selector:
            overrides["power_limit"] = {"selector": args.selector}
        if base is not None:
            config = base.merged(overrides)
        else:
            config = EnergyConfig.from_mapping(overrides, source="lightning-energy profile")
        config_path = Path(tmp) / "energy.yaml"
        config_path.write_text(yaml.safe_dump(config.to_mapping()), encoding="utf-8")
        report_path.unlink(missing_ok=True)
        env = {
            **os.environ,
            "LIGHTNING_ENERGY_CONFIG": str(config_path),
            MAX_STEPS_ENV: str(args.steps),
        }
        try:
            completed = subprocess.run(
                command, env=env, stdout=_STDERR_FD if args.json else None, check=False
            )
        except FileNotFoundError:
            print(f"error: command not found: {command[0]}", file=sys.stderr)
            return EXIT_USAGE
        except PermissionError:
            print(f"error: cannot run {command[0]}: permission denied", file=sys.stderr)
            return EXIT_USAGE
        if completed.returncode != 0:
            print(
                f"error: the training command exited with status {completed.returncode}",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        return _print_frontier(report_path, args)


def _print_frontier(report_path: Path, args: argparse.Namespace) -> int:
    from lightning_energy.report import ReportError, chosen_power_limits_w, load_report

    try:
        report = load_report(report_path)
    except ReportError as exc:
        print(
            f"error: the command wrote no usable report ({exc}). Is it a Lightning script? "
            "The energy callback is added through LIGHTNING_ENERGY_CONFIG by Lightning's "
            "Trainer; other loops call attach_energy (Accelerate) or use the Fabric/Transformers "
            "callbacks (see docs/quickstart.md).",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    profile = sorted(report["profile"], key=lambda m: -float(m["power_limit_w"]))
    chosen = chosen_power_limits_w(report)
    choice = chosen[0] if chosen else None
    selector = report["config"].get("power_limit", {}).get("selector")
    if args.json:
        body = {
            "steps": report["summary"].get("steps"),
            "selector": selector,
            "chosen_power_limit_w": choice,
            "frontier": profile,
            "report": str(report_path) if args.report else None,
        }
        print(json.dumps(body, indent=2))
        return EXIT_OK
    if not profile:
        reason = "observe-only" if report["summary"].get("observe_only") else "too few steps"
        print(f"No power limit was measured ({reason}); see the decisions in the report.")
        return EXIT_OK
    top = profile[0]
    print(f"Power-limit frontier over {report['summary'].get('steps')} steps (job-wide, per step):")
    print(f"  {'limit':>7}  {'time/step':>10}  {'energy/step':>12}  {'time':>7}  {'energy':>7}")
    for m in profile:
        time_s, energy_j = float(m["time_per_step_s"]), float(m["energy_per_step_j"])
        slower = time_s / float(top["time_per_step_s"]) - 1
        cheaper = energy_j / float(top["energy_per_step_j"]) - 1 if top["energy_per_step_j"] else 0
        mark = "  <- chosen" if m["power_limit_w"] == choice else ""
        print(
            f"  {m['power_limit_w']:>5.0f} W  {time_s:>8.4f} s  {energy_j:>10.2f} J  "
            f"{slower:>+6.1%}  {cheaper:>+6.1%}{mark}"
        )
    if choice is None:
        print(f"The profile did not finish in {args.steps} steps: run with more --steps.")
    else:
        print(f"The '{selector}' selector chooses {choice:.0f} W.")
    if args.report:
        print(f"Report: {report_path}")
    return EXIT_OK
