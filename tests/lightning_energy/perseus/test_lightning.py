from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_energy.errors import ConfigError
from tests.lightning_energy.processes import run_launch

ROOT = Path(__file__).resolve().parents[3]

NAMESPACES = {
    "lightning.pytorch": "lightning_energy.integrations.perseus_lightning",
    "pytorch_lightning": "lightning_energy.integrations.perseus_pytorch_lightning",
}


def fit(
    tmp_path: Path,
    strategy: dict[str, Any],
    max_steps: int,
    namespace: str = "lightning.pytorch",
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run the LightningCLI app of ``namespace`` on 2 CPU processes (gloo) with ``strategy``."""
    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "max_steps": max_steps,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": strategy,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "PERSEUS_TEST_OUT": str(tmp_path),
        "PERSEUS_TEST_NAMESPACE": namespace,
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    done = run_launch(
        [
            sys.executable,
            "-m",
            "tests.lightning_energy.perseus.lightning_fit",
            "fit",
            "--config",
            str(path),
        ],
        cwd=tmp_path,
        env=env,
        timeout_s=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_pipeline_strategy_from_yaml_profiles_plans_and_restores(tmp_path: Path) -> None:
    ranks = fit(
        tmp_path,
        {
            "class_path": "lightning_energy.integrations.perseus_lightning.PerseusPipelineStrategy",
            "init_args": {
                "schedule": "1f1b",
                "microbatches": 4,
                "device_backend": "simulated",
                "profile_clocks_mhz": [1410, 1200, 990],
                "simulated_stage_times_s": [[0.02, 0.04], [0.03, 0.06]],
                "process_group_backend": "gloo",
                "lease_dir": str(tmp_path / "leases"),
            },
        },
        # Warm-up, then each clock: a landing iteration and 20 s (200 periods of the
        # 100 ms energy counter) of ~0.5 s iterations; then planned ones.
        max_steps=130,
    )
    for result in ranks:
        assert result["phase"] == "planned"
        assert result["clock_after"] is None  # the guard reset the clocks
        assert result["losses"] == ranks[0]["losses"]  # the last stage's loss, broadcast
    plan = ranks[0]["plan"]
    assert plan == ranks[1]["plan"]
    # Stage 0 is lighter than stage 1: some of its instructions run below 1410 MHz.
    stage0 = plan["frequencies_mhz"][0]
    assert min(stage0["forward"] + stage0["backward"]) < 1410
    # Profiling visited the requested clocks (the clock locked at the end of each step).
    visited = [c[1] for c in ranks[0]["clocks"] if c is not None]
    assert [f for k, f in enumerate(visited) if k == 0 or f != visited[k - 1]][:3] == [
        1410,
        1200,
        990,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_ddp_strategy_from_yaml_slows_the_fast_rank(tmp_path: Path, namespace: str) -> None:
    ranks = fit(
        tmp_path,
        {
            "class_path": f"{NAMESPACES[namespace]}.PerseusDDPStrategy",
            "init_args": {
                "device_backend": "simulated",
                "slowdowns": [1.0, 1.3],
                "window_steps": 4,
                "steps_per_clock": 2,
                "process_group_backend": "gloo",
                "lease_dir": str(tmp_path / "leases"),
            },
        },
        # Each of 3 clocks: a landing step and 20 s of ~0.26 s steps; then equalised ones.
        max_steps=260,
        namespace=namespace,
    )
    assert ranks[0]["trainer"].startswith(f"{namespace}.")
    assert ranks[0]["straggler"] == ranks[1]["straggler"] == 1
    assert ranks[0]["clocks"][-1][1] < 1410
    assert ranks[1]["clocks"][-1][1] == 1410
    assert ranks[0]["clock_after"] is None and ranks[1]["clock_after"] is None


@pytest.mark.slow
def test_ddp_strategy_shares_the_energy_callbacks_gpus_and_guard(tmp_path: Path) -> None:
    energy = {
        "device": {
            "backend": "simulated",
            "gpu": "a100",
            "slowdowns": [1.0, 1.3],
            "lease_dir": str(tmp_path / "leases"),
        },
        "power_limit": {"enabled": False},
        "perseus": {"window_steps": 4, "steps_per_clock": 2, "simulated_step_s": 2.0},
    }
    path = tmp_path / "energy.yaml"
    path.write_text(yaml.safe_dump(energy))
    ranks = fit(
        tmp_path,
        {
            "class_path": f"{NAMESPACES['lightning.pytorch']}.PerseusDDPStrategy",
            "init_args": {"process_group_backend": "gloo"},
        },
        # Each of 3 clocks: a landing step and 20 s of ~2 s steps; then equalised ones.
        max_steps=48,
        # The strategy reads the file; the entry point adds the EnergyCallback from it.
        env={"LIGHTNING_ENERGY_CONFIG": str(path)},
    )
    assert ranks[0]["shared"] and ranks[1]["shared"]
    assert ranks[0]["straggler"] == ranks[1]["straggler"] == 1
    assert ranks[0]["clocks"][-1][1] < 1410
    assert ranks[0]["clock_after"] is None and ranks[1]["clock_after"] is None


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_strategies_are_registered_in_their_namespace(namespace: str) -> None:
    registry = importlib.import_module(f"{namespace}.strategies").StrategyRegistry
    ddp = importlib.import_module(f"{namespace}.strategies").DDPStrategy
    module = importlib.import_module(NAMESPACES[namespace])
    for name, cls in (
        ("perseus_pipeline", module.PerseusPipelineStrategy),
        ("perseus_ddp", module.PerseusDDPStrategy),
    ):
        assert issubclass(cls, ddp)
        assert registry[name]["strategy"] is cls
        strategy = registry.get(name)
        assert isinstance(strategy, cls)
        assert strategy.strategy_name == name


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_bad_pipeline_arguments_are_all_reported(namespace: str) -> None:
    module = importlib.import_module(NAMESPACES[namespace])
    with pytest.raises(ConfigError) as info:
        module.PerseusPipelineStrategy(schedule="zigzag", microbatches=0)
    message = str(info.value)
    assert "perseus.schedule: 'zigzag' is not allowed; allowed: 1f1b" in message
    assert "perseus.microbatches: 0 is not allowed; use an integer >= 1" in message
    assert "PerseusPipelineStrategy" in message


@pytest.mark.slow
def test_importing_one_namespace_does_not_import_the_other() -> None:
    for module, other in (
        ("lightning_energy.integrations.perseus_pytorch_lightning", "lightning.pytorch"),
        ("lightning_energy.integrations.perseus_lightning", "pytorch_lightning"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "tests.import_probe", "--prefix", other, module],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == []


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_arguments_override_the_perseus_section_which_overrides_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, namespace: str
) -> None:
    module = importlib.import_module(NAMESPACES[namespace])
    path = tmp_path / "energy.yaml"
    path.write_text(
        yaml.safe_dump({"device": {"gpu": "h100"}, "perseus": {"window_steps": 7, "margin": 0.05}})
    )
    monkeypatch.setenv("LIGHTNING_ENERGY_CONFIG", str(path))
    strategy = module.PerseusDDPStrategy(window_steps=3, slowdowns=[1.0, 1.2])
    section = strategy.config.perseus
    assert (section.window_steps, section.margin) == (3, 0.05)
    assert strategy.config.device.gpu == "h100"
    assert strategy.config.device.slowdowns == (1.0, 1.2)
    # An explicit configuration is used instead of the file.
    explicit = module.PerseusPipelineStrategy(energy={"perseus": {"microbatches": 8}})
    assert explicit.config.perseus.microbatches == 8
    assert explicit.config.device.gpu == "a40"  # that configuration's own device
    monkeypatch.delenv("LIGHTNING_ENERGY_CONFIG")
    # No configuration at all: the defaults, on a simulated GPU that models clocks.
    bare = module.PerseusDDPStrategy()
    assert bare.config.perseus.window_steps == 10 and bare.config.device.gpu == "a100"


def test_the_pipeline_strategy_is_a_knob_of_the_energy_callbacks_job(tmp_path: Path) -> None:
    """With the energy callback beside it, the pipeline strategy's clocks are a knob of the
    callback's job: no power limit is profiled beside them (power limits stay on in the
    configuration), and the carbon pace moves Perseus' target time (the knob paced)."""
    import os
    from unittest import mock

    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_energy.integrations.lightning import EnergyCallback
    from lightning_energy.integrations.perseus_lightning import PerseusPipelineStrategy
    from lightning_energy.perseus.runtime.pipeline_run import PipelinePace

    from .lightning_fit import PipelineMLP, RandomData

    config = {"device": {"backend": "simulated", "gpu": "a100", "lease_dir": str(tmp_path)}}
    energy = EnergyCallback(config)
    strategy = PerseusPipelineStrategy(
        energy=config,
        schedule="1f1b",
        microbatches=2,
        process_group_backend="gloo",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=6,
        callbacks=[energy],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with mock.patch.dict(os.environ):  # the DDP-based strategy sets its variables
        try:
            trainer.fit(PipelineMLP(num_stages=1), datamodule=RandomData())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    controller = energy.controller
    assert controller is not None
    assert isinstance(controller.paced_knob(), PipelinePace)
    assert controller.power_limit.profiling_off == "perseus_clocks holds the clocks"
    assert not [d for d in controller.decisions if d["kind"] == "power_limit"]
    assert controller.config.power_limit.enabled
