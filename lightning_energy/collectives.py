"""How ranks agree: a tiny interface over the trainer's own collectives.

The controller aggregates each profiling window across ranks (energy summed over every GPU
of the job, time the slowest rank's) and broadcasts rank 0's decisions, through whatever
collective layer the trainer already runs: Lightning's strategy, Accelerate's utilities, or
``torch.distributed`` directly. Nothing extra is needed across nodes.

Collectives of CPU tensors (Perseus' clock and timing exchanges) never run on an NCCL group,
which rejects them: :func:`cpu_collective_group` gives a gloo group for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from lightning_energy.errors import ConfigError

__all__ = [
    "Collective",
    "GatherCollective",
    "LocalCollective",
    "TorchDistributedCollective",
    "cpu_collective_group",
    "default_collective",
    "replicate_group",
]

T = TypeVar("T")


class Collective(Protocol):
    """Rank identity plus the two operations the controller needs."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def sum_and_max(
        self, to_sum: Sequence[float], to_max: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        """Element-wise sum of ``to_sum`` and max of ``to_max`` over all ranks (one call)."""
        ...

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Every rank returns rank ``src``'s ``obj``."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable data), in rank order, on every rank."""
        ...


class LocalCollective:
    """A single process: every operation is the identity."""

    rank = 0
    world_size = 1

    def sum_and_max(
        self, to_sum: Sequence[float], to_max: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        return list(to_sum), list(to_max)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class GatherCollective:
    """Collectives built from an ``all_gather`` of a float vector and an object broadcast.

    Framework adapters pass their own primitives (Lightning's ``strategy.all_gather`` and
    ``strategy.broadcast``, Accelerate's ``gather`` and ``broadcast_object_list``), so
    ranks agree through the trainer's collectives, whatever its backend.

    Args:
        rank: this process's global rank.
        world_size: number of processes.
        all_gather: takes a list of floats, returns one list per rank.
        broadcast: takes an object and a source rank, returns the source's object.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        all_gather: Callable[[list[float]], list[list[float]]],
        broadcast: Callable[[Any, int], Any],
    ) -> None:
        self._rank = rank
        self._world_size = world_size
        self._all_gather = all_gather
        self._broadcast = broadcast

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def sum_and_max(
        self, to_sum: Sequence[float], to_max: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        n = len(to_sum)
        rows = self._all_gather([*to_sum, *to_max])
        sums = [sum(row[i] for row in rows) for i in range(n)]
        maxes = [max(row[n + i] for row in rows) for i in range(len(to_max))]
        return sums, maxes

    def broadcast(self, obj: T, src: int = 0) -> T:
        result: T = self._broadcast(obj, src)
        return result

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Two float gathers: every rank's JSON length, then the bytes padded to the longest.

        Float64 holds every byte exactly, so any backend's float ``all_gather`` serves.
        """
        payload = json.dumps(obj, sort_keys=True).encode("utf-8")
        lengths = [int(row[0]) for row in self._all_gather([float(len(payload))])]
        padded = [float(b) for b in payload] + [0.0] * (max(lengths) - len(payload))
        rows = self._all_gather(padded)
        return [
            json.loads(bytes(int(v) for v in row[:n]).decode("utf-8"))
            for row, n in zip(rows, lengths, strict=True)
        ]


class TorchDistributedCollective(GatherCollective):
    """Collectives over the default ``torch.distributed`` process group (any backend)."""

    def __init__(self) -> None:
        def all_gather(values: list[float]) -> list[list[float]]:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, values)
            return [list(row) for row in gathered]

        def broadcast(obj: Any, src: int) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=src)
            return box[0]

        super().__init__(dist.get_rank(), dist.get_world_size(), all_gather, broadcast)


def default_collective() -> Collective:
    """``torch.distributed`` when a process group is initialised, else a local one."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return LocalCollective()
    if dist.is_available() and dist.is_initialized():
        return TorchDistributedCollective()
    return LocalCollective()


def cpu_collective_group(group: Any = None) -> Any:
    """A process group over which CPU tensors may be exchanged.

    NCCL, Lightning's default backend on CUDA, raises on CPU tensors. A ``group`` whose
    backend takes them (gloo, or a ``cpu:gloo,cuda:nccl`` group) is returned as is; for the
    default group (None) of another backend, a gloo side group over the same ranks is
    created: call this on every rank at the same point (it is a collective then).

    Args:
        group: the group the caller would use (None: the default group).

    Returns:
        ``group``, or the new gloo group; None when no process group is initialised.

    Raises:
        ConfigError: ``group`` is an explicit group whose backend rejects CPU tensors.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return group
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend:
        return group
    if group is not None and group is not dist.group.WORLD:
        raise ConfigError(
            f"process group backend {backend!r} rejects CPU tensors: pass a gloo group "
            "(torch.distributed.new_group(backend='gloo'))"
        )
    return dist.new_group(backend="gloo")


def replicate_group(group: Any, *, backend: str | None = None, pg_options: Any = None) -> Any:
    """A new group over the ranks of ``group``, with another backend or other options.

    ``torch.distributed.new_group`` is a collective of every process, also of those outside
    the new group. Each rank passes its own ``group`` (its tensor-parallel group, its
    pipeline group...: one of a partition of the ranks); the ranks agree on every member of
    the partition (one object all-gather) and create a group for each, in the same order,
    so every rank gets the copy of its own. Call it on every rank at the same point.

    Args:
        group: this rank's group (one of a partition of all ranks).
        backend: the new group's backend (None: that of ``group``).
        pg_options: the new group's backend options (NCCL's ``ProcessGroupNCCL.Options``).

    Returns:
        The new group this rank belongs to.
    """
    mine = sorted(int(r) for r in dist.get_process_group_ranks(group))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    backend = backend if backend is not None else str(dist.get_backend(group))
    own = None
    for ranks in sorted({tuple(r) for r in everyone}):
        created = dist.new_group(list(ranks), backend=backend, pg_options=pg_options)
        if list(ranks) == mine:
            own = created
    return own
