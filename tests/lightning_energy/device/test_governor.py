"""The power-limit governor: under a cap the clock follows the work's phases, a lock at the
same speed then draws less energy (and does not for single-phase work), the average power
stays at the cap, and the cap and the temperature throttle a lock only while it works."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_energy.device.simulated import (
    CLOCK_EVENT_GPU_IDLE,
    CLOCK_EVENT_SW_POWER_CAP,
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN,
    GovernedRun,
    Phase,
    SimulatedGPU,
    SimulatedSpec,
    ThermalModel,
    physics_preset,
    simulated_gpus,
    steady_run,
)
from lightning_energy.errors import ConfigError, NotSupportedError

A100 = physics_preset("a100")
# A step of two long phases the governor can follow: GEMMs, then memory-bound kernels.
TWO_PHASES = (Phase(0.5, 1.0), Phase(0.5, 0.1))
ONE_PHASE = (Phase(1.0, 0.55),)  # the same mean compute-bound share in one phase
STEP_S = 4.0


def _governed(phases: tuple[Phase, ...], cap_w: float) -> GovernedRun:
    return steady_run(A100, STEP_S, phases, cap_w, settle_s=4.0, measure_s=8.0)


def _locked(phases: tuple[Phase, ...], clock_mhz: int) -> GovernedRun:
    return steady_run(A100, STEP_S, phases, A100.max_power_limit_w, clock_mhz)


def _lock_at_equal_speed(phases: tuple[Phase, ...], governed: GovernedRun) -> GovernedRun:
    """The lock at the lowest supported clock that is no slower than ``governed``."""
    for clock_mhz in A100.sm_clocks_mhz[::-1]:
        run = _locked(phases, clock_mhz)
        if run.duration_s <= governed.duration_s:
            return run
    raise AssertionError("even the maximum clock is slower than the governed run")


@pytest.mark.parametrize("cap_w", [200.0, 250.0])
def test_under_a_cap_the_clock_follows_the_phases_and_a_lock_saves_energy(cap_w: float) -> None:
    # The clock moves with the phases: low in the GEMMs, high in the memory-bound phase.
    gpu = SimulatedGPU(A100)
    gpu.set_power_limit_w(cap_w)
    clocks: dict[float, set[int | None]] = {1.0: set(), 0.1: set()}
    for _ in range(4):
        for phase in TWO_PHASES:
            gpu.run_work(phase.share * STEP_S, phase.compute_bound_share)
            clocks[phase.compute_bound_share].add(gpu.sm_clock_mhz())
    gpu.set_power_limit_w(A100.default_power_limit_w)
    assert max(f or 0 for f in clocks[1.0]) < min(f or 0 for f in clocks[0.1])
    governed = _governed(TWO_PHASES, cap_w)
    # A lock at the average clock is no slower ...
    average = max(f for f in A100.sm_clocks_mhz if f <= governed.mean_clock_mhz + 15)
    assert _locked(TWO_PHASES, average).duration_s <= governed.duration_s
    # ... and the lock at the same speed draws less energy (power is convex in the clock).
    locked = _lock_at_equal_speed(TWO_PHASES, governed)
    assert locked.clock_mhz <= average
    assert locked.energy_j < governed.energy_j * 0.98


@pytest.mark.parametrize("cap_w", [250.0, 300.0])
def test_for_single_phase_work_a_lock_saves_nothing(cap_w: float) -> None:
    """One phase: the governor settles where the power meets the cap and the clock has no
    phases to follow, so a lock at the same speed is no cheaper (the optimiser must follow
    measurements, not the convexity argument)."""
    governed = _governed(ONE_PHASE, cap_w)
    locked = _lock_at_equal_speed(ONE_PHASE, governed)
    assert locked.energy_j >= governed.energy_j


@settings(max_examples=25, deadline=None)
@given(
    cap_w=st.floats(min_value=150.0, max_value=400.0),
    betas=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=5),
    step_s=st.sampled_from([0.02, 0.25, 1.0]),
)
def test_the_governor_holds_average_power_at_or_under_the_cap(
    cap_w: float, betas: list[float], step_s: float
) -> None:
    phases = tuple(Phase(1.0 / len(betas), beta) for beta in betas)
    run = steady_run(A100, step_s, phases, cap_w, settle_s=2.0, measure_s=6.0)
    assert run.power_w <= cap_w * 1.002


def test_a_cap_throttles_a_lock_and_says_so_only_under_load() -> None:
    gpu = SimulatedGPU(A100)
    gpu.set_locked_clocks_mhz(1410, 1410)
    gpu.set_power_limit_w(200.0)
    for _ in range(20):
        gpu.run_work(0.1, 1.0)
    clock_mhz = gpu.sm_clock_mhz()
    assert clock_mhz is not None and clock_mhz < 1410
    assert gpu.clock_event_reasons() & CLOCK_EVENT_SW_POWER_CAP
    gpu.idle(1.0)
    assert gpu.clock_event_reasons() == CLOCK_EVENT_GPU_IDLE
    # Without the cap the lock holds and the cap reason goes.
    gpu.set_power_limit_w(400.0)
    for _ in range(20):
        gpu.run_work(0.1, 0.3)
    assert gpu.sm_clock_mhz() == 1410
    assert not gpu.clock_event_reasons() & CLOCK_EVENT_SW_POWER_CAP
    gpu.reset_locked_clocks()


HOT = ThermalModel(ambient_c=30.0, resistance_c_per_w=0.2, time_constant_s=5.0, slowdown_c=85.0)


def test_a_hot_gpu_slows_a_lock_down_and_says_so_only_under_load() -> None:
    gpu = SimulatedGPU(replace(A100, thermal=HOT))
    gpu.set_locked_clocks_mhz(1410, 1410)
    start_c = gpu.temperature_c()
    for _ in range(300):  # 30 s of compute-bound work: 6 time constants
        gpu.run_work(0.1, 1.0)
    assert gpu.temperature_c() > start_c
    clock_mhz = gpu.sm_clock_mhz()
    assert clock_mhz is not None and clock_mhz < 1410
    assert gpu.clock_event_reasons() & CLOCK_EVENT_SW_THERMAL_SLOWDOWN
    assert not gpu.clock_event_reasons() & CLOCK_EVENT_SW_POWER_CAP
    hot_c = gpu.temperature_c()
    gpu.idle(30.0)
    assert gpu.clock_event_reasons() == CLOCK_EVENT_GPU_IDLE
    assert gpu.temperature_c() < hot_c
    # Cooled down, the lock holds again.
    gpu.run_work(0.1, 1.0)
    assert gpu.sm_clock_mhz() == 1410
    assert not gpu.clock_event_reasons() & CLOCK_EVENT_SW_THERMAL_SLOWDOWN
    gpu.reset_locked_clocks()


def test_a_cool_gpu_keeps_its_lock_and_one_without_a_thermal_model_has_no_temperature() -> None:
    cool = replace(HOT, slowdown_c=200.0)
    gpu = SimulatedGPU(replace(A100, thermal=cool))
    gpu.set_locked_clocks_mhz(1410, 1410)
    for _ in range(300):
        gpu.run_work(0.1, 1.0)
    assert gpu.sm_clock_mhz() == 1410
    assert not gpu.clock_event_reasons() & CLOCK_EVENT_SW_THERMAL_SLOWDOWN
    gpu.reset_locked_clocks()
    with pytest.raises(NotSupportedError, match="thermal"):
        SimulatedGPU(A100).temperature_c()


@pytest.mark.parametrize(
    ("phases", "needle"),
    [
        ((), "phases"),
        ((Phase(0.5, 1.0),), "add up to"),
        ((Phase(0.5, 1.5), Phase(0.5, 0.0)), r"phases\[0\].compute_bound_share"),
        ((Phase(0.0, 1.0), Phase(1.0, 0.0)), r"phases\[0\].share"),
        ((Phase(1.0, 0.5, blocked=True),), "blocked"),
    ],
)
def test_bad_phases_are_refused_with_what_is_allowed(
    phases: tuple[Phase, ...], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        SimulatedGPU(A100).run_phases(0.1, phases)


def test_a_single_phase_step_under_a_cap_lands_near_the_static_answer() -> None:
    """The governor dithers between the supported clocks around the static answer."""
    for cap_w in (200.0, 250.0, 300.0):
        run = steady_run(A100, 0.25, (Phase(1.0, 0.85),), cap_w)
        static_s, static_w = A100.run(0.25, 0.85, cap_w, None)
        assert run.duration_s == pytest.approx(static_s, rel=0.02)
        assert run.power_w == pytest.approx(static_w, rel=0.02)


def test_a_spec_with_step_phases_trains_on_them_and_the_cap_follows_them() -> None:
    """A job's training step made of phases (``SimulatedSpec.step_phases``): under a cap
    the governor moves the clock within each step; a lock at the same speed is cheaper."""
    spec = SimulatedSpec(gpu="a100", step_time_s=STEP_S, step_phases=TWO_PHASES)
    model = spec.model()
    assert isinstance(model, type(A100)) and model.step_shape() == TWO_PHASES
    assert model.step_compute_bound_share == pytest.approx(0.55)

    def step_cost(setting: dict[str, float]) -> tuple[float, float]:
        (gpu,) = simulated_gpus(spec)
        if "cap_w" in setting:
            gpu.set_power_limit_w(setting["cap_w"])
        else:
            gpu.set_locked_clocks_mhz(int(setting["clock_mhz"]), int(setting["clock_mhz"]))
        gpu.run_step(3)  # settle
        start_j, start_s = gpu.energy_j(), gpu.clock.now()
        gpu.run_step(4)
        gpu.set_power_limit_w(A100.default_power_limit_w)
        gpu.reset_locked_clocks()
        return (gpu.clock.now() - start_s) / 4, (gpu.energy_j() - start_j) / 4

    capped_s, capped_j = step_cost({"cap_w": 250.0})
    cheaper = [
        joules
        for clock in A100.sm_clocks_mhz[::3]
        for seconds, joules in [step_cost({"clock_mhz": clock})]
        if seconds <= capped_s
    ]
    assert min(cheaper) < capped_j


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"step_phases": (Phase(0.5, 1.0),)}, "add up to"),
        ({"step_phases": TWO_PHASES, "compute_bound_share": 0.5}, "compute_bound_share"),
        ({"gpu": "a40", "step_phases": TWO_PHASES}, "only applies to physics presets"),
    ],
)
def test_bad_step_phases_in_a_spec_are_refused_with_what_is_allowed(
    fields: dict[str, object], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        SimulatedSpec(**{"gpu": "a100", **fields}).model()  # type: ignore[arg-type]
