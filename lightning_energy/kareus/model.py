"""A physical model of a Kareus partition: compute and a collective sharing a GPU's SMs.

The simulated GPU's answer to "what do the CTAs, the launch slot and the clock do to a
partition?" (:mod:`.partition`). Its form, per GPU of the tensor-parallel group:

* **Compute ops** run one after another on the compute stream. Op ``k`` alone takes
  ``t_k = work_k / rate(class_k)`` at the reference clock (memory ops move bytes at
  ``memory_gbps``; GEMMs and attention do FLOPs at ``gemm_tflops`` and
  ``attention_tflops``); at clock ``f`` the compute-bound share ``beta`` of it scales with
  ``f_ref / f`` (``t_k(f) = t_k (beta f_ref / f + 1 - beta)``, as in
  :mod:`lightning_energy.device.simulated.physics`).
* **The collective alone** takes ``D = latency + V / (n r(b) g(f)) + V / link``: ``V`` bytes
  through ``n`` CTAs of ``b`` threads, each CTA moving ``r(b) = cta_gbps (b / 1024)^x`` at
  the reference clock (``g(f)`` the same clock scaling with its own compute-bound share),
  and never faster than the link. Its time falls with the CTAs and saturates.
* **Sharing.** While the collective runs, compute proceeds ``1 + sigma n / (N - n)`` times
  slower (its CTAs hold ``n`` of the ``N`` SMs); while compute runs, the collective
  proceeds ``1 + nu`` times slower (memory and SM contention). Both are tracked as rates
  that change when either side starts or stops, so an overlapped stretch takes at least
  the longer of the two and at most their sum plus the slowdowns.
* **Issue and waits** follow the host: the framework launches op ``k`` ``h(class_k)``
  seconds after op ``k - 1`` (the GPU may be ahead and wait) and issues the collective
  (``h_comm``) just before the op of its slot, so a late slot starts it later. Waiting for
  it mid-partition (a measured window ending before the last op) holds the host's next
  launch until it is done, plus ``sync_gap_s``; the partition ends when both sides are
  done. ``call_overhead_s`` is the measurement harness's fixed cost per call (Python set-up
  and its closing synchronisation), which a partition inside a training step does not pay.
* **Energy** per GPU: ``static_power_w`` for the whole time (computing, communicating or
  blocked), plus the compute ops' dynamic energy ``compute_power_w t_k`` (clock scaling
  of the A100 physics preset, unchanged by contention: the same work), plus the
  collective's ``(comm_power_w + cta_power_w n (b / 1024)^x) s(f)`` while it runs
  (``s(f)`` the preset's switching-power scale).
* **Noise**: measurements are the model times ``1 + N(0, time_noise)`` and
  ``1 + N(0, energy_noise)``, the spread of the measured repeats.

:func:`fit` calibrates every constant on a measured file (:mod:`.measured`) at one clock:
the rates, host costs, collective and sharing constants by least squares on the relative
errors of time and energy, the powers by non-negative least squares inside it. The
compute-bound shares are not identifiable at one clock and stay at their priors;
:func:`check` reports the model's errors on any other measured file, at any clock.

Example:
    >>> from lightning_energy.kareus.workload import MEASURED_FWD_ATTN
    >>> model = OverlapModel(shipped_physics())
    >>> fast, slow = model.predict(MEASURED_FWD_ATTN, clock_mhz=[1410, 1410], ctas=[20, 2],
    ...                            block_threads=1024, slot=0).time_s
    >>> bool(fast < slow)
    True
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import least_squares, nnls
from scipy.stats import spearmanr

from lightning_energy.device.simulated import PhysicsModel, physics_preset
from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.files import write_atomically
from lightning_energy.kareus.measured import PartitionMeasurements
from lightning_energy.kareus.partition import SEQUENTIAL, ComputeOp, Partition
from lightning_energy.numbers import is_finite

__all__ = [
    "CALIBRATION_FORMAT",
    "FitReport",
    "OverlapModel",
    "OverlapPhysics",
    "Prediction",
    "check",
    "fit",
    "shipped_physics",
]

log = logging.getLogger(__name__)

CALIBRATION_FORMAT = "lightning-energy/kareus-overlap-calibration"
_SHIPPED = "a100_fwd_attn_tp2.json"

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class OverlapPhysics:
    """The constants of the overlap model (see the module docstring).

    Attributes:
        gpu: the physics preset whose voltage curve scales power with the clock.
        ref_clock_mhz: the clock the rates and powers are for.
        num_sms: SMs of the GPU.
        memory_gbps: bytes per second of memory-bound ops, in GB/s.
        gemm_tflops: GEMM throughput, in TFLOP/s.
        attention_tflops: attention throughput, in TFLOP/s.
        host_memory_s: host time to launch a memory op.
        host_gemm_s: host time to launch a GEMM.
        host_attention_s: host time to launch attention.
        host_comm_s: host time to issue the collective.
        comm_latency_s: fixed time of the collective.
        cta_gbps: bytes per second one CTA of 1024 threads moves, in GB/s.
        cta_thread_exponent: ``x`` in ``(threads / 1024)^x`` (rate and power of a CTA).
        link_gbps: the most the collective moves per second, in GB/s.
        sm_slowdown: ``sigma``: compute slows by ``1 + sigma n / (N - n)`` with ``n`` CTAs.
        comm_slowdown: ``nu``: the collective slows by ``1 + nu`` while compute runs.
        sync_gap_s: host gap after a mid-partition wait for the collective.
        call_overhead_s: the measurement harness's fixed cost per partition call.
        static_power_w: power of a GPU whatever it does (also while blocked), in W.
        compute_power_w: dynamic power of compute at ``ref_clock_mhz``, in W.
        cta_power_w: dynamic power of one CTA of 1024 threads of the collective, in W.
        comm_power_w: dynamic power while the collective runs (links, memory), in W.
        memory_compute_share: compute-bound share ``beta`` of memory ops.
        gemm_compute_share: ``beta`` of GEMMs.
        attention_compute_share: ``beta`` of attention.
        comm_compute_share: ``beta`` of a CTA's copy rate.
        time_noise: relative standard deviation of a measured time.
        energy_noise: relative standard deviation of a measured energy.
    """

    gpu: str = "a100"
    ref_clock_mhz: int = 1410
    num_sms: int = 108
    memory_gbps: float = 1000.0
    gemm_tflops: float = 250.0
    attention_tflops: float = 150.0
    host_memory_s: float = 5e-5
    host_gemm_s: float = 5e-5
    host_attention_s: float = 5e-5
    host_comm_s: float = 2e-5
    comm_latency_s: float = 2e-5
    cta_gbps: float = 8.0
    cta_thread_exponent: float = 0.9
    link_gbps: float = 150.0
    sm_slowdown: float = 1.0
    comm_slowdown: float = 0.3
    sync_gap_s: float = 5e-5
    call_overhead_s: float = 3e-4
    static_power_w: float = 80.0
    compute_power_w: float = 250.0
    cta_power_w: float = 2.0
    comm_power_w: float = 5.0
    memory_compute_share: float = 0.2
    gemm_compute_share: float = 0.95
    attention_compute_share: float = 0.9
    comm_compute_share: float = 0.7
    time_noise: float = 0.0
    energy_noise: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "gpu":
                continue
            if not (is_finite(value) and value >= 0):
                problems.append(f"{f.name}: {value!r} is not allowed; use a finite number >= 0")
        for name in ("memory_gbps", "gemm_tflops", "attention_tflops", "cta_gbps", "link_gbps"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}: {getattr(self, name)!r} is not allowed; use > 0")
        for name in (
            "memory_compute_share",
            "gemm_compute_share",
            "attention_compute_share",
            "comm_compute_share",
        ):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name}: {getattr(self, name)!r} is not allowed; use 0..1")
        if problems:
            raise ConfigError(problems, source="overlap physics")

    def preset(self) -> PhysicsModel:
        """The physics preset named by :attr:`gpu`.

        Raises:
            ConfigError: not a preset.
        """
        return physics_preset(self.gpu)

    def to_dict(self) -> dict[str, Any]:
        """The constants as JSON-ready data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OverlapPhysics:
        """Constants from :meth:`to_dict` data.

        Raises:
            ConfigError: an unknown key or a bad value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown keys {unknown}; allowed: {sorted(names)}", "overlap physics"
            )
        return cls(**data)


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for a batch of settings of one partition.

    Attributes:
        time_s: time of one partition.
        energy_j: energy of every GPU of the tensor-parallel group over that time.
        comm_s: time the collective was running.
    """

    time_s: FloatArray
    energy_j: FloatArray
    comm_s: FloatArray


