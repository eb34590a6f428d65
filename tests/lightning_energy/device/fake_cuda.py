"""An in-memory CUDA runtime, as rude as a GPU where this package depends on it.

:class:`FakeCuda` stands in for ``torch.cuda`` on a machine without a GPU. Installed with
:meth:`FakeCuda.install`, it makes ``torch.cuda`` (and so Lightning's and Accelerate's own
accelerator selection) behave as on a GPU machine:

* CUDA is available, with several devices numbered as CUDA numbers them: NVML lists GPUs in
  PCI bus order (the order given); CUDA applies ``CUDA_DEVICE_ORDER`` (``FASTEST_FIRST`` by
  default: faster models first, ties by PCI bus) and then ``CUDA_VISIBLE_DEVICES``
  (indices into that order, ``GPU-`` UUIDs or unique prefixes, ``MIG-`` instance UUIDs; the
  first entry naming nothing ends the list), and reports UUIDs without their prefix, as
  ``torch.cuda.get_device_properties(i).uuid`` does.
* Each host thread has its own current device (a new thread starts on device 0, as a CUDA
  context does) and its own current stream per device; every device has its own default
  stream. :attr:`FakeCuda.contexts` records, per thread name, the devices each thread made a
  CUDA context on: the device it sets, the device of a stream it records on, launches on or
  waits for (torch switches to that device), and its current device for waits on an event
  (``cudaEventSynchronize`` / ``cudaEventQuery`` run on the calling thread's current device,
  so a thread that never called ``set_device`` makes a context on device 0).
* Work is asynchronous: :meth:`FakeCuda.launch` queues simulated kernels on a stream; the
  GPU's time moves only when the host waits (``synchronize``) or a test lets it pass
  (:meth:`FakeCuda.advance`). Until then an event recorded after the work is not complete:
  ``Event.query()`` is False and ``Event.elapsed_time`` raises, as CUDA does.
* A stream can be stalled (:meth:`FakeCuda.stall`: a collective whose peer is gone): waiting
  on it blocks the waiting thread until :meth:`FakeCuda.release`, as a real wait never ends.
* A device can be lost (:meth:`FakeCuda.lose`): every later call on it raises the sticky
  CUDA error.

It also implements :class:`lightning_energy.device.mapping.CudaRuntime`, for the mapping from
torch devices to NVML GPUs.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
import torch


class _Described(Protocol):
    """What the fake needs of a GPU: a fake NVML device fits, or a :class:`CudaDevice`."""

    name: str
    uuid: str
    mig_instances: Any


@dataclass
class CudaDevice:
    """A GPU as CUDA describes it (``uuid`` with its ``GPU-`` prefix, as NVML gives it)."""

    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    major: int = 9
    minor: int = 0
    total_memory: int = 141 * 2**30
    multi_processor_count: int = 132
    mig_instances: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class _Properties:
    """What ``torch.cuda.get_device_properties`` returns (the fields read here)."""

    name: str
    uuid: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int


def cuda_devices(count: int, name: str = "NVIDIA H200") -> list[CudaDevice]:
    """``count`` identical GPUs with distinct UUIDs, in PCI bus order."""
    return [
        CudaDevice(name=name, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000") for i in range(count)
    ]


class FakeStream:
    """A CUDA stream of one device: work queued on it runs in order on the GPU's time."""

    def __init__(self, cuda: FakeCuda, device: int, *, default: bool = False) -> None:
        self.cuda = cuda
        self.device = torch.device("cuda", device)
        self.device_index = device
        self.default = default
        self.ready_s = 0.0  # when the last work queued on it finishes (inf: stalled)
        cuda.streams.append(self)

    def __repr__(self) -> str:
        kind = "default" if self.default else "side"
        return f"FakeStream(cuda:{self.device_index}, {kind})"

    def query(self) -> bool:
        """Whether all work queued so far has finished."""
        self.cuda._context(self.device_index)
        self.cuda._check(self.device_index)
        return self.ready_s <= self.cuda.now_s

    def synchronize(self) -> None:
        """Block until all work queued so far has finished."""
        self.cuda._context(self.device_index)
        self.cuda._wait_until(self.device_index, self.ready_s)

    def wait_event(self, event: FakeEvent) -> None:
        """Later work on this stream starts after ``event``."""
        if event.time_s is not None:
            self.ready_s = max(self.ready_s, event.time_s)

    def wait_stream(self, stream: FakeStream) -> None:
        """Later work on this stream starts after what ``stream`` has queued."""
        self.ready_s = max(self.ready_s, stream.ready_s)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        """Record ``event`` (a new one when None) on this stream."""
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event


