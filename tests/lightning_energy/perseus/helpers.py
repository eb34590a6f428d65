"""Small synthetic profiles shared by the Perseus tests, and the profile simulated GPUs would
measure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_energy.device import StageWork
from lightning_energy.device.simulated import PhysicsModel, physics_preset
from lightning_energy.perseus import PipelineProfile
from lightning_energy.perseus.planning.profile import BlockedPower


def physics_profile(
    num_stages: int,
    freqs_mhz: Sequence[int],
    *,
    seed: int = 0,
    forward_s: float = 0.02,
    backward_s: float = 0.04,
    blocked_power_w: BlockedPower = 70.0,
) -> PipelineProfile:
    """A profile from the A100 physics model, with stage times and compute-bound shares
    drawn at random (seeded) so stages differ."""
    model = physics_preset("a100")
    rng = np.random.default_rng(seed)
    rows = []
    for stage in range(num_stages):
        for kind, base_s in (("forward", forward_s), ("backward", backward_s)):
            t0 = base_s * rng.uniform(0.7, 1.3)
            beta = rng.uniform(0.5, 1.0)
            for f in freqs_mhz:
                t = model.work_time_s(t0, beta, f)
                rows.append((stage, kind, f, t, t * model.work_power_w(beta, f)))
    return PipelineProfile.from_rows(rows, blocked_power_w=blocked_power_w)


class TickingCounter:
    """A GPU energy counter that moves only every ``period_s``, as NVML's does on many
    boards (~100 ms, with +-10 % jitter): a window shorter than that mostly reads 0 J,
    sometimes a period's worth. Time is virtual: :meth:`run` advances it at a constant power.
    """

    def __init__(self, period_s: float = 0.1, seed: int = 0) -> None:
        self.period_s = period_s
        self.now_s = 0.0
        self.true_j = 0.0
        self._shown_j = 0.0
        self._rng = np.random.default_rng(seed)
        self._next_tick_s = self._period()

    def _period(self) -> float:
        return float(self.period_s * self._rng.uniform(0.9, 1.1))

    def run(self, duration_s: float, power_w: float) -> None:
        end_s = self.now_s + duration_s
        while self._next_tick_s <= end_s:
            self.true_j += power_w * (self._next_tick_s - self.now_s)
            self.now_s = self._next_tick_s
            self._shown_j = self.true_j
            self._next_tick_s += self._period()
        self.true_j += power_w * (end_s - self.now_s)
        self.now_s = end_s

    def energy_j(self) -> float:
        """What the counter shows: the energy at its last tick."""
        return self._shown_j


class CudaTimedGPU:
    """A GPU as NVML shows it on a CUDA machine, for Perseus' CUDA path in CPU tests.

    Settings and clocks go to a simulated GPU (so the guard locks and restores them as on
    any GPU), but it is not a ``SimulatedGPU``: Perseus then times the training step with
    CUDA events (the ``FakeCuda`` of ``tests/lightning_energy/device/fake_cuda.py``)
    instead of simulating it. Its time is the CUDA fake's GPU time, and its energy counter
    moves continuously at ``power_w`` over that time.
    """

    def __init__(self, gpu: Any, cuda: Any, power_w: float = 100.0) -> None:
        self._gpu = gpu
        self._cuda = cuda
        self._power_w = power_w

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    def now_s(self) -> float:
        return float(self._cuda.now_s)

    def energy_j(self) -> float:
        return self._power_w * float(self._cuda.now_s)

    def energy_counter_period_s(self) -> float:
        return 0.0

    def locked_mhz(self) -> int:
        """The upper end of the clock lock, or the maximum clock when unlocked."""
        locked = self._gpu.locked_clocks_mhz()
        return int(locked[1]) if locked is not None else max(self._gpu.supported_sm_clocks_mhz())


def simulated_profile(
    model: PhysicsModel,
    works: Mapping[tuple[int, str], StageWork],
    clocks_mhz: Sequence[int] | None = None,
) -> PipelineProfile:
    """The profile simulated GPUs of ``model`` would measure for ``works``.

    Args:
        model: the physics model (e.g. ``physics_preset("a100")``).
        works: the work of every ``(stage, kind)``.
        clocks_mhz: clocks to profile (default: all the model supports).

    Returns:
        Time and energy at each clock, and the model's blocked power at each clock.
    """
    clocks = list(clocks_mhz) if clocks_mhz is not None else list(model.sm_clocks_mhz)
    rows = []
    for (stage, kind), work in sorted(works.items()):
        for freq in clocks:
            time_s = model.work_time_s(work.t0_s, work.compute_bound_share, freq)
            power_w = model.work_power_w(work.compute_bound_share, freq)
            rows.append((stage, kind, freq, time_s, time_s * power_w))
    blocked = {freq: model.blocked_power_w(freq) for freq in clocks}
    return PipelineProfile.from_rows(rows, blocked_power_w=blocked)