class OverlapModel:
    """Predicts (and, with noise, measures) partitions under settings.

    Args:
        physics: the constants (see :class:`OverlapPhysics`).
        harness: include the measurement harness's per-call overhead (True reproduces the
            micro-benchmark; False is a partition inside a training step).
    """

    def __init__(self, physics: OverlapPhysics, *, harness: bool = True) -> None:
        self.physics = physics
        self.harness = harness
        self._preset = physics.preset()
        ref = physics.ref_clock_mhz
        clocks = self._preset.sm_clocks_mhz
        if not clocks[-1] <= ref <= clocks[0]:
            raise ConfigError(
                f"ref_clock_mhz: {ref} is not allowed; use a clock of the {physics.gpu} "
                f"preset ({clocks[-1]}-{clocks[0]} MHz)",
                "overlap physics",
            )

    # ------------------------------------------------------------------ scaling
    def _time_scale(self, share: float, clock_mhz: FloatArray) -> FloatArray:
        return np.asarray(share * self.physics.ref_clock_mhz / clock_mhz + 1.0 - share)

    def _dynamic_energy_scale(self, share: float, clock_mhz: FloatArray) -> FloatArray:
        """Dynamic energy of work at ``clock_mhz`` over that at the reference clock."""
        p = self._preset

        def dynamic(f: float) -> float:
            return (p.work_power_w(share, f) - p.static_power_w) * p.work_time_s(1.0, share, f)

        return _per_clock(dynamic, self.physics.ref_clock_mhz, clock_mhz)

    def _switching_scale(self, clock_mhz: FloatArray) -> FloatArray:
        return _per_clock(self._preset.switching_scale, self.physics.ref_clock_mhz, clock_mhz)

    def op_rate(self, op_class: str) -> float:
        """Work per second of ops of ``op_class`` at the reference clock (bytes or FLOPs)."""
        ph = self.physics
        return {
            "memory": ph.memory_gbps * 1e9,
            "gemm": ph.gemm_tflops * 1e12,
            "attention": ph.attention_tflops * 1e12,
        }[op_class]

    def compute(
        self, ops: Sequence[ComputeOp], clock_mhz: FloatArray
    ) -> tuple[FloatArray, FloatArray]:
        """Compute ops alone at each clock: their times (clocks, ops) and the dynamic energy
        of all of them on one GPU (clocks,)."""
        clock = np.asarray(clock_mhz, dtype=np.float64)
        times = np.zeros((len(clock), len(ops)))
        dynamic_j = np.zeros(len(clock))
        for i, op in enumerate(ops):
            share = float(getattr(self.physics, f"{op.op_class}_compute_share"))
            t_ref = op.work / self.op_rate(op.op_class)
            times[:, i] = t_ref * self._time_scale(share, clock)
            scale = self._dynamic_energy_scale(share, clock)
            dynamic_j += self.physics.compute_power_w * t_ref * scale
        return times, dynamic_j

    # ------------------------------------------------------------------ predict
    def predict(
        self,
        partition: Partition,
        *,
        clock_mhz: ArrayLike,
        ctas: ArrayLike,
        block_threads: ArrayLike = 1024,
        slot: ArrayLike | None = None,
        window: tuple[ArrayLike, ArrayLike] | None = None,
    ) -> Prediction:
        """Time and energy of ``partition`` under a batch of settings (arrays broadcast).

        Args:
            partition: the partition.
            clock_mhz: locked SM clock of each setting.
            ctas: CTAs of the collective.
            block_threads: threads per CTA.
            slot: launch slot (:data:`~.partition.SEQUENTIAL` or an op index); the
                collective is waited for at the end of the partition.
            window: instead of ``slot``, measured windows ``(start, end)``: issued before op
                ``start``, waited for after op ``end``; ``(-1, -1)`` runs it alone first.

        Raises:
            ConfigError: both or neither of ``slot`` and ``window``, a slot or window
                outside the partition's ops, or CTAs outside ``1..num_sms - 1``.
        """
        if (slot is None) == (window is None):
            raise ConfigError("give either slot or window")
        start: ArrayLike
        end: ArrayLike
        if window is not None:
            start, end = window
        elif slot is not None:
            k = len(partition.ops)
            bad = sorted({int(s) for s in np.atleast_1d(slot)} - set(partition.slots))
            if bad:
                raise ConfigError(
                    f"slot {bad[0]} is not allowed; use {SEQUENTIAL} (sequential) or 0..{k - 1} "
                    f"(before an op of {partition.key!r})",
                    source="overlap model",
                )
            start = slot
            end = np.where(np.asarray(slot) == SEQUENTIAL, SEQUENTIAL, len(partition.ops) - 1)
        arrays = np.broadcast_arrays(
            np.asarray(clock_mhz, dtype=np.float64),
            np.asarray(ctas, dtype=np.float64),
            np.asarray(block_threads, dtype=np.float64),
            np.asarray(start, dtype=np.int64),
            np.asarray(end, dtype=np.int64),
        )
        clock, n, threads, win_start, win_end = (np.atleast_1d(a).ravel() for a in arrays)
        self._check(partition, clock, n, threads, win_start, win_end)
        return self._predict(partition, clock, n, threads, win_start, win_end)

    def _check(
        self,
        partition: Partition,
        clock: FloatArray,
        n: FloatArray,
        threads: FloatArray,
        start: IntArray,
        end: IntArray,
    ) -> None:
        k = len(partition.ops)
        problems = []
        sequential = (start == SEQUENTIAL) & (end == SEQUENTIAL)
        bad = ~sequential & ((start < 0) | (end < start) | (end >= k))
        if bad.any():
            problems.append(
                f"window ({int(start[bad][0])}, {int(end[bad][0])}) is not allowed; use (-1, -1) "
                f"(alone, first) or ops start <= end in 0..{k - 1} of {partition.key!r}"
            )
        if ((n < 1) | (n >= self.physics.num_sms)).any():
            problems.append(f"ctas: use 1..{self.physics.num_sms - 1}")
        if (threads < 1).any() or (clock <= 0).any():
            problems.append("block_threads and clock_mhz must be > 0")
        if problems:
            raise ConfigError(problems, source="overlap model")

    def _predict(
        self,
        partition: Partition,
        clock: FloatArray,
        n: FloatArray,
        threads: FloatArray,
        start: IntArray,
        end: IntArray,
    ) -> Prediction:
        ph = self.physics
        op_s, dynamic_j = self.compute(partition.ops, clock)
        host = np.asarray([getattr(ph, f"host_{op.op_class}_s") for op in partition.ops])
        per_cta = ph.cta_gbps * 1e9 * (threads / 1024.0) ** ph.cta_thread_exponent
        per_cta = per_cta / self._time_scale(ph.comm_compute_share, clock)
        comm_alone_s = (
            ph.comm_latency_s
            + partition.comm_bytes / (n * per_cta)
            + partition.comm_bytes / (ph.link_gbps * 1e9)
        )
        compute_slow = 1.0 + ph.sm_slowdown * n / (ph.num_sms - n)
        time_s, comm_s = _timeline(
            op_s,
            host,
            ph.host_comm_s,
            comm_alone_s,
            compute_slow,
            1.0 + ph.comm_slowdown,
            ph.sync_gap_s,
            start,
            end,
        )
        if self.harness:
            time_s = time_s + ph.call_overhead_s
        cta_w = ph.cta_power_w * n * (threads / 1024.0) ** ph.cta_thread_exponent
        comm_j = (ph.comm_power_w + cta_w) * self._switching_scale(clock) * comm_s
        energy_j = partition.tp_size * (ph.static_power_w * time_s + dynamic_j + comm_j)
        return Prediction(time_s, np.asarray(energy_j, dtype=np.float64), comm_s)

    def measure(
        self, partition: Partition, rng: np.random.Generator, **settings: Any
    ) -> Prediction:
        """:meth:`predict` with the measured noise applied (one measurement per setting).

        Args:
            partition: the partition.
            rng: where the noise comes from.
            **settings: as for :meth:`predict`.
        """
        exact = self.predict(partition, **settings)
        ph = self.physics
        shape = exact.time_s.shape
        return Prediction(
            exact.time_s * (1.0 + ph.time_noise * rng.standard_normal(shape)),
            exact.energy_j * (1.0 + ph.energy_noise * rng.standard_normal(shape)),
            exact.comm_s,
        )


