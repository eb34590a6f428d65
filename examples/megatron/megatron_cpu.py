"""Megatron-Core pipelines on CPU: a shim for its hard-coded CUDA calls, and a tiny model.

Megatron-Core runs its pipeline schedules on CPU with gloo once a few CUDA-only calls are
redirected: ``torch.zeros(..., device="cuda")`` and ``tensor.cuda()`` for the token
counters of the schedules, ``torch.cuda.current_device()`` for the receive buffers of the
point-to-point communication, and ``torch.cuda.synchronize()`` after batched sends and
receives; its transformer layers (tensor parallel too) also need
``torch.ones(..., device="cuda")`` for the causal mask and a CUDA RNG tracker, which
dropout forks (here one that forks nothing: the CPU generator draws the masks).
:func:`cuda_calls_on_cpu` redirects them while a block runs. It belongs to the example and
the tests (no GPU there); lightning-energy itself never patches Megatron.

The model is a stack of ``Linear + Tanh`` stages, one per pipeline stage (model chunk),
each a ``MegatronModule`` that takes its input from the previous stage through
``set_input_tensor``, as Megatron's models do; :func:`build_gpt` builds a tiny
Megatron-Core ``GPTModel`` (tensor and pipeline parallel) from a layer spec.

Example (every rank, inside an initialised gloo process group)::

    with cuda_calls_on_cpu():
        model, config = build_chunks(pipeline_ranks=2, virtual_stages=1)
        forward_backward = get_forward_backward_func()
        forward_backward(forward_step_func=forward_step, data_iterator=data(config, 4),
                         model=model, num_microbatches=4, ...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import random as rng
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

#: Sequence length, micro-batch size and hidden size of the tiny model.
SEQ_LENGTH = 4
MICRO_BATCH_SIZE = 2
HIDDEN_SIZE = 8

#: Layers, sequence length, micro-batch size (even: two nano-batches) and vocabulary of
#: the tiny GPT.
GPT_LAYERS = 4
GPT_SEQ_LENGTH = 8
GPT_MICRO_BATCH_SIZE = 4
GPT_VOCAB = 64


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """Redirect Megatron-Core's CUDA-only calls to the CPU while the block runs.

    ``torch.zeros``/``torch.ones`` with ``device="cuda"`` and ``Tensor.cuda()`` give CPU
    tensors, ``torch.cuda.current_device()`` names the CPU, ``torch.cuda.synchronize()``
    does nothing (gloo's sends and receives are complete once waited for) and Megatron's
    CUDA RNG tracker forks nothing. Everything is put back at the end, also when the block
    raises.
    """
    saved = (
        torch.zeros,
        torch.ones,
        torch.Tensor.cuda,
        torch.cuda.current_device,
        torch.cuda.synchronize,
    )
    tracker = (rng._CUDA_RNG_STATE_TRACKER, rng._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    zeros, ones = torch.zeros, torch.ones

    def cpu_zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return zeros(*args, device="cpu" if _is_cuda(device) else device, **kwargs)

    def cpu_ones(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return ones(*args, device="cpu" if _is_cuda(device) else device, **kwargs)

    def cpu_tensor(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.zeros = cpu_zeros
    torch.ones = cpu_ones
    torch.Tensor.cuda = cpu_tensor  # type: ignore[method-assign,assignment]
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None
    # Megatron's inference tracker forks nothing (its CUDA one would fork a CUDA generator).
    rng._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    rng.initialize_rng_tracker(inference_rng_tracker=True)
    try:
        yield
    finally:
        (
            torch.zeros,
            torch.ones,
            torch.Tensor.cuda,  # type: ignore[method-assign]
            torch.cuda.current_device,
            torch.cuda.synchronize,
        ) = saved
        rng._CUDA_RNG_STATE_TRACKER, rng._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker


def _is_cuda(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class LinearStage(MegatronModule):
    """One pipeline stage: ``tanh(linear(x))`` over ``[seq, batch, hidden]`` activations.

    The first stage reads the micro-batch; the others the activation Megatron hands over
    with :meth:`set_input_tensor`.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.linear = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:
        self.input_tensor = input_tensor[0]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs if self.input_tensor is None else self.input_tensor
        return torch.tanh(self.linear(x))


def build_chunks(pipeline_ranks: int, virtual_stages: int) -> tuple[list[LinearStage], Any]:
    """This rank's model chunks (``virtual_stages`` of them) and their config.

    Parameters are seeded by stage, so a stage's weights do not depend on how many ranks
    the pipeline has.
    """
    config = TransformerConfig(
        num_layers=pipeline_ranks * virtual_stages,
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=1,
        pipeline_model_parallel_size=pipeline_ranks,
        virtual_pipeline_model_parallel_size=virtual_stages if virtual_stages > 1 else None,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
    )
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for chunk in range(virtual_stages):
        torch.manual_seed(1000 + chunk * pipeline_ranks + rank)
        chunks.append(LinearStage(config))
    return chunks, config


def batches(num_microbatches: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, targets)`` micro-batches, the same on every rank for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(num_microbatches):
        shape = (SEQ_LENGTH, MICRO_BATCH_SIZE, HIDDEN_SIZE)
        yield torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _loss(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = torch.nn.functional.mse_loss(output, target)
    return loss, {"loss": loss.detach()}


def forward_step(
    data_iterator: Iterator[tuple[torch.Tensor, torch.Tensor]], model: LinearStage
) -> tuple[torch.Tensor, Any]:
    """Megatron's ``forward_step_func``: the stage's output and the loss of the batch."""
    inputs, target = next(data_iterator)
    return model(inputs), partial(_loss, target)


def build_gpt(layer_spec: Any) -> GPTModel:
    """This rank's part of a tiny GPT (float32, no dropout, no fusions: CPU kernels only)
    with ``layer_spec``'s layers, after ``parallel_state.initialize_model_parallel``."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = TransformerConfig(
        num_layers=GPT_LAYERS,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    torch.manual_seed(1)
    return GPTModel(
        config,
        layer_spec,
        vocab_size=GPT_VOCAB,
        max_sequence_length=GPT_SEQ_LENGTH,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        position_embedding_type="rope",
    )


def gpt_batches(num_microbatches: int, seed: int) -> Iterator[torch.Tensor]:
    """Token micro-batches ``[batch, seq]``, the same on every rank for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(num_microbatches):
        yield torch.randint(
            0, GPT_VOCAB, (GPT_MICRO_BATCH_SIZE, GPT_SEQ_LENGTH), generator=generator
        )


def _mean_loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = output.float().mean()
    return loss, {"loss": loss.detach()}


def gpt_forward_step(data_iterator: Iterator[torch.Tensor], model: GPTModel) -> tuple[Any, Any]:
    """Megatron's ``forward_step_func`` for :func:`build_gpt`: next-token losses."""
    tokens = next(data_iterator)
    positions = torch.arange(GPT_SEQ_LENGTH).expand(GPT_MICRO_BATCH_SIZE, GPT_SEQ_LENGTH)
    return model(tokens, positions, None, labels=torch.roll(tokens, -1, 1)), _mean_loss
