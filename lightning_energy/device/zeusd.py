"""GPUs whose settings change through zeusd: for jobs that are neither root nor hold
``CAP_SYS_ADMIN``.

A :class:`ZeusdGPU` is an :class:`~lightning_energy.device.nvml.NVMLGPU` in everything but
how it writes: the power limit and the SM clock lock go to zeusd
(:mod:`~lightning_energy.device.zeusd_client`), always with ``block=true``, while identity
and every reading (energy counter, power, clocks, clock event reasons) stay with NVML,
which needs no privilege. Where NVML cannot read the power limit, its constraints, the
energy counter or the power (a driver error, a refusal), the reading comes from zeusd
instead. Which GPU a job drives is decided as for NVML, by UUID
(:mod:`~lightning_energy.device.mapping`); leases, restore, ``recover`` and the
observe-only fallback are those of every backend, the lease recording the daemon's address
(never the token).

**Which of zeusd's GPUs.** zeusd numbers GPUs by its own NVML enumeration, which is this
process's only when both see the same GPUs: a container given some of a node's GPUs
numbers them from 0, a daemon on the host does not. So the daemon's index of a GPU is
settled before its first change, from ``/discover``: by PCI address where the daemon
reports them (zeusd after 0.5.0); otherwise by NVML index, and only when the daemon lists
exactly as many GPUs as NVML shows here and, where it names them (0.5.0), the same model
at that index. Anything else is refused (:class:`~lightning_energy.errors.GPUNotFoundError`:
the job observes) rather than risk changing another job's GPU.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from lightning_energy.device.base import LeaseSource
from lightning_energy.device.nvml import NVMLGPU
from lightning_energy.device.zeusd_client import Discovery, ZeusdAddress, ZeusdClient
from lightning_energy.errors import (
    DeviceError,
    DriverError,
    GPULostError,
    GPUNotFoundError,
    NoPermissionError,
)

__all__ = [
    "PROC_STATUS",
    "ZeusdGPU",
    "daemon_for_backend",
    "daemon_from_env",
    "daemon_index",
    "gpu_factory",
    "may_change_settings_itself",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Where the kernel shows this process's capabilities.
PROC_STATUS = Path("/proc/self/status")
_CAP_SYS_ADMIN = 21


def may_change_settings_itself(status_path: Path | None = None) -> bool:
    """Whether this process may change GPU settings through NVML itself: it holds
    ``CAP_SYS_ADMIN`` (root outside a container has it; root in a container only when
    granted), read from ``CapEff`` in ``/proc/self/status``. Where there is no such file
    (not Linux), whether it runs as root.

    Args:
        status_path: the status file (default :data:`PROC_STATUS`).
    """
    path = PROC_STATUS if status_path is None else status_path
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return hasattr(os, "geteuid") and os.geteuid() == 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "CapEff":
            try:
                return bool(int(value.strip(), 16) >> _CAP_SYS_ADMIN & 1)
            except ValueError:
                return False
    return False


def daemon_index(gpu: NVMLGPU, discovery: Discovery, nvml_count: int, where: str) -> int:
    """zeusd's index of ``gpu`` (see the module docstring for the rule).

    Args:
        gpu: the GPU as NVML opens it here.
        discovery: what the daemon's ``/discover`` says.
        nvml_count: how many GPUs NVML shows this process.
        where: the daemon, for messages (``zeusd at unix:/run/zeusd/zeusd.sock``).

    Raises:
        GPUNotFoundError: the daemon does not manage the GPU, or which of its GPUs it is
            cannot be told.
        DeviceError: NVML cannot read the GPU's PCI address or index.
    """
    if discovery.schema == "pci":
        address = gpu.pci_address()
        matches = [g.id for g in discovery.gpus if g.pci_address == address]
        if len(matches) == 1:
            return matches[0]
        listed = [g.pci_address for g in discovery.gpus]
        raise GPUNotFoundError(
            f"{where} manages no GPU at PCI address {address} (it lists {listed}): it runs "
            "where other GPUs are visible",
            gpu_index=gpu.index,
            operation="zeusd discover",
        )
    index = gpu.nvml_index()
    if len(discovery.gpus) != nvml_count:
        raise GPUNotFoundError(
            f"{where} lists {len(discovery.gpus)} GPU(s) and NVML shows {nvml_count} here, so "
            f"which of its GPUs NVML's GPU {index} is cannot be told (a container given some "
            "of the node's GPUs?); zeusd after 0.5.0 reports PCI addresses, which settle it",
            gpu_index=gpu.index,
            operation="zeusd discover",
        )
    daemon = {g.id: g for g in discovery.gpus}.get(index)
    if daemon is None or (daemon.name is not None and daemon.name != gpu.name):
        what = "no GPU" if daemon is None else f"a {daemon.name}"
        raise GPUNotFoundError(
            f"{where} has {what} at index {index}, where NVML here has this {gpu.name}: they "
            "do not see the same GPUs",
            gpu_index=gpu.index,
            operation="zeusd discover",
        )
    return index


class ZeusdGPU(NVMLGPU):
    """An NVIDIA GPU read through NVML and changed through zeusd.

    Build them with :func:`~lightning_energy.device.nvml.nvml_gpus` or
    :func:`~lightning_energy.device.mapping.nvml_gpu_for_device`, passing
    ``factory=functools.partial(ZeusdGPU, daemon=client)``.

    Args:
        handle: the NVML device handle.
        index: the process-local index.
        daemon: the zeusd that changes its settings.
        **kwargs: as for :class:`~lightning_energy.device.nvml.NVMLGPU`.
    """

    def __init__(self, handle: object, index: int, *, daemon: ZeusdClient, **kwargs: Any) -> None:
        super().__init__(handle, index, **kwargs)
        self._daemon = daemon
        self._daemon_id: int | None = None
        self._daemon_id_lock = threading.Lock()
        self._fallbacks_logged: set[str] = set()

    def __repr__(self) -> str:
        return (
            f"ZeusdGPU(index={self.index}, name={self.name!r}, uuid={self.uuid!r}, "
            f"daemon={str(self._daemon.address)!r})"
        )

    @property
    def daemon(self) -> ZeusdClient:
        """The zeusd that changes this GPU's settings."""
        return self._daemon

    def daemon_index(self) -> int:
        """zeusd's index of this GPU, asked of the daemon once (``/discover``).

        Raises:
            GPUNotFoundError: the daemon does not manage it, or which of its GPUs it is
                cannot be told.
            DaemonUnreachableError: the daemon does not answer.
            DriverError: it answers with an error or a malformed ``/discover``.
        """
        with self._daemon_id_lock:
            if self._daemon_id is None:
                count = int(self._get("get_count", self._nvml.nvmlDeviceGetCount))
                where = f"zeusd at {self._daemon.address}"
                self._daemon_id = daemon_index(self, self._daemon.discover(), count, where)
            return self._daemon_id

    # ------------------------------------------------------------------ writes
    def _write_power_limit_mw(self, power_limit_mw: int) -> None:
        self._daemon.set_power_limit_mw(self.daemon_index(), power_limit_mw, gpu_index=self.index)

    def _write_locked_clocks_mhz(self, min_mhz: int, max_mhz: int) -> None:
        self._daemon.set_gpu_locked_clocks_mhz(
            self.daemon_index(), min_mhz, max_mhz, gpu_index=self.index
        )

    def _write_reset_locked_clocks(self) -> None:
        self._daemon.reset_gpu_locked_clocks(self.daemon_index(), gpu_index=self.index)

    # ------------------------------------------------------------------ reads
    def _nvml_else_daemon(
        self, what: str, nvml_read: Callable[[], T], daemon_read: Callable[[int], T]
    ) -> T:
        """``nvml_read()``, or, when NVML fails (not for a lost GPU), the daemon's answer;
        when both fail, NVML's error."""
        try:
            return nvml_read()
        except GPULostError:
            raise
        except (NoPermissionError, DriverError) as nvml_error:
            try:
                value = daemon_read(self.daemon_index())
            except DeviceError:
                raise nvml_error from None
            if what not in self._fallbacks_logged:
                self._fallbacks_logged.add(what)
                log.info(
                    "GPU %d: NVML cannot read its %s (%s): read through zeusd at %s.",
                    self.index,
                    what,
                    nvml_error,
                    self._daemon.address,
                )
            return value

    def power_limit_constraints_w(self) -> tuple[float, float]:
        """The (min, max) power limit, in watts: NVML's, else zeusd's."""

        def from_daemon(gpu_id: int) -> tuple[float, float]:
            lo, hi = self._daemon.power_limit_constraints_mw(gpu_id, gpu_index=self.index)
            return lo / 1000.0, hi / 1000.0

        return self._nvml_else_daemon(
            "power limit range", super().power_limit_constraints_w, from_daemon
        )

    def power_limit_w(self) -> float:
        """The power limit set, in watts: NVML's, else zeusd's."""
        return self._nvml_else_daemon(
            "power limit",
            super().power_limit_w,
            lambda gpu_id: self._daemon.power_limit_mw(gpu_id, gpu_index=self.index) / 1000.0,
        )

    def energy_j(self) -> float:
        """Cumulative energy in joules: NVML's counter (or sampled power), else zeusd's."""
        return self._nvml_else_daemon(
            "energy counter",
            super().energy_j,
            lambda gpu_id: self._daemon.energy_mj(gpu_id, gpu_index=self.index) / 1000.0,
        )

    def power_w(self) -> float:
        """Board power in watts: NVML's 1 s average, else zeusd's instantaneous reading."""
        return self._nvml_else_daemon(
            "power",
            super().power_w,
            lambda gpu_id: self._daemon.power_mw(gpu_id, gpu_index=self.index) / 1000.0,
        )

    def lease_source(self) -> LeaseSource:
        """Re-opened through NVML by its UUID, changed through the same daemon."""
        return LeaseSource("zeusd", zeusd_address=str(self._daemon.address))


