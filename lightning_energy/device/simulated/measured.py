"""Measured runs the physics presets are fitted on: the Perseus artifact (SOSP'24).

Two kinds of CSV files, shipped in ``lightning_energy/data/perseus_sosp24/`` (see its
README for provenance and licence):

* ``stage_profile_locked_freq/<model>+<gpu>_bf16.csv``: per pipeline stage, the forward
  and backward time and energy of one micro-batch at each locked SM clock
  (:func:`load_locked_profile`);
* ``zeus_global_power_cap/zeus_global_<gpu>.csv``: pipeline-parallel training jobs under
  one power limit on every GPU, clocks left to the driver: iteration time and energy of
  all GPUs (:func:`load_power_cap_runs`).

Every row is checked; a bad one raises :class:`~lightning_energy.errors.ProfileError`
naming the file, the row (1 is the header) and what is allowed.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from lightning_energy.errors import ProfileError

__all__ = [
    "DATA_DIR",
    "INSTRUCTIONS",
    "UNFITTED_JOBS",
    "CapRun",
    "Curve",
    "Job",
    "LockedStage",
    "Point",
    "cap_jobs",
    "fitted_cap_jobs",
    "load_locked_profile",
    "load_power_cap_runs",
    "lock_curves",
    "measured_lock_vs_cap_pct",
    "relative_gaps",
    "relative_lock_curve",
]

#: Where the package ships the measured files.
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "perseus_sosp24"
#: The pipeline instructions a stage profile holds.
INSTRUCTIONS = ("forward", "backward")

_LOCKED_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
_CAP_COLUMNS = ("model_name", "dp", "tp", "pp", "num_microbatches", "time", "energy")


@dataclass(frozen=True)
class LockedStage:
    """One micro-batch of one pipeline stage at one locked SM clock.

    Attributes:
        stage: the pipeline stage (>= 0).
        instruction: ``"forward"`` or ``"backward"``.
        freq_mhz: the locked SM clock.
        time_s: the measured duration.
        energy_j: the measured energy of one GPU.
    """

    stage: int
    instruction: str
    freq_mhz: int
    time_s: float
    energy_j: float


@dataclass(frozen=True)
class CapRun:
    """One iteration of a pipeline-parallel job under one power limit on every GPU.

    Attributes:
        model_name: the trained model.
        gpus: the number of GPUs (``dp * tp * pp``).
        pp: the number of pipeline stages.
        num_microbatches: micro-batches per iteration.
        power_limit_w: the power limit of every GPU.
        time_s: the iteration's duration.
        energy_j: the iteration's energy, all GPUs together.
    """

    model_name: str
    gpus: int
    pp: int
    num_microbatches: int
    power_limit_w: float
    time_s: float
    energy_j: float


def _rows(path: Path, columns: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    """The rows of a CSV file with their line numbers, after checking its header."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read measured runs ({exc})") from exc
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise ProfileError(f"{path}: missing columns {missing}; required: {list(columns)}")
    rows = list(enumerate(reader, start=2))
    if not rows:
        raise ProfileError(f"{path}: no rows")
    return rows


def _number(path: Path, line: int, row: dict[str, str], key: str) -> float:
    """A finite number > 0 from ``row[key]``."""
    value = row.get(key)
    try:
        number = float(value) if value is not None else math.nan
    except ValueError:
        number = math.nan
    if not 0.0 < number < math.inf:
        raise ProfileError(f"{path}, row {line}: {key}={value!r} is not allowed; use a number > 0")
    return number


def _count(path: Path, line: int, row: dict[str, str], key: str, least: int) -> int:
    """A whole number >= ``least`` from ``row[key]``."""
    value = row.get(key)
    try:
        number = int((value or "").strip())
    except ValueError:
        number = least - 1
    if number < least:
        raise ProfileError(
            f"{path}, row {line}: {key}={value!r} is not allowed; use a whole number >= {least}"
        )
    return number


