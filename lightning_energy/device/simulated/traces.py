"""Trace-driven GPU model: replays measured time and power per power limit.

The traces are Zeus power files (Zeus, NSDI'23, Apache-2.0): one row per (dataset,
network, batch size, optimizer, power limit) with the measured ``time_per_epoch`` (s) and
``average_power`` (W) of one epoch on an NVIDIA A40 or V100. Between measured limits both
are interpolated linearly; outside the measured range they are clamped to the nearest
measured limit. A training step takes ``time_per_epoch / steps_per_epoch``; by default an
epoch is the dataset's training set in batches (:data:`DATASET_SIZES`), so a step of the
A40's ImageNet/ResNet-50 at batch size 128 takes about 0.37 s, as it did when measured.

Trace GPUs do not model SM clocks (the traces vary only the power limit): clock locking
raises :class:`~lightning_energy.errors.NotSupportedError`. Work given as
``(t0, compute_bound_share)`` runs ``t0 * (beta * r(p) + 1 - beta)`` where ``r(p)`` is the
workload's measured slowdown at power limit ``p`` relative to the highest measured limit:
the power limit slows the compute-bound share as it slowed the traced workload, and the
memory-bound share not at all. A GPU that is not computing draws ``idle_power_w``, which the
traces do not contain (defaults: 30 W for the A40, 35 W for the V100, approximate idle
draws of those boards).

Example:
    >>> trace = PowerTrace.load("a40")
    >>> ("imagenet", "resnet50", 128) in trace.workloads()
    True
    >>> trace.workload("imagenet", "resnet50", 128).time_per_epoch_s(300.0)
    3739.5
"""

from __future__ import annotations

import bisect
import csv
import importlib.resources
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_energy.errors import ProfileError

__all__ = [
    "DATASET_SIZES",
    "DEFAULT_STEPS_PER_EPOCH",
    "TRACE_GPUS",
    "PowerTrace",
    "TraceModel",
    "WorkloadTrace",
    "epoch_steps",
]

_COLUMNS = (
    "dataset",
    "network",
    "batch_size",
    "optimizer",
    "power_limit",
    "time_per_epoch",
    "average_power",
)

# Shipped trace name -> (file name, GPU name, approximate idle power in W).
TRACE_GPUS: dict[str, tuple[str, str, float]] = {
    "a40": ("zeus_summary_power_a40.csv", "NVIDIA A40", 30.0),
    "v100": ("zeus_summary_power_v100.csv", "NVIDIA V100", 35.0),
}
_DEFAULT_IDLE_POWER_W = 30.0

#: Training-set sizes of the traced datasets (samples per epoch): ImageNet-1k, CIFAR-100,
#: LibriSpeech (960 h, utterances), MovieLens-1M (ratings), Sentiment140 (tweets) and
#: SQuAD v1.1 (questions).
DATASET_SIZES: dict[str, int] = {
    "imagenet": 1_281_167,
    "cifar100": 50_000,
    "librispeech": 281_241,
    "movielens-1m": 1_000_209,
    "sentiment140": 1_600_000,
    "squad": 87_599,
}
#: Steps per epoch of a dataset of unknown size (custom CSV traces).
DEFAULT_STEPS_PER_EPOCH = 100


