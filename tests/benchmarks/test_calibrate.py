"""benchmarks/gpu/calibrate.py: read-only by default (on a simulated GPU, and on the NVML
backend over the in-memory pynvml as root, nothing is ever set), every read-only phase with
numbers, the settings phases of ``--change-settings``, interrupts, and the JSON loaded back
as a simulated preset."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lightning_energy.config import EnergyConfig
from lightning_energy.device import SimulatedSpec, simulated_gpus
from lightning_energy.device.mapping import TorchCuda
from lightning_energy.device.simulated import BOARDS, PHYSICS_PRESETS
from lightning_energy.errors import ConfigError, GPULostError
from tests.lightning_energy.device.fake_cuda import FakeCuda
from tests.lightning_energy.device.fake_pynvml import FakeDevice, FakeNVML, a100, make_module

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "calibrate.py"
PRESETS = ("a100", "h200")
READ_ONLY_PHASES = (
    "identity",
    "processes",
    "nvml_call_cost",
    "counter",
    "power_readings",
    "power_square_waves",
    "clock_behaviour",
    "workload_step",
    "controller_observe",
    "callback_overhead",
)
SETTINGS_PHASES = (
    "permissions",
    "power_limit_sweep",
    "clock_sweep",
    "setting_latency",
    "restore_checks",
    "controller_run",
    "simulated_comparison",
)
# What a GPU machine's stock Python lacks (and the package that would pull them in).
NOT_INSTALLED = ("carbon", "apscheduler", "sqlalchemy", "platformdirs", "jsonargparse", "psycopg")
# A calibrated preset reproduces its source within this much (time and power per step):
# the sweeps sample a handful of clocks, in between power is interpolated linearly, and a
# power limit near the boundary between two clocks may pick the neighbouring one.
REPRODUCTION_TOLERANCE = 0.05
# Windows of 50 counter periods: the counter's quantisation is at most 2 % of a window.
COMPARISON_TOLERANCE_PCT = 2.5

# Runs the script as a GPU machine would: the packages above unimportable, nothing on
# PYTHONPATH; reports what it tried to import and where lightning_energy came from.
_AS_ON_A_GPU_MACHINE = """
import importlib.abc, json, runpy, sys
missing = set(sys.argv[1].split(","))
tried = []
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in missing:
            tried.append(name)
            raise ImportError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, NotInstalled())
report, script = sys.argv[2], sys.argv[3]
sys.argv = sys.argv[3:]
code = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exc:
    code = exc.code
import lightning_energy
with open(report, "w") as f:
    json.dump({"tried": tried, "lightning_energy": lightning_energy.__file__}, f)
sys.exit(code)
"""


@pytest.fixture
def calibrate(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The script, imported as a module (``sys.path`` put back after the test)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("calibrate_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _phases(module: types.ModuleType, *names: str) -> tuple[Any, ...]:
    every = {p.name: p for p in (*module.READ_ONLY_PHASES, *module.SETTINGS_PHASES)}
    return tuple(every[n] for n in names)


@contextmanager
def _only(module: types.ModuleType, *names: str) -> Iterator[pytest.MonkeyPatch]:
    """Run only the phases ``names`` (the others are left out, not skipped); the patch
    yielded undoes what else it is given at the same time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            module,
            "READ_ONLY_PHASES",
            _phases(module, *[n for n in names if n in READ_ONLY_PHASES]),
        )
        patch.setattr(
            module, "SETTINGS_PHASES", _phases(module, *[n for n in names if n in SETTINGS_PHASES])
        )
        yield patch


def _state(directory: Path) -> dict[str, Any]:
    (state_file,) = directory.glob("*.json")
    return dict(json.loads(state_file.read_text()))


