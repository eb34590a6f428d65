"""What the ranks of one job agree on: who drives which GPU, and the job's totals.

Every rank of a job makes the same collective calls at the same steps, so whether the job
optimises must be one decision, not one per rank: a rank that cannot change its GPU (no
permission on one node, a MIG instance, a GPU leased by another job) still takes part in
every profiling window, observing, while the others optimise. At setup each rank shares
what it drives (:class:`RankInfo`); :func:`shared_gpus` finds physical GPUs that two
processes of the job open: the same GPU (a wrong local rank, every process given
``CUDA_VISIBLE_DEVICES=0``), or MIG instances of one GPU, each of which reports the whole
GPU's power and energy. The lowest rank on a physical GPU drives and measures it, the others
observe it and count none of its energy (:func:`measuring_ranks` counts the ranks that
measure). Then each rank shares whether it can change its GPUs, and :func:`agree` turns the
answers into one :class:`JobPlan`, identical on every rank.

The CPUs and DRAM of a node are measured once too: :func:`node_meters` names the lowest
rank of the ranks that read the same counters.

At the end of a run :func:`job_totals` sums what every rank measured into the job's own
numbers, each GPU and each node once, labelled with its rank and node.

Example:
    >>> a = RankInfo(rank=0, node="n0", gpus=("GPU-a",))
    >>> b = RankInfo(rank=1, node="n0", gpus=("GPU-a",))
    >>> shared_gpus([a, b], rank=1)
    {'GPU-a': 0}
    >>> plan = agree([Capability(0, True, None), Capability(1, False, "GPU-a: rank 0 drives it")])
    >>> plan.optimises, plan.observing
    (True, (1,))
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Capability",
    "JobPlan",
    "RankInfo",
    "agree",
    "describe_shared",
    "job_totals",
    "launcher_node_rank",
    "measuring_ranks",
    "node_meters",
    "node_name",
    "shared_gpus",
]

#: Environment variables launchers set to a node's index (torchrun, Lightning, Slurm).
_NODE_ENV = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")


def launcher_node_rank() -> int | None:
    """The node index the launcher gives (``GROUP_RANK``, ``NODE_RANK`` or
    ``SLURM_NODEID``, the first set to a number), or None."""
    for name in _NODE_ENV:
        value = os.environ.get(name, "").strip()
        if value.isascii() and value.isdigit() and len(value) <= 9:
            return int(value)
    return None


def node_name(node_rank: int | None = None) -> str:
    """This process's node: the host name, with the launcher's node index when known.

    Several "nodes" may share one host (tests, a launcher run on one machine with
    ``--nnodes 2``): the index tells them apart.

    Args:
        node_rank: the framework's node rank (None: from ``GROUP_RANK``, ``NODE_RANK`` or
            ``SLURM_NODEID``, else none).
    """
    if node_rank is None:
        node_rank = launcher_node_rank()
    host = socket.gethostname()
    return host if node_rank is None else f"{host}#{node_rank}"


@dataclass(frozen=True)
class RankInfo:
    """What one rank drives.

    Attributes:
        rank: the global rank.
        node: the node it runs on (:func:`node_name`).
        gpus: the UUIDs of the GPUs (or MIG instances) it opened.
        node_meter: which CPU and DRAM energy counters it can read (see
            :attr:`lightning_energy.device.rapl.RaplCounters.key`); None: none.
        physical: the UUID of the physical GPU of each of ``gpus`` (a MIG instance's
            parent); empty when each is a whole GPU.
    """

    rank: int
    node: str
    gpus: tuple[str, ...]
    node_meter: str | None = None
    physical: tuple[str, ...] = ()

    @property
    def physical_gpus(self) -> tuple[str, ...]:
        """The physical GPU of each of :attr:`gpus`."""
        return self.physical or self.gpus

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for a collective."""
        return {
            "rank": self.rank,
            "node": self.node,
            "gpus": list(self.gpus),
            "physical": list(self.physical),
            "node_meter": self.node_meter,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankInfo:
        """The inverse of :meth:`to_dict`."""
        meter = data.get("node_meter")
        return cls(
            int(data["rank"]),
            str(data["node"]),
            tuple(str(g) for g in data["gpus"]),
            None if meter is None else str(meter),
            tuple(str(g) for g in data.get("physical", ())),
        )


def shared_gpus(ranks: Sequence[RankInfo], rank: int) -> dict[str, int]:
    """The GPUs of ``rank`` whose physical GPU a lower rank of the job also opened (the same
    GPU, or another MIG instance of it).

    Returns:
        ``{uuid: the lowest rank on its physical GPU}`` for each such GPU (empty when this
        rank drives and measures its GPUs alone).
    """
    first = _lowest_ranks(ranks)
    mine = next((info for info in ranks if info.rank == rank), None)
    if mine is None:
        return {}
    return {
        uuid: first[physical]
        for uuid, physical in zip(mine.gpus, mine.physical_gpus, strict=True)
        if first[physical] != rank
    }


def measuring_ranks(ranks: Sequence[RankInfo]) -> int:
    """How many ranks measure their GPUs: those sharing no physical GPU with a lower rank
    (each physical GPU of the job is measured by exactly one of them)."""
    first = _lowest_ranks(ranks)
    return sum(all(first[p] == info.rank for p in info.physical_gpus) for info in ranks)


def _lowest_ranks(ranks: Sequence[RankInfo]) -> dict[str, int]:
    """``{physical GPU UUID: the lowest rank that opened it}``."""
    first: dict[str, int] = {}
    for info in sorted(ranks, key=lambda r: r.rank):
        for physical in info.physical_gpus:
            first.setdefault(physical, info.rank)
    return first


def node_meters(ranks: Sequence[RankInfo]) -> dict[str, int]:
    """Who measures each node's CPUs and DRAM: ``{counters: the lowest rank reading them}``.

    Ranks that read the same counters (one machine, one powercap tree) count them once.
    """
    lowest: dict[str, int] = {}
    for info in sorted(ranks, key=lambda r: r.rank):
        if info.node_meter is not None:
            lowest.setdefault(info.node_meter, info.rank)
    return lowest


def describe_shared(shared: Mapping[str, int], ranks: Sequence[RankInfo]) -> str:
    """Why a rank observes GPUs another rank of its job drives and measures (one sentence)."""
    by_rank = {info.rank: info for info in ranks}
    physical_of = {
        uuid: physical
        for info in ranks
        for uuid, physical in zip(info.gpus, info.physical_gpus, strict=True)
    }
    parts = []
    for uuid, r in shared.items():
        lower = by_rank.get(r)
        where = f"rank {r} on {lower.node if lower else '?'}"
        if lower is not None and uuid in lower.gpus:
            parts.append(
                f"{uuid} is also opened by {where} of this job (two processes on one GPU: "
                "check the local rank, the devices given to the trainer and "
                "CUDA_VISIBLE_DEVICES)"
            )
        else:
            parts.append(
                f"{uuid} is a MIG instance of {physical_of.get(uuid, '?')}, which {where} of "
                "this job also uses (every MIG instance reports its whole GPU's energy)"
            )
    return "; ".join(parts) + "; the lower rank drives and measures it"


@dataclass(frozen=True)
class Capability:
    """Whether one rank can change its GPUs.

    Attributes:
        rank: the global rank.
        can_change: False when the rank observes only (or failed to set up).
        reason: why not (None when it can).
    """

    rank: int
    can_change: bool
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for a collective."""
        return {"rank": self.rank, "can_change": self.can_change, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Capability:
        """The inverse of :meth:`to_dict`."""
        reason = data.get("reason")
        return cls(
            int(data["rank"]), bool(data["can_change"]), None if reason is None else str(reason)
        )


@dataclass(frozen=True)
class JobPlan:
    """The job-wide decision, identical on every rank.

    Attributes:
        optimises: whether the job profiles and changes settings (on the ranks that can).
        observing: the ranks that only observe.
        message: one sentence naming the observing ranks and why (None when none).
    """

    optimises: bool
    observing: tuple[int, ...]
    message: str | None


def agree(capabilities: Sequence[Capability]) -> JobPlan:
    """One decision from every rank's capability.

    The job optimises when at least one rank can change its GPUs; the others observe.
    """
    observing = sorted((c for c in capabilities if not c.can_change), key=lambda c: c.rank)
    optimises = len(observing) < len(capabilities)
    if not observing:
        return JobPlan(True, (), None)
    why = "; ".join(f"rank {c.rank}: {c.reason or 'observe-only'}" for c in observing)
    ranks = [c.rank for c in observing]
    if optimises:
        message = (
            f"ranks {ranks} of {len(capabilities)} observe only, the others optimise their GPUs "
            f"({why})"
        )
    else:
        message = f"every rank observes only, GPU settings are left as they are ({why})"
    return JobPlan(optimises, tuple(ranks), message)


def job_totals(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The job's totals from every rank's own numbers.

    Args:
        ranks: one mapping per rank with ``rank``, ``node``, ``gpus`` (each with ``uuid``
            and ``name``), ``counted`` (False for a rank whose GPUs another rank measures),
            ``energy_j``, ``energy_saved_j`` and optionally ``emissions_g``,
            ``node_energy`` (its node's CPU and DRAM summary, ``measured_by`` another rank
            when that rank measures them) and ``node_emissions_g``.

    Returns:
        ``scope: "job"``, the number of ranks and nodes, ``energy_j``, ``energy_saved_j``
        and ``emissions_g`` summed over counted ranks (each GPU once), and per-rank detail.
        With node summaries also ``node_energy_j`` and ``node_emissions_g`` (each node
        once; None when no node was measured), ``total_energy_j`` and
        ``total_emissions_g`` (GPUs plus nodes), ``counted`` (what the totals count, in
        words) and ``node_energy`` (each node's summary, with its ``node`` and ``rank``).
    """
    counted = [r for r in ranks if r.get("counted", True)]
    emissions = [r["emissions_g"] for r in counted if r.get("emissions_g") is not None]
    gpus = [
        {**gpu, "rank": r["rank"], "node": r["node"]}
        for r in sorted(counted, key=lambda r: r["rank"])
        for gpu in r.get("gpus", [])
    ]
    totals: dict[str, Any] = {
        "scope": "job",
        "ranks": len(ranks),
        "nodes": len({r["node"] for r in ranks}),
        "energy_j": sum(float(r["energy_j"]) for r in counted),
        "energy_saved_j": sum(float(r["energy_saved_j"]) for r in counted),
        "emissions_g": sum(emissions) if emissions else None,
        "gpus": gpus,
        "per_rank": [dict(r) for r in sorted(ranks, key=lambda r: r["rank"])],
    }
    if any(r.get("node_energy") for r in ranks):
        totals.update(_node_totals(ranks, totals["energy_j"], totals["emissions_g"]))
    return totals


def _node_totals(
    ranks: Sequence[Mapping[str, Any]], gpu_energy_j: float, gpu_emissions_g: float | None
) -> dict[str, Any]:
    """Each node's CPU and DRAM once: the rank that measured it, or the lowest rank of a
    node nobody measured (with its reason)."""
    from lightning_energy.node_energy import energy_counted

    entries = [
        {**r["node_energy"], "node": r["node"], "rank": r["rank"]}
        for r in sorted(ranks, key=lambda r: r["rank"])
        if r.get("node_energy") and r["node_energy"].get("measured_by") is None
    ]
    measured = [n for n in entries if n.get("measured")]
    unmeasured: dict[str, dict[str, Any]] = {}
    for n in entries:
        if not any(m["node"] == n["node"] for m in measured):
            unmeasured.setdefault(n["node"], n)  # the lowest rank says why
    nodes = measured + list(unmeasured.values())
    energies = [float(n["energy_j"]) for n in measured if n.get("energy_j") is not None]
    node_j = sum(energies) if energies else None
    grams = [float(r["node_emissions_g"]) for r in ranks if r.get("node_emissions_g") is not None]
    node_g = sum(grams) if grams else None
    return {
        "node_energy_j": node_j,
        "node_emissions_g": node_g,
        "total_energy_j": gpu_energy_j + (node_j or 0.0),
        "total_emissions_g": None if gpu_emissions_g is None else gpu_emissions_g + (node_g or 0.0),
        "counted": energy_counted(nodes),
        "node_energy": nodes,
    }
