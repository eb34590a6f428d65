"""The CUDA side of GPU selection: what ``torch.cuda`` tells about process-local GPUs.

CUDA numbers only the GPUs ``CUDA_VISIBLE_DEVICES`` lets the process see, in the order
``CUDA_DEVICE_ORDER`` says (``FASTEST_FIRST`` by default), and reports each one's UUID
without NVML's ``GPU-``/``MIG-`` prefix. :class:`CudaRuntime` is that knowledge as a small
protocol, so the NVML backend and :mod:`~lightning_energy.device.mapping` are tested with
an in-memory CUDA; :class:`TorchCuda` asks ``torch.cuda``.
"""

from __future__ import annotations

import os
from typing import Protocol

__all__ = ["ORDER_VAR", "CudaRuntime", "TorchCuda", "cuda_device_order", "normalise_uuid"]

#: The variable that tells CUDA how to number GPUs.
ORDER_VAR = "CUDA_DEVICE_ORDER"


class CudaRuntime(Protocol):
    """What ``torch.cuda`` tells about process-local GPUs."""

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


def cuda_device_order() -> str:
    """How CUDA numbers GPUs: ``CUDA_DEVICE_ORDER`` in upper case, ``FASTEST_FIRST`` when
    unset or empty."""
    return os.environ.get(ORDER_VAR, "FASTEST_FIRST").strip().upper() or "FASTEST_FIRST"
