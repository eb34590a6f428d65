"""Per-stage, per-instruction, per-frequency time and energy of a pipeline.

A :class:`PipelineProfile` holds, for every pipeline stage and every instruction kind
(``forward``, ``backward``; other kinds are allowed), the time (s) and energy (J) of one
microbatch at each locked SM clock (MHz), plus the power a GPU draws while it is blocked
(pipeline bubbles, waiting on a send/recv): one value, or one per clock. A GPU blocked in
NCCL is not idle: its kernels spin at the locked clock, so the blocked power rises with
the clock; an online profile measures it at each clock. It is the planner's only input
besides the schedule.

On disk a profile is the CSV layout of Zeus' Perseus tooling::

    stage,instruction,frequency,time,energy
    0,forward,1410,0.0517,18.24
    ...

The blocked power is not part of the CSV; it is given when loading (a number, or a
mapping from each clock to its blocked power).

Example:
    >>> profile = PipelineProfile.from_rows(
    ...     [(0, "forward", 1410, 0.05, 18.0), (0, "forward", 1200, 0.06, 17.0),
    ...      (0, "backward", 1410, 0.10, 36.0), (0, "backward", 1200, 0.12, 34.0)],
    ...     blocked_power_w=70.0,
    ... )
    >>> profile.num_stages, profile.frequencies_mhz
    (1, (1410, 1200))
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lightning_energy.errors import ProfileError, raise_profile_problems
from lightning_energy.numbers import is_finite

__all__ = [
    "BACKWARD",
    "CSV_COLUMNS",
    "FORWARD",
    "BlockedPower",
    "InstructionProfile",
    "PipelineProfile",
    "ProfileRow",
]

FORWARD = "forward"
BACKWARD = "backward"

#: Column order of the profile CSV.
CSV_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")

#: One measurement: ``(stage, instruction, frequency_mhz, time_s, energy_j)``.
ProfileRow = tuple[int, str, int, float, float]

#: Power while blocked, in W: one value for every clock, or ``{frequency_mhz: power_w}``.
BlockedPower = float | Mapping[int, float]


def _raise_problems(problems: list[str], source: str) -> None:
    raise_profile_problems(problems, f"the pipeline profile {source}")


@dataclass(frozen=True)
class InstructionProfile:
    """Time and energy of one instruction kind on one stage, per frequency.

    Attributes:
        stage: the pipeline stage (the virtual stage for interleaved schedules).
        instruction: the instruction kind (``"forward"``, ``"backward"``, ...).
        frequencies_mhz: locked SM clocks, descending.
        times_s: time of one microbatch at each clock.
        energies_j: energy of one microbatch at each clock.
    """

    stage: int
    instruction: str
    frequencies_mhz: tuple[int, ...]
    times_s: tuple[float, ...]
    energies_j: tuple[float, ...]

    def at(self, freq_mhz: int) -> tuple[float, float]:
        """``(time_s, energy_j)`` at ``freq_mhz``.

        Raises:
            ProfileError: the frequency was not profiled.
        """
        try:
            i = self.frequencies_mhz.index(int(freq_mhz))
        except ValueError:
            raise ProfileError(
                f"stage {self.stage} {self.instruction}: frequency {freq_mhz} MHz is not in "
                f"the profile ({self.frequencies_mhz[-1]}-{self.frequencies_mhz[0]} MHz)"
            ) from None
        return self.times_s[i], self.energies_j[i]


class PipelineProfile:
    """Validated time/energy measurements of every stage and instruction of a pipeline.

    Build it with :meth:`from_rows` or :meth:`from_csv`; both report every problem at once.

    Args:
        entries: one :class:`InstructionProfile` per ``(stage, instruction)``.
        blocked_power_w: power drawn while a GPU waits (bubble, blocked send/recv), in W:
            one value, or one per profiled clock (``{frequency_mhz: power_w}``; clocks
            that are not profiled are dropped).
        source: where the measurements come from, for error messages.

    Attributes:
        blocked_power_w: the blocked power as given: a number, or a mapping over the
            profiled clocks.

    Raises:
        ProfileError: stages missing, frequency sets that differ between entries,
            non-positive or non-finite values, or a bad blocked power (negative, not
            finite, or missing for a profiled clock).
    """

    def __init__(
        self,
        entries: Iterable[InstructionProfile],
        *,
        blocked_power_w: BlockedPower,
        source: str = "(in memory)",
    ) -> None:
        entries = list(entries)
        _raise_problems(_validate(entries, blocked_power_w), source)
        self._entries = {(e.stage, e.instruction): e for e in entries}
        self._num_stages = 1 + max(stage for stage, _ in self._entries)
        self._instructions = tuple(sorted({kind for _, kind in self._entries}, key=_kind_order))
        self._frequencies = entries[0].frequencies_mhz
        self.blocked_power_w: BlockedPower = (
            {f: float(blocked_power_w[f]) for f in self._frequencies}
            if isinstance(blocked_power_w, Mapping)
            else float(blocked_power_w)
        )

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_rows(
        cls, rows: Iterable[ProfileRow], *, blocked_power_w: BlockedPower, source: str = "(rows)"
    ) -> PipelineProfile:
        """Build a profile from ``(stage, instruction, frequency_mhz, time_s, energy_j)`` rows.

        Args:
            rows: the measurements, in any order.
            blocked_power_w: power drawn while blocked, in W (one value, or per clock).
            source: where the rows come from, for error messages.

        Raises:
            ProfileError: every problem found (duplicates, missing stages or frequencies,
                non-positive values...), listed in one message.
        """
        grouped: dict[tuple[int, str], dict[int, tuple[float, float]]] = {}
        problems: list[str] = []
        for stage, kind, freq, time_s, energy_j in rows:
            key = (int(stage), str(kind))
            table = grouped.setdefault(key, {})
            if int(freq) in table:
                problems.append(f"stage {stage} {kind} at {freq} MHz: duplicate row")
                continue
            table[int(freq)] = (_float(time_s), _float(energy_j))
        entries = []
        for (stage, kind), table in grouped.items():
            freqs = sorted(table, reverse=True)
            entries.append(
                InstructionProfile(
                    stage=stage,
                    instruction=kind,
                    frequencies_mhz=tuple(freqs),
                    times_s=tuple(table[f][0] for f in freqs),
                    energies_j=tuple(table[f][1] for f in freqs),
                )
            )
        _raise_problems(problems + _validate(entries, blocked_power_w), source)
        return cls(entries, blocked_power_w=blocked_power_w, source=source)

    @classmethod
    def from_csv(
        cls, path: str | os.PathLike[str], *, blocked_power_w: BlockedPower
    ) -> PipelineProfile:
        """Load a ``stage,instruction,frequency,time,energy`` CSV.

        Args:
            path: the CSV file.
            blocked_power_w: power drawn while blocked, in W (not part of the CSV; one
                value, or per clock).

        Raises:
            ProfileError: the file cannot be read, lacks a column, has non-numeric values,
                or fails validation (every problem listed).
        """
        path = Path(path)
        rows: list[ProfileRow] = []
        problems: list[str] = []
        try:
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                header = reader.fieldnames or []
                missing = [c for c in CSV_COLUMNS if c not in header]
                if missing:
                    raise ProfileError(
                        f"pipeline profile {path}: columns {missing} missing; expected "
                        f"{','.join(CSV_COLUMNS)}"
                    )
                for line, record in enumerate(reader, start=2):
                    try:
                        rows.append(
                            (
                                int(record["stage"]),
                                record["instruction"].strip(),
                                int(float(record["frequency"])),
                                float(record["time"]),
                                float(record["energy"]),
                            )
                        )
                    except (TypeError, ValueError, AttributeError, OverflowError):
                        # OverflowError: a frequency of 1e400 (or more digits) is no integer
                        problems.append(f"line {line}: not numeric where expected: {record}")
        except OSError as exc:
            raise ProfileError(f"cannot read the pipeline profile {path}: {exc}") from exc
        _raise_problems(problems, str(path))
        return cls.from_rows(rows, blocked_power_w=blocked_power_w, source=str(path))

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the measurements as a CSV (the blocked power is not part of the file)."""
        tmp = Path(f"{path}.tmp")
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(CSV_COLUMNS)
            for row in self.rows():
                writer.writerow(row)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ access
    @property
    def num_stages(self) -> int:
        """Number of stages profiled (stages are ``0..num_stages - 1``)."""
        return self._num_stages

    @property
    def instructions(self) -> tuple[str, ...]:
        """Instruction kinds profiled (forward and backward first)."""
        return self._instructions

    @property
    def frequencies_mhz(self) -> tuple[int, ...]:
        """Profiled clocks, descending (the same for every entry)."""
        return self._frequencies

    def blocked_power_at(self, freq_mhz: int) -> float:
        """Power drawn while blocked at ``freq_mhz`` (a profiled clock).

        Raises:
            ProfileError: the clock is not profiled.
        """
        if int(freq_mhz) not in self._frequencies:
            raise ProfileError(
                f"blocked power at {freq_mhz} MHz: not a profiled clock "
                f"({self._frequencies[-1]}-{self._frequencies[0]} MHz)"
            )
        if isinstance(self.blocked_power_w, Mapping):
            return self.blocked_power_w[int(freq_mhz)]
        return self.blocked_power_w

    @property
    def min_blocked_power_w(self) -> float:
        """The lowest blocked power over the profiled clocks (the power every wait draws
        at least, whatever its clock)."""
        return min(self.blocked_power_at(f) for f in self._frequencies)

    def entry(self, stage: int, instruction: str) -> InstructionProfile:
        """The measurements of ``instruction`` on ``stage``.

        Raises:
            ProfileError: not profiled.
        """
        try:
            return self._entries[(stage, instruction)]
        except KeyError:
            raise ProfileError(
                f"stage {stage} {instruction}: not in the profile (stages 0.."
                f"{self._num_stages - 1}, instructions {list(self._instructions)})"
            ) from None

    def entries(self) -> Mapping[tuple[int, str], InstructionProfile]:
        """Every entry by ``(stage, instruction)``."""
        return dict(self._entries)

    def rows(self) -> list[ProfileRow]:
        """All measurements as rows, by stage, instruction and descending frequency."""
        out: list[ProfileRow] = []
        for stage in range(self._num_stages):
            for kind in self._instructions:
                entry = self._entries[(stage, kind)]
                out.extend(
                    (stage, kind, f, t, e)
                    for f, t, e in zip(
                        entry.frequencies_mhz, entry.times_s, entry.energies_j, strict=True
                    )
                )
        return out

    def restricted(self, frequencies_mhz: Iterable[int]) -> PipelineProfile:
        """A copy keeping only the given clocks (e.g. what a GPU supports).

        Raises:
            ProfileError: none of the clocks is profiled.
        """
        keep = set(frequencies_mhz)
        rows = [row for row in self.rows() if row[2] in keep]
        if not rows:
            raise ProfileError(
                f"none of the clocks {sorted(keep, reverse=True)} MHz is in the profile"
            )
        return PipelineProfile.from_rows(rows, blocked_power_w=self.blocked_power_w)

    def __repr__(self) -> str:
        return (
            f"PipelineProfile(stages={self._num_stages}, instructions={self._instructions}, "
            f"frequencies={len(self._frequencies)}, blocked_power_w={self.blocked_power_w})"
        )


