"""benchmarks/calibrate_governor.py: the fitted presets reproduce the measured runs they
were fitted on, and the lock-vs-cap comparison picks the cheapest lock no slower."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from lightning_energy.device.simulated import PHYSICS_PRESETS


@pytest.fixture
def calibrate(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("calibrate_governor")


@pytest.mark.parametrize(("preset", "suffix"), [("a100_sxm", "a100_sxm"), ("a40_physics", "a40")])
def test_a_preset_reproduces_its_locked_curves(
    calibrate: ModuleType, preset: str, suffix: str
) -> None:
    model = PHYSICS_PRESETS[preset]
    curves = calibrate.lock_curves(suffix)
    assert len(curves) == 32
    curves = curves[::8]  # one per model and instruction kind, to stay fast
    runs = calibrate.locked_runs(model, curves)
    errors = sorted(
        abs(runs[c.name][f][i] / c.points[f][i] - 1.0)
        for c in curves
        for f in c.points
        for i in (0, 1)
    )
    assert errors[len(errors) // 2] < 0.03  # median
    assert errors[-1] < 0.12


def test_a_preset_reproduces_a_capped_job(calibrate: ModuleType) -> None:
    model = PHYSICS_PRESETS["a100_pcie"]
    job = next(j for j in calibrate.cap_jobs("A100") if j.name == "bert-huge-uncased")
    _, _, runs = calibrate.capped_runs(model, job)
    for cap_w, (time_s, energy_j) in job.points.items():
        assert runs[cap_w][0] == pytest.approx(time_s, rel=0.04), cap_w
        assert runs[cap_w][1] == pytest.approx(energy_j, rel=0.04), cap_w


def test_the_cheapest_lock_no_slower_is_compared_with_each_cap_below_the_top(
    calibrate: ModuleType,
) -> None:
    lock_curve = [(1.0, 1.0), (1.1, 0.8), (1.3, 0.7), (1.6, 0.75)]
    jobs = {"job": {300.0: (10.0, 100.0), 250.0: (11.5, 95.0), 200.0: (20.0, 120.0)}}
    gaps = calibrate.relative_gaps(lock_curve, jobs)
    # 250 W: 1.15x, 0.95 -> the 1.1x lock (0.8); 200 W: 2.0x, 1.2 -> the cheapest, 0.7.
    assert gaps == pytest.approx([(0.8 / 0.95 - 1) * 100, (0.7 / 1.2 - 1) * 100])
