"""The power-limit search: its state machine, determinism, resume, re-selection, accuracy."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from lightning_energy.device.simulated import PowerTrace, SimulatedSpec, TraceModel, simulated_gpus
from lightning_energy.errors import CheckpointMismatchError, ConfigError, ProfileError
from lightning_energy.optimize.power_limit import LOCKED_CLOCK, PowerLimitOptimizer, Window
from lightning_energy.optimize.selectors import Measurement, Selector, make_selector

LIMITS = [300.0, 275.0, 250.0, 225.0, 200.0, 175.0, 150.0, 125.0, 100.0]
# A power-bound workload: time rises below 250 W, energy is least at 200 W. For each selector
# of the accuracy test the runner-up is at least 1.5 % worse than a limit within 1 %.
TRUTH = {
    300.0: (0.100, 25.0),
    275.0: (0.102, 24.3),
    250.0: (0.103, 23.3),
    225.0: (0.108, 21.8),
    200.0: (0.118, 20.2),
    175.0: (0.135, 21.0),
    150.0: (0.160, 22.4),
    125.0: (0.200, 24.0),
    100.0: (0.260, 26.0),
}

Measure = Callable[[Window], tuple[float, float]]


def noiseless(window: Window) -> tuple[float, float]:
    return TRUTH[window.power_limit_w]


def noisy(seed: int, noise_std: float = 0.03) -> Measure:
    """Window means of steps with independent relative noise on time and power."""
    rng = np.random.default_rng(seed)

    def measure(window: Window) -> tuple[float, float]:
        time_s, energy_j = TRUTH[window.power_limit_w]
        t = rng.normal(1.0, noise_std, window.measure_steps)
        p = rng.normal(1.0, noise_std, window.measure_steps)
        return time_s * float(t.mean()), energy_j * float((t * p).mean())

    return measure


def drive(optimizer: PowerLimitOptimizer, measure: Measure) -> list[Window]:
    """Run the controller's loop until the profile is complete."""
    windows = []
    while (window := optimizer.next_window()) is not None:
        windows.append(window)
        if window.measure_steps == 0:
            optimizer.report(window, time_per_step_s=0.0, energy_per_step_j=0.0)
        else:
            time_s, energy_j = measure(window)
            optimizer.report(window, time_per_step_s=time_s, energy_per_step_j=energy_j)
        assert len(windows) < 500
    return windows


def optimizer(selector: Selector | None = None, **kwargs: object) -> PowerLimitOptimizer:
    return PowerLimitOptimizer(
        LIMITS,
        selector if selector is not None else make_selector("cost", eta=0.5),
        num_gpus=1,
        **kwargs,  # type: ignore[arg-type]
    )


def brute_force_limit(selector: Selector) -> float:
    profile = [Measurement(p, t, e, 1) for p, (t, e) in TRUTH.items()]
    return selector.select(profile, max_power_limit_w=300.0, num_gpus=1).power_limit_w


# ---------------------------------------------------------------- state machine
def test_warm_up_once_then_every_limit_descending_in_two_windows() -> None:
    windows = drive(optimizer(), noiseless)
    assert windows[0] == Window(300.0, 10, 0, "warmup")
    first_pass = [w for w in windows if w.purpose == "profile"]
    assert [w.power_limit_w for w in first_pass] == [p for p in LIMITS for _ in range(2)]
    # The warm-up ran at 300 W and each second half follows its first half: no settling.
    assert [w.settle_steps for w in first_pass] == [0, 0] + [2, 0] * (len(LIMITS) - 1)
    assert {w.measure_steps for w in first_pass} == {3}
    assert sum(1 for w in windows if w.purpose == "warmup") == 1


def test_noiseless_profile_stops_after_the_first_pass_with_the_optimum() -> None:
    opt = optimizer(make_selector("energy"))
    windows = drive(opt, noiseless)
    assert all(w.purpose != "refine" for w in windows)
    assert opt.done
    assert opt.chosen_power_limit_w == brute_force_limit(opt.selector)
    assert opt.profiled_steps() == 10 + 6 * len(LIMITS) + 2 * (len(LIMITS) - 1)
    assert opt.next_window() is None