def _float(value: float) -> float:
    """``value`` as a float, or as it is when no float holds it (an integer of 400 digits):
    the validation then names it."""
    try:
        return float(value)
    except OverflowError:
        return value


def _kind_order(kind: str) -> tuple[int, str]:
    order = {FORWARD: 0, BACKWARD: 1}
    return (order.get(kind, 2), kind)


def _validate(entries: list[InstructionProfile], blocked_power_w: BlockedPower) -> list[str]:
    """Every problem of a set of entries: duplicates, gaps, missing clocks, bad values."""
    problems: list[str] = []
    blocked = blocked_power_w if isinstance(blocked_power_w, Mapping) else {None: blocked_power_w}
    for freq, power_w in blocked.items():
        where = "blocked_power_w" if freq is None else f"blocked_power_w at {freq} MHz"
        try:
            value = float(power_w)
        except (TypeError, ValueError, OverflowError):
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{where}: {power_w!r} is not allowed; use a finite power >= 0 W")
    if not entries:
        return [*problems, "no measurements"]
    if isinstance(blocked_power_w, Mapping):
        profiled = {f for entry in entries for f in entry.frequencies_mhz}
        missing = sorted(profiled - set(blocked_power_w), reverse=True)
        if missing:
            problems.append(
                f"blocked_power_w: no value at {missing} MHz; give one per profiled clock "
                "(or a single number)"
            )
    by_key: dict[tuple[int, str], InstructionProfile] = {}
    for entry in entries:
        key = (entry.stage, entry.instruction)
        if key in by_key:
            problems.append(f"stage {entry.stage} {entry.instruction}: given twice")
        by_key[key] = entry
    for (stage, kind), entry in sorted(by_key.items()):
        where = f"stage {stage} {kind}"
        n = len(entry.frequencies_mhz)
        if not (len(entry.times_s) == len(entry.energies_j) == n) or n == 0:
            problems.append(f"{where}: frequencies, times and energies differ in length")
            continue
        if list(entry.frequencies_mhz) != sorted(set(entry.frequencies_mhz), reverse=True):
            problems.append(f"{where}: frequencies must be distinct and descending")
        for f, t, e in zip(entry.frequencies_mhz, entry.times_s, entry.energies_j, strict=True):
            bad = [
                f"{name}={value!r}"
                for name, value in (("frequency", f), ("time", t), ("energy", e))
                if not (is_finite(value) and value > 0)
            ]
            if bad:
                problems.append(f"{where} at {f} MHz: {', '.join(bad)}: must be > 0")
    stages = sorted({stage for stage, _ in by_key})
    if stages[0] < 0:
        problems.append(f"stages {stages}: stage indices must be >= 0")
    missing_stages = sorted(set(range(stages[-1] + 1)) - set(stages))
    if missing_stages:
        problems.append(
            f"stages {missing_stages} missing: stages must be 0..{stages[-1]} without gaps"
        )
    kinds = sorted({kind for _, kind in by_key}, key=_kind_order)
    for stage in stages:
        for kind in kinds:
            if (stage, kind) not in by_key:
                problems.append(f"stage {stage} {kind}: missing (other stages have it)")
    all_freqs: set[int] = set()
    for entry in by_key.values():
        all_freqs.update(entry.frequencies_mhz)
    for (stage, kind), entry in sorted(by_key.items()):
        missing = sorted(all_freqs - set(entry.frequencies_mhz), reverse=True)
        if missing:
            problems.append(
                f"stage {stage} {kind}: frequencies {missing} MHz missing (profiled for "
                "other instructions)"
            )
    return problems
