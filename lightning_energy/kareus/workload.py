"""Transformer layers as Kareus partitions, and a simulated GPU that measures them.

:class:`TransformerShape` turns a tensor-parallel transformer (Megatron-style: column-
parallel QKV and FC1, row-parallel projection and FC2, one all-reduce after each block,
RMS/LayerNorm, rotary embeddings, causal attention) into the compute ops of each
partition (:data:`~.partition.PARTITION_KEYS`) and the work of each op per GPU:

* ``fwd_attn``: residual add, norm, QKV GEMM, QKV split, rotary, attention, projection;
* ``fwd_mlp``: residual add, norm, FC1 GEMM, activation, FC2 GEMM;
* ``bwd_mlp`` and ``bwd_attn``: the same ops' backward in the order the gradient reaches
  them between two all-reduces (as :data:`~.runtime.RUNTIME_OPS` runs them): the norm and
  residual add of the block above first, then the block's ops in reverse; GEMMs twice the
  forward FLOPs (input and weight gradients), attention 2.5 times (FlashAttention's
  backward), memory ops twice the bytes;
* the all-reduce of one nano-batch's ``tokens x hidden`` activations (or gradients).

GEMM and attention work is FLOPs, memory ops bytes; the overlap model
(:mod:`.model`) turns work into time with its calibrated rates. :data:`MEASURED_FWD_ATTN`
is the partition of the measured Kareus micro-benchmark, :data:`LLAMA_3_2_3B` the Kareus
artifact's Llama 3.2 3B configuration (TP 8, PP 2, micro-batch 8, sequence 4096).

:class:`SimulatedPartitions` measures partitions of a shape with the model's noise (the
search's measurement function on a CPU), and :meth:`SimulatedPartitions.non_partition_rows`
gives the rest of an instruction (embedding, output layer and loss) per clock.

Example:
    >>> [op.name for op in LLAMA_3_2_3B.partition("fwd_mlp").ops]
    ['residual_add', 'norm', 'fc1', 'activation', 'fc2']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_energy.errors import ConfigError
from lightning_energy.kareus.model import OverlapModel
from lightning_energy.kareus.partition import (
    PARTITION_KEYS,
    ComputeOp,
    Partition,
    PartitionSetting,
)
from lightning_energy.perseus.planning.profile import BACKWARD, FORWARD, ProfileRow

__all__ = [
    "LLAMA_3_2_3B",
    "MEASURED_FWD_ATTN",
    "SimulatedPartitions",
    "TransformerShape",
]

_BACKWARD_GEMM = 2.0
_BACKWARD_ATTENTION = 2.5
_BACKWARD_MEMORY = 2.0


@dataclass(frozen=True)
class TransformerShape:
    """A tensor-parallel transformer and its micro-batch.

    Attributes:
        name: a label.
        hidden: model width.
        heads: attention (query) heads.
        kv_heads: key/value heads (grouped-query attention when fewer than ``heads``).
        head_dim: width of a head.
        ffn: MLP inner width.
        layers: transformer layers.
        vocab: vocabulary size.
        gated_mlp: SwiGLU-style MLP (FC1 twice as wide).
        seq_len: tokens per sequence.
        microbatch: sequences per micro-batch (split into two nano-batches).
        tp_size: tensor-parallel GPUs.
        dtype_bytes: bytes per activation value.
    """

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int
    gated_mlp: bool
    seq_len: int
    microbatch: int
    tp_size: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        problems = [
            f"{key}: {getattr(self, key)!r} is not allowed; use an integer >= 1"
            for key in (
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "ffn",
                "layers",
                "vocab",
                "seq_len",
                "microbatch",
                "dtype_bytes",
            )
            if getattr(self, key) < 1
        ]
        if self.tp_size < 2:
            problems.append(f"tp_size: {self.tp_size!r} is not allowed; use >= 2")
        if self.microbatch % 2:
            problems.append(
                f"microbatch: {self.microbatch!r} is not allowed; use an even number (two "
                "nano-batches)"
            )
        if problems:
            raise ConfigError(problems, source=f"transformer {self.name!r}")

    def partition(self, key: str, *, nanobatched: bool = True) -> Partition:
        """The ops and collective of one partition, per GPU.

        Args:
            key: one of :data:`~.partition.PARTITION_KEYS`.
            nanobatched: work of one nano-batch (half the micro-batch); False: of the whole
                micro-batch (no nano-batching, the collective then cannot overlap).

        Raises:
            ConfigError: an unknown key.
        """
        if key not in PARTITION_KEYS:
            raise ConfigError(f"partition {key!r}: allowed: {', '.join(PARTITION_KEYS)}")
        sequences = self.microbatch // 2 if nanobatched else self.microbatch
        tokens = float(sequences * self.seq_len)
        b = self.dtype_bytes
        h, tp = float(self.hidden), self.tp_size
        q_dim = self.heads * self.head_dim / tp
        kv_dim = self.kv_heads * self.head_dim / tp
        ffn = self.ffn / tp
        fc1_out = 2 * ffn if self.gated_mlp else ffn
        residual = 3 * tokens * h * b
        norm = 2 * tokens * h * b
        if key.endswith("attn"):
            causal_flops = 4.0 * self.seq_len**2 * self.head_dim * self.heads / tp * sequences / 2
            ops = [
                ComputeOp("residual_add", "memory", residual),
                ComputeOp("norm", "memory", norm),
                ComputeOp("qkv", "gemm", 2 * tokens * h * (q_dim + 2 * kv_dim)),
                ComputeOp("qkv_split", "memory", 2 * tokens * (q_dim + 2 * kv_dim) * b),
                ComputeOp("rotary", "memory", 2 * tokens * (q_dim + kv_dim) * b),
                ComputeOp("attention", "attention", causal_flops),
                ComputeOp("proj", "gemm", 2 * tokens * q_dim * h),
            ]
        else:
            ops = [
                ComputeOp("residual_add", "memory", residual),
                ComputeOp("norm", "memory", norm),
                ComputeOp("fc1", "gemm", 2 * tokens * h * fc1_out),
                ComputeOp("activation", "memory", (fc1_out + ffn) * tokens * b),
                ComputeOp("fc2", "gemm", 2 * tokens * ffn * h),
            ]
        if key.startswith("bwd"):
            # The norm and residual add (the same work in every block) come first: the
            # gradient reaches them before the block's own ops.
            scale = {"gemm": _BACKWARD_GEMM, "attention": _BACKWARD_ATTENTION}
            ops = [
                ComputeOp(op.name, op.op_class, op.work * scale.get(op.op_class, _BACKWARD_MEMORY))
                for op in [*reversed(ops[:2]), *reversed(ops[2:])]
            ]
        comm = 2.0 * (tp - 1) / tp * tokens * h * b
        return Partition(key, tuple(ops), comm_bytes=comm, tp_size=tp)

    def non_partition_ops(self, kind: str, *, first: bool, last: bool) -> tuple[ComputeOp, ...]:
        """Work of one micro-batch outside the layers: the embedding on the first stage,
        the output layer and the loss on the last.

        Args:
            kind: ``"forward"`` or ``"backward"``.
            first: the stage holds the embedding.
            last: the stage holds the output layer and the loss.
        """
        tokens = float(self.microbatch * self.seq_len)
        b, h = self.dtype_bytes, float(self.hidden)
        vocab = self.vocab / self.tp_size
        ops: list[ComputeOp] = []
        if first:
            ops.append(ComputeOp("embedding", "memory", 2 * tokens * h * b))
        if last:
            ops.append(ComputeOp("output", "gemm", 2 * tokens * h * vocab))
            ops.append(ComputeOp("loss", "memory", 3 * tokens * vocab * b))
        if kind == BACKWARD:
            scale = {"gemm": _BACKWARD_GEMM}
            ops = [
                ComputeOp(op.name, op.op_class, op.work * scale.get(op.op_class, _BACKWARD_MEMORY))
                for op in ops
            ]
        return tuple(ops)


#: The measured Kareus micro-benchmark: forward attention, hidden 2048, 32 heads, micro-batch
#: 4 (two nano-batches of 2), sequence 4096, fp16, tensor parallel 2.
MEASURED_FWD_ATTN = TransformerShape(
    name="kareus-microbenchmark",
    hidden=2048,
    heads=32,
    kv_heads=32,
    head_dim=64,
    ffn=8192,
    layers=1,
    vocab=32000,
    gated_mlp=False,
    seq_len=4096,
    microbatch=4,
    tp_size=2,
).partition("fwd_attn")

#: Llama 3.2 3B as the Kareus artifact trains it: TP 8, micro-batch 8, sequence 4096.
LLAMA_3_2_3B = TransformerShape(
    name="llama3.2-3b",
    hidden=3072,
    heads=24,
    kv_heads=8,
    head_dim=128,
    ffn=8192,
    layers=28,
    vocab=128256,
    gated_mlp=True,
    seq_len=4096,
    microbatch=8,
    tp_size=8,
)


class SimulatedPartitions:
    """A simulated tensor-parallel GPU group that measures partitions of a transformer.

    Measurements are the overlap model's predictions inside a training step (no harness
    overhead) with its measured noise.

    Args:
        model: the overlap model (its ``harness`` flag is ignored: partitions run inside a
            training step).
        shape: the transformer.
        seed: seed of the noise.
        nanobatched: partitions of one nano-batch (Kareus); False: of the whole micro-batch,
            whose collective can only run alone (no nano-batching).
    """

    def __init__(
        self,
        model: OverlapModel,
        shape: TransformerShape,
        *,
        seed: int = 0,
        nanobatched: bool = True,
    ) -> None:
        self.model = OverlapModel(model.physics, harness=False)
        self.shape = shape
        self._rng = np.random.default_rng(seed)
        self._partitions = {
            key: shape.partition(key, nanobatched=nanobatched) for key in PARTITION_KEYS
        }
        self.measured = 0

    def partition(self, key: str) -> Partition:
        """The partition measured for ``key``."""
        return self._partitions[key]

    def measure(self, key: str, settings: Sequence[PartitionSetting]) -> list[tuple[float, float]]:
        """``(time_s, energy_j)`` of one noisy measurement of each setting."""
        pred = self.model.measure(self._partitions[key], self._rng, **_arrays(settings))
        self.measured += len(settings)
        return list(zip(pred.time_s.tolist(), pred.energy_j.tolist(), strict=True))

    def exact(self, key: str, settings: Sequence[PartitionSetting]) -> list[tuple[float, float]]:
        """``(time_s, energy_j)`` of each setting without noise."""
        pred = self.model.predict(self._partitions[key], **_arrays(settings))
        return list(zip(pred.time_s.tolist(), pred.energy_j.tolist(), strict=True))

    def non_partition_rows(
        self, layers_per_stage: Sequence[int], clocks_mhz: Sequence[int]
    ) -> list[ProfileRow]:
        """Time and energy of one micro-batch outside the partitions, per stage, kind and
        clock (rows of a Perseus profile; all GPUs of the group).

        Stages without such work get a row of one launch at the static power, so every
        stage has every clock.
        """
        ph = self.model.physics
        clocks = np.asarray(clocks_mhz, dtype=np.float64)
        rows: list[ProfileRow] = []
        stages = len(layers_per_stage)
        for stage in range(stages):
            for kind in (FORWARD, BACKWARD):
                ops = self.shape.non_partition_ops(kind, first=stage == 0, last=stage == stages - 1)
                times, dynamic_j = self.model.compute(ops, clocks)
                time_s = ph.host_memory_s + times.sum(axis=1)
                energy_j = self.shape.tp_size * (ph.static_power_w * time_s + dynamic_j)
                rows.extend(
                    (stage, kind, int(f), float(t), float(e))
                    for f, t, e in zip(clocks_mhz, time_s, energy_j, strict=True)
                )
        return rows


def _arrays(settings: Sequence[PartitionSetting]) -> dict[str, Any]:
    return {
        "clock_mhz": np.asarray([s.clock_mhz for s in settings], dtype=np.float64),
        "ctas": np.asarray([s.ctas for s in settings], dtype=np.float64),
        "block_threads": np.asarray([s.block_threads for s in settings], dtype=np.float64),
        "slot": np.asarray([s.slot for s in settings], dtype=np.int64),
    }
