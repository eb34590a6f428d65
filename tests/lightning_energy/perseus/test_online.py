from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.device import SimulatedSpec, StageWork, simulated_gpus
from lightning_energy.device.guard import GPUGuard
from lightning_energy.device.simulated import physics_preset
from lightning_energy.device.simulated.work import PipelineSimulation
from lightning_energy.errors import ConfigError, ProfileError
from lightning_energy.perseus import one_f_one_b
from lightning_energy.perseus.runtime import ClockController, PipelineRuntime
from lightning_energy.perseus.runtime.online import (
    ClockModel,
    OnlinePerseus,
    PowerCurve,
    default_profile_clocks,
    fit_profile,
)

from .helpers import TickingCounter, simulated_profile


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


def test_blocked_power_measured_per_clock_is_predicted_at_every_clock() -> None:
    """The waits measured at each profiled clock (NCCL spins at the locked clock) give the
    blocked power at every clock of the plan; none measured (no wait anywhere): 0 W."""
    model = physics_preset("a100")
    samples = {
        (0, "forward"): _samples(0.02, 0.9, [1410, 1200, 990]),
        (0, "backward"): _samples(0.04, 0.7, [1410, 1200, 990]),
    }
    measured = {f: model.blocked_power_w(f) for f in (1410, 1200, 990)}
    profile = fit_profile(samples, range(1410, 500, -15), blocked_power_w=measured)
    for f in profile.frequencies_mhz:
        assert profile.blocked_power_at(f) == pytest.approx(model.blocked_power_w(f), rel=0.005)
    assert profile.blocked_power_at(1410) > profile.blocked_power_at(990)
    nothing = fit_profile(samples, [1410, 1200], blocked_power_w={})
    assert nothing.blocked_power_w == {1410: 0.0, 1200: 0.0}


def test_power_curve_holds_its_ends_and_never_goes_negative() -> None:
    curve = PowerCurve.fit({1000: 80.0, 1400: 100.0})
    assert curve.power_w(1200) == pytest.approx(90.0)
    assert (curve.power_w(500), curve.power_w(2000)) == pytest.approx((80.0, 100.0))
    assert PowerCurve.fit({1200: 90.0}).power_w(1400) == 90.0
    assert PowerCurve((-10.0, 0.0, 0.0), 1000, 1400).power_w(1200) == 0.0
    with pytest.raises(ProfileError, match="no power measured"):
        PowerCurve.fit({})


def test_default_profile_clocks() -> None:
    clocks = default_profile_clocks(list(range(1410, 209, -15)))
    assert clocks[0] == 1410 and len(clocks) == 4
    assert all(a > b for a, b in itertools.pairwise(clocks))
    assert clocks[-1] == pytest.approx(846, abs=15)
    with pytest.raises(ConfigError):
        default_profile_clocks([1410], count=1)


def _single_rank(
    tmp_path: Path, spec: SimulatedSpec | None = None, **options: Any
) -> tuple[OnlinePerseus, list[Any], Any]:
    """An online Perseus on one simulated rank of a one-stage pipeline; counts broadcasts."""
    gpu = simulated_gpus(spec or SimulatedSpec(gpu="a100"))[0]
    schedule = one_f_one_b(1, 2)
    works = {(0, "forward"): StageWork(0.02, 0.9), (0, "backward"): StageWork(0.04, 0.8)}
    guard = GPUGuard([gpu], lease_dir=tmp_path, install_signal_handlers=False)
    guard.acquire()
    runtime = PipelineRuntime(
        schedule, 0, ClockController(guard), work=PipelineSimulation(gpu, works)
    )
    try:
        online = OnlinePerseus(
            runtime,
            gpu,
            supported_clocks_mhz=gpu.supported_sm_clocks_mhz(),
            profile_clocks_mhz=[1410, 1200, 990],
            warmup_iterations=0,
            clock=gpu.clock.now,
            **options,
        )
        online.start()  # as after the pipeline's first iteration
    except BaseException:
        runtime.close()
        guard.restore()
        raise
    broadcasts: list[Any] = []
    real = online._broadcast

    def counting(obj: Any) -> Any:
        broadcasts.append(obj)
        return real(obj)

    online._broadcast = counting  # type: ignore[method-assign]
    return online, broadcasts, guard


def _iterate(online: OnlinePerseus) -> None:
    online.on_iteration_start()
    for inst in online.runtime.schedule.device_orders[0]:
        online.runtime.before(inst)
        online.runtime.after(inst)
    online.on_iteration_end()


