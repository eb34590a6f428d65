"""Which NVML GPU a framework's torch device is: matched by UUID, never by position.

CUDA and NVML number GPUs differently. NVML enumerates every GPU of the machine in PCI bus
order. CUDA numbers only the GPUs ``CUDA_VISIBLE_DEVICES`` lets the process see (indices,
``GPU-`` UUIDs or unique prefixes of them, ``MIG-`` instance UUIDs), in the order
``CUDA_DEVICE_ORDER`` says: ``FASTEST_FIRST`` by default, ``PCI_BUS_ID`` on request. And the
framework may train on any of them: ``Trainer(devices=[1])`` trains on ``cuda:1``, while a
launcher that gives each process one GPU (Ray Train, Slurm ``--gpu-bind``) trains every
rank on ``cuda:0`` whatever its local rank.

:func:`nvml_gpu_for_device` therefore asks CUDA for the UUID of the framework's device
(``torch.cuda.get_device_properties(device).uuid``, which already reflects both variables)
and opens the NVML GPU, or MIG instance, with that UUID (``nvmlDeviceGetHandleByUUID``,
then the GPUs that answer: a GPU elsewhere on the node that fell off the bus does not stop
the lookup). The CUDA side is a small :class:`CudaRuntime` protocol
(:mod:`~lightning_energy.device.cuda`), so the mapping is tested without a GPU.

Without a CUDA device (a CPU run on a machine with GPUs), process-local index ``i`` is the
``i``-th GPU ``CUDA_VISIBLE_DEVICES`` names (:func:`~lightning_energy.device.nvml.nvml_gpus`
counts index entries in CUDA's order, through CUDA's UUIDs where that order may differ from
NVML's, and refusing with a :class:`~lightning_energy.errors.ConfigError` where CUDA cannot
say how it numbers them).

Example:
    >>> gpu = nvml_gpu_for_device(torch.device("cuda", 1))  # doctest: +SKIP
    >>> gpu.uuid  # doctest: +SKIP
    'GPU-5f2d...'
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_energy.device.cuda import (
    ORDER_VAR,
    CudaRuntime,
    TorchCuda,
    normalise_uuid,
)
from lightning_energy.device.nvml import (
    NVMLGPU,
    NVMLSession,
    _answering,
    _handle_for_cuda_uuid,
    _pynvml,
)
from lightning_energy.errors import ConfigError, DriverError, GPULostError, GPUNotFoundError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CudaRuntime",
    "TorchCuda",
    "normalise_uuid",
    "nvml_gpu_for_device",
]

_VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"


def _environment() -> str:
    """The two variables as they are set, for error messages."""
    return ", ".join(f"{var}={os.environ.get(var)!r}" for var in (_VISIBLE_VAR, ORDER_VAR))


def nvml_gpu_for_device(
    device: torch.device,
    cuda: CudaRuntime | None = None,
    *,
    power_sample_interval_s: float = 0.05,
    factory: Callable[..., NVMLGPU] = NVMLGPU,
) -> NVMLGPU:
    """Open the NVML GPU (or MIG instance) the framework's CUDA ``device`` is.

    The GPU is asked of NVML by its UUID; a GPU elsewhere on the node that fell off the
    bus does not stop it being found.

    Args:
        device: the framework's root device, e.g. ``torch.device("cuda", 1)``; ``cuda``
            without an index is the current device.
        cuda: the CUDA side (default :class:`TorchCuda`).
        power_sample_interval_s: see :func:`~lightning_energy.device.nvml.nvml_gpus`.
        factory: builds the GPU from its NVML handle and index (see
            :func:`~lightning_energy.device.nvml.nvml_gpus`).

    Returns:
        The GPU, whose ``index`` is the device's process-local CUDA index. Close it when done.

    Raises:
        ConfigError: ``device`` is not a CUDA device.
        DriverError: CUDA is not available, or NVML fails to initialise.
        GPUNotFoundError: the device index is not visible to CUDA, or no NVML GPU has its
            UUID.
        GPULostError: no NVML GPU that answers has its UUID, and some GPU fell off the bus
            (the device's own, most likely).
    """
    if device.type != "cuda":
        raise ConfigError(f"device={str(device)!r}: an NVML GPU needs a 'cuda' device")
    runtime = cuda if cuda is not None else TorchCuda()
    if not runtime.is_available():
        raise DriverError(
            f"device {str(device)!r}: CUDA is not available to map it to an NVML GPU",
            operation="map_device",
        )
    index = device.index if device.index is not None else runtime.current_device()
    count = runtime.device_count()
    if not 0 <= index < count:
        raise GPUNotFoundError(
            f"device 'cuda:{index}': CUDA sees {count} GPU(s) ({_environment()})",
            gpu_index=index,
            operation="map_device",
        )
    wanted = normalise_uuid(runtime.uuid(index))
    with NVMLSession():
        nvml = _pynvml()
        handle = _handle_for_cuda_uuid(nvml, wanted, index)
        if handle is not None:
            return factory(handle, index, power_sample_interval_s=power_sample_interval_s)
        answering, lost = _answering(nvml, index)
    if lost:
        raise GPULostError(
            f"device 'cuda:{index}' has UUID {wanted!r}, which no NVML GPU that answers has: "
            f"the GPU(s) at NVML index {lost} fell off the bus",
            gpu_index=index,
            operation="map_device",
        )
    raise GPUNotFoundError(
        f"device 'cuda:{index}' has UUID {wanted!r}, which no NVML GPU has (NVML lists "
        f"{[uuid for uuid, _ in answering]}; {_environment()}): CUDA and NVML see different "
        "GPUs (a container or driver mismatch)",
        gpu_index=index,
        operation="map_device",
    )