def test_profile_merges_windows_per_limit_highest_first() -> None:
    opt = optimizer()
    drive(opt, noisy(3))
    profile = opt.profile()
    assert [m.power_limit_w for m in profile] == LIMITS
    assert sum(m.steps for m in profile) + 10 + 2 * (len(LIMITS) - 1) <= opt.profiled_steps()
    assert all(m.steps >= 6 for m in profile)


def test_next_window_is_stable_until_reported() -> None:
    opt = optimizer()
    first = opt.next_window()
    assert opt.next_window() == first
    assert first is not None
    opt.report(first, time_per_step_s=0.0, energy_per_step_j=0.0)
    assert opt.next_window() != first


def test_without_warm_up_the_first_window_settles() -> None:
    opt = optimizer(warmup_steps=0)
    assert opt.next_window() == Window(300.0, 2, 3, "profile")


def test_interrupted_window_is_retried_with_settling_and_its_steps_counted() -> None:
    opt = optimizer()
    warmup = opt.next_window()
    assert warmup is not None
    opt.report(warmup, time_per_step_s=0.0, energy_per_step_j=0.0)
    first = opt.next_window()
    assert first == Window(300.0, 0, 3, "profile")
    opt.report(first, time_per_step_s=0.1, energy_per_step_j=25.0)
    second = opt.next_window()
    assert second == Window(300.0, 0, 3, "profile")
    opt.report_interrupted(second, steps_run=2)
    retry = opt.next_window()
    # Same limit and purpose, but the validation run in between calls for settling again.
    assert retry == Window(300.0, 2, 3, "profile")
    assert opt.profiled_steps() == 10 + 3 + 2
    assert len(opt.profile()) == 1 and opt.profile()[0].steps == 3


def test_interrupted_warm_up_is_repeated() -> None:
    opt = optimizer()
    warmup = opt.next_window()
    assert warmup is not None
    opt.report_interrupted(warmup)
    assert opt.next_window() == warmup


def test_interruptions_do_not_change_the_outcome() -> None:
    plain = optimizer()
    drive(plain, noiseless)
    opt = optimizer()
    count = 0
    while (window := opt.next_window()) is not None:
        count += 1
        if count % 3 == 0:
            opt.report_interrupted(window, steps_run=1)
            continue
        time_s, energy_j = noiseless(window) if window.measure_steps else (0.0, 0.0)
        opt.report(window, time_per_step_s=time_s, energy_per_step_j=energy_j)
    assert opt.chosen_power_limit_w == plain.chosen_power_limit_w
    assert opt.profile() == plain.profile()


def test_report_checks_the_window_and_the_numbers() -> None:
    opt = optimizer()
    with pytest.raises(ProfileError, match="not issued"):
        opt.report(Window(300.0, 0, 4, "profile"), time_per_step_s=0.1, energy_per_step_j=1.0)
    warmup = opt.next_window()
    assert warmup is not None
    opt.report(warmup, time_per_step_s=0.0, energy_per_step_j=0.0)
    window = opt.next_window()
    assert window is not None
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ProfileError, match="positive and finite"):
            opt.report(window, time_per_step_s=bad, energy_per_step_j=1.0)
        with pytest.raises(ProfileError, match="positive and finite"):
            opt.report(window, time_per_step_s=0.1, energy_per_step_j=bad)
    drive(opt, noiseless)
    with pytest.raises(ProfileError, match="not issued"):
        opt.report(window, time_per_step_s=0.1, energy_per_step_j=1.0)
    with pytest.raises(ProfileError, match="not issued"):
        opt.report_interrupted(window)


def test_a_single_candidate_needs_no_profile() -> None:
    opt = PowerLimitOptimizer([250.0], make_selector("energy"), num_gpus=4)
    assert opt.done and opt.chosen_power_limit_w == 250.0
    assert opt.next_window() is None
    assert opt.reselect(make_selector("time")) == 250.0


def test_candidates_are_deduplicated_and_sorted() -> None:
    opt = PowerLimitOptimizer([200.0, 300.0, 200.0, 250.0], make_selector("energy"), num_gpus=1)
    assert opt.power_limits_w == (300.0, 250.0, 200.0)


