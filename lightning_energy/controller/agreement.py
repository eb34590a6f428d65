"""How the ranks of a job agree, at setup, on who drives which GPU and whether the job
optimises.

:func:`agree_on_run` is the controller's collaborator for it. Two collectives: which GPUs
each rank opened (a physical GPU opened by two ranks, itself or as MIG instances, is driven
and measured by the lower one only; node energy counters likewise), then whether each rank
can change its GPUs. One job, one plan: every rank optimises, or none does (strict mode:
every rank raises the same error, so no rank is left waiting in a collective).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_energy.controller.job_plan import (
    Capability,
    JobPlan,
    RankInfo,
    agree,
    describe_shared,
    node_meters,
    shared_gpus,
)
from lightning_energy.errors import EnergyError, JobSetupError, LeaseConflictError
from lightning_energy.node_energy import NodeEnergyMeter, NotMeasured

if TYPE_CHECKING:
    from collections.abc import Callable

    from lightning_energy.collectives import Collective
    from lightning_energy.device.base import DeviceSet
    from lightning_energy.device.guard import GPUGuard
    from lightning_energy.device.rapl import RaplCounters

__all__ = ["RunAgreement", "agree_on_run"]

log = logging.getLogger(__name__)


@dataclass
class RunAgreement:
    """What the ranks agreed on at setup.

    Attributes:
        ranks: what every rank drives (this rank's alone in a single process).
        plan: whether the job optimises (every rank alike), and why not.
        counts_energy: whether this rank measures its GPUs (False: a lower rank opened the
            same physical GPU and measures it).
        node_counters: this node's CPU and DRAM energy counters, or why there are none.
    """

    ranks: list[RankInfo] = field(default_factory=list)
    plan: JobPlan = field(default_factory=lambda: JobPlan(True, (), None))
    counts_energy: bool = True
    node_counters: RaplCounters | NotMeasured | None = None

    def changes_settings(self, world_size: int, guard: GPUGuard) -> bool:
        """Whether the job profiles and paces now: one decision for all ranks, since every
        rank makes the same collective calls (an observing rank takes part, changing
        nothing); a single process decides by its own guard."""
        if world_size > 1:
            return self.plan.optimises
        return not (guard.observe_only or guard.restored)

    def optimises(self, world_size: int, guard: GPUGuard | None) -> bool:
        """Whether the run was set up to change settings (as its summary reports it)."""
        if guard is None:
            return False
        return self.plan.optimises if world_size > 1 else not guard.observe_only

    def node_meter(self, rank: int, node: str) -> tuple[NodeEnergyMeter | None, dict[str, Any]]:
        """What this rank measures of its node's CPUs and DRAM: a meter when it is the
        lowest of the ranks that read the same counters (each node once), else None; and
        what the summary says (who measures them, or why nobody does).

        Args:
            rank: this rank.
            node: its node's name.
        """
        info: dict[str, Any] = {"node": node, "rank": rank}
        found = self.node_counters
        assert found is not None  # opened at setup
        if isinstance(found, NotMeasured):
            return None, {**info, **found.summary()}
        measurer = node_meters(self.ranks).get(found.key, rank)
        if measurer != rank:
            why = NotMeasured(f"measured by rank {measurer}", f"rank {measurer} reads them")
            return None, {**info, **why.summary(), "measured_by": measurer}
        return NodeEnergyMeter(found), info


def agree_on_run(
    *,
    collective: Collective,
    node: str,
    devices: DeviceSet,
    guard: GPUGuard,
    node_counters: RaplCounters | NotMeasured,
    probe_permission: Callable[[GPUGuard], None],
    observe: str | None,
    strict: bool,
) -> RunAgreement:
    """Take the lease and find out, with every rank, who drives what and whether the job
    optimises.

    Args:
        collective: how the ranks agree.
        node: this rank's node name.
        devices: this rank's GPUs.
        guard: their guard (it takes the lease here).
        node_counters: this node's CPU and DRAM counters, or why there are none.
        probe_permission: tries a harmless change, to learn now whether settings may be
            changed (the knobs' probe).
        observe: why this run may only observe although it could change its GPUs
            (another run of this process drives them; strict mode: a
            ``LeaseConflictError``).
        strict: raise instead of observing.

    Returns:
        What was agreed.

    Raises:
        EnergyError: in a single process, what its setup raised (strict mode, or a lease
            conflict); with several ranks, in strict mode, a ``JobSetupError`` on every rank
            when one cannot optimise.
    """
    single = collective.world_size == 1
    me = RankInfo(
        collective.rank,
        node,
        tuple(g.uuid for g in devices.gpus),
        node_meter=None if isinstance(node_counters, NotMeasured) else node_counters.key,
        physical=tuple(g.physical_uuid for g in devices.gpus),
    )
    ranks = (
        [me]
        if single
        else [RankInfo.from_dict(r) for r in collective.all_gather_object(me.to_dict())]
    )
    agreement = RunAgreement(ranks=ranks, node_counters=node_counters)
    shared = shared_gpus(ranks, collective.rank)
    if shared:
        agreement.counts_energy = False
        guard.observe(describe_shared(shared, ranks))
    failure: str | None = None
    try:
        if observe is not None and strict:
            raise LeaseConflictError(observe, owner_pid=os.getpid())
        if observe is not None:
            guard.observe(observe)
        guard.acquire()
        probe_permission(guard)
    except EnergyError as exc:
        if single:
            raise
        failure = str(exc)
    if single:
        return agreement
    reason = failure or guard.observe_only_reason
    mine = Capability(collective.rank, reason is None, reason)
    agreement.plan = agree(
        [Capability.from_dict(c) for c in collective.all_gather_object(mine.to_dict())]
    )
    if agreement.plan.message is None:
        return agreement
    if strict:
        raise JobSetupError(agreement.plan.message)
    if collective.rank == 0:
        log.warning("%s.", agreement.plan.message)
    return agreement