def _per_clock(
    scale: Callable[[float], float], ref_clock_mhz: float, clock_mhz: FloatArray
) -> FloatArray:
    """``scale(f) / scale(f_ref)`` for every clock (computed once per distinct clock)."""
    clocks, where = np.unique(np.asarray(clock_mhz, dtype=np.float64), return_inverse=True)
    ref = scale(float(ref_clock_mhz))
    return np.asarray([scale(float(f)) / ref for f in clocks])[where.ravel()]


def _timeline(
    op_s: FloatArray,
    host_s: FloatArray,
    host_comm_s: float,
    comm_alone_s: FloatArray,
    compute_slow: FloatArray,
    comm_slow: float,
    sync_gap_s: float,
    start: IntArray,
    end: IntArray,
) -> tuple[FloatArray, FloatArray]:
    """Advance every setting event by event: op starts and ends, the collective's issue and
    end, the host's resumption after a mid-partition wait. Rates stay constant between
    events. Returns the partition time and how long the collective ran.

    ``op_s`` is (settings, ops); a sequential setting is issued before op 0 and waited for
    before any op (``end = -1``).
    """
    m, k = op_s.shape
    sequential = start == SEQUENTIAL
    start = np.where(sequential, 0, start)
    end = np.where(sequential, -1, end)
    launched = np.cumsum(host_s)  # host time when op j is launched (without the collective)
    before = np.concatenate([[0.0], launched])
    issue_s = before[start] + host_comm_s
    host_after_end = np.where(end >= 0, launched[np.maximum(end, 0)], 0.0) + host_comm_s
    rows = np.arange(m)
    now = np.zeros(m)
    op = np.zeros(m, dtype=np.int64)
    op_left = op_s[:, 0].copy()
    comm_left = comm_alone_s.astype(np.float64).copy()
    comm_s = np.zeros(m)
    resume = np.full(m, np.inf)
    for _ in range(4 * k + 8):
        j = np.minimum(op, k - 1)
        own = launched[j] + np.where(start <= j, host_comm_s, 0.0)
        after_wait = resume + sync_gap_s + launched[j] - launched[np.maximum(end, 0)] * (end >= 0)
        available = np.where(j <= end, own, after_wait)
        computing = (op < k) & (available <= now)
        communicating = (comm_left > 0) & (issue_s <= now)
        compute_rate = np.where(communicating, 1.0 / compute_slow, 1.0)
        comm_rate = np.where(computing, 1.0 / comm_slow, 1.0)
        step = np.full(m, np.inf)
        step = np.where(computing, np.minimum(step, op_left / compute_rate), step)
        step = np.where((op < k) & ~computing, np.minimum(step, available - now), step)
        step = np.where(communicating, np.minimum(step, comm_left / comm_rate), step)
        step = np.where((comm_left > 0) & ~communicating, np.minimum(step, issue_s - now), step)
        finished = ~np.isfinite(step)
        if finished.all():
            break
        step = np.where(finished, 0.0, step)
        op_left = np.where(computing, op_left - step * compute_rate, op_left)
        comm_left = np.where(communicating, comm_left - step * comm_rate, comm_left)
        comm_s += np.where(communicating, step, 0.0)
        now = now + step
        done_op = computing & (op_left <= 1e-15)
        op = np.where(done_op, op + 1, op)
        op_left = np.where(done_op, op_s[rows, np.minimum(op, k - 1)], op_left)
        comm_left = np.where(communicating & (comm_left <= 1e-15), 0.0, comm_left)
        # After launching op ``end`` the host waits for the collective, then launches on.
        waiting = (comm_left <= 0) & ~np.isfinite(resume)
        resume = np.where(waiting, np.maximum(host_after_end, now), resume)
    else:  # pragma: no cover - the event count is bounded by construction
        raise RuntimeError("partition timeline did not finish")
    return now, comm_s


