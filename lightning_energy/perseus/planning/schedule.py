"""Pipeline schedules as DAGs of instructions.

A schedule fixes, for every device (GPU, pipeline rank), the order in which it runs the
forward and backward of each microbatch on each of its stages. Together with the data
dependencies between stages that order is a DAG whose longest path, with each node weighted
by its instruction's time, is the iteration time:

* consecutive instructions on the same device, in schedule order;
* ``F(s, m) -> F(s + 1, m)``: the next stage needs the activations;
* ``B(s + 1, m) -> B(s, m)``: the previous stage needs the gradients.

(``F(s, m)`` precedes ``B(s, m)`` on their device in every schedule here, so the forward
-> backward dependency of a microbatch is already a device edge.)

The orders are those ``torch.distributed.pipelining`` executes: :func:`gpipe`
(``ScheduleGPipe``), :func:`one_f_one_b` (``Schedule1F1B``, identical to the synchronous
1F1B of Megatron-LM and DeepSpeed) and :func:`interleaved_1f1b`
(``ScheduleInterleaved1F1B``: virtual stages, stage ``v`` on device ``v % num_devices``).

Example:
    >>> schedule = one_f_one_b(num_stages=2, num_microbatches=3)
    >>> [str(i) for i in schedule.device_orders[1]]
    ['F1.0', 'B1.0', 'F1.1', 'B1.1', 'F1.2', 'B1.2']
    >>> schedule.longest_path([1.0] * len(schedule.nodes))  # (M + S - 1) * (F + B)
    8.0
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lightning_energy.errors import ConfigError
from lightning_energy.perseus.planning.profile import BACKWARD, FORWARD

__all__ = [
    "SCHEDULES",
    "Instruction",
    "PipelineSchedule",
    "build_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule_to_json",
]

#: Schedule names accepted by :func:`build_schedule` (and the ``plan`` command).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True, order=True)
class Instruction:
    """One forward or backward of one microbatch on one stage.

    Attributes:
        stage: the stage (virtual stage for interleaved schedules).
        microbatch: the microbatch index.
        kind: ``"forward"`` or ``"backward"``.
    """

    stage: int
    microbatch: int
    kind: str

    def __str__(self) -> str:
        return f"{self.kind[0].upper()}{self.stage}.{self.microbatch}"


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule: the per-device instruction orders and the DAG they induce.

    Attributes:
        name: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        num_stages: pipeline stages (all virtual stages for interleaved schedules).
        num_microbatches: microbatches per iteration.
        num_devices: devices (GPUs) running the pipeline; stage ``s`` runs on device
            ``s % num_devices``.
        device_orders: for each device, its instructions in execution order.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_devices: int
    device_orders: tuple[tuple[Instruction, ...], ...] = field(repr=False)

    @property
    def virtual_stages(self) -> int:
        """Stages per device (1 except for interleaved schedules)."""
        return self.num_stages // self.num_devices

    def device_of(self, stage: int) -> int:
        """The device that runs ``stage``."""
        return stage % self.num_devices

    def producer(self, inst: Instruction) -> Instruction | None:
        """The instruction of another stage whose output ``inst`` consumes (None: the
        first forward or the last backward of a microbatch)."""
        if inst.kind == FORWARD and inst.stage > 0:
            return Instruction(inst.stage - 1, inst.microbatch, FORWARD)
        if inst.kind == BACKWARD and inst.stage < self.num_stages - 1:
            return Instruction(inst.stage + 1, inst.microbatch, BACKWARD)
        return None

    def consumer(self, inst: Instruction) -> Instruction | None:
        """The instruction of another stage that consumes the output of ``inst`` (None:
        the last forward or the first backward of a microbatch)."""
        if inst.kind == FORWARD and inst.stage < self.num_stages - 1:
            return Instruction(inst.stage + 1, inst.microbatch, FORWARD)
        if inst.kind == BACKWARD and inst.stage > 0:
            return Instruction(inst.stage - 1, inst.microbatch, BACKWARD)
        return None

    @cached_property
    def nodes(self) -> tuple[Instruction, ...]:
        """Every instruction, device by device in execution order."""
        return tuple(inst for order in self.device_orders for inst in order)

    @cached_property
    def index(self) -> dict[Instruction, int]:
        """Position of each instruction in :attr:`nodes`."""
        return {inst: i for i, inst in enumerate(self.nodes)}

    @cached_property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """Dependency edges ``(before, after)`` as positions in :attr:`nodes`."""
        index = self.index
        out: list[tuple[int, int]] = []
        for order in self.device_orders:
            out.extend((index[a], index[b]) for a, b in itertools.pairwise(order))
        for m in range(self.num_microbatches):
            for s in range(self.num_stages - 1):
                out.append(
                    (index[Instruction(s, m, FORWARD)], index[Instruction(s + 1, m, FORWARD)])
                )
                out.append(
                    (index[Instruction(s + 1, m, BACKWARD)], index[Instruction(s, m, BACKWARD)])
                )
        return tuple(sorted(set(out)))

    @cached_property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        """Direct predecessors of each node."""
        preds: list[list[int]] = [[] for _ in self.nodes]
        for a, b in self.edges:
            preds[b].append(a)
        return tuple(tuple(p) for p in preds)

    @cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        """Direct successors of each node."""
        succs: list[list[int]] = [[] for _ in self.nodes]
        for a, b in self.edges:
            succs[a].append(b)
        return tuple(tuple(s) for s in succs)

    @cached_property
    def topological_order(self) -> tuple[int, ...]:
        """Node positions in an order where every edge goes forward.

        Raises:
            ConfigError: the device orders contradict the data dependencies (a deadlock).
        """
        indegree = [len(p) for p in self.predecessors]
        ready = [i for i, d in enumerate(indegree) if d == 0]
        order: list[int] = []
        while ready:
            node = ready.pop()
            order.append(node)
            for nxt in self.successors[node]:
                indegree[nxt] -= 1
                if indegree[nxt] == 0:
                    ready.append(nxt)
        if len(order) != len(self.nodes):
            raise ConfigError(
                f"schedule {self.name!r}: the device orders deadlock against the stage dependencies"
            )
        return tuple(order)

    def finish_times(
        self, durations_s: Sequence[float] | NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """Earliest finish time of every node when each takes ``durations_s[node]``."""
        d = np.asarray(durations_s, dtype=np.float64)
        finish = np.zeros(len(self.nodes))
        preds = self.predecessors
        for node in self.topological_order:
            p = preds[node]
            start = max(finish[q] for q in p) if p else 0.0
            finish[node] = start + d[node]
        return finish

    def longest_path(self, durations_s: Sequence[float] | NDArray[np.float64]) -> float:
        """The iteration time: the longest path with node weights ``durations_s``.

        Raises:
            ConfigError: ``durations_s`` does not have one entry per node.
        """
        if len(durations_s) != len(self.nodes):
            raise ConfigError(
                f"durations_s: {len(durations_s)} values for {len(self.nodes)} instructions"
            )
        return float(self.finish_times(durations_s).max())


#: The most instructions a schedule holds: a plan file may ask for any count (JSON allows
#: 1 followed by 400 zeros), which is refused rather than built for ever.
MAX_INSTRUCTIONS = 10_000_000


def _check(name: str, **values: int) -> None:
    problems = [
        f"{key}: {_shown(value)} is not allowed; use >= 1"
        for key, value in values.items()
        if value < 1
    ]
    if not problems and 2 * math.prod(values.values()) > MAX_INSTRUCTIONS:
        counts = ", ".join(f"{key}={_shown(value)}" for key, value in values.items())
        problems.append(
            f"{counts}: 2 x {' x '.join(values)} instructions is not allowed; use at most "
            f"{MAX_INSTRUCTIONS:,}"
        )
    if problems:
        raise ConfigError(problems, source=f"schedule {name!r}")


def _shown(value: int) -> str:
    """``repr(value)`` cut to a readable length (a count can have hundreds of digits)."""
    text = repr(value)
    return text if len(text) <= 20 else text[:17] + "..."


def gpipe(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: every stage runs all forwards, then all backwards (microbatch order).

    Raises:
        ConfigError: a count below 1.
    """
    _check("gpipe", num_stages=num_stages, num_microbatches=num_microbatches)
    orders = tuple(
        tuple(Instruction(s, m, FORWARD) for m in range(num_microbatches))
        + tuple(Instruction(s, m, BACKWARD) for m in range(num_microbatches))
        for s in range(num_stages)
    )
    return PipelineSchedule("gpipe", num_stages, num_microbatches, num_stages, orders)


