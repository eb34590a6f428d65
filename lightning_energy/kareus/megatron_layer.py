"""Kareus on Megatron-Core: a transformer layer that overlaps two nano-batches.

:class:`KareusMegatron` is the job's Kareus runtime (one per process, built on every rank
after ``parallel_state.initialize_model_parallel`` and before the model): it reads the
plan, refuses one made for another model, creates one communicator per CTA count of the
plan, and hands out the layer spec (:meth:`KareusMegatron.layer_spec`: Megatron-Core's
local GPT layer spec with :class:`KareusTransformerLayer` in place of
``TransformerLayer``). :class:`~lightning_energy.integrations.megatron.MegatronEnergy`
tells it which instruction runs (``kareus=``) and applies the plan's clocks, so one plan
drives both; without a plan it is plain nano-batching (NCCL's defaults, every collective
issued before the first op it overlaps).

Each micro-batch is split in two along the batch dimension. The all-reduce of one
nano-batch (after the row-parallel projection and FC2 in the forward, of the input gradient
of the column-parallel QKV and FC1 in the backward) runs while the other nano-batch
computes, in this order (``A``: attention block, ``M``: MLP block, ``ar(x)``: the
all-reduce of ``x``):

=========  ==================================  ==================================
partition  forward                             backward
=========  ==================================  ==================================
1          A(nb0)                              M(nb0)
2          A(nb1) + ar(A nb0)                  M(nb1) + ar(M nb0)
3          M(nb0) + ar(A nb1)                  A(nb0) + ar(M nb1)
4          M(nb1) + ar(M nb0)                  A(nb1) + ar(A nb0)
5          residual add(nb0) + ar(M nb1)       input norm(nb0) + ar(A nb1)
=========  ==================================  ==================================

The partition keys are Kareus' (:data:`~.runtime.RUNTIME_OPS`); the fifth partition is the
beginning of the next layer's first partition in Kareus, which overlaps across layers: a
layer spec replaces single layers, so here each layer ends with that short partition (the
all-reduce of nano-batch 1 overlaps only nano-batch 0's residual add, or input norm) and
begins with one without a collective.

The backward runs in that order because the layer is one autograd function whose backward
runs the pieces of each nano-batch itself (the pieces are cut at the collectives); the
backward collectives are those Megatron-Core's column-parallel linears run (``allreduce``
of the input gradient), issued by the layer instead. The layer's outputs and gradients are
the plain layer's (dropout draws its masks per nano-batch).

Supported: Megatron-Core's local (non-Transformer-Engine) GPT layer, tensor parallelism
>= 2 without sequence parallelism, no context parallelism, dense MLP, even micro-batches,
training and evaluation (not inference with a KV cache, packed sequences or CUDA graphs).

Example (every rank)::

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=8, ...)
    kareus = KareusMegatron("kareus_plan.json")   # None: plain nano-batching
    model = GPTModel(config, transformer_layer_spec=kareus.layer_spec(), ...)
    energy = MegatronEnergy("energy.yaml", kareus=kareus)
    forward_backward = energy.wrap(get_forward_backward_func())
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from lightning_energy.errors import ConfigError
from lightning_energy.kareus.compose import KareusPlan
from lightning_energy.kareus.runtime import (
    BASELINE,
    RUNTIME_OPS,
    CommStream,
    Overlap,
    PartitionRun,
    PlanSettings,
    cta_groups,
)
from lightning_energy.perseus.planning.plan import Plan
from lightning_energy.perseus.planning.schedule import Instruction, PipelineSchedule

__all__ = ["KareusMegatron", "KareusTransformerLayer", "PartialRowParallelLinear"]

log = logging.getLogger(__name__)

_FWD_ATTN, _FWD_MLP, _BWD_ATTN, _BWD_MLP = "fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp"


class KareusMegatron:
    """Kareus' runtime for a Megatron-Core job: layer spec, plan, communicators.

    Args:
        plan: a :class:`~.compose.KareusPlan` or its JSON file (``lightning-energy plan
            --config``); None: plain nano-batching.
        tp_group: the tensor-parallel group (None: Megatron-Core's).

    Raises:
        ConfigError: a plan for another tensor-parallel size, a slot beyond the ops of its
            partition, a CTA count out of NCCL's range, partition keys other than
            Kareus', or a tensor-parallel size below 2.
        ProfileError: an unreadable plan file.
    """

    def __init__(
        self, plan: KareusPlan | str | os.PathLike[str] | None = None, *, tp_group: Any = None
    ) -> None:
        if plan is None or isinstance(plan, KareusPlan):
            source = None
        else:
            source = str(plan)
            plan = KareusPlan.load(plan)
        self.settings = None if plan is None else PlanSettings(plan, source=source)
        self.tp_group = (
            tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        )
        self.tp_size = dist.get_world_size(self.tp_group)
        if self.tp_size < 2:
            raise ConfigError(
                f"tensor_model_parallel_size: {self.tp_size} is not allowed; use >= 2 (the "
                "overlapped collectives are tensor-parallel all-reduces)",
                source="KareusMegatron",
            )
        if self.settings is not None:
            self.settings.check_model(tp_size=self.tp_size)
        # Collective: every rank builds the runtime at the same point, with the same plan.
        ctas = () if self.settings is None else self.settings.ctas
        self._groups = cta_groups(self.tp_group, ctas)
        self._instruction: Instruction | None = None
        self._streams: dict[torch.device, CommStream] = {}

    # ------------------------------------------------------------------ model
    def layer_spec(self, **local_spec_kwargs: Any) -> ModuleSpec:
        """Megatron-Core's local GPT layer spec with :class:`KareusTransformerLayer`.

        Args:
            **local_spec_kwargs: passed to ``get_gpt_layer_local_spec`` (``qk_layernorm``,
                ``normalization``...).

        Raises:
            ConfigError: mixture of experts or multi-latent attention.
        """
        problems = [
            f"{key}: {local_spec_kwargs[key]!r} is not allowed; use {allowed!r}"
            for key, allowed in (("num_experts", None), ("multi_latent_attention", False))
            if local_spec_kwargs.get(key, allowed) != allowed
        ]
        if problems:
            raise ConfigError(problems, source="KareusMegatron.layer_spec")
        spec = get_gpt_layer_local_spec(**local_spec_kwargs)
        sub = spec.submodules
        # Kareus issues the collectives: column-parallel linears leave the input gradient
        # partial, row-parallel ones their output (the layer all-reduces both).
        column = ModuleSpec(module=ColumnParallelLinear, params={"disable_grad_reduce": True})
        attention = dataclasses.replace(
            sub.self_attention,
            submodules=dataclasses.replace(
                sub.self_attention.submodules,
                linear_qkv=column,
                linear_proj=PartialRowParallelLinear,
            ),
        )
        mlp = dataclasses.replace(
            sub.mlp,
            submodules=dataclasses.replace(
                sub.mlp.submodules, linear_fc1=column, linear_fc2=PartialRowParallelLinear
            ),
        )
        return ModuleSpec(
            module=KareusTransformerLayer,
            params={"kareus": self},
            submodules=dataclasses.replace(sub, self_attention=attention, mlp=mlp),
        )

    def check_model(self, chunks: Sequence[torch.nn.Module], stages: Sequence[int]) -> None:
        """Refuse a plan made for other layer counts (before training starts).

        Args:
            chunks: this rank's model chunks.
            stages: the pipeline stage of each chunk.

        Raises:
            ConfigError: a chunk with another number of Kareus layers than its stage has
                in the plan.
        """
        if self.settings is None:
            return
        layers = {
            stage: sum(isinstance(m, KareusTransformerLayer) for m in chunk.modules())
            for chunk, stage in zip(chunks, stages, strict=True)
        }
        self.settings.check_model(tp_size=self.tp_size, layers_per_stage=layers)

    def clock_plan(self, schedule: PipelineSchedule) -> Plan | None:
        """The plan's clocks for the engine's ``schedule`` (None without a plan).

        Raises:
            ConfigError: the plan is for another schedule.
        """
        return None if self.settings is None else self.settings.clock_plan(schedule)

    # ------------------------------------------------------------------ running
    @contextlib.contextmanager
    def instruction(self, inst: Instruction) -> Iterator[None]:
        """Apply ``inst``'s settings to every Kareus layer while the block runs."""
        previous, self._instruction = self._instruction, inst
        try:
            yield
        finally:
            self._instruction = previous

    def overlap(self, key: str) -> tuple[Overlap, Any]:
        """The setting of partition ``key`` now, and the group of its collective (outside
        an instruction of the plan: the baseline on the tensor-parallel group)."""
        inst = self._instruction
        if self.settings is None or inst is None or inst.kind != _kind(key):
            return BASELINE, self.tp_group
        overlap = self.settings.overlap(inst, key)
        assert overlap.ctas is not None
        return overlap, self._groups[overlap.ctas]

    def stream(self, device: torch.device) -> CommStream:
        """Where the collectives of ``device`` run."""
        if device not in self._streams:
            self._streams[device] = CommStream(device)
        return self._streams[device]


def _kind(key: str) -> str:
    return "backward" if key.startswith("bwd") else "forward"


class PartialRowParallelLinear(RowParallelLinear):
    """A row-parallel linear that returns its partial sums (the Kareus layer all-reduces
    them, overlapped, and adds the bias after).

    Raises:
        ConfigError: built with ``skip_bias_add=False`` (the bias must come after the sum).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.skip_bias_add:
            raise ConfigError(
                "skip_bias_add: False is not allowed for the Kareus layer's row-parallel "
                "linears; use True (as Megatron-Core's attention and MLP do)"
            )
        # Megatron-Core's own switch for a caller that reduces the output itself.
        self.explicit_expert_comm = True


class _NanoBatch:
    """One nano-batch's tensors where the layer's pieces meet.

    ``x``, ``h_in``, ``r_attn``, ``y_in``, ``h2_in`` and ``r_mlp`` are leaves: each piece
    is a graph of its own, whose backward the layer runs (and whose leaves' gradients it
    hands to the piece before).
    """

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.h: torch.Tensor  # input norm
        self.h_in: torch.Tensor
        self.p_attn: torch.Tensor  # attention, partial sum
        self.b_attn: torch.Tensor | None
        self.r_attn: torch.Tensor  # all-reduced
        self.y: torch.Tensor  # attention's residual add
        self.y_in: torch.Tensor
        self.h2: torch.Tensor  # pre-MLP norm
        self.h2_in: torch.Tensor
        self.p_mlp: torch.Tensor  # MLP, partial sum
        self.b_mlp: torch.Tensor | None
        self.r_mlp: torch.Tensor  # all-reduced
        self.out: torch.Tensor  # MLP's residual add


class KareusTransformerLayer(TransformerLayer):
    """A Megatron-Core transformer layer running two overlapped nano-batches (see the
    module docstring); build it through :meth:`KareusMegatron.layer_spec`.

    Args:
        config: the transformer config.
        submodules: the layer's submodules (the spec's).
        layer_number: as ``TransformerLayer``.
        hidden_dropout: as ``TransformerLayer``.
        kareus: the job's runtime (the spec passes it).
        **kwargs: passed to ``TransformerLayer`` (``vp_stage``, ``pg_collection``...).

    Raises:
        ConfigError: a configuration the layer cannot run (every problem at once).
    """

    def __init__(
        self,
        config: Any,
        submodules: Any,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        *,
        kareus: KareusMegatron,
        **kwargs: Any,
    ) -> None:
        _check_config(config)
        super().__init__(config, submodules, layer_number, hidden_dropout, **kwargs)
        _check_modules(self)
        self.kareus = kareus
        self._active: PartitionRun | None = None
        self._install_boundaries()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        **attention_kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The layer's output (``[s, b, h]``) and no context, as ``TransformerLayer``.

        Raises:
            ConfigError: an odd micro-batch, cross-attention, inference with a KV cache or
                packed sequences.
        """
        attention_kwargs.pop("padding_mask", None)  # for mixture-of-experts routing only
        attention_kwargs.pop("dynamic_inference_decode_only", None)
        batch = hidden_states.shape[1]
        problems = []
        if batch % 2:
            problems.append(
                f"micro_batch_size: {batch} is not allowed; use an even number (two nano-batches)"
            )
        for name, value in (
            ("context", context),
            ("inference_context", inference_context or attention_kwargs.get("inference_params")),
            ("packed_seq_params", packed_seq_params),
        ):
            if value is not None:
                problems.append(f"{name}: not supported by the Kareus layer; pass None")
        if problems:
            raise ConfigError(problems, source="KareusTransformerLayer")
        masks = _halves(attention_mask, batch)
        per_nb = [
            {"attention_mask": masks[i], **_split_batch(attention_kwargs, batch, i)}
            for i in range(2)
        ]
        params = [p for p in self.parameters() if p.requires_grad]
        grad = torch.is_grad_enabled() and (hidden_states.requires_grad or bool(params))
        run = _LayerRun(self, per_nb, grad=grad)
        if not grad:
            return run.forward(hidden_states), None
        if not hidden_states.requires_grad:  # the parameters still need the backward
            hidden_states = hidden_states.detach().requires_grad_()
        return _Overlapped.apply(run, hidden_states), None

    # ------------------------------------------------------------------ boundaries
    def _install_boundaries(self) -> None:
        """Hooks marking the boundaries between the ops inside Megatron-Core's modules:
        forward (pre-)hooks for the forward, gradient hooks on the tensors they see for
        the backward."""
        attention, mlp = self.self_attention, self.mlp
        self._after(attention.linear_qkv, "qkv_split", backward="qkv")
        if getattr(attention, "k_layernorm", None) is not None:
            self._after(attention.k_layernorm, "rotary", backward="qkv_split")
        self._after(attention.core_attention, None, backward="attention")
        self._before(attention.core_attention, "attention", backward="rotary")
        self._before(attention.linear_proj, "proj", backward=None)
        self._after(mlp.linear_fc1, "activation", backward="fc1")
        self._before(mlp.linear_fc2, "fc2", backward="activation")

    def _before(self, module: torch.nn.Module, op: str, *, backward: str | None) -> None:
        def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._forward_boundary(op)
            first = args[0] if args else next(iter(kwargs.values()), None)
            self._mark_gradient(first, backward)

        module.register_forward_pre_hook(hook, with_kwargs=True)

    def _after(self, module: torch.nn.Module, op: str | None, *, backward: str | None) -> None:
        def hook(_: Any, args: tuple[Any, ...], output: Any) -> None:
            if op is not None:
                self._forward_boundary(op)
            self._mark_gradient(output[0] if isinstance(output, tuple) else output, backward)

        module.register_forward_hook(hook)

    def _forward_boundary(self, op: str) -> None:
        run = self._active
        if run is not None and not run.backward:
            run.reach(op)

    def _mark_gradient(self, tensor: Any, op: str | None) -> None:
        """The backward reaches ``op`` when ``tensor``'s gradient is complete."""
        if op is None or not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
            return

        def hook(grad: torch.Tensor) -> None:
            run = self._active
            if run is not None and run.backward:
                run.reach(op)

        tensor.register_hook(hook)


