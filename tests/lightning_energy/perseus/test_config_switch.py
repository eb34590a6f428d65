"""Perseus switched on for an unchanged script by LIGHTNING_ENERGY_CONFIG alone."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_energy.config import EnergyConfig
from lightning_energy.errors import ConfigError
from lightning_energy.integrations._entry_point import configured_callbacks
from lightning_energy.integrations.lightning import EnergyCallback, callbacks_factory
from tests.lightning_energy.processes import run_launch

ROOT = Path(__file__).resolve().parents[3]


def _config(tmp_path: Path, **perseus: Any) -> dict[str, Any]:
    return {
        "device": {
            "backend": "simulated",
            "gpu": "a100",
            "slowdowns": [1.0, 1.3],
            "lease_dir": str(tmp_path / "leases"),
        },
        "perseus": {"enabled": True, **perseus},
    }


@pytest.mark.slow
def test_a_config_file_alone_equalises_ddp_ranks_over_the_energy_callbacks_gpus(
    tmp_path: Path,
) -> None:
    path = tmp_path / "energy.yaml"
    config = _config(tmp_path, mode="ddp", window_steps=4, steps_per_clock=2)
    # Steps of 2 s: the simulated energy counter (~100 ms period) resolves them.
    config["perseus"]["simulated_step_s"] = 2.0
    # GPU settings and leases in files, shared by the processes, as with real GPUs.
    state_dir = tmp_path / "state"
    config["device"]["state_dir"] = str(state_dir)
    path.write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "LIGHTNING_ENERGY_CONFIG": str(path),
        "PERSEUS_TEST_OUT": str(tmp_path),
        "PYTHONPATH": str(ROOT),
    }
    done = run_launch(
        [sys.executable, "-m", "tests.lightning_energy.perseus.config_fit"],
        cwd=tmp_path,
        env=env,
        timeout_s=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        # One opening, one guard, one lease: Perseus drives the energy callback's GPU.
        assert result["same_gpu"] and result["same_guard"] and not result["owned"]
        assert result["straggler"] == 1
        # Its clocks are a knob of the energy callback's job: power limits are on in the
        # file, but no limit is profiled beside the clocks.
        assert result["profiling_off"] == "straggler_clocks holds the clocks"
        assert result["power_limit_decisions"] == []
        # It joined the energy callback's run, whose checkpoint entry carries the state.
        assert result["joined"] and result["checkpoint_entry"] == {}
    assert ranks[0]["clocks"][-1][1] < 1410  # the fast rank waits at a lower clock
    assert ranks[1]["clocks"][-1][1] == 1410  # the straggler keeps the maximum
    # After the job: both GPUs unlocked again, and no lease left behind.
    states = [json.loads(f.read_text()) for f in sorted(state_dir.glob("*.json"))]
    assert len(states) == 2
    assert all(state["locked_clocks_mhz"] is None for state in states)
    assert not list((tmp_path / "leases").glob("*.json"))


def test_the_entry_point_adds_perseus_only_when_the_file_enables_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "energy.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path)))
    monkeypatch.setenv("LIGHTNING_ENERGY_CONFIG", str(path))
    names = [type(c).__name__ for c in callbacks_factory()]
    assert names == ["EnergyCallback", "PerseusCallback"]
    config = _config(tmp_path)
    config["perseus"]["enabled"] = False
    path.write_text(yaml.safe_dump(config))
    assert [type(c).__name__ for c in callbacks_factory()] == ["EnergyCallback"]


@pytest.mark.parametrize("strict", [False, True])
def test_pipeline_mode_without_the_pipeline_strategy_says_what_to_do(
    tmp_path: Path, strict: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import lightning.pytorch as pl

    from tests.lightning_energy.perseus.lightning_fit import PipelineMLP, RandomData

    data = _config(tmp_path, mode="pipeline")
    data["strict"] = strict
    config = EnergyConfig.from_mapping(data)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EnergyCallback(config), *configured_callbacks(config, "lightning.pytorch")],
    )
    if strict:
        with pytest.raises(ConfigError, match=r"perseus\.mode: 'pipeline' needs the perseus_pip"):
            trainer.fit(PipelineMLP(), datamodule=RandomData())
        return
    trainer.fit(PipelineMLP(), datamodule=RandomData())
    assert "strategy='perseus_pipeline'" in caplog.text
    assert trainer.global_step == 2  # trained as before, without Perseus
