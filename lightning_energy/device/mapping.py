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
and opens the NVML GPU, or MIG instance, with that UUID. The CUDA side is a small
:class:`CudaRuntime` protocol, so the mapping is tested without a GPU.

Without a CUDA device (a CPU run on a machine with GPUs), process-local index ``i`` is taken
to be the ``i``-th GPU ``CUDA_VISIBLE_DEVICES`` names in NVML order; :func:`check_device_order`
refuses that when CUDA's fastest-first order could differ from NVML's.

Example:
    >>> gpu = nvml_gpu_for_device(torch.device("cuda", 1))  # doctest: +SKIP
    >>> gpu.uuid  # doctest: +SKIP
    'GPU-5f2d...'
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from lightning_energy.device.nvml import (
    NVMLGPU,
    NVMLSession,
    _call,
    _mig_instances,
    _pynvml,
    _text,
    _visible_handles,
)
from lightning_energy.errors import ConfigError, DriverError, GPULostError, GPUNotFoundError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CudaRuntime",
    "TorchCuda",
    "check_device_order",
    "normalise_uuid",
    "nvml_gpu_for_device",
    "visible_gpu_names",
]

_ORDER_VAR = "CUDA_DEVICE_ORDER"
_VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"


class CudaRuntime(Protocol):
    """The CUDA side of the mapping: what ``torch.cuda`` tells about process-local GPUs."""

    def is_available(self) -> bool:
        """True when CUDA can be used."""
        ...

    def device_count(self) -> int:
        """How many GPUs this process sees (after ``CUDA_VISIBLE_DEVICES``)."""
        ...

    def current_device(self) -> int:
        """The process-local index of the current device."""
        ...

    def uuid(self, index: int) -> str:
        """The UUID of process-local GPU ``index`` (with or without ``GPU-``/``MIG-``)."""
        ...


class TorchCuda:
    """:class:`CudaRuntime` over ``torch.cuda``."""

    def is_available(self) -> bool:
        import torch

        return bool(torch.cuda.is_available())

    def device_count(self) -> int:
        import torch

        return int(torch.cuda.device_count())

    def current_device(self) -> int:
        import torch

        return int(torch.cuda.current_device())

    def uuid(self, index: int) -> str:
        import torch

        return str(torch.cuda.get_device_properties(index).uuid)


def normalise_uuid(uuid: str) -> str:
    """``uuid`` without its ``GPU-`` or ``MIG-`` prefix, in lower case.

    CUDA reports bare UUIDs, NVML prefixed ones; both name the same board or MIG instance.
    """
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def _environment() -> str:
    """The two variables as they are set, for error messages."""
    return ", ".join(f"{var}={os.environ.get(var)!r}" for var in (_VISIBLE_VAR, _ORDER_VAR))


def nvml_gpu_for_device(
    device: torch.device,
    cuda: CudaRuntime | None = None,
    *,
    power_sample_interval_s: float = 0.05,
) -> NVMLGPU:
    """Open the NVML GPU (or MIG instance) the framework's CUDA ``device`` is.

    Args:
        device: the framework's root device, e.g. ``torch.device("cuda", 1)``; ``cuda``
            without an index is the current device.
        cuda: the CUDA side (default :class:`TorchCuda`).
        power_sample_interval_s: see :func:`~lightning_energy.device.nvml.nvml_gpus`.

    Returns:
        The GPU, whose ``index`` is the device's process-local CUDA index. Close it when done.

    Raises:
        ConfigError: ``device`` is not a CUDA device.
        DriverError: CUDA is not available, or NVML fails to initialise.
        GPUNotFoundError: the device index is not visible to CUDA, or no NVML GPU has its
            UUID.
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
        seen: list[str] = []
        for nvml_index in range(_call("get_count", index, nvml.nvmlDeviceGetCount)):
            handle = _call("get_handle", index, nvml.nvmlDeviceGetHandleByIndex, nvml_index)
            candidates = [(_text(_call("get_uuid", index, nvml.nvmlDeviceGetUUID, handle)), handle)]
            candidates.extend(_mig_instances(nvml, handle, index))
            for uuid, candidate in candidates:
                if normalise_uuid(uuid) == wanted:
                    return NVMLGPU(
                        candidate, index, power_sample_interval_s=power_sample_interval_s
                    )
                seen.append(uuid)
    raise GPUNotFoundError(
        f"device 'cuda:{index}' has UUID {wanted!r}, which no NVML GPU has (NVML lists "
        f"{seen}; {_environment()}): CUDA and NVML see different GPUs (a container or "
        "driver mismatch)",
        gpu_index=index,
        operation="map_device",
    )


def check_device_order(names_in_nvml_order: list[str]) -> None:
    """Refuse to take process-local index ``i`` as the ``i``-th visible NVML GPU when CUDA
    may number the GPUs differently.

    CUDA's default order, ``FASTEST_FIRST``, puts faster GPUs first and breaks ties by PCI
    bus id: on GPUs that are all the same model it is NVML's order; on mixed models it is
    not, unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.

    Args:
        names_in_nvml_order: the model names of the GPUs visible to this process.

    Raises:
        ConfigError: mixed models under the fastest-first order.
    """
    order = os.environ.get(_ORDER_VAR, "FASTEST_FIRST").strip().upper() or "FASTEST_FIRST"
    if order == "PCI_BUS_ID" or len(set(names_in_nvml_order)) <= 1:
        return
    raise ConfigError(
        f"{_ORDER_VAR}={order!r} with different GPU models {sorted(set(names_in_nvml_order))}: "
        "CUDA numbers them fastest first, NVML by PCI bus, so a GPU index cannot be matched; "
        f"set {_ORDER_VAR}=PCI_BUS_ID, or pass the framework's CUDA device",
        source=f"env {_ORDER_VAR}",
    )


def visible_gpu_names() -> list[str]:
    """Model names of the GPUs ``CUDA_VISIBLE_DEVICES`` names, in NVML order.

    A GPU that fell off the bus has no name to give and is left out.

    Raises:
        DriverError: pynvml is missing or NVML fails to initialise.
    """
    names = []
    with NVMLSession():
        nvml = _pynvml()
        for i, handle in enumerate(_visible_handles(nvml)):
            try:
                names.append(_text(_call("get_name", i, nvml.nvmlDeviceGetName, handle)))
            except GPULostError:
                continue  # no model to compare: the GPU fell off the bus (observed, not driven)
    return names
