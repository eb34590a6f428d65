"""GPU access behind one small protocol, with an NVML, a zeusd and a simulated backend.

:func:`open_devices` picks the backend: NVML for real NVIDIA GPUs, zeusd for the same GPUs
when this process may not change their settings itself but Zeus' daemon may, the simulated
GPU otherwise (or when asked). Precedence of the choice: the ``backend`` argument when
given, else the ``LIGHTNING_ENERGY_DEVICE`` environment variable (``auto``, ``nvml``,
``zeusd`` or ``simulated``), else ``auto``. Under ``auto`` a framework computing on the
CPU (its device is not a CUDA device) gets the simulated backend even where NVML sees GPUs:
the GPU its local rank would name may be another job's.

Example:
    >>> devices = open_devices("simulated", simulated=SimulatedSpec(gpu="a40", count=2))
    >>> devices.backend, len(devices)
    ('simulated', 2)
    >>> devices.run_step()
    >>> devices.clock() > 0
    True
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from lightning_energy.device.base import GPU, DeviceSet, GPUInfo, StageWork, gpu_info
from lightning_energy.device.mapping import (
    CudaRuntime,
    TorchCuda,
    nvml_gpu_for_device,
)
from lightning_energy.device.nvml import NVMLGPU, nvml_gpus, visible_gpu_count
from lightning_energy.device.simulated import (
    FAULT_OPERATIONS,
    PHYSICS_PRESETS,
    PhysicsModel,
    PowerTrace,
    SimulatedGPU,
    SimulatedSpec,
    TraceModel,
    VirtualClock,
    WorkloadTrace,
    as_simulated,
    live_simulated_gpus,
    physics_preset,
    run_in_parallel,
    simulated_gpus,
)
from lightning_energy.device.zeusd import ZeusdGPU, daemon_for_backend, gpu_factory
from lightning_energy.device.zeusd_client import ZeusdClient
from lightning_energy.errors import ConfigError, DriverError

if TYPE_CHECKING:
    import torch

    from lightning_energy.config import DeviceConfig
    from lightning_energy.device.cuda_events import CudaStream
    from lightning_energy.device.simulated.work import WorkRunner

__all__ = [
    "BACKENDS",
    "DEVICE_ENV_VAR",
    "FAULT_OPERATIONS",
    "GPU",
    "NVMLGPU",
    "PHYSICS_PRESETS",
    "CudaRuntime",
    "DeviceSet",
    "GPUInfo",
    "PhysicsModel",
    "PowerTrace",
    "SimulatedGPU",
    "SimulatedSpec",
    "StageWork",
    "TorchCuda",
    "TraceModel",
    "VirtualClock",
    "WorkloadTrace",
    "ZeusdGPU",
    "cuda_stream",
    "current_torch_device",
    "gpu_info",
    "live_simulated_gpus",
    "nvml_gpus",
    "open_devices",
    "open_rank_devices",
    "physics_preset",
    "run_in_parallel",
    "simulated_gpus",
    "work_runner",
]

logger = logging.getLogger(__name__)

DEVICE_ENV_VAR = "LIGHTNING_ENERGY_DEVICE"
BACKENDS = ("auto", "nvml", "zeusd", "simulated")


def current_torch_device() -> torch.device:
    """The device torch computes on when nothing else says: the current CUDA device when
    CUDA is available, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def open_rank_devices(
    config: DeviceConfig,
    *,
    node_rank: int,
    local_rank: int,
    device: torch.device | None = None,
) -> DeviceSet:
    """One rank's GPUs from the ``device:`` section, as the framework's device says: a CUDA
    device is its GPU; the CPU is a simulated GPU under ``backend: auto`` and the local
    rank's GPU under ``nvml`` (see :func:`open_devices`).

    Args:
        config: the ``device:`` section.
        node_rank: the rank's node (simulated GPUs of different nodes are different GPUs,
            as real ones are).
        local_rank: the rank on its node.
        device: the framework's root device (None: unknown).
    """
    spec = config.simulated_spec()
    if node_rank:
        spec = replace(
            spec,
            seed=spec.seed + 1000 * node_rank,
            uuid_prefix=f"GPU-sim-{spec.label}-n{node_rank}",
        )
    return open_devices(
        config.backend,
        simulated=replace(spec, seed=spec.seed + local_rank),
        local_rank=local_rank,
        device=device,
    )


