"""Files in a directory that every user may write (the lease directory).

Root reads such a directory (``lightning-energy recover`` in a Slurm epilog), so every path
in it may have been planted: a symbolic link to a file of root's, a FIFO that blocks a
reader forever, a hard link. The helpers here never follow a link, never block, and accept
only regular files, in a directory no other user can rewrite.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from lightning_energy.errors import DeviceError, UntrustedLeaseError

__all__ = [
    "OPEN_FLAGS",
    "check_regular",
    "directory_problem",
    "open_lock_file",
    "read_at_most",
]

#: Read-only, no link followed, no blocking on a FIFO, no controlling terminal.
OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def directory_problem(directory: Path, uid: int | None) -> str | None:
    """Why an existing directory is not safe to keep leases in for user ``uid``, or None.

    The directory and every one above it (after resolving symbolic links) must belong to
    root or to ``uid``, and one that group or others may write must have the sticky bit,
    so no other user can rename, replace or remove what is in it.

    Args:
        directory: the directory.
        uid: the user who will act on it (None: no ownership model, nothing to check).
    """
    if uid is None:
        return None
    real = Path(os.path.realpath(directory))
    for part in (real, *real.parents):
        try:
            st = os.lstat(part)
        except OSError as exc:
            return f"{part} cannot be inspected: {exc.strerror or exc}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{part} is not a directory"
        if st.st_uid not in (0, uid):
            return (
                f"{part} belongs to uid {st.st_uid}, another user, who could replace the "
                "leases in it; use a directory owned by root (mode 1777)"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (
                f"{part} may be written by other users and has no sticky bit, so anyone "
                f"could replace another user's lease; run `chmod +t {part}` (or `chmod go-w`)"
            )
    return None


def check_regular(path: Path, st: os.stat_result, what: str) -> None:
    """Refuse anything but a regular file (a FIFO, a directory, a device).

    Raises:
        UntrustedLeaseError: naming what the file is.
    """
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory or device"
        raise UntrustedLeaseError(
            f"{path} is {kind}, not a regular file; not used as a {what}",
            operation="read_lease" if what == "lease" else "lock_lease",
        )


def read_at_most(fd: int, limit: int) -> bytes:
    """Read from ``fd`` until end of file or ``limit`` bytes, whichever comes first."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def open_lock_file(path: Path) -> int:
    """Open (or create) a lock file read-only, never following a link nor blocking.

    An existing file is opened without ``O_CREAT``: in a sticky directory the kernel
    (``fs.protected_regular``) refuses ``O_CREAT`` on another user's file, even to root.

    Raises:
        UntrustedLeaseError: the path is a symbolic link.
        DeviceError: it cannot be opened or created.
    """
    for _ in range(3):
        try:
            return os.open(path, OPEN_FLAGS)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _lock_error(path, exc) from exc
        try:
            return os.open(path, OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue  # created by another job meanwhile: open that one
        except OSError as exc:
            raise _lock_error(path, exc) from exc
    raise DeviceError(f"cannot open lock {path}: it keeps changing", operation="lock_lease")


def _lock_error(path: Path, exc: OSError) -> DeviceError:
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        return UntrustedLeaseError(
            f"{path} is a symbolic link; lock files are never followed elsewhere",
            operation="lock_lease",
        )
    return DeviceError(f"cannot open lock {path}: {exc.strerror or exc}", operation="lock_lease")
