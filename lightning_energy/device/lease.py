"""Per-GPU leases: what a job changed on a GPU, kept on disk until it is put back.

Before a job first changes a GPU, :class:`~lightning_energy.device.guard.GPUGuard` writes a
lease file ``<lease_dir>/<gpu uuid>.json`` holding the GPU's pre-job settings and the
identity of the owning process (pid, process start time, boot id, hostname, pid
namespace). The guard removes it after putting the settings back. A lease that outlives
its process (SIGKILL, OOM kill, node crash) is *stale*: the next job on that GPU, or
``lightning-energy recover``, restores the saved settings from it.

Ownership is decided in two ways that must agree before a lease is treated as stale:

* a lock: the owner holds an exclusive ``flock`` on ``<uuid>.lock`` for as long as it
  owns the GPU; the kernel drops it when the process dies, however it dies. This also
  works between containers that share the lease directory but not a pid namespace.
* the process identity: the pid is still running, with the same start time (so a reused
  pid is not mistaken for the owner), and the machine has not rebooted (same boot id).

Lease files are written atomically (temporary file, ``fsync``, ``os.replace``) so a crash
never leaves half a lease. Lock files are empty and stay in place: removing one while
another process waits on it would let two owners hold "the" lock at once.

The directory is, in order: the ``lease_dir`` argument, the ``LIGHTNING_ENERGY_LEASE_DIR``
environment variable, or ``<user state dir>/lightning-energy/leases`` (``platformdirs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import platformdirs

from lightning_energy.device.base import GPU
from lightning_energy.errors import DeviceError

if sys.platform != "win32":
    import fcntl

__all__ = [
    "LEASE_DIR_ENV",
    "Lease",
    "LeaseLock",
    "LeaseStore",
    "ProcessIdentity",
    "apply_saved_settings",
    "owner_status",
    "resolve_lease_dir",
]

log = logging.getLogger(__name__)

#: Environment variable naming the lease directory.
LEASE_DIR_ENV = "LIGHTNING_ENERGY_LEASE_DIR"

_FORMAT = 1
_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def resolve_lease_dir(lease_dir: str | Path | None = None) -> Path:
    """The lease directory: the argument, else ``$LIGHTNING_ENERGY_LEASE_DIR``, else the
    per-user state directory (``~/.local/state/lightning-energy/leases`` on Linux).

    Args:
        lease_dir: an explicit directory (wins over everything else).

    Returns:
        The directory (not created here).
    """
    if lease_dir is not None:
        return Path(lease_dir).expanduser()
    from_env = os.environ.get(LEASE_DIR_ENV)
    if from_env:
        return Path(from_env).expanduser()
    return Path(platformdirs.user_state_dir("lightning-energy")) / "leases"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the command name), or None."""
    text = _read_text(Path(f"/proc/{pid}/stat"))
    if text is None or ")" not in text:
        return None
    # The command name (field 2) is in parentheses and may itself contain ") ".
    return text[text.rindex(")") + 2 :].split()


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def _is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (visible in this pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    fields = _proc_stat(pid)
    return fields is None or fields[0] not in ("Z", "X")


@dataclass(frozen=True)
class ProcessIdentity:
    """Who owns a lease, precisely enough to tell a live owner from a reused pid.

    Attributes:
        pid: the process id.
        start_time: start time in clock ticks since boot (Linux), None elsewhere.
        boot_id: ``/proc/sys/kernel/random/boot_id``; changes at every reboot.
        hostname: the host (or container) name.
        pid_namespace: ``/proc/self/ns/pid`` link text: pids compare only within one.
    """

    pid: int
    start_time: int | None
    boot_id: str | None
    hostname: str
    pid_namespace: str | None

    @classmethod
    def current(cls) -> ProcessIdentity:
        """The identity of the calling process."""
        pid = os.getpid()
        try:
            namespace: str | None = os.readlink("/proc/self/ns/pid")
        except OSError:
            namespace = None
        return cls(
            pid=pid,
            start_time=_start_time(pid),
            boot_id=_read_text(_BOOT_ID_PATH),
            hostname=socket.gethostname(),
            pid_namespace=namespace,
        )

    def describe(self) -> str:
        """``"pid 1234 on host node1"``."""
        return f"pid {self.pid} on host {self.hostname}"


def owner_status(owner: ProcessIdentity, me: ProcessIdentity) -> tuple[bool, str]:
    """Whether the process ``owner`` is still running, as seen from process ``me``.

    Call this only while holding the lease's lock (:meth:`LeaseStore.try_lock`): a live
    owner holds that lock, so when the caller got it, an owner that cannot be checked by
    pid (another pid namespace or host) is gone.

    Args:
        owner: the identity recorded in the lease.
        me: the calling process (:meth:`ProcessIdentity.current`).

    Returns:
        ``(alive, explanation)``.
    """
    who = owner.describe()
    if owner.boot_id and me.boot_id and owner.boot_id != me.boot_id:
        return False, f"{who} ran before the machine last rebooted"
    same_namespace = owner.pid_namespace is not None and owner.pid_namespace == me.pid_namespace
    if not same_namespace or owner.hostname != me.hostname:
        return False, f"{who} (another container or host) no longer holds the lease lock"
    if not _is_running(owner.pid):
        return False, f"{who} is no longer running"
    if owner.start_time is not None:
        now_start = _start_time(owner.pid)
        if now_start is not None and now_start != owner.start_time:
            return False, f"{who} has exited and its pid was reused by another process"
    if owner.pid == me.pid and owner.start_time == me.start_time:
        return True, f"{who} is this process (another GPUGuard)"
    return True, f"{who} is running"


@dataclass(frozen=True)
class Lease:
    """One GPU's saved settings and its owner.

    Attributes:
        gpu_uuid: the GPU's stable identity (the lease's key).
        gpu_index: the GPU's process-local index in the owning job.
        gpu_name: the GPU's name, for messages.
        owner: the owning process.
        power_limit_w: the pre-job power limit.
        locked_clocks_mhz: the pre-job SM clock lock (None: not locked).
        power_limit_changed: the job has (or is about to have) changed the power limit.
        clocks_changed: the job has (or is about to have) changed the clock lock.
        backend: how to re-open the GPU: ``"nvml"`` or ``"simulated"``.
        simulated_gpu: simulated GPUs: the model name (``"a40"``, ``"a100"``, ...).
        state_path: simulated GPUs: the file holding the GPU's settings.
        created_at: when the lease was first written (ISO 8601, UTC).
    """

    gpu_uuid: str
    gpu_index: int
    gpu_name: str
    owner: ProcessIdentity
    power_limit_w: float
    locked_clocks_mhz: tuple[int, int] | None
    power_limit_changed: bool = False
    clocks_changed: bool = False
    backend: str = "nvml"
    simulated_gpu: str | None = None
    state_path: str | None = None
    created_at: str = dataclasses.field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds")
    )

    @property
    def changed(self) -> bool:
        """Whether the job changed anything that must be put back."""
        return self.power_limit_changed or self.clocks_changed

    def describe_settings(self) -> str:
        """``"power limit 300 W, clocks unlocked"``."""
        clocks = (
            "clocks unlocked"
            if self.locked_clocks_mhz is None
            else f"clocks locked to {self.locked_clocks_mhz[0]}-{self.locked_clocks_mhz[1]} MHz"
        )
        return f"power limit {self.power_limit_w:g} W, {clocks}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (with a ``format`` version)."""
        data = dataclasses.asdict(self)
        data["locked_clocks_mhz"] = (
            list(self.locked_clocks_mhz) if self.locked_clocks_mhz is not None else None
        )
        return {"format": _FORMAT, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        """Parse the JSON form.

        Raises:
            ValueError: a field is missing or of the wrong type, or an unknown format.
        """
        if data.get("format") != _FORMAT:
            raise ValueError(f"unknown lease format {data.get('format')!r} (expected {_FORMAT})")
        try:
            owner = data["owner"]
            locked = data["locked_clocks_mhz"]
            return cls(
                gpu_uuid=str(data["gpu_uuid"]),
                gpu_index=int(data["gpu_index"]),
                gpu_name=str(data["gpu_name"]),
                owner=ProcessIdentity(
                    pid=int(owner["pid"]),
                    start_time=None if owner["start_time"] is None else int(owner["start_time"]),
                    boot_id=owner["boot_id"],
                    hostname=str(owner["hostname"]),
                    pid_namespace=owner["pid_namespace"],
                ),
                power_limit_w=float(data["power_limit_w"]),
                locked_clocks_mhz=None if locked is None else (int(locked[0]), int(locked[1])),
                power_limit_changed=bool(data["power_limit_changed"]),
                clocks_changed=bool(data["clocks_changed"]),
                backend=str(data["backend"]),
                simulated_gpu=data["simulated_gpu"],
                state_path=data["state_path"],
                created_at=str(data["created_at"]),
            )
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"missing or malformed field: {exc!r}") from exc


