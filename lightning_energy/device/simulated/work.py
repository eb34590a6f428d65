"""GPU work run on simulated GPUs: what a job's kernels would do, on the virtual clock.

* :class:`PipelineSimulation`: a pipeline's instructions, each rank on its own virtual
  clock; finishing an instruction sends its virtual finish time to the rank of the dependent
  stage, so a simulated iteration takes the planned iteration time and its bubbles draw the
  blocked power.
* :class:`DataParallelSimulation`: a data-parallel rank's step, synchronised like an
  all-reduce.
* :class:`WorkRunner`: both for one GPU; :func:`~lightning_energy.device.work_runner`
  hands it out for simulated GPUs (real GPUs run the framework's kernels: None).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.device.base import StageWork
from lightning_energy.device.simulated.gpu import SimulatedGPU

if TYPE_CHECKING:
    from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule

__all__ = [
    "DataParallelSimulation",
    "PipelineSimulation",
    "WorkRunner",
    "wait_for_slowest",
]

#: ``(time_s, energy_j)`` of a GPU at one moment.
Reading = tuple[float, float]


def wait_for_slowest(gpu: SimulatedGPU, group: Any = None) -> float:
    """A barrier on simulated clocks: every rank waits, blocked in the collective, until
    the slowest rank's time.

    Args:
        gpu: this rank's simulated GPU (its clock advances, drawing its blocked power at
            the locked clock).
        group: a process group taking CPU tensors (see
            :func:`~lightning_energy.collectives.cpu_collective_group`; None: the default
            one); a single process just returns.

    Returns:
        The common virtual time all ranks reached.
    """
    end = torch.tensor([gpu.clock.now()], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(end, op=dist.ReduceOp.MAX, group=group)
    wait_s = float(end.item()) - gpu.clock.now()
    if wait_s > 0:
        gpu.wait_in_collective(wait_s)
    return float(end.item())


@dataclass
class PipelineSimulation:
    """GPU time, energy and cross-rank timing of a pipeline on simulated GPUs.

    Every rank runs one simulated GPU on its own virtual clock. Finishing an instruction
    sends its virtual finish time to the rank of the dependent stage (through a gloo
    group); starting one waits, blocked in the receive at the clock just set for it, until
    its input's time. :meth:`end_iteration` aligns all ranks on the slowest one (blocked at
    the last instruction's clock), as the optimizer step does.

    Args:
        gpu: this rank's simulated GPU.
        works: the work of each ``(stage, kind)`` run by this rank.
        group: the process group over the pipeline ranks; None: the default group (CPU
            tensors go over a gloo group, see
            :func:`~lightning_energy.collectives.cpu_collective_group`).
    """

    gpu: SimulatedGPU
    works: Mapping[tuple[int, str], StageWork]
    group: Any = None
    _inbox: dict[Instruction, float] = field(default_factory=dict)
    _sends: list[Any] = field(default_factory=list)
    _iteration_start_s: float = 0.0

    def __post_init__(self) -> None:
        self.group = cpu_collective_group(self.group)
        self._iteration_start_s = self.gpu.clock.now()

    def wait_for_input(self, schedule: PipelineSchedule, rank: int, inst: Instruction) -> None:
        """Wait (blocked in the receive) until the virtual time the input of ``inst``
        was produced."""
        producer = schedule.producer(inst)
        if producer is None:
            return
        if schedule.device_of(producer.stage) == rank:
            ready_s = self._inbox.pop(producer)
        else:
            buf = torch.zeros(1, dtype=torch.float64)
            src = schedule.device_of(producer.stage)
            dist.recv(
                buf,
                src=_global_rank(self.group, src),
                group=self.group,
                tag=1 + schedule.index[producer],
            )
            ready_s = float(buf.item())
        wait_s = ready_s - self.gpu.clock.now()
        if wait_s > 0:
            self.gpu.wait_in_collective(wait_s)

    def run(self, inst: Instruction) -> tuple[float, float]:
        """Run the instruction's GPU work at the locked clock: ``(time_s, energy_j)``."""
        work = self.works[(inst.stage, inst.kind)]
        energy_before = self.gpu.energy_j()
        time_s = self.gpu.run_work(work.t0_s, work.compute_bound_share)
        return time_s, self.gpu.energy_j() - energy_before

    def publish(self, schedule: PipelineSchedule, rank: int, inst: Instruction) -> None:
        """Tell the consumer of ``inst``'s output when it was produced."""
        consumer = schedule.consumer(inst)
        if consumer is None:
            return
        now_s = self.gpu.clock.now()
        dst = schedule.device_of(consumer.stage)
        if dst == rank:
            self._inbox[inst] = now_s
            return
        buf = torch.tensor([now_s], dtype=torch.float64)
        self._sends.append(
            dist.isend(
                buf,
                dst=_global_rank(self.group, dst),
                group=self.group,
                tag=1 + schedule.index[inst],
            )
        )

    def locked_mhz(self) -> int | None:
        """The maximum SM clock the GPU is locked to (None: not locked)."""
        locked = self.gpu.locked_clocks_mhz()
        return None if locked is None else locked[1]

    def end_iteration(self) -> tuple[float, float]:
        """Align every rank on the slowest; ``(iteration_time_s, energy_j of this GPU)``."""
        for work in self._sends:
            work.wait()
        self._sends.clear()
        end_s = wait_for_slowest(self.gpu, self.group)
        iteration_s = end_s - self._iteration_start_s
        self._iteration_start_s = end_s
        return iteration_s, self.gpu.energy_j()


