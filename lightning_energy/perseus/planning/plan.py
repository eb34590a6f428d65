"""Frequency plans: a locked SM clock for every instruction, saved as JSON.

A :class:`Plan` assigns a clock (MHz) to every forward and backward of every microbatch on
every stage of a schedule. :func:`evaluate` computes what the plan costs on a profile, with
the objective the planner optimises:

* ``T`` = the longest path through the schedule's DAG, each instruction weighted by its
  time at its planned clock (the iteration time);
* ``E`` = the instructions' energy + the energy of every device's waits (``num_devices x
  T - sum of the instruction times`` in all): every GPU is busy for the whole iteration,
  computing or blocked. A wait draws the blocked power of the clock in force during it,
  which the profile gives per clock or as one value (see
  :class:`~lightning_energy.perseus.planning.solver.DeviceWaits`).

Plans are plain JSON data (``"format": "lightning-energy/perseus-plan"``); loading one
validates it and never executes anything.

Example:
    >>> from lightning_energy.perseus.planning.schedule import one_f_one_b
    >>> schedule = one_f_one_b(2, 2)
    >>> plan = Plan.uniform(schedule, 1410)
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_energy.errors import ProfileError
from lightning_energy.files import write_atomically
from lightning_energy.perseus.planning.profile import PipelineProfile
from lightning_energy.perseus.planning.schedule import (
    Instruction,
    PipelineSchedule,
    build_schedule,
    schedule_to_json,
)
from lightning_energy.perseus.planning.solver import DeviceWaits

__all__ = ["PLAN_FORMAT", "Plan", "PlanEvaluation", "evaluate"]

PLAN_FORMAT = "lightning-energy/perseus-plan"
_PLAN_VERSION = 1


@dataclass(frozen=True)
class PlanEvaluation:
    """What a plan costs on a profile.

    Attributes:
        iteration_time_s: the longest path through the schedule DAG.
        energy_j: compute energy + blocked energy of all devices over one iteration.
        compute_energy_j: energy of the instructions.
        blocked_energy_j: energy drawn while blocked (bubbles, send/recv waits).
    """

    iteration_time_s: float
    energy_j: float
    compute_energy_j: float
    blocked_energy_j: float


@dataclass(frozen=True)
class Plan:
    """A clock for every instruction of a schedule.

    Attributes:
        schedule: the schedule the plan is for.
        frequencies_mhz: one clock per node of ``schedule.nodes``, in that order.
        metadata: free-form numbers saved with the plan (iteration time, energy, ...).
    """

    schedule: PipelineSchedule
    frequencies_mhz: tuple[int, ...]
    metadata: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if len(self.frequencies_mhz) != len(self.schedule.nodes):
            raise ProfileError(
                f"plan: {len(self.frequencies_mhz)} clocks for "
                f"{len(self.schedule.nodes)} instructions"
            )
        if set(map(type, self.frequencies_mhz)) != {int} or min(self.frequencies_mhz) <= 0:
            bad = sorted({f for f in self.frequencies_mhz if not (isinstance(f, int) and f > 0)})
            raise ProfileError(f"plan: clocks {bad[:5]} are not positive integers (MHz)")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (
            self.schedule.name == other.schedule.name
            and self.schedule.device_orders == other.schedule.device_orders
            and self.frequencies_mhz == other.frequencies_mhz
        )

    def __hash__(self) -> int:
        return hash((self.schedule.name, self.frequencies_mhz))

    @classmethod
    def uniform(cls, schedule: PipelineSchedule, freq_mhz: int) -> Plan:
        """Every instruction at ``freq_mhz`` (e.g. the maximum clock: the baseline)."""
        return cls(schedule, (int(freq_mhz),) * len(schedule.nodes))

    def frequency_mhz(self, instruction: Instruction) -> int:
        """The clock planned for ``instruction``.

        Raises:
            ProfileError: the instruction is not part of the schedule.
        """
        try:
            return self.frequencies_mhz[self.schedule.index[instruction]]
        except KeyError:
            raise ProfileError(f"plan: {instruction} is not in the schedule") from None

    def device_plan(self, device: int) -> list[tuple[Instruction, int]]:
        """``(instruction, clock)`` pairs of one device, in execution order."""
        return [(inst, self.frequency_mhz(inst)) for inst in self.schedule.device_orders[device]]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data."""
        spec, rows = schedule_to_json(self.schedule, self.frequency_mhz)
        return {
            "format": PLAN_FORMAT,
            "version": _PLAN_VERSION,
            "schedule": spec,
            "metadata": dict(self.metadata or {}),
            "frequencies_mhz": rows,
        }

    def to_json(self) -> str:
        """The plan as a JSON document."""
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON, atomically (temporary file + rename)."""
        write_atomically(path, self.to_json())

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, schedule: PipelineSchedule | None = None
    ) -> Plan:
        """Rebuild a plan from :meth:`to_dict` data.

        Args:
            data: the plan's data.
            schedule: the schedule the plan must be for (an engine's own schedule, which
                its name alone cannot rebuild); None: rebuilt from the plan's name.

        Raises:
            ProfileError: wrong format or version, a malformed field, or a plan for
                another schedule than ``schedule``.
        """
        if not isinstance(data, Mapping) or data.get("format") != PLAN_FORMAT:
            raise ProfileError(f"not a plan: the 'format' field must be {PLAN_FORMAT!r}")
        if data.get("version") != _PLAN_VERSION:
            raise ProfileError(
                f"plan version {data.get('version')!r} is not supported (only {_PLAN_VERSION})"
            )
        try:
            spec = data["schedule"]
            name = str(spec["name"])
            counts = (int(spec["num_stages"]), int(spec["num_microbatches"]))
            virtual = int(spec.get("virtual_stages", 1))
            if schedule is None:
                schedule = build_schedule(name, *counts, virtual_stages=virtual)
            elif (name, *counts, virtual) != (
                schedule.name,
                schedule.num_stages,
                schedule.num_microbatches,
                schedule.virtual_stages,
            ):
                raise ProfileError(
                    f"the plan is for {name} with {counts[0]} stages and {counts[1]} "
                    f"microbatches, the pipeline runs {schedule.name} with "
                    f"{schedule.num_stages} and {schedule.num_microbatches}"
                )
            freqs: dict[Instruction, int] = {}
            for row in data["frequencies_mhz"]:
                stage = int(row["stage"])
                for kind, values in row.items():
                    if kind == "stage":
                        continue
                    if not isinstance(values, Sequence) or isinstance(values, str):
                        raise ProfileError(f"plan: stage {stage} {kind} is not a list")
                    for m, value in enumerate(values):
                        if not isinstance(value, int) or isinstance(value, bool):
                            raise ProfileError(
                                f"plan: stage {stage} {kind} microbatch {m}: {value!r} is not "
                                "an integer clock"
                            )
                        freqs[Instruction(stage, m, kind)] = value
            metadata = {str(k): float(v) for k, v in dict(data.get("metadata") or {}).items()}
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            # OverflowError: an infinity where an integer goes, or an integer beyond any float
            raise ProfileError(f"malformed plan: {exc!r}") from exc
        missing = [str(inst) for inst in schedule.nodes if inst not in freqs]
        extra = [str(inst) for inst in freqs if inst not in schedule.index]
        if missing or extra:
            raise ProfileError(
                f"plan does not match its schedule: missing {missing[:5]}, unknown {extra[:5]}"
            )
        return cls(schedule, tuple(freqs[inst] for inst in schedule.nodes), metadata)

    @classmethod
    def from_json(cls, text: str, *, schedule: PipelineSchedule | None = None) -> Plan:
        """Parse a JSON plan (data only; nothing is executed); ``schedule`` as in
        :meth:`from_dict`.

        Raises:
            ProfileError: not JSON, or not a valid plan.
        """
        try:
            data = json.loads(text)
        except ValueError as exc:  # not JSON, or a number too long
            raise ProfileError(f"plan is not valid JSON: {exc}") from exc
        return cls.from_dict(data, schedule=schedule)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, schedule: PipelineSchedule | None = None
    ) -> Plan:
        """Read a plan written by :meth:`save`; ``schedule`` as in :meth:`from_dict`.

        Raises:
            ProfileError: unreadable or invalid.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(f"cannot read the plan {path}: {exc}") from exc
        return cls.from_json(text, schedule=schedule)


