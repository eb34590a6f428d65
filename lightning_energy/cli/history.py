"""``lightning-energy history``: the runs of recurring jobs and the best choice so far.

Shows, per job (key x GPU model x GPU count), every recorded run: batch size, power limit,
epochs, energy, time, cost and whether it converged, then the current best batch size (the
lowest mean cost over its converged runs). ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import datetime, timezone
from typing import Any

from lightning_energy.cli import EXIT_FAILURE, EXIT_OK
from lightning_energy.optimize.batch_size import BestChoice, best_choice
from lightning_energy.store import (
    ENV_STORE_URL,
    JobRecord,
    Store,
    TrialRecord,
    resolve_store_url,
    sqlite_path,
)

__all__ = ["register", "run"]

_HEADERS = ("run", "finished (UTC)", "batch", "limit", "epochs", "energy", "time", "cost", "conv")


def register(subparsers: Any) -> None:
    """Add the ``history`` subcommand."""
    parser = subparsers.add_parser(
        "history",
        help="show the runs of recurring jobs (batch size, power limit, energy, cost)",
        description="Show the recorded runs of recurring training jobs and the best batch "
        "size found so far.",
    )
    parser.add_argument("--job", metavar="KEY", help="only the jobs with this key")
    parser.add_argument(
        "--store",
        metavar="URL",
        help=f"store URL (default: ${ENV_STORE_URL}, else SQLite in the user data directory)",
    )
    parser.add_argument(
        "--allow-network-fs",
        action="store_true",
        help="read a SQLite store on a network file system anyway",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the history; returns the exit code."""
    url = resolve_store_url(args.store)
    path = sqlite_path(url)
    if path is not None and not path.exists():
        if args.json:
            print(json.dumps({"store": url, "jobs": []}))
        else:
            print(f"No runs recorded yet ({path} does not exist).")
        return EXIT_OK
    with Store.open(url, allow_network_fs=args.allow_network_fs) as store:
        records = store.jobs(key=args.job)
        if args.job is not None and not records:
            known = sorted({r.job.key for r in store.jobs()})
            print(
                f"error: no job with key {args.job!r} in {store.url} "
                f"(known keys: {', '.join(known) or 'none'})",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        jobs = [(record, store.trials(record.job)) for record in records]
        store_url = store.url
    if args.json:
        print(json.dumps(_as_json(store_url, jobs), indent=2))
    else:
        print(_as_text(store_url, jobs))
    return EXIT_OK


def _as_json(url: str, jobs: list[tuple[JobRecord, list[TrialRecord]]]) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for record, trials in jobs:
        best = best_choice(trials)
        out.append(
            {
                "key": record.job.key,
                "gpu_model": record.job.gpu_model,
                "gpu_count": record.job.gpu_count,
                "settings": record.settings,
                "trials": [_trial_dict(t) for t in trials],
                "best": best.to_dict() if best is not None else None,
            }
        )
    return {"store": url, "jobs": out}


def _trial_dict(trial: TrialRecord) -> dict[str, Any]:
    """A trial as JSON data; its job is named once, at the top of the output."""
    return {k: v for k, v in dataclasses.asdict(trial).items() if k != "job"}


def _as_text(url: str, jobs: list[tuple[JobRecord, list[TrialRecord]]]) -> str:
    lines = [f"store: {url}"]
    if not jobs:
        lines.append("No runs recorded yet.")
    for record, trials in jobs:
        lines += ["", f"{record.job}{_settings_text(record.settings)}"]
        rows = [_row(i, t) for i, t in enumerate(trials, start=1)]
        if not rows:
            lines.append("  no runs yet")
            continue
        widths = [max([len(h), *(len(r[c]) for r in rows)]) for c, h in enumerate(_HEADERS)]
        for row in (_HEADERS, *rows):
            lines.append("  " + "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
        lines.append("  " + _best_text(best_choice(trials)))
    return "\n".join(lines)


def _settings_text(settings: dict[str, Any]) -> str:
    if "target_metric" not in settings or "default_batch_size" not in settings:
        return ""
    direction = "higher" if settings.get("higher_is_better", True) else "lower"
    return (
        f": default batch size {settings['default_batch_size']}, "
        f"target {settings['target_metric']} ({direction} is better)"
    )


def _row(number: int, trial: TrialRecord) -> tuple[str, ...]:
    finished = datetime.fromtimestamp(trial.finished_at, tz=timezone.utc)
    limit = f"{trial.power_limit_w:.0f} W" if trial.power_limit_w is not None else "-"
    return (
        str(number),
        finished.strftime("%Y-%m-%d %H:%M"),
        str(trial.batch_size),
        limit,
        str(trial.epochs),
        _si(trial.energy_j, "J"),
        _duration(trial.time_s),
        _si(trial.cost, "J"),
        "yes" if trial.converged else "no",
    )


def _best_text(best: BestChoice | None) -> str:
    if best is None:
        return "best: none yet (no run has reached the target)"
    limit = f" at {best.power_limit_w:.0f} W" if best.power_limit_w is not None else ""
    runs = "run" if best.runs == 1 else "runs"
    return (
        f"best: batch size {best.batch_size}{limit}: mean cost {_si(best.mean_cost, 'J')}, "
        f"energy {_si(best.mean_energy_j, 'J')}, time {_duration(best.mean_time_s)} "
        f"({best.runs} converged {runs})"
    )


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
