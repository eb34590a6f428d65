"""An in-memory CUDA runtime over the fake pynvml's GPUs, numbering them as CUDA does.

NVML lists GPUs in PCI bus order (the fake's list order). CUDA applies
``CUDA_DEVICE_ORDER`` (``FASTEST_FIRST`` by default: faster models first, ties by PCI bus)
and then ``CUDA_VISIBLE_DEVICES`` (indices into that order, ``GPU-`` UUIDs or unique
prefixes, ``MIG-`` instance UUIDs; the first entry naming nothing ends the list), and reports
UUIDs without their prefix, as ``torch.cuda.get_device_properties(i).uuid`` does.
"""

from __future__ import annotations

import os

from fake_pynvml import FakeDevice


class FakeCuda:
    """Implements :class:`lightning_energy.device.mapping.CudaRuntime`.

    Args:
        devices: the fake NVML GPUs, in PCI bus order.
        speed: relative speed of each model name (higher: enumerated first by CUDA).
        available: False models a machine where CUDA cannot be used.
        current: the process-local index of the current device.
    """

    def __init__(
        self,
        devices: list[FakeDevice],
        speed: dict[str, float] | None = None,
        *,
        available: bool = True,
        current: int = 0,
    ) -> None:
        self.devices = devices
        self.speed = speed or {}
        self.available = available
        self.current = current

    def _ordered(self) -> list[FakeDevice]:
        if os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") == "PCI_BUS_ID":
            return list(self.devices)
        positions = {id(d): i for i, d in enumerate(self.devices)}
        return sorted(self.devices, key=lambda d: (-self.speed.get(d.name, 1.0), positions[id(d)]))

    def _visible(self) -> list[FakeDevice]:
        ordered = self._ordered()
        entries = os.environ.get("CUDA_VISIBLE_DEVICES")
        if entries is None:
            return ordered
        visible: list[FakeDevice] = []
        for entry in (e.strip() for e in entries.split(",")):
            found: FakeDevice | None = None
            if entry.lstrip("-").isdigit():
                found = ordered[int(entry)] if 0 <= int(entry) < len(ordered) else None
            elif entry.startswith("MIG-"):
                instances = [m for d in ordered for m in d.mig_instances]
                matches = [m for m in instances if m.uuid == entry]
                found = matches[0] if matches else None
            elif entry:
                matches = [d for d in ordered if d.uuid.startswith(entry)]
                found = matches[0] if len(matches) == 1 else None
            if found is None or found in visible:
                break
            visible.append(found)
        return visible

    def is_available(self) -> bool:
        return self.available and bool(self._visible())

    def device_count(self) -> int:
        return len(self._visible()) if self.available else 0

    def current_device(self) -> int:
        return self.current

    def uuid(self, index: int) -> str:
        uuid = self._visible()[index].uuid
        return uuid.split("-", 1)[1]
