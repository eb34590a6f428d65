"""Kareus' runtime: a plan's partition settings applied to overlapped nano-batches.

Framework-independent pieces of the runtime (the Megatron-Core layer is
:mod:`.megatron_layer`):

* :data:`RUNTIME_OPS`: the compute ops of each partition, in the order they run, whose
  positions are the launch slots of a plan (``slot = k``: the collective is issued before
  op ``k``; :data:`~.partition.SEQUENTIAL`: alone, before the compute);
* :class:`PlanSettings`: a :class:`~.compose.KareusPlan` checked against the model it is
  applied to (partition keys, slots, CTA counts, layers per stage, tensor-parallel size;
  every problem reported at once), and each instruction's :class:`Overlap` per key;
* :func:`cta_groups`: one communicator per CTA count of the plan, limited to that many
  CTAs through NCCL's per-communicator options (``ProcessGroupNCCL.Options().config``,
  never the process-wide ``NCCL_MIN_CTAS``/``NCCL_MAX_CTAS``);
* :class:`CommStream` and :class:`PartitionRun`: one partition's collective issued at its
  slot on a communication stream of its own and waited for at the end of the partition.

On a GPU the collective waits, on its stream, for an event recorded on the compute stream
at the slot, so it starts on the GPU when the compute reaches that op, and the compute
stream waits for an event recorded after it before the result is used: the host never
blocks. On a CPU (gloo) the collective runs in gloo's own thread from the slot on and the
result is waited for the same way.

Example (what a layer does for one partition)::

    run = PartitionRun("fwd_attn", overlap, group, stream, tensor=partial_sum_of_nb0)
    run.reach("residual_add")      # boundaries before each op, in order
    ...
    reduced = run.finish()         # the consumer waits for the all-reduce
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_energy.collectives import replicate_group
from lightning_energy.errors import ConfigError
from lightning_energy.kareus.compose import KIND_KEYS, KareusPlan
from lightning_energy.kareus.partition import SEQUENTIAL
from lightning_energy.perseus.planning.plan import Plan
from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule

__all__ = [
    "BASELINE",
    "NCCL_MAX_CTAS",
    "RUNTIME_OPS",
    "CommStream",
    "Overlap",
    "PartitionRun",
    "PendingReduce",
    "PlanSettings",
    "cta_groups",
    "nccl_options",
]

log = logging.getLogger(__name__)

#: The compute ops of each partition of a tensor-parallel transformer layer, in the order
#: they run (forward: those of :mod:`.workload`; backward: as Kareus runs them, the norm
#: and residual add of the layer above first, then the block's ops in reverse up to the
#: column-parallel GEMM whose input gradient is all-reduced).
RUNTIME_OPS: dict[str, tuple[str, ...]] = {
    "fwd_attn": ("residual_add", "norm", "qkv", "qkv_split", "rotary", "attention", "proj"),
    "fwd_mlp": ("residual_add", "norm", "fc1", "activation", "fc2"),
    "bwd_attn": ("norm", "residual_add", "proj", "attention", "rotary", "qkv_split", "qkv"),
    "bwd_mlp": ("norm", "residual_add", "fc2", "activation", "fc1"),
}

#: The most CTAs a communicator may be limited to: NCCL caps larger ``min_ctas`` and
#: ``max_ctas`` at its channel limit (32 in most releases) without an error.
NCCL_MAX_CTAS = 32


@dataclass(frozen=True)
class Overlap:
    """How one partition's collective runs.

    Attributes:
        ctas: the CTAs its communicator is limited to (None: the tensor-parallel group,
            NCCL's defaults).
        slot: the compute op before which it is issued (:data:`SEQUENTIAL`: alone,
            before the compute).
    """

    ctas: int | None
    slot: int


#: Plain nano-batching (Kareus' baseline): NCCL's defaults, issued before the first op.
BASELINE = Overlap(None, 0)


class PlanSettings:
    """A Kareus plan's partition settings, checked against the model they are applied to.

    Args:
        plan: the plan.
        source: where the plan came from (a file), named in errors.

    Raises:
        ConfigError: partition keys other than the runtime's, a slot beyond the ops of its
            partition, or a CTA count out of NCCL's range (every problem at once).
    """

    def __init__(self, plan: KareusPlan, *, source: str | None = None) -> None:
        self.plan = plan
        self.source = source
        problems: list[str] = []
        self._overlaps: dict[Instruction, dict[str, Overlap]] = {}
        for inst, option in zip(plan.schedule.nodes, plan.choices, strict=True):
            keys = tuple(key for key, _ in option.partitions)
            if keys != KIND_KEYS[inst.kind]:
                problems.append(
                    f"{inst}: partition keys {list(keys)} are not allowed; use "
                    f"{list(KIND_KEYS[inst.kind])}"
                )
                continue
            overlaps = {}
            for key, setting in option.partitions:
                ops = RUNTIME_OPS[key]
                if not SEQUENTIAL <= setting.slot < len(ops):
                    problems.append(
                        f"{inst} {key}: slot {setting.slot} is not allowed; use "
                        f"{SEQUENTIAL} (sequential) to {len(ops) - 1} (before {ops[-1]})"
                    )
                if not 1 <= setting.ctas <= NCCL_MAX_CTAS:
                    problems.append(
                        f"{inst} {key}: ctas {setting.ctas} is not allowed; use 1 to "
                        f"{NCCL_MAX_CTAS} (NCCL's channel limit)"
                    )
                overlaps[key] = Overlap(setting.ctas, setting.slot)
            self._overlaps[inst] = overlaps
        if problems:
            raise ConfigError(_capped(problems), source=source or "kareus plan")

    @property
    def ctas(self) -> tuple[int, ...]:
        """Every CTA count of the plan, ascending."""
        return tuple(
            sorted({o.ctas for per in self._overlaps.values() for o in per.values() if o.ctas})
        )

    def overlap(self, inst: Instruction, key: str) -> Overlap:
        """The setting of partition ``key`` in instruction ``inst``."""
        return self._overlaps[inst][key]

    def check_model(
        self, *, tp_size: int, layers_per_stage: Mapping[int, int] | None = None
    ) -> None:
        """Refuse a plan made for another model.

        Args:
            tp_size: the model's tensor-parallel size.
            layers_per_stage: the layers of the stages this rank runs, by stage.

        Raises:
            ConfigError: another tensor-parallel size or other layer counts than the plan
                records (every problem at once).
        """
        plan = self.plan
        problems = []
        if plan.tp_size is not None and plan.tp_size != tp_size:
            problems.append(
                f"tensor_model_parallel_size: {tp_size} is not allowed with this plan; its "
                f"partitions were measured at {plan.tp_size}"
            )
        for stage, layers in sorted((layers_per_stage or {}).items()):
            if plan.layers_per_stage is None:
                break
            if not 0 <= stage < len(plan.layers_per_stage):
                problems.append(
                    f"stage {stage}: not in the plan, which has {len(plan.layers_per_stage)}"
                )
            elif plan.layers_per_stage[stage] != layers:
                problems.append(
                    f"stage {stage}: {layers} Kareus layers are not allowed with this plan; "
                    f"it was composed for {plan.layers_per_stage[stage]}"
                )
        if problems:
            raise ConfigError(problems, source=self.source or "kareus plan")
        if plan.tp_size is None or plan.layers_per_stage is None:
            log.warning(
                "Kareus: the plan%s records no %s; it cannot be checked against the model.",
                f" {self.source}" if self.source else "",
                "tensor-parallel size" if plan.tp_size is None else "layers per stage",
            )

    def clock_plan(self, schedule: PipelineSchedule) -> Plan:
        """The plan's clocks as a Perseus plan of ``schedule`` (the engine's own).

        Raises:
            ConfigError: the plan is for another pipeline schedule.
        """
        own = self.plan.schedule
        if (own.name, own.num_stages, own.num_microbatches, own.virtual_stages) != (
            schedule.name,
            schedule.num_stages,
            schedule.num_microbatches,
            schedule.virtual_stages,
        ) or set(own.nodes) != set(schedule.nodes):
            raise ConfigError(
                f"the plan is for {own.name} with {own.num_stages} stages, "
                f"{own.num_microbatches} micro-batches and {own.virtual_stages} virtual "
                f"stages; the pipeline runs {schedule.name} with {schedule.num_stages}, "
                f"{schedule.num_microbatches} and {schedule.virtual_stages}",
                source=self.source or "kareus plan",
            )
        return Plan(
            schedule,
            tuple(self.plan.choice(inst).clock_mhz for inst in schedule.nodes),
            dict(self.plan.metadata),
        )


def _capped(problems: list[str], limit: int = 20) -> list[str]:
    """At most ``limit`` problems, and how many more there are."""
    if len(problems) <= limit:
        return problems
    return [*problems[:limit], f"... and {len(problems) - limit} more"]


def nccl_options(ctas: int) -> Any:
    """NCCL process-group options limiting its communicator to ``ctas`` CTAs."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.min_ctas = ctas
    options.config.max_ctas = ctas
    return options