# ---------------------------------------------------------------------- fit and check
@dataclass(frozen=True)
class FitReport:
    """How well a model reproduces measurements (relative errors of the means).

    Attributes:
        source: the measurements.
        clock_mhz: the clock they were taken at.
        settings: how many settings were compared.
        time_median_error: median relative error of time.
        time_max_error: largest relative error of time.
        energy_median_error: median relative error of energy.
        energy_max_error: largest relative error of energy.
        time_rank_correlation: Spearman correlation of predicted and measured times.
        energy_rank_correlation: the same for energies.
    """

    source: str
    clock_mhz: int
    settings: int
    time_median_error: float
    time_max_error: float
    energy_median_error: float
    energy_max_error: float
    time_rank_correlation: float
    energy_rank_correlation: float

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        """The report in words, one line per measure."""
        return [
            f"{self.source} at {self.clock_mhz} MHz, {self.settings} settings",
            f"time:   median error {self.time_median_error:.2%}, max {self.time_max_error:.2%}, "
            f"rank correlation {self.time_rank_correlation:.3f}",
            f"energy: median error {self.energy_median_error:.2%}, "
            f"max {self.energy_max_error:.2%}, rank correlation {self.energy_rank_correlation:.3f}",
        ]


def check(
    model: OverlapModel,
    partition: Partition,
    measurements: PartitionMeasurements,
    clock_mhz: int,
) -> FitReport:
    """The model's errors on measurements of ``partition`` taken at ``clock_mhz``.

    Raises:
        ConfigError: a measured window or CTA count the partition cannot have.
    """
    pred = _predict_measured(model, partition, measurements, float(clock_mhz))
    return _report(measurements, int(clock_mhz), pred.time_s, pred.energy_j)


