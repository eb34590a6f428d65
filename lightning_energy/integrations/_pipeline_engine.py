"""What the pipeline-engine adapters (DeepSpeed, Megatron-Core) share.

An engine that runs its own pipeline schedule gets one adapter per process: it describes
the engine's schedule (:func:`~lightning_energy.perseus.runtime.pipeline_run.schedule_from_orders`),
then translates the engine's hooks into the calls of :class:`PipelineEngineAdapter`: one
iteration per training step, and every forward and backward of this rank in between. The
adapter holds the job's one :class:`~lightning_energy.controller.EnergyController` (energy,
carbon, the report) and a :class:`~lightning_energy.perseus.runtime.pipeline_run.RankPipeline` that
changes clocks through the controller's guard, under its lease.

With ``perseus: {enabled: true}`` Perseus plans the clocks (from ``perseus.plan`` or online)
and the controller does not profile power limits (both at once would confound each other's
measurements); a ``carbon:`` section then moves Perseus' target iteration time. Without it
the pipeline only runs at the clocks it found, and the power limit is optimised as for any
other framework.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import (
    EnergyController,
    Interruption,
    RunSummary,
    StepEnd,
    StepResult,
    StepStart,
)
from lightning_energy.device import DeviceSet, open_devices
from lightning_energy.errors import EnergyError
from lightning_energy.integrations.adapter import EnergyAdapter
from lightning_energy.perseus.runtime.pipeline_run import PipelinePace, RankPipeline
from lightning_energy.perseus.runtime.rank_gpu import open_rank_gpu

if TYPE_CHECKING:
    import torch

    from lightning_energy.perseus.planning.plan import Plan
    from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule

__all__ = ["PipelineEngineAdapter"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class PipelineEngineAdapter(EnergyAdapter):
    """A pipeline engine's job: one energy controller and this rank's Perseus pipeline.

    Subclasses translate their engine's hooks: :meth:`_begin_pipeline` once the process
    group and the engine exist, :meth:`_iteration_start` / :meth:`_iteration_end` around
    every training step (or :meth:`_run_iteration`, which also aborts the run when the step
    raises), :meth:`_before` / :meth:`_after` around every forward and backward of this
    rank, and :meth:`close` (:meth:`_finish`) / :meth:`_abort` at the end (the ``with``
    block does both).

    Args:
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``; None
            reads the file named by ``LIGHTNING_ENERGY_CONFIG``, else uses defaults.
        device: the ``device:`` section (overrides the file's).
        carbon: the ``carbon:`` section (overrides the file's).
        perseus: the ``perseus:`` section (overrides the file's).
        strict: raise instead of observing when GPU settings cannot be changed, and when
            the engine's executed order is not the schedule's.
        report: write the run report (JSON) to this path at the end of training.

    Raises:
        ConfigError: invalid configuration (before any GPU is touched).
    """

    applied_sections: ClassVar[frozenset[str]] = frozenset({"perseus"})

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig | None = None,
        *,
        device: dict[str, Any] | None = None,
        carbon: dict[str, Any] | None = None,
        perseus: dict[str, Any] | None = None,
        strict: bool | None = None,
        report: str | None = None,
    ) -> None:
        super().__init__(config, device=device, carbon=carbon, strict=strict, report=report)
        if perseus:
            self.config = self.config.merged({"perseus": perseus})
        self._pipeline: RankPipeline | None = None
        self._pace: PipelinePace | None = None
        self._devices: DeviceSet | None = None
        self._step_start_s: float | None = None

    @property
    def pipeline(self) -> RankPipeline | None:
        """This rank's pipeline while a run is open (None before and after)."""
        return self._pipeline

    def _begin_pipeline(
        self,
        *,
        schedule: PipelineSchedule,
        global_rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        workload: str,
        total_steps: int | None = None,
        stage_times_s: Sequence[Sequence[float]] | None = None,
        pipeline_rank: int | None = None,
        pipeline_group: Any = None,
        plan: Plan | None = None,
    ) -> None:
        """Open this rank's GPU, take the lease, set up the controller and the pipeline
        (every rank, once the process group exists).

        Args:
            schedule: the engine's schedule.
            global_rank: this process's global rank.
            world_size: the number of processes.
            local_rank: this process's rank on its node.
            device: the engine's device (a CUDA device picks the GPU by UUID).
            workload: the workload key (:func:`~.adapter.workload_key`).
            total_steps: the training steps the job will run (carbon pacing needs it).
            stage_times_s: simulated GPUs: ``[forward, backward]`` seconds of one
                microbatch on each stage at the maximum clock.
            pipeline_rank: this process's pipeline rank (None: ``global_rank``, a pure
                pipeline).
            pipeline_group: a gloo group of the pipeline ranks this process exchanges
                with (None: every process, a pure pipeline).
            plan: the clocks to apply (None: ``perseus.plan``, or online planning).

        Raises:
            ConfigError: a bad section, a plan file for another schedule, or the stage
                times of another number of stages.
            EnergyError: a run is already open; in strict mode, a GPU that cannot be
                controlled.
        """
        if self.running:
            raise EnergyError(f"{type(self).__name__}: a run is already open")
        dev = self.config.device
        # The pipeline simulates each instruction's work: no whole-step simulation.
        devices = dataclasses.replace(
            open_devices(
                dev.backend, simulated=dev.simulated_spec(), local_rank=local_rank, device=device
            ),
            run_step=None,
        )
        self._devices = devices
        try:
            controller = EnergyController(
                self.config,
                devices=devices,
                local_rank=local_rank,
                device=device,
                install_signal_handlers=threading.current_thread() is threading.main_thread(),
            )
            self._begin_run(controller, main_process=global_rank == 0)
            controller.set_workload(workload)
            controller.set_total_steps(total_steps)
            guard = controller.guard
            assert guard is not None  # set up
            rank = open_rank_gpu(
                self.config, local_rank=local_rank, device=device, shared=(devices, guard)
            )
            if pipeline_group is not None:
                rank = dataclasses.replace(rank, group=pipeline_group)
            perseus = self.config.perseus
            self._pipeline = RankPipeline(
                rank,
                perseus,
                schedule,
                global_rank=global_rank if pipeline_rank is None else pipeline_rank,
                device=device,
                stage_times_s=stage_times_s,
                strict=self.config.strict,
                plan_clocks=perseus.enabled,
                plan=plan,
            )
            if perseus.enabled:
                # A knob that holds the clocks: the controller profiles no power limits
                # (they would confound Perseus' profile) and paces Perseus' target time.
                self._pace = PipelinePace(self._pipeline)
                controller.add_knob(self._pace)
        except BaseException as exc:
            self._abort(type(exc).__name__)
            raise
        log.debug("pipeline of %d processes set up on rank %d", world_size, global_rank)

    def _require(self) -> RankPipeline:
        if self._pipeline is None or self.controller is None:
            raise EnergyError(f"{type(self).__name__}: no run is open")
        return self._pipeline

    def _iteration_start(self) -> None:
        """A training step starts (before its first instruction)."""
        pipeline = self._require()
        assert self.controller is not None
        self.controller.handle(StepStart())
        pipeline.iteration_start()
        self._step_start_s = pipeline.rank.clock()

    def _outside_training(self, reason: str) -> None:
        """Every rank runs something other than a training iteration next (an
        evaluation): the profiling window in progress leaves it out."""
        if self.running and self.controller is not None:
            self.controller.handle(Interruption(reason))

    def _before(self, inst: Instruction) -> None:
        """``inst`` is about to run on this rank."""
        self._require().before(inst)

    def _after(self, inst: Instruction) -> None:
        """``inst`` ran on this rank."""
        self._require().after(inst)

    def _iteration_end(self) -> StepResult:
        """A training step ended (after the optimizer step): plan, pace, account."""
        pipeline = self._require()
        assert self.controller is not None
        pipeline.iteration_end()
        if self._pace is not None and self._step_start_s is not None:
            self._pace.observe_step(pipeline.rank.clock() - self._step_start_s)
        return self.controller.handle(StepEnd())

    def _run_iteration(self, step: Callable[[], T]) -> T:
        """Run ``step`` (the engine's training step) as one iteration; an exception in it
        ends the run at once (clocks reset, GPUs restored, no collective) and propagates."""
        try:
            self._iteration_start()
            result = step()
            self._iteration_end()
        except BaseException as exc:
            self._abort(type(exc).__name__)
            raise
        return result

    def close(self) -> RunSummary | None:
        """End the run (every rank: the job's totals are a collective): reset the clocks,
        restore every GPU, log the summary and write the report."""
        return self._finish()

    def _close_pipeline(self) -> None:
        pipeline, self._pipeline = self._pipeline, None
        self._pace = None
        if pipeline is not None:
            pipeline.close()

    def _close_devices(self) -> None:
        devices, self._devices = self._devices, None
        if devices is not None:
            devices.close()

    def _finish(self) -> RunSummary | None:
        """End the run normally (every rank): clocks reset, GPUs restored, report."""
        try:
            self._close_pipeline()
        finally:
            try:
                summary = super()._finish()
            finally:
                self._close_devices()
        return summary

    def _abort(self, failure: str) -> RunSummary | None:
        """End the run on an exception: clocks reset, GPUs restored, no collective."""
        try:
            self._close_pipeline()
        except Exception:  # restoring the power limit and the report still matter
            log.exception("Resetting the pipeline's GPU clocks failed")
        try:
            return super()._abort(failure)
        finally:
            self._close_devices()
