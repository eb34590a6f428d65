"""A CUDA device's stream, and the CUDA events that time and follow the work queued on it.

This is where the package records CUDA events: Perseus times its instructions and
data-parallel steps, and its clock thread follows the stage's stream, through a
:class:`CudaStream` from :func:`lightning_energy.device.cuda_stream` (None where there is
no stream: the CPU, no CUDA). Simulated GPUs run their work through
:func:`lightning_energy.device.work_runner` instead.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["CudaStream", "StreamPoint", "TimedPoint", "stream_of"]


class StreamPoint(Protocol):
    """A point of a GPU stream: reached once the GPU has run everything queued before it."""

    def query(self) -> bool:
        """True once the GPU has reached the point (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until the GPU reaches the point (sleeping, not spinning)."""
        ...


class TimedPoint(StreamPoint, Protocol):
    """A stream point whose time the GPU records (a timing CUDA event)."""

    def elapsed_time(self, end: Any, /) -> float:
        """Milliseconds of GPU time from this point to ``end`` (both reached)."""
        ...


class CudaStream:
    """The current stream of one CUDA device (whatever the calling thread's current device
    is), the stream a stage's kernels are queued on.

    Args:
        device: the CUDA device, with its index.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def make_current(self) -> None:
        """Make the device the calling thread's current one (a new thread starts on device
        0, and would make a CUDA context there)."""
        torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        """Wait until the GPU has run everything queued on the stream."""
        torch.cuda.current_stream(self.device).synchronize()

    def marker(self) -> StreamPoint:
        """A point at the stream's current end, to wait for (blocking: waiting yields the
        core); not timed."""
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def timed_point(self) -> TimedPoint:
        """A point at the stream's current end whose time the GPU records."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def seconds_between(start: TimedPoint, end: TimedPoint) -> float:
        """The GPU's seconds from ``start`` to ``end`` (both reached)."""
        return start.elapsed_time(end) / 1000.0


def stream_of(device: torch.device | None) -> CudaStream | None:
    """The stream of ``device``: None for a device that is not a CUDA device, or without
    CUDA; None stands for the calling thread's current CUDA device."""
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return None
    if device is None or device.index is None:
        return CudaStream(torch.device("cuda", torch.cuda.current_device()))
    return CudaStream(device)
