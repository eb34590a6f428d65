"""The controller's typed events and the step result adapters read, on a simulated A40."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import (
    CheckpointLoad,
    CheckpointSave,
    End,
    EnergyController,
    Interruption,
    StepEnd,
    StepResult,
    StepStart,
)
from lightning_energy.controller.windows import WINDOW
from lightning_energy.device import DeviceSet, SimulatedSpec, simulated_gpus
from lightning_energy.errors import CheckpointMismatchError, EnergyError
from lightning_energy.optimize.recurring import BatchSizeKnob

LOG_EVERY = 10


def _config(tmp_path: Path) -> EnergyConfig:
    return EnergyConfig.from_mapping(
        {
            "device": {"backend": "simulated", "lease_dir": str(tmp_path / "leases")},
            "power_limit": {
                "power_limits_w": [300, 250, 200, 150],
                "warmup_steps": 2,
                "settle_steps": 1,
            },
            "log_every_n_steps": LOG_EVERY,
        }
    )


def _devices() -> DeviceSet:
    gpus = simulated_gpus(SimulatedSpec(gpu="a40", steps_per_epoch=100))
    return DeviceSet(
        gpus=gpus,
        clock=gpus[0].clock.now,
        backend="simulated",
        run_step=lambda: [g.run_step() for g in gpus],
    )


def _controller(tmp_path: Path) -> EnergyController:
    return EnergyController(_config(tmp_path), devices=_devices(), install_signal_handlers=False)


def _step(controller: EnergyController) -> tuple[StepResult, StepResult]:
    return controller.handle(StepStart()), controller.handle(StepEnd())


def test_metrics_are_returned_exactly_when_a_logging_interval_closes(tmp_path: Path) -> None:
    controller = _controller(tmp_path)
    fresh_at = []
    try:
        for step in range(1, 5 * LOG_EVERY + 1):
            start, end = _step(controller)
            assert start.metrics is None
            if end.metrics is not None:
                fresh_at.append(step)
                assert end.metrics == controller.metrics
                assert end.metrics["energy/total_j"] > 0
        # Every LOG_EVERY steps, and when the profile completes: at each timeline entry.
        assert fresh_at == [entry["step"] for entry in controller.timeline]
        gaps = [b - a for a, b in zip([0, *fresh_at], fresh_at, strict=False)]
        assert fresh_at[0] == LOG_EVERY and max(gaps) == LOG_EVERY and min(gaps) < LOG_EVERY
    finally:
        controller.handle(End())


def test_decisions_are_returned_by_the_event_that_made_them(tmp_path: Path) -> None:
    controller = _controller(tmp_path)
    returned = []
    try:
        for _ in range(150):
            start, end = _step(controller)
            returned += [*start.decisions, *end.decisions]
        assert controller.profile_done
        assert returned == controller.decisions
        assert {d["purpose"] for d in returned} == {"profile", "choice"}
        assert returned[-1]["value"] == controller.current_power_limit_w()
    finally:
        controller.handle(End())


def test_a_knob_records_its_own_decision_and_one_leaving_the_clocks_is_not_paced(
    tmp_path: Path,
) -> None:
    controller = _controller(tmp_path)
    controller.setup()
    try:
        knob = BatchSizeKnob(64)
        with pytest.raises(EnergyError, match="register the knob first"):
            controller.record(knob, knob.decision(), "chosen")
        assert controller.decisions == []
        controller.add_knob(knob)
        controller.record(knob, knob.decision(), "chosen")
        (decision,) = controller.decisions
        assert (decision["kind"], decision["value"], decision["purpose"]) == (
            "batch_size",
            64.0,
            "choice",
        )
        assert decision["step"] == 0 and decision["reason"] == "chosen"
        # It leaves the clocks alone: the power limits are still profiled and paced.
        assert controller.paced_knob() is controller.power_limit
        assert controller.power_limit.profiling_off is None
        for _ in range(150):
            _step(controller)
        assert controller.profile_done
    finally:
        controller.handle(End())


def test_an_interruption_pauses_the_window_and_leaves_out_what_runs_meanwhile(
    tmp_path: Path,
) -> None:
    devices = _devices()
    gpu = devices.gpus[0]
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    try:
        while not controller.power_limit.session.measuring:  # warm-up, settling, then measuring
            _step(controller)
        _step(controller)
        window = controller.power_limit.session.window
        before = controller._ledger.readings.peek(WINDOW)
        result = controller.handle(Interruption("validation"))
        assert result.metrics is None and result.decisions == ()
        gpu.idle(30.0)  # validation: half a minute the window must not count
        start = controller.handle(StepStart())
        assert start.decisions == ()  # the same window goes on: nothing retried or re-applied
        assert controller.power_limit.session.window == window
        resumed = controller._ledger.readings.peek(WINDOW)
        assert before is not None and resumed is not None
        assert resumed.duration_s == pytest.approx(before.duration_s)
        assert resumed.energy_j == pytest.approx(before.energy_j, abs=1.0)
        controller.handle(StepEnd())
    finally:
        controller.handle(End())


def test_checkpoint_events_carry_the_state_and_resume_without_profiling(
    tmp_path: Path,
) -> None:
    first = _controller(tmp_path)
    for _ in range(150):
        _step(first)
    state = first.handle(CheckpointSave()).state
    chosen = first.current_power_limit_w()
    first.handle(End())
    assert state is not None and state["steps"] == 150

    second = _controller(tmp_path)
    try:
        second.setup()
        result = second.handle(CheckpointLoad(state))
        assert [(d["kind"], d["value"]) for d in result.decisions] == [("power_limit", chosen)]
        assert second.profile_done and second.steps == 150
        with pytest.raises(CheckpointMismatchError, match="version"):
            second.handle(CheckpointLoad({**state, "version": 99}))
    finally:
        second.handle(End())


def test_end_restores_first_and_returns_the_summary_once(tmp_path: Path) -> None:
    devices = _devices()
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    for _ in range(12):  # a profiling window below the pre-job limit is applied
        _step(controller)
    assert devices.gpus[0].power_limit_w() < 300.0
    summary = controller.handle(End()).summary
    assert summary is not None and summary.steps == 12
    assert devices.gpus[0].power_limit_w() == 300.0
    assert controller.handle(End()).summary is summary
    assert controller.handle(StepEnd()) == StepResult()  # ignored until another setup
