"""What the Perseus strategies of both Lightning namespaces share.

``lightning.pytorch`` and ``pytorch_lightning`` have distinct strategy classes that reject
each other's objects, so each namespace gets its own thin subclasses (:mod:`.lightning`,
:mod:`.pytorch_lightning`) of the mixins here, which import neither: they extend the hooks
of the namespace's ``DDPStrategy``, listed after them, through ``super()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.device import SimulatedSpec, open_devices
from lightning_energy.device.base import GPU
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.simulated import SimulatedGPU
from lightning_energy.errors import ConfigError
from lightning_energy.perseus.online import OnlinePerseus
from lightning_energy.perseus.plan import Plan
from lightning_energy.perseus.runtime import (
    ClockController,
    PerseusPipelineStage,
    PipelineRuntime,
    PipelineSimulation,
    StageWork,
)
from lightning_energy.perseus.schedule import PipelineSchedule, build_schedule
from lightning_energy.perseus.straggler import (
    SimulatedDataParallel,
    StepReadings,
    StragglerEqualizer,
)

__all__ = [
    "PerseusDDPCore",
    "PerseusPipelineCore",
    "PerseusStrategyCore",
    "PipelineModule",
    "register_perseus_strategies",
]

log = logging.getLogger(__name__)


_SCHEDULE_CLASSES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


@runtime_checkable
class PipelineModule(Protocol):
    """What a LightningModule declares to be trained by the ``perseus_pipeline`` strategy.

    Batches are ``(inputs, target)``; both are split into microbatches along dimension 0.
    The module's ``training_step`` is not called: the strategy runs the pipeline step and
    logs ``train_loss``.
    """

    def pipeline_stages(self) -> Sequence[torch.nn.Module]:
        """The stages, in pipeline order (one per GPU, times the virtual stages)."""
        ...

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Loss of one microbatch from the last stage's output."""
        ...


class PerseusStrategyCore:
    """This rank's GPU and its guard, restored at teardown and on exceptions, and a gloo
    group for the CPU tensors Perseus exchanges (the default group may be NCCL).

    Subclasses call :meth:`_init_gpu_options` in ``__init__`` and :meth:`_open_gpu` in
    ``setup``.
    """

    # Provided by the namespace's ``DDPStrategy``.
    lightning_module: Any
    model: Any
    world_size: int
    global_rank: int
    local_rank: int
    root_device: torch.device

    def _init_gpu_options(
        self,
        profile_clocks_mhz: list[int] | None,
        device_backend: str | None,
        simulated_gpu: str,
        compute_bound_share: float,
        lease_dir: str | None,
        strict: bool,
    ) -> None:
        self.profile_clocks_mhz = profile_clocks_mhz
        self.device_backend = device_backend
        self.simulated_gpu = simulated_gpu
        self.compute_bound_share = compute_bound_share
        self.lease_dir = lease_dir
        self.strict = strict
        self.gpu: GPU | None = None
        self._guard: GPUGuard | None = None
        self._cpu_group: Any = None

    def _open_gpu(self, spec: SimulatedSpec) -> tuple[GPU, GPUGuard]:
        """Open this rank's GPU (``spec`` for simulated ones, the strategy's root device
        for real ones), lease it with a guard, and set up the gloo group."""
        self._cpu_group = cpu_collective_group()
        devices = open_devices(
            self.device_backend,
            simulated=spec,
            local_rank=self.local_rank,
            device=self.root_device,
        )
        gpu = devices.gpus[0]
        guard = GPUGuard(
            [gpu],
            lease_dir=self.lease_dir,
            strict=self.strict,
            install_signal_handlers=threading.current_thread() is threading.main_thread(),
        )
        guard.acquire()
        self.gpu, self._guard = gpu, guard
        return gpu, guard

    def _restore(self) -> None:
        if self._guard is not None:
            self._guard.restore()
            self._guard = None

    def on_exception(self, exception: BaseException) -> None:
        """Put the GPU back before the exception propagates."""
        self._restore()
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        """Restore the GPU, then tear down as DDP does."""
        self._restore()
        super().teardown()  # type: ignore[misc]