def cta_groups(tp_group: Any, ctas: tuple[int, ...]) -> dict[int, Any]:
    """One copy of the tensor-parallel group per CTA count, created collectively.

    On NCCL each copy's communicator is limited to its CTA count (``min_ctas`` =
    ``max_ctas``); another backend (gloo, on a CPU) has no CTAs: the copies only keep the
    collectives apart. Call it on every rank at the same point, with the same counts.

    Args:
        tp_group: this rank's tensor-parallel group.
        ctas: the CTA counts (the same on every rank).

    Returns:
        This rank's group for each count.
    """
    nccl = str(dist.get_backend(tp_group)).lower() == "nccl"
    return {
        n: replicate_group(tp_group, pg_options=nccl_options(n) if nccl else None)
        for n in sorted(set(ctas))
    }


class PendingReduce:
    """An all-reduce in flight.

    Args:
        tensor: the tensor it reduces in place.
        work: the collective's handle (CPU: waited for on the host).
        done: CUDA: an event recorded on the communication stream after the collective.
    """

    def __init__(self, tensor: torch.Tensor, work: Any = None, done: Any = None) -> None:
        self.tensor = tensor
        self._work = work
        self._done = done

    def wait(self, device: torch.device) -> torch.Tensor:
        """The reduced tensor, once the compute of ``device`` may use it (CUDA: the
        current stream waits for the collective's event; the host does not)."""
        if self._done is not None:
            torch.cuda.current_stream(device).wait_event(self._done)
        else:
            self._work.wait()
        return self.tensor