def load_locked_profile(path: str | Path) -> list[LockedStage]:
    """The rows of a locked-clock stage profile.

    Args:
        path: a ``stage_profile_locked_freq`` CSV file (columns ``stage``,
            ``instruction``, ``frequency``, ``time``, ``energy``).

    Returns:
        Its rows, in file order.

    Raises:
        ProfileError: the file is unreadable, lacks a column, has no rows, or a row has a
            negative or fractional stage, an instruction other than forward/backward, a
            clock that is not a whole number > 0, a time or energy that is not a finite
            number > 0, or repeats a (stage, instruction, clock).
    """
    path = Path(path)
    stages = []
    seen: dict[tuple[int, str, int], int] = {}
    for line, row in _rows(path, _LOCKED_COLUMNS):
        stage = _count(path, line, row, "stage", 0)
        instruction = row.get("instruction")
        if instruction not in INSTRUCTIONS:
            raise ProfileError(
                f"{path}, row {line}: instruction={instruction!r} is not allowed; "
                f"use one of {list(INSTRUCTIONS)}"
            )
        freq_mhz = _count(path, line, row, "frequency", 1)
        key = (stage, instruction, freq_mhz)
        first = seen.setdefault(key, line)
        if first != line:
            raise ProfileError(
                f"{path}, row {line}: repeats row {first} (stage, instruction, clock)"
            )
        stages.append(
            LockedStage(
                stage=stage,
                instruction=instruction,
                freq_mhz=freq_mhz,
                time_s=_number(path, line, row, "time"),
                energy_j=_number(path, line, row, "energy"),
            )
        )
    return stages


def load_power_cap_runs(path: str | Path) -> list[CapRun]:
    """The rows of a global power cap file.

    Args:
        path: a ``zeus_global_power_cap`` CSV file (columns ``model_name``, ``dp``,
            ``tp``, ``pp``, ``num_microbatches``, ``power_limit_0`` ... one per pipeline
            stage, ``time``, ``energy``).

    Returns:
        Its rows, in file order.

    Raises:
        ProfileError: the file is unreadable, lacks a column, has no rows, or a row has no
            model name, a GPU or micro-batch count that is not a whole number >= 1,
            power limits that are not one number > 0 on every stage, or a time or energy
            that is not a finite number > 0.
    """
    path = Path(path)
    runs = []
    for line, row in _rows(path, _CAP_COLUMNS):
        name = (row.get("model_name") or "").strip()
        if not name:
            raise ProfileError(f"{path}, row {line}: model_name is empty; name the trained model")
        dp, tp, pp = (_count(path, line, row, key, 1) for key in ("dp", "tp", "pp"))
        limits = {_number(path, line, row, f"power_limit_{i}") for i in range(pp)}
        if len(limits) != 1:
            raise ProfileError(
                f"{path}, row {line}: power limits {sorted(limits)} are not allowed; "
                "use one power limit on every stage"
            )
        runs.append(
            CapRun(
                model_name=name,
                gpus=dp * tp * pp,
                pp=pp,
                num_microbatches=_count(path, line, row, "num_microbatches", 1),
                power_limit_w=limits.pop(),
                time_s=_number(path, line, row, "time"),
                energy_j=_number(path, line, row, "energy"),
            )
        )
    return runs


#: ``(gpu, job)`` runs left out of the presets' fit and of the measured comparison (still
#: checked and printed by ``benchmarks/calibrate_governor.py``): the A40 T5-3B sweep gets
#: faster as the cap falls from 300 to 200 W, which no governor does.
UNFITTED_JOBS = {("A40", "t5-3b")}


#: ``(time_s, energy_j)`` of one run.
Point = tuple[float, float]


@dataclass(frozen=True)
class Curve:
    """One locked-clock curve: ``{clock: (time_s, energy_j)}``."""

    name: str
    points: dict[int, tuple[float, float]]


@dataclass(frozen=True)
class Job:
    """One capped job: ``{cap: (time_s, energy_j per GPU)}``."""

    name: str
    bubble_share: float
    points: dict[float, tuple[float, float]]


