"""Measured partition micro-benchmarks in the Kareus format.

Kareus' overlap micro-benchmark writes one CSV row per setting of a partition run at one
clock: the overlap window (``overlap_start``, ``overlap_end``: the compute ops of the
nano-batch before which the collective of the other is issued and after which it is waited
for; ``-1,-1`` runs the collective alone first), the collective's CTAs
(``comm_sm_number``) and threads per CTA (``comm_block_size``), and for each repeat ``i``
the time of one partition ``i:time (s)`` and the energy of every GPU of the group
``i:total energy (J)`` (the per-rank columns are not needed)::

    overlap_start,overlap_end,comm_sm_number,comm_block_size,0:time (s),0:total energy (J),...
    -1,-1,1,512,0.01156,3.294,...

:func:`read_partition_csv` reads such a file (any number of repeats, at least one) and
checks it, reporting every problem at once.

Example:
    >>> import io
    >>> text = ("overlap_start,overlap_end,comm_sm_number,comm_block_size,"
    ...         "0:time (s),0:total energy (J),1:time (s),1:total energy (J)\\n"
    ...         "0,6,4,1024,0.0030,1.90,0.0032,1.92\\n")
    >>> rows = parse_partition_csv(io.StringIO(text), source="example")
    >>> rows.repeats, rows.time_s.round(6).tolist()
    (2, [0.0031])
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
from numpy.typing import NDArray

from lightning_energy.errors import ProfileError, raise_profile_problems
from lightning_energy.kareus.partition import MAX_SETTING

__all__ = ["PartitionMeasurements", "parse_partition_csv", "read_partition_csv"]

_SETTING_COLUMNS = ("overlap_start", "overlap_end", "comm_sm_number", "comm_block_size")
_REPEAT = re.compile(r"^(\d+):(time \(s\)|total energy \(J\))$")


@dataclass(frozen=True)
class PartitionMeasurements:
    """Every measured setting of one partition at one clock.

    Attributes:
        source: where the rows come from (a path).
        window_start: op before which the collective was issued (-1: alone, first).
        window_end: op after which it was waited for (-1 with ``window_start`` -1).
        ctas: CTAs of the collective.
        block_threads: threads per CTA.
        times_s: time of one partition, one column per repeat.
        energies_j: energy of all GPUs of the group for one partition, per repeat.
    """

    source: str
    window_start: NDArray[np.int64]
    window_end: NDArray[np.int64]
    ctas: NDArray[np.int64]
    block_threads: NDArray[np.int64]
    times_s: NDArray[np.float64]
    energies_j: NDArray[np.float64]

    def __len__(self) -> int:
        return len(self.ctas)

    @property
    def repeats(self) -> int:
        """Repeats per setting."""
        return int(self.times_s.shape[1])

    @property
    def time_s(self) -> NDArray[np.float64]:
        """Mean time of each setting over the repeats."""
        return np.asarray(self.times_s.mean(axis=1))

    @property
    def energy_j(self) -> NDArray[np.float64]:
        """Mean energy of each setting over the repeats."""
        return np.asarray(self.energies_j.mean(axis=1))

    def noise(self) -> tuple[float, float]:
        """Relative standard deviation of one measurement of time and of energy.

        Pooled over every setting from the spread of its repeats around their mean (with
        the ``n - 1`` correction); 0 with a single repeat.
        """
        if self.repeats < 2:
            return 0.0, 0.0
        out = []
        for values in (self.times_s, self.energies_j):
            rel = values / values.mean(axis=1, keepdims=True) - 1.0
            out.append(float(np.sqrt((rel**2).sum() / (rel.size - len(rel)))))
        return out[0], out[1]


def read_partition_csv(path: str | os.PathLike[str]) -> PartitionMeasurements:
    """Read a Kareus partition micro-benchmark CSV.

    Raises:
        ProfileError: the file cannot be read, lacks a column, or has bad values (every
            problem listed).
    """
    try:
        with Path(path).open(newline="", encoding="utf-8") as f:
            return parse_partition_csv(f, source=str(path))
    except OSError as exc:
        raise ProfileError(f"cannot read the partition measurements {path}: {exc}") from exc


def parse_partition_csv(f: TextIO, *, source: str) -> PartitionMeasurements:
    """Parse the CSV text of :func:`read_partition_csv` from an open file.

    Raises:
        ProfileError: a column is missing or values are bad (every problem listed).
    """
    reader = csv.DictReader(f)
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in _SETTING_COLUMNS if c not in header]
    repeats = sorted(
        {int(m.group(1)) for m in map(_REPEAT.match, header) if m is not None},
    )
    for i in repeats:
        for name in ("time (s)", "total energy (J)"):
            if f"{i}:{name}" not in header:
                missing.append(f"{i}:{name}")
    if not repeats:
        missing.append("0:time (s) and 0:total energy (J) (at least one repeat)")
    if missing:
        raise ProfileError(
            f"partition measurements {source}: columns {missing} missing; expected "
            f"{','.join(_SETTING_COLUMNS)} and i:time (s), i:total energy (J) per repeat i"
        )
    problems: list[str] = []
    settings: list[tuple[int, int, int, int]] = []
    times: list[list[float]] = []
    energies: list[list[float]] = []
    seen: set[tuple[int, int, int, int]] = set()
    for line, record in enumerate(reader, start=2):
        record = {(k or "").strip(): v for k, v in record.items()}
        try:
            start, end, ctas, threads = (int(str(record[c]).strip()) for c in _SETTING_COLUMNS)
            t = [float(str(record[f"{i}:time (s)"])) for i in repeats]
            e = [float(str(record[f"{i}:total energy (J)"])) for i in repeats]
        except (TypeError, ValueError):
            problems.append(f"line {line}: not numeric where expected")
            continue
        setting = (start, end, ctas, threads)
        bad = _check_row(start, end, ctas, threads, t + e)
        if bad:
            problems.append(f"line {line}: {bad}")
            continue
        if setting in seen:
            problems.append(f"line {line}: setting {setting} given twice")
            continue
        seen.add(setting)
        settings.append(setting)
        times.append(t)
        energies.append(e)
    if not settings and not problems:
        problems.append("no measurements")
    raise_profile_problems(problems, f"the partition measurements {source}")
    grid = np.asarray(settings, dtype=np.int64)
    return PartitionMeasurements(
        source=source,
        window_start=grid[:, 0],
        window_end=grid[:, 1],
        ctas=grid[:, 2],
        block_threads=grid[:, 3],
        times_s=np.asarray(times, dtype=np.float64),
        energies_j=np.asarray(energies, dtype=np.float64),
    )


def _check_row(start: int, end: int, ctas: int, threads: int, values: Iterable[float]) -> str:
    if not all(abs(v) < MAX_SETTING for v in (start, end, ctas, threads)):
        return (
            f"{', '.join(_SETTING_COLUMNS)}: an integer of size {MAX_SETTING} or more is not "
            "allowed; use smaller ones"
        )
    if (start < 0 or end < 0) and (start, end) != (-1, -1):
        return f"overlap window ({start}, {end}): use -1,-1 or two op indices >= 0"
    if end < start:
        return f"overlap window ({start}, {end}): the end comes before the start"
    if ctas < 1 or threads < 1:
        return f"comm_sm_number={ctas}, comm_block_size={threads}: both must be >= 1"
    if not all(math.isfinite(v) and v > 0 for v in values):
        return "times and energies must be finite and > 0"
    return ""
