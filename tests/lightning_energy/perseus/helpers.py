"""Small synthetic profiles shared by the Perseus tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_energy.device.physics import physics_preset
from lightning_energy.perseus import PipelineProfile

# Perseus times single instructions of milliseconds: the simulated GPUs of these tests read
# energy exactly and apply clocks at once (the presets' boards do neither).
EXACT_BOARD = {"energy_counter_period_s": 0.0, "power_average_s": 0.0, "setting_latency_s": 0.0}


def physics_profile(
    num_stages: int,
    freqs_mhz: Sequence[int],
    *,
    seed: int = 0,
    forward_s: float = 0.02,
    backward_s: float = 0.04,
    blocked_power_w: float = 70.0,
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