def test_bad_configuration_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as info:
        PowerLimitOptimizer(
            [],
            make_selector("energy"),
            num_gpus=0,
            warmup_steps=-1,
            initial_steps=1,
            tolerance=0.0,
            confidence=1.0,
        )
    keys = [p.split(":")[0] for p in info.value.problems]
    assert keys == [
        "power_limits_w",
        "num_gpus",
        "warmup_steps",
        "initial_steps",
        "tolerance",
        "confidence",
    ]
    with pytest.raises(ConfigError, match="max_power_limit_w"):
        PowerLimitOptimizer(LIMITS, make_selector("energy"), num_gpus=1, max_power_limit_w=250)
    with pytest.raises(ConfigError, match="power_limits_w"):
        PowerLimitOptimizer([300.0, -5.0], make_selector("energy"), num_gpus=1)
    with pytest.raises(ConfigError, match="power_limits_w"):
        PowerLimitOptimizer(["300 W"], make_selector("energy"), num_gpus=1)  # type: ignore[list-item]


# ---------------------------------------------------------------- determinism
def test_two_instances_given_the_same_reports_issue_the_same_windows() -> None:
    a, b = optimizer(seed=5), optimizer(seed=5)
    measure = noisy(11)
    windows = []
    while (wa := a.next_window()) is not None:
        wb = b.next_window()
        assert wa == wb
        windows.append(wa)
        time_s, energy_j = measure(wa) if wa.measure_steps else (0.0, 0.0)
        a.report(wa, time_per_step_s=time_s, energy_per_step_j=energy_j)
        b.report(wb, time_per_step_s=time_s, energy_per_step_j=energy_j)
    assert b.next_window() is None
    assert a.chosen_power_limit_w == b.chosen_power_limit_w
    assert any(w.purpose == "refine" for w in windows)  # the noise made it race


# ---------------------------------------------------------------- resume
def test_finished_state_round_trips_through_json_without_profiling_again() -> None:
    opt = optimizer()
    drive(opt, noisy(2))
    state = json.loads(json.dumps(opt.state_dict()))
    resumed = optimizer()
    resumed.load_state_dict(state)
    assert resumed.done
    assert resumed.next_window() is None
    assert resumed.chosen_power_limit_w == opt.chosen_power_limit_w
    assert resumed.profile() == opt.profile()
    assert resumed.profiled_steps() == opt.profiled_steps()
    assert resumed.state_dict() == state


def test_mid_profile_resume_warms_up_then_continues() -> None:
    opt = optimizer()
    measure = noisy(4)
    for _ in range(7):
        window = opt.next_window()
        assert window is not None
        time_s, energy_j = measure(window) if window.measure_steps else (0.0, 0.0)
        opt.report(window, time_per_step_s=time_s, energy_per_step_j=energy_j)
    expected = opt.next_window()
    assert expected is not None and expected.purpose == "profile"
    resumed = optimizer()
    resumed.load_state_dict(json.loads(json.dumps(opt.state_dict())))
    assert not resumed.done
    assert resumed.profiled_steps() == opt.profiled_steps()
    warmup = resumed.next_window()
    assert warmup == Window(expected.power_limit_w, 10, 0, "warmup")
    resumed.report(warmup, time_per_step_s=0.0, energy_per_step_j=0.0)
    nxt = resumed.next_window()
    assert nxt is not None
    assert (nxt.power_limit_w, nxt.measure_steps, nxt.purpose) == (
        expected.power_limit_w,
        expected.measure_steps,
        expected.purpose,
    )
    drive(resumed, measure)
    assert resumed.done
    assert [m.power_limit_w for m in resumed.profile()] == LIMITS


def test_resume_while_racing_warms_up_within_the_budget_and_finishes() -> None:
    opt = optimizer(make_selector("cost", eta=0.5), max_profile_steps=200)
    measure = noisy(21)
    while (window := opt.next_window()) is not None and window.purpose != "refine":
        time_s, energy_j = measure(window) if window.measure_steps else (0.0, 0.0)
        opt.report(window, time_per_step_s=time_s, energy_per_step_j=energy_j)
    assert window is not None and window.purpose == "refine"
    resumed = optimizer(make_selector("cost", eta=0.5), max_profile_steps=200)
    resumed.load_state_dict(opt.state_dict())
    warmup = resumed.next_window()
    assert warmup == Window(window.power_limit_w, 10, 0, "warmup")
    drive(resumed, measure)
    assert resumed.done
    assert resumed.profiled_steps() <= 200


