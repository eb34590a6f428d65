"""Composition: partition Pareto points into instruction options, then the Perseus planner.

An instruction (the forward or backward of one micro-batch on one pipeline stage) runs,
per layer of its stage and per nano-batch, one partition of each of its keys
(:data:`KIND_KEYS`), all at the instruction's clock, with one setting per key for every
layer; plus the work outside the layers (embedding, output layer, loss: the
*non-partition* costs, a Perseus profile of their own). So, per clock ``f``,

    time = layers x nanobatches x sum over keys of t_key(f, setting_key) + t_rest(f),

and the same for energy. :func:`instruction_options` forms every such combination of the
keys' Pareto-optimal points at each clock shared by all of them, and keeps, per stage and
kind, the options no other option beats in both time and effective cost (energy minus the
blocked power times the time: the planner's objective, see
:mod:`lightning_energy.perseus.planning.solver`).

:class:`KareusPlanner` hands the options to :class:`~lightning_energy.perseus.planning.planner.
PerseusPlanner`, which only needs, per instruction, a labelled list of (time, energy)
options: each option is labelled by a positive integer where Perseus has a clock, so the
planner's frontier and plans come back as labels, turned into :class:`KareusPlan` (clock
and partition settings of every instruction). A stage with fewer options than another
repeats its last one (the planner drops the duplicates).

Example::

    options = instruction_options(
        {key: result.front for key, result in results.items()},
        non_partition_profile, layers_per_stage=[15, 13],
    )
    planner = KareusPlanner(options, one_f_one_b(2, 8), blocked_power_w=8 * 80.0)
    point = planner.plan_no_slowdown()
    point.plan.save("kareus_plan.json")
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.files import write_atomically
from lightning_energy.kareus.partition import PARTITION_KEYS, PartitionSetting
from lightning_energy.kareus.search import MeasuredPoint, pareto_front, read_measurements
from lightning_energy.perseus.planning.plan import Plan, PlanEvaluation, evaluate
from lightning_energy.perseus.planning.planner import Frontier, FrontierPoint, PerseusPlanner
from lightning_energy.perseus.planning.profile import (
    BACKWARD,
    FORWARD,
    InstructionProfile,
    PipelineProfile,
    ProfileRow,
)
from lightning_energy.perseus.planning.schedule import (
    Instruction,
    PipelineSchedule,
    build_schedule,
    schedule_to_json,
)

__all__ = [
    "KAREUS_PLAN_FORMAT",
    "KIND_KEYS",
    "InstructionOption",
    "KareusPlan",
    "KareusPlanner",
    "KareusPoint",
    "instruction_options",
    "planner_from_files",
    "reprice",
]

KAREUS_PLAN_FORMAT = "lightning-energy/kareus-plan"
_PLAN_VERSION = 1

#: The partition keys each instruction kind runs, per layer and nano-batch.
KIND_KEYS: dict[str, tuple[str, ...]] = {
    FORWARD: ("fwd_attn", "fwd_mlp"),
    BACKWARD: ("bwd_attn", "bwd_mlp"),
}


@dataclass(frozen=True)
class InstructionOption:
    """One way to run an instruction: its clock and the setting of each of its partitions.

    Attributes:
        clock_mhz: the instruction's clock.
        partitions: ``(key, setting)`` for each partition key of the instruction's kind.
        time_s: the instruction's time.
        energy_j: its energy (all GPUs of the stage's tensor-parallel group).
    """

    clock_mhz: int
    partitions: tuple[tuple[str, PartitionSetting], ...]
    time_s: float
    energy_j: float

    def to_dict(self) -> dict[str, Any]:
        """The option's settings as JSON-ready data (clock, then each key's CTAs and slot)."""
        out: dict[str, Any] = {"clock_mhz": self.clock_mhz}
        for key, setting in self.partitions:
            out[key] = {
                "ctas": setting.ctas,
                "slot": setting.slot,
                "block_threads": setting.block_threads,
            }
        return out


def instruction_options(
    points: Mapping[str, Sequence[MeasuredPoint]],
    non_partition: PipelineProfile,
    layers_per_stage: Sequence[int],
    *,
    nanobatches: int = 2,
) -> dict[tuple[int, str], list[InstructionOption]]:
    """Every Pareto-optimal option of every instruction, fastest first.

    Args:
        points: measured points of each partition key (all of :data:`PARTITION_KEYS`;
            more than the Pareto set is fine).
        non_partition: per stage, kind and clock, one micro-batch's work outside the
            layers; its blocked power is the planner's.
        layers_per_stage: transformer layers on each pipeline stage.
        nanobatches: partitions per layer and key (2: Kareus; 1: the whole micro-batch).

    Returns:
        Options by ``(stage, kind)``.

    Raises:
        ProfileError: a key without points, no clock shared by the keys of a kind and the
            non-partition profile, or stages that differ in number.
        ConfigError: a layer count below 1 or ``nanobatches`` below 1.
    """
    problems = []
    if not layers_per_stage or min(layers_per_stage) < 1:
        problems.append(
            f"layers_per_stage: {list(layers_per_stage)} is not allowed; use integers >= 1"
        )
    if nanobatches < 1:
        problems.append(f"nanobatches: {nanobatches!r} is not allowed; use >= 1")
    if problems:
        raise ConfigError(problems, source="kareus composition")
    missing = [key for key in PARTITION_KEYS if not points.get(key)]
    if missing:
        raise ProfileError(f"no measured points for partitions {missing}")
    if non_partition.num_stages != len(layers_per_stage):
        raise ProfileError(
            f"the non-partition profile has {non_partition.num_stages} stages, "
            f"layers_per_stage {len(layers_per_stage)}"
        )
    # Effective energy subtracts the static power: the least a blocked GPU draws.
    blocked = non_partition.min_blocked_power_w
    out: dict[tuple[int, str], list[InstructionOption]] = {}
    for kind, keys in KIND_KEYS.items():
        clocks = set(non_partition.frequencies_mhz)
        for key in keys:
            clocks &= {p.setting.clock_mhz for p in points[key]}
        if not clocks:
            raise ProfileError(
                f"{kind}: no clock is measured for all of {list(keys)} and in the "
                f"non-partition profile ({list(non_partition.frequencies_mhz)} MHz)"
            )
        combos: list[tuple[MeasuredPoint, ...]] = []
        for clock in sorted(clocks, reverse=True):
            fronts = [
                pareto_front((p for p in points[key] if p.setting.clock_mhz == clock), blocked)
                for key in keys
            ]
            combos.extend(itertools.product(*fronts))
        for stage, layers in enumerate(layers_per_stage):
            rest = non_partition.entry(stage, kind)
            candidates = [_option(keys, combo, rest, layers * nanobatches) for combo in combos]
            out[(stage, kind)] = _pareto_options(candidates, blocked)
    return out


def reprice(
    options: Mapping[tuple[int, str], Sequence[InstructionOption]],
    points: Mapping[str, Mapping[PartitionSetting, MeasuredPoint]],
    non_partition: PipelineProfile,
    layers_per_stage: Sequence[int],
    *,
    nanobatches: int = 2,
) -> dict[tuple[int, str], list[InstructionOption]]:
    """The same options, in the same order, with time and energy from other points of the
    same settings (e.g. the noise-free values of what was measured with noise).

    Raises:
        KeyError: a setting of an option is missing from ``points``.
    """
    out = {}
    for (stage, kind), opts in options.items():
        rest = non_partition.entry(stage, kind)
        scale = layers_per_stage[stage] * nanobatches
        out[(stage, kind)] = [
            _option(
                KIND_KEYS[kind],
                [points[key][setting] for key, setting in option.partitions],
                rest,
                scale,
            )
            for option in opts
        ]
    return out


def _option(
    keys: Sequence[str], combo: Sequence[MeasuredPoint], rest: InstructionProfile, scale: int
) -> InstructionOption:
    """An instruction running ``scale`` times (layers x nano-batches) each point of
    ``combo`` (one per key, one clock) plus the work outside the layers at that clock."""
    clock = combo[0].setting.clock_mhz
    rest_t, rest_e = rest.at(clock)
    return InstructionOption(
        clock,
        tuple((key, p.setting) for key, p in zip(keys, combo, strict=True)),
        scale * sum(p.time_s for p in combo) + rest_t,
        scale * sum(p.energy_j for p in combo) + rest_e,
    )


def _pareto_options(
    candidates: Sequence[InstructionOption], blocked_power_w: float
) -> list[InstructionOption]:
    ordered = sorted(candidates, key=lambda o: (o.time_s, o.energy_j - blocked_power_w * o.time_s))
    kept: list[InstructionOption] = []
    best = np.inf
    for option in ordered:
        cost = option.energy_j - blocked_power_w * option.time_s
        if cost < best:
            kept.append(option)
            best = cost
    return kept


# --------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class KareusPlan:
    """The clock and partition settings of every instruction of a schedule.

    Attributes:
        schedule: the schedule the plan is for.
        choices: one option per node of ``schedule.nodes``, in that order.
        metadata: numbers saved with the plan (iteration time, energy, ...).
        layers_per_stage: transformer layers of each stage the plan was composed for
            (None: not recorded).
        tp_size: the tensor-parallel size the partitions were measured at (None: not
            recorded).
    """

    schedule: PipelineSchedule
    choices: tuple[InstructionOption, ...]
    metadata: Mapping[str, float] = field(default_factory=dict)
    layers_per_stage: tuple[int, ...] | None = None
    tp_size: int | None = None

    def __post_init__(self) -> None:
        if len(self.choices) != len(self.schedule.nodes):
            raise ProfileError(
                f"kareus plan: {len(self.choices)} choices for {len(self.schedule.nodes)} "
                "instructions"
            )
        if self.layers_per_stage is not None and (
            len(self.layers_per_stage) != self.schedule.num_stages
        ):
            raise ProfileError(
                f"kareus plan: layers of {len(self.layers_per_stage)} stages for a schedule "
                f"of {self.schedule.num_stages}"
            )

    def choice(self, instruction: Instruction) -> InstructionOption:
        """The option planned for ``instruction``.

        Raises:
            ProfileError: the instruction is not part of the schedule.
        """
        try:
            return self.choices[self.schedule.index[instruction]]
        except KeyError:
            raise ProfileError(f"kareus plan: {instruction} is not in the schedule") from None

    def clock_plan(self) -> Plan:
        """The clocks alone, as a Perseus plan (what the Perseus runtime applies)."""
        return Plan(self.schedule, tuple(c.clock_mhz for c in self.choices), dict(self.metadata))

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data."""
        spec, rows = schedule_to_json(self.schedule, lambda inst: self.choice(inst).to_dict())
        return {
            "format": KAREUS_PLAN_FORMAT,
            "version": _PLAN_VERSION,
            "schedule": spec,
            "metadata": dict(self.metadata),
            "model": {
                "layers_per_stage": (
                    None if self.layers_per_stage is None else list(self.layers_per_stage)
                ),
                "tp_size": self.tp_size,
            },
            "stages": rows,
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON, atomically (temporary file + rename)."""
        write_atomically(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KareusPlan:
        """Rebuild a plan from :meth:`to_dict` data (times and energies are not saved: they
        come back as 0).

        Raises:
            ProfileError: wrong format or version, or a malformed field.
        """
        if not isinstance(data, Mapping) or data.get("format") != KAREUS_PLAN_FORMAT:
            raise ProfileError(
                f"not a kareus plan: the 'format' field must be {KAREUS_PLAN_FORMAT!r}"
            )
        if data.get("version") != _PLAN_VERSION:
            raise ProfileError(f"kareus plan version {data.get('version')!r} is not supported")
        try:
            spec = data["schedule"]
            schedule = build_schedule(
                str(spec["name"]),
                int(spec["num_stages"]),
                int(spec["num_microbatches"]),
                virtual_stages=int(spec.get("virtual_stages", 1)),
            )
            chosen: dict[Instruction, InstructionOption] = {}
            for row in data["stages"]:
                stage = int(row["stage"])
                for kind, keys in KIND_KEYS.items():
                    for m, item in enumerate(row[kind]):
                        parts = tuple(
                            (
                                key,
                                PartitionSetting(
                                    int(item["clock_mhz"]),
                                    int(item[key]["ctas"]),
                                    int(item[key]["slot"]),
                                    int(item[key]["block_threads"]),
                                ),
                            )
                            for key in keys
                        )
                        chosen[Instruction(stage, m, kind)] = InstructionOption(
                            int(item["clock_mhz"]), parts, 0.0, 0.0
                        )
            metadata = {str(k): float(v) for k, v in dict(data.get("metadata") or {}).items()}
            choices = tuple(chosen[inst] for inst in schedule.nodes)
            model = dict(data.get("model") or {})
            layers = model.get("layers_per_stage")
            tp_size = model.get("tp_size")
            layers_per_stage = None if layers is None else tuple(int(n) for n in layers)
            tp = None if tp_size is None else int(tp_size)
        except ProfileError:
            raise
        except (ConfigError, KeyError, TypeError, ValueError, OverflowError) as exc:
            # OverflowError: an infinity where an integer goes, or an integer beyond any float
            raise ProfileError(f"malformed kareus plan: {exc!r}") from exc
        return cls(schedule, choices, metadata, layers_per_stage, tp)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KareusPlan:
        """Read a plan written by :meth:`save`.

        Raises:
            ProfileError: unreadable or invalid.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: not JSON, or a number too long
            raise ProfileError(f"cannot read the kareus plan {path}: {exc}") from exc
        return cls.from_dict(data)


@dataclass(frozen=True)
class KareusPoint:
    """A Kareus plan with its iteration time and energy (see
    :class:`~lightning_energy.perseus.planning.planner.FrontierPoint`); ``labels`` is the same plan
    as the planner sees it (an option label per instruction)."""

    iteration_time_s: float
    energy_j: float
    plan: KareusPlan
    labels: Plan
    lower_bound_j: float | None = None


class KareusPlanner:
    """Plans clock and partition settings of every instruction with the Perseus planner.

    Args:
        options: per ``(stage, kind)``, the instruction's options (see
            :func:`instruction_options`).
        schedule: the pipeline schedule.
        blocked_power_w: power of a stage's group while blocked (bubbles, send/recv).
        layers_per_stage: the layers of each stage the options were composed for,
            recorded in every plan (the runtime refuses a plan for another model).
        tp_size: the tensor-parallel size the partitions were measured at, recorded too.
        **planner_kwargs: passed to :class:`~lightning_energy.perseus.planning.planner.
            PerseusPlanner` (``variants``, ``rounds``, ``seed``...).

    Raises:
        ProfileError: an instruction of the schedule without options.
    """

    def __init__(
        self,
        options: Mapping[tuple[int, str], Sequence[InstructionOption]],
        schedule: PipelineSchedule,
        *,
        blocked_power_w: float,
        layers_per_stage: Sequence[int] | None = None,
        tp_size: int | None = None,
        **planner_kwargs: Any,
    ) -> None:
        self.layers_per_stage = None if layers_per_stage is None else tuple(layers_per_stage)
        self.tp_size = tp_size
        needed = {(inst.stage, inst.kind) for inst in schedule.nodes}
        missing = sorted(k for k in needed if not options.get(k))
        if missing:
            raise ProfileError(f"no options for instructions {missing}")
        self.options = {k: sorted(options[k], key=lambda o: o.time_s) for k in needed}
        self.profile = self._labelled(self.options, blocked_power_w)
        self.schedule = schedule
        self.perseus = PerseusPlanner(self.profile, schedule, **planner_kwargs)

    @staticmethod
    def _labelled(
        options: Mapping[tuple[int, str], Sequence[InstructionOption]], blocked_power_w: float
    ) -> PipelineProfile:
        """The options as a Perseus profile, option ``i`` (fastest first) labelled ``i + 1``;
        shorter lists repeat their last option up to the longest."""
        width = max(len(v) for v in options.values())
        rows: list[ProfileRow] = []
        for (stage, kind), opts in options.items():
            for label in range(1, width + 1):
                option = opts[min(label, len(opts)) - 1]
                rows.append((stage, kind, label, option.time_s, option.energy_j))
        return PipelineProfile.from_rows(
            rows, blocked_power_w=blocked_power_w, source="kareus instruction options"
        )

    def evaluate(
        self,
        point: KareusPoint,
        options: Mapping[tuple[int, str], Sequence[InstructionOption]],
    ) -> PlanEvaluation:
        """What ``point``'s plan costs when its options cost as in ``options`` (the
        planner's options, same order, other times and energies: see :func:`reprice`)."""
        ordered = {k: options[k] for k in self.options}
        return evaluate(point.labels, self._labelled(ordered, self.profile.min_blocked_power_w))

    def kareus_plan(self, plan: Plan) -> KareusPlan:
        """The Kareus plan behind a plan of option labels."""
        choices = []
        for inst, label in zip(self.schedule.nodes, plan.frequencies_mhz, strict=True):
            opts = self.options[(inst.stage, inst.kind)]
            choices.append(opts[min(label, len(opts)) - 1])
        return KareusPlan(
            self.schedule,
            tuple(choices),
            dict(plan.metadata or {}),
            self.layers_per_stage,
            self.tp_size,
        )

    def point(self, point: FrontierPoint) -> KareusPoint:
        """A Perseus frontier point of labels as a Kareus point."""
        return KareusPoint(
            point.iteration_time_s,
            point.energy_j,
            self.kareus_plan(point.plan),
            point.plan,
            point.lower_bound_j,
        )

    def frontier(self, **kwargs: Any) -> list[KareusPoint]:
        """The iteration time-energy frontier, fastest first (arguments as
        :meth:`~lightning_energy.perseus.planning.planner.PerseusPlanner.frontier`)."""
        frontier: Frontier = self.perseus.frontier(**kwargs)
        return [self.point(p) for p in frontier]

    def plan_no_slowdown(self) -> KareusPoint:
        """The least-energy plan found at the fastest iteration time."""
        return self.point(self.perseus.plan_no_slowdown())

    def plan_for_time(self, target_s: float) -> KareusPoint:
        """The least-energy plan found within ``target_s``."""
        return self.point(self.perseus.plan_for_time(target_s))

    def plan_energy_optimal(self) -> KareusPoint:
        """The least-energy plan found at any iteration time."""
        return self.point(self.perseus.plan_energy_optimal())


def planner_from_files(
    measurements_dir: str | os.PathLike[str],
    non_partition_profile: str | os.PathLike[str],
    layers_per_stage: Sequence[int],
    schedule: PipelineSchedule,
    *,
    blocked_power_w: float,
    tp_size: int | None = None,
    **planner_kwargs: Any,
) -> KareusPlanner:
    """A :class:`KareusPlanner` from the searches' measurement files (``<key>.jsonl`` in
    ``measurements_dir``, one per :data:`PARTITION_KEYS`) and a non-partition profile CSV;
    its plans record ``layers_per_stage`` and ``tp_size`` (the measured tensor-parallel
    size, None: unknown).

    Raises:
        ProfileError: a file missing or malformed, or measurements that do not compose
            (see :func:`instruction_options`).
    """
    folder = Path(measurements_dir)
    missing = [f"{key}.jsonl" for key in PARTITION_KEYS if not (folder / f"{key}.jsonl").is_file()]
    if missing:
        raise ProfileError(
            f"{folder}: measurement files {missing} missing; run the partition search for "
            "each key (docs/kareus.md)"
        )
    points = {key: read_measurements(folder / f"{key}.jsonl", key) for key in PARTITION_KEYS}
    rest = PipelineProfile.from_csv(non_partition_profile, blocked_power_w=blocked_power_w)
    options = instruction_options(points, rest, layers_per_stage)
    return KareusPlanner(
        options,
        schedule,
        blocked_power_w=blocked_power_w,
        layers_per_stage=layers_per_stage,
        tp_size=tp_size,
        **planner_kwargs,
    )
