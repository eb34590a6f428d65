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
from dataclasses import dataclass
from pathlib import Path

from lightning_energy.errors import ProfileError

__all__ = [
    "DATA_DIR",
    "INSTRUCTIONS",
    "CapRun",
    "LockedStage",
    "load_locked_profile",
    "load_power_cap_runs",
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
