"""``lightning-energy carbon now|forecast|window``: the grid carbon intensity of a region,
and the best time to start a job there.

Examples::

    lightning-energy carbon now --config job.yaml
    lightning-energy carbon now --config job.yaml --json        # {"g_per_kwh": ..., ...}
    lightning-energy carbon forecast --config job.yaml --hours 12
    lightning-energy carbon now --config job.yaml --verbose     # DEBUG logs, no token
    lightning-energy carbon window --duration 8h --within 24h --region DE --power-w 2400
    lightning-energy carbon window --duration 8h --config job.yaml --report runs/run.json

Exit codes: 0 ok, 2 bad usage or configuration, 1 the provider failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

from carbon.config import (
    PROVIDERS,
    CarbonConfig,
    build_provider,
    load_carbon_config,
    parse_deadline,
)
from carbon.errors import CarbonConfigError, CarbonError
from carbon.providers.base import CarbonProvider
from carbon.types import IntensityPoint
from carbon.window import MAX_WITHIN_S, MIN_DURATION_S, StartWindow, best_start
from lightning_energy.argtypes import float_in, non_empty

__all__ = ["register"]

_EXIT_OK = 0
_EXIT_FAILURE = 1
_EXIT_USAGE = 2
_MAX_FORECAST_HOURS = 8760  # a year
_MAX_POWER_W = 1e7  # ten megawatts: far beyond any one job
_SEED_HISTORY = timedelta(hours=24)  # what the carbon monitor seeds its history with
_WEB_PROVIDERS = tuple(p for p in PROVIDERS if p != "constant")

logger = logging.getLogger(__name__)


def _now() -> datetime:
    """The wall-clock time in UTC (the one place the command reads the clock)."""
    return datetime.now(timezone.utc)


def _duration(text: str) -> timedelta:
    """``argparse`` type: a duration (``8h``, ``90m``, ``2d 4h``, ``PT8H``)."""
    try:
        value = parse_deadline(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed ({exc}); use a duration such as '8h', '90m', '2d 4h' "
            "or 'PT8H'"
        ) from None
    if not isinstance(value, timedelta):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a time; use a duration such as '8h', '90m', '2d 4h' or 'PT8H'"
        )
    return value


_duration.__name__ = "duration"  # argparse names the type in its own messages


def register(subparsers: Any) -> None:
    """Add the ``carbon`` command and its ``now`` / ``forecast`` / ``window`` actions."""
    parser = subparsers.add_parser(
        "carbon",
        help="grid carbon intensity: the current value, the forecast, the best start",
        description="Ask the configured carbon-intensity provider (the 'carbon:' section "
        "of a YAML file) for the current value or the forecast, or for the best time to "
        "start a job.",
    )
    actions = parser.add_subparsers(dest="carbon_action", metavar="ACTION", required=True)
    now = actions.add_parser("now", help="print the current carbon intensity")
    forecast = actions.add_parser("forecast", help="print the forecast as a table")
    forecast.add_argument(
        "--hours",
        type=float_in(0, _MAX_FORECAST_HOURS, low_inclusive=False),
        default=24.0,
        metavar="N",
        help="hours ahead (default: 24)",
    )
    for action in (now, forecast):
        action.add_argument(
            "--config", required=True, metavar="FILE", help="YAML file with a 'carbon:' section"
        )
    window = actions.add_parser(
        "window",
        help="the best time to start a job, and the grams against starting now",
        description="The least-carbon start of a job that runs DURATION without a break and "
        "must be done within WITHIN of now, planned as carbon-aware pacing plans (the same "
        "provider, forecast, daily profile past the forecast, and planner), with the grams "
        "against starting now and a Slurm --begin value.",
    )
    window.add_argument(
        "--duration",
        required=True,
        type=_duration,
        metavar="DURATION",
        help="how long the job runs: '8h', '90m', '2d 4h', 'PT8H'",
    )
    window.add_argument(
        "--within",
        type=_duration,
        default=timedelta(hours=24),
        metavar="DURATION",
        help=f"the job must be done within this of now (default: 24h; from DURATION to "
        f"{MAX_WITHIN_S / 3600:g}h)",
    )
    source = window.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="FILE", help="YAML file with a 'carbon:' section")
    source.add_argument(
        "--region",
        metavar="REGION",
        help="the grid, with the defaults of the 'carbon:' section (Electricity Maps: a zone "
        "such as 'DE', token in ELECTRICITYMAPS_TOKEN)",
    )
    window.add_argument(
        "--provider",
        choices=_WEB_PROVIDERS,
        help="with --region: the provider (default: electricitymaps)",
    )
    power = window.add_mutually_exclusive_group()
    power.add_argument(
        "--power-w",
        type=float_in(0, _MAX_POWER_W, low_inclusive=False),
        metavar="W",
        help="the job's mean power in watts, for the grams",
    )
    power.add_argument(
        "--report",
        type=non_empty,
        metavar="FILE",
        help="a run report of the job: its measured mean power, for the grams",
    )
    for action in (now, forecast, window):
        action.add_argument("--json", action="store_true", help="print JSON for scripts")
        action.add_argument(
            "--verbose",
            dest="carbon_verbose",
            action="store_true",
            help="log at DEBUG level, HTTP included (tokens are never shown)",
        )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Run ``carbon now``, ``forecast`` or ``window``; returns the exit code."""
    if getattr(args, "carbon_verbose", False):
        logging.getLogger().setLevel(logging.DEBUG)
    try:
        config = _config(args)
        power = None
        if args.carbon_action == "window":
            _check_window(args)
            power = _power(args)
        provider = build_provider(config, now=_now)
    except (CarbonConfigError, _UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    try:
        if args.carbon_action == "now":
            _print_now(config, provider, provider.latest(), args.json)
        elif args.carbon_action == "forecast":
            _print_forecast(config, provider, provider.forecast(args.hours * 3600.0), args.json)
        else:
            best = _window(config, provider, args, power[0] if power else None)
            _print_window(config, provider, args, best, power)
    except CarbonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _EXIT_FAILURE
    finally:
        close = getattr(provider, "close", None)
        if callable(close):
            close()
    return _EXIT_OK


class _UsageError(ValueError):
    """Arguments that parse but do not go together."""


def _config(args: argparse.Namespace) -> CarbonConfig:
    if args.carbon_action != "window" or args.config is not None:
        if getattr(args, "provider", None) is not None:
            raise _UsageError("--provider goes with --region; with --config the file names it")
        return load_carbon_config(args.config)
    return CarbonConfig(
        provider=args.provider or "electricitymaps", region=args.region, source="command line"
    )


def _check_window(args: argparse.Namespace) -> None:
    """Durations that parse but cannot be planned."""
    if args.duration.total_seconds() < MIN_DURATION_S:
        raise _UsageError(
            f"--duration {_hours(args.duration)} is not allowed; allowed: at least "
            f"{_hours(timedelta(seconds=MIN_DURATION_S))}"
        )
    if args.within < args.duration:
        raise _UsageError(
            f"--within {_hours(args.within)} is shorter than --duration "
            f"{_hours(args.duration)}; allowed: from the duration to {MAX_WITHIN_S / 3600:g}h"
        )
    if args.within.total_seconds() > MAX_WITHIN_S:
        raise _UsageError(
            f"--within {_hours(args.within)} is not allowed; allowed: from the duration to "
            f"{MAX_WITHIN_S / 3600:g}h (past the forecast only a daily profile is left)"
        )


def _power(args: argparse.Namespace) -> tuple[float, str] | None:
    """The job's mean power while it trains, and where it comes from, when given.

    From a report: the job's energy over the run's time, or, where carbon pacing paused
    the run (logging intervals without a step, at idle power), over the time it trained,
    the pauses' energy left out: the window plans a job that runs without a break."""
    if args.power_w is not None:
        return float(args.power_w), "given"
    if args.report is None:
        return None
    from lightning_energy.report import ReportError, load_report

    try:
        report = load_report(args.report)
    except ReportError as exc:
        raise _UsageError(f"--report: {exc}") from None
    summary = report["summary"]
    duration_s = summary.get("duration_s")
    energy_j = (report.get("job") or {}).get("energy_j", summary.get("energy_j"))
    if not (duration_s and energy_j and duration_s > 0 and energy_j > 0):
        raise _UsageError(
            f"--report: {args.report} holds no measured energy and time to take the power "
            "from; give --power-w"
        )
    power_w = float(energy_j) / float(duration_s)
    paused = [e for e in report["timeline"] if not e.get("steps")]
    training = [e for e in report["timeline"] if e.get("steps")]
    train_j = sum(float(e.get("energy_j") or 0.0) for e in training)
    train_s = sum(float(e.get("duration_s") or 0.0) for e in training)
    own_j = summary.get("energy_j")
    pauses_out = bool(paused) and train_j > 0 and train_s > 0 and bool(own_j)
    if pauses_out:  # this rank's training power, scaled to the job's energy
        power_w = train_j / train_s * float(energy_j) / float(own_j)
    if not (math.isfinite(power_w) and power_w <= _MAX_POWER_W):
        raise _UsageError(f"--report: {args.report} gives an impossible power ({power_w:g} W)")
    simulated = any("(simulated)" in str(d.get("name", "")) for d in report["devices"])
    on = " on simulated GPUs" if simulated else ""
    out = ", pauses left out" if pauses_out else ""
    return power_w, f"measured{on} in {args.report}{out}"


def _window(
    config: CarbonConfig, provider: CarbonProvider, args: argparse.Namespace, power_w: float | None
) -> StartWindow:
    """Ask the provider as the carbon monitor does (the latest value, the forecast asked
    for by the configuration, the last day of history) and plan the start."""
    now = _now()
    latest = provider.latest()
    forecast: list[IntensityPoint] = []
    if config.forecast_horizon_s > 0:
        try:
            forecast = provider.forecast(config.forecast_horizon_s)
        except CarbonError as exc:
            print(
                f"warning: no forecast ({exc}); planning on the daily profile of the history",
                file=sys.stderr,
            )
    try:
        history = provider.history(now - _SEED_HISTORY, now)
    except CarbonError as exc:
        logger.debug("no history from %s: %s", provider.name, exc)
        history = []
    return best_start(
        now,
        latest.intensity_g_per_kwh,
        forecast,
        [*history, latest],
        duration_s=args.duration.total_seconds(),
        within_s=args.within.total_seconds(),
        step_s=config.poll_interval_s,
        power_w=power_w or 1.0,
    )


def _point_dict(point: IntensityPoint) -> dict[str, Any]:
    return {
        "time": point.time.isoformat(),
        "g_per_kwh": point.intensity_g_per_kwh,
        "kind": point.kind.value,
        "source": point.source,
    }


def _kind(provider: CarbonProvider, point: IntensityPoint) -> str:
    """What a point is, in words: recorded traces are replayed, not measured now."""
    if provider.name == "trace":
        return "replayed"
    return point.kind.value


def _grid(config: CarbonConfig, provider: CarbonProvider) -> str:
    """The provider, region and emission factor, as every output states them."""
    return f"{provider.name} {provider.region} ({config.emission_factor_reported} emission factors)"


def _print_now(
    config: CarbonConfig, provider: CarbonProvider, point: IntensityPoint, as_json: bool
) -> None:
    if as_json:
        body = {
            "provider": provider.name,
            "region": provider.region,
            "emission_factor": config.emission_factor_reported,
            **_point_dict(point),
        }
        body["replayed"] = provider.name == "trace"
        print(json.dumps(body))
        return
    value = f"{point.intensity_g_per_kwh:.1f} gCO2eq/kWh"
    if provider.name == "constant":
        print(f"constant: {value} (a fixed value from the configuration, not grid data)")
        return
    if provider.name == "trace":
        print(
            f"trace {provider.region}: {value} ({config.emission_factor_reported} emission "
            f"factors; replayed from a recorded trace, not measured now: the trace's value "
            f"for the interval from {point.time:%m-%d %H:%M} UTC, its year wrapped onto "
            f"{point.time:%Y}; source {point.source})"
        )
        return
    print(
        f"{_grid(config, provider)}: {value} "
        f"({point.kind.value}, interval from {point.time:%Y-%m-%d %H:%M} UTC, "
        f"source {point.source})"
    )


def _print_forecast(
    config: CarbonConfig, provider: CarbonProvider, points: list[IntensityPoint], as_json: bool
) -> None:
    if as_json:
        body = {
            "provider": provider.name,
            "region": provider.region,
            "emission_factor": config.emission_factor_reported,
            "points": [_point_dict(p) for p in points],
        }
        print(json.dumps(body))
        return
    print(f"{_grid(config, provider)}: {len(points)} points")
    print(f"{'time (UTC)':<17}  {'gCO2eq/kWh':>10}  kind")
    for p in points:
        print(f"{p.time:%Y-%m-%d %H:%M}  {p.intensity_g_per_kwh:>10.1f}  {_kind(provider, p)}")


def _slurm_begin(best: StartWindow, now_start: bool) -> str:
    """The ``sbatch --begin`` value: ``now``, or the start in this machine's local time
    (sbatch reads a time without a zone in the local time of the machine it runs on)."""
    if now_start:
        return "now"
    return best.start.astimezone().strftime("%Y-%m-%dT%H:%M:%S")


def _print_window(
    config: CarbonConfig,
    provider: CarbonProvider,
    args: argparse.Namespace,
    best: StartWindow,
    power: tuple[float, str] | None,
) -> None:
    duration_s = args.duration.total_seconds()
    start_in_s = best.start_in_s
    begin = _slurm_begin(best, start_in_s == 0)
    grams = power is not None
    if args.json:
        body: dict[str, Any] = {
            "provider": provider.name,
            "region": provider.region,
            "emission_factor": config.emission_factor_reported,
            "duration_s": duration_s,
            "within_s": args.within.total_seconds(),
            "start": best.start.isoformat(),
            "end": best.end.isoformat(),
            "start_in_s": start_in_s,
            "slurm_begin": begin,
            "mean_g_per_kwh": best.mean_g_per_kwh,
            "now_mean_g_per_kwh": best.now_mean_g_per_kwh,
            "power_w": power[0] if power else None,
            "power_from": power[1] if power else None,
            "emissions_g": best.emissions_g if grams else None,
            "now_emissions_g": best.now_emissions_g if grams else None,
            "saved_g": best.saved_g if grams else None,
            "forecast_reach_s": best.forecast_reach_s,
            "beyond_forecast_s": best.beyond_forecast_s,
            "step_s": best.step_s,
        }
        print(json.dumps(body))
        return
    print(
        f"{_grid(config, provider)}: the best start of a {_hours(args.duration)} job done "
        f"within {_hours(args.within)}"
    )
    when = "now" if start_in_s == 0 else f"in {_hours(timedelta(seconds=start_in_s))}"
    print(
        f"  start      {best.start:%Y-%m-%d %H:%M} UTC ({when}), ends {best.end:%Y-%m-%d %H:%M} UTC"
    )
    print(
        f"  expected   {best.mean_g_per_kwh:.0f} gCO2eq/kWh over the job, against "
        f"{best.now_mean_g_per_kwh:.0f} started now"
    )
    if power is not None:
        share = best.saved_g / best.now_emissions_g if best.now_emissions_g > 0 else 0.0
        print(
            f"  emissions  {best.emissions_g:.0f} gCO2eq at {power[0]:.0f} W ({power[1]}), "
            f"against {best.now_emissions_g:.0f} started now: {best.saved_g:.0f} g "
            f"({share:.1%}) less"
        )
    else:
        print("  emissions  give --power-w or --report for the grams")
    reach = _hours(timedelta(seconds=best.forecast_reach_s))
    if best.beyond_forecast_s > 0:
        past = _hours(timedelta(seconds=best.beyond_forecast_s))
        print(
            f"  forecast   reaches {reach}; {past} of the job lies past it, where the daily "
            "profile of the history is all there is"
        )
    else:
        print(f"  forecast   reaches {reach}; the job lies within it")
    zone = best.start.astimezone().tzname() or "local"
    print(f"  slurm      sbatch --begin={begin}" + ("" if begin == "now" else f" ({zone})"))


def _hours(duration: timedelta) -> str:
    """A duration in words: ``8 h``, ``1 h 30 min``, ``45 min``, ``30 s``."""
    seconds = duration.total_seconds()
    if seconds < 60:
        return f"{seconds:g} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    if hours and minutes:
        return f"{hours} h {minutes} min"
    return f"{hours} h" if hours else f"{minutes} min"