def lock_curves(suffix: str) -> list[Curve]:
    """The locked-clock curves measured on one GPU, every model's stages."""
    curves = []
    for path in sorted((DATA_DIR / "stage_profile_locked_freq").glob(f"*+{suffix}_bf16.csv")):
        points: dict[tuple[int, str], dict[int, tuple[float, float]]] = defaultdict(dict)
        for row in load_locked_profile(path):
            points[(row.stage, row.instruction)][row.freq_mhz] = (row.time_s, row.energy_j)
        model = path.name.split("+")[0]
        curves += [Curve(f"{model} {s} {i}", p) for (s, i), p in sorted(points.items())]
    return curves


def cap_jobs(suffix: str) -> list[Job]:
    """The capped jobs measured on one GPU."""
    jobs: dict[str, Job] = {}
    for run in load_power_cap_runs(
        DATA_DIR / "zeus_global_power_cap" / f"zeus_global_{suffix}.csv"
    ):
        bubble = (run.pp - 1) / (run.num_microbatches + run.pp - 1)
        job = jobs.setdefault(run.model_name, Job(run.model_name, bubble, {}))
        job.points[run.power_limit_w] = (run.time_s, run.energy_j / run.gpus)
    return list(jobs.values())


def relative_lock_curve(
    runs: dict[str, dict[int, Point]], reference_mhz: int | None = None
) -> list[tuple[float, float]]:
    """``(time, energy)`` per clock, summed over the curves, over those at the top clock
    (or at ``reference_mhz``, one of the curves' clocks)."""
    total: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for points in runs.values():
        for freq, (time_s, energy_j) in points.items():
            total[freq][0] += time_s
            total[freq][1] += energy_j
    if reference_mhz is not None and reference_mhz not in total:
        raise ValueError(
            f"reference_mhz={reference_mhz!r} is not allowed; use one of the curves' clocks "
            f"({min(total)}-{max(total)} MHz, as measured)"
        )
    top = total[max(total) if reference_mhz is None else reference_mhz]
    return [(t / top[0], e / top[1]) for t, e in total.values()]


def relative_gaps(
    lock_curve: list[tuple[float, float]], jobs: dict[str, dict[float, Point]]
) -> list[float]:
    """Per capped run below the highest cap: the cheapest lock no slower, energy vs the
    cap's, per cent (relative curves); runs faster than every lock are left out."""
    gaps = []
    for points in jobs.values():
        top_s, top_j = points[max(points)]
        for cap_w, (time_s, energy_j) in points.items():
            if cap_w == max(points):
                continue
            fits = [e for t, e in lock_curve if t <= time_s / top_s + 1e-12]
            if fits:
                gaps.append((min(fits) / (energy_j / top_j) - 1.0) * 100)
    return gaps


def fitted_cap_jobs(gpu: str) -> dict[str, dict[float, Point]]:
    """The capped jobs measured on ``gpu`` (``A100`` or ``A40``) but those left out of the
    fit: ``{job: {cap: (time_s, energy_j per GPU)}}``."""
    return {j.name: j.points for j in cap_jobs(gpu) if (gpu, j.name) not in UNFITTED_JOBS}


def measured_lock_vs_cap_pct(lock_suffix: str, gpu: str) -> list[float]:
    """The measured data's own lock-vs-cap comparison at equal speed: per capped run of
    ``gpu`` below its job's highest cap, the cheapest lock of the ``lock_suffix`` curves
    (``a100_sxm`` or ``a40``) no slower, its energy vs the cap's, per cent (negative: the
    lock uses less). The data hold no locked runs of the capped jobs, so both sides are
    relative curves (see :func:`relative_gaps`)."""
    curves = lock_curves(lock_suffix)
    lock_curve = relative_lock_curve({c.name: c.points for c in curves})
    return relative_gaps(lock_curve, fitted_cap_jobs(gpu))
