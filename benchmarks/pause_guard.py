"""Does a job allowed to pause ever emit more than its carbon-unaware run?

The energy controller runs the same job twice on a simulated GPU replaying a grid trace,
once with the ``forecast`` policy (pausing allowed) and once with the ``static`` policy
(the carbon-unaware run: the selector's limit throughout), and compares the grams each
emitted, both measured. The job: ``--steps`` training steps (default 1500, ~16 h at full
speed on the simulated A40 with 100 steps an epoch), a deadline ``--deadline`` after its
start (default 40 h), the ``energy`` selector, hourly polling. One start a week, on
``--weeks`` consecutive Mondays of 2023 from ``--first``.

Also printed: the report's own carbon-unaware figure (an estimate: the profile's time and
energy per step at the selector's limit replayed against the trace) against the measured
static run, to show how far the report's estimate is from the run itself.

Usage::

    python benchmarks/pause_guard.py                      # DE, A40, 52 weekly starts
    python benchmarks/pause_guard.py --region FR --gpu v100 --weeks 8 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import date, timedelta
from pathlib import Path
from typing import Any

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController


def run_job(args: argparse.Namespace, start: date, policy: str, lease_dir: Path) -> dict[str, Any]:
    """One job: its measured grams, pauses, the report's estimate and the deadline."""
    config = EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "gpu": args.gpu,
                "start": f"{start.isoformat()}T00:00:00Z",
                "steps_per_epoch": 100,
                "lease_dir": str(lease_dir),
            },
            "power_limit": {"selector": "energy", "warmup_steps": 2, "settle_steps": 1},
            "carbon": {
                "provider": "trace",
                "region": args.region,
                "policy": policy,
                "deadline": args.deadline,
                "allow_pause": True,
                "poll_interval_s": 3600,
            },
            "log_every_n_steps": 10,
        }
    )
    controller = EnergyController(config, install_signal_handlers=False)
    controller.setup()
    controller.set_total_steps(args.steps)
    for _ in range(args.steps):
        controller.on_step_start()
        controller.on_step_end()
    carbon = controller.teardown().carbon or {}
    return {
        "emissions_g": carbon["emissions_g"],
        "estimate_g": carbon.get("carbon_unaware_emissions_g"),
        "pauses": sum(1 for d in controller.decisions if d["purpose"] == "pause"),
        "deadline_met": carbon.get("deadline_met"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--region", default="DE", choices=["CISO", "DE", "FR"])
    parser.add_argument("--gpu", default="a40", choices=["a40", "v100"])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--deadline", default="40h")
    parser.add_argument("--first", default="2023-01-02", help="the first Monday (ISO date)")
    parser.add_argument("--weeks", type=int, default=52)
    parser.add_argument("--json", action="store_true", help="one JSON line per start")
    args = parser.parse_args(argv)
    first = date.fromisoformat(args.first)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for week in range(args.weeks):
            start = first + timedelta(days=7 * week)
            paced = run_job(args, start, "forecast", Path(tmp) / "leases")
            unaware = run_job(args, start, "static", Path(tmp) / "leases")
            row = {
                "start": start.isoformat(),
                "pauses": paced["pauses"],
                "emissions_g": paced["emissions_g"],
                "carbon_unaware_g": unaware["emissions_g"],
                "vs_carbon_unaware": paced["emissions_g"] / unaware["emissions_g"] - 1,
                "estimate_error": (unaware["estimate_g"] or 0.0) / unaware["emissions_g"] - 1,
                "deadline_met": bool(paced["deadline_met"]),
            }
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{row['start']}  pauses {row['pauses']}  "
                    f"{row['emissions_g']:8.1f} g vs {row['carbon_unaware_g']:8.1f} g "
                    f"({row['vs_carbon_unaware']:+.3%})  report's estimate "
                    f"{row['estimate_error']:+.3%}",
                    flush=True,
                )
    worse = [r for r in rows if r["emissions_g"] > r["carbon_unaware_g"]]
    paused = [r for r in rows if r["pauses"]]
    errors = sorted(abs(r["estimate_error"]) for r in rows)
    print(
        f"{args.region}, {args.gpu}, {len(rows)} starts: {len(worse)} emitted more than their "
        f"carbon-unaware run, {len(paused)} paused (saving "
        f"{min((-r['vs_carbon_unaware'] for r in paused), default=0.0):.1%} to "
        f"{max((-r['vs_carbon_unaware'] for r in paused), default=0.0):.1%}), "
        f"{sum(not r['deadline_met'] for r in rows)} missed the deadline; the report's "
        f"estimate of the carbon-unaware run is off by {errors[len(errors) // 2]:.3%} "
        f"(median) and {errors[-1]:.3%} (max)"
        if rows
        else "no starts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