class FakeEvent:
    """``torch.cuda.Event``: a point of a stream, complete once the GPU has reached it."""

    cuda: FakeCuda  # the installed fake (set by install)

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.device_index: int | None = None
        self.time_s: float | None = None  # when the GPU reaches it; None: never recorded
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        """Mark the current point of ``stream`` (default: the current stream)."""
        cuda = self.cuda
        stream = stream if stream is not None else cuda.current_stream()
        cuda._context(stream.device_index)
        cuda._check(stream.device_index)
        if self.device_index is not None and self.device_index != stream.device_index:
            raise RuntimeError(
                f"Event device {self.device_index} does not match recording stream's device "
                f"{stream.device_index}."
            )
        self.device_index = stream.device_index
        self.stream = stream
        self.time_s = max(cuda.now_s, stream.ready_s)

    def query(self) -> bool:
        """True once the GPU has passed the recorded point (an unrecorded event: True)."""
        if self.time_s is None:
            return True
        assert self.device_index is not None
        self.cuda._context()
        self.cuda._check(self.device_index)
        return self.time_s <= self.cuda.now_s

    def synchronize(self) -> None:
        """Block until the GPU reaches the recorded point."""
        if self.time_s is None:
            return
        assert self.device_index is not None
        self.cuda._context()
        self.cuda._wait_until(self.device_index, self.time_s)

    def wait(self, stream: FakeStream | None = None) -> None:
        """Later work on ``stream`` (default: the current one) starts after this event."""
        (stream if stream is not None else self.cuda.current_stream()).wait_event(self)

    def elapsed_time(self, end_event: FakeEvent) -> float:
        """Milliseconds between this event and ``end_event``, both complete.

        Raises:
            RuntimeError: an event without timing, not recorded, or not complete yet.
        """
        if self.device_index is not None:
            self.cuda._context(self.device_index)
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.time_s is None or end_event.time_s is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            raise RuntimeError("CUDA error: device not ready")
        return (end_event.time_s - self.time_s) * 1000.0


