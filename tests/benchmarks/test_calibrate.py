"""benchmarks/gpu/calibrate.py: the calibration run on simulated GPUs, its JSON, the JSON
loaded back as a simulated preset, and the refusal without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.device.simulated import BOARDS
from lightning_energy.errors import ConfigError, GPULostError

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu" / "calibrate.py"
ROOT = Path(__file__).parents[2]
PRESETS = ("a100", "h200")
# A calibrated preset reproduces its source within this much (time and power per step):
# the sweeps sample a handful of clocks, in between power is interpolated linearly, and a
# power limit near the boundary between two clocks may pick the neighbouring one.
REPRODUCTION_TOLERANCE = 0.05
# Windows of 50 counter periods: the counter's quantisation is at most 2 % of a window.
COMPARISON_TOLERANCE_PCT = 2.5


def _run(preset: str, directory: Path) -> tuple[int, dict[str, Any], Path]:
    out = directory / "calibration.json"
    state_dir = directory / "state"
    lease_dir = directory / "leases"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--simulated",
            preset,
            "--out",
            str(out),
            "--state-dir",
            str(state_dir),
            "--lease-dir",
            str(lease_dir),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert out.exists(), proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    written = json.loads(out.read_text())
    assert printed == written
    return proc.returncode, written, directory


@pytest.fixture(scope="module")
def calibrations(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[int, dict[str, Any], Path]]:
    """One simulated calibration run per preset (each is a few seconds of work)."""
    return {p: _run(p, tmp_path_factory.mktemp(f"calibrate-{p}")) for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS)
def test_simulated_run_covers_every_phase(
    calibrations: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    status, result, _ = calibrations[preset]
    assert status == 0, result["problems"]
    assert result["problems"] == [] and result["skipped"] == {}
    for key in (
        "gpu",
        "mapping",
        "permissions",
        "counter",
        "power_readings",
        "idle_power_w",
        "limits",
        "clocks",
        "power_limit_sweep",
        "clock_sweep",
        "energy_optimal_clock_mhz",
        "setting_latency_s",
        "restore_checks",
        "controller_run",
        "simulated_comparison",
        "settings_restored",
    ):
        assert key in result, key
    assert result["format"] == "lightning-energy-calibration/1"
    assert result["backend"] == "simulated" and result["preset"] == preset
    assert result["permissions"]["can_change_settings"] is True
    # The simulated run spends its budget on the virtual clock: within 8 minutes there too.
    assert result["elapsed_s"] <= result["budget_s"] <= 480


@pytest.mark.parametrize("preset", PRESETS)
def test_counter_period_and_zero_deltas(
    calibrations: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, _ = calibrations[preset]
    expected_s = BOARDS[preset].energy_counter_period_s
    assert result["counter"]["period_s"] == pytest.approx(expected_s, rel=0.05)
    shares = list(result["counter"]["zero_delta_share"].values())
    assert list(result["counter"]["zero_delta_share"]) == ["5ms", "20ms", "50ms", "100ms", "500ms"]
    assert shares == sorted(shares, reverse=True)
    # A 5 ms window mostly reads nothing on a 100 ms counter; a 500 ms one never does.
    assert shares[0] > shares[2] > shares[4]
    assert shares[4] == 0.0


@pytest.mark.parametrize("preset", PRESETS)
def test_readings_sweeps_and_latency(
    calibrations: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, _ = calibrations[preset]
    model = SimulatedSpec(gpu=preset).model()
    readings = result["power_readings"]
    assert abs(readings["instant_vs_counter_pct"]) < COMPARISON_TOLERANCE_PCT
    assert result["idle_power_w"] == pytest.approx(model.idle_power_w, rel=0.03)
    limits = [r["power_limit_w"] for r in result["power_limit_sweep"]]
    assert limits == sorted(limits, reverse=True)
    assert limits[0] == model.max_power_limit_w and limits[-1] == model.min_power_limit_w
    clocks = [r["sm_clock_mhz"] for r in result["power_limit_sweep"]]
    assert clocks == sorted(clocks, reverse=True) and clocks[0] > clocks[-1]
    assert "sw_power_cap" in result["power_limit_sweep"][-1]["throttle_reasons"]
    for row in result["clock_sweep"]:
        assert row["clock_matches_lock"] is True
        assert row["sm_clock_mhz"] == row["locked_sm_clock_mhz"]
    best = min(result["clock_sweep"], key=lambda r: r["energy_per_step_j"])
    assert result["energy_optimal_clock_mhz"] == best["locked_sm_clock_mhz"]
    # The top and bottom of the sweep are not the optimum: lower clocks cost more again.
    assert best is not result["clock_sweep"][0] and best is not result["clock_sweep"][-1]
    latency = BOARDS[preset].setting_latency_s
    for value in result["setting_latency_s"].values():
        assert latency <= value <= latency + 0.02


@pytest.mark.parametrize("preset", PRESETS)
def test_restore_checks_and_every_setting_restored(
    calibrations: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, directory = calibrations[preset]
    checks = result["restore_checks"]
    assert set(checks) == {"exit", "sigterm", "sigkill"}
    pre_w = result["limits"]["pre_job_power_limit_w"]
    for check in checks.values():
        assert check["ok"] is True
        assert check["during"]["power_limit_w"] < pre_w and check["during"]["clock_locked"]
        assert check["after"] == {"power_limit_w": pre_w, "clock_locked": False}
        assert check["lock_released"] is True
    assert checks["exit"]["child_exit"] == 0
    assert checks["sigterm"]["child_exit"] == -15
    # The kill skipped the child's restore; recover put the settings back.
    assert checks["sigkill"]["left_by_kill"]["power_limit_w"] < pre_w
    assert checks["sigkill"]["recover_exit"] == 0
    assert result["settings_restored"] is True
    # Independently of what the script says: the GPU's state file and the leases.
    (state_file,) = (directory / "state").glob("*.json")
    state = json.loads(state_file.read_text())
    assert state["power_limit_w"] == pre_w and state["locked_clocks_mhz"] is None
    assert not list((directory / "leases").glob("*.json"))


@pytest.mark.parametrize("preset", PRESETS)
def test_controller_run_reads_no_zero_energy_window(
    calibrations: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, _ = calibrations[preset]
    run = result["controller_run"]
    assert run["profile_done"] is True
    assert run["zero_energy_windows"] == 0
    assert len(run["windows"]) == 2 and all(w["energy_per_step_j"] > 0 for w in run["windows"])
    assert run["power_limit_restored"] is True


@pytest.mark.parametrize("preset", PRESETS)
def test_comparison_with_the_same_preset_is_close(
    calibrations: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, _ = calibrations[preset]
    comparison = result["simulated_comparison"]
    assert comparison["preset"] == preset
    rows = len(result["power_limit_sweep"]) + len(result["clock_sweep"])
    assert len(comparison["rows"]) == rows
    for kind, error_pct in comparison["max_abs_error_pct"].items():
        assert error_pct < COMPARISON_TOLERANCE_PCT, kind


@pytest.mark.parametrize("preset", PRESETS)
def test_calibration_loads_back_as_a_preset_reproducing_it(
    calibrations: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, _, directory = calibrations[preset]
    config = EnergyConfig.from_mapping(
        {"device": {"backend": "simulated", "calibration": str(directory / "calibration.json")}}
    )
    spec = config.device.simulated_spec()
    board = spec.board()
    assert board.energy_counter_period_s == pytest.approx(
        BOARDS[preset].energy_counter_period_s, rel=0.05
    )
    assert board.instant_power is True
    (calibrated,) = simulated_gpus(spec)
    (source,) = simulated_gpus(SimulatedSpec(gpu=preset))
    assert calibrated.power_limit_constraints_w() == source.power_limit_constraints_w()
    assert calibrated.supported_sm_clocks_mhz() == source.supported_sm_clocks_mhz()
    lo, hi = source.power_limit_constraints_w()
    clocks = source.supported_sm_clocks_mhz()
    limits = [lo + (hi - lo) * k / 12 for k in range(13)]
    locks = [f for f in clocks[::7] if f >= 0.4 * clocks[0]]
    try:
        for settings in [(w, None) for w in limits] + [(hi, f) for f in locks]:
            measured = []
            for gpu in (source, calibrated):
                gpu.set_power_limit_w(settings[0])
                if settings[1] is None:
                    gpu.reset_locked_clocks()
                else:
                    gpu.set_locked_clocks_mhz(settings[1], settings[1])
                gpu.idle(1.0)  # past the setting latency
                duration_s = gpu.run_step()
                measured.append((duration_s, gpu.instant_power_w()))
            (t_src, p_src), (t_cal, p_cal) = measured
            assert t_cal == pytest.approx(t_src, rel=REPRODUCTION_TOLERANCE), settings
            assert p_cal == pytest.approx(p_src, rel=REPRODUCTION_TOLERANCE), settings
    finally:
        for gpu in (source, calibrated):
            gpu.set_power_limit_w(gpu.default_power_limit_w())
            gpu.reset_locked_clocks()


def test_without_cuda_no_gpu_phase_runs(
    load_benchmark: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    bench = load_benchmark("gpu/calibrate")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a real-GPU phase was attempted without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "CudaBench", refuse)
    monkeypatch.setattr(bench, "nvml_gpu_for_device", refuse)
    monkeypatch.setattr(bench, "nvml_gpus", refuse)
    out = tmp_path / "calibration.json"
    assert bench.main(["--out", str(out)]) == bench.EXIT_NO_GPU == 2
    captured = capsys.readouterr()
    assert "torch.cuda is not available" in captured.err and "--simulated" in captured.err
    assert captured.out == ""
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--budget-s", "900"], "--budget-s 900"),
        (["--budget-s", "0"], "--budget-s 0"),
        (["--limit-points", "1"], "--limit-points"),
    ],
)
def test_bad_arguments_are_named(
    load_benchmark: Callable[[str], ModuleType],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    expected: str,
) -> None:
    bench = load_benchmark("gpu/calibrate")
    assert bench.main(["--simulated", "a100", *argv]) == bench.EXIT_FAILED
    err = capsys.readouterr().err
    assert expected in err and "use" in err


def test_trace_gpu_without_clocks(tmp_path: Path) -> None:
    status, result, directory = _run("a40", tmp_path)
    assert status == 0, result["problems"]
    # No SM clocks on a trace GPU: the clock phases say so; the rest runs.
    assert result["skipped"] == {"clock_sweep": "the GPU reports no SM clocks"}
    assert result["clocks"]["supported_sm_clocks_mhz"] == []
    assert result["setting_latency_s"]["set_locked_clocks_s"] is None
    latency = BOARDS["a40"].setting_latency_s
    assert latency <= result["setting_latency_s"]["set_power_limit_s"] <= latency + 0.02
    for check in result["restore_checks"].values():
        assert check["ok"] is True and check["lock_released"] is None
    # Its limit sweep has no clock per row: it cannot stand for a simulated GPU.
    with pytest.raises(
        ConfigError, match=r"power_limit_sweep\[0\]\.sm_clock_mhz: null is not allowed"
    ):
        EnergyConfig.from_mapping(
            {"device": {"backend": "simulated", "calibration": str(directory / "calibration.json")}}
        )


def test_gpu_error_in_a_phase_and_a_short_budget(
    load_benchmark: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_benchmark("gpu/calibrate")

    def lost(run: Any) -> None:
        raise GPULostError("fell off the bus", gpu_index=0, operation="energy")

    monkeypatch.setattr(bench, "phase_counter", lost)
    out = tmp_path / "calibration.json"
    state_dir = tmp_path / "state"
    argv = ["--simulated", "a100", "--out", str(out), "--state-dir", str(state_dir)]
    # 40 s of the virtual clock: the readings and part of the limit sweep fit, not the rest.
    status = bench.main([*argv, "--budget-s", "40", "--lease-dir", str(tmp_path / "leases")])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert status == bench.EXIT_FAILED
    assert result["problems"] == ["counter: GPU 0: fell off the bus (during energy)"]
    assert result["skipped"]["counter"].startswith("stopped by a GPU error")
    for phase in ("clock_sweep", "setting_latency", "restore_checks", "controller_run"):
        assert result["skipped"][phase].startswith("budget: needs"), phase
    assert 1 <= len(result["power_limit_sweep"]) < 5
    assert result["elapsed_s"] <= 40
    assert result["settings_restored"] is True
    state = json.loads(next(state_dir.glob("*.json")).read_text())
    assert state["power_limit_w"] == 400.0 and state["locked_clocks_mhz"] is None
