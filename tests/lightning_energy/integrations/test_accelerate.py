"""attach_energy / EnergyTracker with a real Accelerate loop on CPU and simulated GPUs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from lightning_energy.config import CONFIG_ENV_VAR
from lightning_energy.errors import ConfigError, EnergyError
from lightning_energy.integrations.accelerate import (
    AcceleratorEnergy,
    EnergyTracker,
    attach_energy,
)
from tests.lightning_energy.integrations._accelerate import (
    PRE_JOB_W,
    energy_config,
    fresh_accelerate_state,  # noqa: F401 - the autouse fixture
    gpu_limit_w,
    reset_accelerate_state,
    train,
    training_parts,
)
from tests.lightning_energy.processes import free_port, run_launch

REPO_ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = REPO_ROOT / "examples" / "accelerate"


class _SubclassedAccelerator(Accelerator):
    """Users often subclass Accelerator; attaching must work the same."""


@pytest.mark.parametrize("when", ["before_prepare", "after_prepare"])
@pytest.mark.parametrize("accelerator_class", [Accelerator, _SubclassedAccelerator])
def test_steps_are_counted_per_real_optimizer_step_under_accumulation(
    tmp_path: Path, when: str, accelerator_class: type[Accelerator]
) -> None:
    accelerator = accelerator_class(cpu=True, gradient_accumulation_steps=4)
    model, optimizer, loader = training_parts(micro_batches=24)
    if when == "before_prepare":
        energy = attach_energy(accelerator, energy_config(tmp_path))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        energy = attach_energy(accelerator, energy_config(tmp_path))
    with energy:
        train(accelerator, model, optimizer, loader)
        assert energy.controller is not None
        assert energy.controller.steps == 6  # 24 micro-batches / 4


def test_profile_completes_metrics_reach_trackers_and_end_training_restores(
    tmp_path: Path,
) -> None:
    tracker = EnergyTracker(tmp_path / "energy.jsonl")
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("test")
    report = tmp_path / "report.json"
    energy = attach_energy(accelerator, {**energy_config(tmp_path), "report": str(report)})
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=60))
    train(accelerator, model, optimizer, loader)
    controller = energy.controller
    assert controller is not None and controller.profile_done
    chosen_w = controller.current_power_limit_w()
    assert chosen_w is not None and chosen_w < PRE_JOB_W
    assert gpu_limit_w(energy) == chosen_w
    assert energy.metrics["energy/power_limit_w"] == chosen_w

    accelerator.end_training()

    assert gpu_limit_w(energy) == PRE_JOB_W
    assert energy.summary is not None and energy.summary.power_limit_w == chosen_w
    assert "end_training" not in vars(accelerator)  # the instance is left as it was
    steps = [record["step"] for record in tracker.history]
    # Every log_every_n_steps optimizer steps, and at the end of profiling, where the count
    # restarts (the carbon baselines begin at an interval's end).
    profiled_to = next(d["step"] for d in controller.decisions if d["purpose"] == "choice")
    assert steps[:-1] == [*range(5, profiled_to, 5), *range(profiled_to, 61, 5)]
    assert tracker.history[-1]["energy/summary/power_limit_w"] == chosen_w
    lines = (tmp_path / "energy.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == tracker.history
    assert all(key.startswith("energy/") for r in tracker.history for key in r if key != "step")
    assert json.loads(report.read_text())  # the run report is written at the end


def test_carbon_values_reach_the_trackers(tmp_path: Path) -> None:
    tracker = EnergyTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("test")
    config = {**energy_config(tmp_path), "carbon": {"provider": "trace", "region": "DE"}}
    config["device"]["start"] = "2023-06-01T00:00:00"  # a pinned day of the replayed trace
    with attach_energy(accelerator, config) as energy:
        energy.set_total_steps(10)
        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=10))
        train(accelerator, model, optimizer, loader)
    assert [record["step"] for record in tracker.history] == [5, 10, 10]
    assert all(record["carbon/intensity_g_per_kwh"] > 0 for record in tracker.history[:2])
    assert tracker.history[-1]["carbon/summary/emissions_g"] > 0


def test_save_state_load_state_resumes_without_profiling(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    accelerator = Accelerator(cpu=True)
    with attach_energy(accelerator, energy_config(tmp_path)) as energy:
        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=60))
        train(accelerator, model, optimizer, loader)
        assert energy.controller is not None and energy.controller.profile_done
        chosen_w = energy.controller.current_power_limit_w()
        accelerator.save_state(str(checkpoint))
    reset_accelerate_state()

    accelerator = Accelerator(cpu=True)
    with attach_energy(accelerator, energy_config(tmp_path)) as energy:
        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=10))
        accelerator.load_state(str(checkpoint))
        controller = energy.controller
        assert controller is not None and controller.profile_done
        assert gpu_limit_w(energy) == chosen_w  # applied before the first step
        train(accelerator, model, optimizer, loader)
        assert controller.steps == 70
        assert [d["reason"] for d in controller.decisions] == ["resumed from checkpoint"]
        assert gpu_limit_w(energy) == chosen_w


def test_exception_in_the_with_block_restores_and_unhooks(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=40))
    with pytest.raises(RuntimeError, match="boom"):  # noqa: SIM117 - the order is the point
        with attach_energy(accelerator, energy_config(tmp_path)) as energy:
            for x, y in loader:
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                if gpu_limit_w(energy) < PRE_JOB_W:
                    raise RuntimeError("boom")
    assert gpu_limit_w(energy) == PRE_JOB_W
    assert energy.summary is not None
    assert energy.controller is not None
    steps = energy.controller.steps
    optimizer.step()  # the optimizer hooks are gone
    assert energy.controller.steps == steps


def test_unset_env_var_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator)
    assert not energy.active and energy.controller is None
    assert "end_training" not in vars(accelerator)
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=8))
    train(accelerator, model, optimizer, loader)
    assert energy.metrics == {}
    assert energy.close() is None
    # Nothing is registered: the checkpoint is Accelerate's own, loadable either way.
    accelerator.save_state(str(tmp_path / "off"))
    accelerator.load_state(str(tmp_path / "off"))
    accelerator.end_training()


def test_checkpoint_saved_with_energy_on_loads_with_energy_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accelerator = Accelerator(cpu=True)
    with attach_energy(accelerator, energy_config(tmp_path)):
        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=8))
        train(accelerator, model, optimizer, loader)
        accelerator.save_state(str(tmp_path / "on"))
    reset_accelerate_state()

    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    accelerator = Accelerator(cpu=True)
    energy = attach_energy(accelerator)
    accelerator.prepare(*training_parts(micro_batches=8))
    accelerator.load_state(str(tmp_path / "on"))
    assert energy.controller is None


def test_config_from_env_var_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "energy.yaml"
    path.write_text(json.dumps(energy_config(tmp_path, selector="energy")))  # JSON is YAML
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    accelerator = Accelerator(cpu=True)
    with attach_energy(accelerator) as energy:
        assert energy.active and energy.config is not None
        assert energy.config.power_limit.selector == "energy"
        assert energy.config.source == str(path)


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        (None, ["cannot read the file"]),
        ("power_limit: [300", ["not valid YAML"]),
        (
            "power_limit: {selector: fastest, warmup_steps: -1}\nlog_every: 5\n",
            ["selector", "warmup_steps", "log_every"],
        ),
    ],
    ids=["missing", "not-yaml", "invalid"],
)
def test_bad_file_named_by_env_var_fails_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None, needles: list[str]
) -> None:
    path = tmp_path / "energy.yaml"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ConfigError) as info:
        attach_energy(accelerator)
    message = str(info.value)
    assert str(path) in message and CONFIG_ENV_VAR in message
    for needle in needles:
        assert needle in message
    assert "end_training" not in vars(accelerator)


def test_power_limits_outside_the_gpu_range_fail_at_attach(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ConfigError, match="outside the allowed range"):
        attach_energy(accelerator, energy_config(tmp_path, power_limits_w=[300, 50]))
    assert "end_training" not in vars(accelerator)


def test_attaching_twice_is_refused(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    with (
        attach_energy(accelerator, energy_config(tmp_path)),
        pytest.raises(EnergyError, match="already"),
    ):
        attach_energy(accelerator, energy_config(tmp_path))


def test_explicit_optimizer_is_the_only_one_counted(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = training_parts(micro_batches=6)
    probe = nn.Linear(8, 1)
    other = torch.optim.SGD(probe.parameters(), lr=0.01)
    model, optimizer, other, loader = accelerator.prepare(model, optimizer, other, loader)
    with attach_energy(accelerator, energy_config(tmp_path), optimizer=optimizer) as energy:
        for x, y in loader:
            accelerator.backward(nn.functional.mse_loss(probe(x), y))
            other.step()  # steps first in every iteration, yet is not the training optimizer
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
        assert energy.controller is not None and energy.controller.steps == 6


def test_energy_tracker_keeps_energy_and_carbon_values_only(tmp_path: Path) -> None:
    tracker = EnergyTracker(tmp_path / "logs" / "energy.jsonl")
    tracker.log({"loss": 0.5}, step=1)
    tracker.log({"loss": 0.4, "energy/step_j": 10.0, "carbon/emissions_g": 2.0}, step=2)
    tracker.finish()
    expected = [{"step": 2, "energy/step_j": 10.0, "carbon/emissions_g": 2.0}]
    assert tracker.tracker == expected
    lines = (tmp_path / "logs" / "energy.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == expected


def _launch(tmp_path: Path, *script_args: str) -> tuple[int, list[dict[str, Any]], str]:
    """Run the example on 2 processes; its exit status, JSON events and stderr's tail."""
    env = dict(
        os.environ,
        LIGHTNING_ENERGY_CONFIG=str(EXAMPLE / "energy.yaml"),
        LIGHTNING_ENERGY_LEASE_DIR=str(tmp_path / "leases"),
    )
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.accelerate_cli",  # the `accelerate` command
        "launch",
        "--config_file",
        str(EXAMPLE / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
        "--num_cpu_threads_per_process",
        "1",
        str(EXAMPLE / "train.py"),
        *script_args,
    ]
    out = run_launch(cmd, env=env, timeout_s=240)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return out.returncode, events, out.stderr[-4000:]


