"""File helpers shared by the Kareus modules: atomic writes and problem lists."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lightning_energy.errors import ProfileError

__all__ = ["raise_problems", "write_atomically"]

_MAX_LISTED = 20


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, flushed to
    disk, then renamed over it: a crash leaves the old file or the new one, never half."""
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


def raise_problems(problems: list[str], what: str) -> None:
    """Raise one :class:`ProfileError` listing every problem (the first 20) of ``what``.

    Raises:
        ProfileError: when there is any problem.
    """
    if not problems:
        return
    shown = problems[:_MAX_LISTED]
    lines = "\n".join(f"  - {p}" for p in shown)
    if len(problems) > len(shown):
        lines += f"\n  - ... and {len(problems) - len(shown)} more"
    raise ProfileError(f"{len(problems)} problem(s) in {what}:\n{lines}")
