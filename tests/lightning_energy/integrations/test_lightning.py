"""EnergyCallback / EnergyStrategy on a real Lightning fit, with simulated GPUs on CPU."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.device import SimulatedSpec, TraceModel
from lightning_energy.errors import CheckpointMismatchError, ConfigError
from tests.lightning_energy.integrations._models import make_loader, module_class, quiet_trainer
from tests.lightning_energy.processes import run_launch

ROOT = Path(__file__).resolve().parents[3]

CANDIDATES = [300.0, 250.0, 200.0, 150.0, 100.0]


def _energy_config(tmp_path: Path, selector: str = "energy", **extra: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "selector": selector,
        "power_limits_w": CANDIDATES,
        "warmup_steps": 2,
        "settle_steps": 1,
    }
    section.update(extra)
    return {
        # 100 steps an epoch: ~37 s steps, each longer than a profiling window must last.
        "device": {
            "backend": "simulated",
            "gpu": "a40",
            "steps_per_epoch": 100,
            "lease_dir": str(tmp_path / "leases"),
        },
        "power_limit": section,
        "log_every_n_steps": 5,
    }


def _brute_force(selector: str) -> float:
    """The optimum over CANDIDATES computed from the noiseless A40 trace."""
    from lightning_energy.optimize.selectors import Measurement, make_selector

    model = SimulatedSpec(gpu="a40", steps_per_epoch=100).model()
    assert isinstance(model, TraceModel)
    steps = model.steps_per_epoch
    profile = [
        Measurement(
            power_limit_w=p,
            time_per_step_s=model.workload.time_per_epoch_s(p) / steps,
            energy_per_step_j=model.workload.time_per_epoch_s(p)
            * model.workload.average_power_w(p)
            / steps,
            steps=40,
        )
        for p in CANDIDATES
    ]
    kwargs: dict[str, Any] = {"eta": 0.5} if selector == "cost" else {}
    if selector == "max_slowdown":
        kwargs = {"max_slowdown": 1.1}
    chosen = make_selector(selector, **kwargs).select(
        profile, max_power_limit_w=max(CANDIDATES), num_gpus=1
    )
    return chosen.power_limit_w


def _fit(ns: Any, callback: Any, tmp_path: Path, *, steps: int = 160, **trainer_kw: Any) -> Any:
    model = module_class(ns)(**trainer_kw.pop("model_kw", {}))
    ckpt_path = trainer_kw.pop("ckpt_path", None)
    trainer = ns.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **trainer_kw,
    )
    trainer.fit(model, make_loader(), make_loader(n=32), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(params=["lightning.pytorch", "pytorch_lightning"])
def namespace(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """Both Lightning namespaces with their own EnergyCallback."""
    ns = importlib.import_module(request.param)
    integ = importlib.import_module(
        "lightning_energy.integrations."
        + ("lightning" if request.param == "lightning.pytorch" else "pytorch_lightning")
    )
    return ns, integ


@pytest.mark.parametrize("selector", ["energy", "time", "cost", "max_slowdown"])
def test_callback_chooses_the_brute_force_optimum(
    selector: str, namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    ns, integ = namespace
    extra = {"eta": 0.5} if selector == "cost" else {}
    callback = integ.EnergyCallback(_energy_config(tmp_path, selector, **extra))
    _fit(ns, callback, tmp_path, enable_checkpointing=False, num_sanity_val_steps=0)
    assert callback.summary is not None
    assert callback.summary.power_limit_w == _brute_force(selector)
    # Restored to the pre-job limit once training ended.
    gpu = callback.controller.devices.gpus[0]
    assert gpu.power_limit_w() == callback.summary.pre_job_power_limit_w


def test_validation_mid_profile_is_discarded_and_retried(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    callback = EnergyCallback(_energy_config(tmp_path, "energy"))
    _fit(ns, callback, tmp_path, val_check_interval=7, enable_checkpointing=False)
    controller = callback.controller
    assert controller is not None
    assert callback.summary is not None
    assert callback.summary.power_limit_w == _brute_force("energy")
    # Every candidate was measured even though validation interrupted windows.
    assert sorted(m["power_limit_w"] for m in controller.profile()) == sorted(CANDIDATES)


def test_validation_inside_fit_is_left_out_of_every_window(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    """Lightning runs validation during ``fit`` with ``trainer.training`` False (its stage
    is already ``validating``): the window in progress must still pause, or validation's
    GPU time and energy are charged to the limit being measured."""
    ns, integ = namespace
    callback = integ.EnergyCallback(_energy_config(tmp_path, "energy"))

    class HeavyValidation(module_class(ns)):  # type: ignore[misc]
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            callback.controller.devices.run_step()  # the GPU is as busy as in training
            super().validation_step(batch, batch_idx)

    trainer = quiet_trainer(ns, callback, tmp_path, 160, val_check_interval=7)
    trainer.fit(HeavyValidation(), make_loader(), make_loader(n=32))
    _assert_profile_is_the_workloads(callback.controller.profile())


def _assert_profile_is_the_workloads(profile: list[dict[str, float]]) -> None:
    """Every candidate measured at the noiseless A40 trace's own step time and energy."""
    model = SimulatedSpec(gpu="a40", steps_per_epoch=100).model()
    assert isinstance(model, TraceModel)
    assert sorted(m["power_limit_w"] for m in profile) == sorted(CANDIDATES)
    for m in profile:
        epoch_s = model.workload.time_per_epoch_s(m["power_limit_w"])
        energy_j = epoch_s * model.workload.average_power_w(m["power_limit_w"])
        assert m["time_per_step_s"] == pytest.approx(epoch_s / model.steps_per_epoch, rel=0.01)
        assert m["energy_per_step_j"] == pytest.approx(energy_j / model.steps_per_epoch, rel=0.01)