def test_replanning_is_checked_every_n_iterations_not_every_one(tmp_path: Path) -> None:
    online, broadcasts, guard = _single_rank(tmp_path, replan_every_iterations=10)
    try:
        for _ in range(1000):
            _iterate(online)
            if online.phase != "profiling":
                break
        assert online.phase == "planned"
        planned_with = len(broadcasts)  # the plan itself
        for _ in range(25):
            _iterate(online)
        assert len(broadcasts) - planned_with == 2  # after 10 and 20 planned iterations
        plan = online.runtime.plan
        online.set_target_time(0.5)
        for _ in range(4):
            _iterate(online)
        assert online.runtime.plan is plan  # not before the next check
        _iterate(online)
        assert online.target_time_s == 0.5 and online.runtime.plan is not plan
    finally:
        online.runtime.close()
        guard.restore()


def test_replan_period_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="replan_every_iterations: 0 is not allowed"):
        _single_rank(tmp_path, replan_every_iterations=0)


def test_without_permission_nothing_is_profiled_or_planned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = SimulatedSpec(gpu="a100", permission_denied=True)
    with caplog.at_level(logging.INFO):
        online, _, guard = _single_rank(tmp_path, spec)
        try:
            for _ in range(6):
                _iterate(online)
            assert online.phase == "disabled"
            assert online.runtime.plan is None and online.profile is None
            assert online.runtime.controller.changes == 0
            assert guard.observe_only
        finally:
            online.runtime.close()
            guard.restore()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "observe-only" in warnings[0].getMessage()


def _ticking_samples(
    clocks: list[int], iterations: int, counter: TickingCounter
) -> list[tuple[int, float, float]]:
    """One 20 ms instruction (then 5 ms blocked) per iteration, measured on ``counter``."""
    model = physics_preset("a100")
    samples = []
    for f in clocks:
        for _ in range(iterations):
            t = model.work_time_s(0.02, 0.85, f)
            before = counter.energy_j()
            counter.run(t, model.work_power_w(0.85, f))
            samples.append((f, t, counter.energy_j() - before))
            counter.run(0.005, model.idle_power_w)
    return samples


def test_online_profiling_is_sized_by_the_counter_period_and_lets_changes_land(
    tmp_path: Path,
) -> None:
    """On the default board (100 ms counter, 50 ms set latency) each clock gets one
    iteration for the change to land and then 200 counter periods (20 s) of measured
    iterations; the fitted profile matches the physics."""
    online, _, guard = _single_rank(tmp_path)
    try:
        clocks = []
        while online.phase == "profiling":
            clocks.append(online.profile_clocks_mhz[online._clock_index])
            _iterate(online)
        assert online.phase == "planned" and online.profile is not None
        iteration_s = {
            f: 2
            * sum(
                physics_preset("a100").work_time_s(t, b, f) for t, b in ((0.02, 0.9), (0.04, 0.8))
            )
            for f in (1410, 1200, 990)
        }
        for f in (1410, 1200, 990):
            measured = clocks.count(f) - 1
            assert measured * iteration_s[f] >= 20.0 > (measured - 1) * iteration_s[f]
        truth = simulated_profile(
            physics_preset("a100"),
            {(0, "forward"): StageWork(0.02, 0.9), (0, "backward"): StageWork(0.04, 0.8)},
            [1410, 1200, 990],
        )
        for stage, kind, f, time_s, energy_j in truth.rows():
            fitted_s, fitted_j = online.profile.entry(stage, kind).at(f)
            assert fitted_s == pytest.approx(time_s, rel=1e-6)
            assert fitted_j == pytest.approx(energy_j, rel=0.02)
    finally:
        online.runtime.close()
        guard.restore()


def test_a_counter_that_never_moves_leaves_the_clocks_alone_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    online, _, guard = _single_rank(tmp_path)
    monkeypatch.setattr(online.gpu, "energy_j", lambda: 1234.0)
    try:
        with caplog.at_level(logging.WARNING):
            while online.phase == "profiling":
                _iterate(online)
        assert online.phase == "disabled" and online.runtime.plan is None
        assert online.gpu.locked_clocks_mhz() is None  # back to the pre-job state
    finally:
        online.runtime.close()
        guard.restore()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "cannot plan" in warnings[0] and "rank 0: the energy counter moved 0" in warnings[0]


def test_a_clock_without_energy_is_left_out_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    samples = _ticking_samples([1410, 1200], 200, TickingCounter(0.1))
    samples += [(990, 0.02, 0.0), (990, 0.02, 0.0)]  # two samples between ticks
    entries = {(0, "forward"): samples, (0, "backward"): samples}
    with caplog.at_level(logging.WARNING):
        profile = fit_profile(entries, [1410, 1200, 990], blocked_power_w=70.0)
    assert list(profile.frequencies_mhz) == [1410, 1200]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "[990]" in warnings[0].getMessage()
