"""The physics model: monotonic in the clock, capped by the power limit, and consistent with
the pipeline profiles of the reference data."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest

from lightning_energy.device import PHYSICS_PRESETS, SimulatedSpec, physics_preset, simulated_gpus
from lightning_energy.errors import ConfigError, DriverError
from tests.lightning_energy.device.ideal_board import IDEAL


@pytest.mark.parametrize("name", ["a100", "h100"])
def test_lower_clock_is_slower_and_draws_less_power(name: str) -> None:
    model = PHYSICS_PRESETS[name]
    for beta in (0.0, 0.5, 0.85, 1.0):
        times = [model.work_time_s(1.0, beta, f) for f in model.sm_clocks_mhz]
        powers = [model.work_power_w(beta, f) for f in model.sm_clocks_mhz]
        assert all(a <= b for a, b in itertools.pairwise(times))
        assert all(a > b for a, b in itertools.pairwise(powers))
        assert times[0] == pytest.approx(1.0)


def test_every_preset_has_a_name_of_its_own() -> None:
    """A lease names its GPU's preset by the model's name: two presets of one name would
    rebuild the wrong board (the A100 SXM fit is an 80GB board, the ``a100`` preset a 40GB)."""
    names = [model.name for model in PHYSICS_PRESETS.values()]
    assert len(set(names)) == len(names)


def test_presets_match_the_documented_tables() -> None:
    a100, h100 = PHYSICS_PRESETS["a100"], PHYSICS_PRESETS["h100"]
    assert (a100.sm_clocks_mhz[0], a100.sm_clocks_mhz[-1], len(a100.sm_clocks_mhz)) == (
        1410,
        210,
        81,
    )
    assert (h100.sm_clocks_mhz[0], h100.sm_clocks_mhz[-1]) == (1980, 345)
    assert {a - b for a, b in itertools.pairwise(h100.sm_clocks_mhz)} == {15}
    assert (a100.min_power_limit_w, a100.max_power_limit_w, a100.default_power_limit_w) == (
        100,
        400,
        400,
    )
    assert (h100.min_power_limit_w, h100.max_power_limit_w, h100.default_power_limit_w) == (
        200,
        700,
        700,
    )
    assert (a100.idle_power_w, a100.static_power_w) == (70.0, 80.0)


def test_a100_preset_reproduces_the_pipeline_profiles(data_dir: Path) -> None:
    model = PHYSICS_PRESETS["a100"]
    rows = list(csv.DictReader((data_dir / "perseus_profiles" / "profile_S4_M8.csv").open()))
    by_instr: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for row in rows:
        by_instr.setdefault((row["stage"], row["instruction"]), {})[int(row["frequency"])] = (
            float(row["time"]),
            float(row["energy"]),
        )
    for points in by_instr.values():
        t0 = points[1410][0]
        beta = (points[1200][0] / t0 - 1) / (1410 / 1200 - 1)
        for freq, (time_s, energy_j) in points.items():
            assert model.work_time_s(t0, beta, freq) == pytest.approx(time_s, rel=1e-9)
            assert model.work_power_w(beta, freq) * time_s == pytest.approx(energy_j, rel=1e-9)


def test_power_limit_caps_the_clock() -> None:
    model = PHYSICS_PRESETS["a100"]
    # Compute-bound work draws 380 W at 1410 MHz: under 400 W it runs at full clock.
    assert model.clock_for(1.0, 400.0) == 1410
    capped = model.clock_for(1.0, 250.0)
    assert capped < 1410
    assert model.work_power_w(1.0, capped) <= 250.0 < model.work_power_w(1.0, capped + 15)
    # Nothing fits under 100 W: the lowest clock.
    assert model.clock_for(1.0, 100.0) == 210
    # A clock lock is a ceiling; the power limit still wins below it.
    assert model.clock_for(1.0, 400.0, max_clock_mhz=1000) == 990
    assert model.clock_for(1.0, 250.0, max_clock_mhz=1400) == capped


def test_locked_clock_and_power_limit_drive_the_simulated_gpu() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", **IDEAL))[0]
    clocks = gpu.supported_sm_clocks_mhz()
    assert clocks == sorted(clocks, reverse=True) and clocks[0] == 1410
    fast = gpu.run_work(0.1, 0.9)
    e0 = gpu.energy_j()
    gpu.set_locked_clocks_mhz(900, 900)
    assert gpu.locked_clocks_mhz() == (900, 900)
    slow = gpu.run_work(0.1, 0.9)
    locked_energy = gpu.energy_j() - e0
    gpu.reset_locked_clocks()
    assert gpu.locked_clocks_mhz() is None
    e1 = gpu.energy_j()
    gpu.run_work(0.1, 0.9)
    full_energy = gpu.energy_j() - e1
    assert slow == pytest.approx(0.1 * (0.9 * 1410 / 900 + 0.1))
    assert fast == pytest.approx(0.1)
    assert locked_energy < full_energy
    gpu.set_power_limit_w(200.0)
    assert gpu.run_work(0.1, 1.0) > 0.1
    gpu.set_power_limit_w(400.0)


def test_invalid_settings_are_rejected_like_nvml_does() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100"))[0]
    with pytest.raises(DriverError, match=r"outside the supported range \[100.0, 400.0\]"):
        gpu.set_power_limit_w(450.0)
    with pytest.raises(DriverError, match="invalid clock lock"):
        gpu.set_locked_clocks_mhz(1000, 900)
    assert gpu.settings() == (400.0, None)


def test_physics_step_parameters() -> None:
    model = physics_preset("h100", step_time_s=0.5, compute_bound_share=0.6)
    assert model.step_work() == (0.5, 0.6)
    gpu = simulated_gpus(SimulatedSpec(gpu="h100", step_time_s=0.5, compute_bound_share=0.6))[0]
    assert gpu.run_step() == pytest.approx(0.5)
    assert gpu.name == "NVIDIA H100 80GB HBM3 (simulated)"
    with pytest.raises(ConfigError, match="not a physics preset"):
        physics_preset("b200")
    with pytest.raises(ConfigError, match=r"step_compute_bound_share: 1\.5 is not allowed"):
        physics_preset("a100", compute_bound_share=1.5)


@pytest.mark.parametrize("name", ["a100", "h100", "h200"])
def test_blocked_in_a_collective_draws_more_than_idle_rising_with_the_clock(name: str) -> None:
    """NCCL's kernels spin while a rank waits for its peers: idle plus the spin's
    switching power, which rises with the clock as any switching power does."""
    model = PHYSICS_PRESETS[name]
    blocked = [model.blocked_power_w(f) for f in model.sm_clocks_mhz]
    assert all(a > b for a, b in itertools.pairwise(blocked))
    assert blocked[-1] > model.idle_power_w
    assert blocked[0] == pytest.approx(model.idle_power_w + model.spin_power_w)
    assert model.spin_power_w == pytest.approx(0.1 * model.compute_power_w)


def test_a_wait_in_a_collective_spins_at_the_locked_clock_and_a_pause_idles() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", **IDEAL))[0]
    model = physics_preset("a100")

    def energy_j(wait: str, seconds: float) -> float:
        before = gpu.energy_j()
        getattr(gpu, wait)(seconds)
        return gpu.energy_j() - before

    assert energy_j("wait_in_collective", 2.0) == pytest.approx(2.0 * model.blocked_power_w(1410))
    gpu.set_locked_clocks_mhz(900, 900)
    assert energy_j("wait_in_collective", 2.0) == pytest.approx(2.0 * model.blocked_power_w(900))
    assert gpu.sm_clock_mhz() == 900  # spinning, not idle
    # A real idle (a carbon pause: nothing queued) draws idle power whatever the clock.
    assert energy_j("idle", 2.0) == pytest.approx(2.0 * model.idle_power_w)
    gpu.reset_locked_clocks()
    assert energy_j("idle", 2.0) == pytest.approx(2.0 * model.idle_power_w)
    with pytest.raises(ConfigError, match=r"seconds=-1\.0"):
        gpu.wait_in_collective(-1.0)


def test_a_clock_set_within_the_latency_does_not_govern_the_wait_yet() -> None:
    gpu = simulated_gpus(SimulatedSpec(gpu="a100", energy_counter_period_s=0.0))[0]
    model = physics_preset("a100")
    gpu.set_locked_clocks_mhz(900, 900)
    before = gpu.energy_j()
    gpu.wait_in_collective(0.01)  # starts before the board's 50 ms latency: still 1410 MHz
    assert gpu.energy_j() - before == pytest.approx(0.01 * model.blocked_power_w(1410))
    gpu.idle(0.1)
    before = gpu.energy_j()
    gpu.wait_in_collective(1.0)
    assert gpu.energy_j() - before == pytest.approx(1.0 * model.blocked_power_w(900))
    gpu.reset_locked_clocks()
