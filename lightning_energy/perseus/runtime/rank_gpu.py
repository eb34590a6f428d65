"""This rank's GPU for Perseus: the job's one opening, guard and lease.

A job opens its GPUs once, takes one lease and changes settings through one guard. When
the energy controller of the same process already holds them (the energy callback runs
next to a Perseus strategy), Perseus borrows them: its clock changes go through the
controller's guard, and the controller restores everything at its teardown. Only when
Perseus runs alone does :func:`open_rank_gpu` open this rank's GPU from the ``device:``
section and take a guard of its own, which :meth:`RankGPU.close` restores.

Example:
    >>> from lightning_energy.config import DeviceConfig, EnergyConfig
    >>> config = EnergyConfig(device=DeviceConfig(backend="simulated", gpu="a100"))
    >>> rank = open_rank_gpu(config, local_rank=0, install_signal_handlers=False)
    >>> rank.owned, rank.devices.backend
    (True, 'simulated')
    >>> rank.close()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_energy.collectives import cpu_collective_group
from lightning_energy.device import DeviceSet, open_devices
from lightning_energy.device.guard import GPUGuard

if TYPE_CHECKING:
    import torch

    from lightning_energy.config import EnergyConfig
    from lightning_energy.device.base import GPU

__all__ = ["RankGPU", "open_rank_gpu"]


@dataclass
class RankGPU:
    """The GPU this rank drives, the guard its clocks change through, and a gloo group.

    Attributes:
        devices: the opened GPUs (this rank's is the first).
        guard: the guard every clock change goes through.
        owned: whether Perseus opened them (and restores and closes them).
        group: a gloo group for the CPU tensors Perseus exchanges (None: single process).
    """

    devices: DeviceSet
    guard: GPUGuard
    owned: bool
    group: Any = None

    @property
    def gpu(self) -> GPU:
        """This rank's GPU."""
        return self.devices.gpus[0]

    @property
    def clock(self) -> Callable[[], float]:
        """Seconds on the GPU's clock (virtual for simulated GPUs)."""
        return self.gpu.now_s

    def close(self) -> None:
        """Restore and release the GPU when Perseus opened it; else leave it to its owner."""
        if self.owned:
            self.guard.restore()
            self.devices.close()


def open_rank_gpu(
    config: EnergyConfig,
    *,
    local_rank: int,
    device: torch.device | None = None,
    install_signal_handlers: bool = True,
    shared: tuple[DeviceSet, GPUGuard] | None = None,
) -> RankGPU:
    """This rank's GPU: ``shared`` when the job already opened it, else opened here.

    Args:
        config: the job's configuration (its ``device:`` section and ``strict``).
        local_rank: this process's local rank (its GPU when ``device`` is not CUDA).
        device: the framework's root device: a CUDA device picks the GPU by UUID; the
            CPU (a run computing on no GPU) gets a simulated GPU under ``backend: auto``
            (see :func:`~lightning_energy.device.open_devices`).
        install_signal_handlers: restore on SIGTERM/SIGINT too (main thread only).
        shared: the devices and guard of the energy controller of this process.

    Raises:
        ConfigError: a bad ``device:`` section.
        EnergyError: in strict mode, when the GPU cannot be controlled.
    """
    group = cpu_collective_group()
    if shared is not None:
        devices, guard = shared
        return RankGPU(devices, guard, owned=False, group=group)
    dev = config.device
    devices = open_devices(
        dev.backend, simulated=dev.simulated_spec(), local_rank=local_rank, device=device
    )
    guard = GPUGuard(
        devices.gpus[:1],
        lease_dir=dev.lease_dir,
        strict=config.strict,
        install_signal_handlers=install_signal_handlers,
    )
    try:
        guard.acquire()
    except BaseException:
        devices.close()
        raise
    return RankGPU(devices, guard, owned=True, group=group)