def _predict_measured(
    model: OverlapModel, partition: Partition, rows: PartitionMeasurements, clock_mhz: float
) -> Prediction:
    return model.predict(
        partition,
        clock_mhz=np.full(len(rows), clock_mhz),
        ctas=rows.ctas,
        block_threads=rows.block_threads,
        window=(rows.window_start, rows.window_end),
    )


def _report(
    rows: PartitionMeasurements, clock_mhz: int, time_s: FloatArray, energy_j: FloatArray
) -> FitReport:
    t_err = np.abs(time_s / rows.time_s - 1.0)
    e_err = np.abs(energy_j / rows.energy_j - 1.0)
    return FitReport(
        source=rows.source,
        clock_mhz=clock_mhz,
        settings=len(rows),
        time_median_error=float(np.median(t_err)),
        time_max_error=float(t_err.max()),
        energy_median_error=float(np.median(e_err)),
        energy_max_error=float(e_err.max()),
        time_rank_correlation=_spearman(time_s, rows.time_s),
        energy_rank_correlation=_spearman(energy_j, rows.energy_j),
    )


def _spearman(a: FloatArray, b: FloatArray) -> float:
    if len(a) < 2:
        return float("nan")
    return float(spearmanr(a, b).statistic)


#: The constants :func:`fit` adjusts by nonlinear least squares (as logarithms).
_FITTED = (
    "memory_gbps",
    "gemm_tflops",
    "attention_tflops",
    "host_memory_s",
    "host_gemm_s",
    "host_attention_s",
    "host_comm_s",
    "comm_latency_s",
    "cta_gbps",
    "link_gbps",
    "sm_slowdown",
    "comm_slowdown",
    "sync_gap_s",
    "call_overhead_s",
)
#: The powers :func:`fit` solves for by non-negative least squares at each step.
_POWERS = ("static_power_w", "compute_power_w", "cta_power_w", "comm_power_w")