def test_resume_rejects_other_jobs_and_malformed_states() -> None:
    opt = optimizer()
    drive(opt, noiseless)
    state = opt.state_dict()
    other = PowerLimitOptimizer(LIMITS[:-1], make_selector("energy"), num_gpus=1)
    with pytest.raises(CheckpointMismatchError, match="limits"):
        other.load_state_dict(state)
    with pytest.raises(CheckpointMismatchError, match="GPUs"):
        PowerLimitOptimizer(LIMITS, make_selector("energy"), num_gpus=2).load_state_dict(state)
    for broken in (
        {k: v for k, v in state.items() if k != "windows"},
        {**state, "windows": [[300.0, 4, -1.0, 2.0, "profile"]]},
        {**state, "windows": [[310.0, 4, 0.1, 2.0, "profile"]]},
        {**state, "chosen_power_limit_w": 123.0},
        {**state, "version": 99},
    ):
        with pytest.raises(ProfileError):
            optimizer().load_state_dict(broken)


def test_resume_under_another_selector_chooses_again_from_the_saved_profile() -> None:
    opt = optimizer(make_selector("time"))
    drive(opt, noiseless)
    resumed = optimizer(make_selector("energy"))
    resumed.load_state_dict(opt.state_dict())
    assert resumed.done and resumed.next_window() is None
    assert opt.chosen_power_limit_w == brute_force_limit(make_selector("time"))
    assert resumed.chosen_power_limit_w == brute_force_limit(make_selector("energy"))


# ---------------------------------------------------------------- reselect
def test_reselect_matches_brute_force_for_targets_across_the_frontier() -> None:
    opt = optimizer()
    drive(opt, noiseless)
    steps = opt.profiled_steps()
    profile = [Measurement(p, t, e, 1) for p, (t, e) in TRUTH.items()]
    times = sorted(t for t, _ in TRUTH.values())
    between = [0.5 * (a + b) for a, b in itertools.pairwise(times)]
    for target_s in [0.5 * times[0], *times, *between, 2 * times[-1]]:
        selector = make_selector("target_time", target_time_s=target_s)
        chosen = opt.reselect(selector)
        # Within the tolerance: at most 1 % more energy, the target met within 1 %.
        assert gap_of(selector, profile, chosen) <= 0.01, target_s
        if all(abs(t / target_s - 1) > 0.01 for t in times):
            assert chosen == brute_force_limit(selector), target_s
        assert opt.chosen_power_limit_w == chosen
        assert opt.selector is selector
    assert opt.profiled_steps() == steps
    assert opt.next_window() is None


def test_reselect_with_noise_stays_close_to_the_optimum() -> None:
    opt = optimizer()
    drive(opt, noisy(8))
    profile = [Measurement(p, t, e, 1) for p, (t, e) in TRUTH.items()]
    times = sorted(t for t, _ in TRUTH.values())
    for target_s in np.linspace(times[0], times[-1], 25):
        selector = make_selector("target_time", target_time_s=float(target_s))
        chosen = opt.reselect(selector)
        gap = gap_of(selector, profile, chosen, slack=0.02)
        assert gap <= 0.03, (target_s, chosen)


def test_reselect_during_the_profile_switches_the_goal_of_the_search() -> None:
    opt = optimizer()
    window = opt.next_window()
    assert opt.reselect(make_selector("energy")) == 300.0  # nothing measured yet
    assert opt.next_window() == window  # the window in flight is not withdrawn
    drive(opt, noiseless)
    assert opt.chosen_power_limit_w == brute_force_limit(make_selector("energy"))


# ---------------------------------------------------------------- accuracy
def gap_of(
    selector: Selector, profile: Sequence[Measurement], limit_w: float, slack: float = 0.01
) -> float:
    limits = np.array([m.power_limit_w for m in profile])
    gaps = selector.gaps(
        limits,
        np.array([[m.time_per_step_s for m in profile]]),
        np.array([[m.energy_per_step_j for m in profile]]),
        max_power_limit_w=float(limits.max()),
        num_gpus=1,
        time_slack=slack,
    )
    return float(gaps[0, list(limits).index(limit_w)])


