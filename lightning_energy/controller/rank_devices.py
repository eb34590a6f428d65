"""This process's GPUs, as the controller holds them from run to run.

GPUs given to the controller stay the caller's: it never closes them. GPUs it opens itself
(from the ``device:`` section, on first use: see
:func:`~lightning_energy.device.open_rank_devices`) are closed at the end of every run and
opened afresh by the next one; a setup that fails closes them at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lightning_energy.config import DeviceConfig
    from lightning_energy.device.base import DeviceSet

__all__ = ["RankDevices"]


class RankDevices:
    """The GPUs of one controller.

    Args:
        config: the ``device:`` section.
        devices: the GPUs to drive (None: opened from ``config`` on first use).
        node_rank: the framework's node rank.
        local_rank: which local GPU this process drives, when ``device`` is not a CUDA device.
        device: the framework's root device.
    """

    def __init__(
        self,
        config: DeviceConfig,
        devices: DeviceSet | None,
        *,
        node_rank: int,
        local_rank: int,
        device: torch.device | None,
    ) -> None:
        self._config = config
        self._devices = devices
        self._node_rank = node_rank
        self._local_rank = local_rank
        self._device = device
        self._owned = False
        self._closed = False

    def get(self) -> DeviceSet:
        """The GPUs (opened on first use)."""
        if self._devices is None:
            from lightning_energy.device import open_rank_devices

            self._owned = True
            self._devices = open_rank_devices(
                self._config,
                node_rank=self._node_rank,
                local_rank=self._local_rank,
                device=self._device,
            )
        return self._devices

    @property
    def opened(self) -> bool:
        """Whether the GPUs are there to read (given, or opened and not forgotten)."""
        return self._devices is not None

    def for_new_run(self) -> DeviceSet:
        """The GPUs of a run being set up: opened afresh where the last run closed them."""
        if self._owned and self._closed:
            self._devices = None  # closing released them
        devices = self.get()
        self._closed = False
        return devices

    def close(self, *, forget: bool = False) -> None:
        """Close the GPUs this process opened (given ones stay open).

        Args:
            forget: a setup failed: nothing of the run is left to read, and the next use
                opens them again.
        """
        if not self._owned or self._devices is None:
            return
        self._devices.close()
        if forget:
            self._devices = None
        else:
            self._closed = True
