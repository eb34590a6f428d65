"""Perseus and energy measurement for DeepSpeed's pipeline engine, in one line.

An existing ``PipelineEngine`` (what ``deepspeed.initialize`` returns for a
``PipelineModule``) gets per-instruction GPU clocks, online profiling and planning,
carbon pacing and the run report::

    import deepspeed
    from lightning_energy.integrations.deepspeed import attach_energy

    engine, _, _, _ = deepspeed.initialize(model=pipeline_module, config=ds_config, ...)
    with attach_energy(engine, config="energy.yaml") as energy:   # or $LIGHTNING_ENERGY_CONFIG
        for _ in range(steps):
            engine.train_batch(data_iter)       # one Perseus iteration, one energy step

What :func:`attach_energy` wires up, on this engine instance only (other engines and the
DeepSpeed classes are left alone):

* the schedule: DeepSpeed's own ``TrainSchedule`` is walked for every stage (its
  ``ForwardPass`` / ``BackwardPass`` instructions, the micro-batch of each from the
  schedule's step -> micro-batch mapping) and turned into Perseus' instruction DAG
  (DeepSpeed's synchronous 1F1B);
* the instructions: the engine's ``_INSTRUCTION_MAP`` gets an instance-level copy whose
  forward and backward passes run between the pipeline's ``before`` / ``after``; the
  micro-batch of each comes from the schedule step the engine is executing, so the order
  Perseus checks after the first iteration is the order the engine actually ran;
* the iterations: ``train_batch`` is one iteration (a controller step too); ``eval_batch``
  is none, and the profiling window in progress leaves it out;
* the end: :meth:`DeepSpeedEnergy.close` or the end of the ``with`` block restores the
  clocks and power limits and writes the report; an exception raised by ``train_batch``
  restores them at once (without a collective) and propagates. The hooks are removed in
  both cases.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule
from typing_extensions import override

from lightning_energy.config import EnergyConfig
from lightning_energy.errors import ConfigError
from lightning_energy.integrations._pipeline_engine import PipelineEngineAdapter
from lightning_energy.integrations.adapter import count_parameters, workload_key
from lightning_energy.perseus.planning.profile import BACKWARD, FORWARD
from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule
from lightning_energy.perseus.runtime.pipeline_run import schedule_from_orders

__all__ = ["DeepSpeedEnergy", "attach_energy", "train_schedule"]

log = logging.getLogger(__name__)

ConfigLike = str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig

_KINDS: dict[type, str] = {ForwardPass: FORWARD, BackwardPass: BACKWARD}
#: The engine's attributes the attachment sets on the instance (never on the class).
_HOOKED = ("_INSTRUCTION_MAP", "_train_schedule", "train_batch", "eval_batch")


def _instruction(schedule: TrainSchedule, step_id: int, kind: str) -> Instruction:
    """The forward or backward a schedule step runs, by the schedule's own mapping."""
    microbatch, _ = schedule._step_to_micro_batch(step_id)
    return Instruction(schedule.stage_id, microbatch, kind)


def _stage_order(schedule: TrainSchedule) -> Iterator[Instruction]:
    for step_id, commands in enumerate(schedule.steps()):
        for command in commands:
            kind = _KINDS.get(type(command))
            if kind is not None:
                yield _instruction(schedule, step_id, kind)


def train_schedule(micro_batches: int, stages: int) -> PipelineSchedule:
    """Perseus' schedule of DeepSpeed's ``TrainSchedule``, built from DeepSpeed's own steps.

    Args:
        micro_batches: micro-batches per batch (the engine's gradient accumulation steps).
        stages: pipeline stages (one per pipeline rank).

    Raises:
        ConfigError: a count below 1, or an order that does not form a schedule.

    Example:
        >>> [str(i) for i in train_schedule(3, 2).device_orders[1]]
        ['F1.0', 'B1.0', 'F1.1', 'B1.1', 'F1.2', 'B1.2']
    """
    problems = [
        f"{key}: {value!r} is not allowed; use an integer >= 1"
        for key, value in (("micro_batches", micro_batches), ("stages", stages))
        if value < 1
    ]
    if problems:
        raise ConfigError(problems, source="DeepSpeed TrainSchedule")
    orders = [
        tuple(_stage_order(TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=s)))
        for s in range(stages)
    ]
    return schedule_from_orders("1f1b", orders, num_microbatches=micro_batches)