def one_f_one_b(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """Synchronous 1F1B: stage ``s`` runs ``min(M, S - s)`` forwards, then alternates one
    backward and one forward, then drains the remaining backwards.

    Raises:
        ConfigError: a count below 1.
    """
    _check("1f1b", num_stages=num_stages, num_microbatches=num_microbatches)
    orders = []
    for s in range(num_stages):
        warmup = min(num_microbatches, num_stages - s)
        order = [Instruction(s, m, FORWARD) for m in range(warmup)]
        next_forward = warmup
        for m in range(num_microbatches):
            order.append(Instruction(s, m, BACKWARD))
            if next_forward < num_microbatches:
                order.append(Instruction(s, next_forward, FORWARD))
                next_forward += 1
        orders.append(tuple(order))
    return PipelineSchedule("1f1b", num_stages, num_microbatches, num_stages, tuple(orders))


def interleaved_1f1b(
    num_devices: int, num_microbatches: int, virtual_stages: int
) -> PipelineSchedule:
    """Interleaved 1F1B (Narayanan et al., SC'21) as ``torch.distributed.pipelining`` runs it.

    Device ``r`` holds stages ``r, r + R, r + 2R, ...`` (``R = num_devices``). Microbatches
    go in rounds of ``M // max(1, M // R)``; a device first runs
    ``(V - 1) * per_round + 2 * (R - 1 - r)`` forwards (at most ``M * V``), then alternates
    one forward and one backward, then drains the backwards. Forwards cycle through the
    device's stages every round in ascending order, backwards in descending order.

    Args:
        num_devices: pipeline ranks ``R``.
        num_microbatches: microbatches ``M``; must be a multiple of ``max(1, M // R)``.
        virtual_stages: stages per device ``V``.

    Raises:
        ConfigError: a count below 1, or ``M`` not a multiple of the number of rounds.
    """
    _check(
        "interleaved_1f1b",
        num_devices=num_devices,
        num_microbatches=num_microbatches,
        virtual_stages=virtual_stages,
    )
    rounds = max(1, num_microbatches // num_devices)
    if num_microbatches % rounds:
        raise ConfigError(
            f"num_microbatches={num_microbatches}: interleaved 1F1B needs a multiple of the "
            f"number of rounds max(1, M // num_devices) = {rounds}",
            source="schedule 'interleaved_1f1b'",
        )
    per_round = num_microbatches // rounds
    total = num_microbatches * virtual_stages
    orders = []
    for rank in range(num_devices):
        warmup = min((virtual_stages - 1) * per_round + 2 * (num_devices - 1 - rank), total)
        next_mb: dict[tuple[int, str], int] = {}

        def take(stage: int, kind: str, counters: dict[tuple[int, str], int]) -> Instruction:
            m = counters.get((stage, kind), 0)
            counters[(stage, kind)] = m + 1
            return Instruction(stage, m, kind)

        order: list[Instruction] = []
        for step in range(warmup + total):
            if step < total:
                local = (step // per_round) % virtual_stages
                order.append(take(local * num_devices + rank, FORWARD, next_mb))
            if step >= warmup:
                local = virtual_stages - 1 - ((step - warmup) // per_round) % virtual_stages
                order.append(take(local * num_devices + rank, BACKWARD, next_mb))
        orders.append(tuple(order))
    return PipelineSchedule(
        "interleaved_1f1b",
        num_devices * virtual_stages,
        num_microbatches,
        num_devices,
        tuple(orders),
    )


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, *, virtual_stages: int = 1
) -> PipelineSchedule:
    """Build a schedule by name.

    Args:
        name: one of :data:`SCHEDULES`.
        num_stages: pipeline stages; for ``"interleaved_1f1b"`` all virtual stages
            (``num_devices * virtual_stages``).
        num_microbatches: microbatches per iteration.
        virtual_stages: stages per device (``"interleaved_1f1b"`` only).

    Raises:
        ConfigError: unknown name, bad counts, or ``num_stages`` not a multiple of
            ``virtual_stages``.
    """
    if name == "gpipe":
        schedule = gpipe(num_stages, num_microbatches)
    elif name == "1f1b":
        schedule = one_f_one_b(num_stages, num_microbatches)
    elif name == "interleaved_1f1b":
        if virtual_stages < 1 or num_stages % virtual_stages:
            raise ConfigError(
                f"num_stages={num_stages}, virtual_stages={virtual_stages}: interleaved 1F1B "
                "needs num_stages to be a multiple of virtual_stages >= 1"
            )
        return interleaved_1f1b(num_stages // virtual_stages, num_microbatches, virtual_stages)
    else:
        raise ConfigError(f"schedule={name!r}: allowed: {list(SCHEDULES)}")
    if virtual_stages != 1:
        raise ConfigError(
            f"virtual_stages={virtual_stages}: only 'interleaved_1f1b' has virtual stages"
        )
    return schedule


def schedule_to_json(
    schedule: PipelineSchedule, value: Callable[[Instruction], Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A schedule and one value per instruction as JSON-ready data (what a plan file holds).

    Args:
        schedule: the schedule.
        value: the JSON-ready value of an instruction (its clock, its settings...).

    Returns:
        ``(spec, rows)``: the schedule's name and sizes (what :func:`build_schedule` takes
        back), and one row per stage: ``{"stage": s, kind: [value of each microbatch]}``
        for every instruction kind.

    Example:
        >>> spec, rows = schedule_to_json(gpipe(2, 2), lambda inst: inst.microbatch)
        >>> spec["name"], rows[1]
        ('gpipe', {'stage': 1, 'backward': [0, 1], 'forward': [0, 1]})
    """
    kinds = sorted({inst.kind for inst in schedule.nodes})
    rows = [
        {
            "stage": stage,
            **{
                kind: [value(Instruction(stage, m, kind)) for m in range(schedule.num_microbatches)]
                for kind in kinds
            },
        }
        for stage in range(schedule.num_stages)
    ]
    spec = {
        "name": schedule.name,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "virtual_stages": schedule.virtual_stages,
    }
    return spec, rows
