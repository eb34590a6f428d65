"""What ``EnergyFabricCallback`` may change in a Fabric loop, and what it never does.

It may add the values a loop logs from ``energy.metrics`` and, in a checkpoint the loop
saves, the entry it is saved under. It never breaks a loop that calls hooks for its other
callbacks (hooks before ``setup`` do nothing, with one warning; only a call whose data a
missing setup would lose raises), never stops a ``Fabric`` (or itself) from being pickled,
never keeps a ``Fabric`` alive after its run, and never changes the exceptions the loop
raises. A second run set up while one is open in the same process observes only and says
why; a run never ended is ended at interpreter exit with a message naming what ends it.
Real Fabric on CPU, a simulated A40.
"""

from __future__ import annotations

import gc
import json
import logging
import pickle
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.errors import EnergyError
from lightning_energy.integrations.fabric import EnergyFabricCallback
from tests.lightning_energy.integrations._models import energy_config

ROOT = Path(__file__).resolve().parents[3]


def _fabric(energy: EnergyFabricCallback) -> Any:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[energy])
    fabric.launch()
    return fabric


def _steps(fabric: Any, n: int) -> None:
    for _ in range(n):
        fabric.call("on_train_batch_start")
        fabric.call("on_train_batch_end")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------- hooks before setup
def test_hooks_before_setup_do_nothing_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    energy = EnergyFabricCallback(energy_config(tmp_path))
    fabric = _fabric(energy)
    with caplog.at_level(logging.WARNING, logger="lightning_energy"):
        _steps(fabric, 2)
        fabric.call("on_train_epoch_end")
        fabric.call("on_validation_start")
        fabric.call("on_exception", RuntimeError("the loop's own"))
    (warning,) = _warnings(caplog)
    assert "before EnergyFabricCallback.setup(fabric)" in warning
    assert energy.controller is None and not energy.running and energy.summary is None
    assert energy.teardown() is None


def test_declaring_a_workload_before_setup_raises_since_it_would_be_lost(tmp_path: Path) -> None:
    energy = EnergyFabricCallback(energy_config(tmp_path))
    with pytest.raises(EnergyError, match=r"setup\(fabric\)"):
        energy.set_workload("batch_size=8,params=10")


# ---------------------------------------------------------------------- pickling, lifetime
def test_the_callback_and_its_fabric_pickle_at_every_point_of_a_run(tmp_path: Path) -> None:
    energy = EnergyFabricCallback(energy_config(tmp_path))
    fabric = _fabric(energy)
    copies = [pickle.loads(pickle.dumps(energy))]
    energy.setup(fabric)
    _steps(fabric, 7)
    copies.append(pickle.loads(pickle.dumps(energy)))
    pickle.loads(pickle.dumps(fabric))
    summary = energy.teardown()
    copies.append(pickle.loads(pickle.dumps(energy)))
    pickle.loads(pickle.dumps(fabric))
    for copy in copies:  # the configuration travels; the run, its GPUs and lease stay here
        assert copy.config == energy.config
        assert copy.controller is None and not copy.running
    assert copies[-1].summary == summary is not None


def test_a_fabric_is_freed_once_its_run_ended(tmp_path: Path) -> None:
    energy = EnergyFabricCallback(energy_config(tmp_path))
    fabric = _fabric(energy)
    energy.setup(fabric)
    with energy:
        _steps(fabric, 7)
    gone = weakref.ref(fabric)
    del fabric
    gc.collect()
    assert gone() is None
    assert energy.summary is not None and energy.summary.steps == 7


# ---------------------------------------------------------------------- exceptions
def test_an_exception_in_the_loop_reaches_the_caller_as_it_was_raised(tmp_path: Path) -> None:
    energy = EnergyFabricCallback(energy_config(tmp_path))
    fabric = _fabric(energy)
    energy.setup(fabric)
    error = KeyError("raised by the loop")
    with pytest.raises(KeyError) as raised, energy:
        _steps(fabric, 7)
        raise error
    assert raised.value is error
    assert energy.summary is not None and not energy.running


# ---------------------------------------------------------------------- runs of one process
def test_a_second_run_while_the_first_is_open_observes_and_names_the_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = energy_config(tmp_path)
    config["device"]["state_dir"] = str(tmp_path / "gpus")  # one GPU, with a lease
    first = EnergyFabricCallback(config)
    second = EnergyFabricCallback(config)
    first.setup(_fabric(first))
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_energy"):
            fabric = _fabric(second)
            second.setup(fabric)
        with second:
            assert second.controller is not None and second.controller.observe_only
            _steps(fabric, 7)
    finally:
        first.teardown()
    (warning,) = _warnings(caplog)
    assert "EnergyFabricCallback" in warning and "this process" in warning
    assert "`with energy:`" in warning and "`energy.teardown()`" in warning
    assert "another job" not in warning
    assert second.summary is not None and second.summary.observe_only


_NEVER_ENDED = """
import json, logging, sys
from lightning.fabric import Fabric
from lightning_energy.integrations.fabric import EnergyFabricCallback

logging.basicConfig(level=logging.WARNING)
energy = EnergyFabricCallback(json.loads(sys.argv[1]))
fabric = Fabric(accelerator="cpu", devices=1, callbacks=[energy])
fabric.launch()
energy.setup(fabric)
for _ in range(12):
    fabric.call("on_train_batch_start")
    fabric.call("on_train_batch_end")
print(json.dumps({"power_limit_w": energy.controller.current_power_limit_w()}))
"""


def test_a_run_never_ended_is_ended_at_exit_naming_what_ends_it(tmp_path: Path) -> None:
    config = energy_config(tmp_path, report=str(tmp_path / "report.json"))
    config["device"]["state_dir"] = str(tmp_path / "gpus")  # the GPU outlives the process
    out = subprocess.run(
        [sys.executable, "-c", _NEVER_ENDED, json.dumps(config)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["power_limit_w"] < 300.0  # changed when the script ended
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, out.stderr[-3000:]
    assert "EnergyFabricCallback" in warnings[0] and "never ended" in warnings[0]
    assert "`with energy:`" in warnings[0] and "`energy.teardown()`" in warnings[0]
    assert "GPUGuard" not in warnings[0]
    (state,) = (tmp_path / "gpus").glob("*.json")
    assert json.loads(state.read_text())["power_limit_w"] == 300.0
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["steps"] == 12
