"""Repair GPUs that killed jobs left changed: restore every stale lease.

A job killed with SIGKILL (or by the OOM killer, or a node crash) cannot restore its GPUs;
its leases (:mod:`.lease`) keep the pre-job settings. :func:`recover` restores every GPU
whose lease belongs to a process that is gone, skips leases of live processes, and keeps
(with a message) a lease whose GPU cannot be opened or restored. A process that may not
change GPU settings itself restores through zeusd (see :func:`_daemon_for_lease`). It is what
``lightning-energy recover`` runs; :class:`~lightning_energy.device.guard.GPUGuard` does
the same for its own GPUs when it acquires them.

``recover`` usually runs as root over a directory every user may write to, so it refuses
(keeps, explains, changes nothing for) anything it cannot trust: a symbolic link, FIFO or
other non-regular file, another user's malformed lease, a lease of another user asking for
a lower limit than the GPU has, and a simulated GPU's state file that is not the caller's
own. What it does apply is capped by the driver (see
:func:`~.lease.restore_stale_lease`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_energy.device.base import GPU
from lightning_energy.device.lease import (
    Lease,
    LeaseStore,
    ProcessIdentity,
    directory_problem,
    owner_status,
    restore_stale_lease,
)
from lightning_energy.device.simulated import SimulatedGPU, SimulatedSpec
from lightning_energy.device.zeusd_client import ZeusdAddress, ZeusdClient
from lightning_energy.errors import (
    DeviceError,
    EnergyError,
    GPUNotFoundError,
    UntrustedLeaseError,
)

__all__ = ["RecoveryResult", "recover"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryResult:
    """What :func:`recover` did with one lease.

    Attributes:
        gpu_uuid: the GPU (the lease file's name when the lease is unreadable).
        lease_path: the lease file.
        status: ``"restored"`` (settings put back, lease removed), ``"would_restore"``
            (dry run), ``"skipped"`` (owner alive, or another host's GPU; lease kept),
            ``"refused"`` (not a lease to act on: nothing changed, file kept) or
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
        """False when the restore failed (a refused lease is not a failure of this
        machine's GPUs: another user's file is kept and explained)."""
        return self.status != "failed"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {**dataclasses.asdict(self), "lease_path": str(self.lease_path)}


def _open_nvml_gpu(gpu_uuid: str, index: int, daemon: ZeusdClient | None = None) -> GPU:
    """Open a GPU by UUID through NVML, whatever ``CUDA_VISIBLE_DEVICES`` says (past a lost
    GPU elsewhere on the node, which NVML's own by-UUID lookup stops at), changed through
    ``daemon`` when one is given; ``index`` only labels its errors."""
    from lightning_energy.device.nvml import NVMLSession, _handle_for_cuda_uuid, _pynvml
    from lightning_energy.device.zeusd import gpu_factory

    with NVMLSession():
        handle = _handle_for_cuda_uuid(_pynvml(), gpu_uuid, index)
        if handle is None:
            raise GPUNotFoundError(
                f"no GPU with UUID {gpu_uuid!r} answers NVML on this node",
                gpu_index=index,
                operation="get_handle",
            )
        return gpu_factory(daemon)(handle, index)


def _daemon_for_lease(store: LeaseStore, lease: Lease) -> ZeusdClient | None:
    """The zeusd to restore a real GPU's lease through, or None for NVML itself.

    A process that may change settings itself (root, ``CAP_SYS_ADMIN``) uses NVML: no
    daemon, no token sent anywhere. Otherwise a trusted lease (the caller's own, or
    root's) is restored through the daemon that changed the GPU, as it records; any other
    lease through the caller's own zeusd (``ZEUSD_SOCK_PATH``/``ZEUSD_HOST_PORT``), never
    through an address another user wrote, which could collect the caller's token.

    Raises:
        ConfigError: the caller's zeusd variables are unusable.
    """
    from lightning_energy.device.zeusd import may_change_settings_itself

    if may_change_settings_itself():
        return None
    if lease.zeusd_address is not None and store.trusts(lease):
        return ZeusdClient.for_address(ZeusdAddress.parse(lease.zeusd_address))
    return ZeusdClient.from_env()


def _open_for_lease(store: LeaseStore, lease: Lease) -> GPU:
    """Re-open the GPU a lease names: by UUID through NVML (changed through zeusd where
    :func:`_daemon_for_lease` says), or a simulated GPU through its state file, which only
    the lease's own user may have re-opened.

    Raises:
        UntrustedLeaseError: a simulated GPU's lease or state file is not the caller's.
        GPUNotFoundError: the GPU is not there.
        ConfigError: the caller's zeusd variables are unusable.
    """
    if lease.backend != "simulated":
        daemon = _daemon_for_lease(store, lease)
        return _open_nvml_gpu(lease.gpu_uuid, lease.gpu_index, daemon)
    if lease.state_path is None or lease.simulated_gpu is None:
        raise GPUNotFoundError(
            "the lease does not record how to rebuild this simulated GPU (its model is not a "
            "shipped one)",
            operation="get_handle",
        )
    state_path = Path(lease.state_path)
    problem = _state_file_problem(store, lease, state_path)
    if problem is not None:
        raise UntrustedLeaseError(
            f"the simulated GPU's state file {state_path} is not re-opened: {problem}",
            operation="get_handle",
        )
    return SimulatedGPU(
        SimulatedSpec(gpu=lease.simulated_gpu).model(),
        index=lease.gpu_index,
        uuid=lease.gpu_uuid,
        state_path=state_path,
    )


def _state_file_problem(store: LeaseStore, lease: Lease, path: Path) -> str | None:
    """Why a simulated GPU's state file named by a lease may not be rewritten, or None.

    A path in a lease is a claim of whoever wrote the file: it is used only when the
    lease and the state file belong to the user running this, the state file already
    exists as a regular file of its own (never created, never through a link) and no
    other user can rewrite the directories above it.
    """
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is None:
        return None
    if lease.file_uid != uid or not store.trusts(lease):
        return f"the lease belongs to uid {lease.file_uid}, not to the user running recover"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{exc.strerror or exc} (recover never creates a file)"
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return "not a regular file of its own (a link, FIFO or directory)"
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}"
    return directory_problem(path.parent, uid)


def _through(gpu: GPU) -> str:
    """`` through zeusd at <address>`` for a GPU changed through zeusd, else nothing."""
    address = gpu.lease_source().zeusd_address
    return "" if address is None else f" through zeusd at {address}"


def _close(gpu: GPU) -> None:
    close = getattr(gpu, "close", None)
    if callable(close):
        close()


def recover(
    lease_dir: str | Path | None = None,
    *,
    open_gpu: Callable[[str], GPU] | None = None,
    dry_run: bool = False,
    trusted_uids: Collection[int] | None = None,
) -> list[RecoveryResult]:
    """Restore every GPU whose lease outlived its job (SIGKILL, OOM kill, reboot).

    Leases of live processes are skipped. A lease whose GPU cannot be opened or restored
    stays in place with a message saying why. A file that is not a lease to act on is
    refused: kept, explained, nothing changed.

    Args:
        lease_dir: the lease directory (default: ``$LIGHTNING_ENERGY_LEASE_DIR``, else
            :data:`~.lease.DEFAULT_LEASE_DIR`; see :func:`~.lease.resolve_lease_dir`).
        open_gpu: opens a GPU by UUID; default: NVML by UUID (changed through zeusd when
            the caller may not change settings itself: the daemon the caller's own lease
            records, else the caller's ``ZEUSD_SOCK_PATH``/``ZEUSD_HOST_PORT``), or for a
            simulated GPU, a rebuild from the state file the lease records (the caller's own
            leases only).
        dry_run: only report what would be done.
        trusted_uids: owners whose leases are believed as they are (default: root and
            the caller); the leases of other users may only undo a lowering.

    Returns:
        One result per lease file, in file-name order.

    Raises:
        UntrustedLeaseError: the directory is not safe (others could rewrite it).
        ConfigError: ``lease_dir`` is empty.

    Example:
        >>> results = recover("/run/lightning-energy")  # doctest: +SKIP
        >>> all(r.ok for r in results)  # doctest: +SKIP
        True
    """
    store = LeaseStore(lease_dir, trusted_uids=trusted_uids)
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


def _refused(path: Path, reason: object, lease: Lease | None = None) -> RecoveryResult:
    message = (
        f"{reason}; nothing was changed and the file is kept: check who wrote it, then delete it "
        "(see docs/troubleshooting.md)"
    )
    log.warning("Lease %s refused: %s", path, message)
    return _result(path, "refused", message, lease)


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
    except UntrustedLeaseError as exc:
        return _refused(path, exc)
    except DeviceError as exc:
        message = f"{exc}; inspect the file and delete it once the GPU is known to be fine"
        return _result(path, "failed", message)
    if lock is None:
        return _result(path, "skipped", f"in use: {lease.owner.describe()} holds its lock", lease)
    try:
        try:
            current = store.read_path(path)  # re-read under the lock
        except UntrustedLeaseError as exc:
            return _refused(path, exc, lease)
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
    trusted = store.trusts(lease)
    whose = "" if trusted else f" (a lease of uid {lease.file_uid}, another user)"
    if dry_run:
        action = f"restore {lease.describe_settings()}" if lease.changed else "remove the lease"
        capped = "" if trusted else ", capped at the GPU's default limit, never lower"
        return _result(path, "would_restore", f"{why}{whose}; would {action}{capped}", lease)
    done = "nothing was changed"
    if lease.changed:
        try:
            gpu = (
                open_gpu(lease.gpu_uuid) if open_gpu is not None else _open_for_lease(store, lease)
            )
        except UntrustedLeaseError as exc:
            return _refused(path, exc, lease)
        except EnergyError as exc:
            if isinstance(exc, GPUNotFoundError) and lease.owner.hostname != me.hostname:
                message = f"GPU not visible here (a lease of host {lease.owner.hostname})"
                return _result(path, "skipped", message, lease)
            return _result(path, "failed", f"cannot open the GPU: {exc}; lease kept", lease)
        try:
            done = restore_stale_lease(gpu, lease, trusted=trusted) + _through(gpu)
        except UntrustedLeaseError as exc:
            return _refused(path, exc, lease)
        except DeviceError as exc:
            return _result(path, "failed", f"cannot restore the GPU: {exc}; lease kept", lease)
        finally:
            if open_gpu is None:
                _close(gpu)
    try:
        store.remove(lease.gpu_uuid)
    except DeviceError as exc:
        return _result(path, "failed", f"restored, but {exc}", lease)
    if lease.changed:
        done = f"saved {lease.describe_settings()}: {done}"
    log.info("%s: %s (%s%s); lease removed.", lease.gpu_uuid, done, why, whose)
    return _result(path, "restored", f"{why}{whose}; {done}; lease removed", lease)