def evaluate(plan: Plan, profile: PipelineProfile) -> PlanEvaluation:
    """Iteration time and energy of ``plan`` on ``profile`` (see the module docstring).

    Raises:
        ProfileError: the profile lacks a stage, instruction or clock the plan uses.
    """
    schedule = plan.schedule
    if profile.num_stages != schedule.num_stages:
        raise ProfileError(
            f"the profile has {profile.num_stages} stages, the schedule {schedule.num_stages}"
        )
    times = np.empty(len(schedule.nodes))
    energies = np.empty(len(schedule.nodes))
    blocked_w = np.empty(len(schedule.nodes))
    for i, (inst, freq) in enumerate(zip(schedule.nodes, plan.frequencies_mhz, strict=True)):
        times[i], energies[i] = profile.entry(inst.stage, inst.kind).at(freq)
        blocked_w[i] = profile.blocked_power_at(freq)
    finish = schedule.finish_times(times)
    iteration_s = float(finish.max())
    compute_j = float(energies.sum())
    blocked_j = float(
        DeviceWaits(schedule).blocked_energy_j(
            (finish - times)[:, None], times[:, None], blocked_w[:, None], np.array([iteration_s])
        )[0]
    )
    return PlanEvaluation(iteration_s, compute_j + blocked_j, compute_j, blocked_j)
