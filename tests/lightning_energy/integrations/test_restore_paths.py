"""Restore first, on every exit path: failed readings at teardown or mid-run, SIGTERM
mid-step under Lightning, SIGTERM during a carbon pause.

Real Lightning fits and controllers on the simulated A40 (CPU), with the simulated GPU's
fault injection standing in for NVML reads that fail. The conftest leak check also fails
a test that leaves a GPU changed, a thread running or a signal handler behind.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import SimulatedGPU, SimulatedSpec, open_devices
from lightning_energy.errors import DriverError, GPULostError
from lightning_energy.integrations.adapter import format_summary
from lightning_energy.report import build_report, format_report
from tests.lightning_energy.integrations._models import (
    energy_config,
    make_loader,
    module_class,
)

PRE_JOB_W = 300.0  # the simulated A40's default limit


def _simulated_gpu(controller: EnergyController | None) -> SimulatedGPU:
    """The first GPU of a run of these tests (a simulated A40)."""
    assert controller is not None
    gpu = controller.devices.gpus[0]
    assert isinstance(gpu, SimulatedGPU)
    return gpu


def _controller(tmp_path: Path) -> tuple[EnergyController, SimulatedGPU]:
    devices = open_devices("simulated", simulated=SimulatedSpec(gpu="a40", steps_per_epoch=100))
    controller = EnergyController(
        EnergyConfig.from_mapping(energy_config(tmp_path)),
        devices=devices,
        install_signal_handlers=False,
    )
    return controller, _simulated_gpu(controller)


def _steps(controller: EnergyController, n: int) -> None:
    for _ in range(n):
        controller.on_step_start()
        controller.on_step_end()


@pytest.mark.parametrize(
    ("operation", "error"), [("energy", GPULostError), ("synchronize", DriverError)]
)
def test_teardown_restores_before_reading_and_survives_a_failed_read(
    operation: str, error: type, tmp_path: Path
) -> None:
    controller, gpu = _controller(tmp_path)
    controller.setup()
    _steps(controller, 12)  # inside the profile: a candidate below the pre-job limit applies
    assert gpu.power_limit_w() < PRE_JOB_W
    gpu.inject_fault(operation, error)
    summary = controller.teardown()
    assert gpu.settings() == (PRE_JOB_W, None)
    assert summary.read_error is not None and summary.steps == 12
    assert controller.teardown() is summary


def test_a_read_failing_mid_run_restores_and_training_goes_on(tmp_path: Path) -> None:
    controller, gpu = _controller(tmp_path)
    controller.setup()
    _steps(controller, 12)
    assert gpu.power_limit_w() < PRE_JOB_W
    gpu.inject_fault("energy", GPULostError, times=1)
    _steps(controller, 60)  # no exception: training continues
    assert gpu.power_limit_w() == PRE_JOB_W  # restored at the failure, never changed again
    assert controller.metrics == {}  # missing, not stale
    assert not controller.profile_done
    summary = controller.teardown()
    assert summary.read_error is not None and summary.steps == 72

    # The GPU reads again: the next run in the same process optimises again.
    controller.setup()
    _steps(controller, 160)
    assert controller.profile_done
    assert controller.current_power_limit_w() == gpu.power_limit_w() < PRE_JOB_W
    again = controller.teardown()
    assert again.read_error is None and again.steps == 160
    assert gpu.settings() == (PRE_JOB_W, None)


def test_a_read_failing_after_the_profile_restores_at_once(tmp_path: Path) -> None:
    controller, gpu = _controller(tmp_path)
    controller.setup()
    _steps(controller, 160)
    assert controller.profile_done and gpu.power_limit_w() < PRE_JOB_W
    gpu.inject_fault("energy", GPULostError, times=1)  # no profiling window is open
    _steps(controller, 1)
    assert gpu.power_limit_w() == PRE_JOB_W and controller.observe_only
    _steps(controller, 9)  # the GPU reads again: nothing is changed nor measured any more
    assert gpu.power_limit_w() == PRE_JOB_W and controller.metrics == {}
    summary = controller.teardown()
    assert summary.read_error is not None and summary.steps == 170
    # What is printed says so: limits were set and restored, the energy is incomplete and
    # the savings unknown (not 0), in the logged summary and in the report's table.
    for table in (format_summary(summary), format_report(build_report(controller))):
        rows = dict(re.findall(r"^\s*(\S.*?)\s{2,}(.*)$", table, flags=re.M))
        assert "failed mid-run, energy incomplete" in rows["GPU readings"], table
        assert "could not be changed" not in table and "settings unchanged" not in table
        assert "restored" in rows["mode"], table
        saved = next(v for k, v in rows.items() if k.startswith("energy saved"))
        slowdown = next(v for k, v in rows.items() if k.startswith("slowdown"))
        assert saved.strip().startswith("not measured") and slowdown.strip().startswith(
            "not measured"
        ), table


def test_lightning_fit_survives_a_read_failing_mid_run(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    energy = EnergyCallback(energy_config(tmp_path))
    seen: dict[str, float] = {}

    class FailReads(ns.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
            gpu = _simulated_gpu(energy.controller)
            if trainer.global_step == 12:
                seen["before"] = gpu.power_limit_w()
                gpu.inject_fault("power", GPULostError)  # no energy counter: power fails too
                gpu.inject_fault("energy", GPULostError)
            if trainer.global_step == 13:
                seen["after"] = gpu.power_limit_w()

    trainer = ns.Trainer(
        max_steps=80,
        accelerator="cpu",
        devices=1,
        callbacks=[FailReads(), energy],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(module_class(ns)(), make_loader())
    assert trainer.global_step == 80
    assert seen["before"] < PRE_JOB_W and seen["after"] == PRE_JOB_W
    assert energy.summary is not None and energy.summary.read_error is not None
    assert _simulated_gpu(energy.controller).settings() == (PRE_JOB_W, None)


def test_sigterm_under_lightning_restores_while_the_step_runs(tmp_path: Path) -> None:
    import lightning.pytorch as ns
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_energy.integrations.lightning import EnergyCallback

    energy = EnergyCallback(energy_config(tmp_path))
    seen: dict[str, float] = {}

    class Terminated(module_class(ns)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.global_step == 12:
                gpu = _simulated_gpu(energy.controller)
                seen["before"] = gpu.power_limit_w()
                os.kill(os.getpid(), signal.SIGTERM)  # handled before the next bytecode
                seen["during_step"] = gpu.power_limit_w()
            return super().training_step(batch, batch_idx)

    trainer = ns.Trainer(
        max_steps=80,
        accelerator="cpu",
        devices=1,
        callbacks=[energy],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    with pytest.raises(SIGTERMException):  # Lightning still handles the signal its way
        trainer.fit(Terminated(), make_loader())
    assert seen["before"] < PRE_JOB_W
    assert seen["during_step"] == PRE_JOB_W
    assert trainer.global_step == 13  # Lightning stopped at the next batch boundary
    assert energy.summary is not None


def test_sigterm_during_a_carbon_pause_restores_and_ends_the_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from lightning_energy.device.base import DeviceSet
    from lightning_energy.pacing import PaceUpdate

    gpus = open_devices("simulated", simulated=SimulatedSpec(gpu="a40")).gpus
    # A real clock and no simulated step: the pause really waits between polls.
    devices = DeviceSet(gpus=gpus, clock=time.monotonic, backend="nvml")
    config = energy_config(
        tmp_path, carbon={"provider": "constant", "region": "test", "poll_interval_s": 20}
    )
    controller = EnergyController(EnergyConfig.from_mapping(config), devices=devices)
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    gpu = gpus[0]
    assert isinstance(gpu, SimulatedGPU)
    lowest_w = gpu.power_limit_constraints_w()[0]
    pausing = PaceUpdate(400.0, None, True, "dirty grid")
    updates = [pausing, pausing, pausing]  # the policy would pause for three more polls

    def next_update(*, paused: bool = False) -> PaceUpdate | None:
        return updates.pop() if updates else None

    def terminate_once_paused() -> None:
        while gpu.power_limit_w() != lowest_w:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_once_paused, name="test-sigterm")
    try:
        controller.setup()
        pacing = controller._pacing
        assert pacing is not None
        monkeypatch.setattr(pacing, "_update", next_update)
        killer.start()
        pacing._pause(pausing)
        killer.join()
        assert received == [signal.SIGTERM]  # handed on to the handler found
        assert gpu.settings() == (PRE_JOB_W, None)
        assert len(updates) >= 2  # the pause ended at the signal, not when the policy said
    finally:
        controller.teardown()
        signal.signal(signal.SIGTERM, previous)


def test_a_report_that_cannot_be_written_never_hides_the_training_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback
    from tests.lightning_energy.integrations._models import quiet_trainer

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    callback = EnergyCallback(energy_config(tmp_path, report=str(blocked / "run.json")))
    trainer = quiet_trainer(ns, callback, tmp_path, 20)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer.fit(module_class(ns)(fail_at_step=5), make_loader())
    gpu = callback.controller.devices.gpus[0] if callback.controller else None
    assert gpu is not None and gpu.power_limit_w() == PRE_JOB_W
    assert any("report could not be written" in r.getMessage() for r in caplog.records)