@pytest.mark.slow
def test_two_process_accelerate_launch_agrees_resumes_and_restores(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "checkpoint")
    code, events, stderr = _launch(tmp_path, "--steps", "60", "--checkpoint-dir", checkpoint)
    assert code == 0, stderr
    chosen = {e["rank"]: e["power_limit_w"] for e in events if e["event"] == "power_limit"}
    assert set(chosen) == {0, 1}
    assert chosen[0] == chosen[1] < PRE_JOB_W  # one limit, agreed through Accelerate
    summaries = {e["rank"]: e for e in events if e["event"] == "summary"}
    assert {s["steps"] for s in summaries.values()} == {60}  # 120 micro-batches, accumulation 2
    assert summaries[0]["decisions"] == summaries[1]["decisions"]
    # Job-wide numbers (energy summed over both ranks' GPUs, time of the slower): each rank
    # measures its own noisy GPU, so equal profiles show the measurements were combined.
    assert summaries[0]["profile"] == summaries[1]["profile"] != []
    # Every 10 optimizer steps, and at the end of profiling, where the count restarts.
    profiled_to = events[[e["event"] for e in events].index("power_limit")]["step"]
    logged = [*range(10, profiled_to, 10), *range(profiled_to, 61, 10)]
    assert summaries[0]["logged_steps"][: len(logged)] == logged

    # Resume on both ranks: the limit comes back from the checkpoint, nothing is profiled;
    # then a failure mid-training restores each rank's GPU before the process exits.
    code, events, stderr = _launch(
        tmp_path, "--steps", "20", "--resume-from", checkpoint, "--fail-at-step", "70"
    )
    assert code != 0
    resumed = {e["rank"]: e for e in events if e["event"] == "power_limit"}
    assert {r: e["power_limit_w"] for r, e in resumed.items()} == chosen
    assert {e["step"] for e in resumed.values()} == {61}
    failed = {e["rank"]: e for e in events if e["event"] == "failed"}
    assert set(failed) == {0, 1}, stderr
    for event in failed.values():
        assert event["decisions"] == ["resumed from checkpoint"]
        assert event["gpu_power_limit_w"] == event["pre_job_power_limit_w"] == PRE_JOB_W


