"""RAPL energy counters of the CPU packages and DRAM, read from the Linux powercap tree.

The kernel's RAPL driver (``intel_rapl_msr``, which also serves AMD processors since
Linux 5.8) exposes one zone per CPU package under ``/sys/class/powercap``::

    intel-rapl:0/                   name package-0   energy_uj  max_energy_range_uj
    intel-rapl:0/intel-rapl:0:0/    name core        (inside the package)
    intel-rapl:0/intel-rapl:0:1/    name uncore      (inside the package)
    intel-rapl:0/intel-rapl:0:2/    name dram        (beside the package)
    intel-rapl:1/                   name package-1   (or psys: the whole platform)

``energy_uj`` is a cumulative counter in microjoules that starts again from 0 after
``max_energy_range_uj``. Counted: every package and the DRAM beside it. Left out, so that
nothing is counted twice: ``core`` and ``uncore`` (inside their package), ``psys`` (the
platform domain of client machines, which includes the packages), the
``intel-rapl-mmio`` zones (the same package counter read through MMIO) and a zone named
like a package already counted. AMD processors expose their packages (and ``core``),
mostly without DRAM.

Since the 2020 fix for the Platypus attack (CVE-2020-8694) ``energy_uj`` is readable by
root only; ``name`` and ``max_energy_range_uj`` stay readable by every user.

Every file is read through one seam (``read_text``), so a test can make a file as rude as
the kernel makes it (``EACCES``, garbage) even when the tests run as root.

Example:
    >>> counters = RaplCounters("/sys/class/powercap")  # doctest: +SKIP
    >>> [d.label for d in counters.domains]  # doctest: +SKIP
    ['package-0', 'package-0/dram', 'package-1', 'package-1/dram']
    >>> counters.read_uj()  # doctest: +SKIP
    [43200155841, 1830245118, 40123305712, 1790033411]
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from lightning_energy.errors import NodeEnergyError

__all__ = ["DEFAULT_POWERCAP_ROOT", "RaplCounters", "RaplDomain", "read_sysfs"]

#: Where the kernel exposes the power-capping zones.
DEFAULT_POWERCAP_ROOT = Path("/sys/class/powercap")

_PACKAGE_ZONE = re.compile(r"intel-rapl:(\d+)")
_SUB_ZONE = re.compile(r"intel-rapl:(\d+):(\d+)")
_PACKAGE_NAME = re.compile(r"package-\d+(-die-\d+)?")
_COUNTER = re.compile(r"[0-9]{1,20}")
_MAX_U64 = 2**64 - 1
#: Attributes are a few bytes; a longer file is not a powercap attribute.
_READ_BYTES = 64
#: The kernel's identity for this boot, shared by every container of the machine.
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_PERMISSION_HINT = (
    "readable by root only on kernels patched for CVE-2020-8694 (2020); "
    "docs/permissions.md says how an administrator grants read access"
)


def read_sysfs(path: Path) -> str:
    """The text of a sysfs attribute (its first 64 bytes, ASCII).

    Raises:
        OSError: the file cannot be opened or read.
        UnicodeDecodeError: it is not ASCII text.
    """
    with open(path, "rb") as f:
        return f.read(_READ_BYTES).decode("ascii")


@dataclass(frozen=True)
class RaplDomain:
    """One counted RAPL domain.

    Attributes:
        zone: the powercap zone (``intel-rapl:0:2``).
        name: the zone's name (``package-0``, ``dram``).
        kind: ``package`` or ``dram``.
        package: the package it belongs to (its own name for a package).
        max_energy_range_uj: the counter's range: it starts again from 0 after it.
        energy_path: its ``energy_uj`` file.
    """

    zone: str
    name: str
    kind: str
    package: str
    max_energy_range_uj: int
    energy_path: Path

    @property
    def label(self) -> str:
        """``package-0`` for a package, ``package-0/dram`` for its DRAM."""
        return self.package if self.kind == "package" else f"{self.package}/{self.name}"


class RaplCounters:
    """The counted RAPL domains of a powercap tree, and their readings.

    Every counted counter is read once when the tree is opened, so an unreadable one is
    found now, not mid-run. A package that cannot be read makes the whole tree unusable
    (counting some packages only would undercount without saying so); a DRAM domain
    that cannot be read is left out, and :attr:`left_out` says why.

    Args:
        root: the powercap directory (``/sys/class/powercap``, or where a container mounts
            it); ``/sys/class/powercap/intel-rapl`` works too.
        read_text: reads one attribute file (None: :func:`read_sysfs`).

    Attributes:
        domains: the counted domains, packages in index order, each followed by its DRAM.
        left_out: each zone seen but not counted, and why.

    Raises:
        NodeEnergyError: nothing can be measured: no tree, no package zone, or a package
            whose counter cannot be read (permission, missing, not a counter); the message
            names the file.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] = DEFAULT_POWERCAP_ROOT,
        *,
        read_text: Callable[[Path], str] | None = None,
    ) -> None:
        self.root = Path(root)
        self._read_text = read_text or read_sysfs
        self.left_out: list[str] = []
        self.domains: tuple[RaplDomain, ...] = tuple(self._discover())

    @cached_property
    def key(self) -> str:
        """Who else reads these counters: processes of one machine (one kernel, containers
        included) reading the same tree get the same key."""
        try:
            boot = _BOOT_ID.read_text(encoding="ascii").strip()
        except (OSError, ValueError):
            boot = ""
        return f"{boot or socket.gethostname()}:{os.path.realpath(self.root)}"

    def read_uj(self) -> list[int]:
        """One reading of every counted counter, in the order of :attr:`domains`.

        Raises:
            NodeEnergyError: a counter cannot be read or holds no valid count.
        """
        return [self._counter(d.energy_path, d.max_energy_range_uj) for d in self.domains]

    # ------------------------------------------------------------------ discovery
    def _discover(self) -> list[RaplDomain]:
        try:
            entries = sorted(p.name for p in self.root.iterdir())
        except FileNotFoundError as exc:
            raise NodeEnergyError(
                f"no powercap tree at {self.root} (no RAPL driver loaded, a virtual machine, "
                "or a container that does not mount /sys/class/powercap)",
                why="no RAPL counters",
            ) from exc
        except OSError as exc:
            raise self._error(self.root, exc) from exc
        self.left_out.extend(
            f"{e}: the package counter again, read through MMIO"
            for e in entries
            if e.startswith("intel-rapl-mmio:")
        )
        zones = sorted(
            (int(m.group(1)), e) for e in entries if (m := _PACKAGE_ZONE.fullmatch(e)) is not None
        )
        domains: list[RaplDomain] = []
        seen: dict[str, str] = {}
        for _, zone in zones:
            path = self.root / zone
            name = self._text(path / "name")
            if name == "psys":
                self.left_out.append(f"{zone} psys: the platform domain, it includes the packages")
            elif not _PACKAGE_NAME.fullmatch(name):
                self.left_out.append(f"{zone} {name[:24]!r}: not a CPU package")
            elif name in seen:
                self.left_out.append(f"{zone} {name}: named like {seen[name]}, counted once")
            else:
                seen[name] = zone
                domains.append(self._domain(path, zone, name, "package", name))
                domains.extend(self._subzones(path, name))
        if not domains:
            raise NodeEnergyError(
                f"{self.root} has no RAPL package zone (intel-rapl:N named package-N)",
                why="no RAPL counters",
            )
        return domains

    def _subzones(self, path: Path, package: str) -> list[RaplDomain]:
        """The DRAM beside a package; core and uncore are inside it (left out)."""
        try:
            entries = sorted(
                (tuple(map(int, m.groups())), p.name)
                for p in path.iterdir()
                if (m := _SUB_ZONE.fullmatch(p.name)) is not None
            )
        except OSError as exc:
            self.left_out.append(f"{package}: its subzones cannot be listed ({exc.strerror})")
            return []
        found: list[RaplDomain] = []
        for _, zone in entries:
            try:
                name = self._text(path / zone / "name")
                if name != "dram":
                    where = "inside" if name in ("core", "uncore") else "not known to be outside"
                    self.left_out.append(f"{package}/{name[:24]}: {where} {package}")
                    continue
                found.append(self._domain(path / zone, zone, name, "dram", package))
            except NodeEnergyError as exc:
                self.left_out.append(f"{package}/{zone}: not counted ({exc})")
        return found

    def _domain(self, path: Path, zone: str, name: str, kind: str, package: str) -> RaplDomain:
        range_uj = self._counter(path / "max_energy_range_uj", _MAX_U64)
        if range_uj == 0:
            raise NodeEnergyError(
                f"{path / 'max_energy_range_uj'} is 0: the counter has no range",
                why="RAPL counters unreadable",
            )
        domain = RaplDomain(zone, name, kind, package, range_uj, path / "energy_uj")
        self._counter(domain.energy_path, range_uj)  # readable now, or the reason why not
        return domain

    # ------------------------------------------------------------------ files
    def _counter(self, path: Path, limit: int) -> int:
        text = self._text(path)
        if not _COUNTER.fullmatch(text):
            raise NodeEnergyError(
                f"{path} holds {text[:24]!r}, not a count of microjoules",
                why="RAPL counters unreadable",
            )
        value = int(text)
        if value > limit:
            raise NodeEnergyError(
                f"{path} holds {value}, above the counter's range {limit}",
                why="RAPL counters unreadable",
            )
        return value

    def _text(self, path: Path) -> str:
        try:
            return self._read_text(path).strip()
        except OSError as exc:
            raise self._error(path, exc) from exc
        except ValueError as exc:  # not ASCII
            raise NodeEnergyError(
                f"{path} is not a text attribute", why="RAPL counters unreadable"
            ) from exc

    @staticmethod
    def _error(path: Path, exc: OSError) -> NodeEnergyError:
        if isinstance(exc, PermissionError):
            hint = f" (energy_uj is {_PERMISSION_HINT})" if path.name == "energy_uj" else ""
            return NodeEnergyError(
                f"{path}: permission denied{hint}", why="RAPL not readable (permission)"
            )
        return NodeEnergyError(
            f"{path} cannot be read: {exc.strerror or exc}", why="RAPL counters unreadable"
        )
