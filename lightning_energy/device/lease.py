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

The directory is shared by every user of the machine, and root reads it (``recover`` in a
Slurm epilog), so nothing in it is taken on faith:

* the directory and every directory above it must belong to root or to the caller, and
  one that others may write must have the sticky bit (so nobody replaces or removes
  another user's files); a directory created here gets mode ``1777``;
* a lease is opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file with one
  link, at most :data:`MAX_LEASE_BYTES`, strict UTF-8 JSON whose every field has its type
  and range, describing the GPU it is named after;
* a lease is *trusted* when its file belongs to root or to the caller
  (:attr:`LeaseStore.trusted_uids`). Another user's lease may only undo a lowering: see
  :func:`restore_stale_lease`.

The directory is, in order: the ``lease_dir`` argument, the ``LIGHTNING_ENERGY_LEASE_DIR``
environment variable, or :data:`DEFAULT_LEASE_DIR` (``/run/lightning-energy``), one
directory for every user and container of the machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import socket
import sys
import tempfile
import weakref
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_energy.device.base import GPU
from lightning_energy.device.lease_fields import (
    field,
    kind_of,
    parse_json,
    read_bool,
    read_clock_lock,
    read_int,
    read_optional_int,
    read_optional_text,
    read_text,
    read_watts,
    show,
)
from lightning_energy.device.shared_dir import (
    OPEN_FLAGS,
    check_regular,
    directory_problem,
    open_lock_file,
    read_at_most,
)
from lightning_energy.device.zeusd_client import ZeusdAddress
from lightning_energy.errors import ConfigError, DeviceError, UntrustedLeaseError

if sys.platform != "win32":
    import fcntl

__all__ = [
    "DEFAULT_LEASE_DIR",
    "LEASE_DIR_ENV",
    "MAX_LEASE_BYTES",
    "Lease",
    "LeaseLock",
    "LeaseStore",
    "ProcessIdentity",
    "apply_saved_settings",
    "directory_problem",
    "owner_status",
    "resolve_lease_dir",
    "restore_stale_lease",
]

log = logging.getLogger(__name__)

#: Environment variable naming the lease directory.
LEASE_DIR_ENV = "LIGHTNING_ENERGY_LEASE_DIR"

#: The lease directory when none is configured: one for every user and container of the
#: machine (``/run`` is cleared at boot, as GPU settings are).
DEFAULT_LEASE_DIR = (
    Path("/run/lightning-energy")
    if Path("/run").is_dir()
    else Path(tempfile.gettempdir()) / "lightning-energy"
)

#: The largest lease file read (a real lease is well under 1 KiB).
MAX_LEASE_BYTES = 64 * 1024

_FORMAT = 1
_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
_MODEL = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")
_BACKENDS = ("nvml", "zeusd", "simulated")
_MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT


def _euid() -> int | None:
    """The effective uid (None where there are no uids)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def resolve_lease_dir(lease_dir: str | Path | None = None) -> Path:
    """The lease directory: the argument, else ``$LIGHTNING_ENERGY_LEASE_DIR``, else
    :data:`DEFAULT_LEASE_DIR`, shared by every user of the machine.

    Args:
        lease_dir: an explicit directory (wins over everything else).

    Returns:
        The directory (not created here).

    Raises:
        ConfigError: ``lease_dir`` is not a path, or is empty (which would mean the
            current directory).
    """
    if lease_dir is not None:
        if not isinstance(lease_dir, (str, os.PathLike)):
            raise ConfigError(
                f"lease_dir: {lease_dir!r} is not allowed; "
                "use a directory path (a string), or unset for "
                f"{DEFAULT_LEASE_DIR}",
                source="lease directory",
            )
        if not str(lease_dir).strip():
            raise ConfigError(
                f"lease_dir: {str(lease_dir)!r} is not allowed; name a directory (an empty "
                f"path would be the current directory), or leave it unset for {DEFAULT_LEASE_DIR}",
                source="lease directory",
            )
        return Path(lease_dir).expanduser()
    from_env = os.environ.get(LEASE_DIR_ENV)
    if from_env and from_env.strip():
        return Path(from_env).expanduser()
    return DEFAULT_LEASE_DIR


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
        backend: how to re-open the GPU: ``"nvml"``, ``"zeusd"`` or ``"simulated"``.
        simulated_gpu: simulated GPUs: the model name (``"a40"``, ``"a100"``, ...).
        state_path: simulated GPUs: the file holding the GPU's settings.
        zeusd_address: zeusd GPUs: the daemon that changed them (``unix:<path>`` or
            ``tcp:<host>:<port>``; a token is never recorded).
        created_at: when the lease was first written (ISO 8601, UTC).
        file_uid: the owner of the file it was read from (None: not read from a file, or
            no uids on this platform); not part of the file.
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
    zeusd_address: str | None = None
    created_at: str = dataclasses.field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds")
    )
    file_uid: int | None = dataclasses.field(default=None, compare=False)

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
        del data["file_uid"]
        data["locked_clocks_mhz"] = (
            list(self.locked_clocks_mhz) if self.locked_clocks_mhz is not None else None
        )
        return {"format": _FORMAT, **data}

    @classmethod
    def from_dict(cls, data: Any) -> Lease:
        """Parse the JSON form, checking the type and range of every field.

        Raises:
            ValueError: not an object, a field is missing or has the wrong type or an
                impossible value, or an unknown format.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a lease is a JSON object, not {kind_of(data)}")
        if data.get("format") != _FORMAT:
            raise ValueError(
                f"unknown lease format {show(data.get('format'))} (expected {_FORMAT})"
            )
        owner = field(data, "owner")
        if not isinstance(owner, dict):
            raise ValueError(f"owner: a JSON object is needed, not {kind_of(owner)}")
        uuid = read_text(data, "gpu_uuid")
        if not _UUID.fullmatch(uuid):
            raise ValueError(f"gpu_uuid: {show(uuid)} is not a GPU UUID")
        backend = read_text(data, "backend")
        if backend not in _BACKENDS:
            raise ValueError(f"backend: {show(backend)} is not one of {', '.join(_BACKENDS)}")
        model = read_optional_text(data, "simulated_gpu")
        if model is not None and not _MODEL.fullmatch(model):
            raise ValueError(f"simulated_gpu: {show(model)} is not a simulated GPU model name")
        state_path = read_optional_text(data, "state_path", max_len=4096)
        if state_path is not None and not os.path.isabs(state_path):
            raise ValueError(f"state_path: {show(state_path)} is not an absolute path")
        # Absent from the leases of versions without the zeusd backend.
        zeusd_address = (
            read_optional_text(data, "zeusd_address", max_len=4096)
            if "zeusd_address" in data
            else None
        )
        if zeusd_address is not None:
            try:
                ZeusdAddress.parse(zeusd_address)
            except ValueError as exc:
                raise ValueError(f"zeusd_address: {exc}") from None
        if (backend == "zeusd") != (zeusd_address is not None):
            raise ValueError(
                f"zeusd_address: {show(zeusd_address)} with backend {backend}: a daemon's "
                "address goes with backend zeusd, and only there"
            )
        return cls(
            gpu_uuid=uuid,
            gpu_index=read_int(data, "gpu_index", 0, 1 << 16),
            gpu_name=read_text(data, "gpu_name"),
            owner=ProcessIdentity(
                pid=read_int(owner, "pid", 1, _MAX_PID, prefix="owner."),
                start_time=read_optional_int(owner, "start_time", prefix="owner."),
                boot_id=read_optional_text(owner, "boot_id", prefix="owner."),
                hostname=read_text(owner, "hostname", prefix="owner."),
                pid_namespace=read_optional_text(owner, "pid_namespace", prefix="owner."),
            ),
            power_limit_w=read_watts(data, "power_limit_w"),
            locked_clocks_mhz=read_clock_lock(data, "locked_clocks_mhz"),
            power_limit_changed=read_bool(data, "power_limit_changed"),
            clocks_changed=read_bool(data, "clocks_changed"),
            backend=backend,
            simulated_gpu=model,
            state_path=state_path,
            zeusd_address=zeusd_address,
            created_at=read_text(data, "created_at"),
        )


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


def restore_stale_lease(gpu: GPU, lease: Lease, *, trusted: bool) -> str:
    """Put back what a dead job's lease says it changed, within what the driver allows.

    The saved values are capped by what the driver reports, never taken as they are:

    * the power limit is raised back to the saved limit, capped at the GPU's maximum (a
      trusted lease) or its default limit (another user's lease); it is never lowered: a
      limit already at or above the saved one stays;
    * a trusted lease's saved clock lock is set again when it lies within the GPU's
      supported clocks; otherwise, and for every lease of another user, the clock lock is
      released.

    Args:
        gpu: the GPU the lease names.
        lease: the stale lease.
        trusted: the lease file belongs to root or to the caller
            (:meth:`LeaseStore.trusts`).

    Returns:
        What was done, in words.

    Raises:
        UntrustedLeaseError: another user's lease asks for a limit lower than the GPU has
            now, which only root may decide; nothing was changed.
        DeviceError: the GPU could not be read or changed (both settings are tried).
    """
    done: list[str] = []
    power_w: float | None = None
    if lease.power_limit_changed:
        current_w = gpu.power_limit_w()
        if not trusted and lease.power_limit_w < current_w:
            raise UntrustedLeaseError(
                f"the lease of uid {lease.file_uid} (another user) asks for "
                f"{lease.power_limit_w:g} W, lower than the "
                f"{current_w:g} W the GPU has now; a lease of another user may only undo a "
                "lowering",
                operation="restore_lease",
            )
        lo_w, hi_w = gpu.power_limit_constraints_w()
        ceiling_w = hi_w if trusted else min(hi_w, gpu.default_power_limit_w())
        target_w = min(max(lease.power_limit_w, lo_w), ceiling_w)
        if target_w > current_w:
            power_w = target_w
            capped = (
                ""
                if target_w == lease.power_limit_w
                else f" (the lease said {lease.power_limit_w:g} W)"
            )
            done.append(f"power limit {current_w:g} W -> {target_w:g} W{capped}")
        else:
            done.append(f"kept {current_w:g} W (a lease never lowers a limit)")
    lock: tuple[int, int] | None = None
    if lease.clocks_changed and trusted and lease.locked_clocks_mhz is not None:
        supported = gpu.supported_sm_clocks_mhz()
        lo_mhz, hi_mhz = lease.locked_clocks_mhz
        if min(supported) <= lo_mhz and hi_mhz <= max(supported):
            lock = lease.locked_clocks_mhz
    errors: list[DeviceError] = []
    if power_w is not None:
        try:
            gpu.set_power_limit_w(power_w)
        except DeviceError as exc:
            errors.append(exc)
    if lease.clocks_changed:
        try:
            if lock is None:
                gpu.reset_locked_clocks()
                done.append("clock lock released")
            else:
                gpu.set_locked_clocks_mhz(*lock)
                done.append(f"clocks locked to {lock[0]}-{lock[1]} MHz")
        except DeviceError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return ", ".join(done) if done else "nothing was changed"


class LeaseLock:
    """An exclusive ``flock`` on a GPU's lock file, held until :meth:`release`.

    ``flock`` locks belong to the open file, so two guards in one process exclude each
    other too, and the kernel releases the lock when the process dies. A forked child
    (a DataLoader worker, a pool process) shares the open file: it closes its copy at the
    fork (:func:`os.register_at_fork`), or a worker that outlives a killed job would hold
    the job's lock, and ``recover`` and the next job would take the dead job for alive.
    The descriptor is not inherited across ``exec`` either (Python opens it close-on-exec).
    """

    def __init__(self, fd: int | None, path: Path) -> None:
        self._fd = fd
        self._held = True
        self.path = path
        if fd is not None:
            _OPEN_LOCKS.add(self)

    @property
    def held(self) -> bool:
        """Whether the lock is still held (by this process: never in a forked child)."""
        return self._held

    def release(self) -> None:
        """Release the lock (idempotent)."""
        _OPEN_LOCKS.discard(self)
        fd, self._fd, self._held = self._fd, None, False
        if fd is not None:
            os.close(fd)  # closing the file drops the flock


#: The locks this process holds, whose files a forked child must close.
_OPEN_LOCKS: weakref.WeakSet[LeaseLock] = weakref.WeakSet()


def _close_inherited_locks() -> None:
    """In a forked child: close the parent's lock files (the parent keeps its locks)."""
    for lock in list(_OPEN_LOCKS):
        lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


class LeaseStore:
    """The lease files of one directory.

    Args:
        lease_dir: the directory (see :func:`resolve_lease_dir` for the default).
        trusted_uids: owners whose lease files are believed as they are (default: root
            and the calling user); other users' leases may only undo a lowering (see
            :func:`restore_stale_lease`).

    Raises:
        ConfigError: ``lease_dir`` is empty.
    """

    def __init__(
        self, lease_dir: str | Path | None = None, *, trusted_uids: Collection[int] | None = None
    ) -> None:
        self.directory = resolve_lease_dir(lease_dir)
        self._uid = _euid()
        default = {0} if self._uid is None else {0, self._uid}
        self.trusted_uids = frozenset(default if trusted_uids is None else trusted_uids)

    def trusts(self, lease: Lease) -> bool:
        """Whether a lease read from this directory is believed as it is (its file belongs
        to a trusted owner, or the platform has no file owners)."""
        return lease.file_uid is None or lease.file_uid in self.trusted_uids

    def _stem(self, gpu_uuid: str) -> str:
        return _UNSAFE_CHARS.sub("_", gpu_uuid)

    def path_for(self, gpu_uuid: str) -> Path:
        """The lease file of a GPU."""
        return self.directory / f"{self._stem(gpu_uuid)}.json"

    def check_directory(self) -> None:
        """Refuse a directory other users could rewrite (see :func:`directory_problem`).

        Raises:
            UntrustedLeaseError: the directory is not safe (operation ``lease_dir``).
        """
        problem = directory_problem(self.directory, self._uid)
        if problem is not None:
            raise UntrustedLeaseError(
                f"unsafe lease directory {self.directory}: {problem}; see docs/permissions.md",
                operation="lease_dir",
            )

    def ensure_directory(self) -> None:
        """Create the directory when missing (sticky, writable by all: every user's jobs
        lease GPUs in it) and check it.

        Raises:
            UntrustedLeaseError: the directory is not safe.
            DeviceError: it cannot be created (operation ``lease_dir``).
        """
        if not self.directory.is_dir():
            try:
                self.directory.parent.mkdir(parents=True, exist_ok=True)
                self.directory.mkdir(mode=0o700)
                if sys.platform != "win32":
                    os.chmod(self.directory, 0o1777)  # not subject to the umask
            except FileExistsError:
                pass  # created meanwhile (by another job); checked below
            except OSError as exc:
                raise DeviceError(
                    f"cannot create the lease directory {self.directory}: "
                    f"{exc.strerror or exc}; create it as root with mode 1777 (see "
                    f"docs/permissions.md) or set {LEASE_DIR_ENV} / device.lease_dir",
                    operation="lease_dir",
                ) from exc
        self.check_directory()

    def lease_paths(self) -> list[Path]:
        """Every lease file in the directory (none when it does not exist), sorted.

        Raises:
            UntrustedLeaseError: the directory is not safe.
        """
        if not self.directory.is_dir():
            return []
        self.check_directory()
        return sorted(p for p in self.directory.glob("*.json") if not p.name.startswith("."))

    def read_path(self, path: Path) -> Lease | None:
        """Read one lease file; None when it does not exist.

        The file is opened without following a symbolic link and without blocking (a FIFO
        does not hang), and must be a regular file with one link of at most
        :data:`MAX_LEASE_BYTES` describing the GPU it is named after.

        Raises:
            UntrustedLeaseError: the file is not a lease to act on (a link, a FIFO, too big,
                or another user's malformed lease).
            DeviceError: the file is unreadable, or a trusted lease is malformed
                (operation ``read_lease``).
        """
        try:
            fd = os.open(path, OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise UntrustedLeaseError(
                    f"{path} is a symbolic link; leases are never followed elsewhere",
                    operation="read_lease",
                ) from exc
            raise DeviceError(
                f"cannot read lease {path}: {exc.strerror or exc}", operation="read_lease"
            ) from exc
        try:
            st = os.fstat(fd)
            file_uid = st.st_uid if self._uid is not None else None
            check_regular(path, st, "lease")
            if st.st_nlink != 1:
                raise UntrustedLeaseError(
                    f"{path} has {st.st_nlink} hard links; a lease is a file of its own",
                    operation="read_lease",
                )
            raw = read_at_most(fd, MAX_LEASE_BYTES + 1)
        except OSError as exc:
            raise DeviceError(
                f"cannot read lease {path}: {exc.strerror or exc}", operation="read_lease"
            ) from exc
        finally:
            os.close(fd)
        whose = "" if file_uid is None else f" (owned by uid {file_uid})"
        if len(raw) > MAX_LEASE_BYTES:
            raise UntrustedLeaseError(
                f"{path}{whose} is larger than {MAX_LEASE_BYTES} bytes; not read",
                operation="read_lease",
            )
        try:
            lease = dataclasses.replace(_parse(raw), file_uid=file_uid)
            if self.path_for(lease.gpu_uuid) != path:
                raise ValueError(f"it describes GPU {lease.gpu_uuid}, not {path.stem}")
        except ValueError as exc:
            trusted = file_uid is None or file_uid in self.trusted_uids
            error = DeviceError if trusted else UntrustedLeaseError
            raise error(f"malformed lease {path}{whose}: {exc}", operation="read_lease") from exc
        return lease

    def read(self, gpu_uuid: str) -> Lease | None:
        """The lease of a GPU, or None.

        Raises:
            UntrustedLeaseError: the directory or the file is not safe to act on.
            DeviceError: the file is unreadable or malformed.
        """
        if not self.directory.is_dir():
            return None
        self.check_directory()
        return self.read_path(self.path_for(gpu_uuid))

    def write(self, lease: Lease) -> None:
        """Write (or replace) a lease atomically and durably.

        Raises:
            UntrustedLeaseError: the directory is not safe.
            DeviceError: the directory cannot be created or written (operation
                ``write_lease``); in a sticky directory that includes a file of the same
                name owned by another user.
        """
        path = self.path_for(lease.gpu_uuid)
        self.ensure_directory()
        tmp: str | None = None
        try:
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
                f"cannot write lease {path}: {exc.strerror or exc}",
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
                f"cannot remove lease {path}: {exc.strerror or exc}", operation="remove_lease"
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

        The lock file is opened without following a symbolic link and must be a regular
        file; it may belong to another user (whose job created it first).

        Returns:
            The held lock, or None when another open file (a live owner) holds it.

        Raises:
            UntrustedLeaseError: the directory or the lock file is not safe.
            DeviceError: the lock file cannot be created or opened (operation
                ``lock_lease``).
        """
        path = self.directory / f"{self._stem(gpu_uuid)}.lock"
        if sys.platform == "win32":  # no flock: rely on the process identity alone
            return LeaseLock(None, path)
        self.ensure_directory()
        fd = open_lock_file(path)
        try:
            check_regular(path, os.fstat(fd), "lock file")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            raise DeviceError(f"cannot lock {path}: {exc}", operation="lock_lease") from exc
        except BaseException:
            os.close(fd)
            raise
        return LeaseLock(fd, path)


def _parse(raw: bytes) -> Lease:
    """Parse a lease's bytes: strict UTF-8 JSON, every field checked.

    Raises:
        ValueError: anything else, in words.
    """
    return Lease.from_dict(parse_json(raw))