def _check_engine(engine: Any) -> None:
    """Raise a ConfigError naming every reason ``engine`` cannot be driven."""
    if not isinstance(engine, PipelineEngine):
        raise ConfigError(
            f"engine: {type(engine).__name__} is not allowed; use the PipelineEngine that "
            "deepspeed.initialize returns for a deepspeed.pipe.PipelineModule",
            source="attach_energy",
        )
    problems = []
    schedule = engine._train_schedule()
    if type(schedule) is not TrainSchedule:
        problems.append(
            f"schedule: {type(schedule).__name__} is not allowed; use DeepSpeed's "
            "TrainSchedule (the PipelineEngine's default, synchronous 1F1B)"
        )
    grid = engine.grid
    if grid.data_parallel_size != 1:
        problems.append(
            f"data parallel size: {grid.data_parallel_size} is not allowed; use 1 "
            "(one process per pipeline stage)"
        )
    if grid.model_parallel_size != 1:
        problems.append(
            f"model (tensor) parallel size: {grid.model_parallel_size} is not allowed; use 1"
        )
    if isinstance(vars(engine).get("train_batch"), _TrainBatch):
        problems.append("engine: energy optimisation is already attached to this engine")
    if problems:
        raise ConfigError(problems, source="attach_energy")


class _TrainBatch:
    """The engine's ``train_batch``, run as one Perseus iteration (marks the attachment)."""

    def __init__(self, energy: DeepSpeedEnergy, original: Callable[..., Any]) -> None:
        self._energy = energy
        self._original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._energy._train_batch(self._original, *args, **kwargs)


