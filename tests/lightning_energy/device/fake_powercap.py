"""A powercap tree written to a folder as the kernel lays it out, with counters a test moves.

The zones live where sysfs keeps them (``devices/virtual/powercap/intel-rapl/intel-rapl:0/
intel-rapl:0:0``) and ``class/powercap`` holds links to every zone, subzones included, as
``/sys/class/powercap`` does. Counters are written atomically (a reader never sees half a
number, as with sysfs) and wrap at their range. :meth:`FakePowercap.deny` makes a file
unreadable the way a patched kernel does: mode 0400 root, which a test running as root
still reads, so :meth:`FakePowercap.read_text` (the reader's seam) raises ``EACCES`` for it.

Example:
    >>> tree = FakePowercap.intel(tmp_path, packages=2)  # doctest: +SKIP
    >>> tree.add_j("package-0", 120.0)  # doctest: +SKIP
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lightning_energy.device import rapl
from lightning_energy.device.rapl import read_sysfs

#: Intel's counter range (32-bit counter of 61 uJ units), and AMD's (15.3 uJ units).
INTEL_RANGE_UJ = 262143328850
AMD_RANGE_UJ = 65532610987


class FakePowercap:
    """A powercap tree under ``base``; :attr:`root` is what a reader is given.

    Args:
        base: the folder to write the tree in.
        zones: ``(zone, name, parent zone or None)``, e.g. ``("intel-rapl:0:2", "dram",
            "intel-rapl:0")``.
        range_uj: every counter's ``max_energy_range_uj``.
        mmio: also write ``intel-rapl-mmio:0`` (the package counter read through MMIO).
    """

    def __init__(
        self,
        base: Path,
        zones: list[tuple[str, str, str | None]],
        *,
        range_uj: int = INTEL_RANGE_UJ,
        mmio: bool = False,
    ) -> None:
        self.root = base / "class" / "powercap"
        self.root.mkdir(parents=True)
        devices = base / "devices" / "virtual" / "powercap"
        self.range_uj = range_uj
        self.denied: set[Path] = set()
        self._paths: dict[str, Path] = {}
        labels: dict[str, str] = {}
        (devices / "intel-rapl").mkdir(parents=True)
        os.symlink(devices / "intel-rapl", self.root / "intel-rapl")
        real: dict[str, Path] = {}
        for zone, name, parent in zones:
            path = (devices / "intel-rapl" if parent is None else real[parent]) / zone
            path.mkdir()
            real[zone] = path
            os.symlink(path, self.root / zone)
            label = name if parent is None else f"{labels[parent]}/{name}"
            labels[zone] = label
            # Where a reader of root finds it (what its messages name).
            self._paths[label] = (
                self.root / zone if parent is None else self._paths[labels[parent]] / zone
            )
            self._write(path / "name", name)
            self._write(path / "max_energy_range_uj", str(range_uj))
            self._write(path / "energy_uj", "0")
            self._write(path / "enabled", "1")
        if mmio:
            path = devices / "intel-rapl-mmio" / "intel-rapl-mmio:0"
            path.mkdir(parents=True)
            os.symlink(path, self.root / "intel-rapl-mmio:0")
            self._write(path / "name", "package-0")
            self._write(path / "max_energy_range_uj", str(range_uj))
            self._write(path / "energy_uj", "0")

    @classmethod
    def intel(
        cls, base: Path, *, packages: int = 2, dram: bool = True, psys: bool = False
    ) -> FakePowercap:
        """An Intel server: packages with core, uncore and (optionally) DRAM subzones."""
        zones: list[tuple[str, str, str | None]] = []
        for p in range(packages):
            zones.append((f"intel-rapl:{p}", f"package-{p}", None))
            subzones = ["core", "uncore"] + (["dram"] if dram else [])
            zones.extend(
                (f"intel-rapl:{p}:{i}", name, f"intel-rapl:{p}") for i, name in enumerate(subzones)
            )
        if psys:
            zones.append((f"intel-rapl:{packages}", "psys", None))
        return cls(base, zones, mmio=True)

    @classmethod
    def amd(cls, base: Path, *, packages: int = 2) -> FakePowercap:
        """An AMD server: packages with a core subzone, no DRAM, AMD's counter range."""
        zones: list[tuple[str, str, str | None]] = []
        for p in range(packages):
            zones.append((f"intel-rapl:{p}", f"package-{p}", None))
            zones.append((f"intel-rapl:{p}:0", "core", f"intel-rapl:{p}"))
        return cls(base, zones, range_uj=AMD_RANGE_UJ)

    # ------------------------------------------------------------------ counters
    def path(self, label: str, attribute: str = "energy_uj") -> Path:
        """The file ``attribute`` of the zone ``label`` (``package-0``, ``package-0/dram``)."""
        return self._paths[label] / attribute

    def energy_uj(self, label: str) -> int:
        """The counter of ``label`` as the kernel shows it."""
        return int(self.path(label).read_text())

    def set_uj(self, label: str, value_uj: int) -> None:
        """Set the counter of ``label``."""
        self._write(self.path(label), str(value_uj))

    def add_j(self, label: str, energy_j: float) -> None:
        """``label`` used ``energy_j``: its counter moves on, and wraps at its range."""
        add_energy_j(self.path(label), energy_j, self.range_uj)

    def write(self, label: str, attribute: str, text: str) -> None:
        """Write any text to an attribute (garbage, as a broken driver would show)."""
        self._write(self.path(label, attribute), text)

    # ------------------------------------------------------------------ permissions
    def deny(self, label: str, attribute: str = "energy_uj") -> None:
        """Make an attribute root-only, as kernels patched for CVE-2020-8694 do."""
        path = self.path(label, attribute)
        path.chmod(0o400)
        self.denied.add(path)

    def allow(self, label: str, attribute: str = "energy_uj") -> None:
        """Give read access back (as an administrator's udev rule would)."""
        path = self.path(label, attribute)
        path.chmod(0o444)
        self.denied.discard(path)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make every reader of a tree (the controller's too) read through :meth:`read_text`."""
        monkeypatch.setattr(rapl, "read_sysfs", self.read_text)

    def read_text(self, path: Path) -> str:
        """The reader's seam: what an unprivileged process reads (EACCES on denied files)."""
        if Path(os.path.realpath(path)) in {Path(os.path.realpath(p)) for p in self.denied}:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return read_sysfs(path)

    @staticmethod
    def _write(path: Path, text: str) -> None:
        write_atomically(path, text + "\n")


def write_atomically(path: Path, text: str) -> None:
    """Replace a file's text at once (a reader sees the old or the new, never half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def add_energy_j(path: Path, energy_j: float, range_uj: int) -> None:
    """Move the counter in ``path`` on by ``energy_j``, wrapping at ``range_uj`` (usable
    from another process, e.g. a rank of a multi-process test). The kernel's counter wraps
    one counter unit (15 to 61 uJ) later, which no reading can tell apart."""
    value = (int(path.read_text()) + round(energy_j * 1e6)) % range_uj
    write_atomically(path, f"{value}\n")