def fit(
    partition: Partition,
    measurements: PartitionMeasurements,
    clock_mhz: int,
    *,
    initial: OverlapPhysics | None = None,
    max_evaluations: int = 400,
) -> tuple[OverlapModel, FitReport]:
    """Calibrate the model on measurements of ``partition`` taken at ``clock_mhz``.

    Args:
        partition: the measured partition (its ops and collective).
        measurements: the measured settings.
        clock_mhz: the clock they were taken at (it becomes ``ref_clock_mhz``).
        initial: where the search starts (default :class:`OverlapPhysics` defaults); its
            compute-bound shares and preset are kept.
        max_evaluations: the most model evaluations of the least-squares search.

    Returns:
        The calibrated model (noise from the measured repeats) and its errors on the
        measurements.

    Raises:
        ConfigError: a measured window or CTA count the partition cannot have.
    """
    start = dataclasses.replace(initial or OverlapPhysics(), ref_clock_mhz=int(clock_mhz))
    noise_t, noise_e = measurements.noise()
    start = dataclasses.replace(start, time_noise=noise_t, energy_noise=noise_e)
    OverlapModel(start)._check(
        partition,
        np.full(len(measurements), float(clock_mhz)),
        measurements.ctas.astype(np.float64),
        measurements.block_threads.astype(np.float64),
        measurements.window_start,
        measurements.window_end,
    )
    x0 = np.log([max(getattr(start, name), 1e-12) for name in _FITTED] + [1.0])
    x0[-1] = start.cta_thread_exponent
    lower = np.full(len(x0), -30.0)
    upper = np.full(len(x0), 10.0)
    lower[-1], upper[-1] = 0.0, 2.0
    x0 = np.clip(x0, lower + 1e-9, upper - 1e-9)
    tp = partition.tp_size
    t_meas, e_meas = measurements.time_s, measurements.energy_j

    def physics_at(x: FloatArray, powers: FloatArray | None = None) -> OverlapPhysics:
        values: dict[str, Any] = {
            name: float(np.exp(v)) for name, v in zip(_FITTED, x[:-1], strict=True)
        }
        values["cta_thread_exponent"] = float(x[-1])
        if powers is not None:
            values.update({name: float(p) for name, p in zip(_POWERS, powers, strict=True)})
        return dataclasses.replace(start, **values)

    def solve(x: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Times, the powers' design matrix and the least-squares powers for ``x``."""
        ph = physics_at(x)
        model = OverlapModel(ph)
        pred = _predict_measured(model, partition, measurements, float(clock_mhz))
        busy_s = sum(op.work / model.op_rate(op.op_class) for op in partition.ops)
        cta = measurements.ctas * (measurements.block_threads / 1024.0) ** ph.cta_thread_exponent
        design = tp * np.column_stack(
            [pred.time_s, np.full(len(measurements), busy_s), cta * pred.comm_s, pred.comm_s]
        )
        powers, _ = nnls(design / e_meas[:, None], np.ones(len(e_meas)))
        return pred.time_s, design, powers

    def residuals(x: FloatArray) -> FloatArray:
        time_s, design, powers = solve(x)
        return np.concatenate([time_s / t_meas - 1.0, design @ powers / e_meas - 1.0])

    result = least_squares(
        residuals, x0, bounds=(lower, upper), x_scale="jac", max_nfev=max_evaluations
    )
    _, _, powers = solve(result.x)
    model = OverlapModel(physics_at(result.x, powers))
    report = check(model, partition, measurements, clock_mhz)
    log.info("Overlap model fitted on %s: %s", measurements.source, "; ".join(report.lines()))
    return model, report


# ---------------------------------------------------------------------- calibration files
def save_calibration(
    model: OverlapModel, report: FitReport, path: str | os.PathLike[str], *, provenance: str
) -> None:
    """Write a calibration (constants, fit report, provenance) as JSON, atomically."""
    data = {
        "format": CALIBRATION_FORMAT,
        "version": 1,
        "provenance": provenance,
        "physics": model.physics.to_dict(),
        "fit": report.to_dict(),
    }
    write_atomically(path, json.dumps(data, indent=1) + "\n")


def load_calibration(path: str | os.PathLike[str]) -> tuple[OverlapPhysics, dict[str, Any]]:
    """Read a calibration written by :func:`save_calibration`: constants and fit report.

    Raises:
        ProfileError: unreadable, not a calibration, or bad constants.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or a number too long
        raise ProfileError(f"cannot read the overlap calibration {path}: {exc}") from exc
    return _parse_calibration(data, str(path))


def _parse_calibration(data: Any, source: str) -> tuple[OverlapPhysics, dict[str, Any]]:
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise ProfileError(f"{source}: not an overlap calibration (format {CALIBRATION_FORMAT!r})")
    try:
        return OverlapPhysics.from_dict(dict(data["physics"])), dict(data.get("fit") or {})
    except (KeyError, TypeError, ConfigError) as exc:
        raise ProfileError(f"{source}: bad overlap calibration: {exc}") from exc


def shipped_physics() -> OverlapPhysics:
    """The constants calibrated on the measured A100 forward-attention partition (package
    data ``kareus/a100_fwd_attn_tp2.json``, written by ``benchmarks/kareus.py
    --calibrate``)."""
    text = (resources.files("lightning_energy") / "data" / "kareus" / _SHIPPED).read_text()
    return _parse_calibration(json.loads(text), _SHIPPED)[0]