def apply_saved_settings(gpu: GPU, lease: Lease, *, power: bool, clocks: bool) -> None:
    """Put a lease's saved settings back on ``gpu``; both are tried before raising.

    Args:
        gpu: the GPU the lease names.
        lease: its lease.
        power: restore the power limit.
        clocks: restore the clock state (the saved lock, or no lock).

    Raises:
        DeviceError: the first setting that failed.
    """
    errors: list[DeviceError] = []
    if power:
        try:
            gpu.set_power_limit_w(lease.power_limit_w)
        except DeviceError as exc:
            errors.append(exc)
    if clocks:
        try:
            if lease.locked_clocks_mhz is None:
                gpu.reset_locked_clocks()
            else:
                gpu.set_locked_clocks_mhz(*lease.locked_clocks_mhz)
        except DeviceError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


class LeaseLock:
    """An exclusive ``flock`` on a GPU's lock file, held until :meth:`release`.

    ``flock`` locks belong to the open file, so two guards in one process exclude each
    other too, and the kernel releases the lock when the process dies.
    """

    def __init__(self, fd: int | None, path: Path) -> None:
        self._fd = fd
        self._held = True
        self.path = path

    @property
    def held(self) -> bool:
        """Whether the lock is still held."""
        return self._held

    def release(self) -> None:
        """Release the lock (idempotent)."""
        fd, self._fd, self._held = self._fd, None, False
        if fd is not None:
            os.close(fd)  # closing the file drops the flock