class CommStream:
    """Where the overlapped collectives of a device run.

    Args:
        device: the device the layer computes on (CUDA: the collectives get a stream of
            their own on it; otherwise the backend's own thread runs them).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    @property
    def cuda(self) -> bool:
        """Whether the collectives run on a CUDA stream."""
        return self.device.type == "cuda"

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> PendingReduce:
        """Issue the all-reduce of ``tensor`` (in place) over ``group`` now.

        On CUDA the communication stream first waits for an event recorded on the current
        (compute) stream here: the collective starts when the compute reaches this point.
        The all-reduce stays out of ``tensor``'s graph (it reduces partial sums, whose
        gradient is the sum's: the producer's backward is unchanged).
        """
        tensor = tensor.detach()
        if not self.cuda:
            return PendingReduce(tensor, work=dist.all_reduce(tensor, group=group, async_op=True))
        compute = torch.cuda.current_stream(self.device)
        slot = torch.cuda.Event()
        slot.record(compute)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        comm = self._stream
        comm.wait_event(slot)
        with torch.cuda.stream(comm):
            work = dist.all_reduce(tensor, group=group, async_op=True)
            work.wait()  # the communication stream waits for the collective; the host not
        done = torch.cuda.Event()
        done.record(comm)
        return PendingReduce(tensor, done=done)


class PartitionRun:
    """One partition: the compute of one nano-batch and the all-reduce of the other.

    Call :meth:`reach` at the boundary before each compute op, in order (by name or
    position), then :meth:`finish`. The collective is issued at the first boundary at or
    after its slot (with :data:`SEQUENTIAL`, at once and waited for before the compute),
    and at :meth:`finish` if no boundary reached it.

    Args:
        key: the partition key (one of :data:`RUNTIME_OPS`).
        overlap: the slot (its CTAs chose ``group``).
        group: the process group of the all-reduce.
        stream: where collectives run.
        tensor: what the other nano-batch all-reduces (in place); None: no collective.
        ops: the ops this partition runs (default: all of the key's; a layer's last
            partition runs the first ops only).
    """

    def __init__(
        self,
        key: str,
        overlap: Overlap,
        group: Any,
        stream: CommStream,
        tensor: torch.Tensor | None,
        *,
        ops: tuple[str, ...] | None = None,
    ) -> None:
        self.key = key
        self.backward = key.startswith("bwd")
        self.ops = RUNTIME_OPS[key] if ops is None else ops
        self.overlap = overlap
        self._group = group
        self._stream = stream
        self._tensor = tensor
        self._pending: PendingReduce | None = None
        self._reduced: torch.Tensor | None = None
        self.issued_before: str | None = None  # the op the collective was issued before

    def reach(self, op: str | int) -> None:
        """The compute is about to run ``op`` (a name of :attr:`ops`, or its position)."""
        if isinstance(op, str):
            if op not in self.ops:
                return
            op = self.ops.index(op)
        if self._tensor is None or self._pending is not None or op < self.overlap.slot:
            return
        pending = self._issue(self.ops[op])
        if self.overlap.slot == SEQUENTIAL:
            self._reduced = pending.wait(self._stream.device)

    def finish(self) -> torch.Tensor | None:
        """The reduced tensor, once the compute may use it (None: no collective)."""
        if self._tensor is None:
            return None
        if self._reduced is None:
            pending = self._pending or self._issue("the end")
            self._reduced = pending.wait(self._stream.device)
        return self._reduced

    def _issue(self, before: str) -> PendingReduce:
        assert self._tensor is not None
        self.issued_before = before
        self._pending = self._stream.all_reduce(self._tensor, self._group)
        return self._pending