class PerseusPipelineCore(PerseusStrategyCore):
    """Pipeline parallel with per-instruction GPU clocks; see
    :class:`lightning_energy.perseus.lightning.PerseusPipelineStrategy` for the arguments.

    Raises:
        ConfigError: bad arguments (at construction) or a module without a stage split
            (at setup).
    """

    strategy_name = "perseus_pipeline"

    def __init__(
        self,
        *,
        schedule: str = "1f1b",
        microbatches: int = 4,
        virtual_stages: int = 1,
        plan: str | None = None,
        target_time_s: float | None = None,
        profile_clocks_mhz: list[int] | None = None,
        warmup_iterations: int = 1,
        iterations_per_clock: int = 1,
        replan_every_iterations: int = 10,
        device_backend: str | None = None,
        simulated_gpu: str = "a100",
        simulated_stage_times_s: list[list[float]] | None = None,
        compute_bound_share: float = 0.85,
        lease_dir: str | None = None,
        strict: bool = False,
        **kwargs: Any,
    ) -> None:
        problems = []
        if schedule not in _SCHEDULE_CLASSES:
            problems.append(f"schedule={schedule!r}: allowed: {sorted(_SCHEDULE_CLASSES)}")
        if microbatches < 1 or virtual_stages < 1:
            problems.append(
                f"microbatches={microbatches}, virtual_stages={virtual_stages}: must be >= 1"
            )
        if problems:
            raise ConfigError(problems, source=type(self).__name__)
        super().__init__(**kwargs)
        self._init_gpu_options(
            profile_clocks_mhz,
            device_backend,
            simulated_gpu,
            compute_bound_share,
            lease_dir,
            strict,
        )
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.virtual_stages = virtual_stages
        self.plan_path = plan
        self.target_time_s = target_time_s
        self.warmup_iterations = warmup_iterations
        self.iterations_per_clock = iterations_per_clock
        self.replan_every_iterations = replan_every_iterations
        self.simulated_stage_times_s = simulated_stage_times_s
        self.runtime: PipelineRuntime | None = None
        self.online: OnlinePerseus | None = None
        self._pipe: Any = None
        self._has_first = self._has_last = False

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every pipeline rank reads the same batches."""
        return {"num_replicas": 1, "rank": 0}

    def configure_ddp(self) -> None:
        """Pipeline parallel: no DDP wrapper, each rank owns its stages' parameters."""

    def setup(self, trainer: Any) -> None:
        """Set up as DDP does (process group, devices, optimizers), then the pipeline."""
        super().setup(trainer)  # type: ignore[misc]
        self._build_pipeline()

    def _schedule(self) -> PipelineSchedule:
        return build_schedule(
            self.schedule_name,
            self.world_size * self.virtual_stages,
            self.microbatches,
            virtual_stages=self.virtual_stages,
        )

    def model_to_device(self) -> None:
        """Place only this rank's stages on its device; the other ranks' stay on the CPU."""
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            return  # reported by _build_pipeline
        schedule = self._schedule()
        stages = list(module.pipeline_stages())
        if len(stages) != schedule.num_stages:
            return  # reported by _build_pipeline
        for s, stage in enumerate(stages):
            if schedule.device_of(s) == self.global_rank:
                stage.to(self.root_device)

    def _build_pipeline(self) -> None:
        module = self.lightning_module
        if not isinstance(module, PipelineModule):
            raise ConfigError(
                f"{type(module).__name__} must define pipeline_stages() and pipeline_loss() "
                f"to be trained with {type(self).__name__}"
            )
        stages = list(module.pipeline_stages())
        ranks = self.world_size
        schedule = self._schedule()
        if len(stages) != schedule.num_stages:
            raise ConfigError(
                f"pipeline_stages() returned {len(stages)} stages; {ranks} ranks x "
                f"{self.virtual_stages} virtual stages need {schedule.num_stages}"
            )
        rank = self.global_rank
        gpu, guard = self._open_gpu(SimulatedSpec(gpu=self.simulated_gpu, count=max(ranks, 1)))
        simulation = None
        if isinstance(gpu, SimulatedGPU):
            times = self.simulated_stage_times_s or [[0.02, 0.04]] * schedule.num_stages
            works = {
                (s, kind): StageWork(times[s][k], self.compute_bound_share)
                for s in range(schedule.num_stages)
                if schedule.device_of(s) == rank
                for k, kind in enumerate(("forward", "backward"))
            }
            simulation = PipelineSimulation(gpu, works, group=self._cpu_group)
        self.runtime = PipelineRuntime(
            schedule, rank, ClockController(guard, gpu=gpu), simulation=simulation, record=False
        )
        local = [s for s in range(schedule.num_stages) if schedule.device_of(s) == rank]
        pipeline_stages = [
            PerseusPipelineStage(
                stages[s], s, schedule.num_stages, self.root_device, runtime=self.runtime
            )
            for s in local
        ]
        self._has_first = 0 in local
        self._has_last = schedule.num_stages - 1 in local
        cls = _SCHEDULE_CLASSES[self.schedule_name]
        self._pipe = cls(
            pipeline_stages if len(pipeline_stages) > 1 else pipeline_stages[0],
            n_microbatches=self.microbatches,
            loss_fn=module.pipeline_loss,
        )
        if self.plan_path is not None:
            self.runtime.set_plan(Plan.load(self.plan_path))
            return
        clock: Callable[[], float] = (
            gpu.clock.now if isinstance(gpu, SimulatedGPU) else time.perf_counter
        )
        self.online = OnlinePerseus(
            self.runtime,
            gpu,
            supported_clocks_mhz=gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=self.profile_clocks_mhz,
            warmup_iterations=self.warmup_iterations,
            iterations_per_clock=self.iterations_per_clock,
            target_time_s=self.target_time_s,
            replan_every_iterations=self.replan_every_iterations,
            group=self._cpu_group,
            clock=clock,
        )

    def set_target_time(self, target_s: float | None) -> None:
        """Re-plan for ``target_s`` at the next iteration (rank 0's value counts)."""
        self.target_time_s = target_s
        if self.online is not None:
            self.online.set_target_time(target_s)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One pipeline step (all microbatches' forwards and backwards) at the planned
        clocks; returns the mean microbatch loss (the same on every rank)."""
        assert self._pipe is not None and self.runtime is not None
        inputs, target = args[0]
        if self.online is not None:
            self.online.on_iteration_start()
        losses: list[torch.Tensor] = []
        step_args = (inputs,) if self._has_first else ()
        step_kwargs: dict[str, Any] = {}
        if self._has_last:
            step_kwargs = {"target": target, "losses": losses}
        self._pipe.step(*step_args, **step_kwargs)
        if self.online is not None:
            self.online.on_iteration_end()
        else:
            self.runtime.end_iteration()
        loss = torch.stack(losses).mean().detach().cpu() if losses else torch.zeros(())
        if dist.is_initialized():
            last = self.runtime.schedule.device_of(self.runtime.schedule.num_stages - 1)
            dist.broadcast(loss, src=last, group=self._cpu_group)
        module = self.lightning_module
        assert module is not None
        module.log("train_loss", loss, prog_bar=True)
        return loss

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Nothing to do: the pipeline schedule ran every backward in ``training_step``."""
        return closure_loss

    def _restore(self) -> None:
        """Reset the clocks, then restore the GPU."""
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
        super()._restore()


class PerseusDDPCore(PerseusStrategyCore):
    """DDP whose faster ranks finish their compute with the straggler; see
    :class:`lightning_energy.perseus.lightning.PerseusDDPStrategy` for the arguments.
    """

    strategy_name = "perseus_ddp"

    def __init__(
        self,
        *,
        window_steps: int = 10,
        steps_per_clock: int = 2,
        margin: float = 0.01,
        profile_clocks_mhz: list[int] | None = None,
        device_backend: str | None = None,
        simulated_gpu: str = "a100",
        simulated_step_s: float = 0.2,
        compute_bound_share: float = 0.85,
        slowdowns: list[float] | None = None,
        lease_dir: str | None = None,
        strict: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._init_gpu_options(
            profile_clocks_mhz,
            device_backend,
            simulated_gpu,
            compute_bound_share,
            lease_dir,
            strict,
        )
        self.window_steps = window_steps
        self.steps_per_clock = steps_per_clock
        self.margin = margin
        self.simulated_step_s = simulated_step_s
        self.slowdowns = tuple(slowdowns or ())
        self.equalizer: StragglerEqualizer | None = None
        self._simulation: SimulatedDataParallel | None = None
        self._probe: _CudaComputeProbe | None = None

    def setup(self, trainer: Any) -> None:
        """Set up DDP, then this rank's GPU, guard and equalizer."""
        super().setup(trainer)  # type: ignore[misc]
        spec = SimulatedSpec(
            gpu=self.simulated_gpu,
            count=max(self.world_size, len(self.slowdowns), 1),
            slowdowns=self.slowdowns,
        )
        gpu, guard = self._open_gpu(spec)
        self.equalizer = StragglerEqualizer(
            guard,
            gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=self.profile_clocks_mhz,
            steps_per_clock=self.steps_per_clock,
            window_steps=self.window_steps,
            margin=self.margin,
            counter_period_s=gpu.energy_counter_period_s(),
            group=self._cpu_group,
        )
        if isinstance(gpu, SimulatedGPU):
            work = StageWork(self.simulated_step_s, self.compute_bound_share)
            self._simulation = SimulatedDataParallel(gpu, work, group=self._cpu_group)
        elif torch.cuda.is_available():
            self._probe = _CudaComputeProbe(self.model, gpu, self.equalizer)
        else:
            log.warning(
                "%s: no CUDA and no simulated GPU; ranks not equalised.", type(self).__name__
            )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Mark the step start (real GPUs), then the usual training step."""
        if self._probe is not None:
            self._probe.step_start()
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        """The usual optimizer step, then report the step and re-evaluate the clock."""
        out = super().optimizer_step(*args, **kwargs)  # type: ignore[misc]
        if self.equalizer is None:
            return out
        if self._simulation is not None:
            compute_s = self._simulation.compute()
            self.equalizer.record_step(compute_s, self._simulation.all_reduce())
        elif self._probe is not None:
            measured = self._probe.step_end()
            if measured is None:
                return out
            self.equalizer.record_step(*measured)
        else:
            return out
        self.equalizer.on_step_end()
        return out


class _CudaComputeProbe:
    """Times a rank's compute on a CUDA GPU: from the step start to when DDP's last
    gradient bucket is ready (before the all-reduce waits for other ranks).

    While the equalizer profiles, it synchronises the compute stream at both points to
    read the energy counter; afterwards it only records CUDA events and reads them one step
    later, so the CPU never waits for the GPU.
    """

    def __init__(self, ddp_model: Any, gpu: GPU, equalizer: StragglerEqualizer) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.gpu = gpu
        self.equalizer = equalizer
        self._allreduce = allreduce_hook
        self._start: tuple[float, float] | None = None
        self._end: tuple[float, float] | None = None
        self._events: tuple[Any, Any] | None = None
        self._pending: tuple[Any, Any] | None = None
        ddp_model.register_comm_hook(None, self._hook)

    def step_start(self) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self._events = (start, None)
        if self.equalizer.profiling:
            torch.cuda.current_stream().synchronize()
            self._start = (time.perf_counter(), self.gpu.energy_j())

    def _hook(self, state: Any, bucket: Any) -> Any:
        if bucket.is_last() and self._events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (self._events[0], end)
            if self.equalizer.profiling:
                torch.cuda.current_stream().synchronize()
                self._end = (time.perf_counter(), self.gpu.energy_j())
        return self._allreduce(state, bucket)

    def step_end(self) -> tuple[float, StepReadings | None] | None:
        """``(compute_s, counter readings while profiling)`` of a finished step, or None."""
        if self.equalizer.profiling and self._start is not None and self._end is not None:
            torch.cuda.synchronize()
            now = (time.perf_counter(), self.gpu.energy_j())
            start, end = self._start, self._end
            self._start = self._end = None
            return end[0] - start[0], (start, end, now)
        previous, self._pending = self._pending, self._events
        if previous is None or previous[1] is None or not previous[1].query():
            return None
        return previous[0].elapsed_time(previous[1]) / 1000.0, None


def register_perseus_strategies(registry: Any, pipeline_class: type, ddp_class: type) -> None:
    """Register ``perseus_pipeline`` and ``perseus_ddp`` in a namespace's ``StrategyRegistry``."""
    registry.register(
        PerseusPipelineCore.strategy_name,
        pipeline_class,
        description="Pipeline parallel with per-instruction GPU clocks (Perseus)",
    )
    registry.register(
        PerseusDDPCore.strategy_name,
        ddp_class,
        description="DDP with straggler-aware GPU clocks (Perseus)",
    )
