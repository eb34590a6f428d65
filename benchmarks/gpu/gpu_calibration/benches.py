"""The two backends the calibration runs on, behind one :class:`Bench` protocol.

* :class:`NVMLBench`: a real GPU read through NVML (found by the torch device's UUID), kept
  busy by a :class:`Workload`; :class:`TransformerWorkload` trains one bf16 transformer
  block with torch on the GPU, in the background while the GPU is polled, and runs square
  waves of short matrix products.
* :class:`SimulatedBench`: a simulated GPU of a preset on its virtual clock, its settings in
  a state file (so restore-check children share them, as they would a real GPU's).

In a read-only run each bench's GPU is a :class:`~gpu_calibration.read_only.ReadOnlyGPU`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from gpu_calibration.read_only import ReadOnlyGPU, RefusedCalls
from lightning_energy.device.base import GPU, DeviceSet
from lightning_energy.device.mapping import TorchCuda, normalise_uuid, nvml_gpu_for_device
from lightning_energy.device.nvml import NVMLGPU
from lightning_energy.device.simulated import SimulatedSpec, simulated_gpus
from lightning_energy.errors import DeviceError, NotSupportedError

__all__ = [
    "Bench",
    "NVMLBench",
    "NoGPU",
    "SimulatedBench",
    "TransformerWorkload",
    "Wave",
    "Workload",
    "read",
    "readers",
    "sample",
]

T = TypeVar("T")

#: A square wave of load: ``(on_s, off_s)``; None: steady training steps.
Wave = tuple[float, float] | None
# Simulated work runs in pieces of at most this long (a change of settings governs the
# pieces that start after it takes effect).
_PIECE_S = 0.01
# Matrix products of the square waves: 4096 x 4096 in bf16, a fraction of a millisecond each
# on a recent GPU, so a wave's on-time is met within about a millisecond.
_WAVE_MATMUL = 4096


class NoGPU(Exception):
    """There is no GPU to calibrate here (the message says why)."""


def read(reader: Callable[[], T] | None) -> T | None:
    """``reader()``, or None when the GPU cannot answer (or has no such reading)."""
    if reader is None:
        return None
    try:
        return reader()
    except DeviceError:
        return None


def sample(gpu: GPU) -> dict[str, Any]:
    """SM clock, clock event reasons, temperature and power (the instantaneous field,
    else the driver's power usage) now; None where unreadable."""
    power_w = read(getattr(gpu, "instant_power_w", None))
    return {
        "sm_clock_mhz": read(getattr(gpu, "sm_clock_mhz", None)),
        "reasons": read(getattr(gpu, "clock_event_reasons", None)),
        "temperature_c": read(getattr(gpu, "temperature_c", None)),
        "power_w": power_w if power_w is not None else read(gpu.power_w),
    }


def readers(gpu: GPU) -> dict[str, Callable[[], Any]]:
    """The NVML readings a controller makes during training, by name."""

    def missing(name: str) -> Callable[[], Any]:
        def raise_missing() -> Any:
            raise NotSupportedError(f"this backend has no {name} reading", operation=name)

        return raise_missing

    return {
        "energy": gpu.energy_j,
        "power": gpu.power_w,
        "instant_power": getattr(gpu, "instant_power_w", None) or missing("instant_power"),
        "clock_event_reasons": getattr(gpu, "clock_event_reasons", None)
        or missing("clock_event_reasons"),
    }


class Bench(Protocol):
    """What the phases need from a backend: one GPU, its clock, its workload."""

    backend: str
    gpu: GPU

    def now(self) -> float:
        """Seconds on the GPU's clock."""
        ...

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass (the GPU working as :meth:`loaded` says)."""
        ...

    def loaded(self, wave: Wave = None) -> contextlib.AbstractContextManager[None]:
        """Keep the GPU busy during the block: steady training steps, or a square wave."""
        ...

    def step(self) -> None:
        """Start one training step (it may still run when this returns)."""
        ...

    def synchronize(self) -> None:
        """Wait for the steps started."""
        ...

    def identity(self) -> dict[str, Any]:
        """Name, UUIDs and whether torch and NVML name the same GPU."""
        ...

    def persistence_mode(self) -> bool | None:
        """Persistence mode (None: not applicable or unreadable)."""
        ...

    def process_ids(self) -> list[int] | None:
        """Processes NVML lists as computing on the GPU (None: no NVML here)."""
        ...

    def fresh_settings(self) -> tuple[float, bool]:
        """``(power limit in W, whether any clock lock is in force)`` read anew."""
        ...

    def child_args(self) -> list[str]:
        """Arguments by which a child process opens the same GPU."""
        ...

    def device_set(self) -> DeviceSet:
        """The GPU as the controller takes it."""
        ...

    def lightning_target(self) -> tuple[str, list[int] | int]:
        """``(accelerator, devices)`` of a Lightning ``Trainer`` running the workload."""
        ...

    def close(self) -> None:
        """Release what the backend holds."""
        ...


class SimulatedBench:
    """A simulated GPU of ``preset`` with its settings in a state file under ``state_dir``.

    Work runs on the virtual clock: :meth:`wait` inside :meth:`loaded` runs the preset's
    step work (or a square wave of it), outside it the GPU idles. Methods: see
    :class:`Bench`.

    Args:
        preset: the simulated GPU.
        state_dir: where its state file lives (shared with restore-check children).
        refused: read-only runs: where refused setter calls are recorded (None: the GPU
            may be changed).
    """

    backend = "simulated"

    def __init__(self, preset: str, state_dir: str, refused: RefusedCalls | None) -> None:
        self.preset = preset
        self.state_dir = state_dir
        (self._sim,) = simulated_gpus(SimulatedSpec(gpu=preset, state_dir=state_dir))
        self.gpu: GPU = self._sim if refused is None else ReadOnlyGPU(self._sim, refused)
        _, self._beta = self._sim.model.step_work()
        self._busy = False
        self._wave: Wave = None
        self._wave_on = True
        self._wave_left_s = 0.0

    def now(self) -> float:
        return self._sim.clock.now()

    def wait(self, seconds: float) -> None:
        if not self._busy:
            self._sim.idle(seconds)
        elif self._wave is None:
            self._work_for(seconds)
        else:
            self._wave_for(seconds, *self._wave)

    def _work_for(self, seconds: float) -> None:
        """Work for ``seconds`` of the clock, in short pieces: each piece runs under the
        settings in force when it starts, as a real GPU's work follows a change."""
        end_s = self.now() + seconds
        while self.now() < end_s - 1e-12:
            self._sim.run_work(min(_PIECE_S, end_s - self.now()), self._beta)

    def _wave_for(self, seconds: float, on_s: float, off_s: float) -> None:
        """``seconds`` of the square wave, continuing where the last wait left it."""
        end_s = self.now() + seconds
        while self.now() < end_s - 1e-12:
            piece_s = min(end_s - self.now(), self._wave_left_s)
            start_s = self.now()
            if self._wave_on:
                self._work_for(piece_s)
            else:
                self._sim.idle(piece_s)
            self._wave_left_s -= self.now() - start_s
            if self._wave_left_s <= 1e-12:
                self._wave_on = not self._wave_on
                self._wave_left_s = on_s if self._wave_on else off_s

    @contextlib.contextmanager
    def loaded(self, wave: Wave = None) -> Iterator[None]:
        self._busy, self._wave = True, wave
        self._wave_on, self._wave_left_s = True, wave[0] if wave is not None else 0.0
        try:
            yield
        finally:
            self._busy, self._wave = False, None

    def step(self) -> None:
        self._sim.run_step()

    def synchronize(self) -> None:
        self._sim.synchronize()

    def identity(self) -> dict[str, Any]:
        return {
            "name": self.gpu.name,
            "nvml_uuid": self.gpu.uuid,
            "torch_uuid": None,
            "uuid_match": None,
            "note": "simulated GPU: no CUDA device to map",
        }

    def persistence_mode(self) -> bool | None:
        return None

    def process_ids(self) -> list[int] | None:
        return None

    def fresh_settings(self) -> tuple[float, bool]:
        (fresh,) = simulated_gpus(SimulatedSpec(gpu=self.preset, state_dir=self.state_dir))
        limit_w, lock = fresh.settings()
        return limit_w, lock is not None

    def child_args(self) -> list[str]:
        return ["--simulated", self.preset, "--state-dir", self.state_dir]

    def device_set(self) -> DeviceSet:
        # The phases run each step themselves (run_step None), as on a real GPU.
        return DeviceSet(gpus=[self.gpu], clock=self.now, backend="simulated")

    def lightning_target(self) -> tuple[str, list[int] | int]:
        return "cpu", 1

    def close(self) -> None:
        """Nothing to release."""


class Workload(Protocol):
    """What keeps a real GPU busy, and the clock its time passes on."""

    def now(self) -> float:
        """Seconds (``time.perf_counter`` on a real GPU)."""
        ...

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass (``time.sleep`` on a real GPU)."""
        ...

    def loaded(self, wave: Wave) -> contextlib.AbstractContextManager[None]:
        """Run steady training steps, or a square wave, in the background in the block."""
        ...

    def step(self) -> None:
        """Queue one training step."""
        ...

    def synchronize(self) -> None:
        """Wait for the queued work."""
        ...

    def torch_uuid(self) -> str:
        """The UUID torch gives the workload's device."""
        ...

    def lightning_target(self) -> tuple[str, list[int] | int]:
        """``(accelerator, devices)`` of a Lightning ``Trainer`` on the same device."""
        ...

    def close(self) -> None:
        """Release the device memory held."""
        ...


class NVMLBench:
    """A real GPU through NVML, kept busy by ``workload``. Methods: see :class:`Bench`.

    Args:
        gpu: the GPU (the workload's device).
        workload: what runs on it.
        refused: read-only runs: where refused setter calls are recorded (None: the GPU
            may be changed).
    """

    backend = "nvml"

    def __init__(self, gpu: NVMLGPU, workload: Workload, refused: RefusedCalls | None) -> None:
        self._nvml_gpu = gpu
        self.gpu: GPU = gpu if refused is None else ReadOnlyGPU(gpu, refused)
        self.workload = workload

    def now(self) -> float:
        return self.workload.now()

    def wait(self, seconds: float) -> None:
        self.workload.wait(seconds)

    def loaded(self, wave: Wave = None) -> contextlib.AbstractContextManager[None]:
        return self.workload.loaded(wave)

    def step(self) -> None:
        self.workload.step()

    def synchronize(self) -> None:
        self.workload.synchronize()

    def identity(self) -> dict[str, Any]:
        torch_uuid = self.workload.torch_uuid()
        return {
            "name": self.gpu.name,
            "nvml_uuid": self.gpu.uuid,
            "torch_uuid": torch_uuid,
            "uuid_match": normalise_uuid(torch_uuid) == normalise_uuid(self.gpu.uuid),
        }

    def persistence_mode(self) -> bool | None:
        return read(self._nvml_gpu.persistence_mode)

    def process_ids(self) -> list[int] | None:
        return self._nvml_gpu.running_process_ids()

    def fresh_settings(self) -> tuple[float, bool]:
        # NVML cannot read a lock back: ours is known, another process's (a restore-check
        # child's, an administrator's) shows as a foreign clock setting.
        gpu = self._nvml_gpu
        locked = gpu.locked_clocks_mhz() is not None or gpu.foreign_clock_setting() is not None
        return gpu.power_limit_w(), locked

    def child_args(self) -> list[str]:
        return ["--uuid", self.gpu.uuid]

    def device_set(self) -> DeviceSet:
        return DeviceSet(gpus=[self.gpu], clock=self.now, backend="nvml")

    def lightning_target(self) -> tuple[str, list[int] | int]:
        return self.workload.lightning_target()

    def close(self) -> None:
        self.workload.close()
        self._nvml_gpu.close()


class TransformerWorkload:
    """One bf16 transformer block (forward, backward, SGD step) trained on a CUDA device.

    Args:
        device_index: the torch CUDA device.
        d_model: the block's width (heads of 128, feed-forward 4x).
        batch: sequences per step.
        seq: tokens per sequence.
    """

    def __init__(self, device_index: int, d_model: int, batch: int, seq: int) -> None:
        import torch

        self._torch = torch
        self._index = device_index
        self.device = torch.device("cuda", device_index)
        torch.cuda.set_device(self.device)
        self._block = torch.nn.TransformerEncoderLayer(
            d_model,
            max(1, d_model // 128),
            4 * d_model,
            batch_first=True,
            device=self.device,
            dtype=torch.bfloat16,
        )
        self._x = torch.randn(batch, seq, d_model, device=self.device, dtype=torch.bfloat16)
        self._opt = torch.optim.SGD(self._block.parameters(), lr=1e-6)
        shape = (_WAVE_MATMUL, _WAVE_MATMUL)
        self._a = torch.randn(shape, device=self.device, dtype=torch.bfloat16)
        self._b = torch.randn(shape, device=self.device, dtype=torch.bfloat16)
        self._c = torch.empty(shape, device=self.device, dtype=torch.bfloat16)
        self._events: list[Any] = []
        self._stop = threading.Event()

    def now(self) -> float:
        return time.perf_counter()

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def _record(self) -> None:
        """Mark the work queued so far; keep at most two marked pieces of work queued
        (the waits release the GIL)."""
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        self._events.append(event)
        while len(self._events) > 2:
            self._events.pop(0).synchronize()

    def _wave(self, on_s: float, off_s: float) -> None:
        torch = self._torch
        end_s = time.perf_counter() + on_s
        while time.perf_counter() < end_s and not self._stop.is_set():
            torch.matmul(self._a, self._b, out=self._c)
            self._record()
        self.synchronize()
        self._stop.wait(off_s)

    @contextlib.contextmanager
    def loaded(self, wave: Wave) -> Iterator[None]:
        self._stop.clear()

        def run() -> None:
            self._torch.cuda.set_device(self.device)  # the current device is per thread
            while not self._stop.is_set():
                if wave is None:
                    self.step()
                else:
                    self._wave(*wave)

        thread = threading.Thread(target=run, name="calibrate-load", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()
            self.synchronize()

    def step(self) -> None:
        out = self._block(self._x)
        loss = out.float().pow(2).mean()
        loss.backward()
        self._opt.step()
        self._opt.zero_grad(set_to_none=True)
        self._record()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.device)
        self._events.clear()

    def torch_uuid(self) -> str:
        return TorchCuda().uuid(self._index)

    def lightning_target(self) -> tuple[str, list[int] | int]:
        return "cuda", [self._index]

    def close(self) -> None:
        self._events.clear()
        del self._block, self._x, self._opt, self._a, self._b, self._c
        self._torch.cuda.empty_cache()


def open_nvml_bench(
    device_index: int,
    make_workload: Callable[[int], Workload],
    refused: RefusedCalls | None,
) -> NVMLBench:
    """The GPU torch calls ``cuda:<device_index>`` (by UUID), with its workload.

    Raises:
        NoGPU: torch is missing, CUDA is not available, or no NVML GPU is the device.
    """
    try:
        import torch
    except ImportError as exc:
        raise NoGPU("torch is not installed: the calibration needs torch with CUDA") from exc
    if not torch.cuda.is_available():
        raise NoGPU(
            "torch.cuda is not available: the calibration needs one NVIDIA GPU with CUDA "
            "(--simulated PRESET runs it on a simulated GPU)"
        )
    try:
        gpu = nvml_gpu_for_device(torch.device("cuda", device_index), TorchCuda())
    except DeviceError as exc:
        raise NoGPU(f"no NVIDIA GPU usable through NVML for cuda:{device_index}: {exc}") from exc
    try:
        workload = make_workload(device_index)
    except BaseException:
        gpu.close()
        raise
    return NVMLBench(gpu, workload, refused)
