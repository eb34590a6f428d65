"""What a Kareus partition is: compute ops of one nano-batch and one collective of the other.

Kareus (Wu, Chung and Chowdhury, OSDI'26) splits every micro-batch into two nano-batches so
that one nano-batch's tensor-parallel all-reduce runs while the other computes. A
*partition* is the compute of one nano-batch in one block of a transformer layer (the
attention block or the MLP block, forward or backward) plus at most one collective of the
other nano-batch; its key is one of :data:`PARTITION_KEYS`, and one setting per key applies
to every layer of an instruction.

Three knobs decide how a partition runs (a :class:`PartitionSetting`):

* ``clock_mhz``: the locked SM clock;
* ``ctas``: the thread blocks (CTAs, one SM each) the collective may use, with
  ``block_threads`` threads each;
* ``slot``: the compute op before which the collective is issued (``0`` issues it before the
  first op, so it overlaps everything); :data:`SEQUENTIAL` (``-1``) runs it alone before the
  compute, as without nano-batch overlap.

Example:
    >>> ops = (ComputeOp("norm", "memory", 6.7e7), ComputeOp("fc1", "gemm", 1.0e11))
    >>> part = Partition("fwd_mlp", ops, comm_bytes=3.4e7, tp_size=8)
    >>> part.slots
    (-1, 0, 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_energy.errors import ConfigError

__all__ = [
    "MAX_SETTING",
    "OP_CLASSES",
    "PARTITION_KEYS",
    "SEQUENTIAL",
    "ComputeOp",
    "Partition",
    "PartitionSetting",
]

#: The partitions of a tensor-parallel transformer layer, as Kareus names them.
PARTITION_KEYS = ("fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp")

#: Kinds of compute op: ``work`` is bytes moved for ``memory`` ops, FLOPs for the others.
OP_CLASSES = ("memory", "gemm", "attention")

#: The slot of a collective that runs alone, before the compute (no overlap).
SEQUENTIAL = -1

#: A setting read from a file (clock, CTAs, slot, threads, op index) is an integer of size
#: below this: larger ones are no setting, and would not fit numpy's integers.
MAX_SETTING = 2**31


@dataclass(frozen=True)
class ComputeOp:
    """One compute kernel of a partition.

    Attributes:
        name: what it computes (``"qkv"``, ``"attention"``, ``"norm"``...).
        op_class: one of :data:`OP_CLASSES`.
        work: bytes read and written (``memory``) or floating-point operations (others),
            per GPU.
    """

    name: str
    op_class: str
    work: float

    def __post_init__(self) -> None:
        if self.op_class not in OP_CLASSES:
            raise ConfigError(
                f"op {self.name!r}: op_class {self.op_class!r} is not allowed; allowed: "
                f"{', '.join(OP_CLASSES)}"
            )
        if not self.work > 0:
            raise ConfigError(f"op {self.name!r}: work {self.work!r} is not allowed; use > 0")


@dataclass(frozen=True)
class Partition:
    """The compute ops of one nano-batch and the all-reduce of the other.

    Attributes:
        key: one of :data:`PARTITION_KEYS` (or another name for a measured micro-benchmark).
        ops: the compute kernels, in execution order.
        comm_bytes: bytes each GPU sends (and receives) in the all-reduce (a ring
            all-reduce of ``S`` bytes over ``N`` GPUs moves ``2 (N - 1) / N * S``).
        tp_size: GPUs of the tensor-parallel group (energies are of all of them).
    """

    key: str
    ops: tuple[ComputeOp, ...]
    comm_bytes: float
    tp_size: int

    def __post_init__(self) -> None:
        problems = []
        if not self.ops:
            problems.append("ops: at least one compute op is needed")
        if not self.comm_bytes > 0:
            problems.append(f"comm_bytes: {self.comm_bytes!r} is not allowed; use > 0")
        if self.tp_size < 2:
            problems.append(f"tp_size: {self.tp_size!r} is not allowed; use >= 2")
        if problems:
            raise ConfigError(problems, source=f"partition {self.key!r}")

    @property
    def slots(self) -> tuple[int, ...]:
        """Every launch slot: :data:`SEQUENTIAL`, then before each compute op."""
        return (SEQUENTIAL, *range(len(self.ops)))


@dataclass(frozen=True, order=True)
class PartitionSetting:
    """How one partition runs: clock, communication CTAs and launch slot.

    Attributes:
        clock_mhz: locked SM clock.
        ctas: thread blocks of the collective (>= 1).
        slot: compute op before which the collective is issued, or :data:`SEQUENTIAL`.
        block_threads: threads per block of the collective.
    """

    clock_mhz: int
    ctas: int
    slot: int
    block_threads: int = 1024

    def to_dict(self) -> dict[str, int]:
        """The setting as JSON-ready data."""
        return {
            "clock_mhz": self.clock_mhz,
            "ctas": self.ctas,
            "slot": self.slot,
            "block_threads": self.block_threads,
        }
