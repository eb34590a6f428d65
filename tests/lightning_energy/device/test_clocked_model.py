"""The physics and the calibrated GPU models share their clock maths and step checks."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lightning_energy.device import PHYSICS_PRESETS, PhysicsModel
from lightning_energy.device.simulated.calibration import CalibratedModel
from lightning_energy.device.simulated.clocked_model import ClockedModel
from lightning_energy.errors import ConfigError

CALIBRATED = CalibratedModel(
    name="NVIDIA Test GPU (calibrated)",
    sm_clocks_mhz=(1400, 1200, 1000),
    min_power_limit_w=100.0,
    max_power_limit_w=300.0,
    default_power_limit_w=300.0,
    idle_power_w=60.0,
    points=((1000.0, 200.0), (1400.0, 280.0)),
    step_time_s=0.2,
    step_compute_bound_share=0.75,
)
MODELS = {"physics": PHYSICS_PRESETS["a100"], "calibrated": CALIBRATED}


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
@pytest.mark.parametrize(
    ("step_time_s", "share", "message"),
    [
        (0.0, 0.5, r"step_time_s: 0\.0 is not allowed; use > 0"),
        (math.nan, 0.5, r"step_time_s: nan is not allowed; use > 0"),
        (0.2, 1.5, r"step_compute_bound_share: 1\.5 is not allowed; use a number in \[0, 1\]"),
    ],
    ids=["zero_time", "nan_time", "share_above_one"],
)
def test_both_models_name_a_bad_step_field_alike(
    model: PhysicsModel | CalibratedModel, step_time_s: float, share: float, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(model, step_time_s=step_time_s, step_compute_bound_share=share)


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_a_power_limit_caps_the_clock_below_a_lock(model: ClockedModel) -> None:
    share = model.step_compute_bound_share
    fastest = model.max_clock_mhz
    assert model.clock_for(share, math.inf) == fastest
    lock = model.sm_clocks_mhz[1]
    assert model.clock_for(share, math.inf, max_clock_mhz=lock) == lock
    # A limit below the power at the lock wins over the lock; below every clock's power,
    # the work runs at the lowest clock.
    capped_w = model.work_power_w(share, lock) - 1.0
    assert model.clock_for(share, capped_w, max_clock_mhz=lock) < lock
    assert model.clock_for(share, 0.0) == model.sm_clocks_mhz[-1]
    duration_s, power_w = model.run(1.0, share, capped_w, lock)
    freq = model.clock_for(share, capped_w, lock)
    assert duration_s == pytest.approx(share * fastest / freq + 1 - share)
    assert power_w == pytest.approx(model.work_power_w(share, freq)) and power_w <= capped_w
