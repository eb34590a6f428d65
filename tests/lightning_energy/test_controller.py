"""EnergyController driven directly, as an adapter would, on simulated GPUs."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from carbon.providers.trace import TraceProvider, load_trace
from lightning_energy.config import EnergyConfig
from lightning_energy.controller import Decision, EnergyController
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus
from lightning_energy.device.simulated import TRACE_GPUS
from lightning_energy.errors import CheckpointMismatchError, ConfigError, NoPermissionError
from tests.lightning_energy.conftest import PaceCall


def _config(tmp_path: Path, **power_limit: Any) -> EnergyConfig:
    section = {"power_limits_w": [300, 250, 200, 150], "warmup_steps": 2, "settle_steps": 1}
    section.update(power_limit)
    return EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")},
            "power_limit": section,
            "log_every_n_steps": 10,
        }
    )


def _devices(**spec: Any) -> DeviceSet:
    # 100 steps an epoch: ~37 s steps, each longer than a profiling window must last.
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", steps_per_epoch=100, **spec))
    return DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=lambda: [g.run_step() for g in gpus],
    )


def _run(controller: EnergyController, steps: int) -> None:
    for _ in range(steps):
        controller.on_step_start()
        controller.on_step_end()


def _windows(controller: EnergyController) -> list[Decision]:
    return [d for d in controller.decisions if "window" in d["reason"]]


def test_profiles_then_keeps_the_choice_and_restores(tmp_path: Path) -> None:
    devices = _devices()
    controller = EnergyController(
        _config(tmp_path, selector="energy"), devices=devices, install_signal_handlers=False
    )
    _run(controller, 150)
    assert controller.profile_done
    chosen = controller.current_power_limit_w()
    assert chosen in (300.0, 250.0, 200.0, 150.0)
    assert devices.gpus[0].power_limit_w() == chosen
    assert controller.metrics["energy/power_limit_w"] == chosen
    summary = controller.teardown()
    assert devices.gpus[0].power_limit_w() == 300.0
    assert summary.power_limit_w == chosen
    assert summary.energy_j > 0 and summary.steps == 150
    assert summary.energy_saved_j > 0  # the least-energy limit beats full power
    assert controller.teardown() is summary  # idempotent


def test_workload_change_profiles_again_and_known_workloads_reuse(tmp_path: Path) -> None:
    controller = EnergyController(
        _config(tmp_path), devices=_devices(), install_signal_handlers=False
    )
    controller.set_workload("batch=32")
    _run(controller, 150)
    first = len(_windows(controller))
    choice_32 = controller.current_power_limit_w()
    controller.set_workload("batch=64")
    _run(controller, 150)
    second = len(_windows(controller))
    assert second > first  # profiled again
    controller.set_workload("batch=32")
    _run(controller, 20)
    assert len(_windows(controller)) == second  # reused, no new windows
    assert controller.current_power_limit_w() == choice_32
    controller.teardown()


def test_state_dict_resumes_without_profiling(tmp_path: Path) -> None:
    first = EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)
    _run(first, 150)
    state = first.state_dict()
    first.teardown()

    second = EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)
    second.setup()
    second.load_state_dict(state)
    _run(second, 20)
    assert _windows(second) == []
    assert second.current_power_limit_w() == state_choice(state)
    second.teardown()


def state_choice(state: dict[str, Any]) -> float:
    (optimizer,) = state["optimizers"].values()
    from lightning_energy.optimize.power_limit import PowerLimitOptimizer
    from lightning_energy.optimize.selectors import make_selector

    probe = PowerLimitOptimizer(
        [300.0, 250.0, 200.0, 150.0], make_selector("cost", eta=0.5), num_gpus=1
    )
    probe.load_state_dict(optimizer)
    assert probe.chosen_power_limit_w is not None
    return probe.chosen_power_limit_w


def test_state_from_another_gpu_model_or_version_is_refused(tmp_path: Path) -> None:
    a40 = EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)
    _run(a40, 5)
    state = a40.state_dict()
    a40.teardown()
    v100_devices = DeviceSet(
        gpus=simulated_gpus(SimulatedSpec(gpu="v100")), clock=lambda: 0.0, backend="simulated"
    )
    v100 = EnergyController(
        _config(tmp_path, power_limits_w=[250, 200]),
        devices=v100_devices,
        install_signal_handlers=False,
    )
    with pytest.raises(CheckpointMismatchError, match="V100"):
        v100.load_state_dict(state)
    with pytest.raises(CheckpointMismatchError, match="version"):
        v100.load_state_dict({**state, "version": 99})


def test_no_permission_observes_only_and_changes_nothing(tmp_path: Path) -> None:
    devices = _devices(permission_denied=True)
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    _run(controller, 60)
    assert controller.observe_only
    assert controller.current_power_limit_w() is None
    assert devices.gpus[0].power_limit_w() == 300.0
    summary = controller.teardown()
    assert summary.observe_only and summary.energy_j > 0
    assert controller.decisions[0]["kind"] == "observe-only"


def test_strict_mode_raises_without_permission(tmp_path: Path) -> None:
    config = _config(tmp_path).merged({"strict": True})
    controller = EnergyController(
        config, devices=_devices(permission_denied=True), install_signal_handlers=False
    )
    with pytest.raises(NoPermissionError):
        controller.setup()


def test_candidates_outside_the_gpu_range_fail_before_any_change(tmp_path: Path) -> None:
    devices = _devices()
    controller = EnergyController(
        _config(tmp_path, power_limits_w=[300, 40]), devices=devices, install_signal_handlers=False
    )
    with pytest.raises(ConfigError, match=r"\[40\.0\] outside the allowed range 100-300 W"):
        controller.setup()
    assert devices.gpus[0].power_limit_w() == 300.0


def test_interrupted_windows_are_retried(tmp_path: Path) -> None:
    controller = EnergyController(
        _config(tmp_path, selector="energy"), devices=_devices(), install_signal_handlers=False
    )
    for step in range(200):
        controller.on_step_start()
        controller.on_step_end()
        if step % 7 == 6:
            controller.interrupt("validation")
    assert controller.profile_done
    measured = {m["power_limit_w"] for m in controller.profile()}
    assert measured == {300.0, 250.0, 200.0, 150.0}
    controller.teardown()


def test_carbon_problem_at_setup_is_a_config_error_and_leaves_nothing_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EM_TOKEN", "t0ken-value")
    config = _config(tmp_path).merged(
        {"carbon": {"provider": "electricitymaps", "region": "DE", "token_env": "EM_TOKEN"}}
    )
    monkeypatch.delenv("EM_TOKEN")  # gone by the time the job starts
    devices = _devices()
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    with pytest.raises(ConfigError, match=r"carbon\.token_env") as info:
        controller.setup()
    assert "t0ken-value" not in str(info.value)
    assert devices.gpus[0].power_limit_w() == 300.0


@pytest.mark.parametrize("candidates", [[300, 250, 200, 150], [300, 250, 200]])
def test_the_choice_is_recorded_even_when_it_is_the_limit_already_set(
    tmp_path: Path, candidates: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    devices = _devices()
    controller = EnergyController(
        _config(tmp_path, selector="energy", power_limits_w=candidates),
        devices=devices,
        install_signal_handlers=False,
    )
    controller.setup()
    sets: list[float] = []
    guard = controller.guard
    assert guard is not None
    guard_set = guard.set_power_limit_w

    def counting_set(power_limit_w: float) -> float:
        sets.append(power_limit_w)
        return float(guard_set(power_limit_w))

    monkeypatch.setattr(guard, "set_power_limit_w", counting_set)
    _run(controller, 150)
    assert controller.profile_done
    profiled_last = [d["value"] for d in controller.decisions if d["purpose"] == "profile"][-1]
    choices = [d for d in controller.decisions if d["purpose"] == "choice"]
    assert [d["value"] for d in choices] == [controller.current_power_limit_w()]
    assert "profile complete" in choices[0]["reason"]
    # The GPU is not set again to the limit it already has.
    assert all(a != b for a, b in itertools.pairwise(sets))
    if candidates[-1] == 200:  # the least-energy limit is the last one profiled
        assert choices[0]["value"] == profiled_last == 200.0
    controller.teardown()


def test_end_of_profiling_says_at_info_what_was_chosen_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    controller = EnergyController(
        _config(tmp_path, selector="energy"), devices=_devices(), install_signal_handlers=False
    )
    with caplog.at_level(logging.INFO, logger="lightning_energy.controller"):
        _run(controller, 150)
    chosen = controller.current_power_limit_w()
    controller.teardown()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("lightning_energy.controller") and r.levelno == logging.INFO
    ]
    assert len(lines) == 1
    assert f"{chosen:.0f} W" in lines[0] and "energy" in lines[0] and "less energy" in lines[0]


def test_carbon_baselines_cover_exactly_the_steps_and_time_of_the_totals(tmp_path: Path) -> None:
    config = EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "gpu": "a40",
                "start": "2023-03-01T00:00:00Z",
                "steps_per_epoch": 100,  # ~37 s steps: the profile ends within the run
                "lease_dir": str(tmp_path / "leases"),
            },
            "power_limit": {
                "power_limits_w": [300, 250, 200, 150],
                "warmup_steps": 2,
                "settle_steps": 1,
                "selector": "energy",
            },
            "carbon": {"provider": "trace", "region": "DE", "poll_interval_s": 600},
            "log_every_n_steps": 7,  # divides neither the profile's steps nor the run's
        }
    )
    controller = EnergyController(config, install_signal_handlers=False)
    _run(controller, 103)
    summary = controller.teardown()
    carbon = summary.carbon
    assert carbon is not None
    timeline = controller.timeline
    assert sum(e["steps"] for e in timeline) == summary.steps == 103
    assert sum(e["duration_s"] for e in timeline) == pytest.approx(summary.duration_s)
    assert sum(e["emissions_g"] for e in timeline) == pytest.approx(carbon["emissions_g"])
    # The baselines start where a logging interval ends: the grams before them are those
    # of the intervals up to that step, and they cover the remaining steps exactly.
    from_step = carbon["baselines_from_step"]
    assert 0 < from_step < 103 and from_step % 7 != 0
    before = [e for e in timeline if e["step"] <= from_step]
    assert before[-1]["step"] == from_step
    assert before[-1]["time_s"] == pytest.approx(carbon["baselines_from_s"])
    assert carbon["emissions_before_baselines_g"] == pytest.approx(
        sum(e["emissions_g"] for e in before)
    )
    assert carbon["baselines_steps"] == summary.steps - from_step
    for name in ("carbon_unaware", "full_power"):
        series = carbon["baselines"][name]
        assert carbon[f"{name}_emissions_g"] == pytest.approx(series[-1][1])


def test_grams_are_counted_at_the_intensity_in_force_after_the_hour_turns(
    tmp_path: Path,
) -> None:
    # The DE trace changes on the hour. A poll once an hour, from a start off the hour,
    # held each value up to an hour past its end: every logging interval must be charged
    # at the value in force when it started, whatever the polling period.
    config = EnergyConfig.from_mapping(
        {
            "device": {
                "backend": "simulated",
                "gpu": "v100",
                "start": "2023-09-25T00:00:00Z",
                "steps_per_epoch": 100,  # ~40 s steps
                "lease_dir": str(tmp_path / "leases"),
            },
            "power_limit": {"selector": "energy", "warmup_steps": 2, "settle_steps": 1},
            "carbon": {"provider": "trace", "region": "DE", "poll_interval_s": 3600},
            "log_every_n_steps": 10,
        }
    )
    controller = EnergyController(config, install_signal_handlers=False)
    _run(controller, 600)  # ~7 h: six hour boundaries
    controller.teardown()
    start = datetime(2023, 9, 25, tzinfo=timezone.utc)
    trace = load_trace("DE")
    charged = [e for e in controller.timeline if e["steps"]]
    assert len(charged) >= 60
    hours = set()
    for entry in charged:
        began = start + timedelta(seconds=entry["time_s"] - entry["duration_s"])
        hours.add(began.hour)

        def at_start(began: datetime = began) -> datetime:
            return began

        in_force = TraceProvider(trace, now=at_start).latest().intensity_g_per_kwh
        assert entry["intensity_g_per_kwh"] == pytest.approx(in_force), began
    assert len(hours) >= 6


@pytest.mark.parametrize(("max_slowdown", "moves"), [(1.04, True), (1.5, False)])
def test_the_example_pacing_config_moves_the_pace_and_a_loose_deadline_does_not(
    tmp_path: Path, max_slowdown: float, moves: bool
) -> None:
    example = Path(__file__).parents[2] / "examples" / "carbon_pacing.yaml"
    config = EnergyConfig.from_yaml(example).merged(
        {
            "device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")},
            "carbon": {"max_slowdown": max_slowdown},
            "report": None,
        }
    )
    steps = 1200  # about half a day of device time on the simulated A40
    controller = EnergyController(config, install_signal_handlers=False)
    controller.setup()
    controller.set_total_steps(steps)
    _run(controller, steps)
    summary = controller.teardown()
    scales = {round(e["scale"], 2) for e in controller.timeline if e.get("scale") is not None}
    assert scales
    assert (len(scales) > 1) == moves
    assert summary.carbon is not None and summary.carbon["deadline_met"] is True


def test_a_pause_is_reweighed_at_the_idle_power_it_measures(
    a40_pausing_config: EnergyConfig,
    setup_reading_cold_idle: Callable[[EnergyController], float],
    record_pace_calls: Callable[[EnergyController], list[PaceCall]],
) -> None:
    # Before any pause the idle power is the boards' reading at setup, here their cold idle;
    # the first polling period of a pause measures what a pause draws, and the next
    # decision (still inside the pause) must use the measurement.
    controller = EnergyController(a40_pausing_config, install_signal_handlers=False)
    cold_idle_w = setup_reading_cold_idle(controller)
    calls = record_pace_calls(controller)
    controller.set_total_steps(1500)
    _run(controller, 1500)
    controller.teardown()
    first_pause = next(i for i, call in enumerate(calls) if call.pause)
    assert calls[first_pause].idle_w == cold_idle_w  # weighed at the reading at setup
    idle_w = TRACE_GPUS["a40"][2]  # what the simulated A40 draws idle
    assert calls[first_pause + 1].idle_w == pytest.approx(idle_w, rel=0.1)


def test_a_pause_on_an_unmeasured_idle_power_commits_to_a_short_probe_only(
    a40_pausing_config: EnergyConfig,
    setup_reading_cold_idle: Callable[[EnergyController], float],
    record_pace_calls: Callable[[EnergyController], list[PaceCall]],
) -> None:
    # The first pause is decided before a pause ever measured idle power (the reading at
    # setup, cold idle, is off); it may not commit the job to a whole polling period of
    # that estimate: it measures idle power over a short probe and is decided again at the
    # measured power.
    config = a40_pausing_config
    assert config.carbon is not None
    poll_s = config.carbon.poll_interval_s
    controller = EnergyController(config, install_signal_handlers=False)
    setup_reading_cold_idle(controller)
    calls = record_pace_calls(controller)
    controller.set_total_steps(1500)
    _run(controller, 1500)
    controller.teardown()
    paused = [e for e in controller.timeline if e["steps"] == 0 and e["duration_s"] > 0]
    assert paused, "the cold-idle reading makes the policy pause on this day"
    assert paused[0]["duration_s"] < poll_s
    first = next(i for i, call in enumerate(calls) if call.pause)
    probe_end = calls[first + 1]
    assert probe_end.elapsed_s - calls[first].elapsed_s < poll_s
    assert probe_end.idle_w == pytest.approx(TRACE_GPUS["a40"][2], rel=0.1)
    # Decided again at once at the measured power: on this day no pause pays at 30 W.
    assert not probe_end.pause
    pause = next(d for d in controller.decisions if d["purpose"] == "pause")
    resume = next(d for d in controller.decisions if d["purpose"] == "resume")
    assert resume["time_s"] - pause["time_s"] < poll_s


def _emissions(config: EnergyConfig, steps: int) -> tuple[float, list[Decision]]:
    controller = EnergyController(config, install_signal_handlers=False)
    controller.setup()
    controller.set_total_steps(steps)
    _run(controller, steps)
    summary = controller.teardown()
    assert summary.carbon is not None and summary.carbon["deadline_met"] is True
    return summary.carbon["emissions_g"], controller.decisions


@pytest.mark.parametrize(
    ("gpu", "start"),
    [("a40", "2023-09-04"), ("a40", "2023-03-06"), ("a40", "2023-10-30"), ("v100", "2023-09-25")],
)
def test_a_job_allowed_to_pause_emits_no_more_than_its_carbon_unaware_run(
    a40_pausing_config: EnergyConfig, gpu: str, start: str
) -> None:
    # The carbon-unaware run is run, not estimated: the same job with the static policy.
    # On 2023-09-04 and 2023-10-30 no pause pays at the A40's 30 W idle (a pause weighed at
    # a guessed idle power, before the boards' reading at setup was used, cost the first
    # ~0.1 %); on 2023-03-06 one does. On 2023-09-25 the V100 runs ahead at a faster limit
    # through the clean morning, so as not to run into the evening peak; charged at values
    # held up to an hour past the turn of the hour, that looked 2 % worse than the
    # carbon-unaware run, which it beats.
    config = a40_pausing_config.merged({"device": {"gpu": gpu, "start": f"{start}T00:00:00Z"}})
    unaware = config.merged({"carbon": {"policy": "static"}})
    paced_g, decisions = _emissions(config, 1500)
    unaware_g, _ = _emissions(unaware, 1500)
    assert paced_g <= unaware_g
    if start == "2023-03-06":
        assert any(d["purpose"] == "pause" for d in decisions)
        assert paced_g < 0.9 * unaware_g