class FakeCuda:
    """``torch.cuda`` over simulated GPUs; implements ``CudaRuntime`` too.

    Args:
        devices: the GPUs in PCI bus order (fake NVML devices, or :class:`CudaDevice`).
        speed: relative speed of each model name (higher: enumerated first by CUDA).
        available: False models a machine where CUDA cannot be used.
        current: the current device of the thread that builds the fake.
    """

    def __init__(
        self,
        devices: Sequence[_Described],
        speed: dict[str, float] | None = None,
        *,
        available: bool = True,
        current: int = 0,
    ) -> None:
        self.devices = list(devices)
        self.speed = speed or {}
        self.available = available
        self.now_s = 0.0  # the GPUs' time
        self.lost: set[int] = set()
        self.synchronize_calls: list[int] = []  # device of every host wait
        #: Per thread name, the devices that thread made a CUDA context on.
        self.contexts: dict[str, set[int]] = {}
        self._threads = threading.local()
        self._main_current = current
        self.streams: list[FakeStream] = []  # every stream made, default ones included
        self._default_streams: dict[int, FakeStream] = {}
        self._cond = threading.Condition()
        self._released = False

    # ------------------------------------------------------------ enumeration
    def _ordered(self) -> list[_Described]:
        if os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") == "PCI_BUS_ID":
            return list(self.devices)
        positions = {id(d): i for i, d in enumerate(self.devices)}
        return sorted(self.devices, key=lambda d: (-self.speed.get(d.name, 1.0), positions[id(d)]))

    def _visible(self) -> list[_Described]:
        ordered = self._ordered()
        entries = os.environ.get("CUDA_VISIBLE_DEVICES")
        if entries is None:
            return ordered
        visible: list[_Described] = []
        for entry in (e.strip() for e in entries.split(",")):
            found: _Described | None = None
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

    # ------------------------------------------------------- CudaRuntime + torch.cuda
    def is_available(self) -> bool:
        return self.available and bool(self._visible())

    def device_count(self) -> int:
        return len(self._visible()) if self.available else 0

    def current_device(self) -> int:
        return int(getattr(self._threads, "device", self._default_current()))

    def _default_current(self) -> int:
        # A thread that never set a device works on device 0, as a new CUDA context does;
        # the thread that built the fake starts where it was told.
        return self._main_current if threading.current_thread() is self._builder else 0

    def set_device(self, device: Any) -> None:
        index = self._index(device)
        if not 0 <= index < self.device_count():
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self._threads.device = index
        self._context(index)

    def uuid(self, index: int) -> str:
        uuid = self._visible()[index].uuid
        return uuid.split("-", 1)[1]

    def get_device_properties(self, device: Any = None) -> _Properties:
        index = self._index(device)
        described = self._visible()[index]
        cuda = described if isinstance(described, CudaDevice) else CudaDevice(described.name)
        return _Properties(
            name=described.name,
            uuid=self.uuid(index),
            major=cuda.major,
            minor=cuda.minor,
            total_memory=cuda.total_memory,
            multi_processor_count=cuda.multi_processor_count,
        )

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        props = self.get_device_properties(device)
        return props.major, props.minor

    def _index(self, device: Any) -> int:
        if device is None:
            return self.current_device()
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            return device.index if device.index is not None else self.current_device()
        return int(device)

    # ------------------------------------------------------------------ streams
    def default_stream(self, device: Any = None) -> FakeStream:
        index = self._index(device)
        if index not in self._default_streams:
            self._default_streams[index] = FakeStream(self, index, default=True)
        return self._default_streams[index]

    def current_stream(self, device: Any = None) -> FakeStream:
        index = self._index(device)
        streams: dict[int, FakeStream] = getattr(self._threads, "streams", {})
        return streams.get(index) or self.default_stream(index)

    def set_stream(self, stream: FakeStream) -> None:
        if not hasattr(self._threads, "streams"):
            self._threads.streams = {}
        self._threads.streams[stream.device_index] = stream
        self._threads.device = stream.device_index

    def new_stream(self, device: Any = None, priority: int = 0, **_: Any) -> FakeStream:
        """``torch.cuda.Stream(device)``: a new stream of that device."""
        return FakeStream(self, self._index(device))

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        device = self.current_device()
        previous = self.current_stream(stream.device_index)
        self.set_stream(stream)
        try:
            yield
        finally:
            self.set_stream(previous)
            self._threads.device = device

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        previous = self.current_device()
        self.set_device(device)
        try:
            yield
        finally:
            self._threads.device = previous

    # --------------------------------------------------------------- GPU time
    def launch(self, seconds: float, stream: FakeStream | torch.cuda.Stream | None = None) -> None:
        """Queue ``seconds`` of kernels on ``stream`` (default: the current stream)."""
        stream = self._own(stream)
        self._context(stream.device_index)
        self._check(stream.device_index)
        stream.ready_s = max(stream.ready_s, self.now_s) + seconds

    def advance(self, seconds: float) -> None:
        """Let the GPUs run for ``seconds`` while the host does something else."""
        with self._cond:
            self.now_s += seconds
            self._cond.notify_all()

    def stall(self, stream: FakeStream | torch.cuda.Stream | None = None) -> None:
        """``stream`` (default: the current one) stops at a collective whose peer is gone:
        nothing queued after now ever runs, until :meth:`release`."""
        self._own(stream).ready_s = math.inf

    def _own(self, stream: FakeStream | torch.cuda.Stream | None) -> FakeStream:
        """``stream`` as this fake's own (``torch.cuda`` hands out :class:`FakeStream` s while
        the fake is installed); None: the calling thread's current stream.

        Raises:
            TypeError: a stream of another runtime.
        """
        if stream is None:
            return self.current_stream()
        if not isinstance(stream, FakeStream):
            raise TypeError(f"{stream!r} is not a stream of this fake CUDA runtime")
        return stream

    def release(self) -> None:
        """End every stall (the test is over): stalled streams and waiters go on."""
        with self._cond:
            self._released = True
            for stream in self.streams:
                if math.isinf(stream.ready_s):
                    stream.ready_s = self.now_s
            self._cond.notify_all()

    def lose(self, device: int) -> None:
        """The GPU falls off the bus: every later call on it raises the sticky error."""
        self.lost.add(device)

    def _context(self, device: int | None = None) -> None:
        """The calling thread works on ``device`` (None: its current device), where CUDA
        makes it a context."""
        index = self.current_device() if device is None else device
        self.contexts.setdefault(threading.current_thread().name, set()).add(index)

    def _check(self, device: int) -> None:
        if device in self.lost:
            raise RuntimeError(
                "CUDA error: unspecified launch failure (the GPU is lost; CUDA kernel errors "
                "are sticky)"
            )

    def _wait_until(self, device: int, time_s: float) -> None:
        """The host waits for the GPU to reach ``time_s`` (forever while stalled)."""
        self._check(device)
        self.synchronize_calls.append(device)
        with self._cond:
            while math.isinf(time_s) and not self._released:
                self._cond.wait()
            if not math.isinf(time_s):
                self.now_s = max(self.now_s, time_s)

    def synchronize(self, device: Any = None) -> None:
        """Wait for every stream of ``device`` (default: the current one)."""
        index = self._index(device)
        self._context(index)
        ready = [s.ready_s for s in self.streams if s.device_index == index]
        self._wait_until(index, max(ready, default=self.now_s))

    # ------------------------------------------------------------------ install
    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        """Make ``torch.cuda`` this fake for the test (``monkeypatch`` undoes it)."""
        self._builder = threading.current_thread()
        monkeypatch.setattr(FakeEvent, "cuda", self, raising=False)
        patches: dict[str, Any] = {
            "is_available": self.is_available,
            "device_count": self.device_count,
            "current_device": self.current_device,
            "set_device": self.set_device,
            "get_device_properties": self.get_device_properties,
            "get_device_name": self.get_device_name,
            "get_device_capability": self.get_device_capability,
            "current_stream": self.current_stream,
            "default_stream": self.default_stream,
            "set_stream": self.set_stream,
            "stream": self.stream,
            "device": self.device,
            "synchronize": self.synchronize,
            "Event": FakeEvent,
            "Stream": self.new_stream,
            "is_initialized": lambda: True,
            "empty_cache": lambda: None,
            "memory_allocated": lambda device=None: 0,
            "max_memory_allocated": lambda device=None: 0,
            "reset_peak_memory_stats": lambda device=None: None,
            "mem_get_info": lambda device=None: (2**30, 2**31),
            "memory_stats": lambda device=None: {},
            "memory_summary": lambda device=None, abbreviated=False: "",
        }
        for name, value in patches.items():
            monkeypatch.setattr(torch.cuda, name, value)
        return self

    _builder: threading.Thread = threading.main_thread()
