"""Repair GPUs that killed jobs left changed: restore every stale lease.

A job killed with SIGKILL (or by the OOM killer, or a node crash) cannot restore its GPUs;
its leases (:mod:`.lease`) keep the pre-job settings. :func:`recover` restores every GPU
whose lease belongs to a process that is gone, skips leases of live processes, and keeps
(with a message) a lease whose GPU cannot be opened or restored. It is what
``lightning-energy recover`` runs; :class:`~.guard.GPUGuard` does the same for its own GPUs
when it acquires them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_energy.device.base import GPU
from lightning_energy.device.lease import (
    Lease,
    LeaseStore,
    ProcessIdentity,
    apply_saved_settings,
    owner_status,
)
from lightning_energy.device.simulated import SimulatedGPU, SimulatedSpec
from lightning_energy.errors import DeviceError, EnergyError, GPUNotFoundError

__all__ = ["RecoveryResult", "recover"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryResult:
    """What :func:`recover` did with one lease.

    Attributes:
        gpu_uuid: the GPU (the lease file's name when the lease is unreadable).
        lease_path: the lease file.
        status: ``"restored"`` (settings put back, lease removed), ``"would_restore"``
            (dry run), ``"skipped"`` (owner alive, or another host's GPU; lease kept) or
            ``"failed"`` (lease kept).
        message: what happened, in words.
        owner: the owning process as recorded (``"pid 12 on host n1"``), if readable.
        settings: the saved settings (``"power limit 300 W, clocks unlocked"``), if readable.
    """

    gpu_uuid: str
    lease_path: Path
    status: str
    message: str
    owner: str | None = None
    settings: str | None = None

    @property
    def ok(self) -> bool:
        """False when the restore failed."""
        return self.status != "failed"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {**dataclasses.asdict(self), "lease_path": str(self.lease_path)}


def _open_nvml_gpu(gpu_uuid: str, index: int) -> GPU:
    """Open a GPU by UUID through NVML, whatever ``CUDA_VISIBLE_DEVICES`` says; ``index``
    only labels its errors."""
    from lightning_energy.device.nvml import NVMLGPU, NVMLSession, translate_nvml_error

    with NVMLSession():
        import pynvml

        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        except pynvml.NVMLError as exc:
            raise translate_nvml_error(exc, operation="get_handle") from exc
        return NVMLGPU(handle, index)


def _open_for_lease(lease: Lease) -> GPU:
    """Re-open the GPU a lease names: by UUID through NVML, or a simulated GPU through
    its state file."""
    if lease.backend != "simulated":
        return _open_nvml_gpu(lease.gpu_uuid, lease.gpu_index)
    if lease.state_path is None or lease.simulated_gpu is None:
        raise GPUNotFoundError(
            "the lease does not record how to rebuild this simulated GPU (its model is not a "
            "shipped one)",
            operation="get_handle",
        )
    return SimulatedGPU(
        SimulatedSpec(gpu=lease.simulated_gpu).model(),
        index=lease.gpu_index,
        uuid=lease.gpu_uuid,
        state_path=Path(lease.state_path),
    )


def _close(gpu: GPU) -> None:
    close = getattr(gpu, "close", None)
    if callable(close):
        close()


def recover(
    lease_dir: str | Path | None = None,
    *,
    open_gpu: Callable[[str], GPU] | None = None,
    dry_run: bool = False,
) -> list[RecoveryResult]:
    """Restore every GPU whose lease outlived its job (SIGKILL, OOM kill, reboot).

    Leases of live processes are skipped. A lease whose GPU cannot be opened or restored
    stays in place with a message saying why.

    Args:
        lease_dir: the lease directory (default: ``$LIGHTNING_ENERGY_LEASE_DIR``, else the
            per-user state directory; see :func:`~.lease.resolve_lease_dir`).
        open_gpu: opens a GPU by UUID; default: NVML by UUID, or for a simulated GPU, a
            rebuild from the state file the lease records.
        dry_run: only report what would be done.

    Returns:
        One result per lease file, in file-name order.

    Example:
        >>> results = recover("/run/lightning-energy")  # doctest: +SKIP
        >>> all(r.ok for r in results)  # doctest: +SKIP
        True
    """
    store = LeaseStore(lease_dir)
    me = ProcessIdentity.current()
    return [_recover_one(store, path, me, open_gpu, dry_run) for path in store.lease_paths()]


def _result(path: Path, status: str, message: str, lease: Lease | None = None) -> RecoveryResult:
    return RecoveryResult(
        gpu_uuid=lease.gpu_uuid if lease else path.stem,
        lease_path=path,
        status=status,
        message=message,
        owner=lease.owner.describe() if lease else None,
        settings=lease.describe_settings() if lease else None,
    )


def _recover_one(
    store: LeaseStore,
    path: Path,
    me: ProcessIdentity,
    open_gpu: Callable[[str], GPU] | None,
    dry_run: bool,
) -> RecoveryResult:
    try:
        lease = store.read_path(path)
        if lease is None:
            return _result(path, "skipped", "released by its owner meanwhile")
        lock = store.try_lock(lease.gpu_uuid)
    except DeviceError as exc:
        message = f"{exc}; inspect the file and delete it once the GPU is known to be fine"
        return _result(path, "failed", message)
    if lock is None:
        return _result(path, "skipped", f"in use: {lease.owner.describe()} holds its lock", lease)
    try:
        try:
            current = store.read_path(path)  # re-read under the lock
        except DeviceError as exc:
            return _result(path, "failed", str(exc), lease)
        if current is None:
            return _result(path, "skipped", "released by its owner meanwhile", lease)
        return _recover_locked(store, path, current, me, open_gpu, dry_run)
    finally:
        lock.release()


def _recover_locked(
    store: LeaseStore,
    path: Path,
    lease: Lease,
    me: ProcessIdentity,
    open_gpu: Callable[[str], GPU] | None,
    dry_run: bool,
) -> RecoveryResult:
    alive, why = owner_status(lease.owner, me)
    if alive:
        return _result(path, "skipped", f"in use: {why}", lease)
    if dry_run:
        action = f"restore {lease.describe_settings()}" if lease.changed else "remove the lease"
        return _result(path, "would_restore", f"{why}; would {action}", lease)
    if lease.changed:
        try:
            gpu = open_gpu(lease.gpu_uuid) if open_gpu is not None else _open_for_lease(lease)
        except EnergyError as exc:
            if isinstance(exc, GPUNotFoundError) and lease.owner.hostname != me.hostname:
                message = f"GPU not visible here (a lease of host {lease.owner.hostname})"
                return _result(path, "skipped", message, lease)
            return _result(path, "failed", f"cannot open the GPU: {exc}; lease kept", lease)
        try:
            apply_saved_settings(
                gpu, lease, power=lease.power_limit_changed, clocks=lease.clocks_changed
            )
        except DeviceError as exc:
            return _result(path, "failed", f"cannot restore the GPU: {exc}; lease kept", lease)
        finally:
            if open_gpu is None:
                _close(gpu)
    try:
        store.remove(lease.gpu_uuid)
    except DeviceError as exc:
        return _result(path, "failed", f"restored, but {exc}", lease)
    done = f"restored {lease.describe_settings()}" if lease.changed else "nothing was changed"
    log.info("%s: %s (%s); lease removed.", lease.gpu_uuid, done, why)
    return _result(path, "restored", f"{why}; {done}; lease removed", lease)