class DeepSpeedEnergy(PipelineEngineAdapter):
    """Perseus and energy measurement on one DeepSpeed ``PipelineEngine``.

    Built by :func:`attach_energy`, which starts it; use it as a context manager or call
    :meth:`close` after the last ``train_batch``.

    Args:
        engine: the job's ``PipelineEngine``.
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``; None reads
            the file named by ``LIGHTNING_ENERGY_CONFIG``, else uses defaults.
        total_steps: the ``train_batch`` calls the job will run (a carbon deadline needs it).
        stage_times_s: simulated GPUs only: ``[forward, backward]`` seconds at the maximum
            clock of one micro-batch on each stage (None: 20 ms and 40 ms everywhere).
        **sections: ``device``, ``carbon``, ``perseus``, ``strict``, ``report``
            overriding the configuration's.

    Attributes:
        engine: the engine.
        schedule: the instruction DAG of the engine's ``TrainSchedule``.

    Raises:
        ConfigError: ``engine`` is not a ``PipelineEngine``, runs another schedule than
            ``TrainSchedule``, has data or tensor parallelism, or an enabled ``perseus:``
            section asks for another schedule or virtual stages.
    """

    def __init__(
        self,
        engine: Any,
        config: ConfigLike | None = None,
        *,
        total_steps: int | None = None,
        stage_times_s: Sequence[Sequence[float]] | None = None,
        **sections: Any,
    ) -> None:
        super().__init__(config, **sections)
        _check_engine(engine)
        section = self.config.perseus
        problems = []
        if section.enabled and section.schedule != "1f1b":
            problems.append(
                f"perseus.schedule: {section.schedule!r} is not allowed; use '1f1b' (DeepSpeed's "
                "TrainSchedule)"
            )
        if section.enabled and section.virtual_stages != 1:
            problems.append(
                f"perseus.virtual_stages: {section.virtual_stages!r} is not allowed; use 1 "
                "(DeepSpeed runs one stage per rank)"
            )
        if problems:
            raise ConfigError(problems, source="attach_energy")
        self.engine = engine
        self.schedule = train_schedule(engine.micro_batches, engine.num_stages)
        self._stage_times_s = stage_times_s
        self._total_steps = total_steps
        self._executing: tuple[TrainSchedule, int] | None = None
        self._shadowed: dict[str, Any] = {}
        self._hooked = False

    def start(self) -> None:
        """Open this rank's GPU, take its lease, start the run and hook the engine.

        Raises:
            ConfigError: invalid settings found when opening the GPU (e.g. a plan file for
                another schedule).
            EnergyError: strict mode, when the GPU cannot be controlled.
        """
        if self.running:
            return
        engine = self.engine
        self._begin_pipeline(
            schedule=self.schedule,
            global_rank=engine.global_rank,
            world_size=engine.grid.world_size,
            local_rank=engine.local_rank,
            device=torch.device(engine.device),
            workload=workload_key(
                batch_size=engine.train_micro_batch_size_per_gpu(),
                params=count_parameters(engine.module),
                micro_batches=engine.micro_batches,
                stages=engine.num_stages,
            ),
            total_steps=self._total_steps,
            stage_times_s=self._stage_times_s,
        )
        self._hook()

    # ------------------------------------------------------------------ hooks
    def _hook(self) -> None:
        engine = self.engine
        self._shadowed = {n: vars(engine)[n] for n in _HOOKED if n in vars(engine)}
        instruction_map = dict(engine._INSTRUCTION_MAP)
        for command, kind in _KINDS.items():
            instruction_map[command] = self._instruction_hook(kind, instruction_map[command])
        engine._INSTRUCTION_MAP = instruction_map
        engine._train_schedule = self._tracked_schedule(engine._train_schedule)
        engine.train_batch = _TrainBatch(self, engine.train_batch)
        engine.eval_batch = self._evaluation(engine.eval_batch)
        self._hooked = True

    def _unhook(self) -> None:
        """Put back the engine's own attributes (instance-level ones set before, if any)."""
        if not self._hooked:
            return
        self._hooked = False
        attributes = vars(self.engine)
        for name in _HOOKED:
            attributes.pop(name, None)
        attributes.update(self._shadowed)
        self._shadowed = {}
        self._executing = None

    def _evaluation(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The engine's ``eval_batch`` (every stage runs it), left out of the window."""

        def eval_batch(*args: Any, **kwargs: Any) -> Any:
            self._outside_training("evaluation")
            return original(*args, **kwargs)

        return eval_batch

    def _tracked_schedule(self, original: Callable[[], Any]) -> Callable[[], Any]:
        """The engine's ``_train_schedule``, recording which step the engine executes."""

        def train_schedule() -> Any:
            schedule = original()
            steps = schedule.steps

            def tracked_steps() -> Iterator[Any]:
                for step_id, commands in enumerate(steps()):
                    self._executing = (schedule, step_id)
                    yield commands
                self._executing = None

            schedule.steps = tracked_steps
            return schedule

        return train_schedule

    def _instruction_hook(self, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def run(engine: Any, buffer_id: int) -> Any:
            executing = self._executing
            if executing is None or self.pipeline is None:  # eval_batch, or no run open
                return original(engine, buffer_id)
            inst = _instruction(executing[0], executing[1], kind)
            self._before(inst)
            result = original(engine, buffer_id)
            self._after(inst)
            return result

        return run

    def _train_batch(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.running:
            return original(*args, **kwargs)
        if self.engine.micro_batches != self.schedule.num_microbatches:
            self._schedule_changed()
            return original(*args, **kwargs)

        def step() -> Any:
            loss = original(*args, **kwargs)
            self._executing = None
            return loss

        return self._run_iteration(step)

    def _schedule_changed(self) -> None:
        """The engine's micro-batch count changed (``set_train_batch_size``): the plan and
        the schedule no longer hold. End the run as :meth:`close` does (every rank changes
        its batch size: the totals' collective holds), with one warning; strict mode
        raises."""
        message = (
            f"the engine now runs {self.engine.micro_batches} micro-batches per batch, "
            f"Perseus' schedule has {self.schedule.num_microbatches}: call attach_energy "
            "again after set_train_batch_size"
        )
        self._finish()
        if self.config.strict:
            raise ConfigError(message, source="attach_energy")
        log.warning("Perseus and energy measurement stopped: %s.", message)

    # -------------------------------------------------------------- lifecycle
    @override
    def _finish(self) -> Any:
        self._unhook()
        return super()._finish()

    @override
    def _abort(self, failure: str) -> Any:
        self._unhook()
        return super()._abort(failure)


def attach_energy(
    engine: Any,
    config: ConfigLike | None = None,
    *,
    total_steps: int | None = None,
    stage_times_s: Sequence[Sequence[float]] | None = None,
    **sections: Any,
) -> DeepSpeedEnergy:
    """Attach Perseus and energy measurement to a DeepSpeed ``PipelineEngine``.

    Call it once per process, after ``deepspeed.initialize`` and before the first
    ``train_batch``. The GPU is opened and the configuration validated here, so a bad
    configuration fails before training.

    Args:
        engine: the ``PipelineEngine`` (pipeline parallelism only: data and tensor
            parallel sizes of 1, DeepSpeed's ``TrainSchedule``).
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``; None reads
            the file named by ``LIGHTNING_ENERGY_CONFIG``, else uses defaults.
        total_steps: the ``train_batch`` calls the job will run (a carbon deadline needs it).
        stage_times_s: simulated GPUs only: ``[forward, backward]`` seconds at the maximum
            clock of one micro-batch on each stage.
        **sections: ``device``, ``carbon``, ``perseus``, ``strict`` or ``report``
            overriding the configuration's sections.

    Returns:
        The started attachment: a context manager; or call :meth:`DeepSpeedEnergy.close`.

    Raises:
        ConfigError: what cannot be driven (see :class:`DeepSpeedEnergy`), or an invalid
            configuration.
        EnergyError: strict mode, when the GPU cannot be controlled.
    """
    energy = DeepSpeedEnergy(
        engine, config, total_steps=total_steps, stage_times_s=stage_times_s, **sections
    )
    energy.start()
    return energy
