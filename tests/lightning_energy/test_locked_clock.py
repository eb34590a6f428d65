"""The locked-clock knob: profile and choice under every selector, restore and lease,
checkpoints, and the ``power_limit.knob`` choice (simulated A100, whose clocks are modelled)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.controller.locked_clock import thin_clocks_mhz
from lightning_energy.device import NVMLGPU, DeviceSet, SimulatedGPU, SimulatedSpec, simulated_gpus
from lightning_energy.device.guard import recover
from lightning_energy.device.simulated import Phase
from lightning_energy.errors import ConfigError, NoPermissionError, ProfileError
from lightning_energy.optimize.selectors import Measurement, make_selector, select_across
from tests.lightning_energy.paced_lock_worker import paced_config

PRE_JOB_W = 400.0  # the simulated A100's default limit
WORKER = Path(__file__).with_name("clock_worker.py")
SELECTORS: dict[str, dict[str, Any]] = {
    "energy": {},
    "time": {},
    "cost": {"eta": 0.5},
    "max_slowdown": {"max_slowdown": 1.1},
    "target_time": {"target_time_s": 0.6},
}

# Phased work: under a cap the governor's clock follows the phases, and a lock at the same
# average clock saves energy. Compute-bound work of one phase: cap and lock settle at the
# same clock, and on a coarse clock grid the limit lands nearer the optimum.
AUTO_MODELS: dict[str, tuple[tuple[Phase, ...], float, str]] = {
    "phased": ((Phase(0.6, 0.95), Phase(0.4, 0.15)), 150, "locked_clock"),
    "one phase, coarse clocks": ((Phase(1.0, 0.9),), 400, "power_limit"),
}


def _config(tmp_path: Path, **power_limit: Any) -> EnergyConfig:
    section: dict[str, Any] = {
        "knob": "locked_clock",
        "warmup_steps": 2,
        "settle_steps": 1,
        "clock_step_mhz": 150,
    }
    section.update(power_limit)
    return EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")},
            "power_limit": section,
        }
    )


def _devices(**spec: Any) -> DeviceSet:
    fields: dict[str, Any] = {"gpu": "a100", "step_time_s": 0.5}
    fields.update(spec)
    gpus = simulated_gpus(SimulatedSpec(**fields))
    return DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=lambda: [g.run_step() for g in gpus] and None,
    )


def _sim(devices: DeviceSet) -> SimulatedGPU:
    """The simulated GPU of a one-GPU device set."""
    gpu = devices.gpus[0]
    assert isinstance(gpu, SimulatedGPU)
    return gpu


def _profile(controller: EnergyController, max_steps: int = 1500) -> None:
    for _ in range(max_steps):
        controller.on_step_start()
        controller.on_step_end()
        if controller.profile_done:
            return
    pytest.fail(f"the profile did not complete in {max_steps} steps")


def test_candidates_are_the_supported_clocks_thinned_from_the_top() -> None:
    supported = [1410, 1395, 1380, 1300, 1290, 1200, 1185, 210]
    assert thin_clocks_mhz(supported, 100) == [1410.0, 1300.0, 1200.0, 210.0]
    assert thin_clocks_mhz(supported, 1) == sorted(map(float, supported), reverse=True)
    assert thin_clocks_mhz(supported, 5000) == [1410.0]


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_the_knob_profiles_locked_clocks_and_chooses_by_the_selector(
    tmp_path: Path, selector: str
) -> None:
    devices = _devices()
    gpu = _sim(devices)
    parameters = SELECTORS[selector]
    controller = EnergyController(
        _config(tmp_path, selector=selector, **parameters),
        devices=devices,
        install_signal_handlers=False,
    )
    _profile(controller)
    assert controller.locked_clock.active
    measured = controller.locked_clock.profile_by_limit()
    candidates = thin_clocks_mhz(gpu.supported_sm_clocks_mhz(), 150)
    assert sorted(measured, reverse=True) == candidates  # every candidate measured
    # The choice is good enough for the selector on what was measured (a noiseless GPU):
    # within the optimizer's 1 % of the best, and of any time bound.
    clocks = np.array(sorted(measured, reverse=True))
    time_s = np.array([[measured[c][0] for c in clocks]])
    energy_j = np.array([[measured[c][1] for c in clocks]])
    gaps = make_selector(selector, **parameters).gaps(
        clocks, time_s, energy_j, max_power_limit_w=PRE_JOB_W, num_gpus=1, time_slack=0.01
    )[0]
    chosen = controller.locked_clock.value
    assert chosen is not None
    assert gaps[list(clocks).index(chosen)] <= 0.01
    assert gaps.max() > 0.01  # the selector tells the clocks apart: the choice is not free
    assert gpu.settings() == (PRE_JOB_W, (chosen, chosen))  # the power limit is untouched
    kinds = {d["kind"] for d in controller.decisions}
    assert kinds == {"locked_clock"}
    assert controller.decisions[-1]["value"] == chosen
    for entry in controller.profile():  # what reports show of each candidate
        assert "power_limit_w" not in entry
        assert entry["sm_clock_mhz"] == entry["locked_clock_mhz"]  # the locks held
        assert entry["throttled"] is False
    summary = controller.teardown()
    assert gpu.settings() == (PRE_JOB_W, None)  # the lock is released at the end
    assert summary.power_limit_w is None
    assert (summary.knob, summary.locked_clock_mhz) == ("locked_clock", chosen)


@pytest.mark.parametrize("knob", ["locked_clock", "auto"])
def test_the_lock_is_restored_when_training_raises(tmp_path: Path, knob: str) -> None:
    devices = _devices()
    controller = EnergyController(
        _config(tmp_path, knob=knob, power_limits_w=[400, 300]),
        devices=devices,
        install_signal_handlers=False,
    )
    with pytest.raises(RuntimeError, match="training failed"):
        try:
            for _ in range(400):
                controller.on_step_start()
                controller.on_step_end()
                if _sim(devices).settings()[1] is not None:
                    break
            assert _sim(devices).settings()[1] is not None
            raise RuntimeError("training failed")
        finally:
            controller.teardown()
    assert _sim(devices).settings() == (PRE_JOB_W, None)


def test_a_checkpoint_resumes_the_chosen_lock_without_profiling(tmp_path: Path) -> None:
    controller = EnergyController(
        _config(tmp_path), devices=_devices(), install_signal_handlers=False
    )
    _profile(controller)
    chosen = controller.locked_clock.value
    state = json.loads(json.dumps(controller.state_dict()))
    controller.teardown()

    devices = _devices()
    resumed = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    resumed.setup()
    resumed.load_state_dict(state)
    assert resumed.profile_done
    assert _sim(devices).settings()[1] == (chosen, chosen)
    resumed.on_step_start()
    resumed.on_step_end()
    assert [d["purpose"] for d in resumed.decisions] == ["choice"]
    resumed.teardown()
    assert _sim(devices).settings() == (PRE_JOB_W, None)


@pytest.mark.parametrize("model", sorted(AUTO_MODELS))
def test_a_checkpoint_resumes_auto_s_choice_without_profiling(tmp_path: Path, model: str) -> None:
    phases, clock_step_mhz, winner = AUTO_MODELS[model]
    config = _config(
        tmp_path,
        knob="auto",
        selector="energy",
        clock_step_mhz=clock_step_mhz,
        power_limits_w=[400, 350, 300, 250, 200, 150],
    )
    controller = EnergyController(
        config, devices=_devices(step_phases=phases), install_signal_handlers=False
    )
    _profile(controller)
    chosen = (controller.setting.name, controller.setting.value)
    assert chosen[0] == winner
    state = json.loads(json.dumps(controller.state_dict()))
    controller.teardown()

    devices = _devices(step_phases=phases)
    resumed = EnergyController(config, devices=devices, install_signal_handlers=False)
    resumed.setup()
    resumed.load_state_dict(state)
    assert resumed.profile_done
    assert (resumed.setting.name, resumed.setting.value) == chosen
    value = chosen[1]
    held = (PRE_JOB_W, (value, value)) if winner == "locked_clock" else (value, None)
    assert _sim(devices).settings() == held
    resumed.on_step_start()
    resumed.on_step_end()
    assert [(d["kind"], d["purpose"]) for d in resumed.decisions] == [(winner, "choice")]
    resumed.teardown()
    assert _sim(devices).settings() == (PRE_JOB_W, None)


def test_a_power_limit_profile_does_not_resume_as_a_clock_profile(tmp_path: Path) -> None:
    limits = EnergyController(
        _config(tmp_path, knob="power_limit"), devices=_devices(), install_signal_handlers=False
    )
    _profile(limits)
    state = limits.state_dict()
    limits.teardown()
    clocks = EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)
    clocks.setup()
    clocks.load_state_dict(state)
    assert not clocks.profile_done  # the clocks are profiled afresh
    clocks.teardown()


def _state_lock(state_dir: Path) -> list[int] | None:
    state = json.loads((state_dir / "GPU-sim-a100-0.json").read_text(encoding="utf-8"))
    lock = state["locked_clocks_mhz"]
    return None if lock is None else list(lock)


def _start_worker(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path / "leases"), str(tmp_path / "state")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate()
        pytest.fail(f"worker exited early ({proc.returncode}): {err}")
    return proc, json.loads(line)["locked"]


def test_sigterm_releases_the_lock(tmp_path: Path) -> None:
    proc, locked = _start_worker(tmp_path)
    assert _state_lock(tmp_path / "state") == locked
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM
    assert _state_lock(tmp_path / "state") is None


@pytest.mark.gpu_state_may_change
def test_after_sigkill_the_lease_records_the_lock_and_recover_releases_it(
    tmp_path: Path,
) -> None:
    proc, locked = _start_worker(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    lease = json.loads((tmp_path / "leases" / "GPU-sim-a100-0.json").read_text(encoding="utf-8"))
    assert lease["clocks_changed"] is True
    assert _state_lock(tmp_path / "state") == locked
    (result,) = recover(tmp_path / "leases")
    assert result.status == "restored"
    assert _state_lock(tmp_path / "state") is None


_KNOB_VALUES = st.one_of(
    st.text(max_size=12).filter(lambda s: s not in ("auto", "power_limit", "locked_clock")),
    st.integers(),
    st.none(),
    st.booleans(),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(knob=_KNOB_VALUES)
def test_a_bad_knob_is_refused_naming_what_is_allowed(knob: object) -> None:
    with pytest.raises(ConfigError) as info:
        EnergyConfig.from_mapping({"power_limit": {"knob": knob}})
    assert "power_limit.knob" in str(info.value)
    if isinstance(knob, str):
        assert "allowed: auto, power_limit, locked_clock" in str(info.value)


@settings(max_examples=60, deadline=None)
@given(
    step=st.one_of(
        st.floats(max_value=0.999),
        st.floats(min_value=10_000.001),
        st.just(float("nan")),
        st.text(max_size=6),
        st.none(),
    )
)
def test_a_bad_clock_step_is_refused_naming_the_key(step: object) -> None:
    with pytest.raises(ConfigError, match=r"power_limit\.clock_step_mhz"):
        EnergyConfig.from_mapping({"power_limit": {"clock_step_mhz": step}})


# ---------------------------------------------------------------- which knob, and fallback
@pytest.mark.parametrize("model", sorted(AUTO_MODELS))
def test_auto_applies_the_measured_best_of_power_limits_and_locked_clocks(
    tmp_path: Path, model: str
) -> None:
    phases, clock_step_mhz, winner = AUTO_MODELS[model]
    devices = _devices(step_phases=phases)
    gpu = _sim(devices)
    controller = EnergyController(
        _config(
            tmp_path,
            knob="auto",
            selector="energy",
            clock_step_mhz=clock_step_mhz,
            power_limits_w=[400, 350, 300, 250, 200, 150],
        ),
        devices=devices,
        install_signal_handlers=False,
    )
    controller.setup()
    assert controller.setting is controller.power_limit  # power limits are profiled first
    _profile(controller)
    profile = controller.profile()
    limits = [e for e in profile if "power_limit_w" in e]
    clocks = [e for e in profile if "locked_clock_mhz" in e]
    assert len(limits) == 6 and len(clocks) > 1  # both knobs measured
    # The locks were seeded at the clocks the limits ran at.
    supported = sorted(gpu.supported_sm_clocks_mhz())
    seeded = {float(min(supported, key=lambda c: abs(c - e["sm_clock_mhz"]))) for e in limits}
    assert seeded <= {e["locked_clock_mhz"] for e in clocks}
    # The selector's choice among every measured candidate of both knobs is applied.
    measured = [
        [
            Measurement(e[key], e["time_per_step_s"], e["energy_per_step_j"], int(e["steps"]))
            for e in es
        ]
        for key, es in (("power_limit_w", limits), ("locked_clock_mhz", clocks))
    ]
    index, best = select_across(
        make_selector("energy"), measured, max_power_limit_w=PRE_JOB_W, num_gpus=1
    )
    assert ("power_limit", "locked_clock")[index] == winner  # the model is what it says
    assert controller.setting.name == winner
    assert controller.setting.value == best.power_limit_w
    if winner == "locked_clock":
        assert gpu.settings() == (PRE_JOB_W, (best.power_limit_w, best.power_limit_w))
    else:
        assert gpu.settings() == (best.power_limit_w, None)
    kinds = [d["kind"] for d in controller.decisions]
    assert kinds.index("locked_clock") > kinds.index("power_limit")
    choices = [d for d in controller.decisions if d["purpose"] == "choice"]
    assert [(d["kind"], d["value"]) for d in choices] == [(winner, best.power_limit_w)]
    summary = controller.teardown()
    assert gpu.settings() == (PRE_JOB_W, None)
    assert summary.knob == winner
    # The report names the winner and lists what every candidate of both knobs measured.
    from lightning_energy.plots import render_plots
    from lightning_energy.report import load_report, write_report

    report = load_report(write_report(controller, tmp_path / "run.json"))
    assert report["summary"]["knob"] == winner
    assert len(report["profile"]) == len(limits) + len(clocks)
    assert "frontier.png" in {p.name for p in render_plots(report, tmp_path / "figures")}


def test_auto_makes_the_same_choice_on_every_rank(tmp_path: Path) -> None:
    from tests.lightning_energy.processes import free_port, run_module_ranks

    port = str(free_port())
    dirs = [str(tmp_path / "gpus"), str(tmp_path / "leases")]
    run_module_ranks(
        "tests.lightning_energy.auto_knob_worker",
        [[str(r), port, str(tmp_path), *dirs] for r in range(2)],
        tmp_path,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["clocks_profiled"] for r in ranks)  # both knobs were measured
    assert ranks[0]["knob"] == ranks[1]["knob"] and ranks[0]["value"] == ranks[1]["value"]
    value = ranks[0]["value"]
    held = [PRE_JOB_W, [value, value]] if ranks[0]["knob"] == "locked_clock" else [value, None]
    assert all(r["settings"] == held for r in ranks)
    assert all(r["restored"] == [PRE_JOB_W, None] for r in ranks)


def test_select_across_bounds_time_by_the_reference_knob() -> None:
    limits = [Measurement(400.0, 1.00, 100.0, 10), Measurement(300.0, 1.08, 90.0, 10)]
    clocks = [Measurement(1410.0, 0.90, 110.0, 10), Measurement(1200.0, 1.05, 85.0, 10)]
    selector = make_selector("max_slowdown", max_slowdown=1.1)
    # 1.1 x the highest limit's 1.00 s: the 1200 MHz lock is allowed (by the fastest lock's
    # 0.90 s it would not be).
    assert select_across(selector, [limits, clocks], max_power_limit_w=400.0, num_gpus=1) == (
        1,
        clocks[1],
    )
    slow = [Measurement(1200.0, 1.2, 50.0, 10)]
    assert select_across(selector, [limits, slow], max_power_limit_w=400.0, num_gpus=1) == (
        0,
        limits[1],
    )


def test_auto_uses_power_limits_on_a_gpu_without_clock_control(tmp_path: Path) -> None:
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", steps_per_epoch=100))  # a trace GPU
    devices = DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=lambda: [g.run_step() for g in gpus] and None,
    )
    controller = EnergyController(
        _config(tmp_path, knob="auto", power_limits_w=[300, 200]),
        devices=devices,
        install_signal_handlers=False,
    )
    _profile(controller)
    assert controller.setting is controller.power_limit
    assert {d["kind"] for d in controller.decisions} == {"power_limit"}
    controller.teardown()
    assert gpus[0].settings() == (300.0, None)


def _nvml_devices(monkeypatch: pytest.MonkeyPatch, **device: Any) -> tuple[DeviceSet, Any]:
    from lightning_energy.device.nvml import nvml_gpus
    from tests.lightning_energy.device.fake_pynvml import a100, make_module

    fake = make_module([a100(0, **device)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = nvml_gpus()
    return DeviceSet(gpus=gpus, clock=fake.clock, backend="nvml"), fake


def _nvml_steps(controller: EnergyController, fake: Any, max_steps: int = 1500) -> Iterator[int]:
    """Run steps of 0.5 s on the in-memory NVML (a busy GPU drawing 250 W) until the
    profile is complete, yielding after each; fail when it does not complete."""
    for step in range(max_steps):
        controller.on_step_start()
        fake.advance(0.5)
        controller.on_step_end()
        yield step
        if controller.profile_done:
            return
    pytest.fail(f"the profile did not complete in {max_steps} steps")


BUSY = {"draw_mw": 250_000.0, "busy": True}
REFUSALS: dict[str, dict[str, Any]] = {
    "no permission": {"errors": {"nvmlDeviceSetGpuLockedClocks": 4}},
    "not supported": {"errors": {"nvmlDeviceSetGpuLockedClocks": 3}},
    "pre-Volta": {"graphics_clocks": {1215: (), 405: ()}},
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
@pytest.mark.parametrize("knob", ["auto", "locked_clock"])
def test_where_locking_is_refused_power_limits_are_profiled(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    refusal: str,
    knob: str,
) -> None:
    devices, fake = _nvml_devices(monkeypatch, **BUSY, **REFUSALS[refusal])
    controller = EnergyController(
        _config(tmp_path, knob=knob, power_limits_w=[400, 300, 200]),
        devices=devices,
        install_signal_handlers=False,
    )
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        # The refusal is known at setup, or at the first lock (under auto: once the power
        # limits are profiled).
        for _ in _nvml_steps(controller, fake):
            pass
    assert controller.setting is controller.power_limit
    assert not controller.observe_only  # power limits still apply
    chosen = controller.power_limit.static_value
    assert chosen is not None and fake.devices[0].limit_mw == chosen * 1000
    assert fake.devices[0].locked is None
    said = [r for r in caplog.records if "power limits are profiled" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == (logging.WARNING if knob == "locked_clock" else logging.INFO)
    controller.teardown()
    assert fake.devices[0].locked is None
    assert fake.devices[0].limit_mw == 400_000
    for gpu in devices.gpus:
        assert isinstance(gpu, NVMLGPU)
        gpu.close()


@pytest.mark.parametrize("knob", ["auto", "locked_clock"])
def test_a_lock_refused_later_in_the_run_falls_back_to_power_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, knob: str
) -> None:
    devices, fake = _nvml_devices(monkeypatch, **BUSY)
    controller = EnergyController(
        _config(tmp_path, knob=knob, power_limits_w=[400, 300, 200]),
        devices=devices,
        install_signal_handlers=False,
    )
    refused_at = None
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        for step in _nvml_steps(controller, fake):
            if refused_at is None and len(controller.locked_clock.session.profile()) >= 2:
                # Two clocks are measured; the driver refuses every lock from now on.
                fake.devices[0].errors["nvmlDeviceSetGpuLockedClocks"] = 4
                refused_at = step
    assert refused_at is not None
    assert not controller.locked_clock.active
    assert controller.setting is controller.power_limit
    assert fake.devices[0].locked is None  # the lock in force was released
    chosen = controller.power_limit.static_value
    assert chosen is not None and fake.devices[0].limit_mw == chosen * 1000
    assert not controller.observe_only
    said = [r for r in caplog.records if "power limits are profiled" in r.getMessage()]
    assert len(said) == 1
    locks = [d for d in controller.decisions if d["kind"] == "locked_clock"]
    assert locks and all(d["step"] <= refused_at + 1 for d in locks)
    controller.teardown()
    assert fake.devices[0].locked is None
    assert fake.devices[0].limit_mw == 400_000
    for gpu in devices.gpus:
        assert isinstance(gpu, NVMLGPU)
        gpu.close()


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_strict_mode_refuses_a_forced_lock_that_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    devices, fake = _nvml_devices(monkeypatch, **REFUSALS[refusal])
    config = _config(tmp_path).merged({"strict": True})
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    with pytest.raises(ConfigError, match=r"power_limit\.knob: 'locked_clock' is not possible"):
        for _ in range(6):  # the refusal is known at setup, or at the first lock
            controller.on_step_start()
            controller.on_step_end()
    controller.teardown()
    assert fake.devices[0].locked is None
    for gpu in devices.gpus:
        assert isinstance(gpu, NVMLGPU)
        gpu.close()


def test_a_throttled_lock_is_flagged_and_never_chosen(tmp_path: Path) -> None:
    devices = _devices()
    gpu = _sim(devices)
    gpu.set_power_limit_w(200.0)  # an operator's cap: the highest locks cannot hold under it
    try:
        controller = EnergyController(
            _config(tmp_path, selector="time"), devices=devices, install_signal_handlers=False
        )
        _profile(controller)
        measured = controller.locked_clock.profile_by_limit()
        throttled = controller.locked_clock.throttled()
        fastest = min(measured, key=lambda c: (measured[c][0], -c))
        assert fastest in throttled  # the time selector would take it, were it not flagged
        assert throttled and max(measured) in throttled
        chosen = controller.locked_clock.value
        assert chosen is not None and chosen not in throttled
        assert gpu.settings() == (200.0, (chosen, chosen))
        flagged = {e["locked_clock_mhz"]: e for e in controller.profile() if e["throttled"]}
        assert set(flagged) == throttled
        assert all(e["sm_clock_mhz"] < c for c, e in flagged.items())  # measured below it
        controller.teardown()
        assert gpu.settings() == (200.0, None)
    finally:
        gpu.set_power_limit_w(PRE_JOB_W)


# ---------------------------------------------------------------- reports and summaries
def test_the_metrics_and_timeline_carry_the_locked_clock(tmp_path: Path) -> None:
    devices = _devices()
    config = _config(tmp_path).merged({"log_every_n_steps": 1})
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    _profile(controller)
    for _ in range(10):
        controller.on_step_start()
        controller.on_step_end()
    chosen = controller.locked_clock.value
    assert chosen is not None
    assert controller.metrics["energy/locked_clock_mhz"] == chosen
    assert controller.metrics["energy/power_limit_w"] == 0.0  # the limit is left alone
    timeline = controller.timeline
    assert timeline[0]["locked_clock_mhz"] is None  # the warm-up runs unlocked
    assert timeline[-1]["locked_clock_mhz"] == chosen
    profiled = {e["locked_clock_mhz"] for e in timeline} - {None}
    assert len(profiled) > 2  # the profiling windows' locks
    assert all(e["power_limit_w"] is None for e in timeline)
    controller.teardown()


def test_the_report_summary_and_figures_name_the_knob_and_the_chosen_clock(
    tmp_path: Path,
) -> None:
    from lightning_energy.integrations.adapter import format_summary
    from lightning_energy.plots import render_plots
    from lightning_energy.report import format_report, load_report, write_report

    devices = _devices()
    _sim(devices).set_power_limit_w(200.0)  # some locks are throttled under this cap
    try:
        controller = EnergyController(
            _config(tmp_path, selector="time"), devices=devices, install_signal_handlers=False
        )
        _profile(controller)
        for _ in range(5):
            controller.on_step_start()
            controller.on_step_end()
        chosen = controller.locked_clock.value
        summary = controller.teardown()
    finally:
        _sim(devices).set_power_limit_w(PRE_JOB_W)
    printed = format_summary(summary)
    assert "locked SM clock" in printed
    assert re.search(rf"locked clocks chosen\s+{chosen:.0f} MHz", printed)
    report = load_report(write_report(controller, tmp_path / "run.json"))
    assert report["summary"]["knob"] == "locked_clock"
    assert report["summary"]["locked_clock_mhz"] == chosen
    entries = report["profile"]
    assert all(set(e) >= {"locked_clock_mhz", "sm_clock_mhz", "throttled"} for e in entries)
    assert any(e["throttled"] for e in entries) and not all(e["throttled"] for e in entries)
    table = format_report(report)
    assert re.search(rf"locked clocks chosen\s+{chosen:.0f} MHz", table)
    assert "power limits chosen" not in table
    written = render_plots(report, tmp_path / "figures")
    assert {p.name for p in written} >= {"frontier.png"}


# ---------------------------------------------------------------- one owner of the clocks
def test_a_knob_holding_the_clocks_switches_the_clock_knob_off(tmp_path: Path) -> None:
    from lightning_energy.perseus.data_parallel import StragglerClocks

    devices = _devices()
    gpu = _sim(devices)
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    controller.setup()
    assert controller.setting is controller.locked_clock
    straggler = StragglerClocks()
    controller.add_knob(straggler)
    assert not controller.locked_clock.active
    assert controller.setting is controller.power_limit
    assert controller.paced_knob() is straggler
    assert [k.name for k in controller.knobs] == ["power_limit", "straggler_clocks"]
    for _ in range(60):
        controller.on_step_start()
        controller.on_step_end()
    assert gpu.settings() == (PRE_JOB_W, None)  # neither a lock nor a power limit of ours
    assert not [d for d in controller.decisions if d["kind"] in ("locked_clock", "power_limit")]
    controller.teardown()
    # The next run of this controller keeps the clocks to their owner.
    controller.setup()
    assert controller.setting is controller.power_limit
    controller.teardown()


def test_one_knob_holds_the_clocks_and_a_later_fits_knob_of_its_name_replaces_it(
    tmp_path: Path,
) -> None:
    from lightning_energy.kareus.data_parallel import DataParallelClock
    from lightning_energy.perseus.data_parallel import StragglerClocks

    devices = _devices()
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    controller.setup()
    first = StragglerClocks()
    controller.add_knob(first)
    with pytest.raises(ConfigError, match=r"straggler_clocks already holds the clocks"):
        controller.add_knob(DataParallelClock(1005))
    assert controller.knobs == [controller.power_limit, first]  # nothing registered
    assert _sim(devices).settings() == (PRE_JOB_W, None)  # nothing changed
    controller.teardown()
    controller.setup()  # the next fit registers its own knob of that name
    second = StragglerClocks()
    controller.add_knob(second)
    assert controller.knobs == [controller.power_limit, second]
    assert controller.paced_knob() is second
    controller.teardown()


def test_a_lock_already_applied_is_released_when_another_knob_takes_the_clocks(
    tmp_path: Path,
) -> None:
    from lightning_energy.perseus.data_parallel import StragglerClocks

    devices = _devices()
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    _profile(controller)
    controller.teardown()
    _sim(devices).idle(1.0)  # between fits (else the GPU still shows the last lock)
    controller.setup()  # a second fit: the known choice is locked at once
    assert _sim(devices).settings()[1] is not None
    controller.add_knob(StragglerClocks())
    assert _sim(devices).settings() == (PRE_JOB_W, None)
    controller.teardown()


# ---------------------------------------------------------------- the carbon pace
def test_the_carbon_pace_moves_the_locked_clock(tmp_path: Path) -> None:
    config = paced_config(tmp_path / "leases", knob="locked_clock", clock_step_mhz=150)
    (gpu,) = simulated_gpus(config.device.simulated_spec())
    devices = DeviceSet(gpus=[gpu], clock=gpu.clock.now, backend="simulated", run_step=gpu.run_step)
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    assert controller.paced_knob() is controller.locked_clock
    controller.set_total_steps(1200)
    for _ in range(1200):
        controller.on_step_start()
        controller.on_step_end()
    summary = controller.teardown()
    paced = [d for d in controller.decisions if "carbon pace" in d["reason"]]
    assert paced and {d["kind"] for d in paced} == {"locked_clock"}
    assert len({d["value"] for d in paced}) > 1  # the pace moved the clock with the grid
    assert not [d for d in controller.decisions if d["kind"] == "power_limit"]
    assert summary.carbon is not None and summary.carbon["deadline_met"] is True
    assert gpu.settings()[1] is None


@pytest.mark.parametrize("knob", ["auto", "locked_clock"])
def test_a_lock_refused_while_pacing_hands_the_pace_to_power_limits(
    tmp_path: Path, knob: str
) -> None:
    config = paced_config(
        tmp_path / "leases",
        knob=knob,
        selector="energy",
        clock_step_mhz=150,
        power_limits_w=[400, 350, 300, 250, 200, 150],
    )
    # Phased work: under auto the lock measures cheaper than every power limit and wins.
    spec = dataclasses.replace(config.device.simulated_spec(), step_phases=AUTO_MODELS["phased"][0])
    (gpu,) = simulated_gpus(spec)
    devices = DeviceSet(gpus=[gpu], clock=gpu.clock.now, backend="simulated", run_step=gpu.run_step)
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    controller.setup()
    controller.set_total_steps(1200)
    refused_from = None
    for step in range(1200):
        controller.on_step_start()
        controller.on_step_end()
        paced = [d for d in controller.decisions if "carbon pace" in d["reason"]]
        if refused_from is None and paced:
            assert {d["kind"] for d in paced} == {"locked_clock"}
            # The pace set a lock; from now on the driver refuses every lock.
            gpu.inject_fault("set_locked_clocks", NoPermissionError)
            refused_from = step + 1
    assert refused_from is not None
    assert not controller.locked_clock.active  # a later pace was refused
    assert controller.paced_knob() is controller.power_limit
    assert gpu.settings()[1] is None  # the lock in force was released
    later = [d for d in controller.decisions if d["step"] > refused_from]
    limits = [i for i, d in enumerate(later) if d["kind"] == "power_limit"]
    assert limits
    assert not [d for d in later[limits[0] :] if d["kind"] == "locked_clock"]
    # The pace moves the power limit from then on (once profiled, where only locks were).
    paced_limits = [d for d in later if d["kind"] == "power_limit" and "carbon pace" in d["reason"]]
    assert paced_limits
    assert controller.power_limit.value == paced_limits[-1]["value"]
    assert gpu.settings()[0] == paced_limits[-1]["value"]
    summary = controller.teardown()
    assert summary.carbon is not None
    if knob == "auto":  # power limits were profiled already (forced locks: a profile of
        # power limits runs mid-job, out of the slack the pace had planned with)
        assert summary.carbon["deadline_met"] is True
    assert gpu.settings() == (PRE_JOB_W, None)


def test_a_lock_refused_on_one_rank_while_pacing_moves_every_rank_to_power_limits(
    tmp_path: Path,
) -> None:
    from tests.lightning_energy.processes import free_port, run_module_ranks

    port = str(free_port())
    run_module_ranks(
        "tests.lightning_energy.paced_lock_worker",
        [[str(r), port, str(tmp_path), str(tmp_path / "leases")] for r in range(2)],
        tmp_path,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["refused_from"] is not None  # the pace moved the lock first
    assert not ranks[0]["locks_on"] and not ranks[1]["locks_on"]  # rank 1's refusal: both
    for rank in ranks:
        kinds = [d["kind"] for d in rank["decisions"] if "carbon pace" in d["reason"]]
        assert kinds[0] == "locked_clock" and kinds[-1] == "power_limit"
        assert rank["settings"][1] is None  # no lock left on either rank
        assert rank["restored"] == [PRE_JOB_W, None]
    # Both ranks ran the same settings from the fall-back on.
    assert [(d["kind"], d["value"]) for d in ranks[0]["decisions"]] == [
        (d["kind"], d["value"]) for d in ranks[1]["decisions"]
    ]


def test_the_clocks_power_limits_ran_at_are_candidates_once_limits_were_profiled(
    tmp_path: Path,
) -> None:
    devices = _devices()
    gpu = _sim(devices)
    config = _config(tmp_path, knob="power_limit", power_limits_w=[400, 350, 300, 250])
    controller = EnergyController(config, devices=devices, install_signal_handlers=False)
    _profile(controller)
    under_limits = controller.power_limit.average_clocks_mhz("default")
    assert sorted(under_limits) == [250.0, 300.0, 350.0, 400.0]
    controller.teardown()
    gpu.idle(1.0)
    # The next run of the job locks clocks: the clocks the limits ran at are candidates.
    controller.config = config.merged({"power_limit": {"knob": "locked_clock"}})
    controller.setup()
    assert controller.setting is controller.locked_clock
    candidates = controller.locked_clock.session.optimizer().power_limits_w
    grid = thin_clocks_mhz(gpu.supported_sm_clocks_mhz(), 150)
    supported = gpu.supported_sm_clocks_mhz()
    seeded = {float(min(supported, key=lambda c: abs(c - s))) for s in under_limits.values()}
    assert seeded - set(grid)  # some of them are off the thinned grid
    assert set(candidates) == set(grid) | seeded
    controller.teardown()


@pytest.mark.parametrize("warmup_steps", [0, 10])
def test_an_administrators_lock_is_never_replaced_and_power_limits_are_profiled(
    tmp_path: Path, warmup_steps: int
) -> None:
    devices = _devices(foreign_clock_lock_mhz=(1005, 1005))
    gpu = _sim(devices)
    controller = EnergyController(
        _config(tmp_path, knob="auto", warmup_steps=warmup_steps),
        devices=devices,
        install_signal_handlers=False,
    )
    for _ in range(40):
        controller.on_step_start()
        controller.on_step_end()
        assert gpu.foreign_clock_lock_mhz() == (1005, 1005)
    assert controller.setting is controller.power_limit
    assert not [d for d in controller.decisions if d["kind"] == "locked_clock"]
    assert [d for d in controller.decisions if d["kind"] == "power_limit"]
    controller.teardown()
    assert gpu.foreign_clock_lock_mhz() == (1005, 1005)


@pytest.mark.parametrize("huge", [10**400, -(10**400)])
def test_a_checkpoint_clock_no_float_holds_is_named(tmp_path: Path, huge: int) -> None:
    controller = EnergyController(
        _config(tmp_path), devices=_devices(), install_signal_handlers=False
    )
    _profile(controller)
    state = json.loads(json.dumps(controller.state_dict()))
    controller.teardown()
    state["locked_clock"]["sm_clocks_mhz"] = [["default", 1410.0, huge]]
    resumed = EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)
    resumed.setup()
    try:
        with pytest.raises(ProfileError, match="sm_clocks_mhz"):
            resumed.load_state_dict(state)
    finally:
        resumed.teardown()