def test_checkpoints_written_during_profiling_are_left_out_of_every_window(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    """``ModelCheckpoint(every_n_train_steps=...)`` writes after the step has ended, in
    the gap the window measures (data loading): the write is not training."""
    ns, integ = namespace
    callback = integ.EnergyCallback(_energy_config(tmp_path, "energy"))

    class SlowCheckpoint(module_class(ns)):  # type: ignore[misc]
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            callback.controller.devices.gpus[0].idle(60.0)  # a large model to disk

    checkpoints = ns.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)
    trainer = quiet_trainer(
        ns, callback, tmp_path, 120, callbacks=[callback, checkpoints], enable_checkpointing=True
    )
    trainer.fit(SlowCheckpoint(), make_loader())
    _assert_profile_is_the_workloads(callback.controller.profile())


def test_resume_from_checkpoint_does_not_profile_again(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    cfg = _energy_config(tmp_path, "energy")
    first = EnergyCallback(cfg)
    trainer = _fit(ns, first, tmp_path, steps=160, num_sanity_val_steps=0)
    ckpt = tmp_path / "energy.ckpt"
    trainer.save_checkpoint(ckpt)
    chosen = first.summary.power_limit_w if first.summary else None

    second = EnergyCallback(cfg)
    _fit(ns, second, tmp_path, steps=200, num_sanity_val_steps=0, ckpt_path=str(ckpt))
    controller = second.controller
    assert controller is not None
    windows = [d for d in controller.decisions if "window" in d["reason"]]
    assert windows == []
    assert second.summary is not None and second.summary.power_limit_w == chosen


def test_exception_in_training_step_restores_pre_job_limit(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    callback = EnergyCallback(_energy_config(tmp_path, "energy"))
    with pytest.raises(RuntimeError, match="boom"):
        _fit(ns, callback, tmp_path, model_kw={"fail_at_step": 40}, num_sanity_val_steps=0)
    controller = callback.controller
    assert controller is not None
    # The failure happened mid-profile, at a lowered limit; it is back to the pre-job one.
    assert any(d["value"] is not None and d["value"] < 300 for d in controller.decisions)
    assert controller.devices.gpus[0].power_limit_w() == 300.0


def test_checkpoint_from_another_gpu_model_is_refused(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    cfg = _energy_config(tmp_path, "energy")
    first = EnergyCallback(cfg)
    trainer = _fit(ns, first, tmp_path, steps=20, num_sanity_val_steps=0)
    ckpt = tmp_path / "a40.ckpt"
    trainer.save_checkpoint(ckpt)
    other = dict(cfg, device=dict(cfg["device"], gpu="v100"))
    other["power_limit"] = dict(cfg["power_limit"], power_limits_w=[250.0, 200.0])
    second = EnergyCallback(other)
    with pytest.raises(CheckpointMismatchError, match="A40"):
        _fit(ns, second, tmp_path, steps=30, num_sanity_val_steps=0, ckpt_path=str(ckpt))


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"selector": "fastest"}, "fastest"),
        ({"selector": "cost", "eta": 1.5}, "eta"),
        ({"selector": "max_slowdown", "max_slowdown": 0.9}, "max_slowdown"),
    ],
)
def test_bad_configuration_fails_before_training(section: dict[str, Any], needle: str) -> None:
    from lightning_energy.integrations.lightning import EnergyCallback

    with pytest.raises(ConfigError, match=needle):
        EnergyCallback(power_limit=section)


