"""Run reports (JSON) and their plots, from controllers driving simulated GPUs."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.controller import EnergyController
from lightning_energy.device import SimulatedSpec, open_devices
from lightning_energy.errors import EnergyError, GPULostError
from lightning_energy.integrations.adapter import format_summary
from lightning_energy.plots import render_plots
from lightning_energy.report import (
    REPORT_VERSION,
    ReportError,
    build_report,
    chosen_power_limits_w,
    format_report,
    load_report,
    save_report,
    write_report,
)

STEPS = 240
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _config(tmp_path: Path, carbon: dict[str, Any] | None = None) -> EnergyConfig:
    data: dict[str, Any] = {
        # 100 steps an epoch: ~37 s steps, each longer than a profiling window must last.
        "device": {
            "backend": "simulated",
            "gpu": "a40",
            "steps_per_epoch": 100,
            "lease_dir": str(tmp_path / "leases"),
            "start": "2023-06-01T00:00:00",  # a pinned day of the replayed trace
        },
        "power_limit": {
            "power_limits_w": [300, 250, 200, 150],
            "warmup_steps": 2,
            "settle_steps": 1,
        },
        "log_every_n_steps": 5,
    }
    if carbon is not None:
        data["carbon"] = carbon
    return EnergyConfig.from_mapping(data)


def _run(config: EnergyConfig, steps: int = STEPS) -> EnergyController:
    controller = EnergyController(config, install_signal_handlers=False)
    controller.setup()
    controller.set_total_steps(steps)
    for _ in range(steps):
        controller.on_step_start()
        controller.on_step_end()
    controller.teardown()
    return controller


@pytest.fixture
def plain(tmp_path: Path) -> EnergyController:
    return _run(_config(tmp_path))


@pytest.fixture
def carbon_aware(tmp_path: Path) -> EnergyController:
    section = {"provider": "trace", "region": "CISO", "policy": "forecast", "max_slowdown": 1.5}
    return _run(_config(tmp_path, section))


def test_report_holds_every_section(plain: EnergyController, tmp_path: Path) -> None:
    path = write_report(plain, tmp_path / "runs" / "run.json")
    report = load_report(path)
    assert report["version"] == REPORT_VERSION
    assert set(report) == {
        "version",
        "created",
        "config",
        "devices",
        "timeline",
        "profile",
        "decisions",
        "summary",
    }
    assert report["config"]["power_limit"]["power_limits_w"] == [300.0, 250.0, 200.0, 150.0]
    (device,) = report["devices"]
    assert device["name"] == "NVIDIA A40 (simulated)"
    assert (device["min_power_limit_w"], device["max_power_limit_w"]) == (100.0, 300.0)
    assert sum(entry["steps"] for entry in report["timeline"]) == STEPS
    assert {"power_limit_w", "energy_j", "power_w", "time_s"} <= set(report["timeline"][0])
    assert sorted(m["power_limit_w"] for m in report["profile"]) == [150.0, 200.0, 250.0, 300.0]
    assert report["summary"]["steps"] == STEPS
    assert report["summary"]["energy_j"] == pytest.approx(
        sum(e["energy_j"] for e in report["timeline"])
    )
    reasons = [d["reason"] for d in report["decisions"]]
    assert any(r.startswith("profile complete") for r in reasons)


def test_chosen_limits_skip_profiling_windows(plain: EnergyController) -> None:
    report = build_report(plain)
    chosen = chosen_power_limits_w(report)
    assert chosen == [plain.teardown().power_limit_w]
    profiled = {d["value"] for d in report["decisions"] if d["reason"].endswith(" window")}
    assert len(profiled) == 4  # every candidate was applied for profiling


def test_carbon_aware_report_has_intensity_grams_and_baselines(
    carbon_aware: EnergyController,
) -> None:
    report = build_report(carbon_aware)
    carbon = report["carbon"]
    assert "carbon" not in report["summary"]
    timeline = report["timeline"]
    assert all(e["intensity_g_per_kwh"] > 0 for e in timeline)
    assert carbon["emissions_g"] == pytest.approx(sum(e["emissions_g"] for e in timeline))
    assert any(e["scale"] is not None and e["scale"] >= 1.0 for e in timeline)
    assert carbon["region"] == "CISO" and carbon["provider"] == "trace"
    assert carbon["emission_factor"] == "direct"  # the numbers say which factor they use
    assert carbon["forecast_horizon_s"] == 72 * 3600.0
    assert 0 < carbon["forecast_reach_s"] <= 73 * 3600.0
    assert carbon["full_power_emissions_g"] > 0 and carbon["carbon_unaware_emissions_g"] > 0
    assert set(carbon["baselines"]) == {"carbon_unaware", "full_power"}
    table = format_report(report)
    assert "CISO via trace (direct emission factors), forecast policy" in table
    assert re.search(r"forecast for pacing +72 h asked, the last one reached \d+ h", table)
    logged = format_summary(carbon_aware.teardown())  # the summary a fit logs at its end
    assert re.search(
        r"CO2eq emitted \(this process\) +[\d.]+ g \(direct emission factors\)", logged
    )
    assert "vs. carbon-unaware" in table and "vs. full power" in table
    assert "gCO2eq/kWh" in table


def test_credentials_never_reach_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_EM_TOKEN", "s3cret-token-value")
    section = {"provider": "electricitymaps", "region": "DE", "token_env": "MY_EM_TOKEN"}
    controller = EnergyController(_config(tmp_path, section), install_signal_handlers=False)
    path = write_report(controller, tmp_path / "run.json")  # a run that never started
    text = path.read_text()
    assert "s3cret-token-value" not in text
    assert json.loads(text)["config"]["carbon"]["token_env"] == "MY_EM_TOKEN"


def test_devices_are_recorded_at_setup_and_survive_a_lost_gpu(tmp_path: Path) -> None:
    devices = open_devices("simulated", simulated=SimulatedSpec(gpu="a40"))
    controller = EnergyController(_config(tmp_path), devices=devices, install_signal_handlers=False)
    controller.setup()
    controller.teardown()
    devices.gpus[0].inject_fault("power_limit_constraints", GPULostError)  # type: ignore[attr-defined]
    (device,) = build_report(controller)["devices"]
    assert device["uuid"] == devices.gpus[0].uuid
    assert device["name"] == "NVIDIA A40 (simulated)"
    assert (device["min_power_limit_w"], device["max_power_limit_w"]) == (100.0, 300.0)


def test_save_is_atomic_and_json_safe(tmp_path: Path) -> None:
    report = {
        "version": REPORT_VERSION,
        "created": "2025-01-01T00:00:00+00:00",
        "config": {},
        "devices": [],
        "timeline": [{"power_w": float("nan"), "energy_j": float("inf"), "steps": 5}],
        "profile": [],
        "decisions": [],
        "summary": {"limits": (1.0, 2.0)},
    }
    path = save_report(report, tmp_path / "a" / "b" / "run.json")
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]  # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # readable as usual
    loaded = load_report(path)
    assert loaded["timeline"][0] == {"power_w": None, "energy_j": None, "steps": 5}
    assert loaded["summary"]["limits"] == [1.0, 2.0]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the report"),
        ("{not json", "is not a JSON report"),
        ("[1, 2]", "expected a JSON object"),
        ('{"version": 99}', "report version 99 cannot be read"),
        ('{"version": 1, "created": "x", "timeline": {}}', "'timeline' should be a list"),
    ],
)
def test_bad_report_files_are_explained(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ReportError, match=message) as info:
        load_report(path)
    assert isinstance(info.value, EnergyError)


def test_missing_sections_are_all_named(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text('{"version": 1, "created": "now"}')
    with pytest.raises(ReportError) as info:
        load_report(path)
    for key in ("config", "devices", "timeline", "profile", "decisions", "summary"):
        assert f"'{key}' is missing" in str(info.value)


def test_table_of_a_run_without_carbon(plain: EnergyController) -> None:
    table = format_report(build_report(plain))
    lines = dict(line.strip().split("  ", 1) for line in table.splitlines())
    assert lines["GPUs"].strip() == "1x NVIDIA A40 (simulated)"
    assert lines["steps"].strip() == str(STEPS)
    assert lines["pre-job power limit"].strip() == "300 W (every GPU put back to it at the end)"
    assert "carbon intensity from" not in lines


def test_table_of_an_observe_only_run() -> None:
    report = {
        "devices": [{"name": "NVIDIA A100"}, {"name": "NVIDIA A100"}],
        "decisions": [{"kind": "observe-only", "value": None, "reason": "no permission"}],
        "summary": {"steps": 10, "energy_j": 5e6, "duration_s": 4000.0, "observe_only": True},
        "carbon": {"emissions_g": 1500.0},
    }
    lines = dict(line.strip().split("  ", 1) for line in format_report(report).splitlines())
    assert lines["GPUs"].strip() == "2x NVIDIA A100"
    assert lines["power limits chosen"].strip() == "none (GPU settings unchanged)"
    assert lines["mode"].strip().startswith("observe-only")
    assert lines["energy"].strip() == "1.39 kWh"
    assert lines["time (device clock)"].strip() == "1 h 07 min"
    assert lines["emissions"].strip() == "1.50 kgCO2eq"
    assert lines["mean intensity"].strip() == "1080 gCO2eq/kWh"
    assert "vs. full power" not in lines


def _pngs(paths: list[Path]) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in paths}


def test_plots_of_a_carbon_aware_run(carbon_aware: EnergyController, tmp_path: Path) -> None:
    images = _pngs(render_plots(build_report(carbon_aware), tmp_path / "plots"))
    assert set(images) == {"power.png", "frontier.png", "emissions.png"}
    assert all(data.startswith(PNG_MAGIC) and len(data) > 10_000 for data in images.values())


def test_plots_without_carbon_and_of_an_empty_run(plain: EnergyController, tmp_path: Path) -> None:
    report = build_report(plain)
    plain_images = _pngs(render_plots(report, tmp_path / "plain"))
    empty = {**report, "timeline": [], "profile": [], "decisions": []}
    empty_images = _pngs(render_plots(empty, tmp_path / "empty"))
    for name, data in empty_images.items():
        assert data.startswith(PNG_MAGIC)
        assert data != plain_images[name]


def test_plots_into_an_unwritable_place_fail_clearly(
    plain: EnergyController, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ReportError, match="cannot create the folder"):
        render_plots(build_report(plain), blocker / "plots")


def _paused_report(scales: Sequence[float | None]) -> dict[str, Any]:
    """A paced run: 3 intervals of steps, one paused hour between them."""
    timeline = [
        {
            "step": 10,
            "time_s": 3600.0,
            "duration_s": 3600.0,
            "steps": 10,
            "energy_j": 9.0e5,
            "power_w": 250.0,
            "power_limit_w": 200.0,
            "emissions_g": 90.0,
            "scale": scales[0],
        },
        {
            "step": 10,
            "time_s": 7200.0,
            "duration_s": 3600.0,
            "steps": 0,
            "energy_j": 3.0e4,
            "power_w": 8.0,
            "power_limit_w": 100.0,
            "emissions_g": 4.0,
            "scale": scales[1],
        },
        {
            "step": 20,
            "time_s": 10800.0,
            "duration_s": 3600.0,
            "steps": 10,
            "energy_j": 9.5e5,
            "power_w": 260.0,
            "power_limit_w": 250.0,
            "emissions_g": 60.0,
            "scale": scales[2],
        },
    ]
    return {
        "devices": [{"name": "NVIDIA A40"}],
        "summary": {
            "steps": 20,
            "energy_j": 1.88e6,
            "duration_s": 10800.0,
            "energy_saved_j": 2.0e3,
            "slowdown": 1.4,
            "pre_job_power_limit_w": 300.0,
        },
        "decisions": [
            {"purpose": "choice", "value": 200.0, "step": 5, "time_s": 1800.0},
            {"purpose": "pause", "value": 100.0, "step": 10, "time_s": 3600.0},
            {"purpose": "resume", "value": 200.0, "step": 10, "time_s": 7200.0},
            {"purpose": "choice", "value": 250.0, "step": 10, "time_s": 7200.0},
        ],
        "timeline": timeline,
        "carbon": {
            "emissions_g": 154.0,
            "carbon_unaware_emissions_g": 154.5,
            "full_power_emissions_g": 2100.0,
        },
    }


def test_table_states_pauses_and_their_share_of_the_time() -> None:
    table = format_report(_paused_report([1.0, 1.0, 1.2]))
    assert "paused" in table and "1 time" in table and "1 h 00 min (33.3 % of the time)" in table
    assert "pauses included" in table


def test_table_uses_one_energy_unit_and_one_mass_unit() -> None:
    table = format_report(_paused_report([1.0, 1.0, 1.2]))
    assert "kWh" in table and "kJ" not in table  # 2 kJ saved shows as 0.00 kWh
    assert "kgCO2eq" not in table  # 154 g emitted: every mass in grams


def test_table_gives_the_pace_range_or_says_it_never_moved() -> None:
    moved = format_report(_paused_report([1.0, 1.0, 1.2]))
    assert "x1.00 to x1.20" in moved
    still = format_report(_paused_report([1.05, 1.05, 1.05]))
    assert "x1.05 throughout" in still


@pytest.mark.parametrize(("scales", "flat"), [([1.05, 1.05, 1.05], True), ([1.0, 1.0, 1.2], False)])
def test_power_plot_says_so_when_the_pace_never_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scales: list[float], flat: bool
) -> None:
    import lightning_energy.plots as plots

    notes: list[str] = []
    draw = plots._note

    def noted(ax: Any, message: str) -> None:
        notes.append(message)
        draw(ax, message)

    monkeypatch.setattr(plots, "_note", noted)
    report = _paused_report(scales)
    for entry in report["timeline"]:
        entry["intensity_g_per_kwh"] = 300.0
    plots.plot_power(report, tmp_path / "power.png")
    assert any("never moved" in n for n in notes) == flat


@pytest.mark.parametrize("ranks", [1, 4])
def test_the_full_power_line_is_this_ranks_share_of_the_jobs_profile(
    plain: EnergyController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: int
) -> None:
    """The profile's energy per step is the whole job's; the run's line is rank 0's own
    energy: the full-power line beside it is rank 0's share, or a 4-rank job would
    look like it saved three quarters of its energy."""
    import matplotlib.axes

    import lightning_energy.plots as plots

    drawn: dict[str, float] = {}
    plot = matplotlib.axes.Axes.plot

    def recorded(ax: Any, x: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        drawn[str(kwargs.get("label", "")).split(" (")[0]] = float(y[-1])
        return plot(ax, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recorded)
    report = build_report(plain)
    report["profile"] = [
        {**m, "energy_per_step_j": m["energy_per_step_j"] * ranks} for m in report["profile"]
    ]
    report["job"] = {"ranks": ranks, "energy_j": report["summary"]["energy_j"] * ranks}
    plots.plot_emissions(report, tmp_path / "energy.png")
    top = max(report["profile"], key=lambda m: m["power_limit_w"])
    steps = sum(e["steps"] for e in report["timeline"])
    full = next(v for k, v in drawn.items() if k.startswith("full power"))
    run_j = sum(e["energy_j"] for e in report["timeline"])
    # In the figure's unit, whichever: the two lines' ratio is that of their joules.
    full_j = steps * top["energy_per_step_j"] / ranks
    assert full / drawn["this run"] == pytest.approx(full_j / run_j, rel=1e-3)
