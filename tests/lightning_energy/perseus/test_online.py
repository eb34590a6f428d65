from __future__ import annotations

import itertools

import pytest

from lightning_energy.device.physics import physics_preset
from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.perseus.online import ClockModel, default_profile_clocks, fit_profile


def _samples(t0_s: float, beta: float, clocks: list[int]) -> list[tuple[int, float, float]]:
    model = physics_preset("a100")
    out = []
    for f in clocks:
        t = model.work_time_s(t0_s, beta, f)
        out.append((f, t, t * model.work_power_w(beta, f)))
    return out


def test_clock_model_recovers_physics() -> None:
    model = physics_preset("a100")
    fit = ClockModel.fit(_samples(0.05, 0.8, [1410, 1200, 1005, 900]))
    assert (fit.min_mhz, fit.max_mhz) == (900, 1410)
    for f in range(900, 1411, 15):
        t = model.work_time_s(0.05, 0.8, f)
        assert fit.time_s(f) == pytest.approx(t, rel=1e-9)  # the time model is exact
        assert fit.energy_j(f) == pytest.approx(t * model.work_power_w(0.8, f), rel=0.01)
    two = ClockModel.fit(_samples(0.05, 0.8, [1410, 1005]))
    assert two.power_coef[2] == 0.0  # linear power with two clocks


def test_clock_model_needs_two_clocks_and_positive_values() -> None:
    with pytest.raises(ProfileError, match="two clocks"):
        ClockModel.fit([(1410, 0.1, 10.0), (1410, 0.1, 10.0)])
    with pytest.raises(ProfileError, match="positive"):
        ClockModel.fit([(1410, 0.1, 10.0), (1200, -0.1, 10.0)])


def test_fit_profile_predicts_within_the_profiled_range() -> None:
    samples = {
        (0, "forward"): _samples(0.02, 0.9, [1410, 1200, 990]),
        (0, "backward"): _samples(0.04, 0.7, [1410, 1200, 990]),
    }
    profile = fit_profile(samples, range(1410, 500, -15), blocked_power_w=70.0)
    assert profile.frequencies_mhz[0] == 1410 and profile.frequencies_mhz[-1] == 990
    assert profile.blocked_power_w == 70.0
    with pytest.raises(ProfileError, match="no clock in the profiled range"):
        fit_profile(samples, [800], blocked_power_w=70.0)


def test_default_profile_clocks() -> None:
    clocks = default_profile_clocks(list(range(1410, 209, -15)))
    assert clocks[0] == 1410 and len(clocks) == 4
    assert all(a > b for a, b in itertools.pairwise(clocks))
    assert clocks[-1] == pytest.approx(846, abs=15)
    with pytest.raises(ConfigError):
        default_profile_clocks([1410], count=1)
