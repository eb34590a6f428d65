"""``lightning-energy carbon now|forecast``: the grid carbon intensity of a configured region.

Examples::

    lightning-energy carbon now --config job.yaml
    lightning-energy carbon now --config job.yaml --json        # {"g_per_kwh": ..., ...}
    lightning-energy carbon forecast --config job.yaml --hours 12
    lightning-energy carbon now --config job.yaml --verbose     # DEBUG logs, no token

Exit codes: 0 ok, 2 bad usage or configuration, 1 the provider failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from carbon.config import build_provider, load_carbon_config
from carbon.errors import CarbonConfigError, CarbonError
from carbon.providers.base import CarbonProvider
from carbon.types import IntensityPoint
from lightning_energy.argtypes import float_in

__all__ = ["register"]

_EXIT_OK = 0
_EXIT_FAILURE = 1
_EXIT_USAGE = 2
_MAX_FORECAST_HOURS = 8760  # a year


def register(subparsers: Any) -> None:
    """Add the ``carbon`` command and its ``now`` / ``forecast`` actions."""
    parser = subparsers.add_parser(
        "carbon",
        help="grid carbon intensity: the current value or the forecast",
        description="Ask the configured carbon-intensity provider (the 'carbon:' section "
        "of a YAML file) for the current value or the forecast.",
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
        action.add_argument("--json", action="store_true", help="print JSON for scripts")
        action.add_argument(
            "--verbose",
            dest="carbon_verbose",
            action="store_true",
            help="log at DEBUG level, HTTP included (tokens are never shown)",
        )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Run ``carbon now`` or ``carbon forecast``; returns the exit code."""
    if getattr(args, "carbon_verbose", False):
        logging.getLogger().setLevel(logging.DEBUG)
    try:
        config = load_carbon_config(args.config)
        provider = build_provider(config)
    except CarbonConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    try:
        if args.carbon_action == "now":
            _print_now(provider, provider.latest(), args.json)
        else:
            _print_forecast(provider, provider.forecast(args.hours * 3600.0), args.json)
    except CarbonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _EXIT_FAILURE
    finally:
        close = getattr(provider, "close", None)
        if callable(close):
            close()
    return _EXIT_OK


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


def _print_now(provider: CarbonProvider, point: IntensityPoint, as_json: bool) -> None:
    if as_json:
        body = {"provider": provider.name, "region": provider.region, **_point_dict(point)}
        body["replayed"] = provider.name == "trace"
        print(json.dumps(body))
        return
    value = f"{point.intensity_g_per_kwh:.1f} gCO2eq/kWh"
    if provider.name == "constant":
        print(f"constant: {value} (a fixed value from the configuration, not grid data)")
        return
    if provider.name == "trace":
        print(
            f"trace {provider.region}: {value} (replayed from a recorded trace, not measured "
            f"now: the trace's value for the interval from {point.time:%m-%d %H:%M} UTC, its "
            f"year wrapped onto {point.time:%Y}; source {point.source})"
        )
        return
    print(
        f"{provider.name} {provider.region}: {value} "
        f"({point.kind.value}, interval from {point.time:%Y-%m-%d %H:%M} UTC, "
        f"source {point.source})"
    )


def _print_forecast(provider: CarbonProvider, points: list[IntensityPoint], as_json: bool) -> None:
    if as_json:
        body = {
            "provider": provider.name,
            "region": provider.region,
            "points": [_point_dict(p) for p in points],
        }
        print(json.dumps(body))
        return
    print(f"{provider.name} {provider.region}: {len(points)} points")
    print(f"{'time (UTC)':<17}  {'gCO2eq/kWh':>10}  kind")
    for p in points:
        print(f"{p.time:%Y-%m-%d %H:%M}  {p.intensity_g_per_kwh:>10.1f}  {_kind(provider, p)}")
