"""benchmarks/gpu/check_nvml.py against the fake pynvml: reads, changes, always restores."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.lightning_energy.device.fake_pynvml import (
    ERROR_CODES,
    FakeDevice,
    FakeNVML,
    a100,
    make_module,
)

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "gpu" / "check_nvml.py"


@pytest.fixture(scope="module")
def check() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("check_nvml", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _install(monkeypatch: pytest.MonkeyPatch, devices: list[FakeDevice]) -> FakeNVML:
    fake = make_module(devices)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def _settings(device: FakeDevice) -> tuple[int, tuple[int, int] | None]:
    return device.limit_mw, device.locked


def test_sets_reads_back_and_restores(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _install(monkeypatch, [a100(0), a100(1, limit_mw=200_000)])
    assert check.main(["--energy-window-s", "0"]) == 0
    first, second = fake.devices
    assert fake.calls[:4] == [
        ("set_power_limit", first.uuid, 250_000),  # midpoint of 100-400 W, below 400 W
        ("set_locked_clocks", first.uuid, 1005, 1005),  # middle of 1410, 1395, 1005, 210
        ("set_power_limit", first.uuid, 400_000),
        ("reset_locked_clocks", first.uuid),
    ]
    # Already at or below the midpoint: halfway down to the minimum, never above the limit.
    assert fake.calls[4] == ("set_power_limit", second.uuid, 150_000)
    assert _settings(first) == (400_000, None)
    assert _settings(second) == (200_000, None)
    out = capsys.readouterr().out
    assert "GPU 0: NVIDIA A100-SXM4-40GB" in out
    assert "power_limit_w" in out and "250.0" in out and "1005-1005" in out
    assert out.count("  OK") == 2
    assert fake.init_calls == fake.shutdown_calls


def test_read_only_changes_nothing_and_prints_json(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _install(monkeypatch, [a100(0)])
    assert check.main(["--read-only", "--json", "--energy-window-s", "0"]) == 0
    assert fake.calls == []
    (report,) = json.loads(capsys.readouterr().out)
    assert report["skipped"] == "--read-only"
    assert report["values"]["power_limit_constraints_w"] == [100.0, 400.0]
    assert report["values"]["energy_j"] == 123.456
    assert report["values"]["power_w"] == 250.5


def test_refuses_a_gpu_others_are_using_unless_forced(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _install(monkeypatch, [a100(0, processes=[os.getpid(), 999_999])])
    assert check.main(["--energy-window-s", "0"]) == 0
    assert fake.calls == []
    assert "other processes are using it ([999999])" in capsys.readouterr().out
    assert check.main(["--force", "--energy-window-s", "0"]) == 0
    assert len(fake.calls) == 4
    assert _settings(fake.devices[0]) == (400_000, None)


def test_only_our_own_process_on_the_gpu_is_fine(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _install(monkeypatch, [a100(0, processes=[os.getpid()])])
    assert check.main(["--energy-window-s", "0"]) == 0
    assert len(fake.calls) == 4


def test_mig_gpus_are_only_read(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _install(monkeypatch, [a100(0, mig_mode=1)])
    assert check.main(["--energy-window-s", "0"]) == 0
    assert fake.calls == []
    assert "MIG: observe-only" in capsys.readouterr().out


def test_failure_midway_still_restores(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _install(
        monkeypatch,
        [a100(0, errors={"nvmlDeviceSetGpuLockedClocks": ERROR_CODES["NVML_ERROR_NO_PERMISSION"]})],
    )
    assert check.main(["--energy-window-s", "0"]) == 1
    assert [c[0] for c in fake.calls] == ["set_power_limit", "set_power_limit"]
    assert _settings(fake.devices[0]) == (400_000, None)
    out = capsys.readouterr().out
    assert "PROBLEM: changing settings" in out and "root or CAP_SYS_ADMIN" in out
    assert "FAILED" in out


def test_no_permission_at_all_is_reported_without_changes(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no = ERROR_CODES["NVML_ERROR_NO_PERMISSION"]
    fake = _install(monkeypatch, [a100(0, errors={"nvmlDeviceSetPowerManagementLimit": no})])
    assert check.main(["--energy-window-s", "0"]) == 1
    assert fake.calls == []
    assert "root or CAP_SYS_ADMIN" in capsys.readouterr().out


def test_sigterm_while_changed_restores_everything(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _install(monkeypatch, [a100(0), a100(1)])
    real_lock = fake.nvmlDeviceSetGpuLockedClocks

    def lock_then_get_killed(handle: FakeDevice, lo: int, hi: int) -> None:
        real_lock(handle, lo, hi)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(fake, "nvmlDeviceSetGpuLockedClocks", lock_then_get_killed)
    handler = signal.getsignal(signal.SIGTERM)
    assert check.main(["--energy-window-s", "0"]) == 130
    assert signal.getsignal(signal.SIGTERM) is handler
    first, second = fake.devices
    assert _settings(first) == (400_000, None)
    assert [c[0] for c in fake.calls] == [
        "set_power_limit",
        "set_locked_clocks",
        "set_power_limit",
        "reset_locked_clocks",
    ]
    assert _settings(second) == (400_000, None)  # the second GPU was never touched
    assert fake.init_calls == fake.shutdown_calls


def test_no_nvml_exits_with_a_clear_message(
    check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _install(monkeypatch, [a100(0)])
    fake.init_error = ERROR_CODES["NVML_ERROR_DRIVER_NOT_LOADED"]
    assert check.main([]) == 2
    assert "No NVIDIA GPU usable through NVML" in capsys.readouterr().err
    fake.init_error = None
    fake.devices.clear()
    assert check.main([]) == 2
    assert "NVML sees no GPU" in capsys.readouterr().err


def test_lower_power_limit_is_never_above_the_current_one(check: ModuleType) -> None:
    assert check.lower_power_limit_w(100.0, 400.0, 400.0) == 250.0
    assert check.lower_power_limit_w(100.0, 400.0, 250.0) == 175.0
    assert check.lower_power_limit_w(100.0, 400.0, 100.0) == 100.0