def test_power_limits_outside_the_gpu_range_fail_before_any_change(tmp_path: Path) -> None:
    import lightning.pytorch as ns

    from lightning_energy.integrations.lightning import EnergyCallback

    cfg = _energy_config(tmp_path, "energy")
    cfg["power_limit"]["power_limits_w"] = [300.0, 50.0]
    callback = EnergyCallback(cfg)
    with pytest.raises(ConfigError, match="50"):
        _fit(ns, callback, tmp_path, steps=5)


def test_strategy_by_name_attaches_the_callback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as ns
    import yaml

    import lightning_energy.integrations.lightning as integ

    path = tmp_path / "energy.yaml"
    path.write_text(yaml.safe_dump(_energy_config(tmp_path, "time")))
    monkeypatch.setenv("LIGHTNING_ENERGY_CONFIG", str(path))
    model = module_class(ns)()
    trainer = ns.Trainer(
        max_steps=40,
        strategy="energy_single_device",
        callbacks=[],
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    # The entry point added one callback from the env var; the strategy adds none more.
    assert isinstance(trainer.strategy, integ.EnergySingleDeviceStrategy)
    trainer.fit(model, make_loader())
    callbacks = [c for c in trainer.callbacks if isinstance(c, integ.EnergyCallback)]  # type: ignore[attr-defined]
    assert len(callbacks) == 1
    assert callbacks[0].summary is not None


def test_entry_point_adds_callback_only_when_env_var_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as ns
    import yaml

    from lightning_energy.integrations.lightning import EnergyCallback

    monkeypatch.delenv("LIGHTNING_ENERGY_CONFIG", raising=False)
    trainer = ns.Trainer(logger=False, enable_checkpointing=False)
    assert not any(isinstance(c, EnergyCallback) for c in trainer.callbacks)  # type: ignore[attr-defined]
    path = tmp_path / "energy.yaml"
    path.write_text(yaml.safe_dump(_energy_config(tmp_path, "cost")))
    monkeypatch.setenv("LIGHTNING_ENERGY_CONFIG", str(path))
    trainer = ns.Trainer(logger=False, enable_checkpointing=False)
    assert sum(isinstance(c, EnergyCallback) for c in trainer.callbacks) == 1  # type: ignore[attr-defined]


def test_entry_point_with_a_missing_file_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as ns

    monkeypatch.setenv("LIGHTNING_ENERGY_CONFIG", "/nonexistent/energy.yaml")
    with pytest.raises(ConfigError, match=r"/nonexistent/energy\.yaml"):
        ns.Trainer(logger=False)


@pytest.mark.parametrize(
    ("module", "other"),
    [
        ("lightning_energy.integrations.pytorch_lightning", "lightning.pytorch"),
        ("lightning_energy.integrations.lightning", "pytorch_lightning"),
    ],
)
def test_importing_one_namespace_does_not_import_the_other(module: str, other: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.import_probe", "--prefix", other, module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize(
    "module",
    ["lightning_energy.integrations.lightning", "lightning_energy.integrations.pytorch_lightning"],
)
def test_importing_a_namespace_loads_no_store_until_a_batch_size_callback_is_built(
    module: str,
) -> None:
    """The module defines the batch-size callback beside the energy callback, but a job
    using the energy callback alone loads no store or database driver (GPU machines
    calibrating without them, and import time)."""
    prefixes = [
        "lightning_energy.store",
        "lightning_energy.optimize.recurring",
        "sqlalchemy",
        "platformdirs",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "tests.import_probe", *(f"--prefix={p}" for p in prefixes), module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_fabric_loop(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    from lightning_energy.integrations.fabric import EnergyFabricCallback

    energy = EnergyFabricCallback(_energy_config(tmp_path, "energy"))
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[energy])
    fabric.launch()
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    energy.setup(fabric)
    try:
        for _ in range(6):
            for x, y in make_loader():
                fabric.call("on_train_batch_start")
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                fabric.backward(loss)
                optimizer.step()
                fabric.call("on_train_batch_end")
            fabric.call("on_validation_start")
        fabric.save(tmp_path / "fabric.ckpt", {"energy": energy})
    finally:
        summary = energy.teardown()
    assert summary is not None and summary.power_limit_w == _brute_force("energy")
    restored = EnergyFabricCallback(_energy_config(tmp_path, "energy"))
    restored.setup(fabric)
    try:
        fabric.load(tmp_path / "fabric.ckpt", {"energy": restored})
        assert restored.controller is not None and restored.controller.profile_done
    finally:
        restored.teardown()


@pytest.mark.slow
def test_two_process_ddp_picks_one_limit_on_all_ranks(tmp_path: Path) -> None:
    cfg = _energy_config(tmp_path, "energy")
    # Rank 1 is a straggler: job time is the slowest rank's, energy the sum of both.
    cfg["device"]["slowdowns"] = [1.0, 1.3]
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        ENERGY_CFG=json.dumps(cfg),
        OUT_DIR=str(tmp_path),
        PL_DISABLE_FORK="1",
    )
    worker = "tests.lightning_energy.integrations.ddp_strategy_worker"
    out = run_launch([sys.executable, "-m", worker], env=env, timeout_s=240)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["power_limit_w"] == ranks[1]["power_limit_w"] is not None
    # Both ranks hold the same job-wide profile (aggregated with the strategy's collectives).
    assert ranks[0]["profile"] == ranks[1]["profile"]


def test_exception_in_training_restores_and_writes_the_report(
    namespace: tuple[Any, Any], tmp_path: Path
) -> None:
    ns, integ = namespace
    report = tmp_path / "report.json"
    callback = integ.EnergyCallback({**_energy_config(tmp_path, "energy"), "report": str(report)})
    with pytest.raises(RuntimeError, match="boom"):
        _fit(ns, callback, tmp_path, model_kw={"fail_at_step": 40}, num_sanity_val_steps=0)
    controller = callback.controller
    assert controller is not None and not callback.running
    assert any(d["value"] is not None and d["value"] < 300 for d in controller.decisions)
    assert controller.devices.gpus[0].power_limit_w() == 300.0
    written = json.loads(report.read_text())
    assert written["summary"]["steps"] == controller.steps == 40
    assert "job" not in written  # no collective on an exception path: another rank may be gone


def _fabric_loop(fabric: Any, energy: Any, batches: int, fail_below_w: float | None) -> None:
    for _ in range(batches):
        fabric.call("on_train_batch_start")
        fabric.call("on_train_batch_end")
        limit_w = energy.controller.current_power_limit_w()
        if fail_below_w is not None and limit_w is not None and limit_w < fail_below_w:
            raise RuntimeError("boom")


def test_fabric_exception_in_the_with_block_restores_and_writes_the_report(
    tmp_path: Path,
) -> None:
    from lightning.fabric import Fabric

    from lightning_energy.integrations.fabric import EnergyFabricCallback

    report = tmp_path / "report.json"
    energy = EnergyFabricCallback({**_energy_config(tmp_path, "energy"), "report": str(report)})
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[energy])
    fabric.launch()
    energy.setup(fabric)
    with pytest.raises(RuntimeError, match="boom"), energy:
        _fabric_loop(fabric, energy, 100, fail_below_w=300.0)
    assert energy.controller is not None and not energy.running
    assert energy.controller.devices.gpus[0].power_limit_w() == 300.0
    assert energy.summary is not None and energy.teardown() is energy.summary
    written = json.loads(report.read_text())
    assert written["summary"]["steps"] == energy.controller.steps > 0
    assert "job" not in written


def test_fabric_state_loaded_before_setup_is_resumed_at_setup(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    from lightning_energy.integrations.fabric import EnergyFabricCallback

    first = EnergyFabricCallback(_energy_config(tmp_path, "energy"))
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[first])
    fabric.launch()
    first.setup(fabric)
    with first:
        _fabric_loop(fabric, first, 150, fail_below_w=None)
        fabric.save(tmp_path / "fabric.ckpt", {"energy": first})
    assert first.controller is not None and first.controller.profile_done
    chosen = first.controller.current_power_limit_w()

    second = EnergyFabricCallback(_energy_config(tmp_path, "energy"))
    fabric.load(tmp_path / "fabric.ckpt", {"energy": second})  # before setup
    assert second.controller is None
    second.setup(fabric)
    with second:
        controller = second.controller
        assert controller is not None and controller.profile_done
        assert [d["reason"] for d in controller.decisions] == ["resumed from checkpoint"]
        assert controller.devices.gpus[0].power_limit_w() == chosen