def test_exception_in_the_with_block_writes_the_report_without_a_collective(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.json"
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=40))
    config = {**energy_config(tmp_path), "report": str(report)}
    with pytest.raises(RuntimeError, match="boom"):  # noqa: SIM117 - the order is the point
        with attach_energy(accelerator, config) as energy:
            for x, y in loader:
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                if gpu_limit_w(energy) < PRE_JOB_W:
                    raise RuntimeError("boom")
    assert gpu_limit_w(energy) == PRE_JOB_W
    assert energy.controller is not None
    written = json.loads(report.read_text())
    assert written["summary"]["steps"] == energy.controller.steps > 0
    assert "job" not in written  # no collective on an exception path: another rank may be gone
    assert "end_training" not in vars(accelerator)  # unhooked


def test_state_loaded_before_start_is_resumed_at_start(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    with attach_energy(accelerator, energy_config(tmp_path)) as energy:
        model, optimizer, loader = accelerator.prepare(*training_parts(micro_batches=80))
        train(accelerator, model, optimizer, loader)
        assert energy.controller is not None and energy.controller.profile_done
        state = energy.state_dict()
        chosen_w = energy.controller.current_power_limit_w()
    reset_accelerate_state()

    from lightning_energy.config import EnergyConfig

    accelerator = Accelerator(cpu=True)  # held weakly by the attachment: kept here
    resumed = AcceleratorEnergy(accelerator, EnergyConfig.from_mapping(energy_config(tmp_path)))
    resumed.load_state_dict(state)
    assert resumed.controller is None
    resumed.start()
    with resumed:
        controller = resumed.controller
        assert controller is not None and controller.profile_done
        assert [d["reason"] for d in controller.decisions] == ["resumed from checkpoint"]
        assert gpu_limit_w(resumed) == chosen_w
