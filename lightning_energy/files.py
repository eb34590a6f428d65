"""Files that outlive a process (plans, calibrations, measurement caches, simulated GPU
state) are written atomically: a crash leaves the old file or the new one, never half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, flushed to
    disk, then renamed over it: a crash leaves the old file or the new one, never half.

    The file is readable by its owner only (the temporary file's permissions).

    Args:
        path: the file to write (its folder is created when missing).
        text: the whole content.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
