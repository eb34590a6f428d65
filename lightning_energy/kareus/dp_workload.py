"""The simulated GPU's answer for data-parallel training: a backward pass whose gradient
all-reduce overlaps it, under (CTAs, bucket size, clock).

DDP all-reduces the gradients in buckets, in the order the backward produces them: a
bucket closes when the gradients added to it reach ``bucket_cap_mb`` (a parameter is never
split) and is all-reduced while the backward goes on. So bucket ``j``'s all-reduce overlaps
the compute that produces bucket ``j + 1``; the last bucket's runs alone after the
backward, as the first bucket's compute runs with no all-reduce beside it.

Each such stretch is a partition of the calibrated overlap model (:mod:`.model`, used as
it is): the compute ops of bucket ``j + 1`` and the all-reduce of bucket ``j`` issued before
the first of them (slot 0), waited for at the end. The first bucket's compute and the last
bucket's all-reduce, which overlap nothing, are one sequential partition (the collective
alone, then the compute: the time and energy of both alone). The time and energy of a
backward are the sums over its partitions, for the data-parallel group (one GPU per
replica). Waiting for each all-reduce at the end of the next bucket's compute is the
conservative side of DDP, whose compute never waits for the communication mid-backward.

The compute is the backward of every transformer layer of a :class:`~.workload.TransformerShape`
(each layer's MLP then its attention, as :mod:`.workload` orders them, per tensor-parallel
GPU); each GEMM's weight gradient is ready after its backward op. Embedding, output layer
and norm weights are left out, as is DDP's smaller first bucket.

:class:`SimulatedDataParallel` measures such backwards for the partition search
(:func:`~.search.search_partition`): a data-parallel setting is a
:class:`~.partition.PartitionSetting` whose ``slot`` is the index of its bucket size in
:attr:`SimulatedDataParallel.bucket_caps_mb` (the bucket size decides when communication
starts, as a slot does).

Example:
    >>> from lightning_energy.kareus.model import OverlapModel, shipped_physics
    >>> from lightning_energy.kareus.partition import PartitionSetting
    >>> from lightning_energy.kareus.workload import LLAMA_3_2_3B
    >>> dp = SimulatedDataParallel(
    ...     OverlapModel(shipped_physics()), LLAMA_3_2_3B, dp_size=4, bucket_caps_mb=(25, 4000)
    ... )
    >>> buckets_25mb, one_bucket = PartitionSetting(1410, 20, 0), PartitionSetting(1410, 20, 1)
    >>> (overlapped, _), (alone, _) = dp.exact(DP_KEY, [buckets_25mb, one_bucket])
    >>> bool(overlapped < alone)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lightning_energy.device.base import StageWork
from lightning_energy.errors import ConfigError
from lightning_energy.kareus.data_parallel import DataParallelSetting
from lightning_energy.kareus.model import OverlapModel, Prediction
from lightning_energy.kareus.partition import SEQUENTIAL, ComputeOp, Partition, PartitionSetting
from lightning_energy.kareus.search import MeasuredPoint
from lightning_energy.kareus.workload import TransformerShape, _arrays

__all__ = ["DP_KEY", "SimulatedDataParallel", "least_energy_within"]

#: The partition key of a data-parallel backward in searches and measurement files.
DP_KEY = "dp_backward"


class SimulatedDataParallel:
    """A simulated data-parallel group that measures backwards with an overlapped gradient
    all-reduce.

    Args:
        model: the overlap model (its ``harness`` flag is ignored: the backward runs inside
            a training step).
        shape: the transformer (its ``tp_size`` splits the weights as in :mod:`.workload`).
        dp_size: data-parallel replicas (GPUs of the all-reduce), at least 2.
        bucket_caps_mb: the bucket sizes a setting's ``slot`` indexes.
        grad_bytes: bytes per gradient value (4: fp32 gradients, as under mixed precision).
        seed: seed of the noise.

    Raises:
        ConfigError: a bad ``dp_size``, bucket size or ``grad_bytes`` (every problem).
    """

    def __init__(
        self,
        model: OverlapModel,
        shape: TransformerShape,
        *,
        dp_size: int,
        bucket_caps_mb: Sequence[float],
        grad_bytes: int = 4,
        seed: int = 0,
    ) -> None:
        problems = []
        if dp_size < 2:
            problems.append(f"dp_size: {dp_size!r} is not allowed; use >= 2")
        if grad_bytes < 1:
            problems.append(f"grad_bytes: {grad_bytes!r} is not allowed; use >= 1")
        if not bucket_caps_mb:
            problems.append("bucket_caps_mb: give at least one bucket size")
        for cap in bucket_caps_mb:
            try:
                DataParallelSetting(bucket_cap_mb=cap)
            except ConfigError as exc:
                problems.append(str(exc))
        if problems:
            raise ConfigError(problems, source="simulated data-parallel group")
        self.model = OverlapModel(model.physics, harness=False)
        self.dp_size = dp_size
        self.bucket_caps_mb = tuple(float(c) for c in bucket_caps_mb)
        self._rng = np.random.default_rng(seed)
        tokens = float(shape.microbatch * shape.seq_len)
        self._ops: list[tuple[ComputeOp, float]] = []  # backward op, gradient bytes ready
        for _ in range(shape.layers):
            for key in ("mlp", "attn"):
                forward = shape.partition(f"fwd_{key}", nanobatched=False).ops
                weights = {
                    op.name: op.work / (2.0 * tokens) for op in forward if op.op_class == "gemm"
                }
                self._ops.extend(
                    (op, weights.get(op.name, 0.0) * grad_bytes)
                    for op in shape.partition(f"bwd_{key}", nanobatched=False).ops
                )

    @property
    def slots(self) -> tuple[int, ...]:
        """The ``slot`` of each bucket size (its index)."""
        return tuple(range(len(self.bucket_caps_mb)))

    def setting(self, point: PartitionSetting) -> DataParallelSetting:
        """The data-parallel setting a search point stands for."""
        return DataParallelSetting(
            ctas=point.ctas,
            bucket_cap_mb=self.bucket_caps_mb[point.slot],
            clock_mhz=point.clock_mhz,
        )

    def step_work(self, ctas: int, bucket_cap_mb: float, max_clock_mhz: int) -> StageWork:
        """The backward under ``ctas`` and ``bucket_cap_mb`` as work a simulated GPU runs
        (:class:`~lightning_energy.device.simulated.work.DataParallelSimulation`): its time
        at ``max_clock_mhz`` and the share of it that scales with the clock, both from this
        model without noise (the share from the time at half that clock). The GPU then runs
        it at the clock it is locked to, drawing its own power.

        Args:
            ctas: the CTAs of the gradient all-reduce.
            bucket_cap_mb: one of :attr:`bucket_caps_mb`.
            max_clock_mhz: the simulated GPU's highest SM clock.

        Raises:
            ConfigError: ``bucket_cap_mb`` is not one of :attr:`bucket_caps_mb`.
        """
        if bucket_cap_mb not in self.bucket_caps_mb:
            raise ConfigError(
                f"bucket_cap_mb: {bucket_cap_mb!r} is not allowed; use one of "
                f"{', '.join(f'{c:g}' for c in self.bucket_caps_mb)}"
            )
        slot = self.bucket_caps_mb.index(bucket_cap_mb)
        half = max_clock_mhz // 2
        settings = [PartitionSetting(max_clock_mhz, ctas, slot), PartitionSetting(half, ctas, slot)]
        (fast_s, _), (slow_s, _) = self.exact(DP_KEY, settings)
        share = (slow_s / fast_s - 1.0) / (max_clock_mhz / half - 1.0)
        return StageWork(fast_s, min(1.0, max(0.0, share)))

    def buckets(self, bucket_cap_mb: float) -> list[tuple[tuple[ComputeOp, ...], float]]:
        """The buckets under ``bucket_cap_mb``, in backward order: the compute ops that
        produce each and its gradient bytes."""
        cap_bytes = bucket_cap_mb * 1024 * 1024
        buckets: list[tuple[tuple[ComputeOp, ...], float]] = []
        ops: list[ComputeOp] = []
        size = 0.0
        for op, grad in self._ops:
            ops.append(op)
            size += grad
            if size >= cap_bytes:
                buckets.append((tuple(ops), size))
                ops, size = [], 0.0
        if size > 0:
            buckets.append((tuple(ops), size))
        elif ops:  # compute after the last gradient: beside the last bucket's all-reduce
            last_ops, last_size = buckets.pop()
            buckets.append((last_ops + tuple(ops), last_size))
        return buckets

    def partitions(self, bucket_cap_mb: float) -> list[tuple[Partition, int]]:
        """The backward under ``bucket_cap_mb`` as overlap-model partitions and slots."""
        buckets = self.buckets(bucket_cap_mb)
        ring = 2.0 * (self.dp_size - 1) / self.dp_size

        def partition(ops: tuple[ComputeOp, ...], grad: float, i: int) -> Partition:
            return Partition(f"{DP_KEY}[{i}]", ops, comm_bytes=ring * grad, tp_size=self.dp_size)

        first = partition(buckets[0][0], buckets[-1][1], 0)
        return [(first, SEQUENTIAL)] + [
            (partition(buckets[j + 1][0], buckets[j][1], j + 1), 0) for j in range(len(buckets) - 1)
        ]

    def measure(self, key: str, settings: Sequence[PartitionSetting]) -> list[tuple[float, float]]:
        """``(time_s, energy_j)`` of one noisy backward per setting."""
        return self._backwards(key, settings, lambda p, **s: self.model.measure(p, self._rng, **s))

    def exact(self, key: str, settings: Sequence[PartitionSetting]) -> list[tuple[float, float]]:
        """``(time_s, energy_j)`` of each setting's backward without noise."""
        return self._backwards(key, settings, self.model.predict)

    def _backwards(
        self,
        key: str,
        settings: Sequence[PartitionSetting],
        predict: Callable[..., Prediction],
    ) -> list[tuple[float, float]]:
        if key != DP_KEY:
            raise ConfigError(f"partition {key!r}: a data-parallel group measures {DP_KEY!r}")
        bad = sorted({s.slot for s in settings} - set(self.slots))
        if bad:
            raise ConfigError(
                f"slot {bad[0]} is not allowed; use the index of a bucket size, 0 to "
                f"{len(self.slots) - 1} ({', '.join(f'{c:g} MB' for c in self.bucket_caps_mb)})"
            )
        time_s = np.zeros(len(settings))
        energy_j = np.zeros(len(settings))
        for slot in sorted({s.slot for s in settings}):
            rows = [i for i, s in enumerate(settings) if s.slot == slot]
            arrays = _arrays([settings[i] for i in rows])
            for part, part_slot in self.partitions(self.bucket_caps_mb[slot]):
                pred = predict(part, **{**arrays, "slot": part_slot})
                time_s[rows] += pred.time_s
                energy_j[rows] += pred.energy_j
        return list(zip(time_s.tolist(), energy_j.tolist(), strict=True))


def least_energy_within(
    points: Sequence[MeasuredPoint], time_s: float, static_power_w: float
) -> MeasuredPoint | None:
    """The point of least effective energy taking at most ``time_s`` (None: none does).

    Args:
        points: measured points (a Pareto set or any).
        time_s: the target time.
        static_power_w: as for :func:`~.search.pareto_front`.
    """
    fitting = [p for p in points if p.time_s <= time_s]
    return min(fitting, key=lambda p: p.effective_energy_j(static_power_w), default=None)