class LeaseStore:
    """The lease files of one directory.

    Args:
        lease_dir: the directory (see :func:`resolve_lease_dir` for the default).
    """

    def __init__(self, lease_dir: str | Path | None = None) -> None:
        self.directory = resolve_lease_dir(lease_dir)

    def _stem(self, gpu_uuid: str) -> str:
        return _UNSAFE_CHARS.sub("_", gpu_uuid)

    def path_for(self, gpu_uuid: str) -> Path:
        """The lease file of a GPU."""
        return self.directory / f"{self._stem(gpu_uuid)}.json"

    def lease_paths(self) -> list[Path]:
        """Every lease file in the directory (none when it does not exist), sorted."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("*.json") if not p.name.startswith("."))

    def read_path(self, path: Path) -> Lease | None:
        """Read one lease file; None when it does not exist.

        Raises:
            DeviceError: the file is unreadable or malformed (operation ``read_lease``).
        """
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DeviceError(f"cannot read lease {path}: {exc}", operation="read_lease") from exc
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return Lease.from_dict(data)
        except ValueError as exc:
            raise DeviceError(f"malformed lease {path}: {exc}", operation="read_lease") from exc

    def read(self, gpu_uuid: str) -> Lease | None:
        """The lease of a GPU, or None.

        Raises:
            DeviceError: the file is unreadable or malformed.
        """
        return self.read_path(self.path_for(gpu_uuid))

    def write(self, lease: Lease) -> None:
        """Write (or replace) a lease atomically and durably.

        Raises:
            DeviceError: the directory cannot be created or written (operation
                ``write_lease``).
        """
        path = self.path_for(lease.gpu_uuid)
        tmp: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                if sys.platform != "win32":
                    os.fchmod(f.fileno(), 0o644)  # other users' jobs may need to read it
                json.dump(lease.to_dict(), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            self._fsync_directory()
        except OSError as exc:
            raise DeviceError(
                f"cannot write lease {path}: {exc}",
                gpu_index=lease.gpu_index,
                operation="write_lease",
            ) from exc
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def remove(self, gpu_uuid: str) -> None:
        """Delete a GPU's lease file (a missing file is fine).

        Raises:
            DeviceError: the file exists but cannot be deleted.
        """
        path = self.path_for(gpu_uuid)
        try:
            path.unlink(missing_ok=True)
            self._fsync_directory()
        except OSError as exc:
            raise DeviceError(
                f"cannot remove lease {path}: {exc}", operation="remove_lease"
            ) from exc

    def _fsync_directory(self) -> None:
        """Make a rename or unlink in the directory durable (best effort)."""
        if sys.platform == "win32":
            return
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError as exc:
            log.debug("fsync of lease directory %s failed: %s", self.directory, exc)
        finally:
            os.close(fd)

    def try_lock(self, gpu_uuid: str) -> LeaseLock | None:
        """Take the GPU's exclusive lock without waiting.

        Returns:
            The held lock, or None when another open file (a live owner) holds it.

        Raises:
            DeviceError: the lock file cannot be created or opened (operation
                ``lock_lease``).
        """
        path = self.directory / f"{self._stem(gpu_uuid)}.lock"
        if sys.platform == "win32":  # no flock: rely on the process identity alone
            return LeaseLock(None, path)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Read-only is enough for flock, so another user's lock file can be opened.
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DeviceError(f"cannot open lock {path}: {exc}", operation="lock_lease") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            raise DeviceError(f"cannot lock {path}: {exc}", operation="lock_lease") from exc
        return LeaseLock(fd, path)