def gpu_factory(daemon: ZeusdClient | None) -> Callable[..., NVMLGPU]:
    """What builds each GPU from its NVML handle and index (the ``factory`` of
    :func:`~lightning_energy.device.nvml.nvml_gpus`): a :class:`ZeusdGPU` changed through
    ``daemon``, or a plain :class:`~lightning_energy.device.nvml.NVMLGPU` when it is None."""
    return NVMLGPU if daemon is None else functools.partial(ZeusdGPU, daemon=daemon)


def daemon_from_env(environ: Mapping[str, str] | None = None) -> ZeusdClient:
    """The zeusd the environment names (``ZEUSD_SOCK_PATH``, else ``ZEUSD_HOST_PORT``),
    else zeusd's default socket, with ``ZEUSD_TOKEN``.

    Raises:
        ConfigError: a variable is set to something unusable.
    """
    client = ZeusdClient.from_env(environ)
    return (
        client if client is not None else ZeusdClient.for_address(ZeusdAddress.default(), environ)
    )


def daemon_for_backend(backend: str) -> ZeusdClient | None:
    """The zeusd a device backend changes GPU settings through, or None for NVML itself.

    Args:
        backend: ``"zeusd"`` (:func:`daemon_from_env`), ``"auto"`` (the daemon
            ``ZEUSD_SOCK_PATH`` or ``ZEUSD_HOST_PORT`` names, unless this process may
            change settings itself) or another backend (None).

    Raises:
        ConfigError: a zeusd variable is set to something unusable.
    """
    if backend == "zeusd":
        return daemon_from_env()
    if backend != "auto":
        return None
    daemon = ZeusdClient.from_env()
    if daemon is None:
        return None
    if may_change_settings_itself():
        log.debug("%r is configured, but this process holds CAP_SYS_ADMIN: using NVML", daemon)
        return None
    log.info(
        "This process may not change GPU settings itself: changing them through zeusd at %s "
        "(device.backend: zeusd).",
        daemon.address,
    )
    return daemon