def work_runner(gpu: GPU) -> WorkRunner | None:
    """What runs a job's GPU work on ``gpu`` in the calling thread, for Perseus to time it.

    A simulated GPU runs the work it is given on its virtual clock
    (:class:`~lightning_energy.device.simulated.work.WorkRunner`: a pipeline's
    instructions, a data-parallel step). A real GPU gives None: its work is the
    framework's kernels, timed with CUDA events on the stage's stream.
    """
    simulated = as_simulated(gpu)
    if simulated is None:
        return None
    from lightning_energy.device.simulated.work import WorkRunner  # imports torch

    return WorkRunner(simulated)


def cuda_stream(device: torch.device | None) -> CudaStream | None:
    """The stream a CUDA device runs a job's GPU work on, timed and followed with CUDA
    events (:class:`~lightning_energy.device.cuda_events.CudaStream`), for Perseus to time
    that work on a real GPU; None where there is no stream (a device that is not a CUDA
    device, no CUDA). None for ``device`` stands for the calling thread's current CUDA
    device. A simulated GPU's work runs through :func:`work_runner` instead.
    """
    from lightning_energy.device.cuda_events import stream_of  # imports torch

    return stream_of(device)


def _what_nvml_drives(indices: Sequence[int] | None, local_rank: int | None) -> str:
    """The GPUs the NVML backend would open without a CUDA device, for log lines."""
    if local_rank is not None:
        return f"GPU {local_rank}"
    if indices is not None:
        return f"GPUs {list(indices)}"
    return "the visible GPUs"


def _simulated_set(
    spec: SimulatedSpec, indices: Sequence[int] | None, local_rank: int | None
) -> DeviceSet:
    if local_rank is not None:
        slowdowns = spec.slowdowns[local_rank : local_rank + 1]
        spec = replace(
            spec, count=1, first_index=spec.first_index + local_rank, slowdowns=slowdowns
        )
    gpus = simulated_gpus(spec)
    if indices is not None:
        by_index = {gpu.index: gpu for gpu in gpus}
        missing = [i for i in indices if i not in by_index]
        if missing:
            raise ConfigError(
                f"indices={list(indices)!r}: {missing} not among the simulated GPUs "
                f"{sorted(by_index)}"
            )
        gpus = [by_index[i] for i in indices]

    def run_step() -> None:
        run_in_parallel(gpus)

    return DeviceSet(gpus=gpus, clock=gpus[0].clock.now, backend="simulated", run_step=run_step)


def _nvml_set(
    indices: Sequence[int] | None,
    local_rank: int | None,
    device: torch.device | None,
    cuda: CudaRuntime | None,
    daemon: ZeusdClient | None = None,
) -> DeviceSet:
    """The NVML GPUs asked for; changed through ``daemon`` (the zeusd backend) if given."""
    factory = gpu_factory(daemon)
    if device is not None and device.type == "cuda":
        gpus = [nvml_gpu_for_device(device, cuda, factory=factory)]
    else:
        # nvml_gpus numbers the visible GPUs as CUDA does (or refuses when it cannot).
        gpus = nvml_gpus([local_rank] if local_rank is not None else indices, factory=factory)
    backend = "nvml" if daemon is None else "zeusd"
    return DeviceSet(gpus=gpus, clock=time.perf_counter, backend=backend)