def _halves(tensor: torch.Tensor | None, batch: int) -> list[torch.Tensor | None]:
    """Each nano-batch's part of a tensor whose first dimension is the batch (a mask);
    the tensor itself when it broadcasts over the batch."""
    if tensor is None or tensor.dim() == 0 or tensor.shape[0] != batch:
        return [tensor, tensor]
    half = batch // 2
    return [tensor[:half], tensor[half:]]


def _split_batch(kwargs: Mapping[str, Any], batch: int, i: int) -> dict[str, Any]:
    """Nano-batch ``i``'s attention arguments: ``attention_bias`` split like the mask,
    the rest (rotary embeddings, offsets) shared."""
    out = dict(kwargs)
    if isinstance(out.get("attention_bias"), torch.Tensor):
        out["attention_bias"] = _halves(out["attention_bias"], batch)[i]
    return out


class _LayerRun:
    """One call of a Kareus layer: the partitions of its forward and backward.

    Args:
        layer: the layer.
        attention_kwargs: each nano-batch's arguments of the self-attention.
        grad: whether the pieces build graphs (the backward runs them).
    """

    def __init__(
        self, layer: KareusTransformerLayer, attention_kwargs: list[dict[str, Any]], *, grad: bool
    ) -> None:
        self.layer = layer
        self.kareus = layer.kareus
        self.attention_kwargs = attention_kwargs
        self.grad = grad
        self.nbs: list[_NanoBatch] = []
        self.stream: CommStream | None = None

    def _leaf(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().requires_grad_() if self.grad else tensor

    def _partition(
        self,
        key: str,
        tensor: torch.Tensor | None,
        compute: Callable[[PartitionRun], None],
        *,
        ops: tuple[str, ...] | None = None,
    ) -> torch.Tensor | None:
        """Run ``compute`` as partition ``key``, with the all-reduce of ``tensor``."""
        assert self.stream is not None
        overlap, group = self.kareus.overlap(key)
        run = PartitionRun(key, overlap, group, self.stream, tensor, ops=ops)
        self.layer._active = run
        try:
            run.reach(0)
            compute(run)
            return run.finish()
        finally:
            self.layer._active = None

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's output; with ``grad``, each piece's graph is kept for
        :meth:`backward`."""
        self.stream = self.kareus.stream(hidden_states.device)
        half = hidden_states.shape[1] // 2
        source = hidden_states.detach()
        self.nbs = nbs = [
            _NanoBatch(self._leaf(source[:, :half].contiguous())),
            _NanoBatch(self._leaf(source[:, half:].contiguous())),
        ]
        self._partition(_FWD_ATTN, None, lambda run: self._attention(0, run))
        reduced = self._partition(_FWD_ATTN, nbs[0].p_attn, lambda run: self._attention(1, run))
        nbs[0].r_attn = self._leaf(_done(reduced))
        reduced = self._partition(_FWD_MLP, nbs[1].p_attn, lambda run: self._mlp(0, run))
        nbs[1].r_attn = self._leaf(_done(reduced))
        reduced = self._partition(_FWD_MLP, nbs[0].p_mlp, lambda run: self._mlp(1, run))
        nbs[0].r_mlp = self._leaf(_done(reduced))
        # The beginning of the next layer's first partition: nano-batch 0's residual add.
        reduced = self._partition(
            _FWD_ATTN,
            nbs[1].p_mlp,
            lambda run: self._residual_add(0),
            ops=RUNTIME_OPS[_FWD_ATTN][:1],
        )
        nbs[1].r_mlp = self._leaf(_done(reduced))
        self._residual_add(1)
        return torch.cat([nb.out.detach() for nb in nbs], dim=1)

    def _attention(self, i: int, run: PartitionRun) -> None:
        layer, nb = self.layer, self.nbs[i]
        run.reach("norm")
        nb.h = layer.input_layernorm(nb.x)
        run.reach("qkv")
        nb.h_in = self._leaf(nb.h)
        nb.p_attn, nb.b_attn = layer.self_attention(nb.h_in, **self.attention_kwargs[i])

    def _mlp(self, i: int, run: PartitionRun) -> None:
        layer, nb = self.layer, self.nbs[i]
        with layer.bias_dropout_add_exec_handler():
            nb.y = layer.self_attn_bda(layer.training, layer.config.bias_dropout_fusion)(
                (nb.r_attn, nb.b_attn), nb.x, layer.hidden_dropout
            )
        run.reach("norm")
        nb.y_in = self._leaf(nb.y)
        nb.h2 = layer.pre_mlp_layernorm(nb.y_in)
        run.reach("fc1")
        nb.h2_in = self._leaf(nb.h2)
        nb.p_mlp, nb.b_mlp = layer.mlp(nb.h2_in)

    def _residual_add(self, i: int) -> None:
        layer, nb = self.layer, self.nbs[i]
        with layer.bias_dropout_add_exec_handler():
            nb.out = layer.mlp_bda(layer.training, layer.config.bias_dropout_fusion)(
                (nb.r_mlp, nb.b_mlp), nb.y_in, layer.hidden_dropout
            )

    # ------------------------------------------------------------------ backward
    def backward(self, grad_output: torch.Tensor) -> torch.Tensor:
        """The gradient of the layer's input; the parameters' gradients accumulate."""
        nbs = self.nbs
        half = grad_output.shape[1] // 2
        g0, g1 = grad_output[:, :half].contiguous(), grad_output[:, half:].contiguous()
        self._partition(_BWD_MLP, None, lambda run: self._mlp_backward(0, g0, run))
        g_h2_0 = self._partition(
            _BWD_MLP, _grad(nbs[0].h2_in), lambda run: self._mlp_backward(1, g1, run)
        )
        g_h2_1 = self._partition(
            _BWD_ATTN, _grad(nbs[1].h2_in), lambda run: self._attention_backward(0, g_h2_0, run)
        )
        g_h_0 = self._partition(
            _BWD_ATTN, _grad(nbs[0].h_in), lambda run: self._attention_backward(1, g_h2_1, run)
        )
        # The end of the previous layer's last partition: nano-batch 0's input norm.
        g_h_1 = self._partition(
            _BWD_MLP,
            _grad(nbs[1].h_in),
            lambda run: _backward(nbs[0].h, g_h_0),
            ops=RUNTIME_OPS[_BWD_MLP][:1],
        )
        _backward(nbs[1].h, g_h_1)
        grad_input = torch.cat([_grad(nb.x) for nb in nbs], dim=1)
        self.nbs = []  # the pieces' graphs are spent
        return grad_input

    def _mlp_backward(self, i: int, grad_output: torch.Tensor, run: PartitionRun) -> None:
        nb = self.nbs[i]
        run.reach("residual_add")
        _backward(nb.out, grad_output)
        run.reach("fc2")
        _backward(nb.p_mlp, _grad(nb.r_mlp))

    def _attention_backward(self, i: int, grad_h2: torch.Tensor | None, run: PartitionRun) -> None:
        nb = self.nbs[i]
        _backward(nb.h2, grad_h2)
        run.reach("residual_add")
        _backward(nb.y, _grad(nb.y_in))
        run.reach("proj")
        _backward(nb.p_attn, _grad(nb.r_attn))


def _done(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None  # a partition with a collective returns its result
    return tensor


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    assert leaf.grad is not None  # every leaf of a piece feeds the piece after it
    return leaf.grad


def _backward(tensor: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Run the backward of one piece (its parameters' gradients accumulate)."""
    torch.autograd.backward(tensor, _done(grad))


class _Overlapped(torch.autograd.Function):
    """The layer as one autograd node: its backward runs the pieces' backwards in
    Kareus' order."""

    @staticmethod
    def forward(ctx: Any, run: _LayerRun, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            output = run.forward(hidden_states)
        ctx.run = run
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, torch.Tensor]:
        run, ctx.run = ctx.run, None
        return None, run.backward(grad_output)


def _check_config(config: Any) -> None:
    """Refuse what the layer cannot run, before any module is built.

    Raises:
        ConfigError: every problem at once.
    """
    problems = []
    expected = {
        "sequence_parallel": False,
        "context_parallel_size": 1,
        "num_moe_experts": None,
        "enable_cuda_graph": False,
        "external_cuda_graph": False,
        "fine_grained_activation_offloading": False,
    }
    for key, allowed in expected.items():
        value = getattr(config, key, allowed)
        if value != allowed:
            problems.append(f"{key}: {value!r} is not allowed; use {allowed!r}")
    if getattr(config, "cuda_graph_impl", "none") not in ("none", None):
        problems.append(f"cuda_graph_impl: {config.cuda_graph_impl!r} is not allowed; use 'none'")
    if getattr(config, "recompute_granularity", None) == "selective":
        unsupported = sorted(
            set(getattr(config, "recompute_modules", None) or ()) & {"layernorm", "mlp"}
        )
        if unsupported:
            problems.append(
                f"recompute_modules: {unsupported} is not allowed with the Kareus layer; "
                "recompute 'core_attn' or whole layers (recompute_granularity='full')"
            )
    if problems:
        raise ConfigError(problems, source="KareusTransformerLayer")


def _check_modules(layer: TransformerLayer) -> None:
    """Refuse submodules other than those of :meth:`KareusMegatron.layer_spec`.

    Raises:
        ConfigError: every problem at once.
    """
    problems = []
    attention, mlp = layer.self_attention, layer.mlp
    if not isinstance(mlp, MLP):
        problems.append(f"mlp: {type(mlp).__name__} is not allowed; use a dense MLP")
    for owner, name, cls in (
        (attention, "linear_qkv", ColumnParallelLinear),
        (attention, "linear_proj", PartialRowParallelLinear),
        (mlp, "linear_fc1", ColumnParallelLinear),
        (mlp, "linear_fc2", PartialRowParallelLinear),
    ):
        module = getattr(owner, name, None)
        if not isinstance(module, cls):
            problems.append(
                f"{name}: {type(module).__name__} is not allowed; use "
                "KareusMegatron.layer_spec() (Megatron-Core's local linears)"
            )
    for name in ("pre_cross_attn_layernorm", "cross_attention"):
        if not isinstance(getattr(layer, name), IdentityOp):
            problems.append(f"{name}: not supported by the Kareus layer; use IdentityOp")
    if problems:
        raise ConfigError(problems, source="KareusTransformerLayer")