def epoch_steps(dataset: str, batch_size: int) -> int:
    """Training steps in one epoch of ``dataset`` at ``batch_size`` (the last batch counted).

    Datasets not in :data:`DATASET_SIZES` get :data:`DEFAULT_STEPS_PER_EPOCH`.
    """
    size = DATASET_SIZES.get(dataset)
    if size is None or batch_size < 1:
        return DEFAULT_STEPS_PER_EPOCH
    return -(-size // batch_size)


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation through ``(xs, ys)`` (xs ascending), clamped."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = bisect.bisect_right(xs, x)
    lo = hi - 1
    w = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + w * (ys[hi] - ys[lo])


@dataclass(frozen=True)
class WorkloadTrace:
    """Measured epoch time and average power of one workload at each measured power limit.

    Attributes:
        dataset: dataset name, e.g. ``"imagenet"``.
        network: network name, e.g. ``"resnet50"``.
        batch_size: the batch size measured.
        optimizer: the optimizer measured.
        power_limits_w: measured power limits, ascending.
        times_per_epoch_s: epoch time at each measured limit.
        average_powers_w: average power at each measured limit.
    """

    dataset: str
    network: str
    batch_size: int
    optimizer: str
    power_limits_w: tuple[float, ...]
    times_per_epoch_s: tuple[float, ...]
    average_powers_w: tuple[float, ...]

    def time_per_epoch_s(self, power_limit_w: float) -> float:
        """Epoch time at ``power_limit_w`` (linear between measured limits, clamped)."""
        return _interpolate(self.power_limits_w, self.times_per_epoch_s, power_limit_w)

    def average_power_w(self, power_limit_w: float) -> float:
        """Average power at ``power_limit_w`` (linear between measured limits, clamped)."""
        return _interpolate(self.power_limits_w, self.average_powers_w, power_limit_w)


class PowerTrace:
    """A Zeus-format power trace file: every workload measured on one GPU class.

    Use :meth:`load`; rows are validated when loaded.

    Args:
        source: where the rows came from (named in errors).
        gpu_name: the GPU class's name.
        idle_power_w: power a GPU of this class draws while not computing.
        rows: validated rows, keyed by (dataset, network, batch size, optimizer), each a
            list of ``(power_limit_w, time_per_epoch_s, average_power_w)``.
    """

    def __init__(
        self,
        source: str,
        gpu_name: str,
        idle_power_w: float,
        rows: dict[tuple[str, str, int, str], list[tuple[float, float, float]]],
    ) -> None:
        self.source = source
        self.gpu_name = gpu_name
        self.idle_power_w = idle_power_w
        self._rows = rows

    @classmethod
    def load(cls, path_or_name: str | Path) -> PowerTrace:
        """Read and validate a power trace.

        Args:
            path_or_name: a shipped trace name (``"a40"``, ``"v100"``) or the path of a
                Zeus-format CSV file.

        Returns:
            The trace.

        Raises:
            ProfileError: the file is missing or a row is malformed (the file, the row
                number and the problem are named).
        """
        key = str(path_or_name)
        if key in TRACE_GPUS:
            file_name, gpu_name, idle_power_w = TRACE_GPUS[key]
            resource = (
                importlib.resources.files("lightning_energy") / "data" / "gpu_profiles" / file_name
            )
            return cls._parse(resource.read_text(encoding="utf-8"), key, gpu_name, idle_power_w)
        path = Path(path_or_name)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(
                f"{path}: cannot read power trace ({exc.strerror or exc}); shipped traces: "
                f"{sorted(TRACE_GPUS)}"
            ) from exc
        return cls._parse(text, str(path), path.stem, _DEFAULT_IDLE_POWER_W)

    @classmethod
    def _parse(cls, text: str, source: str, gpu_name: str, idle_power_w: float) -> PowerTrace:
        reader = csv.DictReader(text.splitlines())
        missing = [c for c in _COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ProfileError(f"{source}: missing columns {missing}; required: {list(_COLUMNS)}")
        rows: dict[tuple[str, str, int, str], list[tuple[float, float, float]]] = {}
        seen: dict[tuple[str, str, int, str, float], int] = {}
        for line, row in enumerate(reader, start=2):
            try:
                batch_size = int(row["batch_size"])
                limit_w = float(row["power_limit"])
                time_s = float(row["time_per_epoch"])
                power_w = float(row["average_power"])
            except (TypeError, ValueError):
                raise ProfileError(
                    f"{source}, row {line}: batch_size, power_limit, time_per_epoch and "
                    f"average_power must be numbers, got {dict(row)}"
                ) from None
            if not (row["dataset"] and row["network"] and row["optimizer"]):
                raise ProfileError(f"{source}, row {line}: dataset, network and optimizer needed")
            bad = {
                k: v
                for k, v in (
                    ("batch_size", batch_size),
                    ("power_limit", limit_w),
                    ("time_per_epoch", time_s),
                    ("average_power", power_w),
                )
                if not v > 0
            }
            if bad:
                raise ProfileError(f"{source}, row {line}: must be positive: {bad}")
            workload = (row["dataset"], row["network"], batch_size, row["optimizer"])
            first = seen.setdefault((*workload, limit_w), line)
            if first != line:
                raise ProfileError(
                    f"{source}, row {line}: duplicate of row {first} "
                    f"(workload {workload}, power_limit {limit_w:g})"
                )
            rows.setdefault(workload, []).append((limit_w, time_s, power_w))
        if not rows:
            raise ProfileError(f"{source}: no rows")
        return cls(source, gpu_name, idle_power_w, rows)

    def workloads(self) -> list[tuple[str, str, int]]:
        """Every measured ``(dataset, network, batch_size)``, in file order."""
        return list(dict.fromkeys((d, n, b) for d, n, b, _ in self._rows))

    def optimizers(self, dataset: str, network: str, batch_size: int) -> list[str]:
        """The optimizers measured for a workload, in file order."""
        return [o for d, n, b, o in self._rows if (d, n, b) == (dataset, network, batch_size)]

    def power_limit_range_w(self) -> tuple[float, float]:
        """The lowest and highest power limit measured in the whole file."""
        limits = [limit for points in self._rows.values() for limit, _, _ in points]
        return min(limits), max(limits)

    def workload(
        self, dataset: str, network: str, batch_size: int, optimizer: str | None = None
    ) -> WorkloadTrace:
        """The measurements of one workload.

        Args:
            dataset: e.g. ``"imagenet"``.
            network: e.g. ``"resnet50"``.
            batch_size: a measured batch size.
            optimizer: which optimizer's measurements, when several were measured (default:
                the first in the file).

        Returns:
            The workload's trace.

        Raises:
            ProfileError: no such workload; the message lists the available ones.
        """
        optimizers = self.optimizers(dataset, network, batch_size)
        if not optimizers or (optimizer is not None and optimizer not in optimizers):
            available = ", ".join(f"{d}/{n} batch {b}" for d, n, b in self.workloads())
            wanted = f"{dataset}/{network} batch {batch_size}"
            if optimizer is not None:
                wanted += f" optimizer {optimizer}"
            raise ProfileError(f"{self.source}: no workload {wanted}; available: {available}")
        chosen = optimizer if optimizer is not None else optimizers[0]
        points = sorted(self._rows[(dataset, network, batch_size, chosen)])
        return WorkloadTrace(
            dataset=dataset,
            network=network,
            batch_size=batch_size,
            optimizer=chosen,
            power_limits_w=tuple(p[0] for p in points),
            times_per_epoch_s=tuple(p[1] for p in points),
            average_powers_w=tuple(p[2] for p in points),
        )


@dataclass(frozen=True)
class TraceModel:
    """A GPU replaying one workload of a power trace.

    Attributes:
        name: the GPU class's name.
        workload: the replayed workload.
        steps_per_epoch: training steps per epoch (a step takes epoch time / this).
        min_power_limit_w: lowest measured power limit of the trace file.
        max_power_limit_w: highest measured power limit (also the default limit).
        idle_power_w: power drawn while not computing.
    """

    name: str
    workload: WorkloadTrace
    steps_per_epoch: int
    min_power_limit_w: float
    max_power_limit_w: float
    idle_power_w: float

    @classmethod
    def from_trace(
        cls, trace: PowerTrace, workload: WorkloadTrace, steps_per_epoch: int | None = None
    ) -> TraceModel:
        """A model replaying ``workload`` on the GPU class of ``trace``.

        ``steps_per_epoch`` None: the workload's dataset in batches of its batch size.
        """
        lo, hi = trace.power_limit_range_w()
        if steps_per_epoch is None:
            steps_per_epoch = epoch_steps(workload.dataset, workload.batch_size)
        return cls(trace.gpu_name, workload, steps_per_epoch, lo, hi, trace.idle_power_w)

    @property
    def default_power_limit_w(self) -> float:
        """The default power limit: the highest measured one."""
        return self.max_power_limit_w

    @property
    def sm_clocks_mhz(self) -> tuple[int, ...]:
        """Empty: trace GPUs do not model SM clocks."""
        return ()

    def step_work(self) -> tuple[float, float]:
        """``(t0_s, compute_bound_share)`` of one training step at the highest limit."""
        return self.workload.time_per_epoch_s(self.max_power_limit_w) / self.steps_per_epoch, 1.0

    def run(
        self,
        t0_s: float,
        compute_bound_share: float,
        power_limit_w: float,
        max_clock_mhz: int | None,
    ) -> tuple[float, float]:
        """Duration and average power of work taking ``t0_s`` at the highest limit.

        Args:
            t0_s: duration at the highest measured power limit.
            compute_bound_share: the share of ``t0_s`` the power limit slows down.
            power_limit_w: the power limit in force.
            max_clock_mhz: must be None (trace GPUs cannot lock clocks).

        Returns:
            ``(duration_s, power_w)``.
        """
        assert max_clock_mhz is None, "trace GPUs do not model clocks"
        ratio = self.workload.time_per_epoch_s(power_limit_w) / self.workload.time_per_epoch_s(
            self.max_power_limit_w
        )
        beta = compute_bound_share
        return t0_s * (beta * ratio + 1.0 - beta), self.workload.average_power_w(power_limit_w)