def _global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (the default group: itself)."""
    if group is None:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


@dataclass
class DataParallelSimulation:
    """One data-parallel rank's step on a simulated GPU, synchronised like an all-reduce.

    Args:
        gpu: this rank's simulated GPU (its ``slowdown`` makes it a straggler).
        work: the compute of one step.
        group: the data-parallel process group (None: the default group; CPU tensors go
            over a gloo group, see :func:`~lightning_energy.collectives.cpu_collective_group`).
    """

    gpu: SimulatedGPU
    work: StageWork
    group: Any = None
    _step_start: Reading = field(default=(0.0, 0.0))
    _compute_end: Reading = field(default=(0.0, 0.0))

    def __post_init__(self) -> None:
        self.group = cpu_collective_group(self.group)

    def _read(self) -> Reading:
        return self.gpu.clock.now(), self.gpu.energy_j()

    def compute(self) -> float:
        """Run the step's compute at the locked clock; its time in seconds."""
        self._step_start = self._read()
        time_s = self.gpu.run_work(self.work.t0_s, self.work.compute_bound_share)
        self._compute_end = self._read()
        return time_s

    def all_reduce(self) -> tuple[Reading, Reading, Reading]:
        """Wait (idle) for the slowest rank; the step's ``(time_s, energy_j)`` readings at
        its start, at the end of its compute and now."""
        wait_for_slowest(self.gpu, self.group)
        return self._step_start, self._compute_end, self._read()


class WorkRunner:
    """Runs a job's GPU work on a simulated GPU, in the calling thread: what
    :func:`~lightning_energy.device.work_runner` gives for one.

    Args:
        gpu: the simulated GPU.
    """

    def __init__(self, gpu: SimulatedGPU) -> None:
        self.gpu = gpu

    def pipeline(
        self, works: Mapping[tuple[int, str], StageWork], group: Any = None
    ) -> PipelineSimulation:
        """The work of this rank's pipeline instructions (see :class:`PipelineSimulation`)."""
        return PipelineSimulation(self.gpu, works, group=group)

    def data_parallel(self, work: StageWork, group: Any = None) -> DataParallelSimulation:
        """This rank's data-parallel step (see :class:`DataParallelSimulation`)."""
        return DataParallelSimulation(self.gpu, work, group=group)