def open_devices(
    backend: str | None = None,
    *,
    indices: Sequence[int] | None = None,
    simulated: SimulatedSpec | None = None,
    local_rank: int | None = None,
    device: torch.device | None = None,
    cuda: CudaRuntime | None = None,
) -> DeviceSet:
    """Open the GPUs this process drives.

    Args:
        backend: ``"auto"`` (NVML when ``device`` is a CUDA device or None and NVML
            initialises and sees a GPU, changed through zeusd when ``ZEUSD_SOCK_PATH`` or
            ``ZEUSD_HOST_PORT`` is set and this process lacks ``CAP_SYS_ADMIN``; else
            simulated, with one INFO log line saying why), ``"nvml"``, ``"zeusd"`` (NVML's
            GPUs changed through the zeusd those variables name, else through zeusd's
            default socket) or ``"simulated"``. None: the ``LIGHTNING_ENERGY_DEVICE``
            environment variable, else ``"auto"``.
        indices: process-local GPU indices (after ``CUDA_VISIBLE_DEVICES``); None: all.
        simulated: what to simulate (default :class:`SimulatedSpec` ``()``: one A40 running
            ImageNet/ResNet-50).
        local_rank: DDP: this rank's one GPU, the ``local_rank``-th visible GPU (simulated:
            index ``first_index + local_rank``, straggler factor ``slowdowns[local_rank]``),
            when ``device`` is not a CUDA device.
        device: the framework's root device. A CUDA device selects this process's one GPU
            by UUID (see :mod:`~lightning_energy.device.mapping`; simulated: its index
            stands for ``local_rank``). Another device (the CPU): simulated under
            ``"auto"``, ``local_rank`` decides under ``"nvml"`` and ``"zeusd"``. None (unknown):
            ``local_rank`` decides.
        cuda: the CUDA side of the mapping (default: ``torch.cuda``).

    Returns:
        The GPUs with their clock (``time.perf_counter`` for NVML and zeusd, the virtual
        clock for simulated GPUs) and, for simulated GPUs, ``run_step`` running one step
        on all of them. Call :meth:`DeviceSet.close` when done.

    Raises:
        ConfigError: unknown backend, ``indices`` given with ``local_rank`` or a CUDA
            ``device``, an index to match while CUDA orders mixed GPU models fastest
            first, or zeusd variables that cannot be used.
        DriverError: ``"nvml"`` or ``"zeusd"`` requested but NVML is missing or fails to
            initialise, or a CUDA ``device`` without CUDA. (A zeusd that does not answer
            is found at the first change: the job then observes.)
        GPUNotFoundError: a requested index does not exist, or no NVML GPU has the CUDA
            device's UUID.
    """
    source = "python"
    if backend is None:
        backend = os.environ.get(DEVICE_ENV_VAR, "auto").strip().lower() or "auto"
        source = f"env {DEVICE_ENV_VAR}"
    problems = []
    if backend not in BACKENDS:
        problems.append(f"backend={backend!r}: allowed: {list(BACKENDS)}")
    if indices is not None and local_rank is not None:
        problems.append(
            f"indices={list(indices)!r} and local_rank={local_rank!r}: give one, not both"
        )
    if local_rank is not None and local_rank < 0:
        problems.append(f"local_rank: {local_rank!r} is not allowed; use >= 0")
    on_cuda = device is not None and device.type == "cuda"
    if indices is not None and on_cuda:
        problems.append(f"indices={list(indices)!r} and device={str(device)!r}: give one")
    if problems:
        raise ConfigError(problems, source=source)
    spec = simulated if simulated is not None else SimulatedSpec()
    if on_cuda and device is not None and device.index is not None:
        simulated_rank: int | None = device.index
    else:
        simulated_rank = local_rank
    if backend == "simulated":
        return _simulated_set(spec, indices, simulated_rank)
    if backend in ("nvml", "zeusd"):
        return _nvml_set(indices, local_rank, device, cuda, daemon_for_backend(backend))
    if device is not None and not on_cuda:
        logger.info(
            "The framework computes on %r, not on a GPU: using the simulated backend (%s), "
            "so no GPU is profiled or capped; set device.backend: nvml to drive %s anyway.",
            str(device),
            spec.label,
            _what_nvml_drives(indices, local_rank),
        )
        return _simulated_set(spec, indices, simulated_rank)
    try:
        count = visible_gpu_count()
    except DriverError as exc:
        reason = str(exc)
    else:
        if count > 0:
            return _nvml_set(indices, local_rank, device, cuda, daemon_for_backend(backend))
        reason = "NVML sees no GPU"
    logger.info(
        "No NVIDIA GPU available (%s): using the simulated backend (%s).", reason, spec.label
    )
    return _simulated_set(spec, indices, simulated_rank)
