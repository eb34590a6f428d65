"""Perseus for Megatron-Core pipelines: per-instruction GPU clocks in its 1F1B schedules.

:class:`MegatronEnergy` wraps the function Megatron-Core's ``get_forward_backward_func()``
returns (1F1B, ``forward_backward_pipelining_without_interleaving``, or interleaved 1F1B,
``forward_backward_pipelining_with_interleaving``). Each call of the wrapped function is
one training iteration: the instruction DAG comes from Megatron-Core's own schedule
(:func:`megatron_schedule`), and while the call runs ``schedules.forward_step`` and
``schedules.backward_step`` are wrapped so every forward and backward of this rank runs at
its planned clock. The rest (online profiling, plans agreed across ranks, clocks applied
off the training thread, carbon pacing, restoring the GPUs) is the engine-agnostic
pipeline core's.

With ``kareus=`` (a :class:`~lightning_energy.kareus.megatron_layer.KareusMegatron` whose
layer spec built the model) every forward and backward also runs at its Kareus
settings, and a Kareus plan's clocks are the Perseus plan: one plan drives both.
Online profiling needs a pure pipeline; with tensor (or data) parallelism the clocks come
from a plan (Kareus' or ``perseus.plan``), the same on every rank of a stage.

Example (every rank, after ``parallel_state.initialize_model_parallel``)::

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from lightning_energy.integrations.megatron import MegatronEnergy

    energy = MegatronEnergy("energy.yaml")  # None: $LIGHTNING_ENERGY_CONFIG
    forward_backward = energy.wrap(get_forward_backward_func())
    with energy:  # restores every GPU at the end, also when training raises
        for _ in range(train_iters):
            forward_backward(forward_step_func=forward_step, data_iterator=data,
                             model=model, num_microbatches=8, seq_length=1024,
                             micro_batch_size=2)
            optimizer.step()
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_energy.collectives import replicate_group
from lightning_energy.config import EnergyConfig
from lightning_energy.device import current_torch_device
from lightning_energy.errors import ConfigError
from lightning_energy.integrations._pipeline_engine import PipelineEngineAdapter
from lightning_energy.integrations.adapter import workload_key
from lightning_energy.perseus.planning.profile import BACKWARD, FORWARD
from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule
from lightning_energy.perseus.runtime.pipeline_run import schedule_from_orders

if TYPE_CHECKING:
    from lightning_energy.kareus.megatron_layer import KareusMegatron

__all__ = ["SCHEDULE_FUNCTIONS", "MegatronEnergy", "megatron_schedule"]

#: The Megatron-Core functions :meth:`MegatronEnergy.wrap` takes, and their schedules.
SCHEDULE_FUNCTIONS = {
    "forward_backward_pipelining_without_interleaving": "1f1b",
    "forward_backward_pipelining_with_interleaving": "megatron_interleaved_1f1b",
}


def _warmup_microbatches(
    name: str, pipeline_ranks: int, rank: int, total: int, virtual_stages: int, group_size: int
) -> int:
    """Forwards a rank runs before its first backward (``get_pp_rank_microbatches``)."""
    warmup = pipeline_ranks - rank - 1
    if name == "megatron_interleaved_1f1b":
        warmup = warmup * 2 + (virtual_stages - 1) * group_size
    return min(warmup, total)


def _table_to_order() -> Callable[[int, int, Sequence[tuple[int, int]]], list[int]]:
    """Megatron-Core's ``convert_schedule_table_to_order`` (in ``schedules`` in 0.12, in
    ``transformer.cuda_graphs`` in later versions)."""
    from megatron.core.pipeline_parallel import schedules

    convert = getattr(schedules, "convert_schedule_table_to_order", None)
    if convert is None:
        from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

        convert = convert_schedule_table_to_order
    return convert


def megatron_schedule(
    name: str,
    *,
    pipeline_ranks: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    microbatch_group_size: int | None = None,
) -> PipelineSchedule:
    """The schedule Megatron-Core runs, from its own schedule table.

    Each rank's order is Megatron-Core's: ``get_schedule_table`` (which model chunk and
    micro-batch the k-th forward runs) turned into a rank's forward/backward order by
    ``convert_schedule_table_to_order`` with the rank's warmup forwards. Model chunk ``v``
    on pipeline rank ``r`` is stage ``v * pipeline_ranks + r``. Megatron-Core's 1F1B runs
    the orders of :func:`~lightning_energy.perseus.planning.schedule.one_f_one_b` (hence the same
    name); its interleaved orders are its own, under a name of their own, so a plan for
    ``torch.distributed.pipelining``'s interleaved 1F1B is never applied to them.

    Args:
        name: ``"1f1b"`` or ``"megatron_interleaved_1f1b"``.
        pipeline_ranks: the pipeline-parallel size.
        num_microbatches: micro-batches per iteration.
        virtual_stages: model chunks per rank (interleaved only).
        microbatch_group_size: ``microbatch_group_size_per_vp_stage`` of the model config
            (interleaved only; None: ``pipeline_ranks``, Megatron-Core's default).

    Raises:
        ConfigError: an unknown name or a count out of range.
    """
    from megatron.core.pipeline_parallel import schedules

    group_size = microbatch_group_size or pipeline_ranks
    problems = []
    if name not in SCHEDULE_FUNCTIONS.values():
        problems.append(
            f"schedule: {name!r} is not allowed; use {sorted(set(SCHEDULE_FUNCTIONS.values()))}"
        )
    if pipeline_ranks < 2:
        problems.append(f"pipeline_ranks: {pipeline_ranks} is not allowed; use >= 2")
    if num_microbatches < 1:
        problems.append(f"num_microbatches: {num_microbatches} is not allowed; use >= 1")
    if virtual_stages < 1 or (name == "1f1b" and virtual_stages != 1):
        allowed = "1 for 1f1b" if name == "1f1b" else ">= 1"
        problems.append(f"virtual_stages: {virtual_stages} is not allowed; use {allowed}")
    if group_size < 1:
        problems.append(f"microbatch_group_size: {group_size} is not allowed; use >= 1")
    if problems:
        raise ConfigError(problems, source="Megatron-Core schedule")
    if name == "1f1b":
        group_size = num_microbatches
    table = schedules.get_schedule_table(num_microbatches, virtual_stages, group_size)
    convert = _table_to_order()
    total = num_microbatches * virtual_stages
    orders = []
    for rank in range(pipeline_ranks):
        warmup = _warmup_microbatches(name, pipeline_ranks, rank, total, virtual_stages, group_size)
        seen: dict[tuple[int, str], int] = {}
        order = []
        for value in convert(warmup, virtual_stages, table):
            # Forwards are +(chunk + 1), backwards -(chunk + 1); each chunk runs its
            # micro-batches in ascending order, both ways.
            chunk, kind = abs(value) - 1, FORWARD if value > 0 else BACKWARD
            microbatch = seen.get((chunk, kind), 0)
            seen[(chunk, kind)] = microbatch + 1
            order.append(Instruction(chunk * pipeline_ranks + rank, microbatch, kind))
        orders.append(order)
    return schedule_from_orders(name, orders, num_microbatches=num_microbatches)


def _schedule_name(forward_backward_func: Callable[..., Any]) -> str:
    """The schedule of a Megatron-Core forward-backward function.

    Raises:
        ConfigError: any other function.
    """
    name = SCHEDULE_FUNCTIONS.get(getattr(forward_backward_func, "__name__", ""))
    if name is None or not getattr(forward_backward_func, "__module__", "").startswith(
        "megatron.core"
    ):
        got = getattr(forward_backward_func, "__qualname__", repr(forward_backward_func))
        raise ConfigError(
            f"forward_backward_func: {got} is not allowed; use one of Megatron-Core's "
            f"pipeline schedules {sorted(SCHEDULE_FUNCTIONS)} "
            "(get_forward_backward_func() with pipeline_model_parallel_size >= 2)",
            source="MegatronEnergy",
        )
    return name


class MegatronEnergy(PipelineEngineAdapter):
    """Energy accounting and Perseus clocks for Megatron-Core pipeline schedules.

    Wrap Megatron-Core's forward-backward function with :meth:`wrap` and call the result
    as the original, once per training iteration. The ``perseus:`` section applies
    (``plan``, online profiling, ``target_time_s``...); the schedule, micro-batches and
    virtual stages are Megatron-Core's, not the section's. ``forward_only`` calls
    (evaluation) run untouched. The first call opens the run (its schedule: that call's
    micro-batches and model chunks); end it with :meth:`close` or a ``with`` block (also
    on an exception inside a call). A call after the end opens a new run.

    Args:
        config: a YAML path, a mapping of the YAML schema or an ``EnergyConfig``; None
            reads the file named by ``LIGHTNING_ENERGY_CONFIG``, else uses defaults.
        device: the ``device:`` section (overrides the file's).
        carbon: the ``carbon:`` section (overrides the file's).
        perseus: the ``perseus:`` section (overrides the file's).
        strict: raise instead of observing when GPU settings cannot be changed, or when
            the executed order leaves the schedule.
        report: write the run report (JSON) to this path at the end.
        stage_times_s: simulated GPUs: ``[forward, backward]`` seconds at the maximum clock
            of one micro-batch on each stage (all virtual stages, in stage order).
        total_steps: iterations the run will train (None: unknown), for carbon pacing.
        kareus: the Kareus runtime whose layers the model runs: each instruction runs at
            its plan's settings, and the plan's clocks replace ``perseus.plan`` (Perseus
            is then enabled).

    Raises:
        ConfigError: invalid configuration, raised here, before training starts.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | EnergyConfig | None = None,
        *,
        device: dict[str, Any] | None = None,
        carbon: dict[str, Any] | None = None,
        perseus: dict[str, Any] | None = None,
        strict: bool | None = None,
        report: str | None = None,
        stage_times_s: Sequence[Sequence[float]] | None = None,
        total_steps: int | None = None,
        kareus: KareusMegatron | None = None,
    ) -> None:
        planned = kareus is not None and kareus.settings is not None
        if planned:
            perseus = {**(perseus or {}), "enabled": True}
        super().__init__(
            config, device=device, carbon=carbon, perseus=perseus, strict=strict, report=report
        )
        if planned and self.config.perseus.plan is not None:
            raise ConfigError(
                f"perseus.plan: {self.config.perseus.plan!r} is not allowed with a Kareus "
                "plan; use null (the Kareus plan's clocks apply)",
                source="MegatronEnergy",
            )
        self.kareus = kareus
        self.stage_times_s = stage_times_s
        self.total_steps = total_steps
        self._shape = (0, 0)  # the open run's (micro-batches, model chunks)
        self._chunks: list[Any] = []
        self._pipeline_rank = 0
        self._pipeline_ranks = 1
        self._outputs: dict[int, tuple[Any, Instruction]] = {}

    def wrap(self, forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
        """The forward-backward function, running at the planned clocks.

        Args:
            forward_backward_func: what ``get_forward_backward_func()`` returned.

        Raises:
            ConfigError: not one of Megatron-Core's pipeline schedules.
        """
        name = _schedule_name(forward_backward_func)

        @functools.wraps(forward_backward_func)
        def forward_backward(**kwargs: Any) -> Any:
            if kwargs.get("forward_only", False):  # evaluation: no training step
                self._outside_training("evaluation")
                return forward_backward_func(**kwargs)
            return self._iteration(forward_backward_func, name, kwargs)

        return forward_backward

    # ------------------------------------------------------------------ calls
    def _iteration(self, func: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> Any:
        try:
            self._prepare(name, kwargs)
        except BaseException as exc:
            self._abort(type(exc).__name__)
            raise

        def step() -> Any:
            with self._hooks():
                return func(**kwargs)

        return self._run_iteration(step)

    def _prepare(self, name: str, kwargs: Mapping[str, Any]) -> None:
        """Check the call and, at the first one, open the run with its schedule.

        Raises:
            ConfigError: what Perseus cannot run, naming what it can.
        """
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        model = kwargs.get("model")
        chunks: list[Any] = list(model) if isinstance(model, list) else [model]
        given = kwargs.get("num_microbatches")
        num_microbatches = given if isinstance(given, int) else 0
        # Newer Megatron-Core may take the pipeline group in p2p_communicator.
        group = getattr(kwargs.get("p2p_communicator"), "pp_group", None)
        problems = []
        if not dist.is_initialized() or (
            group is None and not parallel_state.model_parallel_is_initialized()
        ):
            problems.append(
                "torch.distributed and Megatron-Core's parallel_state must be initialised "
                "before the first forward_backward call"
            )
        if num_microbatches < 1:
            problems.append(f"num_microbatches: {given!r} is not allowed; use >= 1")
        micro_batch_size = kwargs.get("micro_batch_size")
        if self.kareus is not None and isinstance(micro_batch_size, int) and micro_batch_size % 2:
            problems.append(
                f"micro_batch_size: {micro_batch_size} is not allowed with Kareus; use an even "
                "number (two nano-batches)"
            )
        if problems:
            raise ConfigError(problems, source="MegatronEnergy")
        if group is None:
            group = parallel_state.get_pipeline_model_parallel_group()
        config = get_model_config(chunks[0])
        if getattr(config, "overlap_moe_expert_parallel_comm", False):
            problems.append(
                "overlap_moe_expert_parallel_comm: True is not allowed; use False (the "
                "combined 1F1B schedule runs a forward and a backward as one instruction)"
            )
        ranks, world = dist.get_world_size(group), dist.get_world_size()
        planned = self.config.perseus.plan is not None or (
            self.kareus is not None and self.kareus.settings is not None
        )
        if ranks != world and self.config.perseus.enabled and not planned:
            problems.append(
                f"pipeline_model_parallel_size: {ranks} of {world} processes is not allowed "
                "with online profiling; use pure pipeline parallelism (tensor, context and "
                "data parallel sizes 1), or give a plan (perseus.plan, or a Kareus plan)"
            )
        if problems:
            raise ConfigError(problems, source="MegatronEnergy")
        self._chunks = chunks
        shape = (num_microbatches, len(chunks))
        if self.running:
            if shape != self._shape:
                raise ConfigError(
                    f"num_microbatches={shape[0]} with {shape[1]} model chunks is not "
                    f"allowed; use the run's values ({self._shape[0]} and "
                    f"{self._shape[1]}): one run plans one schedule",
                    source="MegatronEnergy",
                )
            return
        self._pipeline_rank, self._pipeline_ranks = dist.get_rank(group), ranks
        schedule = megatron_schedule(
            name,
            pipeline_ranks=ranks,
            num_microbatches=num_microbatches,
            virtual_stages=len(chunks),
            microbatch_group_size=getattr(config, "microbatch_group_size_per_vp_stage", None),
        )
        plan = None
        if self.kareus is not None:
            self.kareus.check_model(
                chunks, [v * ranks + self._pipeline_rank for v in range(len(chunks))]
            )
            plan = self.kareus.clock_plan(schedule)
        self._begin_pipeline(
            schedule=schedule,
            global_rank=dist.get_rank(),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            device=_device(chunks),
            workload=workload_key(
                batch_size=micro_batch_size if isinstance(micro_batch_size, int) else None,
                params=sum(p.numel() for chunk in chunks for p in chunk.parameters()),
                seq_length=kwargs.get("seq_length"),
                num_microbatches=num_microbatches,
                pipeline_ranks=ranks,
                virtual_stages=len(chunks),
            ),
            total_steps=self.total_steps,
            stage_times_s=self.stage_times_s,
            pipeline_rank=self._pipeline_rank,
            pipeline_group=None if ranks == world else _gloo(group),
            plan=plan,
        )
        self._shape = shape

    # ------------------------------------------------------------------ hooks
    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        """Wrap ``schedules.forward_step`` / ``backward_step`` while the block runs."""
        from megatron.core.pipeline_parallel import schedules

        forward, backward = schedules.forward_step, schedules.backward_step
        schedules.forward_step = self._forward_hook(forward)
        schedules.backward_step = self._backward_hook(backward)
        try:
            yield
        finally:
            schedules.forward_step, schedules.backward_step = forward, backward
            self._outputs.clear()

    def _settings(self, inst: Instruction) -> contextlib.AbstractContextManager[None]:
        """``inst``'s Kareus settings while it runs (nothing without Kareus)."""
        return contextlib.nullcontext() if self.kareus is None else self.kareus.instruction(inst)

    def _forward_hook(self, forward_step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward_step)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            model = kwargs["model"] if "model" in kwargs else args[2]
            chunk = next((v for v, c in enumerate(self._chunks) if c is model), None)
            microbatch = kwargs.get("current_microbatch")
            if chunk is None or microbatch is None:
                # Not an instruction of the schedule: the executed order says so.
                return forward_step(*args, **kwargs)
            inst = Instruction(
                chunk * self._pipeline_ranks + self._pipeline_rank, microbatch, FORWARD
            )
            self._before(inst)
            with self._settings(inst):
                output = forward_step(*args, **kwargs)
            self._after(inst)
            # The backward receives this very object (the backward step has no micro-batch).
            self._outputs[id(output[0])] = (output[0], inst)
            return output

        return hooked

    def _backward_hook(self, backward_step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward_step)
        def hooked(*args: Any, **kwargs: Any) -> Any:
            output = kwargs["output_tensor"] if "output_tensor" in kwargs else args[1]
            entry = self._outputs.pop(id(output), None)
            if entry is None:
                return backward_step(*args, **kwargs)
            inst = Instruction(entry[1].stage, entry[1].microbatch, BACKWARD)
            self._before(inst)
            with self._settings(inst):
                grad = backward_step(*args, **kwargs)
            self._after(inst)
            return grad

        return hooked


def _gloo(group: Any) -> Any:
    """A group of the same ranks that takes CPU tensors (a gloo copy of an NCCL group,
    created on every rank at the same point)."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    return replicate_group(group, backend="gloo")


def _device(chunks: Sequence[torch.nn.Module]) -> torch.device:
    """Where Megatron-Core computes: the device of the model chunks' parameters (the
    current device when they have none)."""
    for chunk in chunks:
        for parameter in chunk.parameters():
            return parameter.device
    return current_torch_device()