# --------------------------------------------------------------------------- read-only
@pytest.fixture(scope="module")
def read_only_h200(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    """``--simulated h200`` with default arguments, run as on a GPU machine."""
    directory = tmp_path_factory.mktemp("read-only")
    out, report = directory / "calibration.json", directory / "imports.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _AS_ON_A_GPU_MACHINE,
            ",".join(NOT_INSTALLED),
            str(report),
            str(SCRIPT),
            "--simulated",
            "h200",
            "--out",
            str(out),
            "--state-dir",
            str(directory / "state"),
            "--lease-dir",
            str(directory / "leases"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=directory,
        env=env,
    )
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    imports = json.loads(report.read_text())
    assert imports["tried"] == [], imports  # nothing it needs is missing on a GPU machine
    assert Path(imports["lightning_energy"]).is_relative_to(ROOT), imports
    return proc.returncode, result, directory


def test_read_only_run_measures_every_read_only_phase(
    read_only_h200: tuple[int, dict[str, Any], Path],
) -> None:
    status, result, _ = read_only_h200
    assert status == 0, result["problems"]
    assert result["mode"] == "read-only" and result["problems"] == [] and result["errors"] == {}
    for phase in READ_ONLY_PHASES:
        assert phase not in result["skipped"], (phase, result["skipped"].get(phase))
    # The settings phases are named, with the reason they did not run.
    assert set(result["skipped"]) == set(SETTINGS_PHASES)
    assert all("--change-settings" in why for why in result["skipped"].values())
    assert result["elapsed_s"] <= result["budget_s"] < 300


def test_read_only_run_sets_nothing(read_only_h200: tuple[int, dict[str, Any], Path]) -> None:
    _, result, directory = read_only_h200
    assert result["setter_calls_refused"] == []
    assert result["settings_unchanged"] is True
    assert result["controller_observe"]["settings_unchanged"] is True
    assert result["callback_overhead"]["settings_unchanged"] is True
    # Independently of the script: a simulated GPU writes its state file on its first
    # change only, and no lease outlived the run.
    assert not (directory / "state").exists() or not list((directory / "state").iterdir())
    assert not list((directory / "leases").glob("*.json"))


def test_read_only_numbers(read_only_h200: tuple[int, dict[str, Any], Path]) -> None:
    _, result, _ = read_only_h200
    model = SimulatedSpec(gpu="h200").model()
    t0_s, _ = model.step_work()
    assert result["mapping"]["uuid_match"] is None  # no CUDA device behind a simulated GPU
    assert result["processes"]["own_pid"] > 0 and result["processes"]["nvml_pids"] is None
    for name in ("energy", "power", "instant_power", "clock_event_reasons"):
        cost = result["nvml_call_cost"][name]["us"]
        assert cost["n"] == 1000 and 0 < cost["p50"] <= cost["p99"] <= cost["max"], name
    period_s = BOARDS["h200"].energy_counter_period_s
    for state in ("idle", "load"):
        counter = result["counter"][state]
        assert counter["period_s"] == pytest.approx(period_s, rel=0.05), state
        shares = list(counter["zero_delta_share"].values())
        assert shares == sorted(shares, reverse=True) and shares[0] > shares[2] > shares[4] == 0
    assert result["idle_power_w"] == pytest.approx(model.idle_power_w, rel=0.03)
    steady = result["power_readings"]
    assert abs(steady["instant_vs_counter_pct"]) < COMPARISON_TOLERANCE_PCT
    waves = result["power_square_waves"]
    assert list(waves) == ["50/50ms", "10/90ms"]
    for wave in waves.values():
        # The simulated counter integrates everything: between idle and full power, by duty.
        expected_w = wave["duty"] * steady["counter_w"] + (1 - wave["duty"]) * model.idle_power_w
        assert wave["counter_w"] == pytest.approx(expected_w, rel=0.03)
        assert wave["counter_integrates_all_time"] is True
        assert wave["instant_min_w"] == pytest.approx(model.idle_power_w)
    assert waves["10/90ms"]["counter_w"] < waves["50/50ms"]["counter_w"] < steady["counter_w"]
    clocks = result["clock_behaviour"]
    assert clocks["idle"]["reasons_share"] == {"gpu_idle": 1.0}
    assert clocks["load"]["sm_clock_mhz"]["p50"] == result["clocks"]["max_sm_clock_mhz"]
    step = result["workload_step"]
    assert step["time_per_step_s"] == pytest.approx(t0_s)
    assert step["power_limit_w"] == result["limits"]["pre_job_power_limit_w"]
    assert step["energy_per_step_j"] == pytest.approx(step["power_w"] * t0_s)
    observe = result["controller_observe"]
    assert observe["steps_with"] > 3 and observe["energy_j"] > 0
    assert observe["time_per_step_s"] == {"without": t0_s, "with": t0_s}
    assert observe["hooks_us_per_step"]["p50"] > 0
    callback = result["callback_overhead"]
    assert callback["steps_timed"] > 10 and callback["callback_energy_j"] > 0
    assert all(t > 0 for t in callback["time_per_step_s"].values())


def test_read_only_calibration_does_not_load_as_a_simulated_gpu(
    read_only_h200: tuple[int, dict[str, Any], Path],
) -> None:
    _, _, directory = read_only_h200
    with pytest.raises(ConfigError, match="--change-settings on a GPU you own"):
        EnergyConfig.from_mapping(
            {"device": {"backend": "simulated", "calibration": str(directory / "calibration.json")}}
        )


# --------------------------------------------------------------------------- NVML, as root
class FakeWorkload:
    """The workload on the in-memory pynvml's clock: the GPU draws ``busy_mw`` while it
    works (steps, steady load, a square wave's on-time) and ``idle_mw`` otherwise."""

    def __init__(self, nvml: FakeNVML, device: FakeDevice, step_s: float = 0.2) -> None:
        self.nvml, self.device, self.step_s = nvml, device, step_s
        self.busy_mw, self.idle_mw = 600_000.0, 90_000.0
        self.wave: tuple[float, float] | None = None
        self.wave_on, self.wave_left_s = True, 0.0
        self.busy = False
        device.draw_mw = self.idle_mw

    def now(self) -> float:
        return self.nvml.clock()

    def _run(self, seconds: float, busy: bool) -> None:
        self.device.draw_mw = self.busy_mw if busy else self.idle_mw
        self.nvml.advance(seconds)
        # What it draws from now on: the instantaneous power field reads it.
        working = self.busy and (self.wave is None or self.wave_on)
        self.device.draw_mw = self.busy_mw if working else self.idle_mw

    def wait(self, seconds: float) -> None:
        if not self.busy or self.wave is None:
            self._run(seconds, self.busy)
            return
        while seconds > 1e-12:  # the wave goes on where the last wait left it
            piece_s = min(seconds, self.wave_left_s)
            on = self.wave_on
            seconds -= piece_s
            self.wave_left_s -= piece_s
            if self.wave_left_s <= 1e-12:
                self.wave_on = not self.wave_on
                self.wave_left_s = self.wave[0] if self.wave_on else self.wave[1]
            self._run(piece_s, on)

    @contextmanager
    def loaded(self, wave: tuple[float, float] | None) -> Iterator[None]:
        self.busy, self.wave = True, wave
        self.wave_on, self.wave_left_s = True, wave[0] if wave else 0.0
        self.device.draw_mw = self.busy_mw
        try:
            yield
        finally:
            self.busy, self.wave = False, None
            self.device.draw_mw = self.idle_mw

    def step(self) -> None:
        self._run(self.step_s, True)

    def synchronize(self) -> None:
        """Steps complete as they run."""

    def torch_uuid(self) -> str:
        return TorchCuda().uuid(0)

    def lightning_target(self) -> tuple[str, list[int] | int]:
        return "cpu", 1

    def close(self) -> None:
        """Nothing held."""


@pytest.fixture
def nvml_h200(
    monkeypatch: pytest.MonkeyPatch, calibrate: types.ModuleType
) -> tuple[FakeNVML, FakeDevice]:
    """One H200 behind the in-memory pynvml and CUDA, as root (every setter would
    succeed), running :class:`FakeWorkload`."""
    device = a100(
        0,
        name="NVIDIA H200",
        min_limit_mw=200_000,
        max_limit_mw=700_000,
        default_limit_mw=700_000,
        limit_mw=700_000,
        energy_update_period_s=0.1,
        power_average_s=1.0,
        processes=[os.getpid()],
    )
    nvml = make_module([device])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    FakeCuda([device]).install(monkeypatch)
    monkeypatch.setattr(calibrate, "TransformerWorkload", lambda *args: FakeWorkload(nvml, device))
    return nvml, device


def test_read_only_nvml_run_as_root_calls_no_setter(
    calibrate: types.ModuleType,
    nvml_h200: tuple[FakeNVML, FakeDevice],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    nvml, device = nvml_h200
    out = tmp_path / "calibration.json"
    assert calibrate.main(["--out", str(out), "--lease-dir", str(tmp_path / "leases")]) == 0
    result = json.loads(out.read_text())
    assert result["problems"] == [] and result["backend"] == "nvml"
    assert nvml.calls == []  # no setter of the driver was ever called
    assert (device.limit_mw, device.locked) == (700_000, None)
    assert result["setter_calls_refused"] == [] and result["settings_unchanged"] is True
    for phase in READ_ONLY_PHASES:
        assert phase not in result["skipped"], phase
    assert result["mapping"]["uuid_match"] is True
    assert result["processes"]["own_pid_listed"] is True
    assert result["counter"]["load"]["period_s"] == pytest.approx(0.1, rel=0.05)
    waves = result["power_square_waves"]
    assert waves["10/90ms"]["counter_w"] == pytest.approx(0.1 * 600 + 0.9 * 90, rel=0.03)
    assert waves["50/50ms"]["counter_integrates_all_time"] is True
    assert result["workload_step"]["time_per_step_s"] == pytest.approx(0.2)
    assert result["workload_step"]["power_w"] == pytest.approx(600, rel=0.02)
    assert result["controller_observe"]["energy_j"] > 0
    assert sys.modules["pynvml"] is nvml  # the read-only view is gone after the run
    capsys.readouterr()


def test_a_setting_change_in_a_read_only_run_is_refused_and_reported(
    calibrate: types.ModuleType,
    nvml_h200: tuple[FakeNVML, FakeDevice],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    nvml, device = nvml_h200

    def meddle(run: Any) -> None:
        run.bench.gpu.set_power_limit_w(300.0)

    def meddle_with_nvml(run: Any) -> None:
        pynvml = importlib.import_module("pynvml")
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, 300_000)

    out = tmp_path / "calibration.json"
    with _only(calibrate, "identity", "processes") as patch:
        phases = calibrate.READ_ONLY_PHASES
        patch.setattr(
            calibrate,
            "READ_ONLY_PHASES",
            (
                *phases,
                dataclasses.replace(phases[0], name="meddle", run=meddle),
                dataclasses.replace(phases[0], name="meddle_with_nvml", run=meddle_with_nvml),
            ),
        )
        assert calibrate.main(["--out", str(out)]) == calibrate.EXIT_FAILED
    result = json.loads(out.read_text())
    assert nvml.calls == [] and device.limit_mw == 700_000
    assert result["setter_calls_refused"] == [
        "GPU.set_power_limit_w",
        "pynvml.nvmlDeviceSetPowerManagementLimit",
    ]
    assert any("refused" in p for p in result["problems"])
    assert "NoPermissionError" in result["skipped"]["meddle"]
    capsys.readouterr()


# Setters of NVML as nvml.h names them: power, clocks, persistence, MIG, reset and more.
_NVML_SETTERS = (
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetPowerManagementLimit_v2",
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetMemoryLockedClocks",
    "nvmlDeviceSetApplicationsClocks",
    "nvmlDeviceResetApplicationsClocks",
    "nvmlDeviceSetPersistenceMode",
    "nvmlDeviceSetMigMode",
    "nvmlDeviceCreateGpuInstance",
    "nvmlGpuInstanceDestroy",
    "nvmlDeviceSetComputeMode",
    "nvmlDeviceSetEccMode",
    "nvmlDeviceClearEccErrorCounts",
    "nvmlDeviceSetAutoBoostedClocksEnabled",
    "nvmlDeviceModifyDrainState",
    "nvmlDeviceRemoveGpu",
)


def test_the_read_only_nvml_view_refuses_every_nvml_function_but_readers(
    calibrate: types.ModuleType,
) -> None:
    from gpu_calibration.read_only import RefusedCalls, is_nvml_reader, read_only_nvml

    pynvml = pytest.importorskip("pynvml")
    functions = [n for n in dir(pynvml) if n.startswith("nvml") and callable(getattr(pynvml, n))]
    assert set(_NVML_SETTERS) <= set(functions)  # names as the installed pynvml has them
    refused = RefusedCalls()
    with read_only_nvml(refused) as guarded:
        view = importlib.import_module("pynvml")
        assert guarded and view is not pynvml
        for name in functions:
            if is_nvml_reader(name):
                assert getattr(view, name) is getattr(pynvml, name), name
                continue
            with pytest.raises(pynvml.NVMLError) as raised:
                getattr(view, name)(None, 0)
            assert raised.value.value == pynvml.NVML_ERROR_NO_PERMISSION, name
        assert view.NVML_ERROR_NO_PERMISSION == pynvml.NVML_ERROR_NO_PERMISSION
    assert importlib.import_module("pynvml") is pynvml
    assert {f"pynvml.{n}" for n in _NVML_SETTERS} <= set(refused.names)
    assert not any(is_nvml_reader(n) for n in _NVML_SETTERS)


def test_the_nvml_backend_reads_only_through_readers(calibrate: types.ModuleType) -> None:
    # Every NVML function the backend calls to read is one the read-only view passes on.
    from gpu_calibration.read_only import is_nvml_reader

    source = "".join(
        (ROOT / "lightning_energy" / "device" / name).read_text()
        for name in ("nvml.py", "mapping.py")
    )
    # Called as ``nvml.nvmlX(...)`` (``self._nvml.nvmlX``), or looked up by name.
    from_source = set(re.findall(r"nvml\.(nvml[A-Z]\w*)|\"(nvml[A-Z]\w*)\"", source))
    from_source = {a or b for a, b in from_source}
    setters = {
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
    }
    assert {n for n in from_source if not is_nvml_reader(n)} == setters


def test_clock_event_reasons_decode_every_bit_nvml_defines(calibrate: types.ModuleType) -> None:
    from gpu_calibration.run import reason_names

    pynvml = pytest.importorskip("pynvml")
    bits = {
        getattr(pynvml, n)
        for n in dir(pynvml)
        if re.fullmatch(r"nvmlClocks(Event|Throttle)Reason\w+", n)
        and isinstance(getattr(pynvml, n), int)
        and bin(getattr(pynvml, n)).count("1") == 1
    }
    assert {0x200, 0x400} <= bits  # board limit and reliability: the newest bits
    for bit in bits:
        names = reason_names(bit)
        assert names is not None and len(names) == 1, hex(bit)
        assert not names[0].startswith("0x"), hex(bit)
    assert reason_names(0x4 | 0x200 | 0x800) == ["sw_power_cap", "board_limit", "0x800"]


# --------------------------------------------------------------------------- settings
def _main_in_process(
    module: types.ModuleType, argv: list[str], *phases: str
) -> tuple[int, dict[str, Any]]:
    out = Path(argv[argv.index("--out") + 1])
    with _only(module, *phases) if phases else contextlib.nullcontext():
        status = module.main(argv)
    return status, json.loads(out.read_text())


@pytest.fixture(scope="module")
def changed(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[int, dict[str, Any], Path]]:
    """One ``--change-settings`` run per preset (without the Lightning fits, which the
    read-only run covers)."""
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "path", list(sys.path))
        spec = importlib.util.spec_from_file_location("calibrate_script_changed", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        phases = [p for p in (*READ_ONLY_PHASES, *SETTINGS_PHASES) if p != "callback_overhead"]
        for preset in PRESETS:
            directory = tmp_path_factory.mktemp(f"calibrate-{preset}")
            argv = [
                "--simulated",
                preset,
                "--change-settings",
                "--out",
                str(directory / "calibration.json"),
                "--state-dir",
                str(directory / "state"),
                "--lease-dir",
                str(directory / "leases"),
            ]
            status, result = _main_in_process(module, argv, *phases)
            runs[preset] = (status, result, directory)
    return runs


@pytest.mark.parametrize("preset", PRESETS)
def test_change_settings_run_covers_every_phase(
    changed: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    status, result, _ = changed[preset]
    assert status == 0, result["problems"]
    assert result["problems"] == [] and result["skipped"] == {}
    assert result["mode"] == "change-settings" and result["setter_calls_refused"] == []
    for key in (
        *[p for p in READ_ONLY_PHASES if p not in ("identity", "callback_overhead")],
        *[p for p in SETTINGS_PHASES if p != "setting_latency"],
        "gpu",
        "mapping",
        "limits",
        "clocks",
        "idle_power_w",
        "energy_optimal_clock_mhz",
        "setting_latency_s",
        "settings_restored",
    ):
        assert key in result, key
    assert result["format"] == "lightning-energy-calibration/1"
    assert result["backend"] == "simulated" and result["preset"] == preset
    assert result["permissions"]["can_change_settings"] is True
    assert result["elapsed_s"] <= result["budget_s"]


@pytest.mark.parametrize("preset", PRESETS)
def test_sweeps_and_latency_from_power(
    changed: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, _ = changed[preset]
    model = SimulatedSpec(gpu=preset).model()
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
    latency_s = BOARDS[preset].setting_latency_s
    measured = result["setting_latency_s"]
    assert measured["power_before_w"] > measured["cap_w"] == model.min_power_limit_w
    # A lock lands at once; under a far lower limit the board's governor walks the clock
    # down for a few control periods before the power settles.
    assert latency_s <= measured["set_locked_clocks_s"] <= latency_s + 0.02
    settle_s = 10 * PHYSICS_PRESETS[preset].governor.control_period_s
    assert latency_s <= measured["set_power_limit_s"] <= latency_s + settle_s


def test_power_limit_latency_ignores_clock_jitter(
    calibrate: types.ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from gpu_calibration import change
    from gpu_calibration.benches import SimulatedBench
    from gpu_calibration.read_only import RefusedCalls
    from gpu_calibration.run import Options, Run

    real = change.sample
    calls = [0]

    def jittery(gpu: Any) -> dict[str, Any]:
        # The SM clock reading dips a step and more every other time, as under load.
        reading = real(gpu)
        calls[0] += 1
        if reading["sm_clock_mhz"] is not None and calls[0] % 2 == 0:
            reading["sm_clock_mhz"] -= 30
        return reading

    monkeypatch.setattr(change, "sample", jittery)
    bench = SimulatedBench("a100", str(tmp_path / "state"), None)
    options = Options(change_settings=True, lease_dir=str(tmp_path / "leases"))
    run = Run(bench, options, 60.0, RefusedCalls())
    run.run_phase(_phases(calibrate, "identity")[0])
    try:
        change.permissions(run)
        change.setting_latency(run)
    finally:
        assert run.guard is not None
        run.guard.restore()
    latency_s = BOARDS["a100"].setting_latency_s
    settle_s = 10 * PHYSICS_PRESETS["a100"].governor.control_period_s  # the governor's walk
    assert latency_s <= run.result["setting_latency_s"]["set_power_limit_s"] <= latency_s + settle_s


@pytest.mark.parametrize("preset", PRESETS)
def test_restore_checks_and_every_setting_restored(
    changed: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, directory = changed[preset]
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
    state = _state(directory / "state")
    assert state["power_limit_w"] == pre_w and state["locked_clocks_mhz"] is None
    assert not list((directory / "leases").glob("*.json"))


@pytest.mark.parametrize("preset", PRESETS)
def test_controller_run_reads_no_zero_energy_window(
    changed: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, _ = changed[preset]
    run = result["controller_run"]
    assert run["profile_done"] is True
    assert run["zero_energy_windows"] == 0
    assert len(run["windows"]) == 2 and all(w["energy_per_step_j"] > 0 for w in run["windows"])
    assert run["power_limit_restored"] is True


@pytest.mark.parametrize("preset", PRESETS)
def test_comparison_with_the_same_preset_is_close(
    changed: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, result, _ = changed[preset]
    comparison = result["simulated_comparison"]
    assert comparison["preset"] == preset
    rows = len(result["power_limit_sweep"]) + len(result["clock_sweep"])
    assert len(comparison["rows"]) == rows
    for kind, error_pct in comparison["max_abs_error_pct"].items():
        assert error_pct < COMPARISON_TOLERANCE_PCT, kind


@pytest.mark.parametrize("preset", PRESETS)
def test_calibration_loads_back_as_a_preset_reproducing_it(
    changed: dict[str, tuple[int, dict[str, Any], Path]], preset: str
) -> None:
    _, _, directory = changed[preset]
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
                gpu.run_step(4)  # the source's governor walks its clock to the new setting
                duration_s = gpu.run_step()
                measured.append((duration_s, gpu.instant_power_w()))
            (t_src, p_src), (t_cal, p_cal) = measured
            assert t_cal == pytest.approx(t_src, rel=REPRODUCTION_TOLERANCE), settings
            assert p_cal == pytest.approx(p_src, rel=REPRODUCTION_TOLERANCE), settings
    finally:
        for gpu in (source, calibrated):
            gpu.set_power_limit_w(gpu.default_power_limit_w())
            gpu.reset_locked_clocks()


def test_trace_gpu_without_clocks(
    calibrate: types.ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--simulated",
        "a40",
        "--change-settings",
        "--out",
        str(tmp_path / "calibration.json"),
        "--state-dir",
        str(tmp_path / "state"),
    ]
    phases = ("identity", "counter", *SETTINGS_PHASES)
    status, result = _main_in_process(calibrate, argv, *phases)
    capsys.readouterr()
    assert status == 0, result["problems"]
    # No SM clocks on a trace GPU: the clock phases say so; the rest runs.
    assert result["skipped"] == {"clock_sweep": "the GPU reports no SM clocks"}
    assert result["clocks"]["supported_sm_clocks_mhz"] == []
    assert result["setting_latency_s"]["set_locked_clocks_s"] is None
    latency_s = BOARDS["a40"].setting_latency_s
    assert latency_s <= result["setting_latency_s"]["set_power_limit_s"] <= latency_s + 0.02
    for check in result["restore_checks"].values():
        assert check["ok"] is True and check["lock_released"] is None
    # Its limit sweep has no clock per row: it cannot stand for a simulated GPU.
    with pytest.raises(
        ConfigError, match=r"power_limit_sweep\[0\]\.sm_clock_mhz: null is not allowed"
    ):
        EnergyConfig.from_mapping(
            {"device": {"backend": "simulated", "calibration": str(tmp_path / "calibration.json")}}
        )


# --------------------------------------------------------------------------- interrupts
@pytest.mark.gpu_state_may_change  # recover, in this process, restores what the kill left
@pytest.mark.parametrize(
    ("nth_changed_read", "recovered"),
    [(1, []), (4, ["restored"])],
    ids=["while-a-child-holds-a-change", "after-a-sigkill-before-recover"],
)
def test_an_interrupted_restore_check_still_restores(
    calibrate: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    nth_changed_read: int,
    recovered: list[str],
) -> None:
    from gpu_calibration.benches import SimulatedBench

    real = SimulatedBench.fresh_settings
    changed_reads = [0]

    def interrupt_at_the_nth_changed_read(self: SimulatedBench) -> tuple[float, bool]:
        # The reads during restore checks: exit, sigterm and sigkill children holding
        # their change (1-3), then what the SIGKILL left (4), before recover runs.
        limit_w, locked = real(self)
        if limit_w != 400.0 or locked:
            changed_reads[0] += 1
            if changed_reads[0] == nth_changed_read:
                raise KeyboardInterrupt
        return limit_w, locked

    monkeypatch.setattr(SimulatedBench, "fresh_settings", interrupt_at_the_nth_changed_read)
    state = tmp_path / "state"
    argv = ["--simulated", "a100", "--change-settings", "--state-dir", str(state)]
    argv += ["--out", str(tmp_path / "calibration.json")]  # the lease directory is private
    status, result = _main_in_process(calibrate, argv, "identity", "permissions", "restore_checks")
    capsys.readouterr()
    assert status == calibrate.EXIT_INTERRUPTED
    assert result["interrupted"] == "SIGINT"
    assert result["skipped"]["restore_checks"] == "interrupted by SIGINT"
    assert [r["status"] for r in result["leases_recovered_at_exit"]] == recovered
    if nth_changed_read == 1:  # the child was asked to end, and restored on its own
        assert result["restore_checks"]["exit"]["child_exit"] == -signal.SIGTERM
    assert _state(state) == {
        "uuid": "GPU-sim-a100-0",
        "power_limit_w": 400.0,
        "locked_clocks_mhz": None,
    }


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_writes_the_partial_json_and_exits_130(
    calibrate: types.ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    signum: signal.Signals,
) -> None:
    def signalled(run: Any) -> None:
        os.kill(os.getpid(), signum)

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    out = tmp_path / "calibration.json"
    argv = ["--simulated", "h200", "--out", str(out), "--state-dir", str(tmp_path / "state")]
    with _only(calibrate, "identity", "processes", "counter", "clock_behaviour") as patch:
        phases = list(calibrate.READ_ONLY_PHASES)
        phases.insert(2, dataclasses.replace(phases[0], name="signalled", run=signalled))
        patch.setattr(calibrate, "READ_ONLY_PHASES", tuple(phases))
        status = calibrate.main(argv)
    assert status == calibrate.EXIT_INTERRUPTED == 130
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    name = signal.Signals(signum).name
    assert result["interrupted"] == name
    assert "gpu" in result and "processes" in result  # the phases before it
    for phase in ("signalled", "counter", "clock_behaviour"):
        assert result["skipped"][phase] == f"interrupted by {name}"
    assert {s: signal.getsignal(s) for s in handlers} == handlers


# --------------------------------------------------------------------------- the rest
def test_without_cuda_no_gpu_phase_runs(
    calibrate: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch
    from gpu_calibration import benches

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a real-GPU phase was attempted without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(calibrate, "TransformerWorkload", refuse)
    monkeypatch.setattr(benches, "nvml_gpu_for_device", refuse)
    out = tmp_path / "calibration.json"
    assert calibrate.main(["--out", str(out)]) == calibrate.EXIT_NO_GPU == 2
    captured = capsys.readouterr()
    assert "torch.cuda is not available" in captured.err and "--simulated" in captured.err
    result = json.loads(out.read_text())
    assert json.loads(captured.out) == result
    assert "torch.cuda is not available" in result["no_gpu"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--budget-s", "900"], "--budget-s 900"),
        (["--budget-s", "0"], "--budget-s 0"),
        (["--limit-points", "1"], "--limit-points"),
    ],
)
def test_bad_arguments_are_named(
    calibrate: types.ModuleType,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    expected: str,
) -> None:
    assert calibrate.main(["--simulated", "a100", *argv]) == calibrate.EXIT_FAILED
    err = capsys.readouterr().err
    assert expected in err and "use" in err


def test_a_failing_phase_and_a_short_budget(
    calibrate: types.ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def lost(run: Any) -> None:
        raise GPULostError("fell off the bus", gpu_index=0, operation="energy")

    out = tmp_path / "calibration.json"
    state_dir = tmp_path / "state"
    argv = ["--simulated", "a100", "--change-settings", "--out", str(out)]
    argv += ["--state-dir", str(state_dir), "--budget-s", "30"]
    phases = ("identity", "counter", "power_readings", "workload_step", *SETTINGS_PHASES)
    with _only(calibrate, *phases) as patch:
        patch.setattr(
            calibrate,
            "READ_ONLY_PHASES",
            tuple(
                dataclasses.replace(p, run=lost) if p.name == "counter" else p
                for p in calibrate.READ_ONLY_PHASES
            ),
        )
        status = calibrate.main(argv)
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert status == calibrate.EXIT_FAILED
    assert result["problems"] == ["counter: GPULostError: GPU 0: fell off the bus (during energy)"]
    assert result["skipped"]["counter"].startswith("failed: GPULostError")
    assert "fell off the bus" in result["errors"]["counter"]
    # 30 s of the virtual clock: the readings and part of the limit sweep fit, not the rest.
    assert "power_readings" in result and "workload_step" in result
    for phase in ("clock_sweep", "setting_latency", "restore_checks", "controller_run"):
        assert result["skipped"][phase].startswith("budget: "), phase
    assert 1 <= len(result["power_limit_sweep"]) < 5
    assert result["elapsed_s"] <= 30
    assert result["settings_restored"] is True
    assert _state(state_dir) == {
        "uuid": "GPU-sim-a100-0",
        "power_limit_w": 400.0,
        "locked_clocks_mhz": None,
    }


@pytest.mark.gpu
def test_read_only_run_on_a_real_gpu(tmp_path: Path) -> None:
    pynvml = pytest.importorskip("pynvml")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a real NVIDIA GPU with CUDA")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        limit_mw = pynvml.nvmlDeviceGetPowerManagementLimit(handle)
    finally:
        pynvml.nvmlShutdown()
    out = tmp_path / "calibration.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    result = json.loads(out.read_text())
    assert result["setter_calls_refused"] == [] and result["settings_unchanged"] is True
    for phase in READ_ONLY_PHASES:
        assert phase in result or phase in result["skipped"], phase
    assert result["limits"]["pre_job_power_limit_w"] == limit_mw / 1000
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