@pytest.mark.parametrize(
    "selector",
    [
        make_selector("energy"),
        make_selector("time"),
        make_selector("cost", eta=0.5),
        make_selector("max_slowdown", max_slowdown=1.1),
        make_selector("target_time", target_time_s=0.115),
    ],
    ids=lambda s: s.describe(),
)
def test_noisy_search_is_within_tolerance_and_budget(selector: Selector) -> None:
    profile = [Measurement(p, t, e, 1) for p, (t, e) in TRUTH.items()]
    for seed in range(5):
        opt = optimizer(selector, seed=seed)
        drive(opt, noisy(100 + seed))
        assert opt.chosen_power_limit_w is not None
        assert gap_of(selector, profile, opt.chosen_power_limit_w) <= 0.01
        assert opt.profiled_steps() <= 30 * len(LIMITS)


def test_custom_budget_caps_the_racing() -> None:
    opt = optimizer(max_profile_steps=0)
    windows = drive(opt, noisy(1))
    assert all(w.purpose != "refine" for w in windows)  # the first pass always completes
    assert opt.done


# ---------------------------------------------------------------- trace-driven GPUs
def candidates(lo_w: float, hi_w: float) -> list[float]:
    return [hi_w - 25.0 * i for i in range(int((hi_w - lo_w) // 25.0) + 1)]


def search_on_gpu(spec: SimulatedSpec, selector: Selector) -> PowerLimitOptimizer:
    """The controller's loop: apply, settle, read the energy counter and clock, measure."""
    (gpu,) = simulated_gpus(spec)
    opt = PowerLimitOptimizer(
        candidates(*gpu.power_limit_constraints_w()), selector, num_gpus=1, seed=spec.seed
    )
    try:
        while (window := opt.next_window()) is not None:
            gpu.set_power_limit_w(window.power_limit_w)
            gpu.run_step(window.settle_steps)
            start_s, start_j = gpu.clock.now(), gpu.energy_j()
            gpu.run_step(window.measure_steps)
            steps = max(window.measure_steps, 1)
            opt.report(
                window,
                time_per_step_s=(gpu.clock.now() - start_s) / steps,
                energy_per_step_j=(gpu.energy_j() - start_j) / steps,
            )
    finally:
        gpu.set_power_limit_w(gpu.default_power_limit_w())
    return opt


def zeus_sweep(spec: SimulatedSpec) -> list[Measurement]:
    """Zeus' exhaustive sweep on the same GPU: 10 warm-up and 40 measured steps per limit."""
    (gpu,) = simulated_gpus(spec)
    profile = []
    try:
        for limit_w in candidates(*gpu.power_limit_constraints_w()):
            gpu.set_power_limit_w(limit_w)
            gpu.run_step(10)
            start_s, start_j = gpu.clock.now(), gpu.energy_j()
            gpu.run_step(40)
            time_s = (gpu.clock.now() - start_s) / 40
            profile.append(Measurement(limit_w, time_s, (gpu.energy_j() - start_j) / 40, 40))
    finally:
        gpu.set_power_limit_w(gpu.default_power_limit_w())
    return profile


def trace_truth(spec: SimulatedSpec) -> list[Measurement]:
    model = spec.model()
    assert isinstance(model, TraceModel)
    t0_s, share = model.step_work()
    profile = []
    for limit_w in candidates(model.min_power_limit_w, model.max_power_limit_w):
        duration_s, power_w = model.run(t0_s, share, limit_w, None)
        profile.append(Measurement(limit_w, duration_s, duration_s * power_w, 0))
    return profile


def trace_selectors(truth: Sequence[Measurement]) -> list[Selector]:
    fastest_s = min(m.time_per_step_s for m in truth)
    return [
        make_selector("energy"),
        make_selector("time"),
        make_selector("cost", eta=0.5),
        make_selector("max_slowdown", max_slowdown=1.1),
        make_selector("target_time", target_time_s=1.2 * fastest_s),
    ]


def trace_outcomes(
    gpu: str, noise_std: float, seed: int
) -> tuple[list[float], list[float], int, int]:
    """Our gaps, Zeus sweep gaps, our steps and the sweep's steps over a whole trace."""
    ours, zeus, steps, sweep_steps = [], [], 0, 0
    for index, (dataset, network, batch_size) in enumerate(PowerTrace.load(gpu).workloads()):
        spec = SimulatedSpec(
            gpu=gpu,
            workload=f"{dataset}/{network}",
            batch_size=batch_size,
            noise_std=noise_std,
            seed=1000 * seed + index,  # independent noise for every workload
            # The search's step efficiency, on exact readings: sizing windows for a slow
            # energy counter is the controller's job.
            energy_counter_period_s=0.0,
            power_average_s=0.0,
            setting_latency_s=0.0,
        )
        truth = trace_truth(spec)
        swept = zeus_sweep(spec)
        for selector in trace_selectors(truth):
            opt = search_on_gpu(spec, selector)
            assert opt.chosen_power_limit_w is not None
            ours.append(gap_of(selector, truth, opt.chosen_power_limit_w))
            chosen = selector.select(swept, max_power_limit_w=truth[0].power_limit_w, num_gpus=1)
            zeus.append(gap_of(selector, truth, chosen.power_limit_w))
            steps += opt.profiled_steps()
            sweep_steps += 50 * len(truth)
            assert opt.profiled_steps() <= 30 * len(truth)
    return ours, zeus, steps, sweep_steps


@pytest.mark.slow
@pytest.mark.parametrize("gpu", ["a40", "v100"])
def test_every_trace_workload_and_selector_within_tolerance_at_low_noise(gpu: str) -> None:
    ours, _, steps, sweep_steps = trace_outcomes(gpu, noise_std=0.01, seed=0)
    worst = max(ours)
    assert worst <= 0.01, f"a choice is {worst:.2%} off the optimum"
    assert steps <= 0.4 * sweep_steps


@pytest.mark.slow
def test_noisy_trace_search_misses_less_often_than_zeus_sweep() -> None:
    # With 3 % noise per step some limits are too close to tell apart within any budget:
    # Zeus' own 40 measured steps per limit miss a few. Over both traces the search must
    # miss no more often, with at most 40 % of the sweep's steps in total.
    ours, zeus, steps, sweep_steps = [], [], 0, 0
    for gpu in ("a40", "v100"):
        gaps, zeus_gaps, used, swept = trace_outcomes(gpu, noise_std=0.03, seed=0)
        ours += gaps
        zeus += zeus_gaps
        steps += used
        sweep_steps += swept
    misses = sum(g > 0.01 for g in ours)
    assert misses <= sum(g > 0.01 for g in zeus)
    assert misses <= 0.02 * len(ours)
    assert steps <= 0.4 * sweep_steps


def test_an_excluded_setting_is_measured_but_never_chosen_and_the_state_keeps_it() -> None:
    best = optimizer(make_selector("energy"))
    drive(best, noiseless)
    assert best.chosen_power_limit_w == 200.0
    opt = optimizer(make_selector("energy"))
    excluded = False
    while (window := opt.next_window()) is not None:
        if window.measure_steps == 0:
            opt.report(window, time_per_step_s=0.0, energy_per_step_j=0.0)
            continue
        if window.power_limit_w == 200.0 and not excluded:
            opt.exclude(200.0)  # e.g. a lock the GPU could not hold
            excluded = True
        time_s, energy_j = noiseless(window)
        opt.report(window, time_per_step_s=time_s, energy_per_step_j=energy_j)
    assert 200.0 in {m.power_limit_w for m in opt.profile()}
    assert opt.chosen_power_limit_w not in (None, 200.0)
    assert opt.reselect(make_selector("energy")) != 200.0
    resumed = optimizer(make_selector("energy"))
    resumed.load_state_dict(opt.state_dict())
    assert resumed.excluded == {200.0}
    assert resumed.reselect(make_selector("energy")) == opt.chosen_power_limit_w
    with pytest.raises(ProfileError, match="not a candidate"):
        opt.exclude(212.0)


def test_a_locked_clock_profile_is_not_resumed_as_power_limits() -> None:
    clocks = PowerLimitOptimizer(
        [1410.0, 1200.0],
        make_selector("energy"),
        num_gpus=1,
        max_power_limit_w=400.0,
        kind=LOCKED_CLOCK,
    )
    limits = PowerLimitOptimizer([1410.0, 1200.0], make_selector("energy"), num_gpus=1)
    with pytest.raises(CheckpointMismatchError, match="locked clocks"):
        limits.load_state_dict(clocks.state_dict())
    with pytest.raises(ConfigError, match="max_power_limit_w"):
        PowerLimitOptimizer([1410.0], make_selector("energy"), num_gpus=1, kind=LOCKED_CLOCK)
