"""The Lightning examples: ``examples/lightning/train.py`` with ``cli.yaml`` (LightningCLI),
and ``examples/lightning/callback.py`` (plain Python)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

from lightning_energy.device.lease import LEASE_DIR_ENV
from lightning_energy.integrations.lightning import EnergyCallback
from lightning_energy.report import load_report

EXAMPLES = Path(__file__).parents[3] / "examples" / "lightning"


def _load(name: str, module_name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module_name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run in ``tmp_path`` with the examples' ``model`` module importable."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(LEASE_DIR_ENV, str(tmp_path / "leases"))
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # LightningCLI's seed_everything sets it
    monkeypatch.delenv("LIGHTNING_ENERGY_CONFIG", raising=False)
    _load("model", "model", monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)


def test_cli_yaml_declares_the_callback_with_a_carbon_region() -> None:
    config = yaml.safe_load((EXAMPLES / "cli.yaml").read_text())
    (callback,) = config["trainer"]["callbacks"]
    assert callback["class_path"] == "lightning_energy.integrations.lightning.EnergyCallback"
    carbon = callback["init_args"]["carbon"]
    assert (carbon["provider"], carbon["region"]) == ("trace", "DE")
    EnergyCallback(**callback["init_args"])  # the init_args are a valid configuration


def test_lightning_cli_runs_the_yaml(examples: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures]")
    config = yaml.safe_load((EXAMPLES / "cli.yaml").read_text())
    config["trainer"]["max_steps"] = 150
    config["trainer"]["enable_progress_bar"] = False
    config["trainer"]["callbacks"][0]["init_args"]["device"]["backend"] = "simulated"
    config["trainer"]["callbacks"][0]["init_args"]["device"]["start"] = "2023-06-01T00:00:00"
    path = examples / "cli.yaml"
    path.write_text(yaml.safe_dump(config))
    train = _load("train", "lightning_cli_example_train", monkeypatch)
    cli = train.main(["fit", "--config", str(path)])
    (energy,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, EnergyCallback)]
    assert energy.config.carbon is not None and energy.config.carbon.region == "DE"
    report = load_report(examples / "runs" / "lightning_cli" / "energy.json")
    assert report["summary"]["steps"] == 150
    assert report["carbon"]["region"] == "DE"
    assert all(e["intensity_g_per_kwh"] > 0 for e in report["timeline"])
    assert report["profile"], "the power limits were profiled"


def test_plain_callback_example(
    examples: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _load("callback", "lightning_callback_example", monkeypatch)
    args = ["--steps", "150", "--backend", "simulated", "--region", "FR", "--report", "r.json"]
    args += ["--start", "2023-06-01T00:00:00"]
    energy = example.main(args)
    assert energy.summary is not None and energy.summary.steps == 150
    out = capsys.readouterr().out
    assert "FR via trace" in out and "emissions" in out
    assert load_report(examples / "r.json")["carbon"]["region"] == "FR"
